"""From a pretrained tree to a fine-tune: a checkpoint (or a parameter tree
in memory) read into a `like` whose parameter tree differs from the saved
one, e.g. with LoRA adapters added.

The parameters both trees have take the saved values; `like`'s other
leaves keep their values (its freshly initialised adapters) and are listed
once; saved leaves `like` lacks are refused unless `partial=True`. A
shared leaf with another shape, or another dtype without `cast=True`, is
refused naming it. The optimizer state and step are `like`'s: a fine-tune
starts its own. The result is `zerojax.shard` of `like` with the merged
parameters.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

import jax
import numpy as np

from zerojax.checkpoint._format import (CHUNK_FORMATS, by_path, cut_chunks,
                                        layout_from_json)
from zerojax._core.layout import path_names
from zerojax._state.shard import config_and_mesh, shard

_log = logging.getLogger("zerojax")


def saved_params(meta: Optional[dict], saved: Any) -> dict:
  """{leaf name: (shape, dtype name)} of the parameters a checkpoint holds
  (`meta`, `saved`: `open_step`'s): its chunk layout, the `params` of a
  TrainState tree, or a plain tree of parameters."""
  if meta is not None and meta["format"] in CHUNK_FORMATS:
    return {"/".join(i["names"]): (tuple(i["shape"]), i["dtype"])
            for i in meta["layout"]["leaves"]}
  return {k: (tuple(x.shape), np.dtype(x.dtype).name)
          for k, x in by_path(params_part(saved)).items()}


def params_part(tree: Any) -> Any:
  """The parameters of a saved tree: a TrainState's (or Flax variables')
  `params`, else the tree itself."""
  if isinstance(tree, dict) and "params" in tree and (
      "opt_state" in tree or set(tree) <= {"params", "batch_stats"}):
    return tree["params"]
  return tree


def host_params(meta: Optional[dict], loaded: dict) -> dict:
  """{leaf name: numpy array} of a checkpoint read to host (`loaded`)."""
  if meta is not None and meta["format"] in CHUNK_FORMATS:
    params, _ = cut_chunks(layout_from_json(meta["layout"], None), loaded)
    return {"/".join(names): x for names, x in params.items()}
  return {k: np.asarray(x) for k, x in by_path(params_part(loaded)).items()}


def differs(saved: dict, abstract) -> bool:
  """Whether the saved parameter names are not `abstract`'s."""
  return set(saved) != set(by_path(abstract))


def restore_into(values: dict, like, *, partial: bool, cast: bool,
                 source: str, mesh, fields: dict):
  """`like` sharded with its parameters the saved `values` ({leaf name:
  array}) where both have them (the module docstring), under the config
  `fields` (the saved ZeroConfig's, the caller's options over them)."""
  mine = by_path(like.params)
  new = sorted(set(mine) - set(values))
  dropped = sorted(set(values) - set(mine))
  if not set(mine) & set(values):   # before suggesting partial=True
    raise ValueError(f"{source} shares no parameter with `like` (its leaves: "
                     f"{_few(sorted(values))}; like's: {_few(sorted(mine))}): "
                     "is it the checkpoint of this model? (nothing was "
                     "restored)")
  if dropped and not partial:
    raise ValueError(
        f"{source} has {len(dropped)} parameter(s) `like` lacks "
        f"({_few(dropped)}); pass partial=True to leave them out (nothing "
        "was restored).")
  for name in sorted(set(mine) & set(values)):
    have, want = values[name], mine[name]
    if tuple(np.shape(have)) != tuple(np.shape(want)):
      raise ValueError(f"parameter {name}: {source} has shape "
                       f"{tuple(np.shape(have))}, `like` {tuple(np.shape(want))}"
                       " (nothing was restored).")
    if np.dtype(have.dtype) != np.dtype(want.dtype) and not cast:
      raise ValueError(f"parameter {name}: {source} has dtype {have.dtype}, "
                       f"`like` {want.dtype}; pass cast=True to convert "
                       "(nothing was restored).")
  missing = [n for n in new if isinstance(mine[n], jax.ShapeDtypeStruct)]
  if missing:
    raise ValueError(f"`like` has parameter(s) {source} lacks "
                     f"({_few(missing)}) but no values for them: pass a "
                     "TrainState with them initialised.")
  merged = jax.tree_util.tree_map_with_path(
      lambda path, x: _take(values.get("/".join(path_names(path))), x),
      like.params)
  # every saved leaf used (a base restored under adapters): said at info
  # level; saved leaves left out (partial=True) are a warning
  _log.log(
      logging.WARNING if dropped else logging.INFO,
      "restored %d of %d parameters from %s; %d new (like's values "
      "kept): %s%s", len(mine) - len(new), len(mine), source, len(new),
      _few(new) or "none",
      f"; {len(dropped)} saved left out: {_few(dropped)}" if dropped else "")
  config, mesh = config_and_mesh(fields.pop("stage", 3), mesh, fields)
  return shard(like.replace(params=merged), mesh=mesh, config=config)


def _take(saved, mine):
  if saved is None:
    return mine
  return np.asarray(saved).astype(np.dtype(mine.dtype))


def _few(names: list) -> str:
  return ", ".join(names[:6]) + (f" ... ({len(names)})" if len(names) > 6
                                 else "")
