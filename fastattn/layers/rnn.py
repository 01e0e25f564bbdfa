"""Embedding, Linear and the recurrent layers ``SimpleRNN``, ``GRU``, ``LSTM``
(torch's equations and parameter layout), and ``RNNEncoder``.

Shapes are batch-first: inputs ``(B, T, E)`` or unbatched ``(T, E)``; final
states ``(num_layers * D, B, H)`` (D = 2 when bidirectional), torch's layout
(index ``layer * D + direction``).  The input projections of all time steps
are one GEMM per layer and direction (``X W_ihᵀ + b_ih``); the time loop runs
in compiled code (:func:`fastattn.functional.rnn_scan`, csrc/fa_rnn.c), each
step one product over the batch rows (``h W_hhᵀ``) plus the gates, the rows
split into blocks across fastattn's threads -- never a loop over batch items
in Python.

Gate equations (torch):

* SimpleRNN: ``h' = tanh(W_ih x + b_ih + W_hh h + b_hh)`` (or relu)
* GRU (gates r, z, n in that order in the stacked weights):
  ``r = σ(W_ir x + b_ir + W_hr h + b_hr)``, ``z = σ(W_iz x + b_iz + W_hz h + b_hz)``,
  ``n = tanh(W_in x + b_in + r ⊙ (W_hn h + b_hn))``, ``h' = (1 − z) ⊙ n + z ⊙ h``
* LSTM (gates i, f, g, o): ``c' = f ⊙ c + i ⊙ g``, ``h' = o ⊙ tanh(c')``

Variable lengths (``lengths=``) follow ``torch.nn.utils.rnn.pack_padded_sequence``:
a sequence's state stops changing after its last real token (the reverse
direction starts at its last real token from the initial state), outputs at
padded positions are 0 and the final state is taken at each sequence's last
real token.
"""
from __future__ import annotations

import math

import numpy as np

from .. import _stamps
from .. import functional as F
from ._base import Layer, _config_seed, _rng, as_float_input, check_bool, check_dtype, check_int

__all__ = ["Embedding", "Linear", "SimpleRNN", "GRU", "LSTM", "RNNEncoder", "lengths_from_mask"]


def _torch_state(obj):
    """(state dict of numpy arrays, module or None) from a torch module or a mapping."""
    if hasattr(obj, "state_dict") and callable(obj.state_dict):
        module, sd = obj, obj.state_dict()
    elif hasattr(obj, "keys"):
        module, sd = None, obj
    else:
        raise TypeError(f"module_or_state_dict: expected a torch module or a state dict, got {type(obj).__name__}")
    out = {}
    for k in sd.keys():
        v = sd[k]
        if hasattr(v, "detach"):
            v = v.detach().cpu().numpy()
        try:
            out[str(k)] = np.asarray(v)
        except Exception as exc:  # ragged lists and the like
            raise TypeError(f"state_dict[{str(k)!r}]: expected an array, got {type(v).__name__} ({exc})") from None
    return out, module


def _dtype_of(sd, dtype):
    if dtype is not None:
        return check_dtype(dtype)
    for a in sd.values():
        if a.dtype in (np.float32, np.float64):
            return a.dtype
    return np.dtype(np.float32)


