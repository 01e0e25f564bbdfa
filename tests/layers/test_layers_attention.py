"""fastattn.layers.Attention / SelfAttention and Similarity.precompute_keys."""
import math

import numpy as np
import pytest

import fastattn
from fastattn import _reference as ref
from fastattn.layers import Attention, SelfAttention

from support import assert_close

SIMS = ["dot", "scaled_dot", "general", "additive", "concat", "cosine"]


def ref_score(name, p, d):
    """The reference score function of a built-in with the layer's params p."""
    if name == "dot":
        return lambda q, k: ref.score_dot(q, k)
    if name == "scaled_dot":
        return lambda q, k: ref.score_dot(q, k, float(p.get("scale", 1 / math.sqrt(d))))
    if name == "general":
        return lambda q, k: ref.score_general(q, k, p["W"], float(p.get("scale", 1.0)))
    if name == "additive":
        return lambda q, k: ref.score_additive(q, k, p["W_q"], p["W_k"], p["v"], p.get("b"))
    if name == "concat":
        return lambda q, k: ref.score_concat(q, k, p["W"], p["v"], p.get("b"))
    if name == "cosine":
        return lambda q, k: ref.score_cosine(q, k, float(p.get("beta", 1.0)))
    raise AssertionError(name)


def ref_layer(layer, name, query, key, value, mask=None, is_causal=False):
    sd = {k: np.asarray(v, np.float64) for k, v in layer.state_dict().items()}
    proj = lambda x, n: np.asarray(x, np.float64) @ sd[f"W_{n}"].T + sd.get(f"b_{n}", 0)
    q, k, v = proj(query, "Q"), proj(key, "K"), proj(value, "V")
    p = {kk[4:]: vv for kk, vv in sd.items() if kk.startswith("sim.")}
    # randomise nothing here: parameters come from the layer
    return ref.attention(q, k, v, ref_score(name, p, q.shape[-1]), mask, is_causal, return_weights=True)


def _perturb(layer, rng):
    """Non-trivial values for every parameter (biases are zero-initialised)."""
    sd = layer.state_dict()
    layer.load_state_dict({k: v + 0.3 * rng.standard_normal(v.shape) for k, v in sd.items()})


@pytest.mark.parametrize("sim", SIMS)
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_attention_matches_reference(sim, dtype, rng):
    layer = Attention(4, 6, 5, similarity=sim, embed_dim=8, out_dim=3, attn_dim=7, bias=True, seed=0,
                      dtype=dtype)
    _perturb(layer, rng)
    q = rng.standard_normal((2, 3, 4)).astype(dtype)
    k = rng.standard_normal((2, 5, 6)).astype(dtype)
    v = rng.standard_normal((2, 5, 5)).astype(dtype)
    key_mask = np.array([[True, True, True, False, False], [True] * 5])
    attn_mask = np.ones((3, 5), bool)
    attn_mask[1, :2] = False
    copies = [a.copy() for a in (q, k, v, key_mask, attn_mask)]
    out, w = layer(q, k, v, key_mask=key_mask, attn_mask=attn_mask, return_weights=True)
    for a, b in zip((q, k, v, key_mask, attn_mask), copies):
        np.testing.assert_array_equal(a, b)
    assert out.dtype == dtype and out.shape == (2, 3, 3) and w.shape == (2, 3, 5)
    allowed = attn_mask[None] & key_mask[:, None, :]
    r_out, r_w = ref_layer(layer, sim, q, k, v, allowed)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    assert np.all(w[~allowed] == 0)


@pytest.mark.parametrize("sim", ["scaled_dot", "additive"])
def test_self_attention_causal_and_padding(sim, rng):
    layer = SelfAttention(6, similarity=sim, causal=True, seed=1, dtype=np.float64)
    _perturb(layer, rng)
    x = rng.standard_normal((2, 5, 6))
    km = np.array([[True] * 5, [True, True, True, False, False]])
    out, w = layer(x, key_mask=km, return_weights=True)
    r_out, r_w = ref_layer(layer, sim, x, x, x, km[:, None, :], is_causal=True)
    assert_close(out, r_out)
    assert_close(w, r_w)
    assert np.all(np.triu(w[0], 1) == 0)
    # unbatched equals a batch of one
    np.testing.assert_allclose(layer(x[0]), layer(x[:1])[0], rtol=1e-13, atol=1e-14)


