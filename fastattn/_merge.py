"""``merge_attention``: combine attention results over disjoint key sets.

Attention over keys split into parts (key/value caches on several machines,
the key chunks of :mod:`fastattn.dask`) is one call per part with
``return_lse=True`` and then this merge: with ``lse`` the log-sum-exp of the
scaled, masked scores of each part's keys,

    lse = logsumexp_i lse_i,        out = sum_i exp(lse_i - lse) * out_i,

exactly the softmax over all keys.  A part whose row saw no key
(``lse_i = -inf``) gets weight 0; a row that saw no key in any part gives
``out = 0`` and ``lse = -inf`` (the convention of every fastattn path).  The
merge is associative and commutative, so any reduction tree gives the same
result up to rounding.
"""
from __future__ import annotations

import math

import numpy as np

from ._validation import describe

__all__ = ["merge_attention"]


def _parts(x, name, axis):
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError(f"{name}: expected at least one part, got an empty {type(x).__name__}")
        arrs = [np.asarray(a) for a in x]
        shapes = {a.shape for a in arrs}
        if len(shapes) != 1:
            raise ValueError(f"{name}: every part must have the same shape, got "
                             f"{sorted(shapes)}")
        return np.stack(arrs, axis=0), True
    arr = np.asarray(x)
    if arr.dtype == object:
        raise TypeError(f"{name}: expected a sequence of arrays or an array, got {describe(x)}")
    return arr, False


def merge_attention(outs, lses, axis=0):
    """Merge attention results computed over disjoint sets of keys.

    Parameters
    ----------
    outs : sequence of arrays (..., Lq, dv), or one array with the parts along ``axis``
        Each part's attention output (what ``attention(..., return_lse=True)``
        or ``scaled_dot_product_attention(..., return_lse=True)`` returned
        for its keys).
    lses : sequence of arrays (..., Lq), or one array with the parts along ``axis``
        Each part's row log-sum-exp (``-inf``: that part has no key the row
        may see).
    axis : int
        With arrays: the parts axis, counted in the dims of ``lses`` (a
        negative axis counts from the end of ``lses``' shape, e.g. -2 for
        lses of shape (..., P, Lq)); it may not be the last (query) axis.
        The same position in ``outs``.  With sequences: ignored (the parts
        are the sequence's items).

    Returns
    -------
    ``(out, lse)``: out (..., Lq, dv) and lse (..., Lq), in the floating
    dtype NumPy promotion gives ``outs`` and ``lses`` (float64 for integer
    inputs).  The weights are computed in float64 and the sum formed in
    float64, then rounded once, block of rows by block of rows (temporaries
    of O(block), whatever the number of parts or rows).
    """
    o, o_seq = _parts(outs, "outs", axis)
    ls, l_seq = _parts(lses, "lses", axis)
    if o_seq != l_seq:
        raise TypeError("outs, lses: give both as sequences of parts or both as arrays, got "
                        f"{type(outs).__name__} and {type(lses).__name__}")
    for name, a in (("outs", o), ("lses", ls)):
        if a.dtype.kind not in "biuf":
            raise TypeError(f"{name}: expected real numbers, got dtype {a.dtype}")
    if o_seq:
        ax = 0
    else:
        if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
            raise TypeError(f"axis: expected an int, got {describe(axis)}")
        if ls.ndim < 2:
            raise ValueError(f"lses: expected at least 2 dims (parts, Lq), got shape {ls.shape}")
        ax = int(axis)
        if not -ls.ndim <= ax < ls.ndim:
            raise ValueError(f"axis: {axis} is out of range for lses of shape {ls.shape}")
        ax %= ls.ndim
        if ax == ls.ndim - 1:
            raise ValueError(f"axis: {axis} is the query axis of lses (shape {ls.shape}); the "
                             "parts axis must be a leading one")
    if o.shape[:-1] != ls.shape:
        raise ValueError(f"outs: expected shape {ls.shape} + (dv,) to match lses, got "
                         f"{o.shape}" + (" (per part)" if o_seq else ""))
    dt = np.result_type(o.dtype, ls.dtype)
    dt = dt if dt.kind == "f" else np.dtype(np.float64)
    # parts first, then rows (batch dims and queries) x dv: a view when it can be
    o = np.moveaxis(o, ax, 0)
    ls = np.moveaxis(ls, ax, 0)
    P, rest = ls.shape[0], ls.shape[1:]
    R = math.prod(rest)
    dv = o.shape[-1]
    o2 = o.reshape(P, R, dv)
    l2 = ls.reshape(P, R)
    out = np.empty((R, dv), dt)
    lse = np.empty(R, dt)
    # rows in blocks: the float64 temporaries stay O(block), not O(parts x rows)
    step = max(1, _BLOCK_ELEMS // max(1, dv))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        lb = l2[:, r0:r1].astype(np.float64)
        if np.isnan(lb).any() or np.isposinf(lb).any():
            raise ValueError("lses: expected finite values or -inf (a part without keys), got "
                             "NaN or +inf")
        m = np.max(lb, axis=0)
        mref = np.where(np.isneginf(m), 0.0, m)
        w = np.exp(lb - mref)                        # 0 for parts with lse = -inf
        total = np.sum(w, axis=0)
        with np.errstate(divide="ignore"):
            lse[r0:r1] = mref + np.log(total)        # -inf where no part saw a key
        w /= np.where(total > 0, total, 1.0)
        acc = np.zeros((r1 - r0, dv), np.float64)
        tmp = np.empty_like(acc)
        for i in range(P):
            wi = w[i][:, None]
            np.multiply(o2[i, r0:r1], wi, out=tmp)
            tmp[np.broadcast_to(wi == 0, tmp.shape)] = 0.0  # no weight, not even 0 * NaN
            acc += tmp
        out[r0:r1] = acc
    return out.reshape(rest + (dv,)), lse.reshape(rest)


# float64 elements of a row block's temporaries (256 KiB each)
_BLOCK_ELEMS = 1 << 15
