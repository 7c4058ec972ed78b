"""The disk tier (`offload_optimizer="disk"`, ZeRO-Infinity): the
offloaded chunks' statistics in files, streamed through host memory by
each step's update. Bit-identical to the host tier, checkpoints in and out
of it, the host memory it holds, a process killed mid-update, and bad
input."""
import functools
import json
import os
import re
import signal
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax._tiers import disk_tier
from zerojax._state.state import loaded_master
import disk_worker
from models import zopts, assert_same_numbers, OWN_EMITTERS, TOLERANCE
from models import (OFFLOADED_UPDATE_CASES, assert_matches_reference,
                    make_problem, reference_run, zero_run)

TX = optax.adam(1e-2)
WORKER = os.path.join(os.path.dirname(__file__), "disk_worker.py")   # one object: zerojax probes each (tx, tree) once
_problem = functools.lru_cache(maxsize=None)(make_problem)


def _shard(stage, kind="transformer", **fields):
  model, params, _, _ = _problem(kind, steps=3)
  if kind == "scan_transformer":
    fields["stacked"] = ("blocks",)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  return zerojax.shard(plain, stage=stage, **zopts(fields))


def _files(state) -> list:
  """The names of the files the state's `OnDisk`s name."""
  return sorted(f"{x.key}.bin" for x in disk_tier._on_disk(state))


def _params(state):
  return jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))


def _check_against_host_tier(disk, host):
  """The statistics the host tier's (`assert_same_numbers`); the masters
  within an ulp of themselves plus one of the update (lr = 1e-2)."""
  got = jax.tree_util.tree_leaves(disk_tier.mapped(disk, disk.opt_state))
  want = jax.tree_util.tree_leaves(host.opt_state)
  assert len(got) == len(want)
  for g, w in zip(got, want):
    assert_same_numbers(g, w)
  for g, w in zip(loaded_master(disk), host.master):
    if not OWN_EMITTERS:   # the statistics already differ by rounding
      assert_same_numbers(g, w)
      continue
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2 ** -22,
                               atol=2 * np.spacing(np.float32(1e-2)))


@pytest.mark.slow
@pytest.mark.parametrize("stage,fields", OFFLOADED_UPDATE_CASES + (
    # a [layers, length] chunk, streamed a layer at a time
    (2, dict(compute_dtype="bfloat16", kind="scan_transformer")),
    (3, dict(compute_dtype="float32", kind="scan_transformer")),
    # sub-groups of each shard's columns (unequal: 1588 = 5 x 265 + 263)
    (2, dict(compute_dtype="bfloat16", sub_group_size=300)),
    (3, dict(compute_dtype="float32", accum_steps=2, sub_group_size=300)),
    (3, dict(compute_dtype="bfloat16", kind="scan_transformer",
             sub_group_size=300)),
))
def test_the_disk_tier_matches_the_host_tier(stage, fields, tmp_path):
  """The same update as the host tier's (`update_on_host`), compiled as a
  program of its own: XLA's algebraic simplifier rewrites adam's
  bias-corrected division differently there (m·(1/c1) / (√v̂+ε) against
  m / (c1·(√v̂+ε))), so after a step the master may differ by an ulp of
  itself plus one of the update (lr = 1e-2); the statistics are
  bit-identical. At float32 both go on matching plain optax."""
  _, params, loss_fn, batches = _problem(fields.get("kind", "transformer"),
                                         steps=3)
  host_state = _shard(stage, offload_optimizer=True, update_on="host",
                      **{k: v for k, v in fields.items()
                         if k != "sub_group_size"})
  state = _shard(stage, offload_optimizer="disk", offload_dir=str(tmp_path),
                 **fields)
  assert sorted(p.name for p in tmp_path.iterdir()) == _files(state)
  # the fp32 master is on disk too where only the update reads it: with
  # 16-bit compute (at stage 3 the gathers read a sharded compute copy)
  half = fields["compute_dtype"] != "float32"
  assert any(map(disk_tier.is_on_disk, state.master)) == half
  host, host_losses = zero_run(host_state, loss_fn, batches[:1])
  disk, disk_losses = zero_run(state, loss_fn, batches[:1])
  np.testing.assert_array_equal(disk_losses, host_losses)
  if stage == 3 and half:   # the copy the next step gathers: the new master's
    assert len(disk.compute) == len(disk.master)
    for x, m in zip(disk.compute, loaded_master(disk)):
      if x is None:
        assert not disk_tier.is_on_disk(m)
        continue
      assert x.sharding.memory_kind == "pinned_host" and x.dtype == jnp.bfloat16
      np.testing.assert_array_equal(np.asarray(x),
                                    np.asarray(m).astype(jnp.bfloat16))
  _check_against_host_tier(disk, host)
  if fields["compute_dtype"] == "float32":
    disk, more = zero_run(disk, loss_fn, batches[1:])
    ref_losses, ref_params = reference_run(loss_fn, params, TX, batches)
    np.testing.assert_allclose(np.concatenate([disk_losses, more]),
                               ref_losses, rtol=1e-5)
    # Adam normalises each step, so where an element's gradient is near
    # zero the ulp between the two programs' updates grows by up to lr
    # times the relative change: bounded here by 1e-3 lr (seen: one element
    # of 8192 at 6.6e-6 on the scanned transformer, on some machines'
    # CPUs and not others); everywhere else rtol 1e-5 as plain optax
    jax.tree_util.tree_map(functools.partial(
        np.testing.assert_allclose, rtol=1e-5, atol=1e-3 * 1e-2),
                           _params(disk), ref_params)


