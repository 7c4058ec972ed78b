"""Reading a checkpoint onto any mesh and stage: straight into the target
shardings when the chunk layout is the saved one, else repacked."""
from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from zerojax._tiers import disk_tier
from zerojax._model import frontend as frontend
from zerojax._core import tensor_parallel
from zerojax.checkpoint._format import (CHUNK_FORMATS, by_path,
                                        config_from_json, frozen_mask,
                                        params_shapes)
from zerojax.checkpoint._partial import (differs, host_params, params_part,
                                         restore_into, saved_params)
from zerojax.checkpoint._integrity import (ITEM_META, check_arrays, check_step,
                                           read_meta, read_meta_file,
                                           saved_steps)
from zerojax.checkpoint._read import (restore_chunk_form, restore_to_host,
                                      restore_tree_form)
from zerojax.checkpoint._save import check_items, wait
from zerojax._options.config import DISK, OFFLOAD_FIELDS, expand
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
  step_dir = os.path.join(directory, str(step))
  item = _item_of_own_manager(step_dir)
  if item is not None:   # saved by the caller's CheckpointManager (`_orbax`)
    return readable_item(item)
  path = os.path.join(step_dir, "state")
  _check_files(path)
  meta = read_meta(step_dir)
  saved = _saved_tree(path)
  if meta is not None and meta["format"] in CHUNK_FORMATS:
    check_arrays(path, meta["layout"], saved)
  return path, meta, saved


def readable_item(path: str) -> tuple:
  """(path, metadata, orbax metadata tree) of a state saved as one item of
  a CheckpointManager (`_orbax`: its arrays and `zerojax.json` in `path`);
  ValueError saying what is wrong otherwise."""
  _check_files(path)
  meta = read_meta_file(os.path.join(path, ITEM_META))
  saved = _saved_tree(path)
  check_arrays(path, meta["layout"], saved)
  return path, meta, saved


def _check_files(path: str) -> None:
  for name in ("", "_METADATA", "manifest.ocdbt"):
    if not os.path.exists(os.path.join(path, name)):
      raise ValueError(f"{os.path.join(path, name)} is missing")


