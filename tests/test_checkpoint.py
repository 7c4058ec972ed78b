"""Checkpoints: round trip, any device count and stage, export, plain orbax,
bad input, a crash during an asynchronous save."""
import gc
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from etils import epath
from flax.training import train_state
from jax.sharding import AxisType, Mesh

import zerojax
from models import make_problem, zero_run as _train

STEPS = 6
SPLIT = 3


def _mesh(n):
  return Mesh(np.array(jax.devices()[:n]), ("data",), axis_types=(AxisType.Auto,))


@pytest.fixture(scope="module")
def problem():
  # batch 24: divisible by 8, 4, 3, 2 and 1 devices
  model, params, loss_fn, batches = make_problem("transformer", steps=STEPS,
                                                 batch=24)
  tx = optax.adamw(1e-2, weight_decay=0.1)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  return plain, loss_fn, batches


@pytest.fixture(scope="module")
def saved(problem, tmp_path_factory):
  """Trained SPLIT steps on 8 devices at stage 3, saved; plus the
  uninterrupted run's remaining losses."""
  plain, loss_fn, batches = problem
  state = zerojax.shard(plain, stage=3, chunk_size=3000)
  state, _ = _train(state, loss_fn, batches[:SPLIT])
  directory = str(tmp_path_factory.mktemp("ckpt"))
  zerojax.checkpoint.save(directory, state)     # asynchronous
  params = zerojax.gather_params(state)
  _, rest = _train(state, loss_fn, batches[SPLIT:])  # donates `state`
  zerojax.checkpoint.wait(directory)
  return directory, params, rest


@pytest.mark.slow
def test_round_trip_is_bit_identical(problem, saved, monkeypatch):
  plain, loss_fn, batches = problem
  directory, params, rest = saved

  def no_repack(*args, **kwargs):
    raise AssertionError("the same layout was repacked, not read directly")
  monkeypatch.setattr(zerojax.checkpoint._read, "_repack", no_repack)
  state = zerojax.checkpoint.restore(directory, like=plain, stage=3,
                                     chunk_size=3000)
  assert int(state.step) == SPLIT
  # (initialised in another process on 2 devices: equal to float rounding)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      zerojax.gather_params(state), params)
  _, losses = _train(state, loss_fn, batches[SPLIT:])
  np.testing.assert_array_equal(losses, rest)


@pytest.mark.slow
@pytest.mark.parametrize("devices,stage", [(4, 3), (2, 2), (1, 1), (3, 3), (8, 0)])
def test_restore_on_another_mesh_and_stage(problem, saved, devices, stage):
  plain, loss_fn, batches = problem
  directory, params, rest = saved
  state = zerojax.checkpoint.restore(directory, like=plain, mesh=_mesh(devices),
                                     stage=stage)
  assert state.num_shards == devices and state.config.stage == stage
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.checkpoint.export_params(state), params)
  _, losses = _train(state, loss_fn, batches[SPLIT:])
  np.testing.assert_allclose(losses, rest, rtol=1e-5)


def test_restore_regroups_for_a_tx_with_other_optimizer_classes(
    problem, saved, monkeypatch):
  """Same state structure, but like.tx decays only matrices: the saved
  chunks mix leaves that like.tx treats apart, so the restore repacks. The
  decay is small (1e-4, optax's default) so that a check with a tolerance
  would miss it: the restore must find like.tx's classes afresh."""
  plain, _, _ = problem
  directory, params, _ = saved
  decay_matrices = optax.adamw(1e-2, weight_decay=1e-4, mask=lambda p: (
      jax.tree_util.tree_map(lambda x: x.ndim > 1, p)))
  repacked = []
  repack = zerojax.checkpoint._read._repack
  monkeypatch.setattr(zerojax.checkpoint._read, "_repack",
                      lambda *a, **k: repacked.append(1) or repack(*a, **k))
  state = zerojax.checkpoint.restore(directory, like=plain.replace(
      tx=decay_matrices))
  assert repacked and len(set(state.layout.labels)) == 2
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.checkpoint.export_params(state), params)


