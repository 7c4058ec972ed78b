"""One entry point for the benchmark suite.

    python -m benchmarks.run --quick [--out benchmarks/results]
    python -m benchmarks.run --full  [--suites speed,memory,comm]
    python -m benchmarks.run --quick --suites offload
    python -m benchmarks.run --full --suites checkpoint
    python -m benchmarks.run --gpu   # on the local GPUs: GPT-2 medium, bf16

On 8 simulated CPU devices (XLA_FLAGS is set here, before jax is imported,
unless the caller set it), in one process, for a GPT-2-style model
(`benchmarks.models`): step time of zerojax stages 0-3 against plain jit data
parallelism and GSPMD FSDP, and of zerojax on a 1-device mesh against plain
optax, for that model and for two models written as users write them
(`benchmarks.user_models`, against plain DP only) (`speed`), per-device
memory against ZeRO's
formulas plus a depth sweep (`memory`), collectives per step against ZeRO's
communication volume plus a chunk-size sweep (`comm`); on request only,
host offload at stage 3 (`offload`: device/host bytes, the largest model
under a fixed device budget, step-time cost), the disk tier against host
offload (`disk`: the largest model on one machine, PCIe and disk bytes,
step time) and checkpoint save / restore
against plain orbax (`checkpoint`, each measurement in a fresh process). Writes
`<mode>_<suite>.json`, `<mode>_*.png` and a README.md summarising every
result file in the output folder (see `benchmarks.report`). The exit status
is 1 when a goal of a suite that ran was missed.
"""
from __future__ import annotations

import os
import sys

# --gpu runs on the local accelerators: no simulated CPU devices
if "--gpu" not in sys.argv and "--xla_force_host_platform_device_count" not in (
    os.environ.get("XLA_FLAGS", "")):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                             " --xla_force_host_platform_device_count=8").strip()
if "--gpu" not in sys.argv:
  os.environ.setdefault("JAX_PLATFORMS", "cpu")

# timings with a pooled malloc (`benchmarks.allocator`); --system-allocator
# keeps glibc's defaults
if (__name__ == "__main__" and "--gpu" not in sys.argv
    and "--system-allocator" not in sys.argv):
  from benchmarks.allocator import restart_pooled
  restart_pooled("benchmarks.run")

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402

from benchmarks import allocator, comm, memory, models, offload, report, speed  # noqa: E402
from benchmarks import third_party, user_models  # noqa: E402
from benchmarks import variants as V  # noqa: E402
from benchmarks import checkpoint, disk, frontends, gpu, hybrid  # noqa: E402
from benchmarks import quantized, tensor_parallel  # noqa: E402

SUITES = ("speed", "memory", "comm")   # run by default
EXTRA_SUITES = ("offload", "checkpoint", "frontends", "hybrid",
                "quantized", "disk", "tp")  # when named
CONFIGS = {**models.CONFIGS, **user_models.CONFIGS, **third_party.CONFIGS}
# The user-written models against plain DP, not GSPMD FSDP: the comparison
# the issue sets goals for, at half the time.
USER_VARIANTS = tuple(f"zero-{s}" for s in V.ZERO_STAGES) + (
    "plain-dp", "1dev-zero-0", "1dev-optax")
SMOKE_VARIANTS = ("zero-3", "plain-dp")
# 32 rows of 256 features per device, in --quick and --full alike
MLP_SPEED = dict(config="mlp-3m", batch=256, seq=None, rounds=9,
                 variants=USER_VARIANTS)


def _third_party(config: str, **kw) -> tuple:
  """The speed config of a third-party model (`benchmarks.third_party`),
  none where its package is not installed (`_meta` says so)."""
  return ((dict(config=config, **{"variants": USER_VARIANTS, **kw}),)
          if config in CONFIGS else ())


