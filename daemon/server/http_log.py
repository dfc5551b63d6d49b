"""aiohttp logs a request it cannot parse as an ERROR with a traceback. Such a request is the client's
doing and was answered 400: SGLang's router, for one, opens each worker with an HTTP/2 prior-knowledge
probe (`PRI * HTTP/2.0`) and falls back to HTTP/1.1. One line at INFO says it instead."""

from __future__ import annotations

import logging

from aiohttp.http_exceptions import HttpProcessingError


class UnparsableRequestFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, HttpProcessingError):
            reason = (exc.message or type(exc).__name__).strip().splitlines()[0][:200]
            record.msg = f"{record.getMessage()}: refused with 400 ({reason})"
            record.args = ()
            record.exc_info = record.exc_text = None
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


def install() -> None:
    logger = logging.getLogger("aiohttp.server")
    if not any(isinstance(f, UnparsableRequestFilter) for f in logger.filters):
        logger.addFilter(UnparsableRequestFilter())
