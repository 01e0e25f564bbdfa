"""Regression tests for the bugs the bad-input table (docs/bad_input.md) exposed.

One test (or group) per fix; the table's rows themselves are in
tests/api/test_bad_input.py.
"""
from __future__ import annotations

import math
import re

import numpy as np
import pytest

import fastattn
from fastattn import functional as F
from fastattn import layers as L


# -------------------------------------------------- RNN layers, B = 0 or T = 0

@pytest.mark.parametrize("cls", [L.SimpleRNN, L.GRU, L.LSTM])
@pytest.mark.parametrize("shape", [(0, 3, 8), (2, 0, 8)], ids=["B0", "T0"])
def test_rnn_layer_empty_batch_or_sequence(cls, shape):
    """x.reshape(B * T, -1) cannot infer -1 from 0 elements: the layers raised
    NumPy's 'cannot reshape array of size 0' instead of returning empty outputs."""
    layer = cls(8, 4, num_layers=2, bidirectional=True, seed=0)
    x = np.zeros(shape, np.float32)
    out, state = layer(x)
    h = state[0] if isinstance(state, tuple) else state
    assert out.shape == shape[:2] + (8,) and out.dtype == np.float32
    assert h.shape == (4, shape[0], 4)
    np.testing.assert_array_equal(h, 0)  # T = 0: the initial (zero) state


def test_encoder_and_seq2seq_empty_source():
    enc = L.RNNEncoder(10, 4, 6, seed=0)
    out, final, mask = enc(np.zeros((2, 0), np.int64))
    assert out.shape == (2, 0, 6) and final.shape == (1, 2, 6) and mask.shape == (2, 0)
    out, final, mask = enc(np.zeros((0, 3), np.int64))
    assert out.shape == (0, 3, 6) and mask.shape == (0, 3)
    s2s = L.Seq2Seq(enc, L.AttentionDecoder(10, 4, 6, 6, seed=0), bos_id=1, eos_id=2)
    tokens, lengths, scores, align = s2s.greedy_decode(np.zeros((2, 0), np.int64), max_len=3)
    assert tokens.shape == (2, 3) and align.shape == (2, 3, 0)


# ------------------------------------- ragged lists name their parameter

RAGGED = [[1.0], [1.0, 2.0]]


@pytest.mark.parametrize("name,call", [
    ("x", lambda: F.linear(RAGGED, np.ones((5, 2)))),
    ("weight", lambda: F.linear(np.ones((3, 2)), RAGGED)),
    ("bias", lambda: F.linear(np.ones((3, 2)), np.ones((2, 2)), RAGGED)),
    ("xw", lambda: F.rnn_scan([RAGGED, RAGGED], np.ones((3, 1)), None, np.ones((2, 1)))),
    ("lengths", lambda: F.rnn_scan(np.ones((2, 3, 3)), np.ones((3, 1)), None, np.ones((2, 1)),
                                   lengths=RAGGED)),
    ("x", lambda: F.rnn_cell(RAGGED, np.ones((2, 1)), np.ones((3, 1)), None, np.ones((3, 1)), None)),
    (r"state_dict\['weight_ih_l0'\]", lambda: L.GRU.from_torch({"weight_ih_l0": RAGGED,
                                                                "weight_hh_l0": np.zeros((3, 1))})),
])
def test_ragged_lists_name_the_parameter(name, call):
    """linear / rnn_scan / rnn_cell / RNN.from_torch let NumPy's 'setting an array
    element with a sequence' ValueError through, naming no parameter."""
    with pytest.raises(TypeError, match=rf"^{name}: expected an array"):
        call()


@pytest.mark.parametrize("cls", [L.SimpleRNN, L.GRU, L.LSTM])
def test_rnn_from_torch_non_2d_weight(cls):
    """A 1-d weight_ih_l0 raised 'not enough values to unpack (expected 2, got 1)'."""
    with pytest.raises(ValueError, match=r"state_dict\['weight_ih_l0'\]: expected a 2-d .* got shape \(12,\)"):
        cls.from_torch({"weight_ih_l0": np.zeros(12), "weight_hh_l0": np.zeros((12, 1))})


