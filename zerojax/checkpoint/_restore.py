"""Reading a checkpoint onto any mesh and stage: straight into the target
shardings when the chunk layout is the saved one, else repacked."""
from __future__ import annotations

import concurrent.futures
import os
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax._tiers import disk_tier
from zerojax.nn import _frontend as frontend
from zerojax._core import meshes
from zerojax._core import optstate
from zerojax._core import precision
from zerojax._core import reshard
from zerojax._core import tensor_parallel
from zerojax.checkpoint._format import (CHUNK_FORMATS, as_dtype, by_path,
                                        config_from_json, cut_chunks,
                                        describe_mismatch, frozen_mask,
                                        layout_from_json, layout_json,
                                        non_empty, params_shapes, saved_list,
                                        saved_rest, shape_signature)
from zerojax.checkpoint._partial import (differs, host_params, params_part,
                                         restore_into, saved_params)
from zerojax.checkpoint._integrity import (check_arrays, check_step, read_meta,
                                           saved_steps, verify)
from zerojax.checkpoint._save import wait
from zerojax._options.config import DISK, OFFLOAD_FIELDS, expand, shard_axes
from zerojax._core.layout import path_names
from zerojax._core.reshard import leaf_spec
from zerojax._state.build import cast_compute, check_tx, place, plan_state
from zerojax._state.shard import config_and_mesh
from zerojax._state.state import ZeroTrainState, extra_fields


def open_step(directory: str, step: Optional[int]):
  """(path of the state item, checked metadata or None, step, the item's
  orbax metadata tree) of the checkpoint to read: `step`, or the newest. A step that cannot be read
  raises, naming it, why, and the steps that can be restored: never a
  silent fall back to an older one."""
  if step is not None:
    step = check_step(step, "restore")
  if not os.path.isdir(directory):
    raise FileNotFoundError(f"no checkpoint directory {directory!r}.")
  wait(directory)
  steps = saved_steps(directory)
  if not steps:
    # A plain orbax checkpoint of a TrainState (StandardCheckpointer.save).
    if step is not None or not os.path.exists(
        os.path.join(directory, "_CHECKPOINT_METADATA")):
      raise ValueError(f"{directory!r} holds no zerojax checkpoint and no "
                       "orbax checkpoint.")
    return directory, None, None, _saved_tree(directory)
  chosen = steps[-1] if step is None else step
  if chosen not in steps:
    raise ValueError(f"step {chosen} is not in {directory!r}; saved steps: "
                     f"{steps}.")
  try:
    path, meta, saved = _readable(directory, chosen)
    return path, meta, chosen, saved
  except ValueError as e:
    others = [s for s in steps[::-1] if s != chosen and _can_read(directory, s)]
    hint = (f" Steps that can be restored: {others} (pass step=...)." if others
            else " No other step in it can be restored.")
    raise ValueError(f"step {chosen} in {directory!r} cannot be restored: "
                     f"{e}{hint}") from None


def _readable(directory: str, step: int) -> tuple:
  """(state path, metadata, orbax metadata tree) of a step whose files are
  all there and whose metadata is sound; ValueError saying what is wrong
  otherwise."""
  path = os.path.join(directory, str(step), "state")
  for name in ("", "_METADATA", "manifest.ocdbt"):
    if not os.path.exists(os.path.join(path, name)):
      raise ValueError(f"{os.path.join(path, name)} is missing")
  meta = read_meta(os.path.join(directory, str(step)))
  saved = _saved_tree(path)
  if meta is not None and meta["format"] in CHUNK_FORMATS:
    check_arrays(path, meta["layout"], saved)
  return path, meta, saved


def _can_read(directory: str, step: int) -> bool:
  try:
    _readable(directory, step)
  except ValueError:
    return False
  return True


