"""The operator's log as a person reads it: kopf's lines that mislead a newcomer are reworded or quietened.

One filter on the root logger's handlers (kopf logs through many loggers and adapters, and a filter on a logger
misses records of its children):
- a request kopf retries after a 429 (the API server's "storage is (re)initializing" while it starts) is INFO,
  not ERROR: nothing failed yet; one that kopf gives up on stays ERROR;
- "Pausing operations in favour of [...]" becomes a WARNING that says why this operator does nothing and how to
  make it act (another operator of higher peering priority, usually the Helm chart's, is running);
- successful runs of the owned-object handler and the liveness probe's access log lines are dropped: they
  come every few seconds and say nothing.
"""

from __future__ import annotations

import logging

_PAUSE_HINT = (
    "this operator pauses: an operator of higher peering priority acts for the same peering object (the Helm "
    "chart's runs with peering.priority 100); stop that one (helm uninstall) to let this one act, or stop this one"
)


class OperatorLogFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # Every handler sees the same record: decide once (a reworded record no longer looks like the original).
        if (keep := getattr(record, "_kvpilot_keep", None)) is None:
            keep = record._kvpilot_keep = self._decide(record)
        return keep

    @staticmethod
    def _decide(record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if record.name == "aiohttp.access" and "/healthz" in msg:
            return False
        if msg.startswith("Handler 'owned_changed'") and msg.endswith("succeeded."):
            return False
        if record.levelno == logging.ERROR and "will retry" in msg and "TooManyRequests" in msg:
            return _reword(record, logging.INFO, msg)
        if msg.startswith("Pausing operations in favour of"):
            peers = msg.removeprefix("Pausing operations in favour of ")
            return _reword(record, logging.WARNING, f"{_PAUSE_HINT}; peers: {peers}")
        return True


def _reword(record: logging.LogRecord, level: int, msg: str) -> bool:
    """Give the record a new level and text; False (drop it) when the new level is below the log's level."""
    record.levelno, record.levelname = level, logging.getLevelName(level)
    record.msg, record.args = msg, None
    return level >= logging.getLogger().getEffectiveLevel()


def install() -> None:
    """Attach the filter to every handler of the root logger (after logging is configured)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, OperatorLogFilter) for f in handler.filters):
            handler.addFilter(OperatorLogFilter())
