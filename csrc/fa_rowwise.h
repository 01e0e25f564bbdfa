/*
 * Row-wise and elementwise kernels of the training ops (csrc/fa_rowwise.c),
 * used by fastattn/_rowwise.pyx: layer normalisation forward and backward,
 * dropout with a counter-based random stream, and the masked products of the
 * activations' and dropout's backward.
 *
 * Plain C99: raw pointers, sizes and row strides in elements; the caller
 * cuts the work into ranges (rows or elements) and runs them on its threads.
 * Each range's result depends only on its own elements (and the seed), never
 * on how the ranges were cut or which thread ran them -- except the layer
 * norm backward's weight / bias sums, which each call adds into the partial
 * sums it is given (the caller keeps one per fixed chunk of rows and adds
 * them up in chunk order).
 */
#ifndef FA_ROWWISE_H
#define FA_ROWWISE_H

#include <stdint.h>

/* y = (x - mean) / sqrt(var + eps) * w + b over each of `rows` rows of E
 * elements (w, b: E elements each, or NULL for none); the mean and the
 * biased variance in double, every element computed in double and rounded
 * once.  Row r of x starts at x + r * ldx, of y at y + r * ldy.  simd (float32):
 * AVX2 double lanes where the CPU has them, the same bits (the same operations
 * in the same order, no fused multiply-adds). */
void fa_ln_fwd_f32(int64_t rows, int64_t E, const float *x, int64_t ldx, const float *w,
                   const float *b, double eps, float *y, int64_t ldy, int simd);
void fa_ln_fwd_f64(int64_t rows, int64_t E, const double *x, int64_t ldx, const double *w,
                   const double *b, double eps, double *y, int64_t ldy);

/* The backward of fa_ln_fwd for those rows, from g = dL/dy (row stride ldg):
 * with xh = (x - mean) rstd and gh = g w (g when w is NULL),
 *     dx = rstd (gh - mean(gh) - xh mean(gh xh))          (row means)
 * written to dx (row stride lddx), in double then rounded; and, when not
 * NULL, dw_acc[j] += sum over the rows of g xh, db_acc[j] += sum of g
 * (E doubles each, summed in row order).  The row means' sums: element j into
 * sum j % 4, the four added as (s0 + s1) + (s2 + s3). */
void fa_ln_bwd_f32(int64_t rows, int64_t E, const float *g, int64_t ldg, const float *x,
                   int64_t ldx, const float *w, double eps, float *dx, int64_t lddx,
                   double *dw_acc, double *db_acc, int simd);
void fa_ln_bwd_f64(int64_t rows, int64_t E, const double *g, int64_t ldg, const double *x,
                   int64_t ldx, const double *w, double eps, double *dx, int64_t lddx,
                   double *dw_acc, double *db_acc);

/* Dropout's keep mask for the elements i0 <= i < i1 of a flat array:
 * keep[i] = (u(seed, i) >= threshold), u a 32-bit draw (SplitMix64 of
 * seed + (i/2 + 1) * golden ratio, its low half for even i, high half for odd
 * i), so P(keep) = 1 - threshold / 2^32 and the mask depends only on the seed
 * and the index.  With x and y, also y[i] = x[i] keep[i] scale (so a NaN
 * stays NaN where it is dropped, as x * mask does).
 * keep, x and y are the whole arrays (indexed from 0).  simd != 0 lets an
 * AVX2 CPU draw four pairs at a time (the same bytes). */
void fa_dropout_f32(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold, const float *x,
                    float *y, float scale, uint8_t *keep, int simd);
void fa_dropout_f64(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold, const double *x,
                    double *y, double scale, uint8_t *keep, int simd);

/* out[i] = g[i] keep[i] scale, i < n (dropout's backward). */
/* fa_relu then fa_dropout in one pass: y = relu(x) keep scale, the mask as
 * fa_dropout's (the same bytes and floats as the two calls). */
void fa_relu_dropout_f32(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                         const float *x, float *y, float scale, uint8_t *keep, int simd);
void fa_relu_dropout_f64(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                         const double *x, double *y, double scale, uint8_t *keep, int simd);
/* fa_mask_scale then fa_relu_bwd against d (the forward's relu-dropout output)
 * in one pass: out = d <= 0 ? 0 : g keep scale (the same floats as the two;
 * simd: float32 in AVX2 lanes where the CPU has them, the same floats). */
void fa_relu_mask_scale_f32(int64_t n, const float *g, const uint8_t *keep, float scale,
                            const float *d, float *out, int simd);
