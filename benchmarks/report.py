"""README.md tables and PNG plots from the result files of a folder.

`write(out, mode)` draws the plots of `mode` and rewrites `out/README.md`
from every `<mode>_<suite>.json` in `out`, so `--quick` and `--full` results
live side by side.
"""
from __future__ import annotations

import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from benchmarks import gpu  # noqa: E402

MODES = ("quick", "full", "smoke", "gpu", "gpu-smoke")
SUITES = ("speed", "memory", "comm", "offload", "disk", "checkpoint",
          "throughput", "frontends", "hybrid", "tp", "quantized")
MIB = 2 ** 20
COLORS = {"zero-0": "#9ecae1", "zero-1": "#6baed6", "zero-2": "#3182bd",
          "zero-3": "#08519c", "plain-dp": "#969696", "gspmd-fsdp": "#e6550d",
          "1dev-zero-0": "#9ecae1", "1dev-zero-3": "#08519c",
          "1dev-optax": "#969696"}


def _load(out: str, mode: str) -> dict:
  found = {}
  for suite in SUITES:
    path = os.path.join(out, f"{mode}_{suite}.json")
    if os.path.exists(path):
      with open(path) as f:
        found[suite] = json.load(f)
  return found


def _mib(x) -> str:
  return "—" if x is None else f"{x / MIB:,.2f}"


def _goals_table(results: dict) -> list:
  rows = [g for suite in SUITES
          for g in results.get(suite, {}).get("goals", [])]
  if not rows:
    return []
  lines = ["| goal | measured | bound | met |", "|---|---:|---:|:---:|"]
  for what, value, bound, met in rows:
    bound_txt = (f"±{bound - 1:.0%} of 1" if "theory" in what
                 else f"≥ {bound:.2f}" if ("offload" in what or "MFU" in what
                                           or "largest" in what)
                 else f"≤ {bound:.2f}")
    lines.append(f"| {what} | {value:.3f} | {bound_txt} | "
                 f"{'yes' if met else '**no**'} |")
  return lines


# ---- markdown ------------------------------------------------------------------
def _speed_md(r: dict, mode: str) -> list:
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


def _memory_md(r: dict, mode: str) -> list:
  s = r["setup"]
  lines = [f"### Memory per device (batch {s['global_batch']}×{s['seq']} "
           f"tokens, {s['devices']} devices, fp32 + AdamW)", "",
           "persistent: the state's bytes on one device; footprint: "
           "`memory_analysis()` argument + output + temp − alias; theory: "
           "ZeRO's persistent bytes (Ψ parameters, N devices); last column: "
           "whether a step on 8 simulated devices (8 × footprint) fits in "
           "this host's memory.", ""]
  notes = []
  for cfg_name, rows in r["rows"].items():
    c = r["configs"][cfg_name]
    lines += [f"**{cfg_name}** (Ψ = {c['num_params']:,}, {c['layers']} layers, "
              f"width {c['width']})", "",
              "| variant | persistent MiB | theory | theory MiB | persistent / "
              "theory | argument MiB | output MiB | temp MiB | alias MiB | "
              "footprint MiB | 8 × footprint fits host |",
              "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for row in rows:
      if "error" in row:
        lines.append(f"| {row['variant']} | failed: {row['error'][:120]} |"
                     + " |" * 9)
        continue
      mark = "" if row["persistent_from"] == "addressable_shards" else " ¹"
      lines.append(
          f"| {row['variant']} | {_mib(row['persistent_bytes'])}{mark} | "
          f"{row['theory']} | {_mib(row['theory_bytes'])} | "
          f"{row['persistent_over_theory']:.4f} | {_mib(row['argument'])} | "
          f"{_mib(row['output'])} | {_mib(row['temp'])} | "
          f"{_mib(row['alias'])} | {_mib(row['footprint'])} | "
          f"{'yes' if row['runs_on_this_host'] else 'no'} |")
      if row.get("note"):
        notes.append(f"{cfg_name} {row['variant']}: {row['note']}")
    lines.append("")
    e = r.get("expected_stage3", {}).get(cfg_name)
    if e:
      # results written before the yardstick counted the gradient shard
      shard = (f" + gradient shard 4Ψ/N {_mib(e['gradient_shard'])}"
               if "gradient_shard" in e else "")
      lines += [f"ZeRO-3 yardstick (`benchmarks.memory.stage3_expected`): "
                f"12Ψ/N {_mib(e['state'])}{shard} + two gathered layers "
                f"{_mib(e['two_layers'])} + activations (saved block inputs, "
                f"logits and their gradient) {_mib(e['activations'])} = "
                f"{_mib(e['total'])} MiB; not in it: "
                + ("one block of the tied embedding (`BlockedEmbed`, "
                   f"{e['table_blocks']} blocks) and of its gradient, "
                   "gathered per use." if e.get("table_blocks", 1) > 1 else
                   "the tied embedding, gathered for the whole step, with "
                   "its full gradient before the reduce-scatter."), ""]
  if notes:
    lines += ["¹ " + n for n in notes] + [""]
  d = r["depth_sweep"]
  lines += [f"Depth sweep ({r['depth_config']} width, compiled footprint "
            "MiB per device; compiled for analysis only, without LLVM "
            "optimisation and fusion emitters: within a few hundred bytes of "
            "the tables above):", "",
            "| layers | Ψ | " + " | ".join(d["footprint"]) + " |",
            "|---:|---:|" + "---:|" * len(d["footprint"])]
  for i, layers in enumerate(d["layers"]):
    lines.append(f"| {layers} | {d['num_params'][i]:,} | " + " | ".join(
        _mib(v[i]) for v in d["footprint"].values()) + " |")
  return lines + ["", f"![memory]({mode}_memory.png)",
                  f"![depth sweep]({mode}_depth.png)", ""]


def _comm_md(r: dict, mode: str) -> list:
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
                   f"{k['count']}{loop} / {_mib(k['bytes'])}")
    other = [k for k in row["per_kind"] if k not in
             ("all-gather", "reduce-scatter", "all-reduce")]
    name = row["variant"] + (f" (+{', '.join(other)})" if other else "")
    lines.append(f"| {name} | " + " | ".join(cells) +
                 f" | {row['measured_in_psi']:.3f} | {row['theory_in_psi']} | "
                 f"{row['measured_over_theory']:.3f} | "
                 f"{_mib(row['wire_bytes'])} |")
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
                 f"{c['total_count']} | {_mib(c['total_bytes'])} |")
  return lines + ["", f"![communication]({mode}_comm.png)",
                  f"![chunk sweep]({mode}_chunks.png)", ""]


