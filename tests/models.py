"""Small Flax models for the tests, and the independent reference: the same
model trained with plain optax on one device."""
from __future__ import annotations

import functools
import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax
from zerojax.nn import BlockedEmbed, layerwise


class MLP(nn.Module):
  hidden: int = 32
  out: int = 4

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(self.hidden)(x)
    x = nn.LayerNorm()(x)
    x = nn.gelu(x)
    return nn.Dense(self.out)(x)


class Block(nn.Module):
  """Pre-LayerNorm causal self-attention + MLP block."""
  width: int = 32
  heads: int = 4

  @nn.compact
  def __call__(self, x, _=None):
    h = nn.LayerNorm()(x)
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    # No projection biases: the key bias has an exactly-zero true gradient
    # (softmax ignores a per-query constant), and Adam would blow its float
    # noise up to lr-sized steps that differ with any summation order.
    h = nn.MultiHeadDotProductAttention(num_heads=self.heads, dtype=x.dtype,
                                        use_bias=False)(h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.width, dtype=x.dtype)(h)
    h = nn.Dense(self.width, dtype=x.dtype)(nn.gelu(h))
    return x + h, None


class Transformer(nn.Module):
  """A tiny GPT: token + position embeddings, blocks, tied output."""
  vocab: int = 64
  width: int = 32
  layers: int = 2
  seq: int = 8
  scan: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width)
    pos = self.param("pos", nn.initializers.normal(0.02), (self.seq, self.width))
    x = embed(tokens) + pos[: tokens.shape[1]].astype(embed.embedding.dtype)
    if self.scan:
      x, _ = nn.scan(Block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.layers)(
                         self.width, name="blocks")(x, None)
    else:
      for i in range(self.layers):
        x, _ = Block(self.width, name=f"block_{i}")(x)
    x = nn.LayerNorm()(x)
    return embed.attend(x).astype(jnp.float32)


class ScannedLM(nn.Module):
  """Blocks in one `nn.scan`, or (`scan=False`) called one by one in a
  Python loop as `blocks_0`, `blocks_1`, ...; gathered per layer at stage 3
  with `layerwise`. With `logits=False` it returns the hidden states before
  the tied head (for `zerojax.losses.linear_cross_entropy`)."""
  layers: int = 2
  width: int = 64
  vocab: int = 128
  layerwise: bool = True
  scan: bool = True
  logits: bool = True
  # a `zerojax.nn.BlockedEmbed` of this many blocks, named "wte", instead
  # of nn.Embed; with `targets` the call returns its per-token losses
  embed_blocks: int = 0
  # a `jax.checkpoint_policies` policy for the layerwise block's remat
  remat_policy: Any = None

  @nn.compact
  def __call__(self, tokens, targets=None):
    embed = (BlockedEmbed(self.vocab, self.width, self.embed_blocks,
                          name="wte") if self.embed_blocks
             else nn.Embed(self.vocab, self.width))
    x = embed(tokens)
    policy = {} if self.remat_policy is None else {"policy": self.remat_policy}
    block = layerwise(Block, **policy) if self.layerwise else Block
    if self.scan:
      x, _ = nn.scan(block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.layers)(
                         self.width, 4, name="blocks")(x, None)
    else:
      for i in range(self.layers):
        x, _ = block(self.width, 4, name=f"blocks_{i}")(x)
    x = nn.LayerNorm()(x)
    if targets is not None:
      return embed.cross_entropy(x, targets)
    return embed.attend(x).astype(jnp.float32) if self.logits else x


def _split(names, init=nn.initializers.lecun_normal()):
  """An initializer that marks its weight split over mesh axes `names`."""
  return nn.with_partitioning(init, names)


