"""What zerojax knows of the user's model: its Flax front end (`frontend`:
a TrainState or an NNX module), where its blocks are and how each gathers
its chunks at stage 3 (`gather`, `calls`, `linen`, `nnx`; the opt-in
`layerwise`), and what stage 3 holds beside them (`peruse`). The public
`zerojax.nn` re-exports `layerwise` and `keep_activations`; the core reads
the rest from here, never from `nn`.
"""