def _saved_tree(path):
  """The orbax metadata tree of the item at `path`."""
  try:
    # The handler reads only the item's tree (`_METADATA`). A Checkpointer
    # would also look for the step's `_CHECKPOINT_METADATA`, which a
    # CheckpointManager writes one level up (`<step>/`), and warn "Metadata
    # file does not exist" on every restore of a valid checkpoint.
    item = ocp.StandardCheckpointHandler().metadata(epath.Path(path))
  except Exception as e:  # noqa: BLE001 - re-raised as one clear error
    raise ValueError(f"orbax cannot read the metadata of {path}: "
                     f"{type(e).__name__}: {e}") from None
  if item is None or not hasattr(item, "tree"):
    raise ValueError(f"{path} has no readable orbax metadata (_METADATA)")
  return item.tree


def _read(path: str, read: Callable, *args):
  """`read(path, *args)` (an orbax restore), its failures (truncated or
  missing data files) raised as one ValueError naming `path`."""
  try:
    return read(path, *args)
  except Exception as e:  # noqa: BLE001 - re-raised as one clear error
    raise ValueError(f"checkpoint {path} could not be read: "
                     f"{type(e).__name__}: {e}") from None


def _check_opt_state(saved: dict, want: dict) -> None:
  if saved != want:
    raise ValueError("the checkpoint's optimizer state does not match "
                     "like.tx (a different optax transformation?):\n" +
                     describe_mismatch(saved, want, "").split("\n", 1)[1])


def _check_like_tree(like) -> None:
  if not (hasattr(like, "params") and hasattr(like, "tx")) or isinstance(
      like, ZeroTrainState):
    raise TypeError("restoring into another parameter tree needs like= a "
                    "TrainState (or an NNX model with tx=) holding the new "
                    f"leaves' values, got {type(like).__name__}.")


def _check_dtypes(saved: dict, abstract, cast: bool) -> None:
  """`saved`: {leaf name: dtype name} at save. A leaf whose dtype `like`
  changes is refused, naming it, unless the caller asked (`cast`)."""
  want = {k: jnp.dtype(x.dtype).name for k, x in by_path(abstract).items()}
  changed = sorted(k for k in want if k in saved and saved[k] != want[k])
  if changed and not cast:
    shown = ", ".join(f"{k} ({saved[k]} -> {want[k]})" for k in changed[:5])
    raise ValueError(
        f"`like` would change the dtype of {len(changed)} saved parameter(s): "
        f"{shown}{' ...' if len(changed) > 5 else ''}. Pass like= a state "
        "with the saved dtypes, or restore(..., cast=True) to convert them "
        "(a narrower dtype loses precision; nothing was restored).")


