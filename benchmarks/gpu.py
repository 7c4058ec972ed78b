"""GPU throughput: GPT-2 medium, bf16 compute, on the local accelerators.

`python -m benchmarks.run --gpu` (or `--gpu-smoke`: a tiny model on CPU, for
the tests). Each variant (zerojax stages 0-3, plain `jax.jit` data parallel,
GSPMD FSDP, and the model written otherwise: see `MODELS`; all keep fp32
parameters and AdamW state and compute in bf16, with cuDNN's flash
attention) runs in a fresh process
(`python -m benchmarks.gpu VARIANT CONFIG BATCH SEQ STEPS [ATTENTION]`,
one JSON line on stdout), so that `device.memory_stats()`'s peak belongs to
that variant alone. Reported per variant: median step time, tokens/s, model
TFLOP/s, MFU against the device's dense bf16 peak, and the peak device
bytes. Model FLOPs per token are 6Ψ + 12·layers·width·seq (PaLM's count:
weights forward and backward, attention scores and values), whatever a
variant recomputes (stage 3 rematerialises each layer).

Inside a short GPU lease, `benchmarks/gpu_lease.sh` runs the same children
under a time limit each and keeps each row as it finishes; `python -m
benchmarks.run --gpu --rows FILE...` turns those rows into the results
(`read_rows`, `summarize`). Each row records its `SETTING` (device, model
config, batch, attention, the XLA flags it ran with); rows of different
settings are never compared or replaced by one another. With `PROFILE=path.json` in its environment a
child also traces three steps and writes `profile_summary` there.
"""
from __future__ import annotations

import glob
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

from benchmarks import charts

# Dense bf16 peak FLOP/s by device kind (vendor data sheets, SXM parts).
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}
# GPT-2 medium written otherwise, under one of the variants above. Stage 3
# as a Python loop of blocks (each opted in with `zerojax.nn.layerwise`),
# with zerojax's prefetch (on by default on a GPU) and without: there is no
# layer loop for XLA to pipeline, so this pair measures what
# `ZeroConfig.prefetch` gains; with its tied embedding as a
# `zerojax.nn.BlockedEmbed` (no logits in memory, one vocabulary block
# gathered at a time); with the layer remat keeping the matmul outputs; with
# the head's loss as `zerojax.losses.linear_cross_entropy` (no logits in
# memory, the embedding held); with the layer remat keeping everything but
# the gathered parameters. And plain data parallel with each block
# rematerialised as stage 3's are, which tells remat's cost from zerojax's.
# Values: (the variant, changes to the model config, ZeroConfig fields).
MODELS = {
    "zero-3-unrolled": ("zero-3", {"scan": False}, {}),
    "zero-3-unrolled-no-prefetch": ("zero-3", {"scan": False},
                                    {"prefetch": False}),
    "zero-3-blocked-embed": ("zero-3", {"embed_blocks": 16}, {}),
    "zero-3-save-dots": (
        "zero-3", {"remat_policy": "dots_with_no_batch_dims_saveable"}, {}),
    # ZeRO-3 without activation checkpointing: the layers' activations kept,
    # each layer gathered again in the backward (DeepSpeed's default)
    "zero-3-save-all": ("zero-3", {"remat_policy": "everything_saveable"}, {}),
    # the same on the blocks as a Python loop: nothing recomputed and no
    # scan to stack the kept activations into (each block's gathered
    # parameters are kept too: on one device, the parameters themselves)
    "zero-3-unrolled-save-all": (
        "zero-3", {"scan": False, "remat_policy": "everything_saveable"}, {}),
    "zero-3-loss-block": ("zero-3", {"loss_block": 8192}, {}),
    "plain-dp-remat": ("plain-dp", {"remat": True}, {}),
    # plain data parallel on the blocks as a Python loop, nothing
    # rematerialised: what the model costs without remat and without a
    # scan's stacked residuals
    "plain-dp-unrolled": ("plain-dp", {"scan": False}, {}),
    # on one device each leaf is its own chunk unless a chunk size is given:
    # packed as on N devices, for the comparison
    "zero-3-packed": ("zero-3", {}, {"chunk_size": 2 ** 24}),
    # the blocks as a Python loop with no opt-in, as a user writes them:
    # stage 3 finds and gathers each block itself, keeping its activations
    # (the default) or recomputing the block (`remat="full"`, what the
    # opt-in does)
    "zero-3-as-written": ("zero-3", {"scan": False, "opt_in": False}, {}),
    "zero-3-as-written-remat": ("zero-3", {"scan": False, "opt_in": False},
                                {"remat": "full"}),
}
VARIANTS = ("zero-0", "zero-1", "zero-2", "zero-3", "plain-dp",
            "gspmd-fsdp") + tuple(MODELS)
