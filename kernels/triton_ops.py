"""The triton op set (`TRITON_OPS`), picked by `kvpilot.kernels.ops.select_ops` on CUDA or when forced.

Each op has the signature of its torch twin in `kvpilot.kernels.reference`. On the CPU the kernels only
run under the triton interpreter (`TRITON_INTERPRET=1`, set before this module is imported).
"""

from __future__ import annotations

from kvpilot.kernels.ops import Ops
from kvpilot.kernels.triton_activation import silu_and_mul
from kvpilot.kernels.triton_attention import paged_attention
from kvpilot.kernels.triton_kv_write import write_kv
from kvpilot.kernels.triton_lora import lora_add
from kvpilot.kernels.triton_norm import rms_norm
from kvpilot.kernels.triton_rotary import rotary

TRITON_OPS = Ops(
    name="triton",
    write_kv=write_kv,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    rotary=rotary,
    silu_and_mul=silu_and_mul,
    lora_add=lora_add,
)

__all__ = ["TRITON_OPS"]
