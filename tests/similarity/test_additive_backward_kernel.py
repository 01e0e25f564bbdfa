"""The fused C backward of ``additive`` / ``concat`` attention
(csrc/fa_additive_bwd_impl.h, ``_scores.additive_backward``), which
``attention_backward`` takes for them: that it is the path taken; against
the float64 oracle (every mask kind, SIMD on and off, tile- and vector-ragged
sizes, d_a = 1); against torch autograd in float64 (1e-10 relative; strided,
transposed and flipped inputs, broadcast batch dims, few batch items so that
the key blocks are split into groups); float32 accuracy against torch; the
same bits for any thread count and on repeated calls; exact zeros for rows
and keys without an allowed pair; agreement with the NumPy tiled backward it
replaced; inputs untouched; memory O(B (Lq + Lk) d_a).

Upstream gradients are random (never all ones).
"""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fastattn
from fastattn import _attention, _reference as R, _scores
from fastattn.functional import attention_backward

from support import make_layout, randn
from test_attention_backward import F32_SCALAR_TOL, check_grads, make_case, out_batch
from test_similarity import MASKS, make_mask

SIMS = ["additive", "additive_norm", "concat"]


@pytest.fixture
def c_calls(monkeypatch):
    """Counts the fused kernel's calls; the NumPy tiled backward must not run."""
    calls = []
    real = _scores.additive_backward

    def counted(*args):
        calls.append(args[0].dtype)
        return real(*args)

    def no_tiles(*args, **kw):
        raise AssertionError("the NumPy tiled backward ran")

    monkeypatch.setattr(_scores, "additive_backward", counted)
    monkeypatch.setattr(_attention, "_tiled_backward", no_tiles)
    return calls


def run(g, q, k, v, sim, params, mask=None, causal=False, align="top_left", nt=None):
    out, lse = fastattn.attention(q, k, v, sim, params=params, attn_mask=mask, is_causal=causal,
                                  causal_alignment=align, return_lse=True)
    return attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse, attn_mask=mask,
                              is_causal=causal, causal_alignment=align, n_threads=nt)


def oracle(g, q, k, v, vjp, mask=None, causal=False, align="top_left"):
    return R.attention_backward(g, q, k, v, vjp, mask, causal, causal_alignment=align)


def test_the_fused_kernel_is_the_path_taken(c_calls, rng):
    q, k, v = randn(rng, (2, 9, 4)), randn(rng, (2, 11, 3)), randn(rng, (2, 11, 2))
    g = randn(rng, (2, 9, 2))
    for name in SIMS:
        sim, params, _, _ = make_case(name, np.float64, 4, 3, rng)
        run(g, q, k, v, sim, params)
    sim, params, _, _ = make_case("additive", np.float32, 4, 3, rng)
    run(g.astype(np.float32), q.astype(np.float32), k.astype(np.float32), v.astype(np.float32),
        sim, params)
    # precomputed keys (no key projection: the kernel reads the keys as given)
    checked = fastattn.get_similarity("additive").check_params(params, 4, 3, np.float32)
    psim, pparams, kp = fastattn.get_similarity("additive").precompute_keys(
        k.astype(np.float32), checked)
    run(g.astype(np.float32), q.astype(np.float32), kp, v.astype(np.float32), psim, pparams)
    assert c_calls == [np.float64] * 3 + [np.float32] * 2


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_matches_the_oracle(sim_name, dtype, mask_kind, simd_mode, c_calls, rng):
    # 70 queries, 150 keys, d_a = 5: ragged query blocks (64), key blocks (32)
    # and vectors (8 floats, 4 doubles; d_a is padded to 8)
    dt = np.dtype(dtype)
    Lq, Lk = 70, 150
    q, k, v = randn(rng, (2, Lq, 6), dt), randn(rng, (2, Lk, 5), dt), randn(rng, (2, Lk, 4), dt)
    sim, params, vjp, names = make_case(sim_name, dt, 6, 5, rng)
    mask, causal, align = make_mask(mask_kind, (2,), Lq, Lk, rng, dt)
    g = randn(rng, out_batch((2,), mask) + (Lq, 4), dt)
    got = run(g, q, k, v, sim, params, mask, causal, align)
    ref = oracle(g, q, k, v, vjp, mask, causal, align)
    check_grads(got, ref, dt, (q, k, v), params, names,
                F32_SCALAR_TOL if dt == np.float32 else None)
    assert c_calls


@pytest.mark.parametrize("Lq, Lk, d_a", [(1, 1, 1), (1, 200, 1), (65, 33, 9), (129, 97, 16),
                                         (7, 300, 37), (40, 40, 24)])
