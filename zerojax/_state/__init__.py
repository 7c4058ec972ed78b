"""The sharded state (internal; public through `zerojax.shard`, `create`,
`gather_params` and the memory reports): `ZeroTrainState` (`state`),
`shard()` and its checks (`shard`), a chunk form built from a tree
(`build`), built without the full model (`sharded_init`), its ordinary
forms (`gathered`), and its bytes per device (`memory`)."""
