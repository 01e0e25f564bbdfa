"""LayerNorm, Dropout, FeedForward, MeanPooling, Sequential and the functional
layer_norm / gelu / relu / dropout: values and gradients against torch (float64)."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import functional as F
from fastattn.layers import Dropout, FeedForward, LayerNorm, Linear, MeanPooling, Sequential
from support import randn

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("affine,bias", [(True, True), (True, False), (False, False)])
def test_layer_norm_matches_torch(affine, bias, rng):
    ln = LayerNorm(6, 1e-4, elementwise_affine=affine, bias=bias, dtype=np.float64)
    for a in ln.parameters().values():
        a[...] = randn(rng, a.shape)
    x, g = randn(rng, (2, 3, 6), scale=3.0) + 5.0, randn(rng, (2, 3, 6))
    t = torch.nn.LayerNorm(6, 1e-4, elementwise_affine=affine, bias=bias, dtype=torch.float64)
    if affine:
        ln2 = LayerNorm.from_torch(t)
        assert ln2.get_config()["eps"] == 1e-4
        with torch.no_grad():
            for n, p in t.named_parameters():
                p.copy_(torch.from_numpy(ln.parameters()[n]))
    tx = torch.tensor(x, requires_grad=True)
    ty = t(tx)
    ty.backward(torch.from_numpy(g))
    out, backprop = ln.forward_backward(x)
    np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ln(x), out, rtol=0, atol=0)
    (dx,) = backprop(g)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    for n, p in t.named_parameters():
        np.testing.assert_allclose(ln.grads[n], p.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_layer_norm_float32_accuracy(rng):
    x = (randn(rng, (64, 256)) * 10 + 100).astype(np.float32)
    w, b = randn(rng, (256,), np.float32), randn(rng, (256,), np.float32)
    ref = (x.astype(np.float64) - x.astype(np.float64).mean(-1, keepdims=True)) / np.sqrt(
        x.astype(np.float64).var(-1, keepdims=True) + 1e-5) * w + b
    ours = F.layer_norm(x, w, b)
    theirs = torch.nn.functional.layer_norm(torch.from_numpy(x), (256,), torch.from_numpy(w),
                                            torch.from_numpy(b)).numpy()
    assert ours.dtype == np.float32
    assert np.sqrt(np.mean((ours - ref) ** 2)) <= 1.1 * np.sqrt(np.mean((theirs - ref) ** 2))


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_and_relu_match_torch(approximate, rng):
    x = randn(rng, (5, 7), scale=3.0)
    x[0, 0] = 0.0
    g = randn(rng, (5, 7))
    tx = torch.tensor(x, requires_grad=True)
    ty = torch.nn.functional.gelu(tx, approximate=approximate)
    ty.backward(torch.from_numpy(g))
    np.testing.assert_allclose(F.gelu(x, approximate), ty.detach().numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(F.gelu_backward(g, x, approximate), tx.grad.numpy(), rtol=1e-12, atol=1e-14)
    tx = torch.tensor(x, requires_grad=True)
    torch.relu(tx).backward(torch.from_numpy(g))
    np.testing.assert_array_equal(F.relu(x), np.maximum(x, 0))
    np.testing.assert_array_equal(F.relu_backward(g, x), tx.grad.numpy())
    assert np.isnan(F.relu(np.array([np.nan]))[0])


def test_dropout_layer_seeded_and_scaled(rng):
    x = randn(rng, (4, 50))
    a, b = Dropout(0.3, seed=5), Dropout(0.3, seed=5)
    out, backprop = a.forward_backward(x)
    np.testing.assert_array_equal(out, b(x))          # same seed, same mask
    kept = out != 0
    assert 0.5 < kept.mean() < 0.9
    np.testing.assert_allclose(out[kept], x[kept] / 0.7, rtol=1e-15)
    g = randn(rng, x.shape)
    (dx,) = backprop(g)
    np.testing.assert_allclose(dx, np.where(kept, g / 0.7, 0.0), rtol=1e-15)
    a.eval()
    assert a(x) is x and a.forward_backward(x)[1](g)[0] is g
    with pytest.raises(ValueError, match=r"^p: expected a probability in \[0, 1\), got 1.0"):
        Dropout(1.0)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_matches_torch(activation, rng):
    ff = FeedForward(6, 10, activation=activation, seed=3, dtype=np.float64)
    x, g = randn(rng, (2, 4, 6)), randn(rng, (2, 4, 6))
    l1, l2 = torch.nn.Linear(6, 10, dtype=torch.float64), torch.nn.Linear(10, 6, dtype=torch.float64)
    sd = ff.state_dict()
    with torch.no_grad():
        for name, mod in (("linear1", l1), ("linear2", l2)):
            mod.weight.copy_(torch.from_numpy(sd[name + ".weight"]))
            mod.bias.copy_(torch.from_numpy(sd[name + ".bias"]))
    act = torch.relu if activation == "relu" else torch.nn.functional.gelu
    tx = torch.tensor(x, requires_grad=True)
    ty = l2(act(l1(tx)))
    ty.backward(torch.from_numpy(g))
    out, backprop = ff.forward_backward(x)
    np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-12, atol=1e-13)
    (dx,) = backprop(g)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    grads = dict(ff.named_grads())
    for name, mod in (("linear1", l1), ("linear2", l2)):
        np.testing.assert_allclose(grads[name + ".weight"], mod.weight.grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(grads[name + ".bias"], mod.bias.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_feed_forward_training_dropout_is_the_ops_composed(activation, rng):
    """In training with dropout, FeedForward (relu: one fused relu + dropout
    pass each way) gives the bits of linear, activation, dropout and linear
    composed from fastattn.functional with the same generator draw."""
    import copy
    ff = FeedForward(16, 40, activation=activation, dropout=0.25, seed=3)
    ff.train()
    x = randn(rng, (2, 9, 16), np.float32)
    g = randn(rng, (2, 9, 16), np.float32)
    gen = copy.deepcopy(ff.dropout._gen)
    sd = ff.state_dict()
    out, backprop = ff.forward_backward(x)
    (dx,) = backprop(g)
    h = F.linear(x, sd["linear1.weight"], sd["linear1.bias"])
    a = F.relu(h) if activation == "relu" else F.gelu(h)
    d, keep = F.dropout(a, 0.25, rng=gen)
    want = F.linear(d, sd["linear2.weight"], sd["linear2.bias"])
    np.testing.assert_array_equal(out, want)
    gd = F.linear_backward(g, d, sd["linear2.weight"], sd["linear2.bias"])[0]
    ga = F.dropout_backward(gd, keep, 0.25)
    gh = F.relu_backward(ga, d) if activation == "relu" else F.gelu_backward(ga, h)
    want_dx = F.linear_backward(gh, x, sd["linear1.weight"], sd["linear1.bias"])[0]
    np.testing.assert_array_equal(dx, want_dx)


def test_mean_pooling_masked(rng):
    x, g = randn(rng, (3, 4, 5)), randn(rng, (3, 5))
    m = np.array([[True] * 4, [True, True, False, False], [False] * 4])
    out, backprop = MeanPooling().forward_backward(x, m)
    np.testing.assert_allclose(out[0], x[0].mean(0), rtol=1e-14)
    np.testing.assert_allclose(out[1], x[1, :2].mean(0), rtol=1e-14)
    assert not out[2].any()
    dx, dm = backprop(g)
    assert dm is None and not dx[1, 2:].any() and not dx[2].any()
    tx = torch.tensor(x, requires_grad=True)
    tm = torch.from_numpy(m).double()[..., None]
    tout = (tx * tm).sum(1) / tm.sum(1).clamp(min=1)
    tout.backward(torch.from_numpy(g))
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(MeanPooling()(x), x.mean(1), rtol=1e-14)
    with pytest.raises(ValueError, match=r"^mask: expected shape \(3, 4\), got \(3, 5\)"):
        MeanPooling()(x, np.ones((3, 5), bool))


def test_sequential_chains_and_round_trips_its_config(rng):
    seq = Sequential(Linear(4, 6, seed=1, dtype=np.float64), LayerNorm(6, dtype=np.float64),
                     FeedForward(6, 8, activation="gelu", seed=2, dtype=np.float64))
    assert [n for n, _ in seq.named_parameters()][:3] == ["0.weight", "0.bias", "1.weight"]
    x, g = randn(rng, (3, 4)), randn(rng, (3, 6))
    out, backprop = seq.forward_backward(x)
    np.testing.assert_allclose(out, seq(x), rtol=0, atol=0)
    (dx,) = backprop(g)
    eps = 1e-6
    for idx in [(0, 0), (2, 3)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        fd = (np.sum(seq(xp) * g) - np.sum(seq(xm) * g)) / (2 * eps)
        np.testing.assert_allclose(dx[idx], fd, rtol=1e-6)
    again = Sequential.from_config(seq.get_config())
    assert [type(layer).__name__ for layer in again] == ["Linear", "LayerNorm", "FeedForward"]
    assert again.load_state_dict(seq.state_dict()) is again
    np.testing.assert_array_equal(again(x), seq(x))
    with pytest.raises(ValueError, match="unknown layer class 'os.system'"):
        Sequential.from_config({"layers": [{"class": "os.system", "config": {}}]})
    with pytest.raises(TypeError, match=r"^layers\[1\]: expected a fastattn Layer"):
        Sequential(Linear(2, 2), "relu")


@pytest.mark.parametrize("hops,penalty", [(1, 0.0), (3, 0.5)])
def test_attention_pooling_matches_torch(hops, penalty, rng):
    from fastattn.layers import AttentionPooling
    layer = AttentionPooling(6, 5, hops, seed=2, dtype=np.float64)
    x = randn(rng, (3, 4, 6))
    mask = np.array([[True] * 4, [True, True, True, False], [True, False, False, False]])
    (out, P), backprop = layer.forward_backward(x, mask, penalty=penalty)
    ref, a = layer(x, mask, return_weights=True)
    np.testing.assert_allclose(out, ref, rtol=0, atol=0)
    assert out.shape == (3, hops * 6) and a.shape == (3, hops, 4)
    assert not a[1, :, 3].any() and np.allclose(a.sum(-1), 1.0)
    g = randn(rng, out.shape)
    dx, dm = backprop(g)
    assert dm is None
    tx = torch.tensor(x, requires_grad=True)
    W1 = torch.tensor(layer.parameters()["W_s1"], requires_grad=True)
    W2 = torch.tensor(layer.parameters()["W_s2"], requires_grad=True)
    s = (torch.tanh(tx @ W1.T) @ W2.T).transpose(1, 2)
    s = s.masked_fill(~torch.from_numpy(mask)[:, None, :], float("-inf"))
    ta = torch.softmax(s, -1)
    tm = (ta @ tx).reshape(3, -1)
    gram = ta @ ta.transpose(1, 2) - torch.eye(hops, dtype=torch.float64)
    tp = (gram ** 2).sum((1, 2)).mean()
    ((tm * torch.from_numpy(g)).sum() + penalty * tp).backward()
    np.testing.assert_allclose(out, tm.detach().numpy(), rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(P, tp.item(), rtol=1e-12)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.grads["W_s1"], W1.grad.numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(layer.grads["W_s2"], W2.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_positional_embedding(rng):
    from fastattn.layers import PositionalEmbedding
    sin = PositionalEmbedding(10, 6, kind="sinusoidal", dtype=np.float64)
    x = randn(rng, (2, 7, 6))
    pe = sin(x) - x
    p, i = 5, 2   # feature 2i = 4 is sin, 2i + 1 = 5 is cos
    np.testing.assert_allclose(pe[1, p, 4], np.sin(p / 10000 ** (4 / 6)), rtol=1e-12)
    np.testing.assert_allclose(pe[0, p, 5], np.cos(p / 10000 ** (4 / 6)), rtol=1e-12)
    assert sin.parameters() == {}
    learned = PositionalEmbedding(10, 6, seed=1, dtype=np.float64)
    out, backprop = learned.forward_backward(x)
    np.testing.assert_allclose(out, x + learned.parameters()["weight"][:7], rtol=1e-15)
    g = randn(rng, x.shape)
    (dx,) = backprop(g)
    np.testing.assert_array_equal(dx, g)
    np.testing.assert_allclose(learned.grads["weight"][:7], g.sum(0), rtol=1e-14)
    assert not learned.grads["weight"][7:].any()
    with pytest.raises(ValueError, match=r"^x: expected at most max_len=10 positions, got 11"):
        learned(randn(rng, (1, 11, 6)))
