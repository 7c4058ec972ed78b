"""Per-device memory of the variants: persistent state and compiled footprint.

  persistent  bytes of the train state on one device: the first shard of
              every array of the state (`x.addressable_shards[0].data.nbytes`),
              or, for a state too large to allocate on this host, the same
              sum from the arrays' shapes and shardings
  footprint   `compiled.memory_analysis()` of the step: argument + output +
              temp - alias (what one device needs to run the step; the CPU
              backend's peak figure is not meaningful)
  theory      ZeRO's persistent bytes, fp32 parameters with Adam, Ψ
              parameters on N devices: 12Ψ (stage 0, plain DP), 4Ψ + 8Ψ/N
              (stages 1-2), 12Ψ/N (stage 3, FSDP)
"""
from __future__ import annotations

import gc
from typing import Callable, Dict, Iterable, Optional

import zerojax
from zerojax._core import compat
from benchmarks import variants as V

FORMULA = {"zero-0": "12Ψ", "plain-dp": "12Ψ", "1dev-optax": "12Ψ",
           "1dev-zero-0": "12Ψ",
           "zero-1": "4Ψ+8Ψ/N", "zero-2": "4Ψ+8Ψ/N",
           "zero-3": "12Ψ/N", "gspmd-fsdp": "12Ψ/N", "1dev-zero-3": "12Ψ/N"}

# Programs that are analysed but never run are compiled without LLVM
# optimisation: the HLO, its buffer assignment, memory_analysis() and the
# collectives are the same as with the default options (tests check it),
# compilation is about twice as fast.
# (The options this XLA accepts: `zerojax._core.compat`.)
def analysis_options() -> dict:
  return compat.compiler_options({"xla_backend_optimization_level": 0})


# The depth and chunk-size sweeps also skip the CPU fusion emitters where
# XLA has them: three times faster again; buffers can differ by a few
# hundred bytes, the collectives not at all. Every point of a sweep is
# compiled this way.
def sweep_options() -> dict:
  return compat.compiler_options()


def host_memory() -> Dict[str, int]:
  """MemTotal and MemAvailable of this host, in bytes; MemAvailable counts
  the bytes this process has freed but malloc keeps (`_kept_by_malloc`):
  under the benchmarks' pooled allocator they are most of what it freed,
  and its next allocation reuses them."""
  out = {}
  with open("/proc/meminfo") as f:
    for line in f:
      key, value = line.split(":", 1)
      if key in ("MemTotal", "MemAvailable"):
        out[key] = int(value.split()[0]) * 1024
  out["MemAvailable"] += _kept_by_malloc()
  return out


def _kept_by_malloc() -> int:
  """Free bytes in glibc's malloc arenas (`mallinfo2().fordblks`), 0 where
  that is not glibc's or too old to have it."""
  import ctypes

  class _Info(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
        "fsmblks", "uordblks", "fordblks", "keepcost")]
  try:
    mallinfo2 = ctypes.CDLL(None).mallinfo2
  except (OSError, AttributeError):
    return 0
  mallinfo2.restype = _Info
  return int(mallinfo2().fordblks)


def allocation_check(name: str, num_params: int, n: int,
                     fraction: float = 0.6) -> str:
  """Why this variant's state should not be allocated on this host, or ""
  when it can be: its state on all n simulated devices, next to the
  unsharded source state (12Ψ), must stay within `fraction` of the memory
  available now (other jobs share the host)."""
  per_device = V.theory_bytes(name, num_params, n)
  devices = 1 if name in V.ONE_DEVICE_VARIANTS else n
  need = per_device * devices + 12.0 * num_params
  available = host_memory()["MemAvailable"]
  if need <= fraction * available:
    return ""
  return (f"state not allocated: {need / 2 ** 30:.1f} GiB (the state on "
          f"{devices} simulated devices plus the unsharded source state) is "
          f"more than {fraction:.0%} of the {available / 2 ** 30:.1f} GiB "
          "available; bytes from shapes and shardings, program compiled from "
          "the abstract state")


def footprint(compiled) -> Dict[str, int]:
  """argument, output, temp, alias and footprint bytes per device (see
  `zerojax.compiled_footprint`, which also splits off host bytes)."""
  full = zerojax.compiled_footprint(compiled)
  return {k: full[k] for k in ("argument", "output", "temp", "alias", "footprint")}


