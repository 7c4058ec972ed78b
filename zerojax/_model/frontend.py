"""Flax front ends: how a user's model object becomes a ZeRO state, and how
the user's loss sees the parameters. The step and the evaluation ask the
state's front end (`ZeroTrainState.frontend`) to adapt the user's function,
never which front end it is.

  linen  a `TrainState`; the loss gets the parameter tree (`LINEN`, the
         identity).
  NNX    an `nnx.Module` (with `tx=`, or `optimizer=` an `nnx.Optimizer`
         whose state and step count are kept) becomes a `TrainState` whose
         params are the module's `wrt` variables (`nnx.Param`) as a plain
         dict, and whose field `nnx_state` holds every other variable
         (BatchStat, RngCount, RNG keys stored as key data). The loss gets an
         `nnx.Module` rebuilt from the gathered parameters and that state;
         whatever it changes in that state is written back as a mutable
         field (`train_step(mutable=...)`: floating values averaged over the
         data axis, others the first device's). RNG keys are folded with the
         device index inside the step, so `nnx.Dropout` draws differently on
         each device, and are stored back unfolded.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import optax
from flax import nnx, struct, traverse_util
from flax.training import train_state

from zerojax._model import gather
from zerojax._model import nnx as model_nnx
from zerojax._options.config import batch_axes
from zerojax._core import outputs


NNX_FIELD = "nnx_state"          # the TrainState field of non-parameter state
FRONTEND_FIELD = "zerojax_frontend"  # the static field holding an `Nnx`


class Linen:
  """The identity: a linen loss already takes the parameter tree."""

  def loss(self, fn: Callable, has_aux: bool, mutable: tuple) -> tuple:
    return fn, mutable

  def keywords(self, mutable: tuple) -> tuple:
    """The fields the user's function takes by keyword."""
    return mutable

  def evaluation(self, fn: Callable, mutable: tuple) -> tuple:
    return fn, mutable


LINEN = Linen()


class NnxTrainState(train_state.TrainState):
  """The `TrainState` an NNX model becomes (`from_nnx`)."""
  nnx_state: Any
  zerojax_frontend: Any = struct.field(pytree_node=False)


