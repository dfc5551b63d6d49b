"""The one dispatch point between the model and its kernels.

`select_ops(device)` returns the op set a model runs on: triton kernels on CUDA, the torch reference
elsewhere. `KVPILOT_KERNELS=torch|triton` (or the `backend` argument) forces either; forcing triton on
the CPU only works under `TRITON_INTERPRET=1`, which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.kernels import reference

BACKENDS = ("torch", "triton")


@dataclass(frozen=True, slots=True)
class Ops:
    name: str
    write_kv: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    rotary: Callable[..., None]
    silu_and_mul: Callable[..., torch.Tensor]
    lora_add: Callable[..., None]


TORCH_OPS = Ops(
    name="torch",
    write_kv=reference.write_kv,
    paged_attention=reference.paged_attention,
    rms_norm=reference.rms_norm,
    rotary=reference.rotary,
    silu_and_mul=reference.silu_and_mul,
    lora_add=reference.lora_add,
)


def _triton_ops() -> Ops:
    from kvpilot.kernels import triton_ops  # imported lazily: triton is optional on the CPU

    return triton_ops.TRITON_OPS


def select_ops(device: torch.device | str, backend: str | None = None) -> Ops:
    """Pick the op set for `device`; `backend` or $KVPILOT_KERNELS overrides the automatic choice."""
    choice = backend or os.environ.get("KVPILOT_KERNELS") or "auto"
    if choice == "auto":
        choice = "triton" if torch.device(device).type == "cuda" else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS} or 'auto'")
    if choice == "torch":
        return TORCH_OPS
    return _triton_ops()
