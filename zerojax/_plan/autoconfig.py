"""`zerojax.plan`: the ZeRO configuration chosen from memory budgets at
compile time, nothing allocated and no step run.

Each candidate is compiled from an abstract state and read, per memory
kind and per link, by `zerojax._plan.costmodel` (its docstring: what is read,
and the modelled step time that ranks the candidates).

Candidates, pruned where memory only falls and time only grows: stages 0,
1, 2 and 3 without offload; for a `GpuTarget` of several hosts, stage 3
within each host (HSDP) and with hpZ, on `hybrid_mesh`; where stage 3
fits, stage 3 keeping its activations' casts too (`remat="casts"`:
faster, more bytes, where a float32 softmax feeds a bf16 matmul); stage 3
recomputing attention's scores (`remat="recompute-scores"`: fewer bytes);
when stage 2 misses the budget, stage 2 with its optimizer state on host
(ZeRO-Offload); at stage 3, when that misses,
the remat policies "dots", "offload" ("dots"' residuals in host memory:
fewer device bytes where memory kinds are real, a `GpuTarget`'s program)
then "full" (more recompute, fewer activations), stopping at the first
that fits, and where that is "offload" or "full" and the model has
blocks of several classes, that remat for one class at a time, "dots"
for the others (`Blocks(remat=)` per class); when none fits, the least
host offload that fits along stage 3's offload ladder (`plan_offload`,
bisected; with the least-memory remat). Each offload candidate that fits
is tried again with its update run on the host (`update_on="host"`,
where the master is sharded). With `offload_dir=`, when nothing else fits, the disk tier
(stage 3, full recompute). Quantized collectives (qwZ and qgZ, int8) are
tried only with `allow_quantized=True`: they change the numerics. Among
the candidates that fit, the fastest modelled; within 2% the simpler (no
offload before offload, a lower stage, less recompute).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any, Callable, Optional

import jax

from zerojax._plan import costmodel
from zerojax._core import frozen
from zerojax._core import opt_reshard
from zerojax._core import reshard
from zerojax._options.config import ZeroConfig, shard_axes
from zerojax._plan.costmodel import FIGURE_KEYS, Candidate, figures_for
from zerojax._options.groups import Axes, plan_chosen
from zerojax._plan.planner import offload_ladder, plan_offload
from zerojax._plan.targets import GpuTarget
from zerojax._state.build import place, plan_state
from zerojax._state.shard import (budget_in_bytes, device_budget_bytes,
                                  shard_shape)
from zerojax._state.state import ZeroTrainState, loaded_master
from zerojax._plan import remembered

_log = logging.getLogger("zerojax")

_CLOSE = 0.02   # modelled times this close are a tie
# a cluster of several hosts (`GpuTarget(hosts=)`): the axis of its hosts
# in the mesh of its HSDP and hpZ candidates (`hybrid_mesh`)
_REPLICA = "replica"
# jax 0.12's XLA aborts the process compiling a hybrid mesh's scalar
# all-reduce for GPUs (a Triton collective kernel: "size mismatch when
# packing elements for LLVM struct"), so HSDP and hpZ are tried before it
# only (docs/decisions.md, "HSDP and hpZ for several hosts")
_HYBRID_COMPILES = jax.__version_info__ < (0, 12)


@dataclasses.dataclass(frozen=True)
class Plan:
  """`zerojax.plan`'s answer: `zerojax.shard(state, **plan.options)`
  applies it. `candidates`: every configuration compiled, in the order
  tried; `chosen`: the one picked; `config`: the whole configuration it
  stands for; `figures`: the device figures the model used, of
  `device_kind`."""
  chosen: Candidate
  candidates: tuple
  device_budget: int
  host_budget: Optional[int]
  device_kind: str
  figures: dict
  config: ZeroConfig

  @property
  def options(self) -> dict:
    """The options the plan chose (`stage`, `offload`, `quantize`, and
    `blocks` with its remat; `axes` where it chose HSDP or hpZ, for a mesh
    of hosts x GPUs per host over `("replica", "data")`, `hybrid_mesh`):
    `zerojax.shard(state, **plan.options)`."""
    chosen = ("stage", "offload", "quantize", "blocks",
              *(("axes",) if self.config.replica_axis else ()))
    return {k: v for k, v in self.config.options().items() if k in chosen}

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2 ** 20:,.1f}"
    width = max([46] + [len(c.label) for c in self.candidates])
    rows = [f"zerojax.plan: {self.chosen.label} (device budget "
            f"{mib(self.device_budget)} MiB"
            + ("" if self.host_budget is None else
               f", host budget {mib(self.host_budget)} MiB")
            + f"; figures of {self.device_kind!r}: {self.figures})",
            f"{'candidate':<{width}} {'device MiB':>10} {'host MiB':>9} "
            f"{'data MiB':>9} {'replica MiB':>11} {'PCIe MiB':>9} "
            f"{'disk MiB':>9} "
            f"{'GFLOP':>8} {'model ms':>9}  fits"]
    if self.config.replica_axis:   # HSDP or hpZ: the mesh it needs
      axes = (self.config.replica_axis, self.config.axis_name)
      rows.insert(1, f"for a mesh of hosts x GPUs per host over {axes}: "
                  f"jax.make_mesh((hosts, gpus_per_host), {axes})")
    for c in self.candidates:
      mark = "  <- chosen" if c is self.chosen else ""
      rows.append(f"{c.label:<{width}} {mib(c.device_bytes):>10} "
                  f"{mib(c.host_bytes):>9} {mib(c.wire_bytes):>9} "
                  f"{mib(c.replica_bytes):>11} {mib(c.pcie_bytes):>9} "
                  f"{mib(c.disk_bytes):>9} "
                  f"{c.flops / 1e9:>8.2f} {1e3 * c.modelled_s:>9.2f}  "
                  f"{'yes' if c.fits else 'no'}{mark}")
    return "\n".join(rows)


def hybrid_mesh(target: GpuTarget):
  """The mesh of a `target` of several hosts on which the plan tries HSDP
  and hpZ: its hosts on the replica axis, the GPUs of each on the data
  axis (so stage 3's gathers stay on NVLink)."""
  return target.mesh((target.hosts, target.gpus_per_host),
                     (_REPLICA, "data"))


def _budget(value, name: str) -> Optional[int]:
  """A budget checked: bytes per device (a device budget may also be a
  fraction in (0, 1] of the device's memory, converted once the mesh is
  known)."""
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name}={value!r} must be a number of bytes per device.")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name}={value!r} must be a positive, finite number "
                     "of bytes per device.")
  if name == "host_budget" and isinstance(value, float) and value <= 1:
    raise ValueError(f"host_budget={value!r} reads as {int(value)} bytes: "
                     "give the host budget in bytes per device.")
  return int(value)


