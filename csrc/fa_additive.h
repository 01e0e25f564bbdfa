/*
 * Streaming attention over score tiles from a score function: the fused
 * additive (Bahdanau / Luong concat) kernel and the loop that runs compiled
 * similarity plugins.  Plain C99 + POSIX threads, no Python.
 *
 * Shapes and strides follow fa_sdpa_args (fastattn.h): q (batch..., Lq, d),
 * k (batch..., Lk, d), v (batch..., Lk, dv), out (batch..., Lq, dv),
 * optional weights (batch..., Lq, Lk) and mask (batch..., Lq|1, Lk).
 * A key j is allowed for query i when the mask allows it and, if causal,
 * j <= i + causal_offset.  Rows with no allowed key produce zeros.
 *
 * Per (batch item, block of block_q query rows) task: for each tile of
 * block_k keys, scores S = score(q rows, k tile) (block_q x block_k scratch),
 * mask, running max / sum per row (the output row is rescaled only when the
 * max grows), O += P V.  Tiles above the causal diagonal and tiles a boolean
 * mask forbids entirely are skipped.  Extra memory: n_threads x
 * (block_q x block_k + 2 block_q) elements, unless weights are wanted (then
 * the scores go straight into the weights), from a grow-only buffer per calling
 * thread.
 */
#ifndef FA_ADDITIVE_H
#define FA_ADDITIVE_H

#include <stdint.h>
#include "fastattn.h"
#include "fastattn_plugin.h"

#define FA_ESCORE 4        /* the score function returned nonzero (see score_status) */
#define FA_ENONFINITE 5    /* a score was NaN or +inf (only when check_scores) */

typedef struct {
    int nbatch;
    const int64_t *batch_shape;
    const int64_t *q_bs, *k_bs, *v_bs, *o_bs, *m_bs, *w_bs;
    int64_t Lq, Lk, d, dv;
    int64_t ldq, ldk, ldv, ldo, ldm, ldw;
    const void *q, *k, *v;
    const void *mask;
    int mask_kind;
    int causal;
    int64_t causal_offset;
    void *out;
    void *weights;
    void *lse;                      /* NULL, or (batch..., Lq) as in fa_sdpa_args */
    const int64_t *l_bs;
    int64_t block_q, block_k;
    int n_threads;
    fastattn_score_f32 score_f32;   /* the one matching the entry point is used */
    fastattn_score_f64 score_f64;
    const void *score_params;
    int check_scores;               /* reject NaN / +inf scores */
    int score_status;               /* out: the score function's nonzero code */
    /* optional, as in fa_sdpa_args: asked on the calling thread between
     * tasks and key tiles; nonzero stops the call with FA_EINTR */
    int (*stop)(void *stop_ctx);
    void *stop_ctx;
} fa_tiled_args;

int fa_tiled_attention_f32(fa_tiled_args *a);
int fa_tiled_attention_f64(fa_tiled_args *a);

/*
 * Backward of the fused additive kernel (FlashAttention-2 style): the
 * gradients of the projected queries and keys, of the v vector and of the
 * values, from dO = dL/d(out), the forward's output O and its row
 * log-sum-exp, recomputing tanh tiles (never an Lq x Lk or Lq x Lk x d array).
 *
 * f: the forward's arguments -- q = the projected queries qp (..., Lq, d),
 * k = the projected keys kp (..., Lk, d), v, mask, causal as in the forward;
 * out = O (read only); lse (batch..., Lq) as the forward wrote it (required);
 * score_params = the v vector (d entries of the element type); weights NULL
 * (the score functions are not used); block_q / block_k the tiles;
 * n_threads; stop.
 * With P_ij = exp(s_ij - lse_i) for the allowed pairs (0 for the others),
 * t_ij = tanh(qp_i + kp_j), dP = dO V^T, D_i = rowsum(dO o O) (in double) and
 * ds_ij = P_ij (dP_ij - D_i):
 *     dV = P^T dO,  dqp_i = v o sum_j ds_ij (1 - t_ij^2),
 *     dkp_j = v o sum_i ds_ij (1 - t_ij^2),  dvec = sum_ij ds_ij t_ij.
 * dq (..., Lq, d), dk (..., Lk, d), dv (..., Lk, dv): one gradient per batch
 * item of the broadcast batch (the caller sums broadcast dims), contiguous
 * rows, none broadcast, none overlapping another array.  dvec: d doubles,
 * summed over the whole batch.  delta: (batch items) x Lq doubles of scratch.
 * ngroups (1 to FA_BWD_MAX_GROUPS): the key blocks of each batch item are
 * split into that many runs, one task each; dq_part: scratch of ngroups x
 * (batch items) x Lq x d doubles (each group's sums for dq), dvec_part:
 * (batch items) x ngroups x d doubles.
 *
 * Pool runs: D per (item, query block); then per (item, key group) every tile
 * (csrc/fa_additive_bwd_impl.h); then dq from the partials in group order.
 * Every output element is summed by one task in a fixed order, so the result
 * depends on the shapes, the tiles and ngroups, never on the thread count.
 * A pair's score is recomputed with the forward's bits.  Pairs a mask or
 * causality forbids are skipped (no tanh, no contribution, exact zeros);
 * rows whose lse is -inf get exact zero gradients.  BLAS gemm for dP and dV
 * (held at one thread).  Returns FA_OK, FA_ENOMEM, FA_EINVAL or FA_EINTR.
 */
