"""Host offload at stage 3: device and host bytes per device, the largest
model that fits a fixed per-device device budget with and without optimizer
offload, and the step-time cost of offload on CPU.

  device / host   `zerojax.compiled_footprint` of the step compiled from an
                  abstract state (nothing allocated): `device` is derived,
                  argument + output + temp - alias less the host-resident
                  arguments and outputs read from the compiled entry layout
                  (the CPU backend does not split memory kinds itself); on
                  CPU the host <-> device copies compile to nothing, so no
                  transient device copy of an offloaded chunk is counted
                  (see `zerojax._core.offload`)
  largest model   the budget is the device bytes of the config without
                  offload (the device that just fits it); depth is swept
                  at the config's width: two depths are compiled, the line
                  through them predicts the deepest model under the budget,
                  and compiles at that depth and the next confirm it (fits,
                  does not fit). The blocks are one `nn.scan`, so a compile
                  costs the same at any depth.
  PCIe bytes      per parameter per step, the chunk-shaped host <-> device
                  moves of the step lowered for a GPU (`transfers.host_moves`),
                  every chunk's optimizer state offloaded, Adam, bf16
                  compute: the optax update on the device (master, m and v
                  over and back) against `update_on="host"` (the gradient
                  to host; at stage 2 the bf16 parameter back). Stage 3's
                  forward also reads the master shard from host under
                  either (4 bytes a parameter, per-device shapes: not
                  counted here)
  step time       the small config, allocated, with and without
                  `offload_optimizer` (and with `update_on="host"` beside
                  the device update), interleaved rounds (`speed`); on CPU
                  the transfers compile to nothing, so this measures only
                  the program differences, not PCIe traffic
"""
from __future__ import annotations

import os
import gc
import statistics
from typing import Optional

import zerojax

import jax.numpy as jnp

from benchmarks import charts
from benchmarks import memory, models, speed
from benchmarks import variants as V
from zerojax._plan.transfers import host_computations, host_moves

VARIANT = "zero-3"
OFFLOAD = {"offload_optimizer": True}


def footprint(cfg: models.GPTConfig, *, batch: int, seq: int, n: int,
              offload: bool) -> dict:
  """compiled_footprint of the stage-3 step of `cfg`, plus Ψ and chunks."""
  v = V.build(VARIANT, cfg, global_batch=batch, seq=seq, num_devices=n,
              materialize=False, options=memory.sweep_options(),
              **(OFFLOAD if offload else {}))
  out = {**zerojax.compiled_footprint(v.compiled()),
         "num_params": cfg.num_params, "layers": cfg.layers,
         "chunks": len(v.layout.chunks), "offload_optimizer": offload}
  del v
  gc.collect()
  return out


