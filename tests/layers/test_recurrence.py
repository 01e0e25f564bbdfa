"""functional.rnn_scan / rnn_cell (csrc/fa_rnn.c) against the float64 oracle."""
import numpy as np
import pytest

from fastattn import _reference, functional as F

CELLS = {"rnn_tanh": ("RNN", 1, "tanh"), "rnn_relu": ("RNN", 1, "relu"), "gru": ("GRU", 3, "tanh"),
         "lstm": ("LSTM", 4, "tanh")}
TOL = {np.float32: 2e-5, np.float64: 1e-12}


def _weights(rng, cell, I, H, dtype, bias=True):
    G = CELLS[cell][1]
    wi = (rng.standard_normal((G * H, I)) / np.sqrt(max(I, 1))).astype(dtype)
    wh = (rng.standard_normal((G * H, H)) / np.sqrt(H)).astype(dtype)
    bi = rng.standard_normal(G * H).astype(dtype) if bias else None
    bh = rng.standard_normal(G * H).astype(dtype) if bias else None
    return wi, bi, wh, bh


def _ref_step(cell, x, h, c, wi, bi, wh, bh):
    """Oracle step for a batch, row by row (x (B, I) or None for precomputed gi)."""
    mode, _, nl = CELLS[cell]
    hs, cs = [], []
    for b in range(h.shape[0]):
        hn, cn = _reference.rnn_cell(mode, x[b], h[b], None if c is None else c[b], wi, wh, bi, bh, nl)
        hs.append(hn)
        cs.append(cn)
    return np.array(hs), (np.array(cs) if cell == "lstm" else None)


def _ref_scan(cell, xw, wh, bh, h0, c0, lengths, reverse):
    """Oracle of rnn_scan: xw is x W_ihᵀ + b_ih, so W_ih = identity on it."""
    B, T, GH = xw.shape
    eye = np.eye(GH)
    h = h0.astype(np.float64)
    c = None if c0 is None else c0.astype(np.float64)
    out = np.zeros((B, T, h.shape[1]))
    L = np.full(B, T) if lengths is None else np.asarray(lengths)
    for t in (range(T - 1, -1, -1) if reverse else range(T)):
        hn, cn = _ref_step(cell, xw[:, t].astype(np.float64), h, c, eye, None, wh, bh)
        live = (t < L)[:, None]
        h = np.where(live, hn, h)
        if c is not None:
            c = np.where(live, cn, c)
        out[:, t] = np.where(live, h, 0)
    return out, h, c


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,T,H", [(1, 5, 7), (3, 4, 16), (9, 3, 33), (5, 1, 8)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("use_lengths", [False, True])
def test_scan_matches_oracle(simd_mode, cell, dtype, B, T, H, reverse, use_lengths, rng):
    G = CELLS[cell][1]
    xw = rng.standard_normal((B, T, G * H)).astype(dtype)
    _, _, wh, bh = _weights(rng, cell, 1, H, dtype)
    h0 = rng.standard_normal((B, H)).astype(dtype)
    c0 = rng.standard_normal((B, H)).astype(dtype) if cell == "lstm" else None
    lengths = rng.integers(0, T + 1, B) if use_lengths else None
    saved = [a.copy() for a in (xw, wh, bh, h0)]
    out, h, c = F.rnn_scan(xw, wh, bh, h0, cell=cell, c0=c0, lengths=lengths, reverse=reverse)
    ro, rh, rc = _ref_scan(cell, xw, wh, bh, h0, c0, lengths, reverse)
    tol = TOL[dtype]
    assert out.dtype == dtype and h.dtype == dtype
    np.testing.assert_allclose(out, ro, rtol=tol, atol=tol)
    np.testing.assert_allclose(h, rh, rtol=tol, atol=tol)
    if cell == "lstm":
        np.testing.assert_allclose(c, rc, rtol=tol, atol=tol)
    else:
        assert c is None
    for a, s in zip((xw, wh, bh, h0), saved):
        np.testing.assert_array_equal(a, s)


