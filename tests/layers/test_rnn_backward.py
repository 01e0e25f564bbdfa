"""fastattn.functional.rnn_scan_backward (backpropagation through time) against
the float64 oracle (``fastattn._reference.rnn_scan_backward``, one sequence and
one step at a time), torch.nn.RNN / GRU / LSTM autograd in float64 (packed
sequences for ``lengths``, the reverse half of a bidirectional layer for
``reverse``) and central finite differences.  Upstream gradients are random.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _reference as R
from fastattn.functional import rnn_scan, rnn_scan_backward

from support import assert_central_differences, assert_close, randn

torch = pytest.importorskip("torch")

CELLS = {"rnn_tanh": (1, "RNN", "tanh"), "rnn_relu": (1, "RNN", "relu"),
         "gru": (3, "GRU", "tanh"), "lstm": (4, "LSTM", "tanh")}
B, T, H = 3, 7, 5


def case(rng, cell, dtype=np.float64, bias=True):
    G = CELLS[cell][0]
    xw = randn(rng, (B, T, G * H), dtype)
    W = randn(rng, (G * H, H), dtype, 0.4)
    b = randn(rng, (G * H,), dtype) if bias else None
    h0 = randn(rng, (B, H), dtype)
    c0 = randn(rng, (B, H), dtype) if cell == "lstm" else None
    return xw, W, b, h0, c0


@pytest.mark.parametrize("lengths", [None, [7, 3, 0], [1, 7, 5]], ids=["full", "ragged", "ragged2"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_matches_the_oracle(dtype, cell, reverse, lengths, rng):
    xw, W, b, h0, c0 = case(rng, cell, dtype)
    out, hn, cn = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths, reverse=reverse)
    go, gh = randn(rng, (B, T, H), dtype), randn(rng, (B, H), dtype)
    gc = randn(rng, (B, H), dtype) if cell == "lstm" else None
    before = [a.copy() for a in (xw, W, b, h0, out, go, gh)]
    got = rnn_scan_backward(go, gh, xw, W, b, h0, out, cell=cell, c0=c0, grad_c_n=gc,
                            lengths=lengths, reverse=reverse)
    _, mode, nl = CELLS[cell]
    ref = R.rnn_scan_backward(mode, go, gh, xw, W, b, h0, c0, gc, lengths, reverse, nonlinearity=nl)
    for name, a, r, inp in zip(("dxw", "dw_hh", "db_hh", "dh0", "dc0"), got, ref, (xw, W, b, h0, c0)):
        if inp is None:
            assert a is None and r is None, name
            continue
        assert a.shape == inp.shape and a.dtype == inp.dtype, name
        assert_close(a, r, dtype, err_msg=name)
    if lengths is not None:   # padded steps get no gradient
        for s, n in enumerate(lengths):
            assert np.all(got[0][s, n:] == 0)
    for a, c in zip((xw, W, b, h0, out, go, gh), before):
        np.testing.assert_array_equal(a, c)


def _torch_layer(cell, bidirectional, In, seed=0):
    cls = {"rnn_tanh": torch.nn.RNN, "rnn_relu": torch.nn.RNN, "gru": torch.nn.GRU,
           "lstm": torch.nn.LSTM}[cell]
    kw = {"nonlinearity": CELLS[cell][2]} if cell.startswith("rnn") else {}
    torch.manual_seed(seed)
    return cls(In, H, batch_first=True, bidirectional=bidirectional, **kw).double()


@pytest.mark.parametrize("lengths", [None, [7, 3, 1]], ids=["full", "packed"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_float64_against_torch_autograd(cell, reverse, lengths, rng):
    """The reverse direction is the reverse half of a bidirectional torch layer."""
    In = 4
    layer = _torch_layer(cell, reverse, In)
    sfx = "_reverse" if reverse else ""
    x = torch.tensor(randn(rng, (B, T, In)), requires_grad=True)
    D = 2 if reverse else 1
    h0 = torch.tensor(randn(rng, (D, B, H)), requires_grad=True)
    state = (h0, torch.tensor(randn(rng, (D, B, H)), requires_grad=True)) if cell == "lstm" else h0
    inp = x
    if lengths is not None:
        inp = torch.nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=True,
                                                      enforce_sorted=False)
    out, hn = layer(inp, state)
    if lengths is not None:
        out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=T)
    go = randn(rng, (B, T, D * H))
    ghn = randn(rng, (D, B, H))
    loss = (out * torch.tensor(go)).sum()
    hn_, cn_ = (hn if cell == "lstm" else (hn, None))
    loss = loss + (hn_ * torch.tensor(ghn)).sum()
    gcn = None
    if cell == "lstm":
        gcn = randn(rng, (D, B, H))
        loss = loss + (cn_ * torch.tensor(gcn)).sum()
    loss.backward()

    d = D - 1   # this direction's index in torch's stacked states and outputs
    Wih = getattr(layer, "weight_ih_l0" + sfx).detach().numpy()
    bih = getattr(layer, "bias_ih_l0" + sfx).detach().numpy()
    Whh = getattr(layer, "weight_hh_l0" + sfx).detach().numpy()
    bhh = getattr(layer, "bias_hh_l0" + sfx).detach().numpy()
    xn = x.detach().numpy()
    xw = xn @ Wih.T + bih
    h0n = h0.detach().numpy()[d]
    c0n = state[1].detach().numpy()[d] if cell == "lstm" else None
    o, _, _ = rnn_scan(xw, Whh, bhh, h0n, cell=cell, c0=c0n, lengths=lengths, reverse=reverse)
    np.testing.assert_allclose(o, out.detach().numpy()[..., d * H:(d + 1) * H], rtol=1e-10, atol=1e-12)
    dxw, dW, db, dh0, dc0 = rnn_scan_backward(
        go[..., d * H:(d + 1) * H], ghn[d], xw, Whh, bhh, h0n, o, cell=cell, c0=c0n,
        grad_c_n=None if gcn is None else gcn[d], lengths=lengths, reverse=reverse)
    tol = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dW, getattr(layer, "weight_hh_l0" + sfx).grad.numpy(), **tol)
    np.testing.assert_allclose(db, getattr(layer, "bias_hh_l0" + sfx).grad.numpy(), **tol)
    np.testing.assert_allclose(dxw.reshape(-1, dxw.shape[-1]).T @ xn.reshape(-1, In),
                               getattr(layer, "weight_ih_l0" + sfx).grad.numpy(), **tol)
    np.testing.assert_allclose(dxw.sum(axis=(0, 1)), getattr(layer, "bias_ih_l0" + sfx).grad.numpy(), **tol)
    np.testing.assert_allclose(dh0, h0.grad.numpy()[d], **tol)
    if cell == "lstm":
        np.testing.assert_allclose(dc0, state[1].grad.numpy()[d], **tol)
    if not reverse:   # x's gradient comes from this one direction only
        np.testing.assert_allclose(dxw @ Wih, x.grad.numpy(), **tol)


@pytest.mark.parametrize("cell", list(CELLS))
def test_central_finite_differences(cell, rng):
    xw, W, b, h0, c0 = case(rng, cell)
    lengths = [7, 4, 2]
    go, gh = randn(rng, (B, T, H)), randn(rng, (B, H))

    def loss(xw, W, b, h0):
        o, hn, _ = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths)
        return float(np.sum(o * go) + np.sum(hn * gh))

    o, _, _ = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths)
    grads = rnn_scan_backward(go, gh, xw, W, b, h0, o, cell=cell, c0=c0, lengths=lengths)
    assert_central_differences(loss, [xw, W, b, h0], grads[:4], rng, points=3)


def test_optional_gradients_dtypes_and_empty(rng):
    xw, W, b, h0, c0 = case(rng, "gru", np.float32, bias=False)
    o, _, _ = rnn_scan(xw, W, b, h0, cell="gru")
    dxw, dW, db, dh0, dc0 = rnn_scan_backward(None, randn(rng, (B, H), np.float32), xw, W, b, h0, o,
                                              cell="gru")
    assert db is None and dc0 is None and dxw.dtype == np.float32
    z = rnn_scan_backward(None, None, xw, W, b, h0, o, cell="gru")
    assert all(np.all(a == 0) for a in z if a is not None)
    e = rnn_scan_backward(None, None, xw[:, :0], W, b, h0, o[:, :0], cell="gru")
    assert e[0].shape == (B, 0, 3 * H) and np.all(e[1] == 0)


def test_bad_input_names_the_argument(rng):
    xw, W, b, h0, c0 = case(rng, "lstm")
    o, _, _ = rnn_scan(xw, W, b, h0, cell="lstm", c0=c0)
    with pytest.raises(ValueError, match=r"outputs: expected shape \(3, 7, 5\)"):
        rnn_scan_backward(None, None, xw, W, b, h0, o[:, :3], cell="lstm", c0=c0)
    with pytest.raises(ValueError, match=r"grad_outputs: expected shape \(3, 7, 5\)"):
        rnn_scan_backward(o[..., :2], None, xw, W, b, h0, o, cell="lstm", c0=c0)
    with pytest.raises(TypeError, match="grad_h_n: expected a real floating array"):
        rnn_scan_backward(None, np.zeros((B, H), int), xw, W, b, h0, o, cell="lstm", c0=c0)
    with pytest.raises(ValueError, match="grad_c_n: only an LSTM has a cell state"):
        rnn_scan_backward(None, None, xw[..., :15], W[:15], b[:15], h0, o, cell="gru",
                          grad_c_n=h0)
    with pytest.raises(ValueError, match="cell: expected one of"):
        rnn_scan_backward(None, None, xw, W, b, h0, o, cell="transformer")


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_same_bits_for_any_thread_count(cell, rng):
    G = CELLS[cell][0]
    xw = randn(rng, (8, 20, G * 64), np.float32)
    W = randn(rng, (G * 64, 64), np.float32, 0.2)
    b = randn(rng, (G * 64,), np.float32)
    h0 = randn(rng, (8, 64), np.float32)
    o, _, _ = rnn_scan(xw, W, b, h0, cell=cell, lengths=[20, 5, 9, 20, 1, 0, 13, 20])
    go = randn(rng, (8, 20, 64), np.float32)
    res = [rnn_scan_backward(go, None, xw, W, b, h0, o, cell=cell,
                             lengths=[20, 5, 9, 20, 1, 0, 13, 20], n_threads=n) for n in (1, 2, 3)]
    for other in res[1:]:
        for a, c in zip(res[0], other):
            if a is not None:
                np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cell", list(CELLS))
def test_rnn_cell_backward_against_torch_cells(cell, bias, rng):
    """One step against torch.nn.RNNCell / GRUCell / LSTMCell autograd in float64."""
    from fastattn.functional import rnn_cell_backward

    In = 6
    cls = {"rnn_tanh": torch.nn.RNNCell, "rnn_relu": torch.nn.RNNCell, "gru": torch.nn.GRUCell,
           "lstm": torch.nn.LSTMCell}[cell]
    kw = {"nonlinearity": CELLS[cell][2]} if cell.startswith("rnn") else {}
    torch.manual_seed(1)
    tc = cls(In, H, bias=bias, **kw).double()
    x = torch.tensor(randn(rng, (B, In)), requires_grad=True)
    h = torch.tensor(randn(rng, (B, H)), requires_grad=True)
    c = torch.tensor(randn(rng, (B, H)), requires_grad=True) if cell == "lstm" else None
    gh = randn(rng, (B, H))
    gc = randn(rng, (B, H)) if cell == "lstm" else None
    if cell == "lstm":
        h1, c1 = tc(x, (h, c))
        ((h1 * torch.tensor(gh)).sum() + (c1 * torch.tensor(gc)).sum()).backward()
    else:
        h1 = tc(x, h)
        (h1 * torch.tensor(gh)).sum().backward()
    p = {n: t.detach().numpy() for n, t in tc.named_parameters()}
    dx, dh, dwi, dbi, dwh, dbh, dc = rnn_cell_backward(
        gh, x.detach().numpy(), h.detach().numpy(), p["weight_ih"], p.get("bias_ih"),
        p["weight_hh"], p.get("bias_hh"), cell=cell,
        c=None if c is None else c.detach().numpy(), grad_c=gc)
    tol = dict(rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dx, x.grad.numpy(), **tol)
    np.testing.assert_allclose(dh, h.grad.numpy(), **tol)
    np.testing.assert_allclose(dwi, tc.weight_ih.grad.numpy(), **tol)
    np.testing.assert_allclose(dwh, tc.weight_hh.grad.numpy(), **tol)
    if bias:
        np.testing.assert_allclose(dbi, tc.bias_ih.grad.numpy(), **tol)
        np.testing.assert_allclose(dbh, tc.bias_hh.grad.numpy(), **tol)
    else:
        assert dbi is None and dbh is None
    if cell == "lstm":
        np.testing.assert_allclose(dc, c.grad.numpy(), **tol)
    else:
        assert dc is None


def test_rnn_cell_backward_bad_input(rng):
    from fastattn.functional import rnn_cell_backward

    x, h = randn(rng, (B, 4)), randn(rng, (B, H))
    wi, wh = randn(rng, (3 * H, 4)), randn(rng, (3 * H, H))
    with pytest.raises(ValueError, match=r"grad_h: expected shape \(3, 5\)"):
        rnn_cell_backward(randn(rng, (B, 4)), x, h, wi, None, wh, None)
    with pytest.raises(ValueError, match="grad_c: only an LSTM has a cell state"):
        rnn_cell_backward(randn(rng, (B, H)), x, h, wi, None, wh, None, grad_c=h)
    with pytest.raises(ValueError, match="w_hh: expected shape"):
        rnn_cell_backward(randn(rng, (B, H)), x, h, wi, None, wh[:5], None)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_rnn_cell_backward_matches_the_oracle(cell, dtype, rng):
    """One step: the oracle's recurrence backward over T = 1, then its linear backward."""
    from fastattn.functional import rnn_cell_backward

    G, mode, nl = CELLS[cell]
    x, h = randn(rng, (B, 4), dtype), randn(rng, (B, H), dtype)
    wi, bi = randn(rng, (G * H, 4), dtype, 0.4), randn(rng, (G * H,), dtype)
    wh, bh = randn(rng, (G * H, H), dtype, 0.4), randn(rng, (G * H,), dtype)
    c = randn(rng, (B, H), dtype) if cell == "lstm" else None
    gh = randn(rng, (B, H), dtype)
    gc = randn(rng, (B, H), dtype) if cell == "lstm" else None
    got = rnn_cell_backward(gh, x, h, wi, bi, wh, bh, cell=cell, c=c, grad_c=gc)
    xw = x.astype(np.float64) @ wi.astype(np.float64).T + bi
    dxw, dwh, dbh, dh, dc = R.rnn_scan_backward(mode, None, gh, xw[:, None], wh, bh, h, c, gc,
                                                nonlinearity=nl)
    dx, dwi, dbi = R.linear_backward(dxw[:, 0], x, wi, bi)
    for name, a, r in zip(("dx", "dh", "dw_ih", "db_ih", "dw_hh", "db_hh"),
                          got[:6], (dx, dh, dwi, dbi, dwh, dbh)):
        assert a.dtype == dtype, name
        assert_close(a, r, dtype, err_msg=name)
    if cell == "lstm":
        assert_close(got[6], dc, dtype)


