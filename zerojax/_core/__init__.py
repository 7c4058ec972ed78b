"""The chunk form of a state (internal): how leaves group into chunks
(`chunking`) and where each lives in them (`layout`), the optax state over
chunk views (`optstate`, `optim`), moving a state between tree and chunk
form (`reshard`), memory kinds (`offload`), frozen weights (`frozen`), the
mesh (`meshes`), tensor-parallel dims, loss scaling, the user's outputs,
and the choices that depend on the installed jax (`compat`)."""
