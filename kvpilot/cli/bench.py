"""`kvpilot bench`: a concurrency sweep of the load generator (loadgen.py) against a running server."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field

from kvpilot.cli.flags import add_command, add_flags, flag, flag_message, from_flags
from kvpilot.engines import ENGINE_NAMES

log = logging.getLogger(__name__)


@dataclass(slots=True)
class BenchSettings:
    url: str = field(default="http://127.0.0.1:8000", metadata=flag("server base URL"))
    model: str | None = field(default=None, metadata=flag("model name", unset="the first of GET /v1/models"))
    concurrency: list[int] = field(
        default_factory=lambda: [1, 4, 16], metadata=flag("concurrency levels, one run each")
    )
    rounds: int = field(default=2, metadata=flag("requests per client in each run"))
    min_requests: int = field(default=4, metadata=flag("at least this many requests per run"))
    max_tokens: int = field(default=16, metadata=flag("tokens generated per request"))
    reset: bool = field(
        default=True, metadata=flag("reset the server's prefix cache before each run, so that it starts cold")
    )
    verify: bool = field(
        default=True,
        metadata=flag("prove each reset left the server cold: a canary prompt before and after it"),
    )
    engine: str = field(
        default="kvpilot",
        metadata=flag("what the server runs, so that its reset is called its own way", choices=ENGINE_NAMES),
    )
    warm: str | None = field(
        default=None,
        metadata=flag(
            "after each reset, warm the server with these prompts (a JSON or YAML list, as a PrefixCacheWarmup's: "
            "messages or prompt items) and prove it warm before the run",
            metavar="FILE",
            unset="none: every run starts cold",
        ),
    )
    warm_pin: bool = field(
        default=False, metadata=flag("pin the --warm prompts (a kvpilot server with --enable-pinned-prefix)")
    )
    output: str | None = field(default=None, metadata=flag("write the runs as JSON to this file"))

    def validate(self) -> None:
        if min(self.concurrency) < 1 or min(self.rounds, self.min_requests, self.max_tokens) < 1:
            raise ValueError("concurrency, rounds, min_requests and max_tokens must be positive")
        if self.warm is not None and not self.reset:
            raise ValueError("warm needs reset: a warm set on a cache left warm is not a known state")
        if self.warm_pin and self.warm is None:
            raise ValueError("warm_pin needs warm")


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(subparsers, "bench", run_bench)
    add_flags(p, BenchSettings)


def run_bench(args: argparse.Namespace) -> int:
    """Concurrency sweep against a running server, resetting its prefix cache before each run.

    Sweep a shared-prefix chat load over concurrency levels against any OpenAI-compatible server (kvpilot,
    vLLM, SGLang, a kvpilot router). Each run starts with a prefix-cache reset, called as --engine's (POST
    /reset_prefix_cache; SGLang's /flush_cache), and proven cold by a canary prompt before and after it
    (--no-verify: not proven); --no-reset shows how much a warm cache skews the numbers. With --warm FILE each
    reset is followed by a warm-up of those prompts, proven warm (each sent twice, its full blocks served
    from cache the second time), and each run reports the share of its prompt tokens that warm set covers
    beside the hit rate it got: reset, warm, measure.
    """
    import json
    import os
    import urllib.request
    from dataclasses import asdict

    from kvpilot.cli.loadgen import LEGEND, Warm, describe_load, format_table, sweep
    from kvpilot.fanout import warm_prompts

    bench = from_flags(BenchSettings, args)
    try:
        bench.validate()
    except ValueError as exc:
        log.error("%s", flag_message(exc, BenchSettings))
        return 2
    url = bench.url.rstrip("/")
    warm = None
    if bench.warm is not None:
        try:
            with open(bench.warm, encoding="utf-8") as f:
                warm = Warm(warm_prompts.parse(f.read(warm_prompts.MAX_PROMPTS_BYTES + 1)), bench.warm_pin)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            log.error("--warm %s: %s", bench.warm, exc)
            return 2
    token = os.environ.get("KVPILOT_ADMIN_TOKEN")
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    model = bench.model
    if model is None:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                model = json.load(r)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError) as exc:
            log.error("cannot list the models of %s (%s); pass --model", url, exc)
            return 2
    print(
        describe_load(
            url,
            model,
            bench.concurrency,
            bench.rounds,
            bench.min_requests,
            bench.max_tokens,
            bench.reset,
            bench.verify,
            warm,
        ),
        LEGEND,
        "",
        sep="\n",
        flush=True,
    )
    runs = sweep(
        url,
        model,
        model,
        bench.concurrency,
        rounds=bench.rounds,
        min_requests=bench.min_requests,
        max_tokens=bench.max_tokens,
        headers=headers,
        reset=bench.reset,
        engine=bench.engine,
        verify=bench.verify,
        warm=warm,
    )
    print("\nall runs:", format_table(runs), sep="\n", flush=True)
    if any(r.reset is not None and r.reset["result"] != "Succeeded" for r in runs):
        log.warning("the reset failed (see `reset` in the runs): runs may have started warm")
    if any(r.warm is not None and r.warm["verified"] != "warm" for r in runs):
        log.warning(
            "a warm-up was not proven warm (see `warm` in the runs): runs did not start as --warm says"
        )
    if bench.output:
        with open(bench.output, "w") as f:
            json.dump({"url": url, "model": model, "runs": [asdict(r) for r in runs]}, f, indent=2)
        log.info("wrote %s", bench.output)
    return 1 if any(r.errors for r in runs) else 0
