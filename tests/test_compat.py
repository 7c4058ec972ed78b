"""zerojax.compat: compile options this XLA lacks are dropped, not fatal."""
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
