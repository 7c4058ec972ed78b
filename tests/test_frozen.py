"""Frozen weights (`zerojax._core.frozen`): stored once in the compute dtype, split
over the data axis at stage 3 and gathered per block, with no gradient; the
training they give equals plain optax with the frozen leaves' updates
zeroed."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from flax.training import train_state
from jax.sharding import Mesh

import zerojax
from flax import nnx

from models import zopts
from models import (NnxResidualBlock, ScannedLM, assert_matches_reference,
                    lm_batches, lm_loss_fn, nnx_listed, nnx_scanned,
                    reference_run)

WIDTH, RANK, BLOCKS, ROWS = 256, 4, 4, 16


class LoraDense(nn.Module):
  """A frozen base kernel with a trained low-rank adapter beside it."""
  features: int

  @nn.compact
  def __call__(self, x):
    base = nn.Dense(self.features, use_bias=False, name="base")(x)
    a = nn.Dense(RANK, use_bias=False, name="lora_a")(x)
    # frozen too, but no dim divides over 8 devices: kept whole in the block
    gate = self.param("gate", nn.initializers.ones, (3,))
    return base * gate.mean() + nn.Dense(
        self.features, use_bias=False, name="lora_b",
        kernel_init=nn.initializers.normal(0.05))(a)


class Model(nn.Module):
  """Unrolled blocks, written as a user writes them (no zerojax in it)."""

  @nn.compact
  def __call__(self, x):
    for i in range(BLOCKS):
      x = x + jnp.tanh(LoraDense(WIDTH, name=f"block_{i}")(x))
      x = nn.LayerNorm(name=f"norm_{i}")(x)
    return x


def _is_frozen(params):
  flat = traverse_util.flatten_dict(params)
  return traverse_util.unflatten_dict(
      {k: k[-2] == "base" or k[-1] == "gate" or k[0].startswith("norm")
       for k in flat})


def _problem(steps=3):
  model = Model()
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(ROWS, WIDTH)).astype(np.float32),
              "y": rng.normal(size=(ROWS, WIDTH)).astype(np.float32)}
             for _ in range(steps)]
  params = model.init(jax.random.key(0), batches[0]["x"])["params"]

  def loss_fn(params, b):
    out = model.apply({"params": params}, b["x"])
    return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)
  return model, params, loss_fn, batches


def _frozen_bytes(params, dtype) -> int:
  flat = traverse_util.flatten_dict(params)
  mask = traverse_util.flatten_dict(_is_frozen(params))
  return sum(x.size * jnp.dtype(dtype).itemsize for k, x in flat.items()
             if mask[k])


def _sharded(stage, compute_dtype="float32", tx=None, **fields):
  model, params, loss_fn, batches = _problem()
  tx = optax.adam(1e-2) if tx is None else tx
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  return (zerojax.shard(state, stage=stage, frozen=_is_frozen,
                        **zopts({"compute_dtype": compute_dtype, **fields})),
          params, loss_fn, batches, tx)


def _hybrid(**fields):
  mesh = jax.make_mesh((2, 4), ("replica", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  return dict(mesh=mesh, replica_axis="replica", **fields)


@pytest.mark.parametrize("stage,fields", [
    (1, {}), (2, {}), (3, {}), (3, {"remat": "full", "accum_steps": 2}),
    (3, {"prefetch": True}), (3, {"offload_params": True}),
    (3, _hybrid()), (3, _hybrid(hpz=True))],
    ids=["1", "2", "3", "3-remat-accum", "3-prefetch", "3-offload",
         "3-hybrid", "3-hpz"])
def test_training_equals_optax_with_the_frozen_updates_zeroed(stage, fields):
  state, params, loss_fn, batches, tx = _sharded(stage, **fields)
  step = zerojax.train_step(loss_fn)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  labels = jax.tree_util.tree_map(lambda f: "frozen" if f else "train",
                                  _is_frozen(params))
  ref_tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                 labels)
  assert_matches_reference(np.array(losses), zerojax.gather_params(state),
                           *reference_run(loss_fn, params, ref_tx, batches))


@pytest.mark.parametrize("stage,compute_dtype", [
    (3, "float32"), (3, "bfloat16"), (2, "float32"), (2, "bfloat16")])
def test_frozen_weights_are_stored_once_in_the_compute_dtype(stage,
                                                             compute_dtype):
  """Per device: the frozen base in the compute dtype, split over the 8
  devices at stage 3, whole at stage 2; in the leaf's own dtype when it
  comes back."""
  state, params, _, _, _ = _sharded(stage, compute_dtype)
  whole = _frozen_bytes(params, compute_dtype)
  ideal = whole / 8 if stage == 3 else whole
  held = sum(zerojax._state.memory.per_device_bytes(x) for x in state.rest)
  assert ideal <= held <= 1.10 * ideal
  for x in state.rest:
    assert x.dtype == jnp.dtype(compute_dtype)
  back = zerojax.gather_params(state)
  jax.tree_util.tree_map(lambda a, b: np.testing.assert_array_equal(
      a, np.asarray(jnp.asarray(b, compute_dtype), np.float32)),
      back["block_0"]["base"], params["block_0"]["base"])
  assert back["block_0"]["base"]["kernel"].dtype == jnp.float32


def test_stage3_sends_and_computes_no_gradient_for_frozen_weights():
  """The compiled step: no dot yields a `[WIDTH, WIDTH]` result (a base
  kernel's gradient), the reduce-scatters carry the trained chunks only,
  and each block's base is gathered in its call (tied to the block's input,
  as its chunks are): the temporaries hold less than two blocks' bases."""
  state, params, loss_fn, batches, _ = _sharded(3)
  compiled = zerojax.train_step(loss_fn).lower(state, batches[0]).compile()
  text = compiled.as_text()
  dots = re.findall(r"= f32\[([\d,]+)\]\S* dot\(", text)
  assert dots and f"{WIDTH},{WIDTH}" not in dots
  scattered = sum(int(np.prod([int(d) for d in shape.split(",")]))
                  for shape in re.findall(
                      r"= f32\[([\d,]+)\]\S* reduce-scatter\(", text))
  trained = sum(c.length for c in state.layout.chunks) // 8
  assert 0 < scattered <= trained
  # the whole base is BLOCKS (4) kernels; two blocks' at most are alive
  kernel = WIDTH * WIDTH * 4
  assert zerojax.compiled_footprint(compiled)["temp"] < 2 * kernel