# (config, global batch per device, tokens per row, timed steps, attention:
# GPTConfig.attention, cuDNN's flash attention on the GPU)
PLANS = {"gpu": ("gpt2-medium", 16, 1024, 20, "cudnn"),
         "gpu-smoke": ("tiny", 2, 16, 2, "einsum")}
MFU_GOAL = {"zero-3": 0.45}   # the target recorded for one H100


def flops_per_token(cfg, seq: int) -> float:
  return 6.0 * cfg.num_params + 12.0 * cfg.layers * cfg.width * seq


def peak_flops(device_kind: str):
  """The dense bf16 peak of `device_kind`, or None when unknown (CPU)."""
  return next((v for k, v in PEAK_BF16.items() if k in device_kind), None)


def _child(variant: str, config: str, batch_per_device: int, seq: int,
           steps: int, attention: str = "einsum", profile=None) -> dict:
  """One variant in this process: warm up, time `steps` steps. With
  `profile` (a JSON path), then three steps under `jax.profiler.trace`,
  summarized there (`profile_summary`)."""
  import jax
  import jax.numpy as jnp
  from benchmarks import memory, models, variants as V

  n = jax.device_count()
  cfg = models.CONFIGS[config]
  base, changes, fields = MODELS.get(variant, (variant, {}, {}))
  cfg = cfg.replace(attention=attention, **changes)
  v = V.build(base, cfg,
              global_batch=batch_per_device * n, seq=seq, num_devices=n,
              compute_dtype=jnp.bfloat16, **fields)
  start = time.perf_counter()
  v.compiled()
  compile_s = time.perf_counter() - start
  for _ in range(2):
    v.run_once()
  times = []
  for _ in range(steps):
    start = time.perf_counter()
    v.run_once()
    times.append(time.perf_counter() - start)
  stats = jax.devices()[0].memory_stats() or {}
  if profile:
    with tempfile.TemporaryDirectory() as trace:
      with jax.profiler.trace(trace):
        for _ in range(3):
          v.run_once()
      with open(profile, "w") as f:
        json.dump({"variant": variant, "attention": attention, "steps": 3,
                   "planes": profile_summary(trace)}, f, indent=1)
  step_s = statistics.median(times)
  tokens = batch_per_device * n * seq
  tflops = tokens * flops_per_token(cfg, seq) / step_s / 1e12
  peak = peak_flops(jax.devices()[0].device_kind)
  return {"variant": variant, "devices": n,
          "device_kind": jax.devices()[0].device_kind,
          "jax": jax.__version__, "python": platform.python_version(),
          "cpu_count": os.cpu_count(),
          "host_memory_bytes": memory.host_memory()["MemTotal"],
          "date": time.strftime("%Y-%m-%d %H:%M:%S"),
          "attention": attention, "config": config,
          "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "batch_per_device": batch_per_device, "seq": seq,
          "compile_s": compile_s,
          "step_s": step_s, "tokens_per_s": tokens / step_s,
          "tflops_per_s": tflops,
          "mfu": tflops * 1e12 / (peak * n) if peak else None,
          "peak_bytes": stats.get("peak_bytes_in_use"),
          "bytes_limit": stats.get("bytes_limit"),
          "modelled_step_s": modelled_step(v.compiled(), n)}


def modelled_step(compiled, n: int):
  """The modelled step of this program as compiled here
  (`zerojax.GpuTarget.model`: the same model the GPU-compiled tier ranks
  by), beside the measured one, on an H100 or H200; else None."""
  import jax
  import zerojax
  kind = jax.devices()[0].device_kind
  gpu = next((g for g in ("h200", "h100") if g.upper() in kind), None)
  if gpu is None:
    return None
  return zerojax.GpuTarget(gpu, 1, n).model(compiled).time


