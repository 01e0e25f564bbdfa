"""The fused C kernel (csrc/fa_additive.c): its tanh, its accuracy at the
benchmark shapes, memory, SIMD vs scalar, threads, and compiled plugins'
error paths through the plugin ABI."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import _reference as R, _scores
from fastattn._attention import SimilarityError
from fastattn.similarity import CompiledSimilarity, ParamSpec

import test_plugin_backward
from support import assert_close, randn, run_in_threads


def _tanh(x):
    _scores.sync_simd(fastattn._kernels.simd_level())
    y = np.empty_like(x)
    _scores.tanh(np.ascontiguousarray(x), y)
    return y


def test_tanh_float32_error_bound(simd_mode):
    """The documented bound: <= 2 ulp and <= 2e-7 relative, on a dense grid."""
    rng = np.random.default_rng(1)
    x = np.concatenate([
        np.arange(-10, 10, 2.0 ** -12, dtype=np.float32),
        (rng.standard_normal(10 ** 6) * 3).astype(np.float32),
        (rng.random(10 ** 5) * 1e-3).astype(np.float32),   # tiny arguments
        np.float32(0.625) + (rng.random(10 ** 5) - 0.5).astype(np.float32) * 1e-3,  # the switch
        np.float32([1e-30, -1e-30, 1e-45, 7.9988, 8, -8, 9, 20, -20, 3e38, -3e38]),
    ])
    y = _tanh(x)
    ref = np.tanh(x.astype(np.float64))
    err = np.abs(y.astype(np.float64) - ref)
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    # ours (AVX2) <= 2 ulp; libm's tanhf (the scalar fallback) measured 2.13 here
    assert (err / ulp).max() <= (2.0 if fastattn.simd_active() else 3.0)
    nz = ref != 0
    assert (err[nz] / np.abs(ref[nz])).max() <= 2e-7
    assert np.all(np.abs(y) <= 1)
    assert np.all(np.sign(y) == np.sign(x))  # odd, never flips sign


def test_tanh_special_values(simd_mode):
    x = np.float32([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 0.5, 2.0])
    y = _tanh(x)
    assert y[0] == 0 and not np.signbit(y[0])
    assert y[1] == 0 and np.signbit(y[1])
    assert y[2] == 1 and y[3] == -1
    assert np.isnan(y[4])
    np.testing.assert_allclose(y[5:], np.tanh(x[5:].astype(np.float64)), rtol=3e-7)
    # every tail length of the vector loop
    for n in range(1, 17):
        xs = np.linspace(-3, 3, n, dtype=np.float32)
        np.testing.assert_allclose(_tanh(xs), np.tanh(xs.astype(np.float64)), rtol=3e-7, atol=1e-7)


def test_tanh_against_mpmath(simd_mode):
    mpmath = pytest.importorskip("mpmath")
    rng = np.random.default_rng(2)
    x = np.concatenate([(rng.standard_normal(500) * 4), rng.random(100) * 1e-3]).astype(np.float32)
    exact = np.array([float(mpmath.tanh(mpmath.mpf(float(t)))) for t in x])
    y32 = _tanh(x).astype(np.float64)
    ulp = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    assert (np.abs(y32 - exact) / ulp).max() <= 5.0
    # float64: Pade / exp (SIMD) or libm tanh (scalar), on double inputs
    x64 = np.concatenate([rng.standard_normal(1500) * 3, rng.random(500) * 1.3,
                          np.linspace(0.62, 0.63, 200), -np.linspace(0.62, 0.63, 200),
                          rng.random(300) * 40 - 20])
    _scores.sync_simd(fastattn._kernels.simd_level())
    y64 = np.empty_like(x64)
    _scores.tanh(x64, y64)
    exact = np.array([float(mpmath.tanh(mpmath.mpf(float(t)))) for t in x64])
    bound = 3.0 if simd_mode == "simd" else 2.0  # libm tanh is not correctly rounded
    assert (np.abs(y64 - exact) / np.spacing(np.abs(exact))).max() <= bound


def test_tanh_float64_special_values(simd_mode):
    _scores.sync_simd(fastattn._kernels.simd_level())
    x = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-300, -1e-300, 19.0, 19.2, -30.0, 1e300])
    y = np.empty_like(x)
    _scores.tanh(x, y)
    assert y[0] == 0 and not np.signbit(y[0]) and y[1] == 0 and np.signbit(y[1])
    assert y[2] == 1 and y[3] == -1 and np.isnan(y[4])
    assert y[5] == 1e-300 and y[6] == -1e-300
    np.testing.assert_allclose(y[7:], np.tanh(x[7:]), rtol=2.3e-16, atol=0)  # 1 ulp
    for n in range(1, 9):  # vector tails
        xs = np.linspace(-2, 2, n)
        ys = np.empty_like(xs)
        _scores.tanh(xs, ys)
        np.testing.assert_allclose(ys, np.tanh(xs), rtol=1e-15, atol=1e-16)


def _chunked_additive_oracle(q, k, v, P, rows=32):
    """float64 additive attention without the full (Lq, Lk, d_a) tensor."""
    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i0 in range(0, q.shape[-2], rows):
        qs = q[..., i0:i0 + rows, :]
        s = R.score_additive(qs, k, P["W_q"], P["W_k"], P["v"], P.get("b"))
        out[..., i0:i0 + rows, :] = R.attention(qs, k, v, lambda a, b: s)
    return out


@pytest.mark.parametrize("shape", [(2, 256, 128), (1, 1024, 64)], ids=["2x256x128", "1x1024x64"])
def test_float32_error_at_benchmark_shapes(shape, rng):
    """The benchmark's accuracy target: float32 within 1e-5 relative of float64."""
    B, T, d = shape
    q, k, v = (randn(rng, (B, T, d), np.float32) for _ in range(3))
    P = fastattn.get_similarity("additive").init_params(d, d, d_a=d, rng=3, dtype=np.float32)
    got = fastattn.attention(q, k, v, "additive", params=P)
    ref = _chunked_additive_oracle(q, k, v, P)
    rel = np.abs(got - ref).max() / np.abs(ref).max()
    assert rel <= 1e-5, rel


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("weights", [False, True])
def test_simd_and_scalar_paths_agree_with_oracle(simd_mode, dtype, weights, rng):
    q, k, v = randn(rng, (2, 37, 9), dtype), randn(rng, (2, 150, 5), dtype), randn(rng, (2, 150, 11), dtype)
    P = fastattn.get_similarity("additive").init_params(9, 5, d_a=13, rng=4, dtype=dtype)
    P["b"] = randn(rng, (13,), dtype)
    mask = rng.random((37, 150)) < 0.6
    ref = R.attention(q, k, v, lambda a, b: R.score_additive(a, b, P["W_q"], P["W_k"], P["v"], P["b"]),
                      mask, True, return_weights=weights)
    got = fastattn.attention(q, k, v, "additive", params=P, attn_mask=mask, is_causal=True,
                             return_weights=weights)
    if weights:
        assert_close(got[0], ref[0], dtype)
        assert_close(got[1], ref[1], dtype)
    else:
        assert_close(got, ref, dtype)


