"""`shard()` and `shard_shape()`: a ZeRO state from a Flax `TrainState` or an
NNX module, the entry point's arguments checked where they enter (the
options, `config=` or a Lightning `strategy=`, the mesh, the state's
fields), the configuration and mesh resolved (`config_and_mesh`), then a
layout planned and placed by `zerojax._state.build`."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Union

import jax
import numpy as np
import optax
from jax.sharding import Mesh

from zerojax._tiers import disk_tier
from zerojax._model import frontend as frontend
from zerojax._core import meshes
from zerojax._core import offload
from zerojax._core import tensor_parallel
from zerojax._options.config import UNSET, ZeroConfig, expand, given
from zerojax._options.groups import Axes, Blocks, Offload, Precision, Quantize
from zerojax._options import strategies
from zerojax._options.groups import plan_chosen
from zerojax._state.build import place, plan_state
from zerojax._state.state import (TRAIN_STATE_FIELDS, ZeroTrainState,
                                  extra_fields)

_log = logging.getLogger("zerojax")


def _front_door(stage, config, strategy, options: dict) -> tuple:
  """`(stage, config fields)` of `shard`'s arguments: a whole `config=`
  (e.g. `ZeroConfig.from_deepspeed`) or a Lightning `strategy=` name, the
  options on top of it; stage 3 when nothing says otherwise."""
  if config is not None and strategy is not None:
    raise TypeError("pass config= or strategy=, not both.")
  if isinstance(stage, str) and stage == "auto" and config is None \
      and strategy is None:
    _check_auto(options)
  fields = expand(options)
  if config is not None:
    if not isinstance(config, ZeroConfig):
      raise TypeError(f"config={config!r} must be a ZeroConfig (e.g. "
                      "ZeroConfig.from_deepspeed(ds_config)).")
    base = config.fields()
  elif strategy is not None:
    base = strategies.fields(strategy)
  elif isinstance(stage, str) and stage == "auto":
    # laid out at stage 3 until the first step chooses (`zerojax.plan`)
    return 3, {**fields, "placement": "plan"}
  else:
    return (3 if stage is None else stage), fields
  chosen = base.pop("stage")
  if stage is not None and stage != chosen:
    source = "config" if config is not None else "strategy"
    raise ValueError(f"stage={stage!r} contradicts the {source}'s stage "
                     f"{chosen}; pass one of them.")
  return chosen, {**base, **fields}


def _check_auto(options: dict) -> None:
  """stage="auto" chooses the offload, the quantized collectives and the
  blocks' remat itself (`zerojax.plan`): giving them is refused."""
  given = plan_chosen(options)
  if given:
    raise ValueError(f"stage='auto' chooses {', '.join(given)} itself (the "
                     "plan's choice); drop them, or give a stage.")


