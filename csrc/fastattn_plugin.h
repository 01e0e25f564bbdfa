/*
 * fastattn compiled-similarity plugin ABI, version 1.
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
 * The plugin hands fastattn a pointer to a fastattn_score_plugin struct with
 * static lifetime, wrapped in a PyCapsule named FASTATTN_PLUGIN_CAPSULE_NAME,
 * as the ``capsule`` attribute of a fastattn.CompiledSimilarity subclass.
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

#define FASTATTN_PLUGIN_ABI_VERSION 1
#define FASTATTN_PLUGIN_CAPSULE_NAME "fastattn.score_plugin.v1"

typedef int (*fastattn_score_f32)(const void *params, const float *q, int64_t ldq,
                                  const float *k, int64_t ldk, int64_t tq, int64_t tk,
                                  int64_t d, float *scores, int64_t lds);
typedef int (*fastattn_score_f64)(const void *params, const double *q, int64_t ldq,
                                  const double *k, int64_t ldk, int64_t tq, int64_t tk,
                                  int64_t d, double *scores, int64_t lds);

typedef struct {
    int abi_version;               /* FASTATTN_PLUGIN_ABI_VERSION */
    const char *name;              /* informative */
    fastattn_score_f32 score_f32;  /* may be NULL */
    fastattn_score_f64 score_f64;  /* may be NULL */
} fastattn_score_plugin;

#ifdef __cplusplus
}
#endif
#endif
