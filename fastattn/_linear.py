"""``linear(x, weight, bias=None)``: ``x Wᵀ + b``, the one GEMM door of the layers,
and its backward ``linear_backward`` (``dx``, ``dweight``, ``dbias``; products on
:func:`fastattn._proj.matmul`, the same bits for any thread count).

The RNN input and recurrent projections, Linear and the decoder's key
projections all come through here.  Products run on the multi-head
projection kernel (:mod:`fastattn._proj`): fastattn's worker pool with BLAS
held at one thread per worker, few-row products split by output columns so
that a 32-row GRU step uses both cores, and float32 blocks of up to 128 rows
on the AVX2 few-row kernel (weights read in place, not packed).  Tiny
products stay with NumPy's matmul where it was measured to be faster.

Measured on this project's 2-core machine (float32 and float64, in=256 ->
out=768, min of 300 calls, 2 threads, microseconds; "numpy" is
``np.matmul(x, w.T) + b``, "fused" the fused additive path's projection that
``linear`` used above 16 rows before, which hands out blocks of 128 rows so
everything up to 128 rows ran on one thread, "_proj" this module's path)::

    rows               1      4     16     24     32    128
    f32 numpy       16.4   58.8   61.6   80.9   96.7  315.1
    f32 fused          -      -      -  208.1  241.6  630.7
    f32 _proj       19.3   22.4   40.4   59.4   83.2  311.1
    f64 numpy       31.0  128.7  164.2  170.4  179.3  615.6
    f64 fused          -      -      -  268.9  338.3 1149.1
    f64 _proj       89.7  125.2  103.5  140.3  175.1  620.6

(a second run: f32 1 row numpy 20.0 / _proj 20.1 us.)  linear() before -> after
this dispatch, with another process busy on one core (two runs, min of 300)::

    rows                 1      4     16     32    128
    f32 run 1 before  24.0   66.5   78.2  245.1  635.1
    f32 run 1 after   20.9   29.4   51.1  171.9  329.1
    f32 run 2 before  19.7 3990.2   64.1  244.7  631.8
    f32 run 2 after   20.6   29.7   85.4  163.9  641.6
    f64 run 1 before  34.6  141.9  188.4  344.4 1180.5
    f64 run 1 after   34.6  132.8  124.0  353.4 1218.8
    f64 run 2 before  33.2  134.4 11998.6 336.5 1176.1
    f64 run 2 after   33.5  133.1  123.2  343.4 1197.2

(under that load 32 and 128 rows get about one core either way; the
4 ms / 12 ms "before" entries are NumPy's threaded OpenBLAS stalling, on
every one of the 300 calls.)

So NumPy keeps the
single-row float32 product and float64 products of up to 4 rows (dgemm packs
its operands; there is no float64 few-row kernel); without the AVX2 kernel
(``FASTATTN_DISABLE_SIMD`` or another CPU) float32 keeps NumPy up to 16 rows,
as before (sgemm-based blocks were 140-180 us there).  NumPy's own threaded
OpenBLAS is also what stalled 12 ms per 32-row GEMM while another process
held a core; fastattn's pool hands out blocks dynamically instead.
"""
from __future__ import annotations

import numpy as np

from . import _alloc, _proj, _rowwise, _threads
from ._validation import (BLAS_INT_MAX, as_array, canonical_matrix_stack, check_float_kind,
                          check_grad_array, grad_dtype)

#: rows up to which NumPy's matmul is used, by case (see the module docstring)
NUMPY_MAX_ROWS_F32 = 1        # float32 with the AVX2 few-row kernel
NUMPY_MAX_ROWS_F32_BLAS = 16  # float32 without it (sgemm blocks)
NUMPY_MAX_ROWS_F64 = 4
#: float32 products of one row with at least this many weights (N * K) go to the
#: few-row kernel on fastattn's threads instead of NumPy: one row is a pass over
#: the weights, and two cores read them about twice as fast (measured, one row,
#: 2 threads, microseconds, median of 1000: (1000, 256) numpy 25.4 / _proj 11.0;
#: (768, 512) 27.6 / 15.9; (768, 256) 17.2 / 8.4).  Same as _proj's threshold.
PARALLEL_MIN_WEIGHTS = 131072
#: products of at most this many multiply-adds (rows * N * K) stay with NumPy
#: whatever their row count: OpenBLAS runs them on the calling thread (its
#: threading starts at 4 * 65536), and fastattn's dispatch costs more than the
#: work (AMD EPYC Zen 3, AVX2, one thread, median of 300, microseconds: 60 x 64
#: -> 2 numpy 2.3 / _proj 13.5; 8 x 128 -> 64 7.2 / 13.6; the attention
#: pooling's second product is the first of these)
NUMPY_MAX_MACS = 65536
#: kept for callers of the previous name: the float32 limit without the AVX2 kernel
NUMPY_MAX_ROWS = NUMPY_MAX_ROWS_F32_BLAS