def shard(state: Any, stage: Union[None, int, str] = None,
          mesh: Optional[Mesh] = None, *,
          tx: Optional[optax.GradientTransformation] = None, optimizer=None,
          config: Optional[ZeroConfig] = None, strategy: Optional[str] = None,
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
          frozen_dtype: Optional[str] = UNSET,
          **unknown) -> ZeroTrainState:
  """Turns a Flax `TrainState`, or an NNX model, into a ZeRO `ZeroTrainState`.

  The keyword options after `strategy` (`axes`, `precision`, `offload`,
  `quantize`, `blocks`, `device_budget`, `chunk_size`, `clip_norm`,
  `accum_steps`, `frozen`, `frozen_dtype`) are `ZeroConfig`'s
  (`help(zerojax.ZeroConfig)`: `offload="host"`, `precision="bf16"`, ...),
  over `config`'s or `strategy`'s; those left unset are theirs, or the
  defaults.

  Args:
    state: a `flax.training.train_state.TrainState` (or subclass; extra fields
      are kept as they are; its optimizer state, trained or fresh, is kept),
      or a `flax.nnx.Module` (its `nnx.Param` variables are trained, every
      other variable is kept and updated by the step: `zerojax._model.frontend`).
    stage: ZeRO stage 0-3 (see `ZeroConfig`); default 3, or the stage of
      `config` / `strategy`; or "auto" with `device_budget=`: the first
      `train_step` call chooses the stage, remat and offload for its
      program (`zerojax.plan`), lays the state out so and says so once;
      until then the state is at stage 3, everything offloadable on host.
    mesh: device mesh; None puts every device on one axis named "data".
    tx: for an NNX model, the optax optimizer (fresh state)...
    optimizer: ...or an `nnx.Optimizer(model, tx, wrt=nnx.Param)`, whose
      state and step count are kept.
    config: a whole `ZeroConfig`, e.g. `ZeroConfig.from_deepspeed(ds)`.
    strategy: or a Lightning / accelerate strategy name: DeepSpeed's
      (`"deepspeed_stage_3_offload"`, `zerojax.deepspeed.STRATEGIES`) or
      FSDP's (`"fsdp"`, `"fsdp_shard_grad_op"`, `"hybrid_shard"`,
      `zerojax._options.strategies.FSDP`).

  Returns:
    The sharded state; the input state (or model) is left untouched.

  Example:
    >>> state = zerojax.shard(state, stage=3, precision="bf16")
    >>> state = zerojax.shard(nnx_model, stage=3, tx=optax.adamw(1e-3))
  """
  options = given(locals())
  stage, fields = _front_door(stage, config, strategy, options)
  state = _from_front_end(state, tx, optimizer)
  config, mesh, extras, static_extras = _check_train_state(
      state, stage, mesh, fields)
  dims, params, opt_state = _model_split(state, config, mesh)
  placed = place(params, opt_state, state.step, extras,
                 static_extras, tx=state.tx, apply_fn=state.apply_fn,
                 config=config, mesh=mesh, model_dims=dims)
  return disk_tier.spill(placed)


def shard_shape(state: Any, stage: Optional[int] = None,
                mesh: Optional[Mesh] = None, *,
                tx: Optional[optax.GradientTransformation] = None,
                optimizer=None, config: Optional[ZeroConfig] = None,
                strategy: Optional[str] = None,
                **options) -> ZeroTrainState:
  """What `shard` returns, as `jax.ShapeDtypeStruct`s carrying their
  shardings and memory kinds: nothing is allocated or moved. For planning
  and ahead-of-time compiles (`zerojax.plan_offload`, `step.lower`); `state`
  may itself hold `ShapeDtypeStruct`s (`jax.eval_shape` of the init), or be
  an NNX model (`nnx.eval_shape` of its constructor). Arguments as for
  `shard`."""
  stage, fields = _front_door(stage, config, strategy, options)
  state = _from_front_end(state, tx, optimizer)
  config, mesh, extras, static_extras = _check_train_state(
      state, stage, mesh, fields)
  dims, params, opt_state = _model_split(state, config, mesh)
  _, shapes, where = plan_state(params, opt_state, state.step, extras,
                                static_extras, tx=state.tx, apply_fn=state.apply_fn,
                                config=config, mesh=mesh, model_dims=dims)
  return disk_tier.spill(jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, where))


def _model_split(state, config, mesh) -> tuple:
  """`(model dims, params, opt_state)`: per parameter leaf the dim the model
  splits over `config.model_axis` (`zerojax._core.tensor_parallel`), and the
  parameters and optimizer state without Flax's partitioning boxes."""
  data = (config.axis_name, config.replica_axis)
  dims = tensor_parallel.model_dims(state.params, config.model_axis, mesh, data)
  return (dims, tensor_parallel.unboxed(state.params),
          tensor_parallel.unboxed(state.opt_state))


def _from_front_end(state, tx, optimizer):
  """A `TrainState`: `state` itself, or the one an NNX model becomes."""
  if frontend.is_nnx(state):
    return frontend.from_nnx(state, tx=tx, optimizer=optimizer)
  if tx is not None or optimizer is not None:
    raise TypeError("shard(tx=..., optimizer=...) is for NNX models; a "
                    f"{type(state).__name__} carries its own tx.")
  return state


