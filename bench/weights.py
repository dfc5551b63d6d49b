"""In-place weight update vs a daemon restart, under a steady streaming load; one JSON file under bench/results/.

    .venv/bin/python bench/weights.py            # 4 streaming chats, a swap in each pause mode, then a restart
    .venv/bin/python bench/weights.py --quick    # shorter streams and pauses between the steps

One `kvpilot serve` on the embedded model (version A) and a second checkpoint B made from it with changed
weights (same shapes, other greedy outputs). While `--clients` greedy streaming chats run in a loop, the
weights are swapped A -> B -> A -> B through the daemon's routes, once per pause mode (keep, wait, abort):
start + update (stage, while serving) then pause, finish (the swap), resume. Measured from the client and
from the daemon's `kvpilot_weight_update_duration_seconds{phase}`. Then the same update by a restart: SIGTERM
the daemon and `kvpilot serve --model B` on the same port until /health is ready and the first token comes.

Token output: inter-token gaps within each stream over the whole run (p50, p99, max); for each update, the
longest time no stream sent a token across pause + swap + resume (`fleet_gap_s`: the restart's is the baseline) and the
longest a client waited for its next token across it (`client_gap_s`, a new request's first token included).
Mixed-version check: responses whose `system_fingerprint` changes within the stream, or whose text is not
their version's greedy output (a prefix when the stream was cut), counted; must be 0.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit

HERE = Path(__file__).resolve().parent
TOKEN = "bench-weights-admin"
PROMPTS = ["Tell me about rivers.", "Write a short poem about the sea.", "What is a prime number?", "Hello!"]
MODES = ("keep", "wait", "abort")


class Daemon:
    """The one port the load talks to, and admin calls to whichever daemon serves it."""

    def __init__(self, port: int) -> None:
        self.port, self.url = port, f"http://127.0.0.1:{port}"

    def call(self, method: str, path: str, body: dict | None = None) -> tuple[dict | str, float]:
        """One admin request: its reply and the seconds it took; raises unless 200."""
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        t = time.perf_counter()
        try:
            headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
            conn.request(method, path, json.dumps(body) if body is not None else None, headers)
            resp = conn.getresponse()
            raw = resp.read()
        finally:
            conn.close()
        took = time.perf_counter() - t
        if resp.status != 200:
            raise RuntimeError(f"{method} {path}: {resp.status} {raw[:300]!r}")
        try:
            return json.loads(raw), took
        except ValueError:
            return raw.decode(), took

    def phase_sums(self) -> dict[str, float]:
        """The daemon's kvpilot_weight_update_duration_seconds_sum by phase."""
        text, _ = self.call("GET", "/metrics")
        pat = r'^kvpilot_weight_update_duration_seconds_sum\{phase="(\w+)"\} (\S+)$'
        return {m[1]: float(m[2]) for m in re.finditer(pat, str(text), re.M)}


def chat_body(prompt: str, max_tokens: int, stream: bool) -> dict:
    msgs = [{"role": "user", "content": prompt}]
    return {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, "stream": stream}


class Response:
    def __init__(self, client: int, prompt: int) -> None:
        self.client, self.prompt = client, prompt
        self.sent = time.perf_counter()
        self.times: list[float] = []  # one per chunk with text: a token on this engine
        self.text = ""
        self.fingerprints: list[str] = []
        self.finish: str | None = None
        self.error: str | None = None


def stream_one(port: int, r: Response, max_tokens: int) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    try:
        body = json.dumps(chat_body(PROMPTS[r.prompt], max_tokens, True))
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            r.error = f"{resp.status} {resp.read()[:200]!r}"
            return
        for line in resp:
            if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            r.fingerprints.append(chunk.get("system_fingerprint"))
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                if piece:
                    r.times.append(time.perf_counter())
                    r.text += piece
                r.finish = choice.get("finish_reason") or r.finish
    except (OSError, http.client.HTTPException, ValueError) as exc:  # a restart cuts streams and refuses
        r.error = repr(exc)
    finally:
        conn.close()


def client_loop(port: int, n: int, max_tokens: int, stop: threading.Event, out: list[Response]) -> None:
    """Stream chats back to back, as a rollout worker does; a refused connection is retried at once."""
    i = n
    while not stop.is_set():
        r = Response(n, i % len(PROMPTS))
        stream_one(port, r, max_tokens)
        out.append(r)
        i += 1
        if r.error and not r.times:
            time.sleep(0.02)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def gap_across(times: list[float], t0: float, t1: float) -> float:
    """The longest gap between consecutive `times` that overlaps [t0, t1]."""
    best = 0.0
    for a, b in zip(times, times[1:]):
        if b >= t0 and a <= t1:
            best = max(best, b - a)
    return best


