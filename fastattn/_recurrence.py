"""``rnn_scan``: the time loop of one RNN layer and direction, in compiled code.

The layers (:mod:`fastattn.layers.rnn`) compute the input projections of all
time steps with one GEMM (:func:`fastattn.functional.linear`) and hand the
recurrence to this function, which runs every step in C (csrc/fa_rnn.c) with
the GIL released: per step one product ``h W_hhᵀ`` over the batch rows (the
few-row AVX2 kernel for float32, BLAS otherwise) and the gates with
fastattn's own vectorised exp and tanh.  Batch rows are split into blocks that
run on fastattn's worker pool, each block through the whole sequence.

Measured on this project's 2-core machine, in one interleaved A/B run against
the Python loop of NumPy calls this replaced (GRU encoder, E = H = 256, T = 64,
float32, 2 threads, ``Seq2Seq.encode``, median ms): B = 1 3.2 -> 0.9-1.0,
B = 32 22.6 -> 14.2-15.3; a B = 1 decoder step (``rnn_cell``, additive
attention) 0.27 -> 0.14.  benchmarks/test_bench_seq2seq.py has the model.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _alloc, _proj, _rnn, _threads
from ._linear import _dtypes, _matmul, _packed_product, linear, linear_backward
from ._validation import (BLAS_INT_MAX, as_array, canonical_matrix_stack, check_float_kind,
                          check_grad_array, grad_dtype)

__all__ = ["rnn_scan", "rnn_scan_backward", "rnn_cell", "rnn_cell_backward", "RNN_CELLS"]

#: cell name -> number of gates
RNN_CELLS = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_runtime_done = False
#: rnn_scan_backward's dL/dW_hh: float32 products over runs of this many rows
#: (batch rows x steps), summed in float64 (float32 rms error vs the float64
#: oracle, GRU B=16 T=48 H=64 / B=32 T=64 H=256: torch 3.1e-7 / 9.0e-7; one
#: sgemm over all rows 5.8e-7 / 9.8e-7; runs of 64 2.8e-7 / 4.4e-7, of 128
#: 3.6e-7 / 5.8e-7, from float64-exact dgh)
DW_CHUNK = 64
#: the same product on the packed kernel (float32 throughout: each run summed
#: from zero, the runs added in order in float32) in runs of this many rows:
#: rms error against the float64 oracle over torch float32 autograd's, GRU
#: dW_hh, B x T x H = 16x48x64 / 32x64x256 / 32x32x256: runs of 16 1.05 / 1.20 /
#: 1.13, of 32 1.01 / 1.06 / 1.07 (max error 0.85 / 0.79 / 1.01), of 64 1.08 /
#: 1.06 / 1.13, of 128 1.29 / 1.20 / 1.32
DW_PACKED_RUNS = 32


def _ensure_runtime():
    """_rnn on fastattn's pool, BLAS hold and SIMD switch (C addresses, once)."""
    global _runtime_done
    if _runtime_done:
        return
    _threads.install_runtime(_rnn.set_runtime)
    _threads.ensure_blas_hook()
    _runtime_done = True


def _array(x, name):
    a = x if isinstance(x, np.ndarray) else as_array(x, name)
    check_float_kind(a, name)
    return a


def _cell_state(c, name, cell, B, H, arrays):
    """The LSTM cell state argument ``name`` checked as a (B, H) float array
    (appended to ``arrays``), or None; any other cell refuses one."""
    if cell != "lstm":
        if c is not None:
            raise ValueError(f"{name}: only an LSTM has a cell state, got one for cell {cell!r}")
        return None
    if c is None:
        return None
    c = _array(c, name)
    if c.shape != (B, H):
        raise ValueError(f"{name}: expected shape ({B}, {H}) (B, H), got {c.shape}")
    arrays.append(c)
    return c


class _ScanArgs(NamedTuple):
    xw: np.ndarray
    w: np.ndarray
    b: object
    h: np.ndarray
    c: object
    lens: object
    B: int
    T: int
    H: int
    GH: int
    nt: int
    ct: np.dtype
    rdt: np.dtype
    arrays: list


