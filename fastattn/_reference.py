"""Pure-NumPy float64 oracle for every public op.

Written for clarity, not speed: it builds the full score matrix.  Tests and
benchmarks compare the kernels against it; nothing in the library calls it.
"""
from __future__ import annotations

import numpy as np


def _mask_scores(s, attn_mask, is_causal, causal_alignment):
    """(masked scores, allowed) for scores s (..., Lq, Lk): a bool mask and
    causality forbid (-inf), a float mask is added; broadcast together."""
    Lq, Lk = s.shape[-2], s.shape[-1]
    allowed = np.ones(s.shape, dtype=bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            s = s + m.astype(np.float64)
    if is_causal:
        off = 0 if causal_alignment == "top_left" else Lk - Lq
        allowed = allowed & (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + off)
    s, allowed = np.broadcast_arrays(s, allowed)
    return np.where(allowed, s, -np.inf), allowed


def _allowed_and_scores(q, k, attn_mask, is_causal, scale, causal_alignment):
    d = q.shape[-1]
    if scale is None:
        scale = 1.0 / np.sqrt(d) if d > 0 else 1.0
    return _mask_scores(np.matmul(q, np.swapaxes(k, -1, -2)) * scale, attn_mask, is_causal,
                        causal_alignment)


def softmax_rows(s):
    """Softmax over the last axis where a row of only -inf gives zeros; NaN propagates."""
    s = np.asarray(s, dtype=np.float64)
    fully = np.all(s == -np.inf, axis=-1, keepdims=True)
    m = np.max(s, axis=-1, keepdims=True) if s.shape[-1] else np.zeros(s.shape[:-1] + (1,))
    m = np.where(fully, 0.0, m)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp(s - m)
        w = p / np.sum(p, axis=-1, keepdims=True)
    return np.where(fully, 0.0, w)


def logsumexp_rows(s):
    """log(sum(exp(s))) over the last axis in float64, shifted by the row max;
    -inf for a row of only -inf (no allowed key); NaN propagates."""
    s = np.asarray(s, dtype=np.float64)
    if s.shape[-1] == 0:
        return np.full(s.shape[:-1], -np.inf)
    m = np.max(s, axis=-1, keepdims=True)
    m = np.where(m == -np.inf, 0.0, m)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return (m + np.log(np.sum(np.exp(s - m), axis=-1, keepdims=True)))[..., 0]


def _results(out, w, s, return_weights, return_lse):
    res = (out,) + ((w,) if return_weights else ()) + ((logsumexp_rows(s),) if return_lse else ())
    return res[0] if len(res) == 1 else res


def scaled_dot_product_attention(
    query,
    key,
    value,
    attn_mask=None,
    is_causal=False,
    scale=None,
    *,
    causal_alignment="top_left",
    return_weights=False,
    return_lse=False,
):
    """softmax(scale * q k^T + bias, masked) @ v in float64; fully masked rows give 0."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    s, _ = _allowed_and_scores(q, k, attn_mask, is_causal, scale, causal_alignment)
    w = softmax_rows(s)
    return _results(np.matmul(w, v), w, s, return_weights, return_lse)


def _reduce_to(g, shape):
    """Sum a gradient computed on broadcast operands back to an input's shape."""
    shape = tuple(shape)
    while g.ndim > len(shape):
        g = g.sum(axis=0)
    for ax, n in enumerate(shape):
        if n == 1 and g.shape[ax] != 1:
            g = g.sum(axis=ax, keepdims=True)
    return g


def scaled_dot_product_attention_backward(grad_out, query, key, value, attn_mask=None,
                                          is_causal=False, scale=None, *,
                                          causal_alignment="top_left"):
    """(dq, dk, dv, dmask) of the float64 SDPA above, from the dense matrices:
    P = softmax(S), dV = P^T dO, dP = dO V^T, dS = P o (dP - rowsum(P o dP)),
    dQ = scale dS K, dK = scale dS^T Q, dmask = dS (None without a float mask);
    each summed back to its input's shape."""
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    g = np.asarray(grad_out, dtype=np.float64)
    d = q.shape[-1]
    sc = (1.0 / np.sqrt(d) if d > 0 else 1.0) if scale is None else float(scale)
    s, _ = _allowed_and_scores(q, k, attn_mask, is_causal, sc, causal_alignment)
    p = softmax_rows(s)
    dv = np.matmul(np.swapaxes(p, -1, -2), g)
    dp = np.matmul(g, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    ds = np.where(p > 0, ds, 0.0)  # no allowed key / masked: no gradient (even from NaN)
    dq = sc * np.matmul(ds, k)
    dk = sc * np.matmul(np.swapaxes(ds, -1, -2), q)
    dmask = None
    if attn_mask is not None and np.asarray(attn_mask).dtype != np.bool_:
        dmask = _reduce_to(ds, np.shape(attn_mask))
    return (_reduce_to(dq, q.shape), _reduce_to(dk, k.shape), _reduce_to(dv, v.shape), dmask)


# ---------------------------------------------------------------------------
# fastattn.attention: any score function.  Each score formula below is
# written straight from its textbook definition, in float64, building the
# full (..., Lq, Lk[, d_a]) tensors; they share no code with
# fastattn.similarity.

def attention(query, key, value, score_fn, attn_mask=None, is_causal=False, *,
              causal_alignment="top_left", return_weights=False, return_lse=False):
    """softmax(score_fn(q, k) + mask) @ v in float64; fully masked rows give 0.

    score_fn(q, k) gets float64 arrays (..., Lq, d_q), (..., Lk, d_k) and
    returns (..., Lq, Lk) scores.
    """
    q = np.asarray(query, dtype=np.float64)
    k = np.asarray(key, dtype=np.float64)
    v = np.asarray(value, dtype=np.float64)
    s, _ = _mask_scores(np.asarray(score_fn(q, k), dtype=np.float64), attn_mask, is_causal,
                        causal_alignment)
    w = softmax_rows(s)
    return _results(np.matmul(w, v), w, s, return_weights, return_lse)


def _f64(*xs):
    return [None if x is None else np.asarray(x, dtype=np.float64) for x in xs]


def score_dot(q, k, scale=1.0):
    """scale * sum_c q[i, c] k[j, c]."""
    q, k = _f64(q, k)
    return scale * np.einsum("...ic,...jc->...ij", q, k)


def score_general(q, k, W, scale=1.0):
    """scale * q_i^T W k_j, W of shape (d_q, d_k)."""
    q, k, W = _f64(q, k, W)
    return scale * np.einsum("...ia,ab,...jb->...ij", q, W, k)


def score_additive(q, k, W_q, W_k, v, b=None):
    """v . tanh(W_q q_i + W_k k_j + b) (Bahdanau); builds (..., Lq, Lk, d_a)."""
    q, k, W_q, W_k, v, b = _f64(q, k, W_q, W_k, v, b)
    qp = np.einsum("...ic,ac->...ia", q, W_q)
    kp = np.einsum("...jc,ac->...ja", k, W_k)
    h = qp[..., :, None, :] + kp[..., None, :, :]
    if b is not None:
        h = h + b
    return np.einsum("...ija,a->...ij", np.tanh(h), v)


def score_concat(q, k, W, v, b=None):
    """v . tanh(W [q_i; k_j] + b) (Luong concat), by explicit concatenation."""
    q, k, W, v, b = _f64(q, k, W, v, b)
    Lq, Lk = q.shape[-2], k.shape[-2]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    qq = np.broadcast_to(q[..., :, None, :], batch + (Lq, Lk, q.shape[-1]))
    kk = np.broadcast_to(k[..., None, :, :], batch + (Lq, Lk, k.shape[-1]))
    cat = np.concatenate([qq, kk], axis=-1)
    h = np.einsum("...ijc,ac->...ija", cat, W)
    if b is not None:
        h = h + b
    return np.einsum("...ija,a->...ij", np.tanh(h), v)


def score_cosine(q, k, beta=1.0, eps=1e-12):
    """beta * q.k / (max(|q|, eps) max(|k|, eps))."""
    q, k = _f64(q, k)
    nq = np.maximum(np.linalg.norm(q, axis=-1), eps)
    nk = np.maximum(np.linalg.norm(k, axis=-1), eps)
    return beta * np.einsum("...ic,...jc->...ij", q, k) / (nq[..., :, None] * nk[..., None, :])


def score_neg_sq_dist(q, k, gamma=1.0):
    """-gamma * |q_i - k_j|^2 (the example compiled plugin's score)."""
    q, k = _f64(q, k)
    diff = q[..., :, None, :] - k[..., None, :, :]
    return -gamma * np.sum(diff * diff, axis=-1)


def score_neg_l1(q, k, gamma=1.0):
    """-gamma * sum_c |q_ic - k_jc| (the example plugin package's score)."""
    q, k = _f64(q, k)
    return -gamma * np.sum(np.abs(q[..., :, None, :] - k[..., None, :, :]), axis=-1)

def multi_head_attention(
    query,
    key,
    value,
    *,
    num_heads,
    w_query,
    w_key,
    w_value,
    w_out,
    b_query=None,
    b_key=None,
    b_value=None,
    b_out=None,
    attn_mask=None,
    key_mask=None,
    is_causal=False,
    num_kv_heads=None,
    scale=None,
    causal_alignment="top_left",
    return_weights=False,
    average_weights=True,
):
    """Multi-head attention in float64, every step spelled out (separate weights).

    Batch-first (B, L, features) or unbatched (L, features).  Key/value heads
    of grouped-query attention are repeated explicitly (query head h uses
    key/value head h // (H // Hkv)).  Masks follow fastattn's convention
    (bool True = may attend; key_mask True = real token); fully masked rows
    give zero attention.
    """
    f64 = np.float64
    q_in = np.asarray(query, dtype=f64)
    unbatched = q_in.ndim == 2
    k_in = np.asarray(key, dtype=f64)
    v_in = np.asarray(value, dtype=f64)
    if unbatched:
        q_in, k_in, v_in = q_in[None], k_in[None], v_in[None]
    B, Lq, E = q_in.shape
    Lk = k_in.shape[1]
    H = num_heads
    Hkv = H if num_kv_heads is None else num_kv_heads
    dh = E // H

    def lin(x, w, b):
        y = x @ np.asarray(w, dtype=f64).T
        return y if b is None else y + np.asarray(b, dtype=f64)

    q = lin(q_in, w_query, b_query).reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    k = lin(k_in, w_key, b_key).reshape(B, Lk, Hkv, dh).transpose(0, 2, 1, 3)
    v = lin(v_in, w_value, b_value).reshape(B, Lk, Hkv, dh).transpose(0, 2, 1, 3)
    group = H // Hkv
    k = np.repeat(k, group, axis=1)
    v = np.repeat(v, group, axis=1)

    mask = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if unbatched:
            mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)[None]
        if mask.dtype != np.bool_:
            mask = mask.astype(f64)
    if key_mask is not None:
        km = np.asarray(key_mask, dtype=bool).reshape(B, 1, 1, Lk)
        if mask is None:
            mask = km
        elif mask.dtype == np.bool_:
            mask = mask & km
        else:
            mask = np.where(km, mask, -np.inf)
    o, w = scaled_dot_product_attention(q, k, v, mask, is_causal, scale,
                                        causal_alignment=causal_alignment,
                                        return_weights=True)
    o = o.transpose(0, 2, 1, 3).reshape(B, Lq, H * dh)
    out = lin(o, w_out, b_out)
    if average_weights:
        w = w.mean(axis=1)
    if unbatched:
        out, w = out[0], w[0]
    if return_weights:
        return out, w
    return out


# --------------------------------------------------------------------------
# Recurrent layers and the seq2seq decoder (issue 6): one sequence at a time,
# one time step at a time, gate by gate, in float64.

def _sig(x):
    return 1.0 / (1.0 + np.exp(-x))


def rnn_cell(mode, x, h, c, W_ih, W_hh, b_ih, b_hh, nonlinearity="tanh"):
    """One step of torch's RNN / GRU / LSTM for one vector x (in,), h (H,)."""
    x, h, W_ih, W_hh, b_ih, b_hh = _f64(x, h, W_ih, W_hh, b_ih, b_hh)
    H = h.shape[0]
    gi = W_ih @ x + (0 if b_ih is None else b_ih)
    gh = W_hh @ h + (0 if b_hh is None else b_hh)
    if mode == "RNN":
        s = gi + gh
        return (np.maximum(s, 0) if nonlinearity == "relu" else np.tanh(s)), None
    if mode == "GRU":
        r = _sig(gi[:H] + gh[:H])
        z = _sig(gi[H:2 * H] + gh[H:2 * H])
        n = np.tanh(gi[2 * H:] + r * gh[2 * H:])
        return (1 - z) * n + z * h, None
    i = _sig(gi[:H] + gh[:H])
    f = _sig(gi[H:2 * H] + gh[H:2 * H])
    g = np.tanh(gi[2 * H:3 * H] + gh[2 * H:3 * H])
    o = _sig(gi[3 * H:] + gh[3 * H:])
    c = f * np.asarray(c, np.float64) + i * g
    return o * np.tanh(c), c


def rnn(mode, params, x, num_layers, bidirectional, h0=None, c0=None, lengths=None,
        nonlinearity="tanh"):
    """Stacked / bidirectional RNN over x (B, T, E) with torch's parameter names;
    each sequence runs over its first lengths[b] steps only.  Returns
    (outputs (B, T, D*H) with zeros at padded steps, h_n (L*D, B, H), c_n or None)."""
    x = np.asarray(x, np.float64)
    B, T, _ = x.shape
    D = 2 if bidirectional else 1
    H = np.asarray(params["weight_hh_l0"]).shape[1]
    lengths = [T] * B if lengths is None else list(lengths)
    h_n = np.zeros((num_layers * D, B, H))
    c_n = np.zeros((num_layers * D, B, H))
    out = np.zeros((B, T, D * H))
    for b in range(B):
        n = lengths[b]
        inp = x[b, :n]
        for k in range(num_layers):
            layer_out = np.zeros((n, D * H))
            for d in range(D):
                sfx = "_reverse" if d else ""
                idx = k * D + d
                h = np.zeros(H) if h0 is None else np.asarray(h0, np.float64)[idx, b]
                c = np.zeros(H) if c0 is None else np.asarray(c0, np.float64)[idx, b]
                order = range(n - 1, -1, -1) if d else range(n)
                for t in order:
                    h, c = rnn_cell(mode, inp[t], h, c, params[f"weight_ih_l{k}{sfx}"],
                                    params[f"weight_hh_l{k}{sfx}"], params.get(f"bias_ih_l{k}{sfx}"),
                                    params.get(f"bias_hh_l{k}{sfx}"), nonlinearity)
                    layer_out[t, d * H:(d + 1) * H] = h
                h_n[idx, b] = h
                if c is not None:
                    c_n[idx, b] = c
            inp = layer_out
        out[b, :n] = inp
    return out, h_n, (c_n if mode == "LSTM" else None)


def attention_decoder(style, score_fn, emb, cell_mode, cell_params, out_W, out_b, memory,
                      memory_mask, tgt_in, h0, combine_W=None):
    """Teacher-forced attention decoder (one sequence, one step, one layer at a
    time).  score_fn(s (H,), memory (S, D)) -> (S,) scores.  Returns logits
    (B, T, V) and alignments (B, T, S)."""
    memory = np.asarray(memory, np.float64)
    B, S, _ = memory.shape
    T = np.asarray(tgt_in).shape[1]
    L = len([k for k in cell_params if k.startswith("weight_ih_l")])
    V = np.asarray(out_W).shape[0]
    logits = np.zeros((B, T, V))
    aligns = np.zeros((B, T, S))
    for b in range(B):
        real = np.ones(S, bool) if memory_mask is None else np.asarray(memory_mask)[b]
        hs = [np.asarray(h0[0] if cell_mode == "LSTM" else h0, np.float64)[k, b] for k in range(L)]
        cs = [np.asarray(h0[1], np.float64)[k, b] if cell_mode == "LSTM" else None for k in range(L)]

        def attend(s):
            sc = np.where(real, score_fn(s, memory[b]), -np.inf)
            if not real.any():
                return np.zeros(memory.shape[2]), np.zeros(S)
            a = np.exp(sc - sc.max())
            a = a / a.sum()
            return a @ memory[b], a

        for t in range(T):
            e = np.asarray(emb, np.float64)[int(tgt_in[b][t])]
            if style == "bahdanau":
                ctx, a = attend(hs[-1])
                inp = np.concatenate([e, ctx])
            else:
                inp = e
            for k in range(L):
                hs[k], cs[k] = rnn_cell(cell_mode, inp, hs[k], cs[k], cell_params[f"weight_ih_l{k}"],
                                        cell_params[f"weight_hh_l{k}"], cell_params.get(f"bias_ih_l{k}"),
                                        cell_params.get(f"bias_hh_l{k}"))
                inp = hs[k]
            if style == "bahdanau":
                top = hs[-1]
            else:
                ctx, a = attend(hs[-1])
                top = np.tanh(np.asarray(combine_W, np.float64) @ np.concatenate([ctx, hs[-1]]))
            logits[b, t] = np.asarray(out_W, np.float64) @ top + np.asarray(out_b, np.float64)
            aligns[b, t] = a
    return logits, aligns


# --- backward of multi-head attention

def multi_head_attention_backward(grad_out, query, key, value, *, num_heads, w_query, w_key,
                                  w_value, w_out, b_query=None, b_key=None, b_value=None,
                                  b_out=None, attn_mask=None, key_mask=None, is_causal=False,
                                  num_kv_heads=None, scale=None, causal_alignment="top_left"):
    """(dquery, dkey, dvalue, {weight name: gradient}) of the float64
    multi_head_attention above (separate weights), step by step: the output
    projection's backward, the attention's (the dense SDPA backward of this
    module, key/value heads repeated explicitly and their gradients summed
    back over the repeats), the input projections'."""
    f64 = np.float64
    q_in, k_in, v_in, g = (np.asarray(a, dtype=f64) for a in (query, key, value, grad_out))
    unbatched = q_in.ndim == 2
    if unbatched:
        q_in, k_in, v_in, g = q_in[None], k_in[None], v_in[None], g[None]
    B, Lq, E = q_in.shape
    Lk = k_in.shape[1]
    H = num_heads
    Hkv = H if num_kv_heads is None else num_kv_heads
    dh, group = E // H, H // Hkv
    W = {n: np.asarray(w, dtype=f64) for n, w in
         (("w_query", w_query), ("w_key", w_key), ("w_value", w_value), ("w_out", w_out))}

    def lin(x, w, b):
        y = x @ w.T
        return y if b is None else y + np.asarray(b, dtype=f64)

    q = lin(q_in, W["w_query"], b_query).reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    k = lin(k_in, W["w_key"], b_key).reshape(B, Lk, Hkv, dh).transpose(0, 2, 1, 3)
    v = lin(v_in, W["w_value"], b_value).reshape(B, Lk, Hkv, dh).transpose(0, 2, 1, 3)
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    mask = None
    if attn_mask is not None:
        mask = np.asarray(attn_mask)
        if unbatched:
            mask = mask.reshape((1,) * (3 - mask.ndim) + mask.shape)[None]
        if mask.dtype != np.bool_:
            mask = mask.astype(f64)
    if key_mask is not None:
        km = np.asarray(key_mask, dtype=bool).reshape(B, 1, 1, Lk)
        mask = km if mask is None else (mask & km if mask.dtype == np.bool_
                                        else np.where(km, mask, -np.inf))
    o = scaled_dot_product_attention(q, k, v, mask, is_causal, scale,
                                     causal_alignment=causal_alignment)
    o2 = o.transpose(0, 2, 1, 3).reshape(B, Lq, E)
    grads = {"w_out": np.einsum("blo,ble->oe", g, o2)}
    if b_out is not None:
        grads["b_out"] = g.sum(axis=(0, 1))
    do = (g @ W["w_out"]).reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    dq, dk, dv, _ = scaled_dot_product_attention_backward(
        do, q, k, v, mask, is_causal, scale, causal_alignment=causal_alignment)
    dk = dk.reshape(B, Hkv, group, Lk, dh).sum(axis=2)
    dv = dv.reshape(B, Hkv, group, Lk, dh).sum(axis=2)
    dQ = dq.transpose(0, 2, 1, 3).reshape(B, Lq, E)
    dK = dk.transpose(0, 2, 1, 3).reshape(B, Lk, Hkv * dh)
    dV = dv.transpose(0, 2, 1, 3).reshape(B, Lk, Hkv * dh)
    res = []
    for name, d, x, b in (("query", dQ, q_in, b_query), ("key", dK, k_in, b_key),
                          ("value", dV, v_in, b_value)):
        res.append(d @ W["w_" + name])
        grads["w_" + name] = np.einsum("bln,blc->nc", d, x)
        if b is not None:
            grads["b_" + name] = d.sum(axis=(0, 1))
    if unbatched:
        res = [r[0] for r in res]
    return res[0], res[1], res[2], grads


# --- backward of the RNN recurrence (rnn_scan)

def rnn_scan_backward(cell, grad_outputs, grad_h_n, xw, w_hh, b_hh, h0, c0=None, grad_c_n=None,
                      lengths=None, reverse=False, nonlinearity="tanh"):
    """(dxw, dw_hh, db_hh, dh0, dc0) of one layer and direction of torch's
    recurrence driven by given input projections xw (B, T, G*H), one sequence
    at a time, one step at a time: the forward keeps every step's state and
    gates, the backward walks the steps in the opposite order (cell: "RNN",
    "GRU" or "LSTM"; padded steps, t >= lengths[b], neither change the state
    nor get a gradient)."""
    xw, W, h0 = (np.asarray(a, np.float64) for a in (xw, w_hh, h0))
    B, T, GH = xw.shape
    H = W.shape[1]
    b = np.zeros(GH) if b_hh is None else np.asarray(b_hh, np.float64)
    lengths = [T] * B if lengths is None else [int(n) for n in lengths]
    dxw, dW, db = np.zeros_like(xw), np.zeros_like(W), np.zeros(GH)
    dh0, dc0 = np.zeros((B, H)), np.zeros((B, H))
    sig = _sig
    for s in range(B):
        order = list(range(lengths[s]))
        if reverse:
            order = order[::-1]
        h = h0[s].copy()
        c = np.zeros(H) if c0 is None else np.asarray(c0, np.float64)[s].copy()
        tape = []
        for t in order:
            gh = W @ h + b
            gi = xw[s, t]
            if cell == "RNN":
                a = gi + gh
                hn = np.maximum(a, 0) if nonlinearity == "relu" else np.tanh(a)
                tape.append((t, h, c, gh, hn))
                h = hn
            elif cell == "GRU":
                r = sig(gi[:H] + gh[:H])
                z = sig(gi[H:2 * H] + gh[H:2 * H])
                n = np.tanh(gi[2 * H:] + r * gh[2 * H:])
                tape.append((t, h, c, gh, (r, z, n)))
                h = (1 - z) * n + z * h
            else:
                a = gi + gh
                i, f, g, o = sig(a[:H]), sig(a[H:2 * H]), np.tanh(a[2 * H:3 * H]), sig(a[3 * H:])
                cn = f * c + i * g
                tape.append((t, h, c, gh, (i, f, g, o, cn)))
                c, h = cn, o * np.tanh(cn)
        dh = np.zeros(H) if grad_h_n is None else np.asarray(grad_h_n, np.float64)[s].copy()
        dc = np.zeros(H) if grad_c_n is None else np.asarray(grad_c_n, np.float64)[s].copy()
        for t, hp, cp, gh, st in reversed(tape):
            if grad_outputs is not None:
                dh = dh + np.asarray(grad_outputs, np.float64)[s, t]
            if cell == "RNN":
                da = dh * ((st > 0) if nonlinearity == "relu" else 1 - st ** 2)
                dgi = dgh = da
                dh_direct = 0
            elif cell == "GRU":
                r, z, n = st
                dan = dh * (1 - z) * (1 - n ** 2)
                daz = dh * (hp - n) * z * (1 - z)
                dar = dan * gh[2 * H:] * r * (1 - r)
                dgi = np.concatenate([dar, daz, dan])
                dgh = np.concatenate([dar, daz, dan * r])
                dh_direct = dh * z
            else:
                i, f, g, o, cn = st
                tcn = np.tanh(cn)
                dcn = dc + dh * o * (1 - tcn ** 2)
                dgi = dgh = np.concatenate([dcn * g * i * (1 - i), dcn * cp * f * (1 - f),
                                            dcn * i * (1 - g ** 2), dh * tcn * o * (1 - o)])
                dc = dcn * f
                dh_direct = 0
            dxw[s, t] = dgi
            dW += np.outer(dgh, hp)
            db += dgh
            dh = dh_direct + W.T @ dgh
        dh0[s], dc0[s] = dh, dc
    return dxw, dW, (None if b_hh is None else db), dh0, (dc0 if cell == "LSTM" else None)


# --- backward of linear and embedding
# y = x W^T + b and out = weight[ids], differentiated by hand from the dense
# math, in float64: einsum over the rows for linear, a one-hot matrix for the
# embedding (no scatter, no code shared with fastattn._linear / _embedding).

def linear_backward(grad_out, x, weight, bias=None):
    """(dx, dweight, dbias) of ``y = x W^T + b``, x (..., K), W (N, K):
    dx = g W, dW = sum over the rows of g^T x, db = sum over the rows of g
    (None without a bias)."""
    g = np.asarray(grad_out, dtype=np.float64)
    x = np.asarray(x, dtype=np.float64)
    w = np.asarray(weight, dtype=np.float64)
    rows = int(np.prod(x.shape[:-1]))   # every leading dim: one axis of rows
    g2 = g.reshape(rows, w.shape[0])
    x2 = x.reshape(rows, w.shape[1])
    dx = np.einsum("rn,nk->rk", g2, w).reshape(x.shape)
    dw = np.einsum("rn,rk->nk", g2, x2)
    db = None if bias is None else np.einsum("rn->n", g2)
    return dx, dw, db


def embedding_backward(grad_out, ids, num_embeddings, padding_idx=None):
    """dweight (num_embeddings, E) of ``out = weight[ids]``: ``onehot(ids)^T g``
    (each row the sum of the grad rows of its id), the padding_idx row zero."""
    ids = np.asarray(ids).reshape(-1)
    g = np.asarray(grad_out, dtype=np.float64)
    g = g.reshape(ids.size, g.shape[-1])
    onehot = (ids[:, None] == np.arange(num_embeddings)[None, :]).astype(np.float64)
    dw = onehot.T @ g
    if padding_idx is not None:
        dw[padding_idx] = 0.0
    return dw


# --- backward of attention with any similarity
# Dense float64 gradients of `attention` above, from the full (..., Lq, Lk[,
# d_a]) tensors.  Each score_*_vjp(q, k, ...) returns the scores S and a
# function dS -> (dq, dk, {param: dparam}) written from the score's own
# formula (dq, dk in the broadcast batch shape); attention_backward runs the
# softmax backward around it.  They share no code with fastattn.similarity.

def _esum(spec, *ops):
    """np.einsum(spec, *ops) summed over the leading (broadcast) dims of its output."""
    r = np.einsum(spec, *ops)
    n = len(spec.split("->")[1]) - 3
    return r.reshape((-1,) + r.shape[r.ndim - n:]).sum(axis=0) if n else r.sum()


def attention_backward(grad_out, query, key, value, score_vjp, attn_mask=None, is_causal=False,
                       *, causal_alignment="top_left"):
    """(dq, dk, dv, dparams) of `attention` in float64.

    score_vjp(q, k) -> (S, vjp) with vjp(dS) -> (dq, dk, dparams).  With
    P = softmax(masked S): dV = P^T dO, dP = dO V^T,
    dS = P o (dP - rowsum(P o dP)) (zero where P is), then the score's vjp;
    every gradient summed back to its input's shape.
    """
    q, k, v, g = _f64(query, key, value, grad_out)
    s, vjp = score_vjp(q, k)
    s = np.asarray(s, dtype=np.float64)
    p = softmax_rows(_mask_scores(s, attn_mask, is_causal, causal_alignment)[0])
    dv = np.matmul(np.swapaxes(p, -1, -2), g)
    dp = np.matmul(g, np.swapaxes(v, -1, -2))
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True))
    ds = np.where(p > 0, ds, 0.0)
    dq, dk, dparams = vjp(_reduce_to(ds, s.shape))  # a mask may add batch dims
    return _reduce_to(dq, q.shape), _reduce_to(dk, k.shape), _reduce_to(dv, v.shape), dparams


