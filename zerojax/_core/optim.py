"""optax on flat chunks: which leaves the optimizer treats alike, and the
checks that a transformation is element-wise (and separable by chunk, for
offload). The optimizer state itself: `opt_state`.

The user's `tx` never sees a chunk as a bare 1-D array. It sees the original
parameter tree (`ChunkLayout.views`): each chunk is held by one of its own
leaves, with that leaf's rank, and every other leaf is empty. Masks and
labels written on the original tree (`optax.adamw(mask=...)`, `optax.masked`,
`optax.multi_transform`) therefore decide per chunk as they would per leaf,
provided a chunk only holds leaves the optimizer treats alike. `leaf_labels`
finds those classes by running `tx` on a small surrogate of the tree, and
`check_elementwise` refuses transformations that read whole tensors (LAMB's
trust ratio, Adafactor's factored moments) instead of letting them be
silently wrong on chunks.
"""
from __future__ import annotations

import functools
import logging
from typing import NamedTuple, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zerojax._core import optstate
from zerojax._core.layout import ChunkLayout, shaped_labels

_log = logging.getLogger("zerojax")

# steps per probe run: the first shows what reads whole tensors or moves
# zeros, the second what the optimizer state carries (sgd with and without
# momentum differ only there); each step is an eager pass over every leaf
_PROBE_STEPS = 2


def _hashable(key) -> bool:
  try:
    hash(key)
  except TypeError:  # a tx holding unhashable parts
    return False
  return True


def _tree_key(tx, treedef, leaves) -> tuple:
  """`tx` and a tree by its structure, shapes and dtypes (`leaves`: arrays,
  shape structs or a layout's `LeafInfo`s): what a probe's answer depends
  on."""
  return (tx, treedef, tuple((tuple(x.shape), np.dtype(x.dtype))
                             for x in leaves))


def _key_of(tx, abstract_params) -> tuple:
  leaves, treedef = jax.tree_util.tree_flatten(abstract_params)
  return _tree_key(tx, treedef, leaves)


def _cached(probe):
  """A probe's answer depends only on `tx` and the tree's structure, shapes
  and dtypes: computed once per (tx, tree), since `shard`, `create` and
  `restore` each ask twice."""
  answers = {}

  @functools.wraps(probe)
  def cached(tx, abstract_params, *args):
    key = (_key_of(tx, abstract_params),
           tuple(tuple(a) if isinstance(a, list) else a for a in args))
    if not _hashable(key):  # probe every time
      return probe(tx, abstract_params, *args)
    if key not in answers:
      answers[key] = probe(tx, abstract_params, *args)
    return answers[key]

  return cached


def _surrogate_shapes(abstract_params) -> list:
  """Each leaf with every axis capped at 3: same rank, a few elements."""
  return [tuple(min(d, 3) for d in np.shape(x))
          for x in jax.tree_util.tree_leaves(abstract_params)]


def _run(tx, params, grads_seq, full_params=None):
  """Updates of `tx` over a sequence of gradients (plain optax semantics).
  With `full_params` (the full views of compact views `params`), the state
  is `tx.init`'s of those and each update `optstate.update_compact`."""
  if full_params is None:
    state, update = tx.init(params), tx.update
  else:
    state = tx.init(full_params)
    update = functools.partial(optstate.update_compact, tx,
                               skeleton=jax.eval_shape(tx.init, params))
  outs = []
  for grads in grads_seq:
    updates, state = update(grads, state, params)
    params = optax.apply_updates(params, updates)
    outs.append(updates)
  return outs


def _run_probe(probe, *args):
  """`probe(*args)` on a few-element surrogate, run eagerly on the host CPU
  whatever the default backend and fetched as numpy.

  Eagerly, not compiled: a probe runs once per (tx, tree), and compiling
  `tx` over every leaf of the tree costs more than plain `jax.jit`'s
  compile of the whole training step, while each eager operation on a
  few elements reuses a program compiled once per shape
  (docs/decisions.md, "The optimizer probes run eagerly")."""
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    return jax.device_get(probe(*args))


