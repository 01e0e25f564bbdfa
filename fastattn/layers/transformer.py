"""``TransformerEncoderLayer`` and ``TransformerEncoder``: the math and the
parameter names of ``torch.nn.TransformerEncoderLayer(batch_first=True)`` and
``torch.nn.TransformerEncoder``, with ``forward_backward``.

Post-norm (torch's default)::

    x = norm1(x + dropout1(self_attn(x)))
    x = norm2(x + dropout2(linear2(dropout(activation(linear1(x))))))

``norm_first=True``::

    x = x + dropout1(self_attn(norm1(x)))
    x = x + dropout2(linear2(dropout(activation(linear1(norm2(x))))))

One difference from torch: no dropout on the attention *weights* (torch's
``self_attn.dropout``): the attention runs in the streaming kernel, which never
holds the weights.  ``dropout`` applies where torch has its three other
dropouts (``dropout``, ``dropout1``, ``dropout2``); at ``dropout=0`` and in
eval mode the two layers compute the same function.

Masks: ``key_mask (B, L)`` bool, True = real token (torch's
``src_key_padding_mask`` is the negation); ``attn_mask`` as
:func:`fastattn.multi_head_attention`'s (bool True = may attend, or additive
float); ``is_causal``.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from .. import functional as F
from .._validation import check_eps as _check_eps
from ._base import (Layer, _config_seed, _rng, as_float_input, check_bool, check_dtype,
                    check_int)
from .blocks import Dropout, LayerNorm, _check_activation, _check_p, _torch_sd, chain_backprops
from .multi_head import MultiHeadAttention
from .rnn import Linear

__all__ = ["TransformerEncoderLayer", "TransformerEncoder"]


class TransformerEncoderLayer(Layer):
    """One encoder block (see the module docstring); ``d_model`` split over
    ``nhead`` heads, a ``dim_feedforward`` hidden layer, ``activation``
    ``"relu"`` or ``"gelu"``, dropout ``p`` everywhere torch has it."""

    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", *,
                 layer_norm_eps=1e-5, norm_first=False, bias=True, seed=None, dtype=np.float32):
        # every argument checked here, under its own (torch's) name, before any
        # sub-layer sees it under another one (MultiHeadAttention's num_heads, eps)
        d_model = check_int(d_model, "d_model")
        nhead = check_int(nhead, "nhead")
        if d_model % nhead:
            raise ValueError(f"nhead: expected a divisor of d_model={d_model}, got {nhead}")
        dim_feedforward = check_int(dim_feedforward, "dim_feedforward")
        dropout = _check_p(dropout, "dropout")
        activation = _check_activation(activation)
        layer_norm_eps = _check_eps(layer_norm_eps, "layer_norm_eps")
        norm_first = check_bool(norm_first, "norm_first")
        bias = check_bool(bias, "bias")
        dt = check_dtype(dtype)
        config_seed = _config_seed(seed)
        rng = _rng(seed)
        self._config = dict(d_model=d_model, nhead=nhead, dim_feedforward=dim_feedforward,
                            dropout=dropout, activation=activation,
                            layer_norm_eps=layer_norm_eps, norm_first=norm_first,
                            bias=bias, seed=config_seed, dtype=dt.name)
        self.self_attn = MultiHeadAttention(d_model, nhead, bias=bias, seed=rng, dtype=dt)
        self.linear1 = Linear(d_model, dim_feedforward, bias=bias, seed=rng, dtype=dt)
        self.linear2 = Linear(dim_feedforward, d_model, bias=bias, seed=rng, dtype=dt)
        self.norm1 = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=dt)
        self.norm2 = LayerNorm(d_model, layer_norm_eps, bias=bias, dtype=dt)
        self.dropout = Dropout(dropout, seed=rng)
        self.dropout1 = Dropout(dropout, seed=rng)
        self.dropout2 = Dropout(dropout, seed=rng)
        self._params = {}

    def _children(self):
        return {"self_attn": self.self_attn, "linear1": self.linear1, "linear2": self.linear2,
                "norm1": self.norm1, "norm2": self.norm2, "dropout": self.dropout,
                "dropout1": self.dropout1, "dropout2": self.dropout2}

    def __call__(self, x, *, key_mask=None, attn_mask=None, is_causal=False):
        return self.forward(x, key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)

    def forward(self, x, *, key_mask=None, attn_mask=None, is_causal=False):
        """``x (B, L, d_model)`` → ``(B, L, d_model)``."""
        return self.forward_backward(x, key_mask=key_mask, attn_mask=attn_mask,
                                     is_causal=is_causal, _infer=True)[0]

    def _act(self, h):
        return F.relu(h) if self._config["activation"] == "relu" else F.gelu(h)

    def forward_backward(self, x, *, key_mask=None, attn_mask=None, is_causal=False,
                         input_grad=True, _infer=False):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)`` (masks get none).
        ``input_grad=False``: ``x`` needs no gradient (data, as a torch tensor
        without ``requires_grad``): ``(None,)``, and with post-norm the
        attention's input projection skips its dx product (norm_first still
        needs it, for norm1's weights)."""
        fb = (lambda layer, *a, **k: (layer(*a, **k), None)) if _infer else \
            (lambda layer, *a, **k: layer.forward_backward(*a, **k))
        # errors name x, not query (MultiHeadAttention's name), as SelfAttention's
        x = as_float_input(x, "x", (2, 3), last=self._config["d_model"])
        if not isinstance(input_grad, (bool, np.bool_)):
            raise TypeError(f"input_grad: expected a bool, got {type(input_grad).__name__}")
        need_dx = bool(input_grad)
        mkw = dict(key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)
        pre = self._config["norm_first"]
        # the attention block
        a_in, b_n1 = fb(self.norm1, x) if pre else (x, None)
        if _infer:
            sa, b_sa = fb(self.self_attn, a_in, **mkw)
        else:   # post-norm without input_grad: no dx through the attention either
            sa, b_sa = self.self_attn.forward_backward(a_in, input_grad=need_dx or pre, **mkw)
        sa, b_d1 = fb(self.dropout1, sa)
        h = x + sa
        if not pre:
            h, b_n1 = fb(self.norm1, h)
        # the feed-forward block
        f_in, b_n2 = fb(self.norm2, h) if pre else (h, None)
        u, b_l1 = fb(self.linear1, f_in)
        relu = self._config["activation"] == "relu"
        p = self.dropout._config["p"]
        fused = relu and not _infer and self.dropout.training and p > 0.0
        if fused:
            # relu and dropout in one pass each way (FeedForward's: the same
            # mask, floats and generator draw as the two layers)
            a, keep = F._relu_dropout(u, p, rng=self.dropout._gen)
        else:
            a = self._act(u)
            a, b_d = fb(self.dropout, a)
        f, b_l2 = fb(self.linear2, a)
        f, b_d2 = fb(self.dropout2, f)
        out = h + f
        if not pre:
            out, b_n2 = fb(self.norm2, out)
        if _infer:
            return out, None
        # relu's backward reads the dropout's output, which linear2 keeps
        # anyway (> 0 exactly where u > 0 and the element is kept; dropped
        # elements' gradients are zero already): u (B, L, FF) is not kept
        act_in = a if relu else u
        del u

        def backprop(grad_out):
            g = np.asarray(grad_out)
            if not pre:
                (g,) = b_n2(g)
            # out = h + f
            (gf,) = b_d2(g)
            (ga,) = b_l2(gf)
            del gf
            if fused:
                gu = F._relu_dropout_backward(ga, keep, p, act_in)
            else:
                (ga,) = b_d(ga)
                gu = F.relu_backward(ga, act_in) if relu else F.gelu_backward(ga, act_in)
            del ga   # (B, L, FF) gradients: at most two alive at a time
            (gh,) = b_l1(gu)
            del gu
            if pre:
                (gh,) = b_n2(gh)
            gh = gh + g
            if not pre:
                (gh,) = b_n1(gh)
            # h = x + sa
            (gs,) = b_d1(gh)
            (gx,) = b_sa(gs)
            if pre:
                (gx,) = b_n1(gx)
            return (gx + gh,) if need_dx else (None,)
        return out, backprop

    @classmethod
    def from_torch(cls, module, *, dtype=None):
        """From a ``torch.nn.TransformerEncoderLayer`` (``batch_first`` either
        way: this layer is always batch-first); its sizes, dropout,
        activation, eps, norm_first and bias are read from it."""
        act = getattr(module, "activation_relu_or_gelu", None)
        if act not in (1, 2):
            raise ValueError("module: expected a torch.nn.TransformerEncoderLayer with a relu or "
                             "gelu activation")
        sd = _torch_sd(module)
        dt = dtype if dtype is not None else (np.float64 if sd["linear1.weight"].dtype == np.float64
                                              else np.float32)
        layer = cls(module.self_attn.embed_dim, module.self_attn.num_heads,
                    module.linear1.out_features, module.dropout.p,
                    "relu" if act == 1 else "gelu", layer_norm_eps=module.norm1.eps,
                    norm_first=bool(module.norm_first), bias=module.linear1.bias is not None,
                    dtype=dt)
        return layer.load_state_dict(sd)


