"""``Attention`` (cross-attention with learned W_Q, W_K, W_V over any registered
similarity) and ``SelfAttention`` (q = k = v, optional causal).

Batch-first: ``query (B, Lq, query_dim)``, ``key (B, Lk, key_dim)``,
``value (B, Lk, value_dim)``, or unbatched ``(L, E)``.  Masks as everywhere
in fastattn: ``attn_mask`` boolean True = may attend (float = added to the
scores), broadcast against ``(B, Lq, Lk)``; ``key_mask (B, Lk)`` True = real
token.  The math is one call of :func:`fastattn.attention` on the projected
inputs ``Q = query W_Qᵀ (+ b_Q)``, ``K = key W_Kᵀ``, ``V = value W_Vᵀ``.

State-dict names: ``W_Q``, ``W_K``, ``W_V`` (``(out, in)``, torch's Linear
layout), ``b_Q``, ``b_K``, ``b_V`` with ``bias=True``, and the similarity's
parameters as ``sim.<name>`` (e.g. ``sim.W_q``, ``sim.v`` for additive).
"""
from __future__ import annotations

import math

import numpy as np

from .. import functional as F
from ._base import (Layer, _config_seed, _rng, _similarity_config, as_float_input, check_bool,
                    check_dtype, check_int, init_similarity_params, resolve_similarity)

__all__ = ["Attention", "SelfAttention", "combine_masks"]


def combine_masks(attn_mask, key_mask, B, Lq, Lk, unbatched):
    """attn_mask (bool or float, broadcast to (B, Lq, Lk)) and key_mask (B, Lk) bool
    True = real token, as one mask for :func:`fastattn.attention`."""
    if key_mask is None:
        return attn_mask
    km = np.asarray(key_mask)
    if km.dtype != np.bool_:
        raise TypeError(f"key_mask: expected a boolean array (True = real token), got dtype {km.dtype}")
    want = (Lk,) if unbatched else (B, Lk)
    if km.shape != want:
        raise ValueError(f"key_mask: expected shape {want}, got {km.shape}")
    km = km[None, :] if unbatched else km[:, None, :]
    if attn_mask is None:
        return km
    am = np.asarray(attn_mask)
    if am.dtype == np.bool_:
        return am & km
    if am.dtype.kind != "f":
        raise TypeError(f"attn_mask: expected a boolean or floating array, got dtype {am.dtype}")
    return np.where(km, am, -np.inf)


