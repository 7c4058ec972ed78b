"""Communication (internal): the gathers and reduce-scatters of chunk shards
inside `shard_map` (`collectives`) and ZeRO++'s quantized wire format
(`quantize`). Knows nothing of optax or Flax."""
