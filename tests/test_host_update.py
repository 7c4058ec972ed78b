"""`update_on="host"`: the offloaded chunks' optax update as a host
computation. Results bit-identical to the device update, the program
lowered for a GPU updating on the host with the stated bytes over PCIe,
checkpoints, and bad input."""
import functools
import re

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax._plan.transfers import host_computations, host_moves
from models import zopts
from models import (OFFLOADED_UPDATE_CASES, ScannedLM,
                    assert_matches_reference, lm_batches, lm_loss_fn,
                    make_problem, reference_run, zero_run)

TX = optax.adam(1e-2)   # one object: zerojax probes each (tx, tree) once
_problem = functools.lru_cache(maxsize=None)(make_problem)


def _shard(stage, **fields):
  model, params, loss_fn, batches = _problem("transformer", steps=3)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  return zerojax.shard(plain, stage=stage,
                       **zopts({"offload_optimizer": True, **fields}))


def _params(state):
  return jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))


@pytest.mark.slow
@pytest.mark.parametrize("stage,fields", OFFLOADED_UPDATE_CASES)
def test_the_host_update_is_bit_identical_to_the_device_update(stage, fields):
  _, params, loss_fn, batches = _problem("transformer", steps=3)
  device, device_losses = zero_run(_shard(stage, **fields), loss_fn, batches)
  host, host_losses = zero_run(_shard(stage, update_on="host", **fields),
                               loss_fn, batches)
  np.testing.assert_array_equal(host_losses, device_losses)
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(host),
                         _params(device))
  # the state stays where it was placed: statistics and master on host
  stats = [x for x in jax.tree_util.tree_leaves(host.opt_state) if x.ndim
           and x.size]
  assert "pinned_host" in {x.sharding.memory_kind for x in stats}
  if fields["compute_dtype"] == "float32":   # and against plain optax
    ref_losses, ref_params = reference_run(loss_fn, params, TX, batches)
    assert_matches_reference(host_losses, _params(host), ref_losses,
                             ref_params)


@pytest.mark.slow
def test_the_host_update_holds_on_layer_chunks_under_hpz():
  """Per-layer ([layers, length]) chunks of a scanned model, the state
  sharded over replica x data (hpZ): still bit-identical."""
  model = ScannedLM(layers=3)
  batches = lm_batches(model.vocab, steps=2)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=TX)
  mesh = jax.make_mesh((2, 4), ("replica", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)
  runs = [zero_run(zerojax.shard(
      plain, stage=3, mesh=mesh, axes=zerojax.Axes(replica="replica", hpz=True), offload=zerojax.Offload(update_on=where), blocks=zerojax.Blocks(stacked=("blocks",))),
      lm_loss_fn(model), batches) for where in ("device", "host")]
  assert any(c.layers for c in runs[1][0].layout.chunks)
  np.testing.assert_array_equal(runs[1][1], runs[0][1])
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(runs[1][0]),
                         _params(runs[0][0]))


def _moves(state, loss_fn, batch):
  """{direction: bytes per parameter} of the chunk-sized transfers in the
  program lowered for a GPU (on CPU they lower to nothing), and the count
  of host computations."""
  text = zerojax.train_step(loss_fn).trace(state, batch).lower(
      lowering_platforms=("cuda",)).as_text()
  # the chunks whose shape is no other chunk's shard shape (a small chunk,
  # such as a final norm's own, `zerojax._model.peruse`, can be)
  n = state.num_shards
  shards = {c.shape[:-1] + (c.length // n,) for c in state.layout.chunks}
  chunks = [c for c in state.layout.chunks if c.shape not in shards]
  padded = sum(c.length for c in chunks)
  moved = host_moves(text, [c.shape for c in chunks])
  return {k: v / padded for k, v in moved.items()}, host_computations(text)


@pytest.mark.parametrize("stage,dtype,host_bytes", [
    (2, "bfloat16", {"pinned_host": 4, "device": 2}),
    (3, "float32", {"pinned_host": 4, "device": 0})])
def test_the_gpu_program_updates_on_the_host_moving_the_stated_bytes(
    stage, dtype, host_bytes):
  """Adam, every chunk offloaded: the device update moves master, m and v
  over and back (12 bytes a parameter each way); the host update sends the
  fp32 gradient shard (4) and brings back only the 16-bit parameter shard
  at stage 2 (2), nothing at stage 3 (the next step's gathers read the
  host shard, as under the device update)."""
  _, _, loss_fn, batches = _problem("transformer", steps=3)
  moved, calls = _moves(_shard(stage, compute_dtype=dtype), loss_fn,
                        batches[0])
  assert moved == {"pinned_host": 12, "device": 12} and calls == 0
  state = _shard(stage, compute_dtype=dtype, update_on="host")
  moved, calls = _moves(state, loss_fn, batches[0])
  assert moved == host_bytes
  assert calls >= len(state.layout.chunks)   # one update per chunk, on host


def test_a_checkpoint_of_a_host_update_restores_either_way(tmp_path):
  _, _, loss_fn, batches = _problem("transformer", steps=3)
  state, _ = zero_run(_shard(3, update_on="host"), loss_fn, batches[:1])
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  plain = train_state.TrainState.create(
      apply_fn=state.apply_fn, params=zerojax.gather_params(state), tx=TX)
  again = zerojax.checkpoint.restore(tmp_path, like=plain)
  assert again.config.update_on == "host"
  # without the offload, the update goes back to the device
  on_device = zerojax.checkpoint.restore(tmp_path, like=plain,
                                         offload=None)
  assert on_device.config.update_on == "device"
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(on_device),
                         _params(state))


@pytest.mark.parametrize("options,message", [
    (lambda: dict(offload=zerojax.Offload(update_on="cpu")),
     "Offload.update_on='cpu' is not a place"),
    (lambda: dict(offload=zerojax.Offload(optimizer=False, params=True,
                                          update_on="host")),
     "offload it (Offload(optimizer=True))"),
    (lambda: dict(stage=1, offload=zerojax.Offload(update_on="host")),
     "Offload(update_on='host') at stage 1 needs 16-bit compute"),
])
def test_bad_update_places_are_refused(options, message):
  with pytest.raises(ValueError, match=re.escape(message)):
    zerojax.ZeroConfig(**options())
