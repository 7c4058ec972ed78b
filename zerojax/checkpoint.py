"""Orbax checkpoints of a ZeroTrainState that do not depend on the device
count: what is written is the ordinary `TrainState` content, each leaf
sharded over the devices that hold it, so no device or host gathers the
whole state, a checkpoint restores on any mesh and stage, and plain orbax
reads it without zerojax.

On disk, `DIR/<step>/` (orbax CheckpointManager, atomic commit):
  state/  {"step", "params", "opt_state", "loss_scale"?, "extras"?}: the
          parameter tree and the optax state in its ordinary tree form;
  meta/   JSON: format, the ZeroConfig fields, the device count at save.
Never imports `step`.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import precision, reshard
from zerojax.config import DynamicLossScale, ZeroConfig
from zerojax.reshard import leaf_spec
from zerojax.state import ZeroTrainState, _config_and_mesh, place

FORMAT = "zerojax-1"
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
          "num_shards": state.num_shards,
          "leaves": [i.path for i in state.layout.leaves]}
  mgr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(_tree_form(state)),
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
  out = {}
  for path, x in jax.tree_util.tree_leaves_with_path(tree):
    names = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))))
             for k in path]
    out["/".join(names)] = tuple(x.shape)
  return out


def _describe_mismatch(saved, want, what) -> str:
  s, w = _signature(saved), _signature(want)
  lines = [f"  only in the checkpoint: {k}" for k in sorted(set(s) - set(w))][:5]
  lines += [f"  only in `like`: {k}" for k in sorted(set(w) - set(s))][:5]
  lines += [f"  {k}: checkpoint {s[k]}, `like` {w[k]}"
            for k in sorted(set(s) & set(w)) if s[k] != w[k]][:5]
  return f"the checkpoint's {what} does not match `like`:\n" + "\n".join(lines)


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
  saved = _saved_tree(path)
  if _signature(saved["params"]) != _signature(abstract):
    raise ValueError(_describe_mismatch(saved["params"], abstract, "parameter tree"))
  tree_opt = jax.eval_shape(like.tx.init, abstract)
  if _signature(saved["opt_state"]) != _signature(tree_opt):
    raise ValueError("the checkpoint's optimizer state does not match "
                     "like.tx (a different optax transformation?):\n" +
                     _describe_mismatch(saved["opt_state"], tree_opt,
                                        "optimizer state").split("\n", 1)[1])
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
      target[key] = jax.tree_util.tree_map(
          lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), saved[key])
  loaded = ocp.StandardCheckpointer().restore(path, target)
  state = place(loaded["params"], loaded["opt_state"], loaded["step"],
                loaded.get("extras", {}), static_extras, tx=like.tx,
                apply_fn=like.apply_fn, config=config, mesh=mesh,
                release=True)   # `loaded` is ours: freed as it is packed
  if "loss_scale" in loaded and state.loss_scale is not None:
    state = state.replace(loss_scale=precision.LossScaleState(
        scale=loaded["loss_scale"]["scale"],
        good_steps=loaded["loss_scale"]["good_steps"]))
  return state


def export_params(directory_or_state: Any, *, step: Optional[int] = None,
                  with_opt_state: bool = False) -> Any:
  """The ordinary parameter tree (numpy arrays), from a live ZeroTrainState
  or a checkpoint directory, without the original device count (DeepSpeed's
  `zero_to_fp32.py`). With `with_opt_state`, returns `(params, opt_state)`,
  the optax state in its ordinary tree form."""
  if isinstance(directory_or_state, ZeroTrainState):
    tree = jax.tree_util.tree_map(_to_host, _tree_form(directory_or_state))
  else:
    path, _, _ = _open(directory_or_state, step)
    tree = _restore_to_host(path)
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
