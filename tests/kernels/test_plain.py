"""The plain-call entry (_kernels.sdpa_plain) and the plans it remembers.

Its cache of plans is keyed by dtype, shape, threads, causality, alignment
and SIMD state; these tests interleave more signatures than it has slots and
check every result against the oracle, so a stale or mixed-up plan shows up
as a wrong answer or a wrong path."""
import itertools

import numpy as np
import pytest

import fastattn
from fastattn import _kernels, _sdpa

from support import assert_close, oracle, randn


def test_many_signatures_interleaved(rng):
    shapes = [(2, 5, 8), (3, 17, 9), (1, 2, 40, 16), (4, 1, 3), (2, 2, 33, 7), (600, 4),
              (1, 1, 16, 64), (2, 9, 1), (1, 64, 32), (3, 3, 3)]
    cases = []
    for shape, dtype, causal, align in itertools.product(
            shapes, (np.float32, np.float64), (False, True), ("top_left", "bottom_right")):
        q = randn(rng, shape, dtype)
        k = randn(rng, shape[:-2] + (shape[-2] + 3, shape[-1]), dtype)
        v = randn(rng, shape[:-2] + (shape[-2] + 3, 5), dtype)
        cases.append((q, k, v, causal, align))
    for _ in range(2):  # second round: plans evicted and recomputed
        for q, k, v, causal, align in cases:
            got = fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                        causal_alignment=align)
            assert got.dtype == q.dtype and got.flags.c_contiguous
            assert_close(got, oracle(q, k, v, is_causal=causal, causal_alignment=align),
                         q.dtype)


def test_threads_and_scale_are_honoured(rng):
    q = randn(rng, (4, 2, 70, 16), np.float32)
    ref = oracle(q, q, q)
    for nt in (1, 2, 1, 2):
        assert_close(fastattn.scaled_dot_product_attention(q, q, q, n_threads=nt), ref,
                     np.float32)
    for s in (0.5, 2.0, 0.5):
        assert_close(fastattn.scaled_dot_product_attention(q, q, q, scale=s),
                     oracle(q, q, q, scale=s), np.float32)


def test_not_plain_returns_none(rng):
    q = randn(rng, (2, 4, 8), np.float32)
    plan = _sdpa._plain_plan

    def call(*a):
        return _kernels.sdpa_plain(*a, False, False, None, 1, plan)

    assert call(q, q, q) is not None
    assert call(q.astype(np.float64), q, q) is None      # mixed dtypes
    assert call(q[:, ::2], q[:, ::2], q[:, ::2]) is None  # not contiguous
    assert call(q, q[:1], q[:1]) is None                 # batch dims differ
    assert call(q, q[..., :4], q) is None                # d differs
    assert call(q.tolist(), q, q) is None                # not an ndarray
    ro = q.copy()
    ro.flags.writeable = False
    assert call(ro, q, q) is None                        # read-only: general path
    assert _kernels.sdpa_plain(q, q, q, False, False, np.float32(1), 1, plan) is None


def test_planning_constants_take_effect_after_clear(monkeypatch, rng):
    q = randn(rng, (1, 40, 8), np.float32)
    fastattn.scaled_dot_product_attention(q, q, q, n_threads=1)
    seen = []

    def spy(*a):
        seen.append(a)
        return _sdpa._plain_plan(*a)

    _kernels.sdpa_plain(q, q, q, False, False, None, 1, spy)
    assert seen == []            # remembered: the planner is not asked again
    _kernels.clear_fast_plans()
    got = _kernels.sdpa_plain(q, q, q, False, False, None, 1, spy)
    assert len(seen) == 1
    assert_close(got, oracle(q, q, q), np.float32)
