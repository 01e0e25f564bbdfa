# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Recurrence kernel of the RNN layers: csrc/fa_rnn.c over canonical buffers.

Canonical buffers in, preallocated outputs, GIL released, no user-facing
checks: ``fastattn._rnn_api`` (``functional.rnn_scan``) validates and
canonicalises every argument before it calls here.

Threads: batch rows are independent through the whole sequence, so the rows
are cut into blocks that fastattn's worker pool (``fastattn._kernels``) hands
out one at a time; each block runs all T steps on one thread with no
synchronisation between steps.  BLAS (the float64 and large-block float32
products) is held at one thread meanwhile through the attention kernel's
save/restore counter.  The pool, that counter and the SIMD switch are handed
over once by address (:func:`set_runtime`), as for ``fastattn._proj``.

KeyboardInterrupt: from the main thread, a long scan runs its time steps in
chunks of about ``chunk_flops`` (see :func:`set_tuning`), one pool call per
chunk, and asks the stop callback (fastattn/_interrupt.pxd) between chunks;
chunking changes no arithmetic (each row still goes through the same steps
in order), only where the threads meet.
"""
import os
import threading

cimport numpy as cnp
from libc.stdint cimport int64_t, uintptr_t
from libc.string cimport memcpy

from fastattn._interrupt cimport (interrupt_arm, interrupt_raise, interrupt_state, interrupt_stop,
                                  thread_ident)
from fastattn._runtime cimport (fa_store_status, runtime, runtime_hold, runtime_release,
                                runtime_level, runtime_run, runtime_set, runtime_simd)
from scipy.linalg.cython_blas cimport sgemm, dgemm

cnp.import_array()

cdef extern from "fa_rnn.h" nogil:
    ctypedef void (*fa_sgemm_fn)(char *, char *, int *, int *, int *, float *, float *, int *,
                                 float *, int *, float *, float *, int *)
    ctypedef void (*fa_dgemm_fn)(char *, char *, int *, int *, int *, double *, double *, int *,
                                 double *, int *, double *, double *, int *)
    ctypedef struct fa_rnn_args:
        int cell
        int simd
        int64_t B, T, H
        const void *xw
        int64_t xw_bs, xw_ts
        const void *whh
        int64_t ldw
        const void *bhh
        void *h
        void *c
        void *out
        int64_t out_bs, out_ts
        const int64_t *lengths
        int reverse
        void *gates
        int64_t gates_bs, gates_ts
        int64_t small_m
        fa_sgemm_fn sgemm
        fa_dgemm_fn dgemm
        const float *wpack
    ctypedef struct fa_cell_args:
        int cell
        int simd
        int64_t B, H, nin
        const void *x
        int64_t ldx
        const void *wih
        int64_t ldwi
        const void *bih
        const void *whh
        int64_t ldwh
        const void *bhh
        const void *h0
        const void *c0
        void *h1
        void *c1
        int64_t small_m
        fa_sgemm_fn sgemm
        fa_dgemm_fn dgemm
    int fa_rnn_cell_f32(const fa_cell_args *a, int64_t u0, int64_t u1, float *scratch)
    int fa_rnn_cell_f64(const fa_cell_args *a, int64_t u0, int64_t u1, double *scratch)
    ctypedef struct fa_rnn_split:
        int64_t nb, units
        unsigned char *claimed
        int *done
        void *hbuf
    int fa_rnn_split_f32(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, float *scratch)
    int fa_rnn_split_f64(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, double *scratch)
    int fa_rnn_gates(int cell)
    int fa_rnn_f32(const fa_rnn_args *a, int64_t b0, int64_t b1, float *scratch)
    int fa_rnn_f64(const fa_rnn_args *a, int64_t b0, int64_t b1, double *scratch)
    ctypedef struct fa_rnn_bwd_args:
        int cell
        int simd
        int64_t B, T, H
        const void *xw
        int64_t xw_bs, xw_ts
        const void *gh
        const void *bhh
        const void *hprev
        const void *c0
        const void *go
        int64_t go_bs, go_ts
        const void *whh
        int64_t ldw
        const float *wpack
        const int64_t *lengths
        int reverse
        void *dxw
        void *dgh
        void *dh
        void *dc
        double *db
        fa_sgemm_fn sgemm
        fa_dgemm_fn dgemm
    int64_t fa_rnn_bwd_scratch(int cell, int64_t rows, int64_t T, int64_t H)
    int fa_rnn_bwd_cstate_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, float *scratch)
    int fa_rnn_bwd_cstate_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, double *scratch)
    int fa_rnn_bwd_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                       float *scratch)
    int fa_rnn_bwd_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                       double *scratch)

cdef extern from "fa_proj.h" nogil:
    int fa_proj_small_available()
    int fa_proj_packed_available()
    int64_t fa_proj_packed_size(int64_t n, int64_t k)
    void fa_proj_pack_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                                 const float *w, int64_t ldw, float *wp, int simd)
    void fa_proj_pack_t_panels_f32(int64_t p_begin, int64_t p_end, int64_t n, int64_t k,
                                   const float *bt, int64_t ldb, float *wp)

# this module's copy of fastattn._kernels' pool, BLAS hold and SIMD switch
# (fastattn/_runtime.pxd): a C static, so all NULL until set_runtime
cdef runtime g_rt

# signal handlers run on the main thread only (as in fastattn._kernels)
cdef unsigned long _main_ident = threading.main_thread().ident


def _after_fork_in_child():
    global _main_ident
    _main_ident = thread_ident()


os.register_at_fork(after_in_child=_after_fork_in_child)

CELLS = {"rnn_tanh": 0, "rnn_relu": 1, "gru": 2, "lstm": 3}

# Blocking, measured on the 2-core AVX2 machine (GRU, H = 256): a block of at
# least MIN_BLOCK_ROWS rows per task; two blocks a thread when there are
# enough rows (a thread that the OS deschedules then holds up at most half of
# its share); float32 blocks of at most SMALL_M rows use the few-row kernel of
# csrc/fa_proj.c (W_hh read in place) instead of sgemm.
cdef int g_min_block_rows = 4
cdef int g_blocks_per_thread = 2
cdef int g_small_m = 128
# Fewer rows than n_threads * min_block_rows: split the units of each step
# instead (fa_rnn_split_*), when the units make blocks of at least
# SPLIT_MIN_UNITS and a step is worth SPLIT_MIN_FLOPS.
cdef int g_split = 1
# float32 row blocks (AVX2): W_hh packed once per scan for fa_proj.c's packed
# kernel rather than read in place by its few-row kernel at every step
cdef int g_packed = 1
cdef int g_split_min_units = 32
DEF SPLIT_MIN_FLOPS = 100000.0
# Below this many flops per step and row block a call stays on the calling thread.
DEF PARALLEL_MIN_FLOPS = 200000.0
# One step (cell): blocks of hidden units, at least CELL_MIN_UNITS each, two
# blocks a thread; below CELL_PARALLEL_MIN_FLOPS a step stays on the calling thread.
cdef int g_cell_min_units = 32
DEF CELL_PARALLEL_MIN_FLOPS = 400000.0
# Main-thread scans: steps per chunk such that a chunk is about this many
# flops of h W_hh^T (~5-10 ms), at least one step.
cdef double g_chunk_flops = 1e8
# Backward (scan_backward): the rows in at most bwd_blocks blocks of at least
# BWD_MIN_ROWS rows (two blocks of min_block_rows or more when B is smaller),
# fixed by the sizes alone (never by the thread count, so every thread count
# gives the same bits); below
# PARALLEL_MIN_FLOPS per step and block, one block.  Each block's product reads
# all of W_hh^T at every step: GRU B=32 H=256 T=64 float32 on 2 threads, 4
# blocks of 8 rows took 35.5 ms of CPU time against 31.2 for 2 blocks of 16
# (min of 40 interleaved runs, the machine loaded by other processes).
cdef int g_bwd_blocks = 4
DEF BWD_MIN_ROWS = 16
# dW_hh is not formed here: fastattn._recurrence computes it after the loop
# with one chunked product over all rows (measured faster than each block's
# gemms of ~32 rows into its own full (G*H, H) copy, which this kernel did first).


def set_runtime(uintptr_t pool_run, uintptr_t hold_enter, uintptr_t hold_exit,
                uintptr_t simd_active=0):
    """Install fastattn._kernels' pool, BLAS hold and SIMD switch (C addresses); 0s uninstall."""
    runtime_set(&g_rt, pool_run, hold_enter, hold_exit, simd_active)


