"""Third-party Flax code for the speed suite and the models-as-written
benchmark: Hugging Face's Flax GPT-2, Llama, BERT and OPT.

`transformers`' `FlaxGPT2LMHeadModule` (the `hf` extra: transformers 4.x,
whose Flax models version 5 dropped) is linen code nobody wrote for zerojax:
its blocks are a setup-time list named `h/0`, `h/1`, ... (found as units by
`zerojax._core.chunking.repeated_blocks`), called with Python flags
(`deterministic=True`), its projections are `Conv1D` kernels stored
`[out, in]`, and the head reads the embedding table through
`self.variables`. The loss wraps it as a user's training code does (mask
and positions built from the tokens, dropout off). At stage 3 the block
class is swapped for `zerojax.nn.layerwise(FlaxGPT2Block)` while the model
runs, which is the one line a user adds
(`modeling_flax_gpt2.FlaxGPT2Block = zerojax.nn.layerwise(...)`), scoped
here so the other variants in the same process run the code as written.
`FlaxLlamaForCausalLMModule` (`layers/0`, `layers/1`, ...; RMSNorm, rotary
positions, grouped-query attention, SwiGLU, an untied head) takes the same
line on `FlaxLlamaDecoderLayer`, BERT's masked LM (post-LayerNorm blocks
`bert/encoder/layer/<i>`, an encoder) on `FlaxBertLayer` and OPT
(`decoder/layers/<i>`, a ReLU MLP) on `FlaxOPTDecoderLayer`.

Without `transformers` installed, `CONFIGS` is empty and `missing` says why.
"""
from __future__ import annotations

import contextlib
import dataclasses

import flax.linen as nn
import jax.numpy as jnp

import zerojax
from benchmarks.user_models import TransformerConfig, block_params

try:
  from transformers import (BertConfig as _BertConfig, GPT2Config as _HFConfig,
                            LlamaConfig as _LlamaConfig,
                            OPTConfig as _OPTConfig)
  from transformers.models.bert import modeling_flax_bert as _bert
  from transformers.models.gpt2 import modeling_flax_gpt2 as _hf
  from transformers.models.llama import modeling_flax_llama as _llama
  from transformers.models.opt import modeling_flax_opt as _opt
  missing = None
except ImportError as e:   # an optional dependency (`pip install -e ".[hf]"`)
  _hf, missing = None, (f"transformers' Flax models are not "
                        f"importable ({e}); pip install -e '.[hf]' to time "
                        "them")


@contextlib.contextmanager
def _blocks(module, name: str, layerwise: bool):
  """`module.<name>` (a block class) wrapped in `zerojax.nn.layerwise` while
  the model is set up and called (the block collection looks the class up
  then)."""
  plain = getattr(module, name)
  if layerwise:
    setattr(module, name, zerojax.nn.layerwise(plain))
  try:
    yield
  finally:
    setattr(module, name, plain)


def _positions(tokens):
  """Each token's position in its row, as the Hugging Face modules take
  them (their `position_ids`)."""
  return jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)


@dataclasses.dataclass(frozen=True)
class HFGPT2Config(TransformerConfig):
  """transformer-6m's fields, and learned positions; `dtype`, the Hugging
  Face modules' computation dtype (their `dtype=` argument, "bfloat16"
  for bf16 compute)."""
  positions: int = 128
  dtype: str = "float32"

  @property
  def num_params(self) -> int:
    d = self.width   # the head is the embedding, tied
    return ((self.vocab_size + self.positions) * d
            + self.layers * block_params(d) + 2 * d)

  def make_model(self) -> "HFGPT2":
    return HFGPT2(self)


class HFGPT2(nn.Module):
  """Tokens to next-token logits through the Hugging Face module (its
  parameters under `gpt2`), as `FlaxGPT2LMHeadModel.__call__` drives it."""
  cfg: HFGPT2Config

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    config = _HFConfig(vocab_size=cfg.vocab_size, n_embd=cfg.width,
                       n_layer=cfg.layers, n_head=cfg.heads,
                       n_positions=cfg.positions)
    positions = _positions(tokens)
    with _blocks(_hf, "FlaxGPT2Block", cfg.layerwise):
      return _hf.FlaxGPT2LMHeadModule(config, dtype=jnp.dtype(cfg.dtype),
                                      name="gpt2")(
          tokens, jnp.ones_like(tokens), positions, deterministic=True)[0]


