"""`shard(state, strategy=name)`: the strategy names users bring from
Lightning and accelerate, as the ZeroConfig fields they stand for.

DeepSpeed's (`"deepspeed_stage_3_offload"`, ...) are DeepSpeed sections,
read by `zerojax.deepspeed`; FSDP's name the sharding FSDP does, which is a
ZeRO stage: FULL_SHARD is stage 3, SHARD_GRAD_OP stage 2, HYBRID_SHARD
stage 3 within a node and replicated across (HSDP), CPU offload stage 3 with
the parameters and optimizer state in host memory.
"""
from __future__ import annotations

from zerojax import deepspeed
from zerojax._options.config import expand, with_loss_scale
from zerojax._options.groups import Axes, Offload

# Lightning's `strategy=` and accelerate's `fsdp_sharding_strategy` names
FSDP = {
    "fsdp": dict(stage=3),
    "fsdp_full_shard": dict(stage=3),
    "fsdp_shard_grad_op": dict(stage=2),
    "hybrid_shard": dict(stage=3, axes=Axes(replica="replica")),
    "fsdp_cpu_offload": dict(stage=3, offload=Offload("host", params=True)),
}


def names() -> list:
  return list(deepspeed.STRATEGIES) + list(FSDP)


def fields(name) -> dict:
  """The ZeroConfig fields (stage included) of a strategy name."""
  if not isinstance(name, str):
    raise TypeError(f"strategy={name!r} must be a strategy name: "
                    f"{', '.join(names())}.")
  if name in FSDP:
    options = dict(FSDP[name])
    return {"stage": options.pop("stage"), **expand(options)}
  if name in deepspeed.STRATEGIES:
    return with_loss_scale(deepspeed.config_fields(deepspeed.strategy(name)))
  raise ValueError(f"strategy={name!r} is not one of Lightning's or "
                   f"accelerate's strategy names zerojax maps: "
                   f"{', '.join(names())}.")