__all__ = ["linear", "linear_backward"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_F16 = np.dtype(np.float16)
_runtime_done = False


def _ensure_runtime():
    """_proj on fastattn's pool and BLAS hold (once)."""
    global _runtime_done
    if not _runtime_done:
        _threads.install_runtime(_proj.set_runtime)
        _threads.ensure_blas_hook()
        _runtime_done = True


def _dtypes(*arrays):
    """(compute dtype, result dtype): float32 when every array (None skipped) is
    float32 or float16, float64 otherwise; float16 results when all are float16
    (computed in float32), as the attention functions do."""
    all16 = True
    for a in arrays:
        if a is None:
            continue
        dt = a.dtype
        if dt != _F32 and dt != _F16:
            return _F64, _F64
        if dt != _F16:
            all16 = False
    return (_F32, _F16) if all16 else (_F32, _F32)


def numpy_max_rows(dtype) -> int:
    """The largest row count that ``linear`` gives to NumPy's matmul for ``dtype``."""
    if np.dtype(dtype) == _F64:
        return NUMPY_MAX_ROWS_F64
    _ensure_runtime()
    return NUMPY_MAX_ROWS_F32 if _proj.small_kernel_active() else NUMPY_MAX_ROWS_F32_BLAS


def _check_args(x, weight, bias):
    """linear's arguments checked: (x, weight, bias) as ndarrays (not copied,
    bias None or its own dtype), the compute dtype and the result dtype."""
    x = x if isinstance(x, np.ndarray) else as_array(x, "x")
    w = weight if isinstance(weight, np.ndarray) else as_array(weight, "weight")
    check_float_kind(x, "x")
    check_float_kind(w, "weight")
    if w.ndim != 2:
        raise ValueError(f"weight: expected a 2-d array (out_features, in_features), got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: expected last dim {w.shape[1]} (weight's in_features), got shape {x.shape}")
    b = None if bias is None else bias if isinstance(bias, np.ndarray) else as_array(bias, "bias")
    cdt, rdt = _dtypes(x, w, b)
    if b is not None:
        check_float_kind(b, "bias")
        if b.shape != (w.shape[0],):
            raise ValueError(f"bias: expected shape ({w.shape[0]},), got {b.shape}")
    return x, w, b, cdt, rdt


@_alloc.cached
def linear(x, weight, bias=None, *, n_threads=None):
    """``x @ weight.T + bias`` (torch's ``F.linear``).

    x : array_like (..., in_features); weight : (out_features, in_features);
    bias : (out_features,) or None.  float32 when every argument is float32
    (or float16), float64 otherwise; float16 when every argument is float16
    (computed in float32, as the attention functions do).  Returns a new array (..., out_features); inputs are
    never modified.  ``n_threads``: fastattn's thread count for products of
    more than :func:`numpy_max_rows` rows and more than ``NUMPY_MAX_MACS``
    multiply-adds (default: :func:`fastattn.get_num_threads`).
    float32 products of 64 rows or more (AVX2 on) pack ``weight`` for the
    projection kernel on every call, into a scratch buffer kept per calling
    thread (at most 16 MB; ``fastattn._proj.release_pack_buffer()`` frees
    this thread's).
    """
    x, w, b, cdt, rdt = _check_args(x, weight, bias)
    if b is not None:
        b = np.ascontiguousarray(b, dtype=cdt)
    nt = _threads.resolve(n_threads)
    xc = x.astype(cdt, copy=False)
    wc = w.astype(cdt, copy=False)
    K, N = wc.shape[1], wc.shape[0]
    rows = xc.size // K if K else int(np.prod(xc.shape[:-1]))
    few = rows <= numpy_max_rows(cdt) or rows * N * K <= NUMPY_MAX_MACS
    if few and cdt == _F32 and N * K >= PARALLEL_MIN_WEIGHTS and _proj.small_kernel_active():
        few = False  # a large weight matrix: both cores read it (see PARALLEL_MIN_WEIGHTS)
    if few or K == 0 or N == 0 or max(rows, K, N) > BLAS_INT_MAX:
        y = np.matmul(xc, wc.T)
        if b is not None:
            y += b
        return y if rdt is cdt else y.astype(rdt)
    _ensure_runtime()
    x3 = canonical_matrix_stack(xc.reshape(1, rows, K), cdt)  # a view for C-ordered x
    y = np.empty((1, rows, N), dtype=cdt)
    _proj.linear(x3, canonical_matrix_stack(wc, cdt), b, y, nt)
    y = y.reshape(x.shape[:-1] + (N,))
    return y if rdt is cdt else y.astype(rdt)


class _PackedLinear:
    """:func:`linear` with one weight for many calls (AttentionDecoder's
    Bahdanau loop: the same few-row products at every step): the arguments
    checked once and, float32 with the packed kernel active, the weight packed
    once for it (``_proj.linear``'s ``wp``; a float32 product of fewer than
    64 rows is not worth packing per call, but a packed weight read by many
    calls is: 32 x 256 into 768, 2 threads, 81 -> 58 us).  Otherwise each call
    is :func:`linear` itself.  Internal: ``x`` (rows, in_features) in the
    compute dtype; the weight and bias must not change while it is used."""

    def __init__(self, weight, bias=None, n_threads=None):
        w = weight if isinstance(weight, np.ndarray) else as_array(weight, "weight")
        _, w, b, cdt, _ = _check_args(np.zeros((0, w.shape[-1] if w.ndim else 0), w.dtype), w, bias)
        self.cdt, self.n_threads = cdt, n_threads   # resolved at each call
        self.N, self.K = w.shape
        self.w = canonical_matrix_stack(w.astype(cdt, copy=False), cdt)
        self.b = None if b is None else np.ascontiguousarray(b, dtype=cdt)
        self.wp = None
        _ensure_runtime()
        if (cdt == _F32 and self.N and self.K and max(self.N, self.K) <= BLAS_INT_MAX
                and _proj.packed_kernel_active()):
            self.wp = np.empty(_proj.packed_size(self.N, self.K), np.float32)
            _proj.pack_f32(self.w, self.wp)

    def __call__(self, x):
        nt = _threads.resolve(self.n_threads)
        if self.wp is None:
            return linear(x, self.w, self.b, n_threads=nt)
        rows = x.shape[0]
        y = np.empty((1, rows, self.N), self.cdt)
        if rows:
            _proj.linear(canonical_matrix_stack(x.reshape(1, rows, self.K), self.cdt), self.w,
                         self.b, y, nt, self.wp)
        return y[0]

    def worth_it(self, rows):
        """Whether a product of ``rows`` rows should take the packed weights
        (a layer's inference call) rather than :func:`linear`: more than one
        row (a single row reads the weights once either way) and more than
        ``NUMPY_MAX_MACS`` multiply-adds.  Measured on AMD EPYC Zen 3 (AVX2),
        one thread, microseconds, min of 5 x 200, packed / :func:`linear` /
        NumPy with one OpenBLAS thread: 60 x 128 -> 256 43.3 / 68.8 / 56.8;
        60 x 256 -> 128 44.1 / 62.0 / 53.6; 16 x 128 -> 256 13.6 / 23.7 /
        21.8; 128 x 128 -> 256 92.3 / 102.2 / 111.8."""
        return (self.wp is not None and 1 < rows <= BLAS_INT_MAX
                and rows * self.N * self.K > NUMPY_MAX_MACS)


def _operand(a, cdt):
    """A 2-d operand for :func:`fastattn._proj.matmul` as ``(buffer, transposed)``:
    ``a`` in ``cdt`` with BLAS-addressable rows (not copied when it has them),
    or the transpose of a transposed view (``W.T`` of a C-ordered array) with
    ``transposed`` set, so that neither is copied."""
    if (a.dtype == cdt and a.shape[0] > 1 and a.shape[1] > 1 and a.strides[1] != cdt.itemsize
            and a.strides[0] == cdt.itemsize):
        t = canonical_matrix_stack(a.T, cdt)
        return t, True
    return canonical_matrix_stack(a, cdt), False


def _matmul(a, b, cdt, n_threads, kc=0):
    """``a (M, R) @ b (R, N)`` in ``cdt`` on :func:`fastattn._proj.matmul` (tiles
    fixed by the shapes: the same bits for any thread count); transposed views
    are read in place.  For the other backward ops' products.  ``kc`` > 0
    (float32): the reduction in chunks of kc summed in float64 (``_proj.matmul``)."""
    M, R = a.shape
    N = b.shape[1]
    if M == 0 or N == 0 or R == 0:
        return np.zeros((M, N), cdt)
    if max(M, N, R) > BLAS_INT_MAX:
        return np.matmul(a.astype(cdt, copy=False), b.astype(cdt, copy=False))
    _ensure_runtime()
    aa, at = _operand(a, cdt)
    bb, bt = _operand(b, cdt)
    c = np.empty((M, N), cdt)
    _proj.matmul(aa, at, bb, bt, c, n_threads, kc)
    return c


@_alloc.cached
def linear_backward(grad_out, x, weight, bias=None, *, n_threads=None):
    """Gradients of :func:`linear`: ``(dx, dweight, dbias)``.

    grad_out : array_like (..., out_features), dL/d(output), the forward's
    output shape; x, weight, bias : the forward's arguments, unchanged (checked
    as :func:`linear` checks them).  With ``y = x Wᵀ + b``::

        dx = grad_out W                      (the shape of x)
        dweight = Σ grad_outᵀ x              (out_features, in_features)
        dbias = Σ grad_out                   (out_features,); None without a bias

    the sums over every leading dim of x: all rows together, one product.
    Computed in :func:`linear`'s dtype (float32 when every argument is float32
    or float16, float64 otherwise; grad_out is cast to it), each gradient
    returned in its input's dtype (a non-float input gets the compute dtype);
    dbias is summed in float64.  Inputs are never modified.

    float32 products of at least 64 result rows (AVX2 on, operands that fit
    the packing scratch) run on the packed projection kernel of
    :func:`linear` (the other operand packed by copies; for dweight, grad_out
    read as its transpose, block by block into per-call scratch, never a
    transposed copy of it), one call whose reduction runs in runs of
    :data:`PACKED_KC` terms, each summed from zero and added in order (as
    accurate as torch's MKL: see there): measured against NumPy's OpenBLAS
    (one long float32 sum per output) on 4096-row products of a transformer
    step, about 1.5x its speed on an AMD AVX-512 machine, 0.8-1.0x on an
    Intel AVX-512 one (Xeon: 0.79x for 4096 x 256 into 1024, 0.96-0.97x at
    the others) and 0.8-1.1x on an AVX2 one (Zen 3), at the cost of the
    packed operand (scratch kept per thread, at most 16 MB).  The others run on :func:`fastattn._proj.matmul`
    (fastattn's worker pool, BLAS held at one thread, tiles fixed by the
    shapes).  Either way every element is summed in an order fixed by the
    shapes: the same bits for any ``n_threads`` (default
    :func:`fastattn.get_num_threads`).
    """
    return _linear_backward(grad_out, x, weight, bias, n_threads, True)


def _linear_weight_grads(grad_out, x, weight, bias=None, *, n_threads=None):
    """:func:`linear_backward`'s ``(dweight, dbias)`` alone, the same floats,
    without the product for dx (AttentionDecoder's query projection, whose dx
    it computes step by step).  Internal."""
    _, dw, db = _linear_backward(grad_out, x, weight, bias, n_threads, False)
    return dw, db


def _linear_input_grad(grad_out, x, weight, *, n_threads=None):
    """:func:`linear_backward`'s ``dx`` alone, without the weight gradient; for a
    slice of ``weight``'s columns, those columns of the whole dx (the same
    floats on the float32 packed kernel, where each column is its own
    product; to rounding on the tiled products).  For
    AttentionDecoder's input projection, whose context columns' gradient it
    takes step by step and whose embedding columns' gradient it needs here.
    Internal."""
    return _linear_backward(grad_out, x, weight, None, n_threads, True, need_dw=False)[0]


def _linear_backward(grad_out, x, weight, bias, n_threads, need_dx, need_dw=True):
    x, w, b, cdt, _ = _check_args(x, weight, bias)
    nt = _threads.resolve(n_threads)
    N, K = w.shape
    lead = x.shape[:-1]
    g = check_grad_array(grad_out, "grad_out", lead + (N,))
    rows = int(np.prod(lead))
    g2 = g.reshape(rows, N)
    x2 = x.reshape(rows, K)
    ga, gt, db64 = None, False, None
    if rows == 0 or N == 0 or K == 0:  # sums of nothing, or nothing to write
        dx = np.zeros((rows, K), cdt)
        dw = np.zeros((N, K), cdt)
    elif max(rows, N, K) > BLAS_INT_MAX:  # beyond BLAS's 32-bit sizes: NumPy's matmul
        ga = g2.astype(cdt, copy=False)
        dx = np.matmul(ga, w.astype(cdt, copy=False))
        dw = np.matmul(ga.T, x2.astype(cdt, copy=False)) if need_dw else None
    else:
        _ensure_runtime()
        ga, gt = _operand(g2, cdt)
        dx = np.empty((rows, K), cdt) if need_dx else None
        dw = np.empty((N, K), cdt) if need_dw else None
        packed_dx = cdt == _F32 and _proj.packs_transposed(rows, K, N)
        packed_dw = cdt == _F32 and _proj.packs_transposed(N, K, rows) and need_dw
        if packed_dx or packed_dw:   # float32 on the packed projection kernel
            g32 = np.ascontiguousarray(g2, dtype=cdt)
        if need_dx and packed_dx:   # dx = g W: the rows of g against W read as w^T (packed by copies)
            _packed_product(g32, np.ascontiguousarray(w, dtype=cdt), dx, nt)
        elif need_dx:
            wa, wt = _operand(w, cdt)
            _proj.matmul(ga, gt, wa, wt, dx, nt)        # (rows, N) @ (N, K)
        if packed_dw:   # dw = g^T x: g read transposed (8 x 8 blocks into scratch), x as w^T
            # and db = g's column sums from the same pass over g (float64, in row order)
            db64 = np.zeros(N) if b is not None else None
            _packed_product(g32, np.ascontiguousarray(x2, dtype=cdt), dw, nt, a_transposed=True,
                            colsum=db64)
        elif need_dw:
            xa, xt = _operand(x2, cdt)
            _proj.matmul(ga, not gt, xa, xt, dw, nt)    # (N, rows) @ (rows, K)
    if dx is not None:
        dx = dx.reshape(x.shape).astype(grad_dtype(x, cdt), copy=False)
    if not need_dw:
        return dx, None, None
    dw = dw.astype(grad_dtype(w, cdt), copy=False)
    db = None
    if b is not None:
        if db64 is not None:
            db = db64
        else:
            if ga is None:
                ga = g2.astype(cdt, copy=False)
            db = _column_sums(ga.T if gt else ga, nt)
        db = db.astype(grad_dtype(b, cdt), copy=False)
    return dx, dw, db


#: linear_backward's packed products sum their reduction in runs of this many
#: terms (each run from zero, then the runs added in order: _proj.linear's
#: ``runs``, inside one call).  The packed
#: kernel's one float32 accumulator per output over the whole reduction gave
#: 2.3-4.4x torch's rms error at 4096 rows; runs of 256 1.1-1.4x, runs of 128
#: 0.85-1.0x (max error 0.68-1.0x), about 1.5x OpenBLAS's speed on an AMD
#: AVX-512 machine (measured, one run, 2 threads: 4096 x 1024 into 256, 4096
#: x 256 into 1024, 1024 x 1000 into 256; 0.8-1.0x on an Intel one, see
#: linear_backward; tests/kernels/test_proj_transposed.py checks the error ratios).
PACKED_KC = 128


def _packed_product(a, bt, out, n_threads, a_transposed=False, runs=PACKED_KC, colsum=None):
    """``out (M, N) = a (M, R) @ bt (R, N)`` in float32 on the packed kernel
    (:func:`fastattn._proj.linear` with ``w_transposed``), the reduction in
    runs of ``runs`` terms (default :data:`PACKED_KC`; the same bits for any
    ``n_threads``).  ``a_transposed``: ``a`` is given as ``(R, M)``, ``out =
    a.T @ bt``, each block transposed inside the kernel (the floats of a
    transposed copy); ``colsum`` (with it): float64 zeros (M,) that get
    ``a``'s column sums (over R in order, in float64) from the same pass."""
    _proj.linear(a[None], bt, None, out[None], n_threads, w_transposed=True, runs=runs,
                 x_transposed=a_transposed, colsum=colsum)
    return out


def _column_sums(a, n_threads):
    """``a (rows, N)``'s column sums in float64: fixed chunks of rows summed in
    C (fastattn._rowwise, row order), the chunks added in order -- the same bits
    for any thread count.  Rows that are not BLAS-style (a transposed view) sum
    in NumPy."""
    rows, n = a.shape
    if not rows or not n or a.dtype not in (np.float32, np.float64) or not a.flags.aligned or \
            (n > 1 and a.strides[1] != a.itemsize) or (rows > 1 and a.strides[0] < n * a.itemsize):
        return np.add.reduce(a, axis=0, dtype=np.float64)
    _threads.install_runtime_once(_rowwise.set_runtime)
    parts = np.zeros((_rowwise.n_chunks(rows, n), n))
    _rowwise.colsum(a, parts, n_threads)
    return np.add.reduce(parts, axis=0)
