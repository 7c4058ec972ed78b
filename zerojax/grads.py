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
is checked (a floating scalar; aux scalars or per-example arrays).
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from jax.sharding import PartitionSpec as P

from zerojax import collectives, offload
from zerojax import nn as zero_nn
from zerojax.policy import Forward, Reduction, StagePolicy, policy
from zerojax.state import chunk_spec, state_shardings

_log = logging.getLogger("zerojax")
# metrics the step writes itself; a dict aux is merged beside them
METRICS = ("loss", "grad_norm", "loss_scale", "skipped")
# the reduction after the micro-batches; the other reductions happen in the
# backward pass (the gathers' transposes, `scatter_on_backward`)
_PER_STEP = {Reduction.ALL_REDUCE: collectives.all_reduce,
             Reduction.SCATTER_PER_STEP: collectives.reduce_scatter}


def grads_and_metrics(loss_fn, has_aux, state, batch, rng, modes):
  """Reduced gradient chunks (sharded, or replicated under ALL_REDUCE), the
  mean loss and the aux values; fills `modes` with how each chunk is
  gathered (`gather_modes`)."""
  cfg, layout, mesh = state.config, state.layout, state.mesh
  pol = policy(cfg)
  ax = cfg.axis_name
  split = tuple(chunk_spec(len(c.shape), ax) for c in layout.chunks)
  replicated = tuple(P() for _ in layout.chunks)
  params_in = state.compute if pol.forward is Forward.COMPUTE else state.master
  scale = (state.loss_scale.scale if state.loss_scale is not None
           else jnp.ones((), jnp.float32))
  with_rng = rng is not None
  # Shards kept in host memory are moved to the device by their gather (per
  # layer for layer chunks); their gradients go to device-side slots.
  host = (frozenset(c for c, s in enumerate(state_shardings(state).master)
                    if s.memory_kind == offload.HOST)
          if pol.gathers_params else frozenset())
  scalar = []   # per aux value: a scalar (averaged) or per-example

  def local(params_in, rest, batch, scale, *maybe_rng):
    dev_rng = (jax.random.fold_in(maybe_rng[0], jax.lax.axis_index(ax))
               if with_rng else None)
    forward = _Forward(loss_fn, has_aux, state, pol, params_in, rest, scale,
                       host, with_rng)
    diff = forward.differentiated()
    layerwise = forward.opted_in(diff, batch, dev_rng)
    modes.update(gather_modes(layout, pol, layerwise))
    grads, loss, aux = _accumulate(
        jax.grad(functools.partial(forward, layerwise=layerwise), has_aux=True),
        diff, batch, dev_rng, cfg.accum_steps, cfg.reduce_dtype)
    if pol.reduction in _PER_STEP:
      grads = tuple(_PER_STEP[pol.reduction](g, ax) for g in grads)
    n = mesh.shape[ax]
    grads = tuple(g / (n * cfg.accum_steps) for g in grads)
    loss = collectives.all_mean(loss, ax)
    # Every aux value leaves with a leading device axis: per-example values
    # are concatenated over the global batch, scalars are averaged over the
    # devices and taken once below.
    scalar.append(jax.tree_util.tree_map(lambda a: a.ndim == 0, aux))
    aux = jax.tree_util.tree_map(
        lambda a: jnp.reshape(collectives.all_mean(jnp.asarray(a, jnp.float32), ax),
                              (1,)) if a.ndim == 0 else a, aux)
    return grads, loss, aux

  args = (params_in, state.rest, batch, scale) + ((rng,) if with_rng else ())
  in_specs = ((split if pol.forward is Forward.GATHERED else replicated),
              P(), P(ax), P()) + ((P(),) if with_rng else ())
  out_specs = (split if pol.grads_sharded else replicated, P(), P(ax))
  grads, loss, aux = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                                   out_specs=out_specs, check_vma=False)(*args)
  aux = jax.tree_util.tree_map(lambda a, one: a[0] if one else a, aux, scalar[-1])
  return grads, loss, aux


