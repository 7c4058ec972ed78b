"""Gather and scatter of chunk shards inside `shard_map`. Knows nothing of optax.

A chunk is sharded on its last axis. `gather` all-gathers it in the compute
dtype; its transpose reduce-scatters the gradient in the reduce dtype, so
gradients of gathered parameters arrive already sharded (ZeRO-3).
`gather_from_host` does the same for a shard kept in host memory, moving it
to the device right before the all-gather. `gather_leaves` gathers a chunk
held for the whole step and cuts it into its leaves, each in a buffer of its
own, so that the gathered chunk is freed at once.
`scatter_on_backward` gives a replicated chunk the same backward (ZeRO-2):
the gradient is reduce-scattered as soon as the backward pass produces it.

Each takes a `Wire`: the compute and reduce dtypes, and whether parameter
gathers (qwZ) and gradient reduce-scatters (qgZ) are sent quantized
(`zerojax._comm.quantize`).

Tensor parallelism (`ZeroConfig.model_axis`): the step's `shard_map` is
manual over the data axis only, and a chunk of model rows (`[..., M,
length]`) arrives with its rows on the automatic model axis. Left to GSPMD,
a data-axis collective on it first gathers the rows over the model axis
(measured: an all-gather of every shard over "model" before the data
gather, and one of every gradient before its reduce-scatter). So its
collectives run inside a nested `shard_map` manual over the model axis too
(`_per_row`): each device moves its own row, and no collective spans the
model axis.

On an axis of one device every collective here is the identity and emits
no collective op: XLA does not remove a one-device all-reduce, which on CPU
costs a copy of every gradient chunk (a 1-device mesh is how a user first
tries zerojax, and the benchmarks hold it to plain optax's speed).
"""
from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any, Optional

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from zerojax._comm import quantize
from zerojax._comm.quantize import Quantization


@dataclasses.dataclass(frozen=True)
class Wire:
  """How chunks travel: gathered in `compute_dtype`, gradients reduced in
  `reduce_dtype`; `weights` / `grads`: the quantization of parameter gathers
  and gradient reduce-scatters (None: sent as they are)."""
  compute_dtype: Any
  reduce_dtype: Any
  weights: Optional[Quantization] = None
  grads: Optional[Quantization] = None
  model: Optional[str] = None   # the chunk's rows' mesh axis, if it has rows

  @classmethod
  def of(cls, config, chunk=None) -> "Wire":
    """The config's wire; for `chunk` (a `layout.Chunk`), with its model
    rows' axis when it has rows."""
    rows = chunk is not None and chunk.model_shards
    return cls(config.compute_dtype, config.reduce_dtype,
               quantize.of(config.quantize_weights, config.quantize_block),
               quantize.of(config.quantize_grads, config.quantize_block),
               config.model_axis if rows else None)


def _alone(axis_name) -> bool:
  return jax.lax.axis_size(axis_name) == 1


def _per_row(fn, x, model: Optional[str]):
  """`fn(x)`, for a chunk of model rows (`x`: `[..., M, length]`, rows on
  the automatic axis `model`) run on each device's own row (see the module
  docstring)."""
  if model is None:
    return fn(x)
  spec = P(*([None] * (x.ndim - 2)), model, None)
  return jax.shard_map(fn, in_specs=spec, out_specs=spec,
                       axis_names=frozenset({model}), check_vma=False)(x)


def all_gather(x, axis_name, quant: Optional[Quantization] = None,
               model: Optional[str] = None):
  """Concatenates the shards of `x` (last axis) from every device, sent
  quantized under `quant`; per row for a chunk of `model` rows."""
  if _alone(axis_name):
    return x
  if quant is not None:
    return _per_row(lambda x: quantize.all_gather(x, axis_name, quant), x, model)
  return _per_row(lambda x: jax.lax.all_gather(x, axis_name, axis=x.ndim - 1,
                                               tiled=True), x, model)


