"""Orbax checkpoints of a ZeroTrainState that restore on any device count
and stage, and that plain orbax reads without zerojax.

A save writes the state as it is, chunk shards and all: every device writes
its own shards, nothing is gathered or converted, so saving costs what a
plain orbax save of the same bytes costs (the optimizer statistics are kept
in chunk shape, `optim.stored`, since TensorStore copies arrays with a unit
axis). The chunk layout goes beside it as
JSON, which is all a reader needs to cut the chunks back into leaves.
A restore onto the same layout (same device count and chunking; any stage)
reads the chunks straight into their new shardings. Onto another layout it
reads the chunks on the host, cuts them into the ordinary tree and repacks
that chunk by chunk (`reshard`), as `shard()` does.

On disk, `DIR/<step>/` (orbax CheckpointManager, atomic commit):
  state/  {"step", "master", "rest", "opt_state", "loss_scale"?, "extras"?}:
          the ZeroTrainState's arrays (`opt_state` is optax's state over the
          chunk views, `ChunkLayout.views`, each chunk's statistics in the
          chunk's shape: `optim.stored`);
  meta/   JSON: format, the ZeroConfig fields, the device count at save, and
          the chunk layout (`_layout_json`).
Formats "zerojax-2" (statistics in view shape, written before 2026-11-23:
restored by repacking) and "zerojax-1" (the ordinary tree form, written
before 2026-11-22), and plain orbax checkpoints of a flax TrainState are
still read.
Never imports `step`.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import optim, precision, reshard
from zerojax.config import DynamicLossScale, ZeroConfig
from zerojax.layout import Chunk, ChunkLayout, LeafInfo, _path_names
from zerojax.reshard import leaf_spec
from zerojax.state import (ZeroTrainState, _config_and_mesh, _plan, check_tx,
                            place)

FORMAT = "zerojax-3"   # chunk form (this module's docstring)
VIEW_FORMAT = "zerojax-2"   # chunk form, statistics in view shape
CHUNK_FORMATS = (FORMAT, VIEW_FORMAT)
_MANAGERS: dict = {}


def _manager(directory: str, keep: Optional[int] = None) -> ocp.CheckpointManager:
  directory = os.path.abspath(directory)
  if directory not in _MANAGERS:
    # The process that saves owns the directory: orbax's leftovers of a save
    # that a crash cut short (`<step>.orbax-checkpoint-tmp`) are removed.
    _MANAGERS[directory] = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True,
            cleanup_tmp_directories=True))
  return _MANAGERS[directory]


def _leaf_shardings(tree, mesh, axis_name):
  n = mesh.shape[axis_name]
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), n, axis_name)), tree)


def _abstract_params(layout) -> Any:
  """The parameter tree of `layout` as ShapeDtypeStructs."""
  return jax.tree_util.tree_unflatten(
      layout.treedef, [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in layout.leaves])


def _tree_form(state: ZeroTrainState) -> dict:
  """The ordinary TrainState content of `state`, leaves sharded, converted
  chunk by chunk (`reshard`): no device holds more than its share plus one
  chunk."""
  layout, axis = state.layout, state.config.axis_name
  abstract = _abstract_params(layout)
  params = reshard.to_tree(layout, state.master, state.rest, axis)
  opt_state = reshard.opt_to_tree(layout, state.opt_state,
                                  jax.eval_shape(state.tx.init, abstract), axis)
  out = {"step": state.step, "params": params, "opt_state": opt_state}
  if state.loss_scale is not None:
    out["loss_scale"] = {"scale": state.loss_scale.scale,
                         "good_steps": state.loss_scale.good_steps}
  if state.extras:
    out["extras"] = state.extras
  # nothing shared with `state`, which the next train step donates
  return {k: v if k in ("params", "opt_state") else
          jax.tree_util.tree_map(reshard.copy, v) for k, v in out.items()}


def _chunk_form(state: ZeroTrainState) -> dict:
  """What a save writes: the state's own arrays, as they are sharded."""
  out = {"step": state.step, "master": list(state.master),
         "rest": list(state.rest), "opt_state": _non_empty(state.opt_state)}
  if state.loss_scale is not None:
    out["loss_scale"] = {"scale": state.loss_scale.scale,
                         "good_steps": state.loss_scale.good_steps}
  if state.extras:
    out["extras"] = state.extras
  return out


