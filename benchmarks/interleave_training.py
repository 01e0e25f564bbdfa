"""The training steps of test_bench_training.py, fastattn and torch alternated
in blocks, so that the load changes of a shared machine hit both alike
(pytest-benchmark times one library's rounds after the other's, which on a
noisy 2-core VM moved the ratio by 20-40 % between runs).  A block is BLOCK
consecutive steps of one library, as a training loop runs them, the first
one untimed (it meets the caches and the worker threads the other library
left: single steps alternated with a rest between them took 1.3x longer for
fastattn's seq2seq step, 0.8x for torch's); a rest (``_bench.quiesce``)
before each block, so that the other library's spinning threads are idle.

Run: ``python benchmarks/interleave_training.py [encoder,seq2seq] [budget_s]``
(default both, 20 s each, the rests included).  Prints per case the min and median ms of each
library and the ratios (fastattn / torch) of both.  The models, data and
weights are test_bench_training.py's (the same first loss is checked there).
"""
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_bench_training as tb  # noqa: E402

from fastattn import _bench  # noqa: E402

CASES = (sys.argv[1] if len(sys.argv) > 1 else "encoder,seq2seq").split(",")
BUDGET = float(sys.argv[2]) if len(sys.argv) > 2 else 20.0
BLOCK = 4
torch = tb.torch
if torch is None:
    sys.exit("torch is not importable: nothing to interleave with")


def encoder():
    x, mask, y = tb.encoder_data()
    fa = tb.FastattnEncoder()
    _, tstep = tb.torch_encoder(fa)
    tx, tm, ty = torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(y)
    return (lambda: fa.step(x, mask, y)), (lambda: tstep(tx, tm, ty))


def seq2seq():
    data = tb.seq2seq_data()
    model, fa_step = tb.fastattn_seq2seq()
    t_step = tb.torch_seq2seq(model)
    tdata = tuple(torch.from_numpy(np.ascontiguousarray(a)) for a in data)
    return (lambda: fa_step(*data)), (lambda: t_step(*tdata))


print(f"fastattn vs torch {torch.__version__}, {tb.N_THREADS} threads, steps alternated in blocks of {BLOCK}, "
      f"{BUDGET:g} s a case")
for case in CASES:
    a, b = {"encoder": encoder, "seq2seq": seq2seq}[case]()
    a()
    b()
    ta, tt = [], []
    end = time.perf_counter() + BUDGET
    while time.perf_counter() < end or len(ta) < 10:
        for f, ts in ((a, ta), (b, tt)):
            _bench.quiesce()
            f()
            for _ in range(BLOCK - 1):
                t0 = time.perf_counter()
                f()
                ts.append((time.perf_counter() - t0) * 1e3)
    ta, tt = np.array(ta), np.array(tt)
    print(f"{case:8s} n={len(ta):3d}  fastattn min {ta.min():7.1f} med {np.median(ta):7.1f} ms | "
          f"torch min {tt.min():7.1f} med {np.median(tt):7.1f} ms | "
          f"ratio min {ta.min() / tt.min():.2f} med {np.median(ta) / np.median(tt):.2f}", flush=True)
