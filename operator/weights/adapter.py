"""A WeightUpdate of one LoRA adapter (spec.adapter): every pod loads the adapter's new directory in place
(/v1/load_lora_adapter with load_inplace, each daemon over its ranks), all or none. When any pod fails or
they loaded different files, the pods that did go back to the directory they served before (or unload an
adapter they did not have), so the fleet ends on one version of it either way. A pod whose way back fails is
Fenced. The base weights, status.weights and the catch-up are not touched. The rest of the run (its
deadline, status, fencing, the versions read at the end) is update.py's `Run`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from kvpilot.fanout import CallSettings, Target
from kvpilot.fanout.phase import PhaseReply, run_phase
from kvpilot.operator.weights import fence
from kvpilot.operator.weights.status import WeightResult, redact
from kvpilot.operator.weights.update import Run


class AdapterRun(Run):
    async def update(self, targets: list[Target], settings: CallSettings) -> None:
        """spec.adapter on every pod or on none (the module docstring)."""
        adapter = self.spec.adapter
        assert adapter is not None
        await self.progress("Committing")
        pods = self._by_name()
        # What each pod serves now (its directory, its digest): what an undo must bring it back to.
        listed = await self.call(targets, settings, "GET", "/v1/models")
        health = await self.call(targets, settings, "GET", "/health")
        if unknown := [t.name for t in targets if not (listed[t.name].ok and health[t.name].ok)]:
            for name in unknown:
                r = listed[name] if not listed[name].ok else health[name]
                pods[name].result, pods[name].message = (
                    WeightResult.FAILED,
                    redact(f"what it serves: {r.message}"),
                )
            why = f"{unknown[0]}: {pods[unknown[0]].message}"
            return await self.finish("Failed", "StageFailed", f"no pod changed; {why}")
        before = {
            t.name: (
                _adapter_path(listed[t.name].body, adapter.name),
                _adapter_digest(health[t.name].body, adapter.name),
            )
            for t in targets
        }
        body = {"lora_name": adapter.name, "lora_path": adapter.path, "load_inplace": True}
        # Until the stage deadline, as a model's stage: the time after it is for going back.
        loaded = await run_phase(
            targets,
            settings,
            "POST",
            "/v1/load_lora_adapter",
            body,
            deadline=self.stage_deadline,
            limiter=self.limiter,
        )
        for t in targets:
            r, p = loaded[t.name], pods[t.name]
            p.staged_digest = str(r.body.get("digest") or "") if r.ok else ""
            p.result, p.message = (
                (WeightResult.SUCCEEDED, "") if r.ok else (WeightResult.FAILED, redact(f"load: {r.message}"))
            )
        digests = {p.staged_digest for p in self.pods}
        if all(p.result == WeightResult.SUCCEEDED for p in self.pods) and len(digests) == 1:
            await self.read_versions(targets, settings)
            digest = digests.pop()
            n = len(self.pods)
            msg = f"{n}/{n} pods serve adapter {adapter.name} {self.spec.version} ({digest})"
            return await self.finish("Succeeded", "AllPodsUpdated", msg, digest=digest)
        if all(
            p.result == WeightResult.SUCCEEDED for p in self.pods
        ):  # the same path, other files on some nodes
            for p in self.pods:
                p.message = f"loaded {p.staged_digest}: the pods read different files at {adapter.path}"
        # Back on every pod that may have loaded it: those that did, and those that gave no definite answer.
        refused = {t.name for t in targets if not loaded[t.name].ok and 400 <= loaded[t.name].status < 500}
        await self.undo([t for t in targets if t.name not in refused], settings, before)
        await self.read_versions(targets, settings)
        first = next(p for p in self.pods if p.message)  # a failed load, or the files that differed
        why = f"{first.name}: {first.message}"
        if fenced := [p.name for p in self.pods if p.result == WeightResult.FENCED]:
            msg = f"{', '.join(fenced[:5])} could not go back from the new {adapter.name} (fenced); {why}"
            return await self.finish("Degraded", "CommitFailed", msg)
        return await self.finish("Failed", "StageFailed", f"no pod changed {adapter.name}; {why}")

    async def undo(
        self,
        group: Sequence[Target],
        settings: CallSettings,
        before: dict[str, tuple[str | None, str | None]],
    ) -> None:
        """Take the pods of `group` back to the adapter each served before ((directory, digest); a directory of
        None: it served none of that name), side by side. A pod is back (Dropped, or Failed if its own load
        failed) only when it says so with the digest it had; else it is Fenced: out of the Service."""
        adapter, pods = self.spec.adapter, self._by_name()
        assert adapter is not None
        by_dir: dict[str | None, list[Target]] = {}
        for t in group:
            by_dir.setdefault(before[t.name][0], []).append(t)

        async def back(directory: str | None, ts: list[Target]) -> dict[str, PhaseReply]:
            if directory is None:  # it served none of that name: unload it
                return await self.call(
                    ts, settings, "POST", "/v1/unload_lora_adapter", {"lora_name": adapter.name}
                )
            body = {"lora_name": adapter.name, "lora_path": directory, "load_inplace": True}
            return await self.call(ts, settings, "POST", "/v1/load_lora_adapter", body)

        replies: dict[str, PhaseReply] = {}
        for part in await asyncio.gather(*(back(d, ts) for d, ts in by_dir.items())):
            replies |= part
        for t in group:
            p, r, (directory, digest) = pods[t.name], replies[t.name], before[t.name]
            # an unload of an adapter the load never reached answers 404: it is back as well
            ok = r.ok or (directory is None and r.status == 404)
            if ok and (directory is None or r.body.get("digest") == digest):
                p.result = WeightResult.FAILED if p.result == WeightResult.FAILED else WeightResult.DROPPED
                continue
            served = f"now {r.body.get('digest')}" if r.ok else r.message
            p.result = WeightResult.FENCED
            p.message = redact(f"could not go back to {directory or 'no adapter'} ({digest}): {served}")
            if await fence.set_serving(self.kube, self.ns, t.name, t.uid, False, p.message, self.obj):
                self.fenced.add(t.name)


def _adapter_path(models: dict[str, Any], name: str) -> str | None:
    """The directory a pod serves the adapter `name` from, as its /v1/models lists it (vLLM's `root`)."""
    for m in models.get("data") or []:
        if isinstance(m, dict) and m.get("id") == name and m.get("parent"):
            if isinstance(root := m.get("root"), str):
                return root
    return None


def _adapter_digest(health: dict[str, Any], name: str) -> str | None:
    """The digest of the adapter `name` a pod's /health names (None: it serves none of that name)."""
    adapters = health.get("lora_adapters")
    digest = adapters.get(name) if isinstance(adapters, dict) else None
    return digest if isinstance(digest, str) else None
