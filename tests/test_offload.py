"""Host offload: memory kinds of the state, results unchanged, partial
offload, and bad input."""
import functools
import re
import types

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax._core import offload
from models import (zopts, assert_same_numbers, ScannedLM, lm_batches,
                    lm_loss_fn, make_problem, zero_run)


TX = optax.adamw(1e-2)   # one object: zerojax probes each (tx, tree) once
_problem = functools.lru_cache(maxsize=None)(make_problem)


def _run(stage, steps=5, **fields):
  model, params, loss_fn, batches = _problem("transformer", steps=steps)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  state = zerojax.shard(plain, stage=stage, chunk_size=3000, **zopts(fields))
  kinds = [_kinds(state)]
  state, losses = zero_run(state, loss_fn, batches,
                           after_step=lambda s: kinds.append(_kinds(s)))
  return state, losses, kinds, plain


# the run without offload that each offloaded run is compared with
_baseline = functools.lru_cache(maxsize=None)(_run)


def _kinds(state):
  """(master kinds, optimizer-state kinds) of the chunk arrays."""
  opt = [x for x in jax.tree_util.tree_leaves(state.opt_state) if x.ndim and x.size]
  return ({x.sharding.memory_kind for x in state.master},
          {x.sharding.memory_kind for x in opt})


def _assert_same(a, b):
  for x, y in zip(jax.tree_util.tree_leaves(zerojax.gather_params(a)),
                  jax.tree_util.tree_leaves(zerojax.gather_params(b))):
    assert_same_numbers(x, y)


@pytest.mark.slow
@pytest.mark.parametrize("stage,dtype", [(1, "bfloat16"), (2, "float32"), (3, "float32")])
def test_optimizer_offload_is_exact_and_stays_on_host(stage, dtype):
  base, base_losses, _, _ = _baseline(stage, compute_dtype=dtype)
  state, losses, kinds, _ = _run(stage, compute_dtype=dtype,
                                 offload_optimizer=True)
  assert_same_numbers(losses, base_losses)
  _assert_same(state, base)
  master_sharded = stage == 3 or dtype != "float32"
  for master, opt in kinds:          # after shard() and after every step
    assert opt == {"pinned_host"}
    assert master == ({"pinned_host"} if master_sharded else {"device"})
  report = zerojax.memory_report(state)
  host = sum(x.addressable_shards[0].data.nbytes
             for x in jax.tree_util.tree_leaves((state.master, state.opt_state))
             if x.sharding.memory_kind == "pinned_host")
  assert report.by_kind()["pinned_host"] == host > 0


@pytest.mark.slow
def test_parameter_offload_at_stage3():
  base, base_losses, _, _ = _baseline(3, compute_dtype="float32")
  state, losses, kinds, _ = _run(3, offload_params=True)
  assert_same_numbers(losses, base_losses)
  _assert_same(state, base)
  assert all(master == {"pinned_host"} and opt == {"device"}
             for master, opt in kinds)


@pytest.mark.slow
def test_stage3_offloaded_layers_come_to_the_device_one_at_a_time():
  """A layerwise model at stage 3: with its shards in host memory, each
  layer's shard is moved to the device inside the layer loop, right before
  its all-gather, and its gradient stays on the device. Checked in the
  program lowered for a GPU (on CPU the moves lower to nothing); results
  bit-identical to the run without offload."""
  model = ScannedLM(layers=3)
  batches = lm_batches(model.vocab, steps=2)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  step = zerojax.train_step(lm_loss_fn(model))
  runs = {}
  for fields in ({}, {"offload_params": True},
                 {"offload_params": True, "offload_optimizer": True}):
    state = zerojax.shard(plain, stage=3, chunk_size=4096,
                          **zopts({"stacked": ("blocks",), **fields}))
    layer_shards = {f"tensor<{c.length // 8}xf32>" for c in state.layout.chunks
                    if c.layers}
    text = step.trace(state, batches[0]).lower(
        lowering_platforms=("cuda",)).as_text()
    moves = re.findall(r'_xla_buffer_placement = "(\w+)"\}\} : \((tensor<[^>]*>)',
                       text)
    per_layer = {(kind, t) for kind, t in moves if t in layer_shards}
    if fields:
      assert {t for kind, t in per_layer if kind == "device"} == layer_shards
      assert not {t for kind, t in per_layer if kind == "pinned_host"}
    else:
      assert not moves
    state, losses = zero_run(state, lm_loss_fn(model), batches)
    runs[str(fields)] = losses, state
  base_losses, base = runs.pop("{}")
  for losses, state in runs.values():
    np.testing.assert_array_equal(losses, base_losses)
    _assert_same(state, base)
    assert {x.sharding.memory_kind for x in state.master} == {"pinned_host"}


