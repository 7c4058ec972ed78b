"""The user's function called on a state's chunks (`ModelCall`), for the
train step's gradients (`grads`) and for evaluation: the chunks cut into
the user's tree as the stage's forward reads them, the front end adapting
the function, the per-block gathering switched on (`zerojax._model.linen.active`),
and, in the step's hearing trace (an ordinary tree), which blocks read
parameters from outside their own call (`_read_outside`, a backward walk
over the jaxpr: `_live_inputs`)."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util

from zerojax._comm import collectives
from zerojax._core import frozen
from zerojax._core import outputs
from zerojax._model import peruse as peruse
from zerojax._model import gather
from zerojax._model import linen as model_linen
from zerojax._options.config import collectives_overlap, prefetches
from zerojax._options.policy import Forward, Reduction, StagePolicy
from zerojax._options.groups import remat_kinds


class ModelCall:
  """Inside `shard_map`: the user's function on the parameter tree built as
  `StagePolicy.forward` says (`outputs`; `eval_step` uses it too), the
  scaled loss of one micro-batch as a function of what is differentiated
  (`differentiated()`, `__call__`), and the model's opt-in (`opted_in`)."""

  def __init__(self, loss_fn, has_aux, mutable, state, pol, params_in, rest,
               scale, host, with_rng, weighted=False):
    self.loss_fn, self.has_aux, self.pol = loss_fn, has_aux, pol
    self.weighted = weighted
    self.mutable = mutable
    self.cfg, self.layout = state.config, state.layout
    self.params_in, self.rest, self.scale = params_in, rest, scale
    # per leaf outside the chunks, the dim a frozen weight's shard is split
    # on (`zerojax._core.frozen`), or None: held whole
    self.split = frozen.split_dims(state.layout, state.config, state.mesh)
    self.host, self.with_rng = host, with_rng
    # a slot holds the gradient of a shard that is not differentiated
    self.slot_dtypes = [np.dtype(m.dtype) for m in state.master]
    self.prefetch = prefetches(state.config, state.mesh)
    self.overlap = collectives_overlap(state.mesh)
    # {chunk beside the blocks: why it is held for the step}, by `opted_in`
    self.held_beside = {}

  def differentiated(self) -> tuple:
    """Per chunk, what the gradient is taken with respect to: the chunk (or
    shard) itself, or a zero slot whose gradient is the reduce-scattered
    chunk gradient (SCATTER_PER_MICRO; shards in host memory)."""
    cfg = self.cfg
    if self.pol.reduction is Reduction.SCATTER_PER_MICRO:
      n = jax.lax.axis_size(cfg.axis_name)
      return tuple(jnp.zeros(_shard_shape(c.shape, n), cfg.reduce_dtype)
                   for c in self.layout.chunks)
    return tuple(jnp.zeros(p.shape, self.slot_dtypes[c]) if c in self.host
                 else p for c, p in enumerate(self.params_in))

  def opted_in(self, diff, batch, dev_rng, fields) -> frozenset:
    """Chunks a block gathers itself at its calls (layer stacks, unrolled
    blocks, `per_use` modules): one abstract trace on the ordinary tree
    hears which blocks are called, each saying its module path: a
    `zerojax.nn.layerwise` block, or at stage 3 any linen block that owns
    chunks (`zerojax._model.linen.intercept`). A block heard there whose parameters
    are also read outside its call (a tied weight another module reads, a
    penalty in the loss) is held for the step instead (`_read_outside`).
    An error in the trace is the model's own."""
    layout = self.layout
    own = {c: layout.stack_prefix(c) for c, ch in enumerate(layout.chunks)
           if self.pol.layer_hooks and ch.stack is not None}
    if not own:
      return frozenset()
    called, heard, refused = set(), set(), {}
    traced = jax.make_jaxpr(lambda d: self.outputs(
        d, batch, dev_rng, fields, called=called, hearing=(heard, refused)))(
            diff)
    layerwise = frozenset(c for c, path in own.items() if path in called)
    read = _read_outside(traced, {c for c in layerwise if own[c] in heard})
    if self.pol.gathers_params and self.cfg.reshard_after_forward:
      # the modules beside the blocks are held unless chosen per use: the
      # step says why where it chooses (`zerojax._model.peruse`)
      quiet = peruse.chunks(layout, self.cfg)
      self.held_beside = {c: _why_held(c in read, refused.get(own[c]))
                          for c in quiet if c not in layerwise - read}
      _say_whole(layout, self.cfg,
                 {c: p for c, p in own.items() if c not in quiet},
                 layerwise - read - quiet, read - quiet,
                 {c: refused[p] for c, p in own.items()
                  if p in refused and c not in quiet})
    return layerwise - read

  def outputs(self, diff, batch, rng, fields, layerwise=frozenset(),
              called=None, hearing=None):
    """What the user's function returns on this device's `batch`; with
    `hearing`, `(heard, refused)` of the step's hearing trace
    (`zerojax._model.linen.active`)."""
    params = self._tree(diff, layerwise)
    heard, refused = (None, None) if hearing is None else hearing
    beside = frozenset(self.layout.stack_prefix(c)
                       for c in peruse.chunks(self.layout, self.cfg))
    kinds = set()   # the classes of the blocks gathered per call
    auto = self.pol.gathers_params and self.cfg.reshard_after_forward
    with model_linen.active(self.layout, self.cfg, called, self.prefetch,
                        overlap=self.overlap, auto=auto,
                        heard=heard, refused=refused, beside=beside,
                        kinds=kinds):
      out = (self.loss_fn(params, batch, rng, **fields) if self.with_rng
             else self.loss_fn(params, batch, **fields))
    if auto and hearing is None:
      _check_remat_kinds(self.cfg.remat, kinds)
      seen = _SEEN.get()
      if seen is not None:
        seen.update(kinds)
    return out

  def __call__(self, diff, micro_batch, micro_rng, fields,
               layerwise=frozenset(), called=None):
    """`(loss * scale, (loss, aux, updates))` of one micro-batch; weighted,
    `(sum * scale, ((sum, weight), aux, updates))`."""
    out = self.outputs(diff, micro_batch, micro_rng, fields, layerwise, called)
    if self.mutable:
      out, updates = outputs.updates(out, self.has_aux, fields)
    else:
      updates = {}
    loss, aux = outputs.loss_and_aux(out, self.has_aux,
                                     outputs.batch_size(micro_batch),
                                     self.weighted)
    if self.weighted and self.cfg.loss_scale is not None:
      # see [Note: a loss-scaled weighted loss]
      return loss[0] * (self.scale / weight_normalizer(loss[1])), (
          loss, aux, updates)
    if self.weighted:
      return loss[0] * self.scale, (loss, aux, updates)
    loss = jnp.asarray(loss, jnp.float32)
    return loss * self.scale, (loss, aux, updates)

  def _tree(self, diff, layerwise):
    """The user's parameter tree, as `StagePolicy.forward` says."""
    cfg, layout, ax = self.cfg, self.layout, self.cfg.axis_name
    wire = [collectives.Wire.of(cfg, chunk) for chunk in layout.chunks]
    leaves = {}   # chunk -> its leaves, cut as it was gathered
    if self.pol.forward is Forward.GATHERED:
      chunks = [collectives.gather_from_host(self.params_in[c], s, ax, wire[c])
                if c in self.host and c not in layerwise else None
                for c, s in enumerate(diff)]
      leaves = {c: collectives.gather_leaves(layout, c, s, ax, wire[c])
                for c, s in enumerate(diff)
                if c not in layerwise and c not in self.host}
    elif self.pol.reduction is Reduction.SCATTER_PER_MICRO:
      # a wrapped stack's block reduce-scatters each layer's gradient itself
      chunks = [p.astype(cfg.compute_dtype) if c in layerwise else
                collectives.scatter_on_backward(
                    p.astype(cfg.compute_dtype), slot, ax, wire[c])
                for c, (p, slot) in enumerate(zip(self.params_in, diff))]
    else:
      chunks = [p.astype(cfg.compute_dtype) for p in diff]
    blocks = {layout.stack_prefix(c) for c in layerwise}
    # frozen weights under a block gathered per call go to the block as
    # shards; the others are gathered for the step
    in_block = {j for j, (i, dim) in enumerate(zip(layout.rest_indices,
                                                   self.split))
                if dim is not None and any(
                    layout.leaves[i].names[:len(b)] == b for b in blocks)}
    rest = tuple(x if j in in_block else
                 frozen.read(x, layout.leaves[i], cfg, dim, ax)
                 for j, (i, x, dim) in enumerate(zip(
                     layout.rest_indices, self.rest, self.split)))
    if not layerwise:
      return layout.merge(chunks, rest, dtype=None, leaves=leaves)
    own = {}   # per wrapped chunk, what its block reads (`nn._full_layer`)
    for c in layerwise:
      if not self.pol.gathers_params:   # the replicated chunk, and the slot
        own[c] = (chunks[c], diff[c])   # its gradient is scattered into
      elif c in self.host:   # shards in host memory, and their gradient slot
        own[c] = (self.params_in[c], diff[c])
      else:   # the shards, differentiated
        own[c] = (diff[c], None)
    return _with_layer_params(layout, chunks, leaves, rest, own,
                              {layout.rest_indices[j] for j in in_block})