def _scan_args(xw, w_hh, b_hh, h0, cell, c0, lengths, reverse, n_threads) -> _ScanArgs:
    """rnn_scan's argument checks (shared with rnn_scan_backward)."""
    if not isinstance(cell, str) or cell not in RNN_CELLS:
        raise ValueError(f"cell: expected one of {sorted(RNN_CELLS)}, got {cell!r}")
    G = RNN_CELLS[cell]
    xw = _array(xw, "xw")
    w = _array(w_hh, "w_hh")
    h = _array(h0, "h0")
    if xw.ndim != 3:
        raise ValueError(f"xw: expected a 3-d array (B, T, G*H), got shape {xw.shape}")
    if w.ndim != 2:
        raise ValueError(f"w_hh: expected a 2-d array (G*H, H), got shape {w.shape}")
    B, T, GH = xw.shape
    H = w.shape[1]
    if w.shape[0] != G * H:
        raise ValueError(f"w_hh: expected shape ({G} * H, H) for cell {cell!r}, got {w.shape}")
    if GH != G * H:
        raise ValueError(f"xw: expected last dim {G * H} (= w_hh's rows), got shape {xw.shape}")
    if h.shape != (B, H):
        raise ValueError(f"h0: expected shape ({B}, {H}) (B, H), got {h.shape}")
    arrays = [xw, w, h]
    b = None
    if b_hh is not None:
        b = _array(b_hh, "b_hh")
        if b.shape != (G * H,):
            raise ValueError(f"b_hh: expected shape ({G * H},), got {b.shape}")
        arrays.append(b)
    c = _cell_state(c0, "c0", cell, B, H, arrays)
    lens = None
    if lengths is not None:
        la = as_array(lengths, "lengths")
        if la.dtype.kind not in "iu":
            raise TypeError(f"lengths: expected integers, got dtype {la.dtype}")
        if la.shape != (B,):
            raise ValueError(f"lengths: expected shape ({B},) (one length per batch item), got {la.shape}")
        if la.size and (la.min() < 0 or la.max() > T):
            raise ValueError(f"lengths: expected values in [0, {T}], got values in [{la.min()}, {la.max()}]")
        lens = np.ascontiguousarray(la, dtype=np.int64)
    if not isinstance(reverse, (bool, np.bool_)):
        raise TypeError(f"reverse: expected a bool, got {type(reverse).__name__}")
    nt = _threads.resolve(n_threads)
    ct, rdt = _dtypes(*arrays)
    # before anything of the size of the outputs is allocated
    if B and T and H:
        _check_blas_sizes("xw", xw.shape, (("B", B), ("G * H", GH), ("H", H)))
    return _ScanArgs(xw, w, b, h, c, lens, B, T, H, GH, nt, ct, rdt, arrays)


