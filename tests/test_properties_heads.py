"""Hypothesis properties of multi-head attention: ``fastattn.multi_head_attention``
(packed and separate weights, self- and cross-attention, GQA ``num_kv_heads``,
``attn_mask`` of every broadcast shape, ``key_mask``, both causal alignments,
unbatched inputs) and the layer ``fastattn.layers.MultiHeadAttention`` (its
prepared-weights paths), against ``fastattn._reference.multi_head_attention``.

Properties as in test_properties_all.py: oracle agreement; per-head weights
are distributions over the allowed keys (zero rows where none is) and a row
with no allowed key in any head gives ``b_out``; a per-row constant in a
float mask and any change of ``b_key`` (``q . (k + b)`` shifts a row by
``q . b``) change nothing; permuting keys/values (with the masks) changes
nothing, and for self-attention permutes the output rows; causality and
masked keys bit-for-bit; float32 vs float64.  (test_mha_properties.py has the
basic oracle / key-permutation properties with key_mask only.)
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fastattn
from fastattn import _reference as R
from fastattn.layers import MultiHeadAttention

from conftest import assert_close, check_weights, prop_settings
from test_multihead import make_params, packed
from test_properties_all import F32, F64, LAYOUTS_ND, _f32, assert_agree, lay

OPS = ["functional", "layer"]


@st.composite
def problems(draw, op, *, causal=None, bias=None, self_attn=None, key_mask=None):
    dtype = draw(st.sampled_from([F32, F64]))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    dh = draw(st.integers(1, 5))
    E = H * dh
    batched = draw(st.booleans())
    B = draw(st.integers(1, 3)) if batched else 1
    Lq = draw(st.one_of(st.integers(1, 10), st.sampled_from([1, 33])))
    is_self = draw(st.booleans()) if self_attn is None else self_attn
    Lk = Lq if is_self else draw(st.one_of(st.integers(1, 10), st.sampled_from([1, 40])))
    kdim = vdim = None
    if not is_self and draw(st.booleans()):
        kdim = draw(st.integers(1, 7))
        vdim = draw(st.sampled_from([kdim, draw(st.integers(1, 7))]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    has_bias = draw(st.booleans()) if bias is None else bias
    P = {n: _f32(a) for n, a in make_params(rng, E, H, Hkv=Hkv, kdim=kdim, vdim=vdim,
                                           bias=has_bias, dtype=np.float64).items()}
    bshape = (B,) if batched else ()
    x = _f32(rng.standard_normal(bshape + (Lq, E)))
    kv = x if is_self else _f32(rng.standard_normal(bshape + (Lk, kdim or E)))
    val = kv if vdim == kdim else _f32(rng.standard_normal(bshape + (Lk, vdim)))
    mkind = draw(st.sampled_from(["none", "bool", "float"]))
    m = None
    if mkind != "none":
        full = ((B,) if batched else ()) + (H, Lq, Lk)
        shapes = [(Lq, Lk), (H, Lq, Lk), (1, Lk)]
        if batched:
            shapes += [(B, 1, Lq, Lk), full, (B, 1, 1, Lk)]
        shape = draw(st.sampled_from(shapes))
        if mkind == "bool":
            m = rng.random(shape) < draw(st.sampled_from([0.2, 0.6, 0.9]))
        else:
            m = _f32(rng.standard_normal(shape))
            m[rng.random(shape) < 0.25] = -np.inf
    km = None
    if key_mask is None and draw(st.booleans()) or key_mask:
        km = rng.random(bshape + (Lk,)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    return dict(op=op, dtype=dtype, H=H, Hkv=Hkv, E=E, B=B, batched=batched, Lq=Lq, Lk=Lk,
                self=is_self, kdim=kdim, vdim=vdim, bias=has_bias, P=P, q=x, k=kv, v=val,
                m=m, km=km, causal=draw(st.booleans()) if causal is None else causal,
                align=draw(st.sampled_from(["top_left", "bottom_right"])),
                scale=draw(st.sampled_from([None, None, 0.3])) if op == "functional" else None,
                form=draw(st.sampled_from(["packed", "separate"])), rng=rng,
                layouts=tuple(draw(st.sampled_from(LAYOUTS_ND)) for _ in range(3)))


def _layer(c, dt):
    layer = MultiHeadAttention(c["E"], c["H"], kdim=c["kdim"], vdim=c["vdim"], bias=c["bias"],
                               num_kv_heads=c["Hkv"], dtype=dt)
    P = c["P"]
    sd = {"out_proj.weight": P["w_out"]}
    if layer.packed:
        sd["in_proj_weight"] = np.concatenate([P["w_query"], P["w_key"], P["w_value"]])
    else:
        sd.update(q_proj_weight=P["w_query"], k_proj_weight=P["w_key"], v_proj_weight=P["w_value"])
    if c["bias"]:
        sd["in_proj_bias"] = np.concatenate([P["b_query"], P["b_key"], P["b_value"]])
        sd["out_proj.bias"] = P["b_out"]
    return layer.load_state_dict(sd)


def run(c, *, weights=False, average=False, dtype=None):
    """The op on the case's arrays in ``dtype``: (output, per-head or averaged weights)."""
    dt = c["dtype"] if dtype is None else np.dtype(dtype)
    lq, lk, lv = c["layouts"]
    q = lay(c["q"], lq, dt)
    # self-attention passes one array three times (the one-GEMM packed path)
    k = q if c["self"] else lay(c["k"], lk, dt)
    v = k if c["v"] is c["k"] else lay(c["v"], lv, dt)
    m = c["m"] if c["m"] is None or c["m"].dtype == np.bool_ else c["m"].astype(dt)
    kw = dict(attn_mask=m, key_mask=c["km"], is_causal=c["causal"], causal_alignment=c["align"],
              return_weights=weights, average_weights=average)
    if c["op"] == "layer":
        layer = _layer(c, dt)
        if c["self"]:
            return layer(q, **kw)
        return layer(q, k, v, **kw)
    P = {n: a.astype(dt) for n, a in c["P"].items()}
    w = packed(P) if c["form"] == "packed" and c["kdim"] is None else P
    return fastattn.multi_head_attention(q, k, v, num_heads=c["H"], num_kv_heads=c["Hkv"],
                                         scale=c["scale"], **w, **kw)


