"""The configuration's groups (over 400 lines: each group's docstring is its
reference page): small frozen policies, each checked where it is built
(FSDP2's `MixedPrecisionPolicy` / `OffloadPolicy`, DeepSpeed's nested
`offload_optimizer: {device, nvme_path}`).

`zerojax.ZeroConfig` takes about a dozen options, five of them these groups
(`axes`, `precision`, `offload`, `quantize`, `blocks`), most with a short
spelling for the common case: `offload="host"`, `precision="bf16"`,
`quantize="int8"`. Each group knows the internal fields it stands for
(`fields`) and is read back from them (`from_fields`); the rules that join two
groups (offload needs stage 1 or more, ...) are `ZeroConfig`'s.

Imports nothing else from the package.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping, Optional, Sequence, Union

import jax.numpy as jnp
import numpy as np

_FLOAT_DTYPES = {
    "float32": jnp.float32, "fp32": jnp.float32,
    "bfloat16": jnp.bfloat16, "bf16": jnp.bfloat16,
    "float16": jnp.float16, "fp16": jnp.float16,
}
QUANTIZE_MODES = ("int8", "int4", "identity")   # zerojax._comm.quantize.MODES
UPDATE_PLACES = ("device", "host")
TIERS = ("host", "disk", "auto")
# (in the order the plan prefers them between candidates of one time)
REMATS = ("none", "casts", "recompute-scores", "dots", "full", "offload")


def _set(obj, name, value):
  object.__setattr__(obj, name, value)


def check_int(where: str, value, *, optional: bool = False) -> None:
  if value is None and optional:
    return
  if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
    raise TypeError(f"{where}={value!r} must be an int.")
  if value <= 0:
    raise ValueError(f"{where}={value!r} must be positive.")


def _check_bool(where: str, value) -> None:
  if not isinstance(value, (bool, np.bool_)):
    raise TypeError(f"{where}={value!r} must be True or False.")


def _check_axis(where: str, value, *, optional: bool) -> None:
  if value is None and optional:
    return
  if not isinstance(value, str) or not value:
    raise TypeError(f"{where}={value!r} must be a mesh axis name (a "
                    "non-empty str)" + (" or None." if optional else "."))


def as_dtype(where: str, value: Any):
  """`value` (a float dtype or one of `_FLOAT_DTYPES`' names) as a numpy
  dtype: float32, bfloat16 or float16."""
  if isinstance(value, str):
    if value not in _FLOAT_DTYPES:
      raise ValueError(f"{where}={value!r} is not a known float dtype; use "
                       f"one of {sorted(_FLOAT_DTYPES)} or a jnp dtype.")
    return np.dtype(_FLOAT_DTYPES[value])
  try:
    dtype = np.dtype(value)
  except TypeError:
    raise TypeError(f"{where}={value!r} is not a dtype; pass e.g. "
                    "jnp.bfloat16 or 'bf16'.") from None
  if dtype not in {np.dtype(d) for d in _FLOAT_DTYPES.values()}:
    raise ValueError(f"{where}={dtype} is not supported; use float32, "
                     "bfloat16 or float16.")
  return dtype


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
    if not self.growth_factor > 1:
      raise ValueError(f"DynamicLossScale.growth_factor={self.growth_factor!r} "
                       "must be above 1: the scale grows after "
                       "growth_interval finite steps (backoff lowers it).")
    if not self.min_scale <= self.init_scale:
      raise ValueError(f"DynamicLossScale.min_scale={self.min_scale!r} is "
                       f"above init_scale={self.init_scale!r}.")
    if not (isinstance(self.growth_interval, int) and self.growth_interval > 0):
      raise ValueError(f"DynamicLossScale.growth_interval="
                       f"{self.growth_interval!r} must be a positive int.")


@dataclasses.dataclass(frozen=True)
class Axes:
  """The mesh axes a run uses.

  Attributes:
    data: the axis that carries data parallelism; the stage shards over it
      (N = its size).
    replica: hybrid sharding (FSDP2's HSDP, MaxText's FSDP within a slice and
      data parallelism across): a second axis holding replicas of the sharded
      state, typically the nodes. The batch is split over both; gradients are
      reduced over `data` as the stage says, then all-reduced over the
      replicas once. None: one axis.
    hpz: with `replica`, ZeRO++'s hierarchical partitioning (DeepSpeed's
      `zero_hpz_partition_size`): the master and optimizer state are sharded
      over replica x data, and each step first gathers the compute-dtype
      parameter shards over the replica axis into the data group's shard, so
      stage 3's gathers stay within the data axis. Stages 1-3.
    model: tensor parallelism beside ZeRO (Megatron's TP, MaxText's "tensor"
      axis): the axis the model splits its own weights over, as its Flax code
      says (`nn.with_partitioning`, or a `NamedSharding`). zerojax keeps each
      such weight's model slices apart, gathers and scatters over the data
      axis only and leaves the model's tensor-parallel maths to GSPMD. Not
      yet with the disk tier.
  """
  data: str = "data"
  replica: Optional[str] = None
  hpz: bool = False
  model: Optional[str] = None

  def __post_init__(self):
    _check_axis("Axes.data", self.data, optional=False)
    _check_axis("Axes.replica", self.replica, optional=True)
    _check_axis("Axes.model", self.model, optional=True)
    _check_bool("Axes.hpz", self.hpz)
    if self.replica is not None and self.replica == self.data:
      raise ValueError(
          f"Axes(replica={self.replica!r}) is the data axis itself; name the "
          "mesh axis that holds the replicas (e.g. 'replica' of "
          "Mesh(devices.reshape(R, D), ('replica', 'data'))).")
    if self.model is not None and self.model in (self.data, self.replica):
      raise ValueError(
          f"Axes(model={self.model!r}) is also the data or replica axis; name "
          "the mesh axis the model's weights are split over (e.g. 'model' of "
          "Mesh(devices.reshape(D, M), ('data', 'model'))).")
    if self.hpz and self.replica is None:
      raise ValueError("Axes(hpz=True) shards the state over the replica axis "
                       "too; name it: Axes(replica='replica', hpz=True) (of "
                       "Mesh(devices.reshape(R, D), ('replica', 'data'))).")

  def fields(self) -> dict:
    return dict(axis_name=self.data, replica_axis=self.replica, hpz=self.hpz,
                model_axis=self.model)

  @classmethod
  def from_fields(cls, f: dict) -> "Axes":
    return cls(f["axis_name"], f["replica_axis"], f["hpz"], f["model_axis"])


@dataclasses.dataclass(frozen=True)
class Precision:
  """Mixed precision (FSDP2's `MixedPrecisionPolicy`). `precision="bf16"`
  is `Precision(compute="bf16")`.

  Attributes:
    compute: the dtype the forward and backward run in. Parameters are cast
      to it before they are gathered (half the bytes on the wire for 16-bit);
      the master stays float32.
    reduce: the dtype gradients are reduced (and accumulated) in.
    loss_scale: None, a fixed float, "dynamic" or a `DynamicLossScale`.
      float16 compute gets `DynamicLossScale()` when left None.
    skip_nonfinite: skip a step whose gradient has an inf or NaN (parameters,
      optimizer state and step count stay as they were) in any precision;
      `metrics["skipped"]` says which steps were. Always on under loss
      scaling.
  """
  compute: Any = jnp.float32
  reduce: Any = jnp.float32
  loss_scale: Union[None, float, str, DynamicLossScale] = None
  skip_nonfinite: bool = False

  def __post_init__(self):
    _set(self, "compute", as_dtype("Precision.compute", self.compute))
    _set(self, "reduce", as_dtype("Precision.reduce", self.reduce))
    _check_bool("Precision.skip_nonfinite", self.skip_nonfinite)
    scale = self.loss_scale
    if isinstance(scale, str) and scale == "dynamic":
      scale = DynamicLossScale()
    if scale is None and self.compute == np.dtype(jnp.float16):
      scale = DynamicLossScale()
    if scale is not None and not isinstance(scale, DynamicLossScale):
      if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"Precision.loss_scale={scale!r} must be None, a "
                        "float, 'dynamic' or zerojax.DynamicLossScale(...).")
      if not scale > 0:
        raise ValueError(f"Precision.loss_scale={scale!r} must be positive.")
      scale = float(scale)
    _set(self, "loss_scale", scale)

  def fields(self) -> dict:
    return dict(compute_dtype=self.compute, reduce_dtype=self.reduce,
                loss_scale=self.loss_scale,
                skip_nonfinite=self.skip_nonfinite)

  @classmethod
  def from_fields(cls, f: dict) -> "Precision":
    return cls(f["compute_dtype"], f["reduce_dtype"], f["loss_scale"],
               f["skip_nonfinite"])


@dataclasses.dataclass(frozen=True)
class Offload:
  """Where the state lives between steps (ZeRO-Offload, ZeRO-Infinity,
  Gemini's placement). `offload="host"` is `Offload("host")`; the disk tier
  needs its directory: `Offload("disk", dir=...)`.

  Attributes:
    tier: "host": the fp32 master shards and the optimizer state in
      `pinned_host` memory; the step updates offloaded chunks one at a time,
      so `tx` must allow it (no `clip_by_global_norm` inside it: use
      `clip_norm`). "disk" (ZeRO-Infinity's NVMe tier): the optimizer state
      in raw files under `dir`, streamed through host memory a chunk at a
      time by each step's update, which runs on the host; with 16-bit compute
      the master is on disk too. One process only; `train_step(...,
      donate=True)`. "auto" (Gemini's `placement_policy="auto"`): the first
      step plans, for its own program, how many chunks' optimizer state stay
      on the device within `device_budget=` (`zerojax.plan_offload`) and puts
      the rest on host; a checkpoint of it is planned again where it is
      restored.
    optimizer: offload the master and optimizer state (the tier's point);
      False with `params=True` offloads only the parameters.
    params: stage 3: keep the parameter (master) shards on host too.
    fraction: host tier, the fraction of chunk bytes offloaded (largest
      chunks first).
    update_on: where the offloaded chunks' optax update runs. "device" (the
      default for host): their master and state come to the device and go
      back (for Adam 12 bytes a parameter each way). "host" (the disk tier's
      only place): on the host where they live (DeepSpeed's CPU Adam): only
      the gradient shard goes there. Needs a sharded master: stage 3, or
      16-bit compute at stages 1-2.
    dir: the disk tier's directory (a local NVMe disk), existing and
      writable. Its files are scratch, rebuilt from a checkpoint by
      `checkpoint.restore`.
    sub_group_size: the disk tier, DeepSpeed's `sub_group_size`: the most
      elements of a device's shard of a chunk the stream updates at once, so
      host memory stays below the largest chunk. None: a chunk at a time.
  """
  tier: str = "host"
  optimizer: bool = True
  params: bool = False
  fraction: float = 1.0
  update_on: Optional[str] = None
  dir: Optional[str] = None
  sub_group_size: Optional[int] = None

  def __post_init__(self):
    if self.tier not in TIERS:
      raise ValueError(f"Offload(tier={self.tier!r}) is not a tier; use "
                       "'host' (pinned host memory), 'disk' (files under "
                       "dir=) or 'auto' (planned within device_budget=).")
    _check_bool("Offload.optimizer", self.optimizer)
    _check_bool("Offload.params", self.params)
    if (isinstance(self.fraction, bool) or
        not isinstance(self.fraction, (int, float, np.integer, np.floating))):
      raise TypeError(f"Offload.fraction={self.fraction!r} must be a number.")
    if not 0.0 <= self.fraction <= 1.0:
      raise ValueError(f"Offload.fraction={self.fraction!r} must be in "
                       "[0, 1].")
    if self.update_on is not None and self.update_on not in UPDATE_PLACES:
      raise ValueError(f"Offload.update_on={self.update_on!r} is not a place; "
                       "use 'device' or 'host'.")
    disk = self.tier == "disk"
    if self.tier == "host" and not self.optimizer and not self.params:
      raise ValueError("Offload(optimizer=False, params=False) offloads "
                       "nothing; use offload=None (nothing offloaded), or "
                       "set optimizer= or params= True.")
    if disk and self.update_on == "device":
      raise ValueError("Offload('disk') updates each chunk on the host as it "
                       "streams from its files; drop update_on='device'.")
    if disk and not self.optimizer:
      raise ValueError("Offload('disk', optimizer=False) has nothing to put "
                       "on disk; the disk tier holds the optimizer state.")
    if disk and self.dir is None:
      raise ValueError("Offload('disk') keeps optimizer state in files; give "
                       "dir= an existing writable directory (on a local NVMe "
                       "disk): Offload('disk', dir=...).")
    for name in ("dir", "sub_group_size"):
      if not disk and getattr(self, name) is not None:
        raise ValueError(f"Offload({name}={getattr(self, name)!r}) is read by "
                         "the disk tier only; use Offload('disk', ...), or "
                         f"drop {name}.")
    if self.tier == "auto" and (not self.optimizer or self.params
                                or self.fraction != 1.0):
      raise ValueError("Offload('auto') plans what goes to host itself; drop "
                       "optimizer=, params= and fraction=.")
    if self.dir is not None:
      if not isinstance(self.dir, (str, os.PathLike)):
        raise TypeError(f"Offload.dir={self.dir!r} must be a directory path "
                        "(a str).")
      _set(self, "dir", os.path.abspath(os.fspath(self.dir)))   # chdir-safe
    if self.sub_group_size is not None:
      check_int("Offload.sub_group_size", self.sub_group_size)
      _set(self, "sub_group_size", int(self.sub_group_size))
    if self.update_on is None:
      _set(self, "update_on", "host" if disk else "device")

  def fields(self) -> dict:
    disk = self.tier == "disk"
    return dict(
        offload_optimizer="disk" if disk else (self.optimizer
                                               and self.tier == "host"),
        offload_params=self.params, offload_fraction=float(self.fraction),
        update_on=self.update_on, offload_dir=self.dir,
        sub_group_size=self.sub_group_size,
        placement="auto" if self.tier == "auto" else "manual")

  @staticmethod
  def nothing_fields() -> dict:
    """The offload fields of `offload=None`: nothing offloaded."""
    return dict(offload_optimizer=False, offload_params=False,
                offload_fraction=1.0, update_on="device", offload_dir=None,
                sub_group_size=None, placement="manual")

  @classmethod
  def from_fields(cls, f: dict) -> Optional["Offload"]:
    """The group of `f`'s offload fields; None where nothing is offloaded."""
    if f["placement"] != "manual":
      return cls("auto", update_on=f["update_on"])
    tier = f["offload_optimizer"]
    if isinstance(tier, str) and tier != "disk":
      raise ValueError(f"offload_optimizer={tier!r} is not a tier; use "
                       "Offload('host') or Offload('disk', dir=...).")
    if not (tier or f["offload_params"] or f["offload_dir"]
            or f["sub_group_size"]):
      return None
    return cls("disk" if tier == "disk" else "host", bool(tier),
               f["offload_params"], f["offload_fraction"], f["update_on"],
               f["offload_dir"], f["sub_group_size"])


@dataclasses.dataclass(frozen=True)
class Quantize:
  """ZeRO++'s quantized collectives. `quantize="int8"` is
  `Quantize(weights="int8", grads="int8")`.

  Attributes:
    weights: qwZ: parameter gathers send int8 (or int4) values per `block`
      elements with a float32 absmax each, dequantized to the compute dtype
      on arrival; "identity" is the same path with an exact encoding. The
      master is never quantized. None: off.
    grads: qgZ: gradient reduce-scatters send each device's slices
      quantized by one all-to-all, dequantized and summed in float32;
      all-reduces go as that reduce-scatter and a quantized gather.
    block: elements per quantization block (and per scale of an int8 frozen
      base, `frozen_dtype="int8"`). A block spans leaves of a chunk, so large
      blocks lose small values (benchmarks/quantized.py).
  """
  weights: Optional[str] = None
  grads: Optional[str] = None
  block: int = 256

  def __post_init__(self):
    for name in ("weights", "grads"):
      mode = getattr(self, name)
      if mode is not None and mode not in QUANTIZE_MODES:
        raise ValueError(f"Quantize({name}={mode!r}) is not a quantization "
                         f"mode; use one of {QUANTIZE_MODES} or None (off).")
    check_int("Quantize.block", self.block)

  def fields(self) -> dict:
    return dict(quantize_weights=self.weights, quantize_grads=self.grads,
                quantize_block=self.block)

  @classmethod
  def from_fields(cls, f: dict) -> "Quantize":
    return cls(f["quantize_weights"], f["quantize_grads"], f["quantize_block"])


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Stage 3: how blocks (repeated blocks, scanned layers, named modules)
  are gathered, found in the model as written.

  Attributes:
    reshard_after_forward: FSDP2's name: each block that owns chunks is
      gathered when it is called, dropped after, and gathered again in its
      backward pass (linen and NNX alike, no opt-in in the model). False
      holds every chunk gathered for the whole step (GSPMD FSDP's memory,
      one gather per chunk), except blocks wrapped in `zerojax.nn.layerwise`.
    remat: what a block's backward pass keeps: "none" (ZeRO-3's and
      FSDP2's) its activations (`zerojax.nn.keep_activations`), gathering
      its parameters again; "casts" those and the casts to a narrower
      float (`zerojax.nn.keep_activations_and_casts`: a float32
      softmax's bf16 probabilities, which "none" computes again in the
      backward pass at a pass over the float32 scores), for more bytes;
      "recompute-scores" those but attention's scores
      (`zerojax.nn.recompute_scores`: a batched matmul's result larger
      than its operands), computed again in the backward pass, for fewer;
      "dots" the matmul outputs; "full" the block's
      input, recomputing the block (activation checkpointing); "offload"
      the matmul outputs as "dots" does, moved to pinned host memory in the
      forward pass and back for the backward (ZeRO-R's CPU checkpointing,
      MaxText's offloaded remat), with "dots"' numbers and compute; an
      unrolled block brings its own back as the next block's backward
      starts. In the program XLA compiles for GPUs the activations go to
      host memory; how many device bytes that saves is XLA's scheduler's
      to decide (docs/decisions.md, 2026-12-03).
      One for every block, or per block class: `{"DecoderLayer":
      "offload", "EncoderLayer": "dots"}` (the class's `__name__`; a
      class not named keeps "none"; a name that no block of the model
      has is an error at the step's trace). A policy of your own (what to
      offload, by name) goes to `zerojax.nn.layerwise(Block, policy=...)`.
    prefetch: each block's gather waits for the previous block's input, so
      it runs while that block computes (FSDP2's forward prefetch; backward
      likewise). None: on where collectives run beside compute (GPU, TPU),
      off on XLA's CPU backend. Bit-identical either way.
    stacked: names of submodules whose leaves carry a leading layer axis
      (`flax.linen.scan`), chunked per layer, for a stack the search
      (`chunking.scanned_stacks`) misses. A name matching nothing is an
      error.
    per_use: names of other submodules to gather at each use rather than
      hold for the step (FSDP2's `reshard_after_forward=True` for that
      module), for a large module called between others. Linen only.
  """
  reshard_after_forward: bool = True
  remat: Union[str, Mapping[str, str]] = "none"
  prefetch: Optional[bool] = None
  stacked: Sequence[str] = ()
  per_use: Sequence[str] = ()

  def __post_init__(self):
    _check_bool("Blocks.reshard_after_forward", self.reshard_after_forward)
    _set(self, "remat", _remat(self.remat))
    if self.prefetch is not None:
      _check_bool("Blocks.prefetch", self.prefetch)
    for name in ("stacked", "per_use"):   # submodule names
      names = getattr(self, name)
      names = (names,) if isinstance(names, str) else tuple(names)
      if not all(isinstance(s, str) and s for s in names):
        raise TypeError(f"Blocks.{name}={getattr(self, name)!r} must be a "
                        "sequence of submodule names.")
      _set(self, name, names)

  def fields(self) -> dict:
    return dict(reshard_after_forward=self.reshard_after_forward,
                remat=self.remat, prefetch=self.prefetch,
                stacked=self.stacked, per_use=self.per_use)

  @classmethod
  def from_fields(cls, f: dict) -> "Blocks":
    return cls(f["reshard_after_forward"], f["remat"], f["prefetch"],
               f["stacked"], f["per_use"])


def offload(value) -> Optional[Offload]:
  """`ZeroConfig(offload=...)`'s value as a group: None, "host" (or
  DeepSpeed's device name "cpu"), "auto", or an `Offload`."""
  if value is None or isinstance(value, Offload):
    return value
  if isinstance(value, str) and value in ("host", "auto"):
    return Offload(value)
  if isinstance(value, str) and value == "cpu":   # DeepSpeed's device name
    return Offload("host")
  if isinstance(value, str) and value == "disk":
    raise ValueError("offload='disk' needs its directory: "
                     "offload=zerojax.Offload('disk', dir=...).")
  raise ValueError(f"offload={value!r}: use None, 'host', 'auto' or "
                   "zerojax.Offload(...) (Offload('disk', dir=...)).")


# Lightning's `Trainer(precision=...)` names: its "-mixed" modes are
# zerojax's (an fp32 master, the forward and backward in 16 bits, fp16 with
# a dynamic loss scale)
LIGHTNING_PRECISIONS = {"bf16-mixed": "bf16", "16-mixed": "fp16",
                        "32-true": "fp32", "32": "fp32", "16": "fp16"}
_TRUE_16 = ("bf16-true", "16-true")


def precision(value) -> Precision:
  """`ZeroConfig(precision=...)`'s value: None (float32), a compute dtype
  ("bf16", jnp.bfloat16), a Lightning name ("bf16-mixed",
  `LIGHTNING_PRECISIONS`), or a `Precision`."""
  if value is None:
    return Precision()
  if isinstance(value, Precision):
    return value
  if isinstance(value, str) and value in _TRUE_16:
    raise ValueError(
        f"precision={value!r} (Lightning: parameters stored in 16 bits, no "
        "fp32 master): zerojax reads that from the parameters themselves; "
        "cast them to bfloat16 or float16 before zerojax.shard (it then keeps "
        "no fp32 master) and leave precision out, or use "
        f"precision={value.replace('true', 'mixed')!r} for an fp32 master.")
  return Precision(compute=LIGHTNING_PRECISIONS.get(value, value)
                   if isinstance(value, str) else value)


def quantize(value) -> Quantize:
  """`ZeroConfig(quantize=...)`'s value: None, a mode for both collectives
  ("int8"), or a `Quantize`."""
  if value is None:
    return Quantize()
  if isinstance(value, Quantize):
    return value
  if isinstance(value, str):
    return Quantize(weights=value, grads=value)
  raise TypeError(f"quantize={value!r}: use None, a mode ({QUANTIZE_MODES}) "
                  "or zerojax.Quantize(weights=..., grads=..., block=...).")


def of_type(name: str, value, cls):
  """`value` if it is None or a `cls`, else a TypeError naming the group."""
  if value is None:
    return cls()
  if not isinstance(value, cls):
    raise TypeError(f"{name}={value!r} must be a zerojax.{cls.__name__}(...).")
  return value


_REMAT_CHOICES = ("'none' (activations kept), 'casts' (activations and "
                  "their narrowing casts kept), 'recompute-scores' (those "
                  "but attention's scores), 'dots' (matmul outputs kept), "
                  "'full' (the block recomputed) or 'offload' (matmul "
                  "outputs kept in pinned host memory)")


def _remat(value):
  """`Blocks.remat` checked: one of `REMATS`, or per block class a mapping
  (or its pairs, as a checkpoint's JSON holds them) of class names to
  them, kept as sorted pairs (hashable, as a config is); none named is
  "none"."""
  if isinstance(value, str):
    if value not in REMATS:
      raise ValueError(f"Blocks(remat={value!r}): use {_REMAT_CHOICES}, or "
                       "a dict of block class names to those.")
    return value
  try:
    pairs = [tuple(p) for p in (value.items() if hasattr(value, "items")
                                else value)]
  except TypeError:
    pairs = None
  if pairs is None or not all(len(p) == 2 for p in pairs):
    raise TypeError(f"Blocks(remat={value!r}) must be a string or a dict of "
                    "block class names to remats, e.g. {'DecoderLayer': "
                    "'offload'}.")
  for kind, remat in pairs:
    if not isinstance(kind, str) or not kind:
      raise TypeError(f"Blocks(remat={value!r}): the key {kind!r} must be a "
                      "block class's name (a non-empty string).")
    if remat not in REMATS:
      raise ValueError(f"Blocks(remat={value!r}): {kind!r}: {remat!r}: use "
                       f"{_REMAT_CHOICES}.")
  if len({k for k, _ in pairs}) != len(pairs):
    raise ValueError(f"Blocks(remat={value!r}) names a block class twice.")
  pairs = tuple(sorted(p for p in pairs if p[1] != "none"))
  return pairs if pairs else "none"


def remat_of(remat, kind: str) -> str:
  """The remat of a block of class `kind` (its `__name__`) under
  `Blocks.remat` (`_remat`'s form)."""
  return remat if isinstance(remat, str) else dict(remat).get(kind, "none")


def remat_kinds(remat) -> frozenset:
  """The block classes `Blocks.remat` names (none where it is one for all)."""
  return frozenset() if isinstance(remat, str) else frozenset(
      k for k, _ in remat)


def plan_chosen(options: dict) -> list:
  """The options given in `options` that `zerojax.plan` chooses itself, as
  `stage="auto"` and `plan()` name them when they refuse them: `offload`,
  `quantize`, and a `Blocks` with a remat (the plan chooses the remat)."""
  given = [k for k in ("offload", "quantize") if k in options]
  blocks = options.get("blocks")
  if isinstance(blocks, Blocks) and blocks.remat != "none":
    given.append(f"blocks=Blocks(remat={blocks.remat!r})")
  return given
