"""fastattn.layers.MultiHeadAttention: init, forward == functional, state dicts, configs, loaders."""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np
import pytest

import fastattn
from fastattn import _reference
from fastattn.layers import MultiHeadAttention
from support import REPO_ROOT, assert_close, randn

ROOT = REPO_ROOT


def randomise(layer, rng):
    """Non-zero biases (the default init has zero biases) so every parameter matters."""
    sd = {k: randn(rng, v.shape, v.dtype, 0.3) for k, v in layer.state_dict().items()}
    return layer.load_state_dict(sd)


def oracle_of(layer, q, k, v, **kw):
    p, E = layer.params, layer.embed_dim
    kvE = layer.num_kv_heads * layer.head_dim
    if layer.packed:
        W = p["in_proj_weight"]
        wq, wk, wv = W[:E], W[E:E + kvE], W[E + kvE:]
    else:
        wq, wk, wv = p["q_proj_weight"], p["k_proj_weight"], p["v_proj_weight"]
    b = p.get("in_proj_bias")
    bias = {}
    if b is not None:
        bias = dict(b_query=b[:E], b_key=b[E:E + kvE], b_value=b[E + kvE:], b_out=p["out_proj.bias"])
    return _reference.multi_head_attention(q, k, v, num_heads=layer.num_heads,
                                           num_kv_heads=layer.num_kv_heads, w_query=wq, w_key=wk,
                                           w_value=wv, w_out=p["out_proj.weight"], **bias, **kw)


# --------------------------------------------------------------------------
# Init and parameters

def test_param_names_and_shapes():
    m = MultiHeadAttention(16, 4)
    assert {k: v.shape for k, v in m.params.items()} == {
        "in_proj_weight": (48, 16), "in_proj_bias": (48,), "out_proj.weight": (16, 16),
        "out_proj.bias": (16,)}
    m = MultiHeadAttention(16, 4, kdim=6, vdim=10, bias=False, num_kv_heads=2, dtype=np.float64)
    assert {k: v.shape for k, v in m.params.items()} == {
        "q_proj_weight": (16, 16), "k_proj_weight": (8, 6), "v_proj_weight": (8, 10),
        "out_proj.weight": (16, 16)}
    assert all(v.dtype == np.float64 for v in m.params.values())