def score_dot_vjp(q, k, scale=1.0):
    """S = scale q_i . k_j: dq = scale dS k, dk = scale dS^T q, dscale = sum(dS o q k^T)."""
    q, k = _f64(q, k)
    qk = np.einsum("...ic,...jc->...ij", q, k)

    def vjp(ds):
        return (scale * np.einsum("...ij,...jc->...ic", ds, k),
                scale * np.einsum("...ij,...ic->...jc", ds, q),
                {"scale": np.sum(ds * qk)})
    return scale * qk, vjp


def score_general_vjp(q, k, W, scale=1.0):
    """S = scale q_i^T W k_j: dq = scale dS k W^T, dk = scale dS^T q W,
    dW = scale sum_ij dS_ij q_i k_j^T, dscale = sum(dS o q W k^T)."""
    q, k, W = _f64(q, k, W)
    qwk = np.einsum("...ia,ab,...jb->...ij", q, W, k)

    def vjp(ds):
        return (scale * np.einsum("...ij,ab,...jb->...ia", ds, W, k),
                scale * np.einsum("...ij,...ia,ab->...jb", ds, q, W),
                {"W": scale * _esum("...ij,...ia,...jb->...ab", ds, q, k),
                 "scale": np.sum(ds * qwk)})
    return scale * qwk, vjp