def profile_summary(trace_dir: str, top: int = 40) -> list:
  """The `jax.profiler` trace in `trace_dir` by plane (with the plane's
  stats, e.g. the device's properties) and line (a GPU's streams and XLA
  ops; the host's threads): per line its event count and total time, and
  its `top` events by total time, each with the stats of its first
  occurrence (on a GPU: the HLO op and module of a kernel)."""
  from jax.profiler import ProfileData
  files = glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"),
                    recursive=True)
  data = ProfileData.from_file(max(files, key=os.path.getmtime))
  with warnings.catch_warnings():
    # jax 0.12's profile reader: "builtin type event_stats has no
    # __module__ attribute" (Python 3.13)
    warnings.filterwarnings("ignore", "builtin type .* has no __module__",
                            DeprecationWarning)
    return _planes(data, top)


def _planes(data, top: int) -> list:
  planes = []
  for plane in data.planes:
    lines = []
    for line in plane.lines:
      agg = {}
      for event in line.events:
        entry = agg.setdefault(event.name, {
            "name": event.name, "count": 0, "total_ns": 0.0,
            "stats": {str(k): str(v)[:200] for k, v in event.stats}})
        entry["count"] += 1
        entry["total_ns"] += event.duration_ns
      if agg:
        ranked = sorted(agg.values(), key=lambda e: -e["total_ns"])
        lines.append({"line": line.name,
                      "events": sum(e["count"] for e in ranked),
                      "total_ns": sum(e["total_ns"] for e in ranked),
                      "top": ranked[:top]})
    if lines:
      planes.append({"plane": plane.name, "lines": lines,
                     "stats": {str(k): str(v)[:200] for k, v in plane.stats}})
  return planes


def run(mode: str, log=print) -> dict:
  """Every variant of `mode` ("gpu" or "gpu-smoke"), each in a fresh
  process; returns {"setup", "rows", "goals"} (`summarize`)."""
  config, per_device, seq, steps, attention = PLANS[mode]
  rows = []
  for variant in VARIANTS:
    log(f"gpu: {variant} ({config}, {per_device} x {seq} tokens per device)")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu", variant, config,
         str(per_device), str(seq), str(steps), attention],
        capture_output=True, text=True,
        timeout=1800)
    if proc.returncode:   # (the device is the children's: not asked here)
      from zerojax._core import compat
      rows.append({"variant": variant, "attention": attention,
                   "config": config, "batch_per_device": per_device,
                   "seq": seq, "xla_flags": compat.with_gpu_flags(
                       os.environ.get("XLA_FLAGS", "")),
                   "error": proc.stderr.strip().splitlines()[-1][:500]
                   if proc.stderr.strip() else f"exit {proc.returncode}"})
      continue
    rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
  return summarize(mode, rows)


# What a row was measured with, beside its variant: rows compare (ratios,
# replacements) only within one setting.
SETTING = ("device_kind", "attention", "config", "batch_per_device", "seq",
           "xla_flags")


# the rows others are measured against: plain DP as it is and with each
# block rematerialised as stage 3's are, GSPMD FSDP
REFERENCES = ("plain-dp", "plain-dp-remat", "gspmd-fsdp")


def setting(row: dict) -> tuple:
  """`row`'s SETTING values (its XLA flags as a set: their order is moot)."""
  return tuple(frozenset(row[k].split()) if k == "xla_flags" and k in row
               else row.get(k) for k in SETTING)


def summarize(mode: str, rows: list) -> dict:
  """{"setup", "rows", "goals"} of `rows` (`_child`'s, measured by `run`
  or by `benchmarks/gpu_lease.sh` elsewhere): each row's step time against
  plain data parallel and GSPMD FSDP of the same `setting` (attention,
  model config, batch, XLA flags), rows in `VARIANTS` order within each
  setting, the settings in the order first seen."""
  config, per_device, seq, steps, attention = PLANS[mode]
  settings = list(dict.fromkeys(map(setting, rows)))
  order = {v: i for i, v in enumerate(VARIANTS)}
  rows = sorted(rows, key=lambda r: (settings.index(setting(r)),
                                     order.get(r["variant"], len(order))))
  for r in rows:
    base = {b["variant"]: b for b in rows if "error" not in b
            and setting(b) == setting(r)}
    for ref in REFERENCES:
      if "error" not in r and ref in base:
        r[f"step_vs_{ref}"] = r["step_s"] / base[ref]["step_s"]
  return {"setup": {"config": config, "batch_per_device": per_device,
                    "seq": seq, "timed_steps": steps, "compute": "bf16",
                    "attention": list(dict.fromkeys(
                        r.get("attention", attention) for r in rows)),
                    "optimizer": "AdamW, fp32 state"},
          "rows": rows, "goals": goal_checks(rows)}


