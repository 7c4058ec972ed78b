"""zerojax.nn.BlockedEmbed (and NnxBlockedEmbed): nn.Embed and optax's
cross entropy in values and gradients; zerojax training with it against
plain optax on a plain nn.Embed model; stage 3 gathering one block of the
table at a time, in the compiled program and in its footprint."""
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zerojax
from zerojax.nn import BlockedEmbed
from models import zopts
from models import (ScannedLM, assert_matches_reference, lm_batches,
                    lm_loss_fn, nnx_reference_run, reference_run, zero_run)

# 4 blocks of 63 rows (the last has 61 words and 2 padding rows): fewer
# words than the 8 devices' 32 tokens each, so stage 3 looks up by blocks
VOCAB = 250


def _plain_params(params, vocab=VOCAB):
  """The same model's parameters with nn.Embed's `[vocab, d]` table (what
  `ScannedLM(embed_blocks=0)` names `Embed_0`)."""
  params = dict(params)
  table = BlockedEmbed.table(params.pop("wte")["embedding"], vocab)
  return {**params, "Embed_0": {"embedding": table}}


@pytest.mark.slow
def test_matches_nn_embed_and_optax_on_a_plain_tree():
  module = BlockedEmbed(VOCAB, 16, blocks=4)
  k = jax.random.split(jax.random.key(0), 4)
  tokens = jax.random.randint(k[0], (3, 7), 0, VOCAB)
  hidden = jax.random.normal(k[1], (3, 7, 16))
  labels = jax.random.randint(k[2], (3, 7), 0, VOCAB)
  params = module.init(k[3], tokens)["params"]
  assert params["embedding"].shape == (4, 63, 16)
  assert not np.any(params["embedding"][-1, -2:])   # padding rows: zeros
  table = BlockedEmbed.table(params["embedding"], VOCAB)
  apply = lambda p, *a, **kw: module.apply({"params": p}, *a, **kw)

  np.testing.assert_array_equal(apply(params, tokens), table[tokens])
  np.testing.assert_allclose(apply(params, hidden, method="attend"),
                             hidden @ table.T, rtol=1e-5, atol=1e-6)

  def ours(p, h):   # the lookup's gradient and the head's, together
    return (apply(p, h, labels, method="cross_entropy").mean()
            + 0.1 * (apply(p, tokens) ** 2).sum())

  def plain(p, h):
    t = BlockedEmbed.table(p["embedding"], VOCAB)
    return (optax.softmax_cross_entropy_with_integer_labels(
        h @ t.T, labels).mean() + 0.1 * (t[tokens] ** 2).sum())
  np.testing.assert_allclose(ours(params, hidden), plain(params, hidden),
                             rtol=1e-6)
  for got, want in zip(jax.grad(ours, (0, 1))(params, hidden),
                       jax.grad(plain, (0, 1))(params, hidden)):
    for a, b in zip(jax.tree_util.tree_leaves(got),
                    jax.tree_util.tree_leaves(want)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.slow
@pytest.mark.parametrize("vocab,config", [
    (VOCAB, {"stage": 3, "accum_steps": 2}),
    (600, {"stage": 3}),   # 600 words >= 8 x 32 tokens: looked up by rows
    (600, {"stage": 3, "compute_dtype": jnp.bfloat16}),
    (VOCAB, {"stage": 3, "offload_params": True, "offload_optimizer": True}),
    (VOCAB, {"stage": 2}),
    (VOCAB, {"stage": 1, "compute_dtype": jnp.bfloat16}),
], ids=["stage3-accum2", "stage3-rows", "stage3-rows-bf16", "stage3-offload",
        "stage2", "stage1-bf16"])
def test_training_matches_plain_optax_on_nn_embed(vocab, config):
  """A tied LM with `BlockedEmbed` (a stack "wte") trained by zerojax
  matches plain optax on one device training the same model written with
  nn.Embed and optax's cross entropy of the logits."""
  model = ScannedLM(layers=2, vocab=vocab, embed_blocks=4)
  batches = lm_batches(vocab, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  loss_fn = lambda p, b: model.apply({"params": p}, b["tokens"],
                                     b["targets"]).mean()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx),
                        **zopts({"stacked": ("blocks", "wte"), **config}))
  gathering = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert gathering["wte"] == {3: "per layer", 2: "replicated, gradient "
                              "reduced per layer"}.get(config["stage"],
                                                       "replicated")
  state, losses = zero_run(state, loss_fn, batches)
  dtype = config.get("compute_dtype", jnp.float32)
  assert_matches_reference(
      losses, _plain_params(zerojax.gather_params(state), vocab),
      *reference_run(lm_loss_fn(ScannedLM(layers=2, vocab=vocab)),
                     _plain_params(params, vocab), tx, batches,
                     compute_dtype=dtype), compute_dtype=dtype)


