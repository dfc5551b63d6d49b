"""The `kvpilot` command line.

It only dispatches: each package owns its subcommand (daemon/server/cli.py `serve`, router/cli.py
`router`, operator/cli.py `operator`, `reset` and `endpoint`, kvpilot/cli/bench.py `bench`), an
`add_<name>_parser(subparsers)` registered in `_COMMANDS` that declares its flags (kvpilot/cli/flags.py)
and sets `handler`. Handlers import their heavy dependencies (torch, kopf, ...) lazily, so `kvpilot --help`
and the light subcommands start fast.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence

from kvpilot.cli.bench import add_bench_parser
from kvpilot.daemon.server.cli import add_serve_parser
from kvpilot.operator.cli import add_endpoint_parser, add_operator_parser, add_reset_parser
from kvpilot.operator.weights.cli import add_weights_parser
from kvpilot.router.cli import add_router_parser

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

# name -> function adding the subcommand.
_COMMANDS: dict[str, Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = {
    "serve": add_serve_parser,
    "operator": add_operator_parser,
    "reset": add_reset_parser,
    "endpoint": add_endpoint_parser,
    "bench": add_bench_parser,
    "router": add_router_parser,
    "weights": add_weights_parser,
}


def build_parser() -> argparse.ArgumentParser:
    from kvpilot import __version__

    parser = argparse.ArgumentParser(prog="kvpilot", description=__doc__.splitlines()[0], allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=LOG_LEVELS, help="log level (default INFO)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in _COMMANDS.values():
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # vLLM puts --log-level after the subcommand; accept it anywhere.
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if rest:
        leftover = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
        leftover.add_argument("--log-level", choices=LOG_LEVELS)
        extra, unknown = leftover.parse_known_args(rest)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra.log_level:
            args.log_level = extra.log_level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
