"""A test whose pytest-xdist worker crashed is run once more, on the worker
xdist starts in its place; the crash's report is kept as `rerun after a
crash`, and a second crash of the same test fails it.

Why: XLA's CPU runtime has crashed a worker twice in CI, each time in a
different test that passes on its own (a segmentation fault in the C++
runtime, the worker's Python frames idle in execnet; jax-ml/jax#28908 is an
open report of the like). A crash fails the whole run on one test's bad
luck; an ordinary failure is never run again, and a test that crashes twice
still fails. The worker's own report of the crash (faulthandler's
traceback of every thread) stays in the log above the summary.

tests/conftest.py takes these hooks in; tests/test_crash_rerun.py runs them
on tests that crash.
"""
import pytest

RERUN = "rerun after a crash"
_crashed: set[str] = set()


def pytest_handlecrashitem(crashitem, report, sched):
  """xdist's hook for the test `crashitem` that crashed its worker: the
  first time, the test is scheduled again and `report` marked `RERUN`."""
  if crashitem in _crashed:
    return
  _crashed.add(crashitem)
  sched.mark_test_pending(crashitem)
  report.outcome = RERUN


def pytest_report_teststatus(report, config):
  """How a `RERUN` report is shown: `R` in the progress line, counted in
  the summary as `rerun after a crash`."""
  if report.outcome == RERUN:
    return RERUN, "R", ("RERUN", {"yellow": True})
  return None
