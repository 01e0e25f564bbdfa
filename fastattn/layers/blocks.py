"""Building blocks for training: ``LayerNorm``, ``Dropout``, ``FeedForward``,
``MeanPooling`` and ``Sequential``, each with ``forward_backward``.

Pure Python over :mod:`fastattn.functional` (``layer_norm``, ``gelu`` /
``relu``, ``dropout``, ``linear`` and their backward).  Parameter names are
torch's (``weight``, ``bias``; ``linear1`` / ``linear2`` as in
``torch.nn.TransformerEncoderLayer``).
"""
from __future__ import annotations

import numpy as np

from .. import functional as F
from ._base import (Layer, _config_seed, _rng, as_float_input, check_bool, check_dtype, check_int)
from .rnn import Linear

__all__ = ["LayerNorm", "Dropout", "FeedForward", "MeanPooling", "Sequential", "layer_classes"]


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


# ============================================================== LayerNorm
class LayerNorm(Layer):
    """``torch.nn.LayerNorm(normalized_shape)`` over the last axis: ``weight``
    ones and ``bias`` zeros at init (``elementwise_affine=False``: neither;
    ``bias=False``: no bias)."""

    def __init__(self, normalized_shape, eps=1e-5, *, elementwise_affine=True, bias=True,
                 dtype=np.float32):
        E = check_int(normalized_shape, "normalized_shape")
        if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating)) \
                or not eps >= 0:
            raise ValueError(f"eps: expected a number >= 0, got {eps!r}")
        elementwise_affine = check_bool(elementwise_affine, "elementwise_affine")
        bias = check_bool(bias, "bias")
        dt = check_dtype(dtype)
        self._config = dict(normalized_shape=E, eps=float(eps), elementwise_affine=elementwise_affine,
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
        if activation not in ("relu", "gelu"):
            raise ValueError(f"activation: expected 'relu' or 'gelu', got {activation!r}")
        dropout = _check_p(dropout, "dropout")
        rng = _rng(seed)
        self._config = dict(embed_dim=embed_dim, hidden_dim=hidden_dim, activation=activation,
                            dropout=dropout, bias=check_bool(bias, "bias"),
                            seed=_config_seed(seed), dtype=check_dtype(dtype).name)
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
        a = self._act(h)
        d, bd = self.dropout.forward_backward(a)
        out, b2 = self.linear2.forward_backward(d)
        relu = self._config["activation"] == "relu"

        def backprop(grad_out):
            (gd,) = b2(grad_out)
            (ga,) = bd(gd)
            gh = F.relu_backward(ga, h) if relu else F.gelu_backward(ga, h)
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
            g = np.asarray(grad_out)
            if g.shape != out.shape:
                raise ValueError(f"grad_out: expected shape {out.shape}, got {g.shape}")
            return (w[:, :, None] * g[:, None, :]).astype(x.dtype), None
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

        def backprop(grad_out):
            g = (grad_out,)
            for b in reversed(backs):
                g = b(g[0])
            return g
        return x, backprop

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
