"""zerojax.compat: compile options this XLA lacks are dropped, not fatal."""
import os
import subprocess
import sys

import jax
import numpy as np

from zerojax import compat


def test_compiler_options_keeps_what_xla_accepts_and_drops_the_rest():
  got = compat.compiler_options({"xla_backend_optimization_level": 0,
                                 "xla_zerojax_no_such_option": True})
  assert got == {"xla_backend_optimization_level": 0}
  # whatever is returned compiles
  jax.jit(lambda x: x * 2).lower(np.float32(1)).compile(
      compiler_options=compat.compiler_options())
  assert set(compat.compiler_options()) <= set(compat.FAST_COMPILE)
  assert "xla_backend_optimization_level" in compat.compiler_options()


def test_gpu_overlap_flags_are_added_once_and_known_to_this_xla():
  user = "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"
  flags = compat.with_gpu_overlap_flags(user)
  assert flags.startswith(user)
  assert "--xla_gpu_enable_pipelined_all_gather=true" not in flags  # user's kept
  for name in compat.GPU_OVERLAP_FLAGS:
    assert flags.count(f"--{name}=") == 1
  assert compat.with_gpu_overlap_flags(flags) == flags
  # XLA aborts a process whose XLA_FLAGS names a flag it does not know (a
  # flag renamed in a newer XLA would break every GPU run of the example)
  env = {**os.environ, "XLA_FLAGS": compat.with_gpu_overlap_flags("")}
  proc = subprocess.run([sys.executable, "-c",
                         "import jax; print(jax.numpy.ones(2).sum())"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "2.0"
