# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Row-wise and elementwise kernels of the training ops (csrc/fa_rowwise.c):
layer normalisation and its backward, dropout, and the masked products of the
backward of dropout and relu.

Canonical buffers in, preallocated outputs, GIL released, no user-facing
checks: ``fastattn._norm`` validates every argument, picks the dtype and
allocates before it calls here.  Arrays are 2-D ``(rows, E)`` with a
contiguous last axis (layer norm) or 1-D contiguous (the elementwise ops),
float32 or float64, one dtype per call; masks are uint8 / bool.

Threads: the rows (elements) are cut into chunks whose size depends on the
shape only, handed out by fastattn's worker pool (``set_runtime``, as
``fastattn._proj``); each chunk's result depends on its own elements alone,
so any thread count gives the same bits.  The layer norm backward's weight
and bias sums go into one float64 partial sum per chunk (``parts``), which
the caller adds up in chunk order.  Small arrays run on the calling thread.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t, uint8_t, uint64_t, uintptr_t

from fastattn._runtime cimport (runtime, runtime_level, runtime_run, runtime_set, runtime_simd,
                               task_fn)

cnp.import_array()

cdef extern from "fa_rowwise.h" nogil:
    void fa_ln_fwd_f32(int64_t rows, int64_t E, const float *x, int64_t ldx, const float *w,
                       const float *b, double eps, float *y, int64_t ldy, int simd)
    void fa_ln_fwd_f64(int64_t rows, int64_t E, const double *x, int64_t ldx, const double *w,
                       const double *b, double eps, double *y, int64_t ldy)
    void fa_ln_bwd_f32(int64_t rows, int64_t E, const float *g, int64_t ldg, const float *x,
                       int64_t ldx, const float *w, double eps, float *dx, int64_t lddx,
                       double *dw_acc, double *db_acc, int simd)
    void fa_ln_bwd_f64(int64_t rows, int64_t E, const double *g, int64_t ldg, const double *x,
                       int64_t ldx, const double *w, double eps, double *dx, int64_t lddx,
                       double *dw_acc, double *db_acc)
    void fa_dropout_f32(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                        const float *x, float *y, float scale, uint8_t *keep, int simd)
    void fa_dropout_f64(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                        const double *x, double *y, double scale, uint8_t *keep, int simd)
    void fa_relu_dropout_f32(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                             const float *x, float *y, float scale, uint8_t *keep, int simd)
    void fa_relu_dropout_f64(int64_t i0, int64_t i1, uint64_t seed, uint64_t threshold,
                             const double *x, double *y, double scale, uint8_t *keep, int simd)
    void fa_relu_mask_scale_f32(int64_t n, const float *g, const uint8_t *keep, float scale,
                                const float *d, float *out, int simd)
    void fa_relu_mask_scale_f64(int64_t n, const double *g, const uint8_t *keep, double scale,
                                const double *d, double *out, int simd)
    void fa_mask_scale_f32(int64_t n, const float *g, const uint8_t *keep, float scale, float *out)
    void fa_mask_scale_f64(int64_t n, const double *g, const uint8_t *keep, double scale,
                           double *out)
    void fa_relu_f32(int64_t n, const float *x, float *out)
    void fa_relu_f64(int64_t n, const double *x, double *out)
    void fa_relu_bwd_f32(int64_t n, const float *g, const float *x, float *out)
    void fa_relu_bwd_f64(int64_t n, const double *g, const double *x, double *out)
    void fa_colsum_f32(int64_t rows, int64_t n, const float *x, int64_t ldx, double *acc)
    void fa_colsum_f64(int64_t rows, int64_t n, const double *x, int64_t ldx, double *acc)
    double fa_sumsq_f32(int64_t n, const float *x)
    double fa_sumsq_f64(int64_t n, const double *x)
    void fa_scatter_add_f32(int64_t rows, int64_t E, const float *src, const int64_t *ids,
                            float *dst)
    void fa_scatter_add_f64(int64_t rows, int64_t E, const double *src, const int64_t *ids,
                            double *dst)
    void fa_xent_f32(int64_t r0, int64_t r1, int64_t C, const float *z, int64_t ldz,
                     const int64_t *tgt, int64_t ignore, double scale, float *grad,
                     int64_t ldg, double *nll, int simd)
    void fa_xent_f64(int64_t r0, int64_t r1, int64_t C, const double *z, int64_t ldz,
                     const int64_t *tgt, int64_t ignore, double scale, double *grad,
                     int64_t ldg, double *nll, int simd)
    ctypedef struct fa_adam_hyper:
        double lr, b1, b2, eps, wd, step_size, bc2_sqrt
        int decoupled, maximize
    void fa_adam_f32(int64_t n, float *p, const float *g, float *m, float *v, float *vmax,
                     const fa_adam_hyper *h)
    void fa_adam_f64(int64_t n, double *p, const double *g, double *m, double *v, double *vmax,
                     const fa_adam_hyper *h)

