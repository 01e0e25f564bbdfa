/*
 * Recurrence kernel of the RNN layers (fa_rnn.h).
 *
 * Per step: gh = h W_hh^T + b_hh for the block's rows (float32: fa_proj.c's
 * packed AVX2 kernel on W_hh packed once by the caller, or its few-row kernel
 * reading W_hh in place; otherwise one gemm), then
 * the gates row by row.  The whole time loop runs here, so a step costs one
 * product and one pass over G*H numbers per row instead of a dozen NumPy
 * calls.  Gates use fastattn's own vectorised exp and tanh (fa_exp_avx2.h,
 * fa_tanh_avx2.h: float <= 2 ulp, double <= 3 ulp) with AVX2/FMA, libm's
 * otherwise; the sigmoid is 1 / (1 + exp(-x)).  No -ffast-math: NaN
 * propagates.
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <stddef.h>
#include <string.h>
#include "fa_proj.h"
#include "fa_rnn.h"

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#define FA_RNN_AVX2 1
#include <immintrin.h>
#define AVX2 __attribute__((target("avx2,fma")))
#include "fa_exp_avx2.h"
#include "fa_tanh_avx2.h"
#include "fa_sig_avx2.h"
#else
#define FA_RNN_AVX2 0
#endif

int fa_rnn_gates(int cell)
{
    switch (cell) {
    case FA_RNN_TANH:
    case FA_RNN_RELU:
        return 1;
    case FA_RNN_GRU:
        return 3;
    case FA_RNN_LSTM:
        return 4;
    default:
        return 0;
    }
}

/* One row's gates from column j on: gi = xw row, gh = h W_hh^T + b_hh row,
 * h (and c) updated in place. */
typedef void (*row_f32_fn)(int64_t j, int64_t H, const float *gi, const float *gh, float *h, float *c);
typedef void (*row_f64_fn)(int64_t j, int64_t H, const double *gi, const double *gh, double *h, double *c);

/* ------------------------------------------------------------ scalar rows */

#define SCALAR_ROWS(T, SFX, EXP, TANH)                                                      \
    static inline T sig_##SFX(T x) { return (T)1 / ((T)1 + EXP(-x)); }                      \
    static void tanh_row_##SFX(int64_t j, int64_t H, const T *gi, const T *gh, T *h, T *c)  \
    {                                                                                       \
        (void)c;                                                                            \
        for (; j < H; j++)                                                                  \
            h[j] = TANH(gi[j] + gh[j]);                                                     \
    }                                                                                       \
    static void relu_row_##SFX(int64_t j, int64_t H, const T *gi, const T *gh, T *h, T *c)  \
    {                                                                                       \
        (void)c;                                                                            \
        for (; j < H; j++) {                                                                \
            T s = gi[j] + gh[j];                                                            \
            h[j] = s > 0 ? s : (s == s ? (T)0 : s); /* NaN stays NaN */                     \
        }                                                                                   \
    }                                                                                       \
    static void gru_row_##SFX(int64_t j, int64_t H, const T *gi, const T *gh, T *h, T *c)   \
    {                                                                                       \
        (void)c;                                                                            \
        for (; j < H; j++) {                                                                \
            T r = sig_##SFX(gi[j] + gh[j]);                                                 \
            T z = sig_##SFX(gi[H + j] + gh[H + j]);                                         \
            T n = TANH(gi[2 * H + j] + r * gh[2 * H + j]);                                  \
            h[j] = n + z * (h[j] - n);                                                      \
        }                                                                                   \
    }                                                                                       \
    static void lstm_row_##SFX(int64_t j, int64_t H, const T *gi, const T *gh, T *h, T *c)  \
    {                                                                                       \
        for (; j < H; j++) {                                                                \
            T i = sig_##SFX(gi[j] + gh[j]);                                                 \
            T f = sig_##SFX(gi[H + j] + gh[H + j]);                                         \
            T g = TANH(gi[2 * H + j] + gh[2 * H + j]);                                      \
            T o = sig_##SFX(gi[3 * H + j] + gh[3 * H + j]);                                 \
            T cn = f * c[j] + i * g;                                                        \
            c[j] = cn;                                                                      \
            h[j] = o * TANH(cn);                                                            \
        }                                                                                   \
    }

