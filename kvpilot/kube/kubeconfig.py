"""Kubernetes credentials for every part that talks to the API: one rule, and one clear line when they are
missing or broken.

In a pod (KUBERNETES_SERVICE_HOST set, and neither --kubeconfig nor KUBECONFIG given) the pod's
ServiceAccount; otherwise the kubeconfig (--kubeconfig, else $KUBECONFIG, a list like kubectl's, else
~/.kube/config). The kubernetes client's own errors for a missing file, garbage YAML or no current context are
a traceback deep in its loader, or "Service host/port is not set" after it falls back to in-cluster; `load`
checks those cases first and raises `KubeconfigError` with one line that names the problem and the fix, which
the CLI prints before exiting 2 (`fail`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT = Path("/var/run/secrets/kubernetes.io/serviceaccount")
FIX = "run `make cluster-up` and export KUBECONFIG=$PWD/.cluster/kubeconfig (docs/cluster.md)"


class KubeconfigError(Exception):
    """No usable Kubernetes credentials; the message is one line with the fix."""


def in_cluster(kubeconfig: str | None = None) -> bool:
    """Whether `load` uses the pod's ServiceAccount."""
    return (
        not kubeconfig
        and not os.environ.get("KUBECONFIG")
        and bool(os.environ.get("KUBERNETES_SERVICE_HOST"))
    )


def load(kubeconfig: str | None = None) -> str:
    """Configure the kubernetes client's default Configuration; returns the default namespace (the context's,
    or the pod's own in a cluster). Raises KubeconfigError."""
    from kubernetes import config

    if in_cluster(kubeconfig):
        try:
            config.load_incluster_config()
        except config.ConfigException as exc:
            raise KubeconfigError(f"in-cluster credentials: {exc}; or set KUBECONFIG") from None
        try:
            return (SERVICE_ACCOUNT / "namespace").read_text().strip() or "default"
        except OSError:
            return "default"
    files = _files(kubeconfig)
    merged = _merged(files)
    context = _current_context(files, merged)
    where = os.pathsep.join(map(str, files))
    try:
        config.load_kube_config(config_file=where)
    except Exception as exc:  # noqa: BLE001 - anything the loader finds (a missing cert file, ...) is one line
        raise KubeconfigError(f"kubeconfig {where}: {_one_line(exc)}") from None
    return context.get("namespace") or "default"


def fail(exc: KubeconfigError) -> int:
    """What a CLI command does with a KubeconfigError: one line on stderr, exit 2."""
    print(f"error: {exc}", file=sys.stderr)
    return 2


def _files(kubeconfig: str | None) -> list[Path]:
    """The kubeconfig files that exist, in kubectl's order; a KubeconfigError when there is none."""
    if kubeconfig:
        named, source = [kubeconfig], f"--kubeconfig {kubeconfig}"
    elif os.environ.get("KUBECONFIG"):
        named = [p for p in os.environ["KUBECONFIG"].split(os.pathsep) if p]
        source = f"KUBECONFIG={os.environ['KUBECONFIG']}"
    else:
        default = Path("~/.kube/config").expanduser()
        if not default.is_file():
            raise KubeconfigError(
                f"no kubeconfig: KUBECONFIG is not set and {default} does not exist; set KUBECONFIG, or {FIX}"
            )
        return [default]
    found = [Path(p).expanduser() for p in named if Path(p).expanduser().is_file()]
    if not found:
        raise KubeconfigError(
            f"no kubeconfig: {source} names no file that exists; point it at a kubeconfig, or {FIX}"
        )
    return found


def _merged(files: list[Path]) -> dict[str, Any]:
    """The files read as kubectl merges them: the first current-context, contexts by name."""
    import yaml

    merged: dict[str, Any] = {"contexts": []}
    for f in files:
        try:
            doc = yaml.safe_load(f.read_text())
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            at = f" (line {mark.line + 1})" if mark is not None else ""
            problem = getattr(exc, "problem", None) or "cannot parse"
            raise KubeconfigError(
                f"kubeconfig {f} is not valid YAML: {problem}{at}; fix the file or point "
                f"KUBECONFIG at another, or {FIX}"
            ) from None
        except OSError as exc:
            raise KubeconfigError(f"cannot read kubeconfig {f}: {exc.strerror or exc}") from None
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise KubeconfigError(
                f"kubeconfig {f} is not a kubeconfig (a YAML mapping of clusters, users and "
                f"contexts); point KUBECONFIG at one, or {FIX}"
            )
        if not merged.get("current-context"):
            merged["current-context"] = doc.get("current-context")
        merged["contexts"] += [c for c in doc.get("contexts") or [] if isinstance(c, dict)]
    return merged


def _current_context(files: list[Path], merged: dict[str, Any]) -> dict[str, Any]:
    where = ", ".join(map(str, files))
    names = [c.get("name") for c in merged["contexts"] if c.get("name")]
    current = merged.get("current-context")
    if not names:
        raise KubeconfigError(
            f"kubeconfig {where} has no contexts; point KUBECONFIG at a complete one, or {FIX}"
        )
    if not current:
        raise KubeconfigError(
            f"kubeconfig {where} has no current context: run `kubectl config use-context "
            f"NAME` (its contexts: {', '.join(names)})"
        )
    for c in merged["contexts"]:
        if c.get("name") == current:
            return c.get("context") or {}
    raise KubeconfigError(
        f"kubeconfig {where}: the current context {current!r} is not one of its contexts "
        f"({', '.join(names)}); run `kubectl config use-context NAME`"
    )


def _one_line(exc: Exception) -> str:
    return " ".join(str(exc).split()) or type(exc).__name__