cdef runtime g_rt

# about this many elements a chunk (a few tens of microseconds of work), and
# at least one chunk per PARALLEL_MIN elements before the pool is used
DEF CHUNK_ELEMS = 16384
DEF PARALLEL_MIN = 65536


def set_runtime(uintptr_t pool_run, uintptr_t hold_enter, uintptr_t hold_exit,
                uintptr_t simd_active=0):
    """Install fastattn._kernels' pool (C addresses, see fastattn/_runtime.pxd); 0s uninstall."""
    runtime_set(&g_rt, pool_run, hold_enter, hold_exit, simd_active)


def runtime_installed():
    return g_rt.pool_run != NULL


def chunk_rows(int64_t rows, int64_t E):
    """Rows a chunk of a layer norm over ``(rows, E)`` (a function of the shape only)."""
    cdef int64_t c = CHUNK_ELEMS // (E if E > 0 else 1)
    if c < 1:
        c = 1
    return c


def n_chunks(int64_t rows, int64_t E):
    """Number of chunks (and of ``parts`` rows the backward needs)."""
    cdef int64_t c = chunk_rows(rows, E)
    return (rows + c - 1) // c


ctypedef struct ln_ctx:
    int f64
    int64_t rows, E, chunk
    char *x
    char *g
    char *w
    char *b
    char *y
    int64_t ldx, ldg, ldy
    double eps
    double *parts   # (chunks, 2, E) or NULL
    int simd        # float32: fastattn's SIMD switch is on (AVX2 lanes, the same bits)


cdef void _ln_fwd_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef ln_ctx *c = <ln_ctx *>vctx
    cdef int64_t r0 = t * c.chunk
    cdef int64_t n = c.rows - r0
    if n > c.chunk:
        n = c.chunk
    if c.f64:
        fa_ln_fwd_f64(n, c.E, <double *>c.x + r0 * c.ldx, c.ldx, <double *>c.w, <double *>c.b,
                      c.eps, <double *>c.y + r0 * c.ldy, c.ldy)
    else:
        fa_ln_fwd_f32(n, c.E, <float *>c.x + r0 * c.ldx, c.ldx, <float *>c.w, <float *>c.b,
                      c.eps, <float *>c.y + r0 * c.ldy, c.ldy, c.simd)


cdef void _ln_bwd_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef ln_ctx *c = <ln_ctx *>vctx
    cdef int64_t r0 = t * c.chunk
    cdef int64_t n = c.rows - r0
    cdef double *dw = NULL
    cdef double *db = NULL
    if n > c.chunk:
        n = c.chunk
    if c.parts != NULL:
        dw = c.parts + t * 2 * c.E
        db = dw + c.E
    if c.f64:
        fa_ln_bwd_f64(n, c.E, <double *>c.g + r0 * c.ldg, c.ldg, <double *>c.x + r0 * c.ldx,
                      c.ldx, <double *>c.w, c.eps, <double *>c.y + r0 * c.ldy, c.ldy, dw, db)
    else:
        fa_ln_bwd_f32(n, c.E, <float *>c.g + r0 * c.ldg, c.ldg, <float *>c.x + r0 * c.ldx,
                      c.ldx, <float *>c.w, c.eps, <float *>c.y + r0 * c.ldy, c.ldy, dw, db,
                      c.simd)