SCALAR_ROWS(float, f32, expf, tanhf)
SCALAR_ROWS(double, f64, exp, tanh)

/* -------------------------------------------------------------- AVX2 rows */

#if FA_RNN_AVX2
#define LF(p) _mm256_loadu_ps(p)
#define LD(p) _mm256_loadu_pd(p)

AVX2 static void tanh_row_f32_avx2(int64_t j, int64_t H, const float *gi, const float *gh, float *h, float *c)
{
    for (; j + 8 <= H; j += 8)
        _mm256_storeu_ps(h + j, tanh8_f32(_mm256_add_ps(LF(gi + j), LF(gh + j))));
    tanh_row_f32(j, H, gi, gh, h, c);
}

AVX2 static void gru_row_f32_avx2(int64_t j, int64_t H, const float *gi, const float *gh, float *h, float *c)
{
    for (; j + 8 <= H; j += 8) {
        __m256 r = sig8(_mm256_add_ps(LF(gi + j), LF(gh + j)));
        __m256 z = sig8(_mm256_add_ps(LF(gi + H + j), LF(gh + H + j)));
        __m256 n = tanh8_f32(_mm256_add_ps(LF(gi + 2 * H + j), _mm256_mul_ps(r, LF(gh + 2 * H + j))));
        _mm256_storeu_ps(h + j, _mm256_add_ps(n, _mm256_mul_ps(z, _mm256_sub_ps(LF(h + j), n))));
    }
    gru_row_f32(j, H, gi, gh, h, c);
}

AVX2 static void lstm_row_f32_avx2(int64_t j, int64_t H, const float *gi, const float *gh, float *h, float *c)
{
    for (; j + 8 <= H; j += 8) {
        __m256 i = sig8(_mm256_add_ps(LF(gi + j), LF(gh + j)));
        __m256 f = sig8(_mm256_add_ps(LF(gi + H + j), LF(gh + H + j)));
        __m256 g = tanh8_f32(_mm256_add_ps(LF(gi + 2 * H + j), LF(gh + 2 * H + j)));
        __m256 o = sig8(_mm256_add_ps(LF(gi + 3 * H + j), LF(gh + 3 * H + j)));
        __m256 cn = _mm256_add_ps(_mm256_mul_ps(f, LF(c + j)), _mm256_mul_ps(i, g));
        _mm256_storeu_ps(c + j, cn);
        _mm256_storeu_ps(h + j, _mm256_mul_ps(o, tanh8_f32(cn)));
    }
    lstm_row_f32(j, H, gi, gh, h, c);
}

AVX2 static void tanh_row_f64_avx2(int64_t j, int64_t H, const double *gi, const double *gh, double *h, double *c)
{
    for (; j + 4 <= H; j += 4)
        _mm256_storeu_pd(h + j, tanh4_f64(_mm256_add_pd(LD(gi + j), LD(gh + j))));
    tanh_row_f64(j, H, gi, gh, h, c);
}

AVX2 static void gru_row_f64_avx2(int64_t j, int64_t H, const double *gi, const double *gh, double *h, double *c)
{
    for (; j + 4 <= H; j += 4) {
        __m256d r = sig4(_mm256_add_pd(LD(gi + j), LD(gh + j)));
        __m256d z = sig4(_mm256_add_pd(LD(gi + H + j), LD(gh + H + j)));
        __m256d n = tanh4_f64(_mm256_add_pd(LD(gi + 2 * H + j), _mm256_mul_pd(r, LD(gh + 2 * H + j))));
        _mm256_storeu_pd(h + j, _mm256_add_pd(n, _mm256_mul_pd(z, _mm256_sub_pd(LD(h + j), n))));
    }
    gru_row_f64(j, H, gi, gh, h, c);
}

