# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython entry points into csrc/fa_additive.c (score-tile streaming attention).

Canonical buffers in, preallocated outputs, GIL released, no user-facing
checks: ``fastattn._attention`` validates every argument before it calls here.
A call from the main thread can be stopped by KeyboardInterrupt (see
fastattn/_interrupt.pxd and fastattn._kernels).
"""
import os
import threading

cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_GetPointer, PyCapsule_IsValid, PyCapsule_New
from libc.stdint cimport int64_t, uintptr_t
from scipy.linalg.cython_blas cimport dgemm, sgemm

from fastattn._buffers cimport batch_strides as _batch_strides, row_ld as _ld
from fastattn._cargs cimport fa_tiled_args, fill_layout, layout_bufs
from fastattn._interrupt cimport interrupt_arm, interrupt_raise, interrupt_state, thread_ident

from fastattn.plugin cimport (FASTATTN_PLUGIN_ABI_VERSION, FASTATTN_PLUGIN_CAPSULE_NAME,
                              FASTATTN_PLUGIN_CAPSULE_NAME_V1, fastattn_score_backward_f32,
                              fastattn_score_backward_f64, fastattn_score_f32, fastattn_score_f64,
                              fastattn_score_plugin)

cnp.import_array()

cdef extern from "fa_additive.h" nogil:
    int FA_OK, FA_ENOMEM, FA_EINVAL, FA_ESCORE, FA_ENONFINITE
    int FA_MASK_NONE, FA_MASK_BOOL, FA_MASK_ADD
    ctypedef void (*fa_sgemm_fn)(char*, char*, int*, int*, int*, float*, float*, int*,
                                 float*, int*, float*, float*, int*)
    ctypedef void (*fa_dgemm_fn)(char*, char*, int*, int*, int*, double*, double*, int*,
                                 double*, int*, double*, double*, int*)
    ctypedef int (*fa_blas_set_threads_fn)(int)
    void fa_add_set_blas(fa_sgemm_fn, fa_dgemm_fn, fa_blas_set_threads_fn)
    ctypedef int (*fa_add_pool_run_fn)(int64_t, int, void (*)(void *, int64_t, int), void *,
                                       int (*)(void *), void *)
    ctypedef fa_blas_set_threads_fn (*fa_add_hold_enter_fn)()
    ctypedef void (*fa_add_hold_exit_fn)(fa_blas_set_threads_fn)
    void fa_add_set_runtime(fa_add_pool_run_fn, fa_add_hold_enter_fn, fa_add_hold_exit_fn)
    int fa_add_runtime_shared()
    int fa_project_f32(const float *X, int64_t ldx, int64_t n, int64_t d, const float *W,
                       int64_t ldw, int64_t da, const float *b, float *Y, int64_t ldy, int n_threads)
    int fa_project_f64(const double *X, int64_t ldx, int64_t n, int64_t d, const double *W,
                       int64_t ldw, int64_t da, const double *b, double *Y, int64_t ldy, int n_threads)
    int fa_tiled_attention_f32(fa_tiled_args *a)
    int fa_tiled_attention_f64(fa_tiled_args *a)
    int fa_additive_score_f32(const void *, const float *, int64_t, const float *, int64_t,
                              int64_t, int64_t, int64_t, float *, int64_t)
    int fa_additive_score_f64(const void *, const double *, int64_t, const double *, int64_t,
                              int64_t, int64_t, int64_t, double *, int64_t)
    void fa_pv_acc_f32(int64_t m, int64_t dv, int64_t n, const float *P, int64_t ldp,
                       const float *V, int64_t ldv, float *O, int64_t ldo)
    void fa_pv_acc_f64(int64_t m, int64_t dv, int64_t n, const double *P, int64_t ldp,
                       const double *V, int64_t ldv, double *O, int64_t ldo)
    void fa_tanh_f32(const float *x, float *y, int64_t n)
    void fa_tanh_f64(const double *x, double *y, int64_t n)
    const fastattn_score_plugin *fa_selftest_plugin()
    ctypedef struct fa_additive_bwd_args:
        fa_tiled_args f
        const void *grad_out
        const int64_t *g_bs
        int64_t ldg
        void *dq
        void *dk
        void *dv
        const int64_t *dq_bs
        const int64_t *dk_bs
        const int64_t *dv_bs
        int64_t lddq, lddk, lddv
        double *dvec
        double *delta
        int64_t ngroups
        double *dq_part
        double *dvec_part
        int accumulate
    int fa_additive_bwd_f32(fa_additive_bwd_args *a)
    int fa_additive_bwd_f64(fa_additive_bwd_args *a)
    int FA_BWD_MAX_GROUPS
    int fa_simd_active()
    void fa_simd_set_disabled(int disable)
    int fa_simd_level()
    void fa_simd_set_max_level(int level)

SCORE_ADDITIVE = 0
SCORE_PLUGIN = 1
globals()["FA_ENOMEM"] = FA_ENOMEM
globals()["FA_ESCORE"] = FA_ESCORE
globals()["FA_ENONFINITE"] = FA_ENONFINITE
PLUGIN_ABI_VERSION = FASTATTN_PLUGIN_ABI_VERSION
BWD_MAX_GROUPS = FA_BWD_MAX_GROUPS
PLUGIN_CAPSULE_NAME = (<bytes>FASTATTN_PLUGIN_CAPSULE_NAME).decode()
PLUGIN_CAPSULE_NAME_V1 = (<bytes>FASTATTN_PLUGIN_CAPSULE_NAME_V1).decode()


fa_add_set_blas(<fa_sgemm_fn>sgemm, <fa_dgemm_fn>dgemm, NULL)

# signal handlers run on the main thread only (as in fastattn._kernels)
cdef unsigned long _main_ident = threading.main_thread().ident


def _after_fork_in_child():
    global _main_ident
    _main_ident = thread_ident()


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_runtime(uintptr_t pool_run, uintptr_t hold_enter, uintptr_t hold_exit):
    """Use fastattn._kernels' worker pool and BLAS hold (C addresses of fa_pool_run,
    fa_blas_threads_enter, fa_blas_threads_exit); 0s: this extension's own."""
    if pool_run == 0 or hold_enter == 0 or hold_exit == 0:
        fa_add_set_runtime(NULL, NULL, NULL)
    else:
        fa_add_set_runtime(<fa_add_pool_run_fn>pool_run, <fa_add_hold_enter_fn>hold_enter,
                           <fa_add_hold_exit_fn>hold_exit)