class TPBlock(nn.Module):
  """A Megatron tensor-parallel block, written as Flax users write one:
  attention heads and the MLP's hidden units split over the mesh axis
  "model" (`nn.with_partitioning`), LayerNorms whole."""
  width: int = 32
  heads: int = 4

  @nn.compact
  def __call__(self, x, _=None):
    # (flax's DenseGeneral initialises a flat kernel and cannot carry 3-D
    # partition names under a mesh, so heads are split out by reshapes)
    split = lambda y: y.reshape(y.shape[:-1] + (self.heads, -1))
    h = nn.LayerNorm()(x)
    q, k, v = (split(nn.Dense(self.width, use_bias=False, dtype=x.dtype,
                              name=name, kernel_init=_split((None, "model")))(h))
               for name in ("query", "key", "value"))
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
    h = nn.dot_product_attention(q, k, v, mask=mask, dtype=x.dtype)
    x = x + nn.Dense(self.width, use_bias=False, dtype=x.dtype, name="out",
                     kernel_init=_split(("model", None)))(
                         h.reshape(h.shape[:-2] + (-1,)))
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.width, dtype=x.dtype,
                 kernel_init=_split((None, "model")),
                 bias_init=_split(("model",), nn.initializers.zeros))(h)
    h = nn.Dense(self.width, dtype=x.dtype,
                 kernel_init=_split(("model", None)))(nn.gelu(h))
    return x + h, None


class TPTransformer(nn.Module):
  """A tiny tensor-parallel GPT: embeddings whole, `TPBlock`s unrolled
  (`blocks_0`, ...) or scanned (`blocks`, the layer axis unsplit), tied
  output; `layerwise` gathers each block at stage 3."""
  vocab: int = 64
  width: int = 32
  layers: int = 2
  scan: bool = False
  layerwise: bool = False

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(self.vocab, self.width)
    x = embed(tokens)
    block = layerwise(TPBlock) if self.layerwise else TPBlock
    if self.scan:
      x, _ = nn.scan(block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=self.layers,
                     metadata_params={nn.PARTITION_NAME: None})(
                         self.width, name="blocks")(x, None)
    else:
      for i in range(self.layers):
        x, _ = block(self.width, name=f"blocks_{i}")(x)
    return embed.attend(nn.LayerNorm()(x)).astype(jnp.float32)


class ResidualBlock(nn.Module):
  """LayerNorm -> Dense 4w -> GELU -> Dense w, plus the input."""
  width: int = 64

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class ResidualMLP(nn.Module):
  """Residual blocks called one by one (`blocks_0`, ...); mean-square loss
  of the output, so `apply` is the loss of a batch of inputs."""
  layers: int = 2
  width: int = 64
  layerwise: bool = True

  @nn.compact
  def __call__(self, x):
    block = layerwise(ResidualBlock) if self.layerwise else ResidualBlock
    for i in range(self.layers):
      x = block(self.width, name=f"blocks_{i}")(x)
    return jnp.mean(x.astype(jnp.float32) ** 2)


class Encoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(32)(nn.gelu(nn.Dense(64)(nn.LayerNorm()(x))))


