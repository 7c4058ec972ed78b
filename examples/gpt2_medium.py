"""GPT-2 in Flax linen, trained with zerojax (ZeRO stage 3 by default).

The job to start first, like DeepSpeed's GPT-2 tutorial or Colossal-AI's
"Train GPT with Gemini". The training loop is an ordinary Flax loop; the ZeRO
part is the `zerojax.shard(...)` and `zerojax.train_step(...)` lines.

    python examples/gpt2_medium.py                 # see --help: depends on the machine
    python examples/gpt2_medium.py --preset tiny --steps 3
    python examples/gpt2_medium.py --preset medium --precision bf16 --remat
    python examples/gpt2_medium.py --text input.txt --steps 300   # byte-level text
    python examples/gpt2_medium.py --json run.json               # machine-readable log

Multi-host: one process per host, the same flags everywhere plus
`--coordinator HOST:PORT --num-processes N --process-id I`; under SLURM or
Open MPI with several tasks no flag is needed.

The model's blocks are a `flax.linen.scan` under the submodule "blocks", and
`stacked=("blocks",)` tells zerojax their leaves carry a layer axis, so the
blocks are chunked per layer. Parameters stay float32 (the ZeRO master); the
model computes in the dtype of the parameters it is handed, which is
zerojax's `compute_dtype` (`--precision`). Softmax and cross-entropy run in
float32 whatever the precision. On a GPU in half precision the attention is
cuDNN's flash attention (`--attention`).

One file on purpose (past STYLE.md's ~400 lines): it is the script users
copy, so model, data, loop and measurements sit together.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from typing import Any, Optional

import numpy as np

# ---- configuration (no jax here: the CPU device count must be set first) ----
PRESETS = {
    # name: model shape, and the run defaults used when a flag is left out.
    "tiny": dict(layers=2, width=64, heads=4, vocab=256, ctx=64,
                 micro_batch=2, seq=64, steps=50, lr=3e-3),
    "cpu": dict(layers=4, width=128, heads=2, vocab=256, ctx=128,
                micro_batch=2, seq=128, steps=100, lr=2e-3),
    "small": dict(layers=12, width=768, heads=12, vocab=50257, ctx=1024,
                  micro_batch=8, seq=1024, steps=100, lr=6e-4),
    "medium": dict(layers=24, width=1024, heads=16, vocab=50257, ctx=1024,
                   micro_batch=8, seq=1024, steps=100, lr=3e-4),
}
BYTE_VOCAB = 256

_HELP = __doc__.split("\n\n")[0] + """

