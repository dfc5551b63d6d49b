"""Zero-trust figures (issue 43): what hostile input costs a daemon, a router and the disk tier, measured the
same way on the code before the hardening and after it. Run it once per checkout, with `--label`.

1. `salt`: a `kvpilot serve` with `--kv-offloading-dir` capped at 10 MiB and a small KV cache (so blocks go
   to disk), N one-token requests each with a distinct `cache_salt`, a full reset (`POST
   /reset_prefix_cache`), N more. The daemon's RSS and the directory's bytes on disk (and its directories)
   after each step. Two phases, each on a fresh daemon and directory: salts of 4 MiB (less 16 KiB, so the
   body fits the 4 MiB body cap) and salts of 4,096 characters (the longest the hardened daemon accepts).
   Every reply's status is counted.
2. `ranks`: a fake pod (this process: aiohttp and ZeroMQ PUB/ROUTER sockets on loopback) in front of a
   `kvpilot router`, claiming 16 ranks, first all on one PUB socket, then each on its own; it publishes K
   random block keys on every socket. The router's RSS before and after, and the blocks its index holds for
   the pod (its /health), or what it does instead.
3. `picker`: a `kvpilot router --endpoint-picker-port` in front of two fake pods, spoken to over gRPC
   (Envoy's ext_proc) on 3 connections: S streams each sending a body of 4 MiB (less 64 KiB) it has not
   ended (FULL_DUPLEX_STREAMED), held, then ended; and M streams each picked (BUFFERED) and held open, as a
   gateway holds a request in flight. The router's peak RSS and what each stream got.
4. `tier`: the disk tier (`DiskTier`, in a child process each) started over a directory whose
   `manifest.json` is a link to /dev/zero, or a FIFO, or whose current `gen-N` is a link to a directory
   holding a sentinel file; the time and peak RSS to start (a child past `--tier-timeout` or
   `--tier-rss-cap-mb` is killed and said so), and whether the sentinel is still there.

The checkout is the one this file is in: the script and every server it starts import that tree's
`kvpilot` even where the virtual environment's editable install points at another checkout (its finder is
pointed here). One JSON file: bench/results/zero-trust-<label>-YYYYmmdd-HHMMSS.json, with the tree's commit.

    python bench/zero_trust.py --label after                 # N=150, K=1M keys, S=250, M=2,500
    python bench/zero_trust.py --label before --quick        # N=20, K=100k, S=40, M=300
    python bench/zero_trust.py --label after --only tier,ranks
"""

from __future__ import annotations

import os
import sys


def _use_tree(root: str) -> None:
    """Point an editable install's finder (setuptools' `__editable___kvpilot_*_finder`) at `root`: its
    `kvpilot`, `kvpilot.daemon`, `kvpilot.router`... are then this tree's."""
    for name, mod in list(sys.modules.items()):
        mapping = getattr(mod, "MAPPING", None)
        if name.startswith("__editable__") and isinstance(mapping, dict) and "kvpilot" in mapping:
            for k, v in list(mapping.items()):
                mapping[k] = os.path.join(root, os.path.basename(v))


ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_use_tree(ROOT_DIR)

# `python -c BOOT ROOT ARGS...`: `kvpilot ARGS` run from the tree ROOT (as `_use_tree` does for this process).
BOOT = (
    "import os, runpy, sys\n"
    "root = sys.argv.pop(1)\n"
    "sys.path[:] = [p for p in sys.path if p not in ('', os.getcwd(), root)]\n"
    "for n, m in list(sys.modules.items()):\n"
    "    mp = getattr(m, 'MAPPING', None)\n"
    "    if n.startswith('__editable__') and isinstance(mp, dict) and 'kvpilot' in mp:\n"
    "        for k, v in list(mp.items()):\n"
    "            mp[k] = os.path.join(root, os.path.basename(v))\n"
    "import kvpilot.daemon, kvpilot.router\n"
    "print('zero_trust: kvpilot.daemon from', kvpilot.daemon.__file__, flush=True)\n"
    "sys.argv[0] = 'kvpilot'\n"
    "runpy.run_module('kvpilot', run_name='__main__', alter_sys=True)\n"
)

import argparse  # noqa: E402
import asyncio  # noqa: E402
import http.client  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import urllib.error  # noqa: E402
import urllib.parse  # noqa: E402
import urllib.request  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(ROOT_DIR)
sys.path.append(str(ROOT / "hack" / "lib"))  # benchkit, devcluster
import benchkit  # noqa: E402
from devcluster.procs import free_port, spawn, stop, wait_ready  # noqa: E402

RESULTS = Path(__file__).parent / "results"
TOKEN = "zero-trust-admin-token"
MIB = 1 << 20
PROMPT_WORDS = (
    "Summarise the tenancy agreement for the harbour office: rent is due on the first of each month, "
    "the deposit equals two months of rent, repairs above two hundred euros need written consent, and "
    "either party may end the lease with three months of notice."
)


