"""Tile-size sweep for the SDPA kernel: times _kernels.sdpa under explicit plans.

Run: python benchmarks/tune_tiles.py [long|mid|own].  "own" sweeps the
streaming path with our packed products (SIMD on), the others the BLAS tiles.  Prints, per shape, every plan
with its median time, GFLOP/s and ratio to the best; _sdpa._plan encodes
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
        for plan in plans:
            path, bq, bk = plan[:3]
            direct = len(plan) > 3 and plan[3]
            f = lambda: K.sdpa(q, k, v, None, 0, o, None, (B, H), causal, 0, d ** -0.5, bq, bk, path, direct, nt)
            t = med(f)
            res[plan] = min(res.get(plan, 1e9), t)
    fl = 4 * B * H * N * N * d / (2 if causal else 1)
    best = min(res.values())
    for p, t in sorted(res.items(), key=lambda x: x[1]):
        kind = "single" if p[0] == 1 else "stream-own" if len(p) > 3 and p[3] else "stream"
        print(f"  {shape} {np.dtype(dt).name} causal={causal} path={kind} bq={p[1]} bk={p[2]}: {t*1e3:8.3f} ms {fl/t/1e9:6.1f} GF/s {t/best:5.2f}x")

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
    elif which == "own":
        for shape, dt in [((8, 8, 128, 64), np.float32), ((1, 8, 512, 64), np.float32),
                          ((1, 8, 2048, 64), np.float32), ((1, 8, 2048, 64), np.float64)]:
            N = shape[2]
            nq = shape[0] * shape[1]
            plans = [(2, bq, bk, True) for bq in (64, 128, 256) for bk in (64, 128, 256, 512)
                     if bq <= N and bk <= N and nq * -(-N // bq) >= 4]
            for causal in (False, True):
                run(shape, dt, causal, plans)
