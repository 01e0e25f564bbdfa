/*
 * fastattn C API.
 *
 * Plain C99 + POSIX threads. Nothing here knows about Python: callers pass raw
 * pointers, sizes and strides (in elements), preallocate outputs, and get a
 * status code back.  BLAS is not linked: the caller hands over Fortran-ABI
 * gemm function pointers (fastattn takes them from scipy.linalg.cython_blas).
 */
#ifndef FASTATTN_H
#define FASTATTN_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes. */
#define FA_OK 0
#define FA_ENOMEM 1      /* scratch allocation failed */
#define FA_EINVAL 2      /* inconsistent arguments (a caller bug) */
#define FA_EINTR 3       /* the stop callback asked to stop; outputs are incomplete */

#define FA_MAX_BATCH_DIMS 32

/* Fortran-ABI BLAS gemm, as exported by scipy.linalg.cython_blas (blas_int = int). */
/* Every size and leading dimension handed to it must fit in that int: the
 * kernels check this (FA_EINVAL otherwise) rather than truncate; the Python
 * side refuses such arguments first, with a message (fastattn/_validation.py,
 * BLAS_INT_MAX). */
#define FA_BLAS_INT_MAX 2147483647
static inline int fa_blas_fits(int64_t n) { return n >= 0 && n <= FA_BLAS_INT_MAX; }

typedef void (*fa_sgemm_fn)(char *transa, char *transb, int *m, int *n, int *k,
                            float *alpha, float *a, int *lda, float *b, int *ldb,
                            float *beta, float *c, int *ldc);
typedef void (*fa_dgemm_fn)(char *transa, char *transb, int *m, int *n, int *k,
                            double *alpha, double *a, int *lda, double *b, int *ldb,
                            double *beta, double *c, int *ldc);

/* Hook that sets the BLAS library's thread count and returns the previous one
 * (OpenBLAS's openblas_set_num_threads_local has exactly this shape). */
typedef int (*fa_blas_set_threads_fn)(int);

/* Called once by the binding layer. */
void fa_set_blas(fa_sgemm_fn sgemm, fa_dgemm_fn dgemm, fa_blas_set_threads_fn set_threads);

/* Hold BLAS at one thread while the caller's own threads call it (every kernel
 * here does this around its parallel part).  Calls may overlap: the first one
 * in saves the library's setting, the last one out restores it.  Returns the
 * hook used (NULL when none is installed), to be handed to fa_blas_threads_exit.
 * fastattn's projection kernels (another extension module) reach these two and
 * fa_pool_run through their addresses, so that both share one counter and one
 * worker pool. */
fa_blas_set_threads_fn fa_blas_threads_enter(void);
void fa_blas_threads_exit(fa_blas_set_threads_fn hook);

/* Mask kinds. */
#define FA_MASK_NONE 0
#define FA_MASK_BOOL 1   /* uint8: nonzero = may attend */
#define FA_MASK_ADD 2    /* additive bias, same element type as q */

/* Kernel paths (reported back in fa_sdpa_args.path_taken). */
#define FA_PATH_SINGLE 1   /* whole key row per query block, exact two-pass softmax */
#define FA_PATH_STREAM 2   /* key tiles with online (running max/sum) softmax */

/*
 * Batched scaled-dot-product attention.
 *
 * Logical shapes: q (batch..., Lq, d), k (batch..., Lk, d), v (batch..., Lk, dv),
 * out (batch..., Lq, dv), optional weights (batch..., Lq, Lk), optional mask
 * (batch..., Lq, Lk).  batch... has nbatch dims of sizes batch_shape[]; each
 * array gives its own element stride for every batch dim (0 = broadcast).
 * Within one batch item every array is row-major with contiguous rows:
 * element (i, c) is at base + i*ld + c.  The mask's row stride may be 0
 * (one key mask shared by all queries).
 *
 * A key j is allowed for query i when the mask allows it and, if causal,
 * j <= i + causal_offset.  Rows with no allowed key produce zeros.
 */
typedef struct {
    int nbatch;
    const int64_t *batch_shape;
    const int64_t *q_bs, *k_bs, *v_bs, *o_bs, *m_bs, *w_bs;   /* batch strides */
    int64_t Lq, Lk, d, dv;
    int64_t ldq, ldk, ldv, ldo, ldm, ldw;                     /* row strides */
    const void *q, *k, *v;
    const void *mask;          /* NULL when mask_kind == FA_MASK_NONE */
    int mask_kind;
    int causal;
    int64_t causal_offset;
    double scale;
    void *out;
    void *weights;             /* NULL unless weights are wanted */
    /* NULL, or (batch..., Lq) with batch strides l_bs and contiguous rows: the
     * natural-log log-sum-exp of each row's scaled, masked scores over its
     * allowed keys; -inf for a row with none */
    void *lse;
    const int64_t *l_bs;
    /* plan */
    int64_t block_q;           /* query rows per task */
    int64_t block_k;           /* key rows per tile (streaming path) */
    int path;                  /* FA_PATH_SINGLE or FA_PATH_STREAM (forced SINGLE with weights) */
    int direct;                /* single pass only: register-blocked products instead of BLAS */
    int n_threads;             /* >= 1; 1 runs on the calling thread alone */
    /* optional: asked on the calling thread between tasks and key tiles
     * (about every 10-20 ms); nonzero stops the call with FA_EINTR, leaving
     * out and weights partly written.  It may run code that starts another
     * fastattn call on the same thread (nested calls are safe). */
    int (*stop)(void *stop_ctx);
    void *stop_ctx;
} fa_sdpa_args;

