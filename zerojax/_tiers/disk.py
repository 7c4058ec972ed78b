"""Raw files for the disk tier (ZeRO-Infinity): arrays written and read with
`os.pwrite` / `os.preadv` in pieces on a thread pool, and a stream that
reads the next chunk while the current one is updated and writes the
previous one back meanwhile. Knows nothing of JAX or optax: it moves numpy
arrays. The disk tier (`offload="disk"`) reads and writes its
files through it (`disk_tier`, `disk_stream`).

Why raw files: they wrote and read faster than tensorstore's zarr driver
(uncompressed, the same pieces: docs/decisions.md, "Figures out of the
code's comments"), and a raw file needs no metadata of its own: the layout
already says every chunk's shape and dtype.

Files are scratch: what they hold is rebuilt from a checkpoint on restore,
so nothing is fsynced. A failed write or read (a full disk, a read-only
mount, a file removed or made unreadable, a file-size limit) is raised by
the stream or by `wait` as one `OSError` naming the file, the cause and
the remedy (`_failed`), never dropped: the caller then has no consistent
live state and must restore from its last checkpoint. Every piece written
keeps the sum of its 32-bit words; a read of the same piece checks its
length and that sum, so a file changed behind the tier's back (a stray
write, a NaN-filled file) is found rather than trained on.
"""
from __future__ import annotations

import concurrent.futures as cf
import errno
import os
import threading
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

PIECE = 8 * 2 ** 20   # bytes per pwrite / preadv call


def check_directory(directory: str) -> str:
  """`directory` as an absolute path, after checking that it exists, is a
  directory, and takes a file (written, read back and removed): a clear
  error naming it and the fix otherwise."""
  path = os.path.abspath(os.fspath(directory))
  if not os.path.exists(path):
    raise FileNotFoundError(f"Offload(dir={directory!r}) does not exist; "
                            "create it (on a local NVMe disk) first.")
  if not os.path.isdir(path):
    raise NotADirectoryError(f"Offload(dir={directory!r}) is not a directory.")
  probe = os.path.join(path, f".zerojax-probe-{os.getpid()}")
  try:
    fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
      if os.pwrite(fd, b"zerojax", 0) != 7 or os.pread(fd, 7, 0) != b"zerojax":
        raise OSError(errno.EIO, "a probe file did not read back")
    finally:
      os.close(fd)
      os.unlink(probe)
  except OSError as e:
    raise PermissionError(
        f"Offload(dir={directory!r}) cannot take the disk tier's files "
        f"({e.strerror or e}); choose a writable directory with room for "
        "the offloaded optimizer state.") from None
  return path


class ChunkFiles:
  """Arrays in raw files named by key under a checked directory."""

  def __init__(self, directory: str, threads: int = 4):
    self.directory = check_directory(directory)
    self._sums: dict = {}   # (path, offset, length) -> sum of its words
    self._pool = cf.ThreadPoolExecutor(threads, thread_name_prefix="zerojax-disk")
    # a read that waits for earlier writes waits here, not in the pool
    self._chain = cf.ThreadPoolExecutor(1, thread_name_prefix="zerojax-disk-next")

  def path(self, key: str) -> str:
    return os.path.join(self.directory, f"{key}.bin")

  def write(self, key: str, array: np.ndarray,
            at: Optional[Sequence[int]] = None) -> cf.Future:
    """Starts writing `array` (C-contiguous) to `key`'s file: the whole
    file, or with `at` the array's rows (`len(at)` equal parts) at those
    byte offsets into it (one shard of an array sharded on its last axis:
    `shard_offsets`). The future raises what the write raised (`OSError`
    with the file and the fix for a full disk)."""
    data = memoryview(np.ascontiguousarray(array).view(np.uint8).reshape(-1))
    return self._pool.submit(self._write, self.path(key), data, at)

  def read(self, key: str, shape: Sequence[int], dtype,
           at: Optional[Sequence[int]] = None) -> cf.Future:
    """Starts reading `key`'s file (or with `at`, rows at those byte
    offsets, as `write`) into a new array of `shape` and `dtype`; the
    future raises when the file is shorter than that."""
    out = np.empty(shape, dtype)
    return self._pool.submit(self._read, self.path(key), out, at)

  @staticmethod
  def _segments(data: memoryview, at) -> list:
    if at is None:
      return [(0, data)]
    row = len(data) // len(at)
    return [(offset, data[r * row:(r + 1) * row]) for r, offset in enumerate(at)]

  def _write(self, path: str, data: memoryview, at) -> None:
    done = 0
    try:
      fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
      try:
        for start, segment in self._segments(data, at):
          self._sums.pop((path, start, len(segment)), None)
          offset = 0
          while offset < len(segment):
            wrote = os.pwrite(fd, segment[offset:offset + PIECE],
                              start + offset)
            offset += wrote
            done += wrote
          self._sums[path, start, len(segment)] = _word_sum(segment)
        if at is None:
          os.ftruncate(fd, len(data))
      finally:
        os.close(fd)
    except OSError as e:
      raise _failed("writing", path, e, f"{done:,} of {len(data):,} bytes "
                    "written") from None

  def _read(self, path: str, out: np.ndarray, at) -> np.ndarray:
    data = memoryview(out.view(np.uint8).reshape(-1))
    try:
      fd = os.open(path, os.O_RDONLY)
      try:
        for start, segment in self._segments(data, at):
          offset = 0
          while offset < len(segment):
            got = os.preadv(fd, [segment[offset:offset + PIECE]],
                            start + offset)
            if got == 0:
              raise OSError(errno.EIO, f"the file is shorter than the "
                            f"{len(data):,} bytes expected")
            offset += got
          want = self._sums.get((path, start, len(segment)))
          if want is not None and _word_sum(segment) != want:
            raise OSError(errno.EIO, f"bytes {start:,} to "
                          f"{start + len(segment):,} changed since the tier "
                          "wrote them (their checksum differs)")
      finally:
        os.close(fd)
    except OSError as e:
      raise _failed("reading", path, e) from None
    return out

  def stream(self, items: Iterable, read: Callable, update: Callable,
             write: Callable) -> None:
    """For each item in order: `arrays = list(read(item).result())`, then
    `result = update(item, arrays)` in this thread, then
    `write(item, result)` (a sequence of futures). The stream keeps no
    reference to `arrays` or `result`: an update that empties the list
    frees the arrays it read once it is done with them.

    Overlap with a bounded footprint: while item i is updated, item i-1's
    writes finish and then item i+1's read runs (it waits for them, in a
    thread of its own), so host memory holds item i's arrays and result
    plus one other item's, never three items' at once. Any failed read or
    write is raised here, once the writes in flight are done."""
    items = list(items)
    reads: dict = {}
    writes: list = []   # per item, its write futures

    def start(i):
      if i >= len(items):
        return
      before = writes[i - 2] if i >= 2 else []

      def after_writes(item=items[i]):
        for f in before:
          f.result()
        return read(item).result()
      reads[i] = self._chain.submit(after_writes)

    try:
      start(0)
      for i, item in enumerate(items):
        start(i + 1)   # waits for item i-1's writes in its own thread
        writes.append(list(write(item, update(item, list(
            reads.pop(i).result())))))
    finally:
      errors = []
      for futures in writes:
        for f in futures:
          try:
            f.result()
          except BaseException as e:  # noqa: BLE001 - raised below
            errors.append(e)
      for f in reads.values():
        f.cancel()
    if errors:
      raise errors[0]

  def close(self) -> None:
    self._chain.shutdown(wait=True)
    self._pool.shutdown(wait=True)


