"""Per-block gathering at stage 3: found without an opt-in (`intercept`,
linen's method interceptor; `gather_per_call`, NNX), and the Flax-facing
opt-in it does the work of, `layerwise`, kept as an override.

    Block = zerojax.nn.layerwise(Block)             # the one line
    x, _ = nn.scan(Block, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=L)(name="blocks")(x, None)
    state = zerojax.shard(state, stage=3,
                          blocks=zerojax.Blocks(stacked=("blocks",)))

Without zerojax (init, evaluation on a plain tree) the wrapped block behaves
exactly like the block. Inside a zerojax stage-3 step, the scanned subtree
holds this layer's chunk *shards*; the wrapper all-gathers them right before
the layer runs and unflattens them into the block's own parameter tree
(under `offload_params`, the layer's shards are moved from host memory to the
device first, one layer at a time). Under
`nn.remat` (on by default) the gathered layer is dropped after the forward
and gathered again in the backward pass, so at most about two layers of
gathered parameters are alive at once, whatever the depth. docs/design.md records
why a scan needs nothing more.

Unrolled blocks (`for i in range(L): x = Block(name=f"blocks_{i}")(x)`, or
an `nnx.List` of NNX blocks called in a loop) take the same one line: at
stage 3 each repeated block gets chunks of its own
(`chunking.repeated_blocks`), and the wrapper gathers them when the block is
called. Without a loop, XLA sees L gathers that depend on nothing but the
parameters: it merges each backward re-gather with the forward gather
(CSE) and is free to schedule every gather first, so every gathered block
stays alive. The wrapper therefore ties each gather to data it must wait
for (`tie`): the forward gather to the block's input (in a train step and
in `eval_step`), the backward re-gather to the cotangent of the block's
output. A block call is a
`custom_vjp` whose residuals are the block's shards and inputs only.
With `ZeroConfig.prefetch` each gather waits for the block before instead
(`_Chain`): the forward gather for the previous block's input, the
re-gather for the next block's output cotangent.

At stage 2 a scanned wrapped block holds its layer's replicated row and a
gradient slot instead of shards: nothing is gathered, and the row's
gradient is reduce-scattered into the slot inside the backward loop, as
the backward pass leaves the layer (`StagePolicy.layer_hooks`).
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import logging
from typing import Any, Callable, NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core.tracers import current_trace

from zerojax._comm import collectives
from zerojax._core import frozen
from zerojax._core.offload import HOST_SPACE
from zerojax._options.policy import policy

CHUNK_KEY = "__zerojax_chunk_"
SLOT_KEY = "__zerojax_slot_"   # a gradient slot (offload_params; stage 2)
FROZEN_KEY = "__zerojax_frozen_"   # a frozen weight's shard (`zerojax._core.frozen`)
SCALE_KEY = "__zerojax_scale_"     # an int8 frozen matrix's absmax shard
_ACTIVE = contextvars.ContextVar("zerojax_layerwise", default=None)
# the array a unit's forward gather waits for (its block's input)
_AFTER = contextvars.ContextVar("zerojax_after", default=None)
# the block whose call `intercept` is running (its own call passes through)
_BYPASS = contextvars.ContextVar("zerojax_bypass", default=None)
# inside a `layerwise` block's call (Flax's lifts call the block's own
# class there): `intercept` lets every call through
_OPTED = contextvars.ContextVar("zerojax_opted", default=False)
_log = logging.getLogger("zerojax")
_SAID: set = set()   # messages said already (each is said once a process)


def say_once(message: str, level: int = logging.WARNING) -> None:
  """Logs `message` (a warning, unless `level` says otherwise) the first
  time it is said."""
  if message not in _SAID:
    _SAID.add(message)
    _log.log(level, message)


# a class attribute of modules that gather their own chunks (`layerwise`
# classes, `BlockedEmbed`): `intercept` leaves them alone
GATHERS_ITSELF = "_zerojax_gathers_itself"


class _Context(NamedTuple):
  """What a step tells the blocks while it traces the user's function."""
  layout: Any
  config: Any
  called: set     # module paths of the blocks that gathered (or would)
  chain: Optional["_Chain"]   # prefetch's, or None
  auto: dict      # {module path: its chunks}: blocks gathered per call
                  # without an opt-in (`intercept`); empty when off
  probing: bool   # the step's hearing trace: blocks heard run on zeros
  heard: set      # module paths `intercept` heard (`called` has them too)
  refused: dict   # {module path: why it is not gathered per call}
  beside: frozenset   # module paths beside the blocks (`zerojax.nn._peruse`)