@_alloc.cached
def rnn_scan(xw, w_hh, b_hh, h0, *, cell="gru", c0=None, lengths=None, reverse=False,
             return_outputs=True, return_gates=False, n_threads=None):
    """Run the recurrence of one RNN layer and direction over all time steps.

    Parameters
    ----------
    xw : (B, T, G*H) float array
        The input projections ``x W_ihᵀ + b_ih`` of every step (G gates: 1 for
        ``"rnn_tanh"`` / ``"rnn_relu"``, 3 for ``"gru"`` (r, z, n), 4 for
        ``"lstm"`` (i, f, g, o), torch's order).
    w_hh : (G*H, H); b_hh : (G*H,) or None
    h0 : (B, H) initial hidden state; c0 : (B, H) initial cell state (LSTM
        only; zeros when omitted).
    lengths : optional (B,) integers in [0, T]: a row's state stops changing
        after its last real step and its outputs there are 0
        (``pack_padded_sequence`` semantics; with ``reverse`` the row starts at
        its last real step).
    reverse : walk t = T-1 .. 0 (the backward direction of a bidirectional RNN).
    return_outputs : False skips writing the (B, T, H) outputs.
    return_gates : True also returns the hidden pre-activations
        ``h_{t-1} W_hhᵀ + b_hh`` of every step, (B, T, G*H), zeros at padded
        steps: hand them to :func:`rnn_scan_backward` (``gates=``), which then
        skips recomputing them (one GEMM over all steps) -- for training, at
        the cost of keeping B*T*G*H numbers.

    Returns ``(outputs (B, T, H) or None, h_T (B, H), c_T (B, H) or None)``,
    and the gates as a fourth element with ``return_gates``; float32 when
    every float argument is float32, float64 otherwise (float16 arguments are
    computed in float32; all float16 gives float16 results).  Inputs are never
    modified.  Equations: torch's (see csrc/fa_rnn.h).
    """
    xw, w, b, h, c, lens, B, T, H, GH, nt, ct, rdt, _ = _scan_args(
        xw, w_hh, b_hh, h0, cell, c0, lengths, reverse, n_threads)
    if not isinstance(return_gates, (bool, np.bool_)):
        raise TypeError(f"return_gates: expected a bool, got {type(return_gates).__name__}")
    gates = np.zeros((B, T, GH), ct) if return_gates else None

    # the state is copied (never modified in place) and is where the final one lands
    h = np.array(h, dtype=ct, order="C", copy=True)
    if cell == "lstm":
        c = np.zeros((B, H), ct) if c is None else np.array(c, dtype=ct, order="C", copy=True)
    out = np.zeros((B, T, H), ct) if return_outputs else None
    if B == 0 or T == 0 or H == 0:
        return _scan_result(out, h, c, gates, rdt)
    # the kernel takes element strides: each a multiple of the item size
    xc = _step_rows(xw.astype(ct, copy=False))
    # rows BLAS can address: positive row stride within its 32-bit leading dimensions
    wc = canonical_matrix_stack(w, ct)
    bc = None if b is None else np.ascontiguousarray(b, dtype=ct)
    _ensure_runtime()
    _rnn.scan(_rnn.CELLS[cell], xc, wc, bc, h, c, out, lens, bool(reverse), nt, gates)
    return _scan_result(out, h, c, gates, rdt)


def _scan_result(out, h, c, gates, rdt):
    res = (_as(out, rdt), _as(h, rdt), _as(c, rdt))
    return res if gates is None else res + (_as(gates, rdt),)


