"""fastattn.merge_attention: partial results over disjoint key sets merged
into the one-call result (against fastattn's full call and the float64
oracle), associativity, parts without keys, fully masked rows, the array
form with an axis, and bad input."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R

from support import randn


def _parts(q, k, v, cuts, mask=None, **kw):
    outs, lses = [], []
    for a, b in zip(cuts[:-1], cuts[1:]):
        m = None if mask is None else mask[..., a:b]
        o, lse = fastattn.scaled_dot_product_attention(q, k[..., a:b, :], v[..., a:b, :], m,
                                                       return_lse=True, **kw)
        outs.append(o)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_equals_one_call_over_all_keys(dtype, rng):
    q, k, v = randn(rng, (2, 3, 20, 8), dtype), randn(rng, (2, 3, 57, 8), dtype), randn(rng, (2, 3, 57, 5), dtype)
    mask = rng.random((2, 1, 20, 57)) < 0.7
    before = [a.copy() for a in (q, k, v)]
    outs, lses = _parts(q, k, v, [0, 5, 6, 30, 57], mask)
    snap = [a.copy() for a in outs + lses]
    out, lse = fastattn.merge_attention(outs, lses)
    full, full_lse = fastattn.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)
    assert out.dtype == dtype and lse.dtype == dtype
    np.testing.assert_allclose(out, full, **tol)
    np.testing.assert_allclose(lse, full_lse, **tol)
    ref, ref_lse = R.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    np.testing.assert_allclose(out, ref, **tol)
    np.testing.assert_allclose(lse, ref_lse, **tol)
    for a, b in zip((q, k, v) + tuple(outs + lses), before + snap):
        np.testing.assert_array_equal(a, b)


def test_associative_and_commutative(rng):
    q, k, v = randn(rng, (4, 10, 6)), randn(rng, (4, 40, 6)), randn(rng, (4, 40, 3))
    (a, b, c), (la, lb, lc) = _parts(q, k, v, [0, 9, 25, 40])
    ab = fastattn.merge_attention([a, b], [la, lb])
    left = fastattn.merge_attention([ab[0], c], [ab[1], lc])
    bc = fastattn.merge_attention([b, c], [lb, lc])
    right = fastattn.merge_attention([a, bc[0]], [la, bc[1]])
    flat = fastattn.merge_attention([c, a, b], [lc, la, lb])
    for x, y in [(left, right), (left, flat)]:
        np.testing.assert_allclose(x[0], y[0], rtol=1e-13, atol=1e-14)
        np.testing.assert_allclose(x[1], y[1], rtol=1e-13, atol=1e-14)


def test_a_part_without_keys_and_fully_masked_rows(rng):
    q, k, v = randn(rng, (6, 4)), randn(rng, (9, 4)), randn(rng, (9, 2))
    mask = np.ones((6, 9), bool)
    mask[2] = False           # query 2 sees no key at all
    mask[4, :5] = False       # query 4 sees no key of the first part
    outs, lses = _parts(q, k, v, [0, 5, 5, 9], mask)  # the middle part has no keys
    assert np.all(np.isneginf(lses[1])) and np.all(outs[1] == 0)
    out, lse = fastattn.merge_attention(outs, lses)
    without = fastattn.merge_attention([outs[0], outs[2]], [lses[0], lses[2]])
    np.testing.assert_array_equal(out, without[0])
    np.testing.assert_array_equal(lse, without[1])
    assert np.all(out[2] == 0) and np.isneginf(lse[2])
    full, full_lse = fastattn.scaled_dot_product_attention(q, k, v, mask, return_lse=True)
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
    # a garbage out where its lse is -inf gets no weight (not even NaN * 0)
    bad = [o.copy() for o in outs]
    bad[1][:] = np.nan
    np.testing.assert_array_equal(fastattn.merge_attention(bad, lses)[0], out)


def test_array_form_and_axis(rng):
    q, k, v = randn(rng, (3, 7, 4)), randn(rng, (3, 12, 4)), randn(rng, (3, 12, 5))
    outs, lses = _parts(q, k, v, [0, 4, 12])
    want = fastattn.merge_attention(outs, lses)
    got0 = fastattn.merge_attention(np.stack(outs), np.stack(lses), axis=0)
    got1 = fastattn.merge_attention(np.stack(outs, 1), np.stack(lses, 1), axis=1)
    gotm = fastattn.merge_attention(np.stack(outs, 1), np.stack(lses, 1), axis=-2)
    for g in (got0, got1, gotm):
        np.testing.assert_allclose(g[0], want[0], rtol=1e-14)
        np.testing.assert_allclose(g[1], want[1], rtol=1e-14)
    assert fastattn.functional.merge_attention is fastattn.merge_attention


def test_bad_input_names_the_argument(rng):
    o, l = np.zeros((2, 3, 4)), np.zeros((2, 3))
    M = fastattn.merge_attention
    with pytest.raises(ValueError, match=r"outs: expected at least one part"):
        M([], [])
    with pytest.raises(ValueError, match=r"outs: every part must have the same shape"):
        M([o[0], o[0, :2]], [l[0], l[0]])
    with pytest.raises(ValueError, match=r"outs: expected shape \(2, 3\) \+ \(dv,\)"):
        M(o[:, :2], l, axis=0)
    with pytest.raises(ValueError, match=r"axis: 1 is the query axis of lses"):
        M(o, l, axis=1)
    with pytest.raises(ValueError, match=r"axis: 5 is out of range"):
        M(o, l, axis=5)
    with pytest.raises(TypeError, match=r"axis: expected an int, got float"):
        M(o, l, axis=0.0)
    with pytest.raises(TypeError, match=r"outs, lses: give both as sequences"):
        M([o[0], o[1]], l)
    with pytest.raises(ValueError, match=r"lses: expected finite values or -inf"):
        M(o, np.full((2, 3), np.nan))
    with pytest.raises(TypeError, match=r"outs: expected real numbers, got dtype complex128"):
        M(o.astype(complex), l)
