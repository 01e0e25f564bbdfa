"""The one ``Layer`` base of every layer, ``MultiHeadAttention`` included: one
parameter store, one walk over children (dotted names), one
state_dict / load_state_dict / named_parameters / get_config / from_config,
one set of argument checkers."""
import copy
import json
import pickle

import numpy as np
import pytest

from fastattn.layers import (GRU, LSTM, Attention, AttentionDecoder, Embedding, Linear,
                             MultiHeadAttention, RNNEncoder, SelfAttention, Seq2Seq, SimpleRNN)
from fastattn.layers import _base, attention, multi_head, rnn, seq2seq
from fastattn.layers._base import Layer

V = 7


def make_seq2seq(seed=0, dtype=np.float64):
    enc = RNNEncoder(V, 3, 4, cell="gru", bidirectional=True, padding_idx=0, seed=seed, dtype=dtype)
    dec = AttentionDecoder(V, 5, 8, 8, style="luong", similarity="additive", attn_dim=3, cell="gru",
                           seed=seed + 1, dtype=dtype)
    return Seq2Seq(enc, dec, bos_id=1, eos_id=2, pad_id=0)


def make_mha(seed=0):
    m = MultiHeadAttention(8, 2, seed=seed)
    rng = np.random.default_rng(seed + 10)
    # non-zero biases (they are zero-initialised), so a lost bias shows
    return m.load_state_dict({k: v + 0.1 * rng.standard_normal(v.shape) for k, v in m.state_dict().items()})


LAYERS = {"mha": make_mha, "seq2seq": make_seq2seq}


class Block(Layer):
    """A layer made of an MHA and a Linear (as a transformer block would be), to
    check that MultiHeadAttention nests through ``_children`` like any layer."""

    def __init__(self, seed=0):
        self.attn = MultiHeadAttention(8, 2, seed=seed)
        self.proj = Linear(8, 3, seed=seed)
        self._params = {"scale": np.ones(8, np.float32)}
        self._config = {"seed": seed, "dtype": "float32"}

    def _children(self):
        return {"attn": self.attn, "proj": self.proj}


def run(layer, rng):
    if isinstance(layer, MultiHeadAttention):
        return layer(rng.standard_normal((2, 5, 8)).astype(np.float32))
    src = rng.integers(3, V, (2, 4))
    tgt = rng.integers(3, V, (2, 3))
    return layer(src, tgt)


# ------------------------------------------------------------- one base

@pytest.mark.parametrize("cls", [MultiHeadAttention, Linear, Embedding, SimpleRNN, GRU, LSTM, RNNEncoder,
                                 Attention, SelfAttention, AttentionDecoder, Seq2Seq])
def test_every_layer_is_a_layer(cls):
    assert issubclass(cls, Layer)
    # one mechanism: nothing re-implements the base's state dicts and configs
    for name in ("state_dict", "load_state_dict", "named_parameters", "get_config", "_walk"):
        assert getattr(cls, name) is getattr(Layer, name), (cls.__name__, name)


def test_mha_instance_and_its_store():
    m = MultiHeadAttention(8, 2, seed=0)
    assert isinstance(m, Layer)
    assert m.params is m._params  # one store: params is a view of the base's
    new = {k: a * 2 for k, a in m.params.items()}
    m.params = new
    assert m._params is new
    assert all(a is new[k] for k, a in m.named_parameters())


def test_no_private_duplicates_of_the_base_helpers():
    for mod in (multi_head, attention, rnn, seq2seq):
        assert not hasattr(mod, "_check_int") and not hasattr(mod, "_to_numpy"), mod.__name__
    for mod in (attention, rnn, seq2seq):
        for name in ("_rng", "_config_seed"):
            if hasattr(mod, name):
                assert getattr(mod, name) is getattr(_base, name), (mod.__name__, name)
    assert attention.resolve_similarity is _base.resolve_similarity
    assert seq2seq.init_similarity_params is _base.init_similarity_params


# ------------------------------------------------------ named_parameters

def test_named_parameters_of_mha_are_the_live_arrays_in_state_dict_order():
    m = make_mha()
    named = list(m.named_parameters())
    assert [n for n, _ in named] == list(m.state_dict()) == list(m.param_shapes())
    assert [n for n, _ in named] == ["in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias"]
    for name, a in named:
        assert a is m.params[name]
    sd = m.state_dict()
    for name, a in sd.items():
        assert a is not m.params[name] and not np.shares_memory(a, m.params[name])


