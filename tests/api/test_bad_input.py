"""The bad-input table (docs/bad_input.md), one test per row.

Every public entry point is described once in ``EPS`` (how to build valid
inputs of given sizes, how to call it, the shape of its result); each row of
the table is one test below, parametrized over the entry points it applies
to.  The test names carry the row number: ``test_row03_...`` is row 3 of the
table.  Rows whose cases live elsewhere too name those files in the docs.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import functional as F
from fastattn import layers as L
from fastattn._attention import SimilarityError

RNG = np.random.default_rng(1234)
DIMS = dict(B=2, Lq=3, Lk=5, d=4, dv=6)


def _r(*shape):
    return RNG.standard_normal(shape)


class _NumpyDot(fastattn.Similarity):
    """A NumPy plugin (the tiled path)."""

    name = "bad_input_numpy_dot"

    def score(self, query, key, params):
        return query @ np.swapaxes(key, -1, -2)


SIMS = {
    "dot": "dot",
    "general": "general",
    "additive": "additive",
    "cosine": "cosine",
    "numpy": _NumpyDot(),
    "compiled": fastattn.testing.selftest_similarity(),
}


def _d(query):
    """The feature size the parameters are made for (4 when query has no last axis)."""
    return np.shape(query)[-1] if np.ndim(query) else 4


def _params(sim, d):
    s = fastattn.get_similarity(sim)
    return s.init_params(d, d, rng=0, d_a=3)


class EP:
    """An entry point: ``make(dims) -> {param: array}``, ``call(**inputs)``,
    ``out_shape(dims)``; which dims may be 0; per-param rank rules."""

    def __init__(self, name, make, call, out_shape, zero=(), bad_ndims=None, f16=np.float16,
                 first=None):
        self.name, self.make, self.call, self.out_shape = name, make, call, out_shape
        self.zero, self.bad_ndims, self.f16 = zero, bad_ndims or {}, f16
        self.first = first  # the result's array (index into a tuple result)

    def result(self, inputs):
        r = self.call(**inputs)
        if self.first is not None:
            r = self.first(r)
        return r


def _qkv(D):
    return dict(query=_r(D["B"], D["Lq"], D["d"]), key=_r(D["B"], D["Lk"], D["d"]),
                value=_r(D["B"], D["Lk"], D["dv"]))


def _mha_qkv(D):
    return dict(query=_r(D["B"], D["Lq"], 4), key=_r(D["B"], D["Lk"], 4), value=_r(D["B"], D["Lk"], 4))


_MHA_W = dict(num_heads=2, w_qkv=_r(12, 4), b_qkv=_r(12), w_out=_r(4, 4), b_out=_r(4))
_QKV_RANKS = {"query": (0, 1), "key": (0, 1), "value": (0, 1)}
_LAYERS = {  # float64 layers, built once
    "Linear": L.Linear(4, 6, seed=0, dtype=np.float64),
    "SimpleRNN": L.SimpleRNN(4, 6, seed=0, dtype=np.float64),
    "GRU": L.GRU(4, 6, num_layers=2, bidirectional=True, seed=0, dtype=np.float64),
    "LSTM": L.LSTM(4, 6, seed=0, dtype=np.float64),
    "Attention": L.Attention(4, 4, 6, similarity="additive", seed=0, dtype=np.float64),
    "SelfAttention": L.SelfAttention(4, similarity="general", causal=True, seed=0, dtype=np.float64),
    "MultiHeadAttention": L.MultiHeadAttention(4, 2, seed=0, dtype=np.float64),
}


def _eps():
    eps = [
        EP("sdpa", _qkv, fastattn.scaled_dot_product_attention,
           lambda D: (D["B"], D["Lq"], D["dv"]), zero="B Lq Lk d dv", bad_ndims=_QKV_RANKS),
        EP("explain", _qkv, fastattn.explain, None, bad_ndims=_QKV_RANKS),
    ]
    for n, s in SIMS.items():
        eps.append(EP(f"attention[{n}]", _qkv,
                      lambda query, key, value, s=s: fastattn.attention(
                          query, key, value, s, params=_params(s, _d(query))),
                      lambda D: (D["B"], D["Lq"], D["dv"]), zero="B Lq Lk d dv", bad_ndims=_QKV_RANKS))
    for n in ("dot", "additive", "compiled"):
        s = SIMS[n]
        eps.append(EP(f"PreparedAttention[{n}]", _qkv,
                      lambda query, key, value, s=s: F.PreparedAttention(
                          key, value, s, params=_params(s, _d(query)))(query),
                      lambda D: (D["B"], D["Lq"], D["dv"]), zero="B Lq Lk d dv", bad_ndims=_QKV_RANKS))
    eps += [
        EP("multi_head_attention", _mha_qkv,
           lambda query, key, value: fastattn.multi_head_attention(query, key, value, **_MHA_W),
           lambda D: (D["B"], D["Lq"], 4), zero="B Lq Lk", f16=np.float64,  # float64 weights
           bad_ndims={"query": (1, 4), "key": (2,), "value": (2,)}),
        EP("linear", lambda D: dict(x=_r(D["B"], D["Lq"], D["d"]), weight=_r(D["dv"], D["d"]),
                                    bias=_r(D["dv"])),
           F.linear, lambda D: (D["B"], D["Lq"], D["dv"]), zero="B Lq d dv", f16=np.float16,
           bad_ndims={"x": (0,), "weight": (1, 3), "bias": (0, 2)}),
        EP("rnn_scan", lambda D: dict(xw=_r(D["B"], D["Lq"], 3 * D["d"]), w_hh=_r(3 * D["d"], D["d"]),
                                      b_hh=_r(3 * D["d"]), h0=_r(D["B"], D["d"])),
           F.rnn_scan, lambda D: (D["B"], D["Lq"], D["d"]), zero="B Lq d", f16=np.float16,
           bad_ndims={"xw": (2, 4), "w_hh": (1, 3), "h0": (1, 3)}, first=lambda r: r[0]),
        EP("rnn_cell", lambda D: dict(x=_r(D["B"], D["dv"]), h=_r(D["B"], D["d"]),
                                      w_ih=_r(3 * D["d"], D["dv"]), b_ih=_r(3 * D["d"]),
                                      w_hh=_r(3 * D["d"], D["d"]), b_hh=_r(3 * D["d"])),
           F.rnn_cell, lambda D: (D["B"], D["d"]), zero="B d dv", f16=np.float16,
           bad_ndims={"x": (1, 3), "h": (1, 3), "w_ih": (1, 3), "w_hh": (1, 3)}, first=lambda r: r[0]),
        # layers (float64 parameters: float16 inputs are computed in float32, then promoted)
        EP("Linear", lambda D: dict(x=_r(D["B"], D["Lq"], 4)), _LAYERS["Linear"],
           lambda D: (D["B"], D["Lq"], 6), zero="B Lq", f16=np.float64, bad_ndims={"x": (0,)}),
    ]
    for n in ("SimpleRNN", "GRU", "LSTM"):
        layer = _LAYERS[n]
        D_out = 12 if n == "GRU" else 6
        eps.append(EP(f"{n}.forward", lambda D: dict(x=_r(D["B"], D["Lq"], 4)), layer.forward,
                      lambda D, o=D_out: (D["B"], D["Lq"], o), zero="B Lq", f16=np.float64,
                      bad_ndims={"x": (1, 4)}, first=lambda r: r[0]))
    eps += [
        EP("LSTM.step", lambda D: dict(x=_r(D["B"], 4)), _LAYERS["LSTM"].step,
           lambda D: (D["B"], 6), zero="B", f16=np.float64, bad_ndims={"x": (1, 3)},
           first=lambda r: r[0]),
        EP("Attention", _qkv_layer, _LAYERS["Attention"], lambda D: (D["B"], D["Lq"], 6),
           zero="B Lq Lk", f16=np.float64, bad_ndims={"query": (1, 4), "key": (2,), "value": (2,)}),
        EP("SelfAttention", lambda D: dict(x=_r(D["B"], D["Lq"], 4)), _LAYERS["SelfAttention"],
           lambda D: (D["B"], D["Lq"], 4), zero="B Lq", f16=np.float64, bad_ndims={"x": (1, 4)}),
        EP("MultiHeadAttention", _mha_qkv, _LAYERS["MultiHeadAttention"],
           lambda D: (D["B"], D["Lq"], 4), zero="B Lq Lk", f16=np.float64,
           bad_ndims={"query": (1, 4), "key": (2,), "value": (2,)}),
        EP("AttentionDecoder.precompute+step", lambda D: dict(memory=_r(D["B"], D["Lk"], 6)),
           _decoder_step, lambda D: (D["B"], 10), zero="B Lk", f16=np.float64,
           bad_ndims={"memory": (2, 4)}),
    ]
    return {e.name: e for e in eps}


def _qkv_layer(D):
    return dict(query=_r(D["B"], D["Lq"], 4), key=_r(D["B"], D["Lk"], 4), value=_r(D["B"], D["Lk"], 6))


_DECODER = L.AttentionDecoder(10, 3, 5, 6, seed=0, dtype=np.float64)


def _decoder_step(memory):
    mem = _DECODER.precompute(memory)
    B = mem.values.shape[0]
    logits, _, _ = _DECODER.step(np.ones(B, np.int64), _DECODER.initial_state(B), mem)
    return logits


EPS = _eps()
ARRAY_EPS = [n for n in EPS if n != "explain"]
OUT_EPS = ["sdpa"] + [f"attention[{n}]" for n in SIMS]


def _params_of(names):
    return [(n, p) for n in names for p in EPS[n].make(DIMS)]


def _snapshot(inputs):
    return {k: np.array(v, copy=True) for k, v in inputs.items()}


def _assert_unchanged(inputs, saved):
    for k, v in saved.items():
        np.testing.assert_array_equal(inputs[k], v, err_msg=f"{k} was modified")


# ======================================================================
# Row 1: wrong rank

RANK_CASES = [(n, p, nd) for n in EPS for p, nds in EPS[n].bad_ndims.items() for nd in nds]


@pytest.mark.parametrize("ep,param,ndim", RANK_CASES, ids=[f"{a}-{b}-{c}d" for a, b, c in RANK_CASES])
def test_row01_wrong_rank(ep, param, ndim):
    e = EPS[ep]
    inputs = e.make(DIMS)
    last = inputs[param].shape[-1]
    inputs[param] = np.float64(1.0) if ndim == 0 else np.ones((2,) * (ndim - 1) + (last,))
    with pytest.raises(ValueError, match=rf"^(\w+, )?{param}(, \w+)?: expected"):
        e.call(**inputs)


# ======================================================================
# Row 2: mismatched sizes

MISMATCH = [
    # (entry point, param, new shape, message regex)
    ("sdpa", "key", (2, 5, 3), r"^key: expected last dim 4"),
    ("sdpa", "value", (2, 4, 6), r"^value: expected 5 rows"),
    ("sdpa", "key", (3, 5, 4), r"^leading \(batch\) dimensions do not broadcast: query \(2,\), key \(3,\)"),
    ("explain", "value", (2, 4, 6), r"^value: expected 5 rows"),
    ("attention[dot]", "key", (2, 5, 3), r"^key: expected last dim 4"),
    ("attention[numpy]", "value", (2, 4, 6), r"^value: expected 5 rows"),
    ("attention[compiled]", "key", (2, 5, 3), r"^key: expected last dim 4"),
    ("attention[additive]", "value", (3, 5, 6), r"^leading \(batch\) dimensions do not broadcast"),
    ("PreparedAttention[additive]", "value", (2, 4, 6), r"^value: expected 5 rows"),
    ("PreparedAttention[dot]", "key", (2, 5, 3), r"^key: expected last dim 4"),
    ("multi_head_attention", "query", (2, 3, 6), r"^query: expected embedding size E=4"),
    ("multi_head_attention", "key", (3, 5, 4), r"^key/value: expected batch size 2"),
    ("multi_head_attention", "value", (2, 4, 4), r"^value: expected 5 rows"),
    ("linear", "weight", (6, 3), r"^x: expected last dim 3 \(weight's in_features\)"),
    ("linear", "bias", (5,), r"^bias: expected shape \(6,\)"),
    ("rnn_scan", "xw", (2, 3, 11), r"^xw: expected last dim 12"),
    ("rnn_scan", "w_hh", (12, 3), r"^w_hh: expected shape \(3 \* H, H\)"),
    ("rnn_scan", "h0", (3, 4), r"^h0: expected shape \(2, 4\)"),
    ("rnn_scan", "b_hh", (11,), r"^b_hh: expected shape \(12,\)"),
    ("rnn_cell", "x", (3, 6), r"^x: expected shape \(2, I\)"),
    ("rnn_cell", "w_ih", (12, 5), r"^w_ih: expected shape \(12, 6\)"),
    ("rnn_cell", "w_hh", (12, 3), r"^w_hh: expected shape \(12, 4\)"),
    ("rnn_cell", "b_hh", (11,), r"^b_hh: expected shape \(12,\)"),
    ("Linear", "x", (2, 3, 5), r"^x: expected last dim 4"),
    ("GRU.forward", "x", (2, 3, 5), r"^x: expected last dim 4"),
    ("LSTM.step", "x", (2, 5), r"^x: expected last dim 4"),
    ("Attention", "key", (2, 5, 3), r"^key: expected last dim 4"),
    ("Attention", "key", (3, 5, 4), r"^value: expected leading shape \(3, 5\)"),
    ("Attention", "value", (2, 4, 6), r"^value: expected leading shape \(2, 5\)"),
    ("SelfAttention", "x", (2, 3, 5), r"^x: expected last dim 4"),
    ("MultiHeadAttention", "key", (2, 5, 3), r"^key: expected last dim kdim=4"),
    ("MultiHeadAttention", "value", (2, 4, 4), r"^value: expected 5 rows"),
    ("AttentionDecoder.precompute+step", "memory", (2, 5, 7), r"^memory: expected last dim 6"),
]


@pytest.mark.parametrize("ep,param,shape,match", MISMATCH,
                         ids=[f"{a}-{b}-{i}" for i, (a, b, _, _) in enumerate(MISMATCH)])
def test_row02_mismatched_sizes(ep, param, shape, match):
    e = EPS[ep]
    inputs = e.make(DIMS)
    inputs[param] = _r(*shape)
    saved = _snapshot(inputs)
    with pytest.raises(ValueError, match=match):
        e.call(**inputs)
    _assert_unchanged(inputs, saved)


def test_row02_mismatched_sizes_state_and_lengths():
    x = _r(2, 3, 4)
    with pytest.raises(ValueError, match=r"^h0: expected shape \(4, 2, 6\)"):
        _LAYERS["GRU"](x, _r(4, 3, 6))
    with pytest.raises(TypeError, match=r"^state: expected a tuple \(h0, c0\) for LSTM"):
        _LAYERS["LSTM"](x, _r(1, 2, 6))
    for fn in (lambda n: _LAYERS["GRU"](x, lengths=n), lambda n: F.rnn_scan(_r(2, 3, 12), _r(12, 4), None, _r(2, 4), lengths=n)):
        with pytest.raises(ValueError, match=r"^lengths: expected (lengths|values) in \[0, 3\]"):
            fn([1, 4])
        with pytest.raises(ValueError, match=r"^lengths: expected shape \(2,\)"):
            fn([1, 2, 3])
        with pytest.raises(TypeError, match=r"^lengths: expected integers, got dtype float64"):
            fn([1.0, 2.0])
    with pytest.raises(ValueError, match=r"^num_heads: expected a divisor of embed_dim=4, got 3"):
        L.MultiHeadAttention(4, 3)
    with pytest.raises(ValueError, match=r"^query: expected an embedding size E divisible by num_heads=3"):
        fastattn.multi_head_attention(*_mha_qkv(DIMS).values(), **{**_MHA_W, "num_heads": 3})


# ======================================================================
# Row 3: masks that do not broadcast / have a wrong dtype

MASK_EPS = {
    "sdpa": lambda m, kw: fastattn.scaled_dot_product_attention(**_qkv(DIMS), **{kw: m}),
    "explain": lambda m, kw: fastattn.explain(**_qkv(DIMS), **{kw: m}),
    **{f"attention[{n}]": (lambda m, kw, s=s: fastattn.attention(**_qkv(DIMS), similarity=s,
                                                                  params=_params(s, 4), **{kw: m}))
       for n, s in SIMS.items()},
    "PreparedAttention": lambda m, kw: F.PreparedAttention(_r(2, 5, 4), _r(2, 5, 6), **{kw: m})(_r(2, 3, 4)),
    "multi_head_attention": lambda m, kw: fastattn.multi_head_attention(**_mha_qkv(DIMS), **_MHA_W, **{kw: m}),
    "Attention": lambda m, kw: _LAYERS["Attention"](**_qkv_layer(DIMS), **{kw: m}),
    "MultiHeadAttention": lambda m, kw: _LAYERS["MultiHeadAttention"](**_mha_qkv(DIMS), **{kw: m}),
}
KEY_MASK_EPS = ["multi_head_attention", "Attention", "MultiHeadAttention"]


@pytest.mark.parametrize("shape", [(4, 5), (3, 6), (7,), (3, 3, 5), (2, 4, 3, 5)])
@pytest.mark.parametrize("ep", list(MASK_EPS))
def test_row03_attn_mask_not_broadcastable(ep, shape):
    with pytest.raises(ValueError, match=r"^(attn_mask: expected|leading \(batch\) dimensions do not broadcast.*attn_mask)"):
        MASK_EPS[ep](np.ones(shape, bool), "attn_mask")


@pytest.mark.parametrize("dtype", [np.int64, np.uint8, np.complex128, object, np.longdouble])
@pytest.mark.parametrize("ep", list(MASK_EPS))
def test_row03_attn_mask_dtype(ep, dtype):
    with pytest.raises(TypeError, match=r"^attn_mask: expected a bool mask \(True = may attend\) or a float mask"):
        MASK_EPS[ep](np.ones((3, 5), dtype), "attn_mask")


@pytest.mark.parametrize("ep", KEY_MASK_EPS)
def test_row03_key_mask(ep):
    with pytest.raises(ValueError, match=r"^key_mask: expected shape \(2, 5\)"):
        MASK_EPS[ep](np.ones((2, 4), bool), "key_mask")
    with pytest.raises(TypeError, match=r"^key_mask: expected a bool(ean)? array"):
        MASK_EPS[ep](np.ones((2, 5), np.int64), "key_mask")


def test_row03_padding_masks_of_the_seq2seq_layers():
    with pytest.raises(ValueError, match=r"^memory_mask: expected shape \(2, 5\)"):
        _DECODER.precompute(_r(2, 5, 6), np.ones((2, 4), bool))
    with pytest.raises(TypeError, match=r"^memory_mask: expected a boolean array"):
        _DECODER.precompute(_r(2, 5, 6), np.ones((2, 5), np.int64))
    enc = L.RNNEncoder(10, 3, 4, seed=0)
    with pytest.raises(ValueError, match=r"^src_mask: expected shape \(B, 3\)"):
        enc(np.ones((2, 3), np.int64), src_mask=np.ones((2, 4), bool))
    with pytest.raises(ValueError, match=r"^src_mask: padding must come after the real tokens"):
        enc(np.ones((2, 3), np.int64), src_mask=np.array([[0, 1, 1], [1, 1, 1]], bool))


# ======================================================================
# Rows 4-6: dtypes

def _cast(a, dtype):
    if np.dtype(dtype) == np.bool_:
        return a > 0
    if np.dtype(dtype).kind in "iu":
        return np.round(np.abs(a) * 2).astype(dtype)
    return a.astype(dtype)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int64, np.uint16])
@pytest.mark.parametrize("ep", ARRAY_EPS)
def test_row04_bool_and_integer_inputs_computed_in_float64(ep, dtype):
    e = EPS[ep]
    inputs = {k: _cast(v, dtype) for k, v in e.make(DIMS).items()}
    saved = _snapshot(inputs)
    got = e.result(inputs)
    assert got.dtype == np.float64
    want = e.result({k: v.astype(np.float64) for k, v in inputs.items()})
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    _assert_unchanged(inputs, saved)


def test_row04_mha_layer_follows_numpy_promotion():
    """MultiHeadAttention (float32 parameters) promotes by NumPy's rule: bool or
    int8 inputs give float32, int32/int64 inputs float64."""
    m = L.MultiHeadAttention(4, 2, seed=0)
    x = _r(2, 3, 4)
    assert m(x > 0).dtype == np.float32
    assert m(_cast(x, np.int8)).dtype == np.float32
    assert m(_cast(x, np.int64)).dtype == np.float64


@pytest.mark.parametrize("ep", ARRAY_EPS)
def test_row05_float16(ep):
    e = EPS[ep]
    inputs = {k: v.astype(np.float16) for k, v in e.make(DIMS).items()}
    got = e.result(inputs)
    assert got.dtype == e.f16
    want = e.result({k: v.astype(np.float32) for k, v in inputs.items()})
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=3e-3, atol=3e-3)
    if ep in ("sdpa",):
        assert fastattn.explain(**inputs).dtype == "float32"


def test_row05_float16_everywhere_in_multi_head_attention():
    """float16 inputs *and* weights: float16 result (computed in float32)."""
    x = _r(2, 3, 4).astype(np.float16)
    w16 = {k: (v.astype(np.float16) if isinstance(v, np.ndarray) else v) for k, v in _MHA_W.items()}
    got = fastattn.multi_head_attention(x, x, x, **w16)
    assert got.dtype == np.float16
    w32 = {k: (v.astype(np.float32) if isinstance(v, np.ndarray) else v) for k, v in w16.items()}
    want = fastattn.multi_head_attention(*(x.astype(np.float32),) * 3, **w32)
    np.testing.assert_allclose(got.astype(np.float64), want, rtol=3e-3, atol=3e-3)


BAD_DTYPES = [np.complex64, np.complex128, object, "U2", "datetime64[s]", np.longdouble]


@pytest.mark.parametrize("dtype", BAD_DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("ep,param", _params_of(EPS), ids=lambda x: str(x))
def test_row06_complex_object_string_longdouble_raise(ep, param, dtype):
    e = EPS[ep]
    inputs = e.make(DIMS)
    inputs[param] = np.zeros(inputs[param].shape, dtype)
    with pytest.raises(TypeError, match=rf"^{param}: (complex dtypes are not supported|expected a real|"
                                        r"expected real numbers|float128 is not supported)"):
        e.call(**inputs)


def test_row06_token_ids_must_be_integers():
    enc = L.RNNEncoder(10, 3, 4, seed=0)
    s2s = L.Seq2Seq(enc, L.AttentionDecoder(10, 3, 4, 4, seed=0), bos_id=1, eos_id=2)
    for bad in (np.ones((2, 3)), np.ones((2, 3), bool), np.ones((2, 3), complex)):
        with pytest.raises(TypeError, match=r"^ids: expected an integer array of token ids"):
            L.Embedding(10, 3)(bad)
        with pytest.raises(TypeError, match=r"^src: expected an integer array of token ids"):
            enc(bad)
        with pytest.raises(TypeError, match=r"^src: expected an integer array of token ids"):
            s2s.greedy_decode(bad, max_len=2)
        with pytest.raises(TypeError, match=r"^tgt_in: expected an integer array of token ids"):
            s2s(np.ones((2, 3), np.int64), bad)
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, 10\), got values in \[-1, 10\]"):
        L.Embedding(10, 3)(np.array([-1, 10]))


# ======================================================================
# Row 7: zero-size dimensions

ZERO_CASES = [(n, dim) for n in ARRAY_EPS for dim in EPS[n].zero.split()]


@pytest.mark.parametrize("ep,dim", ZERO_CASES, ids=[f"{a}-{b}0" for a, b in ZERO_CASES])
def test_row07_zero_size_gives_the_defined_result(ep, dim):
    e = EPS[ep]
    D = dict(DIMS, **{dim: 0})
    inputs = e.make(D)
    got = e.result(inputs)
    assert got.shape == e.out_shape(D)
    assert np.isfinite(got).all()
    if dim == "Lk" and ep.startswith(("sdpa", "attention", "PreparedAttention")):
        np.testing.assert_array_equal(got, 0)  # no key to attend to: zeros


def test_row07_zero_size_explain_and_weights():
    q, k, v = _r(2, 0, 4), _r(2, 5, 4), _r(2, 5, 6)
    assert fastattn.explain(q, k, v).path == "empty"
    for sim in SIMS.values():
        o, w = fastattn.attention(_r(2, 3, 4), _r(2, 0, 4), _r(2, 0, 6), sim, params=_params(sim, 4),
                                  return_weights=True)
        assert o.shape == (2, 3, 6) and w.shape == (2, 3, 0)
        o, w = fastattn.attention(_r(2, 3, 0), _r(2, 5, 0), _r(2, 5, 6), sim, params=_params(sim, 0),
                                  return_weights=True)
        np.testing.assert_allclose(w, np.full((2, 3, 5), 0.2))  # all scores equal: uniform


def test_row07_zero_size_documented_values():
    x = _r(2, 3, 4)
    o = fastattn.multi_head_attention(x, _r(2, 0, 4), _r(2, 0, 4), **_MHA_W)
    np.testing.assert_allclose(o, np.broadcast_to(_MHA_W["b_out"], (2, 3, 4)))  # no key: the bias
    with pytest.raises(ValueError, match=r"^query: expected an embedding size E >= 1, got E=0"):
        fastattn.multi_head_attention(_r(2, 3, 0), _r(2, 3, 0), _r(2, 3, 0), num_heads=1,
                                      w_qkv=np.zeros((0, 0)), w_out=np.zeros((1, 0)))
    b = _r(6)
    np.testing.assert_allclose(F.linear(_r(5, 0), _r(6, 0), b), np.broadcast_to(b, (5, 6)))
    h0 = _r(2, 4)
    out, h, _ = F.rnn_scan(_r(2, 0, 12), _r(12, 4), None, h0)
    assert out.shape == (2, 0, 4)
    np.testing.assert_array_equal(h, h0)
    enc = L.RNNEncoder(10, 3, 4, seed=0)
    s2s = L.Seq2Seq(enc, L.AttentionDecoder(10, 3, 4, 4, seed=0), bos_id=1, eos_id=2)
    tokens, lengths, scores, align = s2s.greedy_decode(np.ones((2, 3), np.int64), lengths=[0, 3], max_len=4)
    assert tokens.shape == (2, 4) and np.isfinite(scores).all()
    np.testing.assert_array_equal(align[0], 0)  # an all-padding source: no attention at all


# ======================================================================
# Rows 8-9: memory layouts (non-contiguous last axis, negative strides,
# zero strides, read-only): the result of a C-contiguous copy, input untouched

def _layout(a, kind):
    if kind == "fortran":
        return np.asfortranarray(a)
    if kind == "last_axis_stride2":
        return np.repeat(a, 2, axis=-1)[..., ::2]
    if kind == "negative_last_axis":
        return np.ascontiguousarray(a[..., ::-1])[..., ::-1]
    if kind == "negative_rows":
        return np.ascontiguousarray(a[..., ::-1, :])[..., ::-1, :] if a.ndim >= 2 else a[::-1][::-1]
    if kind == "negative_batch":
        return np.ascontiguousarray(a[::-1])[::-1]
    if kind == "zero_stride_batch":
        return np.broadcast_to(a[:1], a.shape)
    if kind == "unaligned":
        from support import make_layout
        return make_layout(a, "unaligned")
    if kind == "read_only":
        b = a.copy()
        b.flags.writeable = False
        return b
    raise ValueError(kind)


LAYOUTS = ["fortran", "last_axis_stride2", "negative_last_axis", "negative_rows", "negative_batch",
           "zero_stride_batch", "read_only", "unaligned"]


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("ep", ARRAY_EPS)
def test_row08_09_layouts(ep, kind):
    e = EPS[ep]
    base = e.make(DIMS)
    # one odd layout per call, every parameter in turn (a few calls per test)
    for param in base:
        inputs = dict(base)
        inputs[param] = _layout(base[param], kind)
        saved = _snapshot(inputs)
        got = e.result(inputs)
        want = e.result({k: np.array(v, order="C") for k, v in inputs.items()})
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{param} {kind}")
        _assert_unchanged(inputs, saved)


# ======================================================================
# Rows 10-11: out= that overlaps itself, or aliases an input

def _out_call(ep, q, k, v, **kw):
    if ep == "sdpa":
        return fastattn.scaled_dot_product_attention(q, k, v, **kw)
    s = SIMS[ep[len("attention["):-1]]
    return fastattn.attention(q, k, v, s, params=_params(s, q.shape[-1]), **kw)


@pytest.mark.parametrize("ep", OUT_EPS)
def test_row10_out_overlapping_itself(ep):
    q, k, v = _r(2, 3, 4), _r(2, 5, 4), _r(2, 5, 6)
    buf = np.zeros(2 * 3 * 6)
    overlapping = np.lib.stride_tricks.as_strided(buf, (2, 3, 6), (8 * 6, 8, 8))  # rows share 5 elements
    with pytest.raises(ValueError, match=r"^out: its strides \(48, 8, 8\) make elements overlap"):
        _out_call(ep, q, k, v, out=overlapping)
    np.testing.assert_array_equal(buf, 0)
    with pytest.raises(ValueError, match=r"^out: the array is read-only"):
        _out_call(ep, q, k, v, out=np.broadcast_to(np.zeros((1, 3, 6)), (2, 3, 6)))
    with pytest.raises(TypeError, match=r"^out: expected dtype float64, got float32"):
        _out_call(ep, q, k, v, out=np.zeros((2, 3, 6), np.float32))
    with pytest.raises(ValueError, match=r"^out: expected shape \(2, 3, 6\), got \(2, 3, 5\)"):
        _out_call(ep, q, k, v, out=np.zeros((2, 3, 5)))


@pytest.mark.parametrize("target", ["query", "key", "value", "query_shifted_view", "float_mask"])
@pytest.mark.parametrize("ep", OUT_EPS)
def test_row11_out_aliasing_an_input(ep, target):
    q, k, v = _r(2, 5, 4), _r(2, 5, 4), _r(2, 5, 4)
    mask = _r(5, 5)[None].repeat(2, 0) if target == "float_mask" else None
    if target == "query_shifted_view":
        buf = _r(2, 5, 5)
        q, out = buf[..., :4], buf[..., 1:]
    else:
        out = {"query": q, "key": k, "value": v, "float_mask": mask}[target]
        if target == "float_mask":
            k, v = _r(2, 5, 4), _r(2, 5, 5)
            out = mask
    want = _out_call(ep, q.copy(), k.copy(), v.copy(), **({} if mask is None else {"attn_mask": mask.copy()}))
    got = _out_call(ep, q, k, v, out=out, **({} if mask is None else {"attn_mask": mask}))
    assert got is out
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


# ======================================================================
# Row 12: NaN / inf in the inputs

NAN_ROW_EPS = ["sdpa", "linear", "Linear", "Attention", "MultiHeadAttention"] + [
    f"attention[{n}]" for n in ("dot", "general", "additive", "cosine")] + [
    "PreparedAttention[dot]", "PreparedAttention[additive]"]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NumPy's, on inf / inf
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("ep", NAN_ROW_EPS)
def test_row12_nonfinite_query_row_stays_in_its_row(ep, bad):
    """A NaN / inf in one query row: that row of the result may be NaN, no other row is."""
    e = EPS[ep]
    inputs = e.make(DIMS)
    first = next(iter(inputs))
    if ep == "MultiHeadAttention":  # cross-attention: keys and values stay finite
        inputs["key"], inputs["value"] = _r(2, 5, 4), _r(2, 5, 4)
    inputs[first][0, 1, 0] = bad
    saved = _snapshot(inputs)
    got = e.result(inputs)
    other = np.ones(got.shape[:2], bool)
    other[0, 1] = False
    assert np.isfinite(got[other]).all()
    if bad is np.nan:
        assert np.isnan(got[0, 1]).any()
    _assert_unchanged(inputs, saved)


@pytest.mark.parametrize("ep", ["sdpa", "attention[dot]", "attention[additive]", "multi_head_attention",
                                "PreparedAttention[additive]"])
def test_row12_nan_key_poisons_only_its_batch_item(ep):
    e = EPS[ep]
    inputs = e.make(DIMS)
    inputs["key"][0, 2, 0] = np.nan
    got = e.result(inputs)
    assert np.isnan(got[0]).all() and np.isfinite(got[1]).all()


def test_row12_nan_in_a_sequence():
    """Recurrences: a NaN at step t reaches every later step of its row only."""
    for ep in ("rnn_scan", "LSTM.forward", "SimpleRNN.forward"):  # (GRU is bidirectional)
        e = EPS[ep]
        inputs = e.make(DIMS)
        first = next(iter(inputs))
        inputs[first][0, 1, 0] = np.nan
        got = e.result(inputs)
        assert np.isfinite(got[0, 0]).all() and np.isfinite(got[1]).all()
        assert np.isnan(got[0, 2]).any()


@pytest.mark.parametrize("kind", ["numpy", "compiled"])
def test_row12_nonfinite_inputs_to_a_plugin(kind):
    q, k, v = _r(2, 3, 4), _r(2, 5, 4), _r(2, 5, 6)
    q[0, 1, 0] = np.nan
    out = np.full((2, 3, 6), 7.0)
    with pytest.raises(ValueError, match=r"score returned NaN or \+inf values.*; query contains NaN or "
                                         r"infinite values"):
        fastattn.attention(q, k, v, SIMS[kind], out=out)
    np.testing.assert_array_equal(out, 7.0)


def test_row12_nonfinite_parameters_raise():
    q, k, v = _r(2, 3, 4), _r(2, 5, 4), _r(2, 5, 6)
    for sim, params in (("general", {"W": np.full((4, 4), np.nan)}), ("scaled_dot", {"scale": np.inf}),
                        ("additive", dict(_params("additive", 4), v=np.full(3, np.nan)))):
        with pytest.raises(ValueError, match=r"^params\['(W|scale|v)'\]: contains NaN or infinite values"):
            fastattn.attention(q, k, v, sim, params=params)
    with pytest.raises(ValueError, match=r"^scale: expected a finite real number, got nan"):
        fastattn.scaled_dot_product_attention(q, k, v, scale=math.nan)
    for name, layer in _LAYERS.items():
        sd = layer.state_dict()
        key = next(iter(sd))
        sd[key] = np.full(sd[key].shape, np.inf)
        with pytest.raises(ValueError, match=rf"^state_dict\['{key}'\]: contains NaN or infinite values"):
            layer.load_state_dict(sd)


def test_row12_nonfinite_weights_of_the_functional_ops_propagate():
    """Weights passed to the functional ops are inputs like any other: not scanned."""
    x = _r(2, 3, 4)
    w = _r(6, 4)
    w[2, 0] = np.nan
    y = F.linear(x, w)
    assert np.isnan(y[..., 2]).all() and np.isfinite(np.delete(y, 2, axis=-1)).all()
    o = fastattn.multi_head_attention(x, x, x, **{**_MHA_W, "b_out": np.full(4, np.inf)})
    assert np.isinf(o).all()


# ======================================================================
# Rows 13-14: a similarity that fails, and a compiled plugin's error code

class _Bad(fastattn.Similarity):
    def __init__(self, mode):
        self.mode = mode
        self.name = f"bad_{mode}"

    def score(self, query, key, params):
        s = query @ np.swapaxes(key, -1, -2)
        m = self.mode
        if m == "raises":
            raise ZeroDivisionError("oops")
        if m == "writes_input":
            query[...] = 0
        return {"wrong_shape": lambda: s[..., :-1], "int": lambda: s.astype(np.int64),
                "bool": lambda: s > 0, "complex": lambda: s.astype(complex),
                "object": lambda: s.astype(object), "none": lambda: None, "scalar": lambda: 1.0,
                "nan": lambda: np.where(s > 0, np.nan, s), "posinf": lambda: np.where(s > 0, np.inf, s),
                "too_big_for_float32": lambda: s.astype(np.float64) * 1e300}[m]()


SIM_FAILURES = [
    ("raises", SimilarityError, r"score raised ZeroDivisionError: oops"),
    ("writes_input", SimilarityError, r"score raised ValueError: .*read-only"),
    ("wrong_shape", ValueError, r"score returned shape \(2, 3, 4\), expected \(\.\.\., tq, tk\) = \(2, 3, 5\)"),
    ("none", ValueError, r"score returned shape \(\), expected"),
    ("scalar", ValueError, r"score returned shape \(\), expected"),
    ("int", TypeError, r"score returned dtype int64, expected a real floating dtype"),
    ("bool", TypeError, r"score returned dtype bool, expected a real floating dtype"),
    ("complex", TypeError, r"score returned dtype complex128, expected a real floating dtype"),
    ("object", TypeError, r"score returned dtype object, expected a real floating dtype"),
    ("nan", ValueError, r"score returned NaN or \+inf values \(only -inf, 'may not attend', is allowed\)$"),
    ("posinf", ValueError, r"score returned NaN or \+inf values"),
    ("too_big_for_float32", ValueError, r"score returned values out of float32 range"),
]
SIM_EPS = {
    "attention": lambda s, out: fastattn.attention(*_f32_qkv(), s, out=out),
    "attention+weights": lambda s, out: fastattn.attention(*_f32_qkv(), s, out=out, return_weights=True),
    "PreparedAttention": lambda s, out: F.PreparedAttention(*_f32_qkv()[1:], s)(_f32_qkv()[0]),
    "Attention layer": lambda s, out: L.Attention(4, 4, 6, similarity=s, seed=0)(*_f32_qkv()),
    "AttentionDecoder": lambda s, out: _decoder_with(s),
}


def _f32_qkv():
    rng = np.random.default_rng(5)
    return (rng.standard_normal((2, 3, 4)).astype(np.float32), rng.standard_normal((2, 5, 4)).astype(np.float32),
            rng.standard_normal((2, 5, 6)).astype(np.float32))


def _decoder_with(sim):
    dec = L.AttentionDecoder(10, 3, 4, 4, similarity=sim, style="luong", seed=0)
    mem = dec.precompute(_f32_qkv()[1])
    return dec.step(np.ones(2, np.int64), dec.initial_state(2), mem)


@pytest.mark.parametrize("mode,exc,match", SIM_FAILURES, ids=[m for m, _, _ in SIM_FAILURES])
@pytest.mark.parametrize("ep", list(SIM_EPS))
def test_row13_similarity_that_fails(ep, mode, exc, match):
    if ep == "AttentionDecoder" and mode == "wrong_shape":
        match = r"score returned shape \(2, 1, 4\), expected \(\.\.\., tq, tk\) = \(2, 1, 5\)"
    out = np.full((2, 3, 6), 7.0, np.float32)
    q, k, v = _f32_qkv()
    with pytest.raises(exc, match=rf"^similarity 'bad_{mode}': {match}"):
        SIM_EPS[ep](_Bad(mode), out)
    np.testing.assert_array_equal(out, 7.0)  # out= is untouched on error


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mode,exc,match", [
    (1.0, SimilarityError, r"the compiled score function returned error code 7"),
    (2.0, ValueError, r"score returned NaN or \+inf values"),
    (3.0, ValueError, r"score returned NaN or \+inf values"),
], ids=["error_code", "writes_nan", "writes_posinf"])
@pytest.mark.parametrize("ep", ["attention", "attention+weights", "PreparedAttention", "Attention layer"])
def test_row14_compiled_plugin_error(ep, mode, exc, match, dtype):
    sim = SIMS["compiled"]
    q, k, v = (a.astype(dtype) for a in _f32_qkv())
    P = {"mode": mode}
    out = np.full((2, 3, 6), 7.0, dtype)
    calls = {
        "attention": lambda: fastattn.attention(q, k, v, sim, params=P, out=out),
        "attention+weights": lambda: fastattn.attention(q, k, v, sim, params=P, out=out, return_weights=True),
        "PreparedAttention": lambda: F.PreparedAttention(k, v, sim, params=P)(q),
        "Attention layer": lambda: _compiled_layer(dtype, mode)(q, k, v),
    }
    with pytest.raises(exc, match=rf"^similarity 'fastattn_selftest_neg_sq_dist': {match}"):
        calls[ep]()
    np.testing.assert_array_equal(out, 7.0)
    # the next call with good parameters works (no state left behind)
    good = fastattn.attention(q, k, v, sim, params={"mode": 0.0})
    assert np.isfinite(good).all()


def _compiled_layer(dtype, mode):
    layer = L.Attention(4, 4, 6, similarity=SIMS["compiled"], seed=0, dtype=dtype)
    sd = layer.state_dict()
    sd["sim.mode"] = np.asarray(mode, dtype)
    return layer.load_state_dict(sd)


def test_row13_neg_inf_scores_mask_and_lists_are_converted():
    class NegInfFirstKey(fastattn.Similarity):
        name = "neg_inf_first_key"

        def score(self, query, key, params):
            s = query @ np.swapaxes(key, -1, -2)
            s[..., 0] = -np.inf
            return s.tolist()

    q, k, v = _r(2, 3, 4), _r(2, 5, 4), _r(2, 5, 6)
    o, w = fastattn.attention(q, k, v, NegInfFirstKey(), return_weights=True)
    np.testing.assert_array_equal(w[..., 0], 0)
    mask = np.ones((3, 5), bool)
    mask[:, 0] = False
    np.testing.assert_allclose(o, fastattn.attention(q, k, v, "dot", attn_mask=mask), rtol=1e-12, atol=1e-12)


def test_row13_invalid_similarity_objects():
    q, k, v = _f32_qkv()
    for bad, exc, match in [
        ("nope", KeyError, r"similarity: unknown name 'nope'; available: additive"),
        (None, TypeError, r"similarity: expected a registered name \(str\) or a fastattn.similarity.Similarity instance, got NoneType"),
        (_Bad, TypeError, r"similarity: expected .* got class _Bad \(a Similarity subclass: pass an instance"),
        (lambda a, b: a, TypeError, r"similarity: expected .* got function"),
        (fastattn.Similarity(), TypeError, r"similarity: Similarity does not implement score"),
    ]:
        with pytest.raises(exc, match=match):
            fastattn.attention(q, k, v, bad)

    class NoCapsule(fastattn.CompiledSimilarity):
        name = "no_capsule"
        capsule = "not a capsule"

    with pytest.raises(TypeError, match=r"similarity 'no_capsule': capsule must be a PyCapsule named 'fastattn.score_plugin.v2'"):
        fastattn.attention(q, k, v, NoCapsule())
    g = np.zeros(q.shape[:-1] + (v.shape[-1],))
    with pytest.raises(TypeError, match=r"similarity 'no_capsule': capsule must be a PyCapsule named 'fastattn.score_plugin.v2'"):
        fastattn.functional.attention_backward(g, q, k, v, NoCapsule(), out=g, lse=g[..., 0])


# ======================================================================
# Row 15: bad state dicts (load_state_dict, from_torch)

_SD_LAYERS = dict(_LAYERS, Embedding=L.Embedding(10, 4, seed=0), RNNEncoder=L.RNNEncoder(10, 3, 4, seed=0),
                  AttentionDecoder=_DECODER)


@pytest.mark.parametrize("case", ["wrong_shape", "missing", "unexpected", "complex", "bool", "object",
                                  "ragged", "nan", "not_a_mapping"])
@pytest.mark.parametrize("name", list(_SD_LAYERS))
def test_row15_bad_state_dict(name, case):
    layer = _SD_LAYERS[name]
    before = layer.state_dict()
    sd = layer.state_dict()
    key = next(iter(sd))
    good = sd[key]
    exc, match = ValueError, rf"^state_dict\['{key}'\]: "
    if case == "wrong_shape":
        sd[key] = np.zeros(good.shape + (1,))
        match += r"expected shape"
    elif case == "missing":
        del sd[key]
        match = rf"^state_dict: .*missing.*{key}"
    elif case == "unexpected":
        sd["bogus.weight"] = np.zeros(1)
        match = r"^state_dict: .*unexpected.*bogus.weight"
    elif case in ("complex", "bool", "object"):
        sd[key] = good.astype({"complex": complex, "bool": bool, "object": object}[case])
        exc, match = TypeError, match + r"expected (real numbers|a real floating-point array)"
    elif case == "ragged":
        sd[key] = [[1.0], [1.0, 2.0]]
        exc, match = TypeError, match + r"expected an array"
    elif case == "nan":
        sd[key] = np.full(good.shape, np.nan)
        match += r"contains NaN or infinite values"
    else:
        sd, exc, match = list(sd.items()), TypeError, r"^state_dict: expected a mapping"
    saved = {k: np.array(v, copy=True) if isinstance(v, np.ndarray) else v for k, v in dict(sd).items()} \
        if isinstance(sd, dict) else None
    with pytest.raises(exc, match=match):
        layer.load_state_dict(sd)
    after = layer.state_dict()  # nothing changed on error
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k])
    if saved is not None:
        for k, v in saved.items():
            if isinstance(v, np.ndarray):
                np.testing.assert_array_equal(sd[k], v)


@pytest.mark.parametrize("name", list(_SD_LAYERS))
def test_row15_loaded_arrays_are_copies(name):
    layer = _SD_LAYERS[name]
    sd = {k: v + 0.5 for k, v in layer.state_dict().items()}
    saved = _snapshot(sd)
    layer.load_state_dict(sd)
    _assert_unchanged(sd, saved)
    for k, v in sd.items():
        v += 1.0  # the layer holds copies
    for k, v in layer.state_dict().items():
        np.testing.assert_allclose(v, saved[k], rtol=1e-6)


@pytest.mark.parametrize("cls,sd,exc,match", [
    (L.Linear, {}, ValueError, r"^state_dict: expected 'weight' of shape \(out_features, in_features\)"),
    (L.Linear, {"weight": np.zeros(3)}, ValueError, r"^state_dict: expected 'weight' of shape"),
    (L.Embedding, {"weight": np.zeros((2, 2, 2))}, ValueError, r"^state_dict: expected 'weight' of shape"),
    (L.GRU, {"weight_ih_l0": np.zeros((6, 2))}, ValueError, r"^state_dict: expected 'weight_ih_l0' and 'weight_hh_l0'"),
    (L.LSTM, {"weight_ih_l0": np.zeros(8), "weight_hh_l0": np.zeros((8, 2))}, ValueError,
     r"^state_dict\['weight_ih_l0'\]: expected a 2-d"),
    (L.SimpleRNN, {"weight_ih_l0": np.zeros((3, 2)), "weight_hh_l0": np.zeros((3, 3)),
                   "bias_ih_l0": np.zeros(3, complex), "bias_hh_l0": np.zeros(3)}, TypeError,
     r"^state_dict\['bias_ih_l0'\]: expected real numbers"),
    (L.GRU, {"weight_ih_l0": np.zeros((7, 2)), "weight_hh_l0": np.zeros((7, 2))}, ValueError,
     r"^state_dict\['weight_ih_l0'\]: expected 3 \* hidden_size rows"),
    (L.MultiHeadAttention, {"in_proj_weight": np.zeros((12, 4)), "out_proj.weight": np.zeros((4, 4))},
     TypeError, r"^num_heads: a state dict does not record the number of heads"),
    (L.MultiHeadAttention, 3, TypeError, r"^module_or_state_dict: expected a torch.nn.MultiheadAttention"),
    (L.GRU, None, TypeError, r"^module_or_state_dict: expected a torch module or a state dict, got NoneType"),
    (L.Linear, {"weight": np.full((2, 2), np.nan)}, ValueError, r"^state_dict\['weight'\]: contains NaN"),
])
def test_row15_bad_from_torch(cls, sd, exc, match):
    with pytest.raises(exc, match=match):
        cls.from_torch(sd)


# ======================================================================
# The training API: the second table of docs/bad_input.md, rows 18-26
#
# Each case is (id, exception, regex, call); every regex starts with ``^`` and
# the parameter's name.  The inputs are the module-level arrays of ``_T`` (and
# read-only copies of them); every test checks them unchanged afterwards.

import io  # noqa: E402
import re  # noqa: E402

from fastattn import losses as LS  # noqa: E402
from fastattn import optim as O  # noqa: E402
from fastattn import train as T  # noqa: E402

_T = dict(
    x=_r(2, 5, 4), w=_r(4), b=_r(4), g=_r(2, 5, 4),
    keep=RNG.random((2, 5, 4)) < 0.7,
    z=_r(4, 3), t=np.array([0, 2, 1, -100]), cw=RNG.random(3) + 0.5,
    y=(RNG.random((4, 3)) < 0.5).astype(np.float64),
)
_BLOCKS = {  # float64 layers, built once; dropout 0 in the transformer (deterministic)
    "LayerNorm": L.LayerNorm(4, dtype=np.float64),
    "Dropout": L.Dropout(0.3, seed=0),
    "FeedForward": L.FeedForward(4, 6, seed=0, dtype=np.float64),
    "MeanPooling": L.MeanPooling(),
    "Sequential": L.Sequential(L.Linear(4, 4, seed=0, dtype=np.float64), L.LayerNorm(4, dtype=np.float64)),
    "AttentionPooling": L.AttentionPooling(4, 3, hops=2, seed=0, dtype=np.float64),
    "PositionalEmbedding": L.PositionalEmbedding(8, 4, seed=0, dtype=np.float64),
    "TransformerEncoderLayer": L.TransformerEncoderLayer(4, 2, 6, dropout=0.0, seed=0, dtype=np.float64),
    "TransformerEncoder": L.TransformerEncoder(
        L.TransformerEncoderLayer(4, 2, 6, dropout=0.0, seed=0, dtype=np.float64), 2, norm=True, seed=0),
}


def _run_cases(case, inputs=None):
    """Run one (id, exc, regex, call) case; the inputs are unchanged after."""
    inputs = _T if inputs is None else inputs
    saved = _snapshot(inputs)
    _, exc, match, call = case
    assert match.startswith("^"), match
    with pytest.raises(exc, match=match):
        call()
    _assert_unchanged(inputs, saved)


def _ids(cases):
    return [c[0] for c in cases]


def _fb(layer, x, *args):
    """forward_backward's output and the input gradient of a ones grad_out."""
    out, back = layer.forward_backward(x, *args)
    o = out[0] if isinstance(out, tuple) else out
    return o, back(np.ones_like(o))[0]


