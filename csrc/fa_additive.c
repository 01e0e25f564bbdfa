/*
 * Fused additive (Bahdanau / Luong concat) attention and the streaming loop
 * for compiled similarity plugins (fa_additive.h).
 *
 * Vectorised tanh (AVX2/FMA, chosen at run time like fa_simd.c), the same
 * construction in both precisions: below |x| = 0.625 an odd polynomial
 * (float: x + x^3 P(x^2), P of degree 4 fitted for least maximum relative
 * error; double: the [9/8] Pade approximant), above it 1 - 2 / (exp(2|x|) + 1)
 * with our own exp (Cody-Waite reduction and polynomial, as in fa_simd.c).
 * Bounds are measured and pinned by tests/similarity/test_additive_kernel.py (float
 * against float64 tanh on a dense grid of [-10, 10] plus random inputs, double
 * against mpmath).  tanh(+-inf) = +-1, tanh(+-0) = +-0, NaN stays NaN.
 * Each score is a sum of d_a such terms times v_a, so its absolute error is
 * about (bound) * sum_a |v_a| plus the summation error.
 * The scalar fallback uses libm's tanhf / tanh.  No -ffast-math: masks rely
 * on -inf.
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "fa_additive.h"
#include "fa_pool.h"
#include "fa_rowops.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FA_ADD_AVX2 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#define AVX512 __attribute__((target("avx512f,avx2,fma")))
#include "fa_exp_avx2.h"
#include "fa_tanh_avx2.h"
#include "fa_avx512_math.h"
#else
#define FA_ADD_AVX2 0
#endif

/* ------------------------------------------------------------- P . V */

typedef void (*pv_float_t)(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                           const float *V, int64_t ldv, float *O, int64_t ldo);
typedef void (*pv_double_t)(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                            const double *V, int64_t ldv, double *O, int64_t ldo);
#define pv_fn_t_(R) pv_##R##_t
#define pv_fn_t(R) pv_fn_t_(R)

/* O (m x dv) += P (m x n) . V (n x dv); four keys per pass over an output row */
#define PV_BODY(T)                                                                    \
    for (int64_t i = 0; i < m; i++) {                                                 \
        T *restrict o = O + i * ldo;                                                  \
        const T *p = P + i * ldp;                                                     \
        int64_t j = 0;                                                                \
        for (; j + 4 <= n; j += 4) {                                                  \
            T p0 = p[j], p1 = p[j + 1], p2 = p[j + 2], p3 = p[j + 3];                 \
            if (p0 == 0 && p1 == 0 && p2 == 0 && p3 == 0)                             \
                continue;                                                             \
            const T *restrict v0 = V + j * ldv, *restrict v1 = v0 + ldv;              \
            const T *restrict v2 = v1 + ldv, *restrict v3 = v2 + ldv;                 \
            for (int64_t c = 0; c < dv; c++)                                          \
                o[c] += (p0 * v0[c] + p1 * v1[c]) + (p2 * v2[c] + p3 * v3[c]);        \
        }                                                                             \
        for (; j < n; j++) {                                                          \
            T pj = p[j];                                                              \
            if (pj == 0)                                                              \
                continue;                                                             \
            const T *restrict vj = V + j * ldv;                                       \
            for (int64_t c = 0; c < dv; c++)                                          \
                o[c] += pj * vj[c];                                                   \
        }                                                                             \
    }

static void pv_f32_scalar(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                          const float *V, int64_t ldv, float *O, int64_t ldo) { PV_BODY(float) }
static void pv_f64_scalar(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                          const double *V, int64_t ldv, double *O, int64_t ldo) { PV_BODY(double) }
#if FA_ADD_AVX2
AVX2 static void pv_f32_avx2(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                             const float *V, int64_t ldv, float *O, int64_t ldo) { PV_BODY(float) }
AVX2 static void pv_f64_avx2(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                             const double *V, int64_t ldv, double *O, int64_t ldo) { PV_BODY(double) }
#endif

static pv_float_t get_pv_f32(void)
{
#if FA_ADD_AVX2
    if (fa_simd_active())
        return pv_f32_avx2;
#endif
    return pv_f32_scalar;
}

static pv_double_t get_pv_f64(void)
{
#if FA_ADD_AVX2
    if (fa_simd_active())
        return pv_f64_avx2;
#endif
    return pv_f64_scalar;
}

void fa_pv_acc_f32(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                   const float *V, int64_t ldv, float *O, int64_t ldo)
{
    get_pv_f32()(m, dv, n, P, ldp, V, ldv, O, ldo);
}

void fa_pv_acc_f64(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                   const double *V, int64_t ldv, double *O, int64_t ldo)
{
    get_pv_f64()(m, dv, n, P, ldp, V, ldv, O, ldo);
}

/* ---------------------------------------------------------------- tanh */

#if FA_ADD_AVX2
AVX2 static void tanh_f32_avx2(const float *x, float *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(y + j, tanh8_f32(_mm256_loadu_ps(x + j)));
    if (j < n) {
        float buf[8] = {0};
        memcpy(buf, x + j, (size_t)(n - j) * sizeof(float));
        _mm256_storeu_ps(buf, tanh8_f32(_mm256_loadu_ps(buf)));
        memcpy(y + j, buf, (size_t)(n - j) * sizeof(float));
    }
}

/* ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)): the order in which the
 * four-key path below sums each key's lanes (hadd, hadd, halves), so that a
 * score has the same bits whichever path computed it.  (Which keys of a tile
 * take the one-key path depends on the tile's end, which under causality
 * depends on the query block, and so on the thread count.)  The backward
 * recomputes scores and relies on it (fa_additive_bwd_impl.h). */
AVX2 static inline float hsum8_f32(__m256 v)
{
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* (l0 + l1) + (l2 + l3), the four-key path's order (see hsum8_f32) */
AVX2 static inline double hsum4_f64(__m256d v)
{
    __m256d h = _mm256_hadd_pd(v, v);
    return _mm_cvtsd_f64(_mm_add_sd(_mm256_castpd256_pd128(h), _mm256_extractf128_pd(h, 1)));
}

#define FA_ROWS_ATTR AVX2
#define FA_ROWS_SFX avx2
#define FA_ROWS_WIDE 0
#include "fa_additive_rows.h"
#undef FA_ROWS_ATTR
#undef FA_ROWS_SFX
#undef FA_ROWS_WIDE

#define FA_ROWS_ATTR AVX512
#define FA_ROWS_SFX avx512
#define FA_ROWS_WIDE 1
#include "fa_additive_rows.h"
#undef FA_ROWS_ATTR
#undef FA_ROWS_SFX
#undef FA_ROWS_WIDE

AVX2 static void tanh_f64_avx2(const double *x, double *y, int64_t n)
{
    int64_t j = 0;
    for (; j + 4 <= n; j += 4)
        _mm256_storeu_pd(y + j, tanh4_f64(_mm256_loadu_pd(x + j)));
    if (j < n) {
        double buf[4] = {0};
        memcpy(buf, x + j, (size_t)(n - j) * sizeof(double));
        _mm256_storeu_pd(buf, tanh4_f64(_mm256_loadu_pd(buf)));
        memcpy(y + j, buf, (size_t)(n - j) * sizeof(double));
    }
}

AVX2 static int additive_score_f64_avx2(const double *v, const double *q, int64_t ldq,
                                        const double *k, int64_t ldk, int64_t tq, int64_t tk,
                                        int64_t d, double *s, int64_t lds)
{
    const int64_t d4 = d & ~(int64_t)3;
    for (int64_t i = 0; i < tq; i++) {
        const double *qi = q + i * ldq;
        double *si = s + i * lds;
        int64_t j = 0;
        for (; j + 4 <= tk; j += 4) {
            const double *k0 = k + j * ldk, *k1 = k0 + ldk, *k2 = k1 + ldk, *k3 = k2 + ldk;
            __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < d4; c += 4) {
                __m256d vq = _mm256_loadu_pd(qi + c), vv = _mm256_loadu_pd(v + c);
                a0 = _mm256_fmadd_pd(vv, tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(k0 + c))), a0);
                a1 = _mm256_fmadd_pd(vv, tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(k1 + c))), a1);
                a2 = _mm256_fmadd_pd(vv, tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(k2 + c))), a2);
                a3 = _mm256_fmadd_pd(vv, tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(k3 + c))), a3);
            }
            /* four sums of four lanes */
            __m256d t0 = _mm256_hadd_pd(a0, a1), t1 = _mm256_hadd_pd(a2, a3);
            __m256d u = _mm256_add_pd(_mm256_permute2f128_pd(t0, t1, 0x20),
                                      _mm256_permute2f128_pd(t0, t1, 0x31));
            double out[4];
            _mm256_storeu_pd(out, u);
            for (int t = 0; t < 4; t++) {
                const double *kt = k + (j + t) * ldk;
                for (int64_t c = d4; c < d; c++)
                    out[t] += v[c] * tanh(qi[c] + kt[c]);
                si[j + t] = out[t];
            }
        }
        for (; j < tk; j++) {
            const double *kj = k + j * ldk;
            __m256d a0 = _mm256_setzero_pd();
            for (int64_t c = 0; c < d4; c += 4)
                a0 = _mm256_fmadd_pd(_mm256_loadu_pd(v + c),
                                     tanh4_f64(_mm256_add_pd(_mm256_loadu_pd(qi + c),
                                                             _mm256_loadu_pd(kj + c))), a0);
            double acc = hsum4_f64(a0);
            for (int64_t c = d4; c < d; c++)
                acc += v[c] * tanh(qi[c] + kj[c]);
            si[j] = acc;
        }
    }
    return 0;
}

/* ------------------------------------------ backward row kernels (AVX2) */

/* p[0..8) += x (converted to double) */
AVX2 static inline void acc8_f64(double *p, __m256 x)
{
    _mm256_storeu_pd(p, _mm256_add_pd(_mm256_loadu_pd(p), _mm256_cvtps_pd(_mm256_castps256_ps128(x))));
    _mm256_storeu_pd(p + 4, _mm256_add_pd(_mm256_loadu_pd(p + 4),
                                          _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1))));
}

/* fa_additive_bwd_impl.h's ab_grad_rows: per feature, two keys at a time
 * (independent sums), 16 features a pass, then 8, then one. */
