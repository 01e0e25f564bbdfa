# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Projection kernels for multi-head attention: ``Y = X W^T + b`` over BLAS.

Canonical buffers in, a preallocated output, GIL released, no user-facing
checks: ``fastattn._multihead`` validates every argument before it calls here.

Row-major arrays are handed to the Fortran (column-major) gemm as their
transposes: row-major ``Y (M, N)`` with row stride ``ldy`` is column-major
``Y^T (N, M)`` with leading dimension ``ldy``, so ``Y = X W^T`` becomes
``Y^T = W X^T`` = ``gemm('T', 'N', N, M, K, 1, W, ldw, X, ldx, beta, Y, ldy)``.

Threads: the projections are large GEMMs (4 E^2 multiply-adds a token against
the attention's 2 L E), which OpenBLAS parallelises well by itself, so they run
with SciPy's OpenBLAS at its own thread setting (all cores by default, like
``x @ w.T`` in NumPy).  This module never changes that setting: the attention
kernel (``fastattn._kernels``) holds BLAS at one thread with a save/restore
counter of its own, and a second, independent counter here could leave BLAS
at the wrong count when calls from several application threads interleave.
"""
cimport numpy as cnp
from libc.stdint cimport int64_t
from libc.string cimport memcpy
from scipy.linalg.cython_blas cimport sgemm, dgemm

cnp.import_array()

ctypedef fused real:
    float
    double


cdef inline int64_t _rows_ld(cnp.ndarray a, int64_t cols) noexcept:
    """Row stride in elements of the last two axes; a single row gets a BLAS-valid one."""
    cdef int nd = cnp.PyArray_NDIM(a)
    if cnp.PyArray_DIMS(a)[nd - 2] <= 1:
        return cols if cols > 0 else 1
    return cnp.PyArray_STRIDES(a)[nd - 2] // cnp.PyArray_ITEMSIZE(a)


cdef void _linear(real *x, int64_t xbs, int ldx, real *w, int ldw, real *b,
                  real *y, int64_t ybs, int ldy, int nb, int M, int N, int K,
                  bint collapse) noexcept nogil:
    cdef char ta = b'T'
    cdef char tn = b'N'
    cdef real one = 1
    cdef real beta = 0
    cdef int i, r, rows
    cdef int64_t j
    if b != NULL:
        beta = 1
        for i in range(nb):
            for r in range(M):
                memcpy(y + i * ybs + <int64_t>r * ldy, b, N * sizeof(real))
    if collapse:  # the batch items are one run of equally spaced rows: one gemm
        rows = nb * M
        if real is float:
            sgemm(&ta, &tn, &N, &rows, &K, &one, w, &ldw, x, &ldx, &beta, y, &ldy)
        else:
            dgemm(&ta, &tn, &N, &rows, &K, &one, w, &ldw, x, &ldx, &beta, y, &ldy)
        return
    for i in range(nb):
        if real is float:
            sgemm(&ta, &tn, &N, &M, &K, &one, w, &ldw, x + i * xbs, &ldx, &beta,
                  y + i * ybs, &ldy)
        else:
            dgemm(&ta, &tn, &N, &M, &K, &one, w, &ldw, x + i * xbs, &ldx, &beta,
                  y + i * ybs, &ldy)


def linear(cnp.ndarray x, cnp.ndarray w, object b, cnp.ndarray y):
    """``y[i] = x[i] @ w.T + b`` for every batch item ``i``.

    x: (nb, M, K), w: (N, K), b: (N,) or None, y: (nb, M, N); one float dtype
    (float32 or float64); last axes contiguous, row strides positive and at
    least a row long (a single row may have any stride), batch strides
    anything; y does not overlap x, w or b; M, N, K >= 1 and within the BLAS
    32-bit range.
    """
    cdef int nb = <int>cnp.PyArray_DIMS(x)[0]
    cdef int M = <int>cnp.PyArray_DIMS(x)[1]
    cdef int K = <int>cnp.PyArray_DIMS(x)[2]
    cdef int N = <int>cnp.PyArray_DIMS(w)[0]
    cdef int ldx = <int>_rows_ld(x, K)
    cdef int ldw = <int>_rows_ld(w, K)
    cdef int ldy = <int>_rows_ld(y, N)
    cdef int64_t item = cnp.PyArray_ITEMSIZE(x)
    cdef int64_t xbs = cnp.PyArray_STRIDES(x)[0] // item
    cdef int64_t ybs = cnp.PyArray_STRIDES(y)[0] // item
    cdef bint collapse
    cdef void *bp = NULL
    if b is not None:
        bp = cnp.PyArray_DATA(<cnp.ndarray>b)
    if M == 1 and nb > 1:  # one row per item: the batch stride is the row stride
        collapse = (xbs >= K and ybs >= N and xbs < 2147483647 and ybs < 2147483647
                    and xbs > 0 and ybs > 0)
        if collapse:
            ldx = <int>xbs
            ldy = <int>ybs
    else:
        collapse = nb == 1 or (xbs == <int64_t>M * ldx and ybs == <int64_t>M * ldy)
    if cnp.PyArray_TYPE(x) == cnp.NPY_FLOAT32:
        with nogil:
            _linear[float](<float *>cnp.PyArray_DATA(x), xbs, ldx,
                           <float *>cnp.PyArray_DATA(w), ldw, <float *>bp,
                           <float *>cnp.PyArray_DATA(y), ybs, ldy, nb, M, N, K, collapse)
    else:
        with nogil:
            _linear[double](<double *>cnp.PyArray_DATA(x), xbs, ldx,
                            <double *>cnp.PyArray_DATA(w), ldw, <double *>bp,
                            <double *>cnp.PyArray_DATA(y), ybs, ldy, nb, M, N, K, collapse)
