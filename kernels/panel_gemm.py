"""A float32 matrix product for decode-sized row counts on x86-64 CPUs with AVX2 and FMA: `x @ weight.T`
with the weight laid out once in panels of 16 output features, by a kernel of ~40 lines of C compiled here
with the system's C compiler at first use (as inductor compiles its CPU kernels), then loaded by ctypes.

Why it exists: a decode step multiplies a few rows by every weight of the model, once each, so it is bound
by how fast the weights stream from memory and how well the multiply-adds keep up. MKL's sgemm (F.linear)
reaches 7 GB/s of the core's 20 at 8 rows, oneDNN with a packed weight 9 (kernels/onednn_linear.py):
neither keeps the core's FMA units busy while the weights stream in. Here each panel of 16 output
features is read once from memory, sequentially, and held in registers' reach while up to 6 rows at a time
multiply it: 12 accumulators, 2 weight vectors and a broadcast input in the 16 AVX2 registers, 12 FMAs for
2 weight loads and 6 broadcasts. On an AMD EPYC (Zen 3, 1 thread) the embedded model's layer weights,
streamed from memory (30 layers' worth, more than the caches), took 33.0 ms at 8 rows against oneDNN's 49.4
and MKL's 60.1 (bench/decode_matmul.py; docs/performance.md, "A decode matmul at the memory's pace"):
1.7-1.95x MKL's speed at 2-16 rows, even at 1, 1.07x at 256.

The panel layout: for each 16 output features, their weights for input 0, then input 1, and so on
(`[panels, in, 16]`), the last panel zero-padded; a pure permutation of the weight's values. Each output is
its inputs' products summed in input order in float32, so results differ from sgemm's blocked sums by
rounding only.

It runs on one thread (kernels/packed_linear.py chooses it where torch does too), and its layout replaces
the weight there: `unpack` reads it back, `pack_into` writes new values in place, `rows` looks up a tied
embedding's rows. It is built and loaded by kernels/native.py; where that cannot be (no x86-64 with AVX2
and FMA, no C compiler), `available()` says no and the weights stay (oneDNN's copies with `--packed-linears`).
"""

from __future__ import annotations

import ctypes
import functools

import torch
import torch.nn.functional as F

from kvpilot.kernels import native

PANEL = 16  # output features a panel holds: two AVX2 vectors

SOURCE = r"""
#include <immintrin.h>
#include <stddef.h>

/* Rows r of x (MR at most 6) times one panel: a[r][0..1] hold y[r][16 features]. */
#define DECL(r) __m256 a##r##0 = _mm256_setzero_ps(), a##r##1 = _mm256_setzero_ps();
#define STEP(r) if ((r) < MR) { __m256 b = _mm256_broadcast_ss(x + (r) * ldx + k); \
    a##r##0 = _mm256_fmadd_ps(b, w0, a##r##0); a##r##1 = _mm256_fmadd_ps(b, w1, a##r##1); }
#define STORE(r) if ((r) < MR) { \
    if (nc == 16) { _mm256_storeu_ps(y + (r) * ldy, a##r##0); _mm256_storeu_ps(y + (r) * ldy + 8, a##r##1); } \
    else { float t[16]; _mm256_storeu_ps(t, a##r##0); _mm256_storeu_ps(t + 8, a##r##1); \
           for (int j = 0; j < nc; j++) y[(r) * ldy + j] = t[j]; } }

/* One function per row count, so that the accumulators of the rows it has stay in registers. */
#define BLOCK(ROWS) \
static void block##ROWS(const float *x, size_t ldx, const float *w, size_t in, float *y, size_t ldy, int nc) { \
    enum { MR = ROWS }; \
    DECL(0) DECL(1) DECL(2) DECL(3) DECL(4) DECL(5) \
    for (size_t k = 0; k < in; k++, w += 16) { \
        _mm_prefetch((const char *)(w + 384), _MM_HINT_T0); \
        __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8); \
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5) \
    } \
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5) \
}
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)

typedef void (*block_fn)(const float *, size_t, const float *, size_t, float *, size_t, int);
static const block_fn BLOCKS[7] = {0, block1, block2, block3, block4, block5, block6};

/* y[m][out] = x[m][in] times the panels of an [out, in] weight. Each panel is read from memory once; its
   rows go in blocks as even as 6 allows (8 rows: 4 and 4), the later blocks reading it from the cache. */
void panel_gemm(const float *x, const float *panels, float *y, long m, long out, long in) {
    long blocks = (m + 5) / 6;
    for (long p = 0; p * 16 < out; p++) {
        const float *panel = panels + (size_t)p * 16 * in;
        int nc = (int)(out - p * 16 < 16 ? out - p * 16 : 16);
        long r = 0;
        for (long b = 0; b < blocks; b++) {
            long rows = (m - r + (blocks - b) - 1) / (blocks - b);
            BLOCKS[rows](x + r * in, in, panel, in, y + r * out + p * 16, out, nc);
            r += rows;
        }
    }
}
"""


