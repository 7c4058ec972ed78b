"""The Python blocks of the README and the guides in docs/ run as written
(so they cannot rot), each in a namespace holding the small objects it
names (`model`, `loader`, ...)."""
from __future__ import annotations

import glob
import os
import re
from typing import Any

import flax.linen as linen
import jax
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state

import zerojax
from models import NnxMLP, ResNet, Transformer, lm_batches
# starts processes (or runs for minutes): the full suite's, not the fast tier's
pytestmark = pytest.mark.slow

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)
README = os.path.join(ROOT, "README.md")
DOCS = [README] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def _blocks() -> list:
  text = "\n".join(open(path).read() for path in DOCS)
  return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _block(starting: str) -> str:
  found = [b for b in _blocks() if b.lstrip().startswith(starting)]
  assert len(found) == 1, (f"README and docs have {len(found)} blocks "
                           f"starting {starting!r}")
  return found[0]


def test_every_python_block_is_run_by_a_test():
  """Each block's first line is named by some test in this file."""
  source = open(__file__).read()
  untested = [b.splitlines()[0] for b in _blocks()
              if not any(line.strip() and line.strip()[:20] in source
                         for line in b.splitlines()[:1])]
  assert not untested, untested


def test_the_docs_home_page_opens_with_the_readmes_set_up_and_quick_start():
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "docs_hooks", os.path.join(ROOT, "docs", "_hooks.py"))
  hooks = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(hooks)
  index = open(os.path.join(ROOT, "docs", "index.md")).read()
  page = hooks.on_page_markdown(index, None, None, None)
  readme = open(README).read()
  commands = re.search(r"```bash\n(.*?)```", readme, flags=re.S).group(1)
  assert commands in page and _block("import jax, optax, zerojax") in page
  assert page.index(commands) < page.index("[The training loop]")
  assert hooks.START not in page


def _run(code: str, **names) -> dict:
  namespace = {"jax": jax, "np": np, "optax": optax, "zerojax": zerojax,
               "nnx": nnx, "nn": linen, "train_state": train_state, **names}
  exec(compile(code, README, "exec"), namespace)
  return namespace


@pytest.fixture(scope="module")
def quick_start():
  model = Transformer()
  loader = lm_batches(model.vocab, batch=16, seq=model.seq, steps=2)
  params = model.init(jax.random.key(0), loader[0]["tokens"][:1])["params"]
  return _run(_block("import jax, optax, zerojax"), model=model, params=params,
              loader=loader)


def test_quick_start_trains_evaluates_and_reports(quick_start):
  assert int(quick_start["state"].step) == 2
  assert np.isfinite(float(quick_start["metrics"]["loss"]))
  assert set(quick_start["params"]) == set(
      quick_start["model"].init(jax.random.key(0),
                                quick_start["batch"]["tokens"][:1])["params"])


def test_nnx_block_trains_and_gives_back_a_module():
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 8)).astype(np.float32),
           "y": rng.normal(size=(16, 4)).astype(np.float32)}
  ns = _run(_block("model = Model(rngs=nnx.Rngs(0))"),
            Model=NnxMLP, batch=batch, tx=optax.adamw(1e-3))
  assert isinstance(ns["trained"], NnxMLP)
  assert int(ns["state"].step) == 1


def test_batch_norm_block_builds_a_step_that_runs():
  rng = np.random.default_rng(0)
  batch = {"x": rng.normal(size=(16, 8, 8, 3)).astype(np.float32),
           "y": rng.integers(0, 4, size=(16,)).astype(np.int32)}
  model = ResNet()
  ns = _run(_block("class TrainState(train_state.TrainState):"),
            Any=Any, model=model, v=model.init(jax.random.key(0), batch["x"][:2]),
            tx=optax.adam(1e-3),
            cross_entropy=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y).mean())
  before = ns["state"].batch_stats
  before = jax.tree_util.tree_map(np.asarray, before)
  state, _ = ns["step"](ns["state"], batch)
  moved = jax.tree_util.tree_map(lambda a, b: not np.allclose(a, b),
                                 state.batch_stats, before)
  assert all(jax.tree_util.tree_leaves(moved))


def test_overlap_flags_block_keeps_the_users_flags():
  class FakeOs:
    environ = {"XLA_FLAGS": "--xla_dump_to=/tmp/x"}
  ns = _run(_block('os.environ["XLA_FLAGS"]'), os=FakeOs)
  flags = ns["os"].environ["XLA_FLAGS"]
  assert flags.startswith("--xla_dump_to=/tmp/x")
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags


