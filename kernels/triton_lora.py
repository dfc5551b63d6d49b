"""One LoRA adapter's low-rank product added to a projection's output, for the rows that run under it, in
triton: y[rows] += (x[rows] @ a.T) @ b.T, the gather and the scatter fused into the two matmuls.

Two kernels, as vLLM's punica kernels split it: `shrink` (x's rows times a.T, rank r, rounded to x's dtype
as the torch reference rounds it) and `expand` (that times b.T, rounded, added to y's rows in fp32 and
rounded once more). Splitting keeps the shrink from being recomputed for every column block of y. The rows
an adapter owns are distinct (a step's rows run under one adapter each), so the expand needs no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Shared with the attention kernel: fp32 dots stay fp32-accurate (3xTF32 on CUDA, IEEE in the interpreter),
# and the interpreter's bf16 tl.dot is wrong, so bf16 is upcast there.
from kvpilot.kernels import reference
from kvpilot.kernels.triton_attention import _fp32_dot_precision, _interpreting

BLOCK_M = 32  # rows per program; >= 16 keeps tl.dot legal on GPUs
BLOCK_K = 64  # of the input features per shrink iteration
BLOCK_N = 64  # output features per expand program
# The rank is one tile (a fused qkv adapter's is 3r): past this its tiles would not fit a program's registers
# and shared memory, and the torch reference runs it instead (a rank loop in the kernels would lift this).
MAX_BLOCK_R = 256


@triton.jit
def _rows(rows_ptr, offs_m, m_ok, HAS_ROWS: tl.constexpr):
    if HAS_ROWS:
        return tl.load(rows_ptr + offs_m, mask=m_ok, other=0).to(tl.int64)
    return offs_m.to(tl.int64)


@triton.jit
def _shrink_kernel(
    x_ptr,
    rows_ptr,
    a_ptr,
    t_ptr,
    M,
    K,
    R,
    stride_x,
    stride_a,
    stride_t,
    HAS_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = _rows(rows_ptr, offs_m, m_ok, HAS_ROWS)
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        xs = tl.load(
            x_ptr + rows[:, None] * stride_x + offs_k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0
        )
        a_t = tl.load(  # [BLOCK_K, BLOCK_R]: a transposed
            a_ptr + offs_r[None, :] * stride_a + offs_k[:, None],
            mask=r_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            xs, a_t = xs.to(tl.float32), a_t.to(tl.float32)
        acc += tl.dot(xs, a_t, input_precision=DOT_PRECISION)
    tl.store(
        t_ptr + offs_m[:, None] * stride_t + offs_r[None, :],
        acc.to(t_ptr.dtype.element_ty),
        mask=m_ok[:, None] & r_ok[None, :],
    )


@triton.jit
def _expand_kernel(
    t_ptr,
    rows_ptr,
    b_ptr,
    y_ptr,
    M,
    N,
    R,
    stride_t,
    stride_b,
    stride_y,
    HAS_ROWS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    rows = _rows(rows_ptr, offs_m, m_ok, HAS_ROWS)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_r = tl.arange(0, BLOCK_R)
    r_ok = offs_r < R
    t = tl.load(
        t_ptr + offs_m[:, None] * stride_t + offs_r[None, :], mask=m_ok[:, None] & r_ok[None, :], other=0.0
    )
    b_t = tl.load(  # [BLOCK_R, BLOCK_N]: b transposed
        b_ptr + offs_n[None, :] * stride_b + offs_r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0
    )
    if UPCAST:
        t, b_t = t.to(tl.float32), b_t.to(tl.float32)
    delta = tl.dot(t, b_t, input_precision=DOT_PRECISION).to(y_ptr.dtype.element_ty)  # rounded, as torch's
    ok = m_ok[:, None] & n_ok[None, :]
    at = y_ptr + rows[:, None] * stride_y + offs_n[None, :]
    y = tl.load(at, mask=ok, other=0.0)
    tl.store(at, (y.to(tl.float32) + delta.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=ok)


def lora_add(
    y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, rows: torch.Tensor | None
) -> None:
    """Same contract as `kvpilot.kernels.reference.lora_add`."""
    m = x.shape[0] if rows is None else rows.numel()
    rank, k, n = a.shape[0], x.shape[1], y.shape[1]
    if m == 0:
        return
    if triton.next_power_of_2(rank) > MAX_BLOCK_R:
        reference.lora_add(y, x, a, b, rows)
        return
    if x.stride(-1) != 1:
        x = x.contiguous()
    a, b = a.contiguous(), b.contiguous()
    assert y.stride(-1) == 1, "y is written in place: its rows must be contiguous"
    t = torch.empty((m, rank), dtype=x.dtype, device=x.device)
    upcast = _interpreting() and x.dtype == torch.bfloat16
    precision = _fp32_dot_precision(x.device) if x.dtype == torch.float32 or upcast else None
    block_r = max(16, triton.next_power_of_2(rank))
    common = dict(
        HAS_ROWS=rows is not None, UPCAST=upcast, DOT_PRECISION=precision, BLOCK_M=BLOCK_M, BLOCK_R=block_r
    )
    rows_arg = rows if rows is not None else t  # an unused pointer when every row runs
    _shrink_kernel[(triton.cdiv(m, BLOCK_M),)](
        x, rows_arg, a, t, m, k, rank, x.stride(0), a.stride(0), t.stride(0), BLOCK_K=BLOCK_K, **common
    )
    _expand_kernel[(triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))](
        t, rows_arg, b, y, m, n, rank, t.stride(0), b.stride(0), y.stride(0), BLOCK_N=BLOCK_N, **common
    )
