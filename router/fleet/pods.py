"""The fleet's pods as the router sees them: address, readiness, load, and their KV event streams.

Each pod is probed on its own, as its engine wants (`kvpilot/engines.py`): its health endpoint every few
seconds, then for kvpilot pods GET /kv_events and for vLLM pods GET /kv_event_sources, which tell where
it publishes (one `PodEventStream` per rank keeps the prefix index current), and for vLLM and SGLang pods
their load from GET /metrics. A pod that serves no KV events (404, `{}`, or SGLang) is still routed to,
by load alone.

Whatever a pod answers, its watch goes on: a reply of the wrong shape is logged (once per reason) and
asked again at the next probe, and a probe that fails in any way leaves the pod not ready until one
passes. A kvpilot pod's /health also names its weight version, what its ranks' block keys start with
(`weight_versions.py`). A pod that stops being ready loses its index entries at once (they are rebuilt
from its replay buffer when it is back): a pod that died must not keep attracting requests by what it
cached.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import aiohttp
from yarl import URL

from kvpilot.engines import KVPILOT, EngineTraits
from kvpilot.kv.block_keys import DEFAULT_KEYS, KeyScheme, LoRAKey
from kvpilot.kv.sockets import subscriber_context
from kvpilot.router.fleet.load import read_load
from kvpilot.router.kv.index import PrefixIndex
from kvpilot.router.kv.info import (
    MAX_REPLY_BYTES,
    PodEvents,
    checked_endpoint,
    parse_kv_event_sources,
    parse_kv_events,
    static_event_source,
)
from kvpilot.router.kv.lora_adapters import adapters_from_health
from kvpilot.router.kv.stream import PodEventStream
from kvpilot.router.kv.weight_versions import MAX_HEALTH_BYTES, UNKNOWN, Version, from_health
from kvpilot.router.metrics import RouterMetrics
from kvpilot.router.routing.version_choice import VersionChoice
from kvpilot.serving.capped_read import read_capped

log = logging.getLogger(__name__)

# A disaggregated fleet's roles (--prefill, --decode): what the router sends each pod (router/disaggregation.py).
PREFILL = "prefill"
DECODE = "decode"


@dataclass(eq=False)
class Pod:
    name: str
    url: str  # http://host:port, no trailing slash
    ready: bool = False
    role: str | None = None  # PREFILL or DECODE in a disaggregated fleet; None: the pod serves whole requests
    in_flight: int = 0
    kv_events: str = "pending"  # pending (not asked yet) | off (the pod publishes none) | on
    block_size: int | None = None  # of the pod's KV events; None while they are not followed
    keys: KeyScheme = DEFAULT_KEYS  # how its blocks are keyed, as its GET /kv_events says
    ranks: list[int] = field(default_factory=list)  # the data-parallel ranks whose KV events are followed
    streams: list[PodEventStream] = field(default_factory=list)  # one per rank
    rank_in_flight: dict[int, int] = field(default_factory=dict)  # requests sent to a chosen rank
    ranked_in_flight: int = 0  # those together (the rest of in_flight named no rank)
    engine_load: int | None = None  # running + waiting requests, from the pod's metrics; None: not known
    load_error: str = ""  # why engine_load is not known (logged when it changes)
    events_error: str = ""  # why its GET /kv_events could not be used (logged when it changes)
    weight_version: Version = None  # what its last /health named (each rank's own: its stream's)
    adapters: dict[str, LoRAKey] = field(default_factory=dict)  # its LoRA adapters, as its /health names them
    probed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)  # set by its first health probe
    _targets: dict[str, URL] = field(default_factory=dict, repr=False)  # path -> its URL on the pod
    _address: tuple[str, int, bool] | None = field(default=None, repr=False)

    def described(self) -> str:
        """Its name, and its role where it has one (the router's log lines)."""
        return f"{self.name} ({self.role})" if self.role else self.name

    def target(self, path_qs: str) -> URL:
        """The pod's URL for a request to `path_qs`, parsed once per path (the router's few routes);
        a path with a query string is parsed each time, so clients cannot grow the cache."""
        url = self._targets.get(path_qs)
        if url is None:
            url = URL(self.url + path_qs)
            if "?" not in path_qs and len(self._targets) < 16:
                self._targets[path_qs] = url
        return url

    @property
    def address(self) -> tuple[str, int, bool]:
        """(host, port, TLS) of its URL, parsed once."""
        if self._address is None:
            self._address = (self.host, self.port, urlsplit(self.url).scheme == "https")
        return self._address

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or ""

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def holders(self) -> list[tuple[str, int]]:
        """The pod's index entries: one per rank it publishes events for."""
        return [(self.name, r) for r in self.ranks]

    @property
    def num_ranks(self) -> int:
        return len(self.ranks)

    def versions(self) -> list[Version]:
        """Each followed rank's weight version, in the order of `holders()` (its stream's; what /health
        named for a rank without one)."""
        by_rank = {s.rank: s.weight_version for s in self.streams}
        return [by_rank.get(r, self.weight_version) for r in self.ranks]

    def rank_versions(self) -> list[str | None] | None:
        """The same, or None when one is unknown (the pod is then routed by load)."""
        versions = self.versions()
        # without UNKNOWN the items are str | None: mypy does not narrow a list's items by `in`
        return None if UNKNOWN in versions else versions  # type: ignore[return-value]

    def synced(self) -> bool:
        """Whether every rank's stream has caught up (none yet: not synced). A loop, not all() of a
        generator: it runs for every pod on every prefix-aware request."""
        for stream in self.streams:
            if not stream.synced.is_set():
                return False
        return bool(self.streams)

    def opened(self, rank: int | None) -> None:
        """One more request of the router's open on the pod, on `rank` where it named one."""
        if rank is not None:
            self.rank_in_flight[rank] = self.rank_in_flight.get(rank, 0) + 1
            self.ranked_in_flight += 1
        self.in_flight += 1

    def closed(self, rank: int | None) -> None:
        """That request has ended."""
        if rank is not None:
            self.rank_in_flight[rank] -= 1
            self.ranked_in_flight -= 1
        self.in_flight -= 1

    def rank_load(self, rank: int) -> float:
        """Requests the router has open on one rank: those it sent there, and an even share of those it
        sent the pod without naming a rank (the pod's own balancer placed them, where the router cannot
        tell). So while such a request is open no rank of the pod counts as idle: any may be running it."""
        unranked = self.in_flight - self.ranked_in_flight
        return self.rank_in_flight.get(rank, 0) + unranked / max(self.num_ranks, 1)

    def load(self) -> int:
        """Requests on the pod as far as the router can tell: those it has open there, or what the pod's
        metrics last said (other clients' requests included, but up to a probe interval old), whichever
        is more."""
        return max(self.in_flight, self.engine_load or 0)


def _address(item: str, flag: str) -> tuple[str, str]:
    """A pod's address as --endpoints takes it (`http://a:8000`, or `a:8000`): (its name, host:port; its
    URL)."""
    url = item if "://" in item else f"http://{item}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{flag}: {item!r} is not an http://HOST:PORT address")
    return f"{parts.hostname}:{port or 80}", f"{parts.scheme}://{parts.netloc}"