def test_checkpoint_blocks_save_restore_and_read_without_zerojax(quick_start,
                                                                  tmp_path):
  model, params = quick_start["model"], quick_start["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)), stage=3)
  other_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                             axis_types=(jax.sharding.AxisType.Auto,))
  ns = _run(_block("zerojax.checkpoint.save(ckpt_dir, state)"),
            ckpt_dir=str(tmp_path), state=state, other_mesh=other_mesh,
            plain_train_state=train_state.TrainState.create(
                apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)))
  assert ns["state"].num_shards == 4 and ns["state"].config.stage == 1
  exported = ns["params"]
  # the format block reads the same parameters with orbax and numpy alone
  (step,) = [int(d) for d in os.listdir(tmp_path) if d.isdigit()]
  read = _run(_block("import json, jax, numpy as np"), ckpt_dir=str(tmp_path),
              step=step)["params"]
  flat = {"/".join(str(getattr(k, "key", k)) for k in path): np.asarray(x)
          for path, x in jax.tree_util.tree_leaves_with_path(exported)}
  assert set(read) == set(flat)
  for name, x in read.items():
    np.testing.assert_array_equal(x, flat[name])


def test_create_block_builds_the_state_sharded(quick_start, capsys):
  model = quick_start["model"]
  ns = _run(_block("state = zerojax.create("), model=model,
            batch=quick_start["batch"])
  state = ns["state"]
  assert state.num_shards == 8 and state.config.stage == 3
  assert "ZeRO-3" in capsys.readouterr().out
  # every chunk split over the 8 devices, none whole on one
  for chunk in state.master:
    assert chunk.addressable_shards[0].data.size * 8 == chunk.size
  # model.init's values (made in another program: to the last bit's rounding)
  init = model.init(jax.random.key(0), quick_start["batch"]["tokens"][:1])
  jax.tree_util.tree_map(
      lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
      zerojax.gather_params(state), init["params"])


def test_items_block_saves_beside_the_callers_items_in_their_manager(
    quick_start, tmp_path):
  import orbax.checkpoint as ocp
  model, params = quick_start["model"], quick_start["params"]
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  state = zerojax.shard(plain, stage=3)
  other_mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4],
                             axis_types=(jax.sharding.AxisType.Auto,))
  ns = _run(_block("mgr = ocp.CheckpointManager(run_dir)"), ocp=ocp,
            run_dir=str(tmp_path / "run"), ckpt_dir=str(tmp_path / "own"),
            state=state, plain_train_state=plain, other_mesh=other_mesh,
            iterator_state={"position": 1600})
  assert ns["got"].meta == {"lr": 3e-4}
  assert ns["got"].state.num_shards == 4
  assert ns["state"].num_shards == 8   # restore's default mesh: every device
  assert ns["items"]["data"] == {"position": 1600}
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(ns["state"]), params)


def test_fine_tuning_block_restores_a_base_and_trains_adapters_only(
    quick_start, tmp_path):
  """The README's fine-tuning block: a saved base restored into a tree with
  an adapter (an output bias, here) added; the base frozen, stored split;
  the adapter alone moves."""
  model, params, batch = (quick_start[k] for k in ("model", "params", "batch"))
  tx = optax.adam(1e-2)
  base = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=tx), stage=3)
  zerojax.checkpoint.save(str(tmp_path), base)
  zerojax.checkpoint.wait(str(tmp_path))
  vocab = model.vocab
  lora = train_state.TrainState.create(
      apply_fn=model.apply, tx=tx,
      params={**params, "adapter": {"bias": np.zeros(vocab, np.float32)}})

  def token_losses(p, b):
    base_params = {k: v for k, v in p.items() if k != "adapter"}
    logits = model.apply({"params": base_params}, b["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits + p["adapter"]["bias"], b["targets"])

  mask = np.ones(batch["tokens"].shape, np.float32)
  mask[: len(mask) // 2, 3:] = 0   # half the sequences padded
  ns = _run(_block("state = zerojax.checkpoint.restore(base_dir"),
            base_dir=str(tmp_path), lora_state=lora,
            not_adapters=jax.tree_util.tree_map_with_path(
                lambda path, _: path[0].key != "adapter", lora.params),
            token_losses=token_losses, batch={**batch, "mask": mask})
  state = ns["state"]
  assert int(state.step) == 1 and state.layout.num_chunked_elements == vocab
  after = zerojax.gather_params(state)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         {k: v for k, v in after.items() if k != "adapter"},
                         params)
  assert np.abs(after["adapter"]["bias"]).max() > 0


def test_hybrid_block_shards_within_a_node(quick_start):
  model, params = quick_start["model"], quick_start["params"]
  ns = _run(_block("mesh = jax.make_mesh((num_nodes, gpus_per_node)"),
            num_nodes=2, gpus_per_node=4, state=train_state.TrainState.create(
                apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)))
  assert ns["state"].num_shards == 4 and ns["state"].num_replicas == 2


def test_tensor_parallel_block_splits_rows_and_trains():
  """The block's weights become row chunks over "model", and a step of
  the block's mean square equals plain optax's on one device."""
  ns = _run(_block("class MLPBlock(nn.Module):"))
  state, model = ns["state"], ns["model"]
  assert [c.model_shards for c in state.layout.chunks if c.model_shards] == [2]
  x = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32)
  loss = lambda p, b: (model.apply({"params": p}, b["x"]) ** 2).mean()
  state, metrics = zerojax.train_step(loss)(state, {"x": x})
  plain = linen.meta.unbox(ns["params"])
  grads = jax.grad(loss)(plain, {"x": x})
  tx = optax.adam(1e-3)
  updates, _ = tx.update(grads, tx.init(plain), plain)

  def close(a, b, g):
    # Adam's first step is lr * g / (|g| + eps): where a gradient cancels
    # to ~1e-4 of its weight's typical one, the order of the sum (model
    # parallel here, not on one device) decides its last bits, and Adam
    # scales them up to the step. There only the step's size is checked.
    a, b, g = map(np.asarray, (a, b, g))
    tiny = np.abs(g) < 1e-3 * np.median(np.abs(g))
    np.testing.assert_allclose(a[~tiny], b[~tiny], rtol=1e-5, atol=1e-7)
    assert tiny.mean() < 0.01 and np.all(np.abs(a - b)[tiny] <= 1e-3)

  jax.tree_util.tree_map(close, zerojax.gather_params(state),
                         optax.apply_updates(plain, updates), grads)


