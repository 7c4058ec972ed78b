"""Host offload (ZeRO-Offload) with JAX memory kinds: which chunks live in
`pinned_host` memory between steps, and moving them to and from the device
inside the step. Never imports `step`.

Placement, per chunk:
  master shard  on host with `offload_optimizer` (when the master is a
                separate sharded copy: stage 3, or 16-bit stages 1-2) or with
                `offload_params` (stage 3, where the master shard is the
                parameter); the fp32 stage 1-2 master is the replicated
                compute copy and stays on the device;
  optimizer     on host with `offload_optimizer`.
`offload_fraction` offloads the largest chunks first until that fraction of
the chunk bytes is reached (within one chunk): the fewest, largest transfers
for the bytes moved (DeepSpeed's Twin-Flow `ratio`, Gemini's
`offload_optim_frac`).

Device residency inside the step (jax 0.10.2; not yet measured on an
accelerator):
  - Optimizer state: the step updates the device-resident chunks in one optax
    call, then each offloaded chunk in its own call (`update.update`): the
    chunk's state is `device_put` to device memory, updated, and put back to
    `pinned_host`, and the next chunk's host arrays pass through an
    optimization barrier with the previous chunk's written-back state, so
    its transfer cannot start before that write-back. One offloaded chunk's
    optimizer state (plus its update's temporaries) is on the device at a
    time; the largest chunk bounds it. `shard()` checks that `tx` gives the
    same result updated a part at a time (`optim.check_separable`) and
    refuses, e.g., `clip_by_global_norm` inside `tx` (use
    `shard(..., clip_norm=...)`, which clips before the update).
  - Master / parameter shards (`offload_params`, or the master under
    `offload_optimizer` where it is a sharded copy): they stay on host
    through the forward and backward passes. At stage 3 each chunk's gather
    moves its shard to the device right before the all-gather
    (`collectives.gather_from_host`); for layer chunks that is one layer's
    shard at a time, inside the layer loop (`zerojax.nn.layerwise`), again in
    the rematerialised backward. The gradient goes to a device-side slot, so
    gradient shards stay on the device. The update (`update.update`) brings
    the master shards over with their chunk's optimizer state (one chunk at a
    time when that is offloaded, written back to host after its chunk's
    update at stage 3; otherwise all of them for the one update call, back
    at the step's end).
  - On CPU, jax lowers a memory-kind `device_put` to nothing and the CPU
    compiler drops optimization barriers: the compiled CPU program computes
    on the host buffers directly, its `memory_analysis()` holds no device
    copy of an offloaded array, and neither residency nor the transfer
    order can be observed there (the order is checked in the lowered
    program, and the per-layer moves in the program lowered for a GPU:
    `step.trace(...).lower(lowering_platforms=("cuda",))`,
    `tests/test_offload.py`). `zerojax.compiled_footprint`'s
    `device` figure there is the footprint less the host-resident arguments
    and outputs.
  - `update_on="host"` (`update.update_on_host`) instead runs each
    offloaded chunk's update as a host computation: only its gradient shard
    goes to host, and at stages 1-2 only its compute-dtype parameter shard
    comes back.
  - On a GPU, XLA's host-offload passes turn the annotations into
    host <-> device copies. Expect transfer time ~ offloaded bytes / PCIe
    bandwidth each step in each direction (Adam fp32: 8 bytes x Psi/N of
    optimizer state, plus the master shard where it is offloaded).
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

HOST = "pinned_host"
DEVICE = "device"
HOST_SPACE = getattr(getattr(jax, "memory", None), "Space", None) and \
    jax.memory.Space.Host
DEVICE_SPACE = getattr(getattr(jax, "memory", None), "Space", None) and \
    jax.memory.Space.Device


def offloaded_chunks(layout, fraction: float) -> frozenset:
  """Chunk indices to offload: largest first, up to `fraction` of the bytes."""
  sizes = [int(np.prod(c.shape)) * c.dtype.itemsize for c in layout.chunks]
  target, total, chosen = fraction * sum(sizes), 0, []
  for c in sorted(range(len(sizes)), key=lambda c: -sizes[c]):
    if total >= target or (total + sizes[c] / 2 > target and chosen):
      break
    chosen.append(c)
    total += sizes[c]
  return frozenset(chosen) if fraction > 0 else frozenset()


def optimizer_chunks(layout, config) -> frozenset:
  """The chunks whose optimizer state is offloaded (to host memory, or to
  disk under the disk tier): `offloaded_chunks` of the config's
  `offload_fraction` under `offload_optimizer`, else none."""
  if not config.offload_optimizer:
    return frozenset()
  return offloaded_chunks(layout, config.offload_fraction)


def check_backend(mesh) -> None:
  """Offload needs a `pinned_host` memory on every device of the mesh."""
  for device in mesh.devices.flat:
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
      raise ValueError(f"offload needs memory kind {HOST!r}, which "
                       f"{device} does not have (it has {sorted(kinds)}); "
                       "leave offload off (offload=None).")


def has_host_memory(mesh) -> bool:
  """Whether every device of the mesh has `pinned_host` memory."""
  try:
    check_backend(mesh)
  except ValueError:
    return False
  return True


def to_device(tree: Any, shardings: Any) -> Any:
  """Inside jit: the arrays of `tree` whose `shardings` are on host, moved
  to device memory (same sharding otherwise)."""
  return jax.tree_util.tree_map(
      lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE))
      if s.memory_kind == HOST else x, tree, shardings)


def to_host(x, sharding):
  """Inside jit: `x` moved to `sharding`, a host memory kind, unless it is
  in host memory already (a host computation's output under
  `update_on="host"`, the disk tier's gradient read from its file): then
  it is left as it is, so the lowered program's moves are the real
  transfers."""
  if getattr(getattr(x, "aval", None), "memory_space", None) == HOST_SPACE:
    return x
  return jax.device_put(x, sharding)


def place(tree: Any, shardings: Any) -> Any:
  """Inside jit: constrain each array to its sharding, memory kind included
  (`with_sharding_constraint` would drop the host kind; `to_host`)."""
  return jax.tree_util.tree_map(
      lambda x, s: to_host(x, s) if s.memory_kind == HOST else
      jax.lax.with_sharding_constraint(x, s), tree, shardings)
