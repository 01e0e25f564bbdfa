"""Multi-head attention: projections, head split, attention, head merge, output projection.

This is part of :mod:`fastattn.functional` (re-exported there and from
``fastattn``); it lives in its own module to keep the SDPA code apart.

Shapes (batch-first; the unbatched form drops ``B``):

============  ==============================================================
``B``         batch size
``Lq``, ``Lk``  query and key/value sequence lengths
``E``         embedding size of the query (``embed_dim``)
``kdim``, ``vdim``  feature sizes of key and value inputs (default ``E``)
``H``         ``num_heads``; ``dh = E // H`` the head size
``Hkv``       ``num_kv_heads`` (grouped-query attention when ``< H``)
``E_out``     output size, ``w_out.shape[0]`` (``E`` for PyTorch's layer)
============  ==============================================================

Weights follow PyTorch's ``nn.Linear`` convention ``(out_features,
in_features)``: a projection computes ``x @ w.T + b``.

How it runs, with no copy of any activation: the queries, keys and values
are projected by BLAS GEMMs (:mod:`fastattn._proj`) into buffers laid out
``(B, L, H, dh)`` -- self-attention with packed weights is *one* GEMM into a
``(B, L, (H + 2 Hkv) dh)`` buffer; the attention kernel reads those buffers as
strided ``(B, H, L, dh)`` views and writes its output straight into a
``(B, Lq, H, dh)`` buffer (again through a strided view), which is exactly the
``(B * Lq, E)`` matrix the output projection's GEMM takes.  Grouped-query
attention views the keys and values as ``(B, Hkv, 1, Lk, dh)`` and the queries
as ``(B, Hkv, H / Hkv, Lq, dh)``, so shared key/value heads are broadcast
(stride 0), never repeated.

The attention step reads those head views through SDPA's kernel call
without SDPA's validation (``_sdpa._sdpa_canonical``): the views are
fastattn's own, canonical by construction; only the user's masks are checked
(here, once) and brought into the kernel's layout (``_masks.kernel_mask``).
A layer validates its weights once (:func:`prepare_weights`) and calls
:func:`multi_head_attention_prepared`, which checks only the inputs and sends
anything not plain to :func:`multi_head_attention` itself.  A frozen layer's
prepared weights also hold its float32 projection weights packed once
(``prepare_weights(pack=True)``, :class:`PackedWeights`) for the projection
kernel's packed path (:func:`fastattn._proj.linear`'s ``wp``).

Threads: ``n_threads`` (see :func:`fastattn.get_num_threads`) is the thread
count of every step.  The projection GEMMs are cut into blocks that run on the
attention kernel's worker pool with BLAS held at one thread, through the same
save/restore counter (see :mod:`fastattn._proj` for why, and how the two
extension modules share them).
"""
from __future__ import annotations

import math
import operator
from typing import NamedTuple

import numpy as np

from . import _alloc, _proj, _threads
from ._linear import _linear_weight_grads, linear_backward
from ._masks import MASK_ADD, MASK_BOOL, kernel_mask
from ._validation import (
    BLAS_INT_MAX,
    as_array,
    canonical_matrix_stack,
    check_float_kind,
    check_grad_array,
    grad_dtype,
    result_dtypes,
)
from ._sdpa import (_sdpa_canonical, scaled_dot_product_attention, sdpa_backward,
                    sdpa_backward_into)

__all__ = ["multi_head_attention", "multi_head_attention_backward",
           "multi_head_attention_forward_backward"]


def _install_runtime() -> bool:
    """Hand _proj _kernels' worker pool, BLAS hold and SIMD switch (called once, below)."""
    return _threads.install_runtime(_proj.set_runtime) and _proj.runtime_installed()


_install_runtime()

_ALIGNMENTS = ("top_left", "bottom_right")


