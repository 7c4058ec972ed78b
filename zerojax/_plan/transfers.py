"""What a program lowered for a GPU moves between host and device memory,
read from its StableHLO text (`lowered.as_text()`): the memory-kind
moves (`host_moves`), the disk tier's gradient writes (`host_writes`) and
the host computations (`host_computations`). On CPU these lower to
nothing, so the program is lowered for "cuda" on any machine. The plan's
cost model and the offload tests and benchmarks read them; collectives
are `hlo`'s.
"""
from __future__ import annotations

import math
import re
from typing import Dict

from zerojax._core import compat

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
