"""How leaves are grouped into chunks before they are laid out: ColossalAI
Gemini's chunk-size search (the size that leaves the least capacity unused)
the units, unrolled blocks that get chunks of their own so that stage 3
can gather one block at a time (`zerojax.nn.layerwise`), and the layer
stacks a tree holds without being named (`scanned_stacks`). Pure functions of
shapes; imports nothing else from the package. `layout.ChunkLayout.build`
uses both.
"""
from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np


def _greedy_waste(groups: Sequence[Sequence[int]], sizes: np.ndarray) -> np.ndarray:
  """Gemini's waste (unused chunk capacity) of greedy packing, per candidate."""
  waste = np.zeros_like(sizes)
  for group in groups:
    used = np.zeros_like(sizes)
    for s in group:
      own = s > sizes              # too large: a chunk of its own, no waste
      spill = ~own & (used + s > sizes)
      waste += np.where(spill, sizes - used, 0)
      used = np.where(own, used, np.where(spill, s, used + s))
    waste += np.where(used > 0, sizes - used, 0)
  return waste


def search_chunk_size(groups: Sequence[Sequence[int]], *, min_chunk_size: int,
                      search_range: int, search_interval: int) -> tuple:
  """Chunk size with the least unused capacity (ColossalAI Gemini's search).

  Args:
    groups: per chunk group (leaves that may share chunks), the leaf sizes in
      packing order.
    min_chunk_size, search_range, search_interval: candidates are
      `min_chunk_size + k * search_interval` up to `min_chunk_size +
      search_range`.

  Returns:
    `(chunk_size, waste_fraction)`; ties go to the larger size (fewer chunks,
    fewer collectives).
  """
  candidates = np.arange(min_chunk_size, min_chunk_size + search_range + 1,
                         search_interval, dtype=np.int64)
  waste = _greedy_waste(groups, candidates)
  total = sum(sum(g) for g in groups)
  best = len(candidates) - 1 - int(np.argmin(waste[::-1]))
  frac = float(waste[best]) / max(total + float(waste[best]), 1.0)
  return int(candidates[best]), frac


def repeated_blocks(params: Any, stacked: Sequence[str] = ()) -> tuple:
  """The unrolled blocks of a parameter tree: sibling submodules with the same
  structure (relative paths, shapes, dtypes) as at least one sibling, that
  themselves contain submodules (a block, not one `Dense`), whatever their
  names (`blocks_0`, `Block_3`, a list's `h/0` as in Hugging Face's Flax
  models, `layers/0` in an `nnx.List`, or `enc_a`, `enc_b`). A block is
  given by its name where that name is used once in the tree, else by its
  path from the root, `"transformer/h/0"` (`unit_depth` reads both).
  Subtrees under `stacked` (names or paths) are skipped; where repeated blocks hold repeated
  blocks with nearly all (90%) of their parameters, the inner ones are the
  blocks. Whether a block is called as one (and so gathered per call) is
  the step's to find (`zerojax._model.linen.intercept`); a block that is not is held.
  """
  def signature(node):
    if isinstance(node, dict):
      return tuple((k, signature(v)) for k, v in sorted(node.items()))
    return (tuple(np.shape(node)), str(getattr(node, "dtype", "")))

  def is_block(node):
    return isinstance(node, dict) and any(isinstance(v, dict)
                                          for v in node.values())

  def size(node):
    if isinstance(node, dict):
      return sum(size(v) for v in node.values())
    return int(np.prod(np.shape(node)))

  names = []

  def visit(node, path) -> list:
    """`(path, subtree)` of the blocks under `node` (at `path`). A repeated
    block holding repeated blocks that hold nearly all of it (two towers
    alike, each a list of blocks) gives those; one holding only part of it
    in repeated submodules (a decoder block's self- and cross-attention) is
    the block."""
    groups, trees = {}, {}
    for k, v in node.items():
      names.append(str(k))
      if is_block(v) and not _inside(path + (str(k),), stacked):
        groups.setdefault(signature(v), []).append(str(k))
        trees[str(k)] = v
    repeated = {k for group in groups.values() if len(group) > 1 for k in group}
    # a block alike but for a few leaves of its own (T5's first block and
    # its relative attention bias) is one of them: its own leaves are
    # gathered with it
    common = [_leaf_set(trees[group[0]]) for group in groups.values()
              if len(group) > 1]
    for group in groups.values():
      if len(group) == 1 and any(
          _with_a_few_more(_leaf_set(trees[group[0]]), c) for c in common):
        repeated.add(group[0])
    found = []
    for k, v in node.items():
      if isinstance(v, dict) and not _inside(path + (str(k),), stacked):
        inner = visit(v, path + (str(k),))
        held = sum(size(block) for _, block in inner)
        found.extend([(path + (str(k),), v)] if str(k) in repeated and
                     held < 0.9 * size(v) else inner)
    return found

  params = _as_dict(params)
  found = visit(params, ()) if isinstance(params, dict) else []
  counts = collections.Counter(names)
  return tuple(p[-1] if counts[p[-1]] == 1 and not p[-1].isdigit()
               else "/".join(p) for p, _ in found)


