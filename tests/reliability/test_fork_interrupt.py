"""KeyboardInterrupt during long calls, signal handlers that call fastattn,
and calls in a child process after os.fork().

Interrupts: a thread sends SIGINT (or ``_thread.interrupt_main``) while the
main thread is inside a long kernel call (seconds if it ran to completion);
the call must raise KeyboardInterrupt soon after, and leave nothing behind
(the pool works, SciPy's BLAS thread count is back, later results match the
oracle, inputs are untouched).  The latency requirement is 100 ms; on a
loaded 2-core machine one attempt may be descheduled, so the SDPA test takes
the best of up to three attempts, and every test also bounds each attempt
generously (a call that ignored the interrupt would take seconds).

Fork: the child runs calls of every kind with a timeout, so a hang fails the
test instead of hanging the run.
"""
from __future__ import annotations

import _thread
import os
import select
import signal
import threading
import time

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import _bench, _kernels, _rnn, _sdpa, _threads, functional as F
from fastattn._reference import scaled_dot_product_attention as oracle_sdpa

from support import assert_close

LONG_SHAPE = (1, 8, 16384, 64)   # about 10 s of SDPA on two cores


@pytest.fixture
def default_sigint():
    """Python's own SIGINT handler (raises KeyboardInterrupt) during the test."""
    prev = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, prev)


def run_interrupted(fn, delay=0.25, real_signal=False, wait=60.0):
    """Run fn() on the main thread, interrupting it after delay seconds.

    Returns (completed, latency): completed is True when fn returned before the
    interrupt came (it then arrives in a sleep here, never outside); latency is
    the time from the interrupt to the KeyboardInterrupt being caught.
    """
    assert threading.current_thread() is threading.main_thread()
    stamp = {}

    def fire():
        time.sleep(delay)
        stamp["t"] = time.perf_counter()
        if real_signal:
            os.kill(os.getpid(), signal.SIGINT)
        else:
            _thread.interrupt_main()

    th = threading.Thread(target=fire, daemon=True)
    completed = False
    th.start()
    try:
        fn()
        completed = True
        time.sleep(wait)
    except KeyboardInterrupt:
        caught = time.perf_counter()
    th.join()
    return completed, caught - stamp["t"]


def scipy_blas():
    lib = _bench.openblas_libraries().get("scipy")
    if lib is None or _threads.blas_hook_library() is None:
        pytest.skip("SciPy's OpenBLAS thread control is not reachable here")
    return lib


def check_pool_after(rng):
    """A parallel SDPA and a parallel score-tile call right after: oracle results."""
    q = rng.standard_normal((2, 4, 300, 32)).astype(np.float32)
    k = rng.standard_normal((2, 4, 700, 32)).astype(np.float32)
    v = rng.standard_normal((2, 4, 700, 16)).astype(np.float32)
    assert_close(F.scaled_dot_product_attention(q, k, v, n_threads=2), oracle_sdpa(q, k, v))
    sim = fastattn.testing.selftest_similarity()
    got = fastattn.attention(q, k, v, similarity=sim, params={"gamma": 0.05}, n_threads=2)
    ref = fastattn.attention(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                             similarity=sim, params={"gamma": 0.05}, n_threads=1)
    assert_close(got, ref, np.float32)
    assert _kernels.pool_workers() >= 1


def test_sdpa_interrupt_within_100ms(rng, default_sigint):
    q = rng.standard_normal(LONG_SHAPE).astype(np.float32)
    keep = q.copy()
    latencies = []
    for _ in range(3):
        completed, lat = run_interrupted(
            lambda: F.scaled_dot_product_attention(q, q, q, n_threads=2), real_signal=True)
        assert not completed, "the call ran to completion: the interrupt was ignored"
        assert lat < 2.0, f"KeyboardInterrupt {lat:.3f} s after SIGINT"
        latencies.append(lat)
        if lat < 0.1:
            break
    assert min(latencies) < 0.1, f"latencies {latencies}"
    np.testing.assert_array_equal(q, keep)
    check_pool_after(rng)


