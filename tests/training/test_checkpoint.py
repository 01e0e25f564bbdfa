"""Checkpoints: ``fastattn._checkpoint.save(model, path)`` / ``load(path)``.

Every public layer class round-trips exactly (parameters bit for bit, config,
outputs), in float32 and float64; tampered and foreign files are refused with
clear errors and never run code; save leaves the model alone; ``load(path,
into=model)`` refills an existing layer.
"""
from __future__ import annotations

import io
import json
import os
import pathlib
import pickle
import zipfile

import numpy as np
import pytest

import fastattn
import fastattn.layers as L
from fastattn._checkpoint import FORMAT_VERSION, load, save
from fastattn.layers._base import Layer
from fastattn.similarity import BUILTINS as BUILTIN_SIMILARITIES, ParamSpec, Similarity

HEADER = "__fastattn__"
DTYPES = [np.float32, np.float64]


# ------------------------------------------------------------------ builders
# name -> (build(dtype), run(model, rng) -> tuple of outputs).  Each run draws
# its inputs from the rng it is given, so two models run on equal inputs.

def _rnn_run(m, rng):
    x = rng.standard_normal((2, 5, m.input_size))
    out, state = m(x, lengths=np.array([5, 3]))
    return (out, *(state if isinstance(state, tuple) else (state,)))


def _encoder_run(m, rng):
    src = rng.integers(0, m._config["vocab_size"], (2, 6))
    out, final, mask = m(src, lengths=np.array([6, 4]))
    return (out, *(final if isinstance(final, tuple) else (final,)), mask)


def _attention_run(m, rng):
    c = m._dims
    q = rng.standard_normal((2, 3, c["query_dim"]))
    k = rng.standard_normal((2, 4, c["key_dim"]))
    v = rng.standard_normal((2, 4, c["value_dim"]))
    return m(q, k, v, key_mask=np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool), return_weights=True)


def _self_attention_run(m, rng):
    return m(rng.standard_normal((2, 5, m._dims["query_dim"])), return_weights=True)


def _mha_run(m, rng):
    q = rng.standard_normal((2, 3, m.embed_dim))
    k = rng.standard_normal((2, 4, m.kdim))
    v = rng.standard_normal((2, 4, m.vdim))
    out, w = m(q, k, v, return_weights=True, average_weights=False)
    return out, w, m(q, is_causal=True) if m.packed else m(q, k, v, is_causal=True)


def _decoder_run(m, rng):
    mem = m.precompute(rng.standard_normal((2, 4, m.memory_dim)),
                       np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool))
    tgt = rng.integers(0, m.vocab_size, (2, 3))
    logits, state, al = m.forward(tgt, m.initial_state(2), mem)
    return (logits, *(state if isinstance(state, tuple) else (state,)), al)


def _seq2seq_run(m, rng):
    V = m.decoder.vocab_size
    src = rng.integers(3, V, (2, 5))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], bool)
    tgt = rng.integers(0, V, (2, 4))
    logits, al = m(src, tgt, mask, return_alignments=True)
    g = m.greedy_decode(src, mask, max_len=6)
    b = m.beam_search(src, mask, beam_size=2, max_len=6)
    return (logits, al, *g, *b)


def _seq2seq(style, cell="gru", bidirectional=False, similarity="additive", num_layers=1,
             init_state="encoder"):
    def build(dtype):
        H = 6
        enc = L.RNNEncoder(13, 5, H, cell=cell, num_layers=num_layers, bidirectional=bidirectional,
                           padding_idx=0, seed=11, dtype=dtype)
        dec = L.AttentionDecoder(13, 4, enc.output_size, enc.output_size, style=style,
                                 similarity=similarity, attn_dim=5, cell=cell, num_layers=num_layers,
                                 seed=12, dtype=dtype)
        return L.Seq2Seq(enc, dec, bos_id=1, eos_id=2, pad_id=0, init_state=init_state)
    return build, _seq2seq_run


