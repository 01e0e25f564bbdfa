"""One table: fastattn against torch, onnxruntime and NumPy, with GEMM as the yardstick.

Usage (from the checkout, after ``python setup.py build_ext --inplace``)::

    # from a pytest-benchmark run (medians of that run, its sgemm/dgemm groups)
    pytest benchmarks/ --benchmark-only --benchmark-json=bench.json
    python benchmarks/report.py --json bench.json

    # or with its own timing loop (fastattn._bench.measure_case), no pytest
    python benchmarks/report.py [--budget 0.2] [--threads N] [--no-torch] [--no-ort] [--wait-quiet]

Columns: shape, causal, dtype; median µs per call of fastattn, torch, ort
(onnxruntime, opset-23 ``Attention``) and numpy; ``fa/peer`` = fastattn's
time divided by the faster of torch and ort (< 1 means fastattn is
faster); fastattn's GFLOP/s with flops = 4·B·H·N²·d (halved for causal); and
that as a percentage of the same run's SciPy-OpenBLAS sgemm (float32 rows)
or dgemm (float64 rows) GFLOP/s on 2048×2048 at fastattn's thread count.
``python -m fastattn bench`` prints the same table for a few shapes.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

try:
    from fastattn import _bench
except ImportError:  # run as a script from the checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fastattn import _bench


def rows_from_json(path):
    """``(rows, gemm, header)`` from a pytest-benchmark JSON file."""
    with open(path) as f:
        data = json.load(f)
    cases, gemm, threads, load, gemm_load = {}, {}, set(), {}, {}
    peak = None
    for b in data.get("benchmarks", []):
        info = b.get("extra_info", {})
        median = b["stats"]["median"]
        if info.get("kind") == "gemm":
            gemm[info["dtype"]] = info["flops"] / median / 1e9
            gemm_load[info["dtype"]] = info.get("other_cores")
            continue
        if info.get("kind") == "fma_peak":
            peak = info["flops"] / median / 1e9 if info.get("flops") else None
            continue
        if "impl" not in info or "shape" not in info:
            continue
        case = _bench.Case(tuple(info["shape"]), info["dtype"], bool(info["causal"]))
        cases.setdefault(case, {})[info["impl"]] = median
        threads.add(info.get("threads"))
        if info.get("other_cores") is not None:
            load[case] = max(load.get(case) or 0.0, info["other_cores"])
    order = {c: i for i, c in enumerate(_bench.SUITE_CASES)}
    rows = [{"case": c, "times": {impl: t.get(impl) for impl in _bench.IMPLS},
             "check": "asserted", "other_cores": load.get(c)}
            for c, t in sorted(cases.items(), key=lambda kv: (order.get(kv[0], len(order)),
                                                              kv[0]))]
    mi = data.get("machine_info", {})
    header = [f"from {path}: pytest-benchmark medians, {data.get('datetime', '?')}, "
              f"{mi.get('cpu', {}).get('brand_raw', mi.get('processor', '?'))}, "
              f"thread count(s) {sorted(t for t in threads if t is not None)}",
              "gemm: " + (", ".join(f"{'s' if k == 'float32' else 'd'}gemm {v:.1f} GFLOP/s"
                                    for k, v in gemm.items()) or "not in this run"),
              "FMA peak: " + (f"float32 {peak:.1f} GFLOP/s, float64 {peak / 2:.1f} "
                              "(fastattn._kernels.fma_probe on the same threads)"
                              if peak else "not in this run")]
    loaded = [f"{'s' if k == 'float32' else 'd'}gemm" for k, v in gemm_load.items()
              if v is not None and v > _bench.LOADED_CORES]
    if loaded:
        header.append(f"warning: {', '.join(loaded)} measured on a loaded machine: %gemm is inflated")
    return rows, _bench.add_peak(gemm, peak), header


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="pytest-benchmark JSON (--benchmark-json) to report; "
                                   "without it a timing loop runs here")
    ap.add_argument("--budget", type=float, default=0.2,
                    help="seconds of timing per implementation and case (own loop)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads for every library (default fastattn.get_num_threads())")
    ap.add_argument("--no-torch", dest="torch", action="store_false")
    ap.add_argument("--no-ort", dest="ort", action="store_false")
    ap.add_argument("--wait-quiet", action="store_true",
                    help="first wait until other processes leave the CPUs idle")
    args = ap.parse_args(argv)
    if args.wait_quiet:
        _bench.wait_quiet(file=sys.stderr)
    if args.json:
        rows, gemm, header = rows_from_json(args.json)
        for line in _bench.format_report(rows, gemm, sys.stdout, header):
            print(line)
        return 0
    return _bench.run_bench(cases=_bench.SUITE_CASES, budget=args.budget,
                            use_torch=args.torch, use_ort=args.ort, n_threads=args.threads)


if __name__ == "__main__":
    sys.exit(main())
