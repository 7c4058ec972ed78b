"""`zerojax.plan`: the ZeRO configuration chosen from memory budgets at
compile time, nothing allocated and no step run.

Each candidate's step is compiled from an abstract state (`shard_shape`)
and read three ways:

  memory          device and host bytes per device (`compiled_footprint`,
                  as `plan_offload` reads them);
  communication   per link kind, bytes per device per step: the compiled
                  collectives' ring bytes (`zerojax.hlo`) over the data
                  axis, and separately those whose groups span the replica
                  axis (the nodes' slower link); the host transfers the
                  program makes (`hlo.host_moves` of its lowering for a
                  GPU, where memory-kind moves are visible) over PCIe;
                  the disk tier's files, written and read once a step;
  FLOPs           XLA's `cost_analysis()` of the program (one device's).

The modelled step time is

  FLOPs / peak + data bytes / link + replica bytes / node_link
    + PCIe bytes / pcie + disk bytes / disk
    [+ 2 x host-side state bytes / host_update, the update on the host]

with the figures of the device kind (`DEVICE_FIGURES`, overridable with
`figures=`): no overlap assumed, so it ranks candidates rather than
predicts a step.

Candidates, pruned where memory only falls and time only grows: stages 0,
1, 2 and 3 without offload; when stage 2 misses the budget, stage 2 with
its optimizer state on host (ZeRO-Offload); at stage 3, when that misses,
the remat policies "dots" then "full" (more recompute, fewer activations),
stopping at the first that fits; when none fits, the least host offload
that fits along stage 3's offload ladder (`plan_offload`, bisected; with
the least-memory remat). Each offload candidate that fits is tried again
with its update run on the host (`update_on="host"`, where the master is
sharded). With `offload_dir=`, when nothing else fits, the disk tier
(stage 3, full recompute). Quantized collectives (qwZ and qgZ, int8) are tried only with
`allow_quantized=True`: they change the numerics. Among the candidates
that fit, the fastest modelled; within 2% the simpler (no offload before
offload, a lower stage, less recompute).
"""
from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from typing import Any, Callable, Optional

import jax
import numpy as np

from zerojax import disk_tier, frozen, hlo, reshard
from zerojax.config import shard_axes
from zerojax.memory import compiled_footprint
from zerojax.planner import host_bytes, offload_ladder, plan_offload
from zerojax.state import (ZeroTrainState, device_budget_bytes, loaded_master,
                           place, plan_state, shard_shape)
from zerojax.step import train_step

_log = logging.getLogger("zerojax")

# Per device kind (a substring of `device.device_kind`): dense peak FLOP/s
# in 16-bit and 32-bit compute; bytes/s one way of the interconnect within
# a node (`link`), between nodes per device (`node_link`) and of PCIe; and
# `host_update`, the bytes/s of host-resident state a host-side update
# (`update_on="host"`) reads and writes per device; `disk`, a device's
# share of the local NVMe's bytes/s (the disk tier). Vendor datasheets: H100
# / H200 SXM NVLink 4 at 450 GB/s a direction, one 400 Gb/s NDR
# InfiniBand port per GPU (50 GB/s), PCIe 5 x16 at about 55 GB/s; A100
# NVLink 3 at 300, HDR 200 Gb/s, PCIe 4 at 25; `host_update` from
# DeepSpeed's CPU Adam (about 1 G parameters/s a node, 32 bytes a
# parameter, eight devices a node: 4 GB/s a device); one NVMe drive a GPU
# at about 3 GB/s (DGX H100), 2 GB/s elsewhere. "cpu" is this
# project's simulated devices on a 2-core machine, measured by
# `python -m benchmarks.plan --calibrate` (with a pooled malloc, as a
# device allocates): only ratios between its candidates mean anything.
_NVLINK4 = {"flops16": 989e12, "flops32": 67e12, "link": 450e9,
            "node_link": 50e9, "pcie": 55e9, "host_update": 4e9,
            "disk": 3e9}
