"""GPU clusters a program is compiled for without having them: XLA's
description of the card, the topology (hosts x GPUs per host), and the
figures the modelled step reads (`zerojax._plan.schedule`).

    target = zerojax.GpuTarget("h100", hosts=8)       # 64 GPUs
    mesh = target.mesh()                               # abstract devices
    state = zerojax.shard_shape(abstract, stage=3, mesh=mesh)
    compiled = target.compile(step.lower(state, batch))
    target.model(compiled).time                        # seconds, modelled

A CPU-only process compiles for the GPU ("deviceless" ahead-of-time
compile): jax's CUDA plugin must be installed (`jax-cuda12-plugin` and
`jax-cuda12-pjrt` at jaxlib's version, no `nvidia-*` wheels are needed)
and no CUDA backend is started (`JAX_PLATFORMS=cpu` works). The compiled
program is the one XLA builds for those GPUs: `memory_analysis()` is a
GPU's bytes, `as_text()` its scheduled HLO.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import re
from typing import Optional, Sequence

import numpy as np
from jax.sharding import AxisType, Mesh

from zerojax._core import compat
from zerojax._plan import schedule
from zerojax._plan.costmodel import DEVICE_FIGURES

# XLA's description of each card (`GpuTargetConfigProto` text), and the
# facts of another card that differ from it. XLA's H100 SXM spec
# (xla/backends/gpu/target_config/specs) less its rate tables and
# `collective_memory_granularity`, which jaxlib 0.10 cannot parse. The
# H200 is an H100 with HBM3e: 141 GB at 4.8 TB/s, the same SMs and clocks.
_SPEC = {"h100": ("h100_sxm.txtpb", {}),
         "h200": ("h100_sxm.txtpb", {
             "memory_bandwidth": "4800000000000",
             "device_memory_size": "151397597184",
             "name": '"NVIDIA H200 141GB HBM3e"',
             "device_description_str": '"NVIDIA H200 141GB HBM3e"'})}
# The card's peaks and links are the planner's (`costmodel.DEVICE_FIGURES`,
# vendor data sheets) and its memory bandwidth its description's; a
# float32 matmul runs on the tensor cores as TF32, at half the 16-bit rate
# (XLA's H100 and H200 specs: 132 SMs x 4 units x 256 TF32 FMAs a clock).
TF32_OF_16BIT = 0.5
# one 400 Gb/s InfiniBand NDR port per GPU (DGX H100 / H200)
NODE_LINK = DEVICE_FIGURES["H100"]["node_link"]


def _options(flags: dict) -> dict:
  """`GPU_FLAGS` as compile options (typed values)."""
  typed = {"true": True, "false": False}
  return {k: typed.get(v, v) for k, v in flags.items()}


@dataclasses.dataclass(frozen=True)
class GpuTarget:
  """A GPU cluster to compile and plan for, present or not.

  Args:
    gpu: the card, "h100" (SXM, 80 GB) or "h200" (141 GB).
    hosts: how many hosts.
    gpus_per_host: GPUs per host (NVLink within a host).
    node_link: bytes/s per GPU between hosts, one way (400 Gb/s
      InfiniBand: 50e9).
  """
  gpu: str = "h100"
  hosts: int = 1
  gpus_per_host: int = 8
  node_link: float = NODE_LINK

  def __post_init__(self):
    if self.gpu not in _SPEC:
      raise ValueError(f"GpuTarget(gpu={self.gpu!r}): zerojax knows "
                       f"{sorted(_SPEC)}.")
    for name in ("hosts", "gpus_per_host"):
      value = getattr(self, name)
      if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"GpuTarget({name}={value!r}) must be a positive "
                         "integer.")
    if not self.node_link > 0:
      raise ValueError(f"GpuTarget(node_link={self.node_link!r}) must be "
                       "positive (bytes/s per GPU).")

  @property
  def devices(self) -> int:
    return self.hosts * self.gpus_per_host

  def __str__(self) -> str:
    return f"{self.hosts} x {self.gpus_per_host} {self.gpu.upper()}"

  @property
  def memory_bytes(self) -> int:
    """The card's memory (its description's `device_memory_size`)."""
    return int(self._field("device_memory_size"))

  @property
  def device_figures(self) -> dict:
    """The planner's figures of this card (`costmodel.DEVICE_FIGURES`)."""
    return DEVICE_FIGURES[self.gpu.upper()]

  def _field(self, name: str) -> str:
    return re.search(rf"\n\s*{name}: ([^\n]*)", self.config_text()).group(1)

  def config_text(self) -> str:
    """XLA's `GpuTargetConfigProto` of the card, as text."""
    name, changes = _SPEC[self.gpu]
    text = (importlib.resources.files("zerojax._plan") / "gpu_targets"
            / name).read_text()
    for field, value in changes.items():
      text, n = re.subn(rf"(\n\s*{field}: )[^\n]*", rf"\g<1>{value}", text)
      assert n, field
    return text

  def topology(self):
    """jax's topology of these GPUs (`jax.experimental.topologies`)."""
    return _topology(self.gpu, self.hosts, self.gpus_per_host,
                     self.config_text())

  def mesh(self, shape: Optional[Sequence[int]] = None,
           axes: Sequence[str] = ("data",)) -> Mesh:
    """A mesh over the target's devices (host-major: a leading axis of
    `hosts` spans the hosts), of `shape` (default: all on one axis)."""
    devices = np.array(self.topology().devices)
    shape = (self.devices,) if shape is None else tuple(shape)
    return Mesh(devices.reshape(shape), tuple(axes),
                axis_types=(AxisType.Auto,) * len(shape))

  def compile(self, lowered, options: Optional[dict] = None):
    """`lowered` (lowered on a mesh of `mesh()`) compiled for these GPUs,
    with the XLA flags zerojax sets on a GPU machine
    (`zerojax._core.compat.GPU_FLAGS`, those this XLA still has as
    options) and `options` on top."""
    flags = compat.compiler_options(_options(compat.GPU_FLAGS))
    with compat.without_compilation_cache():
      return lowered.compile(compiler_options={**flags, **(options or {})})

  def figures(self) -> schedule.Figures:
    """What the modelled step reads of this card and its links."""
    card = self.device_figures
    return schedule.Figures(
        flops_16=card["flops16"], flops_32=TF32_OF_16BIT * card["flops16"],
        memory_bandwidth=float(self._field("memory_bandwidth")),
        link=card["link"], node_link=self.node_link, pcie=card["pcie"],
        gpus_per_host=self.gpus_per_host)

  def model(self, compiled) -> schedule.StepModel:
    """The modelled step of a program compiled for this target."""
    return schedule.model_step(compiled.as_text(), self.figures())


@functools.lru_cache(maxsize=None)
def _topology(gpu: str, hosts: int, per_host: int, text: str):
  try:
    from jax.experimental import topologies
    return topologies.get_topology_desc(
        platform="cuda", topology=f"1x{hosts}x{per_host}",
        target_config=text)
  except Exception as e:  # noqa: BLE001 - jax's error when the plugin is absent
    import jaxlib
    raise RuntimeError(
        f"compiling for {hosts} x {per_host} {gpu.upper()} needs jax's CUDA "
        f"plugin at jaxlib's version: pip install "
        f"jax-cuda12-plugin=={jaxlib.__version__} "
        f"jax-cuda12-pjrt=={jaxlib.__version__} (no GPU needed; run with "
        f"JAX_PLATFORMS=cpu). jax said: {str(e).splitlines()[0]}") from e
