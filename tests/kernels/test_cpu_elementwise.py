"""The C row-wise ops of the CPU op set (kernels/cpu_elementwise.py) against the torch reference: the RMS
norm with and without its residual, the rotary embedding in place on strided views of a fused projection,
SiLU and multiply; what they do not take goes to the reference; a position outside the rotary table is
refused before anything is written. The engine's tokens through them: tests/engine/test_cpu_ops.py."""

from __future__ import annotations

import pytest
import torch

from kvpilot.daemon.engine.models.llama import rope_cache
from kvpilot.kernels import cpu_elementwise, reference

pytestmark = pytest.mark.skipif(not cpu_elementwise.available(), reason="no AVX2/FMA or no C compiler here")

TOL = {"rtol": 1e-5, "atol": 1e-5}


@pytest.mark.parametrize("width", [576, 64, 13])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_the_references(width: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(width)
    x, r = torch.randn(7, width, generator=gen) * 3, torch.randn(7, width, generator=gen)
    w = torch.randn(width, generator=gen)
    residual = r if with_residual else None
    out, h = cpu_elementwise.rms_norm(x, w, 1e-5, residual)
    want_out, want_h = reference.rms_norm(x, w, 1e-5, residual)
    torch.testing.assert_close(h, want_h, rtol=0, atol=0)  # one add: exact
    torch.testing.assert_close(out, want_out, **TOL)


def test_rotary_in_place_on_a_fused_projection_is_the_references() -> None:
    gen = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(5, (heads + 2 * kv_heads) * dim, generator=gen)
    want = qkv.clone()
    table = rope_cache(dim, 4096, 100000.0)
    positions = torch.tensor([0, 1, 17, 4000, 4095])

    def views(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = t[:, : heads * dim].view(5, heads, dim)
        return q, t[:, heads * dim : (heads + kv_heads) * dim].view(5, kv_heads, dim)

    cpu_elementwise.rotary(*views(qkv), positions, table)
    reference.rotary(*views(want), positions, table)
    torch.testing.assert_close(qkv, want, **TOL)
    # the values (v) after q and k are untouched
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], want[:, (heads + kv_heads) * dim :])


def test_a_position_outside_the_rotary_table_is_refused_before_anything_is_written() -> None:
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    before = q.clone(), k.clone()
    with pytest.raises(ValueError, match="outside the table"):
        cpu_elementwise.rotary(q, k, torch.tensor([3, 16]), rope_cache(8, 16, 10000.0))
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


def test_silu_and_mul_is_the_references() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(6, 2 * 1536, generator=gen) * 6  # large magnitudes both ways: exp(-x) far from 1
    torch.testing.assert_close(cpu_elementwise.silu_and_mul(x), reference.silu_and_mul(x), **TOL)


def test_what_they_do_not_take_goes_to_the_reference() -> None:
    """bfloat16 and non-contiguous rows: the reference's own results."""
    x = torch.randn(4, 64).bfloat16()
    w = torch.randn(64).bfloat16()
    assert torch.equal(cpu_elementwise.rms_norm(x, w, 1e-5)[0], reference.rms_norm(x, w, 1e-5)[0])
    strided = torch.randn(4, 256)[:, ::2]
    assert torch.equal(cpu_elementwise.silu_and_mul(strided), reference.silu_and_mul(strided))
