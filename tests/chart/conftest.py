"""Fixtures for the chart tests: the real helm (`make tools`) with its own config folders, and for the
cluster tests the dev cluster with the prometheus-operator CRDs applied."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from cluster.conftest import Cluster, cluster  # noqa: F401 - the dev cluster fixture (tests/cluster)

from chart.tools import ROOT, tool

CHART = ROOT / "charts" / "kvpilot"


class Helm:
    """helm with private config/cache/data folders; `kubeconfig` for the commands that reach a cluster."""

    def __init__(self, home: Path, kubeconfig: Path | None = None) -> None:
        self.env = {**os.environ, "HELM_CONFIG_HOME": str(home / "config"), "HELM_CACHE_HOME": str(home / "cache"),
                    "HELM_DATA_HOME": str(home / "data")}  # fmt: skip
        if kubeconfig is not None:
            self.env["KUBECONFIG"] = str(kubeconfig)
        self.bin = tool("helm")

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        r = subprocess.run([self.bin, *args], env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        return r

    def template(self, *args: str) -> list[dict]:
        """Rendered objects of the chart (`helm template kvpilot charts/kvpilot -n kvpilot-system ARGS`)."""
        out = self("template", "kvpilot", str(CHART), "--namespace", "kvpilot-system", *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


def kinds(objs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for o in objs:
        out.setdefault(o["kind"], []).append(o)
    return out


@pytest.fixture(scope="session")
def monitoring_crds_applied(cluster: Cluster) -> Iterator[None]:  # noqa: F811
    from chart.tools import monitoring_crds

    cluster.kubectl("apply", "--server-side", "-f", str(monitoring_crds()))
    for crd in ("podmonitors", "servicemonitors", "prometheusrules"):
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}.monitoring.coreos.com", "--timeout=60s"
        )
    yield