# ============================================================== Embedding
class Embedding(Layer):
    """Lookup table ``weight (num_embeddings, embedding_dim)``; ``N(0, 1)`` init
    (torch's), the ``padding_idx`` row zero."""

    def __init__(self, num_embeddings, embedding_dim, *, padding_idx=None, seed=None,
                 dtype=np.float32):
        num_embeddings = check_int(num_embeddings, "num_embeddings")
        embedding_dim = check_int(embedding_dim, "embedding_dim")
        if padding_idx is not None:
            padding_idx = check_int(padding_idx, "padding_idx", minimum=-num_embeddings)
            if padding_idx >= num_embeddings:
                raise ValueError(f"padding_idx: expected an index in [0, {num_embeddings}), got {padding_idx}")
            padding_idx %= num_embeddings
        dt = check_dtype(dtype)
        self._config = dict(num_embeddings=num_embeddings, embedding_dim=embedding_dim,
                            padding_idx=padding_idx, seed=_config_seed(seed), dtype=dt.name)
        w = _rng(seed).standard_normal((num_embeddings, embedding_dim)).astype(dt)
        if padding_idx is not None:
            w[padding_idx] = 0
        self._params = {"weight": w}

    @property
    def weight(self):
        return self._params["weight"]

    def __call__(self, ids):
        return self.forward(ids)

    def forward(self, ids):
        """``weight[ids]``: ids an integer array of any shape → ``ids.shape + (E,)``."""
        return F.embedding(ids, self._params["weight"], padding_idx=self._config["padding_idx"])

    def forward_backward(self, ids):
        """``(out, backprop)``: ``backprop(grad_out)`` adds the lookup's gradient
        (rows summed per id, none for ``padding_idx``) into ``grads["weight"]``
        and returns ``(None,)`` (ids have no gradient)."""
        ids = np.array(ids, copy=True) if isinstance(ids, np.ndarray) else ids
        out = self.forward(ids)
        w = self._params["weight"]

        def backprop(grad_out):
            acc, pad = self.grads["weight"], self._config["padding_idx"]
            if not F._embedding_backward_into(acc, grad_out, ids, padding_idx=pad):
                acc += F.embedding_backward(grad_out, ids, w.shape[0], padding_idx=pad,
                                            dtype=w.dtype)
            return (None,)
        return out, backprop

    @classmethod
    def from_torch(cls, module_or_state_dict, *, dtype=None):
        """From ``torch.nn.Embedding`` or its state dict (``weight``)."""
        sd, module = _torch_state(module_or_state_dict)
        if "weight" not in sd or sd["weight"].ndim != 2:
            raise ValueError(f"state_dict: expected 'weight' of shape (num_embeddings, embedding_dim), got keys {sorted(sd)}")
        n, e = sd["weight"].shape
        pad = getattr(module, "padding_idx", None) if module is not None else None
        layer = cls(n, e, padding_idx=pad, dtype=_dtype_of(sd, dtype))
        return layer.load_state_dict(sd)


