"""Fixtures for the chart tests: the real helm (`make tools`) with its own config folders, and for the
cluster tests the dev cluster (support.cluster) with the prometheus-operator CRDs applied."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from chart.tools import Helm
from support.cluster import Cluster


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))


@pytest.fixture(scope="session")
def monitoring_crds_applied(cluster: Cluster) -> Iterator[None]:
    from chart.tools import monitoring_crds

    cluster.kubectl("apply", "--server-side", "-f", str(monitoring_crds()))
    for crd in ("podmonitors", "servicemonitors", "prometheusrules"):
        cluster.kubectl(
            "wait", "--for=condition=Established", f"crd/{crd}.monitoring.coreos.com", "--timeout=60s"
        )
    yield
