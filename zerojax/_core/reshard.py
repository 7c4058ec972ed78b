"""Moving a state between its tree form and its chunk form, one chunk at a
time, with explicit collectives.

Tree form: the ordinary `TrainState` content (parameter tree, optax state
on it), each leaf sharded on its largest axis the device count divides
(`meshes.leaf_spec`). Chunk form: `ZeroTrainState`'s chunks and chunk views.
`shard()` and a `restore()` onto another chunk layout pack into chunk
form; `export_params` of a live state unpacks into tree form.

Left to GSPMD, one program converting the whole state cannot express a
leaf's shard as slices of chunk shards and replicates whole leaves on
every device ("involuntary full rematerialization"). Here every chunk is
converted by its own `shard_map` programs: tree -> chunk gathers one leaf
(or a group of small leaves up to the largest leaf's bytes, at least 1 MiB)
and keeps this device's window of the chunk; chunk -> tree gathers the
chunk and keeps this device's slice of each leaf. A device holds its part
of both forms plus one chunk (or one leaf) at a time. Chunks a device holds
whole (replicated, or on a one-device mesh) need no gather: consecutive
ones are packed by one program, up to the largest leaf's bytes or 64 MiB
(`packed`), which is then what a device holds beside both forms.
"""
from __future__ import annotations

import functools
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._core import meshes
from zerojax._core.layout import ChunkLayout
from zerojax._core.offload import HOST


def _on_device(x):
  """`x`, in device memory if it was offloaded to host."""
  if getattr(getattr(x, "sharding", None), "memory_kind", None) == HOST:
    return jax.device_put(x, x.sharding.with_memory_kind("device"))
  return x


def _placed(x, sharding):
  """`x` in `sharding`'s memory kind (programs below write device memory)."""
  if getattr(sharding, "memory_kind", None) == HOST:
    return jax.device_put(x, sharding)
  return x


def copy(x, sharding=None):
  """A copy of `x` (in `sharding`, default its own) that shares no buffer
  with it: the other form of a state must survive the donation of this one
  (a train step donates its state; `jax.device_put` alone may alias)."""
  # device_put(may_alias=False) still reuses a one-device array's buffer
  # for its first shard when replicating it (jax 0.10): copy first.
  return jax.device_put(jnp.array(x, copy=True),
                        x.sharding if sharding is None else sharding)


def _is_split(sharding, axis_name) -> bool:
  spec = getattr(sharding, "spec", P())
  return len(spec) > 0 and spec[-1] == axis_name


# ---- tree form -> chunk form --------------------------------------------------------
# the least a group of leaves may hold: a model of small leaves (a test's)
# then compiles a few programs, not one per leaf; a real model's largest
# leaf is far above it
GROUP_FLOOR = 1 << 20
# ... and the least a program packing whole chunks may make (`packed`):
# what it adds to a device beside both forms of the state
WHOLE_GROUP_FLOOR = 64 << 20


def _largest_leaf(layout: ChunkLayout) -> int:
  """The bytes of the layout's largest chunked leaf."""
  return max((layout.leaves[i].size * layout.leaves[i].dtype.itemsize
              for c in layout.chunks for i in c.leaves), default=0)


def leaf_groups(layout: ChunkLayout, leaves: Sequence[int]) -> list:
  """Consecutive leaves grouped up to the layout's largest leaf in bytes (at
  least `GROUP_FLOOR`): one program per group (fewer compilations) still
  holds at most that much."""
  limit = max(_largest_leaf(layout), GROUP_FLOOR)
  groups, size = [], limit
  for i in leaves:
    nbytes = layout.leaves[i].size * layout.leaves[i].dtype.itemsize
    if size + nbytes > limit:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += nbytes
  return groups