def _item_of_own_manager(step_dir: str) -> Optional[str]:
  """The item of `step_dir` that holds a zerojax state saved through the
  caller's own CheckpointManager (its `zerojax.json`), or None for a step
  `save` wrote. Several such items are refused: which one is the
  caller's to say, restoring through their manager."""
  found = sorted(n for n in os.listdir(step_dir) if os.path.isfile(
      os.path.join(step_dir, n, ITEM_META)))
  if len(found) > 1:
    raise ValueError(f"{step_dir} holds zerojax states in the items {found}; "
                     "restore the one you want through your "
                     "CheckpointManager (ocp.args.Composite(name="
                     "zerojax.checkpoint.ZeroRestore(...))).")
  return os.path.join(step_dir, found[0]) if found else None


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
            items: Optional[Mapping[str, Any]] = None,
            **options) -> Any:
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
    items: the step's other items to read, as `save(..., items=)` wrote
      them: {name: orbax restore args}, e.g. `{"data":
      ocp.args.JsonRestore()}`. With it, returns `(state, {name: value})`,
      both of the same step.
    **options: `ZeroConfig` options over the saved ones; a group given
      replaces the saved group. An explicit `frozen=` replaces the saved
      one (`frozen=None` trains every leaf): leaves unfrozen start with
      zero optimizer statistics, and the chunks are repacked. `axes=` of a
      mesh of one axis also turns off a saved `hpz`.
  """
  like, config_fields = prepared(like, tx, cast, partial, options)
  items = check_items(items, "restore")
  if not isinstance(directory, (str, os.PathLike)):   # a tree in memory
    if items:
      raise TypeError("restore(items=...) reads a checkpoint directory's "
                      "items; a parameter tree in memory has none.")
    _check_like_tree(like)
    values = {k: np.asarray(x) for k, x in
              by_path(params_part(directory)).items()}
    return restore_into(values, like, partial=partial, cast=cast,
                        source="the parameter tree", mesh=mesh,
                        fields=_target_fields({}, stage, config_fields))
  path, meta, step, saved = open_step(directory, step)
  if items and step is None:
    raise ValueError(f"restore(items=...): {directory!r} is a plain orbax "
                     "checkpoint, which holds no items beside the state.")
  state = restore_opened(path, meta, saved, like, mesh=mesh, stage=stage,
                         cast=cast, partial=partial,
                         config_fields=config_fields)
  if not items:
    return state
  return state, read_items(os.path.join(directory, str(step)), items)


def prepared(like: Any, tx: Any, cast: Any, partial: Any,
             options: dict) -> tuple:
  """(like, the ZeroConfig fields of `options`) for a restore: an NNX
  model made a TrainState with `tx`; the flags checked."""
  config_fields = expand(options)
  if frontend.is_nnx(like):
    like = frontend.from_nnx(like, tx=tx)
  elif tx is not None:
    raise TypeError("restore(tx=...) is for like= an NNX model; a "
                    f"{type(like).__name__} carries its own tx.")
  for name, flag in (("cast", cast), ("partial", partial)):
    if not isinstance(flag, bool):
      raise TypeError(f"restore({name}={flag!r}): {name} is True or False.")
  return like, config_fields


def read_items(step_dir: str, items: dict) -> dict:
  """{name: value} of the items `items` names in the step `step_dir`, read
  as orbax reads them; a missing one is named with those the step has."""
  have = sorted(n for n in os.listdir(step_dir)
                if os.path.isdir(os.path.join(step_dir, n))
                and n not in ("state", "meta"))
  missing = [n for n in items if n not in have]
  if missing:
    raise ValueError(f"{step_dir} holds no item {', '.join(missing)}; its "
                     f"items beside the state: {have or 'none'}.")
  read = ocp.CompositeCheckpointHandler().restore(
      epath.Path(step_dir), ocp.args.Composite(**items))
  return {name: read[name] for name in items}


def restore_opened(path: str, meta: Optional[dict], saved: Any, like: Any, *,
                   mesh: Optional[Mesh], stage: Optional[int], cast: bool,
                   partial: bool, config_fields: dict) -> ZeroTrainState:
  """The state of an opened checkpoint (`path` of its arrays, its checked
  metadata `meta` and orbax tree `saved`), as `restore` documents."""
  if (hasattr(like, "params") and hasattr(like, "tx")
      and not isinstance(like, ZeroTrainState)) and (
      (meta is None and "opt_state" not in saved) or differs(
          saved_params(meta, saved),
          jax.eval_shape(lambda p: p, tensor_parallel.unboxed(like.params)))):
    _check_like_tree(like)
    values = host_params(meta, restore_to_host(
        path, saved, meta and meta.get("checksums")))
    saved_fields = {}
    if meta is not None:   # the saved ZeroConfig, its frozen leaves by name
      saved_fields = config_from_json(meta["config"])
      saved_fields["frozen"] = frozen_mask(meta, jax.eval_shape(
          lambda p: p, tensor_parallel.unboxed(like.params)))
    return restore_into(values, like, partial=partial, cast=cast,
                        source=f"checkpoint {path}", mesh=mesh,
                        fields=_target_fields(saved_fields, stage,
                                              config_fields))
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
  fields = _target_fields(fields, stage, config_fields)
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
    state = restore_chunk_form(path, saved, meta["layout"],
                                meta.get("checksums"),
                                **target)
  else:
    state = restore_tree_form(path, saved, **target)
  return disk_tier.spill(state)   # a disk tier's statistics: to fresh files


def _target_fields(saved: dict, stage: Optional[int],
                   config_fields: dict) -> dict:
  """The config fields of a restored state: the saved ones (`saved`, the
  checkpoint's ZeroConfig fields, or `like`'s), then `stage` and the
  caller's `config_fields` over them; what the saving cluster planned is
  planned again, and a saved tier's own fields go where the tier does."""
  fields = dict(saved)
  if stage is not None:
    fields["stage"] = stage
  saved_placement = fields.get("placement", "manual")
  _check_saved_offload(fields, config_fields)
  fields.update(config_fields)
  if ("frozen" in config_fields and config_fields["frozen"] is None
      and "frozen_dtype" not in config_fields):
    fields["frozen_dtype"] = None   # nothing frozen: nothing stored in int8
  if "hpz_partition_size" not in config_fields:
    # a DeepSpeed configuration's check of the saving cluster's mesh
    fields.pop("hpz_partition_size", None)
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
  return fields


def _check_saved_offload(fields: dict, config_fields: dict) -> None:
  """A saved offload the target stage cannot hold, the caller not having
  set one: refused naming where it came from (the checkpoint) and the fix
  (offload=None), rather than the config's own "offload needs stage >=
  1"."""
  if "offload_optimizer" in config_fields or fields.get(
      "placement", "manual") != "manual":
    return
  stage = fields.get("stage", 3)
  saved = ("Offload(params=True)" if fields.get("offload_params") and stage != 3
           else "its offload" if stage == 0 and (
               fields.get("offload_optimizer") or fields.get("offload_params"))
           else None)
  if saved is not None:
    raise ValueError(
        f"the checkpoint was saved with {saved}, which stage {stage} cannot "
        "hold (offloaded parameters need stage 3; stage 0 offloads nothing); "
        "pass offload=None to restore without offload (or another "
        "offload=, or another stage).")


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
