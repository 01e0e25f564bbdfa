"""fastattn.multi_head_attention against the float64 oracle (and torch where it applies).

Every numeric test compares against ``fastattn._reference.multi_head_attention``
(float64, separate weights, key/value heads repeated explicitly) fed the same
rounded inputs; the torch comparisons are in addition.
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _multihead, _reference
from support import assert_close, check_weights, randn

mha = fastattn.multi_head_attention


def make_params(rng, E, H, Hkv=None, kdim=None, vdim=None, bias=True, dtype=np.float32,
                E_out=None):
    """Random weights: the separate form (for the oracle) and the packed one when it exists."""
    Hkv = H if Hkv is None else Hkv
    kdim = E if kdim is None else kdim
    vdim = E if vdim is None else vdim
    E_out = E if E_out is None else E_out
    kvE = Hkv * (E // H)
    s = 1.0 / np.sqrt(E)
    p = {
        "w_query": randn(rng, (E, E), dtype, s),
        "w_key": randn(rng, (kvE, kdim), dtype, 1.0 / np.sqrt(max(kdim, 1))),
        "w_value": randn(rng, (kvE, vdim), dtype, 1.0 / np.sqrt(max(vdim, 1))),
        "w_out": randn(rng, (E_out, E), dtype, s),
    }
    if bias:
        p.update(b_query=randn(rng, (E,), dtype, 0.5), b_key=randn(rng, (kvE,), dtype, 0.5),
                 b_value=randn(rng, (kvE,), dtype, 0.5), b_out=randn(rng, (E_out,), dtype, 0.5))
    return p


def packed(p):
    """The separate weights as w_qkv / b_qkv (what the layer and torch hold)."""
    out = {"w_qkv": np.concatenate([p["w_query"], p["w_key"], p["w_value"]]),
           "w_out": p["w_out"]}
    if "b_query" in p:
        out["b_qkv"] = np.concatenate([p["b_query"], p["b_key"], p["b_value"]])
        out["b_out"] = p["b_out"]
    return out


def ref(q, k, v, p, **kw):
    return _reference.multi_head_attention(q, k, v, **p, **kw)


DTYPES = [np.float32, np.float64]


# --------------------------------------------------------------------------
# Against the oracle

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("form", ["packed", "separate"])
@pytest.mark.parametrize("kind", ["self", "cross", "cross_kv_shared"])
@pytest.mark.parametrize("batched", [True, False], ids=["batched", "unbatched"])
def test_matches_oracle(dtype, form, kind, batched, rng):
    E, H, B, Lq, Lk = 24, 3, 2, 7, 11
    p = make_params(rng, E, H, dtype=dtype)
    x = randn(rng, (B, Lq, E), dtype)
    if kind == "self":
        q = k = v = x
    elif kind == "cross":
        q, k, v = x, randn(rng, (B, Lk, E), dtype), randn(rng, (B, Lk, E), dtype)
    else:
        q, k = x, randn(rng, (B, Lk, E), dtype)
        v = k
    if not batched:
        q, k, v = (a[0] for a in (q, k, v))
        if kind == "self":
            k = v = q
        elif kind == "cross_kv_shared":
            v = k
    weights = packed(p) if form == "packed" else p
    out, w = mha(q, k, v, num_heads=H, return_weights=True, **weights)
    r_out, r_w = ref(q, k, v, p, num_heads=H, return_weights=True)
    assert out.dtype == w.dtype == dtype
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    check_weights(w, np.ones(w.shape, bool), dtype)
    only = mha(q, k, v, num_heads=H, **weights)  # the kernel path without weights
    assert_close(only, r_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("mask", ["bool", "float", "key", "bool+key", "float+key", "causal",
                                  "causal+key", "head_bool", "bottom_right"])
def test_masks_against_oracle(dtype, mask, rng):
    E, H, B, Lq, Lk = 16, 4, 3, 6, 9
    p = make_params(rng, E, H, dtype=dtype)
    q, kv = randn(rng, (B, Lq, E), dtype), randn(rng, (B, Lk, E), dtype)
    kw = {}
    if "bool" in mask:
        shape = (B, H, Lq, Lk) if mask == "head_bool" else (Lq, Lk)
        m = rng.random(shape) < 0.6
        m[..., 0] = True
        kw["attn_mask"] = m
    if "float" in mask:
        kw["attn_mask"] = randn(rng, (B, 1, Lq, Lk), dtype)
    if "key" in mask:
        km = np.ones((B, Lk), bool)
        km[1, 5:] = False
        km[2, 1:] = False
        kw["key_mask"] = km
    if "causal" in mask:
        kw["is_causal"] = True
    if mask == "bottom_right":
        kw.update(is_causal=True, causal_alignment="bottom_right")
    out, w = mha(q, kv, kv, num_heads=H, return_weights=True, average_weights=False,
                 **packed(p), **kw)
    r_out, r_w = ref(q, kv, kv, p, num_heads=H, return_weights=True, average_weights=False, **kw)
    assert w.shape == (B, H, Lq, Lk)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    if "key" in mask:
        assert np.all(w[1, ..., 5:] == 0) and np.all(w[2, ..., 1:] == 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("Hkv", [1, 2, 3])
@pytest.mark.parametrize("form", ["packed", "separate"])
@pytest.mark.parametrize("masks", ["none", "key+causal", "head_bool"])
def test_grouped_query_attention(dtype, Hkv, form, masks, rng):
    E, H, B, Lq, Lk = 24, 6, 2, 5, 8
    p = make_params(rng, E, H, Hkv=Hkv, dtype=dtype)
    assert p["w_key"].shape == (Hkv * 4, E)
    q, kv = randn(rng, (B, Lq, E), dtype), randn(rng, (B, Lk, E), dtype)
    kw = {}
    if masks == "key+causal":
        km = np.ones((B, Lk), bool)
        km[0, -3:] = False
        kw.update(key_mask=km, is_causal=True)
    elif masks == "head_bool":
        m = rng.random((B, H, Lq, Lk)) < 0.5
        m[..., 0] = True
        kw["attn_mask"] = m
    weights = packed(p) if form == "packed" else p
    out, w = mha(q, kv, kv, num_heads=H, num_kv_heads=Hkv, return_weights=True,
                 average_weights=False, **weights, **kw)
    r_out, r_w = ref(q, kv, kv, p, num_heads=H, num_kv_heads=Hkv, return_weights=True,
                     average_weights=False, **kw)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    out_avg, w_avg = mha(q, kv, kv, num_heads=H, num_kv_heads=Hkv, return_weights=True,
                         **weights, **kw)
    assert_close(w_avg, r_w.mean(axis=1), dtype)
    np.testing.assert_array_equal(out_avg, out)  # same kernel path: identical


def test_grouped_query_self_attention_and_no_repeat(rng):
    """Self-attention with Hkv < H: one GEMM; the kernel sees broadcast (stride 0) K/V heads."""
    E, H, Hkv, B, L = 32, 8, 2, 2, 10
    p = make_params(rng, E, H, Hkv=Hkv)
    x = randn(rng, (B, L, E), np.float32)
    assert_close(mha(x, x, x, num_heads=H, num_kv_heads=Hkv, **packed(p)),
                 ref(x, x, x, p, num_heads=H, num_kv_heads=Hkv), np.float32)
    prep = _prepare(x, x, x, H, packed(p), num_kv_heads=Hkv)
    q, k, v, mask, out, attn = _multihead._project_heads(prep)
    assert q.shape == (B, Hkv, H // Hkv, L, E // H)
    assert k.shape == v.shape == (B, Hkv, 1, L, E // H)
    assert owner(q) is owner(k) is owner(v)  # one projection buffer (one GEMM)
    assert np.shares_memory(out, attn)
    plan = fastattn.explain(q, k, v, out=out)
    assert plan.copies == ()
    assert plan.batch_shape == (B, Hkv, H // Hkv)


def owner(a):
    """The array that owns a view's memory."""
    while a.base is not None:
        a = a.base
    return a


