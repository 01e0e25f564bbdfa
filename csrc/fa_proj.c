/*
 * Few-row projections without BLAS: y = x . w^T (+ b), float32, AVX2/FMA.
 *
 * A gemm packs the whole weight matrix into its own layout on every call; with
 * few rows (decoding, short sequences) that copy costs as much as the products
 * themselves (SciPy's OpenBLAS, one thread, K = 512, N = 1536: 3 GFLOP/s at 1
 * row, 36 at 16, 69 at 64, 92 at 1024 rows; this kernel: 23 at 1 row, 80 at
 * 16, 84 at 128 -- so fastattn/_proj.pyx uses it for blocks of up to 128
 * rows).  Here the weights are read in place: each step takes 4 input rows
 * against 3 weight rows (3 x 4 for fewer than 4 rows), 12 running dot products
 * in registers, and a horizontal reduction at the end of the row.  Plain C99
 * plus a target attribute; the caller checks fa_proj_small_available() (AVX2 +
 * FMA) and otherwise uses BLAS.
 *
 * Weights that do not change (a frozen MultiHeadAttention layer) can instead
 * be packed once (fa_proj_pack_f32: panels of 16 output columns, feature-major)
 * and multiplied by fa_proj_packed_f32: 6 rows x 16 columns of register
 * accumulators, x broadcast, the panel read sequentially -- no horizontal
 * reductions and no strided weight rows.  One thread, K = 512: 95-99 GFLOP/s
 * from 4 rows up at N = 512 and 1536 (this kernel: 80-87), 33-36 at one row
 * (28-34); peak is ~102.
 */
#include <stddef.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include "fa_proj.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FA_PROJ_AVX2 1
#define AVX2 __attribute__((target("avx2,fma")))
#include "fa_transpose_avx2.h"

static AVX2 inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

/* One input row (decoding, B = 1 recurrences): 8 weight rows a step, one
 * load of x per 8 loads of w, no duplicated rows (3 x 4 computes 3 rows for
 * 1); the 8 sums reduced together at the end of the row. */
static AVX2 void small_1x8(int64_t n, int64_t k, const float *x, const float *w, int64_t ldw,
                           const float *b, float *y)
{
    const int64_t k8 = k & ~(int64_t)7;
    const int tail = (int)(k - k8);
    const __m256i tmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t j = 0; j < n; j += 8) {
        const float *wr[8];
        for (int q = 0; q < 8; q++)   /* rows past the end repeat the last one, not stored */
            wr[q] = w + (j + q < n ? j + q : n - 1) * ldw;
        const int nj = n - j < 8 ? (int)(n - j) : 8;
        __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0, c4 = c0, c5 = c0, c6 = c0, c7 = c0;
        int64_t p = 0;
        for (; p < k8; p += 8) {
            __m256 v = _mm256_loadu_ps(x + p);
            c0 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[0] + p), c0);
            c1 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[1] + p), c1);
            c2 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[2] + p), c2);
            c3 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[3] + p), c3);
            c4 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[4] + p), c4);
            c5 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[5] + p), c5);
            c6 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[6] + p), c6);
            c7 = _mm256_fmadd_ps(v, _mm256_loadu_ps(wr[7] + p), c7);
        }
        if (tail) {
            __m256 v = _mm256_maskload_ps(x + p, tmask);
            c0 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[0] + p, tmask), c0);
            c1 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[1] + p, tmask), c1);
            c2 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[2] + p, tmask), c2);
            c3 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[3] + p, tmask), c3);
            c4 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[4] + p, tmask), c4);
            c5 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[5] + p, tmask), c5);
            c6 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[6] + p, tmask), c6);
            c7 = _mm256_fmadd_ps(v, _mm256_maskload_ps(wr[7] + p, tmask), c7);
        }
        float r[8];
        _mm_storeu_ps(r, hsum4(c0, c1, c2, c3));
        _mm_storeu_ps(r + 4, hsum4(c4, c5, c6, c7));
        for (int jj = 0; jj < nj; jj++)
            y[j + jj] = b ? r[jj] + b[j + jj] : r[jj];
    }
}

