"""The examples refuse a bad command line before they build anything,
naming the flag and the fix. Run in this process: the checks read only the
flags and the devices (8 here, as the examples simulate by default), so no
subprocess is needed (tests/test_example.py starts the examples as a user
does)."""
import os
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _example(name: str):
  """examples/`name`.py as a module."""
  sys.path.insert(0, str(EXAMPLES))
  try:
    return __import__(name)
  finally:
    sys.path.remove(str(EXAMPLES))


@pytest.mark.parametrize("flags,message", [
    ("--mesh replica=2", "needs replica=R,data=D with R x D = 8"),
    ("--mesh replica=3,data=4", "needs replica=R,data=D with R x D = 8"),
    ("--mesh replica=two,data=4", "write it as replica=R,data=D"),
    ("--hpz", "--hpz shards the state over the replica axis too"),
    ("--quantize-block=0", "--quantize-block must be positive, got 0"),
    ("--update-on=host", "--update-on host runs the update where --offload"),
    ("--offload=disk", "--offload disk keeps the optimizer state in files"),
    ("--offload-dir=/tmp", "--offload-dir is where --offload disk keeps"),
    ("--sub-group-size=64", "--sub-group-size sets how --offload disk"),
    ("--tp=3", "--tp 3 does not divide the 8 devices"),
    ("--tp=8", "--tp 8 does not divide the 4 heads"),
    ("--tp=0", "--tp must be positive, got 0"),
    ("--embed-blocks=-1", "--embed-blocks must be 0 (nn.Embed) or a number"),
    ("--embed-blocks=300", "--embed-blocks 300 is more than the 256 words"),
    ("--attention=cudnn", "--attention cudnn needs an NVIDIA GPU"),
    ("--tp=2 --mesh=replica=2,data=4",
     "needs replica=R,data=D with R x D = 4 devices (8 / --tp 2)"),
])
def test_a_bad_gpt2_flag_exits_with_the_fix(monkeypatch, capsys, flags,
                                            message):
  # (main asks XLA for the example's devices: too late here, and undone)
  monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
  with pytest.raises(SystemExit) as exit:
    _example("gpt2_medium").main(["--preset", "tiny", "--steps", "1",
                                  *flags.split()])
  assert exit.value.code != 0
  said = f"{exit.value.code}{capsys.readouterr().err}"
  assert message in said, said


@pytest.mark.parametrize("argv,message", [
    (["--rank", "0"], "--rank must be positive, got 0"),
    (["--base-steps", "-1"], "--base-steps must be positive, got -1"),
])
def test_the_lora_example_refuses_counts_below_one(capsys, argv, message):
  with pytest.raises(SystemExit):
    _example("finetune_lora").parse_args(argv)
  assert message in capsys.readouterr().err


def test_the_lora_example_refuses_a_text_with_no_usable_line(tmp_path):
  text = tmp_path / "one_byte_lines.txt"
  text.write_bytes(b"a\n\nb\n")
  with pytest.raises(SystemExit, match="has no line of two bytes or more"):
    _example("finetune_lora").PaddedBatches(256, 4, 8, 0, text=str(text))


def test_every_flag_of_the_examples_says_what_it_does(monkeypatch):
  import argparse
  said = []
  add = argparse.ArgumentParser.add_argument

  def recording(self, *names, **options):
    said.append((names, options.get("help")))
    return add(self, *names, **options)
  monkeypatch.setattr(argparse.ArgumentParser, "add_argument", recording)
  _example("gpt2_flags").parse_args([])
  _example("finetune_lora").parse_args([])
  flags = [names for names, _ in said if names != ("-h", "--help")]
  assert len(flags) > 30
  assert [names for names, text in said if not text] == []
