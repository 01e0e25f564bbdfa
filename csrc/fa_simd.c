/*
 * exp and softmax row operations: portable scalar code plus AVX2/FMA code
 * selected at run time.  No -ffast-math anywhere: masked scores are IEEE -inf
 * and must give exactly 0, NaN must propagate.
 *
 * Vector exp (both precisions): n = rint(x / ln2), r = x - n*ln2 (Cody-Waite,
 * two constants, FMA), exp(r) by a polynomial on |r| <= ln2/2, then scaled by
 * 2^n in two steps so that subnormal results are rounded once and overflow
 * gives +inf.  Inputs are clamped first so -inf -> 0 exactly, and the clamp is
 * written so a NaN input stays NaN.
 */
#include <math.h>
#include <string.h>
#include "fastattn.h"
#include "fa_rowops.h"

/* ------------------------------------------------------------------ scalar */

static float rowmax_f32_scalar(const float *x, int64_t n)
{
    float m = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        m = x[j] > m ? x[j] : m;
    return m;
}

static double rowmax_f64_scalar(const double *x, int64_t n)
{
    double m = -INFINITY;
    for (int64_t j = 0; j < n; j++)
        m = x[j] > m ? x[j] : m;
    return m;
}

static float expsub_sum_f32_scalar(float *x, int64_t n, float m)
{
    /* summed in double: one float accumulator over a whole row (the AVX2
     * version keeps 8) had 1.35x torch's rms error at 512 keys */
    double s = 0.0;
    for (int64_t j = 0; j < n; j++) {
        float e = expf(x[j] - m);
        x[j] = e;
        s += e;
    }
    return (float)s;
}

static double expsub_sum_f64_scalar(double *x, int64_t n, double m)
{
    double s = 0.0;
    for (int64_t j = 0; j < n; j++) {
        double e = exp(x[j] - m);
        x[j] = e;
        s += e;
    }
    return s;
}

static void mask_bool_f32_scalar(float *x, const unsigned char *m, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        x[j] = m[j] ? x[j] : -INFINITY;
}

static void mask_bool_f64_scalar(double *x, const unsigned char *m, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        x[j] = m[j] ? x[j] : -INFINITY;
}

static void exp_f32_scalar(const float *x, float *y, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        y[j] = expf(x[j]);
}

static void exp_f64_scalar(const double *x, double *y, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        y[j] = exp(x[j]);
}

#define SCALAR_SMALL(T, SFX)                                                          \
    static void small_qk_##SFX##_scalar(int64_t m, int64_t n, int64_t d, T scale,        \
                                        const T *Q, int64_t ldq, const T *K, int64_t ldk, \
                                        T *S, int64_t lds, T *kt)                        \
    {                                                                                    \
        (void)kt;                                                                        \
        for (int64_t i = 0; i < m; i++)                                                  \
            for (int64_t j = 0; j < n; j++) {                                            \
                T acc = 0;                                                               \
                for (int64_t c = 0; c < d; c++)                                          \
                    acc += Q[i * ldq + c] * K[j * ldk + c];                              \
                S[i * lds + j] = scale * acc;                                            \
            }                                                                            \
    }                                                                                    \
    static void small_pv_##SFX##_scalar(int64_t m, int64_t dv, int64_t n, const T *P,    \
                                        int64_t ldp, const T *V, int64_t ldv, T *O,      \
                                        int64_t ldo)                                     \
    {                                                                                    \
        for (int64_t i = 0; i < m; i++) {                                                \
            T *o = O + i * ldo;                                                          \
            for (int64_t c = 0; c < dv; c++)                                             \
                o[c] = 0;                                                                \
            for (int64_t j = 0; j < n; j++) {                                            \
                T p = P[i * ldp + j];                                                    \
                const T *v = V + j * ldv;                                                \
                for (int64_t c = 0; c < dv; c++)                                         \
                    o[c] += p * v[c];                                                    \
            }                                                                            \
        }                                                                                \
    }
SCALAR_SMALL(float, f32)
SCALAR_SMALL(double, f64)

/* Portable packed layout: one column per panel, i.e. kp = scale * K (n x d)
 * and vp = V^T (dv x n); gemm_pb takes dot products against those rows. */
#define SCALAR_PACKED(T, SFX)                                                             \
    static void pack_kt_##SFX##_scalar(int64_t n, int64_t d, T scale, const T *K,          \
                                       int64_t ldk, T *kp)                                 \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            for (int64_t c = 0; c < d; c++)                                                \
                kp[j * d + c] = scale * K[j * ldk + c];                                    \
    }                                                                                      \
    static void pack_v_##SFX##_scalar(int64_t n, int64_t dv, const T *V, int64_t ldv,      \
                                      T *vp)                                               \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            for (int64_t c = 0; c < dv; c++)                                               \
                vp[c * n + j] = V[j * ldv + c];                                            \
    }                                                                                      \
    static void gemm_pb_##SFX##_scalar(int64_t m, int64_t ncols, int64_t k, const T *A,    \
                                       int64_t lda, const T *Bp, T *C, int64_t ldc,        \
                                       int acc, const int64_t *lim, int lim_k)             \
    {                                                                                      \
        for (int64_t i = 0; i < m; i++) {                                                  \
            int64_t nc = ncols, kk = k;                                                    \
            if (lim && lim_k)                                                              \
                kk = lim[i / 6] < k ? lim[i / 6] : k;                                      \
            else if (lim)                                                                  \
                nc = lim[i / 6] < ncols ? lim[i / 6] : ncols;                              \
            for (int64_t p = 0; p < nc; p++) {                                             \
                const T *a = A + i * lda, *b = Bp + p * k;                                 \
                T s = 0;                                                                   \
                for (int64_t c = 0; c < kk; c++)                                           \
                    s += a[c] * b[c];                                                      \
                C[i * ldc + p] = acc ? C[i * ldc + p] + s : s;                             \
            }                                                                              \
        }                                                                                  \
    }
SCALAR_PACKED(float, f32)
SCALAR_PACKED(double, f64)

#define SCALAR_BWD(T, SFX)                                                                 \
    static void bwd_ds_##SFX##_scalar(const T *p, T *g, double dr, int64_t n)              \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            g[j] = p[j] * (T)((double)g[j] - dr);                                          \
    }                                                                                      \
    static void bwd_acc_##SFX##_scalar(double *acc, const T *t, int64_t n)                 \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            acc[j] += (double)t[j];                                                        \
    }                                                                                      \
    static void bwd_store_##SFX##_scalar(T *y, const double *acc, int64_t n)               \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            y[j] = (T)acc[j];                                                              \
    }                                                                                      \
    static void scale_##SFX##_scalar(T *x, int64_t n, T f)                                 \
    {                                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            x[j] *= f;                                                                     \
    }                                                                                      \
    static double dot64_##SFX##_scalar(const T *a, const T *b, int64_t n)                  \
    {                                                                                      \
        double s = 0;                                                                      \
        for (int64_t j = 0; j < n; j++)                                                    \
            s += (double)a[j] * (double)b[j];                                              \
        return s;                                                                          \
    }
SCALAR_BWD(float, f32)
SCALAR_BWD(double, f64)

