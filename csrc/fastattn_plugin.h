/*
 * fastattn compiled-similarity plugin ABI, version 2 (version 1 plugins keep
 * working, forward only).
 *
 * A compiled plugin provides a score-tile function: given a tile of tq query
 * rows and tk key rows (row-major, d features each, row strides ldq / ldk in
 * elements), it writes the tq x tk scores (row stride lds) and returns 0, or
 * a nonzero error code of its choice, which fastattn reports as
 * fastattn._attention.SimilarityError("... returned error code N").
 *
 *   int score(const void *params, const T *q, int64_t ldq, const T *k,
 *             int64_t ldk, int64_t tq, int64_t tk, int64_t d,
 *             T *scores, int64_t lds);
 *
 * - T is float (score_f32) or double (score_f64); either may be NULL when
 *   that precision is not supported (fastattn then raises TypeError).
 * - params points to the buffer of the C-contiguous NumPy array that the
 *   Python side's CompiledSimilarity.pack_params returned (by default the
 *   float64 values of the similarity's parameters, in params_spec order).
 * - Scores must be finite or -inf (-inf: the query may not attend to that
 *   key); NaN or +inf make the call fail with ValueError.
 * - The function is called concurrently from several threads, without the
 *   GIL: it must be thread-safe and must not call into Python.  It must not
 *   write anywhere but scores[0..tq) x [0..tk) (row stride lds).
 * - d >= 1, tq >= 1, tk >= 1.
 *
 * Version 2 adds an optional backward entry (fastattn.functional.
 * attention_backward uses it):
 *
 *   int score_backward(const void *params, const T *q, int64_t ldq,
 *                      const T *k, int64_t ldk, int64_t tq, int64_t tk,
 *                      int64_t d, const T *grad_scores, int64_t ldg,
 *                      T *dq, int64_t lddq, T *dk, int64_t lddk,
 *                      double *dparams);
 *
 * - grad_scores[i * ldg + j] is dL/d(score of query i, key j) for the same
 *   tile; it is 0 for pairs that may not attend.
 * - The function ADDS (never overwrites): dq[i * lddq + c] += dL/dq_ic,
 *   dk[j * lddk + c] += dL/dk_jc, and dparams[n] += dL/dparams[n] for each
 *   element n of the packed params array (the array pack_params returned;
 *   dparams has one double per element of it, whatever its dtype).
 *   CompiledSimilarity.unpack_param_grads maps those back to the named
 *   parameters (by default the inverse of the default pack_params).
 * - Same rules as score: thread-safe, no Python, no writes elsewhere, 0 or
 *   an error code.  Either precision may be NULL (attention_backward then
 *   raises NotImplementedError for that dtype).
 *
 * The plugin hands fastattn a pointer to a fastattn_score_plugin struct with
 * static lifetime, wrapped in a PyCapsule named FASTATTN_PLUGIN_CAPSULE_NAME
 * ("fastattn.score_plugin.v2"), as the ``capsule`` attribute of a
 * fastattn.CompiledSimilarity subclass.  A plugin built against version 1 of
 * this header ("fastattn.score_plugin.v1", abi_version 1, a struct of the
 * first four fields) still works for the forward.  Source written for
 * version 1 compiles unchanged against this one and becomes a version 2
 * plugin without a backward (the new fields are zero-initialised).
 *
 * This header is plain C99 (no Python.h); fastattn.get_include() returns the
 * directory that holds it.
 */
#ifndef FASTATTN_PLUGIN_H
#define FASTATTN_PLUGIN_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define FASTATTN_PLUGIN_ABI_VERSION 2
#define FASTATTN_PLUGIN_CAPSULE_NAME "fastattn.score_plugin.v2"
/* what a version 1 plugin's capsule is named (still accepted, forward only) */
#define FASTATTN_PLUGIN_CAPSULE_NAME_V1 "fastattn.score_plugin.v1"

typedef int (*fastattn_score_f32)(const void *params, const float *q, int64_t ldq,
                                  const float *k, int64_t ldk, int64_t tq, int64_t tk,
                                  int64_t d, float *scores, int64_t lds);
typedef int (*fastattn_score_f64)(const void *params, const double *q, int64_t ldq,
                                  const double *k, int64_t ldk, int64_t tq, int64_t tk,
                                  int64_t d, double *scores, int64_t lds);

typedef int (*fastattn_score_backward_f32)(const void *params, const float *q, int64_t ldq,
                                           const float *k, int64_t ldk, int64_t tq, int64_t tk,
                                           int64_t d, const float *grad_scores, int64_t ldg,
                                           float *dq, int64_t lddq, float *dk, int64_t lddk,
                                           double *dparams);
typedef int (*fastattn_score_backward_f64)(const void *params, const double *q, int64_t ldq,
                                           const double *k, int64_t ldk, int64_t tq, int64_t tk,
                                           int64_t d, const double *grad_scores, int64_t ldg,
                                           double *dq, int64_t lddq, double *dk, int64_t lddk,
                                           double *dparams);

typedef struct {
    int abi_version;               /* FASTATTN_PLUGIN_ABI_VERSION */
    const char *name;              /* informative */
    fastattn_score_f32 score_f32;  /* may be NULL */
    fastattn_score_f64 score_f64;  /* may be NULL */
    /* version 2 (absent from a version 1 struct): */
    fastattn_score_backward_f32 score_backward_f32;  /* may be NULL */
    fastattn_score_backward_f64 score_backward_f64;  /* may be NULL */
} fastattn_score_plugin;

#ifdef __cplusplus
}
#endif
#endif
