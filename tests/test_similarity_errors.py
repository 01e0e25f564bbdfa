"""Bad arguments to fastattn.attention: clear errors naming the argument."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn.similarity import CosineSimilarity

from conftest import randn


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