typedef struct {
    fa_tiled_args f;
    const void *grad_out;
    const int64_t *g_bs;
    int64_t ldg;
    void *dq, *dk, *dv;
    const int64_t *dq_bs, *dk_bs, *dv_bs;
    int64_t lddq, lddk, lddv;
    double *dvec;
    double *delta;
    int64_t ngroups;
    double *dq_part;
    double *dvec_part;
    int accumulate;     /* 1: dk and dv are added to (each element += its float), not written */
} fa_additive_bwd_args;

int fa_additive_bwd_f32(fa_additive_bwd_args *a);
int fa_additive_bwd_f64(fa_additive_bwd_args *a);

/* Built-in additive score tile: s_ij = sum_a v[a] tanh(q_ia + k_ja), with
 * params = the v vector (d entries); q, k are the projected rows. */
int fa_additive_score_f32(const void *params, const float *q, int64_t ldq, const float *k,
                          int64_t ldk, int64_t tq, int64_t tk, int64_t d, float *s,
                          int64_t lds);
int fa_additive_score_f64(const void *params, const double *q, int64_t ldq, const double *k,
                          int64_t ldk, int64_t tq, int64_t tk, int64_t d, double *s,
                          int64_t lds);

/* BLAS for the projections: Fortran-ABI gemm from scipy.linalg.cython_blas and
 * an optional hook that sets the BLAS thread count and returns the previous
 * one (OpenBLAS's openblas_set_num_threads_local). */
void fa_add_set_blas(fa_sgemm_fn sgemm, fa_dgemm_fn dgemm, fa_blas_set_threads_fn set_threads);

/* Y (n x da, row stride ldy) = X (n x d, ldx) . W (da x d, ldw)^T (+ b[da] on
 * every row if b != NULL): blocks of rows are tasks on fastattn's pool, each
 * one gemm with BLAS held at one thread (a multi-threaded BLAS stalls when
 * another process holds a core).  d >= 1, da >= 1.  Returns FA_OK, or
 * FA_EINVAL when no gemm was installed. */
int fa_project_f32(const float *X, int64_t ldx, int64_t n, int64_t d, const float *W,
                   int64_t ldw, int64_t da, const float *b, float *Y, int64_t ldy, int n_threads);
int fa_project_f64(const double *X, int64_t ldx, int64_t n, int64_t d, const double *W,
                   int64_t ldw, int64_t da, const double *b, double *Y, int64_t ldy, int n_threads);

/* O (m x dv, ldo) += P (m x n, ldp) . V (n x dv, ldv) without BLAS (the NumPy
 * tiled path's combine step; vectorised when SIMD is active). */
void fa_pv_acc_f32(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                   const float *V, int64_t ldv, float *O, int64_t ldo);
void fa_pv_acc_f64(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                   const double *V, int64_t ldv, double *O, int64_t ldo);

/* The tanh used by the additive kernels, over an array (in place allowed). */
void fa_tanh_f32(const float *x, float *y, int64_t n);
void fa_tanh_f64(const double *x, double *y, int64_t n);

/* ABI self-test plugin: -gamma |q - k|^2 with params double[2] = {gamma, mode};
 * mode 0: normal, 1: return error code 7, 2: a NaN score, 3: a +inf score. */
const fastattn_score_plugin *fa_selftest_plugin(void);

/* Share fastattn._kernels' worker pool and BLAS hold (see fa_additive.c);
 * all NULL: use this extension's own. */
typedef int (*fa_add_pool_run_fn)(int64_t ntasks, int nthreads, void (*fn)(void *, int64_t, int),
                                  void *ctx, int (*stop)(void *), void *stop_ctx);
typedef fa_blas_set_threads_fn (*fa_add_hold_enter_fn)(void);
typedef void (*fa_add_hold_exit_fn)(fa_blas_set_threads_fn hook);
void fa_add_set_runtime(fa_add_pool_run_fn pool_run, fa_add_hold_enter_fn enter,
                        fa_add_hold_exit_fn exit_);
int fa_add_runtime_shared(void);

#endif
