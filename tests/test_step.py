"""train_step against the independent reference: plain optax on one device."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AxisType, Mesh

import zerojax
from models import zopts
from models import (assert_matches_reference, make_problem, reference_run,
                    zero_run)

LR = 1e-2
CLIP = 0.5


# Momentum SGD with weight decay: linear in the gradients, so this matrix
# compares the gradients themselves. Adam normalises each element: where a
# gradient element cancels to ~1e-7 of its row's scale (a rare token's
# embedding), summation-order noise of 1% there becomes a 1e-4 move, in any
# data-parallel run. Adam itself is checked in test_optim. One object for the
# whole module: zerojax probes each (tx, tree) once.
TX = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(LR * 10, momentum=0.9))
_problem = functools.lru_cache(maxsize=None)(make_problem)


@functools.lru_cache(maxsize=None)
def _reference(kind, dtype_name, clip):
  _, params, loss_fn, batches = _problem(kind)
  return reference_run(loss_fn, params, TX, batches,
                       compute_dtype=jnp.dtype(dtype_name), clip_norm=clip)


def _zero_run(kind, mesh=None, **fields):
  model, params, loss_fn, batches = _problem(kind)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  stacked = ("blocks",) if kind == "scan_transformer" else ()
  state = zerojax.shard(state, mesh=mesh, chunk_size=2048,
                        **zopts({"stacked": stacked, **fields}))
  state, losses = zero_run(state, loss_fn, batches)
  return losses, zerojax.gather_params(state), state


def _assert_close(kind, dtype, clip, losses, params):
  assert_matches_reference(losses, params, *_reference(kind, dtype, clip),
                           compute_dtype=dtype)


# Every stage x precision x accumulation x model; clipping is on for half of
# them, so that each stage meets clipping on and off with both precisions and
# both accumulations (pairwise cover: all 64 combinations cost ~5 min of CI).
MATRIX = [(kind, stage, dtype, accum, CLIP if (dtype == "bfloat16") != (accum == 4)
           else None)
          for kind in ("mlp", "transformer") for stage in (0, 1, 2, 3)
          for dtype in ("float32", "bfloat16") for accum in (1, 4)]


# (the MLP's cases are the fast tier's parity check at every stage)
@pytest.mark.parametrize("kind,stage,dtype,accum,clip", [
    pytest.param(*case, marks=[pytest.mark.slow] * (case[0] == "transformer"),
                 id="{}-{}-{}-{}-{}".format(*case[:4],
                                            "clip" if case[4] else "noclip"))
    for case in MATRIX])
def test_matches_plain_optax(kind, stage, dtype, accum, clip):
  losses, params, state = _zero_run(kind, stage=stage, compute_dtype=dtype,
                                    accum_steps=accum, clip_norm=clip)
  _assert_close(kind, dtype, clip, losses, params)
  assert int(state.step) == len(losses)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layer_stacked_chunks_match_plain_optax(stage):
  losses, params, state = _zero_run("scan_transformer", stage=stage,
                                    accum_steps=2, clip_norm=CLIP)
  assert any(c.layers == 2 for c in state.layout.chunks)
  _assert_close("scan_transformer", "float32", CLIP, losses, params)


def _transformer_on(devices, **fields):
  """The test transformer sharded on the first `devices` devices (chunks of
  2048): `(state, loss_fn, first batch)`, for compiling its step."""
  model, params, loss_fn, batches = _problem("transformer")
  mesh = Mesh(np.array(jax.devices()[:devices]), ("data",),
              axis_types=(AxisType.Auto,))
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), mesh=mesh,
                        chunk_size=2048, **zopts(fields))
  return state, loss_fn, batches[0]


@pytest.mark.parametrize("num_devices", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_small_meshes(stage, num_devices):
  """On one device without accumulation nothing sums the gradients, and the
  global norm (clipping here) is taken per leaf (`step._global_norm`)."""
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",),
              axis_types=(AxisType.Auto,))
  losses, params, _ = _zero_run("mlp", mesh=mesh, stage=stage,
                                accum_steps=num_devices, clip_norm=CLIP)
  _assert_close("mlp", "float32", CLIP, losses, params)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_one_device_mesh_compiles_no_collective(stage):
  """XLA keeps a one-device all-reduce (on CPU a copy of every gradient
  chunk); zerojax emits none, and the step still matches plain optax
  (test_small_meshes)."""
  state, loss_fn, batch = _transformer_on(1, stage=stage, accum_steps=2,
                                          clip_norm=CLIP)
  hlo = zerojax.train_step(loss_fn).lower(state, batch).compile().as_text()
  found = [op for op in ("all-reduce", "all-gather", "reduce-scatter",
                         "all-to-all", "collective-permute") if op in hlo]
  assert not found, found


@pytest.mark.slow
def test_one_device_keeps_each_leaf_a_chunk(tmp_path):
  """On one device with no chunk size given each leaf is a chunk of its own
  (nothing to send, so nothing to pack: docs/design.md), the step still
  matches plain optax, and its checkpoint restores on 8 devices into packed
  chunks. A chunk size, or offload (the chunk is the unit of a transfer),
  packs as on N devices."""
  model, params, loss_fn, batches = _problem("transformer")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  one = Mesh(np.array(jax.devices()[:1]), ("data",),
             axis_types=(AxisType.Auto,))
  leaves = len(jax.tree_util.tree_leaves(params))
  state = zerojax.shard(plain, mesh=one, stage=3, clip_norm=CLIP)
  assert [len(c.leaves) for c in state.layout.chunks] == [1] * leaves
  state, losses = zero_run(state, loss_fn, batches)
  _assert_close("transformer", "float32", CLIP, losses,
                zerojax.gather_params(state))
  for fields in (dict(chunk_size=2048), dict(offload_optimizer=True)):
    packed = zerojax.shard_shape(plain, mesh=one, stage=3, **zopts(fields))
    assert len(packed.layout.chunks) < leaves, fields
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  back = zerojax.checkpoint.restore(tmp_path, like=plain, stage=3)
  assert back.num_shards == 8 and len(back.layout.chunks) < leaves
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(back),
                         zerojax.gather_params(state))


@pytest.mark.parametrize("accum", [1, 2])
def test_one_device_norm_reads_each_leaf_gradient(accum):
  """On one device with one micro-batch a flat chunk's gradient is the
  concatenate of its leaves' (nothing sums it), which XLA's CPU backend
  squares in full before the norm's reduction: the norm is then a dot per
  leaf. Summed gradients (`accum_steps=2`) keep one dot per chunk."""
  state, loss_fn, batch = _transformer_on(1, stage=0, accum_steps=accum,
                                          clip_norm=CLIP)
  text = zerojax.train_step(loss_fn).lower(state, batch).as_text()
  squares = re.findall(r"stablehlo.dot_general[^\n]*-> tensor<f32>", text)
  chunks = state.layout.chunks
  assert all(not c.layers for c in chunks) and len(chunks) > 1
  want = (sum(len(c.leaves) for c in chunks) if accum == 1 else len(chunks))
  assert len(squares) == want, (len(squares), want)


@pytest.mark.parametrize("stage,devices", [(0, 1), (3, 1), (0, 2)])
def test_the_donated_master_is_updated_in_place(stage, devices):
  """Where the forward reads the master itself (stage 0; any stage on one
  device), the update waits for the loss and the whole backward, and is
  applied in the chunk's shape: XLA then writes the new master into the
  donated buffer instead of copying the master (or the new one) whole.
  The weight decay of `TX` reads the master twice."""
  state, loss_fn, batch = _transformer_on(devices, stage=stage)
  hlo = zerojax.train_step(loss_fn).lower(state, batch).compile().as_text()
  sizes = {int(np.prod(c.shape)) for c in state.layout.chunks}
  copied = [int(n) for n in re.findall(r"= f32\[(\d+)\]\{0\} copy\(", hlo)]
  assert not [n for n in copied if n in sizes], (copied, sizes)


@pytest.mark.slow
def test_metrics_report_global_norm_before_clipping_and_aux():
  model, params, loss_fn, batches = make_problem("mlp")

  def with_aux(p, b):
    loss = loss_fn(p, b)
    return loss, {"twice": 2 * loss}

  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
                        clip_norm=1e-3, accum_steps=2)
  state, metrics = zerojax.train_step(with_aux, has_aux=True)(state, batches[0])
  want = optax.tree.norm(jax.grad(loss_fn)(params, batches[0]))
  np.testing.assert_allclose(metrics["grad_norm"], want, rtol=1e-5)
  np.testing.assert_allclose(metrics["twice"], 2 * metrics["loss"], rtol=1e-6)


def test_float16_skips_the_overflowing_step_and_recovers():
  model, params, loss_fn, batches = make_problem("mlp")
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
                        precision=zerojax.Precision(compute="float16", loss_scale=zerojax.DynamicLossScale(init_scale=256.0)))
  step = zerojax.train_step(loss_fn)
  state, m = step(state, batches[0])
  assert not bool(m["skipped"]) and float(m["loss_scale"]) == 256.0
  before_master = [np.asarray(x) for x in state.master]
  before_opt = [np.asarray(x) for x in jax.tree_util.tree_leaves(state.opt_state)]
  bad = dict(batches[1], x=batches[1]["x"].copy())
  bad["x"][3, 0] = np.inf        # one device's gradient becomes non-finite
  state, m = step(state, bad)
  assert bool(m["skipped"]) and float(m["loss_scale"]) == 128.0
  assert int(state.step) == 1
  for a, b in zip(before_master, state.master):
    np.testing.assert_array_equal(a, np.asarray(b))
  for a, b in zip(before_opt, jax.tree_util.tree_leaves(state.opt_state)):
    np.testing.assert_array_equal(a, np.asarray(b))
  state, m = step(state, batches[2])
  assert not bool(m["skipped"]) and np.isfinite(float(m["loss"]))
  assert int(state.step) == 2
  assert not all(np.array_equal(a, np.asarray(b))
                 for a, b in zip(before_master, state.master))


def test_rng_is_passed_per_device_and_micro_batch():
  model, params, _, batches = make_problem("mlp")

  def noisy_loss(p, b, rng):
    noise = jax.random.normal(rng, b["y"].shape)
    out = model.apply({"params": p}, b["x"])
    # per-example draws come back in global batch order: device, then
    # micro-batch, then example
    return jnp.mean((out - b["y"] - noise) ** 2), {"draw": noise[:, 0]}

  def run(key):
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=TX), stage=2, accum_steps=2)
    return zerojax.train_step(noisy_loss, has_aux=True)(state, batches[0], key)[1]

  m1, m2 = run(jax.random.key(1)), run(jax.random.key(2))
  assert np.isfinite(float(m1["loss"])) and float(m1["loss"]) != float(m2["loss"])
  draws = np.asarray(m1["draw"]).reshape(8 * 2, -1)   # 8 devices x 2 micro-batches
  assert draws.shape[1] >= 2
  # every (device, micro-batch) drew its own numbers: no two rows alike
  assert len({row.tobytes() for row in draws}) == len(draws)


def test_batch_not_divisible_raises_and_keeps_state():
  model, params, loss_fn, batches = make_problem("mlp")
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3, accum_steps=4)
  step = zerojax.train_step(loss_fn)
  small = {k: v[:16] for k, v in batches[0].items()}
  with pytest.raises(ValueError, match=r"global batch 16 .* 8 devices x "
                     r"accum_steps 4 = 32"):
    step(state, small)
  state, _ = step(state, batches[0])   # the state was neither donated nor changed
  assert int(state.step) == 1


def test_step_rejects_plain_train_state():
  model, params, loss_fn, batches = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  with pytest.raises(TypeError, match="zerojax.shard"):
    zerojax.train_step(loss_fn)(plain, batches[0])
  with pytest.raises(TypeError, match="loss function"):
    zerojax.train_step("not a function")


def _mlp_state(mesh=None, **fields):
  model, params, loss_fn, batches = make_problem("mlp")
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), mesh=mesh, **zopts(fields))
  return state, model, loss_fn, batches


def test_a_donated_state_raises_a_clear_error():
  state, _, loss_fn, batches = _mlp_state(stage=3)
  step = zerojax.train_step(loss_fn)
  new, _ = step(state, batches[0])
  for use in (lambda: step(state, batches[1]),
              lambda: zerojax.gather_params(state),
              lambda: zerojax.memory_report(state)):
    with pytest.raises(ValueError, match=r"donated to a previous step call.*"
                       r"use the state that call returned"):
      use()
  new, _ = step(new, batches[1])   # the returned state goes on
  assert int(new.step) == 2


def test_donate_false_keeps_the_state_when_a_step_fails_at_run_time():
  """A host callback raises inside the step. (With donation the input's
  buffers may be gone by then, depending on when the failure surfaces.) On
  a 1-device mesh: with several simulated CPU devices, a callback failing on
  some of them leaves the others waiting in a collective (a CPU runtime
  limit, not zerojax's)."""
  mesh = Mesh(np.array(jax.devices()[:1]), ("data",), axis_types=(AxisType.Auto,))
  state, _, loss_fn, batches = _mlp_state(mesh=mesh, stage=3)
  fail = []

  def check(loss):
    if fail:
      raise RuntimeError("a host callback failed")

  def loss_with_callback(p, b):
    loss = loss_fn(p, b)
    jax.debug.callback(check, loss)
    return loss

  step = zerojax.train_step(loss_with_callback, donate=False)
  state, _ = step(state, batches[0])
  before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
  fail.append(1)
  with pytest.raises(Exception, match="a host callback failed"):
    jax.block_until_ready(step(state, batches[1]))
  fail.clear()
  for a, b in zip(before, jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(a, np.asarray(b))
  state, _ = step(state, batches[1])
  assert int(state.step) == 2
  with pytest.raises(TypeError, match=r"train_step\(donate='no'\) must be True"):
    zerojax.train_step(loss_fn, donate="no")


def test_bad_losses_and_aux_values_are_refused():
  state, model, loss_fn, batches = _mlp_state(stage=1)
  step = lambda f, **kw: zerojax.train_step(f, **kw)(state, batches[0])
  with pytest.raises(TypeError, match=r"floating scalar loss; it returned an "
                     r"array of dtype int32 and shape \(\)"):
    step(lambda p, b: loss_fn(p, b).astype(jnp.int32))
  with pytest.raises(TypeError, match=r"floating scalar loss; .* shape \(4, 4\)"):
    step(lambda p, b: model.apply({"params": p}, b["x"][:4]))
  with pytest.raises(TypeError, match=r"has_aux=True\): loss_fn must return "
                     r"\(loss, aux\); it returned an array"):
    step(loss_fn, has_aux=True)
  with pytest.raises(TypeError, match=r"returned a tuple of 2, not a scalar "
                     r"loss; .* has_aux=True"):
    step(lambda p, b: (loss_fn(p, b), {"a": 1.0}))
  with pytest.raises(TypeError, match=r"aux value \['bad'\] has shape \(3,\)"):
    step(lambda p, b: (loss_fn(p, b), {"bad": jnp.ones(3)}), has_aux=True)
  for key in ("loss", "grad_norm", "loss_scale", "skipped"):
    with pytest.raises(ValueError, match=rf"aux key\(s\) \['{key}'\] would "
                       "overwrite the step's own metric"):
      step(lambda p, b: (loss_fn(p, b), {key: 1.0, "fine": 2.0}), has_aux=True)
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])  # never donated
  assert int(state.step) == 1


