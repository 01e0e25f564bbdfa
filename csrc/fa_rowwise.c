/*
 * Row-wise and elementwise kernels of the training ops; see fa_rowwise.h.
 *
 * Portable C: the elementwise loops are left to the compiler's
 * vectorisation; the row sums use four independent accumulators (a fixed
 * order, so a row's result is the same on every machine this build runs on),
 * in double.  These ops read and write each element a few times and are
 * bound by memory and the conversions, not by arithmetic.
 */
#include <math.h>
#include <string.h>

#include "fa_rowwise.h"

#define FA_GOLDEN 0x9E3779B97F4A7C15ULL

/* ------------------------------------------------------------ layer norm */

#define LN_DEFINE(SFX, T)                                                            \
static void ln_stats_##SFX(int64_t E, const T *x, double eps, double *mean, double *rstd) \
{                                                                                    \
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                           \
    int64_t j = 0;                                                                   \
    for (; j + 4 <= E; j += 4) {                                                     \
        s0 += (double)x[j];                                                          \
        s1 += (double)x[j + 1];                                                      \
        s2 += (double)x[j + 2];                                                      \
        s3 += (double)x[j + 3];                                                      \
    }                                                                                \
    for (; j < E; j++)                                                               \
        s0 += (double)x[j];                                                          \
    double m = ((s0 + s1) + (s2 + s3)) / (double)E;                                  \
    double v0 = 0, v1 = 0, v2 = 0, v3 = 0;                                           \
    for (j = 0; j + 4 <= E; j += 4) {                                                \
        double a = (double)x[j] - m, b = (double)x[j + 1] - m;                       \
        double c = (double)x[j + 2] - m, d = (double)x[j + 3] - m;                   \
        v0 += a * a;                                                                 \
        v1 += b * b;                                                                 \
        v2 += c * c;                                                                 \
        v3 += d * d;                                                                 \
    }                                                                                \
    for (; j < E; j++) {                                                             \
        double a = (double)x[j] - m;                                                 \
        v0 += a * a;                                                                 \
    }                                                                                \
    double var = ((v0 + v1) + (v2 + v3)) / (double)E;                                \
    *mean = m;                                                                       \
    *rstd = 1.0 / sqrt(var + eps);                                                   \
}                                                                                    \
                                                                                     \
static void ln_fwd_scalar_##SFX(int64_t rows, int64_t E, const T *x, int64_t ldx,   \
                     const T *w, const T *b, double eps, T *y, int64_t ldy)         \
{                                                                                    \
    for (int64_t r = 0; r < rows; r++) {                                             \
        const T *xr = x + r * ldx;                                                   \
        T *yr = y + r * ldy;                                                         \
        double m, rs;                                                                \
        ln_stats_##SFX(E, xr, eps, &m, &rs);                                         \
        if (w && b) {                                                                \
            for (int64_t j = 0; j < E; j++)                                          \
                yr[j] = (T)(((double)xr[j] - m) * rs * (double)w[j] + (double)b[j]); \
        } else if (w) {                                                              \
            for (int64_t j = 0; j < E; j++)                                          \
                yr[j] = (T)(((double)xr[j] - m) * rs * (double)w[j]);                \
        } else if (b) {                                                              \
            for (int64_t j = 0; j < E; j++)                                          \
                yr[j] = (T)(((double)xr[j] - m) * rs + (double)b[j]);                \
        } else {                                                                     \
            for (int64_t j = 0; j < E; j++)                                          \
                yr[j] = (T)(((double)xr[j] - m) * rs);                               \
        }                                                                            \
    }                                                                                \
}                                                                                    \
                                                                                     \
static void ln_bwd_scalar_##SFX(int64_t rows, int64_t E, const T *g, int64_t ldg,   \
                     const T *x, int64_t ldx, const T *w, double eps, T *dx,         \
                     int64_t lddx, double *dw_acc, double *db_acc)                   \
{                                                                                    \
    for (int64_t r = 0; r < rows; r++) {                                             \
        const T *xr = x + r * ldx, *gr = g + r * ldg;                                \
        T *dr = dx + r * lddx;                                                       \
        double m, rs;                                                                \
        ln_stats_##SFX(E, xr, eps, &m, &rs);                                         \
        /* four sums each, element j into sum j % 4 (the AVX2 lanes' order) */     \
        double a[4] = {0, 0, 0, 0}, cs[4] = {0, 0, 0, 0};                            \
        int64_t j = 0;                                                               \
        for (; j + 4 <= E; j += 4)                                                   \
            for (int q = 0; q < 4; q++) {                                            \
                double xh = ((double)xr[j + q] - m) * rs, g0 = (double)gr[j + q];    \
                if (w)                                                               \
                    g0 *= (double)w[j + q];                                          \
                a[q] += g0;                                                          \
                cs[q] += g0 * xh;                                                    \
            }                                                                        \
        for (; j < E; j++) {                                                         \
            double xh = ((double)xr[j] - m) * rs, g0 = (double)gr[j];                \
            if (w)                                                                   \
                g0 *= (double)w[j];                                                  \
            a[0] += g0;                                                              \
            cs[0] += g0 * xh;                                                        \
        }                                                                            \
        double mg = ((a[0] + a[1]) + (a[2] + a[3])) / (double)E;                     \
        double mgx = ((cs[0] + cs[1]) + (cs[2] + cs[3])) / (double)E;                \
        for (j = 0; j < E; j++) {                                                    \
            double xh = ((double)xr[j] - m) * rs;                                    \
            double gh = w ? (double)gr[j] * (double)w[j] : (double)gr[j];            \
            dr[j] = (T)(rs * (gh - mg - xh * mgx));                                  \
        }                                                                            \
        if (dw_acc)                                                                  \
            for (j = 0; j < E; j++)                                                  \
                dw_acc[j] += (double)gr[j] * (((double)xr[j] - m) * rs);             \
        if (db_acc)                                                                  \
            for (j = 0; j < E; j++)                                                  \
                db_acc[j] += (double)gr[j];                                          \
    }                                                                                \
}

