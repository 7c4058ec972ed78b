"""shard() and gather_params(): what is stored where, bad input, subclasses."""
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import struct
from flax.training import train_state
from jax.sharding import AxisType, Mesh

import zerojax
from models import (assert_matches_reference, make_problem, reference_run,
                    zero_run)


def _state(kind="mlp", tx=None):
  model, params, loss_fn, batches = make_problem(kind)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx or optax.adam(1e-2))
  return state, loss_fn, batches


def _snapshot(state):
  return [np.array(x) for x in jax.tree_util.tree_leaves(state)]


@pytest.mark.parametrize("stage,dtype,master_split,compute", [
    (0, "float32", False, 0), (0, "bfloat16", False, 0),
    (1, "float32", False, 0), (1, "bfloat16", True, 1),
    (2, "float32", False, 0), (2, "bfloat16", True, 1),
    (3, "float32", True, 0), (3, "bfloat16", True, 0)])
def test_what_each_stage_stores(stage, dtype, master_split, compute):
  state, _, _ = _state()
  z = zerojax.shard(state, stage=stage, precision=dtype, chunk_size=256)
  n = 8
  for arr, chunk in zip(z.master, z.layout.chunks):
    local = arr.addressable_shards[0].data.shape[-1]
    assert local == (chunk.length // n if master_split else chunk.length)
    assert arr.dtype == jnp.float32
  assert len(z.compute) == compute * len(z.layout.chunks)
  for arr in z.compute:
    assert arr.dtype == jnp.bfloat16 and arr.sharding.is_fully_replicated
  for leaf in jax.tree_util.tree_leaves(z.opt_state):
    if leaf.ndim and leaf.size:   # the chunk views, not counters
      assert leaf.sharding.is_fully_replicated == (stage == 0)


@pytest.mark.slow
def test_gather_params_returns_the_original_tree():
  state, _, _ = _state("transformer")
  z = zerojax.shard(state, stage=3, chunk_size=1000)
  back = zerojax.gather_params(z)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, state.params)
  half = zerojax.gather_params(z, dtype=jnp.bfloat16)
  assert all(x.dtype == jnp.bfloat16 for x in jax.tree_util.tree_leaves(half))
  with pytest.raises(TypeError, match="ZeroTrainState"):
    zerojax.gather_params(state)


def test_gather_params_to_host_is_numpy_and_equal():
  state, _, _ = _state("mlp", tx=optax.sgd(0.1))
  z = zerojax.shard(state, stage=3, chunk_size=300)
  host = zerojax.gather_params(z, to="host")
  assert all(isinstance(x, np.ndarray) for x in jax.tree_util.tree_leaves(host))
  jax.tree_util.tree_map(np.testing.assert_array_equal, host, state.params)
  half = zerojax.gather_params(z, jnp.bfloat16, to="host")
  jax.tree_util.tree_map(
      lambda h, p: np.testing.assert_array_equal(h, p.astype(jnp.bfloat16)),
      half, state.params)
  with pytest.raises(ValueError, match=r"gather_params\(to='cpu'\): to is "
                     r"'device' .* or 'host'"):
    zerojax.gather_params(z, to="cpu")


def test_numpy_float64_parameters_are_held_as_jax_holds_them():
  # without x64, jax holds a float64 array as float32: so do the chunks
  params = {"w": np.ones((16, 8)), "b": np.zeros(8)}
  state = train_state.TrainState.create(apply_fn=None, params=params,
                                        tx=optax.adam(1e-3))
  z = zerojax.shard(state, stage=3)
  assert {c.dtype for c in z.layout.chunks} == {np.dtype(np.float32)}
  assert {x.dtype for x in z.master} == {np.dtype(np.float32)}


