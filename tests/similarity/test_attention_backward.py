"""fastattn.functional.attention_backward with every similarity: against the
float64 oracle's dense backward (``fastattn._reference.attention_backward``
and the ``score_*_vjp`` formulas) over masks and dtypes, against torch
autograd (float64, 1e-10 relative, the scores written in torch below),
against central finite differences (inputs and parameters); fully masked
rows, broadcast batch dims, dtypes, the NumPy tiled path's memory, the
similarities without a backward, and bad input.

Upstream gradients are random (never all ones, which hides transposition and
scaling bugs).
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import _attention, _reference as R
from fastattn._attention import SimilarityError
from fastattn.functional import attention_backward
from fastattn.similarity import AdditiveSimilarity, DotSimilarity, Similarity

import test_plugin_backward
from support import assert_close, randn
from test_similarity import MASKS, NegSqDist, make_mask


class NegSqDistBwd(NegSqDist):
    """The NumPy plugin of test_similarity with a score_backward, from the
    expansion S = -gamma (|q|^2 + |k|^2 - 2 q.k) (the oracle uses q - k)."""

    name = "test_neg_sq_dist_bwd"

    def score_backward(self, query, key, params, grad_scores):
        gamma = params["gamma"]
        ds = grad_scores
        dq = -2 * gamma * (ds.sum(-1)[..., None] * query - ds @ key)
        dk = -2 * gamma * (ds.sum(-2)[..., None] * key - np.swapaxes(ds, -1, -2) @ query)
        qq = np.sum(query * query, -1)[..., :, None]
        kk = np.sum(key * key, -1)[..., None, :]
        dgamma = -np.sum(ds * (qq + kk - 2 * query @ np.swapaxes(key, -1, -2)))
        return dq, dk, {"gamma": dgamma}


SIMS = ["dot", "scaled_dot", "scaled_dot_s", "general", "additive", "additive_norm", "concat",
        "cosine", "numpy_plugin", "compiled_plugin"]
SAME_DIMS = {"dot", "scaled_dot", "scaled_dot_s", "cosine", "numpy_plugin", "compiled_plugin"}


def dims(name):
    return (6, 6) if name in SAME_DIMS else (6, 5)


def make_case(name, dtype, d_q, d_k, rng, d_a=5):
    """(similarity, params, oracle score_vjp(q, k), names of dparams)."""
    dt = np.dtype(dtype)

    def rnd(*shape, scale=1.0):
        return randn(rng, shape, dt, scale)

    def f(x):  # a python scalar as the compute dtype rounds it
        return float(dt.type(x))

    if name == "dot":
        return "dot", None, lambda q, k: R.score_dot_vjp(q, k), set()
    if name == "scaled_dot":
        return "scaled_dot", None, lambda q, k: R.score_dot_vjp(q, k, 1 / np.sqrt(d_q)), set()
    if name == "scaled_dot_s":
        return "scaled_dot", {"scale": 0.7}, lambda q, k: R.score_dot_vjp(q, k, f(0.7)), {"scale"}
    if name == "general":
        W = rnd(d_q, d_k, scale=0.5)
        return "general", {"W": W, "scale": 0.9}, \
            lambda q, k: R.score_general_vjp(q, k, W, f(0.9)), {"W", "scale"}
    if name in ("additive", "additive_norm"):
        Wq, Wk, v, b = rnd(d_a, d_q, scale=0.6), rnd(d_a, d_k, scale=0.6), rnd(d_a), rnd(d_a)
        params = {"W_q": Wq, "W_k": Wk, "v": v, "b": b}
        if name == "additive":
            return "additive", params, lambda q, k: R.score_additive_vjp(q, k, Wq, Wk, v, b), \
                set(params)
        params["g"] = dt.type(1.7)
        return AdditiveSimilarity(normalize=True), params, \
            lambda q, k: R.score_additive_vjp(q, k, Wq, Wk, v, b, g=params["g"]), set(params)
    if name == "concat":
        W, v, b = rnd(d_a, d_q + d_k, scale=0.6), rnd(d_a), rnd(d_a)
        return "concat", {"W": W, "v": v, "b": b}, \
            lambda q, k: R.score_concat_vjp(q, k, W, v, b), {"W", "v", "b"}
    if name == "cosine":
        return "cosine", {"beta": 3.0}, lambda q, k: R.score_cosine_vjp(q, k, f(3.0)), {"beta"}
    if name == "numpy_plugin":
        return NegSqDistBwd(), {"gamma": 0.25}, \
            lambda q, k: R.score_neg_sq_dist_vjp(q, k, f(0.25)), {"gamma"}
    if name == "compiled_plugin":
        # fastattn's C self-test plugin (ABI version 2: a C score_backward);
        # its "mode" parameter only selects failures and gets a zero gradient
        def vjp(q, k):
            s, inner = R.score_neg_sq_dist_vjp(q, k, f(0.25))
            return s, lambda ds: (lambda dq, dk, dp: (dq, dk, {**dp, "mode": 0.0}))(*inner(ds))
        return fastattn.testing.selftest_similarity(), {"gamma": 0.25, "mode": 0.0}, vjp, \
            {"gamma", "mode"}
    raise AssertionError(name)


def forward(q, k, v, sim, params, mask=None, causal=False, align="top_left"):
    return fastattn.attention(q, k, v, sim, params=params, attn_mask=mask, is_causal=causal,
                              causal_alignment=align, return_lse=True)


def backward(g, q, k, v, sim, params, mask=None, causal=False, align="top_left", nt=None):
    out, lse = forward(q, k, v, sim, params, mask, causal, align)
    return attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse, attn_mask=mask,
                              is_causal=causal, causal_alignment=align, n_threads=nt)


def out_batch(batch, mask):
    return batch if mask is None else np.broadcast_shapes(batch, np.shape(mask)[:-2])


# float32: a scalar parameter's gradient (scale, beta, gamma, g) is one sum
# over every (query, key) pair of the batch, with cancellation; measured over
# 3 seeds x this file's grid up to 4.2e-5 relative to max(1, |reference|)
# (general's scale; every other gradient within the table's 2e-5).  They get
# 2e-4.  (Over 20 seeds general's dscale was 1.7e-5 off on average, torch's
# float32 autograd 6.3e-6: the backward works from the rounded float32 out
# and lse, as FlashAttention does.)
F32_SCALAR_TOL = (2e-4, 2e-4)


def check_grads(got, ref, dt, inputs, params, names, param_tol=None):
    for what, a, r, inp in zip(("dq", "dk", "dv"), got[:3], ref[:3], inputs):
        assert a.shape == inp.shape and a.dtype == inp.dtype, (what, a.shape, a.dtype)
        assert_close(a, r, dt, err_msg=what)
    assert set(got[3]) == names
    for n in names:
        a, r = got[3][n], np.asarray(ref[3][n])
        assert a.shape == np.shape(params[n]), (n, a.shape)
        if param_tol is None or np.ndim(r):
            assert_close(a, r, dt, err_msg=n)
        else:
            scale = max(1.0, float(np.max(np.abs(r))))
            np.testing.assert_allclose(a.astype(np.float64), r, rtol=param_tol[0],
                                       atol=param_tol[1] * scale, err_msg=n)


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_matches_the_oracle(sim_name, dtype, mask_kind, rng):
    # 70 queries and 150 keys: more than one query block and key tile of the
    # NumPy tiled backward, ragged last ones
    dt = np.dtype(dtype)
    d_q, d_k = dims(sim_name)
    Lq, Lk = 70, 150
    q, k, v = randn(rng, (2, Lq, d_q), dt), randn(rng, (2, Lk, d_k), dt), randn(rng, (2, Lk, 4), dt)
    sim, params, vjp, names = make_case(sim_name, dt, d_q, d_k, rng)
    mask, causal, align = make_mask(mask_kind, (2,), Lq, Lk, rng, dt)
    g = randn(rng, out_batch((2,), mask) + (Lq, 4), dt)
    before = [a.copy() for a in (q, k, v, g)]
    pbefore = {n: np.copy(x) for n, x in (params or {}).items()}
    out, lse = forward(q, k, v, sim, params, mask, causal, align)
    obefore = (out.copy(), lse.copy())
    got = attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse, attn_mask=mask,
                             is_causal=causal, causal_alignment=align)
    ref = R.attention_backward(g, q, k, v, vjp, mask, causal, causal_alignment=align)
    check_grads(got, ref, dt, (q, k, v), params, names,
                F32_SCALAR_TOL if dt == np.float32 else None)
    for n in names:
        assert got[3][n].dtype == dt
    for a, b in zip((q, k, v, g) + (out, lse), before + list(obefore)):
        np.testing.assert_array_equal(a, b)
    for n, x in (params or {}).items():
        np.testing.assert_array_equal(x, pbefore[n])


@pytest.mark.parametrize("sim_name", SIMS)
def test_broadcast_batch_dims_are_summed_back(sim_name, rng):
    d_q, d_k = dims(sim_name)
    q = randn(rng, (3, 1, 9, d_q))
    k = randn(rng, (1, 4, 11, d_k))
    v = randn(rng, (4, 11, 3))
    sim, params, vjp, names = make_case(sim_name, np.float64, d_q, d_k, rng)
    mask = randn(rng, (2, 1, 1, 9, 11))    # a float mask with a batch dim of its own
    mask[0, ..., 4, :] = -np.inf
    g = randn(rng, (2, 3, 4, 9, 3))
    got = backward(g, q, k, v, sim, params, mask, True, "bottom_right")
    ref = R.attention_backward(g, q, k, v, vjp, mask, True, causal_alignment="bottom_right")
    check_grads(got, ref, np.float64, (q, k, v), params, names)


# ----------------------------------------------------------------- torch

torch = pytest.importorskip("torch")


def torch_scores(name, q, k, tp):
    """The scores of each similarity, written in torch (tp: torch parameters)."""
    T = torch
    kt = k.transpose(-1, -2)
    if name == "dot":
        return q @ kt
    if name == "scaled_dot":
        return (q @ kt) / np.sqrt(q.shape[-1])
    if name == "scaled_dot_s":
        return tp["scale"] * (q @ kt)
    if name == "general":
        return tp["scale"] * (q @ tp["W"] @ kt)
    if name in ("additive", "additive_norm"):
        v = tp["v"] if name == "additive" else tp["g"] * tp["v"] / tp["v"].norm()
        h = (q @ tp["W_q"].T)[..., :, None, :] + (k @ tp["W_k"].T)[..., None, :, :] + tp["b"]
        return T.tanh(h) @ v
    if name == "concat":
        Lq, Lk = q.shape[-2], k.shape[-2]
        batch = T.broadcast_shapes(q.shape[:-2], k.shape[:-2])
        cat = T.cat([q[..., :, None, :].expand(*batch, Lq, Lk, q.shape[-1]),
                     k[..., None, :, :].expand(*batch, Lq, Lk, k.shape[-1])], dim=-1)
        return T.tanh(cat @ tp["W"].T + tp["b"]) @ tp["v"]
    if name == "cosine":
        F = T.nn.functional
        return tp["beta"] * (F.normalize(q, dim=-1, eps=1e-12)
                             @ F.normalize(k, dim=-1, eps=1e-12).transpose(-1, -2))
    if name in ("numpy_plugin", "compiled_plugin"):
        return -tp["gamma"] * ((q[..., :, None, :] - k[..., None, :, :]) ** 2).sum(-1)
    raise AssertionError(name)


def torch_grads(name, g, q, k, v, params, mask, causal, align):
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    tp = {n: torch.tensor(np.asarray(x, np.float64), requires_grad=True)
          for n, x in (params or {}).items()}
    s = torch_scores(name, tq, tk, tp)
    if mask is not None:
        tm = torch.tensor(mask)
        s = s.masked_fill(~tm, -np.inf) if mask.dtype == np.bool_ else s + tm
    if causal:
        Lq, Lk = q.shape[-2], k.shape[-2]
        off = 0 if align == "top_left" else Lk - Lq
        forbid = torch.arange(Lk)[None, :] > torch.arange(Lq)[:, None] + off
        s = s.masked_fill(forbid, -np.inf)
    o = torch.softmax(s, dim=-1) @ tv
    o.backward(torch.tensor(g))
    return [t.grad.numpy() for t in (tq, tk, tv)], \
        {n: np.zeros(t.shape) if t.grad is None else t.grad.numpy() for n, t in tp.items()}


@pytest.mark.parametrize("mask_kind", ["none", "float", "causal_br", "padding"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_float64_against_torch_autograd(sim_name, mask_kind, rng):
    d_q, d_k = dims(sim_name)
    B, H, L, S = 2, 3, 20, 30
    q = randn(rng, (B, H, L, d_q))
    k = randn(rng, (B, 1, S, d_k))          # one key/value head shared by the query heads
    v = randn(rng, (B, 1, S, 5))
    sim, params, _, names = make_case(sim_name, np.float64, d_q, d_k, rng)
    mask, causal, align = make_mask(mask_kind, (B, H), L, S, rng, np.float64)
    if mask_kind == "float":
        mask[..., 0] = 0.0                    # torch's softmax gives NaN for fully masked rows
    g = randn(rng, (B, H, L, 5))
    want, want_p = torch_grads(sim_name, g, q, k, v, params, mask, causal, align)
    got = backward(g, q, k, v, sim, params, mask, causal, align)
    assert set(got[3]) == names == set(want_p) - ({"scale"} if sim_name == "scaled_dot" else set())
    for a, b in list(zip(got[:3], want)) + [(got[3][n], want_p[n]) for n in names]:
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * np.abs(b).max())


@pytest.mark.parametrize("which", ["additive", "additive_norm", "concat"])
def test_public_score_backward_of_a_tile_against_torch(which, rng):
    """AdditiveSimilarity / ConcatSimilarity.score_backward on one tile (the
    backward of attention projects once instead; this is the public method)."""
    d_q, d_k = 4, 3
    sim, params, _, names = make_case(which, np.float64, d_q, d_k, rng)
    sim = fastattn.get_similarity(sim)
    q, k, ds = randn(rng, (2, 6, d_q)), randn(rng, (2, 7, d_k)), randn(rng, (2, 6, 7))
    checked = sim.check_params(params, d_q, d_k, np.float64)
    dq, dk, dp = sim.score_backward(q, k, checked, ds)
    tq, tk = torch.tensor(q, requires_grad=True), torch.tensor(k, requires_grad=True)
    tp = {n: torch.tensor(np.asarray(x, np.float64), requires_grad=True) for n, x in params.items()}
    (torch_scores(which, tq, tk, tp) * torch.tensor(ds)).sum().backward()
    assert set(dp) == names
    for a, t in [(dq, tq), (dk, tk)] + [(dp[n], tp[n]) for n in names]:
        b = t.grad.numpy()
        assert np.shape(a) == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * np.abs(b).max())


# ----------------------------------------------------- finite differences

@pytest.mark.parametrize("sim_name", SIMS)
def test_central_finite_differences(sim_name, rng):
    """d/dx of sum(out * g) by central differences, for entries of q, k, v and
    every entry of every parameter."""
    d_q, d_k = (3, 3) if sim_name in SAME_DIMS else (3, 2)
    q, k, v = randn(rng, (1, 4, d_q)), randn(rng, (1, 5, d_k)), randn(rng, (1, 5, 2))
    sim, params, _, names = make_case(sim_name, np.float64, d_q, d_k, rng, d_a=3)
    params = {n: np.array(x, np.float64) for n, x in (params or {}).items()} or None
    mask = randn(rng, (4, 5))
    mask[1, 2] = -np.inf
    g = randn(rng, (1, 4, 2))
    dq, dk, dv, dp = backward(g, q, k, v, sim, params, mask, True, "bottom_right")

    def loss(q, k, v, params):
        return float(np.sum(forward(q, k, v, sim, params, mask, True, "bottom_right")[0] * g))

    h = 1e-6
    checks = [(0, q, dq, None), (1, k, dk, None), (2, v, dv, None)]
    checks += [(3, params[n], dp[n], n) for n in sorted(names)]
    for which, arr, grad, pname in checks:
        if pname is None:
            idxs = [tuple(rng.integers(0, n) for n in arr.shape) for _ in range(4)]
        else:
            idxs = list(np.ndindex(*arr.shape))
        for idx in idxs:
            fs = []
            for step in (h, -h):
                args = [q, k, v, params]
                x = arr.copy()
                x[idx] += step
                if pname is None:
                    args[which] = x
                else:
                    args[3] = {**params, pname: x}
                fs.append(loss(*args))
            np.testing.assert_allclose(grad[idx], (fs[0] - fs[1]) / (2 * h), rtol=1e-6,
                                       atol=1e-8, err_msg=f"{pname or 'qkv'[which]}{idx}")


# --------------------------------------------------------------- special cases

@pytest.mark.parametrize("sim_name", SIMS)
def test_fully_masked_rows_give_exact_zeros(sim_name, rng):
    d_q, d_k = dims(sim_name)
    q, k, v = randn(rng, (2, 8, d_q)), randn(rng, (2, 9, d_k)), randn(rng, (2, 9, 3))
    sim, params, vjp, names = make_case(sim_name, np.float64, d_q, d_k, rng)
    mask = rng.random((2, 8, 9)) < 0.7
    mask[:, 2] = False            # query 2 sees no key
    mask[1, 5] = False            # nor does query 5 of item 1
    mask[:, :, 4] = False         # key 4 is seen by nobody
    mask[:, 0, 0] = True
    g = randn(rng, (2, 8, 3))
    dq, dk, dv, dp = backward(g, q, k, v, sim, params, mask)
    assert np.all(dq[:, 2] == 0) and np.all(dq[1, 5] == 0)
    assert np.all(dk[:, 4] == 0) and np.all(dv[:, 4] == 0)
    assert np.any(dq[0, 5] != 0) and np.any(dk[:, 0] != 0)
    assert all(np.all(np.isfinite(a)) for a in (dq, dk, dv, *dp.values()))
    ref = R.attention_backward(g, q, k, v, vjp, mask)
    check_grads((dq, dk, dv, dp), ref, np.float64, (q, k, v), params, names)
    # every row masked: all gradients are zeros
    dq, dk, dv, dp = backward(g, q, k, v, sim, params, np.zeros((8, 9), bool))
    assert all(np.all(a == 0) for a in (dq, dk, dv, *dp.values()))


def test_weight_normalised_additive_at_v_zero(rng):
    """v_eff = g v / |v| is 0 at v = 0 for every g (the forward's choice): zero
    gradients for v and g there, finite ones for the rest."""
    q, k, v = randn(rng, (2, 6, 4)), randn(rng, (2, 7, 3)), randn(rng, (2, 7, 2))
    _, params, _, _ = make_case("additive_norm", np.float64, 4, 3, rng)
    params["v"] = np.zeros_like(params["v"])
    g = randn(rng, (2, 6, 2))
    dq, dk, dv, dp = backward(g, q, k, v, AdditiveSimilarity(normalize=True), params)
    assert np.all(dp["v"] == 0) and dp["g"] == 0
    assert np.all(dq == 0) and np.all(dk == 0)  # uniform weights: the scores do not matter
    ref = R.attention_backward(g, q, k, v, lambda a, b: R.score_additive_vjp(
        a, b, params["W_q"], params["W_k"], params["v"], params["b"]))  # v_eff = v = 0
    assert_close(dv, ref[2], np.float64)


@pytest.mark.parametrize("scale", [0.0, 1e-12, 1e-3, -2.5])
@pytest.mark.parametrize("sim_name", ["scaled_dot", "general", "cosine"])
def test_scale_gradient_for_zero_tiny_and_negative_scales(sim_name, scale, rng):
    """dscale comes from dq / scale for ordinary scales, and from a backward on
    the queries times the scale (scale 1) for |scale| < 2**-30, exact at 0."""
    q, k, v = randn(rng, (2, 10, 4)), randn(rng, (2, 12, 4)), randn(rng, (2, 12, 3))
    g = randn(rng, (2, 10, 3))
    if sim_name == "scaled_dot":
        params, vjp = {"scale": scale}, lambda a, b: R.score_dot_vjp(a, b, scale)
    elif sim_name == "general":
        W = randn(rng, (4, 4))
        params, vjp = {"W": W, "scale": scale}, lambda a, b: R.score_general_vjp(a, b, W, scale)
    else:
        params, vjp = {"beta": scale}, lambda a, b: R.score_cosine_vjp(a, b, scale)
    got = backward(g, q, k, v, sim_name, params, None, True)
    ref = R.attention_backward(g, q, k, v, vjp, None, True)
    names = set(params)
    check_grads(got, ref, np.float64, (q, k, v), params, names)
    pname = "beta" if sim_name == "cosine" else "scale"
    assert abs(got[3][pname]) > 1e-3  # a gradient that is really there
    if scale == 0.0:
        assert np.all(got[0] == 0) and np.all(got[1] == 0)


def test_additive_through_score_backward_and_precomputed_keys(rng):
    """The NumPy tiled path over AdditiveSimilarity.score_backward (a subclass
    without the lowering) and the precomputed-keys similarity agree with the
    oracle and with the lowered path."""
    class Unlowered(AdditiveSimilarity):
        name = "test_additive_unlowered"

        def _lower(self, query, key, params):
            return None

    q, k, v = randn(rng, (2, 70, 6)), randn(rng, (2, 140, 5)), randn(rng, (2, 140, 3))
    g = randn(rng, (2, 70, 3))
    _, params, vjp, names = make_case("additive", np.float64, 6, 5, rng)
    mask = rng.random((70, 140)) < 0.8
    sim = Unlowered()
    assert _attention.attention_path(q, k, v, sim, params=params) == "tiled"
    got = backward(g, q, k, v, sim, params, mask, True)
    ref = R.attention_backward(g, q, k, v, vjp, mask, True)
    check_grads(got, ref, np.float64, (q, k, v), params, names)
    lowered = backward(g, q, k, v, "additive", params, mask, True)
    for a, b in zip(got[:3], lowered[:3]):
        assert_close(a, b, np.float64)
    # precomputed keys kp = k W_k^T: dk of the original keys is dkp W_k
    checked = fastattn.get_similarity("additive").check_params(params, 6, 5, np.float64)
    psim, pparams, kp = fastattn.get_similarity("additive").precompute_keys(k, checked)
    dq, dkp, dv, dpp = backward(g, q, kp, v, psim, pparams, mask, True)
    assert set(dpp) == {"W_q", "v", "b"}
    assert_close(dq, ref[0], np.float64)
    assert_close(dkp @ params["W_k"], ref[1], np.float64)
    assert_close(dv, ref[2], np.float64)
    for n in ("W_q", "v", "b"):
        assert_close(dpp[n], ref[3][n], np.float64)


@pytest.mark.parametrize("sim_name", ["general", "additive", "numpy_plugin"])
def test_dtypes(sim_name, rng):
    d_q, d_k = dims(sim_name)
    sim, params, vjp, names = make_case(sim_name, np.float16, d_q, d_k, rng)
    q, k, v = randn(rng, (5, d_q), np.float16), randn(rng, (7, d_k), np.float16), \
        randn(rng, (7, 3), np.float16)
    g = randn(rng, (5, 3), np.float16)
    dq, dk, dv, dp = backward(g, q, k, v, sim, params)
    assert [a.dtype for a in (dq, dk, dv)] == [np.float16] * 3
    for n in names:  # float16 arrays stay float16; python floats get the compute dtype
        want = params[n].dtype if isinstance(params[n], np.ndarray) else np.float32
        assert dp[n].dtype == want, (n, dp[n].dtype)
    ref = R.attention_backward(g, q, k, v, vjp)
    for a, r in zip((dq, dk, dv), ref):
        np.testing.assert_allclose(a.astype(np.float64), r, rtol=2e-2, atol=2e-2 * np.abs(r).max())
    # integers: computed and returned in float64, like the params given as ints
    qi = (np.arange(5 * d_q).reshape(5, d_q) % 3)
    ki = (np.arange(7 * d_k).reshape(7, d_k) % 4)
    vi = (np.arange(21).reshape(7, 3) % 2)
    pi = {n: (np.round(np.asarray(x, np.float64) * 4).astype(np.int64) if np.ndim(x) else float(x))
          for n, x in (params or {}).items()} or None
    if sim_name == "additive":
        pi["v"] = pi["v"] + (pi["v"] == 0)  # no zero entries needed, just not all zeros
    dq, dk, dv, dp = backward(randn(rng, (5, 3)), qi, ki, vi, sim, pi)
    assert [a.dtype for a in (dq, dk, dv)] == [np.float64] * 3
    assert all(a.dtype == np.float64 for a in dp.values())
    assert all(np.all(np.isfinite(a)) for a in (dq, dk, dv, *dp.values()))


@pytest.mark.parametrize("sim_name", ["dot", "general", "cosine", "additive", "numpy_plugin",
                                      "compiled_plugin"])
def test_empty_sizes(sim_name, rng):
    d_q, d_k = dims(sim_name)
    sim, params, vjp, names = make_case(sim_name, np.float64, d_q, d_k, rng)
    for Lq, Lk, dv_ in [(0, 4, 2), (5, 0, 2), (5, 4, 0)]:
        q, k, v = randn(rng, (2, Lq, d_q)), randn(rng, (2, Lk, d_k)), randn(rng, (2, Lk, dv_))
        g = randn(rng, (2, Lq, dv_))
        got = backward(g, q, k, v, sim, params, None, True, "bottom_right")
        ref = R.attention_backward(g, q, k, v, vjp, None, True, causal_alignment="bottom_right")
        check_grads(got, ref, np.float64, (q, k, v), params, names)
        assert all(np.all(a == 0) for a in (*got[:3], *got[3].values()))


@pytest.mark.parametrize("sim_name", ["general", "additive", "compiled_plugin"])
def test_same_bits_for_any_thread_count(sim_name, rng):
    d_q, d_k = dims(sim_name)
    sim, params, _, _ = make_case(sim_name, np.float32, d_q, d_k, rng)
    q, k, v = (randn(rng, (2, 3, 200, d), np.float32) for d in (d_q, d_k, 8))
    g = randn(rng, (2, 3, 200, 8), np.float32)
    res = [backward(g, q, k, v, sim, params, None, True, nt=n) for n in (1, 2, 3)]
    for other in res[1:]:
        for a, b in zip(res[0][:3], other[:3]):
            np.testing.assert_array_equal(a, b)
        for n in res[0][3]:
            np.testing.assert_array_equal(res[0][3][n], other[3][n])


@pytest.mark.parametrize("shape", [(1, 1024, 16), (64, 256, 4)], ids=["1x1024", "64x256"])
@pytest.mark.parametrize("sim_name", ["additive", "numpy_plugin"])
def test_tiled_backward_memory_is_o_tile(sim_name, shape, rng):
    """The backward's peak (tracemalloc, besides the inputs; additive runs the
    fused kernel, test_additive_backward_kernel.py, the plugin the NumPy tiled
    backward) stays
    under half of the batch's Lq x Lk float64 scores (8 MB at 1 x 1024 x 1024,
    32 MB at 64 x 256 x 256), let alone additive's x d_a tanh tensor: one long
    sequence, and many short ones worked through in chunks of the batch (the
    gradients and accumulators, O(B L (d + d_a)), are most of the peak)."""
    B, L, d = shape
    sim, params, _, _ = make_case(sim_name, np.float64, d, d, rng, d_a=8)
    q, k, v, g = (randn(rng, (B, L, d)) for _ in range(4))
    out, lse = forward(q, k, v, sim, params)
    tracemalloc.start()
    try:
        grads = attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.all(np.isfinite(grads[0])) and np.any(grads[0] != 0)
    assert peak < B * L * L * 8 / 2, peak


# ------------------------------------------------------------ no backward

class Counting(Similarity):
    """A Python similarity without score_backward that counts its calls."""

    name = "test_counting_no_backward"
    calls = 0

    def score(self, query, key, params):
        Counting.calls += 1
        return query @ np.swapaxes(key, -1, -2)


class RelowedDot(DotSimilarity):
    """A dot subclass with a lowering of its own and no backward for it."""

    name = "test_relowered_dot"

    def _lower(self, query, key, params):
        return ("sdpa", query, key, 2.0)


class RescoredAdditive(AdditiveSimilarity):
    """A new score (and no lowering): the inherited score_backward is not its backward."""

    name = "test_rescored_additive"

    def score(self, query, key, params):
        return 2 * super().score(query, key, params)

    def _lower(self, query, key, params):
        return None


def test_similarities_without_a_backward_raise_not_implemented(rng):
    q = randn(rng, (2, 5, 4))
    out, lse = forward(q, q, q, "dot", None)
    g = randn(rng, (2, 5, 4))
    with pytest.raises(NotImplementedError, match="'test_neg_sq_dist' has no backward .*score_backward"):
        attention_backward(g, q, q, q, NegSqDist(), out=out, lse=lse)
    with pytest.raises(NotImplementedError, match="'test_relowered_dot' has no backward"):
        attention_backward(g, q, q, q, RelowedDot(), out=out, lse=lse)
    with pytest.raises(NotImplementedError, match="'test_rescored_additive' has no backward"):
        attention_backward(g, q, q, q, RescoredAdditive(), out=out, lse=lse,
                           params=make_case("additive", np.float64, 4, 4, rng)[1])
    sim = fastattn.testing.selftest_similarity()

    class LoweredCompiled(type(sim)):
        """A compiled plugin's forward never uses a lowering, so neither does its backward."""

        def _lower(self, query, key, params):
            return ("sdpa", query, key, 1.0)

        def _lower_backward(self, query, key, params, grads):
            return grads["query"], grads["key"], {}

    lowered = LoweredCompiled()
    lowered.capsule = test_plugin_backward.v1_capsule()  # forward only
    with pytest.raises(NotImplementedError, match="compiled plugin"):  # before any check
        attention_backward(None, q, q, q, lowered, out=None, lse=None)
    # before any work: no score computed, and not even the arguments checked
    Counting.calls = 0
    with pytest.raises(NotImplementedError, match="'test_counting_no_backward' has no backward"):
        attention_backward(None, q, q, q, Counting(), out=None, lse=None)
    assert Counting.calls == 0
    # the base class's method says what is missing
    with pytest.raises(NotImplementedError, match="score_backward is not implemented"):
        Counting().score_backward(q, q, None, g)


