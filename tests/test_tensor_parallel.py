"""Tensor parallelism beside ZeRO (`model_axis=`): a GPT whose attention
heads and MLP are split over "model" with `nn.with_partitioning`, on a
("data" 4, "model" 2) mesh. Against plain optax on one device and a plain
GSPMD `jax.jit` step of the same model; the compiled collectives; the
chunks' placement; checkpoints across model degrees; bad input."""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax._plan.hlo import count_collectives
from models import zopts
from models import (TPTransformer, assert_matches_reference, lm_batches,
                    lm_loss_fn, reference_run)

TX = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))
D, M = 4, 2


def _mesh(shape=(D, M), names=("data", "model"), devices=None):
  devices = jax.devices()[:int(np.prod(shape))] if devices is None else devices
  return jax.sharding.Mesh(np.array(devices).reshape(shape), names)


@functools.lru_cache(maxsize=None)
def _problem(scan: bool = False):
  """(model, boxed params, loss_fn, batches)."""
  model = TPTransformer(scan=scan, layerwise=True)
  batches = lm_batches(model.vocab, batch=16, seq=8, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  return model, params, lm_loss_fn(model), batches


def _train_state(scan=False):
  model, params, _, _ = _problem(scan)
  return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=TX)


def _state(stage, scan=False, mesh=None, **fields):
  return zerojax.shard(_train_state(scan), stage=stage,
                       mesh=_mesh() if mesh is None else mesh,
                       **zopts({"model_axis": "model",
                                "stacked": ("blocks",) if scan else (),
                                **fields}))


def _run(state, loss_fn, batches):
  step = zerojax.train_step(loss_fn)
  losses, norms = [], []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  return state, np.array(losses), norms


def _reference_norm(loss_fn, params, batch, compute_dtype):
  return optax.tree.norm(jax.grad(lambda p: loss_fn(jax.tree_util.tree_map(
      lambda x: x.astype(compute_dtype), p), batch).astype(np.float32))(params))


@pytest.mark.slow
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_tensor_parallel_matches_plain_optax_at_every_stage(compute_dtype):
  """Stages 0-3 with accumulation: losses, parameters and the gradient norm
  (each model row counted once) as plain optax on one device; the split
  weights' chunks are `[M, length]`, one row per model device, each device
  holding its row's data shard (stages 1-3) or its whole row (stage 0)."""
  _, params, loss_fn, batches = _problem()
  plain = nn.meta.unbox(params)
  ref_losses, ref_params = reference_run(loss_fn, plain, TX, batches,
                                         jnp.dtype(compute_dtype))
  ref_norm = _reference_norm(loss_fn, plain, batches[0], compute_dtype)
  for stage in (0, 1, 2, 3):
    state = _state(stage, compute_dtype=compute_dtype, accum_steps=2)
    rows = [c for c, chunk in enumerate(state.layout.chunks)
            if chunk.model_shards]
    assert rows and all(state.layout.chunks[c].model_shards == M for c in rows)
    for c in rows:
      master, chunk = state.master[c], state.layout.chunks[c]
      assert master.shape == chunk.shape == (M, chunk.length)
      local = master.addressable_shards[0].data.shape
      want = chunk.length // D if stage > 0 and (
          stage == 3 or compute_dtype == "bfloat16") else chunk.length
      assert local == (1, want), (stage, local)
    state, losses, norms = _run(state, loss_fn, batches)
    assert_matches_reference(losses, zerojax.gather_params(state), ref_losses,
                             ref_params, compute_dtype)
    np.testing.assert_allclose(norms[0], ref_norm, rtol=1e-5 if
                               compute_dtype == "float32" else 2e-2)


@pytest.mark.slow
def test_scanned_layerwise_tensor_parallel_stage_3():
  """A scanned stack (`nn.scan` with the layer axis unsplit) gathered a
  layer at a time: its chunks are `[layers, M, length]`, and training
  matches plain optax."""
  _, params, loss_fn, batches = _problem(scan=True)
  state = _state(3, scan=True)
  stacked = [c for c in state.layout.chunks if c.layers and c.model_shards]
  assert stacked and all(c.shape == (2, M, c.length) for c in stacked)
  ref_losses, ref_params = reference_run(loss_fn, nn.meta.unbox(params), TX,
                                         batches)
  state, losses, _ = _run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state), ref_losses,
                           ref_params)