# ================================================================= Linear
class Linear(Layer):
    """``y = x Wᵀ + b``, ``weight (out, in)``, ``bias (out,)``; torch's
    ``U(-1/√in, 1/√in)`` init."""

    def __init__(self, in_features, out_features, *, bias=True, seed=None, dtype=np.float32):
        in_features = check_int(in_features, "in_features")
        out_features = check_int(out_features, "out_features")
        bias = check_bool(bias, "bias")
        dt = check_dtype(dtype)
        self._config = dict(in_features=in_features, out_features=out_features, bias=bias,
                            seed=_config_seed(seed), dtype=dt.name)
        rng = _rng(seed)
        lim = 1.0 / math.sqrt(in_features)
        self._params = {"weight": rng.uniform(-lim, lim, (out_features, in_features)).astype(dt)}
        if bias:
            self._params["bias"] = rng.uniform(-lim, lim, (out_features,)).astype(dt)

    def __call__(self, x):
        return self.forward(x)

    def forward(self, x):
        """``x (..., in)`` → ``(..., out)``."""
        x = as_float_input(x, "x", range(1, 33), last=self._config["in_features"])
        w, b = self._params["weight"], self._params.get("bias")
        if x.dtype == np.float32 and self.auto_pack:
            packed = self._packed_weights(w, b)
            if packed is not None:
                K, N = packed.K, packed.N
                rows = x.size // K if K else 0
                if packed.worth_it(rows):
                    return packed(x.reshape(rows, K)).reshape(x.shape[:-1] + (N,))
        return F.linear(x, w, b)

    def _packed_weights(self, w, b):
        """The packed copy of ``weight`` (``F._PackedLinear``) that inference
        calls of a float32 layer read, made on the first and remade when
        ``params`` holds other arrays or fastattn wrote them since (an
        optimizer's step, :meth:`params_changed`), as MultiHeadAttention's;
        None without the packed kernel (SIMD off, no AVX2/FMA, float64) or for
        parameters :func:`fastattn.functional.linear` would reject (it then
        says why).  :meth:`forward_backward` never makes or reads it."""
        stamp = _stamps.stamp
        key = (getattr(w, "shape", None), getattr(w, "dtype", None), stamp(w),
               getattr(b, "shape", None), getattr(b, "dtype", None), stamp(b))
        c = self.__dict__.get("_packed")
        if c is not None and c[0] is w and c[1] is b and c[2] == key:
            return c[3]
        self._packed = None   # a stale copy goes before the new one is made
        packed = None
        if (isinstance(w, np.ndarray) and w.dtype == np.float32
                and (b is None or (isinstance(b, np.ndarray) and b.dtype == np.float32))):
            try:
                packed = F._PackedLinear(w, b)
            except (TypeError, ValueError):
                packed = None
            if packed is not None and packed.wp is None:
                packed = None
        self._packed = (w, b, key, packed)
        return packed

    @property
    def auto_pack(self) -> bool:
        """Whether inference calls read a packed copy of a float32 weight (default
        True; as MultiHeadAttention's): False reads the arrays in place on every
        call, for code that writes them in place without :meth:`params_changed`.
        Not part of ``get_config``."""
        return self.__dict__.get("_auto_pack", True)

    @auto_pack.setter
    def auto_pack(self, value):
        self._auto_pack = check_bool(value, "auto_pack")
        self._packed = None

    def __getstate__(self):   # pickling: the packed copy is remade on first use
        state = dict(self.__dict__)
        state.pop("_packed", None)
        return state

    def forward_backward(self, x):
        """``(out, backprop)``: ``backprop(grad_out)`` adds ``dweight`` (and
        ``dbias``) into :attr:`grads` and returns ``(dx,)``."""
        x = as_float_input(x, "x", range(1, 33), last=self._config["in_features"])
        w, b = self._params["weight"], self._params.get("bias")
        out = F.linear(x, w, b)

        def backprop(grad_out):
            dx, dw, db = F.linear_backward(grad_out, x, w, b)
            g = self.grads
            g["weight"] += dw
            if b is not None:
                g["bias"] += db
            return (dx,)
        return out, backprop

    @classmethod
    def from_torch(cls, module_or_state_dict, *, dtype=None):
        """From ``torch.nn.Linear`` or its state dict (``weight``, optional ``bias``)."""
        sd, _ = _torch_state(module_or_state_dict)
        if "weight" not in sd or sd["weight"].ndim != 2:
            raise ValueError(f"state_dict: expected 'weight' of shape (out_features, in_features), got keys {sorted(sd)}")
        o, i = sd["weight"].shape
        layer = cls(i, o, bias="bias" in sd, dtype=_dtype_of(sd, dtype))
        return layer.load_state_dict(sd)


# ============================================================ recurrences
_GATES = {"RNN": 1, "GRU": 3, "LSTM": 4}


def lengths_from_mask(mask, T=None, name="src_mask"):
    """Lengths ``(B,)`` from a boolean ``(B, T)`` mask, True = real token; the
    real tokens must come first (padding at the end)."""
    m = np.asarray(mask)
    if m.dtype != np.bool_:
        raise TypeError(f"{name}: expected a boolean array (True = real token), got dtype {m.dtype}")
    if m.ndim != 2 or (T is not None and m.shape[1] != T):
        raise ValueError(f"{name}: expected shape (B, {T if T is not None else 'T'}), got {m.shape}")
    lengths = m.sum(axis=1)
    prefix = np.arange(m.shape[1])[None, :] < lengths[:, None]
    if not np.array_equal(prefix, m):
        raise ValueError(f"{name}: padding must come after the real tokens (True values first in each row)")
    return lengths


