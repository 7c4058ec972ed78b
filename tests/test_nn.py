"""zerojax.nn.layerwise: per-layer gathering at stage 3, exact and flat in
depth; and sharded initialisation (zerojax.create)."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import flax.linen as nn
import optax
import pytest
from flax.training import train_state

import zerojax
from footprints import create_footprint
from models import zopts, assert_same_numbers
from models import (Bridged, ListedLM, ResidualBlock, ResidualMLP, ScannedLM,
                    assert_blocks_bounded,
                    assert_matches_reference, reference_run, zero_run)
from models import lm_batches as _batches, lm_loss_fn as _loss_fn


def _all_gathers(hlo):
  return hlo.count("all-gather-start(") + hlo.count(" all-gather(")


@pytest.mark.slow
@pytest.mark.parametrize("scan,layerwise,offload", [
    (True, True, {}), (True, False, {}), (False, True, {}), (False, False, {}),
    # an unrolled block's shards in host memory: their cotangent goes there
    (False, True, {"offload_optimizer": True, "offload_params": True}),
    (False, True, {"prefetch": True}),
    # stage 2: each layer's gradient reduce-scattered inside the loop
    (True, True, {"stage": 2}),
], ids=["scanned-layerwise", "scanned", "unrolled-layerwise", "unrolled",
        "unrolled-layerwise-offload", "unrolled-layerwise-prefetch",
        "scanned-layerwise-stage2"])
def test_layerwise_matches_plain_optax(layerwise, scan, offload):
  model = ScannedLM(layers=3, layerwise=layerwise, scan=scan)
  batches = _batches(model.vocab)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  # momentum SGD: linear in the gradients, so the comparison measures the
  # gradients themselves (Adam would magnify float noise where g ~ eps).
  tx = optax.sgd(0.5, momentum=0.9)
  loss_fn = _loss_fn(model)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx),
                        accum_steps=2, **zopts({
                            "stage": 3, **offload,
                            "stacked": ("blocks",) if scan else ()}))
  if not scan:   # every block has chunks of its own, opted in or not, and
    # so do the modules beside them (`zerojax._model.peruse`; the root's
    # LayerNorm_0 by its root path, its name being the blocks' too)
    assert {c.stack for c in state.layout.chunks} == {
        "Embed_0", "/LayerNorm_0", "blocks_0", "blocks_1", "blocks_2"}
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


def _footprint(layers, width=512):
  model = ScannedLM(layers=layers, width=width, vocab=256)
  batch = _batches(model.vocab, batch=16, seq=32, steps=1)[0]
  state = zerojax.create(lambda r: model.init(r, batch["tokens"][:1])["params"],
                         jax.random.key(0), apply_fn=model.apply,
                         tx=optax.adam(1e-3), stage=3, blocks=zerojax.Blocks(stacked=("blocks",)))
  compiled = zerojax.train_step(_loss_fn(model)).lower(state, batch).compile()
  return zerojax.compiled_footprint(compiled), compiled.as_text(), state


@pytest.mark.slow
def test_stage3_footprint_does_not_grow_with_gathered_layers():
  width, seq, per_device_batch = 512, 32, 2
  fp4, hlo4, s4 = _footprint(4, width)
  fp16, hlo16, s16 = _footprint(16, width)
  per_layer_params = sum(c.used for c in s4.layout.chunks if c.layers)
  per_layer_state = 12 * per_layer_params / 8          # sharded, persistent
  per_layer_grads = 4 * per_layer_params / 8           # sharded gradient
  per_layer_acts = 4 * per_device_batch * seq * width  # saved layer input
  growth = fp16["footprint"] - fp4["footprint"]
  # Every ZeRO-3 step also holds the gradient shard (4 bytes x params / N)
  # between backward and update; it grows with depth like the state does.
  assert growth <= 1.1 * 12 * (per_layer_state + per_layer_grads + per_layer_acts)
  # the gathered layers would add 12 x 4 x per_layer_params = 151 MiB
  assert growth < 12 * 4 * per_layer_params
  # one gather per chunk in the forward loop body, one in the backward
  assert _all_gathers(hlo4) == _all_gathers(hlo16)


@functools.lru_cache(maxsize=None)
def _unrolled_step(layers, layerwise, width=256, prefetch=None):
  """The compiled stage-3 step of `layers` residual blocks, and its
  (abstract) state; without the opt-in, held for the step
  (`reshard_after_forward=False`)."""
  model = ResidualMLP(layers=layers, width=width, layerwise=layerwise)
  x = np.zeros((64, width), np.float32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1])["params"])
  state = zerojax.shard_shape(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), stage=3,
                              blocks=zerojax.Blocks(prefetch=prefetch, reshard_after_forward=layerwise))
  step = zerojax.train_step(lambda p, b: model.apply({"params": p}, b))
  return step.lower(state, x).compile(), state


@pytest.mark.slow
def test_unrolled_stage3_footprint_is_bounded_like_scanned_layers():
  (c4, s4), (c16, _) = (_unrolled_step(n, True, 256) for n in (4, 16))
  assert_blocks_bounded(c4, c16, s4, "blocks_0", 256)


def test_tie_is_the_bit_identity_on_every_platform():
  """`nn.tie` is `x & (x | t)` on the bits, lowered for CPU and for CUDA
  alike (an optimization barrier is dropped by XLA's CPU backend and, on a
  GPU, cost time and memory: docs/decisions.md), and gives `x`'s values."""
  from zerojax._model.gather import tie
  f = jax.jit(lambda x, a: tie(x, a) * 2)
  x = jnp.arange(6, dtype=jnp.float32).reshape(2, 3)
  a = jnp.float32(-1.5)
  np.testing.assert_array_equal(f(x, a), x * 2)
  for platform in ("cuda", "cpu"):
    lowered = f.trace(x, a).lower(lowering_platforms=(platform,)).as_text()
    assert "stablehlo.and" in lowered and "stablehlo.or" in lowered
    assert "optimization_barrier" not in lowered
  mask = jnp.array([True, False])
  np.testing.assert_array_equal(jax.jit(tie)(mask, a), mask)


