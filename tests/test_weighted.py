"""`train_step(loss_fn, weighted=True)`: a masked token loss over the whole
global batch, Σ sum / Σ weight, whatever the padding per device, micro-batch
and replica; against plain optax on one device with the same loss."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from models import zopts, assert_matches_reference, make_problem, reference_run

# momentum SGD: Adam turns a near-zero gradient (a rare token's embedding row)
# into a full step, so float32 sums in another order would move it visibly
TX = optax.sgd(0.1, momentum=0.9)
STEPS = 3


@functools.lru_cache(maxsize=None)
def _problem():
  model, params, _, batches = make_problem("transformer", steps=STEPS)
  rng = np.random.default_rng(1)
  padded = []
  for b in batches:
    n, seq = b["tokens"].shape
    # half the batch nearly all padding, the rest of uneven lengths, rows
    # shuffled so that devices and micro-batches get different token counts
    lengths = np.concatenate([rng.integers(1, 3, n // 2),
                              rng.integers(3, seq + 1, n - n // 2)])
    rng.shuffle(lengths)
    mask = (np.arange(seq)[None, :] < lengths[:, None]).astype(np.float32)
    padded.append({**b, "mask": mask})
  return model, params, padded


def _token_losses(model, params, b):
  logits = model.apply({"params": params}, b["tokens"])
  return optax.softmax_cross_entropy_with_integer_labels(logits, b["targets"])


def _weighted(model):
  def loss_fn(params, b):
    losses = _token_losses(model, params, b)
    return (losses * b["mask"]).sum(), b["mask"].sum()
  return loss_fn


def _masked_mean(model):
  def loss_fn(params, b):
    losses = _token_losses(model, params, b)
    return (losses * b["mask"]).sum() / b["mask"].sum()
  return loss_fn


def _reference():
  model, params, batches = _problem()
  return reference_run(_masked_mean(model), params, TX, batches)


def _run(mesh=None, **fields):
  model, params, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), mesh=mesh, **zopts(fields))
  step = zerojax.train_step(_weighted(model), weighted=True)
  losses, weights = [], []
  for b in batches:
    state, m = step(state, b)
    losses.append(float(m["loss"]))
    weights.append(float(m["weight"]))
    assert not bool(m["skipped"])
  np.testing.assert_array_equal(weights, [b["mask"].sum() for b in batches])
  return np.array(losses), zerojax.gather_params(state)


@pytest.mark.parametrize("stage,accum", [(1, 1), (3, 1), (1, 4), (3, 4)])
def test_weighted_equals_the_masked_mean_of_the_whole_batch(stage, accum):
  losses, params = _run(stage=stage, accum_steps=accum)
  assert_matches_reference(losses, params, *_reference())


@pytest.mark.slow
def test_weighted_on_a_hybrid_mesh_counts_every_replica():
  mesh = jax.make_mesh((2, 4), ("replica", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  losses, params = _run(mesh=mesh, stage=3, replica_axis="replica",
                        accum_steps=2)
  assert_matches_reference(losses, params, *_reference())


def test_the_unweighted_masked_mean_is_a_mean_of_slices():
  """Why `weighted` exists: the same masked mean written as an ordinary loss
  averages the devices' means, which differs with uneven padding."""
  model, params, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3)
  _, m = zerojax.train_step(_masked_mean(model))(state, batches[0])
  ref_losses, _ = _reference()
  assert abs(float(m["loss"]) - ref_losses[0]) > 1e-3 * ref_losses[0]


def test_a_batch_of_weight_zero_is_a_skipped_step():
  model, params, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3)
  before = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))
  step = zerojax.train_step(_weighted(model), weighted=True)
  empty = {**batches[0], "mask": np.zeros_like(batches[0]["mask"])}
  state, m = step(state, empty)
  assert bool(m["skipped"]) and float(m["weight"]) == 0.0
  assert int(state.step) == 0
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state), before)
  state, m = step(state, batches[0])   # and trains on afterwards
  assert not bool(m["skipped"]) and int(state.step) == 1


def test_weighted_eval_is_the_global_ratio_and_bad_returns_are_named():
  model, params, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3)
  got = zerojax.eval_step(_weighted(model), weighted=True)(state, batches[0])
  want = _masked_mean(model)(params, batches[0])
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  with pytest.raises(TypeError, match=r"weighted=True: the function must "
                     r"return \(sum, weight\)"):
    zerojax.train_step(_masked_mean(model), weighted=True)(state, batches[0])
  with pytest.raises(TypeError, match=r"train_step\(weighted='yes'\)"):
    zerojax.train_step(_weighted(model), weighted="yes")


def test_a_batch_of_negative_weight_is_a_skipped_step():
  """Σ weight is the global batch's token count; a negative one has no
  meaning, and the step skips it as it skips 0 (`metrics["skipped"]`, the
  step count unchanged; docs: train_step)."""
  model, params, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3)
  step = zerojax.train_step(_weighted(model), weighted=True)
  negative = {**batches[0], "mask": -batches[0]["mask"]}
  state, m = step(state, negative)
  assert bool(m["skipped"]) and float(m["weight"]) < 0
  assert int(state.step) == 0


def _fp16_run(loss_fn, weighted):
  model, params, _, batches = make_problem("transformer", batch=128, steps=12)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), stage=3,
      precision="fp16")
  step = zerojax.train_step(loss_fn(model), weighted=weighted)
  skipped = 0
  for b in batches:
    state, m = step(state, {**b, "mask": np.ones(b["tokens"].shape,
                                                 np.float32)})
    skipped += int(m["skipped"])
  return skipped, float(state.loss_scale.scale), float(m["loss"])


@pytest.mark.slow
def test_under_fp16_a_weighted_loss_scales_as_its_mean_does():
  """128 tokens per device, 12 steps, the default dynamic scale (2**15):
  the weighted loss and the same mean skip the same steps and end at the
  same scale (was: 5 of 12 skipped and 1024, against 0 and 32768: the scale
  multiplied the sum). [Note: a loss-scaled weighted loss]"""
  weighted = _fp16_run(_weighted, True)
  mean = _fp16_run(_masked_mean, False)
  assert weighted[:2] == mean[:2], (weighted, mean)
  np.testing.assert_allclose(weighted[2], mean[2], rtol=2e-2)
