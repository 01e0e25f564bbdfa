/*
 * Backpropagation through time of the RNN recurrence (fa_rnn.h, "backward").
 *
 * Per block of rows and per step, in the backward order: every row's gates
 * recomputed from xw and gh (the forward's sigmoid and tanh: fa_sig_avx2.h,
 * fa_tanh_avx2.h with AVX2/FMA, libm's otherwise), its gate gradients written
 * to dxw / dgh, dh replaced by the part that bypasses the product (GRU: d z;
 * otherwise 0), then one product d(hidden gates) W_hh for the block's rows
 * added to it -- fa_proj.c's packed AVX2 kernel on W_hh^T packed once
 * (float32), or one gemm.  LSTM first runs the cell states of all steps
 * forward (fa_rnn_bwd_cstate_*), elementwise, into the block's scratch.
 *
 * With d = dh + dL/d(out_t), the cells' derivatives (torch's equations):
 *   tanh:  da = d (1 - h^2);  relu: da = d [a > 0];   dh_prev = da W
 *   GRU:   dn = d (1 - z), dz = d (h_prev - n), dan = dn (1 - n^2),
 *          dar = dan (W_hn h + b_hn) r (1 - r), daz = dz z (1 - z);
 *          dxw = [dar, daz, dan], dgh = [dar, daz, dan r],
 *          dh_prev = d z + dgh W
 *   LSTM:  dc_t = dc + d o (1 - tanh(c)^2); di = dc_t g i (1 - i),
 *          df = dc_t c_prev f (1 - f), dg = dc_t i (1 - g^2),
 *          do = d tanh(c) o (1 - o); dc_prev = dc_t f, dh_prev = dxw W
 * No -ffast-math (and ISO C: no contraction into FMAs), NaN propagates.
 *
 * dL/db_hh: each block sums its rows of dgh in float64 (in its fixed order).
 * dL/dW_hh is not formed here: fastattn._recurrence computes it after the
 * loop, one product over all B*T rows of dgh and hprev (float32 runs of
 * DW_CHUNK rows summed in float64).
 *
 * Scratch of a block of m rows: P (m x H, the product), a zero row (G*H: no
 * bias, no output gradient, no c0), X (m x G*H: the gemm's rows when their
 * stride exceeds an int), and for LSTM the cell states (m x T x H).
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

int64_t fa_rnn_bwd_scratch(int cell, int64_t rows, int64_t T, int64_t H)
{
    const int64_t GH = (int64_t)fa_rnn_gates(cell) * H;
    return rows * H + GH + rows * GH + (cell == FA_RNN_LSTM ? rows * T * H : 0);
}

/* One row of one step from column j on.  xi: the xw row; gh, bh: the hidden
 * pre-activation row and the bias added to it; hp: h_prev (GRU); cp, cn:
 * c_prev and c_t (LSTM); go: dL/d(out_t) row; dh: d in (without go), the
 * direct part out; dc: LSTM's in / out; dx, dg: the gradient rows. */
#define BWD_ROW_ARGS(TY)                                                                      \
    int64_t j, int64_t H, const TY *xi, const TY *gh, const TY *bh, const TY *hp,             \
    const TY *cp, const TY *cn, const TY *go, TY *dh, TY *dc, TY *dx, TY *dg
typedef void (*bwd_row_f32_fn)(BWD_ROW_ARGS(float));
typedef void (*bwd_row_f64_fn)(BWD_ROW_ARGS(double));
/* LSTM's cell state: cn = f cp + i g */
typedef void (*c_row_f32_fn)(int64_t j, int64_t H, const float *xi, const float *gh,
                             const float *bh, const float *cp, float *cn);
typedef void (*c_row_f64_fn)(int64_t j, int64_t H, const double *xi, const double *gh,
                             const double *bh, const double *cp, double *cn);

/* ------------------------------------------------------------ scalar rows */

