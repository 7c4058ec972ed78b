"""Orbax checkpoints of a ZeroTrainState that restore on any device count
and stage, and that plain orbax reads without zerojax.

A save writes the state as it is, chunk shards and all: every device writes
its own shards, nothing is gathered or converted, so saving costs what a
plain orbax save of the same bytes costs (the optimizer statistics are kept
in chunk shape, `optstate.stored`, since TensorStore copies arrays with a unit
axis). The chunk layout goes beside it as
JSON, which is all a reader needs to cut the chunks back into leaves.
A restore onto the same layout (same device count and chunking; any stage)
reads the chunks straight into their new shardings. Onto another layout it
reads the chunks on the host, cuts them into the ordinary tree and repacks
that chunk by chunk (`reshard`), as `shard()` does.

On disk, `DIR/<step>/` (orbax CheckpointManager, atomic commit):
  state/  {"step", "master", "rest", "opt_state", "loss_scale"?, "extras"?}:
          the ZeroTrainState's arrays (`opt_state` is optax's state over the
          chunk views, `ChunkLayout.views`, each chunk's statistics in the
          chunk's shape: `optstate.stored`);
  meta/   JSON: format, the ZeroConfig fields, the frozen leaves' names
          (`frozen_names`), the device count at save, the chunk layout
          (`layout_json`), a checksum per saved array and the SHA-256 of
          the metadata itself (`_integrity`);
  <name>/ the caller's own items (`save(..., items=)`), as orbax writes them.
Format "zerojax-1" (the ordinary tree form, written before 2026-11-22) and
plain orbax checkpoints of a flax TrainState are still read; "zerojax-2"
(two days' view-shaped statistics) is refused naming how to carry it over.
Never imports `step`.

The package: `_format` (what is on disk: layout and config JSON, cutting
chunks into leaves), `_integrity` (steps, checksums, the metadata's checks),
`_save` (asynchronous saves and their completion, also at exit),
`_restore` (a checkpoint checked and restored onto any mesh and stage),
`_read` (its arrays read: as saved, repacked, or onto the host),
`_export` (plain numpy trees) and `_orbax` (a state as one item of the
caller's own orbax CheckpointManager: `ZeroSave`, `ZeroRestore`).
"""
from zerojax.checkpoint._export import export_params
from zerojax.checkpoint._orbax import ZeroRestore, ZeroSave, ZeroStateHandler
from zerojax.checkpoint._restore import restore
from zerojax.checkpoint._save import save, wait

__all__ = ["ZeroRestore", "ZeroSave", "ZeroStateHandler", "export_params",
           "restore", "save", "wait"]
