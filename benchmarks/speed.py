"""Step time of the variants, measured interleaved in one process.

Every variant is compiled and stepped twice first (warm-up); then each round
times every variant once (one sample: as many steps as last about 0.25 s),
in an order that reverses every other round, so that drift in the machine's
load (a shared 2-core machine running 8 simulated devices) falls on all
variants alike. Medians and minima per variant are reported; only ratios
are meant to be read. Each model's variants are timed among themselves
(`run` is called once per model).
"""
from __future__ import annotations

import os
import math
import resource
import statistics
import time
from typing import Dict, Optional

from benchmarks import charts
from benchmarks.variants import Variant

BASELINE = "plain-dp"
ONE_DEVICE_BASELINE = "1dev-optax"


def time_variants(variants: Dict[str, Variant], rounds: int, warmup: int = 2,
                  sample_s: float = 0.25,
                  faults: Optional[dict] = None) -> Dict[str, list]:
  """Seconds per step of each variant, `rounds` samples each. A sample
  times enough consecutive steps to last about `sample_s` (from the last
  warm-up step), so that short steps are not all scheduling noise. With
  `faults` (a dict), also the process's minor page faults per step of each
  sample, per variant: what an allocator that maps buffers afresh costs
  (see `benchmarks.run`)."""
  names = list(variants)
  steps = {}
  for name in names:
    for _ in range(warmup):
      start = time.perf_counter()
      variants[name].run_once()
    steps[name] = max(1, math.ceil(sample_s / (time.perf_counter() - start)))
  times = {name: [] for name in names}
  counted = {name: [] for name in names}
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
      start = time.perf_counter()
      for _ in range(steps[name]):
        variants[name].run_once()
      times[name].append((time.perf_counter() - start) / steps[name])
      counted[name].append(
          (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
          / steps[name])
  if faults is not None:
    faults.update(counted)
  return times


def medians_and_minima(variants: Dict[str, Variant], rounds: int,
                       faults: Optional[dict] = None) -> tuple:
  """`(times, median, minimum)` of `time_variants`, per variant: the ratios
  the suites report are of medians and of minima (the least disturbed
  samples on a shared machine)."""
  times = time_variants(variants, rounds, faults=faults)
  return (times, {k: statistics.median(v) for k, v in times.items()},
          {k: min(v) for k, v in times.items()})


def run(variants: Dict[str, Variant], rounds: int, setup: dict) -> dict:
  """The speed suite over one model's already built variants.

  Returns:
    {"setup", "rounds", "times_s", "median_s", "min_s", "ratio_vs_plain_dp",
     "min_ratio_vs_plain_dp", "ratio_vs_gspmd_fsdp", "one_device_ratio",
     "min_one_device_ratio", "faults_per_step"}: ratios of medians, and of
    minima (the least disturbed samples on a shared machine), of the mesh
    variants against plain DP, of zero-* against GSPMD FSDP (where built)
    and of zerojax on a 1-device mesh against plain optax on that device
    (where built); the median minor page faults per step of each variant.
  """
  faults = {}
  times, median, fastest = medians_and_minima(variants, rounds, faults)
  mesh = [k for k in median if not k.startswith("1dev-")]
  zero = [k for k in mesh if k.startswith("zero-")]
  one = [k for k in median if k.startswith("1dev-zero-")]
  ratios = lambda stat, names, base: ({k: stat[k] / stat[base] for k in names}
                                      if base in stat else {})
  return {
      "setup": setup,
      "rounds": rounds,
      "median_s": median,
      "min_s": fastest,
      "times_s": times,
      "ratio_vs_plain_dp": ratios(median, mesh, BASELINE),
      "min_ratio_vs_plain_dp": ratios(fastest, mesh, BASELINE),
      "ratio_vs_gspmd_fsdp": ratios(median, zero, "gspmd-fsdp"),
      "one_device_ratio": ratios(median, one, ONE_DEVICE_BASELINE),
      "min_one_device_ratio": ratios(fastest, one, ONE_DEVICE_BASELINE),
      "faults_per_step": {k: statistics.median(v) for k, v in faults.items()},
  }


GOALS = {  # variant: (ratio key, what it is a ratio to, bound)
    "zero-0": ("ratio_vs_plain_dp", BASELINE, 1.05),
    "zero-1": ("ratio_vs_plain_dp", BASELINE, 1.05),
    "zero-2": ("ratio_vs_plain_dp", BASELINE, 1.05),
    "zero-3": ("ratio_vs_plain_dp", BASELINE, 1.15),
    "1dev-zero-0": ("one_device_ratio", ONE_DEVICE_BASELINE, 1.05),
}


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)] for the project's step-time goals of
  one model's result (medians)."""
  config = result["setup"]["config"]
  checks = []
  for name, (key, base, bound) in GOALS.items():
    value = result[key].get(name)
    if value is not None:
      checks.append((f"{name} step time / {base} ({config})", value, bound,
                     value <= bound))
  value = result["ratio_vs_gspmd_fsdp"].get("zero-3")
  if value is not None:
    checks.append((f"zero-3 step time / gspmd-fsdp ({config})", value, 1.0,
                   value <= 1.0))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
  lines = ["### Step time", "",
           "Per model, its variants timed in interleaved rounds after "
           "warm-up; ratios of the medians and of the minima (the least "
           "disturbed samples). The machine is shared (2 cores run 8 "
           "simulated devices, other jobs run beside): read the ratios, not "
           "the times. Host memory comes from a pooled malloc where the "
           "date above says so: with glibc's defaults every step "
           "page-faults its temporaries afresh, which costs most where "
           "they are largest (no rematerialisation), so ratios measured "
           "that way (before 2026-11-25 23:00) are not comparable "
           "(docs/design.md). Page faults / step: the process's minor "
           "faults per step (all devices), the sign of that cost.",
           ""]
  # a file written before the user models holds one model at the top level
  for m in r.get("models", [r]):
    lines += _speed_model_md(m)
  if r.get("meta", {}).get("third_party"):
    lines += [f"Not timed: {r['meta']['third_party']}.", ""]
  return lines + [f"![step time]({mode}_speed.png)", ""]


