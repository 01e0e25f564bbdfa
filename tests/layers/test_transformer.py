"""TransformerEncoderLayer / TransformerEncoder against torch's (batch_first=True),
float64: outputs and every gradient, post-norm and norm_first, key padding,
causal, relu and gelu."""
from __future__ import annotations

import numpy as np
import pytest

from fastattn.layers import TransformerEncoder, TransformerEncoderLayer
from support import randn

torch = pytest.importorskip("torch")


def _torch_layer(norm_first, activation, bias=True):
    torch.manual_seed(0)
    return torch.nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation=activation,
                                            batch_first=True, norm_first=norm_first, bias=bias,
                                            dtype=torch.float64)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("masking", ["none", "padding", "causal"])
def test_encoder_layer_matches_torch(norm_first, activation, masking, rng):
    t = _torch_layer(norm_first, activation)
    layer = TransformerEncoderLayer.from_torch(t)
    assert layer.get_config()["norm_first"] is norm_first
    x, g = randn(rng, (3, 5, 8)), randn(rng, (3, 5, 8))
    pad = np.ones((3, 5), bool)
    pad[1, 3:] = False
    kw, tkw = {}, {}
    if masking == "padding":
        kw, tkw = {"key_mask": pad}, {"src_key_padding_mask": torch.from_numpy(~pad)}
    elif masking == "causal":
        kw = {"is_causal": True}
        tkw = {"src_mask": torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64),
               "is_causal": True}
    t.train()   # dropout 0: train mode keeps torch on its reference (non-fused) path
    tx = torch.tensor(x, requires_grad=True)
    ty = t(tx, **tkw)
    ty.backward(torch.from_numpy(g))
    out, backprop = layer.forward_backward(x, **kw)
    np.testing.assert_allclose(layer(x, **kw), out, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    (dx,) = backprop(g)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    grads = dict(layer.named_grads())
    for name, p in t.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_encoder_stack_matches_torch(rng):
    torch.manual_seed(1)
    base = torch.nn.TransformerEncoderLayer(8, 4, 12, dropout=0.0, batch_first=True,
                                            dtype=torch.float64)
    t = torch.nn.TransformerEncoder(base, 2, norm=torch.nn.LayerNorm(8, dtype=torch.float64),
                                    enable_nested_tensor=False)
    enc = TransformerEncoder.from_torch(t)
    assert [n for n, _ in enc.named_parameters()] == [n for n, _ in t.named_parameters()]
    x, g = randn(rng, (2, 6, 8)), randn(rng, (2, 6, 8))
    tx = torch.tensor(x, requires_grad=True)
    t.train()
    ty = t(tx)
    ty.backward(torch.from_numpy(g))
    out, backprop = enc.forward_backward(x)
    np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-10, atol=1e-12)
    (dx,) = backprop(g)
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-9, atol=1e-11)
    grads = dict(enc.named_grads())
    for name, p in t.named_parameters():
        np.testing.assert_allclose(grads[name], p.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_dropout_is_seeded_and_off_in_eval(rng):
    a = TransformerEncoderLayer(8, 2, 16, dropout=0.3, seed=4, dtype=np.float64)
    b = TransformerEncoderLayer(8, 2, 16, dropout=0.3, seed=4, dtype=np.float64)
    x = randn(rng, (2, 5, 8))
    np.testing.assert_array_equal(a(x), b(x))
    a.eval()
    np.testing.assert_array_equal(a(x), a(x))
    assert not np.array_equal(a(x), b(x))


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_training_dropout_is_the_sublayers_composed(activation, norm_first, rng):
    """In training with dropout (relu: the feed-forward's relu and dropout in
    one fused pass each way), the layer's output, input gradient and weight
    gradients are the bits of its sublayers' own forward_backward composed in
    torch's order, with the same generator draws (a deep copy of the layer)."""
    import copy
    from fastattn import functional as F
    enc = TransformerEncoderLayer(16, 2, 40, dropout=0.25, activation=activation,
                                  norm_first=norm_first, seed=3)
    ref = copy.deepcopy(enc)
    x = randn(rng, (2, 9, 16), np.float32)
    g = randn(rng, (2, 9, 16), np.float32)
    mask = np.ones((2, 9), bool)
    mask[1, 6:] = False
    out, backprop = enc.forward_backward(x, key_mask=mask)
    (dx,) = backprop(g)

    act = F.relu if activation == "relu" else F.gelu
    back = []
    h = x
    if norm_first:
        a_in, b = ref.norm1.forward_backward(h)
        back.append(("n1", b))
    else:
        a_in = h
    sa, b_sa = ref.self_attn.forward_backward(a_in, key_mask=mask)
    sa, b_d1 = ref.dropout1.forward_backward(sa)
    h1 = x + sa
    if not norm_first:
        h1, b_n1 = ref.norm1.forward_backward(h1)
    f_in, b_n2 = ref.norm2.forward_backward(h1) if norm_first else (h1, None)
    u, b_l1 = ref.linear1.forward_backward(f_in)
    a = act(u)
    a, b_d = ref.dropout.forward_backward(a)
    f, b_l2 = ref.linear2.forward_backward(a)
    f, b_d2 = ref.dropout2.forward_backward(f)
    want = h1 + f
    if not norm_first:
        want, b_n2 = ref.norm2.forward_backward(want)
    np.testing.assert_array_equal(out, want)

    gg = g
    if not norm_first:
        (gg,) = b_n2(gg)
    (gf,) = b_d2(gg)
    (ga,) = b_l2(gf)
    (ga,) = b_d(ga)
    gu = F.relu_backward(ga, a) if activation == "relu" else F.gelu_backward(ga, u)
    (gh,) = b_l1(gu)
    if norm_first:
        (gh,) = b_n2(gh)
    gh = gh + gg
    if not norm_first:
        (gh,) = b_n1(gh)
    (gs,) = b_d1(gh)
    (gx,) = b_sa(gs)
    if norm_first:
        (gx,) = back[0][1](gx)
    want_dx = gx + gh
    np.testing.assert_array_equal(dx, want_dx)
    ref_grads = dict(ref.named_grads())
    for name, gr in enc.named_grads():
        np.testing.assert_array_equal(gr, ref_grads[name], err_msg=name)


@pytest.mark.parametrize("norm_first", [False, True])
def test_input_grad_false_skips_dx_keeps_the_weight_gradients(norm_first, rng):
    """``input_grad=False`` (data that needs no gradient, a torch tensor
    without requires_grad): backprop returns (None,), and every weight
    gradient has the bits of the input_grad=True call -- for the layer, a
    stack (only its first layer skips) and MultiHeadAttention itself; a
    non-bool is refused by name."""
    import copy
    from fastattn.layers import MultiHeadAttention
    x = randn(rng, (2, 7, 16), np.float32)
    g = randn(rng, (2, 7, 16), np.float32)
    mask = np.ones((2, 7), bool)
    mask[0, 5:] = False
    for make in (lambda: TransformerEncoderLayer(16, 2, 24, dropout=0.2, norm_first=norm_first,
                                                 seed=5),
                 lambda: TransformerEncoder(
                     TransformerEncoderLayer(16, 2, 24, dropout=0.2, norm_first=norm_first,
                                             seed=5), 2)):
        a = make()
        b = copy.deepcopy(a)
        out_a, back_a = a.forward_backward(x, key_mask=mask)
        out_b, back_b = b.forward_backward(x, key_mask=mask, input_grad=False)
        np.testing.assert_array_equal(out_a, out_b)
        (dx,) = back_a(g)
        assert dx is not None and dx.shape == x.shape
        assert back_b(g) == (None,)
        gb = dict(b.named_grads())
        for name, ga in a.named_grads():
            np.testing.assert_array_equal(ga, gb[name], err_msg=name)
    m = MultiHeadAttention(16, 4, seed=1)
    m2 = copy.deepcopy(m)
    _, bk = m.forward_backward(x)
    _, bk2 = m2.forward_backward(x, input_grad=False)
    assert bk(g)[0] is not None and bk2(g) == (None,)
    g2 = dict(m2.named_grads())
    for name, ga in m.named_grads():
        np.testing.assert_array_equal(ga, g2[name], err_msg=name)
    with pytest.raises(TypeError, match="input_grad"):
        TransformerEncoderLayer(16, 2, 24, seed=5).forward_backward(x, input_grad="no")
    with pytest.raises(TypeError, match="input_grad"):
        m.forward_backward(x, input_grad=1)
    from fastattn import functional as F
    with pytest.raises(TypeError, match="input_grads"):
        F.multi_head_attention_forward_backward(x, x, x, num_heads=4, input_grads=None,
                                                **m._weights())
