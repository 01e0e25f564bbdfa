"""Benchmarks of training the other ops: forward + backward of a GRU layer and of
additive (Bahdanau) attention, against torch autograd in the same run.

* ``gru``: B=32, T=64, E=H=256, float32, zero initial state, a random upstream
  gradient on every output.  fastattn: ``linear`` (input projection),
  ``rnn_scan(..., return_gates=True)`` (the training forward: it keeps the
  hidden products, as torch keeps its gates), ``rnn_scan_backward(...,
  gates=)``, ``linear_backward``; torch:
  ``torch.nn.GRU(batch_first=True)`` forward and ``backward`` (its CPU kernels).
* ``additive``: B=8, Tq=Tk=256, d=d_a=128, float32.  fastattn:
  ``attention(..., "additive", return_lse=True)`` and ``attention_backward``
  (the fused C backward); torch: ``v . tanh(q W_q^T + k W_k^T + b)`` by
  broadcasting (the usual Bahdanau implementation, a (B, Tq, Tk, d_a) tensor),
  softmax, ``@ value`` and autograd.

Each implementation's gradients are checked against the other's outside the
timing (float32 tolerances).  Both libraries at fastattn's thread count.

    pytest benchmarks/test_bench_backward_ops.py --benchmark-only
"""
from __future__ import annotations


import numpy as np
import pytest

import fastattn
from fastattn import _bench
from fastattn.functional import (attention_backward, linear, linear_backward, rnn_scan,
                                 rnn_scan_backward)

pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)


# ------------------------------------------------------------------ GRU
B, T, E, H = 32, 64, 256, 256


def gru_data():
    rng = np.random.default_rng(0)
    s = 1 / np.sqrt(H)
    w = {"w_ih": rng.uniform(-s, s, (3 * H, E)), "b_ih": rng.uniform(-s, s, 3 * H),
         "w_hh": rng.uniform(-s, s, (3 * H, H)), "b_hh": rng.uniform(-s, s, 3 * H)}
    w = {n: a.astype(np.float32) for n, a in w.items()}
    x = rng.standard_normal((B, T, E), dtype=np.float32)
    g = rng.standard_normal((B, T, H), dtype=np.float32)
    return x, w, g


def fastattn_gru(x, w, g):
    h0 = np.zeros((B, H), np.float32)

    def run():
        xw = linear(x, w["w_ih"], w["b_ih"])
        out, _, _, gates = rnn_scan(xw, w["w_hh"], w["b_hh"], h0, cell="gru", return_gates=True)
        dxw, dwhh, dbhh, _, _ = rnn_scan_backward(g, None, xw, w["w_hh"], w["b_hh"], h0, out,
                                                  cell="gru", gates=gates)
        dx, dwih, dbih = linear_backward(dxw, x, w["w_ih"], w["b_ih"])
        return dx, dwih, dbih, dwhh, dbhh
    return run


def torch_gru(x, w, g):
    layer = torch.nn.GRU(E, H, batch_first=True)
    with torch.no_grad():
        for name, key in (("weight_ih_l0", "w_ih"), ("bias_ih_l0", "b_ih"),
                          ("weight_hh_l0", "w_hh"), ("bias_hh_l0", "b_hh")):
            getattr(layer, name).copy_(torch.from_numpy(w[key]))
    tx = torch.from_numpy(x).requires_grad_()
    tg = torch.from_numpy(g)

    def run():
        layer.zero_grad()
        tx.grad = None
        out, _ = layer(tx)
        out.backward(tg)
        return (tx.grad.numpy(), layer.weight_ih_l0.grad.numpy(), layer.bias_ih_l0.grad.numpy(),
                layer.weight_hh_l0.grad.numpy(), layer.bias_hh_l0.grad.numpy())
    return run


# ------------------------------------------------------------- additive
AB, AT, AD = 8, 256, 128


def additive_data():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((AB, AT, AD), dtype=np.float32) for _ in range(3))
    p = fastattn.get_similarity("additive").init_params(AD, AD, d_a=AD, rng=2, dtype=np.float32)
    p["b"] = rng.standard_normal(AD).astype(np.float32) * 0.1
    g = rng.standard_normal((AB, AT, AD), dtype=np.float32)
    return q, k, v, p, g


def fastattn_additive(q, k, v, p, g):
    def run():
        out, lse = fastattn.attention(q, k, v, "additive", params=p, return_lse=True)
        dq, dk, dv, dp = attention_backward(g, q, k, v, "additive", params=p, out=out, lse=lse)
        return dq, dk, dv, dp["W_q"], dp["W_k"], dp["v"]
    return run


def torch_additive(q, k, v, p, g):
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    tp = {n: torch.from_numpy(a).requires_grad_() for n, a in p.items()}
    tg = torch.from_numpy(g)

    def run():
        for t in (tq, tk, tv, *tp.values()):
            t.grad = None
        h = torch.tanh((tq @ tp["W_q"].T)[:, :, None, :] + (tk @ tp["W_k"].T)[:, None, :, :]
                       + tp["b"])
        s = h @ tp["v"]
        out = torch.softmax(s, dim=-1) @ tv
        out.backward(tg)
        return (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy(), tp["W_q"].grad.numpy(),
                tp["W_k"].grad.numpy(), tp["v"].grad.numpy())
    return run


CASES = {"gru": (gru_data, fastattn_gru, torch_gru),
         "additive": (additive_data, fastattn_additive, torch_additive)}


def _params():
    for name in CASES:
        for impl in ("fastattn", "torch"):
            marks = [pytest.mark.benchmark(group=f"train {name}")]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            yield pytest.param(name, impl, id=f"{name}-{impl}", marks=marks)


@pytest.mark.parametrize(("name", "impl"), list(_params()))
def test_forward_backward(benchmark, name, impl):
    make, fa, th = CASES[name]
    data = make()
    benchmark.extra_info.update(kind="train_op", case=name, impl=impl, threads=N_THREADS)
    fn = (fa if impl == "fastattn" else th)(*data)
    if torch is not None:   # the two libraries' gradients agree (checked before timing)
        other = (th if impl == "fastattn" else fa)(*data)
        for a, b in zip(fn(), other()):
            np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4 * max(1.0, np.abs(b).max()))
        _bench.quiesce()
    _bench.time_benchmark(benchmark, fn)