@pytest.mark.slow
def test_save_on_three_restore_on_eight(problem, tmp_path):
  plain, loss_fn, batches = problem
  state = zerojax.shard(plain, stage=3, mesh=_mesh(3), chunk_size=1000)
  state, _ = _train(state, loss_fn, batches[:SPLIT])
  zerojax.checkpoint.save(str(tmp_path), state, wait=True)
  params = zerojax.gather_params(state)
  _, rest = _train(state, loss_fn, batches[SPLIT:])
  back = zerojax.checkpoint.restore(str(tmp_path), like=plain, stage=2)
  assert back.num_shards == 8
  _, losses = _train(back, loss_fn, batches[SPLIT:])
  np.testing.assert_allclose(losses, rest, rtol=1e-5)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.checkpoint.export_params(str(tmp_path)), params)


def test_tree_form_checkpoints_still_restore(problem, saved, tmp_path):
  """Format "zerojax-1" (written before 2026-11-22): the ordinary tree,
  each leaf sharded, beside the config."""
  plain, _, _ = problem
  directory, params, _ = saved
  state = zerojax.checkpoint.restore(directory, like=plain)
  ckpt = zerojax.checkpoint
  mgr = ocp.CheckpointManager(str(tmp_path))
  mgr.save(SPLIT, args=ocp.args.Composite(
      state=ocp.args.StandardSave(ckpt._export._tree_form(state)),
      meta=ocp.args.JsonSave({"format": "zerojax-1", "num_shards": 8,
                              "config": ckpt._format.config_json(state.config)})))
  mgr.wait_until_finished()
  back = ckpt.restore(str(tmp_path), like=plain, mesh=_mesh(4))
  assert int(back.step) == SPLIT and back.num_shards == 4
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         ckpt.export_params(back, with_opt_state=True),
                         ckpt.export_params(state, with_opt_state=True))


def test_a_retired_format_is_refused_naming_how_to_carry_it_over(
    problem, saved, tmp_path):
  """Format "zerojax-2" (two days' view-shaped statistics, before
  2026-11-23) is no longer read: its metadata is refused, naming it."""
  plain, _, _ = problem
  directory, _, _ = saved
  shutil.copytree(directory, tmp_path / "old")
  meta = tmp_path / "old" / str(SPLIT) / "meta" / "metadata"
  doc = json.loads(meta.read_text())
  doc["format"] = "zerojax-2"
  doc.pop("sha256", None)
  meta.write_text(json.dumps(doc))
  with pytest.raises(ValueError, match=r"format 'zerojax-2', the chunk form "
                     r"with statistics in view shape.*commit 10ce0d6"):
    zerojax.checkpoint.restore(str(tmp_path / "old"), like=plain)


def test_export_equals_gather_and_plain_orbax_reads_it(saved):
  directory, params, _ = saved
  exported, opt = zerojax.checkpoint.export_params(directory, with_opt_state=True)
  jax.tree_util.tree_map(np.testing.assert_array_equal, exported, params)
  assert int(opt[0]["count"]) == SPLIT        # adam's count, ordinary form
  assert set(opt[0]["mu"]) == set(params)
  # The README's recipe: plain orbax, the layout JSON and numpy slicing.
  with open(os.path.join(directory, str(SPLIT), "meta", "metadata")) as f:
    layout = json.load(f)["layout"]
  path = os.path.join(directory, str(SPLIT), "state")
  tree = ocp.StandardCheckpointHandler().metadata(epath.Path(path)).tree
  as_numpy = jax.tree_util.tree_map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
  ckpt = ocp.PyTreeCheckpointer().restore(
      path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
  read = {}
  for leaf in layout["leaves"]:
    if leaf["chunk"] < 0:
      continue
    c = layout["chunks"][leaf["chunk"]]
    x = np.asarray(ckpt["master"][leaf["chunk"]]).reshape(-1, c["length"])
    n = np.prod(leaf["shape"][1:] if leaf["stacked"] else leaf["shape"])
    read["/".join(leaf["names"])] = (
        x[:, leaf["offset"]:leaf["offset"] + n].reshape(leaf["shape"]))
  flat = {"/".join(str(k.key) for k in p): v
          for p, v in jax.tree_util.tree_leaves_with_path(params)}
  assert set(read) == set(flat)
  for k, v in flat.items():
    np.testing.assert_array_equal(read[k], v)


def test_start_from_a_plain_train_state_checkpoint(problem, tmp_path):
  plain, loss_fn, batches = problem
  path = str(tmp_path / "plain")
  ckptr = ocp.StandardCheckpointer()
  ckptr.save(path, plain)
  ckptr.wait_until_finished()
  state = zerojax.checkpoint.restore(path, like=plain, stage=3)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state), plain.params)
  _, losses = _train(state, loss_fn, batches[:2])
  assert np.all(np.isfinite(losses))


