"""Torch reference ops: the CPU path, and the ground truth the triton kernels are tested against.

Every op here has the exact signature of its triton twin (see `kvpilot.kernels.ops`).
Shapes use T = tokens in the packed batch, H = query heads, Hkv = KV heads, D = head size,
N = blocks in the pool, B = block size (tokens per block), S = sequences in the batch.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F

from kvpilot.kernels.metadata import AttentionMetadata
from kvpilot.kernels.reference_plan import SharedPrefix, Unit, plan_attention

# Scores held at once by a long prefill chunk (elements): bounds its memory, not its result.
_MAX_SCORES = 1 << 22


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
    # Stored as computed, inf/NaN included: attention never reads a slot outside the context of the
    # sequence it computes (padding included), so what a request wrote can only reach its own rows.
    k_cache.view(n * b, *k_cache.shape[2:]).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(n * b, *v_cache.shape[2:]).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


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

    Indices and masks come from the step's plan (`reference_plan.py`, built once, shared by all layers):
    a prefix shared by several sequences is read once for all their queries; only the tails after it
    are copied out of the cache. Computes in float32 whatever the cache dtype.
    """
    plan = plan_attention(meta, k_cache.shape[1], query.device)
    kv_shape = k_cache.shape[2:]
    k_flat, v_flat = k_cache.view(-1, *kv_shape), v_cache.view(-1, *kv_shape)
    prefixes = [
        (k_flat[p.span[0] : p.span[1]], v_flat[p.span[0] : p.span[1]])
        if p.span
        else (k_flat.index_select(0, _slots(p)), v_flat.index_select(0, _slots(p)))
        for p in plan.prefixes
    ]
    q = query.float() * scale  # folded into the queries: fewer elements than the scores
    if plan.covers_all_rows:
        return _attend_unit(q, plan.units[0], prefixes, k_flat, v_flat).to(query.dtype)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for u in plan.units:
        if isinstance(u.rows, slice):
            out[u.rows] = _attend_unit(q[u.rows], u, prefixes, k_flat, v_flat)
            continue
        o = _attend_unit(q.index_select(0, u.rows), u, prefixes, k_flat, v_flat)
        if u.real_rows is None:
            out.index_copy_(0, u.rows, o)
        else:  # padded queries of a chunk batch: keep the real ones
            dst, src = u.real_rows
            out.index_copy_(0, dst, o.index_select(0, src))
    return out.to(query.dtype)


