"""Hypothesis properties of the functional attention ops (issue 7, hardening):
``scaled_dot_product_attention``, ``attention`` with every built-in similarity,
a NumPy plugin and the compiled self-test plugin, and ``PreparedAttention``
over each of them.

For every op where it applies:

* agreement with the float64 oracle (``fastattn._reference``), also on
  strided / transposed / padded / Fortran-ordered / read-only inputs and
  broadcast leading batch dims;
* weights >= 0, zero on forbidden keys, rows summing to 1 where any key is
  allowed, zero rows (and zero output) where none is;
* invariance to a constant added to every score of a row (a float mask with
  a per-row constant; for the dot family also: one vector added to every
  key, which adds ``q_i . u`` to row ``i``);
* invariance to permuting keys with values (and the mask with them);
* causality: changing keys/values after a query's limit leaves its row
  bit-for-bit unchanged;
* masked keys have no influence (bit-for-bit);
* float32 and float64 agree within the float32 tolerance.

The inputs are float32-representable numbers, so the float32 and float64
runs (and the oracle) see exactly the same values; scores stay O(1-10).
Budgets: ``support.prop_settings`` (profiles ``ci`` and ``long``).
"""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastattn
import fastattn.testing
from fastattn import _reference as R
from fastattn.functional import PreparedAttention
from fastattn.similarity import AdditiveSimilarity

from support import (F32, F64, LAYOUTS_2D, LAYOUTS_ND, NegL1, assert_agree, assert_all_close,
                    changed, check_causal_rows, check_float32_and_float64_agree,
                    check_kv_permutation, check_row_constant_invariance, check_rows_unchanged, f32,
                    lay, random_mask)
from support import allowed_matrix, assert_close, check_weights, prop_settings


# --------------------------------------------------------------------------
# Similarities: the object (NegL1: tests/support.py), its parameters and the
# oracle's score function.

def _params(sim, rng, d_q, d_k, d_a):
    """Parameters (float32-representable float64 arrays / floats) and the
    oracle's score function of those exact values."""
    g = lambda *shape: f32(rng.standard_normal(shape))  # noqa: E731
    if sim == "dot":
        return None, lambda q, k: R.score_dot(q, k)
    if sim == "scaled_dot":
        if rng.random() < 0.5:
            return None, lambda q, k: R.score_dot(q, k, 1.0 / math.sqrt(q.shape[-1]))
        s = float(f32(rng.uniform(0.1, 1.0)))
        return {"scale": s}, lambda q, k: R.score_dot(q, k, s)
    if sim == "general":
        P = {"W": f32(g(d_q, d_k) / (d_q * d_k) ** 0.25)}
        if rng.random() < 0.5:
            P["scale"] = float(f32(rng.uniform(0.2, 2.0)))
        return P, lambda q, k: R.score_general(q, k, P["W"], P.get("scale", 1.0))
    if sim in ("additive", "additive_normalize"):
        P = {"W_q": f32(g(d_a, d_q) / math.sqrt(d_q)), "W_k": f32(g(d_a, d_k) / math.sqrt(d_k)),
             "v": g(d_a)}
        if rng.random() < 0.5:
            P["b"] = f32(0.5 * g(d_a))
        v = P["v"]
        if sim == "additive_normalize":
            P["g"] = float(f32(rng.uniform(0.5, 3.0)))
            v = P["g"] * v / np.linalg.norm(v)
        return P, lambda q, k: R.score_additive(q, k, P["W_q"], P["W_k"], v, P.get("b"))
    if sim == "concat":
        P = {"W": f32(g(d_a, d_q + d_k) / math.sqrt(d_q + d_k)), "v": g(d_a)}
        if rng.random() < 0.5:
            P["b"] = f32(0.5 * g(d_a))
        return P, lambda q, k: R.score_concat(q, k, P["W"], P["v"], P.get("b"))
    if sim == "cosine":
        P = {"beta": float(f32(rng.uniform(0.5, 5.0)))} if rng.random() < 0.7 else None
        beta = 1.0 if P is None else P["beta"]
        return P, lambda q, k: R.score_cosine(q, k, beta)
    if sim == "numpy_plugin":
        P = {"gamma": float(f32(rng.uniform(0.05, 0.5)))}
        return P, lambda q, k: R.score_neg_l1(q, k, P["gamma"])
    if sim == "compiled":
        P = {"gamma": float(f32(rng.uniform(0.05, 0.3)))}
        return P, lambda q, k: R.score_neg_sq_dist(q, k, P["gamma"])
    raise AssertionError(sim)


