"""`kvpilot_build_info{version}`: one series valued 1, exposed by the daemon, the operator and the router,
so dashboards can show which version each process runs and alerts can join on it."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge

from kvpilot import __version__


def register_build_info(registry: CollectorRegistry) -> None:
    Gauge(
        "kvpilot_build_info", "kvpilot version of this process (always 1).", ["version"], registry=registry
    ).labels(__version__).set(1)
