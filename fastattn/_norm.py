"""Layer normalisation, activations and dropout, with their backward.

``layer_norm`` normalises over the last axis as ``torch.nn.functional.layer_norm``
with ``normalized_shape = (E,)``: ``(x - mean) / sqrt(var + eps) * weight + bias``,
the variance biased (divided by E).  The statistics and the backward's row sums
are accumulated in float64 and the results rounded once to the compute dtype
(float32 when x and the weights are float32 or float16, float64 otherwise), so a
float32 result is no less accurate than torch's float32 kernel.  The weight and
bias gradients are summed in float64 per fixed chunk of rows, the chunks added
in order: the same bits for any thread count.

``gelu`` is the exact (erf) form, torch's default ``approximate="none"``, or
the tanh approximation with ``approximate="tanh"``; ``relu`` as torch's
(gradient 0 at 0).  ``dropout`` draws its keep mask from a counter-based
stream (SplitMix64 of a seed and the element's index, csrc/fa_rowwise.c)
whose seed is one draw from the caller's NumPy Generator: seeded runs repeat,
for any thread count; ``P(keep) = 1 - p`` to within 2^-32.  Kept entries are
scaled by ``1 / (1 - p)``.

Result dtypes (docs/bad_input.md rows 5 and 20): ``gelu``, ``relu`` and
``dropout`` return float16 for float16 input (computed in float32 or wider),
float32 for float32, float64 for float64, bool and integers; ``layer_norm``
returns its compute dtype (float32 also when every argument is float16).
Each gradient has its input's dtype (float64 for bool / integer inputs;
``dropout_backward``: grad_out's).  A 0-d input gives a 0-d array, never a
NumPy scalar.

layer_norm, dropout and the backward of dropout and relu run on
fastattn._rowwise (C, GIL released, fastattn's worker pool: ``n_threads``,
default :func:`fastattn.get_num_threads`).  Inputs are never modified.
"""
from __future__ import annotations

import math

import numpy as np
from scipy import special

from . import _rowwise, _threads
from ._validation import (as_array, canonical_matrix_stack, check_eps as _check_eps,
                          check_grad_array, describe)

__all__ = ["layer_norm", "layer_norm_backward", "gelu", "gelu_backward", "relu",
           "relu_backward", "dropout", "dropout_backward"]

def _kernel_threads(n_threads):
    """The thread count for fastattn._rowwise, its pool installed once."""
    _threads.install_runtime_once(_rowwise.set_runtime)
    return _threads.resolve(n_threads)


def _rows(a, dt):
    """``a`` as a ``(rows, E)`` array of ``dt`` for the kernels: a contiguous last
    axis, a valid row stride, aligned (a view when it already is)."""
    return canonical_matrix_stack(a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a, dt)


def _flat(a, dt=None):
    """``a`` as a 1-D C-contiguous, aligned array (of ``dt`` when given) for the
    elementwise kernels (a view when it already is)."""
    a = np.ascontiguousarray(a, dtype=dt)
    if not a.flags.aligned:   # ascontiguousarray keeps unaligned memory
        a = np.array(a, order="C")
    return a.reshape(-1)


def _float_array(x, name):
    a = as_array(x, name)
    if a.dtype.kind == "c" or a.dtype.kind not in "fiub" or (a.dtype.kind == "f" and a.dtype.itemsize > 8):
        raise TypeError(f"{name}: expected a real floating array, got dtype {a.dtype}")
    return a


def _compute_dtype(*arrays):
    for a in arrays:
        if a is not None and not (a.dtype.kind == "f" and a.dtype.itemsize <= 4):
            return np.dtype(np.float64)
    return np.dtype(np.float32)


def _result_dtype(*arrays):
    """docs/bad_input.md row 5's rule for a forward result: float16 when every
    array argument (None: absent) is float16 (computed in float32 or wider),
    else the compute dtype (float32 with float32 / float16 ones, float64
    otherwise)."""
    given = [a for a in arrays if a is not None]
    if given and all(a.dtype == np.float16 for a in given):
        return np.dtype(np.float16)
    return _compute_dtype(*arrays)


