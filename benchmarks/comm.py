"""Collectives per training step, measured from the compiled HLO
(`zerojax._plan.hlo`), against ZeRO's communication volume.

Theory, Ψ parameters, b bytes per element of the compute dtype, in the
per-op byte definitions of `zerojax._plan.hlo` (all-gather: gathered output,
reduce-scatter: input, all-reduce: operand):

  stage 0 / plain DP       all-reduce Ψb                      (Ψ in all)
  stages 1-2               reduce-scatter Ψb + all-gather Ψb  (≈ 2Ψ)
  stage 3 / FSDP           all-gather 2Ψb (forward, re-gather in backward)
                           + reduce-scatter Ψb                (≈ 3Ψ)

A ring all-reduce moves as much as a reduce-scatter plus an all-gather
(`wire_bytes` in the tables), which is why the ZeRO paper counts stage 0 as
2Ψ too.
"""
from __future__ import annotations

import gc
from typing import Callable, Iterable

from zerojax._plan import hlo
from benchmarks import variants as V
from benchmarks.memory import sweep_options

_THEORY = {
    "zero-0": {"all-reduce": 1}, "plain-dp": {"all-reduce": 1},
    "zero-1": {"reduce-scatter": 1, "all-gather": 1},
    "zero-2": {"reduce-scatter": 1, "all-gather": 1},
    "zero-3": {"all-gather": 2, "reduce-scatter": 1},
    "gspmd-fsdp": {"all-gather": 2, "reduce-scatter": 1},
}
TOLERANCE = 0.05


def theory(name: str, num_params: int, elem_bytes: int) -> dict:
  return {k: m * num_params * elem_bytes for k, m in _THEORY[name].items()}


def row(v: V.Variant, elem_bytes: int = 4, compiled=None) -> dict:
  """Measured collectives of one variant's step next to the theory."""
  report = hlo.count_collectives(compiled if compiled is not None
                                 else v.compiled())
  want = theory(v.name, v.num_params, elem_bytes)
  measured = report.bytes()
  out = {"variant": v.name, "num_params": v.num_params,
         "elem_bytes": elem_bytes, "devices": v.num_devices,
         "per_kind": report.summary(),
         "in_loop_bodies_unknown_trips": report.unknown_trip_summary(),
         "measured_bytes": measured,
         "measured_in_psi": measured / (v.num_params * elem_bytes),
         "theory_per_kind": want,
         "theory_bytes": sum(want.values()),
         "theory_in_psi": sum(_THEORY[v.name].values()),
         "measured_over_theory": measured / sum(want.values()),
         "wire_bytes": sum(r["wire_bytes"] for r in report.summary().values())}
  if v.layout is not None:
    out["chunks"] = len(v.layout.chunks)
    out["leaves"] = len(v.layout.leaves)
  return out


def chunk_sweep(cfg, chunk_sizes: Iterable[int], build: Callable[..., V.Variant],
                stages: Iterable[int] = (3,)) -> list:
  """Collectives against the number of chunks for several `chunk_size`s
  (abstract states, programs compiled with `memory.sweep_options`)."""
  rows = []
  for stage in stages:
    for size in chunk_sizes:
      v = build(f"zero-{stage}", cfg, materialize=False,
                options=sweep_options(), chunk_size=size)
      report = hlo.count_collectives(v.compiled())
      s = report.summary()
      rows.append({
          "stage": stage, "chunk_size": size,
          "chunks": len(v.layout.chunks), "leaves": len(v.layout.leaves),
          "all_gather_ops": s.get("all-gather", {}).get("ops", 0),
          "reduce_scatter_ops": s.get("reduce-scatter", {}).get("ops", 0),
          "all_reduce_ops": s.get("all-reduce", {}).get("ops", 0),
          "all_gather_count": s.get("all-gather", {}).get("count", 0),
          "reduce_scatter_count": s.get("reduce-scatter", {}).get("count", 0),
          "total_count": report.count(),
          "total_bytes": report.bytes(),
      })
      del v
      gc.collect()
  return rows


def goal_checks(rows: list) -> list:
  """[(what, measured/theory, tolerance, met)] for the zero-* stages."""
  checks = []
  for r in rows:
    if r["variant"].startswith("zero-"):
      ratio = r["measured_over_theory"]
      checks.append((f"{r['variant']} communication bytes / theory", ratio,
                     1 + TOLERANCE, abs(ratio - 1) <= TOLERANCE))
  return checks
