"""What a zerojax checkpoint holds on disk: the chunk-form tree, the layout
and config as JSON, and the cutting of saved chunks back into leaves."""
from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._tiers import disk_tier
from zerojax._core import frozen
from zerojax._core import optstate
from zerojax._options.config import DynamicLossScale, ZeroConfig
from zerojax._core.layout import Chunk, ChunkLayout, LeafInfo, path_names
from zerojax._state.state import ZeroTrainState

FORMAT = "zerojax-3"   # chunk form (the package docstring)
CHUNK_FORMATS = (FORMAT,)
READ_FORMATS = CHUNK_FORMATS + ("zerojax-1",)   # "zerojax-1": the tree form
# formats no longer read, and how to carry such a checkpoint over
RETIRED_FORMATS = {"zerojax-2": "the chunk form with statistics in view shape, "
                   "written for two days before 2026-11-23: restore it with "
                   "zerojax 0.1 at commit 10ce0d6 and save it again"}


def params_shapes(layout) -> Any:
  """The parameter tree of `layout` as ShapeDtypeStructs."""
  return jax.tree_util.tree_unflatten(
      layout.treedef, [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in layout.leaves])


def chunk_form(state: ZeroTrainState) -> dict:
  """What a save writes: the state's own arrays, as they are sharded."""
  # a disk tier's statistics: read-only maps of their files
  out = {"step": state.step, "master": list(disk_tier.mapped(state,
                                                             state.master)),
         "rest": list(state.rest),
         "opt_state": non_empty(disk_tier.mapped(state, state.opt_state))}
  if state.loss_scale is not None:
    out["loss_scale"] = {"scale": state.loss_scale.scale,
                         "good_steps": state.loss_scale.good_steps}
  if state.extras:
    out["extras"] = state.extras
  return out


def non_empty(tree):
  """`tree` with its empty arrays as None (orbax refuses zero-size arrays;
  the chunk views of leaves other than a chunk's representative are)."""
  return jax.tree_util.tree_map(lambda x: x if np.prod(x.shape) else None, tree)


def layout_json(layout: ChunkLayout) -> dict:
  """The chunk layout as JSON: where each leaf lies in which chunk."""
  return {
      "num_shards": int(layout.num_shards), "chunk_size": int(layout.chunk_size),
      "leaves": [{"path": i.path, "names": list(i.names), "shape": list(i.shape),
                  "dtype": jnp.dtype(i.dtype).name, "chunk": int(i.chunk),
                  "offset": int(i.offset), "stacked": bool(i.stacked),
                  "model_dim": i.model_dim, "model_shards": int(i.model_shards)}
                 for i in layout.leaves],
      "chunks": [{"length": int(c.length), "used": int(c.used),
                  "layers": int(c.layers), "dtype": jnp.dtype(c.dtype).name,
                  "leaves": [int(i) for i in c.leaves], "label": int(c.label),
                  "stack": c.stack, "model_shards": int(c.model_shards)}
                 for c in layout.chunks]}


def layout_from_json(d: dict, treedef) -> ChunkLayout:
  """Inverse of `layout_json`; `treedef`: the parameter tree's, or None
  where only the leaves' places in the chunks are read. Checkpoints from
  before tensor parallelism have no model fields: none of their leaves is
  split."""
  leaves = tuple(LeafInfo(i["path"], tuple(i["shape"]), jnp.dtype(i["dtype"]),
                          i["chunk"], i["offset"], i["stacked"], tuple(i["names"]),
                          i.get("model_dim"), i.get("model_shards", 1))
                 for i in d["leaves"])
  chunks = tuple(Chunk(c["length"], c["used"], c["layers"], jnp.dtype(c["dtype"]),
                       tuple(c["leaves"]), c["label"], c["stack"],
                       c.get("model_shards", 0))
                 for c in d["chunks"])
  return ChunkLayout(treedef, leaves, chunks, d["num_shards"], d["chunk_size"], 0.0)


def config_json(cfg: ZeroConfig) -> dict:
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if f.name == "frozen":
      continue  # maybe a callable: the metadata names the leaves instead
    if isinstance(v, np.dtype):
      v = v.name
    elif isinstance(v, DynamicLossScale):
      v = {"dynamic": dataclasses.asdict(v)}
    elif isinstance(v, tuple):
      v = list(v)
    out[f.name] = v
  return out


def config_from_json(d: dict) -> dict:
  d = dict(d)
  if isinstance(d.get("loss_scale"), dict):
    d["loss_scale"] = DynamicLossScale(**d["loss_scale"]["dynamic"])
  d["stacked"] = tuple(d.get("stacked", ()))
  return d


def frozen_names(layout: dict) -> list:
  """The leaves (names joined by "/") that `ZeroConfig.frozen` kept out of
  the chunks of a layout JSON: its floating-point leaves outside them.
  Integer and empty leaves stay outside whether frozen or not, and are never
  trained either way."""
  return ["/".join(i["names"]) for i in layout["leaves"]
          if i["chunk"] < 0 and jnp.issubdtype(jnp.dtype(i["dtype"]), jnp.floating)
          and np.prod(i["shape"], dtype=np.int64) > 0]


