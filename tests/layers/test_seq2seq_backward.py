"""AttentionDecoder.forward_backward and Seq2Seq.forward_backward /
loss_and_grads: the forward against the inference path (precomputed keys),
every gradient (parameters, initial state, encoder memory) against torch
autograd on an explicit float64 decoder loop written from seq2seq.py's math
(Bahdanau-additive-GRU, Luong-general-LSTM), and central finite differences of
the inference forward for the other similarity / cell / layer combinations and
the whole model.  Upstream gradients are random; sources are padded (masked memory positions
must get exactly zero gradient)."""
from __future__ import annotations

import numpy as np
import pytest

from fastattn.layers import AttentionDecoder, RNNEncoder, Seq2Seq
from fastattn.losses import cross_entropy

V, E, H = 7, 5, 6
B, S, T = 3, 5, 4
LENGTHS = np.array([5, 3, 1])


def make_decoder(style, sim, cell, num_layers=1, seed=0, dtype=np.float64):
    dec = AttentionDecoder(V, E, H, H, style=style, similarity=sim, attn_dim=4, cell=cell,
                           num_layers=num_layers, seed=seed, dtype=dtype)
    rng = np.random.default_rng(seed + 100)
    # non-trivial values everywhere (biases, the general score's scale, cosine's beta)
    dec.load_state_dict({k: v + 0.3 * rng.standard_normal(v.shape) for k, v in dec.state_dict().items()})
    return dec


def make_inputs(dec, seed=1, masked=True):
    rng = np.random.default_rng(seed)
    mem = rng.standard_normal((B, S, dec.memory_dim))
    mask = np.arange(S)[None, :] < LENGTHS[:, None] if masked else None
    tgt = rng.integers(0, V, (B, T))
    st0 = dec.initial_state(B)
    st = (tuple(0.5 * rng.standard_normal(s.shape) for s in st0) if isinstance(st0, tuple)
          else 0.5 * rng.standard_normal(st0.shape))
    return mem, mask, tgt, st


def upstream(rng, dec, final):
    g_logits = rng.standard_normal((B, T, V))
    g_state = (tuple(rng.standard_normal(s.shape) for s in final) if isinstance(final, tuple)
               else rng.standard_normal(final.shape))
    return g_logits, g_state


def leaves(x):
    return list(x) if isinstance(x, tuple) else [x]


# ------------------------------------------------------------------ torch
torch = pytest.importorskip("torch")


def t_cell(cell, x, h, c, p, k):
    wih, whh = p[f"rnn.weight_ih_l{k}"], p[f"rnn.weight_hh_l{k}"]
    gi = x @ wih.T + p[f"rnn.bias_ih_l{k}"]
    gh = h @ whh.T + p[f"rnn.bias_hh_l{k}"]
    if cell == "gru":
        ir, iz, in_ = gi.chunk(3, -1)
        hr, hz, hn = gh.chunk(3, -1)
        r, z = torch.sigmoid(ir + hr), torch.sigmoid(iz + hz)
        n = torch.tanh(in_ + r * hn)
        return (1 - z) * n + z * h, None
    if cell == "lstm":
        i, f, g, o = (gi + gh).chunk(4, -1)
        c1 = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        return torch.sigmoid(o) * torch.tanh(c1), c1
    return torch.tanh(gi + gh), None


def t_score(sim, q, mem, p):
    """q (B, H), mem (B, S, D) -> scores (B, S), the raw score (no precomputed keys)."""
    if sim == "additive":
        a = (q @ p["attn.W_q"].T)[:, None, :] + mem @ p["attn.W_k"].T + p["attn.b"]
        return torch.tanh(a) @ p["attn.v"]
    if sim == "general":
        return p["attn.scale"] * torch.einsum("na,ab,nsb->ns", q, p["attn.W"], mem)
    raise AssertionError(sim)