DEVICE_FIGURES = {
    "H200": _NVLINK4,
    "H100": _NVLINK4,
    "A100": {"flops16": 312e12, "flops32": 19.5e12, "link": 300e9,
             "node_link": 25e9, "pcie": 25e9, "host_update": 4e9,
             "disk": 2e9},
    "TPU v5p": {"flops16": 459e12, "flops32": 459e12 / 4, "link": 200e9,
                "node_link": 25e9, "pcie": 25e9, "host_update": 4e9,
                "disk": 2e9},
    "cpu": {"flops16": 10e9, "flops32": 20e9, "link": 1.5e9,
            "node_link": 1.5e9, "pcie": 2.7e9, "host_update": 2.7e9,
            "disk": 0.22e9},
}
_CLOSE = 0.02   # modelled times this close are a tie


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One configuration the plan compiled. `fields`: its `ZeroConfig`
  fields (stage included); bytes per device; per step and device, the
  collectives' ring bytes over the data axis (`wire_bytes`) and over the
  replica axis (`replica_bytes`), the host transfers (`pcie_bytes`) and,
  with the update on the host, the host state it reads and writes
  (`host_update_bytes`), the disk tier's file reads and writes
  (`disk_bytes`); `flops`: XLA's count; `modelled_s`: the modelled
  step time (the module docstring)."""
  fields: dict
  device_bytes: int
  host_bytes: int
  wire_bytes: float
  replica_bytes: float
  pcie_bytes: float
  host_update_bytes: float
  disk_bytes: float
  flops: float
  modelled_s: float
  fits: bool

  @property
  def label(self) -> str:
    f = self.fields
    parts = [f"stage {f['stage']}"]
    if f.get("remat", "none") != "none":
      parts.append(f"remat={f['remat']}")
    if f.get("offload_optimizer") == "disk":
      parts.append("optimizer on disk")
    elif f.get("offload_optimizer"):
      parts.append("offload" + ("" if f.get("offload_fraction", 1.0) == 1.0
                                else f" {f['offload_fraction']:.2f}"))
    if f.get("offload_params"):
      parts.append("params on host")
    if f.get("update_on") == "host" and f.get("offload_optimizer") != "disk":
      parts.append("update on host")
    if f.get("quantize_weights"):
      parts.append("int8 collectives")
    return ", ".join(parts)

  def _simplicity(self) -> tuple:
    f = self.fields
    return (bool(f.get("offload_optimizer")),
            f.get("offload_optimizer") == "disk", f.get("update_on") == "host",
            bool(f.get("quantize_weights")), f["stage"],
            ("none", "dots", "full").index(f.get("remat", "none")))


@dataclasses.dataclass(frozen=True)
class Plan:
  """`zerojax.plan`'s answer: `zerojax.shard(state, **plan.config_fields)`
  applies it. `candidates`: every configuration compiled, in the order
  tried; `chosen`: the one picked; `figures`: the device figures the model
  used, of `device_kind`."""
  chosen: Candidate
  candidates: tuple
  device_budget: int
  host_budget: Optional[int]
  device_kind: str
  figures: dict

  @property
  def config_fields(self) -> dict:
    return dict(self.chosen.fields)

  def __str__(self) -> str:
    mib = lambda b: f"{b / 2 ** 20:,.1f}"
    rows = [f"zerojax.plan: {self.chosen.label} (device budget "
            f"{mib(self.device_budget)} MiB"
            + ("" if self.host_budget is None else
               f", host budget {mib(self.host_budget)} MiB")
            + f"; figures of {self.device_kind!r}: {self.figures})",
            f"{'candidate':<46} {'device MiB':>10} {'host MiB':>9} "
            f"{'data MiB':>9} {'replica MiB':>11} {'PCIe MiB':>9} "
            f"{'disk MiB':>9} "
            f"{'GFLOP':>8} {'model ms':>9}  fits"]
    for c in self.candidates:
      mark = "  <- chosen" if c is self.chosen else ""
      rows.append(f"{c.label:<46} {mib(c.device_bytes):>10} "
                  f"{mib(c.host_bytes):>9} {mib(c.wire_bytes):>9} "
                  f"{mib(c.replica_bytes):>11} {mib(c.pcie_bytes):>9} "
                  f"{mib(c.disk_bytes):>9} "
                  f"{c.flops / 1e9:>8.2f} {1e3 * c.modelled_s:>9.2f}  "
                  f"{'yes' if c.fits else 'no'}{mark}")
    return "\n".join(rows)


def figures_for(device_kind: str, figures: Optional[dict] = None) -> tuple:
  """`(the DEVICE_FIGURES key used, its figures)` for `device_kind`, with
  `figures` over them; an unknown kind takes H100's, and says so."""
  key = next((k for k in DEVICE_FIGURES if k.lower() in device_kind.lower()),
             None)
  if key is None:
    _log.warning("zerojax.plan: no figures on record for device kind %r; "
                 "modelling it as an H100 (pass figures= to set them).",
                 device_kind)
    key = "H100"
  return key, {**DEVICE_FIGURES[key], **(figures or {})}


