"""What a scheduled GPU program does in time: the collectives' overlap with
compute, and a modelled step time, read from the optimized HLO of a
program compiled for a GPU (`compiled.as_text()`, `is_scheduled=true`:
the order of each computation's instructions is the order they run).

    model = model_step(compiled.as_text(), target)
    model.time, model.exposed         # seconds per step, by the model
    model.collectives                 # each with what runs beside it

[Note: the modelled step]
The program runs on two queues, as XLA's GPU runtime runs it: a compute
stream that runs each computation's kernels in their scheduled order, and
a collective stream (and a host-copy stream for `copy-start`s) on which an
asynchronous collective runs from its `-start` to its `-done`. A kernel
takes the longer of its FLOPs at the card's peak for its dtype (matmuls,
convolutions, attention) and its bytes (operands and result) at the
card's memory bandwidth, plus a launch; a collective takes a latency plus
its wire bytes (`hlo.Collective.wire_bytes`: ring algorithms) over the
link its group crosses: NVLink within a host, the inter-node link per GPU
once a group spans hosts. A `-start` begins once the compute stream has
reached it and the collective stream is free; its `-done` holds the
compute stream until the collective ends. What it holds the stream for is
that collective's exposed time; a synchronous collective is exposed
whole. Loops run their body their known trip count; a conditional its
costliest branch. The model ranks programs and shows what hides what; it
does not predict a GPU's milliseconds (docs/decisions.md, "The modelled
step").
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Dict, List, Optional, Tuple

from zerojax._plan import hlo
from zerojax._plan.hlo_text import Instr, called, parse_module

# instructions that run no kernel
_FREE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast",
         "after-all", "partition-id", "replica-id", "opt-barrier",
         "add-dependency", "iota"}
_COLLECTIVE_START = re.compile(
    r"^(all-gather|reduce-scatter|all-reduce|all-to-all|collective-permute|"
    r"ragged-all-to-all|collective-broadcast)-start$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
_CONTRACTING = re.compile(r"lhs_contracting_dims=\{([\d,]*)\}")
_CUBLAS_CONTRACTING = re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]')
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")


@dataclasses.dataclass(frozen=True)
class Figures:
  """What the model needs of a card and its links (bytes/s one way,
  FLOP/s dense): see `zerojax._plan.targets` for where they come from."""
  flops_16: float          # 16-bit matmuls (tensor cores)
  flops_32: float          # 32-bit matmuls (TF32 tensor cores)
  memory_bandwidth: float  # HBM
  link: float              # NVLink, per GPU per direction
  node_link: float         # across hosts, per GPU
  pcie: float              # device <-> host
  gpus_per_host: int
  collective_latency: float = 10e-6
  kernel_launch: float = 1e-6


@dataclasses.dataclass(frozen=True)
class Timed:
  """One collective (or host copy) of the modelled step."""
  name: str
  kind: str              # "all-gather", ..., or "copy" (host copy)
  passes: str            # "forward", "backward" or "update" (op metadata)
  computation: str
  wire_bytes: float
  duration: float        # seconds, alone
  exposed: float         # seconds the compute stream waited for it
  between: int           # kernels scheduled between its start and done
  between_time: float    # their modelled seconds
  asynchronous: bool
  trips: int = 1

  @property
  def overlapped(self) -> bool:
    """Whether the schedule runs compute beside it."""
    return self.between > 0


@dataclasses.dataclass(frozen=True)
class StepModel:
  """The modelled step of one program (see [Note: the modelled step])."""
  time: float       # seconds
  compute: float    # seconds the compute stream ran kernels
  exposed: float    # seconds it waited for collectives and host copies
  flops: float
  collectives: Tuple[Timed, ...]

  def of(self, kind: Optional[str] = None, passes: Optional[str] = None):
    """The collectives of `kind` in pass `passes` (either None: all)."""
    return [c for c in self.collectives if kind in (None, c.kind)
            and passes in (None, c.passes)]

  def summary(self) -> dict:
    """Per kind and pass: count, how many overlap compute, wire bytes and
    exposed seconds (loops counted per trip)."""
    out: Dict[str, dict] = {}
    for c in self.collectives:
      row = out.setdefault(f"{c.kind} ({c.passes})", dict(
          count=0, overlapped=0, wire_bytes=0.0, exposed_s=0.0))
      row["count"] += c.trips
      row["overlapped"] += c.trips if c.overlapped else 0
      row["wire_bytes"] += c.trips * c.wire_bytes
      row["exposed_s"] += c.trips * c.exposed
    return out

  def to_dict(self) -> dict:
    """The figures, and `summary()` as `collectives`."""
    return dict(time_s=self.time, compute_s=self.compute,
                exposed_s=self.exposed, flops=self.flops,
                exposed_fraction=self.exposed / self.time if self.time else 0.0,
                collectives=self.summary())


def _elements(shape: str) -> List[Tuple[str, List[int]]]:
  return [(dtype, [int(d.strip().lstrip("<=")) for d in dims.split(",")
                   if d.strip()]) for dtype, dims in _ARRAY.findall(shape)]


def _passes(instr: Instr) -> str:
  """Which pass an instruction belongs to, by the jax transformation its
  metadata names: the backward's are under `transpose(...)`."""
  m = _OP_NAME.search(instr.attrs)
  name = m.group(1) if m else ""
  if "transpose(" in name:
    return "backward"
  if "jvp(" in name or "/shared_forward" in name:
    return "forward"
  return "update"


