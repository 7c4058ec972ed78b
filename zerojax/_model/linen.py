"""Per-block gathering for linen without an opt-in (`zerojax.nn`): Flax's
method interceptor (`intercept`) calls a block that owns chunks as a
`layerwise` block would (`_auto_call`)."""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from zerojax._model.calls import (_Arguments, _public_methods, _unit_call,
                               remat_policy)
from zerojax._model.gather import (_ACTIVE, block_remat, _BYPASS, _Chain,
                                _chunk_keys, _Context,
                                _gather_layer, GATHERS_ITSELF, _holds_layer,
                                _OPTED, _regathering)


@contextlib.contextmanager
def active(layout, config, called: Optional[set] = None,
           prefetch: bool = False, overlap: bool = False,
           auto: bool = False,
           heard: Optional[set] = None, refused: Optional[dict] = None,
           beside: frozenset = frozenset(), kinds: Optional[set] = None):
  """Set by the step while it traces the user's loss (trace-time metadata).
  Every layerwise block called meanwhile adds its module path (a tuple of
  names, as `layout.stack_prefix` gives a chunk's) to `called`: how the
  step learns which stacks and blocks opted in, without guessing. With
  `prefetch`, unrolled blocks are chained (`_Chain`; `overlap`: the
  devices run collectives beside compute, and the backward ties less, see
  `_regathered_backward`). With `auto`, linen
  blocks that hold chunks of their own (repeated blocks, scanned stacks,
  `per_use` modules) are gathered per call without an opt-in
  (`intercept`); with `heard` too (the step's hearing trace), such blocks
  say their paths there and run on zeros in place of their parameters, so
  that what still reads those parameters is a read from outside the
  block's call (`model_call.ModelCall.opted_in`). `beside`: the module paths of
  the modules beside the blocks (`zerojax._model.peruse`), which that trace
  refuses where their `setup` makes their parameters attributes. `kinds`
  gets the class name of each block gathered per call (`Blocks.remat` per
  class)."""
  owners = {}
  if auto:
    for c, chunk in enumerate(layout.chunks):
      if chunk.stack is not None:
        owners.setdefault(layout.stack_prefix(c), []).append(c)
  token = _ACTIVE.set(_Context(layout, config,
                               set() if called is None else called,
                               _Chain(overlap) if prefetch else None, owners,
                               heard is not None,
                               set() if heard is None else heard,
                               {} if refused is None else refused,
                               frozenset(beside),
                               set() if kinds is None else kinds))
  try:
    with nn.intercept_methods(intercept):
      yield
  finally:
    _ACTIVE.reset(token)


def intercept(next_fun, args, kwargs, context):
  """Flax's method interceptor while a step traces the user's function
  (`active`): automatic per-block gathering. A linen module whose path is
  a block's with chunks of its own (`_Context.auto`) is called as a
  `layerwise` block would be (`_auto_call`), or, in the step's hearing
  trace (an ordinary tree), says where it sits. Modules of `layerwise`
  classes gather themselves."""
  ctx = _ACTIVE.get()
  module = context.module
  name = context.method_name
  if (ctx is None or not ctx.auto or module is _BYPASS.get() or _OPTED.get()
      or getattr(type(module), GATHERS_ITSELF, False) or module.scope is None
      or name not in ("__call__", "setup") and name not in _own_methods(
          type(module))
      or module.is_initializing()):
    return next_fun(*args, **kwargs)
  path = tuple(module.scope.path)
  chunks = ctx.auto.get(path)
  if chunks is None:
    return next_fun(*args, **kwargs)
  params = module.variables.get("params", {})
  keys = _chunk_keys(params)
  layout = ctx.layout
  if name == "setup":
    # Flax sets a module up before its first method call, reading the
    # parameters a `setup` makes (`nn.Embed`'s table): a block holding
    # shards is set up in its gathered clones instead (`_auto_call`)
    return None if keys else next_fun(*args, **kwargs)
  if not keys:
    mutated = [c for c in module.variables if c != "params"
               and module.is_mutable_collection(c)]
    if ctx.probing and mutated:
      ctx.refused[path] = (f"it updates {', '.join(map(repr, mutated))} in "
                           "its call, which a re-gathered backward pass "
                           "would not replay")
    elif ctx.probing and path in ctx.beside and (
        type(module).setup is not nn.Module.setup):
      # its `setup` makes its parameters attributes (`nn.Embed.embedding`),
      # which code outside its calls may read, if only for their dtype
      ctx.refused[path] = ("its setup makes its parameters attributes (as "
                           "nn.Embed's embedding), which code outside its "
                           "calls may read")
    elif ctx.probing and _holds_layer(layout, chunks, path, params):
      ctx.called.add(path)
      ctx.heard.add(path)
      return _on_zeros(module, name, args, kwargs)
    return next_fun(*args, **kwargs)
  stacked = any(layout.chunks[c].layers for c in keys)
  if stacked and any(jnp.ndim(params[k]) != 1 for k in keys.values()):
    return next_fun(*args, **kwargs)   # the scan around the layers
  return _auto_call(module, name, args, kwargs, stacked)


@functools.lru_cache(maxsize=None)
def _own_methods(cls: type) -> frozenset:
  """The public methods a linen module's own classes define, but `setup`
  (not what Flax's lifted transforms call on it)."""
  return frozenset(_public_methods(cls, nn.Module)) - {"setup"}


def _bypassing(method: str) -> Callable:
  """`(module, *args, **kwargs) -> module.method(...)`, which `intercept`
  lets through."""
  def run(m, *args, **kwargs):
    token = _BYPASS.set(m)
    try:
      return getattr(m, method)(*args, **kwargs)
    finally:
      _BYPASS.reset(token)
  return run


def _on_zeros(module, method: str, args: tuple, kwargs: dict):
  """The block's method with zeros in place of its parameters (the hearing
  trace's: its outputs then depend on the parameters only through reads
  from outside the call)."""
  return nn.map_variables(
      _bypassing(method), "params",
      trans_in_fn=lambda v: jax.tree_util.tree_map(jnp.zeros_like, v))(
          module, *args, **kwargs)

def _auto_call(module, method: str, args: tuple, kwargs: dict,
               stacked: bool):
  """`module.method(*args, **kwargs)` of a block that holds chunk shards,
  as the same method of `layerwise(type(module), policy=...)` would run
  with `ZeroConfig.remat`'s policy (`remat_policy`): gathered
  (`_gather_layer`), rematerialised under that policy, and for an unrolled
  block tied and chained (`_unit_call`). Other public methods are gathered
  only."""
  arguments = _Arguments(args, kwargs)
  saveable, offload = remat_policy(block_remat(_ACTIVE.get(), module),
                                   per_call=not stacked)
  mapped = nn.map_variables(
      _bypassing(method), "params",
      trans_in_fn=functools.partial(_gather_layer,
                                    regather=saveable is not None))
  if method != "__call__":
    return mapped(module, *args, **kwargs)
  kwargs = {} if saveable is None else {"policy": _regathering(saveable)}
  rematted = lambda **kw: nn.remat(
      lambda m, *arrays: arguments.call(mapped, m, arrays), **kwargs, **kw)
  if stacked:
    return rematted()(module, *arguments.arrays)
  return _unit_call(module, arguments, rematted(prevent_cse=False), offload)
