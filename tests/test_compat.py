"""zerojax._core.compat: compile options this XLA lacks are dropped, not fatal."""
import os
import subprocess
import sys

import pytest

import jax
import numpy as np

from zerojax._core import compat


def test_compiler_options_keeps_what_xla_accepts_and_drops_the_rest():
  got = compat.compiler_options({"xla_backend_optimization_level": 0,
                                 "xla_zerojax_no_such_option": True})
  assert got == {"xla_backend_optimization_level": 0}
  # whatever is returned compiles
  jax.jit(lambda x: x * 2).lower(np.float32(1)).compile(
      compiler_options=compat.compiler_options())
  assert set(compat.compiler_options()) <= set(compat.FAST_COMPILE)
  assert "xla_backend_optimization_level" in compat.compiler_options()


@pytest.mark.slow
def test_gpu_flags_are_added_once_and_known_to_this_xla():
  user = "--xla_gpu_enable_pipelined_all_gather=false --xla_dump_to=/tmp/x"
  flags = compat.with_gpu_flags(user)
  assert flags.startswith(user)
  assert "--xla_gpu_enable_pipelined_all_gather=true" not in flags  # user's kept
  assert set(compat.GPU_OVERLAP_FLAGS) < set(compat.GPU_FLAGS)
  for name in compat.GPU_FLAGS:
    assert flags.count(f"--{name}=") == 1
  assert "--xla_gpu_enable_triton_gemm=false" in flags
  assert compat.with_gpu_flags(flags) == flags
  # XLA aborts a process whose XLA_FLAGS names a flag it does not know (a
  # flag renamed in a newer XLA would break every GPU run of the example)
  env = {**os.environ, "XLA_FLAGS": compat.with_gpu_flags("")}
  proc = subprocess.run([sys.executable, "-c",
                         "import jax; print(jax.numpy.ones(2).sum())"],
                        env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.strip() == "2.0"


_WRITES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from zerojax._core import compat
mesh = Mesh(np.array(jax.devices()), ("d",))
n, got = 2 ** 17, []   # 512 KiB per device: copied off the thread that asks

def local(x):
  for j in range(4):   # more callbacks in flight than this machine's cores
    compat.write_on_host(lambda k, a, j=j: got.append(
        (j, int(k), float(a.sum()), a.shape)), jax.lax.axis_index("d"),
        x * (j + 1))
  return x + 1

x = jax.device_put(np.arange(8 * n, dtype=np.float32),
                   NamedSharding(mesh, P("d")))
f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x) + 1)
jax.effects_barrier()
want = sorted((j, k, float((j + 1) * np.arange(k * n, (k + 1) * n,
                                               dtype=np.float64).sum()),
               (n,)) for j in range(4) for k in range(8))
assert sorted(got) == want, (sorted(got)[:3], want[:3])
print("ok", len(got))
"""


@pytest.mark.slow
def test_write_on_host_hands_each_device_its_shard_without_hanging():
  """Each device's operands reach the callback as numpy arrays, once per
  call, with many large ones in flight at once on 8 simulated devices: the
  case where `io_callback`'s copy onto a CPU device never runs (the step
  hung). In a subprocess with a timeout, so a hang fails instead of
  stalling the suite."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  done = subprocess.run([sys.executable, "-c", _WRITES], capture_output=True,
                        text=True, timeout=180, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ["ok", "32"]


def test_write_on_host_lowered_for_another_platform_is_a_named_custom_call():
  """Lowered for CUDA on a machine without a GPU (for reading the program:
  the benchmarks' host moves), the callback cannot be registered: it is a
  side-effecting custom call of `ANALYSIS_TARGET` with the same operands."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()), ("d",))
  spec = jax.sharding.PartitionSpec("d")

  def local(x):
    compat.write_on_host(lambda a: None, x * 2)
    return x

  f = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=spec, out_specs=spec))
  x = jax.ShapeDtypeStruct((8 * 64,), np.float32,
                           sharding=jax.sharding.NamedSharding(mesh, spec))
  text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
  calls = [l for l in text.splitlines() if compat.ANALYSIS_TARGET in l]
  assert len(calls) == 1 and "has_side_effect = true" in calls[0]
  assert "tensor<64xf32>" in calls[0]


@pytest.mark.parametrize("started,platform,plugin,flags,platforms,want", [
    (False, None, True, "", "", "set"),            # a GPU machine, first import
    (False, None, True, "--xla_foo=1", "cuda", "set"),
    (False, None, True, "", "cpu", None),          # asked for CPU only
    (False, None, False, "", "", None),            # no GPU plugin: CPU or TPU
    (True, "gpu", True, "", "", "warn"),           # jax started a GPU first
    (True, "cpu", False, "", "", None),
    (True, "gpu", True, compat.with_gpu_flags(""), "", None),   # already set
])
def test_gpu_flags_at_import_set_warn_or_nothing(started, platform, plugin,
                                                 flags, platforms, want):
  assert compat.gpu_flags_action(started, platform, plugin, flags,
                                 platforms) == want
  # ZEROJAX_GPU_FLAGS=0: never set, never warned
  assert compat.gpu_flags_action(started, platform, plugin, flags,
                                 platforms, opt_out="0") is None


def test_gpu_flags_set_at_import_are_said_once_naming_the_opt_out(
    monkeypatch, caplog):
  from jax._src import xla_bridge
  monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
  monkeypatch.setattr(compat, "_has_gpu_plugin", lambda: True)
  monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
  monkeypatch.delenv("JAX_PLATFORMS", raising=False)
  monkeypatch.delenv(compat.OPT_OUT, raising=False)
  with caplog.at_level("WARNING", logger="zerojax"):
    compat.gpu_flags_at_import()
  flags = os.environ["XLA_FLAGS"]
  assert flags.startswith("--xla_gpu_enable_triton_gemm=true ")   # yours kept
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags
  (record,) = [r for r in caplog.records if "XLA GPU flags" in r.message]
  assert record.levelname == "WARNING"
  assert "xla_gpu_enable_pipelined_all_gather" in record.message
  assert "xla_gpu_enable_triton_gemm" not in record.message   # not added
  assert "ZEROJAX_GPU_FLAGS=0 keeps XLA_FLAGS as it is" in record.message
  caplog.clear()
  monkeypatch.setenv("XLA_FLAGS", "")
  monkeypatch.setenv(compat.OPT_OUT, "0")
  compat.gpu_flags_at_import()
  assert os.environ["XLA_FLAGS"] == "" and not caplog.records


@pytest.mark.slow
def test_importing_zerojax_on_cpu_leaves_xla_flags_alone():
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  out = subprocess.run(
      [sys.executable, "-c", "import os, zerojax; print(os.environ['XLA_FLAGS'])"],
      capture_output=True, text=True, env=env, timeout=120)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.strip() == env["XLA_FLAGS"]


def test_a_warning_nothing_else_would_print_names_zerojax_once(
    monkeypatch, capsys):
  from zerojax._core import logs
  # no handler up the chain (the test's own capture is on the root logger)
  monkeypatch.setattr(logs.LOG, "propagate", False)
  logs.LOG.warning("ZeRO-3 over %d device", 1)
  logs.LOG.info("not shown")
  assert capsys.readouterr().err == "zerojax: ZeRO-3 over 1 device\n"
  monkeypatch.undo()
  # with a handler configured, that handler prints it, as it formats it
  logs.LOG.warning("ZeRO-3 over %d device", 1)
  assert capsys.readouterr().err == ""