def _check_int(n, name: str, minimum: int = 1) -> int:
    if isinstance(n, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a positive integer, got bool {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(
            f"{name}: expected a positive integer, got {type(n).__name__} {n!r}"
        ) from None
    if n < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {n}")
    return n


def _check_bool(x, name: str) -> bool:
    if not isinstance(x, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool, got {type(x).__name__} {x!r}")
    return bool(x)


def _float_array(x, name: str, hint: str = "") -> np.ndarray:
    if x is None:
        raise TypeError(f"{name}: expected an array, got None{hint}")
    a = as_array(x, name)
    check_float_kind(a, name)
    return a


def _check_matrix(w, name: str, shape: tuple, what: str) -> np.ndarray:
    a = _float_array(w, name)
    if a.shape != shape:
        raise ValueError(f"{name}: expected shape {shape} ({what}), got {a.shape}")
    return a


def _check_bias(b, name: str, n: int, what: str):
    if b is None:
        return None
    a = _float_array(b, name)
    if a.shape != (n,):
        raise ValueError(f"{name}: expected shape ({n},) ({what}), got {a.shape}")
    return a


class _Prepared(NamedTuple):
    q: np.ndarray          # (B, Lq, E), compute dtype, canonical rows
    k: np.ndarray          # (B, Lk, kdim)
    v: np.ndarray          # (B, Lk, vdim)
    self_attention: bool   # query, key and value are one array (one fused GEMM)
    kv_shared: bool        # key and value are one array
    w_qkv: object          # packed ((H + 2 Hkv) dh, E), or None
    b_qkv: object
    w_q: object            # separate weights (views of the packed ones when packed)
    w_k: object
    w_v: object
    b_q: object
    b_k: object
    b_v: object
    w_out: np.ndarray
    b_out: object
    mask: object           # one canonical mask for the kernel, 4-D (or None)
    B: int
    Lq: int
    Lk: int
    E: int
    H: int
    Hkv: int
    dh: int
    E_out: int
    batched: bool
    is_causal: bool
    want_weights: bool
    average: bool
    scale: object
    causal_alignment: str
    n_threads: int
    cdt: np.dtype
    rdt: np.dtype
    packed: object = None  # PackedWeights of prepared, frozen weights (float32), or None


def _prepare(query, key, value, num_heads, w_qkv, b_qkv, w_query, w_key, w_value,
             b_query, b_key, b_value, w_out, b_out, attn_mask, key_mask, is_causal,
             return_weights, average_weights, num_kv_heads, scale, causal_alignment,
             n_threads) -> _Prepared:
    H = _check_int(num_heads, "num_heads")
    Hkv = H if num_kv_heads is None else _check_int(num_kv_heads, "num_kv_heads")
    if H % Hkv:
        raise ValueError(
            f"num_kv_heads: expected a divisor of num_heads={H} (each key/value head "
            f"serves num_heads / num_kv_heads query heads), got {Hkv}"
        )
    is_causal = _check_bool(is_causal, "is_causal")
    want_weights = _check_bool(return_weights, "return_weights")
    average = _check_bool(average_weights, "average_weights")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    if scale is not None and (isinstance(scale, (bool, np.bool_))
                              or not isinstance(scale, (int, float, np.integer, np.floating))):
        raise TypeError(f"scale: expected a real number or None, got {type(scale).__name__} {scale!r}")
    if scale is not None and not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite real number, got {float(scale)!r}")
    nt = _threads.resolve(n_threads)

    self_attention = query is key and key is value
    kv_shared = key is value
    again = " (pass the query again for self-attention)"
    q = _float_array(query, "query")
    k = q if query is key else _float_array(key, "key", again)
    v = k if kv_shared else _float_array(value, "value", again)
    if q.ndim not in (2, 3):
        raise ValueError(
            "query: expected a (B, Lq, E) batch or an unbatched (Lq, E) array, "
            f"got {q.ndim}-d array of shape {q.shape}"
        )
    batched = q.ndim == 3
    for name, a in (("key", k), ("value", v)):
        if a.ndim != q.ndim:
            want = "(B, Lk, features)" if batched else "(Lk, features), unbatched like query"
            raise ValueError(
                f"{name}: expected a {q.ndim}-d array {want}, got {a.ndim}-d array of shape {a.shape}"
            )
    if not batched:
        q, k, v = q[None], k[None], v[None]
    B, Lq, E = q.shape
    Lk = k.shape[1]
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"key/value: expected batch size {B} (query's), got key of shape {k.shape} "
            f"and value of shape {v.shape}"
        )
    if v.shape[1] != Lk:
        raise ValueError(
            f"value: expected {Lk} rows (key's length Lk), got value of shape {v.shape[-2:]}"
        )
    q_shape = q.shape if batched else q.shape[1:]
    wo = _float_array(w_out, "w_out")
    w_in = w_qkv if w_qkv is not None else w_query
    try:
        w_in_shape = None if w_in is None else np.shape(w_in)
    except ValueError:  # ragged; its own check below says so
        w_in_shape = None
    in_ok = w_in_shape is not None and len(w_in_shape) == 2 and w_in_shape[1] == E
    if wo.ndim == 2 and wo.shape[1] != E and w_in is not None and not in_ok:
        # the output projection wants another E and the input projection does not
        # side with the query: name the query (w_out is blamed below when it does)
        w_name = "w_qkv" if w_qkv is not None else "w_query"
        also = (f" and {w_name} {tuple(w_in_shape)}" if w_in_shape is not None and len(w_in_shape) == 2
                and w_in_shape[1] == wo.shape[1] else "")
        raise ValueError(
            f"query: expected embedding size E={wo.shape[1]} (the in_features of w_out "
            f"{wo.shape}{also}), got E={E} (query of shape {q_shape})"
        )
    if E < 1:
        raise ValueError(f"query: expected an embedding size E >= 1, got E={E} (query of shape {q_shape})")
    if E % H:
        raise ValueError(
            f"query: expected an embedding size E divisible by num_heads={H}, got E={E} "
            f"(query of shape {q_shape})"
        )
    dh = E // H
    kvE = Hkv * dh
    kdim, vdim = k.shape[2], v.shape[2]
    for name, val in (("B * Lq", B * Lq), ("B * Lk", B * Lk), ("E", E), ("kdim", kdim),
                      ("vdim", vdim), ("projection size", E + 2 * kvE)):
        if val > BLAS_INT_MAX:
            raise ValueError(
                f"{name}={val} exceeds the BLAS 32-bit integer range (max {BLAS_INT_MAX})"
            )

    separate = (w_query, w_key, w_value)
    if w_qkv is not None:
        for name, a in zip(("w_query", "w_key", "w_value", "b_query", "b_key", "b_value"),
                           separate + (b_query, b_key, b_value)):
            if a is not None:
                raise ValueError(
                    f"{name}: give either the packed w_qkv (with b_qkv) or the separate "
                    f"w_query/w_key/w_value (with b_query/b_key/b_value), not both; got w_qkv and {name}"
                )
        if kdim != E or vdim != E:
            raise ValueError(
                f"w_qkv: packed weights need key and value of query's size E={E}, got "
                f"kdim={kdim}, vdim={vdim}; pass w_query, w_key and w_value instead"
            )
        rows = E + 2 * kvE
        wp = _check_matrix(w_qkv, "w_qkv", (rows, E),
                           "(num_heads + 2 * num_kv_heads) * head_dim, E")
        bp = _check_bias(b_qkv, "b_qkv", rows, "(num_heads + 2 * num_kv_heads) * head_dim")
        wq = wk = wv = bq = bk = bv = None
    else:
        if b_qkv is not None:
            raise ValueError("b_qkv: the packed bias goes with the packed w_qkv, which was not given; "
                             "pass b_query, b_key and b_value with separate weights")
        missing = [n for n, a in zip(("w_query", "w_key", "w_value"), separate) if a is None]
        if missing:
            raise ValueError(
                f"{missing[0]}: expected the projection weights, either packed (w_qkv) or all of "
                f"w_query, w_key, w_value; missing {', '.join(missing)}"
            )
        wp = bp = None
        wq = _check_matrix(w_query, "w_query", (E, E), "E, E")
        wk = _check_matrix(w_key, "w_key", (kvE, kdim), "num_kv_heads * head_dim, kdim")
        wv = _check_matrix(w_value, "w_value", (kvE, vdim), "num_kv_heads * head_dim, vdim")
        bq = _check_bias(b_query, "b_query", E, "E")
        bk = _check_bias(b_key, "b_key", kvE, "num_kv_heads * head_dim")
        bv = _check_bias(b_value, "b_value", kvE, "num_kv_heads * head_dim")
    if wo.ndim != 2 or wo.shape[1] != E or wo.shape[0] < 1:
        raise ValueError(f"w_out: expected shape (E_out, E={E}), got {wo.shape}")
    E_out = wo.shape[0]
    if E_out > BLAS_INT_MAX:
        raise ValueError(f"E_out={E_out} exceeds the BLAS 32-bit integer range (max {BLAS_INT_MAX})")
    bo = _check_bias(b_out, "b_out", E_out, "E_out")

    params = [a for a in (wp, bp, wq, wk, wv, bq, bk, bv, wo, bo) if a is not None]
    cdt, rdt = result_dtypes(q, k, v, *params)

    mask = _prepare_mask(attn_mask, key_mask, B, H, Lq, Lk, batched, cdt)

    qc = canonical_matrix_stack(q, cdt)
    kc = qc if query is key else canonical_matrix_stack(k, cdt)
    vc = kc if kv_shared else canonical_matrix_stack(v, cdt)

    def mat(a):
        return None if a is None else canonical_matrix_stack(a, cdt)

    def vec(a):
        if a is None:
            return None
        if a.dtype == cdt and a.flags.c_contiguous and a.flags.aligned:
            return a  # (ascontiguousarray copies an unpickled array: its dtype is equal, not identical)
        return np.ascontiguousarray(a, dtype=cdt)

    wp, wq, wk, wv, wo = mat(wp), mat(wq), mat(wk), mat(wv), mat(wo)
    bp, bq, bk, bv, bo = vec(bp), vec(bq), vec(bk), vec(bv), vec(bo)
    if wp is not None:  # row blocks of the packed weights (views) for the unfused cases
        wq, wk, wv = wp[:E], wp[E:E + kvE], wp[E + kvE:]
        if bp is not None:
            bq, bk, bv = bp[:E], bp[E:E + kvE], bp[E + kvE:]
    return _Prepared(qc, kc, vc, self_attention, kv_shared, wp, bp, wq, wk, wv, bq, bk, bv,
                     wo, bo, mask, B, Lq, Lk, E, H, Hkv, dh, E_out, batched, is_causal,
                     want_weights, average, scale, causal_alignment, nt, cdt, rdt)


def _prepare_mask(attn_mask, key_mask, B, H, Lq, Lk, batched, cdt):
    """One mask for the kernel, 4-D and broadcastable to (B, H, Lq, Lk), or None."""
    km = None
    if key_mask is not None:
        km = as_array(key_mask, "key_mask")
        want = (B, Lk) if batched else (Lk,)
        if km.dtype != np.bool_:
            raise TypeError(
                f"key_mask: expected a bool array of shape {want} (True = real token, "
                f"False = padding), got dtype {km.dtype}"
            )
        if km.shape != want:
            raise ValueError(
                f"key_mask: expected shape {want} ({'(B, Lk)' if batched else '(Lk,)'}, "
                f"True = real token), got {km.shape}"
            )
        km = km.reshape(B, 1, 1, Lk)  # a view: (B, 1, 1, Lk) is used as it is
    am = None
    if attn_mask is not None:
        am = as_array(attn_mask, "attn_mask")
        if am.dtype != np.bool_ and not (am.dtype.kind == "f" and am.dtype.itemsize <= 8):
            raise TypeError(
                "attn_mask: expected a bool mask (True = may attend) or a float mask "
                f"(added to the scores), got dtype {am.dtype}"
            )
        full = (B, H, Lq, Lk) if batched else (H, Lq, Lk)
        names = ("B", "num_heads", "Lq", "Lk")[-len(full):]
        ok = am.ndim <= len(full) and all(
            s in (1, n) for s, n in zip(am.shape[::-1], full[::-1]))
        if not ok:
            spelled = ", ".join(f"{n}={s}" for n, s in zip(names, full))
            raise ValueError(
                f"attn_mask: expected a shape broadcastable to ({spelled}), got {am.shape}"
            )
        am = am.reshape((1,) * (4 - am.ndim) + am.shape)
        if am.dtype.kind == "f" and am.dtype != cdt:
            am = am.astype(cdt)
    if km is None and am is None:
        return None
    if km is None:
        mask = am
    elif am is None:
        mask = km
    elif am.dtype == np.bool_:
        mask = am & km
    else:
        mask = np.where(km, am, np.array(-np.inf, dtype=cdt))
    kind = MASK_BOOL if mask.dtype == np.bool_ else MASK_ADD
    return kernel_mask(mask, kind, Lk, cdt)


def _linear(x, w, b, rows_out, n_threads, wp=None):
    """x (nb, M, K) @ w.T + b into a new (nb, M, rows_out) array (``wp``: w packed, or None)."""
    nb, M = x.shape[0], x.shape[1]
    y = np.empty((nb, M, rows_out), dtype=w.dtype)
    if nb * M and rows_out:
        if wp is None:
            _proj.linear(x, w, b, y, n_threads)
        else:
            _proj.linear(x, w, b, y, n_threads, wp)
    return y


def _project_heads(p: _Prepared):
    """The projections, viewed as heads: (q, k, v, mask, out_view, attn) for the kernel.

    ``q`` is ``(B, H, Lq, dh)`` (``(B, Hkv, G, Lq, dh)`` for grouped-query),
    ``k``, ``v`` ``(B, H, Lk, dh)`` (``(B, Hkv, 1, Lk, dh)``): strided views of
    the projection buffers.  ``attn`` is the ``(B, Lq, E)`` buffer the kernel
    writes through ``out_view``.
    """
    B, Lq, Lk, E, H, Hkv, dh = p.B, p.Lq, p.Lk, p.E, p.H, p.Hkv, p.dh
    kvE = Hkv * dh
    nt = p.n_threads
    pk = p.packed if p.packed is not None else _NO_PACKED
    _threads.ensure_blas_hook()
    attn = np.empty((B, Lq, E), dtype=p.cdt)
    out = attn.reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    if p.self_attention and p.w_qkv is not None and Hkv == H:
        qkv = _linear(p.q, p.w_qkv, p.b_qkv, E + 2 * kvE, nt, pk.qkv)  # one GEMM
        # (B, L, 3, H, dh) -> (3, B, H, L, dh): the three head views in one step
        hv = qkv.reshape(B, Lq, 3, H, dh).transpose(2, 0, 3, 1, 4)
        return hv[0], hv[1], hv[2], p.mask, out, attn
    if p.self_attention and p.w_qkv is not None:
        qkv = _linear(p.q, p.w_qkv, p.b_qkv, E + 2 * kvE, nt, pk.qkv)  # one GEMM
        qb, kb, vb = qkv[..., :E], qkv[..., E:E + kvE], qkv[..., E + kvE:]
    else:
        qb = _linear(p.q, p.w_q, p.b_q, E, nt, pk.q)
        if p.kv_shared and p.w_qkv is not None:  # keys and values in one GEMM
            kv = _linear(p.k, p.w_qkv[E:], None if p.b_qkv is None else p.b_qkv[E:], 2 * kvE,
                         nt, pk.kv)
            kb, vb = kv[..., :kvE], kv[..., kvE:]
        else:
            kb = _linear(p.k, p.w_k, p.b_k, kvE, nt, pk.k)
            vb = _linear(p.v, p.w_v, p.b_v, kvE, nt, pk.v)

    def heads(buf, L, n):  # (B, L, n * dh) -> (B, n, L, dh), a view
        return buf.reshape(B, L, n, dh).transpose(0, 2, 1, 3)

    q, k, v = heads(qb, Lq, H), heads(kb, Lk, Hkv), heads(vb, Lk, Hkv)
    mask = p.mask
    if Hkv != H:
        G = H // Hkv
        q = q.reshape(B, Hkv, G, Lq, dh)
        out = out.reshape(B, Hkv, G, Lq, dh)
        k = k[:, :, None]
        v = v[:, :, None]
        if mask is not None:
            mb, mh, mq, mk = mask.shape
            mask = mask.reshape(mb, Hkv, G, mq, mk) if mh == H else mask[:, :, None]
    return q, k, v, mask, out, attn


@_alloc.cached
def multi_head_attention(
    query,
    key,
    value,
    *,
    num_heads,
    w_qkv=None,
    b_qkv=None,
    w_query=None,
    w_key=None,
    w_value=None,
    b_query=None,
    b_key=None,
    b_value=None,
    w_out,
    b_out=None,
    attn_mask=None,
    key_mask=None,
    is_causal=False,
    return_weights=False,
    average_weights=True,
    num_kv_heads=None,
    scale=None,
    causal_alignment="top_left",
    n_threads=None,
):
    """Multi-head attention with input and output projections (inference).

    ``out = concat_h(attention(q W_q,h^T + b_q,h, k W_k,h^T + b_k,h, v W_v,h^T + b_v,h)) W_out^T + b_out``

    Parameters
    ----------
    query : array_like, shape (B, Lq, E) or unbatched (Lq, E)
    key : array_like, shape (B, Lk, kdim) or (Lk, kdim)
    value : array_like, shape (B, Lk, vdim) or (Lk, vdim)
        Pass the same array three times for self-attention: with packed
        weights the three projections are then one GEMM.
    num_heads : int
        ``H``; must divide ``E``.  The head size is ``dh = E // H``.
    w_qkv, b_qkv : array_like, shapes ((H + 2 Hkv) dh, E) and ((H + 2 Hkv) dh,)
        Packed query/key/value projection (PyTorch's ``in_proj_weight`` /
        ``in_proj_bias`` when ``Hkv == H``): rows ``[0, E)`` project the
        queries, then ``Hkv dh`` rows for the keys, then the values.  Needs
        ``kdim == vdim == E``.
    w_query, w_key, w_value : array_like, shapes (E, E), (Hkv dh, kdim), (Hkv dh, vdim)
        Separate projections instead of ``w_qkv`` (PyTorch's
        ``q_proj_weight`` ...; BERT's ``query`` / ``key`` / ``value``).
    b_query, b_key, b_value : array_like, optional, shapes (E,), (Hkv dh,), (Hkv dh,)
    w_out, b_out : array_like, shapes (E_out, E) and (E_out,)
        The output projection (PyTorch's ``out_proj``).
    attn_mask : array_like, optional, broadcastable to (B, H, Lq, Lk) (unbatched: (H, Lq, Lk))
        Boolean: True where a query may attend to a key -- the *opposite* of
        a boolean mask in ``torch.nn.MultiheadAttention``.  Float: added to
        the scaled scores (``-inf`` forbids).  A 3-D mask is ``(H, Lq, Lk)``
        (broadcast over the batch), not PyTorch's ``(B * H, Lq, Lk)``.
    key_mask : array_like of bool, optional, shape (B, Lk) (unbatched: (Lk,))
        True for real tokens, False for padding -- the opposite polarity of
        PyTorch's ``key_padding_mask``.  Combined with ``attn_mask``, a key
        must be allowed by both.
    is_causal : bool
        Query ``i`` attends only to keys ``j <= i`` (``j <= i + Lk - Lq`` with
        ``causal_alignment="bottom_right"``); combines with the masks.
    return_weights : bool
        Also return the attention weights (PyTorch's ``need_weights``, but off
        by default, and computed on the same fast kernel).
    average_weights : bool
        Weights averaged over heads, shape (B, Lq, Lk) (PyTorch's
        ``average_attn_weights``), or per head, (B, H, Lq, Lk).
    num_kv_heads : int, optional
        ``Hkv``, a divisor of ``H``: grouped-query attention (multi-query when
        1); query head ``h`` uses key/value head ``h // (H // Hkv)``.  Default ``H``.
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(dh)``.
    causal_alignment : {"top_left", "bottom_right"}
    n_threads : int, optional
        Threads for this call, projections and attention alike (see
        :func:`fastattn.get_num_threads`).

    Returns
    -------
    ndarray of shape (B, Lq, E_out) (unbatched: (Lq, E_out)), or ``(output, weights)``.
    Rows whose every key is masked give zero attention (the output is then
    ``b_out``), and zero weights.  The dtype follows NumPy promotion of the
    inputs, weights and biases, as in :func:`scaled_dot_product_attention`.
    Inputs are never modified.
    """
    p = _prepare(query, key, value, num_heads, w_qkv, b_qkv, w_query, w_key, w_value,
                 b_query, b_key, b_value, w_out, b_out, attn_mask, key_mask, is_causal,
                 return_weights, average_weights, num_kv_heads, scale, causal_alignment,
                 n_threads)
    return _forward(p)


def _attend(p: _Prepared, q, k, v, mask, out_view):
    """Attention of the head views into ``out_view``; returns the weights or None."""
    if p.B and p.Lq and p.Lk:
        # our own canonical views: SDPA's kernel call without its validation
        batch = q.shape[:-2]
        scale = 1.0 / math.sqrt(p.dh) if p.scale is None else float(p.scale)
        off = p.Lk - p.Lq if p.is_causal and p.causal_alignment == "bottom_right" else 0
        return _sdpa_canonical(q, k, v, mask, batch, p.is_causal, off, scale, out_view,
                               p.want_weights, p.n_threads)
    res = scaled_dot_product_attention(  # empty sizes: SDPA's general path
        q, k, v, mask, p.is_causal, p.scale, return_weights=p.want_weights,
        causal_alignment=p.causal_alignment, out=out_view, n_threads=p.n_threads)
    return res[1] if p.want_weights else None


def _forward(p: _Prepared):
    """Projections, attention and output projection of a prepared call."""
    q, k, v, mask, out_view, attn = _project_heads(p)
    weights = _attend(p, q, k, v, mask, out_view)
    y = _linear(attn, p.w_out, p.b_out, p.E_out, p.n_threads,
                None if p.packed is None else p.packed.out)
    if p.rdt != p.cdt:
        y = y.astype(p.rdt)
    if not p.batched:
        y = y[0]
    if not p.want_weights:
        return y
    w = weights.reshape(p.B, p.H, p.Lq, p.Lk)
    if p.average:  # as torch: the sum over heads / H (half the time of ndarray.mean here)
        w = np.add.reduce(w, axis=1)
        w *= w.dtype.type(1.0 / p.H)
    if p.rdt != p.cdt:
        w = w.astype(p.rdt)
    if not p.batched:
        w = w[0]
    return y, w


# ------------------------------------------------------------------ backward

@_alloc.cached
def multi_head_attention_backward(
    grad_out,
    query,
    key,
    value,
    *,
    num_heads,
    w_qkv=None,
    b_qkv=None,
    w_query=None,
    w_key=None,
    w_value=None,
    b_query=None,
    b_key=None,
    b_value=None,
    w_out,
    b_out=None,
    attn_mask=None,
    key_mask=None,
    is_causal=False,
    num_kv_heads=None,
    scale=None,
    causal_alignment="top_left",
    n_threads=None,
):
    """Gradients of :func:`multi_head_attention` with respect to its inputs and weights.

    Takes the forward's arguments (no ``return_weights``) and ``grad_out``,
    dL/d(output), of the output's shape.  The projections and the attention
    are recomputed (the attention with its row log-sum-exp, O(L) memory),
    then: the output projection's backward, the attention's
    (:func:`fastattn.functional.sdpa_backward` on the head views: shared
    key/value heads of grouped-query attention get the sum over their query
    heads), and each input projection's.

    Returns
    -------
    ``(dquery, dkey, dvalue, dweights)``: the gradients of the three inputs
    (each the gradient through its own role: when one array was passed as
    query, key and value, its gradient is the sum of the three) and a dict
    with one entry per weight or bias that was given (``"w_qkv"``,
    ``"b_qkv"`` or ``"w_query"`` ... ``"b_value"``, and ``"w_out"``,
    ``"b_out"``), each in the shape and dtype of its argument.
    """
    p = _prepare(query, key, value, num_heads, w_qkv, b_qkv, w_query, w_key, w_value,
                 b_query, b_key, b_value, w_out, b_out, attn_mask, key_mask, is_causal,
                 False, True, num_kv_heads, scale, causal_alignment, n_threads)
    g = _check_grad(p, grad_out)    # before any work
    given = dict(w_qkv=w_qkv, b_qkv=b_qkv, w_query=w_query, w_key=w_key, w_value=w_value,
                 b_query=b_query, b_key=b_key, b_value=b_value, w_out=w_out, b_out=b_out)
    return _backward(p, _train_forward(p), g, query, key, value, given, False)


@_alloc.cached_forward_backward
def multi_head_attention_forward_backward(
    query,
    key,
    value,
    *,
    num_heads,
    w_qkv=None,
    b_qkv=None,
    w_query=None,
    w_key=None,
    w_value=None,
    b_query=None,
    b_key=None,
    b_value=None,
    w_out,
    b_out=None,
    attn_mask=None,
    key_mask=None,
    is_causal=False,
    num_kv_heads=None,
    scale=None,
    causal_alignment="top_left",
    n_threads=None,
    combine_roles=False,
    input_grads=True,
):
    """:func:`multi_head_attention`'s output and its backward in one: ``(out,
    backward)``, ``backward(grad_out)`` returning what
    :func:`multi_head_attention_backward` returns for the same arguments.

    The forward keeps what the backward needs -- the projected queries, keys
    and values, the attention's output and row log-sum-exp (O(L) memory, no
    ``Lq x Lk`` matrix) -- so nothing is computed twice (the training path of
    ``MultiHeadAttention.forward_backward``).  The inputs and weights must not
    change before ``backward`` is called; it may be called more than once.

    ``combine_roles=True``: an array passed in several roles gets its total
    gradient once, in its first role's place, and None in the others (self-
    attention: ``(dx, None, None, dweights)``; key as value: ``(dq, dkv,
    None, dweights)``).  Self-attention with ``w_qkv`` then takes the three
    projections' backward as one product, which sums the roles itself.

    ``input_grads=False``: the inputs' gradients are not computed (returned as
    None; the weights' are), which saves the input projections' dx products
    -- for inputs that need no gradient (data, as torch skips tensors without
    ``requires_grad``).
    """
    combine = _check_bool(combine_roles, "combine_roles")
    need_dx = _check_bool(input_grads, "input_grads")
    p = _prepare(query, key, value, num_heads, w_qkv, b_qkv, w_query, w_key, w_value,
                 b_query, b_key, b_value, w_out, b_out, attn_mask, key_mask, is_causal,
                 False, True, num_kv_heads, scale, causal_alignment, n_threads)
    saved = _train_forward(p)
    attn = saved[5]
    y = _linear(attn, p.w_out, p.b_out, p.E_out, p.n_threads,
                None if p.packed is None else p.packed.out)
    if p.rdt != p.cdt:
        y = y.astype(p.rdt)
    if not p.batched:
        y = y[0]

    given = dict(w_qkv=w_qkv, b_qkv=b_qkv, w_query=w_query, w_key=w_key, w_value=w_value,
                 b_query=b_query, b_key=b_key, b_value=b_value, w_out=w_out, b_out=b_out)

    def backward(grad_out):
        return _backward(p, saved, _check_grad(p, grad_out), query, key, value, given, combine,
                         need_dx)
    return y, backward


def _check_grad(p, grad_out):
    out_shape = (p.B, p.Lq, p.E_out) if p.batched else (p.Lq, p.E_out)
    g = check_grad_array(grad_out, "grad_out", out_shape).astype(p.cdt, copy=False)
    return g.reshape(p.B * p.Lq, p.E_out)


def _train_forward(p):
    """The projections and the attention, keeping its lse: what _backward needs."""
    q, k, v, mask, out_view, attn = _project_heads(p)
    sc = 1.0 / math.sqrt(p.dh) if p.scale is None else float(p.scale)
    _, lse = scaled_dot_product_attention(q, k, v, mask, p.is_causal, sc,
                                          causal_alignment=p.causal_alignment, out=out_view,
                                          n_threads=p.n_threads, return_lse=True)
    return q, k, v, mask, out_view, attn, sc, lse


def _input_projection_backward(g, x, w, b, nt, need_dx):
    """linear_backward of an input projection, or (without need_dx) only its
    weight gradients (the same floats)."""
    if need_dx:
        return linear_backward(g, x, w, b, n_threads=nt)
    dw, db = _linear_weight_grads(g, x, w, b, n_threads=nt)
    return None, dw, db


def _backward(p, saved, g, query, key, value, given, combine, need_dx=True):
    """The gradients from a prepared call, _train_forward's results and grad_out
    (B Lq, E_out); without need_dx the inputs' (None) are not computed."""
    B, Lq, Lk, E, H, Hkv, dh, cdt = p.B, p.Lq, p.Lk, p.E, p.H, p.Hkv, p.dh, p.cdt
    q, k, v, mask, out_view, attn, sc, lse = saved
    attn2 = attn.reshape(B * Lq, E)

    # every projection's backward is linear_backward's (products on fastattn's
    # pool, tiles fixed by the shapes: the same bits for any thread count)
    nt = p.n_threads
    # output projection: y = attn W_out^T + b_out
    d_attn, dwo, dbo = linear_backward(g, attn2, p.w_out, p.b_out, n_threads=nt)   # (B Lq, E)
    grads = {"w_out": dwo}
    if p.b_out is not None:
        grads["b_out"] = dbo

    # attention on the head views (their layout: strided views of d_attn)
    d_ctx = d_attn.reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    if Hkv != H:
        d_ctx = d_ctx.reshape(B, Hkv, H // Hkv, Lq, dh)
    kvE = Hkv * dh
    w_qkv, b_qkv = given["w_qkv"], given["b_qkv"]
    fused = combine and p.self_attention and w_qkv is not None
    # the projections' gradients (B L, n dh): one buffer for the three when fused
    if fused:
        dQKV = np.empty((B * Lq, E + 2 * kvE), cdt)
        dQ, dK, dV = dQKV[:, :E], dQKV[:, E:E + kvE], dQKV[:, E + kvE:]
    else:
        dQ, dK, dV = (np.empty((B * L, n * dh), cdt) for L, n in ((Lq, H), (Lk, Hkv), (Lk, Hkv)))

    def heads(a, L, n):  # (B L, n dh) rows as (B, n, L, dh) head views (never a copy)
        h = a.view()
        h.shape = (B, L, n, dh)   # raises rather than copy
        return h.transpose(0, 2, 1, 3)

    sdpa_kw = dict(causal_alignment=p.causal_alignment, n_threads=p.n_threads)
    if Hkv == H and B * Lq * Lk * dh:
        # the kernel writes the head gradients straight into those rows
        sdpa_backward_into((heads(dQ, Lq, H), heads(dK, Lk, H), heads(dV, Lk, H)), d_ctx, q, k,
                           v, out_view, lse, mask, p.is_causal, sc, **sdpa_kw)
    else:
        dq_h, dk_h, dv_h = sdpa_backward(d_ctx, q, k, v, out_view, lse, mask, p.is_causal, sc,
                                         **sdpa_kw)
        for dst, dh_, L, n in ((dQ, dq_h, Lq, H), (dK, dk_h, Lk, Hkv), (dV, dv_h, Lk, Hkv)):
            dst.reshape(B, L, n, dh)[...] = dh_.reshape(B, n, L, dh).transpose(0, 2, 1, 3)

    if fused:
        # one array in all three roles: one product for the three projections,
        # whose dx is the sum of the three roles' (summed inside the GEMM)
        xq = p.q.reshape(-1, p.q.shape[-1])
        dx, dw, db = _input_projection_backward(dQKV, xq, p.w_qkv, p.b_qkv, nt, need_dx)
        grads["w_qkv"] = dw
        if b_qkv is not None:
            grads["b_qkv"] = db
        dxq = dx
        dxk = dxv = None
    else:
        # input projections: qb = x_q W_q^T + b_q, ...
        xq, xk, xv = (a.reshape(-1, a.shape[-1]) for a in (p.q, p.k, p.v))
        dxq, dwq, dbq = _input_projection_backward(dQ, xq, p.w_q, p.b_q, nt, need_dx)
        dxk, dwk, dbk = _input_projection_backward(dK, xk, p.w_k, p.b_k, nt, need_dx)
        dxv, dwv, dbv = _input_projection_backward(dV, xv, p.w_v, p.b_v, nt, need_dx)
        if w_qkv is not None:
            grads["w_qkv"] = np.concatenate([dwq, dwk, dwv], axis=0)
            if b_qkv is not None:
                grads["b_qkv"] = np.concatenate([dbq, dbk, dbv])
        else:
            grads.update(w_query=dwq, w_key=dwk, w_value=dwv)
            for name, d, b in (("b_query", dbq, given["b_query"]), ("b_key", dbk, given["b_key"]),
                               ("b_value", dbv, given["b_value"])):
                if b is not None:
                    grads[name] = d

    def back(dx, x, L):
        # the feature size spelled out: -1 cannot be inferred when B or L is 0
        dx = dx.reshape((B, L, dx.shape[-1]) if p.batched else (L, dx.shape[-1]))
        return dx.astype(grad_dtype(x, cdt), copy=False)

    dweights = {name: d.astype(grad_dtype(given[name], cdt), copy=False)
                for name, d in grads.items()}
    if not need_dx:
        return None, None, None, dweights
    if combine and dxk is not None:
        if query is key and key is value:
            dxq, dxk, dxv = dxq + dxk + dxv, None, None
        elif key is value:
            dxk, dxv = dxk + dxv, None
        elif query is key:
            dxq, dxk = dxq + dxk, None
        elif query is value:
            dxq, dxv = dxq + dxv, None
    return tuple(None if d is None else back(d, x, L) for d, x, L in
                 ((dxq, query, Lq), (dxk, key, Lk), (dxv, value, Lk))) + (dweights,)


# ------------------------------------------------------------ prepared weights
# A layer calls with the same weights every time: they are validated and made
# canonical once (MultiHeadWeights), and a call whose inputs are plain --
# ndarrays of the weights' input dtype, shapes that fit, Python bools -- only
# checks those inputs (and its masks, through the same _prepare_mask as every
# call).  Anything else goes through multi_head_attention itself, so every
# error is the general path's, worded the same.

class PackedWeights(NamedTuple):
    """The float32 projection weights of prepared weights in the packed layout of
    csrc/fa_proj.h (1-D read-only arrays, :func:`pack_weight`), one per product
    that :func:`_project_heads` runs; None where that product cannot occur."""

    qkv: object   # w_qkv (self-attention, one product), or None (separate weights)
    q: object     # the query rows (w_qkv[:E] or w_query)
    k: object
    v: object
    kv: object    # w_qkv[E:] (key is value), or None (separate weights)
    out: object   # w_out


_NO_PACKED = PackedWeights(None, None, None, None, None, None)


def pack_weight(w: np.ndarray) -> np.ndarray:
    """The packed form of a canonical float32 ``(N, K)`` weight (csrc/fa_proj.h's
    layout): a new read-only 1-D array of ``_proj.packed_size(N, K)`` floats,
    64-byte aligned."""
    size = _proj.packed_size(w.shape[0], w.shape[1])
    buf = np.empty(size + 16, np.float32)
    off = (-buf.ctypes.data % 64) // 4
    wp = buf[off:off + size]
    _proj.pack_f32(w, wp)
    wp.flags.writeable = False
    return wp


def _packed_rows(wp_full, w_full, r0, r1):
    """The packed form of rows [r0, r1) of ``w_full`` (packed: ``wp_full``): a view
    when r0 starts a panel, else packed on its own."""
    K = w_full.shape[1]
    if r0 % _proj.PANEL == 0:
        return wp_full[r0 * K:r0 * K + _proj.packed_size(r1 - r0, K)]
    return pack_weight(w_full[r0:r1])


def _pack_prepared(p: _Prepared) -> PackedWeights:
    """Every projection weight of a float32 _Prepared, packed (views where they can be)."""
    if p.w_qkv is not None:
        E, kvE, wf = p.E, p.Hkv * p.dh, p.w_qkv
        full = pack_weight(wf)
        rows = wf.shape[0]
        return PackedWeights(full, _packed_rows(full, wf, 0, E),
                             _packed_rows(full, wf, E, E + kvE),
                             _packed_rows(full, wf, E + kvE, rows),
                             _packed_rows(full, wf, E, rows), pack_weight(p.w_out))
    return PackedWeights(None, pack_weight(p.w_q), pack_weight(p.w_k), pack_weight(p.w_v), None,
                         pack_weight(p.w_out))


class MultiHeadWeights(NamedTuple):
    """Validated, canonical weights of one ``multi_head_attention`` signature
    (see :func:`prepare_weights`); internal to fastattn."""

    p: _Prepared          # the weight fields of a probe call's _Prepared
    in_dtype: np.dtype    # the input dtype the probe had
    kdim: int
    vdim: int
    kwargs: dict          # the weights as given (for the general path)
    copied: bool          # some weight was copied or cast to become canonical
    packed: object = None  # PackedWeights (prepare_weights(pack=True), float32), or None


_WEIGHT_NAMES = ("w_qkv", "b_qkv", "w_query", "w_key", "w_value", "b_query", "b_key",
                 "b_value", "w_out", "b_out")


def prepare_weights(embed_dim, kdim, vdim, dtype, *, num_heads, num_kv_heads=None,
                    pack=False, **weights) -> MultiHeadWeights:
    """Validate and canonicalise the weights of calls with ``(.., E)`` queries,
    ``(.., kdim)`` keys and ``(.., vdim)`` values of ``dtype`` (the arguments of
    :func:`multi_head_attention`, which raises the same errors).

    ``pack``: also keep float32 projection weights in the packed layout of the
    projection kernel (:class:`PackedWeights`, about one more copy of them),
    read by every call on these prepared weights while fastattn's SIMD
    dispatch is on; ``"auto"``: only when the packed kernel is active now
    (no copy that no call would read).  The caller promises that the weights' values do not
    change afterwards (the packed copy would not see it); float64 computations
    have no packed kernel, so ``pack`` is then ignored."""
    unknown = sorted(set(weights) - set(_WEIGHT_NAMES))
    if unknown:
        raise TypeError(f"prepare_weights: unknown weight names {unknown}")
    dtype = np.dtype(dtype)
    probe_q = np.zeros((1, 1, embed_dim), dtype)
    probe_k = probe_q if kdim == embed_dim else np.zeros((1, 1, kdim), dtype)
    probe_v = probe_k if vdim == kdim else np.zeros((1, 1, vdim), dtype)
    kw = {n: weights.get(n) for n in _WEIGHT_NAMES}
    p = _prepare(probe_q, probe_k, probe_v, num_heads, kw["w_qkv"], kw["b_qkv"], kw["w_query"],
                 kw["w_key"], kw["w_value"], kw["b_query"], kw["b_key"], kw["b_value"],
                 kw["w_out"], kw["b_out"], None, None, False, False, True, num_kv_heads, None,
                 "top_left", None)
    given = {"w_qkv": p.w_qkv, "b_qkv": p.b_qkv, "w_out": p.w_out, "b_out": p.b_out}
    if p.w_qkv is None:
        given.update(w_query=p.w_q, w_key=p.w_k, w_value=p.w_v, b_query=p.b_q, b_key=p.b_k,
                     b_value=p.b_v)
    copied = any(given[n] is not kw[n] for n in given)
    if pack == "auto":
        pack = _proj.packed_kernel_active()
    packed = _pack_prepared(p) if pack and p.cdt == np.float32 else None
    return MultiHeadWeights(p, dtype, kdim, vdim, kw, copied, packed)


def _prepare_with(wts: MultiHeadWeights, query, key, value, attn_mask, key_mask, is_causal,
                  return_weights, average_weights, causal_alignment, n_threads):
    """The _Prepared of a plain call with prepared weights, or None (general path)."""
    dt = wts.in_dtype
    if type(query) is not np.ndarray or query.dtype != dt:
        return None
    nd = query.ndim
    for a in (key, value):
        if a is not query and (type(a) is not np.ndarray or a.dtype != dt or a.ndim != nd):
            return None
    if nd not in (2, 3) or type(causal_alignment) is not str:
        return None
    for flag in (is_causal, return_weights, average_weights):
        if flag is not True and flag is not False:
            return None
    w = wts.p
    if nd == 2:
        q, k, v = query[None], key[None], value[None]
    else:
        q, k, v = query, key, value
    B, Lq, E = q.shape
    _, Lk, kdim = k.shape
    if (E != w.E or kdim != wts.kdim or v.shape[2] != wts.vdim or k.shape[0] != B
            or v.shape[0] != B or v.shape[1] != Lk or B * Lq > BLAS_INT_MAX
            or B * Lk > BLAS_INT_MAX or causal_alignment not in _ALIGNMENTS):
        return None
    nt = _threads.resolve(n_threads)
    cdt = w.cdt
    mask = None
    if attn_mask is not None or key_mask is not None:
        mask = _prepare_mask(attn_mask, key_mask, B, w.H, Lq, Lk, nd == 3, cdt)
    self_attention = query is key and key is value
    kv_shared = key is value
    qc = canonical_matrix_stack(q, cdt)
    kc = qc if query is key else canonical_matrix_stack(k, cdt)
    vc = kc if kv_shared else canonical_matrix_stack(v, cdt)
    # (w._replace would do; positional construction is half its cost)
    return _Prepared(qc, kc, vc, self_attention, kv_shared, w.w_qkv, w.b_qkv, w.w_q, w.w_k,
                     w.w_v, w.b_q, w.b_k, w.b_v, w.w_out, w.b_out, mask, B, Lq, Lk, w.E, w.H,
                     w.Hkv, w.dh, w.E_out, nd == 3, is_causal, return_weights, average_weights,
                     w.scale, causal_alignment, nt, cdt, w.rdt, wts.packed)


def multi_head_attention_prepared(weights: MultiHeadWeights, query, key, value, *,
                                  attn_mask=None, key_mask=None, is_causal=False,
                                  return_weights=False, average_weights=True,
                                  causal_alignment="top_left", n_threads=None):
    """:func:`multi_head_attention` with weights from :func:`prepare_weights`
    (the default ``scale``); same results, same errors."""
    p = _prepare_with(weights, query, key, value, attn_mask, key_mask, is_causal,
                      return_weights, average_weights, causal_alignment, n_threads)
    if p is not None:
        return _forward(p)
    w = weights.p
    return multi_head_attention(
        query, key, value, num_heads=w.H, num_kv_heads=w.Hkv, attn_mask=attn_mask,
        key_mask=key_mask, is_causal=is_causal, return_weights=return_weights,
        average_weights=average_weights, causal_alignment=causal_alignment,
        n_threads=n_threads, **weights.kwargs)