def test_unrolled_regathers_are_distinct_from_the_forward_gathers():
  """Without `tie`, XLA merges each block's backward re-gather with its
  forward gather (CSE): one all-gather per chunk, every block held."""
  for layerwise, per_unit_chunk in ((True, 2), (False, 1)):
    compiled, state = _unrolled_step(4, layerwise)
    units = sum(1 for c in state.layout.chunks if c.stack is not None)
    assert units == 4
    others = len(state.layout.chunks) - units
    assert _all_gathers(compiled.as_text()) == per_unit_chunk * units + others
  # the opt-in is what bounds the temporaries
  temp = {w: _unrolled_step(4, w)[0].memory_analysis().temp_size_in_bytes
          for w in (True, False)}
  assert temp[True] < temp[False]


def _dependences(text):
  """`{op: (line, operands, is_dot)}` of an optimized HLO module's entry
  computation, or of a StableHLO module's values; a fusion (HLO) counts
  as a dot when its computation holds one."""
  hlo = "\nENTRY " in text
  if hlo:
    bodies = dict(re.findall(r"\n(%[\w.\-]+) [^\n]*\{\n(.*?)\n\}", text, re.S))
    text = re.search(r"\nENTRY [^\n]*\{\n(.*?)\n\}", text, re.S).group(1)
  ops = {}
  regions = []   # StableHLO ops whose regions are open: each waits for them
  for line in text.splitlines():
    if regions and line.strip().startswith("})"):
      regions.pop()
      continue
    m = re.match(r"\s*(?:ROOT )?(%[\w.\-]+)(?::\d+)? = (.*)", line)
    head = line
    if m:
      name, rest = m.groups()
      head = rest.split(", metadata=")[0].split("calls=")[0]
      is_dot = (" dot(" in head or "stablehlo.dot_general" in head
                or hlo and any(" dot(" in bodies.get(c, "") for c in
                               re.findall(r"calls=(%[\w.\-]+)", rest)))
      ops[name] = (rest, {o for o in re.findall(r"%[\w.\-]+", head)
                          if o != name}, is_dot)
    for outer in regions:   # (a `platform_dependent` branch is a region)
      ops[outer][1].update(set(re.findall(r"%[\w.\-]+", head)) - {outer})
    if m and rest.rstrip().endswith("({"):
      regions.append(name)
  return ops


def _waits_for(ops):
  """`before(op)`: every op of `ops` (`_dependences`) that `op` waits for."""
  waits = {}

  def before(name):
    if name not in waits:
      waits[name] = set()
      for o in ops[name][1]:
        if o in ops:
          waits[name] |= {o} | before(o)
    return waits[name]
  return before


def _dots_before_gathers(text):
  """Per all-gather, in program order (StableHLO) or by `(pass, block)`
  (optimized HLO, from op names): how many dots it waits for."""
  ops = _dependences(text)
  before = _waits_for(ops)
  out = {}
  for name, (rest, _, _) in ops.items():
    if re.search(r" all-gather(-start)?\(|stablehlo\.all_gather", rest):
      key = len(out)
      op = re.search(r'op_name="([^"]*)"', rest)
      if op:
        key = ("backward" if "transpose(" in op.group(1) else "forward",
               int(re.search(r"blocks_(\d+)/", op.group(1)).group(1)))
      out[key] = sum(ops[o][2] for o in before(name))
  return out


@pytest.mark.slow
def test_prefetch_gathers_each_block_one_block_early():
  """`prefetch`: block i's forward all-gather waits only for what block
  i-1's waited for without it, so it can run beside block i-1's dots; and
  block i's re-gather waits only for what block i+1's did, so it runs beside
  block i+1's backward. One block early, never more (a double buffer). In
  XLA's CPU program (op names tell the blocks) and in the one lowered for
  CUDA (blocks in program order: forward 0..3, re-gathers 3..0). No block's
  dot waits for a gradient's reduce-scatter, so block i's may run beside
  block i-1's backward."""
  model = ResidualMLP(layers=4, width=64)
  x = np.random.RandomState(0).randn(64, 64).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1])["params"]
  step = zerojax.train_step(lambda p, b: model.apply({"params": p}, b))
  waits, trained, evaluated = {}, {}, {}
  evaluate = zerojax.eval_step(lambda p, b: {"loss": model.apply({"params": p}, b)})
  for prefetch in (False, True):
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-2)), stage=3,
                          blocks=zerojax.Blocks(prefetch=prefetch))
    compiled = step.lower(state, x).compile().as_text()
    ops = _dependences(compiled)
    before = _waits_for(ops)
    scatters = {n for n, (line, _, _) in ops.items()
                if " reduce-scatter(" in line}
    assert len(scatters) == 4 and not any(
        scatters & before(n) for n, (line, _, is_dot) in ops.items()
        if is_dot and "/blocks_" in line)
    waits[prefetch] = (
        _dots_before_gathers(compiled),
        _dots_before_gathers(step.trace(state, x).lower(
            lowering_platforms=("cuda",)).as_text()))
    evaluated[prefetch] = evaluate(state, x)["loss"]
    trained[prefetch] = zerojax.gather_params(step(state, x)[0])
  (cpu, cuda), (cpu_pf, cuda_pf) = waits[False], waits[True]
  assert len(cpu) == len(cuda) == 8
  assert cuda[7] == cpu["backward", 0] > 0   # (a parse that loses ties: 0)
  for i in range(4):
    earlier = max(i - 1, 0), min(i + 1, 3)   # the block one step before
    assert cpu_pf["forward", i] == cpu["forward", earlier[0]]
    assert cpu_pf["backward", i] == cpu["backward", earlier[1]]
    assert cuda_pf[i] == cuda[earlier[0]]
    assert cuda_pf[7 - i] == cuda[7 - earlier[1]]
  # and without prefetch, each block's gathers wait for the block before
  assert cpu["forward", 1] > cpu["forward", 0]
  assert cpu["backward", 2] > cpu["backward", 3]
  # the ties are bitwise identities: the same step, bit for bit (under
  # XLA's own emitters: the tests' older ones fuse the two programs around
  # the stored block outputs differently, see `assert_same_numbers`)
  assert evaluated[True] == evaluated[False]
  np.testing.assert_allclose(evaluated[True], model.apply({"params": params}, x),
                             rtol=1e-6)
  for a, b in zip(jax.tree.leaves(trained[False]),
                  jax.tree.leaves(trained[True])):
    assert_same_numbers(a, b)


