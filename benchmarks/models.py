"""A GPT-2-style Flax linen model for the benchmarks, its configs and loss.

Pre-LayerNorm blocks (causal self-attention, GELU MLP), learned positions,
output tied to the token embedding. The blocks are one `nn.scan` under the
submodule "blocks" (parameters stacked on a leading layer axis), so zerojax
gets `stacked=("blocks",)` and GSPMD sees one while loop over layers; with
`scan=False` they are called one by one as `blocks_0`, `blocks_1`, ... (the
unrolled model a user writes; zerojax finds the blocks by their names).

Every benchmark model is a frozen config dataclass that `benchmarks.variants`
builds from through the same members (`GPTConfig` here, the models written as
users write them in `benchmarks.user_models`):

  num_params             Ψ, counted from the shapes
  stacked                `ZeroConfig.stacked` for this model
  make_model()           the Flax module
  example_input()        what `make_model().init` is called with
  make_loss_fn(model)    loss(params, batch), on the full parameter tree
  make_batch(b, seq, s)  a random batch of b rows (host numpy arrays)
  for_variant(name, d)   the config as the model code of variant `name` is
                         written (d: the batch sharding)
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding

import zerojax


class LanguageModel:
  """Input, loss and batch of a config whose model maps tokens to next-token
  logits (the config has a `vocab_size` field)."""

  def example_input(self):
    return jnp.zeros((1, 8), jnp.int32)

  def make_loss_fn(self, model: nn.Module):
    """Mean next-token cross entropy, written on the full parameter tree;
    with a `loss_block`, of the hidden states and the tied embedding by
    `zerojax.losses.linear_cross_entropy` (no logits in memory)."""
    block = getattr(self, "loss_block", None)
    blocked = getattr(self, "embed_blocks", None)

    def loss_fn(params, batch):
      if blocked:   # the model's BlockedEmbed gives the per-token losses
        return model.apply({"params": params}, batch["tokens"],
                           batch["targets"]).mean()
      if block:
        hidden = model.apply({"params": params}, batch["tokens"])
        return zerojax.losses.linear_cross_entropy(
            hidden, params["wte"]["embedding"], batch["targets"],
            block_size=block).mean()
      logits = model.apply({"params": params}, batch["tokens"])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits.astype(jnp.float32), batch["targets"]).mean()
    return loss_fn

  def make_batch(self, batch: int, seq: int, seed: int = 0) -> dict:
    """A random token batch (host numpy arrays), `seq` tokens per row."""
    rng = np.random.default_rng(seed)
    t = rng.integers(0, self.vocab_size, size=(batch, seq + 1))
    return {"tokens": t[:, :-1].astype(np.int32),
            "targets": t[:, 1:].astype(np.int32)}


@dataclasses.dataclass(frozen=True)
class GPTConfig(LanguageModel):
  """Model shape. `activation_sharding` (GSPMD runs only) pins the
  activations between blocks to this sharding (batch over the data axis), as
  MaxText's logical constraints do; inside zerojax's shard_map it stays None."""
  vocab_size: int = 50257
  max_len: int = 1024
  width: int = 768
  layers: int = 12
  heads: int = 12
  activation_sharding: Optional[NamedSharding] = None
  # zerojax stage 3: gather each layer right before use (zerojax.nn.layerwise,
  # which also rematerialises the block)
  layerwise: bool = False
  scan: bool = True
  # whether zero-3 variants take the one-line opt-in (False: the model as a
  # user writes it without zerojax.nn.layerwise)
  opt_in: bool = True
  # tensor parallelism over a "model" mesh axis of `tp` devices (Megatron's
  # split, annotated with nn.with_partitioning: qkv and MLP-in by columns,
  # a head's q, k, v side by side; attention-out and MLP-out by rows)
  tp: int = 1
  # the head and loss as one `zerojax.losses.linear_cross_entropy` over
  # vocabulary blocks of this many words (the model returns its hidden
  # states); None: logits, then optax's cross entropy
  loss_block: Optional[int] = None
  # the tied embedding as a `zerojax.nn.BlockedEmbed` of this many
  # vocabulary blocks (a stack "wte": zerojax gathers one block at a time
  # at the lookup and at the head, whose loss it computes); None: nn.Embed
  embed_blocks: Optional[int] = None
  # the attention: "einsum" (scores written out, then a softmax), a
  # `jax.nn.dot_product_attention` implementation ("xla"; "cudnn", its
  # fused flash attention on an NVIDIA GPU), or "chunked"
  # (`chunked_attention`: no T x T scores in memory, in plain JAX)
  attention: str = "einsum"
  # a `jax.checkpoint_policies` name for the layerwise block's remat (e.g.
  # "dots_with_no_batch_dims_saveable": the backward keeps the matmul
  # outputs and recomputes the rest, the gathers included); "": recompute all
  remat_policy: str = ""
  # rematerialise each block (nn.remat) where stage 3's layerwise does not
  remat: bool = False
  # GPT-2's learned position table (`max_len` rows); False: none, as for a
  # long-sequence model whose positions are rotary (their elementwise work
  # left out)
  learned_positions: bool = True

  @property
  def stacked(self) -> tuple:
    return (("blocks",) if self.scan else ()) + (
        ("wte",) if self.embed_blocks else ())

  def replace(self, **kw) -> "GPTConfig":
    return dataclasses.replace(self, **kw)

  def for_variant(self, name: str, data: NamedSharding) -> "GPTConfig":
    """Stage 3 wraps the block in `zerojax.nn.layerwise` (the opt-in a
    stage-3 user writes); GSPMD FSDP pins the activations to `data`."""
    if name == "gspmd-fsdp":
      return self.replace(activation_sharding=data)
    if name in ("zero-3", "1dev-zero-3"):
      return self.replace(layerwise=self.opt_in)
    return self

  def make_model(self) -> "GPT":
    return GPT(self)

  @property
  def num_params(self) -> int:
    """Ψ, counted from the shapes (tied embedding counted once)."""
    d, v, t, l = self.width, self.vocab_size, self.max_len, self.layers
    block = (2 * 2 * d            # two LayerNorms
             + d * 3 * d + 3 * d  # qkv
             + d * d + d          # attention out
             + d * 4 * d + 4 * d  # mlp in
             + 4 * d * d + d)     # mlp out
    if self.embed_blocks:   # the table's rows padded to whole blocks
      v = -(-v // self.embed_blocks) * self.embed_blocks
    t = t if self.learned_positions else 0
    return v * d + t * d + l * block + 2 * d


CONFIGS = {
    # the test smoke run
    "tiny": GPTConfig(vocab_size=256, max_len=64, width=64, layers=2, heads=4),
    # --quick, and --full's speed runs: ~1M parameters, steps of 0.2-2.5 s
    # on 2 CPU cores running 8 simulated devices
    "cpu-1m": GPTConfig(vocab_size=2048, max_len=128, width=128, layers=4,
                        heads=4),
    "gpt2-small": GPTConfig(),                                   # 124M
    "gpt2-medium": GPTConfig(width=1024, layers=24, heads=16),  # 355M
    # the vocabulary padded to a multiple of 64 (nanoGPT's 50304): the tied
    # head's matmuls get aligned shapes on a GPU
    "gpt2-medium-pad": GPTConfig(width=1024, layers=24, heads=16,
                                 vocab_size=50304),
    # the same with the tied embedding as a zerojax.nn.BlockedEmbed
    "gpt2-small-blocked": GPTConfig(embed_blocks=16),
    "gpt2-medium-blocked": GPTConfig(width=1024, layers=24, heads=16,
                                     embed_blocks=16),
    # issue 14's unscanned model: stage 3 without the opt-in against GSPMD
    "gpt2-384-unrolled": GPTConfig(width=384, layers=12, heads=6, scan=False,
                                   opt_in=False),                # 40M
}


# `chunked_attention`'s blocks: at least CHUNK queries (and keys), and at
# most BLOCKS of them a sequence (few loop steps: few small kernels)
CHUNK, BLOCKS = 512, 16


def chunked_attention(q, k, v, chunk: int):
  """Causal attention over `[batch, tokens, heads, head_dim]` in blocks of
  `chunk` queries and keys with a running softmax (Rabe and Staats's
  memory-efficient attention; flash attention's arithmetic without its
  kernel): one query block's scores against one key block's at a time,
  each query block rematerialised, so neither pass holds more than a
  block of scores. It reads every key block (twice the FLOPs of a kernel
  that skips the masked ones), in the compute dtype with float32 softmax
  statistics."""
  b, t, h, hd = q.shape
  chunk = min(chunk, t)   # (a short sequence, such as init's, is one block)
  if t % chunk:
    raise ValueError(f"chunked_attention: {t} tokens are not whole blocks "
                     f"of {chunk}.")
  n = t // chunk
  blocks = lambda x: jnp.moveaxis(x.reshape(b, n, chunk, h, hd), 1, 0)
  q, k, v = blocks(q) / np.sqrt(hd).astype(q.dtype), blocks(k), blocks(v)
  rows = jnp.arange(chunk)

  @jax.checkpoint
  def query_block(qi, i):
    def key_block(carry, j):
      top, total, acc = carry
      s = jnp.einsum("bqhd,bkhd->bhqk", qi, k[j],
                     preferred_element_type=jnp.float32)
      causal = (i * chunk + rows)[:, None] >= (j * chunk + rows)[None, :]
      s = jnp.where(causal, s, -jnp.inf)
      new = jnp.maximum(top, s.max(-1))
      p = jnp.exp(s - new[..., None])
      scale = jnp.exp(top - new)
      acc = acc * scale[..., None] + jnp.einsum(
          "bhqk,bkhd->bhqd", p.astype(v.dtype), v[j],
          preferred_element_type=jnp.float32)
      return (new, total * scale + p.sum(-1), acc), None
    start = (jnp.full((b, h, chunk), -jnp.inf, jnp.float32),
             jnp.zeros((b, h, chunk), jnp.float32),
             jnp.zeros((b, h, chunk, hd), jnp.float32))
    (_, total, acc), _ = jax.lax.scan(jax.checkpoint(key_block), start,
                                      jnp.arange(n))
    return jnp.einsum("bhqd->bqhd", acc / total[..., None]).astype(qi.dtype)

  out = jax.lax.map(lambda a: query_block(*a), (q, jnp.arange(n)))
  return jnp.moveaxis(out, 0, 1).reshape(b, t, h, hd)


class Block(nn.Module):
  cfg: GPTConfig

  def _pin(self, x):
    if self.cfg.activation_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.cfg.activation_sharding)

  @nn.compact
  def __call__(self, x, _):
    cfg = self.cfg
    b, t, d = x.shape
    hd = d // cfg.heads
    x = self._pin(x)
    h = nn.LayerNorm(name="ln_1")(x)
    if cfg.tp > 1:   # columns head-major: each model device, whole heads
      qkv = self._dense(3 * d, "qkv", cols=True)(h).reshape(b, t, cfg.heads, 3, hd)
      q, k, v = qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2]
    else:
      qkv = nn.Dense(3 * d, name="qkv")(h).reshape(b, t, 3, cfg.heads, hd)
      q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    if cfg.attention == "chunked":
      h = chunked_attention(q, k, v, max(CHUNK, t // BLOCKS)).reshape(
          b, t, d)
    elif cfg.attention == "einsum":
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd).astype(x.dtype)
      causal = jnp.tril(jnp.ones((t, t), bool))
      scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
      attn = jax.nn.softmax(scores, axis=-1)
      h = jnp.einsum("bhqk,bkhd->bqhd", attn, v).reshape(b, t, d)
    else:
      # (cuDNN takes half precision only: fp32 runs, and the parameters'
      # fp32 init, take XLA's)
      half = q.dtype in (jnp.bfloat16, jnp.float16)
      h = jax.nn.dot_product_attention(
          q, k, v, is_causal=True,
          implementation=cfg.attention if half else "xla").reshape(b, t, d)
    x = x + self._dense(d, "attn_out", cols=False)(h)
    h = nn.LayerNorm(name="ln_2")(x)
    h = nn.gelu(self._dense(4 * d, "mlp_in", cols=True)(h))
    x = x + self._dense(d, "mlp_out", cols=False)(h)
    return self._pin(x), None

  def _dense(self, features: int, name: str, cols: bool) -> nn.Dense:
    """nn.Dense, its weights split over "model" by columns or rows when
    the config asks for tensor parallelism."""
    if self.cfg.tp == 1:
      return nn.Dense(features, name=name)
    split = nn.with_partitioning
    kernel = nn.initializers.lecun_normal()
    return nn.Dense(
        features, name=name,
        kernel_init=split(kernel, (None, "model") if cols else ("model", None)),
        bias_init=split(nn.initializers.zeros, ("model",) if cols else (None,)))


class GPT(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens, targets=None):
    """Logits; with `embed_blocks`, the per-token losses against
    `targets` (the tied head's, `BlockedEmbed.cross_entropy`)."""
    cfg = self.cfg
    init = nn.initializers.normal(0.02)
    if cfg.embed_blocks:
      wte = zerojax.nn.BlockedEmbed(cfg.vocab_size, cfg.width,
                                    cfg.embed_blocks, embedding_init=init,
                                    name="wte")
    else:
      wte = nn.Embed(cfg.vocab_size, cfg.width, embedding_init=init,
                     name="wte")
    x = wte(tokens)
    if cfg.learned_positions:
      x = x + self.param("wpe", init, (cfg.max_len, cfg.width))[
          : tokens.shape[1]]
    policy = ({"policy": getattr(jax.checkpoint_policies, cfg.remat_policy)}
              if cfg.remat_policy else {})
    if cfg.layerwise:
      block = zerojax.nn.layerwise(Block, prevent_cse=False, **policy)
    else:
      # (outside a scan, XLA would merge the recompute with the forward
      # pass without prevent_cse: no remat at all)
      block = (nn.remat(Block, prevent_cse=not cfg.scan) if cfg.remat
               else Block)
    if cfg.scan:
      x, _ = nn.scan(block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=cfg.layers,
                     metadata_params={nn.PARTITION_NAME: None})(
                         cfg, name="blocks")(x, None)
    else:
      for i in range(cfg.layers):
        x, _ = block(cfg, name=f"blocks_{i}")(x, None)
    x = nn.LayerNorm(name="ln_f")(x)
    if targets is not None:
      return wte.cross_entropy(x, targets)
    return x if cfg.loss_block else wte.attend(x)


@functools.lru_cache(maxsize=None)
def make_tx(name: str = "adamw"):
  """The optimizer `name` ("adamw"; "muon": `optax.contrib.muon`, AdamW for
  what is no matrix; "adafactor"); one object per process, so that
  zerojax's per-optimizer work can be shared between variants (see
  `variants._memoize_optimizer_probes`)."""
  make = {"adamw": lambda: optax.adamw(3e-4, weight_decay=0.1),
          "muon": lambda: optax.contrib.muon(3e-4, adam_weight_decay=0.1),
          "adafactor": lambda: optax.adafactor(3e-4)}
  if name not in make:
    raise ValueError(f"make_tx({name!r}): use one of {sorted(make)}.")
  return make[name]()
