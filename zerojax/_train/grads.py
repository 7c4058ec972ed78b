"""Step 1 of a train step: gradients, loss and aux, in one `shard_map` over
the data axis (all of ZeRO's gradient communication is explicit here).

Per micro-batch (`accum_steps`: a `lax.scan`), `StagePolicy.forward` says
what the user's loss reads and `StagePolicy.reduction` how its gradient is
reduced:

  GATHERED           chunk shards gathered (`collectives.gather_leaves`,
                     from host memory `gather_from_host`); the blocks of a
                     model wrapped with `zerojax.nn.layerwise` gather their
                     own layer's shards. The gathers' transpose
                     reduce-scatters: gradients arrive sharded (stage 3).
  SCATTER_PER_MICRO  replicated chunks whose backward reduce-scatters each
                     chunk's gradient as soon as it is complete (stage 2).
  otherwise          replicated chunks, cast to the compute dtype; after the
                     micro-batches one all-reduce (stage 0) or one
                     reduce-scatter (stage 1).

The chunks are cut into the user's tree (`ChunkLayout.merge`) and the loss
is checked (a floating scalar; aux scalars or per-example arrays). Mutable
fields (`train_step(mutable=...)`, BatchNorm's `batch_stats`) go into the
loss beside the batch; their new values come back after each micro-batch,
floating ones averaged over the data axis (as Flax's examples `pmean`
them), others taken from the axis's first device, and feed the next one.
"""
from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from zerojax._comm import collectives
from zerojax._core import frozen
from zerojax._core import offload
from zerojax._model import peruse as peruse
from zerojax._options.config import batch_axes, manual_axes, shard_axes
from zerojax._options.policy import Forward, Reduction, policy
from zerojax._state.state import chunk_spec, state_shardings
from zerojax._train.model_call import (ModelCall, gather_modes,
                                       weight_normalizer)