@_alloc.cached
def rnn_scan_backward(grad_outputs, grad_h_n, xw, w_hh, b_hh, h0, outputs, *, cell="gru",
                      c0=None, grad_c_n=None, lengths=None, reverse=False, gates=None,
                      n_threads=None):
    """Backpropagation through time of :func:`rnn_scan`.

    Parameters
    ----------
    grad_outputs : (B, T, H) or None
        dL/d(outputs) (None: the outputs were not used; padded steps' entries
        are ignored, as those outputs are constant zeros).
    grad_h_n : (B, H) or None
        dL/d(h_T), the final hidden state (None: zeros).
    xw, w_hh, b_hh, h0, cell, c0, lengths, reverse
        The forward's arguments, unchanged.
    outputs : (B, T, H)
        The forward's outputs: the hidden state after each step, from which
        every step's gates are recomputed with one product over all steps.
    grad_c_n : (B, H) or None
        dL/d(c_T) (LSTM only).
    gates : (B, T, G*H) or None
        The forward's gates (``rnn_scan(..., return_gates=True)``): the hidden
        products are then not recomputed.

    Returns
    -------
    ``(dxw, dw_hh, db_hh, dh0, dc0)``: the gradients of xw (B, T, G*H; zeros
    at padded steps), w_hh, b_hh (None without b_hh), h0 and c0 (LSTM; None
    otherwise), in their inputs' shapes and dtypes (non-float inputs: the
    compute dtype), all computed in the compute dtype.

    The hidden products ``h_{t-1} W_hhᵀ`` of every step are the forward's
    ``gates`` or recomputed from ``outputs`` with one GEMM over all steps; the sequential ``dh`` (and LSTM
    ``dc``) recurrence runs in C (csrc/fa_rnn_bwd.c, GIL released): per step
    the gate gradients elementwise (AVX2) and one ``(rows, G*H) x (G*H, H)``
    product for a block of batch rows, the blocks on fastattn's worker pool;
    the weight gradient is then one GEMM over all steps (float32: on the
    packed kernel in runs of ``DW_PACKED_RUNS`` rows, as accurate as torch's
    per-step accumulation: see there).  Deterministic: the
    row blocks and every summation order are fixed by the shapes, so any
    ``n_threads`` gives the same bits.
    """
    a = _scan_args(xw, w_hh, b_hh, h0, cell, c0, lengths, reverse, n_threads)
    B, T, H, GH, ct = a.B, a.T, a.H, a.GH, a.ct
    o = _array(outputs, "outputs")
    if o.shape != (B, T, H):
        raise ValueError(f"outputs: expected shape {(B, T, H)} (the forward's outputs), got {o.shape}")
    grads_in = {}
    for name, g_, shape in (("grad_outputs", grad_outputs, (B, T, H)), ("grad_h_n", grad_h_n, (B, H)),
                            ("grad_c_n", grad_c_n, (B, H))):
        if g_ is None:
            grads_in[name] = None
            continue
        if name == "grad_c_n" and cell != "lstm":
            raise ValueError(f"grad_c_n: only an LSTM has a cell state (cell {cell!r})")
        grads_in[name] = check_grad_array(g_, name, shape).astype(ct, copy=False)
    if gates is not None:
        gates = check_grad_array(gates, "gates", (B, T, GH))
    # dL/dh and dL/dc flow backwards through these (copies: inputs are never modified)
    dh = np.zeros((B, H), ct) if grads_in["grad_h_n"] is None else np.array(
        grads_in["grad_h_n"], dtype=ct, order="C", copy=True)
    dc = None
    if cell == "lstm":
        dc = np.zeros((B, H), ct) if grads_in["grad_c_n"] is None else np.array(
            grads_in["grad_c_n"], dtype=ct, order="C", copy=True)
    bh = None if a.b is None else np.ascontiguousarray(a.b, dtype=ct)
    if B == 0 or T == 0 or H == 0:   # no step runs: every gradient passes straight through
        dxw = np.zeros((B, T, GH), ct)
        dW = np.zeros((GH, H), ct)
        db = None if bh is None else np.zeros(GH, ct)
        return _grads_back(dxw, dW, db, dh, dc, xw, w_hh, b_hh, h0, c0, cell, ct)
    xwd = _step_rows(a.xw.astype(ct, copy=False))
    W = canonical_matrix_stack(a.w, ct)
    hprev = _states_before(o.astype(ct, copy=False), a.h.astype(ct, copy=False), a.lens, reverse)
    if gates is not None:   # the forward's, b_hh included
        gh, bgh = _contig(gates, ct), None
    else:
        # every step's hidden products at once, on fastattn's pool (tiles fixed
        # by the shapes: the same bits for any thread count); b_hh added in C
        gh, bgh = _matmul(hprev.reshape(B * T, H), W.T, ct, a.nt).reshape(B, T, GH), bh
    go = grads_in["grad_outputs"]
    if go is not None:
        go = _step_rows(go)
    c0c = None if (cell != "lstm" or a.c is None) else _contig(a.c, ct)
    dxw = np.empty((B, T, GH), ct)
    dgh = np.empty((B, T, GH), ct) if cell == "gru" else None
    # dL/db_hh: each row block's sums in float64 (in C), then the blocks' in order
    dbb = None if bh is None else np.zeros((B, GH), np.float64)
    _ensure_runtime()
    _rnn.scan_backward(_rnn.CELLS[cell], xwd, gh, bgh, hprev, c0c, go, W, a.lens, bool(reverse),
                       dxw, dgh, dh, dc, dbb, a.nt)
    db = None if dbb is None else dbb.sum(axis=0).astype(ct)
    # dL/dW_hh = sum over every row and step of dgh^T h_prev: one product over
    # all B*T rows after the loop, float32 in short runs (as a per-step
    # autograd's) at a large gemm's speed (_weight_product; padded steps have
    # zero dgh and a zeroed h_prev)
    if a.lens is not None:
        hprev[np.arange(T)[None, :] >= a.lens[:, None]] = 0
    dg2 = (dxw if dgh is None else dgh).reshape(B * T, GH)
    dW = _weight_product(dg2, hprev.reshape(B * T, H), ct, a.nt)
    return _grads_back(dxw, dW, db, dh, dc, xw, w_hh, b_hh, h0, c0, cell, ct)


