"""The disk tier (ZeRO-Infinity, `offload_optimizer="disk"`) against the
host tier (`offload_optimizer=True, update_on="host"`), on the transformer
written one module per block (`benchmarks.user_models`; at stage 3 each
block is a chunk, `zerojax.nn.layerwise`; at stage 2 `chunk_size` is
2**19 elements, so a few blocks' worth: the disk tier streams a chunk at a
time, in sub-groups of `SUB_GROUP` elements per device, and holds two).

  device / host   per device, from compiled programs (abstract states,
                  nothing allocated): `zerojax.compiled_footprint`'s
                  `device` for the step's program; host = the host-resident
                  arguments and outputs of that program (the host tier's
                  master and statistics; the disk tier's stage-3 fp32
                  master, or its bf16 compute copy)
                  plus, for the disk tier, its stream: the largest chunk's
                  host update program (its statistics, master and gradient
                  shard in host memory) and the next chunk's read
  largest model   the budget is a machine whose host memory the host tier
                  fills at the config's depth L0 (host budget = its host
                  bytes there) and whose device would hold the host tier's
                  step at 4·L0 (device budget = its device bytes there):
                  how deep each tier goes on it. Depth is swept: a line
                  through L0 and 2·L0 predicts each tier's deepest fitting
                  model, compiles at that depth and the next confirm it;
                  then one step of the disk tier runs, allocated, at its
                  depth
  PCIe bytes      per parameter per step, the chunk- and shard-shaped host
                  <-> device moves of the programs lowered for a GPU
                  (`transfers.host_moves`): the step (at stage 3 its gathers of
                  host shards, forward and rematerialised backward), and
                  for the disk tier its gradient sink's writes
                  (`transfers.host_writes`) and each chunk's host update
  disk bytes      per parameter per step: every disk chunk's files read
                  and written once (its gradient's written by the step,
                  read by the stream)
  step time       the small config, allocated, interleaved rounds of the
                  tiers' whole steps (the disk tier's stream included; in
                  sub-groups, and a chunk at a time); on this machine the
                  files mostly stay in the page cache
"""
from __future__ import annotations

import os
import gc
import statistics
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp

import zerojax
from zerojax._tiers import disk_tier
from zerojax._train import disk_stream
from benchmarks import charts
from benchmarks import memory, speed
from benchmarks import variants as V
from zerojax._plan.transfers import host_moves, host_writes
from benchmarks.user_models import CONFIGS

CASES = {   # name -> (stage, ZeroConfig fields beside the tier's)
    "2 bf16": (2, {"compute_dtype": jnp.bfloat16, "chunk_size": 2 ** 19}),
    # ZeRO-Infinity's setting: 16-bit compute, the fp32 master and adam's
    # statistics on disk, the gathers reading a bf16 copy in host memory
    "3 bf16": (3, {"compute_dtype": jnp.bfloat16}),
    # fp32 compute: the master is the gathered parameter, kept in host memory
    "3 fp32": (3, {"compute_dtype": jnp.float32}),
}


# the disk tier streams each device's shard in sub-groups of at most this
# many elements (DeepSpeed's `sub_group_size`): about 1/6 of a block's or
# the embedding's shard here, so the stream holds well under a chunk
SUB_GROUP = 2 ** 14


def _tier(tier: str, directory: str) -> dict:
  """"host", "disk" (in sub-groups), or "disk whole" (a chunk at a time)."""
  if tier == "host":
    return {"offload_optimizer": True, "update_on": "host"}
  return {"offload_optimizer": "disk", "offload_dir": directory,
          "sub_group_size": None if tier == "disk whole" else SUB_GROUP}


def _build(cfg, case, tier, directory, *, batch, seq, n, materialize=False):
  stage, fields = CASES[case]
  return V.build(f"zero-{stage}", cfg, global_batch=batch, seq=seq,
                 num_devices=n, materialize=materialize,
                 options=memory.sweep_options(), **fields,
                 **_tier(tier, directory))


def _host(fp: dict) -> int:
  return fp["host_argument"] + fp["host_output"] - fp["host_alias"]


