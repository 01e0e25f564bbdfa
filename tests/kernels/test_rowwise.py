"""The row-wise kernels behind functional.layer_norm, dropout and the backward
of dropout and relu (fastattn/_rowwise.pyx, csrc/fa_rowwise.c): values against
a float64 NumPy reference on every layout, the same bits for any thread count,
the dropout stream's statistics and seeding, inputs never modified."""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import functional as F
from support import _restore_simd, make_layout, randn


def ln_ref(x, w, b, eps):
    x = x.astype(np.float64)
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    y = (x - m) / np.sqrt(v + eps)
    if w is not None:
        y = y * w.astype(np.float64)
    if b is not None:
        y = y + b.astype(np.float64)
    return y


def ln_bwd_ref(g, x, w, eps):
    """dx through the explicit Jacobian of each row (independent of the kernel's formula)."""
    x, g = x.astype(np.float64), g.astype(np.float64)
    E = x.shape[-1]
    xr, gr = x.reshape(-1, E), g.reshape(-1, E)
    wv = np.ones(E) if w is None else w.astype(np.float64)
    dx = np.empty_like(xr)
    for r in range(xr.shape[0]):
        m = xr[r].mean()
        s = np.sqrt(((xr[r] - m) ** 2).mean() + eps)
        xh = (xr[r] - m) / s
        J = (np.eye(E) - 1.0 / E - np.outer(xh, xh) / E) / s   # d xhat_i / d x_j
        dx[r] = J.T @ (gr[r] * wv)
    xh = (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
    return dx.reshape(x.shape), (g * xh).reshape(-1, E).sum(0), gr.sum(0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 16), (70, 300), (4, 3, 1)])
