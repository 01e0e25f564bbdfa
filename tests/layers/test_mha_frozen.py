"""MultiHeadAttention.freeze(): read-only parameters and prepacked float32 projection
weights (fastattn._proj.pack_f32 / linear(.., wp=)), against the float64 oracle and
the unfrozen layer."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

from fastattn import _multihead, _proj
from fastattn.layers import MultiHeadAttention
from support import assert_close, randn, run_child

from test_mha_layer import oracle_of, randomise
from test_mha_prepared import _masks  # the same mask kinds (a superset)

LAYOUTS = {"packed": {}, "kdim_vdim": {"kdim": 6, "vdim": 10}, "gqa": {"num_kv_heads": 2},
           "no_bias": {"bias": False}}
MASKS = ["none", "bool", "float_and_key_mask", "causal", "causal_br"]


@pytest.fixture
def spy_packed(monkeypatch):
    """Records, for every projection product of the multi-head code, whether it got packed weights."""
    calls = []
    real = _multihead._linear

    def spy(x, w, b, rows_out, n_threads, wp=None):
        calls.append(wp is not None)
        return real(x, w, b, rows_out, n_threads, wp)

    monkeypatch.setattr(_multihead, "_linear", spy)
    return calls


def _frozen_pair(E, layout, rng, dtype=np.float32):
    """An unfrozen layer that reads its arrays in place (auto_pack off) and a frozen copy."""
    m = randomise(MultiHeadAttention(E, 4, dtype=dtype, seed=0, **LAYOUTS[layout]), rng)
    f = copy.deepcopy(m).freeze()
    m.auto_pack = False
    return m, f


@pytest.mark.parametrize("E", [24, 48])  # 24: the key and value rows do not start a 16-row panel
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("form", ["self", "cross", "kv_shared"])
def test_frozen_matches_oracle_and_unfrozen(simd_mode, E, layout, mask, form, rng, spy_packed):
    m, f = _frozen_pair(E, layout, rng)
    B, Lq = 2, 5
    Lk = Lq if form == "self" else 7
    x = randn(rng, (B, Lq, E), np.float32)
    if form == "self" and m.packed:
        q = k = v = x
        args = (x,)
    elif form == "kv_shared" and m.kdim == m.vdim:
        k = v = randn(rng, (B, Lk, m.kdim), np.float32)
        q, args = x, (x, k)
    else:
        q = x
        k = randn(rng, (B, Lk, m.kdim), np.float32)
        v = randn(rng, (B, Lk, m.vdim), np.float32)
        args = (x, k, v)
    kw = _masks(mask, rng, B, m.num_heads, Lq, Lk, np.float32)
    saved = [a.copy() for a in args]
    got = f(*args, **kw)
    ref = m(*args, **kw)
    for a, s in zip(args, saved):  # inputs unchanged
        np.testing.assert_array_equal(a, s)
    assert got.dtype == np.float32
    assert_close(got, oracle_of(m, q, k, v, **kw), np.float32)
    np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-5)
    n = len(spy_packed) // 2  # the frozen call's products, then the unfrozen one's
    assert spy_packed[n:] == [False] * n
    if simd_mode == "simd":
        assert _proj.packed_kernel_active()
        assert spy_packed[:n] == [True] * n
    else:
        assert not _proj.packed_kernel_active()
    # unbatched: the same rows
    got1 = f(*(a[0] for a in args), **{k_: (v_[0] if k_ == "key_mask" else v_) for k_, v_ in kw.items()})
    ref1 = m(*(a[0] for a in args), **{k_: (v_[0] if k_ == "key_mask" else v_) for k_, v_ in kw.items()})
    np.testing.assert_allclose(got1, ref1, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("B, L", [(1, 1), (1, 7), (1, 13), (3, 16), (2, 67), (1, 200)])
def test_frozen_threads_and_row_counts(simd_mode, n_threads, B, L, rng):
    m, f = _frozen_pair(64, "packed", rng)
    x = randn(rng, (B, L, 64), np.float32)
    got = f(x, n_threads=n_threads, is_causal=True)
    assert_close(got, oracle_of(m, x, x, x, is_causal=True), np.float32)
    np.testing.assert_allclose(got, m(x, n_threads=n_threads, is_causal=True), rtol=2e-5, atol=2e-5)


def _unpack(wp, N, K):
    """The (N, K) weight back from its packed form (panels of 16 rows, feature-major)."""
    P = _proj.PANEL
    rows = -(-N // P) * P
    return wp.reshape(rows // P, K, P).transpose(0, 2, 1).reshape(rows, K)


@pytest.mark.parametrize("N, K", [(1, 1), (15, 3), (16, 7), (17, 33), (48, 16), (100, 65)])
def test_packing_round_trip(N, K, rng):
    w = randn(rng, (N, K), np.float32)
    wp = _multihead.pack_weight(w)
    assert wp.shape == (_proj.packed_size(N, K),) and wp.dtype == np.float32
    assert not wp.flags.writeable and wp.ctypes.data % 64 == 0
    full = _unpack(wp, N, K)
    np.testing.assert_array_equal(full[:N], w)
    assert np.all(full[N:] == 0)
    # strided rows pack the same
    wide = np.zeros((N, K + 5), np.float32)
    wide[:, :K] = w
    np.testing.assert_array_equal(_multihead.pack_weight(wide[:, :K]), wp)
    # row ranges: a view when the first row starts a panel, else packed on its own
    for r0, r1 in ((0, N), (0, (N + 1) // 2), (N // 2, N), (16, N)):
        if not 0 <= r0 < r1 <= N:
            continue
        sub = _multihead._packed_rows(wp, w, r0, r1)
        if r0 % 16 == 0:
            assert np.shares_memory(sub, wp)
        np.testing.assert_array_equal(_unpack(sub, r1 - r0, K)[:r1 - r0], w[r0:r1])


@pytest.mark.parametrize("n_threads", [1, 2])
@pytest.mark.parametrize("M", list(range(1, 14)) + [64, 97, 300])
@pytest.mark.parametrize("N, K", [(1, 5), (17, 3), (33, 7), (509, 65), (48, 512)])
def test_linear_packed_matches_float64(simd_mode, n_threads, M, N, K, rng):
    x = randn(rng, (2, M, K), np.float32)
    w = randn(rng, (N, K), np.float32)
    b = randn(rng, (N,), np.float32)
    wp = _multihead.pack_weight(w)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    for bias in (None, b):
        y = np.full((2, M, N), np.nan, np.float32)
        _proj.linear(x, w, bias, y, n_threads, wp)
        assert_close(y, ref + (0 if bias is None else b), np.float32)


def test_linear_packed_strided_batches_and_output(simd_mode, rng):
    M, N, K = 9, 40, 24
    xs = randn(rng, (3, M + 2, K + 3), np.float32)[:, 1:M + 1, :K]   # row stride K + 3
    w = randn(rng, (N, K), np.float32)
    b = randn(rng, (N,), np.float32)
    ys = np.zeros((3, M, N + 8), np.float32)
    y = ys[:, :, 4:N + 4]
    _proj.linear(xs, w, b, y, 2, _multihead.pack_weight(w))
    assert_close(y, xs.astype(np.float64) @ w.T.astype(np.float64) + b, np.float32)
    assert np.all(ys[:, :, :4] == 0) and np.all(ys[:, :, N + 4:] == 0)  # nothing written outside


def test_freeze_makes_parameters_read_only(rng):
    m = randomise(MultiHeadAttention(32, 4, seed=0), rng)
    assert not m.frozen
    params = m.params
    assert m.freeze() is m and m.frozen
    assert m.params is params  # the same dict, the same arrays: only their flags changed
    for name, a in m.params.items():
        assert not a.flags.writeable, name
        with pytest.raises(ValueError, match="read-only"):
            a[...] = 0
    w = m._prepared_weights()
    assert w is not None and w.packed is not None
    assert m.unfreeze() is m and not m.frozen
    assert all(a.flags.writeable for a in m.params.values())
    assert (m._prepared_weights().packed is not None) == _proj.packed_kernel_active()  # auto_pack
    m.auto_pack = False
    assert m._prepared_weights().packed is None
    m.freeze()  # a frozen layer packs with auto_pack off too
    assert m._prepared_weights().packed is not None


def test_freeze_copies_views_and_leaves_read_only_arrays(rng):
    m = randomise(MultiHeadAttention(16, 2, seed=0), rng)
    big = np.zeros((2,) + m.params["out_proj.weight"].shape, np.float32)
    big[1] = m.params["out_proj.weight"]
    view = big[1]
    ro = m.params["in_proj_weight"].copy()
    ro.flags.writeable = False
    m.params["out_proj.weight"] = view
    m.params["in_proj_weight"] = ro
    x = randn(rng, (1, 4, 16), np.float32)
    ref = m(x)
    m.freeze()
    assert m.params["out_proj.weight"] is not view and view.flags.writeable  # a private copy
    assert m.params["in_proj_weight"] is ro
    np.testing.assert_allclose(m(x), ref, rtol=2e-5, atol=2e-5)
    m.unfreeze()
    assert not ro.flags.writeable  # it was read-only before freeze: it stays so


def test_load_state_dict_on_frozen_layer_repacks(rng):
    m = randomise(MultiHeadAttention(32, 4, seed=0), rng).freeze()
    x = randn(rng, (2, 6, 32), np.float32)
    before = m(x)
    other = randomise(MultiHeadAttention(32, 4, seed=1), rng)
    m.load_state_dict(other.state_dict())
    assert m.frozen and all(not a.flags.writeable for a in m.params.values())
    got = m(x)
    assert not np.allclose(got, before)
    np.testing.assert_allclose(got, other(x), rtol=2e-5, atol=2e-5)
    assert_close(got, oracle_of(other, x, x, x), np.float32)


def test_unfreeze_edit_refreeze_gives_new_results(rng):
    m = randomise(MultiHeadAttention(32, 4, seed=0), rng).freeze()
    x = randn(rng, (1, 5, 32), np.float32)
    before = m(x)
    m.unfreeze()
    m.params["in_proj_weight"][3:40] *= -2.0
    m.params["out_proj.weight"][:, 1] += 1.0
    edited = m(x)
    m.freeze()
    got = m(x)
    assert not np.allclose(got, before)
    np.testing.assert_allclose(got, edited, rtol=2e-5, atol=2e-5)
    assert_close(got, oracle_of(m, x, x, x), np.float32)


def test_replacing_a_parameter_of_a_frozen_layer(rng):
    m = randomise(MultiHeadAttention(32, 4, seed=0), rng).freeze()
    x = randn(rng, (1, 5, 32), np.float32)
    m(x)
    new = randn(rng, m.params["out_proj.weight"].shape, np.float32)
    m.params["out_proj.weight"] = new
    got = m(x)
    assert not new.flags.writeable  # frozen with the others
    assert_close(got, oracle_of(m, x, x, x), np.float32)
    assert m._prepared_weights().packed is not None


def test_pickle_copy_config_state_dict(rng):
    m = randomise(MultiHeadAttention(32, 4, kdim=12, vdim=20, seed=0), rng).freeze()
    x = randn(rng, (2, 3, 32), np.float32)
    k = randn(rng, (2, 4, 12), np.float32)
    v = randn(rng, (2, 4, 20), np.float32)
    ref = m(x, k, v)
    for other in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert other.frozen
        assert all(not a.flags.writeable for a in other.params.values())
        assert other._prepared_weights().packed is not None
        np.testing.assert_array_equal(other(x, k, v), ref)
    assert "frozen" not in m.get_config()
    sd = m.state_dict()
    for a in sd.values():
        assert a.flags.writeable
        a[...] = 0  # a copy: the layer does not see it
    np.testing.assert_array_equal(m(x, k, v), ref)
    fresh = MultiHeadAttention.from_config(m.get_config()).load_state_dict(m.state_dict())
    assert not fresh.frozen
    np.testing.assert_allclose(fresh(x, k, v), ref, rtol=2e-5, atol=2e-5)


def test_float64_layer_and_inputs(rng):
    m, f = _frozen_pair(32, "packed", rng, dtype=np.float64)
    assert f.frozen and f._prepared_weights().packed is None  # no float64 packed kernel
    x = randn(rng, (2, 5, 32), np.float64)
    np.testing.assert_array_equal(f(x), m(x))
    m32, f32 = _frozen_pair(32, "packed", rng)
    np.testing.assert_array_equal(f32(x), m32(x))  # float64 inputs: the general path
    assert f32(x).dtype == np.float64


SIMD_OFF_CODE = """
import copy
import numpy as np
from fastattn import _proj
from fastattn.layers import MultiHeadAttention
assert not _proj.packed_kernel_active()
rng = np.random.default_rng(5)
for kw in ({}, {"kdim": 6, "vdim": 10}, {"num_kv_heads": 2}):
    m = MultiHeadAttention(48, 4, seed=0, **kw)
    m.load_state_dict({k: rng.standard_normal(a.shape) * 0.3 for k, a in m.params.items()})
    f = copy.deepcopy(m).freeze()
    x = rng.standard_normal((2, 9, 48)).astype(np.float32)
    k = rng.standard_normal((2, 5, m.kdim)).astype(np.float32)
    v = rng.standard_normal((2, 5, m.vdim)).astype(np.float32)
    np.testing.assert_allclose(f(x, k, v), m(x, k, v), rtol=2e-5, atol=2e-5)
    if m.packed:
        np.testing.assert_allclose(f(x, is_causal=True), m(x, is_causal=True), rtol=2e-5, atol=2e-5)
