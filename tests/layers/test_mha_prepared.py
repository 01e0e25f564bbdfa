"""The layer's prepared-weights path (weights validated once) and the trusted SDPA call
of multi-head attention (_sdpa._sdpa_canonical), against the float64 oracle."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import fastattn
from fastattn import _multihead, _sdpa, functional as F
from fastattn.layers import MultiHeadAttention
from support import assert_close, oracle, randn

from test_mha_layer import oracle_of, randomise

DTYPES = [np.float32, np.float64]
LAYOUTS = {"packed": {}, "kdim_vdim": {"kdim": 6, "vdim": 10}, "gqa": {"num_kv_heads": 2},
           "no_bias": {"bias": False}}


@pytest.fixture
def no_general_path(monkeypatch):
    """Fail if multi_head_attention_prepared falls back to the general entry."""
    def boom(*a, **k):
        raise AssertionError("the general path was taken")
    monkeypatch.setattr(_multihead, "multi_head_attention", boom)


def _masks(kind, rng, B, H, Lq, Lk, dtype):
    if kind == "none":
        return {}
    if kind == "key_mask":
        km = np.ones((B, Lk), bool)
        km[0, 3:] = False
        km[-1, 0] = False
        return {"key_mask": km}
    if kind == "key_mask_strided":  # last axis not contiguous: the kernel gets a copy
        km = np.ones((B, 2 * Lk), bool)
        km[0, 6:] = False
        return {"key_mask": km[:, ::2]}
    if kind == "bool":
        am = rng.random((H, Lq, Lk)) > 0.3
        am[0, 1] = False  # a fully masked row
        return {"attn_mask": am}
    if kind == "float_keys_broadcast":  # one additive value for every key (Lk dim 1)
        return {"attn_mask": randn(rng, (B, 1, Lq, 1), np.float64)}
    if kind == "float_and_key_mask":
        km = np.ones((B, Lk), bool)
        km[-1, :2] = False
        return {"attn_mask": randn(rng, (Lq, Lk), dtype), "key_mask": km}
    if kind == "causal":
        return {"is_causal": True}
    if kind == "causal_br":
        return {"is_causal": True, "causal_alignment": "bottom_right"}
    raise ValueError(kind)


MASKS = ["none", "key_mask", "key_mask_strided", "bool", "float_keys_broadcast",
         "float_and_key_mask", "causal", "causal_br"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("form", ["self", "cross"])
def test_prepared_path_matches_oracle(dtype, layout, mask, form, rng, no_general_path):
    m = randomise(MultiHeadAttention(16, 4, dtype=dtype, seed=0, **LAYOUTS[layout]), rng)
    B, Lq = 2, 5
    Lk = Lq if form == "self" or m.kdim != 16 and form == "self" else 7
    x = randn(rng, (B, Lq, 16), dtype)
    if form == "self" and m.packed:
        args = (x,)
        q = k = v = x
    else:
        if form == "self":  # separate weights: query, key, value of their own sizes
            Lk = Lq
        k = randn(rng, (B, Lk, m.kdim), dtype)
        v = randn(rng, (B, Lk, m.vdim), dtype)
        args, q = (x, k, v), x
    kw = _masks(mask, rng, B, m.num_heads, Lq, Lk, dtype)
    out, w = m(*args, return_weights=True, average_weights=False, **kw)
    r_out, r_w = oracle_of(m, q, k, v, return_weights=True, average_weights=False, **kw)
    assert out.dtype == dtype and w.shape == (B, m.num_heads, Lq, Lk)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    out2 = m(*args, **kw)  # without weights: the kernel's other plan
    assert_close(out2, r_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
def test_prepared_unbatched_and_averaged(dtype, rng, no_general_path):
    m = randomise(MultiHeadAttention(16, 4, dtype=dtype, seed=0, num_kv_heads=1), rng)
    x = randn(rng, (6, 16), dtype)
    out, w = m(x, key_mask=np.arange(6) < 4, return_weights=True)
    r_out, r_w = oracle_of(m, x, x, x, key_mask=np.arange(6) < 4, return_weights=True)
    assert out.shape == (6, 16) and w.shape == (6, 6)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)


def test_prepared_equals_general_path(rng):
    """Bit for bit: the two entries run the same kernels on the same buffers."""
    m = randomise(MultiHeadAttention(32, 4, seed=0), rng)
    m.auto_pack = False   # the packed weights' rounding differs (test_mha_frozen, test_mha_autopack)
    x = randn(rng, (3, 9, 32), np.float32)
    km = np.ones((3, 9), bool)
    km[1, 5:] = False
    p = m.params
    got = m(x, key_mask=km, is_causal=True, return_weights=True)
    ref = fastattn.multi_head_attention(
        x, x, x, num_heads=4, w_qkv=p["in_proj_weight"], b_qkv=p["in_proj_bias"],
        w_out=p["out_proj.weight"], b_out=p["out_proj.bias"], key_mask=km, is_causal=True,
        return_weights=True)
    np.testing.assert_array_equal(got[0], ref[0])
    np.testing.assert_array_equal(got[1], ref[1])


def test_weights_are_prepared_once_and_follow_params(rng, monkeypatch):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    calls = []
    real = F._prepare_mha_weights

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(F, "_prepare_mha_weights", counting)
    m(x)
    m(x)
    assert len(calls) == 1
    # values changed in place: seen without re-preparing (the same arrays)
    m.params["out_proj.bias"][:] += 1.0
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    assert len(calls) == 1
    # an entry replaced, the dict replaced, load_state_dict: prepared again
    m.params["in_proj_weight"] = randn(rng, (48, 16), np.float32)
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    m.params = {k: a.copy() * 0.5 for k, a in m.params.items()}
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    m.load_state_dict({k: a * 2 for k, a in m.state_dict().items()})
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    assert len(calls) == 4


def test_params_needing_a_copy_take_the_general_path(rng):
    """A parameter that is not canonical (here Fortran-ordered) is converted on every
    call, so in-place changes to it are still seen."""
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    w = np.asfortranarray(m.params["in_proj_weight"])
    m.params["in_proj_weight"] = w
    assert m._prepared_weights() is None
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    w[:] *= -1.0
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)


def test_invalid_params_are_reported_by_the_general_path(rng):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    m(x)
    m.params["in_proj_weight"] = np.zeros((40, 16), np.float32)
    with pytest.raises(ValueError, match=r"^w_qkv: expected shape \(48, 16\)"):
        m(x)
    m.params["in_proj_weight"] = np.zeros((48, 16), np.complex64)
    with pytest.raises(TypeError, match=r"^w_qkv: complex dtypes are not supported"):
        m(x)
    del m.params["out_proj.weight"]
    with pytest.raises(KeyError):
        m(x)


@pytest.mark.parametrize("case", ["f64_input", "list_input", "np_bool_flags", "f16_input",
                                  "readonly_strided"])
def test_inputs_outside_the_fast_path(case, rng):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float64)
    kw, want = {}, np.float32
    if case == "f64_input":
        arg, want = x, np.float64
    elif case == "list_input":
        arg, want = x.tolist(), np.float64
    elif case == "np_bool_flags":
        arg, kw = x.astype(np.float32), {"is_causal": np.bool_(True)}
    elif case == "f16_input":
        arg, want = x.astype(np.float16), np.float32
    else:
        big = np.repeat(x.astype(np.float32), 2, axis=2)[:, ::-1, ::2]
        big.flags.writeable = False
        arg = big
    out = m(arg, **kw)
    xa = np.asarray(arg, dtype=np.float64)
    assert out.dtype == want
    assert_close(out, oracle_of(m, xa, xa, xa, **kw), np.float32)


def test_prepared_path_errors(rng):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    with pytest.raises(TypeError, match=r"^is_causal: expected a bool, got int 1"):
        m(x, is_causal=1)
    with pytest.raises(TypeError, match=r"^return_weights: expected a bool"):
        m(x, return_weights="yes")
    with pytest.raises(ValueError, match=r"^causal_alignment: expected 'top_left' or 'bottom_right'"):
        m(x, is_causal=True, causal_alignment="bottom")
    with pytest.raises(ValueError, match=r"^n_threads: expected a positive integer"):
        m(x, n_threads=0)
    with pytest.raises(TypeError, match=r"^attn_mask: expected a bool mask"):
        m(x, attn_mask=np.zeros((5, 5), np.int64))
    with pytest.raises(ValueError, match=r"^key_mask: expected shape \(2, 5\)"):
        m(x, key_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"^attn_mask: expected a shape broadcastable to"):
        m(x, attn_mask=np.ones((3, 5, 5), bool))
    with pytest.raises(ValueError, match=r"^key/value: expected batch size 2"):
        m(x, randn(rng, (3, 5, 16), np.float32))


def test_prepared_path_does_not_modify_inputs(rng, no_general_path):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    am = randn(rng, (5, 5), np.float32)
    km = np.ones((2, 5), bool)
    km[0, 0] = False
    copies = [a.copy() for a in (x, am, km)]
    sd = m.state_dict()
    m(x, attn_mask=am, key_mask=km, return_weights=True)
    for a, c in zip((x, am, km), copies):
        np.testing.assert_array_equal(a, c)
    for k, v in m.params.items():
        np.testing.assert_array_equal(v, sd[k])


def test_prepare_weights_errors_are_the_functional_ones(rng):
    with pytest.raises(ValueError, match=r"^w_out: expected shape \(E_out, E=16\)"):
        _multihead.prepare_weights(16, 16, 16, np.float32, num_heads=4,
                                   w_qkv=np.zeros((48, 16)), w_out=np.zeros((16, 8)))
    with pytest.raises(TypeError, match=r"prepare_weights: unknown weight names \['w_q'\]"):
        _multihead.prepare_weights(16, 16, 16, np.float32, num_heads=4, w_q=np.zeros((16, 16)),
                                   w_out=np.zeros((16, 16)))


# ------------------------------------------------------ the trusted SDPA call

@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f64"])
@pytest.mark.parametrize("mask", ["none", "bool", "float", "keys"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("Lq", [1, 6, 40])
def test_sdpa_canonical_on_head_views(dtype, mask, causal, Lq, rng):
    B, H, Lk, dh = 2, 3, 37, 8
    buf = randn(rng, (B, max(Lq, Lk), 3 * H * dh), dtype)

    def heads(part, L):
        return buf[:, :L, part * H * dh:(part + 1) * H * dh].reshape(B, L, H, dh).transpose(0, 2, 1, 3)

    q, k, v = heads(0, Lq), heads(1, Lk), heads(2, Lk)
    m = None
    if mask == "bool":
        m = rng.random((1, H, Lq, Lk)) > 0.4
        m[0, 0, 0] = False
    elif mask == "float":
        m = randn(rng, (B, 1, Lq, Lk), dtype)
    elif mask == "keys":
        m = (rng.random((B, 1, 1, Lk)) > 0.3)
    attn = np.full((B, Lq, H * dh), np.nan, dtype)
    out = attn.reshape(B, Lq, H, dh).transpose(0, 2, 1, 3)
    off = Lk - Lq if causal else 0
    w = _sdpa._sdpa_canonical(q, k, v, m, (B, H), causal, off, 0.3, out, True, 2)
    r_out, r_w = oracle(q, k, v, m, causal, 0.3, causal_alignment="bottom_right",
                        return_weights=True)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    out2 = np.empty_like(out)
    assert _sdpa._sdpa_canonical(q, k, v, m, (B, H), causal, off, 0.3, out2, False, 2) is None
    assert_close(out2, r_out, dtype)


def test_pickle_and_copies_of_a_called_layer(rng):
    m = randomise(MultiHeadAttention(16, 4, seed=0), rng)
    x = randn(rng, (2, 5, 16), np.float32)
    ref = m(x)
    m2 = pickle.loads(pickle.dumps(m))
    assert m2._prepared is None
    np.testing.assert_array_equal(m2(x), ref)
    m3 = copy.deepcopy(m)
    m3.params["out_proj.bias"][:] += 1.0  # its own arrays: m is unchanged
    np.testing.assert_array_equal(m(x), ref)
    assert_close(m3(x), oracle_of(m3, x, x, x), np.float32)