def test_frozen_weights_survive_a_checkpoint_on_another_device_count(tmp_path):
  state, params, loss_fn, batches, tx = _sharded(3, "bfloat16")
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  zerojax.checkpoint.save(str(tmp_path), state)
  zerojax.checkpoint.wait(str(tmp_path))
  saved = zerojax.gather_params(state)
  model = Model()
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  back = zerojax.checkpoint.restore(str(tmp_path), like=plain, mesh=mesh)
  assert back.config.stage == 3 and back.num_shards == 4
  assert all(x.dtype == jnp.bfloat16 for x in back.rest)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(back), saved)


def test_eval_step_reads_the_frozen_weights_gathered():
  state, params, loss_fn, batches, _ = _sharded(3, "bfloat16")
  model = Model()
  out = zerojax.eval_step(lambda p, b: model.apply({"params": p}, b["x"]))(
      state, batches[0])
  whole = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16),
                                 zerojax.gather_params(state))
  np.testing.assert_allclose(
      np.asarray(out, np.float32),
      np.asarray(model.apply({"params": whole}, batches[0]["x"]), np.float32),
      rtol=2e-2, atol=2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unrolled"])
def test_a_frozen_layer_stack_is_gathered_per_layer(scan):
  """`ScannedLM`'s block kernels frozen (its biases and norms trained): the
  frozen kernels of a scanned stack are split beside their layer axis and
  gathered per layer, of an unrolled loop per block; equal to optax."""
  model = ScannedLM(layers=3, width=64, vocab=128, layerwise=False,
                    scan=scan)
  batches = lm_batches(128, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"])["params"]
  mask = traverse_util.unflatten_dict({
      k: k[0].startswith("blocks") and k[-1] == "kernel"
      for k in traverse_util.flatten_dict(params)})
  # (not Adam: its normalisation turns float32 summation-order noise in a
  # near-zero embedding gradient into a full-size update)
  tx = optax.sgd(0.1, momentum=0.9)
  state = zerojax.shard(
      train_state.TrainState.create(apply_fn=model.apply, params=params,
                                    tx=tx),
      stage=3, frozen=mask, blocks=zerojax.Blocks(stacked=("blocks",) if scan else ()))
  loss_fn = lm_loss_fn(model)
  step = zerojax.train_step(loss_fn)
  modes = step.gathering(state, batches[0])
  assert ("per layer" if scan else "per block") in modes.values()
  split = [x for x in state.rest if x.ndim > 1]
  assert split and all("data" in x.sharding.spec for x in split)
  if scan:   # never on the layer axis: each layer is gathered alone
    assert all(x.sharding.spec[0] is None for x in split)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  labels = jax.tree_util.tree_map(lambda f: "frozen" if f else "train", mask)
  ref_tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                 labels)
  assert_matches_reference(np.array(losses), zerojax.gather_params(state),
                           *reference_run(loss_fn, params, ref_tx, batches))


@pytest.mark.parametrize("listed,devices", [(True, 8), (False, 8), (True, 3)],
                         ids=["listed", "scanned", "listed-whole"])
def test_nnx_frozen_weights_split_at_stage3_train_as_replicated(listed,
                                                               devices):
  """An NNX model as written (blocks in an `nnx.List`, or `nnx.scan` over
  `nnx.vmap`-made layers), its `up` kernels frozen: stage 3 (split, gathered
  per block or layer) trains as stage 1 (replicated) does. On 3 devices no
  dim of the frozen kernels divides: kept whole inside their blocks."""
  net = (nnx_listed if listed else nnx_scanned)(NnxResidualBlock, 3, 32)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(16, 32)).astype(np.float32),
              "y": rng.normal(size=(16, 4)).astype(np.float32)}
             for _ in range(3)]
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  mask = lambda p: jax.tree_util.tree_map_with_path(
      lambda path, _: "up" in jax.tree_util.keystr(path)
      and "kernel" in jax.tree_util.keystr(path), p)
  fields = {} if listed else {"stacked": ("blocks",)}
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",))
  rows = devices * (16 // devices)   # a whole number of rows per device
  batches = [{k: v[:rows] for k, v in b.items()} for b in batches]
  runs = []
  for stage in (1, 3):
    state = zerojax.shard(net(nnx.Rngs(0)), tx=optax.adam(1e-2), stage=stage,
                          frozen=mask, mesh=mesh, **zopts(fields))
    if stage == 3:
      assert any(x.ndim > 1 and "data" in x.sharding.spec
                 for x in state.rest) == (devices == 8)
    step = zerojax.train_step(loss_fn)
    losses = []
    for b in batches:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
    runs.append((np.array(losses), zerojax.gather_params(state)))
  np.testing.assert_allclose(runs[0][0], runs[1][0], rtol=1e-5)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
      runs[0][1], runs[1][1])


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_create_stores_frozen_weights_as_shard_does(compute_dtype):
  """`zerojax.create` (each shard built on its device) gives the frozen
  weights `shard`'s dtype, split and values."""
  model, params, _, batches, tx = _problem() + (optax.adam(1e-2),)
  made = zerojax.create(lambda r: model.init(r, batches[0]["x"])["params"],
                        jax.random.key(0), tx=tx, apply_fn=model.apply,
                        stage=3, frozen=_is_frozen,
                        precision=compute_dtype)
  state, *_ = _sharded(3, compute_dtype)
  assert len(made.rest) == len(state.rest)
  for a, b in zip(made.rest, state.rest):
    assert a.dtype == b.dtype and a.sharding == b.sharding
    np.testing.assert_array_equal(np.asarray(a, np.float32),
                                  np.asarray(b, np.float32))


