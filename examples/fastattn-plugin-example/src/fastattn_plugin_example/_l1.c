/*
 * Example fastattn compiled similarity: s_ij = -gamma * sum_c |q_ic - k_jc|.
 *
 * The score-tile functions follow csrc/fastattn_plugin.h: plain C, no Python
 * inside them (they run on fastattn's worker threads without the GIL).  The
 * module only exposes the plugin struct as a PyCapsule named
 * FASTATTN_PLUGIN_CAPSULE_NAME in its attribute ``score_plugin``.
 *
 * params: the float64 array returned by NegL1Distance.pack_params, {gamma}.
 * Error code 1: gamma < 0 (it would reward distance).
 *
 * The backward (plugin ABI version 2) adds, for dL/ds_ij = g_ij:
 *   dq_ic += -gamma g_ij sign(q_ic - k_jc),  dk_jc -= the same,
 *   dgamma += -g_ij sum_c |q_ic - k_jc|
 * (sign(0) = 0: the subgradient torch's abs uses).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include "fastattn_plugin.h"

#define L1_BODY(T, ABS)                                                  \
    const double gamma = ((const double *)params)[0];                    \
    if (gamma < 0)                                                       \
        return 1;                                                        \
    for (int64_t i = 0; i < tq; i++) {                                   \
        const T *qi = q + i * ldq;                                       \
        for (int64_t j = 0; j < tk; j++) {                               \
            const T *kj = k + j * ldk;                                   \
            T acc = 0;                                                   \
            for (int64_t c = 0; c < d; c++)                              \
                acc += ABS(qi[c] - kj[c]);                               \
            scores[i * lds + j] = (T)(-gamma) * acc;                     \
        }                                                                \
    }                                                                    \
    return 0;

static int l1_f32(const void *params, const float *q, int64_t ldq, const float *k, int64_t ldk,
                  int64_t tq, int64_t tk, int64_t d, float *scores, int64_t lds)
{
    L1_BODY(float, fabsf)
}

static int l1_f64(const void *params, const double *q, int64_t ldq, const double *k,
                  int64_t ldk, int64_t tq, int64_t tk, int64_t d, double *scores, int64_t lds)
{
    L1_BODY(double, fabs)
}

#define L1_BWD_BODY(T, ABS)                                              \
    const double gamma = ((const double *)params)[0];                    \
    if (gamma < 0)                                                       \
        return 1;                                                        \
    double dgamma = 0.0;                                                 \
    for (int64_t i = 0; i < tq; i++) {                                   \
        const T *qi = q + i * ldq;                                       \
        T *dqi = dq + i * lddq;                                          \
        for (int64_t j = 0; j < tk; j++) {                               \
            const T *kj = k + j * ldk;                                   \
            T *dkj = dk + j * lddk;                                      \
            T gij = grad_scores[i * ldg + j], w = (T)(-gamma) * gij;     \
            T acc = 0;                                                   \
            if (gij == 0)                                                \
                continue;                                                \
            for (int64_t c = 0; c < d; c++) {                            \
                T t = qi[c] - kj[c];                                     \
                T sg = (T)((t > 0) - (t < 0));                           \
                acc += ABS(t);                                           \
                dqi[c] += w * sg;                                        \
                dkj[c] -= w * sg;                                        \
            }                                                            \
            dgamma -= (double)gij * (double)acc;                         \
        }                                                                \
    }                                                                    \
    dparams[0] += dgamma;                                                \
    return 0;

static int l1_bwd_f32(const void *params, const float *q, int64_t ldq, const float *k,
                      int64_t ldk, int64_t tq, int64_t tk, int64_t d, const float *grad_scores,
                      int64_t ldg, float *dq, int64_t lddq, float *dk, int64_t lddk,
                      double *dparams)
{
    L1_BWD_BODY(float, fabsf)
}

static int l1_bwd_f64(const void *params, const double *q, int64_t ldq, const double *k,
                      int64_t ldk, int64_t tq, int64_t tk, int64_t d, const double *grad_scores,
                      int64_t ldg, double *dq, int64_t lddq, double *dk, int64_t lddk,
                      double *dparams)
{
    L1_BWD_BODY(double, fabs)
}

static const fastattn_score_plugin plugin = {
    FASTATTN_PLUGIN_ABI_VERSION, "neg_l1_distance", l1_f32, l1_f64, l1_bwd_f32, l1_bwd_f64,
};

static struct PyModuleDef moddef = {
    PyModuleDef_HEAD_INIT, "fastattn_plugin_example._l1",
    "The fastattn score-tile functions of NegL1Distance, as a PyCapsule.", -1, NULL,
};

PyMODINIT_FUNC PyInit__l1(void)
{
    PyObject *m = PyModule_Create(&moddef);
    if (!m)
        return NULL;
    PyObject *cap = PyCapsule_New((void *)&plugin, FASTATTN_PLUGIN_CAPSULE_NAME, NULL);
    if (!cap || PyModule_AddObject(m, "score_plugin", cap) < 0) {
        Py_XDECREF(cap);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