class _Costs:
  """Per-kernel FLOPs and bytes of a module's instructions."""

  def __init__(self, comps: Dict[str, List[Instr]]):
    self.comps = comps
    self.shapes = {c: {i.name: i.shape for i in instrs}
                   for c, instrs in comps.items()}

  def _operand_shape(self, comp: str, instr: Instr, k: int) -> str:
    inline = instr.operand_shapes[k] if k < len(instr.operand_shapes) else None
    return inline or self.shapes[comp].get(instr.operands[k], "")

  def _dot_flops(self, comp: str, instr: Instr, contracting: List[int]) -> \
      Tuple[float, bool]:
    result = _elements(instr.shape)
    lhs = _elements(self._operand_shape(comp, instr, 0))
    if not result or not lhs:
      return 0.0, False
    k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
    dtype = lhs[0][0]
    return 2.0 * math.prod(result[0][1]) * k, dtype in ("bf16", "f16",
                                                         "f8e4m3fn", "f8e5m2")

  def flops(self, comp: str, instr: Instr) -> Tuple[float, bool]:
    """(FLOPs of `instr`, whether in 16 bits or fewer)."""
    if instr.opcode == "dot":
      m = _CONTRACTING.search(instr.attrs)
      dims = [int(d) for d in m.group(1).split(",") if d] if m else []
      return self._dot_flops(comp, instr, dims)
    if instr.opcode == "convolution":
      out = _elements(instr.shape)
      kernel = _elements(self._operand_shape(comp, instr, 1))
      if out and kernel:
        # each output element: a multiply-add per kernel element / out feature
        per = math.prod(kernel[0][1]) / max(out[0][1][-1], 1)
        return 2.0 * math.prod(out[0][1]) * per, kernel[0][0] in ("bf16", "f16")
      return 0.0, False
    if instr.opcode == "custom-call":
      target = re.search(r'custom_call_target="([^"]*)"', instr.attrs)
      target = target.group(1) if target else ""
      if "gemm" in target or "matmul" in target:
        m = _CUBLAS_CONTRACTING.search(instr.attrs)
        dims = [int(d.strip().strip('"')) for d in m.group(1).split(",")
                if d.strip()] if m else [len(_elements(
                    self._operand_shape(comp, instr, 0))[0][1]) - 1]
        return self._dot_flops(comp, instr, dims)
      if "fmha" in target or "flash" in target:
        q = _elements(self._operand_shape(comp, instr, 0))
        kv = _elements(self._operand_shape(comp, instr, 1))
        if q and kv:   # [batch, seq, heads, dim]: QK^T and PV
          b, s, h, d = (q[0][1] + [1, 1, 1, 1])[:4]
          sk = kv[0][1][1] if len(kv[0][1]) > 1 else s
          f = 4.0 * b * h * s * sk * d
          return (2.5 * f if "Backward" in target or "bwd" in target else f,
                  q[0][0] in ("bf16", "f16"))
      return 0.0, False
    if instr.opcode == "fusion":
      total, low = 0.0, True
      for c in called(instr.attrs, "calls"):
        for inner in self.comps.get(c, []):
          f, lo = self.flops(c, inner)
          if f:
            total += f
            low = low and lo
      return total, low and total > 0
    return 0.0, False

  def bytes(self, comp: str, instr: Instr) -> float:
    """Bytes a kernel reads and writes: its operands and result, except
    that a fusion's operand read only through slices counts the slices,
    and a result that updates a slice in place counts the update (a
    scanned layer's step reads one layer of its stacked operands)."""
    fused = called(instr.attrs, "calls") if instr.opcode == "fusion" else []
    inner = self.comps.get(fused[0], []) if fused else []
    total = 0
    for k in range(len(instr.operands)):
      whole = hlo.shape_bytes(self._operand_shape(comp, instr, k))
      total += min(whole, self._sliced(inner, k)) if inner else whole
    total += (self._updated(inner) if inner else
              hlo.shape_bytes(instr.shape))
    return float(total)

  @staticmethod
  def _sliced(inner: List[Instr], k: int) -> float:
    """Bytes a fused computation reads of its parameter `k`: the results
    of the slices that are its only readers (nothing of a buffer updated
    in place), else all of it."""
    param = next((i for i in inner if i.opcode == "parameter"
                  and _parameter_number(i) == k), None)
    if param is None:
      return math.inf
    readers = [i for i in inner if param.name in i.operands]
    if readers and all(i.operands[0] == param.name and i.opcode in (
        "dynamic-slice", "slice", "dynamic-update-slice") for i in readers):
      # (the buffer a dynamic-update-slice updates in place is not read)
      return float(sum(hlo.shape_bytes(i.shape) for i in readers
                       if i.opcode != "dynamic-update-slice"))
    return math.inf

  @staticmethod
  def _updated(inner: List[Instr]) -> float:
    """Bytes a fused computation writes: its root's, or the update of a
    root `dynamic-update-slice` (in place)."""
    root = inner[-1] if inner else None
    if root is None:
      return 0.0
    if root.opcode == "dynamic-update-slice":
      update = next((i for i in inner if i.name == root.operands[1]), None)
      if update is not None:
        return float(hlo.shape_bytes(update.shape))
    return float(hlo.shape_bytes(root.shape))