def torch_decoder(dec, mem, mask, tgt, st, sim, cell, detach_keys=False):
    """An explicit decoder loop; returns (leaf tensors dict, logits, final state list)."""
    p = {n: torch.tensor(a, requires_grad=True) for n, a in dec.named_parameters()}
    m = torch.tensor(mem, requires_grad=True)
    s0 = [torch.tensor(a, requires_grad=True) for a in leaves(st)]
    L = dec.rnn.num_layers
    h = [s0[0][k] for k in range(L)]
    c = [s0[1][k] for k in range(L)] if cell == "lstm" else [None] * L
    allowed = torch.tensor(mask) if mask is not None else torch.ones(B, S, dtype=torch.bool)
    keys_mem = m.detach() if detach_keys else m

    def attend(q):
        sc = t_score(sim, q, keys_mem, p).masked_fill(~allowed, float("-inf"))
        a = torch.softmax(sc, -1)
        return torch.einsum("bs,bsd->bd", a, m)

    emb = p["embedding.weight"][torch.tensor(tgt)]
    logits = []
    for t in range(T):
        if dec.style == "bahdanau":
            x = torch.cat([emb[:, t], attend(h[-1])], -1)
        else:
            x = emb[:, t]
        for k in range(L):
            h[k], c[k] = t_cell(cell, x, h[k], c[k], p, k)
            x = h[k]
        if dec.style == "luong":
            x = torch.tanh(torch.cat([attend(x), x], -1) @ p["combine.weight"].T)
        logits.append(x @ p["out.weight"].T + p["out.bias"])
    final = [torch.stack(h)] + ([torch.stack(c)] if cell == "lstm" else [])
    return p, m, s0, torch.stack(logits, 1), final


@pytest.mark.parametrize("style,sim,cell,num_layers", [
    ("bahdanau", "additive", "gru", 1),
    ("bahdanau", "additive", "gru", 2),
    ("luong", "general", "lstm", 1),
    ("luong", "general", "lstm", 2),
])
def test_decoder_matches_torch(style, sim, cell, num_layers):
    dec = make_decoder(style, sim, cell, num_layers)
    mem, mask, tgt, st = make_inputs(dec)
    (logits, final), backprop = dec.forward_backward(tgt, st, mem, mask)
    rng = np.random.default_rng(7)
    g_logits, g_state = upstream(rng, dec, final)
    _, dstate, dmem = backprop(g_logits, g_state)

    p, m, s0, t_logits, t_final = torch_decoder(dec, mem, mask, tgt, st, sim, cell)
    np.testing.assert_allclose(logits, t_logits.detach().numpy(), rtol=1e-12, atol=1e-12)
    for a, b in zip(leaves(final), t_final):
        np.testing.assert_allclose(a, b.detach().numpy(), rtol=1e-12, atol=1e-12)
    loss = (t_logits * torch.tensor(g_logits)).sum() + sum(
        (f * torch.tensor(g)).sum() for f, g in zip(t_final, leaves(g_state)))
    loss.backward()

    def close(got, want, what):
        want = want.numpy()
        scale = max(np.abs(want).max(), 1e-300)
        assert np.abs(got - want).max() <= 1e-9 * scale, what

    grads = dict(dec.named_grads())
    assert set(grads) == set(p)
    for n, tp in p.items():
        close(grads[n], tp.grad, n)
    close(dmem, m.grad, "memory")
    assert isinstance(dstate, tuple) == (cell == "lstm")
    for a, t0 in zip(leaves(dstate), s0):
        close(a, t0.grad, "state")
    assert np.all(dmem[~mask] == 0)
    assert np.abs(dmem[mask]).min() > 0


def test_memory_gradient_includes_the_key_path():
    """The check above is sensitive: dropping the path through the keys (the
    precomputed key projection) gives a memory gradient that is clearly off."""
    dec = make_decoder("bahdanau", "additive", "gru")
    mem, mask, tgt, st = make_inputs(dec)
    (logits, final), backprop = dec.forward_backward(tgt, st, mem, mask)
    g_logits = np.random.default_rng(3).standard_normal(logits.shape)
    _, _, dmem = backprop(g_logits)
    _, m, _, t_logits, _ = torch_decoder(dec, mem, mask, tgt, st, "additive", "gru", detach_keys=True)
    (t_logits * torch.tensor(g_logits)).sum().backward()
    assert np.abs(dmem - m.grad.numpy()).max() > 1e-3 * np.abs(dmem).max()


