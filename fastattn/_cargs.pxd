# cython: language_level=3
"""The argument structs of the two attention kernels (csrc/fastattn.h
fa_sdpa_args, csrc/fa_additive.h fa_tiled_args) and the one helper that fills
their common part -- batch shape and strides, sizes, leading dimensions, data
pointers, mask and weights -- from validated, canonical ndarrays."""
cimport numpy as cnp
from libc.stdint cimport int64_t

from fastattn._buffers cimport batch_strides, row_ld
from fastattn.plugin cimport fastattn_score_f32, fastattn_score_f64

cdef extern from "fastattn.h" nogil:
    ctypedef struct fa_sdpa_args:
        int nbatch
        const int64_t *batch_shape
        const int64_t *q_bs
        const int64_t *k_bs
        const int64_t *v_bs
        const int64_t *o_bs
        const int64_t *m_bs
        const int64_t *w_bs
        int64_t Lq, Lk, d, dv
        int64_t ldq, ldk, ldv, ldo, ldm, ldw
        const void *q
        const void *k
        const void *v
        const void *mask
        int mask_kind
        int causal
        int64_t causal_offset
        double scale
        void *out
        void *weights
        void *lse
        const int64_t *l_bs
        int64_t block_q
        int64_t block_k
        int path
        int direct
        int n_threads
        int (*stop)(void *)
        void *stop_ctx

cdef extern from "fa_additive.h" nogil:
    ctypedef struct fa_tiled_args:
        int nbatch
        const int64_t *batch_shape
        const int64_t *q_bs
        const int64_t *k_bs
        const int64_t *v_bs
        const int64_t *o_bs
        const int64_t *m_bs
        const int64_t *w_bs
        int64_t Lq, Lk, d, dv
        int64_t ldq, ldk, ldv, ldo, ldm, ldw
        const void *q
        const void *k
        const void *v
        const void *mask
        int mask_kind
        int causal
        int64_t causal_offset
        void *out
        void *weights
        void *lse
        const int64_t *l_bs
        int64_t block_q, block_k
        int n_threads
        fastattn_score_f32 score_f32
        fastattn_score_f64 score_f64
        const void *score_params
        int check_scores
        int score_status
        int (*stop)(void *)
        void *stop_ctx

ctypedef fused attn_args:
    fa_sdpa_args
    fa_tiled_args

# per call: batch shape, then the batch strides of q, k, v, out, mask, weights, lse
ctypedef struct layout_bufs:
    int64_t shape[32]
    int64_t qbs[32]
    int64_t kbs[32]
    int64_t vbs[32]
    int64_t obs[32]
    int64_t mbs[32]
    int64_t wbs[32]
    int64_t lbs[32]


cdef inline void fill_layout(attn_args *a, layout_bufs *b, cnp.ndarray q, cnp.ndarray k,
                             cnp.ndarray v, object mask, int mask_kind, int mask_none,
                             cnp.ndarray out, object weights, object lse, tuple batch_shape):
    """q (..., Lq, d), k (..., Lk, d), v (..., Lk, dv), out (..., Lq, dv), mask
    (..., Lq|1, Lk) unless mask_kind == mask_none, weights (..., Lq, Lk) or None,
    lse (..., Lq, 1) with unit row stride (the Lq axis contiguous) or None;
    leading dims broadcasting to batch_shape (at most 32 dims).  The pointers in
    *a point into *b, which must outlive the kernel call."""
    cdef int nb = len(batch_shape)
    cdef int i
    cdef cnp.ndarray m_arr, w_arr, l_arr
    for i in range(nb):
        b.shape[i] = batch_shape[i]
    a.nbatch = nb
    a.batch_shape = b.shape
    batch_strides(q, nb, b.shape, b.qbs)
    batch_strides(k, nb, b.shape, b.kbs)
    batch_strides(v, nb, b.shape, b.vbs)
    batch_strides(out, nb, b.shape, b.obs)
    a.q_bs = b.qbs
    a.k_bs = b.kbs
    a.v_bs = b.vbs
    a.o_bs = b.obs
    a.m_bs = b.mbs
    a.w_bs = b.wbs
    a.Lq = cnp.PyArray_DIMS(q)[cnp.PyArray_NDIM(q) - 2]
    a.d = cnp.PyArray_DIMS(q)[cnp.PyArray_NDIM(q) - 1]
    a.Lk = cnp.PyArray_DIMS(k)[cnp.PyArray_NDIM(k) - 2]
    a.dv = cnp.PyArray_DIMS(v)[cnp.PyArray_NDIM(v) - 1]
    a.ldq = row_ld(q, a.d)
    a.ldk = row_ld(k, a.d)
    a.ldv = row_ld(v, a.dv)
    a.ldo = row_ld(out, a.dv)
    a.q = cnp.PyArray_DATA(q)
    a.k = cnp.PyArray_DATA(k)
    a.v = cnp.PyArray_DATA(v)
    a.out = cnp.PyArray_DATA(out)
    a.mask_kind = mask_kind
    a.mask = NULL
    a.ldm = 0
    if mask_kind != mask_none:
        m_arr = <cnp.ndarray>mask
        batch_strides(m_arr, nb, b.shape, b.mbs)
        a.mask = cnp.PyArray_DATA(m_arr)
        if cnp.PyArray_DIMS(m_arr)[cnp.PyArray_NDIM(m_arr) - 2] != 1:
            a.ldm = cnp.PyArray_STRIDES(m_arr)[cnp.PyArray_NDIM(m_arr) - 2] // cnp.PyArray_ITEMSIZE(m_arr)
    a.weights = NULL
    a.ldw = 0
    if weights is not None:
        w_arr = <cnp.ndarray>weights
        batch_strides(w_arr, nb, b.shape, b.wbs)
        a.weights = cnp.PyArray_DATA(w_arr)
        a.ldw = row_ld(w_arr, a.Lk)
    a.lse = NULL
    a.l_bs = b.lbs
    if lse is not None:
        l_arr = <cnp.ndarray>lse
        batch_strides(l_arr, nb, b.shape, b.lbs)
        a.lse = cnp.PyArray_DATA(l_arr)