class _Forward:
  """Inside `shard_map`: the scaled loss of one micro-batch as a function
  of what is differentiated (`differentiated()`), and the model's opt-in."""

  def __init__(self, loss_fn, has_aux, state, pol, params_in, rest, scale,
               host, with_rng):
    self.loss_fn, self.has_aux, self.pol = loss_fn, has_aux, pol
    self.cfg, self.layout = state.config, state.layout
    self.params_in, self.rest, self.scale = params_in, rest, scale
    self.host, self.with_rng = host, with_rng

  def differentiated(self) -> tuple:
    """Per chunk, what the gradient is taken with respect to: the chunk (or
    shard) itself, or a zero slot whose gradient is the reduce-scattered
    chunk gradient (SCATTER_PER_MICRO; shards in host memory)."""
    cfg = self.cfg
    if self.pol.reduction is Reduction.SCATTER_PER_MICRO:
      n = jax.lax.axis_size(cfg.axis_name)
      return tuple(jnp.zeros(_shard_shape(c.shape, n), cfg.reduce_dtype)
                   for c in self.layout.chunks)
    return tuple(jnp.zeros(p.shape, p.dtype) if c in self.host else p
                 for c, p in enumerate(self.params_in))

  def opted_in(self, diff, batch, dev_rng) -> frozenset:
    """Chunks a `zerojax.nn.layerwise` block gathers itself (layer stacks,
    unrolled blocks): one abstract trace on the ordinary tree hears which
    blocks are wrapped, each saying its module path; an error in it is
    the model's own."""
    layout = self.layout
    own = {c: layout.stack_prefix(c) for c, ch in enumerate(layout.chunks)
           if self.pol.gathers_params and ch.stack is not None}
    if not own:
      return frozenset()
    k = self.cfg.accum_steps
    first = jax.tree_util.tree_map(lambda x: x[:x.shape[0] // k], batch)
    called = set()
    jax.eval_shape(lambda d: self(d, first, dev_rng, called=called), diff)
    layerwise = frozenset(c for c, path in own.items() if path in called)
    _say_whole(layout, self.cfg, own, layerwise)
    return layerwise

  def __call__(self, diff, micro_batch, micro_rng, layerwise=frozenset(),
               called=None):
    """`(loss * scale, (loss, aux))` of one micro-batch."""
    params = self._tree(diff, layerwise)
    with zero_nn.active(self.layout, self.cfg, called):
      out = (self.loss_fn(params, micro_batch, micro_rng) if self.with_rng
             else self.loss_fn(params, micro_batch))
    loss, aux = _loss_and_aux(out, self.has_aux, _batch_size(micro_batch))
    loss = jnp.asarray(loss, jnp.float32)
    return loss * self.scale, (loss, aux)

  def _tree(self, diff, layerwise):
    """The user's parameter tree, as `StagePolicy.forward` says."""
    cfg, layout, ax = self.cfg, self.layout, self.cfg.axis_name
    dtypes = (cfg.compute_dtype, cfg.reduce_dtype)
    leaves = {}   # chunk -> its leaves, cut as it was gathered
    if self.pol.forward is Forward.GATHERED:
      chunks = [collectives.gather_from_host(self.params_in[c], s, ax, *dtypes)
                if c in self.host and c not in layerwise else None
                for c, s in enumerate(diff)]
      leaves = {c: collectives.gather_leaves(layout, c, s, ax, *dtypes)
                for c, s in enumerate(diff)
                if c not in layerwise and c not in self.host}
    elif self.pol.reduction is Reduction.SCATTER_PER_MICRO:
      chunks = [collectives.scatter_on_backward(
          p.astype(cfg.compute_dtype), slot, ax, cfg.reduce_dtype)
                for p, slot in zip(self.params_in, diff)]
    else:
      chunks = [p.astype(cfg.compute_dtype) for p in diff]
    if layerwise:
      return _with_layer_shards(layout, chunks, leaves, self.rest,
                                self.params_in, diff, layerwise, self.host)
    return layout.merge(chunks, self.rest, dtype=None, leaves=leaves)


def _accumulate(grad_fn, diff, batch, dev_rng, k: int, reduce_dtype):
  """`(summed gradients in reduce_dtype, mean loss, aux)` over `k`
  micro-batches of this device's batch; per-example aux values in batch
  order, scalars averaged."""
  to_reduce = lambda g: tuple(x.astype(reduce_dtype) for x in g)
  if k == 1:
    grads, (loss, aux) = grad_fn(diff, batch, dev_rng)
    return to_reduce(grads), loss, aux
  micro = jax.tree_util.tree_map(
      lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

  def body(acc, xs):
    i, micro_batch = xs
    micro_rng = jax.random.fold_in(dev_rng, i) if dev_rng is not None else None
    g, (loss, aux) = grad_fn(diff, micro_batch, micro_rng)
    return jax.tree_util.tree_map(jnp.add, acc, to_reduce(g)), (loss, aux)

  zeros = tuple(jnp.zeros(np.shape(d), reduce_dtype) for d in diff)
  grads, (losses, auxes) = jax.lax.scan(body, zeros, (jnp.arange(k), micro))
  # per-example values [k, micro, ...] in batch order; scalars averaged
  aux = jax.tree_util.tree_map(
      lambda a: jnp.reshape(a, (-1,) + a.shape[2:]) if a.ndim > 1
      else jnp.mean(a, axis=0), auxes)
  return grads, jnp.mean(losses), aux


def _shard_shape(shape, n):
  return shape[:-1] + (shape[-1] // n,)


def gather_modes(layout, pol: StagePolicy, layerwise: frozenset) -> dict:
  """How a step gathers each chunk: `{name: mode}`, the name being the
  stack or block a chunk belongs to ("blocks", "blocks_3") or "chunk <c>
  (<its first leaf>)"; the mode "per layer" (a scanned stack whose block is
  wrapped with `zerojax.nn.layerwise`), "per block" (an unrolled wrapped
  block, gathered at each call), "whole step" (gathered once for the step's
  forward and backward), or, below stage 3, "replicated" (never gathered)."""
  out = {}
  for c, chunk in enumerate(layout.chunks):
    name = ("/".join(layout.stack_prefix(c)) if chunk.stack is not None else
            f"chunk {c} ({layout.leaves[chunk.leaves[0]].path})")
    out[name] = ("replicated" if not pol.gathers_params else
                 "whole step" if c not in layerwise else
                 "per layer" if chunk.layers else "per block")
  return out


def _say_whole(layout, config, own_gather: dict, layerwise: frozenset) -> None:
  """A scanned stack whose blocks are not wrapped is gathered whole, every
  layer at once: legal, but not what `stacked=` at stage 3 is for."""
  stacks = sorted({layout.chunks[c].stack for c in own_gather
                   if c not in layerwise and layout.chunks[c].layers})
  if stacks:
    _log.warning(
        "zerojax: stacked=%r at stage 3, but the blocks scanned under %s are "
        "not wrapped with zerojax.nn.layerwise, so the step gathers all their "
        "layers at once for the whole step (memory grows with depth). Wrap "
        "the block class, Block = zerojax.nn.layerwise(Block), to gather one "
        "layer at a time.", tuple(config.stacked),
        ", ".join(map(repr, stacks)))


def _batch_size(batch) -> int:
  return np.shape(jax.tree_util.tree_leaves(batch)[0])[0]


def _loss_and_aux(out, has_aux: bool, batch_size: int) -> tuple:
  """`(loss, aux)` of what the user's loss function returned, checked: a
  floating scalar loss; aux values that are scalars or per-example arrays
  (leading axis `batch_size`, this device's micro-batch)."""
  if has_aux:
    if not (isinstance(out, (tuple, list)) and len(out) == 2):
      raise TypeError(
          "train_step(has_aux=True): loss_fn must return (loss, aux); it "
          f"returned {_describe(out)}. Return a pair, or build the step with "
          "has_aux=False.")
    loss, aux = out
  else:
    if isinstance(out, (tuple, list)):
      raise TypeError(
          f"loss_fn returned {_describe(out)}, not a scalar loss; if it returns "
          "(loss, aux), build the step with train_step(loss_fn, has_aux=True).")
    loss, aux = out, {}
  dtype = jnp.result_type(loss) if hasattr(loss, "dtype") or isinstance(
      loss, (int, float)) else None
  if dtype is None or np.shape(loss) != () or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"loss_fn must return a floating scalar loss; it returned "
        f"{_describe(loss)}. Reduce it to a scalar (e.g. .mean()) and keep it "
        "floating: an integer loss has no gradient.")
  if isinstance(aux, dict):
    taken = sorted(set(map(str, aux)) & set(METRICS))
    if taken:
      raise ValueError(
          f"aux key(s) {taken} would overwrite the step's own metric(s) of "
          f"that name (the step reports {', '.join(METRICS)}); rename them "
          "in loss_fn's aux dict.")
  for path, a in jax.tree_util.tree_leaves_with_path(aux):
    shape = np.shape(a)
    if shape and shape[0] != batch_size:
      raise TypeError(
          f"aux value {jax.tree_util.keystr(path) or 'aux'} has shape {shape}: "
          "an aux value is a scalar (averaged over the batch) or has the "
          f"per-example leading axis ({batch_size} on this device's "
          "micro-batch; concatenated over the global batch).")
  return loss, jax.tree_util.tree_map(jnp.asarray, aux)


def _describe(x) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"an array of dtype {x.dtype} and shape {tuple(x.shape)}"
  return f"a {type(x).__name__}"


def _with_layer_shards(layout, chunks, leaves, rest, shards, slots,
                       layer_chunks, host):
  """The parameter tree with each layer-stacked chunk left as its shard
  `[layers, length / N]` under the stack (see `zerojax.nn.layerwise`); a
  chunk in `host` memory also leaves its gradient slot there."""
  tree = layout.merge(chunks, rest, dtype=None, skip=layer_chunks,
                      leaves=leaves)
  skipped = {layout.leaves[i].names for c in layer_chunks
             for i in layout.chunks[c].leaves}
  flat = {k: v for k, v in traverse_util.flatten_dict(tree).items()
          if k not in skipped}
  for c in layer_chunks:
    flat[layout.stack_prefix(c) + (zero_nn.chunk_key(c),)] = (
        shards[c] if c in host else slots[c])
    if c in host:
      flat[layout.stack_prefix(c) + (zero_nn.slot_key(c),)] = slots[c]
  return traverse_util.unflatten_dict(flat)