# ---------------------------------------------------------------- row 18: wrong rank
_X = _T["x"]
ROW18 = [
    ("layer_norm-0d", ValueError, r"^x: expected an array with at least 1 dim \(\.\.\., E\), got shape \(\)$",
     lambda: F.layer_norm(np.float64(1.0))),
    ("layer_norm_backward-0d", ValueError, r"^x: expected an array with at least 1 dim",
     lambda: F.layer_norm_backward(np.float64(1.0), np.float64(1.0))),
    ("cross_entropy-0d", ValueError, r"^logits: expected an array of shape \(C,\), \(N, C\) or \(N, C, d1, \.\.\.\), "
     r"got a 0-d array$", lambda: LS.cross_entropy(np.float64(1.0), 0)),
] + [
    (f"{n}-{nd}d", ValueError, rf"^x: expected a {want} array, got {nd}-d array of shape",
     lambda n=n, nd=nd: _BLOCKS[n](np.ones((1,) * (nd - 1) + (4,)) if nd else np.float64(1.0)))
    for n, want, nds in [("LayerNorm", "1-d to 32-d", (0, 33)), ("FeedForward", "1-d to 32-d", (0,)),
                         ("Sequential", "1-d to 32-d", (0,)), ("MeanPooling", "3-d", (0, 2, 4)),
                         ("AttentionPooling", "3-d", (1, 2, 4)),
                         ("PositionalEmbedding", "2-d or 3-d", (0, 1, 4))]
    for nd in nds
] + [
    ("bucket_batches-1d-array", ValueError, r"^seqs: expected a 2-d integer array or a list of 1-d sequences, "
     r"got array of shape \(3,\)", lambda: T.bucket_batches(np.arange(3), batch_size=2)),
    ("bucket_batches-nested", ValueError, r"^seqs\[1\]: expected a 1-d sequence of ids, got array of shape \(1, 2\)",
     lambda: T.bucket_batches([[1, 2], [[1, 2]]], batch_size=2)),
]