# --------------------------------------------------- non-finite scale

def _mha_kw(E=8):
    rng = np.random.default_rng(0)
    return dict(num_heads=2, w_qkv=rng.standard_normal((3 * E, E)), w_out=rng.standard_normal((E, E)))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -np.inf, np.float32("nan")])
@pytest.mark.parametrize("fn", ["sdpa", "sdpa_masked", "explain", "multi_head_attention"])
def test_non_finite_scale_raises(fn, bad):
    """scale=nan/inf made every output NaN (sdpa, multi_head_attention) while
    attention(similarity='scaled_dot', params={'scale': nan}) raised: now all raise."""
    x = np.random.default_rng(1).standard_normal((2, 5, 8))
    calls = {
        "sdpa": lambda: fastattn.scaled_dot_product_attention(x, x, x, scale=bad),
        "sdpa_masked": lambda: fastattn.scaled_dot_product_attention(x, x, x, np.ones((5, 5), bool), scale=bad),
        "explain": lambda: fastattn.explain(x, x, x, scale=bad),
        "multi_head_attention": lambda: fastattn.multi_head_attention(x, x, x, scale=bad, **_mha_kw()),
    }
    with pytest.raises(ValueError, match=r"^scale: expected a finite real number, got (nan|inf|-inf)"):
        calls[fn]()
    with pytest.raises(ValueError, match=r"params\['scale'\]: contains NaN or infinite values"):
        fastattn.attention(x, x, x, "scaled_dot", params={"scale": bad})


# ------------------------------- MultiHeadAttention state dicts with NaN / inf

@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_mha_load_state_dict_refuses_non_finite(bad):
    """Every other layer's load_state_dict refused NaN / inf weights; the
    multi-head layer loaded them (and from_torch with it)."""
    m = L.MultiHeadAttention(8, 2, seed=0)
    before = m.state_dict()
    sd = m.state_dict()
    sd["out_proj.weight"][1, 2] = bad
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.weight'\]: contains NaN or infinite values"):
        m.load_state_dict(sd)
    for k, v in m.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.weight'\]: contains NaN or infinite values"):
        L.MultiHeadAttention.from_torch(sd, num_heads=2)


# ------------------------ Attention layers: a mask with more dims than the input

@pytest.mark.parametrize("layer", ["Attention", "SelfAttention"])
@pytest.mark.parametrize("batched", [True, False])
def test_attention_layer_mask_with_extra_dims(layer, batched):
    """A (2, B, Lq, Lk) mask on (B, Lq, E) inputs was broadcast by F.attention
    into an extra output dim: the layer returned (2, B, Lq, out_dim) instead of
    the documented (B, Lq, out_dim)."""
    x = np.random.default_rng(0).standard_normal((2, 3, 8) if batched else (3, 8))
    mod = L.Attention(8, seed=0) if layer == "Attention" else L.SelfAttention(8, seed=0)
    m = np.ones((2,) + x.shape[:-1] + (3,), bool)
    want = "(B, Lq, Lk) = (2, 3, 3)" if batched else "(Lq, Lk) = (3, 3)"
    with pytest.raises(ValueError, match=rf"^attn_mask: expected at most {x.ndim} dims, .*"
                                         + re.escape(f"{want}, got shape {m.shape}")):
        mod(x, attn_mask=m)
    assert mod(x, attn_mask=m[0]).shape == x.shape  # as many dims as the input: fine


# ------------------------------------------ layers: bool inputs, rank message