def plan(state: Any, loss_fn: Callable, batch: Any, *, device_budget=None,
         host_budget=None, offload_dir=None, mesh=None, tx=None,
         has_aux: bool = False,
         mutable: tuple = (), weighted: bool = False,
         allow_quantized: bool = False, figures: Optional[dict] = None,
         target: Optional[GpuTarget] = None, **options) -> Plan:
  """Chooses the ZeRO configuration of `state` for `loss_fn` on `batch`
  whose compiled step fits `device_budget` (and `host_budget`) bytes per
  device and is fastest modelled (see the module docstring).

  Args:
    state: what `zerojax.shard` takes (a Flax `TrainState`, real or
      `jax.eval_shape`'d, or an NNX model with `tx=`), or a
      `ZeroTrainState` (real or from `shard_shape`), whose own stage,
      remat, offload and quantization are the plan's to choose.
    loss_fn, has_aux, mutable, weighted: as for `zerojax.train_step`.
    batch: one step's global batch (arrays or `jax.ShapeDtypeStruct`s).
    device_budget, host_budget: bytes per device (host: pinned host memory
      per device; None: unbounded).
    offload_dir: a directory for the disk tier's files (a local NVMe
      disk), tried when nothing fits in device and host memory; None: no
      disk tier.
    mesh: as for `shard`.
    allow_quantized: also try int8 quantized collectives (qwZ, qgZ), which
      change the numerics.
    figures: `DEVICE_FIGURES` entries to override (`flops16`, `flops32`,
      `link`, `node_link`, `pcie`, `host_update`, `disk`).
    target: a `zerojax.GpuTarget`, a cluster this machine need not have:
      each candidate is compiled for its GPUs (the mesh is the target's:
      no `mesh=`) and ranked by the modelled step of its scheduled program
      (`zerojax._plan.schedule`, overlap included); `device_budget`
      defaults to the card's memory.
    **options: further `ZeroConfig` options every candidate keeps
      (`precision`, `accum_steps`, `frozen`, ...).

  Returns:
    A `Plan`; `zerojax.shard(state, **plan.options, ...)` applies it.

  Raises:
    ValueError: nothing fits; the error names the candidate that needs the
      least device memory, its needs per memory kind and the shortfall.
  """
  if target is not None:
    if not isinstance(target, GpuTarget):
      raise TypeError(f"plan(target={target!r}) takes a zerojax.GpuTarget.")
    if mesh is not None:
      raise TypeError("plan(target=...) plans on the target's own mesh; "
                      "leave out mesh=.")
    if figures is not None:
      raise TypeError("plan(target=...) models with the target's own "
                      "figures; leave out figures= (the link between hosts "
                      "is GpuTarget(node_link=...)).")
    if isinstance(state, ZeroTrainState):
      raise TypeError("plan(target=...) lays the state out on the target's "
                      "devices: pass the TrainState (or its shapes, "
                      "jax.eval_shape of its init), not a ZeroTrainState.")
    mesh = target.mesh()
    if device_budget is None:
      device_budget = target.memory_bytes
  device = _budget(device_budget, "device_budget")
  if device is None:
    raise TypeError("plan() needs device_budget= (bytes per device, or a "
                    "fraction in (0, 1] of the device's memory).")
  if figures is not None:
    unknown = sorted(set(figures) - set(FIGURE_KEYS))
    if unknown:
      raise ValueError(f"plan(figures=...) has no figure(s) {unknown}; the "
                       f"figures are {', '.join(FIGURE_KEYS)}.")
  host = _budget(host_budget, "host_budget")
  if not callable(loss_fn):
    raise TypeError(f"plan() takes the loss function, got {loss_fn!r}.")
  taken = [k for k in ("stage", "device_budget") if k in options]
  taken += plan_chosen(options)
  if taken:
    raise ValueError(f"plan() chooses {', '.join(taken)} itself; leave them "
                     "out (pass the options every candidate keeps).")
  batch = jax.eval_shape(lambda b: b, batch)
  step = remembered.step(loss_fn, has_aux=has_aux, mutable=mutable,
                         weighted=weighted)
  hybrid = None   # a cluster of several hosts: also ZeRO-3 within each
  if not isinstance(state, ZeroTrainState):
    given = {**({} if tx is None else {"tx": tx}), **options}
    if target is not None and target.hosts > 1 and "axes" not in options:
      if _HYBRID_COMPILES:
        hybrid = shard_shape(state, 3, hybrid_mesh(target),
                             axes=Axes(replica=_REPLICA), **given)
      else:
        _log.warning("zerojax.plan: HSDP and hpZ not tried for %s: jax %s's "
                     "XLA aborts compiling their GPU program.", target,
                     jax.__version__)
    state = shard_shape(state, 3, mesh, **given)
  elif options or tx is not None or mesh is not None:
    raise TypeError("plan() of a ZeroTrainState takes its mesh, tx and "
                    "config from it; pass only the budgets and options.")
  if not isinstance(device_budget, numbers.Integral) and device_budget <= 1:
    # a fraction, as shard(device_budget=) takes it: of the card's memory
    device = (int(device_budget * target.memory_bytes) if target is not None
              else budget_in_bytes(device_budget, state.mesh))
  used = ((str(target), {"schedule": dataclasses.asdict(target.figures())})
          if target is not None else
          figures_for(state.mesh.devices.flat[0].device_kind, figures))
  tried = []

  def trial(fields):
    laid_out = hybrid if fields.get("replica_axis") else state
    cand = measure(laid_out, step, batch, fields, used[1], device, host,
                   target)
    tried.append(cand)
    return cand

  # (hpZ shards over the replica axis too: no stage 0)
  stages = [trial({"stage": s}) for s in
            ((1, 2, 3) if state.config.hpz else (0, 1, 2, 3))]
  if hybrid is not None:   # several hosts: FSDP2's HSDP and ZeRO++'s hpZ
    trial({"stage": 3, "replica_axis": _REPLICA})
    trial({"stage": 3, "replica_axis": _REPLICA, "hpz": True})
  if stages[-1].fits:   # stage 3 fits: keeping its casts too may, faster
    trial({"stage": 3, "remat": "casts"})
  # attention's scores computed again: fewer bytes than "none", and faster
  # where the casts it keeps save more than the scores' matmul costs
  trial({"stage": 3, "remat": "recompute-scores"})
  if not stages[-2].fits:   # stage 2 misses: its optimizer state on host
    trial({"stage": 2, "offload_optimizer": True})
  if not stages[-1].fits:   # stage 3 misses: recompute more, then offload
    # "offload" keeps "dots"' compute, its residuals in host memory: fewer
    # device bytes where memory kinds are real (a GpuTarget's program)
    fitted = next((remat for remat in ("dots", "offload", "full")
                   if trial({"stage": 3, "remat": remat}).fits), None)
    if fitted in ("offload", "full"):   # "dots" missed: per block class
      classes = sorted(step.block_classes(_as_configured(
          state, {"stage": 3, "remat": "dots"}), batch))
      for cls in classes if len(classes) > 1 else ():
        trial({"stage": 3, "remat": tuple(sorted(
            {**dict.fromkeys(classes, "dots"), cls: fitted}.items()))})
  if not any(c.fits for c in tried):
    # the most offload first: when it misses, nothing fits (said below)
    fields = {"stage": 3, "remat": "full"}
    full = _as_configured(state, fields)
    most = trial({**fields, **offload_ladder(full)[-1]})
    if most.fits and most.fields != fields:
      offload = plan_offload(full, loss_fn, batch, device,
                             has_aux=has_aux, mutable=mutable,
                             weighted=weighted)
      least = {**fields, **offload.fields}
      if _explicit(least) != most.fields:
        trial(least)
  if offload_dir is not None and not any(c.fits for c in tried):
    trial({"stage": 3, "remat": "full", "offload_optimizer": "disk",
           "offload_dir": offload_dir})
  for cand in [c for c in tried if c.fits and c.fields.get("offload_optimizer")
               is True]:
    if cand.fields["stage"] == 3 or state.config.mixed_precision:
      trial({**cand.fields, "update_on": "host"})
  if allow_quantized:
    best = min((c for c in tried if c.fits and c.fields["stage"] == 3),
               key=lambda c: c.modelled_s, default=None)
    if best is not None:
      trial({**best.fields, "quantize_weights": "int8",
             "quantize_grads": "int8"})
  fitting = [c for c in tried if c.fits]
  if not fitting:
    least = min(tried, key=lambda c: c.device_bytes)
    need = (f"{least.device_bytes:,} bytes of device memory"
            + ("" if host is None else f" and {least.host_bytes:,} of host"))
    short = least.device_bytes - device
    raise ValueError(
        f"zerojax.plan: no configuration fits device_budget={device:,}"
        + ("" if host is None else f", host_budget={host:,}") +
        f". The least is {least.label}: {need} per device"
        + (f", {short:,} bytes over the device budget" if short > 0 else
           f", over the host budget by {least.host_bytes - host:,} bytes")
        + ". Raise the budget, use more devices, a smaller batch (or "
        "accum_steps) or model.")
  fastest = min(c.modelled_s for c in fitting)
  chosen = min((c for c in fitting if c.modelled_s <= fastest * (1 + _CLOSE)),
               key=Candidate._simplicity)
  return Plan(chosen, tuple(tried), device, host, *used,
              config=state.config.replace(**{**_CHOSEN, **chosen.fields}))