def test_fused_path_never_builds_the_dense_tensor(rng):
    """NumPy-side allocations of one fused call: projections and output only
    (the C scratch is n_threads x 64 x 128 scores)."""
    q, k, v = (randn(rng, (1, 1024, 64), np.float32) for _ in range(3))
    P = fastattn.get_similarity("additive").init_params(64, 64, d_a=64, rng=0, dtype=np.float32)
    fastattn.attention(q, k, v, "additive", params=P)  # warm
    tracemalloc.start()
    fastattn.attention(q, k, v, "additive", params=P)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    dense = 1024 * 1024 * 64 * 4  # what the peers allocate: (Tq, Tk, d_a) float32
    assert peak < 4 * 1024 * 64 * 4 + 65536  # Qp, Kp, output (+ small change)
    assert peak * 200 < dense


def test_concurrent_calls_from_python_threads(rng):
    """The kernel releases the GIL and keeps no shared state: concurrent calls
    from several threads give the single-threaded results."""
    q, k, v = randn(rng, (4, 128, 16), np.float32), randn(rng, (4, 200, 16), np.float32), \
        randn(rng, (4, 200, 8), np.float32)
    P = fastattn.get_similarity("additive").init_params(16, 16, d_a=24, rng=0, dtype=np.float32)
    expected = fastattn.attention(q, k, v, "additive", params=P, n_threads=1)
    results, errors = [None] * 4, []

    def work(i):
        try:
            for _ in range(5):
                results[i] = fastattn.attention(q, k, v, "additive", params=P, n_threads=2)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    run_in_threads(work, 4)
    assert not errors
    for r in results:
        np.testing.assert_array_equal(r, expected)


# ----------------------------------------------------------- plugin errors

