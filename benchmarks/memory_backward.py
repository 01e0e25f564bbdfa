"""Peak extra memory of one sdpa_backward call (1 x 8 x 4096 x 64, float32), in this process.

    python benchmarks/memory_backward.py [--causal]

The inputs, the forward's output and lse exist before the measured call, and
the kernel has run once on a tiny shape. VmHWM is reset through
/proc/self/clear_refs after returning free heap pages to the OS, then one
backward runs.  Printed: the peak RSS growth, the part that is the three
gradients (returned, so not extra), and the rest: D, the dQ partials and the
per-thread tile scratch.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

try:
    import fastattn
except ImportError:  # run as a script from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import fastattn
from fastattn import _bench
from fastattn.functional import sdpa_backward


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--shape", type=_bench.parse_shape, default=(1, 8, 4096, 64))
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal(args.shape, dtype=np.float32) for _ in range(4))
    out, lse = fastattn.scaled_dot_product_attention(q, k, v, is_causal=args.causal, return_lse=True)
    t = rng.standard_normal((1, 1, 64, 64), dtype=np.float32)
    o2, l2 = fastattn.scaled_dot_product_attention(t, t, t, return_lse=True)
    sdpa_backward(t, t, t, t, o2, l2)
    _bench._malloc_trim()
    if not _bench._reset_hwm():
        print("cannot reset VmHWM (/proc/self/clear_refs): no measurement")
        return 1
    base = _bench._proc_status_kb("VmRSS")["VmRSS"]
    sdpa_backward(g, q, k, v, out, lse, is_causal=args.causal)
    peak = _bench._proc_status_kb("VmHWM")["VmHWM"]
    grads = 3 * q.nbytes / 2**20
    growth = (peak - base) / 1024
    print(f"{'x'.join(map(str, args.shape))} causal={args.causal}: peak RSS growth {growth:.1f} MB, "
          f"gradients {grads:.1f} MB, extra {growth - grads:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