class TransformerEncoder(Layer):
    """``num_layers`` encoder layers built from ``layer_config`` (a
    ``TransformerEncoderLayer``, whose config is used, or its ``get_config()``
    dict; fresh weights each, seeded from ``seed``) and an optional final ``LayerNorm`` (``norm=True``,
    torch's ``norm=LayerNorm(d_model)``); parameter names ``layers.{i}.…`` and
    ``norm.…`` as torch's."""

    def __init__(self, layer_config, num_layers, *, norm=False, seed=None):
        if isinstance(layer_config, TransformerEncoderLayer):
            layer_config = layer_config.get_config()
        elif not isinstance(layer_config, Mapping):
            r = repr(layer_config)
            what = f"the class {layer_config.__name__} (not an instance of it)" \
                if isinstance(layer_config, type) else type(layer_config).__name__ + \
                (f" {r}" if len(r) <= 40 else "")
            raise TypeError(f"layer_config: expected a TransformerEncoderLayer or its get_config() "
                            f"dict, got {what}")
        try:   # its keys checked under its own name (from_config's messages say 'config')
            cfg = TransformerEncoderLayer._check_config(layer_config)
        except (TypeError, ValueError) as exc:
            msg = str(exc)
            if not msg.startswith("config: "):
                raise
            raise type(exc)("layer_config: " + msg[len("config: "):]) from None
        num_layers = check_int(num_layers, "num_layers")
        norm = check_bool(norm, "norm")
        config_seed = _config_seed(seed)
        rng = _rng(seed)
        self.layers = [TransformerEncoderLayer.from_config(cfg, seed=rng) for _ in range(num_layers)]
        self.norm = LayerNorm(cfg["d_model"], cfg.get("layer_norm_eps", 1e-5),
                              dtype=cfg.get("dtype", "float32")) if norm else None
        self._config = dict(layer_config=self.layers[0].get_config() if self.layers else cfg,
                            num_layers=num_layers, norm=norm, seed=config_seed)
        self._params = {}

    def _children(self):
        c = {f"layers.{i}": layer for i, layer in enumerate(self.layers)}
        if self.norm is not None:
            c["norm"] = self.norm
        return c

    def __call__(self, x, *, key_mask=None, attn_mask=None, is_causal=False):
        return self.forward(x, key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)

    def forward(self, x, *, key_mask=None, attn_mask=None, is_causal=False):
        for layer in self.layers:
            x = layer(x, key_mask=key_mask, attn_mask=attn_mask, is_causal=is_causal)
        return x if self.norm is None else self.norm(x)

    def forward_backward(self, x, *, key_mask=None, attn_mask=None, is_causal=False,
                         input_grad=True):
        """``(out, backprop)``; ``backprop(grad_out)`` → ``(dx,)`` (``(None,)``
        with ``input_grad=False``: see TransformerEncoderLayer)."""
        backs = []
        for i, layer in enumerate(self.layers):
            x, b = layer.forward_backward(x, key_mask=key_mask, attn_mask=attn_mask,
                                          is_causal=is_causal, input_grad=input_grad or i > 0)
            backs.append(b)
        if self.norm is not None:
            x, b = self.norm.forward_backward(x)
            backs.append(b)
        return x, chain_backprops(backs)

    @classmethod
    def from_torch(cls, module, *, dtype=None):
        """From a ``torch.nn.TransformerEncoder`` of TransformerEncoderLayers."""
        first = TransformerEncoderLayer.from_torch(module.layers[0], dtype=dtype)
        enc = cls(first, len(module.layers), norm=module.norm is not None)
        return enc.load_state_dict(_torch_sd(module))
