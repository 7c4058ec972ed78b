"""A zerojax state beside the caller's own checkpoint items: as one item of
an orbax CheckpointManager the test builds (`ZeroSave` / `ZeroRestore`),
and through `zerojax.checkpoint.save/restore(items=)`; restored on another
device count with the saved configuration, checked as a step is; killed
mid-save and resumed with both."""
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax.training import train_state
from jax.sharding import Mesh

import zerojax
from models import make_problem


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("data",))


def _freeze_first(params):
  return {k: jax.tree_util.tree_map(lambda _: k == "Dense_0", v)
          for k, v in params.items()}


@pytest.fixture(scope="module")
def trained():
  """A stage-3 state on 8 devices, first layer frozen in int8, quantized
  collectives: one step trained; with its plain TrainState and problem."""
  model, params, loss_fn, batches = make_problem("mlp", batch=16, steps=2)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-2))
  state = zerojax.shard(plain, stage=3, frozen=_freeze_first,
                        frozen_dtype="int8", quantize="int8")
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  return state, plain


def _exported(state):
  return jax.tree_util.tree_map(np.asarray, zerojax.checkpoint.export_params(
      state, with_opt_state=True))


def _same(a, b):
  jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)


def _frozen(state):
  """The leaves kept out of the chunks (frozen), by name."""
  return sorted("/".join(i.names) for i in state.layout.leaves if i.chunk < 0)


def _fields(state):
  return {k: v for k, v in state.config.fields().items() if k != "frozen"}