static AVX2 void small_3x4(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                                  const float *w, int64_t ldw, const float *b, float *y,
                                  int64_t ldy)
{
    const int64_t k8 = k & ~(int64_t)7;
    const int tail = (int)(k - k8);
    /* lanes < tail loaded in the last, partial step */
    const __m256i tmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t j = 0; j < n; j += 4) {
        /* rows past the end repeat the last one and are not stored */
        const float *w0 = w + j * ldw;
        const float *w1 = w + (j + 1 < n ? j + 1 : n - 1) * ldw;
        const float *w2 = w + (j + 2 < n ? j + 2 : n - 1) * ldw;
        const float *w3 = w + (j + 3 < n ? j + 3 : n - 1) * ldw;
        const int nj = n - j < 4 ? (int)(n - j) : 4;
        for (int64_t i = 0; i < m; i += 3) {
            const float *x0 = x + i * ldx;
            const float *x1 = x + (i + 1 < m ? i + 1 : m - 1) * ldx;
            const float *x2 = x + (i + 2 < m ? i + 2 : m - 1) * ldx;
            const int mi = m - i < 3 ? (int)(m - i) : 3;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00, c03 = c00;
            __m256 c10 = c00, c11 = c00, c12 = c00, c13 = c00;
            __m256 c20 = c00, c21 = c00, c22 = c00, c23 = c00;
            int64_t p = 0;
            for (; p < k8; p += 8) {
                __m256 a0 = _mm256_loadu_ps(w0 + p), a1 = _mm256_loadu_ps(w1 + p);
                __m256 a2 = _mm256_loadu_ps(w2 + p), a3 = _mm256_loadu_ps(w3 + p);
                __m256 v = _mm256_loadu_ps(x0 + p);
                c00 = _mm256_fmadd_ps(v, a0, c00); c01 = _mm256_fmadd_ps(v, a1, c01);
                c02 = _mm256_fmadd_ps(v, a2, c02); c03 = _mm256_fmadd_ps(v, a3, c03);
                v = _mm256_loadu_ps(x1 + p);
                c10 = _mm256_fmadd_ps(v, a0, c10); c11 = _mm256_fmadd_ps(v, a1, c11);
                c12 = _mm256_fmadd_ps(v, a2, c12); c13 = _mm256_fmadd_ps(v, a3, c13);
                v = _mm256_loadu_ps(x2 + p);
                c20 = _mm256_fmadd_ps(v, a0, c20); c21 = _mm256_fmadd_ps(v, a1, c21);
                c22 = _mm256_fmadd_ps(v, a2, c22); c23 = _mm256_fmadd_ps(v, a3, c23);
            }
            if (tail) {
                __m256 a0 = _mm256_maskload_ps(w0 + p, tmask), a1 = _mm256_maskload_ps(w1 + p, tmask);
                __m256 a2 = _mm256_maskload_ps(w2 + p, tmask), a3 = _mm256_maskload_ps(w3 + p, tmask);
                __m256 v = _mm256_maskload_ps(x0 + p, tmask);
                c00 = _mm256_fmadd_ps(v, a0, c00); c01 = _mm256_fmadd_ps(v, a1, c01);
                c02 = _mm256_fmadd_ps(v, a2, c02); c03 = _mm256_fmadd_ps(v, a3, c03);
                v = _mm256_maskload_ps(x1 + p, tmask);
                c10 = _mm256_fmadd_ps(v, a0, c10); c11 = _mm256_fmadd_ps(v, a1, c11);
                c12 = _mm256_fmadd_ps(v, a2, c12); c13 = _mm256_fmadd_ps(v, a3, c13);
                v = _mm256_maskload_ps(x2 + p, tmask);
                c20 = _mm256_fmadd_ps(v, a0, c20); c21 = _mm256_fmadd_ps(v, a1, c21);
                c22 = _mm256_fmadd_ps(v, a2, c22); c23 = _mm256_fmadd_ps(v, a3, c23);
            }
            float r[3][4];
            _mm_storeu_ps(r[0], hsum4(c00, c01, c02, c03));
            _mm_storeu_ps(r[1], hsum4(c10, c11, c12, c13));
            _mm_storeu_ps(r[2], hsum4(c20, c21, c22, c23));
            for (int ii = 0; ii < mi; ii++) {
                float *yr = y + (i + ii) * ldy + j;
                for (int jj = 0; jj < nj; jj++)
                    yr[jj] = b ? r[ii][jj] + b[j + jj] : r[ii][jj];
            }
        }
    }
}
/* 4 input rows x 3 weight rows a step: 23 % faster than 3 x 4 at 16 rows and
 * 12 % at 128 (measured, one thread, K = 512); 3 x 4 stays for 1-3 rows. */
