"""``MultiHeadAttention``: parameters, initialisation, state dicts, configs and loaders.

Pure Python: every computation is a call to
:func:`fastattn.functional.multi_head_attention`.

Parameter names are PyTorch's (``torch.nn.MultiheadAttention``), so a torch
state dict loads as it is:

* ``in_proj_weight`` ``((H + 2 Hkv) dh, E)`` when ``kdim == vdim == E``,
  otherwise ``q_proj_weight`` ``(E, E)``, ``k_proj_weight`` ``(Hkv dh, kdim)``
  and ``v_proj_weight`` ``(Hkv dh, vdim)``;
* ``in_proj_bias`` ``((H + 2 Hkv) dh,)`` (packed in both layouts, as in torch);
* ``out_proj.weight`` ``(E, E)`` and ``out_proj.bias`` ``(E,)``.

With ``bias=False`` the two biases are absent.  ``Hkv = num_kv_heads``
(grouped-query attention) is an extension: torch has no such layer, so a
state dict with ``Hkv < H`` only comes from fastattn itself.
"""
from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

from .. import _stamps, functional
from ._base import Layer, as_param_array, check_bool, check_dtype, check_int

__all__ = ["MultiHeadAttention"]

_CONFIG_KEYS = ("embed_dim", "num_heads", "kdim", "vdim", "bias", "num_kv_heads", "dtype")
#: _cached_weights: the prepared weights are not (or no longer) those of params
_STALE = object()
#: what this layer's integer checks say they expect (torch's wording, kept from before the base)
_POSITIVE = "a positive integer"


def _shape(x):
    """The shape of an array-like without converting it (None when it has none)."""
    try:
        return tuple(np.shape(x))
    except (ValueError, TypeError):  # ragged: the functional's checks report it
        return None


