"""The program 8 H100s would run, compiled on this CPU machine
(`zerojax.GpuTarget`, `zerojax._plan.schedule`): every stage-3 backward
re-gather and gradient reduce-scatter has compute scheduled beside it, and
the per-GPU bytes are what the state and the activations need.

Needs jax's CUDA plugin (`jax-cuda12-plugin`, `jax-cuda12-pjrt` at
jaxlib's version; .ci/run installs them); without it these tests skip,
except under CI, where they fail.
"""
import importlib.util
import os

import flax.linen as nn
from flax import nnx
import jax
import jax.numpy as jnp
import optax
import pytest
from flax.training import train_state
from jax.sharding import NamedSharding, PartitionSpec as P

import zerojax
from zerojax._plan import autoconfig, schedule

_PLUGIN = importlib.util.find_spec("jax_cuda12_plugin") is not None
needs_plugin = pytest.mark.skipif(
    not _PLUGIN and not os.environ.get("CI"),
    reason="jax's CUDA plugin is not installed (pip install "
           "jax-cuda12-plugin==<jaxlib's version> jax-cuda12-pjrt==<same>)")

WIDTH, BLOCKS, ROWS = 1024, 4, 8192   # rows per GPU


class Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(WIDTH)(nn.gelu(nn.LayerNorm()(x)))


class Net(nn.Module):
  """Unscanned blocks, no zerojax edits: stage 3 finds and gathers them."""
  block: type = Block

  @nn.compact
  def __call__(self, x):
    for i in range(BLOCKS):
      x = self.block(name=f"block_{i}")(x)
    return nn.Dense(1)(x)


def _abstract_state(model: nn.Module = Net(), example=(1, WIDTH)):
  """(abstract AdamW state, mean-squared-error loss) of `model`, whose
  input is shaped like `example`."""
  params = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros(example))["params"])
  tx = optax.adamw(1e-3)
  state = train_state.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32), apply_fn=model.apply,
      params=params, tx=tx, opt_state=jax.eval_shape(tx.init, params))

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"]) - b["y"]) ** 2)
  return state, loss


class NnxBlock(nnx.Module):
  def __init__(self, rngs):
    self.norm = nnx.LayerNorm(WIDTH, rngs=rngs)
    self.dense = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

  def __call__(self, x):
    return x + self.dense(nnx.gelu(self.norm(x)))


class NnxNet(nnx.Module):
  """The same model in NNX: blocks in an `nnx.List`, called in a loop."""

  def __init__(self, rngs):
    self.blocks = nnx.List([NnxBlock(rngs) for _ in range(BLOCKS)])
    self.head = nnx.Linear(WIDTH, 1, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(x)


def _compiled(target: zerojax.GpuTarget, front: str = "linen",
              model: nn.Module = Net(), **options):
  """The stage-3 step (bf16 compute, AdamW; `options` for `shard`) of
  `model` (linen) or `NnxNet` compiled for `target`, and its abstract
  state."""
  tx, mesh = optax.adamw(1e-3), target.mesh()
  if front == "nnx":
    zero = zerojax.shard_shape(nnx.eval_shape(lambda: NnxNet(nnx.Rngs(0))),
                               tx=tx, stage=3, mesh=mesh, precision="bf16",
                               **options)
    loss = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  else:
    state, loss = _abstract_state(model)
    zero = zerojax.shard_shape(state, stage=3, mesh=mesh, precision="bf16",
                               **options)
  rows = ROWS * target.devices
  batch = {k: jax.ShapeDtypeStruct(shape, jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P("data")))
           for k, shape in (("x", (rows, WIDTH)), ("y", (rows, 1)))}
  step = zerojax.train_step(loss)
  return target.compile(step.lower(zero, batch)), zero


@needs_plugin
@pytest.mark.parametrize("front", ["linen", "nnx"])
def test_stage3_backward_collectives_overlap_compute_on_8_h100(front):
  target = zerojax.GpuTarget("h100")
  compiled, _ = _compiled(target, front)
  model = target.model(compiled)
  regathers = model.of("all-gather", "backward")
  scatters = model.of("reduce-scatter")
  forward = model.of("all-gather", "forward")
  # (XLA may combine a few blocks' gathers into one op): the backward
  # re-gathers every block but the last, whose forward gather it keeps
  wire = lambda ops: sum(c.wire_bytes for c in ops)
  assert wire(regathers) >= (BLOCKS - 1) / BLOCKS * 0.99 * wire(forward) > 0
  assert scatters, model.summary()
  alone = [c.name for c in regathers + scatters if not c.overlapped]
  assert not alone, (alone, model.summary())
  # the forward gathers but the first run beside compute too
  assert sum(not c.overlapped for c in forward) <= 1, model.summary()