cdef int64_t _ld(cnp.ndarray a):
    return cnp.PyArray_STRIDES(a)[0] // cnp.PyArray_ITEMSIZE(a) if cnp.PyArray_DIMS(a)[0] > 1 \
        else cnp.PyArray_DIMS(a)[1]


cdef char *_ptr(object a):
    return NULL if a is None else <char *>cnp.PyArray_DATA(<cnp.ndarray>a)


cdef void _run(ln_ctx *c, task_fn fn, int n_threads) noexcept nogil:
    cdef int64_t ntasks = (c.rows + c.chunk - 1) // c.chunk
    cdef int64_t t
    if n_threads > 1 and c.rows * c.E >= PARALLEL_MIN and ntasks > 1:
        runtime_run(&g_rt, ntasks, n_threads, fn, c, NULL, NULL)
    else:
        for t in range(ntasks):
            fn(c, t, 0)


def layer_norm(cnp.ndarray x, object w, object b, double eps, cnp.ndarray y, int n_threads):
    """y = layer_norm(x) over rows: x, y (rows, E); w, b (E,) or None; one dtype."""
    cdef ln_ctx c
    c.f64 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    c.rows, c.E = cnp.PyArray_DIMS(x)[0], cnp.PyArray_DIMS(x)[1]
    if c.rows == 0 or c.E == 0:
        return
    c.chunk = chunk_rows(c.rows, c.E)
    c.x, c.w, c.b, c.y = _ptr(x), _ptr(w), _ptr(b), _ptr(y)
    c.ldx, c.ldy = _ld(x), _ld(y)
    c.eps = eps
    c.parts = NULL
    c.simd = runtime_simd(&g_rt)
    with nogil:
        _run(&c, _ln_fwd_task, n_threads)


def layer_norm_backward(cnp.ndarray g, cnp.ndarray x, object w, double eps, cnp.ndarray dx,
                        object parts, int n_threads):
    """dx from g (rows, E); ``parts`` (n_chunks, 2, E) float64 zeros, or None: each
    chunk's sums of g x̂ and of g."""
    cdef ln_ctx c
    c.f64 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    c.rows, c.E = cnp.PyArray_DIMS(x)[0], cnp.PyArray_DIMS(x)[1]
    if c.rows == 0 or c.E == 0:
        return
    c.chunk = chunk_rows(c.rows, c.E)
    c.x, c.g, c.w, c.b, c.y = _ptr(x), _ptr(g), _ptr(w), NULL, _ptr(dx)
    c.ldx, c.ldg, c.ldy = _ld(x), _ld(g), _ld(dx)
    c.eps = eps
    c.parts = <double *>_ptr(parts)
    c.simd = runtime_simd(&g_rt)
    with nogil:
        _run(&c, _ln_bwd_task, n_threads)


ctypedef struct ew_ctx:
    int op          # 0 dropout (mask only when x is NULL), 1 mask_scale, 2 relu_bwd, 3 relu,
                    # 4 relu then dropout, 5 mask_scale then relu_bwd against b
    int f64
    int64_t n, chunk
    char *a
    char *b
    char *out
    uint8_t *keep
    uint64_t seed, threshold
    double scale
    int simd        # dropout: fastattn's SIMD level (0 off, 1 AVX2, 2 AVX-512; the same
                    # bytes and floats at every level)


ctypedef void (*drop_f32)(int64_t, int64_t, uint64_t, uint64_t, const float *, float *, float,
                         uint8_t *, int) noexcept nogil
