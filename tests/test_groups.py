"""The configuration's groups (zerojax/_options/groups.py) and ZeroConfig's options:
the short spellings, the round trip through the flat fields, and the old
flat names refused naming their new spelling. Each group's own refusals
are tested beside the feature it configures (test_offload, test_disk_tier,
test_hybrid, test_quantize, test_state)."""
import os
import re

import jax.numpy as jnp
import numpy as np
import pytest

import zerojax
from zerojax._options.config import OPTIONS, ZeroConfig
from zerojax._options.spelling import NEW_SPELLING


def test_there_are_a_dozen_options():
  assert len(OPTIONS) == 12


@pytest.mark.parametrize("short,group", [
    (dict(offload="host"), dict(offload=zerojax.Offload("host"))),
    (dict(offload="auto", device_budget=10 ** 9),
     dict(offload=zerojax.Offload("auto"), device_budget=10 ** 9)),
    (dict(precision="bf16"),
     dict(precision=zerojax.Precision(compute=jnp.bfloat16))),
    (dict(precision=jnp.float16),
     dict(precision=zerojax.Precision(
         compute="float16", loss_scale=zerojax.DynamicLossScale()))),
    (dict(quantize="int8"),
     dict(quantize=zerojax.Quantize(weights="int8", grads="int8"))),
    (dict(offload=None, quantize=None, precision=None), dict()),
])
def test_short_spellings_are_their_groups(short, group):
  assert ZeroConfig(**short) == ZeroConfig(**group)


@pytest.mark.parametrize("options", [
    dict(),
    dict(stage=2, precision="bf16", offload=zerojax.Offload(
        fraction=0.5, update_on="host")),
    dict(stage=3, offload=zerojax.Offload(optimizer=False, params=True)),
    dict(offload=zerojax.Offload("disk", dir="/tmp", sub_group_size=64),
         precision=zerojax.Precision("bf16", loss_scale=128.0)),
    dict(axes=zerojax.Axes(replica="replica", hpz=True, model="model"),
         quantize=zerojax.Quantize(weights="int4", block=64)),
    dict(blocks=zerojax.Blocks(remat="dots", prefetch=True,
                               stacked=("blocks",)),
         accum_steps=4, clip_norm=1.0, chunk_size=1024),
    dict(offload="auto", device_budget=0.5),
])
def test_options_and_fields_give_the_same_config(options):
  config = ZeroConfig(**options)
  assert ZeroConfig(**config.options()) == config
  assert ZeroConfig.from_fields(**config.fields()) == config
  for name, value in options.items():
    if isinstance(value, (zerojax.Offload, zerojax.Axes, zerojax.Quantize,
                          zerojax.Blocks)):
      assert getattr(config, name) == value


@pytest.mark.parametrize("name", sorted(NEW_SPELLING))
def test_each_old_flat_name_names_its_new_spelling(name):
  with pytest.raises(TypeError, match=re.escape(
      f"{name}= is now {NEW_SPELLING[name]}")):
    ZeroConfig(**{name: None})


def test_an_unknown_option_lists_the_options():
  with pytest.raises(TypeError, match=r"unknown option\(s\) \['offlaod'\]; "
                     "the options are stage, axes, precision, offload"):
    ZeroConfig(offlaod="host")


def test_a_group_given_to_the_wrong_option_is_named():
  with pytest.raises(TypeError, match=r"blocks=Axes\(.*\) must be a "
                     r"zerojax.Blocks"):
    ZeroConfig(blocks=zerojax.Axes())


def test_the_disk_directory_is_resolved_once(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  offload = zerojax.Offload("disk", dir="files")
  assert offload.dir == os.path.join(str(tmp_path), "files")


def test_a_config_is_hashable_static_metadata():
  one = ZeroConfig(stage=2, precision="bf16", frozen={"w": True, "b": False})
  two = ZeroConfig(stage=2, precision="bf16", frozen={"w": True, "b": False})
  assert one == two and hash(one) == hash(two)
  assert one.replace(stage=3).stage == 3 and one.stage == 2
  assert np.dtype(one.compute_dtype) == jnp.bfloat16


def test_shard_and_zeroconfig_spell_every_option():
  """An editor completes them (issue 63): every option of ZeroConfig is a
  keyword parameter of `shard` and of `ZeroConfig` itself, in one order."""
  import inspect
  from zerojax._options.config import OPTIONS
  for fn in (zerojax.shard, zerojax.ZeroConfig):
    params = inspect.signature(fn).parameters
    keyword = [n for n, p in params.items()
               if p.kind is inspect.Parameter.KEYWORD_ONLY and n in OPTIONS]
    assert keyword == [o for o in OPTIONS if o != "stage"], fn
    assert "stage" in params
  assert "help(zerojax.ZeroConfig)" in _refusal(offload_optimizer=True)


def _refusal(**options) -> str:
  with pytest.raises(TypeError) as e:
    zerojax.ZeroConfig(**options)
  return str(e.value)
