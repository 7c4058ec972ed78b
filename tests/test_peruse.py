"""zerojax._model.peruse: the modules beside a stage-3 model's blocks, held for the
step or gathered at each use, whichever compiles smaller."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn, nnx
from flax.training import train_state

import zerojax
from zerojax._state import memory
from zerojax._model import peruse as peruse
from models import (Bridged, NnxResidualBlock, ResidualBlock, ScannedLM,
                    assert_matches_reference, nnx_listed, reference_run,
                    zero_run)
from models import lm_batches, lm_loss_fn


def _bridged(per_use=(), batch=64):
  """`Bridged` as written (no wrapper on the bridge): a 4 MiB bridge
  between two towers of blocks, stage 3, SGD with momentum."""
  model = Bridged(layers=2, width=256, hidden=2048, wrap=False)
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(batch, 256)).astype(np.float32)
             for _ in range(2)]
  params = model.init(jax.random.key(0), batches[0][:1])["params"]
  tx = optax.sgd(0.1, momentum=0.9)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3, blocks=zerojax.Blocks(per_use=per_use))
  loss_fn = lambda p, b: model.apply({"params": p}, b)
  return state, loss_fn, batches, (params, tx)


def _footprint(step, state, batch) -> int:
  return memory.compiled_footprint(step.lower(state, batch).compile())["device"]


@pytest.mark.slow
def test_the_smaller_of_held_and_per_use_is_chosen_and_trains_exactly(
    caplog, monkeypatch):
  """The bridge gets chunks of its own without `per_use=`; the first step
  compiles it held and per use and keeps the smaller, says so once, and
  trains as plain optax."""
  zerojax._model.gather._SAID.clear()   # (said once a process)
  state, loss_fn, batches, (params, tx) = _bridged()
  assert "bridge" in {c.stack for c in state.layout.chunks}
  step = zerojax.train_step(loss_fn)
  with caplog.at_level("INFO", logger="zerojax"):
    modes = step.gathering(state, batches[0])
  chosen = _footprint(step, state, batches[0])
  # the two ways, each set by hand: named in per_use, and held (the
  # comparison switched off)
  per_use = _footprint(zerojax.train_step(loss_fn), _bridged(("bridge",))[0],
                       batches[0])
  monkeypatch.setattr(peruse, "WORTH_COMPARING", float("inf"))
  held = _footprint(zerojax.train_step(loss_fn), state, batches[0])
  assert chosen == min(per_use, held)
  way = "per use" if per_use < held else "whole step"
  assert modes["bridge"] == (f"{way} (compiled step {per_use / 2**20:.2f} MiB "
                             f"per use, {held / 2**20:.2f} MiB held)")
  said = [r.getMessage() for r in caplog.records if r.name == "zerojax"]
  assert said == [f"stage 3 "
                  f"{'gathers' if per_use < held else 'holds'} 'bridge' "
                  f"{'at each use' if per_use < held else 'for the whole step'}"
                  f": compiled step {per_use / 2**20:.2f} MiB per use, "
                  f"{held / 2**20:.2f} MiB held."]
  monkeypatch.undo()
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


def test_small_modules_are_held_without_a_second_compile(monkeypatch):
  """Below `WORTH_COMPARING` the modules are held and nothing is compiled
  to compare (the comparison is never asked for a footprint)."""
  model = ScannedLM(layers=2, width=32, vocab=64, layerwise=False)
  batch = lm_batches(64, batch=16, seq=8, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3)
  # the root's LayerNorm_0 shares its name with the blocks': a root path
  assert {c.stack for c in state.layout.chunks} == {
      "Embed_0", "/LayerNorm_0", "blocks"}
  asked = []
  real = peruse.choose
  monkeypatch.setattr(peruse, "choose", lambda layout, config, heard, fp: real(
      layout, config, heard, lambda held: asked.append(held) or fp(held)))
  modes = zerojax.train_step(lm_loss_fn(model)).gathering(state, batch)
  assert not asked
  size = peruse.gathered_bytes(state.layout, state.config,
                               peruse.chunks(state.layout, state.config))
  why = (f"whole step ({size / 2**10:.1f} KiB gathered, too little to "
         "compile the step a second way for)")
  assert modes == {"Embed_0": why, "LayerNorm_0": why, "blocks": "per layer"}


class _Table(nn.Module):
  """A lookup table made in `@nn.compact` (no setup): a call can be heard."""

  @nn.compact
  def __call__(self, tokens):
    table = self.param("table", nn.initializers.normal(0.02), (64, 32))
    return table[tokens]


class _ReadOutside(nn.Module):
  """Modules beside two blocks held for four reasons: a table read by its
  module's call and, outside it, by the head (Hugging Face's GPT-2 ties its
  head this way); an `nn.Embed` (its setup makes its table an attribute);
  a norm whose parameters are read with no call of it; and a bias of the
  top module itself (Bart's `final_logits_bias`)."""

  @nn.compact
  def __call__(self, tokens):
    tied = _Table(name="tied")
    x = tied(tokens) + nn.Embed(64, 32, name="embed")(tokens)
    for i in range(2):
      x = ResidualBlock(32, name=f"blocks_{i}")(x)
    norm = nn.LayerNorm(name="norm")
    if self.is_initializing():
      norm(x)
    x = x * norm.variables["params"]["scale"]
    bias = self.param("bias", nn.initializers.zeros, (64,))
    return (x @ tied.variables["params"]["table"].T + bias).astype(
        jnp.float32)


def test_step_gathering_says_why_each_module_is_held(caplog, monkeypatch):
  monkeypatch.setattr(peruse, "WORTH_COMPARING", 0)
  model = _ReadOutside()
  batch = lm_batches(64, batch=16, seq=8, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(lm_loss_fn(model)).gathering(state, batch)
  top = next(k for k in modes if k.startswith("chunk "))
  assert top.endswith("(bias)"), modes
  assert modes == {
      "tied": "whole step (called, and its parameters also read outside "
              "its call (a tied weight, or read by the loss))",
      "embed": "whole step (its setup makes its parameters attributes (as "
               "nn.Embed's embedding), which code outside its calls may "
               "read)",
      "norm": "whole step (never called: its parameters are read without "
              "a call of their module)",
      top: "whole step (parameters of the top module itself: no call to "
           "gather at)",
      "blocks_0": "per block", "blocks_1": "per block"}, modes
  assert not caplog.records


def test_nnx_models_and_lower_stages_have_no_modules_beside():
  model = ScannedLM(layers=2, width=32, vocab=64, layerwise=False)
  params = model.init(jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
  for stage, reshard in ((2, True), (3, False)):
    state = zerojax.shard_shape(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=stage,
                                blocks=zerojax.Blocks(reshard_after_forward=reshard))
    assert not peruse.chunks(state.layout, state.config)
    assert "Embed_0" not in {c.stack for c in state.layout.chunks}
  # an NNX model may read a module's weights outside its call unseen
  # (no hearing of such reads yet): what is beside its blocks stays held
  state = zerojax.shard(nnx_listed(NnxResidualBlock, 2, 32)(nnx.Rngs(0)),
                        stage=3, tx=optax.sgd(0.1))
  assert {c.stack for c in state.layout.chunks} == {
      "blocks/0", "blocks/1", None}
  # ... and is said to be held for the whole step, not to be the top
  # module's own parameters (those of its head are its head's)
  loss = lambda m, b: jnp.mean(m(b) ** 2)
  modes = zerojax.train_step(loss).gathering(state, np.ones((16, 32),
                                                            np.float32))
  assert {k: v for k, v in modes.items() if k.startswith("chunk ")} == {
      "chunk 2 (head/bias)": "whole step"}, modes
