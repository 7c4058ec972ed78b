"""The disk tier (ZeRO-Infinity, `offload_optimizer="disk"`): which
statistics live in files, and moving them between files and the state.

The offloaded chunks' optimizer statistics (`offload.offloaded_chunks`;
adam's m and v) are written once, at `shard` / `restore`, to raw files
under `ZeroConfig.offload_dir` (`disk.ChunkFiles`), one file per array
holding it whole in C order, and the state keeps an `OnDisk` in their
place: a pytree node with no children, so `jax.jit`, the shardings, the
owners table and every tree walk pass over it, and the jitted step never
sees those arrays. Each step then streams them (`disk_stream.run`): read
chunk c+1 while c is updated on the host, write c while c+1 is, each
shard from and to its own buffer.

Their fp32 master shards go to disk too where the master is only the
update's: with 16-bit compute the forward reads a compute copy (stages
1-2: the replicated one; stage 3: a sharded one per disk chunk in host
memory, `StagePolicy.sharded_compute`, which the update rewrites). At
stage 3 with fp32 compute the master shard is the parameter every step
gathers: it stays in host memory (`pinned_host`, as in the host tier).

Each step also writes the disk chunks' gradients to files of their own
(`grad_file`, from inside its program: `disk_stream.sink`), which the
stream reads back.

The files are scratch. A step rewrites them in place (the state's keys do
not change), so the state before a step is gone once it starts, as under
donation; a checkpoint (`checkpoint.save`) holds the copy to go back to,
and `checkpoint.restore` writes fresh files. Never imports `step`.
"""
from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import uuid
from typing import Any, Optional

import jax
import numpy as np

from zerojax._tiers import disk
from zerojax._core import offload
from zerojax._core import optstate
from zerojax._options.policy import policy

_log = logging.getLogger("zerojax")
_FILES: dict = {}   # absolute directory -> its ChunkFiles (one thread pool)
_PREFIXES: dict = {}   # absolute directory -> this process's file prefixes


@dataclasses.dataclass(frozen=True)
class OnDisk:
  """A statistic held in the file `key` under the state's `offload_dir`:
  its global shape and dtype (a str)."""
  key: str
  shape: tuple
  dtype: str

  @property
  def size(self) -> int:
    return int(np.prod(self.shape, dtype=np.int64))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize


jax.tree_util.register_pytree_node(OnDisk, lambda x: ((), x),
                                   lambda aux, _: aux)


def is_on_disk(x) -> bool:
  return isinstance(x, OnDisk)


def files(config) -> disk.ChunkFiles:
  """The `ChunkFiles` of `config.offload_dir`, made (and the directory
  checked: clear errors for a missing, non-directory or unwritable one)
  the first time, not at every step."""
  path = os.path.abspath(config.offload_dir)
  if path not in _FILES:
    _FILES[path] = disk.ChunkFiles(path)
  return _FILES[path]


def disk_chunks(layout, config) -> frozenset:
  """The chunks whose statistics live on disk."""
  return offload.optimizer_chunks(layout, config) if config.disk else frozenset()


def full_leaves(opt_state) -> tuple:
  """(leaves, treedef) of the optimizer state with each `OnDisk` a leaf:
  the positions `optstate.owners` gives for the state as built, arrays and
  `OnDisk`s mixed."""
  return jax.tree_util.tree_flatten(opt_state, is_leaf=is_on_disk)


