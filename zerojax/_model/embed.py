"""`zerojax.nn.BlockedEmbed`: a tied embedding gathered one vocabulary
block at a time, at the lookup and at the head.

    wte = zerojax.nn.BlockedEmbed(vocab, width, blocks=16, name="wte")
    x = wte(tokens)                                  # the lookup
    ...
    losses = wte.cross_entropy(hidden, targets)      # the tied head + loss
    state = zerojax.shard(state, stage=3,
                          blocks=zerojax.Blocks(stacked=("blocks", "wte")))

A tied embedding is used at both ends of the model. Held gathered for the
step (what stage 3 does with a chunk no block gathers), the whole `[vocab,
d]` table and, in the backward pass, its whole gradient are alive together
at the head, beside the logits: GPT-2 small's peak at stage 3 is there.
`BlockedEmbed` stores its table as `[blocks, rows, d]` (`rows = ceil(vocab
/ blocks)`; the rows past the vocabulary are zeros and never used), a
layer stack like a scanned block's (`stacked=`). Its lookup and its head
each run over the blocks in a loop; inside a stage-3 step each iteration
all-gathers one block, the loop's rematerialisation gathers it again in
the backward pass, and the block's gradient is reduce-scattered as the
backward pass leaves it. So one block of the table, one of its gradient
and one of logits (`tokens x rows`) are alive at a time: per-use
gathering, as FSDP2 does for a module with `reshard_after_forward=True`,
cut by vocabulary blocks so that the head's backward never holds the
whole table either. At stage 2 each block's gradient is reduce-scattered
in the loop; below, the blocks are a plain array.

The head's loss is `zerojax.losses.linear_cross_entropy`'s (a running
log-sum-exp over blocks), differentiated by JAX through the loop.
`gather_params` exports the `[blocks, rows, d]` table:
`BlockedEmbed.table(embedding, vocab)` gives `nn.Embed`'s `[vocab, d]`.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from zerojax import _online_softmax as online_softmax
from zerojax._comm import collectives
from zerojax._model import nnx as model_nnx
from zerojax._model import gather
from zerojax._options.policy import policy


def _say_unstacked(layout, config, path: tuple) -> None:
  """A `BlockedEmbed` at stage 2 or 3 whose table is not a stack (its
  module is not in `stacked=`) is held whole, as `nn.Embed` would be:
  legal, but not what the module is for."""
  if (not policy(config).layer_hooks
      or any(layout.stack_prefix(c) == path
             for c, chunk in enumerate(layout.chunks) if chunk.layers)):
    return
  gather.say_once(
      f"BlockedEmbed {'/'.join(path)} is not in "
      f"Blocks(stacked={tuple(config.stacked)!r}), so the step holds its whole table "
      "(and gradient) as it would nn.Embed's. Add its name, Blocks(stacked=(..., "
      f"{path[-1]!r})), to gather it one vocabulary block at a time.")


class _Blocks:
  """The vocabulary-block computations `BlockedEmbed` and `NnxBlockedEmbed`
  share. A subclass has `num_embeddings`, `features`, `blocks` and says
  where its table is (`_source`) and how the step hears it (`_heard`)."""
  locals()[gather.GATHERS_ITSELF] = True   # see zerojax._model.linen.intercept

  @property
  def rows(self) -> int:
    """Vocabulary rows per block."""
    return -(-self.num_embeddings // self.blocks)

  @staticmethod
  def table(embedding: jax.Array, num_embeddings: int) -> jax.Array:
    """The `[vocab, features]` table (`nn.Embed`'s) of a `[blocks, rows,
    features]` parameter."""
    return embedding.reshape(-1, embedding.shape[-1])[:num_embeddings]

  def _source(self):
    """`(table, None)`: the plain `[blocks, rows, features]` parameter; or
    inside a zerojax step whose stack this is, `(None, (c, value,
    slot))`: the table's chunk `c`, this device's value of it (shards, or
    at stage 2 the replicated rows) and its gradient slot (or None)."""
    raise NotImplementedError

  def _heard(self) -> None:
    """Says this module's path to the step tracing it (the opt-in)."""
    raise NotImplementedError

  def _check_shape(self) -> None:
    for name, value in (("num_embeddings", self.num_embeddings),
                        ("features", self.features), ("blocks", self.blocks)):
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"BlockedEmbed({name}={value!r}): give a positive "
                         "integer.")
    if self.blocks > self.num_embeddings:
      raise ValueError(f"BlockedEmbed(blocks={self.blocks}) is more than its "
                       f"{self.num_embeddings} words: give at most one block "
                       "per word.")

  def _initial(self, init, key):
    table = init(key, (self.num_embeddings, self.features))
    pad = self.blocks * self.rows - self.num_embeddings
    return jnp.pad(table, ((0, pad), (0, 0))).reshape(
        self.blocks, self.rows, self.features)

  def _lookup(self, tokens: jax.Array) -> jax.Array:
    """`tokens`' embeddings, `[..., features]`, looked up block by block
    (or at stage 3 by rows, `_rows_lookup`)."""
    tokens = jnp.asarray(tokens)
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
      raise TypeError(f"BlockedEmbed: tokens have dtype {tokens.dtype}; "
                      "give integer token ids.")
    table, chunk = self._source()
    if chunk is not None:
      rows = self._rows_lookup(tokens, *chunk)
      if rows is not None:
        return rows

    def body(x, i, w):
      local = tokens - i * self.rows
      hit = (local >= 0) & (local < self.rows)
      return x + jnp.where(hit[..., None],
                           jnp.take(w, jnp.clip(local, 0, self.rows - 1),
                                    axis=0), 0).astype(x.dtype)

    dtype = (table.dtype if table is not None
             else gather.active_layout()[1].compute_dtype)
    return self._over_blocks(body, jnp.zeros(
        tokens.shape + (self.features,), dtype))

  def _rows_lookup(self, tokens, c: int, value, slot):
    """At stage 3, the lookup by rows instead of blocks (None where it does
    not apply): every device's token ids are all-gathered, each device
    takes from its own shard the elements of those rows it holds, and a
    reduce-scatter hands every device the sum, its tokens' embeddings. In
    the backward pass the embeddings' cotangents are all-gathered and each
    device adds its elements into its shard's gradient. It moves the
    tokens' rows (devices x tokens x width), not the table, and is chosen
    where that is no more than the table (devices x tokens <= vocab);
    Megatron's vocabulary-parallel embedding sums partial lookups the same
    way. Not for shards in host memory or split over a model axis: those
    take the blocks."""
    layout, config = gather.active_layout()
    ax = config.axis_name
    n = jax.lax.axis_size(ax)
    if (not policy(config).gathers_params or slot is not None
        or collectives.Wire.of(config, layout.chunks[c]).model is not None
        or n * tokens.size > self.blocks * self.rows):
      return None
    self._heard()
    shard = value.astype(config.compute_dtype)   # [blocks, length / n]
    width = shard.shape[-1]
    ids = jax.lax.all_gather(tokens.reshape(-1), ax)   # [n, tokens]
    # where each element of each token's row lies: the leaf is the row's
    # only one, row-major from offset 0
    element = ((ids % self.rows)[..., None] * self.features
               + jnp.arange(self.features))            # [n, tokens, width]
    mine = element // width == jax.lax.axis_index(ax)
    taken = shard[(ids // self.rows)[..., None],
                  jnp.clip(element % width, 0, width - 1)]
    rows = jax.lax.psum_scatter(jnp.where(mine, taken, 0), ax,
                                scatter_dimension=0)
    return rows.reshape(tokens.shape + (self.features,))

  def cross_entropy(self, hidden: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-token cross entropy of the tied head's logits `hidden @ table.T`
    against `labels`, float32, without the logits in memory
    (`zerojax.losses.linear_cross_entropy`'s, over this module's blocks)."""
    hidden, labels = jnp.asarray(hidden), jnp.asarray(labels)
    if not jnp.issubdtype(labels.dtype, jnp.integer):
      raise TypeError(f"BlockedEmbed.cross_entropy: labels have dtype "
                      f"{labels.dtype}; give integer class indices.")
    if (hidden.shape[-1:] != (self.features,)
        or hidden.shape[:-1] != labels.shape):
      raise ValueError(
          f"BlockedEmbed.cross_entropy: hidden {hidden.shape} and labels "
          f"{labels.shape} do not fit: hidden must be [..., {self.features}] "
          "and labels its leading shape.")
    h, y = hidden.reshape(-1, self.features), labels.reshape(-1)

    def body(carry, i, w):
      ids = i * self.rows + jnp.arange(self.rows)
      live = ids < self.num_embeddings
      hit = online_softmax.hit(ids, y, live)
      logits = online_softmax.logits(h, w.astype(h.dtype), live)
      return online_softmax.running_add(carry, logits, hit)

    carry = self._over_blocks(body, online_softmax.running_start(h.shape[0]))
    return online_softmax.running_losses(carry)[0].reshape(labels.shape)

  def attend(self, hidden: jax.Array) -> jax.Array:
    """The tied head's logits `hidden @ table.T`, `[..., vocab]` (for
    evaluation and sampling: they are all in memory)."""
    hidden = jnp.asarray(hidden)

    def body(out, i, w):
      block = hidden @ w.astype(hidden.dtype).T
      return jax.lax.dynamic_update_slice_in_dim(out, block, i * self.rows,
                                                 axis=-1)

    start = jnp.zeros(hidden.shape[:-1] + (self.blocks * self.rows,),
                      hidden.dtype)
    return self._over_blocks(body, start)[..., :self.num_embeddings]

  def _over_blocks(self, body, carry):
    """`body(carry, i, w)` over the blocks `i` in order, `w` block `i` of
    the table (`[rows, features]`): a slice of the plain parameter, or
    inside a zerojax step this block's row of the table's chunk, whole
    (`nn._full_layer`: gathered at stage 3). The loop rematerialises each
    iteration, so the backward pass gathers the block again instead of
    keeping it."""
    self._heard()
    table, chunk = self._source()
    if chunk is None:
      block = lambda i, w: w
      xs = (table,)
    else:
      layout, config = gather.active_layout()
      c, value, slot = chunk
      xs = (value, slot)

      def block(i, value, slot):
        full = gather._full_layer(layout, config, c, value, slot)
        return layout.layer_tree(c, full)["embedding"]

    step = jax.checkpoint(lambda carry, i, *x: (body(carry, i, block(i, *x)),
                                                None))
    xs = (jnp.arange(self.blocks),) + xs
    return jax.lax.scan(lambda c, x: step(c, *x), carry, xs)[0]


class BlockedEmbed(_Blocks, nn.Module):
  """`nn.Embed` whose table is stored, gathered and differentiated by
  vocabulary blocks, with the tied head's cross entropy (module docstring).
  Flax linen; `NnxBlockedEmbed` is the NNX module.

  Attributes:
    num_embeddings: the vocabulary size.
    features: the embedding width.
    blocks: how many vocabulary blocks the table is stored in; at stage 3
      one block of the table is gathered at a time.
    embedding_init: `nn.Embed`'s initializer, applied to the `[vocab,
      features]` table before it is cut into blocks.
  """
  num_embeddings: int
  features: int
  blocks: int = 16
  embedding_init: Callable[..., Any] = nn.linear.default_embed_init

  def setup(self):
    self._check_shape()
    if not gather._chunk_keys(self.variables.get("params", {})):
      self.embedding = self.param(
          "embedding", lambda key: self._initial(self.embedding_init, key))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """`tokens`' embeddings, `[..., features]`, looked up block by block."""
    return self._lookup(tokens)

  def _source(self):
    if hasattr(self, "embedding"):
      return self.embedding, None
    params = self.variables["params"]
    (c, key), = gather._chunk_keys(params).items()   # one leaf, one chunk
    return None, (c, params[key], params.get(gather.slot_key(c)))

  def _heard(self) -> None:
    context = gather._ACTIVE.get()
    if context is not None and not self.is_initializing():
      path = tuple(self.scope.path)
      if path not in context.beside:   # a table beside the blocks is held
        context[2].add(path)
      _say_unstacked(context[0], context[1], path)


class NnxBlockedEmbed(_Blocks, nnx.Module):
  """`BlockedEmbed` as a Flax NNX module (`nnx.Embed`'s place); list its
  attribute path in `Blocks(stacked=...)` (`("wte",)` for `model.wte`).

  Args:
    num_embeddings, features, blocks, embedding_init: as `BlockedEmbed`'s.
    rngs: the `nnx.Rngs` its table is drawn from (`rngs.params()`).
  """

  def __init__(self, num_embeddings: int, features: int, blocks: int = 16, *,
               embedding_init: Callable[..., Any] = nn.linear.default_embed_init,
               rngs: nnx.Rngs):
    self.num_embeddings, self.features, self.blocks = (num_embeddings,
                                                       features, blocks)
    self._check_shape()
    self.embedding = nnx.Param(self._initial(embedding_init, rngs.params()))

  def __call__(self, tokens: jax.Array) -> jax.Array:
    """`tokens`' embeddings, `[..., features]`, looked up block by block."""
    return self._lookup(tokens)

  def _source(self):
    shards = {int(k[len(gather.CHUNK_KEY):]): v for k, v in vars(self).items()
              if k.startswith(gather.CHUNK_KEY)}
    if not shards:
      return self.embedding[...], None
    (c, value), = shards.items()
    slot = getattr(self, gather.slot_key(c), None)
    return None, (c, value[...], None if slot is None else slot[...])

  def _heard(self) -> None:
    context = gather._ACTIVE.get()
    stack = getattr(self, model_nnx.STACK_ATTR, None)
    if context is not None and stack is not None:
      context[2].add(stack)
