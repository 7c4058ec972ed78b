"""Per-block gathering for NNX (`zerojax.nn`): a block class made to gather
per call (`_nnx_layerwise`, `layerwise`'s NNX half), the blocks a step's
rebuilt model gathers without an opt-in (`gather_per_call`), and the
chunk shards (`Shard`) a stacked NNX module holds."""
from __future__ import annotations

import functools

import jax
from flax import nnx

from zerojax._model.calls import (_Arguments, _public_methods, _write,
                               remat_policy)
from zerojax._model.gather import (_ACTIVE, active_layout, after_copies,
                                _AFTER, _anchor, _avals, block_remat,
                                _block_tree, CHUNK_KEY, _chunk_keys, FROZEN_KEY,
                                GATHERS_ITSELF, _holds_layer, _Link,
                                _memory_spaces, _owned, _regathered_backward,
                                _regathering, SCALE_KEY, SLOT_KEY, stored,
                                _token, offloaded)


def gather_per_call(module) -> None:
  """An NNX block that owns chunks, in the model a step rebuilt for its
  trace (never the user's object): made an instance of
  `layerwise(type(module), policy=...)` with `ZeroConfig.remat`'s policy
  (`remat_policy`), so that it gathers per call as the opt-in does. Blocks
  that gather themselves are left as they are."""
  context = _ACTIVE.get()
  cls = type(module)
  if (context is None or not context.auto
      or getattr(cls, GATHERS_ITSELF, False)):
    return
  module.__class__ = _nnx_auto(cls)


@functools.lru_cache(maxsize=None)
def _nnx_auto(cls: type) -> type:
  return _nnx_layerwise(cls, True, _FROM_CONFIG)


_FROM_CONFIG = object()   # `_nnx_layerwise`'s policy: `ZeroConfig.remat`'s

# ---- NNX ---------------------------------------------------------------------
STACK_ATTR = "zerojax_stack"   # on a stacked NNX module: its path (static)


class Shard(nnx.Variable):
  """One layer stack's chunk shard `[layers, length / N]`, put beside the
  stack's own variables in an NNX model inside a zerojax step; `nnx.scan`
  hands each layer its row, which the layerwise block gathers."""