def oracle(c, **over):
    c = dict(c, **over)
    return R.multi_head_attention(
        c["q"], c["k"], c["v"], num_heads=c["H"], num_kv_heads=c["Hkv"], attn_mask=c["m"],
        key_mask=c["km"], is_causal=c["causal"], scale=c["scale"], causal_alignment=c["align"],
        return_weights=True, average_weights=False, **c["P"])


def allowed(c):
    """(B, H, Lq, Lk) 'may attend' (unbatched: (H, Lq, Lk))."""
    H, Lq, Lk = c["H"], c["Lq"], c["Lk"]
    full = ((c["B"],) if c["batched"] else ()) + (H, Lq, Lk)
    a = np.ones(full, bool)
    if c["m"] is not None:
        m = c["m"]
        a = a & (m if m.dtype == np.bool_ else m != -np.inf)
    if c["km"] is not None:
        a = a & c["km"][..., None, None, :]
    if c["causal"]:
        off = 0 if c["align"] == "top_left" else Lk - Lq
        a = a & (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + off)
    return a


def _changed(rng, a, index):
    a = a.copy()
    a[index] = _f32(3.0 * rng.standard_normal(a[index].shape))
    return a


def _with_kv(c, k, v):
    """The case with new key and value inputs (value follows the key when shared)."""
    if c["self"]:
        return dict(c, q=k, k=k, v=k)
    return dict(c, k=k, v=k if c["v"] is c["k"] else v)


@pytest.mark.parametrize("op", OPS)
@prop_settings(1)
@given(data=st.data())
def test_matches_oracle_and_weights_are_distributions(op, data):
    c = data.draw(problems(op))
    dt = c["dtype"]
    out, w = run(c, weights=True)
    r_out, r_w = oracle(c)
    assert out.dtype == dt and w.dtype == dt
    assert_close(out, r_out, dt)
    assert_close(w, r_w, dt)
    ok = allowed(c)
    check_weights(w, ok, dt)
    none = ~ok.any(-1).any(-2)  # (B, Lq): no head may attend to anything
    b_out = c["P"].get("b_out", np.zeros(c["E"]))
    assert_close(out[none], np.broadcast_to(b_out, out[none].shape), dt)
    out_avg, w_avg = run(c, weights=True, average=True)
    assert_close(w_avg, r_w.mean(axis=-3), dt)
    assert_close(out_avg, r_out, dt)
    assert_close(run(c), r_out, dt)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), c_max=st.sampled_from([1.0, 10.0, 40.0]))
