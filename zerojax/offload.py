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

Device residency inside the step, as measured on this project's CPU
machines (jax 0.10.2) and not yet on an accelerator:
  - `to_device` runs at the start of the step for every offloaded array
    and `place` at its end, and the optax update is one call over all
    chunks, so the program's data dependencies allow every offloaded
    chunk's device copy to be live at once; the issue's bound (a bounded
    number of chunks' optimizer state on device at a time) is NOT enforced.
    Enforcing it needs the update split per chunk with each chunk's copy
    ordered after the previous chunk's write-back, which changes results
    for a user `tx` that reads all chunks (e.g. `clip_by_global_norm`
    inside an `optax.chain`).
  - On CPU, jax lowers a memory-kind `device_put` to nothing (only the
    TPU/GPU lowering emits the `annotate_device_placement` transfers):
    the compiled CPU program computes on the host buffers directly, so its
    `memory_analysis()` holds no device copy of an offloaded array and
    cannot show residency. `zerojax.compiled_footprint`'s `device` figure
    there is the footprint less the host-resident arguments and outputs.
  - On a GPU, XLA's host-offload passes turn the annotations into
    host <-> device copies; when each copy runs (and so how many chunks
    are resident at once) is up to XLA's scheduler. Expect the update to
    need, at worst, device room for the offloaded optimizer state on top
    of `device`, and transfer time ~ offloaded bytes / PCIe bandwidth
    each step in each direction.
"""
from __future__ import annotations

from typing import Any

import jax
import numpy as np

HOST = "pinned_host"
DEVICE = "device"


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


def check_backend(mesh) -> None:
  """Offload needs a `pinned_host` memory on every device of the mesh."""
  for device in mesh.devices.flat:
    kinds = {m.kind for m in device.addressable_memories()}
    if HOST not in kinds:
      raise ValueError(f"offload needs memory kind {HOST!r}, which "
                       f"{device} does not have (it has {sorted(kinds)}); "
                       "turn offload_optimizer/offload_params off.")


def to_device(tree: Any, shardings: Any) -> Any:
  """Inside jit: the arrays of `tree` whose `shardings` are on host, moved
  to device memory (same sharding otherwise)."""
  return jax.tree_util.tree_map(
      lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE))
      if s.memory_kind == HOST else x, tree, shardings)


def place(tree: Any, shardings: Any) -> Any:
  """Inside jit: constrain each array to its sharding, memory kind included
  (`with_sharding_constraint` would drop the host kind)."""
  def one(x, s):
    if s.memory_kind == HOST:
      return jax.device_put(x, s)
    return jax.lax.with_sharding_constraint(x, s)
  return jax.tree_util.tree_map(one, tree, shardings)
