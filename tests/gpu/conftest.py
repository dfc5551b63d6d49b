"""Native CUDA runs: the triton kernels, with wider sweeps than the CPU interpreter can afford, and the nccl
weight transport.

Every test here is marked `gpu` and skips, saying why, when there is no CUDA device or when this
process interprets triton (tests/kernels sets TRITON_INTERPRET=1 at collection): run this folder in its
own process, `pytest tests/gpu`.
"""

from __future__ import annotations

import os

import pytest


def _skip_reason() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device: tests/gpu (native triton kernels, the nccl weight transport) needs a GPU"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is on in this process (tests/kernels sets it); run `pytest tests/gpu` on its own"
    return None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    mine = [i for i in items if "tests/gpu/" in i.nodeid]
    if not mine:
        return
    reason = _skip_reason()
    for item in mine:
        item.add_marker(pytest.mark.gpu)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
