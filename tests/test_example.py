"""examples/gpt2_medium.py (and finetune_lora.py) run end to end, as a user
starts them.

The example runs as a subprocess with its own environment (it sets its own
XLA_FLAGS for 8 simulated CPU devices). Most of a tiny run is compilation,
and both runs compile the same programs (same model, same batch shapes), so
they share a fresh JAX persistent compilation cache: the second run takes a
few seconds instead of half a minute.
"""
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
# starts processes (or runs for minutes): the full suite's, not the fast tier's
pytestmark = pytest.mark.slow

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "gpt2_medium.py"
STEPS = 40

PARAGRAPH = (
    "It was the best of times, it was the worst of times, it was the age of "
    "wisdom, it was the age of foolishness, it was the epoch of belief, it "
    "was the epoch of incredulity, it was the season of Light, it was the "
    "season of Darkness, it was the spring of hope, it was the winter of "
    "despair, we had everything before us, we had nothing before us.\n")


def _run(args, out, cache):
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  # (the example adds its simulated devices to conftest's compile flags)
  env.update(XLA_FLAGS=env.get("ZEROJAX_TEST_FAST_FLAGS", ""),
             JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache),
             JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
             JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0")
  cmd = [sys.executable, str(EXAMPLE), "--preset", "tiny", "--steps",
         str(STEPS), "--json", str(out), *args]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=300)
  assert proc.returncode == 0, (f"{' '.join(cmd)} failed:\n"
                                f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
  return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  tmp = tmp_path_factory.mktemp("example")
  text = tmp / "paragraph.txt"
  text.write_text(PARAGRAPH * 40)
  cache = tmp / "jax_cache"
  return {"random": _run([], tmp / "random.json", cache),
          "text": _run(["--text", str(text)], tmp / "text.json", cache)}


def _losses(result):
  return [s["loss"] for s in result["steps"]]


@pytest.mark.parametrize("name", ["random", "text"])
def test_json_has_documented_keys(runs, name):
  result = runs[name]
  assert {"config", "steps", "memory"} <= set(result)
  config = result["config"]
  for key in ("preset", "stage", "devices", "num_params", "model", "batch",
              "seq", "steps", "lr", "precision", "accum", "clip", "seed"):
    assert key in config, key
  assert config["preset"] == "tiny" and config["stage"] == 3
  assert config["devices"] == 8
  assert config["model"]["vocab"] == 256
  assert [s["step"] for s in result["steps"]] == list(range(1, STEPS + 1))
  for s in result["steps"]:
    assert set(s) == {"step", "loss", "grad_norm", "tokens_per_s", "step_time_s"}
    assert math.isfinite(s["loss"]) and s["grad_norm"] > 0
    assert s["tokens_per_s"] > 0 and s["step_time_s"] > 0
  memory = result["memory"]
  assert memory["compiled_footprint_bytes_per_device"] > 0
  # ZeRO-3 with Adam keeps 12 bytes per parameter, split over the devices
  # (plus padding of at most 7 elements per chunk row and the step counter).
  bound = 12 * config["num_params"] / config["devices"] + 4096
  assert 0 < memory["persistent_bytes_per_device"] <= bound


def test_random_tokens_loss_falls(runs):
  # Zipf-distributed tokens: from ~ln(256) = 5.55 toward their entropy 4.31.
  losses = _losses(runs["random"])
  assert abs(losses[0] - math.log(256)) < 0.3
  first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
  assert last < first - 0.5, losses
  assert last > 4.0, losses  # cannot beat the data's entropy by much


def test_text_loss_falls(runs):
  losses = _losses(runs["text"])
  first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
  assert last < first - 1.5, losses
  assert last < 3.5, losses


@pytest.mark.parametrize("hpz", [False, True], ids=["hsdp", "hpz"])
def test_hybrid_mesh_flag_trains(tmp_path, hpz):
  """`--mesh replica=2,data=4`: stage 3 shards over 4 devices, replicated
  twice (the layout of two 4-GPU nodes); with `--hpz` over all 8, gathered
  over the replicas once per step."""
  out = _run(["--mesh", "replica=2,data=4", "--steps", "3"] +
             (["--hpz"] if hpz else []),
             tmp_path / "hybrid.json", tmp_path / "cache")
  assert out["config"]["mesh_shape"] == {"replica": 2, "data": 4}
  assert out["config"]["hpz"] is hpz
  losses = [s["loss"] for s in out["steps"]]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


@pytest.mark.parametrize("flags, shape", [
    ([], {"data": 4, "model": 2}),
    (["--mesh", "replica=2,data=2", "--hpz"],
     {"replica": 2, "data": 2, "model": 2})], ids=["tp", "tp-hpz"])
def test_tensor_parallel_flag_trains(tmp_path, flags, shape):
  """`--tp 2`: heads and MLP split over a model axis of 2, ZeRO-3 over the
  other 4 devices (or over 2 nodes of 2 under hpZ); the report states the
  split."""
  out = _run(["--tp", "2", "--steps", "3", *flags], tmp_path / "tp.json",
             tmp_path / "cache")
  assert out["config"]["mesh_shape"] == shape
  assert "tensor parallel: " in out["memory"]["report"]
  losses = [s["loss"] for s in out["steps"]]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_blocked_embedding_trains_as_nn_embed(runs, tmp_path):
  """`--embed-blocks 4`: the tied embedding as a BlockedEmbed (stage 3, its
  table gathered by blocks, the loss without logits) starts from the same
  values and follows nn.Embed's run (the same seed and data)."""
  out = _run(["--embed-blocks", "4"], tmp_path / "blocked.json",
             tmp_path / "cache")
  assert out["config"]["embed_blocks"] == 4
  got, want = _losses(out), _losses(runs["random"])
  # the same float32 sums in another order: AdamW (lr 3e-3) lets the
  # difference grow over the run (1.7e-4 by step 40 in one run)
  assert got[:20] == pytest.approx(want[:20], rel=1e-5)
  assert got == pytest.approx(want, rel=1e-3)


def test_offload_with_the_host_update_trains(tmp_path):
  """`--offload --update-on host`: the optimizer state in host memory,
  updated there."""
  out = _run(["--offload", "--update-on", "host", "--steps", "3"],
             tmp_path / "offload.json", tmp_path / "cache")
  assert out["config"]["offload"] and out["config"]["update_on"] == "host"
  losses = [s["loss"] for s in out["steps"]]
  assert len(losses) == 3 and all(math.isfinite(x) for x in losses)


def test_the_disk_tier_trains(tmp_path):
  """`--offload disk --offload-dir DIR`: the optimizer state in files,
  removed when the example exits."""
  live = tmp_path / "live"
  live.mkdir()
  out = _run(["--offload", "disk", "--offload-dir", str(live), "--steps",
              "2", "--sub-group-size", "4096"], tmp_path / "disk.json",
             tmp_path / "cache")
  assert out["config"]["offload"] == "disk"
  assert out["memory"]["persistent_by_kind"]["disk"] > 0
  # the run's files were there (the bytes above) and are gone at its exit
  assert not any(p.name.endswith(".bin") for p in live.iterdir())
  losses = [s["loss"] for s in out["steps"]]
  assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_the_lora_example_fine_tunes_a_pretrained_base(tmp_path):
  """examples/finetune_lora.py at the tiny preset: pretrains a base with
  gpt2_medium.py, restores it into the model with adapters, freezes the
  base and fine-tunes on padded sequences with a token-weighted loss. The
  held-out loss per token falls; each device holds an eighth of the frozen
  base (float32 on CPU) and no optimizer state for it."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=env.get("ZEROJAX_TEST_FAST_FLAGS", ""),
             JAX_PLATFORMS="cpu")
  out = tmp_path / "lora.json"
  cmd = [sys.executable, str(ROOT / "examples" / "finetune_lora.py"),
         "--preset", "tiny", "--base-steps", "20", "--steps", "30",
         "--json", str(out)]
  proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 0, f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}"
  result = json.loads(out.read_text())
  assert result["loss_after"] < result["loss_before"] - 0.3, result
  devices = result["config"]["devices"]
  frozen, trained = result["params"]["frozen"], result["params"]["trained"]
  assert trained < frozen / 4
  memory = result["memory_per_device"]
  ideal = 4 * frozen / devices
  assert ideal <= memory["frozen base"] <= 1.10 * ideal
  # Adam's two moments of the adapters only (padding: 7 elements a chunk)
  assert memory["optimizer state"] <= 8 * (trained + 64) / devices + 64
  assert "restored the base from" in proc.stdout
  assert ": 16 of 24 parameters; the 8 adapters start" in proc.stdout
  # a restore that uses every saved leaf is no warning (info level)
  assert "restored 16 of 24 parameters" not in proc.stderr


def test_two_processes_each_load_their_own_text(tmp_path):
  """The example as two processes on 127.0.0.1 (4 simulated devices each),
  each reading its own --text: its rows of the global batch."""
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env.update(XLA_FLAGS=env.get("ZEROJAX_TEST_FAST_FLAGS", ""),
             JAX_PLATFORMS="cpu")
  procs = []
  for rank, line in enumerate(PARAGRAPH.split(", it was ")[:2]):
    text = tmp_path / f"host{rank}.txt"
    text.write_text((line + "\n") * 200)   # each host its own part
    procs.append(subprocess.Popen(
        [sys.executable, str(EXAMPLE), "--preset", "tiny", "--steps", "4",
         "--devices", "4", "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", str(rank), "--text",
         str(text), "--json", str(tmp_path / f"rank{rank}.json")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True))
  outputs = []
  try:
    for p in procs:
      outputs.append(p.communicate(timeout=300)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for p, out in zip(procs, outputs):
    assert p.returncode == 0, out[-4000:]
  result = json.loads((tmp_path / "rank0.json").read_text())
  assert result["config"]["processes"] == 2
  assert result["config"]["batch"] == 16   # global: 2 rows a device, 8 devices
  assert all(math.isfinite(loss) for loss in _losses(result))
