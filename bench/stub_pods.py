"""Stub inference pods for the router benches (bench/router_cost.py, bench/router_loads.py): each port a
raw asyncio HTTP/1.1 server (keep-alive; up to 8 ports in one process) that answers OpenAI chat completions
and completions: a JSON reply with usage, or, for `"stream": true`, `--chunks` server-sent events sent one
per write a little apart (as an engine emits tokens), then the usage event and [DONE].

With `--kv-events` each port keeps a prefix cache as a kvpilot daemon would and publishes it as one does
(`GET /kv_events`, a PUB and a replay socket, the daemon's own publisher): a BlockStored for each full block
of a prompt it had not stored yet (keyed as the daemon keys it), a BlockRemoved for the least recently used
block past its pool of `--blocks`, and the reply's `cached_tokens` for the blocks it had. So a prefix-aware
kvpilot router is fed by KV events, as in a real fleet. `--prefill-us-per-token` makes a port take that long
per prompt token it did not have cached before it answers, one prompt at a time (an engine's prefill: what
a cache hit saves), so time to first token depends on where a router sends each prompt.

Beyond an engine's endpoints: `POST /reset_prefix_cache` empties the cache (published, as a daemon's reset
is) and `POST /stub/restart` empties it as a process restart does: the publisher is closed and a new one
binds the same endpoints, so the event stream starts again from sequence 0 with nothing to replay.

    .venv/bin/python -P bench/stub_pods.py --worker 8001,8002 --kv-events --blocks 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.append(str(Path(__file__).resolve().parents[1] / "hack" / "lib"))  # benchkit, devcluster

import benchkit
from devcluster.procs import free_port

ROOT = Path(__file__).resolve().parent.parent
MODEL = "stub"
BLOCK_SIZE = 16


def _usage(prompt_tokens: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 4,
        "total_tokens": prompt_tokens + 4,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def _reply(path: str, prompt_tokens: int, cached: int) -> bytes:
    if path.startswith("/v1/completions"):
        choice: dict = {"index": 0, "text": " Hi there!", "logprobs": None, "finish_reason": "stop"}
        doc = {"id": "cmpl-stub", "object": "text_completion", "created": 0, "model": MODEL}
    else:
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": "Hi there!"},
            "finish_reason": "stop",
        }
        doc = {"id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": MODEL}
    return json.dumps(doc | {"choices": [choice], "usage": _usage(prompt_tokens, cached)}).encode()


def _event(doc: dict) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


class _Cache:
    """One stub port's KV cache as a kvpilot daemon would publish it: the daemon's own publisher (PUB and
    replay sockets), a BlockStored for each full block of a prompt not stored before, keyed as the daemon
    keys it (the router's prompt reader, which is the daemon's tokenizer, template and key function), and a
    BlockRemoved for the least recently used block past the pool's `blocks`."""

    def __init__(self, reader: object, blocks: int) -> None:
        self.reader = reader
        self.blocks = blocks
        self.pub = self._publisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*")
        self.info = json.dumps(self.pub.describe("127.0.0.1")).encode()
        self.stored: OrderedDict = OrderedDict()

    def _publisher(self, endpoint: str, replay: str):  # noqa: ANN202
        from kvpilot.daemon.engine.kv.publisher import KVEventPublisher

        return KVEventPublisher(endpoint, replay, block_size=BLOCK_SIZE, blocks_total=self.blocks)

    def serve(self, path: str, body: bytes) -> tuple[int, int]:
        """Store the prompt's blocks (publishing the new ones); (its tokens, those it found cached)."""
        scheme = (BLOCK_SIZE, None, self.pub.keys, None)
        prompts = self.reader._prepare(path, body, {scheme})  # type: ignore[attr-defined]
        if prompts is None:
            return 0, 0
        chain, ids = prompts.block_keys(scheme)[0], prompts.token_ids[0]
        cached = 0
        while cached < len(chain) and chain[cached] in self.stored:
            self.stored.move_to_end(chain[cached])
            cached += 1
        rec = self.pub.recorder
        # room first, as an engine frees blocks before it fills them: the pool never holds more than its
        # size, nor do its events say so (a router empties the entry of a rank past its blocks_total)
        end = max(min(len(chain), self.blocks), cached)  # a prompt past the pool keeps its first blocks
        while len(self.stored) > self.blocks - (end - cached):  # (its own cached blocks are the newest)
            rec.block_removed(self.stored.popitem(last=False)[0])
        for i in range(cached, end):
            rec.block_stored(chain, i, ids)
            self.stored[chain[i]] = None
        self.pub.flush()
        return len(ids), cached * BLOCK_SIZE

    def clear(self) -> None:
        """Empty the cache, as a reset does (an AllBlocksCleared)."""
        self.stored.clear()
        self.pub.recorder.all_cleared()
        self.pub.flush()

    async def restart(self) -> None:
        """Empty the cache as a restarted daemon has it: a new publisher on the same endpoints (its
        sequence from 0, nothing to replay), the old one's subscribers cut off."""
        self.stored.clear()
        endpoint, replay = self.pub.endpoint, self.pub.replay_endpoint
        self.pub.close()
        for _ in range(50):  # the old sockets close on the publisher's thread: the ports free soon after
            try:
                self.pub = self._publisher(endpoint, replay)
                return
            except Exception:  # noqa: BLE001 (zmq's address in use)
                await asyncio.sleep(0.1)
        raise RuntimeError(f"the stub's KV event endpoints {endpoint}, {replay} stayed taken")


