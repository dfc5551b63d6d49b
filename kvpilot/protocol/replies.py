"""JSON replies of the daemon and the router: the body ends with a newline, so `curl -s` output ends its line
instead of running into the shell prompt. Server-sent events keep their own framing (`data: ...\n\n`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from aiohttp import web


def _dumps_line(body: Any) -> str:
    return json.dumps(body) + "\n"


def json_response(body: Any, *, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers, dumps=_dumps_line)