# ------------------------------------------------------ the compiled kernel
# csrc/fa_rnn_bwd.c through rnn_scan_backward: SIMD on and off, H not a
# multiple of the vector width, B = 1, lengths with 0 and T, h0 / c0 given or
# zero, the forward's saved gates or recomputed hidden products.

from fastattn import _rnn  # noqa: E402


@pytest.mark.parametrize("gates", [False, True], ids=["recompute", "saved"])
@pytest.mark.parametrize("shape", [(1, 6, 13), (9, 5, 20)], ids=["B1-H13", "B9-H20"])
@pytest.mark.parametrize("reverse", [False, True], ids=["fwd", "rev"])
@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_kernel_matches_the_oracle(simd_mode, dtype, cell, reverse, shape, gates, rng, monkeypatch):
    Bk, Tk, Hk = shape
    G, mode, nl = CELLS[cell]
    xw = randn(rng, (Bk, Tk, G * Hk), dtype)
    W = randn(rng, (G * Hk, Hk), dtype, 0.3)
    b = randn(rng, (G * Hk,), dtype)
    zero_state = Bk == 1
    h0 = np.zeros((Bk, Hk), dtype) if zero_state else randn(rng, (Bk, Hk), dtype)
    c0 = None if cell != "lstm" or zero_state else randn(rng, (Bk, Hk), dtype)
    lengths = [Tk] if Bk == 1 else [Tk, 0, 3, Tk, 1, 0, 5, 2, Tk]
    calls = []
    real = _rnn.scan_backward
    monkeypatch.setattr(_rnn, "scan_backward", lambda *a: calls.append(1) or real(*a))
    res = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths, reverse=reverse,
                   return_gates=gates)
    out = res[0]
    go, ghn = randn(rng, (Bk, Tk, Hk), dtype), randn(rng, (Bk, Hk), dtype)
    gcn = randn(rng, (Bk, Hk), dtype) if cell == "lstm" else None
    args = (xw, W, b, h0, out, go, ghn) + ((res[3],) if gates else ())
    before = [a.copy() for a in args]
    got = rnn_scan_backward(go, ghn, xw, W, b, h0, out, cell=cell, c0=c0, grad_c_n=gcn,
                            lengths=lengths, reverse=reverse, gates=res[3] if gates else None)
    assert calls == [1]   # the C recurrence ran
    ref = R.rnn_scan_backward(mode, go, ghn, xw, W, b, h0, c0, gcn, lengths, reverse, nonlinearity=nl)
    for name, a, r in zip(("dxw", "dw_hh", "db_hh", "dh0", "dc0"), got, ref):
        if r is None:
            assert a is None, name
            continue
        assert a.dtype == dtype, name
        assert_close(a, r, dtype, err_msg=name)
    for s, n in enumerate(lengths):
        assert np.all(got[0][s, n:] == 0)
    for a, c in zip(args, before):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("cell", list(CELLS))
