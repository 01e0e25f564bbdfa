"""Bad arguments to fastattn.attention: clear errors naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn.similarity import CosineSimilarity

from support import randn


@pytest.fixture
def qkv(rng):
    return randn(rng, (2, 5, 4)), randn(rng, (2, 6, 3)), randn(rng, (2, 6, 2))


def _add(d_q=4, d_k=3, d_a=5):
    return fastattn.get_similarity("additive").init_params(d_q, d_k, d_a=d_a, rng=0)


def test_params_errors(qkv):
    q, k, v = qkv
    att = fastattn.attention
    with pytest.raises(ValueError, match=r"params: missing 'W_q' for similarity 'additive'; "
                                         r"expected W_q: \(d_a, d_q\), W_k: \(d_a, d_k\), v: \(d_a,\), b: \(d_a,\) \(optional\)"):
        att(q, k, v, "additive")
    P = _add()
    P["W_k"] = np.zeros((5, 4))
    with pytest.raises(ValueError, match=r"params\['W_k'\]: expected shape \(d_a, d_k\) = \(5, 3\) "
                                         r"for similarity 'additive' \(d_q=4, d_k=3\), got \(5, 4\)"):
        att(q, k, v, "additive", params=P)
    P = _add()
    P["v"] = np.zeros((5, 1))
    with pytest.raises(ValueError, match=r"params\['v'\]: expected shape \(d_a,\) for similarity "
                                         r"'additive', got 2-d array of shape \(5, 1\)"):
        att(q, k, v, "additive", params=P)
    P = _add()
    P["extra"] = 1
    with pytest.raises(ValueError, match=r"params: unexpected key\(s\) \['extra'\] for similarity 'additive'"):
        att(q, k, v, "additive", params=P)
    with pytest.raises(TypeError, match=r"params: expected a dict of arrays for similarity 'additive', got list"):
        att(q, k, v, "additive", params=[1, 2])
    P = _add()
    P["W_q"] = P["W_q"].astype(np.complex128)
    with pytest.raises(TypeError, match=r"params\['W_q'\]: expected real numbers \(float32/float64\) "
                                        r"for similarity 'additive', got dtype complex128"):
        att(q, k, v, "additive", params=P)
    P = _add()
    P["b"] = np.full(5, np.nan)
    with pytest.raises(ValueError, match=r"params\['b'\]: contains NaN or infinite values"):
        att(q, k, v, "additive", params=P)
    with pytest.raises(ValueError, match=r"params\['W'\]: expected shape \(d_a, d_q\+d_k\) = \(5, 7\) for similarity 'concat' \(d_q=4, d_k=3\), got \(5, 6\)"):
        att(q, k, v, "concat", params={"W": np.zeros((5, 6)), "v": np.zeros(5)})
    with pytest.raises(ValueError, match=r"params\['W'\]: expected shape \(d_q, d_k\) = \(4, 3\)"):
        att(q, k, v, "general", params={"W": np.zeros((3, 4))})
    with pytest.raises(ValueError, match=r"params\['scale'\]: expected shape \(\) for similarity 'scaled_dot', got 1-d"):
        att(q, q, v[:, :5], "scaled_dot", params={"scale": [1.0]})


def test_feature_size_mismatch(qkv):
    q, k, v = qkv
    for name in ("dot", "scaled_dot", "cosine"):
        with pytest.raises(ValueError, match=rf"key: expected last dim 4 \(query's feature size d; "
                                             rf"similarity '{name}' needs equal query and key features\), "
                                             r"got key of shape \(2, 6, 3\)"):
            fastattn.attention(q, k, v, name)


def test_same_messages_as_sdpa(qkv, rng):
    """Mask, causal, out, threads, dtypes: SDPA's own checks and messages."""
    q, _, v = qkv
    k = randn(rng, (2, 6, 4))
    cases = [
        dict(attn_mask=np.ones((5, 7), bool)),
        dict(attn_mask=np.ones((5, 6), np.int32)),
        dict(is_causal=1),
        dict(causal_alignment="middle"),
        dict(return_weights="yes"),
        dict(out=np.empty((2, 5, 3))),
        dict(out=np.empty((2, 5, 2), np.float32)),
        dict(n_threads=0),
        dict(n_threads=1.5),
    ]
    for kw in cases:
        with pytest.raises((ValueError, TypeError)) as sdpa_err:
            fastattn.scaled_dot_product_attention(q, k, v, **kw)
        for sim, params in (("dot", None), ("additive", _add(4, 4))):
            with pytest.raises(type(sdpa_err.value), match=__import__("re").escape(str(sdpa_err.value))):
                fastattn.attention(q, k, v, sim, params=params, **kw)
    with pytest.raises(TypeError, match=r"query: complex dtypes are not supported"):
        fastattn.attention(q.astype(complex), k, v, "additive", params=_add(4, 4))
    with pytest.raises(ValueError, match=r"value: expected 6 rows \(the number of keys Lk\), got value of shape \(2, 5, 2\)"):
        fastattn.attention(q, k, v[:, :5], "additive", params=_add(4, 4))
    with pytest.raises(ValueError, match=r"query: expected an array with at least 2 dims \(\.\.\., L, features\), got 1-d"):
        fastattn.attention(q[0, 0], k, v, "additive", params=_add(4, 4))
    with pytest.raises(ValueError, match=r"leading \(batch\) dimensions do not broadcast"):
        fastattn.attention(q, randn(rng, (3, 6, 4)), randn(rng, (3, 6, 2)), "additive", params=_add(4, 4))


