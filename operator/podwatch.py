"""Who the reset's pods are right now: one list, then a watch keeps it current (an informer for one reset).

The fan-out asks before every call whether the pod it resolved at the start is still that pod at that
address (`gone`), so a token is never sent to an IP that a deleted pod left behind. Answers come from memory;
the watch runs in a thread (the official client is synchronous) and re-lists when the stream breaks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from kubernetes import watch

from kvpilot.fanout import Target
from kvpilot.operator.kube import Kube

log = logging.getLogger(__name__)


def identity(pod: dict[str, Any]) -> tuple[str, str, bool]:
    """(uid, pod IP, terminating) of a pod as a dict."""
    meta, st = pod["metadata"], pod.get("status") or {}
    return meta.get("uid", ""), st.get("podIP") or "", bool(meta.get("deletionTimestamp"))


class PodWatch:
    def __init__(self, kube: Kube, ns: str, selector: str, pods: list[dict[str, Any]], version: str) -> None:
        self.kube, self.ns, self.selector, self.version = kube, ns, selector, version
        self.pods = {p["metadata"]["name"]: identity(p) for p in pods}
        self._listed = {uid for uid, _, _ in self.pods.values()}  # the pods the reset started with
        self._stop = threading.Event()
        self._watch: watch.Watch | None = None
        self._thread: threading.Thread | None = None

    async def gone(self, target: Target) -> str | None:
        now = self.pods.get(target.name)
        if now is None:
            return "pod deleted (or no longer selected) during the reset"
        uid, ip, terminating = now
        if uid != target.uid:
            return "pod replaced during the reset (new uid); not called"
        if terminating:
            return "pod terminating during the reset"
        if ip != target.ip:
            return f"pod IP changed during the reset ({target.ip} -> {ip or 'none'}); not called"
        return None

    def newcomers(self) -> list[str]:
        """Pods selected now that the reset did not start with (replacements of deleted pods, a scale-up),
        by name: they came up after the reset began, so nothing they cache predates it."""
        return sorted(
            n for n, (uid, _, terminating) in self.pods.items() if uid not in self._listed and not terminating
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
        if self._watch is not None:
            self._watch.stop()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 10)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._watch = watch.Watch()
                for ev in self._watch.stream(
                    self.kube.core.list_namespaced_pod,
                    self.ns,
                    label_selector=self.selector,
                    resource_version=self.version,
                    timeout_seconds=10,
                    allow_watch_bookmarks=True,
                ):
                    pod = self.kube.api.sanitize_for_serialization(ev["object"])
                    self.version = pod["metadata"].get("resourceVersion") or self.version
                    if ev["type"] == "DELETED":
                        self.pods.pop(pod["metadata"]["name"], None)
                    elif ev["type"] in ("ADDED", "MODIFIED"):
                        self.pods[pod["metadata"]["name"]] = identity(pod)
            except Exception as exc:  # noqa: BLE001 - 410 Gone, a broken stream: list again
                if self._stop.is_set():
                    return
                log.info("pod watch of %s restarts with a fresh list: %s", self.ns, exc)
                try:
                    pods, self.version = self.kube.list_pods_sync(self.ns, self.selector)
                    self.pods = {p["metadata"]["name"]: identity(p) for p in pods}
                except Exception as exc2:  # noqa: BLE001 - retried after a pause
                    log.warning("pod list of %s failed: %s", self.ns, exc2)
                    self._stop.wait(1.0)