def test_quantized_block_sends_int8_and_int4(quick_start):
  model, params = quick_start["model"], quick_start["params"]
  ns = _run(_block('state = zerojax.shard(state, stage=3, precision="bfloat16",'),
            state=train_state.TrainState.create(
                apply_fn=model.apply, params=params, tx=optax.adamw(1e-3)))
  state = ns["state"]
  assert (state.config.quantize_weights, state.config.quantize_grads) == (
      "int8", "int4")
  loss_fn = lambda p, b: optax.softmax_cross_entropy_with_integer_labels(
      model.apply({"params": p}, b["tokens"]), b["targets"]).mean()
  state, metrics = zerojax.train_step(loss_fn)(state, quick_start["batch"])
  assert np.isfinite(float(metrics["loss"]))


class _HiddenLM(linen.Module):
  """A tied-embedding LM that returns its hidden states (the head is the
  loss's), its embedding named as GPT-2's."""

  @linen.compact
  def __call__(self, tokens):
    x = linen.Embed(64, 16, name="wte")(tokens)
    return linen.LayerNorm()(linen.Dense(16)(x))


def test_linear_cross_entropy_block_is_optax_on_the_logits():
  model = _HiddenLM()
  batch = lm_batches(64, batch=8, seq=8, steps=1)[0]
  params = model.init(jax.random.key(0), batch["tokens"])["params"]
  loss_fn = _run(_block("def loss_fn(params, batch):\n  hidden"),
                 model=model)["loss_fn"]
  logits = model.apply({"params": params}, batch["tokens"]) @ (
      params["wte"]["embedding"].T)
  want = optax.softmax_cross_entropy_with_integer_labels(
      logits, batch["targets"]).mean()
  np.testing.assert_allclose(loss_fn(params, batch), want, rtol=1e-6)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3)
  _, metrics = zerojax.train_step(loss_fn)(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


def test_blocked_embed_block_trains_a_tied_lm_at_stage_3():
  vocab, width = 600, 16
  batch = lm_batches(vocab, batch=8, seq=8, steps=1)[0]
  ns = _run(_block("class TiedLM(nn.Module):"), vocab=vocab, width=width,
            tokens=batch["tokens"][:1], targets=batch["targets"][:1])
  state, step = ns["state"], ns["step"]
  assert step.gathering(state, batch)["wte"] == "per layer"
  params = ns["params"]
  table = zerojax.nn.BlockedEmbed.table(params["wte"]["embedding"], vocab)
  x = table[batch["tokens"]] @ params["Dense_0"]["kernel"] + (
      params["Dense_0"]["bias"])
  mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
  x = (x - mean) / np.sqrt(var + 1e-6) * params["LayerNorm_0"]["scale"] + (
      params["LayerNorm_0"]["bias"])
  want = optax.softmax_cross_entropy_with_integer_labels(
      x @ table.T, batch["targets"]).mean()
  _, metrics = step(state, batch)
  np.testing.assert_allclose(float(metrics["loss"]), want, rtol=1e-5)


def test_weighted_loss_block_trains_on_the_token_mean(quick_start):
  model = quick_start["model"]

  def token_losses(params, batch):
    logits = model.apply({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch["targets"])

  ns = _run(_block("def loss_fn(params, batch):\n  l = token_losses"),
            token_losses=token_losses)
  batch = dict(quick_start["loader"][0])
  batch["mask"] = (np.arange(model.seq)[None] < np.arange(16)[:, None] % 5 + 1
                   ).astype(np.float32)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=quick_start["params"], tx=optax.sgd(0.1)),
      stage=3)
  _, metrics = ns["step"](state, batch)
  l = token_losses(quick_start["params"], batch)
  want = (l * batch["mask"]).sum() / batch["mask"].sum()
  np.testing.assert_allclose(float(metrics["loss"]), float(want), rtol=1e-5)
  assert float(metrics["weight"]) == batch["mask"].sum()


