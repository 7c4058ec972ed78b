"""Step time of the variants, measured interleaved in one process.

Every variant is compiled and stepped twice first (warm-up); then each round
times every variant once (one sample: as many steps as last about 0.25 s),
in an order that reverses every other round, so that drift in the machine's
load (a shared 2-core machine running 8 simulated devices) falls on all
variants alike. Medians and minima per variant are reported; only ratios
are meant to be read.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Dict

from benchmarks.variants import Variant

BASELINE = "plain-dp"
ONE_DEVICE = ("1dev-zero-3", "1dev-optax")


def time_variants(variants: Dict[str, Variant], rounds: int, warmup: int = 2,
                  sample_s: float = 0.25) -> Dict[str, list]:
  """Seconds per step of each variant, `rounds` samples each. A sample
  times enough consecutive steps to last about `sample_s` (from the last
  warm-up step), so that short steps are not all scheduling noise."""
  names = list(variants)
  steps = {}
  for name in names:
    for _ in range(warmup):
      start = time.perf_counter()
      variants[name].run_once()
    steps[name] = max(1, math.ceil(sample_s / (time.perf_counter() - start)))
  times = {name: [] for name in names}
  for r in range(rounds):
    for name in (names if r % 2 == 0 else names[::-1]):
      start = time.perf_counter()
      for _ in range(steps[name]):
        variants[name].run_once()
      times[name].append((time.perf_counter() - start) / steps[name])
  return times


def run(variants: Dict[str, Variant], rounds: int, setup: dict) -> dict:
  """The speed suite over already built variants.

  Returns:
    {"setup", "rounds", "times_s", "median_s", "min_s", "ratio_vs_plain_dp",
     "min_ratio_vs_plain_dp", "ratio_vs_gspmd_fsdp", "one_device_overhead"}:
    ratios of medians, and of minima (the least disturbed samples on a
    shared machine), against plain DP; zero-* against GSPMD FSDP.
  """
  times = time_variants(variants, rounds)
  median = {k: statistics.median(v) for k, v in times.items()}
  fastest = {k: min(v) for k, v in times.items()}
  mesh = [k for k in median if k not in ONE_DEVICE]
  out = {
      "setup": setup,
      "rounds": rounds,
      "median_s": median,
      "min_s": fastest,
      "times_s": times,
      "ratio_vs_plain_dp": {k: median[k] / median[BASELINE] for k in mesh},
      "min_ratio_vs_plain_dp": {k: fastest[k] / fastest[BASELINE]
                                for k in mesh},
      "ratio_vs_gspmd_fsdp": {k: median[k] / median["gspmd-fsdp"]
                              for k in mesh if k.startswith("zero-")},
  }
  if all(k in median for k in ONE_DEVICE):
    out["one_device_overhead"] = median[ONE_DEVICE[0]] / median[ONE_DEVICE[1]]
    out["min_one_device_overhead"] = (fastest[ONE_DEVICE[0]] /
                                      fastest[ONE_DEVICE[1]])
  return out


GOALS = {  # variant: (ratio key, bound)
    "zero-1": ("ratio_vs_plain_dp", 1.05),
    "zero-2": ("ratio_vs_plain_dp", 1.05),
    "zero-3": ("ratio_vs_plain_dp", 1.15),
}


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)] for the project's step-time goals."""
  checks = []
  for name, (key, bound) in GOALS.items():
    value = result[key].get(name)
    if value is not None:
      checks.append((f"{name} step time / plain-dp", value, bound,
                     value <= bound))
  value = result["ratio_vs_gspmd_fsdp"].get("zero-3")
  if value is not None:
    checks.append(("zero-3 step time / gspmd-fsdp", value, 1.0, value <= 1.0))
  return checks
