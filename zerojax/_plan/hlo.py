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

from zerojax._core import compat

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
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")
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
  return _split_top(shape[1:_match(shape, 0)])


# ---- text scanning ---------------------------------------------------------
def _match(s: str, i: int) -> int:
  """Index of the bracket closing the one at s[i], skipping quoted text."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, quoted = [], False
  for j in range(i, len(s)):
    c = s[j]
    if c == '"' and (j == 0 or s[j - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j
  raise ValueError(f"unbalanced brackets in HLO: {s[i:i + 80]!r}")


def _split_top(s: str) -> List[str]:
  """Splits on commas that are not nested in brackets or quotes."""
  out, depth, quoted, start = [], 0, False, 0
  for j, c in enumerate(s):
    if c == '"' and (j == 0 or s[j - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
    elif c == "," and depth == 0:
      out.append(s[start:j].strip())
      start = j + 1
  if s[start:].strip():
    out.append(s[start:].strip())
  return out


@dataclasses.dataclass
class _Instr:
  name: str
  shape: str
  opcode: str
  operands: List[str]            # operand names
  operand_shapes: List[Optional[str]]  # inline shapes when printed
  attrs: str


def _parse_instruction(line: str) -> Optional[_Instr]:
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  eq = line.find(" = ")
  if eq < 0:
    return None
  name = line[:eq].strip().lstrip("%")
  rest = line[eq + 3:].lstrip()
  # A tuple shape ends at its closing bracket, an array shape (with its
  # layout, `f32[8,4]{1,0}`) at the first space.
  end = _match(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  shape, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
  if not m:
    return None
  opcode = m.group(1)
  open_at = m.end() - 1
  close = _match(rest, open_at)
  operands, operand_shapes = [], []
  for arg in _split_top(rest[open_at + 1:close]):   # "%x" or "f32[8] %x"
    pieces = arg.rsplit(" ", 1)
    operands.append(pieces[-1].lstrip("%"))
    operand_shapes.append(pieces[0] if len(pieces) == 2 else None)
  return _Instr(name, shape, opcode, operands, operand_shapes,
                rest[close + 1:])


def _parse_module(text: str):
  """{computation: [instructions]}, the entry computation's name, and the
  module's device count (num_partitions x replica_count)."""
  comps: Dict[str, List[_Instr]] = {}
  entry, current = None, None
  devices = 1
  for line in text.splitlines():
    if line.startswith("HloModule"):
      parts = re.search(r"num_partitions=(\d+)", line)
      reps = re.search(r"replica_count=(\d+)", line)
      devices = (int(parts.group(1)) if parts else 1) * (
          int(reps.group(1)) if reps else 1)
      continue
    stripped = _COMMENT.sub("", line).strip()
    if current is None:
      m = _HEADER.match(stripped)
      if m and " = " not in stripped.split("(", 1)[0]:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if stripped == "}":
      current = None
      continue
    instr = _parse_instruction(stripped)
    if instr is not None:
      comps[current].append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text; pass the text of "
                     "a compiled module (compiled.as_text()).")
  return comps, entry, devices


def _called(attrs: str, key: str) -> List[str]:
  m = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", attrs)
  if not m:
    return []
  value = m.group(1).strip("{}")
  return [v.strip().lstrip("%") for v in value.split(",") if v.strip()]


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
    groups = attrs[m.end() - 1:_match(attrs, m.end() - 1) + 1]
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


