"""`zerojax.train_step`: `_train.step`'s step, placed at its first call
where the state asks for it (`offload="auto"`: the planner's placement,
`_plan.planner`; `stage="auto"`: a configuration chosen, `_plan.autoconfig`).
The planners compile steps of `_train.step` to plan, so placement at the
first step has this owner above both, and imports only go down."""
from __future__ import annotations

import logging
from typing import Callable

import jax
import numpy as np

from zerojax._plan import autoconfig, planner
from zerojax._train import step as steps
from zerojax._state.state import ZeroTrainState
from zerojax._train.inputs import check_mutable, check_signature, check_state

_log = logging.getLogger("zerojax")


def train_step(loss_fn: Callable, *, has_aux: bool = False,
               mutable: tuple = (), donate: bool = True,
               weighted: bool = False) -> Callable:
  """Builds the jitted ZeRO training step.

  Args:
    loss_fn: `loss_fn(params, batch)` or `loss_fn(params, batch, rng)`,
      written on the full parameter tree and one device's slice of the batch
      (one micro-batch of it under `accum_steps`); returns the floating
      scalar loss, or `(loss, aux)` with `has_aux=True`. The step's loss and
      gradient are the mean of these slices' losses: for a mean over
      examples with equal slices that is the global batch's mean, but a
      masked mean (`(l * mask).sum() / mask.sum()`) becomes a mean of the
      slices' means, which differs when padding is uneven: use `weighted`.
      aux is a pytree (a dict is merged into `metrics`) whose values are
      scalars, averaged over devices and micro-batches, or per-example
      arrays with the micro-batch's leading axis, concatenated in global
      batch order.
    has_aux: whether `loss_fn` returns `(loss, aux)`.
    mutable: names of fields of the user's `TrainState` subclass that the
      loss updates, e.g. `("batch_stats",)` for BatchNorm. `loss_fn` gets
      each as a keyword argument after `batch` (and `rng`) and returns
      `(loss, updates)`, or `(loss, (aux, updates))` with `has_aux`;
      `updates` is a dict `{field: new value}` (Flax's `apply(...,
      mutable=["batch_stats"])` returns one), each value with the field's
      keys and shapes (cast to its dtypes); a declared field left out keeps
      its value. Floating values are averaged over the data axis, as
      Flax's examples `pmean` them; other values must agree across devices
      (the first device's are kept). Under `accum_steps=k` the
      micro-batches update in sequence, each reading the previous one's
      values, as k plain steps of the model would. The updates are kept
      when a step is skipped (a non-finite gradient), as PyTorch keeps
      BatchNorm's running statistics. BatchNorm with `axis_name=` the data
      axis (synchronised batch norm) works as written: the loss runs inside
      a `shard_map` over that axis.
    donate: the step donates the input state's buffers to the new state, so
      the state is held once. A step that fails at run time (a host callback
      raising, say) then leaves no usable input state: restore from a
      checkpoint. `donate=False` keeps the input state intact whatever
      happens, at the cost of holding the old and the new state at once
      during the step (one more state's bytes per device).
    weighted: `loss_fn` returns `(sum, weight)` (or `((sum, weight), aux)`),
      e.g. `((token_loss * mask).sum(), mask.sum())`: the step's loss is
      Σ sum / Σ weight over the whole global batch (every device, every
      micro-batch, every replica), its gradient that ratio's, as under
      `jax.jit` on the whole batch; `metrics["weight"]` is Σ weight. A
      global batch of weight 0 or below (a negative Σ weight has no meaning)
      is a skipped step (`metrics["skipped"]`, nothing changed). Under an
      fp16 loss scale the backward sees each micro-batch's sum divided by
      its weight, as a mean's would be ([Note: a loss-scaled weighted
      loss]).

  Parameters stored in a 16-bit dtype with no float32 master (bfloat16
  params, the default precision) are widened for the forward, their
  gradients reduced in `Precision.reduce`, and optax updates the 16-bit
  parameters with those gradients, rounding the new values to the
  parameters' dtype: within one ulp of plain optax doing the same. For a
  float32 master, keep the params in float32 and set `precision=`.

  Returns:
    `step(state, batch, rng=None) -> (state, metrics)`, jitted, donating
    `state`. `batch` is a pytree of arrays with the global batch on the
    leading axis (numpy arrays are fine). `metrics` holds `loss` (mean over
    the global batch), `grad_norm` (global, before clipping), the aux values,
    and under loss scaling `loss_scale` and `skipped`. `step.lower(state,
    batch)` gives the lowered program (for `memory_analysis()`); state and
    batch may be `jax.ShapeDtypeStruct`s (nothing is allocated).
    `step.trace(state, batch)` gives the traced program, e.g. for
    `.lower(lowering_platforms=("cuda",))`: what a GPU would run, host
    offload transfers included, lowered on any machine.
    `step.gathering(state, batch)` says how the step gathers each chunk
    (`gather_modes`: per layer, per block, whole step or replicated).
    A state with `offload="auto"` is placed by its first step (see
    `zerojax.Offload`); `lower` and `trace` take it as it is placed.
  """
  step = steps.train_step(loss_fn, has_aux=has_aux, mutable=mutable,
                          donate=donate, weighted=weighted)
  mutable = check_mutable(mutable, "train_step")
  planned: dict = {}    # stage="auto"'s chosen config -> its batch's bytes

  def placed(state, batch, rng=None):
    placement = (state.config.placement if isinstance(state, ZeroTrainState)
                 else "manual")   # anything else: refused by `step`
    if placement in ("auto", "plan"):   # checked before it is planned
      check_state(state, "step()", mutable)
      check_signature(loss_fn, rng is not None,
                      state.frontend.keywords(mutable), "step()")
    if placement == "auto":
      state = planner.place_as_planned(state, loss_fn, batch,
                                       has_aux=has_aux, mutable=mutable,
                                       weighted=weighted)
    elif placement == "plan":
      budget = state.config.device_budget
      state = autoconfig.place_as_chosen(state, loss_fn, batch,
                                         has_aux=has_aux, mutable=mutable,
                                         weighted=weighted)
      planned[state.config] = (_batch_bytes(batch), budget)
    elif planned and isinstance(state, ZeroTrainState) and (
        state.config in planned):
      _check_planned_batch(planned, state.config, batch)
    return step(state, batch, rng)

  placed.lower, placed.trace = step.lower, step.trace
  placed.gathering = step.gathering
  return placed


def _batch_bytes(batch) -> int:
  return sum(int(np.prod(np.shape(x))) * np.dtype(x.dtype).itemsize
             for x in jax.tree_util.tree_leaves(batch))


def _check_planned_batch(planned: dict, config, batch) -> None:
  """stage="auto" chose `config` for its first batch's program: a larger
  batch is a program the plan did not measure against the budget. Said
  once per chosen config (`planned`: config -> (planned batch bytes,
  budget), the budget set to None once said)."""
  size, budget = planned[config]
  if budget is None or _batch_bytes(batch) <= size:
    return
  _log.warning(
      "stage='auto' chose its configuration for the first batch "
      "(%d bytes); this batch holds %d bytes, a program the plan did not "
      "measure against device_budget=%r. If it runs out of memory, shard "
      "again with stage='auto' and pass the largest batch first (or plan "
      "it: zerojax.plan(state, loss_fn, largest_batch, device_budget=...)).",
      size, _batch_bytes(batch), budget)
  planned[config] = (size, None)