def _speed_model_md(r: dict) -> list:
  s = r["setup"]
  per_device = max(s["global_batch"] // s["devices"], 1)
  rows = (f"{s['global_batch']}×{s['seq']} tokens = {per_device * s['seq']} "
          "tokens per device" if s["seq"] else
          f"{s['global_batch']} rows = {per_device} per device")
  fsdp = bool(r["ratio_vs_gspmd_fsdp"])
  # page faults per step: written since 2026-11-26
  faults = r.get("faults_per_step", {})
  lines = [f"**{s['config']}** ({s.get('model', 'GPT')}: Ψ = "
           f"{s['num_params']:,}, {s['layers']} layers, width {s['width']}; "
           f"batch {rows}, {s['devices']} devices; {r['rounds']} rounds)", "",
           "| variant | median step (ms) | median × plain-dp | min × plain-dp |"
           + (" median × gspmd-fsdp |" if fsdp else "")
           + (" page faults / step |" if faults else ""),
           "|---|---:|---:|---:|" + ("---:|" if fsdp else "")
           + ("---:|" if faults else "")]
  for name, ratio in r["ratio_vs_plain_dp"].items():
    vs_fsdp = r["ratio_vs_gspmd_fsdp"].get(name)
    lines.append(f"| {name} | {1e3 * r['median_s'][name]:.1f} | {ratio:.3f} "
                 f"| {r['min_ratio_vs_plain_dp'][name]:.3f} |" + (
                     "" if not fsdp else " |" if vs_fsdp is None
                     else f" {vs_fsdp:.3f} |") + (
                     f" {faults[name]:,.0f} |" if faults else ""))
  m = r["median_s"]
  for name, ratio in r.get("one_device_ratio", {}).items():
    lines += ["", f"1 device: zerojax stage {name[-1]} on a 1-device mesh "
              f"{1e3 * m[name]:.1f} ms vs plain optax jit "
              f"{1e3 * m['1dev-optax']:.1f} ms: **{ratio:.3f}×** (minima: "
              f"{r['min_one_device_ratio'][name]:.3f}×; one device's share "
              "of the batch)."]
  return lines + [""]


def plot_speed(r: dict, path: str):
  runs = r.get("models", [r])
  fig, axes = charts.plt.subplots(len(runs), 1, figsize=(7, 3.8 * len(runs)),
                           squeeze=False)
  for ax, m in zip(axes[:, 0], runs):
    _plot_speed_model(ax, m)
  charts.save(fig, path)


def _plot_speed_model(ax, r: dict):
  ratios = r["ratio_vs_plain_dp"]
  minima = r["min_ratio_vs_plain_dp"]
  names = list(ratios)
  ax.barh(names, [ratios[n] for n in names], color=charts.bar_colors(names),
          label="median")
  ax.scatter([minima[n] for n in names], names, marker="|", s=250,
             color="k", zorder=3, label="minimum")
  ax.axvline(1.0, color="k", lw=0.8)
  for i, n in enumerate(names):
    ax.text(max(ratios[n], minima[n]), i, f"  {ratios[n]:.2f}×", va="center",
            fontsize=9)
  s = r["setup"]
  per_device = max(s["global_batch"] // s["devices"], 1)
  load = (f"{per_device * s['seq']} tokens/device" if s["seq"]
          else f"{per_device} rows/device")
  title = (f"Step time vs plain-dp ({s['config']}, {load}, "
           f"{s['devices']} devices)")
  for name, ratio in r.get("one_device_ratio", {}).items():
    title += f"\n1-device zerojax stage {name[-1]} / optax: {ratio:.2f}×"
  ax.set_title(title, fontsize=10)
  ax.set_xlabel("step time / plain-dp (lower is better)")
  ax.invert_yaxis()
  ax.set_xlim(0, max(list(ratios.values()) + list(minima.values())) * 1.45)
  ax.legend(fontsize=8, loc="lower right")


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_speed(r, os.path.join(out, f"{mode}_speed.png"))