def parse_endpoints(text: str, flag: str = "--endpoints", role: str | None = None) -> list[Pod]:
    """`--endpoints http://a:8000,http://b:8000` -> pods named host:port (of `role`)."""
    pods, seen = [], set()
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, url = _address(item, flag)
        if name in seen:
            raise ValueError(f"{flag}: {name} is listed twice")
        seen.add(name)
        pods.append(Pod(name, url, role=role))
    if not pods:
        raise ValueError(f"{flag}: no address given")
    return pods


def parse_pools(prefill: list[str], decode: list[str]) -> list[Pod]:
    """`--prefill URL... --decode URL...` (each flag repeated or given several URLs, each value a URL or
    a comma list, as --endpoints takes them) -> the pods, each with its role; a pod has one role."""
    for flag, values in (("--prefill", prefill), ("--decode", decode)):
        for value in values:
            if value.isdigit() or value.lower() == "none":
                # vllm-router's and sglang-router's `--prefill URL BOOTSTRAP_PORT`: their connectors' rendezvous
                raise ValueError(
                    f"{flag} {value}: a bootstrap port is for other KV connectors; kvpilot pods need only "
                    "their URL (docs/disaggregation.md)"
                )
    pods = parse_endpoints(",".join(prefill), "--prefill", PREFILL)
    pods += parse_endpoints(",".join(decode), "--decode", DECODE)
    names = [p.name for p in pods]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ValueError(f"{twice} is named by both --prefill and --decode: a pod has one role")
    return pods


