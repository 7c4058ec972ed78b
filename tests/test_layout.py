"""ChunkLayout: packing rules, units never sharing a chunk, exact round
trips, and the cost of unpacking's gradient."""
import collections
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zerojax._core.chunking import repeated_blocks
from zerojax._core.layout import ChunkLayout

DTYPES = [np.float32, jnp.bfloat16, np.float16, np.int32, np.bool_]

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def leaves(draw):
  shape = draw(shapes)
  dtype = draw(st.sampled_from(DTYPES))
  seed = draw(st.integers(0, 2 ** 31 - 1))
  values = np.random.default_rng(seed).normal(size=shape) * 10
  return jnp.asarray(values).astype(dtype)


trees = st.recursive(
    leaves(),
    lambda children: st.one_of(
        st.dictionaries(st.text("abcxyz", min_size=1, max_size=3), children,
                        max_size=4),
        st.lists(children, max_size=3),
        st.lists(children, max_size=3).map(tuple)),
    max_leaves=12)


def _check_invariants(layout, tree, align=1):
  flat = jax.tree_util.tree_leaves(tree)
  n = layout.num_shards
  up = lambda x: -(-x // align) * align
  for c, chunk in enumerate(layout.chunks):
    members = [layout.leaves[i] for i in chunk.leaves]
    ends = [m.offset + m.size for m in members]
    assert chunk.length % (n * align) == 0
    assert 0 <= chunk.length - ends[-1] < n * align
    assert {m.dtype for m in members} == {chunk.dtype}
    assert sum(m.size for m in members) == chunk.used
    # packed in order, each leaf at the first multiple of align
    assert [m.offset for m in members] == [0] + [up(e) for e in ends[:-1]]
    if len(members) > 1:
      assert up(ends[-1]) <= max(layout.chunk_size, up(members[0].size))
  for info, leaf in zip(layout.leaves, flat):
    floating = jnp.issubdtype(leaf.dtype, jnp.floating)
    assert (info.chunk >= 0) == (floating and leaf.size > 0)


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(tree=trees, num_shards=st.integers(1, 8),
       chunk_size=st.one_of(st.none(), st.integers(1, 40)),
       align=st.sampled_from([1, 1, 3, 4]))
def test_split_merge_round_trip_is_exact(tree, num_shards, chunk_size, align):
  """`align`: leaves start at whole quantization blocks, gaps between them
  zero (`build(align=)`)."""
  layout = ChunkLayout.build(jax.eval_shape(lambda t: t, tree), num_shards,
                             chunk_size=chunk_size, min_chunk_size=4,
                             search_range=32, search_interval=4, align=align)
  _check_invariants(layout, tree, align)
  chunks, rest = layout.split(tree)
  for chunk, arr in zip(layout.chunks, chunks):
    assert arr.shape == chunk.shape and arr.dtype == chunk.dtype
    outside = np.ones(chunk.length, bool)
    for i in chunk.leaves:
      info = layout.leaves[i]
      outside[info.offset:info.offset + info.size] = False
    assert not np.any(np.asarray(arr[..., outside], np.float32))
  back = layout.merge(chunks, rest)
  assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(tree)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(tree)):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=50, deadline=None)
@given(tree=trees, num_shards=st.integers(1, 8))
def test_views_round_trip(tree, num_shards):
  layout = ChunkLayout.build(jax.eval_shape(lambda t: t, tree), num_shards,
                             chunk_size=16)
  chunks, _ = layout.split(tree)
  views = layout.views(chunks)
  assert jax.tree_util.tree_structure(views) == jax.tree_util.tree_structure(tree)
  reps = {layout.representative(c) for c in range(len(layout.chunks))}
  for i, (view, info) in enumerate(zip(jax.tree_util.tree_leaves(views),
                                       layout.leaves)):
    assert view.ndim in (info.ndim, 1)   # rank kept (a scalar gets rank 1)
    # every other leaf holds nothing, a scalar too: no optimizer state of
    # its own, no update of it in the step
    assert i in reps or view.size == 0
  for a, b in zip(layout.from_views(views), chunks):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@settings(max_examples=50, deadline=None)
@given(tree=trees, num_shards=st.integers(1, 8),
       chunk_size=st.integers(1, 40), stacked=st.booleans())
