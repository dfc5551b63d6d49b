"""`kvpilot router`: the router's flags, generated from RouterSettings, and its start."""

from __future__ import annotations

import argparse
import asyncio
import logging

import uvloop

from kvpilot.cli.flags import add_command, add_flags, flag_message, from_flags
from kvpilot.router.settings import RouterSettings
from kvpilot.serving.http_limits import ConnectionLimits

log = logging.getLogger(__name__)


def add_router_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(subparsers, "router", run_router)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--endpoints",
        metavar="URL,...",
        help="the pods' HTTP addresses, comma-separated: http://HOST:PORT,...",
    )
    where.add_argument(
        "--fleet",
        metavar="NAME",
        help="route to the ready pods of InferenceDeployment NAME, from its Service's EndpointSlices, each "
        "checked to be a pod of the fleet (in-cluster, or the current kubeconfig); a fleet with "
        "spec.disaggregation runs as --prefill/--decode do, each pod's role its kvpilot.io/role label",
    )
    # vllm-router's and sglang-router's names; each flag repeated or given several URLs (or comma lists)
    where.add_argument(
        "--prefill",
        nargs="+",
        action="extend",
        metavar="URL",
        help="prefill/decode disaggregation (with --decode): the prefill pods' HTTP addresses; each request "
        "is prefilled on one, chosen by its cache, and decoded on a --decode pod (docs/disaggregation.md)",
    )
    p.add_argument(
        "--decode",
        nargs="+",
        action="extend",
        metavar="URL",
        help="with --prefill: the decode pods' HTTP addresses, which pull the prefill's KV and generate",
    )
    p.add_argument(
        "-n",
        "--namespace",
        default=None,
        help="namespace of --fleet (default: the router's own namespace in-cluster, else the kubeconfig context's)",
    )
    p.add_argument(
        "--model",
        default=None,
        help="checkpoint directory whose tokenizer the pods use (default: the embedded model)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="admin token for /reset_prefix_cache, also sent to the pods (default: $KVPILOT_ADMIN_TOKEN)",
    )
    add_flags(p, RouterSettings)
    add_flags(p, ConnectionLimits, "client connections")


def run_router(args: argparse.Namespace) -> int:
    """Run the fleet router (OpenAI reverse proxy, prefix-aware routing, fleet-wide reset).

    Route OpenAI requests to the fleet's pods by what their KV caches hold (from the pods' KV events), and
    reset every pod's prefix cache with one POST /reset_prefix_cache. With --engine vllm or sglang it fronts
    vLLM or SGLang pods: their own health endpoints and resets; vLLM pods routed by their own KV events
    (GET /kv_event_sources), and both by the load their metrics report. With --prefill and --decode each
    request is prefilled on one pod and decoded on another, its KV handed over (docs/disaggregation.md), as
    it is with --fleet when the InferenceDeployment has spec.disaggregation.
    """
    from kvpilot.router.app import serve
    from kvpilot.router.fleet.pods import parse_endpoints, parse_pools
    from kvpilot.serving.admin_token import AdminTokenError, load_admin_token

    if args.decode and not args.prefill:
        log.error(
            "--decode needs --prefill: a disaggregated fleet's pods are named by both (or by its "
            "InferenceDeployment, with --fleet alone)"
        )
        return 2
    if args.prefill and not args.decode:
        log.error("--prefill needs --decode: a disaggregated fleet needs pods of both roles")
        return 2
    try:
        token = load_admin_token(args.admin_token_file)
        pods = None
        if args.endpoints:
            pods = parse_endpoints(args.endpoints)
        elif args.prefill:
            pods = parse_pools(args.prefill, args.decode)
        limits = from_flags(ConnectionLimits, args)
        settings = from_flags(
            RouterSettings, args, admin_token=token, limits=limits, disaggregated=bool(args.prefill)
        )
        settings.validate()
    except (AdminTokenError, ValueError) as exc:
        log.error("%s", flag_message(exc, RouterSettings, ConnectionLimits))
        return 2
    namespace = args.namespace or "default"
    if args.fleet:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            log.error("--fleet needs the kubernetes client: pip install 'kvpilot[operator]'")
            return 2
        from kvpilot.kube.kubeconfig import KubeconfigError, fail, load

        try:
            default_ns = load()
        except KubeconfigError as exc:
            return fail(exc)
        namespace = args.namespace or default_ns
    try:
        # uvloop: the proxy's cost is mostly socket calls and event-loop turns, which it makes cheaper
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(serve(settings, args.model, pods, args.fleet, namespace))
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return 1