def _prepare(q, k, v, H, weights, **kw):
    args = dict(num_heads=H, w_qkv=None, b_qkv=None, w_query=None, w_key=None, w_value=None,
                b_query=None, b_key=None, b_value=None, w_out=None, b_out=None, attn_mask=None,
                key_mask=None, is_causal=False, return_weights=False, average_weights=True,
                num_kv_heads=None, scale=None, causal_alignment="top_left", n_threads=None)
    args.update(weights)
    args.update(kw)
    return _multihead._prepare(q, k, v, *args.values())


@pytest.mark.parametrize("kind", ["self", "cross", "key_mask"])
def test_no_copies_between_projections_and_kernel(kind, rng):
    E, H, B, Lq, Lk = 32, 4, 3, 6, 9
    p = packed(make_params(rng, E, H))
    x = randn(rng, (B, Lq, E), np.float32)
    mem = randn(rng, (B, Lk, E), np.float32)
    kw = {}
    if kind == "key_mask":
        kw["key_mask"] = np.ones((B, Lk), bool)
    args = (x, x, x) if kind == "self" else (x, mem, mem)
    prep = _prepare(*args, H, p, **kw)
    q, k, v, mask, out, attn = _multihead._project_heads(prep)
    assert q.shape == out.shape == (B, H, Lq, E // H)
    assert q.base is not None and not q.flags.c_contiguous  # a head-split view
    if kind == "self":
        assert owner(q) is owner(k) is owner(v)  # one GEMM into one buffer
    else:
        assert owner(k) is owner(v) is not owner(q)  # keys and values: one GEMM over `mem`
    if kind == "key_mask":
        assert mask.shape == (B, 1, 1, Lk)
        assert np.shares_memory(mask, kw["key_mask"])  # a view, not an expansion
    plan = fastattn.explain(q, k, v, mask, out=out)
    assert plan.copies == ()
    assert np.shares_memory(out, attn) and attn.flags.c_contiguous


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_strided_and_readonly_inputs(dtype, rng):
    E, H, B, Lq, Lk = 16, 2, 2, 5, 7
    p = make_params(rng, E, H, kdim=12, vdim=20, dtype=dtype)
    q = randn(rng, (B, 2 * Lq, E + 3), dtype)[:, ::2, 1:E + 1]      # strided rows, padded
    k = np.swapaxes(randn(rng, (Lk, B, 12), dtype), 0, 1)            # (B, Lk, kdim) transposed view
    v = randn(rng, (B, Lk, 20), dtype)
    v.flags.writeable = False
    w_q = np.asfortranarray(p["w_query"])                              # a transposed weight layout
    weights = dict(p, w_query=w_q)
    out, w = mha(q, k, v, num_heads=H, return_weights=True, **weights)
    r_out, r_w = ref(q, k, v, p, num_heads=H, return_weights=True)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)