def _gspmd_step(loss_fn, mesh):
  """The same tensor-parallel model stepped by plain `jax.jit` (GSPMD):
  parameters placed by their partition specs, the batch split over data."""
  specs = nn.get_partition_spec(_problem()[1])
  where = jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s), specs)

  @jax.jit
  def step(params, opt, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt = TX.update(grads, opt, params)
    return optax.apply_updates(params, updates), opt, loss

  def put(params):
    return jax.device_put(params, where)
  return step, put


@pytest.mark.slow
def test_tensor_parallel_matches_a_plain_gspmd_step_and_keeps_to_the_data_axis():
  """Stage 3 against the GSPMD step of the same model on the same mesh
  (float32, rtol 1e-5). In the compiled step every gather and
  reduce-scatter is over the data axis (groups of D), the model's own
  maths is all that spans the model axis (all-reduces in groups of M, no
  more bytes than the GSPMD step's), and nothing spans both but
  scalars."""
  _, params, loss_fn, batches = _problem()
  mesh = _mesh()
  step, put = _gspmd_step(loss_fn, mesh)
  plain = put(nn.meta.unbox(params))
  opt = TX.init(plain)
  data = NamedSharding(mesh, P("data"))
  ref_losses = []
  for b in batches:
    plain, opt, loss = step(plain, opt, jax.device_put(b, data))
    ref_losses.append(float(loss))
  state = _state(3)
  program = zerojax.train_step(loss_fn).lower(state, batches[0]).compile()
  state, losses, _ = _run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           np.array(ref_losses), plain)

  # scalars aside (the loss's mean, the gradient norm's partial sums)
  ops = [op for op in count_collectives(program).ops if op.bytes > 16]
  by_group = {}
  for op in ops:
    by_group.setdefault(op.group_size, []).append(op.kind)
  assert set(by_group) == {D, M}, by_group
  assert {"all-gather", "reduce-scatter"} <= set(by_group[D])
  assert set(by_group[M]) == {"all-reduce"}, by_group[M]
  gspmd = count_collectives(step.lower(plain, opt, jax.device_put(
      batches[0], data)).compile())
  over_model = lambda ops: sum(op.bytes for op in ops
                               if op.group_size == M and op.bytes > 16)
  # (XLA may fold a scalar or two, the norm's partial sums, into one of them)
  assert 0 < over_model(ops) <= over_model(gspmd.ops) + 16


@pytest.mark.slow
def test_tensor_parallel_checkpoint_restores_across_model_degrees(tmp_path):
  """Saved on (data 4, model 2): restored on the same mesh (read straight
  in), on (data 2, model 4), on a 1-D 8-device mesh without tensor
  parallelism and on (replica 2, data 2, model 2) under hpZ (repacked),
  each training on as the uninterrupted run."""
  _, _, loss_fn, batches = _problem()
  state, _, _ = _run(_state(3), loss_fn, batches[:1])
  zerojax.checkpoint.save(str(tmp_path), state)
  zerojax.checkpoint.wait(str(tmp_path))
  after, want, _ = _run(state, loss_fn, batches[1:])
  want_params = zerojax.gather_params(after)
  like = _train_state()
  for mesh, fields in [(_mesh(), {}), (_mesh((2, 4)), {}),
                       (_mesh((8,), ("data",)), {"model_axis": None}),
                       (_mesh((2, 2, 2), ("replica", "data", "model")),
                        # (an axes group given replaces the saved one whole)
                        {"replica_axis": "replica", "hpz": True,
                         "model_axis": "model"})]:
    back = zerojax.checkpoint.restore(str(tmp_path), like=like, mesh=mesh,
                                      **zopts(fields))
    rows = {c.model_shards for c in back.layout.chunks}
    assert rows == ({0} if "model" not in mesh.shape
                    else {0, mesh.shape["model"]})
    back, losses, _ = _run(back, loss_fn, batches[1:])
    assert_matches_reference(losses, zerojax.gather_params(back), want,
                             want_params)


def test_a_model_degree_the_weights_do_not_divide_into_is_refused(tmp_path):
  _, _, loss_fn, batches = _problem()
  state = _state(3)
  zerojax.checkpoint.save(str(tmp_path), state)
  zerojax.checkpoint.wait(str(tmp_path))
  with pytest.raises(ValueError, match="does not divide into 3 model devices"):
    zerojax.checkpoint.restore(str(tmp_path), like=_train_state(),
                               mesh=_mesh((2, 3)))


def _boxed(names, shape=(4, 6)):
  return {"w": nn.Partitioned(jnp.ones(shape), names=names),
          "b": jnp.zeros((6,))}


