"""The gathers of per-block gathering (`zerojax.nn`): while a step traces
the user's function (`active`), a block's chunk shards gathered into its
parameter tree (`_gather_layer`, `_full_layer`), each gather tied to data
it must wait for (`tie`, `_Chain` for prefetch), the backward's re-gather
(`_regathered_backward`, `_regathering`), and the names of the chunk
variables a step puts beside a model's own (`chunk_key`, ...)."""
from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from flax.core.tracers import current_trace

from zerojax._comm import collectives
from zerojax._core import frozen
from zerojax._core.offload import DEVICE_SPACE, HOST_SPACE
from zerojax._options.groups import remat_of
from zerojax._options.policy import policy


CHUNK_KEY = "__zerojax_chunk_"
SLOT_KEY = "__zerojax_slot_"   # a gradient slot (offload_params; stage 2)
FROZEN_KEY = "__zerojax_frozen_"   # a frozen weight's shard (`_core.frozen`)
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
  beside: frozenset   # module paths beside the blocks (`zerojax._model.peruse`)
  kinds: set     # class names of the blocks gathered per call


def block_remat(context: _Context, module) -> str:
  """`ZeroConfig.remat` of `module`'s block (per class: `groups.remat_of`
  of its class's `__name__`), the name recorded in `context.kinds`."""
  kind = type(module).__name__
  context.kinds.add(kind)
  return remat_of(context.config.remat, kind)


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


def stored(tree):
  """`tree`'s floating arrays, bit for bit, each computed once and kept in
  memory: an unrolled block's output ([Note: a block's output stored]).
  Differentiates as the identity."""
  return jax.tree_util.tree_map(
      lambda x: _stored(x) if (hasattr(x, "dtype") and jnp.ndim(x) and
                               jnp.issubdtype(x.dtype, jnp.floating)) else x,
      tree)