print("ok")
"""


def test_simd_disabled_by_environment():
    proc = run_child(SIMD_OFF_CODE, env_update={"FASTATTN_DISABLE_SIMD": "1"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"



@pytest.mark.parametrize("kc, mc", [(7, 5), (64, 0), (0, 13)])
def test_linear_packed_cache_blocking(simd_mode, kc, mc, rng):
    """The split paths of the packed kernel (k in chunks: later chunks add into y; rows in
    chunks) give the same products (fa_proj_packed_tune, process-wide: restored)."""
    prev = _proj.set_tuning(packed_kc=kc, packed_mc=mc)
    try:
        for M, N, K in ((13, 33, 29), (100, 48, 130), (1, 17, 8)):
            x = randn(rng, (1, M, K), np.float32)
            w = randn(rng, (N, K), np.float32)
            b = randn(rng, (N,), np.float32)
            y = np.empty((1, M, N), np.float32)
            _proj.linear(x, w, b, y, 2, _multihead.pack_weight(w))
            assert_close(y, x.astype(np.float64) @ w.T.astype(np.float64) + b, np.float32)
    finally:
        _proj.set_tuning(packed_kc=prev["packed_kc"], packed_mc=prev["packed_mc"])
    assert _proj.set_tuning()["packed_mc"] == prev["packed_mc"]


@pytest.mark.parametrize("E, extra", [(512, 0.0), (48, 0.0), (24, 1.0)])
def test_frozen_memory_is_about_one_more_copy(E, extra, rng):
    """The packed copies: one more copy of the projection weights (rounded up to 16-row
    panels); when the key/value rows do not start a panel they are packed on their own too."""
    m = MultiHeadAttention(E, 4 if E % 16 else 8, seed=0).freeze()
    pk = m._prepared_weights().packed
    weight_bytes = sum(a.nbytes for n, a in m.params.items() if n.endswith("weight"))
    bases = {}
    for a in pk:
        if a is not None:
            base = a.base if a.base is not None else a
            bases[id(base)] = base.nbytes
    packed_bytes = sum(bases.values())
    assert packed_bytes <= (1.0 + extra) * weight_bytes * 1.34 + 64 * len(bases)
    if E == 512:  # a multiple of 16: just the one copy (plus alignment slack)
        assert packed_bytes <= weight_bytes + 128 * len(bases)


def test_frozen_zero_feature_keys_and_empty_batches(rng):
    m = randomise(MultiHeadAttention(16, 2, kdim=0, vdim=5, seed=0), rng)
    f = copy.deepcopy(m).freeze()
    assert f._prepared_weights().packed is not None
    x = randn(rng, (2, 3, 16), np.float32)
    k = np.zeros((2, 4, 0), np.float32)
    v = randn(rng, (2, 4, 5), np.float32)
    np.testing.assert_allclose(f(x, k, v), m(x, k, v), rtol=2e-5, atol=2e-5)
    g = randomise(MultiHeadAttention(16, 2, seed=0), rng).freeze()
    assert g(np.zeros((0, 3, 16), np.float32)).shape == (0, 3, 16)
    assert g(np.zeros((2, 0, 16), np.float32)).shape == (2, 0, 16)
