"""ZeroConfig: every knob of a ZeRO run, validated once where it enters.

Imports nothing else from the package (see docs/design.md, "Modules").
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from zerojax import deepspeed

_FLOAT_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}


@dataclasses.dataclass(frozen=True)
class DynamicLossScale:
  """Dynamic loss scaling for float16 (as in DeepSpeed's `fp16.loss_scale=0`).

  The loss is multiplied by `init_scale` before differentiation. A step whose
  gradients are not finite is skipped (parameters and optimizer state stay
  exactly as they were) and the scale is multiplied by `backoff` (never below
  `min_scale`); after `growth_interval` finite steps in a row the scale is
  multiplied by `growth_factor`.
  """
  init_scale: float = 2.0 ** 15
  growth_interval: int = 2000
  growth_factor: float = 2.0
  backoff: float = 0.5
  min_scale: float = 1.0

  def __post_init__(self):
    for name in ("init_scale", "growth_factor", "min_scale"):
      if not getattr(self, name) > 0:
        raise ValueError(f"DynamicLossScale.{name}={getattr(self, name)!r} "
                         "must be positive.")
    if not 0 < self.backoff < 1:
      raise ValueError(f"DynamicLossScale.backoff={self.backoff!r} must be "
                       "in (0, 1).")
    if not (isinstance(self.growth_interval, int) and self.growth_interval > 0):
      raise ValueError(f"DynamicLossScale.growth_interval="
                       f"{self.growth_interval!r} must be a positive int.")


def with_loss_scale(fields: dict) -> dict:
  """`deepspeed.config_fields`' fields, a dynamic loss scale's dict as a
  `DynamicLossScale`."""
  scale = fields.get("loss_scale")
  if isinstance(scale, dict):
    fields = {**fields, "loss_scale": DynamicLossScale(**scale)}
  return fields


def _as_dtype(name: str, value: Any):
  if isinstance(value, str):
    if value not in _FLOAT_DTYPES:
      raise ValueError(f"{name}={value!r} is not a known float dtype; use one "
                       f"of {sorted(_FLOAT_DTYPES)} or a jnp dtype.")
    return np.dtype(_FLOAT_DTYPES[value])
  try:
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(f"{name}={value!r} is not a dtype; pass e.g. "
                    "jnp.bfloat16 or 'bf16'.") from None
  if dtype not in {np.dtype(d) for d in _FLOAT_DTYPES.values()}:
    raise ValueError(f"{name}={dtype} is not supported; use float32, "
                     "bfloat16 or float16.")
  return dtype


QUANTIZE_MODES = ("int8", "int4", "identity")   # zerojax.quantize.MODES
UPDATE_PLACES = ("device", "host")   # ZeroConfig.update_on
DISK = "disk"   # ZeroConfig.offload_optimizer's disk tier
# "planned": auto, after planning; "plan": shard(stage="auto") before its
# first step, which chooses the whole configuration (`zerojax.plan`)
PLACEMENTS = ("manual", "auto", "planned", "plan")
OFFLOAD_FIELDS = ("offload_optimizer", "offload_params", "offload_fraction")


@dataclasses.dataclass(frozen=True)
class ZeroConfig:
  """How a `TrainState` is sharded and stepped.

  Attributes:
    stage: ZeRO stage. 0 = plain data parallel (everything replicated,
      gradients all-reduced); 1 = optimizer state and fp32 master sharded;
      2 = also gradients (reduce-scattered per micro-batch); 3 = also
      parameters (gathered per chunk right before use).
    axis_name: the mesh axis that carries data parallelism; the stage
      shards over it (N = its size).
    replica_axis: hybrid sharding (FSDP2's HSDP, MaxText's FSDP within a
      slice and data parallelism across): a second mesh axis holding
      replicas of the sharded state, typically the nodes, with `axis_name`
      the devices of one node. The batch is split over both axes; each
      step reduces gradients over `axis_name` as the stage says, then
      all-reduces them over the replicas once. None: one mesh axis.
    hpz: with `replica_axis`, ZeRO++'s hierarchical partitioning (hpZ,
      DeepSpeed's `zero_hpz_partition_size`; Megatron's HFSDP): the fp32
      master and the optimizer state are sharded over replica x data (N =
      R·D) instead of replicated over the replicas. Each step first gathers
      the compute-dtype parameter shards over the replica axis into the
      data group's shard (ZeRO++'s secondary partition, b·Ψ/D bytes per
      device while the step runs, at stage 3), so stage 3's forward and
      backward gathers stay within the data axis; gradients are
      reduce-scattered over data and then over replica. Stages 1-3.
    model_axis: tensor parallelism beside ZeRO (Megatron's TP, MaxText's
      "tensor" axis): a mesh axis over which the model itself splits its
      weights, as its Flax code says (`nn.with_partitioning`,
      `nn.with_logical_partitioning`, or parameters already placed with a
      `NamedSharding`). zerojax keeps each such weight's model slices apart
      (chunks `[M, length]`, one row per model device, sharded over this
      axis and the data axis), gathers and scatters over the data axis only
      and adds no collective over this one: GSPMD runs the model's own
      tensor-parallel maths. The stage table holds with N = the data axis,
      a split weight counting 1/M per device. Combines with `replica_axis`
      / `hpz`, host offload, `placement="auto"` and qwZ / qgZ; not yet
      with the disk tier. None: no tensor parallelism (a weight split over
      a mesh axis other than the data and replica axes is then an error
      at `shard`; names of axes the mesh lacks are ignored).
    quantize_weights: ZeRO++ qwZ: parameter gathers (stage 3's, the hpZ
      replica gather, and stages 1-2's gather of the 16-bit compute copy
      after the update) send int8 values per block of `quantize_block`
      elements with a float32 absmax each, dequantized to the compute
      dtype on arrival ("int8"; "int4"; "identity", the same path with an
      exact encoding). The fp32 master is never quantized. None: off.
    quantize_grads: ZeRO++ qgZ: gradient reduce-scatters (over the data
      axis, and under hpZ over the replica axis, requantized between) send
      each device's slices quantized ("int8", "int4": two values a byte;
      "identity") by one all-to-all, dequantized and summed in float32.
      All-reduces (stage 0's, HSDP's over the replica axis) go as that
      reduce-scatter and a gather of the sums, both quantized.
    quantize_block: elements per quantization block; a shard that is not a
      whole number of blocks is padded with zeros to one on the wire. A
      block spans leaves of a chunk (a LayerNorm scale beside small
      weights), so large blocks lose the small values: 256 (scales cost
      4/256 bytes an element) kept the example's loss within 1% where
      2048 lost 2.7% (benchmarks/quantized.py).
    chunk_size: elements per chunk; None searches the size that wastes least
      (on a one-device mesh with nothing offloaded: each leaf its own chunk).
    min_chunk_size, search_range, search_interval: the chunk-size search
      (ColossalAI Gemini's `search_chunk_configuration`): candidates from
      `min_chunk_size` to `min_chunk_size + search_range` in steps of
      `search_interval`.
    compute_dtype: dtype the forward/backward runs in. Parameters are cast
      to it before they are gathered (half the bytes on the wire for 16-bit).
    reduce_dtype: dtype gradients are reduced (and accumulated) in.
    clip_norm: clip gradients to this global L2 norm (padding excluded).
    accum_steps: micro-batches per step (gradient accumulation).
    loss_scale: None, a fixed float, or a `DynamicLossScale`. float16
      compute gets `DynamicLossScale()` when left None.
    frozen: parameters the optimizer must not touch: a callable
      `params -> tree of bools` or such a tree (True = frozen). Frozen and
      non-floating leaves stay outside the chunks; frozen floating leaves
      are stored once in the compute dtype (no master, gradient or
      optimizer state), split over the data axis at stage 3 and gathered
      per block (`zerojax.frozen`).
    frozen_dtype: None stores frozen weights in the compute dtype; "int8"
      stores frozen matrices (two dims or more per layer) block-quantized,
      int8 values with a float32 scale per `quantize_block` elements of
      their last dim, dequantized to the compute dtype after the gather
      (QLoRA-style memory under ZeRO sharding); vectors stay in the compute
      dtype. Needs `frozen`.
    offload_optimizer: keep the fp32 master shards and the optimizer state
      in `pinned_host` memory between steps (ZeRO-Offload); stages 1-3.
      The step updates offloaded chunks one at a time; `tx` must allow it
      (no `clip_by_global_norm` inside it: use `clip_norm`).
      "disk" (ZeRO-Infinity's NVMe tier): the offloaded chunks' optimizer
      state lives in raw files under `offload_dir` instead, streamed through
      host memory a chunk at a time by each step's update, which runs on
      the host (`update_on="host"`, implied). With 16-bit compute their
      fp32 master shards are on disk too (at stage 3 beside a sharded
      16-bit copy in host memory, which the step gathers); with fp32
      compute at stage 3 they stay in host memory. One process only;
      `train_step(..., donate=True)`.
    offload_dir: with offload_optimizer="disk", the directory of its files
      (a local NVMe disk): it must exist and be writable. The files are
      scratch, rebuilt from a checkpoint by `checkpoint.restore`.
    sub_group_size: with offload_optimizer="disk", DeepSpeed's
      `sub_group_size`: the most elements of each device's shard of a
      chunk (or of one layer of a stacked chunk) that the stream updates at
      once. The stream holds about two sub-groups' state in host memory, so
      a smaller value bounds host memory below the largest chunk (an
      embedding) at the cost of more, smaller reads and writes. None (the
      default): a whole chunk (layer) at a time.
    offload_params: stage 3: keep the parameter (master) shards on host.
    offload_fraction: with `offload_optimizer`, the fraction of chunk bytes
      offloaded (largest chunks first).
    update_on: with `offload_optimizer`, where the offloaded chunks' optax
      update runs. "device" (the default, but "host" for the disk tier):
      their master shard and optimizer
      state come to the device for it and go back (for Adam, 12 bytes a
      parameter each way). "host": it runs on the host, where they live
      (DeepSpeed's CPU Adam, ColossalAI's HybridAdam): only the gradient
      shard goes to the host, and at stages 1-2 only the compute-dtype
      parameter shard comes back. Needs a sharded master: stage 3, or
      16-bit compute at stages 1-2.
    placement: "manual" (default): the offload fields say where each chunk's
      optimizer state lives. "auto" (ColossalAI Gemini's
      `placement_policy="auto"`): the first step (`train_step`) plans it
      with `zerojax.plan_offload` for that step's program, keeping as many
      chunks' optimizer state on the device as fit in `device_budget` beside
      the compiled step and the rest in host memory, and moves the state
      there; until then everything offloadable is on host. The planned
      state says "planned"; a checkpoint of it restores as "auto" (planned
      again, for the new cluster). The offload fields are the planner's to
      set: giving them beside "auto" is an error. Stages 1-3. "plan" is
      `shard(stage="auto")`'s: the first step chooses the stage, remat and
      offload too (`zerojax.plan`) and lays the state out again.
    device_budget: with placement="auto", the device memory per device the
      step may use: bytes (an int, or a float above 1), or a fraction in
      (0, 1] of what the device reports (`memory_stats()["bytes_limit"]`;
      CPU devices report none).
    stacked: names of submodules (first-level keys below "params", or any
      path component) whose leaves carry a leading layer axis, as
      `flax.linen.scan` produces; they are chunked per layer. At stage 3
      such stacks are found without naming (`chunking.scanned_stacks`);
      name one the search misses (a stack of one weight, or of layers
      smaller than 32 elements per device). A name that matches no
      submodule is an error (`shard` lists the names).
    per_use: stage 3, names of other submodules (path components) to gather
      at each use rather than hold for the whole step, FSDP2's
      `reshard_after_forward=True` for that module: each named module's
      leaves get chunks of their own, and with its class wrapped in
      `zerojax.nn.layerwise` the step gathers it when it is called, drops
      it after, and gathers it again in its backward pass. Meant for a
      large module called between others (an encoder's projection into a
      decoder), whose held leaves would stay gathered from its forward to
      its backward; whether the compiled step is smaller depends on XLA's
      scheduler (README: smaller on jax 0.10, larger on 0.12 in one
      measured model), so compare `compiled_footprint`s. Repeated blocks
      (`<base>_<i>`, or a list's `<i>`) are found without naming. The
      default holds the rest (measured: for GPT-2's embedding, final norm
      and head, a held leaf is already freed after its last use,
      and the tied head's peak is inside its one use, see
      `zerojax.nn.BlockedEmbed`). A name must match exactly one submodule,
      outside `stacked` modules and repeated blocks; ignored below stage 3.
      Flax linen only (refused for an NNX model).
    prefetch: stage 3, unrolled blocks opted in with `zerojax.nn.layerwise`:
      each block's all-gather waits for the previous block's input instead
      of its own, so it can run while the previous block computes (FSDP2's
      forward prefetch); in the backward pass each block's re-gather waits
      for the next block's output cotangent instead of its own, so it runs
      beside the next block's backward (FSDP's `BACKWARD_PRE`). Each gather
      moves one block earlier, so two blocks' gathers overlap at most.
      Results are bit-identical either way. None (the default): on where
      collectives run beside compute (GPU, TPU), off on XLA's CPU backend,
      whose collectives block the device, so that prefetch there only costs
      memory and time (measured in the README). Scanned layer
      stacks are prefetched by XLA's GPU loop pipeliner instead
      (`zerojax.compat.GPU_FLAGS`); this field does not touch them.
    reshard_after_forward: stage 3 (FSDP2's name): each block that owns
      chunks (a repeated block, a layer of a scanned stack, a `per_use`
      module) is gathered when it is called, dropped after, and gathered
      again in its backward pass, found by the step without an opt-in in
      the model (linen and NNX alike). False
      holds every chunk gathered for the whole step (GSPMD FSDP's memory,
      one gather per chunk), except blocks wrapped in `layerwise`.
    remat: stage 3, what the backward pass of a linen block gathered per
      call (`reshard_after_forward`, without `layerwise` in the model) keeps:
      "none" (the default, ZeRO-3's and FSDP2's) keeps its activations
      (`zerojax.nn.keep_activations`: all but elementwise results, which
      the backward computes again in its fused kernels) and gathers its
      parameters again, the matmul FLOPs of plain data parallelism;
      "dots" keeps the matmul outputs
      (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`) and
      recomputes the rest; "full" keeps the block's input and recomputes
      the block (activation checkpointing, `layerwise`'s default). Each is
      what `layerwise(Block, policy=...)` does with that policy, bit for
      bit.
    skip_nonfinite: skip a step whose gradient has an inf or NaN (parameters,
      optimizer state and step count stay as they were) in any precision;
      `metrics["skipped"]` says which steps were. Always on under loss
      scaling.
  """
  stage: int = 3
  axis_name: str = "data"
  replica_axis: Optional[str] = None
  hpz: bool = False
  model_axis: Optional[str] = None
  quantize_weights: Optional[str] = None
  quantize_grads: Optional[str] = None
  quantize_block: int = 256
  chunk_size: Optional[int] = None
  min_chunk_size: int = 2 ** 20
  search_range: int = 2 ** 22
  search_interval: int = 2 ** 12
  compute_dtype: Any = jnp.float32
  reduce_dtype: Any = jnp.float32
  clip_norm: Optional[float] = None
  accum_steps: int = 1
  loss_scale: Union[None, float, DynamicLossScale] = None
  frozen: Union[None, Callable, Any] = None
  frozen_dtype: Optional[str] = None
  stacked: Sequence[str] = ()
  per_use: Sequence[str] = ()
  offload_optimizer: Union[bool, str] = False
  offload_dir: Optional[str] = None
  sub_group_size: Optional[int] = None
  offload_params: bool = False
  offload_fraction: float = 1.0
  update_on: Optional[str] = None
  placement: str = "manual"
  device_budget: Union[None, int, float] = None
  prefetch: Optional[bool] = None
  skip_nonfinite: bool = False
  reshard_after_forward: bool = True
  remat: str = "none"

  def __post_init__(self):
    set_ = lambda k, v: object.__setattr__(self, k, v)
    if isinstance(self.stage, bool) or not isinstance(self.stage, (int, np.integer)):
      raise TypeError(f"stage={self.stage!r} must be an int: 0 (data "
                      "parallel), 1, 2 or 3.")
    if self.stage not in (0, 1, 2, 3):
      raise ValueError(f"stage={self.stage!r} is not a ZeRO stage; use 0 "
                       "(data parallel), 1, 2 or 3.")
    set_("stage", int(self.stage))
    if not isinstance(self.axis_name, str) or not self.axis_name:
      raise TypeError(f"axis_name={self.axis_name!r} must be a mesh axis "
                      "name (a non-empty str).")
    if self.replica_axis is not None:
      if not isinstance(self.replica_axis, str) or not self.replica_axis:
        raise TypeError(f"replica_axis={self.replica_axis!r} must be a mesh "
                        "axis name (a non-empty str) or None.")
      if self.replica_axis == self.axis_name:
        raise ValueError(
            f"replica_axis={self.replica_axis!r} is the data axis itself; "
            "name the mesh axis that holds the replicas (e.g. 'replica' of "
            "Mesh(devices.reshape(R, D), ('replica', 'data'))).")
    self._check_model_axis()
    for name in ("quantize_weights", "quantize_grads"):
      mode = getattr(self, name)
      if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"{name}={mode!r} is not a quantization mode; use "
                         f"one of {QUANTIZE_MODES} or None (off).")
    for name in ("chunk_size", "min_chunk_size", "search_range",
                 "search_interval", "accum_steps", "quantize_block"):
      value = getattr(self, name)
      if value is None and name == "chunk_size":
        continue
      if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}={value!r} must be an int.")
      if value <= 0:
        raise ValueError(f"{name}={value!r} must be positive.")
    set_("compute_dtype", _as_dtype("compute_dtype", self.compute_dtype))
    set_("reduce_dtype", _as_dtype("reduce_dtype", self.reduce_dtype))
    for name in ("clip_norm", "offload_fraction"):
      _check_number(name, getattr(self, name))
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(f"clip_norm={self.clip_norm!r} must be positive or "
                       "None (no clipping).")
    scale = self.loss_scale
    if scale == "dynamic":
      scale = DynamicLossScale()
    if scale is None and self.compute_dtype == np.dtype(jnp.float16):
      scale = DynamicLossScale()
    if scale is not None and not isinstance(scale, DynamicLossScale):
      if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"loss_scale={scale!r} must be None, a float or "
                        "zerojax.DynamicLossScale(...).")
      if not scale > 0:
        raise ValueError(f"loss_scale={scale!r} must be positive.")
      scale = float(scale)
    set_("loss_scale", scale)
    for field in ("stacked", "per_use"):   # submodule names
      names = getattr(self, field)
      names = (names,) if isinstance(names, str) else tuple(names)
      if not all(isinstance(s, str) and s for s in names):
        raise TypeError(f"{field}={getattr(self, field)!r} must be a "
                        "sequence of submodule names.")
      set_(field, names)
    if not 0.0 <= self.offload_fraction <= 1.0:
      raise ValueError(f"offload_fraction={self.offload_fraction!r} must be "
                       "in [0, 1].")
    self._check_disk()
    if self.prefetch is not None and not isinstance(self.prefetch,
                                                    (bool, np.bool_)):
      raise TypeError(f"prefetch={self.prefetch!r} must be True, False or "
                      "None (on for GPU and TPU meshes, off on CPU).")
    for name in ("hpz", "offload_optimizer", "offload_params", "skip_nonfinite",
                 "reshard_after_forward"):
      if name == "offload_optimizer" and self.offload_optimizer == DISK:
        continue
      if not isinstance(getattr(self, name), (bool, np.bool_)):
        raise TypeError(f"{name}={getattr(self, name)!r} must be True or False.")
    if self.remat not in ("none", "dots", "full"):
      raise ValueError(f"remat={self.remat!r} must be 'none' (activations "
                       "kept), 'dots' (matmul outputs kept) or 'full' "
                       "(the block recomputed).")
    if self.offload_optimizer and self.stage == 0:
      raise ValueError("offload_optimizer needs stage >= 1 (stage 0 keeps "
                       "everything replicated); use stage=1, 2 or 3.")
    if self.offload_params and self.stage != 3:
      raise ValueError(f"offload_params needs stage=3 (got stage="
                       f"{self.stage}): only stage 3 shards the parameters.")
    if self.update_on not in UPDATE_PLACES:
      raise ValueError(f"update_on={self.update_on!r} is not a place; use "
                       "'device' (the default) or 'host' (with "
                       "offload_optimizer=True).")
    if self.placement not in PLACEMENTS:
      raise ValueError(f"placement={self.placement!r} is not a placement; use "
                       "'manual' (the offload fields, the default) or 'auto' "
                       "(with device_budget=).")
    budget = self.device_budget
    if budget is not None and (isinstance(budget, bool) or
                               not isinstance(budget, (int, float, np.integer,
                                                       np.floating))):
      raise TypeError(f"device_budget={budget!r} must be bytes (an int) or a "
                      "fraction of device memory (a float in (0, 1]).")
    if budget is not None and not (np.isfinite(budget) and budget > 0):
      raise ValueError(f"device_budget={budget!r} must be positive: bytes, or "
                       "a fraction of device memory in (0, 1].")
    if self.placement in ("auto", "plan") and budget is None:
      what = ("stage='auto' chooses the configuration"
              if self.placement == "plan" else "placement='auto' plans")
      raise ValueError(f"{what} for a device memory budget; give "
                       "device_budget= (bytes, or a fraction in (0, 1] of the "
                       "device's memory).")
    if self.placement == "manual" and budget is not None:
      raise ValueError(f"device_budget={budget!r} is read by placement='auto' "
                       "only; set placement='auto' too, or drop it.")
    if self.placement != "manual" and self.stage == 0:
      raise ValueError(f"placement={self.placement!r} needs stage >= 1 (stage "
                       "0 keeps everything replicated, nothing to offload).")
    if (self.update_on == "host" and not self.offload_optimizer
        and self.placement == "manual"):
      raise ValueError("update_on='host' runs the update where the offloaded "
                       "optimizer state lives; set offload_optimizer=True "
                       "(or leave update_on='device').")
    if (self.update_on == "host" and self.stage in (1, 2)
        and not self.mixed_precision):
      what = ("offload_optimizer='disk' (its update runs on the host)"
              if self.disk else "update_on='host'")
      raise ValueError(
          f"{what} at stage {self.stage} needs 16-bit compute "
          "(compute_dtype='bfloat16' or 'float16'): at float32 the master "
          "is the replicated compute copy, kept on the device. Use stage=3, "
          "16-bit compute" + (", or offload_optimizer=True." if self.disk
                              else ", or update_on='device'."))
    if self.hpz and self.replica_axis is None:
      raise ValueError("hpz=True shards the state over the replica axis too; "
                       "name it: replica_axis='replica' (of Mesh(devices."
                       "reshape(R, D), ('replica', 'data'))).")
    if self.hpz and self.stage == 0:
      raise ValueError("hpz=True needs stage >= 1 (stage 0 keeps everything "
                       "replicated); use stage=1, 2 or 3.")
    if self.frozen_dtype not in (None, "int8"):
      raise ValueError(f"frozen_dtype={self.frozen_dtype!r}: use None (the "
                       "compute dtype) or 'int8' (frozen matrices "
                       "block-quantized).")
    if self.frozen_dtype is not None and self.frozen is None:
      raise ValueError(f"frozen_dtype={self.frozen_dtype!r} sets how frozen "
                       "weights are stored, but nothing is frozen: pass "
                       "frozen=... (a callable params -> tree of bools), or "
                       "drop frozen_dtype.")
    if self.frozen is not None and not callable(self.frozen):
      # A tree of bools is hashed as part of the static state: freeze it.
      leaves, treedef = jax.tree_util.tree_flatten(self.frozen)
      if not all(isinstance(x, (bool, np.bool_)) for x in leaves):
        raise TypeError("frozen must be a callable params -> tree of bools, "
                        "or a tree of Python bools matching the parameters.")
      set_("frozen", _FrozenMask(tuple(bool(x) for x in leaves), treedef))

  @classmethod
  def from_deepspeed(cls, config, **overrides) -> "ZeroConfig":
    """The configuration a DeepSpeed JSON (a dict or a path) describes, for
    `zerojax.shard(state, config=cfg)`; `overrides` are further fields.
    Every key is mapped, accepted without effect for a stated reason, or
    refused naming it (`zerojax.deepspeed`, `docs/deepspeed.md`). The
    `optimizer` and `scheduler` sections are
    `zerojax.deepspeed.optimizer(config)`'s."""
    fields = deepspeed.config_fields(config, world_size=jax.device_count())
    return cls(**{**with_loss_scale(fields), **overrides})

  def _check_model_axis(self) -> None:
    """Tensor parallelism's axis: a name of its own, and not (yet) the disk
    tier, whose files hold shards without model rows."""
    axis = self.model_axis
    if axis is None:
      return
    if not isinstance(axis, str) or not axis:
      raise TypeError(f"model_axis={axis!r} must be a mesh axis name (a "
                      "non-empty str) or None.")
    if axis in (self.axis_name, self.replica_axis):
      raise ValueError(f"model_axis={axis!r} is also the data or replica "
                       "axis; name the mesh axis the model's weights are "
                       "split over (e.g. 'model' of Mesh(devices.reshape(D, "
                       "M), ('data', 'model'))).")
    if isinstance(self.offload_optimizer, str):
      raise ValueError(
          f"model_axis={axis!r} (tensor parallelism) does not combine with "
          f"offload_optimizer={self.offload_optimizer!r} yet (the disk tier "
          "streams whole shards); use offload_optimizer=True, or train "
          "without model_axis.")

  def _check_disk(self) -> None:
    """The disk tier's fields; `update_on` left None becomes its place."""
    disk = isinstance(self.offload_optimizer, str)
    if disk and self.offload_optimizer != DISK:
      raise ValueError(f"offload_optimizer={self.offload_optimizer!r} is not "
                       "a tier; use True (host memory), 'disk' (files under "
                       "offload_dir=) or False.")
    if disk and self.offload_dir is None:
      raise ValueError("offload_optimizer='disk' keeps optimizer state in "
                       "files; give offload_dir= an existing writable "
                       "directory (on a local NVMe disk).")
    if not disk and self.offload_dir is not None:
      raise ValueError(f"offload_dir={self.offload_dir!r} is read by "
                       "offload_optimizer='disk' only; set that too, or drop "
                       "offload_dir.")
    if self.offload_dir is not None and not isinstance(self.offload_dir,
                                                       (str, os.PathLike)):
      raise TypeError(f"offload_dir={self.offload_dir!r} must be a directory "
                      "path (a str).")
    if self.offload_dir is not None:   # resolved once: a later chdir is safe
      object.__setattr__(self, "offload_dir",
                         os.path.abspath(os.fspath(self.offload_dir)))
    if self.sub_group_size is not None:
      if (isinstance(self.sub_group_size, bool) or
          not isinstance(self.sub_group_size, (int, np.integer))):
        raise TypeError(f"sub_group_size={self.sub_group_size!r} must be an "
                        "int: elements of a device's shard updated at once.")
      if self.sub_group_size < 1:
        raise ValueError(f"sub_group_size={self.sub_group_size!r} must be at "
                         "least 1 (None: a whole chunk at a time).")
      if not disk:
        raise ValueError(f"sub_group_size={self.sub_group_size!r} is read by "
                         "offload_optimizer='disk' only; set that too, or "
                         "drop sub_group_size.")
      object.__setattr__(self, "sub_group_size", int(self.sub_group_size))
    if disk and self.update_on == "device":
      raise ValueError("offload_optimizer='disk' updates each chunk on the "
                       "host as it streams from its files; drop "
                       "update_on='device' (it means 'host' here).")
    if disk and self.placement != "manual":
      raise ValueError(f"placement={self.placement!r} plans host offload "
                       "only; use placement='manual' with the disk tier.")
    if self.update_on is None:
      object.__setattr__(self, "update_on", "host" if disk else "device")

  @property
  def disk(self) -> bool:
    """Whether offloaded optimizer state lives on disk (the disk tier)."""
    return self.offload_optimizer == DISK

  @property
  def mixed_precision(self) -> bool:
    return self.compute_dtype != np.dtype(jnp.float32)


def prefetches(config: ZeroConfig, mesh) -> bool:
  """`config.prefetch`, its default (None) decided for `mesh`'s devices: on
  where collectives run beside compute, off on XLA's CPU backend."""
  if config.prefetch is not None:
    return bool(config.prefetch)
  return mesh.devices.flat[0].platform != "cpu"


def _check_number(name: str, value: Any) -> None:
  if value is None and name == "clip_norm":
    return
  if isinstance(value, bool) or not isinstance(value, (int, float, np.integer,
                                                       np.floating)):
    raise TypeError(f"{name}={value!r} must be a number, not "
                    f"{type(value).__name__}.")


@dataclasses.dataclass(frozen=True)
class _FrozenMask:
  """A hashable tree of bools (config is static jit metadata)."""
  leaves: tuple
  treedef: Any

  def __call__(self, params):
    del params
    return jax.tree_util.tree_unflatten(self.treedef, self.leaves)


FIELDS = tuple(f.name for f in dataclasses.fields(ZeroConfig))


def batch_axes(config: ZeroConfig):
  """The mesh axes the global batch is split over: the data axis, and the
  replica axis first under hybrid sharding."""
  if config.replica_axis is None:
    return config.axis_name
  return (config.replica_axis, config.axis_name)


def manual_axes(config: ZeroConfig) -> dict:
  """`jax.shard_map` keywords for zerojax's programs: under tensor
  parallelism manual over the data (and replica) axes only, leaving the
  model axis to GSPMD; otherwise manual over every axis (no keyword)."""
  if config.model_axis is None:
    return {}
  axes = {config.axis_name}
  if config.replica_axis is not None:
    axes.add(config.replica_axis)
  return {"axis_names": frozenset(axes)}


def shard_axes(config: ZeroConfig):
  """The mesh axes the state's chunks are split over: the data axis, or
  under hpZ the data axis then the replica axis. Device (r, d) then holds
  piece d·R + r of a chunk, so gathering over the replica axis yields the
  data group's shard, piece d of D."""
  if config.hpz:
    return (config.axis_name, config.replica_axis)
  return config.axis_name
