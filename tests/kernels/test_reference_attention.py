"""The torch reference attention (the CPU path and the triton kernels' ground truth) against a naive
float64 attention, on batches whose sequences share leading blocks as prefix-cache hits do."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.kernels import AttentionMetadata, reference
from kvpilot.kernels.reference import paged_attention
from kvpilot.kernels.reference_plan import plan_attention

BLOCK = 4


def _naive(query, k_cache, v_cache, q_lens, seq_lens, tables, scale):  # noqa: ANN001, ANN202
    out, row = [], 0
    group = query.shape[1] // k_cache.shape[2]
    for q_len, seq_len, table in zip(q_lens, seq_lens, tables):
        slots = [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(seq_len)]
        k = k_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)  # [L, H, D]
        v = v_cache.flatten(0, 1)[slots].double().repeat_interleave(group, 1)
        for j in range(q_len):
            visible = seq_len - q_len + j + 1
            q = query[row + j].double()  # [H, D]
            p = torch.softmax(torch.einsum("hd,lhd->hl", q, k[:visible]) * scale, -1)
            out.append(torch.einsum("hl,lhd->hd", p, v[:visible]))
        row += q_len
    return torch.stack(out)


def _case(seed: int, prefixes: list[list[int]], members: list[tuple[int, int, int]], dtype: torch.dtype):
    """`members`: (prefix index or -1, own tokens after it, queries at the end). Each prefix is a list of
    block ids; the sequences' own blocks come shuffled from the rest of the pool. Every slot outside a
    sequence's context holds NaN, so any read past a context shows in the output."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    used = {b for p in prefixes for b in p}
    free = [b for b in range(1, 200) if b not in used]
    rng.shuffle(free)
    q_lens, seq_lens, tables = [], [], []
    for prefix, own, q_len in members:
        shared = prefixes[prefix] if prefix >= 0 else []
        seq_len = len(shared) * BLOCK + own
        need = -(-seq_len // BLOCK) - len(shared)
        tables.append(shared + [free.pop() for _ in range(need)])
        seq_lens.append(seq_len)
        q_lens.append(q_len)
    kv_heads, group, dim = 2, 3, 16
    shape = (200, BLOCK, kv_heads, dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    for seq_len, table in zip(seq_lens, tables):
        for p in range(seq_len):
            b, o = table[p // BLOCK], p % BLOCK
            if torch.isnan(k_cache[b, o]).any():  # a shared slot keeps the value its first owner wrote
                k_cache[b, o] = torch.randn((kv_heads, dim), generator=gen).to(dtype)
                v_cache[b, o] = torch.randn((kv_heads, dim), generator=gen).to(dtype)
    query = torch.randn((sum(q_lens), kv_heads * group, dim), generator=gen).to(dtype)
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, torch.device("cpu"))
    return query, k_cache, v_cache, meta, q_lens, seq_lens, tables


# Two groups: one prefix of consecutive blocks (read as a view), one shuffled; members that decode,
# members with several queries past the prefix, a member whose queries start inside the shared blocks
# (it cannot use them all, so the group's prefix shrinks to what it sees), and unrelated sequences.
PREFIXES = [[10, 11, 12, 13, 14], [40, 7, 33]]
MEMBERS = [
    (0, 3, 1),
    (0, 9, 1),
    (0, 1, 1),
    (0, 6, 4),
    (-1, 9, 1),
    (1, 2, 1),
    (1, 5, 5),
    (1, 0, 1),
    (-1, 13, 13),
    (0, 2, 11),
    (-1, 1, 1),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_shared_prefix_batch_matches_naive_attention(dtype: torch.dtype) -> None:
    query, k_cache, v_cache, meta, q_lens, seq_lens, tables = _case(0, PREFIXES, MEMBERS, dtype)
    plan = plan_attention(meta, BLOCK, query.device)
    assert [p.span is not None for p in plan.prefixes] == [True, False]  # both grouped, both read paths
    assert plan.prefixes[0].span == (10 * BLOCK, 12 * BLOCK)  # the member starting mid-prefix limits it
    assert sum(u.prefix is not None for u in plan.units) == 4  # 2 groups x (decode rows, short chunks)
    out = paged_attention(query, k_cache, v_cache, meta, 0.25)
    assert out.dtype == dtype and torch.isfinite(out.float()).all()
    expected = _naive(query, k_cache, v_cache, q_lens, seq_lens, tables, 0.25)
    tol = 1e-5 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), expected, atol=tol, rtol=tol)


def test_plan_is_built_once_per_step() -> None:
    query, k_cache, v_cache, meta, *_ = _case(1, PREFIXES, MEMBERS, torch.float32)
    first = paged_attention(query, k_cache, v_cache, meta, 0.25)
    plan = meta.reference_plan
    second = paged_attention(query, k_cache, v_cache, meta, 0.25)
    assert meta.reference_plan is plan
    torch.testing.assert_close(first, second, atol=0, rtol=0)


@pytest.mark.parametrize("seed", range(6))
def test_random_batches_match_naive_attention(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    if seed % 2:  # long chunks are taken in slices of rows: make every chunk long
        monkeypatch.setattr(reference, "_MAX_SCORES", 64)
    rng = random.Random(seed)
    prefixes = [[100 + 10 * g + i for i in range(rng.randint(1, 4))] for g in range(2)]
    prefixes[1].reverse()
    members = []
    for _ in range(rng.randint(1, 9)):
        own = rng.randint(0, 12)
        prefix = rng.choice([-1, 0, 1])
        if prefix < 0:
            own = max(own, 1)
        total = own + (len(prefixes[prefix]) * BLOCK if prefix >= 0 else 0)
        members.append((prefix, own, rng.choice([1, 1, rng.randint(1, max(1, total))])))
    members = [
        (p, o, q) for p, o, q in members if (o + (len(prefixes[p]) * BLOCK if p >= 0 else 0)) >= q >= 1
    ]
    query, k_cache, v_cache, meta, q_lens, seq_lens, tables = _case(seed, prefixes, members, torch.float32)
    out = paged_attention(query, k_cache, v_cache, meta, 0.3)
    expected = _naive(query, k_cache, v_cache, q_lens, seq_lens, tables, 0.3)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