@needs_plugin
def test_stage3_gpu_bytes_are_state_plus_activations():
  """Per-GPU bytes within 10% of what stage 3 should hold: the state
  (`estimate_memory`), the batch, the compiled activations (the same step
  compiled for one GPU on one GPU's rows: its temporaries) and two blocks
  gathered with their gradients (prefetch gathers one block ahead)."""
  eight, one = zerojax.GpuTarget("h100"), zerojax.GpuTarget("h100", 1, 1)
  compiled, state = _compiled(eight)
  ma = compiled.memory_analysis()
  footprint = (ma.argument_size_in_bytes + ma.output_size_in_bytes
               - ma.alias_size_in_bytes + ma.temp_size_in_bytes)
  layout = state.layout
  num_params = sum(info.size for info in layout.leaves)
  persistent = zerojax.estimate_memory(
      num_params, stage=3, num_devices=8,
      compute_dtype=jnp.bfloat16)["persistent"]
  batch = ROWS * (WIDTH + 1) * 2   # one GPU's rows, bfloat16
  activations = _compiled(one)[0].memory_analysis().temp_size_in_bytes
  block = max(sum(layout.leaves[i].size for i in chunk.leaves)
              for chunk in layout.chunks if chunk.stack is not None)
  window = 2 * block * (2 + 4)   # bfloat16 gathered, float32 gradient
  expected = persistent + batch + activations + window
  assert abs(footprint / expected - 1) <= 0.10, (footprint, expected)


class MlpBlock(nn.Module):
  """A block whose matmul output the backward needs (the gelu's input)."""

  @nn.compact
  def __call__(self, x):
    h = nn.Dense(WIDTH)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(h))


def _remat_programs(target: zerojax.GpuTarget) -> dict:
  """{remat: the stage-3 step of `MlpBlock`s compiled for `target`}."""
  return {remat: _compiled(target, model=Net(block=MlpBlock),
                           blocks=zerojax.Blocks(remat=remat))[0]
          for remat in ("dots", "offload", "full")}


@pytest.fixture(scope="module")
def remat_programs():
  return _remat_programs(zerojax.GpuTarget("h100"))


@needs_plugin
def test_offloaded_remat_keeps_the_saved_matmul_outputs_in_host_memory(
    remat_programs):
  """`Blocks(remat="offload")`: the 8-H100 program holds "dots"' saved
  matmul outputs in host memory between the passes (memory space S(5),
  host temporaries), each copied there and back asynchronously."""
  ma = {k: c.memory_analysis() for k, c in remat_programs.items()}
  # the first matmul's output of each block, half of them or more: ROWS x
  # WIDTH in bfloat16 a block
  assert ma["offload"].host_temp_size_in_bytes >= BLOCKS * ROWS * WIDTH
  assert ma["dots"].host_temp_size_in_bytes == 0
  text = remat_programs["offload"].as_text()
  assert "S(5)" in text and "copy-start" in text
  assert "S(5)" not in remat_programs["dots"].as_text()


class DecoderMlpBlock(MlpBlock):
  """The same block under another class name."""


class TwoClasses(nn.Module):
  """Half the blocks `MlpBlock`s, half `DecoderMlpBlock`s."""

  @nn.compact
  def __call__(self, x):
    for i in range(BLOCKS):
      block = MlpBlock if i < BLOCKS // 2 else DecoderMlpBlock
      x = block(name=f"block_{i}")(x)
    return nn.Dense(1)(x)