@contextlib.contextmanager
def active(layout, config, called: Optional[set] = None,
           prefetch: bool = False, auto: bool = False,
           heard: Optional[set] = None, refused: Optional[dict] = None,
           beside: frozenset = frozenset()):
  """Set by the step while it traces the user's loss (trace-time metadata).
  Every layerwise block called meanwhile adds its module path (a tuple of
  names, as `layout.stack_prefix` gives a chunk's) to `called`: how the
  step learns which stacks and blocks opted in, without guessing. With
  `prefetch`, unrolled blocks are chained (`_Chain`). With `auto`, linen
  blocks that hold chunks of their own (repeated blocks, scanned stacks,
  `per_use` modules) are gathered per call without an opt-in
  (`intercept`); with `heard` too (the step's hearing trace), such blocks
  say their paths there and run on zeros in place of their parameters, so
  that what still reads those parameters is a read from outside the
  block's call (`grads.ModelCall.opted_in`). `beside`: the module paths of
  the modules beside the blocks (`zerojax.nn._peruse`), which that trace
  refuses where their `setup` makes their parameters attributes."""
  owners = {}
  if auto:
    for c, chunk in enumerate(layout.chunks):
      if chunk.stack is not None:
        owners.setdefault(layout.stack_prefix(c), []).append(c)
  token = _ACTIVE.set(_Context(layout, config,
                               set() if called is None else called,
                               _Chain() if prefetch else None, owners,
                               heard is not None,
                               set() if heard is None else heard,
                               {} if refused is None else refused,
                               frozenset(beside)))
  try:
    with nn.intercept_methods(intercept):
      yield
  finally:
    _ACTIVE.reset(token)


def chunk_key(c: int) -> str:
  return f"{CHUNK_KEY}{c}"


def slot_key(c: int) -> str:
  return f"{SLOT_KEY}{c}"


def frozen_key(i: int) -> str:
  """The key of leaf `i`'s shard, a frozen weight a block gathers itself."""
  return f"{FROZEN_KEY}{i}"


def scale_key(i: int) -> str:
  """The key of the absmax shard of leaf `i`, an int8 frozen matrix."""
  return f"{SCALE_KEY}{i}"


@jax.custom_jvp
def tie(x, after):
  """`x`, bit for bit, computed from `after` too: XLA can then neither run
  what reads the result before `after` exists, nor merge it with the same
  computation on `x` elsewhere. It is `x & (x | t)` on the bits, `x` for
  every `t`, which no XLA simplification knows, on every backend: XLA's
  CPU backend drops optimization barriers before scheduling, and on a GPU
  a barrier over the saved activations cost more time and memory than
  these bit passes, which XLA fuses into a value's producers or readers
  (docs/decisions.md, "the bit tie"). Differentiates as the identity in
  `x`.
  """
  return _bit_tie(x, jnp.ravel(after)[0])


def _bit_tie(x, t):
  if x.dtype == jnp.bool_:   # no bit casts of bool: tie its bytes
    return _bit_tie(x.astype(jnp.uint8), t).astype(jnp.bool_)
  bits = jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}")
  if jnp.issubdtype(t.dtype, jnp.floating):
    t = jax.lax.bitcast_convert_type(
        t, jnp.dtype(f"uint{8 * jnp.dtype(t.dtype).itemsize}"))
  u = jax.lax.bitcast_convert_type(x, bits)
  return jax.lax.bitcast_convert_type(u & (u | t.astype(bits)), x.dtype)


@tie.defjvp
def _tie_jvp(primals, tangents):
  return tie(*primals), tangents[0]


def _anchor(tree):
  """The first non-empty numeric array of `tree`, or None."""
  for leaf in jax.tree_util.tree_leaves(tree):
    dtype = getattr(leaf, "dtype", None)
    if (dtype is not None and jnp.size(leaf) and
        (jnp.issubdtype(dtype, jnp.number) or dtype == jnp.bool_)):
      return leaf
  return None


def _token(values) -> Optional[jax.Array]:
  """A float32 scalar computed from `values`' first array (None if they
  hold none): what a gather that must wait for `values` is tied to."""
  anchor = _anchor(values)
  return None if anchor is None else jnp.ravel(anchor)[0].astype(jnp.float32)


class _Link:
  """One unrolled block call; `consumed` once the next block's forward
  gather waits for its token (so its re-gather may wait for that block's
  backward to start)."""

  def __init__(self):
    self.consumed = False


