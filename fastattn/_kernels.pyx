# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Cython entry points into csrc/.

Canonical buffers in, preallocated outputs, GIL released, no user-facing
checks: ``fastattn.functional`` validates every argument before it calls here.

KeyboardInterrupt: a call from the main thread hands the kernel a stop
callback (fastattn/_interrupt.pxd) that runs Python's signal handlers about
every 10-20 ms; when one raises, the kernel stops early and the binding
re-raises that exception (the output buffers are then partly written).
"""
import os
import threading

cimport numpy as cnp
from libc.math cimport sqrt
from libc.stdint cimport int64_t, uintptr_t
from scipy.linalg.cython_blas cimport sgemm, dgemm

from fastattn._buffers cimport batch_strides, row_ld
from fastattn._cargs cimport fa_sdpa_args, fill_layout, layout_bufs
from fastattn._interrupt cimport interrupt_arm, interrupt_raise, interrupt_state, thread_ident

cnp.import_array()

cdef extern from "fastattn.h" nogil:
    int FA_OK, FA_ENOMEM, FA_EINVAL, FA_EINTR
    int FA_MAX_BATCH_DIMS
    int FA_MASK_NONE, FA_MASK_BOOL, FA_MASK_ADD
    int FA_PATH_SINGLE, FA_PATH_STREAM
    ctypedef void (*fa_sgemm_fn)(char*, char*, int*, int*, int*, float*, float*, int*,
                                 float*, int*, float*, float*, int*)
    ctypedef void (*fa_dgemm_fn)(char*, char*, int*, int*, int*, double*, double*, int*,
                                 double*, int*, double*, double*, int*)
    ctypedef int (*fa_blas_set_threads_fn)(int)
    void fa_set_blas(fa_sgemm_fn, fa_dgemm_fn, fa_blas_set_threads_fn)
    int fa_sdpa_f32(const fa_sdpa_args *a)
    int fa_sdpa_f64(const fa_sdpa_args *a)
    ctypedef struct fa_sdpa_bwd_args:
        fa_sdpa_args f
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
        void *dmask
        const int64_t *dm_bs
        int64_t lddm
        void *delta
        int64_t ngroups
        void *dq_part
    int FA_BWD_MAX_GROUPS
    int fa_sdpa_bwd_f32(const fa_sdpa_bwd_args *a)
    int fa_sdpa_bwd_f64(const fa_sdpa_bwd_args *a)
    void fa_exp_f32(const float *x, float *y, int64_t n)
    void fa_exp_f64(const double *x, double *y, int64_t n)
    float fa_expsub_sum_f32(float *x, int64_t n, float m)
    double fa_expsub_sum_f64(double *x, int64_t n, double m)
    float fa_expsub_masked_f32(float *x, int64_t n, float m)
    double fa_expsub_masked_f64(double *x, int64_t n, double m)
    int fa_simd_active()
    double fa_fma_probe(int64_t n, float *sink)
    int fa_pool_workers()
    int64_t fa_pool_last_helped()
    int fa_pool_hold(int delta)
    int fa_simd_compiled()
    void fa_simd_set_disabled(int disable)
    int fa_simd_level()
    void fa_simd_set_max_level(int level)
    int fa_simd_max_level()

cdef extern from "fa_pool.h" nogil:
    ctypedef void (*fa_task_fn)(void *ctx, int64_t task, int slot) noexcept nogil
    ctypedef int (*fa_stop_fn)(void *stop_ctx) noexcept nogil
    int fa_pool_run(int64_t ntasks, int nthreads, fa_task_fn fn, void *ctx,
                    fa_stop_fn stop, void *stop_ctx)

MASK_NONE = FA_MASK_NONE
MASK_BOOL = FA_MASK_BOOL
MASK_ADD = FA_MASK_ADD
PATH_SINGLE = FA_PATH_SINGLE
PATH_STREAM = FA_PATH_STREAM
MAX_BATCH_DIMS = FA_MAX_BATCH_DIMS
BWD_MAX_GROUPS = FA_BWD_MAX_GROUPS

fa_set_blas(<fa_sgemm_fn>sgemm, <fa_dgemm_fn>dgemm, NULL)

# Python runs signal handlers on its main thread only: calls from there get
# the stop callback.  After fork() the forking thread is the child's main thread.
cdef unsigned long _main_ident = threading.main_thread().ident


def _after_fork_in_child():
    global _main_ident
    _main_ident = thread_ident()


os.register_at_fork(after_in_child=_after_fork_in_child)


cdef int _run_sdpa(fa_sdpa_args *a, bint f32) except? -1:
    """fa_sdpa_f32 / _f64 on ``a`` with the GIL released and, from the main thread,
    the stop callback; then raise what a signal handler raised meanwhile."""
    cdef interrupt_state intr
    cdef int rc
    a.stop = interrupt_arm(&intr, _main_ident)
    a.stop_ctx = &intr if a.stop != NULL else NULL
    with nogil:
        if f32:
            rc = fa_sdpa_f32(a)
        else:
            rc = fa_sdpa_f64(a)
    interrupt_raise(&intr)
    return rc


def set_blas_threads_hook(uintptr_t address):
    """Install ``int f(int)`` (set BLAS threads, return the previous count); 0 removes it."""
    fa_set_blas(<fa_sgemm_fn>sgemm, <fa_dgemm_fn>dgemm, <fa_blas_set_threads_fn>address)


def pool_workers():
    """Worker threads alive in the kernels' pool."""
    return fa_pool_workers()