# ---------------------------------------------------------- finite differences
def fd_check(dec, mem, mask, tgt, st, g_logits, g_state, grads, dstate, dmem, rng, entries=3,
             eps=1e-6, rtol=1e-6, atol=1e-8):
    """Central differences of the inference path (precompute + forward) of
    <g_logits, logits> + <g_state, final_state>, perturbing a few entries of
    every parameter, of the initial state and of the real memory positions."""
    st_l = [np.array(a) for a in leaves(st)]

    def value():
        s = tuple(st_l) if isinstance(st, tuple) else st_l[0]
        lg, fin, _ = dec.forward(tgt, s, dec.precompute(mem, mask))
        return float(np.sum(lg * g_logits) + sum(np.sum(f * g) for f, g in zip(leaves(fin), leaves(g_state))))

    checks = [(f"param {n}", a, grads[n]) for n, a in dec.named_parameters()]
    if dstate is not None:
        checks += [(f"state {i}", a, d) for i, (a, d) in enumerate(zip(st_l, leaves(dstate)))]
    checks.append(("memory", mem, dmem))
    real = np.argwhere(mask) if mask is not None else None
    for name, arr, grad in checks:
        for _ in range(entries):
            if name == "memory" and real is not None:
                b, s = real[rng.integers(len(real))]
                idx = (int(b), int(s), int(rng.integers(arr.shape[2])))
            else:
                idx = tuple(int(rng.integers(n)) for n in arr.shape)
            old = arr[idx].copy()
            arr[idx] = old + eps
            hi = value()
            arr[idx] = old - eps
            lo = value()
            arr[idx] = old
            fd = (hi - lo) / (2 * eps)
            assert abs(grad[idx] - fd) <= atol + rtol * abs(fd), (name, idx, grad[idx], fd)


COMBOS = [
    ("bahdanau", "dot", "gru", 1), ("luong", "dot", "rnn", 1),
    ("bahdanau", "concat", "lstm", 1), ("luong", "concat", "gru", 2),
    ("bahdanau", "cosine", "rnn", 2), ("luong", "cosine", "lstm", 1),
    ("bahdanau", "general", "lstm", 2), ("luong", "additive", "rnn", 1),
    ("bahdanau", "scaled_dot", "rnn", 1), ("luong", "scaled_dot", "gru", 2),
]


@pytest.mark.parametrize("style,sim,cell,num_layers", COMBOS)
def test_decoder_finite_differences(style, sim, cell, num_layers):
    dec = make_decoder(style, sim, cell, num_layers, seed=num_layers)
    mem, mask, tgt, st = make_inputs(dec, seed=num_layers + 10)
    (logits, final), backprop = dec.forward_backward(tgt, st, mem, mask)
    ref_logits, ref_final, _ = dec.forward(tgt, st, dec.precompute(mem, mask))
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-12, atol=1e-12)
    for a, b in zip(leaves(final), leaves(ref_final)):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(5)
    g_logits, g_state = upstream(rng, dec, final)
    _, dstate, dmem = backprop(g_logits, g_state)
    assert dmem.shape == mem.shape
    assert np.all(dmem[~mask] == 0)
    fd_check(dec, mem, mask, tgt, st, g_logits, g_state, dict(dec.named_grads()), dstate, dmem, rng)