AVX2 static void ab_grad_rows_avx2_f32(const float *T, int64_t d, const float *ds,
                                       float *const *dkr, int64_t na, double *hq, double *dw)
{
    const __m256 one = _mm256_set1_ps(1.0f);
    int64_t c = 0;
    for (; c + 16 <= d; c += 16) {
        __m256 h0 = _mm256_setzero_ps(), h1 = h0, h2 = h0, h3 = h0;
        __m256 w0 = h0, w1 = h0, w2 = h0, w3 = h0;
        int64_t a = 0;
        for (; a + 2 <= na; a += 2) {
            const float *ta = T + a * d + c, *tb = ta + d;
            float *ka = dkr[a] + c, *kb = dkr[a + 1] + c;
            __m256 sa = _mm256_broadcast_ss(ds + a), sb = _mm256_broadcast_ss(ds + a + 1);
            __m256 xa0 = _mm256_loadu_ps(ta), xa1 = _mm256_loadu_ps(ta + 8);
            __m256 xb0 = _mm256_loadu_ps(tb), xb1 = _mm256_loadu_ps(tb + 8);
            __m256 ea0 = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa0, xa0, one));
            __m256 ea1 = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa1, xa1, one));
            __m256 eb0 = _mm256_mul_ps(sb, _mm256_fnmadd_ps(xb0, xb0, one));
            __m256 eb1 = _mm256_mul_ps(sb, _mm256_fnmadd_ps(xb1, xb1, one));
            h0 = _mm256_add_ps(h0, ea0);
            h1 = _mm256_add_ps(h1, ea1);
            h2 = _mm256_add_ps(h2, eb0);
            h3 = _mm256_add_ps(h3, eb1);
            _mm256_storeu_ps(ka, _mm256_add_ps(_mm256_loadu_ps(ka), ea0));
            _mm256_storeu_ps(ka + 8, _mm256_add_ps(_mm256_loadu_ps(ka + 8), ea1));
            _mm256_storeu_ps(kb, _mm256_add_ps(_mm256_loadu_ps(kb), eb0));
            _mm256_storeu_ps(kb + 8, _mm256_add_ps(_mm256_loadu_ps(kb + 8), eb1));
            w0 = _mm256_fmadd_ps(sa, xa0, w0);
            w1 = _mm256_fmadd_ps(sa, xa1, w1);
            w2 = _mm256_fmadd_ps(sb, xb0, w2);
            w3 = _mm256_fmadd_ps(sb, xb1, w3);
        }
        if (a < na) {
            const float *ta = T + a * d + c;
            float *ka = dkr[a] + c;
            __m256 sa = _mm256_broadcast_ss(ds + a);
            __m256 xa0 = _mm256_loadu_ps(ta), xa1 = _mm256_loadu_ps(ta + 8);
            __m256 ea0 = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa0, xa0, one));
            __m256 ea1 = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa1, xa1, one));
            h0 = _mm256_add_ps(h0, ea0);
            h1 = _mm256_add_ps(h1, ea1);
            _mm256_storeu_ps(ka, _mm256_add_ps(_mm256_loadu_ps(ka), ea0));
            _mm256_storeu_ps(ka + 8, _mm256_add_ps(_mm256_loadu_ps(ka + 8), ea1));
            w0 = _mm256_fmadd_ps(sa, xa0, w0);
            w1 = _mm256_fmadd_ps(sa, xa1, w1);
        }
        acc8_f64(hq + c, _mm256_add_ps(h0, h2));
        acc8_f64(hq + c + 8, _mm256_add_ps(h1, h3));
        acc8_f64(dw + c, _mm256_add_ps(w0, w2));
        acc8_f64(dw + c + 8, _mm256_add_ps(w1, w3));
    }
    for (; c + 8 <= d; c += 8) {
        __m256 h0 = _mm256_setzero_ps(), h1 = h0, w0 = h0, w1 = h0;
        int64_t a = 0;
        for (; a + 2 <= na; a += 2) {
            const float *ta = T + a * d + c, *tb = ta + d;
            float *ka = dkr[a] + c, *kb = dkr[a + 1] + c;
            __m256 sa = _mm256_broadcast_ss(ds + a), sb = _mm256_broadcast_ss(ds + a + 1);
            __m256 xa = _mm256_loadu_ps(ta), xb = _mm256_loadu_ps(tb);
            __m256 ea = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa, xa, one));
            __m256 eb = _mm256_mul_ps(sb, _mm256_fnmadd_ps(xb, xb, one));
            h0 = _mm256_add_ps(h0, ea);
            h1 = _mm256_add_ps(h1, eb);
            _mm256_storeu_ps(ka, _mm256_add_ps(_mm256_loadu_ps(ka), ea));
            _mm256_storeu_ps(kb, _mm256_add_ps(_mm256_loadu_ps(kb), eb));
            w0 = _mm256_fmadd_ps(sa, xa, w0);
            w1 = _mm256_fmadd_ps(sb, xb, w1);
        }
        if (a < na) {
            float *ka = dkr[a] + c;
            __m256 sa = _mm256_broadcast_ss(ds + a);
            __m256 xa = _mm256_loadu_ps(T + a * d + c);
            __m256 ea = _mm256_mul_ps(sa, _mm256_fnmadd_ps(xa, xa, one));
            h0 = _mm256_add_ps(h0, ea);
            _mm256_storeu_ps(ka, _mm256_add_ps(_mm256_loadu_ps(ka), ea));
            w0 = _mm256_fmadd_ps(sa, xa, w0);
        }
        acc8_f64(hq + c, _mm256_add_ps(h0, h1));
        acc8_f64(dw + c, _mm256_add_ps(w0, w1));
    }
    for (; c < d; c++) {
        float h = 0, w = 0;
        for (int64_t a = 0; a < na; a++) {
            float t = T[a * d + c];
            float e = ds[a] * (1.0f - t * t);
            h += e;
            dkr[a][c] += e;
            w += ds[a] * t;
        }
        hq[c] += (double)h;
        dw[c] += (double)w;
    }
}