# ---- processes and their memory ---------------------------------------------------------------------
def proc_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (KiB) of `pid` from /proc; {} once it is gone."""
    out = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "VmHWM:")):
                out[line.split(":")[0]] = int(line.split()[1])
    except OSError:
        pass
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and every live process below it, in MB (10^6 bytes)."""
    return round(sum(proc_status(p).get("VmRSS", 0) for p in benchkit.tree_pids(pid)) * 1024 / 1e6, 1)


def hwm_mb(pid: int) -> float:
    """The peak resident memory of `pid` itself (VmHWM), in MB."""
    return round(proc_status(pid).get("VmHWM", 0) * 1024 / 1e6, 1)


class PeakSampler:
    """The highest `rss_mb(pid)` seen, sampled every `interval` s on a thread while the block runs."""

    def __init__(self, pid: int, interval: float = 0.1) -> None:
        self.pid, self.interval, self.peak = pid, interval, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_mb(self.pid))
            self._stop.wait(self.interval)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss_mb(self.pid))


def get_json(url: str, timeout: float = 10) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:  # /health answers 503 with a body
        return json.loads(e.read())


@contextmanager
def kvpilot(command: str, args: list[str], log: Path, ready: Callable[[str], bool], timeout: float = 300):
    """`kvpilot COMMAND --host 127.0.0.1 --port FREE ARGS` of this tree, in its own process group; yields
    (url, process) once `ready(url)` holds, stops the group when the block ends."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-c", BOOT, ROOT_DIR, command, "--host", "127.0.0.1", "--port", str(port), *args]
    env = {k: v for k, v in os.environ.items() if k != "KVPILOT_ADMIN_TOKEN"}
    proc = spawn(argv, log_path=log, env=env, cwd=str(log.parent))
    try:
        wait_ready(proc, lambda: ready(url), timeout, f"kvpilot {command}", log)
        boot = [x for x in log.read_text(errors="replace").splitlines() if x.startswith("zero_trust:")]
        if not boot or ROOT_DIR + os.sep not in boot[0]:
            raise RuntimeError(f"kvpilot {command} did not run this tree's code: {boot}")
        yield url, proc
    finally:
        stop(proc, grace=20, leader_only=True)


def supported_flags(command: str) -> set[str]:
    """The long options `kvpilot COMMAND --help` names (this tree's)."""
    out = subprocess.run(
        [sys.executable, "-c", BOOT, ROOT_DIR, command, "--help"], capture_output=True, text=True, check=True
    ).stdout
    return {w.strip("[],") for w in out.split() if w.strip("[],").startswith("--")}


# ---- 1. cache_salt --------------------------------------------------------------------------------
def disk_usage(root: Path) -> dict:
    """Bytes (apparent and allocated) of every file under `root`, its directories, its files."""
    size = alloc = dirs = files = 0
    for base, dnames, fnames in os.walk(root):
        dirs += len(dnames)
        for name in fnames:
            try:
                st = os.lstat(os.path.join(base, name))
            except OSError:
                continue
            files += 1
            size += st.st_size
            alloc += st.st_blocks * 512
    return {
        "bytes": size,
        "mb": round(size / 1e6, 2),
        "allocated_mb": round(alloc / 1e6, 2),
        "dirs": dirs,
        "files": files,
    }


def settled_usage(root: Path, timeout: float = 20) -> dict:
    """disk_usage once two readings half a second apart agree (the tier writes on a thread of its own)."""
    last, deadline = disk_usage(root), time.monotonic() + timeout
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = disk_usage(root)
        if now == last:
            break
        last = now
    return last


def post(
    url: str, path: str, body: bytes, headers: dict | None = None, timeout: float = 300
) -> tuple[int, bytes]:
    u = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=timeout)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def salted_requests(url: str, first: int, n: int, salt_chars: int) -> dict:
    """n one-token completions, request i salted with a salt of `salt_chars` characters of its own."""
    statuses: dict[str, int] = {}
    first_error = None
    start = time.perf_counter()
    for i in range(first, first + n):
        tag = f"{i:06d}-"
        body = {
            "prompt": f"Request {i}. {PROMPT_WORDS}",
            "max_tokens": 1,
            "temperature": 0,
            "cache_salt": tag + "s" * (salt_chars - len(tag)),
        }
        status, reply = post(url, "/v1/completions", json.dumps(body).encode())
        statuses[str(status)] = statuses.get(str(status), 0) + 1
        if status != 200 and first_error is None:
            first_error = reply[:300].decode(errors="replace")
    return {"statuses": statuses, "first_error": first_error, "s": round(time.perf_counter() - start, 2)}