static const fa_rowops scalar_ops = {
    rowmax_f32_scalar, rowmax_f64_scalar,
    expsub_sum_f32_scalar, expsub_sum_f64_scalar,
    expsub_sum_f32_scalar, expsub_sum_f64_scalar,
    mask_bool_f32_scalar, mask_bool_f64_scalar,
    exp_f32_scalar, exp_f64_scalar,
    small_qk_f32_scalar, small_qk_f64_scalar,
    small_pv_f32_scalar, small_pv_f64_scalar,
    pack_kt_f32_scalar, pack_kt_f64_scalar,
    pack_v_f32_scalar, pack_v_f64_scalar,
    gemm_pb_f32_scalar, gemm_pb_f64_scalar,
    bwd_ds_f32_scalar, bwd_ds_f64_scalar,
    bwd_acc_f32_scalar, bwd_acc_f64_scalar,
    bwd_store_f32_scalar, bwd_store_f64_scalar,
    scale_f32_scalar, scale_f64_scalar,
    dot64_f32_scalar, dot64_f64_scalar,
    NULL, NULL,   /* gemm_tn_acc: BLAS */
};

/* ------------------------------------------------------------------- AVX2 */

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FA_HAVE_AVX2_CODE 1
#include <immintrin.h>

#define AVX2 __attribute__((target("avx2,fma")))

#include "fa_exp_avx2.h"

AVX2 static float hsum8(__m256 v)
{
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static double hsum4(__m256d v)
{
    __m128d s = _mm_add_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_add_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

AVX2 static float hmax8(__m256 v)
{
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

AVX2 static double hmax4(__m256d v)
{
    __m128d s = _mm_max_pd(_mm256_castpd256_pd128(v), _mm256_extractf128_pd(v, 1));
    s = _mm_max_sd(s, _mm_unpackhi_pd(s, s));
    return _mm_cvtsd_f64(s);
}

/* _mm256_max_ps(x, m) returns m when x is NaN: NaN is ignored, as in the scalar loop */
AVX2 static float rowmax_f32_avx2(const float *x, int64_t n)
{
    __m256 m0 = _mm256_set1_ps(-INFINITY), m1 = m0;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + j), m0);
        m1 = _mm256_max_ps(_mm256_loadu_ps(x + j + 8), m1);
    }
    for (; j + 8 <= n; j += 8)
        m0 = _mm256_max_ps(_mm256_loadu_ps(x + j), m0);
    if (j < n) {  /* masked tail: lanes past the end read as -inf */
        __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 v = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), _mm256_maskload_ps(x + j, msk),
                                    _mm256_castsi256_ps(msk));
        m1 = _mm256_max_ps(v, m1);
    }
    return hmax8(_mm256_max_ps(m0, m1));
}

AVX2 static double rowmax_f64_avx2(const double *x, int64_t n)
{
    __m256d m0 = _mm256_set1_pd(-INFINITY), m1 = m0;
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        m0 = _mm256_max_pd(_mm256_loadu_pd(x + j), m0);
        m1 = _mm256_max_pd(_mm256_loadu_pd(x + j + 4), m1);
    }
    for (; j + 4 <= n; j += 4)
        m0 = _mm256_max_pd(_mm256_loadu_pd(x + j), m0);
    if (j < n) {  /* masked tail */
        __m256i msk = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n - j), _mm256_setr_epi64x(0, 1, 2, 3));
        __m256d v = _mm256_blendv_pd(_mm256_set1_pd(-INFINITY), _mm256_maskload_pd(x + j, msk),
                                     _mm256_castsi256_pd(msk));
        m1 = _mm256_max_pd(v, m1);
    }
    return hmax4(_mm256_max_pd(m0, m1));
}

/* x[j..n) of expsub_sum, onto the 8 lane sums acc (lane i sums the
 * elements i mod 8 in order: the AVX-512 loop hands over the same sums) */
AVX2 static inline float expsub_sum_f32_from(float *x, int64_t j, int64_t n, float m, __m256 acc)
{
    const __m256 vm = _mm256_set1_ps(m);
    for (; j + 8 <= n; j += 8) {
        __m256 e = exp8_nonpos_f32(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < n) {  /* masked tail */
        __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        /* lanes past the end compute exp(0) (not -inf: that takes exp's slow
         * subnormal path) and are left out of the sum and the store */
        __m256 v = _mm256_sub_ps(_mm256_maskload_ps(x + j, msk), vm);
        v = _mm256_and_ps(v, _mm256_castsi256_ps(msk));
        __m256 e = exp8_nonpos_f32(v);
        _mm256_maskstore_ps(x + j, msk, e);
        acc = _mm256_add_ps(acc, _mm256_and_ps(e, _mm256_castsi256_ps(msk)));
    }
    return hsum8(acc);
}

AVX2 static float expsub_sum_f32_avx2(float *x, int64_t n, float m)
{
    return expsub_sum_f32_from(x, 0, n, m, _mm256_setzero_ps());
}

AVX2 static double expsub_sum_f64_avx2(double *x, int64_t n, double m)
{
    const __m256d vm = _mm256_set1_pd(m);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        __m256d e = exp4_f64(_mm256_sub_pd(_mm256_loadu_pd(x + j), vm));
        _mm256_storeu_pd(x + j, e);
        acc = _mm256_add_pd(acc, e);
    }
    if (j < n) {  /* masked tail, as for float */
        __m256i msk = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n - j), _mm256_setr_epi64x(0, 1, 2, 3));
        __m256d v = _mm256_sub_pd(_mm256_maskload_pd(x + j, msk), vm);
        v = _mm256_and_pd(v, _mm256_castsi256_pd(msk));
        __m256d e = exp4_f64(v);
        _mm256_maskstore_pd(x + j, msk, e);
        acc = _mm256_add_pd(acc, _mm256_and_pd(e, _mm256_castsi256_pd(msk)));
    }
    return hsum4(acc);
}

/* Lanes with x - m below these give exactly 0 (exp < half the smallest
 * subnormal): they are computed as exp(0) and cleared, so a masked -inf
 * never sends a vector down exp's slow subnormal path. */
#define FA_EXP_DEAD_F32 (-104.0f)
#define FA_EXP_DEAD_F64 (-746.0)

AVX2 static inline float expsub_masked_f32_from(float *x, int64_t j, int64_t n, float m,
                                               __m256 acc)
{
    const __m256 vm = _mm256_set1_ps(m), dead = _mm256_set1_ps(FA_EXP_DEAD_F32);
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_sub_ps(_mm256_loadu_ps(x + j), vm);
        __m256 gone = _mm256_cmp_ps(v, dead, _CMP_LT_OQ);  /* NaN: kept, propagates */
        __m256 e = _mm256_andnot_ps(gone, exp8_nonpos_f32(_mm256_andnot_ps(gone, v)));
        _mm256_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    if (j < n) {
        __m256i msk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(n - j)),
                                         _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        __m256 v = _mm256_sub_ps(_mm256_maskload_ps(x + j, msk), vm);
        __m256 gone = _mm256_or_ps(_mm256_cmp_ps(v, dead, _CMP_LT_OQ),
                                   _mm256_castsi256_ps(_mm256_xor_si256(msk, _mm256_set1_epi32(-1))));
        __m256 e = _mm256_andnot_ps(gone, exp8_nonpos_f32(_mm256_andnot_ps(gone, v)));
        _mm256_maskstore_ps(x + j, msk, e);
        acc = _mm256_add_ps(acc, e);
    }
    return hsum8(acc);
}

AVX2 static float expsub_masked_f32_avx2(float *x, int64_t n, float m)
{
    return expsub_masked_f32_from(x, 0, n, m, _mm256_setzero_ps());
}