def add_leaf_window(layout, c, i, leaf, shard, mesh, axis_name):
  """Inside jit: `shard` (chunk `c`, sharded on its last axis) with leaf `i`
  written into it: the leaf is made sharded, gathered, and each device keeps
  the window of it that falls in its slice of the chunk."""
  chunk, info = layout.chunks[c], layout.leaves[i]
  n = meshes.axes_size(mesh, axis_name)
  width = chunk.length // n
  lead = (chunk.layers,) if chunk.layers else ()
  spec = meshes.leaf_spec(leaf.shape, n, axis_name)
  leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

  def local(part, shard):
    for d, name in enumerate(spec):
      if name is not None:
        part = jax.lax.all_gather(part, axis_name, axis=d, tiled=True)
    flat = jnp.reshape(part, lead + (-1,)).astype(shard.dtype)
    # position p of this device's slice holds leaf element start + p - offset
    j = (jax.lax.axis_index(axis_name) * width + jnp.arange(width)
         - info.offset)
    inside = (j >= 0) & (j < info.size)
    window = jnp.take(flat, jnp.clip(j, 0, info.size - 1), axis=len(lead))
    return jnp.where(inside, window, shard)

  spec_chunk = P(*([None] * len(lead)), axis_name)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec_chunk),
                       out_specs=spec_chunk, check_vma=False)(leaf, shard)


def packs_whole(layout, c, sharding, axis_name) -> bool:
  """Chunk `c` in `sharding` is packed whole by one program, from its whole
  leaves: replicated, split over an axis of one device (a one-device mesh:
  each device's window is the chunk), or a chunk of model rows."""
  return (not _is_split(sharding, axis_name)
          or meshes.axes_size(sharding.mesh, axis_name) == 1
          or bool(layout.chunks[c].model_shards))


@functools.lru_cache(maxsize=256)
def pack_programs(layout, c, sharding, axis_name, dtype=None,
                  leaves_of=lambda source: source) -> tuple:
  """`(start, fills)`: the jitted programs that build chunk `c` (in `dtype`,
  by default the chunk's) in `sharding`, reading its leaves from a source
  through `leaves_of(source)`, indexable by leaf number (by default the
  source is that: a `{leaf index: array}` mapping). Replicated: `start(source)`
  packs the whole chunk and `fills` is empty. Split on the last axis:
  `start(source)` gives zeros, and each `(group, fill)` of `fills` maps
  `(source, shard) -> shard` (shard donated), writing in the leaves of
  `group` (`leaf_groups`): one program per group bounds the leaves alive at
  once."""
  chunk = layout.chunks[c]
  dtype = chunk.dtype if dtype is None else dtype
  if packs_whole(layout, c, sharding, axis_name):
    # replicated, on one device, or a chunk of model rows (tensor
    # parallelism): one GSPMD program, which may hold the whole chunk on a
    # device while it packs
    start = jax.jit(lambda source: layout.pack_chunk(c, leaves_of(source), dtype),
                    out_shardings=sharding)
    return start, []
  start = jax.jit(lambda source: jnp.zeros(chunk.shape, dtype),
                  out_shardings=sharding)

  def fill(source, shard, group):
    leaves = leaves_of(source)
    for i in group:
      shard = add_leaf_window(layout, c, i, leaves[i], shard, sharding.mesh,
                              axis_name)
    return shard

  fills = [(group, jax.jit(functools.partial(fill, group=group),
                           out_shardings=sharding, donate_argnums=1))
           for group in leaf_groups(layout, chunk.leaves)]
  return start, fills


def chunk_from_leaves(layout: ChunkLayout, c: int, leaves: Mapping[int, Any],
                      sharding: NamedSharding, axis_name: str,
                      dtype: Any = None, release: bool = False) -> jax.Array:
  """Chunk `c` packed from `leaves` (leaf index -> array, any sharding), in
  `sharding` (replicated, or split on the last axis; any memory kind). With
  `release`, each leaf array is deleted once packed (a restore's own copy:
  the two forms of the state are then never both whole in memory)."""
  dtype = np.dtype(layout.chunks[c].dtype if dtype is None else dtype)
  device = sharding.with_memory_kind("device")
  members = [leaves[i] for i in layout.chunks[c].leaves]
  if (not packs_whole(layout, c, device, axis_name)
      and all(_on_this_host(x) for x in members)):
    return _placed(_host_packed(layout, c, leaves, device, dtype, release),
                   sharding)
  start, fills = pack_programs(layout, c, device, axis_name, dtype)
  if not fills:
    out = start({i: _on_device(leaves[i]) for i in layout.chunks[c].leaves})
    _delete([leaves[i] for i in layout.chunks[c].leaves] if release else [])
  else:
    out = start({})
    for group, fill in fills:
      out = _settled(fill({i: _on_device(leaves[i]) for i in group}, out))
      _delete([leaves[i] for i in group] if release else [])
  return _placed(out, sharding)


