"""``return_lse=True``: the row log-sum-exp of scaled_dot_product_attention and
attention, against the float64 oracle (``fastattn._reference.logsumexp_rows``
of the oracle's masked scores), on every kernel path, mask kind and similarity.

The lse is what a backward pass recomputes the weights from
(``P = exp(S - lse)``) and what merging attention over disjoint key sets needs;
asking for it must not change the output or the weights by a single bit.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _attention, _reference as R, _sdpa

from support import assert_close, make_layout, randn
from test_similarity import MASKS, SIMS, _dims, make_case, make_mask


def ref_lse(q, k, mask, causal, align, scale=None):
    s, _ = R._allowed_and_scores(np.asarray(q, np.float64), np.asarray(k, np.float64), mask,
                                 causal, scale, align)
    return R.logsumexp_rows(s)


def check_lse(lse, ref, cdt):
    """lse in the compute dtype, -inf exactly where the oracle has no allowed key,
    finite values within the dtype's tolerance (relative to their magnitude)."""
    assert lse.dtype == cdt and lse.shape == ref.shape, (lse.dtype, lse.shape, ref.shape)
    np.testing.assert_array_equal(lse == -np.inf, ref == -np.inf)
    assert_close(lse, ref, cdt)


# (B, H, Lq, Lk, d, n_threads, return_weights): every path of the SDPA kernel
PATH_CASES = [
    ((2, 3), 5, 7, 8, 1, False),        # tiny: single pass, calling thread
    ((2, 3), 4, 300, 16, 2, False),     # decoding rows (Lq <= 4)
    ((1, 2), 300, 700, 32, 2, False),   # streaming with several key tiles
    ((1, 2), 300, 700, 32, 2, True),    # single pass writing the weights
    ((3,), 130, 64, 24, 2, False),      # more query blocks than threads
]


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("case", PATH_CASES, ids=lambda c: "x".join(map(str, c[0] + c[1:4])) + ("w" if c[5] else ""))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_sdpa_lse_matches_the_oracle(simd_mode, dtype, case, mask_kind, rng):
    batch, Lq, Lk, d, nt, want_w = case
    q = randn(rng, batch + (Lq, d), dtype)
    k = randn(rng, batch + (Lk, d), dtype)
    v = randn(rng, batch + (Lk, d + 1), dtype)
    mask, causal, align = make_mask(mask_kind, batch, Lq, Lk, rng, dtype)
    kw = dict(attn_mask=mask, is_causal=causal, causal_alignment=align, n_threads=nt)
    plain = fastattn.scaled_dot_product_attention(q, k, v, return_weights=want_w, **kw)
    res = fastattn.scaled_dot_product_attention(q, k, v, return_weights=want_w, return_lse=True, **kw)
    assert isinstance(res, tuple) and len(res) == (3 if want_w else 2)
    lse = res[-1]
    ref = ref_lse(q, k, mask, causal, align)
    check_lse(lse, ref, np.dtype(dtype))
    # the output (and weights) are bit for bit those of the call without lse
    for got, want in zip(res[:-1], plain if want_w else (plain,)):
        np.testing.assert_array_equal(got, want)
    # the lse gives back the weights: P = exp(S - lse)
    s, _ = R._allowed_and_scores(q.astype(np.float64), k.astype(np.float64), mask, causal,
                                 None, align)
    with np.errstate(invalid="ignore"):
        p = np.where(np.isfinite(ref)[..., None], np.exp(s - lse.astype(np.float64)[..., None]), 0)
    _, ref_w = R.scaled_dot_product_attention(q, k, v, mask, causal, causal_alignment=align,
                                              return_weights=True)
    assert_close(p, ref_w, dtype)


def test_sdpa_lse_streaming_and_blas_paths_agree(monkeypatch, rng):
    """The same call through the packed streaming kernel and the BLAS tiles: one lse."""
    q, k, v = (randn(rng, (1, 2, 260, 32), np.float32) for _ in range(3))
    a = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)[1]
    monkeypatch.setattr(_sdpa, "STREAM_OWN_PRODUCTS", False)
    monkeypatch.setattr(_sdpa, "SINGLE_PASS_MAX_KEYS", 64)
    _sdpa._clear_plans()
    try:
        assert fastattn.explain(q, k, v, is_causal=True).blas or not fastattn.simd_active()
        b = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True)[1]
    finally:
        monkeypatch.undo()
        _sdpa._clear_plans()
    check_lse(b, ref_lse(q, k, None, True, "top_left"), np.dtype(np.float32))
    np.testing.assert_allclose(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("layout", ["strided", "transposed", "flipped_batch", "readonly"])
def test_sdpa_lse_layouts_and_broadcast(layout, rng):
    """Any input layout; a key shared by every head: lse has the broadcast batch shape."""
    q = make_layout(randn(rng, (2, 4, 9, 8), np.float64), layout)
    k = randn(rng, (2, 1, 11, 8), np.float64)   # one key for all heads
    v = randn(rng, (11, 5), np.float64)         # one value for everything
    m = rng.random((2, 1, 1, 11)) < 0.6          # padding mask
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, m, scale=0.4, return_lse=True)
    assert lse.shape == (2, 4, 9)
    check_lse(lse, ref_lse(q, k, m, False, "top_left", scale=0.4), np.dtype(np.float64))