def test_seeded_init_like_torch():
    a = MultiHeadAttention(64, 8, seed=3)
    b = MultiHeadAttention(64, 8, seed=3)
    c = MultiHeadAttention(64, 8, seed=4)
    for k in a.params:
        np.testing.assert_array_equal(a.params[k], b.params[k])
    assert not np.array_equal(a.params["in_proj_weight"], c.params["in_proj_weight"])
    w = a.params["in_proj_weight"]
    bound = math.sqrt(6 / (64 + 192))  # xavier-uniform over the packed (3E, E) matrix
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.95 * bound
    assert abs(w.std() - bound / math.sqrt(3)) < 0.05 * bound
    wo = a.params["out_proj.weight"]
    assert np.abs(wo).max() <= 1 / 8 and np.abs(wo).max() > 0.95 / 8
    assert np.all(a.params["in_proj_bias"] == 0) and np.all(a.params["out_proj.bias"] == 0)
    rng = np.random.default_rng(5)
    d = MultiHeadAttention(64, 8, seed=rng)  # a Generator works too
    assert d.params["in_proj_weight"].shape == (192, 64)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"embed_dim": 0, "num_heads": 1}, ValueError, r"embed_dim: expected a positive integer, got 0"),
    ({"embed_dim": 10, "num_heads": 3}, ValueError, r"num_heads: expected a divisor of embed_dim=10, got 3"),
    ({"embed_dim": 8, "num_heads": 4, "num_kv_heads": 3}, ValueError,
     r"num_kv_heads: expected a divisor of num_heads=4, got 3"),
    ({"embed_dim": 8, "num_heads": 2.5}, TypeError, r"num_heads: expected a positive integer, got float 2.5"),
    ({"embed_dim": 8, "num_heads": 2, "kdim": -1}, ValueError, r"kdim: expected an integer >= 0, got -1"),
    ({"embed_dim": 8, "num_heads": 2, "vdim": 1.0}, TypeError, r"vdim: expected an integer >= 0, got float 1.0"),
    ({"embed_dim": 8, "num_heads": 2, "bias": 1}, TypeError, r"bias: expected a bool, got int 1"),
    ({"embed_dim": 8, "num_heads": 2, "dtype": np.float16}, TypeError,
     r"dtype: expected float32 or float64, got float16"),
    ({"embed_dim": 8, "num_heads": 2, "dtype": "nonsense"}, TypeError, r"dtype: expected float32 or float64, got 'nonsense'"),
])
def test_constructor_errors(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        MultiHeadAttention(**kwargs)


# --------------------------------------------------------------------------
# Forward

@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("layout", ["packed", "kdim_vdim", "gqa", "no_bias"])
def test_layer_equals_functional_and_oracle(dtype, layout, rng):
    kw = {"packed": {}, "kdim_vdim": {"kdim": 6, "vdim": 10}, "gqa": {"num_kv_heads": 2},
          "no_bias": {"bias": False}}[layout]
    m = randomise(MultiHeadAttention(16, 4, dtype=dtype, seed=0, **kw), rng)
    B, Lq, Lk = 2, 5, 7
    x = randn(rng, (B, Lq, 16), dtype)
    k = randn(rng, (B, Lk, m.kdim), dtype)
    v = randn(rng, (B, Lk, m.vdim), dtype)
    km = np.ones((B, Lk), bool)
    km[0, 4:] = False
    packed_out, packed_w = m(x, k, v, key_mask=km, return_weights=True)
    m.auto_pack = False   # the arrays read in place: the functional's kernels on the same buffers
    out, w = m(x, k, v, key_mask=km, return_weights=True)
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(packed_out, out, **tol)
    np.testing.assert_allclose(packed_w, w, **tol)
    p = m.params
    if m.packed:
        weights = dict(w_qkv=p["in_proj_weight"], b_qkv=p.get("in_proj_bias"))
    else:
        b = p.get("in_proj_bias")
        weights = dict(w_query=p["q_proj_weight"], w_key=p["k_proj_weight"], w_value=p["v_proj_weight"])
        if b is not None:
            kvE = m.num_kv_heads * m.head_dim
            weights.update(b_query=b[:16], b_key=b[16:16 + kvE], b_value=b[16 + kvE:])
    f_out, f_w = fastattn.multi_head_attention(
        x, k, v, num_heads=4, num_kv_heads=m.num_kv_heads, w_out=p["out_proj.weight"],
        b_out=p.get("out_proj.bias"), key_mask=km, return_weights=True, **weights)
    np.testing.assert_array_equal(out, f_out)
    np.testing.assert_array_equal(w, f_w)
    r_out, r_w = oracle_of(m, x, k, v, key_mask=km, return_weights=True)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)


@pytest.mark.parametrize(("kdim", "vdim"), [(0, 6), (6, 0), (0, 0)])
def test_zero_feature_keys_and_values(kdim, vdim, rng):
    """kdim / vdim = 0 are valid sizes (as in the functional): the projections are their biases."""
    m = randomise(MultiHeadAttention(8, 2, kdim=kdim, vdim=vdim), rng)
    assert m.params["k_proj_weight"].shape == (8, kdim)
    q = randn(rng, (2, 3, 8), np.float32)
    k = randn(rng, (2, 5, kdim), np.float32)
    v = randn(rng, (2, 5, vdim), np.float32)
    assert_close(m(q, k, v), oracle_of(m, q, k, v), np.float32)