AVX2 static double expsub_masked_f64_avx2(double *x, int64_t n, double m)
{
    const __m256d vm = _mm256_set1_pd(m), dead = _mm256_set1_pd(FA_EXP_DEAD_F64);
    __m256d acc = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j < n; j += 4) {
        __m256i msk = _mm256_cmpgt_epi64(_mm256_set1_epi64x(n - j < 4 ? n - j : 4),
                                         _mm256_setr_epi64x(0, 1, 2, 3));
        __m256d v = _mm256_sub_pd(_mm256_maskload_pd(x + j, msk), vm);
        __m256d gone = _mm256_or_pd(_mm256_cmp_pd(v, dead, _CMP_LT_OQ),
                                    _mm256_castsi256_pd(_mm256_xor_si256(msk, _mm256_set1_epi64x(-1))));
        __m256d e = _mm256_andnot_pd(gone, exp4_f64(_mm256_andnot_pd(gone, v)));
        _mm256_maskstore_pd(x + j, msk, e);
        acc = _mm256_add_pd(acc, e);
    }
    return hsum4(acc);
}

AVX2 static void mask_bool_f32_avx2(float *x, const unsigned char *m, int64_t n)
{
    const __m256 ninf = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        long long bytes;
        memcpy(&bytes, m + j, 8);
        __m256i w = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128(bytes));
        __m256 off = _mm256_castsi256_ps(_mm256_cmpeq_epi32(w, _mm256_setzero_si256()));
        _mm256_storeu_ps(x + j, _mm256_blendv_ps(_mm256_loadu_ps(x + j), ninf, off));
    }
    for (; j < n; j++)
        x[j] = m[j] ? x[j] : -INFINITY;
}

AVX2 static void mask_bool_f64_avx2(double *x, const unsigned char *m, int64_t n)
{
    const __m256d ninf = _mm256_set1_pd(-INFINITY);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        int bytes;
        memcpy(&bytes, m + j, 4);
        __m256i w = _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(bytes));
        __m256d off = _mm256_castsi256_pd(_mm256_cmpeq_epi64(w, _mm256_setzero_si256()));
        _mm256_storeu_pd(x + j, _mm256_blendv_pd(_mm256_loadu_pd(x + j), ninf, off));
    }
    for (; j < n; j++)
        x[j] = m[j] ? x[j] : -INFINITY;
}

AVX2 static void exp_f32_avx2(const float *x, float *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(y + j, exp8_f32(_mm256_loadu_ps(x + j)));
    if (j < n) {
        float buf[8] = {0};
        int64_t t = n - j;
        memcpy(buf, x + j, (size_t)t * sizeof(float));
        _mm256_storeu_ps(buf, exp8_f32(_mm256_loadu_ps(buf)));
        memcpy(y + j, buf, (size_t)t * sizeof(float));
    }
}

AVX2 static void exp_f64_avx2(const double *x, double *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(y + j, exp4_f64(_mm256_loadu_pd(x + j)));
    if (j < n) {
        double buf[4] = {0};
        int64_t t = n - j;
        memcpy(buf, x + j, (size_t)t * sizeof(double));
        _mm256_storeu_pd(buf, exp4_f64(_mm256_loadu_pd(buf)));
        memcpy(y + j, buf, (size_t)t * sizeof(double));
    }
}

AVX2 static inline __m256 load_part_f32(const float *p, int64_t cnt)
{
    if (cnt >= 8)
        return _mm256_loadu_ps(p);
    __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    return _mm256_maskload_ps(p, m);
}

AVX2 static inline void store_part_f32(float *p, __m256 v, int64_t cnt)
{
    if (cnt >= 8) {
        _mm256_storeu_ps(p, v);
        return;
    }
    __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)cnt), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    _mm256_maskstore_ps(p, m, v);
}

AVX2 static inline __m256d load_part_f64(const double *p, int64_t cnt)
{
    if (cnt >= 4)
        return _mm256_loadu_pd(p);
    __m256i m = _mm256_cmpgt_epi64(_mm256_set1_epi64x(cnt), _mm256_setr_epi64x(0, 1, 2, 3));
    return _mm256_maskload_pd(p, m);
}

AVX2 static inline void store_part_f64(double *p, __m256d v, int64_t cnt)
{
    if (cnt >= 4) {
        _mm256_storeu_pd(p, v);
        return;
    }
    __m256i m = _mm256_cmpgt_epi64(_mm256_set1_epi64x(cnt), _mm256_setr_epi64x(0, 1, 2, 3));
    _mm256_maskstore_pd(p, m, v);
}

/* four accumulators -> their four sums */
AVX2 static inline __m128 hsum4_f32(__m256 a0, __m256 a1, __m256 a2, __m256 a3)
{
    __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

AVX2 static inline void store4_f32(float *p, __m128 v, float scale, int cnt)
{
    v = _mm_mul_ps(v, _mm_set1_ps(scale));
    if (cnt >= 4) {
        _mm_storeu_ps(p, v);
        return;
    }
    __m128i m = _mm_cmpgt_epi32(_mm_set1_epi32(cnt), _mm_setr_epi32(0, 1, 2, 3));
    _mm_maskstore_ps(p, m, v);
}

AVX2 static inline __m256d hsum4_f64(__m256d a0, __m256d a1, __m256d a2, __m256d a3)
{
    __m256d t0 = _mm256_hadd_pd(a0, a1), t1 = _mm256_hadd_pd(a2, a3);
    return _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20), _mm256_permute2f128_pd(t0, t1, 0x31));
}

AVX2 static inline void store4_f64(double *p, __m256d v, double scale, int cnt)
{
    store_part_f64(p, _mm256_mul_pd(v, _mm256_set1_pd(scale)), cnt);
}

#include "fa_transpose_avx2.h"

/* the same for a 4 x 4 double block */
AVX2 static inline void transpose_block_f64(const double *src, int64_t lds, double *dst,
                                            int64_t ldd, __m256d vs)
{
    __m256d r0 = _mm256_loadu_pd(src), r1 = _mm256_loadu_pd(src + lds);
    __m256d r2 = _mm256_loadu_pd(src + 2 * lds), r3 = _mm256_loadu_pd(src + 3 * lds);
    __m256d t0 = _mm256_unpacklo_pd(r0, r1), t1 = _mm256_unpackhi_pd(r0, r1);
    __m256d t2 = _mm256_unpacklo_pd(r2, r3), t3 = _mm256_unpackhi_pd(r2, r3);
    _mm256_storeu_pd(dst, _mm256_mul_pd(vs, _mm256_permute2f128_pd(t0, t2, 0x20)));
    _mm256_storeu_pd(dst + ldd, _mm256_mul_pd(vs, _mm256_permute2f128_pd(t1, t3, 0x20)));
    _mm256_storeu_pd(dst + 2 * ldd, _mm256_mul_pd(vs, _mm256_permute2f128_pd(t0, t2, 0x31)));
    _mm256_storeu_pd(dst + 3 * ldd, _mm256_mul_pd(vs, _mm256_permute2f128_pd(t1, t3, 0x31)));
}

#define SMT AVX2
#define SM(name) SM_(name, f32)
#define SM_(name, t) SM__(name, t)
#define SM__(name, t) name##_##t
#define ELT float
#define VEC __m256
#define W 8
#define SET1 _mm256_set1_ps
#define ZERO _mm256_setzero_ps
#define LOADU _mm256_loadu_ps
#define STOREU _mm256_storeu_ps
#define FMADD _mm256_fmadd_ps
#define MUL _mm256_mul_ps
#define ADD _mm256_add_ps
#include "fa_small_avx2.h"
#undef SM
#undef ELT
#undef VEC
#undef W
#undef SET1
#undef ZERO
#undef LOADU
#undef STOREU
#undef FMADD
#undef MUL
#undef ADD

