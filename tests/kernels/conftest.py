"""Triton kernels on the CPU, through triton's interpreter.

TRITON_INTERPRET must be set before any `@triton.jit` kernel is defined (triton decides at decoration
time whether a kernel is compiled or interpreted), so it is set here, at conftest import time. pytest
imports every conftest at collection, so in a run that collects this folder the whole process
interprets triton: nothing else in the CPU suite runs triton natively (the engine uses the torch
reference on the CPU). `tests/gpu` needs native kernels and therefore skips, saying so, in a process
where the interpreter is on: run it on its own (`pytest tests/gpu`).
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return
    skip = pytest.mark.skip(reason="TRITON_INTERPRET is off: the CPU kernel tests need triton's interpreter")
    for item in items:
        if "tests/kernels/" in item.nodeid:
            item.add_marker(skip)