def _offload_md(r: dict, mode: str) -> list:
  none, off = r["rows"]
  fit = r["largest"]
  sp = r["speed"]
  lines = [f"### Host offload, stage 3 ({r['config']}: Ψ = "
           f"{none['num_params']:,}, {r['layers']} layers, width {r['width']}, "
           f"batch {r['global_batch']}×{r['seq']}, {r['devices']} devices, "
           "compiled from abstract states)", "",
           "`device` = argument + output + temp − alias of the compiled step "
           "(measured) less the host-resident arguments and outputs "
           "(`S(5)` in the compiled entry layout): derived, because the CPU "
           "backend does not split memory kinds, and on CPU the host ↔ "
           "device copies compile to nothing, so no transient device copy of "
           "an offloaded chunk is counted (on a GPU the step updates the "
           "offloaded chunks one at a time, so it adds the largest chunk's "
           "optimizer state and its temporaries; not measured, no GPU here). "
           "`python -m benchmarks.run "
           f"--{mode} --suites offload`.", "",
           "| setting | device MiB / device | host MiB / device | "
           "footprint MiB (all kinds) | temp MiB |",
           "|---|---:|---:|---:|---:|"]
  for name, row in (("no offload", none), ("offload_optimizer", off)):
    lines.append(f"| {name} | {_mib(row['device'])} | "
                 f"{_mib(row['host_argument'])} | {_mib(row['footprint'])} | "
                 f"{_mib(row['temp'])} |")
  if "pcie" in r:
    lines += ["", "Host ↔ device bytes per parameter per step of the optax "
              "update, every chunk's optimizer state offloaded (Adam, bf16 "
              "compute), read from the step lowered for a GPU: "
              "`update_on=\"device\"` brings master, m and v over and back; "
              "`update_on=\"host\"` runs the update as a host computation. "
              "(Stage 3's forward also reads the fp32 master shard from host, "
              "4 B, under either.)", "",
              "| stage, update | to host | to device | host computations |",
              "|---|---:|---:|---:|"]
    for name, row in r["pcie"].items():
      lines.append(f"| {name} | {row['to host']:.2f} B | "
                   f"{row['to device']:.2f} B | {row['host computations']} |")
  lines += ["", f"Largest model under a budget of {_mib(r['budget'])} MiB "
            f"device memory per device (the no-offload footprint of "
            f"{r['config']}), depth swept at width {r['width']}:", "",
            "| setting | layers | Ψ | device MiB | next depth's device MiB |",
            "|---|---:|---:|---:|---:|"]
  for name, f in fit.items():
    how = "" if f.get("verified", True) else " (predicted, not compiled)"
    lines.append(f"| {name}{how} | {f['layers']} | {f['num_params']:,} | "
                 f"{_mib(f['device'])} | {_mib(f['next_device'])} |")
  if not all(f.get("verified", True) for f in fit.values()):
    lines += ["", "Predicted rows: the line through the compiled points "
              "(plotted), device bytes per layer "
              + ", ".join(f"{n}: {_mib(f['slope'])} MiB" for n, f in fit.items())
              + "; deeper states were not compiled (see "
              "`benchmarks/offload.py`, `largest_fitting`)."]
  lines += ["", f"**{r['size_ratio']:.2f}×** the parameters fit with optimizer "
            "offload (at stage 3 the master shard is the parameter, so it "
            "goes to host with the optimizer state).", "",
            f"Step time on CPU ({sp['config']}, batch {sp['global_batch']}×"
            f"{sp['seq']}, {sp['rounds']} interleaved rounds): offload / no "
            f"offload = {sp['ratio']:.3f} (medians), {sp['min_ratio']:.3f} "
            "(minima). Not a goal: on CPU the transfers compile away." + (
                f" The update on the host / on the device: "
                f"{sp['host_update_ratio']:.3f} (medians), "
                f"{sp['host_update_min_ratio']:.3f} (minima); here host and "
                "device are the same CPU, so this is the cost of the host "
                "computations' program structure, not of a host's Adam "
                "against a GPU's." if "host_update_ratio" in sp else ""), "",
            f"![offload]({mode}_offload.png)", ""]
  return lines


