"""tests/router's `fleet` (two daemons publishing KV events and a `kvpilot router` in front of them, on
loopback): the router whose /metrics the dashboard and alert checks read."""

from router.conftest import fleet  # noqa: F401 - the fixture, shared as is