#define SCALAR_BWD(TY, SFX, EXP, TANH)                                                        \
    static inline TY bsig_##SFX(TY x) { return (TY)1 / ((TY)1 + EXP(-x)); }                  \
    static void tanh_bwd_##SFX(BWD_ROW_ARGS(TY))                                              \
    {                                                                                         \
        (void)hp; (void)cp; (void)cn; (void)dc; (void)dg;                                     \
        for (; j < H; j++) {                                                                  \
            const TY h = TANH(xi[j] + (gh[j] + bh[j]));                                       \
            const TY d = dh[j] + go[j];                                                       \
            dx[j] = d * ((TY)1 - h * h);                                                      \
            dh[j] = 0;                                                                        \
        }                                                                                     \
    }                                                                                         \
    static void relu_bwd_##SFX(BWD_ROW_ARGS(TY))                                              \
    {                                                                                         \
        (void)hp; (void)cp; (void)cn; (void)dc; (void)dg;                                     \
        for (; j < H; j++) {                                                                  \
            const TY s = xi[j] + (gh[j] + bh[j]);                                             \
            const TY d = dh[j] + go[j];                                                       \
            dx[j] = d * (s > 0 ? (TY)1 : (TY)0);                                              \
            dh[j] = 0;                                                                        \
        }                                                                                     \
    }                                                                                         \
    static void gru_bwd_##SFX(BWD_ROW_ARGS(TY))                                               \
    {                                                                                         \
        (void)cp; (void)cn; (void)dc;                                                         \
        for (; j < H; j++) {                                                                  \
            const TY r = bsig_##SFX(xi[j] + (gh[j] + bh[j]));                                 \
            const TY z = bsig_##SFX(xi[H + j] + (gh[H + j] + bh[H + j]));                     \
            const TY hn = gh[2 * H + j] + bh[2 * H + j];                                      \
            const TY n = TANH(xi[2 * H + j] + r * hn);                                        \
            const TY d = dh[j] + go[j];                                                       \
            const TY dan = d * ((TY)1 - z) * ((TY)1 - n * n);                                 \
            const TY dar = dan * hn * r * ((TY)1 - r);                                        \
            const TY daz = d * (hp[j] - n) * z * ((TY)1 - z);                                 \
            dx[j] = dar;                                                                      \
            dx[H + j] = daz;                                                                  \
            dx[2 * H + j] = dan;                                                              \
            dg[j] = dar;                                                                      \
            dg[H + j] = daz;                                                                  \
            dg[2 * H + j] = dan * r;                                                          \
            dh[j] = d * z;                                                                    \
        }                                                                                     \
    }                                                                                         \
    static void lstm_bwd_##SFX(BWD_ROW_ARGS(TY))                                              \
    {                                                                                         \
        (void)hp; (void)dg;                                                                   \
        for (; j < H; j++) {                                                                  \
            const TY i = bsig_##SFX(xi[j] + (gh[j] + bh[j]));                                 \
            const TY f = bsig_##SFX(xi[H + j] + (gh[H + j] + bh[H + j]));                     \
            const TY g = TANH(xi[2 * H + j] + (gh[2 * H + j] + bh[2 * H + j]));               \
            const TY o = bsig_##SFX(xi[3 * H + j] + (gh[3 * H + j] + bh[3 * H + j]));         \
            const TY tc = TANH(cn[j]);                                                        \
            const TY d = dh[j] + go[j];                                                       \
            const TY dct = dc[j] + d * o * ((TY)1 - tc * tc);                                 \
            dx[j] = dct * g * i * ((TY)1 - i);                                                \
            dx[H + j] = dct * cp[j] * f * ((TY)1 - f);                                        \
            dx[2 * H + j] = dct * i * ((TY)1 - g * g);                                        \
            dx[3 * H + j] = d * tc * o * ((TY)1 - o);                                         \
            dc[j] = dct * f;                                                                  \
            dh[j] = 0;                                                                        \
        }                                                                                     \
    }                                                                                         \
    static void lstm_c_##SFX(int64_t j, int64_t H, const TY *xi, const TY *gh, const TY *bh,  \
                             const TY *cp, TY *cn)                                            \
    {                                                                                         \
        for (; j < H; j++) {                                                                  \
            const TY i = bsig_##SFX(xi[j] + (gh[j] + bh[j]));                                 \
            const TY f = bsig_##SFX(xi[H + j] + (gh[H + j] + bh[H + j]));                     \
            const TY g = TANH(xi[2 * H + j] + (gh[2 * H + j] + bh[2 * H + j]));               \
            cn[j] = f * cp[j] + i * g;                                                        \
        }                                                                                     \
    }

