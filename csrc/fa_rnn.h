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
    int simd;                     /* the caller's SIMD level: 0 none, 1 AVX2/FMA, 2 also AVX-512 */
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
    void *gates;                  /* or NULL: gh = h W_hh^T + b_hh of every real step saved,
                                     gates[b, t, g] at gates + b * gates_bs + t * gates_ts + g
                                     (padded steps not written), for the backward */
    int64_t gates_bs, gates_ts;
    /* h W_hh^T: float32 blocks of at most small_m rows use fa_proj_small_f32
     * (with simd); otherwise these Fortran-ABI gemms (scipy.linalg.cython_blas),
     * which the caller keeps at one thread.  G*H, H, B must fit in an int. */
    int64_t small_m;
    fa_sgemm_fn sgemm;
    fa_dgemm_fn dgemm;
    /* float32 with simd: W_hh's packed form (fa_proj_pack_f32 of the (G*H, H)
     * matrix), read by fa_proj_packed_f32 for every block's product; or NULL */
    const float *wpack;
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

/* ------------------------------------------------------------- backward
 * Backpropagation through time of fa_rnn_f32 / _f64 (csrc/fa_rnn_bwd.c): the
 * sequential dh (and LSTM dc) recurrence only.  The gates of every step are
 * recomputed elementwise from xw and the hidden pre-activations gh (which the
 * caller has: saved by the forward or recomputed with one GEMM over all
 * steps); per step the rows' gate gradients are written and
 * dh_prev = direct + d(hidden gates) W_hh is one product for the block's rows.
 * The weight gradients are left to the caller (one GEMM over all steps of
 * dgh and hprev).  With dL/dz for z = each gate's pre-activation:
 *   dxw[b, t] = dL/d(xw[b, t])  (zeros at padded steps)
 *   dgh[b, t] = dL/d(gh[b, t])  (GRU only: its n block is dxw's times r;
 *                                 for the other cells it equals dxw)
 * Steps past a row's length pass dh (and dc) through unchanged.
 *
 * Rows are independent: disjoint row blocks may run on different threads at
 * once.  A row's arithmetic depends only on the rows of its block (the
 * product's kernel groups them), so a partition fixed by the sizes gives the
 * same bits for any thread count.  The time loop can be cut into chunks of
 * steps (for KeyboardInterrupt): fa_rnn_bwd_* over steps [s0, s1) of the
 * backward order continues from dh / dc and the scratch the previous chunk
 * left, after one fa_rnn_bwd_cstate_* (LSTM: the cell states of every step). */
typedef struct {
    int cell;                     /* FA_RNN_* */
    int simd;                     /* SIMD level: 0 none, 1 AVX2/FMA, 2 also AVX-512 */
    int64_t B, T, H;              /* all >= 1 */
    const void *xw;               /* xw[b, t, g] at xw + b * xw_bs + t * xw_ts + g */
    int64_t xw_bs, xw_ts;
    const void *gh;               /* (B, T, G*H) C-contiguous: h_{t-1} W_hh^T (+ b_hh) */
    const void *bhh;              /* (G*H,) added to gh (gh without the bias), or NULL */
    const void *hprev;            /* (B, T, H) C-contiguous: the state step t started from */
    const void *c0;               /* LSTM: (B, H) C-contiguous initial cell state, or NULL: 0 */
    const void *go;               /* dL/d(out[b, t, j]) at go + b * go_bs + t * go_ts + j, or NULL */
    int64_t go_bs, go_ts;
    const void *whh;              /* (G*H, H), row stride ldw >= H (the gemm path) */
    int64_t ldw;
    const float *wpack;           /* float32: W_hh^T packed (fa_proj_pack_t_panels_f32 of W_hh,
                                     for fa_proj.c's AVX2 kernel), or NULL: sgemm */
    const int64_t *lengths;       /* (B,) values in [0, T], or NULL: all T */
    int reverse;                  /* 1: the forward walked t = T-1 .. 0 */
    void *dxw;                    /* (B, T, G*H) C-contiguous, written */
    void *dgh;                    /* GRU: (B, T, G*H) C-contiguous, written; others NULL */
    void *dh;                     /* (B, H) C-contiguous: dL/dh_T in, dL/dh_0 out */
    void *dc;                     /* LSTM: (B, H) C-contiguous: dL/dc_T in, dL/dc_0 out */
    double *db;                   /* or NULL: (B, G*H) -- row block [b0, b1) adds the sums of its
                                     rows of dgh over its steps into row b0 (zeroed by the caller),
                                     in float64; dL/db_hh is the sum of the blocks' rows */
    fa_sgemm_fn sgemm;            /* the products without wpack; one thread (the caller's
                                     hold) */
    fa_dgemm_fn dgemm;
} fa_rnn_bwd_args;

/* Scratch elements a block of `rows` rows needs (kept between chunks). */
int64_t fa_rnn_bwd_scratch(int cell, int64_t rows, int64_t T, int64_t H);
/* LSTM only, once before the steps: the cell state after every step of rows
 * [b0, b1) into the block's scratch.  Other cells: no-op. */
int fa_rnn_bwd_cstate_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, float *scratch);
int fa_rnn_bwd_cstate_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, double *scratch);
/* Steps [s0, s1) of the backward order (s = 0 is the forward's last step) for
 * rows [b0, b1).  Returns 0 or FA_RNN_EINVAL. */
int fa_rnn_bwd_f32(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                   float *scratch);
int fa_rnn_bwd_f64(const fa_rnn_bwd_args *a, int64_t b0, int64_t b1, int64_t s0, int64_t s1,
                   double *scratch);

#endif
