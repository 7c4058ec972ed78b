"""zerojax._core.chunking: the chunk-size search against an independent greedy
packing, which sibling submodules are units (repeated blocks), and which
submodules look like layer stacks."""
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from zerojax._core import chunking
from zerojax._core.chunking import (beside, named_units, repeated_blocks,
                                    scanned_stacks, search_chunk_size,
                                    unit_depth)


def _block(width, hidden=None):
  hidden = hidden or 4 * width
  return {"ln": {"scale": np.zeros(width), "bias": np.zeros(width)},
          "fc": {"kernel": np.zeros((width, hidden)), "bias": np.zeros(hidden)}}


def test_a_block_name_used_twice_is_a_unit_by_path():
  params = {"a": {"blocks_0": _block(4), "blocks_1": _block(4)},
            "b": {"blocks_0": _block(8), "blocks_1": _block(8)}}
  assert repeated_blocks(params) == ("a/blocks_0", "a/blocks_1",
                                     "b/blocks_0", "b/blocks_1")
  # two towers alike: their blocks are the blocks
  assert repeated_blocks({"a": params["a"], "b": params["a"]}) == (
      "a/blocks_0", "a/blocks_1", "b/blocks_0", "b/blocks_1")
  assert repeated_blocks({"a": _block(4), "b": _block(4)}) == ("a", "b")
  # decoder blocks whose self- and cross-attention are alike: the blocks
  attention = {"q": {"kernel": np.zeros((4, 4))}, "k": {"kernel": np.zeros((4, 4))}}
  decoder = {"self": attention, "cross": attention, "mlp": _block(4)}
  assert repeated_blocks({"d_0": decoder, "d_1": decoder}) == ("d_0", "d_1")


def test_a_block_with_a_few_leaves_of_its_own_is_one_of_the_blocks(
    monkeypatch):
  """T5's first block holds the relative attention bias its siblings do
  not: it is a block all the same. A sibling whose own leaves are most of
  it (a head shaped as a block plus a table), or that lacks a leaf, is
  not."""
  first = {**_block(8), "bias": {"table": np.zeros((4, 2))}}
  params = {"h": {"0": first, "1": _block(8), "2": _block(8)}}
  assert repeated_blocks(params) == ("h/0", "h/1", "h/2")
  monkeypatch.setattr(chunking, "OWN_LEAVES_SHARE", 0.0)   # as before
  assert repeated_blocks(params) == ("h/1", "h/2")
  monkeypatch.undo()
  big = {**_block(8), "table": {"embedding": np.zeros((256, 8))}}
  part = {"ln": _block(8)["ln"]}
  assert repeated_blocks({"b_0": _block(8), "b_1": _block(8),
                          "head": big, "tail": part}) == ("b_0", "b_1")


def test_blocks_are_found_by_structure_whatever_their_names():
  """24 blocks named `enc_a` ... `enc_x` are units as `blocks_<i>` are;
  siblings shaped alike that hold no submodule (`q`, `k`) are not."""
  letters = "abcdefghijklmnopqrstuvwx"
  params = {**{f"enc_{c}": _block(4) for c in letters},
            "q": {"kernel": np.zeros((4, 4))}, "k": {"kernel": np.zeros((4, 4))},
            "head": _block(4, hidden=8)}
  assert repeated_blocks(params) == tuple(f"enc_{c}" for c in letters)


def test_blocks_named_by_index_are_units_by_path():
  """A list's items (`h/0`, `h/1`, each index used twice here) are units
  named by their path from the root; a lone item, an item holding no
  submodule, or one shaped unlike its siblings is not."""
  params = {"enc": {"h": {"0": _block(4), "1": _block(4)}},
            "dec": {"h": {"0": _block(4), "1": _block(4), "2": _block(8)}},
            "lone": {"0": _block(4)},
            "flat": {"0": {"kernel": np.zeros(4)},
                     "1": {"kernel": np.zeros(4)}}}
  assert repeated_blocks(params) == ("enc/h/0", "enc/h/1", "dec/h/0",
                                     "dec/h/1")
  assert unit_depth(("dec", "h", "1", "fc", "kernel"), "dec/h/1") == 3
  assert unit_depth(("dec", "h", "1"), "dec/h/1") == 0      # a leaf, not in it
  assert unit_depth(("enc", "h", "1", "fc", "kernel"), "dec/h/1") == 0
  assert unit_depth(("x", "blocks_2", "fc", "kernel"), "blocks_2") == 2
  found = repeated_blocks(params)
  with pytest.raises(ValueError, match="'enc' is around 'enc/h/0'"):
    named_units(params, ("enc",), (), found)
  with pytest.raises(ValueError, match="'fc' names 6 submodules"):
    named_units(params, ("fc",), (), found)
  assert named_units(params, ("lone",), (), found) == ("lone",)


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(1, 300), min_size=1, max_size=20))
def test_search_minimises_waste(sizes):
  size, frac = search_chunk_size([sizes], min_chunk_size=64, search_range=256,
                                 search_interval=16)
  candidates = range(64, 64 + 256 + 1, 16)
  wastes = {c: _waste(sizes, c) for c in candidates}
  assert wastes[size] == min(wastes.values())
  assert size == max(c for c in candidates if wastes[c] == wastes[size])
  assert frac == pytest.approx(wastes[size] / (sum(sizes) + wastes[size]))


