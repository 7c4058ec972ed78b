"""A block's call inside a stage-3 step (`zerojax.nn`): its arguments split
into traced arrays and static values (`_Arguments`), an unrolled block's
call as a `custom_vjp` with tied gathers (`_unit_call`), and the remat
policies `Blocks(remat=)` names (`keep_activations`, `_POLICIES`)."""
from __future__ import annotations

import functools
import inspect
import math
from typing import Callable

import flax.linen as nn
import jax
import numpy as np
from flax import nnx

from zerojax._model.gather import (_ACTIVE, _AFTER, after_copies, _anchor,
                                _avals, _Link, _memory_spaces, _OPTED,
                                _regathered_backward, _token, offloaded,
                                stored)


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


def _unit_call(module, arguments: _Arguments, call: Callable,
               offload: bool = False):
  """One call of an unrolled linen block inside a stage-3 step (the
  explicit `layerwise` class's and the automatic path's, `intercept`):
  `call(module, *arrays)`, the gathered, rematerialised block, as a
  `custom_vjp` whose residuals are the block's shards and inputs, its
  gathers tied to the block's input (forward) and to the output's
  cotangent (backward), or with prefetch to the previous block's input and
  the next block's output cotangent; see `zerojax.nn`'s docstring. With
  `offload` (`remat="offload"`, `call` rematerialised under "dots"), the
  activations `call` saves wait in host memory (`offloaded`)."""
  values = arguments.arrays
  chain = _ACTIVE.get().chain
  # the forward gather waits for `token_in`: from the previous block's
  # input when prefetching (`_Chain`), else from this block's own
  token_in = None if chain is None else chain.take(module.parent)
  link = _Link(overlap=chain is not None and chain.overlap)
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
  shards = set()   # ... and of its variables
  moved = []   # per residual: moved to host memory (`offloaded`)

  def forward(module, *values):
    spaces[:] = _memory_spaces(module.variables)
    shards.update(_avals(module.variables))
    inputs.update(_avals(values[:-1]))
    (out, vjp_fn), token = gathered(
        lambda m, *v: nn.vjp(call, m, *v), module, values)
    if offload:
      vjp_fn, done = offloaded(vjp_fn, (module.variables, values), moved,
                               ordered=link.overlap)
      out = after_copies(out, done)
    return (out, token), vjp_fn

  def backward(vjp_fn, cotangents):
    return _regathered_backward(vjp_fn, cotangents, link, inputs, shards,
                                spaces, token_in, moved)

  out, token = nn.custom_vjp(tied, forward_fn=forward,
                             backward_fn=backward)(module, *values, token_in)
  if chain is not None:
    chain.put(module.parent, token, link)
  return stored(out)   # see [Note: a block's output stored]

# Primitives whose results `keep_activations` does not keep: elementwise
# arithmetic and layout changes, which XLA fuses into the kernels that read
# them (recomputing them costs no pass of their own), ...
_RECOMPUTED = frozenset({
    "abs", "add", "and", "atan2", "bitcast_convert_type", "broadcast_in_dim",
    "cbrt", "ceil", "clamp", "concatenate", "conj", "convert_element_type",
    "copy", "cos", "div", "eq", "erf", "erf_inv", "erfc", "exp", "exp2",
    "expand_dims", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "iota",
    "is_finite", "le", "log", "log1p", "logistic", "lt", "max", "min", "mul",
    "ne", "neg", "nextafter", "not", "or", "pad", "polynomial", "pow", "real",
    "reduce_precision", "rem", "reshape", "rev", "round", "rsqrt", "select_n",
    "sign", "sin", "slice", "split", "sqrt", "square", "squeeze",
    "stop_gradient", "sub", "tan", "tanh", "transpose", "xor",
    # ... and the maximum a softmax or log-sum-exp subtracts: XLA computes
    # it again inside the kernel that reads the scores anyway, where a kept
    # one is a kernel and a pass over the scores of its own in the forward,
    # and splits the backward's softmax kernel in two (docs/decisions.md,
    # "the softmax's maximum")
    "reduce_max", "reduce_min"})


def _elementwise(prim, params: dict) -> bool:
  """Whether `prim` is elementwise arithmetic or a layout change
  (`_RECOMPUTED`), or a call of such alone: `jax.nn.relu`, a `custom_jvp`
  function, is a `custom_jvp_call` of one `max`."""
  if prim.name in _RECOMPUTED:
    return True
  inner = params.get("call_jaxpr", params.get("jaxpr"))
  jaxpr = getattr(inner, "jaxpr", inner)
  return (prim.name in ("custom_jvp_call", "pjit", "jit")
          and hasattr(jaxpr, "eqns")
          and all(_elementwise(e.primitive, e.params) for e in jaxpr.eqns))


