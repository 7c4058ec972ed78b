"""Asynchronous saves: one orbax CheckpointManager per directory, each save
checked where it enters and its completion owed to the caller.

A save returns once the state is copied to the host; orbax writes it in the
background. What zerojax adds to orbax:
  * a directory that cannot be written fails at `save()` (a probe file);
  * a background write that fails is raised at the next `save`/`wait` of
    that directory, naming the directory and the step it lost;
  * every save still in flight is committed before the interpreter shuts
    down. Orbax's commit schedules work on thread pools, which Python closes
    at shutdown *before* `atexit` hooks run ("cannot schedule new futures
    after interpreter shutdown"), so the hook is registered with
    `threading._register_atexit`, which runs before those pools close. A
    save that fails there is printed once and the process exits with
    status 1, so a lost checkpoint never looks like success.
    CPython 3.12.0 and 3.12.1 refuse to start threads once shutdown begins
    (gh-113964, fixed in 3.12.2), so there a save still in flight at exit
    cannot be committed: it is reported as above, and the first save warns
    to call `wait()` before the script ends.
"""
from __future__ import annotations

import atexit
import os
import sys
import tempfile
import threading
import warnings
from typing import Optional

import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint._format import (FORMAT, chunk_form, config_json,
                                        frozen_names, layout_json)
from zerojax.checkpoint._integrity import check_step, checksums, seal
from zerojax.state import ZeroTrainState, check_live

_MANAGERS: dict = {}   # absolute directory -> CheckpointManager
_KEEP: dict = {}       # absolute directory -> its manager's `keep`
_PENDING: dict = {}    # absolute directory -> the step being written
_EXIT_HOOK: list = []
# no thread can start at shutdown (gh-113964): orbax's commit needs some
_NO_THREADS_AT_EXIT = sys.version_info[:3] in ((3, 12, 0), (3, 12, 1))


def _manager(directory: str, keep: Optional[int]) -> ocp.CheckpointManager:
  """The directory's manager, keeping the newest `keep` steps. Orbax fixes
  `max_to_keep` when a manager is made, so another `keep` than the last
  save's gets a new one (the caller has committed the last save)."""
  if directory in _MANAGERS and _KEEP[directory] != keep:
    _MANAGERS.pop(directory).close()
  if directory not in _MANAGERS:
    # The process that saves owns the directory: orbax's leftovers of a save
    # that a crash cut short (`<step>.orbax-checkpoint-tmp`) are removed.
    _MANAGERS[directory] = ocp.CheckpointManager(
        directory, options=ocp.CheckpointManagerOptions(
            max_to_keep=keep, enable_async_checkpointing=True,
            cleanup_tmp_directories=True))
    _KEEP[directory] = keep
    if not _EXIT_HOOK:
      _EXIT_HOOK.append(_finish_all_at_exit)
      # Runs before concurrent.futures closes its pools (imported by orbax
      # already, so registered before this hook and run after it).
      getattr(threading, "_register_atexit", atexit.register)(
          _finish_all_at_exit)
      if _NO_THREADS_AT_EXIT:
        warnings.warn(
            f"Python {sys.version.split()[0]} cannot start threads at "
            "interpreter shutdown (CPython gh-113964, fixed in 3.12.2): an "
            "asynchronous checkpoint save still in flight when the script "
            "ends is lost (and the exit status set to 1). Call "
            "zerojax.checkpoint.wait(directory) before the script ends, or "
            "use another Python.", RuntimeWarning, stacklevel=3)
  return _MANAGERS[directory]


def _check_writable(directory: str) -> None:
  """Creates `directory` and a probe file in it: an unwritable directory
  fails here rather than in orbax's background thread."""
  try:
    os.makedirs(directory, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=directory, prefix=".zerojax-probe-"):
      pass
  except OSError as e:
    raise type(e)(e.errno, f"cannot write checkpoints to {directory}: "
                  f"{e.strerror}; pass a directory this process may write "
                  "(nothing was saved)", directory) from None