@needs_plugin
def test_offloaded_remat_of_one_block_class_moves_only_its_activations():
  """`Blocks(remat={"MlpBlock": "offload"})` on the 8-H100 program: host
  temporaries for the named class's blocks only, fewer than with every
  block offloaded."""
  target = zerojax.GpuTarget("h100")
  host = {}
  for name, remat in (("every", "offload"), ("one", {"MlpBlock": "offload"})):
    compiled, _ = _compiled(target, model=TwoClasses(),
                            blocks=zerojax.Blocks(remat=remat))
    host[name] = compiled.memory_analysis().host_temp_size_in_bytes
  assert 0 < host["one"] < host["every"], host
  # half the blocks, each its first matmul's output or more
  assert host["one"] >= BLOCKS // 2 * ROWS * WIDTH, host


@needs_plugin
def test_offloaded_remat_holds_fewer_device_bytes_than_dots_or_full(
    remat_programs):
  """`Blocks(remat="offload")` on the 8-H100 program: each block's copies
  to host run in a loop that the next block's forward waits for, and each
  block's backward waits for the weight gradients of the block after it
  ([Note: activations copied to host in a loop]), so the device holds
  fewer bytes than with the activations saved on it ("dots"), and no more
  than with them recomputed ("full")."""
  temp = {k: c.memory_analysis().temp_size_in_bytes
          for k, c in remat_programs.items()}
  assert temp["offload"] <= temp["dots"] - BLOCKS * ROWS * WIDTH, temp
  assert temp["offload"] <= temp["full"], temp
  text = remat_programs["offload"].as_text()
  assert text.count(" while(") >= BLOCKS, "the copies run in loops"


class MaskedBlock(nn.Module):
  """`MlpBlock` with an integer input, as Hugging Face's blocks take their
  attention mask: its cotangent is a float0."""

  @nn.compact
  def __call__(self, x, keep):
    h = nn.Dense(WIDTH)(nn.LayerNorm()(x))
    return x + nn.Dense(WIDTH)(nn.gelu(h)) * keep[:, None].astype(x.dtype)


class Masked(nn.Module):
  @nn.compact
  def __call__(self, x, keep):
    for i in range(BLOCKS):
      x = MaskedBlock(name=f"block_{i}")(x, keep)
    return nn.Dense(1)(x)


@needs_plugin
def test_offloaded_remat_of_blocks_with_an_integer_input():
  """A block called with an integer array offloads on the 8-H100 program
  too: the ties of its backward skip the integer input's (float0)
  cotangent."""
  target = zerojax.GpuTarget("h100")
  model, mesh = Masked(), target.mesh()
  params = jax.eval_shape(lambda: model.init(
      jax.random.key(0), jnp.zeros((1, WIDTH)),
      jnp.zeros((1,), jnp.int32))["params"])
  tx = optax.adamw(1e-3)
  state = train_state.TrainState(
      step=jax.ShapeDtypeStruct((), jnp.int32), apply_fn=model.apply,
      params=params, tx=tx, opt_state=jax.eval_shape(tx.init, params))

  def loss(p, b):
    return jnp.mean((model.apply({"params": p}, b["x"], b["keep"])
                     - b["y"]) ** 2)
  rows, data = ROWS * target.devices, NamedSharding(mesh, P("data"))
  batch = {"x": jax.ShapeDtypeStruct((rows, WIDTH), jnp.bfloat16,
                                     sharding=data),
           "y": jax.ShapeDtypeStruct((rows, 1), jnp.bfloat16, sharding=data),
           "keep": jax.ShapeDtypeStruct((rows,), jnp.int32, sharding=data)}
  temp = {}
  for remat in ("dots", "offload"):
    zero = zerojax.shard_shape(state, stage=3, mesh=mesh, precision="bf16",
                               blocks=zerojax.Blocks(remat=remat))
    compiled = target.compile(zerojax.train_step(loss).lower(zero, batch))
    temp[remat] = compiled.memory_analysis().temp_size_in_bytes
  assert temp["offload"] <= temp["dots"] - BLOCKS * ROWS * WIDTH, temp


class AttentionBlock(nn.Module):
  """Attention as `jax.nn.dot_product_attention` computes it without a
  fused kernel: the scores' softmax in float32, its probabilities cast to
  bf16 for the value matmul."""
  heads: int = 8

  @nn.compact
  def __call__(self, x):
    b, t, d = x.shape
    qkv = nn.Dense(3 * d)(nn.LayerNorm()(x)).reshape(b, t, 3, self.heads, -1)
    h = jax.nn.dot_product_attention(qkv[:, :, 0], qkv[:, :, 1],
                                     qkv[:, :, 2], is_causal=True,
                                     implementation="xla")
    return x + nn.Dense(d)(h.reshape(b, t, d))


