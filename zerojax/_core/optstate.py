"""The optax state over chunk views: which of its leaves holds which chunk's
statistic (`owners`, the one answer the step, the shardings, `reshard` and
the checkpoint read), the chunk shape it is stored in (`stored`), the
update on compact views (`update_compact`), and the check of a
`TrainState`'s own optimizer state against `tx` (`check_tree_state`).
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._core.layout import ChunkLayout


@dataclasses.dataclass(frozen=True)
class Owners:
  """Which leaf of an optax state over chunk views holds which chunk's
  statistic: the one answer the step, the shardings, `reshard` and the
  checkpoint read (`owners` computes it).

  `tx.init(layout.views(...))` holds one subtree per statistic (adam's `mu`
  and `nu`), shaped like the parameter tree: chunk c's statistic sits at
  the path of its representative leaf, every other leaf of the subtree is
  empty; counts and scalars lie outside. The state on the parameter tree
  (`tx.init(params)`) flattens alike, each leaf's statistic at the same
  position, so the positions below serve both forms.

  Per leaf of the flattened state:
    chunk: the chunk whose statistic it holds, else None.
    leaf: the parameter leaf (index into `layout.leaves`) whose statistic
      sits at this position, else None (counts, scalars).
    prefix: where `leaf` is set, the path of its statistic's subtree
      (`jax.tree_util` keys, e.g. `(GetAttrKey('mu'),)`), else None.
    members: where `chunk` is set, the positions of the statistics of the
      chunk's leaves (`layout.chunks[chunk].leaves` order; None for one the
      flattening lacks), else ().
  """
  chunk: tuple
  leaf: tuple
  prefix: tuple
  members: tuple


def counts(flat: list, chunk: tuple) -> list:
  """Positions in the flattened optimizer state `flat` (`chunk`: its
  `Owners.chunk`) of the leaves that are no chunk's statistic and not
  empty: the step counts (and other scalars), which every chunk's update
  reads and writes."""
  return [j for j, (x, c) in enumerate(zip(flat, chunk))
          if c is None and np.size(x)]


def owners(layout: ChunkLayout, opt_state: Any) -> Owners:
  """The `Owners` of an optax state over chunk views: statistics in view
  shape or, as `stored` keeps them, in chunk shape; leaves may be missing
  (a checkpoint does not write empty ones). From paths and shapes only,
  computed once per (layout, state structure); inside jit or not."""
  flat = jax.tree_util.tree_flatten_with_path(opt_state)[0]
  return _owners(layout, tuple(path for path, _ in flat),
                 tuple(tuple(np.shape(x)) for _, x in flat))


@functools.lru_cache(maxsize=64)
def _owners(layout: ChunkLayout, paths: tuple, shapes: tuple) -> Owners:
  keys = [jax.tree_util.keystr(path) for path in paths]
  # A chunk's statistic has the chunk's shape (or its view's) at a path that
  # ends with the representative's; the longest such path wins, since
  # `.mu['x']['a']` also ends with the path `['a']` of another leaf.
  reps = sorted(((layout.leaves[layout.representative(c)], c)
                 for c in range(len(layout.chunks))), key=lambda t: -len(t[0].path))
  # A shaped chunk's statistics have the shapes optax gives them (a
  # factored moment's rows, say): any shape at its leaf's path ([Note:
  # shaped leaves]).
  chunk = tuple(next((c for rep, c in reps if key.endswith(rep.path) and (
      layout.chunks[c].shaped or
      shape in (layout.view_shape(c), layout.chunks[c].shape))),
                     None) for key, shape in zip(keys, shapes))
  # Each statistic's subtree, by its path (head): an owner's path less its
  # representative's; or a path under which the whole parameter tree lies
  # (the statistics of leaves outside the chunks, when no chunk owns one).
  index = {key: j for j, key in enumerate(keys)}
  heads = {}
  for j, c in enumerate(chunk):
    if c is not None:
      depth = len(layout.leaves[layout.representative(c)].names)
      prefix = paths[j][:len(paths[j]) - depth]
      heads[jax.tree_util.keystr(prefix)] = prefix
  if layout.leaves:
    first = layout.leaves[0]
    for path, key in zip(paths, keys):
      head = key[:len(key) - len(first.path)]
      if key.endswith(first.path) and all(
          head + info.path in index for info in layout.leaves):
        heads.setdefault(head, path[:len(path) - len(first.names)])
  at = {(head, i): index.get(head + info.path)
        for head in heads for i, info in enumerate(layout.leaves)}
  leaf, prefix = [None] * len(keys), [None] * len(keys)
  for (head, i), j in at.items():
    if j is not None:
      leaf[j], prefix[j] = i, heads[head]
  members = tuple(
      () if c is None else
      tuple(at[jax.tree_util.keystr(prefix[j]), m] for m in layout.chunks[c].leaves)
      for j, c in enumerate(chunk))
  return Owners(chunk=chunk, leaf=tuple(leaf), prefix=tuple(prefix),
                members=members)


def update_compact(tx, grads: Any, state: Any, params: Any,
                   skeleton: Any = None) -> tuple:
  """`tx.update(grads, state, params)` on compact views
  (`ChunkLayout.views(compact=True)`: None for each leaf the views leave
  empty), `state` kept in the form `tx.init` of the full views gives.

  On the full views `tx` computes on every empty leaf too, in each call: on
  a tree of n leaves, an update of one chunk at a time traces n leaves'
  arithmetic per chunk. Here it sees the statistics `tx.init` of the
  compact views has, taken from `state` by their paths (the same paths in
  both forms: a leaf's statistic sits at its leaf's path); the others,
  empty, are kept as they are. Returns `(updates, new state)`, the updates
  compact, the state in the full form. `skeleton`: `jax.eval_shape(tx.init,
  params)`, where the caller has it.

  Raises:
    ValueError: `tx` keeps statistics on compact views that the full
      views' state lacks (at that path and shape: a statistic per leaf
      count, say), or its update changes the state's structure
      (`optim` then keeps the full views for it).
  """
  if skeleton is None:
    skeleton = jax.eval_shape(tx.init, params)
  paths = [jax.tree_util.keystr(path) for path, _ in
           jax.tree_util.tree_flatten_with_path(skeleton)[0]]
  flat, treedef = jax.tree_util.tree_flatten_with_path(state)
  at = {jax.tree_util.keystr(path): j for j, (path, _) in enumerate(flat)}
  for p, want in zip(paths, jax.tree_util.tree_leaves(skeleton)):
    if p not in at or np.shape(flat[at[p]][1]) != want.shape:
      raise ValueError(f"optimizer state {p} of the compact views is not in "
                       "the full views' state")
  structure = jax.tree_util.tree_structure(skeleton)
  updates, new = tx.update(grads, jax.tree_util.tree_unflatten(
      structure, [flat[at[p]][1] for p in paths]), params)
  if jax.tree_util.tree_structure(new) != structure:
    raise ValueError("the update changes the optimizer state's structure")
  out = [x for _, x in flat]
  for p, x in zip(paths, jax.tree_util.tree_leaves(new)):
    out[at[p]] = x
  return updates, jax.tree_util.tree_unflatten(treedef, out)


def stored(layout: ChunkLayout, view_state: Any) -> Any:
  """The optax state over chunk views as `ZeroTrainState.opt_state` keeps
  it: each chunk's statistic in the chunk's own shape. A view has its
  leaf's rank, so unit axes (`[layers, 1, length]`), and TensorStore copies
  an array with a unit axis before writing it; the step reshapes to views
  inside its program, where
  a reshape costs nothing. Inside jit or eval_shape."""
  flat, treedef = jax.tree_util.tree_flatten(view_state)
  return jax.tree_util.tree_unflatten(treedef, [
      x if c is None else layout.stat_stored(c, x)
      for x, c in zip(flat, owners(layout, view_state).chunk)])


def check_tree_state(layout: ChunkLayout, tree_state: Any,
                     view_state: Any) -> Owners:
  """Checks that the optax state on the parameter tree (`tx.init(params)`)
  corresponds to the state over chunk views
  (`tx.init(layout.views(chunks))`): same structure, each statistic of a
  parameter leaf in that leaf's shape, every other leaf as on the views.
  Returns the views' `Owners`, whose positions serve both forms.

  Raises:
    ValueError: the structures differ (another tx), or a statistic has
      per-tensor shape (factored moments), which chunks cannot hold.
  """
  t_flat, t_def = jax.tree_util.tree_flatten_with_path(tree_state)
  v_flat, v_def = jax.tree_util.tree_flatten(view_state)
  if t_def != v_def:
    raise ValueError(
        "the TrainState's opt_state does not have the structure of "
        f"tx.init(params):\n  got      {t_def}\n  expected {v_def}\n"
        "Build the state with TrainState.create(..., tx=tx) and the same tx.")
  table = owners(layout, view_state)
  for (path, tree_leaf), view_leaf, i in zip(t_flat, v_flat, table.leaf):
    shape = tuple(np.shape(tree_leaf))
    # a shaped leaf's statistics are the tree's own ([Note: shaped leaves])
    shaped = i is not None and layout.leaves[i].chunk >= 0 and layout.chunks[
        layout.leaves[i].chunk].shaped
    want = (tuple(np.shape(view_leaf)) if i is None or shaped
            else layout.leaves[i].shape)
    if shape != want:
      raise ValueError(
          f"optimizer state {jax.tree_util.keystr(path)} has shape {shape} "
          f"on the parameters but {tuple(np.shape(view_leaf))} on chunks: the "
          "transformation keeps per-tensor statistics (e.g. factored second "
          "moments), which flat ZeRO chunks cannot hold; zerojax refuses it. "
          "Use an element-wise optimizer (adam, adamw, lion, sgd, ...).")
  return table
