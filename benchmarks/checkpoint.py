"""Checkpoint save and restore: zerojax stage 3 on 8 simulated devices against
a plain orbax `StandardCheckpointer` of the same unsharded flax `TrainState`
(fp32 parameters + AdamW, values of `model.init`).

  save      `zerojax.checkpoint.save` + `wait`, from a live stage-3 state;
            `StandardCheckpointer().save` + `wait_until_finished` of the
            TrainState on one device. `blocking` is the part before the call
            returns (training waits that long), `total` until committed.
  restore   `zerojax.checkpoint.restore(like=<abstract TrainState>)` into a
            stage-3 state on 8 devices (the same chunk layout: reads the
            chunk shards directly); `StandardCheckpointer().restore` onto one
            device. Until the arrays are ready.
  host MiB  peak resident memory of the process during the call less its
            resident memory just before (`VmHWM` after resetting it through
            `/proc/self/clear_refs`, against `VmRSS`). CPU "device" memory is
            host memory, so this counts every copy the call makes, and the
            state itself (resident before a save) is not in it. A save whose
            increase stays below the state's size gathered no full copy.

Every measurement runs in a fresh process (`python -m benchmarks.checkpoint
KIND CONFIG DIR`, one JSON line on stdout), so that no earlier allocation or
compilation counts.
"""
from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from benchmarks import charts

KINDS = ("orbax-save", "zerojax-save", "orbax-restore", "zerojax-restore")
# Model configs (benchmarks.models) per run mode. GPT-2 medium's state is
# 4.3 GB; its zerojax save holds about twice that at its peak.
CONFIGS = {"smoke": ("tiny",), "quick": ("gpt2-small",),
           "full": ("gpt2-small", "gpt2-medium")}
ROUNDS = {"smoke": 1, "quick": 2, "full": 4}
GOAL_TIME_RATIO = 1.2
# table rows: the second call of a process, then the first
MEASUREMENTS = ("save", "first save", "restore", "first restore")


# ---- inside the measuring process -------------------------------------------------
def _status() -> dict:
  out = {}
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith(("VmRSS", "VmHWM")):
        key, value = line.split(":", 1)
        out[key] = int(value.split()[0]) * 1024
  return out


def _cpu_seconds() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)   # every thread
  return usage.ru_utime + usage.ru_stime


def _measured(fn) -> dict:
  """Runs fn() -> (result, blocking seconds or None); times, CPU seconds of
  the process (user + system, all threads: steadier than wall time on a
  shared host) and peak host memory above the resident memory at the
  start."""
  with open("/proc/self/clear_refs", "w") as f:
    f.write("5")   # resets VmHWM to the current VmRSS
  before = _status()["VmRSS"]
  cpu = _cpu_seconds()
  start = time.perf_counter()
  result, blocking = fn()
  total = time.perf_counter() - start
  cpu = _cpu_seconds() - cpu
  after = _status()
  return {"total_s": total, "cpu_s": cpu, "blocking_s": blocking,
          "rss_before": before, "peak_increase": after["VmHWM"] - before,
          "rss_after": after["VmRSS"]}, result


def _twice(call) -> tuple:
  """The first call of the process (`call(0)`: compiles, and zerojax runs
  its optimizer probes, once per process and tx) and a second (`call(1)`:
  what every later call costs); the second call's result."""
  first, result = _measured(lambda: call(0))
  del result   # a restore's first state is freed before the second
  again, result = _measured(lambda: call(1))
  return {**again, "first": first}, result


def _problem(cfg_name: str):
  import jax
  from flax.training import train_state
  from benchmarks import models
  model = models.CONFIGS[cfg_name].make_model()
  tx = models.make_tx()

  def init_fn(rng):
    return model.init(rng, jax.numpy.zeros((1, 8), jax.numpy.int32))["params"]

  def plain(rng):
    return train_state.TrainState.create(apply_fn=model.apply,
                                         params=init_fn(rng), tx=tx)
  return model, tx, init_fn, plain