class _RNNBase(Layer):
    _mode = "RNN"

    def __init__(self, input_size, hidden_size, num_layers=1, *, bias=True, bidirectional=False,
                 seed=None, dtype=np.float32, **extra):
        input_size = check_int(input_size, "input_size")
        hidden_size = check_int(hidden_size, "hidden_size")
        num_layers = check_int(num_layers, "num_layers")
        bias = check_bool(bias, "bias")
        bidirectional = check_bool(bidirectional, "bidirectional")
        dt = check_dtype(dtype)
        self._config = dict(input_size=input_size, hidden_size=hidden_size, num_layers=num_layers,
                            bias=bias, bidirectional=bidirectional, **extra,
                            seed=_config_seed(seed), dtype=dt.name)
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.bidirectional = bias, bidirectional
        self.num_directions = 2 if bidirectional else 1
        G = _GATES[self._mode]
        rng = _rng(seed)
        lim = 1.0 / math.sqrt(hidden_size)
        self._params = {}
        for k in range(num_layers):
            in_k = input_size if k == 0 else hidden_size * self.num_directions
            for sfx in ("", "_reverse")[:self.num_directions]:
                shapes = {f"weight_ih_l{k}{sfx}": (G * hidden_size, in_k),
                          f"weight_hh_l{k}{sfx}": (G * hidden_size, hidden_size)}
                if bias:
                    shapes[f"bias_ih_l{k}{sfx}"] = (G * hidden_size,)
                    shapes[f"bias_hh_l{k}{sfx}"] = (G * hidden_size,)
                for n, s in shapes.items():
                    self._params[n] = rng.uniform(-lim, lim, s).astype(dt)
        self._cache = {}

    def _after_load(self):
        self._cache = {}

    @property
    def dtype(self):
        return np.dtype(self._config["dtype"])

    def _weights(self, k, sfx, ct):
        """(W_ih, W_hh, b_ih, b_hh) in dtype ct: the live parameter arrays when
        they are in ct already (so in-place updates, e.g. an optimizer's step,
        are seen), converted copies otherwise (made per call, never cached);
        zero biases (cached) without bias."""
        p = self._params
        G = _GATES[self._mode] * self.hidden_size
        if self.bias:
            bih = p[f"bias_ih_l{k}{sfx}"].astype(ct, copy=False)
            bhh = p[f"bias_hh_l{k}{sfx}"].astype(ct, copy=False)
        else:
            bih = bhh = self._cache.get(("zeros", ct.str))
            if bih is None:
                bih = bhh = self._cache.setdefault(("zeros", ct.str), np.zeros(G, ct))
        return (np.ascontiguousarray(p[f"weight_ih_l{k}{sfx}"], dtype=ct),
                np.ascontiguousarray(p[f"weight_hh_l{k}{sfx}"], dtype=ct), bih, bhh)

    def _scan_cell(self):
        """The cell name of :func:`fastattn.functional.rnn_scan`."""
        if self._mode == "RNN":
            return "rnn_relu" if self._config.get("nonlinearity") == "relu" else "rnn_tanh"
        return self._mode.lower()

    # ------------------------------------------------------------ states
    def _check_state(self, state, B, unbatched, ct):
        LD, H = self.num_layers * self.num_directions, self.hidden_size
        want = (LD, H) if unbatched else (LD, B, H)
        names = ("h0", "c0") if self._mode == "LSTM" else ("h0",)
        if state is None:
            return [np.zeros((LD, B, H), ct) for _ in names]
        if self._mode == "LSTM":
            if not isinstance(state, (tuple, list)) or len(state) != 2:
                raise TypeError(f"state: expected a tuple (h0, c0) for LSTM, got {type(state).__name__}")
            parts = list(state)
        else:
            parts = [state]
        out = []
        for name, s in zip(names, parts):
            s = as_float_input(s, name, (len(want),))
            if s.shape != want:
                raise ValueError(f"{name}: expected shape {want} (num_layers * num_directions, "
                                 f"{'' if unbatched else 'B, '}hidden_size), got {s.shape}")
            # not copied: the kernels never write into a state they are given
            out.append((s[:, None, :] if unbatched else s).astype(ct, copy=False))
        return out

    def _pack_state(self, hs, cs, unbatched):
        h = hs[0][None] if len(hs) == 1 else np.stack(hs)
        if unbatched:
            h = h[:, 0]
        if self._mode != "LSTM":
            return h
        c = cs[0][None] if len(cs) == 1 else np.stack(cs)
        return h, (c[:, 0] if unbatched else c)

    def _call_args(self, x, state, lengths):
        """``(x (B, T, E), unbatched, compute dtype, lengths or None, h0, c0)`` of a
        call, validated (lengths None when no row is shorter than T)."""
        x = as_float_input(x, "x", (2, 3), last=self.input_size)
        unbatched = x.ndim == 2
        if unbatched:
            x = x[None]
        B, T, _ = x.shape
        ct = np.result_type(x.dtype, self.dtype)
        if lengths is not None:
            if unbatched:
                raise ValueError("lengths: not supported for unbatched (T, E) input; pass (1, T, E)")
            lengths = _check_lengths(lengths, B, T)
            if not np.any(lengths < T):
                lengths = None
        st = self._check_state(state, B, unbatched, ct)
        return x, unbatched, ct, lengths, st[0], st[1] if self._mode == "LSTM" else None

    # ----------------------------------------------------------- forward
    def __call__(self, x, state=None, *, lengths=None):
        return self.forward(x, state, lengths=lengths)

    def forward(self, x, state=None, *, lengths=None):
        """Run the whole sequence.

        x : (B, T, input_size) or unbatched (T, input_size)
        state : initial state, (num_layers * D, B, H) (``(h0, c0)`` for LSTM),
            zeros when omitted.
        lengths : optional (B,) ints in [0, T]: packed-sequence semantics.

        Returns ``(outputs (B, T, D * H), final_state)``.
        """
        x, unbatched, ct, lengths, h0, c0 = self._call_args(x, state, lengths)
        B, T, _ = x.shape
        hs, cs = [], []
        inp = x
        cell = self._scan_cell()
        for k in range(self.num_layers):
            dirs = []
            for d, sfx in enumerate(("", "_reverse")[:self.num_directions]):
                wih, whh, bih, bhh = self._weights(k, sfx, ct)
                idx = k * self.num_directions + d
                # (explicit sizes: B * T may be 0, where -1 cannot be inferred)
                xw = F.linear(inp.reshape(B * T, inp.shape[-1]), wih, bih).reshape(B, T, wih.shape[0])
                o, h, c = F.rnn_scan(xw, whh, bhh, h0[idx], cell=cell,
                                     c0=None if c0 is None else c0[idx], lengths=lengths,
                                     reverse=bool(d))
                dirs.append(o)
                hs.append(h)
                cs.append(c)
            inp = dirs[0] if len(dirs) == 1 else np.concatenate(dirs, axis=-1)
        outputs = inp[0] if unbatched else inp
        return outputs, self._pack_state(hs, cs, unbatched)

    def forward_backward(self, x, state=None, *, lengths=None):
        """``((outputs, final_state), backprop)`` for :meth:`forward`'s arguments.

        ``backprop(grad_outputs, grad_state=None)`` takes dL/d(outputs) (None:
        unused) and dL/d(final_state) in its structure (``h_n``, LSTM ``(h_n,
        c_n)``, either part None; None: unused), adds every weight's and
        bias's gradient into :attr:`grads` and returns ``(dx, dstate)``:
        dstate in the initial state's structure, None when no state was given.
        Each layer and direction keeps its input projections, outputs and gates
        for the backward (:func:`fastattn.functional.rnn_scan` with
        ``return_gates``); the inputs must not change before ``backprop``.
        """
        x = as_float_input(x, "x", (2, 3), last=self.input_size)
        xb, unbatched, ct, lengths, h0, c0 = self._call_args(x, state, lengths)
        B, T, _ = xb.shape
        cell, H, D = self._scan_cell(), self.hidden_size, self.num_directions
        GH = _GATES[self._mode] * H
        p = self._params
        saved, hs, cs = [], [], []
        inp = xb.astype(ct, copy=False)
        for k in range(self.num_layers):
            dirs = []
            for d, sfx in enumerate(("", "_reverse")[:D]):
                # the live parameters (no cached conversion: an optimizer updates them in place)
                wih = np.ascontiguousarray(p[f"weight_ih_l{k}{sfx}"], dtype=ct)
                whh = np.ascontiguousarray(p[f"weight_hh_l{k}{sfx}"], dtype=ct)
                bih = p[f"bias_ih_l{k}{sfx}"].astype(ct, copy=False) if self.bias else np.zeros(GH, ct)
                bhh = p[f"bias_hh_l{k}{sfx}"].astype(ct, copy=False) if self.bias else np.zeros(GH, ct)
                idx = k * D + d
                xw = F.linear(inp.reshape(B * T, inp.shape[-1]), wih, bih).reshape(B, T, GH)
                o, h, c, gates = F.rnn_scan(xw, whh, bhh, h0[idx], cell=cell,
                                            c0=None if c0 is None else c0[idx], lengths=lengths,
                                            reverse=bool(d), return_gates=True)
                saved.append((k, sfx, inp, xw, o, gates, wih, whh, bih, bhh))
                dirs.append(o)
                hs.append(h)
                cs.append(c)
            inp = dirs[0] if len(dirs) == 1 else np.concatenate(dirs, axis=-1)
        outputs = inp[0] if unbatched else inp
        final = self._pack_state(hs, cs, unbatched)
        LD = self.num_layers * D

        def state_grad(a, name):
            if a is None:
                return None
            a = np.asarray(a)
            want = (LD, H) if unbatched else (LD, B, H)
            if a.shape != want:
                raise ValueError(f"grad_state: expected {name} of shape {want}, got {a.shape}")
            return (a[:, None, :] if unbatched else a).astype(ct, copy=False)

        def backprop(grad_outputs, grad_state=None):
            want = (T, D * H) if unbatched else (B, T, D * H)
            if grad_outputs is None:
                d_inp = np.zeros((B, T, D * H), ct)
            else:
                go = np.asarray(grad_outputs)
                if go.shape != want:
                    raise ValueError(f"grad_outputs: expected shape {want}, got {go.shape}")
                d_inp = (go[None] if unbatched else go).astype(ct, copy=False)
            if self._mode == "LSTM":
                if grad_state is not None and (not isinstance(grad_state, (tuple, list))
                                               or len(grad_state) != 2):
                    raise TypeError("grad_state: expected (grad_h_n, grad_c_n) for LSTM, got "
                                    f"{type(grad_state).__name__}")
                gh_n, gc_n = (None, None) if grad_state is None else grad_state
                gh_n, gc_n = state_grad(gh_n, "grad_h_n"), state_grad(gc_n, "grad_c_n")
            else:
                gh_n, gc_n = state_grad(grad_state, "grad_h_n"), None
            dh0 = np.zeros((LD, B, H), ct)
            dc0 = np.zeros((LD, B, H), ct) if self._mode == "LSTM" else None
            g = self.grads
            for k in reversed(range(self.num_layers)):
                d_below = None
                for d in range(D):
                    idx = k * D + d
                    _, sfx, inp_k, xw, o, gates, wih, whh, bih, bhh = saved[idx]
                    dxw, dwhh, dbhh, dh0i, dc0i = F.rnn_scan_backward(
                        d_inp[..., d * H:(d + 1) * H], None if gh_n is None else gh_n[idx],
                        xw, whh, bhh, h0[idx], o, cell=cell,
                        c0=None if c0 is None else c0[idx],
                        grad_c_n=None if gc_n is None else gc_n[idx], lengths=lengths,
                        reverse=bool(d), gates=gates)
                    dinp, dwih, dbih = F.linear_backward(
                        dxw.reshape(B * T, GH), inp_k.reshape(B * T, inp_k.shape[-1]), wih, bih)
                    g[f"weight_ih_l{k}{sfx}"] += dwih
                    g[f"weight_hh_l{k}{sfx}"] += dwhh
                    if self.bias:
                        g[f"bias_ih_l{k}{sfx}"] += dbih
                        g[f"bias_hh_l{k}{sfx}"] += dbhh
                    dh0[idx] = dh0i
                    if dc0 is not None:
                        dc0[idx] = dc0i
                    dinp = dinp.reshape(B, T, inp_k.shape[-1])
                    d_below = dinp if d_below is None else d_below + dinp
                d_inp = d_below
            dx = (d_inp[0] if unbatched else d_inp).astype(x.dtype, copy=False)
            if state is None:
                return dx, None
            hs_ = dh0[:, 0] if unbatched else dh0
            if self._mode != "LSTM":
                return dx, hs_
            return dx, (hs_, dc0[:, 0] if unbatched else dc0)
        return (outputs, final), backprop

    def step(self, x, state=None):
        """One time step for a unidirectional layer: x (B, input_size) → (output (B, H), state)."""
        if self.bidirectional:
            raise ValueError("step: a bidirectional layer needs the whole sequence; use forward()")
        x = as_float_input(x, "x", (2,), last=self.input_size)
        B = x.shape[0]
        ct = np.result_type(x.dtype, self.dtype)
        return self._step_checked(x, self._check_state(state, B, False, ct), ct)

    def _step_checked(self, x, st, ct):
        """step() after the checks: x (B, input_size), st the state as a list of
        (num_layers, B, H) arrays ([h] or [h, c]) in dtype ct."""
        cell = self._scan_cell()
        hs, cs = [], []
        inp = x
        for k in range(self.num_layers):
            wih, whh, bih, bhh = self._weights(k, "", ct)
            h, c = F.rnn_cell(inp, st[0][k], wih, bih, whh, bhh, cell=cell,
                              c=st[1][k] if self._mode == "LSTM" else None)
            hs.append(h)
            cs.append(c)
            inp = h
        return inp, self._pack_state(hs, cs, False)

    # ------------------------------------------------------------ torch
    @classmethod
    def from_torch(cls, module_or_state_dict, *, dtype=None, **kwargs):
        """From ``torch.nn.RNN`` / ``GRU`` / ``LSTM`` (or its state dict: sizes are
        read off ``weight_ih_l0`` / ``weight_hh_l0``, layers and directions off
        the names).  torch's ``batch_first`` does not matter: fastattn is
        always batch-first."""
        sd, module = _torch_state(module_or_state_dict)
        G = _GATES[cls._mode]
        if module is not None:
            tname = type(module).__name__
            if tname != cls._torch_name:
                raise TypeError(f"module_or_state_dict: expected torch.nn.{cls._torch_name}, got {tname}")
            if getattr(module, "proj_size", 0):
                raise ValueError("module_or_state_dict: LSTM proj_size is not supported")
            if cls._mode == "RNN":
                kwargs.setdefault("nonlinearity", module.nonlinearity)
        if "weight_ih_l0" not in sd or "weight_hh_l0" not in sd:
            raise ValueError(f"state_dict: expected 'weight_ih_l0' and 'weight_hh_l0', got keys {sorted(sd)}")
        for name in ("weight_ih_l0", "weight_hh_l0"):
            if sd[name].ndim != 2:
                raise ValueError(f"state_dict[{name!r}]: expected a 2-d ({G} * hidden_size, features) "
                                 f"weight, got shape {sd[name].shape}")
        GH, in_size = sd["weight_ih_l0"].shape
        if GH % G:
            raise ValueError(f"state_dict['weight_ih_l0']: expected {G} * hidden_size rows for {cls.__name__}, got {GH}")
        H = GH // G
        L = 0
        while f"weight_ih_l{L}" in sd:
            L += 1
        layer = cls(in_size, H, L, bias="bias_ih_l0" in sd, bidirectional="weight_ih_l0_reverse" in sd,
                    dtype=_dtype_of(sd, dtype), **kwargs)
        return layer.load_state_dict(sd)


