"""Hybrid sharding (HSDP) against 1-D ZeRO-3: communication per mesh axis
and step time, on the same 8 devices laid out as 2 nodes of 4.

Both programs are compiled for the GPT config and their collectives read
from the optimized HLO (`benchmarks.hlo`), each op classed by its replica
groups: groups of D = 4 stay within a node (data axis), groups of R = 2
(replica axis) and groups of all 8 devices cross nodes. Theory per device
per step, stage 3, fp32, Ψ parameters (`bytes` as `benchmarks.hlo` counts
them: an all-gather's output, a reduce-scatter's input):

  1-D ZeRO-3   across nodes: gathers 2·4Ψ, reduce-scatter 4Ψ (every group
               spans both nodes); within: nothing
  HSDP         within a node: gathers 2·4Ψ, reduce-scatter 4Ψ (groups of D);
               across nodes: one all-reduce of the gradient shards, 4Ψ/D

Non-layer chunks are gathered once per step (not re-gathered in the
backward), so the gathers come to somewhat less than 2·4Ψ in both.

    python -m benchmarks.run --quick --suites hybrid
"""
from __future__ import annotations

import statistics

from benchmarks import models, speed
from benchmarks import variants as V
from benchmarks.hlo import count_collectives

R = 2   # nodes (the replica axis)


def _per_axis(variant, devices: int, node: int) -> dict:
  """Bytes per device per step: within a node (groups of at most `node`
  devices on the data axis) and across nodes, by collective kind."""
  out = {"within": {}, "across": {}}
  for op in count_collectives(variant.compiled()).ops:
    if op.trips is None or op.group_size <= 1:
      continue
    where = "within" if op.group_size == node else "across"
    out[where][op.kind] = out[where].get(op.kind, 0) + op.trips * op.bytes
  return out


def run(mode: str, log=print) -> dict:
  """{"config", "num_params", "rows": {label: per-axis bytes}, "theory",
  "ratio" (step time HSDP / 1-D, medians and minima), "rounds"}."""
  name = "tiny" if mode == "smoke" else "cpu-1m"
  cfg = models.CONFIGS[name]
  rounds = {"smoke": 1, "quick": 7, "full": 15}[mode]
  batch, seq, n = 16, 64, 8
  node = n // R
  built = {}
  for label, replicas in (("zero-3 1-D", 1), ("zero-3 HSDP", R)):
    log(f"hybrid: {label} ({name})")
    built[label] = V.build("zero-3", cfg, global_batch=batch, seq=seq,
                           num_devices=n, replicas=replicas)
  psi = built["zero-3 1-D"].num_params
  rows = {label: _per_axis(v, n, node) for label, v in built.items()}
  # 1-D groups span all 8 devices: none stays within a node
  theory = {"zero-3 1-D": {"within": 0, "across": 12 * psi},
            "zero-3 HSDP": {"within": 12 * psi, "across": 4 * psi / node}}
  times = speed.time_variants(built, rounds)
  median = {k: statistics.median(v) for k, v in times.items()}
  fastest = {k: min(v) for k, v in times.items()}
  for v in built.values():
    v.release()
  return {"config": name, "num_params": psi, "devices": n, "nodes": R,
          "rows": rows, "theory": theory, "rounds": rounds,
          "ratio": median["zero-3 HSDP"] / median["zero-3 1-D"],
          "min_ratio": fastest["zero-3 HSDP"] / fastest["zero-3 1-D"]}


def total(row: dict, where: str) -> int:
  return sum(row[where].values())


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]."""
  one_d, hsdp = result["rows"]["zero-3 1-D"], result["rows"]["zero-3 HSDP"]
  gathers_1d = one_d["across"].get("all-gather", 0)
  across = total(hsdp, "across")
  node = result["devices"] // result["nodes"]
  theory = result["theory"]["zero-3 HSDP"]
  return [
      (f"HSDP inter-node bytes / 1-D zero-3 gather bytes x D "
       f"({result['config']})", across / gathers_1d * node, 1.0,
       across / gathers_1d * node <= 1.0),
      (f"HSDP inter-node bytes / theory 4Ψ/D ({result['config']})",
       across / theory["across"], 1.05,
       abs(across / theory["across"] - 1) <= 0.05),
      (f"HSDP step time / 1-D zero-3 ({result['config']})",
       result["min_ratio"], 1.05, result["min_ratio"] <= 1.05),
  ]
