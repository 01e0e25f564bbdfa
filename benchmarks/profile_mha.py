"""Where a default ``MultiHeadAttention`` call spends its time, part by part.

Run: ``python benchmarks/profile_mha.py [BxN,...] [threads] [budget_s] [peak_gflops]``
(default ``1x16,1x128 2 1.0``).  E = 512, H = 8, float32, self-attention, the
layer as a user gets it (``auto_pack`` on: the packed projection weights).
For each shape, each part is timed interleaved with the whole call (so both
see the same load) and printed as its median in microseconds, GFLOP/s and %
of the FMA peak:

* ``qkv``: the fused QKV projection (``(B*N, 512) x (512, 1536)``, packed kernel);
* ``attn``: the attention kernel on the head views (``_sdpa_canonical``);
* ``out``: the output projection (``(B*N, 512) x (512, 512)``, packed kernel);
* ``rest``: the whole call minus the three (argument checks, buffers, head
  views, Python);
* ``sgemm qkv`` / ``sgemm out``: SciPy's OpenBLAS ``sgemm`` on the same
  shapes, preallocated output, same thread count: the BLAS reference.

The peak: ``peak_gflops`` if given, else fastattn's FMA probe
(``_bench.fma_peak_gflops``, the report's %peak column).
"""
import sys

import numpy as np
from scipy.linalg import blas

from fastattn import _bench, _multihead, _sdpa
from fastattn.layers import MultiHeadAttention

E, H = 512, 8
dh = E // H
SHAPES = sys.argv[1] if len(sys.argv) > 1 else "1x16,1x128"
NT = int(sys.argv[2]) if len(sys.argv) > 2 else 2
BUDGET = float(sys.argv[3]) if len(sys.argv) > 3 else 1.0
PEAK = float(sys.argv[4]) if len(sys.argv) > 4 else _bench.fma_peak_gflops(NT)
SRC = "given" if len(sys.argv) > 4 else "fastattn's FMA probe"

m = MultiHeadAttention(E, H, seed=0)
rng = np.random.default_rng(1)
m.load_state_dict({k: (rng.standard_normal(a.shape) * 0.05).astype(np.float32)
                   for k, a in m.params.items()})
print(f"E={E} H={H} float32, {NT} threads; FMA peak {PEAK:.0f} GFLOP/s ({SRC})")
for s in SHAPES.split(","):
    B, N = (int(v) for v in s.split("x"))
    M = B * N
    x = rng.standard_normal((B, N, E)).astype(np.float32)
    m(x, n_threads=NT)
    w = m._prepared_weights()
    assert w.packed is not None, "no packed weights (SIMD off?)"
    p = w.p
    qkv = _multihead._linear(x, p.w_qkv, p.b_qkv, 3 * E, NT, w.packed.qkv)
    hv = qkv.reshape(B, N, 3, H, dh).transpose(2, 0, 3, 1, 4)
    attn = np.empty((B, N, E), np.float32)
    out_view = attn.reshape(B, N, H, dh).transpose(0, 2, 1, 3)
    scale = 1.0 / np.sqrt(dh)
    wq_f = np.asfortranarray(p.w_qkv.T)          # (E, 3E)
    wo_f = np.asfortranarray(p.w_out.T)
    xa = np.asfortranarray(x.reshape(M, E))
    c_qkv = np.zeros((M, 3 * E), np.float32, order="F")
    c_out = np.zeros((M, E), np.float32, order="F")
    parts = {
        "qkv": (lambda: _multihead._linear(x, p.w_qkv, p.b_qkv, 3 * E, NT, w.packed.qkv),
                2.0 * M * E * 3 * E),
        "attn": (lambda: _sdpa._sdpa_canonical(hv[0], hv[1], hv[2], None, (B, H), False, 0,
                                               scale, out_view, False, NT),
                 4.0 * B * H * N * N * dh),
        "out": (lambda: _multihead._linear(attn, p.w_out, p.b_out, E, NT, w.packed.out),
                2.0 * M * E * E),
    }
    layer = lambda: m(x, n_threads=NT)  # noqa: E731
    med, total = {}, []
    for name, (fn, _) in parts.items():
        tp, tl = _bench.interleaved(fn, layer, BUDGET, 10)
        med[name] = np.median(tp)
        total.append(np.median(tl))
    with _bench.blas_threads(NT, which=("scipy",)):
        for name, c, b_ in (("sgemm qkv", c_qkv, wq_f), ("sgemm out", c_out, wo_f)):
            fn = lambda c=c, b_=b_: blas.sgemm(1.0, xa, b_, beta=0.0, c=c, overwrite_c=1)  # noqa: E731
            tp, tl = _bench.interleaved(fn, layer, BUDGET, 10)
            med[name] = np.median(tp)
            total.append(np.median(tl))
    whole = float(np.median(total))
    med["rest"] = whole - med["qkv"] - med["attn"] - med["out"]
    flops = {k: f for k, (_, f) in parts.items()}
    flops["sgemm qkv"], flops["sgemm out"] = flops["qkv"], flops["out"]
    print(f"({B},{N}) whole call {whole:8.1f} us  "
          f"({sum(flops[k] for k in ('qkv', 'attn', 'out')) / whole / 1e3:.0f} GFLOP/s)")
    for name in ("qkv", "sgemm qkv", "attn", "out", "sgemm out", "rest"):
        t = med[name]
        if name in flops:
            g = flops[name] / t / 1e3
            print(f"  {name:10s} {t:8.1f} us  {g:6.0f} GFLOP/s  {100 * g / PEAK:5.1f} % of peak")
        else:
            print(f"  {name:10s} {t:8.1f} us  ({100 * t / whole:.0f} % of the call)")
    sys.stdout.flush()