@pytest.mark.slow
def test_prefetch_holds_one_more_block_at_any_depth():
  temps = {layers: _unrolled_step(layers, True, 256, prefetch=True)[0]
           .memory_analysis().temp_size_in_bytes for layers in (4, 16)}
  state = _unrolled_step(4, True, 256, prefetch=True)[1]
  per_block = 4 * sum(c.used for c in state.layout.chunks
                      if c.stack == "blocks_0")
  base = _unrolled_step(4, True, 256)[0].memory_analysis().temp_size_in_bytes
  assert temps[16] <= temps[4] + per_block / 4      # flat in depth
  # XLA's CPU scheduler copies the prefetched block's weights out of the
  # gathered chunk as soon as it arrives: two blocks more than without
  assert temps[4] <= base + 2 * per_block + per_block / 4


def test_prefetch_default_is_on_where_collectives_overlap():
  mesh = jax.make_mesh((8,), ("data",))
  assert zerojax._options.config.prefetches(zerojax.ZeroConfig(), mesh) is False
  assert zerojax._options.config.prefetches(zerojax.ZeroConfig(blocks=zerojax.Blocks(prefetch=True)), mesh)


def test_the_default_policy_keeps_a_softmaxs_scores_and_sum_not_its_maximum(
    capsys):
  """`keep_activations` saves an attention's scores (a matmul) and its
  softmax's sum, and recomputes the maximum the softmax subtracts: XLA
  computes it again inside the kernel that reads the scores
  (docs/decisions.md, "the softmax's maximum")."""
  import jax.ad_checkpoint

  def attention(q, k, v):
    return jax.nn.softmax(jnp.einsum("qd,kd->qk", q, k)) @ v

  q, kv = jnp.ones((4, 8)), jnp.ones((6, 8))
  jax.ad_checkpoint.print_saved_residuals(
      jax.checkpoint(attention, policy=zerojax.nn.keep_activations), q, kv,
      kv)
  saved = [line for line in capsys.readouterr().out.splitlines()
           if "output of" in line]
  assert [line.split(" from ")[0] for line in saved] == [
      "f32[4,6] output of dot_general", "f32[4] output of reduce_sum"], saved


def test_keeping_the_casts_also_keeps_a_softmaxs_bf16_probabilities(capsys):
  """`keep_activations_and_casts` (`Blocks(remat="casts")`) saves what
  `keep_activations` saves and the float32 softmax's probabilities cast to
  bf16 for the value matmul (a widening cast it leaves to be computed
  again); `recompute_scores` (`"recompute-scores"`) saves those but the
  scores, a batched matmul's result larger than its operands, and keeps
  the value matmul's, smaller than its."""
  import jax.ad_checkpoint

  def attention(q, k, v):   # 2 heads of 4 dimensions, 16 queries and keys
    s = jnp.einsum("hqd,hkd->hqk", q, k, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s).astype(jnp.bfloat16)
    return jnp.sin(jnp.einsum("hqk,hkd->hqd", p, v).astype(jnp.float32))

  qkv = jnp.ones((2, 16, 4), jnp.bfloat16)
  saved = {}
  for policy in (zerojax.nn.keep_activations,
                 zerojax.nn.keep_activations_and_casts,
                 zerojax.nn.recompute_scores):
    jax.ad_checkpoint.print_saved_residuals(
        jax.checkpoint(attention, policy=policy), qkv, qkv, qkv)
    saved[policy.__name__] = [
        line.split(" from ")[0] for line in capsys.readouterr().out
        .splitlines() if "output of" in line]
  scores, probabilities = ("f32[2,16,16] output of dot_general",
                           "bf16[2,16,16] output of convert_element_type")
  assert scores in saved["keep_activations"], saved
  assert probabilities not in saved["keep_activations"], saved
  assert sorted(saved["keep_activations_and_casts"]) == sorted(
      saved["keep_activations"] + [probabilities]), saved
  assert saved["recompute_scores"] == [
      s for s in saved["keep_activations_and_casts"] if s != scores], saved
  assert "bf16[2,16,4] output of dot_general" in saved["recompute_scores"]


