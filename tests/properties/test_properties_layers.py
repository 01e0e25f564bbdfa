"""Hypothesis properties of the layers that expose attention weights:
``layers.Attention`` and ``layers.SelfAttention`` (every built-in similarity,
attn_mask / key_mask, causal alignments, unbatched inputs) and the seq2seq
``AttentionDecoder``'s alignments (Bahdanau and Luong, GRU / LSTM / RNN cells).

Oracles: the projections and ``fastattn._reference.attention`` for the
attention layers, ``fastattn._reference.attention_decoder`` for the decoder.
Properties as in test_properties_all.py; for the decoder (whose scores have
no float mask): alignments are distributions over the real source tokens,
permuting the memory (with its mask) permutes the alignments and leaves the
logits unchanged, padded memory has no influence, a step does not see later
target tokens, float32 agrees with float64.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastattn import _reference as R
from fastattn.layers import Attention, AttentionDecoder, SelfAttention

from support import (F32, F64, assert_agree, assert_all_close, check_causal_rows,
                    check_float32_and_float64_agree, check_kv_permutation, check_padded_keys,
                    check_row_constant_invariance, f32, random_mask)
from support import allowed_matrix, assert_close, check_weights, prop_settings
from test_layers_attention import SIMS, ref_score

OPS = [f"attention/{s}" for s in SIMS] + [f"self/{s}" for s in SIMS]


def _load(layer, rng):
    """Non-trivial float32-representable parameters (biases start at zero)."""
    sd = layer.state_dict()
    new = {k: f32(np.asarray(v, np.float64) + 0.3 * rng.standard_normal(np.shape(v)))
           for k, v in sd.items()}
    layer.load_state_dict(new)
    return new


@st.composite
def problems(draw, op, *, causal=None, key_mask=None):
    kind, sim = op.split("/")
    dtype = draw(st.sampled_from([F32, F64]))
    is_self = kind == "self"
    qd = draw(st.integers(1, 6))
    kd = qd if is_self else draw(st.integers(1, 6))
    vd = kd if is_self else draw(st.integers(1, 6))
    emb = qd if is_self else draw(st.integers(1, 8))
    batched = draw(st.booleans())
    B = draw(st.integers(1, 3)) if batched else 1
    Lq = draw(st.one_of(st.integers(1, 9), st.sampled_from([1, 70])))
    Lk = Lq if is_self else draw(st.one_of(st.integers(1, 9), st.sampled_from([1, 130])))
    is_causal = draw(st.booleans()) if causal is None else causal
    cfg = dict(similarity=sim, out_dim=draw(st.integers(1, 5)), attn_dim=draw(st.integers(1, 7)),
               bias=draw(st.booleans()), seed=0)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    bs = (B,) if batched else ()
    q = f32(rng.standard_normal(bs + (Lq, qd)))
    k = q if is_self else f32(rng.standard_normal(bs + (Lk, kd)))
    v = k if is_self or (vd == kd and draw(st.booleans())) else f32(rng.standard_normal(bs + (Lk, vd)))
    m = None
    mkind = draw(st.sampled_from(["none", "bool", "float"]))
    if mkind != "none":
        shape = draw(st.sampled_from([(Lq, Lk), (1, Lk)] + ([(B, Lq, Lk)] if batched else [])))
        m = random_mask(draw, rng, mkind, shape, [0.2, 0.7, 0.95])
    km = None
    if key_mask or key_mask is None and draw(st.booleans()):
        km = rng.random(bs + (Lk,)) < draw(st.sampled_from([0.4, 0.9, 1.0]))
    c = dict(op=op, sim=sim, self=is_self, dtype=dtype, cfg=cfg, dims=(qd, kd, vd, emb),
             batched=batched, B=B, Lq=Lq, Lk=Lk, q=q, k=k, v=v, m=m, km=km, causal=is_causal,
             align="top_left" if is_self else draw(st.sampled_from(["top_left", "bottom_right"])),
             rng=rng)
    c["params"] = _load(_make(c, F64), rng)
    return c


def _make(c, dt):
    qd, kd, vd, emb = c["dims"]
    if c["self"]:
        return SelfAttention(qd, causal=c["causal"], dtype=dt, **c["cfg"])
    return Attention(qd, kd, vd, embed_dim=emb, dtype=dt, **c["cfg"])


def run(c, *, weights=False, dtype=None):
    dt = c["dtype"] if dtype is None else np.dtype(dtype)
    layer = _make(c, dt)
    layer.load_state_dict(c["params"])
    m = c["m"] if c["m"] is None or c["m"].dtype == np.bool_ else c["m"].astype(dt)
    kw = dict(attn_mask=m, key_mask=c["km"], return_weights=weights)
    q = c["q"].astype(dt)
    if c["self"]:
        return layer(q, **kw)
    k = c["k"].astype(dt)
    v = k if c["v"] is c["k"] else c["v"].astype(dt)
    return layer(q, k, v, is_causal=c["causal"], causal_alignment=c["align"], **kw)


def _mask(c):
    """attn_mask and key_mask as one mask for the oracle ((B,) Lq, Lk)."""
    m, km = c["m"], c["km"]
    if km is None:
        return m
    km = km[..., None, :]
    if m is None:
        return km
    if m.dtype == np.bool_:
        return m & km
    return np.where(km, m, -np.inf)


def oracle(c):
    sd = c["params"]
    proj = lambda x, n: x @ sd[f"W_{n}"].T + sd.get(f"b_{n}", 0)  # noqa: E731
    q, k, v = proj(c["q"], "Q"), proj(c["k"], "K"), proj(c["v"], "V")
    p = {kk[4:]: vv for kk, vv in sd.items() if kk.startswith("sim.")}
    return R.attention(q, k, v, ref_score(c["sim"], p, q.shape[-1]), _mask(c), c["causal"],
                       causal_alignment=c["align"], return_weights=True)


def allowed(c):
    a = allowed_matrix(c["Lq"], c["Lk"], _mask(c), c["causal"], c["align"])
    return np.broadcast_to(a, ((c["B"],) if c["batched"] else ()) + (c["Lq"], c["Lk"]))


# --------------------------------------------------------------------------
# Attention, SelfAttention

@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data())
def test_layer_matches_oracle_and_weights_are_distributions(op, data):
    c = data.draw(problems(op))
    dt = c["dtype"]
    out, w = run(c, weights=True)
    r_out, r_w = oracle(c)
    assert_all_close((out, w), (r_out, r_w), dt)
    ok = allowed(c)
    check_weights(w, ok, dt)
    assert np.all(out[~ok.any(-1)] == 0)
    assert_close(run(c), r_out, dt)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data(), c_max=st.sampled_from([1.0, 10.0, 40.0]))
def test_layer_invariant_to_a_constant_added_to_each_score_row(op, data, c_max):
    c = data.draw(problems(op))
    shape = ((c["B"],) if c["batched"] else ()) + (c["Lq"], c["Lk"])
    check_row_constant_invariance(run, c, shape, c_max)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_layer_key_value_permutation(op, data):
    """Attention: unchanged output; SelfAttention (not causal): rows permuted."""
    c = data.draw(problems(op, causal=False))
    check_kv_permutation(run, c)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data(), weights=st.booleans())
def test_layer_causal_rows_do_not_see_later_keys(op, data, weights):
    c = data.draw(problems(op, causal=True))
    check_causal_rows(run, oracle, c, data.draw(st.integers(0, c["Lk"] - 1)), weights)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data(), weights=st.booleans())
def test_layer_padded_keys_have_no_influence(op, data, weights):
    c = data.draw(problems(op, key_mask=True))
    check_padded_keys(run, oracle, c, weights)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.4)
@given(data=st.data())
def test_layer_float32_and_float64_agree(op, data):
    c = data.draw(problems(op))
    check_float32_and_float64_agree(lambda dt: run(c, weights=True, dtype=dt))


# --------------------------------------------------------------------------
# AttentionDecoder

DEC_SIMS = ["additive", "concat", "general", "dot", "scaled_dot", "cosine"]
_CELLS = {"gru": "GRU", "lstm": "LSTM", "rnn": "RNN"}
VOCAB = 7


@st.composite
def decoder_problems(draw, style, *, all_real=False):
    sim = draw(st.sampled_from(DEC_SIMS))
    cell = draw(st.sampled_from(sorted(_CELLS)))
    H = draw(st.integers(1, 5))
    D = H if sim in ("dot", "scaled_dot", "cosine") else draw(st.integers(1, 5))
    L = draw(st.integers(1, 2))
    B = draw(st.integers(1, 3))
    S = draw(st.one_of(st.integers(1, 7), st.just(130)))
    T = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    E, d_a = draw(st.integers(1, 4)), draw(st.integers(1, 6))
    dec = AttentionDecoder(VOCAB, E, H, D, style=style, similarity=sim, attn_dim=d_a, cell=cell,
                           num_layers=L, seed=0, dtype=np.float64)
    params = _load(dec, rng)
    mem = f32(rng.standard_normal((B, S, D)))
    mask = None
    if not all_real and draw(st.booleans()):
        mask = rng.random((B, S)) < draw(st.sampled_from([0.5, 0.9]))
        if draw(st.booleans()):
            mask[rng.integers(0, B)] = False  # a source with no real token
    tgt = rng.integers(0, VOCAB, (B, T))
    h = f32(0.5 * rng.standard_normal((L, B, H)))
    state = (h, f32(0.5 * rng.standard_normal((L, B, H)))) if cell == "lstm" else h
    return dict(style=style, sim=sim, cell=cell, H=H, params=params, mem=mem, mask=mask, tgt=tgt,
                state=state, rng=rng, dtype=draw(st.sampled_from([F32, F64])), L=L, D=D, E=E, d_a=d_a)


def run_decoder(c, dtype=None):
    """Teacher-forced decoder in ``dtype`` with the case's parameters: (logits, alignments)."""
    dt = c["dtype"] if dtype is None else np.dtype(dtype)
    dec = AttentionDecoder(VOCAB, c["E"], c["H"], c["D"], style=c["style"], similarity=c["sim"],
                           attn_dim=c["d_a"], cell=c["cell"], num_layers=c["L"], seed=0, dtype=dt)
    dec.load_state_dict(c["params"])
    st_ = c["state"]
    state = tuple(s.astype(dt) for s in st_) if isinstance(st_, tuple) else st_.astype(dt)
    memory = dec.precompute(c["mem"].astype(dt), c["mask"])
    logits, _, aligns = dec.forward(c["tgt"], state, memory)
    return logits, aligns