/* the double versions: as additive_score_f64_avx2 / the float ones above */
AVX2 static void ab_tanh_rows_avx2_f64(const double *q, const double *const *kr, int64_t na,
                                       int64_t d, const double *v, double *T, double *s)
{
    const int64_t d4 = d & ~(int64_t)3;
    int64_t a = 0;
    for (; a + 4 <= na; a += 4) {
        const double *ks[4] = {kr[a], kr[a + 1], kr[a + 2], kr[a + 3]};
        double *t0 = T + a * d, *t1 = t0 + d, *t2 = t1 + d, *t3 = t2 + d;
        __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
        for (int64_t c = 0; c < d4; c += 4) {
            __m256d vq = _mm256_loadu_pd(q + c), vv = _mm256_loadu_pd(v + c);
            __m256d x0 = tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(ks[0] + c)));
            __m256d x1 = tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(ks[1] + c)));
            __m256d x2 = tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(ks[2] + c)));
            __m256d x3 = tanh4_f64(_mm256_add_pd(vq, _mm256_loadu_pd(ks[3] + c)));
            _mm256_storeu_pd(t0 + c, x0);
            _mm256_storeu_pd(t1 + c, x1);
            _mm256_storeu_pd(t2 + c, x2);
            _mm256_storeu_pd(t3 + c, x3);
            a0 = _mm256_fmadd_pd(vv, x0, a0);
            a1 = _mm256_fmadd_pd(vv, x1, a1);
            a2 = _mm256_fmadd_pd(vv, x2, a2);
            a3 = _mm256_fmadd_pd(vv, x3, a3);
        }
        __m256d h0 = _mm256_hadd_pd(a0, a1), h1 = _mm256_hadd_pd(a2, a3);
        __m256d u = _mm256_add_pd(_mm256_permute2f128_pd(h0, h1, 0x20),
                                  _mm256_permute2f128_pd(h0, h1, 0x31));
        double out[4];
        _mm256_storeu_pd(out, u);
        for (int t = 0; t < 4; t++) {
            double *tt = T + (a + t) * d;
            for (int64_t c = d4; c < d; c++) {
                double x = tanh(q[c] + ks[t][c]);
                tt[c] = x;
                out[t] += v[c] * x;
            }
            s[a + t] = out[t];
        }
    }
    for (; a < na; a++) {
        const double *kj = kr[a];
        double *tt = T + a * d;
        __m256d a0 = _mm256_setzero_pd();
        for (int64_t c = 0; c < d4; c += 4) {
            __m256d x = tanh4_f64(_mm256_add_pd(_mm256_loadu_pd(q + c), _mm256_loadu_pd(kj + c)));
            _mm256_storeu_pd(tt + c, x);
            a0 = _mm256_fmadd_pd(_mm256_loadu_pd(v + c), x, a0);
        }
        double acc = hsum4_f64(a0);
        for (int64_t c = d4; c < d; c++) {
            double x = tanh(q[c] + kj[c]);
            tt[c] = x;
            acc += v[c] * x;
        }
        s[a] = acc;
    }
}

