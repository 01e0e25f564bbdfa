"""``linear(x, weight, bias=None)``: ``x Wᵀ + b``, the one GEMM door of the layers.

The RNN input and recurrent projections, Linear and the decoder's key
projections all come through here.  It runs NumPy's matmul (its BLAS picks
gemv for one row): measured at (1, 256) x (768, 256) float32 it took 16 us
against 142 us for the gemm-based projection kernel of the fused additive
path (``_attention._project``, sgemm packs its operands even for one row),
and 117 vs 246 us at 32 rows.  A few-row kernel can be dispatched from here
later without touching the layers.
"""
from __future__ import annotations

import numpy as np

from ._validation import check_float_kind

__all__ = ["linear"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def linear(x, weight, bias=None, *, n_threads=None):
    """``x @ weight.T + bias`` (torch's ``F.linear``).

    x : array_like (..., in_features); weight : (out_features, in_features);
    bias : (out_features,) or None.  float32 when every argument is float32,
    float64 otherwise.  Returns a new array (..., out_features); inputs are
    never modified.  ``n_threads`` is accepted for symmetry with the other
    functional ops; NumPy's BLAS uses its own thread setting.
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
    y = np.matmul(x.astype(cdt, copy=False), w.astype(cdt, copy=False).T)
    if b is not None:
        y += b
    return y