class _SteppedScan:
    """One RNN layer stepped one step a call over ``T`` steps with the same
    weights, for training (AttentionDecoder's Bahdanau loop: the score of step
    t reads the state of step t - 1, so the cells cannot run as one scan).

    Each :meth:`forward` is :func:`rnn_scan` over T = 1 with
    ``return_gates=True`` and each :meth:`backward` is
    :func:`rnn_scan_backward` over T = 1 with those gates, the same floats,
    without their per-call costs: the arguments are checked here once, W_hh
    is packed here once for both directions' products (the calls would pack
    it on every call) and the backward leaves the weight gradients to
    :meth:`weight_grads`, one product over all the steps' rows (as
    rnn_scan_backward computes them for a whole sequence, :func:`_weight_product`;
    dL/db_hh summed in float64 over every step) instead of a product and a float32 sum per step.

    Internal: the caller (fastattn.layers.seq2seq) hands arrays of the shapes
    and compute dtype given here, made by itself; ``w_hh`` and ``b_hh`` must
    not change while the object is used (the packed copies would be stale).
    """

    def __init__(self, w_hh, b_hh, cell, B, T, ct, n_threads=None):
        G = RNN_CELLS[cell]
        H = w_hh.shape[1]
        a = _scan_args(np.zeros((B, 1, G * H), ct), w_hh, b_hh, np.zeros((B, H), ct), cell,
                       np.zeros((B, H), ct) if cell == "lstm" else None, None, False, n_threads)
        if a.ct != ct:
            raise TypeError(f"w_hh: expected compute dtype {ct}, got {a.ct}")
        self.cell, self.code, self.B, self.T, self.H, self.GH = cell, _rnn.CELLS[cell], B, T, H, G * H
        self.ct, self.nt = ct, a.nt
        self.w = canonical_matrix_stack(a.w, ct)
        self.b = None if a.b is None else np.ascontiguousarray(a.b, dtype=ct)
        _ensure_runtime()
        self.pack_f = _rnn.pack_recurrent(self.w, False) if ct == _F32 else None
        self.pack_b = _rnn.pack_recurrent(self.w, True) if ct == _F32 else None
        # per step (index t): the products' left factors and the states they met
        self._dg = np.zeros((T, B, self.GH), ct)
        self._hp = np.zeros((T, B, H), ct)
        self._db = None if self.b is None else np.zeros((B, self.GH), np.float64)

    def forward(self, xw3, h, c=None):
        """xw3 (B, 1, G*H), h (B, H) (c: LSTM) -> ``(out (B, 1, H), h1, c1 or
        None, gates (B, 1, G*H))`` as rnn_scan(..., return_gates=True)."""
        B, H, ct = self.B, self.H, self.ct
        gates = np.zeros((B, 1, self.GH), ct)
        h1 = np.array(h, dtype=ct, order="C", copy=True)
        c1 = None
        if self.cell == "lstm":
            c1 = np.zeros((B, H), ct) if c is None else np.array(c, dtype=ct, order="C", copy=True)
        out = np.zeros((B, 1, H), ct)
        _rnn.scan(self.code, _step_rows(xw3), self.w, self.b, h1, c1, out, None, False, self.nt,
                  gates, self.pack_f)
        return out, h1, c1, gates

    def start_backward(self):
        """Before a backward pass over the steps (each pass sums its own db_hh)."""
        if self._db is not None:
            self._db[...] = 0

    def backward(self, t, grad_out3, grad_h, xw3, h_prev, gates, c_prev=None, grad_c=None):
        """Step ``t``'s rnn_scan_backward (its forward's xw3, h_prev, gates and
        c_prev; grad_out3 (B, 1, H), grad_h (B, H), grad_c LSTM or None) ->
        ``(dxw (B, 1, G*H), dh_prev, dc_prev or None)``; the step's share of
        dW_hh and db_hh is kept for :meth:`weight_grads` (a pass over the steps
        starts with :meth:`start_backward`)."""
        B, H, ct = self.B, self.H, self.ct
        dh = np.array(grad_h, dtype=ct, order="C", copy=True)
        dc = None
        if self.cell == "lstm":
            dc = np.zeros((B, H), ct) if grad_c is None else np.array(grad_c, dtype=ct, order="C",
                                                                        copy=True)
        hp = self._hp[t]
        hp[...] = h_prev
        dxw = np.empty((B, 1, self.GH), ct)
        gru = self.cell == "gru"
        dgh = self._dg[t].reshape(B, 1, self.GH) if gru else None
        c0c = None if (self.cell != "lstm" or c_prev is None) else _contig(c_prev, ct)
        _rnn.scan_backward(self.code, _step_rows(xw3), _contig(gates, ct), None,
                           hp.reshape(B, 1, H), c0c, _step_rows(grad_out3), self.w, None, False,
                           dxw, dgh, dh, dc, self._db, self.nt, self.pack_b)
        if not gru:
            self._dg[t] = dxw[:, 0]
        return dxw, dh, dc

    def weight_grads(self):
        """``(dW_hh (G*H, H), db_hh (G*H,) or None)`` over every step's backward."""
        n = self.T * self.B
        dW = _weight_product(self._dg.reshape(n, self.GH), self._hp.reshape(n, self.H), self.ct,
                             self.nt)
        db = None if self._db is None else self._db.sum(axis=0).astype(self.ct)
        return dW, db