def runtime_shared():
    """True when the pool and the BLAS hold are _kernels' (one count, one pool per process)."""
    return bool(fa_add_runtime_shared())


def set_blas_threads_hook(uintptr_t address):
    """Install ``int f(int)`` (set the BLAS thread count, return the previous one); 0 removes it."""
    fa_add_set_blas(<fa_sgemm_fn>sgemm, <fa_dgemm_fn>dgemm, <fa_blas_set_threads_fn>address)


def project(cnp.ndarray x, cnp.ndarray w, object b, cnp.ndarray y, int n_threads):
    """y[:, :da] = x @ w.T (+ b).  x (n, d) and y (n, >= da) with contiguous rows,
    w (da, d) with a contiguous last axis (any row stride), b (da,) contiguous or None;
    one float dtype; d, da >= 1.  Returns the C status."""
    cdef int64_t n = cnp.PyArray_DIMS(x)[0]
    cdef int64_t d = cnp.PyArray_DIMS(x)[1]
    cdef int64_t da = cnp.PyArray_DIMS(w)[0]
    cdef int64_t item = cnp.PyArray_ITEMSIZE(x)
    cdef int64_t ldx = cnp.PyArray_STRIDES(x)[0] // item if n > 1 else d
    cdef int64_t ldw = cnp.PyArray_STRIDES(w)[0] // item if da > 1 else d
    cdef int64_t ldy = cnp.PyArray_STRIDES(y)[0] // item if n > 1 else cnp.PyArray_DIMS(y)[1]
    cdef const void *bp = NULL
    cdef int rc
    if b is not None:
        bp = cnp.PyArray_DATA(<cnp.ndarray>b)
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            rc = fa_project_f32(<const float *>cnp.PyArray_DATA(x), ldx, n, d,
                                <const float *>cnp.PyArray_DATA(w), ldw, da, <const float *>bp,
                                <float *>cnp.PyArray_DATA(y), ldy, n_threads)
    else:
        with nogil:
            rc = fa_project_f64(<const double *>cnp.PyArray_DATA(x), ldx, n, d,
                                <const double *>cnp.PyArray_DATA(w), ldw, da, <const double *>bp,
                                <double *>cnp.PyArray_DATA(y), ldy, n_threads)
    return rc


