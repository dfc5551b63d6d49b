"""The OpenAI wire protocol that the daemon serves and the router proxies, in one place both import: the
request bodies (`schema`), the fields they do not model (`fields`), request parsing (`requests`), the error
shape and middleware (`errors`) and JSON replies (`replies`). Nothing here imports a part of kvpilot, so a
change to the daemon's insides cannot change what the router accepts."""

from typing import Any

# A JSON object as it crosses the wire, a body read or a reply built: its values are whatever JSON holds
# (strings, numbers, lists, objects), so they are Any. Where a field's type matters, the code reading it
# checks it (the pydantic models of `schema`, the `isinstance` checks of `requests`).
JSONObject = dict[str, Any]

# vLLM's header naming the data-parallel rank a request runs on: the daemon reads it, the router's proxy and
# endpoint picker set it to the rank they scored, and a reset's canary sends it to reach each rank.
DP_RANK_HEADER = "X-data-parallel-rank"