def _disk_md(r: dict, mode: str) -> list:
  lines = [f"### Disk tier against host offload ({r['config']}, written one "
           f"module per block: width {r['width']}, {r['layers']} layers at "
           f"the start; batch {r['global_batch']}×{r['seq']}, {r['devices']} "
           "devices)", "",
           "Per device, from compiled programs (abstract states): `device` as "
           "in the offload suite; `host` = the step program's host-resident "
           "arguments and outputs plus, for the disk tier, its stream (the "
           "largest chunk's host update: its statistics, master and gradient "
           "in host memory; and the next chunk's read). The host tier is "
           "`offload_optimizer=True, update_on=\"host\"`. Bytes per "
           "parameter per step: PCIe from the programs lowered for a GPU "
           "(the step, its gradient sink's writes included, and each disk "
           "chunk's host update), disk = every disk chunk's files read and "
           "written once (its gradient: written by the step, read by the "
           "stream). `python -m benchmarks.run "
           f"--{mode} --suites disk` (`benchmarks/disk.py`).", ""]
  for stage, x in _disk_cases(r).items():
    rows, fit, b, sp = x["rows"], x["largest"], x["budget"], x["speed"]
    lines += [f"Stage {stage}:", "",
              "| tier | chunks | device MiB | host MiB (of it: stream) | "
              "PCIe to host B | PCIe to device B | disk B |",
              "|---|---:|---:|---:|---:|---:|---:|"]
    for tier, row in rows.items():
      lines.append(
          f"| {tier} | {row['chunks']} | {_mib(row['device'])} | "
          f"{_mib(row['host'])} ({_mib(row['stream'])}) | "
          f"{row['pcie_to_host']:.2f} | {row['pcie_to_device']:.2f} | "
          f"{row['disk_bytes_per_param']:.2f} |")
    lines += ["", f"One machine: host memory {_mib(b['host'])} MiB per device "
              f"(the host tier's at {r['layers']} layers) and device memory "
              f"{_mib(b['device'])} MiB (the host tier's step at "
              f"{4 * r['layers']} layers). Deepest model that fits both:", "",
              "| tier | layers | Ψ | device MiB | host MiB | next depth: "
              "device, host MiB |", "|---|---:|---:|---:|---:|---|"]
    for tier, f in fit.items():
      lines.append(f"| {tier} | {f['layers']}{'' if f['fits'] else ' (none fits)'}"
                   f" | {f['num_params']:,} | {_mib(f['device'])} | "
                   f"{_mib(f['host'])} | {_mib(f['next']['device'])}, "
                   f"{_mib(f['next']['host'])} |")
    if all("predicted" in f for f in fit.values()):
      alone = lambda d: ("unbounded" if d >= 10 ** 6 else str(d))
      lines += ["", "Depth in layers each budget alone would allow (the line "
                "through the first two depths): " + "; ".join(
                    f"{tier} tier device {alone(f['predicted']['device'])}, "
                    f"host {alone(f['predicted']['host'])}"
                    for tier, f in fit.items()) + "."]
    loss = fit["disk"].get("loss_of_one_step")
    lines += ["", f"**{x['size_ratio']:.2f}×** the parameters with the disk "
              "tier" + (f"; one step of it at {fit['disk']['layers']} layers "
                        f"ran, loss {loss:.3f}" if loss is not None else "")
              + ". Step time on this machine (" + sp["config"] +
              f", {sp['rounds']} interleaved rounds, files in the page "
              f"cache): disk / host = {sp['ratio']:.2f} (medians), "
              f"{sp['min_ratio']:.2f} (minima)" + (
                  f"; a chunk at a time instead of sub-groups, "
                  f"{sp['whole_ratio']:.2f}" if "whole_ratio" in sp else "")
              + ".", ""]
  lines += [f"![disk]({mode}_disk.png)", ""]
  return lines


def _disk_cases(r: dict) -> dict:
  """{"<stage> <precision>": result} (results before session 13 named the
  stage only)."""
  return r.get("cases") or r["stages"]


def _checkpoint_md(r: dict, mode: str) -> list:
  lines = ["### Checkpoints: zerojax stage 3 vs plain orbax", "",
           "Save and restore of the fp32 + AdamW state, each measurement in a "
           "fresh process on 8 simulated CPU devices (`benchmarks/checkpoint."
           "py`): zerojax from / into a stage-3 state; plain orbax "
           "`StandardCheckpointer` of the unsharded flax `TrainState` on one "
           "device. `save`, `restore`: the second call of the process (what "
           "each later call costs); `first ...`: the first, which for a "
           "zerojax restore includes the optimizer probes (`zerojax._core.optim`, "
           "compiled once per process and tx, as `shard()` does). host MiB: "
           "peak resident memory during the call above the resident memory "
           "before it (the state itself is not counted by a save). Each "
           "figure is the mean of "
           f"{r['configs'][0].get('rounds', 1) if r['configs'] else 1} "
           "round(s) that alternate which side goes first, every measurement "
           "after `os.sync()`, on a two-core host shared with other jobs; "
           "`rounds` gives the lowest and highest ratio of a single round. "
           "CPU s: user + system seconds of the process during the call, "
           "all threads (steadier than wall time on a shared host). "
           f"`python -m benchmarks.run --{mode} --suites checkpoint`.", "",
           "| model | state MiB | measurement | zerojax s | orbax s | zerojax / "
           "orbax | rounds | zerojax CPU s | orbax CPU s | zerojax host MiB | "
           "orbax host MiB | zerojax blocking s |",
           "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for c in r["configs"]:
    rows = c["rows"]
    z, o = rows["zerojax-save"], rows["orbax-save"]
    zr, orr = rows["zerojax-restore"], rows["orbax-restore"]
    pairs = [("save", z, o), ("first save", z["first"], o["first"]),
             ("restore", zr, orr), ("first restore", zr["first"], orr["first"])]
    for what, zr, orow in pairs:
      blocking = ("" if zr["blocking_s"] is None else f"{zr['blocking_s']:.2f}")
      spread = c.get("round_ratios", {}).get(what, [])
      spread = f"{min(spread):.2f}–{max(spread):.2f}" if len(spread) > 1 else ""
      cpu = lambda m: "" if m.get("cpu_s") is None else f"{m['cpu_s']:.2f}"
      lines.append(f"| {c['config']} | {_mib(c['state_bytes'])} | {what} | "
                   f"{zr['total_s']:.2f} | {orow['total_s']:.2f} | "
                   f"{zr['total_s'] / orow['total_s']:.2f} | {spread} | "
                   f"{cpu(zr)} | {cpu(orow)} | "
                   f"{_mib(zr['peak_increase'])} | {_mib(orow['peak_increase'])}"
                   f" | {blocking} |")
  return lines + ["", f"![checkpoint]({mode}_checkpoint.png)", ""]


def _throughput_md(r: dict, mode: str) -> list:
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
             f"{gpu.flags_beside_defaults(row.get('xla_flags'))}")
    if "error" in row:
      lines.append(f"| {row['variant']} | {attention} | {where} | error: "
                   f"{row['error']} ||||||||")
      continue
    mfu = "—" if row["mfu"] is None else f"{row['mfu']:.1%}"
    ratio = lambda k: f"{row[k]:.3f}" if k in row else ""
    lines.append(f"| {row['variant']} | {attention} | {where} | {row['devices']}× "
                 f"{row['device_kind']} | "
                 f"{row['step_s']:.4f} | {row['tokens_per_s']:,.0f} | "
                 f"{row['tflops_per_s']:.2f} | {mfu} | {_mib(row['peak_bytes'])} | "
                 f"{ratio('step_vs_plain-dp')} | {ratio('step_vs_plain-dp-remat')} "
                 f"| {ratio('step_vs_gspmd-fsdp')} |")
  return lines + ["", f"![throughput]({mode}_throughput.png)", ""]