CASES = {
    "Embedding": (lambda dt: L.Embedding(9, 4, padding_idx=2, seed=1, dtype=dt),
                  lambda m, rng: (m(rng.integers(0, 9, (2, 5))),)),
    "Linear": (lambda dt: L.Linear(5, 3, seed=2, dtype=dt),
               lambda m, rng: (m(rng.standard_normal((2, 4, 5))),)),
    "Linear-nobias-generator-seed": (
        lambda dt: L.Linear(5, 3, bias=False, seed=np.random.default_rng(7), dtype=dt),
        lambda m, rng: (m(rng.standard_normal((4, 5))),)),
    "SimpleRNN-tanh": (lambda dt: L.SimpleRNN(4, 3, seed=3, dtype=dt), _rnn_run),
    "SimpleRNN-relu-bidir-2": (lambda dt: L.SimpleRNN(4, 3, 2, nonlinearity="relu", bidirectional=True,
                                                      seed=3, dtype=dt), _rnn_run),
    "GRU-bidir-2": (lambda dt: L.GRU(4, 3, 2, bidirectional=True, seed=4, dtype=dt), _rnn_run),
    "GRU-nobias": (lambda dt: L.GRU(4, 3, bias=False, seed=4, dtype=dt), _rnn_run),
    "LSTM-bidir-2": (lambda dt: L.LSTM(4, 3, 2, bidirectional=True, seed=5, dtype=dt), _rnn_run),
    "RNNEncoder-lstm-bidir-2": (lambda dt: L.RNNEncoder(11, 4, 3, cell="lstm", num_layers=2,
                                                         bidirectional=True, padding_idx=0, seed=6,
                                                         dtype=dt), _encoder_run),
    "RNNEncoder-rnn": (lambda dt: L.RNNEncoder(11, 4, 3, cell="rnn", seed=6, dtype=dt), _encoder_run),
    "Attention-additive": (lambda dt: L.Attention(4, 5, 6, similarity="additive", embed_dim=3, out_dim=2,
                                                  attn_dim=7, bias=True, seed=7, dtype=dt),
                           _attention_run),
    "Attention-additive-normalize": (
        lambda dt: L.Attention(4, 5, similarity={"name": "additive", "normalize": True}, attn_dim=3,
                               seed=7, dtype=dt), _attention_run),
    "Attention-general": (lambda dt: L.Attention(4, 5, similarity="general", seed=7, dtype=dt),
                          _attention_run),
    "Attention-concat": (lambda dt: L.Attention(4, similarity="concat", attn_dim=3, seed=7, dtype=dt),
                         _attention_run),
    "Attention-cosine": (lambda dt: L.Attention(4, 6, similarity={"name": "cosine", "eps": 1e-7},
                                                seed=7, dtype=dt), _attention_run),
    "Attention-dot": (lambda dt: L.Attention(4, similarity="dot", seed=7, dtype=dt), _attention_run),
    "Attention-scaled_dot": (lambda dt: L.Attention(4, similarity="scaled_dot", seed=7, dtype=dt),
                             _attention_run),
    "SelfAttention-causal": (lambda dt: L.SelfAttention(6, similarity="scaled_dot", out_dim=4,
                                                        causal=True, bias=True, seed=8, dtype=dt),
                             _self_attention_run),
    "SelfAttention-additive": (lambda dt: L.SelfAttention(5, similarity="additive", attn_dim=3, seed=8,
                                                          dtype=dt), _self_attention_run),
    "MultiHeadAttention": (lambda dt: L.MultiHeadAttention(8, 2, seed=9, dtype=dt), _mha_run),
    "MultiHeadAttention-gqa": (lambda dt: L.MultiHeadAttention(8, 4, num_kv_heads=2, seed=9, dtype=dt),
                               _mha_run),
    "MultiHeadAttention-kvdim-nobias-mqa": (
        lambda dt: L.MultiHeadAttention(8, 4, kdim=5, vdim=3, bias=False, num_kv_heads=1, seed=9,
                                        dtype=dt), _mha_run),
    "AttentionDecoder-bahdanau": (lambda dt: L.AttentionDecoder(10, 4, 5, 6, style="bahdanau", seed=10,
                                                                dtype=dt), _decoder_run),
    "AttentionDecoder-luong-lstm-2": (
        lambda dt: L.AttentionDecoder(10, 4, 5, 6, style="luong", similarity="general", cell="lstm",
                                      num_layers=2, padding_idx=0, seed=10, dtype=dt), _decoder_run),
    "Seq2Seq-bahdanau": _seq2seq("bahdanau"),
    "Seq2Seq-luong": _seq2seq("luong", similarity="general"),
    "Seq2Seq-bahdanau-lstm-bidir-2": _seq2seq("bahdanau", cell="lstm", bidirectional=True, num_layers=2),
    "Seq2Seq-luong-concat-zeros": _seq2seq("luong", similarity="concat", init_state="zeros"),
    "LayerNorm": (lambda dt: L.LayerNorm(5, 1e-4, dtype=dt),
                  lambda m, rng: (m(rng.standard_normal((2, 3, 5))),)),
    "LayerNorm-nobias": (lambda dt: L.LayerNorm(5, bias=False, dtype=dt),
                         lambda m, rng: (m(rng.standard_normal((2, 5))),)),
    "Dropout": (lambda dt: L.Dropout(0.25, seed=3),
                lambda m, rng: (m.eval()(rng.standard_normal((2, 5))),)),
    "FeedForward-gelu": (lambda dt: L.FeedForward(5, 7, activation="gelu", dropout=0.1, seed=4,
                                                  dtype=dt),
                         lambda m, rng: (m.eval()(rng.standard_normal((2, 3, 5))),)),
    "MeanPooling": (lambda dt: L.MeanPooling(),
                    lambda m, rng: (m(rng.standard_normal((2, 3, 5)),
                                      np.array([[1, 1, 0], [1, 1, 1]], bool)),)),
    "Sequential": (lambda dt: L.Sequential(L.Linear(5, 6, seed=5, dtype=dt), L.LayerNorm(6, dtype=dt),
                                           L.FeedForward(6, 8, seed=6, dtype=dt)),
                   lambda m, rng: (m(rng.standard_normal((2, 5))),)),
    "AttentionPooling": (lambda dt: L.AttentionPooling(5, 4, 3, seed=9, dtype=dt),
                         lambda m, rng: m(rng.standard_normal((2, 3, 5)),
                                          np.array([[1, 1, 0], [1, 1, 1]], bool), return_weights=True)),
    "PositionalEmbedding-learned": (lambda dt: L.PositionalEmbedding(6, 5, seed=3, dtype=dt),
                                    lambda m, rng: (m(rng.standard_normal((2, 4, 5))),)),
    "PositionalEmbedding-sinusoidal": (lambda dt: L.PositionalEmbedding(6, 5, kind="sinusoidal", dtype=dt),
                                       lambda m, rng: (m(rng.standard_normal((2, 4, 5))),)),
    "TransformerEncoderLayer-post": (
        lambda dt: L.TransformerEncoderLayer(8, 2, 12, dropout=0.1, seed=7, dtype=dt),
        lambda m, rng: (m.eval()(rng.standard_normal((2, 4, 8)),
                                 key_mask=np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool)),)),
    "TransformerEncoder-pre-norm-2": (
        lambda dt: L.TransformerEncoder(L.TransformerEncoderLayer(8, 4, 12, activation="gelu",
                                                                  norm_first=True, seed=8, dtype=dt),
                                        2, norm=True, seed=9),
        lambda m, rng: (m.eval()(rng.standard_normal((2, 4, 8)), is_causal=True),)),
    "TextClassifier-wide-bigru": (
        lambda dt: L.TextClassifier(11, 3, 8, num_heads=2, ff_dim=12, max_len=6, rnn_hidden=4,
                                    ngram_buckets=5, wide_buckets=7, wide_scale=3.0, hops=2,
                                    seed=4, dtype=dt),
        lambda m, rng: m.eval()(np.array([[3, 4, 5, 0], [6, 7, 8, 9]]),
                                np.array([[1, 1, 1, 0], [1, 1, 1, 1]], bool), return_weights=True)),
}