def reduce_scatter(x, axis_name, quant: Optional[Quantization] = None,
                   model: Optional[str] = None):
  """Sums `x` over devices and keeps this device's slice of the last axis,
  the slices sent quantized under `quant`; per row for a chunk of `model`
  rows."""
  if _alone(axis_name):
    return x
  if quant is not None:
    return _per_row(lambda x: quantize.reduce_scatter(x, axis_name, quant,
                                                      x.dtype), x, model)
  return _per_row(lambda x: jax.lax.psum_scatter(
      x, axis_name, scatter_dimension=x.ndim - 1, tiled=True), x, model)


def all_reduce(x, axis_name, quant: Optional[Quantization] = None,
               model: Optional[str] = None):
  """Sums `x` (an array, or a tuple of them with `model` None or one per
  array) over devices: stage 0's gradient reduction, and HSDP's over the
  replica axis. Under `quant`, each array is reduce-scattered and gathered
  back quantized (`quantize.all_reduce`); otherwise one all-reduce (of all
  the arrays of a tuple together); per row for a chunk of `model` rows."""
  if _alone(axis_name):
    return x
  if isinstance(x, tuple):
    if quant is None:
      # one variadic all-reduce: an all-reduce sums a row where it lies, so
      # GSPMD moves no row of a tuple's row chunks over the model axis
      return jax.lax.psum(x, axis_name)
    models = model if isinstance(model, (tuple, list)) else (model,) * len(x)
    return tuple(all_reduce(a, axis_name, quant, m) for a, m in zip(x, models))
  if quant is not None:
    return _per_row(lambda a: quantize.all_reduce(a, axis_name, quant), x, model)
  return _per_row(lambda x: jax.lax.psum(x, axis_name), x, model)


def all_mean(x, axis_name):
  """Averages `x` over devices (the loss and aux metrics)."""
  return x if _alone(axis_name) else jax.lax.pmean(x, axis_name)


def from_first(x, axis_name):
  """The first device's `x` on every device (values that must agree, such as
  a non-floating mutable field): a sum with zeros from the others."""
  if _alone(axis_name):
    return x
  first = jax.lax.axis_index(axis_name) == 0
  wide = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
  out = jax.lax.psum(jnp.where(first, wide, jnp.zeros_like(wide)), axis_name)
  return out.astype(x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def gather(shard, axis_name, wire: Wire):
  """All-gathers a chunk shard, cast to `compute_dtype` before the wire.

  Backward: the chunk's gradient is cast to `reduce_dtype` and
  reduce-scattered, giving the (summed) gradient of this device's shard.
  """
  return all_gather(shard.astype(wire.compute_dtype), axis_name, wire.weights,
                    wire.model)


def _gather_fwd(shard, axis_name, wire):
  # The residual is an empty array: it only carries the shard's dtype.
  return gather(shard, axis_name, wire), jnp.zeros((0,), shard.dtype)


def _gather_bwd(axis_name, wire, like, g):
  return (_scatter_grad(g, axis_name, wire).astype(like.dtype),)


def _scatter_grad(g, axis_name, wire):
  return reduce_scatter(g.astype(wire.reduce_dtype), axis_name, wire.grads,
                        wire.model)


gather.defvjp(_gather_fwd, _gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 3, 4))
def gather_leaves(layout, c, shard, axis_name, wire: Wire):
  """`gather` of chunk `c`'s shard, cut into the chunk's leaves
  (`layout.unpack_chunk`), for a chunk the step holds gathered throughout.

  Each leaf is written to a buffer of its own right after the all-gather
  (`_own_buffers`), so the gathered chunk dies there. Cut by a plain split,
  XLA fuses the cut of a leaf into the op that reads it, and the whole
  gathered chunk then stays alive beside the leaves already cut from it
  (twice the chunk's bytes) until the last such op, in the backward pass
  for a leaf the backward reads.

  Backward: the leaves' gradients are concatenated into the chunk's
  (`layout.pack_chunk`, in `reduce_dtype`) and reduce-scattered, as
  `gather`'s.
  """
  full = all_gather(shard.astype(wire.compute_dtype), axis_name, wire.weights,
                    wire.model)
  return _own_buffers(lambda f: layout.unpack_chunk(c, f), full, axis_name)


