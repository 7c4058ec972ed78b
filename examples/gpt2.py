"""GPT-2 in Flax linen as `gpt2_medium.py` trains it: the model (blocks as
one `flax.linen.scan`, optionally LoRA adapters, a tied or blocked
embedding, Megatron's tensor-parallel split), its data, the figures the run
prints (memory, FLOPs, MFU) and the cluster set-up (multi-host, meshes).
Nothing here is zerojax-specific but `zerojax.nn.layerwise` and
`zerojax.nn.BlockedEmbed`, the model's two opt-ins.

Imports jax: `gpt2_medium.py` imports it once XLA_FLAGS are set.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import zerojax

BYTE_VOCAB = 256


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
  """Batches {"tokens", "targets"} of int32 [batch, seq], host numpy: the
  global batch on one process; each process's own rows on several (its
  share of the batch, its own seed and --text), which the step assembles
  into the global batch (process-local batches, docs/multinode.md).
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


def summarize(records: list, state, step, batch, *, cfg: GPTConfig, run: dict,
              stage: int, data: Batches, log) -> tuple:
  """`(timing, memory)` of a finished run, said through `log`: the loss,
  the throughput (step 1 includes compilation: measured on the rest), the
  memory per device against `zerojax.estimate_memory`, and on an
  accelerator the MFU."""
  layout, n = state.layout, state.mesh.devices.size
  backend, kind = jax.default_backend(), state.mesh.devices.flat[0].device_kind
  tokens_per_step, num_params = run["batch"] * run["seq"], layout.num_chunked_elements
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
      psi, stage=stage, num_devices=state.num_state_shards,
      compute_dtype=jnp.float32 if run["precision"] == "fp32" else jnp.bfloat16,
      optimizer_bytes_per_param=8,   # AdamW: two fp32 moments
      split_params=split, model_shards=cfg.tp)["persistent"]

  last = records[-10:]
  mean = sum(r["loss"] for r in last) / len(last)
  # a batch's loss scatters around the model's mean loss, which the data's
  # entropy bounds from below: one batch may fall under it by chance
  floor = (f"; the data's entropy {data.entropy:.4f} is the least a model's "
           "mean loss can reach" if data.probs is not None else "")
  log(f"loss {records[0]['loss']:.4f} -> {records[-1]['loss']:.4f} over "
      f"{len(records)} steps (mean of the last {len(last)}: {mean:.4f}"
      f"{floor}); first step (compile + run) "
      f"{timing['first_step_s']:.1f} s")
  if steady:
    log(f"throughput {timing['tokens_per_s']:,.0f} tokens/s, "
        f"{timing['step_time_s'] * 1e3:,.1f} ms/step (steps 2-{len(records)})")
  log(f"memory per device: state {_mib(memory['persistent_bytes_per_device'])} "
      f"(ZeRO-{stage} with AdamW should need {_mib(expected)} for "
      f"{psi:,} parameters on {n} devices"
      f"{', tensor parallel' if cfg.tp > 1 else ''}), "
      f"compiled step {_mib(memory['compiled_footprint_bytes_per_device'])}")
  log(memory["report"])
  if backend != "cpu" and steady:
    achieved = (timing["tokens_per_s"] * flops_per_token(cfg, num_params, run["seq"])
                / n / 1e12)
    peak = peak_tflops(kind)
    timing["tflops_per_device"] = achieved
    timing["mfu"] = achieved / peak if peak else None
    log(f"{achieved:.1f} TFLOP/s per device, MFU " +
        (f"{100 * achieved / peak:.1f}% of {peak} TFLOP/s (16-bit dense peak)"
         if peak else f"unknown (no peak on record for {kind!r})"))

  return timing, memory


def describe(state, cfg: GPTConfig, run: dict, args, data: Batches,
             log) -> dict:
  """The run's set-up said through `log` (model, mesh, data, chunks), and
  returned for its JSON record."""
  n, backend = state.mesh.devices.size, jax.default_backend()
  kind = state.mesh.devices.flat[0].device_kind
  num_params, replica_axis = state.layout.num_chunked_elements, args.mesh
  layout = state.layout
  chunks = (f"{len(layout.chunks)} chunks ("
            f"{sum(1 for c in layout.chunks if c.layers)} stacked per layer), "
            f"{layout.num_chunked_elements:,} elements + "
            f"{layout.num_padding_elements:,} padding")
  config = {"num_params": num_params, "devices": n,
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
  log(f"ZeRO stage {args.stage} over {n} {backend} devices "
      f"({kind}){hybrid}, {run['precision']} compute, batch {run['batch']} x "
      f"{run['seq']} tokens, accum {args.accum}, lr {run['lr']:g}")
  log(f"data: {data.description}")
  log(f"chunks: {chunks}")
  return config