AVX2 static void ab_grad_rows_avx2_f64(const double *T, int64_t d, const double *ds,
                                       double *const *dkr, int64_t na, double *hq, double *dw)
{
    const __m256d one = _mm256_set1_pd(1.0);
    int64_t c = 0;
    for (; c + 8 <= d; c += 8) {
        __m256d h0 = _mm256_setzero_pd(), h1 = h0, h2 = h0, h3 = h0;
        __m256d w0 = h0, w1 = h0, w2 = h0, w3 = h0;
        int64_t a = 0;
        for (; a + 2 <= na; a += 2) {
            const double *ta = T + a * d + c, *tb = ta + d;
            double *ka = dkr[a] + c, *kb = dkr[a + 1] + c;
            __m256d sa = _mm256_broadcast_sd(ds + a), sb = _mm256_broadcast_sd(ds + a + 1);
            __m256d xa0 = _mm256_loadu_pd(ta), xa1 = _mm256_loadu_pd(ta + 4);
            __m256d xb0 = _mm256_loadu_pd(tb), xb1 = _mm256_loadu_pd(tb + 4);
            __m256d ea0 = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa0, xa0, one));
            __m256d ea1 = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa1, xa1, one));
            __m256d eb0 = _mm256_mul_pd(sb, _mm256_fnmadd_pd(xb0, xb0, one));
            __m256d eb1 = _mm256_mul_pd(sb, _mm256_fnmadd_pd(xb1, xb1, one));
            h0 = _mm256_add_pd(h0, ea0);
            h1 = _mm256_add_pd(h1, ea1);
            h2 = _mm256_add_pd(h2, eb0);
            h3 = _mm256_add_pd(h3, eb1);
            _mm256_storeu_pd(ka, _mm256_add_pd(_mm256_loadu_pd(ka), ea0));
            _mm256_storeu_pd(ka + 4, _mm256_add_pd(_mm256_loadu_pd(ka + 4), ea1));
            _mm256_storeu_pd(kb, _mm256_add_pd(_mm256_loadu_pd(kb), eb0));
            _mm256_storeu_pd(kb + 4, _mm256_add_pd(_mm256_loadu_pd(kb + 4), eb1));
            w0 = _mm256_fmadd_pd(sa, xa0, w0);
            w1 = _mm256_fmadd_pd(sa, xa1, w1);
            w2 = _mm256_fmadd_pd(sb, xb0, w2);
            w3 = _mm256_fmadd_pd(sb, xb1, w3);
        }
        if (a < na) {
            const double *ta = T + a * d + c;
            double *ka = dkr[a] + c;
            __m256d sa = _mm256_broadcast_sd(ds + a);
            __m256d xa0 = _mm256_loadu_pd(ta), xa1 = _mm256_loadu_pd(ta + 4);
            __m256d ea0 = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa0, xa0, one));
            __m256d ea1 = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa1, xa1, one));
            h0 = _mm256_add_pd(h0, ea0);
            h1 = _mm256_add_pd(h1, ea1);
            _mm256_storeu_pd(ka, _mm256_add_pd(_mm256_loadu_pd(ka), ea0));
            _mm256_storeu_pd(ka + 4, _mm256_add_pd(_mm256_loadu_pd(ka + 4), ea1));
            w0 = _mm256_fmadd_pd(sa, xa0, w0);
            w1 = _mm256_fmadd_pd(sa, xa1, w1);
        }
        _mm256_storeu_pd(hq + c, _mm256_add_pd(_mm256_loadu_pd(hq + c), _mm256_add_pd(h0, h2)));
        _mm256_storeu_pd(hq + c + 4, _mm256_add_pd(_mm256_loadu_pd(hq + c + 4), _mm256_add_pd(h1, h3)));
        _mm256_storeu_pd(dw + c, _mm256_add_pd(_mm256_loadu_pd(dw + c), _mm256_add_pd(w0, w2)));
        _mm256_storeu_pd(dw + c + 4, _mm256_add_pd(_mm256_loadu_pd(dw + c + 4), _mm256_add_pd(w1, w3)));
    }
    for (; c + 4 <= d; c += 4) {
        __m256d h0 = _mm256_setzero_pd(), h1 = h0, w0 = h0, w1 = h0;
        int64_t a = 0;
        for (; a + 2 <= na; a += 2) {
            double *ka = dkr[a] + c, *kb = dkr[a + 1] + c;
            __m256d sa = _mm256_broadcast_sd(ds + a), sb = _mm256_broadcast_sd(ds + a + 1);
            __m256d xa = _mm256_loadu_pd(T + a * d + c), xb = _mm256_loadu_pd(T + (a + 1) * d + c);
            __m256d ea = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa, xa, one));
            __m256d eb = _mm256_mul_pd(sb, _mm256_fnmadd_pd(xb, xb, one));
            h0 = _mm256_add_pd(h0, ea);
            h1 = _mm256_add_pd(h1, eb);
            _mm256_storeu_pd(ka, _mm256_add_pd(_mm256_loadu_pd(ka), ea));
            _mm256_storeu_pd(kb, _mm256_add_pd(_mm256_loadu_pd(kb), eb));
            w0 = _mm256_fmadd_pd(sa, xa, w0);
            w1 = _mm256_fmadd_pd(sb, xb, w1);
        }
        if (a < na) {
            double *ka = dkr[a] + c;
            __m256d sa = _mm256_broadcast_sd(ds + a);
            __m256d xa = _mm256_loadu_pd(T + a * d + c);
            __m256d ea = _mm256_mul_pd(sa, _mm256_fnmadd_pd(xa, xa, one));
            h0 = _mm256_add_pd(h0, ea);
            _mm256_storeu_pd(ka, _mm256_add_pd(_mm256_loadu_pd(ka), ea));
            w0 = _mm256_fmadd_pd(sa, xa, w0);
        }
        _mm256_storeu_pd(hq + c, _mm256_add_pd(_mm256_loadu_pd(hq + c), _mm256_add_pd(h0, h1)));
        _mm256_storeu_pd(dw + c, _mm256_add_pd(_mm256_loadu_pd(dw + c), _mm256_add_pd(w0, w1)));
    }
    for (; c < d; c++) {
        double h = 0, w = 0;
        for (int64_t a = 0; a < na; a++) {
            double t = T[a * d + c];
            double e = ds[a] * (1.0 - t * t);
            h += e;
            dkr[a][c] += e;
            w += ds[a] * t;
        }
        hq[c] += h;
        dw[c] += w;
    }
}
#endif

