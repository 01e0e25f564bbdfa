"""fastattn on Dask: attention and layers over dask arrays.

Optional (``pip install 'fastattn[dask]'``: ``dask[array]`` and
``distributed``); ``import fastattn`` never imports Dask.

* :func:`scaled_dot_product_attention` and :func:`attention` take dask (or
  NumPy) arrays and return a lazy dask array.  Chunks along the batch dims
  and the queries pass through: one fastattn call per block.  Chunks along
  the keys give per-block ``(out, lse)`` partials, combined by a tree
  reduction with :func:`fastattn.merge_attention` (a fold in key order by
  default, a balanced tree with ``split_every``); causal blocks that see no
  key are left out of the graph, and a mask is sliced to the blocks (a
  ``(B, 1, 1, Lk)`` padding mask is never expanded).  The feature axes must
  be one chunk each.
* :func:`apply` runs a layer over the batch chunks of a dask array, the
  layer sent to the workers once (one graph key that every task reads).
* Threads: a task started with ``n_threads=None`` runs fastattn with 1
  thread when its worker runs several task threads (a ``distributed`` worker
  with ``nthreads > 1``, or a thread of Dask's local threaded scheduler) and
  with fastattn's default otherwise; :class:`WorkerSetup` (a worker plugin)
  sets another count on every worker.
* Similarities travel by registry name and are resolved on the worker; a
  name the worker does not know is an error that names it.
"""
from __future__ import annotations

import itertools
import operator
import threading

import numpy as np

try:
    import dask.array as da
    from dask.base import tokenize
    from dask.highlevelgraph import HighLevelGraph
except ImportError as _exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        "fastattn.dask needs Dask: pip install 'fastattn[dask]' (dask[array] and distributed). "
        f"Original error: {_exc}") from _exc

import fastattn
from fastattn import registry
from fastattn._validation import describe
from fastattn.similarity import Similarity

__all__ = ["scaled_dot_product_attention", "attention", "apply", "WorkerSetup", "task_threads"]


# The thread count WorkerSetup installed in this (worker) process; None: the default rule.
_worker_threads = None
_worker_lock = threading.Lock()


def task_threads(n_threads=None):
    """The fastattn thread count a task uses: ``n_threads`` when given; else
    the count a :class:`WorkerSetup` installed in this worker process; else 1
    when this worker runs several task threads (a ``distributed`` worker with
    ``nthreads > 1``, or a pool thread of Dask's local threaded scheduler),
    else fastattn's default (:func:`fastattn.get_num_threads`)."""
    if n_threads is not None:
        return n_threads
    if _worker_threads is not None:
        return _worker_threads
    try:
        from distributed import get_worker
        worker = get_worker()
    except (ImportError, ValueError):
        worker = None
    if worker is not None:
        return 1 if worker.state.nthreads > 1 else fastattn.get_num_threads()
    if threading.current_thread() is not threading.main_thread():
        return 1  # a pool thread of a local scheduler: its siblings run too
    return fastattn.get_num_threads()


class _WorkerSetupBase:
    """Shared by WorkerSetup (a distributed.WorkerPlugin when distributed is installed)."""

    name = "fastattn-worker-setup"

    def __init__(self, n_threads=None):
        if n_threads is not None and (isinstance(n_threads, bool)
                                      or not isinstance(n_threads, (int, np.integer))
                                      or n_threads < 1):
            raise ValueError(f"n_threads: expected a positive int or None, got {n_threads!r}")
        self.n_threads = None if n_threads is None else int(n_threads)

    def setup(self, worker=None):
        global _worker_threads
        with _worker_lock:
            _worker_threads = self.n_threads

    def teardown(self, worker=None):
        global _worker_threads
        with _worker_lock:
            _worker_threads = None


try:
    from distributed.diagnostics.plugin import WorkerPlugin as _WorkerPlugin
except ImportError:  # pragma: no cover - dask without distributed
    _WorkerPlugin = object


class WorkerSetup(_WorkerSetupBase, _WorkerPlugin):
    """Worker plugin: the fastattn thread count of the tasks on every worker.

    ``client.register_plugin(fastattn.dask.WorkerSetup(n_threads=2))`` makes
    every task that is given ``n_threads=None`` use 2 fastattn threads on
    each worker (present and future ones); ``n_threads=None`` restores the
    default rule of :func:`task_threads`.
    """