SCALAR_BWD(float, f32, expf, tanhf)
SCALAR_BWD(double, f64, exp, tanh)

/* -------------------------------------------------------------- AVX2 rows */

#if FA_RNN_AVX2
#define V_f32 __m256
#define N_f32 8
#define LD_f32 _mm256_loadu_ps
#define ST_f32 _mm256_storeu_ps
#define ADD_f32 _mm256_add_ps
#define SUB_f32 _mm256_sub_ps
#define MUL_f32 _mm256_mul_ps
#define SET1_f32 _mm256_set1_ps
#define ZERO_f32 _mm256_setzero_ps
#define SIG_f32 sig8
#define TANH_f32 tanh8_f32
#define POS_f32(s, one) _mm256_and_ps(_mm256_cmp_ps((s), _mm256_setzero_ps(), _CMP_GT_OQ), (one))
#define V_f64 __m256d
#define N_f64 4
#define LD_f64 _mm256_loadu_pd
#define ST_f64 _mm256_storeu_pd
#define ADD_f64 _mm256_add_pd
#define SUB_f64 _mm256_sub_pd
#define MUL_f64 _mm256_mul_pd
#define SET1_f64 _mm256_set1_pd
#define ZERO_f64 _mm256_setzero_pd
#define SIG_f64 sig4
#define TANH_f64 tanh4_f64
#define POS_f64(s, one) _mm256_and_pd(_mm256_cmp_pd((s), _mm256_setzero_pd(), _CMP_GT_OQ), (one))

/* the same expressions as the scalar rows, in the same order; the tail of a
 * row (fewer than a vector) goes to the scalar row */