class Decoder(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(32)(jnp.tanh(nn.Dense(32)(nn.LayerNorm()(x))))


class TwoKinds(nn.Module):
  """Two block classes (an encoder's and a decoder's, as `Blocks(remat=)`
  per class names them), two blocks each, as written (no opt-ins)."""

  @nn.compact
  def __call__(self, x):
    for i in range(2):
      x = Encoder(name=f"enc_{i}")(x)
    for i in range(2):
      x = Decoder(name=f"dec_{i}")(x)
    return x


class Bridge(nn.Module):
  """A wide residual MLP between two stacks of blocks (an encoder's
  projection into a decoder): one module, called once."""
  width: int = 64
  hidden: int = 512

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(self.hidden)(nn.LayerNorm()(x))
    return x + nn.Dense(self.width)(nn.gelu(h))


class Bridged(nn.Module):
  """Residual blocks `enc_<i>`, a `Bridge` named "bridge", blocks `dec_<i>`
  (all wrapped with `layerwise`, the bridge when `wrap`); mean-square loss
  of the output."""
  layers: int = 2
  width: int = 64
  hidden: int = 512
  wrap: bool = True

  @nn.compact
  def __call__(self, x):
    block = layerwise(ResidualBlock)
    for i in range(self.layers):
      x = block(self.width, name=f"enc_{i}")(x)
    bridge = layerwise(Bridge) if self.wrap else Bridge
    x = bridge(self.width, self.hidden, name="bridge")(x)
    for i in range(self.layers):
      x = block(self.width, name=f"dec_{i}")(x)
    return jnp.mean(x.astype(jnp.float32) ** 2)


class FlagBlock(nn.Module):
  """A residual MLP block called as Hugging Face's Flax blocks are: an
  optional mask and Python flags beside the array (`deterministic`)."""
  width: int = 32

  @nn.compact
  def __call__(self, x, mask=None, deterministic: bool = True):
    h = nn.Dense(4 * self.width)(nn.LayerNorm()(x))
    h = nn.Dropout(0.5, deterministic=deterministic)(nn.gelu(h))
    return x + nn.Dense(self.width)(h) * (1.0 if mask is None else mask)


class BlockList(nn.Module):
  """Blocks kept in a setup-time list, named by their index (`h/0`, `h/1`,
  as `transformers`' `FlaxGPT2BlockCollection` names them)."""
  layers: int = 2
  width: int = 32
  layerwise: bool = True

  def setup(self):
    block = layerwise(FlagBlock) if self.layerwise else FlagBlock
    self.blocks = [block(self.width, name=str(i)) for i in range(self.layers)]

  def __call__(self, x, deterministic: bool = True):
    for block in self.blocks:
      x = block(x, None, deterministic=deterministic)
    return x


class ListedLM(nn.Module):
  """Two block lists, "enc" and "dec" (so each index names two blocks), an
  embedding and a head; with `deterministic=False` the blocks draw
  dropout."""
  layers: int = 2
  width: int = 32
  vocab: int = 64
  layerwise: bool = True

  @nn.compact
  def __call__(self, tokens, deterministic: bool = True):
    x = nn.Embed(self.vocab, self.width)(tokens)
    for name in ("enc", "dec"):
      x = BlockList(self.layers, self.width, self.layerwise, name=name)(
          x, deterministic=deterministic)
    return nn.Dense(self.vocab)(nn.LayerNorm()(x)).astype(jnp.float32)


class ResBlock(nn.Module):
  channels: int
  axis_name: Optional[str] = None
  train: bool = True

  @nn.compact
  def __call__(self, x):
    norm = functools.partial(nn.BatchNorm, use_running_average=not self.train,
                             momentum=0.9, axis_name=self.axis_name)
    # no conv biases before BatchNorm (as ResNets write it): their gradient
    # is exactly zero, and Adam would blow its float noise up to lr-sized
    # steps that differ with any summation order
    conv = functools.partial(nn.Conv, self.channels, (3, 3), use_bias=False)
    h = nn.relu(norm()(conv()(x)))
    h = norm()(conv()(h))
    return nn.relu(x + h)


class ResNet(nn.Module):
  """A small ResNet: a stem, residual blocks with BatchNorm, a linear head;
  `train=False` normalises with the running averages."""
  channels: int = 8
  blocks: int = 2
  classes: int = 4
  axis_name: Optional[str] = None
  train: bool = True

  @nn.compact
  def __call__(self, x):
    x = nn.Conv(self.channels, (3, 3), use_bias=False)(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not self.train, momentum=0.9,
                             axis_name=self.axis_name)(x))
    for _ in range(self.blocks):
      x = ResBlock(self.channels, self.axis_name, self.train)(x)
    return nn.Dense(self.classes)(x.mean(axis=(1, 2)))


def lm_batches(vocab, batch=16, seq=16, steps=4):
  rng = np.random.default_rng(0)
  out = []
  for _ in range(steps):
    t = rng.integers(0, vocab, size=(batch, seq + 1))
    out.append({"tokens": t[:, :-1].astype(np.int32),
                "targets": t[:, 1:].astype(np.int32)})
  return out