ctypedef void (*drop_f64)(int64_t, int64_t, uint64_t, uint64_t, const double *, double *,
                         double, uint8_t *, int) noexcept nogil


cdef void _ew_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef ew_ctx *c = <ew_ctx *>vctx
    cdef int64_t i0 = t * c.chunk
    cdef int64_t n = c.n - i0
    if n > c.chunk:
        n = c.chunk
    cdef drop_f32 d32
    cdef drop_f64 d64
    if c.op == 0 or c.op == 4:   # dropout, after a relu for op 4
        if c.f64:
            d64 = fa_relu_dropout_f64 if c.op == 4 else fa_dropout_f64
            d64(i0, i0 + n, c.seed, c.threshold, <double *>c.a, <double *>c.out, c.scale, c.keep,
                c.simd)
        else:
            d32 = fa_relu_dropout_f32 if c.op == 4 else fa_dropout_f32
            d32(i0, i0 + n, c.seed, c.threshold, <float *>c.a, <float *>c.out, <float>c.scale,
                c.keep, c.simd)
    elif c.op == 5:
        if c.f64:
            fa_relu_mask_scale_f64(n, <double *>c.a + i0, c.keep + i0, c.scale,
                                   <double *>c.b + i0, <double *>c.out + i0, c.simd)
        else:
            fa_relu_mask_scale_f32(n, <float *>c.a + i0, c.keep + i0, <float>c.scale,
                                   <float *>c.b + i0, <float *>c.out + i0, c.simd)
    elif c.op == 1:
        if c.f64:
            fa_mask_scale_f64(n, <double *>c.a + i0, c.keep + i0, c.scale, <double *>c.out + i0)
        else:
            fa_mask_scale_f32(n, <float *>c.a + i0, c.keep + i0, <float>c.scale,
                              <float *>c.out + i0)
    elif c.op == 2:
        if c.f64:
            fa_relu_bwd_f64(n, <double *>c.a + i0, <double *>c.b + i0, <double *>c.out + i0)
        else:
            fa_relu_bwd_f32(n, <float *>c.a + i0, <float *>c.b + i0, <float *>c.out + i0)
    else:
        if c.f64:
            fa_relu_f64(n, <double *>c.a + i0, <double *>c.out + i0)
        else:
            fa_relu_f32(n, <float *>c.a + i0, <float *>c.out + i0)


cdef void _ew_run(ew_ctx *c, int n_threads) noexcept nogil:
    cdef int64_t ntasks
    cdef int64_t t
    c.chunk = 4 * CHUNK_ELEMS
    ntasks = (c.n + c.chunk - 1) // c.chunk
    if n_threads > 1 and c.n >= PARALLEL_MIN and ntasks > 1:
        runtime_run(&g_rt, ntasks, n_threads, _ew_task, c, NULL, NULL)
    else:
        for t in range(ntasks):
            _ew_task(c, t, 0)


cdef _dropout_run(int op, object x, object y, cnp.ndarray keep, uint64_t seed,
                  uint64_t threshold, double scale, int n_threads):
    cdef ew_ctx c
    c.op = op
    c.n = cnp.PyArray_DIMS(keep)[0]
    c.f64 = x is not None and cnp.PyArray_TYPE(<cnp.ndarray>x) == cnp.NPY_FLOAT64
    c.a, c.b, c.out = _ptr(x), NULL, _ptr(y)
    c.keep = <uint8_t *>_ptr(keep)
    c.seed, c.threshold, c.scale = seed, threshold, scale
    c.simd = runtime_level(&g_rt)   # 2: the AVX-512 float32 pass (the same bytes and floats)
    with nogil:
        _ew_run(&c, n_threads)


def dropout(object x, object y, cnp.ndarray keep, uint64_t seed, uint64_t threshold,
            double scale, int n_threads):
    """keep (n,) uint8 / bool from the seeded stream; with x and y (n,), y = x keep scale."""
    _dropout_run(0, x, y, keep, seed, threshold, scale, n_threads)