def test_named_parameters_of_seq2seq_are_dotted_and_live():
    m = make_seq2seq()
    named = dict(m.named_parameters())
    assert list(named) == list(m.state_dict())
    assert named["encoder.rnn.weight_ih_l0"] is m.encoder.rnn._params["weight_ih_l0"]
    assert named["encoder.rnn.weight_hh_l0_reverse"] is m.encoder.rnn._params["weight_hh_l0_reverse"]
    assert named["decoder.attn.W_q"] is m.decoder._params["attn.W_q"]
    assert named["decoder.combine.weight"] is m.decoder.combine._params["weight"]
    # own parameters first, then the children in _children() order, depth first
    heads = [n.split(".")[0] + "." + n.split(".")[1] for n in named]
    assert heads.index("encoder.embedding") < heads.index("encoder.rnn") < heads.index("decoder.attn") \
        < heads.index("decoder.embedding") < heads.index("decoder.rnn") < heads.index("decoder.out") \
        < heads.index("decoder.combine")
    assert list(named) == list(dict(m.named_parameters()))  # stable


def test_mha_nests_like_any_layer():
    b = Block()
    names = [n for n, _ in b.named_parameters()]
    assert names == ["scale", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
                     "attn.out_proj.bias", "proj.weight", "proj.bias"]
    assert dict(b.named_parameters())["attn.out_proj.weight"] is b.attn.params["out_proj.weight"]


# --------------------------------------------------------------- round trips

@pytest.mark.parametrize("kind", list(LAYERS))
def test_state_dict_round_trip(kind):
    a, b = LAYERS[kind](seed=0), LAYERS[kind](seed=5)
    sd = a.state_dict()
    assert any(not np.array_equal(v, dict(b.named_parameters())[k]) for k, v in sd.items())
    x_rng = np.random.default_rng(3)
    assert b.load_state_dict(sd) is b
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa, pb)
        assert pa is not pb and pb.flags.c_contiguous and pb.dtype == pa.dtype
    np.testing.assert_array_equal(run(a, x_rng), run(b, np.random.default_rng(3)))
    saved = {k: v.copy() for k, v in sd.items()}
    for v in sd.values():  # the layer holds copies
        v += 1.0
    for k, v in b.named_parameters():
        np.testing.assert_array_equal(v, saved[k])


@pytest.mark.parametrize("kind", list(LAYERS))
def test_round_trip_through_json_config_and_pickle(kind):
    a = LAYERS[kind](seed=0)
    cfg = json.loads(json.dumps(a.get_config()))
    b = type(a).from_config(cfg).load_state_dict(a.state_dict())
    assert b.get_config() == a.get_config()
    c = pickle.loads(pickle.dumps(b))
    d = copy.deepcopy(b)
    for other in (b, c, d):
        for (n1, p1), (n2, p2) in zip(a.named_parameters(), other.named_parameters()):
            assert n1 == n2
            np.testing.assert_array_equal(p1, p2)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_prefix(kind):
    a, b = LAYERS[kind](seed=0), LAYERS[kind](seed=5)
    sd = {"model." + k: v for k, v in a.state_dict().items()}
    sd["other.weight"] = np.zeros(3)  # not under the prefix: ignored
    b.load_state_dict(sd, prefix="model.")
    for k, v in b.state_dict().items():
        np.testing.assert_array_equal(v, sd["model." + k])
    del sd[next(iter(sd))]
    with pytest.raises(ValueError, match=r"^state_dict: .*missing.*model\."):
        b.load_state_dict(sd, prefix="model.")


# -------------------------------------------------------- strict / non-strict

def test_strict_errors_keep_each_layers_message():
    m, s = make_mha(), make_seq2seq()
    sd = m.state_dict()
    del sd["out_proj.bias"]
    sd["extra"] = np.zeros(1)
    with pytest.raises(ValueError, match=r"^state_dict: expected the keys in_proj_weight, in_proj_bias, "
                                         r"out_proj.weight, out_proj.bias; missing out_proj.bias; "
                                         r"unexpected extra$"):
        m.load_state_dict(sd)
    sd = s.state_dict()
    del sd["encoder.rnn.weight_ih_l0"], sd["encoder.rnn.bias_hh_l0"]  # missing names are sorted
    sd["bogus"] = np.zeros(1)
    with pytest.raises(ValueError, match=r"^state_dict: names do not match Seq2Seq: missing "
                                         r"\['encoder.rnn.bias_hh_l0', 'encoder.rnn.weight_ih_l0'\], "
                                         r"unexpected \['bogus'\]$"):
        s.load_state_dict(sd)


