"""From a pretrained checkpoint to a fine-tune (issue 43 item 4): a `like`
with leaves the checkpoint lacks (adapters) or without some it has, from a
zerojax checkpoint, a plain orbax checkpoint of parameters, or
`export_params`' tree in memory."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state

import zerojax
from models import make_problem, zero_run


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
  model, params, loss_fn, batches = make_problem("mlp", steps=2)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  state, _ = zero_run(zerojax.shard(plain, stage=3), loss_fn, batches)
  directory = str(tmp_path_factory.mktemp("pretrained"))
  zerojax.checkpoint.save(directory, state, wait=True)
  trained = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))
  return model, params, loss_fn, batches, directory, trained


def _with_adapter(model, params, tx=optax.sgd(0.1)):
  adapter = {"a": jnp.full((8, 2), 0.5, jnp.float32)}
  return train_state.TrainState.create(
      apply_fn=model.apply, params={**params, "adapter": adapter}, tx=tx)


def _check(state, trained):
  got = zerojax.gather_params(state)
  np.testing.assert_array_equal(got["adapter"]["a"], np.full((8, 2), 0.5))
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         {k: v for k, v in got.items() if k != "adapter"},
                         trained)


def test_a_larger_tree_restores_what_both_have_and_lists_the_new(
    pretrained, caplog):
  model, params, loss_fn, batches, directory, trained = pretrained
  like = _with_adapter(model, params)
  with caplog.at_level("INFO", logger="zerojax"):
    state = zerojax.checkpoint.restore(directory, like=like)
  (said,) = [r for r in caplog.records if "new (like's values kept)" in
             r.getMessage()]
  assert "new (like's values kept): adapter/a" in said.getMessage()
  assert said.levelname == "INFO"   # a base restored under adapters: no warning
  _check(state, trained)
  assert state.config.stage == 3 and int(state.step) == 0   # like's step
  step = zerojax.train_step(lambda p, b: loss_fn(
      {k: v for k, v in p.items() if k != "adapter"}, b))
  state, m = step(state, batches[0])
  assert np.isfinite(float(m["loss"]))


def test_a_smaller_tree_needs_partial(pretrained, caplog):
  model, params, _, _, directory, trained = pretrained
  first = sorted(params)[0]
  smaller = {k: v for k, v in params.items() if k != first}
  like = train_state.TrainState.create(apply_fn=model.apply, params=smaller,
                                       tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match=rf"has \d+ parameter\(s\) `like` "
                     rf"lacks \({first}/.*pass partial=True"):
    zerojax.checkpoint.restore(directory, like=like)
  with caplog.at_level("WARNING", logger="zerojax"):
    state = zerojax.checkpoint.restore(directory, like=like, partial=True)
  (said,) = [r for r in caplog.records if "saved left out" in r.getMessage()]
  assert said.levelname == "WARNING" and f"left out: {first}/" in (
      said.getMessage())
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state),
                         {k: v for k, v in trained.items() if k != first})


def test_from_export_params_and_from_plain_orbax(pretrained, tmp_path):
  model, params, _, _, directory, trained = pretrained
  exported = zerojax.checkpoint.export_params(directory)
  _check(zerojax.checkpoint.restore(exported, like=_with_adapter(model, params)),
         trained)
  path = tmp_path / "params"
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(path, exported)
  checkpointer.wait_until_finished()
  _check(zerojax.checkpoint.restore(str(path), like=_with_adapter(model, params),
                                    stage=2), trained)


def test_a_shared_leaf_of_another_shape_or_dtype_is_named(pretrained):
  model, params, _, _, directory, _ = pretrained
  name = sorted(params)[0]
  wide = jax.tree_util.tree_map(lambda x: jnp.zeros(x.shape[:-1] + (
      x.shape[-1] + 1,), x.dtype), params[name])
  like = _with_adapter(model, {**params, name: wide})
  with pytest.raises(ValueError, match=rf"parameter {name}/\w+: checkpoint "
                     r".* has shape .*nothing was restored"):
    zerojax.checkpoint.restore(directory, like=like)
  half = _with_adapter(model, jax.tree_util.tree_map(
      lambda x: x.astype(jnp.bfloat16), params))
  with pytest.raises(ValueError, match=r"has dtype float32, `like` bfloat16; "
                     r"pass cast=True"):
    zerojax.checkpoint.restore(directory, like=half)
  state = zerojax.checkpoint.restore(directory, like=half, cast=True)
  assert zerojax.gather_params(state)[name]["kernel"].dtype == jnp.bfloat16


def test_a_tree_sharing_nothing_is_named_before_partial_is_suggested(
    pretrained):
  """"pass partial=True" was suggested where partial=True then failed."""
  model, _, _, _, directory, _ = pretrained
  other = train_state.TrainState.create(
      apply_fn=model.apply, params={"head": {"w": jnp.ones((3, 3))}},
      tx=optax.sgd(0.1))
  for partial in (False, True):
    with pytest.raises(ValueError, match=r"shares no parameter with `like`.*"
                       r"is it the checkpoint of this model"):
      zerojax.checkpoint.restore(directory, like=other, partial=partial)
