"""Scaled dot-product attention: validation, planning and the kernel call.

The public entry points (:func:`scaled_dot_product_attention`,
:func:`explain`, :class:`Plan`) are re-exported by :mod:`fastattn.functional`,
whose docstring holds the shape glossary and the mask convention.  Also here
for the other op modules: :func:`_sdpa_canonical` (SDPA on buffers fastattn
built itself, for multi-head attention's head views) and :func:`_prepare`
(SDPA's argument checks, reused by ``attention``).
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from . import _alloc, _kernels, _threads
from . import _masks
from ._masks import check_attn_mask
from ._validation import (
    BLAS_INT_MAX,
    broadcast_batch,
    canonical_matrix_stack,
    check_grad_array,
    grad_dtype,
    check_out,
    check_qkv,
    result_dtypes,
    sum_to_shape,
)

__all__ = ["scaled_dot_product_attention", "explain", "Plan"]

_ALIGNMENTS = ("top_left", "bottom_right")

# Tiling, chosen by measurement on a 2-core AVX2 machine (L2 512 KiB-1 MiB a
# core; the sweeps are benchmarks/tune_tiles.py).  With SIMD on, every call
# without weights and with more than DIRECT_MAX_ROWS queries streams over
# tiles of BLOCK_K keys through our packed products (K^T and V tiles packed
# into 16-column panels, a 6x16 register-blocked kernel): single-threaded they
# ran 10-15 % faster than OpenBLAS on the same tiles, and `tune_tiles.py own`
# found every query block of 64-256 rows and key tile of 128-512 keys within
# 4 % of the best (256/256 at 1x8x512x64, 128/256 at 1x8x2048x64), causal or
# not -- so query blocks are BLOCK_Q_MAX rows, halved only to give every
# thread two tasks.  Causal tiles skip the keys above the diagonal per block
# of 6 rows, so causal needs no smaller blocks.
#
# Without SIMD, with weights, or for decoding (the BLAS and small-kernel
# paths): keys up to
# SINGLE_PASS_MAX_KEYS are scored in one pass per query block (exact two-pass
# softmax over the whole row); longer key sequences stream over tiles of
# BLOCK_K keys with an online softmax.  Query blocks: as large as BLOCK_Q_MAX
# without causality (fewer, larger BLAS calls: 256 rows were 5-20 % faster
# than 128 and 64); with causality smaller blocks waste less work above the
# diagonal, so they grow with the key length instead (32 rows up to 256 keys:
# 2.5 vs 3.0 ms at 32x8x64x64, 1.8 vs 2.0 ms at 8x8x128x64).
SINGLE_PASS_MAX_KEYS = 512
# Single-pass tasks of at most DIRECT_MAX_MACS multiply-adds, or with at most
# DIRECT_MAX_ROWS queries (decoding: M=1 gemm is BLAS's worst case, 9x slower
# than ours at 1x512x64), use register-blocked products instead of BLAS calls
# (measured, one thread, d=64: ours 16 vs 21 us at 64x64 keys, 62 vs 67 us at
# 128x128, 137 vs 130 us at 128x256).
DIRECT_MAX_MACS = 1 << 21
DIRECT_MAX_ROWS = 4
BLOCK_K = 256
STREAM_OWN_PRODUCTS = True  # False: BLAS tiles even with SIMD (for comparisons)
BLOCK_Q_MAX = 256
BLOCK_Q_MIN = 32
# Below this many flops a call runs on the calling thread alone.
PARALLEL_MIN_FLOPS = 500_000

_PATH_SINGLE = _kernels.PATH_SINGLE
_PATH_STREAM = _kernels.PATH_STREAM
_MASK_NONE = _masks.MASK_NONE
_MASK_NAMES = _masks.MASK_NAMES
_MAX_BATCH_DIMS = _kernels.MAX_BATCH_DIMS
_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_ndarray = np.ndarray
_sdpa_plain = _kernels.sdpa_plain
_resolve = _threads.resolve


class Plan(NamedTuple):
    """How a call is executed (see :func:`explain`)."""

    path: str          # "single_pass", "streaming" or "empty"
    blas: bool         # False: register-blocked products instead of BLAS calls
    dtype: str         # compute dtype
    batch_shape: tuple
    block_q: int
    block_k: int       # keys per tile (streaming), or all keys (single pass)
    n_threads: int
    n_tasks: int
    causal: str | None  # "top_left", "bottom_right" or None
    mask: str          # "none", "bool", "additive"
    copies: tuple      # names of the inputs that had to be copied
    reason: str


def _plain_plan(batch, Lq, Lk, d, dv, n_threads, causal, dtype):
    """The plan of a plain call (see _kernels.sdpa_plain, which remembers it)."""
    _threads.ensure_blas_hook()
    path, bq, bk, no_blas, nt, _ = _plan(batch, Lq, Lk, d, dv, False, n_threads, causal,
                                         dtype.itemsize)
    return bq, bk, path, no_blas, nt


#: _sdpa_canonical's remembered plans: (batch, Lq, Lk, d, dv, want_weights,
#: n_threads, causal, itemsize, SIMD active) -> _plan's result (at most
#: _CANON_PLANS_MAX; _clear_plans forgets them with the kernels' own)
_CANON_PLANS: dict = {}
_CANON_PLANS_MAX = 256


def _clear_plans():
    """Forget remembered plans (tests that change the planning constants)."""
    _kernels.clear_fast_plans()
    _CANON_PLANS.clear()


def _plan(batch_shape, Lq, Lk, d, dv, want_weights, n_threads, causal, itemsize, why=False):
    """(path, block_q, block_k, no_blas, threads, tasks[, reason]) for one call."""
    nb = 1
    for n in batch_shape:
        nb *= n
    own = STREAM_OWN_PRODUCTS and _kernels.simd_active()
    if want_weights or Lq <= DIRECT_MAX_ROWS or (Lk <= SINGLE_PASS_MAX_KEYS and not own):
        path, bk = _PATH_SINGLE, Lk
    else:
        path, bk = _PATH_STREAM, max(1, min(BLOCK_K, Lk))  # Lk = 0: no tiles, zeros
    if not causal or (path == _PATH_STREAM and own):
        # our products skip the keys above the diagonal per block of 6 rows:
        # causal needs no smaller query blocks (measured: 256-row blocks
        # 0.70-0.97x the time of the 32/128-row ones)
        bq = BLOCK_Q_MAX
    else:
        bq = 32 if Lk <= 256 else 128 if Lk <= 1024 else 256
    if itemsize == 8 and path == _PATH_SINGLE:
        bq = min(bq, 128)  # keep a block's double-precision scores in L2
    bq = max(1, min(bq, Lq))
    nt = n_threads
    if 2.0 * nb * Lq * Lk * (d + dv) < PARALLEL_MIN_FLOPS:
        nt = 1
    # enough tasks for every thread to get a couple
    while nt > 1 and bq > BLOCK_Q_MIN and nb * (-(-Lq // bq)) < 2 * nt:
        bq = (bq + 1) // 2
    ntasks = nb * (-(-Lq // bq))
    if nt > ntasks:
        nt = max(ntasks, 1)
    no_blas = path == _PATH_SINGLE and (bq <= DIRECT_MAX_ROWS or bq * Lk * (d + dv) <= DIRECT_MAX_MACS)
    if path == _PATH_STREAM and own:
        no_blas = True
    if not why:
        return path, bq, bk, no_blas, nt, ntasks
    if want_weights:
        reason = "weights requested: scores written into the weights output"
        if no_blas:
            reason += "; blocks small enough to skip BLAS"
    elif path == _PATH_SINGLE and Lq <= DIRECT_MAX_ROWS:
        reason = f"Lq={Lq} <= {DIRECT_MAX_ROWS}: one pass over all keys, dot-product kernels"
    elif path == _PATH_SINGLE:
        reason = (f"SIMD off and Lk={Lk} <= {SINGLE_PASS_MAX_KEYS}: one pass over all keys"
                  + ("; blocks small enough to skip BLAS" if no_blas else ""))
    elif no_blas:
        reason = (f"streaming softmax over tiles of {bk} keys; products by packed "
                  f"register-blocked kernels ({'AVX-512' if _kernels.simd_level() >= 2 else 'AVX2'}, "
                  "no BLAS)")
    else:
        reason = (f"SIMD off and Lk={Lk} > {SINGLE_PASS_MAX_KEYS}: streaming softmax over "
                  f"tiles of {bk} keys, BLAS products")
    return path, bq, bk, no_blas, nt, ntasks, reason


@_alloc.cached
def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    return_weights=False,
    causal_alignment="top_left",
    out=None,
    n_threads=None,
    return_lse=False,
):
    """Scaled dot-product attention, ``softmax(scale * Q K^T + mask) V``.

    Parameters
    ----------
    query : array_like, shape (..., Lq, d)
    key : array_like, shape (..., Lk, d)
    value : array_like, shape (..., Lk, dv)
        The leading dims of the three (and of ``attn_mask``) broadcast.
    attn_mask : array_like, optional, broadcastable to (..., Lq, Lk)
        Boolean: True where a query may attend to a key.  Float: added to the
        scaled scores (``-inf`` forbids).  A padding mask shaped
        ``(B, 1, 1, Lk)`` is used as it is, never expanded.
    is_causal : bool
        Query ``i`` may attend to key ``j`` only when ``j <= i`` (top-left
        alignment) or ``j <= i + Lk - Lq`` (bottom-right).  Combined with
        ``attn_mask``, a key must be allowed by both (unlike PyTorch, which
        refuses the combination).
    scale : float, optional
        Multiplies ``Q K^T`` (a finite number; NaN and inf raise ValueError);
        default ``1 / sqrt(d)`` (1 when ``d == 0``).
    return_weights : bool
        Also return the attention weights, shape (..., Lq, Lk).
    causal_alignment : {"top_left", "bottom_right"}
        "top_left" is PyTorch's rule; "bottom_right" aligns the last query
        with the last key, as needed when decoding with a key/value cache.
    out : ndarray, optional
        Written with the result and returned; must have the result's shape
        and dtype.  It may overlap the inputs (the result then goes through
        a temporary).  When the call is interrupted (KeyboardInterrupt, or
        whatever a signal handler raises; checked about every 20 ms on the
        main thread) its contents are unspecified.
    n_threads : int, optional
        Threads for this call (see :func:`fastattn.get_num_threads`).
    return_lse : bool
        Also return ``lse``, shape (..., Lq) (the broadcast batch shape), in
        the compute dtype: for each query the natural-log log-sum-exp over
        its allowed keys of the scaled, masked scores (``-inf`` for a row
        with no allowed key).  With it, the weights are
        ``exp(scale * q.k + mask - lse)``: what a backward pass or a merge of
        attention over disjoint key sets needs, without the weights matrix.

    Returns
    -------
    ndarray of shape (..., Lq, dv); with ``return_weights`` and/or
    ``return_lse``, a tuple ``(output[, weights][, lse])`` in that order.
    Rows with no allowed key are zeros.  The dtype follows NumPy promotion of
    query, key and value: float32 and float64 are computed natively, float16
    in float32 (returned as float16), integers and bool as float64.  Complex
    inputs raise TypeError.
    """
    # The plain call -- three C-contiguous, aligned, writeable arrays of one
    # native float dtype with equal leading dims, no mask, out or weights --
    # has nothing to canonicalise: the binding checks those buffer properties
    # and remembers the plan of each signature.  Anything else (including
    # every error) takes the general path.
    if (attn_mask is None and out is None and return_weights is False and return_lse is False
            and (is_causal is False or is_causal is True)
            and (scale is None or type(scale) is not float or math.isfinite(scale))):
        if causal_alignment == "top_left":
            br = False
        elif causal_alignment == "bottom_right":
            br = True
        else:
            br = None
        if br is not None:
            r = _sdpa_plain(query, key, value, is_causal, br, scale,
                            _resolve(n_threads), _plain_plan)
            if r is not None:
                if type(r) is int:
                    _raise_status(r)
                return r
    p = _prepare(query, key, value, attn_mask, is_causal, scale, return_weights,
                 causal_alignment, out, n_threads, return_lse)
    return _run(p)


def _raise_status(rc):
    if rc == 1:
        raise MemoryError("fastattn: could not allocate kernel scratch memory")
    raise RuntimeError(f"fastattn: kernel rejected its arguments (status {rc})")  # a bug


class _Prepared(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: object
    mask_kind: int
    batch: tuple
    Lq: int
    Lk: int
    d: int
    dv: int
    causal: bool
    causal_alignment: str
    causal_offset: int
    scale: float
    want_weights: bool
    want_lse: bool
    out: object
    n_threads: int
    cdt: np.dtype
    rdt: np.dtype
    copies: tuple


def _prepare(query, key, value, attn_mask, is_causal, scale, return_weights,
             causal_alignment, out, n_threads, return_lse=False):
    q, k, v = check_qkv(query, key, value)
    Lq, d = q.shape[-2:]
    Lk, dk = k.shape[-2:]
    Lv, dv = v.shape[-2:]
    if dk != d:
        raise ValueError(
            f"key: expected last dim {d} (query's feature size d), got key of shape {k.shape}"
        )
    if Lv != Lk:
        raise ValueError(
            f"value: expected {Lk} rows (the number of keys Lk), got value of shape {v.shape}"
        )
    shapes = [("query", q.shape[:-2]), ("key", k.shape[:-2]), ("value", v.shape[:-2])]
    for name, val in (("Lq", Lq), ("Lk", Lk), ("d", d), ("dv", dv)):
        if val > BLAS_INT_MAX:
            raise ValueError(
                f"{name}={val} exceeds the BLAS 32-bit integer range (max {BLAS_INT_MAX})"
            )


    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal: expected a bool, got {type(is_causal).__name__} {is_causal!r}")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(
            f"causal_alignment: expected 'top_left' or 'bottom_right', got {causal_alignment!r}"
        )
    if not isinstance(return_weights, (bool, np.bool_)):
        raise TypeError(
            f"return_weights: expected a bool, got {type(return_weights).__name__} {return_weights!r}"
        )
    if not isinstance(return_lse, (bool, np.bool_)):
        raise TypeError(
            f"return_lse: expected a bool, got {type(return_lse).__name__} {return_lse!r}"
        )

    cdt, rdt = result_dtypes(q, k, v)

    mask, mask_kind, mask_batch = check_attn_mask(attn_mask, Lq, Lk, cdt)
    if mask is not None:
        shapes.append(("attn_mask", mask_batch))

    batch = broadcast_batch(shapes, _kernels.MAX_BATCH_DIMS)

    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    else:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, (int, float, np.integer, np.floating)):
            raise TypeError(f"scale: expected a real number, got {type(scale).__name__} {scale!r}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale: expected a finite real number, got {scale!r}")

    nt = _threads.resolve(n_threads)

    out_shape = batch + (Lq, dv)
    if out is not None:
        check_out(out, out_shape, rdt)

    copies = []
    qc = canonical_matrix_stack(q, cdt)
    kc = canonical_matrix_stack(k, cdt)
    vc = canonical_matrix_stack(v, cdt)
    for name, a, c in (("query", q, qc), ("key", k, kc), ("value", v, vc)):
        if c is not a:
            copies.append(name)

    off = 0
    if is_causal and causal_alignment == "bottom_right":
        off = Lk - Lq
    return _Prepared(qc, kc, vc, mask, mask_kind, batch, Lq, Lk, d, dv, bool(is_causal),
                     causal_alignment, off, scale, bool(return_weights), bool(return_lse), out, nt, cdt, rdt,
                     tuple(copies))


def _sdpa_canonical(q, k, v, mask, batch, causal, causal_offset, scale, out, want_weights,
                    n_threads):
    """SDPA for arrays that fastattn built itself (multi-head attention's head views):
    no validation, no canonicalisation of q, k, v or out.

    The caller guarantees what :func:`_prepare` would have established: q, k,
    v and out share one float dtype (float32 or float64), have contiguous last
    axes and BLAS-valid row strides, and their leading dims broadcast to
    ``batch``; out (shape ``batch + (Lq, dv)``) is writeable, has its own memory
    for every element and overlaps neither the inputs nor the mask; every size
    (batch, Lq, Lk, d, dv) is at least 1; ``mask`` is None or already through
    :func:`fastattn._masks.kernel_mask` (bool or in the compute dtype) with leading dims that
    broadcast to ``batch``; ``scale`` is a float; ``n_threads`` is resolved.
    Writes ``out``; returns the weights ``batch + (Lq, Lk)`` or None.
    """
    Lq, d = q.shape[-2], q.shape[-1]
    Lk, dv = k.shape[-2], v.shape[-1]
    dt = q.dtype
    if mask is None:
        kind = _MASK_NONE
    elif mask.dtype == np.bool_:
        kind = _masks.MASK_BOOL
    else:
        kind = _masks.MASK_ADD
    weights = np.empty(batch + (Lq, Lk), dtype=dt) if want_weights else None
    key = (batch, Lq, Lk, d, dv, want_weights, n_threads, causal, dt.itemsize,
           _kernels.simd_active())
    plan = _CANON_PLANS.get(key)
    if plan is None:  # a layer calls with the same few shapes: plan each once
        if len(_CANON_PLANS) >= _CANON_PLANS_MAX:
            _CANON_PLANS.clear()
        plan = _CANON_PLANS[key] = _plan(*key[:-1])
    path, bq, bk, no_blas, nt, _ = plan
    _threads.ensure_blas_hook()
    rc = _kernels.sdpa(q, k, v, mask, kind, out, weights, batch, causal, causal_offset,
                       scale, bq, bk, path, no_blas, nt)
    if rc:
        _raise_status(rc)
    return weights


def _run(p: _Prepared):
    out_shape = p.batch + (p.Lq, p.dv)
    w_shape = p.batch + (p.Lq, p.Lk)
    user_out = p.out
    direct = (
        user_out is not None
        and p.rdt == p.cdt
        and user_out.flags.aligned
        and user_out.strides[-1] in (p.cdt.itemsize,) + ((0,) if p.dv <= 1 else ())
        and not any(np.may_share_memory(user_out, a) for a in (p.q, p.k, p.v)
                    if a is not None)
        and not (p.mask is not None and np.may_share_memory(user_out, p.mask))
    )
    if direct:
        res = canonical_matrix_stack(user_out, p.cdt)
        if res is not user_out:  # rows not BLAS-addressable: go through a temporary
            direct = False
    if not direct:
        res = np.empty(out_shape, dtype=p.cdt)
    weights = np.empty(w_shape, dtype=p.cdt) if p.want_weights else None
    lse = np.empty(p.batch + (p.Lq,), dtype=p.cdt) if p.want_lse else None

    empty = (math.prod(out_shape) == 0 and (weights is None or weights.size == 0)
             and (lse is None or lse.size == 0))
    if not empty:
        q, k, v = p.q, p.k, p.v
        if p.d == 0:  # scores are all 0: any width-1 zeros do
            q = np.zeros(p.q.shape[:-1] + (1,), p.cdt)
            k = np.zeros(p.k.shape[:-1] + (1,), p.cdt)
        res_k = res
        if p.dv == 0:  # weights wanted but nothing to combine: use a dummy value column
            v = np.zeros(p.v.shape[:-1] + (1,), p.cdt)
            res_k = np.empty(p.batch + (p.Lq, 1), p.cdt)
        path, bq, bk, no_blas, nt, _ = _plan(p.batch, p.Lq, p.Lk, max(p.d, 1), max(p.dv, 1),
                                             p.want_weights, p.n_threads, p.causal,
                                             p.cdt.itemsize)
        _threads.ensure_blas_hook()
        rc = _kernels.sdpa(q, k, v, p.mask, p.mask_kind, res_k, weights, p.batch,
                           p.causal, p.causal_offset, p.scale, bq, bk, path, no_blas, nt,
                           None if lse is None else lse[..., None])
        if rc:
            _raise_status(rc)

    return _finish(p, res, weights, lse)


def _finish(p: _Prepared, res, weights, lse=None):
    """The call's result from the kernel's output ``res`` (``p.out`` itself or a
    buffer in the compute dtype), weights and lse: copied into ``out=`` or cast
    to the result dtype (lse stays in the compute dtype); ``(res[, weights][,
    lse])`` when either was asked for."""
    if p.out is not None:
        if res is not p.out:
            np.copyto(p.out, res, casting="unsafe")
        res = p.out
    elif p.rdt != p.cdt:
        res = res.astype(p.rdt)
    if p.want_weights and p.rdt != p.cdt:
        weights = weights.astype(p.rdt)
    if p.want_lse:
        return (res, weights, lse) if p.want_weights else (res, lse)
    if p.want_weights:
        return res, weights
    return res


def explain(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
            return_weights=False, causal_alignment="top_left", out=None, n_threads=None,
            return_lse=False) -> Plan:
    """Say how :func:`scaled_dot_product_attention` would run these arguments.

    Takes the same arguments, validates them the same way, and returns a
    :class:`Plan` (kernel path, tile sizes, threads, copies made and why)
    without computing anything.
    """
    p = _prepare(query, key, value, attn_mask, is_causal, scale, return_weights,
                 causal_alignment, out, n_threads, return_lse)
    nrows = math.prod(p.batch) * p.Lq
    if nrows * p.dv == 0 and not (p.want_weights and nrows * p.Lk) and not (p.want_lse and nrows):
        return Plan("empty", False, p.cdt.name, p.batch, 0, 0, 1, 0,
                    p.causal_alignment if p.causal else None,
                    _MASK_NAMES[p.mask_kind], p.copies,
                    "nothing to compute: a dimension of the output is 0")
    path, bq, bk, no_blas, nt, ntasks, why = _plan(p.batch, p.Lq, p.Lk, max(p.d, 1), max(p.dv, 1),
                                          p.want_weights, p.n_threads, p.causal,
                                          p.cdt.itemsize, why=True)
    if nt < p.n_threads:
        why += f"; {nt} thread(s): " + ("small problem" if ntasks >= p.n_threads else f"only {ntasks} task(s)")
    return Plan(
        "single_pass" if path == _PATH_SINGLE else "streaming", not no_blas,
        p.cdt.name, p.batch, bq, bk, nt, ntasks,
        p.causal_alignment if p.causal else None,
        _MASK_NAMES[p.mask_kind],
        p.copies, why,
    )


# ------------------------------------------------------------------ backward

# Tiles of the backward kernel (csrc/fa_sdpa_bwd_impl.h): query rows x keys
# per recomputed score tile.
BWD_BLOCK_Q = 128
BWD_BLOCK_K = 128


# The backward splits each batch item's key blocks into groups, one task each,
# so that few batch items still keep every thread busy: at least
# BWD_MIN_TASKS (batch item, group) tasks.  A function of the shapes only --
# never of the thread count -- so the gradients are the same bits for any
# n_threads.  Each group past the first costs a (Lq, d) dQ partial per item.
BWD_MIN_TASKS = 8


def _bwd_groups(nbatch, nkb):
    """Key groups per batch item for the backward (see BWD_MIN_TASKS)."""
    if nbatch >= BWD_MIN_TASKS:
        return 1
    return max(1, min(nkb, -(-BWD_MIN_TASKS // max(nbatch, 1)), _kernels.BWD_MAX_GROUPS))


def _bwd_plan(p):
    """(block_q, block_k, key groups, threads, own products) of the backward of a
    prepared call with at least one row, key and value feature."""
    nt = p.n_threads
    if 10.0 * math.prod(p.batch) * p.Lq * p.Lk * (max(p.d, 1) + p.dv) < PARALLEL_MIN_FLOPS:
        nt = 1
    bq, bk = max(1, min(BWD_BLOCK_Q, p.Lq)), max(1, min(BWD_BLOCK_K, p.Lk))
    ng = _bwd_groups(math.prod(p.batch), -(-p.Lk // bk))
    return bq, bk, ng, nt, STREAM_OWN_PRODUCTS and _kernels.simd_active()


class BackwardPlan(NamedTuple):
    """How :func:`sdpa_backward` runs (see :func:`explain_backward`)."""

    path: str           # "tiled" (FlashAttention-2 backward) or "empty"
    products: str       # "packed" (the forward's own products) or "blas"
    dtype: str
    batch_shape: tuple
    block_q: int
    block_k: int
    key_groups: int     # key-block groups per batch item (one task each)
    n_threads: int
    n_tasks: int
    extra_bytes: int    # scratch beyond the gradients: D, dQ partials, per-thread tiles
    reason: str


def explain_backward(query, key, value, attn_mask=None, is_causal=False, scale=None, *,
                     causal_alignment="top_left", n_threads=None) -> BackwardPlan:
    """Say how :func:`sdpa_backward` would run for these forward arguments
    (validated the same way; nothing is computed)."""
    p = _prepare(query, key, value, attn_mask, is_causal, scale, False, causal_alignment, None,
                 n_threads)
    nb = math.prod(p.batch)
    if not (nb * p.Lq and p.Lk and p.dv):
        return BackwardPlan("empty", "none", p.cdt.name, p.batch, 0, 0, 0, 1, 0, 0,
                            "every gradient is a sum of no terms: zeros")
    bq, bk, ng, nt, own = _bwd_plan(p)
    d = max(p.d, 1)
    item = p.cdt.itemsize
    tile = (2 * bq * bk + max(bq, bk) * max(d, p.dv) + (-(-bk // 16) * 16) * (d + p.dv)
            + (-(-d // 16) * 16) * bk) * item + bk * (d + p.dv) * 8
    extra = nb * p.Lq * 8 + (ng - 1) * nb * p.Lq * d * item + min(nt, nb * ng) * tile
    ntasks = nb * ng
    reason = (f"scores recomputed from lse in {bq} x {bk} tiles; {ng} key group(s) a batch item "
              f"(at least {BWD_MIN_TASKS} tasks, from the shapes only: the same bits for any "
              f"thread count); " + (f"packed products ({'AVX-512' if _kernels.simd_level() >= 2 else 'AVX2'}), "
                                    "as the forward's streaming path"
                                    if own else "BLAS products, as the forward without SIMD"))
    if nt < p.n_threads:
        reason += f"; {nt} thread(s): small problem"
    return BackwardPlan("tiled", "packed" if own else "blas", p.cdt.name, p.batch, bq, bk, ng,
                        nt, ntasks, extra, reason)


@_alloc.cached
def sdpa_backward(grad_out, query, key, value, out, lse, attn_mask=None, is_causal=False,
                  scale=None, *, causal_alignment="top_left", mask_grad=False, n_threads=None):
    """Gradients of :func:`scaled_dot_product_attention` (FlashAttention-2).

    Parameters
    ----------
    grad_out : array_like (..., Lq, dv)
        dL/d(output), the shape of the forward's output.
    query, key, value, attn_mask, is_causal, scale, causal_alignment
        The forward's arguments, unchanged.
    out, lse : array_like
        The forward's output ``(..., Lq, dv)`` and its ``lse`` ``(..., Lq)``
        (``return_lse=True``): the scores are recomputed tile by tile from
        them, never an ``Lq x Lk`` matrix.
    mask_grad : bool
        Also return ``dmask``, the gradient of a float ``attn_mask`` (its
        shape; needs ``(..., Lq, Lk)`` memory while it is summed).
    n_threads : int, optional
        Threads for this call.

    Returns
    -------
    ``(dq, dk, dv)``, or ``(dq, dk, dv, dmask)`` with ``mask_grad``.  Each has
    its input's shape (dims that were broadcast are summed back) and dtype (a
    non-float input gets the compute dtype).  Rows with no allowed key give
    exact zero gradients.  The result depends on the inputs only, not on the
    thread count.
    """
    return _sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale,
                          causal_alignment, mask_grad, n_threads, None)


def sdpa_backward_into(grads, grad_out, query, key, value, out, lse, attn_mask=None,
                       is_causal=False, scale=None, *, causal_alignment="top_left",
                       n_threads=None):
    """:func:`sdpa_backward` writing ``(dq, dk, dv)`` into ``grads``, three
    arrays of the compute dtype in the full batch shape (no broadcast batch
    dim: nothing is summed back), last axes contiguous, BLAS-valid row
    strides, none overlapping another or an input -- for fastattn's own
    callers (the multi-head backward writes the head gradients straight into
    the rows of its projection gradients).  Returns ``grads``."""
    return _sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale,
                          causal_alignment, False, n_threads, grads)


def _sdpa_backward(grad_out, query, key, value, out, lse, attn_mask, is_causal, scale,
                   causal_alignment, mask_grad, n_threads, into):
    p = _prepare(query, key, value, attn_mask, is_causal, scale, False, causal_alignment, None,
                 n_threads)
    if not isinstance(mask_grad, (bool, np.bool_)):
        raise TypeError(f"mask_grad: expected a bool, got {type(mask_grad).__name__} {mask_grad!r}")
    if mask_grad and p.mask_kind != _masks.MASK_ADD:
        raise ValueError(
            "mask_grad: expected a float attn_mask (only an additive mask has a gradient), got "
            + ("no attn_mask" if p.mask is None else "a bool attn_mask"))
    cdt = p.cdt
    osh = p.batch + (p.Lq, p.dv)
    g = canonical_matrix_stack(check_grad_array(grad_out, "grad_out", osh), cdt)
    o = canonical_matrix_stack(check_grad_array(out, "out", osh), cdt)
    ls = check_grad_array(lse, "lse", p.batch + (p.Lq,))
    if ls.dtype != cdt or (p.Lq > 1 and ls.strides[-1] != ls.itemsize) or not ls.flags.aligned:
        ls = np.array(ls, dtype=cdt, order="C")

    nrows = math.prod(p.batch) * p.Lq
    run = bool(nrows and p.Lk and p.dv)  # otherwise every gradient is a sum of nothing: zeros
    new = np.empty if run else np.zeros  # the kernel writes every element
    if into is not None:
        dq, dk, dv = into
        want = (p.batch + (p.Lq, p.d), p.batch + (p.Lk, p.d), p.batch + (p.Lk, p.dv))
        if tuple(a.shape for a in into) != want or any(a.dtype != cdt for a in into) \
                or np.shape(p.k)[:-2] != p.batch or np.shape(p.v)[:-2] != p.batch \
                or np.shape(p.q)[:-2] != p.batch or not run or p.d == 0:
            raise ValueError("sdpa_backward_into: grads do not match (a caller's bug)")
    else:
        dq = new(p.batch + (p.Lq, p.d), cdt)
        dk = new(p.batch + (p.Lk, p.d), cdt)
        dv = new(p.batch + (p.Lk, p.dv), cdt)
    dmask = np.zeros(p.batch + (p.Lq, p.Lk), cdt) if mask_grad else None
    if run:
        q, k, dq_k, dk_k = p.q, p.k, dq, dk
        if p.d == 0:  # the scores are 0: any width-1 zeros do (their gradients are dropped)
            q = np.zeros(p.q.shape[:-1] + (1,), cdt)
            k = np.zeros(p.k.shape[:-1] + (1,), cdt)
            dq_k = np.empty(p.batch + (p.Lq, 1), cdt)
            dk_k = np.empty(p.batch + (p.Lk, 1), cdt)
        bq, bk, ng, nt, own = _bwd_plan(p)
        delta = np.empty(nrows, np.float64)
        part = np.empty((ng - 1) * nrows * dq_k.shape[-1], cdt) if ng > 1 else None
        _threads.ensure_blas_hook()
        rc = _kernels.sdpa_backward(
            q, k, p.v, o, g, ls[..., None], p.mask, p.mask_kind, dq_k, dk_k, dv, dmask, delta,
            p.batch, p.causal, p.causal_offset, p.scale, bq, bk, nt, ng, part, own)
        if rc:
            _raise_status(rc)
    if into is not None:
        return into
    grads = [sum_to_shape(dq, np.shape(p.q)).astype(grad_dtype(query, cdt), copy=False),
             sum_to_shape(dk, np.shape(p.k)).astype(grad_dtype(key, cdt), copy=False),
             sum_to_shape(dv, np.shape(p.v)).astype(grad_dtype(value, cdt), copy=False)]
    if mask_grad:
        m = attn_mask if isinstance(attn_mask, np.ndarray) else np.asarray(attn_mask)
        grads.append(sum_to_shape(dmask, m.shape).astype(m.dtype, copy=False))
    return tuple(grads)
