"""`kvpilot serve`: the daemon's flags, generated from EngineConfig and ServerSettings, and its start."""

from __future__ import annotations

import argparse
import asyncio
import logging

from kvpilot.cli.flags import add_command, add_flags, flag_message, from_flags
from kvpilot.daemon.engine.config import EngineConfig
from kvpilot.daemon.server.settings import ServerSettings
from kvpilot.serving.http_limits import ConnectionLimits

log = logging.getLogger(__name__)


def add_serve_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(subparsers, "serve", run_serve)
    add_flags(p, EngineConfig, "engine")
    server = add_flags(p, ServerSettings, "server")
    server.add_argument(
        "--admin-token-file",
        default=None,
        help="file holding the admin token for /reset_prefix_cache (default: $KVPILOT_ADMIN_TOKEN)",
    )
    server.add_argument(
        "--tenant-tokens-file",
        default=None,
        help="file of 'TENANT TOKEN' lines: generation requests then need a tenant's token, and the server "
        "salts each tenant's cache itself (a body's cache_salt cannot reach another tenant's blocks)",
    )
    add_flags(p, ConnectionLimits, "client connections")


def run_serve(args: argparse.Namespace) -> int:
    """Run the inference daemon (OpenAI-compatible HTTP server).

    Run the kvpilot daemon. Flag names follow vLLM's `vllm serve` where it has one.
    """
    from kvpilot.daemon.server.tenants import TenantFileError, load_tenant_tokens
    from kvpilot.serving.admin_token import AdminTokenError, load_admin_token

    try:
        token = load_admin_token(args.admin_token_file)
        tenants = load_tenant_tokens(args.tenant_tokens_file) if args.tenant_tokens_file else None
    except (AdminTokenError, TenantFileError) as exc:
        log.error("%s", exc)
        return 2
    config = from_flags(EngineConfig, args)
    settings = from_flags(
        ServerSettings,
        args,
        admin_token=token,
        tenant_tokens=tenants,
        limits=from_flags(ConnectionLimits, args),
    )
    try:
        config.validate()
        settings.validate()
    except ValueError as exc:
        log.error("%s", flag_message(exc, EngineConfig, ServerSettings, ConnectionLimits))
        return 2

    from kvpilot.daemon.engine.client import start_engine
    from kvpilot.daemon.server.app import serve

    try:
        engine = start_engine(config)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    from kvpilot.daemon.kv_transfer.server import TransferPortError

    try:
        return asyncio.run(serve(engine, settings))
    except TransferPortError as exc:
        log.error("%s", exc.strerror)
        return 1
    except OSError as exc:  # most often: the port is taken
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return 1