def _frontends_md(r: dict, mode: str) -> list:
  lines = ["### NNX front end against linen", "",
           "The user models written again in Flax NNX, layer for layer "
           "(`benchmarks/frontends.py`), trained through "
           "`zerojax.shard(model, tx=...)` against the linen `TrainState`; "
           f"{r['rounds']} interleaved rounds, batch 64. Run: "
           f"`python -m benchmarks.run --{mode} --suites frontends`.", "",
           "Stage 3 gathers per block in both (`zerojax.nn.layerwise` on "
           "the block class); the footprint is the compiled step's "
           "(`zerojax.compiled_footprint`).", "",
           "| model | stage | NNX / linen (medians) | NNX / linen (minima) | "
           "persistent bytes, linen | NNX | footprint, linen | NNX |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for row in r["rows"]:
    b, f = row["persistent_bytes"], row.get("footprint_bytes", {})
    lines.append(f"| {row['model']} | {row['stage']} | {row['ratio']:.3f} | "
                 f"{row['min_ratio']:.3f} | {_mib(b['linen'])} | "
                 f"{_mib(b['nnx'])} | "
                 + " | ".join(_mib(f[k]) if k in f else "not measured"
                              for k in ("linen", "nnx")) + " |")
  return lines + ["", f"![frontends]({mode}_frontends.png)", ""]


def _memory_table(memory: dict) -> list:
  """Persistent bytes per device against theory, and the compiled step's
  footprint, per variant (the hybrid and tensor-parallel suites)."""
  lines = ["", "| variant | persistent per device | theory | compiled "
           "step footprint |", "|---|---:|---:|---:|"]
  for label, m in memory.items():
    lines.append(f"| {label} | {_mib(m['persistent'])} | {_mib(m['theory'])} "
                 f"| {_mib(m['compiled'])} |")
  return lines


def _hybrid_md(r: dict, mode: str) -> list:
  lines = ["### Hybrid sharding: bytes per mesh axis", "",
           f"Stage 3 on {r['devices']} devices laid out as {r['nodes']} nodes "
           f"({r['config']}, Ψ = {r['num_params']:,}): 1-D ZeRO-3 against HSDP "
           "(`replica_axis`) and hpZ (`hpz=True`), collectives read from the "
           "compiled HLO and classed by their replica groups "
           "(`benchmarks/hybrid.py`). Bytes per device per step; \"sent "
           "across\" is what a device sends over the nodes' links with ring "
           "algorithms. Run: "
           f"`python -m benchmarks.run --{mode} --suites hybrid`.", "",
           "| variant | within a node | across nodes | theory within | "
           "theory across | sent across | theory sent |",
           "|---|---:|---:|---:|---:|---:|---:|"]
  for label, row in r["rows"].items():
    th = r["theory"][label]
    wire = row.get("wire", {})
    lines.append(f"| {label} | {_mib(sum(row['within'].values()))} | "
                 f"{_mib(sum(row['across'].values()))} | {_mib(th['within'])} | "
                 f"{_mib(th['across'])} | {_mib(wire.get('across', 0))} | "
                 f"{_mib(th.get('wire_across', 0))} |")
  if "memory" in r:
    lines += _memory_table(r["memory"])
  lines += ["", f"Step time, HSDP / 1-D ({r['rounds']} interleaved rounds): "
            f"{r['ratio']:.3f} (medians), {r['min_ratio']:.3f} (minima)."]
  if "hpz_ratio" in r:
    lines += ["", f"Step time, hpZ / 1-D: {r['hpz_ratio']:.3f} (medians), "
              f"{r['hpz_min_ratio']:.3f} (minima)."]
  return lines + ["", f"![hybrid]({mode}_hybrid.png)", ""]


def _tp_md(r: dict, mode: str) -> list:
  lines = ["### Tensor parallelism beside ZeRO: bytes per mesh axis", ""]
  lines += _tp_tables(r, mode)
  if "unrolled" in r:
    lines += ["", "The same GPT written one module per block (blocks called in a "
              "Python loop, zero-3 gathering each block with `layerwise`):", ""]
    lines += _tp_tables(r["unrolled"], mode)
  return lines + ["", f"![tensor parallel]({mode}_tp.png)", ""]


def _tp_tables(r: dict, mode: str) -> list:
  psi_eff = r["num_params"] - r["split_params"] + r["split_params"] / r["model"]
  lines = [f"Stage 3 on {r['devices']} devices as (data {r['data']}, model "
           f"{r['model']}) ({r['config']}, Ψ = {r['num_params']:,}, of which "
           f"Ψ_s = {r['split_params']:,} split over model: Ψ' = Ψ − Ψ_s + "
           f"Ψ_s/M = {psi_eff:,.0f} per model device), against 1-D ZeRO-3 "
           "over all 8 and Megatron-style data + tensor parallelism under "
           "plain `jax.jit`. Collectives from the compiled HLO, classed by "
           "their replica groups (`benchmarks/tensor_parallel.py`); bytes per "
           "device per step. Run: "
           f"`python -m benchmarks.run --{mode} --suites tp`.", "",
           "| variant | over data | theory | over model | theory | over both |",
           "|---|---:|---:|---:|---:|---:|"]
  for label, row in r["rows"].items():
    th = r["theory"][label]
    lines.append(f"| {label} | {_mib(sum(row['data'].values()))} | "
                 f"{_mib(th['data'])} | {_mib(sum(row['model'].values()))} | "
                 f"{_mib(th['model'])} | {sum(row['both'].values())} B |")
  lines += _memory_table(r["memory"])
  lines += ["", f"Step time ({r['rounds']} interleaved rounds), zero-3 TP / "
            f"DP + TP: {r['ratio']:.3f} (medians), {r['min_ratio']:.3f} "
            f"(minima); zero-3 TP / 1-D zero-3: {r['ratio_1d']:.3f}, "
            f"{r['min_ratio_1d']:.3f}."]
  return lines


def markdown(out: str) -> str:
  lines = ["# zerojax benchmarks", "",
           "Generated by `python -m benchmarks.run --quick` and "
           "`python -m benchmarks.run --full` (add `--suites memory,comm` for "
           "a part). Everything runs in one process on 8 simulated CPU "
           "devices (`--xla_force_host_platform_device_count=8`) on a GPT-2-"
           "style model (`benchmarks/models.py`: pre-LN, causal attention, "
           "GELU MLP, learned positions, tied embeddings, blocks in one "
           "`nn.scan`). Variants: zerojax stages 0-3 "
           "(`stacked=(\"blocks\",)`), `plain-dp` (jax.jit, replicated "
           "params, batch sharded), `gspmd-fsdp` (MaxText-style: every leaf "
           "sharded on its largest divisible axis, XLA inserts the "
           "collectives); see `benchmarks/variants.py`. The step-time suite "
           "also runs two models written as users write them "
           "(`benchmarks/user_models.py`: a residual MLP and a transformer, "
           "one submodule per block in a Python loop, no `nn.scan`, so many "
           "leaves share a chunk) against plain DP, and zerojax stage 0 on "
           "a 1-device mesh against plain optax on that device, and "
           "third-party code: Hugging Face's Flax GPT-2 and Llama "
           "(`benchmarks/third_party.py`, `transformers` 4.x, the `hf` "
           "extra), their blocks a setup-time list.", ""]
  for mode in MODES:
    results = _load(out, mode)
    if not results:
      continue
    meta = next(iter(results.values()))["meta"]
    # suites are rerun separately (--suites): each has its own date
    dates = ", ".join(
        f"{suite} {r['meta']['date']}" + (
            "" if r["meta"].get("allocator", "system") == "system"
            else " (pooled malloc)") for suite, r in results.items())
    lines += [f"## `--{mode}`", "",
              f"jax {meta['jax']}, {meta['backend']} backend, "
              f"{meta['devices']} devices, " + (
                  f"{meta['cpu_count']} CPU cores, "
                  f"{meta['host_memory_bytes'] / 2 ** 30:.0f} GiB host "
                  "memory" if meta.get("cpu_count") else "host not recorded")
              + f". Measured: {dates}.", ""]
    goals = _goals_table(results)
    if goals:
      lines += ["Goals:", ""] + goals + [""]
    if "speed" in results:
      lines += _speed_md(results["speed"], mode)
    if "memory" in results:
      lines += _memory_md(results["memory"], mode)
    if "comm" in results:
      lines += _comm_md(results["comm"], mode)
    if "offload" in results:
      lines += _offload_md(results["offload"], mode)
    if "disk" in results:
      lines += _disk_md(results["disk"], mode)
    if "checkpoint" in results:
      lines += _checkpoint_md(results["checkpoint"], mode)
    if "throughput" in results:
      lines += _throughput_md(results["throughput"], mode)
    if "frontends" in results:
      lines += _frontends_md(results["frontends"], mode)
    if "hybrid" in results:
      lines += _hybrid_md(results["hybrid"], mode)
    if "tp" in results:
      lines += _tp_md(results["tp"], mode)
    if "quantized" in results:
      lines += _quantized_md(results["quantized"], mode)
  return "\n".join(lines) + "\n"


# ---- plots ---------------------------------------------------------------------
def _bar_colors(names):
  return [COLORS.get(n, "#756bb1") for n in names]


def plot_speed(r: dict, path: str):
  runs = r.get("models", [r])
  fig, axes = plt.subplots(len(runs), 1, figsize=(7, 3.8 * len(runs)),
                           squeeze=False)
  for ax, m in zip(axes[:, 0], runs):
    _plot_speed_model(ax, m)
  _save(fig, path)


def _plot_speed_model(ax, r: dict):
  ratios = r["ratio_vs_plain_dp"]
  minima = r["min_ratio_vs_plain_dp"]
  names = list(ratios)
  ax.barh(names, [ratios[n] for n in names], color=_bar_colors(names),
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


def plot_memory(r: dict, path: str):
  configs = list(r["rows"])
  fig, axes = plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4),
                           squeeze=False)
  for ax, cfg_name in zip(axes[0], configs):
    rows = [row for row in r["rows"][cfg_name] if "error" not in row]
    names = [row["variant"] for row in rows]
    x = range(len(rows))
    w = 0.27
    ax.bar([i - w for i in x], [row["theory_bytes"] / MIB for row in rows], w,
           label="theory (persistent)", color="#d9d9d9", edgecolor="k", lw=0.5)
    ax.bar(list(x), [row["persistent_bytes"] / MIB for row in rows], w,
           label="persistent (measured)", color="#6baed6")
    ax.bar([i + w for i in x], [row["footprint"] / MIB for row in rows], w,
           label="compiled footprint", color="#08519c")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("MiB per device")
    n_params = r["configs"][cfg_name]["num_params"]
    ax.set_title(f"{cfg_name} (Ψ = {n_params / 1e6:.1f}M)", fontsize=10)
    ax.legend(fontsize=8)
  _save(fig, path)