static AVX2 void small_4x3(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                           const float *w, int64_t ldw, const float *b, float *y, int64_t ldy)
{
    const int64_t k8 = k & ~(int64_t)7;
    const int tail = (int)(k - k8);
    const __m256i tmask = _mm256_cmpgt_epi32(_mm256_set1_epi32(tail),
                                             _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int64_t j = 0; j < n; j += 3) {
        const float *w0 = w + j * ldw;
        const float *w1 = w + (j + 1 < n ? j + 1 : n - 1) * ldw;
        const float *w2 = w + (j + 2 < n ? j + 2 : n - 1) * ldw;
        const int nj = n - j < 3 ? (int)(n - j) : 3;
        for (int64_t i = 0; i < m; i += 4) {
            const float *x0 = x + i * ldx;
            const float *x1 = x + (i + 1 < m ? i + 1 : m - 1) * ldx;
            const float *x2 = x + (i + 2 < m ? i + 2 : m - 1) * ldx;
            const float *x3 = x + (i + 3 < m ? i + 3 : m - 1) * ldx;
            const int mi = m - i < 4 ? (int)(m - i) : 4;
            __m256 c00 = _mm256_setzero_ps(), c01 = c00, c02 = c00;
            __m256 c10 = c00, c11 = c00, c12 = c00;
            __m256 c20 = c00, c21 = c00, c22 = c00;
            __m256 c30 = c00, c31 = c00, c32 = c00;
            int64_t p = 0;
#define FA_STEP43(LOAD)                                                                   \
            {                                                                             \
                __m256 a0 = LOAD(w0 + p), a1 = LOAD(w1 + p), a2 = LOAD(w2 + p);           \
                __m256 v = LOAD(x0 + p);                                                  \
                c00 = _mm256_fmadd_ps(v, a0, c00); c01 = _mm256_fmadd_ps(v, a1, c01);    \
                c02 = _mm256_fmadd_ps(v, a2, c02);                                        \
                v = LOAD(x1 + p);                                                         \
                c10 = _mm256_fmadd_ps(v, a0, c10); c11 = _mm256_fmadd_ps(v, a1, c11);    \
                c12 = _mm256_fmadd_ps(v, a2, c12);                                        \
                v = LOAD(x2 + p);                                                         \
                c20 = _mm256_fmadd_ps(v, a0, c20); c21 = _mm256_fmadd_ps(v, a1, c21);    \
                c22 = _mm256_fmadd_ps(v, a2, c22);                                        \
                v = LOAD(x3 + p);                                                         \
                c30 = _mm256_fmadd_ps(v, a0, c30); c31 = _mm256_fmadd_ps(v, a1, c31);    \
                c32 = _mm256_fmadd_ps(v, a2, c32);                                        \
            }
#define FA_LOADU(ptr) _mm256_loadu_ps(ptr)
#define FA_LOADM(ptr) _mm256_maskload_ps((ptr), tmask)
            for (; p < k8; p += 8)
                FA_STEP43(FA_LOADU)
            if (tail)
                FA_STEP43(FA_LOADM)
#undef FA_STEP43
#undef FA_LOADU
#undef FA_LOADM
            float r[3][4];  /* r[column][row] */
            _mm_storeu_ps(r[0], hsum4(c00, c10, c20, c30));
            _mm_storeu_ps(r[1], hsum4(c01, c11, c21, c31));
            _mm_storeu_ps(r[2], hsum4(c02, c12, c22, c32));
            for (int ii = 0; ii < mi; ii++) {
                float *yr = y + (i + ii) * ldy + j;
                for (int jj = 0; jj < nj; jj++)
                    yr[jj] = b ? r[jj][ii] + b[j + jj] : r[jj][ii];
            }
        }
    }
}

/* ---- Products against prepacked weights (fa_proj_pack_f32's layout) ----
 * A block of R <= 6 input rows x one 16-column panel: 2R accumulators,
 * per input feature two loads of the panel and R broadcasts of x (the weights
 * are read sequentially, whatever their original row stride).  The first pass
 * over k starts from the bias (or zeros); later passes of a split k start from
 * y.  rem (1..16) is the number of valid columns of this panel. */
