"""Gather and scatter of chunk shards inside `shard_map`. Knows nothing of optax.

A chunk is sharded on its last axis. `gather` all-gathers it in the compute
dtype; its transpose reduce-scatters the gradient in the reduce dtype, so
gradients of gathered parameters arrive already sharded (ZeRO-3).
`gather_from_host` does the same for a shard kept in host memory, moving it
to the device right before the all-gather.
`scatter_on_backward` gives a replicated chunk the same backward (ZeRO-2):
the gradient is reduce-scattered as soon as the backward pass produces it.

On an axis of one device every collective here is the identity and emits
no collective op: XLA does not remove a one-device all-reduce, which on CPU
costs a copy of every gradient chunk (a 1-device mesh is how a user first
tries zerojax, and the benchmarks hold it to plain optax's speed).
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def _alone(axis_name) -> bool:
  return jax.lax.axis_size(axis_name) == 1


def all_gather(x, axis_name):
  """Concatenates the shards of `x` (last axis) from every device."""
  if _alone(axis_name):
    return x
  return jax.lax.all_gather(x, axis_name, axis=x.ndim - 1, tiled=True)


def reduce_scatter(x, axis_name):
  """Sums `x` over devices and keeps this device's slice of the last axis."""
  if _alone(axis_name):
    return x
  return jax.lax.psum_scatter(x, axis_name, scatter_dimension=x.ndim - 1,
                              tiled=True)


def all_reduce(x, axis_name):
  """Sums `x` over devices (stage 0's gradient reduction)."""
  return x if _alone(axis_name) else jax.lax.psum(x, axis_name)


def all_mean(x, axis_name):
  """Averages `x` over devices (the loss and aux metrics)."""
  return x if _alone(axis_name) else jax.lax.pmean(x, axis_name)


@partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3))
def gather(shard, axis_name, compute_dtype, reduce_dtype):
  """All-gathers a chunk shard, cast to `compute_dtype` before the wire.

  Backward: the chunk's gradient is cast to `reduce_dtype` and
  reduce-scattered, giving the (summed) gradient of this device's shard.
  """
  return all_gather(shard.astype(compute_dtype), axis_name)


def _gather_fwd(shard, axis_name, compute_dtype, reduce_dtype):
  # The residual is an empty array: it only carries the shard's dtype.
  return (gather(shard, axis_name, compute_dtype, reduce_dtype),
          jnp.zeros((0,), shard.dtype))


def _gather_bwd(axis_name, compute_dtype, reduce_dtype, like, g):
  del compute_dtype
  return (reduce_scatter(g.astype(reduce_dtype), axis_name).astype(like.dtype),)


gather.defvjp(_gather_fwd, _gather_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def gather_from_host(shard, grad_slot, axis_name, compute_dtype, reduce_dtype):
  """`gather` of a shard kept in host memory (`offload_params`): moved to
  device memory right before the all-gather.

  Differentiate with respect to `grad_slot` (zeros of the shard's shape and
  dtype, on the device): its gradient is the chunk gradient reduce-scattered,
  as `gather`'s, and stays on the device. The host shard gets none (JAX
  would otherwise send its gradient back to host memory).
  """
  del grad_slot
  on_device = jax.device_put(shard, jax.memory.Space.Device)
  return all_gather(on_device.astype(compute_dtype), axis_name)


def _from_host_fwd(shard, grad_slot, axis_name, compute_dtype, reduce_dtype):
  return (gather_from_host(shard, grad_slot, axis_name, compute_dtype,
                           reduce_dtype), jnp.zeros((0,), grad_slot.dtype))


def _from_host_bwd(axis_name, compute_dtype, reduce_dtype, like, g):
  del compute_dtype
  return None, reduce_scatter(g.astype(reduce_dtype), axis_name).astype(like.dtype)


gather_from_host.defvjp(_from_host_fwd, _from_host_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def scatter_on_backward(full, grad_slot, axis_name, reduce_dtype):
  """Identity on a replicated chunk whose gradient goes to `grad_slot`.

  Differentiate with respect to `grad_slot` (zeros of the shard's shape, in
  `reduce_dtype`): its gradient is the chunk gradient reduce-scattered in
  `reduce_dtype`, issued where the backward pass finishes the chunk.
  """
  del grad_slot
  return full


def _scatter_fwd(full, grad_slot, axis_name, reduce_dtype):
  del grad_slot
  return full, None


def _scatter_bwd(axis_name, reduce_dtype, res, g):
  del res
  return (jnp.zeros_like(g), reduce_scatter(g.astype(reduce_dtype), axis_name))


scatter_on_backward.defvjp(_scatter_fwd, _scatter_bwd)