class Attention(Layer):
    """Cross-attention ``softmax(score(query W_Qᵀ, key W_Kᵀ)) (value W_Vᵀ)``.

    Parameters
    ----------
    query_dim, key_dim, value_dim : int
        Input feature sizes (``value_dim`` defaults to ``key_dim``).
    similarity : str, Similarity or config dict
        Any registered similarity (``"dot"``, ``"scaled_dot"``, ``"general"``,
        ``"additive"``, ``"concat"``, ``"cosine"``, plugins).
    embed_dim : int
        Size of the projected queries and keys (default ``query_dim``).
    out_dim : int
        Size of the projected values (default ``value_dim``).
    attn_dim : int
        The similarity's inner size ``d_a`` (additive / concat; default ``embed_dim``).
    bias : bool
        Biases on the three projections (default False).
    seed : int or np.random.Generator
    dtype : float32 (default) or float64
    """

    def __init__(self, query_dim, key_dim=None, value_dim=None, *, similarity="dot", embed_dim=None,
                 out_dim=None, attn_dim=None, bias=False, seed=None, dtype=np.float32):
        query_dim = check_int(query_dim, "query_dim")
        key_dim = query_dim if key_dim is None else check_int(key_dim, "key_dim")
        value_dim = key_dim if value_dim is None else check_int(value_dim, "value_dim")
        embed_dim = query_dim if embed_dim is None else check_int(embed_dim, "embed_dim")
        out_dim = value_dim if out_dim is None else check_int(out_dim, "out_dim")
        attn_dim = embed_dim if attn_dim is None else check_int(attn_dim, "attn_dim")
        bias = check_bool(bias, "bias")
        dt = check_dtype(dtype)
        self.similarity = resolve_similarity(similarity)
        self._config = dict(query_dim=query_dim, key_dim=key_dim, value_dim=value_dim,
                            similarity=_similarity_config(self.similarity), embed_dim=embed_dim,
                            out_dim=out_dim, attn_dim=attn_dim, bias=bias, seed=_config_seed(seed),
                            dtype=dt.name)
        self._dims = dict(query_dim=query_dim, key_dim=key_dim, value_dim=value_dim)
        rng = _rng(seed)
        p = {}
        for name, (o, i) in (("Q", (embed_dim, query_dim)), ("K", (embed_dim, key_dim)),
                             ("V", (out_dim, value_dim))):
            lim = math.sqrt(6.0 / (o + i))  # Glorot uniform
            p[f"W_{name}"] = rng.uniform(-lim, lim, (o, i)).astype(dt)
        if bias:
            for name, n in (("Q", embed_dim), ("K", embed_dim), ("V", out_dim)):
                p[f"b_{name}"] = np.zeros(n, dt)
        for k, v in init_similarity_params(self.similarity, embed_dim, embed_dim, attn_dim, rng, dt).items():
            p[f"sim.{k}"] = v
        self._params = p

    def _sim_params(self):
        return {k[4:]: v for k, v in self._params.items() if k.startswith("sim.")} or None

    def _proj(self, x, name):
        return F.linear(x, self._params[f"W_{name}"], self._params.get(f"b_{name}"))

    def __call__(self, query, key=None, value=None, **kwargs):
        return self.forward(query, key, value, **kwargs)

    def forward(self, query, key=None, value=None, *, attn_mask=None, key_mask=None, is_causal=False,
                return_weights=False, causal_alignment="top_left", n_threads=None):
        """``(B, Lq, out_dim)`` (or unbatched ``(Lq, out_dim)``); with
        ``return_weights`` also the weights ``(B, Lq, Lk)``.  ``key`` defaults to
        ``query``, ``value`` to ``key``."""
        query, key, value, mask = self._inputs(query, key, value, attn_mask, key_mask)
        q, k, v = self._proj(query, "Q"), self._proj(key, "K"), self._proj(value, "V")
        return F.attention(q, k, v, self.similarity, params=self._sim_params(), attn_mask=mask,
                           is_causal=is_causal, return_weights=return_weights,
                           causal_alignment=causal_alignment, n_threads=n_threads)

    def forward_backward(self, query, key=None, value=None, *, attn_mask=None, key_mask=None,
                         is_causal=False, causal_alignment="top_left", n_threads=None):
        """``(out, backprop)`` for :meth:`forward`'s arguments (no weights).
        ``backprop(grad_out)`` adds the gradients of the projections and of the
        similarity's parameters (``sim.*``) into :attr:`grads` and returns one
        gradient per input given: ``(dquery,)`` when key and value default to
        the query (the sum of the three roles), ``(dquery, dkey)`` when value
        defaults to key, else ``(dquery, dkey, dvalue)``.  The forward keeps
        the projected inputs, the output and its lse (O(L) beyond them); the
        inputs must not change before ``backprop`` is called."""
        n_given = 1 if key is None and value is None else 2 if value is None else 3
        query, key, value, mask = self._inputs(query, key, value, attn_mask, key_mask)
        q, k, v = self._proj(query, "Q"), self._proj(key, "K"), self._proj(value, "V")
        sp = self._sim_params()
        out, lse = F.attention(q, k, v, self.similarity, params=sp, attn_mask=mask,
                               is_causal=is_causal, causal_alignment=causal_alignment,
                               n_threads=n_threads, return_lse=True)
        p = self._params

        def backprop(grad_out):
            dq, dk, dv, dsim = F.attention_backward(
                grad_out, q, k, v, self.similarity, params=sp, out=out, lse=lse, attn_mask=mask,
                is_causal=is_causal, causal_alignment=causal_alignment, n_threads=n_threads)
            g = self.grads
            dx = []
            for name, x, d in (("Q", query, dq), ("K", key, dk), ("V", value, dv)):
                b = p.get(f"b_{name}")
                dxi, dw, db = F.linear_backward(d, x, p[f"W_{name}"], b, n_threads=n_threads)
                g[f"W_{name}"] += dw
                if b is not None:
                    g[f"b_{name}"] += db
                dx.append(dxi)
            for name, d in (dsim or {}).items():
                g[f"sim.{name}"] += d
            if n_given == 1:
                return (dx[0] + dx[1] + dx[2],)
            if n_given == 2:
                return (dx[0], dx[1] + dx[2])
            return tuple(dx)
        return out, backprop

    def _inputs(self, query, key, value, attn_mask, key_mask):
        """The validated ``(query, key, value, mask)`` of a call (key defaults to
        the query, value to the key; the masks combined)."""
        c = self._dims
        query = as_float_input(query, "query", (2, 3), last=c["query_dim"])
        key = query if key is None else as_float_input(key, "key", (2, 3), last=c["key_dim"])
        value = key if value is None else as_float_input(value, "value", (2, 3), last=c["value_dim"])
        if key.shape[-1] != c["key_dim"]:
            raise ValueError(f"key: expected last dim {c['key_dim']}, got shape {key.shape}")
        if value.shape[-1] != c["value_dim"]:
            raise ValueError(f"value: expected last dim {c['value_dim']}, got shape {value.shape}")
        if not (query.ndim == key.ndim == value.ndim):
            raise ValueError(f"key, value: expected the same number of dims as query ({query.ndim}), "
                             f"got key {key.shape}, value {value.shape}")
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"value: expected leading shape {key.shape[:-1]} (key's), got {value.shape}")
        unbatched = query.ndim == 2
        if not unbatched and key.shape[0] != query.shape[0]:
            raise ValueError(f"key: expected batch size {query.shape[0]} (query's), got shape {key.shape}")
        B = 1 if unbatched else query.shape[0]
        if attn_mask is not None and np.ndim(attn_mask) > query.ndim:
            # F.attention would broadcast the extra dims into the output's batch
            want = (query.shape[-2], key.shape[-2]) if unbatched else (B, query.shape[-2], key.shape[-2])
            raise ValueError(
                f"attn_mask: expected at most {query.ndim} dims, a shape broadcastable to "
                f"{'(Lq, Lk)' if unbatched else '(B, Lq, Lk)'} = {want}, got shape {np.shape(attn_mask)}")
        mask = combine_masks(attn_mask, key_mask, B, query.shape[-2], key.shape[-2], unbatched)
        return query, key, value, mask