class _Chain:
  """Prefetch (`ZeroConfig.prefetch`) over one traced model call: the token
  of the last unrolled block called, which the next block's forward gather
  waits for. Only blocks called from the same module method in the same JAX
  trace are chained (a block under another transformation starts afresh)."""

  def __init__(self):
    self.last = None   # (parent, trace, token, link)

  def take(self, parent) -> Optional[jax.Array]:
    """The previous block's token, if a block of `parent` (a linen module,
    or an NNX block's path without its index) may wait for it."""
    if self.last is None:
      return None
    last, trace, token, link = self.last
    same = last is parent or (isinstance(parent, tuple) and last == parent)
    if token is None or not same or trace != current_trace():
      return None
    link.consumed = True
    return token

  def put(self, parent, token, link: _Link) -> None:
    self.last = (parent, current_trace(), token, link)


def _avals(values) -> set:
  """`(shape, dtype)` of each array in `values`."""
  return {(jnp.shape(v), jnp.result_type(v))
          for v in jax.tree_util.tree_leaves(values)}


def _regathered_backward(vjp_fn, cotangents, link: _Link, inputs: set,
                         spaces: list, token_in) -> tuple:
  """The backward of an unrolled block's call (linen or NNX): `vjp_fn`
  (of the rematerialised, gathered block; its residuals are the block's
  shards and inputs) applied to the output's cotangent, with the re-gather
  waiting for that cotangent, and the cotangent of the previous block's
  token appended. `cotangents` is `(output's, token's)`, `inputs` the
  `(shape, dtype)`s of the block's array arguments, `spaces` the memory
  space of each shard (the first of `vjp_fn`'s results)."""
  cotangent, token_cotangent = cotangents
  after = _anchor(cotangent)
  if after is not None:   # the re-gathers wait for the cotangent...
    # ...of the next block's output when it prefetches this block: its
    # token's cotangent (`_Link`), which that block's backward gives as it
    # starts. The block's saved inputs still wait for its own, so only the
    # re-gather (shards, token) starts early.
    early = token_cotangent if link.consumed else after
    vjp_fn = jax.tree_util.tree_map(
        lambda r: r if _anchor(r) is None else tie(
            r, after if _avals((r,)) <= inputs else early), vjp_fn)
  grads = vjp_fn(cotangent)
  # a shard in host memory (offload) takes its (unused: the gradient goes
  # to a device slot) cotangent there, as JAX requires
  leaves, treedef = jax.tree_util.tree_flatten(grads[0])
  if len(leaves) == len(spaces) and HOST_SPACE in spaces:
    leaves = [jax.device_put(g, HOST_SPACE) if space == HOST_SPACE else g
              for g, space in zip(leaves, spaces)]
    grads = (jax.tree_util.tree_unflatten(treedef, leaves),) + tuple(grads[1:])
  # the previous block's token: no gradient flows through a token, so its
  # cotangent is free to be what the previous block's re-gathers wait for
  # (this block's output cotangent)
  return tuple(grads) + (None if token_in is None else
                         _token((cotangent,)) if after is not None
                         else jnp.zeros((), jnp.float32),)


def _memory_spaces(tree) -> list:
  """The memory space of each array of `tree` (None where unsaid)."""
  return [getattr(getattr(x, "aval", None), "memory_space", None)
          for x in jax.tree_util.tree_leaves(tree)]


def _chunk_keys(params, prefix: str = CHUNK_KEY) -> dict:
  """`{chunk index: key}` of the chunk shards a block's params hold (with
  `prefix=FROZEN_KEY`, `{leaf index: key}` of its frozen weights' shards)."""
  return {int(str(k)[len(prefix):]): k for k in params
          if str(k).startswith(prefix)}


def _without_keys(params) -> dict:
  """A copy of a block's nested parameter dicts without the entries a step
  put there (chunk shards, gradient slots, frozen weights' shards)."""
  return {k: _without_keys(v) if hasattr(v, "items") else v
          for k, v in params.items()
          if not str(k).startswith((CHUNK_KEY, SLOT_KEY, FROZEN_KEY,
                                    SCALE_KEY))}


