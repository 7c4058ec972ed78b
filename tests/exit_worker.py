"""Processes whose exit the checkpoint and step tests watch (not a test).

`python exit_worker.py MODE CKPT_DIR`, on 8 simulated CPU devices:
  crash: saves step 1 of a stage-3 state (waiting for the commit), then
    starts the asynchronous save of step 2 from other parameters and, as
    soon as `save` returns, sends itself SIGKILL: the write of step 2 is in
    flight (it takes ~0.1 s, the signal microseconds), deterministically,
    without a race against a parent;
  last-save: an asynchronous save of step 2 is the script's last line;
  unwritable: saves into CKPT_DIR, which this process cannot write;
  full-disk: saves into CKPT_DIR, but no file can grow (RLIMIT_FSIZE 0,
    as on a full disk), so the write fails in orbax's background thread;
  donated: steps a state, then steps the donated input again;
  crash-items, crash-manager: as crash, each step saved with a data
    iterator's state ({"position": step}) and a dict of metadata beside
    it: through `save(..., items=)`, or as items of an orbax
    CheckpointManager the worker builds itself (`ZeroSave`).
"""
import os
import resource
import signal
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("ZEROJAX_TEST_FAST_FLAGS", "")  # conftest
                             + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
import orbax.checkpoint as ocp  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax  # noqa: E402

# 3 x 32 MiB (params and Adam's two moments): measured 0.12-0.17 s from
# `save` returning to the commit on this machine.
SHAPE = (2048, 4096)


def plain_state(offset: float) -> train_state.TrainState:
  params = {"w": np.full(SHAPE, offset, np.float32),
            "b": np.arange(SHAPE[1], dtype=np.float32) + offset}
  return train_state.TrainState.create(apply_fn=None, params=params,
                                       tx=optax.adam(1e-3)).replace(
                                           step=int(offset))


def items(step: int) -> dict:
  """The items saved beside the state of `step` in the crash-* modes."""
  return {"data": ocp.args.JsonSave({"position": step}),
          "meta": ocp.args.JsonSave({"run": "crash", "step": step})}


def crash_with_items(mode: str, directory: str) -> None:
  if mode == "crash-items":
    for step in (1, 2):
      extra = {"data": items(step)["data"], "info": items(step)["meta"]}
      zerojax.checkpoint.save(directory, zerojax.shard(plain_state(step)),
                              items=extra, wait=step == 1)
  else:
    mgr = ocp.CheckpointManager(directory)
    for step in (1, 2):
      mgr.save(step, args=ocp.args.Composite(
          state=zerojax.checkpoint.ZeroSave(zerojax.shard(plain_state(step))),
          **items(step)))
      if step == 1:
        mgr.wait_until_finished()
  print("save returned", flush=True)
  os.kill(os.getpid(), signal.SIGKILL)


def main(mode: str, directory: str) -> None:
  if mode.startswith("crash-"):
    return crash_with_items(mode, directory)
  if mode == "crash":
    zerojax.checkpoint.save(directory, zerojax.shard(plain_state(1.0), stage=3),
                            wait=True)
  if mode == "full-disk":
    # every write of a file's bytes fails (EFBIG), as on a full disk: the
    # directories and the empty probe file are made, the data write fails
    # in orbax's background thread, after save() returned
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
  if mode == "donated":
    state = zerojax.shard(plain_state(0.0), stage=3)
    step = zerojax.train_step(lambda p, b: jnp.mean(p["b"] * b))
    batch = np.ones((8, SHAPE[1]), np.float32)
    step(state, batch)
    step(state, batch)   # donated by the call before
    return
  zerojax.checkpoint.save(directory, zerojax.shard(plain_state(2.0), stage=3))
  print("save returned", flush=True)
  if mode == "crash":
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
