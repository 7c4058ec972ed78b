"""What a candidate configuration costs, read from its compiled step:
`zerojax.plan`'s measure of each candidate (`zerojax._plan.autoconfig`).

Each candidate's step is compiled from an abstract state (`shard_shape`)
and read three ways:

  memory          device and host bytes per device (`compiled_footprint`,
                  as `plan_offload` reads them);
  communication   per link kind, bytes per device per step: the compiled
                  collectives' ring bytes (`zerojax._plan.hlo`) over the data
                  axis, and separately those whose groups span the replica
                  axis (the nodes' slower link); the host transfers the
                  program makes (`transfers.host_moves` of its lowering for a
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
"""
from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import jax
import numpy as np

from zerojax._options.groups import REMATS
from zerojax._tiers import disk_tier
from zerojax._plan import hlo
from zerojax._plan import remembered
from zerojax._plan import transfers
from zerojax._state.memory import compiled_footprint
from zerojax._plan.planner import host_bytes
from zerojax._state.state import ZeroTrainState

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
FIGURE_KEYS = tuple(DEVICE_FIGURES["H100"])   # what figures= may set


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
    return label(self.fields)

  def _simplicity(self) -> tuple:
    f = self.fields
    return (bool(f.get("offload_optimizer")),
            f.get("offload_optimizer") == "disk", f.get("update_on") == "host",
            bool(f.get("quantize_weights")), bool(f.get("replica_axis")),
            bool(f.get("hpz")), f["stage"], _recompute(f.get("remat", "none")))


def _recompute(remat) -> int:
  """How far a remat departs from keeping activations, for ties: the
  furthest of a per-class remat's (`Blocks.remat`)."""
  return (REMATS.index(remat) if isinstance(remat, str) else
          max(REMATS.index(r) for _, r in remat))


def label(fields: dict) -> str:
  """A candidate's fields (stage included) in a few words, as the plan's
  table shows them."""
  f = fields
  parts = [f"stage {f['stage']}"]
  if f.get("replica_axis"):   # several hosts (`autoconfig.hybrid_mesh`)
    parts.append("hpZ" if f.get("hpz") else "HSDP")
  remat = f.get("remat", "none")
  if remat != "none":
    parts.append(f"remat={remat}" if isinstance(remat, str) else
                 "remat " + ", ".join(f"{k}={v}" for k, v in remat))
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


def measure(shapes: ZeroTrainState, step: Callable, batch: Any, fields: dict,
            figures: dict, device_budget: int,
            host_budget: Optional[int] = None, target=None) -> Candidate:
  """The candidate `fields` (as the plan shows them), laid out as the
  abstract state `shapes`: its `step` (a `zerojax.train_step`) compiled for
  `batch` and read as the module docstring says, against the budgets
  (bytes per device). With a `zerojax.GpuTarget`, compiled for its GPUs
  and timed by the schedule of the program (`schedule.model_step`: its
  collectives and host copies beside its compute) instead of the sum
  below; the host update and the disk tier are added to it as below."""
  if shapes.config.disk:   # its statistics as `OnDisk`s: nothing written
    shapes = disk_tier.spill(shapes)
  if target is not None:
    footprint, data, replica, flops, program = remembered.measured(
        step, shapes, batch, _scheduled_reader(target),
        compile=target.compile)
  else:
    footprint, data, replica, flops = remembered.measured(step, shapes, batch,
                                                          _read)
  held = host_bytes(shapes)
  moves = held or shapes.config.disk   # (the disk tier's gradient sink)
  pcie, sunk = _host_traffic(step, shapes, batch) if moves else (0.0, 0.0)
  on_disk = sum(x.nbytes for x in jax.tree_util.tree_leaves(
      shapes, is_leaf=disk_tier.is_on_disk)
                if disk_tier.is_on_disk(x)) / shapes.num_shards
  disk = 2.0 * (on_disk + sunk)   # written and read back once a step
  host_update = (2.0 * (held + on_disk) if shapes.config.update_on == "host"
                 else 0.0)
  if target is not None:
    outside = target.device_figures   # the host and its disk, per GPU
    modelled = (program + host_update / outside["host_update"]
                + disk / outside["disk"])
  else:
    half = np.dtype(shapes.config.compute_dtype).itemsize < 4
    modelled = (flops / figures["flops16" if half else "flops32"]
                + data / figures["link"] + replica / figures["node_link"]
                + pcie / figures["pcie"]
                + host_update / figures["host_update"]
                + disk / figures["disk"])
  fits = (footprint["device"] <= device_budget
          and (host_budget is None or held <= host_budget))
  return Candidate(fields, int(footprint["device"]), int(held),
                   data, replica, pcie, host_update, disk, flops, modelled,
                   fits)


def _read(compiled, shapes: ZeroTrainState) -> tuple:
  """`(footprint, data-axis wire bytes, replica-axis wire bytes, FLOPs)` of
  a candidate's compiled step."""
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  return (compiled_footprint(compiled), *_wire_by_link(compiled, shapes),
          float((cost or {}).get("flops", 0.0)))


@functools.lru_cache(maxsize=None)
def _scheduled_reader(target) -> Callable:
  """`_read`'s figures and the modelled step of the scheduled program, for
  `target` (one function per target: `remembered` keys on it)."""
  def read(compiled, shapes: ZeroTrainState) -> tuple:
    model = target.model(compiled)   # (its FLOPs: XLA counts none here)
    return _read(compiled, shapes)[:3] + (model.flops, model.time)
  return read


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
  shard of one (`transfers.host_moves`) and its writes to host files
  (`transfers.host_writes`), read from the program lowered for a GPU, where they
  are visible (on CPU they lower to nothing)."""
  text = step.trace(shapes, batch).lower(
      lowering_platforms=("cuda",)).as_text()
  n = shapes.num_shards
  chunks = [tuple(c.shape) for c in shapes.layout.chunks]
  pieces = [c[:-1] + (c[-1] // n,) for c in chunks]
  moved = transfers.host_moves(text, chunks, pieces, n)
  sunk = transfers.host_writes(text, n) / n
  return (moved["pinned_host"] + moved["device"]) / n + sunk, sunk