def _block_tree(layout, config, params, regather: bool) -> dict:
  """A block's parameter tree (paths relative to the block) from what it
  holds inside a step, `params` (`{key: array}`): each chunk's shard of
  this layer or block gathered (`_layer_tree`) and each frozen weight's
  (`zerojax._core.frozen.gather`), over the leaves it holds as they are (those
  outside the chunks that stay whole)."""
  tree = _without_keys(params)
  keys = _chunk_keys(params)
  for c, key in keys.items():
    _layer_tree(layout, config, c, params[key], params.get(slot_key(c)),
                regather, tree)
  depth = len(layout.stack_prefix(next(iter(keys))))
  n, after = jax.lax.axis_size(config.axis_name), _AFTER.get()
  for i, key in _chunk_keys(params, FROZEN_KEY).items():
    info, shard = layout.leaves[i], params[key]
    # inside a scan, a stacked weight's shard is one layer's
    dim = (frozen.split_dim(info, config, n)
           - (len(info.shape) - jnp.ndim(shard)))
    if scale_key(i) in params:   # an int8 matrix: values and absmax
      shard = (shard, params[scale_key(i)])
    if after is not None:   # as `_full_layer`'s gathers
      shard = jax.tree_util.tree_map(lambda x: tie(x, after), shard)
    node = tree
    for name in info.names[depth:-1]:
      node = node.setdefault(name, {})
    node[info.names[-1]] = frozen.read(shard, info, config, dim,
                                       config.axis_name)
  return tree


def _gather_layer(variables: Any, regather: bool = False) -> Any:
  """The layer's parameters, gathered (`_full_layer`) and cut into leaves.
  With `regather` (a block whose remat has a policy), each chunk's leaves
  come out of one `_gathered_leaves` call, which `_regathering` policies
  never save: whatever else the policy keeps, the backward gathers the
  layer or block again (ZeRO-3's and FSDP2's way) instead of keeping every
  one gathered from the forward pass on (docs/decisions.md, "stage 3
  keeps activations, not gathered blocks")."""
  params = variables.get("params", {})
  keys = _chunk_keys(params)
  if not keys:
    return variables      # init, or a plain (gathered) tree: pass through
  context = _ACTIVE.get()
  if context is None:
    raise RuntimeError("zerojax layer chunks reached a layerwise block outside "
                       "a zerojax train step.")
  layout, config = context[:2]
  return {**variables, "params": _block_tree(layout, config, params, regather)}


def _layer_tree(layout, config, c: int, value, slot, regather: bool,
                tree: Optional[dict] = None) -> dict:
  """Chunk `c`'s leaves of this layer or block, gathered (`_full_layer`,
  waiting for `_AFTER`) into `tree`; with `regather`, out of one
  `_gathered_leaves` call, which `_regathering` policies never save (a
  layer kept in host memory, `slot`, comes over as before)."""
  args = value, slot, _AFTER.get()
  if regather and policy(config).gathers_params and slot is None:
    return layout.place_layer_leaves(
        c, _gathered_leaves(layout, config, c)(*args), tree)
  return layout.layer_tree(c, _full_layer(layout, config, c, *args), tree)


_GATHERED = frozen.GATHERED   # the function `_regathering` knows


def _gathered_leaves(layout, config, c: int):
  """`(value, slot, after) -> chunk c's leaves of this layer`, gathered and
  cut, as one `custom_vjp` (its backward: the pullback of the same, the
  gather's reduce-scatter): one equation whose outputs a remat policy sees
  whole, so that `_regathering` can refuse to save them."""
  def leaves(value, slot, after):
    return layout.unpack_chunk(c, _full_layer(layout, config, c, value, slot,
                                              after),
                               per_layer=bool(layout.chunks[c].layers))
  leaves.__name__ = _GATHERED
  call = jax.custom_vjp(leaves)
  call.defvjp(lambda *args: (call(*args), args),
              lambda args, g: jax.vjp(leaves, *args)[1](g))
  return call


def _regathering(saveable: Callable) -> Callable:
  """A remat policy: `saveable`, except that the leaves `_gathered_leaves`
  makes are never saved (recomputed, that is gathered again, in the
  backward pass)."""
  def policy(prim, *avals, **params):
    if prim.name == "custom_vjp_call":
      info = getattr(getattr(params.get("call_jaxpr"), "jaxpr", None),
                     "debug_info", None)
      if getattr(info, "func_name", None) == _GATHERED:
        return False
    return saveable(prim, *avals, **params)
  return policy


def _full_layer(layout, config, c: int, value, slot, after=None):
  """This layer's (or block's) row of chunk `c`, whole: `value`, its
  shard, gathered (stage 3; from host memory where it has a gradient
  `slot`; waiting for `after`, see `tie`), or at stage 2 `value`, the
  replicated row, whose gradient is reduce-scattered into `slot` as the
  backward pass leaves the layer."""
  wire = collectives.Wire.of(config, layout.chunks[c])
  if not policy(config).gathers_params:
    return collectives.scatter_on_backward(value, slot, config.axis_name, wire)
  if slot is not None:   # kept in host memory: comes over now
    return collectives.gather_from_host(value, slot, config.axis_name, wire)
  return collectives.gather(value if after is None else tie(value, after),
                            config.axis_name, wire)


