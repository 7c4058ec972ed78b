"""Processes the disk-tier tests watch (not a test), on 8 simulated CPU
devices.

`python disk_worker.py kill LIVE_DIR CKPT_DIR`: trains `problem()` with its
  statistics in LIVE_DIR, saves step 1 to CKPT_DIR, and during step 2's
  update, once the first shard of statistics is written back, sends itself
  SIGKILL: the live files then mix step 2 and step 1.
  `tests/test_disk_tier.py` restores CKPT_DIR.
`python disk_worker.py exit LIVE_DIR`: trains two steps with its statistics
  in LIVE_DIR, named relative to the working directory, which it leaves
  between the steps, and exits normally.
`python disk_worker.py rss LIVE_DIR`: steps `problem(width=1024)` (four
  chunks of 1M elements, 8 MiB of adam statistics each) and prints, as
  JSON, the largest RSS increase during the disk update of its third step
  above the RSS when that update began, and one chunk's statistics' bytes.
  Run with glibc's mmap threshold fixed (MALLOC_MMAP_THRESHOLD_), so a
  freed array's pages go back at once and RSS follows what is held.
"""
import os
import signal
import sys


def problem(width: int = 64, layers: int = 3):
  """(TrainState, loss_fn, batches, shard fields): `layers` chunks of
  statistics, all on disk."""
  import numpy as np
  import optax
  from flax.training import train_state
  rng = np.random.default_rng(0)
  params = {f"w{i}": (rng.normal(size=(width, width)) /
                      np.sqrt(width)).astype(np.float32)
            for i in range(layers)}

  def loss_fn(params, batch):
    h = batch["x"]
    for i in range(layers):
      h = h @ params[f"w{i}"]
    return ((h - batch["y"]) ** 2).mean()

  batches = [{"x": rng.normal(size=(16, width)).astype(np.float32),
              "y": rng.normal(size=(16, width)).astype(np.float32)}
             for _ in range(3)]
  state = train_state.TrainState.create(apply_fn=None, params=params,
                                        tx=optax.adam(1e-2))
  return state, loss_fn, batches, dict(stage=3, chunk_size=width * width)


def kill(live: str, ckpt: str) -> None:
  import zerojax
  from zerojax._tiers import disk
  state, loss_fn, batches, fields = problem()
  state = zerojax.shard(state, offload=zerojax.Offload("disk", dir=live),
                        **fields)
  step = zerojax.train_step(loss_fn)
  state, _ = step(state, batches[0])
  zerojax.checkpoint.save(ckpt, state)   # a disk tier's save is committed
  write = disk.ChunkFiles._write

  def write_then_die(self, path, data, at):
    write(self, path, data, at)
    os.kill(os.getpid(), signal.SIGKILL)

  disk.ChunkFiles._write = write_then_die
  step(state, batches[1])
  raise SystemExit("not killed")


def exit_normally(live: str) -> None:
  import zerojax
  state, loss_fn, batches, fields = problem()
  os.chdir(os.path.dirname(live))
  state = zerojax.shard(state, offload=zerojax.Offload("disk", dir=os.path.basename(live)), **fields)
  step = zerojax.train_step(loss_fn)
  state, _ = step(state, batches[0])
  os.chdir("/")   # the directory was resolved once, at shard
  state, _ = step(state, batches[1])
  print(sorted(os.listdir(live)))


def rss(live: str) -> None:
  import json
  import threading
  import time
  import jax
  import zerojax
  from zerojax._train import disk_stream
  state, loss_fn, batches, fields = problem(width=1024, layers=4)
  state = zerojax.shard(state, offload=zerojax.Offload("disk", dir=live),
                        **fields)
  page = os.sysconf("SC_PAGE_SIZE")

  def now() -> int:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * page

  update, seen, peak = disk_stream.run, {}, [0]

  def measured(*args):
    jax.block_until_ready(args[:2])   # the step's own program has run
    seen.update(step_peak=max(peak[0], now()), start=now())
    peak[0] = 0
    out = update(*args)
    seen.update(peak=max(peak[0], now()), end=now())
    return out

  disk_stream.run = measured
  step = zerojax.train_step(loss_fn)
  for batch in batches[:2]:   # these compile
    state, _ = step(state, batch)
  done = threading.Event()

  def sample():
    while not done.is_set():
      peak[0] = max(peak[0], now())
      time.sleep(0.0002)
  sampler = threading.Thread(target=sample)
  peak[0] = now()
  sampler.start()
  state, _ = step(state, batches[2])
  done.set()
  sampler.join()
  chunk = 2 * 1024 * 1024 * 4   # adam's m and v of one chunk
  print(json.dumps({**seen, "chunk": chunk}))


if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = (os.environ.get("ZEROJAX_TEST_FAST_FLAGS", "")  # conftest
                             + " --xla_force_host_platform_device_count=8").strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  {"kill": kill, "rss": rss, "exit": exit_normally}[sys.argv[1]](*sys.argv[2:])