@pytest.mark.parametrize("case", ROW18, ids=_ids(ROW18))
def test_row18_wrong_rank(case):
    _run_cases(case)


@pytest.mark.parametrize("shape", [(), (3,), (2, 3, 4, 5)], ids=str)
def test_row18_elementwise_ops_take_any_rank(shape):
    """gelu / relu / dropout, bce and mse are elementwise: any rank, the input's shape."""
    x = RNG.standard_normal(shape)
    for fn in (F.gelu, F.relu, lambda a: F.dropout(a, 0.5, rng=np.random.default_rng(0))[0],
               lambda a: LS.binary_cross_entropy_with_logits(a, np.ones(shape))[1],
               lambda a: LS.mse(a, np.zeros(shape))[1], _BLOCKS["Dropout"]):
        assert np.shape(fn(x)) == shape


@pytest.mark.parametrize("name", ["TransformerEncoderLayer", "TransformerEncoder"])
def test_row18_transformer_errors_name_x(name):
    """The transformer blocks name their input x (not MultiHeadAttention's query)."""
    x1, x3, xc = np.ones(4), np.ones((2, 5, 3)), np.ones((2, 5, 4), complex)
    for i, (exc, match, call) in enumerate([
            (ValueError, r"^x: expected a 2-d or 3-d array, got 1-d array of shape \(4,\)$",
             lambda: _BLOCKS[name](x1)),
            (ValueError, r"^x: expected a 2-d or 3-d array, got 1-d array of shape \(4,\)$",
             lambda: _BLOCKS[name].forward_backward(x1)),
            (ValueError, r"^x: expected last dim 4, got shape \(2, 5, 3\)$", lambda: _BLOCKS[name](x3)),
            (TypeError, r"^x: expected real numbers \(float32/float64\), got dtype complex128$",
             lambda: _BLOCKS[name](xc))]):
        _run_cases((str(i), exc, match, call), dict(x1=x1, x3=x3, xc=xc))


