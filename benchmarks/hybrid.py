"""Hybrid sharding (HSDP) and hpZ against 1-D ZeRO-3: communication per mesh
axis, memory per device and step time, on the same 8 devices laid out as 2
nodes of 4.

The programs are compiled for the GPT config and their collectives read
from the optimized HLO (`zerojax._plan.hlo`), each op classed by its replica
groups: groups of D = 4 stay within a node (data axis), groups of R = 2
(replica axis) and groups of all 8 devices cross nodes. Theory per device
per step, stage 3, compute dtype of b bytes (fp32 here: b = 4), Ψ
parameters (`bytes` as `zerojax._plan.hlo` counts them: an all-gather's
output, a reduce-scatter's input, an all-reduce's operand):

  1-D ZeRO-3   across nodes: gathers 2·bΨ, reduce-scatter 4Ψ (every group
               spans both nodes); within: nothing
  HSDP         within a node: gathers 2·bΨ, reduce-scatter 4Ψ (groups of D);
               across nodes: one all-reduce of the gradient shards, 4Ψ/D
  hpZ          within a node: as HSDP; across nodes: the secondary
               partition's gather, bΨ/D, and the gradient shards'
               reduce-scatter, 4Ψ/D

Non-layer chunks are gathered once per step (not re-gathered in the
backward), so the gathers come to somewhat less than 2·bΨ.

What a device sends with ring algorithms (`Collective.wire_bytes`) gives
the inter-node bytes per device per step against the device count N for
nodes of D devices (`inter_node_wire`): (N-1)/N·(2b+4)Ψ for 1-D ZeRO-3,
2(R-1)/R·4Ψ/D for HSDP's all-reduce, (R-1)/R·(b+4)Ψ/D for hpZ, R = N/D.
The measured 8-device points check those formulas; the plot extends them.

Persistent bytes per device (Adam, fp32): 12Ψ/N (1-D), 12Ψ/D (HSDP),
12Ψ/(R·D) (hpZ, which also holds the secondary partition, bΨ/D, while a
step runs: in the compiled footprint).

    python -m benchmarks.run --quick --suites hybrid
"""
from __future__ import annotations

import os
import zerojax
from benchmarks import charts
from benchmarks import models, speed
from benchmarks import variants as V
from zerojax._plan.hlo import count_collectives

R = 2   # nodes (the replica axis)
MODES = {"zero-3 1-D": dict(replicas=1), "zero-3 HSDP": dict(replicas=R),
         "zero-3 hpZ": dict(replicas=R, hpz=True)}


def inter_node_wire(mode: str, psi: float, n: int, node: int,
                    b: int = 4) -> float:
  """Bytes a device sends across nodes per step (ring algorithms), stage 3,
  `n` devices in nodes of `node`, compute dtype of `b` bytes, reduce in
  fp32. Gathers counted twice (forward and backward), as for layers."""
  r = n // node
  if mode == "zero-3 1-D":
    return (n - 1) / n * (2 * b + 4) * psi if r > 1 else 0.0
  if mode == "zero-3 HSDP":
    return 2 * (r - 1) / r * 4 * psi / node
  if mode == "zero-3 hpZ":
    return (r - 1) / r * (b + 4) * psi / node
  raise ValueError(f"unknown mode {mode!r}; use one of {sorted(MODES)}.")


def _per_axis(variant, node: int) -> dict:
  """Bytes per device per step: within a node (groups of `node` devices on
  the data axis) and across nodes, by collective kind; and what a device
  sends (`wire`) each way."""
  out = {"within": {}, "across": {}, "wire": {"within": 0.0, "across": 0.0}}
  for op in count_collectives(variant.compiled()).ops:
    if op.trips is None or op.group_size <= 1:
      continue
    where = "within" if op.group_size == node else "across"
    out[where][op.kind] = out[where].get(op.kind, 0) + op.trips * op.bytes
    out["wire"][where] += op.trips * op.wire_bytes
  return out