#define PK_LANES _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define PK_KERNEL(R, U)                                                                    \
static AVX2 void pk_##R(int64_t kc, const float *x, int64_t ldx, const float *bp,          \
                        float *y, int64_t ldy, const float *bias, int first, int rem)      \
{                                                                                          \
    __m256 a[U][R][2];                                                                     \
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), PK_LANES);               \
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem - 8), PK_LANES);           \
    const int full = rem == 16;                                                            \
    _Pragma("GCC unroll 6")                                                                \
    for (int r = 0; r < R; r++) {                                                          \
        const float *src = first ? bias : NULL;                                            \
        __m256 b0 = _mm256_setzero_ps(), b1 = b0;                                          \
        if (src) {                                                                         \
            b0 = full ? _mm256_loadu_ps(src) : _mm256_maskload_ps(src, m0);                \
            b1 = full ? _mm256_loadu_ps(src + 8) : _mm256_maskload_ps(src + 8, m1);        \
        }                                                                                  \
        a[0][r][0] = b0; a[0][r][1] = b1;                                                  \
        _Pragma("GCC unroll 2")                                                            \
        for (int u = 1; u < U; u++)                                                        \
            a[u][r][0] = a[u][r][1] = _mm256_setzero_ps();                                 \
    }                                                                                      \
    int64_t p = 0;                                                                         \
    for (; p + U <= kc; p += U) {                                                          \
        _Pragma("GCC unroll 2")                                                            \
        for (int u = 0; u < U; u++) {                                                      \
            const __m256 v0 = _mm256_loadu_ps(bp + (p + u) * 16);                          \
            const __m256 v1 = _mm256_loadu_ps(bp + (p + u) * 16 + 8);                      \
            _Pragma("GCC unroll 6")                                                        \
            for (int r = 0; r < R; r++) {                                                  \
                const __m256 xv = _mm256_broadcast_ss(x + r * ldx + p + u);                \
                a[u][r][0] = _mm256_fmadd_ps(xv, v0, a[u][r][0]);                          \
                a[u][r][1] = _mm256_fmadd_ps(xv, v1, a[u][r][1]);                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (; p < kc; p++) {                                                                  \
        const __m256 v0 = _mm256_loadu_ps(bp + p * 16), v1 = _mm256_loadu_ps(bp + p * 16 + 8); \
        _Pragma("GCC unroll 6")                                                            \
        for (int r = 0; r < R; r++) {                                                      \
            const __m256 xv = _mm256_broadcast_ss(x + r * ldx + p);                        \
            a[0][r][0] = _mm256_fmadd_ps(xv, v0, a[0][r][0]);                              \
            a[0][r][1] = _mm256_fmadd_ps(xv, v1, a[0][r][1]);                              \
        }                                                                                  \
    }                                                                                      \
    _Pragma("GCC unroll 6")                                                                \
    for (int r = 0; r < R; r++) {                                                          \
        float *yr = y + r * ldy;                                                           \
        __m256 s0 = a[0][r][0], s1 = a[0][r][1];                                           \
        _Pragma("GCC unroll 2")                                                            \
        for (int u = 1; u < U; u++) {                                                      \
            s0 = _mm256_add_ps(s0, a[u][r][0]);                                            \
            s1 = _mm256_add_ps(s1, a[u][r][1]);                                            \
        }                                                                                  \
        if (!first) {   /* a later run: summed from zero, then added to y */               \
            s0 = _mm256_add_ps(full ? _mm256_loadu_ps(yr) : _mm256_maskload_ps(yr, m0), s0);  \
            s1 = _mm256_add_ps(full ? _mm256_loadu_ps(yr + 8)                              \
                                    : _mm256_maskload_ps(yr + 8, m1), s1);                 \
        }                                                                                  \
        if (full) {                                                                        \
            _mm256_storeu_ps(yr, s0);                                                      \
            _mm256_storeu_ps(yr + 8, s1);                                                  \
        } else {                                                                           \
            _mm256_maskstore_ps(yr, m0, s0);                                               \
            _mm256_maskstore_ps(yr + 8, m1, s1);                                           \
        }                                                                                  \
    }                                                                                      \
}
/* 2 and 3 rows: two sets of accumulators (even and odd features) */
PK_KERNEL(2, 2)
PK_KERNEL(3, 2)
PK_KERNEL(4, 1)
PK_KERNEL(5, 1)
PK_KERNEL(6, 1)
#undef PK_KERNEL
#undef PK_LANES

/* One row: 2 accumulators would leave the FMA latency exposed (a decoding step
 * is then latency- rather than bandwidth-bound); 4 features a step into 8. */
static AVX2 void pk_1(int64_t kc, const float *x, int64_t ldx, const float *bp, float *y,
                      int64_t ldy, const float *bias, int first, int rem)
{
    (void)ldx; (void)ldy;
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem - 8), lanes);
    const int full = rem == 16;
    __m256 a0, a1;
    const float *src = first ? bias : NULL;   /* a later run: from zero, y added at the end */
    if (src) {
        a0 = full ? _mm256_loadu_ps(src) : _mm256_maskload_ps(src, m0);
        a1 = full ? _mm256_loadu_ps(src + 8) : _mm256_maskload_ps(src + 8, m1);
    } else {
        a0 = a1 = _mm256_setzero_ps();
    }
    __m256 b0 = _mm256_setzero_ps(), b1 = b0, c0 = b0, c1 = b0, d0 = b0, d1 = b0;
    int64_t p = 0;
    for (; p + 4 <= kc; p += 4) {
        const float *q = bp + p * 16;
        __m256 xv = _mm256_broadcast_ss(x + p);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 8), a1);
        xv = _mm256_broadcast_ss(x + p + 1);
        b0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 16), b0);
        b1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 24), b1);
        xv = _mm256_broadcast_ss(x + p + 2);
        c0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 32), c0);
        c1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 40), c1);
        xv = _mm256_broadcast_ss(x + p + 3);
        d0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 48), d0);
        d1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(q + 56), d1);
    }
    for (; p < kc; p++) {
        const __m256 xv = _mm256_broadcast_ss(x + p);
        a0 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(bp + p * 16), a0);
        a1 = _mm256_fmadd_ps(xv, _mm256_loadu_ps(bp + p * 16 + 8), a1);
    }
    a0 = _mm256_add_ps(_mm256_add_ps(a0, b0), _mm256_add_ps(c0, d0));
    a1 = _mm256_add_ps(_mm256_add_ps(a1, b1), _mm256_add_ps(c1, d1));
    if (!first) {
        a0 = _mm256_add_ps(full ? _mm256_loadu_ps(y) : _mm256_maskload_ps(y, m0), a0);
        a1 = _mm256_add_ps(full ? _mm256_loadu_ps(y + 8) : _mm256_maskload_ps(y + 8, m1), a1);
    }
    if (full) {
        _mm256_storeu_ps(y, a0);
        _mm256_storeu_ps(y + 8, a1);
    } else {
        _mm256_maskstore_ps(y, m0, a0);
        _mm256_maskstore_ps(y + 8, m1, a1);
    }
}