LN_DEFINE(f32, float)
LN_DEFINE(f64, double)

/* ------------------------------------------------------------ dropout */

static inline uint64_t splitmix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define FA_RW_AVX2 1
/* The same stream, four pairs (eight elements) a step: splitmix64 in 64-bit
 * lanes, its multiplications by constants from 32 x 32 -> 64-bit products
 * (AVX2 has no 64-bit multiply), the low and high halves compared with the
 * threshold and the eight bytes stored in element order.  Bit for bit the
 * scalar loop's bytes. */
static __attribute__((target("avx2"))) inline __m256i mul64c(__m256i a, uint64_t c)
{
    const __m256i cl = _mm256_set1_epi64x((int64_t)(c & 0xFFFFFFFFULL));
    const __m256i ch = _mm256_set1_epi64x((int64_t)(c >> 32));
    const __m256i lo = _mm256_mul_epu32(a, cl);
    const __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), cl),
                                           _mm256_mul_epu32(a, ch));
    return _mm256_add_epi64(lo, _mm256_slli_epi64(cross, 32));
}

static __attribute__((target("avx2"))) inline __m256i splitmix64x4(__m256i z)
{
    z = mul64c(_mm256_xor_si256(z, _mm256_srli_epi64(z, 30)), 0xBF58476D1CE4E5B9ULL);
    z = mul64c(_mm256_xor_si256(z, _mm256_srli_epi64(z, 27)), 0x94D049BB133111EBULL);
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

/* pairs [k0, k0 + 4 n) of the stream into keep[2 k0 ...]; threshold <= 2^32 */
static __attribute__((target("avx2"))) void dropout_pairs_avx2(int64_t k0, int64_t n,
                                                                 uint64_t seed,
                                                                 uint64_t threshold,
                                                                 uint8_t *keep)
{
    const __m256i thr = _mm256_set1_epi64x((int64_t)threshold);
    const __m256i low = _mm256_set1_epi64x(0xFFFFFFFFLL);
    const __m256i step = _mm256_set1_epi64x((int64_t)(4 * FA_GOLDEN));
    /* counters seed + (k + 1) G for pairs k0 .. k0 + 3 */
    __m256i ctr = _mm256_setr_epi64x((int64_t)(seed + (uint64_t)(k0 + 1) * FA_GOLDEN),
                                     (int64_t)(seed + (uint64_t)(k0 + 2) * FA_GOLDEN),
                                     (int64_t)(seed + (uint64_t)(k0 + 3) * FA_GOLDEN),
                                     (int64_t)(seed + (uint64_t)(k0 + 4) * FA_GOLDEN));
    for (int64_t s = 0; s < n; s++) {
        const __m256i z = splitmix64x4(ctr);
        ctr = _mm256_add_epi64(ctr, step);
        /* halves as non-negative 64-bit values: signed compares are exact */
        const __m256i drop_lo = _mm256_cmpgt_epi64(thr, _mm256_and_si256(z, low));
        const __m256i drop_hi = _mm256_cmpgt_epi64(thr, _mm256_srli_epi64(z, 32));
        /* 32-bit lanes in element order: low half of pair k, then its high half */
        const __m256i drop = _mm256_blend_epi32(drop_lo, drop_hi, 0xAA);
        const unsigned bits = (unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(drop)) ^ 0xFFu;
        uint64_t bytes = 0;
        for (int e = 0; e < 8; e++)
            bytes |= (uint64_t)((bits >> e) & 1u) << (8 * e);
        memcpy(keep + 2 * (k0 + 4 * s), &bytes, 8);
    }
}

static int rw_has_avx2_fma(void)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") ? 1 : 0;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

static int rw_has_avx2(void)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx2") ? 1 : 0;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

/* Layer norm, float32, in double lanes of four: the scalar loops' operations
 * (element j in sum j % 4, no fused multiply-adds: target avx2 without fma)
 * in the same order, so the same bits as ln_*_scalar_f32. */
#define RW_AVX2 __attribute__((target("avx2")))
static RW_AVX2 inline __m256d ld4(const float *p)
{
    return _mm256_cvtps_pd(_mm_loadu_ps(p));
}

static RW_AVX2 void ln_stats_avx2(int64_t E, const float *x, double eps, double *mean,
                                  double *rstd)
{
    __m256d s = _mm256_setzero_pd();
    int64_t j = 0;
    for (; j + 4 <= E; j += 4)
        s = _mm256_add_pd(s, ld4(x + j));
    double t[4];
    _mm256_storeu_pd(t, s);
    for (; j < E; j++)
        t[0] += (double)x[j];
    const double m = ((t[0] + t[1]) + (t[2] + t[3])) / (double)E;
    const __m256d vm = _mm256_set1_pd(m);
    __m256d v = _mm256_setzero_pd();
    for (j = 0; j + 4 <= E; j += 4) {
        const __m256d a = _mm256_sub_pd(ld4(x + j), vm);
        v = _mm256_add_pd(v, _mm256_mul_pd(a, a));
    }
    _mm256_storeu_pd(t, v);
    for (; j < E; j++) {
        double a = (double)x[j] - m;
        t[0] += a * a;
    }
    const double var = ((t[0] + t[1]) + (t[2] + t[3])) / (double)E;
    *mean = m;
    *rstd = 1.0 / sqrt(var + eps);
}

static RW_AVX2 void ln_fwd_avx2_f32(int64_t rows, int64_t E, const float *x, int64_t ldx,
                                    const float *w, const float *b, double eps, float *y,
                                    int64_t ldy)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
        double m, rs;
        ln_stats_avx2(E, xr, eps, &m, &rs);
        const __m256d vm = _mm256_set1_pd(m), vr = _mm256_set1_pd(rs);
        int64_t j = 0;
        for (; j + 4 <= E; j += 4) {
            __m256d t = _mm256_mul_pd(_mm256_sub_pd(ld4(xr + j), vm), vr);
            if (w)
                t = _mm256_mul_pd(t, ld4(w + j));
            if (b)
                t = _mm256_add_pd(t, ld4(b + j));
            _mm_storeu_ps(yr + j, _mm256_cvtpd_ps(t));
        }
        for (; j < E; j++) {
            double t = ((double)xr[j] - m) * rs;
            if (w)
                t = t * (double)w[j];
            if (b)
                t = t + (double)b[j];
            yr[j] = (float)t;
        }
    }
}

