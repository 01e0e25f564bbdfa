/*
 * Internal row operations used by the softmax kernels, with runtime dispatch
 * between a portable scalar version and an AVX2/FMA version.
 */
#ifndef FA_ROWOPS_H
#define FA_ROWOPS_H

#include <math.h>
#include <stdint.h>

/* Natural-log log-sum-exp of a softmax row from its reference max m (the
 * value subtracted before the exponentials; 0 for a row whose max is -inf)
 * and its sum l = sum_j exp(s_j - m): m + log(l), -inf when l == 0 (no
 * allowed key).  In double, then rounded once. */
static inline double fa_row_lse(double m, double l)
{
    return l == 0.0 ? -INFINITY : m + log(l);
}

/* small_qk works on up to this many query rows as dot products (no K^T
 * scratch); above it, against K^T transposed into the caller's scratch. */
#define FA_SMALL_QK_DOT_ROWS 16

typedef struct {
    /* max over x[0..n) ignoring NaN; -inf for an empty or all-masked row */
    float (*rowmax_f32)(const float *x, int64_t n);
    double (*rowmax_f64)(const double *x, int64_t n);
    /* x[j] = exp(x[j] - m) in place, returns the sum (NaN propagates) */
    float (*expsub_sum_f32)(float *x, int64_t n, float m);
    double (*expsub_sum_f64)(double *x, int64_t n, double m);
    /* expsub for rows with masked (-inf) entries: those become exact zeros
     * without exp's subnormal path (which every -inf lane would take) */
    float (*expsub_masked_f32)(float *x, int64_t n, float m);
    double (*expsub_masked_f64)(double *x, int64_t n, double m);
    /* x[j] = -inf where the byte m[j] is 0 */
    void (*mask_bool_f32)(float *x, const unsigned char *m, int64_t n);
    void (*mask_bool_f64)(double *x, const unsigned char *m, int64_t n);
    void (*exp_f32)(const float *x, float *y, int64_t n);
    void (*exp_f64)(const double *x, double *y, int64_t n);
    /* S (m x n, lds) = scale * Q (m x d, ldq) . K (n x d, ldk)^T, without BLAS;
     * kt: scratch for d * n elements */
    void (*small_qk_f32)(int64_t m, int64_t n, int64_t d, float scale, const float *Q,
                         int64_t ldq, const float *K, int64_t ldk, float *S, int64_t lds,
                         float *kt);
    void (*small_qk_f64)(int64_t m, int64_t n, int64_t d, double scale, const double *Q,
                         int64_t ldq, const double *K, int64_t ldk, double *S, int64_t lds,
                         double *kt);
    /* O (m x dv, ldo) = P (m x n, ldp) . V (n x dv, ldv), without BLAS */
    void (*small_pv_f32)(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                         const float *V, int64_t ldv, float *O, int64_t ldo);
    void (*small_pv_f64)(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                         const double *V, int64_t ldv, double *O, int64_t ldo);
    /* Packed products for the streaming tiles.  pack_kt: kp = scale * K^T
     * (n keys x d) and pack_v: vp = V (n x dv) in the table's panel layout;
     * gemm_pb: C (m x ncols, ldc) = A (m x k, lda) . B (k x ncols) packed that
     * way, or C += when acc.  Packed buffers hold at most
     * FA_PACK_ROUND(cols) * k elements.  lim (NULL: none): row block r, rows
     * [FA_PACK_ROWS*r, FA_PACK_ROWS*(r+1)), needs only its first lim[r]
     * columns of C (lim_k = 0; the others are left unwritten) or only its
     * first lim[r] inner terms (lim_k = 1). */
    void (*pack_kt_f32)(int64_t n, int64_t d, float scale, const float *K, int64_t ldk, float *kp);
    void (*pack_kt_f64)(int64_t n, int64_t d, double scale, const double *K, int64_t ldk, double *kp);
    void (*pack_v_f32)(int64_t n, int64_t dv, const float *V, int64_t ldv, float *vp);
    void (*pack_v_f64)(int64_t n, int64_t dv, const double *V, int64_t ldv, double *vp);
    void (*gemm_pb_f32)(int64_t m, int64_t ncols, int64_t k, const float *A, int64_t lda,
                        const float *Bp, float *C, int64_t ldc, int acc,
                        const int64_t *lim, int lim_k);
    void (*gemm_pb_f64)(int64_t m, int64_t ncols, int64_t k, const double *A, int64_t lda,
                        const double *Bp, double *C, int64_t ldc, int acc,
                        const int64_t *lim, int lim_k);
    /* The backward's elementwise steps.  ds: g[j] = p[j] * (g[j] - dr), the
     * difference in double, then rounded; acc: acc[j] += t[j] (in double);
     * store: y[j] = acc[j] rounded; scale: x[j] *= f. */
    void (*bwd_ds_f32)(const float *p, float *g, double dr, int64_t n);
    void (*bwd_ds_f64)(const double *p, double *g, double dr, int64_t n);
    void (*bwd_acc_f32)(double *acc, const float *t, int64_t n);
    void (*bwd_acc_f64)(double *acc, const double *t, int64_t n);
    void (*bwd_store_f32)(float *y, const double *acc, int64_t n);
    void (*bwd_store_f64)(double *y, const double *acc, int64_t n);
    void (*scale_f32)(float *x, int64_t n, float f);
    void (*scale_f64)(double *x, int64_t n, double f);
    /* sum_j a[j] * b[j], the products and the sum in double */
    double (*dot64_f32)(const float *a, const float *b, int64_t n);
    double (*dot64_f64)(const double *a, const double *b, int64_t n);
    /* acc (M x N doubles, row stride ldacc) += alpha * A^T B, A (K x M, lda)
     * and B (K x N, ldb) row-major, each output one chain of K products from
     * zero, alpha times it rounded to the type, then added in double (the
     * backward's dV and dK chunks); NULL: the caller uses BLAS */
    void (*gemm_tn_acc_f32)(int64_t M, int64_t N, int64_t K, float alpha, const float *A,
                            int64_t lda, const float *B, int64_t ldb, double *acc, int64_t ldacc);
    void (*gemm_tn_acc_f64)(int64_t M, int64_t N, int64_t K, double alpha, const double *A,
                            int64_t lda, const double *B, int64_t ldb, double *acc,
                            int64_t ldacc);
} fa_rowops;

