"""Multi-host checkpoints: two processes on 127.0.0.1, 4 simulated CPU devices
each, jax.distributed with gloo collectives, train at stage 3, save, restore,
train on (tests/multihost_worker.py). The result must equal the same run on
8 devices in this one process, and a restore onto another chunk layout (cut
and repacked on both hosts) must hold the same state bit for bit.

The workers train the small MLP: the tiny transformer's compilations made
the test take ~150 s on a loaded two-core machine, the MLP ~40 s.
"""
import os
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import pytest

import zerojax
from models import zero_run
from multihost_worker import CHUNK, SPLIT, problem
# starts processes (or runs for minutes): the full suite's, not the fast tier's
pytestmark = pytest.mark.slow

WORKER = pathlib.Path(__file__).with_name("multihost_worker.py")
TIMEOUT_S = 240


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run_workers(tmp_path, *mode) -> dict:
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=(env.get("ZEROJAX_TEST_FAST_FLAGS", "")   # conftest
                        + " --xla_force_host_platform_device_count=4").strip(),
             JAX_PLATFORMS="cpu")
  port, out = _free_port(), tmp_path / "result.npz"
  procs, logs = [], []
  for rank in range(2):
    logs.append(open(tmp_path / f"rank{rank}.log", "w+"))
    procs.append(subprocess.Popen(
        [sys.executable, str(WORKER), str(rank), str(port),
         str(tmp_path / "ckpt"), str(out), *mode],
        env=env, stdout=logs[-1], stderr=subprocess.STDOUT))
  failed = []
  try:
    for rank, p in enumerate(procs):
      try:
        if p.wait(timeout=TIMEOUT_S) != 0:
          failed.append(f"rank {rank} exited with {p.returncode}")
      except subprocess.TimeoutExpired:
        failed.append(f"rank {rank} still running after {TIMEOUT_S} s")
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
        p.wait()
  if failed:
    tails = []
    for rank, log in enumerate(logs):
      log.seek(0)
      tails.append(f"--- rank {rank} output (tail) ---\n{log.read()[-6000:]}")
    pytest.fail("; ".join(failed) + "\n" + "\n".join(tails))
  for log in logs:
    log.close()
  with np.load(out) as f:
    return dict(f)


def test_two_processes_train_save_restore_equal_one_process(tmp_path):
  got = _run_workers(tmp_path)

  plain, loss_fn, batches = problem()
  state = zerojax.shard(plain, stage=3, chunk_size=CHUNK)
  state, losses = zero_run(state, loss_fn, batches)
  want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(zerojax.gather_params(state))}

  # rtol 1e-5 (float32): the same programs on the same 8 device ids, but the
  # cross-process collectives go through gloo, whose reductions may add in
  # another order than XLA's in-process CPU collectives; a few ulps per
  # step, grown by Adam's division by small second moments over 6 steps.
  assert len(got["losses"]) == len(losses) and SPLIT < len(losses)
  np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
  for source in ("params", "disk"):   # export of the live state / of the files
    keys = sorted(k.split("/", 1)[1] for k in got if k.startswith(source + "/"))
    assert keys == sorted(want)
    for k in keys:
      np.testing.assert_allclose(got[f"{source}/{k}"], want[k], rtol=1e-5,
                                 atol=1e-7, err_msg=f"{source} {k}")
  # restored onto another chunk layout across the two processes: the same
  # parameters and optimizer state, bit for bit
  live = sorted(k.split("/", 1)[1] for k in got if k.startswith("live/"))
  assert live and live == sorted(k.split("/", 1)[1] for k in got
                                 if k.startswith("repacked/"))
  for k in live:
    np.testing.assert_array_equal(got[f"repacked/{k}"], got[f"live/{k}"],
                                  err_msg=k)


def test_two_nodes_hybrid_sharding_equals_one_process(tmp_path):
  """Replica across the two processes, data within each: the layout of a
  2-node cluster under HSDP; trained, saved and restored there, equal to
  the single-process 1-D run."""
  got = _run_workers(tmp_path, "hybrid")
  plain, loss_fn, batches = problem()
  state = zerojax.shard(plain, stage=3, chunk_size=CHUNK)
  state, losses = zero_run(state, loss_fn, batches)
  want = {jax.tree_util.keystr(k): np.asarray(v) for k, v in
          jax.tree_util.tree_leaves_with_path(zerojax.gather_params(state))}
  np.testing.assert_allclose(got["losses"], losses, rtol=1e-5)
  keys = sorted(k.split("/", 1)[1] for k in got if k.startswith("params/"))
  assert keys == sorted(want)
  for k in keys:
    np.testing.assert_allclose(got[f"params/{k}"], want[k], rtol=1e-5,
                               atol=1e-7, err_msg=k)


def test_each_process_loads_only_its_own_rows(tmp_path):
  """[Note: process-local batches]: each process passes its half of every
  batch; the run equals the same batches given as global jax.Arrays bit for
  bit (both through gloo), and the single-process run within gloo's ulps. A
  local batch that does not divide over the process's devices is refused
  naming both sizes; the global batch passed on every process is said once."""
  got = _run_workers(tmp_path, "local")
  np.testing.assert_array_equal(got["by_slice"], got["by_array"])
  sliced = sorted(k for k in got if k.startswith("sliced/"))
  assert sliced
  for k in sliced:
    np.testing.assert_array_equal(got[k], got["array/" + k.split("/", 1)[1]],
                                  err_msg=k)
  plain, loss_fn, batches = problem()
  _, losses = zero_run(zerojax.shard(plain, stage=3, chunk_size=CHUNK),
                       loss_fn, batches[:SPLIT])
  np.testing.assert_allclose(got["by_slice"], losses, rtol=1e-5)
  assert "the process-local batch has 5 examples" in str(got["wrong"])
  assert "multiple of 4 rows" in str(got["wrong"])
  assert int(got["same"]) == 1