def plot_throughput(r: dict, path: str):
  """Model TFLOP/s per variant (MFU where the device's peak is known), one
  bar per attention."""
  rows = [row for row in r["rows"] if "error" not in row]
  settings = list(dict.fromkeys(map(gpu.setting, rows)))
  variants = list(dict.fromkeys(row["variant"] for row in rows))
  mfu = all(row["mfu"] is not None for row in rows)
  fig, ax = plt.subplots(figsize=(8.5, 0.3 * len(variants) * max(
      len(settings), 1) + 1.8))
  height = 0.8 / max(len(settings), 1)
  for k, key in enumerate(settings):
    got = {row["variant"]: row for row in rows if gpu.setting(row) == key}
    one = next(iter(got.values()))
    label = (f"{one.get('attention', 'einsum')} attention, "
             f"{one.get('config', r['setup']['config'])}, batch "
             f"{one.get('batch_per_device', r['setup']['batch_per_device'])}"
             f" {gpu.flags_beside_defaults(one.get('xla_flags'))}")
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
  _save(fig, path)


def _save(fig, path: str):
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _finish_line_plot(fig, ax, path: str):
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  _save(fig, path)


def plot_depth(r: dict, path: str):
  d = r["depth_sweep"]
  fig, ax = plt.subplots(figsize=(6.5, 4))
  for name, values in d["footprint"].items():
    ax.plot(d["layers"], [v / MIB for v in values], marker="o", label=name,
            color=COLORS.get(name), ls="--" if name in ("plain-dp",
                                                        "gspmd-fsdp") else "-")
  ax.set_xlabel("layers")
  ax.set_xticks(d["layers"])
  ax.set_ylabel("compiled footprint per device (MiB)")
  ax.set_title(f"Footprint vs depth ({r['depth_config']} width, 8 devices)",
               fontsize=10)
  _finish_line_plot(fig, ax, path)