@pytest.mark.parametrize("stage", [1, 3])
def test_aux_scalars_are_averaged_and_per_example_values_concatenated(stage):
  state, model, loss_fn, batches = _mlp_state(stage=stage, accum_steps=2)
  _, params, _, _ = _problem("mlp")

  def per_example(p, b):
    err = jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2, axis=-1)
    return err.mean(), {"err": err, "first": err[0]}

  _, m = zerojax.train_step(per_example, has_aux=True)(state, batches[0])
  want = np.mean((model.apply({"params": params}, batches[0]["x"])
                  - batches[0]["y"]) ** 2, axis=-1)
  assert m["err"].shape == want.shape
  np.testing.assert_allclose(m["err"], want, rtol=1e-5)
  # micro-batch 0 of each device starts every 2nd group of 2 examples
  np.testing.assert_allclose(m["first"], want.reshape(16, 2)[:, 0].mean(), rtol=1e-5)
  np.testing.assert_allclose(m["loss"], want.mean(), rtol=1e-5)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_skip_nonfinite_skips_the_step_in_float32(stage):
  state, _, loss_fn, batches = _mlp_state(stage=stage, skip_nonfinite=True)
  step = zerojax.train_step(loss_fn)
  state, m = step(state, batches[0])
  assert not bool(m["skipped"]) and int(state.step) == 1
  before = [np.asarray(x) for x in jax.tree_util.tree_leaves(state)]
  bad = dict(batches[1], x=batches[1]["x"].copy())
  bad["x"][5, 1] = np.nan
  state, m = step(state, bad)
  assert bool(m["skipped"]) and int(state.step) == 1
  for a, b in zip(before, jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(a, np.asarray(b))
  state, m = step(state, batches[1])
  assert not bool(m["skipped"]) and int(state.step) == 2


@pytest.mark.parametrize("stage", [1, 3])
def test_bfloat16_stored_parameters_follow_the_stated_policy(stage):
  """Parameters stored in bfloat16 (no fp32 master asked for): the forward
  runs in compute_dtype on the widened values, gradients are reduced in
  reduce_dtype (float32), and optax updates the bfloat16 parameters with
  those float32 gradients, the new values rounded to bfloat16 (`train_step`'s
  docstring). Against plain optax doing exactly that on one device: the same
  loss, and parameters within one bfloat16 ulp (the order of float32 sums
  can move a rounding)."""
  model, params, loss_fn, batches = make_problem("mlp")
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.bfloat16), params)
  tx = optax.adam(1e-2)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=stage)
  state, m = zerojax.train_step(loss_fn)(state, batches[0])
  loss, g = jax.value_and_grad(lambda q: loss_fn(q, batches[0]))(
      jax.tree_util.tree_map(lambda x: x.astype(jnp.float32), params))
  updates, _ = tx.update(g, tx.init(params), params)
  want = optax.apply_updates(params, updates)

  def within_one_ulp(got, ref):
    assert got.dtype == jnp.bfloat16
    got, ref = np.asarray(got, np.float32), np.asarray(ref, np.float32)
    ulp = np.exp2(np.floor(np.log2(np.maximum(np.abs(ref), 1e-30))) - 7)
    assert np.all(np.abs(got - ref) <= ulp)

  np.testing.assert_allclose(float(m["loss"]), float(loss), rtol=1e-6)
  jax.tree_util.tree_map(within_one_ulp, zerojax.gather_params(state), want)
