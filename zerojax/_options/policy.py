"""What a configured ZeRO stage does, decided once from `ZeroConfig`.

FSDP2 hands small policy objects (`MixedPrecisionPolicy`, `OffloadPolicy`)
to the parts that need them; zerojax derives one `StagePolicy` from the
config, and `state`, `sharded_init`, `step` and `planner` read it instead of
testing `stage` and `mixed_precision` themselves. How a reduction travels
is not the policy's: quantization (qwZ / qgZ) is the `collectives.Wire`
every collective takes, and hpZ's replica hop follows the data-axis
reduction in `grads` (`ZeroConfig.hpz`).

  stage  master (fp32)     compute copy     optimizer  forward reads      gradient reduction
  0      replicated        -                replicated master, cast        all-reduce per step
  1      replicated (fp32) -                sharded    master             reduce-scatter per step
         sharded (16-bit)  replicated 16-bit           compute copy
  2      as stage 1                                    as stage 1         reduce-scatter per micro-batch
  3      sharded           -                sharded    gathered shards    the gather's transpose
         on disk (16-bit   sharded 16-bit,             compute shards
         disk tier)        host memory                 gathered
"""
from __future__ import annotations

import dataclasses
import enum

from zerojax._options.config import ZeroConfig


class Reduction(enum.Enum):
  """How the gradient of a micro-batch reaches the update."""
  ALL_REDUCE = "all-reduce of the accumulated gradient"          # stage 0
  SCATTER_PER_STEP = "reduce-scatter of the accumulated gradient"  # stage 1
  SCATTER_PER_MICRO = "reduce-scatter of each micro-batch's gradient"  # 2
  GATHER_TRANSPOSE = "reduce-scatter by the gather's transpose"  # stage 3


class Forward(enum.Enum):
  """Which copy of the parameters the forward pass reads."""
  MASTER = "the replicated master, cast to the compute dtype"
  COMPUTE = "the replicated 16-bit compute copy"
  GATHERED = "the master shards, gathered"


@dataclasses.dataclass(frozen=True)
class StagePolicy:
  """The decisions of one configured stage (`policy(config)`).

  Attributes:
    stage: the ZeRO stage.
    forward: which copy the forward pass reads (`Forward`).
    reduction: how gradients are reduced (`Reduction`).
    master_sharded: the fp32 master chunks are sharded (stage 3, and stages
      1-2 under 16-bit compute, where the compute copy is replicated);
      otherwise replicated.
    compute_copy: a persistent replicated compute-dtype copy is kept
      (stages 1-2 under 16-bit compute).
    optimizer_sharded: the optimizer state is sharded (stages 1-3).
    update_slice: the update writes this device's slice of a replicated
      master (float32 stages 1-2), which the re-gather then fills.
    regather: after the update the shards are all-gathered (stages 1-2):
      into the compute copy under 16-bit compute, else into the master.
    gathers_params: parameters are gathered for the forward (stage 3):
      layer stacks and unrolled blocks may be gathered per layer / block.
    sharded_compute: a persistent sharded compute-dtype copy of each disk
      chunk is kept in host memory, and the gathers read it (stage 3 under
      the disk tier with 16-bit compute: its fp32 master lives on disk,
      read by the update only, as at stages 1-2).
  """
  stage: int
  forward: Forward
  reduction: Reduction
  master_sharded: bool
  compute_copy: bool
  optimizer_sharded: bool
  update_slice: bool
  regather: bool
  gathers_params: bool
  sharded_compute: bool = False

  @property
  def layer_hooks(self) -> bool:
    """A layer stack whose scanned block is wrapped with
    `zerojax.nn.layerwise` is handed to the block one layer at a time: its
    shards, which the block gathers (stage 3), or its replicated rows,
    whose gradient the block reduce-scatters as the backward pass leaves
    the layer (stage 2), inside the loop where the next layer's backward
    can hide it, not after the whole backward pass."""
    return self.gathers_params or self.reduction is Reduction.SCATTER_PER_MICRO

  @property
  def grads_sharded(self) -> bool:
    """The reduced gradient leaves the step sharded (stages 1-3)."""
    return self.reduction is not Reduction.ALL_REDUCE


def policy(config: ZeroConfig) -> StagePolicy:
  """The `StagePolicy` of `config` (the only place that reads its stage)."""
  stage, mixed = config.stage, config.mixed_precision
  middle = stage in (1, 2)
  return StagePolicy(
      stage=stage,
      forward=(Forward.GATHERED if stage == 3 else
               Forward.COMPUTE if middle and mixed else Forward.MASTER),
      reduction={0: Reduction.ALL_REDUCE, 1: Reduction.SCATTER_PER_STEP,
                 2: Reduction.SCATTER_PER_MICRO,
                 3: Reduction.GATHER_TRANSPOSE}[stage],
      master_sharded=stage == 3 or (middle and mixed),
      compute_copy=middle and mixed,
      optimizer_sharded=stage >= 1,
      update_slice=middle and not mixed,
      regather=middle,
      gathers_params=stage == 3,
      sharded_compute=stage == 3 and mixed and config.disk)