def _check_lengths(lengths, B, T, name="lengths"):
    a = np.asarray(lengths)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integers, got dtype {a.dtype}")
    if a.shape != (B,):
        raise ValueError(f"{name}: expected shape ({B},) (one length per batch item), got {a.shape}")
    if a.size and (a.min() < 0 or a.max() > T):
        raise ValueError(f"{name}: expected lengths in [0, {T}], got values in [{a.min()}, {a.max()}]")
    return a.astype(np.intp)


class SimpleRNN(_RNNBase):
    """Elman RNN, ``torch.nn.RNN`` (``nonlinearity="tanh"`` or ``"relu"``)."""
    _mode = "RNN"
    _torch_name = "RNN"

    def __init__(self, input_size, hidden_size, num_layers=1, *, nonlinearity="tanh", bias=True,
                 bidirectional=False, seed=None, dtype=np.float32):
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"nonlinearity: expected 'tanh' or 'relu', got {nonlinearity!r}")
        super().__init__(input_size, hidden_size, num_layers, bias=bias, bidirectional=bidirectional,
                         seed=seed, dtype=dtype, nonlinearity=nonlinearity)


class GRU(_RNNBase):
    """``torch.nn.GRU`` (gates r, z, n)."""
    _mode = "GRU"
    _torch_name = "GRU"