# Per mode: the speed configs, each timed on its own (the first, the GPT, is
# also analysed for memory and communication when it is the first memory
# config), the memory configs, the depth sweep and the chunk-size sweep.
# Batches are global (rows over all devices) x tokens.
MODES = {
    "smoke": dict(
        speed=(dict(config="tiny", batch=8, seq=16, rounds=1,
                    variants=("zero-3", "plain-dp", "gspmd-fsdp"),
                    options=memory.analysis_options()),
               # the user models, one step each (and the warm-up),
               # compiled the sweeps' faster way: every variant of one,
               # stage 3 and its baseline of the others (each variant of
               # each is stepped in tests/test_benchmarks.py)
               dict(config="mlp-tiny", batch=8, seq=None, rounds=1,
                    variants=USER_VARIANTS, options=memory.sweep_options()),
               dict(config="transformer-tiny", batch=8, seq=16, rounds=1,
                    variants=SMOKE_VARIANTS, options=memory.sweep_options()),
               *_third_party("hf-gpt2-tiny", batch=8, seq=16, rounds=1,
                             variants=SMOKE_VARIANTS,
                             options=memory.sweep_options()),
               *_third_party("hf-llama-tiny", batch=8, seq=16, rounds=1,
                             variants=SMOKE_VARIANTS,
                             options=memory.sweep_options())),
        memory=dict(configs=("tiny",), batch=8, seq=16),
        depth=dict(config="tiny", layers=(1, 2)),
        comm=dict(config="tiny", chunk_sizes=(2 ** 12,), chunk_stages=(3,)),
        offload=dict(config="tiny", batch=8, seq=16, speed_config="tiny",
                     speed_batch=8, speed_seq=16, rounds=1),
        disk=dict(config="transformer-tiny", batch=8, seq=16,
                  cases=("3 bf16",),
                  speed_config="transformer-tiny", speed_batch=8,
                  speed_seq=16, rounds=1),
    ),
    # GPT: 128 tokens per device: the per-step cost of the optimizer and of
    # parameter movement weighs heavily against so little compute.
    "quick": dict(
        speed=(dict(config="cpu-1m", batch=16, seq=64, rounds=15,
                    variants=V.MESH_VARIANTS + V.ONE_DEVICE_VARIANTS),
               MLP_SPEED,
               dict(config="transformer-6m", batch=16, seq=32, rounds=9,
                    variants=USER_VARIANTS),
               *_third_party("hf-gpt2-6m", batch=16, seq=32, rounds=9),
               *_third_party("hf-llama-6m", batch=16, seq=32, rounds=9)),
        memory=dict(configs=("cpu-1m",), batch=16, seq=64),
        depth=dict(config="cpu-1m", layers=(2, 4, 8)),
        comm=dict(config="cpu-1m", chunk_sizes=(2 ** 14, 2 ** 16, 2 ** 18),
                  chunk_stages=(3,)),
        # compiled only (abstract states): GPT-2 medium costs seconds here
        offload=dict(config="gpt2-medium", batch=8, seq=256,
                     speed_config="cpu-1m", speed_batch=16, speed_seq=64,
                     rounds=9),
        # 4 blocks at the start: the disk tier's depth stays where the CPU
        # backend runs stage 2 (24 blocks die in an all-gather rendezvous
        # here, with or without offload)
        disk=dict(config="transformer-6m", layers=4, batch=16, seq=32,
                  cases=("2 bf16", "3 bf16", "3 fp32"),
                  speed_config="transformer-6m",
                  speed_batch=16, speed_seq=32, rounds=5),
    ),
    # The same model at 1024 tokens per device for speed; GPT-2 small and
    # medium for memory and communication (compiled, and allocated only where
    # the state fits in this host's memory).
    "full": dict(
        speed=(dict(config="cpu-1m", batch=64, seq=128, rounds=9,
                    variants=V.MESH_VARIANTS + V.ONE_DEVICE_VARIANTS),
               MLP_SPEED,
               dict(config="transformer-6m", batch=32, seq=64, rounds=9,
                    variants=USER_VARIANTS),
               *_third_party("hf-gpt2-6m", batch=32, seq=64, rounds=9),
               *_third_party("hf-llama-6m", batch=32, seq=64, rounds=9)),
        # and issue 14's unscanned GPT-2 without the opt-in: stage 3 must
        # never hold more than GSPMD FSDP (a goal row)
        # and GPT-2 with its tied embedding gathered by vocabulary blocks
        memory=dict(configs=("gpt2-small", "gpt2-medium", "gpt2-384-unrolled",
                             "gpt2-small-blocked", "gpt2-medium-blocked"),
                    batch=8, seq=256),
        depth=dict(config="gpt2-small", layers=(2, 4, 8, 12)),
        # `also`: configs whose stage 3 is counted too
        comm=dict(config="gpt2-small",
                  chunk_sizes=(2 ** 18, 2 ** 20, 2 ** 22, 2 ** 24),
                  chunk_stages=(2, 3), also=("gpt2-small-blocked",)),
        offload=dict(config="gpt2-medium", batch=8, seq=256,
                     speed_config="cpu-1m", speed_batch=64, speed_seq=128,
                     rounds=9),
        disk=dict(config="transformer-6m", layers=4, batch=16, seq=32,
                  cases=("2 bf16", "3 bf16", "3 fp32"),
                  speed_config="transformer-6m",
                  speed_batch=16, speed_seq=32, rounds=9),
    ),
}
NUM_DEVICES = 8


