"""Per-device bytes of what `zerojax.create` compiles: a measurement the
tests make of `create`'s peak (it reads `sharded_init`'s programs)."""
from typing import Callable, Optional

import jax
import optax
from jax.sharding import Mesh

from zerojax._state import memory
from zerojax._state import sharded_init


def create_footprint(init_fn: Callable, rng: jax.Array, *,
                     apply_fn: Optional[Callable] = None,
                     tx: optax.GradientTransformation, stage: int = 3,
                     mesh: Optional[Mesh] = None, **options) -> dict:
  """Per-device bytes `create` needs at its peak, from the compiled programs:
  the chunks made so far plus the running program's argument + output +
  temp - alias (see `zerojax.compiled_footprint`).

  Returns:
    {"peak": bytes, "programs": the footprint dict of every program, in the
    order `create` runs them}.
  """
  chunks, rest_program, split, assemble = sharded_init._create_programs(
      init_fn, rng, apply_fn, tx, stage, mesh, options)
  held, peak, prints = 0, 0, []

  def run(program, *args):
    nonlocal peak
    fp = memory.compiled_footprint(program.lower(*args).compile())
    peak = max(peak, held + fp["footprint"])
    prints.append(fp)
    return jax.eval_shape(program, *args)

  made = []
  for make in chunks:
    if isinstance(make, sharded_init._GroupProgram):
      pairs = run(make.make, rng)
      held += memory.per_device_bytes(pairs)
      made.extend(pairs)
      continue
    master = run(make.start, rng)
    for add_leaf in make.leaves:
      master = run(add_leaf, rng, master)
    held += memory.per_device_bytes(master)
    compute = run(make.cast, master) if make.cast else None
    held += memory.per_device_bytes(compute)
    made.append((master, compute))
  rest = run(rest_program, rng)
  held += memory.per_device_bytes(rest)
  # the assembling program's arguments are the chunks held so far (donated,
  # but for the masters that leave the device: `sharded_init` splits them)
  held = 0
  run(assemble, *split(tuple(m for m, _ in made), sharded_init._compute(made),
                      rest))
  return {"peak": peak, "programs": prints}
