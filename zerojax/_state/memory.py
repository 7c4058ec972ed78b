"""Bytes per device: measured from a state's arrays, predicted from Ψ, and
read from a compiled step. Never imports `step`.

The predictions follow docs/design.md's table (Adam: two fp32 moments, 8 bytes a
parameter; no persistent 16-bit copy at stages 0 and 3):

  stage   float32 training     16-bit compute, fp32 master
  0       12Ψ                  12Ψ
  1, 2    4Ψ + 8Ψ/N            2Ψ + 12Ψ/N
  3       12Ψ/N                12Ψ/N

next to the ZeRO paper's mixed-precision figures (16Ψ, 4Ψ+12Ψ/N, 2Ψ+14Ψ/N,
16Ψ/N). zerojax accumulates micro-batches inside one step, so the gradient
accumulator is transient (in the step's temp memory): 4Ψ at stages 0-1, 4Ψ/N
at stages 2-3, reported beside the persistent figures.

Under hpZ (`ZeroConfig.hpz`) N is replica x data for the persistent state,
and stage 3's step also holds ZeRO++'s secondary partition, the compute-dtype
parameters gathered over the replica axis: b·Ψ/D with D the data axis
(transient, reported beside the accumulator, which is 4Ψ/D there).

Under quantized collectives (`quantize_weights` / `quantize_grads`) the
report says which chunks' shards are padded with zeros to whole blocks on
the wire, and by how much: zerojax pads rather than falling back to the
plain collective, so every chunk goes quantized.
"""
from __future__ import annotations

import dataclasses
import re
from collections import defaultdict
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._tiers import disk_tier
from zerojax._core import frozen
from zerojax._core import offload
from zerojax._comm import quantize
from zerojax._state.state import ZeroTrainState, check_live

CATEGORIES = ("master parameters", "compute parameters", "frozen weights",
              "optimizer state", "loss scale", "other")


def _kind(x) -> str:
  return getattr(x.sharding, "memory_kind", None) or "device"


def per_device_bytes(tree) -> int:
  """Bytes `tree`'s arrays occupy on their most loaded device: a
  `jax.Array` from its addressable shards, a `jax.ShapeDtypeStruct` carrying
  a sharding (what `shard_shape` returns) from its shard shape, anything
  else whole."""
  return sum(_leaf_bytes(x) for x in jax.tree_util.tree_leaves(tree))


def _leaf_bytes(x) -> int:
  if isinstance(x, jax.ShapeDtypeStruct) and x.sharding is not None:
    shape = x.sharding.shard_shape(x.shape)
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
  if not isinstance(x, jax.Array):
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize
  by_device = defaultdict(int)
  for shard in x.addressable_shards:
    by_device[shard.device] += shard.data.nbytes
  return max(by_device.values(), default=0)


