"""RMSNorm with a fused residual add, in triton.

One program per row: h = x + residual (rounded to x's dtype, as the reference does), stored as the new
residual; then norm(h) = h * rsqrt(mean(h^2) + eps) in fp32, rounded to x's dtype, times the weight
(the Hugging Face Llama order of roundings), rounded to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    h_ptr,
    hidden,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0)
    dtype = x.dtype
    h = x.to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=ok, other=0.0).to(tl.float32)
        h_low = (h + r).to(dtype)
        tl.store(h_ptr + row * stride_h + cols, h_low, mask=ok)
        h = h_low.to(tl.float32)
    var = tl.sum(h * h, 0) / hidden
    normed = (h * tl.rsqrt(var + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (normed * w).to(out_ptr.dtype.element_ty), mask=ok)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `kvpilot.kernels.reference.rms_norm`: returns (norm(h) * weight, h)."""
    hidden = x.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    h = x if residual is None else torch.empty_like(x, memory_format=torch.contiguous_format)
    if x.numel() == 0:
        return out, h
    x2 = _rows(x)
    r2 = x2 if residual is None else _rows(residual)
    o2 = out.view(-1, hidden)
    h2 = o2 if residual is None else h.view(-1, hidden)
    block = triton.next_power_of_2(hidden)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        r2,
        weight.contiguous(),
        o2,
        h2,
        hidden,
        float(eps),
        x2.stride(0),
        r2.stride(0),
        o2.stride(0),
        h2.stride(0),
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
    )
    return out, h
