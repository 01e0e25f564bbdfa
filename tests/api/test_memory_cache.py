"""fastattn's block cache (fastattn/_alloc.py, csrc/fa_cache.c): the layers
allocate through it, it reuses freed large blocks within its limit, and it
never changes a result."""
import os

import numpy as np
import pytest

import fastattn
from fastattn import _memory
from fastattn import layers as L

from support import run_child, run_in_threads

try:
    from numpy._core.multiarray import get_handler_name as handler_name
except ImportError:   # NumPy 1.x
    from numpy.core.multiarray import get_handler_name as handler_name
BIG = 2 << 20   # bytes: above the cache's threshold (_memory.MIN_BYTES)


def owner_handler(a):
    """The handler of the array that owns a's memory (a may be a view)."""
    while isinstance(a.base, np.ndarray):
        a = a.base
    return handler_name(a)


@pytest.fixture
def cache_limit():
    """Restore the limit (and the handler switch) after the test."""
    prev = fastattn.memory_cache_info()["limit"]
    yield
    fastattn.set_memory_cache(prev)


def _encoder_step(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((4, 64, 64), dtype=np.float32)
    layer = L.TransformerEncoderLayer(64, 4, 128, 0.0, seed=1)
    out, back = layer.forward_backward(x)
    (dx,) = back(rng.standard_normal(out.shape, dtype=np.float32))
    return layer, out, dx


def test_layers_allocate_through_the_cache_and_nothing_else_does(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    layer, out, dx = _encoder_step()
    assert handler_name(out) == _memory.NAME
    assert handler_name(dx) == _memory.NAME   # made inside the backprop
    assert handler_name(layer(np.ones((2, 8, 64), np.float32))) == _memory.NAME
    assert handler_name() != _memory.NAME      # this context is left as it was
    assert handler_name(np.empty(BIG, np.uint8)) != _memory.NAME


def test_results_are_the_same_bits_with_and_without_the_cache(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    layer_c, out_c, dx_c = _encoder_step()
    fastattn.set_memory_cache(0)
    layer_p, out_p, dx_p = _encoder_step()
    assert handler_name(out_p) != _memory.NAME
    np.testing.assert_array_equal(out_c, out_p)
    np.testing.assert_array_equal(dx_c, dx_p)
    for (n, a), (_, b) in zip(layer_c.named_grads(), layer_p.named_grads()):
        np.testing.assert_array_equal(a, b, err_msg=n)


def test_a_second_step_reuses_the_first_steps_blocks(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 128, 128), dtype=np.float32)   # 4 MiB activations
    layer = L.TransformerEncoderLayer(128, 4, 256, 0.0, seed=1)

    def step():
        out, back = layer.forward_backward(x)
        back(np.ones_like(out))

    step()
    before = fastattn.memory_cache_info()
    assert before["cached_bytes"] > 0 and before["cached_blocks"] > 0
    step()
    after = fastattn.memory_cache_info()
    assert after["hits"] - before["hits"] >= 5
    assert after["misses"] - before["misses"] <= after["hits"] - before["hits"]
    assert after["cached_bytes"] <= after["limit"]


def test_reused_blocks_are_zeroed_for_zeros_and_kept_by_resize(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    prev = _memory.enter()
    try:
        a = np.empty(BIG, np.uint8)
        a[:] = 7
        del a
        hits = fastattn.memory_cache_info()["hits"]
        z = np.zeros(BIG, np.uint8)                 # calloc from a dirty cached block
        assert fastattn.memory_cache_info()["hits"] == hits + 1
        assert not z.any()
        b = np.arange(BIG // 4, dtype=np.int32)
        b.resize(BIG, refcheck=False)              # realloc to 4x: moved, contents kept
        np.testing.assert_array_equal(b[:BIG // 4], np.arange(BIG // 4, dtype=np.int32))
        assert not b[BIG // 4:].any()
        c = np.arange(10, dtype=np.int64)          # a small block (malloc, not cached)
        c.resize(3, refcheck=False)
        np.testing.assert_array_equal(c, [0, 1, 2])
        assert c.ctypes.data % 16 == 0 and b.ctypes.data % 64 == 0
    finally:
        _memory.exit(prev)


def test_limit_bounds_the_cache_and_release_empties_it(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    prev = _memory.enter()
    try:
        arrays = [np.empty(BIG, np.uint8) for _ in range(6)]
        del arrays
        info = fastattn.memory_cache_info()
        assert info["cached_bytes"] >= 6 * BIG and info["cached_blocks"] >= 6
        assert fastattn.set_memory_cache(3 * BIG + 4096) == 256 << 20
        info = fastattn.memory_cache_info()
        assert 0 < info["cached_bytes"] <= 3 * BIG + 4096
        fastattn.release_memory()
        assert fastattn.memory_cache_info()["cached_bytes"] == 0
        big = np.empty(4 * BIG, np.uint8)          # above the limit: freed at once
        del big
        assert fastattn.memory_cache_info()["cached_bytes"] == 0
    finally:
        _memory.exit(prev)
    fastattn.set_memory_cache(0)
    info = fastattn.memory_cache_info()
    assert info["limit"] == 0 and info["cached_bytes"] == 0 and info["cached_blocks"] == 0
    _, out, _ = _encoder_step()
    assert handler_name(out) != _memory.NAME


@pytest.mark.parametrize(("value", "exc", "words"), [
    (-1, ValueError, ">= 0, got -1"),
    (1.5, TypeError, "got float"),
    (True, TypeError, "got bool"),
    ("256M", TypeError, "got str"),
])
def test_bad_limit(value, exc, words, cache_limit):
    before = fastattn.memory_cache_info()["limit"]
    with pytest.raises(exc, match="limit") as e:
        fastattn.set_memory_cache(value)
    assert words in str(e.value)
    assert fastattn.memory_cache_info()["limit"] == before


def _limit_in_child(value):
    r = run_child("import warnings; warnings.simplefilter('always'); import fastattn; "
                  "print(fastattn.memory_cache_info()['limit'])",
                  env_update={"FASTATTN_MEMORY_CACHE": value}, timeout=120)
    assert r.returncode == 0, r.stderr
    return int(r.stdout.split()[-1]), r.stderr


@pytest.mark.parametrize(("value", "limit"), [("0", 0), ("64M", 64 << 20), ("1048576", 1 << 20),
                                              ("2g", 2 << 30), ("512KiB", 512 << 10)])
def test_environment_variable(value, limit):
    got, err = _limit_in_child(value)
    assert got == limit and "Warning" not in err


def test_environment_variable_garbage_warns_and_keeps_the_default():
    limit, err = _limit_in_child("lots")
    assert limit == 256 << 20
    assert "FASTATTN_MEMORY_CACHE='lots'" in err and "RuntimeWarning" in err


def test_threads_allocate_and_free_concurrently(cache_limit):
    fastattn.set_memory_cache(8 * BIG)
    errors = []

    def work(k):
        prev = _memory.enter()
        try:
            for i in range(200):
                n = BIG + (i % 7) * 4096 * (k + 1)
                a = np.empty(n, np.uint8)
                a[::4096] = k
                if not (a[::4096] == k).all():
                    errors.append((k, i))
                del a
        finally:
            _memory.exit(prev)

    run_in_threads(work, 4)
    assert not errors
    assert fastattn.memory_cache_info()["cached_bytes"] <= 8 * BIG


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_allocates(cache_limit):
    fastattn.set_memory_cache(256 << 20)
    pid = os.fork()
    if pid == 0:   # pragma: no cover - the child's exit status is the check
        try:
            _, out, dx = _encoder_step()
            os._exit(0 if np.isfinite(dx).all() and handler_name(out) == _memory.NAME else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


@pytest.mark.parametrize("op", ["sdpa", "sdpa_backward", "attention", "attention_backward"])
def test_the_attention_ops_allocate_through_the_cache(op, cache_limit):
    fastattn.set_memory_cache(256 << 20)
    F = fastattn.functional
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 512, 64), dtype=np.float32)   # 1 MiB results
    out, lse = F.scaled_dot_product_attention(q, q, q, return_lse=True)
    if op == "sdpa":
        res = out
    elif op == "sdpa_backward":
        res = F.sdpa_backward(out, q, q, q, out, lse)[0]
    elif op == "attention":
        res = F.attention(q, q, q, "dot")
    else:
        res = F.attention_backward(out, q, q, q, "dot", out=out, lse=lse)[0]
    assert handler_name(res) == _memory.NAME
    fastattn.set_memory_cache(0)
    assert handler_name(F.scaled_dot_product_attention(q, q, q)) != _memory.NAME


def test_threshold():
    assert _memory.MIN_BYTES == 128 << 10 and BIG >= _memory.MIN_BYTES


@pytest.mark.parametrize("op", ["linear", "linear_backward", "rnn_scan", "rnn_scan_backward",
                                "multi_head_attention", "multi_head_attention_forward_backward"])
def test_the_other_ops_allocate_through_the_cache(op, cache_limit):
    fastattn.set_memory_cache(256 << 20)
    F = fastattn.functional
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 64, 256), dtype=np.float32)       # 256 KiB
    w = rng.standard_normal((768, 256), dtype=np.float32) * 0.05
    b = np.zeros(768, np.float32)
    h0 = np.zeros((4, 256), np.float32)
    if op == "linear":
        res = F.linear(x, w, b)
    elif op == "linear_backward":
        res = F.linear_backward(F.linear(x, w, b), x, w, b)[0]
    elif op == "rnn_scan":
        res = F.rnn_scan(F.linear(x, w, b), w[:, :256].copy(), b, h0, cell="gru")[0]
    elif op == "rnn_scan_backward":
        xw = F.linear(x, w, b)
        out = F.rnn_scan(xw, w[:, :256].copy(), b, h0, cell="gru")[0]
        res = F.rnn_scan_backward(out, None, xw, w[:, :256].copy(), b, h0, out, cell="gru")[0]
    else:
        wq = {"w_qkv": w, "b_qkv": b, "w_out": w[:256].copy(), "b_out": b[:256].copy()}
        if op == "multi_head_attention":
            res = F.multi_head_attention(x, x, x, num_heads=4, **wq)
        else:
            out, backward = F.multi_head_attention_forward_backward(x, x, x, num_heads=4, **wq)
            grads = backward(out)
            res = grads[0] if isinstance(grads, tuple) else next(iter(grads.values()))
            assert owner_handler(out) == _memory.NAME
    assert owner_handler(res) == _memory.NAME
