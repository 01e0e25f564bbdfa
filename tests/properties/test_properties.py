"""Hypothesis properties (budget and randomness from the hypothesis profile, see docs/testing.md)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import fastattn
from support import allowed_matrix, assert_close, check_weights, oracle, prop_settings, tol

sdpa = fastattn.scaled_dot_product_attention

# 40 examples under the ci profile (2 x its base), 25x that under long
SETTINGS = prop_settings(2, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    B = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 40))
    Lk = draw(st.one_of(st.integers(1, 40), st.sampled_from([255, 256, 257, 513, 700, 1025])))
    d = draw(st.integers(1, 16))
    dv = draw(st.integers(1, 9))
    seed = draw(st.integers(0, 2**32 - 1))
    mask_kind = draw(st.sampled_from(["none", "bool", "float"]))
    causal = draw(st.booleans())
    align = draw(st.sampled_from(["top_left", "bottom_right"]))
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Lq, d)).astype(dtype)
    k = rng.standard_normal((B, Lk, d)).astype(dtype)
    v = rng.standard_normal((B, Lk, dv)).astype(dtype)
    m = None
    if mask_kind == "bool":
        m = rng.random((B, Lq, Lk)) < draw(st.sampled_from([0.05, 0.5, 0.95]))
    elif mask_kind == "float":
        m = rng.standard_normal((B, Lq, Lk)).astype(dtype)
        m[rng.random(m.shape) < 0.2] = -np.inf
    return dict(q=q, k=k, v=v, m=m, causal=causal, align=align, dtype=dtype, rng=rng)


def _call(p, **kw):
    return sdpa(p["q"], p["k"], p["v"], p["m"], p["causal"], causal_alignment=p["align"], **kw)


@SETTINGS
@given(problems())
def test_matches_oracle_and_weights_are_a_distribution(p):
    o, w = _call(p, return_weights=True)
    ref_o, ref_w = oracle(p["q"], p["k"], p["v"], p["m"], p["causal"], causal_alignment=p["align"],
                          return_weights=True)
    assert_close(o, ref_o, p["dtype"])
    assert_close(w, ref_w, p["dtype"])
    Lq, Lk = p["q"].shape[-2], p["k"].shape[-2]
    check_weights(w, allowed_matrix(Lq, Lk, p["m"], p["causal"], p["align"]), p["dtype"])
    # the output is the weights applied to the values
    assert_close(o, np.matmul(w.astype(np.float64), p["v"].astype(np.float64)), p["dtype"])
    # and the weights-free (streaming for long keys) path agrees
    assert_close(_call(p), ref_o, p["dtype"])


@SETTINGS
@given(problems())
def test_key_permutation_invariance(p):
    if p["causal"]:
        p["causal"] = False  # causality is not permutation invariant
    perm = p["rng"].permutation(p["k"].shape[-2])
    p2 = dict(p, k=p["k"][:, perm], v=p["v"][:, perm], m=None if p["m"] is None else p["m"][..., perm])
    a, b = _call(p), _call(p2)
    rtol, atol = tol(p["dtype"])
    np.testing.assert_allclose(a, b, rtol=rtol, atol=atol * max(1.0, float(np.abs(a).max())))


@SETTINGS
@given(problems())
def test_causality(p):
    """With is_causal, row i does not depend on keys/values after its limit."""
    p["causal"] = True
    Lq, Lk = p["q"].shape[-2], p["k"].shape[-2]
    off = 0 if p["align"] == "top_left" else Lk - Lq
    i = int(p["rng"].integers(0, Lq))
    lim = i + off  # last key row i may see
    a = _call(p)
    k2, v2 = p["k"].copy(), p["v"].copy()
    if lim + 1 < Lk:
        k2[:, max(lim + 1, 0):] = p["rng"].standard_normal(k2[:, max(lim + 1, 0):].shape) * 10
        v2[:, max(lim + 1, 0):] = p["rng"].standard_normal(v2[:, max(lim + 1, 0):].shape) * 10
    b = _call(dict(p, k=k2, v=v2))
    rtol, atol = tol(p["dtype"])
    np.testing.assert_allclose(a[:, i], b[:, i], rtol=rtol, atol=atol * 10)
    if lim < 0:
        assert np.all(a[:, i] == 0) and np.all(b[:, i] == 0)


@SETTINGS
@given(problems())
def test_batch_and_query_independence(p):
    """Each batch item and each query row is computed independently."""
    full = _call(p)
    for b in range(p["q"].shape[0]):
        one = sdpa(p["q"][b], p["k"][b], p["v"][b], None if p["m"] is None else p["m"][b], p["causal"],
                   causal_alignment=p["align"])
        assert_close(one, full[b].astype(np.float64), p["dtype"])
    if not p["causal"]:  # causal limits depend on Lq (bottom_right) -- skip the slicing there
        sl = slice(1, None, 2)
        part = sdpa(p["q"][:, sl], p["k"], p["v"], None if p["m"] is None else p["m"][:, sl])
        assert_close(part, full[:, sl].astype(np.float64), p["dtype"])


@SETTINGS
@given(problems(), st.floats(-50, 50))
def test_float_mask_row_shift_invariance(p, c):
    """softmax is invariant to adding a constant to every score of a row."""
    if p["m"] is None or p["m"].dtype == np.bool_:
        p["m"] = np.zeros(p["q"].shape[:-1] + (p["k"].shape[-2],), p["dtype"])
    a = _call(p)
    b = _call(dict(p, m=(p["m"] + p["dtype"](c)).astype(p["dtype"])))
    rtol, atol = tol(p["dtype"])
    np.testing.assert_allclose(a, b, rtol=rtol * 50, atol=atol * 50)