#define SM(name) SM_(name, f64)
#define ELT double
#define VEC __m256d
#define W 4
#define SET1 _mm256_set1_pd
#define ZERO _mm256_setzero_pd
#define LOADU _mm256_loadu_pd
#define STOREU _mm256_storeu_pd
#define FMADD _mm256_fmadd_pd
#define MUL _mm256_mul_pd
#define ADD _mm256_add_pd
#include "fa_small_avx2.h"
#undef SM
#undef ELT
#undef VEC
#undef W
#undef SET1
#undef ZERO
#undef LOADU
#undef STOREU
#undef FMADD
#undef MUL
#undef ADD
#undef SMT

/* ---------------------------------------------------------------- AVX-512
 * The same products with 512-bit vectors (AVX512F), for CPUs that have them:
 * fa_small_avx2.h instantiated again with W = 16 floats / 8 doubles, so a
 * packed panel is 2W = 32 floats or 16 doubles wide (FA_PACK_ROUND rounds to
 * 32).  Every output element of small_pv, small_qk's transposed form and
 * gemm_pb is one sequential FMA chain over the inner dimension, as with AVX2:
 * the two tables give the same bits there; only small_qk's dot-product form
 * for few rows (lane sums) rounds differently.  The float exp rows
 * (expsub, masked or not) and the backward's elementwise steps have 512-bit
 * versions with AVX2's roundings and sums in AVX2's order (the same bits);
 * the rest of the row operations stay AVX2. */
#define AVX512 __attribute__((target("avx512f,avx2,fma")))

AVX512 static inline __mmask16 mask16(int64_t cnt)
{
    return cnt >= 16 ? (__mmask16)0xFFFF : cnt <= 0 ? (__mmask16)0 : (__mmask16)((1u << cnt) - 1u);
}

AVX512 static inline __mmask8 mask8(int64_t cnt)
{
    return cnt >= 8 ? (__mmask8)0xFF : cnt <= 0 ? (__mmask8)0 : (__mmask8)((1u << cnt) - 1u);
}

AVX512 static inline __m512 load_part_f32z(const float *p, int64_t cnt)
{
    return cnt >= 16 ? _mm512_loadu_ps(p) : _mm512_maskz_loadu_ps(mask16(cnt), p);
}

AVX512 static inline void store_part_f32z(float *p, __m512 v, int64_t cnt)
{
    if (cnt >= 16)
        _mm512_storeu_ps(p, v);
    else
        _mm512_mask_storeu_ps(p, mask16(cnt), v);
}

AVX512 static inline __m512d load_part_f64z(const double *p, int64_t cnt)
{
    return cnt >= 8 ? _mm512_loadu_pd(p) : _mm512_maskz_loadu_pd(mask8(cnt), p);
}

AVX512 static inline void store_part_f64z(double *p, __m512d v, int64_t cnt)
{
    if (cnt >= 8)
        _mm512_storeu_pd(p, v);
    else
        _mm512_mask_storeu_pd(p, mask8(cnt), v);
}

/* lane-pair sums down to 256 bits, then AVX2's four-way sums */
AVX512 static inline __m256 halves_f32z(__m512 v)
{
    return _mm256_add_ps(_mm512_castps512_ps256(v),
                         _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
}

AVX512 static inline __m128 hsum4_f32z(__m512 a0, __m512 a1, __m512 a2, __m512 a3)
{
    return hsum4_f32(halves_f32z(a0), halves_f32z(a1), halves_f32z(a2), halves_f32z(a3));
}

AVX512 static inline __m256d halves_f64z(__m512d v)
{
    return _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
}

AVX512 static inline __m256d hsum4_f64z(__m512d a0, __m512d a1, __m512d a2, __m512d a3)
{
    return hsum4_f64(halves_f64z(a0), halves_f64z(a1), halves_f64z(a2), halves_f64z(a3));
}

#define store4_f32z store4_f32
#define store4_f64z store4_f64

/* a 16 x 16 float (8 x 8 double) block as four AVX2 transposes: dst rows =
 * scale * src columns */
AVX512 static inline void transpose_block_f32z(const float *src, int64_t lds, float *dst,
                                               int64_t ldd, __m512 vs)
{
    __m256 v = _mm512_castps512_ps256(vs);
    transpose_block_f32(src, lds, dst, ldd, v);
    transpose_block_f32(src + 8, lds, dst + 8 * ldd, ldd, v);
    transpose_block_f32(src + 8 * lds, lds, dst + 8, ldd, v);
    transpose_block_f32(src + 8 * lds + 8, lds, dst + 8 * ldd + 8, ldd, v);
}

AVX512 static inline void transpose_block_f64z(const double *src, int64_t lds, double *dst,
                                               int64_t ldd, __m512d vs)
{
    __m256d v = _mm512_castpd512_pd256(vs);
    transpose_block_f64(src, lds, dst, ldd, v);
    transpose_block_f64(src + 4, lds, dst + 4 * ldd, ldd, v);
    transpose_block_f64(src + 4 * lds, lds, dst + 4, ldd, v);
    transpose_block_f64(src + 4 * lds + 4, lds, dst + 4 * ldd + 4, ldd, v);
}

#define SMT AVX512
#define SM_ROWS8
#define SM(name) SM_(name, f32z)
#define ELT float
#define VEC __m512
#define W 16
#define SET1 _mm512_set1_ps
#define ZERO _mm512_setzero_ps
#define LOADU _mm512_loadu_ps
#define STOREU _mm512_storeu_ps
#define FMADD _mm512_fmadd_ps
#define MUL _mm512_mul_ps
#define ADD _mm512_add_ps
#include "fa_small_avx2.h"
#undef SM
#undef ELT
#undef VEC
#undef W
#undef SET1
#undef ZERO
#undef LOADU
#undef STOREU
#undef FMADD
#undef MUL
#undef ADD

#define SM(name) SM_(name, f64z)
#define ELT double
#define VEC __m512d
#define W 8
#define SET1 _mm512_set1_pd
#define ZERO _mm512_setzero_pd
#define LOADU _mm512_loadu_pd
#define STOREU _mm512_storeu_pd
#define FMADD _mm512_fmadd_pd
#define MUL _mm512_mul_pd
#define ADD _mm512_add_pd
#include "fa_small_avx2.h"
#undef SM
#undef ELT
#undef VEC
#undef W
#undef SET1
#undef ZERO
#undef LOADU
#undef STOREU
#undef FMADD
#undef MUL
#undef ADD
#undef SM_ROWS8
#undef SMT

/* The backward's elementwise steps (the same roundings as the scalar ones:
 * one IEEE operation per step, in the same order). */
AVX2 static void bwd_ds_f32_avx2(const float *p, float *g, double dr, int64_t n)
{
    const __m256d d = _mm256_set1_pd(dr);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 gv = _mm256_loadu_ps(g + j);
        __m256d lo = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(gv)), d);
        __m256d hi = _mm256_sub_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(gv, 1)), d);
        __m256 diff = _mm256_set_m128(_mm256_cvtpd_ps(hi), _mm256_cvtpd_ps(lo));
        _mm256_storeu_ps(g + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), diff));
    }
    for (; j < n; j++)
        g[j] = p[j] * (float)((double)g[j] - dr);
}

AVX2 static void bwd_ds_f64_avx2(const double *p, double *g, double dr, int64_t n)
{
    const __m256d d = _mm256_set1_pd(dr);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(g + j, _mm256_mul_pd(_mm256_loadu_pd(p + j),
                                              _mm256_sub_pd(_mm256_loadu_pd(g + j), d)));
    for (; j < n; j++)
        g[j] = p[j] * (g[j] - dr);
}