typedef void (*pk_fn)(int64_t, const float *, int64_t, const float *, float *, int64_t,
                      const float *, int, int);
static const pk_fn pk_rows[7] = {NULL, pk_1, pk_2, pk_3, pk_4, pk_5, pk_6};

/* ---- The same products two panels at a time with 512-bit vectors ----
 * (AVX512F CPUs): R rows x 32 columns, one vector of each panel a row, 2R
 * accumulators per feature set as pk_R has; the features split into the same
 * U sets (U = 4 for one row, 2 for two and three, 1 from four rows) and
 * summed in the same order, so every output is the same float as pk_R's.
 * The second panel is always whole in memory (panels are zero padded);
 * rem (17..32) columns are stored. */
#define AVX512P __attribute__((target("avx512f,avx2,fma")))

static AVX512P inline __mmask16 pk_mask16(int cnt)
{
    return cnt >= 16 ? (__mmask16)0xFFFF : cnt <= 0 ? (__mmask16)0 : (__mmask16)((1u << cnt) - 1u);
}

#define PKZ_KERNEL(R, U)                                                                   \
static AVX512P void pkz_##R(int64_t kc, const float *x, int64_t ldx, const float *bp,      \
                            int64_t pstride, float *y, int64_t ldy, const float *bias,     \
                            int first, int rem)                                            \
{                                                                                          \
    __m512 a[U][R][2];                                                                     \
    const __mmask16 m0 = pk_mask16(rem), m1 = pk_mask16(rem - 16);                         \
    const float *bq = bp + pstride;                                                        \
    _Pragma("GCC unroll 12")                                                               \
    for (int r = 0; r < R; r++) {                                                          \
        const float *src = first ? bias : NULL;                                            \
        __m512 b0 = _mm512_setzero_ps(), b1 = b0;                                          \
        if (src) {                                                                         \
            b0 = _mm512_maskz_loadu_ps(m0, src);                                           \
            b1 = _mm512_maskz_loadu_ps(m1, src + 16);                                      \
        }                                                                                  \
        a[0][r][0] = b0; a[0][r][1] = b1;                                                  \
        _Pragma("GCC unroll 4")                                                            \
        for (int u = 1; u < U; u++)                                                        \
            a[u][r][0] = a[u][r][1] = _mm512_setzero_ps();                                 \
    }                                                                                      \
    int64_t p = 0;                                                                         \
    for (; p + U <= kc; p += U) {                                                          \
        _Pragma("GCC unroll 4")                                                            \
        for (int u = 0; u < U; u++) {                                                      \
            const __m512 v0 = _mm512_loadu_ps(bp + (p + u) * 16);                          \
            const __m512 v1 = _mm512_loadu_ps(bq + (p + u) * 16);                          \
            _Pragma("GCC unroll 12")                                                       \
            for (int r = 0; r < R; r++) {                                                  \
                const __m512 xv = _mm512_set1_ps(x[r * ldx + p + u]);                      \
                a[u][r][0] = _mm512_fmadd_ps(xv, v0, a[u][r][0]);                          \
                a[u][r][1] = _mm512_fmadd_ps(xv, v1, a[u][r][1]);                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    for (; p < kc; p++) {                                                                  \
        const __m512 v0 = _mm512_loadu_ps(bp + p * 16), v1 = _mm512_loadu_ps(bq + p * 16); \
        _Pragma("GCC unroll 12")                                                           \
        for (int r = 0; r < R; r++) {                                                      \
            const __m512 xv = _mm512_set1_ps(x[r * ldx + p]);                              \
            a[0][r][0] = _mm512_fmadd_ps(xv, v0, a[0][r][0]);                              \
            a[0][r][1] = _mm512_fmadd_ps(xv, v1, a[0][r][1]);                              \
        }                                                                                  \
    }                                                                                      \
    _Pragma("GCC unroll 12")                                                               \
    for (int r = 0; r < R; r++) {                                                          \
        float *yr = y + r * ldy;                                                           \
        __m512 s0, s1;                                                                     \
        if (U == 4) {   /* pk_1's order: (a + b) + (c + d) */                              \
            s0 = _mm512_add_ps(_mm512_add_ps(a[0][r][0], a[1 % U][r][0]),                  \
                               _mm512_add_ps(a[2 % U][r][0], a[3 % U][r][0]));             \
            s1 = _mm512_add_ps(_mm512_add_ps(a[0][r][1], a[1 % U][r][1]),                  \
                               _mm512_add_ps(a[2 % U][r][1], a[3 % U][r][1]));             \
        } else {                                                                           \
            s0 = a[0][r][0]; s1 = a[0][r][1];                                              \
            _Pragma("GCC unroll 2")                                                        \
            for (int u = 1; u < U; u++) {                                                  \
                s0 = _mm512_add_ps(s0, a[u][r][0]);                                        \
                s1 = _mm512_add_ps(s1, a[u][r][1]);                                        \
            }                                                                              \
        }                                                                                  \
        if (!first) {   /* a later run: summed from zero, then added to y */               \
            s0 = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, yr), s0);                         \
            s1 = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, yr + 16), s1);                    \
        }                                                                                  \
        _mm512_mask_storeu_ps(yr, m0, s0);                                                 \
        _mm512_mask_storeu_ps(yr + 16, m1, s1);                                            \
    }                                                                                      \
}
PKZ_KERNEL(1, 4)
PKZ_KERNEL(2, 2)
PKZ_KERNEL(3, 2)
PKZ_KERNEL(4, 1)
PKZ_KERNEL(5, 1)
PKZ_KERNEL(6, 1)
PKZ_KERNEL(7, 1)
PKZ_KERNEL(8, 1)
PKZ_KERNEL(9, 1)
PKZ_KERNEL(10, 1)
PKZ_KERNEL(11, 1)
PKZ_KERNEL(12, 1)
#undef PKZ_KERNEL

