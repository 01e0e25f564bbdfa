/*
 * Batched scaled-dot-product attention: BLAS (or our register-blocked
 * products) for Q.K^T and P.V tiles, our own softmax row operations, and the
 * worker pool (fa_pool.c) over (batch item, query block) tasks.
 */
#define _POSIX_C_SOURCE 200112L
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include "fastattn.h"
#include "fa_pool.h"
#include "fa_rowops.h"

/* ------------------------------------------------------------------ BLAS */

static fa_sgemm_fn g_sgemm = NULL;
static fa_dgemm_fn g_dgemm = NULL;
static fa_blas_set_threads_fn g_blas_set_threads = NULL; /* atomic */

/* BLAS is held at one thread while a kernel of ours calls it.  Calls may overlap
 * (an app's threads call in concurrently), so the first one in saves the
 * library's setting and the last one out restores it.  Each call uses the hook
 * it saw on the way in for the way out too, so a hook installed meanwhile
 * cannot unbalance the count. */
static pthread_mutex_t g_blas_lock = PTHREAD_MUTEX_INITIALIZER;
static int g_blas_users = 0;
static int g_blas_saved = -1;

static void blas_atfork_child(void)
{
    /* a call that was running in the parent does not exist here: give BLAS
     * back the setting it had before it */
    fa_blas_set_threads_fn hook = __atomic_load_n(&g_blas_set_threads, __ATOMIC_ACQUIRE);
    if (g_blas_users > 0 && g_blas_saved > 0 && hook)
        hook(g_blas_saved);
    pthread_mutex_init(&g_blas_lock, NULL);
    g_blas_users = 0;
}

void fa_set_blas(fa_sgemm_fn sgemm, fa_dgemm_fn dgemm, fa_blas_set_threads_fn set_threads)
{
    static int atfork = 0;
    if (!atfork) {
        pthread_atfork(NULL, NULL, blas_atfork_child);
        atfork = 1;
    }
    g_sgemm = sgemm;
    g_dgemm = dgemm;
    __atomic_store_n(&g_blas_set_threads, set_threads, __ATOMIC_RELEASE);
}

/* Returns the hook used (NULL: none), to be handed to fa_blas_threads_exit.
 * Exported (fastattn.h): the projection kernels (fastattn/_proj.pyx) hold BLAS
 * through this same counter. */
fa_blas_set_threads_fn fa_blas_threads_enter(void)
{
    fa_blas_set_threads_fn hook = __atomic_load_n(&g_blas_set_threads, __ATOMIC_ACQUIRE);
    if (!hook)
        return NULL;
    pthread_mutex_lock(&g_blas_lock);
    if (g_blas_users++ == 0)
        g_blas_saved = hook(1);
    pthread_mutex_unlock(&g_blas_lock);
    return hook;
}

void fa_blas_threads_exit(fa_blas_set_threads_fn hook)
{
    if (!hook)
        return;
    pthread_mutex_lock(&g_blas_lock);
    if (--g_blas_users == 0 && g_blas_saved > 0)
        hook(g_blas_saved);
    pthread_mutex_unlock(&g_blas_lock);
}

/* --------------------------------------------------------- instantiations */

static inline float ops_rowmax_f32(const fa_rowops *o, const float *x, int64_t n) { return o->rowmax_f32(x, n); }
static inline double ops_rowmax_f64(const fa_rowops *o, const double *x, int64_t n) { return o->rowmax_f64(x, n); }
static inline float ops_expsub_f32(const fa_rowops *o, float *x, int64_t n, float m) { return o->expsub_sum_f32(x, n, m); }
static inline double ops_expsub_f64(const fa_rowops *o, double *x, int64_t n, double m) { return o->expsub_sum_f64(x, n, m); }
static inline float ops_expsub_masked_f32(const fa_rowops *o, float *x, int64_t n, float m) { return o->expsub_masked_f32(x, n, m); }
static inline double ops_expsub_masked_f64(const fa_rowops *o, double *x, int64_t n, double m) { return o->expsub_masked_f64(x, n, m); }
static inline void ops_mask_bool_f32(const fa_rowops *o, float *x, const unsigned char *m, int64_t n) { o->mask_bool_f32(x, m, n); }
static inline void ops_mask_bool_f64(const fa_rowops *o, double *x, const unsigned char *m, int64_t n) { o->mask_bool_f64(x, m, n); }
#define ops_small_qk_f32(o, ...) (o)->small_qk_f32(__VA_ARGS__)
#define ops_small_qk_f64(o, ...) (o)->small_qk_f64(__VA_ARGS__)
#define ops_small_pv_f32(o, ...) (o)->small_pv_f32(__VA_ARGS__)
#define ops_small_pv_f64(o, ...) (o)->small_pv_f64(__VA_ARGS__)
#define ops_pack_kt_f32(o, ...) (o)->pack_kt_f32(__VA_ARGS__)
#define ops_pack_kt_f64(o, ...) (o)->pack_kt_f64(__VA_ARGS__)
#define ops_pack_v_f32(o, ...) (o)->pack_v_f32(__VA_ARGS__)
#define ops_pack_v_f64(o, ...) (o)->pack_v_f64(__VA_ARGS__)
#define ops_gemm_pb_f32(o, ...) (o)->gemm_pb_f32(__VA_ARGS__)
#define ops_gemm_pb_f64(o, ...) (o)->gemm_pb_f64(__VA_ARGS__)
#define ops_bwd_ds_f32(o, ...) (o)->bwd_ds_f32(__VA_ARGS__)
#define ops_bwd_ds_f64(o, ...) (o)->bwd_ds_f64(__VA_ARGS__)
#define ops_bwd_acc_f32(o, ...) (o)->bwd_acc_f32(__VA_ARGS__)
#define ops_bwd_acc_f64(o, ...) (o)->bwd_acc_f64(__VA_ARGS__)
#define ops_bwd_store_f32(o, ...) (o)->bwd_store_f32(__VA_ARGS__)
#define ops_bwd_store_f64(o, ...) (o)->bwd_store_f64(__VA_ARGS__)
#define ops_scale_f32(o, ...) (o)->scale_f32(__VA_ARGS__)
#define ops_scale_f64(o, ...) (o)->scale_f64(__VA_ARGS__)
#define ops_dot64_f32(o, ...) (o)->dot64_f32(__VA_ARGS__)
#define ops_dot64_f64(o, ...) (o)->dot64_f64(__VA_ARGS__)
#define ops_gemm_tn_acc_f32(o, ...) (o)->gemm_tn_acc_f32(__VA_ARGS__)
#define ops_gemm_tn_acc_f64(o, ...) (o)->gemm_tn_acc_f64(__VA_ARGS__)
#define ops_has_tn_f32(o) ((o)->gemm_tn_acc_f32 != NULL)
#define ops_has_tn_f64(o) ((o)->gemm_tn_acc_f64 != NULL)

static inline float expo_f32(float x) { return expf(x); }
static inline double expo_f64(double x) { return exp(x); }

#define REAL float
#define SFX f32
#define GEMM g_sgemm
#include "fa_sdpa_impl.h"
#include "fa_sdpa_bwd_impl.h"
#undef REAL
#undef SFX
#undef GEMM

#define REAL double
#define SFX f64
#define GEMM g_dgemm
#include "fa_sdpa_impl.h"
#include "fa_sdpa_bwd_impl.h"
#undef REAL
#undef SFX
#undef GEMM