def _dequantized(params, block=256):
  """`params` with every frozen matrix replaced by what int8 blocks of it
  give back (`zerojax._comm.quantize`'s encode; values times absmax / 127, a
  block's extremes its absmax)."""
  from zerojax._comm import quantize
  q = quantize.Quantization("int8", block)
  mask = _is_frozen(params)

  def one(x, frozen):
    if not frozen or np.ndim(x) < 2:
      return x
    values, absmax = quantize.encode(jnp.asarray(x), q)
    scale = np.asarray(absmax)[..., None]
    blocks = np.asarray(values, np.float32).reshape(scale.shape[:-1] + (-1,))
    out = np.where(np.abs(blocks) == 127, np.sign(blocks) * scale,
                   blocks * (scale * np.float32(1 / 127)))
    return out.reshape(values.shape)[..., :x.shape[-1]]
  return jax.tree_util.tree_map(one, params, mask)


@pytest.mark.parametrize("stage", [2, 3])
def test_int8_frozen_matrices_train_as_their_dequantized_values(stage):
  """`frozen_dtype="int8"`: the step reads each frozen matrix as its int8
  blocks dequantized, so training equals plain optax on the model whose
  frozen matrices are those values (fp32, rtol 1e-5); `gather_params`
  gives them back in float32. (Momentum, not Adam: XLA may compute the
  dequantization's division as a product, a last-bit difference that
  Adam's normalisation would blow up on a near-zero gradient.)"""
  state, params, loss_fn, batches, tx = _sharded(
      stage, tx=optax.sgd(0.1, momentum=0.9), frozen_dtype="int8")
  assert any(isinstance(x, tuple) and x[0].dtype == jnp.int8
             for x in state.rest)
  step = zerojax.train_step(loss_fn)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  base = _dequantized(params)
  labels = jax.tree_util.tree_map(lambda f: "frozen" if f else "train",
                                  _is_frozen(params))
  ref_tx = optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                 labels)
  assert_matches_reference(np.array(losses), zerojax.gather_params(state),
                           *reference_run(loss_fn, base, ref_tx, batches))