typedef void (*pkz_fn)(int64_t, const float *, int64_t, const float *, int64_t, float *,
                       int64_t, const float *, int, int);
static const pkz_fn pkz_rows[13] = {NULL, pkz_1, pkz_2, pkz_3, pkz_4, pkz_5, pkz_6, pkz_7,
                                    pkz_8, pkz_9, pkz_10, pkz_11, pkz_12};
/* the tallest 512-bit row block (8..12; fa_proj_packed_tune_rows) */
static int g_pkz_max = 12;

/* Row blocks of the 512-bit path: up to 12 rows (24 of the 32 registers as
 * accumulators; g_pkz_max, 8 before) where the 256-bit path takes up to 6, with the same floats.
 * Blocks of four rows or more sum each output in one chain (U = 1) whatever
 * their height; the 256-bit policy (6-row blocks, then 4 + 4, 4 + 3, ...)
 * leaves a block of 1-3 rows (U > 1) exactly for the last 3 rows when m % 6
 * is 1 or 3, or a whole m < 3, so those rows go to a block of the same height
 * here and everything before them into blocks of 4-12 (checked for every m up
 * to 400 by simulating both policies; test_dispatch compares the paths). */
static int pkz_row_block(int64_t left, int64_t m)
{
    const int64_t tail = m < 3 ? m : (m % 6 == 1 || m % 6 == 3) ? 3 : 0;
    const int64_t big = left - tail;   /* rows before the tail, all in U = 1 blocks */
    const int64_t mx = g_pkz_max;
    if (big <= 0)
        return (int)left;
    if (big >= mx + 4)
        return (int)mx;
    if (big > mx)   /* two blocks, the second of 4 */
        return (int)(big - 4);
    return (int)big;   /* 4..mx */
}

static int cpu_has_avx512f(void)
{
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") != 0;
    }
    return cached;
}

/* Cache blocking inside one call (see fa_proj_packed_f32). */
static int64_t g_pk_kc = FA_PROJ_PACKED_KC;
static int64_t g_pk_mc = FA_PROJ_PACKED_MC;

/* dst[c][r] = src[r][c] for rows [r0, r1): row blocks of 8 in column tiles of
 * 64 (the tile's 8 x 64 source floats and its 64 x 8 destination floats stay
 * in L1 while the 8 x 8 blocks move).  Exact copies. */
/* csum (or NULL): csum[c] += src[r][c] in double for the rows in order (the
 * column sums of the block, read while it is in L1 for its transposition). */