def relu_dropout(cnp.ndarray x, cnp.ndarray y, cnp.ndarray keep, uint64_t seed,
                 uint64_t threshold, double scale, int n_threads):
    """keep (n,) from the seeded stream and y = relu(x) keep scale, all (n,): the
    bytes and floats of relu then dropout."""
    _dropout_run(4, x, y, keep, seed, threshold, scale, n_threads)


def relu_mask_scale(cnp.ndarray g, cnp.ndarray keep, double scale, cnp.ndarray d,
                    cnp.ndarray out, int n_threads):
    """out = 0 where d <= 0, else g keep scale, all (n,): mask_scale then
    relu_backward against d in one pass."""
    cdef ew_ctx c
    c.op = 5
    c.n = cnp.PyArray_DIMS(g)[0]
    c.f64 = cnp.PyArray_TYPE(g) == cnp.NPY_FLOAT64
    c.a, c.b, c.out = _ptr(g), _ptr(d), _ptr(out)
    c.keep = <uint8_t *>_ptr(keep)
    c.scale = scale
    c.simd = runtime_simd(&g_rt)
    with nogil:
        _ew_run(&c, n_threads)


def mask_scale(cnp.ndarray g, cnp.ndarray keep, double scale, cnp.ndarray out, int n_threads):
    """out = g keep scale, all (n,)."""
    cdef ew_ctx c
    c.op = 1
    c.n = cnp.PyArray_DIMS(g)[0]
    c.f64 = cnp.PyArray_TYPE(g) == cnp.NPY_FLOAT64
    c.a, c.b, c.out = _ptr(g), NULL, _ptr(out)
    c.keep = <uint8_t *>_ptr(keep)
    c.scale = scale
    with nogil:
        _ew_run(&c, n_threads)


def relu(cnp.ndarray x, cnp.ndarray out, int n_threads):
    """out = max(x, 0) as np.maximum (NaN kept, -0 -> +0), both (n,)."""
    cdef ew_ctx c
    c.op = 3
    c.n = cnp.PyArray_DIMS(x)[0]
    c.f64 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    c.a, c.b, c.out = _ptr(x), NULL, _ptr(out)
    c.keep = NULL
    with nogil:
        _ew_run(&c, n_threads)


def relu_backward(cnp.ndarray g, cnp.ndarray x, cnp.ndarray out, int n_threads):
    """out = g where x > 0 else 0, all (n,)."""
    cdef ew_ctx c
    c.op = 2
    c.n = cnp.PyArray_DIMS(g)[0]
    c.f64 = cnp.PyArray_TYPE(g) == cnp.NPY_FLOAT64
    c.a, c.b, c.out = _ptr(g), _ptr(x), _ptr(out)
    c.keep = NULL
    with nogil:
        _ew_run(&c, n_threads)


ctypedef struct adam_ctx:
    int f64
    int64_t n, chunk
    char *p
    char *g
    char *m
    char *v
    char *vmax
    fa_adam_hyper h


cdef void _adam_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef adam_ctx *c = <adam_ctx *>vctx
    cdef int64_t i0 = t * c.chunk
    cdef int64_t n = c.n - i0
    if n > c.chunk:
        n = c.chunk
    if c.f64:
        fa_adam_f64(n, <double *>c.p + i0, <double *>c.g + i0, <double *>c.m + i0,
                    <double *>c.v + i0, <double *>c.vmax + i0 if c.vmax != NULL else NULL, &c.h)
    else:
        fa_adam_f32(n, <float *>c.p + i0, <float *>c.g + i0, <float *>c.m + i0,
                    <float *>c.v + i0, <float *>c.vmax + i0 if c.vmax != NULL else NULL, &c.h)