@pytest.mark.parametrize("call", [
    lambda x: L.Linear(8, 5, seed=0)(x),
    lambda x: L.GRU(8, 4, seed=0)(x)[0],
    lambda x: L.LSTM(8, 4, seed=0).step(x[:, 0])[0],
    lambda x: L.Attention(8, seed=0)(x),
    lambda x: L.SelfAttention(8, seed=0)(x),
], ids=["Linear", "GRU", "LSTM.step", "Attention", "SelfAttention"])
def test_layers_accept_bool_inputs_like_ints(call):
    """Layers refused bool inputs ('expected real numbers') while taking ints,
    and while the functional ops and MultiHeadAttention take both: bool is
    now computed like the integers, in float64."""
    xb = np.random.default_rng(0).random((2, 3, 8)) < 0.5
    got = call(xb)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, call(xb.astype(np.int64)))
    np.testing.assert_array_equal(got, call(xb.astype(np.float64)))


def test_layer_rank_message_is_short():
    with pytest.raises(ValueError, match=r"^x: expected a 1-d to 32-d array, got 0-d array of shape \(\)$"):
        L.Linear(8, 5)(np.float64(1.0))


# ----------------------------------------- init_params with zero-size dims

@pytest.mark.parametrize("name,dims", [("general", {}), ("additive", {"d_a": 0}), ("concat", {"d_a": 2})])
def test_init_params_zero_size(name, dims):
    """Glorot's limit sqrt(6 / fan) raised ZeroDivisionError for a (0, 0) matrix."""
    p = fastattn.get_similarity(name).init_params(0, 0, rng=0, **dims)
    q, k, v = np.zeros((2, 3, 0)), np.zeros((2, 4, 0)), np.ones((2, 4, 5))
    o = fastattn.attention(q, k, v, name, params=p)
    np.testing.assert_allclose(o, np.ones((2, 3, 5)))  # all scores equal: the mean of v


# ------------- a plugin's NaN scores caused by NaN inputs: the message says so

class _NumpyDot(fastattn.Similarity):
    name = "bad_input_numpy_dot"

    def score(self, query, key, params):
        return query @ np.swapaxes(key, -1, -2)


@pytest.mark.parametrize("kind", ["numpy", "compiled"])
@pytest.mark.parametrize("where", ["query", "key"])
def test_plugin_nan_scores_name_the_nonfinite_input(kind, where):
    """A plugin turning a NaN input into NaN scores was told 'score returned NaN'
    with nothing pointing at the input; the message now names it."""
    import fastattn.testing

    sim = _NumpyDot() if kind == "numpy" else fastattn.testing.selftest_similarity()
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((2, 3, 4)), rng.standard_normal((2, 5, 4)), rng.standard_normal((2, 5, 2))
    (q if where == "query" else k)[1, 2, 0] = np.nan
    with pytest.raises(ValueError, match=rf"score returned NaN or \+inf values .*; {where} contains NaN "
                                         r"or infinite values"):
        fastattn.attention(q, k, v, sim)
    with pytest.raises(ValueError, match=rf"; {where} contains NaN"):
        F.PreparedAttention(k, v, sim)(q)
    # a plugin writing NaN into finite inputs' scores is still blamed alone
    with pytest.raises(ValueError, match=r"score returned NaN or \+inf values \(only -inf, 'may not attend', is allowed\)$"):
        fastattn.attention(np.nan_to_num(q), np.nan_to_num(k), v, fastattn.testing.selftest_similarity(),
                           params={"mode": 2.0})


def test_self_attention_errors_name_x():
    """SelfAttention.forward(x) reported bad inputs as 'query' (its parent's name)."""
    layer = L.SelfAttention(4, seed=0)
    with pytest.raises(ValueError, match=r"^x: expected last dim 4, got shape \(2, 3, 5\)"):
        layer(np.zeros((2, 3, 5)))
    with pytest.raises(ValueError, match=r"^x: expected a 2-d or 3-d array"):
        layer(np.zeros(4))
    with pytest.raises(TypeError, match=r"^x: expected real numbers"):
        layer(np.zeros((3, 4), complex))


# -------------------------------------------------- the training API