def test_saved_gates_are_the_hidden_products(cell, rng):
    """rnn_scan(return_gates=True): h_{t-1} W_hh^T + b_hh of every real step, zeros elsewhere;
    the other results are those of the plain call, bit for bit."""
    G = CELLS[cell][0]
    Bk, Tk, Hk = 6, 5, 24
    xw, W, b = randn(rng, (Bk, Tk, G * Hk)), randn(rng, (G * Hk, Hk), scale=0.3), randn(rng, (G * Hk,))
    h0 = randn(rng, (Bk, Hk))
    c0 = randn(rng, (Bk, Hk)) if cell == "lstm" else None
    lengths = [5, 0, 2, 5, 1, 3]
    for reverse in (False, True):
        out, hn, cn, gates = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths,
                                      reverse=reverse, return_gates=True)
        plain = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, lengths=lengths, reverse=reverse)
        for a, p in zip((out, hn, cn), plain):
            if p is not None:
                np.testing.assert_array_equal(a, p)
        assert gates.shape == (Bk, Tk, G * Hk) and gates.dtype == np.float64
        for s, n in enumerate(lengths):
            steps = range(n) if not reverse else range(n - 1, -1, -1)
            h = h0[s]
            for t in steps:
                np.testing.assert_allclose(gates[s, t], W @ h + b, rtol=1e-12, atol=1e-12)
                h = out[s, t]
            assert np.all(gates[s, n:] == 0)


