"""ZeRO++'s quantized collectives (`quantize_weights=`, `quantize_grads=`):
the quantizer's properties, the identity encoding bit-identical to the
plain collectives at every stage, the compiled HLO's operand types and
bytes, non-finite gradients still skipped, and bad modes refused."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training import train_state
from hypothesis import given, settings, strategies as st
from jax.sharding import PartitionSpec as P

import zerojax
from zerojax._plan.hlo import count_collectives
from models import zopts, assert_same_numbers, make_problem
from zerojax._comm import quantize
from zerojax._comm.quantize import Quantization

LEVELS = {"int8": 127, "int4": 7}
TX = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))


def _roundtrip(x, mode, block):
  q = Quantization(mode, block)
  values, absmax = quantize.encode(jnp.asarray(x), q)
  return (np.asarray(quantize.decode(values, absmax, x.shape[-1], q,
                                     jnp.float32)),
          np.asarray(absmax), values)


floats = st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32,
                   allow_subnormal=False)   # denormals: below


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(values=st.lists(floats, min_size=1, max_size=70),
       mode=st.sampled_from(["int8", "int4"]),
       block=st.sampled_from([1, 3, 8, 16]))
def test_error_is_at_most_half_a_step(values, mode, block):
  x = np.asarray(values, np.float32)
  out, absmax, _ = _roundtrip(x, mode, block)
  step = np.repeat(absmax, block)[:x.size] / LEVELS[mode]
  # half a step, plus float32 rounding of the arithmetic
  assert np.all(np.abs(out - x) <= step / 2 * (1 + 1e-5) + 1e-6 * np.abs(x))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(ints=st.lists(st.integers(-7, 7), min_size=1, max_size=40),
       absmax=st.floats(1e-3, 1e3, allow_subnormal=False),
       mode=st.sampled_from(["int8", "int4"]))
def test_values_on_the_grid_come_back_exactly(ints, absmax, mode):
  """A block the dequantizer produced (integers on the grid times the
  block's step) is quantized back to itself, bit for bit."""
  q = Quantization(mode, len(ints) + 1)
  level = LEVELS[mode]
  grid = jnp.asarray([level] + ints, jnp.int8)     # its absmax comes first
  if mode == "int4":
    grid = jnp.concatenate([grid, jnp.zeros(grid.size % 2, jnp.int8)])
    q = Quantization(mode, grid.size)
    grid = quantize.pack_int4(grid)
  x = np.asarray(quantize.decode(grid, jnp.asarray([absmax], jnp.float32),
                                 q.block, q, jnp.float32))
  np.testing.assert_array_equal(_roundtrip(x, mode, q.block)[0], x)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_zeros_constants_and_denormals(mode):
  zeros = np.zeros(10, np.float32)
  np.testing.assert_array_equal(_roundtrip(zeros, mode, 4)[0], zeros)
  const = np.full(12, -3.25, np.float32)
  np.testing.assert_array_equal(_roundtrip(const, mode, 4)[0], const)
  tiny = np.array([1e-40, -3e-41, 0, 7e-42], np.float32)   # denormals
  out = _roundtrip(tiny, mode, 4)[0]
  # finite, and no worse than flushing them to zero (XLA flushes denormals)
  assert np.all(np.isfinite(out)) and np.all(np.abs(out - tiny) <= np.abs(tiny))


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(ints=st.lists(st.integers(-8, 7), min_size=1, max_size=16).map(
    lambda v: v + v[:len(v) % 2]))
def test_int4_packs_two_values_a_byte(ints):
  values = jnp.asarray(ints, jnp.int8)
  packed = quantize.pack_int4(values)
  assert packed.dtype == jnp.uint8 and packed.size == values.size // 2
  np.testing.assert_array_equal(quantize.unpack_int4(packed), values)
  x = np.linspace(-1, 1, 2 * len(ints) + 1, dtype=np.float32)   # odd: padded
  encoded, _ = quantize.encode(jnp.asarray(x), Quantization("int4", 5))
  assert encoded.dtype == jnp.uint8 and encoded.size == -(-x.size // 10) * 5


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_stays_non_finite(mode, bad):
  x = np.array([1.0, 2.0, bad, 4.0, 5.0, 6.0, 7.0, 8.0], np.float32)
  out = _roundtrip(x, mode, 4)[0]
  assert not np.all(np.isfinite(out[:4]))          # the block holding it
  np.testing.assert_allclose(out[4:], x[4:], rtol=0.1)   # the other block


@pytest.mark.slow
def test_collectives_match_plain_ones_within_the_bound():
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(8, 2, 8 * 100)).astype(np.float32))
  per_device = lambda f: jax.jit(jax.shard_map(
      lambda s: f(s[0])[None], mesh=mesh, in_specs=P("data"),
      out_specs=P("data"), check_vma=False))
  plain_sum = per_device(lambda s: jax.lax.psum_scatter(
      s, "data", scatter_dimension=1, tiled=True))(x)
  plain_gather = per_device(lambda s: jax.lax.all_gather(
      s, "data", axis=1, tiled=True))(x)
  odd = 797   # not a multiple of the devices: all_reduce pads
  plain_total = per_device(lambda s: jax.lax.psum(s[..., :odd], "data"))(x)
  for mode in ("identity", "int8", "int4"):
    q = Quantization(mode, 32)
    summed = per_device(lambda s: quantize.reduce_scatter(
        s, "data", q, jnp.float32))(x)
    gathered = per_device(lambda s: quantize.all_gather(s, "data", q))(x)
    total = per_device(lambda s: quantize.all_reduce(s[..., :odd], "data",
                                                     q))(x)
    assert total.shape == plain_total.shape
    if mode == "identity":
      np.testing.assert_array_equal(summed, plain_sum)
      np.testing.assert_array_equal(gathered, plain_gather)
      np.testing.assert_array_equal(total, plain_total)
    else:
      # 8 slices, each within half a step of its block's absmax
      bound = 8 * float(jnp.max(jnp.abs(x))) / LEVELS[mode] / 2
      assert float(jnp.max(jnp.abs(summed - plain_sum))) <= bound * 1.001
      assert float(jnp.max(jnp.abs(gathered - plain_gather))) <= bound / 8 * 1.001
      # the sum's error, then half a step of the sum's own block
      assert float(jnp.max(jnp.abs(total - plain_total))) <= 2 * bound * 1.001
    # every device decoded the same bytes
    for d in range(1, 8):
      np.testing.assert_array_equal(total[d], total[0])


