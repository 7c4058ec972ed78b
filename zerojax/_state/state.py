"""ZeroTrainState: the sharded train state, `shard()` to build it from a Flax
`TrainState`, and `gather_params()` to read the ordinary parameter tree back.

What each stage stores (N devices on the data axis, see docs/design.md):

  stage 0: `master` chunks replicated, optimizer state replicated.
  stage 1/2, float32 compute: `master` replicated (it is the compute copy),
    optimizer state sharded; the step updates this device's slice.
  stage 1/2, 16-bit compute: `master` (fp32) sharded, `compute` (16-bit)
    replicated, optimizer state sharded.
  stage 3: `master` sharded, optimizer state sharded; no persistent 16-bit
    copy (the step casts each shard before gathering it), except under the
    disk tier with 16-bit compute: each disk chunk's fp32 master is on disk
    and `compute` holds its sharded 16-bit copy in host memory, which the
    step gathers (`StagePolicy.sharded_compute`).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from zerojax._tiers import disk_tier
from zerojax.nn import _frontend as frontend
from zerojax._core import frozen
from zerojax._core import meshes
from zerojax._core import offload
from zerojax._core import optim
from zerojax._core import optstate
from zerojax._core import precision
from zerojax._core import reshard
from zerojax._core import tensor_parallel
from zerojax import deepspeed
from zerojax._options.config import (ZeroConfig, expand, shard_axes,
                                     with_loss_scale)
from zerojax._options.groups import Blocks
from zerojax._core.chunking import (beside, named_units, repeated_blocks,
                                    scanned_stacks, unit_depth)
from zerojax._core.layout import ChunkLayout, path_names
from zerojax._options.policy import policy

_TRAIN_STATE_FIELDS = ("step", "apply_fn", "params", "tx", "opt_state")


class ZeroTrainState(struct.PyTreeNode):
  """A `TrainState` whose parameters and optimizer state live in chunks.

  Attributes:
    step: number of updates applied.
    master: chunk arrays of the trainable parameters in their own dtype.
    compute: replicated compute-dtype chunks (stages 1-2 under 16-bit
      compute); at stage 3 under the disk tier with 16-bit compute, per
      chunk its sharded compute-dtype copy in host memory (disk chunks) or
      None; else `()`.
    rest: leaves kept outside the chunks: frozen weights in the compute
      dtype, split over the data axis at stage 3 (`zerojax._core.frozen`), and
      non-floating leaves, replicated.
    opt_state: the optax state over the chunk views (`ChunkLayout.views`),
      each chunk's statistics kept in the chunk's shape (`optstate.stored`;
      the step shows them to `tx` in view shape).
    loss_scale: `precision.LossScaleState` or None.
    extras: the pytree fields a `TrainState` subclass added, kept as they
      are; readable as attributes (`state.batch_stats`).
  """
  step: jax.Array
  master: tuple
  compute: tuple
  rest: tuple
  opt_state: Any
  loss_scale: Optional[precision.LossScaleState]
  extras: dict
  apply_fn: Callable = struct.field(pytree_node=False)
  tx: optax.GradientTransformation = struct.field(pytree_node=False)
  layout: ChunkLayout = struct.field(pytree_node=False)
  config: ZeroConfig = struct.field(pytree_node=False)
  mesh: Mesh = struct.field(pytree_node=False)
  static_extras: tuple = struct.field(pytree_node=False, default=())

  def __getattr__(self, name):
    # Only reached when normal lookup fails: expose subclass fields.
    if name.startswith("__"):
      raise AttributeError(name)
    extras = self.__dict__.get("extras") or {}
    if name in extras:
      return extras[name]
    static = dict(self.__dict__.get("static_extras") or ())
    if name in static:
      return static[name]
    if name == "params":
      raise AttributeError("ZeroTrainState keeps parameters in sharded chunks; "
                           "use zerojax.gather_params(state) for the tree.")
    raise AttributeError(f"ZeroTrainState has no attribute {name!r}")

  @property
  def num_shards(self) -> int:
    return self.mesh.shape[self.config.axis_name]

  @property
  def num_state_shards(self) -> int:
    """Pieces each chunk is split into: the data axis's devices, or under
    hpZ replica x data."""
    return meshes.axes_size(self.mesh, shard_axes(self.config))

  @property
  def num_replicas(self) -> int:
    """Replicas of the sharded state (hybrid sharding), else 1."""
    axis = self.config.replica_axis
    return 1 if axis is None else self.mesh.shape[axis]

  @property
  def num_batch_shards(self) -> int:
    """Devices the batch is split over (data x replica): the gradient is
    the mean of this many devices' gradients."""
    return self.num_shards * self.num_replicas

  @property
  def frontend(self):
    """The Flax front end the state came from (`zerojax.nn._frontend`): it adapts
    the user's loss and evaluation functions."""
    return dict(self.static_extras).get(frontend.FRONTEND_FIELD, frontend.LINEN)