def test_host_packing_matches_the_device_and_cuts_leaves_back(
    tree, num_shards, chunk_size, stacked):
  """`pack_chunk(xp=numpy)` and `host_leaf` (the optimizer probes' packing
  on the host) against the leaves themselves and the device packing."""
  if stacked:   # a layer stack beside the drawn tree
    tree = {"blocks": {"k": jnp.arange(3 * 4 * 5.0).reshape(3, 4, 5),
                       "b": jnp.arange(3 * 5.0).reshape(3, 5)}, "t": tree}
  layout = ChunkLayout.build(jax.eval_shape(lambda t: t, tree), num_shards,
                             chunk_size=chunk_size,
                             stacked=("blocks",) if stacked else ())
  leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]
  host = [layout.pack_chunk(c, leaves, xp=np) for c in range(len(layout.chunks))]
  for arr, device in zip(host, layout.split(tree)[0]):
    assert isinstance(arr, np.ndarray) and arr.dtype == device.dtype
    np.testing.assert_array_equal(arr, np.asarray(device))
  for i, info in enumerate(layout.leaves):
    if info.chunk >= 0:
      np.testing.assert_array_equal(layout.host_leaf(i, host[info.chunk]),
                                    leaves[i])


def test_large_leaf_gets_its_own_chunk_and_order_is_kept():
  tree = {"a": jnp.ones(3), "b": jnp.ones(50), "c": jnp.ones(4), "d": jnp.ones(5)}
  layout = ChunkLayout.build(tree, 4, chunk_size=10)
  assert [tuple(layout.leaves[i].path for i in c.leaves)
          for c in layout.chunks] == [("['a']",), ("['b']",), ("['c']", "['d']")]
  assert [c.length for c in layout.chunks] == [4, 52, 12]


def test_frozen_and_labels_split_chunks():
  tree = {"w": jnp.ones(6), "b": jnp.ones(2), "frozen": jnp.ones(3),
          "step": jnp.ones((), jnp.int32)}
  # leaf order is sorted by key: b, frozen, step, w
  layout = ChunkLayout.build(tree, 2, chunk_size=100,
                             trainable=[True, False, True, True],
                             labels=[1, 0, 0, 0])
  assert layout.rest_indices == (1, 2)
  assert [c.label for c in layout.chunks] == [1, 0]


def test_layer_stacked_leaves_are_chunked_per_layer():
  tree = {"blocks": {"k": jnp.arange(3 * 4 * 5.0).reshape(3, 4, 5),
                     "b": jnp.arange(3 * 5.0).reshape(3, 5)},
          "head": jnp.ones(7)}
  layout = ChunkLayout.build(tree, 8, chunk_size=64, stacked=("blocks",))
  shapes = sorted(c.shape for c in layout.chunks)
  assert shapes == [(3, 32), (8,)]
  chunks, rest = layout.split(tree)
  stacked = next(a for a in chunks if a.ndim == 2)
  # layer 1 of the chunk holds exactly layer 1 of every stacked leaf
  np.testing.assert_array_equal(stacked[1, :5], tree["blocks"]["b"][1])
  np.testing.assert_array_equal(stacked[1, 5:25], tree["blocks"]["k"][1].ravel())
  back = layout.merge(chunks, rest)
  jax.tree_util.tree_map(np.testing.assert_array_equal, back, tree)


def _block(width, hidden=None):
  hidden = hidden or 4 * width
  return {"ln": {"scale": np.zeros(width), "bias": np.zeros(width)},
          "fc": {"kernel": np.zeros((width, hidden)), "bias": np.zeros(hidden)}}


def test_repeated_blocks_are_found_and_never_share_a_chunk():
  params = {"embed": {"embedding": np.zeros((16, 8), np.float32)},
            "blocks_0": _block(8), "blocks_1": _block(8), "blocks_2": _block(8),
            "odd_0": _block(8, hidden=4), "odd_1": _block(8, hidden=2),  # differ
            "Dense_0": {"kernel": np.zeros((8, 8))},            # no submodules
            "Dense_1": {"kernel": np.zeros((8, 8))},
            "stack": {"layer_0": _block(8), "layer_1": _block(8)}}
  params = jax.tree_util.tree_map(lambda x: x.astype(np.float32), params)
  units = repeated_blocks(params, stacked=("stack",))
  assert units == ("blocks_0", "blocks_1", "blocks_2")
  # one large chunk size: without units, everything would share one chunk
  layout = ChunkLayout.build(params, 2, chunk_size=10 ** 6, units=units)
  for c, chunk in enumerate(layout.chunks):
    owners = {next((u for u in units if u in layout.leaves[i].names), None)
              for i in chunk.leaves}
    assert owners == {chunk.stack}, (c, owners)
  assert sorted(filter(None, (c.stack for c in layout.chunks))) == list(units)
  # a unit's gathered chunk unpacks into its block's own tree
  c = next(c for c, ch in enumerate(layout.chunks) if ch.stack == "blocks_1")
  full = jnp.arange(layout.chunks[c].length, dtype=jnp.float32)
  tree = layout.layer_tree(c, full)
  assert jax.tree_util.tree_map(np.shape, tree) == jax.tree_util.tree_map(
      np.shape, params["blocks_1"])