AVX2 static void lstm_row_f64_avx2(int64_t j, int64_t H, const double *gi, const double *gh, double *h, double *c)
{
    for (; j + 4 <= H; j += 4) {
        __m256d i = sig4(_mm256_add_pd(LD(gi + j), LD(gh + j)));
        __m256d f = sig4(_mm256_add_pd(LD(gi + H + j), LD(gh + H + j)));
        __m256d g = tanh4_f64(_mm256_add_pd(LD(gi + 2 * H + j), LD(gh + 2 * H + j)));
        __m256d o = sig4(_mm256_add_pd(LD(gi + 3 * H + j), LD(gh + 3 * H + j)));
        __m256d cn = _mm256_add_pd(_mm256_mul_pd(f, LD(c + j)), _mm256_mul_pd(i, g));
        _mm256_storeu_pd(c + j, cn);
        _mm256_storeu_pd(h + j, _mm256_mul_pd(o, tanh4_f64(cn)));
    }
    lstm_row_f64(j, H, gi, gh, h, c);
}
#endif

static row_f32_fn pick_f32(int cell, int simd)
{
#if FA_RNN_AVX2
    if (simd) {
        switch (cell) {
        case FA_RNN_TANH: return tanh_row_f32_avx2;
        case FA_RNN_GRU: return gru_row_f32_avx2;
        case FA_RNN_LSTM: return lstm_row_f32_avx2;
        default: break;
        }
    }
#else
    (void)simd;
#endif
    switch (cell) {
    case FA_RNN_TANH: return tanh_row_f32;
    case FA_RNN_RELU: return relu_row_f32;
    case FA_RNN_GRU: return gru_row_f32;
    case FA_RNN_LSTM: return lstm_row_f32;
    default: return NULL;
    }
}

static row_f64_fn pick_f64(int cell, int simd)
{
#if FA_RNN_AVX2
    if (simd) {
        switch (cell) {
        case FA_RNN_TANH: return tanh_row_f64_avx2;
        case FA_RNN_GRU: return gru_row_f64_avx2;
        case FA_RNN_LSTM: return lstm_row_f64_avx2;
        default: break;
        }
    }
#else
    (void)simd;
#endif
    switch (cell) {
    case FA_RNN_TANH: return tanh_row_f64;
    case FA_RNN_RELU: return relu_row_f64;
    case FA_RNN_GRU: return gru_row_f64;
    case FA_RNN_LSTM: return lstm_row_f64;
    default: return NULL;
    }
}

/* ------------------------------------------------------------- time loop */

/* The loop is the same for both precisions; GH_PRODUCT(m) fills G (m x GH,
 * row stride GH) with h[b0 .. b0+m) W_hh^T + b_hh. */
#define RNN_LOOP(TY, ROW, GH_PRODUCT)                                                          \
    const int64_t H = a->H, GH = (int64_t)fa_rnn_gates(a->cell) * H, m = b1 - b0;            \
    const TY *xw = (const TY *)a->xw;                                                           \
    TY *h = (TY *)a->h + b0 * H;                                                                \
    TY *c = a->c ? (TY *)a->c + b0 * H : NULL;                                                  \
    TY *out = (TY *)a->out;                                                                     \
    for (int64_t s = 0; s < a->T; s++) {                                                      \
        const int64_t t = a->reverse ? a->T - 1 - s : s;                                      \
        int64_t live = m;                                                                     \
        if (a->lengths) {                                                                     \
            live = 0;                                                                         \
            for (int64_t r = 0; r < m; r++)                                                   \
                live += t < a->lengths[b0 + r];                                               \
        }                                                                                     \
        if (live) {                                                                           \
            GH_PRODUCT(m);                                                                    \
        }                                                                                     \
        for (int64_t r = 0; r < m; r++) {                                                     \
            const int64_t b = b0 + r;                                                         \
            TY *o = out ? out + b * a->out_bs + t * a->out_ts : NULL;                          \
            if (a->lengths && t >= a->lengths[b]) {                                           \
                if (o)                                                                        \
                    memset(o, 0, (size_t)H * sizeof(TY));                                      \
                continue;                                                                     \
            }                                                                                 \
            if (a->gates)                                                                     \
                memcpy((TY *)a->gates + b * a->gates_bs + t * a->gates_ts, G + r * GH,        \
                       (size_t)GH * sizeof(TY));                                              \
            ROW(0, H, xw + b * a->xw_bs + t * a->xw_ts, G + r * GH, h + r * H,                \
                c ? c + r * H : NULL);                                                        \
            if (o)                                                                            \
                memcpy(o, h + r * H, (size_t)H * sizeof(TY));                                  \
        }                                                                                     \
    }