def gather_per_call(module) -> None:
  """An NNX block that owns chunks, in the model a step rebuilt for its
  trace (never the user's object): made an instance of
  `layerwise(type(module), policy=...)` with `ZeroConfig.remat`'s policy
  (`_POLICIES`), so that it gathers per call as the opt-in does. Blocks
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


def active_layout():
  """`(layout, config)` while a zerojax step traces the user's function,
  else None."""
  context = _ACTIVE.get()
  return None if context is None else context[:2]


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
      chosen = (_POLICIES[context.config.remat]
                if saveable is _FROM_CONFIG else saveable)
      runs = functools.partial(run, method, remat and chosen is not None)
      if not remat:
        return runs(self, *args, **kwargs)
      kept = {} if chosen is None else {"policy": _regathering(chosen)}
      # `nnx.remat` and the unit's `custom_vjp` trace what they are given
      # (arrays, and NNX objects, whose changes are written back); flags
      # are closed over
      arguments = _Arguments(args, kwargs, objects=True)
      if not any(context[0].chunks[c].layers for c in chunks):
        return _nnx_unit(self, stack, runs, arguments, kept)   # per call
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
              kept: dict):
  """One call of a repeated NNX block (or a `per_use` module; at `path`)
  inside a stage-3 step: `run` as a pure function of the block's shards, its other state
  and the call's arrays, rematerialised, in a `custom_vjp` whose gathers
  are tied as a linen block's (see the module docstring; with prefetch,
  chained to the previous block of the same list; `kept`: the remat's
  `policy`, if any). Its other variables' new values are written back; no
  gradient flows through them."""
  chain = _ACTIVE.get()[3]
  graphdef, shards, own = nnx.split(module, Shard, ...)
  # the NNX objects the call is given: their state is threaded as the
  # block's own is, so what the block changes in them (an `nnx.Rngs`'s
  # counts) is written back
  objects = [nnx.split(o) for o in arguments.objects]
  other = (own, tuple(state for _, state in objects))
  values = arguments.arrays
  token_in = None if chain is None else chain.take(path[:-1])
  link = _Link()
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

  spaces, inputs = [], set()

  @jax.custom_vjp
  def tied(shards, other, *values):
    (out, new), token = gathered(lambda *v: call(shards, other, *v), values)
    return out, new, token

  def forward(shards, other, *values):
    spaces[:] = _memory_spaces(shards)
    inputs.update(_avals(values[:-1]))
    (out, vjp_fn, new), token = gathered(
        lambda *v: jax.vjp(lambda s, *a: rematted(s, other, *a), shards, *v,
                           has_aux=True), values)
    return (out, new, token), vjp_fn

  def backward(vjp_fn, cotangents):
    cotangent, _, token_cotangent = cotangents
    grads = _regathered_backward(vjp_fn, (cotangent, token_cotangent), link,
                                 inputs, spaces, token_in)
    return (grads[0], None) + grads[1:]   # no gradient for the state

  tied.defvjp(forward, backward)
  out, new, token = tied(shards, other, *values, token_in)
  nnx.update(module, new[0])
  for o, state in zip(arguments.objects, new[1]):
    nnx.update(o, state)
  if chain is not None:
    chain.put(path[:-1], token, link)
  return out


def _public_methods(block: type, base: type) -> list:
  """The public methods the block's own classes (those below `base`, Flax's
  module class) define, such as `Embed.attend` (and linen's `setup`, where
  a module such as `nn.Embed` makes its parameters: mapped too, the
  parameters it reads are the gathered ones)."""
  names = []
  for cls in block.__mro__:
    if cls is base or cls is object or cls in _NNX_OBJECTS:
      break
    names += [name for name, value in vars(cls).items()
              if not name.startswith("_") and inspect.isfunction(value)
              and name not in names]
  return names


def _write(values: dict, tree: dict) -> None:
  """`tree`'s leaves written over `values` (an NNX pure dict: list indices
  are ints there, strings in a layout's names)."""
  for key, sub in tree.items():
    k = key if key in values else int(key)
    if isinstance(sub, dict):
      _write(values[k], sub)
    else:
      values[k] = sub


# NNX objects (`nnx.Rngs`, modules) a block may be called with: the base
# class is `nnx.Pytree` in flax 0.12, `nnx.Object` before
_NNX_OBJECTS = tuple(t for t in (getattr(nnx, "Pytree", None),
                                 getattr(nnx, "Object", None)) if t is not None)


