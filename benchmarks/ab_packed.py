"""A/B of the projection kernel with and without prepacked weights (fastattn._proj.linear).

Run: ``python benchmarks/ab_packed.py [M,M,...] [budget_s]``.  For K = 512,
N in {512, 1536}, float32, 1 and 2 threads, it alternates single calls of
``linear(x, w, b, y, nt)`` (the current paths: the few-row kernel up to 128
rows, sgemm blocks above) and ``linear(.., wp)`` (w packed once,
``_multihead.pack_weight``) for ``budget_s`` seconds per case and prints the
minimum and median of each in microseconds.  Alternating single calls keeps
both sides under the same load when another process shares the machine;
trust the minima more than the medians then.
"""
import sys

import numpy as np

from fastattn import _bench, _multihead, _proj, _threads

_threads.ensure_blas_hook()
rng = np.random.default_rng(0)
K = 512
ROWS = [int(a) for a in sys.argv[1].split(",")] if len(sys.argv) > 1 else [
    1, 2, 4, 6, 8, 13, 16, 32, 64, 128, 256, 512, 1024, 2048]
BUDGET = float(sys.argv[2]) if len(sys.argv) > 2 else 0.5

print(f"packed kernel active: {_proj.packed_kernel_active()}")
for N in (512, 1536):
    w = rng.standard_normal((N, K)).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    wp = _multihead.pack_weight(w)
    for M in ROWS:
        x = rng.standard_normal((1, M, K)).astype(np.float32)
        y = np.empty((1, M, N), np.float32)
        line = f"N={N:4d} M={M:5d}"
        for nt in (1, 2):
            a = lambda: _proj.linear(x, w, b, y, nt)
            p = lambda: _proj.linear(x, w, b, y, nt, wp)
            ta, tp = _bench.interleaved(a, p, BUDGET, 5)
            line += (f" | {nt}t cur {ta.min():8.1f}/{np.median(ta):8.1f} packed {tp.min():8.1f}/"
                     f"{np.median(tp):8.1f} x{ta.min() / tp.min():.2f}")
        print(line + "   (min/median us)", flush=True)
