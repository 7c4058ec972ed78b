"""`zerojax.plan`'s step-time model against measured step times, and what
planning costs (issue 45).

A GPT written as users write it (unrolled blocks, no zerojax line in the
model), 8 simulated CPU devices, Adam, in two shapes (`PROBLEMS`): many
tokens a parameter (FLOPs dominate the step) and few (the state's bytes
do, as in large-model training). Rows:

  ranking    per problem, each of `CANDIDATES` modelled as the plan models
             it (`zerojax._plan.autoconfig.measure`) and trained for real: the
             Spearman rank correlation of modelled against measured step
             time (target >= 0.8 over at least 6 candidates);
  planning   `zerojax.plan` under a budget only stage 3 meets, timed,
             against one compile of the chosen step in a fresh process
             (target <= 10x).

    python -m benchmarks.plan [--rounds R] [--out DIR]
    python -m benchmarks.plan --calibrate     # the "cpu" figures

Step times are medians of samples taken round robin in one process, with
a pooled malloc (`benchmarks.allocator`), as the calibration: only their
order and ratios mean anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

if __name__ == "__main__":   # before jax starts
  from benchmarks.allocator import restart_pooled
  restart_pooled("benchmarks.plan")   # timings as from a device's pool
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"),
      "--xla_force_host_platform_device_count=8")))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax  # noqa: E402
from benchmarks import models  # noqa: E402
from zerojax._plan import autoconfig  # noqa: E402
from zerojax._plan import costmodel

# name: (model, batch, sequence length)
PROBLEMS = {
    "FLOP-bound": (models.GPTConfig(vocab_size=2048, max_len=64, width=128,
                                    layers=4, heads=4, scan=False,
                                    opt_in=False), 32, 64),
    "state-bound": (models.GPTConfig(vocab_size=4096, max_len=64, width=256,
                                     layers=4, heads=4, scan=False,
                                     opt_in=False), 8, 32),
}
# what the plan chooses between (`zerojax.plan`'s candidates, and stage 2
# and 3 offload variants it would reach under smaller budgets)
CANDIDATES = (
    {"stage": 0}, {"stage": 1}, {"stage": 2}, {"stage": 3},
    {"stage": 3, "remat": "dots"}, {"stage": 3, "remat": "full"},
    {"stage": 2, "offload_optimizer": True},
    {"stage": 3, "offload_optimizer": True},
    {"stage": 3, "offload_optimizer": True, "update_on": "host"},
    {"stage": 3, "remat": "full", "offload_optimizer": True,
     "offload_params": True},
)


def problem(name: str):
  """`(plain TrainState, loss_fn, batch)` of `PROBLEMS[name]`."""
  cfg, size, seq = PROBLEMS[name]
  model = models.GPT(cfg)
  rng = np.random.default_rng(0)
  tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (size, seq + 1)),
                       jnp.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3))

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"]).mean()
  return plain, loss_fn, batch


def spearman(a, b) -> float:
  """Rank correlation (ties at their mean rank)."""
  def ranks(x):
    x = np.asarray(x, float)
    order = np.argsort(x, kind="stable")
    r = np.empty(len(x))
    r[order] = np.arange(len(x))
    for v in np.unique(x):
      r[x == v] = r[x == v].mean()
    return r
  return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def ranking(name: str, rounds: int, figures: dict) -> list:
  """Per candidate: its modelled figures and its measured step time (the
  median of `rounds` samples, candidates round robin)."""
  plain, loss_fn, batch = problem(name)
  step = zerojax.train_step(loss_fn)
  shapes = zerojax.shard_shape(plain)
  used = costmodel.figures_for(jax.devices()[0].device_kind, figures)[1]
  rows, runs = [], {}
  for fields in CANDIDATES:
    c = autoconfig.measure(shapes, step, batch, fields, used, 2 ** 60)
    rows.append({"problem": name, "candidate": c.label,
                 "fields": fields,
                 "device_bytes": c.device_bytes, "host_bytes": c.host_bytes,
                 "wire_bytes": c.wire_bytes, "pcie_bytes": c.pcie_bytes,
                 "host_update_bytes": c.host_update_bytes, "flops": c.flops,
                 "modelled_s": c.modelled_s})
    state = zerojax.shard(plain,
                          config=zerojax.ZeroConfig.from_fields(**fields))
    holder = {"state": state}

    def run(holder=holder):
      holder["state"], metrics = step(holder["state"], batch)
      jax.block_until_ready(metrics)
    run()
    runs[rows[-1]["candidate"]] = run
  times = {k: [] for k in runs}
  for r in range(rounds + 1):
    for name in (list(runs) if r % 2 == 0 else list(runs)[::-1]):
      start = time.perf_counter()
      runs[name]()
      if r:   # the first round: warm-up
        times[name].append(time.perf_counter() - start)
  for row in rows:
    row["measured_s"] = float(np.median(times[row["candidate"]]))
  return rows


_COMPILE = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, {root!r})
import jax, json
import zerojax
from benchmarks.plan import problem
plain, loss_fn, batch = problem({name!r})
shapes = zerojax.shard_shape(jax.eval_shape(lambda s: s, plain),
                             config=zerojax.ZeroConfig.from_fields(**{fields!r}))
start = time.perf_counter()
zerojax.train_step(loss_fn).lower(shapes, batch).compile()
print(json.dumps(time.perf_counter() - start))
"""