def runtime_installed():
    return g_rt.pool_run != NULL


def simd_active():
    """True when the gates use the AVX2 code (fastattn's dispatch, FASTATTN_DISABLE_SIMD)."""
    return runtime_simd(&g_rt)


def set_tuning(min_block_rows=None, blocks_per_thread=None, small_m=None, split=None,
               chunk_flops=None, bwd_blocks=None, packed=None):
    """Change the blocking parameters (for tuning sweeps and tests); returns the previous ones."""
    global g_min_block_rows, g_blocks_per_thread, g_small_m, g_split, g_chunk_flops, g_bwd_blocks
    global g_packed
    prev = dict(min_block_rows=g_min_block_rows, blocks_per_thread=g_blocks_per_thread,
                small_m=g_small_m, split=bool(g_split), chunk_flops=g_chunk_flops,
                bwd_blocks=g_bwd_blocks, packed=bool(g_packed))
    if packed is not None:
        g_packed = 1 if packed else 0
    if bwd_blocks is not None:
        g_bwd_blocks = max(1, int(bwd_blocks))
    if chunk_flops is not None:
        g_chunk_flops = max(0.0, float(chunk_flops))
    if split is not None:
        g_split = 1 if split else 0
    if min_block_rows is not None:
        g_min_block_rows = max(1, int(min_block_rows))
    if blocks_per_thread is not None:
        g_blocks_per_thread = max(1, int(blocks_per_thread))
    if small_m is not None:
        g_small_m = max(0, int(small_m))
    return prev