def sync_simd(int level):
    """Follow fastattn._kernels' SIMD level (``_kernels.simd_level()``: 0 scalar,
    1 AVX2, 2 AVX-512; this extension has its own copy of the switch)."""
    fa_simd_set_disabled(level <= 0)
    fa_simd_set_max_level(level if level > 0 else 2)


def simd_active():
    return bool(fa_simd_active())


def capsule_info(object cap):
    """(capsule version, abi_version, score_f32, score_f64, score_backward_f32,
    score_backward_f64) -- the addresses, 0 for NULL -- of a PyCapsule named
    FASTATTN_PLUGIN_CAPSULE_NAME (version 2) or FASTATTN_PLUGIN_CAPSULE_NAME_V1
    (version 1: a struct without the backward fields, which are not read);
    None for anything else."""
    cdef const fastattn_score_plugin *p
    cdef int version
    if PyCapsule_IsValid(cap, FASTATTN_PLUGIN_CAPSULE_NAME):
        version = 2
        p = <const fastattn_score_plugin *>PyCapsule_GetPointer(cap, FASTATTN_PLUGIN_CAPSULE_NAME)
    elif PyCapsule_IsValid(cap, FASTATTN_PLUGIN_CAPSULE_NAME_V1):
        version = 1
        p = <const fastattn_score_plugin *>PyCapsule_GetPointer(cap, FASTATTN_PLUGIN_CAPSULE_NAME_V1)
    else:
        return None
    if p == NULL:
        return None
    if version == 1 or p.abi_version != 2:  # a version 1 struct ends after score_f64
        return (version, p.abi_version, <uintptr_t>p.score_f32, <uintptr_t>p.score_f64, 0, 0)
    return (version, p.abi_version, <uintptr_t>p.score_f32, <uintptr_t>p.score_f64,
            <uintptr_t>p.score_backward_f32, <uintptr_t>p.score_backward_f64)


def plugin_tiles(uintptr_t fn, cnp.ndarray packed, cnp.ndarray q, cnp.ndarray k,
                 cnp.ndarray s):
    """s[b] = score(q[b], k[b]) for every b: q (n, tq, d), k (n, tk, d),
    s (n, tq, tk), C-contiguous, one float dtype, d, tq, tk >= 1; fn the
    plugin's score function of that dtype.  Returns (0, 0) or (FA_ESCORE,
    the plugin's code)."""
    cdef int64_t n = cnp.PyArray_DIMS(q)[0], tq = cnp.PyArray_DIMS(q)[1]
    cdef int64_t d = cnp.PyArray_DIMS(q)[2], tk = cnp.PyArray_DIMS(k)[1]
    cdef const void *pp = cnp.PyArray_DATA(packed)
    cdef int64_t b
    cdef int rc = 0
    cdef fastattn_score_f32 f32 = <fastattn_score_f32>fn
    cdef fastattn_score_f64 f64 = <fastattn_score_f64>fn
    cdef char *qp = <char *>cnp.PyArray_DATA(q)
    cdef char *kp = <char *>cnp.PyArray_DATA(k)
    cdef char *sp = <char *>cnp.PyArray_DATA(s)
    cdef bint single = cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32
    cdef int64_t item = cnp.PyArray_ITEMSIZE(q)
    with nogil:
        for b in range(n):
            if single:
                rc = f32(pp, <const float *>(qp + b * tq * d * item), d,
                         <const float *>(kp + b * tk * d * item), d, tq, tk, d,
                         <float *>(sp + b * tq * tk * item), tk)
            else:
                rc = f64(pp, <const double *>(qp + b * tq * d * item), d,
                         <const double *>(kp + b * tk * d * item), d, tq, tk, d,
                         <double *>(sp + b * tq * tk * item), tk)
            if rc:
                break
    if rc:
        return (int(FA_ESCORE), int(rc))
    return (0, 0)


