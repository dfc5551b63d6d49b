"""The CPU suite's comparisons, natively on CUDA, over wider sweeps (see tests/support/kernel_cases.py
for the tolerances)."""

from __future__ import annotations

import random

import pytest
import torch

from kvpilot.kernels import reference
from support.kernel_cases import (
    ATTENTION_TOL,
    DTYPES,
    ELEMENTWISE_TOL,
    LORA_TOL,
    MIXED_BATCH,
    build_attention_case,
    lora_case,
    random_attention_case,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(scope="module")
def ops():
    from kvpilot.kernels import triton_ops

    return triton_ops.TRITON_OPS


def _gqa_case(q_lens, seq_lens, dtype, num_kv_heads=8):
    """Groups of 4 query heads per KV head (8 KV heads: Llama-3-8B's shape), head_dim 128, block size 16."""
    return build_attention_case(
        q_lens,
        seq_lens,
        num_kv_heads=num_kv_heads,
        group=4,
        head_dim=128,
        block_size=16,
        dtype=dtype,
        device=DEV,
    )


def _attn(ops, case, dtype, num_splits=None):
    expected = reference.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    if num_splits is None:
        actual = ops.paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale)
    else:
        from kvpilot.kernels.triton_attention import paged_attention

        actual = paged_attention(case.query, case.k_cache, case.v_cache, case.meta, case.scale, num_splits)
    torch.testing.assert_close(actual, expected, **ATTENTION_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(8, 1), (4, 2), (2, 3), (2, 4), (1, 8), (4, 8)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
@pytest.mark.parametrize("block_size", [8, 16, 32, 64])
def test_mixed_batch(ops, dtype, heads, head_dim, block_size):
    kv, group = heads
    case = build_attention_case(
        *MIXED_BATCH,
        num_kv_heads=kv,
        group=group,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEV,
    )
    _attn(ops, case, dtype)


@pytest.mark.parametrize("seed", range(40))
def test_random_batches(ops, seed):
    case, dtype = random_attention_case(
        seed,
        heads=[(8, 1), (2, 3), (4, 4), (1, 8)],
        max_seqs=24,
        max_len=1500,
        block_sizes=[16, 32],
        device=DEV,
    )
    _attn(ops, case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_seqs,ctx", [(1, 32768), (4, 8191), (256, 512), (64, 2048)])
def test_decode_sweep(ops, dtype, num_seqs, ctx):
    """Decode batches 1-256 over contexts up to 32k, on the heuristic's choice of split-K."""
    rng = random.Random(num_seqs)
    seq_lens = [max(1, ctx - rng.randint(0, 100)) for _ in range(num_seqs)]
    case = _gqa_case([1] * num_seqs, seq_lens, dtype)
    _attn(ops, case, dtype)


@pytest.mark.parametrize("num_splits", [1, 2, 7, 32])
def test_forced_splits(num_splits):
    case = _gqa_case([1, 1, 1, 9], [1, 300, 4097, 50], torch.bfloat16, num_kv_heads=2)
    _attn(None, case, torch.bfloat16, num_splits=num_splits)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_long_prefill(ops, dtype):
    case = _gqa_case([2048, 1, 300], [4096, 1000, 300], dtype)
    _attn(ops, case, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,head_dim", [((8, 1), 64), ((32, 8), 128), ((28, 4), 128), ((16, 16), 256)])
def test_write_kv_and_rotary(ops, dtype, heads, head_dim):
    num_heads, num_kv = heads
    t = 777
    g = torch.Generator(device=DEV).manual_seed(0)
    q = torch.randn(t, num_heads, head_dim, device=DEV, generator=g).to(dtype)
    k = torch.randn(t, num_kv, head_dim, device=DEV, generator=g).to(dtype)
    pos = torch.randint(0, 4096, (t,), device=DEV, generator=g)
    inv = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, device=DEV).float() / head_dim))
    ang = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cache = torch.cat([ang.cos(), ang.sin()], -1)
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary(q_ref, k_ref, pos, cache)
    ops.rotary(q, k, pos, cache)
    torch.testing.assert_close(q, q_ref, **ELEMENTWISE_TOL[dtype])
    torch.testing.assert_close(k, k_ref, **ELEMENTWISE_TOL[dtype])

    n_blocks = 64
    slots = torch.randperm(n_blocks * 16, device=DEV, generator=g)[:t]
    kc = torch.zeros(n_blocks, 16, num_kv, head_dim, device=DEV, dtype=dtype)
    kr, vr, ko, vo = kc.clone(), kc.clone(), kc.clone(), kc.clone()
    reference.write_kv(k, q[:, :num_kv], kr, vr, slots)
    ops.write_kv(k, q[:, :num_kv], ko, vo, slots)
    assert torch.equal(ko, kr) and torch.equal(vo, vr)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (4096, 4096), (33, 8192), (7, 5120)])
def test_rms_norm(ops, dtype, rows, hidden):
    g = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(rows, hidden, device=DEV, generator=g).to(dtype)
    r = torch.randn(rows, hidden, device=DEV, generator=g).to(dtype)
    w = torch.randn(hidden, device=DEV, generator=g).to(dtype)
    for residual in (None, r):
        out_ref, h_ref = reference.rms_norm(x, w, 1e-6, residual)
        out, h = ops.rms_norm(x, w, 1e-6, residual)
        torch.testing.assert_close(out, out_ref, **ELEMENTWISE_TOL[dtype])
        torch.testing.assert_close(h, h_ref, **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 1536), (1000, 2 * 14336), (3, 5, 2 * 100)], ids=str)
def test_silu_and_mul(ops, dtype, shape):
    x = (torch.randn(shape, device=DEV) * 4).to(dtype)
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), **ELEMENTWISE_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ["all", "some", "shuffled"])
@pytest.mark.parametrize(
    ("tokens", "k", "n", "rank"), [(1, 4096, 6144, 16), (300, 4096, 28672, 64), (2048, 896, 1152, 8)]
)
def test_lora_add(ops, dtype, rows, tokens, k, n, rank):
    """Llama-3-8B's fused qkv and gate_up widths, decode to a long prefill, rank 8 to 64."""
    y, x, a, b, picked = lora_case(tokens, k, n, rank, rows, dtype, device=DEV)
    expected = y.clone()
    reference.lora_add(expected, x, a, b, picked)
    ops.lora_add(y, x, a, b, picked)
    torch.testing.assert_close(y, expected, **LORA_TOL[dtype])


def test_dispatch_on_cuda(monkeypatch):
    from kvpilot.kernels import select_ops

    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    assert select_ops("cuda").name == "triton"
    monkeypatch.setenv("KVPILOT_KERNELS", "torch")
    assert select_ops("cuda").name == "torch"
