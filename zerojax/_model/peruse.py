"""The modules beside a stage-3 model's blocks (its embedding, final norm,
a bridge between two towers): held for the whole step, or gathered at each
use, whichever the compiled step needs fewer bytes for.

`shard` gives each such module of a linen model chunks of its own
(`chunking.beside`). Held, a module is gathered once for the step and
kept from its forward use to its backward; per use, the step gathers it at
each call of the module, drops it after, and gathers it again in its
backward pass, as it does a block (`zerojax._model.linen.intercept`). Which needs
less memory is for XLA's scheduler to say, and it changes between
versions (a bridge between two towers: smaller per use on jax 0.10,
smaller held on 0.12; docs/decisions.md). So the first step of each
program compiles both and keeps the smaller (a tie: held, fewer
collectives), where the modules heard called would gather at least
`WORTH_COMPARING` bytes; below that they are held without a second
compile. A module whose parameters are read outside its call (a tied
weight), whose call cannot be replayed, or that is never called, is held.
The step says its choice once (logging, level info), and `step.gathering`
says it, and why, for each module.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import numpy as np

from zerojax._core.chunking import repeated_blocks
from zerojax._model.gather import say_once
from zerojax._options.policy import policy


# the bytes the modules heard per use must gather, all together, for the
# step to compile both ways: below it, what either way could save is less
# than a second compile costs
WORTH_COMPARING = 1 << 20
PER_USE = "per use"


def chunks(layout, config) -> frozenset:
  """The chunks of the modules beside the blocks: chunks of a unit that is
  no stack, no repeated block and not named in `per_use` (empty where the
  step gathers nothing per call)."""
  if not (policy(config).gathers_params and config.reshard_after_forward):
    return frozenset()
  blocks = _blocks(layout)
  return frozenset(c for c, chunk in enumerate(layout.chunks)
                   if chunk.stack is not None and not chunk.layers
                   and chunk.stack not in blocks
                   and chunk.stack not in config.per_use)


@functools.lru_cache(maxsize=64)
def _blocks(layout) -> frozenset:
  """The repeated blocks of the layout's tree."""
  tree = jax.tree_util.tree_unflatten(
      layout.treedef,
      [jax.ShapeDtypeStruct(i.shape, i.dtype) for i in layout.leaves])
  stacks = tuple(dict.fromkeys(c.stack for c in layout.chunks if c.layers))
  return frozenset(repeated_blocks(tree, stacks))


def gathered_bytes(layout, config, members) -> int:
  """What chunks `members` are when gathered, in the compute dtype."""
  size = np.dtype(config.compute_dtype).itemsize
  return sum(layout.chunks[c].length * layout.chunks[c].copies * size
             for c in members)


def choose(layout, config, heard: Callable[[], dict],
           footprint: Callable[[frozenset], int]) -> tuple:
  """`(held, why)`: the chunks beside the blocks (`chunks`) the step holds
  for the whole step, and per module name why. `heard()` gives, of the
  chunks a trace heard, None for those it heard called and not read
  outside their calls, and for others beside the blocks why they are held
  (`model_call._why_held`); `footprint(held)` compiles the step holding
  `held` and gives its per-device bytes."""
  beside = chunks(layout, config)
  if not beside:
    return frozenset(), {}
  # each module by the name `model_call.gather_modes` gives it
  names = lambda cs: sorted({"/".join(layout.stack_prefix(c)) for c in cs})
  small = lambda size: (f"{size / 2**10:.1f} KiB gathered, too little to "
                        "compile the step a second way for")
  size = gathered_bytes(layout, config, beside)
  if size < WORTH_COMPARING:
    return beside, {n: small(size) for n in names(beside)}
  said = heard()
  usable = frozenset(c for c, why in said.items() if why is None) & beside
  why = {}
  for c in sorted(beside - usable):
    why.setdefault(names([c])[0], said.get(c) or "never called")
  if not usable:
    return beside, why
  size = gathered_bytes(layout, config, usable)
  if size < WORTH_COMPARING:
    return beside, {**why, **{n: small(size) for n in names(usable)}}
  held, per_use = footprint(beside), footprint(beside - usable)
  mib = lambda b: f"{b / 2**20:.2f} MiB"
  chosen = beside - usable if per_use < held else beside
  what = (f"compiled step {mib(per_use)} per use, {mib(held)} held")
  why.update({n: what for n in names(usable)})
  say_once(f"stage 3 {'gathers' if chosen != beside else 'holds'} "
           f"{', '.join(map(repr, names(usable)))} "
           f"{'at each use' if chosen != beside else 'for the whole step'}: "
           f"{what}.", logging.INFO)
  return chosen, why
