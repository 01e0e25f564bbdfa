"""Blocking sweep for the projection kernel (fastattn._proj.linear).

Run: python benchmarks/tune_proj.py.  For the layer's projection shapes
(rows M = B * L, N = 3E or E, K = E = 512, float32, 2 threads) it times every
blocking in CONFIGS (fastattn._proj.set_tuning) in three rounds, keeps each
one's best median, and prints GFLOP/s and the ratio to the best; the defaults
in fastattn/_proj.pyx encode the winners.  Run it on an idle machine: the
differences are a few per cent.
"""
import time

import numpy as np

from fastattn import _proj, _threads

_threads.ensure_blas_hook()
rng = np.random.default_rng(0)
E = 512
CONFIGS = {
    "rows, 2 blocks/thread (default)": {},
    "rows, 1 block/thread": {"blocks_per_thread": 1},
    "columns, 2 blocks/thread": {"min_block_rows": 1 << 30},
    "sgemm only": {"small_m": 0},
    "small kernel up to 256 rows": {"small_m": 256},
}
SHAPES = [(16, 3 * E), (16, E), (128, 3 * E), (128, E), (1024, 3 * E), (1024, E), (2048, 3 * E)]


def med(f, budget=0.4):
    f()
    ts = []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(ts) < 5:
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


for M, N in SHAPES:
    x = rng.standard_normal((1, M, E)).astype(np.float32)
    w = rng.standard_normal((N, E)).astype(np.float32)
    b = np.zeros(N, np.float32)
    y = np.empty((1, M, N), np.float32)
    best = {}
    for _ in range(3):
        for name, cfg in CONFIGS.items():
            prev = _proj.set_tuning(**cfg)
            try:
                best[name] = min(best.get(name, 1e9), med(lambda: _proj.linear(x, w, b, y, 2)))
            finally:
                _proj.set_tuning(**prev)
            time.sleep(0.05)
    top = min(best.values())
    print(f"M={M} N={N} K={E}")
    for name, t in best.items():
        print(f"  {name:34s} {t * 1e3:8.3f} ms {2 * M * N * E / t / 1e9:6.0f} GFLOP/s  x{t / top:.2f}")