# [Note: a block's output stored]
# XLA fuses a cheap elementwise producer into each of its consumers, and so
# may compute a value the backward pass reads again there, from the
# producer's operands. A post-LayerNorm block's output (BERT's) is its
# norm's scale and bias applied to saved statistics, read by the next
# block's forward and saved as its input: recomputed for the backward, it
# reads slices of the whole gathered block, which then stays alive from
# the forward pass to the backward, a gathered block per layer
# (docs/decisions.md, 2026-12-03). So each unrolled block's output is its
# bits divided (an integer division) by a one XLA cannot see is one: a
# division is among the operations XLA does not compute twice to fuse it,
# so the output is computed once and stored, and the backward reads it.
@jax.custom_jvp
def _stored(x):
  bits = jnp.dtype(f"uint{8 * jnp.dtype(x.dtype).itemsize}")
  u = jax.lax.bitcast_convert_type(x, bits)
  one = (jnp.ravel(u)[0] & 1) | 1
  return jax.lax.bitcast_convert_type(u // one, x.dtype)


@_stored.defjvp
def _stored_jvp(primals, tangents):
  return _stored(*primals), tangents[0]


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
  backward to start); `overlap`: the devices run collectives beside
  compute (`_Chain.overlap`, see `_regathered_backward`)."""

  def __init__(self, overlap: bool = False):
    self.overlap = overlap
    self.consumed = False


class _Chain:
  """Prefetch (`ZeroConfig.prefetch`) over one traced model call: the token
  of the last unrolled block called, which the next block's forward gather
  waits for. Only blocks called from the same module method in the same JAX
  trace are chained (a block under another transformation starts afresh)."""

  def __init__(self, overlap: bool = False):
    self.last = None   # (parent, trace, token, link)
    # the devices run collectives beside compute (a GPU): what the
    # backward ties is then less (`_regathered_backward`)
    self.overlap = overlap

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


# the smallest saved activation `offloaded` moves to host: below it a
# copy's fixed cost (some microseconds) outweighs its bytes' transfer
OFFLOAD_MIN_BYTES = 1 << 18


def offloaded(vjp_fn, kept, moved: list, ordered: bool = False):
  """`vjp_fn` (a block's pullback) with the activations its block saved
  moved to pinned host memory: its residuals that are none of `kept` (the
  block's inputs and shards, by identity), of `OFFLOAD_MIN_BYTES` or more;
  `moved` is set to whether each residual was (its shape, where it was
  moved as two halves). An unrolled block's `remat="offload"`;
  `_regathered_backward` brings each back one block ahead of its backward.

  Returns `(vjp_fn, done)`. With `ordered` (collectives run beside compute:
  a GPU), the copies run in a loop and `done`, a scalar the loop computes,
  is what the next block's forward must wait for ([Note: activations copied
  to host in a loop]); else `done` is None and the copies' place is XLA's.
  """
  kept = {id(x) for x in jax.tree_util.tree_leaves(kept)}
  leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
  moved[:] = [id(r) not in kept and hasattr(r, "dtype") and
              jnp.size(r) * jnp.dtype(r.dtype).itemsize >= OFFLOAD_MIN_BYTES
              for r in leaves]
  done = None
  if ordered:   # (an array of odd size is copied alone, as without)
    halved = [i for i, m in enumerate(moved)
              if m and jnp.size(leaves[i]) % 2 == 0]
    if halved:
      host, done = _copied_in_a_loop([leaves[i] for i in halved])
      leaves = list(leaves)
      for i, h in zip(halved, host):
        moved[i], leaves[i] = jnp.shape(leaves[i]), h
  return jax.tree_util.tree_unflatten(treedef, [
      r if m is not True else jax.device_put(r, HOST_SPACE)
      for r, m in zip(leaves, moved)]), done


# [Note: activations copied to host in a loop]
# XLA's GPU scheduler issues an asynchronous copy only as far ahead of its
# first reader as the copy takes. A copy to host memory is first read by
# the copy back in the backward pass, so every block's device-to-host copy
# was issued after the last block's forward and every block's activations
# stayed on the device until then, even in a program that does not fit
# the card (docs/decisions.md, 2026-12-04, second session). A loop is the
# one boundary it does not schedule across: the copies of a block's
# activations run inside a `lax.scan` over their two halves (a loop of one
# trip XLA would inline), which also sums the first element of each half,
# and the block's output is tied to that sum (`after_copies`), so the next
# block's forward starts after the copies and each block's device buffers
# are freed as its forward ends. In the backward pass XLA also leaves a
# block's weight-gradient matmuls (and what they recompute) for the end,
# holding every block's activations, copied back, until then; so the
# cotangents a block's backward passes on are tied to its shard gradients
# (`_regathered_backward`). The price is the copies' time, which no
# compute covers (a loop runs alone on the compute stream), and each
# block's gradient reduce-scatter done before the previous block's
# backward: small beside the backward of a block whose activations are
# worth moving. Only where collectives run beside compute (a GPU): on CPU
# memory kinds lower to nothing and the program is left as it was.
def after_copies(out, done):
  """`out` (a block's outputs, or cotangents), each array tied to `done`
  (`offloaded`'s): what reads it waits for what computed `done`; `out`
  if `done` is None."""
  if done is None:
    return out
  return jax.tree_util.tree_map(
      lambda x: tie(x, done) if _has_values(x) else x, out)


def _has_values(x) -> bool:
  """Whether `x` is a non-empty array with values (not a float0 cotangent,
  an integer input's)."""
  return (hasattr(x, "dtype") and x.dtype != jax.dtypes.float0 and
          bool(jnp.size(x)))


def _sum_of_firsts(tree):
  """A float32 scalar read from every array of `tree` (its first element)."""
  return sum(jnp.ravel(x)[0].astype(jnp.float32)
             for x in jax.tree_util.tree_leaves(tree) if _has_values(x))


def _copied_in_a_loop(arrays: list) -> tuple:
  """`(arrays in host memory, each as its two halves; a float32 scalar
  computed inside the loop that copies them)`."""
  def copy(done, halves):
    return (done + _sum_of_firsts(halves),
            tuple(jax.device_put(h, HOST_SPACE) for h in halves))
  done, host = jax.lax.scan(copy, jnp.float32(0),
                            tuple(jnp.reshape(a, (2, -1)) for a in arrays))
  return host, done


def _regathered_backward(vjp_fn, cotangents, link: _Link, inputs: set,
                         shards: set, spaces: list, token_in,
                         moved: list = ()) -> tuple:
  """The backward of an unrolled block's call (linen or NNX): `vjp_fn`
  (of the rematerialised, gathered block; its residuals are the block's
  shards and inputs) applied to the output's cotangent, with the re-gather
  waiting for that cotangent, and the cotangent of the previous block's
  token appended. `cotangents` is `(output's, token's)`, `inputs` and
  `shards` the `(shape, dtype)`s of the block's array arguments and of its
  variables (shards), `spaces` the memory space of each shard (the first
  of `vjp_fn`'s results). The residuals `moved` marks are activations in
  host memory (`offloaded`): each comes back to the device as the
  re-gather does, waiting for the next block's backward to start, so at
  most two blocks' activations are on the device at a time."""
  cotangent, token_cotangent = cotangents
  after = _anchor(cotangent)
  if after is not None:   # the re-gathers wait for the cotangent...
    # ...of the next block's output when it prefetches this block: its
    # token's cotangent (`_Link`), which that block's backward gives as it
    # starts. The block's saved inputs still wait for its own, so only the
    # re-gather (shards, token) starts early.
    early = token_cotangent if link.consumed else after
    # Where collectives run beside compute (`link.overlap`, a GPU; see
    # docs/stage3.md, "The program 8 GPUs run"): the last block of a
    # prefetch chain, whose re-gather has no next block's backward to run
    # beside, keeps its forward gather (its shards untied, as FSDP2 keeps
    # the last block); and saved activations wait behind an optimization
    # barrier, since before a cuBLAS matmul a bit tie is a kernel copying
    # the activation. On CPU everything is bit-tied as before.
    last = link.overlap and not link.consumed

    def back(r, m):   # an activation `offloaded` moved
      if link.overlap:   # the copy back starts after `early`
        r = jax.lax.optimization_barrier((r, early))[0]
      r = jax.device_put(r, DEVICE_SPACE)
      if m is not True:   # moved as its two halves
        r = jnp.reshape(r, m)
      return r if link.overlap else tie(r, early)

    def tied(r):
      kind = _avals((r,))
      if _anchor(r) is None:
        return r
      if kind <= inputs:
        return tie(r, after)
      if link.overlap and not kind <= shards:
        return jax.lax.optimization_barrier((r, after))[0]
      return r if last else tie(r, early)
    leaves, treedef = jax.tree_util.tree_flatten(vjp_fn)
    moved = moved or [False] * len(leaves)
    vjp_fn = jax.tree_util.tree_unflatten(treedef, [
        back(r, m) if m else tied(r) for r, m in zip(leaves, moved)])
  grads = vjp_fn(cotangent)
  if link.overlap and any(moved):   # the previous block's backward waits
    # for this one's weight gradients ([Note: activations copied to host
    # in a loop])
    grads = (grads[0],) + tuple(after_copies(g, _sum_of_firsts(grads[0]))
                                for g in grads[1:])
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

def active_layout():
  """`(layout, config)` while a zerojax step traces the user's function,
  else None."""
  context = _ACTIVE.get()
  return None if context is None else context[:2]


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
