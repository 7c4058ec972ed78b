"""zerojax: ZeRO (Zero Redundancy Optimizer) for JAX and Flax.

    state = zerojax.shard(train_state, stage=3)
    step = zerojax.train_step(loss_fn)
    state, metrics = step(state, batch)
    outputs = zerojax.eval_step(eval_fn)(state, batch)
    params = zerojax.gather_params(state)

The public surface is `__all__` (docs/design.md, "Public surface"); the
modules `checkpoint`, `losses` and `nn`, and `compat.with_gpu_flags`, are
public too. Everything else (the chunk layout, the policy, collectives)
is internal: importable, but free to change.
"""
from zerojax import compat as _compat
_compat.gpu_flags_at_import()   # before anything here could start jax
from zerojax.config import ZeroConfig  # noqa: E402
from zerojax.groups import (Axes, Blocks, DynamicLossScale, Offload,
                            Precision, Quantize)
from zerojax.evaluation import eval_step
from zerojax import checkpoint, deepspeed, losses, nn
from zerojax.layout import ChunkLayout   # internal: importable, not in __all__
from zerojax.memory import (MemoryReport, compiled_footprint, estimate_memory,
                            memory_report)
from zerojax.planner import OffloadPlan, plan_offload
from zerojax.autoconfig import Plan, plan
from zerojax.sharded_init import create
from zerojax.gathered import gather_model, gather_params
from zerojax.state import ZeroTrainState, shard, shard_shape
from zerojax.step import train_step

__all__ = ["Axes", "Blocks", "DynamicLossScale", "MemoryReport", "Offload",
           "OffloadPlan", "Plan", "Precision", "Quantize", "ZeroConfig",
           "ZeroTrainState", "checkpoint", "compiled_footprint", "create",
           "deepspeed",
           "estimate_memory", "eval_step", "gather_model", "gather_params",
           "losses", "memory_report", "nn", "plan", "plan_offload", "shard",
           "shard_shape", "train_step"]
__version__ = "0.1.0"
