"""DeepSpeed's `optimizer` and `scheduler` sections as one optax
transformation (`zerojax.deepspeed.optimizer`), with DeepSpeed's
semantics."""
from __future__ import annotations

import math
from typing import Callable, Union

import jax.numpy as jnp
import optax

_REFUSED_OPTIMIZERS = {
    "onebitadam": "it compresses DeepSpeed's own all-reduce; use Adam or "
                  "AdamW (and zero_quantized_gradients for compressed gradients)",
    "zerooneadam": "it compresses DeepSpeed's own all-reduce; use Adam or "
                   "AdamW (and zero_quantized_gradients for compressed gradients)",
    "onebitlamb": "LAMB reads whole tensors (trust ratios), which flat ZeRO "
                  "chunks cannot give it; use AdamW",
    "lamb": "LAMB reads whole tensors (trust ratios), which flat ZeRO chunks "
            "cannot give it; use AdamW",
    "adagrad": "not mapped; use optax.adagrad directly",
}


def from_sections(ds: dict) -> optax.GradientTransformation:
  """`optimizer` of a loaded configuration (`load`)."""
  section = ds.get("optimizer")
  if not section:
    raise ValueError("the DeepSpeed configuration has no optimizer section.")
  kind = str(section.get("type", "")).lower()
  params = dict(section.get("params", {}))
  if kind in _REFUSED_OPTIMIZERS:
    raise ValueError(f"optimizer type {section.get('type')!r} is refused: "
                     f"{_REFUSED_OPTIMIZERS[kind]}.")
  lr = _schedule(ds.get("scheduler"), float(params.pop("lr", 1e-3)))
  decay = float(params.pop("weight_decay", 0.0))
  if kind in ("adam", "adamw"):
    b1, b2 = params.pop("betas", (0.9, 0.999))
    eps = float(params.pop("eps", 1e-8))
    decoupled = kind == "adamw" or params.pop("adam_w_mode", True)
    params.pop("torch_adam", None)
    if not params.pop("bias_correction", True) or params.pop("amsgrad", False):
      raise ValueError("Adam without bias correction, or AMSGrad, is not "
                       "mapped; use optax directly.")
    _no_more(params, kind)
    if decoupled:
      return optax.adamw(lr, b1, b2, eps, weight_decay=decay)
    return optax.chain(optax.add_decayed_weights(decay),
                       optax.adam(lr, b1, b2, eps))
  if kind == "sgd":
    momentum = float(params.pop("momentum", 0.0))
    nesterov = bool(params.pop("nesterov", False))
    if float(params.pop("dampening", 0.0)) != 0.0:
      raise ValueError("SGD with dampening is not mapped; use optax directly.")
    _no_more(params, kind)
    return optax.chain(optax.add_decayed_weights(decay),
                       optax.sgd(lr, momentum or None, nesterov))
  if kind == "lion":
    b1, b2 = params.pop("betas", (0.9, 0.99))
    _no_more(params, kind)
    return optax.lion(lr, b1, b2, weight_decay=decay)
  raise ValueError(f"optimizer type {section.get('type')!r} is not mapped: "
                   "use Adam, AdamW, SGD or Lion, or pass an optax "
                   "transformation yourself.")


def _no_more(params: dict, kind: str) -> None:
  if params:
    raise ValueError(f"optimizer {kind} params {sorted(params)} are not "
                     "mapped; remove them or use optax directly.")


def _schedule(section, base_lr: float) -> Union[float, Callable]:
  """DeepSpeed's scheduler as a function of optax's update count (DeepSpeed's
  `last_batch_iteration`, 0 at the first step), or `base_lr`."""
  if not section:
    return base_lr
  kind, p = section.get("type"), dict(section.get("params", {}))
  warmup = max(2, int(p.get("warmup_num_steps", 1000)))   # as DeepSpeed
  log = p.get("warmup_type", "log") == "log"

  def rising(t):   # 0 -> 1 over the warm-up
    return (jnp.log(t + 1.0) / math.log(warmup) if log else t / warmup)

  if kind in ("WarmupLR", "WarmupDecayLR"):
    low = float(p.get("warmup_min_lr", 0.0))
    high = float(p.get("warmup_max_lr", 0.001))
    total = int(p.get("total_num_steps", 0))

    def lr(count):
      t = jnp.asarray(count, jnp.float32)
      after = (1.0 if kind == "WarmupLR" else jnp.maximum(
          0.0, (total - t) / max(1.0, total - warmup)))
      return low + (high - low) * jnp.where(t < warmup, rising(t), after)
    return lr
  if kind == "WarmupCosineLR":
    total = int(p["total_num_steps"])
    start = float(p.get("warmup_min_ratio", 0.0))
    floor = float(p.get("cos_min_ratio", 0.0001))

    def lr(count):
      t = jnp.asarray(count, jnp.float32)
      warm = start + rising(t) * (1.0 - start)
      cos = (1 + jnp.cos(jnp.pi * (t - warmup + 1) / (total - warmup))) / 2
      return base_lr * jnp.where(t < warmup, warm,
                                 jnp.maximum(0.0, floor + (1 - floor) * cos))
    return lr
  raise ValueError(f"scheduler type {kind!r} is not mapped: use WarmupLR, "
                   "WarmupDecayLR or WarmupCosineLR, or an optax schedule.")
