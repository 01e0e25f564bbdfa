"""MultiHeadAttention packs its float32 projection weights without being asked
(``auto_pack``), and the packed copy follows every write fastattn makes:
optimizer steps (model or triples), load_state_dict, fastattn.load,
params_changed after a user's in-place edit.  Every result against the float64
oracle of the layer's current arrays."""
from __future__ import annotations

import copy
import gc
import pickle

import numpy as np
import pytest

import fastattn
from fastattn import _proj, _stamps, optim
from fastattn import layers as L
from fastattn.layers import MultiHeadAttention
from support import assert_close, randn

from test_mha_frozen import spy_packed  # noqa: F401 (a fixture: products given packed weights)
from test_mha_layer import oracle_of, randomise

pytestmark = pytest.mark.skipif(not _proj.packed_kernel_active(),
                                reason="no packed projection kernel on this CPU/build (AVX2+FMA)")


def _layer(rng, **kw):
    return randomise(MultiHeadAttention(32, 4, seed=0, **kw), rng)


def _packed(m):
    w = m._prepared
    return w is not None and w[2] is not None and w[2].packed is not None


@pytest.mark.parametrize("kw", [{}, {"kdim": 6, "vdim": 10}, {"num_kv_heads": 2}, {"bias": False}],
                         ids=["packed", "kdim_vdim", "gqa", "no_bias"])
def test_default_layer_packs_on_first_call(kw, rng, spy_packed):
    m = _layer(rng, **kw)
    assert m.auto_pack and not m.frozen and not _packed(m)
    x = randn(rng, (2, 5, 32), np.float32)
    k = x if m.packed else randn(rng, (2, 7, m.kdim), np.float32)
    v = x if m.packed else randn(rng, (2, 7, m.vdim), np.float32)
    got = m(x) if m.packed else m(x, k, v)
    assert _packed(m)
    assert spy_packed and all(spy_packed)
    assert_close(got, oracle_of(m, x, k, v), np.float32)
    assert all(a.flags.writeable for a in m.params.values())  # not frozen: nothing read-only


def test_float64_layer_packs_nothing(rng, spy_packed):
    m = _layer(rng, dtype=np.float64)
    x = randn(rng, (2, 5, 32), np.float64)
    assert_close(m(x), oracle_of(m, x, x, x), np.float64)
    assert not _packed(m) and not any(spy_packed)


def test_auto_pack_off_reads_the_arrays(rng, spy_packed):
    m = _layer(rng)
    x = randn(rng, (2, 5, 32), np.float32)
    m(x)
    assert _packed(m)
    m.auto_pack = False
    assert m._prepared is None   # the copy is dropped at once
    del spy_packed[:]
    got = m(x)
    assert not _packed(m) and spy_packed and not any(spy_packed)
    m.params["out_proj.weight"][:, 0] += 1.0   # read in place: seen with no call
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    assert not np.allclose(m(x), got)
    with pytest.raises(TypeError, match="auto_pack: expected a bool"):
        m.auto_pack = "yes"


@pytest.mark.parametrize("how", ["model", "triples"])
@pytest.mark.parametrize("opt_cls", [optim.SGD, optim.Adam, optim.AdamW])
def test_optimizer_steps_refresh_the_packed_copy(how, opt_cls, rng):
    m = _layer(rng)
    x = randn(rng, (2, 6, 32), np.float32)
    source = m if how == "model" else [(n, p, g) for (n, p), (_, g)
                                       in zip(m.named_parameters(), m.named_grads())]
    opt = opt_cls(source, lr=0.05)
    before = m(x)                      # packed now
    for _ in range(3):
        m.zero_grad()
        out, backprop = m.forward_backward(x)
        assert _packed(m)              # still valid: kept
        backprop(randn(rng, out.shape, np.float32))
        opt.step()
        m.forward_backward(x)
        assert not _packed(m)          # stale after the step: a layer in training drops it
        got = m(x)                     # repacked from the stepped arrays
        assert _packed(m)
        assert_close(got, oracle_of(m, x, x, x), np.float32)
    assert not np.allclose(got, before)


