"""train_step(): one jitted program per step, each part as the configured
`StagePolicy` says.

  1. Gradients, loss and aux (`grads.grads_and_metrics`): one `shard_map`
     over the data axis with ZeRO's gather / reduce-scatter / all-reduce.
  2. The update on gradient and master shards: unscale, skip on overflow,
     clip by the global norm, the user's optax update (`_update`).
     Element-wise work on arrays sharded over the data axis: no
     communication but the scalar norms.
  3. The re-gather (`StagePolicy.regather`, stages 1-2): `shard_map`
     all-gathers the updated shards (cast to the compute dtype first) into
     the replicated compute copy, or the replicated master.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import (collectives, compat, disk, disk_tier, offload, optstate,
                     precision)
from zerojax.config import batch_axes, shard_axes
from zerojax.grads import grads_and_metrics
from zerojax.policy import policy
from zerojax.state import (ZeroTrainState, check_live, chunk_spec,
                           state_shardings)


def _gather_updated(state, shards):
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

  def local(shards):
    out = []
    for s in shards:
      s = s if dtype is None else s.astype(dtype)
      for axis in hops:
        s = collectives.all_gather(s, axis, quant)
      out.append(s)
    return tuple(out)

  gathered = jax.shard_map(local, mesh=state.mesh, in_specs=(split_specs,),
                           out_specs=tuple(P() for _ in todo),
                           check_vma=False)(tuple(shards[c] for c in todo))
  out = [None] * len(shards)
  for c, g in zip(todo, gathered):
    out[c] = g
  return tuple(out)


def _update_groups(layout, cfg) -> list:
  """`(chunks, offloaded)` for each `tx.update` call, in order: every chunk
  whose optimizer state is on the device in one call, then each chunk whose
  optimizer state is offloaded alone."""
  host = (offload.offloaded_chunks(layout, cfg.offload_fraction)
          if cfg.offload_optimizer else frozenset())
  device = frozenset(range(len(layout.chunks))) - host
  return ([(device, False)] if device else []) + [
      (frozenset([c]), True) for c in sorted(host)]


def _update_chunks(state, chunks, grads, master, opt, owners, keep):
  """`tx.update` of the chunks in `chunks`, whose master shards and
  optimizer-state leaves (`opt`, flat, chunk-shaped: `optstate.stored`) are
  on the device. Returns their new master chunks (by chunk index) and the
  new optimizer-state leaves (by leaf index): those of `chunks` and those
  owned by no chunk (step counts, alike in every call)."""
  cfg, layout, tx = state.config, state.layout, state.tx
  # tx sees the statistics as views; other chunks' statistics are empty
  views = [x if c is None else
           jnp.reshape(x, layout.view_shape(c)) if c in chunks else
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
  params = layout.views(master, only=chunks)
  updates, new_opt = tx.update(
      layout.views(grads, fill_dtype=cfg.reduce_dtype, only=chunks),
      jax.tree_util.tree_unflatten(treedef, views), params)
  new_master = layout.from_views(optax.apply_updates(params, updates), chunks)
  new_master = {c: keep(new_master[c], master[c]) for c in chunks}
  new_leaves = [x for x, d in zip(jax.tree_util.tree_leaves(new_opt), on_disk)
                if not d]
  new_opt = {j: keep(x if c is None else jnp.reshape(x, opt[j].shape), opt[j])
             for j, (x, c) in enumerate(zip(new_leaves, owners))
             if c is None or c in chunks}
  return new_master, new_opt


def _update(state, grads, master, shardings, finite):
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
  offloaded chunk is updated where it lives instead (`_update_on_host`).
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
      m, leaves, to_gather[c] = _update_on_host(
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
    masters, leaves = _update_chunks(state, chunks, grads, master_here,
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


def _update_on_host(state, c, grads, master, opt, owners, finite, shardings):
  """`update_on="host"`: chunk `c`'s update as a host computation, where its
  master shard and optimizer state live (`compat.on_host`). Its gradient
  shard (and the step counts and the finite flag, scalars) go to the host;
  returns the new master shard and the new optimizer-state leaves (of `c`,
  and the step counts, on the device), all in host memory but the counts,
  and what the re-gather of stages 1-2 reads: the new master cast to the
  compute dtype, moved to the device (at stage 3 the next step's gathers
  read the host shard, so nothing comes back)."""
  cfg = state.config
  opt_at = jax.tree_util.tree_leaves(shardings.opt_state)
  on_host = lambda x, s: jax.device_put(x, s.with_memory_kind(offload.HOST))
  # its statistics, and the step counts (the empty statistics of other
  # leaves are made in the host computation)
  mine = [j for j, o in enumerate(owners)
          if o == c or (o is None and np.size(opt[j]))]
  args = ({j: opt[j] if owners[j] == c else on_host(opt[j], opt_at[j])
           for j in mine},
          on_host(grads[c], shardings.master[c]),
          master[c],
          None if finite is None else on_host(
              finite, NamedSharding(state.mesh, P())))
  regather = policy(cfg).regather
  others = [jax.ShapeDtypeStruct(np.shape(x), x.dtype) for x in opt]

  def update(stats, grad, shard, finite):
    keep = ((lambda new, old: new) if finite is None else
            (lambda new, old: jnp.where(finite, new, old)))
    opt_here = [stats[j] if j in stats else
                x if np.prod(x.shape) else jnp.zeros(x.shape, x.dtype)
                for j, x in enumerate(others)]
    grads_here = [grad if i == c else None for i in range(len(grads))]
    master_here = [shard if i == c else None for i in range(len(master))]
    masters, leaves = _update_chunks(state, frozenset([c]), grads_here,
                                     master_here, opt_here, owners, keep)
    compute = masters[c].astype(cfg.compute_dtype) if regather else None
    return masters[c], leaves, compute

  new_master, leaves, compute = compat.on_host(update)(*args)
  leaves = {j: x if owners[j] == c else
            jax.device_put(x, opt_at[j]) for j, x in leaves.items()}
  if compute is not None:
    compute = jax.device_put(compute, shardings.master[c].with_memory_kind(
        offload.DEVICE))
  return new_master, leaves, compute if regather else new_master


def _disk_inputs(state, pending, finite) -> dict:
  """What `_disk_update` needs from the step's program: the disk chunks'
  gradient shards (on the device), the optimizer state's leaves owned by
  no chunk (step counts) as they were before the step, by position among
  the leaves with each `OnDisk` one (`disk_tier.full_leaves`), and the
  finite flag (None when no step is skipped)."""
  flat, _ = disk_tier.full_leaves(state.opt_state)
  owners = optstate.owners(state.layout,
                           disk_tier.abstract(state.opt_state)).chunk
  counts = {j: x for j, (x, c) in enumerate(zip(flat, owners))
            if c is None and not disk_tier.is_on_disk(x) and np.size(x)}
  return {"grads": pending, "counts": counts, "finite": finite}


def _skeleton(state) -> ZeroTrainState:
  """`state` as `ShapeDtypeStruct`s, its `OnDisk`s included: the static
  parts and shapes the disk tier's programs are built from."""
  full = state.replace(opt_state=disk_tier.abstract(state.opt_state),
                       master=disk_tier.abstract(state.master))
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), full)