def test_sdpa_interrupt_general_path_blas_and_out(rng, default_sigint, monkeypatch):
    """BLAS tiles (held at one thread) and out=: the BLAS setting comes back,
    out is usable afterwards (its contents after the interrupt are unspecified)."""
    lib = scipy_blas()
    monkeypatch.setattr(_sdpa, "STREAM_OWN_PRODUCTS", False)
    _sdpa._clear_plans()
    q = rng.standard_normal(LONG_SHAPE).astype(np.float32)
    mask = np.ones(LONG_SHAPE[2], dtype=bool)   # a key mask: the general path
    out = np.empty(LONG_SHAPE, np.float32)
    assert F.explain(q, q, q, attn_mask=mask, n_threads=2).blas
    before = lib.get_threads()
    try:
        lib.set_threads(2)
        completed, lat = run_interrupted(
            lambda: F.scaled_dot_product_attention(q, q, q, attn_mask=mask, out=out, n_threads=2))
        assert not completed
        assert lat < 1.0, f"KeyboardInterrupt {lat:.3f} s after the interrupt"
        assert lib.get_threads() == 2
        small = q[:, :2, :200]
        r = F.scaled_dot_product_attention(small, small, small, attn_mask=mask[:200],
                                           out=out[:, :2, :200], n_threads=2)
        assert np.shares_memory(r, out)
        assert_close(out[:, :2, :200], oracle_sdpa(small, small, small))
    finally:
        lib.set_threads(before)
        _sdpa._clear_plans()


@pytest.mark.parametrize("kind", ["additive", "compiled"])
def test_score_tile_kernel_interrupt(rng, default_sigint, kind):
    shape = (1, 2, 16384, 64)
    q = rng.standard_normal(shape).astype(np.float32)
    if kind == "additive":
        sim, params = "additive", dict(W_q=np.eye(64, dtype=np.float32) * 0.1,
                                       W_k=np.eye(64, dtype=np.float32) * 0.1,
                                       v=np.ones(64, np.float32))
    else:
        sim, params = fastattn.testing.selftest_similarity(), {"gamma": 0.05}
    completed, lat = run_interrupted(
        lambda: fastattn.attention(q, q, q, similarity=sim, params=params, n_threads=2))
    assert not completed
    assert lat < 1.0, f"KeyboardInterrupt {lat:.3f} s after the interrupt"
    check_pool_after(rng)


