"""DeepSpeed configurations and Lightning strategy names read as they are:
every key mapped, a no-op with its reason, or refused naming it; training
with a converted configuration equals the same configuration by hand."""
import json
import math
import os

import jax
import numpy as np
import optax
import pytest
from flax.training import train_state

import zerojax
from zerojax import ZeroConfig, deepspeed
from models import make_problem, zero_run

# DeepSpeed's ZeRO tutorial configuration (stage 2, CPU offload)
TUTORIAL = {
    "train_micro_batch_size_per_gpu": 4,
    "zero_optimization": {
        "stage": 2,
        "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "allgather_partitions": True,
        "allgather_bucket_size": 2e8,
        "overlap_comm": True,
        "reduce_scatter": True,
        "reduce_bucket_size": 2e8,
        "contiguous_gradients": True,
    },
    "optimizer": {"type": "OneBitAdam",
                  "params": {"lr": 0.001, "betas": [0.8, 0.999], "eps": 1e-8,
                             "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 0.001,
                             "warmup_num_steps": 1000}},
}


def _fields(cfg: ZeroConfig, names) -> dict:
  return {n: getattr(cfg, n) for n in names}


def test_the_tutorial_converts_with_one_refusal(tmp_path):
  path = tmp_path / "ds_config.json"
  path.write_text(json.dumps(TUTORIAL))
  cfg = ZeroConfig.from_deepspeed(str(path))
  assert _fields(cfg, ("stage", "offload_optimizer", "prefetch",
                       "chunk_size")) == {"stage": 2, "offload_optimizer": True,
                                          "prefetch": True, "chunk_size": None}
  with pytest.raises(ValueError, match=r"optimizer type 'OneBitAdam' is "
                     r"refused: .*use Adam or AdamW"):
    deepspeed.optimizer(TUTORIAL)
  adam = {**TUTORIAL, "optimizer": {**TUTORIAL["optimizer"], "type": "Adam"}}
  tx = deepspeed.optimizer(adam)
  # DeepSpeed's "Adam" decouples weight decay (AdamW) by default
  want = optax.adamw(lambda c: 0.001 * np.log(c + 1.0) / math.log(1000),
                     0.8, 0.999, 1e-8, weight_decay=3e-7)
  params = {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
  grads = {"w": np.linspace(0.5, -0.5, 6, dtype=np.float32)}
  got_state, want_state = tx.init(params), want.init(params)
  for _ in range(3):
    got, got_state = tx.update(grads, got_state, params)
    ref, want_state = want.update(grads, want_state, params)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-6)


@pytest.mark.parametrize("name,fields", [
    ("deepspeed_stage_1", dict(stage=1, offload_optimizer=False)),
    ("deepspeed_stage_2", dict(stage=2, offload_optimizer=False)),
    ("deepspeed_stage_2_offload", dict(stage=2, offload_optimizer=True,
                                       offload_params=False)),
    ("deepspeed_stage_3", dict(stage=3, offload_optimizer=False)),
    ("deepspeed_stage_3_offload", dict(stage=3, offload_optimizer=True,
                                       offload_params=True)),
])
def test_each_lightning_strategy_is_its_deepspeed_configuration(name, fields):
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.1))
  state = zerojax.shard_shape(plain, strategy=name)
  assert _fields(state.config, fields) == fields


def test_the_nvme_strategy_puts_the_optimizer_on_disk(tmp_path, caplog):
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(0.1))
  with caplog.at_level("WARNING", logger="zerojax"):
    state = zerojax.shard_shape(plain, strategy="deepspeed_stage_3_offload_nvme",
                                offload=zerojax.Offload("disk", dir=str(tmp_path),
                                                        params=True))
  assert _fields(state.config, ("stage", "offload_optimizer", "offload_params",
                                "offload_dir")) == {
      "stage": 3, "offload_optimizer": "disk", "offload_params": True,
      "offload_dir": str(tmp_path)}
  assert "parameters go to host memory" in caplog.text


