"""zerojax's log: the logger "zerojax", whose records read
`WARNING:zerojax:<message>` under `logging.basicConfig` (or however the
caller's logging is configured), and `zerojax: <message>` on stderr where
nothing is configured: Python's own last resort would print the bare
message, naming no one. Messages are written without a "zerojax:" of
their own."""
import logging
import sys

LOG = logging.getLogger("zerojax")


class _LastResort(logging.Handler):
  """Python's `logging.lastResort`, naming zerojax: a WARNING or above is
  printed to stderr when no other handler, here or up the chain of loggers
  a record propagates to, would take it."""

  def __init__(self):
    super().__init__(logging.WARNING)

  def emit(self, record: logging.LogRecord) -> None:
    logger = LOG
    while logger is not None:
      if any(h is not self for h in logger.handlers):
        return
      logger = logger.parent if logger.propagate else None
    try:
      sys.stderr.write(f"zerojax: {self.format(record)}\n")
    except Exception:  # noqa: BLE001 - logging never raises into the caller
      self.handleError(record)


if not any(isinstance(h, _LastResort) for h in LOG.handlers):
  LOG.addHandler(_LastResort())
