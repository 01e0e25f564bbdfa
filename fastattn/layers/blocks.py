"""Building blocks for training: ``LayerNorm``, ``Dropout``, ``FeedForward``,
``MeanPooling``, ``Sequential``, ``AttentionPooling`` (Lin et al. 2017) and
``PositionalEmbedding``, each with ``forward_backward``.

Pure Python over :mod:`fastattn.functional` (``layer_norm``, ``gelu`` /
``relu``, ``dropout``, ``linear`` and their backward).  Parameter names are
torch's (``weight``, ``bias``; ``linear1`` / ``linear2`` as in
``torch.nn.TransformerEncoderLayer``).
"""
from __future__ import annotations

import numpy as np

from .. import functional as F
from .._validation import check_eps as _check_eps, check_grad_array
from ._base import (Layer, _config_seed, _rng, as_float_input, check_bool, check_dtype, check_int)
from .rnn import Linear

__all__ = ["LayerNorm", "Dropout", "FeedForward", "MeanPooling", "Sequential", "AttentionPooling",
           "PositionalEmbedding", "layer_classes"]


def _torch_sd(module_or_state_dict):
    """``{name: ndarray}`` from a torch module or a state dict (tensors or arrays)."""
    sd = module_or_state_dict.state_dict() if hasattr(module_or_state_dict, "state_dict") \
        else module_or_state_dict
    out = {}
    for k, v in sd.items():
        out[k] = v.detach().cpu().numpy() if hasattr(v, "detach") else np.asarray(v)
    return out


def _check_p(p, name="p"):
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, float, np.integer, np.floating)):
        raise TypeError(f"{name}: expected a probability (a real number), got {type(p).__name__} {p!r}")
    p = float(p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"{name}: expected a probability in [0, 1), got {p!r}")
    return p


def _check_activation(activation):
    if not isinstance(activation, str):
        raise TypeError(f"activation: expected 'relu' or 'gelu', got {type(activation).__name__} "
                        f"{activation!r}")
    if activation not in ("relu", "gelu"):
        raise ValueError(f"activation: expected 'relu' or 'gelu', got {activation!r}")
    return str(activation)