# ---- placement ---------------------------------------------------------------
def chunk_spec(ndim: int, axis_name) -> P:
  """Inside `shard_map`: a chunk (or chunk view) sharded on its last axis
  (over `axis_name`, a mesh axis or a tuple of them: `config.shard_axes`).
  Under tensor parallelism the model rows ride on the automatic model axis
  (`config.manual_axes`); placement says where they go (`Chunk.spec`)."""
  return P(*([None] * (ndim - 1)), axis_name)


def state_shardings(state: ZeroTrainState) -> ZeroTrainState:
  """The `NamedSharding` of every array of `state`, as a state-shaped tree."""
  cfg, mesh, layout = state.config, state.mesh, state.layout
  pol = policy(cfg)
  rep = NamedSharding(mesh, P())
  axes = shard_axes(cfg)
  # chunk c split over the data axes, or whole on each data device (its
  # model rows split over the model axis either way)
  split = lambda c: NamedSharding(mesh, layout.chunks[c].spec(axes, cfg.model_axis))
  whole = lambda c: NamedSharding(mesh, layout.chunks[c].spec(None, cfg.model_axis))
  lengths = {c.length for c in layout.chunks}
  n = meshes.axes_size(mesh, axes)

  def opt_rule(x, c):
    shape = np.shape(x)
    if c is None or shape != layout.chunks[c].shape:
      return rep   # counts, scalars, the empty views of other leaves
    if (pol.optimizer_sharded and shape[-1] in lengths and shape[-1] % n == 0):
      return split(c)
    return whole(c)

  host_opt = offload.optimizer_chunks(layout, cfg)
  host_master = (frozenset(range(len(layout.chunks))) if cfg.offload_params
                 else host_opt if pol.master_sharded else frozenset())
  kind = lambda s, host: s.with_memory_kind(offload.HOST if host else offload.DEVICE)

  def master_rule(c, x):
    if disk_tier.is_on_disk(x):   # in its file (stays itself, no leaves)
      return x
    return kind(split(c) if pol.master_sharded else whole(c), c in host_master)

  opt, opt_def = jax.tree_util.tree_flatten(state.opt_state)
  opt_where = [kind(opt_rule(x, c), c in host_opt) for x, c in
               zip(opt, optstate.owners(layout, state.opt_state).chunk)]

  def compute_rule(c, x):
    if x is None:
      return None
    return kind(split(c), True) if pol.sharded_compute else whole(c)

  return state.replace(
      step=rep,
      master=tuple(master_rule(c, x) for c, x in enumerate(state.master)),
      compute=tuple(compute_rule(c, x) for c, x in enumerate(state.compute)),
      rest=frozen.shardings(layout, cfg, mesh),
      opt_state=jax.tree_util.tree_unflatten(opt_def, opt_where),
      loss_scale=jax.tree_util.tree_map(lambda x: rep, state.loss_scale),
      extras=jax.tree_util.tree_map(lambda x: rep, state.extras))


# ---- shard ---------------------------------------------------------------------
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


