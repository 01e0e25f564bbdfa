# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Projection kernels for multi-head attention: ``Y = X W^T + b`` over BLAS.

Canonical buffers in, a preallocated output, GIL released, no user-facing
checks: ``fastattn._multihead`` validates every argument before it calls here.

Row-major arrays are handed to the Fortran (column-major) gemm as their
transposes: row-major ``Y (M, N)`` with row stride ``ldy`` is column-major
``Y^T (N, M)`` with leading dimension ``ldy``, so ``Y = X W^T`` becomes
``Y^T = W X^T`` = ``gemm('T', 'N', N, M, K, 1, W, ldw, X, ldx, beta, Y, ldy)``.
The bias is written into ``Y`` first and the gemm adds to it (``beta = 1``).

Float32 blocks of at most 128 rows skip BLAS: csrc/fa_proj.c reads the
weights in place (register-blocked dot products, AVX2/FMA) instead of packing
them on every call, which is what makes few-row gemms slow.

Prepacked float32 weights (a frozen layer's, :func:`pack_f32`): given to
``linear`` as ``wp``, every block reads them through csrc/fa_proj.c's packed
kernel instead (faster than both of the above at every row count measured),
with the same blocking, threads and stop callback.

``matmul`` (the backward's products, ``op(A) op(B)``) cuts its result into
tiles whose sizes depend on the shapes only, so it gives the same bits for
any thread count.

Threads: the same regime as the attention kernel.  ``Y`` is cut into blocks
(of rows, or of columns when there are few rows) that fastattn's worker pool
hands out one at a time; each block is one single-threaded gemm, and BLAS is
held at one thread meanwhile through the attention kernel's own save/restore
counter.  The pool and that counter live in ``fastattn._kernels``; their C
entry points (``fa_pool_run``, ``fa_blas_threads_enter`` / ``_exit``, see
csrc/fastattn.h) are handed over once by address (:func:`set_runtime`), so
both modules share one pool and one counter.  Letting OpenBLAS thread the
projections itself was measured to be worse: its workers keep spinning for
~0.1 s after a call and slowed the attention kernel that runs next by up to 2x
on two cores.  Without the runtime (``set_runtime`` not called) a call is one
gemm with OpenBLAS's own threading.

KeyboardInterrupt: a call from the main thread is run through the pool (one
thread or more) with a stop callback (fastattn/_interrupt.pxd) asked between
blocks; no block exceeds MAX_BLOCK_FLOPS, so a large product answers within
a few tens of milliseconds.
"""
import os
import threading

cimport numpy as cnp
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy
from scipy.linalg.cython_blas cimport sgemm, dgemm

from fastattn._interrupt cimport (interrupt_arm, interrupt_raise, interrupt_state, stop_fn,
                                  thread_ident)
from fastattn._runtime cimport (fa_store_status, runtime, runtime_hold, runtime_release, task_fn,
                                runtime_level, runtime_run, runtime_set, runtime_simd)

cnp.import_array()

# signal handlers run on the main thread only (as in fastattn._kernels)
cdef unsigned long _main_ident = threading.main_thread().ident


def _after_fork_in_child():
    global _main_ident
    _main_ident = thread_ident()


os.register_at_fork(after_in_child=_after_fork_in_child)

cdef extern from "fa_proj.h" nogil:
    int fa_proj_small_available()
    int fa_proj_small_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                          const float *w, int64_t ldw, const float *b, float *y, int64_t ldy)
    int64_t fa_proj_packed_size(int64_t n, int64_t k)
    void fa_proj_pack_f32(int64_t n, int64_t k, const float *w, int64_t ldw, float *wp)
    void fa_proj_pack_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                                 const float *w, int64_t ldw, float *wp, int simd)
    void fa_proj_pack_t_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                                   const float *bt, int64_t ldb, float *wp)
    int fa_proj_packed_available()
    void fa_proj_packed_tune(int64_t kc, int64_t mc)
    void fa_proj_packed_tune_rows(int rows)
    int fa_proj_packed_runs_f32(int64_t m, int64_t n, int64_t k, const float *x, int64_t ldx,
                                const float *wp, int64_t c0, const float *b, float *y,
                                int64_t ldy, int wide, int64_t runs)
    int fa_proj_packed_xt_runs_f32(int64_t m, int64_t n, int64_t k, const float *xt,
                                   int64_t ldt, const float *wp, int64_t c0, const float *b,
                                   float *y, int64_t ldy, int wide, int64_t runs, double *csum)
    int FA_PROJ_XT_MAX_RUNS
    int FA_PROJ_ENOMEM
    int FA_PROJ_PANEL
    int FA_PROJ_PACKED_KC
    int FA_PROJ_PACKED_MC

# this module's copy of fastattn._kernels' pool, BLAS hold and SIMD switch
# (fastattn/_runtime.pxd): a C static, so all NULL until set_runtime
cdef runtime g_rt

# Blocking (measured on the 2-core AVX2 machine, E = 512): about two blocks a
# thread keep both cores busy when one is briefly taken by another process;
# fewer than min_block_rows rows a block and the split goes over columns instead
# (blocks of at least min_block_cols), so small batches still use every thread.
# float32 blocks of at most small_m rows use csrc/fa_proj.c instead of sgemm
# (the weights read in place rather than packed on every call; measured, one
# thread, K = 512: 2x sgemm's speed at 16 rows, even at 128).
# Module state so that benchmarks/ can sweep them (set_tuning).
cdef int g_blocks_per_thread = 2
cdef int g_min_block_rows = 64
cdef int g_min_block_cols = 128
cdef int g_small_m = 128
# float32 blocks of at most packed_m rows use the prepacked weights when the
# caller has them (linear's ``wp``); measured faster than both the few-row
# kernel and sgemm at every row count (one thread, K = 512, N = 512 / 1536:
# 95-99 GFLOP/s from 4 rows up, against 80-87 few-row and ~90 sgemm), so no limit.
cdef int g_packed_m = 2147483647
# Without packed weights from the caller, float32 products of at least
# pack_min_rows rows (all batch items together) pack w on every call (AVX2
# transposes on the pool, into a per-thread grow-only buffer of at most
# pack_max_elems floats) and use the packed kernel; 0 turns this off.
cdef int64_t g_pack_min_rows = 64
cdef int64_t g_pack_max_elems = 4 * 1024 * 1024
# matmul's tile size (the backward's products; see matmul below).  A product's
# bits depend on it: change it only for tuning sweeps, never between calls
# whose results are compared.
cdef int64_t g_mm_tile = 256
# matmul's split reduction (matmul_kpart); 0 turns it off (tuning sweeps)
cdef int g_mm_ksplit = 1
DEF MM_MIN_TILE = 64
# matmul: at least this many tiles when the tiles can be halved (two cores, one
# of them now and then taken by another process), and with a chunked reduction
# tiles of at most MM_KC_TILE elements
DEF MM_MIN_TILES = 4
DEF MM_KC_TILE = 32768
# matmul's split reduction (matmul_kpart): results of at most this many
# elements, parts of at least MM_KPART_MIN rows
DEF MM_KSPLIT_ELEMS = 262144
DEF MM_KPART_MIN = 256
# Below this many flops a call runs on the calling thread alone -- unless the
# weights have PARALLEL_MIN_WEIGHTS elements or more: a few-row product reads
# all of them once, from L3 or memory, and two cores read twice as fast (one
# row x (1000, 256) float32, 1 MB: 20 us on one thread, see _linear.py).
DEF PARALLEL_MIN_FLOPS = 2000000.0
DEF PARALLEL_MIN_WEIGHTS = 131072
# No block larger than this (measured on one core: 19 ms float32, 35 ms
# float64): the stop callback is
# asked between blocks.  Blocks are halved (rows first, down to 2 *
# min_block_rows, then columns down to 2 * min_block_cols) on every thread
# count, so a product's blocking does not depend on where it is called from.
DEF MAX_BLOCK_FLOPS = 1000000000.0


cdef int64_t g_packed_kc = FA_PROJ_PACKED_KC
cdef int64_t g_packed_mc = FA_PROJ_PACKED_MC
cdef int g_packed_rows = 12


def set_tuning(blocks_per_thread=None, min_block_rows=None, min_block_cols=None, small_m=None,
               packed_m=None, packed_kc=None, packed_mc=None, pack_min_rows=None,
               pack_max_elems=None, mm_tile=None, mm_ksplit=None, packed_rows=None):
    """Change the blocking parameters (for tuning sweeps); returns the previous ones as a dict.

    ``packed_kc`` / ``packed_mc``: csrc/fa_proj.c's cache blocking of the
    packed kernel (0: no split); process-wide, set them only with no call running.
    ``packed_rows``: the tallest row block of the packed kernel's 512-bit path
    (8..12; the same floats for any).
    ``mm_tile``: :func:`matmul`'s tile size (at least 64; its results' bits depend on it).
    ``mm_ksplit``: False turns off :func:`matmul`'s split reduction (:func:`matmul_kpart`;
    the bits depend on it too).
    """
    global g_blocks_per_thread, g_min_block_rows, g_min_block_cols, g_small_m, g_packed_m
    global g_packed_kc, g_packed_mc, g_pack_min_rows, g_pack_max_elems, g_mm_tile, g_mm_ksplit
    global g_packed_rows
    prev = dict(blocks_per_thread=g_blocks_per_thread, min_block_rows=g_min_block_rows,
                min_block_cols=g_min_block_cols, small_m=g_small_m, packed_m=g_packed_m,
                packed_kc=g_packed_kc, packed_mc=g_packed_mc, pack_min_rows=g_pack_min_rows,
                pack_max_elems=g_pack_max_elems, mm_tile=g_mm_tile, mm_ksplit=bool(g_mm_ksplit),
                packed_rows=g_packed_rows)
    if packed_rows is not None:
        g_packed_rows = min(12, max(8, int(packed_rows)))
        fa_proj_packed_tune_rows(g_packed_rows)
    if mm_ksplit is not None:
        g_mm_ksplit = 1 if mm_ksplit else 0
    if mm_tile is not None:
        g_mm_tile = max(MM_MIN_TILE, int(mm_tile))
    if pack_min_rows is not None:
        g_pack_min_rows = max(0, int(pack_min_rows))
    if pack_max_elems is not None:
        g_pack_max_elems = max(0, int(pack_max_elems))
    if packed_m is not None:
        g_packed_m = max(0, int(packed_m))
    if packed_kc is not None or packed_mc is not None:
        if packed_kc is not None:
            g_packed_kc = max(0, int(packed_kc))
        if packed_mc is not None:
            g_packed_mc = max(0, int(packed_mc))
        fa_proj_packed_tune(g_packed_kc, g_packed_mc)
    if blocks_per_thread is not None:
        g_blocks_per_thread = max(1, int(blocks_per_thread))
    if min_block_rows is not None:
        g_min_block_rows = max(1, int(min_block_rows))
    if min_block_cols is not None:
        g_min_block_cols = max(1, int(min_block_cols))
    if small_m is not None:
        g_small_m = max(0, int(small_m))
    return prev


ctypedef struct lin_ctx:
    int f32
    char *x
    char *w
    char *b
    char *y
    int64_t xbs, ybs          # batch strides (elements)
    int ldx, ldw, ldy
    int xt                    # x given as its transpose (K x M, row stride ldx)
    int M, N, K
    int mb, nbm               # row block size, row blocks per batch item
    int cb, nbc               # column block size, column blocks
    int64_t item
    int small                 # use fa_proj_small_f32
    char *wp                  # the packed weights (fa_proj_pack_f32), or NULL
    int packed                # use fa_proj_packed_f32 on wp
    int wide                  # ... with its AVX-512 kernels (fastattn's SIMD level 2)
    int64_t runs              # ... with the reduction in runs of this many terms (0: one)
    double *csum              # xt: x's column sums (M doubles, added to), or NULL
    int status                # first non-zero status of fa_proj_small_f32 (0: all ran)


def set_runtime(uintptr_t pool_run, uintptr_t hold_enter, uintptr_t hold_exit,
                uintptr_t simd_active=0):
    """Install fastattn._kernels' pool, BLAS hold and SIMD switch (C addresses); 0s uninstall.

    ``simd_active`` (``int f(void)``, fastattn's AVX2 dispatch, which
    ``FASTATTN_DISABLE_SIMD`` turns off) gates the few-row kernel; without it
    that kernel is not used.
    """
    runtime_set(&g_rt, pool_run, hold_enter, hold_exit, simd_active)


def small_kernel_active():
    """True when float32 blocks of few rows use csrc/fa_proj.c rather than sgemm."""
    return runtime_simd(&g_rt) and fa_proj_small_available() != 0


def runtime_installed():
    return g_rt.pool_run != NULL


def packed_kernel_active():
    """True when float32 products given packed weights (``linear(.., wp=)``) use them."""
    return runtime_simd(&g_rt) and fa_proj_packed_available() != 0


PANEL = FA_PROJ_PANEL


def packed_size(int64_t N, int64_t K):
    """Elements (float32) of the packed form of an (N, K) weight: N rounded up to 16, times K."""
    return fa_proj_packed_size(N, K)


def pack_f32(cnp.ndarray w, cnp.ndarray wp):
    """Write the packed form of the float32 weight ``w`` (N, K) into ``wp``.

    w: 2-D float32, last axis contiguous, row stride >= K (a single row any);
    wp: 1-D contiguous float32 of :func:`packed_size` (N, K) elements, not
    overlapping w.  Layout (csrc/fa_proj.h): panels of 16 rows of w, panel p
    holding for each input feature c the 16 values ``w[16 p + jj, c]``, zeros
    past row N; rows ``[16 q, N)`` of w are the packed form from element
    ``16 q K`` on.  Portable C (no SIMD needed).  Returns ``wp``.
    """
    cdef int64_t N = cnp.PyArray_DIMS(w)[0]
    cdef int64_t K = cnp.PyArray_DIMS(w)[1]
    cdef int64_t ldw = _rows_ld(w, K)
    cdef const float *src = <const float *>cnp.PyArray_DATA(w)
    cdef float *dst = <float *>cnp.PyArray_DATA(wp)
    with nogil:
        fa_proj_pack_f32(N, K, src, ldw, dst)
    return wp


cdef inline int64_t _rows_ld(cnp.ndarray a, int64_t cols) noexcept:
    """Row stride in elements of the last two axes; a single row gets a BLAS-valid one."""
    cdef int nd = cnp.PyArray_NDIM(a)
    if cnp.PyArray_DIMS(a)[nd - 2] <= 1:
        return cols if cols > 0 else 1
    return cnp.PyArray_STRIDES(a)[nd - 2] // cnp.PyArray_ITEMSIZE(a)


cdef void _task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef lin_ctx *c = <lin_ctx *>vctx
    cdef int64_t per = <int64_t>c.nbm * c.nbc
    cdef int64_t i = t // per
    cdef int64_t rem = t - i * per
    cdef int rb = <int>(rem // c.nbc)
    cdef int cbk = <int>(rem - <int64_t>rb * c.nbc)
    cdef int r0 = rb * c.mb
    cdef int c0 = cbk * c.cb
    cdef int m = c.M - r0
    cdef int n = c.N - c0
    cdef int r
    cdef char ta = b'T'
    cdef char tn = b'N'
    cdef float one_f = 1, beta_f = 0
    cdef double one_d = 1, beta_d = 0
    if m > c.mb:
        m = c.mb
    if n > c.cb:
        n = c.cb
    if m <= 0 or n <= 0:
        return
    cdef int64_t it = c.item
    cdef char *x = c.x + (i * c.xbs + (<int64_t>r0 if c.xt else <int64_t>r0 * c.ldx)) * it
    cdef char *w = c.w + (<int64_t>c0 * c.ldw) * it
    cdef char *y = c.y + (i * c.ybs + <int64_t>r0 * c.ldy + c0) * it
    cdef int rc
    cdef const float *bias = <float *>(c.b + <int64_t>c0 * it) if c.b != NULL else NULL
    if c.packed:   # x read in place, or (xt) given as its transpose
        if c.xt:
            # the column sums of this row block by its first column block's task
            rc = fa_proj_packed_xt_runs_f32(m, n, c.K, <float *>x, c.ldx, <float *>c.wp, c0,
                                            bias, <float *>y, c.ldy, c.wide, c.runs,
                                            c.csum + r0 if c.csum != NULL and c0 == 0 else NULL)
        else:
            rc = fa_proj_packed_runs_f32(m, n, c.K, <float *>x, c.ldx, <float *>c.wp, c0,
                                         bias, <float *>y, c.ldy, c.wide, c.runs)
        if rc != 0:
            fa_store_status(&c.status, rc)
        return
    if c.small:
        rc = fa_proj_small_f32(m, n, c.K, <float *>x, c.ldx, <float *>w, c.ldw,
                               <float *>(c.b + <int64_t>c0 * it) if c.b != NULL else NULL,
                               <float *>y, c.ldy)
        if rc != 0:  # recorded for linear() to raise; the block is left unwritten
            fa_store_status(&c.status, rc)
        return
    if c.b != NULL:
        beta_f = 1
        beta_d = 1
        for r in range(m):
            memcpy(y + <int64_t>r * c.ldy * it, c.b + <int64_t>c0 * it, <size_t>n * it)
    if c.f32:
        sgemm(&ta, &tn, &n, &m, &c.K, &one_f, <float *>w, &c.ldw, <float *>x, &c.ldx,
              &beta_f, <float *>y, &c.ldy)
    else:
        dgemm(&ta, &tn, &n, &m, &c.K, &one_d, <double *>w, &c.ldw, <double *>x, &c.ldx,
              &beta_d, <double *>y, &c.ldy)


ctypedef struct pack_ctx:
    const float *w
    float *wp
    int64_t n, k, ldw
    int64_t npanels, per_task
    int simd
    int trans   # w is given as its transpose (k x n): packed by copies


cdef void _pack_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef pack_ctx *p = <pack_ctx *>vctx
    cdef int64_t p0 = t * p.per_task
    cdef int64_t p1 = p0 + p.per_task
    if p1 > p.npanels:
        p1 = p.npanels
    if p0 < p1 and p.trans:
        fa_proj_pack_t_panels_f32(p0, p1, p.n, p.k, p.w, p.ldw, p.wp)
    elif p0 < p1:
        fa_proj_pack_panels_f32(p0, p1, p.n, p.k, p.w, p.ldw, p.wp, p.simd)


_tls = threading.local()


def _pack_buffer(int64_t n):
    """This thread's scratch for weights packed by ``linear`` (grow-only, at
    most ``pack_max_elems`` floats): reused by every later call, so a call
    neither allocates nor touches new pages."""
    buf = getattr(_tls, "buf", None)
    if buf is None or cnp.PyArray_DIMS(<cnp.ndarray>buf)[0] < n:
        buf = cnp.PyArray_EMPTY(1, [n], cnp.NPY_FLOAT32, 0)
        _tls.buf = buf
    return buf


def release_pack_buffer():
    """Free this thread's packing scratch (``linear`` makes it again when needed)."""
    _tls.buf = None


