# Cython declarations of fastattn's compiled-similarity plugin ABI.
#
# The C header is csrc/fastattn_plugin.h in the source tree and
# fastattn/include/fastattn_plugin.h in an installed fastattn; add
# fastattn.get_include() to your extension's include_dirs.  Usage:
#
#     from fastattn.plugin cimport fastattn_score_plugin, FASTATTN_PLUGIN_CAPSULE_NAME
#
# Score-tile signature (float and double variants):
#
#     int score(const void *params, const T *q, int64_t ldq, const T *k,
#               int64_t ldk, int64_t tq, int64_t tk, int64_t d,
#               T *scores, int64_t lds)
#
# writes scores[i * lds + j] for i < tq, j < tk; returns 0 or an error code.
# Called from several threads at once without the GIL: declare it noexcept nogil.
#
# ABI version 2 adds the optional backward (float and double variants):
#
#     int score_backward(const void *params, const T *q, int64_t ldq,
#                        const T *k, int64_t ldk, int64_t tq, int64_t tk,
#                        int64_t d, const T *grad_scores, int64_t ldg,
#                        T *dq, int64_t lddq, T *dk, int64_t lddk, double *dparams)
#
# which ADDS dL/dq, dL/dk and dL/d(packed params) into dq, dk and dparams
# (see fastattn_plugin.h for the full contract).
from libc.stdint cimport int64_t

cdef extern from "fastattn_plugin.h" nogil:
    int FASTATTN_PLUGIN_ABI_VERSION
    const char *FASTATTN_PLUGIN_CAPSULE_NAME
    const char *FASTATTN_PLUGIN_CAPSULE_NAME_V1
    ctypedef int (*fastattn_score_f32)(const void *params, const float *q, int64_t ldq,
                                       const float *k, int64_t ldk, int64_t tq, int64_t tk,
                                       int64_t d, float *scores, int64_t lds) noexcept nogil
    ctypedef int (*fastattn_score_f64)(const void *params, const double *q, int64_t ldq,
                                       const double *k, int64_t ldk, int64_t tq, int64_t tk,
                                       int64_t d, double *scores, int64_t lds) noexcept nogil
    ctypedef int (*fastattn_score_backward_f32)(
        const void *params, const float *q, int64_t ldq, const float *k, int64_t ldk,
        int64_t tq, int64_t tk, int64_t d, const float *grad_scores, int64_t ldg,
        float *dq, int64_t lddq, float *dk, int64_t lddk, double *dparams) noexcept nogil
    ctypedef int (*fastattn_score_backward_f64)(
        const void *params, const double *q, int64_t ldq, const double *k, int64_t ldk,
        int64_t tq, int64_t tk, int64_t d, const double *grad_scores, int64_t ldg,
        double *dq, int64_t lddq, double *dk, int64_t lddk, double *dparams) noexcept nogil
    ctypedef struct fastattn_score_plugin:
        int abi_version
        const char *name
        fastattn_score_f32 score_f32
        fastattn_score_f64 score_f64
        fastattn_score_backward_f32 score_backward_f32  # version 2 only
        fastattn_score_backward_f64 score_backward_f64  # version 2 only