@pytest.mark.parametrize("gates", [False, True], ids=["recompute", "saved"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("cell", list(CELLS))
def test_kernel_same_bits_for_one_and_two_threads(cell, dtype, gates, rng):
    """Enough rows for several row blocks (each its own products): n_threads 1, 2 and 3
    give the same bits, and the blocks are fixed by the shapes."""
    G = CELLS[cell][0]
    Bk, Tk, Hk = 32, 9, 90
    assert _rnn.backward_blocks(Bk, Hk, G)[0] > 1
    xw = randn(rng, (Bk, Tk, G * Hk), dtype)
    W = randn(rng, (G * Hk, Hk), dtype, 0.2)
    b = randn(rng, (G * Hk,), dtype)
    h0 = randn(rng, (Bk, Hk), dtype)
    lengths = rng.integers(0, Tk + 1, Bk)
    res = rnn_scan(xw, W, b, h0, cell=cell, lengths=lengths, return_gates=True)
    go = randn(rng, (Bk, Tk, Hk), dtype)
    got = [rnn_scan_backward(go, None, xw, W, b, h0, res[0], cell=cell, lengths=lengths,
                             gates=res[3] if gates else None, n_threads=n) for n in (1, 2, 3)]
    for other in got[1:]:
        for a, c in zip(got[0], other):
            if a is not None:
                np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("cell", ["gru", "lstm", "rnn_tanh"])
def test_float32_accuracy_as_torch_float32(cell, rng):
    """float32 gradients against the float64 oracle: rms error no worse than torch
    float32 autograd's (the same float32 weights and inputs), within 1.2x."""
    G, mode, nl = CELLS[cell]
    Bk, Tk, Hk = 16, 48, 64
    cls = {"gru": torch.nn.GRU, "lstm": torch.nn.LSTM, "rnn_tanh": torch.nn.RNN}[cell]
    torch.manual_seed(0)
    layer = cls(Hk, Hk, batch_first=True)
    x = randn(rng, (Bk, Tk, Hk), np.float32)
    go = randn(rng, (Bk, Tk, Hk), np.float32)
    tx = torch.tensor(x, requires_grad=True)
    out_t, _ = layer(tx)
    out_t.backward(torch.tensor(go))
    Wih, bih = layer.weight_ih_l0.detach().numpy(), layer.bias_ih_l0.detach().numpy()
    W, b = layer.weight_hh_l0.detach().numpy(), layer.bias_hh_l0.detach().numpy()
    xw = (x @ Wih.T + bih).astype(np.float32)
    h0 = np.zeros((Bk, Hk), np.float32)
    c0 = np.zeros((Bk, Hk), np.float32) if cell == "lstm" else None
    out, _, _, gates = rnn_scan(xw, W, b, h0, cell=cell, c0=c0, return_gates=True)
    dxw, dW, db, _, _ = rnn_scan_backward(go, None, xw, W, b, h0, out, cell=cell, c0=c0, gates=gates)
    rdxw, rdW, rdb, _, _ = R.rnn_scan_backward(mode, go, None, xw.astype(np.float64), W, b, h0, c0,
                                               None, nonlinearity=nl)

    def rms(a, r):
        return float(np.sqrt(np.mean((np.asarray(a, np.float64) - r) ** 2)))

    # torch's float32 dL/dxw is its bias_ih gradient per step: compare what both have
    for name, a, t, r in (("dw_hh", dW, layer.weight_hh_l0.grad.numpy(), rdW),
                          ("db_hh", db, layer.bias_hh_l0.grad.numpy(), rdb),
                          ("dw_ih", dxw.reshape(-1, G * Hk).T.astype(np.float64) @ x.reshape(-1, Hk),
                           layer.weight_ih_l0.grad.numpy(),
                           rdxw.reshape(-1, G * Hk).T @ x.reshape(-1, Hk).astype(np.float64))):
        assert rms(a, r) <= 1.2 * rms(t, r), name


@pytest.mark.parametrize("shape", [(32, 32, 256), (32, 64, 256)], ids=["32x32x256", "32x64x256"])
def test_float32_weight_gradient_as_accurate_as_torch_at_training_sizes(shape):
    """dW_hh on the packed kernel (runs of DW_PACKED_RUNS rows, float32) at the
    training benchmark's sizes: rms error <= 1.1x and max error <= 1.25x torch
    float32 autograd's against the float64 oracle."""
    Bk, Tk, Hk = shape
    rng = np.random.default_rng(0)
    torch.manual_seed(0)
    layer = torch.nn.GRU(Hk, Hk, batch_first=True)
    x = randn(rng, (Bk, Tk, Hk), np.float32)
    go = randn(rng, (Bk, Tk, Hk), np.float32)
    out_t, _ = layer(torch.tensor(x))
    out_t.backward(torch.tensor(go))
    Wih, bih = layer.weight_ih_l0.detach().numpy(), layer.bias_ih_l0.detach().numpy()
    W, b = layer.weight_hh_l0.detach().numpy(), layer.bias_hh_l0.detach().numpy()
    xw = (x @ Wih.T + bih).astype(np.float32)
    h0 = np.zeros((Bk, Hk), np.float32)
    out, _, _, gates = rnn_scan(xw, W, b, h0, cell="gru", return_gates=True)
    _, dW, _, _, _ = rnn_scan_backward(go, None, xw, W, b, h0, out, cell="gru", gates=gates)
    ref = R.rnn_scan_backward("GRU", go, None, xw.astype(np.float64), W, b, h0, None, None,
                              nonlinearity="tanh")[1]
    t = layer.weight_hh_l0.grad.numpy().astype(np.float64)
    err, terr = dW.astype(np.float64) - ref, t - ref
    assert np.sqrt(np.mean(err ** 2)) <= 1.1 * np.sqrt(np.mean(terr ** 2))
    assert np.abs(err).max() <= 1.25 * np.abs(terr).max()


def test_gates_and_return_gates_bad_input(rng):
    xw, W, b, h0, c0 = case(rng, "gru")
    o, _, _ = rnn_scan(xw, W, b, h0, cell="gru")
    with pytest.raises(ValueError, match=r"^gates: expected shape \(3, 7, 15\), got \(3, 7, 5\)"):
        rnn_scan_backward(None, None, xw, W, b, h0, o, cell="gru", gates=o)
    with pytest.raises(TypeError, match=r"^gates: expected a real floating array"):
        rnn_scan_backward(None, None, xw, W, b, h0, o, cell="gru", gates=np.zeros((3, 7, 15), int))
    with pytest.raises(TypeError, match=r"^return_gates: expected a bool, got int"):
        rnn_scan(xw, W, b, h0, cell="gru", return_gates=1)
    e = rnn_scan(xw[:, :0], W, b, h0, cell="gru", return_gates=True)
    assert len(e) == 4 and e[3].shape == (B, 0, 3 * H)