def lm_loss_fn(model):
  def loss_fn(params, b):
    logits = model.apply({"params": params}, b["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b["targets"]).mean()
  return loss_fn


def make_problem(kind: str, batch: int = 32, steps: int = 5, seed: int = 0):
  """(model, params, loss_fn, batches) for a model kind."""
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    model = MLP()
    batches = [{"x": rng.normal(size=(batch, 8)).astype(np.float32),
                "y": rng.normal(size=(batch, 4)).astype(np.float32)}
               for _ in range(steps)]
    params = model.init(jax.random.key(seed), batches[0]["x"][:1])["params"]

    def loss_fn(params, b):
      out = model.apply({"params": params}, b["x"].astype(_dtype(params)))
      return jnp.mean((out.astype(jnp.float32) - b["y"]) ** 2)
  else:
    model = Transformer(scan=(kind == "scan_transformer"))
    batches = []
    for _ in range(steps):
      t = rng.integers(0, model.vocab, size=(batch, model.seq + 1))
      batches.append({"tokens": t[:, :-1].astype(np.int32),
                      "targets": t[:, 1:].astype(np.int32)})
    params = model.init(jax.random.key(seed), batches[0]["tokens"][:1])["params"]

    def loss_fn(params, b):
      logits = model.apply({"params": params}, b["tokens"])
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, b["targets"]).mean()
  return model, params, loss_fn, batches


def _dtype(params):
  return jax.tree_util.tree_leaves(params)[0].dtype


def reference_run(loss_fn, params, tx, batches, compute_dtype=jnp.float32,
                  clip_norm=None, opt_state=None):
  """Plain optax on one device; 16-bit compute casts the fp32 params for the
  forward/backward and keeps the update in fp32. Starts from `opt_state`
  (default `tx.init(params)`). Returns (losses, params)."""
  if clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(clip_norm), tx)
  device = jax.devices()[0]
  params = jax.device_put(params, device)
  opt_state = tx.init(params) if opt_state is None else jax.device_put(
      opt_state, device)

  def cast_loss(p, b):
    cast = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), p)
    return loss_fn(cast, b).astype(jnp.float32)

  @jax.jit
  def step(p, s, b):
    loss, g = jax.value_and_grad(cast_loss)(p, b)
    g = jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), g)
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s, loss

  losses = []
  for b in batches:
    params, opt_state, loss = step(params, opt_state,
                                   jax.device_put(b, device))
    losses.append(float(loss))
  return np.array(losses), params


# (stage, ZeroConfig fields) the offloaded updates (`update_on="host"`, the
# disk tier) are checked at: each stage, bf16 and float32, skipped steps,
# accumulation, part of the chunks offloaded
OFFLOADED_UPDATE_CASES = (
    (1, dict(compute_dtype="bfloat16", skip_nonfinite=True)),
    (2, dict(compute_dtype="bfloat16", accum_steps=2)),
    (3, dict(compute_dtype="float32", accum_steps=2)),
    (3, dict(compute_dtype="bfloat16", offload_fraction=0.5)),
)


def zero_run(state, loss_fn, batches, after_step=None):
  """Trains a ZeroTrainState on `batches` with one `zerojax.train_step`;
  returns (state, losses). `after_step(state)`, if given, sees the state
  after each step."""
  import zerojax
  step = zerojax.train_step(loss_fn)
  losses = []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
    if after_step is not None:
      after_step(state)
  return state, np.array(losses)


# How close a zerojax run must come to `reference_run`, by compute dtype:
# (loss tolerance, parameter tolerance). In float32 the two differ only in
# the order of float32 sums (over devices, micro-batches and chunks). A
# 16-bit run follows the same mixed-precision recipe as the reference; what
# differs is only the order of 16-bit partial sums, so the bound is a few
# bfloat16 ulps of the loss and of the parameters' moves.
TOLERANCE = {
    "float32": (dict(rtol=1e-5), dict(rtol=1e-5, atol=1e-6)),
    "bfloat16": (dict(rtol=2e-2), dict(atol=2e-2)),
}


# Two zerojax programs that compute the same numbers (a tier against
# another, an identity encoding against none) agree bit for bit under XLA's
# own CPU fusion emitters. The older emitters the tests compile with where
# this XLA has them (conftest.FAST) fuse the two programs differently, so
# there they agree as a float32 run agrees with the reference (rounding,
# which Adam magnifies where a gradient is near 0).
OWN_EMITTERS = "xla_cpu_use_fusion_emitters=false" not in os.environ.get(
    "XLA_FLAGS", "")