def _budget(value, name: str) -> Optional[int]:
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise TypeError(f"{name}={value!r} must be a number of bytes per device.")
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"{name}={value!r} must be a positive, finite number "
                     "of bytes per device.")
  return int(value)


def plan(state: Any, loss_fn: Callable, batch: Any, *, device_budget,
         host_budget=None, offload_dir=None, mesh=None, tx=None,
         has_aux: bool = False,
         mutable: tuple = (), weighted: bool = False,
         allow_quantized: bool = False, figures: Optional[dict] = None,
         **config_fields) -> Plan:
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
    **config_fields: further `ZeroConfig` fields every candidate keeps
      (`compute_dtype`, `accum_steps`, `frozen`, ...).

  Returns:
    A `Plan`; `zerojax.shard(state, **plan.config_fields, ...)` applies it.

  Raises:
    ValueError: nothing fits; the error names the candidate that needs the
      least device memory, its needs per memory kind and the shortfall.
  """
  device = _budget(device_budget, "device_budget")
  if device is None:
    raise TypeError("plan() needs device_budget= (bytes per device).")
  host = _budget(host_budget, "host_budget")
  if not callable(loss_fn):
    raise TypeError(f"plan() takes the loss function, got {loss_fn!r}.")
  taken = {"stage", "remat", "offload_optimizer", "offload_params",
           "offload_fraction", "quantize_weights", "quantize_grads",
           "placement", "device_budget", "update_on",
           "offload_dir"} & set(config_fields)
  if taken:
    raise ValueError(f"plan() chooses {sorted(taken)} itself; leave them "
                     "out (pass the fields every candidate keeps).")
  batch = jax.eval_shape(lambda b: b, batch)
  step = train_step(loss_fn, has_aux=has_aux, mutable=mutable,
                    weighted=weighted)
  if not isinstance(state, ZeroTrainState):
    state = shard_shape(state, 3, mesh, **({} if tx is None else {"tx": tx}),
                        **config_fields)
  elif config_fields or tx is not None or mesh is not None:
    raise TypeError("plan() of a ZeroTrainState takes its mesh, tx and "
                    "config from it; pass only the budgets and options.")
  used = figures_for(state.mesh.devices.flat[0].device_kind, figures)
  tried = []

  def trial(fields):
    cand = measure(state, step, batch, fields, used[1], device, host)
    tried.append(cand)
    return cand

  # (hpZ shards over the replica axis too: no stage 0)
  stages = [trial({"stage": s}) for s in
            ((1, 2, 3) if state.config.hpz else (0, 1, 2, 3))]
  if not stages[-2].fits:   # stage 2 misses: its optimizer state on host
    trial({"stage": 2, "offload_optimizer": True})
  if not stages[-1].fits:   # stage 3 misses: recompute more, then offload
    for remat in ("dots", "full"):
      if trial({"stage": 3, "remat": remat}).fits:
        break
  if not any(c.fits for c in tried):
    # the most offload first: when it misses, nothing fits (said below)
    fields = {"stage": 3, "remat": "full"}
    full = _as_configured(state, fields)
    most = trial({**fields, **offload_ladder(full)[-1]})
    if most.fits and most.fields != fields:
      offload = plan_offload(full, loss_fn, batch, device,
                             has_aux=has_aux, mutable=mutable,
                             weighted=weighted)
      least = {**fields, **offload.config_fields}
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
  return Plan(chosen, tuple(tried), device, host, *used)


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
  config = dataclasses.replace(state.config, **{**_CHOSEN, **fields})
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
  _log.warning("zerojax: stage='auto' chose %s.\n%s", chosen.chosen.label,
               chosen)
  layout, axes = state.layout, shard_axes(cfg)
  params = reshard.to_tree(layout, loaded_master(state),
                           frozen.restored(layout, state.rest), axes)
  _, opt_shapes, dims = _tree_parts(state)
  opt_state = reshard.opt_to_tree(layout, state.opt_state, opt_shapes, axes)
  config = dataclasses.replace(cfg, **{**_CHOSEN, **chosen.config_fields})
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
            host_budget: Optional[int] = None) -> Candidate:
  """`state` configured with `fields` (`_as_configured`), its `step`
  (a `zerojax.train_step`) compiled for `batch` abstractly and read as the
  module docstring says, against the budgets (bytes per device)."""
  shapes = _as_configured(state, fields)
  if shapes.config.disk:   # its statistics as `OnDisk`s: nothing written
    shapes = disk_tier.spill(shapes)
  compiled = step.lower(shapes, batch).compile()
  footprint = compiled_footprint(compiled)
  held = host_bytes(shapes)
  data, replica = _wire_by_link(compiled, shapes)
  pcie, sunk = _host_traffic(step, shapes, batch) if held else (0.0, 0.0)
  on_disk = sum(x.nbytes for x in jax.tree_util.tree_leaves(
      shapes, is_leaf=disk_tier.is_on_disk)
                if disk_tier.is_on_disk(x)) / shapes.num_shards
  disk = 2.0 * (on_disk + sunk)   # written and read back once a step
  host_update = (2.0 * (held + on_disk) if shapes.config.update_on == "host"
                 else 0.0)
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  flops = float((cost or {}).get("flops", 0.0))
  half = np.dtype(shapes.config.compute_dtype).itemsize < 4
  modelled = (flops / figures["flops16" if half else "flops32"]
              + data / figures["link"] + replica / figures["node_link"]
              + pcie / figures["pcie"] + host_update / figures["host_update"]
              + disk / figures["disk"])
  fits = (footprint["device"] <= device_budget
          and (host_budget is None or held <= host_budget))
  return Candidate(_explicit(fields), int(footprint["device"]), int(held),
                   data, replica, pcie, host_update, disk, flops, modelled,
                   fits)


def _wire_by_link(compiled, shapes: ZeroTrainState) -> tuple:
  """`(data-axis bytes, replica-axis bytes)`: the ring bytes per device per
  step of the collectives of known trip count, those whose groups span
  the replica axis counted on the slower link."""
  ops = [op for op in hlo.count_collectives(compiled).ops
         if op.trips is not None]
  axis = shapes.config.replica_axis
  mesh = shapes.mesh
  if axis is None:
    return float(sum(op.trips * op.wire_bytes for op in ops)), 0.0
  where = (tuple(mesh.devices.shape), mesh.axis_names.index(axis))
  across = [op.spans(*where) for op in ops]
  total = lambda wanted: float(sum(op.trips * op.wire_bytes
                                   for op, a in zip(ops, across)
                                   if a == wanted))
  return total(False), total(True)


def _host_traffic(step: Callable, shapes: ZeroTrainState,
                  batch: Any) -> tuple:
  """`(PCIe bytes, of which the disk tier's gradient sink)` per device per
  step: the step's memory-kind moves of whole chunks or of one device's
  shard of one (`hlo.host_moves`) and its writes to host files
  (`hlo.host_writes`), read from the program lowered for a GPU, where they
  are visible (on CPU they lower to nothing)."""
  text = step.trace(shapes, batch).lower(
      lowering_platforms=("cuda",)).as_text()
  n = shapes.num_shards
  chunks = [tuple(c.shape) for c in shapes.layout.chunks]
  pieces = [c[:-1] + (c[-1] // n,) for c in chunks]
  moved = hlo.host_moves(text, chunks, pieces, n)
  sunk = hlo.host_writes(text, n) / n
  return (moved["pinned_host"] + moved["device"]) / n + sunk, sunk
