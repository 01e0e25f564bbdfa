"""Thread-count API and thread safety."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import numpy as np
import pytest

import fastattn
from support import assert_close, oracle, randn, run_child

sdpa = fastattn.scaled_dot_product_attention


@pytest.fixture
def restore_threads():
    before = fastattn._threads._global_threads
    yield
    fastattn.set_num_threads(before)


# (q, k, v shapes) large enough that explain() reports a 2-thread plan
PARALLEL_CASES = {
    "single_pass": ((4, 64, 32), (4, 200, 32), (4, 200, 32)),
    "streaming": ((2, 2, 70, 16), (2, 2, 600, 16), (2, 2, 600, 16)),
    "bcast": ((2, 1, 64, 32), (1, 3, 300, 32), (1, 3, 300, 32)),
}


@pytest.mark.parametrize("masked", ["none", "causal", "bool", "weights"])
@pytest.mark.parametrize("case", list(PARALLEL_CASES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_one_vs_two_threads(simd_mode, dtype, case, masked, rng):
    qs, ks, vs = PARALLEL_CASES[case]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    kw = {}
    if masked == "causal":
        kw = dict(is_causal=True, causal_alignment="bottom_right")
    elif masked == "bool":
        kw = dict(attn_mask=rng.random((qs[-2], ks[-2])) < 0.5)
    elif masked == "weights":
        kw = dict(return_weights=True)
    assert fastattn.explain(q, k, v, n_threads=2, **kw).n_threads == 2
    assert fastattn.explain(q, k, v, n_threads=1, **kw).n_threads == 1
    r1 = sdpa(q, k, v, n_threads=1, **kw)
    r2 = sdpa(q, k, v, n_threads=2, **kw)
    r1, r2 = (r if isinstance(r, tuple) else (r,) for r in (r1, r2))
    ref = oracle(q, k, v, **kw)
    ref = ref if isinstance(ref, tuple) else (ref,)
    atol = 1e-13 if dtype == np.float64 else 1e-6
    for a, b, c in zip(r1, r2, ref):
        np.testing.assert_allclose(a, b, rtol=0, atol=atol)
        assert_close(b, c, dtype)


def test_set_get_round_trip(restore_threads):
    fastattn.set_num_threads(None)
    default = fastattn.get_num_threads()
    assert isinstance(default, int) and default >= 1
    for n in (1, 2, 3, 7, np.int32(5)):
        fastattn.set_num_threads(n)
        assert fastattn.get_num_threads() == int(n)
        assert type(fastattn.get_num_threads()) is int
    fastattn.set_num_threads(None)
    assert fastattn.get_num_threads() == default


def test_default_thread_count_bounded_by_affinity(restore_threads):
    import os
    fastattn.set_num_threads(None)
    assert 1 <= fastattn.get_num_threads() <= len(os.sched_getaffinity(0))


def test_set_num_threads_used_by_calls(restore_threads, rng):
    q, k, v = randn(rng, (4, 256, 64)), randn(rng, (4, 300, 64)), randn(rng, (4, 300, 32))
    fastattn.set_num_threads(1)
    assert fastattn.explain(q, k, v).n_threads == 1
    fastattn.set_num_threads(2)
    assert fastattn.explain(q, k, v).n_threads == 2
    assert fastattn.explain(q, k, v, n_threads=1).n_threads == 1  # per call wins


def test_plan_caps_threads_to_tasks(rng):
    # 32 queries are one task (the smallest query block): one thread, whatever was asked
    q, k, v = randn(rng, (1, 32, 64)), randn(rng, (1, 4000, 64)), randn(rng, (1, 4000, 64))
    p = fastattn.explain(q, k, v, n_threads=8)
    assert p.n_tasks == 1 and p.n_threads == 1
    wide = fastattn.explain(randn(rng, (1, 200, 64)), k, v, n_threads=8)
    assert wide.n_threads <= wide.n_tasks
    small = fastattn.explain(randn(rng, (4, 4)), randn(rng, (4, 4)), randn(rng, (4, 4)), n_threads=8)
    assert small.n_threads == 1
    assert_close(sdpa(q, k, v, n_threads=8), oracle(q, k, v), np.float64)


def test_threads_context_restores(restore_threads):
    fastattn.set_num_threads(3)
    with fastattn.threads(1):
        assert fastattn.get_num_threads() == 1
        with fastattn.threads(2):
            assert fastattn.get_num_threads() == 2
            fastattn.set_num_threads(5)  # the context still wins
            assert fastattn.get_num_threads() == 2
        assert fastattn.get_num_threads() == 1
    assert fastattn.get_num_threads() == 5


def test_threads_context_restores_on_exception(restore_threads):
    fastattn.set_num_threads(3)
    with pytest.raises(RuntimeError, match="boom"):
        with fastattn.threads(1):
            raise RuntimeError("boom")
    assert fastattn.get_num_threads() == 3


def test_threads_context_used_by_calls(restore_threads, rng):
    q, k, v = randn(rng, (4, 256, 64)), randn(rng, (4, 300, 64)), randn(rng, (4, 300, 32))
    fastattn.set_num_threads(2)
    with fastattn.threads(1):
        assert fastattn.explain(q, k, v).n_threads == 1
        assert fastattn.explain(q, k, v, n_threads=2).n_threads == 2
        r = sdpa(q, k, v)
    assert fastattn.explain(q, k, v).n_threads == 2
    assert_close(r, oracle(q, k, v), np.float64)


def test_threads_context_is_thread_local(restore_threads):
    fastattn.set_num_threads(3)
    entered, release = threading.Event(), threading.Event()
    seen = {}

    def worker():
        with fastattn.threads(1):
            seen["inside_worker"] = fastattn.get_num_threads()
            entered.set()
            release.wait(10)

    t = threading.Thread(target=worker)
    t.start()
    assert entered.wait(10)
    seen["main_while_worker_inside"] = fastattn.get_num_threads()
    with fastattn.threads(2):
        seen["main_inside"] = fastattn.get_num_threads()
    release.set()
    t.join(10)

    def other():
        seen["fresh_thread"] = fastattn.get_num_threads()

    with fastattn.threads(7):
        t2 = threading.Thread(target=other)
        t2.start()
        t2.join(10)
    assert seen == {"inside_worker": 1, "main_while_worker_inside": 3, "main_inside": 2,
                    "fresh_thread": 3}


def test_threads_context_is_task_local(restore_threads):
    fastattn.set_num_threads(3)

    async def task(n, out):
        with fastattn.threads(n):
            await asyncio.sleep(0.01)
            out.append((n, fastattn.get_num_threads()))

    async def main():
        out = []
        await asyncio.gather(task(1, out), task(2, out), task(4, out))
        return out

    res = asyncio.run(main())
    assert sorted(res) == [(1, 1), (2, 2), (4, 4)]
    assert fastattn.get_num_threads() == 3


def _concurrent_jobs(rng):
    jobs = []
    specs = [
        (np.float32, (2, 3, 70, 16), (2, 3, 600, 16), (2, 3, 600, 16), dict(is_causal=True)),
        (np.float64, (4, 70, 32), (4, 200, 32), (4, 200, 32), {}),
        (np.float32, (1, 130, 16), (1, 700, 16), (1, 700, 8), dict(return_weights=True)),
        (np.float64, (2, 1, 64, 16), (1, 3, 700, 16), (1, 3, 700, 16), dict(is_causal=True, causal_alignment="bottom_right")),
        (np.float16, (2, 50, 16), (2, 60, 16), (2, 60, 16), {}),
        (np.float64, (3, 70, 8), (3, 600, 8), (3, 600, 8), "mask"),
    ]
    for dt, qs, ks, vs, kw in specs:
        q, k, v = randn(rng, qs, dt), randn(rng, ks, dt), randn(rng, vs, dt)
        if kw == "mask":
            kw = dict(attn_mask=rng.random((qs[-2], ks[-2])) < 0.3)
        jobs.append((q, k, v, kw))
    return jobs


@pytest.mark.parametrize("n_threads", [1, 2, None])
def test_concurrent_python_threads(simd_mode, n_threads, rng):
    jobs = _concurrent_jobs(rng)
    serial = [sdpa(q, k, v, n_threads=1, **kw) for q, k, v, kw in jobs]
    barrier = threading.Barrier(4)

    def run(i):
        barrier.wait(10)
        results = []
        for rep in range(2):
            for j in range(len(jobs)):
                q, k, v, kw = jobs[(i + j) % len(jobs)]
                results.append(((i + j) % len(jobs), sdpa(q, k, v, n_threads=n_threads, **kw)))
        return results

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        all_results = list(ex.map(run, range(4)))
    for results in all_results:
        for j, r in results:
            ser = serial[j]
            if isinstance(ser, tuple):
                for a, b in zip(r, ser):
                    np.testing.assert_allclose(a, b, rtol=0, atol=1e-6 if a.dtype != np.float64 else 1e-13)
            else:
                assert r.dtype == ser.dtype
                np.testing.assert_allclose(r, ser, rtol=0, atol=1e-6 if r.dtype != np.float64 else 1e-13)
    # and the serial results are right
    for (q, k, v, kw), ser in zip(jobs, serial):
        ref = oracle(q, k, v, **kw)
        for a, b in zip(ser if isinstance(ser, tuple) else (ser,), ref if isinstance(ref, tuple) else (ref,)):
            assert_close(a, b, a.dtype)


def test_concurrent_threads_with_own_contexts(restore_threads, rng):
    """Each Python thread uses its own threads(n) setting while others run."""
    q, k, v = randn(rng, (4, 256, 64)), randn(rng, (4, 600, 64)), randn(rng, (4, 600, 32))
    ref = sdpa(q, k, v, n_threads=1)
    barrier = threading.Barrier(4)

    def run(n):
        with fastattn.threads(n):
            barrier.wait(10)
            plans = [fastattn.explain(q, k, v).n_threads for _ in range(3)]
            outs = [sdpa(q, k, v) for _ in range(3)]
            return n, plans, outs

    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        res = list(ex.map(run, [1, 2, 1, 2]))
    for n, plans, outs in res:
        assert plans == [n] * 3
        for o in outs:
            np.testing.assert_allclose(o, ref, rtol=0, atol=1e-13)


def _blas_get_threads():
    import ctypes
    lib = fastattn._threads.blas_hook_library()
    if lib is None:
        return None
    dll = ctypes.CDLL(lib)
    for sym in ("openblas_get_num_threads", "scipy_openblas_get_num_threads"):
        fn = getattr(dll, sym, None)
        if fn is not None:
            return fn
    return None


def test_blas_threads_restored_after_parallel_call(rng):
    """While a team runs BLAS is held at one thread; afterwards its setting is back."""
    q, k, v = randn(rng, (4, 64, 32)), randn(rng, (4, 200, 32)), randn(rng, (4, 200, 32))
    get = _blas_get_threads()
    assert get is not None, "fastattn found no OpenBLAS to hold at one thread"
    before = get()
    for n in (2, 1, 2):
        r = sdpa(q, k, v, n_threads=n)
        assert get() == before
    assert_close(r, oracle(q, k, v), np.float64)
    # concurrent parallel calls: the last one out restores the setting
    with concurrent.futures.ThreadPoolExecutor(3) as ex:
        list(ex.map(lambda _: sdpa(q, k, v, n_threads=2), range(6)))
    assert get() == before


@pytest.mark.parametrize("env, expected", [("3", 3), ("1,2", 1), ("junk", None), ("0", None)])
def test_omp_num_threads_sets_the_default(env, expected):
    """OMP_NUM_THREADS (read at import) is the default; invalid values are ignored."""
    from support import run_child

    code = (
        "import os, fastattn; n = fastattn.get_num_threads(); "
        "print(n, len(os.sched_getaffinity(0)))"
    )
    res = run_child(code, env_update={"OMP_NUM_THREADS": env})
    assert res.returncode == 0, res.stderr
    got, ncpu = map(int, res.stdout.split())
    assert got == (expected if expected is not None else ncpu)


def test_call_in_forked_child_after_parallel_call(rng):
    """The pool does not survive fork(); the child must start a fresh one, not hang."""
    import os

    q, k, v = randn(rng, (4, 64, 32)), randn(rng, (4, 200, 32)), randn(rng, (4, 200, 32))
    ref = oracle(q, k, v)
    sdpa(q, k, v, n_threads=2)  # parent's workers exist now
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        ok = 0
        try:
            r = sdpa(q, k, v, n_threads=2)
            ok = int(np.allclose(r, ref, rtol=1e-4, atol=1e-5))
        finally:
            os._exit(0 if ok else 3)
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            assert os.waitstatus_to_exitcode(status) == 0
            return
        time.sleep(0.01)
    os.kill(pid, 9)
    pytest.fail("the call in the forked child hung")


def test_pool_workers_sleep_after_a_call(rng):
    """After a parallel call returns, no worker of ours keeps spinning a core."""
    import time

    q, k, v = randn(rng, (4, 64, 32)), randn(rng, (4, 200, 32)), randn(rng, (4, 200, 32))
    sdpa(q, k, v, n_threads=2)
    assert fastattn._kernels.pool_workers() >= 1
    time.sleep(0.2)  # ours spin for at most 50 us, 500 us inside a layer call (OpenBLAS pools elsewhere: ~0.1 s)
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(0.3)
    used = time.process_time() - c0
    # an idle process: well under one busy core over the interval
    assert used < 0.5 * (time.perf_counter() - t0)


def test_layer_calls_hold_the_pool_only_while_they_run(rng):
    """A layer call (and the backprop it returns) opens a hold on the pool's
    workers (they spin longer between its kernels) and closes it on return,
    also when it raises; afterwards the workers sleep as after any call."""
    import time

    from fastattn import _kernels, layers

    assert _kernels.pool_hold(0) == 0
    seen = []
    real = fastattn._alloc._hold

    def spy(delta):
        seen.append(delta)
        return real(delta)

    m = layers.MultiHeadAttention(32, 4, seed=0)
    x = randn(rng, (4, 64, 32), np.float32)
    fastattn._alloc._hold = spy
    try:
        out, back = m.forward_backward(x)
        back(np.ones_like(out))
        with pytest.raises(ValueError):
            m(randn(rng, (4, 64, 31), np.float32))
    finally:
        fastattn._alloc._hold = real
    assert seen and sum(seen) == 0 and seen.count(1) == seen.count(-1)
    assert _kernels.pool_hold(0) == 0
    time.sleep(0.2)
    c0, t0 = time.process_time(), time.perf_counter()
    time.sleep(0.3)
    assert time.process_time() - c0 < 0.5 * (time.perf_counter() - t0)


def test_first_parallel_call_gets_its_worker():
    """The worker that a process's first parallel call creates must join that call
    (it used to start waiting for the *next* job: the first call ran on one thread)."""
    code = (
        "import numpy as np, fastattn\n"
        "from fastattn import _kernels\n"
        "q = np.random.default_rng(0).standard_normal((1, 16, 512, 64)).astype(np.float32)\n"
        "assert _kernels.pool_workers() == 0\n"
        "fastattn.scaled_dot_product_attention(q, q, q, n_threads=2)\n"
        "print(_kernels.pool_workers(), _kernels.pool_last_helped())\n"
    )
    r = run_child(code)
    assert r.returncode == 0, r.stderr
    workers, helped = map(int, r.stdout.split())
    assert workers == 1
    assert helped >= 1  # 32 tasks of ~0.5 ms each: the worker ran some of them


def test_blas_threads_restored_with_sdpa_and_additive_overlapping(rng):
    """SDPA (BLAS tiles) and the additive / general similarities hold BLAS through one
    shared count and one pool: overlapping calls from two threads leave the setting
    as it was (with a count per extension one call could restore another's 1)."""
    from fastattn import _attention, _kernels, _scores

    assert _attention._install_runtime() and _scores.runtime_shared()
    get = _blas_get_threads()
    assert get is not None
    before = get()
    q = randn(rng, (4, 512, 64), np.float32)
    params = fastattn.get_similarity("additive").init_params(64, 64, d_a=64, rng=0,
                                                             dtype=np.float32)
    eye = {"W": np.eye(64, dtype=np.float32)}
    was = _kernels.simd_active()
    _kernels.set_simd_disabled(True)  # SDPA through BLAS tiles, holding BLAS
    try:
        def sdpa_loop():
            for _ in range(40):
                sdpa(q, q, q, n_threads=2)

        def other_loop():
            for _ in range(20):
                fastattn.attention(q[:1, :256], q[:1, :256], q[:1, :256], "additive",
                                   params=params, n_threads=2)
                fastattn.attention(q, q, q, "general", params=eye, n_threads=2)

        ts = [threading.Thread(target=sdpa_loop), threading.Thread(target=other_loop)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        _kernels.set_simd_disabled(not was)
    assert get() == before
