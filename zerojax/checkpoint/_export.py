"""Plain numpy trees of a live state or a checkpoint (DeepSpeed's
`zero_to_fp32.py`)."""
from __future__ import annotations

from typing import Any, Optional

import jax

from zerojax._core import frozen
from zerojax._core import opt_reshard
from zerojax._core import reshard
from zerojax.checkpoint._format import (CHUNK_FORMATS, cut_chunks,
                                        layout_from_json, nest_by_names,
                                        params_shapes)
from zerojax.checkpoint._read import restore_to_host
from zerojax.checkpoint._restore import open_step
from zerojax._options.config import shard_axes
from zerojax._state.gathered import to_host
from zerojax._state.state import (ZeroTrainState, check_live, loaded,
                                  loaded_master)


def export_params(directory_or_state: Any, *, step: Optional[int] = None,
                  with_opt_state: bool = False) -> Any:
  """The ordinary parameter tree (numpy arrays), from a live ZeroTrainState
  or a checkpoint directory, without the original device count (DeepSpeed's
  `zero_to_fp32.py`). With `with_opt_state`, returns `(params, opt_state)`,
  the optax state in its ordinary tree form. From a directory the trees are
  nested dicts (lists for tuples), as orbax reads any tree back."""
  if isinstance(directory_or_state, ZeroTrainState):
    check_live(directory_or_state, "checkpoint.export_params()")
    tree = jax.tree_util.tree_map(to_host, _tree_form(directory_or_state))
  else:
    path, meta, _, saved = open_step(directory_or_state, step)
    tree = restore_to_host(path, saved, meta and meta.get("checksums"))
    if meta is not None and meta.get("format") in CHUNK_FORMATS:
      params, opt = cut_chunks(layout_from_json(meta["layout"], None), tree)
      tree = {"params": nest_by_names(params), "opt_state": nest_by_names(opt)}
  return (tree["params"], tree["opt_state"]) if with_opt_state else tree["params"]


def _tree_form(state: ZeroTrainState) -> dict:
  """The ordinary TrainState content of `state`, leaves sharded, converted
  chunk by chunk (`reshard`): no device holds more than its share plus one
  chunk."""
  layout, axis = state.layout, shard_axes(state.config)
  abstract = params_shapes(layout)
  params = reshard.to_tree(layout, loaded_master(state),
                           frozen.restored(layout, state.rest), axis)
  opt_state = opt_reshard.opt_to_tree(layout, loaded(state, "opt_state"),
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