#define AVX2_BWD(TY, S)                                                                       \
    AVX2 static void tanh_bwd_##S##_avx2(BWD_ROW_ARGS(TY))                                    \
    {                                                                                         \
        const V_##S one = SET1_##S((TY)1);                                                    \
        for (; j + N_##S <= H; j += N_##S) {                                                  \
            V_##S h = TANH_##S(ADD_##S(LD_##S(xi + j), ADD_##S(LD_##S(gh + j), LD_##S(bh + j)))); \
            V_##S d = ADD_##S(LD_##S(dh + j), LD_##S(go + j));                                \
            ST_##S(dx + j, MUL_##S(d, SUB_##S(one, MUL_##S(h, h))));                          \
            ST_##S(dh + j, ZERO_##S());                                                       \
        }                                                                                     \
        tanh_bwd_##S(j, H, xi, gh, bh, hp, cp, cn, go, dh, dc, dx, dg);                       \
    }                                                                                         \
    AVX2 static void relu_bwd_##S##_avx2(BWD_ROW_ARGS(TY))                                    \
    {                                                                                         \
        const V_##S one = SET1_##S((TY)1);                                                    \
        for (; j + N_##S <= H; j += N_##S) {                                                  \
            V_##S s = ADD_##S(LD_##S(xi + j), ADD_##S(LD_##S(gh + j), LD_##S(bh + j)));       \
            V_##S d = ADD_##S(LD_##S(dh + j), LD_##S(go + j));                                \
            ST_##S(dx + j, MUL_##S(d, POS_##S(s, one)));                                      \
            ST_##S(dh + j, ZERO_##S());                                                       \
        }                                                                                     \
        relu_bwd_##S(j, H, xi, gh, bh, hp, cp, cn, go, dh, dc, dx, dg);                       \
    }                                                                                         \
    AVX2 static void gru_bwd_##S##_avx2(BWD_ROW_ARGS(TY))                                     \
    {                                                                                         \
        const V_##S one = SET1_##S((TY)1);                                                    \
        for (; j + N_##S <= H; j += N_##S) {                                                  \
            V_##S r = SIG_##S(ADD_##S(LD_##S(xi + j), ADD_##S(LD_##S(gh + j), LD_##S(bh + j)))); \
            V_##S z = SIG_##S(ADD_##S(LD_##S(xi + H + j),                                     \
                                      ADD_##S(LD_##S(gh + H + j), LD_##S(bh + H + j))));      \
            V_##S hn = ADD_##S(LD_##S(gh + 2 * H + j), LD_##S(bh + 2 * H + j));               \
            V_##S n = TANH_##S(ADD_##S(LD_##S(xi + 2 * H + j), MUL_##S(r, hn)));              \
            V_##S d = ADD_##S(LD_##S(dh + j), LD_##S(go + j));                                \
            V_##S dan = MUL_##S(MUL_##S(d, SUB_##S(one, z)), SUB_##S(one, MUL_##S(n, n)));    \
            V_##S dar = MUL_##S(MUL_##S(MUL_##S(dan, hn), r), SUB_##S(one, r));               \
            V_##S daz = MUL_##S(MUL_##S(MUL_##S(d, SUB_##S(LD_##S(hp + j), n)), z),           \
                                SUB_##S(one, z));                                             \
            ST_##S(dx + j, dar);                                                              \
            ST_##S(dx + H + j, daz);                                                          \
            ST_##S(dx + 2 * H + j, dan);                                                      \
            ST_##S(dg + j, dar);                                                              \
            ST_##S(dg + H + j, daz);                                                          \
            ST_##S(dg + 2 * H + j, MUL_##S(dan, r));                                          \
            ST_##S(dh + j, MUL_##S(d, z));                                                    \
        }                                                                                     \
        gru_bwd_##S(j, H, xi, gh, bh, hp, cp, cn, go, dh, dc, dx, dg);                        \
    }                                                                                         \
    AVX2 static void lstm_bwd_##S##_avx2(BWD_ROW_ARGS(TY))                                    \
    {                                                                                         \
        const V_##S one = SET1_##S((TY)1);                                                    \
        for (; j + N_##S <= H; j += N_##S) {                                                  \
            V_##S i = SIG_##S(ADD_##S(LD_##S(xi + j), ADD_##S(LD_##S(gh + j), LD_##S(bh + j)))); \
            V_##S f = SIG_##S(ADD_##S(LD_##S(xi + H + j),                                     \
                                      ADD_##S(LD_##S(gh + H + j), LD_##S(bh + H + j))));      \
            V_##S g = TANH_##S(ADD_##S(LD_##S(xi + 2 * H + j),                                \
                                       ADD_##S(LD_##S(gh + 2 * H + j), LD_##S(bh + 2 * H + j)))); \
            V_##S o = SIG_##S(ADD_##S(LD_##S(xi + 3 * H + j),                                 \
                                      ADD_##S(LD_##S(gh + 3 * H + j), LD_##S(bh + 3 * H + j)))); \
            V_##S tc = TANH_##S(LD_##S(cn + j));                                              \
            V_##S d = ADD_##S(LD_##S(dh + j), LD_##S(go + j));                                \
            V_##S dct = ADD_##S(LD_##S(dc + j),                                               \
                                MUL_##S(MUL_##S(d, o), SUB_##S(one, MUL_##S(tc, tc))));       \
            ST_##S(dx + j, MUL_##S(MUL_##S(MUL_##S(dct, g), i), SUB_##S(one, i)));            \
            ST_##S(dx + H + j,                                                                \
                   MUL_##S(MUL_##S(MUL_##S(dct, LD_##S(cp + j)), f), SUB_##S(one, f)));       \
            ST_##S(dx + 2 * H + j, MUL_##S(MUL_##S(dct, i), SUB_##S(one, MUL_##S(g, g))));    \
            ST_##S(dx + 3 * H + j, MUL_##S(MUL_##S(MUL_##S(d, tc), o), SUB_##S(one, o)));     \
            ST_##S(dc + j, MUL_##S(dct, f));                                                  \
            ST_##S(dh + j, ZERO_##S());                                                       \
        }                                                                                     \
        lstm_bwd_##S(j, H, xi, gh, bh, hp, cp, cn, go, dh, dc, dx, dg);                       \
    }                                                                                         \
    AVX2 static void lstm_c_##S##_avx2(int64_t j, int64_t H, const TY *xi, const TY *gh,      \
                                       const TY *bh, const TY *cp, TY *cn)                    \
    {                                                                                         \
        for (; j + N_##S <= H; j += N_##S) {                                                  \
            V_##S i = SIG_##S(ADD_##S(LD_##S(xi + j), ADD_##S(LD_##S(gh + j), LD_##S(bh + j)))); \
            V_##S f = SIG_##S(ADD_##S(LD_##S(xi + H + j),                                     \
                                      ADD_##S(LD_##S(gh + H + j), LD_##S(bh + H + j))));      \
            V_##S g = TANH_##S(ADD_##S(LD_##S(xi + 2 * H + j),                                \
                                       ADD_##S(LD_##S(gh + 2 * H + j), LD_##S(bh + 2 * H + j)))); \
            ST_##S(cn + j, ADD_##S(MUL_##S(f, LD_##S(cp + j)), MUL_##S(i, g)));               \
        }                                                                                     \
        lstm_c_##S(j, H, xi, gh, bh, cp, cn);                                                 \
    }

