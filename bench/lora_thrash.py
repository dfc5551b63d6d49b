"""LoRA thrash: what two adapters taking turns under `--max-cpu-loras 1` cost another client's stream.

A `kvpilot serve` with two large adapters (rank 128 on every projection: ~150 MB each for the default
model) and room for one. One client streams a long base-model completion while another sends one-token
requests back to back: in mode `steady` all to one adapter (held: no read), in mode `thrash` alternating
the two (each read, hashed and parsed again). The stream's inter-token latency p50 in each mode and their
ratio (thrash / steady), the modes alternating `--repeats` times in one server; the adapter reloads counted
by `kvpilot_lora_reloads_total`. One JSON file under bench/results/.

    python bench/lora_thrash.py              # rank 128, 64 streamed tokens, 3 repeats
    python bench/lora_thrash.py --quick      # rank 32, 16 tokens, 1 repeat
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
from pathlib import Path

import aiohttp

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit
import benchkit  # noqa: E402
from kvpilot.daemon.engine.config import EngineConfig  # noqa: E402
from kvpilot.daemon.engine.engine import LLMEngine  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a long story about a lighthouse keeper and the ships she watched over the years."


async def stream_itl(session: aiohttp.ClientSession, url: str, tokens: int) -> list[float]:
    """The gaps (s) between the stream's token events."""
    body = {"prompt": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    stamps = []
    async with session.post(url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            if raw.startswith(b"data: {"):
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps, stamps[1:])]


async def adapter_requests(
    session: aiohttp.ClientSession, url: str, names: list[str], stop: asyncio.Event
) -> int:
    """One-token requests, naming `names` in turn, back to back until `stop`; how many were sent."""
    sent = 0
    while not stop.is_set():
        body = {"model": names[sent % len(names)], "prompt": f"Request {sent}: hello", "max_tokens": 1}
        async with session.post(url + "/v1/completions", json=body) as resp:
            resp.raise_for_status()
            await resp.read()
        sent += 1
    return sent


async def one_run(url: str, names: list[str], tokens: int) -> dict:
    stop = asyncio.Event()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        side = asyncio.create_task(adapter_requests(session, url, names, stop))
        await asyncio.sleep(0.5)  # the adapter client's first request is under way
        gaps = await stream_itl(session, url, tokens)
        stop.set()
        sent = await side
    return {
        "itl_p50_ms": statistics.median(gaps) * 1e3,
        "itl_max_ms": max(gaps) * 1e3,
        "adapter_requests": sent,
    }


def reloads(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("kvpilot_lora_reloads_total "):
                return float(line.split()[1])
    return 0.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rank", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=64, help="tokens of the measured stream")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.rank, args.tokens, args.repeats = 32, 16, 1
    write_adapter = benchkit.bench_module(Path(__file__).with_name("lora.py")).write_adapter
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        probe = LLMEngine(EngineConfig(num_kv_blocks=16))
        paths = {n: write_adapter(Path(tmp) / n, probe, args.rank, seed=i) for i, n in enumerate(("a", "b"))}
        del probe
        adapter_mb = (paths["a"] / "adapter_model.safetensors").stat().st_size / 2**20
        flags = [
            "--enable-lora",
            "--max-loras",
            "1",
            "--max-cpu-loras",
            "1",
            "--max-lora-rank",
            str(args.rank),
        ]
        flags += ["--lora-modules", *(f"{n}={p}" for n, p in paths.items())]
        with benchkit.kvpilot_serve(Path(tmp) / "serve.log", 300, *flags) as url:
            modes = {"steady": ["a"], "thrash": ["a", "b"]}
            asyncio.run(one_run(url, ["a"], 4))  # warm-up
            runs: dict[str, list[dict]] = {m: [] for m in modes}
            for _ in range(args.repeats):
                for mode, names in modes.items():
                    before = reloads(url)
                    run = asyncio.run(one_run(url, names, args.tokens))
                    run["reloads"] = reloads(url) - before
                    runs[mode].append(run)
                    print(f"{mode:>7}: {json.dumps(run)}", flush=True)
    p50 = {m: statistics.median(r["itl_p50_ms"] for r in v) for m, v in runs.items()}
    doc = benchkit.header("lora_thrash", load_before) | {
        "config": {"rank": args.rank, "tokens": args.tokens, "repeats": args.repeats},
        "adapter_mb": round(adapter_mb, 1),
        "itl_p50_ms": {m: round(v, 1) for m, v in p50.items()},
        "ratio_thrash_over_steady": round(p50["thrash"] / p50["steady"], 2),
        "runs": runs,
    }
    print(json.dumps({k: v for k, v in doc.items() if k != "runs"}, indent=2))
    benchkit.write(args.output or benchkit.default_path(RESULTS, "lora-thrash"), doc)


if __name__ == "__main__":
    main()
