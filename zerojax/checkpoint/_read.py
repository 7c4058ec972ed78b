"""Reading a checkpoint's arrays once `restore` has checked it: into the
target shardings when the chunk layout is the saved one
(`restore_chunk_form`), repacked onto another layout (`_repack`), from the
tree form of older checkpoints (`restore_tree_form`), or onto the host as
numpy (`restore_to_host`, for export and partial restore)."""
from __future__ import annotations

import concurrent.futures
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._core import meshes
from zerojax._core import optstate
from zerojax._core import precision
from zerojax._core import reshard
from zerojax.checkpoint._format import (as_dtype, by_path, cut_chunks,
                                        describe_mismatch, layout_from_json,
                                        layout_json, non_empty, saved_list,
                                        saved_rest, shape_signature)
from zerojax.checkpoint._integrity import verify
from zerojax._options.config import shard_axes
from zerojax._core.layout import path_names
from zerojax._core.meshes import leaf_spec
from zerojax._state.build import cast_compute, check_tx, place, plan_state
from zerojax._state.state import ZeroTrainState


def orbax_read(path: str, read: Callable, *args):
  """`read(path, *args)` (an orbax restore), its failures (truncated or
  missing data files) raised as one ValueError naming `path`."""
  try:
    return read(path, *args)
  except Exception as e:  # noqa: BLE001 - re-raised as one clear error
    raise ValueError(f"checkpoint {path} could not be read: "
                     f"{type(e).__name__}: {e}") from None


def check_opt_state(saved: dict, want: dict) -> None:
  if saved != want:
    raise ValueError("the checkpoint's optimizer state does not match "
                     "like.tx (a different optax transformation?):\n" +
                     describe_mismatch(saved, want, "").split("\n", 1)[1])


def without_scalar_placeholders(saved, views) -> dict:
  """The signature (`shape_signature`) of a chunk-form checkpoint's
  optimizer state `saved`, less what checkpoints written before a scalar
  leaf's view was emptied (`ChunkLayout.views`) hold for it: a shape ()
  statistic where `views`, the state over this layout's views, holds an
  empty (0,) one. Those carried nothing but zeros."""
  now = shape_signature(views)
  return {k: s for k, s in shape_signature(saved).items()
          if not (s == () and now.get(k) == (0,))}


def loss_scale(state: ZeroTrainState, loaded: dict) -> ZeroTrainState:
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


def _leaf_shardings(tree, mesh, axis_name):
  n = meshes.axes_size(mesh, axis_name)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), n, axis_name)), tree)


def restore_chunk_form(path, saved, saved_layout, sums, *, like, abstract,
                        static_extras, config, mesh,
                        model_dims) -> ZeroTrainState:
  """A chunk-form checkpoint: read straight into the target shardings when
  the target's chunk layout is the saved one, else cut into the ordinary
  tree on the host and repacked. `sums`: the saved arrays' checksums, checked as they are read."""
  # The optimizer probes that check like.tx (a compile: seconds, once per
  # process and tx) run beside the checks and the read, which need only the
  # saved labels.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  try:
    probed = pool.submit(check_tx, like.tx, abstract, config)
    want = shape_signature(abstract)
    names = ["/".join(i["names"]) for i in saved_layout["leaves"]]
    have = {k: tuple(i["shape"]) for k, i in zip(names, saved_layout["leaves"])}
    if have != want:
      raise ValueError(describe_mismatch(have, want, "parameter tree"))
    layout_saved = layout_from_json(saved_layout,
                                     jax.tree_util.tree_structure(abstract))
    def saved_opt():
      views = like.tx.init(layout_saved.views(
          [jnp.zeros(c.shape, c.dtype) for c in layout_saved.chunks]))
      return optstate.stored(layout_saved, views)
    views = jax.eval_shape(saved_opt)
    check_opt_state(without_scalar_placeholders(saved["opt_state"], views),
                     shape_signature(non_empty(views)))
    tree_opt = jax.eval_shape(like.tx.init, abstract)
    extras = _replicated_like(saved.get("extras", {}), mesh)
    layout, shapes, where = plan_state(abstract, tree_opt, 0, extras, static_extras,
                                       tx=like.tx, apply_fn=like.apply_fn,
                                       config=config, mesh=mesh,
                                       labels=layout_saved.labels,
                                       model_dims=model_dims)
    # the same chunks, and the leaves outside them stored alike (frozen
    # weights in the same dtype, or int8 pairs): read as they are
    same = (layout_json(layout) == saved_layout
            and _stored_form(saved.get("rest", [])) == _stored_form(
                shapes.rest))
    loaded = (_read_chunks(path, saved, shapes, where, mesh, sums) if same
              else None)
    labels = probed.result()   # raises if like.tx cannot run on chunks
  finally:
    pool.shutdown(wait=False)  # a refused checkpoint does not wait for it
  if loaded is None or labels != layout_saved.labels:
    del loaded
    return _repack(path, saved, layout_saved, sums, abstract, tree_opt,
                   static_extras, like=like, config=config, mesh=mesh,
                   model_dims=model_dims)
  master = tuple(saved_list(loaded.get("master", [])))
  state = shapes.replace(
      step=loaded["step"], master=master,
      compute=cast_compute(master, where.compute, config),
      rest=tuple(saved_rest(loaded.get("rest", []))),
      opt_state=loaded["opt_state"],
      loss_scale=jax.tree_util.tree_map(
          reshard.copy, precision.init(config.loss_scale), where.loss_scale),
      extras=loaded.get("extras", {}))
  return loss_scale(state, loaded)