def _attend_unit(
    q: torch.Tensor,
    u: Unit,
    prefixes: list[tuple[torch.Tensor, torch.Tensor]],
    k_flat: torch.Tensor,
    v_flat: torch.Tensor,
) -> torch.Tensor:
    """One unit's queries [n, H, D] (already scaled) over its prefix and tails: [n, H, D] float32."""
    n = q.shape[0]
    shared = [] if u.prefix is None else [prefixes[u.prefix]]
    k_tail, v_tail = k_flat.index_select(0, u.tail_slots), v_flat.index_select(0, u.tail_slots)
    if u.num_seqs:
        per_seq = (
            k_tail.view(u.num_seqs, u.tail_len, *k_tail.shape[1:]),
            v_tail.view(u.num_seqs, u.tail_len, *v_tail.shape[1:]),
        )
    elif u.prefix is None:
        # A chunk over its own context only (a prompt's prefill): flash attention skips what the causal
        # mask hides, and with as many queries as keys the mask is SDPA's own (no mask tensor).
        square = n == u.tail_len
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1),
            k_tail.float().transpose(0, 1),
            v_tail.float().transpose(0, 1),
            attn_mask=None if square else u.bias,
            is_causal=square,
            scale=1.0,
            enable_gqa=q.shape[1] != k_tail.shape[1],
        )
        return o.transpose(0, 1)
    else:
        shared.append((k_tail, v_tail))
        per_seq = None
    # A long chunk is taken in slices of rows (of whole sequences in a batch), which bounds the memory
    # its scores take.
    width = u.bias.shape[1]
    per = n // u.num_seqs if u.num_seqs else 1  # rows per slicing step's unit
    step = max(1, _MAX_SCORES // (q.shape[1] * width * per)) * per
    if n <= step:
        return _attend(q, shared, per_seq, u.bias)
    parts = []
    for r in range(0, n, step):
        seqs = (
            None
            if per_seq is None
            else (per_seq[0][r // per : (r + step) // per], per_seq[1][r // per : (r + step) // per])
        )
        parts.append(_attend(q[r : r + step], shared, seqs, u.bias[r : r + step]))
    return torch.cat(parts)


def _attend(
    q: torch.Tensor,
    shared: list[tuple[torch.Tensor, torch.Tensor]],
    per_seq: tuple[torch.Tensor, torch.Tensor] | None,
    bias: torch.Tensor,
) -> torch.Tensor:
    """softmax(q K^T + bias) V in float32 over keys in parts, in this order: `shared` parts, [L, Hkv, D],
    seen by every row, then an optional `per_seq` part, [S, L, Hkv, D]: the rows are S sequences' rows
    in order (n / S each) and each sequence sees its own keys.

    The scores of all parts go into one softmax, laid out [Hkv, n, group, keys]: grouped query heads
    are rows of their KV head's matmul, so K/V are never repeated per head."""
    n, heads, dim = q.shape
    # at least one part: without shared ones, per_seq
    kv_heads = (shared[0][0] if shared else cast(tuple[torch.Tensor, torch.Tensor], per_seq)[0]).shape[-2]
    group = heads // kv_heads
    qh = q.view(n, kv_heads, group, dim).permute(1, 0, 2, 3).reshape(kv_heads, n * group, dim)
    scores = [torch.matmul(qh, k.float().permute(1, 2, 0)).view(kv_heads, n, group, -1) for k, _ in shared]
    if per_seq is not None:
        seqs, tail = per_seq[0].shape[:2]
        rows = n // seqs
        qs = (
            q.view(seqs, rows, kv_heads, group, dim)
            .transpose(1, 2)
            .reshape(seqs, kv_heads, rows * group, dim)
        )
        st = torch.matmul(qs, per_seq[0].float().permute(0, 2, 3, 1))  # [S, Hkv, rows * group, L]
        scores.append(
            st.view(seqs, kv_heads, rows, group, tail).transpose(0, 1).reshape(kv_heads, n, group, tail)
        )
    s = torch.cat(scores, -1) if len(scores) > 1 else scores[0]
    s.add_(bias[:, None, :])
    s.sub_(s.amax(-1, keepdim=True)).exp_()
    total = s.sum(-1, keepdim=True)
    out, offset = None, 0
    for k, v in shared:
        length = k.shape[0]
        p = s[..., offset : offset + length].reshape(kv_heads, n * group, length)
        part = torch.matmul(p, v.float().transpose(0, 1)).view(kv_heads, n, group, dim)
        out = part if out is None else out.add_(part)
        offset += length
    if per_seq is not None:
        p = s[..., offset:].reshape(kv_heads, seqs, rows, group, tail).transpose(0, 1)
        p = p.reshape(seqs, kv_heads, rows * group, tail)
        part = torch.matmul(p, per_seq[1].float().transpose(1, 2))  # [S, Hkv, rows * group, D]
        part = part.view(seqs, kv_heads, rows, group, dim).transpose(0, 1).reshape(kv_heads, n, group, dim)
        out = part if out is None else out.add_(part)
    assert out is not None  # at least one part
    out = out.div_(total)
    return out.permute(1, 0, 2, 3).reshape(n, heads, dim)


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
    Computed as Hugging Face does, x * cos + rotate_half(x) * sin, with the same roundings.
    """
    cos, sin = _rotary_tables(positions, cos_sin_cache)
    half = query.shape[-1] // 2
    for t in (query, key):
        x = t.float()
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        t.copy_(x * cos + rotated * sin)


# The last step's rotary tables: every layer of a step passes the same positions tensor, so the
# per-token cos/sin rows are gathered once per step, by the first layer (a strong reference to the
# positions keeps their identity from being reused by another tensor).
_rotary_step: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _rotary_tables(positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of each token's position, [T, 1, D] each, both halves repeated as HF lays them out."""
    global _rotary_step
    # Traced by torch.compile: no module state (its identity test would recompile every step); the
    # compiler computes the tables once for all layers by itself.
    compiling = torch.compiler.is_compiling()
    step = _rotary_step
    if not compiling and step is not None and step[0] is positions and step[1] is cos_sin_cache:
        return step[2], step[3]
    half = cos_sin_cache.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions)
    cos = torch.cat((cs[:, :half], cs[:, :half]), dim=-1)[:, None, :]
    sin = torch.cat((cs[:, half:], cs[:, half:]), dim=-1)[:, None, :]
    if not compiling:
        _rotary_step = (positions, cos_sin_cache, cos, sin)
    return cos, sin


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(x[..., :I]) * x[..., I:]."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """One LoRA adapter's product, in place: y += (x @ a.T) @ b.T at `rows` (int64, distinct; None: every
    row). x [T, K], a [R, K], b [N, R], y [T, N], all of one dtype."""
    if rows is None:
        y.add_((x @ a.T) @ b.T)
    else:
        y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)


def _slots(p: SharedPrefix) -> torch.Tensor:
    """A prefix's cache slots, there when its blocks are no span."""
    return cast(torch.Tensor, p.slots)
