"""`layerwise`: the Flax-facing opt-in of per-block gathering at stage 3
(`zerojax.nn`'s docstring says what it does), and the override the step's
own gathering (`linen.intercept`, `nnx.gather_per_call`) does the work of."""
from __future__ import annotations

import functools

import flax.linen as nn
from flax import nnx

from zerojax._model.calls import (_Arguments, _opted, _public_methods,
                                  _unit_call)
from zerojax._model.gather import (GATHERS_ITSELF, _ACTIVE, _chunk_keys,
                                   _gather_layer, _regathering)
from zerojax._model.nnx import _nnx_layerwise


def layerwise(block: type, *, remat: bool = True, **remat_kwargs) -> type:
  """Wraps a Flax block class so zerojax gathers its parameters per layer.

  Args:
    block: a `flax.linen.Module` or `nnx.Module` class, either scanned
      (`nn.scan` with `variable_axes={"params": 0}`; `nnx.scan` over an
      `nnx.vmap` stack) under a name listed in `ZeroConfig.stacked`, or
      called once per layer under names `<base>_<i>` or, in a list
      (`nnx.List`), `<i>` (unrolled; found by
      `zerojax._core.chunking.repeated_blocks`). Arguments holding no array
      (`deterministic=True`, `None`) are static, not traced. Stage 3
      gathers it per layer (or block); stage 2 reduce-scatters a scanned
      block's gradient per layer; other stages call it as it is.
    remat: rematerialise the block (and its gather) in the backward pass; this
      is what keeps gathered parameters from piling up over depth.
    **remat_kwargs: passed to `nn.remat` (e.g. `prevent_cse`, `policy`).
      An unrolled block's calls inside a stage-3 step always rematerialise
      with `prevent_cse=False`: ties keep them apart instead (see `unit`).
      At stage 3 a `policy` never keeps a layer's or block's gathered
      parameters (`_regathering`): the backward gathers it again. A policy
      that saves what it derives from them (`everything_saveable` keeps
      their casts and transposes) keeps copies of them all the same;
      `keep_activations` keeps the activations and none of those. NNX
      blocks take `policy` (and `remat`) only.

  Returns:
    A module class with the block's constructor and call signature.
  """
  if isinstance(block, type) and issubclass(block, nnx.Module):
    if set(remat_kwargs) - {"policy"}:
      raise TypeError(f"layerwise(NNX block, {sorted(remat_kwargs)}): NNX "
                      "blocks take remat= and policy= only.")
    return _nnx_layerwise(block, remat, remat_kwargs.get("policy"))
  # every public method gathers (a tied `nn.Embed`'s `attend` too); only
  # `__call__` is rematerialised and tied
  regather = remat and "policy" in remat_kwargs
  if regather:
    remat_kwargs = {**remat_kwargs,
                    "policy": _regathering(remat_kwargs["policy"])}
  mapped = nn.map_variables(
      block, "params", init=True,
      trans_in_fn=functools.partial(_gather_layer, regather=regather),
      methods=["__call__", *_public_methods(block, nn.Module)])
  wrapped = nn.remat(mapped, **remat_kwargs) if remat else mapped
  # An unrolled block's call: its ties already keep the re-gather and the
  # recomputation apart from the forward's, and JAX's CSE guard (an
  # optimization barrier over the saved values and the output cotangent)
  # would hold the re-gather back until the cotangent, which prefetch must
  # not wait for (XLA's GPU backend keeps barriers; its CPU backend drops
  # them).
  unit = nn.remat(mapped, **{**remat_kwargs, "prevent_cse": False})

  class Layerwise(wrapped):
    """Per call of an unrolled block: a `custom_vjp` around the gathered,
    rematerialised block, its gathers tied to the block's input (forward)
    and to the output's cotangent (backward), or with prefetch to the
    previous block's input and the next block's output cotangent; see the
    module docstring. Inside a zerojax step every call says where it sits
    (`active`)."""

    @_opted
    def __call__(self, *args, **kwargs):
      context = _ACTIVE.get()
      if context is not None and not self.is_initializing():
        context.called.add(tuple(self.scope.path))
      arguments = _Arguments(args, kwargs)
      if not (remat and self._is_unit()):
        if remat and arguments.any_static:
          return self._remat(arguments, remat_kwargs)(self, *arguments.arrays)
        return super().__call__(*args, **kwargs)
      call = (self._remat(arguments, {**remat_kwargs, "prevent_cse": False})
              if arguments.any_static else
              lambda module, *values: arguments.call(unit.__call__, module,
                                                     values))
      return _unit_call(self, arguments, call)

    @staticmethod
    def _remat(arguments: _Arguments, kwargs: dict):
      """`nn.remat` of the gathered block, as a function of the module and
      the call's arrays, the other arguments closed over (a user's
      `static_argnums` counted them; they are static here already)."""
      kwargs = {k: v for k, v in kwargs.items() if k != "static_argnums"}
      return nn.remat(
          lambda module, *arrays: arguments.call(mapped.__call__, module,
                                                 arrays), **kwargs)

    def _is_unit(self) -> bool:
      """Whether this call holds the shards of an unrolled block's chunks
      (inside a zerojax step; not at init, nor in a scan)."""
      context = _ACTIVE.get()
      if context is None or self.is_initializing():
        return False
      chunks = _chunk_keys(self.variables.get("params", {}))
      return bool(chunks) and not any(context[0].chunks[c].layers
                                      for c in chunks)

  setattr(Layerwise, GATHERS_ITSELF, True)
  for name in _public_methods(block, nn.Module):   # `attend`, say
    if name != "setup":
      setattr(Layerwise, name, _opted(getattr(wrapped, name)))
  # Flax names unnamed submodules after their class: wrapping a block keeps
  # its parameter paths (`Block_0`, not `LayerwiseBlock_0`)
  Layerwise.__name__ = Layerwise.__qualname__ = block.__name__
  return Layerwise