def _log(msg: str):
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _write(out: str, name: str, data: dict):
  path = os.path.join(out, name)
  with open(path, "w") as f:
    json.dump(data, f, indent=1, default=_json_default)
  _log(f"wrote {path}")


def _json_default(x):
  if hasattr(x, "item"):
    return x.item()
  if isinstance(x, (set, tuple)):
    return list(x)
  return str(x)


def _meta(mode: str) -> dict:
  return {"mode": mode, "jax": jax.__version__, "backend": jax.default_backend(),
          "devices": jax.device_count(), "python": platform.python_version(),
          "host_memory_bytes": memory.host_memory()["MemTotal"],
          "cpu_count": os.cpu_count(),
          **({"third_party": third_party.missing} if third_party.missing
             else {}),
          "allocator": ("pooled (GLIBC_TUNABLES)" if allocator.pooled()
                        else "system"),
          "date": time.strftime("%Y-%m-%d %H:%M:%S")}


def _setup(cfg_name: str, batch: int, seq) -> dict:
  """The config's name, model class, Ψ and integer shape fields."""
  cfg = CONFIGS[cfg_name]
  shape = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
           if type(getattr(cfg, f.name)) is int}
  return {"config": cfg_name, "model": type(cfg.make_model()).__name__,
          "num_params": cfg.num_params, **shape, "global_batch": batch,
          "seq": seq, "devices": NUM_DEVICES}


def _build_speed(sp: dict) -> dict:
  """The variants of one speed config, built and compiled side by side."""
  built = {}
  for name in sp["variants"]:
    _log(f"building {name} ({sp['config']})")
    built[name] = V.build(name, CONFIGS[sp["config"]],
                          global_batch=sp["batch"], seq=sp["seq"],
                          num_devices=NUM_DEVICES, options=sp.get("options"))
    built[name].compiled()
  return built


def _same_setup(plan: dict, cfg_name: str) -> bool:
  """Whether the memory suite can reuse the speed suite's variants."""
  sp, mp = plan["speed"][0], plan["memory"]
  return (cfg_name == sp["config"] and
          (mp["batch"], mp["seq"]) == (sp["batch"], sp["seq"]))