def keep_activations(prim, *_, **params) -> bool:
  """The remat policy of `Blocks(remat="none")` (activations kept): every
  result is saved for the backward pass but those of elementwise and layout
  primitives and a softmax's maximum (`_RECOMPUTED`), which the backward
  computes again inside its own fused kernels. So the block's matmul,
  sum and attention outputs are kept and none of its FLOPs are spent
  twice, while neither a cast, transpose or broadcast of the gathered
  parameters (a copy of the block, which `everything_saveable` keeps) nor
  a chain of elementwise results that XLA would fuse away is held from the
  forward pass to the backward.
  A function of elementwise arithmetic alone (`jax.nn.relu`, whose
  derivative jax defines; jax 0.12's derivative of `erfc`, a polynomial
  under a `custom_jvp`) counts as elementwise: saved, its result is the
  matmul output plus the gathered bias, which XLA computes where the
  backward reads it, holding the forward's gathered block till then
  (docs/decisions.md, 2026-12-03)."""
  return not _elementwise(prim, params)


def keep_activations_and_casts(prim, *avals, **params) -> bool:
  """The remat policy of `Blocks(remat="casts")`: what `keep_activations`
  keeps, and each cast to a narrower float. A float32 softmax's bf16
  probabilities feed the value matmul's gradient; `keep_activations`
  computes them again in the backward pass from the kept scores, a pass
  over the float32 scores a block, where keeping them costs half the
  scores' bytes (docs/decisions.md, "Keeping the casts"). A model's own
  casts of its parameters (a `Dense(dtype=bfloat16)` over float32
  parameters gathered as such) are kept too: a copy of the block at the
  narrower width."""
  if prim.name == "convert_element_type" and avals:
    old, new = np.dtype(avals[0].dtype), np.dtype(params["new_dtype"])
    if (jax.numpy.issubdtype(old, jax.numpy.floating)
        and jax.numpy.issubdtype(new, jax.numpy.floating)):
      return new.itemsize < old.itemsize
  return keep_activations(prim, *avals, **params)


def _outweighs_its_operands(lhs, rhs, dimension_numbers) -> bool:
  """Whether a batched matmul of `lhs` and `rhs` (avals) has a result of
  more elements than the two of them together."""
  (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers

  def free(aval, contract, batch):   # the dimensions the result keeps
    return math.prod(n for d, n in enumerate(aval.shape)
                     if d not in contract and d not in batch)
  result = (math.prod(lhs.shape[d] for d in lhs_batch)
            * free(lhs, lhs_contract, lhs_batch)
            * free(rhs, rhs_contract, rhs_batch))
  return bool(lhs_batch) and result > lhs.size + rhs.size


def recompute_scores(prim, *avals, **params) -> bool:
  """The remat policy of `Blocks(remat="recompute-scores")`: what
  `keep_activations_and_casts` keeps, but not a batched matmul's result
  that outweighs its operands: attention's scores, queries x keys a head,
  from heads of a few dozen dimensions. The backward computes them again
  from the kept queries and keys, a matmul of few FLOPs an element, where
  keeping them costs the block's largest activation (docs/decisions.md,
  "The scores recomputed")."""
  if (prim.name == "dot_general" and len(avals) == 2
      and _outweighs_its_operands(*avals, params["dimension_numbers"])):
    return False
  return keep_activations_and_casts(prim, *avals, **params)


# `ZeroConfig.remat`: the remat policy of each choice (None: nothing saved
# but the block's input); the gathered parameters are never saved
# (`_regathering`)
_POLICIES = {"none": keep_activations,
             "casts": keep_activations_and_casts,
             "recompute-scores": recompute_scores,
             "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
             "full": None,
             # "dots"' residuals in pinned host memory between the passes
             # (on CPU, memory kinds lower to nothing: "dots" bit for bit)
             "offload": jax.checkpoint_policies.offload_dot_with_no_batch_dims(
                 offload_src="device", offload_dst="pinned_host")}


def remat_policy(remat: str, per_call: bool) -> tuple:
  """`(policy, offload)` of a block under `ZeroConfig.remat`: its policy
  (`_POLICIES`), except that an unrolled block's call (`per_call`:
  `_unit_call`, `_nnx_unit`) under "offload" is "dots" with the saved
  activations moved to host by the call itself (`offloaded`), which brings
  each back one block ahead of its backward, as it does the block's
  re-gather; left to XLA (`_POLICIES["offload"]`), the GPU program brings
  every block's back at once (docs/decisions.md, "Offloaded remat on the
  GPU program"). A scanned stack keeps jax's policy: its loop bounds the
  copies."""
  if remat == "offload" and per_call:
    return _POLICIES["dots"], True
  return _POLICIES[remat], False
