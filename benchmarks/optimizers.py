"""Optimizers that read whole tensors at stage 3, on CPU devices: Muon
(`optax.contrib.muon`: its matrices shaped, its AdamW leaves in flat
chunks) and Adafactor (every leaf shaped), against GSPMD FSDP with the same
optimizer, AdamW beside them for scale. The CPU rows of issue 62's speed
goal (the GPU-compiled ones: `python -m benchmarks.gpu_compiled
--optimizers`):

- stage-3 step time at most 1.15x GSPMD FSDP's with the same optimizer;
- stage-3 persistent bytes per device (`zerojax.memory_report`) at most
  1.10x (master + optimizer state) / N.

    python -m benchmarks.optimizers [--steps N] [--out DIR]

Hugging Face's Flax GPT-2 as written, 8 simulated CPU devices. Step times
are medians of steps run round-robin in one process: only their ratios
mean anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

if __name__ == "__main__":   # before jax starts
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"),
      "--xla_force_host_platform_device_count=8")))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import zerojax  # noqa: E402
from benchmarks import charts, third_party, variants  # noqa: E402
from benchmarks.as_written import _GPT2  # noqa: E402

GLOBAL_BATCH, SEQ, DEVICES, LAYERS = 16, 64, 8, 8
OPTIMIZERS = ("adamw", "muon", "adafactor")   # `models.make_tx`'s names
VARIANTS = ("zero-3", "gspmd-fsdp")


def _config():
  return _GPT2(vocab_size=2048, width=256, layers=LAYERS, heads=4,
               positions=SEQ)


def _nbytes(tree) -> int:
  return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(tree))


def measure(steps: int) -> list:
  """Per optimizer and variant: the median step time (round-robin within
  each optimizer, two warm-up steps first) and, at stage 3, the persistent
  bytes per device against (master + optimizer state) / N."""
  rows = []
  for tx in OPTIMIZERS:
    built = {name: variants.build(name, _config(), global_batch=GLOBAL_BATCH,
                                  seq=SEQ, num_devices=DEVICES, tx=tx)
             for name in VARIANTS}
    times = {name: [] for name in built}
    for i in range(steps + 2):
      for name, v in built.items():
        t = time.perf_counter()
        v.run_once()
        if i >= 2:
          times[name].append(time.perf_counter() - t)
    zero = built["zero-3"].state
    params = zerojax.gather_params(zero)
    ideal = (_nbytes(params)
             + _nbytes(jax.eval_shape(zero.tx.init, params))) / DEVICES
    for name, v in built.items():
      row = {"optimizer": tx, "variant": name,
             "step_s": float(np.median(times[name])), "steps": steps}
      if name == "zero-3":
        row.update(persistent=int(zerojax.memory_report(zero).persistent),
                   ideal=int(ideal),
                   shaped=sum(c.shaped for c in zero.layout.chunks),
                   chunks=len(zero.layout.chunks))
      rows.append(row)
      v.release()
  return rows


def goals(rows: list) -> list:
  """(optimizer, goal, measured, target, met)."""
  at = {(r["optimizer"], r["variant"]): r for r in rows}
  out = []
  for tx in OPTIMIZERS:
    zero, fsdp = at[tx, "zero-3"], at[tx, "gspmd-fsdp"]
    for goal, value, target in (
        ("stage-3 step / GSPMD FSDP's", zero["step_s"] / fsdp["step_s"], 1.15),
        ("persistent / ((master + state) / N)",
         zero["persistent"] / zero["ideal"], 1.10)):
      out.append((tx, goal, value, target, value <= target))
  return out


def write(rows: list, out: str, meta: dict) -> str:
  """`optimizers.{json,md,png}` in `out`; returns the markdown."""
  goal = ["| optimizer | goal | measured | target | met |",
          "|---|---|---:|---:|---|"]
  goal += [f"| {tx} | {g} | {v:.3f} | {t:.2f} | {'yes' if ok else 'NO'} |"
           for tx, g, v, t, ok in goals(rows)]
  table = ["| optimizer | variant | step ms | persistent MiB / device | "
           "shaped chunks |", "|---|---|---:|---:|---:|"]
  table += [f"| {r['optimizer']} | {r['variant']} | {1e3 * r['step_s']:,.1f} "
            f"| {r['persistent'] / 2 ** 20:,.2f} | "
            f"{r['shaped']} of {r['chunks']} |" if "shaped" in r else
            f"| {r['optimizer']} | {r['variant']} | "
            f"{1e3 * r['step_s']:,.1f} | | |" for r in rows]
  text = "\n".join([
      "# Optimizers that read whole tensors, at stage 3", "",
      f"`python -m benchmarks.optimizers`, {meta['date']}, jax {meta['jax']}, "
      f"{DEVICES} simulated CPU devices, Hugging Face's Flax GPT-2 as written "
      f"({LAYERS} blocks, width 256, vocabulary 2,048), {GLOBAL_BATCH} x "
      f"{SEQ} tokens, fp32. Muon is `optax.contrib.muon` (AdamW for what is "
      "no matrix); Adafactor is `optax.adafactor`. Shaped chunks hold one "
      "leaf each, shown to the optimizer in its own shape ([Note: shaped "
      "leaves]). Step times: medians of steps run round-robin per "
      "optimizer in one process (ratios only). The 8-H100 rows: "
      "[gpu_compiled](gpu_compiled.md).", "", "## Goals", "", *goal, "",
      "## Measured", "", *table, "", "![step time](optimizers.png)", ""])
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "optimizers.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "optimizers.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  fig, ax = charts.plt.subplots(figsize=(6, 3.5))
  at = {(r["optimizer"], r["variant"]): r["step_s"] for r in rows}
  x = np.arange(len(OPTIMIZERS))
  for k, name in enumerate(VARIANTS):
    ax.bar(x + 0.4 * k - 0.2, [1e3 * at[tx, name] for tx in OPTIMIZERS], 0.4,
           label=name, color=charts.COLORS[name])
  ax.set_xticks(x, OPTIMIZERS)
  ax.set_ylabel("step ms (8 CPU devices)")
  ax.legend(fontsize=8)
  charts.save(fig, os.path.join(out, "optimizers.png"))
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  if third_party.missing:
    raise SystemExit(third_party.missing)
  rows = measure(args.steps)
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC"), "jax": jax.__version__}
  print(write(rows, args.out, meta))


if __name__ == "__main__":
  main()