def _grad_dtype(x):
    """A gradient's dtype: its input's when that is a float dtype, else float64
    (bool and integer inputs are computed in float64)."""
    return x.dtype if x.dtype.kind == "f" else np.dtype(np.float64)


def _ln_args(x, weight, bias, eps):
    x = _float_array(x, "x")
    if x.ndim < 1:
        raise ValueError(f"x: expected an array with at least 1 dim (..., E), got shape {x.shape}")
    E = x.shape[-1]
    w = None if weight is None else _float_array(weight, "weight")
    b = None if bias is None else _float_array(bias, "bias")
    for name, a in (("weight", w), ("bias", b)):
        if a is not None and a.shape != (E,):
            raise ValueError(f"{name}: expected shape ({E},) (x's last dim), got {a.shape}")
    return x, w, b, _check_eps(eps), _compute_dtype(x, w, b)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, n_threads=None):
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis of
    ``x (..., E)``; ``weight``, ``bias`` ``(E,)`` or None."""
    x, w, b, eps, cdt = _ln_args(x, weight, bias, eps)
    nt = _kernel_threads(n_threads)
    y = np.empty(x.shape, cdt)
    if y.size:
        _rowwise.layer_norm(_rows(x, cdt), None if w is None else _flat(w, cdt),
                            None if b is None else _flat(b, cdt), eps,
                            y.reshape(-1, x.shape[-1]), nt)
    with np.errstate(over="ignore"):   # float16: a value beyond its range is inf, as a cast
        return y.astype(_result_dtype(x, w, b), copy=False)


def layer_norm_backward(grad_out, x, weight=None, bias=None, eps=1e-5, *, n_threads=None):
    """Gradients of :func:`layer_norm`: ``(dx, dweight, dbias)`` (None for an
    absent weight or bias), with ``x̂ = (x - mean) rstd`` and ``ĝ = grad_out
    weight``::

        dx = rstd (ĝ - mean(ĝ) - x̂ mean(ĝ x̂))      (row means over E)
        dweight = Σ grad_out x̂,   dbias = Σ grad_out  (over every leading dim)

    each in its input's dtype (float inputs), computed in float64 and
    rounded once."""
    x, w, b, eps, cdt = _ln_args(x, weight, bias, eps)
    g = check_grad_array(grad_out, "grad_out", x.shape)
    nt = _kernel_threads(n_threads)
    E = x.shape[-1]
    rows = x.size // E if E else 0
    dx = np.empty(x.shape, cdt)
    affine = w is not None or b is not None
    parts = np.zeros((_rowwise.n_chunks(rows, E), 2, E)) if affine else None
    if dx.size:
        _rowwise.layer_norm_backward(_rows(g, cdt), _rows(x, cdt),
                                     None if w is None else _flat(w, cdt), eps,
                                     dx.reshape(rows, E), parts, nt)
    # NaN / inf in the inputs reach these sums and casts (inf - inf, float16 overflow):
    # they propagate, as documented, without NumPy's RuntimeWarnings
    with np.errstate(invalid="ignore", over="ignore"):
        if affine:  # the chunks' sums, in chunk order
            sums = np.add.reduce(parts, axis=0) if parts.shape[0] else np.zeros((2, E))
        dw = None if w is None else sums[0].astype(w.dtype if w.dtype.kind == "f" else cdt)
        db = None if b is None else sums[1].astype(b.dtype if b.dtype.kind == "f" else cdt)
        return dx.astype(x.dtype if x.dtype.kind == "f" else cdt, copy=False), dw, db


def _check_approximate(approximate):
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate: expected 'none' or 'tanh', got {approximate!r}")


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def gelu(x, approximate="none"):
    """``x Φ(x)`` (``approximate="none"``, torch's default) or
    ``0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))`` (``"tanh"``)."""
    _check_approximate(approximate)
    x = _float_array(x, "x")
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):   # gelu(-inf) = -inf * 0: NaN, as torch's
        if approximate == "tanh":
            y = 0.5 * x64 * (1.0 + np.tanh(_SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3)))
        else:
            y = 0.5 * x64 * (1.0 + special.erf(x64 / math.sqrt(2.0)))
        return np.asarray(y.astype(_result_dtype(x)))   # a 0-d array for 0-d x, not a scalar


def gelu_backward(grad_out, x, approximate="none"):
    """dL/dx of :func:`gelu` (``x``'s dtype)."""
    _check_approximate(approximate)
    x = _float_array(x, "x")
    g = check_grad_array(grad_out, "grad_out", x.shape).astype(np.float64)
    x64 = x.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):   # NaN at +-inf, as torch's
        if approximate == "tanh":
            u = _SQRT_2_OVER_PI * (x64 + 0.044715 * x64 ** 3)
            t = np.tanh(u)
            d = 0.5 * (1.0 + t) + 0.5 * x64 * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x64 ** 2)
        else:
            d = 0.5 * (1.0 + special.erf(x64 / math.sqrt(2.0))) + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(2.0 * math.pi)
        return np.asarray((g * d).astype(_grad_dtype(x)))


