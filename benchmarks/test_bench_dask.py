"""Benchmarks of fastattn.dask on a local distributed cluster (2 worker
processes, 1 task thread each, on this machine's 2 cores).

* ``apply``: embedding a corpus with ``fastattn.dask.apply(MultiHeadAttention(256, 4), x)``,
  x = 4096 x 128 x 256 float32 in 16 batch chunks, generated on the workers
  and persisted before the timing; the result is persisted on the workers
  (an embedding job keeps or writes it there).  Against the same layer called
  once on the whole NumPy array in this process with 2 fastattn threads.
  Throughput target: dask >= 0.85x the single process (Dask's overhead <= 15 %).
* ``key_split``: SDPA over 1 x 8 x 16384 x 64 float32 in 8 key chunks (and 8
  query chunks), persisted on the workers, against the one-machine call
  (results compared), and each
  peak RSS growth (VmHWM, reset through /proc/self/clear_refs just before,
  minus the RSS then) of one (query block, key block) task on a worker beyond
  its inputs, against 16 MB, and of each worker over the whole graph (that
  includes the input blocks Dask copies between the workers and the partials
  it holds for the merges).

    pytest benchmarks/test_bench_dask.py --benchmark-only
"""
from __future__ import annotations

import copy
import os

import numpy as np
import pytest

import fastattn

da = pytest.importorskip("dask.array", reason="the 'dask' extra is not installed")
distributed = pytest.importorskip("distributed", reason="the 'dask' extra is not installed")
import fastattn.dask as fd  # noqa: E402

B, N, E, HEADS, CHUNKS = 4096, 128, 256, 4, 16


@pytest.fixture(scope="module")
def client():
    here = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = {"PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cluster = distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                       dashboard_address=None, env=env)
    c = distributed.Client(cluster)
    yield c
    c.close()
    cluster.close()


def _layer():
    return fastattn.layers.MultiHeadAttention(E, HEADS, seed=0)


@pytest.mark.benchmark(group="dask-apply MHA(256, 4) 4096x128x256 f32")
def test_apply_single_process(benchmark):
    layer = _layer()
    x = np.random.default_rng(0).standard_normal((B, N, E), dtype=np.float32)
    benchmark.extra_info.update(kind="dask_apply", impl="single process (2 threads)",
                                rows=B)
    with fastattn.threads(2):
        benchmark.pedantic(lambda: layer(x), rounds=3, iterations=1, warmup_rounds=1)


@pytest.mark.benchmark(group="dask-apply MHA(256, 4) 4096x128x256 f32")
def test_apply_dask(benchmark, client):
    layer = _layer()
    x = da.random.default_rng(0).standard_normal((B, N, E), chunks=(B // CHUNKS, N, E),
                                                 dtype=np.float32)
    x = client.persist(x)
    distributed.wait(x)
    # the check, outside the timing: one chunk against the layer in this process
    got = fd.apply(layer, x)[:B // CHUNKS].compute()
    np.testing.assert_allclose(got, layer(x[:B // CHUNKS].compute()), rtol=1e-4, atol=1e-5)

    def run():
        # a fresh copy of the layer each round: new output keys (the same graph
        # persisted again would be served from the previous round's results)
        y = client.persist(fd.apply(copy.deepcopy(layer), x))
        distributed.wait(y)
        del y

    benchmark.extra_info.update(kind="dask_apply", impl="dask, 2 workers x 1 thread",
                                rows=B, chunks=CHUNKS)
    benchmark.pedantic(run, rounds=3, iterations=1, warmup_rounds=1)


def _status(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak():
    """Return freed memory to the system (gc, malloc_trim), reset this
    process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0) and return
    that RSS: the growth measured next is new memory, not reused free lists."""
    import ctypes
    import gc
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS")


def _peak():
    return _status("VmHWM")


def _identity(block):
    return block


def _task_peak(q, k, v):
    """Peak RSS growth of one fastattn call (on its inputs, already in memory)."""
    rss = _reset_peak()
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, return_lse=True, n_threads=1)
    return _peak() - rss


@pytest.mark.benchmark(group="dask key-split SDPA 1x8x16384x64 f32")
def test_key_split_sdpa(benchmark, client):
    L, d, kc, qc = 16384, 64, 8, 8
    rng = da.random.default_rng(1)
    shape = (1, 8, L, d)
    q = client.persist(rng.standard_normal(shape, chunks=(1, 8, L // qc, d), dtype=np.float32))
    k, v = (client.persist(rng.standard_normal(shape, chunks=(1, 8, L // kc, d), dtype=np.float32))
            for _ in range(2))
    distributed.wait([q, k, v])
    out = fd.scaled_dot_product_attention(q, k, v)
    before = client.run(_reset_peak)
    res = client.persist(out)          # the result stays on the workers
    distributed.wait(res)
    peaks = client.run(_peak)
    growth = {w: peaks[w] - before[w] for w in before}
    got = res.compute()
    del res
    want = fastattn.scaled_dot_product_attention(*(x.compute() for x in (q, k, v)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    chunk_inputs = 8 * (L // qc) * d * 4 + 2 * 8 * (L // kc) * d * 4
    # one (query block, key block) task on a worker: its peak beyond its inputs
    blocks = [client.compute(x[:, :, :n]) for x, n in ((q, L // qc), (k, L // kc), (v, L // kc))]
    task = client.submit(_task_peak, *blocks, pure=False).result() / 2 ** 20
    benchmark.extra_info.update(
        kind="dask_key_split", chunk_inputs_mb=chunk_inputs / 2 ** 20,
        peak_growth_mb={w: g / 2 ** 20 for w, g in growth.items()},
        task_peak_beyond_inputs_mb=task, target_mb=chunk_inputs / 2 ** 20 + 16)
    print(f"\nkey-split SDPA ({qc} query x {kc} key chunks): one chunk's inputs "
          f"{chunk_inputs / 2 ** 20:.1f} MB (target {chunk_inputs / 2 ** 20 + 16:.1f} MB); one "
          f"task's peak beyond its inputs {task:.1f} MB (its out and lse included); each "
          f"worker's peak RSS growth over the whole graph (result persisted) "
          + ", ".join(f"{g / 2 ** 20:.1f} MB" for g in growth.values()))

    rounds = iter(range(1000))

    def run():
        # new keys each round (an identity over q's blocks, no copy): the graph
        # is computed again, not served from the previous round's results
        qr = q.map_blocks(_identity, name=f"bench-q-{next(rounds)}-{q.name}")
        r = client.persist(fd.scaled_dot_product_attention(qr, k, v))
        distributed.wait(r)
        del r

    benchmark.pedantic(run, rounds=3, iterations=1)


@pytest.mark.benchmark(group="dask key-split SDPA 1x8x16384x64 f32")
def test_key_split_one_machine(benchmark):
    """The same SDPA as one fastattn call in this process (2 threads)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 8, 16384, 64), dtype=np.float32) for _ in range(3))
    benchmark.extra_info.update(kind="dask_key_split", impl="one machine (2 threads)")
    with fastattn.threads(2):
        benchmark.pedantic(lambda: fastattn.scaled_dot_product_attention(q, k, v), rounds=3,
                           iterations=1)