# what the plan chooses: reset before each candidate's own fields
_CHOSEN = {"remat": "none", "offload_optimizer": False, "offload_params": False,
           "offload_fraction": 1.0, "update_on": None, "offload_dir": None,
           "quantize_weights": None, "quantize_grads": None,
           "placement": "manual", "device_budget": None}


def _tree_parts(state: ZeroTrainState) -> tuple:
  """`(params, opt_state shapes, model dims)` of the ordinary TrainState
  content of `state`, as shapes."""
  layout = state.layout
  params = jax.tree_util.tree_unflatten(
      layout.treedef, [jax.ShapeDtypeStruct(i.shape, i.dtype)
                       for i in layout.leaves])
  dims = tuple(i.model_dim for i in layout.leaves)
  return (params, jax.eval_shape(state.tx.init, params),
          dims if any(d is not None for d in dims) else None)


def _as_configured(state: ZeroTrainState, fields: dict) -> ZeroTrainState:
  """`state` laid out with `fields` over its config (`_CHOSEN` reset), as
  `jax.ShapeDtypeStruct`s carrying their shardings."""
  config = state.config.replace(**{**_CHOSEN, **fields})
  params, opt_state, dims = _tree_parts(state)
  _, shapes, where = plan_state(
      params, opt_state, 0, state.extras, state.static_extras, tx=state.tx,
      apply_fn=state.apply_fn, config=config, mesh=state.mesh,
      model_dims=dims)
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, where)


