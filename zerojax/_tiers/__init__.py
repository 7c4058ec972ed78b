"""The disk tier, ZeRO-Infinity (internal): raw files read and written on a
thread pool (`disk`) and which statistics live in them (`disk_tier`). The
host tier is memory kinds (`zerojax._core.offload`); the disk tier's part of
a step is `zerojax._train.disk_stream`."""