def test_only_trained_layer_never_packs(rng, spy_packed):
    m = _layer(rng)
    opt = optim.Adam(m, lr=1e-3)
    x = randn(rng, (2, 6, 32), np.float32)
    for _ in range(2):
        out, backprop = m.forward_backward(x)
        backprop(np.ones_like(out))
        opt.step()
    assert not _packed(m) and not any(spy_packed)


def test_load_state_dict_and_fastattn_load(tmp_path, rng):
    m = _layer(rng)
    other = randomise(MultiHeadAttention(32, 4, seed=1), rng)
    x = randn(rng, (2, 5, 32), np.float32)
    m(x)
    assert _packed(m)
    m.load_state_dict(other.state_dict())
    assert_close(m(x), oracle_of(other, x, x, x), np.float32)
    # strict=False, one entry: the others keep their arrays, the copy is remade all the same
    w = randn(rng, (32, 32), np.float32)
    m.load_state_dict({"out_proj.weight": w}, strict=False)
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)
    np.testing.assert_array_equal(m.params["out_proj.weight"], w)
    path = tmp_path / "m.npz"
    fastattn.save(m, path)
    back = fastattn.load(path)
    assert_close(back(x), oracle_of(m, x, x, x), np.float32)


def test_params_changed_after_an_in_place_edit(rng):
    m = _layer(rng)
    x = randn(rng, (2, 5, 32), np.float32)
    before = m(x)
    m.params["in_proj_weight"][3:40] *= -2.0
    m.params["out_proj.bias"][...] = 1.5
    assert m.params_changed() is m
    got = m(x)
    assert_close(got, oracle_of(m, x, x, x), np.float32)
    assert not np.allclose(got, before)


def test_replacing_an_array_is_seen(rng):
    m = _layer(rng)
    x = randn(rng, (2, 5, 32), np.float32)
    m(x)
    m.params["out_proj.weight"] = randn(rng, (32, 32), np.float32)
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)


def test_params_changed_reaches_children(rng):
    enc = L.TransformerEncoderLayer(32, 4, 64, dropout=0.0, seed=0).eval()
    ref = copy.deepcopy(enc)
    ref.self_attn.auto_pack = False
    x = randn(rng, (2, 5, 32), np.float32)
    enc(x)
    assert _packed(enc.self_attn)
    for e in (enc, ref):
        e.self_attn.params["in_proj_weight"][...] *= 0.5
    enc.params_changed()
    np.testing.assert_allclose(enc(x), ref(x), rtol=2e-5, atol=2e-5)


def test_transformer_inference_between_training_steps(rng):
    """Validation calls between optimizer steps see the current weights."""
    enc = L.TransformerEncoderLayer(32, 4, 64, dropout=0.0, seed=0)
    ref = copy.deepcopy(enc)
    ref.self_attn.auto_pack = False
    opts = [optim.Adam(e, lr=1e-2) for e in (enc, ref)]
    x = randn(rng, (2, 5, 32), np.float32)
    g = randn(rng, (2, 5, 32), np.float32)
    for _ in range(3):
        for e, opt in zip((enc, ref), opts):
            e.zero_grad()
            out, backprop = e.forward_backward(x)
            backprop(g)
            opt.step()
        np.testing.assert_allclose(enc(x), ref(x), rtol=2e-5, atol=2e-5)
    assert _packed(enc.self_attn) and not _packed(ref.self_attn)


def test_copies_and_pickles_keep_the_setting_and_repack(rng):
    m = _layer(rng)
    x = randn(rng, (2, 5, 32), np.float32)
    want = m(x)
    for c in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert c.auto_pack and not _packed(c)
        np.testing.assert_array_equal(c(x), want)
    m.auto_pack = False
    assert not pickle.loads(pickle.dumps(m)).auto_pack
    assert "auto_pack" not in m.get_config()


def test_stamps_are_per_live_array():
    a = np.zeros(4)
    assert _stamps.stamp(a) == 0
    _stamps.bump(a)
    s1 = _stamps.stamp(a)
    _stamps.bump(a)
    assert _stamps.stamp(a) > s1 > 0
    key = id(a)
    del a
    gc.collect()
    assert key not in _stamps._entries   # the entry goes with the array
    b = np.zeros(4)
    assert _stamps.stamp(b) == 0
