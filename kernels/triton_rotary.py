"""Rotary position embedding in triton, in place, Llama/neox layout.

Each head's first and second halves (x1, x2) are rotated by the position's angles:
x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, computed in fp32 and written back in the tensor's dtype.
One program per token rotates all its query heads and all its key heads, BLOCK_H heads at a time.
cos_sin_cache[pos] = cat(cos, sin) of the D/2 frequencies (float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    ptr, t, stride_t, stride_h, stride_d, num_heads, cos, sin, i, i_ok, HALF, BLOCK_H: tl.constexpr
):
    for h0 in range(0, num_heads, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = (h[:, None] < num_heads) & i_ok[None, :]
        p1 = ptr + t * stride_t + h[:, None] * stride_h + i[None, :] * stride_d
        p2 = p1 + HALF * stride_d
        x1 = tl.load(p1, mask=mask, other=0.0)
        x2 = tl.load(p2, mask=mask, other=0.0)
        f1 = x1.to(tl.float32)
        f2 = x2.to(tl.float32)
        r1 = f1 * cos[None, :] - f2 * sin[None, :]
        r2 = f2 * cos[None, :] + f1 * sin[None, :]
        tl.store(p1, r1.to(x1.dtype), mask=mask)
        tl.store(p2, r2.to(x2.dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cache_ptr,
    num_heads,
    num_kv_heads,
    stride_qt,
    stride_qh,
    stride_qd,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_c,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_ok = i < HALF
    cos = tl.load(cache_ptr + pos * stride_c + i, mask=i_ok, other=0.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * stride_c + HALF + i, mask=i_ok, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, t, stride_qt, stride_qh, stride_qd, num_heads, cos, sin, i, i_ok, HALF, BLOCK_H)
    _rotate_heads(k_ptr, t, stride_kt, stride_kh, stride_kd, num_kv_heads, cos, sin, i, i_ok, HALF, BLOCK_H)


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Same contract as `kvpilot.kernels.reference.rotary` (in place on query and key)."""
    num_tokens, num_heads, head_dim = query.shape
    if num_tokens == 0:
        return
    half = head_dim // 2
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(num_tokens,)](
        query,
        key,
        positions,
        cache,
        num_heads,
        key.shape[1],
        *query.stride(),
        *key.stride(),
        cache.stride(0),
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=max(1, min(triton.next_power_of_2(max(num_heads, key.shape[1])), 4096 // block_half)),
        num_warps=4,
    )
