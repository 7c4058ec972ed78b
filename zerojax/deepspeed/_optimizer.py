"""DeepSpeed's `optimizer` and `scheduler` sections as one optax
transformation (`zerojax.deepspeed.optimizer`), with DeepSpeed's
semantics (`deepspeed/runtime/engine.py`'s `_configure_basic_optimizer`,
`deepspeed/runtime/lr_schedules.py`). Every parameter is read with its
type, an unknown one is refused naming it, and the "auto" values are
filled from the caller's arguments (`fills`) or refused."""
from __future__ import annotations

import logging
import math
from typing import Callable, Union

import jax.numpy as jnp
import optax

from zerojax.deepspeed import _values as values

_log = logging.getLogger("zerojax")

_REFUSED_OPTIMIZERS = {
    "onebitadam": "it compresses DeepSpeed's own all-reduce; use Adam or "
                  "AdamW (and zero_quantized_gradients for compressed gradients)",
    "zerooneadam": "it compresses DeepSpeed's own all-reduce; use Adam or "
                   "AdamW (and zero_quantized_gradients for compressed gradients)",
    "onebitlamb": "it compresses DeepSpeed's own all-reduce; pass "
                  "optax.lamb yourself",
    "lamb": "DeepSpeed's Lamb clamps its trust ratio (max_coeff, min_coeff), "
            "optax.lamb does not; pass optax.lamb yourself (zerojax runs it "
            "on leaves in their own shapes)",
    "adagrad": "not mapped; use optax.adagrad directly",
}
# each scheduler's parameters (lr_schedules.py's constructors)
_WARMUP = ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
           "last_batch_iteration")
_SCHEDULER_PARAMS = {
    "WarmupLR": _WARMUP,
    "WarmupDecayLR": _WARMUP + ("total_num_steps",),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio",
                       "warmup_num_steps", "cos_min_ratio", "warmup_type",
                       "last_batch_iteration"),
}
# the argument of `zerojax.deepspeed.optimizer` that fills each "auto"
_FILLED_BY = {"optimizer.params.lr": "lr=", "optimizer.params.betas": "betas=",
              "optimizer.params.eps": "eps=",
              "optimizer.params.weight_decay": "weight_decay=",
              "scheduler.params.warmup_max_lr": "lr=",
              "scheduler.params.warmup_num_steps": "warmup_steps=",
              "scheduler.params.total_num_steps": "total_steps="}


