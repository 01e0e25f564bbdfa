"""Benchmarks of fastattn.scaled_dot_product_attention against its peers.

One pytest-benchmark group per case (shape B x H x N x d, dtype, causal;
the list is :data:`fastattn._bench.SUITE_CASES`).  Each group times:

* ``fastattn``: ``fastattn.scaled_dot_product_attention``;
* ``numpy``: plain NumPy ``softmax(scale * Q K^T) V`` in the inputs' dtype
  (:func:`fastattn._bench.numpy_sdpa`; not the float64 oracle in
  ``fastattn._reference``, which is written for clarity, not speed), with
  NumPy's OpenBLAS held at fastattn's thread count;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` when torch
  is importable, with ``torch.set_num_threads`` equal to fastattn's thread
  count, under ``torch.inference_mode``, on tensors made once with
  ``torch.from_numpy``;
* ``ort``: onnxruntime running a one-node opset-23 ``Attention`` model
  (:class:`fastattn._bench.OrtAttention`) when onnx and onnxruntime are
  importable: CPU provider, ``intra_op_num_threads`` = fastattn's thread
  count, ``inter_op_num_threads=1``, inputs and a preallocated output bound
  once with IOBinding, so the timed call is only
  ``session.run_with_iobinding``.  (onnxruntime 1.32 has no native float64
  kernel for this op; it runs the operator's function body instead, see
  the ``fastattn._bench`` docstring.)

Two more groups, ``sgemm 2048`` and ``dgemm 2048`` (run first), time SciPy's OpenBLAS
``sgemm``/``dgemm`` (the BLAS fastattn's kernels call) on 2048 x 2048
Fortran-ordered arrays with the BLAS held at fastattn's thread count, so
``benchmarks/report.py`` can state fastattn's throughput as a share of GEMM
measured in the same run.

Each benchmark is followed by a 0.2 s rest (``_bench.quiesce``) so worker
threads still spinning from one library (OpenBLAS ~110 ms, onnxruntime
~40 ms, torch ~10 ms after a call; ``benchmarks/idle.py``) do not slow the
next one down.

Every attention benchmark checks the result it timed against the NumPy
result (outside the timing), and the NumPy baseline is itself checked
against the float64 oracle, so a broken kernel cannot look fast.

Calls longer than ~20 ms are timed with ``benchmark.pedantic`` (1 warm-up
round, then as many 1-iteration rounds as fit in ~3 s, between 3 and 15) so
the whole suite stays within a few minutes.

    pytest benchmarks/ --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py --json bench.json
"""
from __future__ import annotations

import contextlib
import functools
import time
from typing import NamedTuple

import numpy as np
import pytest

import fastattn
from fastattn import _bench, _reference
from fastattn._bench import Case

# every benchmark records the other processes' load and rests afterwards (conftest)
pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)
ort = _bench.load_ort()

TOLERANCE = {  # (rtol, atol) against the NumPy result, per dtype
    "float32": (1e-4, 1e-5),
    "float64": (1e-10, 1e-12),
}
# onnxruntime's float64 Attention is its ONNX function body, which rounds
# sqrt(scale) to float32: ~1e-7 relative error
ORT_FLOAT64_TOLERANCE = (1e-6, 1e-6)

CASES = list(_bench.SUITE_CASES)
IMPLS = ("fastattn", "torch", "ort", "numpy")
GEMM_N = 2048