static int check_args(const fa_rnn_args *a, int64_t b0, int64_t b1)
{
    if (!a || fa_rnn_gates(a->cell) == 0 || a->B < 1 || a->T < 1 || a->H < 1 || b0 < 0 ||
        b1 > a->B || b0 >= b1 || !a->xw || !a->whh || !a->h || a->ldw < a->H ||
        (a->cell == FA_RNN_LSTM && !a->c))
        return FA_RNN_EINVAL;
    /* the gemm's sizes and leading dimensions are ints: G*H, rows, H, ldw */
    if (!fa_blas_fits((int64_t)fa_rnn_gates(a->cell) * a->H) || !fa_blas_fits(a->B) ||
        !fa_blas_fits(a->ldw))
        return FA_RNN_EINVAL;
    return 0;
}

/* G = bias rows (or 0), ready for a gemm with beta = 1 */
#define FILL_BIAS(T, m)                                                                       \
    for (int64_t r = 0; r < (m); r++) {                                                       \
        if (bhh)                                                                              \
            memcpy(G + r * GH, bhh, (size_t)GH * sizeof(T));                                  \
        else                                                                                  \
            memset(G + r * GH, 0, (size_t)GH * sizeof(T));                                    \
    }

int fa_rnn_f32(const fa_rnn_args *a, int64_t b0, int64_t b1, float *G)
{
    if (check_args(a, b0, b1) || !G)
        return FA_RNN_EINVAL;
    const row_f32_fn row = pick_f32(a->cell, a->simd);
    const float *whh = (const float *)a->whh, *bhh = (const float *)a->bhh;
    const int packed = a->wpack && a->simd && fa_proj_packed_available();
    const int small = !packed && a->simd && (b1 - b0) <= a->small_m && fa_proj_small_available();
    if (!packed && !small && !a->sgemm)
        return FA_RNN_EINVAL;
    int status = 0;
    int gn = (int)((int64_t)fa_rnn_gates(a->cell) * a->H), gm = (int)(b1 - b0), gk = (int)a->H;
    int ldw = (int)a->ldw, ldh = (int)a->H, ldg = gn;
    float one = 1.0f;
    char tt = 'T', tn = 'N';
#define PRODUCT_F32(m)                                                                        \
    if (packed) {                                                                             \
        if (fa_proj_packed_f32((m), GH, H, h, H, a->wpack, 0, bhh, G, GH, a->simd >= 2))      \
            status = FA_RNN_EINVAL;                                                           \
    } else if (small) {                                                                       \
        fa_proj_small_f32((m), GH, H, h, H, whh, a->ldw, bhh, G, GH);                        \
    } else {                                                                                  \
        FILL_BIAS(float, m)                                                                   \
        a->sgemm(&tt, &tn, &gn, &gm, &gk, &one, (float *)whh, &ldw, h, &ldh, &one, G, &ldg);  \
    }
    RNN_LOOP(float, row, PRODUCT_F32)
#undef PRODUCT_F32
    return status;
}

int fa_rnn_f64(const fa_rnn_args *a, int64_t b0, int64_t b1, double *G)
{
    if (check_args(a, b0, b1) || !G || !a->dgemm)
        return FA_RNN_EINVAL;
    const row_f64_fn row = pick_f64(a->cell, a->simd);
    const double *whh = (const double *)a->whh, *bhh = (const double *)a->bhh;
    int gn = (int)((int64_t)fa_rnn_gates(a->cell) * a->H), gm = (int)(b1 - b0), gk = (int)a->H;
    int ldw = (int)a->ldw, ldh = (int)a->H, ldg = gn;
    double one = 1.0;
    char tt = 'T', tn = 'N';
#define PRODUCT_F64(m)                                                                        \
    FILL_BIAS(double, m)                                                                      \
    a->dgemm(&tt, &tn, &gn, &gm, &gk, &one, (double *)whh, &ldw, h, &ldh, &one, G, &ldg);
    RNN_LOOP(double, row, PRODUCT_F64)
#undef PRODUCT_F64
    return 0;
}