def test_half_offload_splits_by_chunk_bytes():
  base, base_losses, _, _ = _baseline(3, compute_dtype="float32")
  state, losses, _, _ = _run(3, offload_optimizer=True, offload_fraction=0.5)
  assert_same_numbers(losses, base_losses)
  kinds = zerojax.memory_report(state).measured["optimizer state"]
  total = kinds.get("pinned_host", 0) + kinds.get("device", 0)
  largest = max(np.prod(c.shape) for c in state.layout.chunks) * 4 * 2 / 8
  assert abs(kinds["pinned_host"] - total / 2) <= largest


@pytest.mark.slow
def test_offloaded_chunks_come_to_the_device_one_at_a_time():
  """Each offloaded chunk's optimizer state is moved to the device only once
  the previous chunk's new state has been written back: one optimization
  barrier per offloaded chunk after the first, ordering the transfers (on
  CPU the transfers themselves compile to nothing, so the order is what can
  be checked here)."""
  model, params, loss_fn, batches = _problem("transformer", steps=1)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  step = zerojax.train_step(loss_fn)
  barriers = {}
  for fraction in (0.0, 0.5, 1.0):
    fields = dict(offload_optimizer=True, offload_fraction=fraction) if (
        fraction) else {}
    state = zerojax.shard_shape(plain, stage=3, chunk_size=3000, **zopts(fields))
    text = step.lower(state, batches[0]).as_text()
    host = offload.offloaded_chunks(state.layout, fraction)
    barriers[fraction] = (text.count("stablehlo.optimization_barrier"), len(host))
  base = barriers[0.0][0]
  assert barriers[1.0][1] > barriers[0.5][1] >= 2
  for fraction in (0.5, 1.0):
    count, chunks = barriers[fraction]
    assert count - base == chunks - 1


def test_offload_refuses_a_tx_that_reads_every_chunk():
  model, params, _, _ = make_problem("mlp")
  clipped = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=clipped)
  with pytest.raises(ValueError,
                     match=r"one at a time.*shard\(\.\.\., clip_norm=.*offload=None"):
    zerojax.shard(plain, stage=3, offload="host")
  assert zerojax.shard(plain, stage=3).config.stage == 3   # fine on device


def test_restore_keeps_memory_kinds(tmp_path):
  state, _, _, plain = _run(3, steps=1, offload_optimizer=True)
  zerojax.checkpoint.save(str(tmp_path), state, wait=True)
  back = zerojax.checkpoint.restore(str(tmp_path), like=state)
  assert _kinds(back) == ({"pinned_host"}, {"pinned_host"})
  _assert_same(back, state)


def test_offload_bad_input():
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3))
  with pytest.raises(ValueError, match="offload needs stage >= 1"):
    zerojax.shard(plain, stage=0, offload="host")
  with pytest.raises(ValueError, match=r"Offload\(params=True\) needs stage=3"):
    zerojax.shard(plain, stage=2, offload=zerojax.Offload(params=True))
  with pytest.raises(ValueError, match=r"Offload.fraction=1.5 must be in \[0, 1\]"):
    zerojax.shard(plain, stage=3, offload=zerojax.Offload(fraction=1.5))
  device = types.SimpleNamespace(addressable_memories=lambda: [
      types.SimpleNamespace(kind="device")])
  mesh = types.SimpleNamespace(devices=np.array([device]))
  with pytest.raises(ValueError, match="'pinned_host'"):
    offload.check_backend(mesh)