def _disk_chunk_program(skeleton, c: int) -> Callable:
  """The jitted host update of disk chunk `c`: `(statistics by position,
  counts by position, gradient shard, master shard, finite) -> (new master
  shard, new leaves by position, the re-gather's input)`, the very
  computation of the host tier's `_update_on_host`."""
  shardings = state_shardings(skeleton)
  owners = optstate.owners(skeleton.layout, skeleton.opt_state).chunk
  template = jax.tree_util.tree_leaves(skeleton.opt_state)
  n = len(skeleton.layout.chunks)

  def run(stats, counts, grad, master, finite):
    opt = [stats[j] if j in stats else counts[j] if j in counts else t
           for j, t in enumerate(template)]
    return _update_on_host(skeleton, c, [grad if i == c else None
                                         for i in range(n)],
                           [master if i == c else None for i in range(n)],
                           opt, owners, finite, shardings)
  # the statistics, gradient and master shard are the caller's to give up
  return jax.jit(run, donate_argnums=(0, 2, 3))


def disk_update_programs(state) -> dict:
  """{disk chunk: (its jitted host update, its arguments as
  `ShapeDtypeStruct`s)} of a disk-tier state (real or `shard_shape`'s):
  for `.lower(...).compile()` (its host bytes) and `.trace(...).lower(
  lowering_platforms=("cuda",))` (its host <-> device moves). A stacked
  chunk's is the update of one of its layers (run once per layer)."""
  full = _skeleton(state)
  return {c: _disk_program_and_args(
      full if not state.layout.chunks[c].layers else _one_layer(full, c),
      state, c)
          for c in sorted(disk_tier.disk_chunks(state.layout, state.config))}


