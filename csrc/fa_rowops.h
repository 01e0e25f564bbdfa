/*
 * Internal row operations used by the softmax kernels, with runtime dispatch
 * between a portable scalar version and an AVX2/FMA version.
 */
#ifndef FA_ROWOPS_H
#define FA_ROWOPS_H

#include <stdint.h>

typedef struct {
    /* max over x[0..n) ignoring NaN; -inf for an empty or all-masked row */
    float (*rowmax_f32)(const float *x, int64_t n);
    double (*rowmax_f64)(const double *x, int64_t n);
    /* x[j] = exp(x[j] - m) in place, returns the sum (NaN propagates) */
    float (*expsub_sum_f32)(float *x, int64_t n, float m);
    double (*expsub_sum_f64)(double *x, int64_t n, double m);
    void (*exp_f32)(const float *x, float *y, int64_t n);
    void (*exp_f64)(const double *x, double *y, int64_t n);
} fa_rowops;

/* The table in use (scalar or AVX2), chosen by fa_simd_set_disabled / CPU detection. */
const fa_rowops *fa_get_rowops(void);

#endif