class _Arguments:
  """A block call's arguments split into arrays, which `nn.remat` and
  `custom_vjp` trace, and the rest (flags such as `deterministic=True`,
  `None`), which they must not: closed over, as `static_argnums` would.
  With `objects` (NNX), NNX objects (an `nnx.Rngs` handed to the call, as
  Flax's NNX examples do) are a third kind, `objects`: their state goes
  in and comes out of the traced call (`_nnx_unit`)."""

  def __init__(self, args: tuple, kwargs: dict, objects: bool = False):
    self.count, self.names = len(args), tuple(kwargs)
    self.values = (*args, *kwargs.values())
    self.kinds = tuple(
        "object" if objects and isinstance(v, _NNX_OBJECTS) else
        "array" if any(isinstance(x, (jax.Array, np.ndarray))
                       for x in jax.tree_util.tree_leaves(v)) else "static"
        for v in self.values)
    self.arrays = self._of("array")
    self.objects = self._of("object")

  def _of(self, kind: str) -> tuple:
    return tuple(v for v, k in zip(self.values, self.kinds) if k == kind)

  @property
  def any_static(self) -> bool:
    return "static" in self.kinds

  def call(self, method, module, arrays, objects=()):
    """`method(module, *args, **kwargs)` with `arrays` (and `objects`) in
    the arrays' (and objects') places."""
    given = {"array": iter(arrays), "object": iter(objects)}
    values = [v if k == "static" else next(given[k])
              for v, k in zip(self.values, self.kinds)]
    return method(module, *values[:self.count],
                  **dict(zip(self.names, values[self.count:])))


def _opted(method: Callable) -> Callable:
  """`method` of a `layerwise` class, which `intercept` lets through."""
  @functools.wraps(method)
  def call(self, *args, **kwargs):
    token = _OPTED.set(True)
    try:
      return method(self, *args, **kwargs)
    finally:
      _OPTED.reset(token)
  return call


def _unit_call(module, arguments: _Arguments, call: Callable):
  """One call of an unrolled linen block inside a stage-3 step (the
  explicit `layerwise` class's and the automatic path's, `intercept`):
  `call(module, *arrays)`, the gathered, rematerialised block, as a
  `custom_vjp` whose residuals are the block's shards and inputs, its
  gathers tied to the block's input (forward) and to the output's
  cotangent (backward), or with prefetch to the previous block's input and
  the next block's output cotangent; see the module docstring."""
  values = arguments.arrays
  chain = _ACTIVE.get().chain
  # the forward gather waits for `token_in`: from the previous block's
  # input when prefetching (`_Chain`), else from this block's own
  token_in = None if chain is None else chain.take(module.parent)
  link = _Link()
  if token_in is None and _anchor(values) is not None:
    token_in = jax.lax.stop_gradient(_token(values))

  def gathered(run, module, values):
    """`run` with the block's gathers waiting for `values[-1]`, and the
    token (this block's input) the next block's gathers may wait for."""
    token = _AFTER.set(values[-1])
    try:
      return run(module, *values[:-1]), _token(values[:-1])
    finally:
      _AFTER.reset(token)

  def tied(module, *values):
    """The primal (an evaluation, no backward pass), as the forward."""
    return gathered(call, module, values)

  spaces = []   # per variable of the block: its memory space
  inputs = set()   # (shape, dtype) of the block's array arguments

  def forward(module, *values):
    spaces[:] = _memory_spaces(module.variables)
    inputs.update(_avals(values[:-1]))
    (out, vjp_fn), token = gathered(
        lambda m, *v: nn.vjp(call, m, *v), module, values)
    return (out, token), vjp_fn

  def backward(vjp_fn, cotangents):
    return _regathered_backward(vjp_fn, cotangents, link, inputs, spaces,
                                token_in)

  out, token = nn.custom_vjp(tied, forward_fn=forward,
                             backward_fn=backward)(module, *values, token_in)
  if chain is not None:
    chain.put(module.parent, token, link)
  return out


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
      ctx.refused[path] = "its parameters are attributes its setup makes"
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


def _holds_layer(layout, chunks, path: tuple, params) -> bool:
  """Whether `params` (a module's, on an ordinary tree) are one layer (or
  the whole) of the block that owns `chunks`: every leaf at its path, of
  its shape without the layer axis of a stacked chunk (the module called
  inside the scan, not the scan)."""
  depth = len(path)
  for c in chunks:
    for i in layout.chunks[c].leaves:
      leaf = layout.leaves[i]
      node = params
      for name in leaf.names[depth:]:
        if not hasattr(node, "get"):
          return False
        node = node.get(name, node.get(int(name)) if name.isdigit() else None)
        if node is None:
          return False
      shape = leaf.shape[1:] if leaf.stacked else leaf.shape
      if tuple(jnp.shape(node)) != tuple(shape):
        return False
  return True


