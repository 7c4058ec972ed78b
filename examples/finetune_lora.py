"""LoRA fine-tuning with zerojax: the GPT-2 of examples/gpt2_medium.py, its
attention and MLP kernels given low-rank adapters, the pretrained base frozen.

    python examples/finetune_lora.py                   # pretrains a small base first
    python examples/gpt2_medium.py --text base.txt --checkpoint-dir /tmp/base
    python examples/finetune_lora.py --base /tmp/base --text finetune.txt --steps 300

The three lines that make it a zerojax fine-tune:

  * `zerojax.checkpoint.restore(base, like=lora_state, frozen=...)`: the
    pretrained checkpoint read into the model with adapters (any device
    count or stage); the adapters keep their fresh values.
  * `frozen=`: every leaf but the adapters. Frozen weights are stored once
    in the compute dtype (`--frozen-dtype int8`: matrices as int8 blocks),
    split over the devices at stage 3 and gathered layer by layer; they
    get no gradient and no optimizer state.
  * `train_step(loss_fn, weighted=True)`: `loss_fn` returns the summed token
    loss and the token count of its slice, so the loss is the mean over all
    tokens of the global batch however the padding falls across devices.

Sequences are padded: each is a line of the text (or, without --text, a run
of random tokens of random length), cut to --seq and padded with a mask.
The base must come from a gpt2_medium.py run with the same --preset and
--text / no --text (the vocabulary follows it).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
# (jax reads the device count only when it starts a backend: in main)
import gpt2_flags  # noqa: E402
import gpt2_medium  # noqa: E402
from gpt2 import GPT  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--base", metavar="DIR", help="a checkpoint directory of "
                 "examples/gpt2_medium.py (--checkpoint-dir); default: "
                 "pretrain one for --base-steps first, in a temporary "
                 "directory")
  p.add_argument("--base-steps", type=int, default=30,
                 help="without --base: steps of the pretraining run")
  p.add_argument("--preset", choices=["auto", *gpt2_flags.PRESETS],
                 default="auto",
                 help="the base's preset (default: cpu here, medium on a GPU)")
  p.add_argument("--text", metavar="FILE", help="fine-tune on this file's "
                 "lines, as bytes (the base must be byte-level too)")
  p.add_argument("--rank", type=int, default=8, help="LoRA rank")
  p.add_argument("--steps", type=int, default=100,
                 help="fine-tuning steps (default: 100)")
  p.add_argument("--lr", type=float, default=3e-3,
                 help="peak learning rate of the adapters: warm-up over a "
                 "tenth of --steps, cosine to lr/10 (default: 3e-3)")
  p.add_argument("--stage", type=int, default=3, choices=[1, 2, 3],
                 help="ZeRO stage (default: 3)")
  p.add_argument("--precision", choices=["auto", "fp32", "bf16"],
                 default="auto", help="auto: bf16 on GPU/TPU, fp32 on CPU")
  p.add_argument("--frozen-dtype", choices=["int8"], help="store the frozen "
                 "base's matrices as int8 blocks (QLoRA-style memory); "
                 "default: in the compute dtype")
  p.add_argument("--batch", type=int, help="global batch in sequences "
                 "(default: 4 per device)")
  p.add_argument("--seq", type=int, help="tokens per sequence (default: the "
                 "preset's)")
  p.add_argument("--devices", type=int, default=8, help="without an "
                 "accelerator: simulate this many CPU devices")
  p.add_argument("--seed", type=int, default=0,
                 help="seed of the adapters' initial values and of the data "
                 "(default: 0)")
  p.add_argument("--json", metavar="PATH", help="write losses and memory")
  args = p.parse_args(argv)
  for name in ("rank", "steps", "base_steps", "batch", "seq", "devices"):
    value = getattr(args, name)
    if value is not None and value < 1:
      p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
  return args


def pretrain(args, directory: str) -> None:
  """A base checkpoint: examples/gpt2_medium.py run for --base-steps."""
  flags = ["--preset", args.preset, "--steps", str(args.base_steps),
           "--checkpoint-dir", directory, "--devices", str(args.devices),
           "--seed", str(args.seed)]
  if args.text:
    flags += ["--text", args.text]
  if args.seq:
    flags += ["--seq", str(args.seq)]
  gpt2_medium.main(flags)


class PaddedBatches:
  """Global batches {"tokens", "targets", "mask"} of [batch, seq]: each row
  one sequence of its own length, padded with zeros (mask 0)."""

  def __init__(self, vocab: int, batch: int, seq: int, seed: int, text=None):
    self.batch, self.seq, self.vocab = batch, seq, vocab
    self.rng = np.random.default_rng(seed)
    self.lines = None
    if text is not None:
      with open(text, "rb") as f:
        self.lines = [np.frombuffer(line, np.uint8).astype(np.int32)
                      for line in f.read().splitlines() if len(line) > 1]
      if not self.lines:
        raise SystemExit(f"--text {text} has no line of two bytes or more.")

  def _sequence(self) -> np.ndarray:
    if self.lines is not None:
      return self.lines[self.rng.integers(len(self.lines))][:self.seq + 1]
    # a repeating pattern of random length: something a small model can learn
    period = self.rng.integers(2, 9)
    length = self.rng.integers(self.seq // 8 + 2, self.seq + 2)
    pattern = self.rng.integers(0, self.vocab, period)
    return np.resize(pattern, length).astype(np.int32)

  def __next__(self) -> dict:
    tokens = np.zeros((self.batch, self.seq + 1), np.int32)
    mask = np.zeros((self.batch, self.seq), np.float32)
    for row in range(self.batch):
      s = self._sequence()
      tokens[row, :len(s)] = s
      mask[row, :len(s) - 1] = 1.0
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": mask}


def is_frozen(params):
  """Everything but the LoRA adapters."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) not in ("lora_a",
                                                             "lora_b"), params)