def from_sections(ds: dict, fills: dict) -> optax.GradientTransformation:
  """The optimizer of a loaded configuration (`load`), its "auto" values
  filled from `fills` (`zerojax.deepspeed.optimizer`'s arguments)."""
  section = values.section(ds, "optimizer", "")
  if not section:
    raise ValueError("the DeepSpeed configuration has no optimizer section.")
  scheduler = values.section(ds, "scheduler", "")
  section, scheduler = _filled(section, scheduler, fills)
  kind = str(section.get("type", "")).lower()
  params = dict(values.section(section, "params", "optimizer."))
  if kind in _REFUSED_OPTIMIZERS:
    raise ValueError(f"optimizer type {section.get('type')!r} is refused: "
                     f"{_REFUSED_OPTIMIZERS[kind]}.")
  where = "optimizer.params."
  base_lr = values.number(params.pop("lr", 1e-3), f"{where}lr")
  lr = _schedule(scheduler, base_lr)
  decay = values.number(params.pop("weight_decay", 0.0), f"{where}weight_decay")
  if kind in ("adam", "adamw"):
    b1, b2 = _betas(params.pop("betas", (0.9, 0.999)), f"{where}betas")
    eps = values.number(params.pop("eps", 1e-8), f"{where}eps")
    # "AdamW" is decoupled whatever adam_w_mode says; "Adam" unless it is
    # false (DeepSpeed's effective_adam_w_mode)
    w_mode = values.boolean(params.pop("adam_w_mode", True),
                            f"{where}adam_w_mode")
    decoupled = kind == "adamw" or w_mode
    params.pop("torch_adam", None)   # which torch kernel: no effect here
    for key, default in (("bias_correction", True), ("amsgrad", False)):
      if key in params and values.boolean(params.pop(key),
                                          f"{where}{key}") != default:
        raise ValueError(f"DeepSpeed key {where}{key}={not default} is not "
                         "mapped (Adam without bias correction, AMSGrad); "
                         "remove it or use optax directly.")
    _no_more(params, kind)
    if decoupled:
      return optax.adamw(lr, b1, b2, eps, weight_decay=decay)
    return optax.chain(optax.add_decayed_weights(decay),
                       optax.adam(lr, b1, b2, eps))
  if kind == "sgd":
    momentum = values.number(params.pop("momentum", 0.0), f"{where}momentum")
    nesterov = values.boolean(params.pop("nesterov", False),
                              f"{where}nesterov")
    if values.number(params.pop("dampening", 0.0), f"{where}dampening") != 0:
      raise ValueError("SGD with dampening is not mapped; use optax directly.")
    _no_more(params, kind)
    return optax.chain(optax.add_decayed_weights(decay),
                       optax.sgd(lr, momentum or None, nesterov))
  if kind == "lion":
    b1, b2 = _betas(params.pop("betas", (0.9, 0.99)), f"{where}betas")
    _no_more(params, kind)
    return optax.lion(lr, b1, b2, weight_decay=decay)
  raise ValueError(f"optimizer type {section.get('type')!r} is not mapped: "
                   "use Adam, AdamW, SGD or Lion, or pass an optax "
                   "transformation yourself.")


def _filled(section: dict, scheduler: dict, fills: dict) -> tuple:
  """The optimizer and scheduler sections with their "auto" values filled
  from `fills`; any other "auto" is refused, naming its argument."""
  params = dict(values.section(section, "params", "optimizer."))
  where = "optimizer.params."
  for key, arg in (("lr", "lr"), ("betas", "betas"), ("eps", "eps"),
                   ("weight_decay", "weight_decay")):
    value = fills[arg]
    params = values.fill(params, key, None if value is None else (
        list(value) if key == "betas" else value), where, arg)
  section = {**section, "params": params}
  if scheduler:
    sparams = dict(values.section(scheduler, "params", "scheduler."))
    where = "scheduler.params."
    if sparams.get("warmup_min_lr") == values.AUTO:
      sparams["warmup_min_lr"] = 0.0   # the Trainer's own fill
    lr = fills["lr"] if fills["lr"] is not None else (
        params.get("lr") if params.get("lr") != values.AUTO else None)
    if sparams.get("warmup_max_lr") == values.AUTO and lr is not None:
      sparams["warmup_max_lr"] = lr
    for key, arg in (("warmup_num_steps", "warmup_steps"),
                     ("total_num_steps", "total_steps")):
      sparams = values.fill(sparams, key, fills[arg], where, arg)
    scheduler = {**scheduler, "params": sparams}
  values.refuse_autos(values.autos({"optimizer": section,
                                    "scheduler": scheduler}), _FILLED_BY)
  return section, scheduler


def _betas(value, key: str) -> tuple:
  if not isinstance(value, (list, tuple)) or len(value) != 2:
    raise ValueError(f"DeepSpeed key {key}={value!r} is two numbers, "
                     "[beta1, beta2].")
  return tuple(values.number(b, f"{key}[{i}]") for i, b in enumerate(value))


def _no_more(params: dict, kind: str) -> None:
  if params:
    raise ValueError(f"DeepSpeed key(s) optimizer.params."
                     f"{', optimizer.params.'.join(sorted(params))} of "
                     f"optimizer {kind} are not mapped; remove them or use "
                     "optax directly.")


