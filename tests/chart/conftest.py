"""Fixtures for the chart tests: the real helm (`make tools`) with its own config folders."""

from __future__ import annotations

import pytest

from chart.tools import Helm


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    return Helm(tmp_path_factory.mktemp("helm"))