cdef int _gates(int cell) except 0:
    """The cell's gate count G (ValueError for an unknown cell code)."""
    cdef int G = fa_rnn_gates(cell)
    if G == 0:
        raise ValueError(f"cell: unknown code {cell}")
    return G


cdef int _check_status(int status, str kernel, int64_t B, int64_t T, int64_t H, int64_t nin,
                       int cell) except -1:
    """Raise a kernel's non-zero status (the checks before the call missed a case);
    T or nin < 0: not part of that kernel's sizes."""
    if status == 0:
        return 0
    sizes = f"B={B}, " + (f"T={T}, " if T >= 0 else "") + f"H={H}, "
    if nin >= 0:
        sizes += f"I={nin}, "
    raise RuntimeError(f"fastattn._rnn: the {kernel} kernel rejected its arguments "
                       f"(status {status}; {sizes}cell={cell})")


ctypedef struct scan_ctx:
    fa_rnn_args a
    int f32
    int64_t rows           # rows per block
    char *scratch          # B * G * H elements; block i uses rows [i * rows, ...)
    int64_t gh             # G * H
    int status
    int split              # units split (fa_rnn_split_*) instead of rows
    fa_rnn_split sp
    int64_t per            # split: scratch elements per task


cdef void _task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef scan_ctx *c = <scan_ctx *>vctx
    cdef int64_t b0 = t * c.rows
    cdef int64_t b1 = b0 + c.rows
    cdef int rc
    if c.split:
        if c.f32:
            rc = fa_rnn_split_f32(&c.a, &c.sp, t, <float *>c.scratch + t * c.per)
        else:
            rc = fa_rnn_split_f64(&c.a, &c.sp, t, <double *>c.scratch + t * c.per)
        if rc != 0:
            fa_store_status(&c.status, rc)
        return
    if b1 > c.a.B:
        b1 = c.a.B
    if b0 >= b1:
        return
    if c.f32:
        rc = fa_rnn_f32(&c.a, b0, b1, <float *>c.scratch + b0 * c.gh)
    else:
        rc = fa_rnn_f64(&c.a, b0, b1, <double *>c.scratch + b0 * c.gh)
    if rc != 0:
        fa_store_status(&c.status, rc)


cdef inline void _chunk_args(scan_ctx *s, const char *xw_base, char *out_base, char *gates_base,
                             int64_t item, int64_t t0, int64_t tc, const int64_t *lens_all,
                             int64_t *lens_c) noexcept nogil:
    """Point s.a at steps [t0, t0 + tc): inputs, outputs and gates from step t0
    on, the lengths counted from t0 (a row is live at local step u when t0 + u
    < its length, in either direction)."""
    cdef int64_t r, l
    s.a.T = tc
    s.a.xw = xw_base + t0 * s.a.xw_ts * item
    if out_base != NULL:
        s.a.out = out_base + t0 * s.a.out_ts * item
    if gates_base != NULL:
        s.a.gates = gates_base + t0 * s.a.gates_ts * item
    if lens_all != NULL:
        for r in range(s.a.B):
            l = lens_all[r] - t0
            lens_c[r] = 0 if l < 0 else (tc if l > tc else l)
        s.a.lengths = lens_c


cdef cnp.ndarray _prepacked(object wp, int64_t size):
    """``wp`` checked as a packed W_hh of ``size`` floats (pack_recurrent's)."""
    if (not isinstance(wp, cnp.ndarray) or cnp.PyArray_TYPE(<cnp.ndarray>wp) != cnp.NPY_FLOAT32
            or cnp.PyArray_NDIM(<cnp.ndarray>wp) != 1 or cnp.PyArray_DIMS(<cnp.ndarray>wp)[0] != size
            or not cnp.PyArray_IS_C_CONTIGUOUS(<cnp.ndarray>wp)):
        raise ValueError(f"wpack: expected pack_recurrent's 1-d float32 array of {size} floats for "
                         f"these sizes, got {getattr(wp, 'dtype', type(wp).__name__)} "
                         f"{getattr(wp, 'shape', '')}")
    return <cnp.ndarray>wp


