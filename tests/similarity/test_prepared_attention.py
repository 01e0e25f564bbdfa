"""functional.PreparedAttention: the same results as attention() and the oracle,
call after call, for every similarity."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R, functional as F

from support import assert_close, randn
from test_similarity import SIMS, make_case


# additive / concat also with d_a = 16: no padding of the projected rows (the
# decoder-step path projects the query with one matmul)
CASES = [(n, 7) for n in SIMS] + [(n, 16) for n in ("additive", "additive_norm", "concat")]


@pytest.mark.parametrize("name,d_a", CASES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("return_weights", [False, True])
def test_matches_attention_and_oracle(name, d_a, dtype, masked, return_weights, rng):
    B, S, dk, dv = 3, 11, 6, 5
    same = name in ("dot", "scaled_dot", "scaled_dot_s", "cosine", "numpy_plugin", "compiled_plugin")
    dq = dk if same else 4
    sim, params, score_fn, _ = make_case(name, dtype, dq, dk, rng, d_a=d_a)
    k = randn(rng, (B, S, dk), dtype)
    v = randn(rng, (B, S, dv), dtype)
    mask = None
    if masked:
        mask = rng.random((B, 1, S)) < 0.7
        mask[1] = False  # a fully masked row: zeros
    prep = F.PreparedAttention(k, v, sim, params=params, attn_mask=mask)
    for step in range(4):  # the first call validates, the later ones reuse it
        q = randn(rng, (B, 1, dq), dtype)
        got = prep(q, return_weights=return_weights)
        want = F.attention(q, k, v, sim, params=params, attn_mask=mask, return_weights=return_weights)
        ref_o, ref_w = R.attention(q, k, v, score_fn, attn_mask=mask, return_weights=True)
        if return_weights:
            assert got[0].dtype == dtype and got[1].dtype == dtype
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert_close(got[0], ref_o, dtype)
            assert_close(got[1], ref_w, dtype)
        else:
            np.testing.assert_array_equal(got, want)
            assert_close(got, ref_o, dtype)


def test_new_query_shapes_and_dtypes_are_validated(rng):
    k = randn(rng, (2, 9, 4), np.float32)
    v = randn(rng, (2, 9, 3), np.float32)
    prep = F.PreparedAttention(k, v, "dot")
    a = prep(randn(rng, (2, 1, 4), np.float32))
    assert a.shape == (2, 1, 3) and a.dtype == np.float32
    b = prep(randn(rng, (2, 5, 4), np.float64))  # another signature: float64 result
    assert b.shape == (2, 5, 3) and b.dtype == np.float64
    with pytest.raises(ValueError, match="query"):
        prep(randn(rng, (2, 1, 7), np.float32))
    with pytest.raises(TypeError, match="query"):
        prep(np.ones((2, 1, 4), complex))
    with pytest.raises(TypeError, match="return_weights"):
        prep(randn(rng, (2, 1, 4), np.float32), return_weights=1)


def test_inputs_untouched_and_threads_followed(rng):
    case = make_case("additive", np.float32, 4, 6, rng)
    sim, params = case[0], case[1]
    k = randn(rng, (4, 40, 6), np.float32)
    v = randn(rng, (4, 40, 5), np.float32)
    q = randn(rng, (4, 3, 4), np.float32)
    saved = [a.copy() for a in (k, v, q)]
    prep = F.PreparedAttention(k, v, sim, params=params)
    first = prep(q)
    with fastattn.threads(1):
        one = prep(q)
    np.testing.assert_allclose(one, first, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(prep(q), first)
    for a, s in zip((k, v, q), saved):
        np.testing.assert_array_equal(a, s)
