"""DeepSpeed's values read as DeepSpeed reads them, each error naming the
key and its value.

DeepSpeed checks its configuration with pydantic, so a boolean may be
written `true`, `"false"`, `"yes"`, `0` or `1`, and a count `8`, `8.0` or
`"8"`; a fractional count, or a word that is not a boolean, is refused.
`"auto"` (Hugging Face's placeholder) stands for a value the caller fills
(`fill`); one left unfilled is refused by whoever reads it.
"""
from __future__ import annotations

import math
from typing import Any, Optional

AUTO = "auto"
_TRUE = ("true", "t", "yes", "y", "on", "1")
_FALSE = ("false", "f", "no", "n", "off", "0")


def section(parent: dict, key: str, where: str) -> dict:
  """`parent[key]`, a dict ({} if absent); anything else is refused."""
  value = parent.get(key, {})
  if value is None:
    return {}
  if not isinstance(value, dict):
    raise ValueError(f"DeepSpeed key {where}{key}={value!r} must be a section "
                     "(a dict of keys).")
  return value


def boolean(value: Any, key: str) -> bool:
  """A DeepSpeed boolean: True/False, 0/1, or pydantic's words."""
  if isinstance(value, bool):
    return value
  if isinstance(value, (int, float)) and value in (0, 1):
    return bool(value)
  if isinstance(value, str) and value.strip().lower() in _TRUE + _FALSE:
    return value.strip().lower() in _TRUE
  raise ValueError(f"DeepSpeed key {key}={value!r} is not a boolean: use "
                   "true or false.")


def number(value: Any, key: str) -> float:
  """A DeepSpeed float: a number or a numeric string, finite."""
  if isinstance(value, bool):
    raise ValueError(f"DeepSpeed key {key}={value!r} is not a number.")
  try:
    out = float(value)
  except (TypeError, ValueError):
    raise ValueError(f"DeepSpeed key {key}={value!r} is not a number."
                     ) from None
  if not math.isfinite(out):
    raise ValueError(f"DeepSpeed key {key}={value!r} is not a finite number.")
  return out


def count(value: Any, key: str, low: int = 0) -> int:
  """A DeepSpeed integer of at least `low`: 8, 8.0 or "8"; 2.5 is
  refused, as pydantic refuses it."""
  out = number(value, key)
  if out != int(out):
    raise ValueError(f"DeepSpeed key {key}={value!r} is not a whole number.")
  if out < low:
    raise ValueError(f"DeepSpeed key {key}={value!r} must be at least {low}.")
  return int(out)


def choice(value: Any, key: str, choices: tuple) -> str:
  if value not in choices:
    raise ValueError(f"DeepSpeed key {key}={value!r}: use one of "
                     f"{', '.join(repr(c) for c in choices)}.")
  return value


def autos(tree: Any, where: str = "") -> list:
  """The dotted keys of `tree` whose value is "auto"."""
  if not isinstance(tree, dict):
    return []
  out = []
  for k, v in tree.items():
    if isinstance(v, dict):
      out += autos(v, f"{where}{k}.")
    elif v == AUTO:
      out.append(f"{where}{k}")
  return out


def fill(section_: dict, key: str, value: Optional[Any], where: str,
         argument: str) -> dict:
  """`section_` with its "auto" `key` set to `value` (the caller's
  `argument=`). A value given where the configuration has its own number
  is refused unless they agree (Hugging Face's rule: a value is set in
  one place). `value` None leaves the section as it is."""
  if value is None:
    return section_
  have = section_.get(key)
  if key in section_ and have != AUTO and have != value:
    raise ValueError(f"DeepSpeed key {where}{key}={have!r} and {argument}="
                     f"{value!r} disagree: set the key to \"auto\" to take "
                     f"{argument}=, or drop {argument}=.")
  return {**section_, key: value}


def refuse_autos(keys: list, how: dict) -> None:
  """Refuses the "auto" `keys` left unfilled, naming each and the argument
  that fills it (`how`: key -> argument)."""
  if keys:
    shown = "; ".join(f"{k} (pass {how[k]})" if k in how else k for k in keys)
    raise ValueError(f"DeepSpeed key(s) left \"auto\" with nothing to fill "
                     f"them: {shown}. \"auto\" is Hugging Face's placeholder "
                     "for a value its Trainer fills; pass it here, or write "
                     "the value into the configuration.")
