"""Asynchronous saves: one orbax CheckpointManager per directory, each save
checked where it enters and its completion owed to the caller.

A save returns once the state is copied to the host; orbax writes it in the
background. What zerojax adds to orbax:
  * a directory that cannot be written fails at `save()` (a probe file);
  * a background write that fails is raised at the next `save`/`wait` of
    that directory, naming the directory and the step it lost;
  * saves are serialised process-wide (`_LOCK`), one background write at a
    time: orbax's CheckpointManager races when two threads save into one
    directory (steps returned as saved but never committed, "Save
    finalization already in progress") and when two managers commit at
    once (missing tmp metadata, hangs). A save first waits for the write in
    flight, whichever its directory; a failure found so is kept for that
    directory's next `save`/`wait`;
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
from collections.abc import Mapping
from typing import Any, Optional

import numpy as np
import orbax.checkpoint as ocp

from zerojax.checkpoint._format import (FORMAT, chunk_form, config_json,
                                        frozen_names, layout_json)
from zerojax.checkpoint._integrity import check_step, checksums, seal
from zerojax._state.state import ZeroTrainState, check_live

_MANAGERS: dict = {}   # absolute directory -> CheckpointManager
_KEEP: dict = {}       # absolute directory -> its manager's `keep`
_PENDING: dict = {}    # absolute directory -> the step being written
_FAILED: dict = {}     # absolute directory -> the error of its lost write
_LOCK = threading.RLock()   # every use of the dicts above and of orbax
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


def saved_form(state: ZeroTrainState) -> tuple:
  """(the array tree, the sealed metadata) a checkpoint of `state` holds:
  the package docstring's `state` and `meta`."""
  tree = chunk_form(state)
  layout = layout_json(state.layout)
  # `frozen` beside the config, not in it: a reader that predates it
  # ignores it instead of passing names to ZeroConfig(frozen=...).
  meta = seal({"format": FORMAT, "config": config_json(state.config),
               "frozen": frozen_names(layout),
               "num_shards": state.num_shards, "layout": layout,
               "checksums": checksums(tree)})
  return tree, meta


def check_items(items: Any, caller: str) -> dict:
  """`items` (the caller's own checkpoint items beside the state) as a
  dict of orbax `CheckpointArgs` by name; TypeError/ValueError naming the
  item otherwise. `state` and `meta` are the state's own. `caller`:
  "save" or "restore"."""
  if items is None:
    return {}
  args = ("ocp.args.JsonSave(iterator_state)" if caller == "save"
          else "ocp.args.JsonRestore()")
  if not isinstance(items, Mapping):
    raise TypeError(f"{caller}(items={type(items).__name__}): items is a dict "
                    f"of name -> orbax CheckpointArgs, e.g. {{'data': {args}}}.")
  for name, arg in items.items():
    if not isinstance(name, str) or not name.isidentifier():
      raise ValueError(f"{caller}(items=...): item name {name!r} is not a "
                       "Python identifier (it names a directory of the step).")
    if name in ("state", "meta"):
      raise ValueError(f"{caller}(items=...): the item name {name!r} is the "
                       "state's own; name yours otherwise.")
    if not isinstance(arg, ocp.args.CheckpointArgs):
      raise TypeError(
          f"{caller}(items=...): item {name!r} is a {type(arg).__name__}, not "
          f"orbax CheckpointArgs; pass it as orbax takes it, e.g. {args}.")
  return dict(items)


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


def _settle(directory: str) -> None:
  """Waits for the save in flight to `directory`; a failed background
  write is kept, naming the step it lost, for `_finish`."""
  mgr = _MANAGERS.get(directory)
  if mgr is None or directory not in _PENDING:
    return
  step = _PENDING.pop(directory)
  try:
    mgr.wait_until_finished()
  except Exception as e:  # noqa: BLE001 - kept, naming what was lost
    error = RuntimeError(f"checkpoint step {step} in {directory} was not "
                         f"written: {type(e).__name__}: {e}")
    error.__cause__ = e
    _FAILED.setdefault(directory, error)
    # orbax's manager may be left mid-commit: the next save gets a new one
    _MANAGERS.pop(directory, None)


