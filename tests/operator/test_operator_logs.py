"""The operator's log filter on kopf's own loggers and messages: a retried startup 429 is INFO, a pause in
favour of a higher-priority peer is a WARNING that says what to do, probes and routine successes are dropped;
and through the real operator process on the dev cluster, no access line for its probes."""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Iterator

import pytest

from kvpilot.operator import logs
from support.operator import OperatorProcess


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    root = logging.getLogger()
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    old_level, root.level = root.level, logging.INFO
    root.addHandler(handler)
    logs.install()
    logs.install()  # twice: still one filter
    assert len(handler.filters) == 1
    try:
        yield out
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)


def test_retried_429_is_info_and_escalated_stays_error(captured: io.StringIO) -> None:
    api = logging.getLogger("kopf._cogs.clients.api")
    api.error(
        "Request attempt #1/9 failed; will retry: GET https://127.0.0.1:6443/apis -> "
        "APITooManyRequestsError(429, 'storage is (re)initializing')"
    )
    api.error(
        "Request attempt #9/9 failed; escalating: GET https://127.0.0.1:6443/apis -> "
        "APITooManyRequestsError(429, 'storage is (re)initializing')"
    )
    lines = captured.getvalue().splitlines()
    assert lines[0].startswith("INFO kopf._cogs.clients.api: Request attempt #1/9 failed; will retry"), lines
    assert lines[1].startswith("ERROR kopf._cogs.clients.api: Request attempt #9/9 failed; escalating"), lines


def test_pause_for_a_higher_priority_peer_is_a_warning_that_names_it(captured: io.StringIO) -> None:
    logging.getLogger("kopf._core.engines.peering").info(
        "Pausing operations in favour of [Peer(identity='kvpilot-operator-7d9f@10.244.1.5', priority=100)]."
    )
    line = captured.getvalue().strip()
    assert line.startswith("WARNING kopf._core.engines.peering: this operator pauses"), line
    assert "kvpilot-operator-7d9f" in line and "priority=100" in line and "helm uninstall" in line, line


def test_probes_and_routine_successes_are_dropped(captured: io.StringIO) -> None:
    logging.getLogger("aiohttp.access").info(
        '10.244.1.1 [01/Dec/2026:07:00:00 +0000] "GET /healthz HTTP/1.1" 200'
    )
    logging.getLogger("kopf.objects").info("Handler 'owned_changed' succeeded.")
    logging.getLogger("kopf.objects").info("Handler 'fleet_changed' succeeded.")
    assert captured.getvalue().splitlines() == ["INFO kopf.objects: Handler 'fleet_changed' succeeded."]


def test_a_quietened_line_below_the_log_level_is_dropped(captured: io.StringIO) -> None:
    logging.getLogger().setLevel(logging.WARNING)
    logging.getLogger("kopf._cogs.clients.api").error(
        "Request attempt #1/9 failed; will retry: GET /apis -> APITooManyRequestsError(429)"
    )
    assert captured.getvalue() == ""


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_the_operator_logs_no_access_line_for_probes(operator: OperatorProcess) -> None:
    """Through the real operator process (`python -m kvpilot.operator.main`): probes answered, none logged
    (aiohttp's access log would write `"GET /healthz HTTP/1.1" 200` for each)."""
    for _ in range(5):
        assert operator.healthy()
    time.sleep(1)  # the access log line is written after the reply
    lines = operator.log.read_text().splitlines()
    assert any("kvpilot operator: watching" in line for line in lines), lines
    assert not [line for line in lines if "GET /healthz HTTP" in line], lines
    # The API server's 429 while a just-made CRD's storage initializes, when it came, was retried at INFO.
    assert not [line for line in lines if " ERROR " in line and "TooManyRequests" in line], lines