# ---------------------------------------------------------------- helpers

def _as_dask(x, name):
    if isinstance(x, da.Array):
        return x
    if x is None:
        raise TypeError(f"{name}: expected an array, got None")
    a = np.asarray(x)
    if a.dtype == object:
        raise TypeError(f"{name}: expected a numeric array, got {describe(x)}")
    return da.from_array(a, chunks=a.shape or (), name=f"{name}-{tokenize(a)}")


def _one_chunk(x, axis, name, what):
    if len(x.chunks[axis]) > 1:
        raise ValueError(
            f"{name}: the {what} axis (axis {axis % x.ndim}, size {x.shape[axis]}) must be one "
            f"chunk, got chunks {x.chunks[axis]}; rechunk it, e.g. "
            f"{name}.rechunk({{{axis % x.ndim}: -1}})")


def _bounds(chunks):
    b = [0]
    for c in chunks:
        b.append(b[-1] + c)
    return b


def _lift(x, nb):
    """x with leading size-1 dims so that it has nb batch dims."""
    extra = nb - (x.ndim - 2)
    return x[(None,) * extra] if extra > 0 else x


def _resolve(name):
    """A similarity by registry name, on the worker."""
    try:
        return fastattn.get_similarity(name)
    except registry.UnknownSimilarityError:
        where = ""
        try:
            from distributed import get_worker
            where = f" on the Dask worker {get_worker().address}"
        except (ImportError, ValueError):
            pass
        raise registry.UnknownSimilarityError(
            f"similarity {name!r} is not registered{where}: a similarity registered only in "
            "the client process does not reach the workers. Install the package that "
            "provides it (an entry point in the group 'fastattn.similarities') on every "
            "worker, or import the module that registers it in a worker plugin "
            "(distributed's Client.register_plugin)") from None


def _partial(q, k, v, m, diag, scale, n_threads, sim, params):
    """One (query block, key block) call: (out, lse).  diag: None, or the
    offset c such that local key j may be seen by local query i iff
    j <= i + c (a block across the causal diagonal, as a boolean mask)."""
    nt = task_threads(n_threads)
    if diag is not None:
        Lq, Lk = q.shape[-2], k.shape[-2]
        allowed = np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + diag
        if m is None:
            m = allowed
        elif np.asarray(m).dtype == np.bool_:
            m = np.logical_and(m, allowed)
        else:
            m = np.where(allowed, m, -np.inf).astype(np.asarray(m).dtype, copy=False)
    if sim is None:
        return fastattn.scaled_dot_product_attention(q, k, v, m, False, scale, return_lse=True,
                                                     n_threads=nt)
    return fastattn.attention(q, k, v, _resolve(sim), params=params, attn_mask=m,
                              return_lse=True, n_threads=nt)


def _merge(*parts):
    if len(parts) == 1:
        return parts[0]
    return fastattn.merge_attention([p[0] for p in parts], [p[1] for p in parts])


def _empty(out_shape, dtype):
    return np.zeros(out_shape, dtype), np.full(out_shape[:-1], -np.inf, dtype)


def _result_dtype(q, k, v):
    """The output dtype, by fastattn's own dtype policy (which also raises for
    what it rejects): a one-element call on the inputs' dtypes."""
    return fastattn.scaled_dot_product_attention(
        np.zeros((1, 1), q.dtype), np.zeros((1, 1), k.dtype), np.zeros((1, 1), v.dtype)).dtype


# ---------------------------------------------------------------- attention

