"""``PrecomputedAdditiveSimilarity.split_query_projection``: additive attention
given projected queries and keys (``ProjectedAdditiveSimilarity``, what
AttentionDecoder's training loop runs with its own query projection) is the
precomputed-keys attention, forward and backward, on the fused kernel and on
the tiled NumPy path (its ``score`` / ``score_backward``), against the float64
oracle."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _attention, _reference as R
from fastattn.functional import attention, attention_backward

from support import assert_close, randn
from test_attention_backward import make_case
from test_similarity import MASKS, make_mask


def _split(params, k, dtype):
    add = fastattn.get_similarity("additive")
    checked = add.check_params(params, 6, 5, dtype)
    psim, pparams, kp = add.precompute_keys(k, checked)
    qsim, qparams, wq, b = psim.split_query_projection(pparams)
    return psim, pparams, kp, qsim, qparams, wq, b


@pytest.mark.parametrize("mask_kind", MASKS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_projected_queries_give_the_same_attention(dtype, mask_kind, rng):
    dt = np.dtype(dtype)
    Lq, Lk = 9, 40
    q, k, v = randn(rng, (2, Lq, 6), dt), randn(rng, (2, Lk, 5), dt), randn(rng, (2, Lk, 4), dt)
    _, params, vjp, _ = make_case("additive", dt, 6, 5, rng)
    mask, causal, align = make_mask(mask_kind, (2,), Lq, Lk, rng, dt)
    psim, pparams, kp, qsim, qparams, wq, b = _split(params, k, dt)
    qp = (q @ wq.T + b).astype(dt)
    kw = dict(attn_mask=mask, is_causal=causal, causal_alignment=align, return_lse=True)
    out, lse = attention(qp, kp, v, qsim, params=qparams, **kw)
    ref_out, ref_lse = attention(q, kp, v, psim, params=pparams, **kw)
    assert out.dtype == dt
    assert_close(out, ref_out.astype(np.float64), dt)
    assert_close(np.nan_to_num(lse, neginf=-1e30), np.nan_to_num(ref_lse.astype(np.float64), neginf=-1e30), dt)
    g = randn(rng, out.shape, dt)
    dqp, dkp, dv, dp = attention_backward(g, qp, kp, v, qsim, params=qparams, out=out, lse=lse,
                                          attn_mask=mask, is_causal=causal, causal_alignment=align)
    assert set(dp) == {"v"}
    # the chain rule through qp = q W_q^T + b and kp = k W_k^T against the oracle's
    ref = R.attention_backward(g, q, k, v, vjp, mask, causal, causal_alignment=align)
    d64 = dqp.astype(np.float64)
    assert_close(d64 @ wq.astype(np.float64), ref[0], dt)
    assert_close(dkp.astype(np.float64) @ params["W_k"].astype(np.float64), ref[1], dt)
    assert_close(dv, ref[2], dt)
    assert_close(dp["v"], ref[3]["v"], dt)
    assert_close(d64.reshape(-1, d64.shape[-1]).T @ q.reshape(-1, 6).astype(np.float64), ref[3]["W_q"], dt)
    assert_close(d64.sum(axis=(0, 1)), ref[3]["b"], dt)


def test_tiled_path_agrees_with_the_fused_kernel(rng):
    q, k, v = randn(rng, (2, 7, 6)), randn(rng, (2, 30, 5)), randn(rng, (2, 30, 3))
    _, params, _, _ = make_case("additive", np.float64, 6, 5, rng)
    _, _, kp, qsim, qparams, wq, b = _split(params, k, np.float64)
    qp = q @ wq.T + b
    out, lse = attention(qp, kp, v, qsim, params=qparams, return_lse=True)
    # score / score_backward (what the tiled path and users' own tiles run)
    s = qsim.score(qp, kp, qparams)
    w = np.exp(s - s.max(axis=-1, keepdims=True))
    w /= w.sum(axis=-1, keepdims=True)
    assert_close(out, w @ v, np.float64)
    gs = randn(rng, s.shape)
    dq, dk, dpp = qsim.score_backward(qp, kp, qparams, gs)
    eps = 1e-6
    i = (1, 3, 2)
    qp2 = qp.copy()
    qp2[i] += eps
    num = ((qsim.score(qp2, kp, qparams) - s) * gs).sum() / eps
    assert abs(num - dq[i]) < 1e-4 * max(1.0, abs(num))
    assert dk.shape == kp.shape and set(dpp) == {"v"}


def test_checks_and_no_copy_of_a_read_only_v(rng):
    _, params, _, _ = make_case("additive", np.float64, 6, 5, rng)
    k = randn(rng, (2, 30, 5))
    _, _, kp, qsim, qparams, wq, _ = _split(params, k, np.float64)
    assert not qparams["v"].flags.writeable
    assert qsim.check_params(qparams, wq.shape[0], wq.shape[0], np.float64) is qparams
    with pytest.raises(ValueError, match="projected width"):
        attention(randn(rng, (2, 4, wq.shape[0] + 1)), kp, k, qsim, params=qparams)
    assert _attention.attention_path(randn(rng, (2, 4, wq.shape[0])), kp, k, qsim,
                                     params=qparams) != "tiled"


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_stepped_attention_is_attention_and_its_backward_bitwise(dtype, rng):
    """functional._SteppedAttention (the arguments checked once for many
    one-step calls) gives attention's and attention_backward's floats."""
    from fastattn import functional as F
    dt = np.dtype(dtype)
    B, S = 8, 40
    k = randn(rng, (B, S, 5), dt)
    v = randn(rng, (B, S, 4), dt)
    mask = np.ones((B, 1, S), bool)
    mask[::3, :, 25:] = False
    _, params, _, _ = make_case("additive", dt, 6, 5, rng)
    _, _, kp, qsim, qparams, wq, b = _split(params, k, dt)
    A = wq.shape[0]
    st = F._SteppedAttention(np.zeros((B, 1, A), dt), kp, v, qsim, params=qparams, attn_mask=mask)
    for _ in range(3):
        qp = randn(rng, (B, 1, A), dt)
        out, lse = st.forward(qp)
        eo, el = attention(qp, kp, v, qsim, params=qparams, attn_mask=mask, return_lse=True)
        assert np.array_equal(out, eo) and np.array_equal(lse, el)
        g = randn(rng, out.shape, dt)
        got = st.backward(g, qp, out, lse)
        exp = attention_backward(g, qp, kp, v, qsim, params=qparams, out=eo, lse=el,
                                 attn_mask=mask)
        for a, e in zip(got[:3], exp[:3]):
            assert a.dtype == dt and np.array_equal(a, e)
        assert np.array_equal(got[3]["v"], exp[3]["v"])
    # accumulate: the kernel adds dk and dv to its sums, the same floats as adding
    # the returned arrays call after call (in order, from zeros)
    st.start_accumulating()
    sk, sv = np.zeros(kp.shape, dt), np.zeros(v.shape, dt)
    for _ in range(3):
        qp = randn(rng, (B, 1, A), dt)
        out, lse = st.forward(qp)
        g = randn(rng, out.shape, dt)
        dq, dk, dv, dp = st.backward(g, qp, out, lse)
        aq, ak, av, ap = st.backward(g, qp, out, lse, accumulate=True)
        assert ak is None and av is None
        assert np.array_equal(aq, dq) and np.array_equal(ap["v"], dp["v"])
        sk += dk
        sv += dv
    gk, gv = st.accumulated()
    assert np.array_equal(gk, sk) and np.array_equal(gv, sv)
    st.start_accumulating()
    assert not st.accumulated()[0].any() and not st.accumulated()[1].any()
    with pytest.raises(ValueError, match="query"):
        st.forward(randn(rng, (B, 2, A), dt))
    with pytest.raises(TypeError, match="fused additive"):
        F._SteppedAttention(np.zeros((B, 1, 5), dt), k, v, "dot")


@pytest.mark.parametrize("rows", [8, 1024])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_linear_weight_grads_are_linear_backwards(rows, dtype, rng):
    from fastattn import functional as F
    dt = np.dtype(dtype)
    g, x = randn(rng, (rows, 48), dt), randn(rng, (rows, 40), dt)
    w, b = randn(rng, (48, 40), dt), randn(rng, (48,), dt)
    _, dw, db = F.linear_backward(g, x, w, b)
    gw, gb = F._linear_weight_grads(g, x, w, b)
    assert np.array_equal(gw, dw) and np.array_equal(gb, db)


def test_projected_gradients_against_torch_autograd_float64(rng):
    """attention_backward with projected queries and keys against torch autograd
    of softmax(v . tanh(q + k) masked) V, float64, random upstream gradients."""
    torch = pytest.importorskip("torch")
    B, Lq, Lk, A, dv = 3, 5, 17, 8, 4
    qp, kp, v = randn(rng, (B, Lq, A)), randn(rng, (B, Lk, A)), randn(rng, (B, Lk, dv))
    vec = randn(rng, (A,))
    mask = rng.random((B, 1, Lk)) < 0.8
    mask[:, :, 0] = True
    from fastattn.similarity import ProjectedAdditiveSimilarity
    qsim, qparams = ProjectedAdditiveSimilarity(), {"v": vec}
    out, lse = attention(qp, kp, v, qsim, params=qparams, attn_mask=mask, return_lse=True)
    g = randn(rng, out.shape)
    dq, dk, dval, dp = attention_backward(g, qp, kp, v, qsim, params=qparams, out=out, lse=lse,
                                          attn_mask=mask)
    tq, tk, tv, tvec = (torch.tensor(a, requires_grad=True) for a in (qp, kp, v, vec))
    s = torch.tanh(tq[:, :, None, :] + tk[:, None, :, :]) @ tvec
    s = s.masked_fill(~torch.tensor(mask), float("-inf"))
    to = torch.softmax(s, -1) @ tv
    to.backward(torch.tensor(g))
    np.testing.assert_allclose(out, to.detach().numpy(), rtol=1e-10, atol=1e-12)
    for got, t in ((dq, tq), (dk, tk), (dval, tv), (dp["v"], tvec)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)
