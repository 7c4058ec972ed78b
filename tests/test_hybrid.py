"""Hybrid sharding (HSDP): the stage over the data axis, replicas over a
second mesh axis (`replica_axis=`), the batch split over both; gradients
all-reduced over the replicas once per step. And hpZ (`hpz=True`): the
state sharded over replica x data, gathered over the replicas once per
step into the data group's shard. Against plain optax on one device, and
in the compiled collectives."""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax._plan.hlo import count_collectives
from models import zopts
from models import (ScannedLM, assert_matches_reference, lm_batches,
                    lm_loss_fn, make_problem, reference_run, zero_run)

TX = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))
R, D = 2, 4


def _mesh(shape=(R, D), names=("replica", "data")):
  return jax.make_mesh(shape, names,
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))


@functools.lru_cache(maxsize=None)
def _problem():
  return make_problem("transformer")


def _state(stage, **fields):
  model, params, _, _ = _problem()
  return zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=stage, mesh=_mesh(),
      **zopts({"replica_axis": "replica", **fields}))


def _matches_plain_optax(stages, compute_dtype, check_state, **fields):
  """Trains each stage on the (2, 4) mesh with `fields`; losses, parameters
  and the first step's global gradient norm (replicas not counted twice)
  match plain optax on one device. `check_state(state)` before training."""
  _, params, loss_fn, batches = _problem()
  ref_losses, ref_params = reference_run(loss_fn, params, TX, batches,
                                         jax.numpy.dtype(compute_dtype))
  ref_norm = optax.tree.norm(jax.grad(
      lambda p: loss_fn(jax.tree_util.tree_map(
          lambda x: x.astype(compute_dtype), p), batches[0]).astype(
              np.float32))(params))
  step = zerojax.train_step(loss_fn)
  for stage in stages:
    state = _state(stage, compute_dtype=compute_dtype, accum_steps=2, **fields)
    check_state(state)
    losses, norms = [], []
    for b in batches:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
    assert_matches_reference(np.array(losses), zerojax.gather_params(state),
                             ref_losses, ref_params, compute_dtype)
    np.testing.assert_allclose(norms[0], ref_norm,
                               rtol=1e-5 if compute_dtype == "float32" else 2e-2)


@pytest.mark.slow
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_hybrid_matches_plain_optax_at_every_stage(compute_dtype):
  def check(state):
    assert state.num_shards == D and state.num_replicas == R
  _matches_plain_optax((0, 1, 2, 3), compute_dtype, check)


@pytest.mark.parametrize("stage,accum", [(0, 1), (1, 1), (2, 4), (3, 1), (3, 4)])
def test_hybrid_collectives_stay_in_their_groups(stage, accum):
  _, _, loss_fn, batches = _problem()
  state = _state(stage, accum_steps=accum)
  ops = count_collectives(zerojax.train_step(loss_fn).lower(
      state, batches[0]).compile()).ops
  for op in ops:
    if op.kind in ("all-gather", "reduce-scatter"):
      assert op.group_size == D, op
  # exactly one all-reduce over the replicas (groups of R) per step, all
  # chunks in it, whatever the number of micro-batches
  replica = [op for op in ops if op.kind == "all-reduce" and op.group_size == R]
  assert len(replica) == 1 and replica[0].trips == 1, replica
  # and the per-device bytes are the stage's over D devices
  one_d = zerojax.shard(train_state.TrainState.create(
      apply_fn=None, params=_problem()[1], tx=TX), stage=stage,
      mesh=_mesh((D,), ("data",)), accum_steps=accum)
  assert (zerojax.memory_report(state).measured ==
          zerojax.memory_report(one_d).measured)


@pytest.mark.slow
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_hpz_matches_plain_optax(compute_dtype):
  def check(state):
    # the state is in R * D pieces, data-major: device (r, d) holds piece
    # d * R + r, so a gather over the replicas gives the data group's shard
    assert state.num_state_shards == R * D
    momentum = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.size]
    assert momentum[0].sharding.spec[-1] == ("data", "replica")
  _matches_plain_optax((1, 2, 3), compute_dtype, check, hpz=True)


@pytest.mark.slow
def test_hpz_with_offload_matches_plain_optax():
  """Host shards come to the device for the replica gather."""
  def check(state):
    assert state.master[0].sharding.memory_kind == "pinned_host"
  _matches_plain_optax((3,), "float32", check, hpz=True, offload_params=True,
                       offload_optimizer=True)


