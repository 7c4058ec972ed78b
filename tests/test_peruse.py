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


class _ReadOutside(nn.Module):
  """A table read by its module's lookup and, outside its call, by the
  head (Hugging Face's GPT-2 ties its head this way), between blocks."""

  @nn.compact
  def __call__(self, tokens):
    embed = nn.Embed(64, 32, name="embed")
    x = embed(tokens)
    for i in range(2):
      x = ResidualBlock(32, name=f"blocks_{i}")(x)
    return (x @ embed.variables["params"]["embedding"].T).astype(jnp.float32)


def test_a_module_read_outside_its_call_is_held_without_a_warning(
    caplog, monkeypatch):
  monkeypatch.setattr(peruse, "WORTH_COMPARING", 0)
  model = _ReadOutside()
  batch = lm_batches(64, batch=16, seq=8, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(lm_loss_fn(model)).gathering(state, batch)
  assert modes["embed"] == "whole step (read outside its call, or not called)"
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