@pytest.mark.slow
def test_a_checkpoint_copies_the_files_and_restores_into_any_tier(tmp_path):
  """Saved from the files (maps of them, never the whole state in memory),
  restored into a fresh disk tier (going on exactly as the saved state
  does), into host memory on 4 devices, and with no offload."""
  _, _, loss_fn, batches = _problem("transformer", steps=3)
  live, again_dir = tmp_path / "live", tmp_path / "again"
  live.mkdir(), again_dir.mkdir()
  state, _ = zero_run(_shard(3, offload_optimizer="disk",
                             offload_dir=str(live), sub_group_size=300),
                      loss_fn, batches[:1])
  zerojax.checkpoint.save(tmp_path / "ckpt", state)   # returns committed
  plain = train_state.TrainState.create(
      apply_fn=state.apply_fn, params=zerojax.gather_params(state), tx=TX)
  state, losses = zero_run(state, loss_fn, batches[1:])
  mesh4 = jax.sharding.Mesh(np.array(jax.devices()[:4]), ("data",))
  again = zerojax.Offload("disk", dir=str(again_dir), sub_group_size=300)
  for overrides in (dict(offload=again), dict(offload="host", mesh=mesh4),
                    dict(offload=None)):
    restored = zerojax.checkpoint.restore(tmp_path / "ckpt", like=plain,
                                          **overrides)
    assert restored.config.disk == (overrides["offload"] is again)
    # the saved sub-groups with the disk tier only
    assert restored.config.sub_group_size == (
        300 if restored.config.disk else None)
    if restored.config.disk:
      assert sorted(p.name for p in again_dir.iterdir()) == _files(restored)
    restored, again = zero_run(restored, loss_fn, batches[1:])
    # (another tier, or 4 devices, sums in another order: float32's
    # tolerances of the suite, `models.TOLERANCE`)
    exact = np.testing.assert_array_equal
    loss_tol, param_tol = TOLERANCE["float32"]
    close = lambda tol: functools.partial(np.testing.assert_allclose, **tol)
    (exact if restored.config.disk else close(loss_tol))(again, losses)
    jax.tree_util.tree_map(exact if restored.config.disk else close(param_tol),
                           _params(restored), _params(state))


