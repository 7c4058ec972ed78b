"""A checkpoint round trip for every mode `shard` accepts (issue 61): saved
under one configuration, restored under the same on the same mesh and on
another device count, and into a larger tree (one new head) where the saved
configuration is kept. Every restored value is bit-equal to the saved one."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh

import zerojax
from models import MLP, TPTransformer, lm_batches, lm_loss_fn, make_problem


def _mesh(shape, names):
  n = int(np.prod(shape))
  return Mesh(np.array(jax.devices()[:n]).reshape(shape), names)


def _freeze_first(params):
  return {k: jax.tree_util.tree_map(lambda _: k == "Dense_0", v)
          for k, v in params.items()}


class Net(nnx.Module):
  def __init__(self, rngs, head=False):
    self.a = nnx.Linear(8, 24, rngs=rngs)
    self.b = nnx.Linear(24, 4, rngs=rngs)
    if head:
      self.head = nnx.Linear(4, 2, rngs=rngs)

  def __call__(self, x):
    return self.b(nnx.relu(self.a(x)))


def _nnx_loss(model, b):
  return jnp.mean((model(b["x"]) - b["y"]) ** 2)


# name: (options for shard, mesh as saved, mesh restored on another count)
MODES = {
    "stage1": (dict(stage=1), ((8,), ("data",)), ((4,), ("data",))),
    "stage3-quantized": (dict(stage=3, quantize="int8"),
                         ((8,), ("data",)), ((4,), ("data",))),
    "stage2-quantized-grads": (dict(stage=2, quantize=zerojax.Quantize(
        grads="int8")), ((8,), ("data",)), ((2,), ("data",))),
    "stage3-frozen": (dict(stage=3, frozen=_freeze_first),
                      ((8,), ("data",)), ((4,), ("data",))),
    "stage2-frozen-int8-bf16-offload-accum": (dict(
        stage=2, frozen=_freeze_first, frozen_dtype="int8", precision="bf16",
        offload="host", accum_steps=2), ((8,), ("data",)), ((4,), ("data",))),
    "stage3-offload-params": (dict(stage=3, offload=zerojax.Offload(
        params=True)), ((8,), ("data",)), ((4,), ("data",))),
    "stage3-hsdp": (dict(stage=3, axes=zerojax.Axes(replica="replica")),
                    ((2, 4), ("replica", "data")),
                    ((2, 2), ("replica", "data"))),
}


def _plain(head=False):
  model, params, loss_fn, batches = make_problem("mlp", batch=16, steps=2)
  if head:
    params = {**params, "head": {"kernel": jnp.full((4, 2), 0.25)}}
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-2))
  loss = loss_fn if not head else (lambda p, b: loss_fn(
      {k: v for k, v in p.items() if k != "head"}, b))
  return plain, loss, batches


def _exported(state):
  return jax.tree_util.tree_map(np.asarray, zerojax.checkpoint.export_params(
      state, with_opt_state=True))


def _same(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def _fields(state, *drop):
  return {k: v for k, v in state.config.fields().items()
          if k not in ("frozen",) + drop}


def _trained(options, mesh, tmp_path):
  plain, loss_fn, batches = _plain()
  state = zerojax.shard(plain, mesh=_mesh(*mesh), **options)
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, wait=True)
  return state, directory


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_restores_bit_equal_and_keeps_its_config(mode, tmp_path):
  options, saved_mesh, other_mesh = MODES[mode]
  state, directory = _trained(options, saved_mesh, tmp_path)
  want = _exported(state)
  # the directory exports without a mesh (zero_to_fp32), bit-equal too
  _same(zerojax.checkpoint.export_params(directory), want[0])
  plain, _, _ = _plain()
  same = zerojax.checkpoint.restore(directory, like=plain,
                                    mesh=_mesh(*saved_mesh))
  assert _fields(same) == _fields(state)
  _same(_exported(same), want)
  other = zerojax.checkpoint.restore(directory, like=plain,
                                     mesh=_mesh(*other_mesh))
  assert other.num_shards < state.num_shards
  assert _fields(other) == _fields(state)
  _same(_exported(other), want)
  # a larger tree: the shared leaves bit-equal, the saved config kept
  # (the frozen leaves included), the new head trainable with like's value
  larger, loss_fn, batches = _plain(head=True)
  grown = zerojax.checkpoint.restore(directory, like=larger,
                                     mesh=_mesh(*saved_mesh))
  assert _fields(grown) == _fields(state)
  got = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(grown))
  np.testing.assert_array_equal(got.pop("head")["kernel"], np.full((4, 2),
                                                                   0.25))
  _same(got, want[0])
  if "frozen" in options:
    assert zerojax.memory_report(grown).measured["frozen weights"]["device"] > 0
    before = got["Dense_0"]
    grown, _ = zerojax.train_step(loss_fn)(grown, batches[0])
    after = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(grown))
    _same(after["Dense_0"], before)   # still frozen after a step


def test_disk_tier_restores_bit_equal(tmp_path):
  for name in ("swap", "swap8", "swap4"):
    (tmp_path / name).mkdir()
  options = dict(stage=3, offload=zerojax.Offload(tier="disk",
                                                  dir=str(tmp_path / "swap")))
  state, directory = _trained(options, ((8,), ("data",)), tmp_path)
  want = _exported(state)
  plain, _, _ = _plain()
  for n in (8, 4):
    back = zerojax.checkpoint.restore(
        directory, like=plain, mesh=_mesh((n,), ("data",)),
        offload=zerojax.Offload(tier="disk", dir=str(tmp_path / f"swap{n}")))
    assert back.config.offload_optimizer == "disk" and back.num_shards == n
    _same(_exported(back), want)


def test_tensor_parallel_restores_bit_equal(tmp_path):
  model = TPTransformer(layerwise=True)
  batches = lm_batches(model.vocab, batch=8, seq=8, steps=1)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-2))
  axes = zerojax.Axes(model="model")
  state = zerojax.shard(plain, stage=3, mesh=_mesh((4, 2), ("data", "model")),
                        axes=axes)
  state, _ = zerojax.train_step(lm_loss_fn(model))(state, batches[0])
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, wait=True)
  want = _exported(state)
  for shape in ((4, 2), (2, 2)):
    back = zerojax.checkpoint.restore(directory, like=plain,
                                      mesh=_mesh(shape, ("data", "model")))
    assert back.config.model_axis == "model"
    _same(_exported(back), want)


def test_nnx_restores_bit_equal_and_into_a_larger_model(tmp_path):
  _, _, _, batches = make_problem("mlp", batch=16, steps=1)
  tx = optax.adamw(1e-2)
  state = zerojax.shard(Net(nnx.Rngs(0)), tx=tx, stage=3, precision="bf16")
  state, _ = zerojax.train_step(_nnx_loss)(state, batches[0])
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, wait=True)
  want = _exported(state)
  for n in (8, 4):
    back = zerojax.checkpoint.restore(directory, like=Net(nnx.Rngs(1)), tx=tx,
                                      mesh=_mesh((n,), ("data",)))
    assert _fields(back) == _fields(state)
    _same(_exported(back), want)
  grown = zerojax.checkpoint.restore(directory, like=Net(nnx.Rngs(1),
                                                         head=True), tx=tx)
  assert _fields(grown) == _fields(state)
  got = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(grown))
  got.pop("head")
  _same(got, want[0])


def test_restore_messages_name_what_came_from_the_checkpoint(tmp_path):
  """An offloaded checkpoint restored at a stage that cannot hold its
  offload names the checkpoint and offload=None (was: "offload needs stage
  >= 1"); frozen=None of an int8 frozen checkpoint trains every leaf (was:
  "drop frozen_dtype", a value the caller never passed)."""
  _, directory = _trained(dict(stage=3, offload=zerojax.Offload(params=True)),
                          ((8,), ("data",)), tmp_path)
  plain, _, _ = _plain()
  for stage in (0, 2):
    with pytest.raises(ValueError, match=rf"the checkpoint was saved with "
                       rf"Offload\(params=True\), which stage {stage} cannot "
                       r"hold.*pass offload=None"):
      zerojax.checkpoint.restore(directory, like=plain, stage=stage)
  back = zerojax.checkpoint.restore(directory, like=plain, stage=0,
                                    offload=None)
  assert back.config.stage == 0 and not back.config.offload_params
  (tmp_path / "int8").mkdir()
  _, frozen_dir = _trained(dict(stage=3, frozen=_freeze_first,
                                frozen_dtype="int8"), ((8,), ("data",)),
                           tmp_path / "int8")
  thawed = zerojax.checkpoint.restore(frozen_dir, like=plain, frozen=None)
  assert thawed.config.frozen is None and thawed.config.frozen_dtype is None