def plot_offload(r: dict, path: str):
  fig, ax = plt.subplots(figsize=(6.5, 4))
  colors = {"no offload": COLORS["zero-3"], "offload_optimizer": "#e6550d"}
  for name, f in r["largest"].items():
    ax.plot([p[0] for p in f["points"]], [p[1] / MIB for p in f["points"]],
            marker="o", label=f"{name}: {f['layers']} layers fit",
            color=colors.get(name))
  ax.axhline(r["budget"] / MIB, color="k", ls="--", lw=0.8,
             label="budget (no-offload footprint)")
  ax.set_xlabel(f"layers (width {r['width']})")
  ax.set_ylabel("device MiB per device (compiled)")
  ax.set_title(f"Stage 3, {r['devices']} devices: {r['size_ratio']:.2f}× the "
               "parameters with optimizer offload", fontsize=10)
  _finish_line_plot(fig, ax, path)


def plot_disk(r: dict, path: str):
  """Host and device MiB per device against depth, each tier and stage,
  with the budgets: a tier's depth ends where either line crosses its
  budget."""
  cases = _disk_cases(r)
  fig, axes = plt.subplots(2, len(cases), figsize=(6 * len(cases), 7),
                           squeeze=False, sharex="col")
  for col, (stage, x) in enumerate(cases.items()):
    for row, kind in enumerate(("host", "device")):
      ax = axes[row][col]
      for tier, color in (("host", "#e6550d"), ("disk", COLORS["zero-3"])):
        pts = sorted((int(k), v[kind]) for k, v in
                     x["largest"][tier]["points"].items())
        ax.plot([p[0] for p in pts], [p[1] / MIB for p in pts], marker="o",
                color=color, label=f"{tier} tier: "
                f"{x['largest'][tier]['layers']} layers fit")
      ax.axhline(x["budget"][kind] / MIB, color="k", ls="--", lw=0.8,
                 label=f"{kind} budget")
      ax.set_ylabel(f"{kind} MiB per device")
      ax.legend(fontsize=8)
      ax.grid(alpha=0.3)
    axes[0][col].set_title(f"Stage {stage}: {x['size_ratio']:.2f}× the "
                           "parameters with the disk tier", fontsize=10)
    axes[1][col].set_xlabel(f"layers (width {r['width']})")
  _save(fig, path)


def plot_checkpoint(r: dict, path: str):
  configs = r["configs"]
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.8))
  labels = [f"{c['config']}\n{what}" for c in configs
            for what in ("save", "first save", "restore", "first restore")]
  x = range(len(labels))
  for ax, key, unit, title in (
      (axes[0], "total_s", 1, "time (s)"),
      (axes[1], "peak_increase", MIB, "peak host increase (MiB)")):
    for i, (side, color) in enumerate((("zerojax", COLORS["zero-3"]),
                                       ("orbax", COLORS["plain-dp"]))):
      vals = []
      for c in configs:
        rows = c["rows"]
        for what in ("save", "restore"):
          vals += [rows[f"{side}-{what}"][key] / unit,
                   rows[f"{side}-{what}"]["first"][key] / unit]
      ax.bar([j + 0.4 * i for j in x], vals, width=0.4, color=color,
             label="zerojax stage 3" if side == "zerojax" else "plain orbax")
    if key == "peak_increase":
      for j, c in enumerate(configs):
        ax.axhline(c["state_bytes"] / MIB, color="k", ls="--", lw=0.8,
                   label=f"state size ({c['config']})" if j == 0 else None)
    ax.set_xticks([j + 0.2 for j in x], labels, fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
  axes[0].legend(fontsize=8)
  axes[1].legend(fontsize=8)
  _save(fig, path)


def plot_comm(r: dict, path: str):
  rows = r["rows"]
  names = [row["variant"] for row in rows]
  kinds = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all",
           "collective-permute")
  colors = {"all-gather": "#08519c", "reduce-scatter": "#6baed6",
            "all-reduce": "#e6550d", "all-to-all": "#31a354",
            "collective-permute": "#756bb1"}
  fig, ax = plt.subplots(figsize=(8, 4))
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
  _save(fig, path)