def abstract(tree) -> Any:
  """`tree` (the optimizer state, the master chunks) with each `OnDisk` as
  a `ShapeDtypeStruct`: what `optstate.owners` and `tx` read for the whole
  state."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(x.dtype))
      if is_on_disk(x) else x, tree, is_leaf=is_on_disk)


def _pieces(x: OnDisk, sharding, row: Optional[int] = None,
            cols: Optional[tuple] = None) -> dict:
  """{shard number on the last axis: (its devices in this process, the
  shard's shape, its rows' byte offsets in the file)}; with `row`, of row
  `row` of a `[layers, length]` array only (shape `[1, ...]`); with `cols`
  `(a, b)`, of the columns a:b of each shard only (a sub-group)."""
  out = {}
  for device, index in sharding.addressable_devices_indices_map(
      x.shape).items():
    start, stop, _ = index[-1].indices(x.shape[-1])
    k = start // (stop - start)
    if k not in out:
      if cols is not None:
        start, stop = start + cols[0], start + cols[1]
      rows = disk.shard_offsets(x.shape, np.dtype(x.dtype).itemsize, start,
                                stop)
      shape = x.shape[:-1] + (stop - start,)
      if row is not None:
        rows, shape = rows[row:row + 1], (1,) + shape[1:]
      out[k] = ([], shape, rows)
    out[k][0].append(device)
  return out


def read_shards(files: disk.ChunkFiles, wanted: list,
                row: Optional[int] = None, cols: Optional[tuple] = None):
  """Starts reading this process's shards of each `(OnDisk, sharding)` in
  `wanted` (with `row`: of that layer only; with `cols`: those columns of
  each shard only), each once (replicas share it): one future of their
  numpy arrays, in order (what `assemble` takes). No array is assembled
  whole."""
  pieces = [(x, p) for x, at in wanted
            for p in _pieces(x, at, row, cols).values()]
  return disk.read_many(files, [x.key for x, _ in pieces],
                        [shape for _, (_, shape, _) in pieces],
                        [np.dtype(x.dtype) for x, _ in pieces],
                        [rows for _, (_, _, rows) in pieces])


def assemble(wanted: list, arrays: list, row: Optional[int] = None,
             cols: Optional[tuple] = None) -> list:
  """The jax arrays (in their shardings, host memory kinds included) of the
  `(OnDisk, sharding)`s in `wanted` (with `row`: that layer, `[1, length]`;
  with `cols` `(a, b)`: the columns a:b of every shard, so b - a per
  device) from `read_shards`' numpy shards, emptying `arrays` as it goes so
  each numpy shard is freed once on its devices."""
  out, k = [], 0
  for x, sharding in wanted:
    parts = []
    for devices, _, _ in _pieces(x, sharding, row, cols).values():
      host, arrays[k] = arrays[k], None
      k += 1
      parts += [jax.device_put(host, jax.sharding.SingleDeviceSharding(
          d, memory_kind=sharding.memory_kind)) for d in devices]
      del host
    shape = x.shape if row is None else (1,) + x.shape[1:]
    if cols is not None:   # b - a from each of the shards on the last axis
      shards = x.shape[-1] // sharding.shard_shape(x.shape)[-1]
      shape = shape[:-1] + ((cols[1] - cols[0]) * shards,)
    out.append(jax.make_array_from_single_device_arrays(shape, sharding,
                                                        parts))
  return out


def write_shards(files: disk.ChunkFiles, written: list,
                 row: Optional[int] = None,
                 cols: Optional[tuple] = None) -> list:
  """Starts writing each `(OnDisk, jax array)` in `written` back to its
  file (with `row`: the array is that layer; with `cols`: those columns of
  each shard), shard by shard from the array's own buffers (each distinct
  shard once); returns the futures."""
  futures = []
  for x, array in written:
    pieces = _pieces(x, array.sharding, row, cols)
    for s in array.addressable_shards:
      if s.replica_id == 0:
        start, _, _ = s.index[-1].indices(array.shape[-1])
        futures.append(files.write(x.key, np.asarray(s.data),
                                   pieces[start // s.data.shape[-1]][2]))
  return futures


def master_on_disk(config) -> bool:
  """Whether the disk chunks' master shards are on disk too: under 16-bit
  compute, where only the update reads the fp32 master."""
  pol = policy(config)
  return config.disk and (pol.compute_copy or pol.sharded_compute)


def spill(state) -> Any:
  """`state` with its disk chunks' statistics (and master shards, where
  `master_on_disk`) written to files and held as `OnDisk`s (a state whose
  config is not the disk tier: itself). One array at a time passes
  through host memory as a numpy array; its device arrays are deleted
  once written. An abstract state (`ShapeDtypeStruct`s: `shard_shape`)
  gets its `OnDisk`s and nothing is written."""
  cfg = state.config
  if not cfg.disk:
    return state
  abstract_state = all(isinstance(x, jax.ShapeDtypeStruct)
                       for x in jax.tree_util.tree_leaves(state))
  if jax.process_count() > 1:
    raise ValueError("Offload('disk') runs in one process for now "
                     f"(this job has {jax.process_count()}); use "
                     "offload='host' (host memory) across processes.")
  chunks = disk_chunks(state.layout, cfg)
  target = None if abstract_state else files(cfg)
  flat, treedef = full_leaves(state.opt_state)
  owners = optstate.owners(state.layout, abstract(state.opt_state)).chunk
  prefix = _new_prefix(cfg.offload_dir if target is not None else None)
  to_disk = [(f"s{j}", c) for j, c in enumerate(owners)] + (
      [("master", c) for c in range(len(state.master))]
      if master_on_disk(cfg) else [])
  arrays = flat + list(state.master)
  if not any(c in chunks for _, c in to_disk[:len(arrays)]):
    return _as_host_tier(state)
  out = []
  try:
    for x, (name, c) in zip(arrays, to_disk):
      if c not in chunks or is_on_disk(x):
        out.append(x)
        continue
      key = f"{prefix}-c{c}-{name}"
      out.append(OnDisk(key, tuple(x.shape), np.dtype(x.dtype).name))
      if target is not None:
        target.write(key, np.asarray(x)).result()
  except BaseException:
    for x in out if target is not None else ():   # no partial tier left
      if is_on_disk(x) and os.path.exists(target.path(x.key)):
        os.unlink(target.path(x.key))
    raise
  out += arrays[len(out):]
  for x, kept in zip(arrays, out):
    if is_on_disk(kept) and isinstance(x, jax.Array):
      x.delete()
  return state.replace(
      opt_state=jax.tree_util.tree_unflatten(treedef, out[:len(flat)]),
      master=tuple(out[len(flat):]))


def _as_host_tier(state) -> Any:
  """A disk tier with nothing to put on disk (an optimizer without
  statistics, e.g. `optax.sgd`, at stage 3 under fp32 compute, where the
  master shards are what the forward gathers and stay in host memory):
  the host tier, updating on the host, which places every array as the
  disk tier would; said once."""
  _log.warning(
      "Offload(tier='disk') has nothing to keep on disk here: the "
      "offloaded chunks have no optimizer statistics (optax.sgd keeps none), "
      "and at stage 3 under fp32 compute the "
      "master shards stay in host memory for the gathers; running as "
      "Offload(tier='host', update_on='host'), which holds the same arrays "
      "in the same places.")
  return state.replace(config=state.config.replace(
      offload_optimizer=True, update_on="host", offload_dir=None,
      sub_group_size=None))


# ---- the files' lifetime -------------------------------------------------------
# A state's files are named `<prefix>-c<chunk>-<what>.bin`, the prefix
# `p<pid>x<random>`: scratch of this process, removed at its normal exit
# (`_remove_at_exit`); a prefix whose process is gone is an earlier run's
# leftover, removed by the next run that spills into the directory.

def _new_prefix(directory: Optional[str]) -> str:
  prefix = f"p{os.getpid()}x{uuid.uuid4().hex[:10]}"
  if directory is None:   # an abstract state: nothing is written
    return prefix
  if not _PREFIXES:
    atexit.register(_remove_at_exit)
  if directory not in _PREFIXES:
    _PREFIXES[directory] = set()
    _remove_leftovers(directory)
    _log.warning("the disk tier keeps optimizer state in %s (files "
                 "p%d*.bin), removed when this process exits normally.",
                 directory, os.getpid())
  _PREFIXES[directory].add(prefix)
  return prefix


def _owner(name: str) -> Optional[int]:
  """The pid in a disk-tier file's name, None for another file."""
  head = name.split("-", 1)[0]
  if not (name.endswith(".bin") and head.startswith("p") and "x" in head):
    return None
  pid = head[1:].split("x", 1)[0]
  return int(pid) if pid.isascii() and pid.isdigit() else None