async def serve_ports(
    ports: list[int], gap_s: float, chunks: int, kv_events: bool, blocks: int, prefill_s_per_token: float
) -> None:
    reader = None
    if kv_events:
        # the checkout's root (put on the path by hack/lib's helpers) holds a `kernels` folder that would
        # shadow the package of that name transformers imports
        sys.path[:] = [p for p in sys.path if p and Path(p).resolve() != ROOT]
        from kvpilot.router.routing.prompts import PromptReader

        reader = PromptReader(None, workers=1)
    delta = _event(
        {
            "id": "chatcmpl-stub",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
        }
    )

    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    def handler(cache: _Cache | None):  # noqa: ANN202
        prefill = asyncio.Lock()  # one prompt computed at a time

        async def answer(path: str, body: bytes) -> tuple[int, int]:
            if cache is None:
                return 12, 0
            if not prefill_s_per_token:
                return cache.serve(path, body)
            async with prefill:
                tokens, cached = cache.serve(path, body)
                await asyncio.sleep((tokens - cached) * prefill_s_per_token)
            return tokens, cached

        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while True:
                    head = await reader.readuntil(b"\r\n\r\n")
                    lines = head.decode("latin-1").split("\r\n")
                    method, path, _ = lines[0].split(" ", 2)
                    length = 0
                    for line in lines[1:]:
                        if line[:15].lower() == "content-length:":
                            length = int(line[15:])
                    body = await reader.readexactly(length) if length else b""
                    if method == "POST" and path.startswith(("/v1/chat/completions", "/v1/completions")):
                        tokens, cached = await answer(path, body)
                        req = json.loads(body)
                        if req.get("stream"):
                            writer.write(
                                b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                                b"Cache-Control: no-cache\r\nTransfer-Encoding: chunked\r\n\r\n"
                            )
                            n = chunks  # not the body's max_tokens: sglang-router rewrites that field
                            for _ in range(n):
                                writer.write(chunk(delta))
                                await writer.drain()
                                await asyncio.sleep(gap_s)
                            done = {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "model": MODEL}
                            done |= {
                                "choices": [],
                                "usage": _usage(tokens, cached) | {"completion_tokens": n},
                            }
                            writer.write(chunk(_event(done) + b"data: [DONE]\n\n") + b"0\r\n\r\n")
                            await writer.drain()
                            continue
                        status, out = b"200 OK", _reply(path, tokens, cached)
                    elif method == "POST" and path.startswith("/reset_prefix_cache"):
                        if cache is not None:
                            cache.clear()
                        status, out = b"200 OK", b'{"success": true}'
                    elif method == "POST" and path.startswith("/stub/restart"):
                        if cache is not None:
                            await cache.restart()
                        status, out = b"200 OK", b'{"success": true}'
                    elif method == "GET" and path.startswith("/kv_events"):
                        if cache is not None:
                            status, out = b"200 OK", cache.info
                        else:
                            status, out = b"404 Not Found", b'{"error": "no kv events"}'
                    elif method == "GET" and path.startswith("/v1/models"):
                        status, out = (
                            b"200 OK",
                            b'{"object": "list", "data": [{"id": "stub", "object": "model"}]}',
                        )
                    else:  # /health, /health_generate, /get_model_info, /get_server_info, ...
                        status, out = b"200 OK", b'{"status": "ok", "model_path": "stub"}'
                    writer.write(
                        b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                        % (status, len(out), out)
                    )
                    await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError, ValueError):
                pass
            finally:
                writer.close()

        return handle

    servers = [
        await asyncio.start_server(
            handler(_Cache(reader, blocks) if reader is not None else None), "127.0.0.1", p, backlog=1024
        )
        for p in ports
    ]
    await asyncio.gather(*(s.serve_forever() for s in servers))


def start_stub_pods(
    n: int,
    tmp: Path,
    *,
    chunks: int = 0,
    chunk_gap_ms: float = 1.0,
    kv_events: bool = False,
    blocks: int = 2048,
    prefill_us_per_token: float = 0.0,
) -> tuple[list[subprocess.Popen], list[str]]:
    """n stub pods, 8 ports to a process (a process each would cost 64 interpreters at 64 pods); their
    processes and URLs."""
    ports = [free_port() for _ in range(n)]
    procs = []
    for i in range(0, n, 8):
        group = ports[i : i + 8]
        # -P: bench/ not first on the path (its files' names are not the packages' of those names)
        argv = [sys.executable, "-P", __file__, "--worker", ",".join(map(str, group))]
        argv += ["--chunk-gap-ms", str(chunk_gap_ms), "--chunks", str(chunks), "--blocks", str(blocks)]
        argv += ["--prefill-us-per-token", str(prefill_us_per_token)]
        if kv_events:
            argv.append("--kv-events")
        log = tmp / f"stub-pods-{group[0]}.log"
        procs.append(benchkit.launch(argv, log, f"http://127.0.0.1:{group[-1]}", 120))
    return procs, [f"http://127.0.0.1:{p}" for p in ports]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", metavar="PORT[,PORT...]", required=True, help="the ports to serve")
    ap.add_argument("--chunks", type=int, default=64, help="events of a streamed reply")
    ap.add_argument("--chunk-gap-ms", type=float, default=1.0, help="the pause between events")
    ap.add_argument("--kv-events", action="store_true", help="keep a prefix cache and publish its events")
    ap.add_argument("--blocks", type=int, default=2048, help=f"each port's pool, blocks of {BLOCK_SIZE}")
    ap.add_argument("--prefill-us-per-token", type=float, default=0.0, help="per uncached prompt token")
    args = ap.parse_args()
    ports = [int(p) for p in args.worker.split(",")]
    gap_s, per_token_s = args.chunk_gap_ms / 1000, args.prefill_us_per_token / 1e6
    asyncio.run(serve_ports(ports, gap_s, args.chunks, args.kv_events, args.blocks, per_token_s))


if __name__ == "__main__":
    main()
