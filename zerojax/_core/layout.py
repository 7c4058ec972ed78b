"""ChunkLayout: where every parameter leaf lives inside the flat chunk arrays.
(A little over 400 lines: the packing rules below and the pack / unpack code
that follows them stay in one class, to be read side by side.)

Pure metadata computed from shapes and dtypes only (no device work), plus the
pack (`split`) and unpack (`merge`) functions that move between the ordinary
parameter tree and the chunk arrays. Imports nothing else from the package
but `chunking` (the chunk-size search and the units, which it re-exports).

Packing rules (ColossalAI Gemini's chunks, adapted to SPMD):
  * trainable floating-point leaves are packed in tree order into chunks;
    frozen, non-floating and empty leaves stay outside ("rest"), replicated;
  * a chunk only holds leaves of one dtype, one optimizer class (leaves the
    optimizer treats alike, see `zerojax._core.optim`) and one layer stack;
  * no leaf is split across chunks; a leaf larger than the chunk size gets a
    chunk of its own;
  * a chunk's length is its content rounded up to a multiple of the number of
    shards (zero padding, at most N-1 elements per chunk);
  * leaves stacked over layers (leading layer axis, as `flax.linen.scan`
    produces) are packed per layer: such a chunk has shape [layers, length];
  * a chunk never spans two "units" (unrolled blocks, see `repeated_blocks`):
    a unit's chunks hold its leaves only, so that it can be gathered alone;
  * tensor parallelism (`model_dims`): a leaf the model splits over the
    model axis (M devices) on one of its dims is packed as M rows, row m
    holding model device m's slice of it; such leaves share chunks only with
    each other, of shape `[M, length]` (`[layers, M, length]` when stacked),
    the row axis sharded over the model axis, so that gathering over the
    data axis never crosses it. `length` counts a row's elements.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from zerojax._core.chunking import search_chunk_size, unit_depth


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


# [Note: shaped leaves]
# An optax transformation that reads a tensor's shape (Adafactor's factored
# moments, LAMB's and LARS's per-tensor trust ratios, Muon's Newton-Schulz
# on each matrix) cannot run on flat chunk views. Its leaves are "shaped":
# each alone in its chunk (its label `SHAPED + leaf index`, a class of its
# own), stored and gathered as any chunk, but shown to optax in its own
# shape (`views`: the chunk's first `size` elements reshaped), so that the
# update is plain optax on the real tensor, sharded over the data axis: XLA
# inserts the reductions the transform needs (the rows and columns of a
# factored moment, a norm, a matmul's operands). Its statistics keep the
# shapes optax gives them (`stat_view`, `stat_stored`). The views and the
# statistics are split by `meshes.shaped_spec` (`update._shaped_placed`,
# `state.state_shardings`). Where `tx` multiplies matrices
# (`optim.multiplies_matrices`: Muon's Newton-Schulz) on their largest dim,
# of equal ones the last (the columns `X @ X.T` contracts), not on the rows
# the flat shards hold: each product then contracts over the split dim, one
# all-reduce of the small Gram matrix per iteration, where row shards
# gathered the whole matrix again in each. Any other transform (Adafactor's
# row and column sums, LAMB's norms) reduces as cheaply on the rows, which
# its flat shards already hold: split there, no all-to-all moves them.
# The optimizer probes decide per class of leaves (`optim.shaped_leaves`:
# Muon's matrices shaped, the AdamW rest of its recipe on flat chunks) and
# `build.check_tx` says so once.
SHAPED = 1 << 30


def shaped_labels(labels: Sequence[int], chunked: Sequence[bool]) -> tuple:
  """`labels` with each chunked leaf shaped ([Note: shaped leaves])."""
  return tuple(SHAPED + i if c else label
               for i, (label, c) in enumerate(zip(labels, chunked)))


@dataclasses.dataclass(frozen=True)
class LeafInfo:
  """One leaf of the parameter tree.

  `shape` is the leaf's full shape (with the layer axis for stacked leaves);
  `chunk` is the index of its chunk or -1 when it stays outside the chunks;
  `offset` is where it starts inside the chunk (per layer when stacked).
  """
  path: str
  shape: tuple
  dtype: np.dtype
  chunk: int = -1
  offset: int = 0
  stacked: bool = False
  names: tuple = ()
  model_dim: Optional[int] = None
  model_shards: int = 1

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def local_shape(self) -> tuple:
    """The shape of one model device's slice (the leaf's shape without
    tensor parallelism)."""
    if self.model_dim is None:
      return self.shape
    d = self.model_dim
    return (self.shape[:d] + (self.shape[d] // self.model_shards,)
            + self.shape[d + 1:])

  @property
  def size(self) -> int:
    """Elements the leaf occupies in its chunk (per layer when stacked; per
    model row when split over the model axis)."""
    n = math.prod(self.local_shape)
    return n // self.shape[0] if self.stacked else n


@dataclasses.dataclass(frozen=True)
class Chunk:
  """One chunk array: shape `[length]`, or `[layers, length]` when stacked,
  with a row axis `[..., model_shards, length]` before the last when its
  leaves are split over the model axis (`model_shards > 0`).
  `stack` names the submodule the chunk belongs to: the layer stack
  (`layers > 0`), the unit (an unrolled block, `layers == 0`), or None."""
  length: int
  used: int
  layers: int
  dtype: np.dtype
  leaves: tuple
  label: int
  stack: Optional[str]
  model_shards: int = 0

  @property
  def shape(self) -> tuple:
    return ((self.layers,) if self.layers else ()) + (
        (self.model_shards,) if self.model_shards else ()) + (self.length,)

  def spec(self, data_axes, model_axis: Optional[str] = None):
    """Where the chunk's axes go on the mesh: the last over `data_axes`
    (None: replicated), the model rows over `model_axis`."""
    lead = [None] * (1 if self.layers else 0)
    rows = [model_axis] if self.model_shards else []
    return PartitionSpec(*lead, *rows, data_axes)

  @property
  def copies(self) -> int:
    """Arrays of `length` the chunk holds: layers x model rows."""
    return max(self.layers, 1) * max(self.model_shards, 1)

  @property
  def padding(self) -> int:
    """Padding elements (per layer when stacked)."""
    return self.length - self.used

  @property
  def shaped(self) -> bool:
    """Its one leaf is shown to optax in its own shape ([Note: shaped
    leaves])."""
    return self.label >= SHAPED


def _check_model_dim(path: str, shape: tuple, dim, model_shards: int,
                     stacked: bool) -> None:
  """A leaf's tensor-parallel dim must exist, not be the layer axis, and
  divide over the model axis's devices."""
  if dim is None:
    return
  if not isinstance(dim, (int, np.integer)) or not 0 <= dim < len(shape):
    raise ValueError(f"leaf {path} of shape {shape}: model dim {dim!r} is not "
                     "one of its dims.")
  if stacked and dim == 0:
    raise ValueError(f"leaf {path} of shape {shape} is layer-stacked: its "
                     "layer axis (dim 0) cannot be split over the model axis.")
  if shape[dim] % model_shards:
    raise ValueError(f"leaf {path} of shape {shape} is split over the model "
                     f"axis on dim {dim}, whose {shape[dim]} does not divide "
                     f"into {model_shards} model devices; change the model "
                     "axis's size or the leaf's partitioning.")