def score_additive_vjp(q, k, W_q, W_k, v, b=None, g=None):
    """S = v' . tanh(h_ij), h_ij = W_q q_i + W_k k_j + b, v' = v (or g v / |v|
    with g given).  With dh = dS v' (1 - tanh(h)^2): dq_i = sum_j W_q^T dh_ij,
    dk_j = sum_i W_k^T dh_ij, dW_q = sum dh_ij q_i^T, dW_k = sum dh_ij k_j^T,
    db = sum dh_ij, dv' = sum dS_ij tanh(h_ij); dv = J dv' with the Jacobian
    J = g (I / |v| - v v^T / |v|^3), dg = v . dv' / |v|."""
    q, k, W_q, W_k, v, b = _f64(q, k, W_q, W_k, v, b)
    veff = v if g is None else float(g) * v / np.linalg.norm(v)
    h = np.einsum("...ic,ac->...ia", q, W_q)[..., :, None, :] + \
        np.einsum("...jc,ac->...ja", k, W_k)[..., None, :, :]
    if b is not None:
        h = h + b
    t = np.tanh(h)

    def vjp(ds):
        dh = ds[..., None] * veff * (1.0 - t ** 2)
        dveff = _esum("...ij,...ija->...a", ds, t)
        grads = {"W_q": _esum("...ija,...ic->...ac", dh, q),
                 "W_k": _esum("...ija,...jc->...ac", dh, k),
                 "v": dveff}
        if b is not None:
            grads["b"] = dh.reshape(-1, dh.shape[-1]).sum(axis=0)
        if g is not None:
            n = np.linalg.norm(v)
            J = float(g) * (np.eye(v.shape[0]) / n - np.outer(v, v) / n ** 3)
            grads["v"] = J @ dveff
            grads["g"] = float(v @ dveff) / n
        return (np.einsum("...ija,ac->...ic", dh, W_q), np.einsum("...ija,ac->...jc", dh, W_k),
                grads)
    return np.einsum("...ija,a->...ij", t, veff), vjp


