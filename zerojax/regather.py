"""A block call whose backward pass keeps the block's activations and
gathers its parameters again: ZeRO-3's and FSDP2's default, the FLOPs of
plain data parallelism (no recomputation of the block) with one gathered
block alive at a time.

`jax.checkpoint` with a policy cannot say it: a policy sees one equation at
a time, so what the block derives from its parameters alone (a cast, a
transpose, a broadcast LayerNorm scale) would be saved beside the
activations, a copy of the gathered block. Here the block's residuals (the
values `jax.vjp` keeps for its backward) are sorted by what they depend on,
in a jaxpr of the block traced once: those computed from the block's array
inputs are kept; the others, computed from the parameters (and constants,
RNG keys) alone, are computed again in the backward pass from a fresh
gather, with the rest of that recomputation dead code XLA removes.
Imports nothing else from the package.
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp


def kept_call(f: Callable, gather: Callable, shards: Any, arrays: tuple,
              token: jax.Array, hold: Callable, place: Callable):
  """`f(gather(shards, token), *arrays)`, its backward pass keeping the
  residuals that depend on `arrays` and computing the others again from
  `gather(shards, after)`, `after` being the output's cotangent (see
  `zerojax.nn.tie`: the re-gather waits for it). `token` (a float32
  scalar) is what the forward gather waits for; it takes no gradient.
  `hold(residuals)` gives the kept residuals back, each in a buffer of
  its own: XLA would otherwise fold a residual's cheap producer (a bias
  add) into the backward pass, where it reads the gathered parameters,
  which then stay alive from the forward pass on. `place(cotangents)`
  puts the shards' cotangents where the shards are (host memory)."""
  params = jax.eval_shape(lambda s: gather(s, token), shards)
  kept = _on_inputs(f, params, arrays)
  avals = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a))
           for a in jax.tree_util.tree_leaves(arrays)]
  structure = jax.tree_util.tree_structure(arrays)

  @jax.custom_vjp
  def run(shards, token, arrays):
    return f(gather(shards, token), *arrays)

  def forward(shards, token, arrays):
    out, vjp_fn = jax.vjp(f, gather(shards, token), *arrays)
    leaves = jax.tree_util.tree_leaves(vjp_fn)
    return out, (shards, hold(tuple(r for r, k in zip(leaves, kept) if k)))

  def backward(residuals, cotangent):
    shards, saved = residuals
    after = _first(cotangent)
    params, gather_vjp = jax.vjp(lambda s: gather(s, after), shards)
    zeros = jax.tree_util.tree_unflatten(
        structure, [jnp.zeros(a.shape, a.dtype) for a in avals])
    _, again = jax.vjp(f, params, *zeros)
    leaves, treedef = jax.tree_util.tree_flatten(again)
    saved = iter(saved)
    vjp_fn = jax.tree_util.tree_unflatten(
        treedef, [next(saved) if k else r for r, k in zip(leaves, kept)])
    grads = vjp_fn(cotangent)
    return (place(gather_vjp(grads[0])[0]), jnp.zeros_like(token),
            tuple(grads[1:]))

  run.defvjp(forward, backward)
  return run(shards, token, tuple(arrays))


def _on_inputs(f: Callable, params: Any, arrays: tuple) -> list:
  """Per residual of `jax.vjp(f, params, *arrays)`, whether it depends on
  `arrays`: a forward walk over the jaxpr of the residuals (an equation's
  outputs all depend on what any of its inputs does)."""
  count = len(jax.tree_util.tree_leaves(params))

  def residuals(params, *arrays):
    return jax.tree_util.tree_leaves(jax.vjp(f, params, *arrays)[1])

  jaxpr = jax.make_jaxpr(residuals)(params, *arrays).jaxpr
  on = {id(v) for v in jaxpr.invars[count:]}
  for eqn in jaxpr.eqns:
    if any(id(v) in on for v in eqn.invars):
      on.update(id(v) for v in eqn.outvars)
  return [id(v) in on for v in jaxpr.outvars]


def _first(tree) -> jax.Array:
  """A float32 scalar of `tree`'s first non-empty floating array (what a
  re-gather waits for), or 0."""
  for leaf in jax.tree_util.tree_leaves(tree):
    if jnp.size(leaf) and jnp.issubdtype(jnp.result_type(leaf), jnp.floating):
      return jnp.ravel(leaf)[0].astype(jnp.float32)
  return jnp.zeros((), jnp.float32)