def test_deepspeed_block_converts_and_shards(quick_start):
  ns = _run(_block('ds = {"zero_optimization"'), model=quick_start["model"],
            params=quick_start["params"])
  assert ns["state"].config.stage == 2 and ns["state"].config.offload_optimizer
  assert ns["lightning"].config.stage == 3


def test_stage_3_blocks_of_the_guide_find_and_gather_the_blocks():
  from models import Block
  example = np.ones((2, 8, 32), np.float32)
  ns = _run(_block("class Model(nn.Module):"), Block=Block, n_layers=4,
            example=example, tx=optax.sgd(0.1))
  layout = ns["state"].layout
  assert {c.stack for c in layout.chunks} >= {f"blocks_{i}" for i in range(4)}
  ns = _run(_block("Layer = zerojax.nn.layerwise(Block)"), Block=Block,
            n_layers=3)
  model = ns["Scanned"]()
  params = model.init(jax.random.key(0), example)["params"]
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), stage=3,
      blocks=zerojax.Blocks(stacked=("blocks",)))
  step = zerojax.train_step(lambda p, b: (model.apply({"params": p}, b["x"])
                                          ** 2).mean())
  _, metrics = step(state, {"x": np.ones((8, 8, 32), np.float32)})
  assert np.isfinite(float(metrics["loss"]))


def test_configuration_block_gives_the_groups_it_names(quick_start):
  model, params = quick_start["model"], quick_start["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adamw(1e-3))
  ns = _run(_block('state = zerojax.shard(state, stage=3, precision="bf16", '
                   'offload="host",'), state=state)
  config = ns["state"].config
  assert config.stage == 3 and config.precision.compute == jax.numpy.bfloat16
  assert config.offload == zerojax.Offload("host")
  assert config.quantize == zerojax.Quantize(weights="int8")


@pytest.mark.slow
def test_the_gpu_target_block_compiles_and_plans_for_64_gpus():
  """docs/stage3.md's `GpuTarget` block, on a small model (jax's CUDA
  plugin needed: tests/test_gpu_compiled.py)."""
  import jax.numpy as jnp
  from test_gpu_compiled import WIDTH, _abstract_state, needs_plugin
  if needs_plugin.args[0]:
    pytest.skip(needs_plugin.kwargs["reason"])
  abstract, loss_fn = _abstract_state()
  rows = 8 * 64
  batch = {"x": jax.ShapeDtypeStruct((rows, WIDTH), jnp.bfloat16),
           "y": jax.ShapeDtypeStruct((rows, 1), jnp.bfloat16)}
  out = _run(_block('target = zerojax.GpuTarget("h100", hosts=8)'),
             make_train_state=lambda: abstract, loss_fn=loss_fn,
             step=zerojax.train_step(loss_fn), batch=batch)
  assert out["model"].time > 0 and out["state"].mesh.size == 64
  assert out["plan"].chosen.fields["stage"] in (0, 1, 2, 3)


def test_multinode_block_runs_as_one_process():
  """docs/multinode.md's several-hosts loop, here as one process (its
  `jax.distributed.initialize()` a no-op: one process is the whole job)."""
  import types
  model = Transformer()
  loader = lm_batches(model.vocab, batch=16, seq=model.seq, steps=2)
  params = model.init(jax.random.key(0), loader[0]["tokens"][:1])["params"]
  one_process = types.SimpleNamespace(**{
      **vars(jax), "distributed": types.SimpleNamespace(
          initialize=lambda: None)})
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-3))

  def loss_fn(p, b):
    logits = model.apply({"params": p}, b["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, b["targets"]).mean()

  ns = _run(_block("jax.distributed.initialize()"), jax=one_process,
            state=state, loss_fn=loss_fn, my_rows_of_each_batch=loader)
  assert int(ns["state"].step) == 2