def _front_door(stage, config, strategy, options: dict) -> tuple:
  """`(stage, config fields)` of `shard`'s arguments: a whole `config=`
  (e.g. `ZeroConfig.from_deepspeed`) or a Lightning `strategy=` name, the
  options on top of it; stage 3 when nothing says otherwise."""
  if config is not None and strategy is not None:
    raise TypeError("pass config= or strategy=, not both.")
  if isinstance(stage, str) and stage == "auto" and config is None \
      and strategy is None:
    _check_auto(options)
  fields = expand(options)
  if config is not None:
    if not isinstance(config, ZeroConfig):
      raise TypeError(f"config={config!r} must be a ZeroConfig (e.g. "
                      "ZeroConfig.from_deepspeed(ds_config)).")
    base = config.fields()
  elif strategy is not None:
    if not isinstance(strategy, str):
      raise TypeError(f"strategy={strategy!r} must be a Lightning strategy "
                      f"name: {', '.join(deepspeed.STRATEGIES)}.")
    base = with_loss_scale(deepspeed.config_fields(deepspeed.strategy(
        strategy)))
  elif isinstance(stage, str) and stage == "auto":
    # laid out at stage 3 until the first step chooses (`zerojax.plan`)
    return 3, {**fields, "placement": "plan"}
  else:
    return (3 if stage is None else stage), fields
  chosen = base.pop("stage")
  if stage is not None and stage != chosen:
    source = "config" if config is not None else "strategy"
    raise ValueError(f"stage={stage!r} contradicts the {source}'s stage "
                     f"{chosen}; pass one of them.")
  return chosen, {**base, **fields}


def _check_auto(options: dict) -> None:
  """stage="auto" chooses the offload, the quantized collectives and the
  blocks' remat itself (`zerojax.plan`): giving them is refused."""
  given = [k for k in ("offload", "quantize") if k in options]
  blocks = options.get("blocks")
  if isinstance(blocks, Blocks) and blocks.remat != "none":
    given.append(f"blocks=Blocks(remat={blocks.remat!r})")
  if given:
    raise ValueError(f"stage='auto' chooses {', '.join(given)} itself (the "
                     "plan's choice); drop them, or give a stage.")


def shard(state: Any, stage: Optional[int] = None, mesh: Optional[Mesh] = None,
          *, tx: Optional[optax.GradientTransformation] = None, optimizer=None,
          config: Optional[ZeroConfig] = None, strategy: Optional[str] = None,
          **options) -> ZeroTrainState:
  """Turns a Flax `TrainState`, or an NNX model, into a ZeRO `ZeroTrainState`.

  Args:
    state: a `flax.training.train_state.TrainState` (or subclass; extra fields
      are kept as they are; its optimizer state, trained or fresh, is kept),
      or a `flax.nnx.Module` (its `nnx.Param` variables are trained, every
      other variable is kept and updated by the step: `zerojax.nn._frontend`).
    stage: ZeRO stage 0-3 (see `ZeroConfig`); default 3, or the stage of
      `config` / `strategy`; or "auto" with `device_budget=`: the first
      `train_step` call chooses the stage, remat and offload for its
      program (`zerojax.plan`), lays the state out so and says so once;
      until then the state is at stage 3, everything offloadable on host.
    mesh: device mesh; None puts every device on one axis named "data".
    tx: for an NNX model, the optax optimizer (fresh state)...
    optimizer: ...or an `nnx.Optimizer(model, tx, wrt=nnx.Param)`, whose
      state and step count are kept.
    config: a whole `ZeroConfig`, e.g. `ZeroConfig.from_deepspeed(ds)`.
    strategy: or a Lightning DeepSpeed strategy name
      (`"deepspeed_stage_3_offload"`, `zerojax.deepspeed.STRATEGIES`).
    **options: `ZeroConfig`'s options (`offload="host"`,
      `precision="bf16"`, `accum_steps`, `clip_norm`, `frozen`, ...), over
      `config`'s or `strategy`'s.

  Returns:
    The sharded state; the input state (or model) is left untouched.

  Example:
    >>> state = zerojax.shard(state, stage=3, precision="bf16")
    >>> state = zerojax.shard(nnx_model, stage=3, tx=optax.adamw(1e-3))
  """
  stage, fields = _front_door(stage, config, strategy, options)
  state = _from_front_end(state, tx, optimizer)
  config, mesh, extras, static_extras = _check_train_state(
      state, stage, mesh, fields)
  dims, params, opt_state = _model_split(state, config, mesh)
  placed = place(params, opt_state, state.step, extras,
                 static_extras, tx=state.tx, apply_fn=state.apply_fn,
                 config=config, mesh=mesh, model_dims=dims)
  return disk_tier.spill(placed)


