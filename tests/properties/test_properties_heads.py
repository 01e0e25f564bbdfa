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

from support import (F32, F64, LAYOUTS_ND, assert_agree, assert_all_close, check_causal_rows,
                    check_float32_and_float64_agree, check_kv_permutation, check_padded_keys,
                    check_row_constant_invariance, f32, lay, random_mask)
from support import allowed_matrix, assert_close, check_weights, prop_settings
from test_multihead import make_params, packed

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
    P = {n: f32(a) for n, a in make_params(rng, E, H, Hkv=Hkv, kdim=kdim, vdim=vdim,
                                           bias=has_bias, dtype=np.float64).items()}
    bshape = (B,) if batched else ()
    x = f32(rng.standard_normal(bshape + (Lq, E)))
    kv = x if is_self else f32(rng.standard_normal(bshape + (Lk, kdim or E)))
    val = kv if vdim == kdim else f32(rng.standard_normal(bshape + (Lk, vdim)))
    mkind = draw(st.sampled_from(["none", "bool", "float"]))
    m = None
    if mkind != "none":
        full = ((B,) if batched else ()) + (H, Lq, Lk)
        shapes = [(Lq, Lk), (H, Lq, Lk), (1, Lk)]
        if batched:
            shapes += [(B, 1, Lq, Lk), full, (B, 1, 1, Lk)]
        m = random_mask(draw, rng, mkind, draw(st.sampled_from(shapes)), [0.2, 0.6, 0.9])
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
    a = allowed_matrix(c["Lq"], c["Lk"], c["m"], c["causal"], c["align"])
    if c["km"] is not None:
        a = a & c["km"][..., None, None, :]
    return np.broadcast_to(a, ((c["B"],) if c["batched"] else ()) + (c["H"], c["Lq"], c["Lk"]))


@pytest.mark.parametrize("op", OPS)
@prop_settings(1)
@given(data=st.data())
def test_matches_oracle_and_weights_are_distributions(op, data):
    c = data.draw(problems(op))
    dt = c["dtype"]
    out, w = run(c, weights=True)
    r_out, r_w = oracle(c)
    assert_all_close((out, w), (r_out, r_w), dt)
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
    check_row_constant_invariance(run, c, full, c_max)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_key_bias_changes_nothing(op, data):
    """Every key of a head is shifted by the same b_key slice: a per-row constant."""
    c = data.draw(problems(op, bias=True))
    P = dict(c["P"], b_key=f32(c["P"]["b_key"] + c["rng"].standard_normal(c["P"]["b_key"].shape)))
    a, b = run(c), run(dict(c, P=P))
    assert_agree(b, a, c["dtype"], atol_scale=4.0 if c["dtype"] == F32 else 1.0)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data())
def test_key_value_permutation(op, data):
    """Cross-attention: the output is unchanged; self-attention: its rows are permuted."""
    c = data.draw(problems(op, causal=False))
    check_kv_permutation(run, c)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_causal_rows_do_not_see_later_keys(op, data, weights):
    c = data.draw(problems(op, causal=True))
    check_causal_rows(run, oracle, c, data.draw(st.integers(0, c["Lk"] - 1)), weights)


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.75)
@given(data=st.data(), weights=st.booleans())
def test_padded_keys_have_no_influence(op, data, weights):
    """Keys/values where key_mask is False: any values, the same result bit-for-bit
    (self-attention: for the rows whose query did not change)."""
    c = data.draw(problems(op, key_mask=True))
    # the weights (..., H, Lq, Lk) with the heads last, so that rows index them
    check_padded_keys(run, oracle, c, weights, weights_rows=lambda w: np.moveaxis(w, -3, -1))


@pytest.mark.parametrize("op", OPS)
@prop_settings(0.5)
@given(data=st.data())
def test_float32_and_float64_agree(op, data):
    c = data.draw(problems(op))
    check_float32_and_float64_agree(lambda dt: run(c, weights=True, dtype=dt))
