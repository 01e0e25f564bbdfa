"""Benchmarks of training attention: forward + backward of scaled dot-product attention.

One pytest-benchmark group per case (B x H x N x d, dtype, causal).  Each group times
the forward that keeps what the backward needs plus the backward, for the same
random upstream gradient:

* ``fastattn``: ``scaled_dot_product_attention(..., return_lse=True)`` then
  ``fastattn.functional.sdpa_backward``;
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` on tensors with
  ``requires_grad``, then ``out.backward(grad)`` (autograd; torch's CPU flash
  kernels), ``torch.set_num_threads`` = fastattn's thread count;
* ``numpy``: the dense formulas (scores, softmax, the five products) in the inputs'
  dtype with NumPy's OpenBLAS at fastattn's thread count (up to N = 2048: beyond,
  its N x N matrices take gigabytes).

A ``sgemm 2048`` / ``dgemm 2048`` group gives report_backward.py its %gemm column.
Every implementation's gradients are checked against the float64 oracle's
(``fastattn._reference.scaled_dot_product_attention_backward``) outside the
timing.  flops: the forward's 4·B·H·N²·d plus the backward's five products,
10·B·H·N²·d (halved with causality) -- 3.5x the forward's, as the issue counts.

    pytest benchmarks/test_bench_sdpa_backward.py --benchmark-only --benchmark-json=bwd.json
    python benchmarks/report_backward.py --json bwd.json
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest

import fastattn
from fastattn import _bench, _reference
from fastattn._bench import Case
from fastattn.functional import sdpa_backward

# every benchmark records the other processes' load and rests afterwards (conftest)
pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)

CASES = [Case(s, "float32", c) for s in ((1, 8, 128, 64), (8, 8, 128, 64), (1, 8, 512, 64),
                                          (1, 8, 2048, 64), (1, 8, 4096, 64))
         for c in (False, True)] + [Case((1, 8, 1024, 64), "float64", False)]
IMPLS = ("fastattn", "torch", "numpy")
NUMPY_MAX_N = 2048
TOLERANCE = {"float32": (2e-4, 2e-5), "float64": (1e-9, 1e-11)}


def group(case):
    return "bwd " + case.group


def training_flops(case):
    B, H, N, d = case.shape
    f = 14.0 * B * H * N * N * d
    return f / 2 if case.causal else f


@functools.lru_cache(maxsize=1)
def case_data(case):
    q, k, v = _bench.random_qkv(case.shape, np.dtype(case.dtype), seed=0)
    g = np.random.default_rng(1).standard_normal(q.shape).astype(case.dtype)
    ref = None
    if case.shape[-2] <= NUMPY_MAX_N:
        ref = _reference.scaled_dot_product_attention_backward(g, q, k, v, None, case.causal)[:3]
    return q, k, v, g, ref


def numpy_training(q, k, v, g, causal):
    """Dense forward + backward in the inputs' dtype (the textbook formulas)."""
    scale = q.dtype.type(1 / np.sqrt(q.shape[-1]))
    s = (q @ np.swapaxes(k, -1, -2)) * scale
    if causal:
        s = np.where(_bench.causal_mask(s.shape[-2], s.shape[-1]), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.swapaxes(p, -1, -2) @ g
    dp = g @ np.swapaxes(v, -1, -2)
    ds = p * (dp - (p * dp).sum(-1, keepdims=True))
    return (ds @ k) * scale, (np.swapaxes(ds, -1, -2) @ q) * scale, dv


def impl_callable(impl, q, k, v, g, causal):
    if impl == "fastattn":
        def run():
            out, lse = fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                             return_lse=True)
            return sdpa_backward(g, q, k, v, out, lse, is_causal=causal)
        return run
    if impl == "torch":
        tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
        tg = torch.from_numpy(g)

        def run():
            for t in (tq, tk, tv):
                t.grad = None
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tg)
            return tuple(t.grad.numpy() for t in (tq, tk, tv))
        return run
    return lambda: numpy_training(q, k, v, g, causal)




def _params():
    for case in CASES:
        for impl in IMPLS:
            marks = [pytest.mark.benchmark(group=group(case))]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            if impl == "numpy" and case.shape[-2] > NUMPY_MAX_N:
                marks.append(pytest.mark.skip(reason=f"dense NumPy only up to N = {NUMPY_MAX_N}"))
            yield pytest.param(case, impl, id=f"{case.name}-{impl}", marks=marks)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_gemm_yardstick(benchmark, dtype):
    """SciPy OpenBLAS gemm 2048 at fastattn's thread count (report_backward.py's %gemm)."""
    name = "sgemm" if dtype == "float32" else "dgemm"
    benchmark.group = f"{name} 2048"
    run, flops = _bench.gemm_callable(dtype, 2048)
    with _bench.blas_threads(N_THREADS, which=("scipy",)):
        benchmark.extra_info.update(kind="gemm", dtype=dtype, n=2048, flops=flops)
        benchmark.pedantic(run, rounds=8, iterations=1, warmup_rounds=1)


@pytest.mark.parametrize(("case", "impl"), list(_params()))
def test_sdpa_forward_backward(benchmark, case, impl):
    q, k, v, g, ref = case_data(case)
    benchmark.extra_info.update(kind="sdpa_bwd", shape=list(case.shape), dtype=case.dtype,
                                causal=case.causal, impl=impl, threads=N_THREADS,
                                flops=training_flops(case))
    ctx = contextlib.ExitStack()
    if impl == "numpy":
        ctx.enter_context(_bench.blas_threads(N_THREADS, which=("numpy",)))
    with ctx:
        fn = impl_callable(impl, q, k, v, g, case.causal)
        grads = fn()
        if ref is not None:   # checked before anything is timed
            rtol, atol = TOLERANCE[case.dtype]
            for a, r in zip(grads, ref):
                np.testing.assert_allclose(a, r, rtol=rtol, atol=atol * np.abs(r).max())
        _bench.quiesce()
        _bench.time_benchmark(benchmark, fn)