static RW_AVX2 void ln_bwd_avx2_f32(int64_t rows, int64_t E, const float *g, int64_t ldg,
                                    const float *x, int64_t ldx, const float *w, double eps,
                                    float *dx, int64_t lddx, double *dw_acc, double *db_acc)
{
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * ldx, *gr = g + r * ldg;
        float *dr = dx + r * lddx;
        double m, rs;
        ln_stats_avx2(E, xr, eps, &m, &rs);
        const __m256d vm = _mm256_set1_pd(m), vr = _mm256_set1_pd(rs);
        __m256d va = _mm256_setzero_pd(), vc = va;
        int64_t j = 0;
        for (; j + 4 <= E; j += 4) {
            const __m256d xh = _mm256_mul_pd(_mm256_sub_pd(ld4(xr + j), vm), vr);
            __m256d g0 = ld4(gr + j);
            if (w)
                g0 = _mm256_mul_pd(g0, ld4(w + j));
            va = _mm256_add_pd(va, g0);
            vc = _mm256_add_pd(vc, _mm256_mul_pd(g0, xh));
        }
        double a[4], cs[4];
        _mm256_storeu_pd(a, va);
        _mm256_storeu_pd(cs, vc);
        for (; j < E; j++) {
            double xh = ((double)xr[j] - m) * rs, g0 = (double)gr[j];
            if (w)
                g0 *= (double)w[j];
            a[0] += g0;
            cs[0] += g0 * xh;
        }
        const double mg = ((a[0] + a[1]) + (a[2] + a[3])) / (double)E;
        const double mgx = ((cs[0] + cs[1]) + (cs[2] + cs[3])) / (double)E;
        const __m256d vmg = _mm256_set1_pd(mg), vmgx = _mm256_set1_pd(mgx);
        for (j = 0; j + 4 <= E; j += 4) {
            const __m256d xv = ld4(xr + j), gv = ld4(gr + j);
            const __m256d xh = _mm256_mul_pd(_mm256_sub_pd(xv, vm), vr);
            const __m256d gh = w ? _mm256_mul_pd(gv, ld4(w + j)) : gv;
            const __m256d d = _mm256_mul_pd(vr, _mm256_sub_pd(_mm256_sub_pd(gh, vmg),
                                                              _mm256_mul_pd(xh, vmgx)));
            _mm_storeu_ps(dr + j, _mm256_cvtpd_ps(d));
            if (dw_acc)
                _mm256_storeu_pd(dw_acc + j, _mm256_add_pd(_mm256_loadu_pd(dw_acc + j),
                                                           _mm256_mul_pd(gv, xh)));
            if (db_acc)
                _mm256_storeu_pd(db_acc + j, _mm256_add_pd(_mm256_loadu_pd(db_acc + j), gv));
        }
        for (; j < E; j++) {
            double xh = ((double)xr[j] - m) * rs;
            double gh = w ? (double)gr[j] * (double)w[j] : (double)gr[j];
            dr[j] = (float)(rs * (gh - mg - xh * mgx));
            if (dw_acc)
                dw_acc[j] += (double)gr[j] * (((double)xr[j] - m) * rs);
            if (db_acc)
                db_acc[j] += (double)gr[j];
        }
    }
}
#endif