def test_optimizer_given_a_layer_class():
    """A layer class (not an instance) has named_parameters() unbound: SGD(L.Linear)
    raised "Layer.named_parameters() missing 1 required positional argument"."""
    from fastattn import optim
    with pytest.raises(TypeError, match=r"^params: expected a model .* got the class Linear "
                                        r"\(not an instance of it\)$"):
        optim.SGD(L.Linear, lr=0.1)
    with pytest.raises(TypeError, match=r"^params_or_model: expected a model .* got the class Linear"):
        optim.clip_grad_norm(L.Linear, 1.0)


def test_checkpoint_paths_that_are_directories_or_in_missing_directories(tmp_path):
    """load(a directory) raised a bare "[Errno 21] Is a directory"; save into a
    missing directory named the hidden temporary file ('.x.npz.1a2b3c4d.tmp')."""
    model = L.Linear(2, 2, seed=0)
    with pytest.raises(IsADirectoryError, match=r"^checkpoint '.*': expected a checkpoint file, got a directory$"):
        fastattn.load(tmp_path)
    with pytest.raises(IsADirectoryError, match=r"^path: expected a file name, got the directory '.*'$"):
        fastattn.save(model, tmp_path)
    missing = tmp_path / "no" / "x.npz"
    with pytest.raises(FileNotFoundError, match=r"^path: expected a file in an existing directory, got "
                                                r"'.*x\.npz' \(no directory '.*no'\)$"):
        fastattn.save(model, missing)
    assert list(tmp_path.iterdir()) == []     # no temporary file left behind


def test_bucket_batches_uint64_ids_beyond_int64():
    """uint64 ids >= 2**63 were wrapped to negative int64 ids by astype."""
    from fastattn.train import bucket_batches
    seqs = [np.array([1, 2 ** 63 + 1], dtype=np.uint64)]
    with pytest.raises(ValueError, match=r"^seqs\[0\]: expected int64 ids \(< 2\*\*63\), got 9223372036854775809$"):
        bucket_batches(seqs, batch_size=2)
    ids, mask, _ = bucket_batches([np.array([1, 2], dtype=np.uint64)], batch_size=2)[0]
    np.testing.assert_array_equal(ids, [[1, 2]])


@pytest.mark.parametrize("shape", [(0, 5, 4), (2, 0, 4), (0, 4)], ids=["B0", "L0", "unbatched-L0"])
def test_multi_head_attention_backward_with_zero_batch_or_length(shape):
    """The input gradients were reshaped to (B, L, -1): NumPy cannot infer -1 from
    0 elements ("cannot reshape array of size 0"), so MultiHeadAttention's and
    TransformerEncoderLayer's backprop failed for B = 0 or L = 0."""
    layer = L.MultiHeadAttention(4, 2, seed=0, dtype=np.float64)
    x = np.zeros(shape)
    out, backprop = layer.forward_backward(x, x, x)
    grads = backprop(np.zeros(out.shape))
    assert [g.shape for g in grads] == [shape] * 3
    enc = L.TransformerEncoderLayer(4, 2, 6, dropout=0.0, seed=0, dtype=np.float64)
    out, backprop = enc.forward_backward(x)
    assert backprop(np.zeros(out.shape))[0].shape == shape


def _raises(exc, match, call, *inputs):
    """``call()`` raises ``exc`` matching ``match`` (from the start); ``inputs`` unchanged."""
    assert match.startswith("^"), match
    saved = [np.array(a, copy=True) for a in inputs]
    with pytest.raises(exc, match=match):
        call()
    for a, s in zip(inputs, saved):
        np.testing.assert_array_equal(a, s)


# -------------------------------------------------- the transformer blocks' names

@pytest.mark.parametrize("make", [
    lambda: L.TransformerEncoderLayer(4, 2, 6, dropout=0.0, seed=0),
    lambda: L.TransformerEncoder(L.TransformerEncoderLayer(4, 2, 6, dropout=0.0, seed=0), 2, norm=True)],
    ids=["layer", "encoder"])
