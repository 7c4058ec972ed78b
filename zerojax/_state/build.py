"""A state's chunk form built from a tree: the optimizer probed on chunk
views (`check_tx`), the layout planned over the devices (`plan_layout`,
`plan_state`), and the chunks placed in their shardings and memory kinds
(`place`, `fresh_state`), with the compute copy 16-bit stages keep
(`compute_chunks`, `cast_compute`). `shard()`, sharded init and restore
all build through here."""
from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from zerojax._tiers import disk_tier
from zerojax._model import frontend as frontend
from zerojax._core import frozen
from zerojax._core import meshes
from zerojax._core import optim
from zerojax._core import optstate
from zerojax._core import precision
from zerojax._core import opt_reshard
from zerojax._core import reshard
from zerojax._options.config import ZeroConfig, shard_axes
from zerojax._core.chunking import (beside, named_units, repeated_blocks,
                                    scanned_stacks, unit_depth)
from zerojax._core.layout import ChunkLayout, path_names, shaped_labels
from zerojax._options.policy import policy
from zerojax._state.state import ZeroTrainState, state_shardings

_log = logging.getLogger("zerojax")
_SAID_SHAPED: set = set()   # the transformations said to run shaped


def _trainable(config: ZeroConfig, params) -> list:
  flat = jax.tree_util.tree_leaves(params)
  if config.frozen is None:
    return [True] * len(flat)
  mask = config.frozen(params) if callable(config.frozen) else config.frozen
  try:
    frozen = jax.tree_util.tree_structure(params).flatten_up_to(mask)
  except (ValueError, TypeError) as e:
    raise ValueError("frozen must give one bool per parameter leaf (a tree "
                     f"matching the parameters): {e}") from None
  return [not bool(f) for f in frozen]


def _abstract(params) -> Any:
  """The shapes and dtypes of `params` (arrays or shapes), read off the
  leaves: nothing traced (the dtypes as jax canonicalizes them, a numpy
  float64 array's float32 without x64, as `jax.eval_shape` gives)."""
  return jax.tree_util.tree_map(
      lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), params)


def check_tx(tx, params, config: ZeroConfig, num_shards: int = 1) -> tuple:
  """The optimizer probes (`optim`: eager runs of `tx` on a few-element
  surrogate of the tree, cached per tx and tree) on the layer stacks a
  layout over `num_shards` devices has (`layer_stacks`): the leaves'
  optimizer classes, shaped where `tx` cannot run on flat chunk views
  ([Note: shaped leaves]); raises where it cannot run on those either."""
  abstract = _abstract(params)
  trainable = _trainable(config, abstract)
  labels = optim.leaf_labels(tx, abstract, trainable)
  stacks = layer_stacks(abstract, config, num_shards)
  shaped, why = optim.shaped_leaves(tx, abstract, trainable, labels, stacks)
  if shaped:   # see [Note: shaped leaves]
    name = optim.culprit(tx, abstract, trainable, labels, stacks)
    leaves = jax.tree_util.tree_flatten_with_path(abstract)[0]
    labels = shaped_labels(labels, [i in shaped for i in range(len(leaves))])
    if config.offload_optimizer:
      raise ValueError(
          f"optax transformation {name!r} does not run on flat chunk views "
          f"({why}): zerojax keeps its leaves in their own shapes on the "
          "devices ([Note: shaped leaves]), and offloading their optimizer "
          "state is not built yet; leave offload out, or use an "
          "element-wise optimizer to offload.")
    if (name, why, shaped) not in _SAID_SHAPED:
      _SAID_SHAPED.add((name, why, shaped))
      _log.warning(
          "optax transformation %r does not run on flat chunk views "
          "(%s): %s of the %d trained leaves (%s) are each kept alone in "
          "a chunk and shown to the optimizer in their own shapes, their "
          "update running on the real tensors sharded over the data axis (a "
          "collective per leaf at stage 3; [Note: shaped leaves]).%s",
          name, why, len(shaped), sum(trainable), _some_paths(leaves, shaped),
          "" if len(shaped) == sum(trainable) else
          " The other leaves run on flat chunks.")
  optim.check_elementwise(tx, abstract, trainable, labels, stacks)
  if config.offload_optimizer:
    optim.check_separable(tx, abstract, trainable, labels, stacks)
  return labels


def _some_paths(leaves, chosen, most: int = 3) -> str:
  """The paths of the first `most` of `chosen` (indices into `leaves`,
  `tree_flatten_with_path`'s), and how many more."""
  paths = [jax.tree_util.keystr(leaves[i][0]) for i in chosen]
  more = f", and {len(paths) - most} more" if len(paths) > most else ""
  return ", ".join(paths[:most]) + more


