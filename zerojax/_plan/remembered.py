"""What the planners compile, remembered: one `train_step` per (loss,
flags), and what the last candidates' compiled steps measured, so that
planning again for the same loss and state (`plan_offload`, then
`offload="auto"` at the first step; `zerojax.plan`, then `stage="auto"`)
compiles nothing twice.

As `jax.jit` does, a loss is known by its identity: the same function
object plans as it did before. The state and batch are known by their
shapes, dtypes and shardings and the state's layout, config and mesh;
`placement` and `device_budget` are not part of the key, since the
program does not read them (they say when and for what to plan).
"""
from __future__ import annotations

import collections
import functools
from typing import Any, Callable, Optional

import jax

from zerojax._train.step import train_step

# measurements kept: a plan compiles about a dozen candidates
_KEEP = 64


def _hashes(key) -> bool:
  try:
    hash(key)
  except TypeError:   # a loss or state holding unhashable parts
    return False
  return True


@functools.lru_cache(maxsize=8)
def _step(loss_fn, has_aux, mutable, weighted) -> Callable:
  return train_step(loss_fn, has_aux=has_aux, mutable=mutable,
                    weighted=weighted)


def step(loss_fn: Callable, *, has_aux: bool, mutable, weighted: bool
         ) -> Callable:
  """The `train_step` the planners compile candidates of; the same object
  for the same loss and flags, so jax's traces and lowerings of each
  candidate serve the next plan."""
  key = (loss_fn, has_aux, tuple(mutable) if isinstance(mutable, list)
         else mutable, weighted)
  if not _hashes(key):
    return train_step(loss_fn, has_aux=has_aux, mutable=mutable,
                      weighted=weighted)
  return _step(*key)


_measured: collections.OrderedDict = collections.OrderedDict()


def measured(step_fn: Callable, abstract: Any, batch: Any,
             read: Callable[[Any, Any], Any],
             compiler_options: Optional[dict] = None,
             compile: Optional[Callable] = None) -> Any:
  """`read(compiled, abstract)` of `step_fn.lower(abstract, batch)
  .compile(compiler_options)` (or `compile(lowered)`, a
  `zerojax.GpuTarget`'s), once per (read, step, state, batch shapes,
  options, compile) among the last `_KEEP`. What `read` returns is kept,
  not the compiled program (a large model's is large)."""
  config = tuple((name, value) for name, value in
                 abstract.config.fields().items()
                 if name not in ("placement", "device_budget"))
  leaves, tree = jax.tree_util.tree_flatten(abstract.replace(config=None))
  shapes, batch_tree = jax.tree_util.tree_flatten(batch)
  key = (read, step_fn, config, tree, tuple(leaves), batch_tree,
         tuple((x.shape, x.dtype) for x in shapes),
         tuple(sorted((compiler_options or {}).items())), compile)
  build = compile or (lambda lowered: lowered.compile(compiler_options))
  measure = lambda: read(build(step_fn.lower(abstract, batch)), abstract)
  if not _hashes(key):
    return measure()
  out = _measured.pop(key, None)   # put back last: the most recent
  if out is None:
    out = measure()
  _measured[key] = out
  while len(_measured) > _KEEP:
    _measured.popitem(last=False)
  return out