@pytest.mark.parametrize("config,match", [
    ({"zero_optimization": {"stage": 2, "mics_shard_size": 8}},
     r"DeepSpeed key zero_optimization.mics_shard_size has no zerojax "
     r"equivalent"),
    ({"train_batch_size": 32, "pipeline_parallel": {}},
     r"DeepSpeed key pipeline_parallel has no zerojax equivalent"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     r"offload_optimizer.device='gpu'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}},
     r"offload_param.device='cpu' needs zero_optimization.stage 3"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}},
     r"reduce_scatter=False .* no zerojax equivalent"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     r"DeepSpeed key fp16.fp16_master_weights_and_grads"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     r"train_batch_size=30, train_micro_batch_size_per_gpu=4 and "
     r"gradient_accumulation_steps=1 disagree on 8 devices"),
], ids=["zero key", "top key", "device", "param stage", "reduce_scatter",
        "fp16 key", "batch"])
def test_a_key_without_equivalent_is_refused_naming_it(config, match):
  with pytest.raises(ValueError, match=match):
    ZeroConfig.from_deepspeed(config)


def test_precision_clipping_accumulation_and_communication_map():
  cfg = ZeroConfig.from_deepspeed({
      "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
               "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 2},
      "gradient_clipping": 1.0, "gradient_accumulation_steps": 4,
      "communication_data_type": "bf16", "train_batch_size": 256,
      "train_micro_batch_size_per_gpu": 8,
      "zero_optimization": {"stage": 3, "zero_quantized_weights": True,
                            "zero_quantized_gradients": True,
                            "reduce_bucket_size": 500000}})
  assert cfg.loss_scale == zerojax.DynamicLossScale(
      init_scale=4096.0, growth_interval=500, min_scale=2.0)
  assert _fields(cfg, ("compute_dtype", "clip_norm", "accum_steps",
                       "reduce_dtype", "quantize_weights", "quantize_grads",
                       "chunk_size")) == {
      "compute_dtype": np.dtype("float16"), "clip_norm": 1.0, "accum_steps": 4,
      "reduce_dtype": np.dtype(jax.numpy.bfloat16), "quantize_weights": "int8",
      "quantize_grads": "int4", "chunk_size": 500000}
  assert ZeroConfig.from_deepspeed({"bf16": {"enabled": True}}).compute_dtype == (
      np.dtype(jax.numpy.bfloat16))
  assert ZeroConfig.from_deepspeed({"gradient_accumulation_steps": "auto"},
                                   accum_steps=3).accum_steps == 3


def test_schedules_follow_deepspeeds_formulas():
  def at(scheduler, counts, lr=1.0):
    tx_lr = deepspeed._optimizer._schedule(scheduler, lr)
    return [float(tx_lr(c)) for c in counts]

  warm = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.1,
                                         "warmup_max_lr": 0.5,
                                         "warmup_num_steps": 100}}
  # log warm-up: log(t + 1) / log(100) is 0, 1/2, then 1
  np.testing.assert_allclose(at(warm, [0, 9, 99, 500]), [0.1, 0.3, 0.5, 0.5],
                             rtol=1e-6)
  warm["params"]["warmup_type"] = "linear"
  np.testing.assert_allclose(at(warm, [0, 50, 100]), [0.1, 0.3, 0.5], rtol=1e-6)
  decay = {"type": "WarmupDecayLR", "params": {
      "warmup_max_lr": 1.0, "warmup_num_steps": 100, "total_num_steps": 200}}
  np.testing.assert_allclose(at(decay, [150, 200, 300]), [0.5, 0.0, 0.0],
                             atol=1e-7)
  cosine = {"type": "WarmupCosineLR", "params": {
      "warmup_num_steps": 100, "total_num_steps": 300, "cos_min_ratio": 0.2,
      "warmup_type": "linear"}}
  # half-way through the decay the cosine is 0: ratio 0.2 + 0.8 / 2
  np.testing.assert_allclose(at(cosine, [50, 199, 299], lr=2.0),
                             [1.0, 2 * 0.6, 2 * 0.2], rtol=1e-5)
  with pytest.raises(ValueError, match=r"scheduler type 'OneCycle' is not "
                     r"mapped"):
    at({"type": "OneCycle"}, [0])


