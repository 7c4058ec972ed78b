"""tests/crash_rerun.py on tests that crash their pytest-xdist worker."""
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

TESTS = os.path.dirname(os.path.abspath(__file__))


def _run_pytest(tmp_path, crashes: int) -> subprocess.CompletedProcess:
  """pytest on two workers over a test that crashes its worker the first
  `crashes` times it runs, and one that passes."""
  (tmp_path / "conftest.py").write_text(
      "from crash_rerun import pytest_handlecrashitem, "
      "pytest_report_teststatus\n")
  (tmp_path / "test_crashing.py").write_text(textwrap.dedent(f"""
      import faulthandler, pathlib
      def test_crashes(tmp_path_factory):
        runs = pathlib.Path({str(tmp_path / "runs")!r})
        runs.write_text(runs.read_text() + "x" if runs.exists() else "x")
        if len(runs.read_text()) <= {crashes}:
          faulthandler._sigsegv()
      def test_passes():
        pass
      """))
  return subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-n", "2", "-p",
       "no:cacheprovider", str(tmp_path)],
      cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={**os.environ, "PYTHONPATH": TESTS})


def test_a_test_that_crashes_once_runs_again_and_passes(tmp_path):
  run = _run_pytest(tmp_path, crashes=1)
  assert run.returncode == 0, run.stdout + run.stderr
  assert "2 passed, 1 rerun after a crash" in run.stdout, run.stdout
  assert (tmp_path / "runs").read_text() == "xx"


def test_a_test_that_crashes_twice_fails(tmp_path):
  run = _run_pytest(tmp_path, crashes=2)
  assert run.returncode == 1, run.stdout + run.stderr
  assert "crashed while running 'test_crashing.py::test_crashes'" in run.stdout
  assert "1 failed, 1 passed, 1 rerun after a crash" in run.stdout, run.stdout
  assert (tmp_path / "runs").read_text() == "xx"