def _analyse_config(cfg_name: str, plan: dict, main: dict, want_comm):
  """Memory rows (and communication rows) of every mesh variant of one
  config. Variants are built in turn and released; those the speed suite
  built are reused. `want_comm`: True (every variant's communication),
  False, or the variants whose rows are named after the config too."""
  cfg = models.CONFIGS[cfg_name]
  mp = plan["memory"]
  reuse = _same_setup(plan, cfg_name)
  names = [n for n in V.MESH_VARIANTS if not reuse or n in main]
  mem_rows, comm_rows = [], []
  for name in names:
    _log(f"analysing {name} ({cfg_name})")
    v, note = (main[name], "") if reuse else (None, "")
    try:
      if v is None:
        note = memory.allocation_check(name, cfg.num_params, NUM_DEVICES)
        # Analysed, never run: compiled for analysis only.
        v = V.build(name, cfg, global_batch=mp["batch"], seq=mp["seq"],
                    num_devices=NUM_DEVICES, materialize=not note,
                    options=memory.analysis_options())
      mem_rows.append(memory.row(v, note=note))
      if want_comm is True:
        comm_rows.append(comm.row(v))
      elif want_comm and name in want_comm:
        comm_rows.append({**comm.row(v), "variant": f"{name} ({cfg_name})"})
    except Exception as e:   # noqa: BLE001 - reported, not fatal
      mem_rows.append({"variant": name, "num_params": cfg.num_params,
                       "devices": NUM_DEVICES,
                       "error": f"{type(e).__name__}: {e}"[:500]})
    if v is not None and not reuse:
      v.release()
    del v
    gc.collect()
  return mem_rows, comm_rows


