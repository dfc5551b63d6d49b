"""How the node agent's modules speak to the API server below the typed client: reply bodies read as plain
JSON (the client's model objects cost far more than the agent's twice-a-second pod list can spare), merge
patches, and timestamps in the API's two formats."""

from __future__ import annotations

import datetime as dt
import json

MERGE = "application/merge-patch+json"


def json_of(resp) -> dict:  # noqa: ANN001 - a urllib3 response (`_preload_content=False`)
    return json.loads(resp.data)


def now() -> str:
    """A Time field: seconds."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def micro_now() -> str:
    """A MicroTime field (Lease renewTime): microseconds."""
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