def _leaf_set(node, path=()) -> dict:
  """`{relative path: (shape, dtype)}` of a subtree's leaves."""
  if isinstance(node, dict):
    return {p: v for k, sub in node.items()
            for p, v in _leaf_set(sub, path + (str(k),)).items()}
  return {path: (tuple(np.shape(node)), str(getattr(node, "dtype", "")))}


# a block may hold leaves its siblings do not of at most this share of its
# parameters and still be one of them (`repeated_blocks`)
OWN_LEAVES_SHARE = 0.1


def _with_a_few_more(leaves: dict, common: dict) -> bool:
  """Whether `leaves` are `common`'s and a few more (`OWN_LEAVES_SHARE`)."""
  if any(leaves.get(p) != v for p, v in common.items()):
    return False
  size = lambda ls: sum(int(np.prod(shape)) for shape, _ in ls)
  extra = [v for p, v in leaves.items() if p not in common]
  return bool(extra) and size(extra) <= OWN_LEAVES_SHARE * size(
      leaves.values())


def scanned_stacks(params: Any, num_shards: int,
                   skip: Sequence[str] = ()) -> tuple:
  """The submodules of a parameter tree that look like a layer stack
  (`nn.scan` over a block with `variable_axes={"params": 0}`, or an
  `nnx.vmap`-made stack): at least two leaves, all of rank two or more and
  one of rank three or more, sharing one leading length of at least 2, one
  layer of which holds at least `32 * num_shards` elements (padding each
  layer's row to the data axis then costs at most 3%). The outermost such
  submodule is taken; the root, and subtrees under `skip` (stacked modules
  given, repeated blocks: names or paths as `unit_depth` reads them), are
  not. Given as paths from the root, `"encoder/layers"`.

  The tree alone cannot tell a stack from a module whose weights happen to
  share a leading length (two `[3, 3, c, c]` convolutions), and need not:
  laid out as a stack, such a module is gathered whole for the step, as it
  would be anyway, since the step gathers a stack per layer only where its
  hearing trace heard one layer of it called inside a scan
  (`zerojax._model.linen.intercept`)."""
  def leaves(node):
    if isinstance(node, dict):
      return [x for v in node.values() for x in leaves(v)]
    return [node]

  def is_stack(node) -> bool:
    shapes = [tuple(np.shape(x)) for x in leaves(node)]
    if len(shapes) < 2 or any(len(s) < 2 for s in shapes):
      return False
    length = shapes[0][0]
    return (length >= 2 and all(s[0] == length for s in shapes)
            and any(len(s) >= 3 for s in shapes)
            and sum(int(np.prod(s)) for s in shapes) // length
            >= 32 * num_shards)

  found = []

  def visit(node, path):
    for k, v in node.items():
      here = path + (str(k),)
      if not isinstance(v, dict) or _inside(here, skip):
        continue
      if is_stack(v):
        found.append("/".join(here))
      else:
        visit(v, here)

  params = _as_dict(params)
  if isinstance(params, dict):
    visit(params, ())
  return tuple(found)


