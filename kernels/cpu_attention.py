"""Paged attention for decode-sized steps on x86-64 CPUs with AVX2 and FMA: each query row over its
sequence's keys, read in place through the block table, by a kernel of the project's own in C
(built and loaded by kernels/native.py).

Why it exists: at decode, the torch reference (kernels/reference.py) is a few hundred small ops a step:
gathering the tails' keys and values out of the pool, batched matmuls over tiny shapes, the reshapes of
their permuted views, the softmax's passes. On the embedded model at 8 running requests of ~345 tokens they
took ~9 of a step's 68 ms for ~3 MFLOP a layer. Here each query row walks its sequence's blocks once: the
scores of 8 keys at a time for each head (8 dot products reduced together), an online softmax per tile of
16 keys (running max and sum, the output rescaled, as flash decoding does), and the values weighted into
the row's output. Keys and values are read where they lie in the pool, never copied, tile by tile across
the whole batch: a prefix the batch's sequences share is the same blocks, so each of its tiles is read from
memory once, then from the cache. The step went to 58.9 ms (bench/decode_attention.py has the op alone).

Sums are in float32 in key order and the exponential is a polynomial (Cephes' expf: within ~2 ulp), so
results differ from the reference's by rounding only (tests/kernels/test_cpu_attention.py).

Used by the CPU op set (kernels/ops.py) for steps whose chunks are all short (`MAX_QUERY_ROWS`: decode
steps, which are most steps of a busy engine): every query row here costs a pass over its keys, which a
long prefill chunk's matmuls amortize far better. Float32 only, head size a multiple of 8. Single-threaded:
kernels/ops.py picks it where torch runs on one thread.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from kvpilot.kernels import native, reference
from kvpilot.kernels.metadata import AttentionMetadata

# A step whose longest chunk has more query rows than this goes to the reference: a prefill chunk.
MAX_QUERY_ROWS = 1

SOURCE = r"""
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

#define TILE 16

/* 8 sums of 8 lanes each, as one vector: [sum a0, ..., sum a7]. */
static inline __m256 sum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3,
                          __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax(__m256 v) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

/* e^x, 8 at a time, for x <= 0 (scores less their maximum): Cephes' expf. Below -87.3 it gives e^-87.3
   (~1e-38), never a denormal; the caller zeroes what must be zero. A NaN stays NaN (max_ps returns its
   second operand when either is NaN), so a NaN or infinite score reaches the row as the reference's does. */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.33654f), x);
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The scores of one query head against 8 keys (k[i] + off: their rows of this head). */
static inline __m256 scores8(const float *q, const float *const *k, long off, long dim) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (long d = 0; d < dim; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[0] + off + d), a0);
        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[1] + off + d), a1);
        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[2] + off + d), a2);
        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[3] + off + d), a3);
        a4 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[4] + off + d), a4);
        a5 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[5] + off + d), a5);
        a6 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[6] + off + d), a6);
        a7 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[7] + off + d), a7);
    }
    return sum8(a0, a1, a2, a3, a4, a5, a6, a7);
}

/* a[0..dim) = alpha a + sum of p[i] v[i][off..off+dim) over i < n. By 8 vectors (64 floats) at a time where
   dim allows: 8 independent chains of multiply-adds, where one vector at a time would wait on each. */
static inline void accumulate(float *a, const float *p, const float *const *v, int n, long off, long dim,
                              __m256 alpha) {
    long d = 0;
    for (; d + 64 <= dim; d += 64) {
        __m256 o0 = _mm256_mul_ps(_mm256_loadu_ps(a + d), alpha);
        __m256 o1 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 8), alpha);
        __m256 o2 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 16), alpha);
        __m256 o3 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 24), alpha);
        __m256 o4 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 32), alpha);
        __m256 o5 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 40), alpha);
        __m256 o6 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 48), alpha);
        __m256 o7 = _mm256_mul_ps(_mm256_loadu_ps(a + d + 56), alpha);
        for (int i = 0; i < n; i++) {
            const float *x = v[i] + off + d;
            __m256 w = _mm256_set1_ps(p[i]);
            o0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x), o0);
            o1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 8), o1);
            o2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 16), o2);
            o3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 24), o3);
            o4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 32), o4);
            o5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 40), o5);
            o6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 48), o6);
            o7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(x + 56), o7);
        }
        _mm256_storeu_ps(a + d, o0); _mm256_storeu_ps(a + d + 8, o1);
        _mm256_storeu_ps(a + d + 16, o2); _mm256_storeu_ps(a + d + 24, o3);
        _mm256_storeu_ps(a + d + 32, o4); _mm256_storeu_ps(a + d + 40, o5);
        _mm256_storeu_ps(a + d + 48, o6); _mm256_storeu_ps(a + d + 56, o7);
    }
    for (; d < dim; d += 8) {
        __m256 o = _mm256_mul_ps(_mm256_loadu_ps(a + d), alpha);
        for (int i = 0; i < n; i++) o = _mm256_fmadd_ps(_mm256_set1_ps(p[i]), _mm256_loadu_ps(v[i] + off + d), o);
        _mm256_storeu_ps(a + d, o);
    }
}