def restore(directory: Any, *, like: Any, step: Optional[int] = None,
            mesh: Optional[Mesh] = None, stage: Optional[int] = None,
            tx: Any = None, cast: bool = False, partial: bool = False,
            **options) -> ZeroTrainState:
  """Reads a checkpoint into a ZeroTrainState on `mesh` at `stage`, which may
  differ from those at save time (any device count, any stage).

  Args:
    directory: a directory written by `save`, a plain orbax checkpoint of a
      flax TrainState (`StandardCheckpointer().save(path, train_state)`) or
      of a parameter tree, or a parameter tree in memory (`export_params`'
      output).
    like: a ZeroTrainState or TrainState supplying `tx`, `apply_fn` and the
      parameter structure (functions are not stored), or an `nnx.Module`
      (with `tx=`) of the saved model's structure. A ZeroTrainState also
      supplies the ZeroConfig (its `frozen` included); from a TrainState or
      model the saved ZeroConfig is used, and the leaves frozen at save stay
      frozen.
    step: which checkpoint; default the newest.
    mesh: target mesh; default all devices on the data axis.
    stage: target stage; default the saved one (or `like`'s).
    tx: the optax optimizer, when `like` is an NNX model.
    cast: convert saved parameters to the dtypes of `like`'s where they
      differ; without it such a `like` is refused, naming the leaves.
    partial: where `like` (a TrainState or NNX model) has another
      parameter tree than the saved one, e.g. LoRA adapters added to a
      pretrained model: the leaves both have are restored, `like`'s others
      keep its values (listed once), and the saved leaves `like` lacks are
      an error unless `partial=True`. The optimizer state and step are then
      `like`'s (`_partial`).
    **options: `ZeroConfig` options over the saved ones; a group given
      replaces the saved group. An explicit `frozen=` replaces the saved
      one (`frozen=None` trains every leaf): leaves unfrozen start with
      zero optimizer statistics, and the chunks are repacked. `axes=` of a
      mesh of one axis also turns off a saved `hpz`.
  """
  config_fields = expand(options)
  if frontend.is_nnx(like):
    like = frontend.from_nnx(like, tx=tx)
  elif tx is not None:
    raise TypeError("restore(tx=...) is for like= an NNX model; a "
                    f"{type(like).__name__} carries its own tx.")
  for name, flag in (("cast", cast), ("partial", partial)):
    if not isinstance(flag, bool):
      raise TypeError(f"restore({name}={flag!r}): {name} is True or False.")
  if not isinstance(directory, (str, os.PathLike)):   # a tree in memory
    _check_like_tree(like)
    values = {k: np.asarray(x) for k, x in
              by_path(params_part(directory)).items()}
    return restore_into(values, like, partial=partial, cast=cast,
                        source="the parameter tree", stage=stage, mesh=mesh,
                        **config_fields)
  path, meta, step, saved = open_step(directory, step)
  if (hasattr(like, "params") and hasattr(like, "tx")
      and not isinstance(like, ZeroTrainState)) and (
      (meta is None and "opt_state" not in saved) or differs(
          saved_params(meta, saved),
          jax.eval_shape(lambda p: p, tensor_parallel.unboxed(like.params)))):
    _check_like_tree(like)
    values = host_params(meta, restore_to_host(
        path, saved, meta and meta.get("checksums")))
    if stage is None and meta is not None:
      stage = config_from_json(meta["config"]).get("stage")
    return restore_into(values, like, partial=partial, cast=cast,
                        source=f"checkpoint {path}", stage=stage, mesh=mesh,
                        **config_fields)
  if isinstance(like, ZeroTrainState):
    fields = like.config.fields()
    abstract = params_shapes(like.layout)
    static_extras = like.static_extras
  elif hasattr(like, "params") and hasattr(like, "tx"):
    fields = {}
    abstract = jax.eval_shape(lambda p: p, like.params)
    static_extras = extra_fields(like)[1]
  else:
    raise TypeError("restore() needs like= a ZeroTrainState or TrainState "
                    "(it supplies tx and apply_fn).")
  boxed, abstract = abstract, tensor_parallel.unboxed(abstract)
  if meta is not None and not isinstance(like, ZeroTrainState):
    fields.update(config_from_json(meta["config"]))
    fields["frozen"] = frozen_mask(meta, abstract)
  if stage is not None:
    fields["stage"] = stage
  saved_placement = fields.get("placement", "manual")
  fields.update(config_fields)
  if fields.get("replica_axis") is None and "hpz" not in config_fields:
    fields["hpz"] = False
  if saved_placement in ("auto", "planned"):
    if config_fields.get("placement", "auto") == "auto":
      # planned for the saving cluster: planned again at the first step
      fields["placement"] = "auto"
      for name in OFFLOAD_FIELDS:
        if name not in config_fields:
          fields.pop(name, None)
    elif "device_budget" not in config_fields:
      fields["device_budget"] = None
  if (fields.get("placement", "manual") == "manual" and
      not fields.get("offload_optimizer") and "update_on" not in config_fields):
    fields["update_on"] = "device"   # a saved host update needs the offload
  if fields.get("offload_optimizer") == DISK:
    if "update_on" not in config_fields:
      fields["update_on"] = None   # the disk tier's own: on the host
  else:   # a saved disk tier's fields, not wanted here
    for name in ("offload_dir", "sub_group_size"):
      if name not in config_fields:
        fields.pop(name, None)
  config, mesh = config_and_mesh(fields.pop("stage", 3), mesh, fields)
  dims = _model_dims(like, boxed, meta, config, mesh)
  target = dict(like=like, abstract=abstract, static_extras=static_extras,
                config=config, mesh=mesh, model_dims=dims)
  if meta is not None and meta.get("format") in CHUNK_FORMATS:
    _check_dtypes({"/".join(i["names"]): i["dtype"]
                   for i in meta["layout"]["leaves"]}, abstract, cast)
  else:
    _check_dtypes({k: jnp.dtype(x.dtype).name for k, x in
                   by_path(saved.get("params", {})).items()}, abstract, cast)
  if meta is not None and meta.get("format") in CHUNK_FORMATS:
    state = _restore_chunk_form(path, saved, meta["layout"],
                                meta.get("checksums"),
                                **target)
  else:
    state = _restore_tree_form(path, saved, **target)
  return disk_tier.spill(state)   # a disk tier's statistics: to fresh files