@pytest.mark.parametrize("affine", ["both", "weight", "none"])
def test_layer_norm_forward_and_backward_against_reference(dtype, shape, affine, rng):
    E = shape[-1]
    x = (randn(rng, shape, scale=2.0) + 3.0).astype(dtype)
    g = randn(rng, shape).astype(dtype)
    w = randn(rng, (E,)).astype(dtype) if affine != "none" else None
    b = randn(rng, (E,)).astype(dtype) if affine == "both" else None
    before = [a.copy() for a in (x, g) + tuple(a for a in (w, b) if a is not None)]
    tol = dict(rtol=2e-6, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    y = F.layer_norm(x, w, b, 1e-5)
    assert y.dtype == dtype and y.shape == shape
    np.testing.assert_allclose(y, ln_ref(x, w, b, 1e-5), **tol)
    dx, dw, db = F.layer_norm_backward(g, x, w, b, 1e-5)
    rdx, rdw, rdb = ln_bwd_ref(g, x, w, 1e-5)
    np.testing.assert_allclose(dx, rdx, **tol)
    assert dx.dtype == dtype
    if w is not None:
        np.testing.assert_allclose(dw, rdw, **tol)
        assert dw.dtype == dtype and dw.shape == (E,)
    else:
        assert dw is None
    if b is not None:
        np.testing.assert_allclose(db, rdb, **tol)
    else:
        assert db is None
    for a, a0 in zip((x, g) + tuple(a for a in (w, b) if a is not None), before):
        np.testing.assert_array_equal(a, a0)


@pytest.mark.parametrize("layout", ["strided", "transposed", "readonly", "flipped_batch"])
def test_layer_norm_any_layout_same_bits_as_contiguous(layout, rng):
    x = randn(rng, (3, 9, 40)).astype(np.float32)
    g = randn(rng, x.shape).astype(np.float32)
    w, b = randn(rng, (40,)).astype(np.float32), randn(rng, (40,)).astype(np.float32)
    xl, gl = make_layout(x, layout), make_layout(g, layout)
    np.testing.assert_array_equal(F.layer_norm(xl, w, b), F.layer_norm(x, w, b))
    for got, ref in zip(F.layer_norm_backward(gl, xl, w, b), F.layer_norm_backward(g, x, w, b)):
        np.testing.assert_array_equal(got, ref)


def test_layer_norm_same_bits_for_any_thread_count(rng):
    x = randn(rng, (64, 128, 96)).astype(np.float32)   # many chunks: the pool is used
    g = randn(rng, x.shape).astype(np.float32)
    w, b = randn(rng, (96,)).astype(np.float32), randn(rng, (96,)).astype(np.float32)
    ref = F.layer_norm_backward(g, x, w, b, n_threads=1)
    y1 = F.layer_norm(x, w, b, n_threads=1)
    for nt in (2, 3):
        np.testing.assert_array_equal(F.layer_norm(x, w, b, n_threads=nt), y1)
        for got, r in zip(F.layer_norm_backward(g, x, w, b, n_threads=nt), ref):
            np.testing.assert_array_equal(got, r)


@pytest.mark.parametrize("E", [1, 3, 4, 7, 128, 259])
def test_layer_norm_avx2_lanes_same_bits_as_scalar(E, rng):
    """float32 layer norm on AVX2 double lanes (the same operations in the same
    order as the portable loops, no fused multiply-adds): the same bits with
    fastattn's SIMD switch on and off, forward and backward, affine or not."""
    from fastattn import _kernels
    x = (randn(rng, (37, E), np.float32) * 3 + 1).astype(np.float32)
    g = randn(rng, (37, E), np.float32)
    w, b = randn(rng, (E,), np.float32), randn(rng, (E,), np.float32)
    runs = []
    try:
        for off in (False, True):
            _kernels.set_simd_disabled(off)
            runs.append([F.layer_norm(x, w, b), F.layer_norm(x), F.layer_norm(x, None, b),
                         *F.layer_norm_backward(g, x, w, b), F.layer_norm_backward(g, x)[0]])
    finally:
        _kernels.set_simd_disabled(False)
    for on, off in zip(*runs):
        np.testing.assert_array_equal(on.view(np.uint8), off.view(np.uint8))


def test_layer_norm_float16_and_integer_inputs(rng):
    x = randn(rng, (4, 8))
    w = randn(rng, (8,))
    y16 = F.layer_norm(x.astype(np.float16), w.astype(np.float16))
    assert y16.dtype == np.float16      # computed in float32, returned as float16 (row 5)
    np.testing.assert_allclose(y16, ln_ref(x.astype(np.float16), w.astype(np.float16), None, 1e-5),
                               rtol=1e-3, atol=1e-3)
    assert F.layer_norm(x.astype(np.float16), w).dtype == np.float64   # float64 w: NumPy promotion
    xi = np.arange(32).reshape(4, 8) % 5
    np.testing.assert_allclose(F.layer_norm(xi), ln_ref(xi, None, None, 1e-5), rtol=1e-12)


def test_layer_norm_empty_and_nan(rng):
    assert F.layer_norm(np.zeros((0, 5))).shape == (0, 5)
    dx, dw, db = F.layer_norm_backward(np.zeros((0, 5)), np.zeros((0, 5)), np.ones(5), np.ones(5))
    assert dx.shape == (0, 5)
    np.testing.assert_array_equal(dw, 0)
    np.testing.assert_array_equal(db, 0)
    x = randn(rng, (3, 4))
    x[1, 2] = np.nan
    y = F.layer_norm(x)
    assert np.isnan(y[1]).all() and np.isfinite(y[[0, 2]]).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9])
def test_dropout_values_and_statistics(dtype, p, rng):
    x = randn(rng, (64, 1000)).astype(dtype)
    x0 = x.copy()
    out, keep = F.dropout(x, p, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(x, x0)
    assert keep.dtype == np.bool_ and keep.shape == x.shape and out.dtype == dtype
    n = keep.size
    frac = keep.mean()
    assert abs(frac - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n) + 1e-12
    scale = dtype(1.0 / (1.0 - p))
    np.testing.assert_array_equal(out, np.where(keep, x * scale, 0).astype(dtype))
    g = randn(rng, x.shape).astype(dtype)
    np.testing.assert_array_equal(F.dropout_backward(g, keep, p),
                                  np.where(keep, g * scale, 0).astype(dtype))


def test_dropout_stream_seeded_and_thread_independent(rng):
    x = randn(rng, (3, 200001)).astype(np.float32)   # an odd size: chunks start at odd indices
    a = F.dropout(x, 0.3, rng=np.random.default_rng(7), n_threads=1)
    b = F.dropout(x, 0.3, rng=np.random.default_rng(7), n_threads=2)
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[0], b[0])
    gen = np.random.default_rng(7)
    c, d = F.dropout(x, 0.3, rng=gen), F.dropout(x, 0.3, rng=gen)
    assert (c[1] != d[1]).mean() > 0.3   # the next call draws a new mask
    # neighbouring elements and rows are not correlated
    k = a[1].astype(np.float64).ravel()
    for lag in (1, 2, 200001):
        r = np.corrcoef(k[:-lag], k[lag:])[0, 1]
        assert abs(r) < 0.01, (lag, r)


