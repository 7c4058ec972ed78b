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
from typing import Optional, Union

import numpy as np
import optax

from zerojax.deepspeed import _optimizer
from zerojax.deepspeed import _values as values
from zerojax.deepspeed._values import AUTO

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

_LOGGING = "logging is the caller's"
_TRANSFERS = "XLA schedules the transfers"
_WHOLE = "export_params and gather_params give whole weights"
_REMAT = ("zerojax's per-block remat needs no checkpointing API: "
          "Blocks(remat=) on the blocks it finds")
# Keys accepted without effect, section by section, and why (the docs table
# quotes these). A key is a no-op only in the section DeepSpeed reads it in.
NO_OPS = {
    "activation_checkpointing.": {
        "partition_activations": "a block's saved activations are laid out "
                                 "as its own sharding lays them out (split "
                                 "over Axes.model where tensor parallelism "
                                 "splits them); nothing more to partition",
        "contiguous_memory_optimization": "XLA places the saved activations",
        "number_checkpoints": _REMAT,
        "synchronize_checkpoint_boundary": "no host synchronisation: one "
                                           "program per step",
        "profile": _LOGGING,
    },
    "": {
        "steps_per_print": _LOGGING,
        "wall_clock_breakdown": _LOGGING,
        "memory_breakdown": "zerojax.memory_report gives bytes per device",
        "dump_state": _LOGGING,
        "flops_profiler": "profiling is jax.profiler's",
        "tensorboard": _LOGGING,
        "wandb": _LOGGING,
        "csv_monitor": _LOGGING,
        "comms_logger": "compiled programs show their collectives",
        "zero_allow_untested_optimizer": "zerojax checks any optax "
                                         "transformation at shard()",
        "zero_force_ds_cpu_optimizer": "the update runs where offload= says",
        "sparse_gradients": "gradients are dense chunks",
        "optimizer": "zerojax.deepspeed.optimizer(config) reads it",
        "scheduler": "zerojax.deepspeed.optimizer(config) reads it",
    },
    "zero_optimization.": {
        "contiguous_gradients": "chunks are contiguous by construction",
        "allgather_partitions": "parameters are always all-gathered",
        "stage3_prefetch_bucket_size": "stage 3 gathers per block, one block "
                                       "ahead with prefetch (overlap_comm)",
        "stage3_max_live_parameters": "per-block gathering bounds the live "
                                      "parameters to about two blocks",
        "stage3_max_reuse_distance": "a block's parameters are gathered "
                                     "again in its backward pass",
        "stage3_param_persistence_threshold": "parameters outside repeated "
                                              "blocks are held for the step; "
                                              "blocks are gathered per call",
        "stage3_gather_16bit_weights_on_model_save": _WHOLE,
        "stage3_gather_fp16_weights_on_model_save": _WHOLE,
        "round_robin_gradients": "every device reduces its own shards",
        "elastic_checkpoint": "checkpoints restore on any device count",
        "ignore_unused_parameters": "an unused parameter gets a zero gradient",
        "load_from_fp32_weights": "checkpoints keep the fp32 master",
        "memory_efficient_linear": "XLA chooses the kernels",
        "use_multi_rank_bucket_allreduce": "collectives are XLA's",
    },
    "zero_optimization.offload_optimizer.": {
        "pin_memory": "host offload uses pinned_host memory",
        "buffer_count": _TRANSFERS,
        "fast_init": "optimizer state is built sharded",
        "pipeline": "the disk tier streams its own reads and writes",
        "pipeline_read": "the disk tier streams its own reads and writes",
        "pipeline_write": "the disk tier streams its own reads and writes",
    },
    "zero_optimization.offload_param.": {
        "pin_memory": "host offload uses pinned_host memory",
        "buffer_count": _TRANSFERS,
        "buffer_size": _TRANSFERS,
        "max_in_cpu": _TRANSFERS,
    },
    "fp16.": {
        "hysteresis": "zerojax backs the loss scale off at the first "
                      "overflow (hysteresis 1)",
        "consecutive_hysteresis": "zerojax backs the loss scale off at the "
                                  "first overflow (hysteresis 1)",
        "auto_cast": "the loss function sees parameters in the compute dtype",
    },
    "bf16.": {
        "immediate_grad_update": "gradients are reduced in the step",
    },
}