def read_rows(paths) -> list:
  """The rows (one JSON object per line) that `benchmarks/gpu_lease.sh`
  appended to each of `paths`; a variant measured again in a later file,
  in the same `setting`, replaces its earlier row (a failed row replaces
  none)."""
  rows = {}
  for path in paths:
    with open(path) as f:
      for line in f:
        if line.strip():
          r = json.loads(line)
          key = (r["variant"],) + setting(r)
          if "error" not in r or "error" in rows.get(key, r):
            rows[key] = r
  return list(rows.values())


def flags_beside_defaults(flags) -> str:
  """A row's XLA flags as they differ from `zerojax.with_gpu_flags`'
  defaults: those added (but the simulated CPU device count), and the
  defaults it ran without ("" when the same; "?" when not recorded)."""
  if flags is None:
    return "?"
  from zerojax._core import compat
  given = {f.split("=", 1)[0]: f for f in flags.split()}
  defaults = {f.split("=", 1)[0]: f for f in compat.with_gpu_flags("").split()}
  added = [f for k, f in given.items() if defaults.get(k) != f
           and "device_count" not in k]
  without = [f for k, f in defaults.items() if k not in given]
  return " ".join(added + [f"without {f}" for f in without])


def goal_checks(rows: list) -> list:
  """(what, value, bound, met) of the MFU goals that were measured: per
  setting, the goal variant's row, and beside it the fastest of that
  stage's other variants (the model written otherwise: `MODELS`) where it
  beats that row or there is none. A row without a known device peak (CPU)
  has no MFU and no goal row."""
  def what(r):
    flags = flags_beside_defaults(r.get("xla_flags"))
    return (f"{r['variant']} MFU ({r.get('attention', 'einsum')} attention"
            + "".join(f", {r[k]}" for k in ("device_kind", "config") if k in r)
            + (f", batch {r['batch_per_device']}" if "batch_per_device" in r
               else "")
            + (f", {flags}" if flags not in ("", "?") else "") + ")")
  goals = []
  for goal, bound in MFU_GOAL.items():
    runs = {}   # per setting: the goal variant's row, the others
    for r in rows:
      if r.get("mfu") is None:
        continue
      if r["variant"] == goal:
        runs.setdefault(setting(r), [None, []])[0] = r
      elif MODELS.get(r["variant"], ("",))[0] == goal:
        runs.setdefault(setting(r), [None, []])[1].append(r)
    for own, others in runs.values():
      shown = [] if own is None else [own]
      best = max(others, key=lambda o: o["mfu"], default=None)
      if best is not None and (own is None or best["mfu"] > own["mfu"]):
        shown.append(best)
      goals += [(what(r), r["mfu"], bound, r["mfu"] >= bound) for r in shown]
  return goals


