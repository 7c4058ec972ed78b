"""Bad input at the step, `create` and `shard` (issue 44's probe, items 6
and 7): each refused at the entry point with the value and the fix, the
state untouched."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from models import MLP, make_problem

TX = optax.adam(1e-2)


@pytest.fixture(scope="module")
def mlp():
  model, params, loss_fn, batches = make_problem("mlp")
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3)
  return state, loss_fn, batches


@pytest.mark.parametrize("edit,match", [
    (lambda b: {k: v[:0] for k, v in b.items()},
     r"the batch is empty \(leading size 0\)"),
    (lambda b: {**b, "x": b["x"].tolist()},
     r"batch\['x'\]\[0\]\[0\] is a float .* every batch value must be an "
     r"array"),
    (lambda b: {**b, "t": 0.5},
     r"batch\['t'\] is a float \(0.5\): every batch value must be an array"),
    (lambda b: {**b, "y": b["y"][:16]},
     r"same leading .* got 16 \(batch\['y'\]\), 32 \(batch\['x'\]\)"),
], ids=["empty", "nested lists", "python scalar", "two sizes"])
def test_a_bad_batch_is_named_and_the_state_kept(mlp, edit, match):
  state, loss_fn, batches = mlp
  step = zerojax.train_step(loss_fn)
  before = int(state.step)
  with pytest.raises(ValueError, match=match):
    step(state, edit(batches[0]))
  with pytest.raises(ValueError, match=match):
    zerojax.eval_step(loss_fn)(state, edit(batches[0]))
  assert int(state.step) == before and not any(
      x.is_deleted() for x in state.master)


def test_a_loss_fn_that_cannot_take_the_steps_arguments_is_named(mlp):
  state, loss_fn, batches = mlp
  with pytest.raises(TypeError, match=r"step\(\): the function\(params, b\) "
                     r"cannot be called as fn\(params, batch, rng\) .* pass no "
                     r"rng to the step, or give the function an rng"):
    zerojax.train_step(loss_fn)(state, batches[0], jax.random.key(0))

  def with_rng(params, batch, rng):
    return loss_fn(params, batch)

  with pytest.raises(TypeError, match=r"cannot be called as fn\(params, "
                     r"batch\) .* pass the step an rng"):
    zerojax.train_step(with_rng)(state, batches[0])
  with pytest.raises(TypeError, match=r"evaluate\(\): the function"):
    zerojax.eval_step(with_rng)(state, batches[0])
  assert not any(x.is_deleted() for x in state.master)


def test_create_refuses_an_init_fn_that_returns_no_tree():
  with pytest.raises(TypeError, match=r"init_fn returned .* not a tree of "
                     r"parameter arrays.*nothing was created"):
    zerojax.create(lambda r: 42, jax.random.key(0), tx=TX)


def test_a_complex_parameter_is_refused_at_shard():
  model, params, _, _ = make_problem("mlp")
  params = {**params, "phase": jnp.ones((4,), jnp.complex64)}
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  with pytest.raises(ValueError, match=r"parameter \['phase'\] is complex64: "
                     r".*two real leaves .*or freeze it"):
    zerojax.shard(plain, stage=3)
  frozen = zerojax.shard(plain, stage=3, frozen=lambda p: (
      jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "phase",
                                       p)))
  np.testing.assert_array_equal(zerojax.gather_params(frozen)["phase"],
                                params["phase"])


def test_float16_parameters_with_adam_name_the_epsilon_and_the_fix():
  model = MLP()
  params = jax.tree_util.tree_map(lambda x: x.astype(jnp.float16), model.init(
      jax.random.key(0), jnp.ones((1, 8)))["params"])
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3))
  with pytest.raises(ValueError, match=r"non-finite update for a zero "
                     r"gradient on float16 .*eps=1e-8 is 0 in float16.* "
                     r"precision='fp16'"):
    zerojax.shard(plain, stage=3)


# ---- issue 61, items 13 and 14: each failed before its fix ----------------

def test_gathering_lower_and_trace_name_a_missing_rng(mlp):
  state, loss_fn, batches = mlp
  step = zerojax.train_step(lambda p, b, rng: loss_fn(p, b))
  for call, name in ((step.gathering, "gathering"), (step.lower, "lower"),
                     (step.trace, "trace")):
    with pytest.raises(TypeError, match=rf"step.{name}\(\): the function.* "
                       r"cannot be called as fn\(params, batch\).*pass the "
                       r"step an rng"):
      call(state, batches[0])


def test_an_nnx_model_indexed_as_a_parameter_dict_is_named():
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.dense = nnx.Linear(8, 4, rngs=rngs)

    def __call__(self, x):
      return self.dense(x)

  _, _, _, batches = make_problem("mlp")
  state = zerojax.shard(Net(nnx.Rngs(0)), tx=TX, stage=3)
  linen_style = lambda params, b: jnp.mean(
      (params["dense"]["kernel"] @ b["x"].T) ** 2)
  with pytest.raises(TypeError, match=r"indexed the NNX model as a parameter "
                     r"dict .*'Net' object is not subscriptable.*takes the "
                     r"model itself"):
    zerojax.train_step(linen_style)(state, batches[0])


def test_an_optimizer_whose_update_is_nan_is_named_as_such():
  """`--lr nan` (examples/finetune_lora.py) was diagnosed as a transform
  that "moves zero padding"."""
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(float("nan")))
  with pytest.raises(ValueError, match=r"its update is not finite on the "
                     r"ordinary parameter tree either.*learning rate"):
    zerojax.shard(plain, stage=3)


@pytest.mark.parametrize("make,match", [
    (lambda: zerojax.DynamicLossScale(growth_factor=0.5),
     r"growth_factor=0.5 must be above 1"),
    (lambda: zerojax.DynamicLossScale(init_scale=1.0, min_scale=4.0),
     r"min_scale=4.0 is above init_scale=1.0"),
    (lambda: zerojax.Offload(optimizer=False, params=False),
     r"Offload\(optimizer=False, params=False\) offloads nothing; use "
     r"offload=None"),
], ids=["growth", "min scale", "offload nothing"])
def test_groups_that_do_nothing_or_shrink_the_scale_are_refused(make, match):
  with pytest.raises(ValueError, match=match):
    make()