def test_host_parameters_reach_each_device_as_its_part_only(monkeypatch):
  """Stage 3 from numpy parameters (as a pretrained loader returns them)
  and from device arrays: the same state, bit for bit. Leaves this process
  holds whole are packed on the host and each device is sent its own shard
  (`reshard._host_packed`): no packing program is compiled for a split
  chunk. The programs that pack leaves held across processes constrain
  each leaf to its split (`meshes.leaf_spec`), so jax sends even a host
  leaf to them in parts: their compiled argument bytes per device are each
  leaf's part (whole only where no axis divides by the device count)."""
  from zerojax._core import reshard
  state, _, _ = _state("transformer", tx=optax.sgd(0.1))
  host = jax.tree_util.tree_map(np.asarray, state.params)
  programs = []
  real = reshard.pack_programs
  monkeypatch.setattr(reshard, "pack_programs", lambda *a, **k: (
      programs.append(a[1]), real(*a, **k))[1])
  z = zerojax.shard(state.replace(params=host), stage=3, chunk_size=4096)
  on_device = zerojax.shard(state, stage=3, chunk_size=4096)
  assert programs == [] and len(z.master) > 1
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(z), state.params)
  for a, b in zip(z.master, on_device.master):
    assert a.sharding == b.sharding
    np.testing.assert_array_equal(a, b)
  layout = z.layout
  leaves = dict(enumerate(layout.treedef.flatten_up_to(host)))
  split = 0
  for c, chunk in enumerate(layout.chunks):
    start, fills = real(layout, c, z.master[c].sharding, "data")
    shard = start({})
    for group, fill in fills:
      source = {i: leaves[i] for i in group}
      got = fill.lower(source, shard).compile().memory_analysis(
          ).argument_size_in_bytes - shard.addressable_shards[0].data.nbytes
      parts = [x.nbytes // 8 if any(d % 8 == 0 for d in x.shape) else x.nbytes
               for x in source.values()]
      split += sum(x.nbytes for x in source.values()) - sum(parts)
      assert got <= sum(parts), (c, group, got, parts)
  assert split > 0   # (some leaves were split)


def test_gather_params_traces_once_per_state_structure(monkeypatch):
  traced = []
  merge = zerojax._core.layout.ChunkLayout.merge

  def counting(self, *args, **kwargs):
    traced.append(1)
    return merge(self, *args, **kwargs)

  monkeypatch.setattr(zerojax._core.layout.ChunkLayout, "merge", counting)
  state, _, _ = _state("mlp", tx=optax.sgd(0.1))
  z = zerojax.shard(state, stage=3, chunk_size=300)
  traced.clear()   # (shard's optimizer probes unpack chunks too)
  for _ in range(3):
    zerojax.gather_params(z)
  zerojax.gather_params(z, dtype="bfloat16")
  zerojax.gather_params(z, dtype=jnp.bfloat16)   # the same dtype
  assert len(traced) == 2