def _non_empty(tree):
  """`tree` with its empty arrays as None (orbax refuses zero-size arrays;
  the chunk views of leaves other than a chunk's representative are)."""
  return jax.tree_util.tree_map(lambda x: x if np.prod(x.shape) else None, tree)


def _layout_json(layout: ChunkLayout) -> dict:
  """The chunk layout as JSON: where each leaf lies in which chunk."""
  return {
      "num_shards": int(layout.num_shards), "chunk_size": int(layout.chunk_size),
      "leaves": [{"path": i.path, "names": list(i.names), "shape": list(i.shape),
                  "dtype": jnp.dtype(i.dtype).name, "chunk": int(i.chunk),
                  "offset": int(i.offset), "stacked": bool(i.stacked)}
                 for i in layout.leaves],
      "chunks": [{"length": int(c.length), "used": int(c.used),
                  "layers": int(c.layers), "dtype": jnp.dtype(c.dtype).name,
                  "leaves": [int(i) for i in c.leaves], "label": int(c.label),
                  "stack": c.stack} for c in layout.chunks]}


def _layout_from_json(d: dict, treedef) -> ChunkLayout:
  """Inverse of `_layout_json`; `treedef`: the parameter tree's, or None
  where only the leaves' places in the chunks are read."""
  leaves = tuple(LeafInfo(i["path"], tuple(i["shape"]), jnp.dtype(i["dtype"]),
                          i["chunk"], i["offset"], i["stacked"], tuple(i["names"]))
                 for i in d["leaves"])
  chunks = tuple(Chunk(c["length"], c["used"], c["layers"], jnp.dtype(c["dtype"]),
                       tuple(c["leaves"]), c["label"], c["stack"])
                 for c in d["chunks"])
  return ChunkLayout(treedef, leaves, chunks, d["num_shards"], d["chunk_size"], 0.0)


def _config_json(cfg: ZeroConfig) -> dict:
  out = {}
  for f in dataclasses.fields(cfg):
    v = getattr(cfg, f.name)
    if f.name == "frozen":
      continue  # a callable; restore takes it from `like`
    if isinstance(v, np.dtype):
      v = v.name
    elif isinstance(v, DynamicLossScale):
      v = {"dynamic": dataclasses.asdict(v)}
    elif isinstance(v, tuple):
      v = list(v)
    out[f.name] = v
  return out


def _config_from_json(d: dict) -> dict:
  d = dict(d)
  if isinstance(d.get("loss_scale"), dict):
    d["loss_scale"] = DynamicLossScale(**d["loss_scale"]["dynamic"])
  d["stacked"] = tuple(d.get("stacked", ()))
  return d


def save(directory: str, state: ZeroTrainState, *, step: Optional[int] = None,
         keep: Optional[int] = None, wait: bool = False) -> int:
  """Writes `state` asynchronously; training may go on at once.

  Args:
    directory: the checkpoint directory (created if missing).
    state: a ZeroTrainState.
    step: the checkpoint's number; default `state.step`.
    keep: keep only the newest `keep` checkpoints (set on first use of
      `directory` in this process).
    wait: block until the write is committed.

  Returns:
    The step written. Call `wait(directory)` before reading it back.
  """
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"save() takes a ZeroTrainState, got {type(state).__name__}.")
  step = int(state.step) if step is None else int(step)
  mgr = _manager(directory, keep)
  if step in mgr.all_steps():
    raise ValueError(f"step {step} already exists in {directory}; pass "
                     "another step= (nothing was overwritten).")
  latest = mgr.latest_step()
  if latest is not None and step < latest:
    # orbax would skip it without a word.
    raise ValueError(f"step {step} is older than the newest checkpoint "
                     f"({latest}) in {directory}; pass a step= above {latest} "
                     "or another directory (nothing was written).")
  meta = {"format": FORMAT, "config": _config_json(state.config),
          "num_shards": state.num_shards, "layout": _layout_json(state.layout)}
  mgr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(_chunk_form(state)),
      meta=ocp.args.JsonSave(meta)))
  if wait:
    mgr.wait_until_finished()
  return step