def pool_hold(int delta):
    """Open (1) or close (-1) a hold on the pool's workers: while one is open,
    idle workers spin longer for the next call (a layer's many small calls).
    Returns the holds now open (``pool_hold(0)``: just that)."""
    return fa_pool_hold(delta)


def pool_last_helped():
    """Tasks the pool's workers (not the caller) ran in the last parallel call."""
    return fa_pool_last_helped()


def simd_compiled():
    return bool(fa_simd_compiled())


def simd_active():
    return bool(fa_simd_active())


def set_simd_disabled(bint disable):
    fa_simd_set_disabled(disable)


def simd_level():
    """0 scalar, 1 AVX2/FMA, 2 AVX-512 products."""
    return fa_simd_level()


def set_simd_max_level(int level):
    """Cap the level CPU detection may choose (2: no cap)."""
    fa_simd_set_max_level(level)


def simd_max_level():
    return fa_simd_max_level()


def sdpa(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, object mask, int mask_kind,
         cnp.ndarray out, object weights, tuple batch_shape, bint causal,
         int64_t causal_offset, double scale, int64_t block_q, int64_t block_k,
         int path, bint direct, int n_threads, object lse=None):
    """Run the kernel.  Returns the C status code (0 = OK).

    q, k, v, out (and mask, weights when given) share one float dtype, have
    contiguous last axes and BLAS-valid row strides; their leading dims
    broadcast to batch_shape.  A mask row stride of 0 means one key mask for
    all queries (its query dim has size 1).  lse, when given: (..., Lq, 1) of
    the same dtype with a unit row stride, written with each row's
    log-sum-exp (-inf for a row with no allowed key).
    """
    cdef fa_sdpa_args a
    cdef layout_bufs lb
    cdef int rc
    fill_layout(&a, &lb, q, k, v, mask, mask_kind, FA_MASK_NONE, out, weights, lse, batch_shape)
    a.causal = causal
    a.causal_offset = causal_offset
    a.scale = scale
    a.block_q = block_q
    a.block_k = block_k
    a.path = path
    a.direct = direct
    a.n_threads = n_threads
    rc = _run_sdpa(&a, cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32)
    return rc


ctypedef struct _bwd_bufs:
    int64_t gbs[32]
    int64_t dqbs[32]
    int64_t dkbs[32]
    int64_t dvbs[32]
    int64_t dmbs[32]