PUBLIC_LAYERS = sorted(n for n in L.__all__
                       if isinstance(getattr(L, n), type) and issubclass(getattr(L, n), Layer)
                       and getattr(L, n) is not Layer)   # the base class itself is not loadable


def test_every_public_layer_class_and_similarity_has_a_case():
    built = [build(np.float32) for build, _ in CASES.values()]
    assert {type(m).__name__ for m in built} == set(PUBLIC_LAYERS)
    sims = {m.similarity.name for m in built if isinstance(m, L.Attention)}
    assert sims == {cls.name for cls in BUILTIN_SIMILARITIES}  # plugins aside


def _perturb(model, seed=99):
    """Give every parameter values no fresh init would draw (a loaded model must
    carry the saved values, not its config's seed)."""
    rng = np.random.default_rng(seed)
    sd = {k: rng.standard_normal(v.shape).astype(v.dtype) for k, v in model.state_dict().items()}
    return model.load_state_dict(sd)


def _assert_same_outputs(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(x, y)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float32", "float64"])
@pytest.mark.parametrize("case", list(CASES))
def test_round_trip(case, dtype, tmp_path):
    build, run = CASES[case]
    model = _perturb(build(dtype))
    path = tmp_path / "model.ckpt"
    save(model, path)
    loaded = load(path)

    assert type(loaded) is type(model)
    assert loaded.get_config() == model.get_config()
    want, got = dict(model.named_parameters()), dict(loaded.named_parameters())
    assert list(got) == list(want)
    for name, a in want.items():
        b = got[name]
        assert b.dtype == a.dtype == np.dtype(dtype), name
        assert b.shape == a.shape, name
        assert np.array_equal(a, b), name
        assert not np.shares_memory(a, b), name
    _assert_same_outputs(run(model, np.random.default_rng(0)), run(loaded, np.random.default_rng(0)))
    # the loaded values are not those a fresh from_config would give
    fresh = type(model).from_config(model.get_config())
    assert not list(model.named_parameters()) or not all(np.array_equal(a, b) for (_, a), (_, b) in
                   zip(fresh.named_parameters(), loaded.named_parameters()))


def test_header(tmp_path):
    model = L.GRU(3, 2, bidirectional=True, seed=1, dtype=np.float64)
    save(model, tmp_path / "g")
    with np.load(tmp_path / "g", allow_pickle=False) as data:
        assert data[HEADER].dtype == np.uint8 and data[HEADER].ndim == 1
        header = json.loads(data[HEADER].tobytes().decode("utf-8"))
        assert sorted(data.files) == sorted([HEADER, *model.state_dict()])
    assert header["format"] == "fastattn.checkpoint"
    assert header["format_version"] == FORMAT_VERSION == 1
    assert header["fastattn_version"] == fastattn.__version__
    assert header["class"] == "GRU"
    assert header["config"] == model.get_config()
    assert header["params"] == [{"name": n, "shape": list(a.shape), "dtype": "float64"}
                                for n, a in model.state_dict().items()]
    # uncompressed members, readable by plain NumPy
    with zipfile.ZipFile(tmp_path / "g") as z:
        assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_STORED}