@pytest.mark.slow
def test_bad_input(problem, saved, tmp_path):
  plain, _, _ = problem
  directory, params, _ = saved
  with pytest.raises(FileNotFoundError, match="no checkpoint directory"):
    zerojax.checkpoint.restore(str(tmp_path / "missing"), like=plain)
  with pytest.raises(ValueError, match=rf"step 99 is not in .*saved steps: \[{SPLIT}\]"):
    zerojax.checkpoint.restore(directory, like=plain, step=99)
  # a `like` without a saved leaf (one with a new leaf restores: a fine-tune,
  # tests/test_partial_restore.py)
  smaller = train_state.TrainState.create(
      apply_fn=plain.apply_fn, tx=plain.tx,
      params={k: v for k, v in plain.params.items() if k != "pos"})
  with pytest.raises(ValueError, match=r"has 1 parameter\(s\) `like` lacks "
                     r"\(pos\); pass partial=True"):
    zerojax.checkpoint.restore(directory, like=smaller)
  sgd = plain.replace(tx=optax.sgd(0.1, momentum=0.9))
  with pytest.raises(ValueError, match="does not match like.tx"):
    zerojax.checkpoint.restore(directory, like=sgd)
  # LAMB's state has adamw's structure (adam's moments): restored, its
  # leaves repacked one per chunk in their own shapes ([Note: shaped leaves])
  lamb = plain.replace(tx=optax.lamb(1e-2, weight_decay=0.1))
  assert all(c.shaped for c in zerojax.checkpoint.restore(
      directory, like=lamb).layout.chunks)
  with pytest.raises(TypeError, match="like="):
    zerojax.checkpoint.restore(directory, like=None)
  state = zerojax.checkpoint.restore(directory, like=plain)
  before = sorted(os.listdir(directory))
  with pytest.raises(ValueError, match=f"step {SPLIT} already exists"):
    zerojax.checkpoint.save(directory, state)
  assert sorted(os.listdir(directory)) == before
  with pytest.raises(TypeError, match="ZeroTrainState"):
    zerojax.checkpoint.save(directory, plain)
  for keep, error, message in ((0, ValueError, "keep=0 would delete"),
                              (-2, ValueError, "keep=-2 would delete"),
                              (1.5, TypeError, "keep=1.5 must be an int")):
    with pytest.raises(error, match=message):
      zerojax.checkpoint.save(directory, state, step=SPLIT + 7, keep=keep)
  assert sorted(os.listdir(directory)) == before


def _worker(mode, directory, timeout=180, prefix=()):
  """Runs tests/exit_worker.py in MODE (under the command `prefix`); its
  CompletedProcess."""
  worker = os.path.join(os.path.dirname(__file__), "exit_worker.py")
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return subprocess.run([*prefix, sys.executable, worker, mode, str(directory)],
                        env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_kill_during_async_save_keeps_the_previous_checkpoint(tmp_path):
  from exit_worker import plain_state
  directory = tmp_path / "a"
  proc = _worker("crash", directory)
  assert proc.returncode == -signal.SIGKILL, (
      f"worker exited with {proc.returncode}, not killed:\n{proc.stderr[-4000:]}")
  # Killed mid-write: step 1 committed, step 2 at most orbax's temporary
  # (on a loaded machine the kill can land before orbax's background
  # thread has made it).
  assert sorted(os.listdir(directory)) in (["1"], ["1", "2.orbax-checkpoint-tmp"])
  shutil.copytree(directory, tmp_path / "b")

  like = plain_state(0.0)
  state = zerojax.checkpoint.restore(str(directory), like=like)
  assert int(state.step) == 1
  np.testing.assert_array_equal(zerojax.gather_params(state)["w"], 1.0)
  np.testing.assert_array_equal(
      zerojax.checkpoint.export_params(str(directory))["b"], like.params["b"] + 1)
  with pytest.raises(ValueError, match=r"step 2 is not in .*saved steps: \[1\]"):
    zerojax.checkpoint.restore(str(directory), like=like, step=2)

  # The resumed run reaches step 2 again and saves it: it commits.
  zerojax.checkpoint.save(str(directory), zerojax.shard(plain_state(2.0)),
                          wait=True)
  assert sorted(os.listdir(directory)) == ["1", "2"]
  np.testing.assert_array_equal(
      zerojax.checkpoint.export_params(str(directory))["w"], 2.0)
  with pytest.raises(ValueError, match=r"step 0 is older than the newest "
                     r"checkpoint \(2\)"):
    zerojax.checkpoint.save(str(directory), zerojax.shard(like))
  assert sorted(os.listdir(directory)) == ["1", "2"]

  # A first save under another number removes the dead temporary.
  zerojax.checkpoint.save(str(tmp_path / "b"), zerojax.shard(plain_state(5.0)),
                          wait=True)
  assert sorted(os.listdir(tmp_path / "b")) == ["1", "5"]


@pytest.mark.slow
def test_an_async_save_on_the_last_line_is_committed_at_exit(tmp_path):
  from exit_worker import plain_state
  start = time.monotonic()
  proc = _worker("last-save", tmp_path, timeout=30)
  assert time.monotonic() - start < 30
  assert "save returned" in proc.stdout
  if zerojax.checkpoint._save._NO_THREADS_AT_EXIT:
    # CPython 3.12.0/3.12.1 cannot commit at exit: the loss is reported
    assert proc.returncode == 1
    assert f"checkpoint step 2 in {tmp_path} was not written" in proc.stderr
    assert "call zerojax.checkpoint.wait" in proc.stderr.replace("Call", "call")
    return
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert sorted(os.listdir(tmp_path)) == ["2"]
  state = zerojax.checkpoint.restore(str(tmp_path), like=plain_state(0.0))
  want = plain_state(2.0)
  assert int(state.step) == 2
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state), want.params)