def beside(params: Any, units: Sequence[str]) -> tuple:
  """The modules beside `units` (stacks, repeated blocks, `per_use`
  modules; names or paths as `unit_depth` reads them): on the way from the
  root to each unit, every other submodule that holds no unit and is in
  none (a transformer's embedding and final norm, a bridge between two
  towers). Named as `repeated_blocks` names blocks, a module at the root
  whose name is used again deeper in the tree as `"/name"`."""
  params = _as_dict(params)
  if not isinstance(params, dict) or not units:
    return ()
  names, modules = [], []

  def visit(node, path):
    for k, v in node.items():
      names.append(str(k))
      if isinstance(v, dict):
        modules.append(path + (str(k),))
        visit(v, path + (str(k),))

  visit(params, ())
  held_units = [p for p in modules if any(_is(p, u) for u in units)]
  # the modules on the way to a unit (the root included)
  above = {p[:i] for p in held_units for i in range(len(p))}
  counts = collections.Counter(names)
  out = []
  for p in modules:
    if p[:-1] in above and p not in above and not _inside(p, units):
      out.append(p[-1] if counts[p[-1]] == 1 and not p[-1].isdigit()
                 else "/".join(p) if len(p) > 1 else f"/{p[0]}")
  return tuple(out)


def unit_depth(names: Sequence[str], unit: str) -> int:
  """How many leading components of the path `names` lead to `unit` (a
  stacked module's or block's name, anywhere on the path, or a block's path
  from the root, `"h/0"`, `"/ln_f"` for one at the root), 0 where the path
  is not inside it."""
  parts = tuple(unit.removeprefix("/").split("/"))
  if len(parts) == 1 and not unit.startswith("/"):
    return names.index(unit) + 1 if unit in names[:-1] else 0
  return (len(parts) if len(names) > len(parts)
          and tuple(names[:len(parts)]) == parts else 0)


def _is(path: tuple, unit: str) -> bool:
  """Whether `unit` (a name, or a path as `unit_depth` reads it) names the
  submodule at `path`."""
  return (path[-1] == unit if "/" not in unit
          else "/".join(path) == unit.removeprefix("/"))


def _inside(path: tuple, units: Sequence[str]) -> bool:
  """Whether the submodule at `path` is one of `units` or inside one."""
  return any(unit_depth(path + ("",), u) for u in units)


def named_units(params: Any, names: Sequence[str], stacked: Sequence[str] = (),
                found: Sequence[str] = ()) -> tuple:
  """`names` (`ZeroConfig.per_use`) as units beside the repeated blocks
  `found`: each must name exactly one submodule of the parameter tree, with
  no `stacked` module or found block above or below it. Raises ValueError
  naming the name and the fix."""
  modules = []   # the path of every submodule

  def visit(node, path):
    for k, v in node.items():
      if isinstance(v, dict):
        modules.append(path + (str(k),))
        visit(v, path + (str(k),))

  params = _as_dict(params)
  if isinstance(params, dict):
    visit(params, ())
  fenced = {*stacked, *found}
  out = []
  for name in names:
    if name in found or name in out:
      continue         # a repeated block already, or named twice
    at = [p for p in modules if p[-1] == name]
    if not at:
      raise ValueError(
          f"Blocks(per_use={tuple(names)!r}): no submodule is named {name!r}; the "
          f"submodules are {sorted({p[-1] for p in modules})[:40]}.")
    if len(at) > 1:
      raise ValueError(
          f"Blocks(per_use={tuple(names)!r}): {name!r} names {len(at)} submodules "
          f"({', '.join('/'.join(p) for p in at[:4])}); name a module used "
          "once in the tree (e.g. its parent).")
    if name in stacked:
      raise ValueError(
          f"Blocks(per_use={tuple(names)!r}): {name!r} is a stacked module, gathered "
          "per layer already (with its block wrapped in "
          "zerojax.nn.layerwise); leave it out of per_use.")
    path = at[0]
    inside = [f for p in modules if p[:len(path)] == path for f in fenced
              if _is(p, f)]
    above = [f for f in fenced if unit_depth(path, f)]
    if above or inside:
      raise ValueError(
          f"Blocks(per_use={tuple(names)!r}): {name!r} is "
          f"{'inside' if above else 'around'} "
          f"{(above or inside)[0]!r}, a stacked module or repeated block, "
          "which is gathered on its own already; name a module beside it.")
    out.append(name)
  return tuple(out)


def _as_dict(node):
  """Nested dicts of a (possibly frozen) parameter mapping."""
  if hasattr(node, "items"):
    return {k: _as_dict(v) for k, v in node.items()}
  return node