static AVX2 void transpose_avx2(int64_t r0, int64_t r1, int64_t cols, const float *src,
                                int64_t lds, float *dst, int64_t ldd, double *csum)
{
    const __m256 one = _mm256_set1_ps(1.0f);  /* times 1: exact */
    int64_t r = r0;
    for (; r + 8 <= r1; r += 8) {
        int64_t c = 0;
        for (; c + 8 <= cols; c += 8) {
            const float *sb = src + r * lds + c;
            if (csum) {
                __m256d lo = _mm256_loadu_pd(csum + c), hi = _mm256_loadu_pd(csum + c + 4);
                for (int i = 0; i < 8; i++) {
                    const __m256 v = _mm256_loadu_ps(sb + i * lds);
                    lo = _mm256_add_pd(lo, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
                    hi = _mm256_add_pd(hi, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
                }
                _mm256_storeu_pd(csum + c, lo);
                _mm256_storeu_pd(csum + c + 4, hi);
            }
            transpose_block_f32(sb, lds, dst + c * ldd + r, ldd, one);
        }
        for (; c < cols; c++)
            for (int i = 0; i < 8; i++) {
                dst[c * ldd + r + i] = src[(r + i) * lds + c];
                if (csum)
                    csum[c] += (double)src[(r + i) * lds + c];
            }
    }
    for (; r < r1; r++)
        for (int64_t c = 0; c < cols; c++) {
            dst[c * ldd + r] = src[r * lds + c];
            if (csum)
                csum[c] += (double)src[r * lds + c];
        }
}

/* abuf (x given transposed, see fa_proj_packed_xt_runs_f32): MC x KC floats of
 * scratch; block (i0, k0) of x, read from the transposed array (row stride
 * ldx), is copied into it by transpose_avx2 before the kernels read it (rows of
 * kc), once for all the column panels -- the floats a transposed copy of the
 * whole x would hold, without writing and rereading one. */
static AVX2 void packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                            const float *wp, const float *b, float *y, int64_t ldy, int wide,
                            int64_t runs, float *abuf, double *csum)
{
    const int64_t KC = runs > 0 ? runs : g_pk_kc > 0 ? g_pk_kc : k;
    const int64_t MC = g_pk_mc > 0 ? g_pk_mc : m;
    wide = wide && cpu_has_avx512f();
    for (int64_t i0 = 0; i0 < m; i0 += MC) {
        const int64_t i1 = i0 + MC < m ? i0 + MC : m;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t kc = k - k0 < KC ? k - k0 : KC;
            /* row i of this block at xb + (i - i0) * ldb */
            const float *xb = x + i0 * ldx + k0;
            int64_t ldb = ldx;
            if (abuf) {   /* rows k0.. of the transposed x, columns i0..i1 */
                transpose_avx2(0, kc, i1 - i0, x + k0 * ldx + i0, ldx, abuf, kc,
                               csum ? csum + i0 : NULL);
                xb = abuf;
                ldb = kc;
            }
            for (int64_t j = 0; j < n;) {
                const float *bp = wp + j * k + k0 * 16;
                /* two panels at once with AVX-512 while two are left */
                const int two = wide && n - j > 16;
                const int64_t step = two ? 32 : 16;
                const int rem = n - j < step ? (int)(n - j) : (int)step;
                for (int64_t i = i0; i < i1;) {
                    /* 6-row blocks; 7 or 8 rows left go as two (4 + 3, 4 + 4), not
                     * 6 + a latency-bound 1 or 2 */
                    const int64_t left = i1 - i;
                    const int r = two ? pkz_row_block(left, i1 - i0)
                                      : left >= 9 || left == 6 ? 6 : left > 6 ? 4 : (int)left;
                    if (two)
                        pkz_rows[r](kc, xb + (i - i0) * ldb, ldb, bp, 16 * k, y + i * ldy + j, ldy,
                                    b ? b + j : NULL, k0 == 0, rem);
                    else
                        pk_rows[r](kc, xb + (i - i0) * ldb, ldb, bp, y + i * ldy + j, ldy,
                                   b ? b + j : NULL, k0 == 0, rem);
                    i += r;
                }
                j += step;
            }
        }
    }
}
#endif

int fa_proj_small_available(void)
{
#ifdef FA_PROJ_AVX2
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    }
    return cached;
#else
    return 0;
#endif
}

int fa_proj_small_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                      const float *w, int64_t ldw, const float *b, float *y, int64_t ldy)
{
#ifdef FA_PROJ_AVX2
    if (m < 1 || n < 1 || k < 1 || !fa_proj_small_available())
        return FA_PROJ_EINVAL;
    if (m == 1)
        small_1x8(n, k, x, w, ldw, b, y);
    else if (m < 4)
        small_3x4(m, n, k, x, ldx, w, ldw, b, y, ldy);
    else
        small_4x3(m, n, k, x, ldx, w, ldw, b, y, ldy);
    return 0;
#else
    (void)m; (void)n; (void)k; (void)x; (void)ldx; (void)w; (void)ldw; (void)b; (void)y; (void)ldy;
    return FA_PROJ_EINVAL;
#endif
}


/* One panel (rows p0 .. p0+15 of w, zeros past row n), portable. */
static void pack_panel(int64_t p0, int64_t n, int64_t k, const float *w, int64_t ldw,
                       float *panel)
{
    for (int jj = 0; jj < FA_PROJ_PANEL; jj++) {
        const float *wr = p0 + jj < n ? w + (p0 + jj) * ldw : NULL;
        for (int64_t c = 0; c < k; c++)
            panel[c * FA_PROJ_PANEL + jj] = wr ? wr[c] : 0.0f;
    }
}

#ifdef FA_PROJ_AVX2

/* A full panel by 8 x 8 register transposes: 8 rows x 8 features loaded,
 * stored as 8 features x 8 rows (half a panel row each); the k % 8 last
 * features one by one.  The same floats as pack_panel, 3x faster (measured,
 * one thread, 1536 x 512: 123 against 368 us). */
static AVX2 void pack_panel_avx2(int64_t p0, int64_t k, const float *w, int64_t ldw,
                                 float *panel)
{
    const __m256 one = _mm256_set1_ps(1.0f);  /* times 1: exact */
    int64_t c = 0;
    for (; c + 8 <= k; c += 8)
        for (int h = 0; h < FA_PROJ_PANEL; h += 8)
            transpose_block_f32(w + (p0 + h) * ldw + c, ldw, panel + c * FA_PROJ_PANEL + h,
                                FA_PROJ_PANEL, one);
    for (; c < k; c++)
        for (int jj = 0; jj < FA_PROJ_PANEL; jj++)
            panel[c * FA_PROJ_PANEL + jj] = w[(p0 + jj) * ldw + c];
}
#endif