def sdpa_backward(cnp.ndarray q, cnp.ndarray k, cnp.ndarray v, cnp.ndarray out,
                  cnp.ndarray grad_out, cnp.ndarray lse, object mask, int mask_kind,
                  cnp.ndarray dq, cnp.ndarray dk, cnp.ndarray dv, object dmask,
                  cnp.ndarray delta, tuple batch_shape, bint causal, int64_t causal_offset,
                  double scale, int64_t block_q, int64_t block_k, int n_threads,
                  int64_t ngroups=1, object dq_part=None, bint direct=False):
    """Run the backward kernel (csrc/fastattn.h, fa_sdpa_bwd_args).  Returns the
    C status code.

    q, k, v, mask as for :func:`sdpa`; out and grad_out (..., Lq, dv); lse
    (..., Lq, 1) with a unit row stride; dq (..., Lq, d), dk (..., Lk, d), dv
    (..., Lk, dv) and dmask (..., Lq, Lk) or None: full-batch outputs, each of
    its own memory; delta: contiguous float64, (number of batch items) x Lq;
    ngroups key groups per batch item (1 to BWD_MAX_GROUPS), dq_part: contiguous
    scratch of (ngroups - 1) x items x Lq x d elements, or None for 1; direct:
    the packed products (the forward's streaming path with SIMD) instead of BLAS.
    One float dtype; d, dv >= 1; last axes contiguous, BLAS-valid row strides.
    """
    cdef fa_sdpa_bwd_args a
    cdef layout_bufs lb
    cdef _bwd_bufs bb
    cdef int rc
    cdef interrupt_state intr
    cdef int nb = len(batch_shape)
    cdef cnp.ndarray dm
    fill_layout(&a.f, &lb, q, k, v, mask, mask_kind, FA_MASK_NONE, out, None, lse, batch_shape)
    a.f.causal = causal
    a.f.causal_offset = causal_offset
    a.f.scale = scale
    a.f.block_q = block_q
    a.f.block_k = block_k
    a.f.path = FA_PATH_STREAM
    a.f.direct = direct
    a.f.n_threads = n_threads
    batch_strides(grad_out, nb, lb.shape, bb.gbs)
    batch_strides(dq, nb, lb.shape, bb.dqbs)
    batch_strides(dk, nb, lb.shape, bb.dkbs)
    batch_strides(dv, nb, lb.shape, bb.dvbs)
    a.grad_out = cnp.PyArray_DATA(grad_out)
    a.g_bs = bb.gbs
    a.ldg = row_ld(grad_out, a.f.dv)
    a.dq = cnp.PyArray_DATA(dq)
    a.dk = cnp.PyArray_DATA(dk)
    a.dv = cnp.PyArray_DATA(dv)
    a.dq_bs = bb.dqbs
    a.dk_bs = bb.dkbs
    a.dv_bs = bb.dvbs
    a.lddq = row_ld(dq, a.f.d)
    a.lddk = row_ld(dk, a.f.d)
    a.lddv = row_ld(dv, a.f.dv)
    a.dmask = NULL
    a.dm_bs = bb.dmbs
    a.lddm = 0
    if dmask is not None:
        dm = <cnp.ndarray>dmask
        batch_strides(dm, nb, lb.shape, bb.dmbs)
        a.dmask = cnp.PyArray_DATA(dm)
        a.lddm = row_ld(dm, a.f.Lk)
    a.delta = cnp.PyArray_DATA(delta)
    a.ngroups = ngroups
    a.dq_part = NULL if dq_part is None else cnp.PyArray_DATA(<cnp.ndarray>dq_part)
    a.f.stop = interrupt_arm(&intr, _main_ident)
    a.f.stop_ctx = &intr if a.f.stop != NULL else NULL
    with nogil:
        if cnp.PyArray_TYPE(q) == cnp.NPY_FLOAT32:
            rc = fa_sdpa_bwd_f32(&a)
        else:
            rc = fa_sdpa_bwd_f64(&a)
    interrupt_raise(&intr)
    return rc


ctypedef struct _probe_ctx:
    int64_t iters
    double flops[64]
    float sink


cdef void _probe_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef _probe_ctx *c = <_probe_ctx *>vctx
    cdef float sink = 0
    c.flops[t] = fa_fma_probe(c.iters, &sink)
    if sink == 12345.0:  # keeps the chains alive; never true
        c.sink = sink


def fma_probe(int64_t iters, int n_threads):
    """Float FMA throughput yardstick for the benchmarks: 64 tasks of ``iters``
    iterations of 12 independent 8-lane FMAs each, on fastattn's pool with
    ``n_threads`` threads.  Returns the flops done (0 when the AVX2 code is
    not in use); flops / elapsed time is the machine's FMA peak at that thread
    count, the ceiling every float32 kernel's GFLOP/s is compared with."""
    cdef _probe_ctx c
    cdef int t
    c.iters = iters if iters > 0 else 0
    c.sink = 0
    with nogil:
        fa_pool_run(64, n_threads if n_threads > 0 else 1, _probe_task, &c, NULL, NULL)
    cdef double total = 0
    for t in range(64):
        total += c.flops[t]
    return total