@pytest.mark.slow
def test_one_device_shard_compiles_a_few_programs_not_one_per_leaf():
  """On one device each leaf is a chunk of its own; `shard` packs them (the
  master and Adam's two statistics) a group of chunks per program, not a
  program or two per chunk: 40 leaves of distinct shapes (no two programs
  alike) compile a handful of programs. The state holds the leaves."""
  params = {f"w{i:02d}": jnp.arange((i + 1) * 3, dtype=jnp.float32
                                    ).reshape(i + 1, 3) / 7 for i in range(40)}
  plain = train_state.TrainState.create(apply_fn=None, params=params,
                                        tx=optax.adam(1e-3))
  one = Mesh(np.array(jax.devices()[:1]), ("data",),
             axis_types=(AxisType.Auto,))
  # the optimizer probes answered first (they run eagerly, a small compile
  # per operation and shape, and `shard` asks them again from their
  # cache): what is counted is the placement
  zerojax.shard_shape(plain, mesh=one, stage=2)
  compiled = []
  listener = lambda event, seconds, **kw: (
      compiled.append(event) if event.endswith("backend_compile_duration")
      else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    state = zerojax.shard(plain, mesh=one, stage=2)
  finally:
    jax._src.monitoring.unregister_event_duration_listener(listener)
  assert len(state.layout.chunks) == 40
  assert 0 < len(compiled) <= 10, len(compiled)   # one or two per chunk: > 80
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state), params)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"stage": 4}, ValueError, "stage=4 is not a ZeRO stage"),
    ({"stage": -1}, ValueError, "stage=-1"),
    ({"chunk_size": 0}, ValueError, "chunk_size=0 must be positive"),
    ({"chunk_size": -5}, ValueError, "chunk_size=-5"),
    ({"accum_steps": 0}, ValueError, "accum_steps=0"),
    ({"precision": "int8"}, ValueError, "Precision.compute='int8'"),
    ({"clip_norm": 0.0}, ValueError, "clip_norm=0.0"),
    (lambda: {"precision": zerojax.Precision(loss_scale=-1.0)}, ValueError,
     "Precision.loss_scale=-1.0"),
    (lambda: {"precision": zerojax.Precision(loss_scale="big")}, TypeError,
     "Precision.loss_scale='big'"),
    ({"frozen": {"x": 1}}, TypeError, "frozen must be"),
    ({"chunk_sz": 10}, TypeError,
     r"unknown option\(s\) \['chunk_sz'\]; the options are stage, axes"),
    ({"compute_dtype": "bf16", "remat": "full"}, TypeError,
     r"compute_dtype= is now precision='bf16' .*; remat= is now "
     r"blocks=zerojax.Blocks\(remat=...\)"),
    ({"stage": 3.0}, TypeError, r"stage=3.0 must be an int"),
    ({"clip_norm": "1.0"}, TypeError, r"clip_norm='1.0' must be a number"),
    ({"offload": "gpu"}, ValueError, r"offload='gpu': use None, 'host'"),
    ({"axes": "data"}, TypeError, r"axes='data' must be a zerojax.Axes"),
    (lambda: {"offload": zerojax.Offload(fraction="half")}, TypeError,
     r"Offload.fraction='half' must be a number"),
    (lambda: {"precision": zerojax.Precision(skip_nonfinite="yes")},
     TypeError, r"Precision.skip_nonfinite='yes' must be True or False"),
    (lambda: {"blocks": zerojax.Blocks(prefetch="yes")}, TypeError,
     r"Blocks.prefetch='yes' must be True or False"),
    (lambda: {"blocks": zerojax.Blocks(reshard_after_forward=1)}, TypeError,
     r"Blocks.reshard_after_forward=1 must be True or False"),
    (lambda: {"blocks": zerojax.Blocks(remat="some")}, ValueError,
     r"Blocks\(remat='some'\): use 'none' \(activations kept\), 'casts'"),
    (lambda: {"blocks": zerojax.Blocks(stacked=("nonexistent",))}, ValueError,
     r"no submodule is named 'nonexistent'; the submodules are \['Dense_0'"),
])
def test_bad_config_raises_and_leaves_state_unchanged(kwargs, error, match):
  state, _, _ = _state()
  before = _snapshot(state)
  with pytest.raises(error, match=match):
    kwargs = dict(kwargs() if callable(kwargs) else kwargs)
    stage = kwargs.pop("stage", 3)
    zerojax.shard(state, stage=stage, **kwargs)
  for a, b in zip(before, _snapshot(state)):
    np.testing.assert_array_equal(a, b)


def test_mesh_without_the_axis():
  state, _, _ = _state()
  mesh = Mesh(np.array(jax.devices()), ("batch",), axis_types=(AxisType.Auto,))
  with pytest.raises(ValueError, match=r"no axis 'data'"):
    zerojax.shard(state, stage=1, mesh=mesh)
  z = zerojax.shard(state, stage=1, mesh=mesh, axes=zerojax.Axes(data="batch"))
  assert z.num_shards == 8
  assert z.mesh is mesh     # an Auto mesh is kept as it is


def test_an_explicit_mesh_is_copied_with_auto_axes_and_said_once(caplog):
  state, _, _ = _state()
  mesh = Mesh(np.array(jax.devices()), ("data",),
              axis_types=(AxisType.Explicit,))
  with caplog.at_level("WARNING", logger="zerojax"):
    z = zerojax.shard(state, stage=1, mesh=mesh)
    zerojax.shard(state, stage=3, mesh=mesh)
  said = [r.getMessage() for r in caplog.records if "Auto axes" in r.getMessage()]
  assert len(said) == 1 and "axis_types=(AxisType.Auto,)" in said[0]
  assert z.mesh is not mesh and z.mesh.axis_names == mesh.axis_names
  assert list(z.mesh.devices.flat) == list(mesh.devices.flat)
  assert all(t == AxisType.Auto for t in z.mesh.axis_types)