def _alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:   # another user's live process
    return True
  return True


def _remove_leftovers(directory: str) -> None:
  """Removes the files of disk tiers whose process is gone (a crash, a
  kill), saying how much."""
  gone = [n for n in os.listdir(directory)
          if (pid := _owner(n)) is not None and pid != os.getpid()
          and not _alive(pid)]
  freed = 0
  for name in gone:
    path = os.path.join(directory, name)
    try:
      freed += os.path.getsize(path)
      os.unlink(path)
    except FileNotFoundError:
      pass
  if gone:
    _log.warning("removed %d disk-tier file(s) (%.1f MiB) that "
                 "ended processes left in %s.", len(gone), freed / 2 ** 20,
                 directory)


def _remove_at_exit() -> None:
  for directory, prefixes in _PREFIXES.items():
    try:
      names = os.listdir(directory)
    except OSError:
      continue
    for name in names:
      if name.split("-", 1)[0] in prefixes:
        try:
          os.unlink(os.path.join(directory, name))
        except OSError:
          pass


def mapped(state, tree) -> Any:
  """`tree` (of `state`: its optimizer state, its master chunks) with each
  `OnDisk` as a read-only `np.memmap` of its file (what a checkpoint save
  writes: pages read as needed, never the whole state in memory at
  once)."""
  if not state.config.disk:
    return tree
  target = files(state.config)
  return jax.tree_util.tree_map(
      lambda x: np.memmap(target.path(x.key), np.dtype(x.dtype), "r",
                          shape=x.shape) if is_on_disk(x) else x,
      tree, is_leaf=is_on_disk)