@functools.lru_cache(maxsize=None)
def _problem():
  return make_problem("transformer", steps=3)


def _run(stage, mesh=None, **fields):
  model, params, loss_fn, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=stage, mesh=mesh,
      accum_steps=2, **zopts(fields))
  step = zerojax.train_step(loss_fn)
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  return np.array(losses), zerojax.gather_params(state), state


@pytest.mark.slow
@pytest.mark.parametrize("stage,compute_dtype,setting", [
    (0, "float32", None), (1, "bfloat16", None), (2, "float32", None),
    (3, "float32", None), (2, "bfloat16", "hsdp"), (3, "bfloat16", "hpz"),
    (3, "float32", "offload")])
def test_identity_encoding_is_bit_identical(stage, compute_dtype, setting):
  """The quantized path with an exact encoding gives the plain
  collectives' results bit for bit (losses and parameters:
  `assert_same_numbers`, so within float32 rounding under the tests' older
  emitters, which fuse the two programs differently on some CPUs: an ulp
  of the third loss with offload on an AMD EPYC with AVX-512);
  on hpZ (both hops) the losses bit for bit and the parameters to float32
  rounding (an ulp of a gradient, through the update): the identity
  gradient path sums the replica hop in another order than XLA's CPU
  reduce-scatter does there (its weight gathers alone are bit-identical)."""
  fields = dict(compute_dtype=compute_dtype)
  mesh, hybrid = None, setting == "hpz"
  if setting == "offload":
    fields.update(offload_params=True, offload_optimizer=True)
  if setting in ("hsdp", "hpz"):
    mesh = _hybrid_mesh()
    fields.update(replica_axis="replica", hpz=hybrid)
  plain = _run(stage, mesh, **fields)
  ident = _run(stage, mesh, quantize_weights="identity",
               quantize_grads="identity", quantize_block=64, **fields)
  (np.testing.assert_array_equal if hybrid else assert_same_numbers)(
      plain[0], ident[0])
  same = (functools.partial(np.testing.assert_allclose, rtol=1e-6, atol=1e-8)
          if hybrid else assert_same_numbers)
  jax.tree_util.tree_map(same, plain[1], ident[1])
  # nothing quantized is stored
  assert {x.dtype for x in ident[2].master} == {np.dtype(np.float32)}
  quantized = _run(stage, mesh, quantize_weights="int8",
                   quantize_grads="int4", quantize_block=64, **fields)
  np.testing.assert_allclose(quantized[0], plain[0], rtol=2e-2)


