"""Models written as users write them, for the speed suite.

The GPT in `benchmarks.models` was built for the benchmarks: its blocks are
one `nn.scan`, so zerojax sees a few stacked leaves per chunk. These two are
unrolled (a Python loop creating one submodule per block, no `nn.scan`), so
zerojax packs many small leaves into one chunk and every variant runs the
model code as written; at stage 3 the block class is wrapped in
`zerojax.nn.layerwise` (the one line a stage-3 user adds), so each block is
gathered when it is called:

  ResidualMLP   blocks of LayerNorm -> Dense(hidden) -> GELU -> Dense(width)
                with a residual, then a classification head; random
                Gaussian inputs, random labels, softmax cross entropy
                ("mlp-3m": 6 blocks of 256 -> 1024 -> 256, 38 leaves,
                Ψ = 3.16M: one chunk at zerojax's default chunk-size search)
  Transformer   token embedding, pre-LayerNorm causal self-attention + GELU
                MLP blocks, final LayerNorm, output head; next-token cross
                entropy on random tokens ("transformer-6m": 6 blocks of width
                256, 76 leaves, Ψ = 5.79M: two chunks)

Both follow the config protocol described in `benchmarks.models`.
"""
from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from benchmarks.models import LanguageModel


class _UserConfig:
  """What the two configs share: no stacked blocks; the only per-variant
  model code is stage 3's opt-in (`layerwise`, a field of each config)."""
  stacked = ()

  def replace(self, **kw):
    return dataclasses.replace(self, **kw)

  def for_variant(self, name, data):
    del data
    return self.replace(layerwise=name in ("zero-3", "1dev-zero-3"))

  def block(self, cls):
    return zerojax.nn.layerwise(cls) if self.layerwise else cls


# ---- residual MLP -----------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class MLPConfig(_UserConfig):
  width: int = 256
  hidden: int = 1024
  layers: int = 6
  classes: int = 10
  layerwise: bool = False

  @property
  def num_params(self) -> int:
    w, h = self.width, self.hidden
    block = 2 * w + (w * h + h) + (h * w + w)
    return self.layers * block + w * self.classes + self.classes

  def make_model(self) -> "ResidualMLP":
    return ResidualMLP(self)

  def example_input(self):
    return jnp.zeros((1, self.width), jnp.float32)

  def make_loss_fn(self, model: "ResidualMLP"):
    def loss_fn(params, batch):
      logits = model.apply({"params": params}, batch["inputs"])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch["labels"]).mean()
    return loss_fn

  def make_batch(self, batch: int, seq=None, seed: int = 0) -> dict:
    """`batch` Gaussian inputs and random labels (`seq` unused)."""
    del seq
    rng = np.random.default_rng(seed)
    return {"inputs": rng.standard_normal((batch, self.width), np.float32),
            "labels": rng.integers(0, self.classes, batch).astype(np.int32)}


class ResidualBlock(nn.Module):
  hidden: int

  @nn.compact
  def __call__(self, x):
    h = nn.LayerNorm()(x)
    h = nn.gelu(nn.Dense(self.hidden)(h))
    return x + nn.Dense(x.shape[-1])(h)


class ResidualMLP(nn.Module):
  cfg: MLPConfig

  @nn.compact
  def __call__(self, x):
    block = self.cfg.block(ResidualBlock)
    for _ in range(self.cfg.layers):
      x = block(self.cfg.hidden)(x)
    return nn.Dense(self.cfg.classes)(x)


# ---- transformer, one module per block --------------------------------------
@dataclasses.dataclass(frozen=True)
class TransformerConfig(_UserConfig, LanguageModel):
  vocab_size: int = 2048
  width: int = 256
  layers: int = 6
  heads: int = 4
  layerwise: bool = False

  @property
  def num_params(self) -> int:
    d, v = self.width, self.vocab_size
    return v * d + self.layers * block_params(d) + 2 * d + d * v

  def make_model(self) -> "Transformer":
    return Transformer(self)


def block_params(d: int) -> int:
  """Parameters of a pre-LayerNorm GPT block of width `d` with biases."""
  return (2 * 2 * d            # two LayerNorms
          + d * 3 * d + 3 * d  # qkv
          + d * d + d          # attention out
          + d * 4 * d + 4 * d  # mlp in
          + 4 * d * d + d)     # mlp out


class TransformerBlock(nn.Module):
  heads: int

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    hd = d // self.heads
    h = nn.LayerNorm()(x)
    q, k, v = jnp.split(nn.Dense(3 * d)(h).reshape(b, t, 3 * self.heads, hd),
                        3, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(x.dtype)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores,
                       jnp.finfo(scores.dtype).min)
    h = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    x = x + nn.Dense(d)(h.reshape(b, t, d))
    h = nn.gelu(nn.Dense(4 * d)(nn.LayerNorm()(x)))
    return x + nn.Dense(d)(h)


class Transformer(nn.Module):
  """No position embedding: the causal mask orders the tokens (leaves:
  embedding 1 + 12 per block + final LayerNorm 2 + head 1)."""
  cfg: TransformerConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    x = nn.Embed(cfg.vocab_size, cfg.width)(tokens)
    block = cfg.block(TransformerBlock)
    for _ in range(cfg.layers):
      x = block(cfg.heads)(x)
    x = nn.LayerNorm()(x)
    return nn.Dense(cfg.vocab_size, use_bias=False)(x)


CONFIGS = {
    # the test smoke run
    "mlp-tiny": MLPConfig(width=32, hidden=64, layers=2),
    "transformer-tiny": TransformerConfig(vocab_size=64, width=32, layers=2),
    # the speed suite
    "mlp-3m": MLPConfig(),
    "transformer-6m": TransformerConfig(),
}
