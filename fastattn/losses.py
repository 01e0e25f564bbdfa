"""Training losses with their gradients: ``cross_entropy``,
``binary_cross_entropy_with_logits`` and ``mse``.

Each function returns ``(loss, grad)`` where ``grad`` is d(loss)/d(first
argument), in that argument's shape and dtype, so a training step needs no
autograd::

    loss, dlogits = cross_entropy(logits, targets)
    grads = model_backprop(dlogits)

The semantics (shapes, ``ignore_index``, ``label_smoothing``, class weights,
the weighted-mean normalisation, ``pos_weight``) follow
``torch.nn.functional.cross_entropy``, ``binary_cross_entropy_with_logits`` and
``mse_loss``; names and defaults are torch's.

Conventions shared by the three functions:

- ``reduction``: ``"mean"`` (default) or ``"sum"`` give the loss as a Python
  ``float``; ``"none"`` gives an ndarray of the per-element losses (in the
  first argument's dtype).  With ``"none"`` the returned gradient is the
  gradient of ``sum(loss)``.  Every per-element loss depends only on its own
  element (cross_entropy: on its own class vector), so the gradient of
  ``sum(g * loss)`` for an upstream ``g`` is ``grad * g`` (``mse``, ``bce``)
  or ``grad * np.expand_dims(g, 1)`` (``cross_entropy``; ``grad * g`` for 1-d
  logits).
- ``"mean"`` over nothing (an empty batch, or every target ignored) is
  ``nan``, as in torch; the gradient is then all zeros (torch's too).
- dtypes: float32 and float64 are computed natively (float16 in float32,
  integer and bool inputs in float64); reductions over classes and over the
  batch are accumulated in float64.  The gradient and the ``"none"`` losses
  have the first argument's dtype (float64 for integer or bool inputs).
  Targets and weights are cast to the compute dtype.
- Inputs are never modified.  Bad arguments raise ``ValueError`` (wrong shape
  or value) or ``TypeError`` (wrong type or dtype) naming the argument, what
  was expected and what was received.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from ._validation import as_array, grad_dtype

__all__ = ["cross_entropy", "binary_cross_entropy_with_logits", "mse"]

_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_REDUCTIONS = ("mean", "sum", "none")


# --------------------------------------------------------------------------
# Argument checks

def _check_reduction(reduction) -> str:
    if not isinstance(reduction, str):
        raise TypeError(f"reduction: expected one of 'mean', 'sum', 'none', "
                        f"got {type(reduction).__name__} {reduction!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of 'mean', 'sum', 'none', got {reduction!r}")
    return reduction


def _real_array(x, name: str, what: str = "real numbers") -> np.ndarray:
    """``x`` as an ndarray (not copied) of a real numeric dtype (bool, integer,
    float16/32/64)."""
    a = as_array(x, name)
    k = a.dtype.kind
    if k == "c":
        raise TypeError(f"{name}: expected {what}, got complex dtype {a.dtype} (losses are real)")
    if k not in "fiub" or (k == "f" and a.dtype.itemsize > 8):
        raise TypeError(f"{name}: expected {what} (bool, integer, float16, float32 or float64), "
                        f"got dtype {a.dtype}")
    return a


def _compute_dtype(a: np.ndarray) -> np.dtype:
    """float64 for float64, integer and bool inputs; float32 for float16/32."""
    if a.dtype.kind == "f" and a.dtype.itemsize <= 4:
        return _F32
    return _F64


def _check_broadcastable(w: np.ndarray, name: str, shape: tuple, what: str) -> None:
    """``w`` broadcasts to ``shape`` without enlarging it."""
    try:
        ok = np.broadcast_shapes(w.shape, shape) == tuple(shape)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: expected a shape that broadcasts to {what} {tuple(shape)}, "
                         f"got {w.shape}")


def _mean_scale(count: float) -> float:
    return 1.0 / count if count != 0 else 0.0


def _finish(per, reduction: str, count: float, rdt: np.dtype, out_shape: tuple):
    """The reduced loss from the float64 per-element losses ``per``."""
    if reduction == "none":
        return np.asarray(per, dtype=rdt).reshape(out_shape)
    total = float(np.sum(per, dtype=np.float64))
    if reduction == "sum":
        return total
    return total / count if count != 0 else math.nan


# --------------------------------------------------------------------------
# cross_entropy

def _check_label_smoothing(label_smoothing) -> float:
    if isinstance(label_smoothing, (bool, np.bool_)) or not isinstance(
            label_smoothing, (int, float, np.integer, np.floating)):
        raise TypeError(f"label_smoothing: expected a float in [0, 1], "
                        f"got {type(label_smoothing).__name__} {label_smoothing!r}")
    eps = float(label_smoothing)
    if not 0.0 <= eps <= 1.0:
        raise ValueError(f"label_smoothing: expected a float in [0, 1], got {label_smoothing!r}")
    return eps


def _check_ignore_index(ignore_index) -> int:
    if isinstance(ignore_index, (bool, np.bool_)):
        raise TypeError(f"ignore_index: expected an int, got bool {ignore_index!r}")
    try:
        return operator.index(ignore_index)
    except TypeError:
        raise TypeError(f"ignore_index: expected an int, "
                        f"got {type(ignore_index).__name__} {ignore_index!r}") from None


def cross_entropy(logits, targets, *, ignore_index=-100, label_smoothing=0.0, weight=None,
                  reduction="mean"):
    """Softmax cross entropy and its gradient, as ``torch.nn.functional.cross_entropy``.

    Parameters
    ----------
    logits : array ``(N, C)``, ``(N, C, d1, d2, ...)`` (the class axis is axis 1,
        as in torch) or ``(C,)`` (one sample).  Unnormalised scores.
    targets : either
        - class indices: an integer array of shape ``(N,)`` / ``(N, d1, ...)``
          (``()`` for 1-d logits) with values in ``[0, C)`` or equal to
          ``ignore_index``; or
        - class probabilities: a floating array of exactly ``logits.shape``
          (``ignore_index`` does not apply).
    ignore_index : int
        Class-index targets equal to it contribute no loss and no gradient, and
        are left out of the ``"mean"`` denominator.
    label_smoothing : float in [0, 1]
        The target becomes ``(1 - label_smoothing) * target + label_smoothing / C``
        (for class indices: of the one-hot vector).
    weight : array ``(C,)`` or None
        A weight per class, multiplying each class's term of the loss.
    reduction : ``"mean"``, ``"sum"`` or ``"none"``
        ``"mean"`` with class indices divides the sum by the total weight of the
        non-ignored targets (their number when ``weight`` is None) -- also the
        label-smoothing part, as torch does; with probabilities it divides by
        the number of samples (``logits.size / C``).  Every target ignored (or
        an empty batch): ``nan``, as torch.

    Returns
    -------
    loss : float (``"mean"``, ``"sum"``) or ndarray of the targets' shape
        (class indices) / ``logits.shape`` without axis 1 (probabilities).
    grad_logits : ndarray of ``logits.shape`` and dtype: d(loss)/d(logits);
        for ``"none"`` the gradient of ``loss.sum()``.

    The log-softmax subtracts each class vector's maximum (logits of any size
    stay finite); the exponentials are taken in the compute dtype and the sums
    over classes and samples accumulated in float64.
    """
    reduction = _check_reduction(reduction)
    z = _real_array(logits, "logits")
    if z.ndim == 0:
        raise ValueError("logits: expected an array of shape (C,), (N, C) or (N, C, d1, ...), "
                         "got a 0-d array")
    cdt = _compute_dtype(z)
    rdt = grad_dtype(z, cdt)
    one_sample = z.ndim == 1
    C = z.shape[0] if one_sample else z.shape[1]
    if C == 0:
        raise ValueError(f"logits: expected at least one class (C >= 1 on the class axis), "
                         f"got shape {z.shape}")
    ii = _check_ignore_index(ignore_index)
    eps = _check_label_smoothing(label_smoothing)

    t = as_array(targets, "targets")
    index_shape = () if one_sample else z.shape[:1] + z.shape[2:]
    if t.dtype.kind == "f" and t.dtype.itemsize <= 8:
        if t.shape != z.shape:
            raise ValueError(
                f"targets: floating targets are class probabilities and must have the logits' "
                f"shape {z.shape}, got shape {t.shape} (class indices must be integers of "
                f"shape {index_shape})")
        probs = True
    elif t.dtype.kind in "iu":
        if t.shape != index_shape:
            raise ValueError(
                f"targets: expected class indices of shape {index_shape} (logits' shape "
                f"{z.shape} without the class axis 1) or class probabilities of shape "
                f"{z.shape}, got shape {t.shape}")
        probs = False
    else:
        raise TypeError(
            f"targets: expected integer class indices or floating class probabilities, "
            f"got dtype {t.dtype}")

    if not probs:
        bad = (t != ii) & ((t < 0) | (t >= C))         # in the targets' own dtype
        if bad.any():
            pos = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(
                f"targets: expected class indices in [0, {C}) or ignore_index={ii}, got "
                f"{int(t[pos])} at index {pos} ({int(bad.sum())} out of range)")

    w = None
    if weight is not None:
        wa = _real_array(weight, "weight")
        if wa.shape != (C,):
            raise ValueError(f"weight: expected shape (C,) = ({C},), one weight per class, "
                             f"got shape {wa.shape}")
        w = wa.astype(cdt)

    if one_sample:  # as a batch of one: (1, C) and (1,)
        z, t = z[None], t[None]
    wb = None if w is None else w.reshape((1, C) + (1,) * (z.ndim - 2))  # on the class axis

    if not probs and w is None and not eps and z.ndim == 2 and z.shape[0] and \
            -2 ** 63 <= ii < 2 ** 63:
        # the common case (class indices, no weights, no smoothing, (N, C)) in
        # one pass per row in C (fastattn._rowwise: the same steps as below,
        # rows on fastattn's threads)
        return _cross_entropy_rows(z, t, ii, reduction, cdt, rdt, one_sample)

    # stable log-softmax pieces: sh = z - max, lse = log(sum(exp(sh)))  (logp = sh - lse)
    sh = z.astype(cdt, copy=True)
    m = np.max(sh, axis=1, keepdims=True)
    sh -= m
    e = np.exp(sh)
    sumexp = np.sum(e, axis=1, dtype=np.float64)          # (N, d...)
    lse = np.log(sumexp)

    if probs:
        a = t.astype(cdt, copy=True)                       # the target mass per class
        if eps:
            a *= cdt.type(1.0 - eps)
            a += cdt.type(eps / C)
        if wb is not None:
            a *= wb
        s = np.sum(a, axis=1, dtype=np.float64)            # (N, d...)
        # loss = sum_c a_c (lse - sh_c) = s * lse - sum_c a_c sh_c
        per = s * lse - np.sum(a * sh, axis=1, dtype=np.float64)
        count = float(per.size)
        scale = _mean_scale(count) if reduction == "mean" else 1.0
        e *= (s * (scale / sumexp)).astype(cdt)[:, None]
        a *= cdt.type(scale)
        e -= a
    else:
        ti = t.astype(np.intp, copy=False)
        valid = ti != ii
        y = np.where(valid, ti, 0)[:, None]                # (N, 1, d...)
        wy = valid.astype(np.float64)                      # the target's weight, 0 if ignored
        if w is not None:
            wy *= w.astype(np.float64)[y[:, 0]]
        W = float(C) if w is None else float(np.sum(w, dtype=np.float64))
        nll = lse - np.take_along_axis(sh, y, axis=1)[:, 0]
        per = (1.0 - eps) * wy * nll if eps < 1.0 else np.zeros_like(lse)
        if eps:
            # smoothing term: sum_c w_c (lse - sh_c) = W * lse - sum_c w_c sh_c
            wsh = sh if wb is None else sh * wb
            smooth = W * lse - np.sum(wsh, axis=1, dtype=np.float64)
            per = per + (eps / C) * smooth
        per = np.where(valid, per, 0.0)
        count = float(np.sum(wy))
        scale = _mean_scale(count) if reduction == "mean" else 1.0
        # grad = scale * (s p - a), s = (1-eps) w_y + (eps/C) W, a = (1-eps) w_y e_y + (eps/C) w
        s = np.where(valid, (1.0 - eps) * wy + (eps / C) * W, 0.0)
        e *= (s * (scale / sumexp)).astype(cdt)[:, None]
        hit = np.take_along_axis(e, y, axis=1)
        hit -= ((scale * (1.0 - eps)) * wy).astype(cdt)[:, None]
        np.put_along_axis(e, y, hit, axis=1)
        if eps:
            vs = (valid * (scale * eps / C)).astype(cdt)[:, None]
            e -= vs if wb is None else vs * wb

    out_shape = () if one_sample else per.shape
    loss = _finish(per, reduction, count, rdt, out_shape)
    grad = e.astype(rdt, copy=False)
    if one_sample:
        grad = grad[0]
    return loss, grad


def _cross_entropy_rows(z, t, ii, reduction, cdt, rdt, one_sample):
    """cross_entropy's class-index path without weights or smoothing for (N, C)
    logits (targets checked): fastattn._rowwise.cross_entropy, whose rows are
    the NumPy path's steps -- m = max, e = exp(z - m) in the compute dtype, the
    sum in float64, nll = lse - (z_y - m), grad = e (s scale / sum) - scale at
    the target (a zero row for an ignored one)."""
    from . import _rowwise, _threads   # the extension, only when a loss is computed
    ti = np.ascontiguousarray(t, dtype=np.int64)
    count = float(np.count_nonzero(ti != ii))
    scale = _mean_scale(count) if reduction == "mean" else 1.0
    zc = np.ascontiguousarray(z, dtype=cdt)
    grad = np.empty(zc.shape, cdt)
    per = np.empty(zc.shape[0], np.float64)
    _threads.install_runtime_once(_rowwise.set_runtime)
    _rowwise.cross_entropy(zc, ti, ii, scale, grad, per, _threads.resolve(None))
    loss = _finish(per, reduction, count, rdt, () if one_sample else per.shape)
    grad = grad.astype(rdt, copy=False)
    return loss, (grad[0] if one_sample else grad)


# --------------------------------------------------------------------------
# binary_cross_entropy_with_logits

def binary_cross_entropy_with_logits(logits, targets, *, weight=None, pos_weight=None,
                                     reduction="mean"):
    """Sigmoid binary cross entropy and its gradient, as
    ``torch.nn.functional.binary_cross_entropy_with_logits``.

    ``loss = -weight * (pos_weight * y * log(sigmoid(x)) + (1 - y) * log(1 - sigmoid(x)))``
    elementwise, for logits ``x`` of any shape and ``targets`` ``y`` of the same
    shape (probabilities, usually 0/1; soft targets and values outside [0, 1]
    are not checked, as in torch; bool and integer targets are cast).

    Parameters
    ----------
    weight : array broadcastable to ``logits.shape`` or None
        A rescaling weight of each element's loss.
    pos_weight : array broadcastable to ``logits.shape`` or None
        The weight of the positive term; a vector of length C broadcasts along
        the last axis (classes of a multi-label problem), as in torch.
    reduction : ``"mean"`` (over all elements), ``"sum"`` or ``"none"``.

    Returns ``(loss, grad_logits)``; ``grad_logits`` has ``logits.shape`` and
    dtype (for ``"none"``: the gradient of ``loss.sum()``).

    Computed without overflow for logits of any size: with
    ``L = log1p(exp(-|x|))`` and ``lw = 1 + (pos_weight - 1) * y``, the loss is
    ``(1 - y) * x + lw * L`` for ``x >= 0`` and ``pos_weight * y * (-x) + lw * L``
    for ``x < 0`` (the same value as torch's formula, without its cancellation
    when ``x << 0``); the gradient is ``lw * sigmoid(x) - pos_weight * y``.
    """
    reduction = _check_reduction(reduction)
    xa = _real_array(logits, "logits")
    cdt = _compute_dtype(xa)
    rdt = grad_dtype(xa, cdt)
    ya = _real_array(targets, "targets", "target probabilities")
    if ya.shape != xa.shape:
        raise ValueError(f"targets: expected the logits' shape {xa.shape}, got shape {ya.shape}")
    ws = {}
    for name, val in (("weight", weight), ("pos_weight", pos_weight)):
        if val is not None:
            va = _real_array(val, name)
            _check_broadcastable(va, name, xa.shape, "the logits' shape")
            ws[name] = va.astype(cdt, copy=False)

    x = xa.astype(cdt, copy=False)
    y = ya.astype(cdt, copy=False)
    q = np.exp(-np.abs(x))
    L = np.log1p(q)
    sig = np.where(x >= 0, 1.0 / (1.0 + q), q / (1.0 + q)).astype(cdt, copy=False)
    pw = ws.get("pos_weight")
    if pw is None:
        lw = None
        per = np.where(x >= 0, (1 - y) * x, y * (-x)) + L
        grad = sig - y
    else:
        pwy = pw * y
        lw = 1 + pwy - y
        per = np.where(x >= 0, (1 - y) * x, pwy * (-x)) + lw * L
        grad = lw * sig - pwy
    if "weight" in ws:
        per = per * ws["weight"]
        grad = grad * ws["weight"]
    count = float(x.size)
    if reduction == "mean":
        grad = grad * cdt.type(_mean_scale(count))
    loss = _finish(per, reduction, count, rdt, x.shape)
    # np.asarray: for 0-d logits the arithmetic above gives NumPy scalars, not arrays
    return loss, np.asarray(grad, dtype=rdt)


# --------------------------------------------------------------------------
# mse

def mse(pred, target, *, reduction="mean"):
    """Mean squared error and its gradient, as ``torch.nn.functional.mse_loss``:
    ``(pred - target) ** 2`` elementwise, ``"mean"`` over all elements.

    ``target`` must have exactly ``pred``'s shape (torch broadcasts with a
    warning that the result is likely wrong; here it is an error).

    Returns ``(loss, grad_pred)``; ``grad_pred`` has ``pred.shape`` and dtype
    (for ``"none"``: the gradient of ``loss.sum()``, ``2 * (pred - target)``).
    """
    reduction = _check_reduction(reduction)
    pa = _real_array(pred, "pred")
    cdt = _compute_dtype(pa)
    rdt = grad_dtype(pa, cdt)
    ta = _real_array(target, "target")
    if ta.shape != pa.shape:
        raise ValueError(f"target: expected pred's shape {pa.shape}, got shape {ta.shape}")
    d = pa.astype(cdt, copy=True)
    d -= ta.astype(cdt, copy=False)
    count = float(d.size)
    loss = _finish(np.square(d), reduction, count, rdt, d.shape)
    factor = 2.0 * (_mean_scale(count) if reduction == "mean" else 1.0)
    d *= cdt.type(factor)
    return loss, d.astype(rdt, copy=False)