def salt_phase(tmp: Path, n: int, salt_chars: int, blocks: int, dir_mib: float) -> dict:
    kv = tmp / "kv"
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    args = ["--admin-token-file", str(token), "--num-gpu-blocks-override", str(blocks)]
    args += ["--kv-offloading-dir", str(kv), "--kv-offloading-dir-size", repr(dir_mib / 1024)]
    log = tmp / f"serve-{salt_chars}.log"
    out: dict = {"salt_chars": salt_chars, "requests_per_step": n}

    def step(name: str, pid: int, extra: dict) -> None:
        out[name] = {"rss_mb": rss_mb(pid), "disk": settled_usage(kv), **extra}
        print(f"  salt {salt_chars:>8} {name:>12}: {json.dumps(out[name])}", flush=True)

    def healthy(url: str) -> bool:
        return bool(benchkit.health(url) is not None)

    with kvpilot("serve", args, log, healthy) as (url, proc):
        status, _ = post(
            url, "/v1/completions", json.dumps({"prompt": PROMPT_WORDS, "max_tokens": 1}).encode()
        )
        assert status == 200, status
        step("start", proc.pid, {})
        with PeakSampler(proc.pid) as peak:
            step("after_n", proc.pid, salted_requests(url, 0, n, salt_chars))
            start = time.perf_counter()
            status, reply = post(url, "/reset_prefix_cache", b"{}", {"Authorization": f"Bearer {TOKEN}"})
            step("after_reset", proc.pid, {"status": status, "s": round(time.perf_counter() - start, 2)})
            step("after_2n", proc.pid, salted_requests(url, n, n, salt_chars))
        out["peak_rss_mb"] = peak.peak
        out["vmhwm_mb"] = hwm_mb(proc.pid)
    return out


def finding_salt(args: argparse.Namespace) -> dict:
    big = 4 * MIB - 16 * 1024  # a body of 4 MiB at most: the daemons' default body cap
    doc = {
        "config": {
            "requests_per_step": args.requests,
            "kv_blocks": args.kv_blocks,
            "offloading_dir_cap_mib": args.dir_mib,
            "block_bytes": 737_280,
        }
    }
    for name, chars in (("salt_4MiB", big), ("salt_4096", 4096)):
        with tempfile.TemporaryDirectory(prefix="zt-salt-") as tmp:
            doc[name] = salt_phase(Path(tmp), args.requests, chars, args.kv_blocks, args.dir_mib)
    return doc


# ---- a fake pod: /health, /kv_events, ZeroMQ PUB and ROUTER sockets ----------------------------------
class FakePod:
    """A kvpilot pod as the router sees it, run by a thread of this process: /health 200, /kv_events naming
    `ranks` ranks on `sockets` PUB sockets (rank i on socket i % sockets, each with its replay socket), and
    whatever batches `publish` is given, live and in each socket's replay buffer."""

    def __init__(self, ranks: int = 1, sockets: int = 1, blocks_total: int = 10**9) -> None:
        self.ranks, self.sockets, self.blocks_total = ranks, sockets, blocks_total
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-pod", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fake pod did not start")

    def publish(self, payloads: list[bytes], sockets: list[int] | None = None) -> None:
        """Each payload, in order, on every socket (or those listed)."""
        asyncio.run_coroutine_threadsafe(self._publish(payloads, sockets), self._loop).result(600)

    def stop(self) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._main())

    async def _main(self) -> None:
        import zmq
        import zmq.asyncio
        from aiohttp import web

        self._stop = asyncio.Event()
        ctx = zmq.asyncio.Context()
        self._pubs, self._routers, self.endpoints, self.replays = [], [], [], []
        self._buffers: list[list[bytes]] = []
        for _ in range(self.sockets):
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.SNDHWM, 0)
            pub.bind("tcp://127.0.0.1:*")
            rt = ctx.socket(zmq.ROUTER)
            rt.bind("tcp://127.0.0.1:*")
            self._pubs.append(pub)
            self._routers.append(rt)
            self.endpoints.append(pub.getsockopt_string(zmq.LAST_ENDPOINT))
            self.replays.append(rt.getsockopt_string(zmq.LAST_ENDPOINT))
            self._buffers.append([])
        app = web.Application()
        app.router.add_get("/health", lambda r: web.Response(text="ok"))
        app.router.add_get("/kv_events", self._kv_events)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.name = f"127.0.0.1:{self.port}"
        serving = [asyncio.create_task(self._serve_replays(i)) for i in range(self.sockets)]
        self._ready.set()
        await self._stop.wait()
        for t in serving:
            t.cancel()
        await asyncio.gather(*serving, return_exceptions=True)
        await runner.cleanup()
        for s in self._pubs + self._routers:
            s.close(linger=0)
        ctx.term()

    async def _kv_events(self, request: object) -> object:
        from aiohttp import web

        ranks = [
            {
                "rank": i,
                "endpoint": self.endpoints[i % self.sockets],
                "replay_endpoint": self.replays[i % self.sockets],
                "blocks_total": self.blocks_total,
            }
            for i in range(self.ranks)
        ]
        return web.json_response(
            {
                "endpoint": self.endpoints[0],
                "replay_endpoint": self.replays[0],
                "topic": "",
                "format": "vllm",
                "block_size": 16,
                "blocks_total": self.blocks_total,
                "buffer_batches": 10_000,
                "buffer_bytes": 64 * MIB,
                "ranks": ranks,
            }
        )

    async def _publish(self, payloads: list[bytes], sockets: list[int] | None) -> None:
        for i in sockets if sockets is not None else range(self.sockets):
            buf = self._buffers[i]
            for payload in payloads:
                seq = len(buf)
                buf.append(payload)
                await self._pubs[i].send_multipart([b"", seq.to_bytes(8, "big", signed=True), payload])
            await asyncio.sleep(0)

    async def _serve_replays(self, i: int) -> None:
        rt, buf = self._routers[i], self._buffers[i]
        while True:
            client, _, start = await rt.recv_multipart()
            first = int.from_bytes(start, "big", signed=True)
            for seq in range(max(first, 0), len(buf)):
                await rt.send_multipart([client, b"", b"", seq.to_bytes(8, "big", signed=True), buf[seq]])
            await rt.send_multipart([client, b"", b"", (-1).to_bytes(8, "big", signed=True), b""])