def _schedule(section: dict, base_lr: float) -> Union[float, Callable]:
  """DeepSpeed's scheduler as a function of optax's update count (DeepSpeed's
  `last_batch_iteration`, 0 at the first step), or `base_lr`."""
  if not section:
    return base_lr
  kind = section.get("type")
  if kind not in _SCHEDULER_PARAMS:
    raise ValueError(f"scheduler type {kind!r} is not mapped: use WarmupLR, "
                     "WarmupDecayLR or WarmupCosineLR, or an optax schedule.")
  p = dict(values.section(section, "params", "scheduler."))
  where = "scheduler.params."
  unknown = sorted(set(p) - set(_SCHEDULER_PARAMS[kind]))
  if unknown:
    raise ValueError(f"DeepSpeed key(s) {where}{f', {where}'.join(unknown)} "
                     f"are not parameters of {kind} (its parameters: "
                     f"{', '.join(_SCHEDULER_PARAMS[kind])}).")
  if values.count(p.get("last_batch_iteration", -1),
                  f"{where}last_batch_iteration", -1) != -1:
    raise ValueError(f"DeepSpeed key {where}last_batch_iteration="
                     f"{p['last_batch_iteration']!r}: the schedule reads "
                     "optax's update count, which a checkpoint restores; "
                     "remove the key.")
  warmup = max(2, values.count(p.get("warmup_num_steps", 1000),
                               f"{where}warmup_num_steps", 1))   # as DeepSpeed
  log = values.choice(p.get("warmup_type", "log"), f"{where}warmup_type",
                      ("log", "linear")) == "log"

  def rising(t):   # 0 -> 1 over the warm-up
    return (jnp.log(t + 1.0) / math.log(warmup) if log else t / warmup)

  total = None
  if kind != "WarmupLR":
    if "total_num_steps" not in p:
      raise ValueError(f"DeepSpeed key {where}total_num_steps is missing: "
                       f"{kind} decays over it (DeepSpeed requires it too); "
                       "write it, or set it to \"auto\" and pass "
                       "zerojax.deepspeed.optimizer(..., total_steps=).")
    total = values.count(p["total_num_steps"], f"{where}total_num_steps", 1)
    if total < warmup:
      _log.warning("%stotal_num_steps=%d is less than "
                   "warmup_num_steps=%d: the decay starts at its end (as in "
                   "DeepSpeed).", where, total, warmup)
  if kind in ("WarmupLR", "WarmupDecayLR"):
    low = values.number(p.get("warmup_min_lr", 0.0), f"{where}warmup_min_lr")
    # WarmupLR rises to the optimizer's lr unless told (DeepSpeed's
    # default); WarmupDecayLR's own default is 0.001
    high = values.number(p.get("warmup_max_lr", base_lr if kind == "WarmupLR"
                               else 0.001), f"{where}warmup_max_lr")

    def lr(count):
      t = jnp.asarray(count, jnp.float32)
      after = (1.0 if kind == "WarmupLR" else jnp.maximum(
          0.0, (total - t) / max(1.0, total - warmup)))
      return low + (high - low) * jnp.where(t < warmup, rising(t), after)
    return lr
  start = values.number(p.get("warmup_min_ratio", 0.0),
                        f"{where}warmup_min_ratio")
  floor = values.number(p.get("cos_min_ratio", 0.0001), f"{where}cos_min_ratio")
  span = max(1, total - warmup)

  def lr(count):
    t = jnp.asarray(count, jnp.float32)
    warm = start + rising(t) * (1.0 - start)
    # the progress clamped to 1: at the floor from the end on (and at once
    # where total <= warm-up), as DeepSpeed's
    progress = jnp.minimum(1.0, (t - warmup + 1) / span)
    cos = (1 + jnp.cos(jnp.pi * progress)) / 2
    return base_lr * jnp.where(t < warmup, warm,
                               jnp.maximum(0.0, floor + (1 - floor) * cos))
  return lr
