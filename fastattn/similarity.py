"""Similarity (score) functions for :func:`fastattn.attention`.

A similarity turns a tile of queries ``(..., tq, d_q)`` and a tile of keys
``(..., tk, d_k)`` into scores ``(..., tq, tk)``; :func:`fastattn.attention`
feeds them to the masked streaming softmax and combines with the values.

Built-ins (formulas for one query row ``q`` and key row ``k``; shapes of
the parameters in ``params``; ``d_a`` is the attention size and is read off
the parameters):

============  =====================================  ===========================================
name          score(q, k)                            params
============  =====================================  ===========================================
dot           q . k                                  none
scaled_dot    scale * q . k                          scale: () optional, default 1/sqrt(d)
general       scale * q^T W k                        W: (d_q, d_k); scale: () optional (1)
additive      v . tanh(W_q q + W_k k + b)            W_q: (d_a, d_q), W_k: (d_a, d_k), v: (d_a,),
                                                     b: (d_a,) optional (0);
                                                     normalize=True: v -> g * v / ||v||, g: () (1)
concat        v . tanh(W [q; k] + b)                 W: (d_a, d_q + d_k), v: (d_a,), b optional
cosine        beta * q.k / (|q| |k|)                 beta: () optional (1)
============  =====================================  ===========================================

(For ``cosine`` a zero row is divided by ``eps`` = 1e-12 instead of its
norm, so its scores are 0, as ``torch.nn.functional.normalize`` does.)

A user similarity subclasses :class:`Similarity` and implements
:meth:`Similarity.score` in NumPy (it runs through a tiled streaming
softmax, so memory stays O(tile); :meth:`Similarity.score_backward` gives
it a backward for :func:`fastattn.functional.attention_backward`), or subclasses
:class:`CompiledSimilarity` and hands over a C score-tile function in a
``PyCapsule`` (``csrc/fastattn_plugin.h``, ``fastattn/plugin.pxd``) that the
C streaming loop calls with no Python call per tile.
"""
from __future__ import annotations

import copy
import math
import numbers
import types

import numpy as np

from ._linear import _matmul, linear
from ._validation import sum_to_shape

__all__ = [
    "Similarity",
    "CompiledSimilarity",
    "DotSimilarity",
    "ScaledDotSimilarity",
    "GeneralSimilarity",
    "AdditiveSimilarity",
    "ConcatSimilarity",
    "CosineSimilarity",
    "PLUGIN_CAPSULE_NAME",
    "PLUGIN_CAPSULE_NAME_V1",
    "PLUGIN_ABI_VERSION",
]

#: Name the PyCapsule of a compiled plugin carries (see csrc/fastattn_plugin.h).
PLUGIN_CAPSULE_NAME = "fastattn.score_plugin.v2"
#: ``abi_version`` field of such a plugin's struct.
PLUGIN_ABI_VERSION = 2
#: The capsule name of a plugin built against version 1 of the ABI (abi_version
#: 1, no backward entry): still accepted, forward only.
PLUGIN_CAPSULE_NAME_V1 = "fastattn.score_plugin.v1"

_NO_DEFAULT = object()


class ParamSpec:
    """One parameter: symbolic shape, whether required, its default, a docstring.

    ``default`` (a scalar, for scalar parameters) is filled in by
    :meth:`Similarity.check_params` when the parameter is not given.
    ``zero_default=True`` says an optional array parameter left out acts as
    zeros (a bias): :meth:`Similarity.init_params` then gives zeros.  An
    optional parameter with neither (e.g. ``scaled_dot``'s ``scale``, whose
    default depends on the inputs) is left out of ``init_params``'s dict.
    Immutable (similarities share their specs with every caller).
    """

    __slots__ = ("shape", "required", "default", "doc", "zero_default")

    def __init__(self, shape, required=True, default=None, doc="", zero_default=False):
        for attr, val in (("shape", tuple(shape)), ("required", required), ("default", default),
                          ("doc", doc), ("zero_default", bool(zero_default))):
            object.__setattr__(self, attr, val)

    def __setattr__(self, name, value):
        raise AttributeError(f"ParamSpec is immutable: cannot set {name!r}")

    def __delattr__(self, name):
        raise AttributeError(f"ParamSpec is immutable: cannot delete {name!r}")

    def __repr__(self):
        return (f"ParamSpec(shape={self.shape!r}, required={self.required!r}, "
                f"default={self.default!r})")


def _fits(a, dtype) -> bool:
    """True when every (finite) value of the real array ``a`` is within the
    range of the float ``dtype``, so that casting it cannot overflow."""
    dtype = np.dtype(dtype)
    if a.dtype.kind == "f" and a.dtype.itemsize <= dtype.itemsize:
        return True
    if a.dtype.kind in "iu" and dtype.itemsize >= 4:
        return True  # |int64| < 9.3e18 < float32 max
    big = np.max(np.abs(a.astype(np.float64) if a.dtype.kind in "iu" else a),
                 where=np.isfinite(a), initial=0)
    return bool(big <= np.finfo(dtype).max)


