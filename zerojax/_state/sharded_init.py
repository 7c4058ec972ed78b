"""Sharded initialisation (DeepSpeed's `zero.Init`, Gemini's
`LazyInitContext`): a ZeroTrainState built straight from an init function,
without the full parameters or optimizer state ever on one device.

`init_fn` is traced with `jax.eval_shape` to compute the chunk layout. A
sharded chunk is then filled leaf by leaf, each leaf by its own jitted
program: `init_fn` runs with every other leaf dead-code eliminated, the leaf
is constrained to be sharded (the partitionable threefry RNG computes only
this device's part), gathered, and this device keeps the window of it that
falls in its slice of the chunk (the chunk shard is donated from program to
program; small leaves share a program up to the largest leaf's bytes, or
1 MiB if more).
Separate programs, rather than one per chunk, are what bounds the
peak: inside one program XLA's scheduler keeps several gathered leaves alive
at once (docs/decisions.md, "Figures out of the code's comments").
At any moment a device holds the shards made so far plus one leaf, so the
peak is about the sharded state plus the largest leaf (or 1 MiB). Values equal
`jax.jit(init_fn)(rng)` followed by `zerojax.shard`, bit for bit.
`init_fn` is traced once (a jitted function every program calls, whose
trace JAX caches): a model is built in Python once, not once per program.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax._tiers import disk_tier
from zerojax._model import frontend as frontend
from zerojax._core import frozen
from zerojax._core import meshes
from zerojax._core import offload
from zerojax._core import reshard
from zerojax._core import tensor_parallel
from zerojax._options.config import expand, shard_axes
from zerojax._options.policy import policy
from zerojax._state.build import (compute_chunks, fresh_state, per_leaf,
                                  plan_layout)
from zerojax._state.shard import config_and_mesh
from zerojax._state.state import ZeroTrainState, state_shardings


@dataclasses.dataclass
class _ChunkPrograms:
  """The jitted programs that make one chunk: `start(rng)` gives the master
  chunk (all of it when replicated, zeros when sharded), each of `leaves`
  maps `(rng, master) -> master` adding one leaf's window (master donated),
  and `cast(master)` gives the 16-bit compute copy, if kept (replicated;
  sharded in host memory under `StagePolicy.sharded_compute`)."""
  start: Callable
  leaves: list
  cast: Optional[Callable]

  def __call__(self, rng) -> list:
    """`[(master, compute or None)]`, the chunk's."""
    master = self.start(rng)
    for add_leaf in self.leaves:   # one at a time: see reshard._settled
      master = jax.block_until_ready(add_leaf(rng, master))
    return [(master, self.cast(master) if self.cast else None)]


@dataclasses.dataclass
class _GroupProgram:
  """A chunk per leaf (one device, `state.per_leaf`): nothing to pack, so
  one program, `make(rng)`, makes every chunk, each as `(master, compute
  or None)`, as one program makes a replicated packed chunk. On one device
  the state holds every parameter anyway, so it holds no more than the
  state and its temporaries; one program compiles faster than a program
  or two per chunk."""
  make: Callable

  def __call__(self, rng) -> list:
    return list(jax.block_until_ready(self.make(rng)))


def create(init_fn: Callable, rng: jax.Array, *,
           apply_fn: Optional[Callable] = None,
           tx: optax.GradientTransformation, stage: int = 3,
           mesh: Optional[Mesh] = None, **options) -> ZeroTrainState:
  """Builds a ZeroTrainState without ever materialising the full parameters
  or optimizer state on one device (see the module docstring).

  Args:
    init_fn: `init_fn(rng) -> params` (e.g. `lambda r: model.init(r, x)["params"]`),
      or `init_fn(rng) -> nnx.Module` (e.g. `lambda r: Model(rngs=nnx.Rngs(r))`):
      a state as `zerojax.shard(module, tx=tx)` makes, its other variables
      made replicated beside the chunks.
    rng: the PRNG key handed to `init_fn`.
    apply_fn, tx: as for `TrainState.create` (no `apply_fn` for NNX).
    stage, mesh, **options: as for `zerojax.shard`.
  """
  chunks, rest_program, split, assemble = _create_programs(
      init_fn, rng, apply_fn, tx, stage, mesh, options)
  made = [pair for make in chunks for pair in make(rng)]
  master = tuple(m for m, _ in made)
  return disk_tier.spill(assemble(*split(master, _compute(made),
                                         rest_program(rng))))


def _compute(made: list) -> tuple:
  """`state.compute` from the made `(master, compute or None)` pairs."""
  return (tuple(c for _, c in made)
          if any(c is not None for _, c in made) else ())