static void tanh_f32_scalar(const float *x, float *y, int64_t n)
{
    for (int64_t j = 0; j < n; j++)
        y[j] = tanhf(x[j]);
}

void fa_tanh_f32(const float *x, float *y, int64_t n)
{
#if FA_ADD_AVX2
    if (fa_simd_active()) {
        tanh_f32_avx2(x, y, n);
        return;
    }
#endif
    tanh_f32_scalar(x, y, n);
}

void fa_tanh_f64(const double *x, double *y, int64_t n)
{
#if FA_ADD_AVX2
    if (fa_simd_active()) {
        tanh_f64_avx2(x, y, n);
        return;
    }
#endif
    for (int64_t j = 0; j < n; j++)
        y[j] = tanh(x[j]);
}

int fa_additive_score_f32(const void *params, const float *q, int64_t ldq, const float *k,
                          int64_t ldk, int64_t tq, int64_t tk, int64_t d, float *s,
                          int64_t lds)
{
    const float *v = (const float *)params;
#if FA_ADD_AVX2
    if (fa_simd_level() >= 2)   /* the same bits (fa_additive_rows.h) */
        return additive_score_f32_avx512(v, q, ldq, k, ldk, tq, tk, d, s, lds);
    if (fa_simd_active())
        return additive_score_f32_avx2(v, q, ldq, k, ldk, tq, tk, d, s, lds);
#endif
    for (int64_t i = 0; i < tq; i++)
        for (int64_t j = 0; j < tk; j++) {
            const float *qi = q + i * ldq, *kj = k + j * ldk;
            float acc = 0.0f;
            for (int64_t c = 0; c < d; c++)
                acc += v[c] * tanhf(qi[c] + kj[c]);
            s[i * lds + j] = acc;
        }
    return 0;
}

int fa_additive_score_f64(const void *params, const double *q, int64_t ldq, const double *k,
                          int64_t ldk, int64_t tq, int64_t tk, int64_t d, double *s,
                          int64_t lds)
{
    const double *v = (const double *)params;
#if FA_ADD_AVX2
    if (fa_simd_active())
        return additive_score_f64_avx2(v, q, ldq, k, ldk, tq, tk, d, s, lds);
#endif
    for (int64_t i = 0; i < tq; i++)
        for (int64_t j = 0; j < tk; j++) {
            const double *qi = q + i * ldq, *kj = k + j * ldk;
            double acc = 0.0;
            for (int64_t c = 0; c < d; c++)
                acc += v[c] * tanh(qi[c] + kj[c]);
            s[i * lds + j] = acc;
        }
    return 0;
}

/* ------------------------------------------------------ self-test plugin */

#define SELFTEST_BODY(T)                                                          \
    const double *pr = (const double *)params;                                    \
    T gamma = (T)pr[0];                                                           \
    int mode = (int)pr[1];                                                        \
    if (mode == 1)                                                                \
        return 7;                                                                 \
    for (int64_t i = 0; i < tq; i++)                                              \
        for (int64_t j = 0; j < tk; j++) {                                        \
            const T *qi = q + i * ldq, *kj = k + j * ldk;                         \
            T acc = 0;                                                            \
            for (int64_t c = 0; c < d; c++) {                                     \
                T t = qi[c] - kj[c];                                              \
                acc += t * t;                                                     \
            }                                                                     \
            s[i * lds + j] = -gamma * acc;                                        \
        }                                                                         \
    if (mode == 2)                                                                \
        s[0] = (T)NAN;                                                            \
    if (mode == 3)                                                                \
        s[0] = (T)INFINITY;                                                       \
    return 0;

static int selftest_f32(const void *params, const float *q, int64_t ldq, const float *k,
                        int64_t ldk, int64_t tq, int64_t tk, int64_t d, float *s, int64_t lds)
{
    SELFTEST_BODY(float)
}

static int selftest_f64(const void *params, const double *q, int64_t ldq, const double *k,
                        int64_t ldk, int64_t tq, int64_t tk, int64_t d, double *s, int64_t lds)
{
    SELFTEST_BODY(double)
}

/* Its backward: ds/dq_c = -2 gamma (q_c - k_c) = -ds/dk_c, ds/dgamma = -|q - k|^2;
 * mode (params[1]) gets no gradient; mode 4 makes it fail with code 9. */
#define SELFTEST_BWD_BODY(T)                                                      \
    const double *pr = (const double *)params;                                    \
    T gamma = (T)pr[0];                                                           \
    int mode = (int)pr[1];                                                        \
    if (mode == 4)                                                                \
        return 9;                                                                 \
    double dgamma = 0.0;                                                          \
    for (int64_t i = 0; i < tq; i++)                                              \
        for (int64_t j = 0; j < tk; j++) {                                        \
            const T *qi = q + i * ldq, *kj = k + j * ldk;                         \
            T *dqi = dq + i * lddq, *dkj = dk + j * lddk;                         \
            T gij = g[i * ldg + j];                                               \
            if (gij == 0)                                                         \
                continue;                                                         \
            T w = -2 * gamma * gij, acc = 0;                                      \
            for (int64_t c = 0; c < d; c++) {                                     \
                T t = qi[c] - kj[c];                                              \
                acc += t * t;                                                     \
                dqi[c] += w * t;                                                  \
                dkj[c] -= w * t;                                                  \
            }                                                                     \
            dgamma -= (double)gij * (double)acc;                                  \
        }                                                                         \
    dparams[0] += dgamma;                                                         \
    return 0;

