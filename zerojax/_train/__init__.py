"""The step (internal; public as `zerojax.train_step` and `eval_step`): one
jitted `shard_map` program per step (`step`), its gradients (`grads`) of
the user's function called on the chunks (`model_call`), its
optax update and re-gather (`update`), the disk tier's stream after it
(`disk_stream`), and evaluation (`evaluation`)."""
