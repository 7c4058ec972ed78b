"""A pooled malloc for CPU timings.

XLA's CPU client mallocs each execution's temporaries and frees them after.
glibc maps an allocation over 32 MiB afresh (its largest mmap threshold),
and one over a thread arena's 64 MiB heap whatever the threshold, so such
a program page-faults its whole temporary buffer in every step: at
`benchmarks.run --full`'s 1024 tokens per device about 0.35 s of a 0.5 s
step was the kernel zeroing pages, charged to the programs with large
temporaries (no rematerialisation), which made them look slower than they
compute. Accelerators allocate from a pool; so do the CPU timings: one
malloc arena, no mmap, no trimming, set before the process starts (a
re-exec).
"""
import os
import sys

ALLOCATOR_TUNABLES = ("glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:"
                      "glibc.malloc.trim_threshold=4294967295")


def pooled() -> bool:
  """Whether this process runs with the pooled malloc."""
  return ALLOCATOR_TUNABLES in os.environ.get("GLIBC_TUNABLES", "")


def restart_pooled(module: str) -> None:
  """Restarts this process as `python -m module` with the same arguments
  and the pooled malloc, unless it has it already (or is not on Linux)."""
  if not sys.platform.startswith("linux") or pooled():
    return
  os.environ["GLIBC_TUNABLES"] = ":".join(
      t for t in (os.environ.get("GLIBC_TUNABLES"), ALLOCATOR_TUNABLES) if t)
  os.execv(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]])