def score_concat_vjp(q, k, W, v, b=None):
    """S = v . tanh(W [q_i; k_j] + b), by explicit concatenation c_ij = [q_i; k_j]:
    dh = dS v (1 - tanh^2), dc_ij = W^T dh_ij, dq_i = sum_j dc_ij[:d_q],
    dk_j = sum_i dc_ij[d_q:], dW = sum dh_ij c_ij^T, db = sum dh_ij, dv = sum dS tanh."""
    q, k, W, v, b = _f64(q, k, W, v, b)
    Lq, Lk, d_q = q.shape[-2], k.shape[-2], q.shape[-1]
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    cat = np.concatenate([np.broadcast_to(q[..., :, None, :], batch + (Lq, Lk, d_q)),
                          np.broadcast_to(k[..., None, :, :], batch + (Lq, Lk, k.shape[-1]))],
                         axis=-1)
    h = np.einsum("...ijc,ac->...ija", cat, W)
    if b is not None:
        h = h + b
    t = np.tanh(h)

    def vjp(ds):
        dh = ds[..., None] * v * (1.0 - t ** 2)
        dc = np.einsum("...ija,ac->...ijc", dh, W)
        grads = {"W": _esum("...ija,...ijc->...ac", dh, cat),
                 "v": _esum("...ij,...ija->...a", ds, t)}
        if b is not None:
            grads["b"] = dh.reshape(-1, dh.shape[-1]).sum(axis=0)
        return dc[..., :d_q].sum(axis=-2), dc[..., d_q:].sum(axis=-3), grads
    return np.einsum("...ija,a->...ij", t, v), vjp


