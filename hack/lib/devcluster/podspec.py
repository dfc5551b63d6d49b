"""Turning a pod spec into local things: env values, volume folders, argv.

Containers run as plain processes on the host filesystem, so volumes cannot be
mounted at their mountPath. Instead each volume is materialised in a folder
under the pod's directory, and every occurrence of the mountPath at the start
of a path-like word in the container's command, args, env values and
workingDir is rewritten to that folder. The folder is also exported as
KVPILOT_VOLUME_<NAME> (upper-case, '-' -> '_') for programs that build paths.
The one exception is the service-account folder, which in-cluster clients read
from a fixed path: mountns.py mounts it there for each container.
Projected service-account tokens are renewed as the kubelet renews them.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client

log = logging.getLogger("devcluster.pod")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known vars replaced, $$ escapes, unknown left as is."""

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, text)


def _raw(api_call, *args: Any) -> dict | None:
    """Call a read_* method and return plain JSON, or None if the object is absent."""
    try:
        return json.loads(api_call(*args, _preload_content=False).data)
    except client.ApiException as e:
        if e.status == 404:
            return None
        raise


def _decoded(secret: dict) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.get("data") or {}).items()}


def field_value(pod: dict, path: str) -> str:
    """Resolve a downward-API fieldPath against the pod (as the kubelet does)."""
    meta, spec, status = pod["metadata"], pod["spec"], pod.get("status") or {}
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return (meta.get(m.group(1)) or {}).get(m.group(2), "")
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path not in simple:
        raise ValueError(f"unsupported fieldRef {path}")
    return simple[path]


DEFAULT_TOKEN_SECONDS = 3607  # what the ServiceAccount admission plugin puts in kube-api-access volumes


@dataclass
class ProjectedToken:
    """A serviceAccountToken projection written to `path`, renewed at `refresh_at` (epoch s)."""

    path: Path
    source: dict
    refresh_at: float = 0.0


def refresh_time(issued: float, requested_seconds: int, expires: float) -> float:
    """When the kubelet renews a projected token: after 80% of its lifetime, and at least daily.

    The lifetime is the one requested: the apiserver may extend a 3607 s token to a
    year for old clients, and the kubelet still renews it within the hour.
    """
    lifetime = min(requested_seconds, expires - issued)
    return issued + min(0.8 * lifetime, 24 * 3600)