# ---------------------------------------------------------------- row 19: mismatched sizes
ROW19 = [
    ("layer_norm-weight", ValueError, r"^weight: expected shape \(4,\) \(x's last dim\), got \(3,\)$",
     lambda: F.layer_norm(_T["x"], _T["w"][:3])),
    ("layer_norm-bias", ValueError, r"^bias: expected shape \(4,\) \(x's last dim\), got \(1, 4\)$",
     lambda: F.layer_norm(_T["x"], _T["w"], _T["b"][None])),
    ("layer_norm_backward-grad_out", ValueError, r"^grad_out: expected shape \(2, 5, 4\), got \(2, 5, 3\)$",
     lambda: F.layer_norm_backward(_T["g"][..., :3], _T["x"], _T["w"], _T["b"])),
    ("gelu_backward-grad_out", ValueError, r"^grad_out: expected shape \(2, 5, 4\), got \(5, 4\)$",
     lambda: F.gelu_backward(_T["g"][0], _T["x"])),
    ("relu_backward-grad_out", ValueError, r"^grad_out: expected shape \(2, 5, 4\), got \(2, 5, 3\)$",
     lambda: F.relu_backward(_T["g"][..., :3], _T["x"])),
    ("dropout_backward-keep", ValueError, r"^grad_out: expected shape \(5, 4\), got \(2, 5, 4\)$",
     lambda: F.dropout_backward(_T["g"], _T["keep"][0], 0.3)),
    ("cross_entropy-targets", ValueError, r"^targets: expected class indices of shape \(4,\) \(logits' shape "
     r"\(4, 3\) without the class axis 1\) or class probabilities of shape \(4, 3\), got shape \(3,\)$",
     lambda: LS.cross_entropy(_T["z"], _T["t"][:3])),
    ("cross_entropy-probabilities", ValueError, r"^targets: floating targets are class probabilities and must "
     r"have the logits' shape \(4, 3\), got shape \(4, 2\)", lambda: LS.cross_entropy(_T["z"], _T["y"][:, :2])),
    ("cross_entropy-class-range", ValueError, r"^targets: expected class indices in \[0, 3\) or ignore_index=-100, "
     r"got 3 at index \(1,\) \(1 out of range\)$", lambda: LS.cross_entropy(_T["z"], np.array([0, 3, 1, 2]))),
    ("cross_entropy-weight", ValueError, r"^weight: expected shape \(C,\) = \(3,\), one weight per class, got "
     r"shape \(4,\)$", lambda: LS.cross_entropy(_T["z"], _T["t"], weight=_T["w"])),
    ("bce-targets", ValueError, r"^targets: expected the logits' shape \(4, 3\), got shape \(3, 4\)$",
     lambda: LS.binary_cross_entropy_with_logits(_T["z"], _T["y"].T)),
    ("bce-weight", ValueError, r"^weight: expected a shape that broadcasts to the logits' shape \(4, 3\), got \(4,\)$",
     lambda: LS.binary_cross_entropy_with_logits(_T["z"], _T["y"], weight=_T["w"])),
    ("bce-pos_weight-enlarges", ValueError, r"^pos_weight: expected a shape that broadcasts to the logits' shape "
     r"\(4, 3\), got \(2, 4, 3\)$",
     lambda: LS.binary_cross_entropy_with_logits(_T["z"], _T["y"], pos_weight=np.ones((2, 4, 3)))),
    ("mse-target", ValueError, r"^target: expected pred's shape \(4, 3\), got shape \(3,\)$",
     lambda: LS.mse(_T["z"], _T["cw"])),
] + [
    (f"{n}-last-dim", ValueError, r"^x: expected last dim 4, got shape \(2, 5, 3\)$",
     lambda n=n: _BLOCKS[n](_T["x"][..., :3]))
    for n in ("LayerNorm", "FeedForward", "Sequential", "AttentionPooling", "PositionalEmbedding")
] + [
    ("PositionalEmbedding-max_len", ValueError, r"^x: expected at most max_len=8 positions, got 9$",
     lambda: _BLOCKS["PositionalEmbedding"](np.ones((2, 9, 4)))),
    ("MeanPooling-mask", ValueError, r"^mask: expected shape \(2, 5\), got \(2, 4\)$",
     lambda: _BLOCKS["MeanPooling"](_T["x"], _T["keep"][:, :4, 0])),
    ("AttentionPooling-mask", ValueError, r"^mask: expected shape \(2, 5\), got \(5,\)$",
     lambda: _BLOCKS["AttentionPooling"](_T["x"], _T["keep"][0, :, 0])),
    ("TransformerEncoderLayer-key_mask", ValueError, r"^key_mask: expected shape \(2, 5\) \(\(B, Lk\), True = "
     r"real token\), got \(2, 4\)$", lambda: _BLOCKS["TransformerEncoderLayer"](_T["x"], key_mask=_T["keep"][:, :4, 0])),
    ("TransformerEncoder-attn_mask", ValueError, r"^attn_mask: expected a shape broadcastable to \(B=2, "
     r"num_heads=2, Lq=5, Lk=5\), got \(4, 4\)$",
     lambda: _BLOCKS["TransformerEncoder"](_T["x"], attn_mask=np.ones((4, 4), bool))),
] + [
    (f"{n}-backprop-grad_out", ValueError, rf"^grad_out: expected shape \({s}\), got",
     lambda n=n: _BLOCKS[n].forward_backward(_T["x"])[1](np.ones((2, 5, 5))))
    for n, s in [("LayerNorm", "2, 5, 4"), ("Dropout", "2, 5, 4"), ("FeedForward", "2, 5, 4"),
                 ("MeanPooling", "2, 4"), ("Sequential", "2, 5, 4"), ("PositionalEmbedding", "2, 5, 4"),
                 ("TransformerEncoderLayer", "2, 5, 4"), ("TransformerEncoder", "2, 5, 4")]
] + [
    ("optim-grad-shape", ValueError, r"^params\['w'\]: expected a gradient of the parameter's shape \(4,\), "
     r"got \(3,\)$", lambda: O.Adam([("w", _T["w"], _T["b"][:3])])),
    ("load-into-shape", ValueError, r"^into: the Linear does not have the checkpoint's config: in_features: "
     r"checkpoint 4, model 5$", lambda: fastattn.load(_checkpoint_bytes(), into=L.Linear(5, 3, dtype=np.float64))),
    ("bucket_batches-labels", ValueError, r"^labels: expected one label per sequence \(3\), got 2$",
     lambda: T.bucket_batches([[1], [2, 3], [4]], [0, 1], batch_size=2)),
]


