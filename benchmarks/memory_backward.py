"""Peak extra memory of one sdpa_backward call (1 x 8 x 4096 x 64, float32), in this process.

    python benchmarks/memory_backward.py [--causal]
    python benchmarks/memory_backward.py --additive [--threads N]

``--additive``: one training step of additive attention as
benchmarks/test_bench_backward_ops.py times it (B=8, Tq=Tk=256, d=d_a=128,
float32: forward with lse, then attention_backward; torch: the broadcast
(B, Tq, Tk, d_a) formulation and autograd), each library in a fresh Python
process: import, warm up on a tiny shape, make the inputs, malloc_trim, reset
VmHWM, run the step once.  Printed per library: peak extra = VmHWM after -
VmRSS before (the returned gradients, 4 MB, are part of both numbers), and
fastattn's as a fraction of torch's.

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


AB, AT, AD = 8, 256, 128


def _additive_data(B, T, D):
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, T, D), dtype=np.float32) for _ in range(4))
    p = fastattn.get_similarity("additive").init_params(D, D, d_a=D, rng=2, dtype=np.float32)
    p["b"] = rng.standard_normal(D).astype(np.float32) * 0.1
    return q, k, v, p, g


def _additive_step(impl, q, k, v, p, g):
    """One forward + backward; returns the gradients as NumPy arrays."""
    if impl == "fastattn":
        from fastattn.functional import attention_backward
        out, lse = fastattn.attention(q, k, v, "additive", params=p, return_lse=True)
        dq, dk, dv, dp = attention_backward(g, q, k, v, "additive", params=p, out=out, lse=lse)
        return [dq, dk, dv] + list(dp.values())
    import torch
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tp = {n: torch.from_numpy(a).requires_grad_() for n, a in p.items()}
    h = torch.tanh((tq @ tp["W_q"].T)[:, :, None, :] + (tk @ tp["W_k"].T)[:, None, :, :]
                   + tp["b"])
    out = torch.softmax(h @ tp["v"], dim=-1) @ tv
    out.backward(torch.from_numpy(g))
    return [t.grad.numpy() for t in (tq, tk, tv, *tp.values())]


def additive_child(impl, n_threads):
    """Measure one step in this (fresh) process; returns a dict."""
    import gc
    import json
    import time
    fastattn.set_num_threads(n_threads)
    if impl == "torch":
        import torch
        torch.set_num_threads(n_threads)
    _additive_step(impl, *_additive_data(1, 8, 16))
    data = _additive_data(AB, AT, AD)
    gc.collect()
    _bench._malloc_trim()
    for _ in range(20):   # (the pool's workers may still be settling)
        ok = _bench._reset_hwm()
        if ok:
            break
        time.sleep(0.05)
    before = _bench._proc_status_kb("VmRSS")["VmRSS"]
    grads = _additive_step(impl, *data)
    hwm = _bench._proc_status_kb("VmHWM")["VmHWM"]
    print(json.dumps({"impl": impl, "before_kb": before, "hwm_kb": hwm, "hwm_ok": ok,
                      "grads_bytes": int(sum(a.nbytes for a in grads))}))


def additive_main(n_threads):
    import json
    import subprocess
    parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([parent, here, env.get("PYTHONPATH", "")])
    res = {}
    for impl in ("fastattn", "torch"):
        code = f"import memory_backward as M; M.additive_child({impl!r}, {n_threads})"
        pr = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=600, cwd=parent)
        lines = [ln for ln in pr.stdout.splitlines() if ln.startswith("{")]
        if pr.returncode or not lines:
            print(f"{impl}: child failed: {pr.stderr[-500:]}")
            continue
        r = json.loads(lines[-1])
        if not r["hwm_ok"]:
            print(f"{impl}: cannot reset VmHWM (/proc/self/clear_refs): no measurement")
            continue
        res[impl] = (r["hwm_kb"] - r["before_kb"]) / 1024
        print(f"additive {AB}x{AT}x{AT} d=d_a={AD} float32, {n_threads} threads, forward + "
              f"backward: {impl:>8} peak extra RSS {res[impl]:8.1f} MB "
              f"(gradients {r['grads_bytes'] / 2**20:.1f} MB)")
    if len(res) == 2 and res["torch"] > 0:
        print(f"fastattn / torch = {res['fastattn'] / res['torch']:.4f} "
              f"(1/{res['torch'] / max(res['fastattn'], 1e-9):.0f})")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--shape", type=_bench.parse_shape, default=(1, 8, 4096, 64))
    ap.add_argument("--additive", action="store_true",
                    help="additive attention's training step, fastattn vs torch autograd")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    if args.additive:
        return additive_main(args.threads or fastattn.get_num_threads())
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