def plugin_tiles_backward(uintptr_t fn, cnp.ndarray packed, cnp.ndarray q, cnp.ndarray k,
                          cnp.ndarray g, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dparams):
    """The plugin's score_backward on every b: q, dq (n, tq, d), k, dk (n, tk,
    d), g (n, tq, tk), C-contiguous, one float dtype; dparams float64 with one
    element per element of packed, C-contiguous.  It adds into dq, dk and
    dparams.  Returns (0, 0) or (FA_ESCORE, the plugin's code)."""
    cdef int64_t n = cnp.PyArray_DIMS(q)[0], tq = cnp.PyArray_DIMS(q)[1]
    cdef int64_t d = cnp.PyArray_DIMS(q)[2], tk = cnp.PyArray_DIMS(k)[1]
    cdef const void *pp = cnp.PyArray_DATA(packed)
    cdef double *dpp = <double *>cnp.PyArray_DATA(dparams)
    cdef int64_t b
    cdef int rc = 0
    cdef fastattn_score_backward_f32 f32 = <fastattn_score_backward_f32>fn
    cdef fastattn_score_backward_f64 f64 = <fastattn_score_backward_f64>fn
    cdef char *qp = <char *>cnp.PyArray_DATA(q)
    cdef char *kp = <char *>cnp.PyArray_DATA(k)
    cdef char *gp = <char *>cnp.PyArray_DATA(g)
    cdef char *dqp = <char *>cnp.PyArray_DATA(dq)
    cdef char *dkp = <char *>cnp.PyArray_DATA(dk)
    cdef bint single = cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32
    cdef int64_t item = cnp.PyArray_ITEMSIZE(q)
    with nogil:
        for b in range(n):
            if single:
                rc = f32(pp, <const float *>(qp + b * tq * d * item), d,
                         <const float *>(kp + b * tk * d * item), d, tq, tk, d,
                         <const float *>(gp + b * tq * tk * item), tk,
                         <float *>(dqp + b * tq * d * item), d,
                         <float *>(dkp + b * tk * d * item), d, dpp)
            else:
                rc = f64(pp, <const double *>(qp + b * tq * d * item), d,
                         <const double *>(kp + b * tk * d * item), d, tq, tk, d,
                         <const double *>(gp + b * tq * tk * item), tk,
                         <double *>(dqp + b * tq * d * item), d,
                         <double *>(dkp + b * tk * d * item), d, dpp)
            if rc:
                break
    if rc:
        return (int(FA_ESCORE), int(rc))
    return (0, 0)


def selftest_capsule():
    """PyCapsule of the ABI self-test plugin (-gamma |q - k|^2)."""
    return PyCapsule_New(<void *>fa_selftest_plugin(), FASTATTN_PLUGIN_CAPSULE_NAME, NULL)


