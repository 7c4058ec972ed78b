"""Tensor parallelism beside ZeRO (`model_axis=`): communication per mesh
axis, memory per device and step time on 8 devices laid out as (data 4,
model 2), against 1-D ZeRO-3 over all 8 and against Megatron-style data +
tensor parallelism written with plain `jax.jit` (each weight placed by its
partition spec, replicated over data; XLA inserts the collectives).

The GPT's attention heads and MLP are split over "model" with
`nn.with_partitioning` (`models.GPTConfig(tp=M)`): Ψ_s of its Ψ parameters
are split, Ψ_u = Ψ − Ψ_s (embeddings, norms, the row-split layers' biases)
are whole. A device then holds Ψ' = Ψ_u + Ψ_s/M parameters' worth of rows,
and ZeRO shards those over data. Collectives are read from the optimized
HLO (`zerojax._plan.hlo`) and classed by their replica groups: groups of D = 4
run over data, groups of M = 2 over model, groups of all 8 span both (on
the 1-D mesh every group is all 8: that is its data axis). Theory per
device per step, fp32 (b = 4 bytes), `bytes` as `zerojax._plan.hlo` counts
them (an all-gather's output, a reduce-scatter's input, an all-reduce's
operand):

  zero-3 TP    over data: gathers 2·bΨ' (forward and rematerialised
               backward; non-layer chunks once), reduce-scatter 4Ψ';
               at most 12Ψ'. Over model: only the model's own all-reduces
               of activations: Megatron's two per block each way, plus the
               re-forward's first under `layerwise`'s remat (its second, on
               the block's output, is dead in the backward): 5·L·(B/D)·T·d·b
  DP + TP      over data: one all-reduce of the gradients, 4Ψ'; over
               model: 4·L·(B/D)·T·d·b (no remat)

Persistent bytes per device (Adam, fp32): 12Ψ'/D (zero-3 TP), 12Ψ' (DP +
TP), 12Ψ/8 (1-D).

    python -m benchmarks.run --quick --suites tp
"""
from __future__ import annotations

import os
import zerojax
from benchmarks import charts
from benchmarks import models, speed
from benchmarks import variants as V
from zerojax._plan.hlo import count_collectives

M = 2   # devices of the model axis
MODES = {"zero-3 1-D": ("zero-3", 1), "zero-3 TP": ("zero-3", M),
         "DP + TP (jax.jit)": ("plain-dp", M)}


def _per_axis(variant, data: int, model: int) -> dict:
  """Bytes per device per step by axis ("data", "model", "both") and
  collective kind, and the largest op over both axes."""
  out = {"data": {}, "model": {}, "both": {}, "largest_both": 0}
  for op in count_collectives(variant.compiled()).ops:
    if op.trips is None or op.group_size <= 1:
      continue
    where = ("data" if op.group_size == data else
             "model" if op.group_size == model else "both")
    out[where][op.kind] = out[where].get(op.kind, 0) + op.trips * op.bytes
    if where == "both":
      out["largest_both"] = max(out["largest_both"], op.bytes)
  return out


def run(mode: str, log=print) -> dict:
  """The GPT with its blocks in one `nn.scan` (`stacked`), and under
  "unrolled" the same GPT written one module per block (called in a Python
  loop; zero-3 takes `layerwise` per block; not in smoke mode): each {"config",
  "num_params", "split_params", "rows": {label: per-axis bytes}, "theory",
  "memory", "ratio", "min_ratio" (step time zero-3 TP / DP + TP, medians
  and minima), "ratio_1d", "min_ratio_1d" (zero-3 TP / 1-D zero-3),
  "rounds"}."""
  name = "tiny" if mode == "smoke" else "cpu-1m"
  rounds = {"smoke": 1, "quick": 7, "full": 15}[mode]
  out = _measure(name, True, rounds, log)
  if mode != "smoke":   # (the tests run the unrolled TP model themselves)
    out["unrolled"] = _measure(name, False, rounds, log)
  return out