def _waste(sizes, capacity):
  """Independent greedy packing: unused capacity, leaves too big alone."""
  waste, used = 0, 0
  for s in sizes:
    if s > capacity:
      continue
    if used + s > capacity:
      waste += capacity - used
      used = 0
    used += s
  return waste + (capacity - used if used else 0)


def test_named_units_refuse_a_module_around_a_repeated_block():
  """`per_use` names a module to gather alone: not one holding repeated
  blocks, which are gathered on their own already."""
  block = {"Dense_0": {"kernel": np.zeros((4, 4))}}
  tree = {"enc": {"blocks_0": block, "blocks_1": block},
          "head": {"kernel": np.zeros((4, 2))}}
  found = repeated_blocks(tree)
  assert found == ("blocks_0", "blocks_1")
  assert named_units(tree, ("head", "blocks_0"), (), found) == ("head",)
  with pytest.raises(ValueError, match="'enc' is around 'blocks_0'"):
    named_units(tree, ("enc",), (), found)


def _stacked(layers, width):
  """`_block(width)`'s leaves with a leading layer axis, as `nn.scan` (or
  `nnx.vmap`) makes them."""
  return {k: {n: np.zeros((layers,) + x.shape) for n, x in v.items()}
          for k, v in _block(width).items()}


def test_scanned_stacks_are_found_by_a_shared_leading_length():
  tree = {"wte": {"embedding": np.zeros((64, 32))},
          "blocks": _stacked(4, 32), "ln_f": {"scale": np.zeros(32)}}
  assert scanned_stacks(tree, num_shards=8) == ("blocks",)
  # nested, and the outermost such module is taken
  assert scanned_stacks({"enc": {"layers": _stacked(3, 32)},
                         "dec": {"layers": _stacked(3, 32), "x": tree["ln_f"]}},
                        num_shards=8) == ("enc", "dec/layers")
  # a named stack and what is inside a repeated block are skipped
  assert scanned_stacks(tree, 8, skip=("blocks",)) == ()
  assert scanned_stacks({"h": {"0": tree, "1": tree}}, 8, skip=("h/0",)) == (
      "h/1/blocks",)


def test_what_is_not_a_stack_is_not_taken():
  # unscanned blocks (rank-1 leaves), bias-free square matrices (rank 2
  # only), one leaf, a layer too small for its row's padding to stay small
  assert scanned_stacks({"h": {"0": _block(32), "1": _block(32)}}, 8) == ()
  square = {"a": {"kernel": np.zeros((64, 64))},
            "b": {"kernel": np.zeros((64, 64))}}
  assert scanned_stacks({"mlp": square}, 8) == ()
  assert scanned_stacks({"one": {"kernel": np.zeros((4, 32, 32))}}, 8) == ()
  assert scanned_stacks({"blocks": _stacked(4, 2)}, 8) == ()
  assert scanned_stacks({"blocks": _stacked(4, 4)}, 1) == ("blocks",)


def test_the_modules_beside_the_units_are_named_as_units_are():
  """Hugging Face's layout (blocks `h/<i>` under `transformer`), a bridge
  between towers, a root module whose name a block also uses ("/ln"), and
  nothing without units."""
  hf = {"transformer": {"wte": {"embedding": np.zeros((64, 8))},
                        "h": {str(i): _block(8) for i in range(3)},
                        "ln_f": {"scale": np.zeros(8)}},
        "bias": np.zeros(3)}
  assert beside(hf, repeated_blocks(hf)) == ("wte", "ln_f")
  towers = {"enc_0": _block(8), "enc_1": _block(8), "ln": _block(8)["ln"],
            "bridge": {"fc": {"kernel": np.zeros((8, 8))}},
            "dec_0": _block(8), "dec_1": _block(8)}
  units = repeated_blocks(towers)
  assert beside(towers, units) == ("/ln", "bridge")
  assert unit_depth(("ln", "scale"), "/ln") == 1
  assert unit_depth(("enc_0", "ln", "scale"), "/ln") == 0
  assert beside(towers, ()) == ()