@dataclasses.dataclass(frozen=True)
class Nnx:
  """An NNX model's structure (static): its graph, the tree structures of
  its parameter and other state, and which other-state leaves are RNG keys
  (their key implementation; stored as key data)."""
  graphdef: Any
  params_def: Any
  rest_def: Any
  keys: tuple
  param_paths: tuple = ()   # each parameter's pure-dict key path, in order

  def module(self, params, rest, fold: Optional[jax.Array] = None) -> nnx.Module:
    """The `nnx.Module` of a parameter dict and an `nnx_state` dict; with
    `fold`, every RNG key folded with it."""
    leaves = []
    for x, impl in zip(jax.tree_util.tree_leaves(rest), self.keys):
      if impl is not None:
        x = jax.random.wrap_key_data(x, impl=impl)
        x = x if fold is None else _fold_in(x, fold)
      leaves.append(x)
    flat = traverse_util.flatten_dict(params)
    shards = {path: x for path, x in flat.items()
              if str(path[-1]).startswith((gather.CHUNK_KEY,
                                           gather.SLOT_KEY,
                                           gather.FROZEN_KEY,
                                           gather.SCALE_KEY))}
    model = nnx.merge(self.graphdef,
                      self.params_def.unflatten(self._param_leaves(flat, shards)),
                      self.rest_def.unflatten(leaves))
    self._mark_stacks(model, shards)
    return model

  def _param_leaves(self, flat: dict, shards: dict) -> list:
    """The parameter leaves in order; a leaf of a stack gathered per layer
    or of a block gathered per call (`zerojax.nn.layerwise`) is an empty
    placeholder (`[layers, 0]`, or `[0]`), its values being in the chunk
    (or frozen weight's) shards; the block's leaves kept whole (outside the
    chunks, not split) are themselves."""
    owners = {tuple(map(str, path[:-1])): x.shape[:-1] + (0,)
              for path, x in shards.items()
              if not str(path[-1]).startswith((gather.FROZEN_KEY,
                                               gather.SCALE_KEY))}
    out = []
    for path in self.param_paths:
      names = tuple(map(str, path))
      empty = next((shape for prefix, shape in owners.items()
                    if names[:len(prefix)] == prefix), None)
      out.append(flat[path] if empty is None or path in flat
                 else jnp.zeros(empty))
    return out

  def _mark_stacks(self, model, shards: dict) -> None:
    """Inside a step: each stacked module and each repeated block says its
    path (`STACK_ATTR`, how the step hears which opted in), and holds its
    chunk shards."""
    active = gather.active_layout()
    if active is None:
      return
    layout = active[0]
    for c, chunk in enumerate(layout.chunks):
      if chunk.stack is not None:
        prefix = layout.stack_prefix(c)
        stack = _node(model, prefix)
        if stack is not None:
          setattr(stack, model_nnx.STACK_ATTR, prefix)
          model_nnx.gather_per_call(stack)
    for path, x in shards.items():
      setattr(_node(model, path[:-1]), str(path[-1]), model_nnx.Shard(x))

  def rest_of(self, model: nnx.Module, keep_keys) -> dict:
    """`model`'s non-parameter state as an `nnx_state` dict, the RNG keys
    taken from `keep_keys` (the stored, unfolded ones)."""
    _, _, _, rest = nnx.split(model, nnx.Param, model_nnx.Shard, ...)
    leaves = [k if impl is not None else x for x, k, impl in zip(
        jax.tree_util.tree_leaves(rest), jax.tree_util.tree_leaves(keep_keys),
        self.keys)]
    return nnx.to_pure_dict(self.rest_def.unflatten(leaves))

  def keywords(self, mutable: tuple) -> tuple:
    """None: `fn(model, batch[, rng])`, the model holding its state."""
    return ()

  def loss(self, fn: Callable, has_aux: bool, mutable: tuple) -> tuple:
    """`fn(model, batch[, rng])` as a linen-style loss over the parameter
    dict, with `nnx_state` mutable: the model's other variables after the
    loss are its update."""
    def write_back(out, model, stored):
      updates = {NNX_FIELD: self.rest_of(model, stored)}
      if has_aux:
        loss, aux = outputs.split_aux(out)
        return loss, (aux, updates)
      return out, updates
    return self._adapted(fn, mutable, "train_step", write_back)

  def evaluation(self, fn: Callable, mutable: tuple) -> tuple:
    """`fn(model, batch[, rng])` over the parameter dict; state changes made
    while evaluating are dropped."""
    return self._adapted(fn, mutable, "eval_step", lambda out, *_: out)

  def _adapted(self, fn, mutable, caller, finish) -> tuple:
    if mutable:
      raise ValueError(f"{caller}(mutable={mutable}): an NNX model carries "
                       "its own state, written back by itself; leave "
                       "mutable= out.")

    def linen_fn(params, batch, *rng, nnx_state):
      # inside the step: every device draws its own (data and replica axes)
      _, config = gather.active_layout()
      model = self.module(params, nnx_state,
                          jax.lax.axis_index(batch_axes(config)))
      try:
        out = fn(model, batch, *rng)
      except TypeError as e:
        if f"'{type(model).__name__}' object is not subscriptable" in str(e):
          raise TypeError(
              f"{caller}: the function indexed the NNX model as a parameter "
              f"dict ({e}); with an NNX model it takes the model itself, "
              "fn(model, batch[, rng]), and calls it (model(batch['x'])).",
          ) from e
        raise
      return finish(out, model, nnx_state)

    return linen_fn, (NNX_FIELD,)


# every NNX object: Module, Optimizer, Rngs, Variable, State (the base
# class is `nnx.Pytree` in flax 0.12, `nnx.Object` before)
_NNX_TYPES = tuple(t for t in (getattr(nnx, "Pytree", None),
                               getattr(nnx, "Object", None), nnx.Variable,
                               nnx.State) if t is not None)


def is_nnx(obj) -> bool:
  return isinstance(obj, _NNX_TYPES)


def is_linen(static_extras) -> bool:
  """Whether a state's static fields say its model is a linen one."""
  return not isinstance(dict(static_extras).get(FRONTEND_FIELD), Nnx)