def test_sdpa_lse_dtypes_out_and_degenerate_sizes(rng):
    q16 = randn(rng, (3, 4), np.float16)
    out, lse = fastattn.scaled_dot_product_attention(q16, q16, q16, return_lse=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32   # lse in the compute dtype
    check_lse(lse, ref_lse(q16, q16, None, False, "top_left"), np.dtype(np.float32))
    qi = np.arange(12).reshape(3, 4) % 3
    _, lse = fastattn.scaled_dot_product_attention(qi, qi, qi, return_lse=True)
    assert lse.dtype == np.float64
    # out= is honoured and lse still returned
    q = randn(rng, (2, 6, 4), np.float32)
    buf = np.empty((2, 6, 4), np.float32)
    r, lse = fastattn.scaled_dot_product_attention(q, q, q, out=buf, return_lse=True)
    assert r is buf and lse.shape == (2, 6)
    # no keys: -inf everywhere, zero output
    out, lse = fastattn.scaled_dot_product_attention(q, q[:, :0], q[:, :0], return_lse=True)
    assert np.all(lse == -np.inf) and np.all(out == 0)
    # no value features (dv = 0) and no query features (d = 0): lse still computed
    out, lse = fastattn.scaled_dot_product_attention(q, q, q[..., :0], return_lse=True)
    assert out.shape == (2, 6, 0)
    check_lse(lse, ref_lse(q, q, None, False, "top_left"), np.dtype(np.float32))
    _, lse = fastattn.scaled_dot_product_attention(q[..., :0], q[..., :0], q, is_causal=True,
                                                   return_lse=True)
    np.testing.assert_allclose(lse, np.log(np.arange(1, 7))[None].repeat(2, 0), rtol=1e-6)
    # no queries
    _, lse = fastattn.scaled_dot_product_attention(q[:, :0], q, q, return_lse=True)
    assert lse.shape == (2, 0)


def test_sdpa_lse_extreme_scores_do_not_overflow():
    """Large scores: lse is the max plus a small log, never inf (the shift by the max)."""
    q = np.full((1, 3, 2), 300.0, np.float32)
    _, lse = fastattn.scaled_dot_product_attention(q, q, q, scale=1.0, return_lse=True)
    np.testing.assert_allclose(lse, 2 * 300.0 ** 2 + np.log(3), rtol=1e-6)


def test_sdpa_lse_same_bits_for_any_thread_count(rng):
    q, k, v = (randn(rng, (2, 4, 200, 32), np.float32) for _ in range(3))
    a = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, n_threads=1)
    b = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, return_lse=True, n_threads=2)
    np.testing.assert_array_equal(a[1], b[1])


@pytest.mark.parametrize("bad", [1, "yes", None, np.array([True])])
def test_return_lse_must_be_a_bool(bad, rng):
    q = randn(rng, (3, 4), np.float32)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        fastattn.scaled_dot_product_attention(q, q, q, return_lse=bad)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        fastattn.attention(q, q, q, "additive", params=fastattn.get_similarity("additive")
                           .init_params(4, 4, d_a=3, rng=0), return_lse=bad)
    with pytest.raises(TypeError, match="return_lse: expected a bool"):
        fastattn.explain(q, q, q, return_lse=bad)


def test_explain_plans_an_lse_only_call(rng):
    q = randn(rng, (2, 5, 3), np.float32)
    assert fastattn.explain(q, q, q[..., :0]).path == "empty"
    assert fastattn.explain(q, q, q[..., :0], return_lse=True).path != "empty"


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float_batch", "causal_br", "padding",
                                       "fully_masked"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sim_name", SIMS)
@pytest.mark.parametrize("want_w", [False, True], ids=["lse", "weights+lse"])
def test_attention_lse_every_similarity(sim_name, dtype, mask_kind, want_w, rng):
    dt = np.dtype(dtype)
    d_q, d_k = _dims(sim_name)
    batch, Lq, Lk = (2,), 9, 150   # two key tiles of the fused and NumPy paths
    q = randn(rng, batch + (Lq, d_q), dt)
    k = randn(rng, batch + (Lk, d_k), dt)
    v = randn(rng, batch + (Lk, 3), dt)
    sim, params, ref_score, path = make_case(sim_name, dt, d_q, d_k, rng)
    mask, causal, align = make_mask(mask_kind, batch, Lq, Lk, rng, dt)
    kw = dict(params=params, attn_mask=mask, is_causal=causal, causal_alignment=align)
    assert _attention.attention_path(q, k, v, sim, **kw) == path
    plain = fastattn.attention(q, k, v, sim, return_weights=want_w, **kw)
    res = fastattn.attention(q, k, v, sim, return_weights=want_w, return_lse=True, **kw)
    for got, want in zip(res[:-1], plain if want_w else (plain,)):
        np.testing.assert_array_equal(got, want)
    out, ref_w, ref = R.attention(q, k, v, ref_score, mask, causal, causal_alignment=align,
                                  return_weights=True, return_lse=True)
    assert_close(res[0], out, dt)
    check_lse(res[-1], ref, dt)


def test_attention_lse_tiled_path_with_no_value_features(rng):
    from test_similarity import NegSqDist

    q = randn(rng, (2, 7, 4), np.float64)
    sim = NegSqDist()
    _, lse = fastattn.attention(q, q, q[..., :0], sim, params={"gamma": 0.5}, is_causal=True,
                                return_lse=True)
    s = R.score_neg_sq_dist(q, q, 0.5)
    s = np.where(np.tril(np.ones((7, 7), bool)), s, -np.inf)
    check_lse(lse, R.logsumexp_rows(s), np.dtype(np.float64))
