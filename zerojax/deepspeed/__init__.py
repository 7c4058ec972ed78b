"""DeepSpeed configurations read as they are.

`ZeroConfig.from_deepspeed(config)` turns a DeepSpeed JSON (a dict or a
path) into a zerojax configuration; `zerojax.shard(state, strategy=...)`
takes Lightning's DeepSpeed strategy names; `optimizer(config)` turns the
`optimizer` and `scheduler` sections into one optax transformation with
DeepSpeed's semantics. Every key is mapped (`config_fields`), accepted as a
no-op for the reason `NO_OPS` gives, or refused naming it: nothing is
dropped silently. `docs/deepspeed.md` is the key-by-key table.

This package reads dicts and builds optax objects only (`_optimizer`: the
optimizer and scheduler sections): it imports nothing else of zerojax
(`config` imports it).
"""
from __future__ import annotations

import json
import logging
import os
from typing import Union

import optax

from zerojax.deepspeed import _optimizer

_log = logging.getLogger("zerojax")

# Lightning's `strategy=` names (lightning.pytorch.strategies.DeepSpeedStrategy
# registrations) as the DeepSpeed sections they stand for.
STRATEGIES = {
    "deepspeed": {"stage": 2},
    "deepspeed_stage_1": {"stage": 1},
    "deepspeed_stage_2": {"stage": 2},
    "deepspeed_stage_2_offload": {"stage": 2,
                                  "offload_optimizer": {"device": "cpu"}},
    "deepspeed_stage_3": {"stage": 3},
    "deepspeed_stage_3_offload": {"stage": 3,
                                  "offload_optimizer": {"device": "cpu"},
                                  "offload_param": {"device": "cpu"}},
    "deepspeed_stage_3_offload_nvme": {"stage": 3,
                                       "offload_optimizer": {"device": "nvme"},
                                       "offload_param": {"device": "nvme"}},
}

# Keys accepted without effect, and why (the docs table quotes these).
NO_OPS = {
    "contiguous_gradients": "chunks are contiguous by construction",
    "allgather_partitions": "parameters are always all-gathered",
    "stage3_prefetch_bucket_size": "stage 3 gathers per block, one block "
                                   "ahead with prefetch (overlap_comm)",
    "stage3_max_live_parameters": "per-block gathering bounds the live "
                                  "parameters to about two blocks",
    "stage3_max_reuse_distance": "a block's parameters are gathered again in "
                                 "its backward pass",
    "stage3_param_persistence_threshold": "parameters outside repeated blocks "
                                          "are held for the step; blocks are "
                                          "gathered per call",
    "stage3_gather_16bit_weights_on_model_save": "export_params and "
                                                 "gather_params give whole "
                                                 "weights",
    "stage3_gather_fp16_weights_on_model_save": "export_params and "
                                                "gather_params give whole "
                                                "weights",
    "round_robin_gradients": "every device reduces its own shards",
    "elastic_checkpoint": "checkpoints restore on any device count",
    "ignore_unused_parameters": "an unused parameter gets a zero gradient",
    "load_from_fp32_weights": "checkpoints keep the fp32 master",
    "memory_efficient_linear": "XLA chooses the kernels",
    "use_multi_rank_bucket_allreduce": "collectives are XLA's",
    "pin_memory": "host offload uses pinned_host memory",
    "buffer_count": "XLA schedules the transfers",
    "buffer_size": "XLA schedules the transfers",
    "max_in_cpu": "XLA schedules the transfers",
    "fast_init": "optimizer state is built sharded",
    "pipeline": "the disk tier streams its own reads and writes",
    "pipeline_read": "the disk tier streams its own reads and writes",
    "pipeline_write": "the disk tier streams its own reads and writes",
    "hysteresis": "zerojax backs the loss scale off at the first overflow "
                  "(hysteresis 1)",
    "consecutive_hysteresis": "zerojax backs the loss scale off at the first "
                              "overflow (hysteresis 1)",
    "auto_cast": "the loss function sees parameters in the compute dtype",
    "immediate_grad_update": "gradients are reduced in the step",
    "steps_per_print": "logging is the caller's",
    "wall_clock_breakdown": "logging is the caller's",
    "memory_breakdown": "zerojax.memory_report gives bytes per device",
    "dump_state": "logging is the caller's",
    "flops_profiler": "profiling is jax.profiler's",
    "tensorboard": "logging is the caller's",
    "wandb": "logging is the caller's",
    "csv_monitor": "logging is the caller's",
    "comms_logger": "compiled programs show their collectives",
    "zero_allow_untested_optimizer": "zerojax checks any optax "
                                     "transformation at shard()",
    "zero_force_ds_cpu_optimizer": "the update runs where offload= says",
    "activation_checkpointing": "configures DeepSpeed's checkpointing API; "
                                "zerojax's per-block remat is Blocks(remat=)",
    "sparse_gradients": "gradients are dense chunks",
    "optimizer": "zerojax.deepspeed.optimizer(config) reads it",
    "scheduler": "zerojax.deepspeed.optimizer(config) reads it",
    "train_batch_size": "checked against the micro-batch size and "
                        "accumulation",
    "train_micro_batch_size_per_gpu": "checked against train_batch_size",
}