def swap(d: Daemon, checkpoint: Path, version: str, mode: str) -> dict:
    """Stage while serving, then pause, swap, resume; the client's and the daemon's times of each call."""
    before = d.phase_sums()
    t_begin = time.perf_counter()
    _, t_start = d.call("POST", "/start_weight_update")
    staged, t_update = d.call("POST", "/update_weights", {"update_info": {"model_path": str(checkpoint)}})
    t_pause0 = time.perf_counter()
    _, t_pause = d.call("POST", f"/pause?mode={mode}")
    t_finish0 = time.perf_counter()
    done, t_finish = d.call("POST", "/finish_weight_update", {"weight_version": version})
    _, t_resume = d.call("POST", "/resume")
    t_end = time.perf_counter()
    assert done["digest"] == staged["staged_digest"], (done, staged)
    after = d.phase_sums()
    daemon = {k: round(after.get(k, 0.0) - before.get(k, 0.0), 4) for k in after}
    return {
        "mode": mode,
        "version": version,
        "client_s": {
            "stage": round(t_start + t_update, 4),
            "pause": round(t_pause, 4),
            "swap": round(t_finish, 4),
            "resume": round(t_resume, 4),
        },
        "daemon_s": {"stage": round(daemon.get("start", 0) + daemon.get("update", 0), 4), **daemon},
        "window": (t_begin, t_pause0, t_finish0, t_end),
    }


def restart(d: Daemon, proc, checkpoint: Path, version: str, log: Path, token_file: Path, responses: list):  # noqa: ANN001, ANN201
    """The same update by a restart: SIGTERM, then `kvpilot serve --model B` on the same port."""
    t_stop = time.perf_counter()
    benchkit.shutdown(proc)
    t_exited = time.perf_counter()
    proc = benchkit.launch(serve_argv(d.port, token_file, version, checkpoint), log, d.url, timeout=600)
    t_ready = time.perf_counter()
    deadline = time.monotonic() + 300
    first = None
    while first is None and time.monotonic() < deadline:
        first = min((t for r in list(responses) for t in r.times if t > t_ready), default=None)
        time.sleep(0.05)
    row = {
        "mode": "restart",
        "version": version,
        "client_s": {
            "stop": round(t_exited - t_stop, 3),
            "start_to_ready": round(t_ready - t_exited, 3),
            "ready_to_first_token": round((first or t_ready) - t_ready, 3),
        },
        "window": (t_stop, t_stop, t_stop, t_ready),
    }
    return proc, row


def serve_argv(port: int, token_file: Path, version: str, model: Path | None = None) -> list[str]:
    argv = [sys.executable, "-m", "kvpilot", "serve", "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--admin-token-file", str(token_file), "--weight-version", version]
    return argv + (["--model", str(model)] if model else [])


def references(d: Daemon, max_tokens: int) -> list[str]:
    """Each prompt's greedy reply on the weights now served, non-streamed, alone."""
    out = []
    for p in PROMPTS:
        conn = http.client.HTTPConnection("127.0.0.1", d.port, timeout=300)
        conn.request("POST", "/v1/chat/completions", json.dumps(chat_body(p, max_tokens, False)))
        out.append(json.loads(conn.getresponse().read())["choices"][0]["message"]["content"])
        conn.close()
    return out


