"""Table of the additive-attention benchmarks from a pytest-benchmark JSON file.

    pytest benchmarks/test_bench_similarity.py --benchmark-only --benchmark-json=bench.json
    python benchmarks/report_similarity.py --json bench.json

Columns: median ms of fastattn, torch, keras, numpy; fa/peer = fastattn's
median / the faster of torch and keras (target <= 0.33); fastattn's float32
error relative to the float64 oracle (target <= 1e-5).
"""
from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", required=True)
    a = ap.parse_args(argv)
    with open(a.json) as f:
        data = json.load(f)
    rows, sims = {}, []
    for b in data["benchmarks"]:
        info = b.get("extra_info", {})
        med = b["stats"]["median"]
        if info.get("kind") == "similarity_peer" or "case" in info:
            r = rows.setdefault(tuple(info["case"]), {})
            r[info["impl"]] = med
            if info["impl"] == "fastattn":
                r["err"] = info.get("rel_err")
                r["load"] = info.get("other_cores")
        elif info.get("kind") == "similarity":
            sims.append((info["similarity"], info.get("path"), med))
    print(f"{'case (B x T x T, d, d_a), float32':>36} {'fastattn ms':>11} {'torch ms':>9} "
          f"{'keras ms':>9} {'numpy ms':>9} {'fa/peer':>8} {'fa rel err':>10}")
    for case, r in rows.items():
        B, T, d, da = case
        peers = [r[p] for p in ("torch", "keras") if p in r]
        ratio = r["fastattn"] / min(peers) if peers and "fastattn" in r else float("nan")

        def ms(key):
            return f"{r[key] * 1e3:.2f}" if key in r else "n/a"
        print(f"{f'{B}x{T}x{T}, d={d}, d_a={da}':>36} {ms('fastattn'):>11} {ms('torch'):>9} "
              f"{ms('keras'):>9} {ms('numpy'):>9} {ratio:>8.3f} {r.get('err', float('nan')):>10.2e}")
    if sims:
        print()
        print(f"{'similarity (4x256x256, d=64)':>30} {'path':>6} {'median ms':>10}")
        for name, path, med in sims:
            print(f"{name:>30} {path:>6} {med * 1e3:>10.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