@pytest.mark.parametrize("style", ["bahdanau", "luong"])
def test_decoder_no_mask_no_state(style):
    """No mask; state None (zeros, dstate None); grad_state omitted."""
    dec = make_decoder(style, "additive", "lstm")
    mem, _, tgt, _ = make_inputs(dec, masked=False)
    (logits, final), backprop = dec.forward_backward(tgt, None, mem)
    ref, _, _ = dec.forward(tgt, dec.initial_state(B), dec.precompute(mem))
    np.testing.assert_allclose(logits, ref, rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(2)
    g_logits = rng.standard_normal(logits.shape)
    zero_state = tuple(np.zeros_like(f) for f in final)
    none, dstate, dmem = backprop(g_logits)
    assert none is None and dstate is None
    st = dec.initial_state(B)
    fd_check(dec, mem, None, tgt, st, g_logits, zero_state, dict(dec.named_grads()), None, dmem, rng)
    # the same as an explicit zero state, whose gradient is then returned
    once = {n: a.copy() for n, a in dec.named_grads()}
    dec.zero_grad()
    _, backprop = dec.forward_backward(tgt, st, mem)
    _, dstate, dmem2 = backprop(g_logits)
    np.testing.assert_array_equal(dmem2, dmem)
    assert isinstance(dstate, tuple) and np.abs(dstate[0]).max() > 0
    for n, a in dec.named_grads():
        np.testing.assert_array_equal(a, once[n])


def test_decoder_gradients_accumulate_and_float32():
    dec = make_decoder("luong", "general", "gru")
    mem, mask, tgt, st = make_inputs(dec)
    (logits, _), backprop = dec.forward_backward(tgt, st, mem, mask)
    g = np.random.default_rng(0).standard_normal(logits.shape)
    _, ds1, dm1 = backprop(g)
    once = {n: a.copy() for n, a in dec.named_grads()}
    _, ds2, dm2 = backprop(g)
    for n, a in dec.named_grads():
        np.testing.assert_allclose(a, 2 * once[n], rtol=1e-12, atol=1e-14)
    np.testing.assert_array_equal(dm1, dm2)
    dec.zero_grad()
    assert all(not a.any() for _, a in dec.named_grads())

    d32 = make_decoder("bahdanau", "additive", "lstm", dtype=np.float32)
    m32 = mem.astype(np.float32)
    st32 = d32.initial_state(B)
    (l32, _), bp32 = d32.forward_backward(tgt, st32, m32, mask)
    ref, _, _ = d32.forward(tgt, st32, d32.precompute(m32, mask))
    assert l32.dtype == np.float32
    np.testing.assert_allclose(l32, ref, rtol=1e-5, atol=1e-5)
    _, dstate, dmem = bp32(g.astype(np.float32))
    assert dmem.dtype == np.float32 and dstate[0].dtype == np.float32
    assert all(a.dtype == np.float32 for _, a in d32.named_grads())


def test_decoder_empty_target_and_errors():
    dec = make_decoder("bahdanau", "dot", "gru")
    mem, mask, _, st = make_inputs(dec)
    (logits, final), backprop = dec.forward_backward(np.zeros((B, 0), np.int64), st, mem, mask)
    assert logits.shape == (B, 0, V)
    np.testing.assert_array_equal(final, st)
    gs = np.random.default_rng(0).standard_normal(st.shape)
    _, dstate, dmem = backprop(np.zeros((B, 0, V)), gs)
    np.testing.assert_array_equal(dstate, gs)
    assert not dmem.any()
    tgt = np.zeros((B, T), np.int64)
    _, backprop = dec.forward_backward(tgt, st, mem, mask)
    with pytest.raises(ValueError, match="grad_logits"):
        backprop(np.zeros((B, T + 1, V)))
    with pytest.raises(ValueError, match="grad_state"):
        backprop(np.zeros((B, T, V)), np.zeros((1, B, H + 1)))
    with pytest.raises(TypeError, match="tgt_in"):
        dec.forward_backward(tgt.astype(float), st, mem, mask)
    with pytest.raises(TypeError, match="memory_mask"):
        dec.forward_backward(tgt, st, mem, mask.astype(int))


# ------------------------------------------------------------------ Seq2Seq
def make_model(cell="gru", bidirectional=True, num_layers=1, init_state="encoder",
               style="bahdanau", sim="additive"):
    Dn = 2 if bidirectional else 1
    enc = RNNEncoder(V, 4, 3, cell=cell, num_layers=num_layers, bidirectional=bidirectional,
                     padding_idx=0, seed=3, dtype=np.float64)
    dec = AttentionDecoder(V, 5, Dn * 3, Dn * 3, style=style, similarity=sim, attn_dim=4, cell=cell,
                           num_layers=num_layers, seed=4, dtype=np.float64)
    m = Seq2Seq(enc, dec, bos_id=1, eos_id=2, pad_id=0, init_state=init_state)
    rng = np.random.default_rng(9)
    m.load_state_dict({k: v + 0.3 * rng.standard_normal(v.shape) for k, v in m.state_dict().items()})
    return m


def s2s_batch(seed=0):
    rng = np.random.default_rng(seed)
    mask = np.arange(S)[None, :] < LENGTHS[:, None]
    src = np.where(mask, rng.integers(3, V, (B, S)), 0)
    tgt = rng.integers(3, V, (B, T + 1))
    tgt[:, 0] = 1
    tgt[2, 3:] = 0  # padding in the targets (ignored by the loss)
    return src, mask, tgt[:, :-1], tgt[:, 1:]


def fd_model(model, value, rng, entries=3, eps=1e-6, rtol=1e-6, atol=1e-8):
    grads = dict(model.named_grads())
    for n, arr in model.named_parameters():
        for _ in range(entries):
            idx = tuple(int(rng.integers(k)) for k in arr.shape)
            old = arr[idx].copy()
            arr[idx] = old + eps
            hi = value()
            arr[idx] = old - eps
            lo = value()
            arr[idx] = old
            fd = (hi - lo) / (2 * eps)
            assert abs(grads[n][idx] - fd) <= atol + rtol * abs(fd), (n, idx, grads[n][idx], fd)


MODELS = [
    dict(cell="gru", bidirectional=True, num_layers=1, init_state="encoder", style="bahdanau", sim="additive"),
    dict(cell="lstm", bidirectional=True, num_layers=2, init_state="encoder", style="luong", sim="general"),
    dict(cell="rnn", bidirectional=False, num_layers=2, init_state="encoder", style="bahdanau", sim="concat"),
    dict(cell="lstm", bidirectional=False, num_layers=1, init_state="zeros", style="bahdanau", sim="dot"),
    dict(cell="gru", bidirectional=True, num_layers=2, init_state="zeros", style="luong", sim="cosine"),
]


@pytest.mark.parametrize("kw", MODELS, ids=lambda kw: "-".join(str(v) for v in kw.values()))
def test_seq2seq_forward_backward_finite_differences(kw):
    model = make_model(**kw)
    src, mask, tgt_in, _ = s2s_batch()
    logits, backprop = model.forward_backward(src, tgt_in, mask)
    np.testing.assert_allclose(logits, model.forward(src, tgt_in, mask), rtol=1e-12, atol=1e-12)
    rng = np.random.default_rng(11)
    g = rng.standard_normal(logits.shape)
    model.zero_grad()
    assert backprop(g) == (None, None)
    # every parameter gets a gradient (the encoder through the memory and the bridge)
    for n, a in model.named_grads():
        assert np.abs(a).max() > 0, n
    fd_model(model, lambda: float(np.sum(model.forward(src, tgt_in, mask) * g)), rng)


def test_seq2seq_bridge_gradient():
    """_bridge_backward is the adjoint of _bridge's merge of a bidirectional
    encoder's directions (the end-to-end checks above cover it too); none for
    init_state='zeros'."""
    model = make_model(cell="lstm", bidirectional=True, num_layers=2)
    rng = np.random.default_rng(4)
    dh = rng.standard_normal((2, B, 6))
    dc = rng.standard_normal((2, B, 6))
    back = model._bridge_backward((dh, dc))
    h = rng.standard_normal((4, B, 3))
    c = rng.standard_normal((4, B, 3))
    mh, mc = model._bridge((h, c), B)
    # <d, merge(x)> == <split(d), x>: the split is the adjoint of the merge
    np.testing.assert_allclose(np.sum(dh * mh) + np.sum(dc * mc),
                               np.sum(back[0] * h) + np.sum(back[1] * c), rtol=1e-12)
    np.testing.assert_array_equal(back[0][1::2], dh[..., 3:])
    assert make_model(init_state="zeros")._bridge_backward(np.ones((1, B, 6))) is None


@pytest.mark.parametrize("kw", [MODELS[0], MODELS[1]], ids=["gru-bahdanau", "lstm-luong"])
def test_seq2seq_loss_and_grads(kw):
    model = make_model(**kw)
    src, mask, tgt_in, tgt_out = s2s_batch(1)
    lengths = mask.sum(1)

    def value():
        lg = model.forward(src, tgt_in, lengths=lengths)
        return float(cross_entropy(lg.reshape(-1, V), tgt_out.reshape(-1), ignore_index=0)[0])

    model.zero_grad()
    loss = model.loss_and_grads(src, tgt_in, tgt_out, lengths=lengths)
    assert isinstance(loss, float)
    assert loss == pytest.approx(value(), rel=1e-12)
    fd_model(model, value, np.random.default_rng(12))
    # the padded target positions contribute nothing: changing their logits' source
    # (the input token after the end) leaves the gradients and the loss unchanged
    g1 = {n: a.copy() for n, a in model.named_grads()}
    model.zero_grad()
    tgt_in2 = tgt_in.copy()
    tgt_in2[2, 3] = 5
    assert model.loss_and_grads(src, tgt_in2, tgt_out, lengths=lengths) == pytest.approx(loss, rel=1e-12)
    for n, a in model.named_grads():
        np.testing.assert_allclose(a, g1[n], rtol=1e-12, atol=1e-14, err_msg=n)
    with pytest.raises(ValueError, match="tgt_out"):
        model.loss_and_grads(src, tgt_in, tgt_out[:, :-1], mask)