def _model_dims(like, abstract, meta, config, mesh) -> Optional[tuple]:
  """Per leaf, the dim split over `config.model_axis` (tensor parallelism):
  as `like` says (a ZeroTrainState's layout, or a TrainState's partitioning
  boxes), else as the checkpoint's layout says; None without a model
  axis. Sizes that do not divide over the new model axis are refused when
  the layout is built, naming the leaf."""
  if config.model_axis is None:
    return None
  if isinstance(like, ZeroTrainState):
    dims = tuple(i.model_dim for i in like.layout.leaves)
  else:
    dims = tensor_parallel.model_dims(
        abstract, config.model_axis, mesh,
        (config.axis_name, config.replica_axis))
  if all(d is None for d in dims) and meta is not None and "layout" in meta:
    dims = tuple(i.get("model_dim") for i in meta["layout"]["leaves"])
  return dims


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


def _leaf_shardings(tree, mesh, axis_name):
  n = meshes.axes_size(mesh, axis_name)
  return jax.tree_util.tree_map(
      lambda x: NamedSharding(mesh, leaf_spec(np.shape(x), n, axis_name)), tree)


def _restore_chunk_form(path, saved, saved_layout, sums, *, like, abstract,
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
    _check_opt_state(shape_signature(saved["opt_state"]),
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
  return _loss_scale(state, loaded)


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
  target = {"step": sds(shapes.step, where.step),
            "master": [sds(x, s) for x, s in zip(shapes.master, where.master)],
            "rest": [jax.tree_util.tree_map(sds, x, s)
                     for x, s in zip(shapes.rest, where.rest)],
            "opt_state": jax.tree_util.tree_map_with_path(
                lambda p, _: opt["/".join(path_names(p))], saved["opt_state"])}
  target = {k: v for k, v in target.items() if k in saved}  # orbax drops []
  for key in ("loss_scale", "extras"):
    if key in saved:
      target[key] = _replicated_like(saved[key], mesh)
  loaded = _read(path, ocp.StandardCheckpointer().restore, target)
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
  return _loss_scale(state, loaded)


def _restore_tree_form(path, saved, *, like, abstract, static_extras, config,
                       mesh, model_dims) -> ZeroTrainState:
  """A tree-form checkpoint (format "zerojax-1", or a plain orbax
  checkpoint of a flax TrainState): each leaf read sharded, then packed
  chunk by chunk."""
  if shape_signature(saved["params"]) != shape_signature(abstract):
    raise ValueError(describe_mismatch(shape_signature(saved["params"]),
                                        shape_signature(abstract), "parameter tree"))
  tree_opt = jax.eval_shape(like.tx.init, abstract)
  _check_opt_state(shape_signature(saved["opt_state"]), shape_signature(tree_opt))
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
  loaded = _read(path, ocp.StandardCheckpointer().restore, target)
  state = place(loaded["params"], loaded["opt_state"], loaded["step"],
                loaded.get("extras", {}), static_extras, tx=like.tx,
                apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True,   # `loaded` is ours: freed as it is packed
                model_dims=model_dims)
  return _loss_scale(state, loaded)


def restore_to_host(path: str, saved, sums: Optional[dict]) -> dict:
  """A saved tree as numpy arrays, read straight from the files: no device
  mesh, so neither the device count nor the process count at save matters.
  `saved`: its orbax metadata tree; `sums`: the saved checksums, checked
  (None: none saved)."""
  as_numpy = jax.tree_util.tree_map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), saved)
  loaded = _read(path, lambda p: ocp.PyTreeCheckpointer().restore(
      p, args=ocp.args.PyTreeRestore(restore_args=as_numpy)))
  verify(path, sums, loaded, on_host=True)
  return loaded