void fa_ln_fwd_f32(int64_t rows, int64_t E, const float *x, int64_t ldx, const float *w,
                   const float *b, double eps, float *y, int64_t ldy, int simd)
{
#ifdef FA_RW_AVX2
    if (simd && rw_has_avx2()) {
        ln_fwd_avx2_f32(rows, E, x, ldx, w, b, eps, y, ldy);
        return;
    }
#endif
    (void)simd;
    ln_fwd_scalar_f32(rows, E, x, ldx, w, b, eps, y, ldy);
}

void fa_ln_fwd_f64(int64_t rows, int64_t E, const double *x, int64_t ldx, const double *w,
                   const double *b, double eps, double *y, int64_t ldy)
{
    ln_fwd_scalar_f64(rows, E, x, ldx, w, b, eps, y, ldy);
}

void fa_ln_bwd_f32(int64_t rows, int64_t E, const float *g, int64_t ldg, const float *x,
                   int64_t ldx, const float *w, double eps, float *dx, int64_t lddx,
                   double *dw_acc, double *db_acc, int simd)
{
#ifdef FA_RW_AVX2
    if (simd && rw_has_avx2()) {
        ln_bwd_avx2_f32(rows, E, g, ldg, x, ldx, w, eps, dx, lddx, dw_acc, db_acc);
        return;
    }
#endif
    (void)simd;
    ln_bwd_scalar_f32(rows, E, g, ldg, x, ldx, w, eps, dx, lddx, dw_acc, db_acc);
}

void fa_ln_bwd_f64(int64_t rows, int64_t E, const double *g, int64_t ldg, const double *x,
                   int64_t ldx, const double *w, double eps, double *dx, int64_t lddx,
                   double *dw_acc, double *db_acc)
{
    ln_bwd_scalar_f64(rows, E, g, ldg, x, ldx, w, eps, dx, lddx, dw_acc, db_acc);
}

static void dropout_mask(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold, uint8_t *keep,
                         int simd)
{
    int64_t i = i0;
    (void)simd;
    if (i < i1 && (i & 1)) {  /* an odd start: the high half of its pair */
        uint64_t z = splitmix64(seed + (uint64_t)(i / 2 + 1) * FA_GOLDEN);
        keep[i] = (uint8_t)((z >> 32) >= threshold);
        i++;
    }
#ifdef FA_RW_AVX2
    if (simd && i1 - i >= 8 && rw_has_avx2()) {   /* i is even here: pair i / 2 */
        const int64_t steps = (i1 - i) / 8;
        dropout_pairs_avx2(i / 2, steps, seed, threshold, keep);
        i += 8 * steps;
    }
#endif
    for (; i + 2 <= i1; i += 2) {
        uint64_t z = splitmix64(seed + (uint64_t)(i / 2 + 1) * FA_GOLDEN);
        keep[i] = (uint8_t)((z & 0xFFFFFFFFULL) >= threshold);
        keep[i + 1] = (uint8_t)((z >> 32) >= threshold);
    }
    if (i < i1) {
        uint64_t z = splitmix64(seed + (uint64_t)(i / 2 + 1) * FA_GOLDEN);
        keep[i] = (uint8_t)((z & 0xFFFFFFFFULL) >= threshold);
    }
}

#ifdef FA_RW_AVX2
#define RW_AVX512 __attribute__((target("avx512f,avx512dq,avx512bw,avx512vl,avx2")))

static int rw_has_avx512_drop(void)
{
    static int cached = -1;
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        __builtin_cpu_init();
        v = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")
            && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") ? 1 : 0;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

static RW_AVX512 inline __m512i splitmix64x8(__m512i z)
{
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 30)),
                           _mm512_set1_epi64((long long)0xBF58476D1CE4E5B9ULL));
    z = _mm512_mullo_epi64(_mm512_xor_si512(z, _mm512_srli_epi64(z, 27)),
                           _mm512_set1_epi64((long long)0x94D049BB133111EBULL));
    return _mm512_xor_si512(z, _mm512_srli_epi64(z, 31));
}

