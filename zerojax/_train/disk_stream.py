"""The disk tier's part of a step (`offload_optimizer="disk"`): after the
step's program, the disk chunks stream through host memory, one chunk (or
one layer of a stacked chunk) at a time, each updated on the host by the
host tier's own computation (`update.update_on_host`).

  `step_inputs`      what the step's program hands over: the disk chunks'
                     gradient files (`sink`), the step counts, the finite
                     flag
  `sink`             inside the step's program, each device writes its
                     disk chunks' gradient shards to their files as they
                     are reduced (ZeRO-Infinity's gradient swap-out)
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

from zerojax._core import compat
from zerojax._tiers import disk
from zerojax._tiers import disk_tier
from zerojax._core import offload
from zerojax._core import optstate
from zerojax._options.config import shard_axes
from zerojax._options.policy import policy
from zerojax._state.state import ZeroTrainState, chunk_spec, state_shardings
from zerojax._train.update import gather_updated, update_on_host


_FAILED_WRITES: list = []   # `sink`'s write errors, for `run` to raise


def step_inputs(state, pending, finite) -> dict:
  """What `run` needs from the step's program (inside it): the disk
  chunks' gradient files, written by `sink`, the optimizer state's leaves
  owned by no chunk (step counts) as they were before the step, by
  position among the leaves with each `OnDisk` one
  (`disk_tier.full_leaves`), and the finite flag (None when no step is
  skipped)."""
  flat, _ = disk_tier.full_leaves(state.opt_state)
  owners = optstate.owners(state.layout,
                           disk_tier.abstract(state.opt_state)).chunk
  counts = {j: flat[j] for j in optstate.counts(flat, owners)}
  return {"grads": sink(state, pending), "counts": counts, "finite": finite}


def sink(state, grads: dict) -> dict:
  """Inside the step's program: writes each disk chunk's gradient (`grads`,
  {chunk: its gradient, sharded as its master}) to its file
  (`disk_tier.grad_file`), each device its own shard through a host
  callback (`compat.write_on_host`), so the shards leave the device as
  they are reduced instead of waiting there for the stream (DeepSpeed's
  `swap_out_gradients` under ZeRO-Infinity), and the host holds no more
  than the shard being written per device. A replica (HSDP's replica
  axis) writes nothing: its shard is the first replica's. Returns {chunk:
  its file's `OnDisk`}; `run` waits for the writes
  (`jax.effects_barrier`) and raises a failed one's error (a full disk)."""
  if not grads:
    return {}
  cfg = state.config
  chunks = sorted(grads)
  out = {c: disk_tier.grad_file(state, c, grads[c].shape, grads[c].dtype)
         for c in chunks}
  axes = shard_axes(cfg)
  others = [a for a in state.mesh.axis_names
            if a not in (axes if isinstance(axes, tuple) else (axes,))]

  def write(x, k, first, shard):
    if first:
      width = shard.shape[-1]
      try:
        disk_tier.files(cfg).write(x.key, shard, disk.shard_offsets(
            x.shape, shard.dtype.itemsize, int(k) * width,
            (int(k) + 1) * width)).result()
      except OSError as e:   # raised by `run`, not inside the program
        _FAILED_WRITES.append(e)

  def local(shards):
    k = jax.lax.axis_index(axes)
    first = jnp.bool_(True)
    for a in others:
      first = first & (jax.lax.axis_index(a) == 0)
    for c, shard in zip(chunks, shards):
      compat.write_on_host(functools.partial(write, out[c]), k, first, shard)
    return ()

  jax.shard_map(local, mesh=state.mesh, in_specs=(tuple(
      chunk_spec(len(grads[c].shape), axes) for c in chunks),),
                out_specs=(), check_vma=False)(
                    tuple(grads[c] for c in chunks))
  return out


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
  chunk's is the update of one of its layers (run once per layer), and
  under `sub_group_size` the update of its largest sub-group."""
  full = _skeleton(state)
  out = {}
  for c in sorted(disk_tier.disk_chunks(state.layout, state.config)):
    (a, b), = sub_groups(state, c)[:1]
    out[c] = _disk_program_and_args(
        _part(full, c, b - a, state.num_state_shards), state, c)
  return out


def sub_groups(state, c: int) -> list:
  """The column ranges `(a, b)` of each device's shard of chunk `c` that
  the stream updates one at a time (largest first): the whole shard, or
  under `ZeroConfig.sub_group_size` (DeepSpeed's, per device) near-equal
  pieces of at most that many elements."""
  shard = state.layout.chunks[c].length // state.num_state_shards
  size = state.config.sub_group_size
  if size is None or size >= shard:
    return [(0, shard)]
  piece = -(-shard // -(-shard // size))   # near-equal, at most `size`
  return [(a, min(a + piece, shard)) for a in range(0, shard, piece)]


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
  host = where.master[c].with_memory_kind(offload.HOST)   # from its file
  stats = {j: sds(flat[j], opt_at[j]) for j, o in enumerate(owners)
           if o == c and disk_tier.is_on_disk(full[j])}
  return (_disk_chunk_program(skeleton, c),
          (stats, counts, sds(skeleton.master[c], host),
           sds(skeleton.master[c], where.master[c]), finite))


def _part(skeleton, c: int, width: int, shards: int):
  """`skeleton` with chunk `c` cut to the part one stream item updates: a
  stacked chunk one layer deep (`[1, length]`), and each device's shard
  `width` columns wide: what that item's update is built from (the update
  is element-wise: `tx` must be separable by chunk, and sees each chunk as
  one array, so a part's update is the chunk's, element by element)."""
  layout = skeleton.layout
  ch = layout.chunks[c]
  if not ch.layers and width * shards == ch.length:
    return skeleton
  length = width * shards
  chunks = tuple(dataclasses.replace(
      ch, layers=min(ch.layers, 1), length=length,
      used=min(ch.used, length)) if i == c else ch
                 for i, ch in enumerate(layout.chunks))
  row = lambda x: jax.ShapeDtypeStruct(chunks[c].shape, x.dtype)
  owners = optstate.owners(layout, skeleton.opt_state).chunk
  flat, treedef = jax.tree_util.tree_flatten(skeleton.opt_state)
  return skeleton.replace(
      layout=dataclasses.replace(layout, chunks=chunks),
      master=tuple(row(m) if i == c else m
                   for i, m in enumerate(skeleton.master)),
      opt_state=jax.tree_util.tree_unflatten(treedef, [
          row(x) if o == c else x for x, o in zip(flat, owners)]))


@functools.lru_cache(maxsize=None)
def _zeros(shape: tuple, dtype, sharding):
  """A program making zeros of `shape` in `sharding`."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _part_programs(sharding, shape: tuple, shards: int, width: int):
  """(take a part of an array, put a part back into one (donated)) for a
  `shape` array in `sharding` (memory kind included): a part is one layer
  l of a `[layers, length]` array (l an argument) and the columns
  a:a+width of each of its `shards` shards (a an argument), so one compile
  serves every layer and sub-group of that width. No communication: each
  device cuts its own shard."""
  rows = len(shape) > 1
  split = lambda x: x.reshape(x.shape[:-1] + (shards, x.shape[-1] // shards))
  flat = lambda y: y.reshape(y.shape[:-2] + (shards * y.shape[-1],))

  def take(x, l, a):
    y = split(x)
    if rows:
      y = jax.lax.dynamic_slice_in_dim(y, l, 1, 0)
    return flat(jax.lax.dynamic_slice_in_dim(y, a, width, y.ndim - 1))

  def put(x, part, l, a):
    y = split(x)
    at = (l, 0, a) if rows else (0, a)
    return flat(jax.lax.dynamic_update_slice(y, split(part), at))

  return (jax.jit(take, out_shardings=sharding),
          jax.jit(put, out_shardings=sharding, donate_argnums=(0,)))


def run(state, inputs, programs: dict) -> ZeroTrainState:
  """The disk chunks' updates after the step's program (`config.disk`):
  one item at a time, an item being a chunk, or one layer of a stacked
  `[layers, length]` chunk, or under `sub_group_size` a sub-group of the
  columns of each device's shard of either (`sub_groups`). Its statistics
  (and its master, where that is on disk too) are read from their files
  into host memory, shard by shard (the next item's read overlapping this
  one's update, the previous item's write overlapping it too:
  `disk.ChunkFiles.stream`), updated on the host by `_disk_chunk_program`,
  written back. Then, at stages 1-2, the disk chunks' new compute-dtype
  shards are gathered into the compute copy; at stage 3
  (`StagePolicy.sharded_compute`) each is put into the chunk's sharded
  compute copy as it comes. `programs` caches the jitted programs per
  state structure."""
  cfg, layout = state.config, state.layout
  files = disk_tier.files(cfg)
  flat, treedef = disk_tier.full_leaves(state.opt_state)
  skeleton = _skeleton(state)
  owners = optstate.owners(layout, skeleton.opt_state).chunk
  where = state_shardings(skeleton)
  opt_at = jax.tree_util.tree_leaves(where.opt_state)
  structure = jax.tree_util.tree_structure(state)
  shards = state.num_state_shards
  # per chunk: (position among the statistics, or "master"; OnDisk; sharding)
  entries = {c: [(j, flat[j], opt_at[j]) for j, o in enumerate(owners)
                 if o == c and disk_tier.is_on_disk(flat[j])] +
             ([("master", state.master[c], where.master[c])]
              if disk_tier.is_on_disk(state.master[c]) else [])
             for c in inputs["grads"]}
  # what each item reads: those, and its gradient (into host memory; read,
  # never written back)
  reads = {c: entries[c] + [("grad", x, where.master[c].with_memory_kind(
      offload.HOST))] for c, x in inputs["grads"].items()}
  items = [(c, l, cols) for c in sorted(entries)
           for l in (range(layout.chunks[c].layers) if layout.chunks[c].layers
                     else (None,))
           for cols in sub_groups(state, c)]
  whole = {c: len(sub_groups(state, c)) == 1 and not layout.chunks[c].layers
           for c in entries}
  master, compute, counts = list(state.master), list(state.compute), {}
  regather = {}   # stages 1-2: chunk -> its new compute-dtype shards
  sharded_compute, regathers = policy(cfg).sharded_compute, policy(cfg).regather

  def program(c, l, cols):
    width = cols[1] - cols[0]
    key = (structure, c, l is not None, width)
    if key not in programs:
      programs[key] = _disk_chunk_program(
          _part(skeleton, c, width, shards), c)
    return programs[key]

  def programs_of(x, cols):
    return _part_programs(x.sharding, x.shape, shards, cols[1] - cols[0])

  def take(x, l, cols):   # this item's part of `x`
    return programs_of(x, cols)[0](x, l or 0, cols[0])

  def put(x, new, l, cols):   # `x` (donated) with this item's part `new`
    return programs_of(x, cols)[1](x, new, l or 0, cols[0])

  def read(item):
    c, l, cols = item
    return disk_tier.read_shards(files, [(x, at) for _, x, at in reads[c]],
                                 l, None if whole[c] else cols)

  def update(item, arrays):
    c, l, cols = item
    loaded = dict(zip([e for e, _, _ in reads[c]], disk_tier.assemble(
        [(x, at) for _, x, at in reads[c]], arrays, l,
        None if whole[c] else cols)))
    grad = loaded.pop("grad")
    if whole[c]:
      shard = loaded.pop("master", master[c])
    else:
      shard = loaded.pop("master", None)
      if shard is None:
        shard = take(master[c], l, cols)
    new_master, leaves, new = program(c, l, cols)(
        loaded, inputs["counts"], grad, shard, inputs["finite"])
    del loaded, grad, shard
    for j in inputs["counts"]:
      counts.setdefault(j, leaves[j])
    if not disk_tier.is_on_disk(master[c]):
      master[c] = new_master if whole[c] else put(master[c], new_master, l,
                                                  cols)
    # the new compute-dtype part: into stage 3's copy, or for the re-gather
    # (at stage 3 in fp32 `new` is the new master, already in place)
    if sharded_compute or regathers:
      target = compute if sharded_compute else regather
      if not whole[c] and target is regather and c not in regather:
        regather[c] = _zeros(layout.chunks[c].shape, new.dtype,
                             new.sharding)()
      target[c] = new if whole[c] else put(target[c], new, l, cols)
    return (l, None if whole[c] else cols), [
        (x, leaves.pop(e) if e != "master" else new_master)
        for e, x, _ in entries[c]]

  def write(item, done):
    (l, cols), written = done
    return disk_tier.write_shards(files, written, l, cols)

  jax.effects_barrier()   # the step's `sink` has written the gradients
  if _FAILED_WRITES:
    error = _FAILED_WRITES[0]
    _FAILED_WRITES.clear()
    raise error
  files.stream(items, read, update, write)
  if regathers:
    key = (structure, "regather")
    if key not in programs:
      programs[key] = jax.jit(functools.partial(gather_updated, skeleton))
    gathered = programs[key](tuple(regather.get(c)
                                   for c in range(len(layout.chunks))))
    compute = [x if g is None else g for x, g in zip(compute, gathered)]
  for j, x in counts.items():
    flat[j] = x
  return state.replace(master=tuple(master), compute=tuple(compute),
                       opt_state=jax.tree_util.tree_unflatten(treedef, flat))