AVX2_BWD(float, f32)
AVX2_BWD(double, f64)
#endif

#if FA_RNN_AVX2
#define PICK_AVX2(S)                                                                          \
    if (simd) {                                                                               \
        switch (cell) {                                                                       \
        case FA_RNN_TANH: return tanh_bwd_##S##_avx2;                                         \
        case FA_RNN_RELU: return relu_bwd_##S##_avx2;                                         \
        case FA_RNN_GRU: return gru_bwd_##S##_avx2;                                           \
        case FA_RNN_LSTM: return lstm_bwd_##S##_avx2;                                         \
        default: return NULL;                                                                 \
        }                                                                                     \
    }
#else
#define PICK_AVX2(S) (void)simd;
#endif

#define PICK(S)                                                                               \
    PICK_AVX2(S)                                                                              \
    switch (cell) {                                                                           \
    case FA_RNN_TANH: return tanh_bwd_##S;                                                    \
    case FA_RNN_RELU: return relu_bwd_##S;                                                    \
    case FA_RNN_GRU: return gru_bwd_##S;                                                      \
    case FA_RNN_LSTM: return lstm_bwd_##S;                                                    \
    default: return NULL;                                                                     \
    }

static bwd_row_f32_fn pick_bwd_f32(int cell, int simd) { PICK(f32) }
static bwd_row_f64_fn pick_bwd_f64(int cell, int simd) { PICK(f64) }

static c_row_f32_fn pick_c_f32(int simd)
{
#if FA_RNN_AVX2
    if (simd)
        return lstm_c_f32_avx2;
#endif
    (void)simd;
    return lstm_c_f32;
}

static c_row_f64_fn pick_c_f64(int simd)
{
#if FA_RNN_AVX2
    if (simd)
        return lstm_c_f64_avx2;
#endif
    (void)simd;
    return lstm_c_f64;
}

/* ------------------------------------------------------------ the blocks */

static int check_bwd(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1)
{
    if (!a || fa_rnn_gates(a->cell) == 0 || a->B < 1 || a->T < 1 || a->H < 1 || b0 < 0 ||
        b1 > a->B || b0 >= b1 || !a->xw || !a->gh || !a->whh || a->ldw < a->H || !a->dxw ||
        !a->dh || (a->cell == FA_RNN_GRU && (!a->hprev || !a->dgh)) ||
        (a->cell == FA_RNN_LSTM && !a->dc))
        return FA_RNN_EINVAL;
    /* the gemm's sizes and leading dimensions are ints: G*H, rows, H, ldw */
    if (!fa_blas_fits((int64_t)fa_rnn_gates(a->cell) * a->H) || !fa_blas_fits(a->B) ||
        !fa_blas_fits(a->ldw))
        return FA_RNN_EINVAL;
    return 0;
}

/* The scratch of a block of m rows (fa_rnn_bwd_scratch), its zero row set. */
#define BWD_SCRATCH(TY)                                                                       \
    const int64_t G = fa_rnn_gates(a->cell), H = a->H, GH = G * H, T = a->T, m = b1 - b0;    \
    TY *P = scratch, *zero = scratch + m * H, *X = zero + GH, *cs = X + m * GH;               \
    memset(zero, 0, (size_t)GH * sizeof(TY));                                                 \
    const TY *xw = (const TY *)a->xw, *gh = (const TY *)a->gh;                                \
    const TY *bias = a->bhh ? (const TY *)a->bhh : zero;                                      \
    const TY *c0 = (const TY *)a->c0;                                                         \
    const int64_t *len = a->lengths;                                                          \
    (void)P; (void)X; (void)G;

