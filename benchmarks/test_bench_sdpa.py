"""Benchmarks of fastattn.scaled_dot_product_attention.

One pytest-benchmark group per case (shape B x H x N x d, dtype, causal).
Each group times:

* ``fastattn``: ``fastattn.scaled_dot_product_attention``;
* ``numpy``: plain NumPy ``softmax(scale * Q K^T) V`` in the inputs' dtype
  (:func:`fastattn._bench.numpy_sdpa`; not the float64 oracle in
  ``fastattn._reference``, which is written for clarity, not speed);
* ``torch``: ``torch.nn.functional.scaled_dot_product_attention`` when torch
  is importable, with ``torch.set_num_threads`` equal to fastattn's thread
  count, under ``torch.inference_mode``, on tensors made once with
  ``torch.from_numpy``.

Every benchmark checks the result it timed against the NumPy result
(outside the timing), and the NumPy baseline is itself checked against the
float64 oracle, so a broken kernel cannot look fast.

    pytest benchmarks/ --benchmark-only
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np
import pytest

import fastattn
from fastattn import _bench, _reference

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)

TOLERANCE = {  # (rtol, atol) against the NumPy result, per dtype
    "float32": (1e-4, 1e-5),
    "float64": (1e-10, 1e-12),
}


class Case(NamedTuple):
    shape: tuple
    dtype: str = "float32"
    causal: bool = False

    @property
    def name(self):
        return "x".join(map(str, self.shape)) + f"-{self.dtype}" + ("-causal" if self.causal else "")

    @property
    def group(self):
        return self.name.replace("-", " ")


CASES = [
    Case((1, 1, 16, 64)),
    Case((32, 8, 64, 64)),
    Case((8, 8, 128, 64)),
    Case((1, 8, 128, 64)),
    Case((1, 12, 128, 32)),
    Case((1, 8, 512, 64)),
    Case((4, 8, 512, 64)),
    Case((1, 8, 2048, 64)),
    Case((1, 8, 128, 64), causal=True),
    Case((1, 8, 512, 64), causal=True),
    Case((1, 8, 2048, 64), causal=True),
    Case((8, 8, 128, 64), "float64"),
    Case((1, 8, 2048, 64), "float64"),
]
IMPLS = ("fastattn", "numpy", "torch")


class Data(NamedTuple):
    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    mask: np.ndarray | None  # boolean, True = may attend (for the NumPy baseline)
    expected: np.ndarray     # the NumPy baseline's result


@functools.lru_cache(maxsize=None)
def case_data(case: Case) -> Data:
    q, k, v = _bench.random_qkv(case.shape, np.dtype(case.dtype), seed=0)
    L = case.shape[-2]
    mask = _bench.causal_mask(L, L) if case.causal else None
    return Data(q, k, v, mask, _bench.numpy_sdpa(q, k, v, mask))


def assert_close(actual, case: Case, expected):
    rtol, atol = TOLERANCE[case.dtype]
    assert actual.shape == expected.shape
    assert actual.dtype == np.dtype(case.dtype)
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def _params():
    for case in CASES:
        for impl in IMPLS:
            marks = [pytest.mark.benchmark(group=case.group)]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            yield pytest.param(case, impl, id=f"{case.name}-{impl}", marks=marks)


@pytest.mark.parametrize(("case", "impl"), list(_params()))
def test_sdpa(benchmark, case, impl):
    data = case_data(case)
    benchmark.extra_info.update(shape=list(case.shape), dtype=case.dtype,
                                causal=case.causal, impl=impl, threads=N_THREADS)

    if impl == "fastattn":
        result = benchmark(fastattn.scaled_dot_product_attention,
                           data.q, data.k, data.v, is_causal=case.causal)
    elif impl == "numpy":
        result = benchmark(_bench.numpy_sdpa, data.q, data.k, data.v, data.mask)
        # the baseline itself against the float64 oracle
        oracle = _reference.scaled_dot_product_attention(data.q, data.k, data.v,
                                                         is_causal=case.causal)
        assert_close(result, case, oracle.astype(case.dtype))
    else:
        tq, tk, tv = (torch.from_numpy(a) for a in (data.q, data.k, data.v))
        sdpa = torch.nn.functional.scaled_dot_product_attention
        with torch.inference_mode():
            result = benchmark(sdpa, tq, tk, tv, is_causal=case.causal).numpy()

    assert_close(result, case, data.expected)
