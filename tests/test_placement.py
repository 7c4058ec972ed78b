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
from models import zopts, assert_same_numbers, make_problem, zero_run

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
  abstract = zerojax.shard_shape(_plain(), stage=3, chunk_size=CHUNK, **zopts(FULL))
  # a budget just under the no-offload step's device bytes
  budget = zerojax.plan_offload(abstract, loss_fn, batches[0],
                                10 ** 9).device_bytes - 1
  plan = zerojax.plan_offload(abstract, loss_fn, batches[0], budget)
  assert 0 < plan.rung and plan.device_bytes <= budget
  state = zerojax.shard(_plain(), stage=3, chunk_size=CHUNK, **zopts(FULL),
                        offload="auto", device_budget=budget)
  # before its first step everything offloadable is on host
  assert {x.sharding.memory_kind for x in state.master} == {"pinned_host"}
  auto, auto_losses = zero_run(state, loss_fn, batches)
  assert auto.config.placement == "planned"
  assert {k: getattr(auto.config, k) for k in plan.fields} == (
      plan.fields)
  host = [c for c, x in enumerate(auto.master)
          if x.sharding.memory_kind == "pinned_host"]
  assert 0 < len(host) == plan.offloaded_chunks < len(auto.layout.chunks)
  report = zerojax.memory_report(auto)
  assert report.placement["host"] == host
  assert f"planned placement, device_budget={budget}" in str(report)
  manual, manual_losses = zero_run(zerojax.shard(
      _plain(), stage=3, chunk_size=CHUNK, **zopts(FULL)), loss_fn, batches)
  assert_same_numbers(auto_losses, manual_losses)
  jax.tree_util.tree_map(assert_same_numbers, _params(auto),
                         _params(manual))


@pytest.mark.slow
def test_nothing_fits_names_the_shortfall_and_keeps_the_state():
  _, _, loss_fn, batches = _problem("transformer", steps=2)
  budget = 100_000   # below what any rung needs (about 350 kB)
  state = zerojax.shard(_plain(), stage=3, chunk_size=2 ** 20,   # 2 rungs
                        offload="auto", device_budget=budget)
  step = zerojax.train_step(loss_fn)
  with pytest.raises(ValueError, match=rf"device_budget={budget}: .* needs "
                     r"at least ([\d,]+) bytes .* over the budget"):
    step(state, batches[0])
  # untouched: still auto, and it trains once the budget allows
  assert state.config.placement == "auto"
  roomy = state.replace(config=state.config.replace(device_budget=10 ** 9))
  trained, metrics = step(roomy, batches[0])
  assert trained.config.placement == "planned" and np.isfinite(
      float(metrics["loss"]))


@pytest.mark.slow
def test_a_planned_checkpoint_is_planned_again(tmp_path):
  _, _, loss_fn, batches = _problem("transformer", steps=2)
  state, _ = zero_run(zerojax.shard(_plain(), stage=3, chunk_size=CHUNK,
                                    offload="auto", device_budget=10 ** 9),
                      loss_fn, batches[:1])
  assert not state.config.offload_optimizer   # all of it fits
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  again = zerojax.checkpoint.restore(tmp_path, like=_plain())
  assert again.config.placement == "auto"
  assert again.config.offload_optimizer   # on host until its first step
  manual = zerojax.checkpoint.restore(tmp_path, like=_plain(), offload=None)
  assert manual.config.device_budget is None
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(again),
                         _params(state))


@pytest.mark.parametrize("options,error,message", [
    (lambda: dict(offload="gemini"), ValueError,
     "offload='gemini': use None, 'host', 'auto'"),
    (lambda: dict(offload="auto"), ValueError, "give device_budget="),
    (lambda: dict(device_budget=10 ** 9), ValueError,
     "read by offload='auto' (and stage='auto') only"),
    (lambda: dict(offload="auto", device_budget=-1), ValueError,
     "must be positive"),
    (lambda: dict(offload="auto", device_budget="1GB"), TypeError,
     "must be bytes"),
    (lambda: dict(offload="auto", device_budget=10 ** 9, stage=0), ValueError,
     "needs stage >= 1"),
    (lambda: dict(offload=zerojax.Offload("auto", fraction=0.5),
                  device_budget=10 ** 9), ValueError,
     "Offload('auto') plans what goes to host itself"),
])
def test_bad_placement_is_refused(options, error, message):
  with pytest.raises(error, match=re.escape(message)):
    zerojax.ZeroConfig(**options())


def test_a_budget_fraction_on_cpu_devices_is_refused():
  with pytest.raises(ValueError, match="cpu devices report none"):
    zerojax.shard(_plain(), stage=3, offload="auto", device_budget=0.9)
