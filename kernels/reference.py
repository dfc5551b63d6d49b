"""Torch reference ops: the CPU path, and the ground truth the triton kernels are tested against.

Every op here has the exact signature of its triton twin (see `kvpilot.kernels.ops`).
Shapes use T = tokens in the packed batch, H = query heads, Hkv = KV heads, D = head size,
N = blocks in the pool, B = block size (tokens per block), S = sequences in the batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvpilot.kernels.metadata import AttentionMetadata


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Scatter K/V of the new tokens into the paged cache.

    key, value: [T, Hkv, D]; k_cache, v_cache: [N, B, Hkv, D]; slot_mapping: [T] int64,
    slot = block_id * B + offset.
    """
    n, b = k_cache.shape[0], k_cache.shape[1]
    # A request whose K/V overflowed is lost anyway; storing its inf/NaN would let it leak into other
    # requests' rows through masked padding slots (0 * NaN is NaN), so the cache only holds finite values.
    key = torch.nan_to_num(key, nan=0.0, posinf=0.0, neginf=0.0)
    value = torch.nan_to_num(value, nan=0.0, posinf=0.0, neginf=0.0)
    k_cache.view(n * b, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(n * b, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """[num_blocks_of_seq, B, Hkv, D] -> [seq_len, Hkv, D] for one sequence."""
    blocks = cache.index_select(0, block_table)
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a packed batch over K/V read through block tables.

    query: [T, H, D]. Sequence i owns query rows query_start_loc[i]:query_start_loc[i+1]; they are the
    last q_len positions of a context of seq_lens[i] tokens whose K/V are already in the cache (the new
    tokens' K/V included). Grouped-query heads: H is a multiple of Hkv. Returns [T, H, D].
    """
    out = torch.empty_like(query)
    num_heads, num_kv_heads = query.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    starts = meta.query_start_loc_list
    seq_lens = meta.seq_lens_list
    # Decode rows (q_len == 1) are batched into one padded call: that is where most calls are.
    decode_ids = [i for i in range(len(seq_lens)) if starts[i + 1] - starts[i] == 1]
    if decode_ids:
        _decode_batch(query, k_cache, v_cache, meta, decode_ids, scale, group, out)
    decode_set = set(decode_ids)
    for i, seq_len in enumerate(seq_lens):
        if i in decode_set:
            continue
        q0, q1 = starts[i], starts[i + 1]
        q_len = q1 - q0
        table = meta.block_tables[i]
        k = _gather_context(k_cache, table, seq_len)
        v = _gather_context(v_cache, table, seq_len)
        q = query[q0:q1].transpose(0, 1)  # [H, q_len, D]
        k = k.transpose(0, 1)  # [Hkv, seq_len, D]: grouped heads share it, no copy per head
        v = v.transpose(0, 1)
        # Query j sits at absolute position seq_len - q_len + j and sees keys at positions <= that.
        qpos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        kpos = torch.arange(seq_len, device=query.device)
        mask = kpos[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(
            q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=group > 1
        )
        out[q0:q1] = o.transpose(0, 1)
    return out


def _decode_batch(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq_ids: list[int],
    scale: float,
    group: int,
    out: torch.Tensor,
) -> None:
    block_size = k_cache.shape[1]
    lens = [meta.seq_lens_list[i] for i in seq_ids]
    max_blocks = (max(lens) + block_size - 1) // block_size
    tables = meta.block_tables[seq_ids, :max_blocks]  # [S, M]
    rows = torch.tensor([meta.query_start_loc_list[i] for i in seq_ids], device=query.device)
    q = query.index_select(0, rows).unsqueeze(2)  # [S, H, 1, D]
    s = len(seq_ids)
    width = max_blocks * block_size
    k = k_cache[tables].reshape(s, width, *k_cache.shape[2:])  # [S, L, Hkv, D]
    v = v_cache[tables].reshape(s, width, *v_cache.shape[2:])
    k = k.transpose(1, 2).to(q.dtype)  # [S, Hkv, L, D]
    v = v.transpose(1, 2).to(q.dtype)
    # Padding slots (block 0, the tail of a last block) hold what an earlier owner left; masking them
    # is enough because write_kv never stores a non-finite value (0 * NaN would be NaN).
    valid = (
        torch.arange(width, device=query.device)[None, :] < torch.tensor(lens, device=query.device)[:, None]
    )
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=group > 1
    )
    out[rows] = o.squeeze(2)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm with a fused residual add: h = x + residual (or x); returns (norm(h) * weight, h)."""
    h = x if residual is None else x + residual
    hf = h.float()
    normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    return (normed.to(x.dtype) * weight).to(x.dtype), h


def rotary(
    query: torch.Tensor,
    key: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Rotary embedding in place, Llama/neox layout (rotate the two halves of each head).

    query: [T, H, D], key: [T, Hkv, D], positions: [T] int64,
    cos_sin_cache: [max_positions, D] float32 = cat(cos, sin) of the D/2 frequencies.
    """
    half = query.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = cs[:, None, :half]
    sin = cs[:, None, half:]
    for t in (query, key):
        x1 = t[..., :half].float()
        x2 = t[..., half:].float()
        r1 = x1 * cos - x2 * sin
        r2 = x2 * cos + x1 * sin
        t[..., :half] = r1.to(t.dtype)
        t[..., half:] = r2.to(t.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]