@pytest.mark.slow
def test_a_policy_that_saves_everything_still_gathers_layers_again():
  """`layerwise(Block, policy=everything_saveable)` on scanned layers at
  stage 3 keeps the blocks' activations for the backward, not their
  gathered parameters (zerojax's policy wrapper refuses the gathered
  leaves, which come out of one `custom_vjp`): the step holds far less
  than every layer gathered more than without a policy (it held all of
  them before), and trains as plain optax does."""
  scan = True
  layers, width = 6, 256
  batches = _batches(64, batch=8, seq=8, steps=2)

  def temp_and_state(policy):
    model = ScannedLM(layers=layers, width=width, vocab=64, scan=scan,
                      remat_policy=policy)
    params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3,
        blocks=zerojax.Blocks(stacked=("blocks",) if scan else ()))
    compiled = zerojax.train_step(_loss_fn(model)).lower(
        state, batches[0]).compile()
    return compiled.memory_analysis().temp_size_in_bytes, state, model, params

  plain, *_ = temp_and_state(None)
  everything, state, model, params = temp_and_state(
      jax.checkpoint_policies.everything_saveable)
  gathered = 4 * sum(c.used * (c.layers or 1) for c in state.layout.chunks
                     if c.stack)
  assert gathered > 4 * 12 * width * width * layers * 0.9
  assert everything - plain < gathered / 4, (everything, plain, gathered)
  ref_losses, ref_params = reference_run(_loss_fn(model), params,
                                         optax.sgd(0.1), batches)
  state, losses = zero_run(state, _loss_fn(model), batches)
  assert_matches_reference(losses, zerojax.gather_params(state), ref_losses,
                           ref_params)


def _tiny_lm_state(layerwise, scan, stacked, stage=3):
  model = ScannedLM(layers=2, width=32, vocab=64, layerwise=layerwise, scan=scan)
  batch = _batches(model.vocab, batch=16, seq=8, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=stage,
                        blocks=zerojax.Blocks(stacked=stacked))
  return model, state, batch


def _reduce_scatters(hlo):
  """`(where, result shape)` of each reduce-scatter in compiled HLO text,
  where being "entry", "loop body" (a while loop's body) or another
  computation's name."""
  bodies = set(re.findall(r"body=%?([\w.\-]+)", hlo))
  where, out = None, []
  for line in hlo.splitlines():
    if line and not line.startswith(" ") and line.rstrip().endswith("{"):
      name = line.split()[1 if line.startswith("ENTRY") else 0].lstrip("%")
      where = ("entry" if line.startswith("ENTRY") else
               "loop body" if name in bodies else name)
    found = re.search(r"= (\S+) reduce-scatter(?:-start)?\(", line)
    if found:
      out.append((where, found.group(1)))
  return out


def _lowered_reduce_scatters(text):
  """`(in a loop, result type)` of each reduce-scatter in StableHLO text:
  in a loop when it sits in a `stablehlo.while` region or in a function
  called from one, however deep (jax may outline rematerialised code)."""
  lines = text.splitlines()
  func, depth, loops = None, 0, []   # loops: [depth at its start, entered]
  calls, from_loops, found = {}, set(), []
  for i, line in enumerate(lines):
    named = re.match(r"\s*func\.func (?:\w+ )?@([\w.\-]+)", line)
    func = named.group(1) if named else func
    called = set(re.findall(r"call @([\w.\-]+)", line))
    calls.setdefault(func, set()).update(called)
    if loops:
      from_loops |= called
    if "stablehlo.reduce_scatter" in line:
      typed = next(l for l in lines[i:] if re.search(r"\) -> tensor<", l))
      found.append((func, bool(loops),
                    re.search(r"-> (tensor<[^>]*>)", typed).group(1)))
    if "stablehlo.while" in line:
      loops.append([depth, False])
    depth += line.count("{") - line.count("}")
    while loops and (depth > loops[-1][0] or loops[-1][1]):
      if depth > loops[-1][0]:
        loops[-1][1] = True
        break
      loops.pop()
  while True:   # functions called from loops, and what they call
    more = set().union(*(calls.get(f, set()) for f in from_loops)) - from_loops
    if not more:
      break
    from_loops |= more
  return [(in_loop or f in from_loops, shape) for f, in_loop, shape in found]


@pytest.mark.slow
def test_stage2_reduces_each_layers_gradient_inside_the_loop():
  """At stage 2 a wrapped scanned block reduce-scatters its layer's
  gradient in the backward loop's body, where the backward of the layers
  below can hide it, instead of the whole stack's after the loop, in the
  program compiled for CPU and in the one lowered for CUDA (the gradient's
  values: `test_layerwise_matches_plain_optax`)."""
  found, lowered = {}, {}
  for layerwise in (True, False):
    model, state, batch = _tiny_lm_state(layerwise, True, ("blocks",), 2)
    step = zerojax.train_step(_loss_fn(model))
    found[layerwise] = _reduce_scatters(
        step.lower(state, batch).compile().as_text())
    lowered[layerwise] = _lowered_reduce_scatters(step.trace(
        state, batch).lower(lowering_platforms=("cuda",)).as_text())
    assert step.gathering(state, batch)["blocks"] == (
        "replicated, gradient reduced per layer" if layerwise
        else "replicated")
  stack = next(c for c in state.layout.chunks if c.layers)
  row = stack.shape[-1] // 8
  # one layer's row in the loop body; the stack's [layers, row] after it
  assert any(where == "loop body" and shape.startswith(f"f32[{row}]")
             for where, shape in found[True])
  assert not any(where == "entry" and f"{row}]" in shape
                 for where, shape in found[True])
  assert any(where == "entry" and shape.startswith(f"f32[2,{row}]")
             for where, shape in found[False])
  assert not any(where == "loop body" for where, _ in found[False])
  assert (True, f"tensor<{row}xf32>") in lowered[True]
  assert not any(f"x{row}x" in shape for _, shape in lowered[True])
  assert (False, f"tensor<2x{row}xf32>") in lowered[False]
  assert not any(in_loop for in_loop, _ in lowered[False])