def _parameter_number(instr: Instr) -> Optional[int]:
  """`n` of a `parameter(n)` instruction."""
  return int(instr.operands[0]) if instr.operands and \
      instr.operands[0].isdigit() else None


def _trips(instr: Instr) -> int:
  m = hlo._TRIP.search(instr.attrs)
  return int(m.group(1)) if m else 1


@dataclasses.dataclass
class _InFlight:
  kind: str
  wire: float
  duration: float
  end: float
  passes: str
  kernels: int = 0         # kernels run beside it so far
  kernel_time: float = 0.0


class _Simulation:
  """The two queues of [Note: the modelled step], run over a module."""

  def __init__(self, text: str, figures: Figures):
    self.comps, self.entry, self.devices = parse_module(text)
    self.costs = _Costs(self.comps)
    self.figures = figures
    self.now = 0.0        # the compute stream's clock
    self.kernels = 0.0    # seconds of kernels run
    self.flops = 0.0
    self.exposed = 0.0
    self.free = {"collective": 0.0, "copy": 0.0}   # when each queue frees
    self.timed: List[Timed] = []

  # -- costs --------------------------------------------------------------
  def kernel(self, comp: str, instr: Instr) -> float:
    flops, low = self.costs.flops(comp, instr)
    f = self.figures
    self.flops += flops
    return f.kernel_launch + max(flops / (f.flops_16 if low else f.flops_32),
                                 self.costs.bytes(comp, instr)
                                 / f.memory_bandwidth)

  def collective(self, comp: str, instr: Instr) -> Tuple[str, float, float]:
    """(kind, wire bytes, seconds) of a collective instruction."""
    kind, size, _, groups = hlo._collective(
        instr, self.comps[comp], self.costs.shapes[comp], self.devices)
    g = len(groups[0])
    if g <= 1:
      return kind, 0.0, 0.0
    factor = (1.0 if kind == "collective-permute" else
              2.0 * (g - 1) / g if kind == "all-reduce" else (g - 1) / g)
    hosts = {d // self.figures.gpus_per_host for d in groups[0]}
    link = self.figures.node_link if len(hosts) > 1 else self.figures.link
    return (kind, factor * size,
            self.figures.collective_latency + factor * size / link)

  def branch_cost(self, comp: str) -> float:
    return sum(self.costs.bytes(comp, i) for i in self.comps[comp]
               if i.opcode not in _FREE)
  # -- the queues -----------------------------------------------------------
  def issue(self, queue: str, kind: str, wire: float, duration: float,
            passes: str) -> _InFlight:
    begin = max(self.now, self.free[queue])
    self.free[queue] = begin + duration
    return _InFlight(kind, wire, duration, begin + duration, passes)

  def wait(self, until: float) -> float:
    waited = max(0.0, until - self.now)
    self.now += waited
    self.exposed += waited
    return waited

  def run(self, comp: str, trips: int = 1) -> None:
    in_flight: Dict[str, _InFlight] = {}
    for instr in self.comps[comp]:
      op = instr.opcode
      if op in _FREE:
        continue
      inner = (_async_inner(self.comps, instr) if op == "async-start"
               else (comp, instr) if _COLLECTIVE_START.match(op) else None)
      if inner is not None:
        kind, wire, duration = self.collective(*inner)
        in_flight[instr.name] = self.issue("collective", kind, wire,
                                           duration, _passes(instr))
      elif op == "copy-start":
        size = hlo.shape_bytes(self.costs._operand_shape(comp, instr, 0))
        in_flight[instr.name] = self.issue(
            "copy", "copy", float(size),
            self.figures.kernel_launch + size / self.figures.pcie,
            _passes(instr))
      elif op.endswith("-done") and instr.operands and \
          instr.operands[0] in in_flight:
        f = in_flight.pop(instr.operands[0])
        waited = self.wait(f.end)
        self.timed.append(Timed(instr.operands[0], f.kind, f.passes, comp,
                                f.wire, f.duration, waited, f.kernels,
                                f.kernel_time, True, trips))
      elif hlo._base_kind(op) is not None:   # synchronous
        kind, wire, duration = self.collective(comp, instr)
        waited = self.wait(self.issue("collective", kind, wire, duration,
                                      "").end)
        self.timed.append(Timed(instr.name, kind, _passes(instr), comp, wire,
                                duration, waited, 0, 0.0, False, trips))
      elif op == "while":
        n = _trips(instr)
        for body in called(instr.attrs, "body"):
          for _ in range(n):
            self.run(body, trips * n)
      elif op == "conditional":
        branches = (called(instr.attrs, "branch_computations") +
                    called(instr.attrs, "true_computation") +
                    called(instr.attrs, "false_computation"))
        if branches:
          self.run(max(branches, key=self.branch_cost), trips)
      elif op == "call":
        for c in called(instr.attrs, "to_apply"):
          self.run(c, trips)
      else:
        t = self.kernel(comp, instr)
        self.now += t
        self.kernels += t
        for f in in_flight.values():
          f.kernels += 1
          f.kernel_time += t


def model_step(text: str, figures: Figures) -> StepModel:
  """The modelled step of a scheduled program's HLO `text` on the card and
  links of `figures` (see [Note: the modelled step])."""
  sim = _Simulation(text, figures)
  sim.run(sim.entry)
  end = max(sim.now, *sim.free.values())
  return StepModel(end, sim.kernels, sim.exposed + (end - sim.now),
                   sim.flops, _merge(sim.timed))


def _merge(timed: List[Timed]) -> Tuple[Timed, ...]:
  """One entry per collective: a loop body's, run once per trip, keeps its
  first trip's figures (`trips` says how many)."""
  first: Dict[tuple, Timed] = {}
  for t in timed:
    first.setdefault((t.computation, t.name), t)
  return tuple(first.values())


def _async_inner(comps, instr: Instr) -> Optional[Tuple[str, Instr]]:
  """(computation, collective) an `async-start` wraps, or None."""
  for c in called(instr.attrs, "calls"):
    for inner in comps.get(c, []):
      if hlo._base_kind(inner.opcode):
        return c, inner
  return None