/* Causal attention of a packed batch over a paged cache: q [tokens, heads, dim] (rows q_stride apart),
   caches [blocks, block, kv_heads, dim], out [tokens, heads, dim]; sequence s owns query rows
   qstart[s]..qstart[s+1], the last of its seqlens[s] tokens, its blocks tables[s][0..width). work holds
   2 * tokens * heads floats. Returns 0, or -1 for a sequence's bounds that do not fit the arrays and -2
   for a block id outside the pool: nothing is read out of bounds.
   Tile by tile of key positions, every row of every sequence in turn: a prefix the sequences share is the
   same blocks, so each of its tiles is read from memory once, then from the cache. out holds each row's
   weighted values until the end, when they are divided by the row's softmax sum. */
int paged_attention(const float *q, long q_stride, const float *kc, const float *vc, float *out,
                    const int *qstart, const int *seqlens, const int *tables, long width, long nseq,
                    long ntok, long nblocks, long block, long heads, long kv_heads, long dim, float scale,
                    float *work) {
    long group = heads / kv_heads, row = kv_heads * dim, longest = 0;
    float *mx = work, *sum = work + ntok * heads;
    const float *kp[TILE], *vp[TILE];
    float p[TILE] __attribute__((aligned(32)));
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7), vscale = _mm256_set1_ps(scale);
    for (long s = 0; s < nseq; s++) {
        long q0 = qstart[s], q1 = qstart[s + 1], len = seqlens[s];
        if (q0 < 0 || q1 < q0 || q1 > ntok || q1 - q0 > len || len > width * block) return -1;
        if (len > longest) longest = len;
    }
    for (long i = 0; i < ntok * heads; i++) { mx[i] = -INFINITY; sum[i] = 0.0f; }
    for (long i = 0; i < ntok * heads * dim; i++) out[i] = 0.0f;
    for (long j0 = 0; j0 < longest; j0 += TILE) {
        for (long s = 0; s < nseq; s++) {
            long q0 = qstart[s], q1 = qstart[s + 1], len = seqlens[s];
            if (len <= j0 || q0 == q1) continue;
            const int *table = tables + s * width;
            /* each key's row in the pool, walking the table (no division per key) */
            int keys = len - j0 < TILE ? (int)(len - j0) : TILE;
            long bi = j0 / block, bo = j0 % block, b = table[bi];
            if (b < 0 || b >= nblocks) return -2;
            for (int i = 0; i < keys; i++) {
                size_t at = ((size_t)b * block + bo) * row;
                kp[i] = kc + at;
                vp[i] = vc + at;
                if (++bo == block && i + 1 < keys) {
                    bo = 0;
                    b = table[++bi];
                    if (b < 0 || b >= nblocks) return -2;
                }
            }
            for (int i = keys; i < (keys + 7) / 8 * 8; i++) { kp[i] = kp[0]; vp[i] = vp[0]; }  /* masked below */
            for (long t = q0; t < q1; t++) {
                long ctx = len - (q1 - 1 - t);
                if (ctx <= j0) continue;
                int n = ctx - j0 < TILE ? (int)(ctx - j0) : TILE;
                for (long h = 0; h < heads; h++) {
                    long off = (h / group) * dim, th = t * heads + h;
                    const float *qh = q + t * q_stride + h * dim;
                    /* the tile's scores (past the context: -inf), then their maximum */
                    __m256 top = _mm256_set1_ps(-INFINITY);
                    for (int c = 0; c < n; c += 8) {
                        __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)c)),
                                                    _mm256_set1_ps((float)n), _CMP_LT_OQ);
                        __m256 sc = _mm256_mul_ps(scores8(qh, kp + c, off, dim), vscale);
                        sc = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), sc, live);
                        _mm256_store_ps(p + c, sc);
                        top = _mm256_max_ps(top, sc);
                    }
                    float tile_max = hmax(top), m = tile_max > mx[th] ? tile_max : mx[th];
                    __m256 vm = _mm256_set1_ps(m), total = _mm256_setzero_ps();
                    for (int c = 0; c < n; c += 8) {
                        __m256 live = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps((float)c)),
                                                    _mm256_set1_ps((float)n), _CMP_LT_OQ);
                        __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_load_ps(p + c), vm)), live);
                        _mm256_store_ps(p + c, e);
                        total = _mm256_add_ps(total, e);
                    }
                    float alpha = _mm256_cvtss_f32(exp8(_mm256_set1_ps(mx[th] - m)));
                    sum[th] = sum[th] * alpha + hsum(total);
                    mx[th] = m;
                    accumulate(out + th * dim, p, vp, n, off, dim, _mm256_set1_ps(alpha));
                }
            }
        }
    }
    for (long s = 0; s < nseq; s++)
        for (long th = qstart[s] * heads; th < qstart[s + 1] * heads; th++) {
            float inv = 1.0f / sum[th];
            for (long d = 0; d < dim; d++) out[th * dim + d] *= inv;
        }
    return 0;
}
"""


def available() -> bool:
    """Whether the kernel runs here: x86-64 with AVX2 and FMA, and its library built (or buildable)."""
    return _library() is not None


def fits(query: torch.Tensor, k_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the kernel takes this step: float32 on the CPU, head size a multiple of 8, chunks of at most
    MAX_QUERY_ROWS rows, and the layouts it reads."""
    return (
        meta.max_query_len <= MAX_QUERY_ROWS
        and query.dtype == k_cache.dtype == torch.float32
        and query.device.type == k_cache.device.type == "cpu"
        and query.dim() == 3
        and k_cache.dim() == 4
        and query.shape[2] == k_cache.shape[3]
        and query.shape[2] % 8 == 0
        and query.shape[1] % k_cache.shape[2] == 0
        and query.stride(2) == 1
        and query.stride(1) == query.shape[2]
        and k_cache.is_contiguous()
    )


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """`reference.paged_attention`, through the kernel where it runs and `fits` the step; the reference
    elsewhere."""
    lib = _library()
    if lib is None or not fits(query, k_cache, meta):
        return reference.paged_attention(query, k_cache, v_cache, meta, scale)
    # The C code trusts these shapes and layouts (and checks every index it reads through them).
    tables, starts, lens = meta.block_tables, meta.query_start_loc, meta.seq_lens
    seqs = lens.shape[0]
    if not (
        v_cache.shape == k_cache.shape
        and v_cache.dtype == torch.float32
        and v_cache.is_contiguous()
        and tables.dtype == starts.dtype == lens.dtype == torch.int32
        and tables.dim() == 2
        and tables.shape[0] == seqs
        and tuple(starts.shape) == (seqs + 1,)
        and tables.is_contiguous()
        and starts.is_contiguous()
        and lens.is_contiguous()
        and tables.device.type == starts.device.type == lens.device.type == "cpu"
    ):
        raise ValueError("cpu_attention: the step's metadata does not fit its caches")
    tokens, heads, dim = query.shape
    blocks, block, kv_heads = k_cache.shape[:3]
    out = torch.empty(query.shape, dtype=torch.float32)
    work = torch.empty(2 * tokens * heads, dtype=torch.float32)
    failed = lib.paged_attention(
        query.data_ptr(),
        query.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        out.data_ptr(),
        starts.data_ptr(),
        lens.data_ptr(),
        tables.data_ptr(),
        tables.shape[1],
        seqs,
        tokens,
        blocks,
        block,
        heads,
        kv_heads,
        dim,
        scale,
        work.data_ptr(),
    )
    if failed:
        what = "a block id outside the pool" if failed == -2 else "sequence bounds past its arrays"
        raise ValueError(f"cpu_attention: the step's metadata holds {what}")
    return out


@functools.cache  # once: an op calls it every layer
def _library() -> ctypes.CDLL | None:
    pointer, size = ctypes.c_void_p, ctypes.c_long
    arguments = (pointer, size, *[pointer] * 6, *[size] * 8, ctypes.c_float, pointer)
    return native.library("cpu_attention", SOURCE, paged_attention=(arguments, ctypes.c_int))