@contextmanager
def fake_pods(n: int, **kw: int) -> Iterator[list[FakePod]]:
    pods = []
    try:
        for _ in range(n):
            pods.append(FakePod(**kw))
        yield pods
    finally:
        for p in pods:
            p.stop()


def key_batches(keys: int, seed_bytes: bytes | None = None) -> list[bytes]:
    """`keys` random 32-byte block keys as BlockStored batches, through the daemon's own encoder: events of
    1,024 keys (the most one event may carry), 25 events a batch (~0.9 MB, under the 1 MiB payload cap)."""
    from kvpilot.kv.events import BlockStored, EventBatch, encode_batch

    raw = seed_bytes or os.urandom(32 * keys)
    hashes = [raw[i : i + 32] for i in range(0, 32 * keys, 32)]
    events = [BlockStored(hashes[i : i + 1024], None, [], 16) for i in range(0, keys, 1024)]
    return [encode_batch(EventBatch(0.0, events[i : i + 25])) for i in range(0, len(events), 25)]


# ---- 2. ranks ---------------------------------------------------------------------------------------
def pod_health(url: str, name: str) -> dict:
    return next((p for p in get_json(url + "/health").get("pods", []) if p["pod"] == name), {})


def ranks_case(tmp: Path, ranks: int, sockets: int, keys: int, settle_s: float) -> dict:
    token = tmp / "token"
    token.write_text(TOKEN + "\n")
    out: dict = {"ranks": ranks, "pub_sockets": sockets, "keys_per_socket": keys}
    with fake_pods(1, ranks=ranks, sockets=sockets) as (pod,):
        log = tmp / f"router-{sockets}.log"
        args = ["--endpoints", pod.url, "--admin-token-file", str(token)]

        def up(url: str) -> bool:
            return get_json(url + "/health").get("status") == "ok"

        with kvpilot("router", args, log, up) as (url, proc):
            # Events on and every rank synced, or the router's refusal (then the pod is routed by load).
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                h = pod_health(url, pod.name)
                if h.get("kv_events") == "on" and h.get("synced"):
                    break
                if "is unusable" in log.read_text(errors="replace"):
                    time.sleep(3)  # a probe or two more: the refusal stands
                    break
                time.sleep(0.5)
            h = pod_health(url, pod.name)
            out["pod_before"] = {
                k: h.get(k) for k in ("ready", "kv_events", "synced", "ranks", "indexed_blocks")
            }
            # Past the slow-joiner window: one key a socket until the index has one per rank.
            following = h.get("kv_events") == "on"
            probes, deadline = 0, time.monotonic() + 30
            while following and time.monotonic() < deadline:
                pod.publish(key_batches(1))
                probes += 1
                time.sleep(0.5)
                if pod_health(url, pod.name).get("indexed_blocks", 0) >= ranks:
                    break
            out["probe_batches"] = probes
            time.sleep(1)
            out["router_rss_mb_before"] = rss_mb(proc.pid)
            payloads = key_batches(keys)
            out["batches_per_socket"] = len(payloads)
            out["payload_mb_per_socket"] = round(sum(map(len, payloads)) / 1e6, 1)
            start = time.monotonic()
            with PeakSampler(proc.pid) as peak:
                pod.publish(payloads)
                published = time.monotonic() - start
                # Until the pod's indexed blocks stop moving for settle_s (or 600 s pass).
                last, since, deadline = -1, time.monotonic(), time.monotonic() + 600
                slowest, timeouts = 0.0, 0
                while time.monotonic() < deadline:
                    asked = time.monotonic()
                    try:
                        n = pod_health(url, pod.name).get("indexed_blocks", 0)
                    except OSError:  # /health did not answer within 10 s: the router is busy
                        timeouts += 1
                        continue
                    finally:
                        slowest = max(slowest, time.monotonic() - asked)
                    if n != last:
                        last, since = n, time.monotonic()
                    elif time.monotonic() - since > settle_s:
                        break
                    time.sleep(0.5)
            out["published_s"] = round(published, 2)
            out["health_slowest_s"] = round(slowest, 2)
            out["health_timeouts_10s"] = timeouts
            out["indexed_s"] = round(since - start, 2) if last > 0 else None
            out["router_rss_mb_after"] = rss_mb(proc.pid)
            out["router_peak_rss_mb"] = peak.peak
            out["router_vmhwm_mb"] = hwm_mb(proc.pid)
            h = pod_health(url, pod.name)
            out["pod_after"] = {
                k: h.get(k) for k in ("ready", "kv_events", "synced", "ranks", "indexed_blocks")
            }
            said = [x for x in log.read_text(errors="replace").splitlines() if "WARNING" in x or "ERROR" in x]
            out["router_warnings"] = [x[-300:] for x in dict.fromkeys(said)][:5]
    print(f"  ranks {ranks} on {sockets} socket(s): {json.dumps(out)}", flush=True)
    return out