class _UntiedLM(nn.Module):
  """An untied head: a `BlockedEmbed` used only for its cross entropy
  (`blocked`), or the same `[vocab, d]` weight as a plain parameter."""
  blocked: bool

  @nn.compact
  def __call__(self, tokens, targets):
    x = nn.LayerNorm()(nn.Dense(32)(nn.Embed(VOCAB, 32)(tokens)))
    if self.blocked:
      return BlockedEmbed(VOCAB, 32, 4, name="head").cross_entropy(x, targets)
    weight = self.param("head", nn.linear.default_embed_init, (VOCAB, 32))
    return optax.softmax_cross_entropy_with_integer_labels(x @ weight.T,
                                                           targets)


@pytest.mark.slow
def test_an_untied_head_trains_at_stage3_as_a_plain_weight():
  batches = lm_batches(VOCAB, steps=3)
  model, plain = _UntiedLM(True), _UntiedLM(False)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1],
                      batches[0]["targets"][:1])["params"]
  to_plain = lambda p: {**{k: v for k, v in p.items() if k != "head"},
                        "head": BlockedEmbed.table(p["head"]["embedding"],
                                                   VOCAB)}
  tx = optax.sgd(0.5, momentum=0.9)
  loss = lambda m: (lambda p, b: m.apply({"params": p}, b["tokens"],
                                         b["targets"]).mean())
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3,
                        blocks=zerojax.Blocks(stacked=("head",)))
  assert zerojax.train_step(loss(model)).gathering(
      state, batches[0])["head"] == "per layer"
  state, losses = zero_run(state, loss(model), batches)
  assert_matches_reference(losses, to_plain(zerojax.gather_params(state)),
                           *reference_run(loss(plain), to_plain(params), tx,
                                          batches))


class _NnxLM(nnx.Module):
  """An NNX LM whose tied embedding is a `NnxBlockedEmbed` (`blocked`), or
  the same `[vocab, d]` table as a plain parameter used by hand."""

  def __init__(self, vocab, rngs, blocked=True):
    self.blocked = blocked
    wte = zerojax.nn.NnxBlockedEmbed(vocab, 32, 4, rngs=rngs)
    self.wte = wte if blocked else nnx.Param(
        BlockedEmbed.table(wte.embedding[...], vocab))
    self.lin = nnx.Linear(32, 32, rngs=rngs)
    self.norm = nnx.LayerNorm(32, rngs=rngs)

  def __call__(self, tokens, targets):
    table = None if self.blocked else self.wte[...]
    x = self.wte(tokens) if self.blocked else table[tokens]
    x = self.norm(self.lin(x))
    if self.blocked:
      return self.wte.cross_entropy(x, targets).mean()
    return optax.softmax_cross_entropy_with_integer_labels(
        x @ table.T, targets).mean()


@pytest.mark.parametrize("vocab,stage", [(600, 3), (VOCAB, 3), (VOCAB, 2)],
                         ids=["stage3-rows", "stage3-blocks", "stage2"])