def _checkpoint_bytes():
    """A saved Linear(4, 3) (float64), as a file object."""
    f = io.BytesIO()
    fastattn.save(L.Linear(4, 3, seed=0, dtype=np.float64), f)
    f.seek(0)
    return f


@pytest.mark.parametrize("case", ROW19, ids=_ids(ROW19))
def test_row19_mismatched_sizes(case):
    _run_cases(case)


# ---------------------------------------------------------------- row 20: dtypes
BAD_DTYPES_T = [np.complex128, object, "U1", np.longdouble, "datetime64[D]"]


def _bad(a, dtype):
    return np.full(a.shape, "a") if dtype == "U1" else (
        np.zeros(a.shape, dtype) if dtype == "datetime64[D]" else a.astype(dtype))


@pytest.mark.parametrize("dtype", BAD_DTYPES_T, ids=lambda d: np.dtype(d).name)
def test_row20_bad_dtypes_raise(dtype):
    x, g, z, y = _T["x"], _T["g"], _T["z"], _T["y"]
    bx, bz = _bad(x, dtype), _bad(z, dtype)
    name = np.dtype(dtype).name if dtype not in ("U1",) else "<U1"
    real = r"^{p}: expected a real floating array, got dtype "
    cases = [
        (TypeError, real.format(p="x"), lambda: F.layer_norm(bx)),
        (TypeError, real.format(p="weight"), lambda: F.layer_norm(x, _bad(_T["w"], dtype))),
        (TypeError, real.format(p="bias"), lambda: F.layer_norm(x, None, _bad(_T["b"], dtype))),
        (TypeError, real.format(p="x"), lambda: F.layer_norm_backward(g, bx)),
        (TypeError, real.format(p="x"), lambda: F.gelu(bx)),
        (TypeError, real.format(p="x"), lambda: F.gelu_backward(g, bx)),
        (TypeError, real.format(p="x"), lambda: F.relu(bx)),
        (TypeError, real.format(p="x"), lambda: F.relu_backward(g, bx)),
        (TypeError, real.format(p="x"), lambda: F.dropout(bx, 0.5, rng=np.random.default_rng(0))),
        (TypeError, r"^grad_out: expected a real floating array \(float16, float32 or float64\), got dtype",
         lambda: F.dropout_backward(_bad(g, dtype), _T["keep"], 0.5)),
        (TypeError, r"^logits: expected real numbers", lambda: LS.cross_entropy(bz, _T["t"])),
        (TypeError, r"^logits: expected real numbers", lambda: LS.binary_cross_entropy_with_logits(bz, y)),
        (TypeError, r"^targets: expected (integer class indices|target probabilities)",
         lambda: LS.binary_cross_entropy_with_logits(z, _bad(y, dtype))),
        (TypeError, r"^weight: expected real numbers", lambda: LS.cross_entropy(z, _T["t"], weight=_bad(_T["cw"], dtype))),
        (TypeError, r"^pred: expected real numbers", lambda: LS.mse(bz, z)),
        (TypeError, r"^target: expected real numbers", lambda: LS.mse(z, bz)),
    ]
    if dtype != np.longdouble:   # a float128 array of class probabilities is refused as a dtype too
        cases.append((TypeError, r"^targets: expected integer class indices or floating class probabilities, "
                                 rf"got dtype {re.escape(name)}$", lambda: LS.cross_entropy(z, _bad(y, dtype))))
    for n in _BLOCKS:
        want = r"^x: expected a real floating array" if n == "Dropout" else \
            r"^x: expected real numbers \(float32/float64\), got dtype "
        cases.append((TypeError, want, lambda n=n: _BLOCKS[n](bx)))
    for i, (exc, match, call) in enumerate(cases):
        _run_cases((str(i), exc, match, call))