@pytest.mark.parametrize("fields, params, match", [
    ({"model_axis": "tensor"}, None, "have no axis 'tensor'"),
    ({"model_axis": "data"}, None, "also the data or replica axis"),
    ({"model_axis": "model", "offload_optimizer": "disk", "offload_dir": "/tmp"},
     None, "does not combine with the disk tier"),
    ({"model_axis": 3}, None, "Axes.model=3 must be a mesh axis name"),
    ({}, None, "no model axis was given: pass axes=zerojax.Axes\\(model="),
    ({"model_axis": "model"}, _boxed(("model", "model")), "on dims \\[0, 1\\]"),
    ({"model_axis": "model"}, _boxed((None, ("data", "model"))),
     "keeps a dim split over the model axis 'model' alone"),
    ({"model_axis": "model"}, _boxed(("model", None), (3, 6)),
     "whose 3 does not divide into 2 model devices"),
])
def test_bad_tensor_parallel_input_is_refused(fields, params, match):
  """Each raises at `shard`, naming the value and the fix; the input state
  is untouched (its arrays still readable)."""
  ts = _train_state()
  if params is not None:
    ts = train_state.TrainState.create(apply_fn=lambda v, x: x,
                                       params=params, tx=TX)
  with pytest.raises((ValueError, TypeError), match=match):
    # (the flat fields as the options: `zopts` builds the Axes group)
    zerojax.shard(ts, stage=3, mesh=_mesh(), **zopts(fields))
  assert all(np.isfinite(np.asarray(x)).all()
             for x in jax.tree_util.tree_leaves(nn.meta.unbox(ts.params)))


@pytest.mark.slow
def test_create_with_tensor_parallelism_equals_init_then_shard():
  """`zerojax.create` from the boxed init: the model dims are read from the
  boxes the init returns, and the state equals `shard` of the jitted init,
  bit for bit and in the same shardings (stage 3, and stage 2 with its
  bf16 copy)."""
  model, _, loss_fn, batches = _problem()
  tokens = batches[0]["tokens"][:1]
  init_fn = lambda r: model.init(r, tokens)["params"]
  for stage, dtype in [(3, "float32"), (2, "bfloat16")]:
    made = zerojax.create(init_fn, jax.random.key(7), apply_fn=model.apply,
                          tx=TX, stage=stage, mesh=_mesh(),
                          axes=zerojax.Axes(model="model"), precision=dtype)
    plain = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=jax.jit(init_fn)(jax.random.key(7)),
        tx=TX), stage=stage, mesh=_mesh(), axes=zerojax.Axes(model="model"), precision=dtype)
    assert made.layout == plain.layout
    assert any(c.model_shards == M for c in made.layout.chunks)
    for a, b in zip(jax.tree_util.tree_leaves(made),
                    jax.tree_util.tree_leaves(plain)):
      assert a.sharding == b.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  made, metrics = zerojax.train_step(loss_fn)(made, batches[0])
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_an_nnx_model_split_over_model_trains_as_plain_optax():
  """An NNX model whose kernels are split with `nnx.with_partitioning`,
  built under the mesh (so its parameters carry their `NamedSharding`):
  `shard(model, model_axis=...)` reads the split dims from them, and stages
  1 and 3 train as plain optax on one device; `gather_model` gives the
  whole weights."""
  from flax import nnx
  part, init = nnx.with_partitioning, nnx.initializers.lecun_normal()

  class Block(nnx.Module):
    def __init__(self, rngs, w=16):
      self.norm = nnx.LayerNorm(w, rngs=rngs)
      self.up = nnx.Linear(w, 4 * w, kernel_init=part(init, (None, "model")),
                           bias_init=part(nnx.initializers.zeros, ("model",)),
                           rngs=rngs)
      self.down = nnx.Linear(4 * w, w, kernel_init=part(init, ("model", None)),
                             rngs=rngs)

    def __call__(self, x):
      return x + self.down(nnx.gelu(self.up(self.norm(x))))

  def loss_fn(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)

  mesh = _mesh()
  with jax.set_mesh(mesh):
    model = Block(nnx.Rngs(0))
  rng = np.random.default_rng(0)
  batches = [{k: rng.normal(size=(16, 16)).astype(np.float32) for k in "xy"}
             for _ in range(3)]
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  plain_loss = lambda p, b: loss_fn(nnx.merge(graphdef, p, rest), b)
  ref_losses, ref_params = reference_run(plain_loss, jax.device_get(params),
                                         TX, batches)
  ref_params = nnx.to_pure_dict(ref_params)
  for stage in (1, 3):
    state = zerojax.shard(model, tx=TX, stage=stage, mesh=mesh,
                          axes=zerojax.Axes(model="model"))
    assert [c.model_shards for c in state.layout.chunks].count(M) == 1
    step = zerojax.train_step(loss_fn)
    losses = []
    for b in batches:
      state, metrics = step(state, b)
      losses.append(float(metrics["loss"]))
    trained = nnx.to_pure_dict(nnx.state(zerojax.gather_model(state), nnx.Param))
    assert_matches_reference(np.array(losses), trained, ref_losses, ref_params)