def _disk_program_and_args(skeleton, state, c: int) -> tuple:
  """`disk_update_programs`' entry for chunk `c` of `skeleton`."""
  where = state_shardings(skeleton)
  flat = jax.tree_util.tree_leaves(skeleton.opt_state)
  opt_at = jax.tree_util.tree_leaves(where.opt_state)
  owners = optstate.owners(skeleton.layout, skeleton.opt_state).chunk
  full, _ = disk_tier.full_leaves(state.opt_state)
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  counts = {j: sds(x, opt_at[j]) for j, (x, o) in enumerate(zip(flat, owners))
            if o is None and np.size(x)}
  guard = state.loss_scale is not None or state.config.skip_nonfinite
  finite = (jax.ShapeDtypeStruct((), jnp.bool_, sharding=NamedSharding(
      state.mesh, P())) if guard else None)
  device = where.master[c].with_memory_kind(offload.DEVICE)
  stats = {j: sds(flat[j], opt_at[j]) for j, o in enumerate(owners)
           if o == c and disk_tier.is_on_disk(full[j])}
  return (_disk_chunk_program(skeleton, c),
          (stats, counts, sds(skeleton.master[c], device),
           sds(skeleton.master[c], where.master[c]), finite))


def _one_layer(skeleton, c: int):
  """`skeleton` with stacked chunk `c` one layer deep (`[1, length]`): what
  the update of one of its layers is built from (element-wise, so each
  layer's update is the chunk's, row by row)."""
  layout = skeleton.layout
  chunks = tuple(dataclasses.replace(ch, layers=1) if i == c else ch
                 for i, ch in enumerate(layout.chunks))
  row = lambda x: jax.ShapeDtypeStruct((1,) + tuple(x.shape[1:]), x.dtype)
  owners = optstate.owners(layout, skeleton.opt_state).chunk
  flat, treedef = jax.tree_util.tree_flatten(skeleton.opt_state)
  return skeleton.replace(
      layout=dataclasses.replace(layout, chunks=chunks),
      master=tuple(row(m) if i == c else m
                   for i, m in enumerate(skeleton.master)),
      opt_state=jax.tree_util.tree_unflatten(treedef, [
          row(x) if o == c else x for x, o in zip(flat, owners)]))


@functools.lru_cache(maxsize=None)
def _layer_programs():
  """(take layer l of an array, put a layer back into one (donated)), in
  the array's own sharding and memory kind; l is an argument, so one
  compile serves every layer."""
  take = jax.jit(lambda x, l: jax.lax.dynamic_slice_in_dim(x, l, 1, 0))
  put = jax.jit(lambda x, r, l: jax.lax.dynamic_update_slice_in_dim(x, r, l, 0),
                donate_argnums=(0,))
  return take, put