@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_scan_row_blocks_on_threads(n_threads, rng):
    """Enough rows for several row blocks (tasks of the pool): same as one thread."""
    B, T, H = 70, 6, 24
    xw = rng.standard_normal((B, T, 3 * H)).astype(np.float32)
    _, _, wh, bh = _weights(rng, "gru", 1, H, np.float32)
    h0 = rng.standard_normal((B, H)).astype(np.float32)
    lengths = rng.integers(0, T + 1, B)
    out, h, _ = F.rnn_scan(xw, wh, bh, h0, lengths=lengths, n_threads=n_threads)
    ro, rh, _ = _ref_scan("gru", xw, wh, bh, h0, None, lengths, False)
    np.testing.assert_allclose(out, ro, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(h, rh, rtol=2e-5, atol=2e-5)


def test_scan_strided_and_mixed_dtypes(rng):
    """Strided xw (a view), a float64 state with float32 weights -> float64."""
    B, T, H = 4, 5, 8
    big = rng.standard_normal((B, 2 * T, 3 * H + 5))
    xw = big[:, ::2, 2:3 * H + 2]
    _, _, wh, bh = _weights(rng, "gru", 1, H, np.float32)
    h0 = rng.standard_normal((B, H))
    out, h, _ = F.rnn_scan(xw, wh, bh, h0, return_outputs=True)
    assert out.dtype == np.float64
    ro, rh, _ = _ref_scan("gru", xw, wh, bh, h0, None, None, False)
    np.testing.assert_allclose(out, ro, rtol=1e-6, atol=1e-6)  # weights are float32 values
    _, h2, _ = F.rnn_scan(xw, wh, bh, h0, return_outputs=False)
    np.testing.assert_array_equal(h2, h)


def test_scan_empty_sizes(rng):
    _, _, wh, bh = _weights(rng, "gru", 1, 4, np.float32)
    h0 = rng.standard_normal((2, 4)).astype(np.float32)
    out, h, _ = F.rnn_scan(np.zeros((2, 0, 12), np.float32), wh, bh, h0)
    assert out.shape == (2, 0, 4)
    np.testing.assert_array_equal(h, h0)
    assert not np.shares_memory(h, h0)
    out, h, _ = F.rnn_scan(np.zeros((0, 3, 12), np.float32), wh, bh, np.zeros((0, 4), np.float32))
    assert out.shape == (0, 3, 4) and h.shape == (0, 4)


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,I,H", [(1, 512, 256), (1, 5, 7), (3, 16, 40), (2, 300, 129), (33, 20, 24)])
@pytest.mark.parametrize("n_threads", [1, 2])
def test_cell_matches_oracle(simd_mode, cell, dtype, B, I, H, n_threads, rng):
    wi, bi, wh, bh = _weights(rng, cell, I, H, dtype, bias=B != 3)
    x = rng.standard_normal((B, I)).astype(dtype)
    h = rng.standard_normal((B, H)).astype(dtype)
    c = rng.standard_normal((B, H)).astype(dtype) if cell == "lstm" else None
    saved = [a.copy() for a in (x, h, wi, wh)]
    h1, c1 = F.rnn_cell(x, h, wi, bi, wh, bh, cell=cell, c=c, n_threads=n_threads)
    rh, rc = _ref_step(cell, x, h, c, wi, bi, wh, bh)
    tol = TOL[dtype] * (4 if dtype == np.float32 else 1)
    assert h1.dtype == dtype
    np.testing.assert_allclose(h1, rh, rtol=tol, atol=tol)
    if cell == "lstm":
        np.testing.assert_allclose(c1, rc, rtol=tol, atol=tol)
    for a, s in zip((x, h, wi, wh), saved):
        np.testing.assert_array_equal(a, s)


def test_cell_equals_one_scan_step(rng):
    """rnn_cell(x, h) == rnn_scan over the one-step projection x W_ihᵀ + b_ih."""
    wi, bi, wh, bh = _weights(rng, "lstm", 12, 16, np.float64)
    x = rng.standard_normal((3, 12))
    h = rng.standard_normal((3, 16))
    c = rng.standard_normal((3, 16))
    h1, c1 = F.rnn_cell(x, h, wi, bi, wh, bh, cell="lstm", c=c)
    _, h2, c2 = F.rnn_scan((x @ wi.T + bi)[:, None], wh, bh, h, cell="lstm", c0=c)
    np.testing.assert_allclose(h1, h2, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(c1, c2, rtol=1e-12, atol=1e-12)


def test_nan_propagates(rng):
    wi, bi, wh, bh = _weights(rng, "gru", 4, 8, np.float32)
    x = rng.standard_normal((2, 4)).astype(np.float32)
    x[1, 0] = np.nan
    h1, _ = F.rnn_cell(x, np.zeros((2, 8), np.float32), wi, bi, wh, bh)
    assert np.isfinite(h1[0]).all() and np.isnan(h1[1]).all()


@pytest.mark.parametrize("call,match", [
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], cell="elman"), "cell: expected one of"),
    (lambda a: F.rnn_scan(a["xw"][0], a["wh"], None, a["h0"]), r"xw: expected a 3-d array"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"][:5], None, a["h0"]), r"w_hh: expected shape \(3 \* H, H\)"),
    (lambda a: F.rnn_scan(a["xw"][..., :6], a["wh"], None, a["h0"]), r"xw: expected last dim 12"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"][:1]), r"h0: expected shape \(2, 4\)"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], np.zeros(5), a["h0"]), r"b_hh: expected shape \(12,\)"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], c0=a["h0"]), "c0: only an LSTM"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], lengths=[1.0, 2.0]), "lengths: expected integers"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], lengths=[1, 4]), r"lengths: expected values in \[0, 3\]"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], lengths=[1]), r"lengths: expected shape \(2,\)"),
    (lambda a: F.rnn_scan(a["xw"], a["wh"], None, a["h0"], reverse=1), "reverse: expected a bool"),
    (lambda a: F.rnn_scan(a["xw"].astype(complex), a["wh"], None, a["h0"]), "xw: complex"),
    (lambda a: F.rnn_cell(a["x"][:1], a["h0"], a["wi"], None, a["wh"], None), r"x: expected shape \(2, I\)"),
    (lambda a: F.rnn_cell(a["x"], a["h0"], a["wi"][:, :2], None, a["wh"], None), r"w_ih: expected shape \(12, 5\)"),
    (lambda a: F.rnn_cell(a["x"], a["h0"][0], a["wi"], None, a["wh"], None), r"h: expected a 2-d array"),
    (lambda a: F.rnn_cell(a["x"], a["h0"], a["wi"], None, a["wh"], None, c=a["h0"]), "c: only an LSTM"),
    (lambda a: F.rnn_cell(a["x"], a["h0"], a["wi"], None, a["wh"], None, cell="lstm"),
     r"w_hh: expected shape \(16, 4\)"),
    (lambda a: F.rnn_cell(a["x"], a["h0"], a["wi"][:4].repeat(4, 0), None, a["wh"][:4].repeat(4, 0),
                          None, cell="lstm", c=a["h0"][:1]), r"c: expected shape \(2, 4\)"),
    (lambda a: F.rnn_cell(a["x"], a["h0"], a["wi"], np.zeros(3), a["wh"], None), r"b_ih: expected shape"),
])
def test_bad_input(call, match, rng):
    a = {"xw": rng.standard_normal((2, 3, 12)), "wh": rng.standard_normal((12, 4)),
         "h0": rng.standard_normal((2, 4)), "x": rng.standard_normal((2, 5)),
         "wi": rng.standard_normal((12, 5))}
    with pytest.raises((ValueError, TypeError), match=match):
        call(a)


@pytest.mark.parametrize("cls", ["SimpleRNN", "GRU", "LSTM"])
def test_layers_leave_the_given_state_alone(cls, rng):
    """The layers hand states to the kernels uncopied; the kernels never write into them."""
    from fastattn import layers

    layer = getattr(layers, cls)(5, 6, 2, seed=0)
    x = rng.standard_normal((3, 4, 5)).astype(np.float32)
    h = rng.standard_normal((2, 3, 6)).astype(np.float32)
    state = (h, h.copy() + 1) if cls == "LSTM" else h
    saved = [s.copy() for s in (state if isinstance(state, tuple) else (state,))]
    out, _ = layer(x, state)
    _, st = layer.step(x[:, 0], state)
    for s, s0 in zip(state if isinstance(state, tuple) else (state,), saved):
        np.testing.assert_array_equal(s, s0)
    # and step() equals the first step of forward()
    np.testing.assert_allclose((st[0] if isinstance(st, tuple) else st)[-1], out[:, 0],
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("cell", sorted(CELLS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("B,H", [(1, 256), (3, 200), (7, 136)])
@pytest.mark.parametrize("n_threads", [2, 3])
@pytest.mark.parametrize("reverse", [False, True])
def test_scan_unit_split_matches_oracle(simd_mode, cell, dtype, B, H, n_threads, reverse, rng):
    """Few rows: the units of each step are split across threads (fa_rnn_split_*)."""
    from fastattn import _rnn

    T, G = 6, CELLS[cell][1]
    xw = rng.standard_normal((B, T, G * H)).astype(dtype)
    _, _, wh, bh = _weights(rng, cell, 1, H, dtype)
    h0 = rng.standard_normal((B, H)).astype(dtype)
    c0 = rng.standard_normal((B, H)).astype(dtype) if cell == "lstm" else None
    lengths = rng.integers(0, T + 1, B) if B > 1 else None
    F.rnn_scan(xw[:, :2], wh, bh, h0, cell=cell, c0=c0, n_threads=n_threads)  # runtime installed
    out, h, c = F.rnn_scan(xw, wh, bh, h0, cell=cell, c0=c0, lengths=lengths, reverse=reverse,
                           n_threads=n_threads)
    ro, rh, rc = _ref_scan(cell, xw, wh, bh, h0, c0, lengths, reverse)
    tol = TOL[dtype] * (4 if dtype == np.float32 else 1)
    np.testing.assert_allclose(out, ro, rtol=tol, atol=tol)
    np.testing.assert_allclose(h, rh, rtol=tol, atol=tol)
    if cell == "lstm":
        np.testing.assert_allclose(c, rc, rtol=tol, atol=tol)
    # the kernel call itself reports the split (negative: threads)
    hh = np.ascontiguousarray(h0)
    cc = None if c0 is None else c0.copy()
    assert _rnn.scan(_rnn.CELLS[cell], xw, wh, bh, hh, cc, None, None, False, n_threads) == -n_threads
    prev = _rnn.set_tuning(split=False)
    try:
        hh2 = np.ascontiguousarray(h0)
        cc2 = None if c0 is None else c0.copy()
        assert _rnn.scan(_rnn.CELLS[cell], xw, wh, bh, hh2, cc2, None, None, False, n_threads) >= 1
    finally:
        _rnn.set_tuning(**prev)
    np.testing.assert_allclose(hh, hh2, rtol=tol, atol=tol)


@pytest.mark.parametrize("B,I,H", [(1, 512, 256), (4, 9, 13)])
def test_cell_plain_float32_gru_path(simd_mode, B, I, H, rng):
    """The common decoder-step case (float32 GRU, contiguous arrays, default
    threads) takes a shorter path: same result as the general one and the oracle;
    anything unusual (a strided x here) still goes through the general checks."""
    import fastattn

    wi, bi, wh, bh = _weights(rng, "gru", I, H, np.float32)
    x = rng.standard_normal((B, I)).astype(np.float32)
    h = rng.standard_normal((B, H)).astype(np.float32)
    fast, _ = F.rnn_cell(x, h, wi, bi, wh, bh)
    general, _ = F.rnn_cell(x, h, wi, bi, wh, bh, n_threads=fastattn.get_num_threads())
    np.testing.assert_array_equal(fast, general)
    rh, _ = _ref_step("gru", x, h, None, wi, bi, wh, bh)
    np.testing.assert_allclose(fast, rh, rtol=8e-5, atol=8e-5)
    xs = np.repeat(x, 2, axis=1)[:, ::2]  # not contiguous
    strided, _ = F.rnn_cell(xs, h, wi, bi, wh, bh)
    np.testing.assert_array_equal(strided, fast)
    with pytest.raises(ValueError, match=r"w_ih: expected shape"):
        F.rnn_cell(x, h, wi[:, :-1], bi, wh, bh)


def test_float16_policy_matches_the_attention_functions(rng):
    """float16 everywhere -> float16 result computed in float32; float16 with float32
    -> float32; with float64 (or integers) -> float64."""
    x = rng.standard_normal((3, 5))
    w = rng.standard_normal((4, 5))
    h = F.linear(x.astype(np.float16), w.astype(np.float16))
    assert h.dtype == np.float16
    np.testing.assert_allclose(h, x.astype(np.float16).astype(np.float32) @ w.astype(np.float16).astype(np.float32).T,
                               rtol=2e-3, atol=2e-3)
    assert F.linear(x.astype(np.float16), w.astype(np.float32)).dtype == np.float32
    assert F.linear(x.astype(np.float16), w).dtype == np.float64
    wi, bi, wh, bh = _weights(rng, "gru", 5, 4, np.float16)
    h1, _ = F.rnn_cell(x.astype(np.float16), np.zeros((3, 4), np.float16), wi, bi, wh, bh)
    out, hT, _ = F.rnn_scan(np.zeros((3, 2, 12), np.float16), wh, bh, np.zeros((3, 4), np.float16))
    assert h1.dtype == out.dtype == hT.dtype == np.float16
    h32, _ = F.rnn_cell(x.astype(np.float16), np.zeros((3, 4), np.float32), wi, bi, wh, bh)
    assert h32.dtype == np.float32
    np.testing.assert_allclose(h1, h32, rtol=2e-3, atol=2e-3)
