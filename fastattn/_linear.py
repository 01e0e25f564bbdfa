"""``linear(x, weight, bias=None)``: ``x Wᵀ + b``, the one GEMM door of the layers.

The RNN input and recurrent projections, Linear and the decoder's key
projections all come through here.  Dispatch, measured on this project's
2-core machine with another process busy (float32, in=256, out=768, min of
100 calls):

* up to 16 rows: NumPy's matmul (OpenBLAS gemv / small gemm, single
  threaded): 21 us at 1 row, 58-85 us at 2-16 rows, against 140-180 us for
  the gemm-based projection kernel (sgemm packs its operands even for one row);
* more rows: the projection kernel of the fused additive path on fastattn's
  worker pool, BLAS held at one thread per worker: 0.25 ms at 32 rows where
  NumPy's multi-threaded OpenBLAS took 12 ms (a descheduled BLAS thread), and
  0.13 ms against 12 ms at 64 x 256 -> 256.
"""
from __future__ import annotations

import numpy as np

from . import _threads
from ._attention import _FEW_ROWS, _ensure_blas_hook, _project
from ._validation import check_float_kind

#: rows up to which NumPy's matmul is used (see the module docstring)
NUMPY_MAX_ROWS = _FEW_ROWS

__all__ = ["linear"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def linear(x, weight, bias=None, *, n_threads=None):
    """``x @ weight.T + bias`` (torch's ``F.linear``).

    x : array_like (..., in_features); weight : (out_features, in_features);
    bias : (out_features,) or None.  float32 when every argument is float32,
    float64 otherwise.  Returns a new array (..., out_features); inputs are
    never modified.  ``n_threads``: fastattn's thread count for products of
    more than ``NUMPY_MAX_ROWS`` rows (default: :func:`fastattn.get_num_threads`).
    """
    x = x if isinstance(x, np.ndarray) else np.asarray(x)
    w = weight if isinstance(weight, np.ndarray) else np.asarray(weight)
    check_float_kind(x, "x")
    check_float_kind(w, "weight")
    if w.ndim != 2:
        raise ValueError(f"weight: expected a 2-d array (out_features, in_features), got shape {w.shape}")
    if x.ndim < 1 or x.shape[-1] != w.shape[1]:
        raise ValueError(f"x: expected last dim {w.shape[1]} (weight's in_features), got shape {x.shape}")
    cdt = _F32 if (x.dtype == _F32 and w.dtype == _F32 and (bias is None or np.asarray(bias).dtype == _F32)) else _F64
    if bias is not None:
        b = bias if isinstance(bias, np.ndarray) else np.asarray(bias)
        check_float_kind(b, "bias")
        if b.shape != (w.shape[0],):
            raise ValueError(f"bias: expected shape ({w.shape[0]},), got {b.shape}")
        b = np.ascontiguousarray(b, dtype=cdt)
    else:
        b = None
    xc = x.astype(cdt, copy=False)
    wc = w.astype(cdt, copy=False)
    rows = xc.size // xc.shape[-1] if xc.shape[-1] else 0
    if rows <= NUMPY_MAX_ROWS or xc.shape[-1] == 0 or wc.shape[0] == 0:
        y = np.matmul(xc, wc.T)
        if b is not None:
            y += b
        return y
    if wc.strides[-1] != wc.itemsize:
        wc = np.ascontiguousarray(wc)
    _ensure_blas_hook()
    return _project(xc, wc, b, cdt, _threads.resolve(n_threads), pad=False)