def _tree_updates(tx, treedef, params: list, grads: list) -> list:
  """Per step, the update leaves of `tx` on the tree of `params` (leaves;
  `grads`: per step, leaves)."""
  unflat = lambda ls: jax.tree_util.tree_unflatten(treedef, ls)
  return _run_probe(
      lambda p, gs: [treedef.flatten_up_to(u)
                     for u in _run(tx, unflat(p), [unflat(g) for g in gs])],
      params, grads)


def _chunk_updates(tx, runs: tuple, params: list, grads: list,
                   compact: bool = False) -> list:
  """Per run `(layout, only)`: per step, the update chunks of `tx` on the
  views of the chunks in `only` (None: all; None for the others) packed
  from `params` (leaves; `grads`: per step, leaves); on compact views with
  `compact`, as the step then updates. The packing happens on the host, in
  numpy."""
  def probe(packed):
    outs = []
    for (layout, only), (chunks, chunk_grads) in zip(runs, packed):
      views = lambda cs, layout=layout, only=only: layout.views(
          cs, only=only, compact=compact)
      full = layout.views(chunks, only=only) if compact else None
      outs.append([layout.from_views(u, only) for u in
                   _run(tx, views(chunks), [views(g) for g in chunk_grads],
                        full)])
    return outs

  pack = lambda layout, leaves: [layout.pack_chunk(c, leaves, xp=np)
                                 for c in range(len(layout.chunks))]
  packed = [(pack(layout, params), [pack(layout, g) for g in grads])
            for layout, _ in runs]
  return _run_probe(probe, packed)


_SHARD_COUNTS = (2, 3, 5, 7, 11, 13)


def _packings(surrogate, trainable, labels, stacked) -> tuple:
  """The runs (`_chunk_updates`) of `tx` whose updates `_compare` reads:
  each class of leaves in one chunk (exposes per-tensor reductions), over
  the first shard count that leaves every chunk padded (exposes updates
  that move zeros); where none does, that packing over 2 shards and the
  small padded one (`_small_packing`)."""
  size = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(surrogate))
  first = None
  for shards in _SHARD_COUNTS:
    whole = _packing(surrogate, trainable, labels, stacked, shards, size + 1)
    if all(c.padding for c in whole[0].chunks):
      return (whole,)
    first = first or whole
  return first, _small_packing(surrogate, trainable, labels, stacked)


def _small_packing(surrogate, trainable, labels, stacked) -> tuple:
  """A run of `tx` on small padded chunks over 2 shards (many chunks)."""
  return _packing(surrogate, trainable, labels, stacked, 2, 5)


def _packing(surrogate, trainable, labels, stacked, shards: int,
             chunk_size: int) -> tuple:
  """A run of `tx` on all chunks of the surrogate packed over `shards`."""
  return (ChunkLayout.build(surrogate, num_shards=shards,
                            chunk_size=chunk_size, trainable=trainable,
                            labels=labels, stacked=stacked), None)


def _is_float(leaf) -> bool:
  return jnp.issubdtype(leaf.dtype, jnp.floating)


@_cached
def leaf_labels(tx, abstract_params, trainable: Sequence[bool]) -> tuple:
  """Optimizer class of each leaf: leaves with equal labels are updated by the
  same element-wise rule (same mask decisions, same hyper-parameters).

  Every element of every leaf gets the same parameter and gradient values;
  leaves whose updates then differ are treated differently by `tx`.
  """
  leaves, treedef = jax.tree_util.tree_flatten(abstract_params)
  shapes = _surrogate_shapes(abstract_params)
  params = [np.full(s, 0.75, x.dtype) for s, x in zip(shapes, leaves)]
  grads = [[np.full(s, v, x.dtype) if t else np.zeros(s, x.dtype)
            for s, x, t in zip(shapes, leaves, trainable)]
           for v in (0.3, -0.55, 0.9)[:_PROBE_STEPS]]
  outs = _tree_updates(tx, treedef, params, grads)
  signatures = {}
  labels = []
  for i, (x, t) in enumerate(zip(leaves, trainable)):
    if not (t and _is_float(x)):
      labels.append(0)
      continue
    sig = tuple(
        None if np.size(leaf) == 0 else
        float(np.format_float_positional(np.ravel(np.asarray(leaf, np.float32))[0],
                                         precision=6, unique=False, fractional=False))
        for leaf in (o[i] for o in outs))
    labels.append(signatures.setdefault(sig, len(signatures)))
  return tuple(labels)