def test_adam_without_w_mode_is_l2_and_sgd_and_lion_map():
  params = {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
  grads = {"w": np.linspace(0.5, -0.5, 6, dtype=np.float32)}

  def same(ds_optimizer, want):
    tx = deepspeed.optimizer({"optimizer": ds_optimizer})
    got, _ = tx.update(grads, tx.init(params), params)
    ref, _ = want.update(grads, want.init(params), params)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-6)

  same({"type": "Adam", "params": {"lr": 0.01, "weight_decay": 0.1,
                                   "adam_w_mode": False}},
       optax.chain(optax.add_decayed_weights(0.1), optax.adam(0.01)))
  same({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9,
                                  "weight_decay": 0.01, "nesterov": True}},
       optax.chain(optax.add_decayed_weights(0.01),
                   optax.sgd(0.1, 0.9, nesterov=True)))
  same({"type": "Lion", "params": {"lr": 1e-4, "weight_decay": 0.1}},
       optax.lion(1e-4, weight_decay=0.1))
  with pytest.raises(ValueError, match=r"'Lamb' is refused: DeepSpeed's Lamb "
                     r"clamps its trust ratio"):
    deepspeed.optimizer({"optimizer": {"type": "Lamb"}})


@pytest.mark.slow
def test_training_with_a_converted_config_equals_it_by_hand():
  model, params, loss_fn, batches = make_problem("transformer", steps=3)
  ds = {**TUTORIAL, "optimizer": {**TUTORIAL["optimizer"], "type": "AdamW"},
        "gradient_clipping": 1.0, "gradient_accumulation_steps": 2}
  del ds["train_micro_batch_size_per_gpu"]
  by_ds = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=deepspeed.optimizer(ds)),
      config=ZeroConfig.from_deepspeed(ds))
  # the schedule's formula is checked above; here the configuration
  schedule = deepspeed._optimizer._schedule(ds["scheduler"], 0.001)
  by_hand = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params,
      tx=optax.adamw(schedule, 0.8, 0.999, 1e-8, weight_decay=3e-7)),
      stage=2, offload="host", blocks=zerojax.Blocks(prefetch=True), clip_norm=1.0,
      accum_steps=2)
  a, a_losses = zero_run(by_ds, loss_fn, batches)
  b, b_losses = zero_run(by_hand, loss_fn, batches)
  np.testing.assert_array_equal(a_losses, b_losses)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         zerojax.gather_params(a), zerojax.gather_params(b))


def test_config_and_strategy_entry_errors():
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.1))
  with pytest.raises(ValueError, match=r"strategy='ddp' is not one of "
                     r"Lightning's or accelerate's strategy names .*fsdp"):
    zerojax.shard_shape(plain, strategy="ddp")
  with pytest.raises(TypeError, match="config= or strategy=, not both"):
    zerojax.shard_shape(plain, config=ZeroConfig(), strategy="deepspeed")
  with pytest.raises(ValueError, match=r"stage=3 contradicts the strategy's "
                     r"stage 2"):
    zerojax.shard_shape(plain, stage=3, strategy="deepspeed_stage_2")
  with pytest.raises(TypeError, match=r"config=\{\} must be a ZeroConfig"):
    zerojax.shard_shape(plain, config={})


def test_the_docs_table_names_every_key():
  """Each no-op by its dotted key, with its reason; each mapped key in its
  section's table (by name); each strategy."""
  doc = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs",
                          "deepspeed.md")).read()
  missing = [f"{w}{k}" for w, section in deepspeed.NO_OPS.items()
             for k, why in section.items()
             if f"| `{w}{k}` | {why} |" not in doc]
  missing += [f"{w}{k}" for w, keys in deepspeed.MAPPED.items() for k in keys
              if k not in doc]
  missing += [k for k in deepspeed.STRATEGIES if f"`{k}`" not in doc]
  assert not missing, missing


# ---- real-world-shaped configurations (tests/fixtures/deepspeed/, written
# for these tests): each maps to what DeepSpeed would run, stated here, or
# is refused naming the key

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "deepspeed")


