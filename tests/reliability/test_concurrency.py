"""Calls from many Python threads at once give the serial results.

Eight threads run a shuffled mix of every kind of call -- SDPA (fast entry and
general path, masks, weights, causal), attention with built-in similarities,
a NumPy plugin and the compiled self-test plugin, multi_head_attention,
linear, rnn_scan (row blocks and unit split) and shared PreparedAttention
objects -- thousands of calls in all, and compare every result with the one
the same call gave serially beforehand.  The comparison is exact: the plan of
a call depends only on its arguments (n_threads included), tasks write
disjoint outputs, so running alone or with the pool busy changes no
arithmetic.  Meanwhile another thread registers, overwrites and unregisters
extra similarities, and the workers also use those names (a name may be
there or not; either result is fine, nothing else is).
"""
from __future__ import annotations

import random
import threading

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import functional as F
from fastattn.registry import UnknownSimilarityError

from test_similarity import NegSqDist

N_THREADS = 8
ROUNDS = 20          # each thread runs every job this many times (in shuffled order): 3 000+ calls


class ConcNegSqDist(NegSqDist):
    """test_similarity's NumPy plugin (-gamma |q - k|^2) under this file's own name."""

    name = "conc_neg_sq_dist"


def _as_tuple(r):
    if isinstance(r, tuple):
        return tuple(x for x in r if x is not None)
    return (r,)


def make_jobs(seed=7):
    rng = np.random.default_rng(seed)

    def f32(*shape, s=1.0):
        return (rng.standard_normal(shape) * s).astype(np.float32)

    def f64(*shape, s=1.0):
        return rng.standard_normal(shape) * s

    q1, k1, v1 = f32(2, 3, 70, 16), f32(2, 3, 130, 16), f32(2, 3, 130, 24)
    q2 = f64(1, 4, 300, 32)
    q3, k3 = f32(3, 45, 32), f32(3, 1100, 32)
    bmask = rng.random((3, 45, 1100)) < 0.7
    amask = np.where(rng.random((45, 1100)) < 0.1, -np.inf, 0.0).astype(np.float32)
    Wg = f32(32, 32, s=0.2)
    add = dict(W_q=f32(12, 32, s=0.3), W_k=f32(12, 32, s=0.3), v=f32(12))
    cat = dict(W=f32(12, 64, s=0.3), v=f32(12))
    E, H = 64, 4
    xq, xkv = f32(2, 40, E), f32(2, 90, E)
    w_qkv, b_qkv = f32(3 * E, E, s=0.1), f32(3 * E)
    w_out = f32(E, E, s=0.1)
    xl, wl, bl = f64(700, 256), f64(384, 256), f64(384)
    xw, whh = f32(16, 30, 3 * 64), f32(3 * 64, 64, s=0.1)
    h0 = f32(16, 64)
    xw1, whh1 = f64(1, 40, 3 * 128), f64(3 * 128, 128, s=0.1)
    lens = rng.integers(0, 31, 16)
    compiled = fastattn.testing.selftest_similarity()
    prep_add = F.PreparedAttention(k3, k3, "additive", params=add, n_threads=2)
    prep_dot = F.PreparedAttention(k1, v1, "dot", n_threads=2)
    inputs = [q1, k1, v1, q2, q3, k3, bmask, amask, Wg, xq, xkv, w_qkv, b_qkv, w_out,
              xl, wl, bl, xw, whh, h0, xw1, whh1, lens] + list(add.values()) + list(cat.values())
    sdpa = F.scaled_dot_product_attention
    att = fastattn.attention
    jobs = {
        "sdpa_plain_f32": lambda: sdpa(q1, k1, v1, n_threads=2),
        "sdpa_plain_f64_causal": lambda: sdpa(q2, q2, q2, is_causal=True, n_threads=2),
        "sdpa_bool_weights": lambda: sdpa(q3, k3, k3, bmask, return_weights=True, n_threads=2),
        "sdpa_float_mask_br": lambda: sdpa(q3, k3, k3, amask, is_causal=True,
                                           causal_alignment="bottom_right", n_threads=2),
        "sdpa_one_thread": lambda: sdpa(q1, k1, v1, n_threads=1),
        "att_dot": lambda: att(q3, k3, k3, "dot", n_threads=2),
        "att_general": lambda: att(q3, k3, k3, "general", params={"W": Wg}, n_threads=2),
        "att_cosine": lambda: att(q3, k3, k3, "cosine", n_threads=2),
        "att_additive": lambda: att(q3, k3, k3, "additive", params=add, attn_mask=bmask,
                                    n_threads=2),
        "att_concat": lambda: att(q3, k3, k3, "concat", params=cat, n_threads=2),
        "att_numpy_plugin": lambda: att(q3, k3, k3, "conc_neg_sq_dist", params={"gamma": 0.05},
                                        n_threads=2),
        "att_compiled_plugin": lambda: att(q3, k3, k3, compiled, params={"gamma": 0.05},
                                           return_weights=True, n_threads=2),
        "mha": lambda: fastattn.multi_head_attention(xq, xkv, xkv, num_heads=H, w_qkv=w_qkv,
                                                     b_qkv=b_qkv, w_out=w_out, n_threads=2),
        "linear": lambda: F.linear(xl, wl, bl, n_threads=2),
        "rnn_rows": lambda: F.rnn_scan(xw, whh, None, h0, cell="gru", lengths=lens,
                                       n_threads=2),
        "rnn_split": lambda: F.rnn_scan(xw1, whh1, None, np.zeros((1, 128)), cell="gru",
                                        reverse=True, n_threads=2),
        "prepared_additive": lambda: prep_add(q3),
        "prepared_dot": lambda: prep_dot(q1),
    }
    return jobs, inputs, (q3, k3, k3)