def estimate_memory(num_params: int, *, stage: int, num_devices: int,
                    compute_dtype: Any = jnp.float32, accum_steps: int = 1,
                    optimizer_bytes_per_param: int = 8,
                    hpz_group: Optional[int] = None,
                    split_params: int = 0, model_shards: int = 1,
                    frozen_bytes: int = 0) -> dict:
  """Predicted bytes per device, allocating nothing (DeepSpeed's
  `estimate_zero3_model_states_mem_needs`).

  Args:
    num_params: Ψ, trainable parameters.
    stage: ZeRO stage 0-3.
    num_devices: N, devices the state is sharded over: the data axis (R·D
      under hpZ).
    compute_dtype: float32, or a 16-bit dtype (fp32 master kept).
    accum_steps: micro-batches per step (sizes the transient accumulator).
    optimizer_bytes_per_param: 8 for Adam/AdamW (two fp32 moments), 4 for
      momentum, 0 for plain SGD.
    hpz_group: hpZ: D, the devices of the data axis, within which the step
      gathers and reduce-scatters; None without hpZ.
    split_params: tensor parallelism: how many of the Ψ parameters the
      model splits over its model axis; a device holds 1/`model_shards`
      of what the table gives for them (each model device keeps its rows).
    model_shards: M, the devices of the model axis.
    frozen_bytes: the frozen weights' bytes as stored (`zerojax._core.frozen`:
      in the compute dtype, or int8 blocks), split over the data axis (D
      under hpZ) at stage 3, whole below.

  Returns:
    dict with `persistent` (zerojax, per device), its parts (`master`,
    `compute`, `frozen`, `optimizer`), `accumulator` (transient, 0 without
    accumulation), `secondary` (hpZ at stage 3: the secondary partition,
    transient; else 0) and `paper` (the ZeRO paper's mixed-precision
    figure).
  """
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0-3.")
  if num_devices < 1 or num_params < 0:
    raise ValueError("num_devices must be >= 1 and num_params >= 0.")
  if hpz_group is not None and not (
      1 <= hpz_group <= num_devices and num_devices % hpz_group == 0):
    raise ValueError(f"hpz_group={hpz_group!r} must divide num_devices="
                     f"{num_devices} (the data axis D of R·D devices).")
  if not (0 <= split_params <= num_params and model_shards >= 1):
    raise ValueError(f"split_params={split_params!r} must lie in [0, "
                     f"num_params] and model_shards={model_shards!r} be >= 1.")
  # per device, a split parameter weighs 1/M of a whole one
  psi = float(num_params - split_params) + split_params / model_shards
  n = float(num_devices)
  half = np.dtype(compute_dtype).itemsize < 4
  opt = optimizer_bytes_per_param * psi / (n if stage >= 1 else 1)
  if stage == 0:
    master, compute = 4 * psi, 0.0
  elif stage in (1, 2):
    master = 4 * psi / n if half else 4 * psi
    compute = 2 * psi if half else 0.0
  else:
    master, compute = 4 * psi / n, 0.0
  group = float(hpz_group or num_devices)   # where gradients are reduced first
  accumulator = 0.0 if accum_steps == 1 else 4 * psi / (group if stage >= 2 else 1)
  secondary = (np.dtype(compute_dtype).itemsize * psi / group
               if hpz_group is not None and stage == 3 else 0.0)
  frozen = frozen_bytes / (float(hpz_group or num_devices) if stage == 3
                           else 1)
  paper = {0: 16 * psi, 1: 4 * psi + 12 * psi / n, 2: 2 * psi + 14 * psi / n,
           3: 16 * psi / n}[stage]
  return {"persistent": int(master + compute + frozen + opt),
          "master": int(master), "compute": int(compute),
          "frozen": int(frozen), "optimizer": int(opt),
          "accumulator": int(accumulator), "secondary": int(secondary),
          "paper": int(paper)}


@dataclasses.dataclass
class MemoryReport:
  """Per-device bytes of a ZeroTrainState, by category and memory kind."""
  stage: int
  num_devices: int
  num_params: int
  compute_dtype: str
  accum_steps: int
  measured: dict            # category -> {memory kind -> bytes}
  estimate: dict            # from `estimate_memory`
  wire: dict = dataclasses.field(default_factory=dict)  # `quantized_wire`
  placement: dict = dataclasses.field(default_factory=dict)  # `placement`
  model_split: Optional[tuple] = None   # tensor parallelism: (split Ψ, M)

  @property
  def persistent(self) -> int:
    return sum(sum(k.values()) for k in self.measured.values())

  def by_kind(self) -> dict:
    out = defaultdict(int)
    for kinds in self.measured.values():
      for kind, b in kinds.items():
        out[kind] += b
    return dict(out)

  def __str__(self) -> str:
    kinds = sorted({k for v in self.measured.values() for k in v} | {"device"})
    mib = lambda b: f"{b / 2 ** 20:,.2f}"
    head = ["per device (MiB)"] + kinds + ["total"]
    rows = []
    for cat in CATEGORIES:
      parts = self.measured.get(cat, {})
      rows.append([cat] + [mib(parts.get(k, 0)) for k in kinds] +
                  [mib(sum(parts.values()))])
    rows.append(["persistent, measured"] + [mib(self.by_kind().get(k, 0))
                                            for k in kinds] + [mib(self.persistent)])
    blank = [""] * len(kinds)
    est = self.estimate
    rows.append(["expected (zerojax's formula)"] + blank + [mib(est["persistent"])])
    rows.append(["ZeRO paper (mixed precision)"] + blank + [mib(est["paper"])])
    if est["accumulator"]:
      rows.append(["+ accumulator (in step)"] + blank + [mib(est["accumulator"])])
    if est.get("secondary"):
      rows.append(["+ hpZ secondary partition (in step)"] + blank +
                  [mib(est["secondary"])])
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                              for i, (c, w) in enumerate(zip(r, widths)))
    title = (f"ZeRO-{self.stage}, {self.num_devices} devices, Ψ = "
             f"{self.num_params:,} parameters, {self.compute_dtype} compute, "
             f"accum {self.accum_steps}")
    if self.model_split:
      split, m = self.model_split
      title += (f"; tensor parallel: {split:,} of them split over {m} model "
                "devices")
    lines = [title, fmt(head), fmt(["-" * w for w in widths])] + [
        fmt(r) for r in rows]
    where = self.placement
    if where:
      tier = "disk" if "disk" in where else "host"
      lines.append(
          f"optimizer state by chunk ({where['placement']} placement"
          + (f", device_budget={where['device_budget']!r}"
             if where["device_budget"] is not None else "") +
          f"): {tier} {_chunk_list(where[tier])}, device "
          f"{_chunk_list(where['device'])}")
    w = self.wire
    if w:
      lines.append(
          f"quantized wire: weights {w['weights'] or 'plain'}, gradients "
          f"{w['grads'] or 'plain'}, blocks of {w['block']}; "
          f"{len(w['padded_chunks'])} of {w['chunks']} chunks' shards padded "
          f"with zeros to whole blocks (+{w['padding']:.2%} elements on the "
          "wire), none sent plain")
    return "\n".join(lines)