def layer_stacks(abstract, config: ZeroConfig, num_shards: int,
                 model_dims: Optional[tuple] = None) -> tuple:
  """The layer stacks of the tree `abstract`, chunked per layer:
  `ZeroConfig.stacked`, and at stage 3 those the tree holds unnamed
  (`chunking.scanned_stacks`: outside repeated blocks; none with a leaf
  that tensor parallelism splits on its leading dim, `model_dims`), which
  the step gathers per layer where it hears one layer called inside its
  scan, as it does a named one."""
  given = tuple(config.stacked)
  if not policy(config).gathers_params:
    return given
  flat = jax.tree_util.tree_flatten_with_path(abstract)[0]
  dims = [None] * len(flat) if model_dims is None else model_dims
  # leaves a stack must not hold: split on dim 0, or in a `per_use` module
  fenced = [names for (path, _), dim in zip(flat, dims)
            for names in (path_names(path),)
            if dim == 0 or set(config.per_use) & set(names[:-1])]
  found = scanned_stacks(abstract, num_shards,
                         given + repeated_blocks(abstract, given))
  return given + tuple(s for s in found
                       if not any(unit_depth(n, s) for n in fenced))


def plan_layout(tx, params, config: ZeroConfig, num_shards: int,
                labels: Optional[tuple] = None, model_dims: Optional[tuple] = None,
                model_shards: int = 1, devices: Optional[int] = None,
                linen: bool = True) -> ChunkLayout:
  """The chunk layout of `params` (arrays or shapes) for `tx` and `config`:
  optimizer classes found, per-tensor transformations refused. `labels`
  given (a saved layout's): no probes, `tx` is not checked. `model_dims`:
  per leaf the dim split over the model axis of `model_shards` devices
  (`tensor_parallel.model_dims`). `devices`: the mesh's size; on one device
  with nothing offloaded each leaf is a chunk of its own (`per_leaf`).
  `linen`: a linen model's (an NNX model holds what is beside its
  blocks)."""
  abstract = _abstract(params)
  if labels is None:
    labels = check_tx(tx, abstract, config, num_shards)
  # stage 3 gathers a stack's chunks per layer, an unrolled block's alone
  # (`zerojax.nn.layerwise`), those of a module named in `per_use`, and
  # for a linen model, those of the modules beside them where that
  # compiles smaller (`zerojax._model.peruse`)
  stacks = layer_stacks(abstract, config, num_shards, model_dims)
  found = repeated_blocks(abstract, stacks)
  named = named_units(abstract, config.per_use, stacks, found)
  units = found + named if policy(config).gathers_params else ()
  if (stacks or units) and policy(config).gathers_params and linen and (
      config.reshard_after_forward):
    units += beside(abstract, stacks + units)
  return ChunkLayout.build(
      abstract, num_shards,
      chunk_size=1 if per_leaf(config, devices) else config.chunk_size,
      trainable=_trainable(config, abstract), labels=labels,
      stacked=stacks, units=units, model_dims=model_dims, align=align(config),
      model_shards=model_shards, min_chunk_size=config.min_chunk_size,
      search_range=config.search_range, search_interval=config.search_interval)


def align(config: ZeroConfig) -> int:
  """Where leaves may start in a chunk, in elements: at whole blocks of the
  quantized collectives (`quantize_block`), so that no block holds two
  leaves' values and a leaf's largest value sets no other leaf's scale;
  anywhere without them."""
  quantized = config.quantize_weights or config.quantize_grads
  return config.quantize_block if quantized else 1


def per_leaf(config: ZeroConfig, devices: Optional[int]) -> bool:
  """Whether each leaf is its own chunk: on a one-device mesh with no chunk
  size given and nothing offloaded. Chunks pack leaves so that a step
  sends a few large collectives; one device sends none, and a flat chunk
  costs a copy of each weight out of it before its dot and of each
  gradient into it (docs/design.md). Offloaded chunks keep their packing:
  the chunk is the unit of a host transfer, a host update and a file."""
  return (devices == 1 and config.chunk_size is None
          and config.placement == "manual"
          and not config.offload_optimizer and not config.offload_params)


