/*
 * Few-row projection kernel (csrc/fa_proj.c), used by fastattn/_proj.pyx.
 * Plain C: raw pointers, sizes and row strides in elements, status codes.
 */
#ifndef FA_PROJ_H
#define FA_PROJ_H

#include <stdint.h>

#define FA_PROJ_EINVAL 2

/* 1 when this build and CPU can run fa_proj_small_f32 (AVX2 + FMA). */
int fa_proj_small_available(void);

/* y[i, j] = sum_p x[i, p] * w[j, p] (+ b[j] when b is not NULL), i < m, j < n, p < k.
 * Row-major with row strides ldx, ldw, ldy; y must not overlap x, w, b.
 * Any m works; it pays for few rows (the weights are read in place, not packed).
 * Returns 0, or FA_PROJ_EINVAL (not available, or an empty size). */
int fa_proj_small_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                      const float *w, int64_t ldw, const float *b, float *y, int64_t ldy);

#endif