@pytest.mark.slow
@pytest.mark.parametrize("layerwise,scan,want", [
    (True, True, {"blocks": "per layer"}),
    (True, False, {"blocks_0": "per block", "blocks_1": "per block"}),
    (False, False, {"blocks_0": "per block", "blocks_1": "per block"}),
    (False, True, {"blocks": "per layer"}),
])
def test_the_step_says_how_it_gathers_each_chunk(layerwise, scan, want):
  # the opt-in names its stack; the model as written needs no name
  model, state, batch = _tiny_lm_state(layerwise, scan,
                                       ("blocks",) if scan and layerwise
                                       else ())
  modes = zerojax.train_step(_loss_fn(model)).gathering(state, batch)
  assert {k: v for k, v in modes.items() if k.startswith("blocks")} == want
  # the embedding and final norm, modules beside the blocks, too small to
  # compare gathering them per use with holding them (`zerojax._model.peruse`)
  assert {k: v.split(" (")[0] for k, v in modes.items()
          if not k.startswith("blocks")} == {"Embed_0": "whole step",
                                             "LayerNorm_0": "whole step"}


@pytest.mark.slow
@pytest.mark.parametrize("prefetch", [False, True])
def test_listed_blocks_called_with_flags_are_gathered_per_block(prefetch):
  """Blocks in a setup-time list named by index (each index twice: "enc" and
  "dec"), called with None and a Python flag, as Hugging Face's Flax models
  call theirs: units by path, the flag closed over (not traced by the
  remat and custom_vjp), training as plain optax."""
  model = ListedLM()
  batches = _batches(model.vocab, batch=16, seq=8, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  loss_fn = _loss_fn(model)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3, accum_steps=2,
                        blocks=zerojax.Blocks(prefetch=prefetch))
  modes = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert {k: v for k, v in modes.items() if "/" in k} == {
      f"{name}/{i}": "per block" for name in ("enc", "dec") for i in (0, 1)}
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


@pytest.mark.slow
def test_a_wrapped_block_with_flags_runs_as_the_block_outside_a_step():
  """Outside a step (and below stage 3) the wrapped block is the block under
  `nn.remat`, its flags static: dropout on and off, values and gradients
  those of the unwrapped block."""
  tokens = jnp.arange(16, dtype=jnp.int32).reshape(2, 8)
  plain, wrapped = ListedLM(layerwise=False), ListedLM()
  params = plain.init(jax.random.key(0), tokens)["params"]
  for deterministic in (True, False):
    def loss(p, model):
      out = model.apply({"params": p}, tokens, deterministic=deterministic,
                        rngs={"dropout": jax.random.key(1)})
      return jnp.mean(out ** 2)
    want = jax.value_and_grad(loss)(params, plain)
    got = jax.value_and_grad(loss)(params, wrapped)
    # (remat may change XLA's fusions: float reordering only)
    jax.tree_util.tree_map(functools.partial(
        np.testing.assert_allclose, rtol=1e-5, atol=1e-8), got, want)


def _trained(model, stacked=(), steps=3, **config):
  """Three stage-3 steps of `model` (a ScannedLM) on 8 devices: (losses,
  gathered parameters, how the step gathered each chunk)."""
  batches = _batches(model.vocab, batch=16, seq=8, steps=steps)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), stage=3,
                        **zopts({"stacked": stacked, **config}))
  modes = zerojax.train_step(_loss_fn(model)).gathering(state, batches[0])
  state, losses = zero_run(state, _loss_fn(model), batches)
  return losses, zerojax.gather_params(state), modes


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
@pytest.mark.parametrize("remat,policy", [
    ("full", None),
    ("dots", jax.checkpoint_policies.dots_with_no_batch_dims_saveable)])
def test_blocks_as_written_are_gathered_as_the_opt_in_gathers_them(
    scan, remat, policy):
  """No `layerwise` in the model and no `stacked=`: stage 3 gathers each
  block at its call (each layer in its scan) and again in its backward
  pass, as the opt-in with the same remat policy does, bit for bit."""
  stacked = ("blocks",) if scan else ()
  plain = _trained(ScannedLM(layers=3, width=32, vocab=64, scan=scan,
                             layerwise=False), remat=remat)
  wrapped = _trained(ScannedLM(layers=3, width=32, vocab=64, scan=scan,
                               layerwise=True, remat_policy=policy), stacked)
  assert plain[2] == wrapped[2]
  assert set(v for k, v in plain[2].items() if k.startswith("blocks")) == {
      "per layer" if scan else "per block"}
  np.testing.assert_array_equal(plain[0], wrapped[0])
  jax.tree_util.tree_map(np.testing.assert_array_equal, plain[1], wrapped[1])


