"""`placement="auto"`: the first step places the optimizer state with
`plan_offload` for its own program and `device_budget`, results unchanged;
the shortfall when nothing fits; `memory_report` per chunk; checkpoints
planned again; bad input."""
import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from models import make_problem, zero_run

TX = optax.adam(1e-2)   # one object: zerojax probes each (tx, tree) once
CHUNK = 3000            # a dozen chunks: the planner has rungs to choose from
_problem = functools.lru_cache(maxsize=None)(make_problem)


def _plain():
  model, params, _, _ = _problem("transformer", steps=2)
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=TX)


def _params(state):
  return jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))


@pytest.mark.slow
def test_the_first_step_places_what_fits_and_trains_as_planned():
  _, _, loss_fn, batches = _problem("transformer", steps=2)
  # Full remat: with activations kept (remat="none") this model's
  # activations are twelve times its optimizer state, and the few kB
  # offloading saves are lost in how XLA schedules them (every rung then
  # needs more than the first); recomputed, the optimizer state is what an
  # offload rung moves.
  FULL = {"remat": "full"}
  abstract = zerojax.shard_shape(_plain(), stage=3, chunk_size=CHUNK, **FULL)
  # a budget just under the no-offload step's device bytes
  budget = zerojax.plan_offload(abstract, loss_fn, batches[0],
                                10 ** 9).device_bytes - 1
  plan = zerojax.plan_offload(abstract, loss_fn, batches[0], budget)
  assert 0 < plan.rung and plan.device_bytes <= budget
  state = zerojax.shard(_plain(), stage=3, chunk_size=CHUNK, **FULL,
                        placement="auto", device_budget=budget)
  # before its first step everything offloadable is on host
  assert {x.sharding.memory_kind for x in state.master} == {"pinned_host"}
  auto, auto_losses = zero_run(state, loss_fn, batches)
  assert auto.config.placement == "planned"
  assert {k: getattr(auto.config, k) for k in plan.config_fields} == (
      plan.config_fields)
  host = [c for c, x in enumerate(auto.master)
          if x.sharding.memory_kind == "pinned_host"]
  assert 0 < len(host) == plan.offloaded_chunks < len(auto.layout.chunks)
  report = zerojax.memory_report(auto)
  assert report.placement["host"] == host
  assert f"planned placement, device_budget={budget}" in str(report)
  manual, manual_losses = zero_run(zerojax.shard(
      _plain(), stage=3, chunk_size=CHUNK, **FULL), loss_fn, batches)
  np.testing.assert_array_equal(auto_losses, manual_losses)
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(auto),
                         _params(manual))


@pytest.mark.slow
def test_nothing_fits_names_the_shortfall_and_keeps_the_state():
  _, _, loss_fn, batches = _problem("transformer", steps=2)
  budget = 100_000   # below what any rung needs (about 350 kB)
  state = zerojax.shard(_plain(), stage=3, chunk_size=2 ** 20,   # 2 rungs
                        placement="auto", device_budget=budget)
  step = zerojax.train_step(loss_fn)
  with pytest.raises(ValueError, match=rf"device_budget={budget}: .* needs "
                     r"at least ([\d,]+) bytes .* over the budget"):
    step(state, batches[0])
  # untouched: still auto, and it trains once the budget allows
  assert state.config.placement == "auto"
  roomy = state.replace(config=state.config.__class__(
      **{**{f: getattr(state.config, f) for f in zerojax.config.FIELDS},
         "device_budget": 10 ** 9}))
  trained, metrics = step(roomy, batches[0])
  assert trained.config.placement == "planned" and np.isfinite(
      float(metrics["loss"]))


@pytest.mark.slow
def test_a_planned_checkpoint_is_planned_again(tmp_path):
  _, _, loss_fn, batches = _problem("transformer", steps=2)
  state, _ = zero_run(zerojax.shard(_plain(), stage=3, chunk_size=CHUNK,
                                    placement="auto", device_budget=10 ** 9),
                      loss_fn, batches[:1])
  assert not state.config.offload_optimizer   # all of it fits
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  again = zerojax.checkpoint.restore(tmp_path, like=_plain())
  assert again.config.placement == "auto"
  assert again.config.offload_optimizer   # on host until its first step
  manual = zerojax.checkpoint.restore(tmp_path, like=_plain(),
                                      placement="manual")
  assert manual.config.device_budget is None
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(again),
                         _params(state))


@pytest.mark.parametrize("fields,error,message", [
    (dict(placement="gemini"), ValueError, "placement='gemini' is not a placement"),
    (dict(placement="auto"), ValueError, "give device_budget="),
    (dict(device_budget=10 ** 9), ValueError, "read by placement='auto' only"),
    (dict(placement="auto", device_budget=-1), ValueError, "must be positive"),
    (dict(placement="auto", device_budget="1GB"), TypeError, "must be bytes"),
    (dict(placement="auto", device_budget=10 ** 9, stage=0), ValueError,
     "needs stage >= 1"),
])
def test_bad_placement_is_refused(fields, error, message):
  with pytest.raises(error, match=re.escape(message)):
    zerojax.ZeroConfig(**fields)


@pytest.mark.parametrize("fields,message", [
    (dict(offload_fraction=0.5), "sets offload_fraction itself"),
    (dict(device_budget=0.9), "cpu devices report none"),
])
def test_bad_auto_shard_is_refused(fields, message):
  fields = {"device_budget": 10 ** 9, **fields}
  with pytest.raises(ValueError, match=re.escape(message)):
    zerojax.shard(_plain(), stage=3, placement="auto", **fields)