class SpecResolver:
    """Reads Secrets/ConfigMaps/tokens the pod refers to, through the API."""

    def __init__(self, core: client.CoreV1Api, pod: dict, pod_dir: Path) -> None:
        self.core, self.pod, self.pod_dir = core, pod, pod_dir
        self.ns = pod["metadata"]["namespace"]
        self.volume_dirs: dict[str, Path] = {}
        self.tokens: list[ProjectedToken] = []

    # ---- volumes ---------------------------------------------------------
    def prepare_volumes(self) -> None:
        for vol in self.pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "hostPath" in vol:
                self.volume_dirs[name] = Path(vol["hostPath"]["path"])
                continue
            d = self.pod_dir / "volumes" / name
            d.mkdir(parents=True, exist_ok=True)
            self.volume_dirs[name] = d
            if "secret" in vol:
                self._write_secret(d, vol["secret"])
            elif "configMap" in vol:
                self._write_configmap(d, vol["configMap"])
            elif "projected" in vol:
                for src in vol["projected"].get("sources") or []:
                    self._write_projection(d, src)
            elif "downwardAPI" in vol:
                self._write_downward(d, vol["downwardAPI"].get("items") or [])
            # emptyDir and anything else: an empty folder.

    def _write_items(self, d: Path, data: dict[str, bytes], items: list | None) -> None:
        mapping = {i["key"]: i["path"] for i in items} if items else {k: k for k in data}
        for key, rel in mapping.items():
            if key in data:
                target = d / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(data[key])

    def _write_secret(self, d: Path, src: dict) -> None:
        name = src.get("secretName") or src.get("name")
        secret = _raw(self.core.read_namespaced_secret, name, self.ns)
        if secret is None:
            if src.get("optional"):
                return
            raise LookupError(f'secret "{name}" not found')
        self._write_items(d, _decoded(secret), src.get("items"))

    def _write_configmap(self, d: Path, src: dict) -> None:
        cm = _raw(self.core.read_namespaced_config_map, src["name"], self.ns)
        if cm is None:
            if src.get("optional"):
                return
            raise LookupError(f'configmap "{src["name"]}" not found')
        data = {k: v.encode() for k, v in (cm.get("data") or {}).items()}
        data.update({k: base64.b64decode(v) for k, v in (cm.get("binaryData") or {}).items()})
        self._write_items(d, data, src.get("items"))

    def _write_downward(self, d: Path, items: list) -> None:
        for item in items:
            if "fieldRef" in item:
                (d / item["path"]).write_text(field_value(self.pod, item["fieldRef"]["fieldPath"]))

    def _write_projection(self, d: Path, src: dict) -> None:
        if "secret" in src:
            self._write_secret(d, src["secret"])
        elif "configMap" in src:
            self._write_configmap(d, src["configMap"])
        elif "downwardAPI" in src:
            self._write_downward(d, src["downwardAPI"].get("items") or [])
        elif "serviceAccountToken" in src:
            token = ProjectedToken(d / src["serviceAccountToken"]["path"], src["serviceAccountToken"])
            self._request_token(token, time.time())
            self.tokens.append(token)

    def refresh_tokens(self, now: float | None = None) -> None:
        """Renew each projected token that is due (refresh_time); a failure is retried in 10 s."""
        now = time.time() if now is None else now
        for token in self.tokens:
            if now < token.refresh_at:
                continue
            try:
                self._request_token(token, now)
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried, never stops the pod
                log.warning("renewing the token %s failed (retrying in 10s): %s", token.path, e)
                token.refresh_at = now + 10

    def _request_token(self, token: ProjectedToken, now: float) -> None:
        # The kubelet asks for a token bound to this pod (it dies with the pod); so do we.
        ttl = token.source.get("expirationSeconds", DEFAULT_TOKEN_SECONDS)
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenRequest",
            "spec": {
                "audiences": [token.source["audience"]] if token.source.get("audience") else [],
                "expirationSeconds": ttl,
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": self.pod["metadata"]["name"],
                    "uid": self.pod["metadata"]["uid"],
                },
            },
        }
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        resp = self.core.create_namespaced_service_account_token(sa, self.ns, body, _preload_content=False)
        status = json.loads(resp.data)["status"]
        expires = dt.datetime.fromisoformat(status["expirationTimestamp"].replace("Z", "+00:00")).timestamp()
        # Replace, never rewrite in place: a reader sees the old token or the new one, whole.
        tmp = token.path.with_name(f".{token.path.name}.new")
        tmp.write_text(status["token"])
        tmp.replace(token.path)
        token.refresh_at = refresh_time(now, ttl, expires)

    # ---- env and argv ----------------------------------------------------
    def rewrite_paths(self, text: str, container: dict) -> str:
        """Replace each mountPath prefix with the folder holding that volume."""
        for mount in sorted(container.get("volumeMounts") or [], key=lambda m: -len(m["mountPath"])):
            local = self.volume_dirs.get(mount["name"])
            if local is None:
                continue
            if mount.get("subPath"):
                local = local / mount["subPath"]
            mp = mount["mountPath"].rstrip("/") or "/"
            text = re.sub(rf"(?<![\w/.-]){re.escape(mp)}(?=/|$|[\s:=,;\"'])", str(local), text)
        return text

    def env(self, container: dict, base: dict[str, str]) -> dict[str, str]:
        env = dict(base)
        for name, d in self.volume_dirs.items():
            env["KVPILOT_VOLUME_" + re.sub(r"[^A-Za-z0-9]", "_", name).upper()] = str(d)
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "secretRef" in src:
                obj = _raw(self.core.read_namespaced_secret, src["secretRef"]["name"], self.ns)
                data = {k: v.decode(errors="replace") for k, v in _decoded(obj or {}).items()}
            else:
                obj = _raw(self.core.read_namespaced_config_map, src["configMapRef"]["name"], self.ns)
                data = (obj or {}).get("data") or {}
            if obj is None and not (src.get("secretRef") or src.get("configMapRef") or {}).get("optional"):
                raise LookupError(f"envFrom source not found: {src}")
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            value = self._env_value(var, env)
            if value is not None:
                env[var["name"]] = self.rewrite_paths(value, container)
        return env

    def _env_value(self, var: dict, env: dict[str, str]) -> str | None:
        if "valueFrom" not in var:
            return expand(var.get("value", ""), env)
        vf = var["valueFrom"]
        if "fieldRef" in vf:
            return field_value(self.pod, vf["fieldRef"]["fieldPath"])
        if "secretKeyRef" in vf:
            ref = vf["secretKeyRef"]
            secret = _raw(self.core.read_namespaced_secret, ref["name"], self.ns)
            data = _decoded(secret or {})
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise LookupError(f'secret "{ref["name"]}" has no key "{ref["key"]}"')
            return data[ref["key"]].decode(errors="replace")
        if "configMapKeyRef" in vf:
            ref = vf["configMapKeyRef"]
            cm = _raw(self.core.read_namespaced_config_map, ref["name"], self.ns) or {}
            data = cm.get("data") or {}
            if ref["key"] not in data:
                if ref.get("optional"):
                    return None
                raise LookupError(f'configmap "{ref["name"]}" has no key "{ref["key"]}"')
            return data[ref["key"]]
        if "resourceFieldRef" in vf:
            res = vf["resourceFieldRef"]["resource"]  # e.g. limits.cpu
            kind, _, name = res.partition(".")
            for c in self.pod["spec"]["containers"]:
                value = ((c.get("resources") or {}).get(kind) or {}).get(name)
                if value is not None:
                    return str(value)
            return "0"
        return None

    def argv(self, container: dict, env: dict[str, str]) -> list[str]:
        words = list(container.get("command") or []) + list(container.get("args") or [])
        return [self.rewrite_paths(expand(w, env), container) for w in words]
