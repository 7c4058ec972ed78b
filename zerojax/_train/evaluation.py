"""eval_step(): the user's function on a sharded state, without gathering
the whole model onto any device.

One `shard_map` over the data axis, the forward half of a train step
(`model_call.ModelCall`): the parameters are read as the stage's forward pass
reads them. At stage 3 the shards are gathered per chunk (each cut into
leaf buffers of its own, `collectives.gather_leaves`), and per layer or per
block for models opted in with `zerojax.nn.layerwise`; with no backward
pass to keep them for, each gathered layer dies after its use. Stages 0-2
read their replicated copy. `gather_params` stays for export.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import PartitionSpec as P

from zerojax._core import frozen
from zerojax._train import grads
from zerojax._train import model_call
from zerojax._core import outputs
from zerojax._model import peruse as peruse
from zerojax._options.config import batch_axes, manual_axes, shard_axes
from zerojax._options.policy import Forward, policy
from zerojax._state.state import chunk_spec
from zerojax._train.inputs import (check_mutable, check_signature, check_state,
                                   shard_batch)


def eval_step(fn: Callable, *, mutable: tuple = (),
              weighted: bool = False) -> Callable:
  """Builds a jitted evaluation of a ZeRO state.

  Args:
    fn: `fn(params, batch, **fields)` or `fn(params, batch, rng, **fields)`,
      written on the full parameter tree and one device's slice of the
      batch, like a loss function. It returns a pytree whose values are
      scalars (averaged over the global batch) or per-example arrays (the
      slice's leading axis; concatenated in global batch order).
    mutable: names of fields of the user's `TrainState` subclass given to
      `fn` as keyword arguments, e.g. `("batch_stats",)` for a BatchNorm
      model evaluated with its running averages. Evaluation changes no
      state: what `fn` returns is all that comes back.
    weighted: `fn` returns `(sum, weight)` (as a `train_step(weighted=True)`
      loss does) and `evaluate` returns Σ sum / Σ weight over the whole
      global batch, a scalar (NaN for a batch of weight 0).

  Returns:
    `evaluate(state, batch, rng=None) -> outputs`, jitted (the state is not
    donated). `batch` has the global batch on its leading axis, a multiple
    of the number of devices. `evaluate.lower(state, batch)` gives the
    lowered program (for `memory_analysis()`).
  """
  if not callable(fn):
    raise TypeError(f"eval_step() takes the evaluation function, got {fn!r}.")
  mutable = check_mutable(mutable, "eval_step")
  if not isinstance(weighted, bool):
    raise TypeError(f"eval_step(weighted={weighted!r}) must be True or False.")
  jitted = jax.jit(functools.partial(_evaluate, fn, mutable, weighted))

  def prepare(state, batch):
    check_state(state, "evaluate()", mutable)
    return shard_batch(state, batch)

  def evaluate(state, batch, rng=None):
    batch = prepare(state, batch)
    check_signature(fn, rng is not None, state.frontend.keywords(mutable),
                    "evaluate()")
    return jitted(state, batch, rng)

  evaluate.lower = lambda state, batch, rng=None: jitted.lower(
      state, prepare(state, batch), rng)
  return evaluate


def _evaluate(fn, mutable, weighted, state, batch, rng):
  fn, mutable = state.frontend.evaluation(fn, mutable)
  cfg, layout = state.config, state.layout
  pol = policy(cfg)
  batch_ax = batch_axes(cfg)
  params_in = grads.forward_params(state)
  host = grads.host_chunks(state)
  with_rng = rng is not None
  scalar = []   # per output value: a scalar (averaged) or per-example

  def local(params_in, rest, fields, batch, *maybe_rng):
    dev_rng = (jax.random.fold_in(maybe_rng[0], jax.lax.axis_index(batch_ax))
               if with_rng else None)
    params_in, slotted = grads.secondary_partition(state, params_in, host)
    call = model_call.ModelCall(fn, False, (), state, pol, params_in, rest,
                                None, slotted, with_rng)
    diff = call.differentiated()
    # the modules beside the blocks are held: an evaluation has no
    # backward pass for gathering per use to shorten (`zerojax._model.peruse`)
    layerwise = (call.opted_in(diff, batch, dev_rng, fields)
                 - peruse.chunks(state.layout, state.config))
    out = call.outputs(diff, batch, dev_rng, fields, layerwise)
    if weighted:
      total, weight = (jax.lax.psum(x, batch_ax)
                       for x in outputs.sum_and_weight(out))
      return total / weight
    out = outputs.check_per_example(out, outputs.batch_size(batch),
                                    "evaluation")
    return grads.per_device(out, batch_ax, scalar)

  chunks = tuple(chunk_spec(len(c.shape), shard_axes(cfg))
                 if pol.forward is Forward.GATHERED
                 else P() for c in layout.chunks)
  fields = {name: state.extras[name] for name in mutable}
  args = (params_in, state.rest, fields, batch) + ((rng,) if with_rng else ())
  in_specs = (chunks, frozen.specs(layout, cfg, state.mesh), P(),
              P(batch_ax)) + ((P(),) if with_rng else ())
  out = jax.shard_map(local, mesh=state.mesh, in_specs=in_specs,
                      out_specs=P() if weighted else P(batch_ax),
                      check_vma=False, **manual_axes(cfg))(*args)
  return out if weighted else grads.taken_once(out, scalar)
