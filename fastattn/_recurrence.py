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

import numpy as np

from . import _rnn, _threads
from ._linear import _dtypes
from ._validation import BLAS_INT_MAX, as_array, canonical_matrix_stack, check_float_kind

__all__ = ["rnn_scan", "rnn_cell", "RNN_CELLS"]

#: cell name -> number of gates
RNN_CELLS = {"rnn_tanh": 1, "rnn_relu": 1, "gru": 3, "lstm": 4}
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_runtime_done = False


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


def rnn_scan(xw, w_hh, b_hh, h0, *, cell="gru", c0=None, lengths=None, reverse=False,
             return_outputs=True, n_threads=None):
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

    Returns ``(outputs (B, T, H) or None, h_T (B, H), c_T (B, H) or None)``,
    float32 when every float argument is float32, float64 otherwise (float16
    arguments are computed in float32; all float16 gives float16 results).  Inputs
    are never modified.  Equations: torch's (see csrc/fa_rnn.h).
    """
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

    # the state is copied (never modified in place) and is where the final one lands
    h = np.array(h, dtype=ct, order="C", copy=True)
    if cell == "lstm":
        c = np.zeros((B, H), ct) if c is None else np.array(c, dtype=ct, order="C", copy=True)
    out = np.zeros((B, T, H), ct) if return_outputs else None
    if B == 0 or T == 0 or H == 0:
        return _as(out, rdt), _as(h, rdt), _as(c, rdt)
    xc = xw.astype(ct, copy=False)
    # the kernel takes element strides: each a multiple of the item size
    if (xc.strides[2] != xc.itemsize or not xc.flags.aligned
            or any(st % xc.itemsize for st in xc.strides)):
        xc = np.ascontiguousarray(xc)
    # rows BLAS can address: positive row stride within its 32-bit leading dimensions
    wc = canonical_matrix_stack(w, ct)
    bc = None if b is None else np.ascontiguousarray(b, dtype=ct)
    _ensure_runtime()
    _rnn.scan(_rnn.CELLS[cell], xc, wc, bc, h, c, out, lens, bool(reverse), nt)
    return _as(out, rdt), _as(h, rdt), _as(c, rdt)


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