# `seen_classes`'s set while a trace runs, else None
_SEEN = contextvars.ContextVar("zerojax_seen_classes", default=None)


@contextlib.contextmanager
def seen_classes():
  """A set that gets the class names of the blocks stage 3 gathers per call
  in the step traces run meanwhile (`step.block_classes`: what
  `Blocks(remat=)` may name per class)."""
  classes = set()
  token = _SEEN.set(classes)
  try:
    yield classes
  finally:
    _SEEN.reset(token)


def _check_remat_kinds(remat, kinds: set) -> None:
  """`Blocks.remat` per block class names only classes of blocks the step
  gathered per call (`kinds`)."""
  unknown = sorted(remat_kinds(remat) - kinds)
  if unknown:
    raise ValueError(
        f"Blocks(remat={dict(remat)!r}) names {unknown}, but the blocks "
        f"stage 3 gathers per call in this model are of the classes "
        f"{sorted(kinds)}: name those (the class's __name__), or give one "
        "remat for every block (e.g. remat='dots').")


def _why_held(read: bool, refused: Optional[str]) -> str:
  """Why a module beside the blocks cannot be gathered at each use: its
  parameters are `read` outside its call, its call is `refused` (why), or
  it was never called."""
  if read:
    return ("called, and its parameters also read outside its call (a tied "
            "weight, or read by the loss)")
  return refused or ("never called: its parameters are read without a call "
                     "of their module")


