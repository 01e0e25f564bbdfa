"""Regression tests for library bugs that the hypothesis properties
(tests/properties/) found, each reduced to a plain example."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R
from fastattn.similarity import Similarity

from support import F32, F64, NegL1
from support import assert_close


class _TransposedScores(Similarity):
    """q . k returned as a view with column-major score rows (any layout is legal)."""

    name = "props_transposed_scores"
    params_spec = {}

    def score(self, query, key, params):
        s = np.matmul(key, np.swapaxes(query, -1, -2))  # (..., tk, tq)
        return np.swapaxes(s, -1, -2)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_numpy_plugin_scores_of_any_layout(dtype):
    """The tiled path's streaming P.V read the plugin's score tile as C rows:
    a tile in another layout (a transposed view, or NumPy's result for
    Fortran-ordered keys) gave wrong outputs without weights."""
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, 5, 3)).astype(dtype)
    k = rng.standard_normal((2, 4, 3)).astype(dtype)
    v = rng.standard_normal((2, 4, 2)).astype(dtype)
    ref = R.attention(q, k, v, R.score_dot)
    assert_close(fastattn.attention(q, k, v, _TransposedScores()), ref, dtype)
    kf = np.asfortranarray(rng.standard_normal((1, 2, 2, 1))).astype(dtype)
    qb, vb = q[:1, None, :2, :1], v[:1, None, :2, :1].repeat(2, 1)
    assert_close(fastattn.attention(qb, kf, vb, NegL1(), params={"gamma": 0.4}),
                 R.attention(qb, kf, vb, lambda a, b: R.score_neg_l1(a, b, 0.4)), dtype)