def _weight_product(dg, hprev, ct, nt):
    """dL/dW_hh = dg (rows, G*H)ᵀ hprev (rows, H): float32 on the packed
    projection kernel, dg read transposed block by block, the reduction in runs
    of :data:`DW_PACKED_RUNS` rows added in order in float32 (2.6 ms where
    ``_matmul``'s float64-summed runs of :data:`DW_CHUNK` took 6.3, 1024 rows x
    768 x 256, 2 threads); otherwise ``_matmul`` with those runs.  Either way
    the same bits for any thread count."""
    rows, GH = dg.shape
    H = hprev.shape[1]
    if ct == _F32 and rows and _proj.packs_transposed(GH, H, rows):
        return _packed_product(np.ascontiguousarray(dg), np.ascontiguousarray(hprev),
                               np.empty((GH, H), ct), nt, a_transposed=True, runs=DW_PACKED_RUNS)
    return _matmul(dg.T, hprev, ct, nt, kc=DW_CHUNK)


def _grads_back(dxw, dW, db, dh, dc, xw, w_hh, b_hh, h0, c0, cell, ct):
    """rnn_scan_backward's results in their inputs' dtypes."""
    def back(g_, x):
        return None if g_ is None else g_.astype(grad_dtype(x, ct), copy=False)

    return (back(dxw, xw), back(dW, w_hh), back(db, b_hh), back(dh, h0),
            back(dc, c0 if c0 is not None else np.zeros(0, ct)) if cell == "lstm" else None)


def _step_rows(x):
    """A (B, T, n) array as the kernels read one: element strides (multiples of
    the item size), the last axis contiguous, aligned (a copy otherwise)."""
    if (x.strides[2] != x.itemsize or not x.flags.aligned
            or any(st % x.itemsize for st in x.strides)):
        return np.ascontiguousarray(x)
    return x


def _states_before(out, h0, lens, reverse):
    """(B, T, H): the state each step started from, in the forward's order (h0
    at a row's first step; with ``reverse`` that is its last real step)."""
    B, T, H = out.shape
    hprev = np.empty((B, T, H), out.dtype)
    if reverse:
        hprev[:, :-1] = out[:, 1:]
        hprev[:, -1] = h0
        if lens is not None:
            hprev[np.arange(B), np.clip(lens - 1, 0, None)] = h0
    else:
        hprev[:, 1:] = out[:, :-1]
        hprev[:, 0] = h0
    return hprev