def test_nested_config_records_the_children(tmp_path):
    build, _ = CASES["Seq2Seq-luong"]
    model = build(np.float32)
    save(model, tmp_path / "s")
    with np.load(tmp_path / "s", allow_pickle=False) as data:
        header = json.loads(data[HEADER].tobytes())
    cfg = header["config"]
    assert cfg["encoder"]["cell"] == "gru" and cfg["decoder"]["style"] == "luong"
    assert cfg["decoder"]["similarity"] == "general"
    assert {p["name"] for p in header["params"]} >= {"encoder.rnn.weight_ih_l0", "decoder.combine.weight",
                                                      "decoder.attn.W"}


# --------------------------------------------------------------------- paths
def test_paths_are_used_exactly_as_given(tmp_path):
    model = L.Linear(3, 2, seed=0)
    for target in (tmp_path / "a", str(tmp_path / "b.ckpt"), tmp_path / "c.npz",
                   os.fsencode(tmp_path / "d")):
        save(model, target)
        assert os.path.isfile(target)
        assert np.array_equal(load(target).state_dict()["weight"], model.state_dict()["weight"])
    assert sorted(os.listdir(tmp_path)) == ["a", "b.ckpt", "c.npz", "d"]  # no .npz added, no temp left


def test_file_objects(tmp_path):
    model = L.SelfAttention(4, similarity="additive", seed=3)
    buf = io.BytesIO()
    save(model, buf)
    buf.seek(0)
    loaded = load(buf)
    assert not buf.closed
    assert all(np.array_equal(a, b) for (_, a), (_, b) in
               zip(model.named_parameters(), loaded.named_parameters()))
    with open(tmp_path / "f", "wb") as f:
        save(model, f)
    with open(tmp_path / "f", "rb") as f:
        assert load(f).get_config() == model.get_config()


def test_overwrite_replaces_the_old_checkpoint(tmp_path):
    path = tmp_path / "m"
    save(L.Linear(3, 2, seed=0), path)
    save(L.Linear(4, 5, seed=1), path)
    assert load(path).get_config()["in_features"] == 4
    assert os.listdir(tmp_path) == ["m"]


def test_missing_file_hints_at_the_npz_suffix(tmp_path):
    np.savez(tmp_path / "w", x=np.zeros(2))  # np.savez wrote w.npz
    with pytest.raises(FileNotFoundError, match=r"no such file \(there is .*w\.npz.*appends no suffix"):
        load(tmp_path / "w")
    with pytest.raises(FileNotFoundError, match=r"no such file$"):
        load(tmp_path / "nothing")