def decoder_oracle(c, **over):
    c = dict(c, **over)
    sd = c["params"]
    p = {k[5:]: v for k, v in sd.items() if k.startswith("attn.")}
    score1 = ref_score(c["sim"], p, c["H"])
    cp = {k[4:]: v for k, v in sd.items() if k.startswith("rnn.")}
    return R.attention_decoder(c["style"], lambda s, mem: score1(s[None], mem)[0],
                               sd["embedding.weight"], _CELLS[c["cell"]], cp, sd["out.weight"],
                               sd["out.bias"], c["mem"], c["mask"], c["tgt"], c["state"],
                               sd.get("combine.weight"))


def _real(c):
    B, S = c["mem"].shape[:2]
    return np.ones((B, S), bool) if c["mask"] is None else c["mask"]


STYLES = ["bahdanau", "luong"]


@pytest.mark.parametrize("style", STYLES)
@prop_settings(0.5)
@given(data=st.data())
def test_decoder_matches_oracle_and_alignments_are_distributions(style, data):
    c = data.draw(decoder_problems(style))
    dt = c["dtype"]
    logits, al = run_decoder(c)
    r_logits, r_al = decoder_oracle(c)
    assert_all_close((logits, al), (r_logits, r_al), dt)
    check_weights(al, _real(c)[:, None, :], dt)


