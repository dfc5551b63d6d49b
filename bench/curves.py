"""Cost curves: the other benches run across their work size, each against its baseline in the same run.

    .venv/bin/python bench/curves.py                  # all five curves (~40 minutes on 2 cores)
    .venv/bin/python bench/curves.py --quick          # few points, small sizes: a smoke run (~1 minute)
    .venv/bin/python bench/curves.py --only reset ttft

Curves (one JSON and one PNG each under bench/results/curves/, or --out-dir):
- throughput: output tok/s vs concurrency (requests at once), bench/engine.py's shared-prefix chat load cut
  to that many requests: the engine in this process (`run_kvpilot`), `kvpilot serve` over HTTP
  (bench/serve.py's `_chat_load`, stops at EOS) and transformers `generate_batch` with block sharing
  (`run_transformers`), alternating per point, all with the same torch threads (all cores but one: the
  server keeps one for HTTP).
- ttft: time to first token vs prompt length (bench/engine.py's `engine_ttft`): cold (after a reset), cached
  (the same prompt with its last 16 tokens new, so all but one block is a hit), and transformers' forward
  over the whole prompt (no cache) as the baseline.
- reset: `BlockPool.reset()` vs cached blocks (bench/engine.py's `reset_latency`), against freeing the old
  index at once, as an eager reset would before answering.
- fanout: bench/fanout.py per pod count (its own control plane each): create to Succeeded with replies at
  once and after 20 ms, against the sequential urllib loop (the 20 ms loop only where it takes <= 30 s).
- router: router CPU per chat and per streamed chunk vs stub pods behind it (bench/router_cost.py):
  kvpilot's router against sglang-router, both round-robin, one after the other per fleet size.

Each curve's JSON has its points, the load average before and after, and per series a log-log fit:
`exponent` k of y ~ x^k (0: flat, 1: linear, 2: quadratic), from a least-squares line through
(log x, log y).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results" / "curves"
CURVES = ("throughput", "ttft", "reset", "fanout", "router")

FULL = {
    "concurrency": [1, 2, 4, 8, 16, 32, 64],
    "max_tokens": 16,
    "prompt_lengths": [128, 256, 512, 1024, 2048, 4096],
    "cached_blocks": [1_000, 10_000, 100_000, 1_000_000],
    "pods": [100, 1000, 3000, 10_000],
    "fleet": [2, 8, 16, 32, 64],
    "chats": 1500,
    "streams": 120,
    "chunks": 64,
}
QUICK = {
    "concurrency": [1, 2],
    "max_tokens": 2,
    "prompt_lengths": [32, 128],
    "cached_blocks": [1_000, 10_000],
    "pods": [20, 60],
    "fleet": [2, 4],
    "chats": 100,
    "streams": 4,
    "chunks": 8,
}


# name -> (title, x label, y label) of its plot
TITLES = {
    "throughput": (
        "output tokens/s vs requests at once (shared ~300-token prefix)",
        "requests at once",
        "output tokens/s",
    ),
    "ttft": ("time to first token vs prompt length (one request alone)", "prompt tokens", "seconds"),
    "reset": ("prefix cache reset latency vs cached blocks", "cached blocks", "milliseconds"),
    "fanout": ("one PrefixCacheReset to N pods: create to Succeeded (window 64)", "pods", "seconds"),
    "router": (
        "router CPU per chat and per streamed chunk vs stub pods (round-robin)",
        "stub pods behind the router",
        "router CPU µs",
    ),
}


def loglog_fit(xs: list[float], ys: list[float]) -> dict | None:
    """y ~ c * x^k by least squares on (log x, log y): k, and the shape it reads as."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y is not None and y > 0]
    if len(pts) < 2:
        return None
    mx = statistics.fmean(p[0] for p in pts)
    my = statistics.fmean(p[1] for p in pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    k = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx
    if abs(k) < 0.25:
        shape = "flat"
    elif 0.75 <= k <= 1.25:
        shape = "linear"
    elif 1.75 <= k <= 2.25:
        shape = "quadratic"
    else:
        shape = f"x^{k:.2f}"
    return {"exponent": round(k, 3), "shape": shape, "points": len(pts)}


def curve(name: str, load_before: tuple, series: dict, **extra) -> dict:
    """One curve's document: `series` maps a label to {"x", "y", "baseline"}; fits added here."""
    for s in series.values():
        s["fit"] = loglog_fit(s["x"], s["y"])
    title, xlabel, ylabel = TITLES[name]
    doc = benchkit.header(f"curves/{name}", load_before)
    return doc | {"title": title, "xlabel": xlabel, "ylabel": ylabel, "series": series, **extra}


def plot(doc: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=110)
    for label, s in doc["series"].items():
        pts = [(x, y) for x, y in zip(s["x"], s["y"]) if y is not None]
        if not pts:
            continue
        fit = s.get("fit")
        text = f"{label} (k={fit['exponent']:.2f})" if fit else label
        ax.plot(*zip(*pts), "--" if s["baseline"] else "-", marker="s" if s["baseline"] else "o", label=text)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    # ticks at the sizes measured, labels as plain numbers (64, 0.5: not 2^6, 5x10^-1)
    xs = sorted({x for s in doc["series"].values() for x in s["x"]})
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))
    ax.set_xlabel(doc["xlabel"])
    ax.set_ylabel(doc["ylabel"])
    la, lb = doc["load_average_before"], doc["load_average_after"]
    ax.set_title(
        f"{doc['title']}\n{doc['time']}, load {la[0]:.1f} -> {lb[0]:.1f} ({doc['cpus']} CPUs)", fontsize=9
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def series(baseline: bool = False) -> dict:
    return {"x": [], "y": [], "baseline": baseline}


def add(s: dict, label: str, x: float, y: float) -> None:
    s[label]["x"].append(x)
    s[label]["y"].append(y)


# ---- engine, server, transformers ------------------------------------------------------------------
class Engines:
    """One engine and one transformers model in this process, with the same torch threads, for the
    throughput and TTFT curves."""

    def __init__(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        from kvpilot.daemon.engine.config import EngineConfig
        from kvpilot.daemon.engine.engine import LLMEngine
        from kvpilot.daemon.engine.request import SamplingParams

        self.threads = max(1, len(os.sched_getaffinity(0)) - 1)  # as `kvpilot serve` sets its own
        torch.set_num_threads(self.threads)
        self.bench = benchkit.bench_module(BENCH / "engine.py")
        self.engine = LLMEngine(EngineConfig(num_kv_blocks=4096, cpu_threads=self.threads))
        self.tok = self.engine.tokenizer
        self.engine.generate([self.tok("warm-up")["input_ids"]], SamplingParams(max_tokens=2))
        self.model = AutoModelForCausalLM.from_pretrained(self.engine.model_dir, dtype=torch.float32).eval()

    def questions(self, n: int) -> list[str]:
        qs = self.bench.QUESTIONS
        return [qs[i % len(qs)] + (f" ({i // len(qs)})" if i >= len(qs) else "") for i in range(n)]


def throughput_curve(p: dict, eng: Engines, workdir: Path) -> dict:
    serve = benchkit.bench_module(BENCH / "serve.py")
    load_before = os.getloadavg()
    s = {"engine": series(), "kvpilot serve (HTTP)": series(), "transformers generate_batch": series(True)}
    raw: list[dict] = []
    flags = ["--max-num-seqs", str(max(p["concurrency"])), "--cpu-threads", str(eng.threads)]
    with benchkit.kvpilot_serve(workdir / "serve.log", 600, *flags) as url:
        asyncio.run(serve._chat_load(url, serve.MODEL, eng.questions(1), eng.bench.SYSTEM, 2))  # warm-up
        for c in p["concurrency"]:
            qs = eng.questions(c)
            prompts = [eng.bench.chat(eng.tok, q) for q in qs]
            e = eng.bench.run_kvpilot(eng.engine, prompts, p["max_tokens"])
            t = eng.bench.run_transformers(eng.model, prompts, p["max_tokens"], sharing=True)
            h = asyncio.run(serve._chat_load(url, serve.MODEL, qs, eng.bench.SYSTEM, p["max_tokens"]))
            h.pop("texts")
            for label, r in zip(s, (e, h, t)):
                add(s, label, c, r["tokens_per_s"])
            raw.append(
                {"concurrency": c, "engine": e, "server": h, "transformers": t, "load": os.getloadavg()}
            )
            print(
                f"throughput c={c}: engine {e['tokens_per_s']:.1f}, server {h['tokens_per_s']:.1f}, "
                f"transformers {t['tokens_per_s']:.1f} tok/s",
                flush=True,
            )
    return curve("throughput", load_before, s, max_tokens=p["max_tokens"], threads=eng.threads, points=raw)


def prompt_of(eng: Engines, n: int, salt: str = "") -> list[int]:
    """n tokens of text: the engine bench's system prompt repeated (salt first, so prompts differ)."""
    ids = eng.tok(salt + eng.bench.SYSTEM)["input_ids"]
    while len(ids) < n:
        ids += eng.tok(" " + eng.bench.SYSTEM)["input_ids"]
    return list(ids[:n])


def hf_ttft(model, prompt: list[int]) -> float:  # noqa: ANN001
    """Seconds for transformers to read the whole prompt and pick its first token (no cache)."""
    import torch

    with torch.no_grad():
        start = time.perf_counter()
        int(model(torch.tensor([prompt])).logits[0, -1].argmax())
        return time.perf_counter() - start


def ttft_curve(p: dict, eng: Engines, repeats: int) -> dict:
    load_before = os.getloadavg()
    s = {
        "cold": series(),
        "cached prefix (last 16 tokens new)": series(),
        "transformers forward": series(True),
    }
    raw = []
    new_tail = prompt_of(eng, 16, salt="A different ending. ")
    for n in p["prompt_lengths"]:
        times: dict[str, list[float]] = {k: [] for k in s}
        cached_tokens = None
        for r in range(repeats if n <= 1024 else 1):
            prompt = prompt_of(eng, n, salt=f"Run {r}. ")
            eng.engine.reset_prefix_cache()
            times["cold"].append(eng.bench.engine_ttft(eng.engine, prompt)[0])
            t, cached_tokens = eng.bench.engine_ttft(eng.engine, prompt[:-16] + new_tail)
            times["cached prefix (last 16 tokens new)"].append(t)
            times["transformers forward"].append(hf_ttft(eng.model, prompt))
        med = {k: statistics.median(v) for k, v in times.items()}
        for k in s:
            add(s, k, n, med[k])
        raw.append(
            {"prompt_tokens": n, "median_s": med, "cached_tokens": cached_tokens, "load": os.getloadavg()}
        )
        print(f"ttft {n} tokens: " + ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in med.items()), flush=True)
    return curve("ttft", load_before, s, threads=eng.threads, points=raw)


# ---- reset ---------------------------------------------------------------------------------------
def reset_curve(p: dict) -> dict:
    engine = benchkit.bench_module(BENCH / "engine.py")
    load_before = os.getloadavg()
    s = {"reset (swap the index)": series(), "free the old index at once": series(True)}
    raw = []
    for n in p["cached_blocks"]:
        r = engine.reset_latency(n, repeats=5 if n <= 100_000 else 2)
        add(s, "reset (swap the index)", n, r["median_ms"])
        add(s, "free the old index at once", n, r["free_old_index_median_ms"])
        raw.append(r | {"load": os.getloadavg()})
        print(f"reset {n} blocks: {r}", flush=True)
    return curve("reset", load_before, s, points=raw)


# ---- fan-out -------------------------------------------------------------------------------------
def fanout_curve(p: dict, workdir: Path) -> dict:
    load_before = os.getloadavg()
    s = {
        "fan-out, replies at once": series(),
        "fan-out, 20 ms replies": series(),
        "sequential loop, replies at once": series(True),
        "sequential loop, 20 ms replies": series(True),
    }
    raw = []
    for n in p["pods"]:
        out = workdir / f"fanout-{n}.json"
        seq_max = 20 if n * 0.020 <= 30 else 0  # the 20 ms loop takes n x 20 ms
        argv = [sys.executable, str(BENCH / "fanout.py"), "--pods", str(n), "--reply-delay-ms", "0", "20"]
        argv += ["--sequential-max-delay-ms", str(seq_max), "--out", str(out)]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=1200)
        if r.returncode != 0:
            raise RuntimeError(f"bench/fanout.py --pods {n} failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        doc = json.loads(out.read_text())
        for rnd in doc["rounds"]:
            at_once = rnd["reply_delay_ms"] == 0
            label = "replies at once" if at_once else "20 ms replies"
            add(s, f"fan-out, {label}", n, rnd["create_to_complete_s"])
            if "sequential_loop_s" in rnd:
                add(s, f"sequential loop, {label}", n, rnd["sequential_loop_s"])
        raw.append(doc)
        print(
            f"fanout {n} pods: "
            + json.dumps(
                [
                    {
                        k: rnd.get(k)
                        for k in (
                            "reply_delay_ms",
                            "create_to_complete_s",
                            "sequential_loop_s",
                            "load_before",
                        )
                    }
                    for rnd in doc["rounds"]
                ]
            ),
            flush=True,
        )
    return curve("fanout", load_before, s, runs=raw)


# ---- router --------------------------------------------------------------------------------------
def router_curve(p: dict, workdir: Path) -> dict:
    rc = benchkit.bench_module(BENCH / "router_cost.py")
    binary = benchkit.tools_bin("sglang-router")
    load_before = os.getloadavg()
    s = {
        "kvpilot router, per chat": series(),
        "sglang-router, per chat": series(True),
        "kvpilot router, per streamed chunk": series(),
        "sglang-router, per streamed chunk": series(True),
    }
    raw = []
    for n in p["fleet"]:
        args = argparse.Namespace(
            chats=p["chats"],
            concurrency=32,
            streams=p["streams"],
            stream_concurrency=8,
            chunks=p["chunks"],
            chunk_gap_ms=1.0,
            repeats=1,
            workers=n,
        )
        runs = rc.both_routers(args, binary, workdir)
        for run in runs:
            who = "kvpilot router" if run["router"] == "kvpilot" else "sglang-router"
            add(s, f"{who}, per chat", n, run["chats"]["cpu_per_request_ms"] * 1000)
            add(s, f"{who}, per streamed chunk", n, run["streams"]["cpu_per_chunk_us"])
        raw.append({"pods": n, "runs": runs, "load": os.getloadavg()})
    return curve("router", load_before, s, points=raw)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="few points at small sizes: a smoke run")
    ap.add_argument("--only", nargs="+", choices=CURVES, default=list(CURVES))
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    ap.add_argument("--replot", action="store_true", help="only redraw the PNGs from the JSON in --out-dir")
    args = ap.parse_args()
    if args.replot:
        for name in args.only:
            if (args.out_dir / f"{name}.json").exists():
                plot(json.loads((args.out_dir / f"{name}.json").read_text()), args.out_dir / f"{name}.png")
        return 0
    p = QUICK if args.quick else FULL
    workdir = Path(tempfile.mkdtemp(prefix="kvpilot-curves-"))
    eng = Engines() if {"throughput", "ttft"} & set(args.only) else None
    for name in args.only:
        print(f"== {name} (load {os.getloadavg()})", flush=True)
        if name == "throughput":
            doc = throughput_curve(p, eng, workdir)
        elif name == "ttft":
            doc = ttft_curve(p, eng, repeats=1 if args.quick else 2)
        elif name == "reset":
            doc = reset_curve(p)
        elif name == "fanout":
            doc = fanout_curve(p, workdir)
        else:
            doc = router_curve(p, workdir)
        doc["quick"] = args.quick
        benchkit.write(args.out_dir / f"{name}.json", doc)
        plot(doc, args.out_dir / f"{name}.png")
        fits = {k: v["fit"] and v["fit"]["exponent"] for k, v in doc["series"].items()}
        print(f"{name}: fitted exponents {fits}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
