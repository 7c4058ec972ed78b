"""train_step against the independent reference: plain optax on one device."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from jax.sharding import AxisType, Mesh

import zerojax
from models import make_problem, reference_run

LR = 1e-2
CLIP = 0.5
# 16-bit runs are compared with the same mixed-precision recipe on one
# device; what differs is only the order of 16-bit partial sums, so the
# tolerance is a few bfloat16 ulps of the loss and of the parameters' moves.
BF16_LOSS_RTOL = 2e-2
BF16_PARAM_ATOL = 2e-2


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
  state = zerojax.shard(state, mesh=mesh, stacked=stacked, chunk_size=2048,
                        **fields)
  step = zerojax.train_step(loss_fn)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  return np.array(losses), zerojax.gather_params(state), state


def _assert_close(kind, dtype, clip, losses, params):
  ref_losses, ref_params = _reference(kind, dtype, clip)
  if dtype == "float32":
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
        params, ref_params)
  else:
    np.testing.assert_allclose(losses, ref_losses, rtol=BF16_LOSS_RTOL)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, atol=BF16_PARAM_ATOL),
        params, ref_params)


# Every stage x precision x accumulation x model; clipping is on for half of
# them, so that each stage meets clipping on and off with both precisions and
# both accumulations (pairwise cover: all 64 combinations cost ~5 min of CI).
MATRIX = [(kind, stage, dtype, accum, CLIP if (dtype == "bfloat16") != (accum == 4)
           else None)
          for kind in ("mlp", "transformer") for stage in (0, 1, 2, 3)
          for dtype in ("float32", "bfloat16") for accum in (1, 4)]


@pytest.mark.parametrize("kind,stage,dtype,accum,clip", MATRIX, ids=[
    f"{k}-{s}-{d}-{a}-{'clip' if c else 'noclip'}" for k, s, d, a, c in MATRIX])
def test_matches_plain_optax(kind, stage, dtype, accum, clip):
  losses, params, state = _zero_run(kind, stage=stage, compute_dtype=dtype,
                                    accum_steps=accum, clip_norm=clip)
  _assert_close(kind, dtype, clip, losses, params)
  assert int(state.step) == len(losses)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_layer_stacked_chunks_match_plain_optax(stage):
  losses, params, state = _zero_run("scan_transformer", stage=stage,
                                    accum_steps=2, clip_norm=CLIP)
  assert any(c.layers == 2 for c in state.layout.chunks)
  _assert_close("scan_transformer", "float32", CLIP, losses, params)


@pytest.mark.parametrize("num_devices", [1, 2])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_small_meshes(stage, num_devices):
  mesh = Mesh(np.array(jax.devices()[:num_devices]), ("data",),
              axis_types=(AxisType.Auto,))
  losses, params, _ = _zero_run("mlp", mesh=mesh, stage=stage, accum_steps=2,
                                clip_norm=CLIP)
  _assert_close("mlp", "float32", CLIP, losses, params)


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
                        compute_dtype="float16",
                        loss_scale=zerojax.DynamicLossScale(init_scale=256.0))
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
    return jnp.mean((out - b["y"] - noise) ** 2)

  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=2, accum_steps=2)
  step = zerojax.train_step(noisy_loss)
  _, m1 = step(state, batches[0], jax.random.key(1))
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=2, accum_steps=2)
  _, m2 = step(state, batches[0], jax.random.key(2))
  assert np.isfinite(float(m1["loss"])) and float(m1["loss"]) != float(m2["loss"])


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
