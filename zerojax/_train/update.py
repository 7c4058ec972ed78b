"""Steps 2 and 3 of a train step (`step._step`) on the gradient and master
shards: the user's optax update, and the re-gather of stages 1-2.

  `update`          the update of every chunk: the chunks whose optimizer
                    state is on the device in one `tx.update` call, then each
                    offloaded chunk alone (its state brought to the device
                    and sent back, ordered by optimization barriers), or,
                    under `update_on="host"`, as a host computation where it
                    lives (`update_on_host`); the disk tier's chunks are left
                    to `disk_stream`
  `update_on_host`  one chunk's update as a host computation
  `gather_updated`  the re-gather: replicated chunks from the new shards

Element-wise work on arrays sharded over the data axis: no communication
but the re-gather's all-gathers.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._comm import collectives
from zerojax._core import compat
from zerojax._core import meshes
from zerojax._tiers import disk_tier
from zerojax._core import offload
from zerojax._core import optim
from zerojax._core import optstate
from zerojax._options.config import manual_axes, shard_axes
from zerojax._options.policy import Forward, policy
from zerojax._state.state import chunk_spec


def gather_updated(state, shards):
  """Step 3 (`StagePolicy.regather`): replicated chunks from the updated
  shards, in the compute dtype when they fill the compute copy. Under hpZ
  in two hops, over the replica axis and then within the data axis. A
  shard given as None (a disk-tier chunk, updated after the program) gives
  None."""
  cfg, layout = state.config, state.layout
  dtype = cfg.compute_dtype if policy(cfg).compute_copy else None
  todo = [c for c, s in enumerate(shards) if s is not None]
  split_specs = tuple(chunk_spec(len(layout.chunks[c].shape), shard_axes(cfg))
                      for c in todo)
  hops = (cfg.replica_axis, cfg.axis_name) if cfg.hpz else (cfg.axis_name,)
  # qwZ quantizes the 16-bit compute copy's gather, never the fp32 master's
  quant = collectives.Wire.of(cfg).weights if dtype is not None else None

  if not todo:
    return tuple(shards)

  rows = [collectives.Wire.of(cfg, layout.chunks[c]).model for c in todo]

  def local(shards):
    out = []
    for s, model in zip(shards, rows):
      s = s if dtype is None else s.astype(dtype)
      for axis in hops:
        s = collectives.all_gather(s, axis, quant, model)
      out.append(s)
    return tuple(out)

  gathered = jax.shard_map(local, mesh=state.mesh, in_specs=(split_specs,),
                           out_specs=tuple(P() for _ in todo),
                           check_vma=False, **manual_axes(cfg))(
                               tuple(shards[c] for c in todo))
  out = [None] * len(shards)
  for c, g in zip(todo, gathered):
    out[c] = g
  return tuple(out)


def forward_reads_master(state) -> bool:
  """Whether the forward reads the very chunks the update replaces, with no
  gather in between: the replicated master (`Forward.MASTER`, or the
  replicated compute copy re-gathered from it), or the shards themselves
  on a one-device shard group. XLA can then update them in place only if
  every read comes first (`step._step` orders them; `update_chunks`)."""
  return (policy(state.config).forward is not Forward.GATHERED or
          state.num_state_shards == 1)


def _update_groups(layout, cfg) -> list:
  """`(chunks, offloaded)` for each `tx.update` call, in order: every chunk
  whose optimizer state is on the device in one call, then each chunk whose
  optimizer state is offloaded alone."""
  host = offload.optimizer_chunks(layout, cfg)
  device = frozenset(range(len(layout.chunks))) - host
  return ([(device, False)] if device else []) + [
      (frozenset([c]), True) for c in sorted(host)]


def update_chunks(state, chunks, grads, master, opt, owners, keep):
  """`tx.update` of the chunks in `chunks`, whose master shards and
  optimizer-state leaves (`opt`, flat, chunk-shaped: `optstate.stored`) are
  on the device. Returns their new master chunks (by chunk index) and the
  new optimizer-state leaves (by leaf index): those of `chunks` and those
  owned by no chunk (step counts, alike in every call)."""
  cfg, layout, tx = state.config, state.layout, state.tx
  # tx sees the statistics as views; other chunks' statistics are empty
  views = [x if c is None else
           layout.stat_view(c, x) if c in chunks else
           jnp.zeros((0,) * len(layout.view_shape(c)), x.dtype)
           for x, c in zip(opt, owners)]
  # the disk tier's statistics (`OnDisk`, no leaves) are other chunks' too
  full, treedef = disk_tier.full_leaves(state.opt_state)
  on_disk = [disk_tier.is_on_disk(x) for x in full]
  if any(on_disk):
    full_owners = optstate.owners(
        layout, disk_tier.abstract(state.opt_state)).chunk
    given = iter(views)
    views = [jnp.zeros((0,) * len(layout.view_shape(c)), np.dtype(x.dtype))
             if d else next(given) for x, c, d in zip(full, full_owners, on_disk)]
  compact = optim.compact_views(tx, layout)
  params = _shaped_placed(state, layout.views(master, only=chunks,
                                              compact=compact))
  grad_views = _shaped_placed(state, layout.views(
      grads, fill_dtype=cfg.reduce_dtype, only=chunks, compact=compact))
  update = (functools.partial(optstate.update_compact, tx) if compact
            else tx.update)
  updates, new_opt = update(grad_views,
                            jax.tree_util.tree_unflatten(treedef, views), params)
  if forward_reads_master(state):
    # applied in the chunk's own shape, not the view's: XLA's CPU backend
    # writes the new master into the donated one only if the update reads
    # it through no reshape, and adamw's weight decay reads it a second
    # time (measured: a copy of the whole chunk)
    updates = layout.from_views(updates, chunks)
    new_master = {c: optax.apply_updates(master[c], updates[c]) for c in chunks}
  else:
    new_master = layout.from_views(optax.apply_updates(params, updates), chunks)
  new_master = {c: keep(new_master[c], master[c]) for c in chunks}
  new_leaves = [x for x, d in zip(jax.tree_util.tree_leaves(new_opt), on_disk)
                if not d]
  new_opt = {j: keep(x if c is None else jnp.reshape(x, opt[j].shape), opt[j])
             for j, (x, c) in enumerate(zip(new_leaves, owners))
             if c is None or c in chunks}
  return new_master, new_opt


def _shaped_placed(state, views):
  """`views` with each shaped leaf's view split as its statistics are
  (`meshes.shaped_spec`: on the dim `tx`'s matrix products contract, else
  on its rows; [Note: shaped leaves]); whole on each device where no dim
  is divided. Left to itself XLA picks shardings it can leave only by
  gathering the whole tensor, and says so on stderr."""
  layout, mesh, axes = state.layout, state.mesh, shard_axes(state.config)
  shaped = {layout.chunks[c].leaves[0] for c in range(len(layout.chunks))
            if layout.chunks[c].shaped}
  if not shaped:
    return views
  n = meshes.axes_size(mesh, axes)
  multiplies = optim.multiplies_matrices(state.tx, layout)
  flat, treedef = jax.tree_util.tree_flatten(views, is_leaf=lambda x: x is None)
  spec = lambda i, x: meshes.shaped_spec(x.shape, n, axes, multiplies,
                                         int(layout.leaves[i].stacked))
  return jax.tree_util.tree_unflatten(treedef, [
      jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec(i, x)))
      if i in shaped and x is not None else x for i, x in enumerate(flat)])


def update(state, grads, master, shardings, finite):
  """Step 2's optax update: `(new master chunks, new optimizer state)`.

  Chunks whose optimizer state is offloaded are updated one at a time, after
  the device-resident ones (`_update_groups`): a chunk's state (and its
  master shard, where that is offloaded too) comes to the device only once
  the previous chunk's new state has gone back to host (an optimization
  barrier on the host arrays orders the transfers), so one offloaded chunk's
  optimizer state is on the device at once. `tx` must then be separable by
  chunk (`optim.check_separable`, run by `shard`). Master shards in host
  memory whose optimizer state is on the device (`offload_params`) come to
  the device for the first update call. Under `update_on="host"` each
  offloaded chunk is updated where it lives instead (`update_on_host`).
  `finite`: when steps may be skipped (loss scaling, `skip_nonfinite`),
  whether to keep the update (else the old values).

  Under the disk tier (`config.disk`) the offloaded chunks are not updated
  here: their gradient shards stay on the device for `_disk_update`, which
  streams their statistics from their files after this program and moves
  each gradient shard to the host for its chunk's update.

  Returns the new master chunks, the new optimizer state, what the
  re-gather of stages 1-2 reads per chunk (the new master, or a host
  update's compute-dtype shard, already on the device; None for a disk
  chunk), and the disk chunks' gradient shards (by chunk).
  """
  cfg, layout = state.config, state.layout
  owners = optstate.owners(layout, state.opt_state).chunk  # per leaf: chunk or None
  opt, treedef = jax.tree_util.tree_flatten(state.opt_state)
  opt_at = jax.tree_util.tree_leaves(shardings.opt_state)
  master_at = shardings.master
  keep = ((lambda new, old: new) if finite is None else
          (lambda new, old: jnp.where(finite, new, old)))
  new_master, new_opt, sent_back = list(master), list(opt), None
  to_gather, pending = list(master), {}
  for n, (chunks, offloaded) in enumerate(_update_groups(layout, cfg)):
    stats = [j for j, c in enumerate(owners) if c in chunks]
    if offloaded and cfg.disk:   # kept on the device until its update
      (c,) = chunks
      pending[c] = grads[c]
      to_gather[c] = None
      continue
    if offloaded and cfg.update_on == "host":
      (c,) = chunks
      m, leaves, to_gather[c] = update_on_host(
          state, c, grads, master, opt, owners, finite, shardings)
      new_master[c] = m
      for j, x in leaves.items():
        if owners[j] is not None or n == 0:   # step counts: from the first call
          new_opt[j] = x
      continue
    masters_on_host = [c for c in sorted(chunks)
                       if master_at[c].memory_kind == offload.HOST]
    incoming = ([opt[j] for j in stats], [master[c] for c in masters_on_host])
    if sent_back is not None:   # only after the previous chunk has left
      incoming, _ = jax.lax.optimization_barrier((incoming, sent_back))
    opt_here, master_here = list(opt), list(master)
    for j, x in zip(stats, offload.to_device(incoming[0], [opt_at[j] for j in stats])):
      opt_here[j] = x
    for c, x in zip(masters_on_host, offload.to_device(
        incoming[1], [master_at[c] for c in masters_on_host])):
      master_here[c] = x
    masters, leaves = update_chunks(state, chunks, grads, master_here,
                                     opt_here, owners, keep)
    for c, x in masters.items():
      new_master[c] = x
    for j, x in leaves.items():
      if owners[j] is not None or n == 0:   # step counts: from the first call
        new_opt[j] = x
    if offloaded:
      # a re-gathered master (stages 1-2) is read again after the update: it
      # goes back to host at the step's end instead
      back = [] if policy(cfg).regather else masters_on_host
      sent_back = offload.place(
          ([new_opt[j] for j in stats], [new_master[c] for c in back]),
          ([opt_at[j] for j in stats], [master_at[c] for c in back]))
      for j, x in zip(stats, sent_back[0]):
        new_opt[j] = x
      for c, x in zip(back, sent_back[1]):
        new_master[c] = x
  for c, x in enumerate(new_master):
    if to_gather[c] is master[c]:
      to_gather[c] = x
  return (tuple(new_master), jax.tree_util.tree_unflatten(treedef, new_opt),
          tuple(to_gather), pending)


def update_on_host(state, c, grads, master, opt, owners, finite, shardings):
  """`update_on="host"`: chunk `c`'s update as a host computation, where its
  master shard and optimizer state live (`compat.on_host`). Its gradient
  shard (and the step counts and the finite flag, scalars) go to the host;
  returns the new master shard and the new optimizer-state leaves (of `c`,
  and the step counts, on the device), all in host memory but the counts,
  and what the re-gather of stages 1-2 reads: the new master cast to the
  compute dtype, moved to the device. At stage 3 the next step's gathers
  read a host shard, so nothing comes back: the new master, or under
  `StagePolicy.sharded_compute` (a disk chunk) its compute-dtype copy, in
  host memory."""
  cfg = state.config
  opt_at = jax.tree_util.tree_leaves(shardings.opt_state)
  on_host = lambda x, s: offload.to_host(x, s.with_memory_kind(offload.HOST))
  # its statistics, and the step counts (the empty statistics of other
  # leaves are made in the host computation)
  mine = sorted([j for j, o in enumerate(owners) if o == c] +
                optstate.counts(opt, owners))
  args = ({j: opt[j] if owners[j] == c else on_host(opt[j], opt_at[j])
           for j in mine},
          on_host(grads[c], shardings.master[c]),
          master[c],
          None if finite is None else on_host(
              finite, NamedSharding(state.mesh, P())))
  pol = policy(cfg)
  regather, cast = pol.regather, pol.regather or pol.sharded_compute
  others = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in opt]

  def update(stats, grad, shard, finite):
    keep = ((lambda new, old: new) if finite is None else
            (lambda new, old: jnp.where(finite, new, old)))
    opt_here = [stats[j] if j in stats else
                x if np.prod(x.shape) else jnp.zeros(x.shape, x.dtype)
                for j, x in enumerate(others)]
    grads_here = [grad if i == c else None for i in range(len(grads))]
    master_here = [shard if i == c else None for i in range(len(master))]
    masters, leaves = update_chunks(state, frozenset([c]), grads_here,
                                     master_here, opt_here, owners, keep)
    compute = masters[c].astype(cfg.compute_dtype) if cast else None
    return masters[c], leaves, compute

  new_master, leaves, compute = compat.on_host(update)(*args)
  leaves = {j: x if owners[j] == c else
            jax.device_put(x, opt_at[j]) for j, x in leaves.items()}
  if regather:
    compute = jax.device_put(compute, shardings.master[c].with_memory_kind(
        offload.DEVICE))
  return new_master, leaves, compute if cast else new_master