def from_nnx(obj, *, tx=None, optimizer=None, model=None) -> NnxTrainState:
  """The `NnxTrainState` of an `nnx.Module` and its optimizer: `tx`, or
  `optimizer` (an `nnx.Optimizer` over `nnx.Param`, its state and step
  count kept). An `nnx.Optimizer` passed as `obj` needs `model=` (flax's
  Optimizer no longer holds its model)."""
  if isinstance(obj, nnx.Optimizer):
    if optimizer is not None:
      raise TypeError("shard(optimizer, optimizer=...): pass the model first, "
                      "zerojax.shard(model, optimizer=optimizer).")
    optimizer, obj = obj, (model if model is not None else
                           getattr(obj, "model", None))
    if obj is None:
      raise TypeError(
          "shard(nnx.Optimizer): flax's nnx.Optimizer does not hold its model; "
          "pass it: zerojax.shard(model, optimizer=optimizer, stage=...).")
  if not isinstance(obj, nnx.Module):
    raise TypeError(
        f"zerojax.shard takes an nnx.Module (or a linen TrainState), got an "
        f"nnx.{type(obj).__name__}: pass the model, with tx= or optimizer=.")
  if optimizer is not None:
    if tx is not None:
      raise TypeError("shard(model, tx=..., optimizer=...): give one; the "
                      "optimizer carries its tx.")
    if not isinstance(optimizer, nnx.Optimizer):
      raise TypeError(f"optimizer= must be an nnx.Optimizer, got "
                      f"{type(optimizer).__name__}.")
    if optimizer.wrt is not nnx.Param:
      raise ValueError(f"nnx.Optimizer(wrt={optimizer.wrt!r}): zerojax trains "
                       "nnx.Param; build the optimizer with wrt=nnx.Param.")
    tx = optimizer.tx
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(
        f"shard(nnx_model) needs tx= an optax GradientTransformation (got "
        f"{tx!r}), or optimizer= an nnx.Optimizer(model, tx, wrt=nnx.Param).")
  pure, stored, front = _parts(obj)
  if optimizer is None:
    opt_state, step = tx.init(pure), 0
  else:
    opt_state = jax.tree_util.tree_map(
        _plain, optimizer.opt_state,
        is_leaf=lambda x: isinstance(x, (nnx.State, nnx.Variable)))
    step = optimizer.step.get_value()
  return NnxTrainState(step=step, apply_fn=None, params=pure, tx=tx,
                       opt_state=opt_state, nnx_state=stored,
                       zerojax_frontend=front)


def _node(model, names):
  """The submodule of `model` at `names` (layout names: list indices as
  strings), or None."""
  node = model
  for name in map(str, names):
    if hasattr(node, name):
      node = getattr(node, name)
    elif name.isdigit() and isinstance(node, (list, tuple, nnx.List)) \
        and int(name) < len(node):
      node = node[int(name)]
    else:
      return None
  return node


def _parts(module: nnx.Module) -> tuple:
  """`(parameter dict, nnx_state dict, Nnx)` of a module (concrete or
  traced): its `nnx.Param` values, its other variables with RNG keys as key
  data, and its structure."""
  graphdef, params, rest = nnx.split(module, nnx.Param, ...)
  keys = tuple(str(jax.random.key_impl(x)) if _is_key(x) else None
               for x in jax.tree_util.tree_leaves(rest))
  stored = jax.tree_util.tree_map(
      lambda x: jax.random.key_data(x) if _is_key(x) else x,
      nnx.to_pure_dict(rest))
  pure = nnx.to_pure_dict(params)
  paths = tuple(tuple(k.key for k in path)
                for path, _ in jax.tree_util.tree_flatten_with_path(pure)[0])
  front = Nnx(graphdef, jax.tree_util.tree_structure(params),
              jax.tree_util.tree_structure(rest), keys, paths)
  return pure, stored, front


def initialiser(init_fn: Callable, rng) -> tuple:
  """`(params_fn, extras_fn, static_extras)` of a sharded-init function
  (`zerojax.create`): a linen `init_fn(rng) -> params` as it is (no
  extras); an `init_fn(rng) -> nnx.Module` as its parameter dict, its
  other variables (`{"nnx_state": ...}`) and the NNX front end. One
  abstract trace tells which."""
  found = []

  def probe(r):
    out = init_fn(r)
    if not isinstance(out, nnx.Module):
      return out
    params, _, front = _parts(out)
    found.append(front)
    return params

  jax.eval_shape(probe, rng)
  if not found:
    return init_fn, None, ()
  return ((lambda r: _parts(init_fn(r))[0]),
          (lambda r: {NNX_FIELD: _parts(init_fn(r))[1]}),
          ((FRONTEND_FIELD, found[0]),))


def _plain(x):
  """An optimizer-state node of an `nnx.Optimizer` as plain arrays."""
  if isinstance(x, nnx.State):
    return nnx.to_pure_dict(x)
  return x.get_value()


def _fold_in(keys: jax.Array, data) -> jax.Array:
  """Every key of `keys` folded with `data` (a stack's streams, split per
  layer, hold one key a layer)."""
  fold = jax.random.fold_in
  for _ in range(keys.ndim):
    fold = jax.vmap(fold, in_axes=(0, None))
  return fold(keys, data)


def _is_key(x) -> bool:
  return jnp.issubdtype(getattr(x, "dtype", None) or jnp.float32,
                        jax.dtypes.prng_key)
