"""Third-party Flax code for the speed suite: Hugging Face's Flax GPT-2.

`transformers`' `FlaxGPT2LMHeadModule` (the `hf` extra: transformers 4.x,
whose Flax models version 5 dropped) is linen code nobody wrote for zerojax:
its blocks are a setup-time list named `h/0`, `h/1`, ... (found as units by
`zerojax.chunking.repeated_blocks`), called with Python flags
(`deterministic=True`), its projections are `Conv1D` kernels stored
`[out, in]`, and the head reads the embedding table through
`self.variables`. The loss wraps it as a user's training code does (mask
and positions built from the tokens, dropout off). At stage 3 the block
class is swapped for `zerojax.nn.layerwise(FlaxGPT2Block)` while the model
runs, which is the one line a user adds
(`modeling_flax_gpt2.FlaxGPT2Block = zerojax.nn.layerwise(...)`), scoped
here so the other variants in the same process run the code as written.

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
  from transformers import GPT2Config as _HFConfig
  from transformers.models.gpt2 import modeling_flax_gpt2 as _hf
  missing = None
except ImportError as e:   # an optional dependency (`pip install -e ".[hf]"`)
  _hf, missing = None, (f"transformers' Flax GPT-2 is not importable ({e}); "
                        "pip install -e '.[hf]' to time it")


@contextlib.contextmanager
def _blocks(layerwise: bool):
  """`FlaxGPT2Block` wrapped in `zerojax.nn.layerwise` while the model is
  set up and called (the block collection looks the class up then)."""
  plain = _hf.FlaxGPT2Block
  if layerwise:
    _hf.FlaxGPT2Block = zerojax.nn.layerwise(plain)
  try:
    yield
  finally:
    _hf.FlaxGPT2Block = plain


@dataclasses.dataclass(frozen=True)
class HFGPT2Config(TransformerConfig):
  """transformer-6m's fields, and learned positions."""
  positions: int = 128

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
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[-1]), tokens.shape)
    with _blocks(cfg.layerwise):
      return _hf.FlaxGPT2LMHeadModule(config, name="gpt2")(
          tokens, jnp.ones_like(tokens), positions, deterministic=True)[0]


CONFIGS = {} if _hf is None else {
    "hf-gpt2-tiny": HFGPT2Config(vocab_size=64, width=32, layers=2, heads=2,
                                 positions=32),
    # transformer-6m's shape (6 blocks of width 256, vocabulary 2,048)
    "hf-gpt2-6m": HFGPT2Config(),
}