/* --------------------------------------------------------------- one step */

/* y (m x n, ldy) = x (m x k, ldx) w (n x k, ldw)^T + b (or 0) */
static void prod_f32(const fa_cell_args *a, int64_t m, int64_t n, int64_t k, const float *x,
                     int64_t ldx, const float *w, int64_t ldw, const float *b, float *y, int64_t ldy)
{
    if (a->simd && m <= a->small_m && fa_proj_small_available()) {
        fa_proj_small_f32(m, n, k, x, ldx, w, ldw, b, y, ldy);
        return;
    }
    for (int64_t r = 0; r < m; r++) {
        if (b)
            memcpy(y + r * ldy, b, (size_t)n * sizeof(float));
        else
            memset(y + r * ldy, 0, (size_t)n * sizeof(float));
    }
    int gn = (int)n, gm = (int)m, gk = (int)k, lw = (int)ldw, lx = (int)ldx, ly = (int)ldy;
    float one = 1.0f;
    char tt = 'T', tn = 'N';
    a->sgemm(&tt, &tn, &gn, &gm, &gk, &one, (float *)w, &lw, (float *)x, &lx, &one, y, &ly);
}

static void prod_f64(const fa_cell_args *a, int64_t m, int64_t n, int64_t k, const double *x,
                     int64_t ldx, const double *w, int64_t ldw, const double *b, double *y, int64_t ldy)
{
    for (int64_t r = 0; r < m; r++) {
        if (b)
            memcpy(y + r * ldy, b, (size_t)n * sizeof(double));
        else
            memset(y + r * ldy, 0, (size_t)n * sizeof(double));
    }
    int gn = (int)n, gm = (int)m, gk = (int)k, lw = (int)ldw, lx = (int)ldx, ly = (int)ldy;
    double one = 1.0;
    char tt = 'T', tn = 'N';
    a->dgemm(&tt, &tn, &gn, &gm, &gk, &one, (double *)w, &lw, (double *)x, &lx, &one, y, &ly);
}

static int check_cell(const fa_cell_args *a, int64_t u0, int64_t u1)
{
    if (!a || fa_rnn_gates(a->cell) == 0 || a->B < 1 || a->H < 1 || a->nin < 1 || u0 < 0 ||
        u1 > a->H || u0 >= u1 || !a->x || !a->wih || !a->whh || !a->h0 || !a->h1 ||
        a->ldx < a->nin || a->ldwi < a->nin || a->ldwh < a->H ||
        (a->cell == FA_RNN_LSTM && (!a->c0 || !a->c1)))
        return FA_RNN_EINVAL;
    /* the gemms' sizes and leading dimensions are ints (G * units <= G*H) */
    if (!fa_blas_fits((int64_t)fa_rnn_gates(a->cell) * a->H) || !fa_blas_fits(a->B) ||
        !fa_blas_fits(a->nin) || !fa_blas_fits(a->ldx) || !fa_blas_fits(a->ldwi) ||
        !fa_blas_fits(a->ldwh))
        return FA_RNN_EINVAL;
    return 0;
}

/* Scratch layout: GI then GH, each B rows of G blocks of nu numbers (gate
 * stride nu), which is the layout the row functions read with H = nu. */
