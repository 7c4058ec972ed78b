"""The ordinary forms of a sharded state, replicated on its mesh: the
parameter tree (`gather_params`, for export) and, for a state made from an
NNX model, the `nnx.Module` (`gather_model`)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import disk_tier, frontend
from zerojax.layout import ChunkLayout
from zerojax.state import ZeroTrainState, check_live


def gather_params(state: ZeroTrainState, dtype: Any = None) -> Any:
  """The ordinary parameter tree of a sharded state, replicated.

  Args:
    state: a `ZeroTrainState`.
    dtype: cast floating leaves to this dtype; None keeps each leaf's dtype.
  """
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"gather_params() takes a ZeroTrainState, got "
                    f"{type(state).__name__}.")
  check_live(state, "gather_params()")
  dtype = None if dtype is None else jnp.dtype(dtype)
  return _gather_program(state.layout, state.mesh, dtype)(
      disk_tier.loaded_master(state), state.rest)


def gather_model(state: ZeroTrainState, dtype: Any = None):
  """The `nnx.Module` of a state sharded from an NNX model: a new module with
  the trained parameters (replicated) and the state's other variables.

  Args:
    state: a `ZeroTrainState` made from an NNX model.
    dtype: cast floating parameters to this dtype; None keeps each one's.
  """
  params = gather_params(state, dtype)
  if not isinstance(state.frontend, frontend.Nnx):
    raise TypeError("gather_model() rebuilds NNX models; this state came "
                    "from a linen TrainState: use zerojax.gather_params(state).")
  return state.frontend.module(params, state.extras[frontend.NNX_FIELD])


@functools.lru_cache(maxsize=64)
def _gather_program(layout: ChunkLayout, mesh: Mesh, dtype) -> Callable:
  """`gather_params`' jitted program, one per layout, mesh and dtype (a new
  jitted closure per call would trace and compile on every call)."""

  def merge(master, rest):
    tree = layout.merge(master, rest)
    if dtype is None:
      return tree
    return jax.tree_util.tree_map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x, tree)

  return jax.jit(merge, out_shardings=NamedSharding(mesh, P()))