def _fixture(name: str) -> str:
  return os.path.join(FIXTURES, name)


def _updates_agree(tx, want, counts, params=None):
  """`tx` and `want` give the same update at each optax count in `counts`
  (the counts set in a fresh state: the schedules compared far out)."""
  params = params or {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
  grads = {"w": np.linspace(0.5, -0.5, 6, dtype=np.float32)}
  for c in counts:
    got, _ = tx.update(grads, optax.tree_utils.tree_set(
        tx.init(params), count=np.int32(c)), params)
    ref, _ = want.update(grads, optax.tree_utils.tree_set(
        want.init(params), count=np.int32(c)), params)
    np.testing.assert_allclose(got["w"], ref["w"], rtol=1e-6, err_msg=str(c))


def test_a_trainer_config_of_autos_takes_the_callers_values():
  """Hugging Face's zero3 template: every value "auto". Unfilled, each is
  refused naming the argument that fills it (was: fp32, no clipping, lr
  1e-3, and WarmupDecayLR's lr 0 after the warm-up); filled, it is the
  Trainer's run: AdamW(lr, betas, eps, wd), lr 0 -> lr over the warm-up
  (log), then linearly to 0 at total_steps."""
  path = _fixture("hf_trainer_zero3_auto.json")
  with pytest.raises(ValueError, match=r"fp16.enabled \(pass precision=\); "
                     r"bf16.enabled \(pass precision=\); "
                     r"gradient_accumulation_steps \(pass accum_steps=\); "
                     r"gradient_clipping \(pass clip_norm=\)"):
    ZeroConfig.from_deepspeed(path)
  cfg = ZeroConfig.from_deepspeed(path, precision="bf16", accum_steps=2,
                                  clip_norm=1.0)
  assert _fields(cfg, ("stage", "offload_optimizer", "offload_params",
                       "compute_dtype", "accum_steps", "clip_norm", "prefetch",
                       "chunk_size", "train_batch_size", "loss_scale")) == {
      "stage": 3, "offload_optimizer": True, "offload_params": True,
      "compute_dtype": np.dtype(jax.numpy.bfloat16), "accum_steps": 2,
      "clip_norm": 1.0, "prefetch": True, "chunk_size": None,
      "train_batch_size": None, "loss_scale": None}
  with pytest.raises(ValueError, match=r"optimizer.params.lr \(pass lr=\); "
                     r".*scheduler.params.total_num_steps \(pass "
                     r"total_steps=\)"):
    deepspeed.optimizer(path)
  tx = deepspeed.optimizer(path, lr=1e-4, betas=(0.9, 0.95), eps=1e-6,
                           weight_decay=0.01, warmup_steps=10,
                           total_steps=100)

  def schedule(t):
    rising = jax.numpy.log(t + 1.0) / math.log(10)
    return 1e-4 * jax.numpy.where(t < 10, rising,
                                  jax.numpy.maximum(0.0, (100 - t) / 90))
  _updates_agree(tx, optax.adamw(schedule, 0.9, 0.95, 1e-6,
                                 weight_decay=0.01), [0, 5, 50, 99, 150])
  with pytest.raises(ValueError, match=r"precision=\)"):
    ZeroConfig.from_deepspeed(path, accum_steps=2, clip_norm=1.0)


def test_accelerates_offload_template_keeps_its_lr_after_the_warm_up():
  """accelerate's zero_stage3_offload: AdamW with adam_w_mode (was refused as
  not mapped), WarmupDecayLR with total_num_steps "auto" (was: lr 0 from
  step 1000 on). DeepSpeed, with the Trainer's 3000 steps: lr rises to the
  optimizer's 5e-5 over 1000 steps, then falls linearly to 0 at 3000."""
  path = _fixture("accelerate_zero3_offload.json")
  cfg = ZeroConfig.from_deepspeed(path, clip_norm=1.0)
  assert cfg.compute_dtype == np.dtype("float16")
  assert cfg.loss_scale == zerojax.DynamicLossScale(
      init_scale=2.0 ** 16, growth_interval=1000, min_scale=1.0)
  assert (cfg.offload_optimizer, cfg.offload_params) == (True, True)
  with pytest.raises(ValueError, match=r"scheduler.params.total_num_steps "
                     r"\(pass total_steps=\)"):
    deepspeed.optimizer(path, weight_decay=0.0)
  tx = deepspeed.optimizer(path, weight_decay=0.0, total_steps=3000)

  def schedule(t):
    rising = jax.numpy.log(t + 1.0) / math.log(1000)
    return 5e-5 * jax.numpy.where(t < 1000, rising, (3000 - t) / 2000)
  _updates_agree(tx, optax.adamw(schedule, weight_decay=0.0),
                 [0, 999, 1000, 1500, 2999])
  with pytest.raises(ValueError, match=r"optimizer.params.lr=5e-05 and "
                     r"lr=0.001 disagree"):
    deepspeed.optimizer(path, lr=1e-3, weight_decay=0.0, total_steps=3000)


def test_batch_sizes_derive_the_accumulation_and_the_step_checks_the_batch():
  """bing_bert's shape: train_batch_size 4096 of micro-batches of 64 on 8
  devices; DeepSpeed derives 8 accumulation steps (was: refused)."""
  cfg = ZeroConfig.from_deepspeed(_fixture("bert_pretraining_batch.json"))
  assert (cfg.accum_steps, cfg.train_batch_size, cfg.clip_norm) == (8, 4096,
                                                                    1.0)
  with pytest.raises(ValueError, match=r"optimizer.params.bias_correction="
                     r"False is not mapped"):
    deepspeed.optimizer(_fixture("bert_pretraining_batch.json"))
  # the same rule, small: 32 = 2 x 2 x 8; the step takes 32 examples
  small = ZeroConfig.from_deepspeed({"train_batch_size": 32,
                                     "train_micro_batch_size_per_gpu": 2})
  assert small.accum_steps == 2
  model, params, loss_fn, batches = make_problem("mlp", batch=32, steps=1)
  state = zerojax.shard(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), config=small)
  step = zerojax.train_step(loss_fn)
  half = jax.tree_util.tree_map(lambda x: x[:16], batches[0])
  with pytest.raises(ValueError, match=r"the batch has 16 examples, but the "
                     r"DeepSpeed configuration's train_batch_size is 32"):
    step(state, half)
  _, metrics = step(state, batches[0])
  assert np.isfinite(float(metrics["loss"]))