def shard_shape(state: Any, stage: Optional[int] = None,
                mesh: Optional[Mesh] = None, *,
                tx: Optional[optax.GradientTransformation] = None,
                optimizer=None, config: Optional[ZeroConfig] = None,
                strategy: Optional[str] = None,
                **options) -> ZeroTrainState:
  """What `shard` returns, as `jax.ShapeDtypeStruct`s carrying their
  shardings and memory kinds: nothing is allocated or moved. For planning
  and ahead-of-time compiles (`zerojax.plan_offload`, `step.lower`); `state`
  may itself hold `ShapeDtypeStruct`s (`jax.eval_shape` of the init), or be
  an NNX model (`nnx.eval_shape` of its constructor). Arguments as for
  `shard`."""
  stage, fields = _front_door(stage, config, strategy, options)
  state = _from_front_end(state, tx, optimizer)
  config, mesh, extras, static_extras = _check_train_state(
      state, stage, mesh, fields)
  dims, params, opt_state = _model_split(state, config, mesh)
  _, shapes, where = plan_state(params, opt_state, state.step, extras,
                                static_extras, tx=state.tx, apply_fn=state.apply_fn,
                                config=config, mesh=mesh, model_dims=dims)
  return disk_tier.spill(jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      shapes, where))


def _model_split(state, config, mesh) -> tuple:
  """`(model dims, params, opt_state)`: per parameter leaf the dim the model
  splits over `config.model_axis` (`zerojax._core.tensor_parallel`), and the
  parameters and optimizer state without Flax's partitioning boxes."""
  data = (config.axis_name, config.replica_axis)
  dims = tensor_parallel.model_dims(state.params, config.model_axis, mesh, data)
  return (dims, tensor_parallel.unboxed(state.params),
          tensor_parallel.unboxed(state.opt_state))


def _from_front_end(state, tx, optimizer):
  """A `TrainState`: `state` itself, or the one an NNX model becomes."""
  if frontend.is_nnx(state):
    return frontend.from_nnx(state, tx=tx, optimizer=optimizer)
  if tx is not None or optimizer is not None:
    raise TypeError("shard(tx=..., optimizer=...) is for NNX models; a "
                    f"{type(state).__name__} carries its own tx.")
  return state


def _check_train_state(state, stage, mesh, fields) -> tuple:
  """(config, mesh, extras, static extras) of a `shard` call's arguments."""
  if isinstance(state, ZeroTrainState):
    raise ValueError("this state is already a ZeroTrainState; shard() takes "
                     "an ordinary TrainState. To change stage or mesh, gather "
                     "it (zerojax.gather_params) or go through a checkpoint.")
  missing = [f for f in _TRAIN_STATE_FIELDS if not hasattr(state, f)]
  if missing:
    raise TypeError(f"shard() takes a flax TrainState; {type(state).__name__} "
                    f"has no {', '.join(missing)}.")
  config, mesh = config_and_mesh(stage, mesh, fields)
  return (config, mesh) + extra_fields(state)


def config_and_mesh(stage, mesh, fields: dict) -> tuple:
  """`(ZeroConfig, mesh)` of the stage, mesh and config fields (`expand`ed
  from the options a user passed to `shard`, `create` or
  `checkpoint.restore`), checked where they enter: a mesh without the
  config's axes is refused, an Explicit mesh is used through its Auto copy,
  offload needs host memory."""
  config = ZeroConfig.from_fields(stage=stage, **fields)
  mesh = meshes.auto_mesh(mesh if mesh is not None
                          else meshes.default_mesh(config.axis_name))
  if config.placement in ("auto", "plan"):
    config = _most_offload(config, mesh)
  for field, name in (("axis_name", "data"), ("replica_axis", "replica"),
                      ("model_axis", "model")):
    axis = getattr(config, field)
    if axis is not None and axis not in mesh.axis_names:
      raise ValueError(f"mesh axes {mesh.axis_names} have no axis {axis!r}; "
                       f"pass axes=zerojax.Axes({name}=...) one of them or "
                       "build the mesh with that axis.")
  if config.offload_optimizer or config.offload_params:
    offload.check_backend(mesh)
  return config, mesh


