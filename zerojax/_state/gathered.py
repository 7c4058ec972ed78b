"""The ordinary forms of a sharded state, replicated on its mesh or in host
memory: the parameter tree (`gather_params`, for export) and, for a state
made from an NNX model, the `nnx.Module` (`gather_model`)."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax._model import frontend as frontend
from zerojax._core import frozen
from zerojax._core import reshard
from zerojax._options.config import shard_axes
from zerojax._core.layout import ChunkLayout
from zerojax._state.state import ZeroTrainState, check_live, loaded_master


def gather_params(state: ZeroTrainState, dtype: Any = None, *,
                  to: str = "device") -> Any:
  """The ordinary parameter tree of a sharded state.

  Args:
    state: a `ZeroTrainState`.
    dtype: cast floating leaves to this dtype; None keeps each leaf's dtype.
    to: "device" (the default): jax arrays replicated on the state's mesh,
      a whole copy of the model on every device, to run it; "host": numpy
      arrays in host memory, gathered one leaf at a time (no device holds
      more than its shard and one leaf), for a model larger than one
      device.
  """
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"gather_params() takes a ZeroTrainState, got "
                    f"{type(state).__name__}.")
  if to not in ("device", "host"):
    raise ValueError(f"gather_params(to={to!r}): to is 'device' (replicated "
                     "on the mesh) or 'host' (numpy arrays).")
  check_live(state, "gather_params()")
  dtype = None if dtype is None else jnp.dtype(dtype)
  master = loaded_master(state)
  if to == "host":
    tree = reshard.to_tree(state.layout, master,
                           frozen.restored(state.layout, state.rest),
                           shard_axes(state.config))
    return jax.tree_util.tree_map(lambda x: _cast(to_host(x), dtype), tree)
  return _gather_program(state.layout, state.mesh, dtype)(master, state.rest)


def to_host(x: jax.Array) -> np.ndarray:
  """`x` as one numpy array; under multi-host every process gets all of it
  (np.asarray alone refuses arrays with shards on other hosts)."""
  if x.is_fully_addressable:
    return np.asarray(x)
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def _cast(x, dtype):
  if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating):
    return x
  return x.astype(dtype)


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
    tree = layout.merge(master, frozen.restored(layout, rest))
    if dtype is None:
      return tree
    return jax.tree_util.tree_map(lambda x: _cast(x, dtype), tree)

  return jax.jit(merge, out_shardings=NamedSharding(mesh, P()))