def test_bad_path_types(tmp_path):
    with pytest.raises(TypeError, match=r"path: expected a str, bytes or os.PathLike path or a binary "
                                        r"file object, got int"):
        save(L.Linear(2, 2), 3)
    with pytest.raises(TypeError, match=r"path: expected .* got NoneType"):
        load(None)


# ---------------------------------------------------------------- save checks
def test_save_does_not_modify_the_model(tmp_path):
    build, run = CASES["Seq2Seq-bahdanau-lstm-bidir-2"]
    model = build(np.float32).eval()
    live = list(model.named_parameters())
    values = model.state_dict()
    cfg = model.get_config()
    before = run(model, np.random.default_rng(1))
    save(model, tmp_path / "s")
    after = list(model.named_parameters())
    assert [n for n, _ in after] == [n for n, _ in live]
    assert all(a is b for (_, a), (_, b) in zip(live, after))  # the same arrays ...
    assert all(np.array_equal(values[n], a) and a.flags.writeable for n, a in after)  # ... unchanged
    assert model.get_config() == cfg and model.training is False
    _assert_same_outputs(before, run(model, np.random.default_rng(1)))
    assert load(tmp_path / "s").training is True  # the mode is not part of a checkpoint


def test_save_keeps_a_frozen_layer_frozen(tmp_path):
    mha = L.MultiHeadAttention(8, 2, seed=0).freeze()
    save(mha, tmp_path / "m")
    assert mha.frozen and not any(a.flags.writeable for a in mha.params.values())
    loaded = load(tmp_path / "m")
    assert not loaded.frozen  # freeze() is not recorded
    x = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    np.testing.assert_allclose(loaded(x), mha(x), rtol=1e-5, atol=1e-6)


def test_save_refuses_what_load_could_not_rebuild(tmp_path):
    class MyLinear(L.Linear):
        pass

    with pytest.raises(TypeError, match=r"model: expected a layer of fastattn.layers \(Embedding, .*TransformerEncoder, TextClassifier\), "
                                        r"got .*MyLinear \(a subclass of Linear: load could not rebuild it\)"):
        save(MyLinear(2, 2), tmp_path / "x")
    with pytest.raises(TypeError, match=r"model: expected a layer of fastattn.layers .* got builtins.dict$"):
        save({"weight": np.zeros(2)}, tmp_path / "x")
    m = L.Linear(3, 2)
    m._params["weight"][0, 0] = np.nan
    with pytest.raises(ValueError, match=r"model: parameter 'weight' contains NaN or infinite values"):
        save(m, tmp_path / "x")
    mha = L.MultiHeadAttention(4, 2)
    mha.params["out_proj.weight"] = mha.params["out_proj.weight"].astype(np.float64)
    with pytest.raises(ValueError, match=r"model: parameter 'out_proj.weight': expected dtype float32 "
                                         r"\(the layer's\), got float64"):
        save(mha, tmp_path / "x")
    mha = L.MultiHeadAttention(4, 2)
    del mha.params["out_proj.bias"]
    with pytest.raises(ValueError, match=r"do not match its architecture .* missing \['out_proj.bias'\]"):
        save(mha, tmp_path / "x")
    assert not os.listdir(tmp_path)  # nothing written, no temporary left


# ------------------------------------------------------------------ tampering
def _members(path):
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    header = json.loads(arrays.pop(HEADER).tobytes().decode("utf-8"))
    return header, arrays


def _write(path, header, arrays, **extra):
    blob = np.frombuffer(json.dumps(header).encode("utf-8"), np.uint8)
    with open(path, "wb") as f:
        np.savez(f, **{HEADER: blob, **arrays, **extra})


@pytest.fixture
def ckpt(tmp_path):
    model = L.Attention(4, 5, similarity="additive", attn_dim=3, bias=True, seed=1)
    path = tmp_path / "attn.ckpt"
    save(model, path)
    return path


def _tampered(ckpt, edit):
    header, arrays = _members(ckpt)
    edit(header, arrays)
    out = ckpt.with_name("tampered")
    _write(out, header, arrays)
    return out


def test_the_untampered_fixture_loads(ckpt):
    header, arrays = _members(ckpt)
    _write(ckpt.with_name("copy"), header, arrays)
    assert isinstance(load(ckpt.with_name("copy")), L.Attention)


@pytest.mark.parametrize("name", ["os.system", "Layer", "Memory", "DecodeResult", "np.ndarray",
                                  "fastattn.layers.Linear", "linear", ""])
