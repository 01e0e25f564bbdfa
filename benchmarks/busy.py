"""Call time with a CPU-bound competitor on one core, against a quiet machine.

For each shape and library: the median (and 90th percentile) time per call
on a quiet machine, then with a competing process (a Python busy loop
pinned with ``os.sched_setaffinity`` to the last CPU this process may use)
running, then quiet again; ``quiet`` is the better of the two quiet
measurements.  Every library uses the same thread count (fastattn's,
2 here), so with one core taken a pool that waits for all its threads at a
barrier suffers most.  Results are checked against NumPy first.

    python benchmarks/busy.py [--budget 0.5] [--impls fastattn,torch] [--shape 1x8x128x64 ...] [--wait-quiet]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys

import numpy as np

try:
    from fastattn import _bench
except ImportError:  # run as a script from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fastattn import _bench

SHAPES = ((1, 8, 128, 64), (8, 8, 128, 64), (1, 8, 512, 64), (1, 8, 2048, 64))


def _p90(xs):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(0.9 * len(xs)))]


def main(argv=None):
    import fastattn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", dest="shapes", type=_bench.parse_shape, action="append")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--budget", type=float, default=0.5, help="seconds of timing per measurement")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--impls", default="fastattn,torch", help="any of fastattn,torch,ort,numpy")
    ap.add_argument("--wait-quiet", action="store_true",
                    help="first wait until other processes leave the CPUs idle")
    args = ap.parse_args(argv)
    if args.wait_quiet:
        _bench.wait_quiet(file=sys.stderr)

    nt = args.threads or fastattn.get_num_threads()
    impls = [i for i in args.impls.split(",") if i]
    torch = _bench.load_torch(nt) if "torch" in impls else None
    if "torch" in impls and torch is None:
        impls.remove("torch")
    if "ort" in impls and _bench.load_ort() is None:
        impls.remove("ort")
    cpu = max(os.sched_getaffinity(0))
    mu = _bench.micro_unit(sys.stdout)
    print(f"busy competitor: a Python busy loop pinned to CPU {cpu} of "
          f"{sorted(os.sched_getaffinity(0))}; {nt} thread(s) per library; {args.dtype}; "
          f"median / p90 {mu} per call")
    print(f"{'BxHxNxd':>14} {'library':>9} {'quiet':>9} {'busy':>9} {'busy/quiet':>10} "
          f"{'p90 quiet':>9} {'p90 busy':>9} {'p90 ratio':>9}")
    status = 0
    load = _bench.LoadMonitor()  # the competitor is our child: not counted as "other"
    for shape in args.shapes or SHAPES:
        q, k, v = _bench.random_qkv(shape, np.dtype(args.dtype))
        with _bench.blas_threads(1, which=("numpy",)):
            expected = _bench.numpy_sdpa(q, k, v)
        fns = {}
        for impl in impls:
            fn = _bench.impl_callable(impl, q, k, v, False, nt, torch)
            ctx = torch.inference_mode() if impl == "torch" else contextlib.nullcontext()
            with ctx:
                err = float(np.max(np.abs(np.asarray(fn(), np.float64) - expected)))
            if err > _bench.check_tolerance(impl, args.dtype) * max(1.0, float(np.abs(expected).max())):
                print(f"MISMATCH {impl} {shape}: max|diff| {err:.2e}")
                status = 1
            fns[impl] = fn

        def measure(impl):
            ctx = torch.inference_mode() if impl == "torch" else contextlib.nullcontext()
            with ctx:
                s = _bench.time_samples(fns[impl], args.budget, min_repeats=9)
            _bench.quiesce()
            return s

        quiet1 = {impl: measure(impl) for impl in impls}
        proc = _bench.start_competitor(cpu)
        try:
            busy = {impl: measure(impl) for impl in impls}
        finally:
            proc.kill()
            proc.wait()
        _bench.quiesce()
        quiet2 = {impl: measure(impl) for impl in impls}
        for impl in impls:
            q1, q2 = quiet1[impl], quiet2[impl]
            quiet = min((q1, q2), key=statistics.median)
            mq, mb = statistics.median(quiet), statistics.median(busy[impl])
            pq, pb = _p90(quiet), _p90(busy[impl])
            print(f"{'x'.join(map(str, shape)):>14} {impl:>9} {_bench.format_us(mq):>9} "
                  f"{_bench.format_us(mb):>9} {mb / mq:>9.2f}x {_bench.format_us(pq):>9} "
                  f"{_bench.format_us(pb):>9} {pb / pq:>8.2f}x")
        fns.clear()
    print("busy/quiet: 1x = unaffected; ~2x = the call lost the busy core's share, as "
          "expected with one of two cores taken; far above 2x = threads waiting on each other")
    print(load.line())
    return status


if __name__ == "__main__":
    sys.exit(main())
