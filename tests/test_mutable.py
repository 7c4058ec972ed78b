"""Mutable state in the loss (`train_step(mutable=...)`): BatchNorm's
`batch_stats` in a TrainState subclass, against a data-parallel reference
written the way Flax's ImageNet example writes its step (gradients and
`batch_stats` averaged over devices), with and without synchronised batch
norm, with and without gradient accumulation."""
from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax
from models import ResNet

STEPS = 5
# momentum SGD: linear in the gradients, so the comparison measures them
# (Adam magnified float noise where a gradient is near 0 past rtol 1e-5 with
# XLA's CPU backend at optimisation level 0, tests/conftest.py, on this
# stack: 9e-5 apart after 5 steps, stage 0 included)
TX = optax.sgd(0.1, momentum=0.9)


class TrainState(train_state.TrainState):
  batch_stats: Any


def _problem(axis_name):
  model = ResNet(axis_name=axis_name)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 8, 8, 3)).astype(np.float32),
              "y": rng.integers(0, 4, size=(32,)).astype(np.int32)}
             for _ in range(STEPS)]
  # init outside any mapped axis: the plain model (same parameters)
  variables = ResNet().init(jax.random.key(0), batches[0]["x"][:2])

  def loss_fn(params, batch, batch_stats):
    logits, updates = model.apply(
        {"params": params, "batch_stats": batch_stats}, batch["x"],
        mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["y"]).mean()
    return loss, updates

  return variables, loss_fn, batches


def _reference(variables, loss_fn, batches, accum):
  """Flax's data-parallel step, written out: each device takes its slice of
  the batch (in `accum` micro-batches, `batch_stats` carried from one to the
  next, averaged over devices after each), gradients averaged over devices;
  the update on replicated parameters."""
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  grad_fn = jax.grad(loss_fn, has_aux=True)

  def local(params, stats, batch):
    grads = jax.tree_util.tree_map(jnp.zeros_like, params)
    micro = jax.tree_util.tree_map(
        lambda x: x.reshape((accum, -1) + x.shape[1:]), batch)
    for i in range(accum):
      g, updates = grad_fn(params, jax.tree_util.tree_map(lambda x: x[i], micro),
                           stats)
      grads = jax.tree_util.tree_map(jnp.add, grads, g)
      stats = jax.lax.pmean(updates["batch_stats"], "data")
    grads = jax.lax.pmean(jax.tree_util.tree_map(lambda g: g / accum, grads),
                          "data")
    return grads, stats

  @jax.jit
  def step(params, opt_state, stats, batch):
    grads, stats = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                 out_specs=(P(), P()), check_vma=False)(
                                     params, stats, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, stats

  params, stats = variables["params"], variables["batch_stats"]
  opt_state = TX.init(params)
  for b in batches:
    params, opt_state, stats = step(params, opt_state, stats, b)
  return params, stats


@pytest.fixture(scope="module")
def problems():
  return {axis: _problem(axis) for axis in (None, "data")}


@pytest.mark.slow
@pytest.mark.parametrize("axis_name,accum", [(None, 1), ("data", 1),
                                             (None, 2), ("data", 2)])
def test_batch_norm_matches_data_parallel_flax_step(problems, axis_name, accum):
  variables, loss_fn, batches = problems[axis_name]
  ref_params, ref_stats = _reference(variables, loss_fn, batches, accum)
  step = zerojax.train_step(loss_fn, mutable=("batch_stats",))
  for stage in (0, 1, 2, 3):
    state = zerojax.shard(
        TrainState.create(apply_fn=None, params=variables["params"], tx=TX,
                          batch_stats=variables["batch_stats"]),
        stage=stage, accum_steps=accum)
    for b in batches:
      state, metrics = step(state, b)
    assert np.isfinite(float(metrics["loss"]))
    close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-6)
    jax.tree_util.tree_map(close, zerojax.gather_params(state), ref_params)
    jax.tree_util.tree_map(close, state.batch_stats, ref_stats)
    # the statistics moved: the test would notice updates being dropped
    moved = jax.tree_util.tree_map(
        lambda a, b: not np.allclose(a, b), state.batch_stats,
        variables["batch_stats"])
    assert all(jax.tree_util.tree_leaves(moved)), stage


class CountingState(train_state.TrainState):
  seen: Any


def _counting_problem():
  params = {"w": jnp.ones((4,), jnp.float32)}
  batch = {"x": np.ones((16, 4), np.float32)}
  state = zerojax.shard(CountingState.create(
      apply_fn=None, params=params, tx=optax.sgd(0.1),
      seen=jnp.zeros((), jnp.int32)), stage=3)
  return state, batch


def test_non_floating_updates_are_the_first_devices_on_every_device():
  state, batch = _counting_problem()

  def loss_fn(params, batch, seen):
    loss = (batch["x"] @ params["w"]).mean()
    # devices disagree on purpose: the first device's value must be kept
    return loss, {"seen": seen + 1 + jax.lax.axis_index("data")}

  step = zerojax.train_step(loss_fn, mutable=("seen",))
  for _ in range(3):
    state, _ = step(state, batch)
  values = {int(s.data) for s in state.seen.addressable_shards}
  assert values == {3}


def _loss_with(updates):
  def loss_fn(params, batch, seen):
    return (batch["x"] @ params["w"]).mean(), updates(seen)
  return loss_fn


@pytest.mark.parametrize("mutable,loss_fn,error,match", [
    (("missing",), _loss_with(lambda s: {}), ValueError, "no field 'missing'"),
    (("seen",), _loss_with(lambda s: {"seen": s, "other": s}), ValueError,
     r"updates for \['other'\], not declared"),
    (("seen",), _loss_with(lambda s: {"seen": jnp.zeros((2,), jnp.int32)}),
     ValueError, "does not match the state's 'seen'"),
    (("seen",), _loss_with(lambda s: [s]), TypeError, "must be a dict"),
    (("seen",), lambda p, b, seen: (b["x"] @ p["w"]).mean(), TypeError,
     r"must return \(loss, updates\)"),
    (7, _loss_with(lambda s: {}), TypeError, "tuple of field names"),
])
def test_bad_mutable_input_is_refused_and_the_state_is_kept(mutable, loss_fn,
                                                            error, match):
  state, batch = _counting_problem()
  with pytest.raises(error, match=match):
    zerojax.train_step(loss_fn, mutable=mutable)(state, batch)
  # nothing was donated: the same state trains with a correct loss
  good = zerojax.train_step(_loss_with(lambda s: {"seen": s + 1}),
                            mutable=("seen",))
  state, _ = good(state, batch)
  assert int(state.seen) == 1


def test_blocks_that_update_statistics_are_held_and_told_so(problems, caplog):
  """A block whose call updates `batch_stats` is not gathered per call (its
  re-gathered backward would not replay the update): held, said once."""
  zerojax._model.gather._SAID.clear()   # (said once a process)
  variables, loss_fn, batches = problems[None]
  state = zerojax.shard(
      TrainState.create(apply_fn=None, params=variables["params"], tx=TX,
                        batch_stats=variables["batch_stats"]), stage=3)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(loss_fn, mutable=("batch_stats",)).gathering(
        state, batches[0])
  assert modes["ResBlock_0"] == modes["ResBlock_1"] == "whole step"
  assert "'ResBlock_0', 'ResBlock_1' (2 modules) gathered for the whole " \
      "step: it updates 'batch_stats' in its call" in " ".join(
          r.getMessage() for r in caplog.records)
