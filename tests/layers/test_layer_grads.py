"""The Layer base's gradient store (grads, named_grads, zero_grad, train/eval)
and forward_backward of Linear and Embedding, against torch autograd (float64)."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn.layers import Embedding, Linear, RNNEncoder
from support import randn

torch = pytest.importorskip("torch")


def test_grads_beside_the_parameters():
    enc = RNNEncoder(11, 6, 5, seed=0)
    names = [n for n, _ in enc.named_parameters()]
    grads = dict(enc.named_grads())
    assert list(grads) == names
    for n, p in enc.named_parameters():
        assert grads[n].shape == p.shape and grads[n].dtype == p.dtype and not grads[n].any()
    # the live accumulators: the same arrays on every access
    lin = Linear(3, 2, seed=1)
    assert lin.grads["weight"] is lin.grads["weight"]
    lin.grads["weight"][...] = 1.0
    assert lin.zero_grad() is lin and not lin.grads["weight"].any()


def test_load_state_dict_keeps_gradients_of_the_same_shape():
    lin = Linear(3, 2, seed=1)
    lin.grads["bias"][...] = 2.0
    lin.load_state_dict(Linear(3, 2, seed=5).state_dict())
    assert np.all(lin.grads["bias"] == 2.0)


def test_train_eval_reach_children():
    enc = RNNEncoder(11, 6, 5, seed=0)
    assert enc.training and all(layer.training for _, layer in enc._walk())
    assert enc.eval() is enc
    assert not any(layer.training for _, layer in enc._walk())
    enc.train()
    assert all(layer.training for _, layer in enc._walk())
    with pytest.raises(TypeError, match="^mode: expected a bool"):
        enc.train(1)


def test_forward_backward_missing_is_clear():
    from fastattn.layers._base import Layer

    class Bare(Layer):
        def __init__(self):
            self._params, self._config = {}, {}
    with pytest.raises(NotImplementedError, match="^Bare has no forward_backward"):
        Bare().forward_backward(np.zeros(3))


@pytest.mark.parametrize("bias", [True, False])
def test_linear_forward_backward_matches_torch(bias, rng):
    lin = Linear(7, 5, bias=bias, seed=2, dtype=np.float64)
    x = randn(rng, (3, 4, 7))[:, ::-1]          # non-contiguous
    g = randn(rng, (3, 4, 5))
    out, backprop = lin.forward_backward(x)
    np.testing.assert_array_equal(out, lin(x))
    (dx,) = backprop(g)
    tl = torch.nn.Linear(7, 5, bias=bias, dtype=torch.float64)
    with torch.no_grad():
        tl.weight.copy_(torch.from_numpy(lin.parameters()["weight"]))
        if bias:
            tl.bias.copy_(torch.from_numpy(lin.parameters()["bias"]))
    tx = torch.tensor(np.ascontiguousarray(x), requires_grad=True)
    tl(tx).backward(torch.from_numpy(g))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(lin.grads["weight"], tl.weight.grad.numpy(), rtol=1e-12, atol=1e-13)
    if bias:
        np.testing.assert_allclose(lin.grads["bias"], tl.bias.grad.numpy(), rtol=1e-12, atol=1e-13)
    # backprop adds: a second call doubles the accumulated gradients
    w1 = lin.grads["weight"].copy()
    backprop(g)
    np.testing.assert_allclose(lin.grads["weight"], 2 * w1, rtol=1e-14)


def test_linear_forward_backward_finite_differences(rng):
    lin = Linear(4, 3, seed=3, dtype=np.float64)
    x, g = randn(rng, (2, 4)), randn(rng, (2, 3))
    _, backprop = lin.forward_backward(x)
    (dx,) = backprop(g)
    w = lin.parameters()["weight"]
    eps = 1e-6
    for idx in [(0, 0), (2, 3), (1, 2)]:
        old = w[idx]
        w[idx] = old + eps
        up = float(np.sum(lin(x) * g))
        w[idx] = old - eps
        down = float(np.sum(lin(x) * g))
        w[idx] = old
        np.testing.assert_allclose(lin.grads["weight"][idx], (up - down) / (2 * eps), rtol=1e-7)
    for idx in [(0, 1), (1, 3)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        fd = (np.sum(lin(xp) * g) - np.sum(lin(xm) * g)) / (2 * eps)
        np.testing.assert_allclose(dx[idx], fd, rtol=1e-7)


def test_embedding_forward_backward_matches_torch(rng):
    emb = Embedding(9, 4, padding_idx=2, seed=4, dtype=np.float64)
    ids = np.array([[1, 2, 1, 8], [2, 0, 1, 5]])
    g = randn(rng, (2, 4, 4))
    out, backprop = emb.forward_backward(ids)
    ids[0, 0] = 7                                 # changing ids afterwards changes nothing
    assert backprop(g) == (None,)
    te = torch.nn.Embedding(9, 4, padding_idx=2, dtype=torch.float64)
    with torch.no_grad():
        te.weight.copy_(torch.from_numpy(emb.weight))
    te(torch.tensor([[1, 2, 1, 8], [2, 0, 1, 5]])).backward(torch.from_numpy(g))
    np.testing.assert_allclose(emb.grads["weight"], te.weight.grad.numpy(), rtol=1e-13, atol=1e-15)
    assert not emb.grads["weight"][2].any()


def test_float32_gradients_stay_float32(rng):
    lin = Linear(6, 3, seed=0)
    _, backprop = lin.forward_backward(randn(rng, (5, 6), np.float32))
    (dx,) = backprop(randn(rng, (5, 3), np.float32))
    assert dx.dtype == np.float32 and lin.grads["weight"].dtype == np.float32


def _torch_mha(layer):
    t = torch.nn.MultiheadAttention(layer.embed_dim, layer.num_heads, bias=layer.bias,
                                    kdim=layer.kdim, vdim=layer.vdim, batch_first=True,
                                    dtype=torch.float64)
    with torch.no_grad():
        for name, p in t.named_parameters():
            p.copy_(torch.from_numpy(layer.state_dict()[name]))
    return t


@pytest.mark.parametrize("kind", ["self", "cross_kv", "cross_split"])
def test_mha_forward_backward_matches_torch(kind, rng):
    from fastattn.layers import MultiHeadAttention
    kdim = 6 if kind == "cross_split" else None
    layer = MultiHeadAttention(8, 2, kdim=kdim, vdim=kdim, seed=3, dtype=np.float64)
    x = randn(rng, (2, 5, 8))
    kv = randn(rng, (2, 7, kdim or 8))
    pad = np.ones((2, 7 if kind != "self" else 5), bool)
    pad[1, -2:] = False
    g = randn(rng, (2, 5, 8))
    args = (x,) if kind == "self" else (x, kv) if kind == "cross_kv" else (x, kv, kv.copy())
    out, backprop = layer.forward_backward(*args, key_mask=pad)
    np.testing.assert_allclose(out, layer(*args, key_mask=pad), rtol=1e-13, atol=1e-14)
    grads_in = backprop(g)
    assert len(grads_in) == len(args)
    t = _torch_mha(layer)
    targs = [torch.tensor(a, requires_grad=True) for a in args]
    tq, tk, tv = (targs[0], targs[0], targs[0]) if kind == "self" else \
        (targs[0], targs[1], targs[1]) if kind == "cross_kv" else targs
    tout, _ = t(tq, tk, tv, key_padding_mask=torch.from_numpy(~pad), need_weights=False)
    tout.backward(torch.from_numpy(g))
    for a, ta in zip(grads_in, targs):
        np.testing.assert_allclose(a, ta.grad.numpy(), rtol=1e-10, atol=1e-12)
    for name, p in t.named_parameters():
        np.testing.assert_allclose(dict(layer.named_grads())[name], p.grad.numpy(),
                                   rtol=1e-10, atol=1e-12, err_msg=name)


def _fd_check(f, arrays, analytic, rng, n=6, eps=1e-6, rtol=1e-6, atol=1e-9):
    """Central differences of the scalar f() at n random entries of each array
    against the analytic gradients (same order)."""
    for a, d in zip(arrays, analytic):
        for _ in range(n):
            idx = tuple(int(rng.integers(s)) for s in a.shape)
            old = a[idx]
            a[idx] = old + eps
            up = f()
            a[idx] = old - eps
            down = f()
            a[idx] = old
            np.testing.assert_allclose(d[idx], (up - down) / (2 * eps), rtol=rtol, atol=atol)


@pytest.mark.parametrize("sim", ["dot", "scaled_dot", "general", "additive", "concat", "cosine"])
def test_attention_forward_backward_finite_differences(sim, rng):
    from fastattn.layers import Attention
    layer = Attention(5, 4, 3, similarity=sim, embed_dim=6, out_dim=2, bias=True, seed=7,
                      dtype=np.float64)
    for name, a in layer.parameters().items():      # biases off zero: their gradients matter
        if name.startswith("b_"):
            a[...] = randn(rng, a.shape, scale=0.3)
    x, kv, vv = randn(rng, (2, 3, 5)), randn(rng, (2, 4, 4)), randn(rng, (2, 4, 3))
    pad = np.array([[True] * 4, [True, True, True, False]])
    g = randn(rng, (2, 3, 2))
    out, backprop = layer.forward_backward(x, kv, vv, key_mask=pad)
    np.testing.assert_allclose(out, layer(x, kv, vv, key_mask=pad), rtol=1e-12, atol=1e-14)
    dx, dk, dv = backprop(g)

    def loss():
        return float(np.sum(layer(x, kv, vv, key_mask=pad) * g))
    names = list(layer.parameters())
    _fd_check(loss, [layer.parameters()[n] for n in names] + [x, kv, vv],
              [layer.grads[n] for n in names] + [dx, dk, dv], rng)
    assert not dk[1, 3].any() and not dv[1, 3].any()   # the padded key gets nothing


def test_self_attention_forward_backward_matches_torch(rng):
    from fastattn.layers import SelfAttention
    layer = SelfAttention(6, similarity="scaled_dot", causal=True, bias=True, seed=1,
                          dtype=np.float64)
    x, g = randn(rng, (2, 5, 6)), randn(rng, (2, 5, 6))
    out, backprop = layer.forward_backward(x)
    (dx,) = backprop(g)
    P = {n: torch.tensor(a, requires_grad=True) for n, a in layer.parameters().items()}
    tx = torch.tensor(x, requires_grad=True)
    q = tx @ P["W_Q"].T + P["b_Q"]
    k = tx @ P["W_K"].T + P["b_K"]
    v = tx @ P["W_V"].T + P["b_V"]
    tout = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    tout.backward(torch.from_numpy(g))
    np.testing.assert_allclose(out, tout.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    for n, t in P.items():
        np.testing.assert_allclose(layer.grads[n], t.grad.numpy(), rtol=1e-10, atol=1e-12, err_msg=n)


def _torch_rnn(layer):
    cls = {"GRU": torch.nn.GRU, "LSTM": torch.nn.LSTM, "RNN": torch.nn.RNN}[layer._mode]
    kw = {"nonlinearity": layer._config.get("nonlinearity", "tanh")} if layer._mode == "RNN" else {}
    t = cls(layer.input_size, layer.hidden_size, layer.num_layers, bias=layer.bias,
            bidirectional=layer.bidirectional, batch_first=True, dtype=torch.float64, **kw)
    with torch.no_grad():
        for name, p in t.named_parameters():
            p.copy_(torch.from_numpy(layer.parameters()[name]))
    return t


@pytest.mark.parametrize("mode", ["GRU", "LSTM", "RNN"])
@pytest.mark.parametrize("shape", ["plain", "stacked_bidir_lengths", "state"])
def test_rnn_forward_backward_matches_torch(mode, shape, rng):
    from fastattn.layers import GRU, LSTM, SimpleRNN
    cls = {"GRU": GRU, "LSTM": LSTM, "RNN": SimpleRNN}[mode]
    nl, bi = (2, True) if shape == "stacked_bidir_lengths" else (1, False)
    layer = cls(5, 4, nl, bidirectional=bi, seed=2, dtype=np.float64)
    B, T, D = 3, 6, 2 if bi else 1
    x = randn(rng, (B, T, 5))
    lengths = np.array([6, 3, 4]) if shape == "stacked_bidir_lengths" else None
    state = None
    if shape == "state":
        h0 = randn(rng, (nl * D, B, 4))
        state = (h0, randn(rng, (nl * D, B, 4))) if mode == "LSTM" else h0
    (out, final), backprop = layer.forward_backward(x, state, lengths=lengths)
    ref_out, ref_final = layer(x, state, lengths=lengths)
    np.testing.assert_allclose(out, ref_out, rtol=1e-13, atol=1e-14)
    go = randn(rng, out.shape)
    gh = randn(rng, (nl * D, B, 4))
    gstate = (gh, randn(rng, gh.shape)) if mode == "LSTM" else gh
    dx, dstate = backprop(go, gstate)

    t = _torch_rnn(layer)
    tx = torch.tensor(x, requires_grad=True)
    tstate = None
    if state is not None:
        tstate = tuple(torch.tensor(s, requires_grad=True) for s in state) if mode == "LSTM" \
            else torch.tensor(state, requires_grad=True)
    inp = tx
    if lengths is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(tx, torch.tensor(lengths), batch_first=True,
                                                      enforce_sorted=False)
    tout, tfinal = t(inp, tstate)
    if lengths is not None:
        tout, _ = torch.nn.utils.rnn.pad_packed_sequence(tout, batch_first=True, total_length=T)
    loss = (tout * torch.from_numpy(go)).sum()
    tfinals = tfinal if mode == "LSTM" else (tfinal,)
    gparts = gstate if mode == "LSTM" else (gstate,)
    for tf, gp in zip(tfinals, gparts):
        loss = loss + (tf * torch.from_numpy(gp)).sum()
    loss.backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    for name, p in t.named_parameters():
        np.testing.assert_allclose(layer.grads[name], p.grad.numpy(), rtol=1e-9, atol=1e-11,
                                   err_msg=name)
    if state is None:
        assert dstate is None
    else:
        ds = dstate if mode == "LSTM" else (dstate,)
        ts = tstate if mode == "LSTM" else (tstate,)
        for a, ta in zip(ds, ts):
            np.testing.assert_allclose(a, ta.grad.numpy(), rtol=1e-9, atol=1e-11)


def test_rnn_encoder_forward_backward_matches_torch(rng):
    enc = RNNEncoder(10, 4, 3, cell="lstm", bidirectional=True, padding_idx=0, seed=1,
                     dtype=np.float64)
    src = np.array([[3, 4, 5, 1], [2, 9, 0, 0]])
    mask = np.array([[True] * 4, [True, True, False, False]])
    (out, final, m), backprop = enc.forward_backward(src, src_mask=mask)
    np.testing.assert_array_equal(m, mask)
    go = randn(rng, out.shape)
    assert backprop(go) == (None, None)
    emb = torch.nn.Embedding(10, 4, padding_idx=0, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(enc.embedding.weight))
    t = _torch_rnn(enc.rnn)
    packed = torch.nn.utils.rnn.pack_padded_sequence(emb(torch.tensor(src)), torch.tensor([4, 2]),
                                                     batch_first=True, enforce_sorted=False)
    tout, _ = t(packed)
    tout, _ = torch.nn.utils.rnn.pad_packed_sequence(tout, batch_first=True, total_length=4)
    (tout * torch.from_numpy(go)).sum().backward()
    grads = dict(enc.named_grads())
    np.testing.assert_allclose(grads["embedding.weight"], emb.weight.grad.numpy(), rtol=1e-9, atol=1e-11)
    for name, p in t.named_parameters():
        np.testing.assert_allclose(grads["rnn." + name], p.grad.numpy(), rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rnn_sees_in_place_updates(dtype, rng):
    """An optimizer updates the parameter arrays in place: the next call uses them
    (also when the input's dtype differs from the layer's)."""
    from fastattn.layers import GRU
    layer = GRU(3, 4, seed=0)
    x = randn(rng, (2, 5, 3), dtype)
    before = layer(x)[0]
    for a in layer.parameters().values():
        a += np.float32(0.1)
    after = layer(x)[0]
    fresh = GRU(3, 4, seed=0)
    fresh.load_state_dict(layer.state_dict())
    np.testing.assert_array_equal(after, fresh(x)[0])
    assert not np.array_equal(before, after)


def test_check_gradients_passes_good_layers_and_catches_a_bad_one(rng):
    from fastattn.layers import GRU, LayerNorm, TransformerEncoderLayer
    from fastattn.testing import check_gradients
    rep = check_gradients(Linear(4, 3, seed=1, dtype=np.float64), randn(rng, (2, 4)))
    assert set(rep) == {"param weight", "param bias", "input 0"}
    check_gradients(GRU(3, 4, 2, bidirectional=True, seed=2, dtype=np.float64), randn(rng, (2, 5, 3)),
                    lengths=np.array([5, 3]))
    check_gradients(TransformerEncoderLayer(8, 2, 12, dropout=0.0, norm_first=True, seed=3,
                                            dtype=np.float64), randn(rng, (2, 4, 8)), is_causal=True)

    class Wrong(LayerNorm):
        def forward_backward(self, x):
            out, back = super().forward_backward(x)
            return out, lambda g: (back(g)[0] * 1.01,)
    with pytest.raises(AssertionError, match=r"^input 0\[.*\]: backward gives"):
        check_gradients(Wrong(5, dtype=np.float64), randn(rng, (3, 5)))