@_alloc.cached
def rnn_cell(x, h, w_ih, b_ih, w_hh, b_hh, *, cell="gru", c=None, n_threads=None):
    """One step of an RNN cell for a batch: both products and the gates in one call.

    x : (B, I) inputs; h : (B, H) previous hidden state; w_ih : (G*H, I),
    b_ih : (G*H,) or None; w_hh : (G*H, H), b_hh : (G*H,) or None; c : (B, H)
    previous cell state (LSTM only; zeros when omitted).  Gates and equations
    as in :func:`rnn_scan`.

    Returns ``(h', c')`` (``c'`` None except for LSTM), new arrays, dtypes
    as for :func:`rnn_scan`.  The hidden units
    are split into blocks across fastattn's threads, each block reading only
    its own rows of the weights -- for a decoder step at B = 1 that is what
    lets two cores share the reading of the weights.
    """
    if (cell == "gru" and c is None and n_threads is None and type(x) is np.ndarray
            and type(h) is np.ndarray and type(w_ih) is np.ndarray and type(w_hh) is np.ndarray
            and type(b_ih) is np.ndarray and type(b_hh) is np.ndarray):
        r = _gru_plain(x, h, w_ih, b_ih, w_hh, b_hh)
        if r is not None:
            return r, None
    if not isinstance(cell, str) or cell not in RNN_CELLS:
        raise ValueError(f"cell: expected one of {sorted(RNN_CELLS)}, got {cell!r}")
    G = RNN_CELLS[cell]
    x = _array(x, "x")
    h = _array(h, "h")
    wi = _array(w_ih, "w_ih")
    wh = _array(w_hh, "w_hh")
    if h.ndim != 2:
        raise ValueError(f"h: expected a 2-d array (B, H), got shape {h.shape}")
    B, H = h.shape
    if wh.shape != (G * H, H):
        raise ValueError(f"w_hh: expected shape ({G * H}, {H}) (G * H, H) for cell {cell!r}, got {wh.shape}")
    if x.ndim != 2 or x.shape[0] != B:
        raise ValueError(f"x: expected shape ({B}, I) (B, input size), got {x.shape}")
    In = x.shape[1]
    if wi.shape != (G * H, In):
        raise ValueError(f"w_ih: expected shape ({G * H}, {In}) (G * H, input size), got {wi.shape}")
    arrays = [x, h, wi, wh]
    bs = []
    for name, bb in (("b_ih", b_ih), ("b_hh", b_hh)):
        if bb is None:
            bs.append(None)
            continue
        bb = _array(bb, name)
        if bb.shape != (G * H,):
            raise ValueError(f"{name}: expected shape ({G * H},), got {bb.shape}")
        arrays.append(bb)
        bs.append(bb)
    c = _cell_state(c, "c", cell, B, H, arrays)
    nt = _threads.resolve(n_threads)
    ct, rdt = _dtypes(*arrays)
    # before anything of the size of the state is copied or allocated
    if B and H:
        _check_blas_sizes("x", x.shape, (("B", B), ("G * H", G * H), ("I", In)))
    h0 = _contig(h, ct)
    c0 = None
    if cell == "lstm":
        c0 = np.zeros((B, H), ct) if c is None else _contig(c, ct)
    if B == 0 or H == 0:
        return _as(h0.copy(), rdt), (None if c0 is None else _as(c0.copy(), rdt))
    h1 = np.empty((B, H), ct)
    c1 = None if c0 is None else np.empty((B, H), ct)
    if In == 0:  # no input features: x W_ih^T is zero
        x = np.zeros((B, 1), ct)
        wi = np.zeros((G * H, 1), ct)
    bic = None if bs[0] is None else _contig(bs[0], ct)
    bhc = None if bs[1] is None else _contig(bs[1], ct)
    if not _runtime_done:
        _ensure_runtime()
    _rnn.cell(_rnn.CELLS[cell], _rows(x, ct), _rows(wi, ct), bic, _rows(wh, ct), bhc, h0, c0, h1, c1, nt)
    return _as(h1, rdt), _as(c1, rdt)


