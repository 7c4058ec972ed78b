"""train_step(): one jitted program per step, each part as the configured
`StagePolicy` says.

  1. Gradients, loss and aux (`grads.grads_and_metrics`): one `shard_map`
     over the data axis with ZeRO's gather / reduce-scatter / all-reduce.
  2. The update on gradient and master shards: unscale, skip on overflow,
     clip by the global norm, the user's optax update (`update.update`).
     Element-wise work on arrays sharded over the data axis: no
     communication but the scalar norms.
  3. The re-gather (`StagePolicy.regather`, stages 1-2): `shard_map`
     all-gathers the updated shards (cast to the compute dtype first) into
     the replicated compute copy, or the replicated master
     (`update.gather_updated`).
  Under the disk tier, its chunks' updates then stream from their files
  (`disk_stream.run`), outside the program.
"""
from __future__ import annotations

import functools
import logging
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from zerojax._train import disk_stream
from zerojax._train import model_call
from zerojax._tiers import disk_tier
from zerojax._state import memory
from zerojax._core import compat
from zerojax._core import offload
from zerojax._model import peruse as peruse
from zerojax._core import precision
from zerojax._model import gather
from zerojax._options.config import collectives_overlap, shard_axes
from zerojax._train.grads import grads_and_metrics
from zerojax._train.inputs import (check_mutable, check_signature, check_state,
                                   shard_batch)
from zerojax._options.policy import policy
from zerojax._state.state import ZeroTrainState, state_shardings
from zerojax._train.update import forward_reads_master, gather_updated, update

_log = logging.getLogger("zerojax")


def _global_norm(grads, layout, summed: bool) -> jax.Array:
  """The L2 norm over all gradient chunks, one read of each: a dot of each
  chunk with itself over all its axes is one pass, where
  `optax.tree.norm`'s square-then-sum writes a chunk-sized temporary first
  on XLA's CPU backend (and clipping with optax would compute the norm a
  second time). Not `jnp.vdot`: it flattens, and flattening a `[layers,
  length]` chunk sharded on its last axis makes GSPMD gather it whole.

  `summed`: the gradients were summed over devices (or micro-batches). If
  not (one device, one micro-batch), a flat chunk's gradient is the
  concatenate of its leaves' gradients, and XLA's CPU backend writes its
  square out in full before the dot's reduction reads it (more temporaries
  and time: docs/decisions.md, "Figures out of the code's comments"):
  such a chunk's norm is then a dot per leaf, read where the backward left
  each leaf's gradient (XLA folds a slice of a concatenate into its
  operand). The sum is then taken in another order: the norm may differ in
  its last bits."""
  def squares(g):
    axes = tuple(range(g.ndim))
    return jax.lax.dot_general(g, g, ((axes, axes), ((), ())),
                               preferred_element_type=jnp.float32)

  def chunk_squares(c, g):
    chunk = layout.chunks[c]
    if summed or chunk.layers:
      return squares(g)
    return sum(squares(g[..., info.offset:info.offset + info.size])
               for info in (layout.leaves[i] for i in chunk.leaves))
  return jnp.sqrt(sum(chunk_squares(c, g) for c, g in enumerate(grads)))


def _clip(grads, norm, max_norm) -> tuple:
  """`optax.clip_by_global_norm(max_norm)` given the global `norm`: the same
  select and the same arithmetic, so the same values."""
  keep = norm < max_norm
  return tuple(jax.lax.select(keep, g, (g / norm.astype(g.dtype)) * max_norm)
               for g in grads)