def packs_transposed(int64_t M, int64_t N, int64_t K):
    """True when :func:`linear` can take ``w_transposed=True`` for a product of
    ``M`` rows into ``N`` columns over ``K`` (the packed kernel is active, the
    packed weights fit the scratch limit ``pack_max_elems``, and the product
    is large enough for packing to pay: ``pack_min_rows`` rows)."""
    return (M >= g_pack_min_rows and g_pack_min_rows > 0 and N > 0 and K > 0
            and fa_proj_packed_size(N, K) <= g_pack_max_elems
            and runtime_simd(&g_rt) and fa_proj_packed_available() != 0)


def linear(cnp.ndarray x, cnp.ndarray w, object b, cnp.ndarray y, int n_threads,
           object wp=None, bint w_transposed=False, int64_t runs=0, bint x_transposed=False,
           object colsum=None):
    """``y[i] = x[i] @ w.T + b`` for every batch item ``i``, on up to ``n_threads`` threads.

    ``wp`` (float32 only): ``w``'s packed form (:func:`pack_f32`, or a slice of
    a larger weight's from a row that is a multiple of 16); when given and the
    packed kernel is active (:func:`packed_kernel_active`), blocks of up to
    ``packed_m`` rows read it instead of ``w`` -- same blocking, same threads.
    The caller keeps ``wp`` equal to ``w``'s packed form.
    ``w_transposed`` (float32, no ``wp``): ``w`` is given as its transpose
    ``(K, N)`` -- ``y = x @ w`` --, packed for this call by copies
    (csrc/fa_proj.h's fa_proj_pack_t_panels_f32) and read by the packed
    kernel; the caller checks :func:`packs_transposed` first (ValueError
    otherwise).  ``runs`` > 0 (with ``w_transposed`` only): the reduction in
    runs of that many terms, each summed from zero and added to ``y`` in
    order (csrc/fa_proj.h's fa_proj_packed_runs_f32: the bits of one call a
    run, the results added in run order).  ``x_transposed`` (with
    ``w_transposed`` and ``runs`` in 1..1024, one batch item): ``x`` is given
    as its transpose ``(1, K, M)`` -- ``y = x[0].T @ w`` -- its last axis
    contiguous; each block of rows and run is transposed into scratch inside
    the call (fa_proj_packed_xt_runs_f32: the floats of the same call on a
    transposed copy).  ``colsum`` (with ``x_transposed`` only): a 1-D
    C-contiguous float64 array of M elements that the column sums of
    ``x[0].T``'s rows are added to (each over the K terms in order, in
    float64; whatever ``n_threads``), read from each block while it is
    transposed.  Without ``wp``, a
    float32 product of at least ``pack_min_rows`` rows (all batch items) whose
    packed ``w`` fits ``pack_max_elems`` packs ``w`` itself first (on the same
    threads, into this thread's scratch, :func:`release_pack_buffer`) and
    takes the packed kernel: measured 0.83-0.97x the time from 64 rows on
    (K = 512, N = 512 and 1536, 2 threads; 1.16x at 32 rows).

    x: (nb, M, K), w: (N, K), b: (N,) or None, y: (nb, M, N); one float dtype
    (float32 or float64); last axes contiguous, row strides positive and at
    least a row long (a single row may have any stride), batch strides
    anything; y does not overlap x, w or b; nb * M, N, K and the strides
    within the BLAS 32-bit range.  Returns the number of blocks (0 when
    nothing was multiplied).  From the main thread, KeyboardInterrupt stops
    the call between blocks and is raised here (``y`` is then partly written).

    Empty sizes: nothing to write when nb, M or N is 0; when K is 0 the product
    is a sum of no terms, so ``y`` is set to ``b`` (zeros without a bias)
    before any kernel runs (the few-row kernel refuses K = 0 and BLAS would be
    handed a leading dimension of 0).  A non-zero status from the few-row
    kernel raises RuntimeError (it means the checks above missed a case).
    """
    cdef lin_ctx c
    cdef int wn = 1 if w_transposed else 0   # the axis of w that is N
    cdef int xm = 2 if x_transposed else 1   # the axis of x that is M (the other is K)
    if x_transposed and (not w_transposed or cnp.PyArray_DIMS(x)[0] != 1 or runs < 1
                         or runs > FA_PROJ_XT_MAX_RUNS):
        raise ValueError("fastattn._proj.linear: x_transposed needs w_transposed, one batch "
                         f"item and runs in 1..{FA_PROJ_XT_MAX_RUNS}")
    if cnp.PyArray_DIMS(x)[0] == 0 or cnp.PyArray_DIMS(x)[xm] == 0 or cnp.PyArray_DIMS(w)[wn] == 0:
        return 0
    if cnp.PyArray_DIMS(x)[3 - xm] == 0:
        if b is None:
            y[...] = 0
        else:
            y[...] = b
        return 0
    cdef int nb = <int>cnp.PyArray_DIMS(x)[0]
    cdef int M = <int>cnp.PyArray_DIMS(x)[xm]
    cdef int64_t item = cnp.PyArray_ITEMSIZE(x)
    cdef int64_t xbs = cnp.PyArray_STRIDES(x)[0] // item
    cdef int64_t ybs = cnp.PyArray_STRIDES(y)[0] // item
    cdef int64_t ntasks, target
    cdef int nt = n_threads if n_threads > 0 else 1
    cdef void *hook = NULL
    c.f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    c.item = item
    c.K = <int>cnp.PyArray_DIMS(x)[3 - xm]
    c.N = <int>cnp.PyArray_DIMS(w)[wn]
    c.xt = x_transposed
    c.csum = NULL
    if colsum is not None:
        if (not x_transposed or cnp.PyArray_TYPE(<cnp.ndarray>colsum) != cnp.NPY_FLOAT64
                or cnp.PyArray_NDIM(<cnp.ndarray>colsum) != 1
                or cnp.PyArray_DIMS(<cnp.ndarray>colsum)[0] != M
                or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>colsum)):
            raise ValueError("fastattn._proj.linear: colsum needs x_transposed and a 1-D "
                             f"C-contiguous float64 array of {M} elements")
        c.csum = <double *>cnp.PyArray_DATA(<cnp.ndarray>colsum)
    c.ldx = <int>_rows_ld(x, M if x_transposed else c.K)   # xt: the (K, M) array's row stride
    c.ldw = <int>_rows_ld(w, c.N if w_transposed else c.K)
    c.ldy = <int>_rows_ld(y, c.N)
    c.x = <char *>cnp.PyArray_DATA(x)
    c.w = <char *>cnp.PyArray_DATA(w)
    c.y = <char *>cnp.PyArray_DATA(y)
    c.b = NULL if b is None else <char *>cnp.PyArray_DATA(<cnp.ndarray>b)
    # the batch items as one run of equally spaced rows: one matrix of nb * M rows
    if nb == 1:
        c.M = M
    elif M == 1 and 0 < xbs < 2147483647 and 0 < ybs < 2147483647 and xbs >= c.K and ybs >= c.N:
        c.ldx = <int>xbs
        c.ldy = <int>ybs
        c.M = nb
        nb = 1
    elif xbs == <int64_t>M * c.ldx and ybs == <int64_t>M * c.ldy:
        c.M = nb * M
        nb = 1
    else:
        c.M = M
    c.xbs = xbs
    c.ybs = ybs
    if g_rt.pool_run == NULL or (2.0 * nb * c.M * c.N * c.K < PARALLEL_MIN_FLOPS
                              and <int64_t>c.N * c.K < PARALLEL_MIN_WEIGHTS):
        nt = 1
    target = <int64_t>g_blocks_per_thread * nt if nt > 1 else 1
    c.mb, c.nbm, c.cb, c.nbc = c.M, 1, c.N, 1
    if target > nb:
        target = (target + nb - 1) // nb   # blocks per batch item
        if c.M >= g_min_block_rows * target:
            c.mb = (c.M + <int>target - 1) // <int>target
            c.mb = (c.mb + 7) // 8 * 8
            c.nbm = (c.M + c.mb - 1) // c.mb
        else:
            c.nbc = <int>target
            if c.nbc > c.N // g_min_block_cols:
                c.nbc = c.N // g_min_block_cols
            if c.nbc < 1:
                c.nbc = 1
            c.cb = (c.N + c.nbc - 1) // c.nbc
            c.cb = (c.cb + 15) // 16 * 16
            c.nbc = (c.N + c.cb - 1) // c.cb
    while 2.0 * c.mb * c.cb * c.K > MAX_BLOCK_FLOPS:
        if c.mb > 2 * g_min_block_rows:
            c.mb = ((c.mb + 1) // 2 + 7) // 8 * 8
        elif c.cb > 2 * g_min_block_cols:
            c.cb = ((c.cb + 1) // 2 + 15) // 16 * 16
        else:
            break
    if w_transposed:
        # row blocks fixed by the shapes (the packed kernel's row grouping, and
        # so its summation order, follows a block's row count): the same bits
        # for any n_threads, as linear_backward promises; FA_PROJ_PACKED_MC
        # rows, the kernel's own cache blocking
        c.mb = c.M if c.M < FA_PROJ_PACKED_MC else FA_PROJ_PACKED_MC
        # too few row blocks for the threads (dW's few hundred output rows):
        # split the columns too -- panels are independent, so bits do not move
        if nt > 1 and <int64_t>nb * ((c.M + c.mb - 1) // c.mb) < 2 * target:
            c.nbc = <int>((2 * target + nb * ((c.M + c.mb - 1) // c.mb) - 1)
                          // (nb * ((c.M + c.mb - 1) // c.mb)))
            if c.nbc > c.N // g_min_block_cols:
                c.nbc = c.N // g_min_block_cols
            if c.nbc < 1:
                c.nbc = 1
            c.cb = (c.N + c.nbc - 1) // c.nbc
            c.cb = (c.cb + 15) // 16 * 16
    c.nbm = (c.M + c.mb - 1) // c.mb
    c.nbc = (c.N + c.cb - 1) // c.cb
    ntasks = <int64_t>nb * c.nbm * c.nbc
    cdef pack_ctx pk
    cdef int64_t pk_tasks = 0
    cdef int64_t psize = fa_proj_packed_size(c.N, c.K)
    if w_transposed and (wp is not None or not c.f32 or not packs_transposed(nb * c.M, c.N, c.K)
                         or c.mb > g_packed_m):
        raise ValueError("fastattn._proj.linear: w_transposed needs a float32 product that "
                         "packs_transposed accepts, and no wp")
    if runs < 0 or (runs > 0 and not w_transposed):
        raise ValueError(f"fastattn._proj.linear: runs must be 0, or > 0 with w_transposed; "
                         f"got {runs}")
    c.runs = runs
    pk.trans = w_transposed
    if (wp is None and c.f32 and g_pack_min_rows > 0 and <int64_t>nb * c.M >= g_pack_min_rows
            and psize <= g_pack_max_elems and runtime_simd(&g_rt)
            and fa_proj_packed_available() != 0):
        wp = _pack_buffer(psize)
        pk.w = <const float *>c.w
        pk.wp = <float *>cnp.PyArray_DATA(<cnp.ndarray>wp)
        pk.n = c.N
        pk.k = c.K
        pk.ldw = c.ldw
        pk.npanels = (c.N + 15) // 16
        pk.simd = 1
        pk_tasks = 4 * nt if nt > 1 else 1
        if pk_tasks > pk.npanels:
            pk_tasks = pk.npanels
        pk.per_task = (pk.npanels + pk_tasks - 1) // pk_tasks
        pk_tasks = (pk.npanels + pk.per_task - 1) // pk.per_task
    c.wp = NULL if wp is None else <char *>cnp.PyArray_DATA(<cnp.ndarray>wp)
    c.packed = (c.f32 and c.wp != NULL and c.mb <= g_packed_m and runtime_simd(&g_rt)
                and fa_proj_packed_available() != 0)
    c.small = (not c.packed and c.f32 and c.mb <= g_small_m and runtime_simd(&g_rt)
               and fa_proj_small_available() != 0)
    c.wide = runtime_level(&g_rt) >= 2
    c.status = 0
    cdef int64_t t
    cdef interrupt_state intr
    cdef stop_fn stop = interrupt_arm(&intr, _main_ident)
    with nogil:
        hook = runtime_hold(&g_rt)
        if pk_tasks > 0:  # packing w for this call (a few ms at most: no stop callback)
            if nt > 1:
                runtime_run(&g_rt, pk_tasks, nt, _pack_task, &pk, NULL, NULL)
            else:
                for t in range(pk_tasks):
                    _pack_task(&pk, t, 0)
        if nt > 1 or stop != NULL:  # the pool, when there is one and more than one block
            runtime_run(&g_rt, ntasks, nt, _task, &c, stop, &intr)
        else:
            for t in range(ntasks):
                _task(&c, t, 0)
        runtime_release(&g_rt, hook)
    interrupt_raise(&intr)
    if c.status == FA_PROJ_ENOMEM:
        raise MemoryError("fastattn._proj: could not allocate the packed kernel's scratch")
    if c.status != 0:
        raise RuntimeError(f"fastattn._proj: the {'packed' if c.packed else 'few-row'} kernel "
                           f"rejected its arguments "
                           f"(status {c.status}; M={c.M}, N={c.N}, K={c.K})")
    return ntasks


# ------------------------------------------------------------------ matmul
# The backward's products (fastattn._linear.linear_backward): ``C = op(A) op(B)``
# with op a transpose or not, cut into tiles whose sizes depend on the shapes
# only -- never on the thread count -- each tile one single-threaded gemm over
# the whole reduction (BLAS held at one thread, as in linear()).  Every element
# of C is then computed by the same gemm call (same sizes, same leading
# dimensions, same summation order) whichever thread runs it and however many
# there are: the same bits for any n_threads.  Tiles of mm_tile x mm_tile
# (set_tuning; 256: on this machine under load from other processes, 256 was
# faster than 128 in most of a few timings at 4096-8192 rows, K, N 512-2048),
# halved towards MM_MIN_TILE while one exceeds MAX_BLOCK_FLOPS, so the stop
# callback is asked often enough; a product below PARALLEL_MIN_FLOPS is one tile.


ctypedef struct mm_ctx:
    int f32
    char *a
    char *b
    char *c
    int lda, ldb, ldc
    int M, N, R
    int ta, tb
    int tm, tn, ntn
    int64_t item
    int kc                    # float32: the reduction in chunks of kc (0: one gemm)
    float *tmp                # kc: per slot, tm * tn floats (a chunk's product)
    double *acc               # kc: per slot, tm * tn doubles (the chunks' sum)
    int kpart                 # split reduction: task t is rows [t * kpart, ...) of it, the
    char *part                # whole (M, N) result into part + t * M * N (0 / NULL: no split)


cdef void _mm_chunked(mm_ctx *p, char *a, char *b, float *c, int m, int n, int slot) noexcept nogil:
    """One float32 tile over the reduction in chunks of kc: each chunk one gemm
    into this slot's float32 buffer, the chunks summed in float64 in order, the
    sum rounded once into c.  The same bits whichever thread runs it."""
    cdef char tra = b'T' if p.tb else b'N'
    cdef char trb = b'T' if p.ta else b'N'
    cdef float one_f = 1, zero_f = 0
    cdef int64_t per = <int64_t>p.tm * p.tn
    cdef float *tmp = p.tmp + slot * per
    cdef double *acc = p.acc + slot * per
    cdef int64_t i, mn = <int64_t>m * n, r, j
    cdef int k0 = 0, kk, ldt = n
    cdef float *ak
    cdef float *bk
    while k0 < p.R:
        kk = p.kc if p.kc < p.R - k0 else p.R - k0
        # the reduction index: rows of A (transposed) or its columns; columns of
        # B (transposed) or its rows
        ak = <float *>a + (<int64_t>k0 * p.lda if p.ta else <int64_t>k0)
        bk = <float *>b + (<int64_t>k0 if p.tb else <int64_t>k0 * p.ldb)
        sgemm(&tra, &trb, &n, &m, &kk, &one_f, bk, &p.ldb, ak, &p.lda, &zero_f, tmp, &ldt)
        if k0 == 0:
            for i in range(mn):
                acc[i] = tmp[i]
        else:
            for i in range(mn):
                acc[i] += tmp[i]
        k0 += kk
    for r in range(m):
        for j in range(n):
            c[r * p.ldc + j] = <float>acc[r * n + j]


cdef void _mm_part_task(void *vctx, int64_t t, int slot) noexcept nogil:
    """Split reduction: part t of the reduction over the whole result."""
    cdef mm_ctx *p = <mm_ctx *>vctx
    cdef int k0 = <int>t * p.kpart
    cdef int kk = p.R - k0
    cdef char tra = b'T' if p.tb else b'N'
    cdef char trb = b'T' if p.ta else b'N'
    cdef float one_f = 1, zero_f = 0
    cdef double one_d = 1, zero_d = 0
    cdef int ldt = p.N
    if kk > p.kpart:
        kk = p.kpart
    if kk <= 0:
        return
    cdef int64_t it = p.item
    cdef char *a = p.a + (<int64_t>k0 * p.lda if p.ta else <int64_t>k0) * it
    cdef char *b = p.b + (<int64_t>k0 if p.tb else <int64_t>k0 * p.ldb) * it
    cdef char *c = p.part + t * p.M * p.N * it
    if p.f32:
        sgemm(&tra, &trb, &p.N, &p.M, &kk, &one_f, <float *>b, &p.ldb, <float *>a, &p.lda,
              &zero_f, <float *>c, &ldt)
    else:
        dgemm(&tra, &trb, &p.N, &p.M, &kk, &one_d, <double *>b, &p.ldb, <double *>a, &p.lda,
              &zero_d, <double *>c, &ldt)


cdef void _mm_sum_parts(mm_ctx *p, int64_t nparts) noexcept nogil:
    """c = the parts' sum, added in part order (the same bits for any thread count)."""
    cdef int64_t r, j, q, mn = <int64_t>p.M * p.N
    cdef float *cf
    cdef const float *pf
    cdef double *cd
    cdef const double *pd
    for r in range(p.M):
        if p.f32:
            cf = <float *>p.c + r * p.ldc
            pf = <const float *>p.part + r * p.N
            for j in range(p.N):
                cf[j] = pf[j]
            for q in range(1, nparts):
                for j in range(p.N):
                    cf[j] += pf[q * mn + j]
        else:
            cd = <double *>p.c + r * p.ldc
            pd = <const double *>p.part + r * p.N
            for j in range(p.N):
                cd[j] = pd[j]
            for q in range(1, nparts):
                for j in range(p.N):
                    cd[j] += pd[q * mn + j]


def matmul_kpart(int64_t M, int64_t N, int64_t R, int64_t kc=0):
    """The reduction's part size for :func:`matmul` (0: not split), a function of
    the shapes only.  A long reduction into a small result (R >= 2 max(M, N),
    M N <= MM_KSPLIT_ELEMS, no ``kc``) is cut into parts of at least 256 rows
    -- MM_MIN_TILES of them, or more to keep each under MAX_BLOCK_FLOPS -- each
    part one gemm over the whole result, the parts then summed in order: a
    768 x 256 result over 2048 rows as tiles packed its 2048-row operand once
    per tile, ~25% slower than one gemm on one thread."""
    cdef int64_t nk, kp
    if (not g_mm_ksplit or kc > 0 or 2.0 * M * N * R < PARALLEL_MIN_FLOPS or M * N > MM_KSPLIT_ELEMS
            or R < 2 * (M if M > N else N) or R < 2 * MM_KPART_MIN):
        return 0
    nk = MM_MIN_TILES
    while 2.0 * M * N * ((R + nk - 1) // nk) > MAX_BLOCK_FLOPS:
        nk *= 2
    kp = (R + nk - 1) // nk
    if kp < MM_KPART_MIN:
        kp = MM_KPART_MIN
    kp = (kp + 63) // 64 * 64
    return kp if kp < R else 0


cdef void _mm_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef mm_ctx *p = <mm_ctx *>vctx
    cdef int rb = <int>(t // p.ntn)
    cdef int cb = <int>(t - <int64_t>rb * p.ntn)
    cdef int r0 = rb * p.tm
    cdef int c0 = cb * p.tn
    cdef int m = p.M - r0
    cdef int n = p.N - c0
    cdef char tra = b'T' if p.tb else b'N'   # column-major: C^T = op(B)^T op(A)^T
    cdef char trb = b'T' if p.ta else b'N'
    cdef float one_f = 1, zero_f = 0
    cdef double one_d = 1, zero_d = 0
    if m > p.tm:
        m = p.tm
    if n > p.tn:
        n = p.tn
    if m <= 0 or n <= 0:
        return
    cdef int64_t it = p.item
    # rows r0.. of op(A): rows of A, or columns of A when transposed; columns
    # c0.. of op(B): columns of B, or rows of B when transposed
    cdef char *a = p.a + (<int64_t>r0 if p.ta else <int64_t>r0 * p.lda) * it
    cdef char *b = p.b + (<int64_t>c0 * p.ldb if p.tb else <int64_t>c0) * it
    cdef char *c = p.c + (<int64_t>r0 * p.ldc + c0) * it
    if p.f32 and p.kc > 0 and p.kc < p.R:
        _mm_chunked(p, a, b, <float *>c, m, n, slot)
    elif p.f32:
        sgemm(&tra, &trb, &n, &m, &p.R, &one_f, <float *>b, &p.ldb, <float *>a, &p.lda,
              &zero_f, <float *>c, &p.ldc)
    else:
        dgemm(&tra, &trb, &n, &m, &p.R, &one_d, <double *>b, &p.ldb, <double *>a, &p.lda,
              &zero_d, <double *>c, &p.ldc)


def matmul_tiles(int64_t M, int64_t N, int64_t R, int64_t kc=0):
    """The tile size ``(tm, tn)`` :func:`matmul` cuts an (M, N) result with a
    reduction of R into: a function of the shapes (and of ``kc``) only.

    Tiles of mm_tile, halved while one exceeds MAX_BLOCK_FLOPS, then while the
    result has fewer than MM_MIN_TILES tiles (a 768 x 256 result in three
    256 x 256 tiles left one of two cores idle a third of the time); with a
    chunked reduction (``kc`` > 0) halved to at most MM_KC_TILE elements, so a
    tile's float32 and float64 sums stay in L2 with the gemm's packed chunks.
    """
    cdef int64_t tm = M if M < g_mm_tile else g_mm_tile
    cdef int64_t tn = N if N < g_mm_tile else g_mm_tile
    if 2.0 * M * N * R < PARALLEL_MIN_FLOPS:
        return (max(M, 1), max(N, 1))
    while 2.0 * tm * tn * R > MAX_BLOCK_FLOPS and (tm > MM_MIN_TILE or tn > MM_MIN_TILE):
        if tm >= tn:
            tm = (tm + 1) // 2
        else:
            tn = (tn + 1) // 2
    while (((M + tm - 1) // tm) * ((N + tn - 1) // tn) < MM_MIN_TILES
           and (tm >= 2 * MM_MIN_TILE or tn >= 2 * MM_MIN_TILE)):
        if tm >= tn:
            tm = (tm + 1) // 2
        else:
            tn = (tn + 1) // 2
    while kc > 0 and tm * tn > MM_KC_TILE and (tm >= 2 * MM_MIN_TILE or tn >= 2 * MM_MIN_TILE):
        if tm >= tn:
            tm = (tm + 1) // 2
        else:
            tn = (tn + 1) // 2
    return (max(tm, 1), max(tn, 1))


def matmul(cnp.ndarray a, bint trans_a, cnp.ndarray b, bint trans_b, cnp.ndarray c,
           int n_threads, int kc=0):
    """``c = op(a) @ op(b)`` (op: ``.T`` when ``trans_*``), on up to ``n_threads`` threads,
    with the same bits for any thread count (tiles of :func:`matmul_tiles`).

    a: (M, R), or (R, M) when trans_a; b: (R, N), or (N, R) when trans_b;
    c: (M, N).  2-D, one float dtype (float32 or float64), last axes
    contiguous, row strides positive and at least a row long (a single row may
    have any), sizes and strides within the BLAS 32-bit range; c does not
    overlap a or b.  R = 0 sets c to zeros.  Returns the number of tiles (0 when
    nothing was multiplied).  From the main thread, KeyboardInterrupt stops the
    call between tiles and is raised here (``c`` is then partly written).

    ``kc`` > 0 (float32 only; ignored for float64): each tile's reduction runs
    in chunks of ``kc``, each one gemm, summed in float64 in order and rounded
    once -- float32 rounding over runs of at most ``kc`` terms instead of the
    whole reduction (a long sum such as a weight gradient over every step of a
    sequence).
    """
    cdef mm_ctx p
    cdef int64_t M = cnp.PyArray_DIMS(c)[0]
    cdef int64_t N = cnp.PyArray_DIMS(c)[1]
    cdef int64_t R = cnp.PyArray_DIMS(a)[0 if trans_a else 1]
    if (cnp.PyArray_DIMS(a)[1 if trans_a else 0] != M
            or cnp.PyArray_DIMS(b)[1 if trans_b else 0] != R
            or cnp.PyArray_DIMS(b)[0 if trans_b else 1] != N
            or cnp.PyArray_TYPE(a) != cnp.PyArray_TYPE(c)
            or cnp.PyArray_TYPE(b) != cnp.PyArray_TYPE(c)):
        raise ValueError("fastattn._proj.matmul: operands do not match")  # a caller's bug
    if M == 0 or N == 0:
        return 0
    if R == 0:
        c[...] = 0
        return 0
    p.f32 = cnp.PyArray_TYPE(c) == cnp.NPY_FLOAT32
    p.kc = kc if (p.f32 and 0 < kc < R) else 0
    tm, tn = matmul_tiles(M, N, R, p.kc)
    p.item = cnp.PyArray_ITEMSIZE(c)
    p.a = <char *>cnp.PyArray_DATA(a)
    p.b = <char *>cnp.PyArray_DATA(b)
    p.c = <char *>cnp.PyArray_DATA(c)
    p.lda = <int>_rows_ld(a, cnp.PyArray_DIMS(a)[1])
    p.ldb = <int>_rows_ld(b, cnp.PyArray_DIMS(b)[1])
    p.ldc = <int>_rows_ld(c, N)
    p.M, p.N, p.R = <int>M, <int>N, <int>R
    p.ta, p.tb = trans_a, trans_b
    p.tm, p.tn = <int>tm, <int>tn
    p.ntn = <int>((N + tn - 1) // tn)
    cdef int64_t ntasks = ((M + tm - 1) // tm) * p.ntn
    cdef int nt = n_threads if n_threads > 0 else 1
    if g_rt.pool_run == NULL:
        nt = 1
    cdef cnp.ndarray tmp = None, acc = None, part = None
    p.tmp = NULL
    p.acc = NULL
    p.kpart = <int>matmul_kpart(M, N, R, p.kc)
    p.part = NULL
    cdef task_fn task = _mm_task
    if p.kpart:
        ntasks = (R + p.kpart - 1) // p.kpart
        part = cnp.PyArray_EMPTY(1, [ntasks * M * N], cnp.PyArray_TYPE(c), 0)
        p.part = <char *>cnp.PyArray_DATA(part)
        task = _mm_part_task
    if p.kc:  # one float32 and one float64 tile per slot (slots < nt)
        tmp = cnp.PyArray_EMPTY(1, [nt * tm * tn], cnp.NPY_FLOAT32, 0)
        acc = cnp.PyArray_EMPTY(1, [nt * tm * tn], cnp.NPY_FLOAT64, 0)
        p.tmp = <float *>cnp.PyArray_DATA(tmp)
        p.acc = <double *>cnp.PyArray_DATA(acc)
    cdef int64_t t
    cdef void *hook = NULL
    cdef interrupt_state intr
    cdef stop_fn stop = interrupt_arm(&intr, _main_ident)
    with nogil:
        hook = runtime_hold(&g_rt)
        if (nt > 1 or stop != NULL) and ntasks > 1:
            runtime_run(&g_rt, ntasks, nt, task, &p, stop, &intr)
        else:
            for t in range(ntasks):
                task(&p, t, 0)
        runtime_release(&g_rt, hook)
        if p.kpart:
            _mm_sum_parts(&p, ntasks)
    interrupt_raise(&intr)
    return ntasks