def _state_bytes(tree) -> int:
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _child(kind: str, cfg_name: str, directory: str) -> dict:
  import jax
  import orbax.checkpoint as ocp
  import zerojax
  model, tx, init_fn, plain = _problem(cfg_name)
  rng = jax.random.key(0)
  abstract = jax.eval_shape(plain, rng)
  out = {"kind": kind, "config": cfg_name, "state_bytes": _state_bytes(abstract),
         "devices": jax.device_count()}
  zdir, odir = os.path.join(directory, "zerojax"), os.path.join(directory, "orbax")
  if kind == "zerojax-save":
    state = zerojax.create(init_fn, rng, apply_fn=model.apply, tx=tx, stage=3,
                           blocks=zerojax.Blocks(stacked=("blocks",)))
    jax.block_until_ready(state)

    def save(step):
      t = time.perf_counter()
      zerojax.checkpoint.save(zdir, state, step=step)
      blocking = time.perf_counter() - t
      zerojax.checkpoint.wait(zdir)
      return None, blocking
    m, _ = _twice(save)
  elif kind == "orbax-save":
    state = jax.jit(plain)(rng)   # on one device
    jax.block_until_ready(state)
    ckptr = ocp.StandardCheckpointer()

    def save(step):
      t = time.perf_counter()
      ckptr.save(os.path.join(odir, str(step)), state)
      blocking = time.perf_counter() - t
      ckptr.wait_until_finished()
      return None, blocking
    m, _ = _twice(save)
  elif kind == "zerojax-restore":
    m, state = _twice(lambda _: (jax.block_until_ready(
        zerojax.checkpoint.restore(zdir, like=abstract)), None))
    assert state.config.stage == 3 and state.num_shards == jax.device_count()
  elif kind == "orbax-restore":
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=one), abstract)
    m, state = _twice(lambda _: (jax.block_until_ready(
        ocp.StandardCheckpointer().restore(os.path.join(odir, "1"), target)),
        None))
  else:
    _check_kind(kind)
  out.update(m)
  return out


# ---- driving process ----------------------------------------------------------------
def _check_kind(kind: str) -> None:
  if kind not in KINDS:
    raise ValueError(f"unknown measurement {kind!r}; use one of {KINDS}.")


def measure(kind: str, cfg_name: str, directory: str, timeout: int = 1800) -> dict:
  """One measurement in a fresh process with 8 simulated CPU devices."""
  _check_kind(kind)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  cmd = [sys.executable, "-m", "benchmarks.checkpoint", kind, cfg_name, directory]
  proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True,
                        timeout=timeout)
  if proc.returncode != 0:
    raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n"
                       f"{proc.stderr[-4000:]}")
  return json.loads(proc.stdout.strip().splitlines()[-1])


def run(config: str, log=print, rounds: int = 2) -> dict:
  """The four measurements of one model config, with ratios and goals.

  Each measurement starts after `os.sync()`, so that no save pays for the
  writeback of the one before. The rounds alternate which side goes first
  (the page cache and the disk favour neither), and every figure is the
  mean over the rounds."""
  measured = {kind: [] for kind in KINDS}
  with tempfile.TemporaryDirectory(prefix="zerojax_ckpt_bench_") as tmp:
    for r in range(rounds):
      order = KINDS if r % 2 == 0 else (KINDS[1], KINDS[0], KINDS[3], KINDS[2])
      directory = os.path.join(tmp, str(r))
      for kind in order:   # saves first: the restores read what they wrote
        log(f"checkpoint {kind} ({config}, round {r + 1} of {rounds})")
        os.sync()
        measured[kind].append(measure(kind, config, directory))
      shutil.rmtree(directory)
  return summary(config, {kind: {**_mean(ms), "rounds": ms}
                          for kind, ms in measured.items()})