def _step(loss_fn, has_aux, mutable, weighted, modes, held, heard,
          state: ZeroTrainState, batch, rng):
  cfg = state.config
  pol = policy(cfg)
  shardings = state_shardings(state)
  # Master chunks in host memory stay there: at stage 3 their gathers move
  # them to the device (one layer at a time for layer chunks), and `_update`
  # moves them along with their optimizer state.
  loss_fn, mutable = state.frontend.loss(loss_fn, has_aux, mutable)
  grads, loss, aux, fields, weight = grads_and_metrics(
      loss_fn, has_aux, mutable, state, batch, rng, modes, weighted, held,
      heard)

  metrics = {"loss": loss}
  if state.loss_scale is not None:
    grads = tuple(g / state.loss_scale.scale for g in grads)
  # A step with a non-finite gradient is skipped under loss scaling (where it
  # is expected) or when asked for (`skip_nonfinite`); a weighted step whose
  # global batch weighs nothing always (its loss is 0/0).
  guard = state.loss_scale is not None or cfg.skip_nonfinite or weighted
  finite = precision.all_finite(grads) if guard else None
  if weighted:
    finite = finite & (weight > 0)
    metrics["weight"] = weight
  summed = cfg.accum_steps > 1 or state.num_batch_shards > 1
  grad_norm = _global_norm(grads, state.layout, summed)   # padding adds nothing
  metrics["grad_norm"] = grad_norm
  if cfg.clip_norm is not None:
    grads = _clip(grads, grad_norm, cfg.clip_norm)

  if forward_reads_master(state) or (pol.gathers_params and
                                     collectives_overlap(state.mesh)):
    # Every chunk's update waits for the loss and the whole backward (the
    # global norm reads every gradient), so that every read of what it
    # replaces comes first and XLA updates the donated buffer in place
    # instead of copying it at the start. Unordered otherwise: the loss,
    # and a block's backward that only feeds an earlier chunk's gradient,
    # read it too. At stage 3, where collectives run beside compute, the
    # backward's re-gathers read the master shards (cast to the compute
    # dtype): unordered, XLA's GPU fusion merges a chunk's update with the
    # cast its own re-gather sends, and every re-gather then waits for a
    # reduce-scatter and an update (docs/stage3.md, "The program 8 GPUs
    # run"). Bit for bit the same values (`nn.tie`); on CPU, where nothing
    # overlaps, the order is left to XLA as before.
    #
    # A disk chunk's gradient is not held back: the sink writes it to its
    # file as the backward produces it (`disk_stream.sink`).
    after = gather.tie(grad_norm, loss)
    streamed = (offload.optimizer_chunks(state.layout, cfg) if cfg.disk
                else frozenset())
    grads = tuple(g if c in streamed else gather.tie(g, after)
                  for c, g in enumerate(grads))
  if pol.update_slice:
    # float32 stages 1-2: the replicated master is the compute copy; this
    # device updates its own slice of it.
    master = tuple(jax.lax.with_sharding_constraint(
        m, NamedSharding(state.mesh, chunk.spec(shard_axes(cfg), cfg.model_axis)))
                   for m, chunk in zip(state.master, state.layout.chunks))
  else:
    master = state.master
  new_master, opt_state, to_gather, pending = update(state, grads, master,
                                                      shardings, finite)
  loss_scale = state.loss_scale
  if loss_scale is not None:
    loss_scale = precision.update(cfg.loss_scale, loss_scale, finite)
    metrics["loss_scale"] = loss_scale.scale
  if guard:
    metrics["skipped"] = ~finite

  compute = state.compute
  if pol.regather:
    gathered = gather_updated(state, to_gather)
    if pol.compute_copy:   # a disk chunk's: after `_disk_update`
      compute = tuple(state.compute[c] if g is None else g
                      for c, g in enumerate(gathered))
    else:
      new_master = gathered
  if isinstance(aux, dict):
    metrics.update(aux)
  elif aux is not None:
    metrics["aux"] = aux
  new_state = state.replace(
      step=state.step + (finite.astype(jnp.int32) if guard else 1),
      master=new_master, compute=compute, opt_state=opt_state,
      loss_scale=loss_scale, extras={**state.extras, **fields})
  new_state = offload.place(new_state, shardings)
  if cfg.disk:
    return new_state, metrics, disk_stream.step_inputs(state, pending, finite)
  return new_state, metrics


