"""The sequence length that fits: a 1.0 B decoder as users write it
(unrolled blocks in a Python loop, a memory-efficient attention, no
zerojax edits), compiled on this CPU machine for 1 x 8 H100
(`zerojax.GpuTarget`), bf16 compute, fp32 master and AdamW state, one
sequence per GPU. For each configuration and each sequence length from 2k
up in powers of two: the per-GPU bytes of the GPU program
(`memory_analysis()`), whether they fit in the card's 80 GB, and the
modelled step ([Note: the modelled step] in `zerojax/_plan/schedule.py`:
host copies on a PCIe queue of their own). A configuration's lengths stop
at the first that does not fit.

    python -m benchmarks.long_sequence            # every row (~30 min)
    python -m benchmarks.long_sequence --quick    # 2k and 4k only
    python -m benchmarks.long_sequence --only "zero-3 remat=offload"
        # that configuration's rows again, the others' kept from the
        # saved results

Configurations: plain `jax.jit` data parallelism and GSPMD FSDP, each
with every block rematerialised (`nn.remat`), and zerojax stage 3 with
`Blocks(remat="none" | "dots" | "full" | "offload")`. Each case is
compiled in a fresh process (`--child`). Results:
`benchmarks/results/long_sequence.{json,md,png}`.

The attention: `benchmarks.models.chunked_attention`, blocks of queries
against blocks of keys (512 tokens, or a sixteenth of the sequence where
that is more) with a running softmax (Rabe and
Staats's memory-efficient attention, flash attention's arithmetic in plain
JAX), so that no configuration is bounded by T x T scores. cuDNN's fused
kernel (`jax.nn.dot_product_attention(implementation="cudnn")`) cannot be
compiled here: jax asks for the cuDNN library when it lowers it ("cuDNN
not found"), and this machine has no `nvidia-*` wheels. XLA's own
implementation writes out every head's T x T scores: with it every
configuration stops at 16k tokens (docs/decisions.md, 2026-12-03).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# width 2,048 over 20 blocks of 16 heads, a 32,000-word vocabulary: 1.0 B
# parameters, the shape of the 1 B Llamas (GPT-2's blocks: LayerNorm and a
# GELU MLP of 4 x width, not RMSNorm and SwiGLU; no position table, as for
# rotary positions); its attention `models.chunked_attention`
SHAPE = dict(vocab_size=32000, width=2048, layers=20, heads=16, scan=False,
             opt_in=False, attention="chunked", learned_positions=False)
CONFIGS = ("plain-dp (full remat)", "gspmd-fsdp (full remat)",
           "zero-3 remat=none", "zero-3 remat=dots", "zero-3 remat=full",
           "zero-3 remat=offload")
LENGTHS = tuple(2048 * 2 ** i for i in range(7))   # 2k ... 128k
QUICK = (2048, 4096)


def child(config: str, seq: int) -> dict:
  """One case, compiled and read (see the module docstring)."""
  import time
  import jax.numpy as jnp
  import zerojax
  from benchmarks import models, variants
  target = zerojax.GpuTarget("h100")
  variant = config.split()[0]
  cfg = models.GPTConfig(max_len=seq, remat=not variant.startswith("zero"),
                         **SHAPE)
  zero = ({"remat": config.split("remat=")[1]}
          if variant.startswith("zero") else {})
  start = time.perf_counter()
  v = variants.build(variant, cfg, global_batch=target.devices, seq=seq,
                     num_devices=target.devices, materialize=False,
                     compute_dtype=jnp.bfloat16, mesh=target.mesh(), **zero)
  compiled = target.compile(v.lowered)
  ma = compiled.memory_analysis()
  footprint = (ma.argument_size_in_bytes + ma.output_size_in_bytes
               - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
  step = target.model(compiled)
  return dict(config=config, seq=seq, num_params=cfg.num_params,
              compile_s=round(time.perf_counter() - start, 1),
              footprint=int(footprint), temp=int(ma.temp_size_in_bytes),
              host_temp=int(getattr(ma, "host_temp_size_in_bytes", 0)),
              fits=bool(footprint <= target.memory_bytes),
              memory=target.memory_bytes,
              **{k: step.to_dict()[k] for k in (
                  "time_s", "compute_s", "exposed_s", "exposed_fraction")})


def _run_child(config: str, seq: int) -> dict:
  proc = subprocess.run(
      [sys.executable, "-m", "benchmarks.long_sequence", "--child", config,
       str(seq)], capture_output=True, text=True,
      env={**os.environ, "JAX_PLATFORMS": "cpu"})
  if proc.returncode:
    return dict(config=config, seq=seq,
                error=proc.stderr.strip().splitlines()[-1][:300])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(lengths=LENGTHS, configs=CONFIGS) -> list:
  rows = []
  for config in configs:
    for seq in lengths:
      row = _run_child(config, seq)
      print(json.dumps({k: row.get(k) for k in (
          "config", "seq", "footprint", "fits", "time_s", "compile_s",
          "error")}), flush=True)
      rows.append(row)
      if not row.get("fits"):
        break
  return rows


def longest(rows, config) -> dict | None:
  """The row of `config`'s longest sequence that fits, or None."""
  fit = [r for r in rows if r["config"] == config and r.get("fits")]
  return max(fit, key=lambda r: r["seq"], default=None)