_ZERO_MAPPED = ("stage", "offload_optimizer", "offload_param", "overlap_comm",
                "reduce_bucket_size", "allgather_bucket_size",
                "sub_group_size", "zero_hpz_partition_size",
                "zero_quantized_weights", "zero_quantized_gradients",
                "reduce_scatter", "cpu_offload")
_TOP_MAPPED = ("zero_optimization", "fp16", "bf16", "bfloat16",
               "gradient_accumulation_steps", "gradient_clipping",
               "communication_data_type", "prescale_gradients",
               "gradient_predivide_factor")
# zerojax's own chunk search stays below this many elements: a bucket at
# least this large cannot bind (see `_chunking`)
_SEARCH_TOP = 2 ** 20 + 2 ** 22


def load(config: Union[dict, str, os.PathLike]) -> dict:
  """A DeepSpeed configuration as a dict: `config` itself or its JSON file.
  Values "auto" (Hugging Face's placeholders) count as unset."""
  if isinstance(config, (str, os.PathLike)):
    try:
      with open(config) as f:
        config = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
      raise ValueError(f"cannot read the DeepSpeed configuration {config!r}: "
                       f"{e}") from None
  if not isinstance(config, dict):
    raise TypeError(f"a DeepSpeed configuration is a dict or a JSON path, "
                    f"got {type(config).__name__}.")
  return _without_auto(config)


def _without_auto(d: dict) -> dict:
  return {k: _without_auto(v) if isinstance(v, dict) else v
          for k, v in d.items() if v != "auto"}


def config_fields(config: Union[dict, str, os.PathLike],
                  world_size: int = 1) -> dict:
  """ZeroConfig fields (`stage` included) of a DeepSpeed configuration.
  `loss_scale` is a float (static) or a dict of `DynamicLossScale` fields.
  `world_size`: the data-parallel devices, to check the batch sizes."""
  ds = load(config)
  _refuse_unknown(ds, _TOP_MAPPED, "")
  zero = ds.get("zero_optimization", {})
  if not isinstance(zero, dict):
    raise TypeError(f"zero_optimization={zero!r} must be a dict.")
  _refuse_unknown(zero, _ZERO_MAPPED, "zero_optimization.")
  fields = {"stage": _stage(zero)}
  fields.update(_offload(zero, fields["stage"]))
  fields.update(_chunking(zero))
  fields.update(_communication(ds, zero))
  fields.update(_precision(ds))
  if "gradient_accumulation_steps" in ds:
    fields["accum_steps"] = int(ds["gradient_accumulation_steps"])
  if ds.get("gradient_clipping"):
    fields["clip_norm"] = float(ds["gradient_clipping"])
  _check_batch(ds, fields.get("accum_steps", 1), world_size)
  return fields