def _disk_update(state, inputs, programs: dict) -> ZeroTrainState:
  """The disk chunks' updates after the step's program (`config.disk`):
  one chunk at a time (one layer at a time for a stacked `[layers, length]`
  chunk), its statistics (and its master shard, where that is on disk too)
  read from their files into host memory, shard by shard (the next item's
  read overlapping this one's update, the previous item's write overlapping
  it too: `disk.ChunkFiles.stream`), updated on the host by
  `_disk_chunk_program`, written back. Then, at stages 1-2, the disk
  chunks' new compute-dtype shards are gathered into the compute copy.
  `programs` caches the jitted programs per state structure."""
  cfg, layout = state.config, state.layout
  files = disk_tier.files(cfg)
  flat, treedef = disk_tier.full_leaves(state.opt_state)
  skeleton = _skeleton(state)
  owners = optstate.owners(layout, skeleton.opt_state).chunk
  where = state_shardings(skeleton)
  opt_at = jax.tree_util.tree_leaves(where.opt_state)
  structure = jax.tree_util.tree_structure(state)
  take, put = _layer_programs()
  # per chunk: (position among the statistics, or "master"; OnDisk; sharding)
  entries = {c: [(j, flat[j], opt_at[j]) for j, o in enumerate(owners)
                 if o == c and disk_tier.is_on_disk(flat[j])] +
             ([("master", state.master[c], where.master[c])]
              if disk_tier.is_on_disk(state.master[c]) else [])
             for c in inputs["grads"]}
  items = [(c, l) for c in sorted(entries)
           for l in (range(layout.chunks[c].layers) if layout.chunks[c].layers
                     else (None,))]
  master, regather, counts = list(state.master), {}, {}

  def program(c, l):
    key = (structure, c, l is not None)
    if key not in programs:
      programs[key] = _disk_chunk_program(
          skeleton if l is None else _one_layer(skeleton, c), c)
    return programs[key]

  def read(item):
    c, l = item
    return disk_tier.read_shards(files, [(x, at) for _, x, at in entries[c]], l)

  def update(item, arrays):
    c, l = item
    loaded = dict(zip([e for e, _, _ in entries[c]], disk_tier.assemble(
        [(x, at) for _, x, at in entries[c]], arrays, l)))
    if l is None:
      grad, shard = inputs["grads"].pop(c), loaded.pop("master", master[c])
    else:
      last = l == layout.chunks[c].layers - 1
      grad = take(inputs["grads"].pop(c) if last else inputs["grads"][c], l)
      shard = loaded.pop("master", None)
      if shard is None:
        shard = take(master[c], l)
    new_master, leaves, gathered = program(c, l)(
        loaded, inputs["counts"], grad, shard, inputs["finite"])
    del loaded, grad, shard
    for j in inputs["counts"]:
      counts.setdefault(j, leaves[j])
    if not disk_tier.is_on_disk(master[c]):
      master[c] = new_master if l is None else put(master[c], new_master, l)
    if l is None:
      regather[c] = gathered
    else:
      regather.setdefault(c, []).append(gathered)
    return l, [(x, leaves.pop(e) if e != "master" else new_master)
               for e, x, _ in entries[c]]

  def write(item, done):
    l, written = done
    return disk_tier.write_shards(files, written, l)

  files.stream(items, read, update, write)
  compute = state.compute
  if policy(cfg).regather:
    key = (structure, "regather")
    if key not in programs:
      programs[key] = jax.jit(functools.partial(_gather_updated, skeleton))
    shards = tuple(regather.get(c) for c in range(len(layout.chunks)))
    shards = tuple(jnp.concatenate(s, 0) if isinstance(s, list) else s
                   for s in shards)
    gathered = programs[key](shards)
    compute = tuple(x if g is None else g
                    for x, g in zip(state.compute, gathered))
  for j, x in counts.items():
    flat[j] = x
  return state.replace(master=tuple(master), compute=compute,
                       opt_state=jax.tree_util.tree_unflatten(treedef, flat))


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