def test_already_sharded_and_not_a_train_state():
  state, _, _ = _state()
  z = zerojax.shard(state, stage=2)
  with pytest.raises(ValueError, match="already a ZeroTrainState"):
    zerojax.shard(z, stage=3)
  with pytest.raises(TypeError, match="has no .*params"):
    zerojax.shard({"params": 1}, stage=3)


def test_frozen_mask_must_match_params():
  state, _, _ = _state()
  with pytest.raises(ValueError, match="one bool per parameter leaf"):
    zerojax.shard(state, stage=3, frozen=lambda p: {"Dense_0": True})


def test_opt_state_of_another_tx_is_refused():
  state, _, _ = _state(tx=optax.adam(1e-2))
  state = state.replace(tx=optax.sgd(1e-2, momentum=0.9))
  with pytest.raises(ValueError, match="structure of tx.init"):
    zerojax.shard(state, stage=3)


class StateWithExtras(train_state.TrainState):
  ema: Any = None
  note: str = struct.field(pytree_node=False, default="")


def test_train_state_subclass_fields_are_kept():
  state, loss_fn, batches = _state()
  state = StateWithExtras.create(apply_fn=state.apply_fn, params=state.params,
                                 tx=state.tx, ema=jnp.arange(3.0), note="run-7")
  z = zerojax.shard(state, stage=3)
  z, _ = zerojax.train_step(loss_fn)(z, batches[0])
  np.testing.assert_array_equal(z.ema, np.arange(3.0))
  assert z.note == "run-7"
  with pytest.raises(AttributeError, match="gather_params"):
    z.params


class ConvNet(nn.Module):
  """A model this project did not design around: conv, group norm, pooling."""

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(8, (3, 3))(x)
    x = nn.GroupNorm(num_groups=4)(x)
    x = nn.avg_pool(nn.relu(x), (2, 2), strides=(2, 2))
    x = nn.Conv(4, (3, 3), use_bias=False)(x)
    return nn.Dense(3)(x.reshape(x.shape[0], -1))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_any_linen_model(stage):
  model = ConvNet()
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(16, 8, 8, 2)).astype(np.float32),
              "y": rng.integers(0, 3, 16).astype(np.int32)} for _ in range(4)]
  params = model.init(jax.random.key(0), batches[0]["x"][:1])["params"]

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["x"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, b["y"]).mean()

  tx = optax.adamw(1e-2)
  z = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=stage, chunk_size=200)
  z, losses = zero_run(z, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(z),
                           *reference_run(loss_fn, params, tx, batches))


def test_statistics_of_a_path_that_ends_another_go_with_their_own_chunk():
  """`['x']['a']['b']` ends with the path `['a']['b']` of another leaf: the
  optimizer state of each leaf's chunk is placed (here: host or device
  memory) by that chunk, not by the first path it ends with."""
  params = {"a": {"b": jnp.ones((8, 8))}, "x": {"a": {"b": jnp.ones((64, 64))}}}
  plain = train_state.TrainState.create(apply_fn=None, params=params,
                                        tx=optax.adam(1e-2))
  state = zerojax.shard_shape(plain, stage=3, chunk_size=64,
                              offload=zerojax.Offload(fraction=0.5))
  big, small = (np.prod(c.shape) for c in sorted(
      state.layout.chunks, key=lambda c: -np.prod(c.shape)))
  kinds = {(int(np.prod(x.shape)), x.sharding.memory_kind)
           for x in jax.tree_util.tree_leaves(state.opt_state) if x.size}
  # the larger chunk alone is half the bytes: its statistics offloaded
  assert kinds == {(big, "pinned_host"), (small, "device"), (1, "device")}


def test_a_state_with_every_leaf_frozen_shards():
  """No chunk owns a statistic: the frozen leaves' statistics are still
  recognised as theirs (not refused as per-tensor statistics)."""
  plain = train_state.TrainState.create(
      apply_fn=None, params={"a": jnp.ones((8, 8)), "b": jnp.ones(())},
      tx=optax.adam(1e-2))
  state = zerojax.shard_shape(plain, stage=3, frozen=lambda p: jax.tree_util.tree_map(
      lambda _: True, p))
  assert state.layout.chunks == () and len(state.rest) == 2
