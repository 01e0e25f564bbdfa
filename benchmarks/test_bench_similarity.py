"""Benchmarks of fastattn.attention with similarities other than the dot product.

Groups ``additive BxTxT d=.. d_a=.. float32`` (the targets of issue 5): one
call of additive (Bahdanau) attention by

* ``fastattn`` -- timed with :func:`fastattn.testing.benchmark_similarity`;
* ``torch`` -- the usual PyTorch Bahdanau, ``V(tanh(W1(q)[:, :, None] + W2(k)[:, None]))``;
* ``keras`` -- ``keras.layers.AdditiveAttention`` on projected inputs (Keras 3, torch backend);
* ``numpy`` -- the same dense formula in NumPy;

(see ``similarity_impls.py``), all on the same float32 inputs and
parameters, at fastattn's thread count (torch.set_num_threads, NumPy's
OpenBLAS held there).  Every result is checked against the float64 oracle
(outside the timing); fastattn's float32 error must be <= 1e-5 relative.
Group ``similarities 4x256x256 d=64 float32``: fastattn with every built-in
and a NumPy plugin, through the same helper.  Memory:
``python benchmarks/memory_similarity.py`` (and ``test_memory_targets``
here).  Table: ``python benchmarks/report_similarity.py --json bench.json``.

    pytest benchmarks/test_bench_similarity.py --benchmark-only --benchmark-json=bench.json
"""
from __future__ import annotations

import contextlib
import functools
import os
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _bench
from fastattn.similarity import ParamSpec, Similarity
from fastattn.testing import benchmark_similarity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import similarity_impls as SI  # noqa: E402

# every benchmark records the other processes' load and rests afterwards (conftest)
pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)
keras = SI.load_keras() if torch is not None else None
PEER_RTOL = 1e-4   # peers and NumPy against the float64 oracle (relative to max |ref|)
TARGET_RTOL = 1e-5  # fastattn float32




@functools.lru_cache(maxsize=1)
def case_data(case):
    q, k, v, P = SI.make_data(case)
    return q, k, v, P, SI.oracle(q, k, v, P)


def rel_err(got, ref):
    return float(np.abs(np.asarray(got, np.float64) - ref).max() / np.abs(ref).max())


def _params():
    for case in SI.CASES:
        for impl in SI.IMPLS:
            marks = [pytest.mark.benchmark(group=case.group)]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            if impl == "keras" and keras is None:
                marks.append(pytest.mark.skip(reason="keras 3 (torch backend) is not importable"))
            yield pytest.param(case, impl, id=f"{case.name}-{impl}", marks=marks)


@pytest.mark.parametrize(("case", "impl"), list(_params()))
def test_additive(benchmark, case, impl):
    q, k, v, P, ref = case_data(case)
    benchmark.extra_info.update(kind="similarity_peer", case=list(case), impl=impl,
                                threads=N_THREADS)
    if impl == "fastattn":
        result = benchmark_similarity(benchmark, "additive", batch=case.B, Lq=case.T, d=case.d,
                                      d_a=case.d_a, params=P, seed=0, n_threads=N_THREADS)
        benchmark.extra_info.update(kind="similarity_peer", impl="fastattn")
        err = rel_err(result, ref)
        benchmark.extra_info["rel_err"] = err
        assert err <= TARGET_RTOL, err
        return
    ctx = _bench.blas_threads(N_THREADS, which=("numpy",)) if impl == "numpy" else contextlib.nullcontext()
    with ctx:
        fn, to_np = SI.make_callable(impl, q, k, v, P, N_THREADS)
        first = to_np(fn())
        err = rel_err(first, ref)
        assert err <= PEER_RTOL, err
        benchmark.extra_info["rel_err"] = err
        _bench.quiesce()  # the reference and this first call may leave workers spinning
        result = _bench.time_benchmark(benchmark, fn)
    assert rel_err(to_np(result), ref) <= PEER_RTOL


class NegSqDist(Similarity):
    """A user similarity in NumPy (runs through the tiled NumPy path)."""

    name = "bench_neg_sq_dist"
    params_spec = {"gamma": ParamSpec((), required=False, default=0.05)}
    same_dims = True

    def score(self, query, key, params):
        qq = np.sum(query * query, axis=-1)[..., :, None]
        kk = np.sum(key * key, axis=-1)[..., None, :]
        return -params["gamma"] * (qq + kk - 2 * query @ np.swapaxes(key, -1, -2))


@pytest.mark.benchmark(group="similarities 4x256x256 d=64 float32")
@pytest.mark.parametrize("sim", ["dot", "scaled_dot", "general", "cosine", "additive", "concat",
                                 "numpy_plugin"])
def test_similarities(benchmark, sim):
    s = NegSqDist() if sim == "numpy_plugin" else sim
    benchmark_similarity(benchmark, s, batch=4, Lq=256, d=64, n_threads=N_THREADS)


@pytest.mark.parametrize("case", SI.CASES, ids=lambda c: c.name)
def test_memory_targets(case):
    """Peak extra RSS of one call (fresh process each): fastattn <= 1/50 of the
    faster peer's (the lower of torch and keras)."""
    import memory_similarity as M

    fa = M.measure("fastattn", case, N_THREADS)
    peers = [r for r in (M.measure(i, case, N_THREADS) for i in ("torch", "keras")) if r]
    if not peers:
        pytest.skip("no peer installed")
    best = min(M.extra_mb(r) for r in peers)
    assert M.extra_mb(fa) * 50 <= best, (M.extra_mb(fa), best)