/* Elements [2 k0, 2 k0 + 16 n) of fa_dropout / fa_relu_dropout (float32, the
 * stream of dropout_pairs_avx2 eight pairs a step: the 64-bit draws' 32-bit
 * halves, low then high, are the sixteen 32-bit lanes in element order), the
 * mask bytes and y = x keep scale (relu: relu(x) keep scale) in the same pass
 * -- the same bytes and floats as the two loops.  threshold < 2^32. */
static RW_AVX512 void dropout16_avx512_f32(int64_t k0, int64_t n, uint64_t seed,
                                           uint64_t threshold, const float *x, float *y,
                                           float scale, uint8_t *keep, int relu)
{
    const __m512i thr = _mm512_set1_epi32((int)(uint32_t)threshold);
    const __m512i step = _mm512_set1_epi64((long long)(8 * FA_GOLDEN));
    const __m512 one = _mm512_set1_ps(1.0f), sc = _mm512_set1_ps(scale);
    const __m512 zero = _mm512_setzero_ps();
    __m512i ctr = _mm512_add_epi64(
        _mm512_set1_epi64((long long)(seed + (uint64_t)k0 * FA_GOLDEN)),
        _mm512_mullo_epi64(_mm512_setr_epi64(1, 2, 3, 4, 5, 6, 7, 8),
                           _mm512_set1_epi64((long long)FA_GOLDEN)));
    for (int64_t s = 0; s < n; s++) {
        const __m512i z = splitmix64x8(ctr);
        ctr = _mm512_add_epi64(ctr, step);
        const __mmask16 k = _mm512_cmpge_epu32_mask(z, thr);   /* kept: u >= threshold */
        const int64_t e = 2 * (k0 + 8 * s);
        _mm_storeu_si128((__m128i *)(keep + e), _mm_maskz_set1_epi8(k, 1));
        __m512 v = _mm512_loadu_ps(x + e);
        if (relu)   /* fa_relu's value: x if x > 0 or NaN, else 0 */
            v = _mm512_mask_mov_ps(zero, _mm512_cmp_ps_mask(v, zero, _CMP_NLE_UQ), v);
        _mm512_storeu_ps(y + e, _mm512_mul_ps(_mm512_mul_ps(v, _mm512_maskz_mov_ps(k, one)), sc));
    }
}
#endif

/* fa_dropout / fa_relu_dropout's float32 elements [i0, i1) on AVX-512 (simd
 * level 2) where it can: returns the first element left to the loops. */
static int64_t dropout_wide_f32(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                                const float *x, float *y, float scale, uint8_t *keep, int simd,
                                int relu)
{
#ifdef FA_RW_AVX2
    if (simd >= 2 && x && y && threshold <= 0xFFFFFFFFULL && i1 - i0 >= 32
        && rw_has_avx512_drop()) {
        int64_t i = i0;
        if (i & 1) {   /* an odd start: the loops take that element */
            dropout_mask(i, i + 1, seed, threshold, keep, 0);
            float r = relu ? ((x[i] > 0 || x[i] != x[i]) ? x[i] : 0.0f) : x[i];
            y[i] = r * (float)keep[i] * scale;
            i++;
        }
        const int64_t n = (i1 - i) / 16;
        dropout16_avx512_f32(i / 2, n, seed, threshold, x, y, scale, keep, relu);
        return i + 16 * n;
    }
#else
    (void)seed; (void)threshold; (void)x; (void)y; (void)scale; (void)keep; (void)simd;
    (void)relu; (void)i1;
#endif
    return i0;
}

#ifdef FA_RW_AVX2
/* fa_relu_mask_scale's float32 loop in eight lanes: (g keep) scale, then +0
 * where d <= 0 (an ordered compare: a NaN d passes the gradient) -- the same
 * floats, without the scalar loop's unpredictable branch. */
static __attribute__((target("avx2"))) int64_t relu_mask_scale_avx2_f32(
    int64_t n, const float *g, const uint8_t *keep, float scale, const float *d, float *out)
{
    const __m256 sc = _mm256_set1_ps(scale), zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t kb;
        memcpy(&kb, keep + i, 8);
        const __m256 k = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)kb)));
        const __m256 gi = _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(g + i), k), sc);
        const __m256 off = _mm256_cmp_ps(_mm256_loadu_ps(d + i), zero, _CMP_LE_OQ);
        _mm256_storeu_ps(out + i, _mm256_andnot_ps(off, gi));
    }
    return i;
}
#endif

static int64_t relu_mask_scale_wide_f32(int64_t n, const float *g, const uint8_t *keep,
                                        float scale, const float *d, float *out, int simd)
{
#ifdef FA_RW_AVX2
    if (simd && rw_has_avx2())
        return relu_mask_scale_avx2_f32(n, g, keep, scale, d, out);
#endif
    (void)n; (void)g; (void)keep; (void)scale; (void)d; (void)out; (void)simd;
    return 0;
}