def _stored_form(rest) -> list:
  """(shape, dtype) of each array of a state's `rest` (or its metadata)."""
  return [(tuple(x.shape), np.dtype(x.dtype).name)
          for x in jax.tree_util.tree_leaves(rest)]


def _read_chunks(path, saved, shapes, where, mesh, sums) -> dict:
  """A chunk-form checkpoint (orbax tree `saved`) read straight into the
  shardings `where` of a state shaped `shapes`. The optimizer state is read
  in the saved tree's structure and refilled into `shapes.opt_state`'s,
  leaf by leaf name: a `tx` whose state holds the same arrays in other
  containers (optax.masked's, namedtuples read back as dicts) fits."""
  sds = lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
  opt = by_path(jax.tree_util.tree_map(sds, shapes.opt_state, where.opt_state))

  def opt_target(path, x):
    want = opt["/".join(path_names(path))]
    if np.shape(x) == want.shape:
      return want
    # a scalar placeholder of an older checkpoint where the state now holds
    # an empty view (`without_scalar_placeholders`): read, dropped below
    return _replicated_like(x, mesh)

  target = {"step": sds(shapes.step, where.step),
            "master": [sds(x, s) for x, s in zip(shapes.master, where.master)],
            "rest": [jax.tree_util.tree_map(sds, x, s)
                     for x, s in zip(shapes.rest, where.rest)],
            "opt_state": jax.tree_util.tree_map_with_path(
                opt_target, saved["opt_state"])}
  target = {k: v for k, v in target.items() if k in saved}  # orbax drops []
  for key in ("loss_scale", "extras"):
    if key in saved:
      target[key] = _replicated_like(saved[key], mesh)
  loaded = orbax_read(path, ocp.StandardCheckpointer().restore, target)
  verify(path, sums, loaded, on_host=False)
  got = by_path(loaded["opt_state"])
  flat, treedef = jax.tree_util.tree_flatten_with_path(shapes.opt_state)
  # empty views are not written (`non_empty`): made again here
  loaded["opt_state"] = jax.tree_util.tree_unflatten(treedef, [
      got["/".join(path_names(p))] if np.prod(x.shape) else
      jax.device_put(jnp.zeros(x.shape, x.dtype), s)
      for (p, x), s in zip(flat, jax.tree_util.tree_leaves(where.opt_state))])
  return loaded


def _repack(path, saved, layout_saved, sums, abstract, tree_opt, static_extras, *,
            like, config, mesh, model_dims) -> ZeroTrainState:
  """Another layout (device count, chunk size): the saved chunks read on the
  host (numpy, straight from the files: any process count), cut into the
  ordinary tree's leaves sharded over `mesh` one saved chunk at a time (each
  freed once cut), then packed chunk by chunk as `shard()` packs, each leaf
  deleted once packed. The host holds the read state once, shrinking as the
  device form grows: about twice the state at the peak, not three times."""
  loaded = restore_to_host(path, saved, sums)
  axes = shard_axes(config)
  n = meshes.axes_size(mesh, axes)

  def sharded(x):
    x = np.asarray(x)
    s = NamedSharding(mesh, leaf_spec(x.shape, n, axes))
    return jax.make_array_from_callback(x.shape, s, lambda index: x[index])

  params, opt = cut_chunks(layout_saved, loaded, emit=sharded)

  def like_tree(tree, by_names):
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(treedef, [
        as_dtype(by_names.pop(path_names(p)), x.dtype) for p, x in flat])

  state = place(like_tree(abstract, params), like_tree(tree_opt, opt),
                loaded["step"], loaded.get("extras", {}), static_extras,
                tx=like.tx, apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True, model_dims=model_dims)   # the cut leaves are ours
  return loss_scale(state, loaded)


def restore_tree_form(path, saved, *, like, abstract, static_extras, config,
                       mesh, model_dims) -> ZeroTrainState:
  """A tree-form checkpoint (format "zerojax-1", or a plain orbax
  checkpoint of a flax TrainState): each leaf read sharded, then packed
  chunk by chunk."""
  if shape_signature(saved["params"]) != shape_signature(abstract):
    raise ValueError(describe_mismatch(shape_signature(saved["params"]),
                                        shape_signature(abstract), "parameter tree"))
  tree_opt = jax.eval_shape(like.tx.init, abstract)
  check_opt_state(shape_signature(saved["opt_state"]), shape_signature(tree_opt))
  rep = NamedSharding(mesh, P())
  target = {"step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
            "params": jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                abstract, _leaf_shardings(abstract, mesh, shard_axes(config))),
            "opt_state": jax.tree_util.tree_map(
                lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                tree_opt, _leaf_shardings(tree_opt, mesh, shard_axes(config)))}
  for key in ("loss_scale", "extras"):
    if key in saved:
      target[key] = _replicated_like(saved[key], mesh)
  loaded = orbax_read(path, ocp.StandardCheckpointer().restore, target)
  state = place(loaded["params"], loaded["opt_state"], loaded["step"],
                loaded.get("extras", {}), static_extras, tx=like.tx,
                apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True,   # `loaded` is ours: freed as it is packed
                model_dims=model_dims)
  return loss_scale(state, loaded)


def restore_to_host(path: str, saved, sums: Optional[dict]) -> dict:
  """A saved tree as numpy arrays, read straight from the files: no device
  mesh, so neither the device count nor the process count at save matters.
  `saved`: its orbax metadata tree; `sums`: the saved checksums, checked
  (None: none saved)."""
  as_numpy = jax.tree_util.tree_map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
  loaded = orbax_read(path, lambda p: ocp.PyTreeCheckpointer().restore(
      p, args=ocp.args.PyTreeRestore(restore_args=as_numpy)))
  verify(path, sums, loaded, on_host=True)
  return loaded
