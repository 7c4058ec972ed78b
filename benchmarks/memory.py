"""Per-device memory of the variants: persistent state and compiled footprint.

  persistent  bytes of the train state on one device: the first shard of
              every array of the state (`x.addressable_shards[0].data.nbytes`),
              or, for a state too large to allocate on this host, the same
              sum from the arrays' shapes and shardings
  footprint   `compiled.memory_analysis()` of the step: argument + output +
              temp - alias (what one device needs to run the step; the CPU
              backend's peak figure is not meaningful)
  theory      ZeRO's persistent bytes, fp32 parameters with Adam, Ψ
              parameters on N devices: 12Ψ (stage 0, plain DP), 4Ψ + 8Ψ/N
              (stages 1-2), 12Ψ/N (stage 3, FSDP)
"""
from __future__ import annotations

import os
import gc
from typing import Callable, Dict, Iterable, Optional

import zerojax
from zerojax._core import compat
from benchmarks import charts
from benchmarks import variants as V

FORMULA = {"zero-0": "12Ψ", "plain-dp": "12Ψ", "1dev-optax": "12Ψ",
           "1dev-zero-0": "12Ψ",
           "zero-1": "4Ψ+8Ψ/N", "zero-2": "4Ψ+8Ψ/N",
           "zero-3": "12Ψ/N", "gspmd-fsdp": "12Ψ/N", "1dev-zero-3": "12Ψ/N"}

# Programs that are analysed but never run are compiled without LLVM
# optimisation: the HLO, its buffer assignment, memory_analysis() and the
# collectives are the same as with the default options (tests check it),
# compilation is about twice as fast.
# (The options this XLA accepts: `zerojax._core.compat`.)
def analysis_options() -> dict:
  return compat.compiler_options({"xla_backend_optimization_level": 0})


# The depth and chunk-size sweeps also skip the CPU fusion emitters where
# XLA has them: three times faster again; buffers can differ by a few
# hundred bytes, the collectives not at all. Every point of a sweep is
# compiled this way.
def sweep_options() -> dict:
  return compat.compiler_options()


def host_memory() -> Dict[str, int]:
  """MemTotal and MemAvailable of this host, in bytes; MemAvailable counts
  the bytes this process has freed but malloc keeps (`_kept_by_malloc`):
  under the benchmarks' pooled allocator they are most of what it freed,
  and its next allocation reuses them."""
  out = {}
  with open("/proc/meminfo") as f:
    for line in f:
      key, value = line.split(":", 1)
      if key in ("MemTotal", "MemAvailable"):
        out[key] = int(value.split()[0]) * 1024
  out["MemAvailable"] += _kept_by_malloc()
  return out


def _kept_by_malloc() -> int:
  """Free bytes in glibc's malloc arenas (`mallinfo2().fordblks`), 0 where
  that is not glibc's or too old to have it."""
  import ctypes

  class _Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]
  try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
  except (OSError, AttributeError):
    return 0
  mallinfo2.restype = _Info
  return int(mallinfo2().fordblks)


def allocation_check(name: str, num_params: int, n: int,
                     fraction: float = 0.6) -> str:
  """Why this variant's state should not be allocated on this host, or ""
  when it can be: its state on all n simulated devices, next to the
  unsharded source state (12Ψ), must stay within `fraction` of the memory
  available now (other jobs share the host)."""
  per_device = V.theory_bytes(name, num_params, n)
  devices = 1 if name in V.ONE_DEVICE_VARIANTS else n
  need = per_device * devices + 12.0 * num_params
  available = host_memory()["MemAvailable"]
  if need <= fraction * available:
    return ""
  return (f"state not allocated: {need / 2 ** 30:.1f} GiB (the state on "
          f"{devices} simulated devices plus the unsharded source state) is "
          f"more than {fraction:.0%} of the {available / 2 ** 30:.1f} GiB "
          "available; bytes from shapes and shardings, program compiled from "
          "the abstract state")


def footprint(compiled) -> Dict[str, int]:
  """argument, output, temp, alias and footprint bytes per device (see
  `zerojax.compiled_footprint`, which also splits off host bytes)."""
  full = zerojax.compiled_footprint(compiled)
  return {k: full[k] for k in ("argument", "output", "temp", "alias", "footprint")}