def frozen_mask(meta: dict, abstract) -> Any:
  """`ZeroConfig.frozen` of the saved state, as a tree of bools over the
  parameter tree `abstract`, or None where nothing was frozen. Metadata
  written before it named the frozen leaves has them in its layout; format
  "zerojax-1" has neither."""
  names = meta.get("frozen")
  if names is None and meta["format"] in CHUNK_FORMATS:
    names = frozen_names(meta["layout"])
  if not names:
    return None
  names = set(names)
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "/".join(path_names(path)) in names, abstract)


def shape_signature(tree) -> dict:
  """Leaf path (names only: orbax stores namedtuples as dicts) -> shape."""
  return {k: tuple(x.shape) for k, x in by_path(tree).items()}


def describe_mismatch(s: dict, w: dict, what: str) -> str:
  """`s`, `w`: signatures (`shape_signature`) of the checkpoint and of `like`."""
  lines = [f"  only in the checkpoint: {k}" for k in sorted(set(s) - set(w))][:5]
  lines += [f"  only in `like`: {k}" for k in sorted(set(w) - set(s))][:5]
  lines += [f"  {k}: checkpoint {s[k]}, `like` {w[k]}"
            for k in sorted(set(s) & set(w)) if s[k] != w[k]][:5]
  return f"the checkpoint's {what} does not match `like`:\n" + "\n".join(lines)


def by_path(tree) -> dict:
  """Leaf path (names only, as `shape_signature`) -> leaf."""
  return {"/".join(path_names(path)): x
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def saved_list(x) -> list:
  """A saved list as orbax may read it back: a list, or a dict keyed "0",
  "1", ..., "10" (whose sorted order is not the list's)."""
  if isinstance(x, dict):
    return [x[k] for k in sorted(x, key=int)]
  return list(x)


def saved_rest(x) -> list:
  """A saved `rest` as the state holds it: each entry an array, or an int8
  frozen matrix's pair `(values, absmax)` (`zerojax._core.frozen`), which orbax
  may read back as a list or a dict."""
  return [tuple(saved_list(e)) if isinstance(e, (list, tuple, dict)) else e
          for e in saved_list(x)]


def nest_by_names(by_names: dict) -> Any:
  """{names: leaf} as nested dicts; a dict keyed 0..n-1 becomes a list."""
  root: dict = {}
  for names, x in by_names.items():
    node = root
    for name in names[:-1]:
      node = node.setdefault(name, {})
    node[names[-1]] = x

  def lists(node):
    if not isinstance(node, dict):
      return node
    node = {k: lists(v) for k, v in node.items()}
    if node and sorted(node) == [str(i) for i in range(len(node))]:
      return [node[str(i)] for i in range(len(node))]
    return node
  return lists(root)


def as_dtype(x, dtype):
  return x if x.dtype == dtype else x.astype(dtype)


def cut_chunks(layout: ChunkLayout, loaded: dict, emit=lambda x: x) -> tuple:
  """The ordinary parameter tree and optax state of a chunk-form
  checkpoint read as numpy (`loaded`, saved with `layout`), each as
  {leaf names: emit(array)}. The chunks are taken out of `loaded` and each
  is dropped once its leaves are emitted, so that with an `emit` that
  copies, the two forms are never both whole in memory."""
  master = [np.asarray(x) for x in saved_list(loaded.pop("master", []))]
  rest = iter(saved_rest(loaded.pop("rest", [])))

  def leaf(x, i):
    return layout.host_leaf(
        i, np.reshape(x, layout.chunks[layout.leaves[i].chunk].shape))

  params = {}
  for i, info in enumerate(layout.leaves):
    if info.chunk < 0:   # in its own dtype (`zerojax._core.frozen.restored`)
      entry = jax.tree_util.tree_map(np.asarray, next(rest))
      params[info.names] = emit(frozen.leaf(entry, info, np))
  for c, chunk in enumerate(layout.chunks):
    for i in chunk.leaves:
      params[layout.leaves[i].names] = emit(leaf(master[c], i))
    master[c] = None
  # optax state over the views: chunk c's statistics at its representative
  opt, prefixes = {}, set()
  opt_state = loaded.pop("opt_state")
  table = optstate.owners(layout, opt_state)
  flat = [(path_names(path), x) for path, x
          in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
  del opt_state
  for j, (c, i) in enumerate(zip(table.chunk, table.leaf)):
    key, x = flat[j][0], np.asarray(flat[j][1])
    flat[j] = None
    if c is None:
      if i is None:
        opt[key] = x                           # counts, scalars
      continue
    prefix = path_names(table.prefix[j])
    prefixes.add((prefix, x.dtype))
    for m in layout.chunks[c].leaves:
      # a shaped chunk's statistic is the tree's own ([Note: shaped leaves])
      opt[prefix + layout.leaves[m].names] = emit(
          x if layout.chunks[c].shaped else leaf(x, m))
    del x
  # Leaves outside the chunks (frozen, integer) have empty views, which are
  # not written: the optimizer never saw them, their statistics are zeros.
  for prefix, dtype in prefixes:
    for i in layout.rest_indices:
      info = layout.leaves[i]
      opt[prefix + info.names] = emit(np.zeros(info.shape, dtype))
  return {k: params[k] for k in (i.names for i in layout.leaves)}, opt
