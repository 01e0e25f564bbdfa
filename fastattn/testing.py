"""Helpers for testing and benchmarking similarities.

Benchmark your similarity against the built-ins with pytest-benchmark in a
few lines (see :func:`benchmark_similarity` and the ``docs/similarities.md``
section "Profiling your similarity")::

    # test_bench_mine.py -- run: pytest test_bench_mine.py --benchmark-only
    import pytest
    from fastattn.testing import benchmark_similarity

    @pytest.mark.parametrize("sim", ["mine", "additive", "scaled_dot"])
    def test_speed(benchmark, sim):
        benchmark_similarity(benchmark, sim, batch=4, Lq=256, Lk=256, d=64)

Also here: :func:`selftest_similarity`, a compiled plugin built into
fastattn that exercises the plugin ABI (``csrc/fastattn_plugin.h``).
"""
from __future__ import annotations

import numpy as np

from .similarity import CompiledSimilarity, ParamSpec

__all__ = ["benchmark_similarity", "make_inputs", "selftest_similarity"]


class _SelftestNegSqDist(CompiledSimilarity):
    """-gamma |q - k|^2 from C (fa_selftest_plugin); ``mode`` 1/2/3 makes the C
    function fail with code 7 / write a NaN / write +inf (for error tests)."""

    name = "fastattn_selftest_neg_sq_dist"
    params_spec = {
        "gamma": ParamSpec((), required=False, default=1.0),
        "mode": ParamSpec((), required=False, default=0.0),
    }

    def __init__(self):
        from . import _scores

        self.capsule = _scores.selftest_capsule()

    def score(self, query, key, params):
        diff = query[..., :, None, :] - key[..., None, :, :]
        return -params["gamma"] * np.sum(diff * diff, axis=-1)


def selftest_similarity():
    """A :class:`~fastattn.CompiledSimilarity` backed by fastattn's own C
    self-test plugin (not registered)."""
    return _SelftestNegSqDist()