@pytest.fixture
def numpy_plugin():
    fastattn.register_similarity(ConcNegSqDist())
    try:
        yield
    finally:
        fastattn.unregister_similarity("conc_neg_sq_dist")
        for i in range(4):
            if f"conc_extra_{i}" in fastattn.registry.similarities:
                fastattn.unregister_similarity(f"conc_extra_{i}")


def test_threads_match_serial_with_registry_churn(numpy_plugin):
    jobs, inputs, extra_args = make_jobs()
    before = [x.copy() for x in inputs]
    serial = {name: _as_tuple(fn()) for name, fn in jobs.items()}
    # the extra names score like the NumPy plugin
    extra_ref = _as_tuple(jobs["att_numpy_plugin"]())

    errors = []
    counts = [0] * N_THREADS
    extra_hits = [[0, 0] for _ in range(N_THREADS)]   # per thread: found, not registered
    churned = [0]
    stop = threading.Event()
    barrier = threading.Barrier(N_THREADS + 1)

    def worker(i):
        rnd = random.Random(i)
        names = list(jobs)
        try:
            barrier.wait()
            for _ in range(ROUNDS):
                rnd.shuffle(names)
                for name in names:
                    got = _as_tuple(jobs[name]())
                    ref = serial[name]
                    assert len(got) == len(ref), name
                    for a, b in zip(got, ref):
                        if not np.array_equal(a, b):
                            raise AssertionError(f"{name}: differs from the serial result "
                                                 f"(max |diff| {np.max(np.abs(a - b))})")
                    counts[i] += 1
                extra = f"conc_extra_{rnd.randrange(4)}"
                try:
                    got = fastattn.attention(*extra_args, similarity=extra,
                                             params={"gamma": 0.05}, n_threads=2)
                except UnknownSimilarityError:
                    extra_hits[i][1] += 1
                else:
                    np.testing.assert_array_equal(got, extra_ref[0])
                    extra_hits[i][0] += 1
                counts[i] += 1
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append((i, repr(exc)))

    def churn():
        n = 0
        barrier.wait()
        while not stop.is_set():
            name = f"conc_extra_{n % 4}"
            try:
                fastattn.register_similarity(ConcNegSqDist(), name=name, overwrite=True)
                assert fastattn.get_similarity(name).name == name
                assert name in fastattn.available_similarities()
                if n % 3 == 0:
                    fastattn.unregister_similarity(name)
            except BaseException as exc:  # noqa: BLE001
                errors.append(("churn", repr(exc)))
                return
            n += 1
            churned[0] = n

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(N_THREADS)]
    churner = threading.Thread(target=churn)
    for t in threads + [churner]:
        t.start()
    for t in threads:
        t.join(timeout=300)
    stop.set()
    churner.join(timeout=60)
    assert not any(t.is_alive() for t in threads + [churner]), "a thread hung"
    assert not errors, errors[:5]
    assert sum(counts) == N_THREADS * ROUNDS * (len(jobs) + 1)
    assert sum(counts) >= 1500
    assert sum(map(sum, extra_hits)) == N_THREADS * ROUNDS
    assert churned[0] > 0
    for a, b in zip(inputs, before):
        np.testing.assert_array_equal(a, b)   # nothing wrote into an input


def test_one_prepared_attention_first_calls_race():
    """Threads making the first calls of a shared PreparedAttention at once
    (several signatures) all get the serial results."""
    rng = np.random.default_rng(3)
    k = rng.standard_normal((2, 200, 16)).astype(np.float32)
    add = dict(W_q=rng.standard_normal((8, 16)).astype(np.float32),
               W_k=rng.standard_normal((8, 16)).astype(np.float32),
               v=rng.standard_normal(8).astype(np.float32))
    qs = [rng.standard_normal((2, n, 16)).astype(np.float32) for n in (1, 3, 17, 60)]
    serial = [F.PreparedAttention(k, k, "additive", params=add, n_threads=2)(q) for q in qs]
    errors = []
    for _ in range(5):
        prep = F.PreparedAttention(k, k, "additive", params=add, n_threads=2)
        barrier = threading.Barrier(N_THREADS)

        def run(i):
            try:
                barrier.wait()
                for j in range(40):
                    n = (i + j) % len(qs)
                    np.testing.assert_array_equal(prep(qs[n]), serial[n])
            except BaseException as exc:  # noqa: BLE001
                errors.append(repr(exc))

        ts = [threading.Thread(target=run, args=(i,)) for i in range(N_THREADS)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=120)
        assert not any(t.is_alive() for t in ts)
    assert not errors, errors[:3]
