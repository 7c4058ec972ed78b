"""Hybrid sharding (HSDP): the stage over the data axis, replicas over a
second mesh axis (`replica_axis=`), the batch split over both; gradients
all-reduced over the replicas once per step. Against plain optax on one
device, and in the compiled collectives."""
from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from benchmarks.hlo import count_collectives
from models import assert_matches_reference, make_problem, reference_run

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
      replica_axis="replica", **fields)


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_hybrid_matches_plain_optax_at_every_stage(compute_dtype):
  _, params, loss_fn, batches = _problem()
  ref_losses, ref_params = reference_run(loss_fn, params, TX, batches,
                                         jax.numpy.dtype(compute_dtype))
  # the global gradient norm of the first step, from the plain gradient
  ref_norm = optax.tree.norm(jax.grad(
      lambda p: loss_fn(jax.tree_util.tree_map(
          lambda x: x.astype(compute_dtype), p), batches[0]).astype(
              np.float32))(params))
  step = zerojax.train_step(loss_fn)
  for stage in (0, 1, 2, 3):
    state = _state(stage, compute_dtype=compute_dtype, accum_steps=2)
    assert state.num_shards == D and state.num_replicas == R
    losses, norms = [], []
    for b in batches:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
    assert_matches_reference(np.array(losses), zerojax.gather_params(state),
                             ref_losses, ref_params, compute_dtype)
    # replicas are not counted twice
    np.testing.assert_allclose(norms[0], ref_norm,
                               rtol=1e-5 if compute_dtype == "float32" else 2e-2)


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


def test_hybrid_bad_input():
  model, params, loss_fn, batches = _problem()
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  with pytest.raises(ValueError, match="no axis 'nodes'"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), replica_axis="nodes")
  with pytest.raises(ValueError, match="is the data axis itself"):
    zerojax.shard(plain, stage=3, mesh=_mesh(), replica_axis="data")
  state = _state(3, accum_steps=2)
  with pytest.raises(ValueError, match="not divisible by 8 devices x "
                                       "accum_steps 2 = 16"):
    zerojax.train_step(loss_fn)(state, jax.tree_util.tree_map(
        lambda x: x[:8], batches[0]))
  # the state is intact
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  assert int(state.step) == 1


def test_hybrid_checkpoint_restores_on_other_meshes(tmp_path):
  _, _, loss_fn, batches = _problem()
  step = zerojax.train_step(loss_fn)
  state = _state(3)
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
  ]
  for fields, shards, replicas in targets:
    restored = zerojax.checkpoint.restore(tmp_path, like=state, **fields)
    assert (restored.num_shards, restored.num_replicas) == (shards, replicas)
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           zerojax.gather_params(restored), expected)
    restored, metrics = step(restored, batches[2])
    assert np.isfinite(float(metrics["loss"]))
