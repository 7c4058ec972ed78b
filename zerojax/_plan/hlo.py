"""Collectives of a compiled XLA program, counted from its optimized HLO text
(`zerojax.plan`'s communication model, and the benchmarks' tables).

    report = count_collectives(jax.jit(f).lower(*args).compile())
    report.summary()   # {"all-gather": {"ops", "count", "bytes", ...}, ...}

What is counted: all-gather, reduce-scatter, all-reduce, all-to-all and
collective-permute, in their synchronous form or their asynchronous pair
(`all-gather-start` / `all-gather-done`, or a generic `async-start` wrapping
the op), each counted once.

Bytes, per device, are the logical buffer the collective works on, summed
over the operands/results of variadic (tuple-shaped) ops:

  all-gather          the gathered output (the whole array after the gather)
  reduce-scatter      the input before scattering (output x group size)
  all-reduce          the operand (equal to the output)
  all-to-all          the operand
  collective-permute  the operand (what each device sends)

With these definitions an fp32 ZeRO step over Ψ parameters moves
4Ψ bytes of all-reduce at stage 0, 4Ψ reduce-scatter + 4Ψ all-gather at
stages 1-2, and 4Ψ reduce-scatter + 8Ψ all-gather at stage 3.
`wire_bytes` estimates what one device sends with ring algorithms over a
group of g devices: (g-1)/g x bytes for all-gather, reduce-scatter and
all-to-all, 2(g-1)/g x bytes for all-reduce, bytes for collective-permute.

Loops: an op inside a while body (a `lax.scan`, `nn.scan`) runs once per
iteration. Where XLA recorded the loop's trip count (`known_trip_count` in the
while's backend_config) the op's `trips` is the product of the trip counts of
its enclosing loops, and `summary()` counts it that many times. Ops in loops
of unknown trip count are left out of `summary()` and reported per iteration
by `unknown_trip_summary()` ("in loop bodies"). Ops in conditional branches
are counted as if their branch ran.

The bytes are those of the compiled program: XLA's CPU backend, for one,
runs 16-bit all-gathers and reduce-scatters in float32.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from zerojax._plan.hlo_text import (Instr, called, match_bracket, parse_module,
                                   split_top)


KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
         "collective-permute")

# Bits per element of the HLO primitive types.
_BITS = {
    "pred": 8, "s2": 2, "u2": 2, "s4": 4, "u4": 4, "s8": 8, "u8": 8,
    "s16": 16, "u16": 16, "s32": 32, "u32": 32, "s64": 64, "u64": 64,
    "f16": 16, "bf16": 16, "f32": 32, "f64": 64, "c64": 64, "c128": 128,
    "f8e5m2": 8, "f8e4m3fn": 8, "f8e4m3b11fnuz": 8, "f8e5m2fnuz": 8,
    "f8e4m3fnuz": 8, "f8e4m3": 8, "f8e3m4": 8, "f8e8m0fnu": 8, "f4e2m1fn": 4,
    "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_TRIP = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')


# ---- shapes ----------------------------------------------------------------
def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape string (`f32[8,128]{1,0}`, tuples summed)."""
  bits = 0
  for dtype, dims in _ARRAY.findall(shape):
    if dtype not in _BITS:
      raise ValueError(f"unknown HLO element type {dtype!r} in {shape!r}")
    n = 1
    for d in dims.split(","):
      d = d.strip().lstrip("<=")
      if d:
        n *= int(d)
    bits += n * _BITS[dtype]
  return (bits + 7) // 8


def _dtypes(shape: str) -> Tuple[str, ...]:
  return tuple(dict.fromkeys(t for t, _ in _ARRAY.findall(shape)))


def _tuple_items(shape: str) -> List[str]:
  """Top-level elements of a tuple shape `(a, (b, c))` -> ["a", "(b, c)"]."""
  shape = shape.strip()
  if not shape.startswith("("):
    return [shape]
  return split_top(shape[1:match_bracket(shape, 0)])