if __name__ == "__main__":
  # every variant with the GPU flags the example sets (read when jax
  # starts the backend, in _child; the row records the flags it ran with)
  from zerojax._core import compat
  os.environ["XLA_FLAGS"] = compat.with_gpu_flags(
      os.environ.get("XLA_FLAGS", ""))
  # PROFILE: a JSON path for the profile summary of this variant
  print(json.dumps(_child(sys.argv[1], sys.argv[2], int(sys.argv[3]),
                          int(sys.argv[4]), int(sys.argv[5]),
                          *sys.argv[6:7],
                          profile=os.environ.get("PROFILE") or None)))


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
  s = r["setup"]
  lines = [f"### Throughput ({s['config']}, {s['compute']} compute, "
           f"{s['optimizer']}, {s['batch_per_device']}×{s['seq']} tokens per "
           f"device unless a row says otherwise)", "",
           "Each variant in a fresh process (`benchmarks/gpu.py`); step time "
           f"is the median of {s['timed_steps']} steps; model FLOPs are "
           "6Ψ + 12·layers·width·seq per token; MFU against the device's "
           "dense bf16 peak (— where the device's peak is unknown: not "
           "measured). Attention `einsum`: the scores written out, then a "
           "softmax; `cudnn`: `jax.nn.dot_product_attention`'s cuDNN flash "
           "attention; plain DP, remat: each block rematerialised as stage "
           "3's are. A row's XLA flags are those it ran with beside "
           "`zerojax.with_gpu_flags`' defaults (\"without\": a "
           "default it ran without). Ratios are against plain DP and GSPMD "
           "FSDP of the same attention, config, batch and flags. "
           f"`python -m benchmarks.run --{mode}`"
           + (" (here: `benchmarks/gpu_lease.sh` on a lent machine, then "
              "`--rows`)." if r.get("meta", {}).get("rows_from") else "."),
           "", "| variant | attention | config | batch | XLA flags | device "
           "| step s | tokens/s | TFLOP/s | MFU | peak MiB | × plain DP "
           "| × plain DP, remat | × GSPMD FSDP |",
           "|---|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for row in r["rows"]:
    attention = row.get("attention", "einsum")
    where = (f"{row.get('config', s['config'])} | "
             f"{row.get('batch_per_device', s['batch_per_device'])}×"
             f"{row.get('seq', s['seq'])} | "
             f"{flags_beside_defaults(row.get('xla_flags'))}")
    if "error" in row:
      lines.append(f"| {row['variant']} | {attention} | {where} | error: "
                   f"{row['error']} ||||||||")
      continue
    mfu = "—" if row["mfu"] is None else f"{row['mfu']:.1%}"
    ratio = lambda k: f"{row[k]:.3f}" if k in row else ""
    lines.append(f"| {row['variant']} | {attention} | {where} | {row['devices']}× "
                 f"{row['device_kind']} | "
                 f"{row['step_s']:.4f} | {row['tokens_per_s']:,.0f} | "
                 f"{row['tflops_per_s']:.2f} | {mfu} | {charts.mib(row['peak_bytes'])} | "
                 f"{ratio('step_vs_plain-dp')} | {ratio('step_vs_plain-dp-remat')} "
                 f"| {ratio('step_vs_gspmd-fsdp')} |")
  return lines + ["", f"![throughput]({mode}_throughput.png)", ""]


def plot_throughput(r: dict, path: str):
  """Model TFLOP/s per variant (MFU where the device's peak is known), one
  bar per attention."""
  rows = [row for row in r["rows"] if "error" not in row]
  settings = list(dict.fromkeys(map(setting, rows)))
  variants = list(dict.fromkeys(row["variant"] for row in rows))
  mfu = all(row["mfu"] is not None for row in rows)
  fig, ax = charts.plt.subplots(figsize=(8.5, 0.3 * len(variants) * max(
      len(settings), 1) + 1.8))
  height = 0.8 / max(len(settings), 1)
  for k, key in enumerate(settings):
    got = {row["variant"]: row for row in rows if setting(row) == key}
    one = next(iter(got.values()))
    label = (f"{one.get('attention', 'einsum')} attention, "
             f"{one.get('config', r['setup']['config'])}, batch "
             f"{one.get('batch_per_device', r['setup']['batch_per_device'])}"
             f" {flags_beside_defaults(one.get('xla_flags'))}")
    ys = [i + k * height for i, v in enumerate(variants) if v in got]
    xs = [100 * got[v]["mfu"] if mfu else got[v]["tflops_per_s"]
          for v in variants if v in got]
    ax.barh(ys, xs, height=height, label=label[:90])
  ax.set_yticks([i + height * (len(settings) - 1) / 2
                 for i in range(len(variants))], variants)
  ax.invert_yaxis()
  ax.set_xlabel("MFU %" if mfu else "model TFLOP/s")
  goal = next((bound for _, _, bound, _ in r.get("goals", [])), None)
  if mfu and goal is not None:
    ax.axvline(100 * goal, color="k", ls="--", lw=1, label="zero-3 goal")
  ax.legend(fontsize=8)
  ax.set_title(f"{r['setup']['config']} (×{r['setup']['seq']} tokens a row)")
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_throughput(r, os.path.join(out, f"{mode}_throughput.png"))