int fa_sdpa_f32(const fa_sdpa_args *a);
int fa_sdpa_f64(const fa_sdpa_args *a);

/*
 * Backward of fa_sdpa (FlashAttention-2): the gradients of q, k, v (and of an
 * additive mask) from dO = dL/d(out), the forward's output O and its row
 * log-sum-exp, recomputing the scores tile by tile (no Lq x Lk matrix).
 *
 * f: the forward's arguments -- q, k, v, mask, causal, scale as in the
 * forward; out = O (read only); lse (batch..., Lq) as the forward wrote it;
 * weights NULL; block_q / block_k the tiles; direct: 1 for the packed
 * products of the forward's streaming path, 0 for BLAS (as the forward ran);
 * n_threads; stop.
 * dq (batch..., Lq, d), dk (batch..., Lk, d), dv (batch..., Lk, dv): one
 * gradient per batch item of the broadcast batch (the caller sums broadcast
 * dims), contiguous rows, none of them broadcast (batch strides nonzero where
 * the batch dim is > 1) and none overlapping another array.
 * dmask: NULL, or (batch..., Lq, Lk) written with dS, the gradient of the
 * additive mask for every batch item.  delta: scratch of
 * (number of batch items) x Lq doubles (D = rowsum(dO o O)).
 * ngroups (1 to FA_BWD_MAX_GROUPS): the key blocks of each batch item are
 * split into that many runs, one task each; dq_part: scratch of
 * (ngroups - 1) x (number of batch items) x Lq x d elements (NULL for 1).
 *
 * Pool runs: D per (item, query block); then per (item, key group) every
 * tile product (fa_sdpa_bwd_impl.h); then the dQ partials summed in group
 * order.  Every output element is summed by one task in a fixed order: the
 * result depends on the shapes, the tiles and ngroups, not on which thread
 * ran what.  BLAS gemm tiles (BLAS held at one thread).  Rows whose lse is
 * -inf (no allowed key) get exact zero gradients.
 */
#define FA_BWD_MAX_GROUPS 64
typedef struct {
    fa_sdpa_args f;
    const void *grad_out;
    const int64_t *g_bs;
    int64_t ldg;
    void *dq, *dk, *dv;
    const int64_t *dq_bs, *dk_bs, *dv_bs;
    int64_t lddq, lddk, lddv;
    void *dmask;
    const int64_t *dm_bs;
    int64_t lddm;
    void *delta;
    int64_t ngroups;
    void *dq_part;
} fa_sdpa_bwd_args;

int fa_sdpa_bwd_f32(const fa_sdpa_bwd_args *a);
int fa_sdpa_bwd_f64(const fa_sdpa_bwd_args *a);

/* Worker threads alive in fastattn's pool. */
int fa_pool_workers(void);
/* Tasks run by pool workers in the last call that posted work (tests). */
int64_t fa_pool_last_helped(void);
/* Open (delta 1) or close (-1) a hold: while any is open, idle workers spin
 * longer between calls (see fa_pool.c).  Returns the holds now open. */
int fa_pool_hold(int delta);

/* Vectorised exp over an array (in place allowed); exact 0 for -inf. */
void fa_exp_f32(const float *x, float *y, int64_t n);
void fa_exp_f64(const double *x, double *y, int64_t n);
/* x[j] = exp(x[j] - m) in place for x[j] <= m (softmax rows), returns the sum. */
float fa_expsub_sum_f32(float *x, int64_t n, float m);
double fa_expsub_sum_f64(double *x, int64_t n, double m);
/* The same for rows with masked (-inf) entries (the kernels use it when a mask is given). */
float fa_expsub_masked_f32(float *x, int64_t n, float m);
double fa_expsub_masked_f64(double *x, int64_t n, double m);

/* Benchmarks' yardstick: n iterations of 12 independent float FMAs on this
 * thread, 8 lanes (AVX2) or 16 (AVX-512) as the table in use has them;
 * returns the flops done (0 when no SIMD code is in use),
 * *sink receives a value that depends on all of them. */
double fa_fma_probe(int64_t n, float *sink);

/* SIMD dispatch: 1 when the AVX2/FMA code paths are in use. */
int fa_simd_active(void);
/* The level in use: 0 scalar, 1 AVX2/FMA, 2 AVX-512 products (AVX512F CPUs). */
int fa_simd_level(void);
/* Force the portable scalar paths (disable != 0) or re-enable detection. */
void fa_simd_set_disabled(int disable);
/* Cap the level detection may choose (2, the default: whatever the CPU has). */
void fa_simd_set_max_level(int level);
int fa_simd_max_level(void);
/* 1 when this build contains AVX2/FMA code at all. */
int fa_simd_compiled(void);

#ifdef __cplusplus
}
#endif
#endif