def test_stacked_leaves_must_agree_on_layers():
  tree = {"blocks": {"k": jnp.ones((3, 4)), "b": jnp.ones((2, 4))}}
  with pytest.raises(ValueError, match="layer count"):
    ChunkLayout.build(tree, 2, stacked=("blocks",))


def test_search_reports_chosen_size_and_waste():
  tree = {f"l{i}": jnp.ones(s) for i, s in enumerate([700, 324, 1024, 250, 774])}
  layout = ChunkLayout.build(tree, 4, min_chunk_size=512, search_range=1024,
                             search_interval=256)
  assert layout.chunk_size == 1024 and layout.waste == 0.0
  assert "capacity 1,024" in layout.summary()


def test_summary_of_a_tiny_model_reports_its_real_padding():
  """A 965-element model gets a chunk capacity of 2**20 by default; its
  chunk is 968 long (965 rounded up to 8 devices): 3 padding elements,
  not the 99.9% of unused capacity."""
  tree = {"w": jnp.ones((30, 30)), "b": jnp.ones(65), "step": jnp.ones((), jnp.int32)}
  layout = ChunkLayout.build(tree, 8)
  assert layout.chunk_size == 2 ** 20
  text = layout.summary()
  assert "965 trainable elements + 3 padding (0.31%)" in text
  assert "largest chunk 968 elements" in text
  assert "1 leaves outside the chunks" in text


@pytest.mark.parametrize("stacked", [False, True])
def test_unpacking_gradient_places_each_leaf_gradient_in_the_chunk(stacked):
  lead = (2,) if stacked else ()
  shapes = {"a": (3,), "b": (2, 5), "c": (4, 1), "unused": (5,), "d": ()}
  if stacked:
    shapes.pop("d")     # a scalar has no layer axis
  tree = {"blocks": {k: jax.ShapeDtypeStruct(lead + s, jnp.float32)
                     for k, s in shapes.items()}}
  layout = ChunkLayout.build(tree, 8, chunk_size=64,
                             stacked=("blocks",) if stacked else ())
  (chunk,) = layout.chunks
  assert chunk.padding > 0
  rng = np.random.default_rng(0)
  weights = {k: rng.normal(size=lead + s).astype(np.float32)
             for k, s in shapes.items() if k != "unused"}

  def loss(arr):   # linear: its gradient is `weights`, zero for "unused"
    params = layout.merge([arr], [], dtype=None)["blocks"]
    return sum(jnp.sum(params[k] * w) for k, w in weights.items())

  # independent reference: each weight written at its leaf's offset
  want = np.zeros(chunk.shape, np.float32)
  for info in layout.leaves:
    if info.names[-1] in weights:
      want[..., info.offset:info.offset + info.size] = np.reshape(
          weights[info.names[-1]], lead + (-1,))
  arrs = jnp.asarray(rng.normal(size=(2,) + chunk.shape), jnp.float32)
  grads = jax.jit(jax.vmap(jax.grad(loss)))(arrs)
  for g in grads:
    np.testing.assert_array_equal(np.asarray(g), want)
  # unpacking is linear, so forward mode works too
  _, tangent = jax.jvp(loss, (arrs[0],), (jnp.asarray(want),))
  np.testing.assert_allclose(tangent, sum(np.sum(w * w) for w in weights.values()),
                             rtol=1e-6)


_OP = re.compile(r"= (\w+)\[([\d,]*)\]\S* ([\w-]+)\(")
# the ops that can assemble a chunk-length array from leaf-sized ones (a
# convert or parameter of chunk length feeding a fused slice is only read
# where the slice reads)
_ASSEMBLY = {"pad", "add", "select", "dynamic-update-slice", "scatter",
             "concatenate"}