# The keys each section maps (docs/deepspeed.md's tables).
MAPPED = {
    "": ("zero_optimization", "fp16", "bf16", "bfloat16",
         "activation_checkpointing",
         "gradient_accumulation_steps", "gradient_clipping",
         "communication_data_type", "prescale_gradients",
         "gradient_predivide_factor", "train_batch_size",
         "train_micro_batch_size_per_gpu"),
    "zero_optimization.": ("stage", "offload_optimizer", "offload_param",
                           "overlap_comm", "reduce_bucket_size",
                           "allgather_bucket_size", "sub_group_size",
                           "zero_hpz_partition_size", "zero_quantized_weights",
                           "zero_quantized_gradients", "reduce_scatter",
                           "cpu_offload"),
    "zero_optimization.offload_optimizer.": ("device", "nvme_path", "ratio"),
    "zero_optimization.offload_param.": ("device", "nvme_path"),
    "fp16.": ("enabled", "loss_scale", "initial_scale_power",
              "loss_scale_window", "min_loss_scale"),
    "bf16.": ("enabled",),
    "activation_checkpointing.": ("cpu_checkpointing",),
}
# "auto" in these is zerojax's own choice (its chunk search, per-block
# gathering), as Hugging Face fills them from the model's hidden size
_OURS_WHEN_AUTO = ("zero_optimization.reduce_bucket_size",
                   "zero_optimization.allgather_bucket_size",
                   "zero_optimization.stage3_prefetch_bucket_size",
                   "zero_optimization.stage3_param_persistence_threshold",
                   "zero_optimization.stage3_max_live_parameters",
                   "zero_optimization.stage3_max_reuse_distance",
                   "zero_optimization.sub_group_size",
                   # only checks: the step sees the batch it is given
                   "train_batch_size", "train_micro_batch_size_per_gpu")
# the option that fills each "auto" (ZeroConfig.from_deepspeed(cfg, **options))
_FILLED_BY = {"fp16.enabled": "precision=", "bf16.enabled": "precision=",
              "bfloat16.enabled": "precision=",
              "gradient_accumulation_steps": "accum_steps=",
              "gradient_clipping": "clip_norm="}
# zerojax's own chunk search stays below this many elements: a bucket at
# least this large cannot bind (see `_chunking`)
_SEARCH_TOP = 2 ** 20 + 2 ** 22


def load(config: Union[dict, str, os.PathLike]) -> dict:
  """A DeepSpeed configuration as a dict: `config` itself or its JSON file
  ("auto" values kept: whoever reads a key fills or refuses them)."""
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
  return config


def config_fields(config: Union[dict, str, os.PathLike], world_size: int = 1,
                  options: Optional[dict] = None) -> dict:
  """ZeroConfig fields (`stage` included) of a DeepSpeed configuration.
  `loss_scale` is a float (static) or a dict of `DynamicLossScale` fields.
  `world_size`: the data-parallel devices, for the batch sizes.
  `options`: the ZeroConfig fields the caller passes beside it, which fill
  its "auto" values (`_FILLED_BY`); an "auto" left unfilled is refused."""
  ds = _filled(load(config), options or {})
  _refuse_unknown(ds, "")
  zero = values.section(ds, "zero_optimization", "")
  _refuse_unknown(zero, "zero_optimization.")
  fields = {"stage": _stage(zero)}
  fields.update(_offload(zero, fields["stage"]))
  fields.update(_chunking(zero))
  fields.update(_communication(ds, zero, world_size))
  fields.update(_precision(ds))
  fields.update(_batch(ds, world_size))
  fields.update(_activations(ds))
  if "gradient_clipping" in ds:
    clip = values.number(ds["gradient_clipping"], "gradient_clipping")
    if clip > 0:   # DeepSpeed clips only above 0
      fields["clip_norm"] = clip
  return fields