AVX2 static void bwd_acc_f32_avx2(double *acc, const float *t, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 tv = _mm256_loadu_ps(t + j);
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j),
                                                _mm256_cvtps_pd(_mm256_castps256_ps128(tv))));
        _mm256_storeu_pd(acc + j + 4, _mm256_add_pd(_mm256_loadu_pd(acc + j + 4),
                                                    _mm256_cvtps_pd(_mm256_extractf128_ps(tv, 1))));
    }
    for (; j < n; j++)
        acc[j] += (double)t[j];
}

AVX2 static void bwd_acc_f64_avx2(double *acc, const double *t, int64_t n)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(acc + j, _mm256_add_pd(_mm256_loadu_pd(acc + j), _mm256_loadu_pd(t + j)));
    for (; j < n; j++)
        acc[j] += t[j];
}

AVX2 static void bwd_store_f32_avx2(float *y, const double *acc, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m128 lo = _mm256_cvtpd_ps(_mm256_loadu_pd(acc + j));
        __m128 hi = _mm256_cvtpd_ps(_mm256_loadu_pd(acc + j + 4));
        _mm256_storeu_ps(y + j, _mm256_set_m128(hi, lo));
    }
    for (; j < n; j++)
        y[j] = (float)acc[j];
}

AVX2 static void bwd_store_f64_avx2(double *y, const double *acc, int64_t n)
{
    memcpy(y, acc, (size_t)n * sizeof(double));
}

AVX2 static void scale_f32_avx2(float *x, int64_t n, float f)
{
    const __m256 fv = _mm256_set1_ps(f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(x + j, _mm256_mul_ps(_mm256_loadu_ps(x + j), fv));
    for (; j < n; j++)
        x[j] *= f;
}

AVX2 static void scale_f64_avx2(double *x, int64_t n, double f)
{
    const __m256d fv = _mm256_set1_pd(f);
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(x + j, _mm256_mul_pd(_mm256_loadu_pd(x + j), fv));
    for (; j < n; j++)
        x[j] *= f;
}

AVX2 static double dot64_f32_avx2(const float *a, const float *b, int64_t n)
{
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 av = _mm256_loadu_ps(a + j), bv = _mm256_loadu_ps(b + j);
        s0 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(av)),
                             _mm256_cvtps_pd(_mm256_castps256_ps128(bv)), s0);
        s1 = _mm256_fmadd_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(av, 1)),
                             _mm256_cvtps_pd(_mm256_extractf128_ps(bv, 1)), s1);
    }
    double s = hsum4(_mm256_add_pd(s0, s1));
    for (; j < n; j++)
        s += (double)a[j] * (double)b[j];
    return s;
}

AVX2 static double dot64_f64_avx2(const double *a, const double *b, int64_t n)
{
    __m256d s0 = _mm256_setzero_pd(), s1 = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        s0 = _mm256_fmadd_pd(_mm256_loadu_pd(a + j), _mm256_loadu_pd(b + j), s0);
        s1 = _mm256_fmadd_pd(_mm256_loadu_pd(a + j + 4), _mm256_loadu_pd(b + j + 4), s1);
    }
    double s = hsum4(_mm256_add_pd(s0, s1));
    for (; j < n; j++)
        s += a[j] * b[j];
    return s;
}

/* The backward's transposed products (fa_rowops.h, gemm_tn_acc): acc (M x N
 * doubles, row stride ldacc) += alpha * A^T B, A (K x M, lda) and B (K x N,
 * ldb) row-major -- dV_j += P^T dO_i and dK_j += scale dS^T Q_i read straight
 * from the tiles, no transposed copy, no BLAS call per 64-row chunk.  Blocks
 * of 6 rows of C x 16 float (8 double) columns: per term two loads of B's row,
 * six broadcasts from A's row (contiguous: the block's 6 columns of A), 12
 * FMA chains summed from zero over the K terms; then alpha times the sum
 * (rounded to REAL, as a gemm's alpha) is added to acc in double. */
#define TN_BLOCK(R, FULL)                                                                  \
    do {                                                                                   \
        __m256 c[R][2];                                                                    \
        _Pragma("GCC unroll 6")                                                            \
        for (int r = 0; r < (R); r++)                                                      \
            c[r][0] = c[r][1] = _mm256_setzero_ps();                                       \
        for (int64_t p = 0; p < K; p++) {                                                  \
            const float *bp = B + p * ldb + j;                                             \
            const __m256 b0 = (FULL) ? _mm256_loadu_ps(bp) : _mm256_maskload_ps(bp, m0);   \
            const __m256 b1 = (FULL) ? _mm256_loadu_ps(bp + 8) : _mm256_maskload_ps(bp + 8, m1); \
            const float *ap = A + p * lda + i;                                             \
            _Pragma("GCC unroll 6")                                                        \
            for (int r = 0; r < (R); r++) {                                                \
                const __m256 av = _mm256_broadcast_ss(ap + r);                             \
                c[r][0] = _mm256_fmadd_ps(av, b0, c[r][0]);                                \
                c[r][1] = _mm256_fmadd_ps(av, b1, c[r][1]);                                \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 6")                                                            \
        for (int r = 0; r < (R); r++)                                                      \
            tn_add_f32(acc + (i + r) * ldacc + j, _mm256_mul_ps(va, c[r][0]),              \
                       _mm256_mul_ps(va, c[r][1]), full, rem);                             \
    } while (0)

/* acc[0..rem) += (double) the 16 floats of s0, s1 */
AVX2 static inline void tn_add_f32(double *ar, __m256 s0, __m256 s1, int full, int rem)
{
    if (full) {
        _mm256_storeu_pd(ar, _mm256_add_pd(_mm256_loadu_pd(ar),
                                           _mm256_cvtps_pd(_mm256_castps256_ps128(s0))));
        _mm256_storeu_pd(ar + 4, _mm256_add_pd(_mm256_loadu_pd(ar + 4),
                                               _mm256_cvtps_pd(_mm256_extractf128_ps(s0, 1))));
        _mm256_storeu_pd(ar + 8, _mm256_add_pd(_mm256_loadu_pd(ar + 8),
                                               _mm256_cvtps_pd(_mm256_castps256_ps128(s1))));
        _mm256_storeu_pd(ar + 12, _mm256_add_pd(_mm256_loadu_pd(ar + 12),
                                                _mm256_cvtps_pd(_mm256_extractf128_ps(s1, 1))));
    } else {
        float t[16];
        _mm256_storeu_ps(t, s0);
        _mm256_storeu_ps(t + 8, s1);
        for (int e = 0; e < rem; e++)
            ar[e] += (double)t[e];
    }
}

AVX2 static void gemm_tn_acc_f32_avx2(int64_t M, int64_t N, int64_t K, float alpha,
                                      const float *A, int64_t lda, const float *B, int64_t ldb,
                                      double *acc, int64_t ldacc)
{
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256 va = _mm256_set1_ps(alpha);
    /* rows of C outermost: a block's 6 columns of A stay in L1 across B's
     * panels (B, a tile's chunk of dO or Q rows, stays there too) */
    for (int64_t i = 0; i < M; i += 6) {
        const int R = M - i < 6 ? (int)(M - i) : 6;
        for (int64_t j = 0; j < N; j += 16) {
            const int rem = N - j < 16 ? (int)(N - j) : 16;
            const int full = rem == 16;
            const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem), lanes);
            const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(rem - 8), lanes);
            if (full && R == 6)   /* the common block: no masks, no switch */
                TN_BLOCK(6, 1);
            else
                switch (R) {
                case 6: TN_BLOCK(6, 0); break;
                case 5: TN_BLOCK(5, 0); break;
                case 4: TN_BLOCK(4, 0); break;
                case 3: TN_BLOCK(3, 0); break;
                case 2: TN_BLOCK(2, 0); break;
                default: TN_BLOCK(1, 0); break;
                }
        }
    }
}
#undef TN_BLOCK

