"""``AttentionDecoder`` (Bahdanau and Luong forms) and ``Seq2Seq``.

Notation: encoder states ``h_i`` (the memory, ``(B, S, D)``), decoder state
``s_t`` (the top layer's hidden state), input token embedding ``x'_t``
(the previous target token), weights ``α_ti = softmax_i(score(s, h_i))`` over
the real source tokens only, context ``c = Σ_i α_ti h_i``.

* **Bahdanau** (``style="bahdanau"``): score the *previous* state ``s_{t-1}``;
  the context enters the cell with the input embedding:
  ``s_t = f([x'_t; c_{t-1}], s_{t-1})`` where ``c_{t-1}`` is the context
  scored from ``s_{t-1}``; ``logits_t = W_out s_t + b_out`` (the layout of
  the PyTorch seq2seq tutorial's ``AttnDecoderRNN``).
* **Luong** (``style="luong"``): the cell runs first, ``s_t = f(x'_t, s_{t-1})``;
  score the *current* state ``s_t``, ``c_t = Σ α_ti h_i``, combine
  ``h̃_t = tanh(W_c [c_t; s_t])`` and ``logits_t = W_out h̃_t + b_out``.

The score is any registered similarity (``attn.<param>`` in the state dict,
``d_q`` = decoder hidden size, ``d_k`` = memory size).  Per source, the
key-only part of the score (e.g. ``W_k h_i`` of additive / concat, ``W h_i``
of general) is computed once by :meth:`AttentionDecoder.precompute`
(:meth:`Similarity.precompute_keys`) and reused by every :meth:`step`.
All attention goes through :func:`fastattn.attention`.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .. import functional as F
from ..losses import cross_entropy
from ._base import (Layer, _config_seed, _rng, _similarity_config, as_float_input, check_dtype,
                    check_int, init_similarity_params, resolve_similarity)
from .rnn import _GATES, Embedding, Linear, RNNEncoder, rnn_class

__all__ = ["AttentionDecoder", "Seq2Seq", "Memory", "DecodeResult"]


def log_softmax(x, axis=-1):
    """``x - logsumexp(x)`` along ``axis`` (plain NumPy; scipy's version costs
    ~100 us of dispatch per call, a fifth of a decoder step at B=1)."""
    m = np.max(x, axis=axis, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))


class Memory(NamedTuple):
    """The encoder memory prepared for decoding (made once per source batch)."""
    values: np.ndarray           # (B, S, D) encoder states
    keys: np.ndarray             # (B, S, d_k') keys with the key-only part of the score applied
    similarity: object           # the similarity that scores against ``keys``
    params: dict | None          # its parameters
    mask: np.ndarray | None      # (B, 1, S) bool, True = real source token
    attend: object = None        # F.PreparedAttention over (keys, values, mask), made by precompute


class DecodeResult(NamedTuple):
    tokens: np.ndarray       # (B, L) int64, generated tokens (eos included), pad after the end
    lengths: np.ndarray      # (B,) number of generated tokens (eos included)
    scores: np.ndarray       # (B,) sum of the log-probabilities of the tokens
    alignments: np.ndarray   # (B, L, S) attention weights of every step (0 after the end)


_STYLES = ("bahdanau", "luong")
#: greedy_decode keeps the logits of up to this many numbers (4 MB of float32)
#: before it turns them into log-probabilities, a batch of steps at a time
_LOGIT_BATCH = 1 << 20


class AttentionDecoder(Layer):
    """RNN decoder attending over an encoder memory.

    Parameters
    ----------
    vocab_size, embed_dim, hidden_size : int
    memory_dim : int
        Feature size D of the encoder states.
    style : "bahdanau" or "luong"
    similarity : str, Similarity or config dict (default ``"additive"``)
    attn_dim : int
        Inner size of additive / concat scores (default ``hidden_size``).
    cell : "gru" (default), "lstm" or "rnn"; num_layers : int
    """

    def __init__(self, vocab_size, embed_dim, hidden_size, memory_dim, *, style="bahdanau",
                 similarity="additive", attn_dim=None, cell="gru", num_layers=1, padding_idx=None,
                 seed=None, dtype=np.float32):
        vocab_size = check_int(vocab_size, "vocab_size")
        embed_dim = check_int(embed_dim, "embed_dim")
        hidden_size = check_int(hidden_size, "hidden_size")
        memory_dim = check_int(memory_dim, "memory_dim")
        attn_dim = hidden_size if attn_dim is None else check_int(attn_dim, "attn_dim")
        if style not in _STYLES:
            raise ValueError(f"style: expected one of {_STYLES}, got {style!r}")
        dt = check_dtype(dtype)
        rnn_cls = rnn_class(cell)
        self.similarity = resolve_similarity(similarity)
        if self.similarity.same_dims and hidden_size != memory_dim:
            raise ValueError(
                f"similarity: {self.similarity.name!r} needs hidden_size == memory_dim, got "
                f"hidden_size={hidden_size}, memory_dim={memory_dim} (use 'general', 'additive' or 'concat')")
        rng = _rng(seed)
        self.style = style
        self.hidden_size, self.memory_dim, self.vocab_size = hidden_size, memory_dim, vocab_size
        self.embedding = Embedding(vocab_size, embed_dim, padding_idx=padding_idx, seed=rng, dtype=dt)
        in_size = embed_dim + memory_dim if style == "bahdanau" else embed_dim
        self.rnn = rnn_cls(in_size, hidden_size, num_layers, seed=rng, dtype=dt)
        self.combine = (Linear(memory_dim + hidden_size, hidden_size, bias=False, seed=rng, dtype=dt)
                        if style == "luong" else None)
        self.out = Linear(hidden_size, vocab_size, seed=rng, dtype=dt)
        self._params = {f"attn.{k}": v for k, v in init_similarity_params(
            self.similarity, hidden_size, memory_dim, attn_dim, rng, dt).items()}
        self._config = dict(vocab_size=vocab_size, embed_dim=embed_dim, hidden_size=hidden_size,
                            memory_dim=memory_dim, style=style,
                            similarity=_similarity_config(self.similarity), attn_dim=attn_dim,
                            cell=cell.lower(), num_layers=num_layers,
                            padding_idx=self.embedding._config["padding_idx"],
                            seed=_config_seed(seed), dtype=dt.name)

    def _children(self):
        ch = {"embedding": self.embedding, "rnn": self.rnn, "out": self.out}
        if self.combine is not None:
            ch["combine"] = self.combine
        return ch

    @property
    def dtype(self):
        return np.dtype(self._config["dtype"])

    # ------------------------------------------------------------ memory
    def precompute(self, memory, memory_mask=None) -> Memory:
        """Prepare the encoder states ``memory (B, S, D)`` (mask ``(B, S)`` bool,
        True = real token) for :meth:`step` / :meth:`forward`: the key-only part
        of the score is applied here, once."""
        memory, mask, ct = self._check_memory(memory, memory_mask)
        raw = {k[5:]: v for k, v in self._params.items() if k.startswith("attn.")}
        params = self.similarity.check_params(raw or None, self.hidden_size, self.memory_dim, ct)
        sim, sparams, keys = self.similarity.precompute_keys(memory.astype(ct, copy=False), params)
        return Memory(memory, keys, sim, sparams, mask,
                      F.PreparedAttention(keys, memory, sim, params=sparams, attn_mask=mask))

    def _check_memory(self, memory, memory_mask):
        """The validated ``(memory (B, S, D), mask (B, 1, S) bool or None, compute dtype)``."""
        memory = as_float_input(memory, "memory", (3,), last=self.memory_dim)
        B, S, _ = memory.shape
        mask = None
        if memory_mask is not None:
            m = np.asarray(memory_mask)
            if m.dtype != np.bool_:
                raise TypeError(f"memory_mask: expected a boolean array (True = real token), got dtype {m.dtype}")
            if m.shape != (B, S):
                raise ValueError(f"memory_mask: expected shape ({B}, {S}), got {m.shape}")
            mask = m[:, None, :].copy()
        return memory, mask, np.result_type(memory.dtype, self.dtype)

    def _attend(self, query, mem: Memory):
        """query (B, Lq, H) → context (B, Lq, D), weights (B, Lq, S)."""
        if mem.attend is not None:
            return mem.attend(query, return_weights=True)
        return F.attention(query, mem.keys, mem.values, mem.similarity, params=mem.params,
                           attn_mask=mem.mask, return_weights=True)

    @staticmethod
    def _top(state):
        return (state[0] if isinstance(state, tuple) else state)[-1]

    def initial_state(self, B, dtype=None):
        dt = self.dtype if dtype is None else dtype
        z = np.zeros((self.rnn.num_layers, B, self.hidden_size), dt)
        return (z, z.copy()) if self._config["cell"] == "lstm" else z

    # -------------------------------------------------------------- step
    def step(self, tokens, state, memory: Memory):
        """One decoding step for the whole batch.

        tokens : (B,) ints, the previous target token; state : the decoder RNN
        state (``(num_layers, B, H)``, ``(h, c)`` for LSTM); memory : from
        :meth:`precompute`.  Returns ``(logits (B, V), state, weights (B, S))``.
        """
        if not isinstance(memory, Memory):
            raise TypeError(f"memory: expected the Memory returned by precompute(), got {type(memory).__name__}")
        tok = np.asarray(tokens)
        B = memory.values.shape[0]
        if tok.shape != (B,):
            raise ValueError(f"tokens: expected shape ({B},) (one token per batch item), got {tok.shape}")
        return self._step(self.embedding(tok), state, memory, self.rnn.step)

    def _step(self, e, state, memory, rnn_step):
        if self.style == "bahdanau":
            ctx, w = self._attend(self._top(state)[:, None, :], memory)
            x = np.concatenate([e.astype(ctx.dtype, copy=False), ctx[:, 0]], axis=-1)
            s, state = rnn_step(x, state)
            logits = F.linear(s, self.out._params["weight"], self.out._params.get("bias"))
        else:
            s, state = rnn_step(e, state)
            ctx, w = self._attend(s[:, None, :], memory)
            ht = np.tanh(self.combine(np.concatenate([ctx[:, 0], s], axis=-1)))
            logits = F.linear(ht, self.out._params["weight"], self.out._params.get("bias"))
        return logits, state, w[:, 0]

    def _step_trusted(self, tokens, state, memory: Memory):
        """step() inside the decoding loops: tokens are int64 ids in range (bos_id
        or picked from this decoder's logits) and state is what the previous step
        (or Seq2Seq's bridge) returned, so neither is checked again."""
        rnn = self.rnn
        ct = np.result_type(memory.values.dtype, rnn.dtype)

        def rnn_step(x, st):
            parts = list(st) if isinstance(st, tuple) else [st]
            return rnn._step_checked(x, [p.astype(ct, copy=False) for p in parts], ct)

        return self._step(self.embedding.weight[tokens], state, memory, rnn_step)

    # ----------------------------------------------------- teacher forced
    def forward(self, tgt_in, state, memory: Memory):
        """Teacher-forced pass: tgt_in (B, T) ints → ``(logits (B, T, V), state,
        alignments (B, T, S))``.  Luong runs the cell over all steps, then one
        attention call with T queries; Bahdanau needs s_{t-1} for each score and
        loops over :meth:`step`."""
        if not isinstance(memory, Memory):
            raise TypeError(f"memory: expected the Memory returned by precompute(), got {type(memory).__name__}")
        tgt = np.asarray(tgt_in)
        if tgt.dtype.kind not in "iu":
            raise TypeError(f"tgt_in: expected an integer array of token ids, got dtype {tgt.dtype}")
        B = memory.values.shape[0]
        if tgt.ndim != 2 or tgt.shape[0] != B:
            raise ValueError(f"tgt_in: expected shape ({B}, T), got {tgt.shape}")
        T = tgt.shape[1]
        if self.style == "luong":
            outs, state = self.rnn(self.embedding(tgt), state)
            ctx, w = self._attend(outs, memory)
            ht = np.tanh(self.combine(np.concatenate([ctx, outs], axis=-1)))
            return self.out(ht), state, w
        logits, aligns = [], []
        for t in range(T):
            lg, state, w = self.step(tgt[:, t], state, memory)
            logits.append(lg)
            aligns.append(w)
        S = memory.values.shape[1]
        if T == 0:
            return (np.zeros((B, 0, self.vocab_size), self.dtype), state, np.zeros((B, 0, S), self.dtype))
        return np.stack(logits, axis=1), state, np.stack(aligns, axis=1)

    # ----------------------------------------------------------- training
    def forward_backward(self, tgt_in, state, memory_values, memory_mask=None):
        """Teacher-forced :meth:`forward` with its backward.

        tgt_in : (B, T) ints; state : the initial decoder state (``(num_layers,
        B, H)``, ``(h, c)`` for LSTM; None: zeros); memory_values : the encoder
        states ``(B, S, D)`` (not a :class:`Memory`: their gradient is
        returned); memory_mask : ``(B, S)`` bool, True = real token.

        Returns ``((logits (B, T, V), final_state), backprop)``;
        ``backprop(grad_logits, grad_state=None)`` (grad_state: dL/d(final
        state) in its structure, LSTM parts may be None) adds every parameter
        gradient (embedding, rnn, combine, out, ``attn.*``) into the
        :attr:`grads` and returns ``(None, dstate, dmemory)``: dstate in the
        initial state's structure (None when no state was given), dmemory
        ``(B, S, D)``, zero at masked positions.

        The scores are computed from the raw similarity on ``(query, values,
        values)`` (no precomputed keys), so the attention backward
        differentiates the key-only part of the score too and dmemory holds
        both the key and the value paths.  Bahdanau steps one cell at a time
        (each keeping its RNN tape and the attention's output and lse);
        Luong runs the cell over all steps and one attention call.
        """
        values, mask, ct = self._check_memory(memory_values, memory_mask)
        tgt = np.asarray(tgt_in)
        if tgt.dtype.kind not in "iu":
            raise TypeError(f"tgt_in: expected an integer array of token ids, got dtype {tgt.dtype}")
        B, S, D = values.shape
        if tgt.ndim != 2 or tgt.shape[0] != B:
            raise ValueError(f"tgt_in: expected shape ({B}, T), got {tgt.shape}")
        tgt = tgt.copy()
        T = tgt.shape[1]
        H, V, L = self.hidden_size, self.vocab_size, self.rnn.num_layers
        lstm = self._config["cell"] == "lstm"
        given = state is not None
        st = self.rnn._check_state(state, B, False, ct)
        state0 = (st[0], st[1]) if lstm else st[0]
        vals = values.astype(ct, copy=False)
        sim = self.similarity
        raw = {k[5:]: v for k, v in self._params.items() if k.startswith("attn.")}
        params = sim.check_params(raw or None, H, D, ct)

        # additive (Bahdanau) scores: the keys' projection W_k h once per call,
        # not at every step (forward and backward); attend_backward returns the
        # gradient of those keys, summed by the caller over the steps and taken
        # back through the projection once (keys_backward)
        pre = sim.name == "additive" and not getattr(sim, "normalize", False)
        if pre:
            psim, pparams, kp = sim.precompute_keys(vals, params)

        def attend(q):
            if pre:
                return F.attention(q, kp, vals, psim, params=pparams, attn_mask=mask,
                                   return_lse=True)
            return F.attention(q, vals, vals, sim, params=params, attn_mask=mask, return_lse=True)

        def attend_backward(g, q, out, lse):
            """(dq, dmemory through the values -- and through the keys when they
            are the memory itself --, d(projected keys) or None)."""
            if pre:
                dq, dkp, dv, dp = F.attention_backward(g, q, kp, vals, psim, params=pparams,
                                                       out=out, lse=lse, attn_mask=mask)
            else:
                dq, dk, dv, dp = F.attention_backward(g, q, vals, vals, sim, params=params,
                                                      out=out, lse=lse, attn_mask=mask)
                dv, dkp = dk + dv, None
            grads = self.grads
            for k, d in (dp or {}).items():
                if f"attn.{k}" in grads:
                    grads[f"attn.{k}"] += d
            return dq, dv, dkp

        def keys_backward(dmem, dkp):
            """dmem plus the gradient through the keys' projection (dkp None: none)."""
            if dkp is None:
                return dmem
            dvk, dwk, _ = F.linear_backward(dkp, vals, params["W_k"])
            self.grads["attn.W_k"] += dwk
            return dmem + dvk

        def grad_state_list(grad_state):
            names = ("grad_h_n", "grad_c_n") if lstm else ("grad_h_n",)
            if lstm:
                if grad_state is not None and (not isinstance(grad_state, (tuple, list))
                                               or len(grad_state) != 2):
                    raise TypeError("grad_state: expected (grad_h_n, grad_c_n) for LSTM, got "
                                    f"{type(grad_state).__name__}")
                parts = [None, None] if grad_state is None else list(grad_state)
            else:
                parts = [grad_state]
            out = []
            for name, a in zip(names, parts):
                if a is None:
                    out.append(np.zeros((L, B, H), ct))
                    continue
                a = np.asarray(a)
                if a.shape != (L, B, H):
                    raise ValueError(f"grad_state: expected {name} of shape {(L, B, H)}, got {a.shape}")
                out.append(np.array(a, dtype=ct))
            return out

        def check_grad_logits(grad_logits):
            g = np.asarray(grad_logits)
            if g.shape != (B, T, V):
                raise ValueError(f"grad_logits: expected shape {(B, T, V)}, got {g.shape}")
            return g.astype(ct, copy=False)

        def pack(parts):
            return tuple(parts) if lstm else parts[0]

        def result(dstate, dmem):
            return None, (pack(dstate) if given else None), dmem.astype(values.dtype, copy=False)

        if T == 0:
            def backprop_empty(grad_logits, grad_state=None):
                check_grad_logits(grad_logits)
                return result(grad_state_list(grad_state), np.zeros((B, S, D), ct))
            return (np.zeros((B, 0, V), ct), state0), backprop_empty

        emb, back_emb = self.embedding.forward_backward(tgt)
        emb = emb.astype(ct, copy=False)
        E = emb.shape[-1]

        if self.style == "luong":
            (outs, final), back_rnn = self.rnn.forward_backward(emb, state0)
            ctx, lse = attend(outs)
            z, back_comb = self.combine.forward_backward(np.concatenate([ctx, outs], axis=-1))
            ht = np.tanh(z)
            logits, back_out = self.out.forward_backward(ht)

            def backprop(grad_logits, grad_state=None):
                g = check_grad_logits(grad_logits)
                gs = grad_state_list(grad_state)
                (dht,) = back_out(g)
                (dcat,) = back_comb(dht * (1 - ht * ht))
                dq, dmem, dkp = attend_backward(dcat[..., :D], outs, ctx, lse)
                dmem = keys_backward(dmem, dkp)
                dx, dstate = back_rnn(dcat[..., D:] + dq, pack(gs))
                back_emb(dx)
                return result(list(dstate) if lstm else [dstate], dmem)
            return (logits, final), backprop

        # Bahdanau: the score of step t reads s_{t-1}, so the cells run one step
        # at a time (F.rnn_scan over T = 1, keeping its gates).  The first
        # layer's input projection is split: the embeddings' part for all steps
        # in one product, the context's per step; in the backward each step
        # takes back only what the recurrence needs (the context's and the
        # lower layers' gradients), and the input projections' weight gradients
        # are one product over all steps afterwards.
        rnn = self.rnn
        cell, Lr = rnn._scan_cell(), rnn.num_layers
        GH = _GATES[rnn._mode] * H
        prm = rnn._params
        W = []
        for k in range(Lr):  # the live parameters (an optimizer updates them in place)
            W.append((np.ascontiguousarray(prm[f"weight_ih_l{k}"], dtype=ct),
                      np.ascontiguousarray(prm[f"weight_hh_l{k}"], dtype=ct),
                      prm[f"bias_ih_l{k}"].astype(ct, copy=False) if rnn.bias else np.zeros(GH, ct),
                      prm[f"bias_hh_l{k}"].astype(ct, copy=False) if rnn.bias else np.zeros(GH, ct)))
        w_c = W[0][0][:, E:]                    # the context's columns of W_ih (l0)
        # the backward's per-step products d(xw) W as linears on the transposes
        WT = [np.ascontiguousarray(w_c.T)] + [np.ascontiguousarray(W[k][0].T) for k in range(1, Lr)]
        xe = F.linear(emb.reshape(B * T, E), W[0][0][:, :E], W[0][2]).reshape(B, T, GH)
        # the per-step products with their weights checked and packed once for
        # all steps, the recurrence's W_hh too (fastattn.functional's private
        # helpers; the weight gradients of W_hh once, after the loop)
        lin_c = F._PackedLinear(w_c)
        lin_ih = [None] + [F._PackedLinear(W[k][0], W[k][2]) for k in range(1, Lr)]
        lin_t = [F._PackedLinear(wt) for wt in WT]
        scans = [F._SteppedScan(W[k][1], W[k][3], cell, B, T, ct) for k in range(Lr)]
        # additive scores: the queries' projection s W_q^T + b as this loop's own
        # product (packed once), the kernel given projected queries and keys;
        # dW_q and db as one product over all steps after the backward's loop
        if pre:
            qsim, qparams, w_q, b_q = psim.split_query_projection(pparams)
            lin_q = F._PackedLinear(w_q, b_q)
            lin_qt = F._PackedLinear(np.ascontiguousarray(w_q.T))
            qproj = np.empty((T, B, w_q.shape[0]), ct)
            steps_attn = F._SteppedAttention(qproj[0][:, None, :], kp, vals, qsim, params=qparams,
                                             attn_mask=mask)
        hs = [np.array(st[0][k], dtype=ct) for k in range(Lr)]
        cs = [np.array(st[1][k], dtype=ct) for k in range(Lr)] if lstm else [None] * Lr
        ctxs = np.empty((B, T, D), ct)
        ins = [None] + [np.empty((B, T, H), ct) for _ in range(1, Lr)]   # layers >= 1's inputs
        tape, tops = [], np.empty((B, T, H), ct)
        for t in range(T):
            q = hs[-1][:, None, :]
            if pre:
                qproj[t] = lin_q(hs[-1])
                ctx, lse = steps_attn.forward(qproj[t][:, None, :])
            else:
                ctx, lse = attend(q)
            ctxs[:, t] = ctx[:, 0]
            xw = xe[:, t] + lin_c(ctx[:, 0])
            steps = []
            for k in range(Lr):
                if k:
                    ins[k][:, t] = inp
                    xw = lin_ih[k](inp)
                xw3 = xw[:, None, :]
                o, h1, c1, gates = scans[k].forward(xw3, hs[k], cs[k])
                steps.append((xw3, o, gates, hs[k], cs[k]))
                hs[k], cs[k] = h1, c1
                inp = o[:, 0]
            tape.append((q, ctx, lse, steps))
            tops[:, t] = inp
        logits, back_out = self.out.forward_backward(tops)
        cur = (np.stack(hs), np.stack(cs)) if lstm else np.stack(hs)

        def backprop(grad_logits, grad_state=None):
            g = check_grad_logits(grad_logits)
            dst = grad_state_list(grad_state)
            (dtop,) = back_out(g)
            dmem = np.zeros((B, S, D), ct)
            dkeys = None
            dh = [np.array(dst[0][k]) for k in range(Lr)]
            dc = [np.array(dst[1][k]) for k in range(Lr)] if lstm else [None] * Lr
            dXW = [np.empty((B, T, GH), ct) for _ in range(Lr)]
            for sc in scans:
                sc.start_backward()
            if pre:
                dqproj = np.empty_like(qproj)
                steps_attn.start_accumulating()   # dkeys and dmem summed by the kernel
            for t in reversed(range(T)):
                q, ctx, lse, steps = tape[t]
                d_o = dtop[:, t]
                for k in reversed(range(Lr)):
                    xw3, o, gates, h_prev, c_prev = steps[k]
                    dxw, dh[k], dck = scans[k].backward(t, d_o[:, None, :], dh[k], xw3, h_prev,
                                                        gates, c_prev, dc[k])
                    if lstm:
                        dc[k] = dck
                    dXW[k][:, t] = dxw[:, 0]
                    if k:
                        d_o = lin_t[k](dxw[:, 0])
                dctx = lin_t[0](dXW[0][:, t])
                if pre:
                    dqp, _, _, dp = steps_attn.backward(dctx[:, None, :], qproj[t][:, None, :],
                                                        ctx, lse, accumulate=True)
                    self.grads["attn.v"] += dp["v"]
                    dqproj[t] = dqp[:, 0]
                    dq = lin_qt(dqp[:, 0])[:, None, :]
                else:
                    dq, dm, dkp = attend_backward(dctx[:, None, :], q, ctx, lse)
                    dmem += dm
                    if dkp is not None:   # summed in place (this call's fresh array first)
                        if dkeys is None:
                            dkeys = dkp
                        else:
                            dkeys += dkp
                dh[-1] = dh[-1] + dq[:, 0]
            if pre:   # the queries' projection over every step at once
                dkeys, dm = steps_attn.accumulated()
                dmem += dm
                qin = np.stack([tape[t][0][:, 0] for t in range(T)])   # each step's query
                dwq, dbq = F._linear_weight_grads(dqproj.reshape(T * B, -1), qin.reshape(T * B, H),
                                                  w_q, b_q)
                self.grads["attn.W_q"] += dwq
                if b_q is not None:
                    self.grads["attn.b"] += dbq
            # the input projections of every step at once
            gr = rnn.grads
            x0 = np.concatenate([emb, ctxs], axis=-1).reshape(B * T, E + D)
            dxw0 = dXW[0].reshape(B * T, GH)
            dwih, dbih = F._linear_weight_grads(dxw0, x0, W[0][0], W[0][2])
            # dx of the embeddings' columns only (the context's went back step by step)
            demb = F._linear_input_grad(dxw0, x0[:, :E], W[0][0][:, :E])
            for k in range(Lr):
                if k:
                    _, dwih, dbih = F.linear_backward(dXW[k].reshape(B * T, GH),
                                                      ins[k].reshape(B * T, H), W[k][0], W[k][2])
                dwhh, dbhh = scans[k].weight_grads()
                gr[f"weight_ih_l{k}"] += dwih
                gr[f"weight_hh_l{k}"] += dwhh
                if rnn.bias:
                    gr[f"bias_ih_l{k}"] += dbih
                    gr[f"bias_hh_l{k}"] += dbhh
            back_emb(demb.reshape(B, T, E))
            out_state = [np.stack(dh)] + ([np.stack(dc)] if lstm else [])
            return result(out_state, keys_backward(dmem, dkeys))
        return (logits, cur), backprop


class Seq2Seq(Layer):
    """``RNNEncoder`` + ``AttentionDecoder``.

    init_state : "encoder" (default) starts the decoder from the encoder's
        final state (per layer; a bidirectional encoder's two directions are
        concatenated, so the decoder's hidden size must be ``2 * H_enc``); the
        cells and layer counts must match.  "zeros" starts from zeros.
    bos_id, eos_id : start and end tokens; pad_id fills generated sequences
        after their end (default eos_id).
    """

    def __init__(self, encoder, decoder, *, bos_id, eos_id, pad_id=None, init_state="encoder"):
        if not isinstance(encoder, RNNEncoder):
            raise TypeError(f"encoder: expected an RNNEncoder, got {type(encoder).__name__}")
        if not isinstance(decoder, AttentionDecoder):
            raise TypeError(f"decoder: expected an AttentionDecoder, got {type(decoder).__name__}")
        V = decoder.vocab_size
        bos_id = check_int(bos_id, "bos_id", 0)
        eos_id = check_int(eos_id, "eos_id", 0)
        pad_id = eos_id if pad_id is None else check_int(pad_id, "pad_id", 0)
        for name, v in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if v >= V:
                raise ValueError(f"{name}: expected a token id in [0, {V}), got {v}")
        if encoder.output_size != decoder.memory_dim:
            raise ValueError(f"decoder: expected memory_dim {encoder.output_size} (the encoder's output "
                             f"size), got {decoder.memory_dim}")
        if init_state not in ("encoder", "zeros"):
            raise ValueError(f"init_state: expected 'encoder' or 'zeros', got {init_state!r}")
        if init_state == "encoder":
            ec, dc = encoder._config, decoder._config
            if ec["cell"] != dc["cell"] or ec["num_layers"] != dc["num_layers"] or \
                    encoder.output_size != decoder.hidden_size:
                raise ValueError(
                    "init_state: 'encoder' needs the same cell and num_layers and decoder hidden_size == "
                    f"encoder output size; got encoder ({ec['cell']}, {ec['num_layers']} layers, output "
                    f"{encoder.output_size}) and decoder ({dc['cell']}, {dc['num_layers']} layers, hidden "
                    f"{decoder.hidden_size}); use init_state='zeros'")
        self.encoder, self.decoder = encoder, decoder
        self.bos_id, self.eos_id, self.pad_id, self.init_state = bos_id, eos_id, pad_id, init_state
        self._params = {}
        self._config = dict(encoder=encoder.get_config(), decoder=decoder.get_config(), bos_id=bos_id,
                            eos_id=eos_id, pad_id=pad_id, init_state=init_state)

    def _children(self):
        return {"encoder": self.encoder, "decoder": self.decoder}

    @classmethod
    def from_config(cls, config, *, seed=None):
        """A new model (freshly initialised) from :meth:`get_config`'s dict; ``seed``,
        when given, replaces the encoder's and decoder's (one Generator drawn by
        both, as ``RNNEncoder`` shares its seed between its sub-layers)."""
        cfg = cls._check_config(config)
        rng = None if seed is None else _rng(seed)
        enc = RNNEncoder.from_config(cfg.pop("encoder"), seed=rng)
        dec = AttentionDecoder.from_config(cfg.pop("decoder"), seed=rng)
        return cls(enc, dec, **cfg)

    # ------------------------------------------------------------ encode
    def _bridge(self, final, B):
        if self.init_state == "zeros":
            return self.decoder.initial_state(B)
        D = self.encoder.rnn.num_directions

        def merge(h):  # (L * D, B, H) -> (L, B, D * H)
            L = h.shape[0] // D
            return np.concatenate([h[d::D] for d in range(D)], axis=-1) if D == 2 else h.reshape(L, *h.shape[1:])

        if isinstance(final, tuple):
            return tuple(merge(h) for h in final)
        return merge(final)

    def encode(self, src, src_mask=None, lengths=None):
        """src (B, S) ids → ``(Memory, initial decoder state)``."""
        out, final, mask = self.encoder(src, lengths=lengths, src_mask=src_mask)
        B = out.shape[0]
        return self.decoder.precompute(out, mask if not mask.all() else None), self._bridge(final, B)

    def __call__(self, src, tgt_in, src_mask=None, **kwargs):
        return self.forward(src, tgt_in, src_mask, **kwargs)

    def forward(self, src, tgt_in, src_mask=None, *, lengths=None, return_alignments=False):
        """Teacher-forced logits ``(B, T, V)`` (and alignments ``(B, T, S)``)."""
        mem, state = self.encode(src, src_mask, lengths)
        logits, _, al = self.decoder.forward(tgt_in, state, mem)
        return (logits, al) if return_alignments else logits

    def _bridge_backward(self, dstate):
        """The gradient of the encoder's final state from the decoder's initial
        state's (None for ``init_state="zeros"``: no path)."""
        if self.init_state == "zeros" or dstate is None:
            return None
        D = self.encoder.rnn.num_directions

        def split(d):  # (L, B, D * H) -> (L * D, B, H), the inverse of _bridge's merge
            if D == 1:
                return d
            L, B, DH = d.shape
            H = DH // D
            out = np.empty((L * D, B, H), d.dtype)
            for k in range(D):
                out[k::D] = d[..., k * H:(k + 1) * H]
            return out

        if isinstance(dstate, tuple):
            return tuple(split(d) for d in dstate)
        return split(dstate)

    def forward_backward(self, src, tgt_in, src_mask=None, *, lengths=None):
        """Teacher-forced :meth:`forward` with its backward: ``(logits (B, T, V),
        backprop)``; ``backprop(grad_logits)`` adds the gradients of the
        encoder's and the decoder's parameters into their :attr:`grads`
        (through the decoder's attention over the encoder states and, with
        ``init_state="encoder"``, through the bridge of the encoder's final
        state) and returns ``(None, None)`` (ids have no gradient)."""
        (out, final, mask), back_enc = self.encoder.forward_backward(src, lengths=lengths,
                                                                     src_mask=src_mask)
        B = out.shape[0]
        state = self._bridge(final, B)
        (logits, _), back_dec = self.decoder.forward_backward(
            tgt_in, state, out, mask if not mask.all() else None)

        def backprop(grad_logits):
            _, dstate, dmem = back_dec(grad_logits)
            back_enc(dmem, self._bridge_backward(dstate))
            return None, None
        return logits, backprop

    def loss_and_grads(self, src, tgt_in, tgt_out, src_mask=None, *, lengths=None):
        """Teacher-forced mean cross entropy of ``tgt_out (B, T)`` (targets equal
        to ``pad_id`` ignored, :func:`fastattn.losses.cross_entropy`) given
        ``tgt_in``; adds its gradients into every parameter's :attr:`grads`
        (call :meth:`zero_grad` first for a fresh step) and returns the loss
        (a float; nan when every target is padding)."""
        logits, backprop = self.forward_backward(src, tgt_in, src_mask, lengths=lengths)
        B, T, V = logits.shape
        tgt = np.asarray(tgt_out)
        if tgt.dtype.kind not in "iu":
            raise TypeError(f"tgt_out: expected an integer array of token ids, got dtype {tgt.dtype}")
        if tgt.shape != (B, T):
            raise ValueError(f"tgt_out: expected shape ({B}, {T}) (that of tgt_in), got {tgt.shape}")
        loss, g = cross_entropy(logits.reshape(B * T, V), tgt.reshape(B * T), ignore_index=self.pad_id)
        backprop(np.asarray(g).reshape(B, T, V))
        return float(loss)

    def step(self, tokens, state, memory):
        """One incremental step; see :meth:`AttentionDecoder.step`."""
        return self.decoder.step(tokens, state, memory)

    # ---------------------------------------------------------- decoding
    def greedy_decode(self, src, src_mask=None, *, lengths=None, max_len=50):
        """Arg-max decoding from ``bos_id`` until ``eos_id`` or ``max_len`` tokens:
        each step takes the arg-max of the logits (the first index among equal
        maxima); ``scores`` sums the log-softmax of the logits at the chosen tokens."""
        max_len = check_int(max_len, "max_len")
        mem, state = self.encode(src, src_mask, lengths)
        B, S = mem.values.shape[:2]
        y = np.full(B, self.bos_id, np.int64)
        done = np.zeros(B, bool)
        ys, ws, lgs, lps = [], [], [], []
        # per step only what the next step needs (the arg-max of the logits);
        # log-probabilities are computed for several steps at once (up to
        # _LOGIT_BATCH numbers of logits kept), lengths, padding after eos and
        # scores once at the end (a B = 1 step is ~150 us, and the dozen small
        # NumPy calls of that bookkeeping were ~40 us of it)
        per_step = B * self.decoder.vocab_size

        def flush():
            if lgs:
                lp = log_softmax(np.stack(lgs, axis=1), axis=-1)          # (B, n, V)
                picked = np.stack(ys[len(ys) - len(lgs):], axis=1)[:, :, None]
                lps.append(np.take_along_axis(lp, picked, axis=-1)[:, :, 0])
                lgs.clear()

        for t in range(max_len):
            logits, state, w = self.decoder._step_trusted(y, state, mem)
            y = np.argmax(logits, axis=-1)
            ys.append(y)
            ws.append(w)
            lgs.append(logits)
            if (len(lgs) + 1) * per_step > _LOGIT_BATCH:
                flush()
            if self.eos_id in y:
                done |= y == self.eos_id
                if done.all():
                    break
        flush()
        L = len(ys)
        tokens = np.full((B, max_len), self.pad_id, np.int64)
        aligns = np.zeros((B, max_len, S), mem.values.dtype)
        scores = np.zeros(B, np.float64)
        lengths_out = np.zeros(B, np.int64)
        if L:
            gen = np.stack(ys, axis=1)                      # (B, L)
            is_eos = gen == self.eos_id
            ended = is_eos.any(axis=1)
            lengths_out = np.where(ended, np.argmax(is_eos, axis=1) + 1, L).astype(np.int64)
            live = np.arange(L)[None, :] < lengths_out[:, None]
            tokens[:, :L] = np.where(live, gen, self.pad_id)
            aligns[:, :L] = np.where(live[:, :, None], np.stack(ws, axis=1), 0)
            lp_all = np.concatenate(lps, axis=1)                              # (B, L)
            for t in range(L):  # in step order, as the running sum was
                scores[live[:, t]] += lp_all[live[:, t], t]
        return DecodeResult(tokens, lengths_out, scores, aligns)

    def beam_search(self, src, src_mask=None, *, lengths=None, beam_size=4, max_len=50,
                    length_penalty=0.0):
        """Beam search; the best hypothesis per batch item by
        ``score / length ** length_penalty`` (0: raw sum of log-probabilities).
        ``beam_size=1`` is exactly :meth:`greedy_decode`."""
        K = check_int(beam_size, "beam_size")
        max_len = check_int(max_len, "max_len")
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)) \
                or not np.isfinite(length_penalty) or length_penalty < 0:
            raise ValueError(f"length_penalty: expected a finite number >= 0, got {length_penalty!r}")
        mem, state = self.encode(src, src_mask, lengths)
        B, S = mem.values.shape[:2]
        V = self.decoder.vocab_size
        rep = np.repeat(np.arange(B), K)
        values, keys = mem.values[rep], mem.keys[rep]
        mask = None if mem.mask is None else mem.mask[rep]
        mem = Memory(values, keys, mem.similarity, mem.params, mask,
                     F.PreparedAttention(keys, values, mem.similarity, params=mem.params, attn_mask=mask))
        state = tuple(s[:, rep] for s in state) if isinstance(state, tuple) else state[:, rep]
        scores = np.full((B, K), -np.inf)
        scores[:, 0] = 0.0
        done = np.zeros((B, K), bool)
        seqs = np.zeros((B, K, 0), np.int64)
        aligns = np.zeros((B, K, 0, S), mem.values.dtype)
        lens = np.zeros((B, K), np.int64)
        y = np.full(B * K, self.bos_id, np.int64)
        for t in range(max_len):
            logits, state, w = self.decoder._step_trusted(y, state, mem)
            lp = log_softmax(logits, axis=-1).astype(np.float64).reshape(B, K, V)
            lp[done] = -np.inf
            lp[done, self.pad_id] = 0.0
            cand = (scores[:, :, None] + lp).reshape(B, K * V)
            idx = np.argsort(-cand, axis=1, kind="stable")[:, :K]
            beam, tok = idx // V, idx % V
            flat = (np.arange(B)[:, None] * K + beam).reshape(-1)
            scores = np.take_along_axis(cand, idx, axis=1)
            prev_done = np.take_along_axis(done, beam, axis=1)
            w = np.where(prev_done.reshape(-1, 1), 0, w[flat]).reshape(B, K, 1, S)
            seqs = np.concatenate([np.take_along_axis(seqs, beam[:, :, None], axis=1),
                                   np.where(prev_done, self.pad_id, tok)[:, :, None]], axis=2)
            aligns = np.concatenate([np.take_along_axis(aligns, beam[:, :, None, None], axis=1), w], axis=2)
            lens = np.take_along_axis(lens, beam, axis=1) + ~prev_done
            done = prev_done | (tok == self.eos_id)
            state = tuple(s[:, flat] for s in state) if isinstance(state, tuple) else state[:, flat]
            y = tok.reshape(-1)
            if done.all():
                break
        norm = scores / np.maximum(lens, 1) ** length_penalty if length_penalty else scores
        best = np.argmax(norm, axis=1)
        r = np.arange(B)
        L = seqs.shape[2]
        tokens = np.full((B, max_len), self.pad_id, np.int64)
        tokens[:, :L] = seqs[r, best]
        al = np.zeros((B, max_len, S), mem.values.dtype)
        al[:, :L] = aligns[r, best]
        return DecodeResult(tokens, lens[r, best], scores[r, best], al)