ROW20 = [
    ("layer_norm_backward-int-grad", TypeError, r"^grad_out: expected a real floating array \(float16, float32 or "
     r"float64\), got dtype int64$", lambda: F.layer_norm_backward(np.ones((2, 5, 4), np.int64), _T["x"])),
    ("gelu_backward-int-grad", TypeError, r"^grad_out: expected a real floating array", lambda: F.gelu_backward(
        np.ones((2, 5, 4), np.int64), _T["x"])),
    ("dropout_backward-int-keep", TypeError, r"^keep: expected the boolean mask dropout returned, got dtype int64$",
     lambda: F.dropout_backward(_T["g"], _T["keep"].astype(np.int64), 0.3)),
    ("cross_entropy-bool-targets", TypeError, r"^targets: expected integer class indices or floating class "
     r"probabilities, got dtype bool$", lambda: LS.cross_entropy(_T["z"], _T["t"] > 0)),
    ("MeanPooling-int-mask", TypeError, r"^mask: expected a boolean array \(True = real position\), got dtype int64$",
     lambda: _BLOCKS["MeanPooling"](_T["x"], np.ones((2, 5), np.int64))),
    ("AttentionPooling-int-mask", TypeError, r"^mask: expected a boolean array", lambda: _BLOCKS["AttentionPooling"](
        _T["x"], np.ones((2, 5), np.int64))),
    ("TransformerEncoderLayer-int-key_mask", TypeError, r"^key_mask: expected a bool array of shape \(2, 5\)",
     lambda: _BLOCKS["TransformerEncoderLayer"](_T["x"], key_mask=np.ones((2, 5), np.int64))),
    ("optim-int-param", TypeError, r"^params\['w'\]: expected a floating-point parameter, got dtype int64$",
     lambda: O.SGD([("w", np.ones(3, np.int64), np.zeros(3, np.int64))])),
    ("optim-grad-dtype", TypeError, r"^params\['w'\]: expected a gradient of the parameter's dtype float64, got "
     r"float32$", lambda: O.SGD([("w", _T["w"], np.zeros(4, np.float32))])),
    ("bucket_batches-float-ids", TypeError, r"^seqs\[0\]: expected integer ids, got dtype float64$",
     lambda: T.bucket_batches([[1.5, 2.0]], batch_size=2)),
] + [
    (f"{n}-backprop-int-grad_out", TypeError, r"^grad_out: expected a real floating array \(float16, float32 or "
     r"float64\), got dtype int64$", lambda n=n: _int_grad_backprop(_BLOCKS[n]))
    for n in _BLOCKS
]


def _int_grad_backprop(layer):
    out, backprop = layer.forward_backward(_T["x"])
    o = out[0] if isinstance(out, tuple) else out
    return backprop(np.ones(o.shape, np.int64))


@pytest.mark.parametrize("case", ROW20, ids=_ids(ROW20))
def test_row20_wrong_dtype_of_masks_grads_and_ids(case):
    _run_cases(case)


@pytest.mark.parametrize("dtype", [np.bool_, np.int8, np.int64, np.float16, np.float32])
def test_row20_promotion(dtype):
    """bool / integer inputs are computed in float64; float16 in float32 (row 5): gelu,
    relu, dropout and layer_norm return float16; every backward its input's dtype."""
    x = (_T["x"] > 0) if dtype == np.bool_ else (_T["x"] * 3).astype(dtype)
    x64 = x.astype(np.float64)
    cd = np.float32 if dtype in (np.float16, np.float32) else np.float64
    gd = dtype if dtype in (np.float16, np.float32) else np.float64
    g = _T["g"].astype(gd)
    assert F.layer_norm(x).dtype == gd and F.gelu(x).dtype == gd
    assert F.relu(x).dtype == gd and F.dropout(x, 0.5, rng=np.random.default_rng(0))[0].dtype == gd
    assert F.layer_norm_backward(g, x)[0].dtype == gd and F.gelu_backward(g, x).dtype == gd
    assert F.relu_backward(g, x).dtype == gd
    tol = 1e-12 if cd == np.float64 else 1e-5
    ltol = 2e-3 if dtype == np.float16 else tol   # a float16 result: its rounding
    np.testing.assert_allclose(F.layer_norm(x), F.layer_norm(x64), rtol=ltol, atol=ltol)
    np.testing.assert_allclose(F.gelu(x), F.gelu(x64).astype(gd), rtol=tol, atol=tol)
    z = x[0] if dtype != np.bool_ else x[0]
    for fn in (lambda a: LS.cross_entropy(a, np.array([0, 1, 2, 3, 0]) % 4),
               lambda a: LS.mse(a, np.zeros(a.shape)),
               lambda a: LS.binary_cross_entropy_with_logits(a, np.ones(a.shape))):
        loss, grad = fn(z)
        assert type(loss) is float and grad.dtype == gd
        loss64, grad64 = fn(z.astype(np.float64))
        assert loss == pytest.approx(loss64, rel=10 * tol, abs=10 * tol)
    for n in ("LayerNorm", "FeedForward", "PositionalEmbedding", "TransformerEncoderLayer"):
        y = _BLOCKS[n](x)
        assert y.dtype == np.float64     # float64 layers
        np.testing.assert_allclose(y, _BLOCKS[n](x64), rtol=tol, atol=tol)


# ---------------------------------------------------------------- row 21: zero-size dims
@pytest.mark.parametrize("shape", [(0, 4), (2, 0, 4)], ids=["rows0", "L0"])
def test_row21_zero_rows_give_empty_results(shape):
    x, g = np.zeros(shape), np.zeros(shape)
    for got in (F.layer_norm(x, _T["w"], _T["b"]), F.gelu(x), F.relu(x), F.dropout(x, 0.5, rng=np.random.default_rng(0))[0],
                F.gelu_backward(g, x), F.relu_backward(g, x), F.dropout_backward(g, x > 0, 0.5),
                LS.mse(x, x, reduction="none")[1], LS.binary_cross_entropy_with_logits(x, x)[1]):
        assert got.shape == shape
    dx, dw, db = F.layer_norm_backward(g, x, _T["w"], _T["b"])
    assert dx.shape == shape
    np.testing.assert_array_equal(dw, 0.0)
    np.testing.assert_array_equal(db, 0.0)


def test_row21_zero_size_losses():
    """"mean" over nothing is nan with an all-zero (empty) gradient, "sum" is 0; C = 0 raises."""
    for fn, args in ((LS.cross_entropy, (np.zeros((0, 3)), np.zeros(0, np.int64))),
                     (LS.binary_cross_entropy_with_logits, (np.zeros((0, 3)), np.zeros((0, 3)))),
                     (LS.mse, (np.zeros((0, 3)), np.zeros((0, 3))))):
        loss, grad = fn(*args)
        assert math.isnan(loss) and grad.shape == (0, 3)
        assert fn(*args, reduction="sum")[0] == 0.0
    loss, grad = LS.cross_entropy(_T["z"], np.full(4, -100))
    assert math.isnan(loss)
    np.testing.assert_array_equal(grad, 0.0)
    _run_cases(("C0", ValueError, r"^logits: expected at least one class \(C >= 1 on the class axis\), got shape "
                r"\(2, 0\)$", lambda: LS.cross_entropy(np.zeros((2, 0)), np.zeros(2, np.int64))))


@pytest.mark.parametrize("name", list(_BLOCKS))
@pytest.mark.parametrize("shape", [(0, 5, 4), (2, 0, 4)], ids=["B0", "L0"])
def test_row21_blocks_with_zero_batch_or_length(name, shape):
    x = np.zeros(shape)
    saved = _snapshot(dict(x=x))
    out, dx = _fb(_BLOCKS[name], x)
    _assert_unchanged(dict(x=x), saved)
    assert dx.shape == shape
    want = {"MeanPooling": shape[:1] + shape[2:], "AttentionPooling": shape[:1] + (8,)}.get(name, shape)
    assert out.shape == want
    if name in ("MeanPooling", "AttentionPooling"):
        np.testing.assert_array_equal(out, 0.0)   # L = 0: no position to pool


def test_row21_positional_embedding_backprop_with_zero_length():
    layer = L.PositionalEmbedding(8, 4, seed=0, dtype=np.float64)
    layer.zero_grad()
    out, backprop = layer.forward_backward(np.zeros((2, 0, 4)))
    assert backprop(np.zeros(out.shape))[0].shape == (2, 0, 4)
    np.testing.assert_array_equal(layer.grads["weight"], 0.0)


@pytest.mark.parametrize("shape", [(0, 5, 4), (2, 0, 4)], ids=["B0", "L0"])
def test_row21_attention_pooling_with_zero_batch_or_length(shape):
    """Empty outputs; L = 0: zeros (as an all-padding row) and zero weight gradients."""
    layer = L.AttentionPooling(4, 3, hops=2, seed=0, dtype=np.float64)
    out, a = layer(np.zeros(shape), return_weights=True)
    assert out.shape == (shape[0], 8) and a.shape == (shape[0], 2, shape[1])
    np.testing.assert_array_equal(out, 0.0)
    (out, P), backprop = layer.forward_backward(np.zeros(shape), penalty=1.0)
    dx, _ = backprop(np.ones(out.shape))
    assert dx.shape == shape and out.shape == (shape[0], 8)
    assert P == (2.0 if shape[0] else 0.0)    # ||A Aᵀ - I||² = hops for an all-zero A
    for g in layer.grads.values():
        np.testing.assert_array_equal(g, 0.0)