def tiled_attention(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind,
                    cnp.ndarray out, object weights, tuple batch_shape, bint causal,
                    int64_t causal_offset, int64_t block_q, int64_t block_k, int n_threads,
                    int score_kind, uintptr_t score_fn, cnp.ndarray params, bint check_scores,
                    object lse=None):
    """Run the kernel; returns (status, score function status).

    q, k, v, out (and mask, weights, lse when given) as for fastattn._kernels.sdpa
    (q and k share the feature size d); params: C-contiguous, its buffer is
    the score function's params (for SCORE_ADDITIVE: the v vector, d
    entries of q's dtype).
    """
    cdef fa_tiled_args a
    cdef layout_bufs lb
    cdef int rc
    fill_layout(&a, &lb, q, k, v, mask, mask_kind, FA_MASK_NONE, out, weights, lse, batch_shape)
    a.causal = causal
    a.causal_offset = causal_offset
    a.block_q = block_q
    a.block_k = block_k
    a.n_threads = n_threads
    a.score_params = cnp.PyArray_DATA(params)
    a.check_scores = check_scores
    a.score_status = 0
    a.score_f32 = NULL
    a.score_f64 = NULL
    cdef interrupt_state intr
    a.stop = interrupt_arm(&intr, _main_ident)
    a.stop_ctx = &intr if a.stop != NULL else NULL
    if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32:
        a.score_f32 = fa_additive_score_f32 if score_kind == SCORE_ADDITIVE else <fastattn_score_f32>score_fn
        with nogil:
            rc = fa_tiled_attention_f32(&a)
    else:
        a.score_f64 = fa_additive_score_f64 if score_kind == SCORE_ADDITIVE else <fastattn_score_f64>score_fn
        with nogil:
            rc = fa_tiled_attention_f64(&a)
    interrupt_raise(&intr)
    return rc, a.score_status


ctypedef struct _bwd_bufs:
    int64_t gbs[32]
    int64_t dqbs[32]
    int64_t dkbs[32]
    int64_t dvbs[32]


def additive_backward(cnp.ndarray qp, cnp.ndarray kp, cnp.ndarray vvec, cnp.ndarray v,
                      cnp.ndarray out, cnp.ndarray grad_out, cnp.ndarray lse, object mask,
                      int mask_kind, cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv,
                      cnp.ndarray dvec, cnp.ndarray delta, cnp.ndarray dq_part,
                      cnp.ndarray dvec_part, tuple batch_shape, bint causal,
                      int64_t causal_offset, int64_t block_q, int64_t block_k, int n_threads,
                      int64_t ngroups, bint accumulate=False):
    """Run the fused additive backward (csrc/fa_additive.h, fa_additive_bwd_args).
    Returns the C status code.

    qp (..., Lq, d), kp (..., Lk, d): the projected queries and keys; vvec: the
    v vector (d,), C-contiguous; v, mask as for :func:`tiled_attention`; out and
    grad_out (..., Lq, dv); lse (..., Lq, 1) with a unit row stride; dq (..., Lq,
    d), dk (..., Lk, d), dv (..., Lk, dv): full-batch outputs, each of its own
    memory; dvec: (d,) float64 output; scratch, contiguous float64: delta items
    x Lq, dq_part ngroups x items x Lq x d, dvec_part items x ngroups x d.  One
    float dtype; d, dv >= 1; last axes contiguous, BLAS-valid row strides.
    """
    cdef fa_additive_bwd_args a
    cdef layout_bufs lb
    cdef _bwd_bufs bb
    cdef int rc
    cdef interrupt_state intr
    cdef int nb = len(batch_shape)
    fill_layout(&a.f, &lb, qp, kp, v, mask, mask_kind, FA_MASK_NONE, out, None, lse, batch_shape)
    a.f.causal = causal
    a.f.causal_offset = causal_offset
    a.f.block_q = block_q
    a.f.block_k = block_k
    a.f.n_threads = n_threads
    a.f.score_f32 = NULL
    a.f.score_f64 = NULL
    a.f.score_params = cnp.PyArray_DATA(vvec)
    a.f.check_scores = 0
    a.f.score_status = 0
    _batch_strides(grad_out, nb, lb.shape, bb.gbs)
    _batch_strides(dq, nb, lb.shape, bb.dqbs)
    _batch_strides(dk, nb, lb.shape, bb.dkbs)
    _batch_strides(dv, nb, lb.shape, bb.dvbs)
    a.grad_out = cnp.PyArray_DATA(grad_out)
    a.g_bs = bb.gbs
    a.ldg = _ld(grad_out, a.f.dv)
    a.dq = cnp.PyArray_DATA(dq)
    a.dk = cnp.PyArray_DATA(dk)
    a.dv = cnp.PyArray_DATA(dv)
    a.dq_bs = bb.dqbs
    a.dk_bs = bb.dkbs
    a.dv_bs = bb.dvbs
    a.lddq = _ld(dq, a.f.d)
    a.lddk = _ld(dk, a.f.d)
    a.lddv = _ld(dv, a.f.dv)
    a.dvec = <double *>cnp.PyArray_DATA(dvec)
    a.delta = <double *>cnp.PyArray_DATA(delta)
    a.ngroups = ngroups
    a.dq_part = <double *>cnp.PyArray_DATA(dq_part)
    a.dvec_part = <double *>cnp.PyArray_DATA(dvec_part)
    a.accumulate = 1 if accumulate else 0
    a.f.stop = interrupt_arm(&intr, _main_ident)
    a.f.stop_ctx = &intr if a.f.stop != NULL else NULL
    with nogil:
        if cnp.PyArray_TYPE(qp) == cnp.NPY_FLOAT32:
            rc = fa_additive_bwd_f32(&a)
        else:
            rc = fa_additive_bwd_f64(&a)
    interrupt_raise(&intr)
    return rc