def test_fully_masked_row_gives_zeros(rng):
    layer = Attention(3, similarity="additive", seed=0, dtype=np.float64)
    q, k = rng.standard_normal((2, 2, 3)), rng.standard_normal((2, 4, 3))
    out, w = layer(q, k, key_mask=np.array([[False] * 4, [True] * 4]), return_weights=True)
    assert np.all(out[0] == 0) and np.all(w[0] == 0)
    np.testing.assert_allclose(w[1].sum(-1), 1.0)


def test_hand_computed_2x2():
    layer = Attention(2, similarity="dot", dtype=np.float64)
    eye = np.eye(2)
    layer.load_state_dict({"W_Q": eye, "W_K": eye, "W_V": eye})
    q = np.array([[1.0, 0.0], [0.0, 2.0]])
    k = np.array([[1.0, 0.0], [0.0, 1.0]])
    v = np.array([[1.0, 2.0], [3.0, 4.0]])
    out, w = layer(q, k, v, return_weights=True)
    a = math.e / (1 + math.e)          # row 0: scores (1, 0)
    b = math.e ** 2 / (1 + math.e ** 2)  # row 1: scores (0, 2)
    np.testing.assert_allclose(w, [[a, 1 - a], [1 - b, b]], rtol=1e-15)
    np.testing.assert_allclose(out, [[a + 3 * (1 - a), 2 * a + 4 * (1 - a)],
                                     [(1 - b) + 3 * b, 2 * (1 - b) + 4 * b]], rtol=1e-15)
    # float additive mask: -inf on key 1 for query 0
    out, w = layer(q, k, v, attn_mask=np.array([[0.0, -np.inf], [0.0, 0.0]]), return_weights=True)
    np.testing.assert_allclose(w[0], [1.0, 0.0])
    np.testing.assert_allclose(out[0], [1.0, 2.0])


@pytest.mark.parametrize("sim", SIMS)
def test_state_dict_and_config_round_trip(sim, rng):
    a = Attention(4, 6, 5, similarity=sim, attn_dim=3, seed=7, dtype=np.float64)
    q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 6))
    v = rng.standard_normal((2, 5, 5))
    b = Attention.from_config(a.get_config())
    np.testing.assert_array_equal(a(q, k, v), b(q, k, v))
    _perturb(a, rng)
    assert not np.array_equal(a(q, k, v), b(q, k, v))
    b.load_state_dict(a.state_dict())
    np.testing.assert_array_equal(a(q, k, v), b(q, k, v))


def test_similarity_config_kept():
    a = Attention(4, similarity=fastattn.similarity.AdditiveSimilarity(normalize=True), seed=0)
    cfg = a.get_config()
    assert cfg["similarity"] == {"name": "additive", "normalize": True}
    b = Attention.from_config(cfg)
    assert b.similarity.normalize and "sim.g" in b.state_dict()
    s = SelfAttention(4, similarity="general", causal=True, seed=2)
    s2 = SelfAttention.from_config(s.get_config())
    assert s2.causal and s2.get_config() == s.get_config()


def test_bad_inputs(rng):
    a = Attention(4, 6, 5, seed=0)
    q, k, v = np.zeros((2, 3, 4)), np.zeros((2, 5, 6)), np.zeros((2, 5, 5))
    with pytest.raises(ValueError, match=r"query: expected last dim 4, got shape \(2, 3, 5\)"):
        a(np.zeros((2, 3, 5)), k, v)
    with pytest.raises(ValueError, match=r"key: expected last dim 6, got shape \(2, 5, 4\)"):
        a(q, np.zeros((2, 5, 4)), v)
    with pytest.raises(ValueError, match=r"key: expected batch size 2 \(query's\), got shape \(3, 5, 6\)"):
        a(q, np.zeros((3, 5, 6)), np.zeros((3, 5, 5)))
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(2, 5\), got \(2, 4\)"):
        a(q, k, v, key_mask=np.ones((2, 4), bool))
    with pytest.raises(TypeError, match="key_mask: expected a boolean array"):
        a(q, k, v, key_mask=np.ones((2, 5)))
    with pytest.raises(ValueError, match="similarity"):
        Attention(4, similarity="no_such_similarity")
    with pytest.raises(ValueError, match=r"state_dict\['W_Q'\]: expected shape \(4, 4\), got \(4, 3\)"):
        a.load_state_dict(dict(a.state_dict(), W_Q=np.zeros((4, 3))))
    with pytest.raises(TypeError, match="causal: expected a bool"):
        SelfAttention(4, causal=1)