def _read_outside(traced, chunks: set) -> frozenset:
  """Of `chunks` (whose blocks ran on zeros in the hearing trace `traced`, a
  closed jaxpr of the chunks' shards), those the outputs still depend on:
  read outside their block's call."""
  if not chunks:
    return frozenset()
  jaxpr = traced.jaxpr
  live = _live_inputs(jaxpr, [True] * len(jaxpr.outvars))
  return frozenset(c for c in chunks if live[c])


# equations whose one sub-jaxpr takes the equation's inputs and gives its
# outputs, in order (`_live_inputs` looks inside them)
_CALLS = ("pjit", "jit", "closed_call", "core_call", "checkpoint", "remat",
          "custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr")


def _live_inputs(jaxpr, live_out: list) -> list:
  """Per input of `jaxpr`, whether the outputs marked in `live_out` depend
  on it: a backward walk, into scans (to the carry's fixpoint) and calls;
  every input of another nested equation, or of one with an effect (a
  callback's; not a collective's axis name), counts where any output does."""
  live = {id(v) for v, used in zip(jaxpr.outvars, live_out) if used}
  for eqn in reversed(jaxpr.eqns):
    outs = [id(v) in live for v in eqn.outvars]
    effects = [e for e in eqn.effects
               if type(e).__name__ != "NamedAxisEffect"]
    if not (effects or any(outs)):
      continue
    ins = [True] * len(eqn.invars) if effects else _live_eqn_inputs(eqn, outs)
    live.update(id(v) for v, used in zip(eqn.invars, ins) if used)
  return [id(v) in live for v in jaxpr.invars]


def _scan_counts(params: dict):
  """`(consts, carry)` of a scan equation: its parameters under jax 0.10,
  its input flat tree's first two parts under jax 0.12; None if neither."""
  if "num_consts" in params:
    return params["num_consts"], params["num_carry"]
  try:
    consts, carry, _ = params["ft_in"].unpack()
    return len(list(consts.vals)), len(list(carry.vals))
  except (KeyError, AttributeError, TypeError, ValueError):
    return None


