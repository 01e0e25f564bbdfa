"""fastattn.attention with every similarity against the float64 oracle.

The oracle (``fastattn._reference.attention`` and the ``score_*`` formulas)
builds the full score tensor from the textbook formula; every similarity,
including a NumPy plugin and (when built) a compiled plugin, must match it
over masks, causality, weights, dtypes and shapes.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import _attention, _reference as R
from fastattn.similarity import ParamSpec, Similarity

from support import allowed_matrix, assert_close, check_weights, randn


class NegSqDist(Similarity):
    """A user plugin in NumPy: -gamma |q - k|^2, via the expansion."""

    name = "test_neg_sq_dist"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0)}
    same_dims = True

    def score(self, query, key, params):
        qq = np.sum(query * query, axis=-1)[..., :, None]
        kk = np.sum(key * key, axis=-1)[..., None, :]
        return -params["gamma"] * (qq + kk - 2 * query @ np.swapaxes(key, -1, -2))


def _compiled_selftest():
    """The ABI self-test plugin compiled into fastattn._scores (None if not built)."""
    try:
        from fastattn import _scores
    except ImportError:
        return None
    return fastattn.testing.selftest_similarity()


SIMS = ["dot", "scaled_dot", "scaled_dot_s", "general", "additive", "additive_norm",
        "concat", "cosine", "numpy_plugin", "compiled_plugin"]


def make_case(name, dtype, d_q, d_k, rng, d_a=7):
    """(similarity, params, reference score function, expected path)."""
    dt = np.dtype(dtype)

    def rnd(*shape, scale=1.0):
        return randn(rng, shape, dt, scale)

    if name == "dot":
        return "dot", None, lambda q, k: R.score_dot(q, k), "sdpa"
    if name == "scaled_dot":
        return "scaled_dot", None, lambda q, k: R.score_dot(q, k, 1 / np.sqrt(q.shape[-1])), "sdpa"
    if name == "scaled_dot_s":
        return "scaled_dot", {"scale": 0.7}, lambda q, k: R.score_dot(q, k, float(dt.type(0.7))), "sdpa"
    if name == "general":
        W = rnd(d_q, d_k, scale=0.5)
        return "general", {"W": W, "scale": 0.9}, \
            lambda q, k: R.score_general(q, k, W, float(dt.type(0.9))), "sdpa"
    if name in ("additive", "additive_norm"):
        Wq, Wk, v, b = rnd(d_a, d_q, scale=0.6), rnd(d_a, d_k, scale=0.6), rnd(d_a), rnd(d_a)
        if name == "additive":
            return "additive", {"W_q": Wq, "W_k": Wk, "v": v, "b": b}, \
                lambda q, k: R.score_additive(q, k, Wq, Wk, v, b), "fused"
        g = dt.type(1.7)
        v64 = v.astype(np.float64)
        veff = (float(g) * v64 / np.linalg.norm(v64)).astype(dt)  # what the kernel sees
        return fastattn.similarity.AdditiveSimilarity(normalize=True), \
            {"W_q": Wq, "W_k": Wk, "v": v, "b": b, "g": g}, \
            lambda q, k: R.score_additive(q, k, Wq, Wk, veff, b), "fused"
    if name == "concat":
        W, v, b = rnd(d_a, d_q + d_k, scale=0.6), rnd(d_a), rnd(d_a)
        return "concat", {"W": W, "v": v, "b": b}, lambda q, k: R.score_concat(q, k, W, v, b), "fused"
    if name == "cosine":
        return "cosine", {"beta": 3.0}, lambda q, k: R.score_cosine(q, k, 3.0), "sdpa"
    if name == "numpy_plugin":
        return NegSqDist(), {"gamma": 0.25}, lambda q, k: R.score_neg_sq_dist(q, k, 0.25), "tiled"
    if name == "compiled_plugin":
        sim = _compiled_selftest()
        if sim is None:
            pytest.skip("fastattn._scores is not built")
        return sim, {"gamma": 0.25}, lambda q, k: R.score_neg_sq_dist(q, k, 0.25), "fused"
    raise AssertionError(name)


def _dims(name):
    same = name in ("dot", "scaled_dot", "scaled_dot_s", "cosine", "numpy_plugin", "compiled_plugin")
    return (6, 6) if same else (6, 5)


MASKS = ["none", "bool", "float", "float_batch", "causal", "causal_br", "padding", "fully_masked",
         "bool_causal"]


def make_mask(kind, batch, Lq, Lk, rng, dtype):
    """(attn_mask, is_causal, causal_alignment)."""
    if kind == "none":
        return None, False, "top_left"
    if kind == "bool":
        return rng.random(batch + (Lq, Lk)) < 0.7, False, "top_left"
    if kind == "float":
        m = randn(rng, (Lq, Lk), dtype)
        m[rng.random((Lq, Lk)) < 0.2] = -np.inf
        return m, False, "top_left"
    if kind == "float_batch":  # a float bias per batch item, plus a new leading dim of 3
        m = randn(rng, (3,) + batch + (Lq, Lk), dtype)
        m[rng.random(m.shape) < 0.2] = -np.inf
        m[1, ..., 3, :] = -np.inf  # fully masked rows in one of the new items
        return m, False, "top_left"
    if kind == "causal":
        return None, True, "top_left"
    if kind == "causal_br":
        return None, True, "bottom_right"
    if kind == "padding":  # (B, 1, 1, Lk) style key mask: True = real token
        lens = rng.integers(1, Lk + 1, size=batch)
        m = np.arange(Lk) < lens[..., None]
        return m[..., None, :], False, "top_left"
    if kind == "fully_masked":
        m = rng.random((Lq, Lk)) < 0.5
        m[0] = False
        m[Lq // 2] = False
        return m, False, "top_left"
    if kind == "bool_causal":
        m = rng.random((Lq, Lk)) < 0.8
        m[-1] = False
        return m, True, "top_left"
    raise AssertionError(kind)


def check(sim_name, dtype, qshape, kshape, vshape, mask_kind, rng, weights=True):
    dt = np.dtype(dtype)
    d_q, d_k = _dims(sim_name)
    q = randn(rng, qshape + (d_q,), dt)
    k = randn(rng, kshape + (d_k,), dt)
    v = randn(rng, vshape, dt)
    batch = np.broadcast_shapes(qshape[:-1], kshape[:-1], vshape[:-2])
    Lq, Lk = qshape[-1], kshape[-1]
    sim, params, ref_score, path = make_case(sim_name, dt, d_q, d_k, rng)
    mask, causal, align = make_mask(mask_kind, batch, Lq, Lk, rng, dt)
    before = [a.copy() for a in (q, k, v)]
    pbefore = {n: np.copy(x) for n, x in (params or {}).items()}
    kw = dict(params=params, attn_mask=mask, is_causal=causal, causal_alignment=align)
    assert _attention.attention_path(q, k, v, sim, **kw) == path
    ref, ref_w = R.attention(q, k, v, ref_score, mask, causal, causal_alignment=align,
                             return_weights=True)
    got = fastattn.attention(q, k, v, sim, **kw)
    assert got.dtype == dt and got.shape == ref.shape
    assert_close(got, ref, dt)
    if weights:
        got2, w = fastattn.attention(q, k, v, sim, return_weights=True, **kw)
        assert_close(got2, ref, dt)
        assert_close(w, ref_w, dt)
        allowed = allowed_matrix(Lq, Lk, mask, causal, align)
        check_weights(w, allowed, dt)
    # no input was modified
    for a, b in zip((q, k, v), before):
        np.testing.assert_array_equal(a, b)
    for n, x in (params or {}).items():
        np.testing.assert_array_equal(x, pbefore[n])
    return got


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_oracle_masks(sim_name, dtype, mask_kind, rng):
    # 70 queries (> one C and one NumPy query block's worth in places), 300
    # keys (> one tile on every path), two batch items
    check(sim_name, dtype, (2, 70), (2, 300), (2, 300, 4), mask_kind, rng)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_oracle_bottom_right_causal_more_queries_than_keys(sim_name, dtype, rng):
    """Lq > Lk with bottom-right alignment: the first Lq - Lk query rows see
    no key (zeros), the rest a growing prefix of the keys."""
    got = check(sim_name, dtype, (2, 150), (2, 20), (2, 20, 3), "causal_br", rng)
    assert np.all(got[:, :130] == 0) and np.all(np.any(got[:, 130:] != 0, axis=-1))
    # one batch item, Lq much larger than Lk
    check(sim_name, dtype, (1, 70), (1, 9), (1, 9, 2), "causal_br", rng)


SHAPES = [
    ((1,), (1,), (1, 3)),                   # Lq = Lk = 1
    ((5,), (9,), (9, 2)),                   # odd, Lq != Lk
    ((3, 1, 17), (1, 4, 17), (1, 17, 5)),   # leading batch dims that broadcast
    ((2, 130), (2, 129), (2, 129, 3)),      # > one block on every path, odd
    ((1, 2), (1, 600), (1, 600, 8)),        # decoding-like: few queries, many keys
]


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: "x".join(map(str, s[0])) + "-" + "x".join(map(str, s[1])))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_oracle_shapes(sim_name, dtype, shapes, rng):
    qs, ks, vs = shapes
    check(sim_name, dtype, qs, ks, vs, "bool_causal" if qs[-1] > 1 else "none", rng)


@pytest.mark.parametrize("sim_name", SIMS)
def test_float16_and_integer_dtypes(sim_name, rng):
    d_q, d_k = _dims(sim_name)
    q = randn(rng, (4, d_q), np.float16)
    k = randn(rng, (6, d_k), np.float16)
    v = randn(rng, (6, 3), np.float16)
    sim, params, ref_score, _ = make_case(sim_name, np.float32, d_q, d_k, rng)
    got = fastattn.attention(q, k, v, sim, params=params)
    assert got.dtype == np.float16
    ref = R.attention(q, k, v, ref_score)
    assert_close(got, ref, np.float16)
    qi = rng.integers(-2, 3, size=(4, d_q))
    ki = rng.integers(-2, 3, size=(6, d_k))
    vi = rng.integers(-2, 3, size=(6, 3))
    sim, params, ref_score, _ = make_case(sim_name, np.float64, d_q, d_k, rng)
    got = fastattn.attention(qi, ki, vi, sim, params=params)
    assert got.dtype == np.float64
    assert_close(got, R.attention(qi, ki, vi, ref_score), np.float64)


@pytest.mark.parametrize("sim_name", SIMS)
def test_out_argument(sim_name, rng):
    d_q, d_k = _dims(sim_name)
    q, k, v = randn(rng, (2, 5, d_q)), randn(rng, (2, 8, d_k)), randn(rng, (2, 8, 3))
    sim, params, ref_score, _ = make_case(sim_name, np.float64, d_q, d_k, rng)
    out = np.full((2, 5, 3), np.nan)
    r = fastattn.attention(q, k, v, sim, params=params, out=out)
    assert r is out
    assert_close(out, R.attention(q, k, v, ref_score), np.float64)
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5, 3\), got \(5, 3\)"):
        fastattn.attention(q, k, v, sim, params=params, out=np.empty((5, 3)))


@pytest.mark.parametrize("sim_name", ["additive", "concat", "numpy_plugin", "compiled_plugin"])
def test_empty_and_degenerate(sim_name, rng):
    d_q, d_k = _dims(sim_name)
    sim, params, ref_score, _ = make_case(sim_name, np.float64, d_q, d_k, rng)
    # no keys: every row fully masked -> zeros
    got = fastattn.attention(randn(rng, (3, d_q)), np.zeros((0, d_k)), np.zeros((0, 2)), sim,
                             params=params)
    np.testing.assert_array_equal(got, np.zeros((3, 2)))
    # no queries
    got = fastattn.attention(np.zeros((0, d_q)), randn(rng, (4, d_k)), randn(rng, (4, 2)), sim,
                             params=params)
    assert got.shape == (0, 2)
    # no value features, weights still computed
    q, k = randn(rng, (3, d_q)), randn(rng, (4, d_k))
    got, w = fastattn.attention(q, k, np.zeros((4, 0)), sim, params=params, return_weights=True)
    assert got.shape == (3, 0)
    _, ref_w = R.attention(q, k, np.zeros((4, 0)), ref_score, return_weights=True)
    assert_close(w, ref_w, np.float64)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
@pytest.mark.parametrize("sim_name", ["additive", "compiled_plugin"])
def test_threads_give_the_same_result(sim_name, n_threads, rng):
    d_q, d_k = _dims(sim_name)
    q, k, v = randn(rng, (3, 200, d_q), np.float32), randn(rng, (3, 333, d_k), np.float32), \
        randn(rng, (3, 333, 16), np.float32)
    sim, params, ref_score, _ = make_case(sim_name, np.float32, d_q, d_k, rng, d_a=32)
    got = fastattn.attention(q, k, v, sim, params=params, is_causal=True, n_threads=n_threads)
    assert_close(got, R.attention(q, k, v, ref_score, is_causal=True), np.float32)
    with fastattn.threads(1):
        one = fastattn.attention(q, k, v, sim, params=params, is_causal=True)
    np.testing.assert_array_equal(got, one)  # tasks are independent: bitwise equal


def test_layouts_no_copy_needed(rng):
    """Strided, transposed and read-only inputs give the same result."""
    from support import make_layout

    q, k, v = randn(rng, (2, 3, 9, 5)), randn(rng, (2, 3, 11, 4)), randn(rng, (2, 3, 11, 6))
    sim, params, ref_score, _ = make_case("additive", np.float64, 5, 4, rng)
    ref = R.attention(q, k, v, ref_score)
    for layout in ("strided", "padded", "transposed", "flipped_batch", "readonly", "unaligned"):
        got = fastattn.attention(make_layout(q, layout), make_layout(k, layout),
                                 make_layout(v, layout), sim, params=params)
        assert_close(got, ref, np.float64, err_msg=layout)


@pytest.mark.parametrize("sim_name", ["additive", "concat", "numpy_plugin", "compiled_plugin", "general"])
def test_out_written_directly_and_overlap(sim_name, rng):
    """out= in the compute dtype is written in place (no temporary needed);
    an out that overlaps the value input still gives the right result."""
    d_q, d_k = _dims(sim_name)
    q, k = randn(rng, (2, 5, d_q)), randn(rng, (2, 8, d_k))
    sim, params, ref_score, _ = make_case(sim_name, np.float64, d_q, d_k, rng)
    big = np.full((2, 8, 3), np.nan)
    v = big  # out will be a view of the value buffer: overlaps
    v[...] = randn(rng, (2, 8, 3))
    ref = R.attention(q, k, v.copy(), ref_score)
    out = big[:, :5, :]
    r = fastattn.attention(q, k, v, sim, params=params, out=out)
    assert r is out
    assert_close(out, ref, np.float64)
    padded_buf = np.full((2, 5, 7), np.nan)
    padded = padded_buf[..., 2:5]  # rows with a stride: still direct
    v2 = randn(rng, (2, 8, 3))
    r = fastattn.attention(q, k, v2, sim, params=params, out=padded)
    assert r is padded
    assert_close(padded, R.attention(q, k, v2, ref_score), np.float64)
    assert np.all(np.isnan(padded_buf[..., :2])) and np.all(np.isnan(padded_buf[..., 5:]))


@pytest.mark.parametrize("mode", [1, 2, 3])
def test_failing_compiled_plugin_leaves_out_untouched(mode, rng):
    """A compiled plugin failing partway (error code 7, a NaN, a +inf score):
    out= is not partly written (the plugin path goes through a temporary)."""
    sim = _compiled_selftest()
    if sim is None:
        pytest.skip("fastattn._scores is not built")
    q, v = randn(rng, (4, 200, 6)), randn(rng, (4, 200, 3))
    out = np.full((4, 200, 3), 7.0)
    with pytest.raises((_attention.SimilarityError, ValueError),
                       match=r"similarity 'fastattn_selftest_neg_sq_dist': (the compiled score "
                             r"function returned error code 7|score returned NaN or \+inf)"):
        fastattn.attention(q, q, v, sim, params={"mode": float(mode)}, out=out, n_threads=2)
    np.testing.assert_array_equal(out, np.full((4, 200, 3), 7.0))
    r = fastattn.attention(q, q, v, sim, params={"gamma": 0.5}, out=out)  # and it works
    assert r is out
    assert_close(out, R.attention(q, q, v, lambda a, b: R.score_neg_sq_dist(a, b, 0.5)), np.float64)


@pytest.mark.parametrize("sim_name", ["additive", "concat", "cosine", "general", "numpy_plugin", "compiled_plugin"])
def test_key_permutation_invariance(sim_name, rng):
    """Permuting keys together with their values (and the mask) changes nothing."""
    d_q, d_k = _dims(sim_name)
    q, k, v = randn(rng, (2, 9, d_q)), randn(rng, (2, 333, d_k)), randn(rng, (2, 333, 4))
    mask = rng.random((9, 333)) < 0.5
    sim, params, _, _ = make_case(sim_name, np.float64, d_q, d_k, rng)
    perm = rng.permutation(333)
    a = fastattn.attention(q, k, v, sim, params=params, attn_mask=mask)
    b = fastattn.attention(q, k[:, perm], v[:, perm], sim, params=params, attn_mask=mask[:, perm])
    assert_close(b, a, np.float64)


@pytest.mark.parametrize("sim_name, layout", [("cosine", "C"), ("cosine", "padded"),
                                              ("additive", "unaligned"), ("general", "C")])
def test_attention_path_does_not_copy_the_inputs(sim_name, layout, rng):
    """attention_path only names the path: no normalised (cosine) or
    canonical (strided) copy of the full query and key."""
    import tracemalloc

    from support import make_layout

    d_q, d_k = _dims(sim_name)
    q = make_layout(randn(rng, (2, 2048, d_q * 40)), layout)  # 3.9 MB
    k = make_layout(randn(rng, (2, 2048, d_k * 40)), layout)
    v = randn(rng, (2, 2048, 2))
    sim, params, _, path = make_case(sim_name, np.float64, d_q * 40, d_k * 40, rng)
    _attention.attention_path(q[:, :2], k[:, :2], v[:, :2], sim, params=params)  # warm up
    tracemalloc.start()
    got = _attention.attention_path(q, k, v, sim, params=params)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert got == path
    assert peak < 2**20 + sum(np.asarray(x).nbytes for x in (params or {}).values()), peak
