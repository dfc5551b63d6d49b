"""Paged attention in triton (interpreter) against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import reference
from kvpilot.kernels import triton_attention as ta
from support.kernel_cases import (
    ATTENTION_TOL,
    DTYPES,
    MIXED_BATCH,
    build_attention_case,
    random_attention_case,
)

# (num_kv_heads, group): GQA ratios 1, 3 and 8.
HEADS = [(2, 1), (2, 3), (1, 8)]


def _check(case, dtype, num_splits=None):
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    actual = ta.paged_attention(
        case.query, case.k_cache, case.v_cache, case.meta, case.scale, num_splits=num_splits
    )
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.isfinite(actual.float()).all()
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"kv{h[0]}xg{h[1]}")
@pytest.mark.parametrize("head_dim", [64, 128])
def test_mixed_batch(dtype, heads, head_dim):
    """Decode tokens and prefill chunks over cached blocks in one packed batch, shuffled block tables."""
    num_kv_heads, group = heads
    case = build_attention_case(
        *MIXED_BATCH, num_kv_heads=num_kv_heads, group=group, head_dim=head_dim, block_size=16, dtype=dtype
    )
    _check(case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_single_token(dtype):
    case = build_attention_case([1], [1], num_kv_heads=2, group=3, head_dim=64, block_size=16, dtype=dtype)
    _check(case, dtype)


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes(block_size):
    """Block sizes below and above the kernel's KV tile (BLOCK_N), with a prefix on a block boundary."""
    q_lens, seq_lens = [1, 2 * block_size, 3, 1], [3 * block_size + 1, 4 * block_size, 2 * block_size + 3, 2]
    case = build_attention_case(
        q_lens, seq_lens, num_kv_heads=2, group=3, head_dim=64, block_size=block_size, dtype=torch.float32
    )
    _check(case, torch.float32)


def test_long_prefill_spans_many_query_blocks():
    """A chunk longer than one query block (BLOCK_M rows) next to another sequence: query blocks must
    map to the right sequence and the right causal window."""
    case = build_attention_case(
        [1, 70, 30], [90, 150, 30], num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    _check(case, torch.float32)


def test_head_dim_not_power_of_two():
    case = build_attention_case(
        *MIXED_BATCH, num_kv_heads=2, group=2, head_dim=80, block_size=16, dtype=torch.float32
    )
    _check(case, torch.float32)


@pytest.mark.parametrize("seed", range(4))
def test_random_batches(seed):
    case, dtype = random_attention_case(seed, heads=HEADS, max_seqs=5, max_len=70, block_sizes=[4, 16])
    _check(case, dtype)


# ---- split-K (flash decoding) ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(2, 1), (1, 8)], ids=lambda h: f"kv{h[0]}xg{h[1]}")
@pytest.mark.parametrize("num_splits", [2, 5])
def test_split_k_decode(dtype, heads, num_splits):
    """Decode over long-ish contexts split into slices, some of which end up empty for short sequences."""
    num_kv_heads, group = heads
    case = build_attention_case(
        [1, 1, 1, 1],
        [1, 16, 130, 301],
        num_kv_heads=num_kv_heads,
        group=group,
        head_dim=64,
        block_size=16,
        dtype=dtype,
    )
    _check(case, dtype, num_splits=num_splits)


def test_split_k_mixed_batch():
    """The split kernel is general: forced on a mixed batch it must still match."""
    case = build_attention_case(
        *MIXED_BATCH, num_kv_heads=2, group=3, head_dim=128, block_size=16, dtype=torch.float16
    )
    _check(case, torch.float16, num_splits=3)


def test_heuristic_picks_split_k_for_long_decode(monkeypatch):
    """Few sequences decoding a long context take the split path by default, and still match."""
    calls = []
    real = ta._merge_splits_kernel

    class Spy:
        def __getitem__(self, grid):
            calls.append(grid)
            return real[grid]

    monkeypatch.setattr(ta, "_merge_splits_kernel", Spy())
    case = build_attention_case(
        [1], [700], num_kv_heads=1, group=8, head_dim=64, block_size=16, dtype=torch.float32
    )
    assert ta.choose_num_splits(1, 1, 1, 700, ta._num_sms(case.query.device)) > 1
    _check(case, torch.float32)
    assert calls, "the split-K merge kernel did not run"


def test_choose_num_splits():
    f = ta.choose_num_splits
    assert f(num_seqs=4, num_kv_heads=8, max_query_len=7, max_seq_len=32768, num_sms=132) == 1  # prefill
    assert f(num_seqs=256, num_kv_heads=8, max_query_len=1, max_seq_len=32768, num_sms=132) == 1  # GPU full
    assert f(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=200, num_sms=132) == 1  # short
    n = f(num_seqs=1, num_kv_heads=8, max_query_len=1, max_seq_len=32768, num_sms=132)
    assert 1 < n <= ta.MAX_SPLITS
    assert (
        f(num_seqs=2, num_kv_heads=8, max_query_len=1, max_seq_len=1024, num_sms=132)
        == 1024 // ta.MIN_TOKENS_PER_SPLIT
    )


def test_empty_batch():
    case = build_attention_case(
        [1], [1], num_kv_heads=1, group=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    out = ta.paged_attention(case.query[:0], case.k_cache, case.v_cache, case.meta, case.scale)
    assert out.shape == (0, 1, 64)


def test_query_with_strided_head_dim():
    """A query whose head dimension is not contiguous is copied, not misread."""
    case = build_attention_case(
        *MIXED_BATCH, num_kv_heads=2, group=2, head_dim=64, block_size=16, dtype=torch.float32
    )
    strided = case.query.transpose(1, 2).contiguous().transpose(1, 2)  # same values, stride(-1) == H
    assert strided.stride(-1) != 1
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    actual = ta.paged_attention(strided, case.k_cache, case.v_cache, case.meta, case.scale)
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[torch.float32])


def test_cache_layout_mismatch_is_refused():
    case = build_attention_case(
        [1], [5], num_kv_heads=2, group=1, head_dim=64, block_size=16, dtype=torch.float32
    )
    v_other = case.v_cache.transpose(1, 2).contiguous().transpose(1, 2)  # [N, B, Hkv, D] with other strides
    with pytest.raises(ValueError, match="layout"):
        ta.paged_attention(case.query, case.k_cache, v_other, case.meta, case.scale)
