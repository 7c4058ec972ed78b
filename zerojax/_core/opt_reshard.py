"""The optax state between its tree form (a TrainState's, a checkpoint's
export) and its chunk form (over the chunk views `tx` sees, stored in
chunk shape: `optstate`): each statistic packed or cut with its chunk's
leaves by `reshard`'s programs."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from zerojax._core import meshes
from zerojax._core import optstate
from zerojax._core import reshard
from zerojax._core.layout import ChunkLayout


def opt_to_views(layout: ChunkLayout, opt_state: Any, view_state: Any,
                 shardings: Any, axis_name: str, release: bool = False) -> Any:
  """The optax state on the parameter tree, converted to the state over
  chunk views (`view_state`: its shapes, `shardings`: its shardings);
  `release` as for `reshard.chunk_from_leaves`."""
  table = optstate.check_tree_state(layout, opt_state, view_state)
  flat = jax.tree_util.tree_leaves(opt_state)
  views, treedef = jax.tree_util.tree_flatten(view_state)
  places = jax.tree_util.tree_leaves(shardings)
  out, jobs, at, zeros = [], [], [], {}
  for j, (c, i, view, sharding) in enumerate(
      zip(table.chunk, table.leaf, views, places)):
    if c is not None and layout.chunks[c].shaped:
      # the tree's own statistic ([Note: shaped leaves])
      out.append(reshard.copy(flat[j], sharding))
      continue
    if c is None:
      # counts and scalars as they are; a chunk's other leaves (their
      # statistics are in the chunk's) and empty views zero, made on the
      # host and placed in one call below
      in_chunk = i is not None and layout.leaves[i].chunk >= 0
      if not in_chunk and np.shape(flat[j]) == view.shape:
        out.append(reshard.copy(flat[j], sharding))
      else:
        zeros[len(out)] = (np.zeros(view.shape, view.dtype), sharding)
        out.append(None)
      continue
    members = {m: flat[k] for m, k in zip(layout.chunks[c].leaves, table.members[j])}
    at.append(len(out))
    out.append(None)
    jobs.append((c, members, sharding, view.dtype, view.shape))
  if zeros:
    arrays, places = zip(*zeros.values())
    for k, x in zip(zeros, jax.device_put(list(arrays), list(places))):
      out[k] = x
  for k, x in zip(at, reshard.packed(layout, jobs, axis_name, release)):
    out[k] = x
  return jax.tree_util.tree_unflatten(treedef, out)


def opt_to_tree(layout: ChunkLayout, view_state: Any, tree_state: Any,
                axis_name: str) -> Any:
  """Inverse of `opt_to_views`: the optax state on the parameter tree
  (`tree_state`: its shapes), leaves sharded by `leaf_spec`."""
  table = optstate.check_tree_state(layout, tree_state, view_state)
  views = jax.tree_util.tree_leaves(view_state)
  targets, treedef = jax.tree_util.tree_flatten(tree_state)
  out = [None] * len(targets)
  for j, (c, i) in enumerate(zip(table.chunk, table.leaf)):
    if c is not None and layout.chunks[c].shaped:
      # the tree's own statistic ([Note: shaped leaves])
      mesh = views[j].sharding.mesh
      out[j] = reshard.copy(views[j], NamedSharding(mesh, meshes.leaf_spec(
          targets[j].shape, meshes.axes_size(mesh, axis_name), axis_name)))
    elif c is not None:
      members = table.members[j]
      for k, leaf in zip(members, reshard.leaves_from_chunk(
          layout, c, views[j], axis_name, [targets[k].dtype for k in members])):
        out[k] = leaf
    elif i is not None and layout.leaves[i].chunk >= 0:
      continue   # placed with its chunk's statistic
    elif views[j].shape == targets[j].shape:
      out[j] = reshard.copy(views[j])   # counts, scalars
    else:   # frozen / non-floating: the optimizer never saw it
      mesh = views[j].sharding.mesh
      spec = meshes.leaf_spec(targets[j].shape,
                              meshes.axes_size(mesh, axis_name), axis_name)
      out[j] = jax.device_put(jnp.zeros(targets[j].shape, targets[j].dtype),
                              NamedSharding(mesh, spec))
  return jax.tree_util.tree_unflatten(treedef, out)