class MultiHeadAttention(Layer):
    """Multi-head attention with input and output projections (inference).

    Parameters
    ----------
    embed_dim : int
        ``E``, the query size and the output size.
    num_heads : int
        ``H``, a divisor of ``E``; heads have ``dh = E // H`` features.
    kdim, vdim : int, optional
        Feature sizes of key and value inputs (default ``E``).
    bias : bool
        Whether the projections have biases.
    num_kv_heads : int, optional
        ``Hkv``, a divisor of ``H`` (default ``H``): grouped-query attention;
        1 is multi-query attention.
    dtype : float32 or float64
        Parameter dtype.  Inputs of another dtype are computed by NumPy
        promotion (float64 inputs with float32 parameters give float64).
    seed : int or numpy.random.Generator, optional
        Initialisation like PyTorch's: Xavier-uniform projection weights
        (the packed ``in_proj_weight`` as one matrix), ``U(-1/sqrt(E), 1/sqrt(E))``
        for ``out_proj.weight``, zero biases.

    The parameters (``self.params``, the :class:`~fastattn.layers._base.Layer`
    store; ``named_parameters()`` and ``state_dict()`` give the same names)
    are validated and made canonical on the first call and reused while
    ``params`` holds the same arrays; replacing an array (or the dict, or
    ``load_state_dict``) prepares them again.

    Packed weights: a float32 layer's first call (``layer(x)``, inference)
    also copies its projection weights into the projection kernel's packed
    layout (csrc/fa_proj.h), which later calls read instead of the arrays:
    faster, above all for short sequences, at the cost of about one more
    copy of the weights (output columns rounded up to multiples of 16).
    :meth:`forward_backward` (training) never makes that copy and drops a
    stale one, so a layer that is only trained holds none.  The copy is
    remade after fastattn writes the parameters: an optimizer's ``step``
    (:mod:`fastattn.optim`), :meth:`load_state_dict`, :func:`fastattn.load`.
    **Writing a parameter array in place yourself** (``layer.params[name][...]
    = ...``) is not seen by the packed copy: call :meth:`params_changed`
    afterwards (or set :attr:`auto_pack` to False, and calls read the arrays
    in place again).  Float64 layers and inputs, and SIMD off
    (``FASTATTN_DISABLE_SIMD``) or a CPU without AVX2/FMA, have no packed
    kernel: nothing is packed.

    :meth:`freeze` (opt-in, for inference with fixed weights) also makes the
    parameter arrays read-only, so that an in-place write raises instead of
    going unseen; see there.

    Calling the layer: ``mha(query, key=None, value=None, *, attn_mask=None,
    key_mask=None, is_causal=False, return_weights=False)`` with batch-first
    ``(B, L, features)`` or unbatched ``(L, features)`` inputs; ``key``
    defaults to ``query`` and ``value`` to ``key`` (self-attention).  Masks
    use fastattn's polarity: boolean True = may attend, ``key_mask`` True =
    real token (see ``docs/coming_from_pytorch.md``).
    """

    def __init__(self, embed_dim, num_heads, *, kdim=None, vdim=None, bias=True,
                 num_kv_heads=None, dtype=np.float32, seed=None):
        E = check_int(embed_dim, "embed_dim", what=_POSITIVE)
        H = check_int(num_heads, "num_heads", what=_POSITIVE)
        if E % H:
            raise ValueError(f"num_heads: expected a divisor of embed_dim={E}, got {H}")
        Hkv = H if num_kv_heads is None else check_int(num_kv_heads, "num_kv_heads", what=_POSITIVE)
        if H % Hkv:
            raise ValueError(f"num_kv_heads: expected a divisor of num_heads={H}, got {Hkv}")
        bias = check_bool(bias, "bias")
        self.embed_dim = E
        self.num_heads = H
        self.num_kv_heads = Hkv
        # zero-feature keys / values are valid (NumPy's convention for empty sums:
        # the projection is its bias, all scores of a zero-feature key are equal)
        self.kdim = E if kdim is None else check_int(kdim, "kdim", 0, what="an integer >= 0")
        self.vdim = E if vdim is None else check_int(vdim, "vdim", 0, what="an integer >= 0")
        self.bias = bias
        self.dtype = check_dtype(dtype)
        self.head_dim = E // H
        self.packed = self.kdim == E and self.vdim == E
        self._config = self._make_config()
        self._params = self._init_params(np.random.default_rng(seed))
        self._prepared = None  # see _prepared_weights
        self._frozen = False   # see freeze
        self._flipped = []     # the arrays freeze made read-only (unfreeze restores them)

    # ------------------------------------------------------------ parameters
    #: a weight given as integers or bools is a mistake, not a number to cast
    _integer_params = False
    _config_keys = _CONFIG_KEYS

    @property
    def params(self):
        """``{name: ndarray}``: the parameters themselves (the base's store, not a
        copy; assigning an entry or the whole mapping is seen by the next call)."""
        return self._params

    @params.setter
    def params(self, value):
        self._params = value

    def param_shapes(self) -> dict:
        """``{name: shape}`` of every parameter, in state-dict order."""
        E, kvE = self.embed_dim, self.num_kv_heads * self.head_dim
        shapes = {}
        if self.packed:
            shapes["in_proj_weight"] = (E + 2 * kvE, E)
        else:
            shapes["q_proj_weight"] = (E, E)
            shapes["k_proj_weight"] = (kvE, self.kdim)
            shapes["v_proj_weight"] = (kvE, self.vdim)
        if self.bias:
            shapes["in_proj_bias"] = (E + 2 * kvE,)
        shapes["out_proj.weight"] = (E, E)
        if self.bias:
            shapes["out_proj.bias"] = (E,)
        return shapes

    def _init_params(self, rng):
        def xavier(shape):
            bound = math.sqrt(6.0 / (shape[0] + shape[1]))
            return rng.uniform(-bound, bound, shape).astype(self.dtype)

        params = {}
        for name, shape in self.param_shapes().items():
            if name.endswith("bias"):
                params[name] = np.zeros(shape, self.dtype)
            elif name == "out_proj.weight":
                bound = 1.0 / math.sqrt(shape[1])
                params[name] = rng.uniform(-bound, bound, shape).astype(self.dtype)
            else:
                params[name] = xavier(shape)
        return params

    def _param_shapes(self):  # the base's hook: load_state_dict expects these
        return self.param_shapes()

    def _names_error(self, expected, missing, unexpected):  # the base's hook: this layer's wording
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing)}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected)}")
        return f"state_dict: expected the keys {', '.join(expected)}; " + "; ".join(parts)

    # ---------------------------------------------------------------- packing
    @property
    def auto_pack(self) -> bool:
        """Whether calls keep float32 projection weights packed (default True;
        see the class docstring).  Setting False drops the packed copy (a
        frozen layer keeps packing: :meth:`freeze` implies it); not part of
        ``get_config``."""
        return self.__dict__.get("_auto_pack", True)

    @auto_pack.setter
    def auto_pack(self, value):
        self._auto_pack = check_bool(value, "auto_pack")
        self._prepared = None

    # ---------------------------------------------------------------- freeze
    @property
    def frozen(self) -> bool:
        """True between :meth:`freeze` and :meth:`unfreeze`."""
        return getattr(self, "_frozen", False)

    def freeze(self):
        """Promise that the parameters will not change, and have it enforced.

        The parameter arrays become read-only (``writeable=False``: writing
        into one raises NumPy's ``ValueError: assignment destination is
        read-only``; an array that does not own its memory is first replaced
        in ``params`` by a private copy), and float32 layers keep their
        projection weights also in the packed layout of fastattn's projection
        kernel (csrc/fa_proj.h), as an unfrozen layer does by default
        (:attr:`auto_pack`; a frozen layer packs even with it off).  Outputs equal the unfrozen layer's
        within float32 rounding; with SIMD off (``FASTATTN_DISABLE_SIMD``) or
        on a CPU without AVX2/FMA, and for float64 layers or inputs, calls take
        the unfrozen path.

        Memory: a frozen float32 layer holds about twice its weight bytes (the
        packed copy, output columns rounded up to multiples of 16; a little
        more when ``embed_dim`` or ``num_kv_heads * head_dim`` is not a
        multiple of 16, where key and value rows are packed on their own).

        The promise is the caller's: a view of a parameter taken before
        ``freeze()`` stays writeable, and writing through it (or setting
        ``writeable`` back) is not seen by the packed copy; call
        :meth:`unfreeze` first, edit, then freeze again.

        :meth:`load_state_dict` on a frozen layer loads new arrays, freezes
        them and repacks; replacing an entry of ``params`` is seen by the next
        call, which freezes the new array too.  Pickling and copying keep the
        layer frozen (the packed copy is rebuilt, not stored); ``get_config``
        does not record it.  :meth:`unfreeze` undoes it.  Returns ``self``.
        """
        self._frozen = True
        self._freeze_params()
        self._prepared = None
        return self

    def unfreeze(self):
        """Make the parameters writeable again and drop the packed copy.  Returns ``self``."""
        current = {id(a) for a in self._params.values()}
        for a in getattr(self, "_flipped", ()):
            if id(a) in current:
                a.flags.writeable = True
        self._flipped = []
        self._frozen = False
        self._prepared = None
        return self

    def _freeze_params(self):
        """Every ndarray in ``params`` read-only; one that does not own its memory
        (a view of someone's array) is replaced in ``params`` by a private copy."""
        flipped = getattr(self, "_flipped", None)
        if flipped is None:
            flipped = self._flipped = []
        params = self._params
        copies = {}
        for name, a in params.items():
            if isinstance(a, np.ndarray) and a.flags.writeable:
                if a.base is not None or not a.flags.owndata:
                    a = copies[name] = a.copy()
                a.flags.writeable = False
                flipped.append(a)
        if copies:
            try:  # in place: a reference to the dict stays this layer's
                for name, a in copies.items():
                    params[name] = a
            except TypeError:  # a read-only mapping
                self._params = {**params, **copies}

    def _after_load(self):
        """After :meth:`load_state_dict` (the base's; ``prefix=`` selects the keys,
        names and shapes are exactly :meth:`param_shapes`, values are copied and
        cast to the layer's dtype): the new arrays are prepared again on the
        next call; a frozen layer stays frozen (they are made read-only now and
        repacked on the next call)."""
        self._prepared = None
        if self.frozen:
            self._flipped = []
            self._freeze_params()

    # ---------------------------------------------------------------- config
    def _make_config(self) -> dict:
        """The constructor arguments (JSON-serialisable) that rebuild this layer's shape
        (``get_config()``; the seed is not recorded)."""
        return {
            "embed_dim": self.embed_dim,
            "num_heads": self.num_heads,
            "kdim": self.kdim,
            "vdim": self.vdim,
            "bias": self.bias,
            "num_kv_heads": self.num_kv_heads,
            "dtype": self.dtype.name,
        }

    def __repr__(self):
        extra = "" if self.packed else f", kdim={self.kdim}, vdim={self.vdim}"
        if self.num_kv_heads != self.num_heads:
            extra += f", num_kv_heads={self.num_kv_heads}"
        return (f"MultiHeadAttention(embed_dim={self.embed_dim}, num_heads={self.num_heads}"
                f"{extra}, bias={self.bias}, dtype={self.dtype.name})")

    # --------------------------------------------------------------- forward
    def _weights(self):
        p = self._params
        kw = {"w_out": p["out_proj.weight"], "b_out": p.get("out_proj.bias")}
        b = p.get("in_proj_bias")
        if self.packed:
            kw.update(w_qkv=p["in_proj_weight"], b_qkv=b)
        else:
            E, kvE = self.embed_dim, self.num_kv_heads * self.head_dim
            kw.update(w_query=p["q_proj_weight"], w_key=p["k_proj_weight"],
                      w_value=p["v_proj_weight"])
            if b is not None:
                kw.update(b_query=b[:E], b_key=b[E:E + kvE], b_value=b[E + kvE:])
        return kw

    def __getstate__(self):  # pickling: the prepared (and packed) weights are rebuilt on first use
        state = self.__dict__.copy()
        state["_prepared"] = None
        state["_flipped"] = []
        return state

    def __setstate__(self, state):
        if "params" in state:  # pickled before the base's store: {"params": ...}
            state = dict(state)
            state["_params"] = state.pop("params")
        self.__dict__.update(state)
        if "_config" not in state:
            self._config = self._make_config()
        self._prepared = None
        self._flipped = []
        if self.frozen:  # unpickled arrays are writeable: freeze them again
            self._freeze_params()

    def _cached_weights(self):
        """The prepared weights made by the last :meth:`_prepared_weights`, or
        ``_STALE`` when ``params`` holds other arrays (or other shapes or
        dtypes) since, or fastattn wrote one of them in place since (a
        write stamp: an optimizer step, :meth:`params_changed`)."""
        params = self._params
        cached = getattr(self, "_prepared", None)
        if cached is None or cached[0] is not params or len(params) != len(cached[1]):
            return _STALE
        get, stamp = params.get, _stamps.stamp
        for name, a, shape, dt, st in cached[1]:
            b = get(name)
            if b is not a or b.shape != shape or b.dtype != dt or stamp(b) != st:
                return _STALE
        return cached[2]

    def _prepared_weights(self):
        """The parameters validated and canonical (functional's prepared weights),
        made once and reused while ``self.params`` holds the same arrays (same
        objects, shapes and dtypes; their values may change in place: the
        prepared weights are those arrays, not copies).  None when they cannot
        be reused (a parameter that had to be copied or cast, or that is
        invalid: the general path then checks and reports it on every call).
        Float32 layers' carry the packed projection weights as well (frozen
        ones always, others while :attr:`auto_pack` is on); a frozen layer's
        parameter array replaced since is frozen before they are made."""
        w = self._cached_weights()
        if w is not _STALE:
            return w
        params = self._params
        if not isinstance(params, Mapping):
            return None
        frozen = self.frozen
        if frozen:
            self._freeze_params()
            params = self._params
        stamp = _stamps.stamp
        snapshot = tuple((name, a, getattr(a, "shape", None), getattr(a, "dtype", None), stamp(a))
                         for name, a in params.items())
        self._prepared = None   # a stale packed copy goes before the new one is made
        try:
            w = functional._prepare_mha_weights(
                self.embed_dim, self.kdim, self.vdim, self.dtype, num_heads=self.num_heads,
                num_kv_heads=self.num_kv_heads, pack=True if frozen else "auto" if self.auto_pack else False,
                **self._weights())
        except (TypeError, ValueError, KeyError):
            w = None
        if w is not None and w.copied:
            w = None
        self._prepared = (params, snapshot, w)
        return w

    def __call__(self, query, key=None, value=None, *, attn_mask=None, key_mask=None,
                 is_causal=False, causal_alignment="top_left", return_weights=False,
                 average_weights=True, n_threads=None):
        """Attend from ``query`` to ``key``/``value``; see :func:`fastattn.multi_head_attention`.

        ``causal_alignment="bottom_right"`` with ``is_causal=True`` aligns the
        last query with the last key (decoding with a key/value cache: query
        ``i`` of ``Lq`` sees keys ``j <= i + Lk - Lq``); the default
        ``"top_left"`` is PyTorch's rule.

        Returns ``(B, Lq, E)`` (unbatched ``(Lq, E)``), or ``(output, weights)``
        with weights averaged over heads ``(B, Lq, Lk)`` or, with
        ``average_weights=False``, per head ``(B, H, Lq, Lk)``.
        """
        w = self._prepared_weights()
        if (w is not None and key is None and value is None and type(query) is np.ndarray
                and query.ndim and query.shape[-1] == self.embed_dim == self.kdim == self.vdim):
            # self-attention on an array of the layer's sizes: nothing for the loop below
            return functional._multi_head_attention_prepared(
                w, query, query, query, attn_mask=attn_mask, key_mask=key_mask,
                is_causal=is_causal, causal_alignment=causal_alignment,
                return_weights=return_weights, average_weights=average_weights,
                n_threads=n_threads)
        key_given, value_given = key is not None, value is not None
        if key is None:
            key = query
        if value is None:
            value = key
        for name, x, want, what, given in (
                ("query", query, self.embed_dim, "embed_dim", True),
                ("key", key, self.kdim, "kdim", key_given),
                ("value", value, self.vdim, "vdim", value_given)):
            shape = None if x is None else _shape(x)
            if shape and shape[-1] != want:
                came = "" if given else (" (key defaults to the query)" if name == "key"
                                         else " (value defaults to the key)")
                raise ValueError(
                    f"{name}: expected last dim {what}={want} (this layer's), got shape {shape}{came}"
                )
        if w is not None:
            return functional._multi_head_attention_prepared(
                w, query, key, value, attn_mask=attn_mask, key_mask=key_mask,
                is_causal=is_causal, causal_alignment=causal_alignment,
                return_weights=return_weights, average_weights=average_weights,
                n_threads=n_threads)
        return functional.multi_head_attention(
            query, key, value, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
            attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
            causal_alignment=causal_alignment, return_weights=return_weights,
            average_weights=average_weights, n_threads=n_threads, **self._weights())

    # -------------------------------------------------------------- training
    #: functional's gradient names -> this layer's parameter names (b_query,
    #: b_key, b_value are the slices of in_proj_bias)
    _GRAD_NAMES = {"w_qkv": "in_proj_weight", "b_qkv": "in_proj_bias",
                   "w_query": "q_proj_weight", "w_key": "k_proj_weight",
                   "w_value": "v_proj_weight", "w_out": "out_proj.weight",
                   "b_out": "out_proj.bias"}

    def forward_backward(self, query, key=None, value=None, *, attn_mask=None, key_mask=None,
                         is_causal=False, causal_alignment="top_left", n_threads=None,
                         input_grad=True):
        """``(out, backprop)`` for :meth:`__call__`'s arguments (no weights
        returned).  ``backprop(grad_out)`` adds every weight's and bias's
        gradient into :attr:`grads` and returns one gradient per input given:
        ``(dx,)`` for self-attention (``key`` and ``value`` omitted: the sum
        of the three roles), ``(dquery, dkey)`` when only ``key`` was given
        (value defaults to it), else ``(dquery, dkey, dvalue)``.  The forward
        keeps the projections and the attention's output and row log-sum-exp
        (:func:`fastattn.functional.multi_head_attention_forward_backward`,
        O(L) memory); the inputs must not change before ``backprop`` is
        called.  ``input_grad=False``: the inputs need no gradient (data, as
        a torch tensor without ``requires_grad``): backprop returns None for
        each and skips the input projections' dx products."""
        if not isinstance(input_grad, (bool, np.bool_)):
            raise TypeError(f"input_grad: expected a bool, got {type(input_grad).__name__}")
        if self._prepared is not None and self._cached_weights() is _STALE:
            self._prepared = None   # a layer in training holds no stale packed copy
        kw = dict(attn_mask=attn_mask, key_mask=key_mask, is_causal=is_causal,
                  causal_alignment=causal_alignment, n_threads=n_threads)
        n_given = 1 if key is None and value is None else 2 if value is None else 3
        q = query
        k = query if key is None else key
        v = k if value is None else value
        out, backward = functional.multi_head_attention_forward_backward(
            q, k, v, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, **kw,
            combine_roles=n_given == 1, input_grads=input_grad, **self._weights())

        def backprop(grad_out):
            dq, dk, dv, dw = backward(grad_out)
            g = self.grads
            E, kvE = self.embed_dim, self.num_kv_heads * self.head_dim
            bias_slices = {"b_query": slice(0, E), "b_key": slice(E, E + kvE),
                           "b_value": slice(E + kvE, None)}
            for name, a in dw.items():
                if name in bias_slices:
                    g["in_proj_bias"][bias_slices[name]] += a
                else:
                    g[self._GRAD_NAMES[name]] += a
            if n_given == 1:   # combine_roles: dq is the sum of the three roles'
                return (dq,)
            if n_given == 2:
                return (dq, dk + dv)
            return (dq, dk, dv)
        return out, backprop

    # --------------------------------------------------------------- loaders
    @classmethod
    def from_torch(cls, module_or_state_dict, *, num_heads=None, prefix="", dtype=None):
        """A layer with the weights of a ``torch.nn.MultiheadAttention``.

        Given the module, its sizes are read from it (torch is imported only
        in that case); given its ``state_dict()`` (tensors or arrays, under
        ``prefix``), pass ``num_heads`` -- a state dict does not record it.
        Both torch layouts load: packed ``in_proj_weight`` and the separate
        ``q/k/v_proj_weight`` used when ``kdim``/``vdim`` differ from
        ``embed_dim``; ``bias=False`` too.  ``add_bias_kv`` and
        ``add_zero_attn`` are not supported.  The layer is always batch-first:
        for a module built with ``batch_first=False`` pass ``(B, L, E)``
        inputs (``x.transpose(1, 0, 2)``).  ``dtype`` defaults to the weights'
        (float32 unless they are float64).
        """
        if num_heads is not None:
            num_heads = check_int(num_heads, "num_heads", what=_POSITIVE)
        if isinstance(module_or_state_dict, Mapping):
            if num_heads is None:
                raise TypeError(
                    "num_heads: a state dict does not record the number of heads; pass "
                    "from_torch(state_dict, num_heads=...) or the module itself"
                )
            sd = module_or_state_dict
        else:
            import torch  # only when given a module

            m = module_or_state_dict
            if not isinstance(m, torch.nn.MultiheadAttention):
                raise TypeError(
                    "module_or_state_dict: expected a torch.nn.MultiheadAttention or its "
                    f"state_dict(), got {type(m).__name__}"
                )
            if m.bias_k is not None or m.bias_v is not None:
                raise ValueError("module_or_state_dict: add_bias_kv=True is not supported")
            if m.add_zero_attn:
                raise ValueError("module_or_state_dict: add_zero_attn=True is not supported")
            if num_heads is not None and num_heads != m.num_heads:
                raise ValueError(f"num_heads: the module has {m.num_heads} heads, got num_heads={num_heads!r}")
            num_heads = m.num_heads
            sd = m.state_dict()
            prefix = ""
        H = check_int(num_heads, "num_heads", what=_POSITIVE)
        names = [k[len(prefix):] for k in sd if isinstance(k, str) and k.startswith(prefix)]
        for bad in ("bias_k", "bias_v"):
            if bad in names:
                raise ValueError(f"state_dict: {prefix + bad} (add_bias_kv=True) is not supported")
        key_w = prefix + "out_proj.weight"
        if key_w not in sd:
            raise ValueError(f"state_dict: expected a torch.nn.MultiheadAttention state dict with "
                             f"{key_w!r}; got keys {sorted(sd)[:8]}")
        w_out = as_param_array(sd[key_w], f"state_dict[{key_w!r}]", integers=False)
        if w_out.ndim != 2:
            raise ValueError(f"state_dict[{key_w!r}]: expected a 2-D (E, E) weight, got shape {w_out.shape}")
        E = w_out.shape[1]
        if E % H:
            raise ValueError(f"num_heads: expected a divisor of embed_dim={E}, got {H}")
        dh = E // H
        if prefix + "in_proj_weight" in sd:
            key_in = prefix + "in_proj_weight"
            w_in = as_param_array(sd[key_in], f"state_dict[{key_in!r}]", integers=False)
            if w_in.ndim != 2:
                raise ValueError(f"state_dict[{key_in!r}]: expected a 2-D ((H + 2 Hkv) dh, E) weight, "
                                 f"got shape {w_in.shape}")
            rows = w_in.shape[0]
            kdim = vdim = E
        elif prefix + "k_proj_weight" in sd and prefix + "v_proj_weight" in sd:
            kw = as_param_array(sd[prefix + "k_proj_weight"], "k_proj_weight", integers=False)
            vw = as_param_array(sd[prefix + "v_proj_weight"], "v_proj_weight", integers=False)
            if kw.ndim != 2 or vw.ndim != 2:
                raise ValueError(f"state_dict: k/v_proj_weight must be 2-D, got {kw.shape}, {vw.shape}")
            rows, kdim, vdim = E + 2 * kw.shape[0], kw.shape[1], vw.shape[1]
        else:
            raise ValueError(
                f"state_dict: expected {prefix}in_proj_weight (packed) or {prefix}q_proj_weight, "
                f"{prefix}k_proj_weight, {prefix}v_proj_weight (separate)"
            )
        kv_rows = (rows - E) // 2
        if kv_rows < dh or kv_rows % dh or rows != E + 2 * kv_rows:
            raise ValueError(
                f"state_dict: projection rows {rows} do not fit embed_dim={E} with {H} heads "
                f"(expected E + 2 * num_kv_heads * {dh})"
            )
        bias = prefix + "in_proj_bias" in sd
        if dtype is None:
            dtype = np.float64 if w_out.dtype == np.float64 else np.float32
        layer = cls(E, H, kdim=kdim, vdim=vdim, bias=bias, num_kv_heads=kv_rows // dh, dtype=dtype)
        subset = {k: sd[k] for k in sd if isinstance(k, str) and k.startswith(prefix)}
        return layer.load_state_dict(subset, prefix=prefix)

    @classmethod
    def from_bert(cls, state_dict, *, num_heads, prefix="", dtype=None):
        """A layer with the weights of a Hugging Face BERT-style attention block.

        Reads ``{prefix}attention.self.{query,key,value}.{weight,bias}`` and
        ``{prefix}attention.output.dense.{weight,bias}`` (as in a ``BertLayer``;
        a ``BertAttention``'s own ``self.query.weight`` ... names work too).
        For layer ``i`` of a full model use ``prefix=f"bert.encoder.layer.{i}."``.
        ``num_heads`` is ``config.num_attention_heads``.  The block's
        ``output.LayerNorm`` and residual are not part of this layer: apply
        them to its output.  Values may be tensors or arrays.  Relative-position
        variants (``position_embedding_type`` other than ``"absolute"``, with an
        ``attention.self.distance_embedding.weight``) are refused with a
        ValueError: their scores have a term this layer does not compute.
        """
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"state_dict: expected a mapping of names to arrays, got {type(state_dict).__name__}")
        H = check_int(num_heads, "num_heads", what=_POSITIVE)
        base = None
        for cand in (prefix + "attention.", prefix):
            if cand + "self.query.weight" in state_dict:
                base = cand
                break
        if base is None:
            want = prefix + "attention.self.query.weight"
            hits = sorted(k for k in state_dict if isinstance(k, str) and k.endswith("attention.self.query.weight"))
            hint = ""
            if hits:
                hint = (f"; the mapping has {hits[0]!r}"
                        + (f" (and {len(hits) - 1} more)" if len(hits) > 1 else "")
                        + f": pass prefix={hits[0][:-len('attention.self.query.weight')]!r}")
            raise ValueError(f"state_dict: no key {want!r}{hint}")

        # the self-attention block holds exactly query/key/value: anything else there
        # (relative-position BERTs' distance_embedding) changes the scores, so
        # ignoring it would give wrong results without a word
        known = {f"self.{n}.{p}" for n in ("query", "key", "value") for p in ("weight", "bias")}
        extra = sorted(k for k in state_dict if isinstance(k, str) and k.startswith(base + "self.")
                       and k[len(base):] not in known)
        if extra:
            raise ValueError(
                f"state_dict: unsupported key(s) {', '.join(repr(k) for k in extra)}: only BERT's "
                "absolute position embeddings are supported (position_embedding_type='absolute'); "
                "relative-position attention (distance_embedding) is not"
            )

        def get(name, required=True):
            k = base + name
            if k not in state_dict:
                if required:
                    raise ValueError(f"state_dict: missing {k!r}")
                return None
            return as_param_array(state_dict[k], f"state_dict[{k!r}]", integers=False)

        wq, wk, wv = get("self.query.weight"), get("self.key.weight"), get("self.value.weight")
        wo = get("output.dense.weight")
        biases = [get(n, False) for n in ("self.query.bias", "self.key.bias", "self.value.bias",
                                          "output.dense.bias")]
        present = [b is not None for b in biases]
        if any(present) and not all(present):
            raise ValueError(
                "state_dict: either all of self.query/key/value.bias and output.dense.bias or none "
                f"(under {base!r}); found {sum(present)} of 4"
            )
        for name, w in (("self.query.weight", wq), ("self.key.weight", wk),
                        ("self.value.weight", wv), ("output.dense.weight", wo)):
            if w.ndim != 2:
                raise ValueError(f"state_dict[{base + name!r}]: expected a 2-D weight, got shape {w.shape}")
        E = wq.shape[0]
        if wq.shape != (E, E) or wo.shape != (E, E):
            raise ValueError(
                f"state_dict: expected square query and output.dense weights (E, E), got "
                f"{wq.shape} and {wo.shape}"
            )
        if E % H:
            raise ValueError(f"num_heads: expected a divisor of the hidden size {E}, got {H}")
        dh = E // H
        if wk.shape[0] != wv.shape[0] or wk.shape[0] % dh or wk.shape[0] == 0:
            raise ValueError(
                f"state_dict: key/value weights {wk.shape}, {wv.shape} do not fit {H} heads of {dh}"
            )
        kdim, vdim = wk.shape[1], wv.shape[1]
        if dtype is None:
            dtype = np.float64 if wq.dtype == np.float64 else np.float32
        layer = cls(E, H, kdim=kdim, vdim=vdim, bias=all(present),
                    num_kv_heads=wk.shape[0] // dh, dtype=dtype)
        sd = {"out_proj.weight": wo}
        if layer.packed:
            sd["in_proj_weight"] = np.concatenate([wq, wk, wv], axis=0)
        else:
            sd.update(q_proj_weight=wq, k_proj_weight=wk, v_proj_weight=wv)
        if layer.bias:
            sd["in_proj_bias"] = np.concatenate(biases[:3])
            sd["out_proj.bias"] = biases[3]
        return layer.load_state_dict(sd)