def _unwritable(parent):
  """(a directory the worker cannot write, the worker's command prefix).
  Permission bits bind root nowhere, so as root the worker runs as nobody
  (setpriv) where nobody can start this interpreter; else (a pyenv Python
  under /root, say) the directory lies below a regular file, which no
  user can write through."""
  directory = os.path.join(parent, "ro")
  drop = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")
  if os.geteuid() == 0 and (shutil.which("setpriv") is None or subprocess.run(
      [*drop, sys.executable, "-c", ""], capture_output=True).returncode):
    open(os.path.join(parent, "file"), "w").close()
    return os.path.join(parent, "file", "ckpt"), ()
  os.mkdir(directory)
  os.chmod(directory, 0o555)
  return directory, drop if os.geteuid() == 0 else ()


@pytest.mark.slow
def test_a_save_into_an_unwritable_directory_fails_at_save():
  parent = tempfile.mkdtemp()
  try:
    os.chmod(parent, 0o755)
    directory, prefix = _unwritable(parent)
    start = time.monotonic()
    proc = _worker("unwritable", directory, timeout=30, prefix=prefix)
    assert time.monotonic() - start < 30
    assert proc.returncode == 1, proc.stderr[-4000:]
    assert f"cannot write checkpoints to {directory}" in proc.stderr
    assert "save returned" not in proc.stdout
    assert not os.path.isdir(directory) or os.listdir(directory) == []
  finally:
    shutil.rmtree(parent)


@pytest.mark.slow
def test_a_save_that_fails_in_the_background_sets_the_exit_status(tmp_path):
  """The data write fails after save() returned (no file may grow, as on a
  full disk): the exit waits for it, prints the lost step once and exits
  with status 1, within the time limit; nothing is committed."""
  start = time.monotonic()
  proc = _worker("full-disk", tmp_path, timeout=30)
  assert time.monotonic() - start < 30
  assert "save returned" in proc.stdout
  assert proc.returncode == 1, proc.stderr[-4000:]
  assert proc.stderr.count(f"zerojax: checkpoint step 2 in {tmp_path} was "
                           "not written") == 1
  assert not [d for d in os.listdir(tmp_path) if d.isdigit()]


@pytest.mark.slow
def test_stepping_a_donated_state_raises_instead_of_crashing(tmp_path):
  proc = _worker("donated", tmp_path, timeout=120)
  assert proc.returncode == 1, (proc.returncode, proc.stderr[-4000:])
  assert "ValueError: step() got a ZeroTrainState whose arrays were donated" in (
      proc.stderr)


