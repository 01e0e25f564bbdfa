"""``fastattn.attention``: attention with any registered similarity.

Three ways a call runs (:func:`attention_path` says which one would):

* ``"sdpa"`` -- dot-like similarities (``dot``, ``scaled_dot``, ``general``,
  ``cosine``) are rewritten as a scaled dot product of (possibly projected or
  normalised) queries and keys and run by
  :func:`fastattn.scaled_dot_product_attention`;
* ``"fused"`` -- ``additive`` and ``concat`` project queries and keys once
  (``Qp = q W_q^T + b``, ``Kp = k W_k^T``) and run the C streaming kernel
  (``csrc/fa_additive.c``) whose score tiles are ``v . tanh(Qp_i + Kp_j)``;
  compiled plugins (:class:`fastattn.similarity.CompiledSimilarity`) run the
  same loop with their C score function;
* ``"tiled"`` -- any other similarity: its NumPy ``score`` is called on
  (query block x key tile) tiles inside a NumPy streaming softmax (running
  max and sum), so memory stays O(tile) unless weights are requested.

Its backward, :func:`attention_backward`, runs SDPA's C backward for the
``"sdpa"`` similarities (then the chain rule of their lowering), the fused C
backward of the additive kernel for ``additive`` / ``concat``
(``csrc/fa_additive_bwd_impl.h``) and a NumPy tiled backward for a Python
similarity with a ``score_backward`` and for a compiled plugin with a C
``score_backward`` (ABI version 2: its C functions on the tiles).

Masks, causality (and its alignment), fully masked rows (zeros), weights,
``out=`` and dtypes behave exactly as in
:func:`fastattn.scaled_dot_product_attention`; the validation is SDPA's own.
Parameters are cast to the compute dtype of query / key / value (they do
not take part in the dtype promotion).
"""
from __future__ import annotations

import copy
import ctypes
import math

import numpy as np

from . import _alloc, _kernels, _masks, _sdpa, _threads, _validation
from ._validation import as_array, canonical_matrix_stack, check_grad_array, describe, sum_to_shape
from .registry import get_similarity
from .similarity import (PLUGIN_ABI_VERSION, PLUGIN_CAPSULE_NAME, PLUGIN_CAPSULE_NAME_V1,
                         CompiledSimilarity, Similarity,
                         _additive_grads, _additive_tanh, _additive_tile_backward, _fits,
                         _sum_rows_t)

try:
    from . import _scores
except ImportError:  # pragma: no cover - only while the extension is not built
    _scores = None

__all__ = ["attention", "attention_backward", "attention_path", "PreparedAttention",
           "SimilarityError"]

# NumPy tiled path: scores of PY_BLOCK_Q x PY_BLOCK_K at a time (64 KiB in
# float64).  Measured with tracemalloc at 1 x 1024 x 1024 keys, d = 64:
# peak 0.77 MB (of which 0.5 MB is the output) against 24 MB for the dense
# computation; 128 x 256 tiles gave 1.34 MB.
PY_BLOCK_Q = 64
PY_BLOCK_K = 128
# Fused C path: query rows per task and keys per tile.  The kernel is bound
# by tanh, so tiles hardly matter: one thread, float32, 8x256x256 d=d_a=128
# and 1x1024x1024 d=d_a=64, every (32, 64, 128) x (64, 128, 256) pair was
# within 37.7-39.2 ms.  64 x 128 keeps Qp and Kp rows and the score tile
# (32 KiB) in L2 for d_a up to ~1000.
C_BLOCK_Q = 64
C_BLOCK_K = 128
# d_a is padded with zeros to a multiple of this (one AVX2 vector of floats).
PAD = 8
# Below this much work (score evaluations) the fused kernel runs on one thread.
PARALLEL_MIN_WORK = 1 << 17
# Fused C backward (csrc/fa_additive_bwd_impl.h): query rows x keys per
# recomputed tanh tile, and at least this many (batch item, key group) tasks
# (few batch items: each one's key blocks split into groups).
C_BWD_BLOCK_Q = 64
C_BWD_BLOCK_K = 32
C_BWD_MIN_TASKS = 8


def selftest_capsule():
    """The PyCapsule of the C self-test plugin compiled into fastattn (for
    :mod:`fastattn.testing`, which must not reach the kernels itself)."""
    if _scores is None:  # pragma: no cover - only while the extension is not built
        raise ImportError("fastattn._scores is not built: no compiled self-test plugin")
    return _scores.selftest_capsule()


class SimilarityError(RuntimeError):
    """A similarity's score function failed (raised, or returned bad scores)."""


def _dummy(a: np.ndarray) -> np.ndarray:
    """Zero-stride stand-in with a's shape but one feature, for SDPA's validation."""
    return np.broadcast_to(np.zeros((), a.dtype), a.shape[:-1] + (1,))


class _Call:
    pass


def _prepare(query, key, value, similarity, params, attn_mask, is_causal, return_weights,
             causal_alignment, out, n_threads, lower=True, return_lse=False):
    sim = get_similarity(similarity)
    q, k, v = _validation.check_qkv(query, key, value)
    d_q, d_k = q.shape[-1], k.shape[-1]
    # SDPA's own size checks below run on one-feature stand-ins: the real
    # feature sizes are BLAS dimensions / leading dimensions of the projections
    for name, what, n in (("query", "d_q", d_q), ("key", "d_k", d_k)):
        if n > _validation.BLAS_INT_MAX:
            raise ValueError(
                f"{name}: feature size {what}={n} exceeds the BLAS 32-bit integer range "
                f"(max {_validation.BLAS_INT_MAX})")
    if sim.same_dims and d_q != d_k:
        raise ValueError(
            f"key: expected last dim {d_q} (query's feature size d; similarity {sim.name!r} "
            f"needs equal query and key features), got key of shape {k.shape}")
    # SDPA's own checks and canonicalisation (mask, causal, batch broadcast,
    # out, threads, dtypes) on stand-ins for q and k with one feature each
    p = _sdpa._prepare(_dummy(q), _dummy(k), v, attn_mask, is_causal, None,
                       return_weights, causal_alignment, out, n_threads, return_lse)
    c = _Call()
    c.sim = sim
    c.p = p
    c.d_q, c.d_k = d_q, d_k
    c.params = sim.check_params(params, d_q, d_k, p.cdt)
    c.attn_mask = attn_mask
    c.causal_alignment = causal_alignment
    c.kcache = None  # a PreparedAttention's list: (projected keys, packed v) once computed
    if lower:
        c.q = canonical_matrix_stack(q, p.cdt)
        c.k = canonical_matrix_stack(k, p.cdt)
        qx, kx = c.q, c.k
    else:
        # only the path is wanted: lower one-row probes, so that nothing of
        # the size of the inputs is copied, cast or normalised
        c.q = c.k = None
        qx, kx = canonical_matrix_stack(_probe(q), p.cdt), canonical_matrix_stack(_probe(k), p.cdt)
    c.lowered = None if isinstance(sim, CompiledSimilarity) else sim._lower(qx, kx, c.params)
    return c


def _probe(a: np.ndarray) -> np.ndarray:
    """The first row of the first batch item of a, keeping every dim (a view)."""
    return a[(slice(0, 1),) * (a.ndim - 1) + (slice(None),)]


def _path(c) -> str:
    if isinstance(c.sim, CompiledSimilarity):
        return "fused"
    if c.lowered is not None and c.lowered[0] in ("sdpa", "project_sdpa"):
        return "sdpa"
    if c.lowered is not None and c.lowered[0] == "additive" and _scores is not None:
        return "fused"
    return "tiled"


def attention_path(query, key, value, similarity="dot", *, params=None, attn_mask=None,
                   is_causal=False, return_weights=False, causal_alignment="top_left",
                   out=None, n_threads=None) -> str:
    """Which path :func:`attention` takes for these arguments: ``"sdpa"``,
    ``"fused"`` or ``"tiled"`` (validates them the same way, but neither
    copies, casts nor normalises query and key: the similarity is lowered
    on their first rows only)."""
    return _path(_prepare(query, key, value, similarity, params, attn_mask, is_causal,
                          return_weights, causal_alignment, out, n_threads, lower=False))