def _word_sum(data: memoryview) -> int:
  """The sum of `data`'s 32-bit words (its tail bytes widened), mod 2**32:
  a cheap checksum, as the checkpoints' (`checkpoint._integrity`)."""
  raw = np.frombuffer(data, np.uint8)
  whole = len(raw) // 4 * 4
  total = int(np.sum(raw[:whole].view(np.uint32), dtype=np.uint64))
  return (total + int(np.sum(raw[whole:], dtype=np.uint64))) % 2 ** 32


def _failed(doing: str, path: str, error: OSError, detail: str = "") -> OSError:
  """One error for a failed file operation of the tier: the file, the
  cause, the remedy."""
  cause = error.strerror or str(error)
  if error.errno in (errno.ENOSPC, errno.EDQUOT):
    remedy = "free space or choose another offload_dir"
  elif error.errno == errno.EFBIG:
    remedy = "the process's file-size limit (ulimit -f) is too small"
  elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
    remedy = "make offload_dir writable again"
  elif error.errno == errno.ENOENT:
    remedy = "the file or offload_dir was removed while training"
  else:
    remedy = "check offload_dir's disk"
  return OSError(error.errno,
                 f"disk tier: {doing} {path} failed: {cause}"
                 f"{' (' + detail + ')' if detail else ''}; {remedy}. The "
                 "training state is no longer consistent: restore from the "
                 "last checkpoint", path)


def shard_offsets(shape: Sequence[int], itemsize: int, start: int,
                  stop: int) -> list:
  """Byte offsets of the rows of `array[..., start:stop]` in the file of a
  C-order array of `shape`: where a shard on the last axis lies."""
  rows, length = int(np.prod(shape[:-1], dtype=np.int64)), shape[-1]
  return [(r * length + start) * itemsize for r in range(rows)]


def read_many(files: ChunkFiles, keys: Sequence[str], shapes, dtypes,
              at: Optional[Sequence] = None) -> cf.Future:
  """One future for several files' arrays (a tuple, in `keys` order);
  `at`: each one's row offsets, as `ChunkFiles.read`."""
  at = [None] * len(keys) if at is None else at
  futures = [files.read(k, s, d, a)
             for k, s, d, a in zip(keys, shapes, dtypes, at)]
  done: cf.Future = cf.Future()
  left = [len(futures)]
  lock = threading.Lock()

  def finish(_):
    with lock:
      left[0] -= 1
      if left[0]:
        return
    try:
      done.set_result(tuple(f.result() for f in futures))
    except BaseException as e:  # noqa: BLE001 - the reader's error
      done.set_exception(e)
    futures.clear()   # each holds `finish`: no cycle keeps the arrays

  if not futures:
    done.set_result(())
  for f in list(futures):
    f.add_done_callback(finish)
  return done