def _on_this_host(x) -> bool:
  """Whether this process can read all of `x` (a host array, or a device
  array whose every shard is this process's)."""
  return not isinstance(x, jax.Array) or x.is_fully_addressable


def _host_packed(layout, c: int, leaves: Mapping[int, Any],
                 sharding: NamedSharding, dtype, release: bool) -> jax.Array:
  """Chunk `c`, split over the devices, packed on the host
  (`pack_chunk(xp=numpy)`) from leaves this process holds whole, and each
  device sent its own shard: no program to compile (a packing program per
  group of leaves took most of `shard`'s time, and XLA's compile time grew
  faster than the leaf count), and no device receives more than its
  shard."""
  members = layout.chunks[c].leaves
  host = layout.pack_chunk(c, {i: np.asarray(leaves[i]) for i in members},
                           dtype, xp=np)
  _delete([leaves[i] for i in members] if release else [])
  return jax.make_array_from_callback(host.shape, sharding,
                                      lambda index: host[index])


def _settled(out):
  """`out`, once computed. Many different collective programs dispatched
  back to back can deadlock the CPU backend's in-process collectives
  (measured: a second restore in one process hung in an all-gather
  rendezvous, 7 of 8 devices arrived); one program at a time avoids it, at
  no cost worth counting for a one-off conversion."""
  return jax.block_until_ready(out)


def _delete(arrays) -> None:
  for x in arrays:
    if isinstance(x, jax.Array):
      x.delete()


# ---- chunk form -> tree form --------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _unpack_program(layout, c, mesh, axis_name, split, dtypes):
  chunk = layout.chunks[c]
  n = meshes.axes_size(mesh, axis_name)
  lead = (chunk.layers,) if chunk.layers else ()
  specs = [meshes.leaf_spec(layout.leaves[i].shape, n, axis_name) for i in chunk.leaves]

  def local(x):
    x = jnp.reshape(x, lead + (x.shape[-1],))
    full = jax.lax.all_gather(x, axis_name, axis=len(lead), tiled=True) if split else x
    me = jax.lax.axis_index(axis_name)
    out = []
    for i, leaf, spec, dtype in zip(chunk.leaves, layout.unpack_chunk(c, full),
                                    specs, dtypes):
      info = layout.leaves[i]
      leaf = leaf.astype(dtype)
      for d, name in enumerate(spec):
        if name is not None:
          size = info.shape[d] // n
          leaf = jax.lax.dynamic_slice_in_dim(leaf, me * size, size, axis=d)
      out.append(leaf)
    return out

  def unpack(x):
    spec_in = P(*([None] * (x.ndim - 1)), axis_name) if split else P()
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_in,),
                         out_specs=specs, check_vma=False)(x)

  return jax.jit(unpack)


def leaves_from_chunk(layout: ChunkLayout, c: int, x: jax.Array, axis_name: str,
                      dtypes: Sequence[Any] = None) -> list:
  """The leaves of chunk `c` held in `x` (the chunk or a chunk view, split on
  its last axis or replicated), each sharded by `meshes.leaf_spec`, in
  `dtypes` (default: each leaf's own)."""
  chunk = layout.chunks[c]
  if dtypes is None:
    dtypes = [layout.leaves[i].dtype for i in chunk.leaves]
  dtypes = tuple(np.dtype(d) for d in dtypes)
  if chunk.model_shards:
    program = _unpack_rows_program(layout, c, x.sharding, dtypes)
  else:
    program = _unpack_program(layout, c, x.sharding.mesh, axis_name,
                              _is_split(x.sharding, axis_name), dtypes)
  return _settled(program(_on_device(x)))


@functools.lru_cache(maxsize=256)
def _unpack_rows_program(layout, c, sharding, dtypes):
  """A chunk of model rows (tensor parallelism) cut into its leaves by one
  GSPMD program, each leaf split over the model axis on its model dim."""
  model = sharding.spec[-2]
  specs = []
  for i in layout.chunks[c].leaves:
    info = layout.leaves[i]
    spec = [None] * info.ndim
    spec[info.model_dim] = model
    specs.append(NamedSharding(sharding.mesh, P(*spec)))
  return jax.jit(lambda x: [leaf.astype(dt) for leaf, dt in
                            zip(layout.unpack_chunk(c, x), dtypes)],
                 out_shardings=specs)


