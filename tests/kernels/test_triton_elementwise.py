"""KV write, RMSNorm (fused residual), rotary (in place, neox) and SiLU-and-mul in triton (interpreter)
against the torch reference."""

from __future__ import annotations

import pytest
import torch

from kvpilot.kernels import (
    reference,
    triton_activation,
    triton_kv_write,
    triton_lora,
    triton_norm,
    triton_rotary,
)
from kvpilot.kernels.ops import select_ops
from support.kernel_cases import DTYPES, ELEMENTWISE_TOL, LORA_TOL, build_attention_case, lora_case


def _rand(*shape, dtype, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---- write_kv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads_dim", [(1, 64), (2, 128), (3, 80)], ids=str)
def test_write_kv(dtype, heads_dim):
    """Scatter into shuffled blocks, lengths off the block grid; untouched slots must stay as they were."""
    num_kv_heads, head_dim = heads_dim
    case = build_attention_case(
        [1, 5, 19, 1],
        [1, 21, 19, 33],
        num_kv_heads=num_kv_heads,
        group=1,
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
    )
    t = case.slot_mapping.numel()
    key = _rand(t, num_kv_heads, head_dim, dtype=dtype, seed=1)
    value = _rand(t, num_kv_heads, head_dim, dtype=dtype, seed=2)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, case.slot_mapping)
    k_out, v_out = case.k_cache.clone(), case.v_cache.clone()
    triton_kv_write.write_kv(key, value, k_out, v_out, case.slot_mapping)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)
    assert not torch.equal(k_out, case.k_cache)


def test_write_kv_strided_source_and_cast():
    """K/V sliced out of a fused qkv row (non-contiguous), written into an fp16 cache from fp32."""
    t, heads, d = 3, 2, 64
    qkv = _rand(t, 3 * heads * d, dtype=torch.float32)
    key = qkv[:, heads * d : 2 * heads * d].view(t, heads, d)
    value = qkv[:, 2 * heads * d :].view(t, heads, d)
    assert not key.is_contiguous()
    cache = torch.zeros(4, 16, heads, d, dtype=torch.float16)
    slots = torch.tensor([17, 3, 63])
    k_ref, v_ref, k_out, v_out = cache.clone(), cache.clone(), cache.clone(), cache.clone()
    reference.write_kv(key, value, k_ref, v_ref, slots)
    triton_kv_write.write_kv(key, value, k_out, v_out, slots)
    assert torch.equal(k_out, k_ref) and torch.equal(v_out, v_ref)


# ---- rms_norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (7, 96), (3, 576)])
@pytest.mark.parametrize("with_residual", [True, False])
def test_rms_norm(dtype, rows, hidden, with_residual):
    x = _rand(rows, hidden, dtype=dtype, seed=1) * 3
    weight = _rand(hidden, dtype=dtype, seed=2)
    residual = _rand(rows, hidden, dtype=dtype, seed=3) if with_residual else None
    out_ref, h_ref = reference.rms_norm(x, weight, 1e-5, residual)
    out, h = triton_norm.rms_norm(x, weight, 1e-5, residual)
    assert out.dtype == out_ref.dtype and h.dtype == h_ref.dtype
    torch.testing.assert_close(out, out_ref, **ELEMENTWISE_TOL[dtype])
    torch.testing.assert_close(h, h_ref, **ELEMENTWISE_TOL[dtype])
    if with_residual:  # inputs are not modified
        assert torch.equal(residual, _rand(rows, hidden, dtype=dtype, seed=3))


def test_rms_norm_non_contiguous_rows():
    base = _rand(6, 128, dtype=torch.float32)
    x = base[::2]  # row stride 256
    weight = _rand(128, dtype=torch.float32, seed=5)
    out_ref, _ = reference.rms_norm(x, weight, 1e-6)
    out, _ = triton_norm.rms_norm(x, weight, 1e-6)
    torch.testing.assert_close(out, out_ref, **ELEMENTWISE_TOL[torch.float32])


# ---- rotary ------------------------------------------------------------------------------------


def _rope_cache(head_dim, max_pos=300, theta=10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(max_pos).float(), inv)
    return torch.cat([ang.cos(), ang.sin()], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads", [(2, 2), (6, 2), (8, 1)], ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary(dtype, heads, head_dim):
    num_heads, num_kv_heads = heads
    t = 5
    q = _rand(t, num_heads, head_dim, dtype=dtype, seed=1)
    k = _rand(t, num_kv_heads, head_dim, dtype=dtype, seed=2)
    positions = torch.tensor([0, 1, 17, 255, 299])
    cache = _rope_cache(head_dim)
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary(q_ref, k_ref, positions, cache)
    triton_rotary.rotary(q, k, positions, cache)
    torch.testing.assert_close(q, q_ref, **ELEMENTWISE_TOL[dtype])
    torch.testing.assert_close(k, k_ref, **ELEMENTWISE_TOL[dtype])
    assert not torch.equal(q, _rand(t, num_heads, head_dim, dtype=dtype, seed=1))  # it did rotate


def test_rotary_one_token_position_zero_is_identity():
    q = _rand(1, 4, 64, dtype=torch.float32)
    k = _rand(1, 2, 64, dtype=torch.float32, seed=1)
    q0, k0 = q.clone(), k.clone()
    triton_rotary.rotary(q, k, torch.tensor([0]), _rope_cache(64))
    assert torch.equal(q, q0) and torch.equal(k, k0)


# ---- silu_and_mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (5, 2 * 96), (2, 3, 2 * 1500)], ids=str)
def test_silu_and_mul(dtype, shape):
    x = _rand(*shape, dtype=dtype) * 4
    expected = reference.silu_and_mul(x)
    actual = triton_activation.silu_and_mul(x)
    assert actual.shape == expected.shape and actual.dtype == dtype
    torch.testing.assert_close(actual, expected, **ELEMENTWISE_TOL[dtype])


# ---- dispatch ----------------------------------------------------------------------------------


def test_select_ops_triton(monkeypatch):
    monkeypatch.delenv("KVPILOT_KERNELS", raising=False)
    assert select_ops("cpu").name in ("torch", "cpu")  # which of the two: tests/kernels/test_cpu_attention.py
    ops = select_ops("cpu", "triton")
    assert ops.name == "triton"
    assert ops.paged_attention.__module__ == "kvpilot.kernels.triton_attention"
    monkeypatch.setenv("KVPILOT_KERNELS", "triton")
    assert select_ops("cpu").name == "triton"


# ---- lora_add -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", ["all", "some", "shuffled", "none"])
@pytest.mark.parametrize(
    ("tokens", "k", "n", "rank"),
    [(7, 64, 96, 8), (40, 200, 130, 16), (33, 576, 1728, 64), (5, 64, 64, 300)],  # 300: the reference runs
)
def test_lora_add(dtype, rows, tokens, k, n, rank):
    """One adapter's product added at its rows (off every block grid: 7 or 33 rows, 200 or 130 features);
    the rows it does not own must stay as they were."""
    y, x, a, b, picked = lora_case(tokens, k, n, rank, rows, dtype)
    expected = y.clone()
    reference.lora_add(expected, x, a, b, picked)
    actual = y.clone()
    triton_lora.lora_add(actual, x, a, b, picked)
    torch.testing.assert_close(actual, expected, **LORA_TOL[dtype])
    if picked is not None:
        untouched = torch.ones(tokens, dtype=torch.bool)
        untouched[picked] = False
        assert torch.equal(actual[untouched], y[untouched])