def available() -> bool:
    """Whether the kernel runs here: x86-64 with AVX2 and FMA, and its library built (or buildable)."""
    return _library() is not None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """`weight` ([out, in], float32) laid out as panels: [panels, in, 16], the last one zero-padded."""
    out, width = weight.shape
    padded = F.pad(weight.detach(), (0, 0, 0, -out % PANEL))
    return padded.view(-1, PANEL, width).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor, out_features: int) -> torch.Tensor:
    """The weight `pack` laid out, [out_features, in] again (a new tensor: exact, the layout is a
    permutation)."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])[:out_features]


def pack_into(panels: torch.Tensor, weight: torch.Tensor) -> None:
    """`panels = pack(weight)` in place: new values for a weight of the same shape, no second copy."""
    out, width = weight.shape
    if width != panels.shape[1] or not (panels.shape[0] - 1) * PANEL < out <= panels.shape[0] * PANEL:
        raise ValueError(
            f"pack_into: a weight {tuple(weight.shape)} is not the shape of panels {tuple(panels.shape)}"
        )
    padded = F.pad(weight.detach(), (0, 0, 0, -out % PANEL)) if out % PANEL else weight.detach()
    panels.transpose(1, 2).copy_(padded.reshape(-1, PANEL, width))


def rows(panels: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Rows `index` of the weight `pack` laid out, [len(index), in]: an embedding table's lookup, where the
    panels hold a tied embedding (its LM head)."""
    return panels[index // PANEL, :, index % PANEL]


def multiply(
    x: torch.Tensor, panels: torch.Tensor, out_features: int, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for x [rows, in] float32 and `panels = pack(weight)` of a weight of
    `out_features` rows; needs `available()`."""
    lib = _library()
    if lib is None:
        raise RuntimeError("panel_gemm.multiply: the kernel does not run here (available() is False)")
    # The C code trusts all of these: a wrong size, dtype, layout or device would read or write past a buffer.
    fits = (
        x.dim() == 2
        and panels.dim() == 3
        and panels.shape[2] == PANEL
        and x.shape[1] == panels.shape[1]
        and x.dtype == panels.dtype == torch.float32
        and x.device.type == panels.device.type == "cpu"
        and panels.is_contiguous()
        and 0 < out_features <= panels.shape[0] * PANEL
        and (bias is None or tuple(bias.shape) == (out_features,))
    )
    if not fits:
        raise ValueError(
            f"panel_gemm: x {tuple(x.shape)} {x.dtype} {x.device} does not fit panels {tuple(panels.shape)} "
            f"{panels.dtype} of {out_features} outputs"
        )
    rows, width = x.shape
    x = x.contiguous()
    y = torch.empty(rows, out_features, dtype=torch.float32)
    lib.panel_gemm(x.data_ptr(), panels.data_ptr(), y.data_ptr(), rows, out_features, width)
    return y if bias is None else y.add_(bias)


@functools.cache  # once: every linear layer calls it
def _library() -> ctypes.CDLL | None:
    long, pointer = ctypes.c_long, ctypes.c_void_p
    return native.library("panel_gemm", SOURCE, panel_gemm=((pointer,) * 3 + (long,) * 3, None))
