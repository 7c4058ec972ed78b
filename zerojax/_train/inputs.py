"""What a step or an evaluation is given, checked where it enters: the
state (`check_state`), the `mutable` fields, the user's function's
signature, and the batch, split over the batch axes (`shard_batch`)."""
from __future__ import annotations

import hashlib
import inspect
import logging
from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from zerojax._options.config import batch_axes
from zerojax._state.state import ZeroTrainState, check_live

_log = logging.getLogger("zerojax")


def check_state(state, caller: str, mutable: tuple = ()) -> None:
  """A live ZeroTrainState that has the `mutable` fields, else a clear error."""
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"{caller} takes the ZeroTrainState from zerojax.shard(), "
                    f"got {type(state).__name__}.")
  check_live(state, caller)
  missing = [m for m in mutable if m not in state.extras]
  if missing:
    static = [m for m in missing if m in dict(state.static_extras)]
    where = (f"{static} are static (pytree_node=False) fields, which a step "
             "cannot change" if static else
             f"the state's own fields are {sorted(state.extras) or 'none'}")
    raise ValueError(
        f"mutable={mutable}: the state has no field {missing[0]!r} ({where}). "
        "Keep it in a TrainState subclass before zerojax.shard, e.g. class "
        "TrainState(train_state.TrainState): batch_stats: Any, created with "
        "batch_stats=variables['batch_stats'].")


def check_mutable(mutable, caller: str) -> tuple:
  """`mutable` as a tuple of field names, else a TypeError."""
  if isinstance(mutable, str):
    mutable = (mutable,)
  if not (isinstance(mutable, (tuple, list))
          and all(isinstance(m, str) for m in mutable)):
    raise TypeError(f"{caller}(mutable={mutable!r}) must be a tuple of field "
                    "names of your TrainState, e.g. ('batch_stats',).")
  return tuple(mutable)


def check_signature(fn: Callable, with_rng: bool, mutable: tuple,
                    caller: str) -> None:
  """A TypeError naming the expected call when `fn` cannot take the
  arguments the step passes: `(params, batch)`, `rng` third when the step
  is given one, each `mutable` field by keyword."""
  try:
    signature = inspect.signature(fn)
  except (TypeError, ValueError):   # a builtin or C callable: not known
    return
  args = ("params", "batch") + (("rng",) if with_rng else ())
  try:
    signature.bind(*args, **{m: None for m in mutable})
  except TypeError as e:
    call = ", ".join(args + tuple(f"{m}=..." for m in mutable))
    other = ("pass no rng to the step, or give the function an rng "
             "parameter" if with_rng else
             "pass the step an rng (step(state, batch, rng)), or drop the "
             "function's third parameter")
    raise TypeError(
        f"{caller}: the function{signature} cannot be called as fn({call}) "
        f"({e}); {other}.") from None


def _describe(x) -> str:
  if hasattr(x, "shape"):
    return f"a 0-d array ({x!r})"
  return f"a {type(x).__name__} ({x!r:.60})"


def shard_batch(state, batch, accum_steps: int = 1):
  """`batch` split over the data axis (and the replica axis: `batch_axes`),
  checked: every array with the same leading (global batch) axis, a
  multiple of devices x `accum_steps`. `ShapeDtypeStruct`s (an abstract
  batch, for `.lower`) get the sharding."""
  devices = state.num_batch_shards
  per_step = devices * accum_steps
  leaves = jax.tree_util.tree_leaves_with_path(batch)
  if not leaves:
    raise ValueError("the batch has no arrays.")
  for path, x in leaves:
    if not (hasattr(x, "shape") and hasattr(x, "dtype")) or not np.ndim(x):
      raise ValueError(
          f"batch{jax.tree_util.keystr(path)} is {_describe(x)}: every batch "
          "value must be an array whose leading axis is the global batch "
          "(pass a scalar as an array of shape [batch], or close over it in "
          "loss_fn).")
  sizes = {np.shape(x)[0] for _, x in leaves}
  if len(sizes) != 1:
    first = {}
    for path, x in leaves:
      first.setdefault(np.shape(x)[0], jax.tree_util.keystr(path))
    raise ValueError(
        "every batch array needs the same leading (global batch) axis; got "
        + ", ".join(f"{n} (batch{k})" for n, k in sorted(first.items())) + ".")
  if 0 in sizes:
    raise ValueError("the batch is empty (leading size 0): a step on it "
                     "would average over no examples; skip it.")
  size = sizes.pop()
  sharding = NamedSharding(state.mesh, P(batch_axes(state.config)))
  if _process_local(leaves):
    size, batch = _assembled(state, batch, size, sharding, accum_steps)
  want = state.config.train_batch_size
  if want is not None and size != want:
    raise ValueError(
        f"the batch has {size} examples, but the DeepSpeed configuration's "
        f"train_batch_size is {want}: one zerojax step takes the whole batch "
        "of one optimizer step (all its micro-batches, every device's), where "
        "DeepSpeed's engine takes one micro-batch per call. Pass batches of "
        f"{want}, or set train_batch_size to the batch you pass.")
  if size % per_step:
    raise ValueError(
        f"global batch {size} is not divisible by {devices} devices "
        f"x accum_steps {accum_steps} = {per_step}; use a multiple of "
        f"{per_step}.")
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
      if isinstance(x, jax.ShapeDtypeStruct) else _placed(x, sharding),
      batch)