@pytest.mark.parametrize("stage, dtype", [(0, "float32"), (2, "bfloat16"),
                                          (3, "float32")])
def test_memory_report_counts_the_split_weights_per_model_device(stage, dtype):
  """Per device: a split weight's share is 1/M of a whole one's under the
  stage's table over the data axis (written out here, from the boxed
  params, independently of `zerojax._state.memory`); the report's formula and its
  measured bytes agree with it, padding aside."""
  _, params, _, _ = _problem()
  state = _state(stage, compute_dtype=dtype)
  report = zerojax.memory_report(state)
  flat = jax.tree_util.tree_leaves(params, is_leaf=lambda x: isinstance(
      x, nn.Partitioned))
  split = sum(x.value.size for x in flat if isinstance(x, nn.Partitioned)
              and "model" in x.names)
  whole = sum(np.size(nn.meta.unbox(x)) for x in flat) - split
  # fp32 master 4 B and SGD's momentum 4 B; at stage 2 in bf16 a whole
  # bf16 copy beside them
  per_param = {0: 8, 2: 2 + 8 / D, 3: 8 / D}[stage]
  want = (whole + split / M) * per_param
  assert report.estimate["persistent"] == pytest.approx(want, abs=1)
  chunks = len(state.layout.chunks)
  assert want <= report.persistent <= want + 12 * (D - 1) * chunks + 64
  assert "split over 2 model devices" in str(report).splitlines()[0]
  with pytest.raises(ValueError, match="split_params=9"):
    zerojax.estimate_memory(8, stage=3, num_devices=4, split_params=9,
                            model_shards=2)



def _collectives_apart(program, mesh):
  """The collectives of `program` that break tensor parallelism's rule:
  any but an all-reduce over the model axis alone (the model's own maths)
  that spans the model axis. Scalars (the loss, the norm's partial sums;
  at most 16 of them) aside."""
  shape, axes = tuple(mesh.shape.values()), list(mesh.shape)
  model = axes.index("model")
  bad = []
  for op in count_collectives(program).ops:
    if op.bytes <= 64 or not op.spans(shape, model):
      continue
    if op.kind != "all-reduce" or any(op.spans(shape, a) for a in
                                      range(len(axes)) if a != model):
      bad.append((op.kind, op.bytes, op.groups[:2]))
  return bad


def _run_and_program(state, loss_fn, batches):
  step = zerojax.train_step(loss_fn)
  program = step.lower(state, batches[0]).compile()
  state, losses, norms = _run(state, loss_fn, batches)
  return state, losses, norms, program


@pytest.mark.slow
@pytest.mark.parametrize("hpz", [False, True], ids=["hsdp", "hpz"])
def test_tensor_parallel_on_a_3d_mesh_with_replicas(hpz):
  """(replica 2, data 2, model 2): tensor parallelism beside HSDP or hpZ at
  stage 3 with accumulation, as plain optax on one device (gradient norm
  included: rows counted once, replicas once); nothing zerojax sends spans
  the model axis, and the replica reduction is one all-reduce per step
  under HSDP. (Stages 1-2 send the same replica reduction; the suite's
  time keeps them to the 2-D tests.)"""
  _, params, loss_fn, batches = _problem()
  plain = nn.meta.unbox(params)
  ref_losses, ref_params = reference_run(loss_fn, plain, TX, batches)
  ref_norm = _reference_norm(loss_fn, plain, batches[0], "float32")
  mesh = _mesh((2, 2, 2), ("replica", "data", "model"))
  for stage in (3,):
    state = _state(stage, mesh=mesh, replica_axis="replica", hpz=hpz,
                   accum_steps=2)
    state, losses, norms, program = _run_and_program(state, loss_fn, batches)
    assert_matches_reference(losses, zerojax.gather_params(state), ref_losses,
                             ref_params)
    np.testing.assert_allclose(norms[0], ref_norm, rtol=1e-5)
    if stage == 3:
      assert _collectives_apart(program, mesh) == []
      over_replica = [op for op in count_collectives(program).ops
                      if op.bytes > 64 and op.spans((2, 2, 2), 0)]
      assert over_replica and not any(op.spans((2, 2, 2), 1)
                                      for op in over_replica)
      if not hpz:
        assert [op.kind for op in over_replica] == ["all-reduce"]


