"""Cross entropy of a linear head without its logits in memory.

    h = model.apply({"params": params}, tokens)   # hidden states, [..., d]
    loss = zerojax.losses.linear_cross_entropy(
        h, params["wte"]["embedding"], targets).mean()

A language model's head `logits = h @ E.T` makes a `[tokens, vocab]` array,
and its backward pass another: at GPT-2's 50,257 words and 8 x 1024 tokens
per device, 1.6 GB each in fp32, more than a ZeRO-3 shard of GPT-2 medium's
whole training state. `linear_cross_entropy` computes the same per-token
losses over blocks of the vocabulary (a `lax.scan`): the forward keeps a
running maximum and sum of exponentials per token (the log-sum-exp, as
online softmax does) and the target's logit; the backward recomputes each
block's logits from the saved log-sum-exp, so no more than one block of
logits (`[tokens, block_size]`) is alive at once, either way. What it
saves is a function of tokens x vocabulary, not of the model's size; the
weight's own gradient is still written whole (one `[vocab, d]` array, as
without it).

The same idea as Liger Kernel's fused linear cross entropy, Apple's Cut
Cross-Entropy and DeepSpeed's `TiledFusedLogitsLoss`, written in JAX
(matmuls per block; no custom kernel), so it runs wherever the model does
and composes with every zerojax stage: it is plain JAX on the parameter
tree the step hands the loss.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp

from zerojax import _online_softmax as online_softmax


def linear_cross_entropy(hidden: jax.Array, weight: jax.Array,
                         labels: jax.Array, *, vocab_axis: int = 0,
                         block_size: int = 4096,
                         where: Optional[jax.Array] = None) -> jax.Array:
  """Per-token cross entropy of `hidden @ weight.T` (or `hidden @ weight`)
  against integer `labels`, without the logits in memory.

  Equal to `optax.softmax_cross_entropy_with_integer_labels(logits, labels)`
  with `logits = hidden @ weight.T` (`vocab_axis=0`, a tied `nn.Embed`'s
  `embedding`) or `hidden @ weight` (`vocab_axis=1`, a `nn.Dense` head's
  `kernel`), computed in float32, up to the order of the log-sum-exp's
  additions. The logits never exist whole: see the module docstring.

  Args:
    hidden: `[..., d]` float activations before the head.
    weight: the head's weight, `[vocab, d]` (vocab_axis=0) or `[d, vocab]`
      (vocab_axis=1), in the same float dtype as `hidden`.
    labels: `[...]` integer targets in `[0, vocab)` (the leading shape of
      `hidden`).
    vocab_axis: which axis of `weight` is the vocabulary (0 or 1).
    block_size: at most this many vocabulary rows per block (the blocks
      are evened out); at most one block's logits (`tokens x block_size`
      float32) are alive at once.
    where: boolean `[...]` (the labels' shape), the tokens to count: the
      others' losses are 0 and send no gradient, whatever their label
      (optax's `where=`). Hugging Face's ignored labels (-100):
      `where=labels != -100`, then `loss.sum() / where.sum()`.

  Returns:
    `[...]` float32 losses, one per token (reduce them as the model does:
    `.mean()`, or a masked mean).
  """
  hidden, weight, labels = map(jnp.asarray, (hidden, weight, labels))
  where = None if where is None else jnp.asarray(where)
  _check(hidden, weight, labels, vocab_axis, block_size, where)
  d, vocab = hidden.shape[-1], weight.shape[vocab_axis]
  # as many blocks as `block_size` asks for, evened out: the last block
  # then overlaps the one before by less than a row per block
  size = -(-vocab // -(-vocab // block_size))
  losses = _blocked(size, vocab_axis, hidden.reshape(-1, d), weight,
                    labels.reshape(-1)).reshape(labels.shape)
  # (a label out of range hits no word: its loss is the log-sum-exp, finite)
  return losses if where is None else jnp.where(where, losses, 0.0)


def _check(hidden, weight, labels, vocab_axis, block_size, where) -> None:
  """Refuses what `linear_cross_entropy` cannot mean, naming the value."""
  if vocab_axis not in (0, 1) or isinstance(vocab_axis, bool):
    raise ValueError(f"linear_cross_entropy(vocab_axis={vocab_axis!r}): the "
                     "weight's vocabulary axis is 0 (an Embed's [vocab, d] "
                     "embedding) or 1 (a Dense head's [d, vocab] kernel).")
  if (not isinstance(block_size, int) or isinstance(block_size, bool)
      or block_size < 1):
    raise ValueError(f"linear_cross_entropy(block_size={block_size!r}): give "
                     "a positive number of vocabulary rows per block.")
  for name, x in (("hidden", hidden), ("weight", weight)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise TypeError(f"linear_cross_entropy: {name} has dtype {x.dtype}; "
                      "it must be a float array.")
  if hidden.dtype != weight.dtype:
    raise TypeError(f"linear_cross_entropy: hidden is {hidden.dtype} and "
                    f"weight {weight.dtype}; cast one to the other (the "
                    "head's compute dtype).")
  if not jnp.issubdtype(labels.dtype, jnp.integer):
    raise TypeError(f"linear_cross_entropy: labels have dtype {labels.dtype};"
                    " give integer class indices (one per token).")
  if weight.ndim != 2 or hidden.ndim < 1:
    raise ValueError(f"linear_cross_entropy: weight has shape {weight.shape} "
                     f"and hidden {hidden.shape}; the weight is 2-D and "
                     "hidden ends in the model width.")
  d = weight.shape[1 - vocab_axis]
  if hidden.shape[-1] != d or hidden.shape[:-1] != labels.shape:
    raise ValueError(
        f"linear_cross_entropy: hidden {hidden.shape}, weight {weight.shape} "
        f"(vocab_axis={vocab_axis}) and labels {labels.shape} do not fit: "
        f"hidden must be [..., {d}] and labels its leading shape "
        f"{hidden.shape[:-1]}.")
  if where is not None and where.dtype != jnp.bool_:
    raise TypeError(f"linear_cross_entropy: where has dtype {where.dtype}; "
                    "give a boolean array (True for the tokens to count).")
  if where is not None and where.shape != labels.shape:
    raise ValueError(f"linear_cross_entropy: where has shape {where.shape}; "
                     f"give the labels' shape {labels.shape}.")


def _block(weight, i, size: int, vocab_axis: int):
  """Block `i` of the vocabulary: `(w [size, d], ids [size], live [size])`.
  The last block is moved back to end at the vocabulary's end (no padded
  copy of the weight); the rows it shares with the block before are not
  `live` there, so every word counts once."""
  vocab = weight.shape[vocab_axis]
  nominal = i * size
  start = jnp.minimum(nominal, vocab - size)
  w = jax.lax.dynamic_slice_in_dim(weight, start, size, axis=vocab_axis)
  ids = start + jnp.arange(size)
  return (w if vocab_axis == 0 else w.T), ids, ids >= nominal


def _forward(size, vocab_axis, h, weight, labels):
  """`(losses, lse)`: per token the log-sum-exp over the vocabulary and the
  loss `lse - logits[label]`, one block at a time."""
  blocks = math.ceil(weight.shape[vocab_axis] / size)

  def body(carry, i):
    w, ids, live = _block(weight, i, size, vocab_axis)
    hit = online_softmax.hit(ids, labels, live)
    logits = online_softmax.logits(h, w, live)
    return online_softmax.running_add(carry, logits, hit), None

  carry, _ = jax.lax.scan(body, online_softmax.running_start(h.shape[0]),
                          jnp.arange(blocks))
  return online_softmax.running_losses(carry)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _blocked(size, vocab_axis, h, weight, labels):
  return _forward(size, vocab_axis, h, weight, labels)[0]


def _blocked_fwd(size, vocab_axis, h, weight, labels):
  losses, lse = _forward(size, vocab_axis, h, weight, labels)
  return losses, (h, weight, labels, lse)


def _blocked_bwd(size, vocab_axis, residuals, g):
  """Per block: the logits again, their cotangent
  `g * (softmax - onehot(label))`, its products with the block's weight
  (added into the hidden cotangent) and with the hidden (the block's rows
  of the weight's cotangent, written in place)."""
  h, weight, labels, lse = residuals
  blocks = math.ceil(weight.shape[vocab_axis] / size)
  g = g.astype(jnp.float32)

  def body(carry, i):
    dh, dweight = carry
    w, ids, live = _block(weight, i, size, vocab_axis)
    # 0 where not live
    probs = jnp.exp(online_softmax.logits(h, w, live) - lse[:, None])
    hit = online_softmax.hit(ids, labels, live)
    dlogits = (probs - hit) * g[:, None]
    dh = dh + jnp.dot(dlogits, w.astype(jnp.float32))
    dw = jax.lax.dot_general(dlogits, h, (((0,), (0,)), ((), ())),
                             preferred_element_type=jnp.float32)
    start = ids[0]
    if vocab_axis == 1:
      dw = dw.T
    # the rows shared with the block before take 0 here (not live): added
    # to what that block wrote, so the sum is exact
    rows = jax.lax.dynamic_slice_in_dim(dweight, start, size, axis=vocab_axis)
    dweight = jax.lax.dynamic_update_slice_in_dim(
        dweight, (rows.astype(jnp.float32) + dw).astype(dweight.dtype), start,
        axis=vocab_axis)
    return (dh, dweight), None

  start = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(weight))
  (dh, dweight), _ = jax.lax.scan(body, start, jnp.arange(blocks))
  return dh.astype(h.dtype), dweight, None


_blocked.defvjp(_blocked_fwd, _blocked_bwd)