def exp(cnp.ndarray x, cnp.ndarray y):
    """y = exp(x) elementwise with the dispatched kernel; x, y contiguous, same float dtype."""
    cdef int64_t n = cnp.PyArray_SIZE(x)
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            fa_exp_f32(<const float *>cnp.PyArray_DATA(x), <float *>cnp.PyArray_DATA(y), n)
    else:
        with nogil:
            fa_exp_f64(<const double *>cnp.PyArray_DATA(x), <double *>cnp.PyArray_DATA(y), n)


def expsub(cnp.ndarray x, double m, bint masked=False):
    """x = exp(x - m) in place (x <= m: a softmax row); returns the sum.  x contiguous.
    masked: the variant for rows with masked (-inf) entries."""
    cdef int64_t n = cnp.PyArray_SIZE(x)
    cdef double r
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            if masked:
                r = fa_expsub_masked_f32(<float *>cnp.PyArray_DATA(x), n, <float>m)
            else:
                r = fa_expsub_sum_f32(<float *>cnp.PyArray_DATA(x), n, <float>m)
    else:
        with nogil:
            if masked:
                r = fa_expsub_masked_f64(<double *>cnp.PyArray_DATA(x), n, m)
            else:
                r = fa_expsub_sum_f64(<double *>cnp.PyArray_DATA(x), n, m)
    return r


# ---------------------------------------------------------------- fast entry
# The plain call -- three C-contiguous, aligned, writeable ndarrays of one
# float dtype, equal leading dims, no mask/out/weights -- with the plan of its
# signature remembered here, so a repeated call costs one C-level comparison
# instead of Python attribute lookups and a tuple-keyed dict.  Only buffer
# properties are checked: anything else returns None and functional takes its
# general path (which validates and explains).  The GIL guards the cache.

DEF _FAST_SLOTS = 8

cdef struct _fast_slot:
    int used
    int typenum
    int nd
    int64_t dims[34]    # q's dims, then Lk, dv
    int n_threads
    int causal
    int bottom_right
    int simd
    int64_t block_q
    int64_t block_k
    int path
    int direct
    int nt

cdef _fast_slot _slots[_FAST_SLOTS]
cdef int _slot_next = 0


def clear_fast_plans():
    """Forget the remembered plans (after the planning constants changed)."""
    global _slot_next
    cdef int i
    for i in range(_FAST_SLOTS):
        _slots[i].used = 0
    _slot_next = 0


cdef inline bint _plain(object x, int typenum, int nd) noexcept:
    if type(x) is not cnp.ndarray:
        return False
    cdef cnp.ndarray a = <cnp.ndarray>x
    return (cnp.PyArray_TYPE(a) == typenum and cnp.PyArray_NDIM(a) == nd
            and cnp.PyArray_ISCARRAY(a))


