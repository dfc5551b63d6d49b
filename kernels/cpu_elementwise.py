"""The row-wise ops of a CPU step in C, each one call where the torch reference is several: the RMS norm
with its residual add, the rotary embedding in place, SiLU and multiply (built and loaded by
kernels/native.py).

Why: a decode step of the embedded model calls them 4 times a layer, ~40 small torch ops in all (the norm
alone is an add, a power, a mean, a reciprocal square root and two multiplies), which took ~4 of a batch-8
step's 60 ms, nearly all of it per-op overhead on rows of 576 numbers. Here each op is one pass over its
rows. Float32, contiguous rows (the rotary's query and key may be strided views of the fused projection,
as the model passes them); anything else, and positions past the rotary table, go to the reference.
Results differ from the reference's by rounding only (the compiler fuses multiply-adds):
tests/kernels/test_cpu_elementwise.py.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.kernels import native, reference

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

/* h = x + r (r may be NULL: h = x), out = h / sqrt(mean(h^2) + eps) * w, row by row. */
void rms_norm(const float *x, const float *r, const float *w, float *out, float *h, long rows, long n,
              float eps) {
    for (long i = 0; i < rows; i++) {
        const float *xi = x + i * n, *ri = r ? r + i * n : NULL;
        float *hi = h + i * n, *oi = out + i * n;
        __m256 acc = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= n; k += 8) {
            __m256 v = _mm256_loadu_ps(xi + k);
            if (ri) v = _mm256_add_ps(v, _mm256_loadu_ps(ri + k));
            _mm256_storeu_ps(hi + k, v);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float t[8], ss = 0.0f;
        _mm256_storeu_ps(t, acc);
        for (int j = 0; j < 8; j++) ss += t[j];
        for (; k < n; k++) { float v = xi[k] + (ri ? ri[k] : 0.0f); hi[k] = v; ss += v * v; }
        float scale = 1.0f / sqrtf(ss / (float)n + eps);
        for (k = 0; k < n; k++) oi[k] = hi[k] * scale * w[k];
    }
}

/* In place, rows of heads x dim (head stride dim, rows t_stride apart): each head's halves a, b become
   a cos - b sin, b cos + a sin, with cos and sin of the token's position (table rows of dim: cos then
   sin of the dim/2 frequencies). -1 for a position outside the table, before anything is written. */
int rotary(float *x, long t_stride, long tokens, long heads, long dim, const long *pos, const float *table,
           long positions) {
    long half = dim / 2;
    for (long t = 0; t < tokens; t++)
        if (pos[t] < 0 || pos[t] >= positions) return -1;
    for (long t = 0; t < tokens; t++) {
        const float *c = table + pos[t] * dim, *s = c + half;
        for (long h = 0; h < heads; h++) {
            float *a = x + t * t_stride + h * dim, *b = a + half;
            for (long i = 0; i < half; i++) {
                float ai = a[i], bi = b[i];
                a[i] = ai * c[i] - bi * s[i];
                b[i] = bi * c[i] + ai * s[i];
            }
        }
    }
    return 0;
}

/* out[i][k] = silu(x[i][k]) * x[i][n + k], rows of 2n. */
void silu_and_mul(const float *x, float *out, long rows, long n) {
    for (long i = 0; i < rows; i++) {
        const float *g = x + i * 2 * n, *u = g + n;
        float *o = out + i * n;
        for (long k = 0; k < n; k++) o[k] = g[k] / (1.0f + expf(-g[k])) * u[k];
    }
}
"""


def available() -> bool:
    return _library() is not None


def _rows_of(t: torch.Tensor) -> bool:
    """A float32 CPU tensor whose last dimension's rows are contiguous, one after another."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.rms_norm`, one pass a row where the kernel runs."""
    lib = _library()
    n = x.shape[-1]
    if (
        lib is None
        or not _rows_of(x)
        or not _rows_of(weight)
        or tuple(weight.shape) != (n,)
        or (residual is not None and (not _rows_of(residual) or residual.shape != x.shape))
    ):
        return reference.rms_norm(x, weight, eps, residual)
    out, h = torch.empty_like(x), torch.empty_like(x)
    rows = x.numel() // n if n else 0
    lib.rms_norm(
        x.data_ptr(), residual.data_ptr() if residual is not None else None, weight.data_ptr(),
        out.data_ptr(), h.data_ptr(), rows, n, eps,
    )  # fmt: skip
    return out, h


def rotary(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """`reference.rotary`, in place, where the kernel runs."""
    lib = _library()
    fits = (
        lib is not None
        and positions.dtype == torch.int64
        and positions.is_contiguous()
        and positions.dim() == 1
        and positions.device.type == "cpu"
        and _rows_of(cos_sin_cache)
        and cos_sin_cache.dim() == 2
        and all(
            t.dtype == torch.float32
            and t.device.type == "cpu"
            and t.dim() == 3
            and t.shape[0] == positions.shape[0]
            and t.shape[2] == cos_sin_cache.shape[1]
            and t.shape[2] % 2 == 0
            and t.stride(2) == 1
            and t.stride(1) == t.shape[2]
            and t.stride(0) >= t.shape[1] * t.shape[2]  # rows that do not overlap
            for t in (query, key)
        )
    )
    if not fits:
        reference.rotary(query, key, positions, cos_sin_cache)
        return
    assert lib is not None
    for t in (query, key):
        tokens, heads, dim = t.shape
        if lib.rotary(
            t.data_ptr(), t.stride(0), tokens, heads, dim, positions.data_ptr(), cos_sin_cache.data_ptr(),
            cos_sin_cache.shape[0],
        ):  # fmt: skip
            raise ValueError(f"rotary: a position outside the table's {cos_sin_cache.shape[0]}")


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """`reference.silu_and_mul`, one pass where the kernel runs."""
    lib = _library()
    if lib is None or not _rows_of(x) or x.shape[-1] % 2:
        return reference.silu_and_mul(x)
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=torch.float32)
    lib.silu_and_mul(x.data_ptr(), out.data_ptr(), x.numel() // (2 * n) if n else 0, n)
    return out


@functools.cache  # once: an op calls it every layer
def _library() -> ctypes.CDLL | None:
    pointer, size = ctypes.c_void_p, ctypes.c_long
    return native.library(
        "cpu_elementwise",
        SOURCE,
        rms_norm=((*[pointer] * 5, size, size, ctypes.c_float), None),
        rotary=((pointer, size, size, size, size, pointer, pointer, size), ctypes.c_int),
        silu_and_mul=((pointer, pointer, size, size), None),
    )