def _hybrid_mesh():
  return jax.make_mesh((2, 4), ("replica", "data"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2)


def _bytes(compiled, kind):
  ops = [op for op in count_collectives(compiled).ops
         if op.kind == kind and op.group_size > 1 and op.bytes > 16]
  return sum(op.bytes * op.trips for op in ops), {d for op in ops
                                                  for d in op.dtypes}


@pytest.mark.slow
def test_hlo_sends_int8_and_int4_with_the_stated_bytes():
  """Stage 3, bf16 compute, 8 devices, every chunk gathered once: the
  gathers carry s8, (1 + 4/B) bytes an element (padded to whole blocks)
  against bf16's 2; the gradients go by all-to-all of s8 at (1 + 4/B)
  against the fp32 reduce-scatter's 4, or u8 (int4) at (1/2 + 4/B)."""
  model, params, loss_fn, batches = _problem()
  block = 74
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
      precision="bfloat16", quantize=zerojax.Quantize(block=block), blocks=zerojax.Blocks(reshard_after_forward=False))
  lengths = [c.length for c in state.layout.chunks]
  padded = sum(8 * -(-n // 8 // block) * block for n in lengths)
  # memory_report names the chunks padded on the wire, and by how much
  assert "quantized wire" not in str(zerojax.memory_report(state))
  wire = zerojax.memory_report(state.replace(config=state.config.replace(
      quantize_grads="int8"))).wire
  assert wire["padded_chunks"] == [c for c, n in enumerate(lengths)
                                   if n // 8 % block]
  assert wire["padding"] == pytest.approx(padded / sum(lengths) - 1)

  def compiled(**fields):
    return zerojax.train_step(loss_fn).lower(
        state.replace(config=state.config.replace(**fields)),
        batches[0]).compile()

  plain = compiled()
  # XLA's CPU backend gathers bf16 as f32 (a GPU sends 2 bytes an element)
  assert _bytes(plain, "all-gather")[0] in (2 * sum(lengths), 4 * sum(lengths))
  assert _bytes(plain, "reduce-scatter")[0] == 4 * sum(lengths)
  q8 = compiled(quantize_weights="int8", quantize_grads="int8")
  q4 = compiled(quantize_grads="int4")
  for program, kind, dtype, per_element in (
      (q8, "all-gather", "s8", 1 + 4 / block),
      (q8, "all-to-all", "s8", 1 + 4 / block),
      (q4, "all-to-all", "u8", 0.5 + 4 / block)):
    got, dtypes = _bytes(program, kind)
    assert dtype in dtypes, (kind, dtypes)
    assert abs(got / (padded * per_element) - 1) <= 0.05, (kind, got)
  assert _bytes(q8, "reduce-scatter")[0] == 0
  # against bf16 / fp32 collectives: about 1/2, 1/4 and 1/8
  assert _bytes(q8, "all-gather")[0] / (2 * sum(lengths)) < 0.56
  assert _bytes(q8, "all-to-all")[0] / (4 * sum(lengths)) < 0.28
  assert _bytes(q4, "all-to-all")[0] / (4 * sum(lengths)) < 0.155


@pytest.mark.slow
@pytest.mark.parametrize("stage", [0, 3])
def test_hsdp_replica_all_reduce_goes_quantized(stage):
  """HSDP on (replica 2, data 4) with int8 gradients: the per-step replica
  reduction is an all-to-all and an all-gather of s8 within groups of 2,
  and no all-reduce larger than a scalar is left. The data axis's
  reduction (stage 3's reduce-scatters, stage 0's all-reduce) is an s8
  all-to-all within groups of 4; only stage 0 gathers s8 there."""
  model, params, loss_fn, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=stage,
      mesh=_hybrid_mesh(), axes=zerojax.Axes(replica="replica"), quantize=zerojax.Quantize(grads="int8", block=64))
  ops = count_collectives(zerojax.train_step(loss_fn).lower(
      state, batches[0]).compile()).ops
  big = [op for op in ops if op.bytes > 16 and op.group_size > 1]
  # scalars only (the loss, a gradient-norm piece per chunk)
  assert not [op for op in big if op.kind == "all-reduce"
              and op.bytes > 4 * (len(state.layout.chunks) + 1)]
  for kind, expected in (("all-to-all", {2, 4}),
                         ("all-gather", {2, 4} if stage == 0 else {2})):
    groups = {op.group_size for op in big if op.kind == kind and
              "s8" in op.dtypes}
    assert groups == expected, (kind, groups)


@pytest.mark.slow
def test_a_non_finite_gradient_still_skips_the_step():
  model, params, loss_fn, batches = _problem()
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=TX), stage=3,
      precision=zerojax.Precision(skip_nonfinite=True), quantize=zerojax.Quantize(weights="int8", grads="int4", block=64))
  before = jax.tree_util.tree_map(np.asarray, zerojax.gather_params(state))

  def poisoned(p, b):     # an inf in the gradient of one leaf
    return loss_fn(p, b) + jnp.sum(p["pos"]) * jnp.inf
  state, metrics = zerojax.train_step(poisoned)(state, batches[0])
  assert bool(metrics["skipped"])
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(state), before)