def test_cosine_constructor():
    with pytest.raises(ValueError, match=r"eps: expected a positive real number, got 0"):
        CosineSimilarity(eps=0)
    # a zero row gives zero cosine scores (no NaN): uniform weights
    q = np.zeros((1, 3))
    k = np.eye(3)
    out, w = fastattn.attention(q, k, np.eye(3), "cosine", return_weights=True)
    np.testing.assert_allclose(w, np.full((1, 3), 1 / 3))


def test_init_params_needs_extra_dims():
    with pytest.raises(ValueError, match=r"init_params: give d_a=\.\.\. for parameter 'W_q'"):
        fastattn.get_similarity("additive").init_params(4, 3)
    P = fastattn.get_similarity("concat").init_params(4, 3, d_a=6, rng=1)
    assert P["W"].shape == (6, 7) and P["v"].shape == (6,) and P["b"].shape == (6,)
    assert np.all(P["b"] == 0)


# ------------------------------------------------ review of issue 5, findings 2, 5, 7

def test_init_params_leaves_out_optional_params_without_a_fixed_default(rng):
    """scaled_dot's scale defaults to 1/sqrt(d): init_params must not give 0
    (which made every score 0 in make_inputs / benchmark_similarity)."""
    from fastattn import testing

    assert "scale" not in fastattn.get_similarity("scaled_dot").init_params(8)
    q, k, v, P = testing.make_inputs("scaled_dot", batch=1, Lq=6, d=8, dtype="float64")
    assert P == {}
    got = fastattn.attention(q, k, v, "scaled_dot", params=P)
    from fastattn import _reference as R
    from support import assert_close

    assert_close(got, R.attention(q, k, v, lambda a, b: R.score_dot(a, b, 1 / np.sqrt(8))),
                 np.float64)
    # documented defaults still come out of init_params: zero biases, unit scalars
    P = fastattn.get_similarity("additive").init_params(4, 3, d_a=5, rng=0)
    assert set(P) == {"W_q", "W_k", "v", "b"} and np.all(P["b"] == 0)
    assert fastattn.get_similarity("general").init_params(4, 3)["scale"] == 1.0
    assert fastattn.get_similarity("cosine").init_params(4)["beta"] == 1.0


def test_params_keys_must_be_str(qkv):
    q, k, v = qkv
    with pytest.raises(TypeError, match=r"params: keys must be str \(parameter names\) for "
                                        r"similarity 'additive', got int 1; expected W_q"):
        fastattn.attention(q, k, v, "additive", params={1: 2, "zz": 3})
    with pytest.raises(TypeError, match=r"params: keys must be str .* got int 1, tuple \(2,\)"):
        fastattn.attention(q, q, v[:, :5], "dot", params={1: 2, (2,): 3})


def _no_warnings():
    import warnings

    ctx = warnings.catch_warnings()
    ctx.__enter__()
    warnings.simplefilter("error")
    return ctx


def test_float32_scores_out_of_range_say_so(rng):
    """A float64 plugin score above the float32 range in a float32 call: 'out
    of float32 range', not 'NaN or +inf', and no RuntimeWarning from the cast."""
    from fastattn.similarity import Similarity

    class Huge(Similarity):
        name = "huge"
        same_dims = True

        def __init__(self, factor):
            self.factor = factor

        def score(self, query, key, params):
            return (query.astype(np.float64) @ np.swapaxes(key, -1, -2)) * self.factor

    q, k, v = (randn(rng, s, np.float32) for s in ((2, 5, 4), (2, 9, 4), (2, 9, 3)))
    ctx = _no_warnings()
    try:
        with pytest.raises(ValueError, match=r"similarity 'huge': score returned values out of "
                                             r"float32 range \(the compute dtype; max 3.403e\+38\), "
                                             r"got max \|score\| .*e\+4\d in float64"):
            fastattn.attention(q, k, v, Huge(1e45))
        # really +inf and NaN still say so (also next to huge values: no cast warning)
        with pytest.raises(ValueError, match=r"score returned NaN or \+inf values"):
            fastattn.attention(q, k, v, Huge(np.inf))
        with pytest.raises(ValueError, match=r"score returned NaN or \+inf values"):
            fastattn.attention(q, k, v, Huge(np.array([np.nan, 1e45, 1, 1, 1, 1, 1, 1, 1])))
    finally:
        ctx.__exit__(None, None, None)
    # in range in float64: fine, and the float32 result matches the oracle
    from fastattn import _reference as R
    from support import assert_close

    got = fastattn.attention(q, k, v, Huge(0.5))
    assert_close(got, R.attention(q, k, v, lambda a, b: R.score_dot(a, b, 0.5)), np.float32)