def _chunk_length_ops(num_leaves, form, length=2 ** 14):
  """Assembly ops (`_ASSEMBLY`) of chunk length (last axis) in the optimized
  HLO of the gradient of unpacking one chunk of `num_leaves` leaves, by
  opcode. `form`: "chunk" (a [length] chunk), "bf16" (a bfloat16 chunk
  unpacked in float32), "layers" (a [layers, length] chunk) or "per_layer"
  (one layer of it, as `layer_tree` unpacks it for zerojax.nn)."""
  lead = (3,) if form in ("layers", "per_layer") else ()
  dtype = jnp.bfloat16 if form == "bf16" else jnp.float32
  tree = {"blocks": {f"w{i:02d}": jax.ShapeDtypeStruct(
      lead + (length // num_leaves,), dtype) for i in range(num_leaves)}}
  layout = ChunkLayout.build(tree, 8, chunk_size=length,
                             stacked=("blocks",) if lead else ())
  (chunk,) = layout.chunks
  assert chunk.length == length and chunk.padding == 0

  def loss(arr):
    if form == "per_layer":
      leaves = jax.tree_util.tree_leaves(layout.layer_tree(0, arr))
    else:
      leaves = jax.tree_util.tree_leaves(layout.merge(
          [arr], [], dtype=jnp.float32 if form == "bf16" else None))
    # leaf 0 unused: its cotangent is a symbolic zero
    return sum(jnp.sum(jnp.sin(x.astype(jnp.float32))) for x in leaves[1:])

  shape = (length,) if form == "per_layer" else chunk.shape
  hlo = jax.jit(jax.grad(loss)).lower(
      jax.ShapeDtypeStruct(shape, dtype)).compile().as_text()
  return collections.Counter(
      op for _, dims, op in _OP.findall(hlo)
      if dims.split(",")[-1] == str(length) and op in _ASSEMBLY)


@pytest.mark.parametrize("form", ["chunk", "bf16", "layers", "per_layer"])
def test_unpacking_gradient_cost_does_not_grow_with_leaves(form):
  # Cut by slices, a chunk's gradient is one full-length pad per leaf, summed:
  # O(leaves x length). Cut by one split, it is one concatenate: O(length).
  few, many = _chunk_length_ops(4, form), _chunk_length_ops(64, form)
  assert few == many == {"concatenate": 1}, (few, many)


# ---- tensor parallelism: leaves split over the model axis --------------------
def _tp_tree():
  r = np.random.default_rng(3)
  a = lambda *s: jnp.asarray(r.normal(size=s), jnp.float32)
  return {"attn": {"qkv": a(8, 12), "out": a(12, 8), "bias": a(12)},
          "ln": {"scale": a(8)},
          "blocks": {"up": a(3, 8, 6), "down": a(3, 6, 8), "norm": a(3, 8)}}


# per leaf in tree order (attn/bias, attn/out, attn/qkv, blocks/down,
# blocks/norm, blocks/up, ln/scale): the dim split over the model axis
_TP_DIMS = (0, 0, 1, 1, None, 2, None)


@pytest.mark.parametrize("model_shards", [2, 3])
def test_tensor_parallel_rows_hold_each_model_devices_slices(model_shards):
  """Row m of a split chunk is model device m's slice of each leaf (what
  it holds under tensor parallelism), leaves back to back; split leaves
  never share a chunk with whole ones; unpacking (on device, per layer,
  and on the host) gives the leaves back exactly."""
  tree = _tp_tree()
  m = model_shards
  layout = ChunkLayout.build(jax.eval_shape(lambda t: t, tree), 4,
                             chunk_size=64, stacked=("blocks",),
                             model_dims=_TP_DIMS, model_shards=m)
  flat = jax.tree_util.tree_leaves(tree)
  chunks, rest = layout.split(tree)
  assert rest == ()
  for c, (chunk, arr) in enumerate(zip(layout.chunks, chunks)):
    members = [layout.leaves[i] for i in chunk.leaves]
    split = {info.model_dim is not None for info in members}
    assert len(split) == 1   # never mixed
    assert arr.shape == chunk.shape
    assert chunk.model_shards == (m if split == {True} else 0)
    for i in chunk.leaves:
      info, leaf = layout.leaves[i], np.asarray(flat[i])
      if info.model_dim is None:
        continue
      d, s = info.model_dim, info.shape[info.model_dim] // m
      for row in range(m):
        own = np.take(leaf, np.arange(row * s, (row + 1) * s), axis=d)
        got = np.asarray(arr)[..., row, info.offset:info.offset + info.size]
        lead = (info.shape[0],) if info.stacked else ()
        np.testing.assert_array_equal(got, own.reshape(lead + (-1,)))
    host = layout.pack_chunk(c, [np.asarray(x) for x in flat], xp=np)
    np.testing.assert_array_equal(host, np.asarray(arr))
    for i in chunk.leaves:
      np.testing.assert_array_equal(layout.host_leaf(i, host), flat[i])
    if chunk.layers:   # one layer at a time, as `layerwise` cuts it
      for layer in range(chunk.layers):
        for i, leaf in zip(chunk.leaves,
                           layout.unpack_chunk(c, arr[layer], per_layer=True)):
          np.testing.assert_array_equal(leaf, flat[i][layer])
  back = layout.merge(chunks, rest)
  for a, b in zip(jax.tree_util.tree_leaves(back), flat):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert layout.num_chunked_elements == sum(x.size for x in flat)
  views = layout.views(chunks)
  for view, info in zip(jax.tree_util.tree_leaves(views), layout.leaves):
    assert view.ndim == info.ndim   # optax's masks see the leaves' ranks
  for a, b in zip(layout.from_views(views), chunks):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_tensor_parallel_unpacking_gradient_is_the_packing():
  """The gradient through unpacking a split chunk is the packing of the
  leaves' gradients (the split's transpose and a transpose of axes: no
  pad of the chunk's length per leaf)."""
  tree = _tp_tree()
  layout = ChunkLayout.build(jax.eval_shape(lambda t: t, tree), 4,
                             stacked=("blocks",), model_dims=_TP_DIMS,
                             model_shards=2)
  chunks, rest = layout.split(tree)
  weights = jax.tree_util.tree_map(lambda x: x * 3 + 1, tree)
  loss = lambda ch: sum(jnp.vdot(a, w) for a, w in zip(
      jax.tree_util.tree_leaves(layout.merge(ch, rest)),
      jax.tree_util.tree_leaves(weights)))
  grads = jax.grad(loss)(chunks)
  for got, want in zip(grads, layout.split(weights)[0]):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  text = jax.jit(jax.grad(loss)).lower(chunks).compile().as_text()
  # cut by slices there would be a pad per leaf (7); at most one per chunk
  # (its zero padding) here
  assert len(re.findall(r" pad\(", text)) <= len(layout.chunks), text


@pytest.mark.parametrize("dims, match", [
    ((0, 0, 1, 1, None, 0, None), "layer axis"),      # blocks/up on dim 0
    ((0, 0, 1, 1, None, 3, None), "not one of its dims"),
    ((0, 0, 1, 1, None, 2, 0), "does not divide"),    # ln/scale 8 over 3
])
def test_tensor_parallel_dims_that_a_chunk_cannot_keep_are_refused(dims, match):
  with pytest.raises(ValueError, match=match):
    ChunkLayout.build(jax.eval_shape(lambda t: t, _tp_tree()), 4,
                      stacked=("blocks",), model_dims=dims, model_shards=3)


def test_tensor_parallel_layout_survives_a_checkpoints_json():
  """A checkpoint's layout metadata keeps each leaf's model dim and each
  chunk's rows; one written before tensor parallelism reads as unsplit."""
  import json
  from zerojax.checkpoint import _format
  abstract = jax.eval_shape(lambda t: t, _tp_tree())
  layout = ChunkLayout.build(abstract, 4, stacked=("blocks",),
                             model_dims=_TP_DIMS, model_shards=2)
  text = json.dumps(_format.layout_json(layout))
  back = _format.layout_from_json(json.loads(text), layout.treedef)
  assert back.leaves == layout.leaves and back.chunks == layout.chunks
  old = json.loads(text)
  for entry in old["leaves"] + old["chunks"]:
    entry.pop("model_dim", None)
    entry.pop("model_shards")
  legacy = _format.layout_from_json(old, None)
  assert all(c.model_shards == 0 for c in legacy.chunks)
  assert all(i.model_dim is None and i.model_shards == 1
             for i in legacy.leaves)