def test_input_sizes_are_checked_against_the_layer(rng):
    """A wrong feature size names the input (it used to blame w_qkv, which the user never passed)."""
    m = MultiHeadAttention(8, 2)
    for E in (6, 7):
        with pytest.raises(ValueError, match=rf"^query: expected last dim embed_dim=8 \(this layer's\), "
                                             rf"got shape \(2, 3, {E}\)$"):
            m(np.ones((2, 3, E), np.float32))
    x = np.ones((2, 3, 8), np.float32)
    with pytest.raises(ValueError, match=r"^key: expected last dim kdim=8 \(this layer's\), got shape \(2, 3, 5\)$"):
        m(x, np.ones((2, 3, 5), np.float32), x)
    with pytest.raises(ValueError, match=r"^value: expected last dim vdim=8 .*got shape \(2, 3, 5\) \(value defaults to the key\)$"):
        MultiHeadAttention(8, 2, kdim=5)(x, np.ones((2, 3, 5), np.float32))
    with pytest.raises(ValueError, match=r"^key: expected last dim kdim=4 .*got shape \(3, 8\) \(key defaults to the query\)$"):
        MultiHeadAttention(8, 2, kdim=4, vdim=4)(x[0])
    with pytest.raises(ValueError, match=r"^query: expected last dim embed_dim=8 .*got shape \(2, 6\)$"):
        m([[0.0] * 6] * 2)   # lists are checked without a conversion here


@pytest.mark.parametrize("layout", ["packed", "gqa"])
def test_causal_alignment_bottom_right(layout, rng):
    """Decoding with a cache: the last Lq queries of a causal sequence see every earlier key."""
    kw = {"num_kv_heads": 2} if layout == "gqa" else {}
    m = randomise(MultiHeadAttention(16, 4, **kw), rng)
    q = randn(rng, (2, 3, 16), np.float32)
    kv = randn(rng, (2, 7, 16), np.float32)
    out, w = m(q, kv, kv, is_causal=True, causal_alignment="bottom_right", return_weights=True)
    ref = oracle_of(m, q, kv, kv, is_causal=True, causal_alignment="bottom_right")
    assert_close(out, ref, np.float32)
    assert (w[:, 0, 5:] == 0).all() and (w[:, 0, :5] > 0).all()   # query 0 sees keys 0..4
    assert (w[:, 2] > 0).all()
    top = m(q, kv, kv, is_causal=True)
    assert_close(top, oracle_of(m, q, kv, kv, is_causal=True), np.float32)
    assert not np.allclose(top, out)
    with pytest.raises(ValueError, match=r"causal_alignment: expected 'top_left' or 'bottom_right', got 'right'"):
        m(q, kv, kv, is_causal=True, causal_alignment="right")
    with pytest.raises(TypeError, match=r"takes from 2 to 4 positional arguments"):
        m(q, kv, kv, None)


def test_self_attention_defaults_and_unbatched(rng):
    m = randomise(MultiHeadAttention(12, 3, seed=1), rng)
    x = randn(rng, (2, 6, 12), np.float32)
    np.testing.assert_array_equal(m(x), m(x, x, x))
    r = oracle_of(m, x, x, x, is_causal=True)
    assert_close(m(x, is_causal=True), r, np.float32)
    mem = randn(rng, (2, 4, 12), np.float32)
    np.testing.assert_array_equal(m(x, mem), m(x, mem, mem))  # value defaults to key
    out, w = m(x[1], return_weights=True, average_weights=False)
    assert out.shape == (6, 12) and w.shape == (3, 6, 6)
    assert_close(out, oracle_of(m, x[1], x[1], x[1]), np.float32)
    assert_close(out, m(x)[1].astype(np.float64), np.float32)


def test_layer_does_not_modify_inputs_or_params(rng):
    m = randomise(MultiHeadAttention(8, 2, seed=0), rng)
    x = randn(rng, (2, 3, 8), np.float32)
    xc, sd = x.copy(), m.state_dict()
    m(x, return_weights=True)
    np.testing.assert_array_equal(x, xc)
    for k, v in m.params.items():
        np.testing.assert_array_equal(v, sd[k])


# --------------------------------------------------------------------------
# State dicts and configs