def _most_offload(config: ZeroConfig, mesh) -> ZeroConfig:
  """offload="auto" before its first step: everything offloadable on host
  (the planner's last rung), so that the state fits before the plan; the
  device budget's fraction checked against what the devices report."""
  device_budget_bytes(config, mesh)
  if not offload.has_host_memory(mesh):
    return config   # nothing to offload, the plan agrees
  return config.replace(offload_optimizer=True,
                        offload_params=config.stage == 3,
                        offload_fraction=1.0)


def device_budget_bytes(config: ZeroConfig, mesh) -> int:
  """`config.device_budget` in bytes per device: itself, or its fraction of
  the first device's `memory_stats()["bytes_limit"]`."""
  budget = config.device_budget
  if isinstance(budget, (float, np.floating)) and budget <= 1.0:
    device = mesh.devices.flat[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" not in stats:
      raise ValueError(
          f"device_budget={budget!r} is a fraction of device memory, but "
          f"{device.platform} devices report none (memory_stats() has no "
          "bytes_limit); give the budget in bytes.")
    return int(budget * stats["bytes_limit"])
  return int(budget)


def extra_fields(state) -> tuple:
  """Fields a TrainState subclass adds: (pytree fields, static fields)."""
  extras, static_extras = {}, []
  if dataclasses.is_dataclass(state):
    for f in dataclasses.fields(state):
      if f.name in _TRAIN_STATE_FIELDS:
        continue
      if f.metadata.get("pytree_node", True):
        extras[f.name] = getattr(state, f.name)
      else:
        static_extras.append((f.name, getattr(state, f.name)))
  return extras, tuple(static_extras)


def check_tx(tx, params, config: ZeroConfig, num_shards: int = 1) -> tuple:
  """The optimizer probes (`optim`: two small compiled programs, three with
  offload, cached per tx and tree) on the layer stacks a layout over
  `num_shards` devices has (`layer_stacks`): the leaves' optimizer
  classes; raises when `tx` cannot run on chunks."""
  abstract = jax.eval_shape(lambda p: p, params)
  trainable = _trainable(config, abstract)
  labels = optim.leaf_labels(tx, abstract, trainable)
  stacks = layer_stacks(abstract, config, num_shards)
  optim.check_elementwise(tx, abstract, trainable, labels, stacks)
  if config.offload_optimizer:
    optim.check_separable(tx, abstract, trainable, labels, stacks)
  return labels


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
  abstract = jax.eval_shape(lambda p: p, params)
  if labels is None:
    labels = check_tx(tx, abstract, config, num_shards)
  # stage 3 gathers a stack's chunks per layer, an unrolled block's alone
  # (`zerojax.nn.layerwise`), those of a module named in `per_use`, and
  # for a linen model, those of the modules beside them where that
  # compiles smaller (`zerojax.nn._peruse`)
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
  opt = reshard.opt_to_views(layout, opt_state, shapes.opt_state,
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


# ---- reading -------------------------------------------------------------------
def loaded_master(state) -> tuple:
  """The master chunks with those on disk read into their shardings (for
  `gather_params` and exports, which build the whole tree anyway)."""
  if not any(disk_tier.is_on_disk(x) for x in state.master):
    return state.master
  where = state_shardings(
      state.replace(master=disk_tier.abstract(state.master))).master
  return tuple(jax.device_put(np.asarray(m), s) if disk_tier.is_on_disk(x)
               else x for x, m, s in zip(
                   state.master, disk_tier.mapped(state, state.master),
                   where))


def check_live(state: ZeroTrainState, caller: str) -> None:
  """Raises a ValueError if any array of `state` was donated or deleted.

  A `train_step` donates its input state: its buffers become the returned
  state's. Using the old state again would otherwise fail deep inside jax
  (or, for a jitted call, crash the process). O(leaves) host work, no
  device sync.
  """
  for x in jax.tree_util.tree_leaves(state):
    if isinstance(x, jax.Array) and x.is_deleted():
      raise ValueError(
          f"{caller} got a ZeroTrainState whose arrays were donated to a "
          "previous step call (or deleted): use the state that call returned, "
          "`state, metrics = step(state, batch)`, or build the step with "
          "train_step(..., donate=False) to keep the input.")