def _dim_value(sym, dims):
    if isinstance(sym, int):
        return sym
    total = 0
    for part in sym.split("+"):
        part = part.strip()
        if part not in dims:
            return None
        total += dims[part]
    return total


class Similarity:
    """Base class of every similarity.

    Subclasses set

    * ``name`` -- the registry name (a str);
    * ``params_spec`` -- ``{param name: ParamSpec(shape, required, default, doc)}``
      where ``shape`` is a tuple of ints and symbols: ``"d_q"`` (query
      features), ``"d_k"`` (key features), any other name (read off the first
      parameter that has it, e.g. ``"d_a"``) and sums such as ``"d_q+d_k"``.
      ``None`` (the default for user plugins) means: no checking, ``params``
      is handed to :meth:`score` as given;
    * :meth:`score`, and optionally :meth:`score_backward` (its gradients).

    Constructor keyword arguments should be stored as attributes of the same
    name so that :meth:`get_config` / :meth:`from_config` round-trip them
    (list their names in ``config_keys``).
    """

    name: str | None = None
    params_spec: dict | None = None
    config_keys: tuple = ()
    #: d_q must equal d_k (dot-like similarities)
    same_dims: bool = False
    #: set by :meth:`_freeze` (the registered built-ins): no attribute can be
    #: set or deleted any more, since every caller shares the object
    _frozen: bool = False

    def __setattr__(self, attr, value):
        if self._frozen:
            raise AttributeError(
                f"{type(self).__qualname__} {self.name!r} is a shared, read-only similarity: "
                f"cannot set {attr!r} (make your own instance instead, e.g. "
                f"{type(self).__qualname__}(...))")
        object.__setattr__(self, attr, value)

    def __delattr__(self, attr):
        if self._frozen:
            raise AttributeError(
                f"{type(self).__qualname__} {self.name!r} is a shared, read-only similarity: "
                f"cannot delete {attr!r}")
        object.__delattr__(self, attr)

    def _freeze(self):
        object.__setattr__(self, "_frozen", True)
        return self

    # ------------------------------------------------------------ the math
    def score(self, query, key, params):
        """Scores of a query tile against a key tile.

        query : ndarray (..., tq, d_q); key : ndarray (..., tk, d_k), both of
        the compute dtype (float32 or float64), read-only, with equal leading
        dims.  params : the checked parameter dict (arrays in the compute
        dtype) or, without ``params_spec``, what the caller passed.
        Returns (..., tq, tk) real floating scores; ``-inf`` forbids a pair,
        NaN and ``+inf`` are errors.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__}.score is not implemented")

    def score_backward(self, query, key, params, grad_scores):
        """Optional: the gradients of a score tile, for
        :func:`fastattn.functional.attention_backward`.

        ``query``, ``key`` and ``params`` are what :meth:`score` got for this
        tile; ``grad_scores`` (..., tq, tk) is dL/d(scores) in the compute
        dtype (exactly 0 where a pair may not attend).  Returns ``(dq, dk,
        dparams)``: dq (..., tq, d_q) and dk (..., tk, d_k) with the tiles'
        leading dims, and a dict ``{param name: gradient summed over the
        tile}`` in each parameter's shape (a parameter left out gets zeros).
        The backward calls it once per recomputed score tile and adds the
        results up.  Without it (the default raises NotImplementedError) the
        similarity has no backward.
        """
        raise NotImplementedError(
            f"{type(self).__qualname__}.score_backward is not implemented")

    # ---------------------------------------------------------- parameters
    def check_params(self, params, d_q, d_k, dtype):
        """Validate ``params`` against ``params_spec``; returns a new dict of
        arrays of ``dtype`` (inputs are never modified)."""
        spec = self.params_spec
        if spec is None:
            return params
        where = f"similarity {self.name!r}"
        if params is None:
            params = {}
        if not isinstance(params, dict):
            raise TypeError(
                f"params: expected a dict of arrays for {where}, got {type(params).__name__}")
        bad_keys = [key for key in params if not isinstance(key, str)]
        if bad_keys:
            raise TypeError(
                f"params: keys must be str (parameter names) for {where}, got "
                f"{', '.join(f'{type(key).__name__} {key!r}' for key in bad_keys)}; expected "
                f"{self._describe_spec()}")
        unknown = sorted(set(params) - set(spec))
        if unknown:
            raise ValueError(
                f"params: unexpected key(s) {unknown} for {where}; expected "
                f"{self._describe_spec()}")
        dims = {"d_q": d_q, "d_k": d_k}
        out = {}
        for pname, ps in spec.items():
            if pname not in params or params[pname] is None:
                if ps.required:
                    raise ValueError(
                        f"params: missing {pname!r} for {where}; expected {self._describe_spec()}")
                if ps.default is not None:
                    out[pname] = np.asarray(ps.default, dtype=dtype)
                continue
            raw = params[pname]
            try:
                a = np.asarray(raw)
            except Exception as exc:
                raise TypeError(f"params[{pname!r}]: expected an array of real numbers ({exc})") from None
            if a.dtype.kind not in "fiu" or (a.dtype.kind == "f" and a.dtype.itemsize > 8):
                raise TypeError(
                    f"params[{pname!r}]: expected real numbers (float32/float64) for {where}, "
                    f"got dtype {a.dtype}")
            if a.ndim != len(ps.shape):
                raise ValueError(
                    f"params[{pname!r}]: expected shape {self._sym(ps.shape)} for {where}, "
                    f"got {a.ndim}-d array of shape {a.shape}")
            for sym, n in zip(ps.shape, a.shape):
                want = _dim_value(sym, dims)
                if want is None:
                    dims[sym] = n
                elif want != n:
                    exp = tuple(_dim_value(s, dims) if _dim_value(s, dims) is not None else s
                                for s in ps.shape)
                    raise ValueError(
                        f"params[{pname!r}]: expected shape {self._sym(ps.shape)} = {exp} for "
                        f"{where} (d_q={d_q}, d_k={d_k}), got {a.shape}")
            if a.dtype.kind == "f" and not np.all(np.isfinite(a)):
                raise ValueError(f"params[{pname!r}]: contains NaN or infinite values")
            if a.size and not _fits(a, dtype):
                raise ValueError(
                    f"params[{pname!r}]: values out of {np.dtype(dtype).name} range (the "
                    f"compute dtype of query/key/value; max {np.finfo(dtype).max:.4g}), got "
                    f"max |value| {float(np.max(np.abs(a.astype(np.float64)))):.4g}")
            a = np.array(a, dtype=dtype, copy=True, order="C")
            a.flags.writeable = False
            out[pname] = a
        return out

    @staticmethod
    def _sym(shape):
        return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"

    def _describe_spec(self):
        spec = self.params_spec or {}
        if not spec:
            return "no parameters"
        return ", ".join(f"{n}: {self._sym(p.shape)}{'' if p.required else ' (optional)'}"
                         for n, p in spec.items())

    def init_params(self, d_q, d_k=None, *, rng=None, dtype=np.float64, **dims):
        """Random parameters of the right shapes (Glorot-uniform matrices,
        zero biases, documented defaults for scalars; an optional parameter
        without a fixed default, such as ``scaled_dot``'s ``scale`` =
        1/sqrt(d), is left out so that its default applies); extra dims such as
        ``d_a=`` must be given.  ``rng``: a seed or np.random.Generator."""
        spec = self.params_spec
        if spec is None:
            return None
        rng = np.random.default_rng(rng)
        d_k = d_q if d_k is None else d_k
        all_dims = {"d_q": d_q, "d_k": d_k, **dims}
        out = {}
        for pname, ps in spec.items():
            shape = []
            for sym in ps.shape:
                n = _dim_value(sym, all_dims)
                if n is None:
                    raise ValueError(f"init_params: give {sym}=... for parameter {pname!r}")
                shape.append(n)
            if not ps.required:
                if ps.default is not None:
                    out[pname] = np.full(shape, ps.default, dtype=dtype)
                elif ps.zero_default:
                    out[pname] = np.zeros(shape, dtype=dtype)
                # else: no fixed default (it depends on the inputs): leave it out
                continue
            if len(shape) == 0:
                out[pname] = np.asarray(1.0, dtype=dtype)
                continue
            fan = sum(shape) if len(shape) > 1 else shape[0] + 1
            lim = math.sqrt(6.0 / fan) if fan else 0.0  # fan 0: an empty matrix
            out[pname] = rng.uniform(-lim, lim, size=shape).astype(dtype)
        return out

    # ----------------------------------------------------------- config
    def get_config(self) -> dict:
        """``{"name": ..., **constructor kwargs}`` -- JSON-friendly."""
        cfg = {"name": self.name}
        for key in self.config_keys:
            cfg[key] = getattr(self, key)
        return cfg

    @classmethod
    def from_config(cls, config: dict):
        cfg = dict(config)
        name = cfg.pop("name", None)
        obj = cls(**cfg)
        if name is not None and name != obj.name:
            obj = obj._renamed(name)
        return obj

    def _renamed(self, name):
        other = copy.copy(self)
        object.__setattr__(other, "name", name)
        return other

    def __repr__(self):
        args = ", ".join(f"{k}={getattr(self, k)!r}" for k in self.config_keys)
        return f"{type(self).__qualname__}({args})"

    # ------------------------------------------------ decoding with a memory
    def precompute_keys(self, key, params):
        """``(similarity, params, key')`` with ``attention(q, key', v, similarity,
        params=params)`` equal to ``attention(q, key, v, self, params=...)``
        for every query: whatever depends on the keys only (a key projection)
        is applied once, here, instead of on every call -- what a decoder
        does once per source sentence.  Default: nothing to precompute.
        ``params`` must already be checked (``check_params``)."""
        return self, params, key

    # ------------------------------------------- how attention() runs it
    def _lower(self, query, key, params):
        """Optional: a fast path.  Returns ``("sdpa", q2, k2, scale)`` (scores =
        scale * q2 . k2, run by the dot kernel), ``("project_sdpa", M, k, scale)``
        (the same with q2 = q M^T, projected by fastattn), ``("additive", W_q, W_k, b,
        v)`` (the fused C additive kernel) or None (tiled NumPy path)."""
        return None

    def _lower_backward(self, query, key, params, grads):
        """The chain rule back through :meth:`_lower` (defined by the class that
        defines ``_lower``; :func:`fastattn.functional.attention_backward`
        uses a lowering only then).  ``grads`` holds the gradients of what the
        lowered call computed with: for ``"sdpa"`` ``{"query", "key",
        "scale"}`` (w.r.t. q2, k2 and the scale); for ``"project_sdpa"``
        ``{"query", "M", "key", "scale"}`` (query: w.r.t. the original
        queries, already through q M^T); for ``"additive"`` ``{"query",
        "key", "W_q", "W_k", "b", "v"}`` (key: w.r.t. the keys the kernel
        read, W_k None when it projected none).  Returns ``(dq, dk,
        dparams)``, dparams with the keys of the checked ``params``."""
        raise NotImplementedError(
            f"{type(self).__qualname__}._lower_backward is not implemented")


class CompiledSimilarity(Similarity):
    """A similarity whose score tiles come from C (see ``csrc/fastattn_plugin.h``).

    Subclasses set ``capsule`` to a ``PyCapsule`` named
    ``"fastattn.score_plugin.v2"`` (ABI version 2; a version 1 plugin's
    ``"fastattn.score_plugin.v1"`` still works, forward only) wrapping a
    ``fastattn_score_plugin`` struct, and may override :meth:`pack_params`,
    whose array's data pointer is passed to the C functions as ``params``.
    The C functions are called from fastattn's worker threads without the
    GIL.  ``score`` (NumPy) is optional; it is not used by
    :func:`fastattn.attention`.

    A version 2 plugin may fill in ``score_backward_f32`` / ``_f64``;
    :func:`fastattn.functional.attention_backward` then calls them on each
    score tile, and :meth:`unpack_param_grads` turns the gradient of the
    packed array into the named parameters' gradients.  Without them, a
    NumPy ``score`` and ``score_backward`` defined on the subclass are used;
    with neither, attention_backward raises NotImplementedError.
    """

    capsule = None
    same_dims = True

    def pack_params(self, params, d, dtype) -> np.ndarray:
        """A C-contiguous array whose buffer the C function reads as ``params``
        (default: the float64 values of ``params_spec``'s entries, flattened
        and concatenated in spec order; an empty array when there are none)."""
        if not params:
            return np.zeros(1, dtype=np.float64)
        return np.ascontiguousarray(
            np.concatenate([np.ravel(np.asarray(params[n], dtype=np.float64))
                            for n in (self.params_spec or params) if n in params]))

    def unpack_param_grads(self, grad_packed, params, d) -> dict:
        """The gradients of the named parameters from ``grad_packed``, the
        float64 gradient of the array :meth:`pack_params` returned (one
        element per element of it), as the C ``score_backward`` accumulated
        it.  The default inverts the default :meth:`pack_params`: consecutive
        slices, in ``params_spec`` order, each reshaped to its parameter's
        shape.  Override it together with ``pack_params``."""
        if not params:
            return {}
        out, at = {}, 0
        for n in (self.params_spec or params):
            if n not in params:
                continue
            shape = np.shape(params[n])
            size = int(np.prod(shape, dtype=np.int64))
            out[n] = grad_packed[at:at + size].reshape(shape)
            at += size
        if at != grad_packed.size:
            raise ValueError(
                f"similarity {self.name!r}: unpack_param_grads got a packed gradient of "
                f"{grad_packed.size} elements, the parameters have {at}; a class that "
                "overrides pack_params with another layout must override unpack_param_grads "
                "too")
        return out


# ------------------------------------------------------------------ built-ins

def _matmul_t(x, w):
    """x @ w.T for x (..., L, a), w (b, a)."""
    return np.matmul(x, w.T)


# ---------------------------------------------- pieces of the backward

def _rows(a):
    """a as a 2-D (rows, features) array (a view when it can be)."""
    return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _sum_rows_t(a, x):
    """sum over every row r (all leading dims) of the outer product a_r x_r^T:
    (n_a, n_x), the gradient of a linear map y = x M^T from dy = a."""
    return np.matmul(_rows(a).T, _rows(x))


def _additive_tanh(qp, kp):
    """tanh(qp_i + kp_j) for a query tile (..., tq, d_a) and a key tile
    (..., tk, d_a): (..., tq, tk, d_a)."""
    return np.tanh(qp[..., :, None, :] + kp[..., None, :, :])


def _additive_tile_backward(t, v, grad_scores):
    """``(dqp, dkp, dv)`` of the scores s_ij = v . t_ij with t = tanh(qp_i + kp_j)
    (``t`` from :func:`_additive_tanh`), given dL/ds (..., tq, tk):
    dh = ds_ij v (1 - t_ij^2), dqp_i = sum_j dh_ij, dkp_j = sum_i dh_ij,
    dv = sum_ij ds_ij t_ij."""
    dh = np.multiply(t, t)
    np.subtract(1, dh, out=dh)
    dh *= v
    dh *= grad_scores[..., None]
    g = np.ascontiguousarray(np.broadcast_to(grad_scores, t.shape[:-1]), dtype=t.dtype).reshape(-1)
    dv = np.matmul(g, t.reshape(g.shape[0], t.shape[-1]))
    return dh.sum(axis=-2), dh.sum(axis=-3), dv


def _additive_grads(query, key, wq, wk, dqp, dkp, dv, n_threads=None):
    """The ``"additive"`` lowering's gradients (see :meth:`Similarity._lower_backward`)
    from those of the projections qp = q W_q^T + b and kp = k W_k^T (or of the
    keys themselves when ``wk`` is None), with the shapes of query and key.

    ``n_threads`` given (the fused backward's products over the whole batch):
    the four products run on fastattn's worker pool with BLAS held at one
    thread (``_linear._matmul``: the same bits for any thread count; NumPy's
    threaded matmul stalled up to 130 ms here, against 5 ms, right after the
    kernel); None (a tile's ``score_backward``): NumPy's matmul."""
    if n_threads is None:
        mm = np.matmul
    else:
        def mm(a, b):
            return _matmul(_rows(a), b, a.dtype, n_threads).reshape(a.shape[:-1] + b.shape[-1:])

    def sum_rows_t(a, x):
        if n_threads is None:
            return _sum_rows_t(a, x)
        return _matmul(_rows(a).T, _rows(x), a.dtype, n_threads)

    return {   # wq None: the queries are the projections themselves
        "query": dqp if wq is None else mm(dqp, wq),
        "key": dkp if wk is None else mm(dkp, wk),
        "W_q": None if wq is None else sum_rows_t(dqp, query),
        "W_k": None if wk is None else sum_rows_t(dkp, key),
        "b": None if wq is None else _rows(dqp).sum(axis=0, dtype=np.float64).astype(dqp.dtype),
        "v": dv,
    }


def _weight_norm_backward(v, g, dv_eff):
    """(dv, dg) of v_eff = g v / ||v|| from dL/dv_eff: with u = v / ||v||,
    dg = u . dv_eff and dv = (g / ||v||) (dv_eff - u (u . dv_eff)).  At v = 0
    (where v_eff is 0 for every g) both are 0."""
    v64 = np.asarray(v, dtype=np.float64)
    d64 = np.asarray(dv_eff, dtype=np.float64)
    nrm = math.sqrt(float(np.sum(np.square(v64))))
    if nrm > 0:
        u = v64 / nrm
        dg = float(u @ d64)
        dv = (float(g) / nrm) * (d64 - u * dg)
    else:
        dv, dg = np.zeros_like(v64), 0.0
    return dv.astype(np.asarray(v).dtype), np.asarray(dg, dtype=np.asarray(v).dtype)


def _scalar(x, like):
    return np.asarray(x, dtype=np.asarray(like).dtype)


class DotSimilarity(Similarity):
    """``q . k`` (no scaling)."""

    name = "dot"
    params_spec = types.MappingProxyType({})
    same_dims = True

    def score(self, query, key, params):
        return np.matmul(query, np.swapaxes(key, -1, -2))

    def _lower(self, query, key, params):
        return ("sdpa", query, key, 1.0)

    def _lower_backward(self, query, key, params, grads):
        return grads["query"], grads["key"], {}


class ScaledDotSimilarity(Similarity):
    """``scale * q . k``, scale 1/sqrt(d) unless given."""

    name = "scaled_dot"
    params_spec = types.MappingProxyType(
        {"scale": ParamSpec((), required=False, doc="default 1/sqrt(d)")})
    same_dims = True

    @staticmethod
    def _scale(query, params):
        if "scale" in params:
            return float(params["scale"])
        d = query.shape[-1]
        return 1.0 / math.sqrt(d) if d > 0 else 1.0

    def score(self, query, key, params):
        return np.matmul(query, np.swapaxes(key, -1, -2)) * query.dtype.type(self._scale(query, params))

    def _lower(self, query, key, params):
        return ("sdpa", query, key, self._scale(query, params))

    def _lower_backward(self, query, key, params, grads):
        dp = {"scale": _scalar(grads["scale"], params["scale"])} if "scale" in params else {}
        return grads["query"], grads["key"], dp


class GeneralSimilarity(Similarity):
    """Luong "general": ``scale * q^T W k`` with W (d_q, d_k)."""

    name = "general"
    params_spec = types.MappingProxyType({
        "W": ParamSpec(("d_q", "d_k"), doc="bilinear form"),
        "scale": ParamSpec((), required=False, default=1.0, doc="multiplies the scores"),
    })

    def score(self, query, key, params):
        qw = np.matmul(query, params["W"])
        return np.matmul(qw, np.swapaxes(key, -1, -2)) * params["scale"]

    def precompute_keys(self, key, params):
        kp = linear(key, params["W"])
        return builtin("scaled_dot"), {"scale": params.get("scale", np.asarray(1.0))}, kp

    def _lower(self, query, key, params):
        # q^T W k = (q W) . k: project the queries once (q W = q (W^T)^T, by
        # fastattn's single-thread-per-task gemm), then the dot kernel
        return ("project_sdpa", np.ascontiguousarray(params["W"].T), key, float(params["scale"]))

    def _lower_backward(self, query, key, params, grads):
        # M = W^T, so dW = dM^T
        return grads["query"], grads["key"], {
            "W": np.ascontiguousarray(grads["M"].T),
            "scale": _scalar(grads["scale"], params["scale"])}


class AdditiveSimilarity(Similarity):
    """Bahdanau: ``v . tanh(W_q q + W_k k + b)``.

    ``normalize=True`` is the weight-normalised form of TF-Addons'
    ``BahdanauAttention(normalize=True)``: ``v`` is replaced by
    ``g * v / ||v||`` (``g`` a scalar parameter, default 1).
    """

    name = "additive"
    config_keys = ("normalize",)
    _SPEC = {
        "W_q": ParamSpec(("d_a", "d_q"), doc="query projection"),
        "W_k": ParamSpec(("d_a", "d_k"), doc="key projection"),
        "v": ParamSpec(("d_a",), doc="output vector"),
        "b": ParamSpec(("d_a",), required=False, zero_default=True,
                       doc="bias inside the tanh (default 0)"),
    }
    _SPECS = {
        False: types.MappingProxyType(dict(_SPEC)),
        True: types.MappingProxyType(
            {**_SPEC, "g": ParamSpec((), required=False, default=1.0, doc="norm of the effective v")}),
    }
    del _SPEC

    def __init__(self, normalize=False):
        if not isinstance(normalize, (bool, np.bool_)):
            raise TypeError(f"normalize: expected a bool, got {type(normalize).__name__} {normalize!r}")
        object.__setattr__(self, "_normalize", bool(normalize))

    @property
    def normalize(self) -> bool:
        """Weight-normalised form (read-only: make a new AdditiveSimilarity to change it)."""
        return self._normalize

    @property
    def params_spec(self):
        """Read-only; has ``g`` exactly when :attr:`normalize` is set."""
        return self._SPECS[self._normalize]

    def _weights(self, params):
        v = params["v"]
        if self.normalize:
            nrm = np.sqrt(np.sum(np.square(v, dtype=np.float64)))
            v = (v * (float(params["g"]) / nrm if nrm > 0 else 0.0)).astype(params["v"].dtype)
        return params["W_q"], params["W_k"], params.get("b"), v

    def score(self, query, key, params):
        wq, wk, b, v = self._weights(params)
        qp = _matmul_t(query, wq)
        if b is not None:
            qp = qp + b
        kp = _matmul_t(key, wk)
        return np.tanh(qp[..., :, None, :] + kp[..., None, :, :]) @ v

    def precompute_keys(self, key, params):
        _, wk, _, _ = self._weights(params)
        return _precomputed_additive(self, params, key, wk)

    def _lower(self, query, key, params):
        wq, wk, b, v = self._weights(params)
        return ("additive", wq, wk, b, v)

    def _lower_backward(self, query, key, params, grads):
        dp = {"W_q": grads["W_q"], "W_k": grads["W_k"], "v": grads["v"]}
        if "b" in params:
            dp["b"] = grads["b"]
        if self.normalize:
            dp["v"], dp["g"] = _weight_norm_backward(params["v"], params["g"], grads["v"])
        return grads["query"], grads["key"], dp

    def score_backward(self, query, key, params, grad_scores):
        """Gradients of a tile of :meth:`score` (see :meth:`Similarity.score_backward`);
        with ``normalize=True`` through v_eff = g v / ||v|| (0 for v and g at v = 0)."""
        wq, wk, b, v = self._weights(params)
        qp = _matmul_t(query, wq)
        if b is not None:
            qp = qp + b
        kp = _matmul_t(key, wk)
        dqp, dkp, dv = _additive_tile_backward(_additive_tanh(qp, kp), v, grad_scores)
        dqp, dkp = sum_to_shape(dqp, qp.shape), sum_to_shape(dkp, kp.shape)
        return self._lower_backward(query, key, params,
                                    _additive_grads(query, key, wq, wk, dqp, dkp, dv))


class ConcatSimilarity(Similarity):
    """Luong "concat": ``v . tanh(W [q; k] + b)``, W (d_a, d_q + d_k).

    Runs as :class:`AdditiveSimilarity` with ``W_q = W[:, :d_q]`` and
    ``W_k = W[:, d_q:]``.
    """

    name = "concat"
    params_spec = types.MappingProxyType({
        "W": ParamSpec(("d_a", "d_q+d_k"), doc="acts on the concatenation [q; k]"),
        "v": ParamSpec(("d_a",), doc="output vector"),
        "b": ParamSpec(("d_a",), required=False, zero_default=True,
                       doc="bias inside the tanh (default 0)"),
    })

    @staticmethod
    def _split(query, params):
        d_q = query.shape[-1]
        return params["W"][:, :d_q], params["W"][:, d_q:]

    def score(self, query, key, params):
        wq, wk = self._split(query, params)
        qp = _matmul_t(query, wq)
        if "b" in params:
            qp = qp + params["b"]
        kp = _matmul_t(key, wk)
        return np.tanh(qp[..., :, None, :] + kp[..., None, :, :]) @ params["v"]

    def precompute_keys(self, key, params):
        d_k = key.shape[-1]
        wk = params["W"][:, params["W"].shape[1] - d_k:]
        out = {"W_q": params["W"][:, :params["W"].shape[1] - d_k], "v": params["v"]}
        if "b" in params:
            out["b"] = params["b"]
        return _precomputed_additive(None, out, key, wk)

    def _lower(self, query, key, params):
        wq, wk = self._split(query, params)
        return ("additive", wq, wk, params.get("b"), params["v"])

    def _lower_backward(self, query, key, params, grads):
        dp = {"W": np.concatenate([grads["W_q"], grads["W_k"]], axis=1), "v": grads["v"]}
        if "b" in params:
            dp["b"] = grads["b"]
        return grads["query"], grads["key"], dp

    def score_backward(self, query, key, params, grad_scores):
        """Gradients of a tile of :meth:`score` (see :meth:`Similarity.score_backward`)."""
        wq, wk = self._split(query, params)
        qp = _matmul_t(query, wq)
        if "b" in params:
            qp = qp + params["b"]
        kp = _matmul_t(key, wk)
        dqp, dkp, dv = _additive_tile_backward(_additive_tanh(qp, kp), params["v"], grad_scores)
        dqp, dkp = sum_to_shape(dqp, qp.shape), sum_to_shape(dkp, kp.shape)
        return self._lower_backward(query, key, params,
                                    _additive_grads(query, key, wq, wk, dqp, dkp, dv))


class CosineSimilarity(Similarity):
    """``beta * cos(q, k)``; rows are divided by max(||row||, eps)."""

    name = "cosine"
    params_spec = types.MappingProxyType(
        {"beta": ParamSpec((), required=False, default=1.0, doc="multiplies the cosine")})
    same_dims = True
    config_keys = ("eps",)

    def __init__(self, eps=1e-12):
        if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not eps > 0:
            raise ValueError(f"eps: expected a positive real number, got {eps!r}")
        object.__setattr__(self, "_eps", float(eps))

    @property
    def eps(self) -> float:
        """Floor of the row norms (read-only)."""
        return self._eps

    def _normalise(self, x):
        n = np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True))
        return x / np.maximum(n, x.dtype.type(self.eps))

    def score(self, query, key, params):
        s = np.matmul(self._normalise(query), np.swapaxes(self._normalise(key), -1, -2))
        return s * params["beta"]

    def _lower(self, query, key, params):
        return ("sdpa", self._normalise(query), self._normalise(key), float(params["beta"]))

    def _normalise_backward(self, x, dy):
        """dx of y = x / max(||x||, eps): (dy - y (y . dy)) / ||x|| where
        ||x|| >= eps, dy / eps elsewhere (the norm is then the constant eps)."""
        n = np.sqrt(np.sum(np.square(x), axis=-1, keepdims=True))
        eps = x.dtype.type(self.eps)
        big = n >= eps
        den = np.where(big, n, eps)
        y = x / den
        dx = dy - np.where(big, y * np.sum(y * dy, axis=-1, keepdims=True), 0)
        return dx / den

    def _lower_backward(self, query, key, params, grads):
        return (self._normalise_backward(query, grads["query"]),
                self._normalise_backward(key, grads["key"]),
                {"beta": _scalar(grads["scale"], params["beta"])})


class PrecomputedAdditiveSimilarity(Similarity):
    """``v . tanh(W_q q + k + b)``: additive attention over keys that are already
    projected (``k = W_k h``), made by ``AdditiveSimilarity.precompute_keys``
    / ``ConcatSimilarity.precompute_keys``.  Not registered; runs in the fused
    additive kernel without projecting the keys again."""

    name = "additive_precomputed"
    params_spec = {
        "W_q": ParamSpec(("d_k", "d_q"), doc="query projection (d_k = d_a)"),
        "v": ParamSpec(("d_k",), doc="output vector"),
        "b": ParamSpec(("d_k",), required=False, doc="bias inside the tanh (default 0)"),
    }

    def __init__(self):
        self._trusted = {}

    def check_params(self, params, d_q, d_k, dtype):
        # the parameters precompute_keys made (already checked, read-only arrays
        # of the compute dtype) are not copied and re-checked on every step
        t = self._trusted
        if (t and isinstance(params, dict) and len(params) == len(t)
                and all(params.get(k) is v for k, v in t.items())
                and all(v.dtype == dtype for v in t.values())
                and t["W_q"].shape == (d_k, d_q)):
            return params
        return super().check_params(params, d_q, d_k, dtype)

    def score(self, query, key, params):
        qp = _matmul_t(query, params["W_q"])
        if "b" in params:
            qp = qp + params["b"]
        return np.tanh(qp[..., :, None, :] + key[..., None, :, :]) @ params["v"]

    def _lower(self, query, key, params):
        return ("additive", params["W_q"], None, params.get("b"), params["v"])

    def split_query_projection(self, params):
        """``(similarity, params', W_q, b)``: ``attention(q W_qᵀ + b, k, v,
        similarity, params=params')`` equals ``attention(q, k, v, self,
        params=params)`` -- for a caller that projects the queries itself (and
        takes W_q's and b's gradients back through its own products); ``b``
        None without a bias.  ``params`` checked (``check_params``)."""
        v = np.array(params["v"])
        v.flags.writeable = False
        return ProjectedAdditiveSimilarity(), {"v": v}, params["W_q"], params.get("b")

    def _lower_backward(self, query, key, params, grads):
        dp = {"W_q": grads["W_q"], "v": grads["v"]}
        if "b" in params:
            dp["b"] = grads["b"]
        return grads["query"], grads["key"], dp

    def score_backward(self, query, key, params, grad_scores):
        qp = _matmul_t(query, params["W_q"])
        if "b" in params:
            qp = qp + params["b"]
        dqp, dkp, dv = _additive_tile_backward(_additive_tanh(qp, key), params["v"], grad_scores)
        dqp, dkp = sum_to_shape(dqp, qp.shape), sum_to_shape(dkp, key.shape)
        return self._lower_backward(query, key, params,
                                    _additive_grads(query, key, params["W_q"], None, dqp, dkp, dv))


class ProjectedAdditiveSimilarity(Similarity):
    """``v . tanh(q + k)``: additive attention whose queries and keys are both
    already projected (``q = W_q s + b``, ``k = W_k h``, width d_a each), for a
    caller that keeps the projections itself (AttentionDecoder's training loop:
    the query projection of every step, and its weight gradient, as products
    of its own over all steps).  Not registered; runs in the fused additive
    kernel with no projection at all; its backward's query gradient is that of
    the projected query."""

    name = "additive_projected"
    params_spec = {"v": ParamSpec(("d_k",), doc="output vector")}

    def check_params(self, params, d_q, d_k, dtype):
        if d_q != d_k:
            raise ValueError(f"query: expected the projected width of the keys ({d_k}) for "
                             f"similarity {self.name!r}, got {d_q}")
        v = params.get("v") if isinstance(params, dict) else None
        if (isinstance(v, np.ndarray) and len(params) == 1 and v.dtype == dtype
                and v.shape == (d_k,) and not v.flags.writeable):
            return params   # a caller's checked, read-only vector: not copied every step
        return super().check_params(params, d_q, d_k, dtype)

    def score(self, query, key, params):
        return np.tanh(query[..., :, None, :] + key[..., None, :, :]) @ params["v"]

    def _lower(self, query, key, params):
        return ("additive", None, None, None, params["v"])

    def _lower_backward(self, query, key, params, grads):
        return grads["query"], grads["key"], {"v": grads["v"]}

    def score_backward(self, query, key, params, grad_scores):
        dq, dk, dv = _additive_tile_backward(_additive_tanh(query, key), params["v"], grad_scores)
        return sum_to_shape(dq, query.shape), sum_to_shape(dk, key.shape), {"v": dv}


def _precomputed_additive(sim, params, key, wk):
    if sim is not None:
        wq, _, b, v = sim._weights(params)
        params = {"W_q": wq, "v": v}
        if b is not None:
            params["b"] = b
    kp = linear(key, wk)
    sim = PrecomputedAdditiveSimilarity()
    params = dict(params)
    if all(isinstance(v, np.ndarray) and not v.flags.writeable for v in params.values()):
        sim._trusted = dict(params)
    return sim, params, kp


BUILTINS = (DotSimilarity, ScaledDotSimilarity, GeneralSimilarity, AdditiveSimilarity,
            ConcatSimilarity, CosineSimilarity)


# One shared, read-only instance of each built-in: fastattn.registry registers
# exactly these (so get_similarity("scaled_dot") is builtin("scaled_dot")).
_BUILTIN_INSTANCES = {cls.name: cls()._freeze() for cls in BUILTINS}


def builtin(name: str) -> Similarity:
    """The shared, read-only instance of the built-in similarity ``name``."""
    return _BUILTIN_INSTANCES[name]