def test_state_dict_round_trip(rng):
    a = randomise(MultiHeadAttention(16, 4, kdim=5, vdim=7, num_kv_heads=2, seed=0), rng)
    sd = a.state_dict()
    sd["out_proj.weight"][0, 0] += 1.0  # a copy: the layer is unchanged
    assert a.params["out_proj.weight"][0, 0] != sd["out_proj.weight"][0, 0]
    b = MultiHeadAttention.from_config(a.get_config()).load_state_dict(a.state_dict())
    x = randn(rng, (2, 3, 16), np.float32)
    k, v = randn(rng, (2, 4, 5), np.float32), randn(rng, (2, 4, 7), np.float32)
    np.testing.assert_array_equal(a(x, k, v), b(x, k, v))
    # float64 arrays load into a float32 layer as float32 copies
    c = MultiHeadAttention(16, 4, kdim=5, vdim=7, num_kv_heads=2)
    c.load_state_dict({n: t.astype(np.float64) for n, t in a.state_dict().items()})
    assert all(t.dtype == np.float32 for t in c.params.values())
    np.testing.assert_array_equal(c(x, k, v), a(x, k, v))


def test_config_round_trip_json():
    m = MultiHeadAttention(16, 4, kdim=5, bias=False, num_kv_heads=1, dtype=np.float64)
    cfg = m.get_config()
    assert cfg == {"embed_dim": 16, "num_heads": 4, "kdim": 5, "vdim": 16, "bias": False,
                   "num_kv_heads": 1, "dtype": "float64"}
    again = MultiHeadAttention.from_config(json.loads(json.dumps(cfg)))
    assert again.get_config() == cfg
    assert {k: v.shape for k, v in again.params.items()} == {k: v.shape for k, v in m.params.items()}
    assert "kdim=5" in repr(m) and "num_kv_heads=1" in repr(m)


def test_state_dict_errors(rng):
    m = MultiHeadAttention(8, 2)
    sd = m.state_dict()
    with pytest.raises(ValueError, match=r"state_dict: expected the keys in_proj_weight, in_proj_bias, "
                                         r"out_proj.weight, out_proj.bias; missing out_proj.bias"):
        m.load_state_dict({k: v for k, v in sd.items() if k != "out_proj.bias"})
    with pytest.raises(ValueError, match=r"unexpected extra"):
        m.load_state_dict(dict(sd, extra=np.zeros(1)))
    with pytest.raises(ValueError, match=r"state_dict\['in_proj_weight'\]: expected shape \(24, 8\), got \(8, 24\)"):
        m.load_state_dict(dict(sd, in_proj_weight=sd["in_proj_weight"].T))
    with pytest.raises(TypeError, match=r"state_dict: expected a mapping of names to arrays, got list"):
        m.load_state_dict([1, 2])
    with pytest.raises(TypeError, match=r"state_dict\['out_proj.bias'\]: expected a real floating-point array, got dtype <U1"):
        m.load_state_dict(dict(sd, **{"out_proj.bias": np.array(["a"] * 8)}))
    before = m.state_dict()
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.bias'\]: expected shape \(8,\), got \(9,\)"):
        m.load_state_dict(dict(sd, **{"out_proj.bias": np.zeros(9)}))
    for k, v in m.params.items():  # a failed load leaves the layer as it was
        np.testing.assert_array_equal(v, before[k])


def test_config_errors():
    with pytest.raises(ValueError, match=r"config: unknown keys \['heads'\]"):
        MultiHeadAttention.from_config({"embed_dim": 8, "heads": 2})
    with pytest.raises(ValueError, match=r"config: missing required key 'num_heads'"):
        MultiHeadAttention.from_config({"embed_dim": 8})
    with pytest.raises(TypeError, match=r"config: expected a mapping, got str"):
        MultiHeadAttention.from_config("embed_dim=8")


# --------------------------------------------------------------------------
# PyTorch interop