def test_inputs_not_modified(rng):
    E, H, B, L = 16, 4, 2, 6
    p = packed(make_params(rng, E, H))
    x = randn(rng, (B, L, E), np.float32)
    m = rng.random((L, L)) < 0.7
    km = np.ones((B, L), bool)
    km[0, -1] = False
    fm = randn(rng, (L, L), np.float64)  # a float64 mask cast to float32 internally
    before = {n: a.copy() for n, a in dict(p, x=x, m=m, km=km, fm=fm).items()}
    mha(x, x, x, num_heads=H, attn_mask=m, key_mask=km, return_weights=True, **p)
    mha(x, x, x, num_heads=H, attn_mask=fm, key_mask=km, is_causal=True, **p)
    for name, a in dict(p, x=x, m=m, km=km, fm=fm).items():
        np.testing.assert_array_equal(a, before[name], err_msg=name)


def test_fully_masked_rows_give_output_bias_and_zero_weights(rng):
    E, H, B, Lq, Lk = 16, 4, 2, 3, 5
    p = make_params(rng, E, H)
    q, kv = randn(rng, (B, Lq, E), np.float32), randn(rng, (B, Lk, E), np.float32)
    km = np.ones((B, Lk), bool)
    km[1] = False  # batch item 1 has no real key
    out, w = mha(q, kv, kv, num_heads=H, key_mask=km, return_weights=True, **packed(p))
    assert np.all(np.isfinite(out)) and np.all(np.isfinite(w))
    np.testing.assert_allclose(out[1], np.broadcast_to(p["b_out"], (Lq, E)), rtol=0, atol=0)
    assert np.all(w[1] == 0)
    assert_close(out, ref(q, kv, kv, p, num_heads=H, key_mask=km), np.float32)


def test_no_bias_scale_and_output_size(rng):
    E, H, E_out = 16, 2, 10
    p = make_params(rng, E, H, bias=False, E_out=E_out)
    x = randn(rng, (3, 4, E), np.float64)
    out = mha(x, x, x, num_heads=H, scale=0.7, **p)
    assert out.shape == (3, 4, E_out)
    assert_close(out, ref(x, x, x, p, num_heads=H, scale=0.7), np.float64)


