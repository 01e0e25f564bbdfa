"""fastattn.functional.multi_head_attention_backward against the float64 oracle
(``fastattn._reference.multi_head_attention_backward``), torch autograd in
float64 (1e-10 relative) and central finite differences: packed and separate
weights, kdim/vdim, grouped-query attention, every mask kind, unbatched
inputs, dtypes, thread counts, bad input.  Upstream gradients are random.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _reference as R
from fastattn.functional import multi_head_attention, multi_head_attention_backward

from support import assert_close, randn

torch = pytest.importorskip("torch")

B, L, S, E, H = 2, 7, 9, 16, 4


def weights(rng, dtype=np.float64, Hkv=H, kdim=E, vdim=E, packed=False, bias=True):
    kvE = E // H * Hkv
    w = {"w_query": randn(rng, (E, E), dtype, 0.3), "w_key": randn(rng, (kvE, kdim), dtype, 0.3),
         "w_value": randn(rng, (kvE, vdim), dtype, 0.3), "w_out": randn(rng, (E, E), dtype, 0.3)}
    if bias:
        w.update(b_query=randn(rng, (E,), dtype), b_key=randn(rng, (kvE,), dtype),
                 b_value=randn(rng, (kvE,), dtype), b_out=randn(rng, (E,), dtype))
    if not packed:
        return w
    p = {"w_qkv": np.concatenate([w["w_query"], w["w_key"], w["w_value"]]), "w_out": w["w_out"]}
    if bias:
        p["b_qkv"] = np.concatenate([w["b_query"], w["b_key"], w["b_value"]])
        p["b_out"] = w["b_out"]
    return p


def separate(w):
    """The oracle's separate weights for packed ones."""
    if "w_qkv" not in w:
        return w
    E_ = w["w_out"].shape[1]
    kvE = (w["w_qkv"].shape[0] - E_) // 2
    out = {"w_query": w["w_qkv"][:E_], "w_key": w["w_qkv"][E_:E_ + kvE],
           "w_value": w["w_qkv"][E_ + kvE:], "w_out": w["w_out"]}
    if "b_qkv" in w:
        out.update(b_query=w["b_qkv"][:E_], b_key=w["b_qkv"][E_:E_ + kvE],
                   b_value=w["b_qkv"][E_ + kvE:], b_out=w["b_out"])
    return out


def packed_grads(g, w):
    """The oracle's separate-weight gradients as the packed names."""
    if "w_qkv" not in w:
        return g
    out = {"w_qkv": np.concatenate([g["w_query"], g["w_key"], g["w_value"]]), "w_out": g["w_out"]}
    if "b_qkv" in w:
        out["b_qkv"] = np.concatenate([g["b_query"], g["b_key"], g["b_value"]])
        out["b_out"] = g["b_out"]
    return out


CASES = {
    "packed_self": dict(packed=True),
    "separate_cross": dict(),
    "kdim_vdim": dict(kdim=5, vdim=11),
    "gqa": dict(Hkv=2),
    "mqa_packed": dict(Hkv=1, packed=True),
    "no_bias": dict(bias=False),
}
MASKS = ["none", "causal", "causal_br", "bool", "float", "key_mask", "key_mask_float",
         "fully_masked"]


def inputs(rng, case, dtype, self_attention, batched=True):
    kw = CASES[case]
    shape = (B,) if batched else ()
    x = randn(rng, shape + (L, E), dtype)
    if self_attention:
        return x, x, x
    k = randn(rng, shape + (S, kw.get("kdim", E)), dtype)
    v = randn(rng, shape + (S, kw.get("vdim", E)), dtype)
    return x, k, v