def train_step(loss_fn: Callable, *, has_aux: bool = False,
               mutable: tuple = (), donate: bool = True,
               weighted: bool = False) -> Callable:
  """The jitted ZeRO training step, as `zerojax.train_step` documents it,
  but for placement at its first call (`offload="auto"`, `stage="auto"`),
  which `zerojax._first_step` adds: the planner compiles steps of this
  one."""
  if not callable(loss_fn):
    raise TypeError(f"train_step() takes the loss function, got {loss_fn!r}.")
  for name, value in (("has_aux", has_aux), ("donate", donate),
                      ("weighted", weighted)):
    if not isinstance(value, bool):
      raise TypeError(f"train_step({name}={value!r}) must be True or False.")
  mutable = check_mutable(mutable, "train_step")

  heard: dict = {}   # per held set, what its step's trace heard
  programs: dict = {}   # the disk tier's, per state structure
  choices: dict = {}    # `zerojax._model.peruse`'s, per program: (held, why)

  @functools.lru_cache(maxsize=None)
  def jitted_holding(held: frozenset):
    """The step holding `held` (modules beside the blocks) for the step;
    its trace fills `heard[held]` (`grads_and_metrics`)."""
    return jax.jit(functools.partial(_step, loss_fn, has_aux, mutable,
                                     weighted, {}, held,
                                     heard.setdefault(held, {})),
                   donate_argnums=(0,) if donate else (),
                   compiler_options=compat.step_compiler_options())

  def chosen(state, batch, rng) -> tuple:
    """`(held, why)` for this program (`zerojax._model.peruse.choose`), once.
    What the blocks could gather at their calls is heard in the trace of
    the step holding every module beside them, the usual choice, which is
    then the step's own trace (jax keeps it for the call)."""
    key = (state.layout, state.config, state.mesh,
           jax.tree_util.tree_structure(batch),
           tuple((x.shape, x.dtype) for x in jax.tree_util.tree_leaves(batch)),
           rng is None)
    if key not in choices:
      def hear():
        every = peruse.chunks(state.layout, state.config)
        jitted_holding(every)   # its sink made
        heard[every].clear()    # filled again by a new trace
        jitted_holding(every).trace(state, batch, rng)
        return dict(heard[every])
      footprint = lambda held: memory.compiled_footprint(jitted_holding(
          held).lower(state, batch, rng).compile())["device"]
      # (an NNX layout has no chunks beside its blocks: nothing to choose)
      choices[key] = peruse.choose(state.layout, state.config, hear,
                                   footprint)
    return choices[key]

  def jitted(state, batch, rng):
    return jitted_holding(chosen(state, batch, rng)[0])

  def prepare(state, batch):
    check_state(state, "step()", mutable)
    if state.config.disk and not donate:
      raise ValueError(
          "train_step(donate=False) keeps the input state, but a disk-tier "
          "state (Offload('disk')) has its statistics rewritten in "
          "their files by every step; use donate=True (the default), and "
          "checkpoint.save to keep a state to go back to.")
    return shard_batch(state, batch, state.config.accum_steps)

  def checked(state, rng, caller: str) -> None:
    check_state(state, caller, mutable)
    check_signature(loss_fn, rng is not None,
                    state.frontend.keywords(mutable), caller)

  def step(state, batch, rng=None):
    checked(state, rng, "step()")
    batch = prepare(state, batch)
    if state.config.disk:   # a running step only: `lower` needs no files
      disk_tier.check_files(state)
    out = jitted(state, batch, rng)(state, batch, rng)
    if state.config.disk:
      new_state, metrics, inputs = out
      return disk_stream.run(new_state, inputs, programs), metrics
    return out

  def lower(state, batch, rng=None):
    checked(state, rng, "step.lower()")
    batch = prepare(state, batch)
    return jitted(state, batch, rng).lower(state, batch, rng)

  def trace(state, batch, rng=None):
    # on CPU, memory-kind transfers lower to nothing: lower for "cuda" to
    # see them
    checked(state, rng, "step.trace()")
    batch = prepare(state, batch)
    return jitted(state, batch, rng).trace(state, batch, rng)

  step.lower, step.trace = lower, trace

  def traced_afresh(state, batch, rng, caller: str, modes: dict) -> dict:
    """The step traced in a `jax.jit` of its own, filling `modes` (the
    step's trace is cached after its first call, and a cached trace runs no
    Python); returns why the modules beside the blocks are held."""
    checked(state, rng, caller)
    batch = prepare(state, batch)
    held, why = chosen(state, batch, rng)
    jax.jit(functools.partial(_step, loss_fn, has_aux, mutable, weighted,
                              modes, held, None)).trace(state, batch, rng)
    return why

  def gathering(state, batch, rng=None) -> dict:
    modes = {}
    why = traced_afresh(state, batch, rng, "step.gathering()", modes)
    for name, reason in why.items():
      modes[name] = f"{modes[name]} ({reason})"
    return modes

  step.gathering = gathering

  def block_classes(state, batch, rng=None) -> frozenset:
    with model_call.seen_classes() as classes:
      traced_afresh(state, batch, rng, "step.block_classes()", {})
    return frozenset(classes)

  step.block_classes = block_classes
  return step
