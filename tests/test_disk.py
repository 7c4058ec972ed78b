"""The disk tier's raw files (`zerojax._tiers.disk`): arrays come back bit for bit,
the stream overlaps reads and writes with updates while holding at most two
items besides the one updated, and a missing, unwritable or full directory
gives a clear error, never a silent partial write."""
import concurrent.futures
import errno
import os
import threading

import ml_dtypes
import numpy as np
import pytest

from zerojax._tiers import disk


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32])
def test_arrays_come_back_bit_for_bit(tmp_path, monkeypatch, dtype):
  monkeypatch.setattr(disk, "PIECE", 1000)   # several pieces per file
  files = disk.ChunkFiles(tmp_path)
  x = (np.random.default_rng(0).standard_normal((3, 1234)) * 100).astype(dtype)
  files.write("a", x).result()
  y = files.read("a", x.shape, x.dtype).result()
  assert y.dtype == x.dtype and np.array_equal(y.view(np.uint8),
                                               x.view(np.uint8))
  # a shorter rewrite leaves no stale tail behind
  files.write("a", x[:1]).result()
  assert os.path.getsize(files.path("a")) == x[:1].nbytes
  with pytest.raises(OSError, match=r"reading .*a\.bin failed: the file is "
                     r"shorter than the [\d,]+ bytes expected.*restore from "
                     r"the last checkpoint"):
    files.read("a", x.shape, x.dtype).result()
  files.close()


def test_the_stream_overlaps_and_bounds_what_it_holds(tmp_path):
  """Item i+1 is read while item i is updated; item i is written while item
  i+1 is updated (its write completes only once that update has started:
  a stream that waited for it first would stall); and item i's read waits
  for item i-2's write, so at most the updated item and one other are
  held."""
  files = disk.ChunkFiles(tmp_path)
  n = 5
  for i in range(n):
    files.write(f"m{i}", np.full(1000, i, np.float32)).result()
  called = [threading.Event() for _ in range(n)]
  started = [threading.Event() for _ in range(n)]
  written, order = {}, []
  gate = concurrent.futures.ThreadPoolExecutor(n)

  def read(i):
    assert i < 2 or written[i - 2].done(), f"read {i} before write {i - 2}"
    called[i].set()
    return disk.read_many(files, [f"m{i}"], [(1000,)], [np.float32])

  def update(i, arrays):
    (x,) = arrays   # a list: the update may empty it
    started[i].set()
    order.append(i)
    if i + 1 < n:   # the next read happens during this update
      assert called[i + 1].wait(10), f"no read-ahead of {i + 1}"
    assert np.all(x == i)
    return x + 10

  def write(i, y):
    def gated():
      if i + 1 < n:
        assert started[i + 1].wait(10), f"write {i} held up update {i + 1}"
      files.write(f"m{i}", y).result()
    written[i] = gate.submit(gated)
    return [written[i]]

  files.stream(range(n), read, update, write)
  assert order == list(range(n))
  for i in range(n):   # every item updated once and written back
    np.testing.assert_array_equal(
        files.read(f"m{i}", (1000,), np.float32).result(), i + 10)
  gate.shutdown()
  files.close()


def test_a_failed_write_is_raised_not_dropped(tmp_path, monkeypatch):
  files = disk.ChunkFiles(tmp_path)
  real = os.pwrite

  def full(fd, data, offset):
    if offset >= 2000:
      raise OSError(errno.ENOSPC, "No space left on device")
    return real(fd, data[:1000], offset)
  monkeypatch.setattr(disk.os, "pwrite", full)
  with pytest.raises(OSError, match=r"disk tier: writing .*a\.bin failed: "
                     r"No space left on device \(2,000 of 40,000 bytes "
                     r"written\); free space .*restore from the last"):
    files.write("a", np.zeros(10_000, np.float32)).result()
  # in a stream too: raised after the writes in flight
  for i in range(3):
    monkeypatch.setattr(disk.os, "pwrite", real)
    files.write(f"s{i}", np.zeros(10, np.float32)).result()
  monkeypatch.setattr(disk.os, "pwrite", full)
  with pytest.raises(OSError, match="No space left"):
    files.stream(range(3), lambda i: disk.read_many(
                     files, [f"s{i}"], [(10,)], [np.float32]),
                 lambda i, x: np.zeros(10_000, np.float32),
                 lambda i, y: [files.write(f"s{i}", y)])
  files.close()


def test_bad_directories_are_refused(tmp_path):
  with pytest.raises(FileNotFoundError, match="does not exist; create it"):
    disk.ChunkFiles(tmp_path / "missing")
  (tmp_path / "file").write_text("x")
  with pytest.raises(NotADirectoryError, match="is not a directory"):
    disk.ChunkFiles(tmp_path / "file")
  # a directory that takes no file (as a read-only mount would not)
  with pytest.raises(PermissionError, match="cannot take the disk tier's "
                     "files .*choose a writable directory"):
    disk.ChunkFiles("/proc/self")
  assert not [p for p in os.listdir(tmp_path) if p.startswith(".zerojax")]
