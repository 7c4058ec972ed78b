"""`Blocks(remat="offload")`: each block's saved matmul outputs ("dots"'
residuals) go to pinned host memory in the forward pass and come back for
its backward. On CPU memory kinds lower to nothing, so it trains as
`remat="dots"` bit for bit, for every front end; the program lowered for
a GPU moves the residuals to the host and back (its device bytes fall:
tests/test_gpu_compiled.py); DeepSpeed's `cpu_checkpointing` maps to it."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zerojax
from benchmarks import third_party
from models import (NnxResidualBlock, ScannedLM, TwoKinds,
                    assert_matches_reference, lm_batches, lm_loss_fn,
                    nnx_listed, reference_run, zero_run, zopts)

TX = optax.adam(1e-2)


def _linen(model, batches, remat, **options):
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
                        **zopts({"remat": remat, **options}))
  state, losses = zero_run(state, lm_loss_fn(model), batches)
  return losses, zerojax.gather_params(state)


def _nnx(remat):
  batches = [{"x": np.full((16, 32), i + 1.0, np.float32),
              "y": np.zeros((16, 4), np.float32)} for i in range(3)]
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  state = zerojax.shard(nnx_listed(NnxResidualBlock)(nnx.Rngs(0)), stage=3,
                        tx=TX, blocks=zerojax.Blocks(remat=remat))
  state, losses = zero_run(state, loss_fn, batches)
  return losses, nnx.state(zerojax.gather_model(state), nnx.Param)


def _run(case: str, remat: str):
  batches = lm_batches(64, batch=16, seq=8, steps=3)
  if case == "nnx-listed":
    return _nnx(remat)
  if case == "hf-gpt2":
    if third_party.missing is not None:
      pytest.skip(str(third_party.missing))
    model = third_party.CONFIGS["hf-gpt2-tiny"].replace(layers=3).make_model()
    return _linen(model, lm_batches(third_party.CONFIGS["hf-gpt2-tiny"]
                                    .vocab_size, batch=16, seq=8, steps=3),
                  remat)
  scan = case == "linen-scanned"
  model = ScannedLM(layers=3, width=32, vocab=64, scan=scan, layerwise=False)
  options = ({"accum_steps": 2, "prefetch": True, "offload_optimizer": True}
             if case == "linen-accum-prefetch-host" else {})
  return _linen(model, batches, remat, **options)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["linen-unrolled", "linen-scanned",
                                  "linen-accum-prefetch-host", "nnx-listed",
                                  "hf-gpt2"])
def test_offloaded_remat_trains_as_dots_bit_for_bit(case):
  dots, offload = _run(case, "dots"), _run(case, "offload")
  np.testing.assert_array_equal(offload[0], dots[0])
  jax.tree_util.tree_map(np.testing.assert_array_equal, offload[1], dots[1])


@pytest.mark.slow
@pytest.mark.parametrize("case,dtype", [("linen-unrolled", "bfloat16"),
                                        ("hf-gpt2", "bfloat16"),
                                        ("hf-gpt2", "float32")])
def test_keeping_the_casts_and_recomputing_the_scores_train_as_plain_optax(
    case, dtype):
  """`Blocks(remat="casts")` and `"recompute-scores"`: each a program of
  its own (in bf16 they keep the casts "none" computes again: layer
  norms' and, in GPT-2, the softmax's; the second computes GPT-2's
  attention scores again, in float32 too), each training as plain optax
  on one device does, within the tolerance of its compute dtype."""
  if case == "hf-gpt2":
    if third_party.missing is not None:
      pytest.skip(str(third_party.missing))
    cfg = third_party.CONFIGS["hf-gpt2-tiny"]
    # (64 positions: a head's 64 x 64 scores outweigh its queries and keys)
    model = cfg.replace(layers=3, dtype=dtype, positions=64).make_model()
    vocab, seq = cfg.vocab_size, 64
  else:
    model = ScannedLM(layers=3, width=32, vocab=64, scan=False,
                      layerwise=False)
    vocab, seq = 64, 8
  batches = lm_batches(vocab, batch=16, seq=seq, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  # (SGD: Adam magnifies a float32 rounding where a gradient is near 0,
  # models.TOLERANCE)
  tx = optax.sgd(0.1)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=tx)
  reference = reference_run(lm_loss_fn(model), params, tx, batches,
                            compute_dtype=jnp.dtype(dtype))
  programs = {}
  for remat in ("none", "casts", "recompute-scores"):
    state = zerojax.shard(plain, stage=3, **zopts(
        {"compute_dtype": dtype, "remat": remat}))
    programs[remat] = zerojax.train_step(lm_loss_fn(model)).lower(
        state, batches[0]).as_text()
    state, losses = zero_run(state, lm_loss_fn(model), batches)
    assert_matches_reference(losses, zerojax.gather_params(state),
                             *reference, dtype)
  if dtype == "bfloat16":
    assert programs["casts"] != programs["none"]
  if case == "hf-gpt2":
    assert programs["recompute-scores"] not in (programs["casts"],
                                                programs["none"])


def _placements(remat: str) -> dict:
  """{memory kind: count} of the memory-kind moves in the stage-3 step of
  a 3-block model, lowered for a GPU (on CPU they lower to nothing), its
  activations of `OFFLOAD_MIN_BYTES` or more (smaller ones stay)."""
  model = ScannedLM(layers=3, width=32, vocab=64, scan=False, layerwise=False)
  batch = lm_batches(64, batch=512, seq=64, steps=1)[0]   # 512 KiB a matmul a device
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
                        blocks=zerojax.Blocks(remat=remat))
  text = zerojax.train_step(lm_loss_fn(model)).trace(state, batch).lower(
      lowering_platforms=("cuda",)).as_text()
  return {kind: text.count(f'_xla_buffer_placement = "{kind}"')
          for kind in ("pinned_host", "device")}


def test_the_gpu_program_moves_the_saved_matmul_outputs_to_host_and_back():
  dots, offload = _placements("dots"), _placements("offload")
  assert dots == {"pinned_host": 0, "device": 0}
  # each block's matmul outputs (3 Dense layers and attention's dots a
  # block): to the host in the forward, back for the backward, alike
  assert offload["pinned_host"] >= 3 * 3
  assert offload["device"] == offload["pinned_host"]


def test_deepspeeds_cpu_checkpointing_is_the_offloaded_remat():
  config = zerojax.ZeroConfig.from_deepspeed({
      "zero_optimization": {"stage": 3},
      "activation_checkpointing": {"partition_activations": True,
                                   "cpu_checkpointing": True,
                                   "number_checkpoints": 4}})
  assert config.blocks.remat == "offload"
  plain = zerojax.ZeroConfig.from_deepspeed({
      "zero_optimization": {"stage": 3},
      "activation_checkpointing": {"partition_activations": True}})
  assert plain.blocks.remat == "none"
  with pytest.raises(ValueError, match="activation_checkpointing.cpu_checkpoint "
                     "has no zerojax equivalent .*mapped there: "
                     "cpu_checkpointing"):
    zerojax.ZeroConfig.from_deepspeed(
        {"activation_checkpointing": {"cpu_checkpoint": True}})
  with pytest.raises(ValueError, match="cpu_checkpointing"):
    zerojax.ZeroConfig.from_deepspeed(
        {"activation_checkpointing": {"cpu_checkpointing": "maybe"}})


def test_a_bad_remat_names_the_choices():
  with pytest.raises(ValueError, match=r"Blocks\(remat='host'\): use 'none' .*"
                     r"'offload' \(matmul outputs kept in pinned host memory\)"):
    zerojax.Blocks(remat="host")


def _two_kinds(remat, rows: int = 16):
  model = TwoKinds()
  batches = [{"x": np.full((rows, 32), i + 1.0, np.float32),
              "y": np.zeros((rows, 32), np.float32)} for i in range(3)]
  params = model.init(jax.random.key(0), batches[0]["x"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
                        blocks=zerojax.Blocks(remat=remat))
  loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"])
                                   - b["y"]) ** 2)
  return state, loss_fn, batches


def test_remat_per_block_class_trains_as_one_remat_for_all():
  """{class: remat}: the decoder's activations offloaded, the encoder's
  kept as "dots" (on CPU, bit for bit "dots"' numbers, as offload's)."""
  runs = {}
  for name, remat in (("dots", "dots"),
                      ("mixed", {"Encoder": "dots", "Decoder": "offload"})):
    state, loss_fn, batches = _two_kinds(remat)
    runs[name] = zero_run(state, loss_fn, batches)
  np.testing.assert_array_equal(runs["mixed"][1], runs["dots"][1])
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(runs["mixed"][0]),
                         zerojax.gather_params(runs["dots"][0]))


def test_remat_per_block_class_offloads_only_the_classes_named():
  """Lowered for a GPU: only the named class's saved matmul outputs move to
  pinned host memory (each block's moves there and back)."""
  def moves(remat):
    state, loss_fn, batches = _two_kinds(remat, rows=65536)
    text = zerojax.train_step(loss_fn).trace(state, batches[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    return text.count('_xla_buffer_placement = "pinned_host"')

  every, decoder = moves("offload"), moves({"Decoder": "offload"})
  encoder = moves({"Encoder": "offload"})
  assert 0 < decoder < every and 0 < encoder < every
  assert decoder + encoder == every


def test_remat_per_block_class_refuses_a_class_no_block_is():
  state, loss_fn, batches = _two_kinds({"DecoderLayer": "offload"})
  with pytest.raises(ValueError, match=r"names \['DecoderLayer'\], but the "
                     r"blocks "
                     r".* classes \['Decoder', 'Encoder'\]"):
    zerojax.train_step(loss_fn)(state, batches[0])


@pytest.mark.parametrize("remat,error,match", [
    ({"Decoder": "host"}, ValueError, r"'Decoder': 'host': use 'none'"),
    ({"": "dots"}, TypeError, r"the key '' must be a block class's name"),
    (3, TypeError, r"must be a string or a dict of block class names"),
    ([("Decoder", "dots"), ("Decoder", "full")], ValueError,
     r"names a block class twice"),
])
def test_a_bad_remat_per_block_class_names_the_value(remat, error, match):
  with pytest.raises(error, match=match):
    zerojax.Blocks(remat=remat)
