"""Run the operator: `kvpilot operator` or `python -m kvpilot.operator.main`."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

import kopf


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", "--namespace", action="append", default=[],
                   help="watch only this namespace (repeatable; default: all namespaces)")  # fmt: skip
    p.add_argument("--standalone", action="store_true",
                   help="no peering: for a single replica (two standalone replicas would both act)")  # fmt: skip
    p.add_argument("--peering", default="kvpilot",
                   help="kopf peering object shared by the replicas; only the highest priority acts")  # fmt: skip
    p.add_argument("--priority", type=int, default=0, help="peering priority of this replica (default 0)")
    p.add_argument("--liveness-port", type=int, default=8080, help="port of GET /healthz (default 8080)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus metrics port (default 9090)")
    p.add_argument("--bind", default="0.0.0.0", help="address of the liveness and metrics servers")


class _QuietSuccess(logging.Filter):
    """kopf logs every successful timer and event handler run at INFO; keep the log for what changed."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not (
            msg.startswith(("Timer 'fleet_resync'", "Handler 'owned_changed'")) and msg.endswith("succeeded.")
        )


def run(args: argparse.Namespace) -> int:
    from kvpilot.operator import handlers, metrics  # noqa: F401 - importing registers the handlers

    logging.getLogger("kopf.objects").addFilter(_QuietSuccess())

    metrics.serve(args.metrics_port, args.bind)
    asyncio.run(
        kopf.operator(
            clusterwide=not args.namespace,
            namespaces=args.namespace,
            standalone=args.standalone,
            priority=args.priority,
            peering_name=None if args.standalone else args.peering,
            liveness_endpoint=f"http://{args.bind}:{args.liveness_port}/healthz",
        )
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvpilot operator", description=__doc__)
    add_arguments(p)
    p.add_argument("--log-level", default="INFO")
    args = p.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args)


if __name__ == "__main__":
    raise SystemExit(main())