def test_transformer_errors_name_x(make):
    """TransformerEncoderLayer / TransformerEncoder passed x on unchecked: a bad x was
    reported by MultiHeadAttention as 'query'."""
    layer = make()
    x0, x1, x5, xc = np.float64(1.0), np.ones(4), np.ones((2, 3, 5)), np.ones((2, 3, 4), complex)
    _raises(ValueError, r"^x: expected a 2-d or 3-d array, got 0-d array of shape \(\)$", lambda: layer(x0))
    _raises(ValueError, r"^x: expected a 2-d or 3-d array, got 1-d array of shape \(4,\)$",
            lambda: layer.forward_backward(x1), x1)
    _raises(ValueError, r"^x: expected last dim 4, got shape \(2, 3, 5\)$", lambda: layer(x5), x5)
    _raises(TypeError, r"^x: expected real numbers \(float32/float64\), got dtype complex128$",
            lambda: layer.forward_backward(xc), xc)
    _raises(TypeError, r"^x: expected an array of real numbers, got list", lambda: layer([[1.0] * 4, [1.0]]))
    assert layer(np.ones((3, 4))).shape == (3, 4)       # unbatched (L, E), as torch


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(d_model=4, nhead=3), ValueError, r"^nhead: expected a divisor of d_model=4, got 3$"),
    (dict(d_model=0, nhead=1), ValueError, r"^d_model: expected an int >= 1, got 0$"),
    (dict(d_model=4.0, nhead=2), TypeError, r"^d_model: expected an int >= 1, got float 4.0$"),
    (dict(d_model=4, nhead=0), ValueError, r"^nhead: expected an int >= 1, got 0$"),
    (dict(d_model=4, nhead=2, dim_feedforward="8"), TypeError, r"^dim_feedforward: expected an int >= 1, "
                                                                r"got str '8'$"),
    (dict(d_model=4, nhead=2, dropout="0.1"), TypeError, r"^dropout: expected a probability \(a real number\), "
                                                         r"got str '0.1'$"),
    (dict(d_model=4, nhead=2, dropout=-0.1), ValueError, r"^dropout: expected a probability in \[0, 1\), got -0.1$"),
    (dict(d_model=4, nhead=2, activation="tanh"), ValueError, r"^activation: expected 'relu' or 'gelu', got 'tanh'$"),
    (dict(d_model=4, nhead=2, activation=None), TypeError, r"^activation: expected 'relu' or 'gelu', got NoneType None$"),
    (dict(d_model=4, nhead=2, activation=np.array(["relu", "gelu"])), TypeError,
     r"^activation: expected 'relu' or 'gelu', got ndarray"),
    (dict(d_model=4, nhead=2, layer_norm_eps="a"), TypeError, r"^layer_norm_eps: expected a real number, got str$"),
    (dict(d_model=4, nhead=2, layer_norm_eps=-1), ValueError, r"^layer_norm_eps: expected a finite number >= 0, "
                                                              r"got -1.0$"),
    (dict(d_model=4, nhead=2, norm_first=1), TypeError, r"^norm_first: expected a bool, got int 1$"),
    (dict(d_model=4, nhead=2, bias="yes"), TypeError, r"^bias: expected a bool, got str 'yes'$"),
    (dict(d_model=4, nhead=2, dtype=np.float16), TypeError, r"^dtype: expected float32 or float64, got float16$"),
    (dict(d_model=4, nhead=2, seed="abc"), TypeError, r"^seed: expected None, an int or a np.random.Generator, "
                                                      r"got str$"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_transformer_encoder_layer_constructor_names_its_arguments(kwargs, exc, match):
    """layer_norm_eps='a' raised float()'s bare message and -1 was reported as 'eps'
    (LayerNorm's name); TransformerEncoderLayer(4, 3) as 'num_heads: expected a
    divisor of embed_dim' (MultiHeadAttention's names); seed='abc' as NumPy's."""
    _raises(exc, match, lambda: L.TransformerEncoderLayer(**kwargs))
    if len(kwargs) > 2 and "seed" not in kwargs:   # from a config dict: the same messages (its seed
        # is replaced by the encoder's)
        _raises(exc, match, lambda: L.TransformerEncoder(kwargs, 1))


@pytest.mark.parametrize("config,exc,match", [
    (None, TypeError, r"^layer_config: expected a TransformerEncoderLayer or its get_config\(\) dict, "
                      r"got NoneType None$"),
    ("abc", TypeError, r"^layer_config: expected a TransformerEncoderLayer or its get_config\(\) dict, "
                       r"got str 'abc'$"),
    ([("d_model", 4), ("nhead", 2)], TypeError, r"^layer_config: expected a TransformerEncoderLayer or its "
                                                r"get_config\(\) dict, got list"),
    ({"d_model": 4}, ValueError, r"^layer_config: missing required key 'nhead'$"),
    ({"d_model": 4, "nhead": 2, "heads": 2}, ValueError, r"^layer_config: unknown keys \['heads'\]; expected some of"),
    ({"d_model": 4, "nhead": 3}, ValueError, r"^nhead: expected a divisor of d_model=4, got 3$"),
], ids=["None", "str", "list", "missing", "unknown", "nhead"])
def test_transformer_encoder_layer_config(config, exc, match):
    """TransformerEncoder(None / 'abc', n) raised dict()'s bare TypeError / ValueError."""
    _raises(exc, match, lambda: L.TransformerEncoder(config, 2))
    enc = L.TransformerEncoder({"d_model": 4, "nhead": 2, "dim_feedforward": 6}, 2, seed=0)
    assert enc.get_config()["layer_config"]["dim_feedforward"] == 6


# -------------------------------------------------- blocks: empty sizes, grad_out

@pytest.mark.parametrize("shape", [(0, 5, 4), (2, 0, 4), (0, 0, 4)], ids=["B0", "L0", "B0-L0"])
@pytest.mark.parametrize("flatten", [True, False])
def test_attention_pooling_with_zero_batch_or_length(shape, flatten):
    """B = 0 raised NumPy's 'cannot reshape array of size 0' (reshape(B, -1)),
    L = 0 'zero-size array to reduction operation maximum' (the softmax's max)."""
    layer = L.AttentionPooling(4, 3, hops=2, flatten=flatten, seed=0)
    x = np.zeros(shape, np.float32)
    mask = np.zeros(shape[:2], bool)
    want = (shape[0], 8) if flatten else (shape[0], 2, 4)
    for m in (None, mask):
        out, a = layer(x, m, return_weights=True)
        assert out.shape == want and out.dtype == np.float32 and a.shape == (shape[0], 2, shape[1])
        np.testing.assert_array_equal(out, 0.0)
        layer.zero_grad()
        (out, _), backprop = layer.forward_backward(x, m, penalty=0.5)
        dx, none = backprop(np.ones(want, np.float32))
        assert dx.shape == shape and dx.dtype == np.float32 and none is None
        for g in layer.grads.values():
            np.testing.assert_array_equal(g, 0.0)
    np.testing.assert_array_equal(x, 0.0)


@pytest.mark.parametrize("kind", ["learned", "sinusoidal"])
@pytest.mark.parametrize("shape", [(2, 0, 4), (0, 3, 4), (0, 4)], ids=["L0", "B0", "unbatched-L0"])
def test_positional_embedding_backprop_with_zero_length(kind, shape):
    """grad_out.reshape(-1, L, E) cannot infer -1 from 0 elements."""
    layer = L.PositionalEmbedding(8, 4, kind=kind, seed=0, dtype=np.float64)
    layer.zero_grad()
    out, backprop = layer.forward_backward(np.zeros(shape))
    assert out.shape == shape
    (dx,) = backprop(np.zeros(shape))
    assert dx.shape == shape
    for g in layer.grads.values():
        np.testing.assert_array_equal(g, 0.0)


_POOL_AND_PE = {
    "PositionalEmbedding": lambda: L.PositionalEmbedding(8, 4, seed=0, dtype=np.float64),
    "MeanPooling": lambda: L.MeanPooling(),
    "AttentionPooling": lambda: L.AttentionPooling(4, 3, hops=2, seed=0, dtype=np.float64),
}


@pytest.mark.parametrize("name", list(_POOL_AND_PE))
def test_block_backprops_check_grad_out_and_never_return_it(name):
    """The backprops of PositionalEmbedding, MeanPooling and AttentionPooling took an
    integer grad_out (PositionalEmbedding then returned an int64 dx: the caller's
    grad_out array itself)."""
    layer = _POOL_AND_PE[name]()
    x = np.random.default_rng(0).standard_normal((2, 5, 4))
    out, backprop = layer.forward_backward(x)
    o = out[0] if isinstance(out, tuple) else out
    gi, gb, gc = np.ones(o.shape, np.int64), np.ones(o.shape, bool), np.ones(o.shape, complex)
    for bad, dt in ((gi, "int64"), (gb, "bool"), (gc, "complex128")):
        _raises(TypeError, rf"^grad_out: expected a real floating array \(float16, float32 or float64\), "
                           rf"got dtype {dt}$", lambda: backprop(bad), bad, x)
    _raises(ValueError, rf"^grad_out: expected shape {re.escape(str(o.shape))}, got \(3, 3\)$",
            lambda: backprop(np.ones((3, 3))))
    for dt in (np.float16, np.float32, np.float64):
        g = np.ones(o.shape, dt)
        g0 = g.copy()
        dx = backprop(g)[0]
        assert dx is not g and not np.shares_memory(dx, g)
        assert dx.dtype == np.float64 and dx.shape == x.shape     # x's dtype
        np.testing.assert_array_equal(g, g0)
        dx[...] = 7.0                                             # writing dx leaves grad_out alone
        np.testing.assert_array_equal(g, g0)


@pytest.mark.parametrize("eps,exc,match", [
    (math.inf, ValueError, r"^eps: expected a finite number >= 0, got inf$"),
    (math.nan, ValueError, r"^eps: expected a finite number >= 0, got nan$"),
    (-1, ValueError, r"^eps: expected a finite number >= 0, got -1.0$"),
    ("a", TypeError, r"^eps: expected a real number, got str$"),
    (None, TypeError, r"^eps: expected a real number, got NoneType$"),
    (True, TypeError, r"^eps: expected a real number, got bool$"),
], ids=["inf", "nan", "negative", "str", "None", "bool"])
def test_layer_norm_layer_checks_eps_at_construction(eps, exc, match):
    """LayerNorm(4, inf) was accepted and failed on the first call (functional.layer_norm's
    check); eps='a' raised ValueError instead of TypeError."""
    _raises(exc, match, lambda: L.LayerNorm(4, eps))
    assert L.LayerNorm(4, np.float32(0.5)).get_config()["eps"] == 0.5
    assert L.LayerNorm(4, np.int64(0)).get_config()["eps"] == 0.0


# -------------------------------------------------- norm / act: 0-d, dtypes, warnings

def _zero_d_calls(x):
    g = np.ones((), x.dtype if x.dtype.kind == "f" else np.float64)
    return {
        "gelu": lambda: F.gelu(x), "gelu-tanh": lambda: F.gelu(x, approximate="tanh"),
        "relu": lambda: F.relu(x), "dropout": lambda: F.dropout(x, 0.5, rng=np.random.default_rng(0))[0],
        "gelu_backward": lambda: F.gelu_backward(g, x), "relu_backward": lambda: F.relu_backward(g, x),
        "dropout_backward": lambda: F.dropout_backward(g, np.array(True), 0.5),
    }


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64, np.bool_])
def test_elementwise_ops_return_0d_arrays_for_0d_input(dtype):
    """gelu, relu, dropout (float16) and their backwards returned NumPy scalars for a
    0-d input (a ufunc on 0-d arrays returns a scalar)."""
    x = np.array(1.5).astype(dtype)
    x0 = x.copy()
    for name, call in _zero_d_calls(x).items():
        y = call()
        assert type(y) is np.ndarray and y.shape == (), (name, type(y))
        assert y.dtype == (x.dtype if x.dtype.kind == "f" else np.float64), name
    np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("xdt", [np.float16, np.float32, np.float64, np.int64])