def relu(x, *, n_threads=None):
    """``max(x, 0)``, NaN propagating (torch's)."""
    x = _float_array(x, "x")
    if x.dtype.kind != "f":
        x = x.astype(np.float64)
    if x.dtype.itemsize >= 4 and x.size:
        out = np.empty(x.shape, x.dtype)
        _rowwise.relu(_flat(x), out.reshape(-1), _kernel_threads(n_threads))
        return out
    # NaN propagates through np.maximum; out=: a 0-d array for 0-d x, not a scalar
    return np.maximum(x, x.dtype.type(0), out=np.empty(x.shape, x.dtype))


def relu_backward(grad_out, x, *, n_threads=None):
    """``grad_out`` except where ``x <= 0`` (0 there: torch's choice at 0; a NaN
    ``x`` passes the gradient, as torch's), in x's dtype (float64 for bool /
    integer x), as :func:`gelu_backward`."""
    x = _float_array(x, "x")
    g = check_grad_array(grad_out, "grad_out", x.shape)
    if g.dtype.kind == "f" and g.dtype.itemsize >= 4 and x.dtype == g.dtype and g.size:
        nt = _kernel_threads(n_threads)
        out = np.empty(g.shape, g.dtype)
        _rowwise.relu_backward(_flat(g), _flat(x), out.reshape(-1), nt)
        return out
    return np.where(x <= 0, g.dtype.type(0), g).astype(_grad_dtype(x), copy=False)


def _check_p(p):
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"p: expected a probability (a real number), got {describe(p)}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"p: expected a probability in [0, 1), got {p!r}")
    return p


def _dropout_args(p, rng):
    """p checked (a probability) and rng (a Generator), in that order."""
    p = _check_p(p)
    if not isinstance(rng, np.random.Generator):
        raise TypeError(f"rng: expected a numpy.random.Generator, got {describe(rng)}")
    return p


def _dropout_stream(p, rng):
    """(seed, threshold) of a dropout call: the seed is one draw from rng."""
    return int(rng.integers(0, 2**64, dtype=np.uint64)), min(round(p * 2.0**32), 2**32)


