"""ZeroConfig: a ZeRO run's options, validated once where they enter.

A user writes about a dozen options, five of them groups (`groups`:
`Axes`, `Precision`, `Offload`, `Quantize`, `Blocks`); the library reads
the flat fields those stand for (`ZeroConfig.fields`), which are also what
checkpoints store. `ZeroConfig.from_fields` builds one from them, and
`ZeroConfig(...)` from the options. Imports only `groups`, `spelling` and
`deepspeed` from the package (docs/design.md, "Package map").
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np

from zerojax import deepspeed
from zerojax._options import groups
from zerojax._options.groups import (Axes, Blocks, DynamicLossScale, Offload,
                                     Precision, Quantize)
from zerojax._options.spelling import NEW_SPELLING

DISK = "disk"   # offload_optimizer's value for the disk tier
# "planned": auto, after planning; "plan": shard(stage="auto") before its
# first step, which chooses the whole configuration (`zerojax.plan`)
PLACEMENTS = ("manual", "auto", "planned", "plan")
OFFLOAD_FIELDS = ("offload_optimizer", "offload_params", "offload_fraction")


def with_loss_scale(fields: dict) -> dict:
  """`deepspeed.config_fields`' fields, a dynamic loss scale's dict as a
  `DynamicLossScale`."""
  scale = fields.get("loss_scale")
  if isinstance(scale, dict):
    fields = {**fields, "loss_scale": DynamicLossScale(**scale)}
  return fields


class _Unset:
  """The default of an option not given (`given`): the config's, the
  strategy's, or the saved one, not a value of its own."""

  def __repr__(self) -> str:
    return "unset"


UNSET = _Unset()


def given(scope: dict) -> dict:
  """The options a signature that spells them (`shard`, `ZeroConfig`) was
  passed: those of `OPTIONS` but `stage` in `scope` (its `locals()`) that
  are not `UNSET`, and the keywords it caught as `unknown` (refused or
  renamed by `expand`)."""
  return {**{k: scope[k] for k in OPTIONS
             if k != "stage" and scope[k] is not UNSET}, **scope["unknown"]}


# The options `ZeroConfig(...)` takes, and the groups' makers.
GROUPS = {
    "axes": (lambda v: groups.of_type("axes", v, Axes)),
    "precision": groups.precision,
    "offload": groups.offload,
    "quantize": groups.quantize,
    "blocks": (lambda v: groups.of_type("blocks", v, Blocks)),
}
PLAIN = ("stage", "device_budget", "chunk_size", "clip_norm", "accum_steps",
         "frozen", "frozen_dtype")
OPTIONS = PLAIN[:1] + tuple(GROUPS) + PLAIN[1:]

def expand(options: dict) -> dict:
  """The flat fields `options` (`ZeroConfig(...)`'s keywords, as given to
  `shard`, `create`, `restore` or `plan`) stand for: a group given sets all
  of its fields, a plain option its own. An old flat name, or an unknown
  one, is refused naming what to write instead."""
  old = [k for k in options if k in NEW_SPELLING]
  if old:
    raise TypeError("; ".join(f"{k}= is now {NEW_SPELLING[k]}" for k in old)
                    + " (the options are grouped: help(zerojax.ZeroConfig)).")
  unknown = sorted(set(options) - set(OPTIONS))
  if unknown:
    raise TypeError(f"unknown option(s) {unknown}; the options are "
                    f"{', '.join(OPTIONS)}.")
  fields = {k: v for k, v in options.items() if k in PLAIN}
  for name, make in GROUPS.items():
    if name in options:
      group = make(options[name])
      fields.update(Offload.nothing_fields() if group is None
                    else group.fields())
  return fields


class _GroupOf:
  """`config.<group>`: the group `ZeroConfig`'s flat fields stand for
  (`Group.from_fields`), read when asked for."""

  def __init__(self, group: type):
    self.group = group

  def __get__(self, config, owner=None):
    return self if config is None else self.group.from_fields(config.fields())