def _torch_module(torch, E, H, dtype=None, seed=0, **kw):
    torch.manual_seed(seed)
    m = torch.nn.MultiheadAttention(E, H, dtype=dtype, **kw)
    if m.in_proj_bias is not None:
        with torch.no_grad():
            m.in_proj_bias.normal_()
            m.out_proj.bias.normal_()
    return m.eval()


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("layout", ["packed", "kdim_vdim", "no_bias", "float64"])
@pytest.mark.parametrize("source", ["module", "state_dict"])
def test_from_torch(batch_first, layout, source, rng):
    torch = pytest.importorskip("torch")
    E, H, B, Lq, Lk = 32, 4, 2, 6, 9
    kw = {"kdim_vdim": {"kdim": 12, "vdim": 20}, "no_bias": {"bias": False}}.get(layout, {})
    tdt = torch.float64 if layout == "float64" else torch.float32
    dtype = np.float64 if layout == "float64" else np.float32
    tm = _torch_module(torch, E, H, dtype=tdt, batch_first=batch_first, **kw)
    if source == "module":
        m = MultiHeadAttention.from_torch(tm)
    else:
        m = MultiHeadAttention.from_torch(tm.state_dict(), num_heads=H)
    assert m.dtype == dtype and m.kdim == kw.get("kdim", E) and m.bias == (layout != "no_bias")
    q = randn(rng, (B, Lq, E), dtype)
    k = randn(rng, (B, Lk, m.kdim), dtype)
    v = randn(rng, (B, Lk, m.vdim), dtype)
    real = np.ones((B, Lk), bool)
    real[1, 6:] = False
    ours, w = m(q, k, v, key_mask=real, return_weights=True)
    tin = [torch.from_numpy(a if batch_first else np.ascontiguousarray(a.transpose(1, 0, 2)))
           for a in (q, k, v)]
    with torch.inference_mode():
        t_out, t_w = tm(*tin, key_padding_mask=torch.from_numpy(~real))
    t_out = t_out.numpy()
    if not batch_first:
        t_out = t_out.transpose(1, 0, 2)
    assert_close(ours, t_out.astype(np.float64), dtype)
    assert_close(w, t_w.numpy().astype(np.float64), dtype)
    assert_close(ours, oracle_of(m, q, k, v, key_mask=real), dtype)


def test_from_torch_self_attention_unbatched_and_prefix(rng):
    torch = pytest.importorskip("torch")
    tm = _torch_module(torch, 16, 2, batch_first=True)
    wrapped = {f"encoder.0.self_attn.{k}": v for k, v in tm.state_dict().items()}
    wrapped["encoder.0.linear1.weight"] = torch.zeros(3, 3)  # other layers' keys are ignored
    m = MultiHeadAttention.from_torch(wrapped, num_heads=2, prefix="encoder.0.self_attn.")
    x = randn(rng, (5, 16), np.float32)
    causal = ~np.tri(5, 5, dtype=bool)
    with torch.inference_mode():
        tx = torch.from_numpy(x)
        t_out = tm(tx, tx, tx, attn_mask=torch.from_numpy(causal), need_weights=False)[0].numpy()
    assert_close(m(x, is_causal=True), t_out.astype(np.float64), np.float32)
    assert_close(m(x, attn_mask=~causal), t_out.astype(np.float64), np.float32)


def test_from_torch_errors():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match=r"module_or_state_dict: add_bias_kv=True is not supported"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(ValueError, match=r"module_or_state_dict: add_zero_attn=True is not supported"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2, add_zero_attn=True))
    with pytest.raises(TypeError, match=r"expected a torch.nn.MultiheadAttention or its state_dict\(\), got Linear"):
        MultiHeadAttention.from_torch(torch.nn.Linear(2, 2))
    sd = torch.nn.MultiheadAttention(8, 2).state_dict()
    with pytest.raises(TypeError, match=r"num_heads: a state dict does not record the number of heads"):
        MultiHeadAttention.from_torch(sd)
    with pytest.raises(ValueError, match=r"num_heads: expected a divisor of embed_dim=8, got 3"):
        MultiHeadAttention.from_torch(sd, num_heads=3)
    with pytest.raises(ValueError, match=r"num_heads: the module has 2 heads, got num_heads=4"):
        MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(8, 2), num_heads=4)
    with pytest.raises(ValueError, match=r"state_dict: expected a torch.nn.MultiheadAttention state dict with 'out_proj.weight'"):
        MultiHeadAttention.from_torch({"weight": np.zeros((2, 2))}, num_heads=1)
    with pytest.raises(ValueError, match=r"state_dict: projection rows 20 do not fit embed_dim=8 with 2 heads"):
        MultiHeadAttention.from_torch(dict(sd, in_proj_weight=torch.zeros(20, 8)), num_heads=2)


