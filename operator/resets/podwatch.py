"""Who the reset's pods are right now: one list, then a watch keeps it current (an informer for one reset, or
one warm-up: warmups/drive.py watches its pods with it too).

The fan-out asks before every call whether the pod it resolved at the start is still that pod at that
address (`gone`), so a token is never sent to an IP that a deleted pod left behind. Answers come from memory;
the watch runs in a thread (the official client is synchronous) and re-lists when the stream breaks. Each
event is parsed once, to a dict, and kept as the pod's (uid, IP, terminating): the client's own watch would
parse it, dump it and parse it again into model objects, at many times the CPU (docs/fanout.md, "What
bounds it").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
from typing import Any

from kubernetes.watch.watch import iter_resp_lines

from kvpilot.fanout import Target
from kvpilot.operator.fleets.targets import Identity, identity
from kvpilot.operator.kube.api import Kube

log = logging.getLogger(__name__)

__all__ = ["Identity", "PodWatch", "identity"]


class PodWatch:
    def __init__(
        self,
        kube: Kube,
        ns: str,
        selector: str,
        container: str | None,
        pods: dict[str, Identity],
        version: str,
        run: str = "reset",
    ) -> None:
        """`pods`: each listed pod's identity by name, `version`: the list's resourceVersion, where the
        watch starts; `run`: what the pods are watched for ("reset", "warm-up"), for the reasons it gives."""
        self.kube, self.ns, self.selector, self.version = kube, ns, selector, version
        self.run = run
        self.container = container
        self.pods = dict(pods)
        self._listed = {uid for uid, _, _, _ in self.pods.values()}  # the pods the reset started with
        self._stop = threading.Event()
        self._resp: Any = None
        self._thread: threading.Thread | None = None

    async def gone(self, target: Target) -> str | None:
        now = self.pods.get(target.name)
        if now is None:
            return f"pod deleted (or no longer selected) during the {self.run}"
        uid, ip, terminating, _ = now
        if uid != target.uid:
            return f"pod replaced during the {self.run} (new uid); not called"
        if terminating:
            return f"pod terminating during the {self.run}"
        if ip != target.ip:
            return f"pod IP changed during the {self.run} ({target.ip} -> {ip or 'none'}); not called"
        return None

    async def starting(self, target: Target) -> bool:
        """Whether the pod is still starting (`targets.starting`): the reset waits for it."""
        now = self.pods.get(target.name)
        return now is not None and now[3]

    def newcomers(self) -> list[str]:
        """Pods selected now that the reset did not start with (replacements of deleted pods, a scale-up),
        by name: they came up after the reset began, so nothing they cache predates it."""
        return sorted(
            n
            for n, (uid, _, terminating, _) in self.pods.items()
            if uid not in self._listed and not terminating
        )

    async def __aenter__(self) -> PodWatch:
        self.start()
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.stop()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"podwatch-{self.ns}", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        self._stop.set()
        # Unblock the thread's read at once (the stream would end on its own within timeout_seconds).
        sock = getattr(getattr(self._resp, "connection", None), "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def _named(self, pod: dict[str, Any]) -> tuple[str, Identity]:
        return pod["metadata"]["name"], identity(pod, self.container)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._follow()
            except Exception as exc:  # noqa: BLE001 - 410 Gone, a broken stream: list again
                if self._stop.is_set():
                    return
                log.info("pod watch of %s restarts with a fresh list: %s", self.ns, exc)
                self._stop.wait(0.2)  # a watch the server keeps refusing is not asked again in a tight loop
                try:
                    pods, self.version = self.kube.list_pods_sync(self.ns, self.selector, self._named)
                    self.pods = dict(pods)
                except Exception as exc2:  # noqa: BLE001 - retried after a pause
                    log.warning("pod list of %s failed: %s", self.ns, exc2)
                    self._stop.wait(1.0)

    def _follow(self) -> None:
        """One watch request from self.version, until the server ends it (timeout_seconds) or it breaks."""
        self._resp = self.kube.core.list_namespaced_pod(
            self.ns,
            label_selector=self.selector,
            resource_version=self.version,
            timeout_seconds=10,
            allow_watch_bookmarks=True,
            watch=True,
            _preload_content=False,
        )
        try:
            if not 200 <= self._resp.status < 300:
                raise RuntimeError(f"watch refused: HTTP {self._resp.status} {self._resp.data[:200]!r}")
            for line in iter_resp_lines(self._resp):
                if self._stop.is_set():
                    return
                ev = json.loads(line)
                kind, pod = ev.get("type"), ev.get("object") or {}
                if kind == "ERROR":  # 410 Gone (too old a version) and the like: list again
                    raise RuntimeError(f"watch error {pod.get('code')}: {pod.get('message')}")
                meta = pod.get("metadata") or {}
                self.version = meta.get("resourceVersion") or self.version
                if kind == "DELETED":
                    self.pods.pop(meta.get("name", ""), None)
                elif kind in ("ADDED", "MODIFIED"):
                    self.pods[meta["name"]] = identity(pod, self.container)
        finally:
            self._resp.close()
            self._resp.release_conn()
