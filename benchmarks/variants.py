"""The training steps the benchmarks compare, built side by side in one process,
for any benchmark model config (`benchmarks.models` describes the protocol).

  zero-0 .. zero-3   zerojax.shard(stage=s) + zerojax.train_step
  plain-dp           plain jax.jit data parallelism, written without zerojax:
                     parameters and optimizer state replicated, batch sharded
                     over "data", value_and_grad + optax update, donated
  gspmd-fsdp         MaxText-style FSDP without zerojax: every parameter and
                     optimizer-state leaf sharded over "data" on its largest
                     divisible axis (never the layer axis of the scanned
                     blocks), activations pinned to batch sharding (where
                     the model has the knob), plain jax.jit with in/out
                     shardings; XLA's SPMD partitioner inserts the
                     collectives
  1dev-zero-0        zerojax stage 0 on a 1-device mesh
  1dev-zero-3        zerojax stage 3 on a 1-device mesh
  1dev-optax         plain optax under jax.jit on that one device

Each `Variant` holds its state, its batch (already placed) and its lowered
program. With `materialize=False` the state is abstract
(`jax.ShapeDtypeStruct`s carrying shardings): the program is lowered and
compiled exactly as for real arrays but nothing is allocated, which is how
configs larger than host memory are analysed.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.training import train_state
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

import zerojax
from benchmarks import models

ZERO_STAGES = (0, 1, 2, 3)
MESH_VARIANTS = tuple(f"zero-{s}" for s in ZERO_STAGES) + ("plain-dp",
                                                            "gspmd-fsdp")
ONE_DEVICE_VARIANTS = ("1dev-zero-0", "1dev-zero-3", "1dev-optax")


def make_mesh(n: int) -> Mesh:
  """The first n devices on one Auto axis "data"."""
  if n == jax.device_count():
    return jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
  return Mesh(np.array(jax.devices()[:n]), ("data",),
              axis_types=(AxisType.Auto,))


@dataclasses.dataclass
class Variant:
  name: str
  state: Any                 # real arrays, or ShapeDtypeStructs
  batch: Any
  lowered: Any
  num_devices: int
  num_params: int
  layout: Any = None         # zerojax ChunkLayout, zero-* only
  extra_args: tuple = ()     # trailing arguments of the lowered step
  trace: Any = None          # zero-*: () -> the traced step (for other platforms)
  options: dict = dataclasses.field(default_factory=dict)  # compiler options
  _compiled: Any = None

  @property
  def materialized(self) -> bool:
    return isinstance(jax.tree_util.tree_leaves(self.state)[0], jax.Array)

  def compiled(self):
    """The compiled program (compiled once, with `options`)."""
    if self._compiled is None:
      self._compiled = self.lowered.compile(self.options or None)
    return self._compiled

  def run_once(self):
    """One step of the compiled program, blocked on its results (the state
    is donated). Calling the compiled executable times exactly the program
    the memory and communication suites analyse."""
    self.state, out = self.compiled()(self.state, self.batch,
                                      *self.extra_args)
    jax.block_until_ready((self.state, out))
    return out

  def persistent_bytes(self) -> int:
    """Per-device bytes of the state: the first shard of every array (real
    arrays) or the same from shapes and shardings (abstract state)."""
    return zerojax._state.memory.per_device_bytes(self.state)

  def release(self):
    for x in jax.tree_util.tree_leaves(self.state):
      if isinstance(x, jax.Array) and not x.is_deleted():
        x.delete()
    self.state = None
    self._compiled = None


# ---- states -----------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _make_train_state(cfg, seed: int, tx: str = "adamw"):
  """The initial flax TrainState of a config: a jitted function (compiled
  once per config, fresh arrays per call) and the model; `tx`, the
  optimizer's name (`models.make_tx`)."""
  model = cfg.make_model()
  tx = models.make_tx(tx)
  make = lambda: train_state.TrainState.create(
      apply_fn=model.apply, tx=tx, params=model.init(
          jax.random.key(seed), cfg.example_input())["params"])
  return jax.jit(make), model


