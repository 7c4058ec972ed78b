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
                                        tx=optax.sgd(0.1))
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
     r"offload_param needs stage 3"),
    ({"zero_optimization": {"stage": 2, "reduce_scatter": False}},
     r"reduce_scatter=false .* no zerojax equivalent"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}},
     r"DeepSpeed key fp16.fp16_master_weights_and_grads"),
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4},
     r"train_batch_size=30 is not train_micro_batch_size_per_gpu=4 x "
     r"gradient_accumulation_steps=1 x 8 devices"),
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
  assert ZeroConfig.from_deepspeed(
      {"gradient_accumulation_steps": "auto"}).accum_steps == 1


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
  with pytest.raises(ValueError, match=r"'Lamb' is refused: LAMB reads whole "
                     r"tensors"):
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
                     r"Lightning's DeepSpeed strategies"):
    zerojax.shard_shape(plain, strategy="ddp")
  with pytest.raises(TypeError, match="config= or strategy=, not both"):
    zerojax.shard_shape(plain, config=ZeroConfig(), strategy="deepspeed")
  with pytest.raises(ValueError, match=r"stage=3 contradicts the strategy's "
                     r"stage 2"):
    zerojax.shard_shape(plain, stage=3, strategy="deepspeed_stage_2")
  with pytest.raises(TypeError, match=r"config=\{\} must be a ZeroConfig"):
    zerojax.shard_shape(plain, config={})


def test_the_docs_table_names_every_key():
  doc = open(os.path.join(os.path.dirname(__file__), os.pardir, "docs",
                          "deepspeed.md")).read()
  keys = (set(deepspeed.NO_OPS) | set(deepspeed._ZERO_MAPPED)
          | set(deepspeed._TOP_MAPPED) | set(deepspeed.STRATEGIES))
  missing = sorted(k for k in keys if f"`{k}`" not in doc)
  assert not missing, missing
