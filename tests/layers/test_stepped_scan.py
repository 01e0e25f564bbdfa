"""The decoder's per-step helpers (fastattn.functional's private ``_SteppedScan``
and ``_PackedLinear``): the same floats as the public ops they stand for, the
weight gradients over all steps against the float64 oracle, and the packed
weights they share with the kernels checked.

``_SteppedScan.forward`` is ``rnn_scan`` over T = 1 with ``return_gates`` (the
same bits: W_hh packed once instead of per call), ``backward`` is
``rnn_scan_backward`` over T = 1 with those gates (the same bits for dxw, dh,
dc), ``weight_grads`` sums dW_hh and db_hh over every step (one product), checked
against the oracle's backward through the whole stepped sequence.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _reference as R
from fastattn import _rnn
from fastattn import functional as F

from support import randn

CELLS = {"rnn_tanh": (1, "RNN", "tanh"), "gru": (3, "GRU", "tanh"), "lstm": (4, "LSTM", "tanh")}


def _run(cell, dtype, B, T, H, rng, bias=True):
    G = CELLS[cell][0]
    xw = randn(rng, (B, T, G * H), dtype)
    W = randn(rng, (G * H, H), dtype, 0.3)
    b = randn(rng, (G * H,), dtype) if bias else None
    h0 = randn(rng, (B, H), dtype)
    c0 = randn(rng, (B, H), dtype) if cell == "lstm" else None
    return xw, W, b, h0, c0


@pytest.mark.parametrize("cell", list(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("B,H", [(3, 5), (32, 48)], ids=["small", "packed"])
def test_steps_are_the_public_ops_bitwise(dtype, cell, B, H, rng):
    T = 4
    lstm = cell == "lstm"
    xw, W, b, h0, c0 = _run(cell, dtype, B, T, H, rng)
    before = [a.copy() for a in (xw, W, b, h0)]
    sc = F._SteppedScan(W, b, cell, B, T, np.dtype(dtype))
    h, c, tape = h0, c0, []
    for t in range(T):
        xw3 = xw[:, t:t + 1]
        o, h1, c1, g = sc.forward(xw3, h, c)
        eo, eh, ec, eg = F.rnn_scan(xw3, W, b, h, cell=cell, c0=c, return_gates=True)
        for got, exp in ((o, eo), (h1, eh), (g, eg)) + (((c1, ec),) if lstm else ()):
            assert got.dtype == exp.dtype and np.array_equal(got, exp)
        tape.append((xw3, o, g, h, c))
        h, c = h1, c1
    go = randn(rng, (B, T, H), dtype)
    dh = randn(rng, (B, H), dtype)
    dc = randn(rng, (B, H), dtype) if lstm else None
    sc.start_backward()
    dW_steps = np.zeros(W.shape)
    db_steps = np.zeros(b.shape)
    for t in reversed(range(T)):
        xw3, o, g, hp, cp = tape[t]
        dxw, dh1, dc1 = sc.backward(t, go[:, t:t + 1], dh, xw3, hp, g, cp, dc)
        e = F.rnn_scan_backward(go[:, t:t + 1], dh, xw3, W, b, hp, o, cell=cell, c0=cp,
                                grad_c_n=dc, gates=g)
        assert np.array_equal(dxw, e[0]) and np.array_equal(dh1, e[3])
        if lstm:
            assert np.array_equal(dc1, e[4])
        dW_steps += e[1]
        db_steps += e[2]
        dh, dc = dh1, dc1
    dW, db = sc.weight_grads()
    assert dW.dtype == dtype and db.dtype == dtype
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(dW, dW_steps, rtol=tol, atol=tol)
    np.testing.assert_allclose(db, db_steps, rtol=tol, atol=tol)
    for a, a0 in zip((xw, W, b, h0), before):
        assert np.array_equal(a, a0)   # inputs untouched


def test_weight_grads_against_the_oracle(rng):
    """dW_hh and db_hh over the steps equal the float64 oracle's for the sequence."""
    B, T, H, cell = 4, 6, 7, "gru"
    xw, W, b, h0, _ = _run(cell, np.float64, B, T, H, rng)
    go, gh = randn(rng, (B, T, H)), randn(rng, (B, H))
    sc = F._SteppedScan(W, b, cell, B, T, np.dtype(np.float64))
    h, tape = h0, []
    for t in range(T):
        o, h1, _, g = sc.forward(xw[:, t:t + 1], h)
        tape.append((o, g, h))
        h = h1
    sc.start_backward()
    dh = gh
    dxws = [None] * T
    for t in reversed(range(T)):
        o, g, hp = tape[t]
        dxws[t], dh, _ = sc.backward(t, go[:, t:t + 1], dh, xw[:, t:t + 1], hp, g)
    dW, db = sc.weight_grads()
    ref = R.rnn_scan_backward("GRU", go, gh, xw, W, b, h0, None, None, None, False, nonlinearity="tanh")
    np.testing.assert_allclose(np.concatenate(dxws, axis=1), ref[0], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dW, ref[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, ref[2], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dh, ref[3], rtol=1e-12, atol=1e-12)
    # a second pass sums its own db_hh, not the first pass's as well
    sc.start_backward()
    dh = gh
    for t in reversed(range(T)):
        o, g, hp = tape[t]
        _, dh, _ = sc.backward(t, go[:, t:t + 1], dh, xw[:, t:t + 1], hp, g)
    dW2, db2 = sc.weight_grads()
    assert np.array_equal(dW2, dW) and np.array_equal(db2, db)


@pytest.mark.parametrize("shape", [(32, 768, 256), (5, 40, 24), (0, 16, 8)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("bias", [True, False])
def test_packed_linear_is_linear(shape, dtype, bias, rng):
    M, N, K = shape
    x = randn(rng, (M, K), dtype)
    w = randn(rng, (N, K), dtype, 0.1)
    b = randn(rng, (N,), dtype) if bias else None
    lin = F._PackedLinear(w, b)
    got = lin(x)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + (0 if b is None else b)
    assert got.dtype == dtype and got.shape == (M, N)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    w[...] = 0   # a snapshot: the packed copy does not follow the array
    if dtype == np.float32 and lin.wp is not None:
        assert np.array_equal(lin(x), got)


def test_prepacked_weights_are_checked(rng):
    H, B = 16, 4
    W = randn(rng, (3 * H, H), np.float32)
    good = _rnn.pack_recurrent(W, False)
    if good is None:
        pytest.skip("this machine's kernels do not pack W_hh (no AVX2 / packed kernel)")
    xw = randn(rng, (B, 1, 3 * H), np.float32)
    h = randn(rng, (B, H), np.float32)
    for bad in (good[:-1].copy(), good.astype(np.float64), good.reshape(-1, 1), [1.0]):
        with pytest.raises(ValueError, match="wpack"):
            _rnn.scan(_rnn.CELLS["gru"], xw, W, None, h.copy(), None, None, None, False, 1, None, bad)
    assert _rnn.pack_recurrent(W.astype(np.float64), False) is None