def test_class_not_on_the_allow_list(ckpt, name):
    def edit(h, a):
        h["class"] = name
    with pytest.raises(ValueError, match=rf"unknown layer class {name!r}; expected one of \['Embedding', "
                                         r"'Linear', .*'TransformerEncoder', 'TextClassifier'\]"):
        load(_tampered(ckpt, edit))


def test_class_that_does_not_fit_the_config(ckpt):
    def edit(h, a):
        h["class"] = "Linear"
    with pytest.raises(ValueError, match=r"its config does not build a Linear: config: unknown keys"):
        load(_tampered(ckpt, edit))


@pytest.mark.parametrize("version", [0, 2, 99, "1", None, True, 1.0])
def test_unknown_format_version(ckpt, version):
    def edit(h, a):
        h["format_version"] = version
    with pytest.raises(ValueError, match=rf"unknown format version {version!r}; this fastattn .* reads "
                                         r"versions 1 to 1"):
        load(_tampered(ckpt, edit))


def test_not_a_fastattn_checkpoint(ckpt, tmp_path):
    header, arrays = _members(ckpt)
    np.savez(tmp_path / "plain.npz", **arrays)
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint \(no '__fastattn__' entry; entries "
                                         r"\['W_K', "):
        load(tmp_path / "plain.npz")
    np.save(tmp_path / "one.npy", np.zeros(3))
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint \(a single .npy array"):
        load(tmp_path / "one.npy")
    (tmp_path / "junk").write_bytes(b"definitely not a zip file")
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint \(not an .npz archive"):
        load(tmp_path / "junk")
    (tmp_path / "empty").write_bytes(b"")
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint"):
        load(tmp_path / "empty")
    raw = ckpt.read_bytes()
    (tmp_path / "truncated").write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint|damaged archive"):
        load(tmp_path / "truncated")

    def other_format(h, a):
        h["format"] = "something.else"
    with pytest.raises(ValueError, match=r"not a fastattn checkpoint \(format 'something.else'"):
        load(_tampered(ckpt, other_format))
    files = {HEADER: np.frombuffer(b"{not json", np.uint8), **arrays}
    np.savez(tmp_path / "notjson.npz", **files)
    with pytest.raises(ValueError, match=r"the '__fastattn__' entry is not valid JSON"):
        load(tmp_path / "notjson.npz")
    files[HEADER] = np.array(["{}"])
    np.savez(tmp_path / "unicode.npz", **files)
    with pytest.raises(ValueError, match=r"the '__fastattn__' entry is not a JSON document \(expected a "
                                         r"1-d uint8 array, got 1-d <U2\)"):
        load(tmp_path / "unicode.npz")


def test_parameter_dropped(ckpt):
    def edit(h, a):  # both the array and its header entry: load_state_dict's message
        del a["sim.v"]
        h["params"] = [p for p in h["params"] if p["name"] != "sim.v"]
    with pytest.raises(ValueError, match=r"state_dict: names do not match Attention: missing \['sim.v'\], "
                                         r"unexpected \[\]"):
        load(_tampered(ckpt, edit))

    def edit_array_only(h, a):
        del a["W_Q"]
    with pytest.raises(ValueError, match=r"the header and the stored arrays disagree: declared but absent "
                                         r"\['W_Q'\], stored but not declared \[\]"):
        load(_tampered(ckpt, edit_array_only))


def test_parameter_unexpected(ckpt):
    def edit(h, a):
        a["extra"] = np.zeros(3, np.float32)
        h["params"].append({"name": "extra", "shape": [3], "dtype": "float32"})
    with pytest.raises(ValueError, match=r"names do not match Attention: missing \[\], unexpected \['extra'\]"):
        load(_tampered(ckpt, edit))

    def edit_array_only(h, a):
        a["extra"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"declared but absent \[\], stored but not declared \['extra'\]"):
        load(_tampered(ckpt, edit_array_only))


def test_parameter_wrong_shape(ckpt):
    def edit(h, a):  # consistent header: the layer's own check
        a["W_Q"] = a["W_Q"][:, :-1].copy()
        next(p for p in h["params"] if p["name"] == "W_Q")["shape"] = list(a["W_Q"].shape)
    with pytest.raises(ValueError, match=r"state_dict\['W_Q'\]: expected shape \(4, 4\), got \(4, 3\)"):
        load(_tampered(ckpt, edit))

    def edit_header_only(h, a):
        next(p for p in h["params"] if p["name"] == "b_K")["shape"] = [5]
    with pytest.raises(ValueError, match=r"entry 'b_K': the header declares float32 \(5,\), the file holds "
                                         r"float32 \(4,\)"):
        load(_tampered(ckpt, edit_header_only))


def test_parameter_wrong_dtype(ckpt):
    def edit(h, a):
        a["W_V"] = a["W_V"].astype(np.float64)
        next(p for p in h["params"] if p["name"] == "W_V")["dtype"] = "float64"
    with pytest.raises(ValueError, match=r"parameter 'W_V': expected dtype float32 \(the Attention's\), "
                                         r"got float64"):
        load(_tampered(ckpt, edit))

    def edit_to_ints(h, a):
        a["W_V"] = a["W_V"].astype(np.int64)
        next(p for p in h["params"] if p["name"] == "W_V")["dtype"] = "int64"
    with pytest.raises(ValueError, match=r"header params\[\d\]: expected .*'float32' or 'float64'\}, got"):
        load(_tampered(ckpt, edit_to_ints))

    def edit_array_to_text(h, a):
        a["W_V"] = np.array(["a", "b"])
    with pytest.raises(ValueError, match=r"entry 'W_V': the header declares float32 \(5, 5\), the file "
                                         r"holds <U1 \(2,\)"):
        load(_tampered(ckpt, edit_array_to_text))


def test_nan_values_are_refused(ckpt):
    def edit(h, a):
        a["sim.v"] = a["sim.v"].copy()
        a["sim.v"][0] = np.nan
    with pytest.raises(ValueError, match=r"state_dict\['sim.v'\]: contains NaN or infinite values"):
        load(_tampered(ckpt, edit))


def test_tampered_config(ckpt):
    def edit(h, a):
        h["config"]["similarity"] = "no_such_similarity"
    with pytest.raises(ValueError, match=r"its config does not build an Attention: .*no_such_similarity"):
        load(_tampered(ckpt, edit))

    def edit_seed(h, a):
        h["config"]["seed"] = "1"
    with pytest.raises(ValueError, match=r"its config does not build an Attention: seed: expected None, "
                                         r"an int or a np.random.Generator, got str"):
        load(_tampered(ckpt, edit_seed))

    def edit_header(h, a):
        h["config"] = ["not", "a", "dict"]
    with pytest.raises(ValueError, match=r"header field 'config': expected a dict, got list"):
        load(_tampered(ckpt, edit_header))


# ------------------------------------------------- pickles are never unpickled
class _Payload:
    """Unpickling this runs ``exec``: it creates the marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


@pytest.mark.parametrize("where", ["parameter", "header", "whole file"])
def test_object_arrays_are_refused_without_running_code(ckpt, tmp_path, where):
    marker = tmp_path / "pwned"
    evil = np.array([_Payload(marker)], dtype=object)
    header, arrays = _members(ckpt)
    path = tmp_path / "evil"
    if where == "parameter":
        arrays["W_Q"] = evil
        _write(path, header, arrays)
        match = r"entry 'W_Q' could not be read safely \(.*allow_pickle=False.*\); a checkpoint holds float32"
    elif where == "header":
        with open(path, "wb") as f:
            np.savez(f, **{HEADER: evil, **arrays})
        match = r"the '__fastattn__' entry could not be read safely \(.*allow_pickle=False"
    else:
        path.write_bytes(pickle.dumps(_Payload(marker)))
        match = r"not a fastattn checkpoint \(not an .npz archive: .*pickled"
    with pytest.raises(ValueError, match=match):
        load(path)
    assert not marker.exists()
    # the control: the payload is live, NumPy with allow_pickle=True runs it
    if where == "whole file":
        np.load(path, allow_pickle=True)
    else:
        with np.load(path, allow_pickle=True) as data:
            data[HEADER if where == "header" else "W_Q"]
    assert marker.exists()


def test_a_member_that_is_not_npy_is_refused(ckpt, tmp_path):
    header, arrays = _members(ckpt)
    path = tmp_path / "raw"
    _write(path, header, {k: v for k, v in arrays.items() if k != "W_K"})
    with zipfile.ZipFile(path, "a") as z:
        z.writestr("W_K", b"raw bytes, no .npy header")
    with pytest.raises(ValueError, match=r"entry 'W_K' is not an .npy array"):
        load(path)


# --------------------------------------------------------------- load(into=)
def test_load_into_an_existing_model(tmp_path):
    build, run = CASES["Seq2Seq-bahdanau-lstm-bidir-2"]
    trained = _perturb(build(np.float64))
    save(trained, tmp_path / "s")
    enc = L.RNNEncoder(13, 5, 6, cell="lstm", num_layers=2, bidirectional=True, padding_idx=0, seed=123,
                       dtype=np.float64)
    dec = L.AttentionDecoder(13, 4, 12, 12, style="bahdanau", attn_dim=5, cell="lstm", num_layers=2,
                             seed=456, dtype=np.float64)
    target = L.Seq2Seq(enc, dec, bos_id=1, eos_id=2, pad_id=0).eval()  # other seeds: same architecture
    live = [a for _, a in target.named_parameters()]
    assert load(tmp_path / "s", into=target) is target
    assert target.training is False  # kept
    for (n, a), (_, b) in zip(trained.named_parameters(), target.named_parameters()):
        assert np.array_equal(a, b), n
    assert not any(a is b for a, (_, b) in zip(live, target.named_parameters()))
    _assert_same_outputs(run(trained, np.random.default_rng(2)), run(target, np.random.default_rng(2)))


def test_load_into_a_frozen_mha(tmp_path):
    src = _perturb(L.MultiHeadAttention(8, 4, num_kv_heads=2, seed=1))
    save(src, tmp_path / "m")
    target = L.MultiHeadAttention(8, 4, num_kv_heads=2, seed=2).freeze()
    load(tmp_path / "m", into=target)
    assert target.frozen and not any(a.flags.writeable for a in target.params.values())
    for n, a in src.named_parameters():
        assert np.array_equal(a, target.params[n])


def test_load_into_a_different_model_changes_nothing(tmp_path):
    save(L.Attention(4, 5, similarity="additive", attn_dim=3, seed=1), tmp_path / "a")
    for other, match in (
            (L.Attention(4, 5, similarity="additive", attn_dim=2, seed=1),
             r"into: the Attention does not have the checkpoint's config: attn_dim: checkpoint 3, model 2"),
            (L.Attention(4, 5, similarity="concat", attn_dim=3, seed=1),
             r"similarity: checkpoint \{'name': 'additive', 'normalize': False\}, model 'concat'"),
            (L.Attention(4, 5, similarity="additive", attn_dim=3, seed=1, dtype=np.float64),
             r"dtype: checkpoint 'float32', model 'float64'"),
            (L.Linear(4, 5), r"into: the checkpoint holds an Attention, got a Linear")):
        before = other.state_dict()
        with pytest.raises(ValueError, match=match):
            load(tmp_path / "a", into=other)
        assert all(np.array_equal(before[n], a) for n, a in other.named_parameters())
    with pytest.raises(TypeError, match=r"into: expected a layer of fastattn.layers or None, got dict"):
        load(tmp_path / "a", into={})


def test_load_into_is_validated_before_anything_changes(ckpt):
    header, arrays = _members(ckpt)
    arrays["W_K"] = arrays["W_K"].copy()
    arrays["W_K"][1, 1] = np.inf
    _write(ckpt.with_name("bad"), header, arrays)
    target = L.Attention(4, 5, similarity="additive", attn_dim=3, bias=True, seed=5)
    before = target.state_dict()
    with pytest.raises(ValueError, match=r"state_dict\['W_K'\]: contains NaN or infinite values"):
        load(ckpt.with_name("bad"), into=target)
    assert all(np.array_equal(before[n], a) for n, a in target.named_parameters())


# --------------------------------------------- similarities travel by name
def test_a_registered_plugin_similarity(tmp_path):
    class Dist(Similarity):
        name = "ckpt_test_dist"
        params_spec = {"gamma": ParamSpec((), required=False, default=1.0)}
        same_dims = True

        def score(self, query, key, params):
            d = query[..., :, None, :] - key[..., None, :, :]
            return -params["gamma"] * np.sum(d * d, axis=-1)

    fastattn.register_similarity(Dist())
    try:
        model = L.Attention(4, similarity="ckpt_test_dist", seed=0)
        save(model, tmp_path / "p")
        loaded = load(tmp_path / "p")
        _assert_same_outputs(_attention_run(model, np.random.default_rng(0)),
                             _attention_run(loaded, np.random.default_rng(0)))
    finally:
        fastattn.unregister_similarity("ckpt_test_dist")
    with pytest.raises(ValueError, match=r"its config does not build an Attention: .*ckpt_test_dist"):
        load(tmp_path / "p")


def test_pathlib_and_str_agree(tmp_path):
    model = L.Embedding(5, 2, seed=0)
    save(model, str(tmp_path / "e"))
    a = load(pathlib.Path(tmp_path / "e")).state_dict()["weight"]
    assert np.array_equal(a, model.state_dict()["weight"])