def _finish(directory: str) -> None:
  """Waits for the save in flight to `directory`; raises naming the step it
  lost when the background write failed."""
  mgr, step = _MANAGERS.get(directory), _PENDING.pop(directory, None)
  if mgr is None:
    return
  try:
    mgr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 - re-raised, naming what was lost
    raise RuntimeError(f"checkpoint step {step} in {directory} was not "
                       f"written: {type(e).__name__}: {e}") from e


def _finish_all_at_exit() -> None:
  failed = False
  for directory in list(_MANAGERS):
    try:
      _finish(directory)
      _MANAGERS.pop(directory).close()
    except Exception as e:  # noqa: BLE001 - reported once, then exit(1)
      print(f"zerojax: {e}", file=sys.stderr, flush=True)
      failed = True
  if failed:
    # The exit status is decided before exit hooks run: only this changes it,
    # and it cannot hang on orbax's threads of the failed save.
    os._exit(1)


def save(directory: str, state: ZeroTrainState, *, step: Optional[int] = None,
         keep: Optional[int] = None, wait: bool = False) -> int:
  """Writes `state` asynchronously; training may go on at once.

  The write is committed at the latest when the process exits normally; a
  failed background write is raised by the next `save` or `wait` of this
  directory (or, at exit, printed and the exit status set to 1).

  Args:
    directory: the checkpoint directory (created if missing).
    state: a ZeroTrainState.
    step: the checkpoint's number, a non-negative int; default `state.step`.
    keep: after this save, keep only the newest `keep` checkpoints in
      `directory` (older ones are deleted); None keeps them all. Each call's
      own `keep` applies.
    wait: block until the write is committed. Always so for a disk-tier
      state (`offload_optimizer="disk"`): its statistics are written from
      their files, which the next step rewrites, so the save returns once
      it is committed.

  Returns:
    The step written. Call `wait(directory)` before another process reads
    it.
  """
  if not isinstance(state, ZeroTrainState):
    raise TypeError(f"save() takes a ZeroTrainState, got {type(state).__name__}.")
  check_live(state, "checkpoint.save()")
  if keep is not None and (isinstance(keep, bool) or
                           not isinstance(keep, (int, np.integer))):
    raise TypeError(f"keep={keep!r} must be an int (how many checkpoints to "
                    "keep) or None (all).")
  if keep is not None and keep < 1:
    raise ValueError(f"keep={keep!r} would delete the checkpoint being "
                     "written; keep at least 1, or None to keep all.")
  step = int(state.step) if step is None else check_step(step, "save")
  directory = os.path.abspath(directory)
  _check_writable(directory)
  _finish(directory)   # the previous save's failure is raised here
  mgr = _manager(directory, keep)
  if step in mgr.all_steps():
    raise ValueError(f"step {step} already exists in {directory}; pass "
                     "another step= (nothing was overwritten).")
  latest = mgr.latest_step()
  if latest is not None and step < latest:
    # orbax would skip it without a word.
    raise ValueError(f"step {step} is older than the newest checkpoint "
                     f"({latest}) in {directory}; pass a step= above {latest} "
                     "or another directory (nothing was written).")
  tree = chunk_form(state)
  layout = layout_json(state.layout)
  # `frozen` beside the config, not in it: a reader that predates it
  # ignores it instead of passing names to ZeroConfig(frozen=...).
  meta = seal({"format": FORMAT, "config": config_json(state.config),
               "frozen": frozen_names(layout),
               "num_shards": state.num_shards, "layout": layout,
               "checksums": checksums(tree)})
  _PENDING[directory] = step
  mgr.save(step, args=ocp.args.Composite(
      state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta)))
  if wait or state.config.disk:
    _finish(directory)
  return step


def wait(directory: str) -> None:
  """Blocks until every asynchronous save to `directory` is committed;
  raises `RuntimeError` naming the step if the background write failed."""
  _finish(os.path.abspath(directory))

