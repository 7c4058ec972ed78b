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
(`--precision`). The ZeRO flags become zerojax's options in one place,
`zero_options`.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time


# ---- configuration (no jax here: the CPU device count must be set first) ----
PRESETS = {
    # name: model shape, and the run defaults used when a flag is left out.
    "tiny": dict(layers=2, width=64, heads=4, vocab=256, ctx=64,
                 micro_batch=2, seq=64, steps=50, lr=3e-3),
    "cpu": dict(layers=4, width=128, heads=2, vocab=256, ctx=128,
                micro_batch=2, seq=128, steps=100, lr=2e-3),
    "small": dict(layers=12, width=768, heads=12, vocab=50257, ctx=1024,
                  micro_batch=8, seq=1024, steps=100, lr=6e-4),
    "medium": dict(layers=24, width=1024, heads=16, vocab=50257, ctx=1024,
                   micro_batch=8, seq=1024, steps=100, lr=3e-4),
}

_HELP = __doc__.split("\n\n")[0] + """

Defaults depend on the machine. On a GPU/TPU the default preset is `medium`
(GPT-2 medium, 355M) in bf16. With no accelerator it is `cpu`: GPT-2's
layout shrunk to 4 layers of width 128, a byte-sized vocabulary (256) and
128-token windows, trained in float32 on 8 simulated CPU devices for 100
steps, so that the default run takes about two minutes on a 2-core machine
and shows the loss falling. (GPT-2's 50257-token output layer alone would
make a CPU step several seconds.)
"""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
  add = p.add_argument
  add("--preset", choices=["auto", *PRESETS], default="auto",
      help="tiny (CI), cpu (default without an accelerator), small (124M), "
      "medium (355M, default on GPU/TPU)")
  add("--layers", type=int, help="override the preset's depth")
  add("--width", type=int, help="override its width (heads: width // 64)")
  add("--remat", action="store_true",
      help="with --no-layerwise: nn.remat each block")
  add("--no-layerwise", dest="layerwise", action="store_false",
      help="do not wrap the block in zerojax.nn.layerwise")
  add("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
  add("--precision", choices=["auto", "fp32", "bf16", "fp16"], default="auto",
      help="compute dtype (the master stays fp32); auto: bf16 on GPU/TPU")
  add("--batch", type=int, help="global batch in sequences (default: the "
      "preset's micro-batch x devices x --accum)")
  add("--seq", type=int, help="tokens per sequence (default: the preset's)")
  add("--steps", type=int, help="optimizer steps (default: the preset's)")
  add("--accum", type=int, default=1, help="micro-batches per step")
  add("--lr", type=float, help="peak learning rate; warm-up, cosine to lr/10")
  add("--warmup", type=int, help="warm-up steps (default: 10%% of --steps)")
  add("--weight-decay", type=float, default=0.1,
      help="AdamW decay on kernels and embeddings")
  add("--clip", type=float, default=1.0, help="global-norm clip; 0: none")
  add("--seed", type=int, default=0)
  add("--text", metavar="FILE", help="train on this file's bytes (default: "
      "random tokens from a Zipf law, whose entropy is printed)")
  add("--json", metavar="PATH", help="write config, metrics and memory here")
  add("--devices", type=int, default=8,
      help="without an accelerator: simulated CPU devices")
  add("--coordinator", metavar="HOST:PORT", help="multi-host: process 0")
  add("--num-processes", type=int)
  add("--process-id", type=int)
  add("--mesh", metavar="replica=R,data=D", help="hybrid sharding: the "
      "stage shards over data (a node's GPUs), replicates over replica")
  add("--tp", type=int, default=1, metavar="M", help="tensor parallelism: "
      "heads and MLP split over a 'model' axis of M devices")
  add("--embed-blocks", type=int, default=0, metavar="K", help="the tied "
      "embedding as a zerojax.nn.BlockedEmbed of K vocabulary blocks")
  add("--attention", choices=["auto", "einsum", "cudnn"], default="auto",
      help="cudnn: flash attention (NVIDIA GPU, half precision); auto: "
      "cudnn where it can run")
  add("--hpz", action="store_true", help="with --mesh: ZeRO++ hpZ")
  add("--quantize-weights", choices=["int8", "int4"], help="ZeRO++ qwZ")
  add("--quantize-grads", choices=["int8", "int4"], help="ZeRO++ qgZ")
  add("--quantize-block", type=int, default=256,
      help="elements per quantization block")
  add("--offload", nargs="?", const="host", choices=["host", "disk"],
      help="ZeRO-Offload: optimizer state in pinned host memory (host), or "
      "in files under --offload-dir (disk, ZeRO-Infinity)")
  add("--offload-dir", metavar="DIR", help="with --offload disk: a local "
      "disk's directory for its files")
  add("--sub-group-size", type=int, metavar="N", help="with --offload disk: "
      "stream N elements of a shard at a time")
  add("--update-on", choices=["device", "host"], help="with --offload host: "
      "where the offloaded update runs")
  add("--checkpoint-dir", metavar="DIR", help="save orbax checkpoints here")
  add("--save-every", type=int, default=0, help="steps between checkpoints "
      "(0: only at the end)")
  add("--resume", action="store_true",
      help="continue from the newest checkpoint in --checkpoint-dir")
  args = p.parse_args(argv)
  if args.resume and not args.checkpoint_dir:
    p.error("--resume needs --checkpoint-dir")
  if args.update_on == "host" and not args.offload:
    p.error("--update-on host runs the update where --offload keeps the "
            "optimizer state; add --offload")
  if args.offload == "disk" and not args.offload_dir:
    p.error("--offload disk keeps the optimizer state in files; add "
            "--offload-dir DIR (an existing directory on a local disk)")
  if args.offload_dir and args.offload != "disk":
    p.error("--offload-dir is where --offload disk keeps its files; add "
            "--offload disk")
  if args.sub_group_size is not None and args.offload != "disk":
    p.error("--sub-group-size sets how --offload disk streams its files; "
            "add --offload disk")
  if args.offload == "disk" and args.update_on == "device":
    p.error("--offload disk updates on the host as the state streams from "
            "disk; drop --update-on device")
  if (args.coordinator is None) != (args.num_processes is None) or (
      args.coordinator is None) != (args.process_id is None):
    p.error("multi-host needs all of --coordinator, --num-processes and "
            "--process-id (or none of them)")
  for name in ("layers", "width", "batch", "seq", "steps", "accum", "devices",
               "warmup", "quantize_block", "tp"):
    value = getattr(args, name)
    if value is not None and value < (0 if name == "warmup" else 1):
      p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
  return args


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


# (imports jax, which reads XLA_FLAGS only when it starts a backend)
import zerojax  # noqa: E402

if __name__ == "__main__":
  simulate_cpu_devices(parse_args().devices)

# pylint: disable=wrong-import-position
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

from gpt2 import (BYTE_VOCAB, GPT, Batches, GPTConfig, decay_mask,  # noqa: E402
                  describe, init_distributed, make_mesh, summarize)


def resolve(args, backend: str, n_devices: int) -> tuple:
  """(GPTConfig, run settings) from the preset and the flags."""
  accel = backend != "cpu"
  name = args.preset if args.preset != "auto" else ("medium" if accel else "cpu")
  pre = PRESETS[name]
  width = args.width or pre["width"]
  heads = pre["heads"] if args.width is None else max(1, width // 64)
  if width % heads:
    raise SystemExit(f"--width {width} is not divisible by {heads} heads.")
  if n_devices % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the {n_devices} devices.")
  if args.embed_blocks < 0:
    raise SystemExit(f"--embed-blocks must be 0 (nn.Embed) or a number of "
                     f"vocabulary blocks, got {args.embed_blocks}.")
  if heads % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the {heads} heads: "
                     "each model device computes whole heads.")
  vocab = BYTE_VOCAB if args.text else pre["vocab"]
  if args.embed_blocks > vocab:
    raise SystemExit(f"--embed-blocks {args.embed_blocks} is more than the "
                     f"{vocab} words: give at most one block per word.")
  seq = args.seq or min(pre["seq"], pre["ctx"])
  precision = (args.precision if args.precision != "auto"
               else ("bf16" if accel else "fp32"))
  attention = args.attention
  if attention == "auto":
    attention = ("cudnn" if backend == "gpu" and precision != "fp32"
                 else "einsum")
  elif attention == "cudnn" and (backend != "gpu" or precision == "fp32"):
    raise SystemExit(f"--attention cudnn needs an NVIDIA GPU and --precision "
                     f"bf16 or fp16 (here: {backend}, {precision}); use "
                     "--attention einsum.")
  cfg = GPTConfig(vocab=vocab, ctx=max(pre["ctx"], seq),
                  layers=args.layers or pre["layers"], width=width, heads=heads,
                  remat=args.remat, layerwise=args.layerwise, tp=args.tp,
                  embed_blocks=args.embed_blocks, attention=attention)
  steps = args.steps or pre["steps"]
  batch = args.batch or pre["micro_batch"] * n_devices * args.accum
  data = n_devices // args.tp   # the devices a batch is split over
  if batch % (data * args.accum):
    raise SystemExit(f"--batch {batch} must be a multiple of {data} "
                     f"data devices x --accum {args.accum}.")
  run = dict(
      preset=name, seq=seq, steps=steps, batch=batch,
      lr=args.lr or pre["lr"],
      warmup=args.warmup if args.warmup is not None else max(1, steps // 10),
      precision=precision)
  return cfg, run


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
  data = Batches(cfg.vocab, run["batch"], run["seq"], args.seed, args.text)
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