def test_float32_params_out_of_range_say_so(qkv):
    q, k, v = (a.astype(np.float32) for a in qkv)
    P = _add()
    P["v"] = np.full(5, 1e39)
    ctx = _no_warnings()
    try:
        with pytest.raises(ValueError, match=r"params\['v'\]: values out of float32 range \(the "
                                             r"compute dtype of query/key/value; max 3.403e\+38\), "
                                             r"got max \|value\| 1e\+39"):
            fastattn.attention(q, k, v, "additive", params=P)
        with pytest.raises(ValueError, match=r"params\['scale'\]: values out of float32 range"):
            fastattn.attention(q, q, v[:, :5], "scaled_dot", params={"scale": -1e300})
        P["v"] = np.full(5, np.inf)
        with pytest.raises(ValueError, match=r"params\['v'\]: contains NaN or infinite values"):
            fastattn.attention(q, k, v, "additive", params=P)
    finally:
        ctx.__exit__(None, None, None)
    # the same values are fine in a float64 call
    P["v"] = np.full(5, 1e39)
    assert np.all(np.isfinite(fastattn.attention(*qkv, "additive", params=P)))


@pytest.mark.parametrize("sim", ["dot", "general", "additive", "concat", "cosine", "numpy", "compiled"])
def test_feature_size_checked_against_the_blas_limit(sim, rng):
    """d is a BLAS dimension (projections, leading dims), never seen by SDPA's
    checks (they run on one-feature stand-ins): 2**31 features, by a
    zero-stride view (no memory), are refused before anything is copied."""
    from fastattn import testing
    from fastattn._validation import BLAS_INT_MAX

    class Dot(fastattn.Similarity):
        name = "numpy_dot"
        same_dims = True

        def score(self, query, key, params):
            return query @ np.swapaxes(key, -1, -2)

    d = BLAS_INT_MAX + 1
    sims = {"numpy": Dot(), "compiled": testing.selftest_similarity()}
    huge = np.broadcast_to(np.float32(0.5), (3, d))
    v = np.ones((3, 2), np.float32)
    with pytest.raises(ValueError, match=rf"query: feature size d_q={d} exceeds the BLAS 32-bit "
                                         rf"integer range \(max {BLAS_INT_MAX}\)"):
        fastattn.attention(huge, huge, v, sims.get(sim, sim))


def test_feature_and_attention_sizes_checked_against_the_limit(monkeypatch, rng):
    """The same with the limit lowered: d_q, d_k and the additive d_a."""
    from fastattn import _validation

    q, k, v = randn(rng, (2, 5, 7)), randn(rng, (2, 6, 3)), randn(rng, (2, 6, 2))
    monkeypatch.setattr(_validation, "BLAS_INT_MAX", 6)
    with pytest.raises(ValueError, match=r"query: feature size d_q=7 exceeds the BLAS 32-bit integer range \(max 6\)"):
        fastattn.attention(q, k, v, "additive", params=_add(7, 3))
    with pytest.raises(ValueError, match=r"key: feature size d_k=7 exceeds"):
        fastattn.attention(k, q, v[:, :5], "general", params={"W": np.zeros((3, 7))})
    with pytest.raises(ValueError, match=r"params: attention size d_a=5 \(padded to 8\) exceeds the "
                                         r"BLAS 32-bit integer range \(max 6\)"):
        fastattn.attention(q[..., :6], k, v, "additive", params=_add(6, 3))
    monkeypatch.setattr(_validation, "BLAS_INT_MAX", 8)  # at the limit: runs
    from fastattn import _reference as R
    from support import assert_close

    P = _add(6, 3)
    got = fastattn.attention(q[..., :6], k, v, "additive", params=P)
    ref = R.attention(q[..., :6], k, v, lambda a, b: R.score_additive(a, b, P["W_q"], P["W_k"], P["v"]))
    assert_close(got, ref, np.float64)
