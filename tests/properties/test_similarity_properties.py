"""Hypothesis properties of fastattn.attention with the non-dot similarities
(profile: see docs/testing.md): agreement with the oracle,
weights that sum to 1 over allowed keys, causality."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import fastattn
import fastattn.testing
from fastattn import _reference as R

from support import allowed_matrix, assert_close, check_weights, prop_settings

# 40 examples under the ci profile (2 x its base), 25x that under long
SETTINGS = prop_settings(2, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    sim = draw(st.sampled_from(["additive", "additive_b", "concat", "compiled"]))
    B = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 80))
    Lk = draw(st.one_of(st.integers(1, 40), st.sampled_from([127, 128, 129, 300])))
    d_q = draw(st.integers(1, 12))
    d_k = d_q if sim == "compiled" else draw(st.integers(1, 12))
    d_a = draw(st.integers(1, 20))
    dv = draw(st.integers(1, 6))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    causal = draw(st.booleans())
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = rng.standard_normal((B, Lq, d_q)).astype(dtype)
    k = rng.standard_normal((B, Lk, d_k)).astype(dtype)
    v = rng.standard_normal((B, Lk, dv)).astype(dtype)
    m = None
    if mask_kind == "bool":
        m = rng.random((B, Lq, Lk)) < draw(st.sampled_from([0.05, 0.5, 0.95]))
    elif mask_kind == "float":
        m = rng.standard_normal((B, Lq, Lk)).astype(dtype)
        m[rng.random(m.shape) < 0.2] = -np.inf
    if sim == "compiled":
        s, P = fastattn.testing.selftest_similarity(), {"gamma": 0.2}
        ref = lambda a, b: R.score_neg_sq_dist(a, b, float(dtype(0.2)))  # noqa: E731
    elif sim == "concat":
        P = fastattn.get_similarity("concat").init_params(d_q, d_k, d_a=d_a, rng=rng, dtype=dtype)
        P["b"] = rng.standard_normal(d_a).astype(dtype)
        s = "concat"
        ref = lambda a, b: R.score_concat(a, b, P["W"], P["v"], P["b"])  # noqa: E731
    else:
        P = fastattn.get_similarity("additive").init_params(d_q, d_k, d_a=d_a, rng=rng, dtype=dtype)
        if sim == "additive_b":
            P["b"] = rng.standard_normal(d_a).astype(dtype)
        s = "additive"
        ref = lambda a, b: R.score_additive(a, b, P["W_q"], P["W_k"], P["v"], P.get("b"))  # noqa: E731
    return dict(q=q, k=k, v=v, m=m, causal=causal, align=align, dtype=dtype, sim=s, P=P, ref=ref)


@SETTINGS
@given(problems())
def test_matches_oracle_and_weights_sum_to_one(p):
    kw = dict(params=p["P"], attn_mask=p["m"], is_causal=p["causal"], causal_alignment=p["align"])
    out, w = fastattn.attention(p["q"], p["k"], p["v"], p["sim"], return_weights=True, **kw)
    ref, ref_w = R.attention(p["q"], p["k"], p["v"], p["ref"], p["m"], p["causal"],
                             causal_alignment=p["align"], return_weights=True)
    assert_close(out, ref, p["dtype"])
    assert_close(w, ref_w, p["dtype"])
    Lq, Lk = p["q"].shape[-2], p["k"].shape[-2]
    check_weights(w, allowed_matrix(Lq, Lk, p["m"], p["causal"], p["align"]), p["dtype"])
    streamed = fastattn.attention(p["q"], p["k"], p["v"], p["sim"], **kw)
    assert_close(streamed, ref, p["dtype"])


@SETTINGS
@given(problems())
def test_causality(p):
    """With is_causal, changing keys/values beyond a query's limit leaves its row unchanged."""
    q, k, v = p["q"], p["k"].copy(), p["v"].copy()
    Lq, Lk = q.shape[-2], k.shape[-2]
    kw = dict(params=p["P"], is_causal=True, causal_alignment="top_left")
    a = fastattn.attention(q, k, v, p["sim"], **kw)
    cut = min(Lq, Lk)
    k[:, cut:] = 7.0
    v[:, cut:] = -3.0
    b = fastattn.attention(q, k, v, p["sim"], **kw)
    np.testing.assert_array_equal(a[:, :cut], b[:, :cut])