def _on_disk(state) -> list:
  """The state's `OnDisk`s: statistics and master shards."""
  return [x for x in jax.tree_util.tree_leaves(
      (state.opt_state, state.master), is_leaf=is_on_disk) if is_on_disk(x)]


def _grad_key(state, c: int) -> str:
  """The key of chunk `c`'s gradient file, under the prefix of the state's
  other files."""
  return f"{_on_disk(state)[0].key.split('-')[0]}-c{c}-grad"


def grad_file(state, c: int, shape: tuple, dtype) -> OnDisk:
  """The file chunk `c`'s gradient shards are written to during a step
  (`disk_stream.sink`): scratch, rewritten every step, never part of a
  checkpoint."""
  return OnDisk(_grad_key(state, c), tuple(shape), np.dtype(dtype).name)


def _grad_paths(state) -> list:
  """The paths of the gradient files of `state`'s disk chunks (written by
  its steps)."""
  if not _on_disk(state):
    return []
  target = files(state.config)
  return [target.path(_grad_key(state, c))
          for c in sorted(disk_chunks(state.layout, state.config))]


def check_files(state) -> None:
  """Before a step donates `state`: its directory still writable and every
  file of its statistics still there; else an error naming them, with the
  state intact (a failure during the step is `disk._failed`'s)."""
  target = files(state.config)
  if not os.access(target.directory, os.W_OK | os.X_OK):
    raise PermissionError(
        f"offload_dir {target.directory} is not writable any more; make it "
        "writable again (the state is intact: nothing was donated).")
  missing = [target.path(x.key) for x in _on_disk(state)
             if not os.path.exists(target.path(x.key))]
  if missing:
    raise FileNotFoundError(
        f"the disk tier's file {missing[0]} is gone ({len(missing)} of "
        f"{len(_on_disk(state))} missing): the optimizer state cannot be read. "
        "Restore from the last checkpoint (this state was not donated).")


def disk_bytes(state) -> int:
  """Bytes in the disk tier's files: statistics and master shards."""
  return sum(x.nbytes for x in _on_disk(state))


def remove(state) -> None:
  """Deletes the state's files (they are scratch): for a caller done with a
  disk-tier state that it will not step again."""
  if state.config.disk:
    target = files(state.config)
    for path in [target.path(x.key) for x in _on_disk(state)] + _grad_paths(
        state):
      try:
        os.unlink(path)
      except FileNotFoundError:
        pass
