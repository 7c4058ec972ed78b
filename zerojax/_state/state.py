"""ZeroTrainState: the sharded train state, its shardings, and reading it
(`loaded_master`, `check_live`). `shard()` builds one from a Flax
`TrainState` (`zerojax._state.shard`), from a layout planned and placed by
`zerojax._state.build`; `gather_params()` reads the ordinary parameter
tree back (`zerojax._state.gathered`).

What each stage stores (N devices on the data axis, see docs/design.md):

  stage 0: `master` chunks replicated, optimizer state replicated.
  stage 1/2, float32 compute: `master` replicated (it is the compute copy),
    optimizer state sharded; the step updates this device's slice.
  stage 1/2, 16-bit compute: `master` (fp32) sharded, `compute` (16-bit)
    replicated, optimizer state sharded.
  stage 3: `master` sharded, optimizer state sharded; no persistent 16-bit
    copy (the step casts each shard before gathering it), except under the
    disk tier with 16-bit compute: each disk chunk's fp32 master is on disk
    and `compute` holds its sharded 16-bit copy in host memory, which the
    step gathers (`StagePolicy.sharded_compute`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable, Optional

import jax
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax._tiers import disk_tier
from zerojax._model import frontend as frontend
from zerojax._core import frozen
from zerojax._core import meshes
from zerojax._core import offload
from zerojax._core import optim
from zerojax._core import optstate
from zerojax._core import precision
from zerojax._options.config import ZeroConfig, shard_axes
from zerojax._core.layout import ChunkLayout
from zerojax._options.policy import policy

TRAIN_STATE_FIELDS = ("step", "apply_fn", "params", "tx", "opt_state")


class ZeroTrainState(struct.PyTreeNode):
  """A `TrainState` whose parameters and optimizer state live in chunks.

  Attributes:
    step: number of updates applied.
    master: chunk arrays of the trainable parameters in their own dtype.
    compute: replicated compute-dtype chunks (stages 1-2 under 16-bit
      compute); at stage 3 under the disk tier with 16-bit compute, per
      chunk its sharded compute-dtype copy in host memory (disk chunks) or
      None; else `()`.
    rest: leaves kept outside the chunks: frozen weights in the compute
      dtype, split over the data axis at stage 3 (`zerojax._core.frozen`), and
      non-floating leaves, replicated.
    opt_state: the optax state over the chunk views (`ChunkLayout.views`),
      each chunk's statistics kept in the chunk's shape (`optstate.stored`;
      the step shows them to `tx` in view shape).
    loss_scale: `precision.LossScaleState` or None.
    extras: the pytree fields a `TrainState` subclass added, kept as they
      are; readable as attributes (`state.batch_stats`).
  """
  step: jax.Array
  master: tuple
  compute: tuple
  rest: tuple
  opt_state: Any
  loss_scale: Optional[precision.LossScaleState]
  extras: dict
  apply_fn: Callable = struct.field(pytree_node=False)
  tx: optax.GradientTransformation = struct.field(pytree_node=False)
  layout: ChunkLayout = struct.field(pytree_node=False)
  config: ZeroConfig = struct.field(pytree_node=False)
  mesh: Mesh = struct.field(pytree_node=False)
  static_extras: tuple = struct.field(pytree_node=False, default=())

  def __getattr__(self, name):
    # Only reached when normal lookup fails: expose subclass fields.
    if name.startswith("__"):
      raise AttributeError(name)
    extras = self.__dict__.get("extras") or {}
    if name in extras:
      return extras[name]
    static = dict(self.__dict__.get("static_extras") or ())
    if name in static:
      return static[name]
    if name == "params":
      raise AttributeError("ZeroTrainState keeps parameters in sharded chunks; "
                           "use zerojax.gather_params(state) for the tree.")
    raise AttributeError(f"ZeroTrainState has no attribute {name!r}")

  @property
  def num_shards(self) -> int:
    return self.mesh.shape[self.config.axis_name]

  @property
  def num_state_shards(self) -> int:
    """Pieces each chunk is split into: the data axis's devices, or under
    hpZ replica x data."""
    return meshes.axes_size(self.mesh, shard_axes(self.config))

  @property
  def num_replicas(self) -> int:
    """Replicas of the sharded state (hybrid sharding), else 1."""
    axis = self.config.replica_axis
    return 1 if axis is None else self.mesh.shape[axis]

  @property
  def num_batch_shards(self) -> int:
    """Devices the batch is split over (data x replica): the gradient is
    the mean of this many devices' gradients."""
    return self.num_shards * self.num_replicas

  @property
  def frontend(self):
    """The Flax front end the state came from (`zerojax._model.frontend`): it
    adapts the user's loss and evaluation functions."""
    return dict(self.static_extras).get(frontend.FRONTEND_FIELD, frontend.LINEN)


# ---- placement ---------------------------------------------------------------
def chunk_spec(ndim: int, axis_name) -> P:
  """Inside `shard_map`: a chunk (or chunk view) sharded on its last axis
  (over `axis_name`, a mesh axis or a tuple of them: `config.shard_axes`).
  Under tensor parallelism the model rows ride on the automatic model axis
  (`config.manual_axes`); placement says where they go (`Chunk.spec`)."""
  return P(*([None] * (ndim - 1)), axis_name)


