/*
 * Recurrence kernel of the RNN layers (csrc/fa_rnn.c), used by fastattn/_rnn.pyx.
 * Plain C: raw pointers, sizes and element strides, status codes; no Python.
 *
 * One layer, one direction, torch's equations (G gates of H each, stacked in
 * that order in the weights):
 *   FA_RNN_TANH / FA_RNN_RELU (G = 1): h' = act(xw + gh)
 *   FA_RNN_GRU  (G = 3: r, z, n):  r = s(xw_r + gh_r), z = s(xw_z + gh_z),
 *                n = tanh(xw_n + r * gh_n), h' = (1 - z) n + z h
 *   FA_RNN_LSTM (G = 4: i, f, g, o): c' = s(.f) c + s(.i) tanh(.g),
 *                h' = s(.o) tanh(c')
 * where xw = x W_ih^T + b_ih is precomputed for every step (one GEMM by the
 * caller), gh = h W_hh^T + b_hh is computed here at every step, and s is the
 * logistic sigmoid 1 / (1 + exp(-x)).
 *
 * Sequences stop at their length (packed-sequence semantics): at step t a
 * row with lengths[b] <= t keeps its state and gets a zero output row.  The
 * reverse direction walks t = T-1 .. 0, so its rows start at their own last
 * real token.
 *
 * fa_rnn_f32 / _f64 run batch rows [b0, b1) through all T steps; rows are
 * independent, so disjoint row ranges may run on different threads at once
 * with no synchronisation.  scratch: (b1 - b0) * G * H elements, not shared
 * between concurrent calls.
 */
#ifndef FA_RNN_H
#define FA_RNN_H

#include <stdint.h>
#include "fastattn.h"

#define FA_RNN_TANH 0
#define FA_RNN_RELU 1
#define FA_RNN_GRU 2
#define FA_RNN_LSTM 3

#define FA_RNN_EINVAL 2

typedef struct {
    int cell;                     /* FA_RNN_* */
    int simd;                     /* 1: the AVX2/FMA code may run (the caller's dispatch) */
    int64_t B, T, H;              /* all >= 1 */
    const void *xw;               /* xw[b, t, g] at xw + b * xw_bs + t * xw_ts + g, g < G*H */
    int64_t xw_bs, xw_ts;
    const void *whh;              /* (G*H, H), row stride ldw >= H */
    int64_t ldw;
    const void *bhh;              /* (G*H,) or NULL */
    void *h;                      /* (B, H), row stride H: initial state in, final state out */
    void *c;                      /* LSTM: (B, H), row stride H, the same; NULL otherwise */
    void *out;                    /* out[b, t, j] at out + b * out_bs + t * out_ts + j; may be NULL */
    int64_t out_bs, out_ts;
    const int64_t *lengths;       /* (B,) values in [0, T], or NULL: all T */
    int reverse;                  /* 1: t = T-1 .. 0 */
    /* h W_hh^T: float32 blocks of at most small_m rows use fa_proj_small_f32
     * (with simd); otherwise these Fortran-ABI gemms (scipy.linalg.cython_blas),
     * which the caller keeps at one thread.  G*H, H, B must fit in an int. */
    int64_t small_m;
    fa_sgemm_fn sgemm;
    fa_dgemm_fn dgemm;
} fa_rnn_args;

/* One step of a cell for all B rows, computing both products: hidden units
 * [u0, u1) of the new state from the old one.  Disjoint unit ranges may run
 * on different threads at once (each reads only its units' G rows of W_ih
 * and W_hh, and writes only its units of h1 / c1), which is how a B = 1
 * decoder step uses more than one core. */
typedef struct {
    int cell;
    int simd;
    int64_t B, H, nin;            /* rows, hidden size, input size; all >= 1 */
    const void *x;                /* (B, nin), row stride ldx >= nin */
    int64_t ldx;
    const void *wih;              /* (G*H, nin), row stride ldwi >= nin */
    int64_t ldwi;
    const void *bih;              /* (G*H,) or NULL */
    const void *whh;              /* (G*H, H), row stride ldwh >= H */
    int64_t ldwh;
    const void *bhh;              /* (G*H,) or NULL */
    const void *h0, *c0;          /* (B, H), row stride H: the previous state (c0: LSTM) */
    void *h1, *c1;                /* (B, H), row stride H: the new state, not overlapping h0 / c0 */
    int64_t small_m;
    fa_sgemm_fn sgemm;
    fa_dgemm_fn dgemm;
} fa_cell_args;

/* scratch: 2 * B * G * (u1 - u0) elements.  Returns 0 or FA_RNN_EINVAL. */
int fa_rnn_cell_f32(const fa_cell_args *a, int64_t u0, int64_t u1, float *scratch);
int fa_rnn_cell_f64(const fa_cell_args *a, int64_t u0, int64_t u1, double *scratch);

/* The same recurrence with the hidden units split instead of the rows, for
 * few rows (a B = 1 encoder): every step is cut into nb blocks of units;
 * threads claim blocks (their own first: slot % nb), and a step starts only
 * when every block of the previous one is done.  A thread that finds no
 * partner claims every block itself, so any number of threads (one
 * included) completes the call -- the worker pool may start the tasks late
 * or one after the other.  Shared state (zeroed by the caller): claimed
 * (T * nb bytes), done (T ints); hbuf: two (B, H) buffers, the second holding
 * the initial state (step s reads buffer (s + 1) % 2 and writes s % 2, so the
 * final state is in buffer (T - 1) % 2); a->c is updated in place (LSTM);
 * a->h is not used.  scratch: 2 * B * G * units elements per thread. */
typedef struct {
    int64_t nb, units;            /* blocks per step, units per block (the last may be shorter) */
    unsigned char *claimed;
    int *done;
    void *hbuf;
} fa_rnn_split;

int fa_rnn_split_f32(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, float *scratch);
int fa_rnn_split_f64(const fa_rnn_args *a, fa_rnn_split *sp, int64_t prefer, double *scratch);

/* Number of gates G for a cell (0 for an unknown cell). */
int fa_rnn_gates(int cell);

/* Returns 0, or FA_RNN_EINVAL (bad cell, empty size, no gemm for the case). */
int fa_rnn_f32(const fa_rnn_args *a, int64_t b0, int64_t b1, float *scratch);
int fa_rnn_f64(const fa_rnn_args *a, int64_t b0, int64_t b1, double *scratch);

#endif