def run(mode: str, out: str, suites=SUITES) -> dict:
  """Runs the suites of `mode` and writes results into `out`.

  Returns the results written, by suite.
  """
  plan = MODES[mode]
  sp, mp, dp, cp = plan["speed"][0], plan["memory"], plan["depth"], plan["comm"]
  os.makedirs(out, exist_ok=True)
  if jax.device_count() < NUM_DEVICES:
    raise RuntimeError(
        f"the benchmarks need {NUM_DEVICES} devices, found "
        f"{jax.device_count()}: set XLA_FLAGS=--xla_force_host_platform_"
        f"device_count={NUM_DEVICES} before jax is imported.")
  meta = _meta(mode)
  written = {}
  analyse = "memory" in suites or "comm" in suites

  # Speed: per speed config, its variants built (allocated) side by side and
  # timed; the first config's are kept for the memory suite when it analyses
  # the same setup.
  keep = analyse and _same_setup(plan, mp["configs"][0])
  main = _build_speed(sp) if keep else {}
  if "speed" in suites:
    timed = []
    for i, p in enumerate(plan["speed"]):
      built = main if i == 0 and keep else _build_speed(p)
      _log(f"timing {len(built)} variants ({p['config']}), {p['rounds']} "
           "rounds")
      timed.append(speed.run(built, p["rounds"],
                             _setup(p["config"], p["batch"], p["seq"])))
      if built is not main:
        for v in built.values():
          v.release()
    result = {"meta": meta, "models": timed,
              "goals": [g for r in timed for g in speed.goal_checks(r)]}
    _write(out, f"{mode}_speed.json", result)
    written["speed"] = result

  # Memory and communication of every memory config.
  mem_rows, comm_rows = {}, []
  if analyse:
    for cfg_name in mp["configs"]:
      mem_rows[cfg_name], rows = _analyse_config(
          cfg_name, plan, main,
          want_comm=(True if cfg_name == cp["config"] else
                     ("zero-3",) if cfg_name in cp.get("also", ()) else False))
      comm_rows += rows

  if "memory" in suites:
    _log(f"depth sweep {dp['layers']} ({dp['config']})")
    sweep = memory.depth_sweep(
        models.CONFIGS[dp["config"]], dp["layers"],
        [n for n in V.MESH_VARIANTS if n in sp["variants"]],
        functools.partial(V.build, global_batch=mp["batch"], seq=mp["seq"],
                          num_devices=NUM_DEVICES))
    result = {"meta": meta,
              "setup": {"global_batch": mp["batch"], "seq": mp["seq"],
                        "devices": NUM_DEVICES},
              "configs": {c: _setup(c, mp["batch"], mp["seq"])
                          for c in mp["configs"]},
              "rows": mem_rows, "depth_sweep": sweep,
              "depth_config": dp["config"],
              # the yardstick counts two gathered layers: for models
              # that take the per-layer opt-in only
              "expected_stage3": {c: memory.stage3_expected(
                  models.CONFIGS[c], mp["batch"] // NUM_DEVICES, mp["seq"],
                  NUM_DEVICES) for c in mp["configs"]
                                  if models.CONFIGS[c].opt_in}}
    result["goals"] = [g for c, rows in mem_rows.items()
                       for g in memory.goal_checks(
                           rows, c, result["expected_stage3"].get(c))]
    _write(out, f"{mode}_memory.json", result)
    written["memory"] = result

  if "comm" in suites:
    _log(f"chunk sweep {cp['chunk_sizes']} ({cp['config']})")
    chunks = comm.chunk_sweep(
        models.CONFIGS[cp["config"]], cp["chunk_sizes"],
        functools.partial(V.build, global_batch=mp["batch"], seq=mp["seq"],
                          num_devices=NUM_DEVICES),
        stages=cp["chunk_stages"])
    result = {"meta": meta,
              "setup": _setup(cp["config"], mp["batch"], mp["seq"]),
              "rows": comm_rows, "chunk_sweep": chunks,
              "goals": comm.goal_checks(comm_rows)}
    _write(out, f"{mode}_comm.json", result)
    written["comm"] = result

  if "offload" in suites:
    op = plan["offload"]
    _log(f"offload ({op['config']}; step time {op['speed_config']})")
    result = offload.run(op["config"], batch=op["batch"], seq=op["seq"],
                         n=NUM_DEVICES, speed_config=op["speed_config"],
                         speed_batch=op["speed_batch"],
                         speed_seq=op["speed_seq"], rounds=op["rounds"],
                         max_layers=op.get("max_layers"))
    result.update(meta=meta, goals=offload.goal_checks(result))
    _write(out, f"{mode}_offload.json", result)
    written["offload"] = result

  if "disk" in suites:
    dp = plan["disk"]
    _log(f"disk tier ({dp['config']}, stages {dp['cases']})")
    result = disk.run(dp["config"], batch=dp["batch"], seq=dp["seq"],
                      n=NUM_DEVICES, speed_config=dp["speed_config"],
                      speed_batch=dp["speed_batch"], speed_seq=dp["speed_seq"],
                      rounds=dp["rounds"], cases=dp["cases"],
                      layers=dp.get("layers"))
    result.update(meta=meta, goals=disk.goal_checks(result))
    _write(out, f"{mode}_disk.json", result)
    written["disk"] = result

  if "checkpoint" in suites:
    rows = [checkpoint.run(c, log=_log, rounds=checkpoint.ROUNDS[mode])
            for c in checkpoint.CONFIGS[mode]]
    result = {"meta": meta, "configs": rows,
              "goals": checkpoint.goal_checks(rows)}
    _write(out, f"{mode}_checkpoint.json", result)
    written["checkpoint"] = result

  if "hybrid" in suites:
    result = hybrid.run(mode, log=_log)
    result.update(meta=meta, goals=hybrid.goal_checks(result))
    _write(out, f"{mode}_hybrid.json", result)
    written["hybrid"] = result

  if "tp" in suites:
    result = tensor_parallel.run(mode, log=_log)
    result.update(meta=meta, goals=tensor_parallel.goal_checks(result))
    _write(out, f"{mode}_tp.json", result)
    written["tp"] = result

  if "quantized" in suites:
    result = quantized.run(mode, log=_log)
    result.update(meta=meta, goals=quantized.goal_checks(result))
    _write(out, f"{mode}_quantized.json", result)
    written["quantized"] = result

  if "frontends" in suites:
    result = frontends.run(mode, log=_log)
    result.update(meta=meta, goals=frontends.goal_checks(result))
    _write(out, f"{mode}_frontends.json", result)
    written["frontends"] = result

  for v in main.values():
    v.release()
  report.write(out, mode)
  _log(f"wrote {os.path.join(out, 'README.md')}")
  return written


