"""A LoRA fine-tune at GPT-2 small's width: stage 3 with the base frozen,
against the same model fully trained at stage 3 and a plain `jax.jit`
data-parallel step of the LoRA model (optax with the base's updates set to
zero). The model is written as users write it: unrolled blocks in a Python
loop, `LoRADense` beside each attention and MLP kernel, no zerojax line.

Rows (issue 43): persistent bytes per device against the ideal (the frozen
base in the compute dtype / N, the adapters' fp32 master and Adam moments /
N: `zerojax.estimate_memory(frozen_bytes=...)`), compiled step footprint,
and step time (a LoRA step computes no base-weight gradient, so it must be
cheaper than the full fine-tune's).

    python -m benchmarks.finetune [--steps N] [--layers L] [--out DIR]
    python -m benchmarks.finetune --quality [--seeds 3] [--ft-steps 300]

`--quality` measures what int8 frozen weights cost in loss: the example
`examples/finetune_lora.py` (bf16 compute) fine-tunes one pretrained base
(`examples/gpt2_medium.py`, the `cpu` preset) per seed twice, the base
stored in bf16 and as int8 blocks (`frozen_dtype="int8"`); the goal: the
final held-out loss within 2% of the bf16 base's, every seed.

Step times are medians of steps run round robin in one process, so only
their ratios mean anything.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import time

if __name__ == "__main__":   # before jax starts
  os.environ["XLA_FLAGS"] = " ".join(filter(None, (
      os.environ.get("XLA_FLAGS"),
      "--xla_force_host_platform_device_count=8")))

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

import zerojax  # noqa: E402

DEVICES, WIDTH, HEADS, VOCAB, SEQ, BATCH, RANK = 8, 768, 12, 2048, 128, 16, 8
COMPUTE = jnp.bfloat16


class LoRADense(nn.Module):
  """`nn.Dense` plus a rank-`RANK` update `x @ lora_a @ lora_b`."""
  features: int

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    kernel = self.param("kernel", nn.initializers.normal(0.02),
                        (d, self.features))
    bias = self.param("bias", nn.initializers.zeros, (self.features,))
    a = self.param("lora_a", nn.initializers.normal(1 / math.sqrt(d)),
                   (d, RANK))
    b = self.param("lora_b", nn.initializers.zeros, (RANK, self.features))
    x, kernel, bias, a, b = nn.dtypes.promote_dtype(x, kernel, bias, a, b)
    return x @ kernel + bias + (x @ a) @ b


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    y = nn.LayerNorm()(x)
    q, k, v = jnp.split(LoRADense(3 * d, name="qkv")(y), 3, axis=-1)
    q, k, v = (z.reshape(b, t, HEADS, d // HEADS) for z in (q, k, v))
    y = jax.nn.dot_product_attention(q, k, v, is_causal=True).reshape(b, t, d)
    x = x + LoRADense(d, name="proj")(y)
    y = nn.gelu(LoRADense(4 * d, name="fc")(nn.LayerNorm()(x)))
    return x + LoRADense(d, name="out")(y)


class LoRAGPT(nn.Module):
  layers: int

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(VOCAB, WIDTH, name="wte")
    x = embed(tokens) + self.param("wpe", nn.initializers.normal(0.01),
                                   (SEQ, WIDTH))
    for i in range(self.layers):
      x = Block(name=f"h_{i}")(x)
    return embed.attend(nn.LayerNorm()(x)).astype(jnp.float32)


def is_frozen(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: path[-1].key not in ("lora_a", "lora_b"), params)


def _problem(layers: int):
  model = LoRAGPT(layers)
  rng = np.random.default_rng(0)
  tokens = rng.integers(0, VOCAB, (BATCH, SEQ + 1)).astype(np.int32)
  batch = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:]}
  params = jax.jit(model.init)(jax.random.key(0), batch["tokens"][:1])["params"]

  def loss_fn(params, b):
    logits = model.apply({"params": params}, b["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b["targets"]).mean()
  return model, params, batch, loss_fn


def build(layers: int) -> dict:
  """{setting: (step(), persistent bytes, compiled footprint)}."""
  model, params, batch, loss_fn = _problem(layers)
  tx = optax.adam(1e-4)
  mesh = jax.make_mesh((DEVICES,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  out = {}
  for label, frozen in (("zero-3 LoRA", is_frozen), ("zero-3 full", None)):
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx), stage=3, mesh=mesh,
        frozen=frozen, precision="bfloat16")
    step = zerojax.train_step(loss_fn)
    compiled = step.lower(state, batch).compile()
    holder = {"state": state}

    def run(step=step, holder=holder):
      holder["state"], metrics = step(holder["state"], batch)
      jax.block_until_ready(metrics)
    report = zerojax.memory_report(state)
    out[label] = (run, report.persistent,
                  zerojax.compiled_footprint(compiled)["footprint"],
                  report.estimate["persistent"])
  # plain jax.jit data parallelism of the LoRA model: replicated, the
  # base's updates zeroed, the forward in bf16 (the fp32 master kept)
  labels = jax.tree_util.tree_map(lambda f: "frozen" if f else "train",
                                  is_frozen(params))
  plain_tx = optax.multi_transform({"train": tx,
                                    "frozen": optax.set_to_zero()}, labels)
  rep = NamedSharding(mesh, P())
  data = NamedSharding(mesh, P("data"))
  plain = jax.device_put(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=plain_tx), rep)

  def plain_step(state, b):
    cast = lambda p: jax.tree_util.tree_map(lambda x: x.astype(COMPUTE), p)
    loss, grads = jax.value_and_grad(lambda p: loss_fn(cast(p), b))(
        state.params)
    return state.apply_gradients(grads=grads), loss
  jitted = jax.jit(plain_step, in_shardings=(rep, data),
                   out_shardings=(rep, rep), donate_argnums=(0,))
  placed = jax.device_put(batch, data)
  compiled = jitted.lower(plain, placed).compile()
  holder = {"state": plain}

  def run_plain():
    holder["state"], loss = compiled(holder["state"], placed)
    jax.block_until_ready(loss)
  out["plain jit LoRA"] = (run_plain, zerojax._state.memory.per_device_bytes(plain),
                           zerojax.compiled_footprint(compiled)["footprint"],
                           None)
  return out


def measure(layers: int, steps: int) -> list:
  built = build(layers)
  times = {label: [] for label in built}
  for i in range(steps + 2):
    for label, (run, *_) in built.items():
      t = time.perf_counter()
      run()
      if i >= 2:   # the first two: compile, warm-up
        times[label].append(time.perf_counter() - t)
  return [{"setting": label, "layers": layers, "persistent": persistent,
           "ideal": ideal, "footprint": footprint,
           "step_s": float(np.median(times[label])), "steps": steps}
          for label, (_, persistent, footprint, ideal) in built.items()]


def write(rows: list, out: str, meta: dict) -> str:
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  by = {r["setting"]: r for r in rows}
  lora, full, plain = (by[k] for k in ("zero-3 LoRA", "zero-3 full",
                                       "plain jit LoRA"))
  mib = lambda b: f"{b / 2 ** 20:,.1f}"
  table = ["| setting | persistent MiB | ideal MiB | compiled step MiB | "
           "step ms |", "|---|---:|---:|---:|---:|"] + [
               f"| {r['setting']} | {mib(r['persistent'])} | "
               f"{mib(r['ideal']) if r['ideal'] else '-'} | "
               f"{mib(r['footprint'])} | {1e3 * r['step_s']:,.1f} |"
               for r in rows]
  goals = [
      ("LoRA persistent / ideal", lora["persistent"] / lora["ideal"], 1.10),
      ("LoRA step time / full fine-tune's", lora["step_s"] / full["step_s"],
       1.0),
      ("LoRA persistent / plain jit LoRA's",
       lora["persistent"] / plain["persistent"], None),
      ("LoRA step time / plain jit LoRA's", lora["step_s"] / plain["step_s"],
       None)]
  goal_rows = ["| row | measured | target |", "|---|---:|---:|"] + [
      f"| {g} | {v:.3f} | {'' if t is None else f'<= {t:.2f}'} |"
      for g, v, t in goals]
  text = "\n".join([
      "# A LoRA fine-tune at GPT-2 small's width", "",
      f"`python -m benchmarks.finetune`, {meta['date']}, jax {meta['jax']}, "
      f"{DEVICES} simulated CPU devices, {lora['layers']} unrolled blocks "
      f"of width {WIDTH} ({HEADS} heads), vocabulary {VOCAB}, rank-{RANK} "
      f"adapters beside every attention and MLP kernel, {BATCH} x {SEQ} "
      "tokens, bf16 compute, Adam. `zero-3 LoRA`: everything but the "
      "adapters frozen (stored in bf16, split over the devices, gathered "
      "per block); `zero-3 full`: the same model with every leaf trained; "
      "`plain jit LoRA`: `jax.jit` data parallelism, replicated, optax with "
      "the base's updates set to zero. Step times: medians, round robin in "
      "one process (ratios only).", "", *goal_rows, "", *table, "",
      "![finetune](finetune.png)", ""])
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "finetune.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "finetune.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  names = [r["setting"] for r in rows]
  axes[0].barh(names, [r["persistent"] / 2 ** 20 for r in rows])
  axes[0].set_xlabel("persistent MiB per device")
  axes[1].barh(names, [1e3 * r["step_s"] for r in rows])
  axes[1].set_xlabel("step ms (CPU, ratios only)")
  fig.tight_layout()
  fig.savefig(os.path.join(out, "finetune.png"), dpi=110)
  return text


def quality(seeds: int, steps: int, base_steps: int) -> list:
  """Per seed and frozen dtype, the example's losses (see the docstring)."""
  import sys
  import tempfile
  examples = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
  sys.path.insert(0, os.path.abspath(examples))
  import finetune_lora
  import gpt2_medium
  base = tempfile.mkdtemp(prefix="zerojax_quality_base_")
  gpt2_medium.main(["--preset", "cpu", "--steps", str(base_steps),
                    "--checkpoint-dir", base])
  rows = []
  for seed in range(seeds):
    for dtype in ("bf16", "int8"):
      out = finetune_lora.main(
          ["--base", base, "--preset", "cpu", "--steps", str(steps),
           "--precision", "bf16", "--seed", str(seed)]
          + (["--frozen-dtype", "int8"] if dtype == "int8" else []))
      tail = [r["loss"] for r in out["steps"][-20:]]
      rows.append({"seed": seed, "frozen": dtype,
                   "loss_before": out["loss_before"],
                   "loss_after": out["loss_after"],
                   "train_loss_last20": float(np.mean(tail)),
                   "frozen_mib": out["memory_per_device"]["frozen base"]
                   / 2 ** 20})
  return rows


