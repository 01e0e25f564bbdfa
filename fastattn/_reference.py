"""Pure-NumPy float64 oracle for every public op.

Written for clarity, not speed: it builds the full score matrix.  Tests and
benchmarks compare the kernels against it; nothing in the library calls it.
"""
from __future__ import annotations

import numpy as np


def _allowed_and_scores(q, k, attn_mask, is_causal, scale, causal_alignment):
    Lq, Lk = q.shape[-2], k.shape[-2]
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d) if d > 0 else 1.0
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * scale
    allowed = np.ones(s.shape, dtype=bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            s = s + m.astype(np.float64)
    if is_causal:
        off = 0 if causal_alignment == "top_left" else Lk - Lq
        i = np.arange(Lq)[:, None]
        j = np.arange(Lk)[None, :]
        allowed = allowed & (j <= i + off)
    s, allowed = np.broadcast_arrays(s, allowed)
    return np.where(allowed, s, -np.inf), allowed


def softmax_rows(s):
    """Softmax over the last axis where a row of only -inf gives zeros; NaN propagates."""
    s = np.asarray(s, dtype=np.float64)
    fully = np.all(s == -np.inf, axis=-1, keepdims=True)
    m = np.max(s, axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,))
    m = np.where(fully, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - m)
        w = p / np.sum(p, axis=-1, keepdims=True)
    return np.where(fully, 0.0, w)


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    causal_alignment="top_left",
    return_weights=False,
):
    """softmax(scale * q k^T + bias, masked) @ v in float64; fully masked rows give 0."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    s, _ = _allowed_and_scores(q, k, attn_mask, is_causal, scale, causal_alignment)
    w = softmax_rows(s)
    out = np.matmul(w, v)
    if return_weights:
        return out, w
    return out