def pack_recurrent(cnp.ndarray whh, bint transposed):
    """W_hh (G*H, H) float32, rows contiguous, packed once for several
    :func:`scan` (``transposed`` False) or :func:`scan_backward` (True) calls
    with the same weights (a decoder stepping one step a call): the panels those
    calls would otherwise pack on every call, the same floats.  None where they
    do not pack (float64, no AVX2 / packed kernel, the forward's packing tuned
    off).  The copy is a snapshot: later writes to whh are not in it."""
    cdef int64_t GH = cnp.PyArray_DIMS(whh)[0]
    cdef int64_t H = cnp.PyArray_DIMS(whh)[1]
    cdef int64_t ldw
    cdef cnp.ndarray wp
    if (cnp.PyArray_TYPE(whh) != cnp.NPY_FLOAT32 or not runtime_level(&g_rt)
            or not fa_proj_packed_available() or (not transposed and not g_packed)
            or GH < 1 or H < 1):
        return None
    if cnp.PyArray_STRIDES(whh)[1] != 4:
        raise ValueError("whh: expected rows contiguous")
    ldw = H if GH <= 1 else cnp.PyArray_STRIDES(whh)[0] // 4
    if transposed:
        wp = cnp.PyArray_EMPTY(1, [fa_proj_packed_size(H, GH)], cnp.NPY_FLOAT32, 0)
        with nogil:
            fa_proj_pack_t_panels_f32(0, (H + 15) // 16, H, GH, <const float *>cnp.PyArray_DATA(whh),
                                      ldw, <float *>cnp.PyArray_DATA(wp))
    else:
        wp = cnp.PyArray_EMPTY(1, [fa_proj_packed_size(GH, H)], cnp.NPY_FLOAT32, 0)
        with nogil:
            fa_proj_pack_panels_f32(0, (GH + 15) // 16, GH, H, <const float *>cnp.PyArray_DATA(whh),
                                    ldw, <float *>cnp.PyArray_DATA(wp), 1)
    return wp


