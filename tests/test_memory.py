"""memory_report / estimate_memory against ZeRO's memory table (docs/design.md)
and against the state's own arrays, and the compiled-footprint helper on a
program of known size."""
import re

import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state

import zerojax
from models import make_problem


def _state(stage, dtype, accum):
  model, params, _, _ = make_problem("transformer")
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  return zerojax.shard(state, stage=stage, precision=dtype,
                       accum_steps=accum, chunk_size=3000)


def _design_table(psi, n, stage, half):
  """docs/design.md's table, written out independently of zerojax._state.memory."""
  if stage == 0:
    return 12 * psi
  if stage in (1, 2):
    return (2 * psi + 12 * psi / n) if half else (4 * psi + 8 * psi / n)
  return 12 * psi / n


@pytest.mark.parametrize("accum", [1, 4])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_persistent_bytes_match_the_design_table(stage, dtype, accum):
  state = _state(stage, dtype, accum)
  report = zerojax.memory_report(state)
  n, chunks = 8, len(state.layout.chunks)
  psi = sum(x.size for x in jax.tree_util.tree_leaves(
      make_problem("transformer")[1]))
  assert report.num_params == psi
  want = _design_table(psi, n, stage, dtype == "bfloat16")
  # one device's bytes of the chunk arrays, read off the arrays themselves
  chunk_bytes = sum(_on_one_device(x) for x in jax.tree_util.tree_leaves(
      (state.master, state.compute, state.opt_state)) if x.ndim)
  # padding: at most N-1 elements per chunk, 12 bytes each at most
  assert want <= chunk_bytes <= want + 12 * (n - 1) * chunks
  assert report.persistent == sum(_on_one_device(x)
                                  for x in jax.tree_util.tree_leaves(state))
  assert report.estimate["persistent"] == pytest.approx(want, abs=1)
  assert report.by_kind().keys() == {"device"}
  # the printed report: its stage and devices, then a row per category with
  # its measured MiB, and the accumulator only when there is one
  title, *lines = str(report).splitlines()
  assert re.search(rf"ZeRO-{stage}\b", title) and re.search(r"\b8 devices", title)
  rows = {re.split(r"\s{2,}", line)[0]: float(line.split()[-1].replace(",", ""))
          for line in lines[2:]}
  for category, kinds in report.measured.items():
    assert rows[category] == pytest.approx(sum(kinds.values()) / 2 ** 20, abs=0.005)
  accumulator = [v for k, v in rows.items() if "accumulator" in k]
  assert accumulator == ([pytest.approx(psi * 4 / (n if stage >= 2 else 1) / 2 ** 20,
                                        abs=0.005)] if accum > 1 else [])


def _on_one_device(x):
  return x.addressable_shards[0].data.nbytes


def test_stage3_holds_at_most_a_sixth_of_stage0():
  s0 = zerojax.memory_report(_state(0, "float32", 1)).persistent
  s3 = zerojax.memory_report(_state(3, "float32", 1)).persistent
  assert s3 <= s0 / 6


def test_estimate_memory_figures_and_errors():
  est = zerojax.estimate_memory(10 ** 9, stage=3, num_devices=8,
                                compute_dtype="bfloat16", accum_steps=4)
  assert est["persistent"] == 12 * 10 ** 9 // 8
  assert est["paper"] == 16 * 10 ** 9 // 8
  assert est["accumulator"] == 4 * 10 ** 9 // 8
  est1 = zerojax.estimate_memory(10 ** 9, stage=1, num_devices=8,
                                 compute_dtype=jnp.bfloat16)
  assert est1["persistent"] == 2 * 10 ** 9 + 12 * 10 ** 9 // 8
  assert est1["paper"] == 4 * 10 ** 9 + 12 * 10 ** 9 // 8
  with pytest.raises(ValueError, match="stage=5"):
    zerojax.estimate_memory(10, stage=5, num_devices=8)
  with pytest.raises(ValueError, match="num_devices"):
    zerojax.estimate_memory(10, stage=1, num_devices=0)


def test_compiled_footprint_of_a_known_program():
  x = jnp.ones((1024, 256), jnp.float32)        # 1 MiB
  fp = zerojax.compiled_footprint(jax.jit(lambda a: a * 2).lower(x).compile())
  assert fp["argument"] == fp["output"] == 2 ** 20
  assert fp["footprint"] == fp["argument"] + fp["output"] + fp["temp"] - fp["alias"]
  donated = zerojax.compiled_footprint(
      jax.jit(lambda a: a * 2, donate_argnums=0).lower(x).compile())
  assert donated["alias"] == 2 ** 20 and donated["footprint"] < fp["footprint"]