def mask_kwargs(kind, rng, Lk, dtype, batched=True):
    bs = (B,) if batched else ()
    if kind == "none":
        return {}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "causal_br":
        return {"is_causal": True, "causal_alignment": "bottom_right"}
    if kind == "bool":
        m = rng.random(bs + (H, L, Lk)) < 0.7
        m[..., 0] = True
        return {"attn_mask": m}
    if kind == "float":
        return {"attn_mask": randn(rng, (L, Lk), dtype)}
    if kind == "key_mask":
        km = rng.random(bs + (Lk,)) < 0.7
        km[..., 0] = True
        return {"key_mask": km}
    if kind == "key_mask_float":
        km = rng.random(bs + (Lk,)) < 0.7
        km[..., 0] = True
        return {"key_mask": km, "attn_mask": randn(rng, (H, L, Lk), dtype)}
    if kind == "fully_masked":
        m = rng.random((L, Lk)) < 0.6
        m[2] = False
        return {"attn_mask": m}
    raise AssertionError(kind)


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_matches_the_oracle(dtype, case, mask, rng):
    kw = CASES[case]
    self_att = kw.get("packed", False)
    q, k, v = inputs(rng, case, dtype, self_att)
    w = weights(rng, dtype, **kw)
    Hkv = kw.get("Hkv", H)
    m = mask_kwargs(mask, rng, k.shape[1], dtype)
    g = randn(rng, (B, L, E), dtype)
    before = [a.copy() for a in (q, k, v, g, *w.values())]
    dq, dk, dv, dw = multi_head_attention_backward(g, q, k, v, num_heads=H, num_kv_heads=Hkv,
                                                   **w, **m)
    rq, rk, rv, rw = R.multi_head_attention_backward(g, q, k, v, num_heads=H, num_kv_heads=Hkv,
                                                     **separate(w), **m)
    rw = packed_grads(rw, w)
    assert set(dw) == set(w)
    for name, a, r, inp in [("dq", dq, rq, q), ("dk", dk, rk, k), ("dv", dv, rv, v)] + [
            (n, dw[n], rw[n], w[n]) for n in w]:
        assert a.shape == inp.shape and a.dtype == inp.dtype, name
        assert_close(a, r, dtype, err_msg=name)
    for a, b in zip((q, k, v, g, *w.values()), before):
        np.testing.assert_array_equal(a, b)


def _torch_mha(q, k, v, w, Hkv, m):
    tq, tk, tv = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    tw = {n: torch.tensor(a, requires_grad=True) for n, a in w.items()}
    sw = separate(tw) if "w_qkv" in tw else tw
    dh = E // H

    def proj(x, name, heads):
        y = x @ sw["w_" + name].T
        if "b_" + name in sw:
            y = y + sw["b_" + name]
        return y.reshape(x.shape[0], x.shape[1], heads, dh).transpose(1, 2)

    qh, kh, vh = proj(tq, "query", H), proj(tk, "key", Hkv), proj(tv, "value", Hkv)
    mask = None
    if "attn_mask" in m or "key_mask" in m:
        am = m.get("attn_mask")
        mask = None if am is None else torch.tensor(np.asarray(am))
        if "key_mask" in m:
            km = torch.tensor(m["key_mask"])[:, None, None, :]
            mask = km if mask is None else (mask & km if mask.dtype == torch.bool
                                            else torch.where(km, mask, float("-inf")))
    o = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask,
                                                         is_causal=m.get("is_causal", False),
                                                         enable_gqa=Hkv != H)
    o = o.transpose(1, 2).reshape(q.shape[0], q.shape[1], E)
    y = o @ sw["w_out"].T
    if "b_out" in sw:
        y = y + sw["b_out"]
    return y, (tq, tk, tv), tw


