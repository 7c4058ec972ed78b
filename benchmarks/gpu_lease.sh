#!/usr/bin/env bash
# `python -m benchmarks.run --gpu`'s variants inside one short GPU lease: each
# variant in a fresh process (`python -m benchmarks.gpu`), most wanted first,
# each under a time limit and all under one deadline, so that a slow compile
# costs one row, not the lease. Every finished row is appended to
# $OUT/rows.jsonl at once; stdout and stderr go to $OUT/log.txt; the variants
# in PROFILE_VARIANTS (default: zero-3 plain-dp) also leave a summary of a
# three-step jax.profiler trace in $OUT/profile_<variant>.json. Back here,
# `python -m benchmarks.run --gpu --rows rows.jsonl` writes the results.
# Each row also carries `modelled_step_s`, the GPU-compiled tier's model of
# the very program it timed (`zerojax.GpuTarget.model`): the check of that
# model against a real step (issue 60).
#
#   BUDGET=480 PER_VARIANT=150 bash benchmarks/gpu_lease.sh
#   (BATCH, SEQ, STEPS, ATTENTION, CONFIG, XLA_FLAGS, VARIANTS change what runs)
# A loop-of-blocks variant (`*-unrolled*`) takes 50-100 s in all on an
# H100 (its compile is 10-20 s of it; a profile adds 20 s): keep
# PER_VARIANT at 120 or more for them.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/zerojax_gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
CONFIG=${CONFIG:-gpt2-medium}
deadline=$((SECONDS + ${BUDGET:-480}))
BATCH=${BATCH:-16} SEQ=${SEQ:-1024} STEPS=${STEPS:-20} ATTENTION=${ATTENTION:-cudnn}
# what a failed row was to be measured with (a measured row records it)
setting=$("$PY" -c "import json, os, sys
import jax
from zerojax import compat
print(json.dumps(dict(device_kind=jax.devices()[0].device_kind,
  attention=sys.argv[1], config=sys.argv[2],
  batch_per_device=int(sys.argv[3]), seq=int(sys.argv[4]),
  xla_flags=compat.with_gpu_flags(os.environ.get('XLA_FLAGS', ''))))[1:-1])" \
  "$ATTENTION" "$CONFIG" "$BATCH" "$SEQ")
{
  date -u
  nvidia-smi -L
  "$PY" -c "import jax, flax, optax, orbax.checkpoint as o; print('jax', \
jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__, \
jax.devices())"
} >>"$OUT/log.txt" 2>&1
for v in ${VARIANTS:-zero-3-as-written plain-dp-unrolled zero-3 \
         zero-3-unrolled-save-all zero-3-as-written-remat plain-dp-remat \
         zero-3-save-dots zero-3-save-all plain-dp gspmd-fsdp zero-3-packed \
         zero-3-loss-block zero-3-blocked-embed zero-0 zero-1 zero-2 \
         zero-3-unrolled zero-3-unrolled-no-prefetch}; do
  left=$((deadline - SECONDS))
  limit=$((left < ${PER_VARIANT:-150} ? left : ${PER_VARIANT:-150}))
  if [ "$limit" -lt 30 ]; then
    echo "{\"variant\": \"$v\", $setting, \"error\": \"not run: the lease's time ran out\"}" >>"$OUT/rows.jsonl"
    continue
  fi
  echo "=== $v (limit ${limit} s) $(date -u +%T)" >>"$OUT/log.txt"
  start=$SECONDS
  profile=
  case " ${PROFILE_VARIANTS-zero-3 plain-dp} " in
    *" $v "*) profile="$OUT/profile_$v.json" ;;
  esac
  PROFILE=$profile timeout "$limit" "$PY" -m benchmarks.gpu "$v" "$CONFIG" "$BATCH" "$SEQ" "$STEPS" "$ATTENTION" \
    >"$OUT/row.tmp" 2>>"$OUT/log.txt"
  rc=$?
  if [ $rc -eq 0 ]; then
    tail -n 1 "$OUT/row.tmp" >>"$OUT/rows.jsonl"
  else
    echo "{\"variant\": \"$v\", $setting, \"error\": \"exit $rc after $((SECONDS - start)) s (124: over its ${limit} s limit); see log.txt\"}" >>"$OUT/rows.jsonl"
  fi
  echo "=== $v done rc=$rc in $((SECONDS - start)) s" >>"$OUT/log.txt"
  tail -n 1 "$OUT/rows.jsonl"
done
rm -f "$OUT/row.tmp"
