"""Flax NNX models through the NNX front end (`zerojax._model.frontend`): the same
one-line adoption, checked against a plain `nnx.Optimizer` loop on one
device, a data-parallel BatchNorm reference, per-device dropout, evaluation
and the errors."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import zerojax
from footprints import create_footprint
from models import zopts
from models import (NnxBlock, NnxResidualBlock, NnxTransformer, TOLERANCE,
                    assert_blocks_bounded, nnx_listed, nnx_problem,
                    nnx_reference_run, nnx_scanned)

# SGD with momentum, as the linen comparisons use: Adam turns the float
# noise of a near-zero gradient element (attention key kernels) into an
# lr-sized move that depends on the summation order
TX = optax.chain(optax.add_decayed_weights(0.1), optax.sgd(0.1, momentum=0.9))


def _params(model):
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _trained(step, state, batches):
  """`(state, losses)` after one step on each batch."""
  losses = []
  for b in batches:
    state, metrics = step(state, b)
    losses.append(float(metrics["loss"]))
  return state, losses


def _close(a, b, compute_dtype):
  jax.tree_util.tree_map(
      lambda x, y: np.testing.assert_allclose(x, y, **TOLERANCE[compute_dtype][1]),
      a, b)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["mlp", "transformer"])
@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_nnx_matches_a_plain_nnx_optimizer_loop(kind, compute_dtype):
  make, loss_fn, batches = nnx_problem(kind)
  ref_losses, ref_model = nnx_reference_run(make, loss_fn, TX, batches,
                                            jnp.dtype(compute_dtype))
  step = zerojax.train_step(loss_fn)
  for stage in (0, 1, 2, 3):
    model = make()
    before = _params(model)
    state = zerojax.shard(model, stage=stage, tx=TX, precision=compute_dtype)
    state, losses = _trained(step, state, batches)
    np.testing.assert_allclose(losses, ref_losses, **TOLERANCE[compute_dtype][0])
    trained = zerojax.gather_model(state)
    assert type(trained) is type(model)
    _close(_params(trained), _params(ref_model), compute_dtype)
    # the user's model is left as it was
    jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model), before)


def test_nnx_optimizer_state_and_step_count_are_kept():
  make, loss_fn, batches = nnx_problem("mlp")
  ref_losses, ref_model = nnx_reference_run(make, loss_fn, TX, batches)
  # two plain steps, then zerojax takes over the model and its optimizer
  model = make()
  optimizer = nnx.Optimizer(model, TX, wrt=nnx.Param)

  @nnx.jit
  def plain_step(model, optimizer, b):
    grads = nnx.grad(loss_fn)(model, b)
    optimizer.update(model, grads)

  for b in batches[:2]:
    plain_step(model, optimizer, b)
  state = zerojax.shard(model, optimizer=optimizer, stage=3)
  assert int(state.step) == 2
  step = zerojax.train_step(loss_fn)
  for b in batches[2:]:
    state, metrics = step(state, b)
  np.testing.assert_allclose(float(metrics["loss"]), ref_losses[-1], rtol=1e-5)
  _close(_params(zerojax.gather_model(state)), _params(ref_model), "float32")
  assert int(state.step) == len(batches)


class BatchNormNet(nnx.Module):
  def __init__(self, rngs):
    self.hidden = nnx.Linear(8, 16, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
    self.out = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    return self.out(nnx.relu(self.norm(self.hidden(x))))


def _bn_problem():
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 8)).astype(np.float32),
              "y": rng.normal(size=(32, 4)).astype(np.float32)}
             for _ in range(5)]

  def loss_fn(model, b):
    return jnp.mean((model(b["x"]) - b["y"]) ** 2)
  return (lambda: BatchNormNet(nnx.Rngs(0))), loss_fn, batches


def _bn_reference(make, loss_fn, batches):
  """Data parallel, written out: per device the loss on its slice, gradients
  and batch statistics averaged over devices."""
  mesh = jax.make_mesh((8,), ("data",),
                       axis_types=(jax.sharding.AxisType.Auto,))
  graph, params, rest = nnx.split(make(), nnx.Param, ...)

  def local(params, rest, b):
    def loss(params):
      # fresh Variables in this trace (NNX refuses to mutate outer ones)
      model = nnx.merge(graph, params, jax.tree_util.tree_map(lambda x: x, rest))
      out = loss_fn(model, b)
      return out, nnx.split(model, nnx.Param, ...)[2]
    grads, new_rest = jax.grad(loss, has_aux=True)(params)
    return jax.lax.pmean(grads, "data"), jax.lax.pmean(new_rest, "data")

  @jax.jit
  def step(params, opt_state, rest, b):
    grads, rest = jax.shard_map(local, mesh=mesh, in_specs=(P(), P(), P("data")),
                                out_specs=(P(), P()), check_vma=False)(
                                    params, rest, b)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, rest

  opt_state = TX.init(params)
  for b in batches:
    params, opt_state, rest = step(params, opt_state, rest, b)
  return nnx.merge(graph, params, rest)


@pytest.mark.slow
def test_nnx_batch_norm_statistics_match_data_parallel():
  make, loss_fn, batches = _bn_problem()
  ref = _bn_reference(make, loss_fn, batches)
  step = zerojax.train_step(loss_fn)
  for stage in (0, 3):
    state = zerojax.shard(make(), stage=stage, tx=TX)
    for b in batches:
      state, _ = step(state, b)
    trained = zerojax.gather_model(state)
    _close(_params(trained), _params(ref), "float32")
    _close(nnx.to_pure_dict(nnx.state(trained, nnx.BatchStat)),
           nnx.to_pure_dict(nnx.state(ref, nnx.BatchStat)), "float32")
    assert not np.allclose(trained.norm.mean[...], make().norm.mean[...])


class DropoutNet(nnx.Module):
  def __init__(self, rngs):
    self.out = nnx.Linear(8, 8, rngs=rngs)
    self.drop = nnx.Dropout(0.5, rngs=rngs)

  def __call__(self, x):
    return self.out(x), self.drop(jnp.ones_like(x))


def test_nnx_dropout_draws_per_device_and_per_step():
  def loss_fn(model, b):
    out, mask = model(b["x"])
    return jnp.mean(out ** 2), {"mask": mask}

  state = zerojax.shard(DropoutNet(nnx.Rngs(0, dropout=1)), stage=3, tx=TX)
  step = zerojax.train_step(loss_fn, has_aux=True)
  batch = {"x": np.ones((16, 8), np.float32)}
  state, first = step(state, batch)
  state, second = step(state, batch)
  masks = np.asarray(first["mask"]).reshape(8, 2 * 8)   # per device
  assert len({row.tobytes() for row in masks}) == 8
  assert not np.array_equal(first["mask"], second["mask"])
  # the stored key is the model's own, unfolded; the count moved on
  assert int(state.nnx_state["drop"]["rngs"]["count"]) == 2


@pytest.mark.slow
def test_nnx_eval_step_equals_the_gathered_model():
  make, loss_fn, batches = nnx_problem("transformer")
  state = zerojax.shard(make(), stage=3, tx=TX)
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  evaluate = zerojax.eval_step(
      lambda model, b: {"logits": model(b["tokens"]), "loss": loss_fn(model, b)})
  out = evaluate(state, batches[1])
  trained = zerojax.gather_model(state)
  plain = trained(batches[1]["tokens"])
  # the same arithmetic on a 4-row slice instead of 32 rows: XLA's CPU dots
  # may block differently, so a few logits differ in the last float32 bits
  # of the logits' scale (about 2)
  np.testing.assert_allclose(out["logits"], plain, rtol=1e-5,
                             atol=1e-6 * float(np.abs(plain).max()))
  np.testing.assert_allclose(out["loss"], loss_fn(trained, batches[1]), rtol=1e-5)


def test_nnx_bad_input():
  make, loss_fn, _ = nnx_problem("mlp")
  model = make()
  with pytest.raises(TypeError, match="needs tx="):
    zerojax.shard(model, stage=3)
  with pytest.raises(TypeError, match="does not hold its model"):
    zerojax.shard(nnx.Optimizer(model, TX, wrt=nnx.Param), stage=3)
  with pytest.raises(TypeError, match="nnx.Module"):
    zerojax.shard(nnx.Rngs(0), stage=3)
  with pytest.raises(ValueError, match="wrt=nnx.Param"):
    zerojax.shard(model, optimizer=nnx.Optimizer(model, TX, wrt=nnx.Variable))
  with pytest.raises(ValueError, match="no submodule is named 'nothere'"):
    zerojax.shard(model, tx=TX, stage=3, blocks=zerojax.Blocks(per_use=("nothere",)))
  with pytest.raises(TypeError, match="carries its own tx"):
    zerojax.shard(train_state.TrainState.create(
        apply_fn=None, params={"w": jnp.ones(3)}, tx=TX), tx=TX)
  linen = zerojax.shard(train_state.TrainState.create(
      apply_fn=None, params={"w": jnp.ones(8)}, tx=TX))
  with pytest.raises(TypeError, match="use zerojax.gather_params"):
    zerojax.gather_model(linen)
  # the model was not changed by any of these
  jax.tree_util.tree_map(np.testing.assert_array_equal, _params(model),
                         _params(make()))


def test_nnx_checkpoint_restores_on_another_stage_and_device_count(tmp_path):
  make, loss_fn, batches = nnx_problem("mlp")
  ref_losses, ref_model = nnx_reference_run(make, loss_fn, TX, batches)
  step = zerojax.train_step(loss_fn)
  state = zerojax.shard(make(), stage=3, tx=TX)
  for b in batches[:3]:
    state, _ = step(state, b)
  zerojax.checkpoint.save(tmp_path, state)
  zerojax.checkpoint.wait(tmp_path)
  exported = zerojax.checkpoint.export_params(tmp_path)
  _close(exported, _params(zerojax.gather_model(state)), "float32")
  # a fresh model of the same structure, another stage, 4 devices
  mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Auto,))
  restored = zerojax.checkpoint.restore(tmp_path, like=make(), tx=TX, stage=1,
                                        mesh=mesh)
  for b in batches[3:]:
    restored, metrics = step(restored, b)
  np.testing.assert_allclose(float(metrics["loss"]), ref_losses[-1], rtol=1e-5)
  _close(_params(zerojax.gather_model(restored)), _params(ref_model), "float32")


def _nnx_lm(rng):
  return NnxTransformer(nnx.Rngs(rng), vocab=512, width=128, layers=4, seq=8)


@pytest.mark.slow
def test_nnx_create_equals_shard_of_the_built_model():
  for stage, dtype in [(3, "float32"), (2, "bfloat16")]:
    made = zerojax.create(_nnx_lm, jax.random.key(7), tx=TX, stage=stage,
                          precision=dtype)
    # built by one jitted program, as create's programs build it (eager
    # op-by-op init may round a product differently from the fused one)
    plain = zerojax.shard(nnx.jit(_nnx_lm)(jax.random.key(7)), tx=TX,
                          stage=stage, precision=dtype)
    assert made.frontend == plain.frontend
    for a, b in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(plain)):
      assert a.sharding == b.sharding
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  # and it trains: the step sees a module
  made, metrics = zerojax.train_step(
      lambda m, b: m(b["tokens"]).mean() ** 2)(made, {"tokens": np.zeros((8, 8), np.int32)})
  assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
def test_nnx_create_never_holds_the_whole_model():
  fp = create_footprint(_nnx_lm, jax.random.key(0), tx=TX,
                                             stage=3)
  params = jax.eval_shape(lambda r: nnx.to_pure_dict(
      nnx.state(_nnx_lm(r), nnx.Param)), jax.random.key(0))
  leaves = jax.tree_util.tree_leaves(params)
  psi = sum(x.size for x in leaves)
  # momentum SGD: 8 bytes a parameter, sharded; one leaf gathered at a time
  bound = 1.25 * 8 * psi / 8 + 4 * max(x.size for x in leaves)
  assert 4 * psi > bound      # the whole fp32 model would not fit it
  assert fp["peak"] <= bound


def _scanned_problem(layerwise, layers=4, width=32):
  block = zerojax.nn.layerwise(NnxResidualBlock) if layerwise else NnxResidualBlock
  net = nnx_scanned(block, layers, width)
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, width)).astype(np.float32),
              "y": rng.normal(size=(32, 4)).astype(np.float32)} for _ in range(4)]
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  return (lambda: net(nnx.Rngs(0))), loss_fn, batches


@pytest.mark.slow
@pytest.mark.parametrize("stage,mode,offload", [
    (3, "per layer", {}),
    # each layer's shards come from host memory (they once met the
    # device's values in one op and failed)
    (3, "per layer", {"offload_params": True, "offload_optimizer": True}),
    (2, "replicated, gradient reduced per layer", {})],
    ids=["stage3", "stage3-offload", "stage2"])
def test_nnx_scanned_stack_gathered_per_layer_matches_plain_nnx(stage, mode,
                                                                 offload):
  make, loss_fn, batches = _scanned_problem(layerwise=True)
  ref_losses, ref_model = nnx_reference_run(make, loss_fn, TX, batches)
  state = zerojax.shard(make(), stage=stage, tx=TX,
                        **zopts({"stacked": ("blocks",), **offload}))
  step = zerojax.train_step(loss_fn)
  assert step.gathering(state, batches[0])["blocks"] == mode
  state, losses = _trained(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  _close(_params(zerojax.gather_model(state)), _params(ref_model), "float32")
  # asked again after the step has run (its trace is cached by then)
  assert step.gathering(state, batches[0])["blocks"] == mode


def _scanned_footprint(layers, width=256):
  _, loss_fn, _ = _scanned_problem(True, layers, width)
  net = nnx_scanned(zerojax.nn.layerwise(NnxResidualBlock), layers, width)
  state = zerojax.create(lambda r: net(nnx.Rngs(r)), jax.random.key(0),
                         tx=optax.adam(1e-3), stage=3, blocks=zerojax.Blocks(stacked=("blocks",)))
  batch = {"x": np.zeros((64, width), np.float32), "y": np.zeros((64, 4), np.float32)}
  compiled = zerojax.train_step(loss_fn).lower(state, batch).compile()
  per_layer = sum(c.used for c in state.layout.chunks if c.layers)
  return zerojax.compiled_footprint(compiled)["footprint"], per_layer


@pytest.mark.slow
def test_nnx_scanned_stage3_footprint_does_not_grow_with_gathered_layers():
  width = 256
  (fp4, per_layer), (fp16, _) = (_scanned_footprint(n, width) for n in (4, 16))
  per_layer_state = 12 * per_layer / 8           # Adam, sharded, persistent
  per_layer_grads = 4 * per_layer / 8            # the gradient shard
  per_layer_acts = 4 * 8 * width                 # the saved layer input
  growth = fp16 - fp4
  assert growth <= 1.1 * 12 * (per_layer_state + per_layer_grads + per_layer_acts)
  # the 12 more gathered layers alone would add 12 x 4 x per_layer bytes
  assert growth < 12 * 4 * per_layer


def test_nnx_shard_shape_is_what_shard_gives():
  """`shard_shape` takes an NNX model (abstract, from `nnx.eval_shape`) as
  `shard` takes a built one."""
  make, _, _ = nnx_problem("transformer")
  shapes = zerojax.shard_shape(nnx.eval_shape(make), tx=TX, stage=3)
  state = zerojax.shard(make(), tx=TX, stage=3)
  assert shapes.layout == state.layout
  got, want = (jax.tree_util.tree_leaves(x) for x in (shapes, state))
  assert [(x.shape, x.dtype, x.sharding) for x in got] == [
      (x.shape, x.dtype, x.sharding) for x in want]


@pytest.mark.slow
@pytest.mark.parametrize("options", [
    {"prefetch": True},
    # each block's shards come over from host memory at its call
    {"offload_params": True, "offload_optimizer": True}],
    ids=["prefetch", "offload"])
def test_nnx_listed_blocks_gathered_per_block_match_plain_nnx(options):
  """Blocks in an `nnx.List`, called in a loop, with the one line: each is
  gathered at its call (and again in the backward), exactly. (Without
  options: `test_nnx_per_use_tied_embedding_is_gathered_at_each_use`.)"""
  _, loss_fn, batches = nnx_problem("transformer")
  ref_losses, ref_params = _listed_reference()
  state = zerojax.shard(_listed_transformer(), stage=3, tx=TX, accum_steps=2,
                        **zopts(options))
  step = zerojax.train_step(loss_fn)
  modes = step.gathering(state, batches[0])
  assert [modes[f"blocks/{i}"] for i in range(3)] == ["per block"] * 3
  state, losses = _trained(step, state, batches)
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  _close(_params(zerojax.gather_model(state)), ref_params, "float32")


def _listed_transformer():
  return NnxTransformer(nnx.Rngs(0), layers=3,
                        block=zerojax.nn.layerwise(NnxBlock))


@functools.lru_cache(maxsize=None)
def _listed_reference():
  """`(losses, parameters)` of a plain `nnx.Optimizer` loop on one device
  (the wrapped blocks are plain blocks outside a step)."""
  _, loss_fn, batches = nnx_problem("transformer")
  losses, model = nnx_reference_run(_listed_transformer, loss_fn, TX, batches)
  return losses, _params(model)


@functools.lru_cache(maxsize=None)
def _listed_step(layers, wrap, width=256):
  """The compiled stage-3 step of `layers` listed residual blocks, and its
  state; unwrapped, held for the step (`reshard_after_forward=False`)."""
  block = zerojax.nn.layerwise(NnxResidualBlock) if wrap else NnxResidualBlock
  net = nnx_listed(block, layers, width)
  state = zerojax.shard_shape(nnx.eval_shape(lambda: net(nnx.Rngs(0))),
                              tx=optax.adam(1e-3), stage=3,
                              blocks=zerojax.Blocks(reshard_after_forward=wrap))
  batch = {"x": np.zeros((64, width), np.float32),
           "y": np.zeros((64, 4), np.float32)}
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  return zerojax.train_step(loss_fn).lower(state, batch).compile(), state


@pytest.mark.slow
def test_nnx_listed_stage3_footprint_is_bounded_and_regathers_distinct():
  (c4, s4), (c16, _) = (_listed_step(n, True, 256) for n in (4, 16))
  assert_blocks_bounded(c4, c16, s4, "blocks/0", 256)
  # each block gathered at its call and re-gathered in the backward (not
  # merged with the forward gather), the head's chunk once
  hlo = c4.as_text()
  assert hlo.count("all-gather-start(") + hlo.count(" all-gather(") == 2 * 4 + 1
  # unwrapped, every block is held for the step
  held = _listed_step(4, False, 256)[0].memory_analysis().temp_size_in_bytes
  assert c4.memory_analysis().temp_size_in_bytes < held


@pytest.mark.slow
def test_nnx_per_use_tied_embedding_is_gathered_at_each_use():
  """`per_use=("embed",)` with `nnx.Embed` wrapped: the table is gathered
  at the lookup and again at the tied head (`attend`, a method other than
  `__call__`), and re-gathered for the head's backward; exact, with the
  listed blocks gathered per block too."""
  _, loss_fn, batches = nnx_problem("transformer")
  block = zerojax.nn.layerwise(NnxBlock)

  def make(embed):
    return NnxTransformer(nnx.Rngs(0), layers=2, block=block, embed=embed)

  ref_losses, ref_model = nnx_reference_run(lambda: make(nnx.Embed), loss_fn,
                                            TX, batches)
  gathers = {}
  for wrap in (False, True):
    embed = zerojax.nn.layerwise(nnx.Embed) if wrap else nnx.Embed
    state = zerojax.shard(make(embed), stage=3, tx=TX, blocks=zerojax.Blocks(per_use=("embed",), reshard_after_forward=wrap))
    step = zerojax.train_step(loss_fn)
    assert step.gathering(state, batches[0])["embed"] == (
        "per block" if wrap else "whole step")
    hlo = step.lower(state, batches[0]).compile().as_text()
    gathers[wrap] = hlo.count("all-gather-start(") + hlo.count(" all-gather(")
  assert step.gathering(state, batches[0])["blocks/1"] == "per block"
  state, losses = _trained(step, state, batches)   # the wrapped one
  np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
  _close(_params(zerojax.gather_model(state)), _params(ref_model), "float32")
  # held: one gather of the table; per use: the lookup's, the head's, and
  # the head's re-gather (the lookup's backward reads no table values)
  assert gathers[True] == gathers[False] + 2


class FlagDropBlock(nnx.Module):
  """A block called with a Python flag and an array keyword, and drawing
  dropout, as NNX blocks often are."""

  def __init__(self, rngs, width=16):
    self.up = nnx.Linear(width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.25, rngs=rngs)

  def __call__(self, x, train=True, scale=None):
    y = self.drop(nnx.gelu(self.up(x)), deterministic=not train)
    return x + (y if scale is None else scale * y)


class FlagDropNet(nnx.Module):
  """Two `FlagDropBlock`s in a list, called with keywords, or scanned
  (`nnx.vmap` stack, one RNG stream a layer) and called as `call` says."""

  def __init__(self, rngs, block=FlagDropBlock, scan=False,
               call=lambda block, x: block(x)):
    if scan:
      @nnx.split_rngs(splits=2)
      @nnx.vmap(in_axes=(0,), out_axes=0)
      def make(rngs):
        return block(rngs)
      self.blocks = make(rngs)
    else:
      self.blocks = nnx.List([block(rngs) for _ in range(2)])
    self.head = nnx.Linear(16, 4, rngs=rngs)
    self.scan, self.call = scan, call

  def __call__(self, x):
    if self.scan:
      @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
      def body(x, block):
        return self.call(block, x)
      return self.head(body(x, self.blocks))
    for i, b in enumerate(self.blocks):
      x = b(x, train=True, scale=None if i else jnp.float32(0.5))
    return self.head(x)


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["listed", "scanned"])
def test_nnx_wrapped_blocks_take_flags_and_draw_dropout_as_unwrapped(scan):
  """Flags and keyword arrays reach a wrapped listed block; its dropout
  draws what the unwrapped block draws (the RNG count it moves is written
  back), so wrapped and unwrapped stage-3 steps agree. A scanned stack's
  streams (one key a layer) are folded per device too."""
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 16)).astype(np.float32),
              "y": rng.normal(size=(32, 4)).astype(np.float32)}
             for _ in range(3)]
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  name, mode = ("blocks", "per layer") if scan else ("blocks/1", "per block")
  runs = {}
  for wrap in (False, True):
    block = zerojax.nn.layerwise(FlagDropBlock) if wrap else FlagDropBlock
    state = zerojax.shard(FlagDropNet(nnx.Rngs(0, dropout=1), block, scan),
                          stage=3, tx=TX, blocks=zerojax.Blocks(stacked=("blocks",) if scan else (), reshard_after_forward=wrap))
    step = zerojax.train_step(loss_fn)
    assert step.gathering(state, batches[0])[name] == (
        mode if wrap else "whole step")
    state, losses = _trained(step, state, batches)
    runs[wrap] = losses, state
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
  _close(_params(zerojax.gather_model(runs[True][1])),
         _params(zerojax.gather_model(runs[False][1])), "float32")
  def count(state):   # the second block's (every layer's, scanned)
    blocks = state.nnx_state["blocks"]
    return np.asarray((blocks if scan else blocks[1])["drop"]["rngs"]["count"])

  np.testing.assert_array_equal(count(runs[True][1]), count(runs[False][1]))
  assert np.all(count(runs[True][1]) > 0)


class PassedRngsBlock(nnx.Module):
  """A block whose dropout draws from an `nnx.Rngs` handed to its call,
  with a boolean mask keyword, as Flax's NNX examples write their
  blocks."""

  def __init__(self, rngs, width=16):
    self.up = nnx.Linear(width, width, rngs=rngs)
    self.drop = nnx.Dropout(0.25)

  def __call__(self, x, *, mask, rngs):
    return x + self.drop(jnp.where(mask, nnx.gelu(self.up(x)), 0), rngs=rngs)


class AttributeBlocksNet(nnx.Module):
  """Blocks as attributes `block_<i>` (Flax's lm1b NNX example), each
  called with the same `nnx.Rngs`."""

  def __init__(self, rngs, block=PassedRngsBlock, layers=3):
    self.layers = layers
    for i in range(layers):
      setattr(self, f"block_{i}", block(rngs))
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x, rngs):
    mask = jnp.arange(16) % 3 != 0   # a boolean array (tied as bytes)
    for i in range(self.layers):
      x = getattr(self, f"block_{i}")(x, mask=mask, rngs=rngs)
    return self.head(x)


@pytest.mark.slow
def test_nnx_blocks_given_an_rngs_draw_as_unwrapped():
  """An `nnx.Rngs` passed to wrapped blocks: each block moves its count on
  (written back out of the block's call), so the blocks draw different
  masks, the same as unwrapped; three steps agree."""
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(32, 16)).astype(np.float32),
              "y": rng.normal(size=(32, 4)).astype(np.float32)}
             for _ in range(3)]

  def loss_fn(model, b, key):
    out = model(b["x"], nnx.Rngs(dropout=key))
    return jnp.mean((out - b["y"]) ** 2)

  runs = {}
  for wrap in (False, True):
    block = zerojax.nn.layerwise(PassedRngsBlock) if wrap else PassedRngsBlock
    state = zerojax.shard(AttributeBlocksNet(nnx.Rngs(0), block), stage=3,
                          tx=TX, blocks=zerojax.Blocks(reshard_after_forward=wrap))
    step = zerojax.train_step(loss_fn)
    key = jax.random.key(1)
    assert step.gathering(state, batches[0], key)["block_2"] == (
        "per block" if wrap else "whole step")
    losses = []
    for i, b in enumerate(batches):
      state, metrics = step(state, b, jax.random.fold_in(key, i))
      losses.append(float(metrics["loss"]))
    runs[wrap] = losses, state
  np.testing.assert_allclose(runs[True][0], runs[False][0], rtol=1e-5)
  _close(_params(zerojax.gather_model(runs[True][1])),
         _params(zerojax.gather_model(runs[False][1])), "float32")


def test_nnx_scanned_block_takes_flags_and_keywords_as_unwrapped():
  """A scanned layer called with a Python flag and a keyword array (dropout
  off), wrapped, trains as the unwrapped stack does."""
  def net(wrap):
    block = zerojax.nn.layerwise(FlagDropBlock) if wrap else FlagDropBlock
    return FlagDropNet(nnx.Rngs(0, dropout=1), block, scan=True,
                       call=lambda block, x: block(x, train=False,
                                                   scale=jnp.float32(0.5)))

  batches = [np.ones((16, 16), np.float32) * (i + 1) for i in range(2)]
  loss_fn = lambda m, b: jnp.mean(m(b) ** 2)
  runs = {}
  for wrap in (False, True):
    state = zerojax.shard(net(wrap), stage=3, tx=TX, blocks=zerojax.Blocks(stacked=("blocks",), reshard_after_forward=wrap))
    step = zerojax.train_step(loss_fn)
    assert step.gathering(state, batches[0])["blocks"] == (
        "per layer" if wrap else "whole step")
    runs[wrap] = _trained(step, state, batches)
  np.testing.assert_allclose(runs[True][1], runs[False][1], rtol=1e-5)
  _close(_params(zerojax.gather_model(runs[True][0])),
         _params(zerojax.gather_model(runs[False][0])), "float32")


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("scan", [False, True], ids=["listed", "scanned"])
def test_nnx_blocks_as_written_are_gathered_as_the_opt_in_gathers_them(
    scan, remat):
  """No `layerwise` in the model: the step's rebuilt model (never the
  user's) gathers each block in an `nnx.List`, or each layer of an
  `nnx.scan` stack, as the opt-in with `remat`'s policy does, bit for bit
  (the default: `layerwise(Block, policy=zerojax.nn.keep_activations)`;
  "full": the opt-in's own remat)."""
  make = nnx_scanned if scan else nnx_listed
  batches = [{"x": np.full((16, 32), i + 1.0, np.float32),
              "y": np.zeros((16, 4), np.float32)} for i in range(3)]
  loss_fn = lambda m, b: jnp.mean((m(b["x"]) - b["y"]) ** 2)
  policy = ({} if remat == "full"
            else {"policy": zerojax.nn.keep_activations})
  runs = {}
  for wrap in (False, True):
    block = (zerojax.nn.layerwise(NnxResidualBlock, **policy) if wrap
             else NnxResidualBlock)
    model = make(block)(nnx.Rngs(0))
    # the opt-in names its stack; the model as written needs no name
    state = zerojax.shard(model, stage=3, tx=TX, blocks=zerojax.Blocks(remat=remat, stacked=("blocks",) if scan and wrap else ()))
    step = zerojax.train_step(loss_fn)
    modes = step.gathering(state, batches[0])
    runs[wrap] = modes, _trained(step, state, batches)
    assert type(model.blocks if scan else model.blocks[0]) is block
  assert runs[False][0] == runs[True][0]
  assert {v for k, v in runs[False][0].items() if k.startswith("blocks")} == {
      "per layer" if scan else "per block"}
  np.testing.assert_array_equal(runs[False][1][1], runs[True][1][1])
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         _params(zerojax.gather_model(runs[False][1][0])),
                         _params(zerojax.gather_model(runs[True][1][0])))


def test_nnx_entry_points_refuse_what_does_not_apply(tmp_path):
  make, loss_fn, batches = nnx_problem("mlp")
  state = zerojax.shard(make(), stage=3, tx=TX)
  # an NNX model writes its own state back: mutable= is refused, and the
  # state is still usable
  with pytest.raises(ValueError, match="carries its own state"):
    zerojax.train_step(loss_fn, mutable=("nnx_state",))(state, batches[0])
  with pytest.raises(ValueError, match="carries its own state"):
    zerojax.eval_step(loss_fn, mutable=("nnx_state",))(state, batches[0])
  state, _ = zerojax.train_step(loss_fn)(state, batches[0])
  with pytest.raises(TypeError, match="loss_fn must return \\(loss, aux\\)"):
    zerojax.train_step(loss_fn, has_aux=True)(state, batches[0])
  # the NNX layerwise wrapper takes remat= and policy= only
  with pytest.raises(TypeError, match="NNX blocks take remat= and policy= only"):
    zerojax.nn.layerwise(NnxResidualBlock, prevent_cse=False)
  # restore(tx=) is for NNX models; a TrainState carries its own
  zerojax.checkpoint.save(tmp_path, state, wait=True)
  with pytest.raises(TypeError, match="carries its own tx"):
    zerojax.checkpoint.restore(tmp_path, like=train_state.TrainState.create(
        apply_fn=None, params=_params(make()), tx=TX), tx=TX)
  with pytest.raises(TypeError, match="rng -> nnx.Module"):
    zerojax.create(7, jax.random.key(0), tx=TX)