@pytest.mark.parametrize("gdt", [np.float16, np.float32, np.float64])
def test_relu_backward_dtype_follows_x_as_gelu_backward(xdt, gdt):
    """relu_backward returned grad_out's dtype (a float16 gradient of a float64 x);
    gelu_backward returns x's (float64 for integer x)."""
    x = np.array([[-1, 2, 0], [3, -4, 5]], dtype=xdt)
    g = np.arange(6, dtype=gdt).reshape(2, 3)
    x0, g0 = x.copy(), g.copy()
    want = np.dtype(xdt) if np.dtype(xdt).kind == "f" else np.dtype(np.float64)
    got = F.relu_backward(g, x)
    assert got.dtype == want == F.gelu_backward(g, x).dtype
    np.testing.assert_array_equal(got, np.where(x <= 0, 0, g).astype(want))
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(g, g0)


def test_gelu_float16_follows_the_float16_rule():
    """gelu returned float32 for float16 input, where relu and dropout return float16
    (docs/bad_input.md row 5: computed in float32 or wider, float16 when every argument is)."""
    x = np.linspace(-4, 4, 17).astype(np.float16)
    x0 = x.copy()
    for approximate in ("none", "tanh"):
        y = F.gelu(x, approximate=approximate)
        assert y.dtype == np.float16
        np.testing.assert_array_equal(y, F.gelu(x.astype(np.float64), approximate=approximate)
                                      .astype(np.float16))   # rounded once
        assert F.gelu_backward(np.ones(17, np.float16), x, approximate=approximate).dtype == np.float16
    assert F.relu(x).dtype == F.dropout(x, 0.5, rng=np.random.default_rng(0))[0].dtype == np.float16
    assert F.gelu(x.astype(np.float32)).dtype == np.float32 and F.gelu(x.astype(np.int8)).dtype == np.float64
    np.testing.assert_array_equal(x, x0)