/* The same for doubles: 6 rows x 8 columns, the sums in double. */
#define TN_BLOCK_D(R, FULL)                                                                \
    do {                                                                                   \
        __m256d c[R][2];                                                                   \
        _Pragma("GCC unroll 6")                                                            \
        for (int r = 0; r < (R); r++)                                                      \
            c[r][0] = c[r][1] = _mm256_setzero_pd();                                       \
        for (int64_t p = 0; p < K; p++) {                                                  \
            const double *bp = B + p * ldb + j;                                            \
            const __m256d b0 = (FULL) ? _mm256_loadu_pd(bp) : _mm256_maskload_pd(bp, m0);  \
            const __m256d b1 = (FULL) ? _mm256_loadu_pd(bp + 4) : _mm256_maskload_pd(bp + 4, m1); \
            const double *ap = A + p * lda + i;                                            \
            _Pragma("GCC unroll 6")                                                        \
            for (int r = 0; r < (R); r++) {                                                \
                const __m256d av = _mm256_broadcast_sd(ap + r);                            \
                c[r][0] = _mm256_fmadd_pd(av, b0, c[r][0]);                                \
                c[r][1] = _mm256_fmadd_pd(av, b1, c[r][1]);                                \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 6")                                                            \
        for (int r = 0; r < (R); r++) {                                                    \
            double *ar = acc + (i + r) * ldacc + j;                                        \
            const __m256d s0 = _mm256_mul_pd(va, c[r][0]), s1 = _mm256_mul_pd(va, c[r][1]); \
            if (full) {                                                                    \
                _mm256_storeu_pd(ar, _mm256_add_pd(_mm256_loadu_pd(ar), s0));              \
                _mm256_storeu_pd(ar + 4, _mm256_add_pd(_mm256_loadu_pd(ar + 4), s1));      \
            } else {                                                                       \
                double t[8];                                                               \
                _mm256_storeu_pd(t, s0);                                                   \
                _mm256_storeu_pd(t + 4, s1);                                               \
                for (int e = 0; e < rem; e++)                                              \
                    ar[e] += t[e];                                                         \
            }                                                                              \
        }                                                                                  \
    } while (0)

AVX2 static void gemm_tn_acc_f64_avx2(int64_t M, int64_t N, int64_t K, double alpha,
                                      const double *A, int64_t lda, const double *B, int64_t ldb,
                                      double *acc, int64_t ldacc)
{
    const __m256i lanes = _mm256_setr_epi64x(0, 1, 2, 3);
    const __m256d va = _mm256_set1_pd(alpha);
    for (int64_t i = 0; i < M; i += 6) {   /* as the float version */
        const int R = M - i < 6 ? (int)(M - i) : 6;
        for (int64_t j = 0; j < N; j += 8) {
            const int rem = N - j < 8 ? (int)(N - j) : 8;
            const int full = rem == 8;
            const __m256i m0 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(rem), lanes);
            const __m256i m1 = _mm256_cmpgt_epi64(_mm256_set1_epi64x(rem - 4), lanes);
            if (full && R == 6)
                TN_BLOCK_D(6, 1);
            else
                switch (R) {
                case 6: TN_BLOCK_D(6, 0); break;
                case 5: TN_BLOCK_D(5, 0); break;
                case 4: TN_BLOCK_D(4, 0); break;
                case 3: TN_BLOCK_D(3, 0); break;
                case 2: TN_BLOCK_D(2, 0); break;
                default: TN_BLOCK_D(1, 0); break;
                }
        }
    }
}
#undef TN_BLOCK_D

static const fa_rowops avx2_ops = {
    rowmax_f32_avx2, rowmax_f64_avx2,
    expsub_sum_f32_avx2, expsub_sum_f64_avx2,
    expsub_masked_f32_avx2, expsub_masked_f64_avx2,
    mask_bool_f32_avx2, mask_bool_f64_avx2,
    exp_f32_avx2, exp_f64_avx2,
    small_qk_f32, small_qk_f64,
    small_pv_f32, small_pv_f64,
    pack_kt_f32, pack_kt_f64,
    pack_v_f32, pack_v_f64,
    gemm_pb_f32, gemm_pb_f64,
    bwd_ds_f32_avx2, bwd_ds_f64_avx2,
    bwd_acc_f32_avx2, bwd_acc_f64_avx2,
    bwd_store_f32_avx2, bwd_store_f64_avx2,
    scale_f32_avx2, scale_f64_avx2,
    dot64_f32_avx2, dot64_f64_avx2,
    gemm_tn_acc_f32_avx2, gemm_tn_acc_f64_avx2,
};

#include "fa_avx512_math.h"

AVX512 static inline __m256 hi256_f32z(__m512 v)
{
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
}

AVX512 static inline __m512 join256_f32z(__m256 lo, __m256 hi)
{
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(lo)),
                                               _mm256_castps_pd(hi), 1));
}

/* 16 at a time, the two halves added to AVX2's 8 lane sums in its order */
AVX512 static float expsub_sum_f32_avx512(float *x, int64_t n, float m)
{
    const __m512 vm = _mm512_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 e = exp16_nonpos_f32(_mm512_sub_ps(_mm512_loadu_ps(x + j), vm));
        _mm512_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, hi256_f32z(e));
    }
    return expsub_sum_f32_from(x, j, n, m, acc);
}

AVX512 static float expsub_masked_f32_avx512(float *x, int64_t n, float m)
{
    const __m512 vm = _mm512_set1_ps(m), dead = _mm512_set1_ps(FA_EXP_DEAD_F32);
    __m256 acc = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 v = _mm512_sub_ps(_mm512_loadu_ps(x + j), vm);
        __mmask16 keep = _mm512_cmp_ps_mask(v, dead, _CMP_NLT_UQ);   /* NaN: kept */
        __m512 e = _mm512_maskz_mov_ps(keep, exp16_nonpos_f32(_mm512_maskz_mov_ps(keep, v)));
        _mm512_storeu_ps(x + j, e);
        acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
        acc = _mm256_add_ps(acc, hi256_f32z(e));
    }
    return expsub_masked_f32_from(x, j, n, m, acc);
}

/* The backward's elementwise steps, 16 floats at a time (the AVX2 ones'
 * roundings, element for element). */
AVX512 static void bwd_ds_f32_avx512(const float *p, float *g, double dr, int64_t n)
{
    const __m512d d = _mm512_set1_pd(dr);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 gv = _mm512_loadu_ps(g + j);
        __m512d lo = _mm512_sub_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(gv)), d);
        __m512d hi = _mm512_sub_pd(_mm512_cvtps_pd(hi256_f32z(gv)), d);
        __m512 diff = join256_f32z(_mm512_cvtpd_ps(lo), _mm512_cvtpd_ps(hi));
        _mm512_storeu_ps(g + j, _mm512_mul_ps(_mm512_loadu_ps(p + j), diff));
    }
    bwd_ds_f32_avx2(p + j, g + j, dr, n - j);
}

AVX512 static void bwd_acc_f32_avx512(double *acc, const float *t, int64_t n)
{
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
        __m512 tv = _mm512_loadu_ps(t + j);
        _mm512_storeu_pd(acc + j, _mm512_add_pd(_mm512_loadu_pd(acc + j),
                                                _mm512_cvtps_pd(_mm512_castps512_ps256(tv))));
        _mm512_storeu_pd(acc + j + 8, _mm512_add_pd(_mm512_loadu_pd(acc + j + 8),
                                                    _mm512_cvtps_pd(hi256_f32z(tv))));
    }
    bwd_acc_f32_avx2(acc + j, t + j, n - j);
}