def _owned(layout, path: tuple) -> list:
  """The chunks of the stack or block at `path`."""
  return [c for c, chunk in enumerate(layout.chunks)
          if chunk.stack is not None and layout.stack_prefix(c) == path]


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


# Primitives whose results `keep_activations` does not keep: elementwise
# arithmetic and layout changes, which XLA fuses into the kernels that read
# them (recomputing them costs no pass of their own)
_RECOMPUTED = frozenset({
    "abs", "add", "and", "atan2", "broadcast_in_dim", "cbrt", "ceil", "clamp",
    "concatenate", "conj", "convert_element_type", "copy", "cos",
    "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2", "expand_dims",
    "expm1", "floor", "ge", "gt", "imag", "integer_pow", "iota", "is_finite",
    "le", "log", "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg",
    "nextafter", "not", "or", "pad", "pow", "real", "reduce_precision", "rem",
    "reshape", "rev", "round", "rsqrt", "select_n", "sign", "sin", "slice",
    "split", "sqrt", "square", "squeeze", "stop_gradient", "sub", "tan",
    "tanh", "transpose", "xor"})


def keep_activations(prim, *_, **__) -> bool:
  """The remat policy of `Blocks(remat="none")` (activations kept): every
  result is saved for the backward pass but those of elementwise and layout
  primitives (`_RECOMPUTED`), which the backward computes again inside its
  own fused kernels. So the block's matmul, reduction and attention outputs
  are kept and none of its FLOPs are spent twice, while neither a cast,
  transpose or broadcast of the gathered parameters (a copy of the block,
  which `everything_saveable` keeps) nor a chain of elementwise results
  that XLA would fuse away is held from the forward pass to the backward."""
  return prim.name not in _RECOMPUTED


# `ZeroConfig.remat`: the remat policy of each choice (None: nothing saved
# but the block's input); the gathered parameters are never saved
# (`_regathering`)
_POLICIES = {"none": keep_activations,
             "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
             "full": None}


def _auto_call(module, method: str, args: tuple, kwargs: dict,
               stacked: bool):
  """`module.method(*args, **kwargs)` of a block that holds chunk shards,
  as the same method of `layerwise(type(module), policy=...)` would run
  with `ZeroConfig.remat`'s policy (`_POLICIES`): gathered
  (`_gather_layer`), rematerialised under that policy, and for an unrolled
  block tied and chained (`_unit_call`). Other public methods are gathered
  only."""
  arguments = _Arguments(args, kwargs)
  policy = _POLICIES[_ACTIVE.get().config.remat]
  mapped = nn.map_variables(
      _bypassing(method), "params",
      trans_in_fn=functools.partial(_gather_layer,
                                    regather=policy is not None))
  if method != "__call__":
    return mapped(module, *args, **kwargs)
  kwargs = {} if policy is None else {"policy": _regathering(policy)}
  rematted = lambda **kw: nn.remat(
      lambda m, *arrays: arguments.call(mapped, m, arrays), **kwargs, **kw)
  if stacked:
    return rematted()(module, *arguments.arrays)
  return _unit_call(module, arguments, rematted(prevent_cse=False))