def write_quality(rows: list, out: str, meta: dict) -> str:
  by = {(r["seed"], r["frozen"]): r for r in rows}
  seeds = sorted({r["seed"] for r in rows})
  lines = ["| seed | held-out loss, bf16 base | int8 base | int8 / bf16 | "
           "frozen MiB per device, bf16 / int8 |", "|---:|---:|---:|---:|---:|"]
  worst = 0.0
  for s in seeds:
    a, b = by[s, "bf16"], by[s, "int8"]
    ratio = b["loss_after"] / a["loss_after"]
    worst = max(worst, abs(ratio - 1))
    lines.append(f"| {s} | {a['loss_after']:.4f} | {b['loss_after']:.4f} | "
                 f"{ratio:.4f} | {a['frozen_mib']:.3f} / "
                 f"{b['frozen_mib']:.3f} |")
  text = "\n".join([
      "# What an int8 frozen base costs in loss", "",
      f"`python -m benchmarks.finetune --quality`, {meta['date']}, jax "
      f"{meta['jax']}: `examples/finetune_lora.py` (preset `cpu`, bf16 "
      f"compute, {meta['steps']} steps, rank 8) on one base pretrained by "
      f"`examples/gpt2_medium.py` ({meta['base_steps']} steps), per seed "
      "with the base in bf16 and as int8 blocks. Goal: every seed's final "
      f"held-out loss within 2% of the bf16 base's; worst "
      f"{100 * worst:.2f}% ({'met' if worst <= 0.02 else 'NOT met'}).", "",
      *lines, ""])
  os.makedirs(out, exist_ok=True)
  with open(os.path.join(out, "finetune_int8.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "finetune_int8.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  return text


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=6)
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--quality", action="store_true")
  parser.add_argument("--seeds", type=int, default=3)
  parser.add_argument("--ft-steps", type=int, default=300)
  parser.add_argument("--base-steps", type=int, default=200)
  parser.add_argument("--out", default=os.path.join(
      os.path.dirname(__file__), "results"))
  args = parser.parse_args()
  meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime(
      "%Y-%m-%d %H:%M UTC"), "jax": jax.__version__}
  if args.quality:
    meta.update(steps=args.ft_steps, base_steps=args.base_steps)
    print(write_quality(quality(args.seeds, args.ft_steps, args.base_steps),
                        args.out, meta))
    return
  rows = measure(args.layers, args.steps)
  print(write(rows, args.out, meta))


if __name__ == "__main__":
  main()