def _with_shardings(abstract, shardings):
  return jax.tree_util.tree_map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
      abstract, shardings)


def fsdp_spec(path, shape, n: int, stacked=(), axis: str = "data") -> P:
  """MaxText-style FSDP: shard the largest axis divisible by n (the leading
  layer axis of the blocks stacked under a name in `stacked` excluded);
  replicate when none divides."""
  names = [str(getattr(k, "key", getattr(k, "name", ""))) for k in path]
  first = 1 if set(stacked) & set(names) and len(shape) > 1 else 0
  best = None
  for i in range(first, len(shape)):
    if shape[i] % n == 0 and shape[i] >= n and (
        best is None or shape[i] > shape[best]):
      best = i
  if best is None:
    return P()
  spec = [None] * len(shape)
  spec[best] = axis
  return P(*spec)


def _cast_params(loss_fn, dtype):
  """`loss_fn` on the parameters cast to `dtype` (the fp32 master stays in
  the state: the mixed-precision recipe zerojax's `compute_dtype` runs)."""
  if dtype is None:
    return loss_fn
  cast = lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x
  return lambda params, batch: loss_fn(jax.tree_util.tree_map(cast, params), batch)


def _optax_step(loss_fn):
  def step(state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss
  return step


# ---- builders ---------------------------------------------------------------
def build(name: str, cfg, *, global_batch: int, seq: Optional[int],
          num_devices: int, materialize: bool = True, seed: int = 0,
          options: Optional[dict] = None, compute_dtype=None,
          replicas: int = 1, model_shards: int = 1,
          mesh: Optional[Mesh] = None, tx: str = "adamw",
          **zero_fields) -> Variant:
  """Builds variant `name` (see the module docstring) of a model config.

  Args:
    name: one of MESH_VARIANTS or ONE_DEVICE_VARIANTS.
    cfg: the model config (`models.GPTConfig`, a `user_models` config).
    global_batch, seq: the batch (rows over all devices, tokens per row;
      `seq` is unused by a model without tokens);
      1-device variants take one device's share, global_batch / num_devices.
    num_devices: devices on the "data" mesh (1-device variants use 1).
    materialize: allocate the state (else an abstract state, see above).
    options: XLA compiler options for the step.
    compute_dtype: e.g. jnp.bfloat16: every variant computes in it and keeps
      its fp32 parameters and optimizer state (None: float32 throughout).
    replicas: hybrid sharding (zero-* only): a (replicas, num_devices /
      replicas) mesh ("replica", "data"), the batch split over both.
    model_shards: tensor parallelism (a config whose weights are annotated
      for "model", `models.GPTConfig(tp=M)`): a (num_devices / M, M) mesh
      ("data", "model"), the batch over data; zero-* take
      `model_axis="model"`, plain-dp is then data parallelism beside the
      model's own tensor parallelism (Megatron's TP + DP under `jax.jit`:
      each weight placed by its partition spec, replicated over data).
    mesh: the mesh to use (devices of another platform: a
      `zerojax.GpuTarget`'s, with `materialize=False`; its leading axis
      "replica" under `replicas`, else one axis "data").
    tx: the optimizer, by name (`models.make_tx`).
    **zero_fields: extra `ZeroConfig` fields for zero-* variants.
  """
  if name not in MESH_VARIANTS + ONE_DEVICE_VARIANTS:
    raise ValueError(f"unknown variant {name!r}; use one of "
                     f"{MESH_VARIANTS + ONE_DEVICE_VARIANTS}.")
  one_device = name in ONE_DEVICE_VARIANTS
  n = 1 if one_device else num_devices
  if one_device:
    global_batch = max(global_batch // num_devices, 1)
  if mesh is not None:
    data = NamedSharding(mesh, P(tuple(mesh.axis_names)))
    if "replica" in mesh.axis_names:
      zero_fields = {**zero_fields, "replica_axis": "replica"}
  elif model_shards > 1:
    mesh = jax.make_mesh((n // model_shards, model_shards), ("data", "model"),
                         axis_types=(AxisType.Auto,) * 2)
    data = NamedSharding(mesh, P("data"))
    zero_fields = {**zero_fields, "model_axis": "model"}
  elif replicas > 1:
    mesh = jax.make_mesh((replicas, n // replicas), ("replica", "data"),
                         axis_types=(AxisType.Auto,) * 2)
    data = NamedSharding(mesh, P(("replica", "data")))
    zero_fields = {**zero_fields, "replica_axis": "replica"}
  else:
    mesh = make_mesh(n)
    data = NamedSharding(mesh, P("data"))
  cfg = cfg.for_variant(name, data)
  make, model = _make_train_state(cfg, seed, tx)
  loss_fn = cfg.make_loss_fn(model)
  batch = cfg.make_batch(global_batch, seq, seed)
  on_host = mesh.devices.flat[0].platform == jax.devices()[0].platform
  batch = (jax.device_put(batch, data) if on_host else
           jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(
               x.shape, x.dtype, sharding=data), batch))
  source = make() if materialize else jax.eval_shape(make)

  if name.startswith(("zero-", "1dev-zero-")):
    stage = int(name[-1])
    fields = {"stacked": cfg.stacked, **zero_fields}
    if compute_dtype is not None:
      fields["compute_dtype"] = compute_dtype

    # (zerojax caches its optimizer probes per tx and shapes: sharding the
    # same model many times costs one probe)
    # (the variants enumerate flat fields: ZeroConfig's internal spelling)
    state = (zerojax.shard if materialize else zerojax.shard_shape)(
        source, mesh=mesh,
        config=zerojax.ZeroConfig.from_fields(stage=stage, **fields))
    step = zerojax.train_step(loss_fn)
    lowered = step.lower(state, batch)
    trace = functools.partial(step.trace, state, batch)
    layout, extra = state.layout, (None,)   # train_step's rng argument
  else:
    if name == "gspmd-fsdp":
      shardings = jax.tree_util.tree_map_with_path(
          lambda p, x: NamedSharding(mesh, fsdp_spec(p, np.shape(x), n,
                                                     cfg.stacked)),
          source)
    elif model_shards > 1:   # plain-dp beside the model's tensor parallelism
      specs = nn.get_partition_spec(source)
      source = nn.meta.unbox(source)
      shardings = jax.tree_util.tree_map(
          lambda x, spec: NamedSharding(mesh, spec), source, specs)
    else:   # plain-dp, 1dev-optax: replicated
      shardings = jax.tree_util.tree_map(
          lambda x: NamedSharding(mesh, P()), source)
    state = (jax.device_put(source, shardings) if materialize
             else _with_shardings(source, shardings))
    step = jax.jit(_optax_step(_cast_params(loss_fn, compute_dtype)),
                   in_shardings=(shardings, data),
                   out_shardings=(shardings, NamedSharding(mesh, P())),
                   donate_argnums=(0,))
    lowered = step.lower(state, batch)
    layout, extra, trace = None, (), None
  del source
  return Variant(name, state, batch, lowered, n, cfg.num_params, layout,
                 extra, trace, dict(options or {}))


# the ZeRO stage whose persistent bytes each variant should hold
_STAGE_OF = {"zero-0": 0, "zero-1": 1, "zero-2": 2, "zero-3": 3,
             "plain-dp": 0, "1dev-optax": 0, "1dev-zero-0": 0,
             "gspmd-fsdp": 3, "1dev-zero-3": 3}


def theory_bytes(name: str, num_params: int, n: int) -> Optional[float]:
  """ZeRO's persistent bytes per device, fp32 params + Adam
  (`zerojax.estimate_memory`, docs/design.md's table)."""
  if name not in _STAGE_OF:
    return None
  one = name.startswith("1dev-")
  return float(zerojax.estimate_memory(
      num_params, stage=_STAGE_OF[name], num_devices=1 if one else n)["persistent"])