@pytest.mark.parametrize("mask_kind", ["none", "causal", "causal_br", "bool_causal"])
def test_sizes(Lq, Lk, d_a, mask_kind, simd_mode, rng):
    """Sizes around the tiles (64 queries x 32 keys), the vector widths and
    their multiples (d_a = 16, 24: padded to none), d_a = 1, one query or key."""
    q, k, v = randn(rng, (2, Lq, 3)), randn(rng, (2, Lk, 4)), randn(rng, (2, Lk, 3))
    sim, params, vjp, names = make_case("additive", np.float64, 3, 4, rng, d_a=d_a)
    if mask_kind == "bool_causal":
        mask, causal, align = rng.random((Lq, Lk)) < 0.8, True, "top_left"
    else:
        mask, causal, align = make_mask(mask_kind, (2,), Lq, Lk, rng, np.float64)
    g = randn(rng, (2, Lq, 3))
    got = run(g, q, k, v, sim, params, mask, causal, align)
    check_grads(got, oracle(g, q, k, v, vjp, mask, causal, align), np.float64, (q, k, v),
                params, names)


# ----------------------------------------------------------------- torch

torch = pytest.importorskip("torch")
from test_attention_backward import torch_grads  # noqa: E402  (needs torch)


@pytest.mark.parametrize("layout", ["C", "strided", "transposed", "flipped_batch", "readonly"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "causal_br", "padding"])
@pytest.mark.parametrize("sim_name", SIMS)
def test_float64_against_torch_autograd(sim_name, mask_kind, layout, rng):
    """One batch item with three query heads over one shared key head (key
    blocks split into groups), Lq != Lk, non-contiguous inputs."""
    B, H, L, S, dq, dk = 1, 3, 45, 70, 6, 5
    q = make_layout(randn(rng, (B, H, L, dq)), layout)
    k = make_layout(randn(rng, (B, 1, S, dk)), layout)
    v = make_layout(randn(rng, (B, 1, S, 4)), layout)
    g = make_layout(randn(rng, (B, H, L, 4)), layout)
    sim, params, _, names = make_case(sim_name, np.float64, dq, dk, rng, d_a=7)
    mask, causal, align = make_mask(mask_kind, (B, H), L, S, rng, np.float64)
    if mask_kind == "float":
        mask[..., 0] = 0.0                    # torch's softmax gives NaN for fully masked rows
    before = [np.copy(a) for a in (q, k, v, g)]
    want, want_p = torch_grads(sim_name, *(np.copy(a) for a in (g, q, k, v)), params, mask,
                               causal, align)
    got = run(g, q, k, v, sim, params, mask, causal, align)
    assert set(got[3]) == names == set(want_p)
    for a, b in list(zip(got[:3], want)) + [(got[3][n], want_p[n]) for n in names]:
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * np.abs(b).max())
    for a, b in zip((q, k, v, g), before):
        np.testing.assert_array_equal(a, b)


def _torch_same_residuals(g, q, k, v, params, out, lse, causal):
    """torch float32: the scores by autograd, the softmax backward from the
    given out and lse (FlashAttention's P = exp(s - lse), D = rowsum(dO o O))."""
    tq, tk = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k))
    tp = {n: torch.from_numpy(x.copy()).requires_grad_() for n, x in params.items()}
    h = torch.tanh((tq @ tp["W_q"].T)[..., :, None, :] + (tk @ tp["W_k"].T)[..., None, :, :]
                   + tp["b"])
    s = h @ tp["v"]
    L, S = s.shape[-2:]
    allowed = torch.ones(L, S, dtype=torch.bool)
    if causal:
        allowed = torch.arange(S)[None, :] <= torch.arange(L)[:, None]
    with torch.no_grad():
        p = torch.where(allowed, torch.exp(s - torch.from_numpy(lse)[..., None]), 0.0)
        tg, tv, to = torch.from_numpy(g), torch.from_numpy(v), torch.from_numpy(out)
        dv = p.transpose(-1, -2) @ tg
        ds = p * (tg @ tv.transpose(-1, -2) - (tg * to).sum(-1, keepdim=True))
    s.backward(ds)
    return [tq.grad.numpy(), tk.grad.numpy(), dv.numpy()] + [tp[n].grad.numpy() for n in params]