def _step(loss_fn, has_aux, mutable, modes, state: ZeroTrainState, batch,
          rng):
  cfg = state.config
  pol = policy(cfg)
  shardings = state_shardings(state)
  # Master chunks in host memory stay there: at stage 3 their gathers move
  # them to the device (one layer at a time for layer chunks), and `_update`
  # moves them along with their optimizer state.
  loss_fn, mutable = state.frontend.loss(loss_fn, has_aux, mutable)
  grads, loss, aux, fields = grads_and_metrics(loss_fn, has_aux, mutable,
                                               state, batch, rng, modes)

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

  if pol.update_slice:
    # float32 stages 1-2: the replicated master is the compute copy; this
    # device updates its own slice of it.
    master = tuple(jax.lax.with_sharding_constraint(
        m, NamedSharding(state.mesh, chunk_spec(m.ndim, shard_axes(cfg))))
                   for m in state.master)
  else:
    master = state.master
  new_master, opt_state, to_gather, pending = _update(state, grads, master,
                                                      shardings, finite)
  loss_scale = state.loss_scale
  if loss_scale is not None:
    loss_scale = precision.update(cfg.loss_scale, loss_scale, finite)
    metrics["loss_scale"] = loss_scale.scale
  if guard:
    metrics["skipped"] = ~finite

  compute = state.compute
  if pol.regather:
    gathered = _gather_updated(state, to_gather)
    if pol.compute_copy:   # a disk chunk's: after `_disk_update`
      compute = tuple(state.compute[c] if g is None else g
                      for c, g in enumerate(gathered))
    else:
      new_master = gathered
  if isinstance(aux, dict):
    metrics.update(aux)
  elif aux is not None:
    metrics["aux"] = aux
  new_state = state.replace(
      step=state.step + (finite.astype(jnp.int32) if guard else 1),
      master=new_master, compute=compute, opt_state=opt_state,
      loss_scale=loss_scale, extras={**state.extras, **fields})
  new_state = offload.place(new_state, shardings)
  if cfg.disk:
    return new_state, metrics, _disk_inputs(state, pending, finite)
  return new_state, metrics


def check_state(state, caller: str, mutable: tuple = ()) -> None:
  """A live ZeroTrainState that has the `mutable` fields, else a clear error."""
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"{caller} takes the ZeroTrainState from zerojax.shard(), "
                    f"got {type(state).__name__}.")
  check_live(state, caller)
  missing = [m for m in mutable if m not in state.extras]
  if missing:
    static = [m for m in missing if m in dict(state.static_extras)]
    where = (f"{static} are static (pytree_node=False) fields, which a step "
             "cannot change" if static else
             f"the state's own fields are {sorted(state.extras) or 'none'}")
    raise ValueError(
        f"mutable={mutable}: the state has no field {missing[0]!r} ({where}). "
        "Keep it in a TrainState subclass before zerojax.shard, e.g. class "
        "TrainState(train_state.TrainState): batch_stats: Any, created with "
        "batch_stats=variables['batch_stats'].")


def check_mutable(mutable, caller: str) -> tuple:
  """`mutable` as a tuple of field names, else a TypeError."""
  if isinstance(mutable, str):
    mutable = (mutable,)
  if not (isinstance(mutable, (tuple, list))
          and all(isinstance(m, str) for m in mutable)):
    raise TypeError(f"{caller}(mutable={mutable!r}) must be a tuple of field "
                    "names of your TrainState, e.g. ('batch_stats',).")
  return tuple(mutable)