def test_from_torch_argument_checks():
    torch = pytest.importorskip("torch")
    mod = torch.nn.MultiheadAttention(8, 2)
    with pytest.raises(TypeError, match=r"^num_heads: expected a positive integer, got str '2'$"):
        MultiHeadAttention.from_torch(mod, num_heads="2")
    with pytest.raises(TypeError, match=r"^num_heads: expected a positive integer, got str '2'$"):
        MultiHeadAttention.from_torch(mod.state_dict(), num_heads="2")
    assert MultiHeadAttention.from_torch(mod, num_heads=np.int64(2)).num_heads == 2
    sd = mod.state_dict()
    with pytest.raises(ValueError, match=r"^state_dict\['in_proj_weight'\]: expected a 2-D .* got shape \(\)$"):
        MultiHeadAttention.from_torch(dict(sd, in_proj_weight=torch.tensor(1.0)), num_heads=2)
    for name in ("in_proj_weight", "in_proj_bias", "out_proj.bias"):
        for bad in (sd[name].to(torch.int32), sd[name] > 0):
            with pytest.raises(TypeError, match=rf"^state_dict\[{name!r}\]: expected a real floating-point "
                                                rf"tensor, got dtype torch\.(int32|bool)$"):
                MultiHeadAttention.from_torch(dict(sd, **{name: bad}), num_heads=2)
    arr = {k: v.numpy() for k, v in sd.items()}
    with pytest.raises(TypeError, match=r"^state_dict\['out_proj.weight'\]: expected a real floating-point "
                                        r"array, got dtype int64$"):
        MultiHeadAttention.from_torch(dict(arr, **{"out_proj.weight": np.ones((8, 8), np.int64)}), num_heads=2)
    with pytest.raises(TypeError, match=r"^state_dict\['out_proj.bias'\]: expected a real floating-point array, got dtype bool$"):
        MultiHeadAttention(8, 2).load_state_dict(dict(arr, **{"out_proj.bias": np.ones(8, bool)}))


@pytest.mark.parametrize("tdtype", ["bfloat16", "float16"])
def test_from_torch_low_precision_module(tdtype, rng):
    """bfloat16 (which NumPy cannot hold) and float16 modules load through .float()."""
    torch = pytest.importorskip("torch")
    tm = _torch_module(torch, 16, 2, batch_first=True).to(getattr(torch, tdtype))
    m = MultiHeadAttention.from_torch(tm)
    assert m.dtype == np.float32
    for k, v in tm.state_dict().items():
        np.testing.assert_array_equal(m.params[k], v.float().numpy())
    x = randn(rng, (2, 5, 16), np.float32)
    assert_close(m(x), oracle_of(m, x, x, x), np.float32)


def test_from_torch_state_dict_errors(rng):
    E = 8
    sd = {"out_proj.weight": randn(rng, (E, E)), "q_proj_weight": randn(rng, (E, E))}
    with pytest.raises(ValueError, match=r"state_dict: expected in_proj_weight \(packed\) or q_proj_weight, "
                                         r"k_proj_weight, v_proj_weight \(separate\)"):
        MultiHeadAttention.from_torch(sd, num_heads=2)
    bad = dict(sd, k_proj_weight=randn(rng, (E,)), v_proj_weight=randn(rng, (E, 3)))
    with pytest.raises(ValueError, match=r"state_dict: k/v_proj_weight must be 2-D, got \(8,\), \(8, 3\)"):
        MultiHeadAttention.from_torch(bad, num_heads=2)
    with pytest.raises(ValueError, match=r"state_dict: bias_k \(add_bias_kv=True\) is not supported"):
        MultiHeadAttention.from_torch(dict(sd, bias_k=np.zeros((1, 1, E))), num_heads=2)
    with pytest.raises(ValueError, match=r"state_dict\['out_proj.weight'\]: expected a 2-D \(E, E\) weight, got shape \(8,\)"):
        MultiHeadAttention.from_torch({"out_proj.weight": np.zeros(8)}, num_heads=2)
    # separate layout with other kdim/vdim loads; a GQA state dict (fewer key/value rows) too
    ok = dict(sd, k_proj_weight=randn(rng, (4, 3)), v_proj_weight=randn(rng, (4, 5)))
    m = MultiHeadAttention.from_torch(ok, num_heads=2)
    assert (m.kdim, m.vdim, m.num_kv_heads, m.bias) == (3, 5, 1, False)