_SIM_OBJECTS = {
    "additive_normalize": AdditiveSimilarity(normalize=True),
    "numpy_plugin": NegL1(),
    "compiled": fastattn.testing.selftest_similarity(),
}
SIMS = ["dot", "scaled_dot", "general", "additive", "additive_normalize", "concat", "cosine",
        "numpy_plugin", "compiled"]
SAME_DIMS = {"dot", "scaled_dot", "cosine", "numpy_plugin", "compiled"}
# one vector u added to every key adds a per-row constant (q_i . u) to the scores
KEY_SHIFT_EXACT = {"sdpa", "attention/dot", "attention/scaled_dot", "attention/general",
                   "prepared/dot", "prepared/scaled_dot", "prepared/general"}

OPS = ["sdpa"] + [f"attention/{s}" for s in SIMS] + [f"prepared/{s}" for s in SIMS]
CAUSAL_OPS = [op for op in OPS if not op.startswith("prepared/")]


def _sim_of(op):
    return op.split("/", 1)[1]


def _sim_arg(sim):
    return _SIM_OBJECTS.get(sim, sim)


# --------------------------------------------------------------------------
# Problems

@st.composite
def batch_shapes(draw, small):
    """(query batch, key/value batch, broadcast batch) leading dims."""
    nd = draw(st.integers(0, 1 if small else 2))
    full, bq, bk = [], [], []
    for _ in range(nd):
        n = draw(st.integers(1, 2 if small else 3))
        who = draw(st.sampled_from(["both", "both", "q", "k"]))
        full.append(n)
        bq.append(n if who in ("both", "q") else 1)
        bk.append(n if who in ("both", "k") else 1)
    if bk and bk[0] == 1 and draw(st.booleans()):
        bk = bk[1:]  # broadcast by rank
    return tuple(bq), tuple(bk), tuple(full)


@st.composite
def problems(draw, op, *, causal=None, mask_kinds=("none", "bool", "float")):
    """One call of ``op`` as a dict of float64 values (float32-representable),
    layouts and options; :func:`run` makes the arrays."""
    sim = None if op == "sdpa" else _sim_of(op)
    dtype = draw(st.sampled_from([F32, F64]))
    Lq = draw(st.one_of(st.integers(1, 12), st.sampled_from([1, 5, 31, 70])))
    Lk = draw(st.one_of(st.integers(1, 12), st.sampled_from([1, 127, 129, 257, 300])))
    bq, bk, full = draw(batch_shapes(small=Lq * Lk > 1000))
    d = draw(st.integers(1, 10))
    d_k = d if sim is None or sim in SAME_DIMS else draw(st.integers(1, 10))
    dv = draw(st.integers(1, 6))
    d_a = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = f32(rng.standard_normal(bq + (Lq, d)) / (math.sqrt(d) if sim == "dot" else 1.0))
    k = f32(rng.standard_normal(bk + (Lk, d_k)))
    v = f32(rng.standard_normal(bk + (Lk, dv)))
    kind = draw(st.sampled_from(mask_kinds))
    m = None
    if kind != "none":
        mshape = draw(st.sampled_from(["full", "2d", "keys", "batch_keys"]))
        shape = {"full": full + (Lq, Lk), "2d": (Lq, Lk), "keys": (1, Lk),
                 "batch_keys": full + (1, Lk)}[mshape]
        m = random_mask(draw, rng, kind, shape, [0.1, 0.5, 0.9])
    is_causal = draw(st.booleans()) if causal is None else causal
    if op.startswith("prepared/"):
        is_causal = False
    nd = len(bq) + 2
    layouts = tuple(draw(st.sampled_from(LAYOUTS_ND if n > 2 else LAYOUTS_2D))
                    for n in (nd, len(bk) + 2, len(bk) + 2))
    P, score = (None, None) if sim is None else _params(sim, rng, d, d_k, d_a)
    return dict(
        op=op, sim=sim, dtype=dtype, q=q, k=k, v=v, m=m, causal=is_causal,
        align=draw(st.sampled_from(["top_left", "bottom_right"])),
        scale=draw(st.sampled_from([None, None, 0.5, 2.0])) if op == "sdpa" else None,
        P=P, score=score, layouts=layouts, warm=draw(st.booleans()), rng=rng,
        batch=np.broadcast_shapes(bq, bk), Lq=Lq, Lk=Lk)