void fa_relu_mask_scale_f64(int64_t n, const double *g, const uint8_t *keep, double scale,
                            const double *d, double *out, int simd);
void fa_mask_scale_f32(int64_t n, const float *g, const uint8_t *keep, float scale, float *out);
void fa_mask_scale_f64(int64_t n, const double *g, const uint8_t *keep, double scale, double *out);

/* out[i] = max(x[i], 0), i < n, as np.maximum (a NaN stays, -0 becomes +0). */
void fa_relu_f32(int64_t n, const float *x, float *out);
void fa_relu_f64(int64_t n, const double *x, double *out);

/* out[i] = x[i] <= 0 ? 0 : g[i], i < n (relu's backward; a NaN x passes g,
 * as torch's threshold_backward). */
void fa_relu_bwd_f32(int64_t n, const float *g, const float *x, float *out);
void fa_relu_bwd_f64(int64_t n, const double *g, const double *x, double *out);

/* acc[j] += sum over rows r of x[r * ldx + j], j < n, rows in order, in double
 * (a bias gradient: the column sums of grad_out). */
void fa_colsum_f32(int64_t rows, int64_t n, const float *x, int64_t ldx, double *acc);
void fa_colsum_f64(int64_t rows, int64_t n, const double *x, int64_t ldx, double *acc);

/* The sum of x[i]^2, i < n, in double: four running sums over i mod 4, in
 * order, added at the end (a fixed order: the same bits on every call; NaN
 * and inf propagate).  A gradient's squared 2-norm. */
double fa_sumsq_f32(int64_t n, const float *x);
double fa_sumsq_f64(int64_t n, const double *x);

/* dst[ids[r] * E + j] += src[r * E + j] for r < rows in order, j < E (an
 * embedding's backward: repeated ids summed one after the other in the
 * order they come, as numpy.add.at does; ids already checked in [0, n)).
 * Single-threaded: the same sums on every call. */
void fa_scatter_add_f32(int64_t rows, int64_t E, const float *src, const int64_t *ids, float *dst);
void fa_scatter_add_f64(int64_t rows, int64_t E, const double *src, const int64_t *ids, double *dst);

/* One Adam / AdamW step (torch.optim's math, the operations of
 * fastattn/optim.py's NumPy form in the same order, each rounded to T) on
 * elements [0, n) of a parameter p, its gradient g and its moments m, v (and
 * vmax with amsgrad, else NULL), all updated in place:
 *     d = maximize ? -g : g
 *     decoupled: p = p (1 - lr wd)      otherwise, wd != 0: d = d + wd p
 *     m = m + (1 - b1)(d - m);  v = v b2;  v = v + ((1 - b2) d) d
 *     amsgrad: vmax = max(vmax, v) (NaN propagating), read instead of v
 *     p = p - step_size (m / (sqrt(v) / bc2_sqrt + eps))
 * The scalars are given in double and rounded to T once, as NumPy rounds a
 * Python float for a T array. */
typedef struct {
    double lr, b1, b2, eps, wd, step_size, bc2_sqrt;
    int decoupled, maximize;
} fa_adam_hyper;

void fa_adam_f32(int64_t n, float *p, const float *g, float *m, float *v, float *vmax,
                 const fa_adam_hyper *h);
void fa_adam_f64(int64_t n, double *p, const double *g, double *m, double *v, double *vmax,
                 const fa_adam_hyper *h);

/* Softmax cross entropy of rows [r0, r1) of z (C classes, row stride ldz)
 * against class indices tgt (ignore: the ignored index), no class weights, no
 * smoothing: with m the row's maximum (NaN propagating), e_c = exp(z_c - m)
 * in T, sum = their sum in double and lse = log(sum),
 *     nll[r] = lse - (z_y - m)   (0 for an ignored target)
 *     grad_c = e_c * (T)(s scale / sum), then grad_y -= (T)scale
 * (s = 1 for a kept target, 0 for an ignored one: a zero row), grad's rows at
 * stride ldg.  simd: AVX2 + FMA lanes where the CPU has them (fastattn's
 * vectorised exp, <= 2 ulp in float32; the scalar loop uses libm's). */
void fa_xent_f32(int64_t r0, int64_t r1, int64_t C, const float *z, int64_t ldz,
                 const int64_t *tgt, int64_t ignore, double scale, float *grad, int64_t ldg,
                 double *nll, int simd);
void fa_xent_f64(int64_t r0, int64_t r1, int64_t C, const double *z, int64_t ldz,
                 const int64_t *tgt, int64_t ignore, double scale, double *grad, int64_t ldg,
                 double *nll, int simd);

#endif