def _multiplies(jaxpr) -> bool:
  """Whether `jaxpr` (or one inside it) has a matrix product: a
  `dot_general` with a result of rank 2 or more (an inner product, a
  norm's `vdot`, is not one)."""
  for eqn in jaxpr.eqns:
    if (eqn.primitive.name == "dot_general"
        and len(eqn.outvars[0].aval.shape) >= 2):
      return True
    for value in eqn.params.values():   # inner jaxprs: jit, scan, cond...
      for inner in value if isinstance(value, (tuple, list)) else (value,):
        inner = getattr(inner, "jaxpr", inner)
        if hasattr(inner, "eqns") and _multiplies(inner):
          return True
  return False


@_cached
def _multiplies_matrices(tx, abstract_params) -> bool:
  try:
    traced = jax.make_jaxpr(lambda p: tx.update(p, tx.init(p), p))(
        abstract_params)
  except Exception as e:  # noqa: BLE001 - a tx that needs more (extra args)
    _log.info("optax transformation %r could not be traced alone (%s): its "
              "shaped leaves are split on their rows.", transform_name(tx),
              str(e).splitlines()[0] if str(e) else type(e).__name__)
    return False
  return _multiplies(traced.jaxpr)


def multiplies_matrices(tx, layout: ChunkLayout) -> bool:
  """Whether `tx`'s update on the real tree multiplies matrices (Muon's
  Newton-Schulz products), traced once per tx and tree, nothing run: its
  shaped leaves are then split on the dim the products contract
  (`meshes.shaped_spec`, [Note: shaped leaves]). Where `tx` cannot be
  traced alone (it asks for more arguments), no, and that is logged."""
  abstract = jax.tree_util.tree_unflatten(layout.treedef, [
      jax.ShapeDtypeStruct(info.shape, info.dtype) for info in layout.leaves])
  return _multiplies_matrices(tx, abstract)


def transform_name(tx) -> str:
  fn = getattr(tx, "update", None)
  name = getattr(fn, "__qualname__", type(tx).__name__)
  return name.split(".<locals>")[0]


def _inner_transforms(tx) -> list:
  """Transformations a combinator (chain, masked, ...) closes over; used only
  to name the part of a refused `tx`, so a miss just names the whole."""
  update = getattr(tx, "update", None)
  cells = dict(zip(getattr(getattr(update, "__code__", None), "co_freevars", ()),
                   getattr(update, "__closure__", None) or ()))
  values = {}
  for name, cell in cells.items():
    try:
      values[name] = cell.cell_contents
    except ValueError:
      continue
  found = []
  if "update_fns" in values:  # optax.chain keeps the parts' functions apart
    update_fns = values["update_fns"]
    init_fns = getattr(tx.init, "__closure__", None)
    inits = next((c.cell_contents for c in init_fns or ()
                  if isinstance(c.cell_contents, tuple) and
                  len(c.cell_contents) == len(update_fns)), None)
    if inits is not None:
      found += [optax.GradientTransformation(i, u)
                for i, u in zip(inits, update_fns)]
  for value in values.values():
    if isinstance(value, optax.GradientTransformation):  # also a tuple
      value = (value,)
    items = value if isinstance(value, (tuple, list)) else (
        value.values() if isinstance(value, dict) else (value,))
    found += [v for v in items
              if isinstance(v, optax.GradientTransformation) and v is not tx]
  return found


def _random_surrogate(abstract_params, trainable, grad_scale: float = 1.0):
  """(treedef, surrogate tree of ShapeDtypeStructs, parameter leaves,
  per-step gradient leaves): random values, each axis capped at 3."""
  leaves, treedef = jax.tree_util.tree_flatten(abstract_params)
  shapes = _surrogate_shapes(abstract_params)
  surrogate = jax.tree_util.tree_unflatten(
      treedef, [jax.ShapeDtypeStruct(s, x.dtype) for s, x in zip(shapes, leaves)])
  rng = np.random.default_rng(0)
  draw = lambda s, x, k=1.0: (k * rng.normal(size=s)).astype(x.dtype)
  params = [draw(s, x) if _is_float(x) else np.zeros(s, x.dtype)
            for s, x in zip(shapes, leaves)]
  grads = [[draw(s, x, grad_scale) if (t and _is_float(x)) else np.zeros(s, x.dtype)
            for s, x, t in zip(shapes, leaves, trainable)]
           for _ in range(_PROBE_STEPS)]
  return treedef, surrogate, params, grads


