"""Checkpoints under faults a user meets: saves from several threads, step
directories that are links or not numbers, a donated state exported."""
import os
import threading

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from models import make_problem, zero_run

SAVES = 5   # per thread
ROUNDS = 5


@pytest.fixture(scope="module")
def trained():
  model, params, loss_fn, batches = make_problem("mlp", steps=2)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  state, _ = zero_run(zerojax.shard(plain, stage=3), loss_fn, batches)
  return plain, state


def _save_from_threads(state, directories):
  """Two threads, thread t saving steps t, t + 2, ... into directories[t];
  returns {(directory, step): None if save returned, else its error}."""
  outcome, barrier = {}, threading.Barrier(2)

  def saver(t):
    barrier.wait()
    for i in range(SAVES):
      step = t + 2 * i
      try:
        zerojax.checkpoint.save(directories[t], state, step=step)
        outcome[directories[t], step] = None
      except Exception as e:  # noqa: BLE001 - checked below
        outcome[directories[t], step] = e

  threads = [threading.Thread(target=saver, args=(t,)) for t in range(2)]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=120)
  assert not any(t.is_alive() for t in threads), "a save hung"
  return outcome


def _check(plain, state, outcome):
  """Every save that returned is restorable and equal to the state; every
  refused one names its own step."""
  params = zerojax.gather_params(state)
  late = {}
  for directory in {d for d, _ in outcome}:
    try:
      zerojax.checkpoint.wait(directory)
    except RuntimeError as e:   # a background write lost: must name its step
      late[directory] = str(e)
  returned = 0
  for (directory, step), error in sorted(outcome.items()):
    if error is not None:
      assert f"step {step} " in str(error), (step, error)
      continue
    if directory in late and f"step {step} " in late[directory]:
      continue
    back = zerojax.checkpoint.restore(directory, like=plain, step=step)
    jax.tree_util.tree_map(np.testing.assert_array_equal,
                           zerojax.gather_params(back), params)
    returned += 1
  assert returned >= SAVES   # the first thread's steps at least


@pytest.mark.slow
@pytest.mark.parametrize("shared", [True, False], ids=["one dir", "two dirs"])
def test_saves_from_two_threads_are_committed_or_raise_naming_the_step(
    trained, tmp_path, shared):
  plain, state = trained
  for r in range(ROUNDS):
    names = ["ckpt", "ckpt"] if shared else ["a", "b"]
    directories = [str(tmp_path / f"{r}-{n}") for n in names]
    _check(plain, state, _save_from_threads(state, directories))


def test_a_symlinked_step_that_keep_would_delete_is_named(trained, tmp_path):
  _, state = trained
  real, directory = tmp_path / "real", tmp_path / "ckpt"
  zerojax.checkpoint.save(str(real), state, step=2, wait=True)
  directory.mkdir()
  os.symlink(real / "2", directory / "2")
  with pytest.raises(ValueError, match=r"keep=1 would delete step 2, but "
                     r".*ckpt/2 is a symbolic link .*nothing was written"):
    zerojax.checkpoint.save(str(directory), state, step=3, keep=1)
  assert sorted(os.listdir(directory)) == ["2"] and os.path.isdir(real / "2")
  # without keep, the link is read and left alone
  zerojax.checkpoint.save(str(directory), state, step=3, wait=True)
  assert sorted(os.listdir(directory)) == ["2", "3"] and os.path.islink(
      directory / "2")


def test_a_step_named_with_a_non_ascii_digit_is_not_a_step(trained, tmp_path):
  plain, state = trained
  directory = tmp_path / "ckpt"
  zerojax.checkpoint.save(str(directory), state, step=1, wait=True)
  (directory / "\u00b2").mkdir()   # '²'.isdigit() is True
  back = zerojax.checkpoint.restore(str(directory), like=plain)
  assert int(back.step) == int(state.step)


def test_exporting_a_donated_state_names_the_donation(trained):
  _, state = trained
  model, _, loss_fn, batches = make_problem("mlp", steps=1)
  copy = jax.tree_util.tree_map(lambda x: x.copy() if isinstance(
      x, jax.Array) else x, state)
  zerojax.train_step(loss_fn)(copy, batches[0])   # donates `copy`
  with pytest.raises(ValueError, match=r"checkpoint.export_params\(\) got a "
                     r"ZeroTrainState whose arrays were donated"):
    zerojax.checkpoint.export_params(copy)


def test_a_restore_that_would_change_dtypes_is_asked_for(trained, tmp_path):
  plain, state = trained
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, wait=True)
  narrow = plain.replace(params=jax.tree_util.tree_map(
      lambda x: x.astype(jax.numpy.bfloat16),
      plain.params))
  with pytest.raises(ValueError, match=r"`like` would change the dtype of \d+ "
                     r"saved parameter\(s\): .*\(float32 -> bfloat16\).*"
                     r"restore\(\.\.\., cast=True\)"):
    zerojax.checkpoint.restore(directory, like=narrow)
  back = zerojax.checkpoint.restore(directory, like=narrow, cast=True)
  saved = zerojax.gather_params(state)
  jax.tree_util.tree_map(
      lambda b, s: np.testing.assert_array_equal(
          np.asarray(b), np.asarray(s.astype(jax.numpy.bfloat16))),
      zerojax.gather_params(back), saved)
  with pytest.raises(TypeError, match=r"restore\(cast='yes'\)"):
    zerojax.checkpoint.restore(directory, like=plain, cast="yes")
