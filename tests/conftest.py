"""8 simulated CPU devices, set before the first `import jax`; and XLA's CPU
backend compiling without LLVM optimisation and, where this XLA still has
the switch (jax 0.10's does, 0.12's does not), with its older fusion
emitters (`FAST`).

The tests check what zerojax emits (its HLO: collectives, pads, copies,
loops; buffer sizes from `memory_analysis`) and its numbers against plain
optax, which XLA's HLO passes decide, not the machine code LLVM makes of
the CPU kernels; compiling is most of the suite's time (tests/test_step.py:
96 s -> 64 s on two workers without LLVM optimisation; with the older
emitters too, docs/decisions.md, "The tests' older fusion emitters"). The
older emitters fuse two programs that compute the same numbers (a tier
against another, an identity encoding against none) differently enough
that they are no longer bit-identical: those tests compare with
`models.assert_same_numbers`, bit for bit under XLA's own emitters. Worker
processes the tests start use the same flags (`ZEROJAX_TEST_FAST_FLAGS`),
so that their numbers compare with the test's. `ZEROJAX_TEST_XLA_DEFAULTS=1`
runs the tests with XLA's own settings. An XLA that does not know a flag
aborts, so each set of flags is tried once in a subprocess, and the first
that starts kept.

Programs are compiled once per run: tests that build the same program (the
same model's reference step, the same stage) read it from jax's
compilation cache in a temporary directory (tests/test_tensor_parallel.py
and tests/test_hybrid.py: 232 s -> 185 s on two workers).
`JAX_COMPILATION_CACHE_DIR`, when set, is used instead.
"""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile

DEVICES = "--xla_force_host_platform_device_count=8"
# each set tried in turn, the first this jax's XLA accepts kept
FAST = ("--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false",
        "--xla_backend_optimization_level=0")


def _accepts(flags: str) -> bool:
  """Whether this jax's XLA starts with `flags` (an unknown flag aborts)."""
  return subprocess.run(
      [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1)"],
      env={**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"},
      capture_output=True).returncode == 0


def _fast() -> str:
  """The first of FAST this jax's XLA accepts, else ""; decided once (the
  answer is passed on to pytest's workers and subprocesses)."""
  if os.environ.get("ZEROJAX_TEST_XLA_DEFAULTS") == "1":
    return ""
  if "ZEROJAX_TEST_FAST_FLAGS" not in os.environ:
    os.environ["ZEROJAX_TEST_FAST_FLAGS"] = next(
        (flags for flags in FAST if _accepts(flags)), "")
  return os.environ["ZEROJAX_TEST_FAST_FLAGS"]


if DEVICES not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = " ".join(
      f for f in (os.environ.get("XLA_FLAGS", ""), _fast(), DEVICES) if f)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
  # One compilation cache for the run, shared by pytest's workers and the
  # processes tests start; removed at exit by the process that made it.
  _cache = tempfile.mkdtemp(prefix="zerojax-test-jax-cache-")
  atexit.register(shutil.rmtree, _cache, True)
  os.environ["JAX_COMPILATION_CACHE_DIR"] = _cache
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

# a test whose worker crashed runs once more (tests/crash_rerun.py)
from crash_rerun import pytest_handlecrashitem, pytest_report_teststatus  # noqa: E402,F401