def test_linear_interrupt(rng, default_sigint):
    x = rng.standard_normal((8192, 4096))
    w = rng.standard_normal((2048, 4096))
    completed, lat = run_interrupted(lambda: F.linear(x, w, n_threads=2))
    assert not completed
    assert lat < 1.0, f"KeyboardInterrupt {lat:.3f} s after the interrupt"
    xs, ws = x[:300, :64], w[:200, :64]
    np.testing.assert_allclose(F.linear(xs, ws, n_threads=2), xs @ ws.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("B", [64, 1], ids=["row_blocks", "unit_split"])
def test_rnn_scan_interrupt(rng, default_sigint, B):
    H, T = 256, 200000 if B == 1 else 20000
    xw = np.broadcast_to(rng.standard_normal((B, 1, 3 * H)).astype(np.float32), (B, T, 3 * H))
    w = (rng.standard_normal((3 * H, H)) * 0.05).astype(np.float32)
    h0 = np.zeros((B, H), np.float32)
    completed, lat = run_interrupted(
        lambda: F.rnn_scan(xw, w, None, h0, cell="gru", return_outputs=False, n_threads=2))
    assert not completed
    assert lat < 1.0, f"KeyboardInterrupt {lat:.3f} s after the interrupt"
    np.testing.assert_array_equal(h0, 0)
    short = np.ascontiguousarray(xw[:, :50])
    a = F.rnn_scan(short, w, None, h0, cell="gru", n_threads=2)
    b = F.rnn_scan(short, w, None, h0, cell="gru", n_threads=1)
    assert_close(a[1], b[1].astype(np.float64), np.float32)


def test_handler_that_calls_fastattn_and_does_not_raise(rng):
    """A signal handler runs inside the stop callback, mid-task: it may call
    fastattn itself (here a call needing more scratch than the outer one),
    and when it does not raise, the outer call finishes with the same result."""
    q = rng.standard_normal((1, 2, 4096, 64)).astype(np.float32)
    ref = F.scaled_dot_product_attention(q, q, q, n_threads=2)
    nq = rng.standard_normal((1, 4, 8)).astype(np.float32)
    nk = rng.standard_normal((1, 100000, 8)).astype(np.float32)
    nested_ref = F.scaled_dot_product_attention(nq, nk, nk)
    nested = []

    def handler(signum, frame):
        nested.append(F.scaled_dot_product_attention(nq, nk, nk))

    prev = signal.signal(signal.SIGUSR1, handler)
    stop = threading.Event()

    def pester():
        while not stop.wait(0.03):
            os.kill(os.getpid(), signal.SIGUSR1)

    th = threading.Thread(target=pester, daemon=True)
    th.start()
    try:
        for _ in range(20):
            got = F.scaled_dot_product_attention(q, q, q, n_threads=2)
            np.testing.assert_array_equal(got, ref)
            if len(nested) >= 5:
                break
    finally:
        stop.set()
        th.join()
        signal.signal(signal.SIGUSR1, prev)
    assert len(nested) >= 1
    for r in nested:
        np.testing.assert_array_equal(r, nested_ref)


def test_handler_exception_other_than_keyboardinterrupt(rng):
    """Whatever a handler raises is what the interrupted call raises."""
    q = rng.standard_normal(LONG_SHAPE).astype(np.float32)

    class Stop(Exception):
        pass

    def handler(signum, frame):
        raise Stop

    prev = signal.signal(signal.SIGUSR1, handler)
    timer = threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGUSR1))
    t0 = time.perf_counter()
    try:
        with pytest.raises(Stop):
            timer.start()
            F.scaled_dot_product_attention(q, q, q, n_threads=2)
    finally:
        timer.cancel()
        signal.signal(signal.SIGUSR1, prev)
    assert time.perf_counter() - t0 < 3.0


# ------------------------------------------------------------------- fork