def dropout(x, p, *, rng, n_threads=None):
    """``(out, keep)``: ``out = x keep / (1 - p)``, ``keep`` a boolean mask with
    ``P(keep) = 1 - p``, drawn from a counter-based stream seeded by one draw
    from ``rng`` (a ``numpy.random.Generator``)."""
    p = _dropout_args(p, rng)
    x = _float_array(x, "x")
    nt = _kernel_threads(n_threads)
    seed, threshold = _dropout_stream(p, rng)
    dt = x.dtype if x.dtype.kind == "f" else np.dtype(np.float64)
    keep = np.empty(x.shape, np.bool_)
    scale = 1.0 / (1.0 - p)
    if dt.itemsize >= 4 and keep.size:
        out = np.empty(x.shape, dt)
        _rowwise.dropout(_flat(x, dt), out.reshape(-1), keep.reshape(-1), seed, threshold,
                         scale, nt)
        return out, keep
    if keep.size:
        _rowwise.dropout(None, None, keep.reshape(-1), seed, threshold, scale, nt)
    out = np.multiply(x, keep, dtype=dt, out=np.empty(x.shape, dt))   # out=: 0-d stays an array
    out *= dt.type(scale)
    return out, keep


def relu_dropout(x, p, *, rng, n_threads=None):
    """``dropout(relu(x), p, rng=rng)`` in one pass over float32 / float64 ``x``
    (the same mask, floats and generator draw as the two calls; other dtypes
    run the two): ``(out, keep)``.  For FeedForward's hidden layer."""
    p = _dropout_args(p, rng)
    x = _float_array(x, "x")
    if x.dtype not in (np.float32, np.float64) or not x.size:
        return dropout(relu(x, n_threads=n_threads), p, rng=rng, n_threads=n_threads)
    nt = _kernel_threads(n_threads)
    seed, threshold = _dropout_stream(p, rng)
    keep = np.empty(x.shape, np.bool_)
    out = np.empty(x.shape, x.dtype)
    _rowwise.relu_dropout(_flat(x, x.dtype), out.reshape(-1), keep.reshape(-1), seed, threshold,
                          1.0 / (1.0 - p), nt)
    return out, keep


def relu_dropout_backward(grad_out, keep, p, out, *, n_threads=None):
    """dL/dx of :func:`relu_dropout` from its ``keep`` and ``out``:
    ``relu_backward(dropout_backward(grad_out, keep, p), out)`` in one pass
    (the same floats; ``out`` > 0 exactly where x > 0 and the element is kept,
    a NaN x's NaN out passes the gradient as relu_backward does)."""
    p = _check_p(p)
    keep = np.asarray(keep)
    out = np.asarray(out)
    g = check_grad_array(grad_out, "grad_out", keep.shape)
    if (keep.dtype != np.bool_ or g.dtype not in (np.float32, np.float64) or out.dtype != g.dtype
            or out.shape != keep.shape or not g.size):
        return relu_backward(dropout_backward(g, keep, p, n_threads=n_threads), out,
                             n_threads=n_threads)
    nt = _kernel_threads(n_threads)
    res = np.empty(g.shape, g.dtype)
    _rowwise.relu_mask_scale(_flat(g), _flat(keep), 1.0 / (1.0 - p), _flat(out),
                             res.reshape(-1), nt)
    return res


def dropout_backward(grad_out, keep, p, *, n_threads=None):
    """dL/dx of :func:`dropout`: ``grad_out keep / (1 - p)``."""
    p = _check_p(p)
    keep = np.asarray(keep)
    if keep.dtype != np.bool_:
        raise TypeError(f"keep: expected the boolean mask dropout returned, got dtype {keep.dtype}")
    g = check_grad_array(grad_out, "grad_out", keep.shape)
    if g.dtype.kind == "f" and g.dtype.itemsize >= 4 and g.size:
        nt = _kernel_threads(n_threads)
        out = np.empty(g.shape, g.dtype)
        _rowwise.mask_scale(_flat(g), _flat(keep), 1.0 / (1.0 - p),
                            out.reshape(-1), nt)
        return out
    out = np.multiply(g, keep, dtype=g.dtype, out=np.empty(g.shape, g.dtype))   # 0-d stays an array
    out *= g.dtype.type(1.0 / (1.0 - p))
    return out