def test_invariant_to_a_constant_added_to_each_score_row(op, data, c_max):
    c = data.draw(problems(op))
    full = ((c["B"],) if c["batched"] else ()) + (c["H"], c["Lq"], c["Lk"])
    m = c["m"]
    if m is None:
        base = np.zeros(full)
    elif m.dtype == np.bool_:
        base = np.where(np.broadcast_to(m, full), 0.0, -np.inf)
    else:
        base = np.broadcast_to(m, full).copy()
    shift = _f32(c["rng"].uniform(-c_max, c_max, full[:-1] + (1,)))
    a, wa = run(dict(c, m=base), weights=True)
    b, wb = run(dict(c, m=base + shift), weights=True)
    s = max(1.0, c_max / 8.0) if c["dtype"] == F32 else 1.0
    assert_agree(b, a, c["dtype"], atol_scale=s)
    assert_agree(wb, wa, c["dtype"], atol_scale=s)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_key_bias_changes_nothing(op, data):
    """Every key of a head is shifted by the same b_key slice: a per-row constant."""
    c = data.draw(problems(op, bias=True))
    P = dict(c["P"], b_key=_f32(c["P"]["b_key"] + c["rng"].standard_normal(c["P"]["b_key"].shape)))
    a, b = run(c), run(dict(c, P=P))
    assert_agree(b, a, c["dtype"], atol_scale=4.0 if c["dtype"] == F32 else 1.0)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data())
def test_key_value_permutation(op, data):
    """Cross-attention: the output is unchanged; self-attention: its rows are permuted."""
    c = data.draw(problems(op, causal=False))
    perm = c["rng"].permutation(c["Lk"])
    m, km = c["m"], c["km"]
    if m is not None and m.shape[-1] == c["Lk"]:
        m = m[..., perm]
    if c["self"] and m is not None and m.shape[-2] == c["Lq"]:
        m = m[..., perm, :]
    km = None if km is None else km[..., perm]
    c2 = dict(_with_kv(c, c["k"][..., perm, :], c["v"][..., perm, :]), m=m, km=km)
    (a, wa), (b, wb) = run(c, weights=True), run(c2, weights=True)
    if c["self"]:
        a, wa = a[..., perm, :], wa[..., perm, :]
    assert_agree(b, a, c["dtype"])
    assert_agree(wb, wa[..., perm], c["dtype"])


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_causal_rows_do_not_see_later_keys(op, data, weights):
    c = data.draw(problems(op, causal=True))
    Lq, Lk = c["Lq"], c["Lk"]
    t = data.draw(st.integers(0, Lk - 1))
    off = 0 if c["align"] == "top_left" else Lk - Lq
    n = min(Lq, max(0, t - off))
    idx = (Ellipsis, slice(t, None), slice(None))
    c2 = _with_kv(c, _changed(c["rng"], c["k"], idx), _changed(c["rng"], c["v"], idx))
    a, b = run(c, weights=weights), run(c2, weights=weights)
    if weights:
        (a, wa), (b, wb) = a, b
        np.testing.assert_array_equal(wa[..., :n, :], wb[..., :n, :])
    np.testing.assert_array_equal(a[..., :n, :], b[..., :n, :])
    assert_close(b, oracle(c2)[0], c["dtype"])


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_padded_keys_have_no_influence(op, data, weights):
    """Keys/values where key_mask is False: any values, the same result bit-for-bit
    (self-attention: for the rows whose query did not change)."""
    c = data.draw(problems(op, key_mask=True))
    km = c["km"].copy()
    km[..., c["rng"].integers(0, c["Lk"])] = False
    c = dict(c, km=km)
    pad = ~km
    c2 = _with_kv(c, _changed(c["rng"], c["k"], pad), _changed(c["rng"], c["v"], pad))
    a, b = run(c, weights=weights), run(c2, weights=weights)
    rows = km if c["self"] else np.ones(km.shape[:-1] + (c["Lq"],), bool)
    if weights:
        (a, wa), (b, wb) = a, b
        np.testing.assert_array_equal(np.moveaxis(wa, -3, -1)[rows], np.moveaxis(wb, -3, -1)[rows])
    np.testing.assert_array_equal(a[rows], b[rows])
    assert_close(b, oracle(c2)[0], c["dtype"])


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_float32_and_float64_agree(op, data):
    c = data.draw(problems(op))
    o32, w32 = run(c, weights=True, dtype=F32)
    o64, w64 = run(c, weights=True, dtype=F64)
    assert o32.dtype == F32 and o64.dtype == F64
    assert_agree(o32, o64, F32, factor=1.0)
    assert_agree(w32, w64, F32, factor=1.0)