@pytest.mark.parametrize("kind", list(LAYERS))
def test_non_strict_loads_only_the_given_names(kind):
    a, b = LAYERS[kind](seed=0), LAYERS[kind](seed=5)
    before = b.state_dict()
    sd = a.state_dict()
    names = list(sd)
    part = {n: sd[n] for n in names[::2]}
    part["not.a.parameter"] = np.zeros(2)
    with pytest.raises(ValueError, match=r"^state_dict: "):
        b.load_state_dict(part)
    b.load_state_dict(part, strict=False)
    after = b.state_dict()
    assert list(after) == names
    for i, n in enumerate(names):
        np.testing.assert_array_equal(after[n], sd[n] if i % 2 == 0 else before[n])


@pytest.mark.parametrize("kind", list(LAYERS))
def test_nothing_changes_on_error(kind):
    """The last name is bad: the names before it, valid, are not loaded either."""
    a, b = LAYERS[kind](seed=0), LAYERS[kind](seed=5)
    before = b.state_dict()
    sd = a.state_dict()
    last = list(sd)[-1]
    for bad, exc, match in ((np.zeros(sd[last].shape + (1,)), ValueError, "expected shape"),
                            (np.full(sd[last].shape, np.inf), ValueError, "contains NaN or infinite"),
                            (sd[last].astype(complex), TypeError, "expected (real numbers|a real floating)")):
        with pytest.raises(exc, match=rf"^state_dict\['{last}'\]: {match}"):
            b.load_state_dict(dict(sd, **{last: bad}))
        for k, v in b.state_dict().items():
            np.testing.assert_array_equal(v, before[k])


def test_integer_arrays_follow_the_owning_layer():
    """Linear casts integer weights, MultiHeadAttention refuses them, also as a child."""
    b = Block()
    sd = b.state_dict()
    ints = dict(sd, **{"proj.weight": np.ones((3, 8), np.int64)})
    b.load_state_dict(ints)
    assert b.proj._params["weight"].dtype == np.float32
    np.testing.assert_array_equal(b.proj._params["weight"], np.ones((3, 8)))
    with pytest.raises(TypeError, match=r"^state_dict\['attn.out_proj.bias'\]: expected a real "
                                        r"floating-point array, got dtype int64$"):
        b.load_state_dict(dict(sd, **{"attn.out_proj.bias": np.ones(8, np.int64)}))
    with pytest.raises(TypeError, match=r"^state_dict\['out_proj.bias'\]: expected a real "
                                        r"floating-point array, got dtype int64$"):
        b.attn.load_state_dict(dict(b.attn.state_dict(), **{"out_proj.bias": np.ones(8, np.int64)}))


def test_a_frozen_child_stays_frozen_and_is_prepared_again(rng):
    b = Block()
    b.attn.freeze()
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    b.attn(x)
    assert b.attn._prepared is not None
    sd = {k: v * 0.5 for k, v in b.state_dict().items()}
    b.load_state_dict(sd)
    assert b.attn.frozen and b.attn._prepared is None  # the child's _after_load ran
    assert all(not a.flags.writeable for a in b.attn.params.values())
    np.testing.assert_array_equal(b.attn.params["in_proj_weight"], sd["attn.in_proj_weight"])
    ref = MultiHeadAttention(8, 2).load_state_dict(b.attn.state_dict())
    np.testing.assert_allclose(b.attn(x), ref(x), rtol=1e-5, atol=1e-6)


def test_two_parameters_with_one_name_are_refused():
    class Clash(Layer):
        def __init__(self):
            self.child = Linear(2, 2, seed=0)
            self._params = {"child.weight": np.zeros((2, 2), np.float32)}
            self._config = {"dtype": "float32"}

        def _children(self):
            return {"child": self.child}

    with pytest.raises(RuntimeError, match=r"two parameters are named 'child.weight'"):
        Clash().state_dict()
    with pytest.raises(RuntimeError, match=r"two parameters are named 'child.weight'"):
        Clash().load_state_dict({})


# --------------------------------------------------------- shared checkers

def test_mha_shares_the_argument_checkers():
    cases = [  # (MultiHeadAttention call, another layer's call, exception, message after "name: ")
        (lambda: MultiHeadAttention(8, 2, bias=1), lambda: Linear(3, 4, bias=1),
         TypeError, r"bias: expected a bool, got int 1$"),
        (lambda: MultiHeadAttention(8, 2, dtype=np.float16), lambda: Linear(3, 4, dtype=np.float16),
         TypeError, r"dtype: expected float32 or float64, got float16$"),
        (lambda: MultiHeadAttention(8, 2, dtype="nonsense"), lambda: Linear(3, 4, dtype="nonsense"),
         TypeError, r"dtype: expected float32 or float64, got 'nonsense'$"),
    ]
    for mha_call, other_call, exc, msg in cases:
        with pytest.raises(exc, match="^" + msg):
            mha_call()
        with pytest.raises(exc, match="^" + msg):
            other_call()
    # one integer checker, each layer's wording (both pinned by older tests)
    for bad, exc, mha_msg, lin_msg in (
            (0, ValueError, "a positive integer, got 0", "an int >= 1, got 0"),
            (2.0, TypeError, "a positive integer, got float 2.0", "an int >= 1, got float 2.0"),
            (True, TypeError, "a positive integer, got bool True", "an int >= 1, got bool True")):
        with pytest.raises(exc, match=rf"^embed_dim: expected {mha_msg}$"):
            MultiHeadAttention(bad, 1)
        with pytest.raises(exc, match=rf"^in_features: expected {lin_msg}$"):
            Linear(bad, 4)
    assert MultiHeadAttention(np.int64(8), np.int32(2)).embed_dim == 8
    assert Linear(np.int64(3), 4).get_config()["in_features"] == 3
    assert type(Linear(np.int64(3), 4).get_config()["in_features"]) is int


