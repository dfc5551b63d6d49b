"""Paged attention over a packed batch, in triton.

One kernel serves prefill chunks and decode tokens alike. The packed batch is cut into query blocks of
BLOCK_Q tokens that never straddle two sequences; a program owns one query block and one KV head, and
stacks the GROUP query heads that share that KV head into the rows of one tile (BLOCK_M = BLOCK_Q x
GROUP_PAD rows), so K/V are read once per KV head, not once per query head. K/V are read through the
block table a tile of BLOCK_N tokens at a time (token -> block_tables[seq, pos // B] -> cache row), so
any block size and any order of blocks works. Causality is by absolute position: query j of a sequence
with q_len new tokens and seq_len tokens of context sits at seq_len - q_len + j.

Programs find their sequence without a host round trip: sequence i's query blocks are numbered from
query_start_loc[i] // BLOCK_Q + i, which leaves at most one unused block number per sequence, so a grid
of T // BLOCK_Q + S programs covers every batch and each program binary-searches query_start_loc.

Split-K (flash decoding): when a few sequences decode over long contexts, one program per (sequence, KV
head) leaves most of the GPU idle. The same kernel then runs with NUM_SPLITS > 1 programs per query
block, each over one slice of the context, writing an unnormalised partial output with its running max
and sum; a second kernel merges the slices. `choose_num_splits` is the heuristic.

Softmax runs in base 2 (scale * log2(e) folded into the scores) and accumulates in fp32 whatever the
input dtype. fp32 inputs never drop silently to TF32: 3xTF32 dot products on CUDA, IEEE in the
interpreter, so fp32 results match the reference closely.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl

from kvpilot.kernels.metadata import AttentionMetadata

LOG2E = 1.4426950408889634

# Query-tile rows. BLOCK_M >= 16 and BLOCK_N >= 16 keep tl.dot legal on GPUs.
BLOCK_M_PREFILL = 64
BLOCK_M_DECODE = 16
# Split-K.
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256
SPLIT_TARGET_WAVES = 2  # split until (sequence, KV head, slice) programs fill this many waves of SMs

TILE_OVERRIDE: dict[str, int] | None = None  # for experiments: dict(block_n=, num_warps=, num_stages=)


def _tile(head_dim: int, block_m: int, dtype: torch.dtype, capability: tuple[int, int]) -> dict[str, int]:
    """KV tile and launch shape, chosen by compiling for sm_80 and sm_90 without a GPU
    (tests/kernels/native_compile_check.py): no register spills, K/V loads pipelined through shared
    memory, prefill tiles on wgmma on Hopper. Not yet tuned on hardware."""
    if TILE_OVERRIDE is not None:
        return dict(TILE_OVERRIDE)
    hopper = capability[0] >= 9
    prefill = block_m > BLOCK_M_DECODE
    if dtype == torch.float32:
        return dict(block_n=32, num_warps=8, num_stages=2)
    if head_dim <= 128:
        return dict(block_n=64, num_warps=8 if prefill and not hopper else 4, num_stages=3)
    if prefill and not hopper:
        return dict(block_n=32, num_warps=8, num_stages=3)
    return dict(block_n=32, num_warps=4, num_stages=2)


def _fp32_dot_precision(device: torch.device) -> str:
    """fp32 must not silently drop to TF32: 3xTF32 keeps about fp32 accuracy on tensor cores."""
    return "tf32x3" if device.type == "cuda" and not _interpreting() else "ieee"


def _capability(device: torch.device) -> tuple[int, int]:
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)
    return (9, 0)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit
def _find_seq(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q: tl.constexpr):
    """The sequence whose numbered query blocks contain `q_block_id` (binary search)."""
    lo = num_seqs * 0  # runtime scalars (num_seqs is never specialised), so the loop can carry them
    hi = num_seqs + 0
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block_id:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit(do_not_specialize=["num_seqs"])
def _paged_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    out_ptr,  # [T, H, D] output, or [NUM_SPLITS, T, H, D] fp32 partial output when NUM_SPLITS > 1
    m_ptr,  # [NUM_SPLITS, T, H] fp32 running max (base 2), split mode only
    l_ptr,  # [NUM_SPLITS, T, H] fp32 running sum, split mode only
    query_start_loc_ptr,
    seq_lens_ptr,
    block_tables_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kn,
    stride_kb,
    stride_kh,
    stride_os,
    stride_ot,
    stride_oh,
    stride_ms,
    stride_mt,
    stride_mh,
    stride_bt,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    D_PADDED: tl.constexpr,
    KV_BLOCK_SIZE: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    q_block_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, num_seqs, q_block_id, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block = q_block_id - (q_start // BLOCK_Q + seq)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    first_pos = seq_len - q_len  # absolute position of the sequence's first query token

    rows = tl.arange(0, BLOCK_M)
    q_local = q_block * BLOCK_Q + rows // GROUP_PAD
    g = rows % GROUP_PAD
    head = kv_head * GROUP + g
    row_ok = (q_local < q_len) & (g < GROUP)
    q_pos = first_pos + q_local
    token = (q_start + q_local).to(tl.int64)

    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    compute_dtype = q.dtype
    if UPCAST:
        compute_dtype = tl.float32
        q = q.to(tl.float32)

    # Keys this query block can see: positions < end of its last query (causal), < seq_len.
    kv_end = tl.minimum(seq_len, first_pos + (q_block + 1) * BLOCK_Q)
    if NUM_SPLITS == 1:
        kv_lo = split * 0
        kv_hi = kv_end
    else:
        per_split = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        kv_lo = split * per_split
        kv_hi = tl.minimum(kv_end, kv_lo + per_split)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    k_base = k_cache_ptr + kv_head.to(tl.int64) * stride_kh
    v_base = v_cache_ptr + kv_head.to(tl.int64) * stride_kh

    for start in range(kv_lo, kv_hi, BLOCK_N):
        k_pos = start + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_hi
        block = tl.load(table_row + k_pos // KV_BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
        # One 64-bit offset per token (K and V caches share their layout), 32-bit offsets along D.
        row = block * stride_kn + (k_pos % KV_BLOCK_SIZE) * stride_kb
        if D_PADDED:
            kv_mask = k_ok[:, None] & d_ok[None, :]
        else:
            kv_mask = k_ok[:, None]
        k = tl.load(k_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(compute_dtype)
        v = tl.load(v_base + row[:, None] + d[None, :], mask=kv_mask, other=0.0).to(compute_dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row that has seen no key yet keeps m = -inf; subtract 0 instead so no NaN appears.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(compute_dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = row_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        o = acc / l_safe[:, None]
        tl.store(
            out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        split_off = split.to(tl.int64)
        tl.store(
            out_ptr
            + split_off * stride_os
            + token[:, None] * stride_ot
            + head[:, None] * stride_oh
            + d[None, :],
            acc,
            mask=out_mask,
        )
        ml_off = split_off * stride_ms + token * stride_mt + head * stride_mh
        tl.store(m_ptr + ml_off, m_i, mask=row_ok)
        tl.store(l_ptr + ml_off, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_ptr,  # [NUM_SPLITS, T, H, D] fp32
    m_ptr,  # [NUM_SPLITS, T, H] fp32
    l_ptr,
    out_ptr,  # [T, H, D]
    stride_ps,
    stride_pt,
    stride_ph,
    stride_ms,
    stride_mt,
    stride_ot,
    stride_oh,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    s = tl.arange(0, SPLITS_PAD)
    s_ok = s < NUM_SPLITS
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM
    ml_off = s.to(tl.int64) * stride_ms + t * stride_mt + h
    m = tl.load(m_ptr + ml_off, mask=s_ok, other=float("-inf"))
    l_part = tl.load(l_ptr + ml_off, mask=s_ok, other=0.0)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.where(s_ok, tl.exp2(m - m_max), 0.0)  # an empty slice has m = -inf: weight 0
    denom = tl.sum(w * l_part, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    part = tl.load(
        part_ptr + s[:, None].to(tl.int64) * stride_ps + t * stride_pt + h * stride_ph + d[None, :],
        mask=s_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    o = tl.sum(part * w[:, None], 0) / denom
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8  # the interpreter: any fixed number keeps the heuristic deterministic


def choose_num_splits(
    num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int, num_sms: int
) -> int:
    """How many context slices each decode program gets (1 = no split-K).

    Split only decode-only batches (prefill has enough query blocks to fill the GPU), only when the
    (sequence, KV head) programs fill less than SPLIT_TARGET_WAVES waves of SMs, and never into slices shorter
    than MIN_TOKENS_PER_SPLIT tokens, where merging would cost more than it saves.
    """
    if max_query_len != 1 or num_seqs == 0:
        return 1
    programs = num_seqs * num_kv_heads
    if programs >= SPLIT_TARGET_WAVES * num_sms:
        return 1
    by_occupancy = math.ceil(SPLIT_TARGET_WAVES * num_sms / programs)
    by_length = max_seq_len // MIN_TOKENS_PER_SPLIT
    return max(1, min(MAX_SPLITS, by_occupancy, by_length))


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as `kvpilot.kernels.reference.paged_attention`; `num_splits` forces the split-K
    variant (None: `choose_num_splits`)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("K and V caches must share one layout with a contiguous head dimension")
    if query.stride(-1) != 1:
        query = query.contiguous()  # a unit stride along D is a compile-time fact: vector loads
    out = torch.empty_like(query, memory_format=torch.contiguous_format)
    num_seqs = len(meta.seq_lens_list)
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_m = BLOCK_M_DECODE if meta.max_query_len <= 1 else BLOCK_M_PREFILL
    if query.dtype == torch.float32:
        block_m = min(block_m, 32 if head_dim <= 128 else 16)  # fp32 tiles are twice the bytes
    block_m = max(block_m, group_pad)
    block_q = block_m // group_pad
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits is None:
        num_splits = choose_num_splits(
            num_seqs, num_kv_heads, meta.max_query_len, meta.max_seq_len, _num_sms(query.device)
        )
    num_splits = max(1, int(num_splits))

    interpreting = _interpreting()
    upcast = interpreting and query.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong
    precision = None  # the target's default; fp16/bf16 dots are exact products with fp32 sums anyway
    if query.dtype == torch.float32 or upcast:
        precision = _fp32_dot_precision(query.device)
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    tile = _tile(head_dim, block_m, query.dtype, _capability(query.device))
    common = dict(
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=tile["block_n"],
        BLOCK_D=block_d,
        HEAD_DIM=head_dim,
        D_PADDED=block_d != head_dim,
        KV_BLOCK_SIZE=k_cache.shape[1],
        NUM_SPLITS=num_splits,
        UPCAST=upcast,
        DOT_PRECISION=precision,
        num_warps=tile["num_warps"],
        num_stages=tile["num_stages"],
    )
    if num_splits == 1:
        target, m, lse_sum = out, out, out  # m/l are unused without splits
        split_stride = 0
        ms: tuple[int, ...] = (0, 0, 0)
    else:
        target = torch.empty((num_splits, *query.shape), dtype=torch.float32, device=query.device)
        m = torch.empty((num_splits, num_tokens, num_heads), dtype=torch.float32, device=query.device)
        lse_sum = torch.empty_like(m)
        split_stride = target.stride(0)
        ms = m.stride()
    ts = target.stride()[-3:]
    _paged_attention_kernel[grid](
        query,
        k_cache,
        v_cache,
        target,
        m,
        lse_sum,
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_tables,
        num_seqs,
        scale * LOG2E,
        *query.stride()[:2],
        *k_cache.stride()[:3],
        split_stride,
        *ts[:2],
        *ms,
        meta.block_tables.stride(0),
        **common,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            target,
            m,
            lse_sum,
            out,
            target.stride(0),
            target.stride(1),
            target.stride(2),
            m.stride(0),
            m.stride(1),
            *out.stride()[:2],
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            BLOCK_D=block_d,
            HEAD_DIM=head_dim,
            num_warps=4,
        )
    return out