def _filled(ds: dict, options: dict) -> dict:
  """`ds` with its "auto" values as the caller's options fill them, and
  those zerojax chooses itself removed; any other "auto" is refused,
  naming the option that fills it. The optimizer and scheduler sections
  are `optimizer`'s."""
  ds = {k: v for k, v in ds.items() if k not in ("optimizer", "scheduler")}
  dtype = options.get("compute_dtype")
  if dtype is not None:
    name = np.dtype(dtype).name
    for key in ("fp16", "bf16", "bfloat16"):
      if isinstance(ds.get(key), dict) and ds[key].get("enabled") == AUTO:
        ds[key] = {**ds[key], "enabled": name == (
            "float16" if key == "fp16" else "bfloat16")}
  for key, field in (("gradient_accumulation_steps", "accum_steps"),
                     ("gradient_clipping", "clip_norm")):
    if ds.get(key) == AUTO and field in options:
      ds[key] = options[field] or 0
  if ds.get("gradient_accumulation_steps") == AUTO and all(
      isinstance(ds.get(k), (int, float)) for k in (
          "train_batch_size", "train_micro_batch_size_per_gpu")):
    del ds["gradient_accumulation_steps"]   # derived, as DeepSpeed does
  left = [k for k in values.autos(ds) if k not in _OURS_WHEN_AUTO
          and not _is_no_op(k)]
  values.refuse_autos(left, _FILLED_BY)
  return _without(ds, set(values.autos(ds)))


def _is_no_op(key: str) -> bool:
  where, _, name = key.rpartition(".")
  return name in NO_OPS.get(f"{where}." if where else "", {})


def _without(tree: dict, keys: set, where: str = "") -> dict:
  return {k: _without(v, keys, f"{where}{k}.") if isinstance(v, dict) else v
          for k, v in tree.items() if f"{where}{k}" not in keys}


def strategy(name: str) -> dict:
  """The DeepSpeed configuration of a Lightning strategy name."""
  if name not in STRATEGIES:
    raise ValueError(f"strategy={name!r} is not one of Lightning's DeepSpeed "
                     f"strategies: {', '.join(STRATEGIES)}.")
  return {"zero_optimization": STRATEGIES[name]}


def _refuse_unknown(section: dict, where: str) -> None:
  mapped, no_ops = MAPPED[where], NO_OPS.get(where, {})
  for key in section:
    if key not in mapped and key not in no_ops:
      raise ValueError(
          f"DeepSpeed key {where}{key} has no zerojax equivalent (mapped "
          f"there: {', '.join(mapped)}; accepted without effect there: "
          f"{', '.join(no_ops) or 'none'}). Remove it; zerojax.deepspeed.MAPPED "
          "and NO_OPS list every key by section (the docs' \"DeepSpeed and "
          "Lightning\" page, docs/deepspeed.md, says what each does).")


def _activations(ds: dict) -> dict:
  """`activation_checkpointing.cpu_checkpointing: true` (ZeRO-R): each
  block's saved matmul outputs in pinned host memory between the passes,
  `Blocks(remat="offload")`; DeepSpeed's other keys there drive its own
  checkpointing API, which zerojax's per-block remat does not need."""
  where = "activation_checkpointing."
  section = values.section(ds, "activation_checkpointing", "")
  _refuse_unknown(section, where)
  return ({"remat": "offload"} if _flag(section, "cpu_checkpointing", where)
          else {})


def _stage(zero: dict) -> int:
  stage = zero.get("stage", 0)
  if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
    raise ValueError(f"DeepSpeed key zero_optimization.stage={stage!r} is not "
                     "a ZeRO stage (0-3).")
  return int(stage)


def _device(section: dict, where: str) -> str:
  device = section.get("device", "none")
  return values.choice("none" if device is None else device,
                       f"{where}device", ("cpu", "nvme", "none"))


