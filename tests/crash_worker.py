"""The process test_checkpoint_crash.py kills (not a test).

`python crash_worker.py CKPT_DIR`: on 8 simulated CPU devices, saves step 1
of a stage-3 state (waiting for the commit), then starts the asynchronous
save of step 2 from other parameters and, as soon as `save` returns, sends
itself SIGKILL: the write of step 2 is in flight (it takes ~0.1 s, the
signal microseconds), deterministically, without a race against a parent.
"""
import os
import signal
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import optax  # noqa: E402
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


def main(directory: str) -> None:
  zerojax.checkpoint.save(directory, zerojax.shard(plain_state(1.0), stage=3),
                          wait=True)
  state = zerojax.shard(plain_state(2.0), stage=3)
  zerojax.checkpoint.save(directory, state)
  os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
  main(sys.argv[1])