def sdpa_plain(object query, object key, object value, bint causal, bint bottom_right,
               object scale, int n_threads, object planner):
    """Run the plain call, returning the output array, or the C status (an int)
    when the kernel failed, or None when the arguments are not the plain case.

    planner(batch, Lq, Lk, d, dv, n_threads, causal, dtype) ->
    (block_q, block_k, path, direct, threads) is called on a signature not
    seen before.
    """
    global _slot_next
    if type(query) is not cnp.ndarray:
        return None
    cdef cnp.ndarray q = <cnp.ndarray>query
    cdef int typenum = cnp.PyArray_TYPE(q)
    if typenum != cnp.NPY_FLOAT32 and typenum != cnp.NPY_FLOAT64:
        return None
    cdef int nd = cnp.PyArray_NDIM(q)
    if nd < 2 or nd > FA_MAX_BATCH_DIMS + 2 or not cnp.PyArray_ISCARRAY(q):
        return None
    if not _plain(key, typenum, nd) or not _plain(value, typenum, nd):
        return None
    cdef cnp.ndarray k = <cnp.ndarray>key
    cdef cnp.ndarray v = <cnp.ndarray>value
    cdef cnp.npy_intp *qd = cnp.PyArray_DIMS(q)
    cdef cnp.npy_intp *kd = cnp.PyArray_DIMS(k)
    cdef cnp.npy_intp *vd = cnp.PyArray_DIMS(v)
    cdef int i, j, nb = nd - 2
    for i in range(nb):
        if kd[i] != qd[i] or vd[i] != qd[i]:
            return None
    cdef int64_t Lq = qd[nd - 2], d = qd[nd - 1], Lk = kd[nd - 2], dv = vd[nd - 1]
    cdef int64_t imax = 2147483647
    if (kd[nd - 1] != d or vd[nd - 2] != Lk or d <= 0 or dv <= 0 or Lk <= 0
            or d > imax or dv > imax or Lk > imax or Lq > imax):
        return None
    cdef double sc
    if scale is None:
        sc = 1.0 / sqrt(<double>d)
    elif type(scale) is float:
        sc = <double>scale
    else:
        return None
    cdef int simd = fa_simd_active()
    cdef _fast_slot *s = NULL
    cdef _fast_slot *c
    for i in range(_FAST_SLOTS):
        c = &_slots[i]
        if (c.used and c.typenum == typenum and c.nd == nd and c.n_threads == n_threads
                and c.causal == causal and c.bottom_right == bottom_right and c.simd == simd
                and c.dims[nd] == Lk and c.dims[nd + 1] == dv):
            j = 0
            while j < nd and c.dims[j] == qd[j]:
                j += 1
            if j == nd:
                s = c
                break
    if s is NULL:
        batch = tuple([qd[i] for i in range(nb)])
        plan = planner(batch, Lq, Lk, d, dv, n_threads, causal, q.dtype)
        s = &_slots[_slot_next]
        _slot_next = (_slot_next + 1) % _FAST_SLOTS
        s.used = 0
        s.typenum = typenum
        s.nd = nd
        for i in range(nd):
            s.dims[i] = qd[i]
        s.dims[nd] = Lk
        s.dims[nd + 1] = dv
        s.n_threads = n_threads
        s.causal = causal
        s.bottom_right = bottom_right
        s.simd = simd
        s.block_q, s.block_k, s.path, s.direct, s.nt = plan
        s.used = 1
    # the plan read now: allocating the output may run Python code (a
    # collection) that lets another thread replace this slot
    cdef int64_t p_bq = s.block_q, p_bk = s.block_k
    cdef int p_path = s.path, p_direct = s.direct, p_nt = s.nt

    cdef cnp.npy_intp odims[34]
    for i in range(nd - 1):
        odims[i] = qd[i]
    odims[nd - 1] = dv
    cdef cnp.ndarray out = cnp.PyArray_EMPTY(nd, odims, typenum, 0)

    cdef fa_sdpa_args a
    cdef int64_t shape[32]
    cdef int64_t qbs[32]
    cdef int64_t kbs[32]
    cdef int64_t vbs[32]
    cdef int64_t obs[32]
    cdef int64_t sq = Lq * d, sk = Lk * d, sv = Lk * dv, so = Lq * dv
    for i in range(nb - 1, -1, -1):  # C-contiguous: strides from the dims
        shape[i] = qd[i]
        qbs[i] = sq if qd[i] != 1 else 0
        kbs[i] = sk if qd[i] != 1 else 0
        vbs[i] = sv if qd[i] != 1 else 0
        obs[i] = so if qd[i] != 1 else 0
        sq *= qd[i]
        sk *= qd[i]
        sv *= qd[i]
        so *= qd[i]
    a.nbatch = nb
    a.batch_shape = shape
    a.q_bs = qbs
    a.k_bs = kbs
    a.v_bs = vbs
    a.o_bs = obs
    a.m_bs = NULL
    a.w_bs = NULL
    a.Lq = Lq
    a.Lk = Lk
    a.d = d
    a.dv = dv
    a.ldq = d
    a.ldk = d
    a.ldv = dv
    a.ldo = dv
    a.ldm = 0
    a.ldw = 0
    a.q = cnp.PyArray_DATA(q)
    a.k = cnp.PyArray_DATA(k)
    a.v = cnp.PyArray_DATA(v)
    a.mask = NULL
    a.mask_kind = FA_MASK_NONE
    a.causal = causal
    a.causal_offset = Lk - Lq if (causal and bottom_right) else 0
    a.scale = sc
    a.out = cnp.PyArray_DATA(out)
    a.weights = NULL
    a.lse = NULL
    a.block_q = p_bq
    a.block_k = p_bk
    a.path = p_path
    a.direct = p_direct
    a.n_threads = p_nt
    cdef int rc = _run_sdpa(&a, typenum == cnp.NPY_FLOAT32)
    if rc != FA_OK:
        return rc
    return out