def _create_programs(init_fn, rng, apply_fn, tx, stage, mesh, options):
  if not callable(init_fn):
    raise TypeError(f"init_fn={init_fn!r} must be a function rng -> params "
                    "(linen) or rng -> nnx.Module.")
  if not isinstance(tx, optax.GradientTransformation):
    raise TypeError(f"tx={tx!r} must be an optax GradientTransformation.")
  config, mesh = config_and_mesh(stage, mesh, expand(options))
  boxed_init, extras_fn, static_extras = frontend.initialiser(init_fn, rng)
  axes = shard_axes(config)
  boxed = jax.eval_shape(boxed_init, rng)
  if jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(boxed)):
    raise TypeError(
        f"init_fn returned {boxed!r:.80}, not a tree of parameter arrays: it "
        "must return the parameters (e.g. `lambda r: model.init(r, x)"
        "[\"params\"]`) or an nnx.Module (nothing was created).")
  # tensor parallelism: the dims the model splits over `model_axis`, read
  # from its partitioning boxes, which the step's tree goes without
  dims = tensor_parallel.model_dims(boxed, config.model_axis, mesh,
                                    (config.axis_name, config.replica_axis))
  init_fn = lambda r: tensor_parallel.unboxed(boxed_init(r))
  model = config.model_axis
  layout = plan_layout(tx, tensor_parallel.unboxed(boxed), config,
                       meshes.axes_size(mesh, axes), model_dims=dims,
                       model_shards=mesh.shape[model] if model else 1,
                       devices=mesh.size,
                       linen=frontend.is_linen(static_extras))
  rep = NamedSharding(mesh, P())
  pol = policy(config)
  with_compute = compute_chunks(layout, config)

  # traced once, called inside every program: the model is built (in
  # Python) once, not once per program; each program keeps what it reads
  leaves_of = jax.jit(lambda rng: layout.treedef.flatten_up_to(init_fn(rng)))

  def chunk_programs(c):
    chunk = layout.chunks[c]
    sharding = NamedSharding(
        mesh, chunk.spec(axes if pol.master_sharded else None, model))
    start, fills = reshard.pack_programs(layout, c, sharding, axes,
                                         leaves_of=leaves_of)
    whole = NamedSharding(mesh, chunk.spec(None, model))
    cast = (reshard.cast_program(config.compute_dtype, whole
                                 if pol.compute_copy else
                                 sharding.with_memory_kind(offload.HOST))
            if c in with_compute else None)
    return _ChunkPrograms(start, [fill for _, fill in fills], cast)

  def make_rest(rng):
    """The leaves outside the chunks (frozen weights as `zerojax._core.frozen`
    stores them), and the extras (NNX's other variables), replicated."""
    leaves = leaves_of(rng)
    return (frozen.stored(layout, config,
                          [leaves[i] for i in layout.rest_indices]),
            extras_fn(rng) if extras_fn else {})

  def assemble(master, compute, rest_and_extras):
    rest, extras = rest_and_extras
    return fresh_state(master, compute, rest, step=0, extras=extras,
                       static_extras=static_extras, layout=layout, tx=tx,
                       apply_fn=apply_fn, config=config, mesh=mesh)

  def single_leaf_chunks(rng):
    leaves = leaves_of(rng)
    out = []
    for c in range(len(layout.chunks)):
      master = layout.pack_chunk(c, leaves)
      out.append((master, master.astype(config.compute_dtype)
                  if c in with_compute else None))
    return tuple(out)

  if per_leaf(config, mesh.size):
    # (nothing is offloaded here: the compute copies are replicated)
    shardings = tuple(
        (NamedSharding(mesh, chunk.spec(axes if pol.master_sharded else None,
                                        model)),
         NamedSharding(mesh, chunk.spec(None, model))
         if c in with_compute else None)
        for c, chunk in enumerate(layout.chunks))
    chunks = [_GroupProgram(jax.jit(single_leaf_chunks,
                                    out_shardings=shardings))]
  else:
    chunks = [chunk_programs(c) for c in range(len(layout.chunks))]
  rest_program = jax.jit(make_rest, out_shardings=(
      frozen.shardings(layout, config, mesh), rep))
  shapes = [pair for make in chunks for pair in jax.eval_shape(make, rng)]
  args = (tuple(m for m, _ in shapes),
          _compute(shapes),
          jax.eval_shape(make_rest, rng))
  out = state_shardings(jax.eval_shape(assemble, *args))
  # The chunks are made on the device. A master the state keeps in host
  # memory (offloaded, or on its way to the disk tier's files) cannot reuse
  # its device buffer: those are passed apart, not donated (else jax warns).
  moved = frozenset(c for c, s in enumerate(out.master)
                    if s.memory_kind != offload.DEVICE)

  def split(master, compute, rest_and_extras):
    """`assemble`'s arguments as `assemble_split` takes them: the masters
    that stay on the device, and those that leave it."""
    kept = tuple(None if c in moved else m for c, m in enumerate(master))
    leaving = tuple(m if c in moved else None for c, m in enumerate(master))
    return kept, leaving, compute, rest_and_extras

  def assemble_split(kept, leaving, compute, rest_and_extras):
    master = tuple(h if m is None else m for m, h in zip(kept, leaving))
    return assemble(master, compute, rest_and_extras)

  return (chunks, rest_program, split,
          jax.jit(assemble_split, out_shardings=out, donate_argnums=(0, 2, 3)))