def goals(rows) -> list:
  """(goal, measured, target, met) for issue 64's long-sequence rows."""
  out = []
  zero = [c for c in CONFIGS if c.startswith("zero")]
  theirs = [c for c in CONFIGS if not c.startswith("zero")]
  seqs = sorted({r["seq"] for r in rows})

  def fastest(configs, seq):
    fit = [r for r in rows if r["config"] in configs and r["seq"] == seq
           and r.get("fits")]
    return min(fit, key=lambda r: r["time_s"], default=None)

  dots = longest(rows, "zero-3 remat=dots")
  if dots is not None:
    at = {r["config"]: r for r in rows if r["seq"] == dots["seq"]
          and "error" not in r}
    off, full = at.get("zero-3 remat=offload"), at.get("zero-3 remat=full")
    if off is not None and full is not None:
      out.append((f"at {dots['seq']} tokens (the longest 'dots' fits): "
                  "offload's device temporaries / full's",
                  f"{off['temp'] / full['temp']:.2f}", "<= 1.20",
                  off["temp"] <= 1.2 * full["temp"]))
      out.append((f"at {dots['seq']} tokens: offload's modelled step / "
                  "dots'", f"{off['time_s'] / dots['time_s']:.2f}",
                  "<= 1.10", off["time_s"] <= 1.1 * dots["time_s"]))
  for seq in seqs:
    z, g = fastest(zero, seq), fastest(["gspmd-fsdp (full remat)"], seq)
    if z is not None and g is not None:
      out.append((f"{seq} tokens: zerojax's fastest that fits / GSPMD "
                  "FSDP's (modelled step)", f"{z['time_s'] / g['time_s']:.2f}",
                  "<= 1", z["time_s"] <= g["time_s"]))
  zl = max((longest(rows, c)["seq"] for c in zero if longest(rows, c)),
           default=0)
  gl = max((longest(rows, c)["seq"] for c in theirs if longest(rows, c)),
           default=0)
  out.append(("longest sequence zerojax fits / the longest plain DP or GSPMD "
              "FSDP fits", f"{zl} / {gl}", ">= 1", zl >= gl))
  return out