def row(v: V.Variant, compiled=None, note: str = "") -> dict:
  """The memory row of one built variant."""
  compiled = compiled if compiled is not None else v.compiled()
  theory = V.theory_bytes(v.name, v.num_params, v.num_devices)
  persistent = v.persistent_bytes()
  out = {"variant": v.name, "num_params": v.num_params,
         "devices": v.num_devices, "persistent_bytes": persistent,
         "persistent_from": ("addressable_shards" if v.materialized
                             else "shapes"),
         "theory": FORMULA.get(v.name), "theory_bytes": theory,
         "persistent_over_theory": persistent / theory if theory else None,
         **footprint(compiled)}
  total = host_memory()["MemTotal"]
  out["host_bytes_to_run"] = out["footprint"] * v.num_devices
  out["runs_on_this_host"] = out["host_bytes_to_run"] <= total
  if note:
    out["note"] = note
  return out


def depth_sweep(cfg, layers: Iterable[int], names: Iterable[str],
                build: Callable[..., V.Variant]) -> dict:
  """Compiled footprint per device against the number of layers.

  Args:
    cfg: the model config whose depth is varied.
    layers: the depths.
    names: the variants.
    build: `build(name, cfg, materialize=..., options=...)`.

  Returns:
    {"layers", "num_params", "footprint": {variant: [bytes per depth]}};
    programs are compiled from abstract states with `sweep_options()`.
  """
  layers = list(layers)
  out = {"layers": layers, "num_params": [], "footprint": {}}
  for depth in layers:
    c = cfg.replace(layers=depth)
    out["num_params"].append(c.num_params)
    for name in names:
      v = build(name, c, materialize=False, options=sweep_options())
      out["footprint"].setdefault(name, []).append(
          footprint(v.compiled())["footprint"])
      del v
    gc.collect()
  return out


def stage3_expected(cfg, per_device_batch: int, seq: int, n: int) -> dict:
  """What a ZeRO-3 step of a GPT config needs per device, fp32 + AdamW, by
  the issue's yardstick "12Ψ/N + the gradient shard 4Ψ/N + activations +
  two gathered layers":

    state           12Ψ/N
    gradient shard  4Ψ/N (reduce-scattered in the backward pass, read by
                    the update)
    two layers      2 x 4 bytes x the parameters of one block, gathered
    activations     the saved input of every block (layerwise remat keeps
                    only those: L x b x s x w x 4) plus the logits and their
                    gradient (2 x b x s x V x 4, V the config's `loss_block`
                    or a block of `embed_blocks`' rows where it has one),
                    b = the per-device batch

  Not counted, though the step holds them: the non-layer parameters (the
  tied embedding, gathered for the whole step, and its full gradient
  before the reduce-scatter; a `BlockedEmbed` holds one block of each),
  nor one block's recomputed internals."""
  d, L, V = cfg.width, cfg.layers, cfg.vocab_size
  blocks = getattr(cfg, "embed_blocks", None) or 1
  table = -(-V // blocks) * blocks * d   # a BlockedEmbed's padded rows too
  block = (cfg.num_params - table - cfg.max_len * d - 2 * d) // L
  # a `loss_block` head (`zerojax.losses.linear_cross_entropy`) holds one
  # block of logits and their gradient, not the vocabulary's; so does a
  # `BlockedEmbed` (`embed_blocks`), one block of rows at a time
  logits = min(getattr(cfg, "loss_block", None) or V, V)
  if blocks > 1:
    logits = table // (blocks * d)
  parts = {"state": 12 * cfg.num_params / n,
           "gradient_shard": 4 * cfg.num_params / n,
           "two_layers": 2 * 4 * block,
           "activations": 4 * per_device_batch * seq * (L * d + 2 * logits)}
  parts["total"] = sum(parts.values())
  parts["table_blocks"] = blocks   # not bytes: how the report words it
  return parts


def goal_checks(rows: list, config: str = "", expected: Optional[dict] = None) -> list:
  """[(what, measured, bound, met)]: stage 3 footprint <= GSPMD FSDP's, and
  within 10% of `expected["total"]` (`stage3_expected`) when given."""
  by = {r["variant"]: r for r in rows if "footprint" in r}
  where = f" ({config})" if config else ""
  goals = []
  if "zero-3" in by and "gspmd-fsdp" in by:
    value = by["zero-3"]["footprint"] / by["gspmd-fsdp"]["footprint"]
    goals.append((f"zero-3 footprint / gspmd-fsdp footprint{where}", value,
                  1.0, value <= 1.0))
  if "zero-3" in by and expected:
    value = by["zero-3"]["footprint"] / expected["total"]
    goals.append((f"zero-3 footprint / (12Ψ/N + 4Ψ/N + activations + two "
                   f"gathered layers){where}", value, 1.1, value <= 1.1))
  return goals