def _own_buffers(cut, full, axis_name):
  """`cut(full)`, its parts computed into buffers of their own before any of
  them is read. A single part that is all of `full` is a reshape (a bitcast
  in XLA, no copy) and is returned as is."""
  shapes = jax.eval_shape(cut, full)
  if len(shapes) == 1 and shapes[0].size == full.size:
    return cut(full)

  def on_cpu(full):
    # XLA fuses nothing across a conditional's boundary, so the parts are
    # the conditional's results. The predicate is true on every device and
    # unknown to XLA before run time (CPU XLA drops optimization barriers
    # before fusion, so those cannot do it there).
    return jax.lax.cond(jax.lax.axis_index(axis_name) >= 0, cut,
                        lambda f: [jnp.zeros(x.shape, x.dtype) for x in shapes],
                        full)

  def elsewhere(full):
    # an accelerator's XLA keeps barriers through fusion (no predicate to
    # read back to the host)
    return jax.lax.optimization_barrier(cut(full))

  return jax.lax.platform_dependent(full, cpu=on_cpu, default=elsewhere)


def _leaves_fwd(layout, c, shard, axis_name, wire):
  # The residual is an empty array: it only carries the shard's dtype.
  return (gather_leaves(layout, c, shard, axis_name, wire),
          jnp.zeros((0,), shard.dtype))


def _leaves_bwd(layout, c, axis_name, wire, like, cts):
  grad = layout.pack_chunk(c, dict(zip(layout.chunks[c].leaves, cts)),
                           wire.reduce_dtype)
  return (_scatter_grad(grad, axis_name, wire).astype(like.dtype),)


gather_leaves.defvjp(_leaves_fwd, _leaves_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def gather_from_host(shard, grad_slot, axis_name, wire: Wire):
  """`gather` of a shard kept in host memory (`offload_params`): moved to
  device memory right before the all-gather.

  Differentiate with respect to `grad_slot` (zeros of the shard's shape and
  dtype, on the device): its gradient is the chunk gradient reduce-scattered,
  as `gather`'s, and stays on the device. The host shard gets none (JAX
  would otherwise send its gradient back to host memory).
  """
  del grad_slot
  on_device = jax.device_put(shard, jax.memory.Space.Device)
  return all_gather(on_device.astype(wire.compute_dtype), axis_name,
                    wire.weights, wire.model)


def _from_host_fwd(shard, grad_slot, axis_name, wire):
  return (gather_from_host(shard, grad_slot, axis_name, wire),
          jnp.zeros((0,), grad_slot.dtype))


def _from_host_bwd(axis_name, wire, like, g):
  return None, _scatter_grad(g, axis_name, wire).astype(like.dtype)


gather_from_host.defvjp(_from_host_fwd, _from_host_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def scatter_on_backward(full, grad_slot, axis_name, wire: Wire):
  """Identity on a replicated chunk whose gradient goes to `grad_slot`.

  Differentiate with respect to `grad_slot` (zeros of the shard's shape, in
  `reduce_dtype`): its gradient is the chunk gradient reduce-scattered in
  `reduce_dtype`, issued where the backward pass finishes the chunk.
  """
  del grad_slot
  return full


def _scatter_fwd(full, grad_slot, axis_name, wire):
  del grad_slot
  return full, None


def _scatter_bwd(axis_name, wire, res, g):
  del res
  return jnp.zeros_like(g), _scatter_grad(g, axis_name, wire)


scatter_on_backward.defvjp(_scatter_fwd, _scatter_bwd)