def _measure(name: str, scan: bool, rounds: int, log) -> dict:
  batch, seq, n = 16, 64, 8
  data = n // M
  built = {}
  for label, (variant, model) in MODES.items():
    log(f"tp: {label} ({name}, {'scanned' if scan else 'unrolled'})")
    cfg = models.CONFIGS[name].replace(tp=model, scan=scan)
    built[label] = V.build(variant, cfg, global_batch=batch, seq=seq,
                           num_devices=n, model_shards=model)
  tp = built["zero-3 TP"]
  psi = tp.num_params
  psi_s = tp.layout.num_split_elements
  psi_eff = psi - psi_s + psi_s / M
  rows = {label: _per_axis(v, n if label == "zero-3 1-D" else data, M)
          for label, v in built.items()}
  cfg = models.CONFIGS[name]
  activations = cfg.layers * (batch // data) * seq * cfg.width * 4
  theory = {"zero-3 1-D": {"data": 12 * psi, "model": 0},
            "zero-3 TP": {"data": 12 * psi_eff, "model": 5 * activations},
            "DP + TP (jax.jit)": {"data": 4 * psi_eff,
                                  "model": 4 * activations}}
  memory = {label: {
      "persistent": v.persistent_bytes(),
      "theory": {"zero-3 1-D": 12 * psi / n, "zero-3 TP": 12 * psi_eff / data,
                 "DP + TP (jax.jit)": 12 * psi_eff}[label],
      "compiled": zerojax.compiled_footprint(v.compiled())["device"]}
            for label, v in built.items()}
  _, median, fastest = speed.medians_and_minima(built, rounds)
  for v in built.values():
    v.release()
  base = "DP + TP (jax.jit)"
  return {"config": name if scan else f"{name} unrolled",
          "num_params": psi, "split_params": psi_s,
          "devices": n, "data": data, "model": M, "rows": rows,
          "theory": theory, "memory": memory, "rounds": rounds,
          "ratio": median["zero-3 TP"] / median[base],
          "min_ratio": fastest["zero-3 TP"] / fastest[base],
          "ratio_1d": median["zero-3 TP"] / median["zero-3 1-D"],
          "min_ratio_1d": fastest["zero-3 TP"] / fastest["zero-3 1-D"]}


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)], for the scanned and the unrolled GPT."""
  return _checks(result) + (_checks(result["unrolled"])
                            if "unrolled" in result else [])


def _checks(result: dict) -> list:
  rows, theory, cfg = result["rows"], result["theory"], result["config"]
  tp = rows["zero-3 TP"]
  checks = [(f"zero-3 TP: biggest collective over data x model, bytes "
             f"(scalars only: at most 16) ({cfg})", tp["largest_both"], 64,
             tp["largest_both"] <= 64)]
  model_kinds = set(tp["model"])
  checks.append((f"zero-3 TP: collective kinds over model besides the "
                 f"model's all-reduces ({cfg})",
                 len(model_kinds - {"all-reduce"}), 0,
                 model_kinds <= {"all-reduce"}))
  got = sum(tp["data"].values()) / theory["zero-3 TP"]["data"]
  checks.append((f"zero-3 TP bytes over data / 12Ψ' ({cfg})", got, 1.0,
                 got <= 1.0))
  got = sum(tp["model"].values()) / theory["zero-3 TP"]["model"]
  checks.append((f"zero-3 TP bytes over model / theory, the model's own 5·L·(B/D)·T·d·4 "
                 f"({cfg})", got, 1.05, abs(got - 1) <= 0.05))
  m = result["memory"]["zero-3 TP"]
  got = m["persistent"] / m["theory"]
  checks.append((f"zero-3 TP persistent bytes / theory 12Ψ'/D ({cfg})", got, 1.05,
                 abs(got - 1) <= 0.05))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
    lines.append(f"| {label} | {charts.mib(sum(row['data'].values()))} | "
                 f"{charts.mib(th['data'])} | {charts.mib(sum(row['model'].values()))} | "
                 f"{charts.mib(th['model'])} | {sum(row['both'].values())} B |")
  lines += charts.memory_table(r["memory"])
  lines += ["", f"Step time ({r['rounds']} interleaved rounds), zero-3 TP / "
            f"DP + TP: {r['ratio']:.3f} (medians), {r['min_ratio']:.3f} "
            f"(minima); zero-3 TP / 1-D zero-3: {r['ratio_1d']:.3f}, "
            f"{r['min_ratio_1d']:.3f}."]
  return lines


def plot_tp(r: dict, path: str):
  fig, (comm, mem) = charts.plt.subplots(1, 2, figsize=(11, 3.8))
  labels = list(r["rows"])
  x = range(len(labels))
  for shift, axis, color in ((-0.2, "data", "#3182bd"), (0.2, "model", "#e6550d")):
    comm.bar([i + shift for i in x],
             [sum(r["rows"][k][axis].values()) / charts.MIB for k in labels],
             width=0.4, label=f"over {axis} (measured)", color=color)
    comm.plot([i + shift for i in x],
              [r["theory"][k][axis] / charts.MIB for k in labels], "k_",
              markersize=18, label=None if axis == "model" else "theory")
  comm.set_xticks(list(x), labels, fontsize=8)
  comm.set_ylabel("MiB per device per step")
  comm.set_title(f"collectives by mesh axis, (data {r['data']}, model "
                 f"{r['model']}), {r['config']}", fontsize=10)
  comm.legend(fontsize=8)
  mem.bar([i - 0.2 for i in x], [r["memory"][k]["persistent"] / charts.MIB
                                 for k in labels], width=0.4,
          label="persistent state", color="#08519c")
  mem.bar([i + 0.2 for i in x], [r["memory"][k]["compiled"] / charts.MIB
                                 for k in labels], width=0.4,
          label="compiled step (device)", color="#9ecae1")
  mem.plot([i - 0.2 for i in x], [r["memory"][k]["theory"] / charts.MIB
                                  for k in labels], "k_", markersize=18,
           label="theory (persistent)")
  mem.set_xticks(list(x), labels, fontsize=8)
  mem.set_yscale("log")
  mem.set_ylabel("MiB per device")
  mem.set_title("memory per device", fontsize=10)
  mem.legend(fontsize=8)
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_tp(r, os.path.join(out, f"{mode}_tp.png"))