@dataclasses.dataclass(frozen=True)
class HFLlamaConfig(TransformerConfig):
  """transformer-6m's fields, grouped-query attention (`kv_heads`) and the
  gated MLP's width."""
  kv_heads: int = 2
  hidden: int = 704
  positions: int = 128   # the rotary table's length
  dtype: str = "float32"  # as HFGPT2Config's

  @property
  def num_params(self) -> int:
    d, v, f = self.width, self.vocab_size, self.hidden
    kv = d // self.heads * self.kv_heads
    block = 2 * d + 2 * d * d + 2 * d * kv + 3 * d * f   # no biases
    return 2 * v * d + self.layers * block + d          # head not tied

  def make_model(self) -> "HFLlama":
    return HFLlama(self)


class HFLlama(nn.Module):
  """Tokens to next-token logits through the Hugging Face module (its
  parameters under `llama`): RMSNorm, rotary positions, grouped-query
  attention, SwiGLU, an untied head."""
  cfg: HFLlamaConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    config = _LlamaConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.width,
                          intermediate_size=cfg.hidden,
                          num_hidden_layers=cfg.layers,
                          num_attention_heads=cfg.heads,
                          num_key_value_heads=cfg.kv_heads,
                          max_position_embeddings=cfg.positions)
    positions = _positions(tokens)
    with _blocks(_llama, "FlaxLlamaDecoderLayer", cfg.layerwise):
      return _llama.FlaxLlamaForCausalLMModule(
          config, dtype=jnp.dtype(cfg.dtype), name="llama")(
          tokens, jnp.ones_like(tokens), positions)[0]


@dataclasses.dataclass(frozen=True)
class HFBertConfig(TransformerConfig):
  """An encoder: Hugging Face's Flax BERT masked LM (post-LayerNorm blocks
  `bert/encoder/layer/0`, ..., learned positions and token types, the head
  tied to the word embedding through `shared_embedding`), trained on the
  tokens' cross entropy as the other language models are."""
  positions: int = 128
  dtype: str = "float32"

  @property
  def num_params(self) -> int:
    d, v = self.width, self.vocab_size
    block = 4 * d * d + 4 * d + 2 * (4 * d * d) + 5 * d + 4 * d
    return ((v + self.positions + 2) * d + 2 * d + self.layers * block
            + d * d + 3 * d + v)   # head: transform, its norm, a bias

  def make_model(self) -> "HFBert":
    return HFBert(self)


class HFBert(nn.Module):
  cfg: HFBertConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    config = _BertConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.width,
                         num_hidden_layers=cfg.layers,
                         num_attention_heads=cfg.heads,
                         intermediate_size=4 * cfg.width,
                         max_position_embeddings=cfg.positions)
    positions = _positions(tokens)
    with _blocks(_bert, "FlaxBertLayer", cfg.layerwise):
      return _bert.FlaxBertForMaskedLMModule(
          config, dtype=jnp.dtype(cfg.dtype), name="bert")(
          tokens, jnp.ones_like(tokens), jnp.zeros_like(tokens), positions,
          None, deterministic=True)[0]


@dataclasses.dataclass(frozen=True)
class HFOPTConfig(TransformerConfig):
  """A decoder with learned positions offset by two: Hugging Face's Flax
  OPT (`decoder/layers/0`, ...; pre-LayerNorm, ReLU MLP, the head tied to
  the token embedding)."""
  positions: int = 128
  dtype: str = "float32"

  @property
  def num_params(self) -> int:
    d = self.width
    return ((self.vocab_size + self.positions + 2) * d
            + self.layers * block_params(d) + 2 * d)

  def make_model(self) -> "HFOPT":
    return HFOPT(self)


class HFOPT(nn.Module):
  cfg: HFOPTConfig

  @nn.compact
  def __call__(self, tokens):
    cfg = self.cfg
    config = _OPTConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.width,
                        num_hidden_layers=cfg.layers,
                        num_attention_heads=cfg.heads, ffn_dim=4 * cfg.width,
                        max_position_embeddings=cfg.positions,
                        word_embed_proj_dim=cfg.width)
    positions = _positions(tokens)
    with _blocks(_opt, "FlaxOPTDecoderLayer", cfg.layerwise):
      return _opt.FlaxOPTForCausalLMModule(
          config, dtype=jnp.dtype(cfg.dtype), name="opt")(
          tokens, jnp.ones_like(tokens), positions, deterministic=True)[0]


