"""Digests of training results, for refactors that must not change them.

    python tests/digests.py OUT.json            # record (about 5-10 minutes)
    python tests/digests.py OUT.json BASE.json  # record, then compare

Trains each case 3 steps (2 models x stages 0-3 x float32/bfloat16 x
accum 1/4 x plain/clip_norm/offload_optimizer; 88 cases) and hashes the
losses and the gathered parameters. A refactor that claims bit-identical
results records a digest before and after, on the same jax: every case must
match. `ONLY=text` runs only the cases whose name contains `text`. Not a
test (pytest does not collect it): it takes minutes and its hashes depend
on the installed XLA.
"""
import hashlib
import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax.training import train_state  # noqa: E402

import zerojax  # noqa: E402
from models import zopts, make_problem  # noqa: E402

TX = optax.chain(optax.add_decayed_weights(0.1), optax.adam(1e-2))
EXTRAS = ({}, {"clip_norm": 0.5}, {"offload_optimizer": True})


def digests(only: str = "") -> dict:
  out = {}
  for kind in ("transformer", "scan_transformer"):
    model, params, loss_fn, batches = make_problem(kind)
    for stage in (0, 1, 2, 3):
      for dtype in ("float32", "bfloat16"):
        for accum in (1, 4):
          for extra in EXTRAS:
            if extra.get("offload_optimizer") and stage == 0:
              continue
            key = f"{kind}-{stage}-{dtype}-{accum}-{'-'.join(extra) or 'plain'}"
            if only not in key:
              continue
            state = zerojax.shard(
                train_state.TrainState.create(apply_fn=model.apply,
                                              params=params, tx=TX),
                stage=stage, accum_steps=accum, chunk_size=2048,
                **zopts({"compute_dtype": dtype, **extra, "stacked": (
                    ("blocks",) if kind == "scan_transformer" else ())}))
            step = zerojax.train_step(loss_fn)
            h = hashlib.sha256()
            for b in batches[:3]:
              state, metrics = step(state, b)
              h.update(np.asarray(metrics["loss"]).tobytes())
            for x in jax.tree_util.tree_leaves(zerojax.gather_params(state)):
              h.update(np.asarray(x).tobytes())
            out[key] = h.hexdigest()[:16]
            print(key, out[key], flush=True)
  return out


if __name__ == "__main__":
  got = digests(os.environ.get("ONLY", ""))
  with open(sys.argv[1], "w") as f:
    json.dump(got, f, indent=1)
  if len(sys.argv) > 2:
    with open(sys.argv[2]) as f:
      base = json.load(f)
    differ = sorted(k for k in got if k in base and base[k] != got[k])
    print(f"{len(got)} cases, {len(differ)} differ from {sys.argv[2]}: {differ}")
    sys.exit(1 if differ else 0)