def test_megatron_shapes_and_deepspeeds_own_zeros():
  """Megatron-DeepSpeed's shape: all three batch sizes (256 = 4 x 8 x 8);
  reduce_bucket_size 0 (DeepSpeed: a collective per parameter; was
  "chunk_size=0 must be positive") and gradient_clipping -1 (DeepSpeed
  clips only above 0; was "clip_norm=...")."""
  cfg = ZeroConfig.from_deepspeed(_fixture("megatron_gpt.json"))
  assert _fields(cfg, ("stage", "accum_steps", "train_batch_size",
                       "chunk_size", "clip_norm", "compute_dtype")) == {
      "stage": 1, "accum_steps": 8, "train_batch_size": 256, "chunk_size": 1,
      "clip_norm": None, "compute_dtype": np.dtype(jax.numpy.bfloat16)}
  model, params, _, _ = make_problem("mlp")
  state = zerojax.shard_shape(train_state.TrainState.create(
      apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), config=cfg)
  # one leaf per chunk: a collective per parameter
  assert len(state.layout.chunks) == len(jax.tree_util.tree_leaves(params))


def test_string_values_are_read_as_deepspeed_reads_them():
  """pydantic's reading: "false" is false (was: prefetch on), "4" is 4,
  "True" is true, "5e8" is 5e8 (too large to bind the chunk search)."""
  cfg = ZeroConfig.from_deepspeed(_fixture("string_values.json"))
  assert _fields(cfg, ("stage", "prefetch", "accum_steps", "compute_dtype",
                       "chunk_size", "train_batch_size")) == {
      "stage": 2, "prefetch": False, "accum_steps": 4,
      "compute_dtype": np.dtype(jax.numpy.bfloat16), "chunk_size": None,
      "train_batch_size": 64}