/* Rows per block of gemm_pb (the lim granularity). */
#define FA_PACK_ROWS 6

/* Columns of a packed operand, rounded up to whole panels (AVX2: 16 floats or
 * 8 doubles; AVX-512: 32 floats or 16 doubles; the larger for all tables). */
#define FA_PACK_ROUND(cols) (((cols) + 31) / 32 * 32)

/* The table in use (scalar, AVX2 or AVX-512), chosen by CPU detection, fa_simd_set_disabled
 * and fa_simd_set_max_level. */
const fa_rowops *fa_get_rowops(void);

/* 1 when no (query row, key) pair of the tile rows [i0, i0+m) x keys
 * [j0, j0+n) is allowed by the boolean mask mb (row stride ldm; 0: one key
 * mask for every query). */
static inline int fa_tile_masked_out(const unsigned char *mb, int64_t ldm, int64_t i0,
                                     int64_t m, int64_t j0, int64_t n)
{
    int64_t rows = ldm == 0 ? 1 : m;
    for (int64_t r = 0; r < rows; r++) {
        const unsigned char *mr = mb + (i0 + r) * ldm + j0;
        for (int64_t c = 0; c < n; c++)
            if (mr[c])
                return 0;
    }
    return 1;
}

/* The backward kernels' key groups (fa_sdpa_bwd_impl.h, fa_additive_bwd_impl.h):
 * split nkb key blocks of block_k keys into ngroups runs of about equal work
 * (the query rows of Lq that see each block: fewer for late blocks under
 * causality, where query i sees key j iff j <= i + causal_offset); group g is
 * blocks [gstart[g], gstart[g+1]).  A function of the shapes only. */
static inline void fa_bwd_key_groups(int causal, int64_t causal_offset, int64_t block_k,
                                     int64_t Lq, int64_t nkb, int64_t ngroups, int64_t *gstart)
{
    double total = 0;
    for (int64_t jb = 0; jb < nkb; jb++) {
        int64_t first = causal ? jb * block_k - causal_offset : 0;
        first = first < 0 ? 0 : first > Lq ? Lq : first;
        total += (double)(Lq - first) + 1.0;
    }
    gstart[0] = 0;
    double acc = 0;
    int64_t g = 1;
    for (int64_t jb = 0; jb < nkb && g < ngroups; jb++) {
        int64_t first = causal ? jb * block_k - causal_offset : 0;
        first = first < 0 ? 0 : first > Lq ? Lq : first;
        acc += (double)(Lq - first) + 1.0;
        /* close group g-1 after this block once it holds its share, leaving
         * at least one block for each group still to come */
        while (g < ngroups && acc >= total * (double)g / (double)ngroups
               && nkb - (jb + 1) >= ngroups - g) {
            gstart[g++] = jb + 1;
        }
    }
    for (; g < ngroups; g++)   /* (only when there are fewer blocks than groups) */
        gstart[g] = gstart[g - 1] + 1 <= nkb ? gstart[g - 1] + 1 : nkb;
    gstart[ngroups] = nkb;
}

#endif