def grads_and_metrics(loss_fn, has_aux, mutable, state, batch, rng, modes,
                      weighted: bool = False, held: frozenset = frozenset(),
                      heard: Optional[dict] = None):
  """Reduced gradient chunks (sharded, or replicated under ALL_REDUCE), the
  loss, the aux values, the new values of the `mutable` fields and the
  global batch's weight (None unless `weighted`); fills `modes` with how
  each chunk is gathered (`gather_modes`), and `heard` with the chunks a
  block or module could gather at its calls (`ModelCall.opted_in`; of
  which those in `held`, modules beside the blocks, `zerojax._model.peruse`,
  are held for the step instead), each to None, and the modules beside
  the blocks that cannot be gathered per use to why.

  The loss and its gradient are the mean of the devices' and micro-batches'
  losses, or with `weighted` (`loss_fn` returns `(sum, weight)`) the whole
  global batch's Σ sum / Σ weight: the summed gradients of the sums are
  divided by the weight all-reduced over the batch axes."""
  cfg, layout, mesh = state.config, state.layout, state.mesh
  pol = policy(cfg)
  ax = cfg.axis_name
  batch_ax = batch_axes(cfg)   # the data axis, and the replica axis (HSDP)
  split = tuple(chunk_spec(len(c.shape), shard_axes(cfg)) for c in layout.chunks)
  replicated = tuple(P() for _ in layout.chunks)
  params_in = forward_params(state)
  scale = (state.loss_scale.scale if state.loss_scale is not None
           else jnp.ones((), jnp.float32))
  with_rng = rng is not None
  # Shards kept in host memory are moved to the device by their gather (per
  # layer for layer chunks); their gradients go to device-side slots.
  host = host_chunks(state)
  scalar = []   # per aux value: a scalar (averaged) or per-example

  def local(params_in, rest, fields, batch, scale, *maybe_rng):
    dev_rng = (jax.random.fold_in(maybe_rng[0], jax.lax.axis_index(batch_ax))
               if with_rng else None)
    params_in, slotted = secondary_partition(state, params_in, host)
    forward = ModelCall(loss_fn, has_aux, mutable, state, pol, params_in, rest,
                       scale, slotted, with_rng, weighted)
    diff = forward.differentiated()
    k = cfg.accum_steps
    first = jax.tree_util.tree_map(lambda x: x[:x.shape[0] // k], batch)
    layerwise = forward.opted_in(diff, first, dev_rng, fields)
    if heard is not None:   # could gather at each use, or why held
      heard.update({c: None for c in layerwise})
      heard.update(forward.held_beside)
    layerwise -= held
    modes.update(gather_modes(layout, pol, layerwise,
                              peruse.chunks(layout, cfg)))
    # see [Note: a loss-scaled weighted loss]
    renormalize = (lambda loss: weight_normalizer(loss[1])) if (
        weighted and cfg.loss_scale is not None) else None
    grads, loss, aux, fields = _accumulate(
        jax.grad(functools.partial(forward, layerwise=layerwise), has_aux=True),
        diff, batch, dev_rng, fields, cfg.accum_steps, cfg.reduce_dtype,
        batch_ax, jnp.sum if weighted else jnp.mean, renormalize)
    quant = collectives.Wire.of(cfg).grads
    rows = [collectives.Wire.of(cfg, c).model for c in layout.chunks]
    if pol.reduction is Reduction.SCATTER_PER_STEP:
      grads = tuple(collectives.reduce_scatter(g, ax, quant, m)
                    for g, m in zip(grads, rows))
    elif pol.reduction is Reduction.ALL_REDUCE:
      grads = tuple(collectives.all_reduce(g, ax, quant, m)
                    for g, m in zip(grads, rows))
    if cfg.hpz:   # the state's shards are pieces of the data group's
      grads = tuple(collectives.reduce_scatter(g, cfg.replica_axis, quant, m)
                    for g, m in zip(grads, rows))
    elif cfg.replica_axis is not None:   # once per step, all chunks together
      grads = collectives.all_reduce(grads, cfg.replica_axis, quant, rows)
    if weighted:
      total, weight = (jax.lax.psum(x, batch_ax) for x in loss)
      grads = tuple(g / weight.astype(g.dtype) for g in grads)
      loss = total / weight
    else:
      n, weight = state.num_batch_shards, jnp.zeros((), jnp.float32)
      grads = tuple(g / (n * cfg.accum_steps) for g in grads)
      loss = collectives.all_mean(loss, batch_ax)
    return grads, loss, per_device(aux, batch_ax, scalar), fields, weight

  fields = {name: state.extras[name] for name in mutable}
  args = (params_in, state.rest, fields, batch, scale) + (
      (rng,) if with_rng else ())
  in_specs = ((split if pol.forward is Forward.GATHERED else replicated),
              frozen.specs(layout, cfg, mesh), P(), P(batch_ax), P()) + (
                  (P(),) if with_rng else ())
  out_specs = (split if pol.grads_sharded else replicated, P(), P(batch_ax), P(),
               P())
  grads, loss, aux, fields, weight = jax.shard_map(
      local, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
      check_vma=False, **manual_axes(cfg))(*args)
  return (grads, loss, taken_once(aux, scalar), fields,
          weight if weighted else None)


def forward_params(state) -> tuple:
  """Per chunk, what the forward reads (`StagePolicy.forward`): the compute
  copy, or the master; at stage 3 a chunk's sharded compute copy where it
  has one (`StagePolicy.sharded_compute`: its master is on disk)."""
  pol = policy(state.config)
  if pol.forward is Forward.COMPUTE:
    return state.compute
  if pol.sharded_compute:
    return tuple(m if x is None else x
                 for m, x in zip(state.master, state.compute))
  return state.master


def host_chunks(state) -> frozenset:
  """Chunks whose gathered shards (`forward_params`) stay in host memory
  until their gather."""
  if not policy(state.config).gathers_params:
    return frozenset()
  where = state_shardings(state)
  return frozenset(c for c, (m, x) in enumerate(zip(
      where.master, where.compute or (None,) * len(where.master)))
                   if (m if x is None else x).memory_kind == offload.HOST)


def secondary_partition(state, params_in, host) -> tuple:
  """Inside `shard_map`: `(the shards the forward gathers, the chunks
  gathered from shards that are not what is differentiated)`.

  Under hpZ at stage 3, each chunk's piece of the world (replica x data) is
  cast to the compute dtype and all-gathered over the replica axis into
  the data group's shard, ZeRO++'s secondary partition, once per step:
  every gather of the forward and the rematerialised backward then stays
  within the data axis. Its gradient goes to a zero slot, as a host
  shard's does (`collectives.gather_from_host`), in the master's dtype;
  the step reduce-scatters it over the replica axis. Otherwise the shards
  as they are, and the chunks kept in host memory (`host`)."""
  cfg = state.config
  if not (cfg.hpz and policy(cfg).gathers_params):
    return params_in, host
  secondary = []
  for c, p in enumerate(params_in):
    if c in host:
      p = jax.device_put(p, jax.memory.Space.Device)
    wire = collectives.Wire.of(cfg, state.layout.chunks[c])
    secondary.append(collectives.all_gather(
        p.astype(cfg.compute_dtype), cfg.replica_axis, wire.weights,
        wire.model))
  return tuple(secondary), frozenset(range(len(params_in)))


def per_device(tree, axis_name, scalar: list):
  """Inside `shard_map`: `tree`'s values (aux, evaluation outputs), each to
  leave with a leading device axis: per-example values concatenated over
  the global batch, scalars averaged over the devices (in float32), to be
  taken once by `taken_once`. Appends which are scalars to `scalar`."""
  scalar.append(jax.tree_util.tree_map(lambda a: a.ndim == 0, tree))
  return jax.tree_util.tree_map(
      lambda a: jnp.reshape(collectives.all_mean(jnp.asarray(a, jnp.float32),
                                                 axis_name), (1,))
      if a.ndim == 0 else a, tree)


def taken_once(tree, scalar: list):
  """Outside `shard_map`: `per_device`'s values, scalars taken once."""
  return jax.tree_util.tree_map(lambda a, one: a[0] if one else a, tree,
                                scalar[-1])


def _accumulate(grad_fn, diff, batch, dev_rng, fields, k: int, reduce_dtype,
                axis_name, combine=jnp.mean, renormalize=None):
  """`(summed gradients in reduce_dtype, loss, aux, fields)` over `k`
  micro-batches of this device's batch, in sequence: each reads the mutable
  `fields` the previous one wrote (`_agreed`). The micro-batches' losses
  are put together by `combine` (a weighted loss's sums and weights are
  added); per-example aux values in batch order, scalars averaged. With
  `renormalize` (of a micro-batch's loss), each micro-batch's gradient is
  multiplied by it in the reduce dtype ([Note: a loss-scaled weighted
  loss])."""
  def to_reduce(g, loss):
    g = tuple(x.astype(reduce_dtype) for x in g)
    if renormalize is None:
      return g
    factor = renormalize(loss)
    return tuple(x * factor.astype(reduce_dtype) for x in g)

  if k == 1:
    grads, (loss, aux, updates) = grad_fn(diff, batch, dev_rng, fields)
    return (to_reduce(grads, loss), loss, aux,
            _agreed(fields, updates, axis_name))
  micro = jax.tree_util.tree_map(
      lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

  def body(carry, xs):
    acc, fields = carry
    i, micro_batch = xs
    micro_rng = jax.random.fold_in(dev_rng, i) if dev_rng is not None else None
    g, (loss, aux, updates) = grad_fn(diff, micro_batch, micro_rng, fields)
    acc = jax.tree_util.tree_map(jnp.add, acc, to_reduce(g, loss))
    return (acc, _agreed(fields, updates, axis_name)), (loss, aux)

  zeros = tuple(jnp.zeros(np.shape(d), reduce_dtype) for d in diff)
  (grads, fields), (losses, auxes) = jax.lax.scan(
      body, (zeros, fields), (jnp.arange(k), micro))
  # per-example values [k, micro, ...] in batch order; scalars averaged
  aux = jax.tree_util.tree_map(
      lambda a: jnp.reshape(a, (-1,) + a.shape[2:]) if a.ndim > 1
      else jnp.mean(a, axis=0), auxes)
  return (grads, jax.tree_util.tree_map(lambda x: combine(x, axis=0), losses),
          aux, fields)


def _agreed(fields, updates, axis_name) -> dict:
  """The mutable fields after a micro-batch: `updates` over `fields`, alike
  on every device: floating values averaged over the data axis, others the
  axis's first device's (they should agree; `collectives.from_first`)."""
  def one(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
      return collectives.all_mean(x, axis_name)
    return collectives.from_first(x, axis_name)
  return {**fields, **{name: jax.tree_util.tree_map(one, new)
                       for name, new in updates.items()}}