def test_save_and_restore_take_only_non_negative_int_steps(problem, saved,
                                                          tmp_path):
  plain, _, _ = problem
  directory, _, _ = saved
  state = zerojax.checkpoint.restore(directory, like=plain)
  for step, error, match in [(-1, ValueError, r"save\(step=-1\): a step is a "
                              "non-negative int"),
                             ("2", TypeError, r"save\(step='2'\): .* not str"),
                             (True, TypeError, r"not bool")]:
    with pytest.raises(error, match=match):
      zerojax.checkpoint.save(str(tmp_path), state, step=step)
  assert os.listdir(tmp_path) == []
  with pytest.raises(TypeError, match=r"restore\(step='3'\): a step is a "
                     "non-negative int, not str"):
    zerojax.checkpoint.restore(directory, like=plain, step="3")


def _value_files(step_dir):
  """The data files of a step's per-process OCDBT databases (the root
  b-tree's left alone). Which of them a restore reads varies with the stack
  and the write's timing: files it never reads, likely superseded b-tree
  nodes, stay beside the values. So damage meant to be found by reading
  goes to all of them."""
  files = [os.path.join(root, f) for root, _, names in os.walk(
      os.path.join(step_dir, "state")) for f in names
           if "ocdbt.process" in root and os.sep + "d" in root]
  assert files, f"no value files under {step_dir}"
  return files


def _flip(path, at=0.5):
  data = bytearray(open(path, "rb").read())
  data[int(len(data) * at)] ^= 0x10
  open(path, "wb").write(bytes(data))


def _truncate(path):
  os.truncate(path, os.path.getsize(path) // 2)


def _edit_meta(step_dir, edit, keep_checksum):
  path = os.path.join(step_dir, "meta", "metadata")
  meta = json.load(open(path))
  edit(meta)
  if not keep_checksum:
    meta.pop("sha256")
  json.dump(meta, open(path, "w"))


def _move_first_leaf(meta):
  leaf = next(i for i in meta["layout"]["leaves"] if i["chunk"] >= 0)
  leaf["offset"] += 1


# (what is done to a copy of the saved step's directory, the error)
CORRUPTIONS = {
    "no state": (lambda d: shutil.rmtree(os.path.join(d, "state")),
                 r"/state/ is missing"),
    "no _METADATA": (lambda d: os.remove(os.path.join(d, "state", "_METADATA")),
                     r"/state/_METADATA is missing"),
    "no manifest": (lambda d: os.remove(os.path.join(d, "state", "manifest.ocdbt")),
                    r"/state/manifest.ocdbt is missing"),
    "truncated data": (lambda d: [_truncate(f) for f in _value_files(d)],
                       r"checkpoint .*/state could not be read"),
    "flipped bit": (lambda d: [_flip(f) for f in _value_files(d)],
                    r"checkpoint .*/state (is corrupt: .* differ from what "
                    r"was saved|could not be read)"),
    "truncated meta": (lambda d: _truncate(os.path.join(d, "meta", "metadata")),
                       r"metadata .*/meta/metadata is unreadable"),
    "empty meta": (lambda d: open(os.path.join(d, "meta", "metadata"), "w").write("{}"),
                   r"metadata .*/meta/metadata has no format"),
    "edited layout": (lambda d: _edit_meta(d, _move_first_leaf, True),
                      r"metadata .*/meta/metadata fails its checksum"),
    "no metadata": (lambda d: os.remove(os.path.join(d, "meta", "metadata")),
                    r"/meta/metadata is missing: the step's chunk layout"),
    "newer format": (lambda d: _edit_meta(
        d, lambda m: m.update(format="zerojax-99"), False),
                     r"has format 'zerojax-99', which this zerojax does not "
                     r"know .* written by a newer zerojax\? Upgrade"),
    "edited layout, no checksum": (
        lambda d: _edit_meta(d, _move_first_leaf, False),
        r"the layout is inconsistent: leaf .* (overlaps|ends at)"),
}


# Where one read of a damaged file fails, orbax leaves its other reads as
# coroutines that never finish; collected, each is reported as an
# exception "ignored" (or its event loop as closed): they are collected,
# and their reports dropped, in the test that made them, not in a later one.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_a_corrupt_checkpoint_raises_naming_it(problem, saved, tmp_path, case):
  """The newest step is damaged: restore and export raise one ValueError
  naming the path, the problem and the older step that still restores;
  never a silent fall back. The damage is done to a copy."""
  plain, _, _ = problem
  directory, params, _ = saved
  copy = str(tmp_path / "ckpt")
  shutil.copytree(directory, copy)
  shutil.copytree(os.path.join(copy, str(SPLIT)), os.path.join(copy, "7"))
  damage, reason = CORRUPTIONS[case]
  damage(os.path.join(copy, "7"))
  match = rf"step 7 in .* cannot be restored: .*{reason}.*Steps that can be restored: \[{SPLIT}\]"
  if case in ("truncated data", "flipped bit"):   # found only by reading
    match = reason
  with pytest.raises(ValueError, match=match):
    zerojax.checkpoint.restore(copy, like=plain)
  with pytest.raises(ValueError, match=match):
    zerojax.checkpoint.export_params(copy)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.checkpoint.export_params(copy, step=SPLIT), params)
  gc.collect()