@pytest.mark.parametrize("kind", list(LAYERS))
def test_state_dict_and_config_checks_are_shared(kind):
    layer = LAYERS[kind]()
    with pytest.raises(TypeError, match=r"^state_dict: expected a mapping of names to arrays, got list$"):
        layer.load_state_dict([1, 2])
    key = next(iter(layer.state_dict()))
    with pytest.raises(TypeError, match=rf"^state_dict\['{key}'\]: expected an array, got list"):
        layer.load_state_dict(dict(layer.state_dict(), **{key: [[1.0], [1.0, 2.0]]}))
    with pytest.raises(TypeError, match=r"^config: expected a mapping, got str$"):
        type(layer).from_config("nope")
    with pytest.raises(ValueError, match=r"^config: unknown keys \['bogus'\]; expected some of \["):
        type(layer).from_config(dict(layer.get_config(), bogus=1))
    cfg = layer.get_config()
    required = "embed_dim" if kind == "mha" else "encoder"
    del cfg[required]
    with pytest.raises(ValueError, match=rf"^config: missing required key '{required}'$"):
        type(layer).from_config(cfg)


def test_mha_config_has_no_seed_and_from_config_takes_one():
    m = MultiHeadAttention(8, 2, seed=0)
    cfg = m.get_config()
    assert "seed" not in cfg
    with pytest.raises(ValueError, match=r"^config: unknown keys \['seed'\]"):
        MultiHeadAttention.from_config(dict(cfg, seed=0))
    a, b = MultiHeadAttention.from_config(cfg, seed=3), MultiHeadAttention.from_config(cfg, seed=3)
    c = MultiHeadAttention.from_config(cfg, seed=4)
    np.testing.assert_array_equal(a.params["in_proj_weight"], b.params["in_proj_weight"])
    np.testing.assert_array_equal(a.params["in_proj_weight"],
                                  MultiHeadAttention(8, 2, seed=3).params["in_proj_weight"])
    assert not np.array_equal(a.params["in_proj_weight"], c.params["in_proj_weight"])


def test_from_config_seed_replaces_the_recorded_one():
    lin = Linear(3, 4, seed=0)
    again = Linear.from_config(lin.get_config())
    np.testing.assert_array_equal(again._params["weight"], lin._params["weight"])
    other = Linear.from_config(lin.get_config(), seed=1)
    assert other.get_config()["seed"] == 1
    np.testing.assert_array_equal(other._params["weight"], Linear(3, 4, seed=1)._params["weight"])
    m = make_seq2seq()
    s1, s2 = Seq2Seq.from_config(m.get_config(), seed=9), Seq2Seq.from_config(m.get_config(), seed=9)
    s3 = Seq2Seq.from_config(m.get_config())
    for (n1, p1), (n2, p2), (n3, p3) in zip(s1.named_parameters(), s2.named_parameters(),
                                            s3.named_parameters()):
        np.testing.assert_array_equal(p1, p2)
        np.testing.assert_array_equal(p3, dict(m.named_parameters())[n3])
    assert any(not np.array_equal(p1, dict(m.named_parameters())[n1]) for n1, p1 in s1.named_parameters()
               if not np.all(p1 == 0))


def test_mha_pickled_before_the_base_still_loads(rng):
    """A pickle made when MultiHeadAttention kept ``params`` in its own attribute."""
    m = make_mha()
    state = m.__getstate__()
    state["params"] = state.pop("_params")
    del state["_config"]
    old = MultiHeadAttention.__new__(MultiHeadAttention)
    old.__setstate__(state)
    assert old.get_config() == m.get_config()
    x = rng.standard_normal((2, 4, 8)).astype(np.float32)
    np.testing.assert_array_equal(old(x), m(x))
    assert list(old.state_dict()) == list(m.state_dict())
