"""train_step(): one jitted program per step.

  1. `shard_map` over the data axis (all ZeRO communication is explicit here):
     gather (stage 3) -> the user's loss on the full parameter tree and this
     device's micro-batches -> gradients reduced per stage:
       stage 0: psum (all-reduce) of the accumulated gradient;
       stage 1: psum_scatter of the accumulated gradient;
       stage 2: psum_scatter of every micro-batch's gradient, chunk by chunk,
                in the backward pass (`collectives.scatter_on_backward`);
       stage 3: the transpose of the gather reduce-scatters (`collectives.gather`).
  2. The optimizer on gradient and master shards: unscale, skip on overflow,
     clip by global norm, the user's optax update. Element-wise work on
     arrays sharded over the data axis: no communication but the scalar norms.
  3. Stages 1-2: `shard_map` all-gathers the updated shards (cast to the
     compute dtype first) into the replicated compute chunks.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from flax import traverse_util

from zerojax import collectives, offload, optim, precision
from zerojax import nn as zero_nn
from zerojax.state import (ZeroTrainState, check_live, chunk_spec,
                           master_is_sharded, state_shardings)


_log = logging.getLogger("zerojax")
# metrics the step writes itself; a dict aux is merged beside them
METRICS = ("loss", "grad_norm", "loss_scale", "skipped")


def _shard_shape(shape, n):
  return shape[:-1] + (shape[-1] // n,)


def _grads_and_metrics(loss_fn, has_aux, state, batch, rng, modes):
  """Step 1: the shard_map program. Returns reduced gradient chunks (sharded
  for stages 1-3, replicated for stage 0), the mean loss and mean aux;
  fills `modes` with how each chunk is gathered (`gather_modes`)."""
  cfg, layout, mesh = state.config, state.layout, state.mesh
  ax, stage, k = cfg.axis_name, cfg.stage, cfg.accum_steps
  n = mesh.shape[ax]
  split_specs = tuple(chunk_spec(len(c.shape), ax) for c in layout.chunks)
  rep_specs = tuple(P() for _ in layout.chunks)
  if stage == 3:
    params_in, params_specs = state.master, split_specs
  elif stage in (1, 2) and cfg.mixed_precision:
    params_in, params_specs = state.compute, rep_specs
  else:
    params_in, params_specs = state.master, rep_specs
  scale = (state.loss_scale.scale if state.loss_scale is not None
           else jnp.ones((), jnp.float32))
  with_rng = rng is not None
  # chunks a `zerojax.nn.layerwise` block may gather itself: layer stacks
  # and unrolled blocks (units), each under its module's path
  own_gather = {c: layout.stack_prefix(c) for c, ch in enumerate(layout.chunks)
                if stage == 3 and ch.stack is not None}
  # Stage-3 shards kept in host memory are moved to the device by their
  # gather (per layer for layer chunks); their gradients go to device-side
  # slots (`collectives.gather_from_host`).
  host = (frozenset(c for c, s in enumerate(state_shardings(state).master)
                    if s.memory_kind == offload.HOST)
          if stage == 3 else frozenset())

  def local(params_in, rest, batch, scale, *maybe_rng):
    dev_rng = (jax.random.fold_in(maybe_rng[0], jax.lax.axis_index(ax))
               if with_rng else None)

    def scaled_loss(diff, micro_batch, micro_rng, layerwise=frozenset(),
                    called=None):
      leaves = {}   # chunk -> its leaves, cut as it was gathered
      if stage == 3:
        chunks = [None if c in layerwise else
                  collectives.gather_from_host(params_in[c], s, ax,
                                               cfg.compute_dtype, cfg.reduce_dtype)
                  if c in host else None for c, s in enumerate(diff)]
        leaves = {c: collectives.gather_leaves(layout, c, s, ax, cfg.compute_dtype,
                                               cfg.reduce_dtype)
                  for c, s in enumerate(diff)
                  if c not in layerwise and c not in host}
      elif stage == 2:
        chunks = [collectives.scatter_on_backward(
            p.astype(cfg.compute_dtype), slot, ax, cfg.reduce_dtype)
                  for p, slot in zip(params_in, diff)]
      else:
        chunks = [p.astype(cfg.compute_dtype) for p in diff]
      if layerwise:
        params = _with_layer_shards(layout, chunks, leaves, rest, params_in,
                                    diff, layerwise, host)
      else:
        params = layout.merge(chunks, rest, dtype=None, leaves=leaves)
      with zero_nn.active(layout, cfg, called):
        out = (loss_fn(params, micro_batch, micro_rng) if with_rng
               else loss_fn(params, micro_batch))
      loss, aux = _loss_and_aux(out, has_aux, _batch_size(micro_batch))
      loss = jnp.asarray(loss, jnp.float32)
      return loss * scale, (loss, aux)

    if stage == 2:
      diff = tuple(jnp.zeros(_shard_shape(c.shape, n), cfg.reduce_dtype)
                   for c in layout.chunks)
    else:
      diff = tuple(jnp.zeros(p.shape, p.dtype) if c in host else p
                   for c, p in enumerate(params_in))
    # Per-layer gathering needs the model's opt-in (zerojax.nn.layerwise):
    # one abstract trace on the ordinary tree hears which blocks are
    # wrapped (each says its module path); an error in it is the model's.
    layerwise = frozenset()
    if own_gather:
      first = jax.tree_util.tree_map(lambda x: x[:x.shape[0] // k], batch)
      called = set()
      jax.eval_shape(lambda d: scaled_loss(d, first, dev_rng, called=called),
                     diff)
      layerwise = frozenset(c for c, path in own_gather.items()
                            if path in called)
      _say_whole(layout, cfg, own_gather, layerwise)
    modes.update(gather_modes(layout, stage, layerwise))
    grad_fn = jax.grad(functools.partial(scaled_loss, layerwise=layerwise),
                       has_aux=True)
    to_reduce = lambda g: tuple(x.astype(cfg.reduce_dtype) for x in g)

    if k == 1:
      grads, (loss, aux) = grad_fn(diff, batch, dev_rng)
      grads = to_reduce(grads)
    else:
      micro = jax.tree_util.tree_map(
          lambda x: x.reshape((k, x.shape[0] // k) + x.shape[1:]), batch)

      def body(acc, xs):
        i, micro_batch = xs
        micro_rng = jax.random.fold_in(dev_rng, i) if with_rng else None
        g, (loss, aux) = grad_fn(diff, micro_batch, micro_rng)
        return jax.tree_util.tree_map(jnp.add, acc, to_reduce(g)), (loss, aux)

      zeros = tuple(jnp.zeros(np.shape(d), cfg.reduce_dtype) for d in diff)
      grads, (losses, auxes) = jax.lax.scan(body, zeros, (jnp.arange(k), micro))
      loss = jnp.mean(losses)
      # per-example values [k, micro, ...] in batch order; scalars averaged
      aux = jax.tree_util.tree_map(
          lambda a: jnp.reshape(a, (-1,) + a.shape[2:]) if a.ndim > 1
          else jnp.mean(a, axis=0), auxes)

    if stage == 0:
      grads = tuple(collectives.all_reduce(g, ax) for g in grads)
    elif stage == 1:
      grads = tuple(collectives.reduce_scatter(g, ax) for g in grads)
    grads = tuple(g / (n * k) for g in grads)
    loss = collectives.all_mean(loss, ax)
    # Every aux value leaves with a leading device axis: per-example values
    # are concatenated over the global batch, scalars are averaged over the
    # devices and taken once below.
    scalar.append(jax.tree_util.tree_map(lambda a: a.ndim == 0, aux))
    aux = jax.tree_util.tree_map(
        lambda a: jnp.reshape(collectives.all_mean(jnp.asarray(a, jnp.float32), ax),
                              (1,)) if a.ndim == 0 else a, aux)
    return grads, loss, aux

  scalar = []
  args = (params_in, state.rest, batch, scale) + ((rng,) if with_rng else ())
  in_specs = (params_specs, P(), P(ax), P()) + ((P(),) if with_rng else ())
  out_specs = (rep_specs if stage == 0 else split_specs, P(), P(ax))
  grads, loss, aux = jax.shard_map(local, mesh=mesh, in_specs=in_specs,
                                   out_specs=out_specs, check_vma=False)(*args)
  aux = jax.tree_util.tree_map(lambda a, one: a[0] if one else a, aux, scalar[-1])
  return grads, loss, aux


def gather_modes(layout, stage: int, layerwise: frozenset) -> dict:
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
    out[name] = ("replicated" if stage < 3 else
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


def _gather_updated(state, shards):
  """Step 3 (stages 1-2): replicated chunks from the updated shards."""
  cfg, layout = state.config, state.layout
  ax = cfg.axis_name
  dtype = cfg.compute_dtype if cfg.mixed_precision else None
  split_specs = tuple(chunk_spec(len(c.shape), ax) for c in layout.chunks)

  def local(shards):
    return tuple(collectives.all_gather(s if dtype is None else s.astype(dtype), ax)
                 for s in shards)

  return jax.shard_map(local, mesh=state.mesh, in_specs=(split_specs,),
                       out_specs=tuple(P() for _ in layout.chunks),
                       check_vma=False)(shards)


def _update(state, grads, master, shardings, finite):
  """Step 2's optax update: `(new master chunks, new optimizer state)`.

  Chunks whose optimizer state is offloaded are updated one at a time, after
  the device-resident ones: a chunk's state (and its master shard, where that
  is offloaded too) comes to the device only once the previous chunk's new
  state has gone back to host (an optimization barrier on the host arrays
  orders the transfers), so one offloaded chunk's optimizer state is on the
  device at once. `tx` must then be separable by chunk
  (`optim.check_separable`, run by `shard`). Master shards in host memory
  whose optimizer state is on the device (`offload_params`) come to the
  device for the first update call. `finite`: when steps may be skipped
  (loss scaling, `skip_nonfinite`), whether to keep the update (else the
  old values).
  """
  cfg, layout, tx = state.config, state.layout, state.tx
  host = (offload.offloaded_chunks(layout, cfg.offload_fraction)
          if cfg.offload_optimizer else frozenset())
  every = frozenset(range(len(layout.chunks)))
  groups = ([every - host] if every - host else []) + [
      frozenset([c]) for c in sorted(host)]
  owners = optim.view_chunks(layout, state.opt_state)
  old, treedef = jax.tree_util.tree_flatten(state.opt_state)
  where = jax.tree_util.tree_leaves(shardings.opt_state)
  keep = ((lambda new, old: new) if finite is None else
          (lambda new, old: jnp.where(finite, new, old)))
  new_master, new_opt, previous = list(master), list(old), None
  for g, only in enumerate(groups):
    mine = [j for j, c in enumerate(owners) if c in only]
    chunks_in = [c for c in sorted(only)
                 if shardings.master[c].memory_kind == offload.HOST]
    # stages 1-2 gather the new master into the compute copy after the
    # update: it goes back to host at the step's end instead
    back = chunks_in if cfg.stage == 3 else []
    host_in = ([old[j] for j in mine], [master[c] for c in chunks_in])
    if previous is not None:
      host_in, _ = jax.lax.optimization_barrier((host_in, previous))
    device_in = dict(zip(mine, offload.to_device(host_in[0], [where[j] for j in mine])))
    master_in = list(master)
    for c, m in zip(chunks_in, offload.to_device(
        host_in[1], [shardings.master[c] for c in chunks_in])):
      master_in[c] = m
    # the statistics are kept in chunk shape (`optim.stored`); tx sees views
    sub = [x if c is None else
           jnp.reshape(device_in[j], layout.view_shape(c)) if j in device_in
           else jnp.zeros((0,) * len(layout.view_shape(c)), x.dtype)
           for j, (x, c) in enumerate(zip(old, owners))]
    params_view = layout.views(master_in, only=only)
    updates, out = tx.update(
        layout.views(grads, fill_dtype=cfg.reduce_dtype, only=only),
        jax.tree_util.tree_unflatten(treedef, sub), params_view)
    chunks = layout.from_views(optax.apply_updates(params_view, updates), only)
    for c in only:
      new_master[c] = keep(chunks[c], master_in[c])
    out = jax.tree_util.tree_leaves(out)
    for j in mine:
      new_opt[j] = keep(jnp.reshape(out[j], device_in[j].shape), device_in[j])
    if g == 0:   # counts and other scalars: alike in every group
      for j, c in enumerate(owners):
        if c is None:
          new_opt[j] = keep(out[j], old[j])
    if only <= host:
      placed = offload.place(
          ([new_opt[j] for j in mine], [new_master[c] for c in back]),
          ([where[j] for j in mine], [shardings.master[c] for c in back]))
      for j, x in zip(mine, placed[0]):
        new_opt[j] = x
      for c, x in zip(back, placed[1]):
        new_master[c] = x
      previous = placed
  return tuple(new_master), jax.tree_util.tree_unflatten(treedef, new_opt)


def _global_norm(grads) -> jax.Array:
  """The L2 norm over all gradient chunks, one read of each: a dot of each
  chunk with itself over all its axes is one pass, where
  `optax.tree.norm`'s square-then-sum writes a chunk-sized temporary first
  on XLA's CPU backend (and clipping with optax would compute the norm a
  second time). Not `jnp.vdot`: it flattens, and flattening a `[layers,
  length]` chunk sharded on its last axis makes GSPMD gather it whole."""
  def squares(g):
    axes = tuple(range(g.ndim))
    return jax.lax.dot_general(g, g, ((axes, axes), ((), ())),
                               preferred_element_type=jnp.float32)
  return jnp.sqrt(sum(squares(g) for g in grads))


def _clip(grads, norm, max_norm) -> tuple:
  """`optax.clip_by_global_norm(max_norm)` given the global `norm`: the same
  select and the same arithmetic, so the same values."""
  keep = norm < max_norm
  return tuple(jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm)
               for g in grads)


def _step(loss_fn, has_aux, modes, state: ZeroTrainState, batch, rng):
  cfg = state.config
  shardings = state_shardings(state)
  # Master chunks in host memory stay there: at stage 3 their gathers move
  # them to the device (one layer at a time for layer chunks), and `_update`
  # moves them along with their optimizer state.
  grads, loss, aux = _grads_and_metrics(loss_fn, has_aux, state, batch, rng,
                                        modes)

  metrics = {"loss": loss}
  if state.loss_scale is not None:
    grads = tuple(g / state.loss_scale.scale for g in grads)
  # A step with a non-finite gradient is skipped under loss scaling (where it
  # is expected) or when asked for (`skip_nonfinite`).
  guard = state.loss_scale is not None or cfg.skip_nonfinite
  finite = precision.all_finite(grads) if guard else None
  grad_norm = _global_norm(grads)   # zero padding adds nothing
  metrics["grad_norm"] = grad_norm
  if cfg.clip_norm is not None:
    grads = _clip(grads, grad_norm, cfg.clip_norm)

  if cfg.stage in (1, 2) and not master_is_sharded(cfg):
    # float32 stages 1-2: the replicated master is the compute copy; this
    # device updates its own slice of it.
    master = tuple(jax.lax.with_sharding_constraint(
        m, NamedSharding(state.mesh, chunk_spec(m.ndim, cfg.axis_name)))
                   for m in state.master)
  else:
    master = state.master
  new_master, opt_state = _update(state, grads, master, shardings, finite)
  loss_scale = state.loss_scale
  if loss_scale is not None:
    loss_scale = precision.update(cfg.loss_scale, loss_scale, finite)
    metrics["loss_scale"] = loss_scale.scale
  if guard:
    metrics["skipped"] = ~finite

  compute = state.compute
  if cfg.stage in (1, 2):
    gathered = _gather_updated(state, new_master)
    if cfg.mixed_precision:
      compute = gathered
    else:
      new_master = gathered
  if isinstance(aux, dict):
    metrics.update(aux)
  elif aux is not None:
    metrics["aux"] = aux
  new_state = state.replace(
      step=state.step + (finite.astype(jnp.int32) if guard else 1),
      master=new_master, compute=compute, opt_state=opt_state,
      loss_scale=loss_scale)
  new_state = offload.place(new_state, shardings)
  return new_state, metrics


def train_step(loss_fn: Callable, *, has_aux: bool = False,
               donate: bool = True) -> Callable:
  """Builds the jitted ZeRO training step.

  Args:
    loss_fn: `loss_fn(params, batch)` or `loss_fn(params, batch, rng)`,
      written on the full parameter tree and one device's slice of the batch;
      returns the floating scalar loss, or `(loss, aux)` with `has_aux=True`.
      aux is a pytree (a dict is merged into `metrics`) whose values are
      scalars, averaged over devices and micro-batches, or per-example
      arrays with the micro-batch's leading axis, concatenated in global
      batch order.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    donate: the step donates the input state's buffers to the new state, so
      the state is held once. A step that fails at run time (a host callback
      raising, say) then leaves no usable input state: restore from a
      checkpoint. `donate=False` keeps the input state intact whatever
      happens, at the cost of holding the old and the new state at once
      during the step (one more state's bytes per device).

  Returns:
    `step(state, batch, rng=None) -> (state, metrics)`, jitted, donating
    `state`. `batch` is a pytree of arrays with the global batch on the
    leading axis (numpy arrays are fine). `metrics` holds `loss` (mean over
    the global batch), `grad_norm` (global, before clipping), the aux values,
    and under loss scaling `loss_scale` and `skipped`. `step.lower(state,
    batch)` gives the lowered program (for `memory_analysis()`); state and
    batch may be `jax.ShapeDtypeStruct`s (nothing is allocated).
    `step.trace(state, batch)` gives the traced program, e.g. for
    `.lower(lowering_platforms=("cuda",))`: what a GPU would run, host
    offload transfers included, lowered on any machine.
    `step.gathering(state, batch)` says how the step gathers each chunk
    (`gather_modes`: per layer, per block, whole step or replicated).
  """
  if not callable(loss_fn):
    raise TypeError(f"train_step() takes the loss function, got {loss_fn!r}.")
  for name, value in (("has_aux", has_aux), ("donate", donate)):
    if not isinstance(value, bool):
      raise TypeError(f"train_step({name}={value!r}) must be True or False.")
  modes = {}   # filled when the step is traced (`step.gathering`)
  jitted = jax.jit(functools.partial(_step, loss_fn, has_aux, modes),
                   donate_argnums=(0,) if donate else ())

  def prepare(state, batch):
    if not isinstance(state, ZeroTrainState):
      raise TypeError(f"step() takes the ZeroTrainState from zerojax.shard(), "
                      f"got {type(state).__name__}.")
    check_live(state, "step()")
    cfg = state.config
    per_step = state.num_shards * cfg.accum_steps
    sizes = {np.shape(x)[0] if np.ndim(x) else None
             for x in jax.tree_util.tree_leaves(batch)}
    if not sizes:
      raise ValueError("the batch has no arrays.")
    if None in sizes or len(sizes) != 1:
      raise ValueError(f"every batch array needs the same leading (global "
                       f"batch) axis; got leading sizes {sorted(map(str, sizes))}.")
    size = sizes.pop()
    if size % per_step:
      raise ValueError(
          f"global batch {size} is not divisible by {state.num_shards} devices "
          f"x accum_steps {cfg.accum_steps} = {per_step}; use a multiple of "
          f"{per_step}.")
    sharding = NamedSharding(state.mesh, P(cfg.axis_name))
    # ShapeDtypeStructs (an abstract batch, for `step.lower`) get the sharding.
    return jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
        if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, sharding),
        batch)

  def step(state, batch, rng=None):
    return jitted(state, prepare(state, batch), rng)

  step.lower = lambda state, batch, rng=None: jitted.lower(
      state, prepare(state, batch), rng)
  # on CPU, memory-kind transfers lower to nothing: lower for "cuda" to see them
  step.trace = lambda state, batch, rng=None: jitted.trace(
      state, prepare(state, batch), rng)

  def gathering(state, batch, rng=None) -> dict:
    modes.clear()
    step.trace(state, batch, rng)
    return dict(modes)

  step.gathering = gathering
  return step