def adam(cnp.ndarray p, cnp.ndarray g, cnp.ndarray m, cnp.ndarray v, object vmax, double lr,
         double b1, double b2, double eps, double wd, double step_size, double bc2_sqrt,
         bint decoupled, bint maximize, int n_threads):
    """One Adam step in place on 1-D contiguous p, g, m, v (vmax or None), one dtype."""
    cdef adam_ctx c
    cdef int64_t ntasks, t
    c.f64 = cnp.PyArray_TYPE(p) == cnp.NPY_FLOAT64
    c.n = cnp.PyArray_DIMS(p)[0]
    c.chunk = 4 * CHUNK_ELEMS
    c.p, c.g, c.m, c.v, c.vmax = _ptr(p), _ptr(g), _ptr(m), _ptr(v), _ptr(vmax)
    c.h.lr, c.h.b1, c.h.b2, c.h.eps, c.h.wd = lr, b1, b2, eps, wd
    c.h.step_size, c.h.bc2_sqrt = step_size, bc2_sqrt
    c.h.decoupled, c.h.maximize = decoupled, maximize
    ntasks = (c.n + c.chunk - 1) // c.chunk
    with nogil:
        if n_threads > 1 and c.n >= PARALLEL_MIN and ntasks > 1:
            runtime_run(&g_rt, ntasks, n_threads, _adam_task, &c, NULL, NULL)
        else:
            for t in range(ntasks):
                _adam_task(&c, t, 0)


cdef void _colsum_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef ln_ctx *c = <ln_ctx *>vctx
    cdef int64_t r0 = t * c.chunk
    cdef int64_t n = c.rows - r0
    if n > c.chunk:
        n = c.chunk
    if c.f64:
        fa_colsum_f64(n, c.E, <double *>c.x + r0 * c.ldx, c.ldx, c.parts + t * c.E)
    else:
        fa_colsum_f32(n, c.E, <float *>c.x + r0 * c.ldx, c.ldx, c.parts + t * c.E)


def colsum(cnp.ndarray x, cnp.ndarray parts, int n_threads):
    """parts[t] += the column sums of chunk t's rows of x (rows, N) (n_chunks(rows, N)
    chunks of chunk_rows rows); parts (chunks, N) float64."""
    cdef ln_ctx c
    c.f64 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    c.rows, c.E = cnp.PyArray_DIMS(x)[0], cnp.PyArray_DIMS(x)[1]
    if c.rows == 0 or c.E == 0:
        return
    c.chunk = chunk_rows(c.rows, c.E)
    c.x = _ptr(x)
    c.ldx = _ld(x)
    c.parts = <double *>_ptr(parts)
    with nogil:
        _run(&c, _colsum_task, n_threads)


ctypedef struct xent_ctx:
    int f64, simd
    int64_t rows, C, chunk, ignore
    char *z
    char *g
    const int64_t *tgt
    double *nll
    double scale


cdef void _xent_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef xent_ctx *c = <xent_ctx *>vctx
    cdef int64_t r0 = t * c.chunk
    cdef int64_t r1 = r0 + c.chunk
    if r1 > c.rows:
        r1 = c.rows
    if c.f64:
        fa_xent_f64(r0, r1, c.C, <double *>c.z, c.C, c.tgt, c.ignore, c.scale, <double *>c.g,
                    c.C, c.nll, c.simd)
    else:
        fa_xent_f32(r0, r1, c.C, <float *>c.z, c.C, c.tgt, c.ignore, c.scale, <float *>c.g,
                    c.C, c.nll, c.simd)