class PreparedAttention:
    """Attention of changing queries over one fixed memory (decoding).

    ``PreparedAttention(key, value, similarity, params=..., attn_mask=...)``
    then ``prep(query)`` is ``attention(query, key, value, similarity,
    params=..., attn_mask=...)``, with the work that depends only on the
    memory done once: the argument checks and canonical buffers are made on
    the first call for each query shape and dtype and reused afterwards, and
    the fused additive / concat path projects and pads the keys once.  A
    decoder step at B = 1 over 64 source tokens spends most of a plain
    :func:`attention` call in those checks.

    Parameters are those of :func:`attention` (no ``is_causal``: the memory
    is attended as a whole; no ``out``).  ``n_threads`` is resolved at each
    call (None follows :func:`fastattn.get_num_threads`).

    ``key``, ``value``, ``attn_mask`` and ``params`` are referenced, not
    copied, when they already have the compute dtype and layout: do not
    modify them while the object is in use.  Queries of a new shape or dtype
    are validated in full, like any :func:`attention` call.
    """

    _MAX_SIGNATURES = 16

    def __init__(self, key, value, similarity="dot", *, params=None, attn_mask=None,
                 n_threads=None):
        self.similarity = get_similarity(similarity)
        self.key = as_array(key, "key")
        self.value = as_array(value, "value")
        self.params = params
        self.attn_mask = attn_mask
        self.n_threads = n_threads
        self._calls = {}

    def __call__(self, query, *, return_weights=False):
        """``(..., Lq, d_q)`` queries -> output (and weights), as :func:`attention`."""
        q = query if isinstance(query, np.ndarray) else as_array(query, "query")
        if not isinstance(return_weights, (bool, np.bool_)):
            raise TypeError(f"return_weights: expected a bool, got {type(return_weights).__name__}")
        nt = _threads.resolve(self.n_threads)
        sig = (q.shape, q.dtype.str, bool(return_weights), nt)
        t = self._calls.get(sig)
        if t is None:
            t = _prepare(q, self.key, self.value, self.similarity, self.params, self.attn_mask,
                         False, bool(return_weights), "top_left", None, nt)
            t.kcache = []
            if len(self._calls) >= self._MAX_SIGNATURES:
                self._calls.clear()
            self._calls[sig] = t
            try:
                return _execute(t)
            finally:  # also when interrupted: the copies get their own query
                t.q = t.lowered = None
        p = t.p
        if t.kcache:  # the fused additive kernel with the keys projected and padded
            wq, b, kx, packed, bq, nt_k = t.kcache
            qc = canonical_matrix_stack(q, p.cdt)
            if wq is None:   # projected queries (ProjectedAdditiveSimilarity)
                qx = _pad_columns(qc, kx.shape[-1], p.cdt)
            elif qc.size // max(qc.shape[-1], 1) <= _FEW_ROWS and kx.shape[-1] == wq.shape[0] and qc.size:
                # a decoder step's query: no padding needed, the same product as _project's
                qx = np.matmul(qc.reshape(-1, qc.shape[-1]), wq.T)
                if b is not None:
                    qx += b
                qx = qx.reshape(qc.shape[:-1] + (wq.shape[0],))
            else:
                qx = _project(qc, wq, b, p.cdt, nt_k)
            res = np.empty(p.batch + (p.Lq, p.dv), dtype=p.cdt)
            weights = np.empty(p.batch + (p.Lq, p.Lk), dtype=p.cdt) if p.want_weights else None
            _launch_additive(t, qx, kx, p.v, res, weights, bq, nt_k, _scores.SCORE_ADDITIVE, 0, packed)
            return _finish(p, res, weights)
        c = copy.copy(t)
        c.q = canonical_matrix_stack(q, p.cdt)
        c.lowered = None if isinstance(c.sim, CompiledSimilarity) else c.sim._lower(c.q, c.k, c.params)
        return _execute(c)


@_alloc.cached
def attention(query, key, value, similarity="dot", *, params=None, attn_mask=None,
              is_causal=False, return_weights=False, causal_alignment="top_left",
              out=None, n_threads=None, return_lse=False):
    """Attention ``softmax(score(Q, K) + mask) V`` with any registered similarity.

    Parameters
    ----------
    query : array_like (..., Lq, d_q)
    key : array_like (..., Lk, d_k)
        ``d_k`` must equal ``d_q`` for ``dot``, ``scaled_dot``, ``cosine`` and
        compiled plugins.
    value : array_like (..., Lk, dv)
    similarity : str or Similarity
        A registered name (see :func:`fastattn.available_similarities`) or a
        :class:`~fastattn.similarity.Similarity` instance (registered or
        not) with a ``name`` and its own ``score`` (a
        :class:`~fastattn.similarity.CompiledSimilarity`: a ``capsule``).
        Anything else -- a Similarity subclass (pass an instance), a
        factory or any other callable -- raises TypeError naming
        ``similarity``; it is never called.
    params : dict, optional
        The similarity's parameters (shapes in its ``params_spec``; see
        ``docs/similarities.md``), cast to the compute dtype.
    attn_mask, is_causal, return_weights, causal_alignment, out, n_threads, return_lse
        Exactly as in :func:`fastattn.scaled_dot_product_attention` (``lse``:
        the log-sum-exp of this similarity's masked scores over the allowed keys).

    Returns
    -------
    ndarray (..., Lq, dv); with ``return_weights`` and/or ``return_lse``, a tuple
    ``(output[, weights][, lse])``: weights (..., Lq, Lk), lse (..., Lq).
    """
    return _execute(_prepare(query, key, value, similarity, params, attn_mask, is_causal,
                             return_weights, causal_alignment, out, n_threads,
                             return_lse=return_lse))


def _execute(c):
    path = _path(c)
    if path == "sdpa":
        return _run_sdpa(c)
    p = c.p
    out_shape = p.batch + (p.Lq, p.dv)
    # only the built-in kernels write straight into out=: a compiled plugin
    # can fail partway (error code, NaN scores), and out must then be untouched
    direct = path == "fused" and not isinstance(c.sim, CompiledSimilarity)
    res = _direct_out(c) if direct else None
    if res is None:
        res = np.empty(out_shape, dtype=p.cdt)
    weights = np.empty(p.batch + (p.Lq, p.Lk), dtype=p.cdt) if p.want_weights else None
    lse = np.empty(p.batch + (p.Lq,), dtype=p.cdt) if p.want_lse else None
    if res.size or (weights is not None and weights.size) or (lse is not None and lse.size):
        if path == "fused":
            _run_fused(c, res, weights, lse)
        else:
            _run_tiled(c, res, weights, lse)
    return _finish(p, res, weights, lse)


def _direct_out(c):
    """The user's ``out`` itself when the fused kernel can write into it: the
    compute dtype, rows addressable by the kernel, no overlap with an input."""
    p = c.p
    out = p.out
    if out is None or out.dtype != p.cdt or not out.flags.aligned or p.dv == 0:
        return None
    if canonical_matrix_stack(out, p.cdt) is not out:
        return None
    for a in (c.q, c.k, p.v, p.mask):
        if a is not None and np.may_share_memory(out, a):
            return None
    return out


_finish = _sdpa._finish
def _run_sdpa(c):
    kind, q2, k2, scale = c.lowered
    p = c.p
    if kind == "project_sdpa":  # q2 is the matrix M of q2 := q M^T
        q2 = _project_queries(c, q2)
    direct = p.out is not None and p.rdt == p.cdt
    r = _sdpa.scaled_dot_product_attention(
        q2, k2, p.v, c.attn_mask, p.causal, scale, return_weights=p.want_weights,
        causal_alignment=c.causal_alignment, out=p.out if direct else None,
        n_threads=p.n_threads, return_lse=p.want_lse)
    if direct:
        return r
    if not (p.want_weights or p.want_lse):
        return _finish(p, r, None)
    return _finish(p, r[0], r[1] if p.want_weights else None, r[-1] if p.want_lse else None)


def _project_queries(c, M):
    """The queries of a ``"project_sdpa"`` lowering, q M^T."""
    if _scores is not None:
        _ensure_blas_hook()
        return _project(c.q, M, None, c.p.cdt, c.p.n_threads, pad=False)
    return np.matmul(c.q, M.T)  # pragma: no cover


# ------------------------------------------------------------- NumPy tiled