def wait(directory: str) -> None:
  """Blocks until every asynchronous save to `directory` is committed."""
  mgr = _MANAGERS.get(os.path.abspath(directory))
  if mgr is not None:
    mgr.wait_until_finished()


def _open(directory: str, step: Optional[int]):
  """(path of the state item, meta dict or None, step) of a checkpoint."""
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory!r}.")
  wait(directory)
  steps = sorted(int(s) for s in os.listdir(directory) if s.isdigit() and
                 os.path.exists(os.path.join(directory, s, "state")))
  if not steps:
    # A plain orbax checkpoint of a TrainState (StandardCheckpointer.save).
    if step is not None or not os.path.exists(
        os.path.join(directory, "_CHECKPOINT_METADATA")):
      raise ValueError(f"{directory!r} holds no zerojax checkpoint and no "
                       "orbax checkpoint.")
    return directory, None, None
  if step is None:
    step = steps[-1]
  if step not in steps:
    raise ValueError(f"step {step} is not in {directory!r}; saved steps: "
                     f"{steps}.")
  meta_path = os.path.join(directory, str(step), "meta")
  meta = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(meta_path) if (
      os.path.exists(meta_path)) else None
  return os.path.join(directory, str(step), "state"), meta, step


def _saved_tree(path):
  return ocp.StandardCheckpointer().metadata(path).item_metadata.tree


def _signature(tree) -> dict:
  """Leaf path (names only: orbax stores namedtuples as dicts) -> shape."""
  return {k: tuple(x.shape) for k, x in _named(tree).items()}


def _describe_mismatch(s: dict, w: dict, what: str) -> str:
  """`s`, `w`: signatures (`_signature`) of the checkpoint and of `like`."""
  lines = [f"  only in the checkpoint: {k}" for k in sorted(set(s) - set(w))][:5]
  lines += [f"  only in `like`: {k}" for k in sorted(set(w) - set(s))][:5]
  lines += [f"  {k}: checkpoint {s[k]}, `like` {w[k]}"
            for k in sorted(set(s) & set(w)) if s[k] != w[k]][:5]
  return f"the checkpoint's {what} does not match `like`:\n" + "\n".join(lines)


def _check_opt_state(saved: dict, want: dict) -> None:
  if saved != want:
    raise ValueError("the checkpoint's optimizer state does not match "
                     "like.tx (a different optax transformation?):\n" +
                     _describe_mismatch(saved, want, "").split("\n", 1)[1])


def restore(directory: str, *, like: Any, step: Optional[int] = None,
            mesh: Optional[Mesh] = None, stage: Optional[int] = None,
            **config_fields) -> ZeroTrainState:
  """Reads a checkpoint into a ZeroTrainState on `mesh` at `stage`, which may
  differ from those at save time (any device count, any stage).

  Args:
    directory: a directory written by `save`, or a plain orbax checkpoint of
      a flax TrainState (`StandardCheckpointer().save(path, train_state)`).
    like: a ZeroTrainState or TrainState supplying `tx`, `apply_fn` and the
      parameter structure (functions are not stored).
    step: which checkpoint; default the newest.
    mesh: target mesh; default all devices on the data axis.
    stage: target stage; default the saved one (or `like`'s).
    **config_fields: further ZeroConfig overrides.
  """
  path, meta, step = _open(directory, step)
  if isinstance(like, ZeroTrainState):
    fields = {f.name: getattr(like.config, f.name)
              for f in dataclasses.fields(like.config)}
    abstract = _abstract_params(like.layout)
    static_extras = like.static_extras
  elif hasattr(like, "params") and hasattr(like, "tx"):
    fields = {}
    abstract = jax.eval_shape(lambda p: p, like.params)
    static_extras = ()
  else:
    raise TypeError("restore() needs like= a ZeroTrainState or TrainState "
                    "(it supplies tx and apply_fn).")
  if meta is not None and not isinstance(like, ZeroTrainState):
    fields.update(_config_from_json(meta["config"]))
  if stage is not None:
    fields["stage"] = stage
  fields.update(config_fields)
  config, mesh = _config_and_mesh(fields.pop("stage", 3), mesh, fields)
  target = dict(like=like, abstract=abstract, static_extras=static_extras,
                config=config, mesh=mesh)
  if meta is not None and meta.get("format") in CHUNK_FORMATS:
    return _restore_chunk_form(path, meta["layout"],
                               in_views=meta["format"] == VIEW_FORMAT, **target)
  return _restore_tree_form(path, **target)


