"""The offload budget planner: least offload that fits, checked against real
sharded states compiled here; impossible budgets; bad input."""

import contextlib

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax._core import compat
from zerojax._state.state import state_shardings
from models import make_problem

CHUNK = 64          # the MLP's five leaves in five chunks of distinct sizes
OPTIONS = compat.compiler_options()   # analysed, never run: faster compiles


@pytest.fixture(scope="module")
def problem():
  model, params, loss_fn, batches = make_problem("mlp", steps=1)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3))
  return plain, loss_fn, batches[0]


def _abstract(plain, stage=3):
  """The sharded state as ShapeDtypeStructs: nothing allocated."""
  return zerojax.shard_shape(plain, stage=stage, chunk_size=CHUNK)


@pytest.fixture(scope="module")
def abstract(problem):
  return _abstract(problem[0])


@pytest.fixture(scope="module")
def base(problem):
  return zerojax.shard(problem[0], stage=3, chunk_size=CHUNK)


def _device_bytes(base, loss_fn, batch, **fields):
  """Device bytes of the step of a real state placed with offload `fields`,
  and the per-device bytes of its arrays that are in pinned_host memory."""
  state = base.replace(config=base.config.replace(**fields))
  state = jax.device_put(state, state_shardings(state))
  compiled = zerojax.train_step(loss_fn).lower(state, batch).compile(OPTIONS)
  host = sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree_util.tree_leaves(state)
             if x.sharding.memory_kind == "pinned_host")
  footprint = zerojax.compiled_footprint(compiled)
  # the host split read from the compiled program agrees with the arrays
  assert footprint["host_argument"] == footprint["host_output"] == host
  return footprint["device"], host


@pytest.fixture(scope="module")
def bounds(problem, base):
  _, loss_fn, batch = problem
  none, _ = _device_bytes(base, loss_fn, batch)
  full, host = _device_bytes(base, loss_fn, batch, offload_optimizer=True)
  sizes = sorted((int(np.prod(c.shape)) * 4 for c in base.layout.chunks),
                 reverse=True)
  return none, full, host, sizes


@pytest.mark.slow
def test_plan_is_the_least_offload_that_fits(problem, base, abstract, bounds):
  plain, loss_fn, batch = problem
  none, full, full_host, sizes = bounds
  assert full < none and full_host > 0
  budget = full + (none - full) // 4
  plan = zerojax.plan_offload(abstract, loss_fn, batch, budget,
                              compiler_options=OPTIONS)
  assert plan.offload_optimizer and not plan.offload_params
  assert 0 < plan.offloaded_chunks < len(sizes)
  # the chosen setting, on a real state: fits, and its host bytes are the plan's
  fits, host = _device_bytes(base, loss_fn, batch, **plan.fields)
  assert fits <= budget and fits == plan.device_bytes and host == plan.host_bytes
  # one chunk fewer on host (the largest k-1 chunks, by bytes): does not fit
  k = plan.offloaded_chunks
  fewer = (dict(offload_optimizer=True,
                offload_fraction=sum(sizes[:k - 1]) / sum(sizes))
           if k > 1 else {})
  over, fewer_host = _device_bytes(base, loss_fn, batch, **fewer)
  assert over > budget and fewer_host < host
  assert plan.budget_bytes == budget and plan.ladder[plan.rung] == plan.fields
  assert len(plan.tried) < len(plan.ladder)      # bisected, not swept


@contextlib.contextmanager
def _lowerings():
  """jax's events of lowering, compiling or reading its compilation cache
  inside the block."""
  seen = []
  listener = lambda event, seconds, **kw: (
      seen.append(event) if any(what in event for what in (
          "to_mlir", "backend_compile", "compilation_cache")) else None)
  jax.monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    jax._src.monitoring.unregister_event_duration_listener(listener)


def test_planning_again_compiles_nothing(problem, abstract):
  """Planning the same loss and state again (`plan_offload`, then
  offload="auto" at the first step, which plans the state as created,
  its config saying "auto") lowers no step again; another loss function
  is compiled afresh: a loss is known by its identity, as under
  `jax.jit` (`zerojax._plan.remembered`)."""
  plain, loss_fn, batch = problem
  budget = 10 ** 9
  first = zerojax.plan_offload(abstract, loss_fn, batch, budget,
                               compiler_options=OPTIONS)
  auto = zerojax.shard_shape(plain, stage=3, chunk_size=CHUNK,
                             offload="auto", device_budget=budget)
  with _lowerings() as lowered:
    again = zerojax.plan_offload(auto, loss_fn, batch, budget,
                                 compiler_options=OPTIONS)
  assert lowered == [] and again == first
  with _lowerings() as lowered:
    other = zerojax.plan_offload(abstract, lambda p, b: loss_fn(p, b), batch,
                                 budget, compiler_options=OPTIONS)
  assert len(lowered) >= len(first.tried) and other.tried == first.tried


def test_impossible_budget_names_the_shortfall(problem, abstract, bounds):
  plain, loss_fn, batch = problem
  full = bounds[1]
  with pytest.raises(ValueError, match=f"cannot be met.*{full:,} bytes.*"
                     f"{100:,} bytes over the budget"):
    zerojax.plan_offload(abstract, loss_fn, batch, full - 100,
                         compiler_options=OPTIONS)


def test_stage0_cannot_offload(problem):
  plain, loss_fn, batch = problem
  with pytest.raises(ValueError, match="Stage 0 cannot offload"):
    zerojax.plan_offload(_abstract(plain, stage=0), loss_fn, batch, 1,
                         compiler_options=OPTIONS)


@pytest.mark.parametrize("budget,error,match", [
    (-1, ValueError, "budget_bytes=-1 must be a positive"),
    (0, ValueError, "budget_bytes=0 must be a positive"),
    (float("nan"), ValueError, "budget_bytes=nan must be a positive"),
    ("1GB", TypeError, "budget_bytes='1GB' must be a number of bytes"),
    (True, TypeError, "budget_bytes=True must be a number of bytes"),
])
def test_bad_budget(problem, abstract, budget, error, match):
  plain, loss_fn, batch = problem
  with pytest.raises(error, match=match):
    zerojax.plan_offload(abstract, loss_fn, batch, budget)


def test_bad_state_and_loss(problem, abstract):
  plain, loss_fn, batch = problem
  with pytest.raises(TypeError, match="takes a ZeroTrainState.*TrainState"):
    zerojax.plan_offload(plain, loss_fn, batch, 2 ** 30)
  with pytest.raises(TypeError, match="takes the loss function"):
    zerojax.plan_offload(abstract, "loss", batch, 2 ** 30)
