"""The disk tier's part of a step (`offload_optimizer="disk"`): after the
step's program, the disk chunks stream through host memory, one chunk (or
one layer of a stacked chunk) at a time, each updated on the host by the
host tier's own computation (`update.update_on_host`).

  `step_inputs`      what the step's program hands over: the disk chunks'
                     gradient shards, the step counts, the finite flag
  `run`              the stream, then the re-gather of stages 1-2
  `update_programs`  each disk chunk's jitted host update and its abstract
                     arguments (for benchmarks: bytes and transfers)

Which arrays live in files, and the shard I/O, are `disk_tier`'s.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax import disk_tier, offload, optstate
from zerojax.policy import policy
from zerojax.state import ZeroTrainState, state_shardings
from zerojax.update import gather_updated, update_on_host


def step_inputs(state, pending, finite) -> dict:
  """What `run` needs from the step's program: the disk chunks'
  gradient shards (on the device), the optimizer state's leaves owned by
  no chunk (step counts) as they were before the step, by position among
  the leaves with each `OnDisk` one (`disk_tier.full_leaves`), and the
  finite flag (None when no step is skipped)."""
  flat, _ = disk_tier.full_leaves(state.opt_state)
  owners = optstate.owners(state.layout,
                           disk_tier.abstract(state.opt_state)).chunk
  counts = {j: flat[j] for j in optstate.counts(flat, owners)}
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
  computation of the host tier's `update_on_host`."""
  shardings = state_shardings(skeleton)
  owners = optstate.owners(skeleton.layout, skeleton.opt_state).chunk
  template = jax.tree_util.tree_leaves(skeleton.opt_state)
  n = len(skeleton.layout.chunks)

  def run(stats, counts, grad, master, finite):
    opt = [stats[j] if j in stats else counts[j] if j in counts else t
           for j, t in enumerate(template)]
    return update_on_host(skeleton, c, [grad if i == c else None
                                         for i in range(n)],
                           [master if i == c else None for i in range(n)],
                           opt, owners, finite, shardings)
  # the statistics, gradient and master shard are the caller's to give up
  return jax.jit(run, donate_argnums=(0, 2, 3))


def update_programs(state) -> dict:
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
  """`update_programs`' entry for chunk `c` of `skeleton`."""
  where = state_shardings(skeleton)
  flat = jax.tree_util.tree_leaves(skeleton.opt_state)
  opt_at = jax.tree_util.tree_leaves(where.opt_state)
  owners = optstate.owners(skeleton.layout, skeleton.opt_state).chunk
  full, _ = disk_tier.full_leaves(state.opt_state)
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  counts = {j: sds(flat[j], opt_at[j]) for j in optstate.counts(flat, owners)}
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


def run(state, inputs, programs: dict) -> ZeroTrainState:
  """The disk chunks' updates after the step's program (`config.disk`):
  one chunk at a time (one layer at a time for a stacked `[layers, length]`
  chunk), its statistics (and its master shard, where that is on disk too)
  read from their files into host memory, shard by shard (the next item's
  read overlapping this one's update, the previous item's write overlapping
  it too: `disk.ChunkFiles.stream`), updated on the host by
  `_disk_chunk_program`, written back. Then, at stages 1-2, the disk
  chunks' new compute-dtype shards are gathered into the compute copy; at
  stage 3 (`StagePolicy.sharded_compute`) each is the chunk's new sharded
  compute copy, put in place as it comes.
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
  compute = list(state.compute)
  sharded_compute = policy(cfg).sharded_compute

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
    if sharded_compute:   # stage 3: the copy the next step gathers
      compute[c] = gathered if l is None else put(compute[c], gathered, l)
    elif l is None:
      regather[c] = gathered
    else:
      regather.setdefault(c, []).append(gathered)
    return l, [(x, leaves.pop(e) if e != "master" else new_master)
               for e, x, _ in entries[c]]

  def write(item, done):
    l, written = done
    return disk_tier.write_shards(files, written, l)

  files.stream(items, read, update, write)
  if policy(cfg).regather:
    key = (structure, "regather")
    if key not in programs:
      programs[key] = jax.jit(functools.partial(gather_updated, skeleton))
    shards = tuple(regather.get(c) for c in range(len(layout.chunks)))
    shards = tuple(jnp.concatenate(s, 0) if isinstance(s, list) else s
                   for s in shards)
    gathered = programs[key](shards)
    compute = [x if g is None else g for x, g in zip(compute, gathered)]
  for j, x in counts.items():
    flat[j] = x
  return state.replace(master=tuple(master), compute=tuple(compute),
                       opt_state=jax.tree_util.tree_unflatten(treedef, flat))
