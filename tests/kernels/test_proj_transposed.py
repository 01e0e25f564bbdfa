"""The packed projection kernel on transposed operands (linear_backward's float32
products): _proj.linear(w_transposed=True), with x_transposed, and
linear_backward taking that path -- against float64 NumPy, the same bits for
any thread count, SIMD on and off."""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _linear, _proj
from fastattn.functional import linear_backward
from support import randn


@pytest.fixture(autouse=True)
def _runtime():
    _linear._ensure_runtime()


needs_packed = pytest.mark.skipif(not _proj.packed_kernel_active(),
                                  reason="no packed projection kernel on this CPU/build (AVX2+FMA)")


@needs_packed
@pytest.mark.parametrize("M, K, N", [(64, 1, 1), (64, 16, 17), (97, 300, 33), (500, 70, 260),
                                     (1000, 129, 64)])
def test_linear_with_w_transposed(M, K, N, rng):
    x = randn(rng, (1, M, K), np.float32)
    wt = randn(rng, (K, N), np.float32)          # w's transpose: y = x @ wt
    assert _proj.packs_transposed(M, N, K)
    ys = []
    for nt in (1, 2, 3):
        y = np.full((1, M, N), np.nan, np.float32)
        _proj.linear(x, wt, None, y, nt, w_transposed=True)
        ys.append(y)
    ref = x[0].astype(np.float64) @ wt.astype(np.float64)
    np.testing.assert_allclose(ys[0][0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


@needs_packed
@pytest.mark.parametrize("M, K, N", [(64, 129, 17), (97, 300, 33), (256, 1100, 300),
                                     (1000, 256, 40), (65, 127, 16)])
@pytest.mark.parametrize("runs", [1, 64, 128, 5000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_runs_equal_one_call_a_run_added_in_order(M, K, N, runs, with_bias, rng):
    """runs=r: each run of r reduction terms summed from zero (the first from
    the bias) and added to y in order -- bit for bit one call a run, the
    results added in run order; any thread count."""
    x = randn(rng, (1, M, K), np.float32)
    wt = randn(rng, (K, N), np.float32)
    b = randn(rng, (N,), np.float32) if with_bias else None
    want = np.empty((1, M, N), np.float32)
    part = np.empty_like(want)
    for k0 in range(0, K, runs):
        dst = want if k0 == 0 else part
        _proj.linear(x[:, :, k0:k0 + runs], wt[k0:k0 + runs], b if k0 == 0 else None, dst, 1,
                     w_transposed=True)
        if k0:
            want += part
    for nt in (1, 2, 3):
        y = np.full((1, M, N), np.nan, np.float32)
        _proj.linear(x, wt, b, y, nt, w_transposed=True, runs=runs)
        np.testing.assert_array_equal(y, want)


@needs_packed
@pytest.mark.parametrize("M, K, N, runs", [(64, 300, 40, 128), (97, 129, 33, 128),
                                          (256, 1000, 256, 128), (203, 77, 17, 8),
                                          (70, 5, 100, 3)])
@pytest.mark.parametrize("row_pad", [0, 24])
def test_x_transposed_equals_a_transposed_copy(M, K, N, runs, row_pad, rng):
    """x given as its transpose (K, M), read in place (blocks transposed into
    scratch in the kernel): bit for bit the call on a transposed copy, any
    thread count, a row stride beyond M too."""
    assert _proj.packs_transposed(M, N, K)
    xt = randn(rng, (K, M + row_pad), np.float32)[:, :M]
    wt = randn(rng, (K, N), np.float32)
    b = randn(rng, (N,), np.float32)
    want = np.empty((1, M, N), np.float32)
    _proj.linear(np.ascontiguousarray(xt.T)[None], wt, b, want, 1, w_transposed=True, runs=runs)
    ref = xt.T.astype(np.float64) @ wt + b
    np.testing.assert_allclose(want[0], ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    for nt in (1, 2, 3):
        y = np.full((1, M, N), np.nan, np.float32)
        _proj.linear(xt[None], wt, b, y, nt, w_transposed=True, runs=runs, x_transposed=True)
        np.testing.assert_array_equal(y, want)


def test_x_transposed_needs_w_transposed_runs_and_one_item(rng):
    xt = randn(rng, (1, 5, 80), np.float32)
    wt = randn(rng, (5, 3), np.float32)
    y = np.empty((1, 80, 3), np.float32)
    for kw in (dict(), dict(w_transposed=True), dict(w_transposed=True, runs=2000)):
        with pytest.raises(ValueError, match="x_transposed"):
            _proj.linear(xt, wt if kw else wt.T.copy(), None, y, 2, x_transposed=True, **kw)
    with pytest.raises(ValueError, match="x_transposed"):
        _proj.linear(np.concatenate([xt, xt]), wt, None, np.empty((2, 80, 3), np.float32), 2,
                     w_transposed=True, runs=4, x_transposed=True)


def test_runs_need_w_transposed(rng):
    x = randn(rng, (1, 80, 5), np.float32)
    w = randn(rng, (3, 5), np.float32)
    with pytest.raises(ValueError, match="runs"):
        _proj.linear(x, w, None, np.empty((1, 80, 3), np.float32), 2, runs=4)
    with pytest.raises(ValueError, match="runs"):
        _proj.linear(x, w.T.copy(), None, np.empty((1, 80, 3), np.float32), 2,
                     w_transposed=True, runs=-1)


def test_w_transposed_refused_where_it_cannot_pack(rng):
    x = randn(rng, (1, 8, 5), np.float32)       # 8 rows: fewer than pack_min_rows
    wt = randn(rng, (5, 3), np.float32)
    assert not _proj.packs_transposed(8, 3, 5)
    with pytest.raises(ValueError, match="w_transposed"):
        _proj.linear(x, wt, None, np.empty((1, 8, 3), np.float32), 2, w_transposed=True)
    x64 = randn(rng, (1, 80, 5), np.float64)
    with pytest.raises(ValueError, match="w_transposed"):
        _proj.linear(x64, randn(rng, (5, 3), np.float64), None, np.empty((1, 80, 3)), 2,
                     w_transposed=True)


@pytest.mark.parametrize("lead, K, N", [((770,), 300, 260), ((4, 33), 65, 2), ((2, 50), 7, 100),
                                        ((64,), 64, 64)])
def test_linear_backward_float32_paths(simd_mode, lead, K, N, rng, monkeypatch):
    """Both products on the packed kernel where it applies (a spy counts them),
    the BLAS tiles elsewhere; float64 NumPy reference; same bits for 1-3 threads."""
    taken = []
    real = _proj.linear

    def spy(*a, **k):
        taken.append((k.get("w_transposed", False), k.get("runs", 0)))
        return real(*a, **k)

    monkeypatch.setattr(_proj, "linear", spy)
    x, g = randn(rng, lead + (K,), np.float32), randn(rng, lead + (N,), np.float32)
    w, b = randn(rng, (N, K), np.float32), randn(rng, (N,), np.float32)
    res = [linear_backward(g, x, w, b, n_threads=n) for n in (1, 2, 3)]
    rows = int(np.prod(lead))
    want = sum((_proj.packs_transposed(rows, K, N), _proj.packs_transposed(N, K, rows)))
    # one call for each product that packs, its reduction in runs of PACKED_KC terms
    assert taken == [(True, _linear.PACKED_KC)] * want * 3
    if simd_mode == "simd":
        assert want == (2 if N >= 64 else 1 if rows >= 64 else 0)
    g64, x64 = g.reshape(rows, N).astype(np.float64), x.reshape(rows, K).astype(np.float64)
    dx_ref, dw_ref = g64 @ w.astype(np.float64), g64.T @ x64
    dx, dw, db = res[0]
    assert dx.dtype == dw.dtype == db.dtype == np.float32
    scale = max(1.0, float(np.sqrt(rows)))
    np.testing.assert_allclose(dx.reshape(rows, K), dx_ref, rtol=1e-5, atol=1e-5 * scale)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-5, atol=1e-5 * scale * np.sqrt(rows))
    np.testing.assert_allclose(db, g64.sum(0), rtol=1e-5, atol=1e-5 * scale)
    for other in res[1:]:
        for a, c in zip(res[0], other):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("rows, N, K", [(4096, 1024, 256), (2048, 256, 512), (1024, 1000, 256)])
def test_linear_backward_float32_as_accurate_as_torch(rows, N, K, rng):
    """rms error <= 1.1x and max error <= 1.25x torch's (autograd, float32) against
    float64, for both gradients (issue 14's accuracy bar), on the packed path."""
    torch = pytest.importorskip("torch")
    x, w, g = (randn(rng, s, np.float32) for s in ((rows, K), (N, K), (rows, N)))
    assert _proj.packs_transposed(rows, K, N) and _proj.packs_transposed(N, K, rows)
    dx, dw, _ = linear_backward(g, x, w)
    tx, tw = torch.from_numpy(x).requires_grad_(), torch.from_numpy(w).requires_grad_()
    torch.nn.functional.linear(tx, tw).backward(torch.from_numpy(g))
    g64 = g.astype(np.float64)
    for got, theirs, ref in ((dx, tx.grad.numpy(), g64 @ w.astype(np.float64)),
                             (dw, tw.grad.numpy(), g64.T @ x.astype(np.float64))):
        ours_e, torch_e = got.astype(np.float64) - ref, theirs.astype(np.float64) - ref
        assert np.sqrt(np.mean(ours_e ** 2)) <= 1.1 * np.sqrt(np.mean(torch_e ** 2))
        assert np.abs(ours_e).max() <= 1.25 * np.abs(torch_e).max()


@pytest.mark.parametrize("K, M, N, runs", [(300, 97, 40, 128), (129, 64, 17, 32), (1000, 203, 70, 128),
                                           (77, 130, 33, 16)])
def test_x_transposed_column_sums_in_row_order(K, M, N, runs, rng):
    """``colsum`` with ``x_transposed``: the column sums of x[0].T's rows
    added to the array, each in float64 over the K terms in order -- exactly
    np.add.reduce along axis 0 in float64 (row by row) -- whatever the thread
    count; the product unchanged by it.  (Without the packed kernel the call
    is refused, as every x_transposed call.)"""
    xt = randn(rng, (1, K, M), np.float32)
    if not _proj.packs_transposed(M, N, K):
        with pytest.raises(ValueError, match="w_transposed"):
            _proj.linear(xt, randn(rng, (K, N), np.float32), None, np.empty((1, M, N), np.float32),
                         1, w_transposed=True, runs=runs, x_transposed=True, colsum=np.zeros(M))
        return
    wt = randn(rng, (K, N), np.float32)
    start = randn(rng, (M,), np.float64)
    want = np.add.reduce(np.concatenate([start[None], xt[0].astype(np.float64)]), axis=0)
    y0 = np.empty((1, M, N), np.float32)
    _proj.linear(xt, wt, None, y0, 1, w_transposed=True, runs=runs, x_transposed=True)
    for nt in (1, 2, 3):
        cs = start.copy()
        y = np.empty((1, M, N), np.float32)
        _proj.linear(xt, wt, None, y, nt, w_transposed=True, runs=runs, x_transposed=True,
                     colsum=cs)
        np.testing.assert_array_equal(cs, want)
        np.testing.assert_array_equal(y, y0)


def test_colsum_needs_x_transposed_and_a_float64_vector(rng):
    x = randn(rng, (1, 80, 5), np.float32)
    wt = randn(rng, (5, 3), np.float32)
    with pytest.raises(ValueError, match="colsum"):
        _proj.linear(x, wt, None, np.empty((1, 80, 3), np.float32), 2, w_transposed=True,
                     runs=4, colsum=np.zeros(80))
    xt = randn(rng, (1, 5, 80), np.float32)
    for bad in (np.zeros(79), np.zeros(80, np.float32), np.zeros((80, 1))):
        with pytest.raises(ValueError, match="colsum"):
            _proj.linear(xt, wt, None, np.empty((1, 80, 3), np.float32), 2, w_transposed=True,
                         runs=4, x_transposed=True, colsum=bad)