def _mean(measurements: list) -> dict:
  """Field-wise mean of measurement dicts (nested dicts alike; None and
  text kept from the first)."""
  out = {}
  for key, value in measurements[0].items():
    values = [m[key] for m in measurements]
    if isinstance(value, dict):
      out[key] = _mean(values)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
      out[key] = sum(values) / len(values)
    else:
      out[key] = value
  return out


def summary(config: str, rows: dict) -> dict:
  """The result of one config from its four measurements."""
  state = rows["orbax-save"]["state_bytes"]
  ratios = {what: rows[f"zerojax-{what}"]["total_s"] /
            rows[f"orbax-{what}"]["total_s"] for what in ("save", "restore")}
  for what in ("save", "restore"):
    ratios[f"first {what}"] = (rows[f"zerojax-{what}"]["first"]["total_s"] /
                               rows[f"orbax-{what}"]["first"]["total_s"])
  return {"config": config, "state_bytes": state, "rows": rows,
          "rounds": len(rows["orbax-save"].get("rounds", [None])),
          "time_ratio": ratios, "round_ratios": _round_ratios(rows),
          "save_peak_over_state": rows["zerojax-save"]["peak_increase"] / state}


def _round_ratios(rows: dict) -> dict:
  """Per measurement, the zerojax / orbax time ratio of each round (the
  spread shows how far one round's figure can be trusted)."""
  out = {}
  for what in MEASUREMENTS:
    kind = what.split()[-1]
    pick = (lambda m: m["first"]) if what.startswith("first") else (lambda m: m)
    pairs = zip(rows[f"zerojax-{kind}"].get("rounds", []),
                rows[f"orbax-{kind}"].get("rounds", []))
    out[what] = [pick(z)["total_s"] / pick(o)["total_s"] for z, o in pairs]
  return out


def goal_checks(results: list) -> list:
  goals = []
  for r in results:
    for what in MEASUREMENTS:
      v = r["time_ratio"][what]
      goals.append((f"zerojax {what} time / plain orbax ({r['config']})", v,
                    GOAL_TIME_RATIO, v <= GOAL_TIME_RATIO))
    v = r["save_peak_over_state"]
    goals.append((f"zerojax save peak host increase / state bytes "
                  f"({r['config']})", v, 1.0, v < 1.0))
  return goals


if __name__ == "__main__":
  print(json.dumps(_child(*sys.argv[1:4])))


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
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
      lines.append(f"| {c['config']} | {charts.mib(c['state_bytes'])} | {what} | "
                   f"{zr['total_s']:.2f} | {orow['total_s']:.2f} | "
                   f"{zr['total_s'] / orow['total_s']:.2f} | {spread} | "
                   f"{cpu(zr)} | {cpu(orow)} | "
                   f"{charts.mib(zr['peak_increase'])} | {charts.mib(orow['peak_increase'])}"
                   f" | {blocking} |")
  return lines + ["", f"![checkpoint]({mode}_checkpoint.png)", ""]


def plot_checkpoint(r: dict, path: str):
  configs = r["configs"]
  fig, axes = charts.plt.subplots(1, 2, figsize=(9, 3.8))
  labels = [f"{c['config']}\n{what}" for c in configs
            for what in ("save", "first save", "restore", "first restore")]
  x = range(len(labels))
  for ax, key, unit, title in (
      (axes[0], "total_s", 1, "time (s)"),
      (axes[1], "peak_increase", charts.MIB, "peak host increase (MiB)")):
    for i, (side, color) in enumerate((("zerojax", charts.COLORS["zero-3"]),
                                       ("orbax", charts.COLORS["plain-dp"]))):
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
        ax.axhline(c["state_bytes"] / charts.MIB, color="k", ls="--", lw=0.8,
                   label=f"state size ({c['config']})" if j == 0 else None)
    ax.set_xticks([j + 0.2 for j in x], labels, fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3, axis="y")
  axes[0].legend(fontsize=8)
  axes[1].legend(fontsize=8)
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_checkpoint(r, os.path.join(out, f"{mode}_checkpoint.png"))