def _score_tile(sim, qt, kt, params, cdt):
    want = qt.shape[:-1] + (kt.shape[-2],)
    try:
        s = sim.score(qt, kt, params)
    except Exception as exc:
        raise SimilarityError(
            f"similarity {sim.name!r}: score raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(s, np.ndarray):
        try:
            s = np.asarray(s)
        except Exception:
            raise TypeError(
                f"similarity {sim.name!r}: score returned {describe(s)}, expected an "
                f"ndarray of shape {want}") from None
    if s.shape != want:
        raise ValueError(
            f"similarity {sim.name!r}: score returned shape {s.shape}, expected "
            f"(..., tq, tk) = {want}")
    if s.dtype.kind != "f":
        raise TypeError(
            f"similarity {sim.name!r}: score returned dtype {s.dtype}, expected a real "
            f"floating dtype (float32 or float64)")
    if s.dtype != cdt and s.dtype.itemsize > cdt.itemsize:
        # check before narrowing: a cast would turn huge finite scores into inf
        # (with a RuntimeWarning) and blame them on the plugin as "+inf"
        with np.errstate(invalid="ignore"):
            bad = np.isnan(s).any() or np.isposinf(s).any()
        if bad:
            raise ValueError(
                f"similarity {sim.name!r}: score returned NaN or +inf values (only -inf, "
                "'may not attend', is allowed)")
        if not _fits(s, cdt):
            big = float(np.max(np.abs(s), where=np.isfinite(s), initial=0))
            raise ValueError(
                f"similarity {sim.name!r}: score returned values out of {cdt.name} range "
                f"(the compute dtype; max {np.finfo(cdt).max:.4g}), got max |score| {big:.4g} "
                f"in {s.dtype}")
    # a fresh C-ordered copy: it is changed in place below, and pv_acc reads
    # it as rows with a contiguous last axis (score() may return any layout:
    # NumPy keeps its operands' order, e.g. Fortran-ordered for such keys)
    s = s.astype(cdt, order="C", copy=True)
    with np.errstate(invalid="ignore"):
        bad = np.isnan(s).any() or np.isposinf(s).any()
    if bad:
        raise ValueError(
            f"similarity {sim.name!r}: score returned NaN or +inf values (only -inf, "
            f"'may not attend', is allowed){_nonfinite_inputs(qt, kt)}")
    return s


def _nonfinite_inputs(q, k) -> str:
    """The end of a 'score returned NaN' message: which input holds NaN / inf, if any."""
    bad = [n for n, a in (("query", q), ("key", k)) if a is not None and not np.isfinite(a).all()]
    if not bad:
        return ""
    return (f"; {' and '.join(bad)} contain{'s' if len(bad) == 1 else ''} NaN or infinite values "
            "(a similarity plugin's scores must be finite or -inf: check the inputs)")


def _tile_scores(c, Q, K, M, i0, i1, j0, j1):
    """Masked scores of queries [i0, i1) x keys [j0, j1), or None if all forbidden."""
    p = c.p
    mt = None
    if M is not None:
        mt = M[..., i0:i1, j0:j1]
        if p.mask_kind == _masks.MASK_BOOL and not mt.any():
            return None
    s = _score_tile(c.sim, Q[..., i0:i1, :], K[..., j0:j1, :], c.params, p.cdt)
    _mask_tile(p, mt, s, i0, i1, j0, j1)
    return s


def _mask_tile(p, mt, s, i0, i1, j0, j1):
    """Apply the mask tile ``mt`` (or None) and causality to the scores ``s`` of
    queries [i0, i1) x keys [j0, j1), in place."""
    if mt is not None:
        if p.mask_kind == _masks.MASK_BOOL:
            s[~np.broadcast_to(mt, s.shape)] = -np.inf
        else:
            s += mt
    if p.causal:
        lim = np.arange(i0, i1)[:, None] + p.causal_offset
        forbid = np.arange(j0, j1)[None, :] > lim
        if forbid.any():
            s[..., forbid] = -np.inf


def _pv_acc(p, v, acc, batch):
    """acc += p @ v.  Not NumPy's matmul: its multi-threaded BLAS stalled these
    small products (a 4x256x256 NumPy plugin took 1 s instead of 4 ms in a
    benchmark run while another process held a core)."""
    if _scores is None or p.dtype != acc.dtype or v.dtype != acc.dtype:  # pragma: no cover
        acc += np.matmul(p, v)
        return
    v = canonical_matrix_stack(v, acc.dtype)
    _scores.pv_acc(p, v, acc, batch)


def _batch_chunks(batch, per_item):
    """Index tuples cutting ``batch`` into chunks of at most
    max(1, PY_BLOCK_Q * PY_BLOCK_K // per_item) items, each a basic index (a
    view): the trailing batch dims that fit whole, a slice of the dim before
    them, ints for the rest.  ``()`` when the whole batch fits."""
    cap = max(1, (PY_BLOCK_Q * PY_BLOCK_K) // max(per_item, 1))
    s = len(batch)
    while s > 0 and math.prod(batch[s - 1:]) <= cap:
        s -= 1
    if s == 0:
        yield ()
        return
    step = max(1, cap // math.prod(batch[s:]))
    n = batch[s - 1]
    for idx in np.ndindex(*batch[:s - 1]):
        for c0 in range(0, n, step):
            yield idx + (slice(c0, min(n, c0 + step)),)


def _run_tiled(c, res, weights, lse=None):
    """The NumPy streaming softmax, through the batch in chunks so that a
    score tile holds at most ~PY_BLOCK_Q x PY_BLOCK_K scores (one batch item's
    tile when Lq, Lk are large): memory O(tile), not O(batch x tile)."""
    p = c.p
    batch = p.batch
    Q = np.broadcast_to(c.q, batch + c.q.shape[-2:])
    K = np.broadcast_to(c.k, batch + c.k.shape[-2:])
    V = np.broadcast_to(p.v, batch + p.v.shape[-2:])
    M = None if p.mask is None else np.broadcast_to(p.mask, batch + (p.Lq, p.Lk))
    per_item = min(p.Lq, PY_BLOCK_Q) * min(p.Lk, PY_BLOCK_K)
    for ix in _batch_chunks(batch, per_item):
        r = res[ix]
        _run_tiled_chunk(c, Q[ix], K[ix], V[ix], None if M is None else M[ix], r,
                         None if weights is None else weights[ix],
                         None if lse is None else lse[ix], r.shape[:-2])


def _row_lse(m, l):
    """log-sum-exp of softmax rows from their reference max ``m`` (-inf for a row
    with no allowed key) and sum ``l`` of exp(s - m): -inf where ``l == 0``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(l > 0, np.where(m == -np.inf, 0, m) + np.log(np.where(l > 0, l, 1)),
                        -np.inf).astype(m.dtype, copy=False)


def _run_tiled_chunk(c, Q, K, V, M, res, weights, lse, batch):
    p = c.p
    cdt = p.cdt
    Lq, Lk = p.Lq, p.Lk
    neg_inf = cdt.type(-np.inf)
    for i0 in range(0, Lq, PY_BLOCK_Q):
        i1 = min(Lq, i0 + PY_BLOCK_Q)
        kend = Lk
        if p.causal:
            kend = max(0, min(Lk, i1 - 1 + p.causal_offset + 1))
        if weights is not None:
            W = weights[..., i0:i1, :]
            W[...] = neg_inf
            for j0 in range(0, kend, PY_BLOCK_K):
                j1 = min(kend, j0 + PY_BLOCK_K)
                s = _tile_scores(c, Q, K, M, i0, i1, j0, j1)
                if s is not None:
                    W[..., j0:j1] = s
            mx = W.max(axis=-1, keepdims=True) if Lk else np.full(W.shape[:-1] + (1,), neg_inf)
            full = mx == neg_inf
            with np.errstate(invalid="ignore", over="ignore"):
                np.exp(W - np.where(full, 0, mx), out=W)
                l = W.sum(axis=-1, keepdims=True)
                W /= np.where(l > 0, l, 1)
            W[np.broadcast_to(full, W.shape)] = 0
            if lse is not None:
                lse[..., i0:i1] = _row_lse(mx[..., 0], l[..., 0])
            np.matmul(W, V, out=res[..., i0:i1, :])
            continue
        m = np.full(batch + (i1 - i0,), neg_inf, dtype=cdt)
        l = np.zeros(batch + (i1 - i0,), dtype=cdt)
        acc = res[..., i0:i1, :]
        acc[...] = 0
        for j0 in range(0, kend, PY_BLOCK_K):
            j1 = min(kend, j0 + PY_BLOCK_K)
            s = _tile_scores(c, Q, K, M, i0, i1, j0, j1)
            if s is None:
                continue
            mnew = np.maximum(m, s.max(axis=-1))
            msafe = np.where(mnew == neg_inf, 0, mnew)
            with np.errstate(invalid="ignore", over="ignore"):
                alpha = np.exp(m - msafe)
                s -= msafe[..., None]
                np.exp(s, out=s)
            l *= alpha
            l += s.sum(axis=-1)
            acc *= alpha[..., None]
            _pv_acc(s, V[..., j0:j1, :], acc, batch)
            m = mnew
        with np.errstate(invalid="ignore", divide="ignore"):
            acc /= np.where(l > 0, l, 1)[..., None]
        acc[l == 0] = 0
        if lse is not None:
            lse[..., i0:i1] = _row_lse(m, l)


# ------------------------------------------------------------- fused C path

def _pad(n):
    return -(-max(n, 1) // PAD) * PAD


_hook_done = False


def _ensure_blas_hook():
    """Give the projections the hook that holds SciPy's OpenBLAS at one thread
    per task (the one fastattn._threads found for the SDPA kernel)."""
    global _hook_done
    if _hook_done:
        return
    _threads.ensure_blas_hook()
    path = _threads._blas_hook_library
    if path is not None:
        try:
            lib = ctypes.CDLL(path)
            for sym in ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local"):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    _scores.set_blas_threads_hook(ctypes.cast(fn, ctypes.c_void_p).value)
                    break
        except OSError:  # pragma: no cover - the library was found a moment ago
            pass
    _install_runtime()
    _hook_done = True


def _install_runtime() -> bool:
    """Hand _scores the C addresses of _kernels' worker pool and BLAS hold, so
    one process has one pool and one BLAS thread count (overlapping SDPA and
    additive calls used to restore each other's setting)."""
    return _threads.install_runtime(_scores.set_runtime, simd=False) and _scores.runtime_shared()


_FEW_ROWS = 16


def _project(x, w, b, cdt, n_threads, pad=True):
    """x (..., L, d) @ w.T (+ b) into a (..., L, pad(d_a)) buffer (zero padding
    columns), by SciPy's gemm on fastattn's threads (BLAS held at one thread
    each: NumPy's multi-threaded matmul was 0.5-32 ms instead of 0.3 ms for
    1024 x 64 x 64 while another process held a core)."""
    d_a = w.shape[0]
    dp = _pad(d_a) if pad else d_a
    buf = (np.zeros if dp != d_a or x.shape[-1] == 0 else np.empty)(x.shape[:-1] + (dp,), dtype=cdt)
    d = x.shape[-1]
    if d and x.size and d_a and x.size // d <= _FEW_ROWS:
        # a few rows (a decoder step's query): NumPy's gemv / small gemm, single
        # threaded, 21 us at 1 x 256 -> 768 float32 where sgemm took 160 us
        y = buf.reshape(-1, dp)
        y[:, :d_a] = np.matmul(x.reshape(-1, d), w.T)
        if b is not None:
            y[:, :d_a] += b
    elif d and x.size and d_a:
        x2 = np.ascontiguousarray(x).reshape(-1, d)  # no copy for C-contiguous x
        if w.shape[0] > 1 and (w.strides[-1] != w.itemsize
                               or w.strides[0] // w.itemsize > _validation.BLAS_INT_MAX):
            w = np.ascontiguousarray(w)  # (a row stride is a BLAS leading dimension)
        nt = n_threads if x2.shape[0] * d * d_a >= PARALLEL_MIN_WORK else 1
        rc = _scores.project(x2, w, None if b is None else np.ascontiguousarray(b),
                             buf.reshape(-1, dp), nt)
        if rc:
            raise RuntimeError(f"fastattn: projection kernel rejected its arguments (status {rc})")
    elif b is not None:
        buf[..., :d_a] += b
    return buf


def _pad_columns(x, dp, cdt):
    """Keys that are already projected (``PrecomputedAdditiveSimilarity``) in the
    kernel's zero-padded layout; no copy when the width is already a multiple of 8."""
    if x.shape[-1] == dp and x.dtype == cdt and x.flags.c_contiguous:
        return x
    buf = np.zeros(x.shape[:-1] + (dp,), dtype=cdt)
    buf[..., :x.shape[-1]] = x
    return buf


def _plugin_functions(sim):
    """(score_f32, score_f64, score_backward_f32, score_backward_f64) of a
    compiled plugin, C addresses (0: not provided; a version 1 plugin has no
    backward)."""
    cap = sim.capsule
    info = _scores.capsule_info(cap)
    if info is None:
        raise TypeError(
            f"similarity {sim.name!r}: capsule must be a PyCapsule named "
            f"{PLUGIN_CAPSULE_NAME!r} (or a version 1 plugin's {PLUGIN_CAPSULE_NAME_V1!r}), "
            f"got {describe(cap) if not type(cap).__name__ == 'PyCapsule' else repr(cap)}")
    version, abi, f32, f64, b32, b64 = info
    if abi != version:
        raise TypeError(
            f"similarity {sim.name!r}: plugin ABI version {abi} in a capsule named "
            f"{(PLUGIN_CAPSULE_NAME if version == 2 else PLUGIN_CAPSULE_NAME_V1)!r}, "
            f"this fastattn expects {version} there (it supports ABI versions 1 and "
            f"{PLUGIN_ABI_VERSION})")
    return f32, f64, b32, b64


def _run_fused(c, res, weights, lse=None):
    p = c.p
    cdt = p.cdt
    nt = p.n_threads
    if isinstance(c.sim, CompiledSimilarity):
        f32, f64, _, _ = _plugin_functions(c.sim)
        fn = f32 if cdt == np.float32 else f64
        if not fn:
            raise TypeError(f"similarity {c.sim.name!r}: the plugin has no {cdt} score function")
        packed = c.sim.pack_params(c.params, c.d_q, cdt)
        if not isinstance(packed, np.ndarray) or not packed.flags.c_contiguous:
            raise TypeError(
                f"similarity {c.sim.name!r}: pack_params must return a C-contiguous ndarray, "
                f"got {describe(packed)}")
        qx, kx, kind, d = c.q, c.k, _scores.SCORE_PLUGIN, c.d_q
        if d == 0:
            qx = np.zeros(c.q.shape[:-1] + (1,), cdt)
            kx = np.zeros(c.k.shape[:-1] + (1,), cdt)
    else:
        _, wq, wk, b, vvec = c.lowered
        d_a = vvec.shape[0]
        if _pad(d_a) > _validation.BLAS_INT_MAX:
            raise ValueError(
                f"params: attention size d_a={d_a} (padded to {_pad(d_a)}) "
                f"exceeds the BLAS 32-bit integer range (max {_validation.BLAS_INT_MAX})")
        _ensure_blas_hook()
        # wq None: the queries are projected already (ProjectedAdditiveSimilarity)
        qx = _project(c.q, wq, b, cdt, nt) if wq is not None else _pad_columns(c.q, _pad(d_a), cdt)
        kx = _project(c.k, wk, None, cdt, nt) if wk is not None else _pad_columns(c.k, qx.shape[-1], cdt)
        packed = np.zeros(qx.shape[-1], dtype=cdt)
        packed[:vvec.shape[0]] = vvec
        fn, kind = 0, _scores.SCORE_ADDITIVE
        d = qx.shape[-1]
    v, res_k = p.v, res
    if p.dv == 0:
        v = np.zeros(p.v.shape[:-1] + (1,), cdt)
        res_k = np.empty(p.batch + (p.Lq, 1), cdt)
    work = math.prod(p.batch) * p.Lq * p.Lk * max(d, 1)
    if work < PARALLEL_MIN_WORK:
        nt = 1
    bq = max(1, min(C_BLOCK_Q, p.Lq))
    nb = math.prod(p.batch)
    while nt > 1 and bq > 8 and nb * -(-p.Lq // bq) < 2 * nt:
        bq = (bq + 1) // 2
    if c.kcache is not None and kind == _scores.SCORE_ADDITIVE and res_k is res:
        # a PreparedAttention's signature: everything but the queries is fixed
        c.kcache[:] = (wq, b, kx, packed, bq, nt)
    _launch_additive(c, qx, kx, v, res_k, weights, bq, nt, kind, fn, packed, lse)


def _launch_additive(c, qx, kx, v, res, weights, bq, nt, kind, fn, packed, lse=None):
    p = c.p
    _scores.sync_simd(_kernels.simd_level())
    rc, prc = _scores.tiled_attention(qx, kx, v, p.mask, p.mask_kind, res, weights, p.batch,
                                      p.causal, p.causal_offset, bq, C_BLOCK_K, nt, kind, fn,
                                      packed, kind == _scores.SCORE_PLUGIN,
                                      None if lse is None else lse[..., None])
    if rc:
        _raise_kernel(rc, prc, c.sim, c)


def _raise_kernel(rc, prc, sim, c=None):
    if rc == _scores.FA_ENOMEM:
        raise MemoryError("fastattn: could not allocate kernel scratch memory")
    if rc == _scores.FA_ESCORE:
        raise SimilarityError(
            f"similarity {sim.name!r}: the compiled score function returned error code {prc}")
    if rc == _scores.FA_ENONFINITE:
        hint = "" if c is None else _nonfinite_inputs(getattr(c, "q", None), getattr(c, "k", None))
        raise ValueError(
            f"similarity {sim.name!r}: score returned NaN or +inf values (only -inf, "
            f"'may not attend', is allowed){hint}")
    raise RuntimeError(f"fastattn: kernel rejected its arguments (status {rc})")  # a bug


# ------------------------------------------------------------------ backward

# A lowered scale smaller than this: the backward runs SDPA's backward on the
# queries times the scale (scale 1) instead of dividing dq by the scale to
# get its gradient (exact at scale 0, no underflow near it).
_SCALE_MIN = 2.0 ** -30
# NumPy tiled backward: at most about this many elements in a (query block x
# key tile [x d_a]) temporary (additive: tanh tiles of d_a values per pair).
PY_BWD_TILE_ELEMS = 1 << 18


def _definer(cls, name):
    """(position in the MRO, class) of the class that defines ``name``."""
    for i, k in enumerate(cls.__mro__):
        if name in k.__dict__:
            return i, k
    return len(cls.__mro__), None


def _has_lower_backward(sim) -> bool:
    """The class that defines sim's ``_lower`` (a fast path) also defines its
    ``_lower_backward`` (or a subclass of it does)."""
    if isinstance(sim, CompiledSimilarity):
        return False  # its forward never uses _lower
    il, kl = _definer(type(sim), "_lower")
    ib, kb = _definer(type(sim), "_lower_backward")
    return kl not in (None, Similarity) and kb not in (None, Similarity) and ib <= il


def _has_score_backward(sim) -> bool:
    """sim has a NumPy ``score`` and a ``score_backward`` defined with it (by
    the class that defines ``score`` or a subclass of it)."""
    i_s, ks = _definer(type(sim), "score")
    ib, kb = _definer(type(sim), "score_backward")
    return ks not in (None, Similarity) and kb not in (None, Similarity) and ib <= i_s


def _no_backward(sim, dtype=None):
    if isinstance(sim, CompiledSimilarity):
        what = "" if dtype is None else f" {np.dtype(dtype).name}"
        why = (f"its compiled plugin has no{what} score_backward (ABI version "
               f"{PLUGIN_ABI_VERSION}'s score_backward_f32 / score_backward_f64) and the class "
               "defines no NumPy score and score_backward")
        how = ("fill in the plugin's score_backward entry (see fastattn_plugin.h), or give "
               "the class a NumPy score and score_backward(query, key, params, grad_scores) "
               "-> (dq, dk, dparams)")
    else:
        why = "it defines no score_backward"
        how = ("give it a NumPy score and score_backward(query, key, params, grad_scores) -> "
               "(dq, dk, dparams) (see fastattn.similarity.Similarity.score_backward)")
    return NotImplementedError(
        f"attention_backward: similarity {sim.name!r} has no backward ({why}); {how}")


def _plugin_backward(sim):
    """A compiled plugin's (score_f32, score_f64, score_backward_f32,
    score_backward_f64) when it has a C backward of some dtype, else None."""
    if not isinstance(sim, CompiledSimilarity) or sim.capsule is None:
        return None
    fns = _plugin_functions(sim)
    return fns if (fns[2] or fns[3]) else None


@_alloc.cached
def attention_backward(grad_out, query, key, value, similarity="dot", *, params=None, out, lse,
                       attn_mask=None, is_causal=False, causal_alignment="top_left",
                       n_threads=None):
    """Gradients of :func:`attention`.

    Parameters
    ----------
    grad_out : array_like (..., Lq, dv)
        dL/d(output), the shape of the forward's output.
    query, key, value, similarity, params, attn_mask, is_causal, causal_alignment
        The forward's arguments, unchanged.
    out, lse : array_like
        What ``attention(..., return_lse=True)`` returned: the output (..., Lq,
        dv) and its row log-sum-exp (..., Lq).  The scores are recomputed
        tile by tile from them (``P = exp(S - lse)``), never an ``Lq x Lk``
        matrix.
    n_threads : int, optional
        Threads for the C backwards (dot-like similarities, ``additive``,
        ``concat``); the NumPy tiled backward runs on the calling thread.

    Returns
    -------
    ``(dq, dk, dv, dparams)``: each array gradient in its input's shape
    (dims that were broadcast are summed back) and dtype (a non-float input
    gets the compute dtype); ``dparams`` a dict with the keys of the checked
    ``params`` (defaults filled in included, e.g. ``general``'s ``scale``;
    empty for ``dot``), each in its parameter's shape.  Rows with no allowed
    key give zero gradients.

    ``dot``, ``scaled_dot``, ``general`` and ``cosine`` run the C backward of
    :func:`fastattn.functional.sdpa_backward` on the queries and keys their
    forward lowered to (projected / normalised), then the chain rule;
    ``additive`` and ``concat`` project queries and keys once and run the
    fused C backward (tanh tiles recomputed, never a ``Lq x Lk x d_a``
    array; extra memory O(batch x (Lq + Lk) x d_a); the same bits for any
    ``n_threads``); a Python similarity with a
    :meth:`~fastattn.similarity.Similarity.score_backward` runs a NumPy tiled
    backward, and so does a compiled plugin with a C ``score_backward`` (ABI
    version 2), with its C functions on the tiles.  A similarity without a
    backward (a version 1 plugin, a Python similarity without
    ``score_backward``) raises NotImplementedError before any work.
    """
    sim = get_similarity(similarity)
    lowered_ok = _has_lower_backward(sim)
    score_ok = _has_score_backward(sim)
    plugin = _plugin_backward(sim) if _scores is not None else None
    if not (lowered_ok or score_ok or plugin):
        raise _no_backward(sim)
    c = _prepare(query, key, value, sim, params, attn_mask, is_causal, False, causal_alignment,
                 None, n_threads)
    p = c.p
    cdt = p.cdt
    if plugin:
        single = cdt == np.float32
        fn, bfn = (plugin[0], plugin[2]) if single else (plugin[1], plugin[3])
        if not bfn:
            if not score_ok:
                raise _no_backward(sim, cdt)
            plugin = None  # the class's NumPy score and score_backward
        elif not fn:
            raise TypeError(f"similarity {sim.name!r}: the plugin has no {cdt} score function")
    osh = p.batch + (p.Lq, p.dv)
    g = canonical_matrix_stack(check_grad_array(grad_out, "grad_out", osh), cdt)
    o = canonical_matrix_stack(check_grad_array(out, "out", osh), cdt)
    ls = np.asarray(check_grad_array(lse, "lse", p.batch + (p.Lq,)), dtype=cdt)
    kind = c.lowered[0] if lowered_ok and c.lowered is not None else None
    if plugin:
        dq, dk, dv, dparams = _backward_plugin(c, g, o, ls, fn, bfn)
    elif kind in ("sdpa", "project_sdpa"):
        dq, dk, dv, dparams = _backward_sdpa(c, g, o, ls)
    elif kind == "additive":
        dq, dk, dv, dparams = _backward_additive(c, g, o, ls)
    elif score_ok:
        dq, dk, dv, dparams = _backward_scores(c, g, o, ls)
    else:  # a _lower_backward, but _lower gave no lowering this time
        raise _no_backward(sim)
    grads = (sum_to_shape(dq, c.q.shape).astype(_validation.grad_dtype(query, cdt), copy=False),
             sum_to_shape(dk, c.k.shape).astype(_validation.grad_dtype(key, cdt), copy=False),
             sum_to_shape(dv, p.v.shape).astype(_validation.grad_dtype(value, cdt), copy=False))
    return grads + (_param_grads(c, params, dparams),)


class _SteppedAttention:
    """:func:`attention` (with ``return_lse``) and :func:`attention_backward`
    of one query shape over one fixed memory, similarity, params and mask, for
    many calls (AttentionDecoder's training loop: one query a step, forward and
    backward): the arguments are checked once, here, and each call hands its
    query to the checked call (as :class:`PreparedAttention` does for its
    forward) and runs the fused additive kernels, forward and backward, as
    those functions do -- the same floats.  Fused additive lowerings only (a
    ``TypeError`` otherwise).  Internal: queries, gradients, outputs and lse of
    the shapes and compute dtype of the template, made by the caller; key,
    value, params and mask must not change while it is used."""

    def __init__(self, query, key, value, similarity, params=None, attn_mask=None,
                 n_threads=None):
        sim = get_similarity(similarity)
        self.fwd = _prepare(query, key, value, sim, params, attn_mask, False, False, "top_left",
                            None, n_threads, return_lse=True)
        if (_path(self.fwd) != "fused" or isinstance(sim, CompiledSimilarity)
                or self.fwd.lowered[0] != "additive" or not _has_lower_backward(sim)):
            raise TypeError(f"similarity {sim.name!r}: expected a fused additive lowering")
        self.bwd = _prepare(query, key, value, sim, params, attn_mask, False, False, "top_left",
                            None, n_threads)
        self.shape, self.cdt = self.fwd.q.shape, self.fwd.p.cdt
        _, wq, wk, _, vvec = self.fwd.lowered
        self.d_a = vvec.shape[0]
        p = self.bwd.p
        # the keys' and values' gradients summed over backward calls in the
        # kernel (projected keys, unbroadcast batch only: accumulate=True)
        self._acc = None
        if wk is None and tuple(self.bwd.k.shape[:-1]) == tuple(p.batch) + (p.Lk,) and \
                tuple(p.v.shape[:-1]) == tuple(p.batch) + (p.Lk,):
            self._acc = (np.zeros(p.batch + (p.Lk, _pad(self.d_a)), self.cdt),
                         np.zeros(p.batch + (p.Lk, p.dv), self.cdt))

    def _with(self, c, q):
        if q.shape != self.shape or q.dtype != self.cdt:
            raise ValueError(f"query: expected shape {self.shape} and dtype {self.cdt}, got "
                             f"{q.shape} {q.dtype}")
        c = copy.copy(c)
        c.q = canonical_matrix_stack(q, self.cdt)
        return c

    def forward(self, q):
        """``(out, lse)`` as ``attention(q, ..., return_lse=True)``."""
        return _execute(self._with(self.fwd, q))

    def _sums(self):
        if self._acc is None:
            raise TypeError("accumulate: needs projected keys (no W_k) and an unbroadcast batch")
        return self._acc

    def start_accumulating(self):
        """Zero the sums that :meth:`backward` with ``accumulate`` adds to."""
        for a in self._sums():
            a[...] = 0

    def accumulated(self):
        """``(dk, dv)``: the sums of the ``accumulate`` backward calls since
        :meth:`start_accumulating` (dk a view of the kernel's padded layout)."""
        return self._acc[0][..., :self.d_a], self._acc[1]

    def backward(self, grad_out, q, out, lse, accumulate=False):
        """``(dq, dk, dv, dparams)`` as :func:`attention_backward` (dparams in
        the similarity's names, the compute dtype).  ``accumulate``: dk and dv
        are added by the kernel to :meth:`accumulated`'s sums (the same floats
        as adding the returned arrays) and returned as None."""
        c = self._with(self.bwd, q)
        p = c.p
        osh = p.batch + (p.Lq, p.dv)
        for name, a in (("grad_out", grad_out), ("out", out)):
            if a.shape != osh:
                raise ValueError(f"{name}: expected shape {osh}, got {a.shape}")
        g = canonical_matrix_stack(grad_out, self.cdt)
        o = canonical_matrix_stack(out, self.cdt)
        return _backward_additive(c, g, o, np.asarray(lse, dtype=self.cdt),
                                  self._sums() if accumulate else None)


def _param_grads(c, params, dparams):
    """dparams with the keys of the checked params, each in its parameter's
    shape and dtype (the compute dtype for a non-float or defaulted one)."""
    if not isinstance(c.params, dict):
        return {}
    raw = params if isinstance(params, dict) else {}
    res = {}
    for name, val in c.params.items():
        shape = np.shape(val)
        grad = dparams.get(name)
        dt = _validation.grad_dtype(raw[name], c.p.cdt) if raw.get(name) is not None else c.p.cdt
        if grad is None:
            res[name] = np.zeros(shape, dt)
        else:
            res[name] = np.asarray(grad).astype(dt, copy=False).reshape(shape)
    return res


def _dot64(a, b) -> float:
    """sum(a * b) in float64."""
    return float(np.sum(np.multiply(a, b, dtype=np.float64)))


def _backward_sdpa(c, g, o, ls):
    """Dot-like similarities: SDPA's backward on the lowered queries and keys,
    then the similarity's chain rule (its ``_lower_backward``).

    With S = s q2 k2^T, sdpa_backward gives dq2 = s dS k2 and dk2 = s dS^T q2,
    so ds = sum(dS o q2 k2^T) = sum(dq2 o q2) / s.  For |s| < _SCALE_MIN it
    runs on q2' = s q2 with scale 1 instead (the same scores): dq2' = dS k2,
    ds = sum(dq2' o q2), dq2 = s dq2'.  A ``"project_sdpa"`` lowering (q2 =
    q M^T) adds dq = dq2 M and dM = sum over rows of dq2^T q."""
    kind, q2, k2, scale = c.lowered
    p = c.p
    M = None
    if kind == "project_sdpa":
        M = q2
        q2 = _project_queries(c, M)

    def run(qq, sc):
        return _sdpa.sdpa_backward(g, qq, k2, p.v, o, ls, c.attn_mask, p.causal, sc,
                                   causal_alignment=c.causal_alignment, n_threads=p.n_threads)

    if abs(scale) >= _SCALE_MIN:
        dq2, dk2, dv = run(q2, scale)
        dscale = _dot64(dq2, q2) / scale
    else:
        s = q2.dtype.type(scale)
        dq1, dk2, dv = run(q2 * s, 1.0)
        dscale = _dot64(dq1, q2)
        dq2 = dq1 * s
    grads = {"query": dq2, "key": dk2, "scale": dscale}
    if M is not None:
        grads["query"] = np.matmul(dq2, M)
        grads["M"] = _sum_rows_t(dq2, c.q)
    dq, dk, dparams = c.sim._lower_backward(c.q, c.k, c.params, grads)
    return dq, dk, dv, dparams


def _additive_bwd_plan(p, d):
    """(block_q, block_k, key groups, threads) of the fused additive backward
    of a prepared call with at least one row, key and value feature (d: the
    padded attention size).  The key groups follow the shapes only, never the
    thread count, so the gradients are the same bits for any n_threads."""
    nb = math.prod(p.batch)
    bq = max(1, min(C_BWD_BLOCK_Q, p.Lq))
    bk = max(1, min(C_BWD_BLOCK_K, p.Lk))
    nkb = -(-p.Lk // bk)
    ng = 1 if nb >= C_BWD_MIN_TASKS else max(
        1, min(nkb, -(-C_BWD_MIN_TASKS // max(nb, 1)), _scores.BWD_MAX_GROUPS))
    nt = p.n_threads if nb * p.Lq * p.Lk * d >= PARALLEL_MIN_WORK else 1
    return bq, bk, ng, nt


def _backward_additive(c, g, o, ls, acc=None):
    """``additive`` / ``concat``: the fused C backward (csrc/fa_additive_bwd_impl.h)
    over the projections qp = q W_q^T + b and kp = k W_k^T (computed once, as
    the forward does, zero-padded to a multiple of PAD features): it recomputes
    the tanh tiles and returns the gradients of qp, kp, the v vector and the
    values; the weight gradients afterwards, as a few products over all rows.
    The NumPy tiled backward (:func:`_backward_additive_tiled`) only runs while
    the extension is not built.  ``acc`` (:class:`_SteppedAttention`): ``(dkp,
    dv)`` accumulators of the kernel's padded layout that the kernel adds the
    keys' and values' gradients to; dk and dv are then returned as None."""
    if _scores is None:  # pragma: no cover - only while the extension is not built
        return _backward_additive_tiled(c, g, o, ls)
    _, wq, wk, b, vvec = c.lowered
    p = c.p
    cdt = p.cdt
    d_a = vvec.shape[0]
    if _pad(d_a) > _validation.BLAS_INT_MAX:
        raise ValueError(
            f"params: attention size d_a={d_a} (padded to {_pad(d_a)}) "
            f"exceeds the BLAS 32-bit integer range (max {_validation.BLAS_INT_MAX})")
    _ensure_blas_hook()
    qp = _project(c.q, wq, b, cdt, p.n_threads) if wq is not None else _pad_columns(c.q, _pad(d_a), cdt)
    dp = qp.shape[-1]
    kp = _project(c.k, wk, None, cdt, p.n_threads) if wk is not None else _pad_columns(c.k, dp, cdt)
    nb = math.prod(p.batch)
    if nb and p.Lq and p.Lk and p.dv:
        vpad = np.zeros(dp, cdt)
        vpad[:d_a] = vvec
        if ls.dtype != cdt or (p.Lq > 1 and ls.strides[-1] != ls.itemsize) or not ls.flags.aligned:
            ls = np.array(ls, dtype=cdt, order="C")
        bq, bk, ng, nt = _additive_bwd_plan(p, dp)
        dqp = np.empty(p.batch + (p.Lq, dp), cdt)
        if acc is None:
            dkp = np.empty(p.batch + (p.Lk, dp), cdt)
            dv = np.empty(p.batch + (p.Lk, p.dv), cdt)
        else:
            dkp, dv = acc
        dvec = np.empty(dp, np.float64)
        delta = np.empty(nb * p.Lq, np.float64)
        part = np.empty(ng * nb * p.Lq * dp, np.float64)
        vpart = np.empty(nb * ng * dp, np.float64)
        _scores.sync_simd(_kernels.simd_level())
        rc = _scores.additive_backward(qp, kp, vpad, p.v, o, g, ls[..., None], p.mask,
                                       p.mask_kind, dqp, dkp, dv, dvec, delta, part, vpart,
                                       p.batch, p.causal, p.causal_offset, bq, bk, nt, ng,
                                       acc is not None)
        if rc:
            _raise_kernel(rc, 0, c.sim, c)
    else:  # no output element depends on anything: zeros
        dqp = np.zeros(p.batch + (p.Lq, dp), cdt)
        dkp = np.zeros(p.batch + (p.Lk, dp), cdt)
        dv = np.zeros(p.batch + (p.Lk, p.dv), cdt)
        dvec = np.zeros(dp, np.float64)
    dqp = sum_to_shape(dqp[..., :d_a], c.q.shape[:-1] + (d_a,))
    if acc is not None:   # the keys' and values' gradients went into the accumulators
        grads = _additive_grads(c.q, None, wq, None, dqp, None, dvec[:d_a].astype(cdt), p.n_threads)
        dq, _, dparams = c.sim._lower_backward(c.q, c.k, c.params, grads)
        return dq, None, None, dparams
    dkp = sum_to_shape(dkp[..., :d_a], c.k.shape[:-1] + (d_a,))
    grads = _additive_grads(c.q, c.k, wq, wk, dqp, dkp, dvec[:d_a].astype(cdt), p.n_threads)
    dq, dk, dparams = c.sim._lower_backward(c.q, c.k, c.params, grads)
    return dq, dk, dv, dparams


def _backward_additive_tiled(c, g, o, ls):
    """``additive`` / ``concat`` through the NumPy tiled backward (the fused
    kernel's fallback and its cross-check in the tests): the projections
    qp = q W_q^T + b and kp = k W_k^T once, :class:`_AdditiveTiles` on every
    tile, the weight gradients afterwards."""
    _, wq, wk, b, vvec = c.lowered
    p = c.p
    cdt = p.cdt
    if _scores is not None:
        _ensure_blas_hook()
        qp = c.q if wq is None else _project(c.q, wq, b, cdt, p.n_threads, pad=False)
        kp = c.k if wk is None else _project(c.k, wk, None, cdt, p.n_threads, pad=False)
    else:  # pragma: no cover - only while the extension is not built
        qp = c.q if wq is None else np.matmul(c.q, wq.T) + (0 if b is None else b)
        kp = c.k if wk is None else np.matmul(c.k, wk.T)
    tiles = _AdditiveTiles(p, qp, kp, vvec)
    dv = _tiled_backward(c, g, o, ls, tiles)
    dqp = sum_to_shape(tiles.dq, qp.shape)
    dkp = sum_to_shape(tiles.dk, kp.shape)
    grads = _additive_grads(c.q, c.k, wq, wk, dqp, dkp, tiles.dv.astype(cdt))
    dq, dk, dparams = c.sim._lower_backward(c.q, c.k, c.params, grads)
    return dq, dk, dv, dparams


def _backward_scores(c, g, o, ls):
    """A similarity's own ``score`` and ``score_backward`` on every tile."""
    tiles = _ScoreTiles(c)
    dv = _tiled_backward(c, g, o, ls, tiles)
    return tiles.dq, tiles.dk, dv, tiles.dparams


def _backward_plugin(c, g, o, ls, fn, bfn):
    """A compiled plugin's C score and score_backward on every tile (the
    tiled backward's softmax part in NumPy on the calling thread)."""
    tiles = _PluginTiles(c, fn, bfn)
    dv = _tiled_backward(c, g, o, ls, tiles)
    d = c.q.shape[-1]
    dparams = c.sim.unpack_param_grads(tiles.dpacked, c.params, c.d_q) if c.params else {}
    return tiles.dq[..., :d], tiles.dk[..., :c.k.shape[-1]], dv, dparams


class _PluginTiles:
    """Score tiles and their gradients from a compiled plugin's C functions
    (plugin_tiles / plugin_tiles_backward: one C call per batch item, GIL
    released); dL/d(packed params) accumulated in float64, tile after tile in
    a fixed order."""

    width = 1

    def __init__(self, c, fn, bfn):
        p = c.p
        cdt = p.cdt
        self.c, self.fn, self.bfn = c, fn, bfn
        q, k = c.q, c.k
        if q.shape[-1] == 0:  # as the forward: one zero feature (d >= 1 in the ABI)
            q = np.zeros(q.shape[:-1] + (1,), cdt)
            k = np.zeros(k.shape[:-1] + (1,), cdt)
        packed = c.sim.pack_params(c.params, c.d_q, cdt)
        if not isinstance(packed, np.ndarray) or not packed.flags.c_contiguous:
            raise TypeError(
                f"similarity {c.sim.name!r}: pack_params must return a C-contiguous ndarray, "
                f"got {describe(packed)}")
        self.packed = packed
        self.dpacked = np.zeros(packed.size, np.float64)
        self.Q = np.broadcast_to(q, p.batch + q.shape[-2:])
        self.K = np.broadcast_to(k, p.batch + k.shape[-2:])
        self.dq = np.zeros(self.Q.shape, cdt)
        self.dk = np.zeros(self.K.shape, cdt)

    def chunk(self, ix):
        self.Qc, self.Kc, self.dqc, self.dkc = self.Q[ix], self.K[ix], self.dq[ix], self.dk[ix]

    def scores(self, i0, i1, j0, j1):
        c = self.c
        cdt = c.p.cdt
        qt, kt = self.Qc[..., i0:i1, :], self.Kc[..., j0:j1, :]
        cb = qt.shape[:-2]
        n = math.prod(cb)
        self.qa = np.ascontiguousarray(qt).reshape(n, i1 - i0, qt.shape[-1])
        self.ka = np.ascontiguousarray(kt).reshape(n, j1 - j0, kt.shape[-1])
        s = np.empty((n, i1 - i0, j1 - j0), cdt)
        rc, prc = _scores.plugin_tiles(self.fn, self.packed, self.qa, self.ka, s)
        if rc:
            _raise_kernel(rc, prc, c.sim, c)
        if np.isnan(s).any() or np.isposinf(s).any():
            raise ValueError(
                f"similarity {c.sim.name!r}: score returned NaN or +inf values (only -inf, "
                f"'may not attend', is allowed){_nonfinite_inputs(c.q, c.k)}")
        return s.reshape(cb + s.shape[1:])

    def backward(self, i0, i1, j0, j1, ds):
        c = self.c
        qa, ka = self.qa, self.ka
        gs = np.ascontiguousarray(ds, dtype=c.p.cdt).reshape(qa.shape[0], qa.shape[1],
                                                             ka.shape[1])
        dq, dk = np.zeros(qa.shape, qa.dtype), np.zeros(ka.shape, ka.dtype)
        rc, prc = _scores.plugin_tiles_backward(self.bfn, self.packed, qa, ka, gs, dq, dk,
                                                self.dpacked)
        if rc:
            raise SimilarityError(
                f"similarity {c.sim.name!r}: the compiled score_backward function returned "
                f"error code {prc}")
        cb = ds.shape[:-2]
        self.dqc[..., i0:i1, :] += dq.reshape(cb + dq.shape[1:])
        self.dkc[..., j0:j1, :] += dk.reshape(cb + dk.shape[1:])


class _AdditiveTiles:
    """Score tiles v . tanh(qp_i + kp_j) and their gradients w.r.t. qp, kp, v."""

    def __init__(self, p, qp, kp, v):
        self.width = max(qp.shape[-1], 1)
        self.Q = np.broadcast_to(qp, p.batch + qp.shape[-2:])
        self.K = np.broadcast_to(kp, p.batch + kp.shape[-2:])
        self.dq = np.zeros(self.Q.shape, p.cdt)
        self.dk = np.zeros(self.K.shape, p.cdt)
        self.dv = np.zeros(v.shape, np.float64)
        self.v = v
        self.t = None

    def chunk(self, ix):
        self.Qc, self.Kc, self.dqc, self.dkc = self.Q[ix], self.K[ix], self.dq[ix], self.dk[ix]

    def scores(self, i0, i1, j0, j1):
        self.t = _additive_tanh(self.Qc[..., i0:i1, :], self.Kc[..., j0:j1, :])
        return np.matmul(self.t, self.v)

    def backward(self, i0, i1, j0, j1, ds):
        dqp, dkp, dv = _additive_tile_backward(self.t, self.v, ds)
        self.t = None
        self.dqc[..., i0:i1, :] += dqp
        self.dkc[..., j0:j1, :] += dkp
        self.dv += dv


class _ScoreTiles:
    """A Python similarity's score tiles and its score_backward, checked."""

    width = 1

    def __init__(self, c):
        p = c.p
        self.c = c
        self.Q = np.broadcast_to(c.q, p.batch + c.q.shape[-2:])
        self.K = np.broadcast_to(c.k, p.batch + c.k.shape[-2:])
        self.dq = np.zeros(self.Q.shape, p.cdt)
        self.dk = np.zeros(self.K.shape, p.cdt)
        self.shapes = ({n: np.shape(v) for n, v in c.params.items()}
                       if isinstance(c.params, dict) else {})
        self.dparams = {}

    def chunk(self, ix):
        self.Qc, self.Kc, self.dqc, self.dkc = self.Q[ix], self.K[ix], self.dq[ix], self.dk[ix]

    def scores(self, i0, i1, j0, j1):
        c = self.c
        return _score_tile(c.sim, self.Qc[..., i0:i1, :], self.Kc[..., j0:j1, :], c.params,
                           c.p.cdt)

    def backward(self, i0, i1, j0, j1, ds):
        c = self.c
        name = c.sim.name
        qt, kt = self.Qc[..., i0:i1, :], self.Kc[..., j0:j1, :]
        try:
            r = c.sim.score_backward(qt, kt, c.params, ds)
        except Exception as exc:
            raise SimilarityError(
                f"similarity {name!r}: score_backward raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(r, (tuple, list)) or len(r) != 3:
            raise TypeError(
                f"similarity {name!r}: score_backward returned {describe(r)}, expected a "
                "tuple (dq, dk, dparams)")
        dq, dk, dp = r
        for what, a, tile, acc in (("dq", dq, qt, self.dqc[..., i0:i1, :]),
                                   ("dk", dk, kt, self.dkc[..., j0:j1, :])):
            a = np.asarray(a)
            if a.dtype.kind != "f":
                raise TypeError(
                    f"similarity {name!r}: score_backward returned {what} of dtype {a.dtype}, "
                    "expected a real floating dtype")
            if a.shape != tile.shape:
                raise ValueError(
                    f"similarity {name!r}: score_backward returned {what} of shape {a.shape}, "
                    f"expected {tile.shape} (the {'query' if what == 'dq' else 'key'} tile's)")
            acc += a
        if dp is None:
            return
        if not isinstance(dp, dict):
            raise TypeError(
                f"similarity {name!r}: score_backward returned dparams {describe(dp)}, "
                "expected a dict {parameter name: gradient}")
        for pname, val in dp.items():
            if pname not in self.shapes:
                raise ValueError(
                    f"similarity {name!r}: score_backward returned a gradient for {pname!r}, "
                    f"which is not one of its params ({sorted(self.shapes)})")
            a = np.asarray(val, dtype=np.float64)
            if a.shape != self.shapes[pname]:
                raise ValueError(
                    f"similarity {name!r}: score_backward returned dparams[{pname!r}] of "
                    f"shape {a.shape}, expected the parameter's shape {self.shapes[pname]}")
            prev = self.dparams.get(pname)
            self.dparams[pname] = a.copy() if prev is None else prev + a


def _mm_acc(a, b, acc, batch):
    """acc += a @ b over the batch (our products, not NumPy's multi-threaded
    BLAS: see _pv_acc)."""
    dt = acc.dtype
    _pv_acc(canonical_matrix_stack(a, dt), canonical_matrix_stack(b, dt), acc, batch)


def _tiled_backward(c, g, o, ls, tiles):
    """FlashAttention-2's backward in NumPy, tile by tile: the masked scores S
    recomputed by ``tiles``, P = exp(S - lse), dV += P^T dO, dP = dO V^T,
    dS = P o (dP - D) with D = rowsum(dO o O), handed to ``tiles.backward``.
    Returns dV (the broadcast batch shape); the rest is accumulated by
    ``tiles``.  The batch runs in chunks so that a tile temporary holds about
    PY_BWD_TILE_ELEMS elements at most (memory O(tile))."""
    p = c.p
    cdt = p.cdt
    batch, Lq, Lk = p.batch, p.Lq, p.Lk
    dV = np.zeros(batch + (Lk, p.dv), cdt)
    if not (math.prod(batch) and Lq and Lk and p.dv):
        return dV  # no output element depends on anything: zeros
    V = np.broadcast_to(p.v, batch + p.v.shape[-2:])
    M = None if p.mask is None else np.broadcast_to(p.mask, batch + (Lq, Lk))
    bq = min(Lq, PY_BLOCK_Q)
    bk = max(1, min(Lk, PY_BLOCK_K, PY_BWD_TILE_ELEMS // (bq * tiles.width)))
    neg_inf = cdt.type(-np.inf)
    for ix in _batch_chunks(batch, bq * bk * tiles.width):
        tiles.chunk(ix)
        Gc, Oc, Lc, Vc, dVc = g[ix], o[ix], ls[ix], V[ix], dV[ix]
        Mc = None if M is None else M[ix]
        cb = Gc.shape[:-2]
        for i0 in range(0, Lq, bq):
            i1 = min(Lq, i0 + bq)
            kend = Lk
            if p.causal:
                kend = max(0, min(Lk, i1 + p.causal_offset))
            li = Lc[..., i0:i1]
            dead = li == neg_inf
            if kend == 0 or dead.all():
                continue
            li = np.where(dead, cdt.type(np.inf), li)[..., None]  # their P: exp(-inf) = 0
            Gi = Gc[..., i0:i1, :]
            Di = np.sum(np.multiply(Gi, Oc[..., i0:i1, :], dtype=np.float64), axis=-1)
            Di = Di.astype(cdt)[..., None]
            for j0 in range(0, kend, bk):
                j1 = min(kend, j0 + bk)
                mt = None if Mc is None else Mc[..., i0:i1, j0:j1]
                if mt is not None and p.mask_kind == _masks.MASK_BOOL and not mt.any():
                    continue
                P = tiles.scores(i0, i1, j0, j1)
                _mask_tile(p, mt, P, i0, i1, j0, j1)
                with np.errstate(invalid="ignore", over="ignore"):
                    P -= li
                    np.exp(P, out=P)
                _mm_acc(np.swapaxes(P, -1, -2), Gi, dVc[..., j0:j1, :], cb)
                dS = np.zeros(P.shape, cdt)
                _mm_acc(Gi, np.swapaxes(Vc[..., j0:j1, :], -1, -2), dS, cb)
                dS -= Di
                dS *= P
                dS[P == 0] = 0  # masked pairs, empty rows: no gradient (not even NaN)
                tiles.backward(i0, i1, j0, j1, dS)
    return dV
