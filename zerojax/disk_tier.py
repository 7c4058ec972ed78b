"""The disk tier (ZeRO-Infinity, `offload_optimizer="disk"`): which
statistics live in files, and moving them between files and the state.

The offloaded chunks' optimizer statistics (`offload.offloaded_chunks`;
adam's m and v) are written once, at `shard` / `restore`, to raw files
under `ZeroConfig.offload_dir` (`disk.ChunkFiles`), one file per statistic
holding the whole array in C order, and the state keeps an `OnDisk` in
their place: a pytree node with no children, so `jax.jit`, the shardings,
the owners table and every tree walk pass over it, and the jitted step
never sees those arrays. Each step then streams them (`step._disk_update`):
read chunk c+1 while c is updated on the host, write c while c+1 is.

Their master shards stay in host memory (`pinned_host`, as in the host
tier): stage 3's gathers read them every step.

The files are scratch. A step rewrites them in place (the state's keys do
not change), so the state before a step is gone once it starts, as under
donation; a checkpoint (`checkpoint.save`) holds the copy to go back to,
and `checkpoint.restore` writes fresh files. Never imports `step`.
"""
from __future__ import annotations

import dataclasses
import os
import uuid
from typing import Any

import jax
import numpy as np

from zerojax import disk, offload, optstate

_FILES: dict = {}   # absolute directory -> its ChunkFiles (one thread pool)


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
  """The `ChunkFiles` of `config.offload_dir` (checked: clear errors for a
  missing, non-directory or unwritable one)."""
  path = disk.check_directory(config.offload_dir)
  if path not in _FILES:
    _FILES[path] = disk.ChunkFiles(path)
  return _FILES[path]


def disk_chunks(layout, config) -> frozenset:
  """The chunks whose statistics live on disk."""
  if not config.disk:
    return frozenset()
  return offload.offloaded_chunks(layout, config.offload_fraction)


def entries(opt_state) -> list:
  """`(position, OnDisk)` of the statistics on disk, positions counted over
  the state's leaves with each `OnDisk` as one (`full_leaves`' order)."""
  flat = jax.tree_util.tree_leaves(opt_state, is_leaf=is_on_disk)
  return [(j, x) for j, x in enumerate(flat) if is_on_disk(x)]


def full_leaves(opt_state) -> tuple:
  """(leaves, treedef) of the optimizer state with each `OnDisk` a leaf:
  the positions `optstate.owners` gives for the state as built, arrays and
  `OnDisk`s mixed."""
  return jax.tree_util.tree_flatten(opt_state, is_leaf=is_on_disk)


def abstract(opt_state) -> Any:
  """The optimizer state with each `OnDisk` as a `ShapeDtypeStruct`: what
  `optstate.owners` and `tx` read for the whole state."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, np.dtype(x.dtype))
      if is_on_disk(x) else x, opt_state, is_leaf=is_on_disk)


def spill(state) -> Any:
  """`state` with its disk chunks' statistics written to files and held as
  `OnDisk`s (a state whose config is not the disk tier: itself). One
  statistic at a time passes through host memory as a numpy array; its
  device arrays are deleted once written."""
  cfg = state.config
  if not cfg.disk:
    return state
  if jax.process_count() > 1:
    raise ValueError("offload_optimizer='disk' runs in one process for now "
                     f"(this job has {jax.process_count()}); use "
                     "offload_optimizer=True (host memory) across processes.")
  chunks = disk_chunks(state.layout, cfg)
  target = files(cfg)
  flat, treedef = full_leaves(state.opt_state)
  owners = optstate.owners(state.layout, abstract(state.opt_state)).chunk
  prefix = uuid.uuid4().hex[:12]
  out = []
  try:
    for j, (x, c) in enumerate(zip(flat, owners)):
      if c not in chunks or is_on_disk(x):
        out.append(x)
        continue
      key = f"{prefix}-c{c}-s{j}"
      out.append(OnDisk(key, tuple(x.shape), np.dtype(x.dtype).name))
      target.write(key, np.asarray(x)).result()
  except BaseException:
    for x in out:   # no partial tier left behind (a full disk, say)
      if is_on_disk(x) and os.path.exists(target.path(x.key)):
        os.unlink(target.path(x.key))
    raise
  for x, kept in zip(flat, out):
    if is_on_disk(kept) and not is_on_disk(x):
      x.delete()
  return state.replace(opt_state=jax.tree_util.tree_unflatten(treedef, out))


def mapped(state) -> Any:
  """The optimizer state with each `OnDisk` as a read-only `np.memmap` of
  its file (what a checkpoint save writes: pages read as needed, never the
  whole state in memory at once)."""
  if not state.config.disk:
    return state.opt_state
  target = files(state.config)
  return jax.tree_util.tree_map(
      lambda x: np.memmap(target.path(x.key), np.dtype(x.dtype), "r",
                          shape=x.shape) if is_on_disk(x) else x,
      state.opt_state, is_leaf=is_on_disk)


def disk_bytes(state) -> int:
  """Bytes of optimizer state in the disk tier's files."""
  return sum(x.nbytes for _, x in entries(state.opt_state))


def remove(state) -> None:
  """Deletes the state's files (they are scratch): for a caller done with a
  disk-tier state that it will not step again."""
  if state.config.disk:
    target = files(state.config)
    for _, x in entries(state.opt_state):
      try:
        os.unlink(target.path(x.key))
      except FileNotFoundError:
        pass