/* c_prev of row r (batch row b) at step t: the state of the step before in
 * the forward's order, or c0 at the row's first step */
#define C_PREV(TY, cpv, r, b, t)                                                              \
    const int64_t tp = a->reverse ? (t) + 1 : (t) - 1;                                        \
    const TY *cpv = (tp < 0 || tp >= T || (len && tp >= len[b]))                               \
                       ? (c0 ? c0 + (b) * H : zero)                                           \
                       : cs + ((r) * T + tp) * H;

#define CSTATE_BODY(TY, CROW)                                                                 \
    BWD_SCRATCH(TY)                                                                           \
    for (int64_t s = 0; s < T; s++) {                                                         \
        const int64_t t = a->reverse ? T - 1 - s : s;                                         \
        for (int64_t r = 0; r < m; r++) {                                                     \
            const int64_t b = b0 + r;                                                         \
            if (len && t >= len[b])                                                           \
                continue;                                                                     \
            C_PREV(TY, cp, r, b, t)                                                           \
            CROW(0, H, xw + b * a->xw_bs + t * a->xw_ts, gh + (b * T + t) * GH, bias, cp,     \
                 cs + (r * T + t) * H);                                                       \
        }                                                                                     \
    }

int fa_rnn_bwd_cstate_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, float *scratch)
{
    if (check_bwd(a, b0, b1) || !scratch)
        return FA_RNN_EINVAL;
    if (a->cell != FA_RNN_LSTM)
        return 0;
    const c_row_f32_fn crow = pick_c_f32(a->simd);
    CSTATE_BODY(float, crow)
    return 0;
}

int fa_rnn_bwd_cstate_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, double *scratch)
{
    if (check_bwd(a, b0, b1) || !scratch)
        return FA_RNN_EINVAL;
    if (a->cell != FA_RNN_LSTM)
        return 0;
    const c_row_f64_fn crow = pick_c_f64(a->simd);
    CSTATE_BODY(double, crow)
    return 0;
}

/* PRODUCT(x, ldx): P (m x H) = x (m x G*H, row stride ldx) W_hh */
#define BWD_BODY(TY, ROW, PRODUCT)                                                            \
    BWD_SCRATCH(TY)                                                                           \
    const TY *hprev = (const TY *)a->hprev, *go = (const TY *)a->go;                          \
    TY *dxw = (TY *)a->dxw, *dgh = a->dgh ? (TY *)a->dgh : (TY *)a->dxw;                      \
    TY *dh = (TY *)a->dh + b0 * H, *dc = a->dc ? (TY *)a->dc + b0 * H : NULL;                 \
    const int gemm_rows_fit = fa_blas_fits(T * GH);                                           \
    double *db = a->db ? a->db + b0 * GH : NULL;                                              \
    for (int64_t s = s0; s < s1; s++) {                                                       \
        const int64_t t = a->reverse ? s : T - 1 - s;                                         \
        int64_t live = 0;                                                                     \
        for (int64_t r = 0; r < m; r++) {                                                     \
            const int64_t b = b0 + r;                                                         \
            TY *dx = dxw + (b * T + t) * GH, *dg = dgh + (b * T + t) * GH;                    \
            if (len && t >= len[b]) {                                                         \
                memset(dx, 0, (size_t)GH * sizeof(TY));                                       \
                if (dg != dx)                                                                 \
                    memset(dg, 0, (size_t)GH * sizeof(TY));                                   \
                continue;                                                                     \
            }                                                                                 \
            live++;                                                                           \
            const TY *cp = NULL, *cn = NULL;                                                  \
            if (a->cell == FA_RNN_LSTM) {                                                     \
                C_PREV(TY, cpl, r, b, t)                                                      \
                cp = cpl;                                                                     \
                cn = cs + (r * T + t) * H;                                                    \
            }                                                                                 \
            ROW(0, H, xw + b * a->xw_bs + t * a->xw_ts, gh + (b * T + t) * GH, bias,          \
                hprev ? hprev + (b * T + t) * H : zero, cp, cn,                               \
                go ? go + b * a->go_bs + t * a->go_ts : zero, dh + r * H, dc ? dc + r * H : NULL, \
                dx, dg);                                                                      \
            if (db)                                                                           \
                for (int64_t g = 0; g < GH; g++)                                              \
                    db[g] += (double)dg[g];                                                   \
        }                                                                                     \
        if (!live)                                                                            \
            continue;                                                                         \
        const TY *x = dgh + (b0 * T + t) * GH;                                                \
        int64_t ldx = T * GH;                                                                 \
        if (!a->wpack && !gemm_rows_fit) { /* rows too far apart for the gemm's int */        \
            for (int64_t r = 0; r < m; r++)                                                   \
                memcpy(X + r * GH, x + r * T * GH, (size_t)GH * sizeof(TY));                  \
            x = X;                                                                            \
            ldx = GH;                                                                         \
        }                                                                                     \
        PRODUCT(x, ldx)                                                                       \
        for (int64_t r = 0; r < m; r++) {                                                     \
            if (len && t >= len[b0 + r])                                                      \
                continue;                                                                     \
            TY *d = dh + r * H;                                                               \
            const TY *p = P + r * H;                                                          \
            for (int64_t j = 0; j < H; j++)                                                   \
                d[j] += p[j];                                                                 \
        }                                                                                     \
    }

