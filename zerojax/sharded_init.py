"""Sharded initialisation (DeepSpeed's `zero.Init`, Gemini's
`LazyInitContext`): a ZeroTrainState built straight from an init function,
without the full parameters or optimizer state ever on one device.

`init_fn` is traced with `jax.eval_shape` to compute the chunk layout. A
sharded chunk is then filled leaf by leaf, each leaf by its own jitted
program: `init_fn` runs with every other leaf dead-code eliminated, the leaf
is constrained to be sharded (the partitionable threefry RNG computes only
this device's part), gathered, and this device keeps the window of it that
falls in its slice of the chunk (the chunk shard is donated from program to
program; small leaves share a program up to the largest leaf's bytes).
Separate programs, rather than one per chunk, are what bounds the
peak: inside one program XLA's scheduler keeps several gathered leaves alive
at once (measured: 18.9 MB temp for a chunk whose largest leaf is 4.2 MB).
At any moment a device holds the shards made so far plus one leaf, so the
peak is about the sharded state plus the largest leaf. Values equal
`jax.jit(init_fn)(rng)` followed by `zerojax.shard`, bit for bit.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax import precision
from zerojax.state import (ZeroTrainState, _config_and_mesh, chunk_spec,
                           leaf_spec, master_is_sharded, plan_layout,
                           state_shardings)


@dataclasses.dataclass
class _ChunkPrograms:
  """The jitted programs that make one chunk: `start(rng)` gives the master
  chunk (all of it when replicated, zeros when sharded), each of `leaves`
  maps `(rng, master) -> master` adding one leaf's window (master donated),
  and `cast(master)` gives the replicated 16-bit compute copy, if kept."""
  start: Callable
  leaves: list
  cast: Optional[Callable]

  def __call__(self, rng):
    master = self.start(rng)
    for add_leaf in self.leaves:
      master = add_leaf(rng, master)
    return master, (self.cast(master) if self.cast else None)


def create(init_fn: Callable, rng: jax.Array, *, apply_fn: Callable,
           tx: optax.GradientTransformation, stage: int = 3,
           mesh: Optional[Mesh] = None, **config_fields) -> ZeroTrainState:
  """Builds a ZeroTrainState without ever materialising the full parameters
  or optimizer state on one device (see the module docstring).

  Args:
    init_fn: `init_fn(rng) -> params` (e.g. `lambda r: model.init(r, x)["params"]`).
    rng: the PRNG key handed to `init_fn`.
    apply_fn, tx: as for `TrainState.create`.
    stage, mesh, **config_fields: as for `zerojax.shard`.
  """
  chunks, rest_program, assemble = _create_programs(
      init_fn, rng, apply_fn, tx, stage, mesh, config_fields)
  made = [make(rng) for make in chunks]
  master = tuple(m for m, _ in made)
  compute = tuple(c for _, c in made if c is not None)
  return assemble(master, compute, rest_program(rng))


def create_footprint(init_fn: Callable, rng: jax.Array, *, apply_fn: Callable,
                     tx: optax.GradientTransformation, stage: int = 3,
                     mesh: Optional[Mesh] = None, **config_fields) -> dict:
  """Per-device bytes `create` needs at its peak, from the compiled programs:
  the chunks made so far plus the running program's argument + output +
  temp - alias (see `zerojax.compiled_footprint`).

  Returns:
    {"peak": bytes, "programs": the footprint dict of every program, in the
    order `create` runs them}.
  """
  from zerojax.memory import compiled_footprint
  chunks, rest_program, assemble = _create_programs(
      init_fn, rng, apply_fn, tx, stage, mesh, config_fields)
  held, peak, prints = 0, 0, []

  def run(program, *args):
    nonlocal peak
    fp = compiled_footprint(program.lower(*args).compile())
    peak = max(peak, held + fp["footprint"])
    prints.append(fp)
    return jax.eval_shape(program, *args)

  made = []
  for make in chunks:
    master = run(make.start, rng)
    for add_leaf in make.leaves:
      master = run(add_leaf, rng, master)
    held += _bytes_per_device(master)
    compute = run(make.cast, master) if make.cast else None
    held += _bytes_per_device(compute) if compute is not None else 0
    made.append((master, compute))
  rest = run(rest_program, rng)
  held += _bytes_per_device(rest)
  # the assembling program's arguments are the chunks held so far (donated)
  held = 0
  run(assemble, tuple(m for m, _ in made),
      tuple(c for _, c in made if c is not None), rest)
  return {"peak": peak, "programs": prints}


def _bytes_per_device(tree) -> int:
  return sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize
             for x in jax.tree_util.tree_leaves(tree))


def _create_programs(init_fn, rng, apply_fn, tx, stage, mesh, config_fields):
  if not callable(init_fn):
    raise TypeError(f"init_fn={init_fn!r} must be a function rng -> params.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx={tx!r} must be an optax GradientTransformation.")
  config, mesh = _config_and_mesh(stage, mesh, config_fields)
  layout = plan_layout(tx, jax.eval_shape(init_fn, rng), config,
                       mesh.shape[config.axis_name])
  rep = NamedSharding(mesh, P())
  with_compute = config.stage in (1, 2) and config.mixed_precision

  largest = max((layout.leaves[i].size * layout.leaves[i].dtype.itemsize
                 for c in layout.chunks for i in c.leaves), default=0)

  def leaves_of(rng):
    return layout.treedef.flatten_up_to(init_fn(rng))

  def chunk_programs(c):
    chunk = layout.chunks[c]
    cast = (jax.jit(lambda m: m.astype(config.compute_dtype), out_shardings=rep)
            if with_compute else None)
    if not master_is_sharded(config):
      return _ChunkPrograms(
          jax.jit(lambda rng: layout.pack_chunk(c, leaves_of(rng)),
                  out_shardings=rep), [], cast)
    sharding = NamedSharding(mesh, chunk_spec(len(chunk.shape), config.axis_name))
    start = jax.jit(lambda rng: jnp.zeros(chunk.shape, chunk.dtype),
                    out_shardings=sharding)

    def add_leaves(rng, master, group):
      leaves = leaves_of(rng)
      for i in group:
        master = _add_leaf_window(layout, c, i, leaves[i], master, mesh,
                                  config.axis_name)
      return master

    add = [jax.jit(lambda rng, master, group=group: add_leaves(rng, master, group),
                   out_shardings=sharding, donate_argnums=1)
           for group in _leaf_groups(layout, chunk.leaves, largest)]
    return _ChunkPrograms(start, add, cast)

  def make_rest(rng):
    leaves = leaves_of(rng)
    return tuple(leaves[i] for i in layout.rest_indices)

  def assemble(master, compute, rest):
    return ZeroTrainState(
        step=jnp.zeros((), jnp.int32), master=master, compute=compute,
        rest=rest, opt_state=tx.init(layout.views(master)),
        loss_scale=precision.init(config.loss_scale), extras={},
        apply_fn=apply_fn, tx=tx, layout=layout, config=config, mesh=mesh)

  chunks = [chunk_programs(c) for c in range(len(layout.chunks))]
  rest_program = jax.jit(make_rest, out_shardings=rep)
  shapes = [jax.eval_shape(make, rng) for make in chunks]
  args = (tuple(m for m, _ in shapes),
          tuple(c for _, c in shapes if c is not None),
          jax.eval_shape(make_rest, rng))
  out = state_shardings(jax.eval_shape(assemble, *args))
  return (chunks, rest_program,
          jax.jit(assemble, out_shardings=out, donate_argnums=(0, 1, 2)))


def _leaf_groups(layout, leaves, limit) -> list:
  """Consecutive leaves grouped up to `limit` bytes: one program per group
  (fewer compilations) still holds at most the largest leaf's bytes."""
  groups, size = [], limit
  for i in leaves:
    nbytes = layout.leaves[i].size * layout.leaves[i].dtype.itemsize
    if size + nbytes > limit:
      groups.append([])
      size = 0
    groups[-1].append(i)
    size += nbytes
  return groups