@pytest.mark.parametrize("sim", ["additive", "concat", "general", "dot", "scaled_dot", "cosine"])
def test_precompute_keys_is_exact(sim, rng):
    """Keys projected once give the same attention as the plain call (the decoder's cache)."""
    s = fastattn.get_similarity(sim)
    d_k = 5 if sim in ("dot", "scaled_dot", "cosine") else 6
    raw = s.init_params(5, d_k, rng=1, d_a=7)
    if raw:
        raw = {k: v + 0.2 * rng.standard_normal(np.shape(v)) for k, v in raw.items()}
    q, k, v = rng.standard_normal((2, 3, 5)), rng.standard_normal((2, 4, d_k)), rng.standard_normal((2, 4, 2))
    params = s.check_params(raw, 5, d_k, np.float64)
    o1, w1 = fastattn.attention(q, k, v, s, params=raw, return_weights=True)
    s2, p2, k2 = s.precompute_keys(k, params)
    o2, w2 = fastattn.attention(q, k2, v, s2, params=p2, return_weights=True)
    np.testing.assert_allclose(o2, o1, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(w2, w1, rtol=1e-13, atol=1e-14)
    if sim in ("additive", "concat"):
        assert s2.name == "additive_precomputed" and k2.shape == (2, 4, 7)
        # the fused kernel runs it, and its NumPy score agrees
        assert fastattn._attention.attention_path(q, k2, v, s2, params=p2) == "fused"
        np.testing.assert_allclose(s2.score(q, k2, p2), ref_score(sim, params, 5)(q, k), rtol=1e-13)
        # the cached parameters skip re-checking only while they are the very arrays made here
        bad = dict(p2, W_q=np.full(p2["W_q"].shape, np.nan))
        with pytest.raises(ValueError, match=r"params\['W_q'\]: contains NaN"):
            fastattn.attention(q, k2, v, s2, params=bad)
        with pytest.raises(ValueError, match=r"params\['W_q'\]: expected shape"):
            fastattn.attention(q[..., :4], k2, v, s2, params=p2)


torch = pytest.importorskip("torch")


def test_self_attention_against_torch_sdpa(rng):
    layer = SelfAttention(8, similarity="scaled_dot", causal=True, bias=True, seed=3, dtype=np.float64)
    _perturb(layer, rng)
    x = rng.standard_normal((2, 6, 8))
    sd = {k: torch.tensor(v) for k, v in layer.state_dict().items()}
    tx = torch.tensor(x)
    q, k, v = (tx @ sd[f"W_{n}"].T + sd[f"b_{n}"] for n in "QKV")
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(layer(x), want.numpy())


def test_additive_attention_against_torch(rng):
    layer = Attention(4, 6, 6, similarity="additive", attn_dim=5, seed=4, dtype=np.float64)
    _perturb(layer, rng)
    q, k = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 7, 6))
    km = np.array([[True] * 7, [True] * 4 + [False] * 3])
    sd = {k_: torch.tensor(v) for k_, v in layer.state_dict().items()}
    tq, tk = torch.tensor(q) @ sd["W_Q"].T, torch.tensor(k) @ sd["W_K"].T
    tv = torch.tensor(k) @ sd["W_V"].T
    e = torch.tanh((tq @ sd["sim.W_q"].T)[:, :, None, :] + (tk @ sd["sim.W_k"].T)[:, None, :, :]
                   + sd["sim.b"]) @ sd["sim.v"]
    e = e.masked_fill(~torch.tensor(km)[:, None, :], float("-inf"))
    a = torch.softmax(e, dim=-1)
    out, w = layer(q, k, key_mask=km, return_weights=True)
    assert_close(w, a.numpy())
    assert_close(out, (a @ tv).numpy())