#define CELL_BODY(TY, PROD, ROW)                                                              \
    const int64_t G = fa_rnn_gates(a->cell), H = a->H, B = a->B, nu = u1 - u0;               \
    const TY *x = (const TY *)a->x, *wih = (const TY *)a->wih, *whh = (const TY *)a->whh;     \
    const TY *bih = (const TY *)a->bih, *bhh = (const TY *)a->bhh;                            \
    const TY *h0 = (const TY *)a->h0, *c0 = (const TY *)a->c0;                                \
    TY *h1 = (TY *)a->h1, *c1 = (TY *)a->c1;                                                  \
    TY *GI = scratch, *GH = scratch + B * G * nu;                                             \
    for (int64_t g = 0; g < G; g++) {                                                         \
        const int64_t r0 = g * H + u0;                                                        \
        PROD(a, B, nu, a->nin, x, a->ldx, wih + r0 * a->ldwi, a->ldwi, bih ? bih + r0 : NULL,  \
             GI + g * nu, G * nu);                                                            \
        PROD(a, B, nu, H, h0, H, whh + r0 * a->ldwh, a->ldwh, bhh ? bhh + r0 : NULL,         \
             GH + g * nu, G * nu);                                                            \
    }                                                                                         \
    for (int64_t b = 0; b < B; b++) {                                                         \
        memcpy(h1 + b * H + u0, h0 + b * H + u0, (size_t)nu * sizeof(TY));                   \
        if (c1)                                                                               \
            memcpy(c1 + b * H + u0, c0 + b * H + u0, (size_t)nu * sizeof(TY));               \
        ROW(0, nu, GI + b * G * nu, GH + b * G * nu, h1 + b * H + u0,                        \
            c1 ? c1 + b * H + u0 : NULL);                                                     \
    }

int fa_rnn_cell_f32(const fa_cell_args *a, int64_t u0, int64_t u1, float *scratch)
{
    if (check_cell(a, u0, u1) || !scratch)
        return FA_RNN_EINVAL;
    if (!(a->simd && a->B <= a->small_m && fa_proj_small_available()) && !a->sgemm)
        return FA_RNN_EINVAL;
    const row_f32_fn row = pick_f32(a->cell, a->simd);
    CELL_BODY(float, prod_f32, row)
    return 0;
}

int fa_rnn_cell_f64(const fa_cell_args *a, int64_t u0, int64_t u1, double *scratch)
{
    if (check_cell(a, u0, u1) || !scratch || !a->dgemm)
        return FA_RNN_EINVAL;
    const row_f64_fn row = pick_f64(a->cell, a->simd);
    CELL_BODY(double, prod_f64, row)
    return 0;
}

/* ------------------------------------------------------- unit-split scan */

#if FA_RNN_AVX2
#define FA_SPIN_PAUSE() _mm_pause()
#else
#define FA_SPIN_PAUSE() ((void)0)
#endif
#include <sched.h>

static void wait_step_done(const int *done, int64_t nb)
{
    unsigned spins = 0;
    while (__atomic_load_n(done, __ATOMIC_ACQUIRE) < nb) {
        FA_SPIN_PAUSE();
        if (++spins > 4096) { /* the partner was descheduled mid-block */
            sched_yield();
            spins = 0;
        }
    }
}

