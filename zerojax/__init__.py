"""zerojax: ZeRO (Zero Redundancy Optimizer) for JAX and Flax.

    state = zerojax.shard(train_state, stage=3)
    step = zerojax.train_step(loss_fn)
    state, metrics = step(state, batch)
    outputs = zerojax.eval_step(eval_fn)(state, batch)
    params = zerojax.gather_params(state)

The public surface is `__all__` (docs/design.md, "Public surface"); the
modules `checkpoint`, `deepspeed`, `losses` and `nn` are public too.
Everything else lives in packages named with a leading underscore
(docs/design.md, "Package map"): importable, but free to change.
"""
from zerojax._core import logs as _logs  # noqa: F401 - the log's last resort
from zerojax._core import compat as _compat
from zerojax._core.compat import with_gpu_flags
_compat.gpu_flags_at_import()   # before anything here could start jax
from zerojax._options.config import ZeroConfig  # noqa: E402
from zerojax._options.groups import (Axes, Blocks, DynamicLossScale, Offload,
                                     Precision, Quantize)
from zerojax._train.evaluation import eval_step
from zerojax import checkpoint, deepspeed, losses, nn
# internal: importable, not in __all__
from zerojax._core.layout import ChunkLayout  # noqa: F401 (state.layout)
from zerojax._state.memory import (MemoryReport, compiled_footprint,
                                   estimate_memory, memory_report)
from zerojax._plan.planner import OffloadPlan, plan_offload
from zerojax._plan.autoconfig import Plan, plan
from zerojax._plan.targets import GpuTarget
from zerojax._state.sharded_init import create
from zerojax._state.gathered import gather_model, gather_params
from zerojax._state.shard import shard, shard_shape
from zerojax._state.state import ZeroTrainState
from zerojax._first_step import train_step

__all__ = ["Axes", "Blocks", "DynamicLossScale", "GpuTarget", "MemoryReport", "Offload",
           "OffloadPlan", "Plan", "Precision", "Quantize", "ZeroConfig",
           "ZeroTrainState", "checkpoint", "compiled_footprint", "create",
           "deepspeed",
           "estimate_memory", "eval_step", "gather_model", "gather_params",
           "losses", "memory_report", "nn", "plan", "plan_offload", "shard",
           "shard_shape", "train_step", "with_gpu_flags"]
__version__ = "0.1.0"
