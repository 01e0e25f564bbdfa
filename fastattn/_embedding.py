"""``embedding(ids, weight)``: the lookup ``weight[ids]``, and its backward.

The backward is a scatter-add of the rows of ``grad_out`` into a zero
``(num_embeddings, embedding_dim)`` gradient, in C (``fa_scatter_add``,
csrc/fa_rowwise.c, GIL released): it adds the contributions of repeated ids
one after the other in the order the ids come (row-major over ``ids``),
single-threaded, so a row's gradient is the same sequential sum on every
call -- the sums :func:`numpy.add.at` gives, which it replaced (32 x 82 ids
x 128 float32 into 3705 rows, one run: numpy.add.at on flat indices 1.30
ms, this 0.19 ms).  A sort-based reduction was the other candidate;
``np.add.reduceat`` over the sorted rows does not add a segment's rows in
that sequential order (not the same bits as a loop over the ids).
"""
from __future__ import annotations

import numpy as np

from . import _rowwise
from ._validation import as_array, check_float_kind, check_int

__all__ = ["embedding", "embedding_backward"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)


def _check_padding_idx(padding_idx, n):
    """``padding_idx`` in ``[-n, n)`` as an index in ``[0, n)`` (``Embedding``'s rule), or None."""
    if padding_idx is None:
        return None
    p = check_int(padding_idx, "padding_idx", -n)
    if p >= n:
        raise ValueError(f"padding_idx: expected an index in [0, {n}), got {p}")
    return p % n


def _check_ids(ids, n):
    """``ids`` as an integer ndarray (not copied) with every value in ``[0, n)``."""
    a = np.asarray(ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"ids: expected an integer array of token ids, got dtype {a.dtype}")
    if a.size and (a.min() < 0 or a.max() >= n):
        raise ValueError(f"ids: expected token ids in [0, {n}), got values in [{a.min()}, {a.max()}]")
    return a


def embedding(ids, weight, *, padding_idx=None):
    """``weight[ids]`` (torch's ``F.embedding``): ids an integer array of any shape,
    weight ``(num_embeddings, embedding_dim)`` -> ``ids.shape + (embedding_dim,)``,
    a new array in weight's dtype.

    ``padding_idx`` (an index in ``[-num_embeddings, num_embeddings)``) does not
    change the lookup (the layer keeps that row at zero); it is checked here
    and matters in :func:`embedding_backward`, where that row gets no gradient.
    """
    w = weight if isinstance(weight, np.ndarray) else as_array(weight, "weight")
    check_float_kind(w, "weight")
    if w.ndim != 2:
        raise ValueError(
            f"weight: expected a 2-d array (num_embeddings, embedding_dim), got shape {w.shape}")
    n = w.shape[0]
    _check_padding_idx(padding_idx, n)
    return w[_check_ids(ids, n)]


def embedding_backward(grad_out, ids, num_embeddings, *, padding_idx=None, dtype=None):
    """The gradient of :func:`embedding` with respect to ``weight``:
    ``dweight (num_embeddings, embedding_dim)``.

    grad_out : array_like ``ids.shape + (embedding_dim,)``, dL/d(output), a
    float array; ids, padding_idx : the forward's.  ``dweight[i]`` is the sum
    of the rows of ``grad_out`` whose id is ``i`` (zeros for ids that do not
    occur), added in the order of the ids (row-major), so the result is the
    same on every call; the ``padding_idx`` row is zeros (torch's rule).
    ``dtype``: dweight's dtype (the weight's; float16, float32 or float64),
    default grad_out's.  Summed in float64 when grad_out or ``dtype`` is
    float64, in float32 otherwise (float16 too).  Inputs are never modified.
    """
    n = check_int(num_embeddings, "num_embeddings", 0)
    pad = _check_padding_idx(padding_idx, n)
    a = _check_ids(ids, n)
    g = as_array(grad_out, "grad_out")
    if g.dtype.kind != "f" or g.dtype.itemsize > 8:
        raise TypeError(
            f"grad_out: expected a real floating array (float16, float32 or float64), "
            f"got dtype {g.dtype}")
    if g.ndim != a.ndim + 1 or g.shape[:-1] != a.shape:
        e = g.shape[-1] if g.ndim else "embedding_dim"
        raise ValueError(f"grad_out: expected shape ids.shape + (embedding_dim,) = "
                         f"{a.shape} + ({e},), got {g.shape}")
    if dtype is None:
        rdt = g.dtype
    else:
        try:
            rdt = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype: expected float16, float32 or float64, got {dtype!r}") from None
        if rdt.kind != "f" or rdt.itemsize > 8:
            raise TypeError(f"dtype: expected float16, float32 or float64, got {rdt}")
    cdt = _F64 if _F64 in (g.dtype, rdt) else _F32
    E = g.shape[-1]
    dw = np.zeros((n, E), cdt)
    rows = a.size
    if rows and E:
        # in row order (csrc/fa_rowwise.c): each id's rows summed one after the
        # other in the order they come, the sums numpy.add.at would give
        src = np.ascontiguousarray(g.reshape(rows, E), dtype=cdt)
        if not src.flags.aligned:
            src = src.copy()
        _rowwise.scatter_add(dw, src, np.ascontiguousarray(a.reshape(rows), dtype=np.int64))
    if pad is not None:
        dw[pad] = 0
    return dw.astype(rdt, copy=False)


def accumulate_backward(acc, grad_out, ids, *, padding_idx=None):
    """``acc += embedding_backward(grad_out, ids, len(acc), padding_idx=...)``
    without the dense temporary (the layers' backward: ``acc`` is their
    gradient accumulator, C-contiguous, of grad_out's dtype float32 /
    float64): the rows are added into ``acc`` in the order of the ids, the
    ``padding_idx`` rows skipped.  Returns False (nothing done) when the
    dtypes or the layout do not allow it -- the caller then takes
    :func:`embedding_backward`."""
    g = np.asarray(grad_out)
    if (not isinstance(acc, np.ndarray) or acc.ndim != 2 or acc.dtype not in (_F32, _F64)
            or g.dtype != acc.dtype or not acc.flags.c_contiguous or not acc.flags.aligned
            or not acc.flags.writeable):
        return False
    n, E = acc.shape
    a = _check_ids(ids, n)
    if g.shape != a.shape + (E,):
        raise ValueError(f"grad_out: expected shape ids.shape + (embedding_dim,) = "
                         f"{a.shape} + ({E},), got {g.shape}")
    rows = a.size
    if not rows or not E:
        return True
    flat = np.ascontiguousarray(a.reshape(rows), dtype=np.int64)
    src = np.ascontiguousarray(g.reshape(rows, E))
    pad = _check_padding_idx(padding_idx, n)
    if pad is not None:
        keep = flat != pad
        if not keep.all():
            flat, src = flat[keep], src[keep]
    if not src.flags.aligned:
        src = src.copy()
    _rowwise.scatter_add(acc, src, flat)
    return True