def finding_ranks(args: argparse.Namespace) -> dict:
    doc: dict = {"config": {"keys_per_socket": args.keys, "ranks": 16}}
    for name, sockets in (("one_socket", 1), ("own_sockets", 16)):
        with tempfile.TemporaryDirectory(prefix="zt-ranks-") as tmp:
            doc[name] = ranks_case(Path(tmp), 16, sockets, args.keys, args.settle)
    return doc


# ---- 3. endpoint picker -----------------------------------------------------------------------------
PROCESS = "/envoy.service.ext_proc.v3.ExternalProcessor/Process"


def _picker_messages() -> tuple:
    from envoy.config.core.v3 import base_pb2
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    modes = processing_mode_pb2.ProcessingMode

    def headers(mode: int) -> object:
        return ep.ProcessingRequest(
            request_headers=ep.HttpHeaders(
                headers=base_pb2.HeaderMap(
                    headers=[
                        base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions"),
                        base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                    ]
                )
            ),
            protocol_config=ep.ProtocolConfiguration(request_body_mode=mode),
        )

    def body(raw: bytes, end: bool) -> object:
        return ep.ProcessingRequest(request_body=ep.HttpBody(body=raw, end_of_stream=end))

    return ep, modes, headers, body


def _chat(i: int) -> bytes:
    msgs = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": f"Hello {i}"},
    ]
    return json.dumps({"model": "m", "messages": msgs, "max_tokens": 1}).encode()


def _outcome(reply: object) -> str:
    kind = reply.WhichOneof("response")
    if kind == "immediate_response":
        return f"immediate_{reply.immediate_response.status.code}"
    common = getattr(reply, kind).response
    return "picked" if common.header_mutation.set_headers else f"{kind}_answer"


def _rpc_outcome(exc: BaseException) -> str:
    code = getattr(exc, "code", None)
    return f"rpc_{code().name}" if callable(code) else f"error_{type(exc).__name__}"


async def _channels(port: int, n: int) -> list:
    import grpc

    opts = [
        ("grpc.use_local_subchannel_pool", 1),  # a connection each
        ("grpc.max_receive_message_length", 64 * MIB),
        ("grpc.max_send_message_length", 64 * MIB),
    ]
    return [grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=opts) for _ in range(n)]


