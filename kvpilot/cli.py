"""The `kvpilot` command line.

One subcommand per job; each is an `_add_<name>(subparsers)` function registered in `_COMMANDS` that
declares its flags and sets `handler`. Handlers import their heavy dependencies (torch, kopf, ...) lazily,
so `kvpilot --help` and the light subcommands start fast.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from collections.abc import Callable, Sequence

from kvpilot.operator.cli import add_operator_parser, add_reset_parser

log = logging.getLogger("kvpilot")


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="run the inference daemon (OpenAI-compatible HTTP server)",
        description="Run the kvpilot daemon. Flag names follow vLLM's `vllm serve` where it has one.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="Hugging Face checkpoint directory; omitted: the embedded SmolLM2-135M-Instruct",
    )
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use; the first is reported (default: the model's name)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (auto: float32 on CPU, bfloat16 on GPU)",
    )
    p.add_argument("--device", default="auto", help="torch device (auto: cuda if available, else cpu)")
    p.add_argument(
        "--cpu-threads",
        type=int,
        default=None,
        help="torch threads on the CPU (default: the CPUs this process may use, from its affinity and "
        "cgroup CPU quota, but one, which serves HTTP)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block (default 16)")
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        dest="num_kv_blocks",
        help="number of KV cache blocks (default: derived from memory)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        default=None,
        help="KV cache budget on the CPU in bytes (default 1 GiB)",
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="most requests in one batch (default 64)")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="token budget of one step, prefill chunks included (default 2048)",
    )
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV of shared prompt prefixes (default on)",
    )
    p.add_argument(
        "--admin-token-file",
        default=None,
        help="file holding the admin token for /reset_prefix_cache (else $KVPILOT_ADMIN_TOKEN)",
    )
    p.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="publish KV cache events (vLLM's format, ZeroMQ PUB) on this address; default off",
    )
    p.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="tcp://HOST:PORT",
        help="serve missed KV events again on this address (ZeroMQ ROUTER); needs --kv-events-endpoint",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="seconds in-flight requests get to finish after SIGTERM (default 30)",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=4 << 20,
        help="larger request bodies are refused with 413 (default 4 MiB)",
    )
    p.add_argument(
        "--request-timeout",
        type=float,
        default=None,
        help="seconds a generation may take from arrival; later ones are aborted with 504 (default: none)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests waiting for the engine beyond which new ones get 503 with Retry-After (default 1024)",
    )
    p.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="engine-core processes behind this server, each with its own KV cache and scheduler, its "
        "share of the CPUs or its own GPU (default 1: the engine runs in the server's process)",
    )
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="processes the model is sharded over by attention head (gloo on the CPU, NCCL on CUDA; "
        "it must divide the model's head counts; default 1)",
    )
    p.set_defaults(handler=_run_serve)


def _run_serve(args: argparse.Namespace) -> int:
    from kvpilot.daemon.server.auth import AdminTokenError, load_admin_token

    try:
        token = load_admin_token(args.admin_token_file)
    except AdminTokenError as exc:
        log.error("%s", exc)
        return 2

    if args.request_timeout is not None and not args.request_timeout > 0:
        log.error("--request-timeout must be a positive number of seconds")
        return 2

    from kvpilot.daemon.engine.client import start_engine
    from kvpilot.daemon.engine.config import EngineConfig
    from kvpilot.daemon.server.app import ServerSettings, serve

    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=args.enable_prefix_caching,
        cpu_threads=args.cpu_threads,
        max_queued_requests=args.max_queued_requests,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    if args.kv_cache_memory_bytes is not None:
        config.kv_cache_memory_bytes = args.kv_cache_memory_bytes
    if args.data_parallel_size < 1 or args.tensor_parallel_size < 1:
        log.error("--data-parallel-size and --tensor-parallel-size must be at least 1")
        return 2
    if args.data_parallel_size > 1 and args.tensor_parallel_size > 1:
        log.error("--data-parallel-size and --tensor-parallel-size cannot be combined yet")
        return 2
    if args.data_parallel_size > 1 and args.kv_events_endpoint:
        # Every rank would bind the same sockets, and a router keeps one index per pod, not per rank.
        log.error("--kv-events-endpoint cannot be combined with --data-parallel-size > 1 yet")
        return 2
    try:
        engine = start_engine(config, args.data_parallel_size)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        log.error("cannot start the engine: %s", exc)
        return 2
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        served_model_names=args.served_model_name or [],
        admin_token=token,
        max_body_bytes=args.max_request_body_bytes,
        shutdown_timeout=args.shutdown_timeout,
        request_timeout=args.request_timeout,
    )
    try:
        return asyncio.run(serve(engine, settings))
    except OSError as exc:  # most often: the port is taken
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return 1


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "bench",
        help="concurrency sweep against a running server, resetting its prefix cache before each run",
        description="Sweep a shared-prefix chat load over concurrency levels against any OpenAI-compatible "
        "server (kvpilot, vLLM, ...). Each run starts with POST /reset_prefix_cache so that every run "
        "starts cold; --no-reset shows how much a warm cache skews the numbers.",
    )
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (default %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16], help="levels (default 1 4 16)")
    p.add_argument("--rounds", type=int, default=2, help="requests per client in each run (default 2)")
    p.add_argument("--min-requests", type=int, default=4, help="at least this many requests per run")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default 16)")
    p.add_argument("--no-reset", dest="reset", action="store_false", help="do not reset before each run")
    p.add_argument("--output", default=None, help="write the runs as JSON to this file")
    p.set_defaults(handler=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import json
    import os
    import urllib.request
    from dataclasses import asdict

    from kvpilot.loadgen import sweep

    url = args.url.rstrip("/")
    token = os.environ.get("KVPILOT_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    model = args.model
    if model is None:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                model = json.load(r)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            log.error("cannot list the models of %s (%s); pass --model", url, exc)
            return 2
    runs = sweep(url, model, model, args.concurrency, rounds=args.rounds, min_requests=args.min_requests,
                 max_tokens=args.max_tokens, headers=headers, reset=args.reset)  # fmt: skip
    if any(isinstance(r.reset, str) for r in runs):
        log.warning("the server refused the reset (see `reset` in the runs): runs may have started warm")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"url": url, "model": model, "runs": [asdict(r) for r in runs]}, f, indent=2)
        log.info("wrote %s", args.output)
    return 1 if any(r.errors for r in runs) else 0


def _add_router(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "router",
        help="run the fleet router (OpenAI reverse proxy, prefix-aware routing, fleet-wide reset)",
        description="Route OpenAI requests to the fleet's pods by what their KV caches hold (from the pods' "
        "KV events), and reset every pod's prefix cache with one POST /reset_prefix_cache.",
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--endpoints", metavar="URL,...",
                       help="the pods' HTTP addresses, comma-separated: http://HOST:PORT,...")  # fmt: skip
    where.add_argument("--fleet", metavar="NAME",
                       help="route to the ready pods of Service NAME (an InferenceDeployment's), from its "
                       "EndpointSlices (in-cluster, or the current kubeconfig)")  # fmt: skip
    p.add_argument("-n", "--namespace", default=None,
                   help="namespace of --fleet (default: the router's own namespace in-cluster, else default)")  # fmt: skip
    p.add_argument("--policy", default="prefix-aware", choices=["prefix-aware", "round-robin", "least-load"],
                   help="how a pod is chosen (default prefix-aware)")  # fmt: skip
    p.add_argument("--model", default=None,
                   help="checkpoint directory whose tokenizer the pods use (default: the embedded model)")  # fmt: skip
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default 0.0.0.0)")
    p.add_argument("--port", type=int, default=8080, help="port to listen on (default 8080)")
    p.add_argument("--admin-token-file", default=None,
                   help="admin token for /reset_prefix_cache, also sent to the pods (else $KVPILOT_ADMIN_TOKEN)")  # fmt: skip
    p.add_argument("--reset-timeout", type=float, default=60.0,
                   help="seconds a fleet reset may take before unfinished pods count as failed (default 60)")  # fmt: skip
    p.set_defaults(handler=_run_router)


def _run_router(args: argparse.Namespace) -> int:
    from kvpilot.daemon.server.auth import AdminTokenError, load_admin_token
    from kvpilot.router.app import RouterSettings, serve
    from kvpilot.router.pods import parse_endpoints

    try:
        token = load_admin_token(args.admin_token_file)
        pods = parse_endpoints(args.endpoints) if args.endpoints else None
    except (AdminTokenError, ValueError) as exc:
        log.error("%s", exc)
        return 2
    if args.fleet:
        try:
            import kubernetes  # noqa: F401
        except ImportError:
            log.error("--fleet needs the kubernetes client: pip install 'kvpilot[operator]'")
            return 2
    namespace = args.namespace or _own_namespace()
    settings = RouterSettings(host=args.host, port=args.port, policy=args.policy, admin_token=token,
                              reset_timeout_s=args.reset_timeout)  # fmt: skip
    try:
        return asyncio.run(serve(settings, args.model, pods, args.fleet, namespace))
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return 2
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", args.host, args.port, exc.strerror or exc)
        return 1


def _own_namespace() -> str:
    try:
        with open("/var/run/secrets/kubernetes.io/serviceaccount/namespace") as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


# name -> function adding the subcommand.
_COMMANDS: dict[str, Callable[[argparse._SubParsersAction], None]] = {
    "serve": _add_serve,
    "operator": add_operator_parser,
    "reset": add_reset_parser,
    "bench": _add_bench,
    "router": _add_router,
}


def build_parser() -> argparse.ArgumentParser:
    from kvpilot import __version__

    parser = argparse.ArgumentParser(prog="kvpilot", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    parser.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="log level (default INFO)")  # fmt: skip
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
        leftover = argparse.ArgumentParser(add_help=False)
        leftover.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
        extra, unknown = leftover.parse_known_args(rest)
        if unknown:
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        if extra.log_level:
            args.log_level = extra.log_level
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