def _mask_as(m, dtype):
    if m is None or m.dtype == np.bool_:
        return m
    return m.astype(dtype)


def _params_as(P, dtype):
    if P is None:
        return None
    return {n: (np.asarray(x, dtype) if isinstance(x, np.ndarray) else x) for n, x in P.items()}


def run(c, *, weights=False, dtype=None, dtypes=None):
    """``c["op"]`` on the arrays of ``c`` (in ``dtype``, default ``c["dtype"]``;
    or query, key, value in ``dtypes``, the mask and parameters then in
    their promoted dtype)."""
    dt = c["dtype"] if dtype is None else np.dtype(dtype)
    dts = (dt,) * 3 if dtypes is None else tuple(np.dtype(t) for t in dtypes)
    if dtypes is not None:
        dt = np.result_type(*dts)
    q, k, v = (lay(c[n], layout, t) for n, layout, t in zip("qkv", c["layouts"], dts))
    m = _mask_as(c["m"], dt)
    op = c["op"]
    if op == "sdpa":
        return fastattn.scaled_dot_product_attention(
            q, k, v, m, c["causal"], c["scale"], return_weights=weights,
            causal_alignment=c["align"])
    sim, P = _sim_arg(c["sim"]), _params_as(c["P"], dt)
    if op.startswith("attention/"):
        return fastattn.attention(q, k, v, sim, params=P, attn_mask=m, is_causal=c["causal"],
                                  return_weights=weights, causal_alignment=c["align"])
    prep = PreparedAttention(k, v, sim, params=P, attn_mask=m)
    if c["warm"]:  # the second call of a signature takes the cached path
        prep(np.ascontiguousarray(q[..., ::-1, :]) * dt.type(0.5), return_weights=weights)
    return prep(q, return_weights=weights)


def oracle(c):
    if c["op"] == "sdpa":
        return R.scaled_dot_product_attention(c["q"], c["k"], c["v"], c["m"], c["causal"],
                                              c["scale"], causal_alignment=c["align"],
                                              return_weights=True)
    return R.attention(c["q"], c["k"], c["v"], c["score"], c["m"], c["causal"],
                       causal_alignment=c["align"], return_weights=True)


def allowed(c):
    """'may attend' of every (batch item, query, key), broadcast to the output's batch."""
    a = allowed_matrix(c["Lq"], c["Lk"], c["m"], c["causal"], c["align"])
    return np.broadcast_to(a, c["batch"] + (c["Lq"], c["Lk"]))


def _forbid(m, rows, cols, Lq, Lk):
    """A copy of the mask (made when there is none) with [rows, cols] forbidden."""
    if m is None:
        m = np.ones((Lq, Lk), bool)
    m = m.copy()
    r = rows if m.shape[-2] == Lq else slice(None)
    idx = (Ellipsis, r[:, None] if isinstance(r, np.ndarray) else r, cols)
    m[idx] = False if m.dtype == np.bool_ else -np.inf
    return m


# --------------------------------------------------------------------------
# Properties

@pytest.mark.parametrize("op", OPS)
@prop_settings(1)
@given(data=st.data())
def test_matches_oracle_and_weights_are_distributions(op, data):
    c = data.draw(problems(op))
    out, w = run(c, weights=True)
    ref_o, ref_w = oracle(c)
    dt = c["dtype"]
    assert_all_close((out, w), (ref_o, ref_w), dt)
    ok = allowed(c)
    check_weights(w, ok, dt)
    fully = ~ok.any(-1)
    assert np.all(out[fully] == 0), "a row with no allowed key must give zeros"
    # the weights-free call (streaming / fused paths) agrees
    assert_close(run(c), ref_o, dt)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), c_max=st.sampled_from([1.0, 10.0, 40.0]))
