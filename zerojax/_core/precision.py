"""Loss scaling for float16 compute: scale, unscale, skip and adapt.

Under bfloat16 or float32 no scaling is needed and none of this runs.
"""
from __future__ import annotations

from typing import Optional, Union

import jax
import jax.numpy as jnp
from flax import struct

from zerojax._options.config import DynamicLossScale


class LossScaleState(struct.PyTreeNode):
  """The current scale and the count of finite steps since it last changed."""
  scale: jax.Array
  good_steps: jax.Array


def init(policy: Union[None, float, DynamicLossScale]) -> Optional[LossScaleState]:
  if policy is None:
    return None
  value = policy.init_scale if isinstance(policy, DynamicLossScale) else policy
  return LossScaleState(scale=jnp.asarray(value, jnp.float32),
                        good_steps=jnp.zeros((), jnp.int32))


def update(policy, state: LossScaleState, finite: jax.Array) -> LossScaleState:
  """Next scale: back off on overflow, grow after a run of finite steps."""
  if not isinstance(policy, DynamicLossScale):
    return state  # a fixed scale never changes
  grow = finite & (state.good_steps + 1 >= policy.growth_interval)
  scale = jnp.where(
      finite,
      jnp.where(grow, state.scale * policy.growth_factor, state.scale),
      jnp.maximum(state.scale * policy.backoff, policy.min_scale))
  good = jnp.where(finite & ~grow, state.good_steps + 1, 0)
  return LossScaleState(scale=scale.astype(jnp.float32),
                        good_steps=good.astype(jnp.int32))


def all_finite(tree) -> jax.Array:
  leaves = jax.tree_util.tree_leaves(tree)
  return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))