ROW21 = [
    ("optim-no-params", ValueError, r"^params: expected at least one parameter, got none$", lambda: O.Adam([])),
    ("bucket_batches-no-seqs", ValueError, r"^seqs: expected at least one sequence, got none$",
     lambda: T.bucket_batches([], batch_size=2)),
    ("bucket_batches-empty-seq", ValueError, r"^seqs\[1\]: expected at least one id, got an empty sequence$",
     lambda: T.bucket_batches([[1], []], batch_size=2)),
    ("fit-no-batch", ValueError, r"^batches: epoch 0 gave no batch$",
     lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL, lr=0.1), [], epochs=1, progress=False)),
]

_FIT_MODEL = L.Linear(4, 3, seed=0, dtype=np.float64)


def _fit_loss(model, batch):
    x, y = batch
    out, back = model.forward_backward(x)
    loss, grad = LS.cross_entropy(out, y)
    back(grad)
    return loss


@pytest.mark.parametrize("case", ROW21, ids=_ids(ROW21))
def test_row21_nothing_to_train_on(case):
    _run_cases(case)


# ---------------------------------------------------------------- row 22: layouts
def _elementwise_calls():
    w, b = _T["w"], _T["b"]
    return {
        "layer_norm": lambda x, g: F.layer_norm(x, w, b),
        "layer_norm_backward": lambda x, g: np.concatenate(
            [a.ravel() for a in F.layer_norm_backward(g, x, w, b)]),
        "gelu": lambda x, g: F.gelu(x), "gelu_backward": lambda x, g: F.gelu_backward(g, x, approximate="tanh"),
        "relu": lambda x, g: F.relu(x), "relu_backward": lambda x, g: F.relu_backward(g, x),
        "dropout": lambda x, g: F.dropout(x, 0.4, rng=np.random.default_rng(3))[0],
        "dropout_backward": lambda x, g: F.dropout_backward(g, x > 0, 0.4),
        "cross_entropy": lambda x, g: LS.cross_entropy(x.reshape(10, 4), np.arange(10) % 4,
                                                        label_smoothing=0.1)[1],
        "cross_entropy-probs": lambda x, g: LS.cross_entropy(x, np.abs(g) / np.abs(g).sum(1, keepdims=True))[1],
        "bce": lambda x, g: LS.binary_cross_entropy_with_logits(x, (g > 0) * 1.0, pos_weight=np.abs(w))[1],
        "mse": lambda x, g: LS.mse(x, g)[1],
        **{n: (lambda x, g, n=n: _fb(_BLOCKS[n], x)[1]) for n in _BLOCKS if n != "Dropout"},
        "Dropout": lambda x, g: _fb(L.Dropout(0.3, seed=0), x)[1],   # a fresh mask stream per call
    }


@pytest.mark.parametrize("kind", LAYOUTS)
@pytest.mark.parametrize("op", list(_elementwise_calls()))
def test_row22_layouts(op, kind):
    call = _elementwise_calls()[op]
    base = dict(x=_T["x"], g=_T["g"])
    for param in base:
        inputs = dict(base)
        inputs[param] = _layout(base[param], kind)
        saved = _snapshot(inputs)
        got = call(**inputs)
        want = call(**{k: np.array(v, order="C") for k, v in inputs.items()})
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12, err_msg=f"{param} {kind}")
        _assert_unchanged(inputs, saved)


def test_row22_read_only_parameters_refused_at_step():
    w = _T["w"].copy()
    w.flags.writeable = False
    opt = O.SGD([("w", w, np.ones(4))], lr=0.1)
    _run_cases(("ro", ValueError, r"^params\['w'\]: the parameter array is read-only \(a frozen layer\? "
                r"unfreeze it to train\)$", opt.step), dict(w=w))


# ---------------------------------------------------------------- row 23: NaN / inf
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # losses.py's, on inf - inf
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_row23_nonfinite_stays_in_its_row(bad):
    x = _T["x"].copy()
    x[0, 1, 2] = bad
    others = np.ones(x.shape[:2], bool)
    others[0, 1] = False
    for out in (F.layer_norm(x, _T["w"], _T["b"]), F.layer_norm_backward(_T["g"], x)[0],
                _BLOCKS["LayerNorm"](x), _BLOCKS["FeedForward"](x), _BLOCKS["Sequential"](x)):
        assert np.all(np.isfinite(out[others])) and not np.all(np.isfinite(out[0, 1]))
    # the elementwise ops: only that element
    for out in (F.gelu(x), F.relu(x), F.gelu_backward(_T["g"], x)):
        flat = np.ravel_multi_index((0, 1, 2), x.shape)
        assert np.all(np.isfinite(np.delete(out.ravel(), flat))) and not np.isfinite(out.ravel()[flat])
    # losses: that sample's loss and gradient, as torch; "mean" becomes nan
    z = _T["z"].copy()
    z[1, 0] = bad
    for loss, grad in (LS.cross_entropy(z, _T["t"], reduction="none"),
                       LS.binary_cross_entropy_with_logits(z, _T["y"], reduction="none"),
                       LS.mse(z, _T["y"], reduction="none")):
        rows = np.ones(4, bool)
        rows[1] = False
        assert np.all(np.isfinite(loss[rows])) and np.all(np.isfinite(grad[rows]))
    assert math.isnan(LS.cross_entropy(z, _T["t"])[0])
    # the pooling and transformer blocks: that batch item
    for n in ("MeanPooling", "AttentionPooling", "TransformerEncoderLayer", "TransformerEncoder"):
        out = _BLOCKS[n](x)
        assert np.all(np.isfinite(out[1])) and not np.all(np.isfinite(out[0])), n