def scan(int cell, cnp.ndarray xw, cnp.ndarray whh, object bhh, cnp.ndarray h, object c,
         object out, object lengths, bint reverse, int n_threads, object gates=None,
         object wpack=None):
    """Run one layer and direction over all time steps.

    xw: (B, T, G*H) input projections (b_ih included), last axis contiguous,
    any batch / time strides; whh: (G*H, H) rows contiguous (row stride >= H);
    bhh: (G*H,) contiguous or None; h: (B, H) C-contiguous, the initial state,
    overwritten with the final one; c: the same for LSTM, else None; out:
    (B, T, H) with last axis contiguous, or None; lengths: (B,) int64
    contiguous with values in [0, T], or None; gates: (B, T, G*H) with last axis
    contiguous, receives h W_hh^T + b_hh of every real step, or None; wpack: None
    or :func:`pack_recurrent` ``(whh, False)`` made from this whh (used where the
    scan would pack W_hh itself, instead of packing it again).  One float dtype throughout;
    B, T, H >= 1; G*H, H, B within int.  Returns the number of row blocks,
    or minus the number of threads when the units were split instead.
    From the main thread, KeyboardInterrupt stops the scan between chunks of
    steps and is raised here (h, c and out are then partly updated).
    """
    cdef scan_ctx s
    cdef int64_t item = cnp.PyArray_ITEMSIZE(xw)
    cdef int64_t B = cnp.PyArray_DIMS(xw)[0]
    cdef int64_t T = cnp.PyArray_DIMS(xw)[1]
    cdef int64_t H = cnp.PyArray_DIMS(h)[1]
    cdef int G = _gates(cell)
    cdef int nt = n_threads if n_threads > 0 else 1
    cdef int64_t nblocks, t
    cdef void *hook = NULL
    cdef cnp.ndarray scratch
    s.f32 = cnp.PyArray_TYPE(xw) == cnp.NPY_FLOAT32
    s.a.cell = cell
    s.a.simd = runtime_level(&g_rt)
    s.a.B = B
    s.a.T = T
    s.a.H = H
    s.a.xw = cnp.PyArray_DATA(xw)
    s.a.xw_bs = cnp.PyArray_STRIDES(xw)[0] // item
    s.a.xw_ts = cnp.PyArray_STRIDES(xw)[1] // item
    s.a.whh = cnp.PyArray_DATA(whh)
    s.a.ldw = H if cnp.PyArray_DIMS(whh)[0] <= 1 else cnp.PyArray_STRIDES(whh)[0] // item
    s.a.bhh = NULL if bhh is None else cnp.PyArray_DATA(<cnp.ndarray>bhh)
    s.a.h = cnp.PyArray_DATA(h)
    s.a.c = NULL if c is None else cnp.PyArray_DATA(<cnp.ndarray>c)
    if out is None:
        s.a.out = NULL
        s.a.out_bs = 0
        s.a.out_ts = 0
    else:
        s.a.out = cnp.PyArray_DATA(<cnp.ndarray>out)
        s.a.out_bs = cnp.PyArray_STRIDES(<cnp.ndarray>out)[0] // item
        s.a.out_ts = cnp.PyArray_STRIDES(<cnp.ndarray>out)[1] // item
    if lengths is None:
        s.a.lengths = NULL
    else:
        s.a.lengths = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>lengths)
    s.a.reverse = reverse
    if gates is None:
        s.a.gates = NULL
        s.a.gates_bs = 0
        s.a.gates_ts = 0
    else:
        s.a.gates = cnp.PyArray_DATA(<cnp.ndarray>gates)
        s.a.gates_bs = cnp.PyArray_STRIDES(<cnp.ndarray>gates)[0] // item
        s.a.gates_ts = cnp.PyArray_STRIDES(<cnp.ndarray>gates)[1] // item
    s.a.small_m = g_small_m
    s.a.sgemm = <fa_sgemm_fn>sgemm
    s.a.dgemm = <fa_dgemm_fn>dgemm
    s.a.wpack = NULL
    s.gh = <int64_t>G * H
    s.status = 0
    cdef object prepacked = wpack
    cdef bint pack_here = 0
    wpack = None
    cdef cnp.ndarray claimed, done, hbuf
    # main thread: the steps in chunks, the stop callback asked between them
    cdef interrupt_state intr
    cdef bint interruptible = interrupt_arm(&intr, _main_ident) != NULL
    cdef int64_t chunk = T
    cdef double step_flops = 2.0 * B * s.gh * H
    if interruptible and step_flops * T > g_chunk_flops:
        chunk = <int64_t>(g_chunk_flops / step_flops)
        if chunk < 1:
            chunk = 1
    cdef cnp.ndarray lens_chunk = None
    cdef const int64_t *lens_all = s.a.lengths
    cdef int64_t *lens_c = NULL
    if chunk < T and lens_all != NULL:
        lens_chunk = cnp.PyArray_EMPTY(1, [B], cnp.NPY_INT64, 0)
        lens_c = <int64_t *>cnp.PyArray_DATA(lens_chunk)
    cdef const char *xw_base = <const char *>s.a.xw
    cdef char *out_base = <char *>s.a.out
    cdef char *gates_base = <char *>s.a.gates
    cdef int64_t t0, tc, k, hb_bytes = B * H * item
    cdef unsigned char *claimed_base = NULL
    cdef int *done_base = NULL
    cdef char *hb = NULL
    s.split = 0
    if (g_split and g_rt.pool_run != NULL and nt > 1 and T > 1
            and B < <int64_t>nt * g_min_block_rows and H >= 2 * g_split_min_units and 2.0 * B * s.gh * H >= SPLIT_MIN_FLOPS):
        # few rows: split the units of every step (see fa_rnn.h)
        s.split = 1
        s.sp.nb = nt
        s.sp.units = ((H + nt - 1) // nt + 7) // 8 * 8
        s.sp.nb = (H + s.sp.units - 1) // s.sp.units
        claimed = cnp.PyArray_ZEROS(1, [T * s.sp.nb], cnp.NPY_UINT8, 0)
        done = cnp.PyArray_ZEROS(1, [T], cnp.NPY_INT32, 0)
        hbuf = cnp.PyArray_EMPTY(2, [2, B * H], cnp.PyArray_TYPE(xw), 0)
        hbuf[1] = h.reshape(-1)
        claimed_base = <unsigned char *>cnp.PyArray_DATA(claimed)
        done_base = <int *>cnp.PyArray_DATA(done)
        hb = <char *>cnp.PyArray_DATA(hbuf)
        s.sp.hbuf = hb
        s.per = 2 * B * G * s.sp.units
        scratch = cnp.PyArray_EMPTY(1, [nt * s.per], cnp.PyArray_TYPE(xw), 0)
        nblocks = nt       # one task a thread, each claiming unit blocks step by step
    else:
        # row blocks
        if g_rt.pool_run == NULL or nt <= 1 or B < 2 or 2.0 * B * s.gh * H < PARALLEL_MIN_FLOPS * 2:
            nblocks = 1
        else:
            nblocks = <int64_t>nt * g_blocks_per_thread
            if nblocks * g_min_block_rows > B:
                nblocks = nt
            if nblocks > B:
                nblocks = B
        s.rows = (B + nblocks - 1) // nblocks
        if s.rows > 4:
            s.rows = (s.rows + 3) // 4 * 4   # the few-row kernel takes rows 4 at a time
        nblocks = (B + s.rows - 1) // s.rows
        scratch = cnp.PyArray_EMPTY(1, [B * s.gh], cnp.PyArray_TYPE(xw), 0)
        if g_packed and s.f32 and s.a.simd and fa_proj_packed_available():
            # W_hh packed once for the packed AVX2 kernel (every block, every step)
            if prepacked is not None:
                wpack = _prepacked(prepacked, fa_proj_packed_size(s.gh, H))
            else:
                wpack = cnp.PyArray_EMPTY(1, [fa_proj_packed_size(s.gh, H)], cnp.NPY_FLOAT32, 0)
                pack_here = 1
            s.a.wpack = <const float *>cnp.PyArray_DATA(<cnp.ndarray>wpack)
    s.scratch = <char *>cnp.PyArray_DATA(scratch)
    with nogil:
        hook = runtime_hold(&g_rt)
        if pack_here:
            fa_proj_pack_panels_f32(0, (s.gh + 15) // 16, s.gh, H, <const float *>s.a.whh,
                                    s.a.ldw, <float *>s.a.wpack, 1)
        # chunk k: steps [t0, t0 + tc); split: every chunk starts from hbuf[1]
        # and has fresh claimed / done entries (those of its own steps)
        k = 0
        while k < T:
            tc = chunk if chunk < T - k else T - k
            t0 = k if not reverse else T - k - tc
            if tc < T:
                _chunk_args(&s, xw_base, out_base, gates_base, item, t0, tc, lens_all, lens_c)
            if s.split:
                s.sp.claimed = claimed_base + k * s.sp.nb
                s.sp.done = done_base + k
            runtime_run(&g_rt, nblocks, nt, _task, &s, NULL, NULL)
            if s.split and (tc - 1) % 2 == 0:  # the chunk's last state is in hbuf[0]
                memcpy(hb + hb_bytes, hb, <size_t>hb_bytes)
            k += tc
            if s.status != 0:
                break
            if k < T and interruptible and interrupt_stop(&intr):
                break
        runtime_release(&g_rt, hook)
    interrupt_raise(&intr)
    _check_status(s.status, "recurrence", B, T, H, -1, cell)
    if s.split:
        h[...] = hbuf[1].reshape(B, H)
        return -nt
    return nblocks


ctypedef struct cell_ctx:
    fa_cell_args a
    int f32
    int64_t units          # hidden units per block
    int64_t per            # scratch elements per block
    char *scratch
    int status


cdef void _cell_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef cell_ctx *c = <cell_ctx *>vctx
    cdef int64_t u0 = t * c.units
    cdef int64_t u1 = u0 + c.units
    cdef int rc
    if u1 > c.a.H:
        u1 = c.a.H
    if u0 >= u1:
        return
    if c.f32:
        rc = fa_rnn_cell_f32(&c.a, u0, u1, <float *>c.scratch + t * c.per)
    else:
        rc = fa_rnn_cell_f64(&c.a, u0, u1, <double *>c.scratch + t * c.per)
    if rc != 0:
        fa_store_status(&c.status, rc)


def cell(int cell, cnp.ndarray x, cnp.ndarray wih, object bih, cnp.ndarray whh, object bhh,
         cnp.ndarray h0, object c0, cnp.ndarray h1, object c1, int n_threads):
    """One step for all rows: h1 (and c1) from x (B, I) and h0 (and c0) (B, H).

    x: rows contiguous, row stride >= I; wih (G*H, I), whh (G*H, H): rows
    contiguous; bih, bhh: (G*H,) contiguous or None; h0, c0, h1, c1: (B, H)
    C-contiguous, h1 / c1 not overlapping h0 / c0; c0, c1 only for LSTM.  One
    float dtype; B, H, I >= 1 and within int.  Returns the number of blocks.
    """
    cdef cell_ctx s
    cdef int64_t item = cnp.PyArray_ITEMSIZE(x)
    cdef int64_t B = cnp.PyArray_DIMS(x)[0]
    cdef int64_t nin = cnp.PyArray_DIMS(x)[1]
    cdef int64_t H = cnp.PyArray_DIMS(h0)[1]
    cdef int G = _gates(cell)
    cdef int nt = n_threads if n_threads > 0 else 1
    cdef int64_t nblocks
    cdef void *hook = NULL
    cdef cnp.ndarray scratch
    s.f32 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32
    s.a.cell = cell
    s.a.simd = runtime_level(&g_rt)
    s.a.B = B
    s.a.H = H
    s.a.nin = nin
    s.a.x = cnp.PyArray_DATA(x)
    s.a.ldx = nin if B <= 1 else cnp.PyArray_STRIDES(x)[0] // item
    s.a.wih = cnp.PyArray_DATA(wih)
    s.a.ldwi = nin if cnp.PyArray_DIMS(wih)[0] <= 1 else cnp.PyArray_STRIDES(wih)[0] // item
    s.a.bih = NULL if bih is None else cnp.PyArray_DATA(<cnp.ndarray>bih)
    s.a.whh = cnp.PyArray_DATA(whh)
    s.a.ldwh = H if cnp.PyArray_DIMS(whh)[0] <= 1 else cnp.PyArray_STRIDES(whh)[0] // item
    s.a.bhh = NULL if bhh is None else cnp.PyArray_DATA(<cnp.ndarray>bhh)
    s.a.h0 = cnp.PyArray_DATA(h0)
    s.a.c0 = NULL if c0 is None else cnp.PyArray_DATA(<cnp.ndarray>c0)
    s.a.h1 = cnp.PyArray_DATA(h1)
    s.a.c1 = NULL if c1 is None else cnp.PyArray_DATA(<cnp.ndarray>c1)
    s.a.small_m = g_small_m
    s.a.sgemm = <fa_sgemm_fn>sgemm
    s.a.dgemm = <fa_dgemm_fn>dgemm
    s.status = 0
    if g_rt.pool_run == NULL or nt <= 1 or 2.0 * B * G * H * (nin + H) < CELL_PARALLEL_MIN_FLOPS:
        nblocks = 1
    else:
        nblocks = <int64_t>nt * g_blocks_per_thread
        if nblocks * g_cell_min_units > H:
            nblocks = H // g_cell_min_units
        if nblocks < 1:
            nblocks = 1
    s.units = (H + nblocks - 1) // nblocks
    if nblocks > 1:
        s.units = (s.units + 7) // 8 * 8   # whole AVX2 vectors of units
    nblocks = (H + s.units - 1) // s.units
    s.per = 2 * B * G * s.units
    scratch = cnp.PyArray_EMPTY(1, [nblocks * s.per], cnp.PyArray_TYPE(x), 0)
    s.scratch = <char *>cnp.PyArray_DATA(scratch)
    with nogil:
        hook = runtime_hold(&g_rt)
        runtime_run(&g_rt, nblocks, nt, _cell_task, &s, NULL, NULL)
        runtime_release(&g_rt, hook)
    _check_status(s.status, "cell", B, -1, H, nin, cell)
    return nblocks


ctypedef struct bwd_ctx:
    fa_rnn_bwd_args a
    int f32
    int64_t rows           # rows per block
    int64_t per            # scratch elements per block
    char *scratch          # block i: elements [i * per, (i + 1) * per)
    int64_t item
    int cstate             # this pool call: the LSTM cell states (else steps [s0, s1))
    int64_t s0, s1
    int status


cdef void _bwd_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef bwd_ctx *c = <bwd_ctx *>vctx
    cdef int64_t b0 = t * c.rows
    cdef int64_t b1 = b0 + c.rows
    cdef int rc
    cdef char *sp = c.scratch + t * c.per * c.item
    if b1 > c.a.B:
        b1 = c.a.B
    if b0 >= b1:
        return
    if c.cstate:
        if c.f32:
            rc = fa_rnn_bwd_cstate_f32(&c.a, b0, b1, <float *>sp)
        else:
            rc = fa_rnn_bwd_cstate_f64(&c.a, b0, b1, <double *>sp)
    elif c.f32:
        rc = fa_rnn_bwd_f32(&c.a, b0, b1, c.s0, c.s1, <float *>sp)
    else:
        rc = fa_rnn_bwd_f64(&c.a, b0, b1, c.s0, c.s1, <double *>sp)
    if rc != 0:
        fa_store_status(&c.status, rc)


def backward_blocks(int64_t B, int64_t H, int G):
    """The row blocks of scan_backward for these sizes: ``(blocks, rows per block)``."""
    cdef int64_t nblocks, rows
    if B < 2 or 2.0 * B * G * H * H < PARALLEL_MIN_FLOPS * 2:
        nblocks = 1
    else:
        # blocks of BWD_MIN_ROWS rows or more, but two blocks (of min_block_rows
        # or more) rather than one
        nblocks = B // BWD_MIN_ROWS
        if nblocks < 2:
            nblocks = 2 if B >= 2 * g_min_block_rows else 1
        if nblocks > g_bwd_blocks:
            nblocks = g_bwd_blocks
        if nblocks < 1:
            nblocks = 1
    rows = (B + nblocks - 1) // nblocks
    if rows > 4:
        rows = (rows + 3) // 4 * 4   # the product's kernel takes rows 4 (or 6) at a time
    return (B + rows - 1) // rows, rows


def scan_backward(int cell, cnp.ndarray xw, cnp.ndarray gh, object bhh, object hprev, object c0,
                  object go, cnp.ndarray whh, object lengths, bint reverse, cnp.ndarray dxw,
                  object dgh, cnp.ndarray dh, object dc, object db, int n_threads,
                  object wpack=None):
    """The dh (and dc) recurrence of one layer and direction, backwards over all steps.

    xw: (B, T, G*H) the forward's input projections, last axis contiguous, any
    batch / time strides; gh: (B, T, G*H) C-contiguous, the hidden products
    h_{t-1} W_hh^T, with b_hh included when bhh is None, else bhh (G*H,)
    contiguous is added here; hprev: (B, T, H) C-contiguous states before each
    step (GRU; None otherwise); c0: (B, H) C-contiguous (LSTM) or None; go:
    (B, T, H) last axis contiguous or None; whh: (G*H, H) rows contiguous;
    lengths: (B,) int64 contiguous or None.  Outputs: dxw (B, T, G*H)
    C-contiguous; dgh the same (GRU) or None; dh (B, H) C-contiguous holds
    dL/dh_T and receives dL/dh_0; dc the same for LSTM, else None; db: (B, G*H)
    float64 zeros or None, row i * rows receives row block i's sums of dgh
    (float64; dL/db_hh = db.sum(0), in block order; the sums are added to
    what db holds, so one db can gather several calls); wpack: None or
    :func:`pack_recurrent` ``(whh, True)`` made from this whh.  One float
    dtype; B, T, H >= 1; G*H, H, B within int.  Returns the number of row
    blocks (fixed by B, G and H).  From the main thread, KeyboardInterrupt
    stops between chunks of steps and is raised here.
    """
    cdef bwd_ctx s
    cdef int64_t item = cnp.PyArray_ITEMSIZE(xw)
    cdef int64_t B = cnp.PyArray_DIMS(xw)[0]
    cdef int64_t T = cnp.PyArray_DIMS(xw)[1]
    cdef int64_t H = cnp.PyArray_DIMS(dh)[1]
    cdef int G = _gates(cell)
    cdef int nt = n_threads if n_threads > 0 else 1
    cdef int64_t nblocks, rows, k, tc
    cdef void *hook = NULL
    cdef cnp.ndarray scratch
    cdef object prepacked = wpack
    cdef bint pack_here = 0
    wpack = None
    s.f32 = cnp.PyArray_TYPE(xw) == cnp.NPY_FLOAT32
    s.item = item
    s.a.cell = cell
    s.a.simd = runtime_level(&g_rt)
    s.a.B = B
    s.a.T = T
    s.a.H = H
    s.a.xw = cnp.PyArray_DATA(xw)
    s.a.xw_bs = cnp.PyArray_STRIDES(xw)[0] // item
    s.a.xw_ts = cnp.PyArray_STRIDES(xw)[1] // item
    s.a.gh = cnp.PyArray_DATA(gh)
    s.a.bhh = NULL if bhh is None else cnp.PyArray_DATA(<cnp.ndarray>bhh)
    s.a.hprev = NULL if hprev is None else cnp.PyArray_DATA(<cnp.ndarray>hprev)
    s.a.c0 = NULL if c0 is None else cnp.PyArray_DATA(<cnp.ndarray>c0)
    if go is None:
        s.a.go = NULL
        s.a.go_bs = 0
        s.a.go_ts = 0
    else:
        s.a.go = cnp.PyArray_DATA(<cnp.ndarray>go)
        s.a.go_bs = cnp.PyArray_STRIDES(<cnp.ndarray>go)[0] // item
        s.a.go_ts = cnp.PyArray_STRIDES(<cnp.ndarray>go)[1] // item
    s.a.whh = cnp.PyArray_DATA(whh)
    s.a.ldw = H if cnp.PyArray_DIMS(whh)[0] <= 1 else cnp.PyArray_STRIDES(whh)[0] // item
    s.a.wpack = NULL
    if lengths is None:
        s.a.lengths = NULL
    else:
        s.a.lengths = <const int64_t *>cnp.PyArray_DATA(<cnp.ndarray>lengths)
    s.a.reverse = reverse
    s.a.dxw = cnp.PyArray_DATA(dxw)
    s.a.dgh = NULL if dgh is None else cnp.PyArray_DATA(<cnp.ndarray>dgh)
    s.a.dh = cnp.PyArray_DATA(dh)
    s.a.dc = NULL if dc is None else cnp.PyArray_DATA(<cnp.ndarray>dc)
    s.a.db = NULL if db is None else <double *>cnp.PyArray_DATA(<cnp.ndarray>db)
    s.a.sgemm = <fa_sgemm_fn>sgemm
    s.a.dgemm = <fa_dgemm_fn>dgemm
    s.status = 0
    nblocks, rows = backward_blocks(B, H, G)
    s.rows = rows
    s.per = fa_rnn_bwd_scratch(cell, rows, T, H)
    scratch = cnp.PyArray_EMPTY(1, [nblocks * s.per], cnp.PyArray_TYPE(xw), 0)
    s.scratch = <char *>cnp.PyArray_DATA(scratch)
    if s.f32 and s.a.simd and fa_proj_packed_available():
        # W_hh^T packed once for the AVX2 kernel (its 16-column panels)
        if prepacked is not None:
            wpack = _prepacked(prepacked, fa_proj_packed_size(H, <int64_t>G * H))
        else:
            wpack = cnp.PyArray_EMPTY(1, [fa_proj_packed_size(H, <int64_t>G * H)], cnp.NPY_FLOAT32, 0)
            pack_here = 1
        s.a.wpack = <const float *>cnp.PyArray_DATA(<cnp.ndarray>wpack)
    # main thread: the steps in chunks, the stop callback asked between them
    cdef interrupt_state intr
    cdef bint interruptible = interrupt_arm(&intr, _main_ident) != NULL
    cdef int64_t chunk = T
    cdef double step_flops = 2.0 * B * G * H * H
    if interruptible and step_flops * T > g_chunk_flops:
        chunk = <int64_t>(g_chunk_flops / step_flops)
        if chunk < 1:
            chunk = 1
    with nogil:
        hook = runtime_hold(&g_rt)
        if pack_here:
            fa_proj_pack_t_panels_f32(0, (H + 15) // 16, H, <int64_t>G * H,
                                      <const float *>s.a.whh, s.a.ldw, <float *>s.a.wpack)
        if cell == 3:   # LSTM: the cell states of every step first
            s.cstate = 1
            runtime_run(&g_rt, nblocks, nt, _bwd_task, &s, NULL, NULL)
        s.cstate = 0
        k = 0
        while k < T and s.status == 0:
            tc = chunk if chunk < T - k else T - k
            s.s0 = k
            s.s1 = k + tc
            runtime_run(&g_rt, nblocks, nt, _bwd_task, &s, NULL, NULL)
            k += tc
            if k < T and interruptible and interrupt_stop(&intr):
                break
        runtime_release(&g_rt, hook)
    interrupt_raise(&intr)
    _check_status(s.status, "recurrence backward", B, T, H, -1, cell)
    return nblocks