def _collective(instr: _Instr, comp: List[_Instr], table: Dict[str, str],
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
  comps, entry, devices = _parse_module(text)
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
        for body in _called(instr.attrs, "body"):
          walk(body, inner, True, seen + (comp,))
      elif instr.opcode == "conditional":
        for key in ("branch_computations", "true_computation",
                    "false_computation"):
          for c in _called(instr.attrs, key):
            walk(c, trips, in_loop, seen + (comp,))
      elif instr.opcode == "call":
        for c in _called(instr.attrs, "to_apply"):
          walk(c, trips, in_loop, seen + (comp,))
      elif instr.opcode in ("fusion", "async-start", "custom-call"):
        for c in _called(instr.attrs, "calls"):
          walk(c, trips, in_loop, seen + (comp,))

  walk(entry, 1, False, ())
  return CommReport(tuple(ops), devices)


# ---- host <-> device moves (a program lowered for a GPU) -----------------------
_PLACEMENT = re.compile(r'annotate_device_placement\((%[\w.]+)(?:#\d+)?\).*'
                        r'_xla_buffer_placement = "(\w+)"\}\} : '
                        r'\(tensor<((?:\d+x)*)(\w+)>')
_HOST_CALL = re.compile(r'^\s*(%[\w.]+)(?::\d+)? = (?:func\.)?call @\S+\(.*'
                        r'_xla_compute_type = "host"')
_STABLEHLO_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "i32": 4, "f64": 8}


def host_moves(lowered_text: str, shapes, shard_shapes=(),
               devices: int = 1) -> Dict[str, int]:
  """Bytes moved to each memory kind ({"pinned_host", "device"}) by the
  memory-kind annotations (`jax.device_put` to a memory kind) of arrays of
  one of `shapes` (e.g. the chunk shapes) in a program's StableHLO text,
  lowered for a GPU (`step.trace(...).lower(lowering_platforms=("cuda",))`:
  on CPU the moves lower to nothing). Shapes there are global, so the bytes
  are for all devices together. The host annotation of a host
  computation's own result (jax 0.11+ writes one) moves nothing and is not
  counted. `shard_shapes`: shapes of one device's piece of a chunk, as a
  move inside `shard_map` shows it (a stage-3 gather of a shard kept in
  host memory), counted `devices` times (a move in a loop body, e.g. a
  scanned stack's per-layer gather, is counted once)."""
  shapes = {tuple(s) for s in shapes}
  pieces = {tuple(s) for s in shard_shapes} - shapes
  out = {"pinned_host": 0, "device": 0}
  from_host_calls = set()
  for line in lowered_text.splitlines():
    if "func.func" in line:
      from_host_calls = set()   # SSA names are per function
    call = _HOST_CALL.match(line)
    if call:
      from_host_calls.add(call.group(1))
    move = _PLACEMENT.search(line)
    if not move:
      continue
    operand, where, dims, dtype = move.groups()
    shape = tuple(int(d) for d in dims.split("x") if d)
    times = 1 if shape in shapes else devices if shape in pieces else 0
    if (times and where in out and
        not (where == "pinned_host" and operand in from_host_calls)):
      out[where] += times * math.prod(shape) * _STABLEHLO_BYTES[dtype]
  return out


_HOST_WRITE = re.compile(r'custom_call @' + compat.ANALYSIS_TARGET +
                         r'\(.*\) \{.*\} : \((.*)\) -> \(\)')
_TENSOR = re.compile(r'tensor<([\dx]*)x?(\w+)>')


def host_writes(lowered_text: str, devices: int) -> int:
  """Bytes the disk tier's gradient sink (`disk_stream.sink`) sends from
  the devices to the host, in a program lowered for a GPU on a machine
  without one, where each device's write stands as a custom call
  (`compat.write_on_host`): its array operands (shapes per device, inside
  `shard_map`), counted `devices` times, its scalars (the device's index)
  not."""
  total = 0
  for line in lowered_text.splitlines():
    call = _HOST_WRITE.search(line)
    if not call:
      continue
    for dims, dtype in _TENSOR.findall(call.group(1)):
      shape = tuple(int(d) for d in dims.split("x") if d)
      if shape:
        total += devices * math.prod(shape) * _STABLEHLO_BYTES[dtype]
  return total


def host_computations(lowered_text: str) -> int:
  """Calls run as host computations (`compute_on("device_host")`)."""
  return sum(bool(_HOST_CALL.match(line))
             for line in lowered_text.splitlines())