@pytest.mark.slow
@pytest.mark.parametrize("hpz", [False, True])
def test_the_disk_tier_matches_the_host_tier_on_a_replica_mesh(hpz, tmp_path,
                                                               monkeypatch):
  """HSDP on (replica 2, data 4), stage 3 bf16: the step's gradient sink
  writes each shard once (a replica writes nothing; under hpZ each of the
  8 devices its own piece d·R + r), and the stream's update is the host
  tier's: losses and statistics bit-identical, masters to the ulp bound
  above."""
  _, _, loss_fn, batches = _problem("transformer", steps=3)
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4),
                           ("replica", "data"))
  fields = dict(compute_dtype="bfloat16", mesh=mesh, replica_axis="replica",
                hpz=hpz)
  host, host_losses = zero_run(_shard(3, offload_optimizer=True,
                                      update_on="host", **fields),
                               loss_fn, batches[:1])
  from zerojax._tiers import disk as disk_files
  write, writes = disk_files.ChunkFiles.write, []

  def counted(self, key, array, at=None):
    if key.endswith("-grad"):   # (chunk, shard number) of a sink's write
      writes.append((key.split("-")[1], at[0] // array.dtype.itemsize //
                     array.shape[-1] % (8 if hpz else 4)))
    return write(self, key, array, at)

  monkeypatch.setattr(disk_files.ChunkFiles, "write", counted)
  disk, disk_losses = zero_run(_shard(3, offload_optimizer="disk",
                                      offload_dir=str(tmp_path), **fields),
                               loss_fn, batches[:1])
  np.testing.assert_array_equal(disk_losses, host_losses)
  assert sorted(writes) == sorted(
      (f"c{c}", k) for c in range(len(disk.layout.chunks))
      for k in range(8 if hpz else 4))   # each shard once
  _check_against_host_tier(disk, host)
  disk_tier.remove(disk)
  assert list(tmp_path.iterdir()) == []   # gradient files included