def row(v: V.Variant, compiled=None, note: str = "") -> dict:
  """The memory row of one built variant."""
  compiled = compiled if compiled is not None else v.compiled()
  theory = V.theory_bytes(v.name, v.num_params, v.num_devices)
  persistent = v.persistent_bytes()
  out = {"variant": v.name, "num_params": v.num_params,
         "devices": v.num_devices, "persistent_bytes": persistent,
         "persistent_from": ("addressable_shards" if v.materialized
                             else "shapes"),
         "theory": FORMULA.get(v.name), "theory_bytes": theory,
         "persistent_over_theory": persistent / theory if theory else None,
         **footprint(compiled)}
  total = host_memory()["MemTotal"]
  out["host_bytes_to_run"] = out["footprint"] * v.num_devices
  out["runs_on_this_host"] = out["host_bytes_to_run"] <= total
  if note:
    out["note"] = note
  return out


def depth_sweep(cfg, layers: Iterable[int], names: Iterable[str],
                build: Callable[..., V.Variant]) -> dict:
  """Compiled footprint per device against the number of layers.

  Args:
    cfg: the model config whose depth is varied.
    layers: the depths.
    names: the variants.
    build: `build(name, cfg, materialize=..., options=...)`.

  Returns:
    {"layers", "num_params", "footprint": {variant: [bytes per depth]}};
    programs are compiled from abstract states with `sweep_options()`.
  """
  layers = list(layers)
  out = {"layers": layers, "num_params": [], "footprint": {}}
  for depth in layers:
    c = cfg.replace(layers=depth)
    out["num_params"].append(c.num_params)
    for name in names:
      v = build(name, c, materialize=False, options=sweep_options())
      out["footprint"].setdefault(name, []).append(
          footprint(v.compiled())["footprint"])
      del v
    gc.collect()
  return out


def stage3_expected(cfg, per_device_batch: int, seq: int, n: int) -> dict:
  """What a ZeRO-3 step of a GPT config needs per device, fp32 + AdamW, by
  the issue's yardstick "12Ψ/N + the gradient shard 4Ψ/N + activations +
  two gathered layers":

    state           12Ψ/N
    gradient shard  4Ψ/N (reduce-scattered in the backward pass, read by
                    the update)
    two layers      2 x 4 bytes x the parameters of one block, gathered
    activations     the saved input of every block (layerwise remat keeps
                    only those: L x b x s x w x 4) plus the logits and their
                    gradient (2 x b x s x V x 4, V the config's `loss_block`
                    or a block of `embed_blocks`' rows where it has one),
                    b = the per-device batch

  Not counted, though the step holds them: the non-layer parameters (the
  tied embedding, gathered for the whole step, and its full gradient
  before the reduce-scatter; a `BlockedEmbed` holds one block of each),
  nor one block's recomputed internals."""
  d, L, V = cfg.width, cfg.layers, cfg.vocab_size
  blocks = getattr(cfg, "embed_blocks", None) or 1
  table = -(-V // blocks) * blocks * d   # a BlockedEmbed's padded rows too
  block = (cfg.num_params - table - cfg.max_len * d - 2 * d) // L
  # a `loss_block` head (`zerojax.losses.linear_cross_entropy`) holds one
  # block of logits and their gradient, not the vocabulary's; so does a
  # `BlockedEmbed` (`embed_blocks`), one block of rows at a time
  logits = min(getattr(cfg, "loss_block", None) or V, V)
  if blocks > 1:
    logits = table // (blocks * d)
  parts = {"state": 12 * cfg.num_params / n,
           "gradient_shard": 4 * cfg.num_params / n,
           "two_layers": 2 * 4 * block,
           "activations": 4 * per_device_batch * seq * (L * d + 2 * logits)}
  parts["total"] = sum(parts.values())
  parts["table_blocks"] = blocks   # not bytes: how the report words it
  return parts


def goal_checks(rows: list, config: str = "", expected: Optional[dict] = None) -> list:
  """[(what, measured, bound, met)]: stage 3 footprint <= GSPMD FSDP's, and
  within 10% of `expected["total"]` (`stage3_expected`) when given."""
  by = {r["variant"]: r for r in rows if "footprint" in r}
  where = f" ({config})" if config else ""
  goals = []
  if "zero-3" in by and "gspmd-fsdp" in by:
    value = by["zero-3"]["footprint"] / by["gspmd-fsdp"]["footprint"]
    goals.append((f"zero-3 footprint / gspmd-fsdp footprint{where}", value,
                  1.0, value <= 1.0))
  if "zero-3" in by and expected:
    value = by["zero-3"]["footprint"] / expected["total"]
    goals.append((f"zero-3 footprint / (12Ψ/N + 4Ψ/N + activations + two "
                   f"gathered layers){where}", value, 1.1, value <= 1.1))
  return goals


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
          f"| {row['variant']} | {charts.mib(row['persistent_bytes'])}{mark} | "
          f"{row['theory']} | {charts.mib(row['theory_bytes'])} | "
          f"{row['persistent_over_theory']:.4f} | {charts.mib(row['argument'])} | "
          f"{charts.mib(row['output'])} | {charts.mib(row['temp'])} | "
          f"{charts.mib(row['alias'])} | {charts.mib(row['footprint'])} | "
          f"{'yes' if row['runs_on_this_host'] else 'no'} |")
      if row.get("note"):
        notes.append(f"{cfg_name} {row['variant']}: {row['note']}")
    lines.append("")
    e = r.get("expected_stage3", {}).get(cfg_name)
    if e:
      # results written before the yardstick counted the gradient shard
      shard = (f" + gradient shard 4Ψ/N {charts.mib(e['gradient_shard'])}"
               if "gradient_shard" in e else "")
      lines += [f"ZeRO-3 yardstick (`benchmarks.memory.stage3_expected`): "
                f"12Ψ/N {charts.mib(e['state'])}{shard} + two gathered layers "
                f"{charts.mib(e['two_layers'])} + activations (saved block inputs, "
                f"logits and their gradient) {charts.mib(e['activations'])} = "
                f"{charts.mib(e['total'])} MiB; not in it: "
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
        charts.mib(v[i]) for v in d["footprint"].values()) + " |")
  return lines + ["", f"![memory]({mode}_memory.png)",
                  f"![depth sweep]({mode}_depth.png)", ""]