class Mismatch(NamedTuple):
  """Why `tx`'s updates on chunk views differ from those on the tree, and a
  leaf of the class (`leaf_labels`) they differ at: None where no one class
  shows it (`tx` fails on the views)."""
  why: str
  leaf: Optional[int] = None


# per (tx, tree): whether the step updates on compact views
# (`compact_views`), as `_chunked_mismatch` found
_COMPACT: dict = {}


def _recorded(key) -> bool:
  """`_COMPACT`'s answer for `key` (`_tree_key`); False where none."""
  return _hashable(key) and _COMPACT.get(key, False)


def compact_views(tx, layout: ChunkLayout) -> bool:
  """Whether the step runs `tx` on compact views
  (`optstate.update_compact`): where the probes (`check_elementwise`) found
  `tx` gives the same updates on them as on the tree. Unprobed, or refused
  there (a mask or label function that reads every leaf as an array), the
  full views, on which `tx` also computes on each empty leaf."""
  return _recorded(_tree_key(tx, layout.treedef, layout.leaves))


@_cached
def _chunked_mismatch(tx, abstract_params, trainable, labels, stacked
                      ) -> Optional[Mismatch]:
  """Why running `tx` on chunk views differs from running it on the tree.

  Runs `tx` on a small surrogate tree (random values, each axis capped at
  3) and on its `_packings`: on compact views first (what the step updates
  on, `compact_views`, where they agree), else on the full views.
  """
  treedef, surrogate, params, grads = _random_surrogate(abstract_params,
                                                       trainable)
  runs = _packings(surrogate, trainable, labels, stacked)
  try:
    reference = _tree_updates(tx, treedef, params, grads)
  except Exception as e:  # noqa: BLE001 - any failure means "not on chunks"
    return Mismatch(f"it fails on chunk views ({type(e).__name__}: {e})")
  key = _key_of(tx, abstract_params)
  for compact in (True, False):
    try:
      chunked = _chunk_updates(tx, runs, params, grads, compact)
    except Exception as e:  # noqa: BLE001 - any failure means "not on chunks"
      why = Mismatch(f"it fails on chunk views ({type(e).__name__}: {e})")
      continue
    why = next((w for w in (_compare(layout, reference, outs)
                            for (layout, _), outs in zip(runs, chunked))
                if w is not None), None)
    if why is None:
      if _hashable(key):
        _COMPACT[key] = compact
      return None
  return why


def _compare(layout, reference, chunked) -> Optional[Mismatch]:
  """`reference`: per step, the tree's update leaves; `chunked`: per step,
  the update chunks; numpy arrays."""
  for want, out_chunks in zip(reference, chunked):
    # (float16 leaves: `_FLOAT16`'s reason below names the cause)
    if not all(np.all(np.isfinite(np.asarray(w, np.float32))) for w in want
               if np.issubdtype(np.asarray(w).dtype, np.floating)
               and np.asarray(w).dtype != np.float16):
      return Mismatch(_NOT_FINITE)
    for c, chunk in enumerate(layout.chunks):
      pad = out_chunks[c][..., chunk.used:]
      if chunk.padding and np.any(pad):
        if chunk.dtype == np.float16 and not np.all(np.isfinite(pad)):
          return Mismatch(_FLOAT16)
        return Mismatch("it moves zero padding (its update of a zero is not "
                        "zero)", chunk.leaves[0])
    for i, info in enumerate(layout.leaves):
      if info.chunk >= 0 and not np.allclose(
          np.asarray(layout.host_leaf(i, out_chunks[info.chunk]), np.float32),
          np.asarray(want[i], np.float32), rtol=1e-4, atol=1e-6):
        return Mismatch(f"its update of {info.path} depends on how leaves "
                        "are packed (it reads whole tensors, e.g. per-tensor "
                        "norms or factored moments)", i)
  return None