#define DROPOUT_DEFINE(SFX, T)                                                       \
void fa_dropout_##SFX(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,     \
                      const T *x, T *y, T scale, uint8_t *keep, int simd)            \
{                                                                                    \
    if (sizeof(T) == 4)                                                              \
        i0 = dropout_wide_f32(i0, i1, seed, threshold, (const float *)x, (float *)y, \
                              (float)scale, keep, simd, 0);                          \
    dropout_mask(i0, i1, seed, threshold, keep, simd);                               \
    if (x && y)                                                                      \
        for (int64_t i = i0; i < i1; i++)                                            \
            y[i] = x[i] * (T)keep[i] * scale;  /* NaN * 0 stays NaN, as x * mask */ \
}                                                                                    \
                                                                                     \
void fa_relu_dropout_##SFX(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold, \
                           const T *x, T *y, T scale, uint8_t *keep, int simd)       \
{                                                                                    \
    if (sizeof(T) == 4)                                                              \
        i0 = dropout_wide_f32(i0, i1, seed, threshold, (const float *)x, (float *)y, \
                              (float)scale, keep, simd, 1);                          \
    dropout_mask(i0, i1, seed, threshold, keep, simd);                               \
    for (int64_t i = i0; i < i1; i++) {                                              \
        T xi = x[i];                                                                 \
        T r = (xi > 0 || xi != xi) ? xi : (T)0;   /* fa_relu's value */              \
        y[i] = r * (T)keep[i] * scale;            /* fa_dropout's product */         \
    }                                                                                \
}                                                                                    \
                                                                                     \
void fa_relu_mask_scale_##SFX(int64_t n, const T *g, const uint8_t *keep, T scale,  \
                              const T *d, T *out, int simd)                          \
{                                                                                    \
    int64_t i0 = 0;                                                                  \
    if (sizeof(T) == 4)                                                              \
        i0 = relu_mask_scale_wide_f32(n, (const float *)g, keep, (float)scale,       \
                                      (const float *)d, (float *)out, simd);         \
    for (int64_t i = i0; i < n; i++) {                                               \
        T gi = g[i] * (T)keep[i] * scale, di = d[i];  /* fa_mask_scale's value */    \
        out[i] = di <= 0 ? (T)0 : gi;                 /* then fa_relu_bwd's */       \
    }                                                                                \
}                                                                                    \
                                                                                     \
void fa_mask_scale_##SFX(int64_t n, const T *g, const uint8_t *keep, T scale, T *out) \
{                                                                                    \
    for (int64_t i = 0; i < n; i++)                                                  \
        out[i] = g[i] * (T)keep[i] * scale;                                          \
}                                                                                    \
                                                                                     \
void fa_relu_##SFX(int64_t n, const T *x, T *out)                                   \
{                                                                                    \
    for (int64_t i = 0; i < n; i++) {                                                \
        T xi = x[i];                                                                 \
        out[i] = (xi > 0 || xi != xi) ? xi : (T)0;  /* np.maximum(x, 0): NaN kept, -0 -> +0 */ \
    }                                                                                \
}                                                                                    \
                                                                                     \
void fa_relu_bwd_##SFX(int64_t n, const T *g, const T *x, T *out)                    \
{                                                                                    \
    for (int64_t i = 0; i < n; i++) {  /* both loaded: a select, not a branch */       \
        T gi = g[i], xi = x[i];                                                      \
        out[i] = xi <= 0 ? (T)0 : gi;  /* NaN x passes g, as torch */                \
    }                                                                                \
}

DROPOUT_DEFINE(f32, float)
DROPOUT_DEFINE(f64, double)

/* ------------------------------------------------------------ column sums */

#define COLSUM_DEFINE(SFX, T)                                                        \
void fa_colsum_##SFX(int64_t rows, int64_t n, const T *x, int64_t ldx, double *acc)  \
{                                                                                    \
    for (int64_t r = 0; r < rows; r++) {                                             \
        const T *xr = x + r * ldx;                                                   \
        for (int64_t j = 0; j < n; j++)                                              \
            acc[j] += (double)xr[j];                                                 \
    }                                                                                \
}

COLSUM_DEFINE(f32, float)
COLSUM_DEFINE(f64, double)

/* ------------------------------------------------------------ Adam */