static int selftest_bwd_f32(const void *params, const float *q, int64_t ldq, const float *k,
                            int64_t ldk, int64_t tq, int64_t tk, int64_t d, const float *g,
                            int64_t ldg, float *dq, int64_t lddq, float *dk, int64_t lddk,
                            double *dparams)
{
    SELFTEST_BWD_BODY(float)
}

static int selftest_bwd_f64(const void *params, const double *q, int64_t ldq, const double *k,
                            int64_t ldk, int64_t tq, int64_t tk, int64_t d, const double *g,
                            int64_t ldg, double *dq, int64_t lddq, double *dk, int64_t lddk,
                            double *dparams)
{
    SELFTEST_BWD_BODY(double)
}

static const fastattn_score_plugin selftest_plugin = {
    FASTATTN_PLUGIN_ABI_VERSION, "fastattn_selftest_neg_sq_dist", selftest_f32, selftest_f64,
    selftest_bwd_f32, selftest_bwd_f64,
};

const fastattn_score_plugin *fa_selftest_plugin(void) { return &selftest_plugin; }

/* ---------------------------------------------------------- projections */

static fa_sgemm_fn g_add_sgemm = NULL;
static fa_dgemm_fn g_add_dgemm = NULL;
static fa_blas_set_threads_fn g_add_threads = NULL;   /* atomic */

static void add_blas_atfork_child(void);

void fa_add_set_blas(fa_sgemm_fn sgemm, fa_dgemm_fn dgemm, fa_blas_set_threads_fn set_threads)
{
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, add_blas_atfork_child);
        atfork = 1;
    }
    g_add_sgemm = sgemm;
    g_add_dgemm = dgemm;
    __atomic_store_n(&g_add_threads, set_threads, __ATOMIC_RELEASE);
}

/* BLAS is held at one thread while our tasks call it.  The hook OpenBLAS
 * offers (openblas_set_num_threads_local) acts process-wide in the pthreads
 * builds SciPy ships (measured), so every fastattn call that holds it must
 * share ONE count (the first one in saves the setting, the last one out
 * restores it): with a count per extension, overlapping calls could restore
 * each other's "1" for good.  fastattn._kernels owns that count and the
 * worker pool; fa_add_set_runtime hands their entry points over (by address,
 * from Python at import).  Without them (symbols not found), this file falls
 * back to its own count and pool copy. */
static fa_add_pool_run_fn g_rt_pool_run = NULL;
static fa_add_hold_enter_fn g_rt_enter = NULL;
static fa_add_hold_exit_fn g_rt_exit = NULL;

void fa_add_set_runtime(fa_add_pool_run_fn pool_run, fa_add_hold_enter_fn enter,
                        fa_add_hold_exit_fn exit_)
{
    if (!pool_run || !enter || !exit_) {
        g_rt_pool_run = NULL;
        g_rt_enter = NULL;
        g_rt_exit = NULL;
        return;
    }
    g_rt_enter = enter;
    g_rt_exit = exit_;
    g_rt_pool_run = pool_run;
}

int fa_add_runtime_shared(void) { return g_rt_pool_run != NULL; }

static int add_pool_run(int64_t ntasks, int nthreads, fa_task_fn fn, void *ctx,
                        fa_stop_fn stop, void *stop_ctx)
{
    if (g_rt_pool_run)
        return g_rt_pool_run(ntasks, nthreads, fn, ctx, stop, stop_ctx);
    return fa_pool_run(ntasks, nthreads, fn, ctx, stop, stop_ctx);
}

static pthread_mutex_t g_add_blas_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_add_blas_users = 0;
static int g_add_blas_saved = -1;

static fa_blas_set_threads_fn add_blas_enter(void)
{
    if (g_rt_enter)
        return g_rt_enter();
    fa_blas_set_threads_fn hook = __atomic_load_n(&g_add_threads, __ATOMIC_ACQUIRE);
    if (!hook)
        return NULL;
    pthread_mutex_lock(&g_add_blas_lock);
    if (g_add_blas_users++ == 0)
        g_add_blas_saved = hook(1);
    pthread_mutex_unlock(&g_add_blas_lock);
    return hook;
}

static void add_blas_exit(fa_blas_set_threads_fn hook)
{
    if (g_rt_exit) {
        g_rt_exit(hook);
        return;
    }
    if (!hook)
        return;
    pthread_mutex_lock(&g_add_blas_lock);
    if (--g_add_blas_users == 0 && g_add_blas_saved > 0)
        hook(g_add_blas_saved);
    pthread_mutex_unlock(&g_add_blas_lock);
}

