"""test_bench_mha.py's MultiHeadAttention cases, the default layer, the frozen
layer and onnxruntime alternated in blocks of 0.15 s (each after a rest,
``_bench.quiesce``), so that the load changes of a shared machine hit all
three alike.

Run: ``python benchmarks/interleave_mha.py [BxN,...] [budget_s]`` (default
the five shapes, 6 s each).  Prints min and median ms of each and the
ratios to onnxruntime's.
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_bench_mha as M  # noqa: E402

from fastattn import _bench  # noqa: E402

if M.ort is None:
    sys.exit("onnxruntime is not importable: nothing to interleave with")
shapes = [tuple(int(v) for v in s.split("x")) for s in (sys.argv[1] if len(sys.argv)>1 else "1x16,1x128,8x128,4x512,1x1024").split(",")]
BUDGET = float(sys.argv[2]) if len(sys.argv)>2 else 6.0
for B,N in shapes:
    x,_ = M.case_data(B,N)
    fns = {k: M._callable(k, x) for k in ("fastattn","fastattn_frozen","ort")}
    for f in fns.values(): f(); f()
    ts = {k: [] for k in fns}
    t_end = time.perf_counter()+BUDGET
    blk = 0.15
    while time.perf_counter() < t_end:
        for k,f in fns.items():
            _bench.quiesce()
            e = time.perf_counter()+blk
            while True:
                t=time.perf_counter(); f(); d=time.perf_counter()-t
                ts[k].append(d)
                if t+d > e: break
    r = {k: (min(v)*1e3, float(np.median(v))*1e3, len(v)) for k,v in ts.items()}
    o = r["ort"]
    print(f"({B},{N}) " + "  ".join(f"{k}: min {a:.3f} med {b:.3f} ms n={n}" for k,(a,b,n) in r.items())
          + f" | default/ort min {r['fastattn'][0]/o[0]:.3f} med {r['fastattn'][1]/o[1]:.3f}; frozen/ort min {r['fastattn_frozen'][0]/o[0]:.3f} med {r['fastattn_frozen'][1]/o[1]:.3f}", flush=True)