@pytest.mark.slow
@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_the_default_keeps_activations_and_gathers_blocks_again(scan):
  """`remat="none"` (the default): each block gathered twice (forward,
  backward), nothing recomputed, training as plain optax; its compiled
  footprint holds the activations the full remat drops, but not the
  gathered blocks `reshard_after_forward=False` holds."""
  model = ScannedLM(layers=4, width=64, vocab=64, scan=scan, layerwise=False)
  batches = _batches(model.vocab, batch=16, seq=16, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  make = lambda **kw: zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3, **zopts(kw))
  state = make()
  step = zerojax.train_step(_loss_fn(model))
  compiled = {}
  for name, kw in (("none", {}), ("full", {"remat": "full"}),
                   ("held", {"reshard_after_forward": False})):
    compiled[name] = step.lower(make(**kw), batches[0]).compile()
  gathers = _all_gathers(compiled["none"].as_text())
  chunks = len(state.layout.chunks)
  # two per block (or in the scan's loops), one per other chunk
  assert gathers == (2 + chunks - 1 if scan else 2 * 4 + chunks - 4)
  temp = {k: c.memory_analysis().temp_size_in_bytes for k, c in compiled.items()}
  assert temp["full"] < temp["none"]
  state, losses = zero_run(state, _loss_fn(model), batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(_loss_fn(model), params, tx, batches))


class _PenalisedLM(nn.Module):
  """Blocks whose first kernel the model also reads outside their calls
  (a penalty on it): gathering them per call would not free it."""
  vocab: int = 64

  @nn.compact
  def __call__(self, tokens):
    lm = ScannedLM(layers=2, width=32, vocab=64, scan=False, layerwise=False,
                   name="lm")
    logits = lm(tokens)
    kernel = lm.variables["params"]["blocks_1"]["Dense_0"]["kernel"]
    return logits + 1e-3 * jnp.sum(kernel ** 2)


@pytest.mark.slow
def test_a_block_whose_parameters_are_read_outside_its_call_is_held(caplog):
  zerojax._model.gather._SAID.clear()   # (said once a process)
  model = _PenalisedLM()
  batches = _batches(64, batch=16, seq=8, steps=3)
  params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3)
  loss_fn = _loss_fn(model)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert modes["lm/blocks_0"] == "per block"
  assert modes["lm/blocks_1"] == "whole step"
  said = [r.getMessage() for r in caplog.records]
  assert sum("'blocks_1' gathered for the whole step: its parameters are "
             "also read outside its own call" in m for m in said) == 1
  caplog.clear()
  with caplog.at_level("WARNING", logger="zerojax"):   # said once
    zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert not caplog.records
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


class _ConvPair(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.relu(nn.Conv(16, (3, 3), use_bias=False)(x))
    return nn.Conv(16, (3, 3), use_bias=False)(x)


class _Convs(nn.Module):
  """Two bias-free 3x3 convolutions in one submodule: every weight starts
  with the same length (3), as a scanned stack's do, but nothing scans."""

  @nn.compact
  def __call__(self, x):
    return _ConvPair(name="body")(x).mean(axis=(1, 2))


def test_a_module_that_only_looks_like_a_stack_is_held(caplog):
  """Found by the tree alone (`chunking.scanned_stacks`), laid out per
  "layer", but never called as one layer inside a scan: held for the step,
  silently (nothing was asked), training as plain optax."""
  zerojax._model.gather._SAID.clear()   # (said once a process)
  model = _Convs()
  rng = np.random.default_rng(0)
  batches = [{"x": rng.normal(size=(16, 6, 6, 16)).astype(np.float32),
              "y": rng.normal(size=(16, 16)).astype(np.float32)}
             for _ in range(3)]
  params = model.init(jax.random.key(0), batches[0]["x"][:1])["params"]
  tx = optax.sgd(0.1, momentum=0.9)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3)
  assert [c.layers for c in state.layout.chunks] == [3]
  loss_fn = lambda p, b: jnp.mean((model.apply({"params": p}, b["x"])
                                   - b["y"]) ** 2)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert modes == {"body": "whole step"} and not caplog.records
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


class _TwoShapes(nn.Module):
  """A block module called on parameters it holds, and a sibling of the same
  structure whose parameters the model uses without calling it."""

  @nn.compact
  def __call__(self, x):
    x = ResidualBlock(32, name="blocks_0")(x)
    if self.is_initializing():
      ResidualBlock(32, name="blocks_1")(x)
      return x
    p = self.variables["params"]["blocks_1"]
    return x @ p["Dense_0"]["kernel"] @ p["Dense_1"]["kernel"]


def test_parameters_used_without_calling_their_module_are_held(caplog):
  zerojax._model.gather._SAID.clear()   # (said once a process)
  model = _TwoShapes()
  x = np.random.default_rng(0).normal(size=(16, 32)).astype(np.float32)
  params = model.init(jax.random.key(0), x[:1])["params"]
  tx = optax.sgd(0.1)
  loss_fn = lambda p, b: jnp.mean(model.apply({"params": p}, b) ** 2)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3)
  with caplog.at_level("WARNING", logger="zerojax"):
    modes = zerojax.train_step(loss_fn).gathering(state, x)
  assert (modes["blocks_0"], modes["blocks_1"]) == ("per block", "whole step")
  assert "'blocks_1' gathered for the whole step: no call of a module " \
      "holding exactly those parameters" in " ".join(
          r.getMessage() for r in caplog.records)
  state, losses = zero_run(state, loss_fn, [x, x])
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, [x, x]))


def _bridged_state(per_use, wrap=True, hidden=512, batch=64):
  """The model, the abstract stage-3 state (Adam) and an input batch of
  `Bridged` with width 256."""
  model = Bridged(layers=2, width=256, hidden=hidden, wrap=wrap)
  x = np.zeros((batch, model.width), np.float32)
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x[:1])["params"])
  state = zerojax.shard_shape(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adam(1e-3)),
                              stage=3, blocks=zerojax.Blocks(per_use=per_use))
  return model, state, x


