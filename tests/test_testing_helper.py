"""fastattn.testing: the benchmark helper (with a stand-in for pytest-benchmark's
fixture, so nothing is timed here) and the oracle check."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import testing
from fastattn.similarity import Similarity


class FakeBenchmark:
    def __init__(self):
        self.extra_info = {}
        self.calls = []

    def __call__(self, fn):
        self.calls.append("call")
        return fn()

    def pedantic(self, fn, rounds, iterations, warmup_rounds):
        self.calls.append(("pedantic", rounds))
        return fn()


@pytest.mark.parametrize("sim", ["additive", "scaled_dot", "concat", "cosine", "general"])
def test_benchmark_similarity_runs_checks_and_records(sim):
    b = FakeBenchmark()
    r = testing.benchmark_similarity(b, sim, batch=2, Lq=40, Lk=50, d=8, dv=4, dtype="float64")
    assert r.shape == (2, 40, 4)
    assert b.calls == ["call"]
    assert b.extra_info["similarity"] == sim
    assert b.extra_info["sim_shape"] == [2, 40, 50, 8]
    assert b.extra_info["path"] in ("sdpa", "fused", "tiled")
    q, k, v, P = testing.make_inputs(sim, batch=2, Lq=40, Lk=50, d=8, dv=4, dtype="float64")
    np.testing.assert_array_equal(r, fastattn.attention(q, k, v, sim, params=P))


def test_benchmark_similarity_pedantic_rounds():
    b = FakeBenchmark()
    testing.benchmark_similarity(b, "additive", Lq=8, d=4, rounds=4, check=False)
    assert b.calls == [("pedantic", 4)]


def test_check_against_oracle_catches_a_wrong_result():
    class Liar(Similarity):
        """Its NumPy score is not what attention computes (a broken _lower)."""
        name = "liar"
        same_dims = True

        def score(self, query, key, params):
            return query @ np.swapaxes(key, -1, -2)

        def _lower(self, query, key, params):
            return ("sdpa", query, key, 0.5)

    q, k, v, _ = testing.make_inputs("dot", Lq=8, d=4, dtype="float64")
    assert testing.check_against_oracle("dot", q, k, v, None) < 1e-12
    with pytest.raises(AssertionError, match=r"similarity 'liar': relative error .* > 1e-10"):
        testing.check_against_oracle(Liar(), q, k, v, None)