def place_as_chosen(state: ZeroTrainState, loss_fn: Callable, batch: Any, *,
                    has_aux: bool, mutable: tuple,
                    weighted: bool = False) -> ZeroTrainState:
  """`shard(stage="auto")` at its first step: `plan` for this step's
  program and the config's `device_budget`, and `state` laid out again as
  the plan says (its parameters and optimizer state carried over, one
  chunk at a time), its config saying "manual"; the choice and the table
  said once. Raises (the state left as it was) when nothing fits."""
  cfg = state.config
  try:
    chosen = plan(state, loss_fn, batch,
                  device_budget=device_budget_bytes(cfg, state.mesh),
                  has_aux=has_aux, mutable=mutable, weighted=weighted)
  except ValueError as e:
    raise ValueError(f"stage='auto', device_budget={cfg.device_budget!r}: "
                     f"{e}") from None
  _log.warning("stage='auto' chose %s.\n%s", chosen.chosen.label,
               chosen)
  layout, axes = state.layout, shard_axes(cfg)
  params = reshard.to_tree(layout, loaded_master(state),
                           frozen.restored(layout, state.rest), axes)
  _, opt_shapes, dims = _tree_parts(state)
  opt_state = opt_reshard.opt_to_tree(layout, state.opt_state, opt_shapes, axes)
  config = chosen.config
  return place(params, opt_state, state.step, state.extras,
               state.static_extras, tx=state.tx, apply_fn=state.apply_fn,
               config=config, mesh=state.mesh, release=True, model_dims=dims)


def _explicit(fields: dict) -> dict:
  """`fields` without those at `_CHOSEN`'s defaults (how a plan shows
  them, and passes them to `shard`)."""
  return {k: v for k, v in fields.items()
          if not (k in _CHOSEN and v == _CHOSEN[k])}


def measure(state: ZeroTrainState, step: Callable, batch: Any, fields: dict,
            figures: dict, device_budget: int,
            host_budget: Optional[int] = None,
            target: Optional[GpuTarget] = None) -> Candidate:
  """`state` configured with `fields` (`_as_configured`), measured as the
  plan measures a candidate (`costmodel.measure`)."""
  return costmodel.measure(_as_configured(state, fields), step, batch,
                           _explicit(fields), figures, device_budget,
                           host_budget, target)