def _loss_scale(state: ZeroTrainState, loaded: dict) -> ZeroTrainState:
  if "loss_scale" not in loaded or state.loss_scale is None:
    return state
  return state.replace(loss_scale=precision.LossScaleState(
      scale=loaded["loss_scale"]["scale"],
      good_steps=loaded["loss_scale"]["good_steps"]))


def _replicated_like(tree, mesh):
  """ShapeDtypeStructs, replicated on `mesh`, of orbax metadata `tree`."""
  rep = NamedSharding(mesh, P())
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)


def _restore_chunk_form(path, saved_layout, *, like, abstract, static_extras,
                        config, mesh, in_views: bool = False) -> ZeroTrainState:
  """A chunk-form checkpoint: read straight into the target shardings when
  the target's chunk layout is the saved one, else (or when its statistics
  are in view shape, `in_views`) cut into the ordinary tree on the host and
  repacked."""
  # The optimizer probes that check like.tx (a compile: seconds, once per
  # process and tx) run beside the checks and the read, which need only the
  # saved labels.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  try:
    probed = pool.submit(check_tx, like.tx, abstract, config)
    saved = _saved_tree(path)
    want = _signature(abstract)
    names = ["/".join(i["names"]) for i in saved_layout["leaves"]]
    have = {k: tuple(i["shape"]) for k, i in zip(names, saved_layout["leaves"])}
    if have != want:
      raise ValueError(_describe_mismatch(have, want, "parameter tree"))
    layout_saved = _layout_from_json(saved_layout,
                                     jax.tree_util.tree_structure(abstract))
    def saved_opt():
      views = like.tx.init(layout_saved.views(
          [jnp.zeros(c.shape, c.dtype) for c in layout_saved.chunks]))
      return views if in_views else optim.stored(layout_saved, views)
    views = jax.eval_shape(saved_opt)
    _check_opt_state(_signature(saved["opt_state"]),
                     _signature(_non_empty(views)))
    tree_opt = jax.eval_shape(like.tx.init, abstract)
    extras = _replicated_like(saved.get("extras", {}), mesh)
    layout, shapes, where = _plan(abstract, tree_opt, 0, extras, static_extras,
                                  tx=like.tx, apply_fn=like.apply_fn,
                                  config=config, mesh=mesh,
                                  labels=layout_saved.labels)
    loaded = (_read_chunks(path, saved, shapes, where, mesh)
              if _layout_json(layout) == saved_layout and not in_views
              else None)
    labels = probed.result()   # raises if like.tx cannot run on chunks
  finally:
    pool.shutdown(wait=False)  # a refused checkpoint does not wait for it
  if loaded is None or labels != layout_saved.labels:
    del loaded
    return _repack(path, layout_saved, abstract, tree_opt, static_extras,
                   like=like, config=config, mesh=mesh)
  master = tuple(_seq(loaded.get("master", [])))
  state = shapes.replace(
      step=loaded["step"], master=master,
      compute=tuple(reshard.cast_program(config.compute_dtype, s)(m)
                    for m, s in zip(master, where.compute)),
      rest=tuple(_seq(loaded.get("rest", []))),
      opt_state=loaded["opt_state"],
      loss_scale=jax.tree_util.tree_map(
          reshard.copy, precision.init(config.loss_scale), where.loss_scale),
      extras=loaded.get("extras", {}))
  return _loss_scale(state, loaded)