def test_a_stray_step_directory_is_named(problem, saved, tmp_path):
  plain, _, _ = problem
  directory, _, _ = saved
  copy = str(tmp_path / "ckpt")
  shutil.copytree(directory, copy)
  os.makedirs(os.path.join(copy, "9", "state"))
  with pytest.raises(ValueError, match=rf"step 9 in .* cannot be restored: "
                     rf".*9/state/_METADATA is missing.*\[{SPLIT}\] \(pass step="):
    zerojax.checkpoint.restore(copy, like=plain)
  assert int(zerojax.checkpoint.restore(copy, like=plain, step=SPLIT).step) == SPLIT


def _freeze_embedding_and_first_block(params):
  return jax.tree_util.tree_map_with_path(
      lambda path, _: path[0].key in ("Embed_0", "block_0"), params)


@pytest.mark.slow
def test_a_restore_from_a_plain_train_state_keeps_frozen(problem, tmp_path,
                                                        monkeypatch):
  """`frozen` is a callable, not stored: the metadata names the frozen
  leaves, and a restore from a plain TrainState freezes them again (reading
  the saved layout as it is); an explicit frozen= wins."""
  plain, loss_fn, batches = problem
  state = zerojax.shard(plain, stage=3, chunk_size=3000,
                        frozen=_freeze_embedding_and_first_block)
  state, _ = _train(state, loss_fn, batches[:SPLIT])
  directory = str(tmp_path / "ckpt")
  zerojax.checkpoint.save(directory, state, wait=True)
  layout, before = state.layout, zerojax.gather_params(state)
  _, rest = _train(state, loss_fn, batches[SPLIT:])
  is_frozen = jax.tree_util.tree_leaves(_freeze_embedding_and_first_block(before))

  repack = zerojax.checkpoint._read._repack
  monkeypatch.setattr(zerojax.checkpoint._read, "_repack", lambda *a, **k: (
      pytest.fail("the saved layout was repacked: frozen was lost")))
  back = zerojax.checkpoint.restore(directory, like=plain)
  assert back.layout == layout
  back, losses = _train(back, loss_fn, batches[SPLIT:])
  np.testing.assert_allclose(losses, rest, rtol=1e-5)
  for frozen, x, y in zip(is_frozen, jax.tree_util.tree_leaves(before),
                          jax.tree_util.tree_leaves(zerojax.gather_params(back))):
    assert frozen == np.array_equal(x, y)

  # Metadata written before it named the frozen leaves: read off the layout.
  step_dir = os.path.join(directory, str(SPLIT))
  _edit_meta(step_dir, lambda meta: meta.pop("frozen"), keep_checksum=False)
  assert zerojax.checkpoint.restore(directory, like=plain).layout == layout

  monkeypatch.setattr(zerojax.checkpoint._read, "_repack", repack)
  unfrozen = zerojax.checkpoint.restore(directory, like=plain, frozen=None)
  assert not unfrozen.rest
  unfrozen, _ = _train(unfrozen, loss_fn, batches[SPLIT:SPLIT + 1])
  for x, y in zip(jax.tree_util.tree_leaves(before),
                  jax.tree_util.tree_leaves(zerojax.gather_params(unfrozen))):
    assert not np.array_equal(x, y)


def _steps(directory):
  return sorted(int(s) for s in os.listdir(directory) if s.isdigit())


