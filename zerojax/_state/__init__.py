"""The sharded state (internal; public through `zerojax.shard`, `create`,
`gather_params` and the memory reports): `ZeroTrainState` and `shard()`
(`state`), building one without the full model (`sharded_init`), its
ordinary forms (`gathered`), and its bytes per device (`memory`)."""