def largest_fitting(cfg: models.GPTConfig, budget: int, *, offload: bool,
                    batch: int, seq: int, n: int,
                    max_layers: Optional[int] = None) -> dict:
  """The deepest `cfg` (at its width) whose step needs <= `budget` device
  bytes per device: {"layers", "num_params", "device", "next_device",
  "points": [[layers, device bytes], ...] compiled}. Compiles at the
  config's depth and half of it, then from the depth the line through them
  predicts, down until one fits and up while the next fits. A predicted
  depth beyond `max_layers` is returned uncompiled, `"verified": False`
  (a guard for hosts where deep compiles do not fit; building and
  compiling GPT-2 medium's stage-3 step from an abstract state measured
  405-429 MB of RSS here at 24, 48 and 96 layers alike)."""
  points = {}

  def device(layers):
    if layers not in points:
      points[layers] = footprint(cfg.replace(layers=layers), batch=batch,
                                 seq=seq, n=n, offload=offload)["device"]
    return points[layers]

  a, b = max(cfg.layers // 2, 1), max(cfg.layers, 2)
  slope = (device(b) - device(a)) / (b - a)
  layers = (max(1, a + int((budget - device(a)) // slope)) if slope > 0
            else b)
  if max_layers is not None and layers + 1 > max_layers:
    return {"layers": layers, "verified": False,
            "num_params": cfg.replace(layers=layers).num_params,
            "device": device(a) + slope * (layers - a),
            "next_device": device(a) + slope * (layers + 1 - a),
            "slope": slope, "points": sorted(points.items())}
  while layers > 0 and device(layers) > budget:
    layers -= 1
  while device(layers + 1) <= budget:
    layers += 1
  return {"layers": layers, "verified": True,
          "num_params": cfg.replace(layers=layers).num_params,
          "device": points.get(layers), "next_device": device(layers + 1),
          "slope": slope, "points": sorted(points.items())}


def step_times(cfg: models.GPTConfig, *, batch: int, seq: int, n: int,
               rounds: int) -> dict:
  """Median and minimum step seconds with and without optimizer offload,
  and with the offloaded update run on the host (`update_on="host"`)."""
  built = {}
  for name, fields in (("no offload", {}), ("offload_optimizer", OFFLOAD),
                       ("update_on=host", {**OFFLOAD, "update_on": "host"})):
    built[name] = V.build(VARIANT, cfg, global_batch=batch, seq=seq,
                          num_devices=n, **fields)
    built[name].compiled()
  times = speed.time_variants(built, rounds)
  for v in built.values():
    v.release()
  median = {k: statistics.median(t) for k, t in times.items()}
  fastest = {k: min(t) for k, t in times.items()}
  return {"times_s": times, "median_s": median, "min_s": fastest,
          "ratio": median["offload_optimizer"] / median["no offload"],
          "min_ratio": fastest["offload_optimizer"] / fastest["no offload"],
          "host_update_ratio": (median["update_on=host"] /
                                median["offload_optimizer"]),
          "host_update_min_ratio": (fastest["update_on=host"] /
                                    fastest["offload_optimizer"])}


def pcie(cfg: models.GPTConfig, *, batch: int, seq: int, n: int) -> dict:
  """{"zero-S update_on": {"to host", "to device" (bytes per parameter),
  "host computations"}} for stages 2 and 3, bf16 compute."""
  out = {}
  for variant in ("zero-2", "zero-3"):
    for where in ("device", "host"):
      v = V.build(variant, cfg, global_batch=batch, seq=seq, num_devices=n,
                  materialize=False, compute_dtype=jnp.bfloat16,
                  offload_optimizer=True, update_on=where)
      text = v.trace().lower(lowering_platforms=("cuda",)).as_text()
      shapes = [c.shape for c in v.layout.chunks]
      params = sum(c.length * max(c.layers, 1) for c in v.layout.chunks)
      moved = host_moves(text, shapes)
      out[f"{variant} update_on={where}"] = {
          "to host": moved["pinned_host"] / params,
          "to device": moved["device"] / params,
          "host computations": host_computations(text)}
  return out


def run(cfg_name: str, *, batch: int, seq: int, n: int, speed_config: str,
        speed_batch: int, speed_seq: int, rounds: int,
        budget: Optional[int] = None,
        max_layers: Optional[int] = None) -> dict:
  """The offload suite; see the module docstring."""
  cfg = models.CONFIGS[cfg_name]
  rows = [footprint(cfg, batch=batch, seq=seq, n=n, offload=o)
          for o in (False, True)]
  budget = budget or rows[0]["device"]
  fit = {("offload_optimizer" if o else "no offload"):
         largest_fitting(cfg, budget, offload=o, batch=batch, seq=seq, n=n,
                         max_layers=max_layers)
         for o in (False, True)}
  ratio = fit["offload_optimizer"]["num_params"] / fit["no offload"]["num_params"]
  moves = pcie(cfg, batch=batch, seq=seq, n=n)
  return {"config": cfg_name, "width": cfg.width, "layers": cfg.layers,
          "global_batch": batch, "seq": seq, "devices": n, "rows": rows,
          "budget": budget, "largest": fit, "size_ratio": ratio,
          "pcie": moves,
          "speed": {"config": speed_config, "global_batch": speed_batch,
                    "seq": speed_seq, "rounds": rounds,
                    **step_times(models.CONFIGS[speed_config],
                                 batch=speed_batch, seq=speed_seq, n=n,
                                 rounds=rounds)}}


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]: >= 3x the parameters under the budget."""
  value = result["size_ratio"]
  predicted = not all(f.get("verified", True)
                      for f in result["largest"].values())
  checks = [(f"largest model with / without optimizer offload, stage 3, "
             f"same device budget ({result['config']} width"
             f"{'; predicted depth, see below' if predicted else ''})", value,
             3.0, value >= 3.0)]
  moves = result.get("pcie", {})
  for variant in ("zero-2", "zero-3"):
    if f"{variant} update_on=host" not in moves:
      continue
    total = lambda r: r["to host"] + r["to device"]
    ratio = (total(moves[f"{variant} update_on=host"]) /
             total(moves[f"{variant} update_on=device"]))
    checks.append((f"PCIe bytes per step, update_on=host / device "
                   f"({variant}, bf16, Adam)", ratio, 1 / 3, ratio <= 1 / 3))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
    lines.append(f"| {name} | {charts.mib(row['device'])} | "
                 f"{charts.mib(row['host_argument'])} | {charts.mib(row['footprint'])} | "
                 f"{charts.mib(row['temp'])} |")
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
  lines += ["", f"Largest model under a budget of {charts.mib(r['budget'])} MiB "
            f"device memory per device (the no-offload footprint of "
            f"{r['config']}), depth swept at width {r['width']}:", "",
            "| setting | layers | Ψ | device MiB | next depth's device MiB |",
            "|---|---:|---:|---:|---:|"]
  for name, f in fit.items():
    how = "" if f.get("verified", True) else " (predicted, not compiled)"
    lines.append(f"| {name}{how} | {f['layers']} | {f['num_params']:,} | "
                 f"{charts.mib(f['device'])} | {charts.mib(f['next_device'])} |")
  if not all(f.get("verified", True) for f in fit.values()):
    lines += ["", "Predicted rows: the line through the compiled points "
              "(plotted), device bytes per layer "
              + ", ".join(f"{n}: {charts.mib(f['slope'])} MiB" for n, f in fit.items())
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


def plot_offload(r: dict, path: str):
  fig, ax = charts.plt.subplots(figsize=(6.5, 4))
  colors = {"no offload": charts.COLORS["zero-3"], "offload_optimizer": "#e6550d"}
  for name, f in r["largest"].items():
    ax.plot([p[0] for p in f["points"]], [p[1] / charts.MIB for p in f["points"]],
            marker="o", label=f"{name}: {f['layers']} layers fit",
            color=colors.get(name))
  ax.axhline(r["budget"] / charts.MIB, color="k", ls="--", lw=0.8,
             label="budget (no-offload footprint)")
  ax.set_xlabel(f"layers (width {r['width']})")
  ax.set_ylabel("device MiB per device (compiled)")
  ax.set_title(f"Stage 3, {r['devices']} devices: {r['size_ratio']:.2f}× the "
               "parameters with optimizer offload", fontsize=10)
  charts.finish_line_plot(fig, ax, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_offload(r, os.path.join(out, f"{mode}_offload.png"))