# -------------------------------------------------------------- bad input

class BadBackward(NegSqDist):
    name = "test_bad_backward"
    mode = "shape"

    def score_backward(self, query, key, params, grad_scores):
        if self.mode == "raise":
            raise RuntimeError("boom")
        if self.mode == "tuple":
            return query
        if self.mode == "shape":
            return query[..., :1], key, {}
        if self.mode == "dtype":
            return query.astype(np.int64), key, {}
        if self.mode == "param":
            return query, key, {"delta": 1.0}
        return query, key, {"gamma": np.ones(2)}  # "param_shape"


@pytest.mark.parametrize("mode, err, match", [
    ("raise", SimilarityError, "'test_bad_backward': score_backward raised RuntimeError: boom"),
    ("tuple", TypeError, r"score_backward returned array .* expected a tuple \(dq, dk, dparams\)"),
    ("shape", ValueError, r"returned dq of shape \(2, 5, 1\), expected \(2, 5, 4\)"),
    ("dtype", TypeError, "returned dq of dtype int64, expected a real floating dtype"),
    ("param", ValueError, "a gradient for 'delta', which is not one of its params"),
    ("param_shape", ValueError, r"dparams\['gamma'\] of shape \(2,\), expected .* \(\)"),
])
def test_bad_score_backward(mode, err, match, rng):
    sim = BadBackward()
    sim.mode = mode
    q = randn(rng, (2, 5, 4))
    out, lse = forward(q, q, q, sim, None)
    with pytest.raises(err, match=match):
        attention_backward(randn(rng, (2, 5, 4)), q, q, q, sim, out=out, lse=lse)