def pv_acc(cnp.ndarray p, cnp.ndarray v, cnp.ndarray o, tuple batch_shape):
    """o += p @ v over the batch, without BLAS.  p (..., m, n), v (..., n, dv),
    o (..., m, dv): one float dtype, contiguous last axes, BLAS-valid row
    strides, leading dims broadcasting to batch_shape (o's equal to it)."""
    cdef int64_t shape[32]
    cdef int64_t pbs[32]
    cdef int64_t vbs[32]
    cdef int64_t obs[32]
    cdef int nb = len(batch_shape)
    cdef int i
    cdef int64_t t, idx, r, po, vo, oo, total = 1
    for i in range(nb):
        shape[i] = batch_shape[i]
        total *= shape[i]
    _batch_strides(p, nb, shape, pbs)
    _batch_strides(v, nb, shape, vbs)
    _batch_strides(o, nb, shape, obs)
    cdef int64_t m = cnp.PyArray_DIMS(p)[cnp.PyArray_NDIM(p) - 2]
    cdef int64_t n = cnp.PyArray_DIMS(p)[cnp.PyArray_NDIM(p) - 1]
    cdef int64_t dv = cnp.PyArray_DIMS(v)[cnp.PyArray_NDIM(v) - 1]
    cdef int64_t ldp = _ld(p, n), ldv = _ld(v, dv), ldo = _ld(o, dv)
    cdef bint f32 = cnp.PyArray_TYPE(p) == cnp.NPY_FLOAT32
    cdef char *P = <char *>cnp.PyArray_DATA(p)
    cdef char *V = <char *>cnp.PyArray_DATA(v)
    cdef char *O = <char *>cnp.PyArray_DATA(o)
    cdef int64_t item = cnp.PyArray_ITEMSIZE(p)
    with nogil:
        for t in range(total):
            r = t
            po = 0
            vo = 0
            oo = 0
            for i in range(nb - 1, -1, -1):
                idx = r % shape[i]
                r = r // shape[i]
                po += idx * pbs[i]
                vo += idx * vbs[i]
                oo += idx * obs[i]
            if f32:
                fa_pv_acc_f32(m, dv, n, <const float *>(P + po * item), ldp,
                              <const float *>(V + vo * item), ldv, <float *>(O + oo * item), ldo)
            else:
                fa_pv_acc_f64(m, dv, n, <const double *>(P + po * item), ldp,
                              <const double *>(V + vo * item), ldv, <double *>(O + oo * item), ldo)


def tanh(cnp.ndarray x, cnp.ndarray y):
    """y = tanh(x) with the additive kernels' tanh; x, y contiguous, same float dtype."""
    cdef int64_t n = cnp.PyArray_SIZE(x)
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            fa_tanh_f32(<const float *>cnp.PyArray_DATA(x), <float *>cnp.PyArray_DATA(y), n)
    else:
        with nogil:
            fa_tanh_f64(<const double *>cnp.PyArray_DATA(x), <double *>cnp.PyArray_DATA(y), n)