# ============================================================== LayerNorm
class LayerNorm(Layer):
    """``torch.nn.LayerNorm(normalized_shape)`` over the last axis: ``weight``
    ones and ``bias`` zeros at init (``elementwise_affine=False``: neither;
    ``bias=False``: no bias)."""

    def __init__(self, normalized_shape, eps=1e-5, *, elementwise_affine=True, bias=True,
                 dtype=np.float32):
        E = check_int(normalized_shape, "normalized_shape")
        eps = _check_eps(eps)   # functional.layer_norm's check, at construction
        elementwise_affine = check_bool(elementwise_affine, "elementwise_affine")
        bias = check_bool(bias, "bias")
        dt = check_dtype(dtype)
        self._config = dict(normalized_shape=E, eps=eps, elementwise_affine=elementwise_affine,
                            bias=bias, dtype=dt.name)
        self._params = {}
        if elementwise_affine:
            self._params["weight"] = np.ones(E, dt)
            if bias:
                self._params["bias"] = np.zeros(E, dt)

    def __call__(self, x):
        return self.forward(x)

    def _x(self, x):
        return as_float_input(x, "x", range(1, 33), last=self._config["normalized_shape"])

    def forward(self, x):
        """``x (..., E)`` → ``(..., E)``."""
        p = self._params
        return F.layer_norm(self._x(x), p.get("weight"), p.get("bias"), self._config["eps"])

    def forward_backward(self, x):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)``."""
        x = self._x(x)
        p = self._params
        w, b = p.get("weight"), p.get("bias")
        out = F.layer_norm(x, w, b, self._config["eps"])

        def backprop(grad_out):
            dx, dw, db = F.layer_norm_backward(grad_out, x, w, b, self._config["eps"])
            g = self.grads
            if dw is not None:
                g["weight"] += dw
            if db is not None:
                g["bias"] += db
            return (dx,)
        return out, backprop

    @classmethod
    def from_torch(cls, module_or_state_dict, *, eps=None, dtype=None):
        """From ``torch.nn.LayerNorm`` (its eps read from it) or its state dict."""
        sd = _torch_sd(module_or_state_dict)
        if "weight" not in sd:
            raise ValueError(f"state_dict: expected 'weight' (and 'bias'), got keys {sorted(sd)}")
        if eps is None:
            eps = getattr(module_or_state_dict, "eps", 1e-5)
        dt = dtype if dtype is not None else (np.float64 if sd["weight"].dtype == np.float64
                                              else np.float32)
        layer = cls(sd["weight"].shape[0], eps, bias="bias" in sd, dtype=dt)
        return layer.load_state_dict(sd)


# ================================================================ Dropout
class Dropout(Layer):
    """Zeroes each entry with probability ``p`` in training mode and scales the
    rest by ``1 / (1 - p)`` (torch's inverted dropout); the identity in
    :meth:`eval` mode.  The masks come from the layer's own Generator, seeded
    by ``seed``: the same seed and calls give the same masks."""

    def __init__(self, p=0.5, *, seed=None):
        p = _check_p(p)
        self._config = dict(p=p, seed=_config_seed(seed))
        self._params = {}
        self._gen = _rng(seed)

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        p = self._config["p"]
        if not self.training or p == 0.0:
            return x
        return F.dropout(x, p, rng=self._gen)[0]

    def forward_backward(self, x):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)``."""
        p = self._config["p"]
        if not self.training or p == 0.0:
            return x, lambda grad_out: (grad_out,)
        out, keep = F.dropout(x, p, rng=self._gen)
        return out, lambda grad_out: (F.dropout_backward(grad_out, keep, p),)


# ============================================================ FeedForward
class FeedForward(Layer):
    """``linear2(dropout(activation(linear1(x))))`` -- the position-wise block of
    ``torch.nn.TransformerEncoderLayer`` (``activation`` ``"relu"`` or
    ``"gelu"``, torch's exact erf form)."""

    def __init__(self, embed_dim, hidden_dim, *, activation="relu", dropout=0.0, bias=True,
                 seed=None, dtype=np.float32):
        embed_dim = check_int(embed_dim, "embed_dim")
        hidden_dim = check_int(hidden_dim, "hidden_dim")
        activation = _check_activation(activation)
        dropout = _check_p(dropout, "dropout")
        self._config = dict(embed_dim=embed_dim, hidden_dim=hidden_dim, activation=activation,
                            dropout=dropout, bias=check_bool(bias, "bias"),
                            seed=_config_seed(seed), dtype=check_dtype(dtype).name)
        rng = _rng(seed)
        self.linear1 = Linear(embed_dim, hidden_dim, bias=bias, seed=rng, dtype=dtype)
        self.linear2 = Linear(hidden_dim, embed_dim, bias=bias, seed=rng, dtype=dtype)
        self.dropout = Dropout(dropout, seed=rng)
        self._params = {}

    def _children(self):
        return {"linear1": self.linear1, "linear2": self.linear2, "dropout": self.dropout}

    def __call__(self, x):
        return self.forward(x)

    def _act(self, h):
        return F.relu(h) if self._config["activation"] == "relu" else F.gelu(h)

    def forward(self, x):
        return self.linear2(self.dropout(self._act(self.linear1(x))))

    def forward_backward(self, x):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)``."""
        h, b1 = self.linear1.forward_backward(x)
        relu = self._config["activation"] == "relu"
        p = self.dropout._config["p"]
        if relu and self.dropout.training and p > 0.0:
            # relu and dropout in one pass each way (the same mask, floats and
            # generator draw as the two layers); the backward reads d, which
            # linear2 keeps anyway: h is not kept
            d, keep = F._relu_dropout(h, p, rng=self.dropout._gen)
            del h
            out, b2 = self.linear2.forward_backward(d)

            def backprop_fused(grad_out):
                (gd,) = b2(grad_out)
                return b1(F._relu_dropout_backward(gd, keep, p, d))
            return out, backprop_fused
        a = self._act(h)
        d, bd = self.dropout.forward_backward(a)
        del a
        out, b2 = self.linear2.forward_backward(d)
        # relu's backward reads the dropout's output d, which linear2 keeps
        # anyway (> 0 exactly where h > 0 and the element is kept; dropped
        # elements' gradients are zero already): h is not kept
        act_in = d if relu else h
        del h

        def backprop(grad_out):
            (gd,) = b2(grad_out)
            (ga,) = bd(gd)
            del gd
            gh = F.relu_backward(ga, act_in) if relu else F.gelu_backward(ga, act_in)
            del ga
            return b1(gh)
        return out, backprop


# ============================================================ MeanPooling
class MeanPooling(Layer):
    """The mean over the positions of ``x (B, L, E)`` where ``mask (B, L)`` is
    True (all positions without a mask) → ``(B, E)``; a row with no True
    position gives zeros."""

    def __init__(self):
        self._config = {}
        self._params = {}

    def __call__(self, x, mask=None):
        return self.forward(x, mask)

    @staticmethod
    def _weights(x, mask):
        B, L = x.shape[0], x.shape[1]
        if mask is None:
            return np.full((B, L), 1.0 / max(L, 1))
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"mask: expected a boolean array (True = real position), got dtype {m.dtype}")
        if m.shape != (B, L):
            raise ValueError(f"mask: expected shape ({B}, {L}), got {m.shape}")
        n = m.sum(axis=1, keepdims=True)
        return np.where(m, 1.0 / np.maximum(n, 1), 0.0)

    def forward(self, x, mask=None):
        x = as_float_input(x, "x", (3,))
        w = self._weights(x, mask).astype(x.dtype)
        return np.einsum("bl,ble->be", w, x)

    def forward_backward(self, x, mask=None):
        """``(out, backprop)``; ``backprop(grad_out (B, E))`` → ``(dx, None)``."""
        x = as_float_input(x, "x", (3,))
        w = self._weights(x, mask).astype(x.dtype)
        out = np.einsum("bl,ble->be", w, x)

        def backprop(grad_out):
            g = check_grad_array(grad_out, "grad_out", out.shape)
            return (w[:, :, None] * g[:, None, :]).astype(x.dtype, copy=False), None
        return out, backprop


# ============================================================= Sequential
class Sequential(Layer):
    """Layers applied in order, each to the previous one's output (children
    named ``"0"``, ``"1"``, ... as ``torch.nn.Sequential``)."""

    def __init__(self, *layers):
        for i, layer in enumerate(layers):
            if not isinstance(layer, Layer):
                raise TypeError(f"layers[{i}]: expected a fastattn Layer, got {type(layer).__name__}")
        self.layers = list(layers)
        self._config = {}
        self._params = {}

    def _children(self):
        return {str(i): layer for i, layer in enumerate(self.layers)}

    def __len__(self):
        return len(self.layers)

    def __getitem__(self, i):
        return self.layers[i]

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_backward(self, x):
        """``(out, backprop)``; ``backprop(grad_out)`` → the first layer's input
        gradients."""
        backs = []
        for layer in self.layers:
            x, b = layer.forward_backward(x)
            backs.append(b)
        return x, chain_backprops(backs)

    def get_config(self):
        return {"layers": [{"class": type(layer).__name__, "config": layer.get_config()}
                           for layer in self.layers]}

    @classmethod
    def from_config(cls, config, *, seed=None):
        """Rebuild from :meth:`get_config`: each entry's class is looked up by
        name among fastattn's layer classes (nothing is imported by name)."""
        if not isinstance(config, dict) or set(config) != {"layers"}:
            raise ValueError(f"config: expected {{'layers': [...]}}, got {config!r}")
        known = layer_classes()
        layers = []
        for i, entry in enumerate(config["layers"]):
            name = entry.get("class") if isinstance(entry, dict) else None
            if name not in known:
                raise ValueError(f"config['layers'][{i}]: unknown layer class {name!r}; "
                                 f"expected one of {sorted(known)}")
            layers.append(known[name].from_config(entry.get("config", {}), seed=seed))
        return cls(*layers)