def _read_chunks(path, saved, shapes, where, mesh) -> dict:
  """A chunk-form checkpoint (orbax tree `saved`) read straight into the
  shardings `where` of a state shaped `shapes`. The optimizer state is read
  in the saved tree's structure and refilled into `shapes.opt_state`'s,
  leaf by leaf name: a `tx` whose state holds the same arrays in other
  containers (optax.masked's, namedtuples read back as dicts) fits."""
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  opt = _named(jax.tree_util.tree_map(sds, shapes.opt_state, where.opt_state))
  target = {"step": sds(shapes.step, where.step),
            "master": [sds(x, s) for x, s in zip(shapes.master, where.master)],
            "rest": [sds(x, s) for x, s in zip(shapes.rest, where.rest)],
            "opt_state": jax.tree_util.tree_map_with_path(
                lambda p, _: opt["/".join(_path_names(p))], saved["opt_state"])}
  target = {k: v for k, v in target.items() if k in saved}  # orbax drops []
  for key in ("loss_scale", "extras"):
    if key in saved:
      target[key] = _replicated_like(saved[key], mesh)
  loaded = ocp.StandardCheckpointer().restore(path, target)
  got = _named(loaded["opt_state"])
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes.opt_state)
  # empty views are not written (`_non_empty`): made again here
  loaded["opt_state"] = jax.tree_util.tree_unflatten(treedef, [
      got["/".join(_path_names(p))] if np.prod(x.shape) else
      jax.device_put(jnp.zeros(x.shape, x.dtype), s)
      for (p, x), s in zip(flat, jax.tree_util.tree_leaves(where.opt_state))])
  return loaded


def _named(tree) -> dict:
  """Leaf path (names only, as `_signature`) -> leaf."""
  return {"/".join(_path_names(path)): x
          for path, x in jax.tree_util.tree_leaves_with_path(tree)}


def _repack(path, layout_saved, abstract, tree_opt, static_extras, *, like,
            config, mesh) -> ZeroTrainState:
  """Another layout (device count, chunk size): the saved chunks read on the
  host (numpy, straight from the files: any process count), cut into the
  ordinary tree's leaves sharded over `mesh` one saved chunk at a time (each
  freed once cut), then packed chunk by chunk as `shard()` packs, each leaf
  deleted once packed. The host holds the read state once, shrinking as the
  device form grows: about twice the state at the peak, not three times."""
  loaded = _restore_to_host(path)
  n = mesh.shape[config.axis_name]

  def sharded(x):
    x = np.asarray(x)
    s = NamedSharding(mesh, leaf_spec(x.shape, n, config.axis_name))
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

  params, opt = _cut(layout_saved, loaded, emit=sharded)

  def like_tree(tree, by_names):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [
        _as_dtype(by_names.pop(_path_names(p)), x.dtype) for p, x in flat])

  state = place(like_tree(abstract, params), like_tree(tree_opt, opt),
                loaded["step"], loaded.get("extras", {}), static_extras,
                tx=like.tx, apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True)   # the cut leaves are ours
  return _loss_scale(state, loaded)


def _as_dtype(x, dtype):
  return x if x.dtype == dtype else x.astype(dtype)


def _cut(layout: ChunkLayout, loaded: dict, emit=lambda x: x) -> tuple:
  """The ordinary parameter tree and optax state of a chunk-form
  checkpoint read as numpy (`loaded`, saved with `layout`), each as
  {leaf names: emit(array)}. The chunks are taken out of `loaded` and each
  is dropped once its leaves are emitted, so that with an `emit` that
  copies, the two forms are never both whole in memory."""
  master = [np.asarray(x) for x in _seq(loaded.pop("master", []))]
  rest = iter(_seq(loaded.pop("rest", [])))

  def leaf(x, i):
    info = layout.leaves[i]
    chunk = np.reshape(x, layout.chunks[info.chunk].shape)
    return chunk[..., info.offset:info.offset + info.size].reshape(info.shape)

  params = {}
  for i, info in enumerate(layout.leaves):
    if info.chunk < 0:
      params[info.names] = emit(np.asarray(next(rest)))
  for c, chunk in enumerate(layout.chunks):
    for i in chunk.leaves:
      params[layout.leaves[i].names] = emit(leaf(master[c], i))
    master[c] = None
  # optax state over the views: chunk c's statistics at its representative
  opt, prefixes = {}, set()
  opt_state = loaded.pop("opt_state")
  owners = optim.view_chunks(layout, opt_state)
  flat = [(_path_names(path), x) for path, x
          in jax.tree_util.tree_flatten_with_path(opt_state)[0]]
  del opt_state
  for j, c in enumerate(owners):
    key, x = flat[j][0], np.asarray(flat[j][1])
    flat[j] = None
    if c is None:
      opt[key] = x                             # counts, scalars
      continue
    prefix = key[:len(key) - len(layout.leaves[layout.representative(c)].names)]
    prefixes.add((prefix, x.dtype))
    for m in layout.chunks[c].leaves:
      opt[prefix + layout.leaves[m].names] = emit(leaf(x, m))
    del x
  # Leaves outside the chunks (frozen, integer) have empty views, which are
  # not written: the optimizer never saw them, their statistics are zeros.
  for prefix, dtype in prefixes:
    for i in layout.rest_indices:
      info = layout.leaves[i]
      opt[prefix + info.names] = emit(np.zeros(info.shape, dtype))
  return {k: params[k] for k in (i.names for i in layout.leaves)}, opt