async def picker_bodies(
    port: int, streams: int, body_bytes: int, conns: int, hold_s: float, pid: int, rss_guard_mb: float
) -> dict:
    """`streams` FULL_DUPLEX_STREAMED requests, each a body chunk of `body_bytes` not ended, held `hold_s`
    after the last is sent, then each ended with a JSON object (the whole body: whitespace, then it)."""
    ep, modes, headers, body = _picker_messages()
    channels = await _channels(port, conns)
    padding = body(b" " * body_bytes, False)
    head = headers(modes.FULL_DUPLEX_STREAMED)
    calls, outcomes = [], {}
    tasks = []

    async def read_all(call: object, i: int) -> None:
        got = []
        try:
            async for reply in call:
                got.append(_outcome(reply))
                if got[-1] != "picked" and not got[-1].startswith("request_body"):
                    break
        except Exception as exc:  # noqa: BLE001 - any end of the stream is an outcome
            got.append(_rpc_outcome(exc))
        outcomes[i] = got

    try:
        start = time.perf_counter()
        stopped_at = None
        for i in range(streams):
            if rss_mb(pid) > rss_guard_mb:  # this machine's bound, not the router's: said in the results
                stopped_at = i
                break
            stub = channels[i % conns].stream_stream(
                PROCESS,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=ep.ProcessingResponse.FromString,
            )
            call = stub(timeout=600)
            calls.append(call)
            tasks.append(asyncio.create_task(read_all(call, i)))
            try:
                await call.write(head)
                await call.write(padding)
            except Exception as exc:  # noqa: BLE001
                outcomes.setdefault(i, [_rpc_outcome(exc)])
        sent_s = time.perf_counter() - start
        rss_sent = rss_mb(pid)
        await asyncio.sleep(hold_s)
        rss_held = rss_mb(pid)
        early = {i: o[:] for i, o in outcomes.items()}
        # Ended one at a time (its pick, its body back, its end awaited): the router's memory then goes
        # down stream by stream instead of every pick at once.
        for i, call in enumerate(calls):
            if i in outcomes:
                continue
            try:
                await call.write(body(_chat(i), True))
                await call.done_writing()
            except Exception as exc:  # noqa: BLE001
                outcomes.setdefault(i, [_rpc_outcome(exc)])
            await asyncio.wait([tasks[i]], timeout=60)
        ended_s = time.perf_counter() - start
    finally:
        for call in calls:
            call.cancel()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for c in channels:
            await c.close()

    def tally(d: dict) -> dict:
        counts: dict[str, int] = {}
        for o in d.values():
            k = o[0] if o else "nothing"
            if "picked" in o:
                k = "picked"
            counts[k] = counts.get(k, 0) + 1
        return counts

    return {
        "streams": streams,
        "body_bytes": body_bytes,
        "connections": conns,
        "sent_s": round(sent_s, 2),
        "stopped_opening_at_stream": stopped_at,
        "rss_guard_mb": rss_guard_mb,
        "router_rss_mb_all_sent": rss_sent,
        "router_rss_mb_held": rss_held,
        "answered_before_the_bodies_ended": tally(early),
        "outcomes": tally(outcomes),
        "ended_s": round(ended_s, 2),
    }


async def picker_streams(port: int, streams: int, conns: int, pid: int, url: str) -> dict:
    """`streams` BUFFERED requests, each held open once its answer came (a gateway's request in flight)."""
    import grpc

    ep, modes, headers, body = _picker_messages()
    channels = await _channels(port, conns)
    head = headers(modes.BUFFERED)
    calls, outcomes = [], {}
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        async with gate:
            stub = channels[i % conns].stream_stream(
                PROCESS,
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=ep.ProcessingResponse.FromString,
            )
            call = stub(timeout=600)
            calls.append(call)
            try:
                await call.write(head)
                first = await asyncio.wait_for(call.read(), 60)
                if first is grpc.aio.EOF or _outcome(first).startswith("immediate"):
                    outcomes[i] = "ended" if first is grpc.aio.EOF else _outcome(first)
                    return
                await call.write(body(_chat(i), True))
                reply = await asyncio.wait_for(call.read(), 60)
                outcomes[i] = "ended" if reply is grpc.aio.EOF else _outcome(reply)
            except TimeoutError:
                outcomes[i] = "no_answer_in_60s"
            except Exception as exc:  # noqa: BLE001
                outcomes[i] = _rpc_outcome(exc)
                detail = getattr(exc, "details", None)
                detail = str(detail() if callable(detail) else exc)[:300]
                details.setdefault(outcomes[i], detail)

    details: dict[str, str] = {}
    try:
        start = time.perf_counter()
        with PeakSampler(pid) as peak:
            await asyncio.gather(*(one(i) for i in range(streams)))
            took = time.perf_counter() - start
            in_flight = _in_flight(url)
            await asyncio.sleep(2)
        rss_held = rss_mb(pid)
    finally:
        for call in calls:
            call.cancel()
        for c in channels:
            await c.close()
    counts: dict[str, int] = {}
    for o in outcomes.values():
        counts[o] = counts.get(o, 0) + 1
    return {
        "streams": streams,
        "connections": conns,
        "s": round(took, 2),
        "outcomes": counts,
        "first_error_details": details,
        "router_in_flight_while_held": in_flight,
        "router_rss_mb_held": rss_held,
        "router_peak_rss_mb": peak.peak,
    }