def run(mode: str, log=print) -> dict:
  """{"config", "num_params", "rows": {label: per-axis bytes}, "theory",
  "memory": {label: persistent and compiled bytes, theory}, "ratio" and
  "min_ratio" (step time HSDP / 1-D, medians and minima), "hpz_ratio",
  "hpz_min_ratio", "rounds"}."""
  name = "tiny" if mode == "smoke" else "cpu-1m"
  cfg = models.CONFIGS[name]
  rounds = {"smoke": 1, "quick": 7, "full": 15}[mode]
  batch, seq, n = 16, 64, 8
  node = n // R
  built = {}
  for label, fields in MODES.items():
    log(f"hybrid: {label} ({name})")
    built[label] = V.build("zero-3", cfg, global_batch=batch, seq=seq,
                           num_devices=n, **fields)
  psi = built["zero-3 1-D"].num_params
  rows = {label: _per_axis(v, node) for label, v in built.items()}
  # 1-D groups span all 8 devices: none stays within a node
  theory = {"zero-3 1-D": {"within": 0, "across": 12 * psi},
            "zero-3 HSDP": {"within": 12 * psi, "across": 4 * psi / node},
            "zero-3 hpZ": {"within": 12 * psi, "across": 8 * psi / node}}
  for label, t in theory.items():
    t["wire_across"] = inter_node_wire(label, psi, n, node)
  shards = {"zero-3 1-D": n, "zero-3 HSDP": node, "zero-3 hpZ": n}
  memory = {label: {
      "persistent": zerojax.memory_report(v.state).persistent,
      "theory": 12 * psi / shards[label],
      "compiled": zerojax.compiled_footprint(v.compiled())["device"]}
            for label, v in built.items()}
  _, median, fastest = speed.medians_and_minima(built, rounds)
  for v in built.values():
    v.release()
  return {"config": name, "num_params": psi, "devices": n, "nodes": R,
          "rows": rows, "theory": theory, "memory": memory, "rounds": rounds,
          "ratio": median["zero-3 HSDP"] / median["zero-3 1-D"],
          "min_ratio": fastest["zero-3 HSDP"] / fastest["zero-3 1-D"],
          "hpz_ratio": median["zero-3 hpZ"] / median["zero-3 1-D"],
          "hpz_min_ratio": fastest["zero-3 hpZ"] / fastest["zero-3 1-D"]}


def total(row: dict, where: str) -> int:
  return sum(row[where].values())


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]."""
  rows, theory, cfg = result["rows"], result["theory"], result["config"]
  gathers_1d = rows["zero-3 1-D"]["across"].get("all-gather", 0)
  node = result["devices"] // result["nodes"]
  checks = [
      (f"HSDP inter-node bytes / 1-D zero-3 gather bytes x D ({cfg})",
       total(rows["zero-3 HSDP"], "across") / gathers_1d * node, 1.0,
       total(rows["zero-3 HSDP"], "across") / gathers_1d * node <= 1.0)]
  for label, formula in (("HSDP", "4Ψ/D"), ("hpZ", "(b+4)Ψ/D")):
    got = total(rows[f"zero-3 {label}"], "across")
    want = theory[f"zero-3 {label}"]["across"]
    checks.append((f"{label} inter-node bytes / theory {formula} ({cfg})",
                   got / want, 1.05, abs(got / want - 1) <= 0.05))
  for label in ("HSDP", "hpZ"):
    got = rows[f"zero-3 {label}"]["wire"]["across"]
    want = theory[f"zero-3 {label}"]["wire_across"]
    checks.append((f"{label} inter-node wire bytes / `inter_node_wire` ({cfg})",
                   got / want, 1.05, abs(got / want - 1) <= 0.05))
  for label in ("HSDP", "hpZ"):
    m = result["memory"][f"zero-3 {label}"]
    checks.append((f"{label} persistent bytes / theory 12Ψ/"
                   f"{'D' if label == 'HSDP' else '(R·D)'} ({cfg})",
                   m["persistent"] / m["theory"], 1.05,
                   abs(m["persistent"] / m["theory"] - 1) <= 0.05))
  checks.append((f"HSDP step time / 1-D zero-3 ({cfg})",
                 result["min_ratio"], 1.05, result["min_ratio"] <= 1.05))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
    lines.append(f"| {label} | {charts.mib(sum(row['within'].values()))} | "
                 f"{charts.mib(sum(row['across'].values()))} | {charts.mib(th['within'])} | "
                 f"{charts.mib(th['across'])} | {charts.mib(wire.get('across', 0))} | "
                 f"{charts.mib(th.get('wire_across', 0))} |")
  if "memory" in r:
    lines += charts.memory_table(r["memory"])
  lines += ["", f"Step time, HSDP / 1-D ({r['rounds']} interleaved rounds): "
            f"{r['ratio']:.3f} (medians), {r['min_ratio']:.3f} (minima)."]
  if "hpz_ratio" in r:
    lines += ["", f"Step time, hpZ / 1-D: {r['hpz_ratio']:.3f} (medians), "
              f"{r['hpz_min_ratio']:.3f} (minima)."]
  return lines + ["", f"![hybrid]({mode}_hybrid.png)", ""]


def plot_hybrid(r: dict, path: str):
  from benchmarks.hybrid import inter_node_wire
  fig, (ax, curve) = charts.plt.subplots(1, 2, figsize=(11, 3.8))
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
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_hybrid(r, os.path.join(out, f"{mode}_hybrid.png"))