def mixed(responses: list[Response], refs: dict[str, list[str]]) -> dict:
    """Responses that mix versions: a fingerprint change mid-stream, or text that is not its version's
    greedy output (a prefix of it when the stream ended early)."""
    changed = wrong = 0
    for r in responses:
        fps = set(r.fingerprints)
        if len(fps) > 1:
            changed += 1
            continue
        if not r.text:
            continue
        want = refs[fps.pop()[0]][r.prompt]  # versions are named A-... or B-...
        whole = r.error is None and r.finish in ("length", "stop")
        if (r.text != want) if whole else not want.startswith(r.text):
            wrong += 1
    return {"fingerprint_changed": changed, "not_one_versions_output": wrong, "count": changed + wrong}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="shorter streams and pauses (a smoke run)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--output", type=Path, default=None)
    args = p.parse_args()
    max_tokens, settle = (12, 2.0) if args.quick else (32, 6.0)
    load_before = os.getloadavg()
    from kvpilot.default_model import ensure_default_model

    with tempfile.TemporaryDirectory() as tmp:
        tmpd = Path(tmp)
        ckpt = {
            "A": ensure_default_model(),
            "B": benchkit.changed_checkpoint(ensure_default_model(), tmpd / "ckpt-b"),
        }
        token_file = tmpd / "token"
        token_file.write_text(TOKEN + "\n")
        d = Daemon(benchkit.free_port())
        log = tmpd / "daemon.log"
        proc = benchkit.launch(serve_argv(d.port, token_file, "A-0"), log, d.url, timeout=600)
        try:
            d.call("POST", "/init_weight_transfer_engine", {"init_info": {}})
            refs = {"A": references(d, max_tokens)}
            swap(d, ckpt["B"], "B-ref", "keep")  # quiet: the second version's references, and a warm-up
            refs["B"] = references(d, max_tokens)
            swap(d, ckpt["A"], "A-1", "keep")
            assert refs["A"] != refs["B"], "the changed checkpoint answers as the original"

            stop, responses = threading.Event(), []
            threads = [
                threading.Thread(target=client_loop, args=(d.port, n, max_tokens, stop, responses))
                for n in range(args.clients)
            ]
            t_load = time.perf_counter()
            for t in threads:
                t.start()
            time.sleep(settle)
            rows = []
            for i, mode in enumerate(MODES):
                name = "B" if i % 2 == 0 else "A"
                rows.append(swap(d, ckpt[name], f"{name}-{mode}", mode))
                print(mode, rows[-1]["client_s"], rows[-1]["daemon_s"], flush=True)
                time.sleep(settle)
            proc, row = restart(d, proc, ckpt["B"], "B-restart", log, token_file, responses)
            rows.append(row)
            print("restart", row["client_s"], flush=True)
            time.sleep(settle)
            stop.set()
            for t in threads:
                t.join(600)
            t_load_end = time.perf_counter()
        finally:
            benchkit.shutdown(proc)

    tokens = sorted(t for r in responses for t in r.times)
    in_stream = [b - a for r in responses for a, b in zip(r.times, r.times[1:])]
    by_client = {
        n: sorted(t for r in responses if r.client == n for t in r.times) for n in range(args.clients)
    }
    for row in rows:
        _, t0, _, t1 = row.pop("window")  # from the pause to the resume: generation is held
        row["fleet_gap_s"] = round(gap_across(tokens, t0, t1), 3)
        row["client_gap_s"] = round(max(gap_across(ts, t0, t1) for ts in by_client.values()), 3)
    base = rows[-1]["fleet_gap_s"]
    check = mixed(responses, refs)
    doc = {
        **benchkit.header("weights", load_before),
        "settings": {
            "clients": args.clients,
            "max_tokens": max_tokens,
            "quick": args.quick,
            "settle_s": settle,
        },
        "load": {
            "seconds": round(t_load_end - t_load, 1),
            "responses": sum(1 for r in responses if r.fingerprints),
            "tokens": len(tokens),
            "cut": sum(1 for r in responses if r.fingerprints and (r.error or r.finish == "abort")),
            "refused": sum(1 for r in responses if not r.fingerprints),  # the restart's closed port
            "inter_token_gap_s": {
                "p50": round(statistics.median(in_stream), 4) if in_stream else 0.0,
                "p99": round(pct(in_stream, 0.99), 4),
                "max": round(max(in_stream, default=0.0), 4),
            },
        },
        "updates": rows,
        "restart_vs_swap_fleet_gap": {
            r["mode"]: round(base / r["fleet_gap_s"], 1) if r["fleet_gap_s"] else None for r in rows[:-1]
        },
        "mixed_version_responses": check,
    }
    path = benchkit.write(args.output or benchkit.default_path(HERE / "results", "weights"), doc)
    swaps = ", ".join(
        f"{r['mode']} stage {r['client_s']['stage']:.2f}s swap {r['client_s']['swap']:.3f}s gap {r['fleet_gap_s']:.2f}s"
        for r in rows[:-1]
    )
    print(
        f"{swaps}; restart gap {base:.2f}s ({doc['restart_vs_swap_fleet_gap']}x); "
        f"token gap p99 {doc['load']['inter_token_gap_s']['p99']}s; mixed {check['count']} ({path.name})"
    )
    return 0 if check["count"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