def write(rows: list, out: str, meta: dict) -> str:
  from benchmarks import charts
  plt = charts.plt
  ok = [r for r in rows if "error" not in r]
  table = ["| configuration | tokens per GPU | GiB per GPU | fits in 80 GB "
           "| device temporaries GiB | host temporaries GiB | modelled step "
           "s | exposed % | compile s |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
  for r in ok:
    table.append(
        f"| {r['config']} | {r['seq']} | {r['footprint'] / 2**30:.2f} | "
        f"{'yes' if r['fits'] else 'no'} | {r['temp'] / 2**30:.2f} | "
        f"{r['host_temp'] / 2**30:.2f} | {r['time_s']:.3f} | "
        f"{100 * r['exposed_fraction']:.1f} | {r['compile_s']:.0f} |")
  failed = [f"- {r['config']} at {r['seq']}: {r['error']}" for r in rows
            if "error" in r]
  fit = ["| configuration | longest sequence that fits | its modelled "
         "step s |", "|---|---:|---:|"]
  for c in CONFIGS:
    r = longest(rows, c)
    step = "—" if r is None else f"{r['time_s']:.3f}"
    fit.append(f"| {c} | {'none' if r is None else r['seq']} | {step} |")
  text = "\n".join([
      "# The sequence length that fits", "",
      f"`python -m benchmarks.long_sequence`, {meta['date']}, jax "
      f"{meta['jax']}: a 1.0 B decoder as users write it (width 2,048, 20 "
      "unrolled blocks of 16 heads, 32,000 words, no position table; a "
      "memory-efficient attention in plain JAX, `benchmarks.models."
      "chunked_attention`, blocks of 512 tokens or a sixteenth of the "
      "sequence, with a running "
      "softmax, since cuDNN's fused kernel cannot be lowered without the "
      "cuDNN library), compiled on this CPU machine for 1 x 8 H100 "
      "(`zerojax.GpuTarget`), bf16 compute, fp32 master and AdamW state, "
      "one sequence per GPU. Bytes: `memory_analysis()` of the GPU program "
      "(arguments + outputs - aliases + temporaries), against the card's "
      "80 GB; a configuration stops at its first length that does not fit. "
      "Step times are modelled, not measured ([Note: the modelled step]), "
      "host copies at PCIe's 55 GB/s on a queue of their own.", "",
      *[f"Rows of {c} measured again: {d}." for c, d in
        meta.get("measured again", {}).items()],
      *([""] if meta.get("measured again") else []),
      "| goal | measured | target | met |", "|---|---:|---:|---|",
      *[f"| {g} | {v} | {t} | {'yes' if m else 'no'} |"
        for g, v, t, m in goals(rows)], "", *fit, "", *table, "",
      *(["Cases that did not compile:", "", *failed, ""] if failed else []),
      "![sequence length that fits](long_sequence.png)", ""])
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "long_sequence.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "long_sequence.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
  for c in CONFIGS:
    rs = sorted((r for r in ok if r["config"] == c), key=lambda r: r["seq"])
    if not rs:
      continue
    left.plot([r["seq"] for r in rs], [r["footprint"] / 2**30 for r in rs],
              marker="o", label=c)
    fits = [r for r in rs if r["fits"]]
    right.plot([r["seq"] for r in fits], [r["time_s"] for r in fits],
               marker="o", label=c)
  left.axhline(ok[0]["memory"] / 2**30 if ok else 79.1, color="k",
               linestyle="--", linewidth=1, label="80 GB")
  for ax, label in ((left, "GiB per GPU"), (right, "modelled step, s")):
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("tokens per GPU")
    ax.set_ylabel(label)
  left.set_title("bytes per GPU (1 x 8 H100)", fontsize=9)
  right.set_title("modelled step where it fits", fontsize=9)
  left.legend(fontsize=7)
  charts.save(fig, os.path.join(out, "long_sequence.png"))
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
  parser.add_argument("--quick", action="store_true")
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "results"))
  parser.add_argument("--only", action="append", choices=CONFIGS,
                      help="measure these configurations again and keep "
                           "the saved rows of the others")
  args = parser.parse_args()
  if args.child:
    print(json.dumps(child(args.child[0], int(args.child[1]))))
    return
  import jax
  now = datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC")
  meta = {"date": now, "jax": jax.__version__}
  lengths = QUICK if args.quick else LENGTHS
  if args.only:
    with open(os.path.join(args.out, "long_sequence.json")) as f:
      saved = json.load(f)
    meta = dict(saved["meta"], jax=jax.__version__)
    meta["measured again"] = dict(meta.get("measured again", {}),
                                  **{c: now for c in args.only})
    new = measure(lengths, tuple(args.only))
    rows = [r for r in saved["rows"] if r["config"] not in args.only] + new
  else:
    rows = measure(lengths)
  print(write(rows, args.out, meta))


if __name__ == "__main__":
  main()
