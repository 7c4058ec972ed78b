"""eval_step: outputs equal a plain `model.apply` on the gathered
parameters; at stage 3 the model is never gathered whole."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from models import zopts, ResidualMLP, ResNet


class TrainState(train_state.TrainState):
  batch_stats: Any


@pytest.fixture(scope="module")
def trained():
  """A ResNet with BatchNorm, trained 2 steps so its running averages moved;
  the plain (not ZeRO) evaluation model and a batch."""
  rng = np.random.default_rng(1)
  batch = {"x": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
           "y": rng.integers(0, 4, size=(16,)).astype(np.int32)}
  variables = ResNet().init(jax.random.key(0), batch["x"][:2])

  def loss_fn(params, b, batch_stats):
    logits, updates = ResNet().apply(
        {"params": params, "batch_stats": batch_stats}, b["x"],
        mutable=["batch_stats"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b["y"]).mean(), updates

  step = zerojax.train_step(loss_fn, mutable=("batch_stats",))
  states = {}
  # stage 3 with every shard in host memory too: eval gathers from there
  host = dict(offload_params=True, offload_optimizer=True)
  for key, stage, fields in ((0, 0, {}), (1, 1, {}), (2, 2, {}), (3, 3, {}),
                             ("3 offload", 3, host)):
    state = zerojax.shard(TrainState.create(
        apply_fn=None, params=variables["params"], tx=optax.adam(1e-2),
        batch_stats=variables["batch_stats"]), stage=stage, **zopts(fields))
    for _ in range(2):
      state, _ = step(state, batch)
    states[key] = state
  return states, batch


def _metrics(params, b, batch_stats):
  logits = ResNet(train=False).apply(
      {"params": params, "batch_stats": batch_stats}, b["x"])
  return {"logits": logits,
          "accuracy": jnp.mean(jnp.argmax(logits, -1) == b["y"]),
          "loss": optax.softmax_cross_entropy_with_integer_labels(
              logits, b["y"]).mean()}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 1, 2, 3, "3 offload"])
def test_eval_equals_plain_apply_on_gathered_params(trained, stage):
  states, batch = trained
  state = states[stage]
  out = zerojax.eval_step(_metrics, mutable=("batch_stats",))(state, batch)
  plain = _metrics(zerojax.gather_params(state), batch, state.batch_stats)
  # per-example logits come back in global batch order
  assert out["logits"].shape == (16, 4)
  np.testing.assert_allclose(out["logits"], plain["logits"], rtol=1e-5, atol=1e-6)
  # scalars: the mean over devices of per-device means (equal slices), so
  # the global mean
  np.testing.assert_allclose(out["loss"], plain["loss"], rtol=1e-5)
  np.testing.assert_allclose(out["accuracy"], plain["accuracy"], rtol=1e-6)
  # evaluation changes no state: the same evaluation gives the same values
  again = zerojax.eval_step(_metrics, mutable=("batch_stats",))(state, batch)
  np.testing.assert_array_equal(again["logits"], out["logits"])


def test_eval_with_rng_draws_per_device(trained):
  states, batch = trained

  def noise(params, b, rng):
    return {"noise": jax.random.normal(rng, (b["x"].shape[0],))}

  out = zerojax.eval_step(noise)(states[3], batch, jax.random.key(3))["noise"]
  per_device = np.asarray(out).reshape(8, 2)
  assert len({tuple(row) for row in per_device}) == 8


def _unrolled(layers, width=256):
  model = ResidualMLP(layers=layers, width=width, layerwise=True)
  x = np.zeros((64, width), np.float32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1])["params"])
  state = zerojax.shard_shape(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), stage=3)
  apply = lambda p, b: model.apply({"params": p}, b)
  train = zerojax.train_step(apply).lower(state, x).compile()
  evaluate = zerojax.eval_step(apply).lower(state, x).compile()
  return state, train, evaluate


@pytest.mark.slow
def test_stage3_eval_needs_no_more_memory_than_training_and_never_the_whole_model():
  state, train, evaluate = _unrolled(16)
  footprint = lambda c: zerojax.compiled_footprint(c)["footprint"]
  assert footprint(evaluate) <= footprint(train)
  full_model = sum(c.used for c in state.layout.chunks) * 4
  per_block = sum(c.used for c in state.layout.chunks if c.stack == "blocks_0") * 4
  assert full_model > 12 * per_block
  # temporaries: a block or two gathered at a time, never the whole model
  temp = evaluate.memory_analysis().temp_size_in_bytes
  assert temp < 3 * per_block + 64 * 256 * 4 * 4
  assert temp < full_model / 4


@pytest.mark.parametrize("call,error,match", [
    (lambda s, b: zerojax.eval_step(7)(s, b), TypeError, "evaluation function"),
    (lambda s, b: zerojax.eval_step(_metrics, mutable=("stats",))(s, b),
     ValueError, "no field 'stats'"),
    (lambda s, b: zerojax.eval_step(lambda p, x: {"bad": jnp.ones((3,))})(s, b),
     TypeError, r"evaluation value \['bad'\] has shape \(3,\)"),
    (lambda s, b: zerojax.eval_step(_metrics)({"not": "a state"}, b),
     TypeError, "ZeroTrainState"),
    (lambda s, b: zerojax.eval_step(_metrics)(s, {"x": b["x"][:3]}),
     ValueError, "not divisible by 8 devices"),
])
def test_eval_bad_input(trained, call, error, match):
  states, batch = trained
  with pytest.raises(error, match=match):
    call(states[3], batch)
