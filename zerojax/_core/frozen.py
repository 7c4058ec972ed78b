"""Frozen weights: the floating leaves `ZeroConfig.frozen` keeps out of the
chunks, stored once in the compute dtype and, at stage 3, split over the
data axis.

A frozen weight has no master copy, no gradient and no optimizer state: it
is stored in the compute dtype (never widened: a leaf already narrower keeps
its dtype), replicated at stages 0-2 and, at stage 3, split on its largest
dim the data axis's device count divides (a layer stack's layer axis
excepted), as GSPMD's FSDP splits a leaf. It stays a leaf of the state's
`rest` (so a checkpoint holds it as an ordinary sharded array, restorable on
any device count); a step gathers it with `gather`, from a stop-gradient
shard: no cotangent reaches it, so the backward pass computes no gradient
for it and sends no reduce-scatter. A block gathered per call
(`zerojax.nn`) gathers the frozen weights under it in its call too, and
again in its backward pass; every other frozen weight is gathered once for
the step.

With `ZeroConfig.frozen_dtype="int8"` a frozen matrix (two dims or more
per layer) is stored block-quantized instead: a pair `(values, absmax)`,
int8 values and a float32 absmax per block of its last dim
(`zerojax._comm.quantize`'s block quantizer; `quantize_block` elements, or the
largest divisor of the dim below that, down to 32, so that no block is
padded; else the last dim padded to whole blocks), both split on the same dim (never the last), gathered as they are
(half the bytes of bf16 on the wire) and dequantized to the compute dtype
after the gather. The pair carries its block size (values' last dim /
absmax's), so it is read back without the config.

Leaves outside the chunks that are not frozen weights (integers, empty
leaves, complex frozen leaves) stay as they are, replicated.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._comm import quantize
from zerojax._core import reshard
from zerojax._options.policy import policy

# the name of the function whose outputs a per-block remat never saves: the
# parameters a block gathers (`zerojax._model.gather._regathering`)
GATHERED = "_zerojax_gathered_leaves"


def is_weight(info) -> bool:
  """Whether leaf `info` (a `layout.LeafInfo` outside the chunks) is a
  frozen weight: floating and not empty."""
  return (jnp.issubdtype(info.dtype, jnp.floating)
          and int(np.prod(info.shape, dtype=np.int64)) > 0)


def quantized(info, config) -> bool:
  """Whether frozen weight `info` is stored as int8 blocks: a matrix (two
  dims or more per layer) under `frozen_dtype="int8"`."""
  per_layer = len(info.shape) - (1 if info.stacked else 0)
  return (config.frozen_dtype == "int8" and is_weight(info)
          and per_layer >= 2)


def _blocks(info, config) -> quantize.Quantization:
  """Int8 blocks of `quantize_block` elements, or of the largest divisor
  of the matrix's last dim below it (down to 32) so that no block is
  padded: a 384-wide matrix in blocks of 128, not of 256 padded to 512."""
  fits = math.gcd(info.shape[-1], config.quantize_block)
  return quantize.Quantization(
      "int8", fits if fits >= 32 else config.quantize_block)


def stored_dtype(info, config):
  """The dtype leaf `info` is stored in (int8 pairs aside): a frozen
  weight's, the narrower of its own and the compute dtype; any other
  leaf's own."""
  own, compute = np.dtype(info.dtype), np.dtype(config.compute_dtype)
  if is_weight(info) and compute.itemsize < own.itemsize:
    return compute
  return own


def split_dim(info, config, n: int) -> Optional[int]:
  """The dim frozen weight `info` is split on over the data axis (`n`
  devices) at stage 3: its largest `n` divides (not a layer stack's layer
  axis, nor an int8 matrix's last dim, which holds its blocks); None
  (replicated) below stage 3, for other leaves, or when no dim divides."""
  if not (policy(config).gathers_params and is_weight(info)) or n == 1:
    return None
  first = 1 if info.stacked else 0
  last = len(info.shape) - (1 if quantized(info, config) else 0)
  dims = [d for d in range(first, last) if info.shape[d] % n == 0]
  return max(dims, key=lambda d: (info.shape[d], -d)) if dims else None


def split_dims(layout, config, mesh) -> tuple:
  """Per leaf outside the chunks (`layout.rest_indices` order), `split_dim`."""
  n = mesh.shape[config.axis_name]
  return tuple(split_dim(layout.leaves[i], config, n)
               for i in layout.rest_indices)


def spec(ndim: int, dim: Optional[int], axis_name) -> P:
  """The `PartitionSpec` of a leaf of `ndim` dims split on `dim` over
  `axis_name` (replicated when `dim` is None)."""
  if dim is None:
    return P()
  return P(*[axis_name if d == dim else None for d in range(ndim)])


def specs(layout, config, mesh) -> tuple:
  """Per leaf outside the chunks, its `PartitionSpec` over the data axis (a
  `shard_map`'s in_specs): a pair of them for an int8 matrix."""
  out = []
  for i, d in zip(layout.rest_indices, split_dims(layout, config, mesh)):
    info = layout.leaves[i]
    one = spec(len(info.shape), d, config.axis_name)
    out.append((one, one) if quantized(info, config) else one)
  return tuple(out)


