"""Tensor parallelism beside ZeRO: which dim of each parameter the model
splits over `ZeroConfig.model_axis`, read from the user's Flax code.

A Flax model says how its weights are split with `nn.with_partitioning`
(mesh axis names per dim), `nn.with_logical_partitioning` (logical names,
mapped to mesh axes by the rules active at `shard`, or the box's own), or
by parameters already placed with a `NamedSharding`. zerojax reads the dim
split over the model axis (`model_dims`), packs each such leaf as one row
per model device (`zerojax._core.layout`), and hands the model plain arrays
(`unboxed`). Axes other than the model axis in a spec (an FSDP axis, the
data axis) are ZeRO's business and are ignored.
"""
from __future__ import annotations

from typing import Any, Optional

import jax
import flax.linen as nn
from flax.core import meta
from jax.sharding import NamedSharding


def _is_box(x) -> bool:
  return isinstance(x, meta.AxisMetadata)


def unboxed(tree: Any) -> Any:
  """`tree` with Flax's partitioning boxes stripped (plain arrays)."""
  return meta.unbox(tree)


def _spec(x) -> tuple:
  """The mesh axes per dim of leaf `x` (a box, or an array), () if none."""
  if isinstance(x, nn.LogicallyPartitioned):
    rules = x.rules if x.rules is not None else nn.get_logical_axis_rules()
    return tuple(nn.logical_to_mesh_axes(x.names, rules))
  if _is_box(x) and hasattr(x, "get_partition_spec"):
    return tuple(x.get_partition_spec())
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return tuple(sharding.spec)
  return ()


def _axes(entry) -> tuple:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def model_dims(params: Any, model_axis: Optional[str], mesh,
               data_axes: tuple) -> tuple:
  """Per leaf of `unboxed(params)` (tree order), the dim the model splits
  over `model_axis`, or None.

  Raises ValueError where a leaf splits two dims over the model axis, or a
  dim over the model axis together with another axis, and where, without a
  `model_axis`, a leaf is split over an axis of `mesh` other than the data
  axes (the model asks for tensor parallelism the config did not name).
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(params, is_leaf=_is_box)
  others = [a for a in mesh.axis_names if a not in data_axes]
  dims = []
  for path, leaf in flat:
    name = jax.tree_util.keystr(path)
    spec = _spec(leaf)
    if model_axis is None:
      used = sorted({a for e in spec for a in _axes(e) if a in others})
      if used:
        raise ValueError(
            f"parameter {name} is split over mesh axis {used[0]!r} (spec "
            f"{spec}), but no model axis was given: pass axes=zerojax."
            f"Axes(model={used[0]!r}) for tensor parallelism beside ZeRO, or build the "
            "mesh without that axis.")
      dims.append(None)
      continue
    split = [d for d, e in enumerate(spec) if model_axis in _axes(e)]
    if len(split) > 1:
      raise ValueError(
          f"parameter {name} is split over the model axis {model_axis!r} on dims "
          f"{split} (spec {spec}); zerojax keeps a weight split on one dim "
          "only. Split it on one dim.")
    if split and len(_axes(spec[split[0]])) > 1:
      raise ValueError(
          f"parameter {name} splits dim {split[0]} over {spec[split[0]]} "
          f"(spec {spec}); zerojax keeps a dim split over the model "
          f"axis {model_axis!r} alone (ZeRO itself shards over the data axis). "
          f"Give that dim {model_axis!r} only.")
    dims.append(split[0] if split else None)
  return tuple(dims)
