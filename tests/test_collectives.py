"""collectives.gather_leaves: the leaves and gradient of `gather` + a split,
bit for bit, and a stage-3 step that holds chunks gathered (no
`zerojax.nn.layerwise`) keeps no gathered chunk beside the leaves cut from
it."""
import re

import pytest

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import zerojax
from zerojax._comm import collectives
from zerojax._core import compat
from zerojax._core.layout import ChunkLayout
from models import zopts, ScannedLM, lm_loss_fn


def _mesh():
  return jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))


def test_gather_leaves_matches_gather_and_split_bit_for_bit():
  tree = {"a": jnp.zeros((3, 5)), "b": jnp.zeros((7,)), "c": jnp.zeros((2, 2))}
  layout = ChunkLayout.build(tree, 8, chunk_size=64)
  (chunk,) = layout.chunks
  assert chunk.padding and len(chunk.leaves) == 3   # a real cut
  shard = jax.device_put(jax.random.normal(jax.random.key(0), chunk.shape),
                         NamedSharding(_mesh(), P("data")))
  weights = [jax.random.normal(jax.random.key(i + 1), layout.leaves[i].shape)
             for i in chunk.leaves]

  def loss(cut):
    def local(s):
      leaves = cut(s)
      return sum(jnp.sum(jnp.sin(x) * w) for x, w in zip(leaves, weights))[None]
    return jax.shard_map(local, mesh=_mesh(), in_specs=P("data"),
                         out_specs=P("data"), check_vma=False)

  wire = collectives.Wire(jnp.float32, jnp.float32)
  new = lambda s: collectives.gather_leaves(layout, 0, s, "data", wire)
  old = lambda s: layout.unpack_chunk(0, collectives.gather(s, "data", wire))
  for f in (lambda cut: loss(cut), lambda cut: jax.grad(
      lambda s: loss(cut)(s).sum())):
    a, b = jax.jit(f(new))(shard), jax.jit(f(old))(shard)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _step_text(model, stage_fields):
  params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  state = zerojax.shard_shape(jax.eval_shape(lambda: state), stage=3,
                              mesh=_mesh(), **zopts(stage_fields))
  tok = jax.ShapeDtypeStruct((16, 32), jnp.int32)
  lowered = zerojax.train_step(lm_loss_fn(model)).lower(
      state, {"tokens": tok, "targets": tok})
  return lowered.compile(compat.compiler_options()), state.layout


@pytest.mark.slow
def test_held_chunks_are_not_kept_beside_their_leaves():
  # unrolled blocks held: every chunk gathered for the step
  model = ScannedLM(layers=3, scan=False, layerwise=False)
  compiled, layout = _step_text(model, {"chunk_size": 20000,
                                        "reshard_after_forward": False})
  cut = sum(len(c.leaves) > 1 or c.padding > 0 for c in layout.chunks)
  assert cut >= 3
  text = compiled.as_text()
  gathers = re.findall(r"%(all[-_]gather[\w.-]*) = \S+ all-gather\(", text)
  assert len(gathers) == len(layout.chunks)

  def users(name):
    """(name, opcode) of the instructions reading `name`."""
    shape = r"(?:\(.*?\)|\S+)"   # a tuple shape has spaces
    return re.findall(rf"%([\w.-]+) = {shape} ([\w-]+)\([^\n]*%"
                      rf"{re.escape(name)}[,)]", text)

  for name in gathers:
    # a cut chunk feeds only the conditional that writes its leaves (its
    # operand tuple); a one-leaf chunk is that leaf (bitcasts)
    for user, op in users(name):
      if op == "tuple":
        assert {o for _, o in users(user)} == {"conditional"}, (name, user)
      else:
        assert op in ("conditional", "bitcast"), (name, user, op)
  assert text.count(" conditional(") >= cut
