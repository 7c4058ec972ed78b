"""The NNX front end against the linen one, on the same models.

The two models of `benchmarks.user_models` (an unrolled residual MLP and an
unrolled transformer) are written a second time in Flax NNX, layer for
layer, and each is trained with zerojax through its front end: the linen
`TrainState` and the NNX module (`zerojax.shard(model, tx=...)`, the loss
taking the module). Per model and stage: the step time of the NNX path over
the linen path (interleaved rounds, `benchmarks.speed.time_variants`; ratios
of medians and of minima), and the persistent bytes per device of both
states (`zerojax.memory_report`), which must be equal: the front end adds
no state. At stage 3 both are opted in to per-block gathering with the
same line (`zerojax.nn.layerwise` on the block class: linen's unrolled
blocks, NNX's `nnx.List` items), and the compiled step's footprint
(`zerojax.compiled_footprint`) of both is reported beside the persistent
bytes.

    python -m benchmarks.run --quick --suites frontends
"""
from __future__ import annotations

import os
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state

import zerojax
from benchmarks import charts
from benchmarks import speed
from benchmarks.user_models import CONFIGS

STAGES = (1, 3)
GOAL = 1.05     # NNX step time / linen step time


class _NnxResidualBlock(nnx.Module):
  def __init__(self, w, h, rngs):
    self.norm = nnx.LayerNorm(w, rngs=rngs)
    self.up, self.down = nnx.Linear(w, h, rngs=rngs), nnx.Linear(h, w, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class _NnxResidualMLP(nnx.Module):
  def __init__(self, cfg, rngs, block=_NnxResidualBlock):
    self.blocks = nnx.List([block(cfg.width, cfg.hidden, rngs)
                            for _ in range(cfg.layers)])
    self.head = nnx.Linear(cfg.width, cfg.classes, rngs=rngs)

  def __call__(self, x):
    for b in self.blocks:
      x = b(x)
    return self.head(x)


class _NnxBlock(nnx.Module):
  def __init__(self, d, heads, rngs):
    self.heads = heads
    self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
    self.qkv = nnx.Linear(d, 3 * d, rngs=rngs)
    self.out = nnx.Linear(d, d, rngs=rngs)
    self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

  def __call__(self, x):
    # the same arithmetic as `user_models.TransformerBlock`
    b, t, d = x.shape
    hd = d // self.heads
    q, k, v = jnp.split(self.qkv(self.norm1(x)).reshape(b, t, 3 * self.heads, hd),
                        3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(x.dtype)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores,
                       jnp.finfo(scores.dtype).min)
    h = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + self.out(h.reshape(b, t, d))
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class _NnxTransformer(nnx.Module):
  def __init__(self, cfg, rngs, block=_NnxBlock):
    self.embed = nnx.Embed(cfg.vocab_size, cfg.width, rngs=rngs)
    self.blocks = nnx.List([block(cfg.width, cfg.heads, rngs)
                            for _ in range(cfg.layers)])
    self.norm = nnx.LayerNorm(cfg.width, rngs=rngs)
    self.head = nnx.Linear(cfg.width, cfg.vocab_size, use_bias=False, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


# per model: the NNX model class and its block class
NNX_MODELS = {"mlp": (_NnxResidualMLP, _NnxResidualBlock),
              "transformer": (_NnxTransformer, _NnxBlock)}


class _Run:
  """A zerojax state and its step, for `speed.time_variants`."""

  def __init__(self, state, loss_fn, batch):
    self.state, self.batch = state, batch
    self.step = zerojax.train_step(loss_fn)
    self.persistent = zerojax.memory_report(state).persistent
    self.footprint = zerojax.compiled_footprint(
        self.step.lower(state, batch).compile())["footprint"]

  def run_once(self):
    self.state, metrics = self.step(self.state, self.batch)
    jax.block_until_ready((self.state, metrics))


def _runs(name: str, stage: int, batch_size: int, seq: int) -> dict:
  """Both front ends' runs; at stage 3 both gather per block."""
  cfg = CONFIGS[name].for_variant(f"zero-{stage}", None)
  batch = cfg.make_batch(batch_size, seq)
  tx = optax.adamw(1e-4)
  model = cfg.make_model()
  params = model.init(jax.random.key(0), cfg.example_input())["params"]
  linen_loss = cfg.make_loss_fn(model)
  key = "mlp" if name.startswith("mlp") else "transformer"
  net, block = NNX_MODELS[key]

  def nnx_loss(module, b):
    if key == "mlp":
      logits, labels = module(b["inputs"]), b["labels"]
    else:
      logits, labels = module(b["tokens"]), b["targets"]
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels).mean()

  return {
      "linen": _Run(zerojax.shard(train_state.TrainState.create(
          apply_fn=model.apply, params=params, tx=tx), stage=stage),
          linen_loss, batch),
      "nnx": _Run(zerojax.shard(net(cfg, nnx.Rngs(0), cfg.block(block)),
                                stage=stage, tx=tx), nnx_loss, batch),
  }


def run(mode: str, log=print) -> dict:
  """{"rows": per model and stage, the step-time ratio NNX / linen and the
  persistent bytes of both; "rounds"}."""
  models = ("mlp-tiny", "transformer-tiny") if mode == "smoke" else (
      "mlp-3m", "transformer-6m")
  rounds = {"smoke": 2, "quick": 7, "full": 15}[mode]
  rows = []
  for name in models:
    for stage in STAGES:
      log(f"frontends: {name} stage {stage}")
      runs = _runs(name, stage, batch_size=64, seq=64)
      _, median, fastest = speed.medians_and_minima(runs, rounds)
      rows.append({
          "model": name, "stage": stage,
          "median_s": median, "min_s": fastest,
          "ratio": median["nnx"] / median["linen"],
          "min_ratio": fastest["nnx"] / fastest["linen"],
          "persistent_bytes": {k: r.persistent for k, r in runs.items()},
          "footprint_bytes": {k: r.footprint for k, r in runs.items()}})
  return {"rows": rows, "rounds": rounds}


def goal_checks(result: dict) -> list:
  """[(what, measured, bound, met)]: NNX within 1.05x of linen (minima),
  the same persistent bytes, and a compiled footprint within 1.05x of
  linen's (rows measured before footprints were recorded have none)."""
  out = []
  for r in result["rows"]:
    out.append((f"NNX / linen step time, zero-{r['stage']} ({r['model']})",
                r["min_ratio"], GOAL, r["min_ratio"] <= GOAL))
    b = r["persistent_bytes"]
    out.append((f"NNX / linen persistent bytes, zero-{r['stage']} "
                f"({r['model']})", b["nnx"] / b["linen"], 1.0,
                b["nnx"] == b["linen"]))
    f = r.get("footprint_bytes")
    if f:
      out.append((f"NNX / linen step footprint, zero-{r['stage']} "
                  f"({r['model']})", f["nnx"] / f["linen"], GOAL,
                  f["nnx"] <= GOAL * f["linen"]))
  return out


# ---- the results page (`benchmarks.report`) ------------------------------
def markdown(r: dict, mode: str) -> list:
  lines = ["### NNX front end against linen", "",
           "The user models written again in Flax NNX, layer for layer "
           "(`benchmarks/frontends.py`), trained through "
           "`zerojax.shard(model, tx=...)` against the linen `TrainState`; "
           f"{r['rounds']} interleaved rounds, batch 64. Run: "
           f"`python -m benchmarks.run --{mode} --suites frontends`.", "",
           "Stage 3 gathers per block in both (`zerojax.nn.layerwise` on "
           "the block class); the footprint is the compiled step's "
           "(`zerojax.compiled_footprint`).", "",
           "| model | stage | NNX / linen (medians) | NNX / linen (minima) | "
           "persistent bytes, linen | NNX | footprint, linen | NNX |",
           "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for row in r["rows"]:
    b, f = row["persistent_bytes"], row.get("footprint_bytes", {})
    lines.append(f"| {row['model']} | {row['stage']} | {row['ratio']:.3f} | "
                 f"{row['min_ratio']:.3f} | {charts.mib(b['linen'])} | "
                 f"{charts.mib(b['nnx'])} | "
                 + " | ".join(charts.mib(f[k]) if k in f else "not measured"
                              for k in ("linen", "nnx")) + " |")
  return lines + ["", f"![frontends]({mode}_frontends.png)", ""]


def plot_frontends(r: dict, path: str):
  fig, ax = charts.plt.subplots(figsize=(6.4, 3.6))
  labels = [f"{row['model']}\nzero-{row['stage']}" for row in r["rows"]]
  ax.bar(labels, [row["min_ratio"] for row in r["rows"]], color="#756bb1")
  ax.axhline(1.0, color="black", linewidth=0.8)
  ax.axhline(1.05, color="#e6550d", linestyle="--", linewidth=0.8,
             label="goal: NNX within 1.05x of linen")
  ax.set_ylabel("step time, NNX / linen (minima)")
  ax.legend(fontsize=8)
  charts.save(fig, path)


def plot(r: dict, out: str, mode: str):
  """This suite's plots of `mode`'s results `r`, written into `out`."""
  plot_frontends(r, os.path.join(out, f"{mode}_frontends.png"))