def planning(name: str, figures: dict) -> dict:
  """`zerojax.plan` under a budget only stage 3 meets (the stage-2 and
  stage-3 figures of a first plan set it), timed, and one compile of the
  chosen step in a fresh process."""
  plain, loss_fn, batch = problem(name)
  every = zerojax.plan(plain, loss_fn, batch, device_budget=2 ** 60,
                       figures=figures)
  by_stage = {c.fields["stage"]: c for c in every.candidates
              if len(c.fields) == 1}
  budget = (by_stage[2].device_bytes + by_stage[3].device_bytes) // 2
  start = time.perf_counter()
  plan = zerojax.plan(plain, loss_fn, batch, device_budget=budget,
                      figures=figures)
  seconds = time.perf_counter() - start
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = subprocess.run(
      [sys.executable, "-c", _COMPILE.format(root=root, name=name,
                                             fields=plan.config_fields)],
      capture_output=True, text=True, check=True)
  compile_s = json.loads(out.stdout.strip().splitlines()[-1])
  return {"problem": name, "budget": budget, "chosen": plan.chosen.label,
          "candidates": len(plan.candidates), "plan_s": seconds,
          "compile_s": compile_s, "ratio": seconds / compile_s,
          "table": str(plan)}


def write(rows: list, plan: dict, out: str, meta: dict) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  names = list(dict.fromkeys(r["problem"] for r in rows))
  rho = {n: spearman([r["modelled_s"] for r in rows if r["problem"] == n],
                     [r["measured_s"] for r in rows if r["problem"] == n])
         for n in names}
  mib = lambda b: f"{b / 2 ** 20:,.2f}"
  goals = [(f"Spearman, modelled vs measured step time, {n} "
            f"({sum(r['problem'] == n for r in rows)} candidates)", rho[n],
            ">= 0.80", rho[n] >= 0.8) for n in names]
  goals.append((f"planning time / one compile of the chosen step, "
                f"{plan['problem']} ({plan['candidates']} candidates "
                "compiled)", plan["ratio"], "<= 10", plan["ratio"] <= 10))
  text = "\n".join([
      "# The plan's step-time model, and what planning costs", "",
      f"`python -m benchmarks.plan`, {meta['date']}, jax {meta['jax']}, 8 "
      "simulated CPU devices, a GPT written as users write it, fp32, Adam. "
      f"Figures of 'cpu': {meta['figures']}. Step times: medians of "
      f"{meta['rounds']} samples round robin in one process (order and "
      "ratios only).", "",
      *[f"- {n}: {meta['problems'].get(n, '')}" for n in names], "",
      "| row | measured | target | met |", "|---|---:|---:|---|",
      *[f"| {g} | {v:.2f} | {t} | {'yes' if m else 'no'} |"
        for g, v, t, m in goals], "",
      "| problem | candidate | device MiB | host MiB | data MiB | PCIe MiB | "
      "GFLOP | modelled ms | measured ms |",
      "|---|---|---:|---:|---:|---:|---:|---:|---:|",
      *[f"| {r['problem']} | {r['candidate']} | {mib(r['device_bytes'])} | "
        f"{mib(r['host_bytes'])} | {mib(r['wire_bytes'])} | "
        f"{mib(r['pcie_bytes'])} | {r['flops'] / 1e9:.2f} | "
        f"{1e3 * r['modelled_s']:.1f} | {1e3 * r['measured_s']:.1f} |"
        for r in rows], "",
      f"Planning the {plan['problem']} problem under a budget of "
      f"{plan['budget']:,} bytes (between stage 2's and stage 3's needs): "
      f"{plan['plan_s']:.1f} s; one compile of the chosen step "
      f"({plan['chosen']}) in a fresh process: {plan['compile_s']:.1f} s.",
      "", "```", plan["table"], "```", "", "![plan](plan.png)", ""])
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "plan.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "plan.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows, "planning": plan,
               "spearman": rho}, f, indent=1)
  fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4))
  for ax, n in zip(np.atleast_1d(axes), names):
    mine = [r for r in rows if r["problem"] == n]
    ax.scatter([1e3 * r["modelled_s"] for r in mine],
               [1e3 * r["measured_s"] for r in mine])
    for r in mine:
      ax.annotate(r["candidate"], (1e3 * r["modelled_s"],
                                   1e3 * r["measured_s"]), fontsize=6)
    ax.set_xlabel("modelled step ms")
    ax.set_ylabel("measured step ms (CPU, order only)")
    ax.set_title(f"{n}: Spearman {rho[n]:.2f}")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "plan.png"), dpi=110)
  return text


