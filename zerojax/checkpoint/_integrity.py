"""What makes a checkpoint trustworthy: step numbers, the metadata's own
checksum and schema, a layout that fits the saved arrays, and a checksum of
every saved array.

Every problem is one `ValueError` naming the path and what is wrong: a
restore never falls back silently and never reads a layout that would cut
the chunks wrongly.

The array checksum is the sum of the array's 32-bit words (16- and 8-bit
values widened) modulo 2**32: independent of how the array is sharded or
in which order its parts are added, so it is computed where the array lies
(on an accelerator by one reduction, on CPU devices by numpy over the
shards, in place) at save and recomputed on restore. It
catches any single flipped bit and any changed value that does not cancel
out; it is no defence against deliberate edits.
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from zerojax.checkpoint._format import (CHUNK_FORMATS, READ_FORMATS,
                                        RETIRED_FORMATS, by_path,
                                        saved_list)

# the metadata file of a state saved as an item of the caller's own orbax
# CheckpointManager, beside its arrays (`_orbax`)
ITEM_META = "zerojax.json"
_WORD = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}


def check_step(step: Any, caller: str) -> int:
  """`step` as an int; TypeError/ValueError naming it unless it is one >= 0."""
  if isinstance(step, bool) or not isinstance(step, (int, np.integer)):
    raise TypeError(f"{caller}(step={step!r}): a step is a non-negative int, "
                    f"not {type(step).__name__}.")
  if step < 0:
    raise ValueError(f"{caller}(step={step}): a step is a non-negative int.")
  return int(step)


# ---- array checksums -----------------------------------------------------------
def _words(x):
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32)
  return jax.lax.bitcast_convert_type(
      x, _WORD[x.dtype.itemsize]).astype(jnp.uint32)


@jax.jit
def _device_sums(arrays: dict) -> dict:
  return {k: jnp.sum(_words(x), dtype=jnp.uint32) for k, x in arrays.items()}


def checksums(tree) -> dict:
  """{array name: checksum} of a tree of jax arrays. Arrays on accelerators
  are reduced there; arrays on CPU devices are summed with numpy over their
  distinct shards, in place (XLA's CPU integer reduction is about 25x
  slower than numpy's: 0.9 s against 0.05 s for GPT-2 small's state)."""
  arrays = by_path(tree)
  # numpy arrays (a disk tier's maps of its files) are summed as they are
  in_numpy = {k: x for k, x in arrays.items() if isinstance(x, np.ndarray)}
  arrays = {k: x for k, x in arrays.items() if k not in in_numpy}
  on_cpu = sorted(k for k, x in arrays.items()
                  if all(d.platform == "cpu" for d in x.sharding.device_set))
  out = {k: int(v) for k, v in jax.device_get(_device_sums(
      {k: x for k, x in arrays.items() if k not in on_cpu})).items()}
  partial = np.array([sum(_host_sum(s.data) for s in arrays[k].addressable_shards
                          if s.replica_id == 0) % 2 ** 32 for k in on_cpu],
                     np.uint32)
  if jax.process_count() > 1:   # each process holds some of the shards
    partial = np.sum(np.asarray(multihost_utils.process_allgather(partial),
                                np.uint64), axis=0)
  out.update(zip(on_cpu, (int(v) % 2 ** 32 for v in partial)))
  out.update({k: _host_sum(x) % 2 ** 32 for k, x in in_numpy.items()})
  return out


def _host_sum(x) -> int:
  x = np.ascontiguousarray(x).reshape(-1)
  words = x.astype(np.uint32) if x.dtype == np.bool_ else x.view(
      _WORD[x.dtype.itemsize])
  return int(np.sum(words, dtype=np.uint32))


def verify(path: str, saved_sums: dict, tree, on_host: bool) -> None:
  """Raises naming `path` and the array when a read array's checksum is not
  the saved one. `on_host`: `tree` holds numpy arrays."""
  if not saved_sums:
    return   # written before checksums (2026-11-23)
  arrays = by_path(tree)
  read = ({k: _host_sum(x) for k, x in arrays.items()} if on_host
          else checksums(arrays))
  bad = sorted(k for k in saved_sums if read.get(k) != saved_sums[k])
  if bad:
    raise ValueError(
        f"checkpoint {path} is corrupt: {len(bad)} array(s) differ from what "
        f"was saved ({', '.join(bad[:5])}): the files changed after the save "
        "(a disk fault or an edit). Restore another step (step=...).")


# ---- the metadata --------------------------------------------------------------
def _digest(meta: dict) -> str:
  body = {k: v for k, v in meta.items() if k != "sha256"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def seal(meta: dict) -> dict:
  """`meta` with the SHA-256 of its JSON, checked on every read."""
  return {**meta, "sha256": _digest(meta)}


def saved_steps(directory: str) -> list:
  """The steps in `directory`, ascending: entries named as orbax names them
  (`str(step)`; `str.isdigit` alone also takes '²', which `int` refuses)."""
  return sorted(int(name) for name in os.listdir(directory)
                if name.isascii() and name.isdigit() and name == str(int(name)))


def read_meta(step_dir: str) -> dict:
  """The checked metadata of a step's directory (every format zerojax wrote
  has it)."""
  return read_meta_file(os.path.join(step_dir, "meta", "metadata"))


def read_meta_file(path: str) -> dict:
  """The checked metadata in the JSON file `path`: a step's `meta` item, or
  the `zerojax.json` of a state saved as an item of the caller's own orbax
  CheckpointManager (`_orbax`)."""
  if not os.path.exists(path):
    raise ValueError(f"{path} is missing: the step's chunk layout and "
                     "configuration are unknown")
  try:
    with open(path) as f:
      meta = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"checkpoint metadata {path} is unreadable: {e}") from None
  if not isinstance(meta, dict) or not isinstance(meta.get("format"), str):
    raise ValueError(f"checkpoint metadata {path} has no format: not a "
                     "zerojax checkpoint's metadata.")
  if "sha256" in meta and meta["sha256"] != _digest(meta):
    raise ValueError(f"checkpoint metadata {path} fails its checksum: it was "
                     "changed after the save.")
  if meta["format"] in RETIRED_FORMATS:
    raise ValueError(f"checkpoint metadata {path} has format "
                     f"{meta['format']!r}, {RETIRED_FORMATS[meta['format']]}.")
  if meta["format"] not in READ_FORMATS:
    raise ValueError(f"checkpoint metadata {path} has format "
                     f"{meta['format']!r}, which this zerojax does not know "
                     f"(it reads {', '.join(READ_FORMATS)}): written by a newer "
                     "zerojax? Upgrade zerojax to read it.")
  missing = [k for k in ("config", "num_shards") + (
      ("layout",) if meta["format"] in CHUNK_FORMATS else ()) if k not in meta]
  if missing:
    raise ValueError(f"checkpoint metadata {path} lacks {', '.join(missing)}.")
  if meta["format"] in CHUNK_FORMATS:
    problem = _layout_problem(meta["layout"])
    if problem:
      raise ValueError(f"checkpoint metadata {path}: the layout is "
                       f"inconsistent: {problem}.")
  return meta


def _layout_problem(layout: Any) -> str:
  """What makes a layout JSON cut its chunks wrongly, or ''."""
  try:
    leaves, chunks = layout["leaves"], layout["chunks"]
    members = {}
    for i, leaf in enumerate(leaves):
      c = leaf["chunk"]
      if c < 0:
        continue
      if c >= len(chunks):
        return f"leaf {leaf['path']} names chunk {c} of {len(chunks)}"
      shape = leaf["shape"][1:] if leaf["stacked"] else leaf["shape"]
      # a leaf split over the model axis fills 1/M of its size in each row
      rows = leaf.get("model_shards", 1)
      members.setdefault(c, []).append(
          (leaf["offset"], int(np.prod(shape, dtype=np.int64)) // rows,
           leaf["path"], i))
    for c, chunk in enumerate(chunks):
      mine = sorted(members.get(c, []))
      if sorted(i for *_, i in mine) != sorted(chunk["leaves"]):
        return f"chunk {c}'s leaves disagree with the leaves' chunks"
      if not 0 <= chunk["used"] <= chunk["length"]:
        return f"chunk {c} uses {chunk['used']} of {chunk['length']} elements"
      # leaves may start at aligned offsets (whole quantization blocks), so
      # they end within the chunk's length; `used` counts their elements
      end = 0
      for offset, size, path, _ in mine:
        if offset < end:
          return f"leaf {path} at offset {offset} overlaps the leaf before it"
        end = offset + size
        if end > chunk["length"]:
          return (f"leaf {path} ends at {end}, past chunk {c}'s "
                  f"{chunk['length']} elements")
      if sum(size for _, size, *_ in mine) != chunk["used"]:
        return (f"chunk {c}'s leaves hold "
                f"{sum(size for _, size, *_ in mine)} elements, not the "
                f"{chunk['used']} it says it uses")
  except (KeyError, TypeError, IndexError) as e:
    return f"malformed ({type(e).__name__}: {e})"
  return ""


def check_arrays(path: str, layout: dict, saved_tree: dict) -> None:
  """The saved chunk arrays have the shapes the layout says (orbax
  metadata `saved_tree` of the state item at `path`)."""
  chunks = layout["chunks"]
  shapes = [tuple(np.shape(x)) for x in saved_list(saved_tree.get("master", []))]
  want = [tuple(n for n in (c["layers"], c.get("model_shards", 0)) if n)
          + (c["length"],) for c in chunks]
  if shapes != want:
    raise ValueError(f"checkpoint {path}: the saved chunks have shapes "
                     f"{shapes[:4]}... but the metadata's layout says "
                     f"{want[:4]}...: metadata and arrays do not belong "
                     "together.")