class Attention(nn.Module):
  @nn.compact
  def __call__(self, x):
    for i in range(BLOCKS):
      x = AttentionBlock(name=f"block_{i}")(x)
    return nn.Dense(1)(x)


ATTENTION_ROWS, SEQ, ATTENTION_WIDTH = 4, 1024, 256   # rows per GPU


def _attention_problem(target: zerojax.GpuTarget):
  """(abstract state, loss, batch) of `Attention` for `target`'s GPUs."""
  mesh = target.mesh()
  shape = (ATTENTION_ROWS * target.devices, SEQ, ATTENTION_WIDTH)
  state, loss = _abstract_state(Attention(), (1, SEQ, ATTENTION_WIDTH))
  batch = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16,
                                   sharding=NamedSharding(mesh, P("data")))
           for k, s in (("x", shape), ("y", shape[:2] + (1,)))}
  return state, loss, batch


@needs_plugin
def test_keeping_the_casts_keeps_the_softmax_probabilities_and_is_faster():
  """`Blocks(remat="casts")` on the 8-H100 program: each block's bf16
  probabilities are kept from the forward pass (about their bytes more
  temporaries than "none"), not computed again from the float32 scores in
  the backward pass: a faster modelled step. `"recompute-scores"` keeps
  them and not the float32 scores: fewer bytes than either."""
  target = zerojax.GpuTarget("h100")
  state, loss, batch = _attention_problem(target)
  compiled = {}
  for remat in ("none", "casts", "recompute-scores"):
    zero = zerojax.shard_shape(state, stage=3, mesh=target.mesh(),
                               precision="bf16",
                               blocks=zerojax.Blocks(remat=remat))
    compiled[remat] = target.compile(
        zerojax.train_step(loss).lower(zero, batch))
  temp = {k: c.memory_analysis().temp_size_in_bytes
          for k, c in compiled.items()}
  probabilities = ATTENTION_ROWS * 8 * SEQ * SEQ * 2   # a block's, bf16
  more = temp["casts"] - temp["none"]
  assert 0.75 * BLOCKS * probabilities <= more <= 1.25 * BLOCKS * probabilities, temp
  # the float32 scores of every block but the last, whose backward
  # follows its forward
  fewer = temp["casts"] - temp["recompute-scores"]
  assert 0.99 * (BLOCKS - 1) * 2 * probabilities <= fewer, temp
  assert temp["recompute-scores"] < temp["none"], temp
  time = {k: target.model(c).time for k, c in compiled.items()}
  assert time["casts"] < 0.97 * time["none"], time


@pytest.mark.slow
@needs_plugin
def test_plan_keeps_the_casts_where_they_fit_and_not_where_they_miss():
  """`zerojax.plan` for 8 H100s compiles stage 3 keeping its casts and
  stage 3 recomputing attention's scores beside stage 3 as it is: under a
  budget the casts meet and stages 0-2 miss, they are chosen (the
  fastest); a byte under it, stage 3 as it is; a byte under that, the
  scores recomputed, faster than "dots"."""
  target = zerojax.GpuTarget("h100")
  state, loss, batch = _attention_problem(target)
  roomy = zerojax.plan(state, loss, batch, target=target, precision="bf16")
  by = {c.label: c for c in roomy.candidates}
  casts, plain = by["stage 3, remat=casts"], by["stage 3"]
  assert plain.device_bytes < casts.device_bytes < min(
      by[f"stage {s}"].device_bytes for s in (0, 1, 2)), str(roomy)
  assert casts.modelled_s < plain.modelled_s
  fits = zerojax.plan(state, loss, batch, target=target, precision="bf16",
                      device_budget=casts.device_bytes)
  assert fits.chosen.fields == casts.fields, str(fits)
  assert fits.options["blocks"].remat == "casts"
  tight = zerojax.plan(state, loss, batch, target=target, precision="bf16",
                       device_budget=casts.device_bytes - 1)
  assert tight.chosen.fields == {"stage": 3}, str(tight)
  scores = by["stage 3, remat=recompute-scores"]
  assert scores.device_bytes < plain.device_bytes
  tighter = zerojax.plan(state, loss, batch, target=target, precision="bf16",
                         device_budget=plain.device_bytes - 1)
  assert tighter.chosen.fields == scores.fields, str(tighter)
  dots = next(c for c in tighter.candidates if c.fields.get("remat") == "dots")
  assert scores.modelled_s < dots.modelled_s


