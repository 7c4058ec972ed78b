"""ZeRO++'s quantized collectives (Wang et al., 2023): block-wise symmetric
quantization of what a gather or a reduce-scatter puts on the wire.

Per block of `block` elements along the last axis, `absmax = max |x|`, and
each value is sent as `round(x / absmax · L)` with L = 127 (int8) or 7
(int4, two values packed per byte), beside the block's absmax in float32;
the receiver computes `q · absmax / L` (a block's ±L exactly ±absmax). The error per element is at most
`absmax / (2L)` (half a step), zeros and constant blocks come back exactly,
and a block holding an inf or a NaN comes back non-finite (its absmax is
non-finite), so a loss-scale check still sees it. A block whose absmax is
denormal comes back as zeros where the backend flushes denormals (XLA's CPU
and GPU backends do): an error below the smallest normal float. A length
that is not a whole number of blocks is padded with zeros to one (the
padding is sent, and dropped on arrival).

"identity" sends the values unchanged beside unit scales through the same
code: the tests' exact encoding.

`all_gather` (qwZ) gathers the quantized shards and scales together and
dequantizes on arrival. `reduce_scatter` (qgZ) quantizes each device's
slice for every other device, exchanges them with one `all_to_all` and sums
the dequantized slices locally in float32, so quantization error is not
compounded over the hops of a ring. `all_reduce` (stage 0's gradient
reduction, and HSDP's over the replica axis) is that reduce-scatter
followed by that gather of the summed slices: every device decodes the
same bytes, so the replicas stay equal.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp

_LEVELS = {"int8": 127, "int4": 7}


@dataclasses.dataclass(frozen=True)
class Quantization:
  """What one kind of collective sends: `mode` ("int8", "int4",
  "identity") in blocks of `block` elements."""
  mode: str
  block: int


def of(mode: Optional[str], block: int) -> Optional[Quantization]:
  return None if mode is None else Quantization(mode, int(block))


def level(mode: str) -> int:
  """The largest quantized magnitude of `mode` ("int8": 127, "int4": 7)."""
  return _LEVELS[mode]


def padded(n: int, q: Quantization) -> int:
  """`n` rounded up to whole blocks (an even count of values for int4)."""
  unit = q.block * (2 if q.mode == "int4" and q.block % 2 else 1)
  return -(-n // unit) * unit


def encode(x, q: Quantization):
  """`(values, absmax)` of `x` along its last axis: values int8 (uint8,
  packed in pairs, for int4; `x` itself for identity), absmax float32 per
  block `[..., blocks]`. The last axis is padded to whole blocks."""
  n = x.shape[-1]
  pad = padded(n, q) - n
  if pad:
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])
  if q.mode == "identity":
    return x, jnp.ones(x.shape[:-1] + (x.shape[-1] // q.block,), jnp.float32)
  blocks = x.astype(jnp.float32).reshape(x.shape[:-1] + (-1, q.block))
  absmax = jnp.max(jnp.abs(blocks), axis=-1)
  level = _LEVELS[q.mode]
  # x / absmax first: a denormal absmax would overflow level / absmax
  safe = jnp.where(absmax > 0, absmax, 1.0)[..., None]
  values = jnp.where(absmax[..., None] > 0,
                     jnp.round(jnp.clip(blocks / safe, -1.0, 1.0) * level), 0.0)
  values = values.astype(jnp.int8).reshape(x.shape)
  return (pack_int4(values) if q.mode == "int4" else values), absmax


def pack_int4(values):
  """int8 values in [-8, 7] (last axis of even length), two per uint8: the
  first in the low nibble."""
  nibbles = (values + 8).astype(jnp.uint8).reshape(values.shape[:-1] + (-1, 2))
  return nibbles[..., 0] | (nibbles[..., 1] << 4)


def unpack_int4(packed):
  """`pack_int4`'s inverse: int8 values, twice as many."""
  low = (packed & 0xF).astype(jnp.int8) - 8
  high = (packed >> 4).astype(jnp.int8) - 8
  return jnp.stack([low, high], axis=-1).reshape(packed.shape[:-1] + (-1,))


def decode(values, absmax, n: int, q: Quantization, dtype):
  """`encode`'s inverse: the first `n` elements of the last axis, in
  `dtype`."""
  if q.mode == "identity":
    return values[..., :n].astype(dtype)
  if q.mode == "int4":
    values = unpack_int4(values)
  blocks = values.astype(jnp.float32).reshape(absmax.shape + (q.block,))
  level = _LEVELS[q.mode]
  scale = absmax[..., None]
  # the extremes exactly (XLA may turn / level into * (1 / level)), so a
  # block's absmax, and a constant block, come back as they went
  out = jnp.where(jnp.abs(blocks) == level, jnp.sign(blocks) * scale,
                  blocks * scale / level).reshape(values.shape)
  return out[..., :n].astype(dtype)


def all_gather(x, axis_name, q: Quantization):
  """Inside `shard_map`: the tiled all-gather of `x` along its last axis,
  sent quantized (values and scales in one gather each) and dequantized to
  `x.dtype` on arrival."""
  n = x.shape[-1]
  values, absmax = encode(x, q)
  values = jax.lax.all_gather(values, axis_name, axis=x.ndim - 1)
  absmax = jax.lax.all_gather(absmax, axis_name, axis=x.ndim - 1)
  # [..., devices, padded]: each device's part decoded, its padding dropped
  out = decode(values, absmax, n, q, x.dtype)
  return out.reshape(x.shape[:-1] + (-1,))


def reduce_scatter(x, axis_name, q: Quantization, out_dtype):
  """Inside `shard_map`: this device's slice of the sum of `x` over
  `axis_name` (tiled along the last axis, as `psum_scatter`): every
  device's slices quantized, exchanged by one `all_to_all`, dequantized and
  summed here in float32, in device order."""
  devices = jax.lax.axis_size(axis_name)
  n = x.shape[-1] // devices
  rows = jnp.moveaxis(x.reshape(x.shape[:-1] + (devices, n)), -2, 0)
  values, absmax = encode(rows, q)
  values = jax.lax.all_to_all(values, axis_name, 0, 0, tiled=True)
  absmax = jax.lax.all_to_all(absmax, axis_name, 0, 0, tiled=True)
  parts = decode(values, absmax, n, q, jnp.float32)
  total = parts[0]
  for part in parts[1:]:
    total = total + part
  return total.astype(out_dtype)


def all_reduce(x, axis_name, q: Quantization):
  """Inside `shard_map`: the sum of `x` over `axis_name` on every device, as
  `reduce_scatter` and then `all_gather` of the summed slices, both sent
  quantized (the last axis padded with zeros to a multiple of the
  devices)."""
  devices = jax.lax.axis_size(axis_name)
  n = x.shape[-1]
  pad = -n % devices
  wide = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)]) if pad else x
  part = reduce_scatter(wide, axis_name, q, x.dtype)
  return all_gather(part, axis_name, q)[..., :n]