def _live_eqn_inputs(eqn, outs: list) -> list:
  """`_live_inputs` of one equation with outputs `outs` live."""
  params, name = eqn.params, eqn.primitive.name
  if name == "scan":   # inputs: consts, carry, xs; outputs: carry, ys
    body = params["jaxpr"].jaxpr
    counts = _scan_counts(params)
    if counts is None:
      return [True] * len(eqn.invars)
    consts, carry = counts
    while True:
      ins = _live_inputs(body, outs)
      # a carry read by a live carry is live on the way out too
      more = [o or i for o, i in zip(outs[:carry],
                                     ins[consts:consts + carry])]
      if more == outs[:carry]:
        return ins
      outs = more + outs[carry:]
  sub = params.get("jaxpr", params.get("call_jaxpr"))
  sub = getattr(sub, "jaxpr", sub)
  if (name in _CALLS and sub is not None and len(sub.invars) == len(eqn.invars)
      and len(sub.outvars) == len(eqn.outvars)):
    return _live_inputs(sub, outs)
  return [True] * len(eqn.invars)


def _shard_shape(shape, n):
  return shape[:-1] + (shape[-1] // n,)


def gather_modes(layout, pol: StagePolicy, layerwise: frozenset,
                 beside: frozenset = frozenset()) -> dict:
  """How a step gathers each chunk: `{name: mode}`, the name being the
  stack or block a chunk belongs to ("blocks", "blocks_3") or "chunk <c>
  (<its first leaf>)"; the mode "per layer" (a scanned stack whose block is
  wrapped with `zerojax.nn.layerwise`), "per block" (an unrolled wrapped
  block, gathered at each call), "per use" (a module `beside` the blocks,
  `zerojax._model.peruse`), "whole step" (gathered once for the step's forward
  and backward), or, below stage 3, "replicated" (never gathered;
  "replicated, gradient reduced per layer" for a wrapped stack at stage 2)."""
  out = {}
  for c, chunk in enumerate(layout.chunks):
    first = "/".join(map(str, layout.leaves[chunk.leaves[0]].names))
    name = ("/".join(layout.stack_prefix(c)) if chunk.stack is not None else
            f"chunk {c} ({first})")
    out[name] = ("replicated, gradient reduced per layer"
                 if c in layerwise and not pol.gathers_params else
                 "replicated" if not pol.gathers_params else
                 TOP if chunk.stack is None and all(
                     len(layout.leaves[i].names) == 1 for i in chunk.leaves)
                 else
                 "whole step" if c not in layerwise else
                 "per layer" if chunk.layers else
                 peruse.PER_USE if c in beside else "per block")
  return out


# a stage-3 chunk of the top module's own parameters (Bart's
# `final_logits_bias`): no module call to gather it at
TOP = "whole step (parameters of the top module itself: no call to gather at)"


def _names(layout, chunks) -> str:
  names = list(dict.fromkeys(layout.chunks[c].stack for c in sorted(chunks)))
  return (", ".join(map(repr, names[:3])) + (", ..." if len(names) > 3 else "")
          + ("" if len(names) == 1 else f" ({len(names)} modules)"))


def _say_whole(layout, config, own_gather: dict, layerwise: frozenset,
               read: frozenset, refused: dict) -> None:
  """Says once which blocks (layer stacks, repeated blocks, `per_use`
  modules) stage 3 holds gathered for the whole step instead of gathering
  them at each call, and why: their parameters are read outside the
  block's call (`read`), a block's call cannot be replayed (`refused`,
  `{chunk: why}`), or no call of a module holding them was heard (called
  with another parameter structure, read without a call, or an NNX block
  not wrapped)."""
  for why in dict.fromkeys(refused.values()):
    chunks = [c for c, w in refused.items() if w == why]
    gather.say_once(f"stage 3 holds {_names(layout, chunks)} gathered "
              f"for the whole step: {why}.")
  if read:
    gather.say_once(
        f"stage 3 holds {_names(layout, read)} gathered for the "
        "whole step: its parameters are also read outside its own call (by "
        "another module, or by the loss function), so gathering it per "
        "call would not free them. To gather it per call, read the weights "
        "only inside the module (e.g. a tied head calling the embedding "
        "module's attend).")
  unheard = [c for c in own_gather
             if c not in layerwise and c not in read and c not in refused]
  # a stack found without `stacked=` that no scan called is a module whose
  # leaves share a leading length: held, as it would be anyway
  stacks = [c for c in unheard if layout.chunks[c].layers
            and layout.chunks[c].stack in config.stacked]
  if stacks:
    gather.say_once(
        f"Blocks(stacked={tuple(config.stacked)!r}) at stage 3, but no "
        f"layer of {_names(layout, stacks)} was called as a module inside "
        "its scan, so the step gathers all its layers at once for the "
        "whole step (memory grows with depth).")
  blocks = [c for c in unheard if not layout.chunks[c].layers]
  if blocks:
    gather.say_once(
        f"stage 3 holds {_names(layout, blocks)} gathered for the "
        "whole step: no call of a module holding exactly those parameters "
        "was seen (a block called with another parameter structure, or "
        "parameters used without calling their module).")


def _with_layer_params(layout, chunks, leaves, rest, own: dict,
                       in_block: set = frozenset()):
  """The parameter tree with each wrapped layer-stacked chunk `c` left
  under its stack as `own[c]`: `(value, slot)`, the value (`[layers, ...]`:
  shards, or the replicated chunk) under `gather.chunk_key(c)` and a
  gradient slot, if any, under `gather.slot_key(c)` (see
  `zerojax.nn.layerwise`); and each frozen weight of such a block (leaf
  indices `in_block`, their shards in `rest`) under
  `gather.frozen_key(i)` (an int8 matrix's absmax under
  `gather.scale_key(i)`), beside its block's chunks."""
  tree = layout.merge(chunks, rest, dtype=None, skip=frozenset(own),
                      leaves=leaves)
  skipped = {layout.leaves[i].names for c in own
             for i in layout.chunks[c].leaves}
  skipped |= {layout.leaves[i].names for i in in_block}
  every = traverse_util.flatten_dict(tree)
  # the tree's own keys (an NNX list's indices are ints; names are strings)
  keys = {tuple(map(str, k)): k for k in every}
  flat = {k: v for k, v in every.items() if tuple(map(str, k)) not in skipped}
  for c, (value, slot) in own.items():
    names = layout.leaves[layout.chunks[c].leaves[0]].names
    prefix = keys[names][:len(layout.stack_prefix(c))]
    flat[prefix + (gather.chunk_key(c),)] = value
    if slot is not None:
      flat[prefix + (gather.slot_key(c),)] = slot
  prefixes = {layout.stack_prefix(c): keys[layout.leaves[
      layout.chunks[c].leaves[0]].names][:len(layout.stack_prefix(c))]
              for c in own}
  for i in in_block:
    names = layout.leaves[i].names
    prefix = next(p for b, p in prefixes.items() if names[:len(b)] == b)
    shard = every[keys[names]]
    if isinstance(shard, tuple):   # an int8 matrix: values and absmax
      shard, flat[prefix + (gather.scale_key(i),)] = shard
    flat[prefix + (gather.frozen_key(i),)] = shard
  return traverse_util.unflatten_dict(flat)


# [Note: a loss-scaled weighted loss]
# A weighted loss returns a sum over its micro-batch (`train_step(weighted=
# True)`), which grows with the tokens in it. Under fp16 the loss scale
# multiplies what is differentiated, so a scaled sum overflows the backward
# where the scaled mean of the same tokens would not (128 tokens per device:
# 5 of 12 steps skipped, the scale down at 1024, against none and 32768 for
# the mean). So under a loss scale the sum is divided by its micro-batch's
# weight before the backward (`weight_normalizer`), and each micro-batch's
# gradient multiplied by it again, in the reduce dtype, before the gradients
# are added (`grads._accumulate`): the backward sees the mean's magnitudes,
# the step still divides Σ gradients of the sums by Σ weight. Without a loss
# scale nothing changes (the same program, bit for bit).
def weight_normalizer(weight) -> jax.Array:
  """What a loss-scaled weighted micro-batch's sum is divided by before its
  backward, and its gradient multiplied by after: its weight, 1 where that
  is not positive. See [Note: a loss-scaled weighted loss]."""
  weight = jnp.asarray(weight, jnp.float32)
  return jnp.where(weight > 0, weight, 1.0)