def _offload(zero: dict, stage: int) -> dict:
  fields = {}
  where = "zero_optimization.offload_optimizer."
  optim = dict(values.section(zero, "offload_optimizer", "zero_optimization."))
  _refuse_unknown(optim, where)
  if "cpu_offload" in zero and values.boolean(
      zero["cpu_offload"], "zero_optimization.cpu_offload"):
    optim.setdefault("device", "cpu")   # DeepSpeed's older spelling
  device = _device(optim, where)
  if device == "cpu":
    fields["offload_optimizer"] = True
    if "ratio" in optim:
      ratio = values.number(optim["ratio"], f"{where}ratio")
      if not 0.0 < ratio <= 1.0:
        raise ValueError(f"DeepSpeed key {where}ratio={optim['ratio']!r} is "
                         "the share offloaded: above 0, at most 1.")
      fields["offload_fraction"] = ratio
  elif device == "nvme":
    fields["offload_optimizer"] = "disk"
    if optim.get("nvme_path"):
      fields["offload_dir"] = str(optim["nvme_path"])
  where = "zero_optimization.offload_param."
  param = values.section(zero, "offload_param", "zero_optimization.")
  _refuse_unknown(param, where)
  if _device(param, where) != "none":
    if stage != 3:
      raise ValueError(f"DeepSpeed key {where}device={param['device']!r} "
                       f"needs zero_optimization.stage 3 (got {stage}), as in "
                       "DeepSpeed.")
    if param["device"] == "nvme":
      _log.warning("offload_param.device='nvme': zerojax keeps "
                   "parameter shards in host memory (its disk tier holds the "
                   "optimizer state); parameters go to host memory.")
    # the optimizer stays on the device unless offload_optimizer says
    # otherwise, as in DeepSpeed
    fields["offload_params"] = True
    fields.setdefault("offload_optimizer", False)
  if fields.get("offload_optimizer") == "disk" and zero.get("sub_group_size"):
    fields["sub_group_size"] = values.count(
        zero["sub_group_size"], "zero_optimization.sub_group_size", 1)
  return fields


def _chunking(zero: dict) -> dict:
  """DeepSpeed's buckets bound how many elements one collective moves;
  zerojax's chunks are that unit. A bucket below the chunk search's range
  sets the chunk size (0, which DeepSpeed reads as a collective per
  parameter: one leaf per chunk); a larger one cannot bind."""
  buckets = [values.count(zero[k], f"zero_optimization.{k}")
             for k in ("reduce_bucket_size", "allgather_bucket_size")
             if k in zero]
  if buckets and min(buckets) < _SEARCH_TOP:
    return {"chunk_size": max(1, min(buckets))}
  return {}


def _flag(section: dict, key: str, where: str, default: bool = False) -> bool:
  return (values.boolean(section[key], f"{where}{key}") if key in section
          else default)


def _communication(ds: dict, zero: dict, world_size: int) -> dict:
  fields = {}
  z = "zero_optimization."
  if "overlap_comm" in zero:
    fields["prefetch"] = _flag(zero, "overlap_comm", z)
  if not _flag(zero, "reduce_scatter", z, True) and _stage(zero) > 0:
    raise ValueError("DeepSpeed key zero_optimization.reduce_scatter="
                     f"{zero['reduce_scatter']!r} (an all-reduce at stages "
                     "1-3) has no zerojax equivalent: zerojax reduce-scatters, "
                     "half the bytes. Remove the key.")
  hpz = values.count(zero.get("zero_hpz_partition_size", 1),
                     f"{z}zero_hpz_partition_size", 1)
  if hpz > 1:
    if world_size % hpz:
      raise ValueError(f"DeepSpeed key {z}zero_hpz_partition_size={hpz} does "
                       f"not divide the {world_size} devices.")
    # the mesh says the partition: ('replica', 'data') with data = hpz
    fields.update(hpz=True, replica_axis="replica", hpz_partition_size=hpz)
  if _flag(zero, "zero_quantized_weights", z):
    fields["quantize_weights"] = "int8"
  if _flag(zero, "zero_quantized_gradients", z):
    fields["quantize_grads"] = "int4"   # ZeRO++ qgZ
  dtype = ds.get("communication_data_type")
  if dtype is not None:
    names = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16",
             "bfp16": "bfloat16"}
    fields["reduce_dtype"] = names[values.choice(
        dtype, "communication_data_type", tuple(names))]
  if _flag(ds, "prescale_gradients", ""):
    raise ValueError(f"DeepSpeed key prescale_gradients="
                     f"{ds['prescale_gradients']!r} has no zerojax "
                     "equivalent: gradients are reduced in the reduce dtype "
                     "(zerojax.Precision(reduce=...)) and divided after. "
                     "Remove the key.")
  factor = ds.get("gradient_predivide_factor", 1.0)
  if values.number(factor, "gradient_predivide_factor") != 1.0:
    raise ValueError(f"DeepSpeed key gradient_predivide_factor={factor!r} has "
                     "no zerojax equivalent (the result is the same mean); "
                     "remove it.")
  return fields


