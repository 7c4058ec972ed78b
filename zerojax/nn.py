"""The Flax-facing opt-in for per-layer gathering of repeated blocks (stage 3).

    Block = zerojax.nn.layerwise(Block)             # the one line
    x, _ = nn.scan(Block, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=L)(name="blocks")(x, None)
    state = zerojax.shard(state, stage=3, stacked=("blocks",))

Without zerojax (init, evaluation on a plain tree) the wrapped block behaves
exactly like the block. Inside a zerojax stage-3 step, the scanned subtree
holds this layer's chunk *shards*; the wrapper all-gathers them right before
the layer runs and unflattens them into the block's own parameter tree
(under `offload_params`, the layer's shards are moved from host memory to the
device first, one layer at a time). Under
`nn.remat` (on by default) the gathered layer is dropped after the forward
and gathered again in the backward pass, so at most about two layers of
gathered parameters are alive at once, whatever the depth. DESIGN.md records
why a scan is needed: with layers unrolled in Python, XLA merges the backward
re-gathers with the forward ones and keeps every gathered layer alive.
"""
from __future__ import annotations

import contextlib
import contextvars
from typing import Any

import flax.linen as nn

from zerojax import collectives

CHUNK_KEY = "__zerojax_chunk_"
SLOT_KEY = "__zerojax_slot_"   # a host chunk's gradient slot (offload_params)
_ACTIVE = contextvars.ContextVar("zerojax_layerwise", default=None)


@contextlib.contextmanager
def active(layout, config):
  """Set by the step while it traces the user's loss (trace-time metadata)."""
  token = _ACTIVE.set((layout, config))
  try:
    yield
  finally:
    _ACTIVE.reset(token)


def chunk_key(c: int) -> str:
  return f"{CHUNK_KEY}{c}"


def slot_key(c: int) -> str:
  return f"{SLOT_KEY}{c}"


def _gather_layer(variables: Any) -> Any:
  params = variables.get("params", {})
  keys = [k for k in params if str(k).startswith(CHUNK_KEY)]
  if not keys:
    return variables      # init, or a plain (gathered) tree: pass through
  context = _ACTIVE.get()
  if context is None:
    raise RuntimeError("zerojax layer chunks reached a layerwise block outside "
                       "a zerojax train step.")
  layout, config = context
  tree = {}
  for key in keys:
    c = int(str(key)[len(CHUNK_KEY):])
    if slot_key(c) in params:   # kept in host memory: this layer comes over now
      full = collectives.gather_from_host(
          params[key], params[slot_key(c)], config.axis_name,
          config.compute_dtype, config.reduce_dtype)
    else:
      full = collectives.gather(params[key], config.axis_name,
                                config.compute_dtype, config.reduce_dtype)
    layout.layer_tree(c, full, tree)
  return {**variables, "params": tree}


def layerwise(block: type, *, remat: bool = True, **remat_kwargs) -> type:
  """Wraps a Flax block class so zerojax gathers its parameters per layer.

  Args:
    block: a `flax.linen.Module` class, to be scanned with `nn.scan`
      (`variable_axes={"params": 0}`) under a name listed in
      `ZeroConfig.stacked`.
    remat: rematerialise the block (and its gather) in the backward pass; this
      is what keeps gathered parameters from piling up over depth.
    **remat_kwargs: passed to `nn.remat` (e.g. `prevent_cse`, `policy`).

  Returns:
    A module class with the block's constructor and call signature.
  """
  wrapped = nn.map_variables(block, "params", trans_in_fn=_gather_layer,
                             init=True)
  if remat:
    wrapped = nn.remat(wrapped, **remat_kwargs)
  return wrapped