def cross_entropy(cnp.ndarray z, cnp.ndarray tgt, int64_t ignore, double scale,
                  cnp.ndarray grad, cnp.ndarray nll, int n_threads):
    """Softmax cross entropy of the rows of z (N, C) against class indices tgt
    (N,) int64 (each in [0, C) or ``ignore``), no weights or smoothing:
    nll (N,) float64 and grad (N, C) = scale * d(sum of nll)/dz written
    (csrc/fa_rowwise.h's fa_xent).  z and grad C-contiguous, one float dtype,
    C >= 1; each row's result depends on that row alone."""
    cdef xent_ctx c
    cdef int64_t ntasks, t
    c.f64 = cnp.PyArray_TYPE(z) == cnp.NPY_FLOAT64
    c.rows, c.C = cnp.PyArray_DIMS(z)[0], cnp.PyArray_DIMS(z)[1]
    if c.rows == 0:
        return
    c.chunk = chunk_rows(c.rows, c.C)
    c.z, c.g = _ptr(z), _ptr(grad)
    c.tgt = <const int64_t *>cnp.PyArray_DATA(tgt)
    c.nll = <double *>cnp.PyArray_DATA(nll)
    c.ignore, c.scale = ignore, scale
    c.simd = runtime_simd(&g_rt)
    ntasks = (c.rows + c.chunk - 1) // c.chunk
    with nogil:
        if n_threads > 1 and c.rows * c.C >= PARALLEL_MIN and ntasks > 1:
            runtime_run(&g_rt, ntasks, n_threads, _xent_task, &c, NULL, NULL)
        else:
            for t in range(ntasks):
                _xent_task(&c, t, 0)


def scatter_add(cnp.ndarray dst, cnp.ndarray src, cnp.ndarray ids):
    """dst[ids[r]] += src[r] for the rows r in order (GIL released).  dst (n, E)
    and src (rows, E) C-contiguous, aligned, of one dtype (float32 or
    float64); ids (rows,) C-contiguous int64, every id in [0, n) -- the
    caller's checks."""
    cdef int64_t rows = cnp.PyArray_DIMS(src)[0]
    cdef int64_t E = cnp.PyArray_DIMS(src)[1]
    cdef bint f64 = cnp.PyArray_TYPE(dst) == cnp.NPY_FLOAT64
    cdef char *d = _ptr(dst)
    cdef char *s = _ptr(src)
    cdef const int64_t *i = <const int64_t *>_ptr(ids)
    with nogil:
        if f64:
            fa_scatter_add_f64(rows, E, <const double *>s, i, <double *>d)
        else:
            fa_scatter_add_f32(rows, E, <const float *>s, i, <float *>d)


ctypedef struct sumsq_ctx:
    int f64
    int64_t n, chunk
    char *x
    double *parts


cdef void _sumsq_task(void *vctx, int64_t t, int slot) noexcept nogil:
    cdef sumsq_ctx *c = <sumsq_ctx *>vctx
    cdef int64_t i0 = t * c.chunk
    cdef int64_t n = c.n - i0
    if n > c.chunk:
        n = c.chunk
    if c.f64:
        c.parts[t] = fa_sumsq_f64(n, <double *>c.x + i0)
    else:
        c.parts[t] = fa_sumsq_f32(n, <float *>c.x + i0)


def sumsq_chunk():
    """Elements per part of :func:`sumsq` (a constant: the parts do not depend
    on the thread count)."""
    return 4 * CHUNK_ELEMS


def sumsq(cnp.ndarray x, cnp.ndarray parts, int n_threads):
    """parts[t] = the sum of squares (in double) of chunk t (sumsq_chunk()
    elements) of x, 1-D C-contiguous aligned float32 / float64; parts float64
    with one entry per chunk."""
    cdef sumsq_ctx c
    cdef int64_t ntasks, t
    c.f64 = cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT64
    c.n = cnp.PyArray_DIMS(x)[0]
    c.chunk = 4 * CHUNK_ELEMS
    c.x = _ptr(x)
    c.parts = <double *>_ptr(parts)
    ntasks = (c.n + c.chunk - 1) // c.chunk
    with nogil:
        if n_threads > 1 and c.n >= PARALLEL_MIN and ntasks > 1:
            runtime_run(&g_rt, ntasks, n_threads, _sumsq_task, &c, NULL, NULL)
        else:
            for t in range(ntasks):
                _sumsq_task(&c, t, 0)