def test_invariant_to_a_constant_added_to_each_score_row(op, data, c_max):
    """A float mask plus a per-row constant gives the same output and weights."""
    c = data.draw(problems(op))
    wa, wb = check_row_constant_invariance(run, c, c["batch"] + (c["Lq"], c["Lk"]), c_max)
    np.testing.assert_array_equal(wa == 0, wb == 0)


@pytest.mark.parametrize("op", sorted(KEY_SHIFT_EXACT))
@prop_settings(0.5)
@given(data=st.data())
def test_dot_family_invariant_to_a_vector_added_to_every_key(op, data):
    """q . (k_j + u) = q . k_j + q . u: a per-row constant, so nothing changes."""
    c = data.draw(problems(op))
    u = f32(c["rng"].standard_normal(c["k"].shape[-1]))
    a = run(c)
    b = run(dict(c, k=c["k"] + u))
    assert_agree(b, a, c["dtype"], atol_scale=4.0 if c["dtype"] == F32 else 1.0)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data())
def test_key_value_permutation_invariance(op, data):
    c = data.draw(problems(op, causal=False))
    check_kv_permutation(run, c)


@pytest.mark.parametrize("op", CAUSAL_OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_causal_rows_do_not_see_later_keys(op, data, weights):
    """Rows whose causal limit is before key t are bit-for-bit unchanged when
    keys and values from t on change."""
    c = data.draw(problems(op, causal=True))
    check_causal_rows(run, oracle, c, data.draw(st.integers(0, c["Lk"] - 1)), weights)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_masked_keys_have_no_influence(op, data, weights):
    """Changing keys/values that a row may not attend to leaves that row
    bit-for-bit unchanged (and the other rows agree with the oracle)."""
    c = data.draw(problems(op, mask_kinds=("none", "bool", "float")))
    Lq, Lk, rng = c["Lq"], c["Lk"], c["rng"]
    cols = np.unique(rng.integers(0, Lk, data.draw(st.integers(1, 3))))
    rows = np.unique(rng.integers(0, Lq, data.draw(st.integers(1, Lq))))
    c = dict(c, m=_forbid(c["m"], rows, cols, Lq, Lk))
    blind = ~allowed(c)[..., cols].any(-1)  # (batch, Lq): rows that see none of cols
    assert blind.any()
    c2 = dict(c, k=changed(rng, c["k"], (Ellipsis, cols, slice(None))),
              v=changed(rng, c["v"], (Ellipsis, cols, slice(None))))
    check_rows_unchanged(run, oracle, c, c2, weights, blind)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_float32_and_float64_agree(op, data):
    """The same (float32-representable) inputs in both dtypes: results within
    the float32 tolerance of each other; each keeps its dtype."""
    c = data.draw(problems(op))
    check_float32_and_float64_agree(lambda dt: run(c, weights=True, dtype=dt))
    s32, s64 = run(c, dtype=F32), run(c, dtype=F64)
    assert_agree(s32, s64, F32, factor=1.0)



@pytest.mark.parametrize("op", OPS)
@prop_settings(0.3)
@given(data=st.data(), dtypes=st.sampled_from([(F32, F64, F64), (F64, F32, F32), (F32, F32, F64),
                                                (F64, F64, F32)]))
def test_mixed_dtypes_and_float16(op, data, dtypes):
    """Mixed float32 / float64 inputs compute in float64 (NumPy promotion):
    the float64 result of the same values.  float16 inputs compute in
    float32 and come back as float16, within half a float16 ulp of the oracle."""
    c = data.draw(problems(op))
    o, w = run(c, weights=True, dtypes=dtypes)
    o64, w64 = run(c, weights=True, dtype=F64)
    assert o.dtype == F64 and w.dtype == F64
    assert_agree(o, o64, F64)
    assert_agree(w, w64, F64)
    h = dict(c, **{n: c[n].astype(np.float16).astype(np.float64) for n in "qkv"})
    if c["m"] is not None and c["m"].dtype != np.bool_:
        h["m"] = c["m"].astype(np.float16).astype(np.float64)
    o16, w16 = run(h, weights=True, dtype=np.float16)
    assert o16.dtype == np.float16 and w16.dtype == np.float16
    ref_o, ref_w = oracle(h)
    assert_close(o16, ref_o, np.float16)
    assert_close(w16, ref_w, np.float16)