def _nnx_layerwise(block: type, remat: bool, saveable=None) -> type:
  """`layerwise` for an `nnx.Module` block class: scanned with `nnx.scan`
  over a stack made with `nnx.vmap` and listed in `ZeroConfig.stacked`, or
  one of repeated blocks (an `nnx.List` of them, or attributes
  `<base>_<i>`), or a module named in `ZeroConfig.per_use`. The block's
  parameters are placeholders inside a step; its `Shard`s (a layer's row,
  or the block's own chunks) are gathered in each call of the block (of
  `__call__`, and of its other public methods, such as `nnx.Embed.attend`),
  cut into a clone of the block holding its parameters, and the method runs
  on the clone (its other variables written back). `nnx.remat` re-gathers
  a layer in the backward; a repeated block's call is a `custom_vjp` with
  ties, as a linen block's (`_nnx_unit`). `saveable`: the remat's policy
  (None: nothing saved but the block's input; `_FROM_CONFIG`:
  `ZeroConfig.remat`'s), its gathered parameters never saved
  (`_regathering`)."""

  def run(method, regather, module, *args, **kwargs):
    layout, config = active_layout()
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    values = nnx.to_pure_dict(params)
    held = {k: v[...] for k, v in vars(module).items()
            if k.startswith((CHUNK_KEY, SLOT_KEY, FROZEN_KEY, SCALE_KEY))}
    _write(values, _block_tree(layout, config, held, regather))
    nnx.replace_by_pure_dict(params, values)
    clone = nnx.merge(graphdef, params, rest)
    out = method(clone, *args, **kwargs)
    nnx.update(module, nnx.state(clone, nnx.Not(nnx.Param)))
    return out

  def gathering(method):
    """`method` of the block, gathering its parameters inside a step."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
      context = _ACTIVE.get()
      stack = getattr(self, STACK_ATTR, None)
      if context is None or stack is None:
        return method(self, *args, **kwargs)
      chunks = _chunk_keys(vars(self))
      if chunks or not context.probing or _holds_layer(
          context.layout, _owned(context.layout, stack), stack,
          nnx.to_pure_dict(nnx.state(self, nnx.Param))):
        context[2].add(stack)   # heard: a layer of it, or the block, called
      if not chunks:
        return method(self, *args, **kwargs)   # gathered for the step
      unit = not any(context[0].chunks[c].layers for c in chunks)
      chosen, offload = (
          remat_policy(block_remat(context, self), per_call=unit)
          if saveable is _FROM_CONFIG else (saveable, False))
      runs = functools.partial(run, method, remat and chosen is not None)
      if not remat:
        return runs(self, *args, **kwargs)
      kept = {} if chosen is None else {"policy": _regathering(chosen)}
      # `nnx.remat` and the unit's `custom_vjp` trace what they are given
      # (arrays, and NNX objects, whose changes are written back); flags
      # are closed over
      arguments = _Arguments(args, kwargs, objects=True)
      if unit:   # per call
        return _nnx_unit(self, stack, runs, arguments, kept, offload)
      return nnx.remat(lambda module, arrays, objects: arguments.call(
          runs, module, arrays, objects), **kept)(self, arguments.arrays,
                                                  arguments.objects)
    return call

  methods = {"__call__": gathering(block.__call__),
             "__module__": block.__module__, "__doc__": block.__doc__}
  for name in _public_methods(block, nnx.Module):
    methods[name] = gathering(getattr(block, name))
  methods[GATHERS_ITSELF] = True
  Layerwise = type(block.__name__, (block,), methods)
  Layerwise.__qualname__ = block.__qualname__
  return Layerwise


def _nnx_unit(module, path: tuple, run, arguments: _Arguments,
              kept: dict, offload: bool = False):
  """One call of a repeated NNX block (or a `per_use` module; at `path`)
  inside a stage-3 step: `run` as a pure function of the block's shards, its other state
  and the call's arrays, rematerialised, in a `custom_vjp` whose gathers
  are tied as a linen block's (see `zerojax.nn`'s docstring; with prefetch,
  chained to the previous block of the same list; `kept`: the remat's
  `policy`, if any; `offload`, as `_unit_call`'s). Its other variables'
  new values are written back; no gradient flows through them."""
  chain = _ACTIVE.get()[3]
  graphdef, shards, own = nnx.split(module, Shard, ...)
  # the NNX objects the call is given: their state is threaded as the
  # block's own is, so what the block changes in them (an `nnx.Rngs`'s
  # counts) is written back
  objects = [nnx.split(o) for o in arguments.objects]
  other = (own, tuple(state for _, state in objects))
  values = arguments.arrays
  token_in = None if chain is None else chain.take(path[:-1])
  link = _Link(overlap=chain is not None and chain.overlap)
  if token_in is None and _anchor(values) is not None:
    token_in = jax.lax.stop_gradient(_token(values))

  def call(shards, other, *values):
    clone = nnx.merge(graphdef, shards, other[0])
    given = [nnx.merge(d, state) for (d, _), state in zip(objects, other[1])]
    out = arguments.call(run, clone, values, given)
    return out, (nnx.state(clone, nnx.Not(Shard)),
                 tuple(nnx.state(o) for o in given))

  rematted = jax.checkpoint(call, prevent_cse=False,   # ties keep it apart
                            **kept)

  def gathered(fn, values):
    """`fn` with the block's gathers waiting for `values[-1]`, and the
    token (this block's input) the next block's gathers may wait for."""
    token = _AFTER.set(values[-1])
    try:
      return fn(*values[:-1]), _token(values[:-1])
    finally:
      _AFTER.reset(token)

  spaces, inputs, kinds = [], set(), set()
  moved = []   # per residual: moved to host memory (`offloaded`)

  @jax.custom_vjp
  def tied(shards, other, *values):
    (out, new), token = gathered(lambda *v: call(shards, other, *v), values)
    return out, new, token

  def forward(shards, other, *values):
    spaces[:] = _memory_spaces(shards)
    kinds.update(_avals(shards))
    inputs.update(_avals(values[:-1]))
    (out, vjp_fn, new), token = gathered(
        lambda *v: jax.vjp(lambda s, *a: rematted(s, other, *a), shards, *v,
                           has_aux=True), values)
    if offload:
      vjp_fn, done = offloaded(vjp_fn, (shards, other, values), moved,
                               ordered=link.overlap)
      out = after_copies(out, done)
    return (out, new, token), vjp_fn

  def backward(vjp_fn, cotangents):
    cotangent, _, token_cotangent = cotangents
    grads = _regathered_backward(vjp_fn, (cotangent, token_cotangent), link,
                                 inputs, kinds, spaces, token_in, moved)
    return (grads[0], None) + grads[1:]   # no gradient for the state

  tied.defvjp(forward, backward)
  out, new, token = tied(shards, other, *values, token_in)
  nnx.update(module, new[0])
  for o, state in zip(arguments.objects, new[1]):
    nnx.update(o, state)
  if chain is not None:
    chain.put(path[:-1], token, link)
  return stored(out)   # see [Note: a block's output stored]