@pytest.mark.parametrize("options,error,message", [
    (lambda: dict(quantize=zerojax.Quantize(weights="fp8")), ValueError,
     r"Quantize\(weights='fp8'\) is not a quantization mode"),
    (lambda: dict(quantize="int2"), ValueError,
     r"Quantize\(weights='int2'\) is not a quantization mode"),
    (lambda: dict(quantize=zerojax.Quantize(grads="int8", block=0)),
     ValueError, "Quantize.block=0 must be positive"),
    (lambda: dict(quantize=zerojax.Quantize(block=2.5)), TypeError,
     "Quantize.block=2.5 must be an int"),
    (lambda: dict(quantize=8), TypeError, "quantize=8: use None, a mode"),
])
def test_bad_quantization_is_refused(options, error, message):
  with pytest.raises(error, match=message):
    zerojax.ZeroConfig(**options())


@pytest.mark.parametrize("field", ["quantize_weights", "quantize_grads"])
def test_no_block_spans_two_leaves(field):
  """Quantized blocks start at leaf boundaries (`state.align`): a 1e30
  weight in one leaf leaves a neighbour's quantized values exactly as they
  are without it (the loss, read through int8 gathers, and the gradient,
  through int8 reduce-scatters, bit for bit), where a block holding both
  would take the neighbour's values to 0."""
  rng = np.random.default_rng(0)
  a = rng.normal(size=(8, 20)).astype(np.float32)   # 160: not whole blocks
  x = rng.normal(size=(16, 8)).astype(np.float32)
  # the loss reads "a" only; "b" rides in the same chunk
  loss_fn = lambda p, b: jnp.mean((b @ p["a"]) ** 2)
  runs = []
  for outlier in (0.0, 1e30):
    b = np.zeros((300,), np.float32)
    b[0] = outlier
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=None, params={"a": a, "b": b}, tx=optax.sgd(0.1)), stage=3,
                          **zopts({field: "int8", "quantize_block": 64}))
    leaves = state.layout.leaves
    assert leaves[0].chunk == leaves[1].chunk
    assert {info.offset % 64 for info in leaves} == {0}
    state, metrics = zerojax.train_step(loss_fn)(state, x)
    runs.append((metrics["loss"], zerojax.gather_params(state)["a"]))
  np.testing.assert_array_equal(runs[0][0], runs[1][0])
  np.testing.assert_array_equal(runs[0][1], runs[1][1])
  plain = zerojax.shard(train_state.TrainState.create(
      apply_fn=None, params={"a": a, "b": b}, tx=optax.sgd(0.1)), stage=3)
  assert plain.layout.leaves[1].offset == 160   # back to back unquantized