def shardings(layout, config, mesh) -> tuple:
  """Per leaf outside the chunks, its `NamedSharding`(s) in the state."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s),
                                specs(layout, config, mesh))


def _store(info, config, x):
  """Leaf `x` (an array or a shape) as the state stores it."""
  if quantized(info, config):
    encode = lambda v: quantize.encode(v, _blocks(info, config))
    return (jax.eval_shape(encode, x) if isinstance(x, jax.ShapeDtypeStruct)
            else encode(x))
  dtype = stored_dtype(info, config)
  if np.dtype(x.dtype) == dtype:
    return x
  return (jax.ShapeDtypeStruct(x.shape, dtype)
          if isinstance(x, jax.ShapeDtypeStruct) else x.astype(dtype))


def stored(layout, config, rest) -> tuple:
  """The leaves outside the chunks (arrays, or shapes; inside `jit` or
  `eval_shape`) as the state stores them: frozen weights cast to
  `stored_dtype`, or int8 pairs."""
  return tuple(_store(layout.leaves[i], config, x)
               for i, x in zip(layout.rest_indices, rest))


def place(layout, config, rest, where) -> tuple:
  """`stored(rest)` placed in the state's shardings `where`, each device
  sent its part only: a host leaf is cast (or split) on the host first, an
  int8 matrix quantized by a program whose input is already split."""
  out = []
  for i, x, s in zip(layout.rest_indices, rest, where):
    info = layout.leaves[i]
    if quantized(info, config):
      split = (jax.device_put(x, s[0]) if isinstance(x, np.ndarray)
               else reshard.copy(x, s[0]))
      out.append(_encoder(_blocks(info, config), tuple(s))(split))
    elif isinstance(x, np.ndarray):
      out.append(jax.device_put(np.asarray(x, stored_dtype(info, config)), s))
    else:
      out.append(reshard.copy(_store(info, config, x), s))
  return tuple(out)


@functools.lru_cache(maxsize=None)
def _encoder(blocks: quantize.Quantization, where: tuple):
  """A jitted int8 quantizer into shardings `where` (values, absmax): one
  per block size and placement, so `place` compiles once per matrix shape,
  not once per matrix."""
  return jax.jit(lambda v: quantize.encode(v, blocks), out_shardings=where)


def _decoded(entry, info, dtype, xp=jnp):
  """A stored leaf as a whole array of `dtype`: an int8 pair dequantized
  (its block size read from its shapes), any other leaf cast. Two float32
  products, `q * (absmax * (1 / 127))`, not `quantize.decode`'s division,
  which XLA may rewrite per program: every program (and numpy) reads the
  same values from the same pair. A block's ±127 is ±absmax exactly, so
  quantizing the values read gives the pair back (a restore onto another
  layout does)."""
  if isinstance(entry, (tuple, list)):
    values, absmax = entry
    level = quantize.level("int8")
    scale = absmax.reshape(absmax.shape + (1,))
    blocks = values.astype(xp.float32).reshape(absmax.shape + (-1,))
    out = xp.where(xp.abs(blocks) == level, xp.sign(blocks) * scale,
                   blocks * (scale * np.float32(1 / level)))
    out = out.reshape(values.shape)
    return out[..., :info.shape[-1]].astype(dtype)
  return entry.astype(dtype)


def leaf(entry, info, xp=jnp):
  """Leaf `info` from its stored `entry`, in its own dtype: an int8 pair
  dequantized, a frozen weight cast back. Arrays anywhere (jax ops keep
  their sharding), or with `xp=numpy` host arrays on the host."""
  return _decoded(entry, info, info.dtype, xp)


def restored(layout, rest) -> tuple:
  """The leaves outside the chunks in their own dtypes (`leaf`): what
  `gather_params`, exports and restores onto another layout read."""
  return tuple(leaf(x, layout.leaves[i])
               for i, x in zip(layout.rest_indices, rest))


def gather(shard, dim: int, axis_name):
  """Inside `shard_map`: frozen weight `shard` (an array or an int8 pair),
  split on `dim`, all-gathered whole over `axis_name`, with no gradient
  (one `custom_vjp` named `GATHERED`, which a per-block remat recomputes:
  gathers again)."""
  def whole(x):
    return jax.tree_util.tree_map(
        lambda a: jax.lax.all_gather(a, axis_name, axis=dim, tiled=True), x)
  whole.__name__ = GATHERED
  call = jax.custom_vjp(whole)
  call.defvjp(lambda x: (call(x), None), lambda _, g: (None,))
  return call(jax.lax.stop_gradient(shard))


def read(entry, info, config, dim: Optional[int], axis_name):
  """Inside `shard_map`: a leaf outside the chunks as the model reads it:
  gathered if split (`gather`), an int8 pair dequantized to the compute
  dtype."""
  if dim is not None:
    entry = gather(entry, dim, axis_name)
  if isinstance(entry, (tuple, list)):
    return _decoded(entry, info, config.compute_dtype)
  return entry