class LSTM(_RNNBase):
    """``torch.nn.LSTM`` (gates i, f, g, o); state ``(h, c)``."""
    _mode = "LSTM"
    _torch_name = "LSTM"


_CELLS = {"rnn": SimpleRNN, "gru": GRU, "lstm": LSTM}


def rnn_class(cell):
    if not isinstance(cell, str) or cell.lower() not in _CELLS:
        raise ValueError(f"cell: expected one of {sorted(_CELLS)}, got {cell!r}")
    return _CELLS[cell.lower()]


# ============================================================= RNNEncoder
class RNNEncoder(Layer):
    """Embedding + (stacked, optionally bidirectional) RNN over token ids.

    ``forward(src, lengths=None, src_mask=None)`` → ``(outputs (B, S, D * H),
    final_state, src_mask (B, S) bool)``.  Padding is given as ``lengths`` or
    as a boolean ``src_mask`` (True = real token, padding at the end); padded
    positions never leak into the states (packed-sequence semantics).
    """

    def __init__(self, vocab_size, embed_dim, hidden_size, *, cell="gru", num_layers=1,
                 bidirectional=False, padding_idx=None, seed=None, dtype=np.float32):
        rnn_cls = rnn_class(cell)
        rng = _rng(seed)
        self.embedding = Embedding(vocab_size, embed_dim, padding_idx=padding_idx, seed=rng, dtype=dtype)
        self.rnn = rnn_cls(embed_dim, hidden_size, num_layers, bidirectional=bidirectional, seed=rng,
                           dtype=dtype)
        self._config = dict(vocab_size=vocab_size, embed_dim=embed_dim, hidden_size=hidden_size,
                            cell=cell.lower(), num_layers=num_layers, bidirectional=bidirectional,
                            padding_idx=self.embedding._config["padding_idx"],
                            seed=_config_seed(seed), dtype=np.dtype(dtype).name)
        self._params = {}

    @property
    def output_size(self):
        return self.rnn.hidden_size * self.rnn.num_directions

    def _children(self):
        return {"embedding": self.embedding, "rnn": self.rnn}

    def __call__(self, src, lengths=None, src_mask=None, state=None):
        return self.forward(src, lengths=lengths, src_mask=src_mask, state=state)

    def _ids_lengths(self, src, lengths, src_mask):
        """The validated ``(ids, lengths or None)`` of a call."""
        ids = np.asarray(src)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"src: expected an integer array of token ids, got dtype {ids.dtype}")
        if ids.ndim != 2:
            raise ValueError(f"src: expected shape (B, S), got {ids.ndim}-d array of shape {ids.shape}")
        B, S = ids.shape
        if src_mask is not None:
            from_mask = lengths_from_mask(src_mask, S)
            if from_mask.shape != (B,):
                raise ValueError(f"src_mask: expected shape ({B}, {S}), got {np.shape(src_mask)}")
            if lengths is not None and not np.array_equal(_check_lengths(lengths, B, S), from_mask):
                raise ValueError("lengths: disagree with src_mask")
            lengths = from_mask
        if lengths is not None:
            lengths = _check_lengths(lengths, B, S)
        return ids, lengths

    def forward(self, src, lengths=None, src_mask=None, state=None):
        ids, lengths = self._ids_lengths(src, lengths, src_mask)
        B, S = ids.shape
        x = self.embedding(ids)
        out, final = self.rnn(x, state, lengths=lengths)
        mask = (np.ones((B, S), bool) if lengths is None
                else np.arange(S)[None, :] < lengths[:, None])
        return out, final, mask

    def forward_backward(self, src, lengths=None, src_mask=None, state=None):
        """``((outputs, final_state, src_mask), backprop)``; ``backprop(grad_outputs,
        grad_state=None)`` adds the embedding's and the RNN's gradients into
        their :attr:`grads` and returns ``(None, dstate)`` (ids have no
        gradient; dstate None when no state was given)."""
        ids, lengths = self._ids_lengths(src, lengths, src_mask)
        B, S = ids.shape
        x, back_emb = self.embedding.forward_backward(ids)
        (out, final), back_rnn = self.rnn.forward_backward(x, state, lengths=lengths)
        mask = (np.ones((B, S), bool) if lengths is None
                else np.arange(S)[None, :] < lengths[:, None])

        def backprop(grad_outputs, grad_state=None):
            dx, dstate = back_rnn(grad_outputs, grad_state)
            back_emb(dx)
            return None, dstate
        return (out, final, mask), backprop