@_alloc.cached
def rnn_cell_backward(grad_h, x, h, w_ih, b_ih, w_hh, b_hh, *, cell="gru", c=None,
                      grad_c=None, n_threads=None):
    """Gradients of :func:`rnn_cell` (one step).

    grad_h : (B, H) dL/d(h'); grad_c : (B, H) dL/d(c') or None (LSTM only);
    the other arguments are the forward's, unchanged.  Returns ``(dx, dh,
    dw_ih, db_ih, dw_hh, db_hh, dc)`` (``db_*`` None without that bias, ``dc``
    None except for LSTM), in the inputs' shapes and dtypes.  The step is one
    step of :func:`rnn_scan` on the input projection ``x W_ihᵀ + b_ih``:
    its backward is :func:`rnn_scan_backward` over one step, then
    :func:`fastattn.functional.linear_backward` for the input projection.
    """
    h1, _ = rnn_cell(x, h, w_ih, b_ih, w_hh, b_hh, cell=cell, c=c, n_threads=n_threads)
    xw = linear(x, w_ih, b_ih, n_threads=n_threads)
    gh = check_grad_array(grad_h, "grad_h", np.shape(h1))
    if grad_c is not None and cell != "lstm":
        raise ValueError(f"grad_c: only an LSTM has a cell state (cell {cell!r})")
    dxw, dw_hh, db_hh, dh, dc = rnn_scan_backward(
        None, gh, xw[:, None], w_hh, b_hh, h, h1[:, None], cell=cell, c0=c, grad_c_n=grad_c,
        n_threads=n_threads)
    dx, dw_ih, db_ih = linear_backward(dxw[:, 0], x, w_ih, b_ih, n_threads=n_threads)
    return dx, dh, dw_ih, db_ih, dw_hh, db_hh, dc


def _gru_plain(x, h, wi, bi, wh, bh):
    """rnn_cell's common case (a decoder step): float32 GRU, C-contiguous arrays,
    consistent shapes -> h', with the same kernel call; None: take the general path."""
    f = _F32
    if not (x.dtype == f and h.dtype == f and wi.dtype == f and wh.dtype == f and bi.dtype == f
            and bh.dtype == f and x.ndim == 2 and h.ndim == 2 and x.flags.c_contiguous
            and h.flags.c_contiguous and wi.flags.c_contiguous and wh.flags.c_contiguous
            and bi.flags.c_contiguous and bh.flags.c_contiguous and x.flags.aligned
            and h.flags.aligned and wi.flags.aligned and wh.flags.aligned and bi.flags.aligned
            and bh.flags.aligned):
        return None
    B, H = h.shape
    GH = 3 * H
    if (B == 0 or H == 0 or x.shape[0] != B or x.shape[1] == 0 or wh.shape != (GH, H)
            or wi.shape != (GH, x.shape[1]) or bi.shape != (GH,) or bh.shape != (GH,)
            or max(GH, B, x.shape[1]) > BLAS_INT_MAX):
        return None
    if not _runtime_done:
        _ensure_runtime()
    h1 = np.empty((B, H), f)
    _rnn.cell(2, x, wi, bi, wh, bh, h, None, h1, None, _threads.resolve(None))
    return h1


def _as(a, rdt):
    return a if a is None or a.dtype == rdt else a.astype(rdt)


def _check_blas_sizes(name, shape, sizes):
    """The sizes gemm is handed must fit its 32-bit ints (checked before any allocation)."""
    for what, n in sizes:
        if n > BLAS_INT_MAX:
            raise ValueError(
                f"{name}: {what}={n} exceeds the BLAS 32-bit integer range (max {BLAS_INT_MAX}), "
                f"got {name} of shape {shape}")


def _contig(a, ct):
    """a as an aligned C-contiguous array of dtype ct (itself when it already is one)."""
    if a.dtype == ct and a.flags.c_contiguous and a.flags.aligned:
        return a
    return np.array(a, dtype=ct, order="C")  # ascontiguousarray keeps unaligned memory


def _rows(a, ct):
    """a (n, k) in dtype ct with contiguous rows and a row stride BLAS can take
    (a multiple of the item size, within its 32-bit leading dimensions; a view
    when it already is)."""
    if a.dtype == ct and a.flags.c_contiguous and a.flags.aligned:
        return a
    return canonical_matrix_stack(a, ct)