def test_param_offload_alone_keeps_the_optimizer_on_the_device():
  """offload_param without offload_optimizer: DeepSpeed keeps the optimizer
  state on the GPU (was: offloaded too). WarmupCosineLR with total =
  warm-up: at the floor after the warm-up (was: NaN)."""
  path = _fixture("param_offload_only.json")
  cfg = ZeroConfig.from_deepspeed(path)
  assert (cfg.offload_params, cfg.offload_optimizer) == (True, False)
  tx = deepspeed.optimizer(path)
  schedule = lambda t: 3e-4 * jax.numpy.where(t < 100, t / 100, 1e-4)
  _updates_agree(tx, optax.adamw(schedule, 0.9, 0.95, 1e-8, weight_decay=0.1),
                 [0, 50, 100, 101, 1000])


@pytest.mark.parametrize("config,match", [
    ({"gradient_accumulation_steps": 2.5},
     r"gradient_accumulation_steps=2.5 is not a whole number"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "nope"}},
     r"zero_optimization.overlap_comm='nope' is not a boolean"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": True}},
     r"zero_optimization.offload_optimizer=True must be a section"),
    ({"pipeline": {"stages": 2}}, r"DeepSpeed key pipeline has no zerojax "
     r"equivalent"),
    ({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 3}},
     r"zero_hpz_partition_size=3 does not divide the 8 devices"),
    ({"communication_data_type": "fp8"},
     r"communication_data_type='fp8': use one of"),
    ({"fp16": {"enabled": True, "loss_scale": "big"}},
     r"fp16.loss_scale='big' is not a number"),
    ({"zero_optimization": {"stage": "three"}},
     r"zero_optimization.stage='three' is not a ZeRO stage"),
    ({"zero_optimization": {"stage": "auto"}},
     r"left \"auto\" with nothing to fill them: zero_optimization.stage"),
    ({"zero_optimization": {"offload_optimizer": {"device": "cpu",
                                                  "ratio": 1.5}}},
     r"offload_optimizer.ratio=1.5 is the share offloaded"),
], ids=["fractional count", "boolean word", "section", "misplaced no-op",
        "hpz", "dtype", "number", "stage", "auto stage", "ratio"])
def test_each_front_door_error_names_the_key_and_its_value(config, match):
  with pytest.raises(ValueError, match=match):
    ZeroConfig.from_deepspeed(config)


@pytest.mark.parametrize("scheduler,match", [
    ({"type": "WarmupDecayLR", "params": {"warmup_num_steps": 10}},
     r"scheduler.params.total_num_steps is missing"),
    ({"type": "WarmupLR", "params": {"warmup_num_step": 10}},
     r"scheduler.params.warmup_num_step are not parameters of WarmupLR"),
    ({"type": "WarmupLR", "params": {"warmup_type": "linaer"}},
     r"scheduler.params.warmup_type='linaer': use one of 'log', 'linear'"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 0}},
     r"scheduler.params.warmup_num_steps=0 must be at least 1"),
    ({"type": "WarmupLR", "params": {"last_batch_iteration": 10}},
     r"last_batch_iteration=10: the schedule reads optax's update count"),
    ({"type": "WarmupCosineLR", "params": {"total_num_steps": "auto"}},
     r"scheduler.params.total_num_steps \(pass total_steps=\)"),
], ids=["decay without total", "misspelt key", "misspelt value", "no warm-up",
        "resumed", "auto"])
def test_scheduler_parameters_are_checked_as_strictly_as_the_optimizers(
    scheduler, match):
  with pytest.raises(ValueError, match=match):
    deepspeed.optimizer({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                         "scheduler": scheduler})