def _precision(ds: dict) -> dict:
  fp16 = values.section(ds, "fp16", "")
  bf16_key = "bf16" if "bf16" in ds else "bfloat16"
  bf16 = values.section(ds, bf16_key, "")
  _refuse_unknown(fp16, "fp16.")
  _refuse_unknown(bf16, "bf16.")
  fp16_on, bf16_on = (_flag(fp16, "enabled", "fp16."),
                      _flag(bf16, "enabled", f"{bf16_key}."))
  if fp16_on and bf16_on:
    raise ValueError("DeepSpeed keys fp16.enabled and bf16.enabled are both "
                     "true; enable one.")
  if bf16_on:
    return {"compute_dtype": "bfloat16"}
  if not fp16_on:
    return {}
  static = values.number(fp16.get("loss_scale", 0), "fp16.loss_scale")
  if static > 0:
    return {"compute_dtype": "float16", "loss_scale": static}
  if static < 0:
    raise ValueError(f"DeepSpeed key fp16.loss_scale={fp16['loss_scale']!r}: "
                     "0 (dynamic) or a positive static scale.")
  return {"compute_dtype": "float16", "loss_scale": {
      "init_scale": 2.0 ** values.number(fp16.get("initial_scale_power", 16),
                                         "fp16.initial_scale_power"),
      "growth_interval": values.count(fp16.get("loss_scale_window", 1000),
                                      "fp16.loss_scale_window", 1),
      "min_scale": values.number(fp16.get("min_loss_scale", 1),
                                 "fp16.min_loss_scale")}}


def _batch(ds: dict, world_size: int) -> dict:
  """DeepSpeed's batch rule, train_batch_size = micro x accumulation x
  data-parallel devices, with the accumulation derived from the two batch
  sizes where it is not given (as DeepSpeed derives it). The step takes
  the global batch, train_batch_size examples, and checks it
  (`train_batch_size`)."""
  total = (values.count(ds["train_batch_size"], "train_batch_size", 1)
           if "train_batch_size" in ds else None)
  micro = (values.count(ds["train_micro_batch_size_per_gpu"],
                        "train_micro_batch_size_per_gpu", 1)
           if "train_micro_batch_size_per_gpu" in ds else None)
  accum = (values.count(ds["gradient_accumulation_steps"],
                        "gradient_accumulation_steps", 1)
           if "gradient_accumulation_steps" in ds else None)
  if accum is None and total is not None and micro is not None:
    accum = max(1, total // (micro * world_size))
  known = accum or 1
  if total is not None and micro is not None and (
      total != micro * known * world_size):
    raise ValueError(
        f"DeepSpeed keys train_batch_size={total}, "
        f"train_micro_batch_size_per_gpu={micro} and "
        f"gradient_accumulation_steps={known} disagree on {world_size} "
        f"devices: DeepSpeed needs train_batch_size = micro x accumulation x "
        f"devices = {micro * known * world_size}.")
  fields = {} if accum is None else {"accum_steps": accum}
  if total is None and micro is not None:
    total = micro * known * world_size
  if total is not None:
    fields["train_batch_size"] = total
  return fields


def optimizer(config: Union[dict, str, os.PathLike], *,
              lr: Optional[float] = None, betas: Optional[tuple] = None,
              eps: Optional[float] = None,
              weight_decay: Optional[float] = None,
              warmup_steps: Optional[int] = None,
              total_steps: Optional[int] = None
              ) -> optax.GradientTransformation:
  """The `optimizer` and `scheduler` sections of a DeepSpeed configuration
  as one optax transformation, with DeepSpeed's semantics: "Adam" decouples
  weight decay (AdamW) unless `adam_w_mode` is false, in which case the decay
  is torch's L2 term; "SGD" and "Lion" as torch's; WarmupLR, WarmupDecayLR
  and WarmupCosineLR as optax schedules of the step count, logarithmic
  warm-up by default (`warmup_type`).

  The keyword arguments fill the configuration's "auto" values, as Hugging
  Face's Trainer fills them from its own arguments: `lr` the optimizer's
  `lr` and the scheduler's `warmup_max_lr`, `betas`, `eps`, `weight_decay`
  the optimizer's, `warmup_steps` and `total_steps` the scheduler's
  `warmup_num_steps` and `total_num_steps` (`warmup_min_lr` "auto" is 0,
  as the Trainer fills it). An "auto" left unfilled is refused, naming it;
  an argument that disagrees with a value the configuration states is
  refused too."""
  return _optimizer.from_sections(load(config), dict(
      lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
      warmup_steps=warmup_steps, total_steps=total_steps))
