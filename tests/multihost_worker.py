"""One process of the two-process run in test_multihost.py (not a test).

`python multihost_worker.py RANK PORT CKPT_DIR OUT [hybrid]`: joins a 2-process
jax.distributed run on 127.0.0.1:PORT with 4 simulated CPU devices (the parent
sets XLA_FLAGS), trains SPLIT steps at stage 3, saves, restores from the
checkpoint, trains the remaining steps, saves again and restores that onto
another chunk size (a repack); rank 0 writes the losses, the final parameters
(from export_params of the live state and of the checkpoint directory) and
the parameters and optimizer state of the live and of the repacked state to
OUT (.npz). With `hybrid`: the layout of a 2-node cluster, a (replica 2,
data 4) mesh whose rows are the two processes (`replica_axis`), trained,
saved and restored on that mesh; rank 0 writes the losses and parameters.
With `local`: process-local slices against global jax.Arrays (`local`).
"""
import os
import sys

import jax
import numpy as np
import optax
from flax.training import train_state

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import zopts, make_problem, zero_run as train  # noqa: E402

STEPS, SPLIT, BATCH, CHUNK = 6, 3, 24, 128


def problem():
  """Shared with the parent's single-process reference run."""
  model, params, loss_fn, batches = make_problem("mlp", steps=STEPS,
                                                 batch=BATCH)
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-2, weight_decay=0.1))
  return plain, loss_fn, batches


def halves(batches, rank):
  """Process `rank`'s rows of each global batch ([Note: process-local
  batches]: with jax's device order, process p holds rows [p B/2, (p+1) B/2))."""
  half = BATCH // 2
  return [{k: v[rank * half:(rank + 1) * half] for k, v in b.items()}
          for b in batches]


def hybrid(directory: str, out: str, rank: int) -> None:
  import zerojax
  from jax.sharding import AxisType, Mesh
  devices = np.array(sorted(jax.devices(), key=lambda d: d.id)).reshape(2, 4)
  # each row (data axis) is one process's devices: replicas are the nodes
  assert all(len({d.process_index for d in row}) == 1 for row in devices)
  mesh = Mesh(devices, ("replica", "data"), axis_types=(AxisType.Auto,) * 2)
  plain, loss_fn, batches = problem()
  batches = halves(batches, rank)   # replica p's rows: process p's
  fields = dict(stage=3, chunk_size=CHUNK, mesh=mesh, replica_axis="replica")
  state = zerojax.shard(plain, **zopts(fields))
  state, first = train(state, loss_fn, batches[:SPLIT])
  zerojax.checkpoint.save(directory, state, wait=True)
  del state
  state = zerojax.checkpoint.restore(directory, like=plain, **zopts(fields))
  assert int(state.step) == SPLIT and state.num_replicas == 2
  state, rest = train(state, loss_fn, batches[SPLIT:])
  params = zerojax.checkpoint.export_params(state)
  if rank == 0:
    np.savez(out, losses=np.concatenate([first, rest]),
             **{f"params/{jax.tree_util.keystr(k)}": v for k, v in
                jax.tree_util.tree_leaves_with_path(params)})


def local(directory: str, out: str, rank: int) -> None:
  """Each process loads only its half of each batch ([Note: process-local
  batches]); the same run from global jax.Arrays; a wrong local size and
  the global batch passed on both processes."""
  import logging
  import zerojax
  from jax.sharding import NamedSharding, PartitionSpec as P
  plain, loss_fn, batches = problem()
  said = []
  handler = logging.Handler()
  handler.emit = lambda record: said.append(record.getMessage())
  logging.getLogger("zerojax").addHandler(handler)
  step = zerojax.train_step(loss_fn)
  # the global batch on both processes: said once (a step of 2 copies)
  step(zerojax.shard(plain, stage=3, chunk_size=CHUNK), batches[0])
  same = sum("passed the same batch rows" in m for m in said)
  half = BATCH // 2
  mine = [{k: v[rank * half:(rank + 1) * half] for k, v in b.items()}
          for b in batches[:SPLIT]]
  state, by_slice = train(zerojax.shard(plain, stage=3, chunk_size=CHUNK),
                          loss_fn, mine)
  sliced = zerojax.checkpoint.export_params(state)
  state = zerojax.shard(plain, stage=3, chunk_size=CHUNK)
  sharding = NamedSharding(state.mesh, P("data"))
  arrays = [{k: jax.make_array_from_callback(v.shape, sharding,
                                             lambda i, v=v: v[i])
             for k, v in b.items()} for b in batches[:SPLIT]]
  state, by_array = train(state, loss_fn, arrays)
  whole = zerojax.checkpoint.export_params(state)
  try:
    step(state, {k: v[:5] for k, v in mine[0].items()})
    wrong = "accepted"
  except ValueError as e:
    wrong = str(e)
  if rank == 0:
    flat = {f"sliced/{jax.tree_util.keystr(k)}": v for k, v in
            jax.tree_util.tree_leaves_with_path(sliced)}
    flat.update({f"array/{jax.tree_util.keystr(k)}": v for k, v in
                 jax.tree_util.tree_leaves_with_path(whole)})
    np.savez(out, by_slice=by_slice, by_array=by_array, same=same,
             wrong=np.array(wrong), **flat)


def main(rank: int, port: int, directory: str, out: str,
         mode: str = "") -> None:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2,
                             process_id=rank, initialization_timeout=60)
  import zerojax
  assert jax.process_count() == 2 and jax.local_device_count() == 4, (
      jax.process_count(), jax.local_device_count())
  if mode in ("hybrid", "local"):
    (hybrid if mode == "hybrid" else local)(directory, out, rank)
    jax.distributed.shutdown()
    return
  plain, loss_fn, batches = problem()
  batches = halves(batches, rank)   # each process loads only its own rows
  state = zerojax.shard(plain, stage=3, chunk_size=CHUNK)
  assert not state.master[0].is_fully_addressable  # really spread over hosts
  state, first = train(state, loss_fn, batches[:SPLIT])
  zerojax.checkpoint.save(directory, state, wait=True)
  del state
  state = zerojax.checkpoint.restore(directory, like=plain, stage=3,
                                     chunk_size=CHUNK)
  assert int(state.step) == SPLIT
  state, rest = train(state, loss_fn, batches[SPLIT:])
  params = zerojax.checkpoint.export_params(state)
  zerojax.checkpoint.save(directory, state, wait=True)
  from_disk = zerojax.checkpoint.export_params(directory)
  # Onto another chunk layout: the saved chunks are cut on each host and
  # repacked across both processes (checkpoint._repack).
  other = zerojax.checkpoint.restore(directory, like=plain, stage=3,
                                     chunk_size=2 * CHUNK)
  assert other.layout != state.layout
  repacked = zerojax.checkpoint.export_params(other, with_opt_state=True)
  live = zerojax.checkpoint.export_params(state, with_opt_state=True)
  if rank == 0:
    flat = {f"params/{jax.tree_util.keystr(k)}": v for k, v in
            jax.tree_util.tree_leaves_with_path(params)}
    flat.update({f"disk/{jax.tree_util.keystr(k)}": v for k, v in
                 jax.tree_util.tree_leaves_with_path(from_disk)})
    for name, tree in (("repacked", repacked), ("live", live)):
      flat.update({f"{name}/{jax.tree_util.keystr(k)}": v for k, v in
                   jax.tree_util.tree_leaves_with_path(tree)})
    np.savez(out, losses=np.concatenate([first, rest]), **flat)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4],
       *sys.argv[5:])