def score_cosine_vjp(q, k, beta=1.0, eps=1e-12):
    """S = beta c_ij / (n_i m_j), c = q k^T, n_i = max(|q_i|, eps), m_j = max(|k_j|, eps).
    dc = beta dS / (n m); through the norms dn_i = -sum_j dS_ij S_ij / n_i and
    d|q_i|/dq_i = q_i / |q_i| where |q_i| >= eps (else the norm is constant):
    dq_i = sum_j dc_ij k_j + dn_i q_i / |q_i|; likewise dk; dbeta = sum(dS o c / (n m))."""
    q, k = _f64(q, k)
    rq, rk = np.linalg.norm(q, axis=-1), np.linalg.norm(k, axis=-1)
    nq, nk = np.maximum(rq, eps), np.maximum(rk, eps)
    cos = np.einsum("...ic,...jc->...ij", q, k) / (nq[..., :, None] * nk[..., None, :])
    s = beta * cos

    def vjp(ds):
        dc = beta * ds / (nq[..., :, None] * nk[..., None, :])
        dnq = -np.sum(ds * s, axis=-1) / nq
        dnk = -np.sum(ds * s, axis=-2) / nk
        with np.errstate(divide="ignore", invalid="ignore"):
            uq = np.where((rq >= eps)[..., None], q / rq[..., None], 0.0)
            uk = np.where((rk >= eps)[..., None], k / rk[..., None], 0.0)
        dq = np.einsum("...ij,...jc->...ic", dc, k) + dnq[..., None] * uq
        dk = np.einsum("...ij,...ic->...jc", dc, q) + dnk[..., None] * uk
        return dq, dk, {"beta": np.sum(ds * cos)}
    return s, vjp


