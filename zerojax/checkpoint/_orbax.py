"""A zerojax state as one item of the caller's own orbax CheckpointManager,
beside their other items (a data iterator's state, metadata), as FSDP2's
sharded state dicts go into DCP beside anything else:

    mgr.save(step, args=ocp.args.Composite(
        state=zerojax.checkpoint.ZeroSave(state),
        data=ocp.args.JsonSave(iterator_state)))
    got = mgr.restore(step, args=ocp.args.Composite(
        state=zerojax.checkpoint.ZeroRestore(like, mesh=mesh),
        data=ocp.args.JsonRestore()))
    state = got.state

`ZeroStateHandler`, which orbax finds through the two argument classes,
writes the item's directory as `save`'s step holds the state: the chunk
arrays as orbax's StandardCheckpointHandler writes them, and the sealed
metadata (`_save.saved_form`) beside them as `zerojax.json`
(`_integrity.ITEM_META`). A restore checks and reads it as `restore` reads
a step (any device count and stage; the checksums, the saved
configuration, the frozen leaves), and so do `restore` and `export_params`
given the manager's directory. The manager's own rules hold for the rest:
its asynchronous save returns once the arrays are copied to the host, and
`mgr.wait_until_finished()` commits it.
"""
from __future__ import annotations

import os
from typing import Any, List, Optional

import orbax.checkpoint as ocp
from etils import epath
from jax.sharding import Mesh

from zerojax._state.state import ZeroTrainState, check_live
from zerojax.checkpoint._integrity import ITEM_META
from zerojax.checkpoint._restore import prepared, readable_item, restore_opened
from zerojax.checkpoint._save import saved_form


class ZeroStateHandler(ocp.AsyncCheckpointHandler):
  """orbax's handler of a ZeroTrainState item (the module docstring)."""

  def __init__(self):
    self._arrays = ocp.StandardCheckpointHandler()
    self._meta = ocp.JsonCheckpointHandler(ITEM_META)

  def _parts(self, args: "ZeroSave") -> tuple:
    """(handler, its args) of the item's arrays and of its metadata."""
    tree, meta = saved_form(args.state)
    return ((self._arrays, ocp.args.StandardSave(tree)),
            (self._meta, ocp.args.JsonSave(meta)))

  async def async_save(self, directory: epath.Path,
                       args: "ZeroSave") -> Optional[List[Any]]:
    futures = []
    for handler, part in self._parts(args):
      futures += await handler.async_save(directory, args=part) or []
    return futures

  def save(self, directory: epath.Path, args: "ZeroSave") -> None:
    for handler, part in self._parts(args):
      handler.save(directory, args=part)

  def restore(self, directory: epath.Path,
              args: "ZeroRestore") -> ZeroTrainState:
    if not isinstance(args, ZeroRestore):
      raise TypeError("a zerojax state item is restored with "
                      "zerojax.checkpoint.ZeroRestore(like, ...), got "
                      f"{type(args).__name__}.")
    path, meta, saved = _opened(os.fspath(directory))
    return restore_opened(path, meta, saved, args.like, **args.target)

  def metadata(self, directory: epath.Path) -> dict:
    """The item's checked metadata: format, config, layout, checksums."""
    return _opened(os.fspath(directory))[1]

  def finalize(self, directory: epath.Path) -> None:
    self._arrays.finalize(directory)

  def close(self) -> None:
    self._arrays.close()
    self._meta.close()


def _opened(path: str) -> tuple:
  try:
    return readable_item(path)
  except ValueError as e:
    raise ValueError(f"the zerojax state in {path} cannot be restored: "
                     f"{e}") from None


@ocp.args.register_with_handler(ZeroStateHandler, for_save=True)
class ZeroSave(ocp.args.CheckpointArgs):
  """Saves a ZeroTrainState as an item of an orbax CheckpointManager's
  `ocp.args.Composite`, as it is sharded: every process writes its own
  shards, nothing is gathered.

  A disk-tier state (`offload_optimizer="disk"`) is refused: its statistics
  are written from their files, which the next step rewrites while the
  manager's asynchronous save is still writing. `zerojax.checkpoint.save`
  (with `items=` for the rest) waits for such a save.
  """

  def __init__(self, state: ZeroTrainState):
    if not isinstance(state, ZeroTrainState):
      raise TypeError("ZeroSave takes a ZeroTrainState, got "
                      f"{type(state).__name__}.")
    check_live(state, "ZeroSave()")
    if state.config.disk:
      raise ValueError(
          "ZeroSave: a disk-tier state (offload_optimizer='disk') cannot go "
          "into an asynchronous CheckpointManager save: its statistics are "
          "written from their files, which the next step rewrites. Save it "
          "with zerojax.checkpoint.save(directory, state, items={...}), "
          "which waits for the write, passing your other items as items=.")
    self.state = state


@ocp.args.register_with_handler(ZeroStateHandler, for_restore=True)
class ZeroRestore(ocp.args.CheckpointArgs):
  """Restores a ZeroTrainState item onto any mesh and stage. The arguments
  are `zerojax.checkpoint.restore`'s (`like`, `mesh`, `stage`, `tx`,
  `cast`, `partial` and ZeroConfig options over the saved ones); the step
  is the manager's."""

  def __init__(self, like: Any, *, mesh: Optional[Mesh] = None,
               stage: Optional[int] = None, tx: Any = None,
               cast: bool = False, partial: bool = False, **options):
    self.like, config_fields = prepared(like, tx, cast, partial, options)
    self.target = dict(mesh=mesh, stage=stage, cast=cast, partial=partial,
                       config_fields=config_fields)
