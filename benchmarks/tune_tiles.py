"""Tile-size sweep for the SDPA kernel: times _kernels.sdpa under explicit plans.

Run: python benchmarks/tune_tiles.py [long|mid].  Prints, per shape, every plan
with its median time, GFLOP/s and ratio to the best; functional._plan encodes
the winners.
"""
import sys, time, itertools
import numpy as np
from fastattn import _kernels as K, _threads
_threads.ensure_blas_hook()
rng = np.random.default_rng(0)

def med(f, budget=0.6):
    f()
    ts = []
    t_end = time.perf_counter() + budget
    while time.perf_counter() < t_end or len(ts) < 3:
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return float(np.median(ts))

def run(shape, dt, causal, plans, nt=2):
    B, H, N, d = shape
    q, k, v = [rng.standard_normal(shape).astype(dt) for _ in range(3)]
    o = np.empty_like(q)
    res = {}
    for rep in range(2):
        for (path, bq, bk) in plans:
            f = lambda: K.sdpa(q, k, v, None, 0, o, None, (B, H), causal, 0, d ** -0.5, bq, bk, path, False, nt)
            t = med(f)
            res[(path, bq, bk)] = min(res.get((path, bq, bk), 1e9), t)
    fl = 4 * B * H * N * N * d / (2 if causal else 1)
    best = min(res.values())
    for p, t in sorted(res.items(), key=lambda x: x[1]):
        print(f"  {shape} {np.dtype(dt).name} causal={causal} path={'single' if p[0]==1 else 'stream'} bq={p[1]} bk={p[2]}: {t*1e3:8.3f} ms {fl/t/1e9:6.1f} GF/s {t/best:5.2f}x")

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "long"
    if which == "long":
        plans = [(2, bq, bk) for bq in (64, 128, 256) for bk in (256, 512, 1024)] + [(1, bq, 0) for bq in (32, 64, 128)]
        for shape in [(1, 8, 2048, 64), (1, 8, 4096, 64)]:
            for causal in (False, True):
                run(shape, np.float32, causal, [(p, bq, bk if p == 2 else shape[2]) for p, bq, bk in plans])
    elif which == "mid":
        for shape in [(1, 8, 512, 64), (4, 8, 512, 64), (8, 8, 128, 64), (1, 8, 128, 64)]:
            N = shape[2]
            plans = [(1, bq, N) for bq in (16, 32, 64, 128, 256) if bq <= N] + [(2, bq, bk) for bq in (64, 128) for bk in (128, 256) if bk < N]
            for causal in (False, True):
                run(shape, np.float32, causal, plans)