@pytest.mark.filterwarnings("error::RuntimeWarning")   # NaN / inf propagate without NumPy's warnings
def test_row23_nonfinite_elementwise_values():
    """gelu(-inf) and its gradient at +-inf are nan (torch's too); relu passes the gradient at NaN (torch's threshold_backward)."""
    x = np.array([np.nan, np.inf, -np.inf, 0.0])
    np.testing.assert_array_equal(F.gelu(x), [np.nan, np.inf, np.nan, 0.0])
    np.testing.assert_array_equal(F.relu(x), [np.nan, np.inf, 0.0, 0.0])
    np.testing.assert_array_equal(F.relu_backward(np.ones(4), x), [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(F.gelu_backward(np.ones(4), x)[:3], [np.nan] * 3)
    # layer_norm: the row with inf is NaN, the others finite
    y = F.layer_norm(np.stack([x[1:3], [1.0, 2.0]]), np.ones(2), np.ones(2))
    assert np.isnan(y[0]).all() and np.isfinite(y[1]).all()


def test_row23_nonfinite_gradients_in_clip_grad_norm():
    g = np.array([np.inf, 1.0, 0.0, 0.0])
    model = [("w", _T["w"].copy(), g.copy())]
    _run_cases(("inf", RuntimeError, r"^clip_grad_norm: the total norm of order 2.0 of the gradients is non-finite "
                r"\(inf\), so it cannot be clipped", lambda: O.clip_grad_norm(model, 1.0, error_if_nonfinite=True)),
               dict(g=model[0][2]))
    np.testing.assert_array_equal(model[0][2], g)   # no gradient changed
    with np.errstate(invalid="ignore"):
        assert O.clip_grad_norm(model, 1.0) == math.inf    # as torch: scaled by 0 (inf * 0 = nan)
    np.testing.assert_array_equal(model[0][2], [np.nan, 0.0, 0.0, 0.0])


# ---------------------------------------------------------------- row 24: options and hyperparameters
ROW24 = [
    ("layer_norm-eps", ValueError, r"^eps: expected a finite number >= 0, got -1.0$", lambda: F.layer_norm(_T["x"], eps=-1)),
    ("layer_norm-eps-type", TypeError, r"^eps: expected a real number, got str", lambda: F.layer_norm(_T["x"], eps="a")),
    ("gelu-approximate", ValueError, r"^approximate: expected 'none' or 'tanh', got 'erf'$",
     lambda: F.gelu(_T["x"], approximate="erf")),
    ("dropout-p", ValueError, r"^p: expected a probability in \[0, 1\), got 1.0$",
     lambda: F.dropout(_T["x"], 1.0, rng=np.random.default_rng(0))),
    ("dropout-p-type", TypeError, r"^p: expected a probability \(a real number\), got bool",
     lambda: F.dropout(_T["x"], True, rng=np.random.default_rng(0))),
    ("dropout-rng", TypeError, r"^rng: expected a numpy.random.Generator, got int", lambda: F.dropout(_T["x"], 0.5, rng=0)),
    ("dropout_backward-p", ValueError, r"^p: expected a probability in \[0, 1\), got nan$",
     lambda: F.dropout_backward(_T["g"], _T["keep"], float("nan"))),
    ("reduction", ValueError, r"^reduction: expected one of 'mean', 'sum', 'none', got 'avg'$",
     lambda: LS.mse(_T["z"], _T["z"], reduction="avg")),
    ("reduction-type", TypeError, r"^reduction: expected one of 'mean', 'sum', 'none', got NoneType None$",
     lambda: LS.binary_cross_entropy_with_logits(_T["z"], _T["y"], reduction=None)),
    ("label_smoothing", ValueError, r"^label_smoothing: expected a float in \[0, 1\], got 2$",
     lambda: LS.cross_entropy(_T["z"], _T["t"], label_smoothing=2)),
    ("ignore_index", TypeError, r"^ignore_index: expected an int, got float 1.5$",
     lambda: LS.cross_entropy(_T["z"], _T["t"], ignore_index=1.5)),
    ("LayerNorm-normalized_shape", TypeError, r"^normalized_shape: expected an int >= 1, got tuple \(4,\)$",
     lambda: L.LayerNorm((4,))),
    ("LayerNorm-eps", ValueError, r"^eps: expected a finite number >= 0, got inf$", lambda: L.LayerNorm(4, math.inf)),
    ("LayerNorm-eps-type", TypeError, r"^eps: expected a real number, got str$", lambda: L.LayerNorm(4, "a")),
    ("Dropout-p", ValueError, r"^p: expected a probability in \[0, 1\), got 1.0$", lambda: L.Dropout(1.0)),
    ("FeedForward-activation", ValueError, r"^activation: expected 'relu' or 'gelu', got 'tanh'$",
     lambda: L.FeedForward(4, 8, activation="tanh")),
    ("AttentionPooling-hops", ValueError, r"^hops: expected an int >= 1, got 0$", lambda: L.AttentionPooling(4, 3, hops=0)),
    ("PositionalEmbedding-kind", ValueError, r"^kind: expected 'learned' or 'sinusoidal', got 'rope'$",
     lambda: L.PositionalEmbedding(8, 4, kind="rope")),
    ("TransformerEncoderLayer-dropout", ValueError, r"^dropout: expected a probability in \[0, 1\), got 1.0$",
     lambda: L.TransformerEncoderLayer(4, 2, 8, dropout=1.0)),
    ("TransformerEncoder-num_layers", ValueError, r"^num_layers: expected an int >= 1, got 0$",
     lambda: L.TransformerEncoder(_BLOCKS["TransformerEncoderLayer"], 0)),
    ("TransformerEncoderLayer-is_causal", TypeError, r"^is_causal: expected a bool, got str",
     lambda: _BLOCKS["TransformerEncoderLayer"](_T["x"], is_causal="yes")),
] + [
    (f"{cls.__name__}-{name}-{bad!r}", exc, match, lambda cls=cls, kw={name: bad}: cls(_FIT_MODEL, **kw))
    for cls in (O.SGD, O.Adam, O.AdamW)
    for name, bad, exc, match in [
        ("lr", -1, ValueError, r"^lr: expected a finite number >= 0, got -1$"),
        ("lr", math.nan, ValueError, r"^lr: expected a finite number >= 0, got nan$"),
        ("lr", "a", TypeError, r"^lr: expected a real number, got str 'a'$"),
        ("lr", np.array(0.1), TypeError, r"^lr: expected a real number, got array of shape \(\) and dtype float64$"),
        ("weight_decay", -1, ValueError, r"^weight_decay: expected a finite number >= 0, got -1$"),
        ("weight_decay", math.inf, ValueError, r"^weight_decay: expected a finite number >= 0, got inf$"),
    ]
] + [
    ("SGD-momentum", ValueError, r"^momentum: expected a finite number >= 0, got -1$",
     lambda: O.SGD(_FIT_MODEL, momentum=-1)),
    ("SGD-nesterov", ValueError, r"^nesterov: expected momentum > 0 and dampening == 0 with nesterov=True, got "
     r"momentum=0.0, dampening=0.0$", lambda: O.SGD(_FIT_MODEL, nesterov=True)),
    ("SGD-nesterov-type", TypeError, r"^nesterov: expected a bool, got int 1$",
     lambda: O.SGD(_FIT_MODEL, momentum=0.9, nesterov=1)),
] + [
    (f"{cls.__name__}-{name}-{bad!r}", exc, match, lambda cls=cls, kw={name: bad}: cls(_FIT_MODEL, **kw))
    for cls in (O.Adam, O.AdamW)
    for name, bad, exc, match in [
        ("betas", (1.0, 0.9), ValueError, r"^betas\[0\]: expected a number in \[0, 1\), got 1.0$"),
        ("betas", (0.9, -0.1), ValueError, r"^betas\[1\]: expected a number in \[0, 1\), got -0.1$"),
        ("betas", 0.9, TypeError, r"^betas: expected a pair \(beta1, beta2\), got float 0.9$"),
        ("betas", (0.9, 0.9, 0.9), TypeError, r"^betas: expected a pair \(beta1, beta2\), got tuple"),
        ("eps", -1, ValueError, r"^eps: expected a finite number >= 0, got -1$"),
        ("eps", math.nan, ValueError, r"^eps: expected a finite number >= 0, got nan$"),
        ("amsgrad", "yes", TypeError, r"^amsgrad: expected a bool, got str 'yes'$"),
    ]
] + [
    ("clip-max_norm", ValueError, r"^max_norm: expected a number >= 0, got -1.0$", lambda: O.clip_grad_norm(_FIT_MODEL, -1)),
    ("clip-max_norm-nan", ValueError, r"^max_norm: expected a number >= 0, got nan$",
     lambda: O.clip_grad_norm(_FIT_MODEL, math.nan)),
    ("clip-max_norm-type", TypeError, r"^max_norm: expected a real number, got NoneType None$",
     lambda: O.clip_grad_norm(_FIT_MODEL, None)),
    ("clip-norm_type", ValueError, r"^norm_type: expected a number > 0 or inf, got 0$",
     lambda: O.clip_grad_norm(_FIT_MODEL, 1.0, norm_type=0)),
]


@pytest.mark.parametrize("case", ROW24, ids=_ids(ROW24))
def test_row24_bad_options_and_hyperparameters(case):
    _run_cases(case)


@pytest.mark.parametrize("bad,exc,match", [
    ("a", TypeError, r"^layer_norm_eps: expected a real number, got str$"),
    (True, TypeError, r"^layer_norm_eps: expected a real number, got bool$"),
    (-1, ValueError, r"^layer_norm_eps: expected a finite number >= 0, got -1.0$"),
    (math.inf, ValueError, r"^layer_norm_eps: expected a finite number >= 0, got inf$"),
    (math.nan, ValueError, r"^layer_norm_eps: expected a finite number >= 0, got nan$"),
], ids=["str", "bool", "negative", "inf", "nan"])
def test_row24_transformer_layer_norm_eps(bad, exc, match):
    with pytest.raises(exc, match=match):
        L.TransformerEncoderLayer(4, 2, 8, layer_norm_eps=bad)


@pytest.mark.parametrize("config,got", [(None, "NoneType None"), ("abc", "str 'abc'"), (3, "int 3"),
                                        (L.TransformerEncoderLayer, r"the class TransformerEncoderLayer "
                                                                    r"\(not an instance of it\)")],
                         ids=["None", "abc", "3", "class"])
def test_row24_transformer_encoder_layer_config(config, got):
    with pytest.raises(TypeError, match=r"^layer_config: expected a TransformerEncoderLayer or its "
                                        rf"get_config\(\) dict, got {got}$"):
        L.TransformerEncoder(config, 1)


# ---------------------------------------------------------------- row 25: optimizer params in a wrong form
_W, _G = _T["w"], _T["b"]
ROW25 = [
    (lab, TypeError, r"^params: expected a model \(with named_parameters\(\) and named_grads\(\)\) or an iterable of "
     rf"\(name, param, grad\) triples, got {got}$", lambda p=p: O.SGD(p, lr=0.1))
    for lab, p, got in [("None", None, "NoneType"), ("dict", {"w": _W}, "dict"), ("array", _W, "ndarray"),
                        ("str", "w", "str"), ("class", L.Linear, r"the class Linear \(not an instance of it\)")]
] + [
    ("list-of-arrays", TypeError, r"^params\[0\]: expected a \(name, param, grad\) triple, got array of shape \(4,\)",
     lambda: O.SGD([_W])),
    ("pairs", TypeError, r"^params\[0\]: expected a \(name, param, grad\) triple, got tuple \('w', ",
     lambda: O.SGD([("w", _W)])),
    ("list-param", TypeError, r"^params\['w'\]: expected the parameter as a NumPy array \(updated in place\), got list",
     lambda: O.SGD([("w", [1.0], [0.0])])),
    ("name-not-str", TypeError, r"^params: expected parameter names \(str\), got int 1$", lambda: O.SGD([(1, _W, _G)])),
    ("duplicate-names", ValueError, r"^params: two parameters are named 'w'$",
     lambda: O.SGD([("w", _W, _G), ("w", _W.copy(), _G.copy())])),
    ("clip-params", TypeError, r"^params_or_model: expected a model .* got dict$", lambda: O.clip_grad_norm({}, 1.0)),
]


@pytest.mark.parametrize("case", ROW25, ids=_ids(ROW25))
def test_row25_optimizer_params_in_a_wrong_form(case):
    _run_cases(case)


# ---------------------------------------------------------------- row 26: checkpoint files, fit, bucket_batches
def _row26_cases(tmp_path):
    (tmp_path / "text").write_text("hello")
    np.savez(tmp_path / "plain.npz", a=np.ones(3))
    np.save(tmp_path / "array.npy", np.ones(3))
    good = tmp_path / "linear.ckpt"
    fastattn.save(L.Linear(4, 3, seed=0, dtype=np.float64), good)
    (tmp_path / "truncated").write_bytes(good.read_bytes()[:200])
    return [
        ("missing", FileNotFoundError, r"^checkpoint '.*nope': no such file$", lambda: fastattn.load(tmp_path / "nope")),
        ("directory", IsADirectoryError, r"^checkpoint '.*': expected a checkpoint file, got a directory$",
         lambda: fastattn.load(tmp_path)),
        ("text", ValueError, r"^checkpoint '.*text': not a fastattn checkpoint \(not an .npz archive",
         lambda: fastattn.load(tmp_path / "text")),
        ("plain-npz", ValueError, r"^checkpoint '.*plain.npz': not a fastattn checkpoint \(no '__fastattn__' entry; "
         r"entries \['a'\]\)$", lambda: fastattn.load(tmp_path / "plain.npz")),
        ("npy", ValueError, r"^checkpoint '.*array.npy': not a fastattn checkpoint \(a single .npy array",
         lambda: fastattn.load(tmp_path / "array.npy")),
        ("truncated", ValueError, r"^checkpoint '.*truncated': not a fastattn checkpoint",
         lambda: fastattn.load(tmp_path / "truncated")),
        ("path-type", TypeError, r"^path: expected a str, bytes or os.PathLike path or a binary file object, got int$",
         lambda: fastattn.load(3)),
        ("into-class", ValueError, r"^into: the checkpoint holds a Linear, got a LayerNorm$",
         lambda: fastattn.load(good, into=L.LayerNorm(4))),
        ("into-dtype", ValueError, r"^into: the Linear does not have the checkpoint's config: dtype: checkpoint "
         r"'float64', model 'float32'$", lambda: fastattn.load(good, into=L.Linear(4, 3, dtype=np.float32))),
        ("into-type", TypeError, r"^into: expected a layer of fastattn.layers or None, got object$",
         lambda: fastattn.load(good, into=object())),
        ("save-model", TypeError, r"^model: expected a layer of fastattn.layers \(", lambda: fastattn.save({}, tmp_path / "x")),
        ("save-missing-dir", FileNotFoundError, r"^path: expected a file in an existing directory",
         lambda: fastattn.save(_FIT_MODEL, tmp_path / "no" / "x")),
    ]


@pytest.mark.parametrize("i", range(12))
def test_row26_checkpoint_files(i, tmp_path):
    cases = _row26_cases(tmp_path)
    assert len(cases) == 12
    before = sorted(p.name for p in tmp_path.iterdir())
    _run_cases(cases[i], dict(w=_FIT_MODEL.parameters()["weight"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == before    # nothing written


_BATCHES = [(_T["x"][0, :4], np.array([0, 1, 2, 0]))]   # one (4, 4) batch of features, 4 labels
ROW26 = [
    ("fit-epochs-0", ValueError, r"^epochs: expected an integer >= 1, got 0$",
     lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), _BATCHES, epochs=0, progress=False)),
    ("fit-epochs-float", TypeError, r"^epochs: expected an integer, got float 1.5$",
     lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), _BATCHES, epochs=1.5, progress=False)),
    ("fit-epochs-bool", TypeError, r"^epochs: expected an integer, got bool True$",
     lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), _BATCHES, epochs=True, progress=False)),
    ("fit-batches-None", TypeError, r"^batches: expected a sequence or iterable of batches, or a callable "
     r"batches\(epoch\), got NoneType None$",
     lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), None, epochs=1, progress=False)),
    ("fit-batches-iterator", TypeError, r"^batches: a one-shot iterator \(list_iterator\) cannot be replayed for "
     r"epochs=2", lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), iter(_BATCHES), epochs=2, progress=False)),
    ("fit-batches-callable", TypeError, r"^batches: expected batches\(0\) to return an iterable of batches, got "
     r"NoneType None$", lambda: T.fit(_FIT_MODEL, _fit_loss, O.SGD(_FIT_MODEL), lambda e: None, epochs=1,
                                      progress=False)),
    ("fit-loss", TypeError, r"^loss_fn \(step 0\): expected a real number, got str 'x'$",
     lambda: T.fit(_FIT_MODEL, lambda m, b: "x", O.SGD(_FIT_MODEL), _BATCHES, epochs=1, progress=False)),
    ("fit-optimizer", TypeError, r"^optimizer: expected an object with step\(\), zero_grad\(\)",
     lambda: T.fit(_FIT_MODEL, _fit_loss, None, _BATCHES, epochs=1, progress=False)),
    ("bucket-batch_size", ValueError, r"^batch_size: expected an integer >= 1, got 0$",
     lambda: T.bucket_batches([[1]], batch_size=0)),
    ("bucket-batch_size-type", TypeError, r"^batch_size: expected an integer, got float 1.5$",
     lambda: T.bucket_batches([[1]], batch_size=1.5)),
    ("bucket-bucket_size", ValueError, r"^bucket_size: expected an integer >= batch_size \(2\), got 1$",
     lambda: T.bucket_batches([[1]], batch_size=2, bucket_size=1)),
    ("bucket-seqs", TypeError, r"^seqs: expected a sequence of integer id sequences, got str 'abc'$",
     lambda: T.bucket_batches("abc", batch_size=2)),
    ("bucket-pad_id", ValueError, r"^pad_id: expected an int64 id \(< 2\*\*63\), got 18446744073709551616$",
     lambda: T.bucket_batches([[1]], batch_size=2, pad_id=2 ** 64)),
    ("bucket-uint64-ids", ValueError, r"^seqs\[0\]: expected int64 ids \(< 2\*\*63\)",
     lambda: T.bucket_batches([np.array([2 ** 63], np.uint64)], batch_size=2)),
]


@pytest.mark.parametrize("case", ROW26, ids=_ids(ROW26))
def test_row26_fit_and_bucket_batches(case):
    params = {k: v.copy() for k, v in _FIT_MODEL.parameters().items()}
    _run_cases(case)
    for k, v in _FIT_MODEL.parameters().items():     # no step was taken
        np.testing.assert_array_equal(v, params[k], err_msg=k)