def _add_leaf_window(layout, c, i, leaf, master, mesh, axis_name):
  """`master` (chunk `c`, sharded) with leaf `i` written into it: the leaf is
  made sharded, gathered, and each device keeps the window of it that falls
  in its slice of the chunk."""
  chunk, info = layout.chunks[c], layout.leaves[i]
  n = mesh.shape[axis_name]
  width = chunk.length // n
  lead = (chunk.layers,) if chunk.layers else ()
  spec = leaf_spec(leaf.shape, n, axis_name)
  leaf = jax.lax.with_sharding_constraint(leaf, NamedSharding(mesh, spec))

  def local(part, master):
    for d, name in enumerate(spec):
      if name is not None:
        part = jax.lax.all_gather(part, axis_name, axis=d, tiled=True)
    flat = jnp.reshape(part, lead + (-1,)).astype(chunk.dtype)
    # position p of this device's slice holds leaf element start + p - offset
    j = (jax.lax.axis_index(axis_name) * width + jnp.arange(width)
         - info.offset)
    inside = (j >= 0) & (j < info.size)
    window = jnp.take(flat, jnp.clip(j, 0, info.size - 1), axis=len(lead))
    return jnp.where(inside, window, master)

  spec_chunk = chunk_spec(len(chunk.shape), axis_name)
  return jax.shard_map(local, mesh=mesh, in_specs=(spec, spec_chunk),
                       out_specs=spec_chunk, check_vma=False)(leaf, master)
