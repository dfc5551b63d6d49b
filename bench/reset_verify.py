"""What verification costs a reset: the same pod reset without and with the canary (kvpilot.fanout.verify),
one after the other in this process, each after the same warm-up load. The ratio is verified / plain
reset time per pod; the canary's prompt tokens are reported as the pod counted them. One JSON file under
bench/results/.

    python bench/reset_verify.py                                  # a kvpilot daemon started here
    python bench/reset_verify.py --url http://127.0.0.1:8000 --engine vllm   # a running server (vLLM: dev mode)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit

import benchkit
from kvpilot.fanout import ResetSettings, Target, run_fanout

RESULTS = Path(__file__).parent / "results"


def warm(url: str, model: str, prompts: int) -> None:
    """A few distinct cached prompts, so each reset has blocks to evict."""
    for i in range(prompts):
        body = {
            "model": model,
            "prompt": f"Warm-up {i}: " + "the cache holds this text " * 40,
            "max_tokens": 1,
        }
        req = urllib.request.Request(
            url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            r.read()


def model_of(url: str) -> str:
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        return json.loads(r.read())["data"][0]["id"]


def reset(url: str, engine: str, token: str | None, verify: bool) -> tuple[float, dict]:
    settings = ResetSettings(engine=engine, token=token, verify=verify, timeout_s=120, request_timeout_s=60)
    t0 = time.perf_counter()
    [res] = asyncio.run(run_fanout([Target("pod", url=url)], settings))
    elapsed = time.perf_counter() - t0
    if res.result != "Succeeded":
        raise SystemExit(f"the reset failed: {res.result}: {res.message}")
    return elapsed, {"verified": res.verified, "message": res.verify_message, "cleared": res.cleared}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start a kvpilot daemon here)")
    ap.add_argument("--engine", default="kvpilot", choices=("kvpilot", "vllm", "sglang"))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--warm-prompts", type=int, default=4)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    load_before = os.getloadavg()
    token = os.environ.get("KVPILOT_ADMIN_TOKEN")
    with ExitStack() as stack:
        url = args.url
        if url is None:
            log = Path(stack.enter_context(tempfile.TemporaryDirectory())) / "serve.log"
            url = stack.enter_context(benchkit.kvpilot_serve(log, 300))
        model = model_of(url)
        plain, verified, verdicts = [], [], []
        for i in range(args.repeats + 1):  # the first pair warms the pod's own code paths; not counted
            warm(url, model, args.warm_prompts)
            t_plain, _ = reset(url, args.engine, token, verify=False)
            warm(url, model, args.warm_prompts)
            t_verified, verdict = reset(url, args.engine, token, verify=True)
            if i:
                plain.append(t_plain)
                verified.append(t_verified)
                verdicts.append(verdict)
    p50_plain, p50_verified = statistics.median(plain), statistics.median(verified)
    doc = benchkit.header("reset_verify", load_before) | {
        "engine": args.engine,
        "url": args.url or "a kvpilot daemon started by the bench",
        "repeats": args.repeats,
        "reset_s_p50": round(p50_plain, 4),
        "verified_reset_s_p50": round(p50_verified, 4),
        "verification_s_p50": round(p50_verified - p50_plain, 4),
        "ratio_verified_over_plain": round(p50_verified / p50_plain, 2),
        "canary_requests_per_rank": 3,
        "verdicts": verdicts,
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "verdicts"}, indent=2))
    benchkit.write(args.out or benchkit.default_path(RESULTS, "reset-verify"), doc)


if __name__ == "__main__":
    main()