def parse_static_sources(values: list[str]) -> dict[str, str]:
    """`URL=ENDPOINT` values (--kv-event-source) as {pod name: tcp endpoint}, the pod named as --endpoints
    names it (host:port); ValueError names a bad one."""
    out: dict[str, str] = {}
    for value in values:
        url, sep, endpoint = value.partition("=")
        if not sep:
            raise ValueError(
                f"--kv-event-source {value!r}: expected URL=ENDPOINT, e.g. http://10.0.0.7:8000=tcp://10.0.0.7:5557"
            )
        name, _ = _address(url, "--kv-event-source")
        if name in out:
            raise ValueError(f"--kv-event-source names {name} twice")
        out[name] = checked_endpoint(endpoint, f"--kv-event-source {value!r}: its endpoint")
    return out


class Fleet:
    """The pods currently in the fleet; `update()` takes a new list (static, or from EndpointSlices)."""

    def __init__(
        self,
        index: PrefixIndex,
        metrics: RouterMetrics,
        session: aiohttp.ClientSession,
        probe_interval_s: float = 2.0,
        engine: EngineTraits = KVPILOT,
        kv_events_curve_dir: str | None = None,
        vllm_events: tuple[int, KeyScheme] = (16, KeyScheme("sha256")),
        static_sources: dict[str, str] | None = None,
    ) -> None:
        self.pods: list[Pod] = []
        self.engine = engine
        # vLLM pods name neither: (block size, key scheme) from --kv-events-block-size and -hash-algo
        self._vllm_events = vllm_events
        self._static_sources = static_sources or {}  # --kv-event-source: pod name -> its publisher
        self._unmatched = set(self._static_sources)  # sources no pod has had yet (warned about once)
        self.index = index
        self.metrics = metrics
        self._session = session
        self._probe_interval_s = probe_interval_s
        # Every KV event socket comes from this context: size-bounded, and CURVE with the fleet's keys.
        self._ctx = subscriber_context(kv_events_curve_dir)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self.versions = VersionChoice()  # the weight versions in the order they appeared
        self._listed = asyncio.Event()  # set by the first update(): the fleet's first list is known
        # Whether the pods have roles: then each request is prefilled on one and decoded on another
        # (router/disaggregation.py). Static with --prefill/--decode; with --fleet, whatever the
        # InferenceDeployment runs now (discovery.py), so a fleet switched either way is followed.
        self.disaggregated = False

    def ready_pods(self) -> list[Pod]:
        return [p for p in self.pods if p.ready]

    def update(self, pods: list[Pod]) -> None:
        """Follow `pods` from now on: new ones are probed, gone ones (or moved: new URL) are dropped
        together with their index entries."""
        self._unmatched -= {p.name for p in pods}
        for name in sorted(self._unmatched):
            log.warning("--kv-event-source names %s, which is not a pod of the fleet: ignored", name)
        self._unmatched.clear()
        old = {p.name: p for p in self.pods}
        keep = []
        for p in pods:
            current = old.pop(p.name, None)
            if current is not None and current.url == p.url:
                current.role = p.role  # its cache and streams stay valid whichever pool it is in
                keep.append(current)
                continue
            if current is not None:
                self._tasks.pop(current.name).cancel()
            if self.engine.kv_events_path is None:
                p.kv_events = "off"  # never asked: the engine publishes none the router can verify
            keep.append(p)
            self.metrics.add_pod(p.name)
            self._tasks[p.name] = asyncio.create_task(self._watch(p), name=f"probe {p.name}")
        for gone in old.values():
            self._tasks.pop(gone.name).cancel()
            for holder in gone.holders():
                self.index.forget(holder)
            self.metrics.pod_ready.labels(gone.name).set(0)
        if old or len(keep) != len(self.pods):
            log.info("fleet: %s", ", ".join(p.described() for p in keep) or "no pods")
        self.pods = keep
        # An empty list says nothing of the fleet's shape: the mode stays until pods say otherwise.
        if keep and any(p.role for p in keep) != self.disaggregated:
            self.disaggregated = not self.disaggregated
            if self.disaggregated:
                self.metrics.pd_mode()
            log.info(
                "fleet: %s",
                "prefill/decode disaggregated: each request prefilled on a prefill pod, decoded on a decode pod"
                if self.disaggregated
                else "colocated: each request runs on one pod",
            )
        self._listed.set()

    async def first_probes(self, timeout_s: float) -> None:
        """Wait, at most `timeout_s`, for the fleet's first list and each of its pods' first health probe:
        a router that listened before would answer a restart's first requests 503 with every pod up."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._listed.wait()
                await asyncio.gather(*(p.probed.wait() for p in self.pods))
        except TimeoutError:
            waiting = [p.name for p in self.pods if not p.probed.is_set()]
            log.warning(
                "after %gs, still waiting for %s; serving now",
                timeout_s,
                "the fleet's first list"
                if not self._listed.is_set()
                else "the first probe of " + ", ".join(waiting),
            )

    async def stop(self) -> None:
        tasks = list(self._tasks.values())
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._ctx.term()

    def mark_unready(self, pod: Pod) -> None:
        """Stop routing to the pod until its next passing probe (its entries stay: the probe decides)."""
        pod.ready = False
        self.metrics.pod_ready.labels(pod.name).set(0)

    async def _watch(self, pod: Pod) -> None:
        streams: list[asyncio.Task[None]] = []
        try:
            while True:
                try:
                    streams += await self._probe_once(pod)
                except Exception as exc:  # noqa: BLE001 - a pod's answer must never end its watch
                    log.warning("%s: probe failed (%s: %s); not ready", pod.name, type(exc).__name__, exc)
                    self.mark_unready(pod)
                await asyncio.sleep(self._probe_interval_s)
        finally:
            for t in streams:
                t.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
            for holder in pod.holders():
                self.index.forget(holder)  # whatever a cancelled stream applied last

    async def _probe_once(self, pod: Pod) -> list[asyncio.Task[None]]:
        """One probe of the pod; returns the event streams it started (the first time events are on)."""
        try:
            pod.ready = await self._healthy(pod)
        finally:
            pod.probed.set()
        self.metrics.pod_ready.labels(pod.name).set(1 if pod.ready else 0)
        for stream in pod.streams:
            if pod.ready:
                stream.release()
            else:
                stream.hold("the pod is not ready")
        started = []
        if pod.ready and pod.kv_events == "pending":
            started = await self._follow_events(pod)
        if self.engine.load_metrics:
            await self._read_load(pod)
        self.metrics.indexed_blocks.labels(pod.name).set(self.index.blocks_of(pod.holders()))
        return started

    async def _healthy(self, pod: Pod) -> bool:
        url = pod.url + self.engine.health_path
        try:
            async with self._session.get(url, timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status != 200:
                    return False
                if self.engine.weight_version:
                    raw = await read_capped(r, MAX_HEALTH_BYTES)
                    self._set_version(pod, from_health(raw))
                    pod.adapters = adapters_from_health(raw)
                return True
        except (TimeoutError, aiohttp.ClientError):
            return False

    def _set_version(self, pod: Pod, version: Version) -> None:
        """What /health names: each rank's version whenever its stream (re)starts (`health_says`)."""
        if version != pod.weight_version:
            log.info("%s: /health names weight version %r", pod.name, version)
        self.versions.saw(version)  # also unnamed weights at the start: older than any version that comes
        pod.weight_version = version
        for stream in pod.streams:
            stream.health_says(version)

    async def _read_load(self, pod: Pod) -> None:
        if not pod.ready:
            pod.engine_load = None
            return
        pod.engine_load, why = await read_load(self._session, pod.url, self.engine)
        if why and why != pod.load_error:  # once per new reason, not every probe
            log.warning(
                "%s: load unknown (%s); counting the requests this router has open there", pod.name, why
            )
        elif not why and pod.load_error:
            log.info("%s: load read from its metrics again", pod.name)
        pod.load_error = why

    async def _follow_events(self, pod: Pod) -> list[asyncio.Task[None]]:
        path = self.engine.kv_events_path or ""
        static = self._static_sources.get(pod.name)
        if static is not None:
            return self._subscribe(pod, static_event_source(static, *self._vllm_events))
        try:
            async with self._session.get(pod.url + path, timeout=aiohttp.ClientTimeout(total=5)) as r:
                if r.status == 404:
                    pod.kv_events = "off"
                    log.info("%s publishes no KV events: routed by load only", pod.name)
                    return []
                if r.status != 200:
                    return []
                raw = await read_capped(r, MAX_REPLY_BYTES)
        except (TimeoutError, aiohttp.ClientError):
            return []
        try:
            if raw is None:
                raise ValueError(f"more than {MAX_REPLY_BYTES} bytes")
            info = json.loads(raw)
            if path == "/kv_event_sources":
                events = parse_kv_event_sources(info, urlsplit(pod.url).hostname or "", *self._vllm_events)
            else:
                events = parse_kv_events(info)
        except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested too deep
            why = f"GET {path} is unusable: {exc}"
            if why != pod.events_error:
                log.warning("%s: %s; routed by load, asked again at the next probe", pod.name, why)
            pod.events_error = why
            return []
        pod.events_error = ""
        if events is None:
            pod.kv_events = "off"
            log.info("%s publishes no KV events (%s names none): routed by load only", pod.name, path)
            return []
        return self._subscribe(pod, events)

    def _subscribe(self, pod: Pod, events: PodEvents) -> list[asyncio.Task[None]]:
        pod.block_size = events.block_size
        pod.keys = events.keys
        pod.streams = [
            PodEventStream(
                pod.name,
                r.endpoint,
                r.replay_endpoint,
                self.index,
                self.metrics.count_kv,
                self._ctx,
                rank=r.rank,
                limits=events.limits,
                blocks_total=r.blocks_total,
                weight_version=pod.weight_version,
                on_version=self.versions.saw,
                block_size=events.block_size,
            )
            for r in events.ranks
        ]
        pod.ranks = [s.rank for s in pod.streams]
        pod.kv_events = "on"
        log.info("%s: following KV events at %s", pod.name, ", ".join(r.endpoint for r in events.ranks))
        return [asyncio.create_task(_run_forever(s), name=f"kv events {pod.name}") for s in pod.streams]


async def _run_forever(stream: PodEventStream) -> None:
    """A stream that fails (bad address, a bug) is restarted after a pause rather than lost."""
    while True:
        try:
            await stream.run()
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001 - logged; the router keeps routing meanwhile
            log.exception("KV events of %s failed; retrying", stream.pod)
        stream.restart("stream failed")
        await asyncio.sleep(1.0)