def test_from_torch_state_dict_needs_no_torch(rng):
    """A state dict of NumPy arrays loads without torch (the inference path never imports it)."""
    E = 8
    sd = {"in_proj_weight": randn(rng, (3 * E, E)), "in_proj_bias": randn(rng, (3 * E,)),
          "out_proj.weight": randn(rng, (E, E)), "out_proj.bias": randn(rng, (E,))}
    m = MultiHeadAttention.from_torch(sd, num_heads=2)
    assert m.dtype == np.float64
    for k in sd:
        np.testing.assert_array_equal(m.params[k], sd[k])


# --------------------------------------------------------------------------
# BERT-style weights

def _bert_state_dict(rng, E, prefix, kdim=None):
    sd = {}
    for name in ("query", "key", "value"):
        sd[f"{prefix}attention.self.{name}.weight"] = randn(rng, (E, E if name == "query" else (kdim or E)),
                                                            np.float32, 0.2)
        sd[f"{prefix}attention.self.{name}.bias"] = randn(rng, (E,), np.float32, 0.2)
    sd[f"{prefix}attention.output.dense.weight"] = randn(rng, (E, E), np.float32, 0.2)
    sd[f"{prefix}attention.output.dense.bias"] = randn(rng, (E,), np.float32, 0.2)
    sd[f"{prefix}attention.output.LayerNorm.weight"] = np.ones(E, np.float32)
    return sd


def _bert_reference(sd, prefix, x, H, real):
    """BERT self-attention as Hugging Face computes it, in float64 NumPy."""
    g = lambda n: sd[prefix + n].astype(np.float64)  # noqa: E731
    B, L, E = x.shape
    dh = E // H

    def split(t):
        return t.reshape(B, L, H, dh).transpose(0, 2, 1, 3)

    q = split(x @ g("attention.self.query.weight").T + g("attention.self.query.bias"))
    k = split(x @ g("attention.self.key.weight").T + g("attention.self.key.bias"))
    v = split(x @ g("attention.self.value.weight").T + g("attention.self.value.bias"))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(dh)
    s = s + np.where(real, 0.0, np.finfo(np.float64).min)[:, None, None, :]  # the extended mask
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    ctx = (p @ v).transpose(0, 2, 1, 3).reshape(B, L, E)
    return ctx @ g("attention.output.dense.weight").T + g("attention.output.dense.bias")


@pytest.mark.parametrize("prefix", ["", "bert.encoder.layer.3."])
def test_from_bert(prefix, rng):
    E, H = 24, 3
    sd = _bert_state_dict(rng, E, prefix)
    m = MultiHeadAttention.from_bert(sd, num_heads=H, prefix=prefix)
    assert m.packed and m.bias
    x = randn(rng, (2, 7, E), np.float32)
    real = np.ones((2, 7), bool)
    real[1, 5:] = False
    assert_close(m(x, key_mask=real), _bert_reference(sd, prefix, x, H, real), np.float32)


def test_from_bert_module_names_and_tensors(rng):
    torch = pytest.importorskip("torch")
    E = 16
    sd = _bert_state_dict(rng, E, "")
    # a BertAttention's own state dict has no leading "attention."
    own = {k[len("attention."):]: torch.from_numpy(v) for k, v in sd.items()}
    m = MultiHeadAttention.from_bert(own, num_heads=4)
    ref = MultiHeadAttention.from_bert(sd, num_heads=4)
    for k in m.params:
        np.testing.assert_array_equal(m.params[k], ref.params[k])