def test_save_honours_keep_on_every_call(problem, tmp_path):
  plain, _, _ = problem
  state = zerojax.shard(plain, stage=1)
  directory = str(tmp_path)
  save = lambda step, keep: zerojax.checkpoint.save(directory, state, step=step,
                                                    keep=keep, wait=True)
  for step in (1, 2, 3):
    save(step, keep=3)
  assert _steps(directory) == [1, 2, 3]
  save(4, keep=1)
  assert _steps(directory) == [4]
  for step in (5, 6, 7):
    save(step, keep=3)
  assert _steps(directory) == [5, 6, 7]
  save(8, keep=None)
  save(9, keep=None)
  assert _steps(directory) == [5, 6, 7, 8, 9]


def test_restoring_a_valid_checkpoint_logs_no_missing_metadata_warning(
    problem, saved, caplog):
  """orbax warns "Metadata file does not exist" when asked for a step's
  metadata inside the step's item directory (`<step>/state`)."""
  plain, _, _ = problem
  directory, params, _ = saved
  with caplog.at_level(logging.WARNING):
    state = zerojax.checkpoint.restore(directory, like=plain)
    exported = zerojax.checkpoint.export_params(directory)
  assert int(state.step) == SPLIT
  jax.tree_util.tree_map(np.testing.assert_array_equal, exported, params)
  assert not [r for r in caplog.records if "does not exist" in r.getMessage()]


def test_a_checkpoint_written_with_the_flat_fields_restores_as_the_groups(
    tmp_path):
  """tests/fixtures/flat_config_checkpoint was saved before the options were
  grouped, on 2 devices, by `shard(state, stage=3, compute_dtype="bf16",
  offload_optimizer=True, accum_steps=2, clip_norm=1.0, quantize_block=64)`
  of `MLP(hidden=8, out=2)` initialised from key 0 (its metadata holds
  those flat fields): it restores on 8 devices, its configuration read as
  the groups, its parameters the initial ones."""
  from models import MLP
  shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures",
                               "flat_config_checkpoint"), tmp_path / "ckpt")
  model = MLP(hidden=8, out=2)
  params = model.init(jax.random.PRNGKey(0), np.ones((4, 4), np.float32))[
      "params"]
  like = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                       tx=optax.adam(1e-2))
  state = zerojax.checkpoint.restore(tmp_path / "ckpt", like=like)
  config = state.config
  assert config.stage == 3 and state.num_shards == 8
  assert config.precision == zerojax.Precision(compute="bf16")
  assert config.offload == zerojax.Offload("host")
  assert config.quantize == zerojax.Quantize(block=64)
  assert (config.accum_steps, config.clip_norm) == (2, 1.0)
  assert config == zerojax.ZeroConfig(**config.options())
  # (initialised in another process on 2 devices: equal to float rounding)
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      zerojax.gather_params(state), params)


def test_a_checkpoint_holding_scalar_placeholders_restores_and_trains_on(
    tmp_path):
  """tests/fixtures/scalar_placeholder_checkpoint was saved before a scalar
  leaf's optimizer view was emptied, on 8 devices, after one step of
  `shard(state, stage=1)` of the problem below: its adam state holds a
  shape () `mu` and `nu` for the scalar `scale`, which shares its chunk
  with `w` and `b`. It restores in place (8 devices) and repacked (2), and
  a further step equals the second step of a run never saved."""
  import jax.numpy as jnp
  params = {"scale": jnp.float32(0.5), "w": jnp.arange(12.0).reshape(3, 4) / 10,
            "b": jnp.zeros(4)}
  loss_fn = lambda p, b: jnp.mean((p["scale"] * (b["x"] @ p["w"]) + p["b"]) ** 2)
  batch = {"x": np.ones((8, 3), np.float32)}
  like = train_state.TrainState.create(apply_fn=None, params=params,
                                       tx=optax.adam(1e-2))
  step = zerojax.train_step(loss_fn)
  whole, _ = step(step(zerojax.shard(like, stage=1), batch)[0], batch)
  path = tmp_path / "ckpt"
  shutil.copytree(os.path.join(os.path.dirname(__file__), "fixtures",
                               "scalar_placeholder_checkpoint"), path)
  for mesh in (None, _mesh(2)):
    state = zerojax.checkpoint.restore(path, like=like, mesh=mesh)
    assert all(x.size == 0 for x in (state.opt_state[0].mu["scale"],
                                     state.opt_state[0].nu["scale"]))
    state, _ = step(state, batch)
    jax.tree_util.tree_map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
        zerojax.gather_params(state), zerojax.gather_params(whole))