@pytest.mark.parametrize("style", STYLES)
@prop_settings(0.4)
@given(data=st.data())
def test_decoder_memory_permutation(style, data):
    """Permuting the source positions (memory and mask) permutes the
    alignments and leaves the logits unchanged."""
    c = data.draw(decoder_problems(style))
    perm = c["rng"].permutation(c["mem"].shape[1])
    c2 = dict(c, mem=c["mem"][:, perm], mask=None if c["mask"] is None else c["mask"][:, perm])
    (la, aa), (lb, ab) = run_decoder(c), run_decoder(c2)
    assert_agree(lb, la, c["dtype"])
    assert_agree(ab, aa[..., perm], c["dtype"])


@pytest.mark.parametrize("style", STYLES)
@prop_settings(0.4)
@given(data=st.data())
def test_decoder_padded_memory_has_no_influence(style, data):
    c = data.draw(decoder_problems(style))
    mask = _real(c).copy()
    mask[:, c["rng"].integers(0, mask.shape[1])] = False
    c = dict(c, mask=mask)
    mem2 = c["mem"].copy()
    mem2[~mask] = f32(3.0 * c["rng"].standard_normal(mem2[~mask].shape))
    (la, aa), (lb, ab) = run_decoder(c), run_decoder(dict(c, mem=mem2))
    np.testing.assert_array_equal(la, lb)
    np.testing.assert_array_equal(aa, ab)
    assert np.all(aa[~np.broadcast_to(mask[:, None, :], aa.shape)] == 0)


@pytest.mark.parametrize("style", STYLES)
@prop_settings(0.4)
@given(data=st.data())
def test_decoder_steps_do_not_see_later_targets(style, data):
    c = data.draw(decoder_problems(style))
    T = c["tgt"].shape[1]
    t = data.draw(st.integers(0, T - 1))
    tgt2 = c["tgt"].copy()
    tgt2[:, t:] = (tgt2[:, t:] + 1 + c["rng"].integers(0, VOCAB - 1, tgt2[:, t:].shape)) % VOCAB
    (la, aa), (lb, ab) = run_decoder(c), run_decoder(dict(c, tgt=tgt2))
    np.testing.assert_array_equal(la[:, :t], lb[:, :t])
    np.testing.assert_array_equal(aa[:, :t], ab[:, :t])


@pytest.mark.parametrize("style", STYLES)
@prop_settings(0.3)
@given(data=st.data())
def test_decoder_float32_and_float64_agree(style, data):
    c = data.draw(decoder_problems(style))
    check_float32_and_float64_agree(lambda dt: run_decoder(c, dt), factor=2.0)