# ---- whole states ---------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _whole_program(layout, items: tuple, shardings: tuple):
  """One program packing several chunks whole: per item `(c, dtype,
  shape)`, chunk `c` in `dtype` reshaped to `shape`, from a `{leaf index:
  array}` mapping per item, into the item's sharding."""
  def pack(sources):
    return [jnp.reshape(layout.pack_chunk(c, source, dtype), shape)
            for (c, dtype, shape), source in zip(items, sources)]
  return jax.jit(pack, out_shardings=list(shardings))


def packed(layout, jobs: Sequence[tuple], axis_name: str,
            release: bool) -> list:
  """Per job `(c, members, sharding, dtype, shape)` (`members`: chunk `c`'s
  leaves by leaf index), chunk `c` packed from them, in `dtype`, reshaped
  to `shape`, in `sharding`; with `release` each member array is deleted
  once packed. Consecutive jobs whose chunks pack whole (`packs_whole`:
  every chunk of a one-device mesh, and replicated ones) share a program,
  up to the largest leaf's bytes a program (at least `WHOLE_GROUP_FLOOR`):
  a model of many small leaves on one device, a chunk each, compiles a few
  programs, not one or two per leaf.
  The others are packed one by one (`chunk_from_leaves`)."""
  limit = max(_largest_leaf(layout), WHOLE_GROUP_FLOOR)
  out, group, size = [None] * len(jobs), [], 0

  def flush():
    if not group:
      return
    items = tuple((jobs[k][0], np.dtype(jobs[k][3]), tuple(jobs[k][4]))
                  for k in group)
    places = tuple(jobs[k][2].with_memory_kind("device") for k in group)
    sources = [{i: _on_device(a) for i, a in jobs[k][1].items()} for k in group]
    packed = _settled(_whole_program(layout, items, places)(sources))
    for k, x in zip(group, packed):
      out[k] = _placed(x, jobs[k][2])
      _delete(list(jobs[k][1].values()) if release else [])
    group.clear()

  for k, (c, members, sharding, dtype, shape) in enumerate(jobs):
    if not packs_whole(layout, c, sharding, axis_name):
      flush()
      size = 0
      device = sharding.with_memory_kind("device")
      chunk = chunk_from_leaves(layout, c, members, device, axis_name, dtype,
                                release)
      if tuple(shape) != chunk.shape:
        chunk = _reshape_program(tuple(shape), device)(chunk)
      out[k] = _placed(chunk, sharding)
      continue
    nbytes = (layout.chunks[c].length * (layout.chunks[c].layers or 1)
              * np.dtype(dtype).itemsize)
    if group and size + nbytes > limit:
      flush()
      size = 0
    group.append(k)
    size += nbytes
  flush()
  return out


def to_chunks(layout: ChunkLayout, params: Any, shardings: Sequence[Any],
              axis_name: str, release: bool = False) -> tuple:
  """`(chunks, rest)` of a parameter tree, chunk `c` in `shardings[c]`;
  `release` as for `chunk_from_leaves`."""
  leaves = dict(enumerate(layout.treedef.flatten_up_to(params)))
  chunks = tuple(packed(layout, [
      (c, {i: leaves[i] for i in layout.chunks[c].leaves}, s,
       layout.chunks[c].dtype, layout.chunks[c].shape)
      for c, s in enumerate(shardings)], axis_name, release))
  return chunks, tuple(leaves[i] for i in layout.rest_indices)


def to_tree(layout: ChunkLayout, chunks: Sequence[Any], rest: Sequence[Any],
            axis_name: str) -> Any:
  """The parameter tree of `(chunks, rest)`, chunk leaves sharded."""
  out = [None] * len(layout.leaves)
  for c, x in enumerate(chunks):
    for i, leaf in zip(layout.chunks[c].leaves,
                       leaves_from_chunk(layout, c, x, axis_name)):
      out[i] = leaf
  for i, leaf in zip(layout.rest_indices, rest):
    out[i] = copy(leaf)
  return jax.tree_util.tree_unflatten(layout.treedef, out)


@functools.lru_cache(maxsize=256)
def _reshape_program(shape, sharding):
  return jax.jit(lambda x: jnp.reshape(x, shape), out_shardings=sharding)


@functools.lru_cache(maxsize=256)
def cast_program(dtype, sharding):
  """`x.astype(dtype)` into `sharding`, compiled once per pair."""
  return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)