#define ADAM_DEFINE(SFX, T, SQRT)                                                    \
void fa_adam_##SFX(int64_t n, T *p, const T *g, T *m, T *v, T *vmax,                 \
                   const fa_adam_hyper *h)                                           \
{                                                                                    \
    const T one_m_b1 = (T)(1 - h->b1), b2 = (T)h->b2, one_m_b2 = (T)(1 - h->b2);      \
    const T decay = (T)(1 - h->lr * h->wd), wd = (T)h->wd, eps = (T)h->eps;           \
    const T step_size = (T)h->step_size, bc2 = (T)h->bc2_sqrt;                        \
    const int l2 = !h->decoupled && h->wd != 0, dec = h->decoupled && h->wd != 0;     \
    for (int64_t i = 0; i < n; i++) {                                                \
        T d = h->maximize ? -g[i] : g[i];                                            \
        T pi = p[i];                                                                 \
        if (dec)                                                                     \
            pi = pi * decay;                                                         \
        else if (l2)                                                                 \
            d = d + wd * pi;                                                         \
        T mi = m[i] + one_m_b1 * (d - m[i]);                                         \
        T vi = v[i] * b2;                                                            \
        vi = vi + (one_m_b2 * d) * d;                                                \
        m[i] = mi;                                                                   \
        v[i] = vi;                                                                   \
        if (vmax) {                                                                  \
            T x = vmax[i];                                                           \
            vi = (x >= vi || x != x) ? x : vi;                                       \
            vmax[i] = vi;                                                            \
        }                                                                            \
        T denom = SQRT(vi) / bc2 + eps;                                              \
        p[i] = pi - step_size * (mi / denom);                                        \
    }                                                                                \
}

ADAM_DEFINE(f32, float, sqrtf)
ADAM_DEFINE(f64, double, sqrt)

/* ------------------------------------------------------------ scatter-add */
#define FA_SCATTER_ADD_BODY(T)                                                  \
    for (int64_t r = 0; r < rows; r++) {                                        \
        T *d = dst + ids[r] * E;                                                \
        const T *s = src + r * E;                                               \
        for (int64_t j = 0; j < E; j++)                                         \
            d[j] += s[j];                                                       \
    }

void fa_scatter_add_f32(int64_t rows, int64_t E, const float *src, const int64_t *ids, float *dst)
{
    FA_SCATTER_ADD_BODY(float)
}

void fa_scatter_add_f64(int64_t rows, int64_t E, const double *src, const int64_t *ids, double *dst)
{
    FA_SCATTER_ADD_BODY(double)
}

/* ------------------------------------------------------------- sum of squares */
#define FA_SUMSQ_BODY(T)                                                        \
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                      \
    int64_t i = 0;                                                              \
    for (; i + 4 <= n; i += 4) {                                                \
        double a = (double)x[i], b = (double)x[i + 1];                          \
        double c = (double)x[i + 2], d = (double)x[i + 3];                      \
        s0 += a * a; s1 += b * b; s2 += c * c; s3 += d * d;                     \
    }                                                                           \
    for (; i < n; i++) {                                                        \
        double a = (double)x[i];                                                \
        s0 += a * a;                                                            \
    }                                                                           \
    return (s0 + s1) + (s2 + s3);

double fa_sumsq_f32(int64_t n, const float *x) { FA_SUMSQ_BODY(float) }
double fa_sumsq_f64(int64_t n, const double *x) { FA_SUMSQ_BODY(double) }

/* ------------------------------------------------------------- cross entropy */
/* Row r: m = max (NaN propagating), e_c = exp(z_c - m) in T, sum of the e_c in
 * double, lse = log(sum); nll = lse - (z_y - m) for a kept target, 0 for an
 * ignored one; grad = e * (T)(s scale / sum), then grad_y -= (T)(scale)
 * (s = 1 kept, 0 ignored) -- fastattn/losses.py's class-index path with no
 * weights and no smoothing, step for step. */
#define FA_XENT_ROW_TAIL(T, LOGF)                                                   \
    const int64_t y = tgt[r];                                                       \
    const int keep = y != ignore;                                                   \
    const double lse = log(sum);                                                    \
    nll[r] = keep ? lse - (double)(T)(zr[y] - m) : 0.0;                            \
    const T f = (T)((keep ? 1.0 : 0.0) * (scale / sum));                            \
    for (int64_t c = 0; c < C; c++)                                                 \
        gr[c] *= f;                                                                 \
    if (keep)                                                                       \
        gr[y] -= (T)scale;

#define FA_XENT_MAX(T)                                                              \
    T m = zr[0];                                                                    \
    for (int64_t c = 1; c < C; c++) {                                               \
        const T v = zr[c];                                                          \
        if (v > m || v != v)                                                        \
            m = v;                                                                  \
        if (m != m)                                                                 \
            break;                                                                  \
    }

#ifdef FA_RW_AVX2
#define AVX2 __attribute__((target("avx2,fma")))
#include "fa_exp_avx2.h"

