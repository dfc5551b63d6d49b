"""The one dispatch point between the model and its kernels.

`select_ops(device)` returns the op set a model runs on: triton kernels on CUDA; on the CPU the torch
reference, with the project's C attention for decode steps (kernels/cpu_attention.py) and C norm, rotary
and activation (kernels/cpu_elementwise.py), where they run and torch runs on one thread (the kernels are
single-threaded; the reference's matmuls are not). `KVPILOT_KERNELS=
torch|cpu|triton` (or the `backend` argument) forces one; forcing triton on the CPU only works under
`TRITON_INTERPRET=1`, which is how the kernels are tested without a GPU.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvpilot.kernels import cpu_attention, cpu_elementwise, reference

BACKENDS = ("torch", "cpu", "triton")


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


# The reference with the project's C kernels, each of which hands what it does not take to the reference.
CPU_OPS = dataclasses.replace(
    TORCH_OPS,
    name="cpu",
    paged_attention=cpu_attention.paged_attention,
    rms_norm=cpu_elementwise.rms_norm,
    rotary=cpu_elementwise.rotary,
    silu_and_mul=cpu_elementwise.silu_and_mul,
)


def _triton_ops() -> Ops:
    from kvpilot.kernels import triton_ops  # imported lazily: triton is optional on the CPU

    return triton_ops.TRITON_OPS


def select_ops(device: torch.device | str, backend: str | None = None) -> Ops:
    """Pick the op set for `device`; `backend` or $KVPILOT_KERNELS overrides the automatic choice."""
    choice = backend or os.environ.get("KVPILOT_KERNELS") or "auto"
    if choice == "auto":
        if torch.device(device).type == "cuda":
            choice = "triton"
        else:
            choice = "cpu" if torch.get_num_threads() == 1 and cpu_attention.available() else "torch"
    if choice not in BACKENDS:
        raise ValueError(f"unknown kernel backend {choice!r}; expected one of {BACKENDS} or 'auto'")
    if choice == "torch":
        return TORCH_OPS
    if choice == "cpu":
        return CPU_OPS
    return _triton_ops()