def test_from_bert_errors(rng):
    sd = _bert_state_dict(rng, 8, "bert.encoder.layer.0.")
    with pytest.raises(ValueError, match=re.escape(
            "state_dict: no key 'attention.self.query.weight'; the mapping has "
            "'bert.encoder.layer.0.attention.self.query.weight': pass prefix='bert.encoder.layer.0.'")):
        MultiHeadAttention.from_bert(sd, num_heads=2)
    p = "bert.encoder.layer.0."
    no_kb = {k: v for k, v in sd.items() if k != p + "attention.self.key.bias"}
    with pytest.raises(ValueError, match=r"either all of self.query/key/value.bias and output.dense.bias or none .*found 3 of 4"):
        MultiHeadAttention.from_bert(no_kb, num_heads=2, prefix=p)
    with pytest.raises(ValueError, match=r"num_heads: expected a divisor of the hidden size 8, got 3"):
        MultiHeadAttention.from_bert(sd, num_heads=3, prefix=p)
    no_dense = {k: v for k, v in sd.items() if "output.dense.weight" not in k}
    with pytest.raises(ValueError, match=r"state_dict: missing 'bert.encoder.layer.0.attention.output.dense.weight'"):
        MultiHeadAttention.from_bert(no_dense, num_heads=2, prefix=p)
    with pytest.raises(TypeError, match=r"num_heads: expected a positive integer, got NoneType"):
        MultiHeadAttention.from_bert(sd, num_heads=None, prefix=p)
    kv = dict(sd, **{p + "attention.self.key.weight": np.zeros((6, 8), np.float32)})
    with pytest.raises(ValueError, match=r"state_dict: key/value weights \(6, 8\), \(8, 8\) do not fit 2 heads of 4"):
        MultiHeadAttention.from_bert(kv, num_heads=2, prefix=p)
    sq = dict(sd, **{p + "attention.self.query.weight": np.zeros((8, 6), np.float32)})
    with pytest.raises(ValueError, match=r"state_dict: expected square query and output.dense weights \(E, E\), got \(8, 6\)"):
        MultiHeadAttention.from_bert(sq, num_heads=2, prefix=p)
    flat = dict(sd, **{p + "attention.self.value.weight": np.zeros(8, np.float32)})
    with pytest.raises(ValueError, match=r"state_dict\['bert.encoder.layer.0.attention.self.value.weight'\]: expected a 2-D weight"):
        MultiHeadAttention.from_bert(flat, num_heads=2, prefix=p)
    with pytest.raises(TypeError, match=r"state_dict: expected a mapping of names to arrays, got list"):
        MultiHeadAttention.from_bert([], num_heads=2)


@pytest.mark.parametrize("own", [False, True])
def test_from_bert_refuses_relative_positions(own, rng):
    """position_embedding_type='relative_key(_query)' adds a distance embedding to the scores;
    loading only query/key/value silently gave wrong results."""
    p = "bert.encoder.layer.0."
    sd = _bert_state_dict(rng, 8, p)
    sd[p + "attention.self.distance_embedding.weight"] = np.zeros((1023, 4), np.float32)
    if own:  # a BertAttention's own names
        sd = {k[len(p + "attention."):]: v for k, v in sd.items()}
        p = ""
    key = ("" if own else "bert.encoder.layer.0.attention.") + "self.distance_embedding.weight"
    with pytest.raises(ValueError, match=rf"^state_dict: unsupported key\(s\) {re.escape(repr(key))}: only "
                                         r"BERT's absolute position embeddings are supported "
                                         r"\(position_embedding_type='absolute'\)"):
        MultiHeadAttention.from_bert(sd, num_heads=2, prefix=p)
    # other layers' keys elsewhere in the mapping are not this block's business
    other = _bert_state_dict(rng, 8, "bert.encoder.layer.0.")
    other["bert.encoder.layer.1.attention.self.distance_embedding.weight"] = np.zeros((3, 4), np.float32)
    assert MultiHeadAttention.from_bert(other, num_heads=2, prefix="bert.encoder.layer.0.").bias


# --------------------------------------------------------------------------
# The README example runs as written

def _readme_example():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    m = re.search(r"<!-- mha-example -->\s*```python\n(.*?)```", text, re.S)
    assert m, "README.md: the multi-head example block (after <!-- mha-example -->) is missing"
    return m.group(1)


def test_readme_example_runs():
    pytest.importorskip("torch")
    code = _readme_example()
    assert len(code.strip().splitlines()) <= 14
    ns = {}
    exec(compile(code, "README.md:mha-example", "exec"), ns)
    # the example's own assertion compared against torch; check what it computed too
    assert ns["out"].shape == (2, 10, 64) and isinstance(ns["out"], np.ndarray)