def _splitmix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@pytest.mark.parametrize("p", [0.0, 0.1, 0.5, 0.9, 1 - 2.0 ** -33])
@pytest.mark.parametrize("n", [1, 7, 8, 9, 17, 1000, 70001])
def test_dropout_stream_is_the_documented_splitmix(simd_mode, p, n):
    """keep[i] = u(seed, i) >= round(p 2^32): SplitMix64 of seed + (i // 2 + 1)
    golden (uint64, wrapping), its low half for even i and high half for odd i
    -- a NumPy model of csrc/fa_rowwise.h's stream, for the scalar loop and
    the AVX2 one (simd_mode), any size and thread count."""
    gen = np.random.default_rng(11)
    seed = np.uint64(np.random.default_rng(11).integers(0, 2**64, dtype=np.uint64))
    x = np.ones((n,), np.float32)
    i = np.arange(n, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = _splitmix64(seed + (i // np.uint64(2) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15))
    u = np.where(i % np.uint64(2) == 0, z & np.uint64(0xFFFFFFFF), z >> np.uint64(32))
    want = u >= np.uint64(min(round(p * 2.0 ** 32), 2 ** 32))
    for nt in (1, 2, 3):
        _, keep = F.dropout(x, p, rng=np.random.default_rng(11), n_threads=nt)
        np.testing.assert_array_equal(keep, want)
    _, keep = F.dropout(x, p, rng=gen)
    np.testing.assert_array_equal(keep, want)


@pytest.mark.parametrize("fn", ["dropout", "relu_dropout"])
def test_dropout_simd_levels_same_bytes_and_floats(fn, rng):
    """float32 dropout and relu-dropout: the AVX-512 pass (mask bytes and the
    scaled values in one loop, 64-bit multiplies in eight lanes), the AVX2 mask
    loop and the scalar one give the same mask bytes and the same output bits,
    NaN, -0 and odd chunk starts included, 1 and 2 threads.  (On a CPU without
    AVX-512 the levels coincide and this checks the AVX2 loop against the
    scalar one.)"""
    from fastattn import _kernels, _norm
    x = randn(rng, (3, 70001)).astype(np.float32)   # chunks start at odd indices
    x[:, ::13] = np.nan
    x[:, ::17] = -0.0
    runs = {}
    try:
        for level in (2, 1, 0):
            _kernels.set_simd_max_level(max(level, 1))
            _kernels.set_simd_disabled(level == 0)
            for p in (0.1, 0.5, 1 - 2.0 ** -33):
                for nt in (1, 2):
                    out, keep = getattr(_norm, fn)(x, p, rng=np.random.default_rng(3), n_threads=nt)
                    runs.setdefault((p, nt), []).append((out.view(np.uint32), keep.view(np.uint8)))
    finally:
        _restore_simd()
    for (p, nt), got in runs.items():
        for out, keep in got[1:]:
            np.testing.assert_array_equal(keep, got[0][1], err_msg=f"p={p} nt={nt}")
            np.testing.assert_array_equal(out, got[0][0], err_msg=f"p={p} nt={nt}")
    assert 0.05 < 1 - runs[(0.1, 1)][0][1].mean() < 0.15


def test_dropout_keeps_nan_where_dropped_as_x_times_mask():
    x = np.full((4, 100), np.nan, np.float32)
    out, keep = F.dropout(x, 0.5, rng=np.random.default_rng(0))
    assert np.isnan(out).all()


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape", [(), (5,), (33, 1001), (3, 200001)])
def test_relu_kernel_is_np_maximum(dtype, shape, rng):
    """max(x, 0) bit for bit as np.maximum (NaN kept, -0 -> +0), any thread
    count, input unchanged, a 0-d input gives a 0-d array."""
    x = randn(rng, shape).astype(dtype)
    if x.size >= 3:
        x.reshape(-1)[:3] = [-0.0, np.nan, -np.inf]
    x0 = x.copy()
    want = np.maximum(x, dtype(0))
    for nt in (1, 2, 3):
        got = F.relu(x, n_threads=nt)
        assert type(got) is np.ndarray and got.shape == x.shape and got.dtype == dtype
        bits = np.dtype(f"u{x.itemsize}")
        np.testing.assert_array_equal(got.view(bits), want.view(bits))
    np.testing.assert_array_equal(x, x0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_backward_kernel(dtype, rng):
    """0 where x <= 0, else grad_out (a NaN x passes it, as torch's threshold_backward)."""
    x = randn(rng, (33, 1001)).astype(dtype)
    x[0, :3] = [0.0, -0.0, np.nan]
    g = randn(rng, x.shape).astype(dtype)
    g[1, 5] = np.nan
    x0, g0 = x.copy(), g.copy()
    got = F.relu_backward(g, x)
    np.testing.assert_array_equal(got, np.where(x <= 0, 0, g))
    np.testing.assert_array_equal(F.relu_backward(g[:, ::2], x[:, ::2]), np.where(x <= 0, 0, g)[:, ::2])
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(g, g0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(7,), (3, 5, 33), (512, 300)])
def test_relu_dropout_fused_is_relu_then_dropout_bitwise(dtype, shape, rng, simd_mode):
    """FeedForward's one-pass relu + dropout (and its backward: AVX2 lanes in
    float32 with SIMD on) against the two ops: the same mask, the same bytes
    (NaN, -0 and 0 inputs included), the same draw from the generator."""
    from fastattn import _norm
    x = randn(rng, shape, dtype)
    x.flat[::17], x.flat[::13], x.flat[::11] = np.nan, -0.0, 0.0
    g1, g2 = np.random.default_rng(5), np.random.default_rng(5)
    d1, k1 = _norm.relu_dropout(x, 0.3, rng=g1)
    d2, k2 = F.dropout(F.relu(x), 0.3, rng=g2)
    np.testing.assert_array_equal(k1, k2)
    np.testing.assert_array_equal(d1.view(np.uint8), d2.view(np.uint8))
    assert g1.integers(2**32) == g2.integers(2**32)
    g = randn(rng, shape, dtype)
    b1 = _norm.relu_dropout_backward(g, k1, 0.3, d1)
    b2 = F.relu_backward(F.dropout_backward(g, k2, 0.3), d2)
    np.testing.assert_array_equal(b1.view(np.uint8), b2.view(np.uint8))


def test_relu_backward_nan_x_passes_the_gradient_as_torch():
    torch = pytest.importorskip("torch")
    x = np.array([np.nan, -1.0, 0.0, 2.0, -np.inf, np.inf])
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    tx = torch.tensor(x, requires_grad=True)
    torch.relu(tx).backward(torch.tensor(g))
    for dt in (np.float32, np.float64):
        np.testing.assert_array_equal(F.relu_backward(g.astype(dt), x.astype(dt)), tx.grad.numpy())


def _unaligned(a):
    """A copy of ``a`` at an address that is not a multiple of its item size."""
    buf = np.empty(a.nbytes + 1, np.uint8)
    u = buf[1:].view(a.dtype).reshape(a.shape)
    u[...] = a
    assert not u.flags.aligned
    return u


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_unaligned_inputs_are_copied_before_the_kernels(dtype, rng):
    """The kernels read aligned memory only (UBSan's alignment check found
    unaligned float32 rows reaching fa_ln_fwd): every op gives the aligned
    input's result."""
    x = randn(rng, (6, 50)).astype(dtype)
    g = randn(rng, x.shape).astype(dtype)
    w, b = randn(rng, (50,)).astype(dtype), randn(rng, (50,)).astype(dtype)
    ux, ug, uw, ub = map(_unaligned, (x, g, w, b))
    np.testing.assert_array_equal(F.layer_norm(ux, uw, ub), F.layer_norm(x, w, b))
    for got, ref in zip(F.layer_norm_backward(ug, ux, uw, ub), F.layer_norm_backward(g, x, w, b)):
        np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(F.relu_backward(ug, ux), F.relu_backward(g, x))
    a = F.dropout(ux, 0.3, rng=np.random.default_rng(1))
    r = F.dropout(x, 0.3, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(a[0], r[0])
    np.testing.assert_array_equal(F.dropout_backward(ug, r[1], 0.3),
                                  F.dropout_backward(g, r[1], 0.3))