@dataclasses.dataclass(frozen=True, init=False)
class ZeroConfig:
  """How a `TrainState` is sharded and stepped.

  Options (`ZeroConfig(...)`, or the same keywords to `zerojax.shard`):
    stage: 0 = plain data parallel (everything replicated, gradients
      all-reduced); 1 = optimizer state and fp32 master sharded; 2 = also
      gradients (reduce-scattered per micro-batch); 3 = also parameters
      (gathered per block right before use).
    axes, precision, offload, quantize, blocks: the groups
      (`zerojax._options.groups`: `Axes`, `Precision` or "bf16", `Offload` or
      "host" / "auto", `Quantize` or "int8", `Blocks`).
    device_budget: with offload="auto" (or stage="auto"), the device memory
      per device the step may use: bytes, or a fraction in (0, 1] of what
      the device reports (CPU devices report none).
    chunk_size: elements per chunk; None searches the size that wastes least
      (ColossalAI Gemini's search; on a one-device mesh with nothing
      offloaded each leaf is its own chunk).
    clip_norm: clip gradients to this global L2 norm (padding excluded).
    accum_steps: micro-batches per step (gradient accumulation).
    frozen: parameters the optimizer must not touch: a callable
      `params -> tree of bools` or such a tree (True = frozen), stored once
      in the compute dtype with no master, gradient or optimizer state,
      split over the data axis at stage 3 (`zerojax._core.frozen`).
    frozen_dtype: "int8" stores frozen matrices block-quantized (a float32
      scale per `Quantize.block` elements of their last dim), dequantized
      after the gather (QLoRA-style memory under ZeRO). Needs `frozen`.

  The attributes are the flat fields those options stand for (each group's
  `fields()`), which the library reads and checkpoints store; the groups are
  read back as properties (`config.offload`, ...).
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
  # what a DeepSpeed configuration states about the run, checked where the
  # run shows it (`from_deepspeed`): the global batch one step takes (its
  # train_batch_size), the data axis's size under hpZ (its
  # zero_hpz_partition_size)
  train_batch_size: Optional[int] = None
  hpz_partition_size: Optional[int] = None
  prefetch: Optional[bool] = None
  skip_nonfinite: bool = False
  reshard_after_forward: bool = True
  remat: Union[str, tuple] = "none"   # `groups._remat`: one, or per class

  def __init__(self, stage: int = 3, *,
               axes: Optional[Axes] = UNSET,
               precision: Union[None, str, Any, Precision] = UNSET,
               offload: Union[None, str, Offload] = UNSET,
               quantize: Union[None, str, Quantize] = UNSET,
               blocks: Optional[Blocks] = UNSET,
               device_budget: Union[None, int, float] = UNSET,
               chunk_size: Optional[int] = UNSET,
               clip_norm: Optional[float] = UNSET,
               accum_steps: int = UNSET,
               frozen: Union[None, Callable, Any] = UNSET,
               frozen_dtype: Optional[str] = UNSET, **unknown):
    self._set_fields({"stage": stage, **expand(given(locals()))})

  @classmethod
  def from_fields(cls, **fields) -> "ZeroConfig":
    """The config of flat fields (the library's and checkpoints' form);
    fields left out take their defaults."""
    unknown = sorted(set(fields) - set(FIELDS))
    if unknown:
      raise TypeError(f"unknown ZeroConfig field(s) {unknown}.")
    config = object.__new__(cls)
    config._set_fields(fields)
    return config

  def fields(self) -> dict:
    return {f: getattr(self, f) for f in FIELDS}

  def replace(self, **fields) -> "ZeroConfig":
    """This config with some flat fields changed (checked again)."""
    return ZeroConfig.from_fields(**{**self.fields(), **fields})

  def options(self) -> dict:
    """The options (`ZeroConfig(**config.options())`) that give this config;
    a planned placement reads as offload="auto"."""
    options = {k: getattr(self, k) for k in PLAIN}
    options.update(axes=self.axes, precision=self.precision,
                   offload=self.offload, quantize=self.quantize,
                   blocks=self.blocks)
    return options

  # each group read back from the flat fields (`_GroupOf`)
  axes = _GroupOf(Axes)
  precision = _GroupOf(Precision)
  offload = _GroupOf(Offload)   # None without offload
  quantize = _GroupOf(Quantize)
  blocks = _GroupOf(Blocks)

  @classmethod
  def from_deepspeed(cls, config, **options) -> "ZeroConfig":
    """The configuration a DeepSpeed JSON (a dict or a path) describes, for
    `zerojax.shard(state, config=cfg)`; `options` are further options over
    it. Every key is mapped, accepted without effect for a stated reason,
    or refused naming it (`zerojax.deepspeed`, `docs/deepspeed.md`). The
    `optimizer` and `scheduler` sections are
    `zerojax.deepspeed.optimizer(config)`'s."""
    given = expand(options)
    fields = deepspeed.config_fields(config, world_size=jax.device_count(),
                                     options=given)
    return cls.from_fields(**{**with_loss_scale(fields), **given})

  def _set_fields(self, given: dict) -> None:
    """Sets every field (defaults for those not given), then checks them:
    each group where it is built, then the rules that join groups."""
    for f in dataclasses.fields(self):
      object.__setattr__(self, f.name, given.get(f.name, f.default))
    stage = self.stage
    if isinstance(stage, bool) or not isinstance(stage, (int, np.integer)):
      raise TypeError(f"stage={stage!r} must be an int: 0 (data parallel), "
                      "1, 2 or 3 (or shard(stage='auto')).")
    if stage not in (0, 1, 2, 3):
      raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0 (data "
                       "parallel), 1, 2 or 3.")
    object.__setattr__(self, "stage", int(stage))
    if self.placement not in PLACEMENTS:
      raise ValueError(f"placement={self.placement!r} is internal; use "
                       "offload='auto' with device_budget=.")
    fields = self.fields()
    for group in (Axes, Precision, Quantize, Blocks):
      fields.update(group.from_fields(fields).fields())
    offload = Offload.from_fields(fields)
    if self.placement == "manual" and offload is not None:
      fields.update(offload.fields())
    elif fields["update_on"] is None:
      fields["update_on"] = "device"
    for name, value in fields.items():
      object.__setattr__(self, name, value)
    for name in ("chunk_size", "min_chunk_size", "search_range",
                 "search_interval", "accum_steps", "train_batch_size",
                 "hpz_partition_size"):
      groups.check_int(name, getattr(self, name), optional=name in (
          "chunk_size", "train_batch_size", "hpz_partition_size"))
    self._check_joins()
    if self.frozen is not None and not callable(self.frozen):
      # A tree of bools is hashed as part of the static state: freeze it.
      leaves, treedef = jax.tree_util.tree_flatten(self.frozen)
      if not all(isinstance(x, (bool, np.bool_)) for x in leaves):
        raise TypeError("frozen must be a callable params -> tree of bools, "
                        "or a tree of Python bools matching the parameters.")
      object.__setattr__(self, "frozen", _FrozenMask(
          tuple(bool(x) for x in leaves), treedef))

  def _check_joins(self) -> None:
    """The rules between options: each group alone is checked where it is
    built (`zerojax._options.groups`)."""
    clip = self.clip_norm
    if clip is not None and (isinstance(clip, bool) or not isinstance(
        clip, (int, float, np.integer, np.floating))):
      raise TypeError(f"clip_norm={clip!r} must be a number, not "
                      f"{type(clip).__name__}.")
    if clip is not None and not clip > 0:
      raise ValueError(f"clip_norm={clip!r} must be positive or None (no "
                       "clipping).")
    if self.stage == 0 and (self.offload_optimizer or self.offload_params or
                            self.placement != "manual"):
      raise ValueError("offload needs stage >= 1 (stage 0 keeps everything "
                       "replicated, nothing to offload); use stage=1, 2 or "
                       "3.")
    if self.offload_params and self.stage != 3:
      raise ValueError(f"Offload(params=True) needs stage=3 (got stage="
                       f"{self.stage}): only stage 3 shards the parameters.")
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
              if self.placement == "plan" else "offload='auto' plans")
      raise ValueError(f"{what} for a device memory budget; give "
                       "device_budget= (bytes, or a fraction in (0, 1] of the "
                       "device's memory).")
    if self.placement == "manual" and budget is not None:
      raise ValueError(f"device_budget={budget!r} is read by offload='auto' "
                       "(and stage='auto') only; set offload='auto' too, or "
                       "drop it.")
    if (self.update_on == "host" and not self.offload_optimizer
        and self.placement == "manual"):
      raise ValueError("Offload(update_on='host') runs the update where the "
                       "offloaded optimizer state lives; offload it "
                       "(Offload(optimizer=True)) or leave update_on.")
    if (self.update_on == "host" and self.stage in (1, 2)
        and not self.mixed_precision):
      what = ("the disk tier (its update runs on the host)" if self.disk
              else "Offload(update_on='host')")
      raise ValueError(
          f"{what} at stage {self.stage} needs 16-bit compute "
          "(precision='bf16' or 'fp16'): at float32 the master is the "
          "replicated compute copy, kept on the device. Use stage=3, 16-bit "
          "compute" + (", or offload='host'." if self.disk
                       else ", or update_on='device'."))
    if self.hpz and self.stage == 0:
      raise ValueError("Axes(hpz=True) needs stage >= 1 (stage 0 keeps "
                       "everything replicated); use stage=1, 2 or 3.")
    if self.model_axis is not None and self.disk:
      raise ValueError(
          f"Axes(model={self.model_axis!r}) (tensor parallelism) does not "
          "combine with the disk tier yet (it streams whole shards); use "
          "offload='host', or train without a model axis.")
    if self.disk and self.placement != "manual":
      raise ValueError(f"placement={self.placement!r} plans host offload "
                       "only, not the disk tier.")
    if self.frozen_dtype not in (None, "int8"):
      raise ValueError(f"frozen_dtype={self.frozen_dtype!r}: use None (the "
                       "compute dtype) or 'int8' (frozen matrices "
                       "block-quantized).")
    if self.frozen_dtype is not None and self.frozen is None:
      raise ValueError(f"frozen_dtype={self.frozen_dtype!r} sets how frozen "
                       "weights are stored, but nothing is frozen: pass "
                       "frozen=... (a callable params -> tree of bools), or "
                       "drop frozen_dtype.")

  @property
  def disk(self) -> bool:
    """Whether offloaded optimizer state lives on disk (the disk tier)."""
    return self.offload_optimizer == DISK

  @property
  def mixed_precision(self) -> bool:
    return self.compute_dtype != np.dtype(jnp.float32)


def collectives_overlap(mesh) -> bool:
  """Whether `mesh`'s devices run collectives beside compute (GPUs, TPUs);
  XLA's CPU backend runs each collective as a copy that blocks the
  device. What a step orders for overlap (prefetch's default, the update
  after the backward at stage 3) is decided by it."""
  return mesh.devices.flat[0].platform != "cpu"


def prefetches(config: ZeroConfig, mesh) -> bool:
  """`config.prefetch`, its default (None) decided for `mesh`'s devices: on
  where collectives run beside compute, off on XLA's CPU backend."""
  if config.prefetch is not None:
    return bool(config.prefetch)
  return collectives_overlap(mesh)


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