/* Block j of step s: units [u0, u1) of h_s from the whole of h_{s-1}. */
#define SPLIT_BLOCK(TY, PROD, ROW)                                                            \
    {                                                                                         \
        const int64_t u0 = j * sp->units;                                                    \
        const int64_t u1 = u0 + sp->units < H ? u0 + sp->units : H, nu = u1 - u0;           \
        const int64_t t = a->reverse ? T - 1 - s : s;                                         \
        const TY *hp = hb + ((s + 1) & 1) * B * H;                                            \
        TY *hn = hb + (s & 1) * B * H;                                                        \
        TY *GI = scratch, *GHs = scratch + B * G * nu;                                        \
        int64_t live = B;                                                                     \
        if (a->lengths) {                                                                     \
            live = 0;                                                                         \
            for (int64_t r = 0; r < B; r++)                                                   \
                live += t < a->lengths[r];                                                    \
        }                                                                                     \
        if (live)                                                                             \
            for (int64_t g = 0; g < G; g++)                                                   \
                PROD(&ca, B, nu, H, hp, H, whh + (g * H + u0) * a->ldw, a->ldw,              \
                     bhh ? bhh + g * H + u0 : NULL, GHs + g * nu, G * nu);                   \
        for (int64_t r = 0; r < B; r++) {                                                     \
            TY *o = out ? out + r * a->out_bs + t * a->out_ts + u0 : NULL;                    \
            memcpy(hn + r * H + u0, hp + r * H + u0, (size_t)nu * sizeof(TY));                \
            if (a->lengths && t >= a->lengths[r]) {                                           \
                if (o)                                                                        \
                    memset(o, 0, (size_t)nu * sizeof(TY));                                    \
                continue;                                                                     \
            }                                                                                 \
            const TY *xr = xw + r * a->xw_bs + t * a->xw_ts;                                  \
            for (int64_t g = 0; g < G; g++)                                                   \
                memcpy(GI + r * G * nu + g * nu, xr + g * H + u0, (size_t)nu * sizeof(TY));   \
            if (a->gates)                                                                     \
                for (int64_t g = 0; g < G; g++)                                               \
                    memcpy((TY *)a->gates + r * a->gates_bs + t * a->gates_ts + g * H + u0,   \
                           GHs + r * G * nu + g * nu, (size_t)nu * sizeof(TY));               \
            ROW(0, nu, GI + r * G * nu, GHs + r * G * nu, hn + r * H + u0,                    \
                c ? c + r * H + u0 : NULL);                                                   \
            if (o)                                                                            \
                memcpy(o, hn + r * H + u0, (size_t)nu * sizeof(TY));                          \
        }                                                                                     \
    }

#define SPLIT_LOOP(TY, PROD, ROW)                                                             \
    const int64_t G = fa_rnn_gates(a->cell), H = a->H, B = a->B, T = a->T, nb = sp->nb;     \
    const TY *xw = (const TY *)a->xw, *whh = (const TY *)a->whh, *bhh = (const TY *)a->bhh;  \
    TY *hb = (TY *)sp->hbuf, *c = (TY *)a->c, *out = (TY *)a->out;                            \
    fa_cell_args ca; /* what prod_* reads: simd, small_m and the gemms */                     \
    memset(&ca, 0, sizeof ca);                                                                \
    ca.simd = a->simd;                                                                        \
    ca.small_m = a->small_m;                                                                  \
    ca.sgemm = a->sgemm;                                                                      \
    ca.dgemm = a->dgemm;                                                                      \
    for (int64_t s = 0; s < T; s++) {                                                         \
        if (s > 0)                                                                            \
            wait_step_done(&sp->done[s - 1], nb);                                             \
        for (int64_t q = 0; q < nb; q++) {                                                    \
            const int64_t j = (prefer + q) % nb;                                              \
            if (__atomic_exchange_n(&sp->claimed[s * nb + j], 1, __ATOMIC_ACQ_REL))           \
                continue;                                                                     \
            SPLIT_BLOCK(TY, PROD, ROW)                                                        \
            __atomic_add_fetch(&sp->done[s], 1, __ATOMIC_RELEASE);                            \
        }                                                                                     \
    }

static int check_split(const fa_rnn_args *a, const fa_rnn_split *sp)
{
    if (check_args(a, 0, a ? a->B : 0) || !sp || sp->nb < 1 || sp->units < 1 ||
        sp->nb * sp->units < a->H || (sp->nb - 1) * sp->units >= a->H || !sp->claimed ||
        !sp->done || !sp->hbuf)
        return FA_RNN_EINVAL;
    return 0;
}

int fa_rnn_split_f32(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, float *scratch)
{
    if (check_split(a, sp) || !scratch || prefer < 0)
        return FA_RNN_EINVAL;
    if (!(a->simd && a->B <= a->small_m && fa_proj_small_available()) && !a->sgemm)
        return FA_RNN_EINVAL;
    const row_f32_fn row = pick_f32(a->cell, a->simd);
    SPLIT_LOOP(float, prod_f32, row)
    return 0;
}

int fa_rnn_split_f64(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, double *scratch)
{
    if (check_split(a, sp) || !scratch || prefer < 0 || !a->dgemm)
        return FA_RNN_EINVAL;
    const row_f64_fn row = pick_f64(a->cell, a->simd);
    SPLIT_LOOP(double, prod_f64, row)
    return 0;
}
