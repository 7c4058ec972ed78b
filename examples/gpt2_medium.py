"""GPT-2 in Flax linen, trained with zerojax (ZeRO stage 3 by default).

The job to start first, like DeepSpeed's GPT-2 tutorial or Colossal-AI's
"Train GPT with Gemini". The training loop is an ordinary Flax loop; the ZeRO
part is the `zerojax.create(...)` and `zerojax.train_step(...)` lines.

    python examples/gpt2_medium.py                 # see --help: depends on the machine
    python examples/gpt2_medium.py --preset tiny --steps 3
    python examples/gpt2_medium.py --preset medium --precision bf16 --remat
    python examples/gpt2_medium.py --text input.txt --steps 300   # byte-level text
    python examples/gpt2_medium.py --json run.json               # machine-readable log

Multi-host: one process per host, the same flags everywhere plus
`--coordinator HOST:PORT --num-processes N --process-id I`; under SLURM or
Open MPI with several tasks no flag is needed.

The model (`gpt2.py`) is GPT-2 with its blocks one `flax.linen.scan` under
"blocks", which `Blocks(stacked=("blocks",))` chunks per layer. Parameters
stay float32 (the ZeRO master); the model computes in the dtype it is handed
(`--precision`). The flags and presets are `gpt2_flags.py`'s; the ZeRO
flags become zerojax's options in one place, `zero_options`.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time

# jax reads XLA_FLAGS only when it starts a backend: importing it is safe
# before `simulate_cpu_devices`
import jax
import jax.numpy as jnp
import optax
from tqdm import tqdm

import zerojax
from gpt2 import (GPT, Batches, decay_mask, describe, init_distributed,
                  make_mesh, summarize)
from gpt2_flags import parse_args, resolve


def simulate_cpu_devices(n: int) -> None:
  """Asks XLA for `n` host devices. Only the CPU platform reads this flag,
  and only when jax starts it, so it is set before any device is used; it does
  nothing on a machine whose default backend is a GPU or TPU. The GPU
  compiler's flags (`zerojax._core.compat.GPU_FLAGS`: prefetch of the next
  layer's gather, reduce-scatter beside the backward, matmuls on cuBLAS)
  are set alike; the CPU compiler ignores them."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + f" --xla_force_host_platform_device_count={n}").strip()
  os.environ["XLA_FLAGS"] = zerojax.with_gpu_flags(flags)


def zero_options(args, run: dict, replica_axis, embed_blocks: bool) -> dict:
  """The command line's ZeRO flags as `zerojax.create`'s options, in one
  place."""
  if args.offload == "disk":
    offload = zerojax.Offload("disk", dir=args.offload_dir,
                              sub_group_size=args.sub_group_size)
  elif args.offload == "host":
    offload = zerojax.Offload("host", update_on=args.update_on)
  else:
    offload = None
  return dict(
      stage=args.stage, precision=run["precision"], offload=offload,
      axes=zerojax.Axes(replica=replica_axis, hpz=args.hpz,
                        model="model" if args.tp > 1 else None),
      quantize=zerojax.Quantize(weights=args.quantize_weights,
                                grads=args.quantize_grads,
                                block=args.quantize_block),
      blocks=zerojax.Blocks(stacked=("blocks", "wte") if embed_blocks
                            else ("blocks",)),
      accum_steps=args.accum, clip_norm=args.clip or None)


def main(argv=None) -> dict:
  """Trains and returns {"config", "steps", "memory", "timing"}."""
  args = parse_args(argv)
  simulate_cpu_devices(args.devices)  # in-process callers: only if jax has not started
  init_distributed(args)
  backend, devices = jax.default_backend(), jax.devices()
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)
  if backend == "cpu" and len(devices) != args.devices * jax.process_count():
    log(f"note: {len(devices)} CPU devices (jax had started before "
        f"--devices {args.devices} could apply)")
  cfg, run = resolve(args, backend, len(devices))

  model = GPT(cfg)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, run["lr"], run["warmup"], max(run["steps"], run["warmup"] + 1),
      end_value=run["lr"] / 10)
  tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                   mask=decay_mask)

  def init_fn(rng):
    return model.init(rng, jnp.zeros((1, run["seq"]), jnp.int32))["params"]

  # Sharded initialisation: every device makes only its own chunk shards
  # (the same values as model.init followed by zerojax.shard on a TrainState).
  mesh, replica_axis = make_mesh(args.mesh, devices, args.tp)
  if args.hpz and replica_axis is None:
    raise SystemExit("--hpz shards the state over the replica axis too: "
                     "give --mesh replica=R,data=D as well.")
  state = zerojax.create(init_fn, jax.random.key(args.seed),
                         apply_fn=model.apply, tx=tx, mesh=mesh,
                         **zero_options(args, run, replica_axis,
                                        cfg.embed_blocks))
  if args.resume:
    state = zerojax.checkpoint.restore(args.checkpoint_dir, like=state,
                                       mesh=state.mesh)
    log(f"resumed from {args.checkpoint_dir} at step {int(state.step)}")

  def loss_fn(params, batch):
    return model.apply({"params": params}, batch["tokens"], batch["targets"])

  step = zerojax.train_step(loss_fn)
  # Each process loads only its own rows (process-local batches: the step
  # assembles the global batch): its share of the batch, from its own
  # --text or its own stream of random tokens.
  procs, me = jax.process_count(), jax.process_index()
  data = Batches(cfg.vocab, run["batch"] // procs, run["seq"], args.seed + me,
                 args.text)
  tokens_per_step = run["batch"] * run["seq"]
  config = {**vars(args), **run, "model": dataclasses.asdict(cfg),
            **describe(state, cfg, run, args, data, log)}

  records = []
  first = int(state.step) + 1
  for _ in range(first - 1):
    next(data)  # the batches the resumed run already saw
  bar = tqdm(range(first, run["steps"] + 1), disable=not is_main, unit="step",
             dynamic_ncols=True)
  for i in bar:
    batch = next(data)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    seconds = time.perf_counter() - start
    records.append({"step": i, "loss": loss,
                    "grad_norm": float(metrics["grad_norm"]),
                    "tokens_per_s": tokens_per_step / seconds,
                    "step_time_s": seconds})
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / seconds:,.0f}",
                    step_s=f"{seconds:.3f}")
    if args.checkpoint_dir and (i == run["steps"] or (
        args.save_every and i % args.save_every == 0)):
      zerojax.checkpoint.save(args.checkpoint_dir, state, keep=3)
  bar.close()
  if args.checkpoint_dir:
    zerojax.checkpoint.wait(args.checkpoint_dir)

  timing, memory = summarize(records, state, step, batch, cfg=cfg, run=run,
                             stage=args.stage, data=data, log=log)
  result = {"config": config, "steps": records, "memory": memory,
            "timing": timing}
  if args.json and is_main:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