def score_neg_sq_dist_vjp(q, k, gamma=1.0):
    """S = -gamma |q_i - k_j|^2: dq_i = -2 gamma sum_j dS_ij (q_i - k_j),
    dk_j = 2 gamma sum_i dS_ij (q_i - k_j), dgamma = -sum dS_ij |q_i - k_j|^2."""
    q, k = _f64(q, k)
    diff = q[..., :, None, :] - k[..., None, :, :]
    sq = np.sum(diff * diff, axis=-1)

    def vjp(ds):
        w = ds[..., None] * diff
        return -2 * gamma * w.sum(axis=-2), 2 * gamma * w.sum(axis=-3), {"gamma": -np.sum(ds * sq)}
    return -gamma * sq, vjp


def score_neg_l1_vjp(q, k, gamma=1.0):
    """S = -gamma sum_c |q_ic - k_jc|: dq_i = -gamma sum_j dS_ij sign(q_i - k_j),
    dk_j = gamma sum_i dS_ij sign(q_i - k_j), dgamma = -sum dS_ij |q_i - k_j|_1
    (sign(0) = 0)."""
    q, k = _f64(q, k)
    diff = q[..., :, None, :] - k[..., None, :, :]
    l1 = np.sum(np.abs(diff), axis=-1)

    def vjp(ds):
        w = ds[..., None] * np.sign(diff)
        return -gamma * w.sum(axis=-2), gamma * w.sum(axis=-3), {"gamma": -np.sum(ds * l1)}
    return -gamma * l1, vjp


