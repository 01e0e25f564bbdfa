"""Peak extra memory of ONE attention call, per library, each in a fresh process.

For each library (fastattn, torch, ort, numpy) a new Python process imports
it, warms it on a tiny shape, allocates the inputs (and, for ort, has its
session, built with symbolic dims, already run the tiny shape), then makes
one call on the shape and reports

    peak extra RSS = peak RSS during the call - RSS right before it.

The peak is the kernel's VmHWM after resetting it to the current RSS just
before the call (``echo 5 > /proc/self/clear_refs``, Linux); a thread
sampling VmRSS every 1 ms is a cross-check (it can miss short peaks).
Every library allocates its own output during the call (ort: IOBinding
output bound to "cpu", allocated by onnxruntime), so the output size is
part of every number and is printed separately.  Just before the call,
glibc's ``malloc_trim(0)`` hands free heap pages back to the OS, so an
allocation cannot hide in memory freed earlier (and counted in "before").

    python benchmarks/memory.py [--shape 1x8x4096x64] [--dtype float32] [--causal]
                                [--impls fastattn,torch,ort,numpy]
"""
from __future__ import annotations

import argparse
import os
import sys

try:
    from fastattn import _bench
except ImportError:  # run as a script from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fastattn import _bench


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", type=_bench.parse_shape, default=(1, 8, 4096, 64))
    ap.add_argument("--dtype", default="float32", choices=("float32", "float64"))
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--impls", default="fastattn,torch,ort,numpy")
    args = ap.parse_args(argv)

    impls = [i for i in args.impls.split(",") if i]
    if "torch" in impls and _bench.load_torch(1) is None:
        impls.remove("torch")
    if "ort" in impls and _bench.load_ort() is None:
        impls.remove("ort")
    MB = 1024.0
    b, h, n, d = (args.shape + (0,) * 4)[:4] if len(args.shape) == 4 else (None,) * 4
    print(f"peak extra RSS of one call: {'x'.join(map(str, args.shape))} {args.dtype}"
          f"{' causal' if args.causal else ''}, no weights; fresh process per library")
    if n:
        esz = 4 if args.dtype == "float32" else 8
        print(f"for scale: inputs 3 x {b * h * n * d * esz / 2**20:.1f} MB, output "
              f"{b * h * n * d * esz / 2**20:.1f} MB, one full score matrix "
              f"B*H*N*N = {b * h * n * n * esz / 2**20:.0f} MB")
    print(f"{'library':>9} {'threads':>7} {'RSS before MB':>13} {'peak extra MB':>13} "
          f"{'sampled MB':>10} {'output MB':>9} {'extra - output':>14} {'call s':>7}")
    for impl in impls:
        r = _bench.memory_benchmark(impl, args.shape, args.dtype, args.causal, args.threads)
        extra = (r["hwm_kb"] - r["rss_before_kb"]) / MB if r["hwm_reset_ok"] else float("nan")
        sampled = (r["sampled_peak_kb"] - r["rss_before_kb"]) / MB
        out = r["out_bytes"] / 2**20
        print(f"{impl:>9} {r['threads']:>7} {r['rss_before_kb'] / MB:>13.1f} {extra:>13.1f} "
              f"{sampled:>10.1f} {out:>9.1f} {extra - out:>14.1f} {r['call_s']:>7.3f}")
    print("peak extra = VmHWM (reset just before the call) - VmRSS before; sampled = the same "
          "from a 1 ms VmRSS sampler; extra - output = memory beyond the result itself")
    return 0


if __name__ == "__main__":
    sys.exit(main())