_FLOAT16 = "float16"   # `_compare`'s reason: a zero's update is not finite
_NOT_FINITE = ("its update is not finite on the ordinary parameter tree "
               "either (nan or inf, before any chunking): check its learning "
               "rate and other hyperparameters")


def _per_tensor(tx, abstract_params, trainable) -> tuple:
  """`(why, leaves)`: the trained leaves whose statistics in `tx`'s state
  on the real tree have another shape than the leaf's (factored moments
  start at 128-wide axes, which the probes' few-element surrogate never
  reaches; GaLore's empty projector of a vector), and why; `(None, ())`
  where none. From `jax.eval_shape(tx.init, ...)` only."""
  leaves = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
  paths = sorted(((jax.tree_util.keystr(p), i, np.shape(x))
                  for i, ((p, x), t) in enumerate(zip(leaves, trainable))
                  if t and _is_float(x) and np.size(x)),
                 key=lambda t: -len(t[0]))
  try:
    state = jax.eval_shape(tx.init, abstract_params)
  except Exception:  # noqa: BLE001 - the probes name the failure
    return None, ()
  why, owners = None, []
  for path, x in jax.tree_util.tree_flatten_with_path(state)[0]:
    key = jax.tree_util.keystr(path)
    owner = next((t for t in paths if key.endswith(t[0])), None)
    if owner is not None and np.shape(x) != owner[2]:
      why = why or (f"its state {key} has shape {np.shape(x)} for a "
                    f"parameter of shape {owner[2]}: per-tensor statistics "
                    "(e.g. factored moments)")
      owners.append(owner[1])
  return why, tuple(owners)


def shaped_leaves(tx, abstract_params, trainable, labels, stacked=()
                  ) -> tuple:
  """`(leaves, why)`: the leaves `tx` must be shown in their own shapes
  ([Note: shaped leaves]), and why the first of them cannot run on flat
  chunk views; `((), None)` where every leaf can.

  Decided per optimizer class (`labels`, `leaf_labels`), so that a
  `multi_transform` of Muon for the matrices and AdamW for the rest keeps
  the AdamW leaves in chunks: first the classes whose state is per tensor
  (`_per_tensor`), then, probed again with those shaped, each class the
  probes see reading whole tensors or moving zero padding, until the rest
  run on chunks. Where a mismatch names no one class (`tx` fails on the
  views: Muon's Newton-Schulz on a chunk's empty matrices), each class is
  probed alone on chunks, every other one shaped; where that does not
  settle it, every trained leaf is shaped. A float16 zero's update and an
  update not finite on the tree itself are no reason: shaped leaves would
  not help, and `check_elementwise` refuses them."""
  leaves = jax.tree_util.tree_leaves(abstract_params)
  member = [t and _is_float(x) and np.size(x) > 0
            for t, x in zip(trainable, leaves)]
  of = lambda classes: [m and labels[i] in classes for i, m in enumerate(member)]
  everything = {labels[i] for i, m in enumerate(member) if m}

  def mismatch(classes) -> Optional[Mismatch]:   # with `classes` shaped
    found = _chunked_mismatch(tx, abstract_params, trainable,
                              shaped_labels(labels, of(classes)), stacked)
    return None if found is None or found.why in (_FLOAT16, _NOT_FINITE) else found

  why, owners = _per_tensor(tx, abstract_params, trainable)
  classes, alone = {labels[i] for i in owners}, False
  while classes != everything:
    found = mismatch(classes)
    if found is None:
      break
    why = why or found.why
    if found.leaf is not None and labels[found.leaf] not in classes:
      classes.add(labels[found.leaf])
    elif not alone:
      alone = True
      classes |= {k for k in everything - classes
                  if mismatch(everything - {k}) is not None}
    else:
      classes = set(everything)
  shaped = of(classes)
  return tuple(i for i, s in enumerate(shaped) if s), why


def _culprit(tx, why, abstract_params, trainable, labels, stacked) -> tuple:
  """`(the innermost part of tx that cannot run on chunks, why)`."""
  culprit, reason = tx, why
  while True:
    for inner in _inner_transforms(culprit):
      inner_why = _chunked_mismatch(inner, abstract_params, trainable, labels,
                                    stacked)
      if inner_why is not None:
        culprit, reason = inner, inner_why.why
        break
    else:
      return culprit, reason