class Data(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None  # boolean, True = may attend (for the NumPy baseline)
    expected: np.ndarray     # the NumPy baseline's result


@functools.lru_cache(maxsize=2)
def case_data(case: Case) -> Data:
    q, k, v = _bench.random_qkv(case.shape, np.dtype(case.dtype), seed=0)
    L = case.shape[-2]
    mask = _bench.causal_mask(L, L) if case.causal else None
    with _bench.blas_threads(1, which=("numpy",)):  # leaves no OpenBLAS worker spinning
        expected = _bench.numpy_sdpa(q, k, v, mask)
    return Data(q, k, v, mask, expected)


def assert_close(actual, case: Case, expected, impl=""):
    rtol, atol = TOLERANCE[case.dtype]
    if impl == "ort" and case.dtype == "float64":
        rtol, atol = ORT_FLOAT64_TOLERANCE
    actual = np.asarray(actual)
    assert actual.shape == expected.shape
    assert actual.dtype == np.dtype(case.dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def _params():
    for case in CASES:
        for impl in IMPLS:
            marks = [pytest.mark.benchmark(group=case.group)]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            if impl == "ort" and ort is None:
                marks.append(pytest.mark.skip(reason="onnx/onnxruntime is not importable"))
            yield pytest.param(case, impl, id=f"{case.name}-{impl}", marks=marks)


def _gemm_params():
    for dtype in ("float32", "float64"):
        name = f"{'s' if dtype == 'float32' else 'd'}gemm"
        yield pytest.param(dtype, name, id=f"{name}-{GEMM_N}",
                           marks=pytest.mark.benchmark(group=f"{name} {GEMM_N}"))


@pytest.mark.parametrize(("dtype", "name"), list(_gemm_params()))
def test_gemm(benchmark, dtype, name):
    """BLAS GEMM throughput: the yardstick of report.py's %gemm column."""
    run, flops = _bench.gemm_callable(dtype, GEMM_N)
    with _bench.blas_threads(N_THREADS, which=("scipy",)) as got:
        benchmark.extra_info.update(kind="gemm", dtype=dtype, n=GEMM_N, flops=flops,
                                    impl="scipy.linalg.blas." + name,
                                    blas_threads=got.get("scipy"), threads=N_THREADS)
        t0 = time.perf_counter()
        run()
        one = time.perf_counter() - t0
        benchmark.pedantic(run, rounds=int(min(15, max(5, 2.0 / one))), iterations=1,
                           warmup_rounds=1)


@pytest.mark.benchmark(group="fma peak")
def test_fma_peak(benchmark):
    """The float32 FMA peak at fastattn's thread count: report.py's %peak column."""
    run, flops = _bench.fma_peak_callable(N_THREADS)
    if not flops:
        pytest.skip("fastattn's AVX2 code is not in use: no FMA peak to measure")
    benchmark.extra_info.update(kind="fma_peak", flops=flops, threads=N_THREADS,
                                impl="fastattn._kernels.fma_probe")
    benchmark.pedantic(run, rounds=15, iterations=1, warmup_rounds=2)


@pytest.mark.parametrize(("case", "impl"), list(_params()))
def test_sdpa(benchmark, case, impl):
    data = case_data(case)
    benchmark.extra_info.update(kind="sdpa", shape=list(case.shape), dtype=case.dtype,
                                causal=case.causal, impl=impl, threads=N_THREADS,
                                flops=_bench.attention_flops(case.shape, case.causal))
    if impl == "ort":
        ops = _bench.ort_graph_ops(case.dtype)
        if ops is None:
            pytest.skip(f"onnxruntime has no Attention for {case.dtype} (n/a)")
        benchmark.extra_info["ort_ops"] = len(ops)

    ctx = contextlib.ExitStack()
    if impl == "torch":
        ctx.enter_context(torch.inference_mode())
    if impl == "numpy":
        ctx.enter_context(_bench.blas_threads(N_THREADS, which=("numpy",)))
    with ctx:
        fn = _bench.impl_callable(impl, data.q, data.k, data.v, case.causal, N_THREADS, torch)
        first = np.asarray(fn())  # checked before anything is timed
        assert_close(first, case, data.expected, impl)
        # rest: the oracle just computed (NumPy's threaded OpenBLAS) and this
        # first call may leave worker threads spinning for ~100 ms
        _bench.quiesce()
        t0 = time.perf_counter()
        fn()  # the second call decides how to time (the first may include set-up)
        first_s = time.perf_counter() - t0
        result = _bench.time_benchmark(benchmark, fn, first_s)

    result = np.asarray(result)
    if impl == "numpy":  # the baseline itself against the float64 oracle
        oracle = _reference.scaled_dot_product_attention(data.q, data.k, data.v,
                                                         is_causal=case.causal)
        assert_close(result, case, oracle.astype(case.dtype))
    assert_close(result, case, data.expected, impl)