def test_a_state_in_the_callers_manager_restores_on_another_count(
    trained, tmp_path):
  state, plain = trained
  want = _exported(state)
  mgr = ocp.CheckpointManager(tmp_path, options=ocp.CheckpointManagerOptions(
      max_to_keep=2))
  mgr.save(1, args=ocp.args.Composite(
      state=zerojax.checkpoint.ZeroSave(state),
      data=ocp.args.JsonSave({"position": 16}),
      meta=ocp.args.JsonSave({"run": "a"})))
  mgr.wait_until_finished()
  for n in (8, 4):
    got = mgr.restore(1, args=ocp.args.Composite(
        state=zerojax.checkpoint.ZeroRestore(plain, mesh=_mesh(n)),
        data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    assert got.data == {"position": 16} and got.meta == {"run": "a"}
    restored = got.state
    assert restored.num_shards == n
    assert _fields(restored) == _fields(state)   # int8, quantize, frozen dtype
    _same(_exported(restored), want)
  # frozen leaves stay frozen: the saved mask, by name
  assert _frozen(restored) == _frozen(state) == ["Dense_0/bias",
                                                 "Dense_0/kernel"]
  # zerojax's own readers take the manager's directory too
  _same(zerojax.checkpoint.export_params(str(tmp_path)), want[0])
  again = zerojax.checkpoint.restore(str(tmp_path), like=plain, mesh=_mesh(2))
  assert again.num_shards == 2 and _fields(again) == _fields(state)
  _same(_exported(again), want)
  # the item's metadata, as orbax's metadata call gives it
  meta = zerojax.checkpoint.ZeroStateHandler().metadata(tmp_path / "1" / "state")
  assert meta["num_shards"] == 8 and meta["config"]["stage"] == 3


def test_the_item_is_checked_as_a_step_is(trained, tmp_path):
  state, plain = trained
  mgr = ocp.CheckpointManager(tmp_path)
  mgr.save(1, args=ocp.args.Composite(state=zerojax.checkpoint.ZeroSave(state)))
  mgr.wait_until_finished()
  path = tmp_path / "1" / "state" / "zerojax.json"
  meta = json.loads(path.read_text())
  meta["config"]["stage"] = 1   # changed after the save
  path.write_text(json.dumps(meta))
  args = ocp.args.Composite(state=zerojax.checkpoint.ZeroRestore(plain))
  with pytest.raises(ValueError, match=r"cannot be restored: .*fails its "
                     "checksum"):
    mgr.restore(1, args=args)
  with pytest.raises(ValueError, match="fails its checksum"):
    zerojax.checkpoint.restore(str(tmp_path), like=plain)


def test_save_and_restore_carry_the_callers_items(trained, tmp_path):
  state, plain = trained
  want = _exported(state)
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, step=5, wait=True, items={
      "data": ocp.args.JsonSave({"position": 80}),
      "rng": ocp.args.StandardSave({"key": np.arange(2, dtype=np.uint32)})})
  restored, items = zerojax.checkpoint.restore(
      directory, like=plain, mesh=_mesh(4),
      items={"data": ocp.args.JsonRestore(), "rng": ocp.args.StandardRestore()})
  assert int(restored.step) == int(state.step)
  assert _fields(restored) == _fields(state)
  _same(_exported(restored), want)
  assert items["data"] == {"position": 80}
  np.testing.assert_array_equal(items["rng"]["key"], [0, 1])
  # without items=, the state alone, as before
  assert isinstance(zerojax.checkpoint.restore(directory, like=plain),
                    zerojax.ZeroTrainState)


def test_bad_items_are_refused_naming_them(trained, tmp_path):
  state, plain = trained
  directory = str(tmp_path / "ckpt")
  json_save = ocp.args.JsonSave({"position": 1})
  for items, error, message in (
      ([json_save], TypeError, r"save\(items=list\): items is a dict"),
      ({"state": json_save}, ValueError, "the item name 'state' is the "
       "state's own"),
      ({"data": {"position": 1}}, TypeError, "item 'data' is a dict, not "
       "orbax CheckpointArgs"),
      ({"my data": json_save}, ValueError, "'my data' is not a Python "
       "identifier")):
    with pytest.raises(error, match=message):
      zerojax.checkpoint.save(directory, state, items=items)
    assert not os.path.exists(directory) or not os.listdir(directory)
  zerojax.checkpoint.save(directory, state, step=3, wait=True,
                          items={"data": json_save})
  with pytest.raises(ValueError, match=r"holds no item rng; its items beside "
                     r"the state: \['data'\]"):
    zerojax.checkpoint.restore(directory, like=plain,
                               items={"rng": ocp.args.StandardRestore()})
  with pytest.raises(TypeError, match="a parameter tree in memory has none"):
    zerojax.checkpoint.restore(zerojax.checkpoint.export_params(directory),
                               like=plain, items={"data": ocp.args.JsonRestore()})
  plain_dir = tmp_path / "plain"
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(plain_dir, plain)
  ckptr.wait_until_finished()
  with pytest.raises(ValueError, match="plain orbax checkpoint, which holds no "
                     "items"):
    zerojax.checkpoint.restore(str(plain_dir), like=plain,
                               items={"data": ocp.args.JsonRestore()})


def test_zero_save_and_restore_refuse_what_they_cannot_hold(trained, tmp_path):
  state, plain = trained
  with pytest.raises(TypeError, match="ZeroSave takes a ZeroTrainState, got "
                     "TrainState"):
    zerojax.checkpoint.ZeroSave(plain)
  (tmp_path / "swap").mkdir()
  disk = zerojax.shard(plain, stage=3, offload=zerojax.Offload(
      tier="disk", dir=str(tmp_path / "swap")))
  with pytest.raises(ValueError, match=r"disk-tier state .* Save it with "
                     r"zerojax.checkpoint.save\(directory, state, items="):
    zerojax.checkpoint.ZeroSave(disk)
  with pytest.raises(TypeError, match="chunk_sise"):
    zerojax.checkpoint.ZeroRestore(plain, chunk_sise=10)
  with pytest.raises(TypeError, match="restore\\(cast='yes'\\)"):
    zerojax.checkpoint.ZeroRestore(plain, cast="yes")
  mgr = ocp.CheckpointManager(tmp_path / "two")
  mgr.save(1, args=ocp.args.Composite(a=zerojax.checkpoint.ZeroSave(state),
                                      b=zerojax.checkpoint.ZeroSave(state)))
  mgr.wait_until_finished()
  with pytest.raises(ValueError, match=r"zerojax states in the items "
                     r"\['a', 'b'\]; restore the one you want through your "
                     "CheckpointManager"):
    zerojax.checkpoint.restore(str(tmp_path / "two"), like=plain)
  got = mgr.restore(1, args=ocp.args.Composite(
      b=zerojax.checkpoint.ZeroRestore(plain)))
  _same(_exported(got.b), _exported(state))


def _worker(mode, directory):
  worker = os.path.join(os.path.dirname(__file__), "exit_worker.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([sys.executable, worker, mode, str(directory)],
                        env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["crash-items", "crash-manager"])
def test_killed_mid_save_resumes_with_the_state_and_its_items(mode, tmp_path):
  from exit_worker import items, plain_state
  directory = tmp_path / "ckpt"
  proc = _worker(mode, directory)
  assert proc.returncode == -signal.SIGKILL, (
      f"worker exited with {proc.returncode}, not killed:\n{proc.stderr[-4000:]}")
  assert "save returned" in proc.stdout
  # step 1 committed, step 2 at most orbax's temporary
  assert sorted(os.listdir(directory)) in (["1"], ["1", "2.orbax-checkpoint-tmp"])
  like = plain_state(0.0)
  if mode == "crash-items":
    state, got = zerojax.checkpoint.restore(
        str(directory), like=like, mesh=_mesh(4),
        items={"data": ocp.args.JsonRestore(), "info": ocp.args.JsonRestore()})
    data, info = got["data"], got["info"]
  else:
    mgr = ocp.CheckpointManager(directory)
    assert mgr.latest_step() == 1
    got = mgr.restore(1, args=ocp.args.Composite(
        state=zerojax.checkpoint.ZeroRestore(like, mesh=_mesh(4)),
        data=ocp.args.JsonRestore(), meta=ocp.args.JsonRestore()))
    state, data, info = got.state, got.data, got.meta
  assert int(state.step) == 1 and state.num_shards == 4
  np.testing.assert_array_equal(zerojax.gather_params(state)["w"], 1.0)
  assert data == {"position": 1} and info == {"run": "crash", "step": 1}
  # the resumed run reaches step 2 again and saves it, with its items
  if mode == "crash-items":
    zerojax.checkpoint.save(str(directory), zerojax.shard(plain_state(2.0)),
                            items={"data": items(2)["data"]}, wait=True)
  else:
    mgr.save(2, args=ocp.args.Composite(
        state=zerojax.checkpoint.ZeroSave(zerojax.shard(plain_state(2.0))),
        **items(2)))
    mgr.wait_until_finished()
  assert sorted(os.listdir(directory)) == ["1", "2"]
  np.testing.assert_array_equal(
      zerojax.checkpoint.export_params(str(directory))["w"], 2.0)