@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_compiled_plugin_error_code(dtype, weights, rng):
    sim = fastattn.testing.selftest_similarity()
    q, k, v = randn(rng, (2, 70, 4), dtype), randn(rng, (2, 300, 4), dtype), randn(rng, (2, 300, 3), dtype)
    with pytest.raises(SimilarityError,
                       match=r"similarity 'fastattn_selftest_neg_sq_dist': the compiled score "
                             r"function returned error code 7"):
        fastattn.attention(q, k, v, sim, params={"mode": 1}, return_weights=weights, n_threads=2)
    for mode in (2, 3):
        with pytest.raises(ValueError, match=r"score returned NaN or \+inf values"):
            fastattn.attention(q, k, v, sim, params={"mode": mode}, return_weights=weights)


def _fake_capsule(abi, f32, f64, name=b"fastattn.score_plugin.v1"):
    """A version 1 plugin struct (four fields) in a capsule named ``name``."""
    cap = test_plugin_backward._capsule(["score_f32", "score_f64"], (abi, f32, f64), name.decode())
    return cap, None


class _Fake(CompiledSimilarity):
    name = "fake_compiled"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0),
                   "mode": ParamSpec((), required=False, default=0.0)}

    def __init__(self, capsule):
        self.capsule = capsule


def test_capsule_errors(rng):
    q, k, v = randn(rng, (3, 4)), randn(rng, (5, 4)), randn(rng, (5, 2))
    with pytest.raises(TypeError, match=r"similarity 'fake_compiled': capsule must be a "
                                        r"PyCapsule named 'fastattn.score_plugin.v2' \(or a "
                                        r"version 1 plugin's 'fastattn.score_plugin.v1'\), got int"):
        fastattn.attention(q, k, v, _Fake(3))
    cap, keep = _fake_capsule(1, None, None, name=b"other.name")
    with pytest.raises(TypeError, match=r"capsule must be a PyCapsule named"):
        fastattn.attention(q, k, v, _Fake(cap))
    _, _, f32, f64, _, _ = _scores.capsule_info(_scores.selftest_capsule())
    cap, keep = _fake_capsule(99, f32, f64)
    with pytest.raises(TypeError, match=r"plugin ABI version 99 in a capsule named "
                                        r"'fastattn.score_plugin.v1', this fastattn expects 1"):
        fastattn.attention(q, k, v, _Fake(cap))
    cap, keep = _fake_capsule(1, f32, None)
    with pytest.raises(TypeError, match=r"the plugin has no float64 score function"):
        fastattn.attention(q, k, v, _Fake(cap))
    # the float32 function alone works, against the NumPy reference
    q32, k32, v32 = (a.astype(np.float32) for a in (q, k, v))
    got = fastattn.attention(q32, k32, v32, _Fake(cap), params={"gamma": 0.5})
    assert_close(got, R.attention(q32, k32, v32, lambda a, b: R.score_neg_sq_dist(a, b, 0.5)), np.float32)
    del keep


def test_pack_params_must_return_contiguous_array(rng):
    class Bad(fastattn.testing._SelftestNegSqDist):
        def pack_params(self, params, d, dtype):
            return [1.0, 0.0]

    with pytest.raises(TypeError, match=r"pack_params must return a C-contiguous ndarray, got list"):
        fastattn.attention(randn(rng, (3, 4)), randn(rng, (5, 4)), randn(rng, (5, 2)), Bad())


def test_compiled_plugin_needs_equal_feature_sizes(rng):
    with pytest.raises(ValueError, match=r"key: expected last dim 4 .*needs equal query and key features"):
        fastattn.attention(randn(rng, (3, 4)), randn(rng, (5, 3)), randn(rng, (5, 2)),
                           fastattn.testing.selftest_similarity())


def test_blas_thread_setting_restored(rng):
    """The projections hold SciPy's OpenBLAS at one thread only while they run."""
    from fastattn import _bench

    libs = _bench.openblas_libraries()
    if "scipy" not in libs:
        pytest.skip("SciPy's OpenBLAS not found")
    lib = libs["scipy"]
    before = lib.get_threads()
    q, k, v = (randn(rng, (4, 512, 64), np.float32) for _ in range(3))
    P = fastattn.get_similarity("additive").init_params(64, 64, d_a=64, rng=0, dtype=np.float32)
    for nt in (1, 2):
        fastattn.attention(q, k, v, "additive", params=P, n_threads=nt)
        fastattn.attention(q, k, v, "general", params={"W": np.eye(64, dtype=np.float32)}, n_threads=nt)
        assert lib.get_threads() == before
