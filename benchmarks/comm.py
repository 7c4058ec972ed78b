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

import os
import gc
from typing import Callable, Iterable

from zerojax._plan import hlo
from benchmarks import charts
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


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
  s = r["setup"]
  lines = [f"### Communication per step ({s['config']}: Ψ = "
           f"{s['num_params']:,}, fp32, {s['devices']} devices)", "",
           "Counted in the optimized HLO (`zerojax/_plan/hlo.py`); bytes per "
           "device: all-gather = gathered output, reduce-scatter = input, "
           "all-reduce = operand. Ops in loop bodies (the scanned layers) "
           "count once per iteration.", "",
           "| variant | all-gather n / MiB | reduce-scatter n / MiB | "
           "all-reduce n / MiB | total (Ψ·4 B) | theory (Ψ·4 B) | measured / "
           "theory | ring wire MiB |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for row in r["rows"]:
    cells = []
    for kind in ("all-gather", "reduce-scatter", "all-reduce"):
      k = row["per_kind"].get(kind)
      loop = (f" ({k['in_loop_count']} in loops)" if k and k["in_loop_count"]
              else "")
      cells.append("—" if k is None else
                   f"{k['count']}{loop} / {charts.mib(k['bytes'])}")
    other = [k for k in row["per_kind"] if k not in
             ("all-gather", "reduce-scatter", "all-reduce")]
    name = row["variant"] + (f" (+{', '.join(other)})" if other else "")
    lines.append(f"| {name} | " + " | ".join(cells) +
                 f" | {row['measured_in_psi']:.3f} | {row['theory_in_psi']} | "
                 f"{row['measured_over_theory']:.3f} | "
                 f"{charts.mib(row['wire_bytes'])} |")
  lines += ["", "On this backend XLA reduces GSPMD's sharded gradients with "
            "all-reduce (no reduce-scatter rewrite on CPU) and runs 16-bit "
            "all-gathers / reduce-scatters in float32, so the tables use "
            "fp32 training.",
            "", "Chunk-size sweep: collectives follow the number of chunks, "
            "not the number of parameter leaves.", "",
            "| stage | chunk_size | chunks | leaves | all-gather ops | "
            "reduce-scatter ops | all-reduce ops | collectives / step | "
            "MiB / step |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for c in r["chunk_sweep"]:
    lines.append(f"| {c['stage']} | {c['chunk_size']:,} | {c['chunks']} | "
                 f"{c['leaves']} | {c['all_gather_ops']} | "
                 f"{c['reduce_scatter_ops']} | {c['all_reduce_ops']} | "
                 f"{c['total_count']} | {charts.mib(c['total_bytes'])} |")
  return lines + ["", f"![communication]({mode}_comm.png)",
                  f"![chunk sweep]({mode}_chunks.png)", ""]


def plot_comm(r: dict, path: str):
  rows = r["rows"]
  names = [row["variant"] for row in rows]
  kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
           "collective-permute")
  colors = {"all-gather": "#08519c", "reduce-scatter": "#6baed6",
            "all-reduce": "#e6550d", "all-to-all": "#31a354",
            "collective-permute": "#756bb1"}
  fig, ax = charts.plt.subplots(figsize=(8, 4))
  x = list(range(len(rows)))
  bottom = [0.0] * len(rows)
  for kind in kinds:
    vals = [row["per_kind"].get(kind, {}).get("bytes", 0) /
            (row["num_params"] * row["elem_bytes"]) for row in rows]
    if any(vals):
      ax.bar(x, vals, 0.55, bottom=bottom, label=kind, color=colors[kind])
      bottom = [b + v for b, v in zip(bottom, vals)]
  ax.hlines([row["theory_in_psi"] for row in rows], [i - 0.38 for i in x],
            [i + 0.38 for i in x], colors="k", linewidth=2, zorder=3,
            label="theory")
  for i, row in enumerate(rows):
    ax.text(i, bottom[i] + 0.05, f"{row['measured_in_psi']:.2f}",
            ha="center", fontsize=8)
  ax.set_xticks(x)
  ax.set_xticklabels(names, rotation=15, fontsize=8)
  ax.set_ylabel("bytes per step / (Ψ × 4 B)")
  ax.set_ylim(0, max(bottom + [3.0]) * 1.15)
  ax.set_title(f"Collectives per step ({r['setup']['config']}, fp32, "
               "8 devices)", fontsize=10)
  ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
  charts.save(fig, path)


def plot_chunks(r: dict, path: str):
  rows = r["chunk_sweep"]
  fig, ax = charts.plt.subplots(figsize=(6.5, 4))
  top = max(c["chunks"] for c in rows)
  ax.plot([0, top], [0, 2 * top], ls=":", color="k", lw=1,
          label="2 × chunks")
  markers = {2: "s", 3: "o"}
  for stage in sorted({c["stage"] for c in rows}):
    sel = sorted((c for c in rows if c["stage"] == stage),
                 key=lambda c: c["chunks"])
    ax.plot([c["chunks"] for c in sel],
            [c["all_gather_ops"] + c["reduce_scatter_ops"] for c in sel],
            marker=markers.get(stage, "o"), ms=9 if stage == 2 else 6,
            mfc="none" if stage == 2 else None, lw=0 if stage == 2 else 1.5,
            label=f"stage {stage}: all-gather + reduce-scatter ops",
            color=charts.COLORS.get(f"zero-{stage}"))
  labels = {}
  for c in rows:   # one label per point, whichever stage put it there
    xy = (c["chunks"], c["all_gather_ops"] + c["reduce_scatter_ops"])
    labels.setdefault(xy, f"{c['chunk_size']:,}")
  for xy, text in labels.items():
    ax.annotate(text, xy, textcoords="offset points", xytext=(6, -10),
                fontsize=7)
  leaves = rows[0]["leaves"]
  ax.axvline(leaves, color="#e6550d", ls="--", lw=0.8,
             label=f"parameter leaves ({leaves})")
  ax.set_xlabel("chunks (len(state.layout.chunks)); labels: chunk_size")
  ax.set_ylabel("collective ops in the step's HLO")
  ax.set_title("Collectives follow chunks, not leaves "
               f"({r['setup']['config']})", fontsize=10)
  charts.finish_line_plot(fig, ax, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_comm(r, os.path.join(out, f"{mode}_comm.png"))
  plot_chunks(r, os.path.join(out, f"{mode}_chunks.png"))
