"""Hypothesis properties of fastattn.merge_attention: for any split of the
keys into parts (empty parts, masked-out parts included) and any merge
order, the merged result equals the one-call result over all keys and the
float64 oracle, and merging is associative."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, strategies as st

import fastattn
from fastattn import _reference as R

from support import prop_settings

SETTINGS = prop_settings(1, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def problems(draw):
    Lq, Lk, d, dv = (draw(st.integers(lo, hi)) for lo, hi in ((1, 6), (1, 12), (1, 4), (1, 3)))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    cuts = sorted(draw(st.lists(st.integers(0, Lk), max_size=4)))
    masked = draw(st.booleans())
    order = draw(st.permutations(range(len(cuts) + 1)))
    return Lq, Lk, d, dv, seed, [0] + cuts + [Lk], masked, order


@SETTINGS
@given(problems())
def test_any_split_and_order_equals_one_call(problem):
    Lq, Lk, d, dv, seed, cuts, masked, order = problem
    rng = np.random.default_rng(seed)
    q, k, v = rng.standard_normal((Lq, d)), rng.standard_normal((Lk, d)), rng.standard_normal((Lk, dv))
    mask = rng.random((Lq, Lk)) < 0.6 if masked else None
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, l = fastattn.scaled_dot_product_attention(
            q, k[a:b], v[a:b], None if mask is None else mask[:, a:b], return_lse=True)
        outs.append(o)
        lses.append(l)
    outs, lses = [outs[i] for i in order], [lses[i] for i in order]
    out, lse = fastattn.merge_attention(outs, lses)
    want, want_lse = R.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    np.testing.assert_allclose(out, want, rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    fin = np.isfinite(want_lse)
    np.testing.assert_allclose(lse[fin], want_lse[fin], rtol=1e-10, atol=1e-12)
    assert np.all(out[~fin] == 0)
    # associativity: the first part merged last gives the same result
    if len(outs) > 2:
        rest = fastattn.merge_attention(outs[1:], lses[1:])
        two = fastattn.merge_attention([outs[0], rest[0]], [lses[0], rest[1]])
        np.testing.assert_allclose(two[0], out, rtol=1e-12, atol=1e-13)