CONFIGS = {} if _hf is None else {
    "hf-gpt2-tiny": HFGPT2Config(vocab_size=64, width=32, layers=2, heads=2,
                                 positions=32),
    "hf-llama-tiny": HFLlamaConfig(vocab_size=64, width=32, layers=2,
                                   heads=2, kv_heads=1, hidden=64),
    # transformer-6m's shape (6 blocks of width 256, vocabulary 2,048)
    "hf-gpt2-6m": HFGPT2Config(),
    "hf-llama-6m": HFLlamaConfig(),
    "hf-bert-tiny": HFBertConfig(vocab_size=64, width=32, layers=2, heads=2,
                                 positions=32),
    "hf-opt-tiny": HFOPTConfig(vocab_size=64, width=32, layers=2, heads=2,
                               positions=32),
}


# ---- stage-3 footprint, one-off (not a suite) -------------------------------
@dataclasses.dataclass(frozen=True)
class _Held(HFGPT2Config):
  """Stage 3 without the one line: the blocks held gathered for the step."""

  def for_variant(self, name, data):
    return self.replace(layerwise=False)


def footprints(layers=(4, 12, 16), batch: int = 8, seq: int = 256,
               devices: int = 8) -> list:
  """Compiled footprint per device of GPT-2 small's shape (width 768,
  vocabulary 50,257) through the Hugging Face code at `layers` blocks:
  zerojax stage 3 with and without the `layerwise` line, and GSPMD FSDP.
  Abstract states: compiled for analysis, nothing allocated."""
  from benchmarks import memory, variants
  rows = []
  for n in layers:
    shape = dict(vocab_size=50257, width=768, layers=n, heads=12,
                 positions=1024)
    for label, cfg, name in (("zero-3, layerwise", HFGPT2Config(**shape),
                              "zero-3"),
                             ("zero-3, held", _Held(**shape), "zero-3"),
                             ("gspmd-fsdp", HFGPT2Config(**shape),
                              "gspmd-fsdp")):
      v = variants.build(name, cfg, global_batch=batch, seq=seq,
                         num_devices=devices, materialize=False,
                         options=memory.analysis_options())
      rows.append({"layers": n, "variant": label, "num_params": cfg.num_params,
                   "global_batch": batch, "seq": seq,
                   **zerojax.compiled_footprint(v.compiled())})
  return rows


def write(rows: list, out: str, meta: dict) -> str:
  """`third_party_footprint.{json,md,png}` in `out`; returns the table."""
  import json
  import os
  from benchmarks import memory
  table = ["| layers | Ψ | variant | footprint MiB | temp MiB |",
           "|---:|---:|---|---:|---:|"] + [
               f"| {r['layers']} | {r['num_params']:,} | {r['variant']} | "
               f"{r['footprint'] / 2 ** 20:,.1f} | {r['temp'] / 2 ** 20:,.1f} |"
               for r in rows]
  text = "\n".join([
      "# Hugging Face's Flax GPT-2 at stage 3: compiled footprint per device",
      "", f"`python -m benchmarks.third_party`, {meta['date']}, jax "
      f"{meta['jax']}, batch {rows[0]['global_batch']}×{rows[0]['seq']} "
      f"tokens, {meta['devices']} simulated CPU "
      "devices, fp32 AdamW; GPT-2 small's width and vocabulary at each "
      "depth (12 blocks: GPT-2 small). `layerwise`: the block class wrapped "
      "(the one line); `held`: not wrapped.", "", *table, "",
      "![footprint](third_party_footprint.png)", ""])
  with open(os.path.join(out, "third_party_footprint.md"), "w") as f:
    f.write(text)
  with open(os.path.join(out, "third_party_footprint.json"), "w") as f:
    json.dump({"meta": meta, "rows": rows}, f, indent=1)
  layers = sorted({r["layers"] for r in rows})
  footprint = {}
  for r in rows:
    footprint.setdefault(r["variant"], []).append(r["footprint"])
  memory.plot_depth({"depth_sweep": {"layers": layers, "footprint": footprint},
                     "depth_config": "Hugging Face GPT-2 small"},
                    os.path.join(out, "third_party_footprint.png"))
  return text


if __name__ == "__main__":
  # python -m benchmarks.third_party [LAYERS...]: the footprint table, into
  # benchmarks/results
  import os
  import sys
  import time
  import jax
  if _hf is None:
    raise SystemExit(missing)
  # read when the backend starts (the first device query), not at import
  os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  info = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "jax": jax.__version__,
          "devices": jax.device_count()}
  depths = tuple(int(a) for a in sys.argv[1:])
  print(write(footprints(depths) if depths else footprints(),
              os.path.join("benchmarks", "results"), info))