class SelfAttention(Attention):
    """``Attention`` with q = k = v = x; ``causal=True`` masks future positions."""

    def __init__(self, embed_dim, *, similarity="dot", out_dim=None, attn_dim=None, causal=False,
                 bias=False, seed=None, dtype=np.float32):
        embed_dim = check_int(embed_dim, "embed_dim")
        causal = check_bool(causal, "causal")
        super().__init__(embed_dim, embed_dim, embed_dim, similarity=similarity, embed_dim=embed_dim,
                         out_dim=out_dim, attn_dim=attn_dim, bias=bias, seed=seed, dtype=dtype)
        self._config = dict(embed_dim=embed_dim, similarity=self._config["similarity"],
                            out_dim=self._config["out_dim"], attn_dim=self._config["attn_dim"],
                            causal=causal, bias=bias, seed=self._config["seed"],
                            dtype=self._config["dtype"])
        self.causal = causal

    def forward(self, x, *, attn_mask=None, key_mask=None, return_weights=False, n_threads=None):
        """x (B, L, embed_dim) or (L, embed_dim)."""
        x = as_float_input(x, "x", (2, 3), last=self._dims["query_dim"])  # errors name x, not query
        return super().forward(x, None, None, attn_mask=attn_mask, key_mask=key_mask,
                               is_causal=self.causal, return_weights=return_weights,
                               n_threads=n_threads)

    def __call__(self, x, **kwargs):
        return self.forward(x, **kwargs)

    def forward_backward(self, x, *, attn_mask=None, key_mask=None, n_threads=None):
        """``(out, backprop)``; ``backprop(grad_out)`` returns ``(dx,)`` (see
        :meth:`Attention.forward_backward`)."""
        x = as_float_input(x, "x", (2, 3), last=self._dims["query_dim"])
        return super().forward_backward(x, None, None, attn_mask=attn_mask, key_mask=key_mask,
                                        is_causal=self.causal, n_threads=n_threads)
