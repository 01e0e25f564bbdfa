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


@pytest.mark.parametrize("sim", ["additive", "dot", "cosine"])
@pytest.mark.parametrize("mask_shape", [(40, 50), (2, 40, 50), (2, 1, 50), (1, 40, 50)])
def test_benchmark_similarity_with_full_size_mask(sim, mask_shape):
    """A mask of the benchmark's full size is cut along its query (and batch)
    axes like the queries before the oracle check."""
    b = FakeBenchmark()
    mask = np.random.default_rng(3).random(mask_shape) < 0.7
    r = testing.benchmark_similarity(b, sim, batch=2, Lq=40, Lk=50, d=8, dv=4,
                                     dtype="float64", attn_mask=mask)
    q, k, v, P = testing.make_inputs(sim, batch=2, Lq=40, Lk=50, d=8, dv=4, dtype="float64")
    np.testing.assert_array_equal(r, fastattn.attention(q, k, v, sim, params=P, attn_mask=mask))
    # the check is a real one: the mask changes the result
    assert not np.allclose(r, fastattn.attention(q, k, v, sim, params=P))


def test_check_against_oracle_with_weights():
    q, k, v, P = testing.make_inputs("additive", batch=2, Lq=40, Lk=50, d=8, dtype="float64")
    mask = np.random.default_rng(4).random((40, 50)) < 0.5
    err = testing.check_against_oracle("additive", q, k, v, P, attn_mask=mask,
                                       return_weights=True)
    assert err < 1e-12
    b = FakeBenchmark()
    r = testing.benchmark_similarity(b, "additive", batch=2, Lq=40, Lk=50, d=8, dtype="float64",
                                     return_weights=True)
    assert isinstance(r, tuple) and r[0].shape == (2, 40, 8) and r[1].shape == (2, 40, 50)


def test_check_against_oracle_checks_the_weights():
    class WrongWeights(Similarity):
        """The NumPy score is scale 1, what attention runs is scale 0.5 --
        the output can hide it (v constant per row), the weights cannot."""
        name = "wrong_weights"
        same_dims = True

        def score(self, query, key, params):
            return query @ np.swapaxes(key, -1, -2)

        def _lower(self, query, key, params):
            return ("sdpa", query, key, 0.5)

    q, k, _, _ = testing.make_inputs("dot", Lq=8, d=4, dtype="float64")
    v = np.ones((1, 8, 3))  # every output row is 1 whatever the weights
    assert testing.check_against_oracle(WrongWeights(), q, k, v, None) < 1e-12
    with pytest.raises(AssertionError, match=r"'wrong_weights': relative error of the weights .* > 1e-10"):
        testing.check_against_oracle(WrongWeights(), q, k, v, None, return_weights=True)


def test_testing_does_not_import_the_kernels():
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(testing))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            names.update(a.name for a in node.names)
            names.add(node.module or "")
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    assert not {n for n in names if "_scores" in n or "_kernels" in n}, names


def test_check_against_oracle_unbatched_inputs():
    """(Lq, d) inputs: only the query rows are cut (q[:1, :rows] used to take
    one query and the first `rows` features)."""
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((40, 8)), rng.standard_normal((50, 8)), rng.standard_normal((50, 3))
    mask = rng.random((40, 50)) < 0.6
    assert testing.check_against_oracle("dot", q, k, v, None, attn_mask=mask,
                                        return_weights=True) < 1e-12