def memory_report(state) -> MemoryReport:
  """Measured per-device bytes of `state` (a ZeroTrainState), with
  `estimate_memory`'s and the ZeRO paper's figures for the same Ψ, N and
  stage."""
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"memory_report() takes a ZeroTrainState, got "
                    f"{type(state).__name__}.")
  check_live(state, "memory_report()")
  cfg = state.config
  parts = {
      "master parameters": state.master,
      "compute parameters": state.compute,
      "optimizer state": state.opt_state,
      "frozen weights": [x for i, x in zip(state.layout.rest_indices,
                                           state.rest)
                         if frozen.is_weight(state.layout.leaves[i])],
      "loss scale": state.loss_scale,
      "other": (state.step, state.extras,
                [x for i, x in zip(state.layout.rest_indices, state.rest)
                 if not frozen.is_weight(state.layout.leaves[i])]),
  }
  measured = {}
  for cat, tree in parts.items():
    kinds = defaultdict(int)
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=disk_tier.is_on_disk):
      if disk_tier.is_on_disk(leaf):   # this device's share of the file
        kinds["disk"] += leaf.nbytes // state.num_state_shards
      else:
        kinds[_kind(leaf)] += per_device_bytes(leaf)
    measured[cat] = dict(kinds)
  opt_bytes = sum(
      x.size * np.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(
          state.opt_state, is_leaf=disk_tier.is_on_disk) if len(x.shape))
  psi = state.layout.num_chunked_elements
  padded = sum(int(np.prod(c.shape)) for c in state.layout.chunks)
  opt_bytes = round(opt_bytes / padded) if padded else 0
  split = state.layout.num_split_elements
  model = state.mesh.shape[cfg.model_axis] if cfg.model_axis else 1
  estimate = estimate_memory(psi, stage=cfg.stage,
                             num_devices=state.num_state_shards,
                             compute_dtype=cfg.compute_dtype,
                             accum_steps=cfg.accum_steps,
                             optimizer_bytes_per_param=opt_bytes,
                             hpz_group=state.num_shards if cfg.hpz else None,
                             split_params=split, model_shards=model,
                             frozen_bytes=sum(
                                 x.size * np.dtype(x.dtype).itemsize
                                 for x in jax.tree_util.tree_leaves(
                                     parts["frozen weights"])))
  return MemoryReport(cfg.stage, state.num_state_shards, psi,
                      np.dtype(cfg.compute_dtype).name, cfg.accum_steps,
                      measured, estimate, quantized_wire(state),
                      placement(state), (split, model) if split else None)


def placement(state) -> dict:
  """{} without offload under manual placement; else which chunks' optimizer
  state is on host (under "disk" for the disk tier) and which on the
  device, and the placement fields."""
  cfg = state.config
  if not cfg.offload_optimizer and cfg.placement == "manual":
    return {}
  host = sorted(offload.optimizer_chunks(state.layout, cfg))
  return {"placement": cfg.placement, "device_budget": cfg.device_budget,
          "disk" if cfg.disk else "host": host, "device": sorted(
              set(range(len(state.layout.chunks))) - set(host))}


def _chunk_list(chunks) -> str:
  return ("none" if not chunks else
          f"{len(chunks)} chunk(s): " + ", ".join(map(str, chunks)))