def shard_batch(state, batch, accum_steps: int = 1):
  """`batch` split over the data axis (and the replica axis: `batch_axes`),
  checked: every array with the same leading (global batch) axis, a
  multiple of devices x `accum_steps`. `ShapeDtypeStruct`s (an abstract
  batch, for `.lower`) get the sharding."""
  devices = state.num_shards * state.num_replicas
  per_step = devices * accum_steps
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
        f"global batch {size} is not divisible by {devices} devices "
        f"x accum_steps {accum_steps} = {per_step}; use a multiple of "
        f"{per_step}.")
  sharding = NamedSharding(state.mesh, P(batch_axes(state.config)))
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      if isinstance(x, jax.ShapeDtypeStruct) else jax.device_put(x, sharding),
      batch)


def train_step(loss_fn: Callable, *, has_aux: bool = False,
               mutable: tuple = (), donate: bool = True) -> Callable:
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
    mutable: names of fields of the user's `TrainState` subclass that the
      loss updates, e.g. `("batch_stats",)` for BatchNorm. `loss_fn` gets
      each as a keyword argument after `batch` (and `rng`) and returns
      `(loss, updates)`, or `(loss, (aux, updates))` with `has_aux`;
      `updates` is a dict `{field: new value}` (Flax's `apply(...,
      mutable=["batch_stats"])` returns one), each value with the field's
      keys and shapes (cast to its dtypes); a declared field left out keeps
      its value. Floating values are averaged over the data axis, as
      Flax's examples `pmean` them; other values must agree across devices
      (the first device's are kept). Under `accum_steps=k` the
      micro-batches update in sequence, each reading the previous one's
      values, as k plain steps of the model would. The updates are kept
      when a step is skipped (a non-finite gradient), as PyTorch keeps
      BatchNorm's running statistics. BatchNorm with `axis_name=` the data
      axis (synchronised batch norm) works as written: the loss runs inside
      a `shard_map` over that axis.
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
    A state with `placement="auto"` is placed by its first step (see
    `ZeroConfig.placement`); `lower` and `trace` take it as it is placed.
  """
  if not callable(loss_fn):
    raise TypeError(f"train_step() takes the loss function, got {loss_fn!r}.")
  for name, value in (("has_aux", has_aux), ("donate", donate)):
    if not isinstance(value, bool):
      raise TypeError(f"train_step({name}={value!r}) must be True or False.")
  mutable = check_mutable(mutable, "train_step")
  jitted = jax.jit(functools.partial(_step, loss_fn, has_aux, mutable, {}),
                   donate_argnums=(0,) if donate else ())

  programs: dict = {}   # the disk tier's, per state structure

  def prepare(state, batch):
    check_state(state, "step()", mutable)
    if state.config.disk and not donate:
      raise ValueError(
          "train_step(donate=False) keeps the input state, but a disk-tier "
          "state (offload_optimizer='disk') has its statistics rewritten in "
          "their files by every step; use donate=True (the default), and "
          "checkpoint.save to keep a state to go back to.")
    return shard_batch(state, batch, state.config.accum_steps)

  def step(state, batch, rng=None):
    if getattr(state, "config", None) is not None and (
        state.config.placement == "auto"):
      from zerojax import planner   # it compiles steps: imports this module
      check_state(state, "step()", mutable)
      state = planner.place_as_planned(state, loss_fn, batch,
                                       has_aux=has_aux, mutable=mutable)
    out = jitted(state, prepare(state, batch), rng)
    if state.config.disk:
      new_state, metrics, inputs = out
      return _disk_update(new_state, inputs, programs), metrics
    return out

  step.lower = lambda state, batch, rng=None: jitted.lower(
      state, prepare(state, batch), rng)
  # on CPU, memory-kind transfers lower to nothing: lower for "cuda" to see them
  step.trace = lambda state, batch, rng=None: jitted.trace(
      state, prepare(state, batch), rng)

  def gathering(state, batch, rng=None) -> dict:
    # a trace of its own, filling its own dict: the step's trace is cached
    # after its first call, and a cached trace runs no Python
    modes = {}
    jax.jit(functools.partial(_step, loss_fn, has_aux, mutable, modes)).trace(
        state, prepare(state, batch), rng)
    return modes

  step.gathering = gathering
  return step
