"""What the user's functions return, checked where it enters: the loss (a
floating scalar), aux and evaluation values (scalars or per-example), and
the updates of mutable fields (`train_step(mutable=...)`)."""
from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

# metrics the step writes itself; a dict aux is merged beside them
METRICS = ("loss", "grad_norm", "loss_scale", "skipped")


def batch_size(batch) -> int:
  return np.shape(jax.tree_util.tree_leaves(batch)[0])[0]


def loss_and_aux(out, has_aux: bool, batch_size: int,
                 weighted: bool = False) -> tuple:
  """`(loss, aux)` of what the user's loss function returned, checked: a
  floating scalar loss, or with `weighted` a pair `(sum, weight)` of
  scalars, returned as float32; aux values that are scalars or per-example
  arrays (leading axis `batch_size`, this device's micro-batch)."""
  if has_aux:
    loss, aux = split_aux(out)
  elif weighted:
    loss, aux = out, {}
  else:
    if isinstance(out, (tuple, list)):
      raise TypeError(
          f"loss_fn returned {_describe(out)}, not a scalar loss; if it returns "
          "(loss, aux), build the step with train_step(loss_fn, has_aux=True).")
    loss, aux = out, {}
  if weighted:
    _check_names(aux, METRICS + ("weight",))
    return sum_and_weight(loss), check_per_example(aux, batch_size, "aux")
  dtype = jnp.result_type(loss) if hasattr(loss, "dtype") or isinstance(
      loss, (int, float)) else None
  if dtype is None or np.shape(loss) != () or not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(
        f"loss_fn must return a floating scalar loss; it returned "
        f"{_describe(loss)}. Reduce it to a scalar (e.g. .mean()) and keep it "
        "floating: an integer loss has no gradient.")
  _check_names(aux, METRICS)
  return loss, check_per_example(aux, batch_size, "aux")


def _check_names(aux, metrics: tuple) -> None:
  if isinstance(aux, dict):
    taken = sorted(set(map(str, aux)) & set(metrics))
    if taken:
      raise ValueError(
          f"aux key(s) {taken} would overwrite the step's own metric(s) of "
          f"that name (the step reports {', '.join(metrics)}); rename them "
          "in loss_fn's aux dict.")


def sum_and_weight(out) -> tuple:
  """A weighted loss's `(sum, weight)`, float32, else a TypeError."""
  if not (isinstance(out, (tuple, list)) and len(out) == 2 and all(
      np.shape(x) == () and hasattr(jnp.asarray(x), "dtype") for x in out)):
    raise TypeError(
        "weighted=True: the function must return (sum, weight), two "
        "scalars (e.g. ((token_loss * mask).sum(), mask.sum())), or "
        f"((sum, weight), aux) with has_aux; it returned {_describe(out)}.")
  total, weight = (jnp.asarray(x) for x in out)
  if not jnp.issubdtype(total.dtype, jnp.floating):
    raise TypeError(f"weighted=True: the sum must be floating (it "
                    f"has the gradient); got {total.dtype}.")
  return total.astype(jnp.float32), weight.astype(jnp.float32)


def split_aux(out) -> tuple:
  """`(loss, aux)` of a `has_aux` loss's output, else a TypeError."""
  if not (isinstance(out, (tuple, list)) and len(out) == 2):
    raise TypeError(
        "train_step(has_aux=True): loss_fn must return (loss, aux); it "
        f"returned {_describe(out)}. Return a pair, or build the step with "
        "has_aux=False.")
  return tuple(out)


def check_per_example(tree, batch_size: int, what: str):
  """`tree`'s values as arrays, each a scalar or per-example (leading axis
  `batch_size`, this device's micro-batch); raises a TypeError otherwise."""
  for path, a in jax.tree_util.tree_leaves_with_path(tree):
    shape = np.shape(a)
    if shape and shape[0] != batch_size:
      raise TypeError(
          f"{what} value {jax.tree_util.keystr(path) or what} has shape "
          f"{shape}: each {what} value is a scalar (averaged over the batch) or "
          f"has the per-example leading axis ({batch_size} on this device's "
          "micro-batch; concatenated over the global batch).")
  return jax.tree_util.tree_map(jnp.asarray, tree)


def _keyed(tree) -> list:
  return [(jax.tree_util.keystr(k), x)
          for k, x in jax.tree_util.tree_leaves_with_path(tree)]


def _describe(x) -> str:
  if isinstance(x, (tuple, list)):
    return f"a {type(x).__name__} of {len(x)}"
  if hasattr(x, "dtype") and hasattr(x, "shape"):
    return f"an array of dtype {x.dtype} and shape {tuple(x.shape)}"
  return f"a {type(x).__name__}"


def updates(out, has_aux: bool, fields: dict) -> tuple:
  """`(what the loss returned without the updates, updates)` under
  `train_step(mutable=...)`, checked: `(loss, updates)`, or `(loss, (aux,
  updates))` with `has_aux`; `updates` a dict of declared fields, each like
  the field's current value (cast to its dtypes)."""
  shape = "(loss, (aux, updates))" if has_aux else "(loss, updates)"
  pair = lambda x: isinstance(x, (tuple, list)) and len(x) == 2
  if not pair(out) or (has_aux and not pair(out[1])):
    raise TypeError(
        f"train_step(mutable={tuple(fields)}): loss_fn must return {shape}, "
        f"updates a dict {{field: new value}}; it returned {_describe(out)}.")
  loss, rest = out
  aux, updates = rest if has_aux else (None, rest)
  if not isinstance(updates, Mapping):
    raise TypeError(
        f"train_step(mutable={tuple(fields)}): the updates loss_fn returns "
        f"must be a dict {{field: new value}}, got {_describe(updates)}.")
  undeclared = sorted(set(map(str, updates)) - set(fields))
  if undeclared:
    raise ValueError(
        f"loss_fn returned updates for {undeclared}, not declared in "
        f"train_step(mutable={tuple(fields)}); add them to mutable= (fields "
        "of your TrainState subclass), or leave them out of the updates.")
  checked = {}
  for name, new in updates.items():
    # compared by key paths and shapes: a FrozenDict update of a dict field
    # (or the reverse) is the same tree
    new_leaves = _keyed(new)
    old_leaves = _keyed(fields[name])
    if [(k, np.shape(a)) for k, a in new_leaves] != [
        (k, np.shape(b)) for k, b in old_leaves]:
      raise ValueError(
          f"loss_fn's update for {name!r} does not match the state's "
          f"{name!r} (the same keys and shapes are needed): got "
          f"{ {k: np.shape(a) for k, a in new_leaves} }, the state holds "
          f"{ {k: np.shape(b) for k, b in old_leaves} }.")
    checked[name] = jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(fields[name]),
        [jnp.asarray(a).astype(b.dtype) for (_, a), (_, b) in
         zip(new_leaves, old_leaves)])
  return ((loss, aux) if has_aux else loss), checked