def assert_same_numbers(actual, desired):
  """Bit for bit under XLA's own fusion emitters, else within float32's
  TOLERANCE for parameters."""
  if OWN_EMITTERS:
    np.testing.assert_array_equal(np.asarray(actual), np.asarray(desired))
  else:
    np.testing.assert_allclose(np.asarray(actual), np.asarray(desired),
                               **TOLERANCE["float32"][1])


def assert_matches_reference(losses, params, ref_losses, ref_params,
                             compute_dtype="float32"):
  """A zerojax run's losses and gathered parameters against the reference's
  (`reference_run`), within TOLERANCE[compute_dtype]."""
  loss_tol, param_tol = TOLERANCE[jnp.dtype(compute_dtype).name]
  np.testing.assert_allclose(losses, ref_losses, **loss_tol)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, **param_tol),
      params, ref_params)


def assert_blocks_bounded(compiled4, compiled16, state4, block: str,
                          width: int) -> None:
  """Stage 3 with repeated blocks gathered per block, 4 against 16 blocks
  (8 devices, Adam, 64 rows of `width` a step): the footprint grows by the
  12 more blocks' sharded state and gradient shard (16 bytes a parameter /
  N) and saved input (8 rows x width floats a device), not by their 4 x
  per-block gathered bytes; the temporaries stay within one block's
  gathered parameters and gradient."""
  per_block = sum(c.used for c in state4.layout.chunks if c.stack == block)
  assert per_block > 0
  growth = (zerojax.compiled_footprint(compiled16)["footprint"]
            - zerojax.compiled_footprint(compiled4)["footprint"])
  assert growth <= 1.1 * 12 * (16 * per_block / 8 + 4 * 8 * width)
  assert growth < 12 * 4 * per_block
  temp4, temp16 = (c.memory_analysis().temp_size_in_bytes
                   for c in (compiled4, compiled16))
  assert temp16 <= temp4 + 2 * 4 * per_block


# ---- Flax NNX --------------------------------------------------------------
from flax import nnx  # noqa: E402


class NnxMLP(nnx.Module):
  def __init__(self, rngs, hidden=32):
    self.hidden = nnx.Linear(8, hidden, rngs=rngs)
    self.norm = nnx.LayerNorm(hidden, rngs=rngs)
    self.out = nnx.Linear(hidden, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.gelu(self.norm(self.hidden(x))))


class NnxBlock(nnx.Module):
  """Pre-LayerNorm causal self-attention + MLP (no attention biases, as
  `Block`)."""

  def __init__(self, width, heads, rngs):
    self.norm1 = nnx.LayerNorm(width, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=width,
                                       use_bias=False, decode=False, rngs=rngs)
    self.norm2 = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    mask = nnx.make_causal_mask(jnp.ones(x.shape[:2]))
    x = x + self.attn(self.norm1(x), mask=mask)
    return x + self.down(nnx.gelu(self.up(self.norm2(x))))


class NnxTransformer(nnx.Module):
  """Blocks in an `nnx.List`, as Flax's NNX examples keep them; `block` is
  their class (e.g. `zerojax.nn.layerwise(NnxBlock)`), `embed` the tied
  embedding's."""

  def __init__(self, rngs, vocab=64, width=32, layers=2, seq=8,
               block=NnxBlock, embed=nnx.Embed):
    self.embed = embed(vocab, width, rngs=rngs)
    self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (seq, width)))
    self.blocks = nnx.List([block(width, 4, rngs) for _ in range(layers)])
    self.norm = nnx.LayerNorm(width, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens) + self.pos[...]
    for block in self.blocks:
      x = block(x)
    return self.embed.attend(self.norm(x)).astype(jnp.float32)