def test_single_rows_and_empty_keys(rng):
    E, H = 8, 2
    p = make_params(rng, E, H)
    q = randn(rng, (4, 1, E), np.float32)   # one query per item: rows one batch stride apart
    kv = randn(rng, (4, 1, E), np.float32)
    assert_close(mha(q, kv, kv, num_heads=H, **packed(p)), ref(q, kv, kv, p, num_heads=H), np.float32)
    empty = np.zeros((4, 0, E), np.float32)
    out, w = mha(q, empty, empty, num_heads=H, return_weights=True, **packed(p))
    np.testing.assert_allclose(out, np.broadcast_to(p["b_out"], out.shape))
    assert w.shape == (4, 1, 0)
    out = mha(empty, kv, kv, num_heads=H, **packed(p))
    assert out.shape == (4, 0, E)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize(("kdim", "vdim"), [(0, 5), (5, 0), (0, 0)])
@pytest.mark.parametrize("bias", [True, False])
def test_zero_feature_keys_and_values(dtype, kdim, vdim, bias, rng):
    """kdim = 0 / vdim = 0 are valid (NumPy's empty sums): a zero-feature key projects to
    its bias, so every score of a query is equal; a zero-feature value projects to its
    bias.  float32 used to return uninitialised memory (the few-row kernel refused K = 0)."""
    E, H = 8, 2
    p = make_params(rng, E, H, kdim=kdim, vdim=vdim, bias=bias, dtype=dtype)
    q = randn(rng, (3, 4, E), dtype)
    k = randn(rng, (3, 6, kdim), dtype)
    v = randn(rng, (3, 6, vdim), dtype)
    out, w = mha(q, k, v, num_heads=H, return_weights=True, **p)
    ref_out, ref_w = ref(q, k, v, p, num_heads=H, return_weights=True)
    assert np.isfinite(out).all()
    assert_close(out, ref_out, dtype)
    assert_close(w, ref_w, dtype)
    if kdim == 0:  # all-equal scores: uniform weights
        np.testing.assert_allclose(w, 1.0 / 6, rtol=1e-6)
    out1 = mha(q[0], k[0], v[0], num_heads=H, **p)  # unbatched, and a few rows
    assert_close(out1, ref(q[0], k[0], v[0], p, num_heads=H), dtype)


def test_dtype_policy(rng):
    E, H = 8, 2
    p32 = packed(make_params(rng, E, H, dtype=np.float32))
    x64 = randn(rng, (2, 3, E), np.float64)
    assert mha(x64, x64, x64, num_heads=H, **p32).dtype == np.float64
    x16 = x64.astype(np.float16)
    out16 = mha(x16, x16, x16, num_heads=H, **{k: v.astype(np.float16) for k, v in p32.items()})
    assert out16.dtype == np.float16
    xi = np.arange(2 * 3 * E).reshape(2, 3, E) % 5
    out_i = mha(xi, xi, xi, num_heads=H, **p32)
    assert out_i.dtype == np.float64
    p_sep = {"w_query": p32["w_qkv"][:E], "w_key": p32["w_qkv"][E:2 * E],
             "w_value": p32["w_qkv"][2 * E:], "w_out": p32["w_out"],
             "b_query": p32["b_qkv"][:E], "b_key": p32["b_qkv"][E:2 * E],
             "b_value": p32["b_qkv"][2 * E:], "b_out": p32["b_out"]}
    assert_close(out_i, ref(xi, xi, xi, p_sep, num_heads=H), np.float64)