@pytest.mark.slow
def test_a_per_use_module_is_gathered_at_each_call_and_trains_exactly():
  """`per_use=("bridge",)`: the bridge's leaves get chunks of their own, the
  step gathers them at its call (and again in its backward pass), and
  training matches plain optax."""
  model = Bridged(layers=2, width=64, hidden=512)
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(16, 64)).astype(np.float32) for _ in range(3)]
  params = model.init(jax.random.key(0), batches[0][:1])["params"]
  tx = optax.sgd(0.5, momentum=0.9)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3,
                        blocks=zerojax.Blocks(per_use=("bridge",)), accum_steps=2)
  assert "bridge" in {c.stack for c in state.layout.chunks}
  loss_fn = lambda p, b: model.apply({"params": p}, b)
  modes = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert modes["bridge"] == "per block"
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))


@pytest.mark.slow
def test_a_per_use_module_is_gathered_once_per_call(monkeypatch):
  """Held (the comparison of `zerojax._model.peruse` off), the bridge's chunks are gathered once for the step; per use, at
  its forward call and again in its backward pass (one more all-gather per
  chunk), the rest of the program unchanged. Whether that lowers the
  footprint is up to XLA's scheduler: the compiled footprints, measured
  2026-11-26 (width 256, 2,048 rows a device, a 4 MiB bridge), were 27.8 MiB
  held and 21.8 per use on jax 0.10.2, but 22.1 held and 23.8 per use on
  jax 0.12.0.1, so no footprint is asserted here."""
  model, held, x = _bridged_state(())
  _, per_use, _ = _bridged_state(("bridge",))
  loss_fn = lambda p, b: model.apply({"params": p}, b)
  monkeypatch.setattr(zerojax._model.peruse, "WORTH_COMPARING", float("inf"))
  text = {k: zerojax.train_step(loss_fn).lower(s, x).compile().as_text()
          for k, s in (("held", held), ("per use", per_use))}
  bridge_chunks = sum(1 for c in per_use.layout.chunks if c.stack == "bridge")
  assert bridge_chunks >= 1
  assert _all_gathers(text["per use"]) == _all_gathers(text["held"]) + bridge_chunks


class _TiedLM(nn.Module):
  """An `nn.Embed` used at the lookup and as the tied head (`attend`),
  between two wrapped residual blocks; `wrap` wraps the embedding too."""
  wrap: bool = True

  @nn.compact
  def __call__(self, tokens):
    wrapped = zerojax.nn.layerwise
    embed = (wrapped(nn.Embed) if self.wrap else nn.Embed)(64, 32,
                                                           name="embed")
    x = embed(tokens)
    for i in range(2):
      x = wrapped(ResidualBlock)(32, name=f"blocks_{i}")(x)
    return embed.attend(x).astype(jnp.float32)


@pytest.mark.slow
def test_a_per_use_tied_embedding_is_gathered_at_each_method_call():
  """A module's other public methods gather too: a tied `nn.Embed` named in
  `per_use` is gathered at the lookup and again at `attend` (which reads
  the table in `setup`), wrapped or as written, and trains exactly."""
  batches = _batches(64)
  gathers, trained = {}, {}
  for wrap, reshard in ((False, False), (False, True), (True, True)):
    model = _TiedLM(wrap)
    params = model.init(jax.random.key(0), batches[0]["tokens"][:1])["params"]
    tx = optax.sgd(0.5, momentum=0.9)
    state = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx), stage=3,
                          blocks=zerojax.Blocks(per_use=("embed",), reshard_after_forward=reshard, remat="full"))
    loss_fn = _loss_fn(model)
    step = zerojax.train_step(loss_fn)
    assert step.gathering(state, batches[0])["embed"] == (
        "per block" if wrap or reshard else "whole step")
    gathers[wrap, reshard] = _all_gathers(
        step.lower(state, batches[0]).compile().as_text())
    if reshard:
      trained[wrap] = zero_run(state, loss_fn, batches)
  assert_matches_reference(trained[False][1],
                           zerojax.gather_params(trained[False][0]),
                           *reference_run(loss_fn, params, tx, batches))
  np.testing.assert_array_equal(trained[False][1], trained[True][1])
  # the lookup's and the head's (whose backward keeps it: only `__call__`
  # is rematerialised) instead of one held for the step
  assert gathers[False, True] == gathers[True, True] == gathers[
      False, False] + 1


def test_a_per_use_module_left_unwrapped_is_gathered_per_call():
  model, state, x = _bridged_state(("bridge",), wrap=False)
  modes = zerojax.train_step(
      lambda p, b: model.apply({"params": p}, b)).gathering(state, x)
  assert modes["bridge"] == "per block"


@pytest.mark.parametrize("scanned,per_use,error,message", [
    (False, ("brige",), ValueError, "no submodule is named 'brige'"),
    (False, ("Dense_0",), ValueError, "'Dense_0' names 5 submodules"),
    (True, ("blocks",), ValueError, "'blocks' is a stacked module"),
    (True, ("MultiHeadDotProductAttention_0",), ValueError,
     "'MultiHeadDotProductAttention_0' is inside 'blocks'"),
    (False, (3,), TypeError, "must be a sequence of submodule names"),
])
def test_per_use_bad_names_are_refused(scanned, per_use, error, message):
  """A name must pick exactly one module, outside stacks and repeated
  blocks (which are gathered on their own already)."""
  if scanned:
    model, x = ScannedLM(layers=2, scan=True, layerwise=True), jnp.zeros(
        (1, 8), jnp.int32)
  else:
    model, x = Bridged(layers=2, width=64, hidden=512), jnp.zeros((1, 64))
  params = jax.eval_shape(lambda: model.init(jax.random.key(0), x)["params"])
  with pytest.raises(error, match=re.escape(message)):
    zerojax.shard_shape(train_state.TrainState.create(
        apply_fn=model.apply, params=params, tx=optax.adam(1e-3)), stage=3,
                        blocks=zerojax.Blocks(per_use=per_use, stacked=("blocks",) if scanned else ()))