def _mixed_calls(seed):
    """Calls of every kind (parallel where they can be); their results."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, 4, 200, 32)).astype(np.float32)
    k = rng.standard_normal((2, 4, 600, 32)).astype(np.float32)
    v = rng.standard_normal((2, 4, 600, 32)).astype(np.float32)
    x = rng.standard_normal((700, 256))
    w = rng.standard_normal((512, 256))
    xw = rng.standard_normal((16, 40, 3 * 64)).astype(np.float32)
    whh = (rng.standard_normal((3 * 64, 64)) * 0.1).astype(np.float32)
    add = dict(W_q=rng.standard_normal((16, 32)).astype(np.float32),
               W_k=rng.standard_normal((16, 32)).astype(np.float32),
               v=rng.standard_normal(16).astype(np.float32))
    return [
        F.scaled_dot_product_attention(q, k, v, n_threads=2),
        F.scaled_dot_product_attention(q.astype(np.float64), k, v, is_causal=True, n_threads=2),
        fastattn.attention(q, k, v, similarity="additive", params=add, n_threads=2),
        fastattn.attention(q, k, v, similarity=fastattn.testing.selftest_similarity(),
                           params={"gamma": 0.1}, n_threads=2),
        F.linear(x, w, n_threads=2),
        F.rnn_scan(xw, whh, None, np.zeros((16, 64), np.float32), n_threads=2)[1],
    ]


def _in_child(fn, timeout=60.0):
    """Run fn() in a forked child; returns what it reported ("ok" or an error)."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        os.close(r)
        msg = b"ok"
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            msg = f"{type(exc).__name__}: {exc}".encode()[:4000]
        try:
            os.write(wfd, msg)
        finally:
            os._exit(0)
    os.close(wfd)
    try:
        ready, _, _ = select.select([r], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child did not finish within {timeout} s (a hang after fork)")
        data = b""
        while True:
            chunk = os.read(r, 4096)
            if not chunk:
                break
            data += chunk
        os.waitpid(pid, 0)
    finally:
        os.close(r)
    return data.decode()


def test_fork_after_parent_used_the_pool():
    parent = _mixed_calls(0)
    assert _kernels.pool_workers() >= 1

    def child():
        got = _mixed_calls(0)
        for a, b in zip(got, parent):
            np.testing.assert_array_equal(a, b)
        assert _kernels.pool_workers() >= 1   # the child's own pool, started afresh

    assert _in_child(child) == "ok"


def test_fork_while_another_thread_is_in_a_parallel_call(rng):
    q = rng.standard_normal((1, 2, 8192, 64)).astype(np.float32)
    parent = _mixed_calls(1)
    box = {}
    started = threading.Event()

    def busy():
        started.set()
        box["r"] = F.scaled_dot_product_attention(q, q, q, n_threads=2)

    th = threading.Thread(target=busy)
    th.start()
    started.wait()
    time.sleep(0.3)   # the kernel is running on the pool now

    def child():
        got = _mixed_calls(1)
        for a, b in zip(got, parent):
            np.testing.assert_array_equal(a, b)

    try:
        assert _in_child(child) == "ok"
    finally:
        th.join()
    qs = q[:, :, :64]
    assert_close(box["r"][:, :, :64], oracle_sdpa(qs, q, q))


def test_prepared_attention_interrupted_first_call(rng, default_sigint):
    """An interrupted first call of a PreparedAttention keeps no reference to
    its query (the signature's cached entry drops it, as a completed call does)."""
    import sys

    k = rng.standard_normal((1, 4, 16384, 64)).astype(np.float32)
    sim = fastattn.testing.selftest_similarity()
    prep = fastattn.functional.PreparedAttention(k, k, sim, params={"gamma": 0.05}, n_threads=2)
    q = rng.standard_normal((1, 4, 16384, 64)).astype(np.float32)
    refs = sys.getrefcount(q)
    completed, lat = run_interrupted(lambda: prep(q))
    assert not completed and lat < 1.0
    assert sys.getrefcount(q) == refs
    check_pool_after(rng)


@pytest.mark.parametrize("B,H,cell", [(1, 160, "gru"), (9, 40, "lstm"), (2, 192, "lstm"),
                                      (33, 16, "rnn_tanh")])
def test_rnn_scan_chunks_change_nothing(rng, B, H, cell):
    """Main-thread scans run in chunks of steps (interrupt checks between
    them): any chunk length gives the one-chunk result exactly, in both
    directions, with and without lengths, row blocks and unit split alike."""
    G = {"gru": 3, "lstm": 4, "rnn_tanh": 1}[cell]
    T = 37
    for dt in (np.float32, np.float64):
        xw = rng.standard_normal((B, T, G * H)).astype(dt)
        w = (rng.standard_normal((G * H, H)) * 0.2).astype(dt)
        b = rng.standard_normal(G * H).astype(dt)
        h0 = rng.standard_normal((B, H)).astype(dt)
        lens = rng.integers(0, T + 1, B)
        for rev in (False, True):
            for L in (None, lens):
                ref = F.rnn_scan(xw, w, b, h0, cell=cell, lengths=L, reverse=rev, n_threads=2)
                prev = _rnn.set_tuning()
                try:
                    for steps in (1, 2, 5):
                        _rnn.set_tuning(chunk_flops=steps * 2.0 * B * G * H * H)
                        got = F.rnn_scan(xw, w, b, h0, cell=cell, lengths=L, reverse=rev,
                                         n_threads=2)
                        for x, y in zip(ref, got):
                            if x is None:
                                assert y is None
                            else:
                                np.testing.assert_array_equal(x, y)
                finally:
                    _rnn.set_tuning(**prev)