void fa_proj_pack_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                             const float *w, int64_t ldw, float *wp, int simd)
{
    for (int64_t p = p_begin; p < p_end; p++) {
        int64_t p0 = p * FA_PROJ_PANEL;
        float *panel = wp + p0 * k;
#ifdef FA_PROJ_AVX2
        if (simd && p0 + FA_PROJ_PANEL <= n && fa_proj_small_available()) {
            pack_panel_avx2(p0, k, w, ldw, panel);
            continue;
        }
#else
        (void)simd;
#endif
        pack_panel(p0, n, k, w, ldw, panel);
    }
}

void fa_proj_pack_f32(int64_t n, int64_t k, const float *w, int64_t ldw, float *wp)
{
    fa_proj_pack_panels_f32(0, (n + FA_PROJ_PANEL - 1) / FA_PROJ_PANEL, n, k, w, ldw, wp, 0);
}

void fa_proj_pack_t_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                               const float *bt, int64_t ldb, float *wp)
{
    for (int64_t p = p_begin; p < p_end; p++) {
        const int64_t p0 = p * FA_PROJ_PANEL;
        const int64_t w = n - p0 < FA_PROJ_PANEL ? n - p0 : FA_PROJ_PANEL;
        float *panel = wp + p0 * k;
        if (w == FA_PROJ_PANEL) {   /* a whole panel: fixed-size row copies, no memcpy calls */
            for (int64_t c = 0; c < k; c++) {
                const float *src = bt + c * ldb + p0;
                float *dst = panel + c * FA_PROJ_PANEL;
                for (int jj = 0; jj < FA_PROJ_PANEL; jj++)
                    dst[jj] = src[jj];
            }
            continue;
        }
        for (int64_t c = 0; c < k; c++) {
            memcpy(panel + c * FA_PROJ_PANEL, bt + c * ldb + p0, (size_t)w * sizeof(float));
            for (int64_t jj = w; jj < FA_PROJ_PANEL; jj++)
                panel[c * FA_PROJ_PANEL + jj] = 0.0f;
        }
    }
}

int fa_proj_packed_available(void)
{
    return fa_proj_small_available();
}

void fa_proj_packed_tune_rows(int rows)
{
#ifdef FA_PROJ_AVX2
    g_pkz_max = rows < 8 ? 8 : rows > 12 ? 12 : rows;
#else
    (void)rows;
#endif
}

void fa_proj_packed_tune(int64_t kc, int64_t mc)
{
#ifdef FA_PROJ_AVX2
    g_pk_kc = kc;
    g_pk_mc = mc;
#else
    (void)kc; (void)mc;
#endif
}

int fa_proj_packed_runs_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                            const float *wp, int64_t c0, const float *b, float *y, int64_t ldy,
                            int wide, int64_t runs)
{
#ifdef FA_PROJ_AVX2
    if (m < 1 || n < 1 || k < 1 || c0 < 0 || c0 % FA_PROJ_PANEL || runs < 0
        || !fa_proj_packed_available())
        return FA_PROJ_EINVAL;
    packed_f32(m, n, k, x, ldx, wp + c0 * k, b, y, ldy, wide, runs, NULL, NULL);
    return 0;
#else
    (void)m; (void)n; (void)k; (void)x; (void)ldx; (void)wp; (void)c0; (void)b; (void)y; (void)ldy;
    (void)wide; (void)runs;
    return FA_PROJ_EINVAL;
#endif
}

int fa_proj_packed_xt_runs_f32(int64_t m, int64_t n, int64_t k, const float *xt, int64_t ldt,
                               const float *wp, int64_t c0, const float *b, float *y,
                               int64_t ldy, int wide, int64_t runs, double *csum)
{
#ifdef FA_PROJ_AVX2
    if (m < 1 || n < 1 || k < 1 || c0 < 0 || c0 % FA_PROJ_PANEL || runs < 1
        || runs > FA_PROJ_XT_MAX_RUNS || ldt < m || !fa_proj_packed_available())
        return FA_PROJ_EINVAL;
    const int64_t MC = g_pk_mc > 0 && g_pk_mc < m ? g_pk_mc : m;
    const int64_t KC = runs < k ? runs : k;
    float *abuf = (float *)malloc((size_t)(MC * KC) * sizeof(float));
    if (!abuf)
        return FA_PROJ_ENOMEM;
    packed_f32(m, n, k, xt, ldt, wp + c0 * k, b, y, ldy, wide, runs, abuf, csum);
    free(abuf);
    return 0;
#else
    (void)m; (void)n; (void)k; (void)xt; (void)ldt; (void)wp; (void)c0; (void)b; (void)y;
    (void)ldy; (void)wide; (void)runs; (void)csum;
    return FA_PROJ_EINVAL;
#endif
}

int fa_proj_packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                       const float *wp, int64_t c0, const float *b, float *y, int64_t ldy,
                       int wide)
{
    return fa_proj_packed_runs_f32(m, n, k, x, ldx, wp, c0, b, y, ldy, wide, 0);
}
