"""SiLU-and-multiply in triton: [..., 2I] -> silu(x[..., :I]) * x[..., I:].

silu is computed in fp32 and rounded to the input dtype before the product (as the reference's
F.silu(a) * b does), the product in fp32 and rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, inter, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    a = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    b = tl.load(x_ptr + row * stride_x + inter + cols, mask=ok, other=0.0).to(tl.float32)
    af = a.to(tl.float32)
    silu = (af / (1.0 + tl.exp(-af))).to(a.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (silu * b).to(out_ptr.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Same contract as `kvpilot.kernels.reference.silu_and_mul`."""
    inter = x.shape[-1] // 2
    out = torch.empty((*x.shape[:-1], inter), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    o2 = out.view(-1, inter)
    block = min(1024, triton.next_power_of_2(inter))
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, o2, inter, x2.stride(0), o2.stride(0), BLOCK=block, num_warps=4
    )
    return out
