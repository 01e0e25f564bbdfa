"""The projection kernel (fastattn._proj.linear): blocks, strides, threads, BLAS setting."""
from __future__ import annotations

import threading

import numpy as np
import pytest

import fastattn
from fastattn import _bench, _multihead, _proj, _threads
from support import assert_close, randn, run_in_threads


def _linear(x, w, b, n_threads, y=None):
    if y is None:
        y = np.full(x.shape[:2] + (w.shape[0],), np.nan, x.dtype)
    blocks = _proj.linear(x, w, b, y, n_threads)
    return y, blocks


def test_runtime_is_installed():
    """_proj runs on _kernels' pool and BLAS hold (their addresses were handed over)."""
    assert _proj.runtime_installed()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize(("nb", "M", "N", "K"), [
    (1, 1, 1, 1), (1, 7, 5, 3), (3, 1, 300, 64), (1, 16, 1536, 64), (2, 130, 129, 17),
    (1, 300, 700, 33), (4, 64, 384, 8),
])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_linear_matches_numpy(simd_mode, dtype, nb, M, N, K, bias, n_threads, rng):
    """Both the few-row AVX2 kernel (float32, <= 128 rows a block) and the sgemm/dgemm blocks."""
    _threads.ensure_blas_hook()
    assert _proj.small_kernel_active() == (simd_mode == "simd")
    x = randn(rng, (nb, M, K), dtype)
    w = randn(rng, (N, K), dtype)
    b = randn(rng, (N,), dtype) if bias else None
    y, blocks = _linear(x, w, b, n_threads)
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    if bias:
        ref = ref + b
    assert blocks >= 1
    assert_close(y, ref, dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_linear_strided_batches_and_output(dtype, rng):
    """Batch items that are not one run of rows, padded rows, and an output with a row stride."""
    _threads.ensure_blas_hook()
    big = randn(rng, (3, 2 * 200 + 1, 40), dtype)
    x = big[:, :-1:2, 3:35]                     # (3, 200, 32): rows 80 apart, items 16040 apart
    w = randn(rng, (600, 40), dtype)[:, 4:36]   # (600, 32), row stride 40
    b = randn(rng, (600,), dtype)
    out_buf = np.full((3, 200, 650), np.nan, dtype)
    y = out_buf[:, :, 20:620]
    _, blocks = _linear(x, w, b, 2, y)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    assert_close(y, ref, dtype)
    assert np.isnan(out_buf[:, :, :20]).all() and np.isnan(out_buf[:, :, 620:]).all()
    assert blocks == 3 * 2  # two row blocks per batch item on two threads


@pytest.mark.parametrize("M", [1, 2, 3, 4, 5, 31, 32, 33])
@pytest.mark.parametrize("K", [1, 7, 8, 9, 64, 513])
def test_small_kernel_edges(simd_mode, M, K, rng):
    """Row, column and depth remainders of the 3 x 4 register blocks; strided rows."""
    _threads.ensure_blas_hook()
    N = 11
    x = randn(rng, (1, M, K + 5), np.float32)[:, :, 2:K + 2]
    w = randn(rng, (N, K + 3), np.float32)[:, 1:K + 1]
    b = randn(rng, (N,), np.float32)
    y, _ = _linear(x, w, b, 1)
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    rtol, atol = 2e-5 * max(1, np.sqrt(K) / 8), 2e-5 * max(1, np.sqrt(K) / 8)
    np.testing.assert_allclose(y, ref, rtol=rtol, atol=atol * max(1.0, np.abs(ref).max()))


def test_block_split():
    """Few rows: columns are split; many rows: rows are; tiny: one block; no
    block above _proj's MAX_BLOCK_FLOPS (1e9: KeyboardInterrupt is checked
    between blocks)."""
    _threads.ensure_blas_hook()
    z = np.zeros
    w = z((1536, 512), np.float32)
    assert _linear(z((1, 16, 512), np.float32), w, None, 2)[1] == 4      # 4 column blocks of 384
    assert _linear(z((1, 1024, 512), np.float32), w, None, 2)[1] == 4    # 4 row blocks of 256
    assert _linear(z((1, 1024, 512), np.float32), w, None, 1)[1] == 2    # 2 x 0.8 GFlop
    assert _linear(z((1, 256, 512), np.float32), w, None, 1)[1] == 1
    assert _linear(z((1, 4, 8), np.float32), z((8, 8), np.float32), None, 2)[1] == 1


def test_blas_setting_restored_and_threads_honoured(rng):
    """Projections hold BLAS at one thread while they run and give the setting back."""
    libs = _bench.openblas_libraries()
    lib = next((lib for tag, lib in libs.items() if tag == "scipy"), None)
    if lib is None or _threads.blas_hook_library() is None:
        pytest.skip("SciPy's OpenBLAS thread control is not reachable here")
    before = lib.get_threads()
    try:
        lib.set_threads(2)
        m = fastattn.layers.MultiHeadAttention(64, 4, seed=0)
        x = randn(rng, (2, 40, 64), np.float32)
        a = m(x, n_threads=1)
        b = m(x, n_threads=2)
        assert lib.get_threads() == 2
        assert_close(a, b.astype(np.float64), np.float32)
    finally:
        lib.set_threads(before)


def test_concurrent_calls_share_one_blas_counter(rng):
    """MHA and SDPA from several threads at once: right results, BLAS setting restored."""
    libs = _bench.openblas_libraries()
    lib = libs.get("scipy")
    if lib is None or _threads.blas_hook_library() is None:
        pytest.skip("SciPy's OpenBLAS thread control is not reachable here")
    m = fastattn.layers.MultiHeadAttention(64, 4, seed=0)
    x = randn(rng, (2, 64, 64), np.float32)
    q = randn(rng, (2, 4, 64, 16), np.float32)
    want_m = m(x)
    want_s = fastattn.scaled_dot_product_attention(q, q, q)
    before = lib.get_threads()
    errors = []

    def work(i):
        try:
            for _ in range(15):
                if i % 2:
                    assert_close(m(x, n_threads=2), want_m.astype(np.float64), np.float32)
                else:
                    assert_close(fastattn.scaled_dot_product_attention(q, q, q, n_threads=2),
                                 want_s.astype(np.float64), np.float32)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_in_threads(work, 4)
    assert not errors, errors
    assert lib.get_threads() == before


def test_install_runtime_is_idempotent():
    assert _multihead._install_runtime() is True
    assert _proj.runtime_installed()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("M", [1, 5, 200])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_zero_depth_gives_bias(simd_mode, dtype, M, bias, rng):
    """K = 0: a sum of no terms, so y = b (zeros without a bias) on every path (the
    few-row kernel refuses K = 0; it used to leave the output unwritten)."""
    _threads.ensure_blas_hook()
    x = np.zeros((2, M, 0), dtype)
    w = np.zeros((16, 0), dtype)
    b = randn(rng, (16,), dtype) if bias else None
    y, blocks = _linear(x, w, b, 2)
    assert blocks == 0
    np.testing.assert_array_equal(y, np.broadcast_to(b if bias else np.zeros(16, dtype), y.shape))


def test_linear_empty_rows_or_columns_write_nothing(rng):
    x = randn(rng, (1, 0, 8), np.float32)
    y, blocks = _linear(x, randn(rng, (4, 8), np.float32), None, 2)
    assert blocks == 0 and y.shape == (1, 0, 4)
    x = randn(rng, (1, 3, 8), np.float32)
    y, blocks = _linear(x, np.zeros((0, 8), np.float32), None, 2)
    assert blocks == 0 and y.shape == (1, 3, 0)


@pytest.fixture
def pack_tuning():
    prev = _proj.set_tuning()
    yield
    _proj.set_tuning(**prev)


@pytest.mark.parametrize(("nb", "M", "N", "K", "strided"), [
    (1, 64, 37, 33, False), (1, 65, 512, 64, False), (3, 40, 100, 17, False),
    (2, 70, 129, 9, True), (1, 200, 1536, 64, False),
])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("n_threads", [1, 2, 3])
def test_linear_packs_weights_per_call(simd_mode, pack_tuning, nb, M, N, K, strided, bias,
                                       n_threads, rng):
    """From pack_min_rows rows on (all batch items together), float32 products pack
    w on the call's threads and take the packed kernel: the oracle's result, the
    same as with per-call packing off (within float32 rounding), inputs unchanged."""
    _threads.ensure_blas_hook()
    w = randn(rng, (N, 2 * K if strided else K), np.float32)[:, :K]  # row stride != K
    x = randn(rng, (nb, M, K), np.float32)
    b = randn(rng, (N,), np.float32) if bias else None
    copies = [a.copy() for a in (x, w) + ((b,) if bias else ())]
    ref = np.einsum("bmk,nk->bmn", x.astype(np.float64), w.astype(np.float64))
    if bias:
        ref = ref + b
    _proj.set_tuning(pack_min_rows=64)
    y, _ = _linear(x, w, b, n_threads)
    _proj.set_tuning(pack_min_rows=0)
    y_off, _ = _linear(x, w, b, n_threads)
    assert_close(y, ref, np.float32)
    np.testing.assert_allclose(y, y_off, rtol=2e-5, atol=2e-5 * np.sqrt(K))
    for a, c in zip((x, w) + ((b,) if bias else ()), copies):
        np.testing.assert_array_equal(a, c)
    if simd_mode == "simd" and _proj.packed_kernel_active():
        # the packed kernel ran: the same bits as with w packed beforehand (wp=).
        # (Not "differs from y_off": without a bias OpenBLAS's sgemm can give
        # the packed kernel's exact bits, as it does on AMD EPYC.)
        wp = _proj.pack_f32(w, np.empty(_proj.packed_size(N, K), np.float32))
        y_wp = np.full_like(y, np.nan)
        _proj.linear(x, w, b, y_wp, n_threads, wp)
        np.testing.assert_array_equal(y, y_wp)


def test_per_call_packing_scratch_is_per_thread(pack_tuning, rng):
    """Threads packing different weights at the same time each use their own
    scratch (a shared one would mix them); release_pack_buffer frees it."""
    _threads.ensure_blas_hook()
    _proj.set_tuning(pack_min_rows=1)
    jobs = []
    for i in range(4):
        K, N = 24 + 8 * i, 48 + 16 * i
        x = randn(rng, (1, 96, K), np.float32)
        w = randn(rng, (N, K), np.float32)
        jobs.append((x, w, np.einsum("bmk,nk->bmn", x.astype(np.float64), w.astype(np.float64))))
    errors = []

    def run(x, w, ref):
        for _ in range(60):
            y = np.empty(x.shape[:2] + (w.shape[0],), np.float32)
            _proj.linear(x, w, None, y, 1)
            if not np.allclose(y, ref, rtol=1e-4, atol=1e-4):
                errors.append(float(np.abs(y - ref).max()))
        _proj.release_pack_buffer()

    threads = [threading.Thread(target=run, args=j) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_per_call_packing_limits(pack_tuning, rng):
    """Below pack_min_rows rows, or past pack_max_elems packed floats, no packing."""
    _threads.ensure_blas_hook()
    x = randn(rng, (1, 80, 32), np.float32)
    w = randn(rng, (40, 32), np.float32)
    ref = np.einsum("bmk,nk->bmn", x.astype(np.float64), w.astype(np.float64))
    # (N rounded up to 16) x K = 48 x 32 packed floats; the scratch exists only
    # once a call of this thread packed
    cases = [({"pack_min_rows": 81}, False), ({"pack_min_rows": 80, "pack_max_elems": 48 * 32 - 1}, False),
             ({"pack_min_rows": 80, "pack_max_elems": 48 * 32}, _proj.packed_kernel_active())]
    for tuning, packs in cases:
        _proj.release_pack_buffer()
        _proj.set_tuning(**tuning)
        y, _ = _linear(x, w, None, 2)
        assert_close(y, ref, np.float32)
        buf = getattr(_proj._tls, "buf", None)
        assert (buf is not None) == packs, tuning
        if packs:
            assert buf.dtype == np.float32 and buf.size >= 48 * 32
    _proj.release_pack_buffer()