def culprit(tx, abstract_params, trainable, labels, stacked=()) -> str:
  """The name of the innermost part of `tx` that cannot run on flat chunk
  views (`tx`'s own where none is found)."""
  why = _chunked_mismatch(tx, abstract_params, trainable, labels, stacked)
  return transform_name(_culprit(tx, why.why, abstract_params, trainable,
                                 labels, stacked)[0] if why is not None else tx)


def check_elementwise(tx, abstract_params, trainable, labels, stacked=()) -> None:
  """Raises ValueError naming the part of `tx` that cannot run on chunks."""
  found = _chunked_mismatch(tx, abstract_params, trainable, labels, stacked)
  if found is None:
    return
  if found.why == _FLOAT16:
    raise ValueError(
        f"optax transformation {transform_name(tx)!r} computes a non-finite "
        "update for a zero gradient on float16 parameters (an epsilon such "
        "as adam's eps=1e-8 is 0 in float16, so 0/0): it would turn "
        "parameters to NaN wherever a gradient is zero. Keep the parameters "
        "in float32 and compute in float16 (zerojax.shard(..., "
        "precision='fp16'): the update then runs on the float32 "
        "master).")
  culprit, reason = _culprit(tx, found.why, abstract_params, trainable,
                             labels, stacked)
  raise ValueError(
      f"optax transformation {transform_name(culprit)!r} cannot run on flat "
      f"ZeRO chunks: {reason}. zerojax refuses it rather than train wrongly. "
      "Use an element-wise optimizer (sgd, momentum, adam, adamw, lion, "
      "rmsprop, ...); clipping by global norm is fine.")


@_cached
def _split_mismatch(tx, abstract_params, trainable, labels, stacked) -> Optional[str]:
  """Why updating chunks in two separate calls of `tx` differs from one call
  over all of them (a transformation that reads every gradient at once:
  `clip_by_global_norm` inside `tx`, ...). Gradients are drawn large
  (x1000) so that clipping thresholds are crossed. The chunks are
  `_small_packing`'s."""
  _, surrogate, params, grads = _random_surrogate(
      abstract_params, trainable, grad_scale=1e3)
  run = _small_packing(surrogate, trainable, labels, stacked)
  layout = run[0]
  if len(layout.chunks) < 2:
    return None
  parts = [frozenset(range(k, len(layout.chunks), 2)) for k in (0, 1)]
  compact = _recorded(_key_of(tx, abstract_params))
  try:
    whole = _chunk_updates(tx, (run,), params, grads, compact)[0]
    split = _chunk_updates(tx, tuple((layout, part) for part in parts), params,
                           grads, compact)
  except Exception as e:  # noqa: BLE001 - any failure means "not separable"
    return f"it fails on a part of the chunks ({type(e).__name__}: {e})"
  for part, outs in zip(parts, split):
    for want, got in zip(whole, outs):
      for c in part:
        if not np.allclose(np.asarray(got[c], np.float32),
                           np.asarray(want[c], np.float32), rtol=1e-4, atol=1e-6):
          return ("its update of one chunk depends on the other chunks' "
                  "gradients (e.g. clip_by_global_norm or apply_if_finite "
                  "inside tx)")
  return None


def check_separable(tx, abstract_params, trainable, labels, stacked=()) -> None:
  """Raises ValueError when `tx` cannot update chunks one at a time, as
  optimizer offload does (`step`)."""
  why = _split_mismatch(tx, abstract_params, trainable, labels, stacked)
  if why is not None:
    raise ValueError(
        f"optimizer offload updates the offloaded chunks one at a time (so "
        f"that one chunk's optimizer state is on the device at once), but "
        f"optax transformation {transform_name(tx)!r} cannot run that way: "
        f"{why}. Clip with zerojax.shard(..., clip_norm=...) instead of "
        "inside tx (it clips by the global norm before the update, as "
        "DeepSpeed's gradient_clipping does), or keep the optimizer state on "
        "the device (offload=None).")