def _finish(directory: str) -> None:
  """Waits for the save in flight to `directory`; raises naming the step it
  lost when the background write failed (also one found earlier)."""
  with _LOCK:
    _settle(directory)
    if directory in _FAILED:
      raise _FAILED.pop(directory)


def _finish_all_at_exit() -> None:
  failed = False
  with _LOCK:
    for directory in list(_MANAGERS) + list(_FAILED):
      try:
        _finish(directory)
        if directory in _MANAGERS:
          _MANAGERS.pop(directory).close()
      except Exception as e:  # noqa: BLE001 - reported once, then exit(1)
        print(f"zerojax: {e}", file=sys.stderr, flush=True)
        failed = True
  if failed:
    # The exit status is decided before exit hooks run: only this changes it,
    # and it cannot hang on orbax's threads of the failed save.
    os._exit(1)


def _check_keep(directory: str, steps: list, keep: Optional[int]) -> None:
  """Refuses a `keep` that would have orbax delete a step that is a
  symbolic link (it would fail half-way, after writing the new step)."""
  if keep is None:
    return
  for step in steps[:max(len(steps) + 1 - keep, 0)]:
    path = os.path.join(directory, str(step))
    if os.path.islink(path):
      raise ValueError(
          f"keep={keep} would delete step {step}, but {path} is a symbolic "
          f"link (to {os.readlink(path)}); zerojax does not delete through "
          "links. Replace the link by the directory, remove it, or save "
          "with keep=None (nothing was written).")


def save(directory: str, state: ZeroTrainState, *, step: Optional[int] = None,
         keep: Optional[int] = None, wait: bool = False,
         items: Optional[Mapping[str, Any]] = None) -> int:
  """Writes `state` asynchronously; training may go on at once.

  The write is committed at the latest when the process exits normally; a
  failed background write is raised by the next `save` or `wait` of this
  directory (or, at exit, printed and the exit status set to 1).

  Safe from several threads, into one directory or several: saves are
  serialised, one background write at a time in the process (the module
  docstring). A save that returns is committed, or its failure is raised
  by the next `save`/`wait` of its directory, naming its step.

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
    items: what else the step holds beside the state, committed with it or
      not at all: {name: orbax save args}, e.g. a data iterator's state and
      metadata, `{"data": ocp.args.JsonSave(it.get_state()),
      "meta": ...}` (grain's `grain.checkpoint.CheckpointSave(it)` too).
      `restore(..., items=)` reads them back. The names `state` and `meta`
      are the state's own.

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
  items = check_items(items, "save")
  directory = os.path.abspath(directory)
  with _LOCK:
    return _save_locked(directory, state, step, keep, wait, items)


def _save_locked(directory: str, state: ZeroTrainState, step: int,
                 keep: Optional[int], wait: bool, items: dict) -> int:
  _check_writable(directory)
  for other in list(_PENDING):   # one background write at a time
    _settle(other)
  _finish(directory)   # the previous save's failure is raised here
  mgr = _manager(directory, keep)
  _check_keep(directory, sorted(mgr.all_steps()), keep)
  if step in mgr.all_steps():
    raise ValueError(f"step {step} already exists in {directory}; pass "
                     "another step= (nothing was overwritten).")
  latest = mgr.latest_step()
  if latest is not None and step < latest:
    # orbax would skip it without a word.
    raise ValueError(f"step {step} is older than the newest checkpoint "
                     f"({latest}) in {directory}; pass a step= above {latest} "
                     "or another directory (nothing was written).")
  tree, meta = saved_form(state)
  try:
    started = mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(tree), meta=ocp.args.JsonSave(meta),
        **items))
  except Exception as e:  # noqa: BLE001 - re-raised, naming what was lost
    _MANAGERS.pop(directory, None)
    raise RuntimeError(f"checkpoint step {step} in {directory} was not "
                       f"written: {type(e).__name__}: {e}") from e
  if not started:   # orbax decided not to save: never returned as saved
    raise RuntimeError(f"checkpoint step {step} in {directory} was not "
                       "written: orbax's CheckpointManager declined it.")
  _PENDING[directory] = step
  if wait or state.config.disk:
    _finish(directory)
  return step


def wait(directory: str) -> None:
  """Blocks until every asynchronous save to `directory` is committed;
  raises `RuntimeError` naming the step if the background write failed."""
  _finish(os.path.abspath(directory))