def footprint(cfg, case: str, tier: str, directory: str, *, batch: int,
              seq: int, n: int) -> dict:
  """Device and host bytes per device of one tier at `cfg`'s depth, and
  its PCIe and disk bytes per parameter per step."""
  v = _build(cfg, case, tier, directory, batch=batch, seq=seq, n=n)
  fp = zerojax.compiled_footprint(v.compiled())
  shapes = [c.shape for c in v.layout.chunks]
  params = v.layout.num_chunked_elements
  # the step's gathers from host memory move shards (stage 3)
  pieces = [s[:-1] + (s[-1] // n,) for s in shapes]
  text = v.trace().lower(lowering_platforms=("cuda",)).as_text()
  moved = host_moves(text, shapes, pieces, n)
  # the disk tier's gradient sink: each device's shard, to the host and on
  # to its file, once per step (then read back once by the stream)
  sunk = host_writes(text, n)
  moved["pinned_host"] += sunk
  out = {"layers": cfg.layers, "num_params": cfg.num_params,
         "chunks": len(v.layout.chunks), "device": fp["device"],
         "step_host": _host(fp), "stream": 0, "disk_bytes_per_param": 0.0}
  if tier == "disk":
    updates, reads = [], []
    for c, (program, args) in disk_stream.update_programs(v.state).items():
      text = program.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
      # its program updates one part (a layer, a sub-group) of the chunk:
      # its moves, once per part
      part, chunk = tuple(args[2].shape), v.layout.chunks[c]
      m = host_moves(text, shapes + [part])
      parts = max(chunk.layers, 1) * chunk.length / part[-1]
      moved = {k: moved[k] + m[k] * parts for k in moved}
      # its host update: the arrays it holds there (the gradient read from
      # its file among them), anything it brings over from the device
      updates.append(_host(zerojax.compiled_footprint(
          program.lower(*args).compile())) + m["pinned_host"] // n)
      stats, grad, master = args[0], args[2], args[3]   # what files hold
      files = list(stats.values()) + [grad] + (
          [master] if disk_tier.master_on_disk(v.state.config) else [])
      reads.append(sum(x.size * x.dtype.itemsize for x in files) // n)
    on_disk = disk_tier.disk_bytes(v.state)
    out["stream"] = max(updates) + max(reads)
    # statistics (and masters) read and written; gradients written, read
    out["disk_bytes_per_param"] = (2 * on_disk + 2 * sunk) / params
    out["disk_bytes_per_device"] = on_disk // n
  out["host"] = out["step_host"] + out["stream"]
  out["pcie_to_host"] = moved["pinned_host"] / params
  out["pcie_to_device"] = moved["device"] / params
  v.release()
  del v
  gc.collect()
  return out


def largest(cfg, case: str, tier: str, directory: str, budget: dict, *,
            batch: int, seq: int, n: int, known: Optional[dict] = None) -> dict:
  """The deepest `cfg` (its width) whose step fits both budgets. `known`:
  footprints already compiled, by depth."""
  seen = dict(known or {})

  def at(layers):
    if layers not in seen:
      seen[layers] = footprint(cfg.replace(layers=layers), case, tier,
                               directory, batch=batch, seq=seq, n=n)
    return seen[layers]

  def fits(layers):
    f = at(layers)
    return f["device"] <= budget["device"] and f["host"] <= budget["host"]

  a, b = cfg.layers, 2 * cfg.layers
  depth = []
  for key in ("device", "host"):
    slope = (at(b)[key] - at(a)[key]) / (b - a)
    depth.append(a + int((budget[key] - at(a)[key]) // slope) if slope > 0
                 else 10 ** 6)
  layers = max(1, min(depth))
  while layers > 1 and not fits(layers):
    layers -= 1
  while fits(layers + 1):
    layers += 1
  return {"layers": layers, "num_params": cfg.replace(layers=layers).num_params,
          # the depth each budget alone allows, from the line through L0, 2·L0
          "predicted": dict(zip(("device", "host"), depth)),
          "fits": fits(layers), **{k: at(layers)[k] for k in ("device", "host")},
          "next": {k: at(layers + 1)[k] for k in ("device", "host")},
          "points": {str(k): {"device": v["device"], "host": v["host"]}
                     for k, v in sorted(seen.items())}}


def one_step(cfg, case: str, directory: str, *, batch: int, seq: int,
             n: int) -> float:
  """The loss of one allocated disk-tier step of `cfg`."""
  v = _build(cfg, case, "disk", directory, batch=batch, seq=seq, n=n,
             materialize=True)
  step = zerojax.train_step(_loss(cfg, case))
  state, metrics = step(v.state, v.batch)
  loss = float(metrics["loss"])
  disk_tier.remove(state)
  return loss


def _loss(cfg, case: str):
  """The loss `V.build` gave the variant (stage 3: blocks `layerwise`)."""
  cfg = cfg.for_variant(f"zero-{CASES[case][0]}", None)
  return cfg.make_loss_fn(cfg.make_model())


class _Whole:
  """A tier's whole step (the disk tier's stream included) for
  `speed.time_variants`."""

  def __init__(self, cfg, case, tier, directory, *, batch, seq, n):
    v = _build(cfg, case, tier, directory, batch=batch, seq=seq, n=n,
               materialize=True)
    self.state, self.batch = v.state, v.batch
    self.step = zerojax.train_step(_loss(cfg, case))

  def run_once(self):
    self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))


def step_times(cfg, case: str, directory: str, *, batch: int, seq: int,
               n: int, rounds: int) -> dict:
  built = {tier: _Whole(cfg, case, tier, directory, batch=batch, seq=seq, n=n)
           for tier in ("host", "disk", "disk whole")}
  times = speed.time_variants(built, rounds)
  for tier in ("disk", "disk whole"):
    disk_tier.remove(built[tier].state)
  median = {k: statistics.median(t) for k, t in times.items()}
  return {"times_s": times, "median_s": median,
          "ratio": median["disk"] / median["host"],
          "min_ratio": min(times["disk"]) / min(times["host"]),
          "whole_ratio": median["disk whole"] / median["host"]}


def run(config: str, *, batch: int, seq: int, n: int, speed_config: str,
        speed_batch: int, speed_seq: int, rounds: int,
        cases: tuple = tuple(CASES), layers: Optional[int] = None,
        directory: Optional[str] = None) -> dict:
  """The disk suite; see the module docstring. `layers`: the config's
  depth L0 instead of its own."""
  cfg = CONFIGS[config]
  cfg = cfg if layers is None else cfg.replace(layers=layers)
  with tempfile.TemporaryDirectory(dir=directory) as tmp:
    out = {"config": config, "width": cfg.width, "layers": cfg.layers,
           "global_batch": batch, "seq": seq, "devices": n, "cases": {}}
    for case in cases:
      rows = {t: footprint(cfg, case, t, tmp, batch=batch, seq=seq, n=n)
              for t in ("host", "disk")}
      budget = {"host": rows["host"]["host"],
                "device": footprint(cfg.replace(layers=4 * cfg.layers), case,
                                    "host", tmp, batch=batch, seq=seq,
                                    n=n)["device"]}
      fit = {t: largest(cfg, case, t, tmp, budget, batch=batch, seq=seq, n=n,
                        known={cfg.layers: rows[t]})
             for t in ("host", "disk")}
      fit["disk"]["loss_of_one_step"] = one_step(
          cfg.replace(layers=fit["disk"]["layers"]), case, tmp, batch=batch,
          seq=seq, n=n)
      out["cases"][case] = {
          "rows": rows, "budget": budget, "largest": fit,
          "size_ratio": fit["disk"]["num_params"] / fit["host"]["num_params"],
          "speed": {"config": speed_config, "global_batch": speed_batch,
                    "seq": speed_seq, "rounds": rounds,
                    **step_times(CONFIGS[speed_config], case, tmp,
                                 batch=speed_batch, seq=speed_seq, n=n,
                                 rounds=rounds)}}
  return out


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]: >= 3x the parameters on the same
  machine."""
  checks = []
  for case, r in result["cases"].items():
    checks.append((f"largest model, disk / host tier, stage {case}, same "
                   f"device and host budget ({result['config']} width)",
                   r["size_ratio"], 3.0, r["size_ratio"] >= 3.0))
  return checks


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
          f"| {tier} | {row['chunks']} | {charts.mib(row['device'])} | "
          f"{charts.mib(row['host'])} ({charts.mib(row['stream'])}) | "
          f"{row['pcie_to_host']:.2f} | {row['pcie_to_device']:.2f} | "
          f"{row['disk_bytes_per_param']:.2f} |")
    lines += ["", f"One machine: host memory {charts.mib(b['host'])} MiB per device "
              f"(the host tier's at {r['layers']} layers) and device memory "
              f"{charts.mib(b['device'])} MiB (the host tier's step at "
              f"{4 * r['layers']} layers). Deepest model that fits both:", "",
              "| tier | layers | Ψ | device MiB | host MiB | next depth: "
              "device, host MiB |", "|---|---:|---:|---:|---:|---|"]
    for tier, f in fit.items():
      lines.append(f"| {tier} | {f['layers']}{'' if f['fits'] else ' (none fits)'}"
                   f" | {f['num_params']:,} | {charts.mib(f['device'])} | "
                   f"{charts.mib(f['host'])} | {charts.mib(f['next']['device'])}, "
                   f"{charts.mib(f['next']['host'])} |")
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


def plot_disk(r: dict, path: str):
  """Host and device MiB per device against depth, each tier and stage,
  with the budgets: a tier's depth ends where either line crosses its
  budget."""
  cases = _disk_cases(r)
  fig, axes = charts.plt.subplots(2, len(cases), figsize=(6 * len(cases), 7),
                           squeeze=False, sharex="col")
  for col, (stage, x) in enumerate(cases.items()):
    for row, kind in enumerate(("host", "device")):
      ax = axes[row][col]
      for tier, color in (("host", "#e6550d"), ("disk", charts.COLORS["zero-3"])):
        pts = sorted((int(k), v[kind]) for k, v in
                     x["largest"][tier]["points"].items())
        ax.plot([p[0] for p in pts], [p[1] / charts.MIB for p in pts], marker="o",
                color=color, label=f"{tier} tier: "
                f"{x['largest'][tier]['layers']} layers fit")
      ax.axhline(x["budget"][kind] / charts.MIB, color="k", ls="--", lw=0.8,
                 label=f"{kind} budget")
      ax.set_ylabel(f"{kind} MiB per device")
      ax.legend(fontsize=8)
      ax.grid(alpha=0.3)
    axes[0][col].set_title(f"Stage {stage}: {x['size_ratio']:.2f}× the "
                           "parameters with the disk tier", fontsize=10)
    axes[1][col].set_xlabel(f"layers (width {r['width']})")
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_disk(r, os.path.join(out, f"{mode}_disk.png"))