static void add_blas_atfork_child(void)
{
    /* as fa_sdpa.c: a call running in the parent does not exist here */
    fa_blas_set_threads_fn hook = __atomic_load_n(&g_add_threads, __ATOMIC_ACQUIRE);
    if (g_add_blas_users > 0 && g_add_blas_saved > 0 && hook)
        hook(g_add_blas_saved);
    pthread_mutex_init(&g_add_blas_lock, NULL);
    g_add_blas_users = 0;
}

#define FA_PROJ_ROWS 128

#define PROJ_DEFS(T, SFX, GEMM)                                                          \
    typedef struct {                                                                     \
        const T *X, *W, *b;                                                              \
        T *Y;                                                                            \
        int64_t ldx, ldw, ldy, n, d, da;                                                 \
    } proj_job_##SFX;                                                                    \
    static void proj_task_##SFX(void *ctx, int64_t t, int slot)                          \
    {                                                                                    \
        (void)slot;                                                                      \
        proj_job_##SFX *j = (proj_job_##SFX *)ctx;                                       \
        int64_t r0 = t * FA_PROJ_ROWS;                                                   \
        int64_t rows = j->n - r0 < FA_PROJ_ROWS ? j->n - r0 : FA_PROJ_ROWS;              \
        /* row-major Y = X W^T is column-major Y^T = W . X^T: gemm('T', 'N') */           \
        char ta = 'T', tb = 'N';                                                         \
        int m = (int)j->da, nn = (int)rows, k = (int)j->d;                               \
        int lda = (int)j->ldw, ldb = (int)j->ldx, ldc = (int)j->ldy;                     \
        T one = 1, zero = 0;                                                             \
        GEMM(&ta, &tb, &m, &nn, &k, &one, (T *)j->W, &lda, (T *)(j->X + r0 * j->ldx),    \
             &ldb, &zero, j->Y + r0 * j->ldy, &ldc);                                     \
        if (j->b)                                                                        \
            for (int64_t r = 0; r < rows; r++) {                                         \
                T *y = j->Y + (r0 + r) * j->ldy;                                         \
                for (int64_t c = 0; c < j->da; c++)                                      \
                    y[c] += j->b[c];                                                     \
            }                                                                            \
    }                                                                                    \
    int fa_project_##SFX(const T *X, int64_t ldx, int64_t n, int64_t d, const T *W,      \
                         int64_t ldw, int64_t da, const T *b, T *Y, int64_t ldy,         \
                         int n_threads)                                                  \
    {                                                                                    \
        if (!GEMM || d < 1 || da < 1 || n_threads < 1)                                   \
            return FA_EINVAL;                                                            \
        /* the gemm's sizes are ints (rows: blocks of FA_PROJ_ROWS) */                   \
        if (!fa_blas_fits(d) || !fa_blas_fits(da) || !fa_blas_fits(ldx)                  \
            || !fa_blas_fits(ldw) || !fa_blas_fits(ldy))                                 \
            return FA_EINVAL;                                                            \
        if (n <= 0)                                                                      \
            return FA_OK;                                                                \
        proj_job_##SFX j = {X, W, b, Y, ldx, ldw, ldy, n, d, da};                        \
        int64_t ntasks = (n + FA_PROJ_ROWS - 1) / FA_PROJ_ROWS;                          \
        fa_blas_set_threads_fn hook = add_blas_enter();                                  \
        add_pool_run(ntasks, n_threads, proj_task_##SFX, &j, NULL, NULL);                \
        add_blas_exit(hook);                                                             \
        return FA_OK;                                                                    \
    }

PROJ_DEFS(float, f32, g_add_sgemm)
PROJ_DEFS(double, f64, g_add_dgemm)

/* --------------------------------------------------------- instantiations */

static inline float ops_rowmax_f32(const fa_rowops *o, const float *x, int64_t n) { return o->rowmax_f32(x, n); }
static inline double ops_rowmax_f64(const fa_rowops *o, const double *x, int64_t n) { return o->rowmax_f64(x, n); }
static inline float ops_expsub_f32(const fa_rowops *o, float *x, int64_t n, float m) { return o->expsub_sum_f32(x, n, m); }
static inline double ops_expsub_f64(const fa_rowops *o, double *x, int64_t n, double m) { return o->expsub_sum_f64(x, n, m); }
static inline float expo_f32(float x) { return expf(x); }
static inline double expo_f64(double x) { return exp(x); }

#if FA_ADD_AVX2
/* the backward's tanh rows on AVX-512 CPUs: float has a 512-bit version with
 * the same bits, double keeps the AVX2 one */
#define ab_tanh_rows_wide_f32 ab_tanh_rows_avx512_f32
#define ab_tanh_rows_wide_f64 ab_tanh_rows_avx2_f64
#endif

#define REAL float
#define SFX f32
#define GEMM g_add_sgemm
#define TANH1 tanhf
#include "fa_additive_impl.h"
#include "fa_additive_bwd_impl.h"
#undef REAL
#undef SFX
#undef GEMM
#undef TANH1

#define REAL double
#define SFX f64
#define GEMM g_add_dgemm
#define TANH1 tanh
#include "fa_additive_impl.h"
#include "fa_additive_bwd_impl.h"
#undef REAL
#undef SFX
#undef GEMM
#undef TANH1