def _seq(x) -> list:
  """A saved list as orbax may read it back: a list, or a dict keyed "0",
  "1", ..., "10" (whose sorted order is not the list's)."""
  if isinstance(x, dict):
    return [x[k] for k in sorted(x, key=int)]
  return list(x)


def _nested(by_names: dict) -> Any:
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


def _restore_tree_form(path, *, like, abstract, static_extras, config,
                       mesh) -> ZeroTrainState:
  """A tree-form checkpoint (format "zerojax-1", or a plain orbax
  checkpoint of a flax TrainState): each leaf read sharded, then packed
  chunk by chunk."""
  saved = _saved_tree(path)
  if _signature(saved["params"]) != _signature(abstract):
    raise ValueError(_describe_mismatch(_signature(saved["params"]),
                                        _signature(abstract), "parameter tree"))
  tree_opt = jax.eval_shape(like.tx.init, abstract)
  _check_opt_state(_signature(saved["opt_state"]), _signature(tree_opt))
  rep = NamedSharding(mesh, P())
  target = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            "params": jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract, _leaf_shardings(abstract, mesh, config.axis_name)),
            "opt_state": jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                tree_opt, _leaf_shardings(tree_opt, mesh, config.axis_name))}
  for key in ("loss_scale", "extras"):
    if key in saved:
      target[key] = _replicated_like(saved[key], mesh)
  loaded = ocp.StandardCheckpointer().restore(path, target)
  state = place(loaded["params"], loaded["opt_state"], loaded["step"],
                loaded.get("extras", {}), static_extras, tx=like.tx,
                apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True)   # `loaded` is ours: freed as it is packed
  return _loss_scale(state, loaded)


def export_params(directory_or_state: Any, *, step: Optional[int] = None,
                  with_opt_state: bool = False) -> Any:
  """The ordinary parameter tree (numpy arrays), from a live ZeroTrainState
  or a checkpoint directory, without the original device count (DeepSpeed's
  `zero_to_fp32.py`). With `with_opt_state`, returns `(params, opt_state)`,
  the optax state in its ordinary tree form. From a directory the trees are
  nested dicts (lists for tuples), as orbax reads any tree back."""
  if isinstance(directory_or_state, ZeroTrainState):
    tree = jax.tree_util.tree_map(_to_host, _tree_form(directory_or_state))
  else:
    path, meta, _ = _open(directory_or_state, step)
    tree = _restore_to_host(path)
    if meta is not None and meta.get("format") in CHUNK_FORMATS:
      params, opt = _cut(_layout_from_json(meta["layout"], None), tree)
      tree = {"params": _nested(params), "opt_state": _nested(opt)}
  return (tree["params"], tree["opt_state"]) if with_opt_state else tree["params"]


def _to_host(x: jax.Array) -> np.ndarray:
  # Under multi-host, every process ends up with the whole tree (export's
  # purpose); np.asarray alone refuses arrays with shards on other hosts.
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _restore_to_host(path: str) -> dict:
  """A saved tree as numpy arrays, read straight from the files: no device
  mesh, so neither the device count nor the process count at save matters."""
  as_numpy = jax.tree_util.tree_map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), _saved_tree(path))
  return ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
