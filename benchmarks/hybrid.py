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

import zerojax
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