def _torch_autograd(g, q, k, v, params, causal):
    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    tp = {n: torch.from_numpy(x.copy()).requires_grad_() for n, x in params.items()}
    h = torch.tanh((tq @ tp["W_q"].T)[..., :, None, :] + (tk @ tp["W_k"].T)[..., None, :, :]
                   + tp["b"])
    s = h @ tp["v"]
    if causal:
        L, S = s.shape[-2:]
        s = s.masked_fill(torch.arange(S)[None, :] > torch.arange(L)[:, None], -np.inf)
    (torch.softmax(s, -1) @ tv).backward(torch.from_numpy(g))
    return [t.grad.numpy() for t in (tq, tk, tv)] + [tp[n].grad.numpy() for n in params]


def _rms_ratios(seed, causal):
    """(name, our rms error / torch's, the same against torch autograd) against
    the float64 oracle, float32, B=2 Lq=200 Lk=230 d=32 d_a=64."""
    rng = np.random.default_rng(seed)
    f = np.float32
    B, L, S, d, da, dv = 2, 200, 230, 32, 64, 16
    q, k = randn(rng, (B, L, d), f), randn(rng, (B, S, d), f)
    v, g = randn(rng, (B, S, dv), f), randn(rng, (B, L, dv), f)
    params = {"W_q": randn(rng, (da, d), f, 1 / np.sqrt(d)),
              "W_k": randn(rng, (da, d), f, 1 / np.sqrt(d)),
              "v": randn(rng, (da,), f), "b": randn(rng, (da,), f, 0.1)}
    out, lse = fastattn.attention(q, k, v, "additive", params=params, is_causal=causal,
                                  return_lse=True)
    got = attention_backward(g, q, k, v, "additive", params=params, out=out, lse=lse,
                             is_causal=causal)
    ref = oracle(g, q, k, v, lambda a, b: R.score_additive_vjp(
        a, b, params["W_q"], params["W_k"], params["v"], params["b"]), None, causal)
    ours = list(got[:3]) + [got[3][n] for n in params]
    refs = list(ref[:3]) + [ref[3][n] for n in params]
    same = _torch_same_residuals(g, q, k, v, params, out, lse, causal)
    auto = _torch_autograd(g, q, k, v, params, causal)

    def rms(a, r):
        return float(np.sqrt(np.mean((a.astype(np.float64) - r) ** 2)))

    return [(n, rms(a, r) / rms(t1, r), rms(a, r) / rms(t2, r))
            for n, a, t1, t2, r in zip(["dq", "dk", "dv"] + list(params), ours, same, auto, refs)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("seed", [0, 1])
def test_float32_no_less_accurate_than_torch(seed, causal):
    """Against the float64 oracle, every gradient's rms error is at most 1.1x
    torch float32's when torch works from the same residuals (our forward's
    out and lse, as any FlashAttention-style backward does): measured
    0.41-0.96x over 10 cases (SIMD; 0.23-0.87x scalar).

    Against torch autograd, which keeps its exactly normalised float32 P
    instead of recomputing it from a float32 lse, the errors are larger: the
    rounding of lse to float32 alone (P = exp(s - lse) is off by a factor
    1 + O(ulp(lse)) per row) was 2.0e-7 of dv's rms error where torch's whole
    error was 2.9e-7.  Measured over 8 cases: 0.9-1.43x for dq, dk, dv, W_q and
    W_k, 0.1-0.4x for v (summed in double), up to 1.78x for b (64 sums over
    every query row, where the per-row factor does not average out), and 2.005x
    for dv on the scalar path (FASTATTN_DISABLE_SIMD=1).  No backward from
    these float32 residuals does much better: one computed entirely in
    float64 from the same out and lse measured up to 2.65x torch autograd's
    error (dq) over 8 cases (benchmarks/accuracy_backward.py --additive); bound
    2.5x."""
    for name, same, auto in _rms_ratios(seed, causal):
        assert same <= 1.1, (name, same)
        assert auto <= 2.5, (name, auto)


# ------------------------------------------------------------- contracts

@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("shape", [(1, 300, 260), (9, 70, 90)], ids=["groups", "items"])
def test_same_bits_for_any_thread_count_and_call(shape, dtype, rng):
    """One batch item (its key blocks split into groups) and many (one group
    each), causal with a float mask: identical gradients for 1, 2 and 3
    threads and for a repeated call."""
    B, L, S = shape
    dt = np.dtype(dtype)
    sim, params, _, _ = make_case("additive", dt, 6, 5, rng, d_a=12)
    q, k, v = randn(rng, (B, L, 6), dt), randn(rng, (B, S, 5), dt), randn(rng, (B, S, 7), dt)
    g = randn(rng, (B, L, 7), dt)
    mask = randn(rng, (L, S), dt)
    mask[rng.random((L, S)) < 0.1] = -np.inf
    res = [run(g, q, k, v, sim, params, mask, True, "bottom_right", nt=n) for n in (1, 2, 3, 2)]
    for other in res[1:]:
        for a, b in zip(res[0][:3], other[:3]):
            np.testing.assert_array_equal(a, b)
        for n in res[0][3]:
            np.testing.assert_array_equal(res[0][3][n], other[3][n])


def test_rows_and_keys_without_an_allowed_pair_get_exact_zeros(rng):
    """Bottom-right causality with Lq > Lk leaves the first Lq - Lk queries no
    key; a padding mask leaves keys unseen; a float -inf row too."""
    q, k, v = randn(rng, (2, 12, 4)), randn(rng, (2, 7, 3)), randn(rng, (2, 7, 3))
    sim, params, vjp, names = make_case("additive", np.float64, 4, 3, rng)
    mask = np.ones((2, 12, 7), bool)
    mask[0, :, 5:] = False       # item 0: keys 5, 6 seen by nobody
    mask[1, 8] = False           # item 1: query 8 sees nothing
    g = randn(rng, (2, 12, 3))
    dq, dk, dv, dp = got = run(g, q, k, v, sim, params, mask, True, "bottom_right")
    assert np.all(dq[:, :5] == 0) and np.all(dq[1, 8] == 0)
    assert np.all(dk[0, 5:] == 0) and np.all(dv[0, 5:] == 0)
    assert np.any(dq[:, 5:] != 0) and np.any(dk[1] != 0)
    check_grads(got, oracle(g, q, k, v, vjp, mask, True, "bottom_right"), np.float64,
                (q, k, v), params, names)


@pytest.mark.parametrize("sim_name", SIMS)
def test_agrees_with_the_numpy_tiled_backward(sim_name, monkeypatch, rng):
    q, k, v = randn(rng, (2, 3, 70, 6)), randn(rng, (2, 1, 90, 5)), randn(rng, (2, 1, 90, 4))
    g = randn(rng, (2, 3, 70, 4))
    sim, params, _, _ = make_case(sim_name, np.float64, 6, 5, rng)
    mask = rng.random((70, 90)) < 0.7
    fused = run(g, q, k, v, sim, params, mask, True)
    monkeypatch.setattr(_attention, "_backward_additive", _attention._backward_additive_tiled)
    tiled = run(g, q, k, v, sim, params, mask, True)
    for a, b in zip(fused[:3], tiled[:3]):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12 * np.abs(b).max())
    for n in fused[3]:
        np.testing.assert_allclose(fused[3][n], tiled[3][n], rtol=1e-12,
                                   atol=1e-12 * np.abs(tiled[3][n]).max())