def _to_rows(info: LeafInfo, x, xp):
  """Leaf `x` (its full shape) with its model slices as rows: shape
  `[layers?, M, slice...]` (unchanged without tensor parallelism)."""
  if info.model_dim is None:
    return x
  d, m, shape = info.model_dim, info.model_shards, info.shape
  x = xp.reshape(x, shape[:d] + (m, shape[d] // m) + shape[d + 1:])
  return xp.moveaxis(x, d, 1 if info.stacked else 0)


def _from_rows(info: LeafInfo, part, xp, per_layer: bool = False):
  """Inverse of `_to_rows`: the leaf (one layer of it, `per_layer`) from its
  part of a chunk, `[..., M?, size]`."""
  shape = info.shape[1:] if per_layer else info.shape
  if info.model_dim is None:
    return xp.reshape(part, shape)
  d = info.model_dim - (1 if per_layer else 0)
  local = info.local_shape[1:] if per_layer else info.local_shape
  lead = part.ndim - 2   # the layer axis, when the part has one
  x = xp.reshape(part, part.shape[:-1] + local[lead:])
  return xp.reshape(xp.moveaxis(x, lead, d), shape)


def path_names(path) -> tuple:
  """The names of a `jax.tree_util` key path (dict keys, attribute names,
  sequence indices as strings): how leaves are named in a layout and in a
  checkpoint's metadata."""
  names = []
  for k in path:
    for attr in ("key", "name", "idx"):
      if hasattr(k, attr):
        names.append(str(getattr(k, attr)))
        break
  return tuple(names)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
  """Where each leaf of a parameter tree lives in the chunk arrays.

  Build it with `ChunkLayout.build`; it is hashable and static under `jit`.
  """
  treedef: Any
  leaves: tuple
  chunks: tuple
  num_shards: int
  chunk_size: int
  waste: float

  # ---- construction -------------------------------------------------------
  @classmethod
  def build(cls, params: Any, num_shards: int, *, chunk_size: Optional[int] = None,
            trainable: Optional[Sequence[bool]] = None,
            labels: Optional[Sequence[int]] = None, stacked: Sequence[str] = (),
            units: Sequence[str] = (),
            model_dims: Optional[Sequence[Optional[int]]] = None,
            model_shards: int = 1,
            min_chunk_size: int = 2 ** 20, search_range: int = 2 ** 22,
            search_interval: int = 2 ** 12, align: int = 1) -> "ChunkLayout":
    """Computes the layout of `params` (arrays or `jax.ShapeDtypeStruct`s).

    Args:
      params: the parameter tree; only shapes and dtypes are read.
      num_shards: devices on the data axis; chunk lengths are multiples of it.
      chunk_size: fixed chunk capacity in elements; None searches it.
      trainable: per leaf (tree order), False keeps the leaf out of chunks.
      labels: per leaf, the optimizer class; chunks never mix classes.
      stacked: the layer stacks, whose leaves have a leading layer axis: a
        path component (`ZeroConfig.stacked`), or a path from the root,
        `"encoder/layers"` (`chunking.scanned_stacks`).
      units: unrolled blocks (`repeated_blocks`: a name on the path, or a
        path from the root, `"h/0"`): a chunk never holds leaves of two
        units, or of a unit and others.
      model_dims: per leaf, the dim the model splits over its model axis
        (tensor parallelism), or None; `model_shards`: that axis's devices.
      min_chunk_size, search_range, search_interval: the search's candidates.
      align: each leaf starts at a multiple of `align` elements, and each
        device's shard is whole multiples of it: quantized collectives'
        blocks (`ZeroConfig.quantize_block`) then never span two leaves,
        so a leaf's values set no other leaf's scale. The gaps are
        padding (zeros, counted in `Chunk.padding`).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    n = len(flat)
    trainable = [True] * n if trainable is None else list(trainable)
    labels = [0] * n if labels is None else list(labels)
    model_dims = [None] * n if model_dims is None else list(model_dims)
    if len(trainable) != n or len(labels) != n or len(model_dims) != n:
      raise ValueError("trainable/labels/model_dims must have one entry per "
                       "leaf.")
    infos, keys = [], []
    for (path, leaf), train, label, dim in zip(flat, trainable, labels,
                                               model_dims):
      shape, dtype = tuple(np.shape(leaf)), np.dtype(leaf.dtype)
      names = path_names(path)
      stack = next((s for s in stacked if unit_depth(names, s)), None)
      if stack is not None and not shape:
        raise ValueError(f"leaf {jax.tree_util.keystr(path)} is under stacked "
                         f"module {stack!r} but is a scalar (no layer axis).")
      _check_model_dim(jax.tree_util.keystr(path), shape, dim, model_shards,
                       stack is not None)
      info = LeafInfo(jax.tree_util.keystr(path), shape, dtype,
                      stacked=stack is not None, names=names, model_dim=dim,
                      model_shards=model_shards if dim is not None else 1)
      if train and jnp.issubdtype(dtype, jnp.complexfloating):
        raise ValueError(
            f"parameter {info.path} is {dtype.name}: zerojax's chunks hold "
            "real numbers, so it would never be trained. Store it as two "
            "real leaves (real and imaginary parts), or freeze it "
            "(frozen=...) to keep it as it is.")
      chunked = (train and jnp.issubdtype(dtype, jnp.floating) and info.size > 0)
      if chunked and label >= SHAPED and dim is not None:
        raise ValueError(
            f"parameter {info.path} is split over the model axis (tensor "
            "parallelism), and the optimizer reads whole tensors ([Note: "
            "shaped leaves]): the two do not combine yet; train without a "
            "model axis, or use an element-wise optimizer.")
      unit = (None if stack is not None else
              next((u for u in units if unit_depth(names, u)), None))
      infos.append(info)
      keys.append((stack or unit, shape[0] if stack else 0, int(label),
                   dtype.name, model_shards if dim is not None else 0)
                  if chunked else None)
    modules = {name for info in infos for name in info.names[:-1]}
    unknown = [s for s in stacked
               if not any(unit_depth(i.names, s) for i in infos)]
    if unknown:
      # a typo would silently turn per-layer chunking off
      raise ValueError(f"Blocks(stacked={tuple(stacked)!r}): no submodule is named "
                       f"{', '.join(map(repr, unknown))}; the submodules are "
                       f"{sorted(modules)[:40]}.")
    group_keys = list(dict.fromkeys(k for k in keys if k is not None))
    groups = [[i for i, k in enumerate(keys) if k == g] for g in group_keys]
    for stack in stacked:
      counts = {k[1] for k in keys if k is not None and k[0] == stack}
      if len(counts) > 1:
        raise ValueError(f"leaves under stacked module {stack!r} disagree on "
                         f"the layer count (leading axis): {sorted(counts)}.")
    waste = 0.0
    # a leaf's room: its size, up to whole quantization blocks (`align`)
    room = lambda i: _round_up(infos[i].size, align)
    if chunk_size is None:
      sizes = [[room(i) for i in members] for members in groups]
      if groups:
        chunk_size, waste = search_chunk_size(
            sizes, min_chunk_size=min_chunk_size, search_range=search_range,
            search_interval=search_interval)
      else:
        chunk_size = min_chunk_size
    chunks = []
    for (stack, layers, label, dtype_name, rows), members in zip(group_keys,
                                                                 groups):
      current, end = [], 0   # end: where the next leaf may start

      def close():
        nonlocal current, end
        if current:
          chunks.append(Chunk(_round_up(end, num_shards * align),
                              sum(infos[i].size for i in current), layers,
                              np.dtype(dtype_name), tuple(current), label, stack,
                              rows))
        current, end = [], 0

      for i in members:
        size = room(i)
        if size > chunk_size:
          close()
          current, end = [i], size
          infos[i] = dataclasses.replace(infos[i], chunk=len(chunks), offset=0)
          close()
          continue
        if end + size > chunk_size:
          close()
        infos[i] = dataclasses.replace(infos[i], chunk=len(chunks), offset=end)
        current.append(i)
        end += size
      close()
    if not groups:
      waste = 0.0
    elif waste == 0.0 and chunks:
      cap = sum(max(c.used, chunk_size) for c in chunks)
      waste = 1.0 - sum(c.used for c in chunks) / cap
    return cls(treedef, tuple(infos), tuple(chunks), int(num_shards),
               int(chunk_size), float(waste))

  # ---- derived metadata ---------------------------------------------------
  @property
  def rest_indices(self) -> tuple:
    """Leaves kept outside the chunks (frozen, non-floating, empty)."""
    return tuple(i for i, info in enumerate(self.leaves) if info.chunk < 0)

  @property
  def labels(self) -> tuple:
    """Per leaf, the optimizer class it was packed with (0 outside chunks),
    as `build(labels=...)` takes them."""
    return tuple(self.chunks[i.chunk].label if i.chunk >= 0 else 0
                 for i in self.leaves)

  @property
  def num_chunked_elements(self) -> int:
    """Ψ: trainable elements (all layers), padding excluded."""
    return sum(c.used * c.copies for c in self.chunks)

  @property
  def num_split_elements(self) -> int:
    """Of Ψ, the elements of leaves split over the model axis (tensor
    parallelism), all model rows counted."""
    return sum(c.used * c.copies for c in self.chunks if c.model_shards)

  @property
  def num_padding_elements(self) -> int:
    return sum(c.padding * c.copies for c in self.chunks)

  def representative(self, c: int) -> int:
    """The leaf whose optimizer view carries chunk `c` (the highest rank)."""
    members = self.chunks[c].leaves
    return max(members, key=lambda i: (self.leaves[i].ndim, -i))

  def stack_prefix(self, c: int) -> tuple:
    """Path components down to (and including) the stack or unit of chunk
    `c`."""
    chunk = self.chunks[c]
    names = self.leaves[chunk.leaves[0]].names
    return names[:unit_depth(names, chunk.stack)]

  def layer_tree(self, c: int, full: Any, tree: Optional[dict] = None) -> dict:
    """One layer's (or unit's) parameters (nested dicts, paths relative to
    the stack or unit) from chunk `c`'s gathered array `full` (shape
    `[length]`: one layer of a layer chunk, or a unit's chunk)."""
    return self.place_layer_leaves(c, self.unpack_chunk(
        c, full, per_layer=bool(self.chunks[c].layers)), tree)

  def place_layer_leaves(self, c: int, leaves: Sequence[Any],
                         tree: Optional[dict] = None) -> dict:
    """`layer_tree` of chunk `c`'s leaves already cut from its array."""
    tree = {} if tree is None else tree
    depth = len(self.stack_prefix(c))
    for i, leaf in zip(self.chunks[c].leaves, leaves):
      node = tree
      for name in self.leaves[i].names[depth:-1]:
        node = node.setdefault(name, {})
      node[self.leaves[i].names[-1]] = leaf
    return tree

  def summary(self) -> str:
    """What a user can act on: chunks (one collective each per step), the
    padding they cost, and the leaves kept out. A chunk is as long as its
    leaves (rounded up to the device count), not as the capacity the search
    chose, so the capacity's unused share is not a cost and is not shown."""
    psi, pad = self.num_chunked_elements, self.num_padding_elements
    largest = max((c.length for c in self.chunks), default=0)
    out = (f"{len(self.chunks)} chunk(s) over {len(self.leaves)} leaves: "
           f"{psi:,} trainable elements + {pad:,} padding "
           f"({100 * pad / max(psi + pad, 1):.2f}%); largest chunk "
           f"{largest:,} elements (capacity {self.chunk_size:,})")
    kept = len(self.rest_indices)
    if kept:
      out += f"; {kept} leaves outside the chunks (frozen, integer or empty)"
    return out

  # ---- pack / unpack ------------------------------------------------------
  def _leaves_of(self, tree) -> list:
    leaves = self.treedef.flatten_up_to(tree)
    return list(leaves)

  def split(self, tree: Any, dtype: Any = None) -> tuple:
    """Packs a tree into `(chunks, rest)`.

    Args:
      tree: a tree with this layout's structure and shapes.
      dtype: cast chunks to this dtype (default: each chunk's own dtype).

    Returns:
      `chunks`, a tuple of arrays of shapes `chunk.shape`, zero padded, and
      `rest`, the tuple of leaves kept outside the chunks.
    """
    leaves = self._leaves_of(tree)
    chunks = tuple(self.pack_chunk(c, leaves, dtype)
                   for c in range(len(self.chunks)))
    rest = tuple(leaves[i] for i in self.rest_indices)
    return chunks, rest

  def pack_chunk(self, c: int, leaves: Sequence[Any], dtype: Any = None,
                 xp: Any = jnp):
    """Chunk `c` built from `leaves` (indexed like `self.leaves`); with
    `xp=numpy`, from host arrays on the host, without device work."""
    chunk = self.chunks[c]
    dt = chunk.dtype if dtype is None else dtype
    lead = chunk.shape[:-1]
    members, parts = iter(chunk.leaves), []
    for kind, n in self._pieces(c):
      if kind == "leaf":
        i = next(members)
        parts.append(xp.reshape(_to_rows(self.leaves[i], leaves[i], xp),
                                lead + (-1,)).astype(dt))
      elif n:
        parts.append(xp.zeros(lead + (n,), dt))
    return xp.concatenate(parts, axis=-1) if len(parts) > 1 else parts[0]

  def _pieces(self, c: int) -> list:
    """Chunk `c` from offset 0 to its length: `("gap", n)` before each leaf
    and after the last (zero padding, `n` may be 0), `("leaf", size)`
    between, in `chunks[c].leaves` order."""
    out, end = [], 0
    for i in self.chunks[c].leaves:
      info = self.leaves[i]
      out += [("gap", info.offset - end), ("leaf", info.size)]
      end = info.offset + info.size
    return out + [("gap", self.chunks[c].length - end)]

  def unpack_chunk(self, c: int, arr: Any, per_layer: bool = False) -> list:
    """The leaves of chunk `c` (in `chunks[c].leaves` order) cut from `arr`,
    the chunk (shape `chunk.shape`, any dtype) or, with `per_layer`, one
    layer `[length]` of a layer chunk (leaves without their layer axis).

    One `lax.split` of the last axis, not a slice per leaf: the transpose of
    a slice is a pad to the full chunk length, so the gradient of a chunk
    cut by slices sums one full-length array per leaf, O(leaves x length);
    the transpose of the split is one concatenate of the leaves' gradients
    (zeros for a leaf the loss does not use), O(length), the same values as
    `pack_chunk` of them.
    """
    chunk = self.chunks[c]
    infos = [self.leaves[i] for i in chunk.leaves]
    pieces = [(kind, n) for kind, n in self._pieces(c) if n]
    parts = jax.lax.split(arr, [n for _, n in pieces], axis=-1)
    parts = [part for part, (kind, _) in zip(parts, pieces) if kind == "leaf"]
    return [_from_rows(info, part, jnp, per_layer)
            for part, info in zip(parts, infos)]

  def host_leaf(self, i: int, chunk: np.ndarray) -> np.ndarray:
    """Leaf `i` cut from a host copy of its chunk (shape
    `chunks[leaves[i].chunk].shape`): `unpack_chunk` without device work."""
    info = self.leaves[i]
    return _from_rows(info, chunk[..., info.offset:info.offset + info.size],
                      np)

  def merge(self, chunks: Sequence[Any], rest: Sequence[Any],
            dtype: Any = "leaf", skip: frozenset = frozenset(),
            leaves: Optional[dict] = None) -> Any:
    """Unpacks `(chunks, rest)` into the tree.

    Args:
      chunks: full (gathered) chunk arrays.
      rest: the leaves kept outside the chunks.
      dtype: "leaf" restores each chunk leaf's dtype; None keeps the
        chunk's dtype (the compute dtype inside a step); or an explicit
        dtype for the chunks' leaves. `rest` is taken as it is (frozen
        weights as they are read: `zerojax._core.frozen.restored`).
      skip: chunk indices whose leaves are left as None.
      leaves: `{chunk index: its leaves}` already cut (in `unpack_chunk`
        order); those chunks' entries of `chunks` are not read.
    """
    leaves = leaves or {}
    out = [None] * len(self.leaves)
    for c, (chunk, arr) in enumerate(zip(self.chunks, chunks)):
      if c in skip:
        continue
      cut = leaves[c] if c in leaves else self.unpack_chunk(c, arr)
      for i, leaf in zip(chunk.leaves, cut):
        info = self.leaves[i]
        if isinstance(dtype, str) and dtype == "leaf":
          leaf = leaf.astype(info.dtype)
        elif dtype is not None:
          leaf = leaf.astype(dtype)
        out[i] = leaf
    for i, leaf in zip(self.rest_indices, rest):
      out[i] = leaf
    return jax.tree_util.tree_unflatten(self.treedef, out)

  # ---- optimizer views ----------------------------------------------------
  def view_shape(self, c: int) -> tuple:
    """Shape of chunk `c` as its representative leaf shows it to optax.

    Same rank as the representative leaf (so masks that test `ndim` see the
    original rank), all elements on the last axis.
    """
    chunk = self.chunks[c]
    if chunk.shaped:
      return self.leaves[chunk.leaves[0]].shape
    rank = self.leaves[self.representative(c)].ndim
    lead = (chunk.layers,) if chunk.layers else ()
    rank -= len(lead)
    if chunk.model_shards and rank >= 2:   # the model rows kept as an axis
      return lead + (1,) * (rank - 2) + (chunk.model_shards, chunk.length)
    return lead + (1,) * max(rank - 1, 0) + (chunk.length *
                                             max(chunk.model_shards, 1),)

  def views(self, chunks: Sequence[Any], fill_dtype: Any = None,
            only: Optional[frozenset] = None, compact: bool = False) -> Any:
    """The tree optax sees: the original structure, each chunk held by its
    representative leaf (reshaped, see `view_shape`), every other leaf empty
    (a scalar as shape (0,): no rank-0 array is empty, and a scalar would
    carry optimizer state and an update of its own through every step).

    An element-wise optax transformation applied to this tree is the same as
    applied to the original tree, element by element. `only`: the chunks to
    show (the others' representatives empty too; their entries of `chunks`
    are not read), for an update of some chunks at a time. `compact`: None
    instead of each empty leaf (the compact views, `optstate.update_compact`).
    """
    out, empty = [], {}
    reps = {self.representative(c): c for c in range(len(self.chunks))
            if only is None or c in only}
    for i, info in enumerate(self.leaves):
      if i in reps:
        c = reps[i]
        out.append(self._shaped_view(c, chunks[c]) if self.chunks[c].shaped
                   else jnp.reshape(chunks[c], self.view_shape(c)))
      elif compact:
        out.append(None)
      else:  # one (immutable) empty array per rank and dtype, shared
        dt = info.dtype if fill_dtype is None else fill_dtype
        key = (info.ndim, np.dtype(dt))
        if key not in empty:
          empty[key] = jnp.zeros((0,) * max(info.ndim, 1), dt)
        out.append(empty[key])
    return jax.tree_util.tree_unflatten(self.treedef, out)

  def from_views(self, tree: Any, only: Optional[frozenset] = None) -> tuple:
    """Inverse of `views`: the chunk arrays held by the representatives
    (None for chunks outside `only`)."""
    leaves = self._leaves_of(tree)
    return tuple(None if only is not None and c not in only else
                 self._shaped_chunk(c, leaves[self.representative(c)])
                 if chunk.shaped else
                 jnp.reshape(leaves[self.representative(c)], chunk.shape)
                 for c, chunk in enumerate(self.chunks))

  def _shaped_view(self, c: int, x):
    """A shaped chunk's leaf in its own shape ([Note: shaped leaves])."""
    info = self.leaves[self.chunks[c].leaves[0]]
    if self.chunks[c].padding:
      x = x[..., :info.size]
    return jnp.reshape(x, info.shape)

  def _shaped_chunk(self, c: int, x):
    """Inverse of `_shaped_view`: the chunk, its padding zero."""
    chunk = self.chunks[c]
    lead = (chunk.layers,) if chunk.layers else ()
    x = jnp.reshape(x, lead + (chunk.used,))
    if chunk.padding:
      x = jnp.pad(x, [(0, 0)] * len(lead) + [(0, chunk.padding)])
    return x

  def stat_view(self, c: int, x):
    """Chunk `c`'s optimizer statistic `x` (as stored) as optax sees it:
    the view's shape, or a shaped chunk's own ([Note: shaped leaves])."""
    return x if self.chunks[c].shaped else jnp.reshape(x, self.view_shape(c))

  def stat_stored(self, c: int, x):
    """Inverse of `stat_view`: in the chunk's shape, a shaped chunk's as
    optax gave it."""
    return x if self.chunks[c].shaped else jnp.reshape(x, self.chunks[c].shape)