def fresh_state(master, compute, rest, *, step, extras, static_extras, layout,
                tx, apply_fn, config, mesh) -> ZeroTrainState:
  """A ZeroTrainState around chunks, with fresh optimizer state (`tx.init`
  on the chunk views, kept in chunk shape) and loss scale: what `shard`
  plans and `create` fills in. Inside jit or eval_shape."""
  return ZeroTrainState(
      step=jnp.asarray(step, jnp.int32), master=master, compute=compute,
      rest=rest, opt_state=optstate.stored(layout, tx.init(layout.views(master))),
      loss_scale=precision.init(config.loss_scale), extras=extras,
      apply_fn=apply_fn, tx=tx, layout=layout, config=config, mesh=mesh,
      static_extras=static_extras)


def plan_state(params, opt_state, step, extras, static_extras, *, tx,
               apply_fn, config, mesh, labels: Optional[tuple] = None,
               model_dims: Optional[tuple] = None) -> tuple:
  """(layout, the state's shapes, its shardings) for the ordinary TrainState
  content, computed from shapes only (`labels`, `model_dims`: as in
  `plan_layout`)."""
  model = config.model_axis
  layout = plan_layout(tx, params, config,
                       meshes.axes_size(mesh, shard_axes(config)), labels,
                       model_dims, mesh.shape[model] if model else 1,
                       mesh.size, frontend.is_linen(static_extras))
  def build(params, step, extras):
    master, rest = layout.split(params)
    rest = frozen.stored(layout, config, rest)
    compute = compute_copy(master, compute_chunks(layout, config),
                           lambda c, m: m.astype(config.compute_dtype))
    return fresh_state(master, compute, rest, step=step, extras=extras,
                       static_extras=static_extras, layout=layout, tx=tx,
                       apply_fn=apply_fn, config=config, mesh=mesh)

  shapes = jax.eval_shape(build, params, step, extras)
  # the user's optimizer state must match tx (raises naming what differs)
  optstate.check_tree_state(layout, opt_state, shapes.opt_state)
  return layout, shapes, state_shardings(shapes)


def compute_chunks(layout, config) -> frozenset:
  """The chunks with a persistent compute-dtype copy (`state.compute`):
  every chunk at stages 1-2 under 16-bit compute, the disk chunks under
  `StagePolicy.sharded_compute`, else none."""
  pol = policy(config)
  if pol.compute_copy:
    return frozenset(range(len(layout.chunks)))
  if pol.sharded_compute:
    return disk_tier.disk_chunks(layout, config)
  return frozenset()


def compute_copy(master, chunks: frozenset, make: Callable) -> tuple:
  """`state.compute` for `master`: per chunk `make(c, master[c])` where `c`
  is in `chunks` and None elsewhere; `()` when `chunks` is empty."""
  if not chunks:
    return ()
  return tuple(make(c, m) if c in chunks else None
               for c, m in enumerate(master))


def cast_compute(master, where: tuple, config) -> tuple:
  """The compute copy of the master chunks (arrays), cast into its
  shardings `where` (`state_shardings(...).compute`: None for a chunk
  without one)."""
  return compute_copy(master, frozenset(
      c for c, s in enumerate(where) if s is not None),
      lambda c, m: reshard.cast_program(config.compute_dtype, where[c])(m))


def place(params, opt_state, step, extras, static_extras, *, tx, apply_fn,
          config, mesh, release: bool = False,
          model_dims: Optional[tuple] = None) -> ZeroTrainState:
  """The ZeroTrainState of the ordinary TrainState content, packed chunk by
  chunk from the leaves wherever they are (`reshard`), so no device holds
  more than its share plus one chunk. `release` deletes the chunked leaves
  of `params` and `opt_state` as they are packed (for a restore's own
  copy). `model_dims`: as in `plan_layout`."""
  layout, shapes, where = plan_state(params, opt_state, step, extras, static_extras,
                                     tx=tx, apply_fn=apply_fn, config=config,
                                     mesh=mesh, model_dims=model_dims)
  opt = opt_reshard.opt_to_views(layout, opt_state, shapes.opt_state,
                             where.opt_state, shard_axes(config), release)
  master, rest = reshard.to_chunks(layout, params, where.master,
                                   shard_axes(config), release)
  put = lambda tree, shardings: jax.tree_util.tree_map(reshard.copy, tree, shardings)
  return shapes.replace(
      step=reshard.copy(jnp.asarray(step, jnp.int32), where.step),
      master=master,
      compute=cast_compute(master, where.compute, config),
      rest=frozen.place(layout, config, rest, where.rest),
      opt_state=opt,
      loss_scale=put(precision.init(config.loss_scale), where.loss_scale),
      extras=put(extras, where.extras))