def plot_chunks(r: dict, path: str):
  rows = r["chunk_sweep"]
  fig, ax = plt.subplots(figsize=(6.5, 4))
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
            color=COLORS.get(f"zero-{stage}"))
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
  _finish_line_plot(fig, ax, path)


def plot_frontends(r: dict, path: str):
  fig, ax = plt.subplots(figsize=(6.4, 3.6))
  labels = [f"{row['model']}\nzero-{row['stage']}" for row in r["rows"]]
  ax.bar(labels, [row["min_ratio"] for row in r["rows"]], color="#756bb1")
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.axhline(1.05, color="#e6550d", linestyle="--", linewidth=0.8,
             label="goal: NNX within 1.05x of linen")
  ax.set_ylabel("step time, NNX / linen (minima)")
  ax.legend(fontsize=8)
  _save(fig, path)


def _quantized_md(r: dict, mode: str) -> list:
  comm, qual = r["communication"], r["quality"]
  lines = ["### ZeRO++ quantized collectives", "",
           f"Stage 3, bf16 compute, 8 devices ({comm['config']}, block "
           f"B = {comm['block']}): bytes per device per step by collective, "
           "from the compiled HLO (`benchmarks/quantized.py`). XLA's CPU "
           "backend gathers bf16 as f32: a GPU sends half the plain "
           "all-gather bytes shown. Run: "
           f"`python -m benchmarks.run --{mode} --suites quantized`.", "",
           "| mode | all-gather | reduce-scatter | all-to-all | wire dtypes |",
           "|---|---:|---:|---:|---|"]
  for label, row in comm["rows"].items():
    kinds = ("all-gather", "reduce-scatter", "all-to-all")
    dtypes = sorted({d for k in kinds for d in row.get(k, {}).get("dtypes", [])})
    lines.append(f"| {label} | " + " | ".join(
        _mib(row.get(k, {}).get("bytes", 0)) for k in kinds) +
        f" | {', '.join(dtypes)} |")
  lines += ["", "The same on the hybrid (2, 4) mesh under hpZ, per axis "
            "(within a node / across nodes):", "",
            "| mode | gathers within | gathers across | gradients within | "
            "gradients across |", "|---|---:|---:|---:|---:|"]
  for label, row in comm["hybrid"].items():
    grads = lambda where: sum(v["bytes"] for k, v in row.items()
                              if k.split()[0] in ("reduce-scatter", "all-to-all")
                              and k.endswith(where))
    lines.append(f"| {label} | {_mib(row.get('all-gather within', {}).get('bytes', 0))}"
                 f" | {_mib(row.get('all-gather across', {}).get('bytes', 0))} | "
                 f"{_mib(grads('within'))} | {_mib(grads('across'))} |")
  if "hsdp" in comm:
    plain = comm["hsdp"]["plain"]["across"]
    lines += ["", "Under HSDP on that mesh, bytes a device sends per step "
              "(ring algorithms): the once-per-step replica all-reduce of "
              "the gradient shards goes as a quantized reduce-scatter and a "
              "quantized gather of the sums.", "",
              "| mode | sent within | sent across | across / unquantized |",
              "|---|---:|---:|---:|"]
    for label, row in comm["hsdp"].items():
      lines.append(f"| {label} | {_mib(row['within'])} | "
                   f"{_mib(row['across'])} | {row['across'] / plain:.3f} |")
  seeds = len(qual.get("seeds", [0]))
  lines += ["", f"Training quality: the GPT-2 example, `--preset tiny`, bf16, "
            f"byte-level text, {qual['steps']} steps, {seeds} seed(s) per run "
            "(final losses averaged); int8 weights and int4 gradients against "
            "unquantized. The unquantized runs' finals spread by "
            f"{qual.get('seed_spread', 0):.1%} over the seeds.", "",
            "| run | final loss (last 10 steps) | / unquantized | median "
            "grad-norm ratio |", "|---|---:|---:|---:|"]
  for label, loss in qual["final"].items():
    lines.append(f"| {label} | {loss:.4f} | "
                 f"{loss / qual['final']['plain']:.4f} | "
                 f"{qual['grad_norm_ratio'][label]:.3f} |")
  return lines + ["", f"![quantized]({mode}_quantized.png)", ""]


def plot_quantized(r: dict, path: str):
  qual = r["quality"]
  fig, (ax, norms) = plt.subplots(1, 2, figsize=(11, 3.8))
  plain = qual["runs"]["plain"]
  for label, run in qual["runs"].items():
    steps = range(1, len(run) + 1)
    ax.plot(steps, [x["loss"] for x in run], linewidth=1,
            label="unquantized" if label == "plain" else
            f"int8 weights + int4 gradients, {label}")
    if label != "plain":
      norms.plot(steps, [x["grad_norm"] / p["grad_norm"]
                         for x, p in zip(run, plain)], linewidth=0.8,
                 label=label)
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title("GPT-2 example (tiny, bf16, byte-level text)", fontsize=10)
  ax.legend(fontsize=8)
  norms.axhline(1.0, color="black", linewidth=0.8)
  norms.set_yscale("log")
  norms.set_xlabel("step")
  norms.set_ylabel("grad norm / unquantized run's")
  norms.legend(fontsize=8)
  _save(fig, path)