def test_gpu_target_refuses_what_it_cannot_compile_for():
  with pytest.raises(ValueError, match="gpu='a42'.*h100"):
    zerojax.GpuTarget("a42")
  with pytest.raises(ValueError, match="hosts=0"):
    zerojax.GpuTarget(hosts=0)
  with pytest.raises(ValueError, match="gpus_per_host=2.5"):
    zerojax.GpuTarget(gpus_per_host=2.5)
  with pytest.raises(ValueError, match="node_link=0"):
    zerojax.GpuTarget(node_link=0)


# ---- the modelled step on a hand-written schedule (no plugin needed) ------
_HLO = """HloModule m, is_scheduled=true, num_partitions=8

%fused (p0: bf16[1024,1024], p1: bf16[1024,1024]) -> bf16[1024,1024] {
  %p0 = bf16[1024,1024]{1,0} parameter(0)
  %p1 = bf16[1024,1024]{1,0} parameter(1)
  ROOT %dot.1 = bf16[1024,1024]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (a: bf16[128,1024], x: bf16[1024,1024]) -> bf16[1024,1024] {
  %a = bf16[128,1024]{1,0} parameter(0)
  %x = bf16[1024,1024]{1,0} parameter(1)
  %ag = (bf16[128,1024]{1,0}, bf16[1024,1024]{1,0}) all-gather-start(%a), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
  %mm = bf16[1024,1024]{1,0} fusion(%x, %x), kind=kCustom, calls=%fused
  %w = bf16[1024,1024]{1,0} all-gather-done(%ag)
  ROOT %mm2 = bf16[1024,1024]{1,0} fusion(%w, %mm), kind=kCustom, calls=%fused
}
"""


def _figures(**changes):
  base = dict(flops_16=1e12, flops_32=5e11, memory_bandwidth=1e12,
              link=1e8, node_link=1e7, pcie=1e9, gpus_per_host=8,
              collective_latency=0.0, kernel_launch=0.0)
  return schedule.Figures(**{**base, **changes})


def test_model_step_hides_a_gather_under_the_matmul_beside_it():
  flops = 2.0 * 1024 ** 3
  gather = 7 / 8 * 1024 * 1024 * 2            # ring wire bytes
  # slow link: the gather outlasts the matmul beside it
  m = schedule.model_step(_HLO, _figures())
  (ag,) = m.collectives
  assert (ag.kind, ag.between, ag.asynchronous) == ("all-gather", 1, True)
  assert m.flops == pytest.approx(2 * flops)
  matmul = flops / 1e12   # compute-bound at these figures
  assert ag.duration == pytest.approx(gather / 1e8)
  assert ag.exposed == pytest.approx(gather / 1e8 - matmul)
  assert m.time == pytest.approx(2 * matmul + ag.exposed)
  # a fast link: hidden whole
  fast = schedule.model_step(_HLO, _figures(link=1e12))
  assert fast.exposed == pytest.approx(0.0)
  assert fast.time == pytest.approx(2 * matmul)
  # the group spans two hosts: the inter-node link
  hosts = schedule.model_step(_HLO, _figures(gpus_per_host=4))
  assert hosts.collectives[0].duration == pytest.approx(gather / 1e7)