def nnx_problem(kind: str, batch: int = 32, steps: int = 5, seed: int = 0):
  """(model factory, loss_fn(model, batch), batches) for an NNX model kind."""
  rng = np.random.default_rng(seed)
  if kind == "mlp":
    batches = [{"x": rng.normal(size=(batch, 8)).astype(np.float32),
                "y": rng.normal(size=(batch, 4)).astype(np.float32)}
               for _ in range(steps)]

    def loss_fn(model, b):
      return jnp.mean((model(b["x"]).astype(jnp.float32) - b["y"]) ** 2)
    return (lambda: NnxMLP(nnx.Rngs(seed))), loss_fn, batches
  batches = []
  for _ in range(steps):
    t = rng.integers(0, 64, size=(batch, 9))
    batches.append({"tokens": t[:, :-1].astype(np.int32),
                    "targets": t[:, 1:].astype(np.int32)})

  def loss_fn(model, b):
    return optax.softmax_cross_entropy_with_integer_labels(
        model(b["tokens"]), b["targets"]).mean()
  return (lambda: NnxTransformer(nnx.Rngs(seed))), loss_fn, batches


def nnx_reference_run(make, loss_fn, tx, batches, compute_dtype=jnp.float32):
  """A plain `nnx.Optimizer(model, tx, wrt=nnx.Param)` loop on one device;
  16-bit compute casts the parameters for the forward and backward and keeps
  the update in fp32. Returns (losses, trained model)."""
  model = make()
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

  @nnx.jit
  def step(model, optimizer, b):
    def cast_loss(model):
      graph, params, rest = nnx.split(model, nnx.Param, ...)
      params = jax.tree_util.tree_map(lambda x: x.astype(compute_dtype), params)
      return loss_fn(nnx.merge(graph, params, rest), b).astype(jnp.float32)
    loss, grads = nnx.value_and_grad(cast_loss)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer, b)) for b in batches]
  return np.array(losses), model


class NnxResidualBlock(nnx.Module):
  def __init__(self, rngs, width=32):
    self.norm = nnx.LayerNorm(width, rngs=rngs)
    self.up = nnx.Linear(width, 4 * width, rngs=rngs)
    self.down = nnx.Linear(4 * width, width, rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


def nnx_scanned(block: type, layers: int = 4, width: int = 32) -> type:
  """An NNX model whose blocks are made with `nnx.vmap` and run with
  `nnx.scan`, as Flax's guide writes a layer stack (`stacked=("blocks",)`)."""

  class ScannedNet(nnx.Module):
    def __init__(self, rngs):
      @nnx.split_rngs(splits=layers)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs, width)
      self.blocks = make(rngs)
      self.head = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return block(x)
      return self.head(body(x, self.blocks))

  return ScannedNet


def nnx_listed(block: type, layers: int = 4, width: int = 32) -> type:
  """An NNX model whose blocks are an `nnx.List` called in a Python loop
  (what stage 3 gathers per block when `block` is wrapped)."""

  class ListedNet(nnx.Module):
    def __init__(self, rngs):
      self.blocks = nnx.List([block(rngs, width) for _ in range(layers)])
      self.head = nnx.Linear(width, 4, rngs=rngs)

    def __call__(self, x):
      for b in self.blocks:
        x = b(x)
      return self.head(x)

  return ListedNet



def zopts(kwargs: dict) -> dict:
  """`kwargs` of a zerojax call with the flat `ZeroConfig` fields in it
  (`ZeroConfig.fields()`, the library's own spelling, which the tests'
  matrices enumerate) turned into the options `zerojax.shard` takes: each
  group touched is built from them (`Group.from_fields`), the others and
  every other keyword (mesh, tx, stage, ...) pass as they are."""
  import zerojax
  from zerojax._options.config import FIELDS, OPTIONS
  flat = {k: v for k, v in kwargs.items() if k in FIELDS and k not in OPTIONS}
  if not flat:
    return dict(kwargs)
  fields = {**zerojax.ZeroConfig().fields(), "update_on": None, **flat}
  out = {k: v for k, v in kwargs.items() if k not in flat}
  for name, group in (("axes", zerojax.Axes), ("precision", zerojax.Precision),
                      ("quantize", zerojax.Quantize),
                      ("blocks", zerojax.Blocks), ("offload", zerojax.Offload)):
    if set(flat) & set(group().fields()):   # the fields it stands for
      out[name] = group.from_fields(fields)
  return out
