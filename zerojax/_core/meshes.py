"""The device mesh a ZeRO state runs on: the default one, the Auto-axes
copy of a user's mesh that the step needs, and how a leaf of the tree
form is split over it (`leaf_spec`), or a shaped leaf in the step
(`shaped_spec`)."""
from __future__ import annotations

import functools
import logging
import math

import jax
from jax.sharding import AxisType, Mesh, PartitionSpec as P

_log = logging.getLogger("zerojax")


def default_mesh(axis_name: str = "data") -> Mesh:
  """All devices on one axis, with Auto axis types (shard_map friendly)."""
  return jax.make_mesh((jax.device_count(),), (axis_name,),
                       axis_types=(AxisType.Auto,))


def axes_size(mesh: Mesh, axes) -> int:
  """Devices along mesh axis `axes`, or along a tuple of axes together."""
  names = axes if isinstance(axes, tuple) else (axes,)
  return math.prod(mesh.shape[a] for a in names)


def auto_mesh(mesh: Mesh) -> Mesh:
  """`mesh` itself when its axes are Auto, else an Auto copy (same devices
  and names), said once per mesh: the step's update runs outside
  `shard_map` on sharded chunks, written for GSPMD's Auto propagation;
  under Explicit axes (`jax.make_mesh`'s default) jax refuses its sharded
  reductions ("Contracting dimensions are sharded")."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  _say_auto_copy(mesh)
  return Mesh(mesh.devices, mesh.axis_names,
              axis_types=(AxisType.Auto,) * len(mesh.axis_names))


@functools.cache
def _say_auto_copy(mesh: Mesh) -> None:
  _log.warning(
      "the mesh's axes %s are %s; the ZeRO state uses a copy of the "
      "mesh with Auto axes (same devices and axis names; state.mesh), since "
      "its update is written for Auto sharding. To keep your own mesh, build "
      "it with Auto axes: jax.make_mesh(shape, names, axis_types=(AxisType."
      "Auto,) * len(names)).", mesh.axis_names,
      tuple(str(t) for t in mesh.axis_types))


def leaf_spec(shape, n, axis_name, last: bool = False) -> P:
  """A leaf sharded on its largest axis the device count divides: the
  first of equal ones, or with `last` the last."""
  dims = sorted((d for d in range(len(shape)) if shape[d] % n == 0),
                key=lambda d: (-shape[d], -d if last else d))
  spec = [None] * len(shape)
  if dims:
    spec[dims[0]] = axis_name
  return P(*spec)


def shaped_spec(shape, n, axis_name, multiplies: bool, rows: int = 0) -> P:
  """A shaped leaf's view or statistic in the step ([Note: shaped leaves]):
  for a transform that multiplies matrices (`multiplies`), split on its
  largest dim, the last of equal ones (the columns a square matrix's
  `X @ X.T` contracts); for any other, on its rows (dim `rows`: 1 under a
  layer axis) where the devices divide them, as its flat shards already
  hold it, so that no collective moves it there; else as `leaf_spec`."""
  if multiplies:
    return leaf_spec(shape, n, axis_name, last=True)
  if len(shape) > rows and shape[rows] % n == 0:
    return P(*([None] * rows), axis_name, *([None] * (len(shape) - rows - 1)))
  return leaf_spec(shape, n, axis_name)