def replica_groups(attrs: str, devices: int) -> Tuple[Tuple[int, ...], ...]:
  """The device groups of a collective's `replica_groups` (partition ids:
  positions in the program's device assignment, a mesh's devices in
  row-major order), in the three forms XLA prints: the iota form
  `[G,S]<=[dims]T(perm)`, the mesh-axes form of newer XLA
  `mesh['a'=2,'b'=4]{'b'}` (one group per value of the other axes, over the
  named ones; no braces: all of them), and explicit `{{0,1},{2,3}}`. None
  given: one group of all `devices`."""
  m = re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\]"
                r"(?:T\(([\d,]+)\))?", attrs)
  if m:
    dims = [int(x) for x in m.group(3).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(4):
      ids = ids.transpose([int(x) for x in m.group(4).split(",")])
    return tuple(map(tuple, ids.reshape(int(m.group(1)), int(m.group(2))).tolist()))
  m = re.search(r"replica_groups=mesh\[([^\]]*)\](\s*\{([^}]*)\})?", attrs)
  if m:
    sizes = {}
    for item in m.group(1).split(","):
      name, size = item.rsplit("=", 1)
      sizes[name.strip().strip("'\"")] = int(size)
    names = list(sizes)
    axes = ([a.strip().strip("'\"") for a in m.group(3).split(",") if a.strip()]
            if m.group(2) else names)
    ids = np.arange(math.prod(sizes.values())).reshape(list(sizes.values()))
    order = [i for i, a in enumerate(names) if a not in axes] + [
        names.index(a) for a in axes]
    group = math.prod(sizes[a] for a in axes)
    return tuple(map(tuple, ids.transpose(order).reshape(-1, group).tolist()))
  m = re.search(r"replica_groups=\{", attrs)
  if m:
    groups = attrs[m.end() - 1:match_bracket(attrs, m.end() - 1) + 1]
    found = tuple(tuple(int(x) for x in g.split(",") if x.strip())
                  for g in re.findall(r"\{([\d,\s]+)\}", groups))
    if found:
      return found
  return (tuple(range(devices)),)


# ---- the report --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Collective:
  """One collective op of the program.

  `trips` is how many times it runs per call of the program: 1 outside
  loops, the product of the enclosing loops' known trip counts inside, None
  when a loop's trip count is unknown. `in_loop` says it sits in a loop body.
  """
  kind: str
  name: str
  computation: str
  bytes: int
  group_size: int
  dtypes: Tuple[str, ...]
  trips: Optional[int]
  in_loop: bool
  groups: Tuple[Tuple[int, ...], ...] = ()   # `replica_groups`

  def spans(self, mesh_shape: Tuple[int, ...], axis: int) -> bool:
    """Whether a group of this op has devices at two coordinates of mesh
    axis `axis` (a mesh of `mesh_shape`, devices in row-major order)."""
    return any(len({np.unravel_index(d, mesh_shape)[axis] for d in g}) > 1
               for g in self.groups)

  @property
  def wire_bytes(self) -> float:
    g = self.group_size
    if self.kind == "collective-permute":
      return float(self.bytes)
    factor = 2.0 if self.kind == "all-reduce" else 1.0
    return factor * self.bytes * (g - 1) / max(g, 1)


@dataclasses.dataclass(frozen=True)
class CommReport:
  """The collectives of one program (see the module docstring)."""
  ops: Tuple[Collective, ...]
  devices: int

  def summary(self) -> Dict[str, Dict[str, float]]:
    """Per kind, ops of known trip count: `ops` (distinct ops in the HLO),
    `count` and `bytes` / `wire_bytes` per program run (loops multiplied)."""
    out = {}
    for op in self.ops:
      if op.trips is None:
        continue
      row = out.setdefault(op.kind, {"ops": 0, "count": 0, "bytes": 0,
                                     "wire_bytes": 0.0, "in_loop_count": 0})
      row["ops"] += 1
      row["count"] += op.trips
      row["bytes"] += op.trips * op.bytes
      row["wire_bytes"] += op.trips * op.wire_bytes
      if op.in_loop:
        row["in_loop_count"] += op.trips
    return {k: out[k] for k in sorted(out, key=_kind_order)}

  def unknown_trip_summary(self) -> Dict[str, Dict[str, int]]:
    """Per kind, ops in loop bodies of unknown trip count, once each (they
    run once per iteration)."""
    out = {}
    for op in self.ops:
      if op.trips is None:
        row = out.setdefault(op.kind, {"ops": 0, "bytes_per_iteration": 0})
        row["ops"] += 1
        row["bytes_per_iteration"] += op.bytes
    return {k: out[k] for k in sorted(out, key=_kind_order)}

  def count(self, kind: Optional[str] = None) -> int:
    rows = self.summary()
    return sum(r["count"] for k, r in rows.items() if kind in (None, k))

  def bytes(self, kind: Optional[str] = None) -> int:
    rows = self.summary()
    return sum(r["bytes"] for k, r in rows.items() if kind in (None, k))

  def to_dict(self) -> Dict[str, Any]:
    return {
        "devices": self.devices,
        "per_kind": self.summary(),
        "in_loop_bodies_unknown_trips": self.unknown_trip_summary(),
        "loop_ops": [dataclasses.asdict(op) for op in self.ops if op.in_loop],
        "total_count": self.count(),
        "total_bytes": self.bytes(),
    }


def _kind_order(kind: str) -> int:
  return KINDS.index(kind) if kind in KINDS else len(KINDS)


def _base_kind(opcode: str) -> Optional[str]:
  for kind in KINDS + ("ragged-all-to-all", "collective-broadcast"):
    if opcode == kind or opcode == kind + "-start":
      return kind
  return None


def _collective(instr: Instr, comp: List[Instr], table: Dict[str, str],
                devices: int) -> Tuple[str, int, Tuple[str, ...], int]:
  kind = _base_kind(instr.opcode)
  operand = " ".join(s if s is not None else table.get(n, "")
                     for n, s in zip(instr.operands, instr.operand_shapes))
  result = instr.shape
  if instr.opcode.endswith("-start"):
    done = next((i for i in comp if i.opcode == kind + "-done"
                 and i.operands and i.operands[0] == instr.name), None)
    if done is not None:
      result = done.shape
    elif kind == "all-gather":          # (operands, outputs)
      items = _tuple_items(result)
      result = " ".join(items[len(items) // 2:])
  if kind == "all-gather":
    size = shape_bytes(result)
  elif kind == "all-reduce":
    size = shape_bytes(operand) or shape_bytes(result)
  else:
    size = shape_bytes(operand)
  return kind, size, _dtypes(operand or result), replica_groups(instr.attrs,
                                                                devices)


def count_collectives(program: Any) -> CommReport:
  """Counts the collectives of a compiled program.

  Args:
    program: a `jax.stages.Compiled`, a `jax.stages.Lowered` (compiled
      here), or the optimized HLO text (`compiled.as_text()`).

  Returns:
    A `CommReport`.
  """
  if hasattr(program, "compile") and not hasattr(program, "memory_analysis"):
    program = program.compile()
  text = program if isinstance(program, str) else program.as_text()
  comps, entry, devices = parse_module(text)
  tables = {c: {i.name: i.shape for i in instrs} for c, instrs in comps.items()}
  ops: List[Collective] = []

  def walk(comp: str, trips: Optional[int], in_loop: bool, seen: tuple):
    if comp not in comps or comp in seen:
      return
    instrs = comps[comp]
    for instr in instrs:
      kind = _base_kind(instr.opcode)
      if kind is not None:
        kind, size, dtypes, groups = _collective(instr, instrs, tables[comp],
                                                 devices)
        ops.append(Collective(kind, instr.name, comp, size, len(groups[0]),
                              dtypes, trips, in_loop, groups))
        continue
      if instr.opcode == "while":
        m = _TRIP.search(instr.attrs)
        n = int(m.group(1)) if m else None
        inner = trips * n if (trips is not None and n is not None) else None
        for body in called(instr.attrs, "body"):
          walk(body, inner, True, seen + (comp,))
      elif instr.opcode == "conditional":
        for key in ("branch_computations", "true_computation",
                    "false_computation"):
          for c in called(instr.attrs, key):
            walk(c, trips, in_loop, seen + (comp,))
      elif instr.opcode == "call":
        for c in called(instr.attrs, "to_apply"):
          walk(c, trips, in_loop, seen + (comp,))
      elif instr.opcode in ("fusion", "async-start", "custom-call"):
        for c in called(instr.attrs, "calls"):
          walk(c, trips, in_loop, seen + (comp,))

  walk(entry, 1, False, ())
  return CommReport(tuple(ops), devices)