def _attention_graph(query, key, value, attn_mask, is_causal, scale, causal_alignment,
                     n_threads, sim, params, return_lse, split_every):
    if split_every is not None and (isinstance(split_every, bool)
                                    or not isinstance(split_every, (int, np.integer))
                                    or split_every < 2):
        raise ValueError(f"split_every: expected an int >= 2 or None, got {split_every!r}")
    if causal_alignment not in ("top_left", "bottom_right"):
        raise ValueError(f"causal_alignment: expected 'top_left' or 'bottom_right', got "
                         f"{causal_alignment!r}")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal: expected a bool, got {describe(is_causal)}")
    q, k, v = (_as_dask(x, n) for x, n in ((query, "query"), (key, "key"), (value, "value")))
    for x, n in ((q, "query"), (k, "key"), (v, "value")):
        if x.ndim < 2:
            raise ValueError(f"{n}: expected at least 2 dims (..., L, features), got shape {x.shape}")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"value: expected {k.shape[-2]} rows (key's Lk), got shape {v.shape}")
    _one_chunk(q, -1, "query", "feature")
    _one_chunk(k, -1, "key", "feature")
    _one_chunk(v, -1, "value", "feature")
    m = None
    if attn_mask is not None:
        m = _as_dask(attn_mask, "attn_mask")
        if m.ndim < 2:
            raise ValueError(f"attn_mask: expected at least 2 dims (..., Lq, Lk), got shape {m.shape}")
    Lq, Lk = q.shape[-2], k.shape[-2]
    try:
        batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2],
                                    () if m is None else m.shape[:-2])
    except ValueError:
        raise ValueError(
            f"query, key, value, attn_mask: batch dims {q.shape[:-2]}, {k.shape[:-2]}, "
            f"{v.shape[:-2]}" + ("" if m is None else f", {m.shape[:-2]}") +
            " do not broadcast") from None
    if m is not None:
        for ax, (n, want) in enumerate(zip(m.shape[-2:], (Lq, Lk))):
            if n not in (1, want):
                raise ValueError(f"attn_mask: expected shape (..., {Lq} or 1, {Lk} or 1), got "
                                 f"{m.shape}")
    nb = len(batch)
    q, k, v = _lift(q, nb), _lift(k, nb), _lift(v, nb)
    if m is not None:
        m = _lift(m, nb)
    dt = _result_dtype(q, k, v)
    dv = v.shape[-1]
    # batch chunks: the chunks of an input with that dim > 1 (all such inputs
    # rechunked alike); query and key chunks: q's rows, k's (= v's) rows
    bchunks = []
    arrays = {"q": q, "k": k, "v": v, "m": m}
    for ax in range(nb):
        big = [a for a in (q, k, v, m) if a is not None and a.shape[ax] > 1]
        bchunks.append(big[0].chunks[ax] if big else (1,))
    qchunks, kchunks = q.chunks[-2], k.chunks[-2]

    def rechunk(name, a):
        want = {}
        for ax in range(nb):
            if a.shape[ax] > 1 and a.chunks[ax] != bchunks[ax]:
                want[ax] = bchunks[ax]
        row_ax = a.ndim - 2
        if name == "v" and a.chunks[row_ax] != kchunks:
            want[row_ax] = kchunks
        if name == "m":
            if a.shape[-2] > 1 and a.chunks[-2] != qchunks:
                want[a.ndim - 2] = qchunks
            if a.shape[-1] > 1 and a.chunks[-1] != kchunks:
                want[a.ndim - 1] = kchunks
        return a.rechunk(want) if want else a

    for name in ("q", "k", "v", "m"):
        if arrays[name] is not None:
            arrays[name] = rechunk(name, arrays[name])
    q, k, v, m = arrays["q"], arrays["k"], arrays["v"], arrays["m"]
    qb, kb = _bounds(qchunks), _bounds(kchunks)
    off = 0 if causal_alignment == "top_left" else Lk - Lq
    token = tokenize(q.name, k.name, v.name, None if m is None else m.name, is_causal, scale,
                     causal_alignment, n_threads, sim, params, split_every)
    pname, oname, lname = (f"fastattn-sdpa-{w}-{token}" for w in ("part", "out", "lse"))
    dsk = {}

    def bidx(a, idx):
        return tuple(i if a.shape[ax] > 1 else 0 for ax, i in enumerate(idx))

    n_calls = 0
    for idx in itertools.product(*(range(len(c)) for c in bchunks)):
        bshape = tuple(c[i] for c, i in zip(bchunks, idx))
        for i in range(len(qchunks)):
            q0, q1 = qb[i], qb[i + 1]
            parts = []
            for j in range(len(kchunks)):
                k0, k1 = kb[j], kb[j + 1]
                diag = None
                if is_causal:
                    # key kk may be seen by query ii iff kk <= ii + off
                    if k0 > q1 - 1 + off:
                        continue                      # no query of the block sees a key
                    if k1 - 1 > q0 + off:
                        diag = q0 + off - k0          # the block crosses the diagonal
                mk = None
                if m is not None:
                    mi = i if m.shape[-2] > 1 else 0
                    mj = j if m.shape[-1] > 1 else 0
                    mk = (m.name,) + bidx(m, idx) + (mi, mj)
                key = (pname,) + idx + (i, j)
                dsk[key] = (_partial, (q.name,) + bidx(q, idx) + (i, 0),
                            (k.name,) + bidx(k, idx) + (j, 0), (v.name,) + bidx(v, idx) + (j, 0),
                            mk, diag, scale, n_threads, sim, params)
                parts.append(key)
                n_calls += 1
            out_shape = bshape + (q1 - q0, dv)
            level = 0
            if split_every is None and len(parts) > 1:  # a fold: each merge takes the next part
                acc = parts[0]
                for g, part in enumerate(parts[1:]):
                    mkey = (f"fastattn-sdpa-chain-{token}",) + idx + (i, g)
                    dsk[mkey] = (_merge, acc, part)
                    acc = mkey
                parts = [acc]
            while len(parts) > 1:
                nxt = []
                for g in range(0, len(parts), split_every):
                    mkey = (f"fastattn-sdpa-merge{level}-{token}",) + idx + (i, g // split_every)
                    dsk[mkey] = (_merge,) + tuple(parts[g:g + split_every])
                    nxt.append(mkey)
                parts, level = nxt, level + 1
            final = parts[0] if parts else None
            if final is None:
                final = (f"fastattn-sdpa-empty-{token}",) + idx + (i,)
                dsk[final] = (_empty, out_shape, dt)
            dsk[(oname,) + idx + (i, 0)] = (operator.getitem, final, 0)
            dsk[(lname,) + idx + (i,)] = (operator.getitem, final, 1)
    deps = [a for a in (q, k, v, m) if a is not None]
    out_layer = {kk: vv for kk, vv in dsk.items() if kk[0] != lname}
    graph = HighLevelGraph.from_collections(oname, out_layer, dependencies=deps)
    out = da.Array(graph, oname, chunks=tuple(bchunks) + (qchunks, (dv,)),
                   meta=np.empty((0,) * (nb + 2), dt))
    if not return_lse:
        return out
    lse_layer = {kk: vv for kk, vv in dsk.items() if kk[0] != oname}
    lgraph = HighLevelGraph.from_collections(lname, lse_layer, dependencies=deps)
    lse = da.Array(lgraph, lname, chunks=tuple(bchunks) + (qchunks,),
                   meta=np.empty((0,) * (nb + 1), dt))
    return out, lse


def scaled_dot_product_attention(query, key, value, attn_mask=None, is_causal=False, scale=None,
                                 *, causal_alignment="top_left", n_threads=None,
                                 return_lse=False, split_every=None):
    """:func:`fastattn.scaled_dot_product_attention` over dask arrays.

    ``query`` (..., Lq, d), ``key`` (..., Lk, d), ``value`` (..., Lk, dv) and
    ``attn_mask`` (broadcastable to (..., Lq, Lk)) may be dask or NumPy
    arrays; the batch dims broadcast.  Returns a lazy dask array (..., Lq, dv)
    chunked like the queries (batch and query chunks), and its lse
    (..., Lq) when ``return_lse=True``.  Key chunks become partials merged by
    :func:`fastattn.merge_attention`: ``split_every=None`` (default) folds
    them in key order, one merge per partial (the fewest partials alive at
    once: the lowest worker memory measured); an int >= 2 builds a balanced
    tree of that fan-in (a shorter path when there are many key chunks and
    few query blocks).  The merge is associative: both agree to rounding.
    ``n_threads=None``: :func:`task_threads` decides on the worker.
    """
    return _attention_graph(query, key, value, attn_mask, is_causal, scale, causal_alignment,
                            n_threads, None, None, return_lse, split_every)


def attention(query, key, value, similarity="dot", *, params=None, attn_mask=None,
              is_causal=False, causal_alignment="top_left", n_threads=None, return_lse=False,
              split_every=None):
    """:func:`fastattn.attention` over dask arrays (as
    :func:`scaled_dot_product_attention`).  ``similarity`` is a registry name
    (or a registered similarity object, sent by its name) resolved on each
    worker; a name the worker does not know raises there, naming it."""
    if isinstance(similarity, Similarity):
        name = similarity.name
        try:
            registered = registry.get_similarity(name)
        except registry.UnknownSimilarityError:
            registered = None
        if registered is None or type(registered) is not type(similarity):
            raise ValueError(
                f"similarity: {type(similarity).__name__} instance {name!r} is not the "
                "registered similarity of that name; fastattn.dask sends similarities by "
                "registry name, so register it (fastattn.register_similarity) and make it "
                "available on the workers")
        similarity = name
    if not isinstance(similarity, str):
        raise TypeError(f"similarity: expected a registered name (str) or a registered "
                        f"Similarity, got {describe(similarity)}")
    return _attention_graph(query, key, value, attn_mask, is_causal, None, causal_alignment,
                            n_threads, similarity, params, return_lse, split_every)


# ---------------------------------------------------------------- layers

def _apply_block(layer, x, mask, n_threads):
    nt = task_threads(n_threads)
    kwargs = {} if mask is None else {"key_mask": mask}
    with fastattn.threads(nt):
        return layer(x, **kwargs)


def apply(layer, x, *, key_mask=None, n_threads=None):
    """Run ``layer`` on every batch chunk of ``x`` (B, L, E): a lazy dask
    array of the layer's outputs, chunked like x's batch.

    The layer must map batch rows independently (MultiHeadAttention,
    SelfAttention, ...) and return one array.  It enters the graph once, as
    one key every task depends on, so each worker receives it once.
    ``key_mask`` (B, L) boolean (True = real token), dask or NumPy, is passed
    as the layer's ``key_mask``.  The L and E axes must be one chunk each.
    """
    if not callable(layer):
        raise TypeError(f"layer: expected a callable layer, got {describe(layer)}")
    x = _as_dask(x, "x")
    if x.ndim != 3:
        raise ValueError(f"x: expected shape (B, L, E), got {x.shape}")
    _one_chunk(x, 1, "x", "sequence")
    _one_chunk(x, 2, "x", "feature")
    m = None
    if key_mask is not None:
        m = _as_dask(key_mask, "key_mask")
        if m.shape != x.shape[:2]:
            raise ValueError(f"key_mask: expected shape {x.shape[:2]} (B, L), got {m.shape}")
        if m.dtype != np.bool_:
            raise TypeError(f"key_mask: expected a boolean array (True = real token), got "
                            f"dtype {m.dtype}")
        m = m.rechunk((x.chunks[0], -1))
    probe_x = np.zeros((1,) + x.shape[1:], x.dtype)
    probe = _apply_block(layer, probe_x, None if m is None else np.ones((1, x.shape[1]), bool), 1)
    if not isinstance(probe, np.ndarray) or probe.ndim < 1 or probe.shape[0] != 1:
        raise TypeError(f"layer: expected it to return one array with the batch first, got "
                        f"{describe(probe)} for a batch of 1")
    token = tokenize(x.name, None if m is None else m.name, n_threads, id(layer))
    lkey = f"fastattn-layer-{tokenize(layer) if _tokenizable(layer) else token}"
    name = f"fastattn-apply-{token}"
    dsk = {lkey: layer}
    for b in range(len(x.chunks[0])):
        mk = None if m is None else (m.name, b, 0)
        dsk[(name, b) + (0,) * (probe.ndim - 1)] = (_apply_block, lkey, (x.name, b, 0, 0), mk,
                                                      n_threads)
    deps = [x] + ([m] if m is not None else [])
    graph = HighLevelGraph.from_collections(name, dsk, dependencies=deps)
    chunks = (x.chunks[0],) + tuple((n,) for n in probe.shape[1:])
    return da.Array(graph, name, chunks=chunks, meta=np.empty((0,) * probe.ndim, probe.dtype))


def _tokenizable(layer):
    try:
        tokenize(layer)
        return True
    except Exception:  # noqa: BLE001 - any failure: fall back to the call's token
        return False
