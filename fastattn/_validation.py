"""Argument checking and canonicalisation shared by the functional ops.

Everything a user can get wrong is caught here, with a message that names the
argument, what was expected and what was received.  The kernels only ever see
what these helpers return.
"""
from __future__ import annotations

import math
import operator

import numpy as np

# BLAS integers are 32-bit (scipy.linalg.cython_blas): sizes and leading
# dimensions handed to gemm must stay below this.
BLAS_INT_MAX = 2**31 - 1

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_F16 = np.dtype(np.float16)


def describe(x) -> str:
    a = x if isinstance(x, np.ndarray) else None
    if a is not None:
        return f"array of shape {a.shape} and dtype {a.dtype}"
    return f"{type(x).__name__}"


def as_array(x, name: str) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    try:
        return np.asarray(x)
    except Exception as exc:  # ragged lists and the like
        raise TypeError(f"{name}: expected an array-like of numbers, got {describe(x)} ({exc})") from None


def check_float_kind(a: np.ndarray, name: str) -> None:
    k = a.dtype.kind
    if k == "c":
        raise TypeError(
            f"{name}: complex dtypes are not supported (attention scores must be real), got {a.dtype}"
        )
    if k not in "fiub":
        raise TypeError(f"{name}: expected a real numeric dtype, got {a.dtype}")
    if k == "f" and a.dtype.itemsize > 8:
        raise TypeError(
            f"{name}: {a.dtype} is not supported (computed natively: float32, float64; "
            "float16 is computed in float32); cast explicitly to float64"
        )


def result_dtypes(*arrays) -> tuple[np.dtype, np.dtype]:
    """(compute dtype, result dtype) by NumPy promotion of the inputs.

    float32 / float64 are computed natively; float16 is computed in float32
    and returned as float16; integer and bool inputs give float64 (as NumPy's
    true division does).
    """
    rt = np.result_type(*arrays)
    if rt.kind != "f":
        rt = _F64
    if rt == _F16:
        return _F32, _F16
    if rt == _F32:
        return _F32, _F32
    return _F64, _F64


def canonical_matrix_stack(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """a in ``dtype`` with a contiguous last axis and a BLAS-valid row stride.

    Any other strides (batch dims: anything, including 0 and negative; rows:
    positive and at least a row apart) are kept as they are, without a copy.
    """
    if a.dtype != dtype:
        return np.ascontiguousarray(a, dtype=dtype)
    if not a.flags.aligned:
        return np.array(a, order="C")  # ascontiguousarray keeps unaligned memory
    item = dtype.itemsize
    rows, cols = a.shape[-2], a.shape[-1]
    st = a.strides
    if cols > 1 and st[-1] != item:
        return np.ascontiguousarray(a)
    if rows > 1:
        rs = st[-2]
        if rs <= 0 or rs % item or rs // item < max(cols, 1) or rs // item > BLAS_INT_MAX:
            return np.ascontiguousarray(a)
    return a


def broadcast_batch(shapes: list[tuple[str, tuple]], max_dims: int) -> tuple:
    for name, shape in shapes:
        if len(shape) > max_dims:
            raise ValueError(
                f"{name}: too many leading dims (at most {max_dims} batch dims are "
                f"supported), got {len(shape)}"
            )
    try:
        return np.broadcast_shapes(*(s for _, s in shapes))
    except ValueError:
        desc = ", ".join(f"{n} {s}" for n, s in shapes)
        raise ValueError(
            f"leading (batch) dimensions do not broadcast: {desc}"
        ) from None


def check_out(out, shape, dtype) -> None:
    """``out=``: an ndarray of exactly ``shape`` and ``dtype``, writeable, every
    element with its own memory (no broadcast views)."""
    if not isinstance(out, np.ndarray):
        raise TypeError(f"out: expected a numpy.ndarray, got {describe(out)}")
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    if out.dtype != dtype:
        raise TypeError(f"out: expected dtype {dtype}, got {out.dtype}")
    if not out.flags.writeable:
        raise ValueError("out: the array is read-only")
    if out.size == 0:
        return
    # no element may be reachable twice (e.g. a broadcast view)
    dims = sorted((abs(st), n) for st, n in zip(out.strides, out.shape) if n > 1)
    span = out.itemsize
    for st, n in dims:
        if st < span:
            raise ValueError(
                f"out: its strides {out.strides} make elements overlap; pass an array "
                "in which every element has its own memory"
            )
        span = st * n


def check_qkv(query, key, value) -> tuple:
    """``query``, ``key``, ``value`` as ndarrays (not copied) of real numbers with
    at least 2 dims ``(..., L, features)``."""
    q = as_array(query, "query")
    k = as_array(key, "key")
    v = as_array(value, "value")
    for name, a in (("query", q), ("key", k), ("value", v)):
        check_float_kind(a, name)
        if a.ndim < 2:
            raise ValueError(
                f"{name}: expected an array with at least 2 dims (..., L, features), "
                f"got {a.ndim}-d array of shape {a.shape}"
            )
    return q, k, v


def sum_to_shape(a: np.ndarray, shape: tuple) -> np.ndarray:
    """``a`` summed over the dims that broadcasting added or stretched to reach
    its shape from ``shape`` (the reverse of ``np.broadcast_to``, as autograd
    sums a broadcast input's gradient); ``a`` itself when nothing was broadcast.
    The sums run in a fixed order (NumPy's pairwise summation)."""
    shape = tuple(shape)
    if a.shape == shape:
        return a
    lead = a.ndim - len(shape)
    if lead:
        a = a.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, a.shape)) if n == 1 and m != 1)
    if axes:
        a = a.sum(axis=axes, keepdims=True)
    return a


def check_grad_array(x, name: str, shape: tuple) -> np.ndarray:
    """A forward result handed to a backward (``grad_out``, ``out``, ``lse``):
    ``x`` as an ndarray (not copied) of a real floating dtype and exactly
    ``shape``; the caller casts it to its compute dtype."""
    a = as_array(x, name)
    if a.dtype.kind != "f" or a.dtype.itemsize > 8:
        raise TypeError(
            f"{name}: expected a real floating array (float16, float32 or float64), "
            f"got dtype {a.dtype}")
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")
    return a


def grad_dtype(x, cdt: np.dtype) -> np.dtype:
    """A gradient's dtype: its input's when that is a float dtype (float16 to
    float64), else the compute dtype (integer and bool inputs, lists)."""
    dt = getattr(x, "dtype", None)
    if dt is not None and dt.kind == "f" and dt.itemsize <= 8:
        return dt
    return cdt


def check_int(value, name, minimum=1, *, what=None):
    """``value`` as an int: a Python or NumPy integer (anything with ``__index__``),
    not a bool, at least ``minimum``.  ``what`` is the expectation the messages
    state (default ``"an int >= {minimum}"``; ``MultiHeadAttention`` says
    ``"a positive integer"``)."""
    if what is None:
        what = f"an int >= {minimum}"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__} {value!r}") from None
    if n < minimum:
        raise ValueError(f"{name}: expected {what}, got {n}")
    return n


def check_eps(eps, name="eps"):
    """``eps`` as a float: a real number (not a bool), finite and >= 0
    (functional.layer_norm's, ``layers.LayerNorm``'s and
    ``TransformerEncoderLayer``'s, whose ``layer_norm_eps`` it names)."""
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a real number, got {describe(eps)}")
    eps = float(eps)
    if not (eps >= 0 and math.isfinite(eps)):
        raise ValueError(f"{name}: expected a finite number >= 0, got {eps!r}")
    return eps