@pytest.mark.parametrize("mask", ["none", "causal", "bool", "float", "key_mask"])
@pytest.mark.parametrize("case", ["separate_cross", "kdim_vdim", "gqa", "packed_self"])
def test_float64_against_torch_autograd(case, mask, rng):
    kw = CASES[case]
    q, k, v = inputs(rng, case, np.float64, self_attention=False if case != "packed_self" else False)
    if case == "packed_self":
        k, v = randn(rng, (B, S, E)), randn(rng, (B, S, E))
    w = weights(rng, **kw)
    Hkv = kw.get("Hkv", H)
    m = mask_kwargs(mask, rng, k.shape[1], np.float64)
    g = randn(rng, (B, L, E))
    y, ins, tw = _torch_mha(q, k, v, w, Hkv, m)
    np.testing.assert_allclose(multi_head_attention(q, k, v, num_heads=H, num_kv_heads=Hkv, **w, **m),
                               y.detach().numpy(), rtol=1e-10, atol=1e-12)
    y.backward(torch.tensor(g))
    dq, dk, dv, dw = multi_head_attention_backward(g, q, k, v, num_heads=H, num_kv_heads=Hkv,
                                                   **w, **m)
    for a, t in zip((dq, dk, dv), ins):
        np.testing.assert_allclose(a, t.grad.numpy(), rtol=1e-10, atol=1e-12)
    for n, t in tw.items():
        np.testing.assert_allclose(dw[n], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


def test_self_attention_gradient_is_the_sum_of_the_three_roles(rng):
    """One array as query, key and value (the packed single-GEMM path): its total
    gradient (as autograd gives for one tensor) is dquery + dkey + dvalue."""
    x = randn(rng, (B, L, E))
    w = weights(rng, packed=True)
    g = randn(rng, (B, L, E))
    dq, dk, dv, dw = multi_head_attention_backward(g, x, x, x, num_heads=H, is_causal=True, **w)
    tx = torch.tensor(x, requires_grad=True)
    tw = {n: torch.tensor(a) for n, a in w.items()}
    sw = separate(tw)
    dh = E // H

    def proj(name):
        return (tx @ sw["w_" + name].T + sw["b_" + name]).reshape(B, L, H, dh).transpose(1, 2)

    o = torch.nn.functional.scaled_dot_product_attention(proj("query"), proj("key"), proj("value"),
                                                         is_causal=True)
    y = o.transpose(1, 2).reshape(B, L, E) @ sw["w_out"].T + sw["b_out"]
    y.backward(torch.tensor(g))
    np.testing.assert_allclose(dq + dk + dv, tx.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_unbatched_and_finite_differences(rng):
    q, k, v = randn(rng, (4, 8)), randn(rng, (5, 6)), randn(rng, (5, 3))
    w = {"w_query": randn(rng, (8, 8), scale=0.5), "w_key": randn(rng, (8, 6), scale=0.5),
         "w_value": randn(rng, (8, 3), scale=0.5), "w_out": randn(rng, (8, 8), scale=0.5),
         "b_query": randn(rng, (8,)), "b_out": randn(rng, (8,))}
    km = np.array([True, True, False, True, True])
    g = randn(rng, (4, 8))
    grads = multi_head_attention_backward(g, q, k, v, num_heads=2, key_mask=km, **w)
    assert grads[0].shape == q.shape and grads[1].shape == k.shape

    def loss(q, k, v, **w2):
        return float(np.sum(multi_head_attention(q, k, v, num_heads=2, key_mask=km, **w2) * g))

    h = 1e-6
    args = {"q": q, "k": k, "v": v}
    for i, name in enumerate(("q", "k", "v")):
        for idx in [tuple(rng.integers(0, n) for n in args[name].shape) for _ in range(3)]:
            hi, lo = dict(args), dict(args)
            hi[name] = args[name].copy()
            hi[name][idx] += h
            lo[name] = args[name].copy()
            lo[name][idx] -= h
            fd = (loss(hi["q"], hi["k"], hi["v"], **w) - loss(lo["q"], lo["k"], lo["v"], **w)) / (2 * h)
            np.testing.assert_allclose(grads[i][idx], fd, rtol=1e-6, atol=1e-8)
    for name in w:
        idx = tuple(rng.integers(0, n) for n in w[name].shape)
        hi, lo = dict(w), dict(w)
        hi[name] = w[name].copy()
        hi[name][idx] += h
        lo[name] = w[name].copy()
        lo[name][idx] -= h
        fd = (loss(q, k, v, **hi) - loss(q, k, v, **lo)) / (2 * h)
        np.testing.assert_allclose(grads[3][name][idx], fd, rtol=1e-6, atol=1e-8, err_msg=name)


def test_same_bits_for_any_thread_count(rng):
    q, k, v = inputs(rng, "gqa", np.float32, False)
    w = weights(rng, np.float32, Hkv=2)
    g = randn(rng, (B, L, E), np.float32)
    res = [multi_head_attention_backward(g, q, k, v, num_heads=H, num_kv_heads=2, is_causal=True,
                                         n_threads=n, **w) for n in (1, 2, 3)]
    for other in res[1:]:
        for a, b in zip(res[0][:3], other[:3]):
            np.testing.assert_array_equal(a, b)
        for n in w:
            np.testing.assert_array_equal(res[0][3][n], other[3][n])


def test_fully_masked_rows_and_dtypes(rng):
    q, k, v = inputs(rng, "separate_cross", np.float64, False)
    w = weights(rng)
    m = np.ones((L, S), bool)
    m[3] = False
    g = randn(rng, (B, L, E))
    dq, dk, dv, dw = multi_head_attention_backward(g, q, k, v, num_heads=H, attn_mask=m, **w)
    assert np.all(dq[:, 3] == 0) and all(np.all(np.isfinite(a)) for a in (dq, dk, dv))
    q16 = q.astype(np.float16)
    w16 = {n: a.astype(np.float16) for n, a in w.items()}
    res = multi_head_attention_backward(g.astype(np.float16), q16, q16, q16, num_heads=H, **w16)
    assert all(a.dtype == np.float16 for a in res[:3])
    assert all(a.dtype == np.float16 for a in res[3].values())


def test_bad_input_names_the_argument(rng):
    q, k, v = inputs(rng, "separate_cross", np.float32, False)
    w = weights(rng, np.float32)
    g = randn(rng, (B, L, E), np.float32)
    with pytest.raises(ValueError, match=r"grad_out: expected shape \(2, 7, 16\), got \(2, 7, 15\)"):
        multi_head_attention_backward(g[..., :15], q, k, v, num_heads=H, **w)
    with pytest.raises(TypeError, match="grad_out: expected a real floating array"):
        multi_head_attention_backward(g.astype(np.int32), q, k, v, num_heads=H, **w)
    with pytest.raises(ValueError, match="num_heads"):
        multi_head_attention_backward(g, q, k, v, num_heads=3, **w)
    with pytest.raises(TypeError, match="return_weights"):
        multi_head_attention_backward(g, q, k, v, num_heads=H, return_weights=True, **w)


@pytest.mark.parametrize("mask", ["none", "causal", "key_mask", "fully_masked"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_forward_backward_keeps_the_forward(dtype, case, mask, rng):
    """multi_head_attention_forward_backward: the forward's output and, from the
    residuals it kept, the oracle's gradients -- per role, or (combine_roles)
    an array's total gradient once."""
    from fastattn.functional import multi_head_attention_forward_backward as fb
    kw = CASES[case]
    self_att = kw.get("packed", False)
    q, k, v = inputs(rng, case, dtype, self_att)
    w = weights(rng, dtype, **kw)
    Hkv = kw.get("Hkv", H)
    m = mask_kwargs(mask, rng, k.shape[1], dtype)
    g = randn(rng, (B, L, E), dtype)
    before = [a.copy() for a in (q, k, v, g, *w.values())]
    rq, rk, rv, rw = R.multi_head_attention_backward(g, q, k, v, num_heads=H, num_kv_heads=Hkv,
                                                     **separate(w), **m)
    rw = packed_grads(rw, w)
    y_ref = multi_head_attention(q, k, v, num_heads=H, num_kv_heads=Hkv, **w, **m)
    for combine in (False, True):
        y, backward = fb(q, k, v, num_heads=H, num_kv_heads=Hkv, combine_roles=combine, **w, **m)
        np.testing.assert_array_equal(y, y_ref)
        dq, dk, dv, dw = backward(g)
        if combine and self_att:     # one array in the three roles: its total gradient
            assert dk is None and dv is None
            assert_close(dq, rq + rk + rv, dtype, err_msg="dx")
        else:
            for name, a, r in (("dq", dq, rq), ("dk", dk, rk), ("dv", dv, rv)):
                assert_close(a, r, dtype, err_msg=name)
        assert set(dw) == set(w)
        for n in w:
            assert dw[n].dtype == w[n].dtype
            assert_close(dw[n], rw[n], dtype, err_msg=n)
        dq2 = backward(g)[0]          # callable again, same result
        np.testing.assert_array_equal(dq2, dq)
    for a, b in zip((q, k, v, g, *w.values()), before):
        np.testing.assert_array_equal(a, b)


def test_forward_backward_bad_grad_and_flag(rng):
    from fastattn.functional import multi_head_attention_forward_backward as fb
    x = randn(rng, (B, L, E))
    w = weights(rng, packed=True)
    _, backward = fb(x, x, x, num_heads=H, **w)
    with pytest.raises(ValueError, match=r"^grad_out: expected shape \(2, 7, 16\)"):
        backward(np.zeros((B, L, E + 1)))
    with pytest.raises(TypeError, match=r"^combine_roles: expected a bool"):
        fb(x, x, x, num_heads=H, combine_roles="yes", **w)