# ---- planning for a cluster this machine does not have --------------------
@pytest.mark.slow
@needs_plugin
def test_plan_for_64_gpus_compiles_each_candidate_for_them():
  target = zerojax.GpuTarget("h100", hosts=8)
  state, loss = _abstract_state()
  rows = 8 * target.devices   # few activations: the state decides
  batch = {"x": jax.ShapeDtypeStruct((rows, WIDTH), jnp.bfloat16),
           "y": jax.ShapeDtypeStruct((rows, 1), jnp.bfloat16)}
  plain = zerojax.plan(state, loss, batch, target=target, precision="bf16")
  assert plain.device_budget == target.memory_bytes > 79 * 2 ** 30
  assert {c.fields["stage"] for c in plain.candidates} == {0, 1, 2, 3}
  # several hosts: also ZeRO-3 within each host (HSDP) and ZeRO++'s hpZ,
  # on a mesh of hosts x GPUs whose gathers stay on NVLink; here the
  # fastest, and the plan's options lay the state out on that mesh (not
  # tried where XLA aborts compiling them: jax 0.12)
  by = {c.label: c for c in plain.candidates}
  if not autoconfig._HYBRID_COMPILES:
    assert not any(c.fields.get("replica_axis") for c in plain.candidates)
  else:
    assert by["stage 3, HSDP"].modelled_s < by["stage 3"].modelled_s
    assert (by["stage 3, hpZ"].device_bytes
            < by["stage 3, HSDP"].device_bytes)
    assert plain.chosen is by["stage 3, HSDP"]
    assert plain.options["axes"] == zerojax.Axes(replica="replica")
    assert "over ('replica', 'data')" in str(plain)
    hybrid = target.mesh((8, 8), ("replica", "data"))
    laid_out = zerojax.shard_shape(state, mesh=hybrid, precision="bf16",
                                   **plain.options)
    assert laid_out.config.replica_axis == "replica"
  # a budget only the smallest candidate fits: it is chosen, with the bytes
  # and the modelled step of its program compiled for the 64 GPUs
  least = min(plain.candidates, key=lambda c: c.device_bytes)
  tight = zerojax.plan(state, loss, batch, target=target, precision="bf16",
                       device_budget=least.device_bytes)
  assert tight.chosen.fields == least.fields
  zero = zerojax.shard_shape(state, mesh=target.mesh(), precision="bf16",
                             **least.fields)
  compiled = target.compile(zerojax.train_step(loss).lower(zero, batch))
  assert tight.chosen.device_bytes == zerojax.compiled_footprint(
      compiled)["device"]
  assert tight.chosen.modelled_s == pytest.approx(
      target.model(compiled).time, rel=1e-6)
  assert tight.chosen.flops == pytest.approx(target.model(compiled).flops)
  assert tight.chosen.flops > 0
  assert "8 x 8 H100" in str(tight)


def test_plan_target_refuses_a_mesh_figures_a_sharded_state_and_no_target():
  state, loss = _abstract_state()
  batch = {"x": jax.ShapeDtypeStruct((8, WIDTH), jnp.float32),
           "y": jax.ShapeDtypeStruct((8, 1), jnp.float32)}
  with pytest.raises(TypeError, match="target='h100'.*GpuTarget"):
    zerojax.plan(state, loss, batch, target="h100")
  with pytest.raises(TypeError, match="leave out mesh="):
    zerojax.plan(state, loss, batch, target=zerojax.GpuTarget(),
                 mesh=jax.make_mesh((8,), ("data",)))
  with pytest.raises(TypeError, match="leave out figures=.*node_link"):
    zerojax.plan(state, loss, batch, target=zerojax.GpuTarget(),
                 figures={"link": 1e9})
  with pytest.raises(TypeError, match="not a ZeroTrainState"):
    zerojax.plan(zerojax.shard_shape(state, stage=3), loss, batch,
                 target=zerojax.GpuTarget())


_SCANNED = """HloModule m, is_scheduled=true, num_partitions=1

%fused (p0: f32[24,1024,1024], p1: s32[]) -> f32[1,1024,1024] {
  %p0 = f32[24,1024,1024]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,1024,1024]{2,1,0} dynamic-slice(%p0, %p1, %z, %z), dynamic_slice_sizes={1,1024,1024}
}

ENTRY %main (w: f32[24,1024,1024], i: s32[]) -> f32[1,1024,1024] {
  %w = f32[24,1024,1024]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  ROOT %layer = f32[1,1024,1024]{2,1,0} fusion(%w, %i), kind=kLoop, calls=%fused
}
"""


def test_model_step_reads_one_layer_of_a_stacked_operand():
  """A scanned layer's kernel that slices its stacked operand reads the
  slice, not the stack."""
  m = schedule.model_step(_SCANNED, _figures())
  layer = 1024 * 1024 * 4
  assert m.compute == pytest.approx((2 * layer + 4) / 1e12)