def quantized_wire(state) -> dict:
  """{} without quantized collectives; else the modes, the block, the chunks
  whose data-axis shards are not whole blocks (`padded_chunks`, padded with
  zeros on the wire), the chunk count and the padding as a fraction of the
  elements sent."""
  cfg = state.config
  if cfg.quantize_weights is None and cfg.quantize_grads is None:
    return {}
  sizes, padded_chunks = [], []
  for c, chunk in enumerate(state.layout.chunks):
    rows = int(np.prod(chunk.shape[:-1]))
    n = chunk.shape[-1] // state.num_shards
    # int4 pads an odd block to an even count: the larger of the two
    out = max(quantize.padded(n, quantize.of(m, cfg.quantize_block))
              for m in (cfg.quantize_weights, cfg.quantize_grads) if m)
    sizes.append((rows * n, rows * out))
    if out != n:
      padded_chunks.append(c)
  sent = sum(n for n, _ in sizes)
  return {"weights": cfg.quantize_weights, "grads": cfg.quantize_grads,
          "block": cfg.quantize_block, "chunks": len(sizes),
          "padded_chunks": padded_chunks,
          "padding": sum(p for _, p in sizes) / sent - 1 if sent else 0.0}


_HOST_MEMORY_SPACE = "S(5)"   # XLA's host memory space in a layout
_SHAPE = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\](?:\{([^{}]*)\})?")
_ALIAS = re.compile(r"\{([0-9, ]*)\}:\s*\((\d+),")


def _entry_buffers(hlo_text: str) -> tuple:
  """([(bytes, on_host)] of the parameters, same of the outputs, {output:
  parameter} aliases) from the module header of a compiled, partitioned
  program: its `entry_computation_layout` (per-device shapes, with the
  memory space in each layout) and its `input_output_alias`."""
  header = hlo_text.split("\n", 1)[0]
  layout = header.split("entry_computation_layout={", 1)[1]
  depth, end = 1, 0
  while depth:
    depth += {"{": 1, "}": -1}.get(layout[end], 0)
    end += 1
  params, outputs = layout[:end - 1].split(")->", 1)

  def buffers(text):
    out = []
    for dtype, dims, lay in _SHAPE.findall(text):
      size = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
      bits = re.search(r"\d+", dtype)     # f32, bf16, s4, f8e4m3fn; pred
      width = max(int(bits.group()) // 8, 1) if bits else 1
      out.append((size * width, _HOST_MEMORY_SPACE in (lay or "")))
    return out

  aliases = {}
  if "input_output_alias={" in header:
    for index, param in _ALIAS.findall(header.split("input_output_alias={", 1)[1]
                                       .split("}, entry_computation_layout", 1)[0]):
      aliases[int(index.split(",")[0]) if index.strip() else 0] = int(param)
  return buffers(params), buffers(outputs), aliases


def compiled_footprint(compiled) -> dict:
  """Per-device bytes of a compiled program (`jax.jit(f).lower(...).compile()`
  or a `step.lower(state, batch).compile()`).

  Measured, from `memory_analysis()`: `argument`, `output`, `temp`, `alias`
  and `footprint` = argument + output + temp - alias.

  The host split: the CPU backend leaves `memory_analysis()`'s host_* fields
  at 0 and counts host-resident buffers in argument/output/alias. The
  memory space of every parameter and output is read from the compiled
  module's entry layout (`S(5)` = host) and its input/output aliases:
  `host_argument`, `host_output`, `host_alias` (host outputs that reuse a
  donated host argument), and `device` = footprint - host_argument -
  host_output + host_alias, the bytes that must fit in device memory. Where
  a backend fills the host_* fields itself, they are used and `device` is
  the footprint as reported (assumed, not checked: no such backend here).
  Temporaries are all counted as device memory; on CPU the host <-> device
  copies of offloaded arrays compile to nothing, so `temp` holds no device
  copy of an offloaded array (an accelerator's would, while it is in use).
  """
  ma = compiled.memory_analysis()
  out = {"argument": int(ma.argument_size_in_bytes),
         "output": int(ma.output_size_in_bytes),
         "temp": int(ma.temp_size_in_bytes),
         "alias": int(ma.alias_size_in_bytes)}
  out["footprint"] = out["argument"] + out["output"] + out["temp"] - out["alias"]
  reported = {k: int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0)
              for k in ("argument", "output", "alias", "temp")}
  if any(reported.values()):
    out.update({f"host_{k}": v for k, v in reported.items()})
    out["device"] = out["footprint"]
    return out
  params, outputs, aliases = _entry_buffers(compiled.as_text())
  out["host_argument"] = sum(b for b, host in params if host)
  out["host_output"] = sum(b for b, host in outputs if host)
  out["host_alias"] = sum(outputs[o][0] for o, p in aliases.items()
                          if o < len(outputs) and outputs[o][1] and params[p][1])
  out["device"] = (out["footprint"] - out["host_argument"] - out["host_output"]
                   + out["host_alias"])
  return out
