"""ZeRO++'s quantized collectives: bytes on the wire and training quality.

Communication: stage 3 in bf16 on 8 devices, the GPT config compiled plain
and with qwZ / qgZ, collectives read from the optimized HLO. XLA's CPU
backend gathers bf16 as f32, so a plain gather is counted at the 2 bytes an
element a GPU sends. Stated per element on the wire (blocks of B, each with
a float32 absmax; shards padded to whole blocks): gathers 1 + 4/B bytes
(int8) against bf16's 2; gradients 1 + 4/B (int8) or 1/2 + 4/B (int4)
against the fp32 reduce-scatter's 4. On the hybrid (2, 4) mesh under hpZ
the same per axis. Under HSDP on that mesh, what a device sends across
nodes per step (ring algorithms): the replica all-reduce of the gradient
shards, 2(R-1)/R · 4 bytes an element plain, 2(R-1)/R · (1 + 4/B) at int8
and 2(R-1)/R · (1/2 + 4/B) at int4 quantized (a reduce-scatter and a
gather of the sums, each row padded to whole blocks).

Training quality: the GPT-2 example (`--preset tiny`, bf16, byte-level
text `--text docs/design.md`) for 300 steps, unquantized and with
`--quantize-weights int8 --quantize-grads int4` at several block sizes,
three seeds each: the final loss (mean of the last 10 steps, averaged over
the seeds) against the unquantized runs', beside the unquantized runs'
spread over seeds, and the gradient-norm ratio along the way.

    python -m benchmarks.run --quick --suites quantized
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile

import jax.numpy as jnp

from benchmarks import charts
from benchmarks import models
from benchmarks import variants as V
from zerojax._plan.hlo import count_collectives
from benchmarks.hybrid import _per_axis

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCK = 256   # ZeroConfig's default
MODES = {"plain": {}, "qwZ int8 + qgZ int8": dict(quantize_weights="int8",
                                                  quantize_grads="int8"),
         "qwZ int8 + qgZ int4": dict(quantize_weights="int8",
                                     quantize_grads="int4")}


def _kinds(compiled, node=None) -> dict:
  """{kind (or "kind within" / "kind across" with `node`): {"bytes",
  "elements" (f32 bytes / 4: the plain path's elements), "dtypes"}}."""
  out = {}
  for op in count_collectives(compiled).ops:
    if op.trips is None or op.group_size <= 1 or op.kind == "all-reduce":
      continue
    key = op.kind if node is None else (
        f"{op.kind} {'within' if op.group_size == node else 'across'}")
    row = out.setdefault(key, {"bytes": 0, "dtypes": []})
    row["bytes"] += op.trips * op.bytes
    row["dtypes"] = sorted(set(row["dtypes"]) | set(op.dtypes))
  return out


def _stated(plain_ops: list, kind: str, per_element: float, block: int) -> float:
  """Bytes the quantized form of the plain program's `kind` ops (gathers or
  reduce-scatters) sends: each op's shard padded to whole blocks, times
  `per_element` bytes."""
  total = 0.0
  for op in plain_ops:
    if op["kind"] != kind:
      continue
    size = 4 if "f32" in op["dtypes"] else 2
    shard = op["bytes"] // size // op["group"]
    total += op["trips"] * op["group"] * -(-shard // block) * block * per_element
  return total


def communication(mode: str, log=print) -> dict:
  """Bytes per device per step of stage 3 (bf16) with each quantization,
  on 8 devices (1-D) and on the hybrid (2, 4) mesh under hpZ."""
  name = "tiny" if mode == "smoke" else "cpu-1m"
  cfg = models.CONFIGS[name]
  block = 64 if mode == "smoke" else BLOCK
  rows, hybrid, hsdp, plain_ops = {}, {}, {}, []
  for label, fields in MODES.items():
    log(f"quantized: {label} ({name})")
    v = V.build("zero-3", cfg, global_batch=16, seq=64, num_devices=8,
                materialize=False, compute_dtype=jnp.bfloat16,
                quantize_block=block, **fields)
    rows[label] = _kinds(v.compiled())
    if not fields:
      plain_ops = [{"kind": op.kind, "bytes": op.bytes, "group": op.group_size,
                    "trips": op.trips, "dtypes": list(op.dtypes)}
                   for op in count_collectives(v.compiled()).ops
                   if op.kind in ("all-gather", "reduce-scatter")]
    h = V.build("zero-3", cfg, global_batch=16, seq=64, num_devices=8,
                materialize=False, compute_dtype=jnp.bfloat16, replicas=2,
                hpz=True, quantize_block=block, **fields)
    hybrid[label] = _kinds(h.compiled(), node=4)
    d = V.build("zero-3", cfg, global_batch=16, seq=64, num_devices=8,
                materialize=False, compute_dtype=jnp.bfloat16, replicas=2,
                quantize_block=block, **fields)
    hsdp[label] = _per_axis(d, node=4)["wire"]
    shards = [(int(np_prod(c.shape[:-1])), c.shape[-1] // 4)
              for c in d.layout.chunks]
  return {"config": name, "block": block, "plain_ops": plain_ops,
          "rows": rows, "hybrid": hybrid, "hsdp": hsdp,
          "hsdp_shards": shards, "replicas": 2}


def np_prod(shape) -> int:
  out = 1
  for n in shape:
    out *= int(n)
  return out


def hsdp_wire_across(shards: list, replicas: int, per_element: float,
                     block) -> float:
  """Bytes a device sends across nodes per step for HSDP's replica
  all-reduce of gradient shards `shards` ([(rows, length)]): plain
  (`block` None) 2(R-1)/R · `per_element` an element; quantized, a
  reduce-scatter and a gather of each row's R slices, each padded to
  whole blocks."""
  r, total = replicas, 0.0
  for rows, n in shards:
    if block is None:
      total += rows * n * per_element
    else:
      total += rows * r * -(-(-(-n // r)) // block) * block * per_element
  return 2 * (r - 1) / r * total


def _example(steps: int, block, quantized: bool, seed: int, out: str) -> list:
  args = [sys.executable, os.path.join(ROOT, "examples", "gpt2_medium.py"),
          "--preset", "tiny", "--steps", str(steps), "--precision", "bf16",
          "--seed", str(seed),
          "--text", os.path.join(ROOT, "docs", "design.md"), "--json", out]
  if quantized:
    args += ["--quantize-weights", "int8", "--quantize-grads", "int4",
             "--quantize-block", str(block)]
  # the caller's XLA flags: its 8 simulated devices (the example's own
  # default, which it then leaves alone) and any compile flags it runs with
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  subprocess.run(args, check=True, env=env, cwd=ROOT,
                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
  with open(out) as f:
    return [{"loss": r["loss"], "grad_norm": r["grad_norm"]}
            for r in json.load(f)["steps"]]


def quality(mode: str, log=print) -> dict:
  """Per run (unquantized, and int8 weights + int4 gradients per block
  size): the seed-0 curve (`runs`), the final loss averaged over the seeds
  (`final`), the spread of the unquantized finals over seeds (`seed_spread`,
  max - min over mean: the noise a ratio is read against) and the median
  gradient-norm ratio against the unquantized run of the same seed."""
  steps = 20 if mode == "smoke" else 300
  blocks = [BLOCK] if mode == "smoke" else [BLOCK, 2048, 64]
  seeds = [0] if mode == "smoke" else [0, 1, 2]
  configs = {"plain": None, **{f"block {b}": b for b in blocks}}
  all_runs = {label: [] for label in configs}
  with tempfile.TemporaryDirectory() as tmp:
    for seed in seeds:
      for label, block in configs.items():
        log(f"quantized: example, {label}, seed {seed}, {steps} steps")
        all_runs[label].append(_example(
            steps, block, block is not None, seed,
            os.path.join(tmp, f"{label}-{seed}.json".replace(" ", "_"))))
  final = lambda run: statistics.fmean(r["loss"] for r in run[-10:])
  plain_finals = [final(run) for run in all_runs["plain"]]
  out = {"steps": steps, "seeds": seeds,
         "runs": {label: runs[0] for label, runs in all_runs.items()},
         "final": {}, "grad_norm_ratio": {},
         "seed_spread": (max(plain_finals) - min(plain_finals)) /
                        statistics.fmean(plain_finals)}
  for label, runs in all_runs.items():
    out["final"][label] = statistics.fmean(final(run) for run in runs)
    out["grad_norm_ratio"][label] = statistics.median(
        r["grad_norm"] / p["grad_norm"] for run, plain in
        zip(runs, all_runs["plain"]) for r, p in zip(run, plain))
  return out


def run(mode: str, log=print) -> dict:
  return {"communication": communication(mode, log), "quality": quality(mode, log)}


def _total(row: dict, kind: str) -> int:
  return sum(v["bytes"] for k, v in row.items() if k.startswith(kind))


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]."""
  comm, checks = result["communication"], []
  b, ops, plain = comm["block"], comm["plain_ops"], comm["rows"]["plain"]
  # the plain gathers' elements (f32 on CPU, bf16 on a GPU) at 2 bytes each
  size = 4 if "f32" in plain["all-gather"]["dtypes"] else 2
  bases = {"all-gather": _total(plain, "all-gather") // size * 2,
           "reduce-scatter": _total(plain, "reduce-scatter")}
  for label, kind, plain_kind, per_element, name in (
      ("qwZ int8 + qgZ int8", "all-gather", "all-gather", 1 + 4 / b,
       "int8 gathers / bf16"),
      ("qwZ int8 + qgZ int8", "all-to-all", "reduce-scatter", 1 + 4 / b,
       "int8 gradients / fp32"),
      ("qwZ int8 + qgZ int4", "all-to-all", "reduce-scatter", 0.5 + 4 / b,
       "int4 gradients / fp32")):
    got = _total(comm["rows"][label], kind)
    stated = _stated(ops, plain_kind, per_element, b)
    checks.append((f"{name}: bytes / theory ({comm['config']}, B={b}, "
                   f"{got / bases[plain_kind]:.3f} of plain)", got / stated,
                   1.05, abs(got / stated - 1) <= 0.05))
  shards, r = comm.get("hsdp_shards"), comm.get("replicas")
  plain_across = comm.get("hsdp", {}).get("plain", {}).get("across")
  for label, per_element in (("qwZ int8 + qgZ int8", 1 + 4 / b),
                             ("qwZ int8 + qgZ int4", 0.5 + 4 / b)):
    if shards is None:
      break
    got = comm["hsdp"][label]["across"]
    stated = hsdp_wire_across(shards, r, per_element, b)
    checks.append((f"HSDP across nodes, {label.split(' + ')[1]} gradients: "
                   f"bytes sent / theory ({got / plain_across:.3f} of the "
                   f"fp32 all-reduce's)", got / stated, 1.05,
                   abs(got / stated - 1) <= 0.05))
  if shards is not None:
    stated = hsdp_wire_across(shards, r, 4, None)
    checks.append(("HSDP across nodes, unquantized: bytes sent / theory",
                   plain_across / stated, 1.05,
                   abs(plain_across / stated - 1) <= 0.05))
  qual = result["quality"]
  for label, loss in qual["final"].items():
    if label == "plain":
      continue
    ratio = loss / qual["final"]["plain"]
    checks.append((f"final loss, int8 weights + int4 gradients, {label} / "
                   f"unquantized ({qual['steps']} steps, mean of "
                   f"{len(qual['seeds'])} seeds)", ratio, 1.02, ratio <= 1.02))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
        charts.mib(row.get(k, {}).get("bytes", 0)) for k in kinds) +
        f" | {', '.join(dtypes)} |")
  lines += ["", "The same on the hybrid (2, 4) mesh under hpZ, per axis "
            "(within a node / across nodes):", "",
            "| mode | gathers within | gathers across | gradients within | "
            "gradients across |", "|---|---:|---:|---:|---:|"]
  for label, row in comm["hybrid"].items():
    grads = lambda where: sum(v["bytes"] for k, v in row.items()
                              if k.split()[0] in ("reduce-scatter", "all-to-all")
                              and k.endswith(where))
    lines.append(f"| {label} | {charts.mib(row.get('all-gather within', {}).get('bytes', 0))}"
                 f" | {charts.mib(row.get('all-gather across', {}).get('bytes', 0))} | "
                 f"{charts.mib(grads('within'))} | {charts.mib(grads('across'))} |")
  if "hsdp" in comm:
    plain = comm["hsdp"]["plain"]["across"]
    lines += ["", "Under HSDP on that mesh, bytes a device sends per step "
              "(ring algorithms): the once-per-step replica all-reduce of "
              "the gradient shards goes as a quantized reduce-scatter and a "
              "quantized gather of the sums.", "",
              "| mode | sent within | sent across | across / unquantized |",
              "|---|---:|---:|---:|"]
    for label, row in comm["hsdp"].items():
      lines.append(f"| {label} | {charts.mib(row['within'])} | "
                   f"{charts.mib(row['across'])} | {row['across'] / plain:.3f} |")
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
  fig, (ax, norms) = charts.plt.subplots(1, 2, figsize=(11, 3.8))
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
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_quantized(r, os.path.join(out, f"{mode}_quantized.png"))
