"""The command line of examples/gpt2_medium.py: the presets, the flags, and
the model and run settings they resolve to (`resolve`)."""
from __future__ import annotations

import argparse

from gpt2 import BYTE_VOCAB, GPTConfig

PRESETS = {
    # name: model shape, and the run defaults used when a flag is left out.
    "tiny": dict(layers=2, width=64, heads=4, vocab=256, ctx=64,
                 micro_batch=2, seq=64, steps=50, lr=3e-3),
    # (its lr: docs/decisions.md, "The CPU example's learning rate")
    "cpu": dict(layers=4, width=128, heads=2, vocab=256, ctx=128,
                micro_batch=2, seq=128, steps=100, lr=1e-3),
    "small": dict(layers=12, width=768, heads=12, vocab=50257, ctx=1024,
                  micro_batch=8, seq=1024, steps=100, lr=6e-4),
    "medium": dict(layers=24, width=1024, heads=16, vocab=50257, ctx=1024,
                   micro_batch=8, seq=1024, steps=100, lr=3e-4),
}

_HELP = """GPT-2 in Flax linen, trained with zerojax (ZeRO stage 3 by default).

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
  add("--seed", type=int, default=0,
      help="seed of the initial parameters and of the data")
  add("--text", metavar="FILE", help="train on this file's bytes (default: "
      "random tokens from a Zipf law, whose entropy is printed); several "
      "processes: each reads its own, its part of the data")
  add("--json", metavar="PATH", help="write config, metrics and memory here")
  add("--devices", type=int, default=8,
      help="without an accelerator: simulated CPU devices")
  add("--coordinator", metavar="HOST:PORT", help="multi-host: process 0")
  add("--num-processes", type=int, help="multi-host: how many processes")
  add("--process-id", type=int, help="multi-host: this process's number, "
      "0 to --num-processes - 1")
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
