"""The flat option names of zerojax 0.1 before the options were grouped,
and what to write now: `config.expand` refuses each old name with its
new spelling."""

NEW_SPELLING = {
    "axis_name": "axes=zerojax.Axes(data=...)",
    "replica_axis": "axes=zerojax.Axes(replica=...)",
    "hpz": "axes=zerojax.Axes(replica=..., hpz=True)",
    "model_axis": "axes=zerojax.Axes(model=...)",
    "compute_dtype": "precision='bf16' (or zerojax.Precision(compute=...))",
    "reduce_dtype": "precision=zerojax.Precision(reduce=...)",
    "loss_scale": "precision=zerojax.Precision(loss_scale=...)",
    "skip_nonfinite": "precision=zerojax.Precision(skip_nonfinite=True)",
    "offload_optimizer": ("offload='host' (or zerojax.Offload('disk', "
                          "dir=...))"),
    "offload_params": "offload=zerojax.Offload(params=True)",
    "offload_fraction": "offload=zerojax.Offload(fraction=...)",
    "update_on": "offload=zerojax.Offload(update_on=...)",
    "offload_dir": "offload=zerojax.Offload('disk', dir=...)",
    "sub_group_size": "offload=zerojax.Offload('disk', sub_group_size=...)",
    "placement": "offload='auto' (with device_budget=)",
    "quantize_weights": "quantize=zerojax.Quantize(weights=...)",
    "quantize_grads": "quantize=zerojax.Quantize(grads=...)",
    "quantize_block": "quantize=zerojax.Quantize(block=...)",
    "stacked": "blocks=zerojax.Blocks(stacked=...)",
    "per_use": "blocks=zerojax.Blocks(per_use=...)",
    "prefetch": "blocks=zerojax.Blocks(prefetch=...)",
    "reshard_after_forward": "blocks=zerojax.Blocks(reshard_after_forward=...)",
    "remat": "blocks=zerojax.Blocks(remat=...)",
    "min_chunk_size": "chunk_size= (the chunk-size search is internal)",
    "search_range": "chunk_size= (the chunk-size search is internal)",
    "search_interval": "chunk_size= (the chunk-size search is internal)",
}
