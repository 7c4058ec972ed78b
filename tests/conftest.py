"""8 simulated CPU devices, set before the first `import jax`; and XLA's CPU
backend compiling without LLVM optimisation (`FAST`).

The tests check what zerojax emits (its HLO: collectives, pads, copies,
loops; buffer sizes from `memory_analysis`) and its numbers against plain
optax, which XLA's HLO passes decide, not the machine code LLVM makes of
the CPU kernels; compiling is most of the suite's time (tests/test_step.py:
96 s -> 64 s on two workers). The older fusion emitters
(`compat.FAST_COMPILE`'s other option) would save more (39 s) but fuse
differently enough that programs meant to be bit-identical (quantized
collectives with the identity encoding) are not. Worker processes the tests
start use the same flags (`ZEROJAX_TEST_FAST_FLAGS`), so that their numbers
compare bit for bit with the test's. `ZEROJAX_TEST_XLA_DEFAULTS=1` runs the
tests with XLA's own settings. An XLA that does not know a flag aborts, so
the flags are tried once in a subprocess, and left out if it fails.

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
FAST = "--xla_backend_optimization_level=0"


def _fast() -> str:
  """FAST where this jax's XLA accepts it, else ""; decided once (the
  answer is passed on to pytest's workers and subprocesses)."""
  if os.environ.get("ZEROJAX_TEST_XLA_DEFAULTS") == "1":
    return ""
  if "ZEROJAX_TEST_FAST_FLAGS" not in os.environ:
    tried = subprocess.run(
        [sys.executable, "-c", "import jax; jax.jit(lambda x: x + 1)(1)"],
        env={**os.environ, "XLA_FLAGS": FAST, "JAX_PLATFORMS": "cpu"},
        capture_output=True)
    os.environ["ZEROJAX_TEST_FAST_FLAGS"] = FAST if tried.returncode == 0 else ""
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
