"""Per-block gathering at stage 3: found without an opt-in (`intercept`,
linen's method interceptor; `gather_per_call`, NNX), and the Flax-facing
opt-in it does the work of, `layerwise`, kept as an override.

    Block = zerojax.nn.layerwise(Block)             # the one line
    x, _ = nn.scan(Block, variable_axes={"params": 0},
                   split_rngs={"params": True}, length=L)(name="blocks")(x, None)
    state = zerojax.shard(state, stage=3,
                          blocks=zerojax.Blocks(stacked=("blocks",)))

Without zerojax (init, evaluation on a plain tree) the wrapped block behaves
exactly like the block. Inside a zerojax stage-3 step, the scanned subtree
holds this layer's chunk *shards*; the wrapper all-gathers them right before
the layer runs and unflattens them into the block's own parameter tree
(under `offload_params`, the layer's shards are moved from host memory to the
device first, one layer at a time). Under
`nn.remat` (on by default) the gathered layer is dropped after the forward
and gathered again in the backward pass, so at most about two layers of
gathered parameters are alive at once, whatever the depth. docs/design.md records
why a scan needs nothing more.

Unrolled blocks (`for i in range(L): x = Block(name=f"blocks_{i}")(x)`, or
an `nnx.List` of NNX blocks called in a loop) take the same one line: at
stage 3 each repeated block gets chunks of its own
(`chunking.repeated_blocks`), and the wrapper gathers them when the block is
called. Without a loop, XLA sees L gathers that depend on nothing but the
parameters: it merges each backward re-gather with the forward gather
(CSE) and is free to schedule every gather first, so every gathered block
stays alive. The wrapper therefore ties each gather to data it must wait
for (`tie`): the forward gather to the block's input (in a train step and
in `eval_step`), the backward re-gather to the cotangent of the block's
output. A block call is a
`custom_vjp` whose residuals are the block's shards and inputs only.
With `ZeroConfig.prefetch` each gather waits for the block before instead
(`_Chain`): the forward gather for the previous block's input, the
re-gather for the next block's output cotangent.

At stage 2 a scanned wrapped block holds its layer's replicated row and a
gradient slot instead of shards: nothing is gathered, and the row's
gradient is reduce-scattered into the slot inside the backward loop, as
the backward pass leaves the layer (`StagePolicy.layer_hooks`).
"""
from zerojax._model.calls import (keep_activations, keep_activations_and_casts,
                                  recompute_scores)
from zerojax._model.layerwise import layerwise
from zerojax._model.embed import BlockedEmbed, NnxBlockedEmbed

__all__ = ["BlockedEmbed", "NnxBlockedEmbed", "keep_activations",
           "keep_activations_and_casts", "layerwise", "recompute_scores"]
