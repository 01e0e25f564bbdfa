"""The forward + backward table from a run of benchmarks/test_bench_sdpa_backward.py.

    pytest benchmarks/test_bench_sdpa_backward.py --benchmark-only --benchmark-json=bwd.json
    python benchmarks/report_backward.py --json bwd.json

Columns: case; median ms of fastattn, torch and numpy (forward with lse +
backward); fa/torch; fastattn's GFLOP/s (flops: 14·B·H·N²·d, halved with
causality: the forward's two products and the backward's five) and that as a
share of the same run's sgemm / dgemm 2048; the busiest other-process load
seen during the case's benchmarks.
"""
from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    with open(args.json) as f:
        data = json.load(f)
    gemm, rows, flops, load = {}, {}, {}, {}
    for b in data.get("benchmarks", []):
        info, med = b.get("extra_info", {}), b["stats"]["median"]
        if info.get("kind") == "gemm":
            gemm[info["dtype"]] = info["flops"] / med / 1e9
        elif info.get("kind") == "sdpa_bwd":
            key = ("x".join(map(str, info["shape"])), "yes" if info["causal"] else "no", info["dtype"])
            rows.setdefault(key, {})[info["impl"]] = med
            flops[key] = info["flops"]
            load[key] = max(load.get(key, 0.0), info.get("other_cores") or 0.0)
    print(f"from {args.json} ({data.get('datetime', '?')}); gemm 2048: "
          + ", ".join(f"{'s' if k == 'float32' else 'd'}gemm {v:.1f} GFLOP/s" for k, v in gemm.items()))
    print(f"{'BxHxNxd':>14} {'causal':>6} {'dtype':>8} {'fastattn ms':>12} {'torch ms':>10} "
          f"{'numpy ms':>10} {'fa/torch':>9} {'GFLOP/s':>8} {'%gemm':>6} {'load':>5}")
    for key, t in rows.items():
        fa, th, npy = t.get("fastattn"), t.get("torch"), t.get("numpy")
        gf = flops[key] / fa / 1e9 if fa else None
        g = gemm.get(key[2])
        cell = lambda x: f"{x * 1e3:.2f}" if x else "-"
        print(f"{key[0]:>14} {key[1]:>6} {key[2]:>8} {cell(fa):>12} {cell(th):>10} {cell(npy):>10} "
              f"{(f'{fa / th:.2f}x' if fa and th else '-'):>9} {(f'{gf:.1f}' if gf else '-'):>8} "
              f"{(f'{100 * gf / g:.0f}%' if gf and g else '-'):>6} {load[key]:>5.2f}")
    print("fa/torch < 1: fastattn is faster. load: other processes' busy cores during the case")


if __name__ == "__main__":
    main()