AVX512 static void bwd_acc_f64_avx512(double *acc, const double *t, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm512_storeu_pd(acc + j, _mm512_add_pd(_mm512_loadu_pd(acc + j), _mm512_loadu_pd(t + j)));
    bwd_acc_f64_avx2(acc + j, t + j, n - j);
}

AVX512 static void bwd_store_f32_avx512(float *y, const double *acc, int64_t n)
{
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(y + j, join256_f32z(_mm512_cvtpd_ps(_mm512_loadu_pd(acc + j)),
                                             _mm512_cvtpd_ps(_mm512_loadu_pd(acc + j + 8))));
    bwd_store_f32_avx2(y + j, acc + j, n - j);
}

AVX512 static void scale_f32_avx512(float *x, int64_t n, float f)
{
    const __m512 fv = _mm512_set1_ps(f);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        _mm512_storeu_ps(x + j, _mm512_mul_ps(_mm512_loadu_ps(x + j), fv));
    scale_f32_avx2(x + j, n - j, f);
}

AVX512 static void scale_f64_avx512(double *x, int64_t n, double f)
{
    const __m512d fv = _mm512_set1_pd(f);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm512_storeu_pd(x + j, _mm512_mul_pd(_mm512_loadu_pd(x + j), fv));
    scale_f64_avx2(x + j, n - j, f);
}

/* gemm_tn_acc on 512-bit vectors: blocks of up to 8 rows of C x 32 float (16
 * double) columns, 16 FMA chains, the same chain per output as the AVX2
 * kernel's (each output from zero over the K terms in order, alpha times the
 * sum rounded to the type, added to acc in double), so the same bits; the
 * column tail by masks. */