def _in_flight(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        total = 0.0
        for line in r.read().decode().splitlines():
            if line.startswith("kvpilot_router_in_flight_requests{"):
                total += float(line.split()[-1])
    return total


def finding_picker(args: argparse.Namespace) -> dict:
    flags = supported_flags("router")
    doc: dict = {
        "config": {"body_streams": args.body_streams, "held_streams": args.held_streams, "connections": 3},
        "flags_in_this_tree": {
            f: f in flags
            for f in (
                "--endpoint-picker-max-streams",
                "--endpoint-picker-buffer-bytes",
                "--endpoint-picker-hold",
            )
        },
    }
    body_bytes = 4 * MIB - 64 * 1024
    for name in ("bodies", "held_streams"):
        with tempfile.TemporaryDirectory(prefix="zt-picker-") as tmp, fake_pods(2) as pods:
            token = Path(tmp) / "token"
            token.write_text(TOKEN + "\n")
            port = free_port()
            cli = ["--endpoints", ",".join(p.url for p in pods), "--admin-token-file", str(token)]
            cli += ["--endpoint-picker-port", str(port), "--endpoint-picker-timeout", "120"]

            def both_ready(url: str) -> bool:
                pods_h = get_json(url + "/health").get("pods", [])
                return len(pods_h) == 2 and all(p["ready"] for p in pods_h)

            with kvpilot("router", cli, Path(tmp) / "router.log", both_ready) as (url, proc):
                time.sleep(1)
                rss0 = rss_mb(proc.pid)
                if name == "bodies":
                    with PeakSampler(proc.pid) as peak:
                        r = asyncio.run(
                            picker_bodies(
                                port, args.body_streams, body_bytes, 3, args.hold, proc.pid, args.rss_guard_mb
                            )
                        )
                    r["router_peak_rss_mb"] = peak.peak
                else:
                    r = asyncio.run(picker_streams(port, args.held_streams, 3, proc.pid, url))
                r["router_rss_mb_before"] = rss0
                r["router_vmhwm_mb"] = hwm_mb(proc.pid)
                r["router_alive_after"] = (
                    proc.poll() is None and get_json(url + "/health").get("status") == "ok"
                )
                r["bench_process_vmhwm_mb"] = hwm_mb(os.getpid())
            doc[name] = r
            print(f"  picker {name}: {json.dumps(r)}", flush=True)
    return doc


# ---- 4. the disk tier's start -------------------------------------------------------------------------
TIER_CASES = ("plain", "manifest_dev_zero", "manifest_fifo", "gen_link")


def tier_child(case: str, root: Path) -> None:
    """Runs in a child: make the tier's directory for `case`, then time the tier's start over it; one JSON
    line on stdout."""
    import torch

    from kvpilot.daemon.engine.kv.disk_tier import DiskTier

    shape, identity = (2, 2, 4, 1, 8), {"model": "m", "files": [["model.safetensors", 10, 1]]}

    def tier() -> DiskTier:
        return DiskTier(root / "kv", 64 * 2 * 2 * 4 * 8 * 4, shape, torch.float32, identity)

    first = tier()
    gen = first.generation
    first.close()
    outside = root / "outside"
    outside.mkdir()
    (outside / "sentinel.txt").write_text("not the tier's\n")
    manifest = root / "kv" / "manifest.json"
    if case == "manifest_dev_zero":
        manifest.unlink()
        manifest.symlink_to("/dev/zero")
    elif case == "manifest_fifo":
        manifest.unlink()
        os.mkfifo(manifest)
    elif case == "gen_link":
        shutil.rmtree(root / "kv" / f"gen-{gen}")
        (root / "kv" / f"gen-{gen}").symlink_to(outside, target_is_directory=True)
    rss = proc_status(os.getpid()).get("VmRSS", 0)
    print(json.dumps({"phase": "opening", "rss_mb": round(rss * 1024 / 1e6, 1)}), flush=True)
    start = time.perf_counter()
    again = tier()
    took = time.perf_counter() - start
    st = proc_status(os.getpid())
    link = root / "kv" / f"gen-{again.generation}"
    print(
        json.dumps(
            {
                "phase": "opened",
                "open_s": round(took, 3),
                "generation": again.generation,
                "vmhwm_mb": round(st.get("VmHWM", 0) * 1024 / 1e6, 1),
                "sentinel_kept": (outside / "sentinel.txt").exists(),
                "current_gen_is_link": link.is_symlink(),
                "manifest_is_link": manifest.is_symlink(),
            }
        ),
        flush=True,
    )
    again.close()


def tier_case(case: str, timeout: float, rss_cap_mb: float) -> dict:
    with tempfile.TemporaryDirectory(prefix="zt-tier-") as tmp:
        argv = [sys.executable, __file__, "--tier-child", case, tmp]
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        peak, killed, opening_at = 0.0, None, None
        try:
            deadline = time.monotonic() + 120  # the child's imports and setup, then `timeout` for the start
            while proc.poll() is None:
                if opening_at is None and any('"opening"' in x for x in lines):
                    opening_at = time.monotonic()
                    deadline = opening_at + timeout
                peak = max(peak, rss_mb(proc.pid))
                if peak > rss_cap_mb:
                    killed = f"RSS past {rss_cap_mb:g} MB"
                elif time.monotonic() > deadline:
                    killed = f"still starting after {timeout:g} s"
                if killed:
                    os.killpg(proc.pid, 9)
                    break
                time.sleep(0.05)
            proc.wait(30)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait(30)
        ended = time.monotonic()
        reader.join(5)
        err = proc.stderr.read()[-600:] if proc.stderr else ""
        got = {}
        for line in lines:
            try:
                got |= json.loads(line)
            except ValueError:
                pass
        out = {"case": case, "peak_rss_mb": round(peak, 1), "exit": proc.returncode, "killed": killed}
        out |= {k: v for k, v in got.items() if k != "phase"}
        if killed and opening_at is not None:
            out["open_s"] = f">{round(ended - opening_at, 1)} (killed)"
        if proc.returncode not in (0, None) and not killed:
            out["stderr_tail"] = err
        if case == "gen_link" and "sentinel_kept" not in out:
            out["sentinel_kept"] = (Path(tmp) / "outside" / "sentinel.txt").exists()
        if case == "manifest_fifo":  # a reader may still be blocked in open(): be its writer
            fifo = Path(tmp) / "kv" / "manifest.json"
            if fifo.exists() and not fifo.is_symlink() and fifo.is_fifo():
                try:
                    fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
                    os.close(fd)
                except OSError:
                    pass
    print(f"  tier {case}: {json.dumps(out)}", flush=True)
    return out


def finding_tier(args: argparse.Namespace) -> dict:
    return {
        "config": {"timeout_s": args.tier_timeout, "rss_cap_mb": args.tier_rss_cap_mb},
        **{c: tier_case(c, args.tier_timeout, args.tier_rss_cap_mb) for c in TIER_CASES},
    }


# ---- main ---------------------------------------------------------------------------------------------
FINDINGS = {"salt": finding_salt, "ranks": finding_ranks, "picker": finding_picker, "tier": finding_tier}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--tier-child":
        tier_child(sys.argv[2], Path(sys.argv[3]))
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True, help="before | after: names the results file")
    ap.add_argument("--only", default=",".join(FINDINGS), help="findings to run, comma-separated")
    ap.add_argument("--requests", type=int, default=150, help="salted requests per step (N)")
    ap.add_argument("--kv-blocks", type=int, default=32, help="the daemon's KV cache blocks")
    ap.add_argument("--dir-mib", type=float, default=10.0, help="--kv-offloading-dir-size, in MiB")
    ap.add_argument("--keys", type=int, default=1_000_000, help="block keys published per PUB socket (K)")
    ap.add_argument("--settle", type=float, default=10.0, help="s the index must hold still to be settled")
    ap.add_argument("--body-streams", type=int, default=250, help="picker streams with 4 MiB bodies (S)")
    ap.add_argument("--held-streams", type=int, default=2500, help="picker streams picked and held (M)")
    ap.add_argument("--hold", type=float, default=3.0, help="s the unended bodies are held")
    ap.add_argument(
        "--rss-guard-mb",
        type=float,
        default=4500.0,
        help="no more picker body streams once the router holds this",
    )
    ap.add_argument("--tier-timeout", type=float, default=20.0)
    ap.add_argument("--tier-rss-cap-mb", type=float, default=3000.0)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--output", type=Path)
    args = ap.parse_args()
    if args.quick:
        args.requests, args.keys, args.body_streams, args.held_streams = 20, 100_000, 40, 300
    import kvpilot.daemon

    if not kvpilot.daemon.__file__.startswith(ROOT_DIR + os.sep):
        raise SystemExit(f"kvpilot.daemon comes from {kvpilot.daemon.__file__}, not this tree ({ROOT_DIR})")
    load_before = os.getloadavg()
    commit = subprocess.run(
        ["git", "-C", ROOT_DIR, "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    doc = benchkit.header("zero_trust", load_before) | {
        "label": args.label,
        "commit": commit,
        "tree": ROOT_DIR,
        "quick": args.quick,
        "findings": {},
    }
    for name in args.only.split(","):
        print(f"== {name}", flush=True)
        start = time.perf_counter()
        try:
            doc["findings"][name] = FINDINGS[name](args)
        except Exception as exc:  # noqa: BLE001 - one finding's failure is a figure too; the others run
            doc["findings"][name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            print(f"  {name} failed: {exc}", flush=True)
        doc["findings"][name]["wall_s"] = round(time.perf_counter() - start, 1)
    doc["load_average_after"] = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    benchkit.write(args.output or RESULTS / f"zero-trust-{args.label}-{stamp}.json", doc)


if __name__ == "__main__":
    main()
