"""CPU burned by lingering threads after a call ("idle after call").

For each library, in a fresh process (so no other library's threads are
around): two warm-up calls and a 0.3 s rest, then 5 times: one call, then
the process CPU time (``time.process_time()``, all threads) over the next
200 ms of ``time.sleep``.  A library whose worker threads go to sleep when
the call returns burns ~0 ms; a spinning pool burns up to
threads x 200 ms.  OpenBLAS (NumPy's matmul) is the known offender.

    python benchmarks/idle.py [--shape 1x8x512x64] [--window 0.2] [--repeats 5]
                              [--impls fastattn,torch,ort,numpy]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys

try:
    from fastattn import _bench
except ImportError:  # run as a script from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fastattn import _bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_bench.parse_shape, default=(1, 8, 512, 64))
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--window", type=float, default=0.2, help="seconds watched after a call")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--impls", default="fastattn,torch,ort,numpy")
    args = ap.parse_args(argv)

    impls = [i for i in args.impls.split(",") if i]
    if "torch" in impls and _bench.load_torch(1) is None:
        impls.remove("torch")
    if "ort" in impls and _bench.load_ort() is None:
        impls.remove("ort")
    w = args.window * 1e3
    print(f"idle after call: {'x'.join(map(str, args.shape))} {args.dtype}; CPU ms burned "
          f"in the {w:.0f} ms after one call (process_time, all threads), "
          f"{args.repeats} calls, fresh process per library")
    print(f"{'library':>9} {'threads':>7} {'OS thr':>6} {'call CPU ms':>11} {'idle base':>9} "
          f"{'after: median':>13} {'max':>7} {'% of window':>11}")
    for impl in impls:
        r = _bench.idle_benchmark(impl, args.shape, args.dtype, n_threads=args.threads,
                                  window=args.window, repeats=args.repeats)
        med = statistics.median(r["after_ms"])
        print(f"{impl:>9} {r['threads']:>7} {r['os_threads']:>6} "
              f"{statistics.median(r['call_cpu_ms']):>11.1f} "
              f"{statistics.median(r['baseline_ms']):>9.1f} {med:>13.1f} "
              f"{max(r['after_ms']):>7.1f} {100 * med / w:>10.0f}%")
    print("idle base = CPU ms over the same window with no call before it; "
          "OS thr = threads in the process at the end; 'threads' = the count each library "
          "was given (numpy: its OpenBLAS default, not set)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