def _check_train_state(state, stage, mesh, fields) -> tuple:
  """(config, mesh, extras, static extras) of a `shard` call's arguments."""
  if isinstance(state, ZeroTrainState):
    raise ValueError("this state is already a ZeroTrainState; shard() takes "
                     "an ordinary TrainState. To change stage or mesh, gather "
                     "it (zerojax.gather_params) or go through a checkpoint.")
  missing = [f for f in TRAIN_STATE_FIELDS if not hasattr(state, f)]
  if missing:
    raise TypeError(f"shard() takes a flax TrainState; {type(state).__name__} "
                    f"has no {', '.join(missing)}.")
  config, mesh = config_and_mesh(stage, mesh, fields)
  return (config, mesh) + extra_fields(state)


_SAID_ONE_DEVICE: list = []   # the one-device warning, once per process


def config_and_mesh(stage, mesh, fields: dict) -> tuple:
  """`(ZeroConfig, mesh)` of the stage, mesh and config fields (`expand`ed
  from the options a user passed to `shard`, `create` or
  `checkpoint.restore`), checked where they enter: a mesh without the
  config's axes is refused, an Explicit mesh is used through its Auto copy,
  offload needs host memory."""
  config = ZeroConfig.from_fields(stage=stage, **fields)
  mesh = meshes.auto_mesh(mesh if mesh is not None
                          else meshes.default_mesh(config.axis_name))
  if config.placement in ("auto", "plan"):
    config = _most_offload(config, mesh)
  for field, name in (("axis_name", "data"), ("replica_axis", "replica"),
                      ("model_axis", "model")):
    axis = getattr(config, field)
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"mesh axes {mesh.axis_names} have no axis {axis!r}; "
                       f"pass axes=zerojax.Axes({name}=...) one of them or "
                       "build the mesh with that axis.")
  partition = config.hpz_partition_size
  if partition is not None and meshes.axes_size(mesh, config.axis_name) != (
      partition):
    raise ValueError(
        f"the DeepSpeed configuration's zero_hpz_partition_size={partition} "
        f"is the size of the mesh's {config.axis_name!r} axis (hpZ's "
        f"partition), which is {meshes.axes_size(mesh, config.axis_name)} "
        f"here: build the mesh with axes ('replica', {config.axis_name!r}) "
        f"of sizes ({mesh.devices.size // partition}, {partition}).")
  if config.offload_optimizer or config.offload_params:
    offload.check_backend(mesh)
  if mesh.devices.size == 1 and config.stage > 0 and not _SAID_ONE_DEVICE:
    _SAID_ONE_DEVICE.append(True)
    _log.warning(
        "ZeRO-%d over 1 device: nothing is sharded. On a CPU machine "
        "set XLA_FLAGS=--xla_force_host_platform_device_count=8 before the "
        "first `import jax` for 8 simulated devices.", config.stage)
  return config, mesh


def _most_offload(config: ZeroConfig, mesh) -> ZeroConfig:
  """offload="auto" before its first step: everything offloadable on host
  (the planner's last rung), so that the state fits before the plan; the
  device budget's fraction checked against what the devices report."""
  device_budget_bytes(config, mesh)
  if not offload.has_host_memory(mesh):
    return config   # nothing to offload, the plan agrees
  return config.replace(offload_optimizer=True,
                        offload_params=config.stage == 3,
                        offload_fraction=1.0)


def device_budget_bytes(config: ZeroConfig, mesh) -> int:
  """`config.device_budget` in bytes per device: itself, or its fraction of
  the first device's `memory_stats()["bytes_limit"]`."""
  return budget_in_bytes(config.device_budget, mesh)


def budget_in_bytes(budget, mesh) -> int:
  """A device budget in bytes per device: itself, or (a float in (0, 1])
  its fraction of the mesh's first device's `memory_stats()["bytes_limit"]`."""
  if isinstance(budget, (float, np.floating)) and budget <= 1.0:
    device = mesh.devices.flat[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError(
          f"device_budget={budget!r} is a fraction of device memory, but "
          f"{device.platform} devices report none (memory_stats() has no "
          "bytes_limit); give the budget in bytes.")
    return int(budget * stats["bytes_limit"])
  return int(budget)
