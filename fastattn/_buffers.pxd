# cython: language_level=3
"""Buffer layout helpers shared by the Cython bindings (_kernels, _scores):
how a validated ndarray's strides become the element strides the C kernels take."""
cimport numpy as cnp
from libc.stdint cimport int64_t


cdef inline void batch_strides(cnp.ndarray a, int nbatch, const int64_t *shape,
                               int64_t *out) noexcept:
    """Element strides of a's leading dims, right-aligned to the broadcast batch shape."""
    cdef int nd = cnp.PyArray_NDIM(a) - 2
    cdef int i, j
    cdef cnp.npy_intp *sh = cnp.PyArray_DIMS(a)
    cdef cnp.npy_intp *st = cnp.PyArray_STRIDES(a)
    cdef int64_t item = cnp.PyArray_ITEMSIZE(a)
    for i in range(nbatch):
        j = i - (nbatch - nd)
        if j < 0 or sh[j] == 1:
            out[i] = 0
        else:
            out[i] = st[j] // item


cdef inline int64_t row_ld(cnp.ndarray a, int64_t cols) noexcept:
    """Row stride in elements; a single row gets a BLAS-valid stride."""
    cdef int nd = cnp.PyArray_NDIM(a)
    if cnp.PyArray_DIMS(a)[nd - 2] == 1:
        return cols if cols > 0 else 1
    return cnp.PyArray_STRIDES(a)[nd - 2] // cnp.PyArray_ITEMSIZE(a)