def _placed(x, sharding):
  """`x` on the batch sharding: a `jax.Array` already laid out so, as it
  is; anything else put there."""
  if isinstance(x, jax.Array) and x.sharding.is_equivalent_to(sharding,
                                                              x.ndim):
    return x
  return jax.device_put(x, sharding)


# [Note: process-local batches]
# With several processes (`jax.process_count() > 1`) a batch of host arrays
# is this process's own slice of the global batch, as jax's, MaxText's and
# levanter's loaders produce it: the rows its devices hold along the batch
# axes, in device order (`jax.make_array_from_process_local_data`). The
# global batch is the processes' slices together: with jax's default device
# order, process p's rows are [p B/P, (p+1) B/P). Each device's rows are then
# cut into `accum_steps` micro-batches, and on a replica x data mesh the
# batch runs over both axes, replica outer. A global `jax.Array` is taken as
# it is. The first such batch is compared across the processes: if every
# process passed the same rows (the global batch, on each), that is said
# once, since the step would train on P copies of it.
_LOCAL_CHECKED: list = []


def _process_local(leaves) -> bool:
  return jax.process_count() > 1 and any(
      not isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) for _, x in leaves)


def _assembled(state, batch, local: int, sharding, accum_steps: int) -> tuple:
  """`(global batch size, the global batch)` of this process's slice
  `batch` of `local` rows ([Note: process-local batches])."""
  shards = state.num_batch_shards
  starts = {idx[0].indices(shards)[0] for idx in
            sharding.addressable_devices_indices_map((shards,)).values()}
  mine = len(starts)   # the batch shards this process's devices hold
  if local % (mine * accum_steps):
    raise ValueError(
        f"the process-local batch has {local} examples, but this process's "
        f"devices hold {mine} of the {shards} batch shards, each cut into "
        f"accum_steps={accum_steps} micro-batches: pass each process a "
        f"multiple of {mine * accum_steps} rows (its own slice; the global "
        f"batch is the {jax.process_count()} processes' slices together, "
        f"{local * shards // mine} examples here).")
  size = local * shards // mine
  if not _LOCAL_CHECKED:
    _LOCAL_CHECKED.append(True)
    _say_if_same_everywhere(batch)
  out = jax.tree_util.tree_map(
      lambda x: x if isinstance(x, jax.Array) else
      jax.make_array_from_process_local_data(
          sharding, np.asarray(x), (size,) + np.shape(x)[1:]), batch)
  return size, out


def _say_if_same_everywhere(batch) -> None:
  from jax.experimental import multihost_utils
  digest = hashlib.blake2b(digest_size=8)
  for x in jax.tree_util.tree_leaves(batch):
    if not isinstance(x, jax.Array):
      digest.update(np.ascontiguousarray(x).tobytes())
  mine = np.frombuffer(digest.digest(), np.int64)
  every = np.asarray(multihost_utils.process_allgather(mine))
  if np.all(every == every[0]):
    _log.warning(
        "every one of the %d processes passed the same batch rows. "
        "With several processes a step takes each process's own slice of "
        "the global batch (the global batch is their slices together); pass "
        "each process its own rows, or a global jax.Array "
        "(the docs' \"Multi-node\" page, docs/multinode.md).",
        jax.process_count())