@pytest.mark.slow
def test_a_process_killed_mid_update_restores_from_its_checkpoint(tmp_path):
  """SIGKILL after the first shard of step 2's statistics is written: the
  live files are a mix of two steps (scratch); the checkpoint of step 1
  restores (its files rebuilt in the same directory) and goes on exactly
  as an uninterrupted run."""
  live, ckpt = tmp_path / "live", tmp_path / "ckpt"
  live.mkdir()
  done = subprocess.run([sys.executable, WORKER, "kill", str(live), str(ckpt)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
  left = sorted(p.name for p in live.iterdir())
  # adam's two moments of three chunks, half rewritten; each chunk's gradient
  # as the killed step's program wrote it
  assert len([n for n in left if not n.endswith("-grad.bin")]) == 6, left
  assert len([n for n in left if n.endswith("-grad.bin")]) == 3, left

  plain, loss_fn, batches, fields = disk_worker.problem()
  reference = zerojax.shard(
      plain, offload=zerojax.Offload("disk", dir=str(tmp_path)), **fields)
  reference, want = zero_run(reference, loss_fn, batches)
  restored = zerojax.checkpoint.restore(
      ckpt, like=plain, offload=zerojax.Offload("disk", dir=str(live)))
  assert int(restored.step) == 1
  restored, got = zero_run(restored, loss_fn, batches[1:])
  np.testing.assert_array_equal(got, want[1:])
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(restored),
                         _params(reference))


@pytest.mark.slow
def test_a_normal_exit_leaves_no_files_and_a_chdir_loses_nothing(tmp_path):
  live = tmp_path / "live"
  live.mkdir()
  done = subprocess.run([sys.executable, WORKER, "exit", str(live)],
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert ".bin" in done.stdout   # the files were there while it ran
  assert "disk tier keeps optimizer state in " + str(live) in done.stderr
  assert sorted(os.listdir(live)) == []


def test_an_ended_processes_files_are_removed_by_the_next_run(tmp_path,
                                                              caplog):
  dead = 2 ** 22 + 12345   # above any pid this machine hands out
  (tmp_path / f"p{dead}x0123456789-c0-s0.bin").write_bytes(b"0" * 2048)
  (tmp_path / "notes.txt").write_text("kept")
  with caplog.at_level("WARNING", logger="zerojax"):
    state = _tiny_disk(tmp_path)
  assert "removed 1 disk-tier file(s)" in caplog.text
  names = sorted(os.listdir(tmp_path))
  assert "notes.txt" in names and not any(f"p{dead}x" in n for n in names)
  assert all(n.startswith(f"p{os.getpid()}x") for n in names
             if n.endswith(".bin")) and int(state.step) == 0


def test_a_removed_file_is_named_before_the_state_is_donated(tmp_path):
  (tmp_path / "live").mkdir()
  state = _tiny_disk(tmp_path / "live")
  _, loss_fn, batches, _ = disk_worker.problem()
  step = zerojax.train_step(loss_fn)
  state, _ = step(state, batches[0])
  victim = sorted((tmp_path / "live").glob("*-s*.bin"))[0]
  victim.unlink()
  with pytest.raises(FileNotFoundError, match=rf"file .*{victim.name} is gone "
                     r".*Restore from the last checkpoint \(this state was "
                     r"not donated\)"):
    step(state, batches[1])
  assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(
      state.master) if isinstance(x, jax.Array))


def test_a_statistics_file_changed_behind_the_tiers_back_is_found(tmp_path):
  state = _tiny_disk(tmp_path)
  _, loss_fn, batches, _ = disk_worker.problem()
  step = zerojax.train_step(loss_fn)
  state, _ = step(state, batches[0])   # every file now written by the tier
  victim = sorted(tmp_path.glob("*-s*.bin"))[0]
  victim.write_bytes(np.full(victim.stat().st_size // 4, np.nan,
                             np.float32).tobytes())
  with pytest.raises(OSError, match=rf"disk tier: reading .*{victim.name} "
                     r"failed: bytes .* changed since the tier wrote them "
                     r"\(their checksum differs\).*restore from the last "
                     r"checkpoint"):
    step(state, batches[1])


def _tiny_disk(tmp_path, **fields):
  plain, _, _, base = disk_worker.problem()
  return zerojax.shard(plain, offload=zerojax.Offload("disk", dir=str(tmp_path)),
                       **{**base, **fields})


def test_bad_directories_are_refused_with_nothing_left(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist; create it"):
    _tiny_disk(tmp_path / "missing")
  (tmp_path / "file").write_text("")
  with pytest.raises(NotADirectoryError, match="is not a directory"):
    _tiny_disk(tmp_path / "file")
  read_only = tmp_path / "ro"
  read_only.mkdir()
  read_only.chmod(0o500)
  try:
    if not os.access(read_only, os.W_OK):   # root writes anywhere
      with pytest.raises(PermissionError, match="cannot take the disk tier"):
        _tiny_disk(read_only)
  finally:
    read_only.chmod(0o700)


def test_a_full_disk_is_an_error_never_a_partial_tier(tmp_path, monkeypatch):
  """At `shard`: the files written so far are removed. During a step: the
  step raises (the state is then gone, as the message says)."""
  from zerojax._tiers import disk
  full_at = {"writes": 3}   # the directory's probe, then two files
  write = disk.os.pwrite

  def pwrite(fd, data, offset):
    full_at["writes"] -= 1
    if full_at["writes"] < 0:
      raise OSError(28, "No space left on device")
    return write(fd, data, offset)

  monkeypatch.setattr(disk.os, "pwrite", pwrite)
  with pytest.raises(OSError, match="No space left .*restore from the last"):
    _tiny_disk(tmp_path)
  assert list(tmp_path.iterdir()) == []
  full_at["writes"] = 6   # six files (the directory is probed once)
  state = _tiny_disk(tmp_path)
  _, loss_fn, batches, _ = disk_worker.problem()
  with pytest.raises(OSError, match="No space left"):
    zerojax.train_step(loss_fn)(state, batches[0])


@pytest.mark.parametrize("options,error,message", [
    (lambda: dict(offload="disk"), ValueError,
     "offload='disk' needs its directory"),
    (lambda: dict(offload=zerojax.Offload("disk")), ValueError,
     "give dir= an existing writable directory"),
    (lambda: dict(offload=zerojax.Offload("nvme", dir="/tmp")), ValueError,
     "Offload(tier='nvme') is not a tier"),
    (lambda: dict(offload=zerojax.Offload("host", dir="/tmp")), ValueError,
     "Offload(dir='/tmp') is read by the disk tier only"),
    (lambda: dict(offload=zerojax.Offload("disk", dir=7)), TypeError,
     "Offload.dir=7 must be a directory path"),
    (lambda: dict(offload=zerojax.Offload("disk", dir="/tmp",
                                          update_on="device")),
     ValueError, "drop update_on='device'"),
    (lambda: dict(offload=zerojax.Offload("disk", dir="/tmp",
                                          optimizer=False)),
     ValueError, "has nothing to put on disk"),
    (lambda: dict(stage=2, offload=zerojax.Offload("disk", dir="/tmp")),
     ValueError, "the disk tier (its update runs on the host) at stage 2 "
     "needs 16-bit compute"),
    (lambda: dict(offload=zerojax.Offload("host", sub_group_size=2 ** 20)),
     ValueError, "Offload(sub_group_size=1048576) is read by the disk tier "
     "only"),
    (lambda: dict(offload=zerojax.Offload("disk", dir="/tmp",
                                          sub_group_size=0)),
     ValueError, "Offload.sub_group_size=0 must be positive"),
    (lambda: dict(offload=zerojax.Offload("disk", dir="/tmp",
                                          sub_group_size=1e6)),
     TypeError, "Offload.sub_group_size=1000000.0 must be an int"),
])
def test_bad_disk_settings_are_refused(options, error, message):
  with pytest.raises(error, match=re.escape(message)):
    zerojax.ZeroConfig(**options())


def test_a_disk_tier_needs_a_donating_step(tmp_path):
  state = _tiny_disk(tmp_path)
  _, loss_fn, batches, _ = disk_worker.problem()
  step = zerojax.train_step(loss_fn, donate=False)
  with pytest.raises(ValueError, match="use donate=True"):
    step(state, batches[0])
  assert len(list(tmp_path.iterdir())) == 6   # the state is untouched
  zerojax.train_step(loss_fn)(state, batches[0])


@pytest.mark.slow
def test_the_update_holds_few_chunks_in_host_memory(tmp_path):
  """Four chunks of 8 MiB of statistics each: the disk update's peak RSS
  (sampled every 0.2 ms) is at most 2.5 chunks' statistics above the
  step's own peak (`tests/disk_worker.py rss`; glibc's mmap threshold
  fixed so freed arrays leave RSS at once)."""
  done = subprocess.run(
      [sys.executable, WORKER, "rss", str(tmp_path)], capture_output=True,
      text=True, timeout=300,
      env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"})
  assert done.returncode == 0, done.stderr[-2000:]
  seen = json.loads(done.stdout.strip().splitlines()[-1])
  above = seen["peak"] - max(seen["step_peak"], seen["start"])
  assert above <= 2.5 * seen["chunk"], seen


def test_memory_report_counts_the_files_as_disk(tmp_path):
  state = _tiny_disk(tmp_path, stage=3)
  report = zerojax.memory_report(state)
  assert report.measured["optimizer state"]["disk"] == (
      disk_tier.disk_bytes(state) // state.num_state_shards) == 2 * 64 * 64 * 4 * 3 // 8
  assert report.placement["disk"] == [0, 1, 2]
  assert "disk 3 chunk(s): 0, 1, 2" in str(report)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, 3])
def test_a_checkpoint_holds_a_master_that_was_on_disk(stage, tmp_path):
  """bf16: the fp32 master is on disk too (at stage 3 beside its sharded
  bf16 copy in host memory, rebuilt from the master on restore). Saved,
  restored into a fresh disk tier it goes on exactly as the saved state;
  restored without offload its parameters are the saved ones."""
  _, _, loss_fn, batches = _problem("transformer", steps=3)
  live, again_dir = tmp_path / "live", tmp_path / "again"
  live.mkdir(), again_dir.mkdir()
  state, _ = zero_run(_shard(stage, compute_dtype="bfloat16",
                             offload_optimizer="disk", offload_dir=str(live)),
                      loss_fn, batches[:1])
  zerojax.checkpoint.save(tmp_path / "ckpt", state)
  saved = _params(state)
  plain = train_state.TrainState.create(
      apply_fn=state.apply_fn, params=zerojax.gather_params(state), tx=TX)
  plainly = zerojax.checkpoint.restore(tmp_path / "ckpt", like=plain,
                                       offload=None)
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(plainly),
                         saved)
  restored = zerojax.checkpoint.restore(tmp_path / "ckpt", like=plain,
                                        offload=zerojax.Offload(
                                            "disk", dir=str(again_dir)))
  assert all(map(disk_tier.is_on_disk, restored.master))
  state, losses = zero_run(state, loss_fn, batches[1:])
  restored, again = zero_run(restored, loss_fn, batches[1:])
  np.testing.assert_array_equal(again, losses)
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(restored),
                         _params(state))


