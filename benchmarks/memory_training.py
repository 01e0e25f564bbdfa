"""Peak memory of ONE training step (forward + backward + Adam), fastattn
against torch, each library in a fresh process: the encoder and seq2seq
steps of benchmarks/test_bench_training.py, the same models, data and
weights.

In each process the model, data and optimizer are built and three steps run
(so the optimizer state exists and every buffer has been allocated once);
then free heap pages go back to the OS (glibc ``malloc_trim(0)``), VmHWM is
reset to the current RSS (``/proc/self/clear_refs``) and one more step runs:

    RSS before     = model, optimizer state, data, the library itself
    of it cached   = fastattn's block cache (fastattn.memory_cache_info():
                     the previous step's freed activations, kept for reuse)
    peak extra     = VmHWM after the step - (RSS before - of it cached)
                     (the step's activations, saved residuals, gradients and
                     temporaries)
    peak total     = VmHWM after the step

    python benchmarks/memory_training.py [--case encoder|seq2seq|all] [--threads N]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

CHILD = r"""
import gc, json, sys
sys.path.insert(0, {here!r})
import numpy as np
from fastattn import _bench
import test_bench_training as tb

case, impl = {case!r}, {impl!r}
if impl == "torch":
    torch = tb.torch
    if case == "encoder":
        x, mask, y = tb.encoder_data()
        _, step = tb.torch_encoder(tb.FastattnEncoder())
        args = (torch.from_numpy(x), torch.from_numpy(mask), torch.from_numpy(y))
    else:
        src, mask, tin, tout = tb.seq2seq_data()
        model, _ = tb.fastattn_seq2seq()
        step = tb.torch_seq2seq(model)
        args = tuple(torch.from_numpy(a) for a in (src, mask, tin, tout))
else:
    if case == "encoder":
        fa = tb.FastattnEncoder()
        step, args = fa.step, tb.encoder_data()
    else:
        _, step = tb.fastattn_seq2seq()
        args = tb.seq2seq_data()
for _ in range(3):
    step(*args)
gc.collect()
_bench._malloc_trim()
before = _bench._proc_status_kb("VmRSS")["VmRSS"]
import fastattn
cached = fastattn.memory_cache_info()["cached_bytes"] // 1024
ok = _bench._reset_hwm()
step(*args)
hwm = _bench._proc_status_kb("VmHWM")["VmHWM"]
print(json.dumps(dict(before_kb=before, hwm_kb=hwm, reset_ok=ok,
                      cached_kb=cached if impl == "fastattn" else 0)))
"""


def run(case, impl, threads):
    import fastattn   # the child imports the same fastattn as this process (installed or in place)
    env = dict(os.environ)
    parent = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))
    env["PYTHONPATH"] = parent + os.pathsep + env.get("PYTHONPATH", "")
    if threads:   # fastattn's default and the benchmarks' torch.set_num_threads follow it
        env["OMP_NUM_THREADS"] = str(threads)
    code = CHILD.format(here=HERE, case=case, impl=impl)
    # cwd: benchmarks/, so that "-c" does not put a source checkout first on the path
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=HERE, capture_output=True,
                         text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"{case}/{impl} failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="all", choices=("encoder", "seq2seq", "all"))
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        from fastattn import _bench
    except ImportError:  # run as a script from the checkout without an install
        sys.path.insert(0, ROOT)
        from fastattn import _bench
    impls = ["fastattn"] + (["torch"] if _bench.load_torch(1) is not None else [])
    cases = ["encoder", "seq2seq"] if args.case == "all" else [args.case]
    print(f"{'case':>8} {'library':>9} {'RSS before MB':>13} {'of it cached':>12} "
          f"{'peak extra MB':>13} {'peak total MB':>13}")
    for case in cases:
        for impl in impls:
            r = run(case, impl, args.threads)
            # fastattn's block cache (fastattn/_alloc.py) holds the previous
            # step's freed activations: they count as the step's, not as "before"
            base = r["before_kb"] - r["cached_kb"]
            extra = (r["hwm_kb"] - base) / 1024 if r["reset_ok"] else float("nan")
            print(f"{case:>8} {impl:>9} {r['before_kb'] / 1024:>13.1f} "
                  f"{r['cached_kb'] / 1024:>12.1f} {extra:>13.1f} {r['hwm_kb'] / 1024:>13.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