@pytest.mark.filterwarnings("error::RuntimeWarning")
@pytest.mark.parametrize("case", ["E0", "inf-x", "inf-grad", "float16-overflow"])
def test_layer_norm_and_gelu_emit_no_runtime_warnings(case):
    """NaN / inf (and E = 0) propagate as documented without NumPy's RuntimeWarnings."""
    if case == "E0":
        x, g, w = np.zeros((2, 0)), np.zeros((2, 0)), np.ones(0)
    elif case == "inf-x":
        x = np.array([[np.inf, 1.0, 2.0], [-np.inf, np.inf, 0.0], [1.0, 2.0, 4.0]])
        g, w = np.ones((3, 3)), np.ones(3)
    elif case == "inf-grad":
        x = np.arange(12.0).reshape(4, 3)
        g, w = np.ones((4, 3)), np.ones(3)
        g[0, 0], g[3, 0] = np.inf, -np.inf      # inf - inf in dbias's sum
    else:
        x = np.array([[1, 2, 3], [4, 5, 6]], np.float16)
        g, w = np.full((2, 3), 6e4, np.float16), np.full(3, 6e4, np.float16)
    saved = [a.copy() for a in (x, g, w)]
    y = F.layer_norm(x, w, w)
    dx, dw, db = F.layer_norm_backward(g, x, w, w)
    assert y.shape == dx.shape == x.shape and dw.shape == db.shape == w.shape
    if case == "inf-x":
        assert np.isnan(y[:2]).all() and np.isfinite(y[2]).all()
    F.gelu(x), F.gelu_backward(g, x), F.gelu(x, approximate="tanh"), F.gelu_backward(g, x, approximate="tanh")
    for a, s in zip((x, g, w), saved):
        np.testing.assert_array_equal(a, s)