def test_lists_are_accepted(rng):
    E, H = 4, 2
    p = make_params(rng, E, H, dtype=np.float64)
    x = randn(rng, (3, E), np.float64)
    out = mha(x.tolist(), x.tolist(), x.tolist(), num_heads=H,
              **{k: v.tolist() for k, v in p.items()})
    assert_close(out, ref(x, x, x, p, num_heads=H), np.float64)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_threads_do_not_change_result(dtype, rng, monkeypatch):
    """(4, 128, 64): the QKV GEMM (12.6 MFLOP), the output GEMM and the attention are all
    big enough to run on 2 threads (shown by the projections' block counts); every block
    computes its outputs as one thread would, so float64 is exact and float32 within 1e-6."""
    E, H = 64, 4
    p = packed(make_params(rng, E, H, dtype=dtype))
    x = randn(rng, (4, 128, E), dtype)
    calls = []
    real = _multihead._proj.linear

    def counting(xx, w, b, y, n_threads):
        blocks = real(xx, w, b, y, n_threads)
        calls.append((w.shape[0], n_threads, blocks))
        return blocks

    monkeypatch.setattr(_multihead._proj, "linear", counting)
    a = mha(x, x, x, num_heads=H, n_threads=1, **p)
    assert [c[2] for c in calls] == [1, 1]
    calls.clear()
    b = mha(x, x, x, num_heads=H, n_threads=2, **p)
    assert [c[:2] for c in calls] == [(3 * E, 2), (E, 2)]   # QKV, then the output projection
    assert all(c[2] >= 2 for c in calls), calls
    if dtype == np.float64:
        np.testing.assert_array_equal(a, b)
    else:
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    assert_close(b, ref(x, x, x, {"w_query": p["w_qkv"][:E], "w_key": p["w_qkv"][E:2 * E],
                                  "w_value": p["w_qkv"][2 * E:], "w_out": p["w_out"],
                                  "b_query": p["b_qkv"][:E], "b_key": p["b_qkv"][E:2 * E],
                                  "b_value": p["b_qkv"][2 * E:], "b_out": p["b_out"]},
                        num_heads=H), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("form", ["self", "cross"])
def test_grouped_query_unbatched(dtype, form, rng):
    E, H, Hkv = 16, 4, 2
    p = make_params(rng, E, H, Hkv=Hkv, kdim=None if form == "self" else 6,
                    vdim=None if form == "self" else 10, dtype=dtype)
    q = randn(rng, (5, E), dtype)
    k = q if form == "self" else randn(rng, (7, 6), dtype)
    v = q if form == "self" else randn(rng, (7, 10), dtype)
    real = np.ones(k.shape[0], bool)
    real[-2:] = False
    out, w = mha(q, k, v, num_heads=H, num_kv_heads=Hkv, key_mask=real, return_weights=True,
                 average_weights=False, **p)
    ref_out, ref_w = ref(q, k, v, p, num_heads=H, num_kv_heads=Hkv, key_mask=real,
                         return_weights=True, average_weights=False)
    assert out.shape == (5, E) and w.shape == (H, 5, k.shape[0])
    assert_close(out, ref_out, dtype)
    assert_close(w, ref_w, dtype)
    if form == "self":
        pk = dict(packed(p))
        assert_close(mha(q, q, q, num_heads=H, num_kv_heads=Hkv, key_mask=real, **pk), ref_out, dtype)


def test_reexported():
    from fastattn import functional

    assert functional.multi_head_attention is fastattn.multi_head_attention is mha
    assert "multi_head_attention" in fastattn.__all__ and "multi_head_attention" in functional.__all__


# --------------------------------------------------------------------------
# Errors: each message pinned

def _good(rng, E=8, H=2):
    p = packed(make_params(rng, E, H))
    x = randn(rng, (2, 3, E), np.float32)
    return x, p


@pytest.mark.parametrize(("change", "exc", "match"), [
    ({"num_heads": 0}, ValueError, r"num_heads: expected an integer >= 1, got 0"),
    ({"num_heads": 2.0}, TypeError, r"num_heads: expected a positive integer, got float 2.0"),
    ({"num_heads": True}, TypeError, r"num_heads: expected a positive integer, got bool True"),
    ({"num_heads": 3}, ValueError, r"query: expected an embedding size E divisible by num_heads=3, got E=8"),
    ({"num_kv_heads": 3}, ValueError, r"num_kv_heads: expected a divisor of num_heads=2 .*got 3"),
    ({"is_causal": 1}, TypeError, r"is_causal: expected a bool, got int 1"),
    ({"return_weights": "yes"}, TypeError, r"return_weights: expected a bool, got str 'yes'"),
    ({"average_weights": None}, TypeError, r"average_weights: expected a bool, got NoneType"),
    ({"causal_alignment": "left"}, ValueError, r"causal_alignment: expected 'top_left' or 'bottom_right', got 'left'"),
    ({"scale": "1"}, TypeError, r"scale: expected a real number or None, got str '1'"),
    ({"n_threads": 0}, ValueError, r"n_threads: expected a positive integer \(>= 1\), got 0"),
    ({"w_qkv": np.zeros((20, 8), np.float32)}, ValueError,
     r"w_qkv: expected shape \(24, 8\) \(\(num_heads \+ 2 \* num_kv_heads\) \* head_dim, E\), got \(20, 8\)"),
    ({"b_qkv": np.zeros(23, np.float32)}, ValueError, r"b_qkv: expected shape \(24,\) .*got \(23,\)"),
    ({"w_out": np.zeros((8, 7), np.float32)}, ValueError, r"w_out: expected shape \(E_out, E=8\), got \(8, 7\)"),
    ({"b_out": np.zeros(9, np.float32)}, ValueError, r"b_out: expected shape \(8,\) \(E_out\), got \(9,\)"),
    ({"w_query": np.zeros((8, 8), np.float32)}, ValueError,
     r"w_query: give either the packed w_qkv .* not both; got w_qkv and w_query"),
    ({"w_qkv": None, "b_qkv": None}, ValueError, r"w_query: expected the projection weights.*missing w_query, w_key, w_value"),
    ({"w_qkv": np.zeros((24, 8), np.complex64)}, TypeError, r"w_qkv: complex dtypes are not supported"),
    ({"b_out": "bias"}, TypeError, r"b_out: expected a real numeric dtype, got <U4"),
    ({"key_mask": np.ones((2, 3), np.int8)}, TypeError,
     r"key_mask: expected a bool array of shape \(2, 3\) \(True = real token, False = padding\), got dtype int8"),
    ({"key_mask": np.ones((2, 4), bool)}, ValueError, r"key_mask: expected shape \(2, 3\) .*got \(2, 4\)"),
    ({"attn_mask": np.ones((3, 3), np.int32)}, TypeError,
     r"attn_mask: expected a bool mask \(True = may attend\) or a float mask .*got dtype int32"),
    ({"attn_mask": np.ones((4, 3, 3), bool)}, ValueError,
     r"attn_mask: expected a shape broadcastable to \(B=2, num_heads=2, Lq=3, Lk=3\), got \(4, 3, 3\)"),
    ({"attn_mask": np.ones((1, 2, 2, 3, 3), bool)}, ValueError, r"attn_mask: expected a shape broadcastable"),
])
def test_errors(change, exc, match, rng):
    x, p = _good(rng)
    kw = dict(p, num_heads=2)
    kw.update(change)
    with pytest.raises(exc, match=match):
        mha(x, x, x, **kw)


def test_missing_arrays_are_named(rng):
    x, p = _good(rng)
    with pytest.raises(TypeError, match=r"^key: expected an array, got None \(pass the query again for self-attention\)$"):
        mha(x, None, None, num_heads=2, **p)
    with pytest.raises(TypeError, match=r"^value: expected an array, got None \(pass the query again"):
        mha(x, x[:, :2], None, num_heads=2, **p)
    with pytest.raises(TypeError, match=r"^query: expected an array, got None$"):
        mha(None, x, x, num_heads=2, **p)
    with pytest.raises(TypeError, match=r"^w_out: expected an array, got None$"):
        mha(x, x, x, num_heads=2, **dict(p, w_out=None))


def test_query_size_blamed_on_the_query(rng):
    """A query whose E disagrees with both the input and output projections is named
    first (it used to blame w_qkv, or num_heads' divisibility)."""
    x, p = _good(rng)   # weights for E = 8
    for E in (6, 7):
        q = randn(rng, (2, 3, E), np.float32)
        with pytest.raises(ValueError, match=rf"^query: expected embedding size E=8 \(the in_features of "
                                             rf"w_out \(8, 8\) and w_qkv \(24, 8\)\), got E={E} "
                                             rf"\(query of shape \(2, 3, {E}\)\)$"):
            mha(q, q, q, num_heads=2, **p)
    sep = {"w_query": p["w_qkv"][:8], "w_key": p["w_qkv"][8:16], "w_value": p["w_qkv"][16:],
           "w_out": p["w_out"]}
    q = randn(rng, (3, 6), np.float32)
    with pytest.raises(ValueError, match=r"^query: expected embedding size E=8 .*w_query \(8, 8\)\), got E=6 "
                                         r"\(query of shape \(3, 6\)\)$"):
        mha(q, x[0], x[0], num_heads=2, **sep)
    q = randn(rng, (2, 3, 6), np.float32)   # nothing agrees with the query: still named first
    with pytest.raises(ValueError, match=r"^query: expected embedding size E=8 \(the in_features of w_out "
                                         r"\(8, 8\)\), got E=6"):
        mha(q, q, q, num_heads=2, **dict(p, w_qkv=np.zeros((24, 7), np.float32)))
    with pytest.raises(ValueError, match=r"^w_out: expected shape \(E_out, E=6\), got \(8, 8\)"):
        mha(q, q, q, num_heads=2, **dict(p, w_qkv=np.zeros((18, 6), np.float32), b_qkv=None))
    e0 = np.zeros((2, 3, 0), np.float32)
    with pytest.raises(ValueError, match=r"^query: expected an embedding size E >= 1, got E=0"):
        mha(e0, x, x, num_heads=2, w_qkv=np.zeros((0, 0), np.float32), w_out=np.zeros((4, 0), np.float32))


def test_unbatched_mask_errors(rng):
    x, p = _good(rng)
    with pytest.raises(ValueError, match=r"key_mask: expected shape \(3,\) \(\(Lk,\), True = real token\), got \(2, 3\)"):
        mha(x[0], x[0], x[0], num_heads=2, key_mask=np.ones((2, 3), bool), **p)
    with pytest.raises(ValueError, match=r"attn_mask: expected a shape broadcastable to \(num_heads=2, Lq=3, Lk=3\), got \(1, 2, 3, 3\)"):
        mha(x[0], x[0], x[0], num_heads=2, attn_mask=np.ones((1, 2, 3, 3), bool), **p)


def test_blas_range_errors(rng, monkeypatch):
    """Sizes beyond SciPy's 32-bit BLAS integers are refused up front (shown with a lowered limit)."""
    x, p = _good(rng)
    monkeypatch.setattr(_multihead, "BLAS_INT_MAX", 5)
    with pytest.raises(ValueError, match=r"B \* Lq=6 exceeds the BLAS 32-bit integer range \(max 5\)"):
        mha(x, x, x, num_heads=2, **p)


def test_shape_errors(rng):
    x, p = _good(rng)
    with pytest.raises(ValueError, match=r"query: expected a \(B, Lq, E\) batch or an unbatched \(Lq, E\) array, got 1-d"):
        mha(x[0, 0], x[0, 0], x[0, 0], num_heads=2, **p)
    with pytest.raises(ValueError, match=r"key: expected a 3-d array \(B, Lk, features\), got 2-d"):
        mha(x, x[0], x, num_heads=2, **p)
    with pytest.raises(ValueError, match=r"value: expected a 2-d array \(Lk, features\), unbatched like query"):
        mha(x[0], x[0], x, num_heads=2, **p)
    with pytest.raises(ValueError, match=r"key/value: expected batch size 2 \(query's\)"):
        mha(x, x[:1], x[:1], num_heads=2, **p)
    with pytest.raises(ValueError, match=r"value: expected 3 rows \(key's length Lk\), got value of shape \(4, 8\)"):
        mha(x, x, np.zeros((2, 4, 8), np.float32), num_heads=2, **p)
    y = np.zeros((2, 3, 5), np.float32)
    with pytest.raises(ValueError, match=r"w_qkv: packed weights need key and value of query's size E=8, got kdim=5, vdim=8"):
        mha(x, y, x, num_heads=2, **p)
    with pytest.raises(ValueError, match=r"b_qkv: the packed bias goes with the packed w_qkv"):
        mha(x, x, x, num_heads=2, b_qkv=p["b_qkv"], w_query=p["w_qkv"][:8], w_key=p["w_qkv"][8:16],
            w_value=p["w_qkv"][16:], w_out=p["w_out"])
    with pytest.raises(ValueError, match=r"w_key: expected shape \(8, 5\) \(num_kv_heads \* head_dim, kdim\), got \(8, 8\)"):
        mha(x, y, x, num_heads=2, w_query=p["w_qkv"][:8], w_key=p["w_qkv"][8:16],
            w_value=p["w_qkv"][16:], w_out=p["w_out"])
    with pytest.raises(TypeError, match=r"query: complex dtypes are not supported"):
        mha(x.astype(np.complex64), x, x, num_heads=2, **p)
    with pytest.raises(TypeError, match=r"missing 1 required keyword-only argument: 'w_out'"):
        mha(x, x, x, num_heads=2, w_qkv=p["w_qkv"])


# --------------------------------------------------------------------------
# torch.nn.MultiheadAttention (eval) on the same weights

def _torch_mha(torch, E, H, kdim=None, vdim=None, bias=True, batch_first=True, dtype=np.float32, seed=0):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                    dtype=torch.float64 if dtype == np.float64 else torch.float32)
    if bias:  # torch initialises biases to 0: make them matter
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m.eval()


