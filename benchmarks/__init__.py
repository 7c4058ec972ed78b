"""zerojax benchmark suite (not part of the installed package).

    python -m benchmarks.run --quick      # its speed suite: about 4 min on 2 cores
    python -m benchmarks.run --full       # GPT-2 small/medium memory + comm

  hlo       collectives counted from a compiled program's optimized HLO
  models    the GPT-2-style Flax model the suites train, and the config
            protocol every benchmark model follows
  user_models  a residual MLP and a transformer written as users write
            them (unrolled blocks), for the speed suite
  variants  zerojax stages 0-3, plain jit data parallelism, GSPMD FSDP, and
            their 1-device counterparts, built side by side
  speed     interleaved step-time measurement
  memory    persistent bytes and compiled footprint per device vs ZeRO
  comm      collectives per step vs ZeRO's communication volume
  report    README.md tables and PNG plots
  run       the entry point (sets the simulated device count before jax)

Nothing here imports jax at package import, so `run` can still set
XLA_FLAGS first.
"""