AVX2 static void xent_rows_avx2_f32(int64_t r0, int64_t r1, int64_t C, const float *z,
                                    int64_t ldz, const int64_t *tgt, int64_t ignore,
                                    double scale, float *grad, int64_t ldg, double *nll)
{
    for (int64_t r = r0; r < r1; r++) {
        const float *zr = z + r * ldz;
        float *gr = grad + r * ldg;
        /* the maximum in lanes, NaNs tracked apart (max_ps drops them) */
        float m = zr[0];
        {
            __m256 mx = _mm256_set1_ps(m), nan = _mm256_setzero_ps();
            int64_t c = 0;
            for (; c + 8 <= C; c += 8) {
                const __m256 v = _mm256_loadu_ps(zr + c);
                mx = _mm256_max_ps(mx, v);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
            }
            float lanes[8];
            _mm256_storeu_ps(lanes, mx);
            for (int l = 0; l < 8; l++)
                m = lanes[l] > m ? lanes[l] : m;
            for (; c < C; c++)
                m = zr[c] > m || zr[c] != zr[c] ? zr[c] : m;
            if (!_mm256_testz_ps(nan, nan))
                m = NAN;
        }
        const __m256 mv = _mm256_set1_ps(m);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        int64_t c = 0;
        for (; c + 8 <= C; c += 8) {
            const __m256 e = exp8_nonpos_f32(_mm256_sub_ps(_mm256_loadu_ps(zr + c), mv));
            _mm256_storeu_ps(gr + c, e);
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        if (c < C) {   /* the last 1..7 classes through a padded buffer */
            float buf[8] = {m, m, m, m, m, m, m, m};   /* padding: exp(0), masked off */
            memcpy(buf, zr + c, (size_t)(C - c) * sizeof(float));
            const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256 live = _mm256_castsi256_ps(
                _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(C - c)), lane));
            __m256 e = exp8_nonpos_f32(_mm256_sub_ps(_mm256_loadu_ps(buf), mv));
            e = _mm256_and_ps(e, live);
            _mm256_storeu_ps(buf, e);
            memcpy(gr + c, buf, (size_t)(C - c) * sizeof(float));
            s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
            s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double part[4];
        _mm256_storeu_pd(part, _mm256_add_pd(s0, s1));
        const double sum = (part[0] + part[1]) + (part[2] + part[3]);
        FA_XENT_ROW_TAIL(float, logf)
    }
}

AVX2 static void xent_rows_avx2_f64(int64_t r0, int64_t r1, int64_t C, const double *z,
                                    int64_t ldz, const int64_t *tgt, int64_t ignore,
                                    double scale, double *grad, int64_t ldg, double *nll)
{
    for (int64_t r = r0; r < r1; r++) {
        const double *zr = z + r * ldz;
        double *gr = grad + r * ldg;
        FA_XENT_MAX(double)
        const __m256d mv = _mm256_set1_pd(m);
        __m256d s0 = _mm256_setzero_pd();
        int64_t c = 0;
        for (; c + 4 <= C; c += 4) {
            const __m256d e = exp4_f64(_mm256_sub_pd(_mm256_loadu_pd(zr + c), mv));
            _mm256_storeu_pd(gr + c, e);
            s0 = _mm256_add_pd(s0, e);
        }
        double part[4];
        _mm256_storeu_pd(part, s0);
        double sum = (part[0] + part[1]) + (part[2] + part[3]);
        for (; c < C; c++) {
            gr[c] = exp(zr[c] - m);
            sum += gr[c];
        }
        FA_XENT_ROW_TAIL(double, log)
    }
}
#undef AVX2
#endif

#define FA_XENT_SCALAR(SFX, T, EXPF)                                                \
static void xent_rows_scalar_##SFX(int64_t r0, int64_t r1, int64_t C, const T *z,   \
                                   int64_t ldz, const int64_t *tgt, int64_t ignore, \
                                   double scale, T *grad, int64_t ldg, double *nll) \
{                                                                                   \
    for (int64_t r = r0; r < r1; r++) {                                             \
        const T *zr = z + r * ldz;                                                  \
        T *gr = grad + r * ldg;                                                     \
        FA_XENT_MAX(T)                                                              \
        double sum = 0;                                                             \
        for (int64_t c = 0; c < C; c++) {                                           \
            gr[c] = EXPF(zr[c] - m);                                                \
            sum += (double)gr[c];                                                   \
        }                                                                           \
        FA_XENT_ROW_TAIL(T, log)                                                    \
    }                                                                               \
}
FA_XENT_SCALAR(f32, float, expf)
FA_XENT_SCALAR(f64, double, exp)

#ifdef FA_RW_AVX2
#define FA_XENT_SIMD(SFX)                                                            \
    if (simd && rw_has_avx2_fma()) {                                                \
        xent_rows_avx2_##SFX(r0, r1, C, z, ldz, tgt, ignore, scale, grad, ldg, nll); \
        return;                                                                      \
    }
#else
#define FA_XENT_SIMD(SFX)
#endif
#define FA_XENT_DEFINE(SFX, T)                                                       \
void fa_xent_##SFX(int64_t r0, int64_t r1, int64_t C, const T *z, int64_t ldz,       \
                   const int64_t *tgt, int64_t ignore, double scale, T *grad,        \
                   int64_t ldg, double *nll, int simd)                               \
{                                                                                    \
    FA_XENT_SIMD(SFX)                                                                \
    (void)simd;                                                                      \
    xent_rows_scalar_##SFX(r0, r1, C, z, ldz, tgt, ignore, scale, grad, ldg, nll);   \
}
FA_XENT_DEFINE(f32, float)
FA_XENT_DEFINE(f64, double)