def _torch_weights(m, E):
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    sep = {}
    if "in_proj_weight" in sd:
        W = sd["in_proj_weight"]
        sep.update(w_query=W[:E], w_key=W[E:2 * E], w_value=W[2 * E:])
    else:
        sep.update(w_query=sd["q_proj_weight"], w_key=sd["k_proj_weight"], w_value=sd["v_proj_weight"])
    sep["w_out"] = sd["out_proj.weight"]
    if "in_proj_bias" in sd:
        b = sd["in_proj_bias"]
        sep.update(b_query=b[:E], b_key=b[E:2 * E], b_value=b[2 * E:], b_out=sd["out_proj.bias"])
    return sep


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("case", ["self", "cross", "kdim_vdim", "bool_mask", "float_mask", "key_padding",
                                  "causal", "no_bias", "unbatched", "per_head"])
def test_matches_torch(dtype, case, rng):
    torch = pytest.importorskip("torch")
    E, H, B, Lq, Lk = 32, 4, 3, 7, 9
    kdim = vdim = None
    if case == "kdim_vdim":
        kdim, vdim = 12, 20
    m = _torch_mha(torch, E, H, kdim=kdim, vdim=vdim, bias=case != "no_bias", dtype=dtype)
    p = _torch_weights(m, E)
    q = randn(rng, (B, Lq, E), dtype)
    k = randn(rng, (B, Lk, kdim or E), dtype)
    v = randn(rng, (B, Lk, vdim or E), dtype)
    if case in ("self", "causal", "no_bias"):
        k = v = q
    ours_kw, torch_kw = {}, {}
    if case == "bool_mask":
        allowed = rng.random((Lq, Lk)) < 0.6
        allowed[:, 0] = True
        ours_kw["attn_mask"] = allowed
        torch_kw["attn_mask"] = torch.from_numpy(~allowed)  # torch: True = NOT allowed
    elif case == "float_mask":
        fm = randn(rng, (Lq, Lk), dtype)
        ours_kw["attn_mask"] = fm
        torch_kw["attn_mask"] = torch.from_numpy(fm)
    elif case == "key_padding":
        real = np.ones((B, Lk), bool)
        real[1, 4:] = False
        real[2, 7:] = False
        ours_kw["key_mask"] = real
        torch_kw["key_padding_mask"] = torch.from_numpy(~real)  # torch: True = padding
    elif case == "causal":
        ours_kw["is_causal"] = True
        torch_kw.update(attn_mask=torch.from_numpy(~np.tri(Lq, Lq, dtype=bool)), is_causal=True)
    avg = case != "per_head"
    if case == "unbatched":
        q, k, v = q[0], k[0], v[0]
    layout = {} if case == "kdim_vdim" else packed(p)
    weights = p if case == "kdim_vdim" else layout
    out, w = mha(q, k, v, num_heads=H, return_weights=True, average_weights=avg, **weights, **ours_kw)
    with torch.inference_mode():
        t_out, t_w = m(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), need_weights=True,
                       average_attn_weights=avg, **torch_kw)
    r_out, r_w = ref(q, k, v, p, num_heads=H, return_weights=True, average_weights=avg, **ours_kw)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    assert_close(out, t_out.numpy().astype(np.float64), dtype)
    assert_close(w, t_w.numpy().astype(np.float64), dtype)
    with torch.inference_mode():  # torch's fast path (no weights) agrees too
        t_fast = m(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), need_weights=False,
                   **torch_kw)[0].numpy()
    assert_close(mha(q, k, v, num_heads=H, **weights, **ours_kw), t_fast.astype(np.float64), dtype)