def plot_hybrid(r: dict, path: str):
  from benchmarks.hybrid import inter_node_wire
  fig, (ax, curve) = plt.subplots(1, 2, figsize=(11, 3.8))
  labels = list(r["rows"])
  within = [sum(r["rows"][k]["within"].values()) / 2 ** 20 for k in labels]
  across = [sum(r["rows"][k]["across"].values()) / 2 ** 20 for k in labels]
  x = range(len(labels))
  ax.bar([i - 0.2 for i in x], within, width=0.4, label="within a node",
         color="#9ecae1")
  ax.bar([i + 0.2 for i in x], across, width=0.4, label="across nodes",
         color="#e6550d")
  ax.set_xticks(list(x), labels)
  ax.set_ylabel("MiB per device per step (collective sizes)")
  ax.set_title(f"stage 3, {r['devices']} devices as {r['nodes']} nodes "
               f"({r['config']})", fontsize=10)
  ax.legend(fontsize=8)
  # inter-node bytes a device sends per step, per parameter, against N
  colors = {"zero-3 1-D": "#636363", "zero-3 HSDP": "#3182bd",
            "zero-3 hpZ": "#31a354"}
  node = r["devices"] // r["nodes"]
  for label in labels:
    if label not in colors:
      continue
    gpu = [2 ** k for k in range(4, 11)]      # from 2 nodes of 8
    curve.plot(gpu, [inter_node_wire(label, 1, n, 8, b=2) for n in gpu],
               color=colors[label], label=f"{label[7:]}: GPU nodes of 8, bf16")
    ours = [n for n in range(2 * node, 2 ** 10 + 1, node)]
    curve.plot(ours, [inter_node_wire(label, 1, n, node, b=4) for n in ours],
               color=colors[label], linestyle=":", linewidth=1)
    wire = r["rows"][label].get("wire", {}).get("across")
    if wire is not None:
      curve.plot([r["devices"]], [wire / r["num_params"]], "o",
                 color=colors[label])
  curve.set_xscale("log", base=2)
  curve.set_yscale("log")
  curve.set_xlabel("devices N")
  curve.set_ylabel("bytes sent across nodes per device\nper step, per parameter")
  curve.set_title(f"formulas; dotted: nodes of {node}, fp32 (HSDP = hpZ "
                  "there), dots: measured", fontsize=9)
  curve.legend(fontsize=7)
  _save(fig, path)


def plot_tp(r: dict, path: str):
  fig, (comm, mem) = plt.subplots(1, 2, figsize=(11, 3.8))
  labels = list(r["rows"])
  x = range(len(labels))
  for shift, axis, color in ((-0.2, "data", "#3182bd"), (0.2, "model", "#e6550d")):
    comm.bar([i + shift for i in x],
             [sum(r["rows"][k][axis].values()) / MIB for k in labels],
             width=0.4, label=f"over {axis} (measured)", color=color)
    comm.plot([i + shift for i in x],
              [r["theory"][k][axis] / MIB for k in labels], "k_",
              markersize=18, label=None if axis == "model" else "theory")
  comm.set_xticks(list(x), labels, fontsize=8)
  comm.set_ylabel("MiB per device per step")
  comm.set_title(f"collectives by mesh axis, (data {r['data']}, model "
                 f"{r['model']}), {r['config']}", fontsize=10)
  comm.legend(fontsize=8)
  mem.bar([i - 0.2 for i in x], [r["memory"][k]["persistent"] / MIB
                                 for k in labels], width=0.4,
          label="persistent state", color="#08519c")
  mem.bar([i + 0.2 for i in x], [r["memory"][k]["compiled"] / MIB
                                 for k in labels], width=0.4,
          label="compiled step (device)", color="#9ecae1")
  mem.plot([i - 0.2 for i in x], [r["memory"][k]["theory"] / MIB
                                  for k in labels], "k_", markersize=18,
           label="theory (persistent)")
  mem.set_xticks(list(x), labels, fontsize=8)
  mem.set_yscale("log")
  mem.set_ylabel("MiB per device")
  mem.set_title("memory per device", fontsize=10)
  mem.legend(fontsize=8)
  _save(fig, path)


def write(out: str, mode: str):
  """Plots of `mode` from its result files, then README.md for all modes."""
  results = _load(out, mode)
  if "speed" in results:
    plot_speed(results["speed"], os.path.join(out, f"{mode}_speed.png"))
  if "memory" in results:
    plot_memory(results["memory"], os.path.join(out, f"{mode}_memory.png"))
    plot_depth(results["memory"], os.path.join(out, f"{mode}_depth.png"))
  if "offload" in results:
    plot_offload(results["offload"], os.path.join(out, f"{mode}_offload.png"))
  if "disk" in results:
    plot_disk(results["disk"], os.path.join(out, f"{mode}_disk.png"))
  if "checkpoint" in results:
    plot_checkpoint(results["checkpoint"],
                    os.path.join(out, f"{mode}_checkpoint.png"))
  if "hybrid" in results:
    plot_hybrid(results["hybrid"], os.path.join(out, f"{mode}_hybrid.png"))
  if "tp" in results:
    plot_tp(results["tp"], os.path.join(out, f"{mode}_tp.png"))
  if "quantized" in results:
    plot_quantized(results["quantized"],
                   os.path.join(out, f"{mode}_quantized.png"))
  if "throughput" in results:
    plot_throughput(results["throughput"],
                    os.path.join(out, f"{mode}_throughput.png"))
  if "frontends" in results:
    plot_frontends(results["frontends"], os.path.join(out, f"{mode}_frontends.png"))
  if "comm" in results:
    plot_comm(results["comm"], os.path.join(out, f"{mode}_comm.png"))
    plot_chunks(results["comm"], os.path.join(out, f"{mode}_chunks.png"))
  with open(os.path.join(out, "README.md"), "w") as f:
    f.write(markdown(out))