def test_simd_and_scalar_kernels_agree(rng):
    from support import SIMD_CAPABLE, _restore_simd
    if not SIMD_CAPABLE:
        pytest.skip("this CPU/build has no AVX2+FMA kernels")
    f = np.float32
    q, k, v = randn(rng, (2, 50, 8), f), randn(rng, (2, 77, 8), f), randn(rng, (2, 77, 5), f)
    g = randn(rng, (2, 50, 5), f)
    sim, params, _, _ = make_case("additive", f, 8, 8, rng, d_a=21)
    try:
        res = []
        for off in (False, True):
            fastattn._kernels.set_simd_disabled(off)
            res.append(run(g, q, k, v, sim, params, None, True))
    finally:
        _restore_simd()
    for a, b in zip(res[0][:3], res[1][:3]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * np.abs(b).max())


def test_memory_is_o_rows_times_d_a(rng):
    """tracemalloc peak of the backward (NumPy buffers: projections, their
    gradients, the double dq partials, the returned gradients) stays within a
    small multiple of B (Lq + Lk) d_a doubles and far below the dense scores
    (B Lq Lk doubles, 64 MB here), let alone B Lq Lk d_a.  The kernel's own
    scratch (one tile a thread, ~0.1 MB) is not traced."""
    B, L, d, d_a = 2, 2048, 16, 16
    sim, params, _, _ = make_case("additive", np.float64, d, d, rng, d_a=d_a)
    q, k, v, g = (randn(rng, (B, L, d)) for _ in range(4))
    out, lse = fastattn.attention(q, k, v, sim, params=params, return_lse=True)
    tracemalloc.start()
    try:
        grads = attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.all(np.isfinite(grads[0])) and np.any(grads[0] != 0)
    rows = B * 2 * L * d_a * 8
    assert peak < 8 * rows, (peak, rows)
    assert peak < B * L * L * 8 / 8, peak