def test_nnx_module_trains_as_a_plain_table(vocab, stage):
  """`NnxBlockedEmbed` (a stack "wte" of an NNX model) trained by zerojax
  matches a plain NNX optimizer loop on one device over the same model
  with its table as a plain `[vocab, d]` parameter."""
  batches = lm_batches(vocab, steps=3)
  tx = optax.sgd(0.5, momentum=0.9)
  loss_fn = lambda m, b: m(b["tokens"], b["targets"])
  state = zerojax.shard(_NnxLM(vocab, nnx.Rngs(0)), tx=tx, stage=stage,
                        blocks=zerojax.Blocks(stacked=("wte",)))
  assert zerojax.train_step(loss_fn).gathering(state, batches[0])["wte"] == (
      "per layer" if stage == 3 else "replicated, gradient reduced per layer")
  state, losses = zero_run(state, loss_fn, batches)
  ref_losses, ref = nnx_reference_run(
      lambda: _NnxLM(vocab, nnx.Rngs(0), blocked=False), loss_fn, tx, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  trained = zerojax.gather_model(state).wte.embedding[...]
  np.testing.assert_allclose(BlockedEmbed.table(trained, vocab),
                             ref.wte[...], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_eval_step_gives_the_plain_models_losses_and_logits():
  """`zerojax.eval_step` at stage 3 (the table by blocks, the lookup by
  rows): the per-token losses and the logits (`attend`) of the same model
  applied to the plain tree."""
  model = ScannedLM(layers=2, vocab=600, embed_blocks=4)
  batch = lm_batches(600, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3,
                        blocks=zerojax.Blocks(stacked=("blocks", "wte")))
  for args in (("tokens", "targets"), ("tokens",)):
    got = zerojax.eval_step(lambda p, b: model.apply(
        {"params": p}, *(b[a] for a in args)))(state, batch)
    want = model.apply({"params": params}, *(batch[a] for a in args))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _stage3(embed_blocks, vocab=8192, width=64):
  model = ScannedLM(layers=2, width=width, vocab=vocab,
                    embed_blocks=embed_blocks)
  batch = lm_batches(vocab, batch=16, seq=32, steps=1)[0]
  if embed_blocks:
    loss_fn = lambda p, b: model.apply({"params": p}, b["tokens"],
                                       b["targets"]).mean()
  else:
    loss_fn = lm_loss_fn(model)
  state = zerojax.create(lambda r: model.init(r, batch["tokens"][:1])["params"],
                         jax.random.key(0), apply_fn=model.apply,
                         tx=optax.adam(1e-3), stage=3,
                         blocks=zerojax.Blocks(stacked=("blocks", "wte") if embed_blocks else
                         ("blocks",)))
  compiled = zerojax.train_step(loss_fn).lower(state, batch).compile()
  return zerojax.compiled_footprint(compiled)["footprint"], compiled.as_text()


def _elements(hlo: str, dtype: str, op: str) -> list:
  """Elements of each `op` result of `dtype` in an HLO text."""
  return [int(np.prod([int(d) for d in dims.split(",") if d]))
          for dims in re.findall(dtype + r"\[([\d,]*)\]\{[^}]*\} " + op, hlo)]


@pytest.mark.slow
def test_stage3_gathers_one_block_of_the_table_at_a_time():
  """Per-use gathering of the tied embedding, by blocks: the step
  all-gathers no more than one block of the table (`[rows x d]`) at once,
  and its footprint is below the held table's by more than the table and
  its gradient, less a block of each (8,192 x 64 fp32: 2 MiB). The lookup
  goes by rows (8 devices x 64 tokens <= 8,192 words): the token ids are
  all-gathered, the rows reduce-scattered."""
  vocab, width, blocks = 8192, 64, 8
  held, _ = _stage3(0, vocab, width)
  blocked, hlo = _stage3(blocks, vocab, width)
  table = 4 * vocab * width
  gathered = _elements(hlo, "f32", "all-gather")
  assert gathered and max(gathered) <= vocab * width // blocks, gathered
  assert held - blocked >= 2 * table * (1 - 1 / blocks), (held, blocked)
  assert 8 * 64 in _elements(hlo, "s32", "all-gather")   # every device's ids
  assert 64 * width in _elements(hlo, "f32", "reduce-scatter")   # its rows


@pytest.mark.parametrize("fields,error,match", [
    ({"blocks": 0}, ValueError, "blocks=0"),
    ({"blocks": 300}, ValueError, "at most one block per word"),
    ({"num_embeddings": 2.5}, ValueError, "num_embeddings=2.5"),
], ids=["no-blocks", "more-blocks-than-words", "float-vocab"])
def test_bad_shape_is_refused_naming_it(fields, error, match):
  module = BlockedEmbed(**{"num_embeddings": VOCAB, "features": 8, **fields})
  with pytest.raises(error, match=match):
    module.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))


@pytest.mark.parametrize("call,error,match", [
    (lambda m, p: m.apply(p, jnp.zeros((2,))), TypeError, "integer token"),
    (lambda m, p: m.apply(p, jnp.zeros((2, 8)), jnp.zeros((2,)),
                          method="cross_entropy"), TypeError,
     "integer class"),
    (lambda m, p: m.apply(p, jnp.zeros((2, 4)), jnp.zeros((2,), jnp.int32),
                          method="cross_entropy"), ValueError,
     r"must be \[..., 8\]"),
], ids=["float-tokens", "float-labels", "width"])
def test_bad_input_is_refused_naming_it(call, error, match):
  module = BlockedEmbed(VOCAB, 8, blocks=4)
  params = module.init(jax.random.key(0), jnp.zeros((2,), jnp.int32))
  with pytest.raises(error, match=match):
    call(module, params)


def test_a_table_left_out_of_stacked_is_held_whole_and_said(caplog,
                                                             monkeypatch):
  """At stage 3 a `BlockedEmbed` whose name is not in `stacked=` is an
  ordinary leaf, held whole for the step (it still trains): the step says
  so once, naming the fix."""
  monkeypatch.setattr(zerojax._model.gather, "_SAID", set())
  model = ScannedLM(layers=2, vocab=VOCAB, embed_blocks=4)
  batch = lm_batches(VOCAB, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3,
                        blocks=zerojax.Blocks(stacked=("blocks",)))
  step = zerojax.train_step(
      lambda p, b: model.apply({"params": p}, b["tokens"],
                               b["targets"]).mean())
  with caplog.at_level("WARNING", logger="zerojax"):
    _, metrics = step(state, batch)
  said = [r.getMessage() for r in caplog.records if "BlockedEmbed" in
          r.getMessage()]
  assert len(said) == 1 and "stacked=(..., 'wte')" in said[0], said
  assert np.isfinite(float(metrics["loss"]))