def run_gpu(mode: str, out: str, rows=None) -> dict:
  """The throughput suite (`benchmarks.gpu`) on the local devices, or the
  results of `rows` files that `benchmarks/gpu_lease.sh` measured on
  another machine (described by its rows)."""
  os.makedirs(out, exist_ok=True)
  if rows is None:
    result = gpu.run(mode, log=_log)
    result["meta"] = _meta(mode)
  else:
    measured = gpu.read_rows(rows)
    result = gpu.summarize(mode, measured)
    first = next((r for r in measured if "error" not in r), {})
    result["meta"] = {
        "mode": mode, "jax": first.get("jax"), "backend": "gpu",
        "devices": first.get("devices"), "python": first.get("python"),
        "host_memory_bytes": first.get("host_memory_bytes"),
        "cpu_count": first.get("cpu_count"), "allocator": "system",
        "date": max((r["date"] for r in measured if "date" in r),
                    default=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(
                        max(map(os.path.getmtime, rows))))),
        "rows_from": [os.path.basename(p) for p in rows]}
  _write(out, f"{mode}_throughput.json", result)
  report.write(out, mode)
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                   description=__doc__.split("\n\n")[0])
  group = parser.add_mutually_exclusive_group(required=True)
  group.add_argument("--quick", action="store_const", dest="mode",
                     const="quick", help="small models, some minutes")
  group.add_argument("--full", action="store_const", dest="mode",
                     const="full", help="GPT-2 small/medium memory and "
                     "communication; speed at 1024 tokens per device")
  group.add_argument("--smoke", action="store_const", dest="mode",
                     const="smoke", help="tiny, for the tests")
  group.add_argument("--gpu", action="store_const", dest="mode", const="gpu",
                     help="GPT-2 medium, bf16, on the local GPUs: tokens/s, "
                     "TFLOP/s, MFU and peak memory per variant")
  group.add_argument("--gpu-smoke", action="store_const", dest="mode",
                     const="gpu-smoke", help="--gpu's path on a tiny model "
                     "(CPU), for the tests")
  parser.add_argument("--rows", nargs="+", metavar="FILE",
                      help="with --gpu: write the results of the rows that "
                      "benchmarks/gpu_lease.sh measured (on a lent GPU) "
                      "instead of measuring here")
  parser.add_argument("--out", default=os.path.join("benchmarks", "results"),
                      help="output folder (default: benchmarks/results)")
  parser.add_argument("--system-allocator", action="store_true",
                      help="keep glibc's malloc defaults (by default the run "
                      "restarts itself with a pooled malloc: benchmarks/allocator.py)")
  parser.add_argument("--suites", default=",".join(SUITES),
                      help="comma-separated subset of "
                      f"{','.join(SUITES + EXTRA_SUITES)}")
  args = parser.parse_args(argv)
  suites = tuple(s for s in args.suites.split(",") if s)
  unknown = sorted(set(suites) - set(SUITES + EXTRA_SUITES))
  if unknown:
    parser.error(f"unknown suite(s) {unknown}; use "
                 f"{','.join(SUITES + EXTRA_SUITES)}")
  if args.rows and args.mode not in gpu.PLANS:
    parser.error(f"--rows {' '.join(args.rows)}: rows are --gpu's; add --gpu")
  start = time.time()
  if args.mode in gpu.PLANS:
    written = {"throughput": run_gpu(args.mode, args.out, args.rows)}
  else:
    written = run(args.mode, args.out, suites)
  _log(f"done in {time.time() - start:.0f} s")
  missed = [what for r in written.values() for what, _, _, met in
            r.get("goals", []) if not met]
  for what in missed:
    _log(f"goal missed: {what}")
  return 1 if missed else 0


if __name__ == "__main__":
  sys.exit(main())