Defaults depend on the machine. On a GPU/TPU the default preset is `medium`
(GPT-2 medium, 355M) in bf16. With no accelerator it is `cpu`: GPT-2's
layout shrunk to 4 layers of width 128, a byte-sized vocabulary (256) and
128-token windows, trained in float32 on 8 simulated CPU devices for 100
steps, so that the default run takes about two minutes on a 2-core machine
and shows the loss falling. (GPT-2's 50257-token output layer alone would
make a CPU step several seconds.)
"""


def parse_args(argv=None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--preset", choices=["auto", *PRESETS], default="auto",
                 help="model size: tiny (CI), cpu (default without an "
                 "accelerator), small (124M), medium (355M, default on "
                 "GPU/TPU). Default: auto.")
  p.add_argument("--layers", type=int, help="override the preset's depth")
  p.add_argument("--width", type=int, help="override the preset's width "
                 "(heads become width // 64)")
  p.add_argument("--remat", action="store_true",
                 help="with --no-layerwise: rematerialise each block in the "
                 "backward pass (nn.remat). zerojax's layerwise blocks always "
                 "rematerialise (that is what keeps gathered layers from "
                 "piling up).")
  p.add_argument("--no-layerwise", dest="layerwise", action="store_false",
                 help="do not wrap the block with zerojax.nn.layerwise: "
                 "stage 3 then gathers every layer at the start of the step")
  p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3],
                 help="ZeRO stage (default 3)")
  p.add_argument("--precision", choices=["auto", "fp32", "bf16", "fp16"],
                 default="auto", help="compute dtype (zerojax compute_dtype; "
                 "the master stays fp32; fp16 gets dynamic loss scaling). "
                 "auto: bf16 on GPU/TPU, fp32 on CPU.")
  p.add_argument("--batch", type=int, help="global batch in sequences "
                 "(default: the preset's per-device micro-batch x devices x "
                 "--accum); must be a multiple of devices x --accum")
  p.add_argument("--seq", type=int, help="tokens per sequence (default: "
                 "the preset's; beyond the preset's context the position "
                 "table grows to fit)")
  p.add_argument("--steps", type=int, help="optimizer steps (default: the "
                 "preset's)")
  p.add_argument("--accum", type=int, default=1,
                 help="micro-batches per step (gradient accumulation)")
  p.add_argument("--lr", type=float, help="peak learning rate (default: "
                 "the preset's); linear warm-up, then cosine decay to lr/10")
  p.add_argument("--warmup", type=int,
                 help="warm-up steps (default: 10%% of --steps)")
  p.add_argument("--weight-decay", type=float, default=0.1,
                 help="AdamW weight decay on kernels and embeddings (never "
                 "on biases or LayerNorm parameters)")
  p.add_argument("--clip", type=float, default=1.0,
                 help="clip gradients to this global norm; 0 disables")
  p.add_argument("--seed", type=int, default=0)
  p.add_argument("--text", metavar="FILE", help="train on this file's bytes "
                 "(vocab 256). Default: random tokens drawn from a Zipf law "
                 "over the vocabulary, so the loss has somewhere to fall to "
                 "(its entropy is printed).")
  p.add_argument("--json", metavar="PATH", help="write config, per-step "
                 "metrics and memory figures to PATH")
  p.add_argument("--devices", type=int, default=8, help="without an "
                 "accelerator: simulate this many CPU devices (default 8)")
  p.add_argument("--coordinator", metavar="HOST:PORT",
                 help="multi-host: address of process 0")
  p.add_argument("--num-processes", type=int)
  p.add_argument("--process-id", type=int)
  p.add_argument("--mesh", metavar="replica=R,data=D",
                 help="hybrid sharding for multi-node runs: the stage shards "
                 "over data (the GPUs of a node) and replicates over replica "
                 "(the nodes); R x D must be the device count (default: every "
                 "device on data)")
  p.add_argument("--tp", type=int, default=1, metavar="M",
                 help="tensor parallelism beside ZeRO: attention heads and "
                 "MLP split over a 'model' axis of M devices, ZeRO over the "
                 "other N/M ('data'); a mesh (data=N/M, model=M)")
  p.add_argument("--embed-blocks", type=int, default=0, metavar="K",
                 help="the tied embedding as a zerojax.nn.BlockedEmbed of K "
                 "vocabulary blocks: no logits in memory (the head's loss "
                 "runs block by block), and at stage 3 one block of the "
                 "table gathered at a time (0: nn.Embed)")
  p.add_argument("--attention", choices=["auto", "einsum", "cudnn"],
                 default="auto", help="einsum: scores written out, softmax "
                 "in fp32; cudnn: jax.nn.dot_product_attention's cuDNN flash "
                 "attention (NVIDIA GPU, bf16/fp16; 1.57x the einsum's "
                 "tokens/s at stage 3 on one H200, benchmarks/results). "
                 "auto: cudnn on a GPU in half precision, else einsum")
  p.add_argument("--hpz", action="store_true",
                 help="with --mesh: ZeRO++ hpZ, the fp32 master and optimizer "
                 "state sharded over replica x data too; each step gathers "
                 "the parameters over replica once, then only within data")
  p.add_argument("--quantize-weights", choices=["int8", "int4"],
                 help="ZeRO++ qwZ: send parameter gathers as int8 (or int4) "
                 "blocks with a float32 scale each")
  p.add_argument("--quantize-grads", choices=["int8", "int4"],
                 help="ZeRO++ qgZ: send gradient reduce-scatters quantized, "
                 "by all-to-all, summed in float32")
  p.add_argument("--quantize-block", type=int, default=256,
                 help="elements per quantization block (default 256)")
  p.add_argument("--offload", nargs="?", const="host",
                 choices=["host", "disk"],
                 help="ZeRO-Offload: keep fp32 master shards and optimizer "
                 "state in pinned host memory between steps (--offload or "
                 "--offload host; stage >= 1); --offload disk "
                 "(ZeRO-Infinity) keeps the optimizer state in files under "
                 "--offload-dir instead, streamed through host memory a "
                 "chunk at a time and updated on the host")
  p.add_argument("--offload-dir", metavar="DIR",
                 help="with --offload disk: an existing directory on a fast "
                 "local disk for its files (scratch)")
  p.add_argument("--sub-group-size", type=int, metavar="N",
                 help="with --offload disk: stream each device's shard of a "
                 "chunk N elements at a time (DeepSpeed's sub_group_size), "
                 "bounding host memory below the largest chunk; default "
                 "a whole chunk")
  p.add_argument("--update-on", choices=["device", "host"],
                 help="with --offload host: run the offloaded optimizer "
                 "update on the host, where its state lives (only the "
                 "gradient goes to the host; stage 3, or bf16 at stages "
                 "1-2). Default device; --offload disk updates on the host")
  p.add_argument("--checkpoint-dir", metavar="DIR",
                 help="save an (asynchronous) orbax checkpoint here every "
                 "--save-every steps and at the end")
  p.add_argument("--save-every", type=int, default=0,
                 help="steps between checkpoints (0: only at the end)")
  p.add_argument("--resume", action="store_true",
                 help="continue from the newest checkpoint in "
                 "--checkpoint-dir (any device count or stage)")
  args = p.parse_args(argv)
  if args.resume and not args.checkpoint_dir:
    p.error("--resume needs --checkpoint-dir")
  if args.update_on == "host" and not args.offload:
    p.error("--update-on host runs the update where --offload keeps the "
            "optimizer state; add --offload")
  if args.offload == "disk" and not args.offload_dir:
    p.error("--offload disk keeps the optimizer state in files; add "
            "--offload-dir DIR (an existing directory on a local disk)")
  if args.offload_dir and args.offload != "disk":
    p.error("--offload-dir is where --offload disk keeps its files; add "
            "--offload disk")
  if args.sub_group_size is not None and args.offload != "disk":
    p.error("--sub-group-size sets how --offload disk streams its files; "
            "add --offload disk")
  if args.offload == "disk" and args.update_on == "device":
    p.error("--offload disk updates on the host as the state streams from "
            "disk; drop --update-on device")
  if (args.coordinator is None) != (args.num_processes is None) or (
      args.coordinator is None) != (args.process_id is None):
    p.error("multi-host needs all of --coordinator, --num-processes and "
            "--process-id (or none of them)")
  for name in ("layers", "width", "batch", "seq", "steps", "accum", "devices",
               "warmup", "quantize_block", "tp"):
    value = getattr(args, name)
    if value is not None and value < (0 if name == "warmup" else 1):
      p.error(f"--{name.replace('_', '-')} must be positive, got {value}")
  return args


def simulate_cpu_devices(n: int) -> None:
  """Asks XLA for `n` host devices. Only the CPU platform reads this flag,
  and only when jax starts it, so it is set before any device is used; it does
  nothing on a machine whose default backend is a GPU or TPU. The GPU
  compiler's flags (`zerojax.compat.GPU_FLAGS`: prefetch of the next
  layer's gather, reduce-scatter beside the backward, matmuls on cuBLAS)
  are set alike; the CPU compiler ignores them."""
  flags = os.environ.get("XLA_FLAGS", "")
  if "xla_force_host_platform_device_count" not in flags:
    flags = (flags + f" --xla_force_host_platform_device_count={n}").strip()
  os.environ["XLA_FLAGS"] = compat.with_gpu_flags(flags)


# (imports jax, which reads XLA_FLAGS only when it starts a backend)
from zerojax import compat  # noqa: E402

if __name__ == "__main__":
  simulate_cpu_devices(parse_args().devices)

# pylint: disable=wrong-import-position
import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from tqdm import tqdm  # noqa: E402

import zerojax  # noqa: E402


# ---- the model -----------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GPTConfig:
  vocab: int
  ctx: int
  layers: int
  width: int
  heads: int
  remat: bool = False
  layerwise: bool = True
  tp: int = 1        # devices of the "model" axis the heads and MLP split over
  embed_blocks: int = 0   # > 0: the tied embedding as a BlockedEmbed
  # "einsum": the scores written out, softmax in fp32; "cudnn":
  # jax.nn.dot_product_attention's cuDNN flash attention (half precision on
  # an NVIDIA GPU; the fp32 init traces XLA's)
  attention: str = "einsum"
  lora_rank: int = 0   # > 0: LoRA adapters beside the attention and MLP kernels


class LoRADense(nn.Module):
  """`nn.Dense` (its `kernel` and `bias`, so a pretrained checkpoint fits)
  plus a low-rank update `x @ lora_a @ lora_b` (LoRA, Hu et al. 2021);
  `lora_b` starts at zero, so the model starts as the pretrained one."""
  features: int
  rank: int
  kernel_init: Any = nn.initializers.lecun_normal()
  bias_init: Any = nn.initializers.zeros

  @nn.compact
  def __call__(self, x):
    d = x.shape[-1]
    kernel = self.param("kernel", self.kernel_init, (d, self.features))
    bias = self.param("bias", self.bias_init, (self.features,))
    a = self.param("lora_a", nn.initializers.normal(1 / math.sqrt(d)),
                   (d, self.rank))
    b = self.param("lora_b", nn.initializers.zeros, (self.rank, self.features))
    x, kernel, bias, a, b = nn.dtypes.promote_dtype(x, kernel, bias, a, b)
    return x @ kernel + bias + (x @ a) @ b


def _dense(cfg: "GPTConfig", features: int, kernel_init, bias_init=None,
           name: str = None):
  """The block's dense layer: `nn.Dense`, or with `cfg.lora_rank` a
  `LoRADense` holding the same `kernel` and `bias`."""
  bias_init = bias_init or nn.initializers.zeros
  if cfg.lora_rank:
    return LoRADense(features, cfg.lora_rank, kernel_init, bias_init, name=name)
  return nn.Dense(features, kernel_init=kernel_init, bias_init=bias_init,
                  name=name)


def _split(init, cfg: GPTConfig, spec: tuple):
  """`init`, annotated with the mesh axes per dim of its weight under tensor
  parallelism (Megatron's split: column-parallel into the heads and the
  MLP's hidden layer, row-parallel out of them); zerojax reads these boxes
  (`model_axis="model"`) and GSPMD adds the model's own all-reduces."""
  return nn.with_partitioning(init, spec) if cfg.tp > 1 else init


def _normal(std):
  return nn.initializers.normal(stddev=std)


class CausalSelfAttention(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    cfg = self.cfg
    h = cfg.heads
    # dtype=None everywhere: compute in the dtype of the parameters handed in.
    # columns head-major (each head's q, k, v side by side), so a column
    # split over "model" gives each device whole heads
    qkv = _dense(cfg, 3 * d, _split(_normal(0.02), cfg, (None, "model")),
                 _split(nn.initializers.zeros, cfg, ("model",)), name="qkv")(x)
    q, k, v = jnp.split(qkv.reshape(b, t, h, 3 * (d // h)), 3, axis=3)
    if cfg.attention == "cudnn":
      half = q.dtype in (jnp.bfloat16, jnp.float16)
      y = jax.nn.dot_product_attention(
          q, k, v, is_causal=True,
          implementation="cudnn" if half else "xla").reshape(b, t, d)
    else:
      scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
      causal = jnp.tril(jnp.ones((t, t), bool))
      scores = jnp.where(causal, scores / math.sqrt(d // h), -1e9)
      probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
      y = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d)
    # GPT-2: residual projections scaled by 1/sqrt(2 * layers).
    return _dense(cfg, d, _split(_normal(0.02 / math.sqrt(2 * cfg.layers)),
                                 cfg, ("model", None)), name="proj")(y)


class MLP(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x):
    d, cfg = x.shape[-1], self.cfg
    x = _dense(cfg, 4 * d, _split(_normal(0.02), cfg, (None, "model")),
               _split(nn.initializers.zeros, cfg, ("model",)), name="fc")(x)
    x = nn.gelu(x, approximate=True)
    return _dense(cfg, d, _split(_normal(0.02 / math.sqrt(2 * cfg.layers)),
                                 cfg, ("model", None)), name="proj")(x)


class Block(nn.Module):
  """Pre-LayerNorm transformer block, written as a scan body (carry, _)."""
  cfg: GPTConfig

  @nn.compact
  def __call__(self, x, _):
    x = x + CausalSelfAttention(self.cfg, name="attn")(nn.LayerNorm(name="ln_1")(x))
    x = x + MLP(self.cfg, name="mlp")(nn.LayerNorm(name="ln_2")(x))
    return x, None


class GPT(nn.Module):
  cfg: GPTConfig

  @nn.compact
  def __call__(self, tokens, targets=None):
    """Next-token logits; with `targets`, the mean cross entropy (what
    `--embed-blocks` computes without the logits)."""
    cfg = self.cfg
    if cfg.embed_blocks:
      # zerojax.nn.BlockedEmbed: nn.Embed by vocabulary blocks, a layer stack
      # (stacked=("blocks", "wte")) gathered one block at a time at stage 3
      wte = zerojax.nn.BlockedEmbed(cfg.vocab, cfg.width, cfg.embed_blocks,
                                    embedding_init=_normal(0.02), name="wte")
    else:
      wte = nn.Embed(cfg.vocab, cfg.width, embedding_init=_normal(0.02),
                     name="wte")
    wpe = nn.Embed(cfg.ctx, cfg.width, embedding_init=_normal(0.01), name="wpe")
    x = wte(tokens) + wpe(jnp.arange(tokens.shape[1]))
    if cfg.layerwise:
      # zerojax's one-line opt-in: at stage 3 each layer's chunk is gathered
      # right before it runs and again in the backward pass.
      block = zerojax.nn.layerwise(Block, prevent_cse=False)
    else:
      block = nn.remat(Block, prevent_cse=False) if cfg.remat else Block
    # One scanned block: parameters get a leading layer axis, which
    # zerojax's stacked=("blocks",) chunks per layer.
    blocks = nn.scan(block, variable_axes={"params": 0},
                     split_rngs={"params": True}, length=cfg.layers,
                     metadata_params={nn.PARTITION_NAME: None})  # layers unsplit
    x, _ = blocks(cfg, name="blocks")(x, None)
    x = nn.LayerNorm(name="ln_f")(x)
    if targets is None:
      return wte.attend(x)  # tied output embedding: x @ wte.T
    if cfg.embed_blocks:
      return wte.cross_entropy(x, targets).mean()
    return cross_entropy(wte.attend(x), targets)


def cross_entropy(logits, targets):
  logits = logits.astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def decay_mask(params):
  """AdamW decays kernels and embeddings, never biases or LayerNorm scales.
  By name, not ndim: scanned leaves carry an extra layer axis."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: getattr(path[-1], "key", None) in ("kernel", "embedding"),
      params)


# ---- data ----------------------------------------------------------------------
class Batches:
  """Global batches {"tokens", "targets"} of int32 [batch, seq], host numpy.

  Every process draws the same global batch (same seed); the step keeps the
  slices its devices hold.
  """

  def __init__(self, vocab: int, batch: int, seq: int, seed: int,
               text: Optional[str] = None):
    self.batch, self.seq = batch, seq
    self.rng = np.random.default_rng(seed)
    if text is not None:
      with open(text, "rb") as f:
        self.corpus = np.frombuffer(f.read(), np.uint8).astype(np.int32)
      if len(self.corpus) < seq + 2:
        raise ValueError(f"--text {text} has {len(self.corpus)} bytes; it "
                         f"needs more than --seq + 1 = {seq + 1}.")
      self.probs = None
      self.description = f"bytes of {text} ({len(self.corpus):,} bytes)"
    else:
      # Zipf's law over a shuffled vocabulary: the frequencies of words.
      ranks = np.arange(1, vocab + 1, dtype=np.float64)
      self.probs = self.rng.permutation(1.0 / ranks / np.sum(1.0 / ranks))
      self.entropy = float(-np.sum(self.probs * np.log(self.probs)))
      self.description = (f"random tokens, Zipf over {vocab} ids (entropy "
                          f"{self.entropy:.2f} nats; uniform would be "
                          f"{math.log(vocab):.2f})")

  def __next__(self) -> dict:
    if self.probs is not None:
      windows = self.rng.choice(len(self.probs), size=(self.batch, self.seq + 1),
                                p=self.probs).astype(np.int32)
    else:
      starts = self.rng.integers(0, len(self.corpus) - self.seq, size=self.batch)
      windows = self.corpus[starts[:, None] + np.arange(self.seq + 1)]
    return {"tokens": windows[:, :-1], "targets": windows[:, 1:]}


# ---- measurements --------------------------------------------------------------
def memory_summary(state, step, batch) -> dict:
  """Bytes per device: the state's arrays (zerojax.memory_report), and the
  compiled step's footprint (arguments + outputs + temporaries - donated
  aliases, zerojax.compiled_footprint)."""
  report = zerojax.memory_report(state)
  compiled = zerojax.compiled_footprint(step.lower(state, batch).compile())
  return {"persistent_bytes_per_device": int(report.persistent),
          "persistent_by_kind": report.by_kind(),   # device, pinned_host, disk
          "compiled_footprint_bytes_per_device": int(compiled["footprint"]),
          "compiled": compiled, "report": str(report)}


# Dense 16-bit peak per chip, TFLOP/s (vendor datasheets).
_PEAK_TFLOPS = (("H100 PCIe", 756), ("H100 NVL", 835), ("H100", 989),
                ("H200", 989), ("H800", 989), ("A100", 312), ("L40S", 362),
                ("TPU v5p", 459), ("TPU v5 lite", 197), ("TPU v4", 275))


def peak_tflops(device_kind: str) -> Optional[float]:
  return next((p for k, p in _PEAK_TFLOPS if k in device_kind), None)


def flops_per_token(cfg: GPTConfig, params: int, seq: int) -> float:
  """Training FLOPs per token (PaLM appendix B): 6 x matmul parameters
  (the position table is a lookup) + 12 x layers x width x seq (attention)."""
  return 6 * (params - cfg.ctx * cfg.width) + 12 * cfg.layers * cfg.width * seq


def _mib(n) -> str:
  return "n/a" if n is None else f"{n / 2**20:,.2f} MiB"


# ---- setup ---------------------------------------------------------------------
def init_distributed(args) -> None:
  """jax.distributed for multi-host runs; a no-op on one host."""
  env_world = max(int(os.environ.get("SLURM_NTASKS", "1")),
                  int(os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
  if args.coordinator is None and env_world <= 1:
    return
  # Hosts without accelerators need a CPU collectives backend.
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if args.coordinator is not None:
    jax.distributed.initialize(args.coordinator, args.num_processes,
                               args.process_id)
  else:
    jax.distributed.initialize()  # reads SLURM / Open MPI variables


def make_mesh(spec, devices, tp: int = 1):
  """`(mesh, replica axis)` of the `--mesh replica=R,data=D` and `--tp M`
  flags: (replica R, data D), with a "model" axis of M after them under
  `--tp` ((data N/M, model M) without `--mesh`); `(None, None)` with
  neither: every device on the data axis."""
  model = ((tp,), ("model",)) if tp > 1 else ((), ())
  if not spec:
    if tp == 1:
      return None, None
    return jax.make_mesh((len(devices) // tp,) + model[0], ("data",) + model[1],
                         axis_types=(jax.sharding.AxisType.Auto,) * 2), None
  try:
    dims = {k: int(v) for k, v in (item.split("=") for item in spec.split(","))}
  except ValueError:
    raise SystemExit(f"--mesh {spec!r}: write it as replica=R,data=D.") from None
  want = len(devices) // tp
  if set(dims) != {"replica", "data"} or dims["replica"] * dims["data"] != want:
    raise SystemExit(f"--mesh {spec!r}: needs replica=R,data=D with R x D = "
                     f"{want} devices" + (f" ({len(devices)} / --tp {tp})"
                                          if tp > 1 else "") + ".")
  shape = (dims["replica"], dims["data"]) + model[0]
  mesh = jax.make_mesh(shape, ("replica", "data") + model[1],
                       axis_types=(jax.sharding.AxisType.Auto,) * len(shape))
  return mesh, "replica"


def resolve(args, backend: str, n_devices: int) -> tuple:
  """(GPTConfig, run settings) from the preset and the flags."""
  accel = backend != "cpu"
  name = args.preset if args.preset != "auto" else ("medium" if accel else "cpu")
  pre = PRESETS[name]
  width = args.width or pre["width"]
  heads = pre["heads"] if args.width is None else max(1, width // 64)
  if width % heads:
    raise SystemExit(f"--width {width} is not divisible by {heads} heads.")
  if n_devices % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the {n_devices} devices.")
  if args.embed_blocks < 0:
    raise SystemExit(f"--embed-blocks must be 0 (nn.Embed) or a number of "
                     f"vocabulary blocks, got {args.embed_blocks}.")
  if heads % args.tp:
    raise SystemExit(f"--tp {args.tp} does not divide the {heads} heads: "
                     "each model device computes whole heads.")
  vocab = BYTE_VOCAB if args.text else pre["vocab"]
  if args.embed_blocks > vocab:
    raise SystemExit(f"--embed-blocks {args.embed_blocks} is more than the "
                     f"{vocab} words: give at most one block per word.")
  seq = args.seq or min(pre["seq"], pre["ctx"])
  precision = (args.precision if args.precision != "auto"
               else ("bf16" if accel else "fp32"))
  attention = args.attention
  if attention == "auto":
    attention = ("cudnn" if backend == "gpu" and precision != "fp32"
                 else "einsum")
  elif attention == "cudnn" and (backend != "gpu" or precision == "fp32"):
    raise SystemExit(f"--attention cudnn needs an NVIDIA GPU and --precision "
                     f"bf16 or fp16 (here: {backend}, {precision}); use "
                     "--attention einsum.")
  cfg = GPTConfig(vocab=vocab, ctx=max(pre["ctx"], seq),
                  layers=args.layers or pre["layers"], width=width, heads=heads,
                  remat=args.remat, layerwise=args.layerwise, tp=args.tp,
                  embed_blocks=args.embed_blocks, attention=attention)
  steps = args.steps or pre["steps"]
  batch = args.batch or pre["micro_batch"] * n_devices * args.accum
  data = n_devices // args.tp   # the devices a batch is split over
  if batch % (data * args.accum):
    raise SystemExit(f"--batch {batch} must be a multiple of {data} "
                     f"data devices x --accum {args.accum}.")
  run = dict(
      preset=name, seq=seq, steps=steps, batch=batch,
      lr=args.lr or pre["lr"],
      warmup=args.warmup if args.warmup is not None else max(1, steps // 10),
      precision=precision)
  return cfg, run


def zero_options(args, run: dict, replica_axis, embed_blocks: bool) -> dict:
  """The command line's ZeRO flags as `zerojax.create`'s options, in one
  place."""
  if args.offload == "disk":
    offload = zerojax.Offload("disk", dir=args.offload_dir,
                              sub_group_size=args.sub_group_size)
  elif args.offload == "host":
    offload = zerojax.Offload("host", update_on=args.update_on)
  else:
    offload = None
  return dict(
      stage=args.stage, precision=run["precision"], offload=offload,
      axes=zerojax.Axes(replica=replica_axis, hpz=args.hpz,
                        model="model" if args.tp > 1 else None),
      quantize=zerojax.Quantize(weights=args.quantize_weights,
                                grads=args.quantize_grads,
                                block=args.quantize_block),
      blocks=zerojax.Blocks(stacked=("blocks", "wte") if embed_blocks
                            else ("blocks",)),
      accum_steps=args.accum, clip_norm=args.clip or None)


def main(argv=None) -> dict:
  """Trains and returns {"config", "steps", "memory", "timing"}."""
  args = parse_args(argv)
  simulate_cpu_devices(args.devices)  # in-process callers: only if jax has not started
  init_distributed(args)
  backend, devices = jax.default_backend(), jax.devices()
  is_main = jax.process_index() == 0
  log = print if is_main else (lambda *a, **k: None)
  if backend == "cpu" and len(devices) != args.devices * jax.process_count():
    log(f"note: {len(devices)} CPU devices (jax had started before "
        f"--devices {args.devices} could apply)")
  cfg, run = resolve(args, backend, len(devices))

  model = GPT(cfg)
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, run["lr"], run["warmup"], max(run["steps"], run["warmup"] + 1),
      end_value=run["lr"] / 10)
  tx = optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=args.weight_decay,
                   mask=decay_mask)

  def init_fn(rng):
    return model.init(rng, jnp.zeros((1, run["seq"]), jnp.int32))["params"]

  # Sharded initialisation: every device makes only its own chunk shards
  # (the same values as model.init followed by zerojax.shard on a TrainState).
  mesh, replica_axis = make_mesh(args.mesh, devices, args.tp)
  if args.hpz and replica_axis is None:
    raise SystemExit("--hpz shards the state over the replica axis too: "
                     "give --mesh replica=R,data=D as well.")
  state = zerojax.create(init_fn, jax.random.key(args.seed),
                         apply_fn=model.apply, tx=tx, mesh=mesh,
                         **zero_options(args, run, replica_axis,
                                        cfg.embed_blocks))
  num_params = state.layout.num_chunked_elements
  if args.resume:
    state = zerojax.checkpoint.restore(args.checkpoint_dir, like=state,
                                       mesh=state.mesh)
    log(f"resumed from {args.checkpoint_dir} at step {int(state.step)}")

  def loss_fn(params, batch):
    return model.apply({"params": params}, batch["tokens"], batch["targets"])

  step = zerojax.train_step(loss_fn)
  data = Batches(cfg.vocab, run["batch"], run["seq"], args.seed, args.text)
  tokens_per_step = run["batch"] * run["seq"]
  kind = devices[0].device_kind
  layout = state.layout
  chunks = (f"{len(layout.chunks)} chunks ("
            f"{sum(1 for c in layout.chunks if c.layers)} stacked per layer), "
            f"{layout.num_chunked_elements:,} elements + "
            f"{layout.num_padding_elements:,} padding")
  config = {**vars(args), **run, "model": dataclasses.asdict(cfg),
            "num_params": num_params, "devices": len(devices),
            "processes": jax.process_count(), "backend": backend,
            "device_kind": kind, "data": data.description,
            "chunks": chunks, "mesh_shape": dict(state.mesh.shape)}
  log(f"GPT-2 '{run['preset']}': {num_params:,} params, {cfg.layers} layers x "
      f"{cfg.width} wide, {cfg.heads} heads, vocab {cfg.vocab}")
  hybrid = (f" (hybrid: sharded over data {state.num_shards}, replicated "
            f"over replica {state.num_replicas})" if replica_axis else "")
  if args.hpz:
    hybrid = (f" (hpZ: state sharded over replica {state.num_replicas} x data "
              f"{state.num_shards}, gathered within data)")
  if args.tp > 1:
    hybrid += (f" (tensor parallel: heads and MLP split over model {args.tp}, "
               f"ZeRO over data {state.num_shards})")
  log(f"ZeRO stage {args.stage} over {len(devices)} {backend} devices "
      f"({kind}){hybrid}, {run['precision']} compute, batch {run['batch']} x "
      f"{run['seq']} tokens, accum {args.accum}, lr {run['lr']:g}")
  log(f"data: {data.description}")
  log(f"chunks: {chunks}")

  records = []
  first = int(state.step) + 1
  for _ in range(first - 1):
    next(data)  # the batches the resumed run already saw
  bar = tqdm(range(first, run["steps"] + 1), disable=not is_main, unit="step",
             dynamic_ncols=True)
  for i in bar:
    batch = next(data)
    start = time.perf_counter()
    state, metrics = step(state, batch)
    loss = float(metrics["loss"])  # blocks until the step is done
    seconds = time.perf_counter() - start
    records.append({"step": i, "loss": loss,
                    "grad_norm": float(metrics["grad_norm"]),
                    "tokens_per_s": tokens_per_step / seconds,
                    "step_time_s": seconds})
    bar.set_postfix(loss=f"{loss:.4f}", tok_s=f"{tokens_per_step / seconds:,.0f}",
                    step_s=f"{seconds:.3f}")
    if args.checkpoint_dir and (i == run["steps"] or (
        args.save_every and i % args.save_every == 0)):
      zerojax.checkpoint.save(args.checkpoint_dir, state, keep=3)
  bar.close()
  if args.checkpoint_dir:
    zerojax.checkpoint.wait(args.checkpoint_dir)

  # Step 1 includes compilation; throughput is measured on the rest.
  steady = records[1:]
  timing = {"first_step_s": records[0]["step_time_s"]}
  if steady:
    seconds = sum(r["step_time_s"] for r in steady)
    timing["tokens_per_s"] = tokens_per_step * len(steady) / seconds
    timing["step_time_s"] = seconds / len(steady)
  memory = memory_summary(state, step, batch)
  psi = layout.num_chunked_elements
  split = layout.num_split_elements
  expected = zerojax.estimate_memory(
      psi, stage=args.stage, num_devices=state.num_state_shards,
      compute_dtype=jnp.float32 if run["precision"] == "fp32" else jnp.bfloat16,
      optimizer_bytes_per_param=8,   # AdamW: two fp32 moments
      split_params=split, model_shards=args.tp)["persistent"]

  floor = (f" (data entropy, the floor: {data.entropy:.4f})"
           if data.probs is not None else "")
  log(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over "
      f"{len(records)} steps{floor}; first step (compile + run) "
      f"{timing['first_step_s']:.1f} s")
  if steady:
    log(f"throughput {timing['tokens_per_s']:,.0f} tokens/s, "
        f"{timing['step_time_s'] * 1e3:,.1f} ms/step (steps 2-{len(records)})")
  log(f"memory per device: state {_mib(memory['persistent_bytes_per_device'])} "
      f"(ZeRO-{args.stage} with AdamW should need {_mib(expected)} for "
      f"{psi:,} parameters on {len(devices)} devices"
      f"{', tensor parallel' if args.tp > 1 else ''}), "
      f"compiled step {_mib(memory['compiled_footprint_bytes_per_device'])}")
  log(memory["report"])
  if backend != "cpu" and steady:
    achieved = (timing["tokens_per_s"] * flops_per_token(cfg, num_params, run["seq"])
                / len(devices) / 1e12)
    peak = peak_tflops(kind)
    timing["tflops_per_device"] = achieved
    timing["mfu"] = achieved / peak if peak else None
    log(f"{achieved:.1f} TFLOP/s per device, MFU " +
        (f"{100 * achieved / peak:.1f}% of {peak} TFLOP/s (16-bit dense peak)"
         if peak else f"unknown (no peak on record for {kind!r})"))

  result = {"config": config, "steps": records, "memory": memory,
            "timing": timing}
  if args.json and is_main:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=1)
  return result


if __name__ == "__main__":
  main()