def test_bad_input_names_the_argument(rng):
    q = randn(rng, (2, 5, 4), np.float32)
    out, lse = forward(q, q, q, "dot", None)
    g = randn(rng, (2, 5, 4), np.float32)

    def call(**kw):
        a = dict(grad_out=g, query=q, key=q, value=q, similarity="dot", out=out, lse=lse)
        a.update(kw)
        return attention_backward(a.pop("grad_out"), a.pop("query"), a.pop("key"), a.pop("value"),
                                  a.pop("similarity"), **a)

    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 5, 4\), got \(2, 5, 3\)"):
        call(grad_out=g[..., :3])
    with pytest.raises(TypeError, match="grad_out: expected a real floating array .* got dtype int64"):
        call(grad_out=g.astype(np.int64))
    with pytest.raises(ValueError, match=r"out: expected shape \(2, 5, 4\), got \(1, 5, 4\)"):
        call(out=out[:1])
    with pytest.raises(ValueError, match=r"lse: expected shape \(2, 5\), got \(2, 5, 1\)"):
        call(lse=lse[..., None])
    with pytest.raises(TypeError, match="lse: expected a real floating array"):
        call(lse=lse.astype(bool))
    with pytest.raises(TypeError, match="missing 2 required keyword-only arguments: 'out' and 'lse'"):
        attention_backward(g, q, q, q)
    with pytest.raises(ValueError, match="no_such_similarity"):
        call(similarity="no_such_similarity")
    with pytest.raises(ValueError, match="params: missing 'W' for similarity 'general'"):
        call(similarity="general")
    with pytest.raises(ValueError, match="params: unexpected key"):
        call(similarity="scaled_dot", params={"scal": 1.0})
    with pytest.raises(TypeError, match="is_causal: expected a bool"):
        call(is_causal="yes")
    with pytest.raises(ValueError, match="causal_alignment: expected 'top_left' or 'bottom_right'"):
        call(causal_alignment="top")
    with pytest.raises(ValueError, match=r"attn_mask: expected a shape broadcastable to \(\.\.\., Lq=5, Lk=5\)"):
        call(attn_mask=np.ones((5, 4), bool))
    with pytest.raises(ValueError, match="key: expected last dim 4"):
        call(key=q[..., :3], value=q)
    with pytest.raises(TypeError, match="query: complex dtypes are not supported"):
        call(query=q.astype(np.complex64))