def main(argv=None) -> dict:
  args = parse_args(argv)
  gpt2_medium.simulate_cpu_devices(args.devices)
  backend, devices = jax.default_backend(), jax.devices()
  base = args.base
  if base is None:
    base = tempfile.mkdtemp(prefix="zerojax_lora_base_")
    print(f"no --base: pretraining one for {args.base_steps} steps in {base}")
    pretrain(args, base)
  # the base's model, as gpt2_medium.py resolves it, with adapters added
  flags = ["--preset", args.preset] + (["--text", args.text] if args.text
                                       else [])
  cfg, run = gpt2_flags.resolve(gpt2_flags.parse_args(flags + (
      ["--seq", str(args.seq)] if args.seq else [])), backend, len(devices))
  cfg = dataclasses.replace(cfg, lora_rank=args.rank)
  precision = args.precision if args.precision != "auto" else run["precision"]
  compute_dtype = {"fp32": "float32", "bf16": "bfloat16"}[precision]
  seq, batch = run["seq"], args.batch or 4 * len(devices)
  model = GPT(cfg)
  tx = optax.adamw(optax.warmup_cosine_decay_schedule(
      0.0, args.lr, max(1, args.steps // 10), args.steps + 1,
      end_value=args.lr / 10), weight_decay=0.0)
  params = jax.jit(model.init)(jax.random.key(args.seed),
                               jnp.zeros((1, seq), jnp.int32))["params"]
  lora = train_state.TrainState.create(apply_fn=model.apply,
                                            params=params, tx=tx)
  state = zerojax.checkpoint.restore(base, like=lora, stage=args.stage,
                                     frozen=is_frozen,
                                     frozen_dtype=args.frozen_dtype,
                                     precision=compute_dtype)
  num_params = sum(int(x.size) for x in jax.tree_util.tree_leaves(params))
  base_leaves = sum(jax.tree_util.tree_leaves(is_frozen(params)))
  leaves = len(jax.tree_util.tree_leaves(params))
  print(f"restored the base from {base}: {base_leaves} of {leaves} "
        f"parameters; the {leaves - base_leaves} adapters start from their "
        "initial values")
  del params, lora

  def loss_fn(params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    losses = optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), batch["targets"])
    return (losses * batch["mask"]).sum(), batch["mask"].sum()

  step = zerojax.train_step(loss_fn, weighted=True)
  evaluate = zerojax.eval_step(loss_fn, weighted=True)
  data = PaddedBatches(cfg.vocab, batch, seq, args.seed + 1, args.text)
  held_out = next(PaddedBatches(cfg.vocab, batch, seq, args.seed + 2,
                                args.text))
  before = float(evaluate(state, held_out))
  report = zerojax.memory_report(state)
  per_device = {name: sum(report.measured[cat].values())
                for name, cat in (("frozen base", "frozen weights"),
                                  ("adapters (master)", "master parameters"),
                                  ("optimizer state", "optimizer state"))}
  print(f"LoRA rank {args.rank} on GPT-2 '{run['preset']}' ({cfg.layers} "
        f"layers x {cfg.width}): {state.layout.num_chunked_elements:,} "
        f"trained parameters; ZeRO stage {args.stage} over {len(devices)} "
        f"{backend} devices, {precision}; batch {batch} x {seq} tokens, "
        f"padded (mask)")
  print("per device: " + ", ".join(f"{k} {v / 2 ** 20:,.2f} MiB"
                                   for k, v in per_device.items()))
  records = []
  bar = tqdm(range(1, args.steps + 1), unit="step", dynamic_ncols=True)
  for i in bar:
    start = time.perf_counter()
    state, metrics = step(state, next(data))
    loss = float(metrics["loss"])
    records.append({"step": i, "loss": loss,
                    "step_time_s": time.perf_counter() - start})
    bar.set_postfix(loss=f"{loss:.4f}")
  bar.close()
  after = float(evaluate(state, held_out))
  print(f"held-out loss per token: {before:.4f} before, {after:.4f} after "
        f"{args.steps} steps")
  result = {"config": {**vars(args), "model": dataclasses.asdict(cfg),
                       "batch": batch, "seq": seq, "precision": precision,
                       "devices": len(devices)},
            "params": {"trained": state.layout.num_chunked_elements,
                       "frozen": num_params
                                 - state.layout.num_chunked_elements},
            "steps": records, "loss_before": before, "loss_after": after,
            "memory_per_device": per_device, "report": str(report)}
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