@pytest.mark.slow
def test_hpz_gathers_over_the_replicas_once_then_within_data():
  """Stage 3 hpZ on a scanned LM gathered per layer: the secondary
  partition is one replica gather per chunk per step; the per-layer
  gathers of the forward and the rematerialised backward, and the per-layer
  reduce-scatters, stay within data; the state is the 1-D 8-device one's."""
  model = ScannedLM(layers=3, layerwise=True, scan=True)
  batches = lm_batches(model.vocab)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  loss_fn = lm_loss_fn(model)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  state = zerojax.shard(plain, stage=3, mesh=_mesh(), axes=zerojax.Axes(replica="replica", hpz=True), blocks=zerojax.Blocks(stacked=("blocks",)), accum_steps=2)
  ops = count_collectives(zerojax.train_step(loss_fn).lower(
      state, batches[0]).compile()).ops
  by = lambda kind, g: [op for op in ops if op.kind == kind and op.group_size == g]
  chunks = len(state.layout.chunks)
  assert len(by("all-gather", R)) == chunks
  assert all(op.trips == 1 for op in by("all-gather", R) + by("reduce-scatter", R))
  assert len(by("reduce-scatter", R)) == chunks
  # per layer, in the loops: forward and backward gathers, reduce-scatters
  assert sum(op.trips for op in by("all-gather", D) if op.in_loop) >= 2 * 3
  assert sum(op.trips for op in by("reduce-scatter", D) if op.in_loop) >= 3
  assert {op.group_size for op in ops if op.kind in (
      "all-gather", "reduce-scatter")} == {R, D}
  # nothing but scalars (the loss, a norm piece per chunk) is all-reduced
  assert all(op.bytes <= 4 * (chunks + 1)
             for op in ops if op.kind == "all-reduce"), ops
  one_d = zerojax.shard(plain, stage=3, mesh=_mesh((R * D,), ("data",)),
                        blocks=zerojax.Blocks(stacked=("blocks",)), accum_steps=2)
  report = zerojax.memory_report(state)
  assert report.measured == zerojax.memory_report(one_d).measured
  # the secondary partition: the compute-dtype chunks over D
  psi = state.layout.num_chunked_elements
  assert report.estimate["secondary"] == int(4 * psi / D)
  assert "hpZ secondary partition" in str(report)
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


def test_hpz_evaluates_as_one_axis():
  model, params, loss_fn, batches = _problem()
  state = _state(3, hpz=True)
  evaluate = zerojax.eval_step(lambda p, b: {"loss": loss_fn(p, b)})
  np.testing.assert_allclose(float(evaluate(state, batches[0])["loss"]),
                             float(loss_fn(params, batches[0])), rtol=1e-5)


def test_hybrid_bad_input():
  model, params, loss_fn, batches = _problem()
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  with pytest.raises(ValueError, match="no axis 'nodes'"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), axes=zerojax.Axes(replica="nodes"))
  with pytest.raises(ValueError, match="is the data axis itself"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), axes=zerojax.Axes(replica="data"))
  with pytest.raises(ValueError, match=r"Axes\(hpz=True\) shards the state "
                                       "over the replica axis too"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), axes=zerojax.Axes(hpz=True))
  with pytest.raises(ValueError, match=r"Axes\(hpz=True\) needs stage >= 1"):
    zerojax.shard(plain, stage=0, mesh=_mesh(), axes=zerojax.Axes(replica="replica", hpz=True))
  with pytest.raises(TypeError, match="Axes.hpz='yes' must be True or False"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), axes=zerojax.Axes(replica="replica", hpz="yes"))
  state = _state(3, accum_steps=2)
  with pytest.raises(ValueError, match="not divisible by 8 devices x "
                                       "accum_steps 2 = 16"):
    zerojax.train_step(loss_fn)(state, jax.tree_util.tree_map(
        lambda x: x[:8], batches[0]))
  # the state is intact
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  assert int(state.step) == 1


@pytest.mark.slow
@pytest.mark.parametrize("hpz", [False, True], ids=["hsdp", "hpz"])
def test_hybrid_checkpoint_restores_on_other_meshes(tmp_path, hpz):
  _, _, loss_fn, batches = _problem()
  step = zerojax.train_step(loss_fn)
  state = _state(3, hpz=hpz)
  for b in batches[:2]:
    state, _ = step(state, b)
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  expected = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))
  targets = [
      (dict(mesh=_mesh((8,), ("data",)), replica_axis=None), 8, 1),
      (dict(mesh=_mesh((4, 2)), replica_axis="replica"), 2, 4),
      (dict(mesh=jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                               axis_types=(jax.sharding.AxisType.Auto,)),
            replica_axis=None), 4, 1),
      (dict(mesh=_mesh(), replica_axis="replica", hpz=not hpz), 4, 2),
  ]
  for fields, shards, replicas in targets:
    restored = zerojax.checkpoint.restore(tmp_path, like=state, **zopts(fields))
    assert (restored.num_shards, restored.num_replicas) == (shards, replicas)
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           zerojax.gather_params(restored), expected)
    restored, metrics = step(restored, batches[2])
    assert np.isfinite(float(metrics["loss"]))


def test_estimate_memory_states_the_secondary_partition():
  psi = 1_000_000
  est = zerojax.estimate_memory(psi, stage=3, num_devices=R * D,
                                compute_dtype="bfloat16", accum_steps=2,
                                hpz_group=D)
  assert est["persistent"] == 12 * psi // (R * D)
  assert est["secondary"] == 2 * psi // D       # bf16 parameters over D
  assert est["accumulator"] == 4 * psi // D     # reduced within data first
  assert zerojax.estimate_memory(psi, stage=3, num_devices=D)["secondary"] == 0
  with pytest.raises(ValueError, match="hpz_group=3 must divide num_devices=8"):
    zerojax.estimate_memory(psi, stage=3, num_devices=8, hpz_group=3)