int fa_rnn_bwd_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                   float *scratch)
{
    if (check_bwd(a, b0, b1) || !scratch || s0 < 0 || s1 > a->T || s0 > s1)
        return FA_RNN_EINVAL;
    if (a->wpack ? !(a->simd && fa_proj_packed_available()) : !a->sgemm)
        return FA_RNN_EINVAL;
    const bwd_row_f32_fn row = pick_bwd_f32(a->cell, a->simd);
    int status = 0;
    int gn = (int)a->H, gm = (int)(b1 - b0), gk = (int)((int64_t)fa_rnn_gates(a->cell) * a->H);
    int ldw = (int)a->ldw, ldp = (int)a->H;
    float one = 1.0f, zf = 0.0f;
    char tn = 'N';
#define PRODUCT_F32(x, ldx)                                                                   \
    if (a->wpack) {                                                                           \
        if (fa_proj_packed_f32(m, H, GH, (x), (ldx), a->wpack, 0, NULL, P, H, a->simd >= 2))  \
            status = FA_RNN_EINVAL;                                                           \
    } else {                                                                                  \
        int ld_ = (int)(ldx);                                                                 \
        a->sgemm(&tn, &tn, &gn, &gm, &gk, &one, (float *)a->whh, &ldw, (float *)(x), &ld_,    \
                 &zf, P, &ldp);                                                               \
    }
    BWD_BODY(float, row, PRODUCT_F32)
#undef PRODUCT_F32
    return status;
}

int fa_rnn_bwd_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                   double *scratch)
{
    if (check_bwd(a, b0, b1) || !scratch || s0 < 0 || s1 > a->T || s0 > s1 || !a->dgemm ||
        a->wpack)
        return FA_RNN_EINVAL;
    const bwd_row_f64_fn row = pick_bwd_f64(a->cell, a->simd);
    int gn = (int)a->H, gm = (int)(b1 - b0), gk = (int)((int64_t)fa_rnn_gates(a->cell) * a->H);
    int ldw = (int)a->ldw, ldp = (int)a->H;
    double one = 1.0, zd = 0.0;
    char tn = 'N';
#define PRODUCT_F64(x, ldx)                                                                   \
    {                                                                                         \
        int ld_ = (int)(ldx);                                                                 \
        a->dgemm(&tn, &tn, &gn, &gm, &gk, &one, (double *)a->whh, &ldw, (double *)(x), &ld_,  \
                 &zd, P, &ldp);                                                               \
    }
    BWD_BODY(double, row, PRODUCT_F64)
#undef PRODUCT_F64
    return 0;
}