def strategy(name: str) -> dict:
  """The DeepSpeed configuration of a Lightning strategy name."""
  if name not in STRATEGIES:
    raise ValueError(f"strategy={name!r} is not one of Lightning's DeepSpeed "
                     f"strategies: {', '.join(STRATEGIES)}.")
  return {"zero_optimization": STRATEGIES[name]}


def _refuse_unknown(section: dict, mapped: tuple, where: str) -> None:
  for key in section:
    if key not in mapped and key not in NO_OPS:
      raise ValueError(
          f"DeepSpeed key {where}{key} has no zerojax equivalent (mapped: "
          f"{', '.join(mapped)}; accepted without effect: see "
          "zerojax.deepspeed.NO_OPS). Remove it, or see docs/deepspeed.md.")


def _stage(zero: dict) -> int:
  stage = zero.get("stage", 0)
  if stage not in (0, 1, 2, 3):
    raise ValueError(f"zero_optimization.stage={stage!r} is not a ZeRO stage "
                     "(0-3).")
  return int(stage)


def _offload(zero: dict, stage: int) -> dict:
  fields = {}
  optim = dict(zero.get("offload_optimizer", {}))
  if zero.get("cpu_offload"):   # DeepSpeed's older spelling
    optim.setdefault("device", "cpu")
  device = optim.get("device", "none")
  _refuse_unknown(optim, ("device", "nvme_path", "ratio"),
                  "zero_optimization.offload_optimizer.")
  if device == "cpu":
    fields["offload_optimizer"] = True
    if "ratio" in optim:
      fields["offload_fraction"] = float(optim["ratio"])
  elif device == "nvme":
    fields["offload_optimizer"] = "disk"
    if optim.get("nvme_path"):
      fields["offload_dir"] = str(optim["nvme_path"])
  elif device not in ("none", None):
    raise ValueError(f"zero_optimization.offload_optimizer.device={device!r}: "
                     "use 'cpu', 'nvme' or 'none'.")
  param = zero.get("offload_param", {})
  _refuse_unknown(param, ("device", "nvme_path"),
                  "zero_optimization.offload_param.")
  device = param.get("device", "none")
  if device in ("cpu", "nvme"):
    if stage != 3:
      raise ValueError(f"zero_optimization.offload_param needs stage 3 (got "
                       f"{stage}), as in DeepSpeed.")
    if device == "nvme":
      _log.warning("zerojax: offload_param.device='nvme': zerojax keeps "
                   "parameter shards in host memory (its disk tier holds the "
                   "optimizer state); parameters go to host memory.")
    fields["offload_params"] = True
    fields.setdefault("offload_optimizer", True)
  elif device not in ("none", None):
    raise ValueError(f"zero_optimization.offload_param.device={device!r}: "
                     "use 'cpu', 'nvme' or 'none'.")
  if fields.get("offload_optimizer") == "disk" and zero.get("sub_group_size"):
    fields["sub_group_size"] = int(zero["sub_group_size"])
  return fields


def _chunking(zero: dict) -> dict:
  """DeepSpeed's buckets bound how many elements one collective moves;
  zerojax's chunks are that unit. A bucket below the chunk search's range
  sets the chunk size; a larger one cannot bind."""
  buckets = [int(zero[k]) for k in ("reduce_bucket_size",
                                    "allgather_bucket_size") if k in zero]
  if buckets and min(buckets) < _SEARCH_TOP:
    return {"chunk_size": min(buckets)}
  return {}


