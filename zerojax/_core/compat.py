"""Choices that depend on the installed jax / XLA, probed once, in one place.

XLA's compile options come and go between releases: an option an older XLA
accepts (`xla_cpu_use_fusion_emitters`) is refused by a newer one with "No
such compile option", which fails the whole compile. Options here only make
compiles cheaper, never change results, so one this XLA lacks is dropped
(logged once) rather than failing. The library, the tests and the
benchmarks all ask `compiler_options` for theirs.

`with_gpu_flags` is the other side: XLA flags (read once, when jax starts a
backend) that let a GPU run ZeRO's collectives beside compute, and run its
matmuls on cuBLAS.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import logging
from typing import Optional

import jax
import numpy as np

_log = logging.getLogger("zerojax")

# Compiles of programs that are analysed but never run (the planner's, the
# tests'): no LLVM optimisation (about half the compile time), and no CPU
# fusion emitters where this XLA has them (a fifth to two thirds less
# again). The HLO, buffer assignment and collectives are
# unchanged; buffers can differ by a few hundred bytes without the emitters.
FAST_COMPILE = {"xla_backend_optimization_level": 0,
                "xla_cpu_use_fusion_emitters": False}


@functools.cache
def _accepted(name: str, value) -> bool:
  """Whether this XLA compiles a trivial program with option `name`."""
  try:
    jax.jit(lambda x: x + 1).lower(np.float32(0)).compile(
        compiler_options={name: value})
  except Exception as e:  # noqa: BLE001 - XLA's error for an unknown option
    _log.info("this XLA refuses compile option %s=%r (%s); "
              "compiling without it.", name, value, str(e).splitlines()[0])
    return False
  return True


def compiler_options(options: Optional[dict] = None) -> dict:
  """The subset of `options` (default `FAST_COMPILE`) that this jax's XLA
  accepts on the default backend, each option probed once."""
  options = FAST_COMPILE if options is None else options
  return {k: v for k, v in options.items() if _accepted(k, v)}


# XLA options of zerojax's own step program, passed to its `jax.jit`
# (`step_compiler_options`): they change that program only, never another
# of the process, and only the GPU compiler reads them. XLA's GPU compiler
# combines independent reduce-scatters up to a size; once every update
# waits for the whole backward (`train_step`), a stage-3 backward's
# per-block gradients are independent, and combined, a block's
# reduce-scatter waits for the blocks below it and the last group runs
# after the backward with nothing to hide it. A zerojax chunk is already
# one reduce-scatter per block (docs/stage3.md, "The program 8 GPUs run").
STEP_OPTIONS = {"xla_gpu_reduce_scatter_combine_threshold_bytes": 0,
                "xla_gpu_all_gather_combine_threshold_bytes": 0}


def step_compiler_options() -> dict:
  """`STEP_OPTIONS` as this XLA accepts them."""
  return compiler_options(STEP_OPTIONS)


# XLA's GPU scheduler overlaps a collective with compute only when allowed to
# (NVIDIA's JAX-Toolbox and MaxText set these for FSDP). For a stage-3 model
# whose layers are scanned (`zerojax.nn.layerwise` under `nn.scan`) the
# pipelined all-gather issues layer i+1's gather in iteration i of the layer
# loop (a prefetch) and the pipelined reduce-scatter sends layer i's gradient
# while layer i-1's backward runs; double buffering unrolls the loop by two
# so that both buffers alternate. Only the GPU compiler reads them; XLA on
# CPU accepts and ignores them (a flag XLA does not know aborts the process:
# tests/test_compat.py starts one with them).
GPU_OVERLAP_FLAGS = {
    "xla_gpu_enable_latency_hiding_scheduler": "true",
    "xla_gpu_enable_pipelined_all_gather": "true",
    "xla_gpu_enable_pipelined_reduce_scatter": "true",
    "xla_gpu_enable_while_loop_double_buffering": "true",
}
# ... and every matmul on cuBLAS rather than XLA's Triton GEMM fusions (as
# MaxText's GPU scripts set): GPT-2's tied head over a 50,257-row
# vocabulary ran slowly as Triton fusions (docs/decisions.md, "The GPU
# leases").
GPU_FLAGS = {**GPU_OVERLAP_FLAGS, "xla_gpu_enable_triton_gemm": "false"}


def with_gpu_flags(xla_flags: str = "") -> str:
  """`xla_flags` (an `XLA_FLAGS` value) with `GPU_FLAGS` added; a flag it
  already sets keeps the caller's value. Put the result in
  `os.environ["XLA_FLAGS"]` before jax first touches a device:

      os.environ["XLA_FLAGS"] = zerojax.with_gpu_flags(
          os.environ.get("XLA_FLAGS", ""))
  """
  named = {f.split("=", 1)[0].lstrip("-") for f in xla_flags.split()}
  extra = [f"--{k}={v}" for k, v in GPU_FLAGS.items() if k not in named]
  return " ".join([xla_flags.strip()] + extra).strip()


def _has_gpu_plugin() -> bool:
  """Whether a CUDA or ROCm plugin of jax is installed (without starting a
  backend)."""
  import importlib.util
  return any(importlib.util.find_spec(name) is not None for name in (
      "jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
      "jax_rocm7_plugin"))


# `ZEROJAX_GPU_FLAGS=0` in the environment: `import zerojax` leaves
# `XLA_FLAGS` as it is, and says nothing of it
OPT_OUT = "ZEROJAX_GPU_FLAGS"


def gpu_flags_action(backends_started: bool, platform: Optional[str],
                     gpu_plugin: bool, xla_flags: str,
                     jax_platforms: str, opt_out: str = "") -> Optional[str]:
  """What `zerojax` does with `GPU_FLAGS` at import: "set" them into
  `XLA_FLAGS` (no backend started yet, a GPU plugin installed, not asked to
  run without GPUs), "warn" (a GPU backend already started without them),
  or nothing (None; CPU, TPU, the flags already there, or `opt_out`, the
  value of `ZEROJAX_GPU_FLAGS`, is "0")."""
  named = {f.split("=", 1)[0].lstrip("-") for f in xla_flags.split()}
  if opt_out.strip() == "0" or all(k in named for k in GPU_FLAGS):
    return None
  if not backends_started:
    wanted = {p.strip() for p in jax_platforms.split(",") if p.strip()}
    if gpu_plugin and (not wanted or wanted & {"cuda", "rocm", "gpu"}):
      return "set"
    return None
  return "warn" if platform == "gpu" else None


def gpu_flags_at_import() -> None:
  """Sets `GPU_FLAGS` in `XLA_FLAGS` where jax has not started a backend
  and would start a GPU one (keeping any flag the user set), and says so
  once, naming the opt-out; warns once where a GPU backend runs without
  them. Called by `import zerojax`."""
  import os
  from jax._src import xla_bridge   # no public "backends started?"
  started = getattr(xla_bridge, "backends_are_initialized", lambda: True)()
  flags = os.environ.get("XLA_FLAGS", "")
  action = gpu_flags_action(
      started, jax.default_backend() if started else None,
      _has_gpu_plugin(), flags, os.environ.get("JAX_PLATFORMS", ""),
      os.environ.get(OPT_OUT, ""))
  if action == "set":
    os.environ["XLA_FLAGS"] = with_gpu_flags(flags)
    added = sorted(set(GPU_FLAGS) - {f.split("=", 1)[0].lstrip("-")
                                     for f in flags.split()})
    _log.warning(
        "added XLA GPU flags to XLA_FLAGS: %s (collectives beside "
        "compute, matmuls on cuBLAS). They apply to every jax program of this "
        "process. A flag you set keeps your value; %s=0 keeps XLA_FLAGS as it "
        "is (the docs' \"Stage 3 on big models\" page, docs/stage3.md: "
        "\"Overlap on GPUs\").", " ".join(added), OPT_OUT)
  elif action == "warn":
    _log.warning(
        "jax started its GPU backend before zerojax was imported, "
        "without zerojax's XLA flags (collectives beside compute, matmuls on "
        "cuBLAS, which made GPT-2 medium's step about a tenth faster on one "
        "H100). Import zerojax first, or set "
        "os.environ['XLA_FLAGS'] = zerojax.with_gpu_flags(...) before "
        "jax starts; %s=0 silences this.", OPT_OUT)


@contextlib.contextmanager
def without_compilation_cache():
  """A context in which jax's persistent compilation cache is off: a
  program compiled for devices this process has no client of (a
  `zerojax.GpuTarget`'s) is written to it but cannot be read back (jax
  warns, then compiles again). jax decides once a process whether it uses
  the cache: the decision is reset on entry and on exit."""
  from jax._src import compilation_cache, config   # no public context
  compilation_cache.reset_cache()
  try:
    with config.enable_compilation_cache(False):
      yield
  finally:
    compilation_cache.reset_cache()


def on_host(fn):
  """`fn` run as a host computation inside a jitted program (XLA's
  `_xla_compute_type = "host"`): its operands must be in host memory, and
  its outputs are left there. jax 0.10's `compute_on` decorates a jitted
  function; jax 0.11+'s also asks for each output's memory space."""
  from jax.experimental.compute_on import compute_on
  if "out_memory_spaces" not in inspect.signature(compute_on).parameters:
    return compute_on("device_host")(jax.jit(fn))

  def run(*args):
    spaces = jax.tree_util.tree_map(lambda _: jax.memory.Space.Host,
                                    jax.eval_shape(fn, *args))
    return compute_on(fn, compute_type="device_host",
                      out_memory_spaces=spaces)(*args)
  return run


# the custom call `write_on_host` lowers to where it cannot run (see there)
ANALYSIS_TARGET = "zerojax_write_on_host"


def write_on_host(fn, *operands) -> None:
  """Inside a `jax.shard_map` manual over every mesh axis: `fn(*operands)`
  called on the host for each device, with that device's operands as numpy
  arrays that are views valid during the call only (`fn` consumes them
  before it returns). An unordered side effect: the program keeps it, and
  `jax.effects_barrier()` waits for it.

  `jax.experimental.io_callback` would first copy its operands onto a CPU
  device; on a CPU backend whose worker threads are all inside such
  callbacks (simulated devices on a few cores), the copies of large
  operands never run and the step hangs. This emits the same host callback
  without that copy, through jax's own lowering (`emit_python_callback`);
  where this jax lacks it, it falls back to `io_callback`. Lowered for a
  platform this process has no backend of (`lowering_platforms=("cuda",)`
  on a CPU machine), it is a custom call named `ANALYSIS_TARGET` with the
  same operands: that text is for reading (its host moves), not for
  running."""
  prim = _write_on_host_p()
  if prim is None:
    from jax.experimental import io_callback
    io_callback(lambda *xs: fn(*map(np.asarray, xs)), None, *operands,
                ordered=False)
    return
  prim.bind(*operands, fn=fn)


@functools.cache
def _write_on_host_p():
  """`write_on_host`'s primitive, or None where jax's internals differ."""
  try:
    from jax._src import callback, core
    from jax._src.interpreters import mlir
    effect, emit = callback._IOEffect, callback.emit_python_callback
    op_sharding, custom_call = callback._callback_op_sharding, mlir.custom_call
  except (ImportError, AttributeError):
    _log.info("jax's host callback internals moved; write_on_host "
              "uses io_callback")
    return None
  optional = {"returns_token": False} if "returns_token" in (
      inspect.signature(emit).parameters) else {}
  prim = core.Primitive("zerojax_write_on_host")
  prim.multiple_results = True

  def call(*args, fn):
    fn(*map(np.asarray, args))
    return []

  prim.def_impl(call)
  prim.def_effectful_abstract_eval(lambda *avals, fn: ([], {effect}))

  def lowering(ctx, *args, fn):
    if ctx.module_context.get_backend(optional=True) is None:
      # lowered for a platform this process has no backend of (a CUDA
      # program's text on a CPU machine, for analysis): a callback cannot be
      # registered, so it stands as a custom call of this name; never run
      custom_call(ANALYSIS_TARGET, result_types=[], operands=list(args),
                  has_side_effect=True)
      return []

    def host(*arrays):
      fn(*arrays)
      return ()
    emit(ctx, host, None, list(args), ctx.avals_in, [], has_side_effect=True,
         sharding=op_sharding(ctx.module_context.axis_context, None, []),
         **optional)
    return []

  mlir.register_lowering(prim, lowering, cacheable=False)
  return prim