#define TNZ_BLOCK(R)                                                                       \
    do {                                                                                   \
        __m512 c[R][2];                                                                    \
        _Pragma("GCC unroll 8")                                                            \
        for (int r = 0; r < (R); r++)                                                      \
            c[r][0] = c[r][1] = _mm512_setzero_ps();                                       \
        for (int64_t p = 0; p < K; p++) {                                                  \
            const float *bp = B + p * ldb + j;                                             \
            const __m512 b0 = _mm512_maskz_loadu_ps(k0m, bp);                              \
            const __m512 b1 = _mm512_maskz_loadu_ps(k1m, bp + 16);                         \
            const float *ap = A + p * lda + i;                                             \
            _Pragma("GCC unroll 8")                                                        \
            for (int r = 0; r < (R); r++) {                                                \
                const __m512 av = _mm512_set1_ps(ap[r]);                                   \
                c[r][0] = _mm512_fmadd_ps(av, b0, c[r][0]);                                \
                c[r][1] = _mm512_fmadd_ps(av, b1, c[r][1]);                                \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 8")                                                            \
        for (int r = 0; r < (R); r++) {                                                    \
            double *ar = acc + (i + r) * ldacc + j;                                        \
            const __m512 s0 = _mm512_mul_ps(va, c[r][0]), s1 = _mm512_mul_ps(va, c[r][1]); \
            tnz_add4(ar, s0, s1, k0m, k1m);                                                \
        }                                                                                  \
    } while (0)

/* ar[0..32) += (double) s0, s1 where the masks (16 columns each) allow */
AVX512 static inline void tnz_add4(double *ar, __m512 s0, __m512 s1, __mmask16 k0m,
                                   __mmask16 k1m)
{
    const __m512d d0 = _mm512_cvtps_pd(_mm512_castps512_ps256(s0));
    const __m512d d1 = _mm512_cvtps_pd(hi256_f32z(s0));
    const __m512d d2 = _mm512_cvtps_pd(_mm512_castps512_ps256(s1));
    const __m512d d3 = _mm512_cvtps_pd(hi256_f32z(s1));
    const __mmask8 m0 = (__mmask8)(k0m & 0xFF), m1 = (__mmask8)(k0m >> 8);
    const __mmask8 m2 = (__mmask8)(k1m & 0xFF), m3 = (__mmask8)(k1m >> 8);
    _mm512_mask_storeu_pd(ar, m0, _mm512_add_pd(_mm512_maskz_loadu_pd(m0, ar), d0));
    _mm512_mask_storeu_pd(ar + 8, m1, _mm512_add_pd(_mm512_maskz_loadu_pd(m1, ar + 8), d1));
    _mm512_mask_storeu_pd(ar + 16, m2, _mm512_add_pd(_mm512_maskz_loadu_pd(m2, ar + 16), d2));
    _mm512_mask_storeu_pd(ar + 24, m3, _mm512_add_pd(_mm512_maskz_loadu_pd(m3, ar + 24), d3));
}

AVX512 static void gemm_tn_acc_f32_avx512(int64_t M, int64_t N, int64_t K, float alpha,
                                          const float *A, int64_t lda, const float *B,
                                          int64_t ldb, double *acc, int64_t ldacc)
{
    const __m512 va = _mm512_set1_ps(alpha);
    for (int64_t i = 0; i < M; i += 8) {   /* rows outermost, as the AVX2 kernel */
        const int R = M - i < 8 ? (int)(M - i) : 8;
        for (int64_t j = 0; j < N; j += 32) {
            const __mmask16 k0m = mask16(N - j), k1m = mask16(N - j - 16);
            switch (R) {
            case 8: TNZ_BLOCK(8); break;
            case 7: TNZ_BLOCK(7); break;
            case 6: TNZ_BLOCK(6); break;
            case 5: TNZ_BLOCK(5); break;
            case 4: TNZ_BLOCK(4); break;
            case 3: TNZ_BLOCK(3); break;
            case 2: TNZ_BLOCK(2); break;
            default: TNZ_BLOCK(1); break;
            }
        }
    }
}
#undef TNZ_BLOCK

#define TNZ_BLOCK_D(R)                                                                     \
    do {                                                                                   \
        __m512d c[R][2];                                                                   \
        _Pragma("GCC unroll 8")                                                            \
        for (int r = 0; r < (R); r++)                                                      \
            c[r][0] = c[r][1] = _mm512_setzero_pd();                                       \
        for (int64_t p = 0; p < K; p++) {                                                  \
            const double *bp = B + p * ldb + j;                                            \
            const __m512d b0 = _mm512_maskz_loadu_pd(k0m, bp);                             \
            const __m512d b1 = _mm512_maskz_loadu_pd(k1m, bp + 8);                         \
            const double *ap = A + p * lda + i;                                            \
            _Pragma("GCC unroll 8")                                                        \
            for (int r = 0; r < (R); r++) {                                                \
                const __m512d av = _mm512_set1_pd(ap[r]);                                  \
                c[r][0] = _mm512_fmadd_pd(av, b0, c[r][0]);                                \
                c[r][1] = _mm512_fmadd_pd(av, b1, c[r][1]);                                \
            }                                                                              \
        }                                                                                  \
        _Pragma("GCC unroll 8")                                                            \
        for (int r = 0; r < (R); r++) {                                                    \
            double *ar = acc + (i + r) * ldacc + j;                                        \
            _mm512_mask_storeu_pd(ar, k0m, _mm512_add_pd(_mm512_maskz_loadu_pd(k0m, ar),   \
                                                         _mm512_mul_pd(va, c[r][0])));     \
            _mm512_mask_storeu_pd(ar + 8, k1m,                                             \
                                  _mm512_add_pd(_mm512_maskz_loadu_pd(k1m, ar + 8),        \
                                                _mm512_mul_pd(va, c[r][1])));              \
        }                                                                                  \
    } while (0)

AVX512 static void gemm_tn_acc_f64_avx512(int64_t M, int64_t N, int64_t K, double alpha,
                                          const double *A, int64_t lda, const double *B,
                                          int64_t ldb, double *acc, int64_t ldacc)
{
    const __m512d va = _mm512_set1_pd(alpha);
    for (int64_t i = 0; i < M; i += 8) {
        const int R = M - i < 8 ? (int)(M - i) : 8;
        for (int64_t j = 0; j < N; j += 16) {
            const __mmask8 k0m = mask8(N - j), k1m = mask8(N - j - 8);
            switch (R) {
            case 8: TNZ_BLOCK_D(8); break;
            case 7: TNZ_BLOCK_D(7); break;
            case 6: TNZ_BLOCK_D(6); break;
            case 5: TNZ_BLOCK_D(5); break;
            case 4: TNZ_BLOCK_D(4); break;
            case 3: TNZ_BLOCK_D(3); break;
            case 2: TNZ_BLOCK_D(2); break;
            default: TNZ_BLOCK_D(1); break;
            }
        }
    }
}
#undef TNZ_BLOCK_D

static const fa_rowops avx512_ops = {
    rowmax_f32_avx2, rowmax_f64_avx2,
    expsub_sum_f32_avx512, expsub_sum_f64_avx2,
    expsub_masked_f32_avx512, expsub_masked_f64_avx2,
    mask_bool_f32_avx2, mask_bool_f64_avx2,
    exp_f32_avx2, exp_f64_avx2,
    small_qk_f32z, small_qk_f64z,
    small_pv_f32z, small_pv_f64z,
    pack_kt_f32z, pack_kt_f64z,
    pack_v_f32z, pack_v_f64z,
    gemm_pb_f32z, gemm_pb_f64z,
    bwd_ds_f32_avx512, bwd_ds_f64_avx2,
    bwd_acc_f32_avx512, bwd_acc_f64_avx512,
    bwd_store_f32_avx512, bwd_store_f64_avx2,
    scale_f32_avx512, scale_f64_avx512,
    dot64_f32_avx2, dot64_f64_avx2,
    gemm_tn_acc_f32_avx512, gemm_tn_acc_f64_avx512,
};

/* The FMA throughput probe (fa_fma_probe): 12 independent chains, enough to
 * keep two FMA pipes of latency 4-5 busy; 192 flops an iteration. */
AVX2 static float fma_probe_avx2(int64_t n)
{
    __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(1e-6f);
    __m256 a0 = _mm256_set1_ps(0.1f), a1 = _mm256_set1_ps(0.2f), a2 = _mm256_set1_ps(0.3f);
    __m256 a3 = _mm256_set1_ps(0.4f), a4 = _mm256_set1_ps(0.5f), a5 = _mm256_set1_ps(0.6f);
    __m256 a6 = _mm256_set1_ps(0.7f), a7 = _mm256_set1_ps(0.8f), a8 = _mm256_set1_ps(0.9f);
    __m256 a9 = _mm256_set1_ps(1.0f), a10 = _mm256_set1_ps(1.1f), a11 = _mm256_set1_ps(1.2f);
    for (int64_t i = 0; i < n; i++) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c);
        a2 = _mm256_fmadd_ps(a2, b, c); a3 = _mm256_fmadd_ps(a3, b, c);
        a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
        a8 = _mm256_fmadd_ps(a8, b, c); a9 = _mm256_fmadd_ps(a9, b, c);
        a10 = _mm256_fmadd_ps(a10, b, c); a11 = _mm256_fmadd_ps(a11, b, c);
    }
    __m256 t = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    t = _mm256_add_ps(t, _mm256_add_ps(_mm256_add_ps(a8, a9), _mm256_add_ps(a10, a11)));
    return hsum8(t);
}

/* The FMA probe with 512-bit vectors: 12 chains, 384 flops an iteration. */
AVX512 static float fma_probe_avx512(int64_t n)
{
    __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(1e-6f);
    __m512 a[12];
    for (int i = 0; i < 12; i++)
        a[i] = _mm512_set1_ps(0.1f * (float)(i + 1));
    for (int64_t i = 0; i < n; i++) {
        _Pragma("GCC unroll 12")
        for (int r = 0; r < 12; r++)
            a[r] = _mm512_fmadd_ps(a[r], b, c);
    }
    __m512 t = a[0];
    for (int r = 1; r < 12; r++)
        t = _mm512_add_ps(t, a[r]);
    return _mm512_reduce_add_ps(t);
}

/* 0: no usable SIMD, 1: AVX2 + FMA, 2: also AVX512F (libgcc's check
 * includes the OS saving the vector state) */
static int cpu_simd_level(void)
{
    __builtin_cpu_init();
    if (!(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")))
        return 0;
    return __builtin_cpu_supports("avx512f") ? 2 : 1;
}
#else
#define FA_HAVE_AVX2_CODE 0
#endif

/* --------------------------------------------------------------- dispatch */

static int simd_disabled = 0;
static int simd_max_level = 2;

int fa_simd_compiled(void) { return FA_HAVE_AVX2_CODE; }

/* The table in use: 0 scalar, 1 AVX2, 2 AVX-512 products (the CPU's level,
 * capped by fa_simd_set_max_level; 0 while disabled). */
int fa_simd_level(void)
{
#if FA_HAVE_AVX2_CODE
    static int detected = -1;
    if (detected < 0)
        detected = cpu_simd_level();
    if (simd_disabled)
        return 0;
    return detected < simd_max_level ? detected : simd_max_level;
#else
    return 0;
#endif
}

int fa_simd_active(void) { return fa_simd_level() > 0; }

void fa_simd_set_disabled(int disable) { simd_disabled = disable != 0; }

void fa_simd_set_max_level(int level) { simd_max_level = level < 0 ? 0 : level > 2 ? 2 : level; }

int fa_simd_max_level(void) { return simd_max_level; }

const fa_rowops *fa_get_rowops(void)
{
#if FA_HAVE_AVX2_CODE
    int level = fa_simd_level();
    if (level >= 2)
        return &avx512_ops;
    if (level == 1)
        return &avx2_ops;
#endif
    return &scalar_ops;
}

void fa_exp_f32(const float *x, float *y, int64_t n) { fa_get_rowops()->exp_f32(x, y, n); }
void fa_exp_f64(const double *x, double *y, int64_t n) { fa_get_rowops()->exp_f64(x, y, n); }
float fa_expsub_sum_f32(float *x, int64_t n, float m) { return fa_get_rowops()->expsub_sum_f32(x, n, m); }
double fa_expsub_sum_f64(double *x, int64_t n, double m) { return fa_get_rowops()->expsub_sum_f64(x, n, m); }
float fa_expsub_masked_f32(float *x, int64_t n, float m) { return fa_get_rowops()->expsub_masked_f32(x, n, m); }
double fa_expsub_masked_f64(double *x, int64_t n, double m) { return fa_get_rowops()->expsub_masked_f64(x, n, m); }

double fa_fma_probe(int64_t n, float *sink)
{
#if FA_HAVE_AVX2_CODE
    int level = fa_simd_level();
    if (level >= 2) {
        *sink = fma_probe_avx512(n);
        return 384.0 * (double)n;
    }
    if (level == 1) {
        *sink = fma_probe_avx2(n);
        return 192.0 * (double)n;
    }
#endif
    *sink = 0.0f;
    return 0.0;
}