@pytest.mark.slow
# (the masters made on the device go to the files through host memory:
# `create` donates no buffer it cannot reuse, so jax has nothing to say)
@pytest.mark.filterwarnings("error:Some donated buffers were not usable")
def test_stage_3_bf16_create_and_eval_read_the_sharded_compute_copy(tmp_path):
  """Stage 3, bf16: `create` makes the same state as `shard` (the master on
  disk, its bf16 shards in host memory), `eval_step` reads the copy, and
  `memory_report` counts it as host memory beside the files."""
  model, params, loss_fn, batches = _problem("transformer", steps=3)
  (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
  shard = _shard(3, precision="bfloat16",
                 offload=zerojax.Offload("disk", dir=str(tmp_path / "a")))
  made = zerojax.create(
      lambda r: model.init(r, batches[0]["tokens"][:1])["params"],
      jax.random.key(0), apply_fn=model.apply, tx=TX, stage=3,
      precision="bfloat16",
      offload=zerojax.Offload("disk", dir=str(tmp_path / "b")))
  assert all(map(disk_tier.is_on_disk, made.master))
  for x, m, s in zip(made.compute, loaded_master(made),
                     shard.compute):
    assert x.sharding == s.sharding and x.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(x),
                                  np.asarray(m).astype(jnp.bfloat16))
  # create's init is jitted, the problem's is not: equal to float rounding
  jax.tree_util.tree_map(functools.partial(np.testing.assert_allclose,
                                           rtol=1e-6, atol=1e-7),
                         _params(made), _params(shard))
  host = _shard(3, compute_dtype="bfloat16", offload_optimizer=True,
                update_on="host")
  evaluate = zerojax.eval_step(lambda p, b: {"loss": jax.vmap(
      lambda t, y: loss_fn(p, {"tokens": t[None], "targets": y[None]}))(
          b["tokens"], b["targets"])})
  np.testing.assert_array_equal(np.asarray(evaluate(made, batches[0])["loss"]),
                                np.asarray(evaluate(host, batches[0])["loss"]))
  report = zerojax.memory_report(made)
  assert report.measured["compute parameters"] == {
      "pinned_host": sum(x.nbytes for x in made.compute) // 8}
  assert report.measured["master parameters"] == {
      "disk": sum(x.nbytes for x in made.master) // 8}
  disk_tier.remove(shard)
  disk_tier.remove(made)


def test_an_optimizer_without_statistics_at_fp32_stage3_runs_as_the_host_tier(
    tmp_path, caplog):
  """optax.sgd at stage 3 under fp32: nothing for the disk (no statistics;
  the master shards are what the forward gathers, in host memory). The
  state runs as the host tier updating on the host, said once, and trains
  as plain optax does (was: a bare IndexError at the first step)."""
  model, params, loss_fn, batches = _problem("mlp", steps=3)
  tx = optax.sgd(0.1)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  with caplog.at_level("WARNING", logger="zerojax"):
    state = zerojax.shard(plain, stage=3, offload=zerojax.Offload(
        tier="disk", dir=str(tmp_path)))
  assert caplog.text.count("nothing to keep on disk") == 1
  assert state.config.offload_optimizer is True
  assert state.config.update_on == "host" and not disk_tier._on_disk(state)
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, _params(state),
                           *reference_run(loss_fn, params, tx, batches))
