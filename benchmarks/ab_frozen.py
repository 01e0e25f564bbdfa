"""A/B of MultiHeadAttention reading its weights in place (``auto_pack = False``) vs frozen
(``freeze()``: prepacked projection weights, as the default layer's since auto-packing).

Run: ``python benchmarks/ab_frozen.py [BxN,BxN,...] [threads] [budget_s]``
(default ``1x16,1x128,8x128,4x512 2 2.0``).  E = 512, H = 8, float32,
self-attention.  For each shape it alternates single calls of the unfrozen
and the frozen layer's QKV projection, output projection and whole forward
for ``budget_s`` seconds each and prints the minimum and median in
microseconds (alternating keeps both sides under the same load).
"""
import copy, sys
import numpy as np
from fastattn import _bench, _multihead
from fastattn.layers import MultiHeadAttention
E, H = 512, 8
NT = int(sys.argv[2]) if len(sys.argv) > 2 else 2
BUDGET = float(sys.argv[3]) if len(sys.argv) > 3 else 2.0
m = MultiHeadAttention(E, H, seed=0)
rng = np.random.default_rng(1)
m.load_state_dict({k: (rng.standard_normal(a.shape) * 0.05).astype(np.float32) for k, a in m.params.items()})
f = copy.deepcopy(m).freeze()
m.auto_pack = False   # the in-place side (the default layer packs, as f does)
pm, pf = m._prepared_weights(), f._prepared_weights()
for s in (sys.argv[1] if len(sys.argv) > 1 else "1x16,1x128,8x128,4x512").split(","):
    B, N = (int(v) for v in s.split("x"))
    x = rng.standard_normal((B, N, E)).astype(np.float32)
    attn = rng.standard_normal((B, N, E)).astype(np.float32)
    cases = {
        "qkv": (lambda: _multihead._linear(x, pm.p.w_qkv, pm.p.b_qkv, 3 * E, NT),
                lambda: _multihead._linear(x, pf.p.w_qkv, pf.p.b_qkv, 3 * E, NT, pf.packed.qkv)),
        "out": (lambda: _multihead._linear(attn, pm.p.w_out, pm.p.b_out, E, NT),
                lambda: _multihead._linear(attn, pf.p.w_out, pf.p.b_out, E, NT, pf.packed.out)),
        "layer": (lambda: m(x, n_threads=NT), lambda: f(x, n_threads=NT)),
    }
    for name, (a, b) in cases.items():
        ta, tb = _bench.interleaved(a, b, BUDGET, 10)
        print(f"({B},{N}) {name:5s} n={len(ta):5d} unfrozen min {ta.min():8.1f} med {np.median(ta):8.1f} | "
              f"frozen min {tb.min():8.1f} med {np.median(tb):8.1f} us | med ratio x{np.median(ta) / np.median(tb):.2f}",
              flush=True)