def _communication(ds: dict, zero: dict) -> dict:
  fields = {}
  if "overlap_comm" in zero:
    fields["prefetch"] = bool(zero["overlap_comm"])
  if zero.get("reduce_scatter", True) is False and _stage(zero) > 0:
    raise ValueError("zero_optimization.reduce_scatter=false (an all-reduce "
                     "at stages 1-3) has no zerojax equivalent: zerojax "
                     "reduce-scatters, half the bytes. Remove the key.")
  hpz = zero.get("zero_hpz_partition_size", 1)
  if hpz and int(hpz) > 1:
    # the mesh says the partition: ('replica', 'data') with data = hpz
    fields.update(hpz=True, replica_axis="replica")
  if zero.get("zero_quantized_weights"):
    fields["quantize_weights"] = "int8"
  if zero.get("zero_quantized_gradients"):
    fields["quantize_grads"] = "int4"   # ZeRO++ qgZ
  dtype = ds.get("communication_data_type")
  if dtype is not None:
    names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
             "bfp16": "bfloat16"}
    if dtype not in names:
      raise ValueError(f"communication_data_type={dtype!r}: use one of "
                       f"{sorted(names)}.")
    fields["reduce_dtype"] = names[dtype]
  if ds.get("prescale_gradients"):
    raise ValueError("prescale_gradients=true has no zerojax equivalent: "
                     "gradients are reduced in the reduce dtype "
                     "(zerojax.Precision(reduce=...)) and divided "
                     "after. Remove the key.")
  factor = ds.get("gradient_predivide_factor", 1.0)
  if float(factor) != 1.0:
    raise ValueError(f"gradient_predivide_factor={factor!r} has no zerojax "
                     "equivalent (the result is the same mean); remove it.")
  return fields


def _precision(ds: dict) -> dict:
  fp16 = ds.get("fp16", {})
  bf16 = ds.get("bf16", ds.get("bfloat16", {}))
  _refuse_unknown(fp16, ("enabled", "loss_scale", "initial_scale_power",
                         "loss_scale_window", "min_loss_scale"), "fp16.")
  _refuse_unknown(bf16, ("enabled",), "bf16.")
  if fp16.get("enabled") and bf16.get("enabled"):
    raise ValueError("fp16 and bf16 are both enabled; enable one.")
  if bf16.get("enabled"):
    return {"compute_dtype": "bfloat16"}
  if not fp16.get("enabled"):
    return {}
  static = float(fp16.get("loss_scale", 0))
  if static > 0:
    return {"compute_dtype": "float16", "loss_scale": static}
  return {"compute_dtype": "float16", "loss_scale": {
      "init_scale": 2.0 ** fp16.get("initial_scale_power", 16),
      "growth_interval": int(fp16.get("loss_scale_window", 1000)),
      "min_scale": float(fp16.get("min_loss_scale", 1))}}


def _check_batch(ds: dict, accum: int, world_size: int) -> None:
  """DeepSpeed's own rule: train_batch_size = micro x accumulation x
  data-parallel devices."""
  total, micro = ds.get("train_batch_size"), ds.get(
      "train_micro_batch_size_per_gpu")
  if total is not None and micro is not None and (
      int(total) != int(micro) * accum * world_size):
    raise ValueError(
        f"train_batch_size={total} is not train_micro_batch_size_per_gpu="
        f"{micro} x gradient_accumulation_steps={accum} x {world_size} "
        "devices; zerojax's step takes the global batch: "
        f"{int(micro) * accum * world_size} examples here.")


def optimizer(config: Union[dict, str, os.PathLike]
              ) -> optax.GradientTransformation:
  """The `optimizer` and `scheduler` sections of a DeepSpeed configuration
  as one optax transformation, with DeepSpeed's semantics: "Adam" decouples
  weight decay (AdamW) unless `adam_w_mode` is false, in which case the decay
  is torch's L2 term; "SGD" and "Lion" as torch's; WarmupLR, WarmupDecayLR
  and WarmupCosineLR as optax schedules of the step count, logarithmic
  warm-up by default (`warmup_type`)."""
  return _optimizer.from_sections(load(config))