@pytest.mark.parametrize("params,match", [
    ({"betas": [0.9]}, r"optimizer.params.betas=\[0.9\] is two numbers"),
    ({"lr": "fast"}, r"optimizer.params.lr='fast' is not a number"),
    ({"adam_w_mode": "maybe"}, r"optimizer.params.adam_w_mode='maybe' is not "
     r"a boolean"),
    ({"lr": 1e-3, "foo": 1}, r"optimizer.params.foo of optimizer adam are not "
     r"mapped"),
], ids=["betas", "lr", "w mode", "unknown"])
def test_optimizer_parameters_name_the_key(params, match):
  with pytest.raises(ValueError, match=match):
    deepspeed.optimizer({"optimizer": {"type": "Adam", "params": params}})


def test_adamw_ignores_adam_w_mode_as_deepspeed_does():
  params = {"w": np.linspace(-1, 1, 6, dtype=np.float32)}
  for mode in (True, False, "false"):
    tx = deepspeed.optimizer({"optimizer": {"type": "AdamW", "params": {
        "lr": 0.01, "weight_decay": 0.1, "adam_w_mode": mode}}})
    _updates_agree(tx, optax.adamw(0.01, weight_decay=0.1), [0, 3], params)


def test_the_hpz_partition_is_checked_against_the_mesh():
  cfg = ZeroConfig.from_deepspeed({"zero_optimization": {
      "stage": 3, "zero_hpz_partition_size": 4}})
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.1))
  mesh = lambda shape: jax.sharding.Mesh(
      np.array(jax.devices()).reshape(shape), ("replica", "data"))
  assert zerojax.shard_shape(plain, config=cfg, mesh=mesh((2, 4))).config.hpz
  with pytest.raises(ValueError, match=r"zero_hpz_partition_size=4 is the "
                     r"size of the mesh's 'data' axis .* which is 2 here"):
    zerojax.shard_shape(plain, config=cfg, mesh=mesh((4, 2)))


@pytest.mark.parametrize("name,fields", [
    ("fsdp", dict(stage=3, replica_axis=None, offload_params=False)),
    ("fsdp_full_shard", dict(stage=3, replica_axis=None)),
    ("fsdp_shard_grad_op", dict(stage=2, replica_axis=None)),
    ("fsdp_cpu_offload", dict(stage=3, offload_optimizer=True,
                              offload_params=True)),
])
def test_fsdp_strategy_names_are_their_zero_stages(name, fields):
  """Lightning's and accelerate's FSDP names (was: refused)."""
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(0.1))
  state = zerojax.shard_shape(plain, strategy=name)
  assert _fields(state.config, fields) == fields


def test_hybrid_shard_is_hsdp_on_a_replica_mesh():
  model, params, _, _ = make_problem("mlp")
  plain = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(0.1))
  mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4),
                           ("replica", "data"))
  state = zerojax.shard_shape(plain, strategy="hybrid_shard", mesh=mesh)
  assert (state.config.stage, state.config.replica_axis,
          state.config.hpz) == (3, "replica", False)
  with pytest.raises(ValueError, match=r"mesh axes \('data',\) have no axis "
                     r"'replica'"):
    zerojax.shard_shape(plain, strategy="hybrid_shard")


@pytest.mark.parametrize("options,fields", [
    (dict(precision="bf16-mixed"), dict(
        compute_dtype=np.dtype(jax.numpy.bfloat16), loss_scale=None)),
    (dict(precision="16-mixed"), dict(
        compute_dtype=np.dtype("float16"),
        loss_scale=zerojax.DynamicLossScale())),
    (dict(precision="32-true"), dict(compute_dtype=np.dtype("float32"))),
    (dict(offload="cpu"), dict(offload_optimizer=True, offload_params=False)),
], ids=["bf16-mixed", "16-mixed", "32-true", "offload cpu"])
def test_spellings_users_bring_from_lightning_and_deepspeed(options, fields):
  cfg = ZeroConfig(stage=3, **options)
  assert _fields(cfg, fields) == fields


def test_true_16_bit_precision_names_where_zerojax_reads_it():
  with pytest.raises(ValueError, match=r"precision='bf16-true'.*cast them to "
                     r"bfloat16 .* precision='bf16-mixed'"):
    ZeroConfig(stage=3, precision="bf16-true")
