/*
 * Few-row projection kernel (csrc/fa_proj.c), used by fastattn/_proj.pyx.
 * Plain C: raw pointers, sizes and row strides in elements, status codes.
 */
#ifndef FA_PROJ_H
#define FA_PROJ_H

#include <stdint.h>

#define FA_PROJ_EINVAL 2
#define FA_PROJ_ENOMEM 3

/* 1 when this build and CPU can run fa_proj_small_f32 (AVX2 + FMA). */
int fa_proj_small_available(void);

/* y[i, j] = sum_p x[i, p] * w[j, p] (+ b[j] when b is not NULL), i < m, j < n, p < k.
 * Row-major with row strides ldx, ldw, ldy; y must not overlap x, w, b.
 * Any m works; it pays for few rows (the weights are read in place, not packed).
 * Returns 0, or FA_PROJ_EINVAL (not available, or an empty size). */
int fa_proj_small_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                      const float *w, int64_t ldw, const float *b, float *y, int64_t ldy);

/* Prepacked weights (fa_proj_pack_f32 / fa_proj_packed_f32).  The packed form
 * of w (n x k) is FA_PROJ_PANEL-column panels, panel p holding for every input
 * feature c the FA_PROJ_PANEL values w[p*FA_PROJ_PANEL + jj][c] (zeros past
 * row n): fa_proj_packed_size(n, k) floats.  Portable C; any n, k >= 0. */
#define FA_PROJ_PANEL 16

static inline int64_t fa_proj_packed_size(int64_t n, int64_t k)
{
    return (n + FA_PROJ_PANEL - 1) / FA_PROJ_PANEL * FA_PROJ_PANEL * k;
}

void fa_proj_pack_f32(int64_t n, int64_t k, const float *w, int64_t ldw, float *wp);
/* Panels [p_begin, p_end) of that packed form (panel p: rows p * FA_PROJ_PANEL
 * on), written into wp (the whole packed array); the same floats as
 * fa_proj_pack_f32.  simd != 0 lets full panels use 8 x 8 AVX2 transposes
 * (when the CPU has AVX2): 3x faster, for packing on every call. */
void fa_proj_pack_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                             const float *w, int64_t ldw, float *wp, int simd);

/* Panels [p_begin, p_end) of the packed form of w = bt^T (n x k), read from
 * bt (k x n, row stride ldb): panel p holds for every c the 16 values
 * bt[c][p*16 .. p*16 + 15] (zeros past column n), copied -- no transpose.
 * For a product against the transpose of a row-major matrix (the RNN
 * backward's dh W_hh).  Portable C. */
void fa_proj_pack_t_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                               const float *bt, int64_t ldb, float *wp);

/* 1 when this build and CPU can run fa_proj_packed_f32 (AVX2 + FMA). */
int fa_proj_packed_available(void);

/* Columns [c0, c0 + n) of y = x . w^T (+ b) from w's packed form wp (of the
 * whole k): y[i, j] = sum_p x[i, p] * w[c0 + j, p] + b[c0 + j], i < m, j < n;
 * c0 a multiple of FA_PROJ_PANEL; b (NULL: none) and y point at column c0.
 * y must not overlap x, wp, b.  wide != 0 lets an AVX512F CPU take two panels
 * at a time in 512-bit vectors (the same floats).  Returns 0, or
 * FA_PROJ_EINVAL (not available, an empty size, a misaligned c0). */
int fa_proj_packed_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                       const float *wp, int64_t c0, const float *b, float *y, int64_t ldy,
                       int wide);

/* fa_proj_packed_f32 with the reduction in runs of `runs` terms (0: the
 * blocking below): each run summed from zero (the first from b), then added
 * to y, in order -- the same floats as one call a run (each without b but the
 * first) with the results added in run order.  Shorter sums: linear_backward's
 * long reductions stay as accurate as MKL's. */
int fa_proj_packed_runs_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                            const float *wp, int64_t c0, const float *b, float *y, int64_t ldy,
                            int wide, int64_t runs);

/* fa_proj_packed_runs_f32 on x given as its transpose: xt (k x m, row stride
 * ldt >= m) holds x[i, p] at xt[p * ldt + i] (pointing at the block's first
 * column).  Each (rows, k-run) block of x is transposed into scratch (8 x 8
 * register transposes; MC x runs floats, malloc'ed per call) once for all the
 * column panels, then read as fa_proj_packed_runs_f32 reads x: the same
 * floats as that function on a transposed copy of x.  For linear_backward's
 * dW = g^T x without a transposed copy of g.  runs in 1..FA_PROJ_XT_MAX_RUNS.
 * csum (or NULL): m doubles to which the column sums of x's rows are added
 * (csum[i] += x[i, p] for p = 0 .. k-1 in order, in double -- dL/db of that
 * dW's linear: g read once for both), while each block is in cache.
 * Returns 0, FA_PROJ_EINVAL or FA_PROJ_ENOMEM. */
#define FA_PROJ_XT_MAX_RUNS 1024
int fa_proj_packed_xt_runs_f32(int64_t m, int64_t n, int64_t k, const float *xt, int64_t ldt,
                               const float *wp, int64_t c0, const float *b, float *y,
                               int64_t ldy, int wide, int64_t runs, double *csum);

/* Cache blocking of fa_proj_packed_f32: k in runs of kc (as above), rows in chunks of
 * mc (0: no split); fa_proj_packed_tune changes them (tuning sweeps).  Measured
 * (one thread, K = 512, N = 512 / 1536): splitting k (128, 256) was slower at
 * every size (59-73 vs 90 GFLOP/s at 2048 x 1536); rows in chunks of 48-144
 * keep x's chunk in L2 and gave 96-98.5 GFLOP/s at 2048 rows against 90-93
 * unsplit (no difference up to 512 rows). */
#ifndef FA_PROJ_PACKED_KC
#define FA_PROJ_PACKED_KC 0
#endif
#ifndef FA_PROJ_PACKED_MC
#define FA_PROJ_PACKED_MC 96
#endif
void fa_proj_packed_tune(int64_t kc, int64_t mc);
/* The tallest row block of the 512-bit packed kernel, 8..12 (default 12;
 * the same floats for any: tuning A/B runs). */
void fa_proj_packed_tune_rows(int rows);

#endif