def layerwise(block: type, *, remat: bool = True, **remat_kwargs) -> type:
  """Wraps a Flax block class so zerojax gathers its parameters per layer.

  Args:
    block: a `flax.linen.Module` or `nnx.Module` class, either scanned
      (`nn.scan` with `variable_axes={"params": 0}`; `nnx.scan` over an
      `nnx.vmap` stack) under a name listed in `ZeroConfig.stacked`, or
      called once per layer under names `<base>_<i>` or, in a list
      (`nnx.List`), `<i>` (unrolled; found by
      `zerojax._core.chunking.repeated_blocks`). Arguments holding no array
      (`deterministic=True`, `None`) are static, not traced. Stage 3
      gathers it per layer (or block); stage 2 reduce-scatters a scanned
      block's gradient per layer; other stages call it as it is.
    remat: rematerialise the block (and its gather) in the backward pass; this
      is what keeps gathered parameters from piling up over depth.
    **remat_kwargs: passed to `nn.remat` (e.g. `prevent_cse`, `policy`).
      An unrolled block's calls inside a stage-3 step always rematerialise
      with `prevent_cse=False`: ties keep them apart instead (see `unit`).
      At stage 3 a `policy` never keeps a layer's or block's gathered
      parameters (`_regathering`): the backward gathers it again. A policy
      that saves what it derives from them (`everything_saveable` keeps
      their casts and transposes) keeps copies of them all the same;
      `keep_activations` keeps the activations and none of those. NNX
      blocks take `policy` (and `remat`) only.

  Returns:
    A module class with the block's constructor and call signature.
  """
  if isinstance(block, type) and issubclass(block, nnx.Module):
    if set(remat_kwargs) - {"policy"}:
      raise TypeError(f"layerwise(NNX block, {sorted(remat_kwargs)}): NNX "
                      "blocks take remat= and policy= only.")
    return _nnx_layerwise(block, remat, remat_kwargs.get("policy"))
  # every public method gathers (a tied `nn.Embed`'s `attend` too); only
  # `__call__` is rematerialised and tied
  regather = remat and "policy" in remat_kwargs
  if regather:
    remat_kwargs = {**remat_kwargs,
                    "policy": _regathering(remat_kwargs["policy"])}
  mapped = nn.map_variables(
      block, "params", init=True,
      trans_in_fn=functools.partial(_gather_layer, regather=regather),
      methods=["__call__", *_public_methods(block, nn.Module)])
  wrapped = nn.remat(mapped, **remat_kwargs) if remat else mapped
  # An unrolled block's call: its ties already keep the re-gather and the
  # recomputation apart from the forward's, and JAX's CSE guard (an
  # optimization barrier over the saved values and the output cotangent)
  # would hold the re-gather back until the cotangent, which prefetch must
  # not wait for (XLA's GPU backend keeps barriers; its CPU backend drops
  # them).
  unit = nn.remat(mapped, **{**remat_kwargs, "prevent_cse": False})

  class Layerwise(wrapped):
    """Per call of an unrolled block: a `custom_vjp` around the gathered,
    rematerialised block, its gathers tied to the block's input (forward)
    and to the output's cotangent (backward), or with prefetch to the
    previous block's input and the next block's output cotangent; see the
    module docstring. Inside a zerojax step every call says where it sits
    (`active`)."""

    @_opted
    def __call__(self, *args, **kwargs):
      context = _ACTIVE.get()
      if context is not None and not self.is_initializing():
        context.called.add(tuple(self.scope.path))
      arguments = _Arguments(args, kwargs)
      if not (remat and self._is_unit()):
        if remat and arguments.any_static:
          return self._remat(arguments, remat_kwargs)(self, *arguments.arrays)
        return super().__call__(*args, **kwargs)
      call = (self._remat(arguments, {**remat_kwargs, "prevent_cse": False})
              if arguments.any_static else
              lambda module, *values: arguments.call(unit.__call__, module,
                                                     values))
      return _unit_call(self, arguments, call)

    @staticmethod
    def _remat(arguments: _Arguments, kwargs: dict):
      """`nn.remat` of the gathered block, as a function of the module and
      the call's arrays, the other arguments closed over (a user's
      `static_argnums` counted them; they are static here already)."""
      kwargs = {k: v for k, v in kwargs.items() if k != "static_argnums"}
      return nn.remat(
          lambda module, *arrays: arguments.call(mapped.__call__, module,
                                                 arrays), **kwargs)

    def _is_unit(self) -> bool:
      """Whether this call holds the shards of an unrolled block's chunks
      (inside a zerojax step; not at init, nor in a scan)."""
      context = _ACTIVE.get()
      if context is None or self.is_initializing():
        return False
      chunks = _chunk_keys(self.variables.get("params", {}))
      return bool(chunks) and not any(context[0].chunks[c].layers
                                      for c in chunks)

  setattr(Layerwise, GATHERS_ITSELF, True)
  for name in _public_methods(block, nn.Module):   # `attend`, say
    if name != "setup":
      setattr(Layerwise, name, _opted(getattr(wrapped, name)))
  # Flax names unnamed submodules after their class: wrapping a block keeps
  # its parameter paths (`Block_0`, not `LayerwiseBlock_0`)
  Layerwise.__name__ = Layerwise.__qualname__ = block.__name__
  return Layerwise


def __getattr__(name: str):
  """`BlockedEmbed` and `NnxBlockedEmbed`: public here, defined in
  `zerojax.nn._embed`, which is built on this module's gathers (so imported
  when first asked for, not by this module)."""
  if name in ("BlockedEmbed", "NnxBlockedEmbed"):
    from zerojax.nn import _embed as embed
    return getattr(embed, name)
  raise AttributeError(f"module 'zerojax.nn' has no attribute {name!r}")
