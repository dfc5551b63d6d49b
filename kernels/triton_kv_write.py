"""KV write in triton: scatter the new tokens' K and V into the paged cache by slot mapping.

One program per token copies all of its KV heads (a [Hkv, D] tile) of K and of V to
cache[slot // B, slot % B]. A negative slot (padding) writes nothing. Values are cast to the cache's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_kv_heads,
    stride_kt,
    stride_kh,
    stride_kd,
    stride_vt,
    stride_vh,
    stride_vd,
    stride_kcn,
    stride_kcb,
    stride_kch,
    stride_kcd,
    stride_vcn,
    stride_vcb,
    stride_vch,
    stride_vcd,
    HEAD_DIM: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // KV_BLOCK_SIZE
    offset = slot % KV_BLOCK_SIZE
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    mask = (h[:, None] < num_kv_heads) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :] * stride_kd, mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :] * stride_vd, mask=mask)
    k_dst = (
        k_cache_ptr
        + block * stride_kcn
        + offset * stride_kcb
        + h[:, None] * stride_kch
        + d[None, :] * stride_kcd
    )
    v_dst = (
        v_cache_ptr
        + block * stride_vcn
        + offset * stride_vcb
        + h[:, None] * stride_vch
        + d[None, :] * stride_vcd
    )
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `kvpilot.kernels.reference.write_kv`."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        num_kv_heads,
        *key.stride(),
        *value.stride(),
        *k_cache.stride(),
        *v_cache.stride(),
        HEAD_DIM=head_dim,
        KV_BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=4,
    )