def chain_backprops(backs):
    """One backprop for layers applied in order: each one's first input gradient
    goes to the layer before (the first layer's gradients are returned)."""
    def backprop(grad_out):
        g = (grad_out,)
        for b in reversed(backs):
            g = b(g[0])
        return g
    return backprop


def layer_classes():
    """``{name: class}`` of fastattn's public layer classes (the subclasses of
    :class:`Layer` defined in ``fastattn.layers``, not starting with ``_``)."""
    out, todo = {}, list(Layer.__subclasses__())
    while todo:
        c = todo.pop()
        todo.extend(c.__subclasses__())
        if c.__module__.startswith("fastattn.layers") and not c.__name__.startswith("_"):
            out[c.__name__] = c
    return out


# ========================================================= AttentionPooling
def _masked_softmax_last(s, mask):
    """softmax over the last axis of s (B, r, L) with mask (B, L) bool (None:
    all); rows with no allowed position give zeros (L = 0 too)."""
    if s.shape[-1] == 0:   # no position: np.max has no identity for an empty axis
        return np.zeros(s.shape)
    if mask is not None:
        s = np.where(mask[:, None, :], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    fin = np.isfinite(m)
    if not fin.all():
        m = np.where(fin, m, 0.0)
    e = np.exp(s - m)
    z = e.sum(axis=-1, keepdims=True)
    pos = z > 0
    if pos.all():        # the common case: every row has an allowed position
        e /= z
        return e
    return np.where(pos, e / np.where(pos, z, 1.0), 0.0)


class AttentionPooling(Layer):
    """The structured self-attention of Lin et al. (2017): ``r`` hops of
    weights over the positions of ``x (B, L, E)``::

        A = softmax_L(W_s2 tanh(W_s1 xᵀ))      (B, r, L), masked positions 0
        M = A x                                 (B, r, E), flattened to (B, r E)

    ``W_s1 (attn_dim, E)``, ``W_s2 (hops, attn_dim)`` (no biases, as the
    paper); Glorot-uniform init.  Its penalty ``P = mean_b ‖A_b A_bᵀ − I‖_F²``
    keeps the hops apart: :meth:`forward_backward` returns it and adds
    ``penalty · dP`` to the gradients when given a ``penalty`` coefficient.
    The weights ``A`` show which positions carry the decision
    (``return_weights=True``)."""

    def __init__(self, embed_dim, attn_dim=64, hops=1, *, flatten=True, seed=None,
                 dtype=np.float32):
        E = check_int(embed_dim, "embed_dim")
        da = check_int(attn_dim, "attn_dim")
        r = check_int(hops, "hops")
        dt = check_dtype(dtype)
        self._config = dict(embed_dim=E, attn_dim=da, hops=r, flatten=check_bool(flatten, "flatten"),
                            seed=_config_seed(seed), dtype=dt.name)
        rng = _rng(seed)
        p = {}
        for name, (o, i) in (("W_s1", (da, E)), ("W_s2", (r, da))):
            lim = np.sqrt(6.0 / (o + i))
            p[name] = rng.uniform(-lim, lim, (o, i)).astype(dt)
        self._params = p

    def __call__(self, x, mask=None, *, return_weights=False):
        return self.forward(x, mask, return_weights=return_weights)

    def _x_mask(self, x, mask):
        x = as_float_input(x, "x", (3,), last=self._config["embed_dim"])
        if mask is not None:
            m = np.asarray(mask)
            if m.dtype != np.bool_:
                raise TypeError(f"mask: expected a boolean array (True = real position), got dtype {m.dtype}")
            if m.shape != x.shape[:2]:
                raise ValueError(f"mask: expected shape {x.shape[:2]}, got {m.shape}")
            mask = m
        return x, mask

    def _forward(self, x, mask):
        p = self._params
        ct = np.result_type(x.dtype, p["W_s1"].dtype)
        u = np.tanh(F.linear(x, p["W_s1"]))                  # (B, L, da)
        s = F.linear(u, p["W_s2"])                           # (B, L, r)
        a = _masked_softmax_last(np.swapaxes(s, 1, 2).astype(np.float64), mask).astype(ct)
        m = np.matmul(a, x.astype(ct, copy=False))          # (B, r, E)
        return u, a, m

    def _out(self, m):
        # the sizes spelled out: -1 cannot be inferred when B = 0
        return m.reshape(m.shape[0], m.shape[1] * m.shape[2]) if self._config["flatten"] else m

    def forward(self, x, mask=None, *, return_weights=False):
        """``(B, hops·E)`` (``flatten``) or ``(B, hops, E)``; with ``return_weights``
        also ``A (B, hops, L)``."""
        x, mask = self._x_mask(x, mask)
        _, a, m = self._forward(x, mask)
        return (self._out(m), a) if return_weights else self._out(m)

    @staticmethod
    def penalty_of(a):
        """``mean_b ‖A_b A_bᵀ − I‖_F²`` of weights ``a (B, r, L)``."""
        g = np.matmul(a.astype(np.float64), np.swapaxes(a, 1, 2).astype(np.float64))
        g -= np.eye(a.shape[1])
        return float(np.mean(np.sum(g * g, axis=(1, 2)))) if a.shape[0] else 0.0

    def forward_backward(self, x, mask=None, *, penalty=0.0):
        """``((out, P), backprop)``: the output, the penalty value ``P`` (a float)
        and ``backprop(grad_out)``, which adds the gradients of the loss terms
        ``out`` feeds and of ``penalty · P`` into :attr:`grads` and returns
        ``(dx, None)``."""
        if isinstance(penalty, bool) or not isinstance(penalty, (int, float, np.floating)) \
                or not penalty >= 0:
            raise ValueError(f"penalty: expected a coefficient >= 0, got {penalty!r}")
        x, mask = self._x_mask(x, mask)
        u, a, m = self._forward(x, mask)
        P = self.penalty_of(a)
        out = self._out(m)
        p = self._params

        def backprop(grad_out):
            g = check_grad_array(grad_out, "grad_out", out.shape)
            gm = g.reshape(m.shape).astype(np.float64)
            a64, x64 = a.astype(np.float64), x.astype(np.float64)
            dx = np.matmul(np.swapaxes(a64, 1, 2), gm)                  # through M = A x
            da = np.matmul(gm, np.swapaxes(x64, 1, 2))                  # (B, r, L)
            if penalty and a.shape[0]:
                gram = np.matmul(a64, np.swapaxes(a64, 1, 2)) - np.eye(a.shape[1])
                da += (penalty * 4.0 / a.shape[0]) * np.matmul(gram, a64)
            ds = a64 * (da - np.sum(da * a64, axis=-1, keepdims=True))  # softmax backward
            ds_t = np.swapaxes(ds, 1, 2).astype(u.dtype)                # (B, L, r)
            du, dw2, _ = F.linear_backward(ds_t, u, p["W_s2"])
            dz = du * (1 - u * u)
            dx_s, dw1, _ = F.linear_backward(dz, x, p["W_s1"])
            gr = self.grads
            gr["W_s1"] += dw1
            gr["W_s2"] += dw2
            return (dx + dx_s).astype(x.dtype, copy=False), None
        return (out, P), backprop


# ======================================================= PositionalEmbedding
class PositionalEmbedding(Layer):
    """Positions ``0 .. max_len-1`` as vectors added to ``x (B, L, E)``:
    ``kind="learned"`` (a ``weight (max_len, E)`` table, N(0, 1) init, trained)
    or ``"sinusoidal"`` (Vaswani et al.: ``sin(p / 10000^(2i/E))`` on even
    features, ``cos`` on odd ones; no parameters).  ``forward(x)`` returns
    ``x + P[:L]``."""

    def __init__(self, max_len, embed_dim, *, kind="learned", seed=None, dtype=np.float32):
        n = check_int(max_len, "max_len")
        E = check_int(embed_dim, "embed_dim")
        if kind not in ("learned", "sinusoidal"):
            raise ValueError(f"kind: expected 'learned' or 'sinusoidal', got {kind!r}")
        dt = check_dtype(dtype)
        self._config = dict(max_len=n, embed_dim=E, kind=kind, seed=_config_seed(seed), dtype=dt.name)
        if kind == "learned":
            self._params = {"weight": _rng(seed).standard_normal((n, E)).astype(dt)}
        else:
            self._params = {}
            pos = np.arange(n, dtype=np.float64)[:, None]
            div = np.exp(np.arange(0, E, 2, dtype=np.float64) * (-np.log(10000.0) / E))
            t = np.zeros((n, E))
            t[:, 0::2] = np.sin(pos * div)
            t[:, 1::2] = np.cos(pos * div[:E // 2])
            self._table = t.astype(dt)

    def _pe(self, L):
        if L > self._config["max_len"]:
            raise ValueError(f"x: expected at most max_len={self._config['max_len']} positions, got {L}")
        return (self._params["weight"] if self._config["kind"] == "learned" else self._table)[:L]

    def __call__(self, x):
        return self.forward(x)

    def _x(self, x):
        return as_float_input(x, "x", (2, 3), last=self._config["embed_dim"])

    def forward(self, x):
        x = self._x(x)
        return x + self._pe(x.shape[-2])

    def forward_backward(self, x):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)`` (``dx`` a new
        array in x's dtype; the learned table gets the sum over the batch)."""
        x = self._x(x)
        out = x + self._pe(x.shape[-2])
        L, xdt = out.shape[-2], x.dtype

        def backprop(grad_out):
            g = check_grad_array(grad_out, "grad_out", out.shape)
            if self._config["kind"] == "learned":
                w = self.grads["weight"]   # the sum over the batch (no reshape: B or L may be 0)
                w[:L] += g.sum(axis=tuple(range(g.ndim - 2)), dtype=np.float64).astype(w.dtype)
            return (np.array(g, dtype=xdt),)   # a copy: never the caller's grad_out
        return out, backprop