def state_shardings(state: ZeroTrainState) -> ZeroTrainState:
  """The `NamedSharding` of every array of `state`, as a state-shaped tree."""
  cfg, mesh, layout = state.config, state.mesh, state.layout
  pol = policy(cfg)
  rep = NamedSharding(mesh, P())
  axes = shard_axes(cfg)
  # chunk c split over the data axes, or whole on each data device (its
  # model rows split over the model axis either way)
  split = lambda c: NamedSharding(mesh, layout.chunks[c].spec(axes, cfg.model_axis))
  whole = lambda c: NamedSharding(mesh, layout.chunks[c].spec(None, cfg.model_axis))
  lengths = {c.length for c in layout.chunks}
  n = meshes.axes_size(mesh, axes)

  multiplies = functools.cache(
      lambda: optim.multiplies_matrices(state.tx, layout))

  def opt_rule(x, c):
    shape = np.shape(x)
    if c is not None and layout.chunks[c].shaped:
      # its statistics in the shapes optax gives them ([Note: shaped leaves])
      leaf = layout.leaves[layout.chunks[c].leaves[0]]
      return NamedSharding(mesh, meshes.shaped_spec(
          shape, n, axes, multiplies(), int(leaf.stacked))
                           if pol.optimizer_sharded else P())
    if c is None or shape != layout.chunks[c].shape:
      return rep   # counts, scalars, the empty views of other leaves
    if (pol.optimizer_sharded and shape[-1] in lengths and shape[-1] % n == 0):
      return split(c)
    return whole(c)

  host_opt = offload.optimizer_chunks(layout, cfg)
  host_master = (frozenset(range(len(layout.chunks))) if cfg.offload_params
                 else host_opt if pol.master_sharded else frozenset())
  kind = lambda s, host: s.with_memory_kind(offload.HOST if host else offload.DEVICE)

  def master_rule(c, x):
    if disk_tier.is_on_disk(x):   # in its file (stays itself, no leaves)
      return x
    return kind(split(c) if pol.master_sharded else whole(c), c in host_master)

  opt, opt_def = jax.tree_util.tree_flatten(state.opt_state)
  opt_where = [kind(opt_rule(x, c), c in host_opt) for x, c in
               zip(opt, optstate.owners(layout, state.opt_state).chunk)]

  def compute_rule(c, x):
    if x is None:
      return None
    return kind(split(c), True) if pol.sharded_compute else whole(c)

  return state.replace(
      step=rep,
      master=tuple(master_rule(c, x) for c, x in enumerate(state.master)),
      compute=tuple(compute_rule(c, x) for c, x in enumerate(state.compute)),
      rest=frozen.shardings(layout, cfg, mesh),
      opt_state=jax.tree_util.tree_unflatten(opt_def, opt_where),
      loss_scale=jax.tree_util.tree_map(lambda x: rep, state.loss_scale),
      extras=jax.tree_util.tree_map(lambda x: rep, state.extras))


def extra_fields(state) -> tuple:
  """Fields a TrainState subclass adds: (pytree fields, static fields)."""
  extras, static_extras = {}, []
  if dataclasses.is_dataclass(state):
    for f in dataclasses.fields(state):
      if f.name in TRAIN_STATE_FIELDS:
        continue
      if f.metadata.get("pytree_node", True):
        extras[f.name] = getattr(state, f.name)
      else:
        static_extras.append((f.name, getattr(state, f.name)))
  return extras, tuple(static_extras)


def loaded_master(state) -> tuple:
  """The master chunks with those on disk read into their shardings (for
  `gather_params` and exports, which build the whole tree anyway)."""
  return loaded(state, "master")


def loaded(state, field: str) -> Any:
  """`state.<field>` (its master chunks or optimizer state) with each
  `OnDisk` read into its sharding (for exports, which build the whole tree
  anyway)."""
  tree = getattr(state, field)
  flat, treedef = jax.tree_util.tree_flatten(tree, is_leaf=disk_tier.is_on_disk)
  if not any(disk_tier.is_on_disk(x) for x in flat):
    return tree
  where = jax.tree_util.tree_leaves(getattr(state_shardings(state.replace(
      **{field: disk_tier.abstract(tree)})), field))
  mapped = jax.tree_util.tree_leaves(disk_tier.mapped(state, tree))
  return jax.tree_util.tree_unflatten(treedef, [
      jax.device_put(np.asarray(m), s) if disk_tier.is_on_disk(x) else x
      for x, m, s in zip(flat, mapped, where)])


def check_live(state: ZeroTrainState, caller: str) -> None:
  """Raises a ValueError if any array of `state` was donated or deleted.

  A `train_step` donates its input state: its buffers become the returned
  state's. Using the old state again would otherwise fail deep inside jax
  (or, for a jitted call, crash the process). O(leaves) host work, no
  device sync.
  """
  for x in jax.tree_util.tree_leaves(state):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise ValueError(
          f"{caller} got a ZeroTrainState whose arrays were donated to a "
          "previous step call (or deleted): use the state that call returned, "
          "`state, metrics = step(state, batch)`, or build the step with "
          "train_step(..., donate=False) to keep the input.")