def plot_memory(r: dict, path: str):
  configs = list(r["rows"])
  fig, axes = charts.plt.subplots(1, len(configs), figsize=(6.5 * len(configs), 4),
                           squeeze=False)
  for ax, cfg_name in zip(axes[0], configs):
    rows = [row for row in r["rows"][cfg_name] if "error" not in row]
    names = [row["variant"] for row in rows]
    x = range(len(rows))
    w = 0.27
    ax.bar([i - w for i in x], [row["theory_bytes"] / charts.MIB for row in rows], w,
           label="theory (persistent)", color="#d9d9d9", edgecolor="k", lw=0.5)
    ax.bar(list(x), [row["persistent_bytes"] / charts.MIB for row in rows], w,
           label="persistent (measured)", color="#6baed6")
    ax.bar([i + w for i in x], [row["footprint"] / charts.MIB for row in rows], w,
           label="compiled footprint", color="#08519c")
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("MiB per device")
    n_params = r["configs"][cfg_name]["num_params"]
    ax.set_title(f"{cfg_name} (Ψ = {n_params / 1e6:.1f}M)", fontsize=10)
    ax.legend(fontsize=8)
  charts.save(fig, path)


def plot_depth(r: dict, path: str):
  d = r["depth_sweep"]
  fig, ax = charts.plt.subplots(figsize=(6.5, 4))
  for name, values in d["footprint"].items():
    ax.plot(d["layers"], [v / charts.MIB for v in values], marker="o", label=name,
            color=charts.COLORS.get(name), ls="--" if name in ("plain-dp",
                                                        "gspmd-fsdp") else "-")
  ax.set_xlabel("layers")
  ax.set_xticks(d["layers"])
  ax.set_ylabel("compiled footprint per device (MiB)")
  ax.set_title(f"Footprint vs depth ({r['depth_config']} width, 8 devices)",
               fontsize=10)
  charts.finish_line_plot(fig, ax, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_memory(r, os.path.join(out, f"{mode}_memory.png"))
  plot_depth(r, os.path.join(out, f"{mode}_depth.png"))