# --- layer_norm, activations, dropout (the training blocks)
# Written from the definitions in float64, sharing no code with
# fastattn._norm: the layer_norm backward is the explicit (E, E) Jacobian of
# each row (dy_i/dx_j), contracted with the upstream gradient; the GELU is
# x * ndtr(x) (the normal CDF, not erf), its tanh form x * sigmoid(2u).

def _as64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def layer_norm(x, weight=None, bias=None, eps=1e-5):
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis, the
    variance biased (over E)."""
    x, w, b = _as64(x), _as64(weight), _as64(bias)
    E = x.shape[-1]
    rows = x.reshape(-1, E)
    mu = rows.sum(axis=1, keepdims=True) / E if E else np.zeros((rows.shape[0], 1))
    var = ((rows - mu) ** 2).sum(axis=1, keepdims=True) / E if E else np.zeros((rows.shape[0], 1))
    y = (rows - mu) / np.sqrt(var + eps)
    if w is not None:
        y = y * w[None, :]
    if b is not None:
        y = y + b[None, :]
    return y.reshape(x.shape)


def layer_norm_jacobian(x, weight=None, eps=1e-5):
    """(rows, E, E): J[r, i, j] = d y[r, i] / d x[r, j] of layer_norm, from
    x̂_i = (x_i - μ) σ⁻¹ with σ = sqrt(var + eps):
    d x̂_i / d x_j = σ⁻¹ (δ_ij - 1/E) - σ⁻³ (x_i - μ)(x_j - μ) / E, times weight_i."""
    x, w = _as64(x), _as64(weight)
    E = x.shape[-1]
    rows = x.reshape(-1, E)
    n = rows.shape[0]
    if E == 0:
        return np.zeros((n, 0, 0))
    mu = rows.mean(axis=1)
    xc = rows - mu[:, None]
    sigma = np.sqrt((xc ** 2).mean(axis=1) + eps)
    eye = np.eye(E)
    J = (eye[None] - 1.0 / E) / sigma[:, None, None] \
        - np.einsum("ri,rj->rij", xc, xc) / (E * sigma[:, None, None] ** 3)
    if w is not None:
        J = J * w[None, :, None]
    return J


def layer_norm_backward(grad_out, x, weight=None, bias=None, eps=1e-5):
    """(dx, dweight, dbias): dx_j = Σ_i g_i J_ij (the explicit Jacobian),
    dweight = Σ_rows g x̂, dbias = Σ_rows g (None when absent)."""
    x = _as64(x)
    E = x.shape[-1]
    g = _as64(grad_out).reshape(-1, E)
    J = layer_norm_jacobian(x, weight, eps)
    dx = np.einsum("ri,rij->rj", g, J).reshape(x.shape)
    xhat = layer_norm(x, None, None, eps).reshape(-1, E)
    dw = None if weight is None else np.einsum("ri,ri->i", g, xhat)
    db = None if bias is None else np.einsum("ri->i", g)
    return dx, dw, db


_GELU_C = np.sqrt(2.0 / np.pi)


def gelu(x, approximate="none"):
    """x Φ(x) (Φ = scipy.special.ndtr), or x sigmoid(2 √(2/π) (x + 0.044715 x³))
    (= 0.5 x (1 + tanh(...)))."""
    from scipy import special
    x = _as64(x)
    if approximate == "tanh":
        return x * special.expit(2.0 * _GELU_C * (x + 0.044715 * x ** 3))
    return x * special.ndtr(x)


def gelu_backward(grad_out, x, approximate="none"):
    """g * d gelu / dx: Φ(x) + x φ(x) (φ the normal density), or with
    s = sigmoid(2u): s + x 2 s (1 - s) u'(x), u' = √(2/π) (1 + 3 0.044715 x²)."""
    from scipy import special
    x, g = _as64(x), _as64(grad_out)
    if approximate == "tanh":
        s = special.expit(2.0 * _GELU_C * (x + 0.044715 * x ** 3))
        d = s + x * 2.0 * s * (1.0 - s) * _GELU_C * (1.0 + 3.0 * 0.044715 * x ** 2)
    else:
        d = special.ndtr(x) + x * np.exp(-x * x / 2.0) / np.sqrt(2.0 * np.pi)
    return g * d


def relu(x):
    """x where x > 0, 0 elsewhere; NaN stays NaN."""
    x = _as64(x)
    return np.where(np.isnan(x), x, np.where(x > 0, x, 0.0))


def relu_backward(grad_out, x):
    """0 where x <= 0 (the gradient at 0 is 0), else g -- a NaN x passes g
    (torch's threshold_backward)."""
    return np.where(_as64(x) <= 0, 0.0, _as64(grad_out))


def dropout_backward(grad_out, keep, p):
    """g / (1 - p) where kept, 0 where dropped."""
    return np.where(np.asarray(keep, dtype=bool), _as64(grad_out) / (1.0 - p), 0.0)


# --- losses (fastattn.losses), with torch's semantics
# Each returns (loss, grad) as fastattn.losses does: loss a float for "mean" /
# "sum", a float64 array for "none" (grad then that of loss.sum()).  The
# cross-entropy gradient is the explicit log-softmax Jacobian
# d log p_c / d z_j = δ_cj - p_j contracted with the target weights a_c
# (loss = -Σ_c a_c log p_c); BCE from log σ(x) = -logaddexp(0, -x).

def _reduce_loss(per, reduction, denom):
    if reduction == "none":
        return per, 1.0
    total = float(np.sum(per))
    if reduction == "sum":
        return total, 1.0
    return (total / denom if denom != 0 else float("nan")), (1.0 / denom if denom != 0 else 0.0)


def cross_entropy(logits, targets, *, ignore_index=-100, label_smoothing=0.0, weight=None,
                  reduction="mean"):
    """torch.nn.functional.cross_entropy and d(loss)/d(logits), in float64.

    Class axis 1 (0 for 1-d logits).  Per sample, the class weights a_c:
    class indices y: a_c = (1 - ε) w_y [c = y] + (ε / C) w_c (0 if y is
    ignored), "mean" dividing by Σ w_y over the non-ignored samples;
    probabilities t: a_c = w_c ((1 - ε) t_c + ε / C), "mean" dividing by the
    number of samples."""
    z = _as64(logits)
    t = np.asarray(targets)
    one = z.ndim == 1
    if one:
        z, t = z[None], t[None]
    C = z.shape[1]
    zl = np.moveaxis(z, 1, -1)                       # (N, d..., C)
    lead = zl.shape[:-1]
    zr = zl.reshape(-1, C)
    w = np.ones(C) if weight is None else _as64(weight)
    eps = float(label_smoothing)
    m = zr.max(axis=1, keepdims=True) if zr.shape[0] else np.zeros((0, 1))
    logp = zr - m - np.log(np.exp(zr - m).sum(axis=1, keepdims=True))
    p = np.exp(logp)
    if t.dtype.kind == "f":
        tr = np.moveaxis(_as64(t), 1, -1).reshape(-1, C)
        a = w[None, :] * ((1.0 - eps) * tr + eps / C)
        denom = float(zr.shape[0])
    else:
        tr = t.reshape(-1).astype(np.int64)
        valid = tr != ignore_index
        onehot = (np.where(valid, tr, -1)[:, None] == np.arange(C)[None, :]).astype(np.float64)
        wy = onehot @ w
        a = (1.0 - eps) * wy[:, None] * onehot + (eps / C) * w[None, :] * valid[:, None]
        denom = float(np.sum(wy))
    per = -np.sum(a * logp, axis=1)
    jac = np.eye(C)[None] - p[:, None, :]           # (n, c, j): δ_cj - p_j
    grad = -np.einsum("nc,ncj->nj", a, jac)
    loss, scale = _reduce_loss(per.reshape(lead), reduction, denom)
    grad = np.moveaxis((grad * scale).reshape(lead + (C,)), -1, 1)
    if one:
        grad = grad[0]
        if reduction == "none":
            loss = loss[0]
    return loss, grad


def binary_cross_entropy_with_logits(logits, targets, *, weight=None, pos_weight=None,
                                     reduction="mean"):
    """-w (pw y log σ(x) + (1 - y) log(1 - σ(x))) elementwise; "mean" over all
    elements; d/dx = w ((1 - y) σ(x) - pw y (1 - σ(x)))."""
    from scipy import special
    x, y = _as64(logits), _as64(targets)
    w = np.ones_like(x) if weight is None else np.broadcast_to(_as64(weight), x.shape)
    pw = np.ones_like(x) if pos_weight is None else np.broadcast_to(_as64(pos_weight), x.shape)
    log_sig = -np.logaddexp(0.0, -x)
    log_one_minus_sig = -np.logaddexp(0.0, x)
    per = -w * (pw * y * log_sig + (1.0 - y) * log_one_minus_sig)
    s = special.expit(x)
    grad = w * ((1.0 - y) * s - pw * y * (1.0 - s))
    loss, scale = _reduce_loss(per, reduction, float(x.size))
    return loss, grad * scale


def mse(pred, target, *, reduction="mean"):
    """(pred - target)² elementwise, "mean" over all elements; d/dpred = 2 (pred - target)."""
    d = _as64(pred) - _as64(target)
    loss, scale = _reduce_loss(d * d, reduction, float(d.size))
    return loss, 2.0 * d * scale
