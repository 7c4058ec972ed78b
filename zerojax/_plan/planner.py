"""The offload budget planner: the least host offload whose compiled step fits
a per-device device-memory budget, decided before the first step.

Gemini decides placement from a warm-up trace at run time; here each
candidate setting's step is lowered from an abstract state
(`jax.ShapeDtypeStruct`s carrying that setting's shardings and memory kinds)
and compiled, so nothing is allocated. It lives beside `offload` rather than
in it because it compiles the step (`offload` never imports `step`).

The ladder, least offload first (each rung keeps every host byte of the one
before, so device bytes fall and host bytes grow along it):

  0        no offload;
  1..C-1   `offload_optimizer=True`, the optimizer state (and, where the
           master is a sharded copy, the master shard) of the 1, 2, ... C-1
           largest chunks on host: `offload_fraction` at chunk granularity,
           largest first as `offload.offloaded_chunks` places them, so each
           rung moves the most bytes for one more chunk's transfers;
  C        full optimizer offload (`offload_fraction=1.0`);
  C+1      stage 3: `offload_params=True` on top, kept only where it moves
           more to host. With this project's placement it never does: at
           stage 3 the master shard is the parameter, and full optimizer
           offload already keeps it on host. Parameters go last because
           they are read in the forward and backward (a transfer before each
           use), the optimizer state only once per step.

Rungs with the same placement as the one before are dropped. The planner
bisects the ladder (device bytes fall along it, though not strictly: XLA's
buffer assignment can give a rung a few KiB more than the one before):
2 + O(log C) compiles. When the most offload misses the budget, every
rung is compiled before refusing, since a rung below it may still fit;
the error then names the least any rung needs.

What is measured and what is derived (see `zerojax.compiled_footprint`):
the argument/output/temp/alias bytes come from `memory_analysis()`; the
CPU backend does not split them by memory space, so the host-resident
parameters and outputs are found from the compiled module's entry layout
and subtracted: `device_bytes` = footprint - host arguments - host outputs
+ host outputs that alias donated host arguments. On CPU the host <-> device
copies compile away, so `device_bytes` holds no transient device copy of an
offloaded chunk; on an accelerator the optimizer update also needs the
device copies of the offloaded optimizer state (see `zerojax._core.offload`).
`host_bytes` is the per-device bytes of the state arrays placed in
`pinned_host` memory (from the shardings; it equals the compiled
`host_argument`).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any, Callable, Optional

import jax
import numpy as np

from zerojax._core import offload
from zerojax._plan import remembered
from zerojax._options.groups import Offload
from zerojax._state.memory import compiled_footprint, per_device_bytes
from zerojax._options.policy import policy
from zerojax._state.shard import device_budget_bytes
from zerojax._state.state import ZeroTrainState, state_shardings

_log = logging.getLogger("zerojax")


@dataclasses.dataclass(frozen=True)
class OffloadPlan:
  """The planner's answer.

  Attributes:
    offload_optimizer, offload_params, offload_fraction: the setting
      (`plan.fields`); pass `offload=plan.offload` to `zerojax.shard` /
      `zerojax.create`.
    offloaded_chunks: how many chunks have their optimizer state on host.
    device_bytes: per-device device memory of the compiled step (derived,
      see the module docstring).
    host_bytes: per-device bytes of the state kept in `pinned_host` memory.
    budget_bytes: the budget asked for.
    footprint: `zerojax.compiled_footprint` of the chosen setting's step.
    ladder: every rung's config fields, least offload first.
    rung: the chosen rung's index in `ladder`.
    tried: {rung index: device bytes} of every rung compiled.
  """
  offload_optimizer: bool
  offload_params: bool
  offload_fraction: float
  offloaded_chunks: int
  device_bytes: int
  host_bytes: int
  budget_bytes: int
  footprint: dict
  ladder: tuple
  rung: int
  tried: dict

  @property
  def fields(self) -> dict:
    return {"offload_optimizer": self.offload_optimizer,
            "offload_params": self.offload_params,
            "offload_fraction": self.offload_fraction}

  @property
  def offload(self) -> Optional[Offload]:
    """The setting as the `offload=` option (None: nothing offloaded)."""
    if not (self.offload_optimizer or self.offload_params):
      return None
    return Offload("host", self.offload_optimizer, self.offload_params,
                   self.offload_fraction)


def offload_ladder(state: ZeroTrainState) -> list:
  """The offload settings the planner chooses from, least offload first, as
  ZeroConfig field dicts (see the module docstring)."""
  cfg, layout = state.config, state.layout
  none = {"offload_optimizer": False, "offload_params": False,
          "offload_fraction": 1.0}
  pol = policy(cfg)
  # replicated optimizer state (stage 0) has no shard to offload
  if not pol.optimizer_sharded or not offload.has_host_memory(state.mesh):
    return [none]
  sizes = [int(np.prod(c.shape)) * c.dtype.itemsize for c in layout.chunks]
  total = sum(sizes)
  candidates = [none]
  cumulative = 0
  for i, size in enumerate(sorted(sizes, reverse=True)):
    cumulative += size
    fraction = 1.0 if i == len(sizes) - 1 else cumulative / total
    candidates.append({"offload_optimizer": True, "offload_params": False,
                       "offload_fraction": fraction})
  if pol.gathers_params:   # parameter shards exist only at stage 3
    candidates.append({"offload_optimizer": True, "offload_params": True,
                       "offload_fraction": 1.0})
  ladder, seen = [], set()
  for fields in candidates:
    kinds = _placement(_abstract_state(state, fields))
    if kinds not in seen:
      seen.add(kinds)
      ladder.append(fields)
  return ladder


def plan_offload(state: ZeroTrainState, loss_fn: Callable, batch: Any,
                 budget_bytes: int, *, has_aux: bool = False,
                 mutable: tuple = (), weighted: bool = False,
                 compiler_options: Optional[dict] = None) -> OffloadPlan:
  """The least offload (along `offload_ladder`) whose compiled step needs at
  most `budget_bytes` of device memory per device.

  Args:
    state: a `ZeroTrainState`, real or abstract (`zerojax.shard_shape`);
      only its shapes, dtypes, layout, config and mesh are
      read, and its own offload fields are ignored.
    loss_fn, has_aux, mutable, weighted: as for `zerojax.train_step`.
    batch: one step's global batch: arrays or `jax.ShapeDtypeStruct`s.
    budget_bytes: device memory per device, in bytes.
    compiler_options: XLA options for the compiles (the same as the run's,
      so the analysis matches what will run).

  Asked again for the same loss function and state (`offload="auto"`
  at the first step, after this), it compiles no rung twice
  (`zerojax._plan.remembered`).

  Returns:
    An `OffloadPlan`; `zerojax.shard(..., offload=plan.offload)`.

  Raises:
    ValueError: when even the most offload of the ladder does not fit,
      saying by how many bytes.
  """
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"plan_offload() takes a ZeroTrainState (from "
                    f"zerojax.shard or zerojax.shard_shape), got "
                    f"{type(state).__name__}.")
  if not callable(loss_fn):
    raise TypeError(f"plan_offload() takes the loss function, got {loss_fn!r}.")
  if (isinstance(budget_bytes, bool) or
      not isinstance(budget_bytes, numbers.Real)):
    raise TypeError(f"budget_bytes={budget_bytes!r} must be a number of bytes "
                    "per device (an int).")
  if not (math.isfinite(budget_bytes) and budget_bytes > 0):
    raise ValueError(f"budget_bytes={budget_bytes!r} must be a positive, "
                     "finite number of bytes per device.")
  budget = int(budget_bytes)
  batch = jax.eval_shape(lambda b: b, batch)   # shapes only: nothing moved
  step = remembered.step(loss_fn, has_aux=has_aux, mutable=mutable,
                         weighted=weighted)
  ladder = offload_ladder(state)
  measured = {}

  def device_bytes(rung):
    if rung not in measured:
      abstract = _abstract_state(state, ladder[rung])
      measured[rung] = dict(remembered.measured(step, abstract, batch,
                                                _footprint, compiler_options))
    return measured[rung]["device"]

  last = len(ladder) - 1
  if device_bytes(last) > budget:
    # device bytes mostly fall along the ladder, but not strictly (XLA's
    # buffer assignment): before refusing, try every rung
    fitting = [r for r in range(last) if device_bytes(r) <= budget]
    if not fitting:
      least = min(measured, key=lambda r: measured[r]["device"])
      need = device_bytes(least)
      raise ValueError(
          f"budget_bytes={budget:,} cannot be met: the step needs at least "
          f"{need:,} bytes of device memory per device, with "
          f"{_describe(ladder[least])}, {need - budget:,} bytes over the "
          f"budget. {_why_no_more(state)}Raise the budget, use more devices, "
          "a smaller batch or model, or accumulate gradients (accum_steps).")
    last = fitting[0]
  lo, hi = -1, last            # lo: known not to fit (or none), hi: fits
  if last > 0:
    if device_bytes(0) <= budget:
      hi = 0
    else:
      lo = 0
  while hi - lo > 1:
    mid = (lo + hi) // 2
    if device_bytes(mid) <= budget:
      hi = mid
    else:
      lo = mid
  fields = ladder[hi]
  chosen = _abstract_state(state, fields)
  host_chunks = (offload.offloaded_chunks(state.layout, fields["offload_fraction"])
                 if fields["offload_optimizer"] else frozenset())
  return OffloadPlan(
      **fields, offloaded_chunks=len(host_chunks),
      device_bytes=measured[hi]["device"], host_bytes=host_bytes(chosen),
      budget_bytes=budget, footprint=measured[hi], ladder=tuple(ladder),
      rung=hi, tried={r: fp["device"] for r, fp in sorted(measured.items())})


def place_as_planned(state: ZeroTrainState, loss_fn: Callable, batch: Any, *,
                     has_aux: bool, mutable: tuple,
                     weighted: bool = False) -> ZeroTrainState:
  """placement="auto" at its first step: `state` moved to the placement
  `plan_offload` chooses for this step's program and the config's
  `device_budget`, its config saying "planned". Raises (the state left as
  it was) when nothing fits."""
  cfg = state.config
  try:
    plan = plan_offload(state, loss_fn, batch,
                        device_budget_bytes(cfg, state.mesh),
                        has_aux=has_aux, mutable=mutable, weighted=weighted)
  except ValueError as e:
    raise ValueError(f"offload='auto', device_budget={cfg.device_budget!r}: "
                     f"{e}") from None
  planned = state.replace(config=cfg.replace(placement="planned",
                                             **plan.fields))
  _log.info("offload='auto' planned %s: step %s device bytes "
            "per device, budget %s; optimizer state of %d of %d chunks on "
            "host.", _describe(plan.fields), f"{plan.device_bytes:,}",
            f"{plan.budget_bytes:,}", plan.offloaded_chunks,
            len(state.layout.chunks))
  return jax.device_put(planned, state_shardings(planned))


def _abstract_state(state, fields) -> ZeroTrainState:
  """`state` as ShapeDtypeStructs with the shardings of `fields`' offload."""
  state = state.replace(config=state.config.replace(**fields))
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=s),
      state, state_shardings(state))


def _footprint(compiled, abstract) -> dict:
  return compiled_footprint(compiled)


def _placement(abstract) -> tuple:
  return tuple(x.sharding.memory_kind for x in jax.tree_util.tree_leaves(abstract))


def host_bytes(abstract) -> int:
  """Per-device bytes of the arrays placed in host memory."""
  return per_device_bytes([x for x in jax.tree_util.tree_leaves(abstract)
                           if x.sharding.memory_kind == offload.HOST])


def _why_no_more(state) -> str:
  if not policy(state.config).optimizer_sharded:
    return "Stage 0 cannot offload (use stage >= 1). "
  if not offload.has_host_memory(state.mesh):
    return (f"The devices have no {offload.HOST!r} memory, so nothing can be "
            "offloaded. ")
  return ""


def _describe(fields) -> str:
  if not fields["offload_optimizer"] and not fields["offload_params"]:
    return "(no offload)"
  return ("(" + ", ".join(f"{k}={v}" for k, v in fields.items()) + ")")
