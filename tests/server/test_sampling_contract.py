"""The protocol's `Sampling` (what a request asks, kvpilot/protocol/requests.py) becomes the engine's
`SamplingParams` field by field (daemon/server/prepare.py, `_params_for`): a field added on one side only
would be dropped silently or refuse every request, so both name the same fields with the same types."""

from __future__ import annotations

import dataclasses
import typing

from kvpilot.daemon.engine.request import SamplingParams
from kvpilot.protocol.requests import Sampling


def test_sampling_and_sampling_params_name_the_same_fields() -> None:
    assert [f.name for f in dataclasses.fields(Sampling)] == [
        f.name for f in dataclasses.fields(SamplingParams)
    ]
    assert typing.get_type_hints(Sampling) == typing.get_type_hints(SamplingParams)