@pytest.mark.slow
@pytest.mark.parametrize("fields", [
    dict(offload_optimizer=True, offload_params=True),
    dict(offload_optimizer=True, update_on="host"),
    dict(placement="auto", device_budget=2 ** 30),
], ids=["offload", "host-update", "auto-placement"])
def test_tensor_parallel_with_host_offload(fields):
  """Stage 3 with the optimizer state (and parameters) in host memory, the
  update on the host, or placed by the first step's plan: as plain optax,
  the row chunks' shards in `pinned_host`, nothing sent over the model
  axis but the model's own all-reduces."""
  _, params, loss_fn, batches = _problem()
  ref_losses, ref_params = reference_run(loss_fn, nn.meta.unbox(params), TX,
                                         batches)
  state = _state(3, **fields)
  rows = [c for c, chunk in enumerate(state.layout.chunks) if chunk.model_shards]
  if fields.get("offload_params"):
    assert {state.master[c].sharding.memory_kind for c in rows} == {"pinned_host"}
  state, losses, _, program = _run_and_program(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state), ref_losses,
                           ref_params)
  assert _collectives_apart(program, _mesh()) == []
  if "placement" in fields:
    assert state.config.placement == "planned"


@pytest.mark.slow
def test_tensor_parallel_with_quantized_collectives():
  """qwZ / qgZ on row chunks: with the exact (identity) encoding the losses
  equal the plain tensor-parallel run's bit for bit and the parameters to
  float32 rounding (the identity gradient path sums a row's pieces in
  another order than XLA's CPU reduce-scatter, as on hpZ in
  test_quantize), int8 stays within the quantized tolerance, and the
  quantized gathers and all-to-alls run over data only."""
  _, _, loss_fn, batches = _problem()
  runs = {}
  for mode in (None, "identity", "int8"):
    state = _state(3, compute_dtype="bfloat16", quantize_weights=mode,
                   quantize_grads=mode, quantize_block=64)
    state, losses, _, program = _run_and_program(state, loss_fn, batches)
    runs[mode] = (losses, zerojax.gather_params(state))
    assert _collectives_apart(program, _mesh()) == []
  np.testing.assert_array_equal(runs[None][0], runs["identity"][0])
  jax.tree_util.tree_map(functools.partial(
      np.testing.assert_allclose, rtol=1e-6, atol=1e-8), runs[None][1],
                         runs["identity"][1])
  np.testing.assert_allclose(runs["int8"][0], runs[None][0], rtol=2e-2)


def test_the_split_is_read_from_logical_names_and_from_placed_arrays():
  """The same split said three ways gives the same chunk layout: Flax
  mesh-axis boxes, logical boxes (`nn.with_logical_partitioning`, mapped by
  the rules active at `shard`), and parameters a GSPMD user already placed
  with `NamedSharding` (no boxes)."""
  _, params, _, _ = _problem()
  mesh = _mesh()
  boxed = lambda x: isinstance(x, nn.Partitioned)
  logical = jax.tree_util.tree_map(
      lambda x: nn.LogicallyPartitioned(x.value, tuple(
          {"model": "heads"}.get(n, n) for n in x.names)) if boxed(x) else x,
      params, is_leaf=boxed)
  specs = nn.get_partition_spec(params)
  placed = jax.device_put(nn.meta.unbox(params), jax.tree_util.tree_map(
      lambda s: NamedSharding(mesh, s), specs))

  def layout(p):
    return zerojax.shard(train_state.TrainState.create(
        apply_fn=None, params=p, tx=TX), stage=3, mesh=mesh,
                         axes=zerojax.Axes(model="model")).layout

  want = layout(params)
  assert any(c.model_shards == M for c in want.chunks)
  with nn.logical_axis_rules((("heads", "model"),)):
    assert layout(logical) == want
  assert layout(placed) == want


@pytest.mark.slow
def test_eval_step_on_a_tensor_parallel_state():
  """eval_step at stages 1 and 3 (the forward's gathers, per row): per
  example logits' sums and the mean loss equal the plain model's on the
  whole batch."""
  model, params, loss_fn, batches = _problem()
  plain = nn.meta.unbox(params)
  batch = batches[0]

  def outputs(p, b):
    logits = model.apply({"params": p}, b["tokens"])
    return {"loss": loss_fn(p, b), "sums": logits.sum(axis=(1, 2))}

  want = outputs(plain, batch)
  for stage in (1, 3):
    got = zerojax.eval_step(outputs)(_state(stage), batch)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-5)
    np.testing.assert_allclose(got["sums"], want["sums"], rtol=1e-4, atol=1e-4)
