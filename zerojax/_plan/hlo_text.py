"""Optimized HLO text (`compiled.as_text()`) read into computations of
instructions: what `hlo` walks to count a program's collectives."""
from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Optional

_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


def match_bracket(s: str, i: int) -> int:
  """Index of the bracket closing the one at s[i], skipping quoted text."""
  pairs = {"(": ")", "{": "}", "[": "]"}
  stack, quoted = [], False
  for j in range(i, len(s)):
    c = s[j]
    if c == '"' and (j == 0 or s[j - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif c in pairs:
      stack.append(pairs[c])
    elif stack and c == stack[-1]:
      stack.pop()
      if not stack:
        return j
  raise ValueError(f"unbalanced brackets in HLO: {s[i:i + 80]!r}")


def split_top(s: str) -> List[str]:
  """Splits on commas that are not nested in brackets or quotes."""
  out, depth, quoted, start = [], 0, False, 0
  for j, c in enumerate(s):
    if c == '"' and (j == 0 or s[j - 1] != "\\"):
      quoted = not quoted
    elif quoted:
      continue
    elif c in "({[":
      depth += 1
    elif c in ")}]":
      depth -= 1
    elif c == "," and depth == 0:
      out.append(s[start:j].strip())
      start = j + 1
  if s[start:].strip():
    out.append(s[start:].strip())
  return out


@dataclasses.dataclass
class Instr:
  name: str
  shape: str
  opcode: str
  operands: List[str]            # operand names
  operand_shapes: List[Optional[str]]  # inline shapes when printed
  attrs: str


def parse_instruction(line: str) -> Optional[Instr]:
  line = line.strip()
  if line.startswith("ROOT "):
    line = line[5:]
  eq = line.find(" = ")
  if eq < 0:
    return None
  name = line[:eq].strip().lstrip("%")
  rest = line[eq + 3:].lstrip()
  # A tuple shape ends at its closing bracket, an array shape (with its
  # layout, `f32[8,4]{1,0}`) at the first space.
  end = match_bracket(rest, 0) + 1 if rest.startswith("(") else rest.find(" ")
  if end <= 0:
    return None
  shape, rest = rest[:end], rest[end:].lstrip()
  m = re.match(r"([a-z][a-z0-9\-]*)\(", rest)
  if not m:
    return None
  opcode = m.group(1)
  open_at = m.end() - 1
  close = match_bracket(rest, open_at)
  operands, operand_shapes = [], []
  for arg in split_top(rest[open_at + 1:close]):   # "%x" or "f32[8] %x"
    pieces = arg.rsplit(" ", 1)
    operands.append(pieces[-1].lstrip("%"))
    operand_shapes.append(pieces[0] if len(pieces) == 2 else None)
  return Instr(name, shape, opcode, operands, operand_shapes,
                rest[close + 1:])


def parse_module(text: str):
  """{computation: [instructions]}, the entry computation's name, and the
  module's device count (num_partitions x replica_count)."""
  comps: Dict[str, List[Instr]] = {}
  entry, current = None, None
  devices = 1
  for line in text.splitlines():
    if line.startswith("HloModule"):
      parts = re.search(r"num_partitions=(\d+)", line)
      reps = re.search(r"replica_count=(\d+)", line)
      devices = (int(parts.group(1)) if parts else 1) * (
          int(reps.group(1)) if reps else 1)
      continue
    stripped = _COMMENT.sub("", line).strip()
    if current is None:
      m = _HEADER.match(stripped)
      if m and " = " not in stripped.split("(", 1)[0]:
        current = m.group(2)
        comps[current] = []
        if m.group(1):
          entry = current
      continue
    if stripped == "}":
      current = None
      continue
    instr = parse_instruction(stripped)
    if instr is not None:
      comps[current].append(instr)
  if entry is None:
    raise ValueError("no ENTRY computation in the HLO text; pass the text of "
                     "a compiled module (compiled.as_text()).")
  return comps, entry, devices


def called(attrs: str, key: str) -> List[str]:
  m = re.search(key + r"=(\{[^}]*\}|%?[\w.\-]+)", attrs)
  if not m:
    return []
  value = m.group(1).strip("{}")
  return [v.strip().lstrip("%") for v in value.split(",") if v.strip()]