def test_int8_frozen_base_takes_about_half_the_bf16_bytes():
  bf16, params, *_ = _sharded(3, "bfloat16")
  int8, *_ = _sharded(3, "bfloat16", frozen_dtype="int8")
  held = lambda s: zerojax.memory_report(s).measured["frozen weights"][
      "device"]
  assert held(int8) <= 0.55 * held(bf16)
  report = zerojax.memory_report(int8)
  assert report.persistent == pytest.approx(report.estimate["persistent"],
                                            rel=0.02)


def test_int8_frozen_weights_restore_on_another_device_count(tmp_path):
  state, params, loss_fn, batches, tx = _sharded(3, frozen_dtype="int8")
  zerojax.checkpoint.save(str(tmp_path), state)
  zerojax.checkpoint.wait(str(tmp_path))
  plain = train_state.TrainState.create(apply_fn=Model().apply,
                                        params=params, tx=tx)
  mesh = Mesh(np.array(jax.devices()[:4]), ("data",))
  back = zerojax.checkpoint.restore(str(tmp_path), like=plain, mesh=mesh)
  assert back.config.frozen_dtype == "int8" and back.num_shards == 4
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(back),
                         zerojax.gather_params(state))
  # and into the compute dtype: the dequantized values, stored as they are
  plain16 = zerojax.checkpoint.restore(str(tmp_path), like=plain,
                                       frozen_dtype=None)
  assert all(not isinstance(x, tuple) for x in plain16.rest)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(plain16),
                         zerojax.gather_params(state))


@pytest.mark.parametrize("fields,message", [
    ({"frozen_dtype": "int4"}, "frozen_dtype='int4': use None"),
    ({"frozen_dtype": "int8", "frozen": None}, "but nothing is frozen"),
])
def test_frozen_dtype_is_checked_where_it_enters(fields, message):
  model, params, _, _ = _problem()
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  with pytest.raises(ValueError, match=re.escape(message)):
    zerojax.shard(state, stage=3, **zopts({"frozen": _is_frozen, **fields}))