def test_an_error_in_the_model_surfaces_instead_of_choosing_a_gather():
  """The opt-in is heard, not guessed by catching errors: a model that
  fails while the step looks at it fails the step with its own error."""
  model, state, batch = _tiny_lm_state(True, True, ("blocks",))
  calls = []

  def flaky(params, b):
    calls.append(1)
    if len(calls) == 1:
      raise ZeroDivisionError("a bug in the model")
    return _loss_fn(model)(params, b)

  with pytest.raises(ZeroDivisionError, match="a bug in the model"):
    zerojax.train_step(flaky)(state, batch)


@pytest.mark.slow
def test_create_equals_init_then_shard_and_stays_sharded():
  model = ScannedLM(layers=4, width=128, vocab=512, layerwise=False)
  tokens = jnp.zeros((1, 8), jnp.int32)
  init_fn = lambda r: model.init(r, tokens)["params"]
  tx = optax.adamw(1e-3)
  # on one device a chunk per leaf, all made by one program
  one = jax.make_mesh((1,), ("data",), devices=jax.devices()[:1],
                      axis_types=(jax.sharding.AxisType.Auto,))
  for stage, dtype, mesh in [(3, "float32", None), (2, "bfloat16", None),
                             (0, "float32", None), (2, "bfloat16", one)]:
    made = zerojax.create(init_fn, jax.random.key(7), apply_fn=model.apply,
                          tx=tx, stage=stage, precision=dtype, blocks=zerojax.Blocks(stacked=("blocks",)), mesh=mesh)
    plain = zerojax.shard(train_state.TrainState.create(
        apply_fn=model.apply, params=jax.jit(init_fn)(jax.random.key(7)), tx=tx),
                          stage=stage, precision=dtype, blocks=zerojax.Blocks(stacked=("blocks",)),
                          mesh=mesh)
    assert made.layout == plain.layout
    for a, b in zip(jax.tree_util.tree_leaves(made), jax.tree_util.tree_leaves(plain)):
      assert a.sharding == b.sharding
      assert_same_numbers(a, b)
  assert all(len(c.leaves) == 1 for c in made.layout.chunks)
  fp = create_footprint(
      init_fn, jax.random.key(7), apply_fn=model.apply, tx=tx, stage=2,
      precision="bfloat16", blocks=zerojax.Blocks(stacked=("blocks",)), mesh=one)
  assert len(fp["programs"]) == 3   # the chunks, the rest, the assembly


@pytest.mark.slow
def test_create_peak_is_the_sharded_state_plus_one_leaf():
  model = ScannedLM(layers=4, width=256, vocab=512, layerwise=False)
  tokens = jnp.zeros((1, 8), jnp.int32)
  init_fn = lambda r: model.init(r, tokens)["params"]
  fp = create_footprint(
      init_fn, jax.random.key(0), apply_fn=model.apply, tx=optax.adam(1e-3),
      stage=3, blocks=zerojax.Blocks(stacked=("blocks",)))
  leaves = jax.tree_util.tree_leaves(jax.eval_shape(init_fn, jax.random.key(0)))
  psi = sum(x.size for x in leaves)
  bound = 1.25 * 12 * psi / 8 + 4 * max(x.size for x in leaves)
  # the whole fp32 state (12 bytes a parameter) is beyond this device's
  # budget, and sharded init stays within it
  assert 12 * psi > bound
  assert fp["peak"] <= bound


def test_create_bad_input():
  with pytest.raises(TypeError, match="init_fn"):
    zerojax.create(None, jax.random.key(0), apply_fn=None, tx=optax.sgd(1.0))
  with pytest.raises(TypeError, match="tx="):
    zerojax.create(lambda r: {}, jax.random.key(0), apply_fn=None, tx="adam")


class _OddFirstBlock(nn.Module):
  """A residual block whose first instance makes a bias the later ones are
  handed (T5's relative attention bias)."""
  first: bool = False

  @nn.compact
  def __call__(self, x, bias=None):
    if self.first:
      bias = self.param("rel_bias", nn.initializers.normal(0.02),
                        (x.shape[-1],))
    h = nn.Dense(x.shape[-1])(nn.LayerNorm()(x)) + bias
    return x + nn.Dense(x.shape[-1])(nn.gelu(h)), bias


class _OddFirstNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    bias = None
    for i in range(3):
      x, bias = _OddFirstBlock(first=i == 0, name=f"block_{i}")(x, bias)
    return nn.Dense(1)(x)


def test_a_block_with_an_extra_leaf_is_gathered_per_block():
  """The first block's own leaf is gathered with it, at its call: stage 3
  gathers all three blocks per block and trains as plain optax does."""
  model = _OddFirstNet()
  rng = np.random.default_rng(0)
  batches = [rng.normal(size=(16, 64)).astype(np.float32) for _ in range(3)]
  params = model.init(jax.random.key(0), batches[0][:1])["params"]
  loss_fn = lambda p, b: jnp.mean(model.apply({"params": p}, b) ** 2)
  tx = optax.adam(1e-2)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3)
  modes = zerojax.train_step(loss_fn).gathering(state, batches[0])
  assert [modes[f"block_{i}"] for i in range(3)] == ["per block"] * 3, modes
  state, losses = zero_run(state, loss_fn, batches)
  assert_matches_reference(losses, zerojax.gather_params(state),
                           *reference_run(loss_fn, params, tx, batches))