def describe(name: str) -> str:
  cfg, size, seq = PROBLEMS[name]
  return (f"{cfg.layers} unrolled blocks of width {cfg.width}, vocabulary "
          f"{cfg.vocab_size}, {size} x {seq} tokens a step")


def _seconds(fn, *args, repeat: int = 7) -> float:
  """Median seconds of `fn(*args)`, after one warm-up call."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(repeat):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def calibrate() -> dict:
  """The "cpu" figures measured on this machine's simulated devices, per
  device (all of them running at once): an fp32 matmul's FLOP/s, an
  all-gather's ring bytes/s, a round trip to `pinned_host` memory's bytes/s,
  an Adam-like elementwise update's bytes/s of state, and a device's share
  of a file written and read back."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  n = jax.device_count()
  mesh = Mesh(np.array(jax.devices()), ("data",))
  split = NamedSharding(mesh, P("data"))
  d = 512
  x = jax.device_put(jnp.ones((n * d, d)), split)
  w = jax.device_put(jnp.ones((d, d)), NamedSharding(mesh, P()))
  flops32 = 2 * d ** 3 / _seconds(jax.jit(lambda x, w: x @ w), x, w)
  shard = 2 ** 20   # fp32 elements a device
  y = jax.device_put(jnp.ones((n * shard,)), split)
  gather = jax.jit(jax.shard_map(
      lambda s: jax.lax.all_gather(s, "data", tiled=True), mesh=mesh,
      in_specs=P("data"), out_specs=P("data")))
  link = 4 * shard * (n - 1) / _seconds(gather, y)
  host = split.with_memory_kind("pinned_host")
  trip = jax.jit(lambda a: jax.device_put(jax.device_put(a, host), split))
  pcie = 2 * 4 * shard / _seconds(trip, y)
  update = jax.jit(lambda p, m, v, g: (p - 1e-3 * m / (jnp.sqrt(v) + 1e-8),
                                       0.9 * m + 0.1 * g,
                                       0.999 * v + 1e-3 * g * g))
  host_update = 2 * 3 * 4 * shard / _seconds(update, y, y, y, y)
  return {"flops16": flops32 / 2, "flops32": flops32, "link": link,
          "node_link": link, "pcie": pcie, "host_update": host_update,
          "disk": _disk_bytes_per_s() / n}


def _disk_bytes_per_s(size: int = 2 ** 26) -> float:
  """A file of `size` bytes written (synced) and read back, bytes/s."""
  import tempfile
  data = np.ones(size // 4, np.float32)
  with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "probe")

    def trip():
      with open(path, "wb") as f:
        data.tofile(f)
        f.flush()
        os.fsync(f.fileno())
      return np.fromfile(path, np.float32)
    return 2 * size / _seconds(trip, repeat=3)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "results"))
  parser.add_argument("--calibrate", action="store_true")
  args = parser.parse_args()
  if args.calibrate:
    print(calibrate())
    return
  figures = {}
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC"), "jax": jax.__version__, "rounds": args.rounds,
      "figures": costmodel.figures_for("cpu", figures)[1],
      "problems": {name: describe(name) for name in PROBLEMS}}
  rows = [row for name in PROBLEMS
          for row in ranking(name, args.rounds, figures)]
  print(write(rows, planning("FLOP-bound", figures), args.out, meta))


if __name__ == "__main__":
  main()
