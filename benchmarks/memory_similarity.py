"""Peak extra memory of ONE additive-attention call, per library, each in a fresh process.

Like benchmarks/memory.py: a new Python process per library imports it,
warms it on a tiny shape, allocates the inputs, returns free heap to the OS
(malloc_trim), resets VmHWM (/proc/self/clear_refs) and makes one call;

    peak extra = VmHWM after the call - VmRSS before it

(a 1 ms VmRSS sampler is the cross-check).  The output (B x T x d float32)
is part of every number.

    python benchmarks/memory_similarity.py [--impls fastattn,torch,keras,numpy] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
try:
    import fastattn  # noqa: F401
except ImportError:  # run from the checkout without an install
    sys.path.insert(0, os.path.dirname(HERE))

import similarity_impls as SI  # noqa: E402


def child(impl, case, n_threads):
    import gc
    import threading
    import time

    import numpy as np

    from fastattn import _bench

    if impl in ("torch", "keras"):
        import torch  # noqa: F401
    tiny = SI.SimCase(1, 8, case.d, case.d_a)
    w, _ = SI.make_callable(impl, *SI.make_data(tiny, seed=1), n_threads)
    w()
    del w
    q, k, v, P = SI.make_data(case)
    fn, to_np = SI.make_callable(impl, q, k, v, P, n_threads)
    gc.collect()
    _bench._malloc_trim()
    peak = [0]
    stop = threading.Event()
    page_kb = os.sysconf("SC_PAGE_SIZE") // 1024

    def sampler():
        with open("/proc/self/statm") as f:
            while not stop.is_set():
                f.seek(0)
                rss = int(f.read().split()[1]) * page_kb
                peak[0] = max(peak[0], rss)
                time.sleep(0.001)

    th = threading.Thread(target=sampler, daemon=True)
    th.start()
    time.sleep(0.05)
    ok = _bench._reset_hwm()
    before = _bench._proc_status_kb("VmRSS")["VmRSS"]
    peak[0] = before
    t0 = time.perf_counter()
    r = fn()
    el = time.perf_counter() - t0
    hwm = _bench._proc_status_kb("VmHWM")["VmHWM"]
    stop.set()
    th.join()
    out = np.asarray(to_np(r))
    return {"impl": impl, "case": list(case), "before_kb": before, "hwm_kb": hwm, "hwm_ok": ok,
            "sampled_kb": peak[0], "out_bytes": int(out.nbytes), "call_s": el}


def measure(impl, case, n_threads):
    """child() in a fresh process; returns its dict (None if the library is missing)."""
    if impl == "keras" and SI.load_keras() is None:
        return None
    import fastattn

    parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([parent, HERE, env.get("PYTHONPATH", "")])
    env.setdefault("KERAS_BACKEND", "torch")
    code = (f"import json, similarity_impls as SI, memory_similarity as M; "
            f"print(json.dumps(M.child({impl!r}, SI.SimCase(*{tuple(case)!r}), {n_threads})))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=600, cwd=parent)
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        raise RuntimeError(f"{impl} child failed: {p.stderr[-800:]}")
    return json.loads(lines[-1])


def extra_mb(r):
    return (r["hwm_kb"] - r["before_kb"]) / 1024.0


def main(argv=None):
    import fastattn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impls", default=",".join(SI.IMPLS))
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args(argv)
    nt = a.threads or fastattn.get_num_threads()
    print(f"peak extra RSS of one additive-attention call (float32, {nt} threads), fresh process per library")
    print(f"{'case':>28} {'library':>9} {'peak extra MB':>13} {'sampled MB':>10} {'output MB':>9} "
          f"{'call s':>7} {'fastattn / this':>15}")
    for case in SI.CASES:
        res = {i: measure(i, case, nt) for i in a.impls.split(",")}
        fa = res.get("fastattn")
        for impl, r in res.items():
            if r is None:
                print(f"{case.name:>28} {impl:>9} {'not installed':>13}")
                continue
            ratio = extra_mb(fa) / extra_mb(r) if fa and impl != "fastattn" else float("nan")
            print(f"{case.name:>28} {impl:>9} {extra_mb(r):>13.2f} "
                  f"{(r['sampled_kb'] - r['before_kb']) / 1024:>10.2f} {r['out_bytes'] / 2**20:>9.2f} "
                  f"{r['call_s']:>7.3f} {'' if impl == 'fastattn' else f'1/{1 / ratio:.0f}':>15}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
