"""float32 accuracy of the SDPA backward against torch's, and the floor set by its inputs.

    python benchmarks/accuracy_backward.py [--seeds 6] [--additive]

For 1 x 8 x L x 64 (L = 512 and 200, causal and not, a few seeds) the
errors of three float32 backwards against the float64 oracle
(fastattn._reference) are compared with torch's float32 autograd error on
the same inputs, as ratios (rms and max over each gradient):

* ``fastattn``: fastattn.functional.sdpa_backward from the float32 ``out``
  and ``lse`` of fastattn's forward;
* ``exact-from-f32``: every step in float64, from the same float32 ``out``
  and ``lse`` -- what any backward that receives these inputs can at best do;
* ``f32-S-dP``: the same with only S = scale Q K^T and dP = dO V^T rounded to
  float32 (the products fastattn shares with its forward / computes in
  float32);
* ``exact-from-torch``: every step in float64 from torch's own float32 ``out``
  and ``lse`` (``_scaled_dot_product_flash_attention_for_cpu``, the kernel
  torch's autograd ran): its max errors exceed torch's float32 backward's as
  often as fastattn's do -- torch's backward, rounding S and P as its forward
  did, partly cancels its forward's errors, which an exact backward cannot.

The max of one element over ~260 000 is an extreme value: its ratio varies
from case to case even where the rms ratio is steady.

``--additive``: the same comparison for additive attention (B=2, Lq=200,
Lk=230, d=32, d_a=64, dv=16, causal and not), rms ratios against torch
autograd (which keeps its float32 P, normalised from its own scores), for
fastattn's fused backward and for a float64 backward from fastattn's float32
``out`` and ``lse``.  Requires torch.
"""
from __future__ import annotations

import argparse

import numpy as np
import torch

import fastattn
from fastattn import _reference as R
from fastattn.functional import sdpa_backward


def _dense(g, q, k, v, o, lse, causal, f32_s_dp):
    sc = 1 / np.sqrt(q.shape[-1])
    kt = np.swapaxes(k, -1, -2)
    if f32_s_dp:
        s = (q @ (np.float32(sc) * kt)).astype(np.float64)
        dp = (g @ np.swapaxes(v, -1, -2)).astype(np.float64)
    q, k, v, g, o, lse = (x.astype(np.float64) for x in (q, k, v, g, o, lse))
    if not f32_s_dp:
        s = sc * q @ np.swapaxes(k, -1, -2)
        dp = g @ np.swapaxes(v, -1, -2)
    if causal:
        n = s.shape[-1]
        s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
    p = np.exp(s - lse[..., None])
    ds = p * (dp - np.sum(g * o, -1, keepdims=True))
    return sc * ds @ k, sc * np.swapaxes(ds, -1, -2) @ q, np.swapaxes(p, -1, -2) @ g


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=6)
    ap.add_argument("--additive", action="store_true", help="the additive attention comparison")
    args = ap.parse_args(argv)
    if args.additive:
        additive(max(1, args.seeds // 2 + 1))
        return
    names = ("fastattn", "exact-from-f32", "f32-S-dP", "exact-from-torch")
    stats = {n: [] for n in names}
    for seed in range(args.seeds):
        for L in (512, 200):
            for causal in (False, True):
                rng = np.random.default_rng(seed)
                q, k, v, g = (rng.standard_normal((1, 8, L, 64)).astype(np.float32)
                              for _ in range(4))
                ref = R.scaled_dot_product_attention_backward(g, q, k, v, None, causal)[:3]
                tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
                torch.nn.functional.scaled_dot_product_attention(
                    tq, tk, tv, is_causal=causal).backward(torch.from_numpy(g))
                tgrads = (tq.grad.numpy(), tk.grad.numpy(), tv.grad.numpy())
                o, lse = fastattn.scaled_dot_product_attention(q, k, v, None, causal,
                                                               return_lse=True)
                to, tlse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                    torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), 0.0, causal)[:2]
                runs = {"fastattn": sdpa_backward(g, q, k, v, o, lse, None, causal),
                        "exact-from-f32": _dense(g, q, k, v, o, lse, causal, False),
                        "f32-S-dP": _dense(g, q, k, v, o, lse, causal, True),
                        "exact-from-torch": _dense(g, q, k, v, to.numpy(), tlse.numpy(), causal,
                                                   False)}
                for n, got in runs.items():
                    row = []
                    for a, t, r in zip(got, tgrads, ref):
                        ea, et = a.astype(np.float64) - r, t.astype(np.float64) - r
                        row.append((np.sqrt(np.mean(ea ** 2)) / np.sqrt(np.mean(et ** 2)),
                                    np.abs(ea).max() / np.abs(et).max()))
                    stats[n].append(row)
    cases = len(stats["fastattn"])
    print(f"error / torch float32 autograd's error, {cases} cases "
          f"(seeds 0-{args.seeds - 1} x L 512, 200 x causal, not; 1 x 8 x L x 64)")
    print(f"{'backward':>15} {'grad':>4} {'rms min':>8} {'rms max':>8} {'max min':>8} "
          f"{'max max':>8} {'max > 1.25':>10}")
    for n in names:
        a = np.array(stats[n])  # cases x 3 x (rms, max)
        for i, gname in enumerate(("dq", "dk", "dv")):
            r, m = a[:, i, 0], a[:, i, 1]
            print(f"{n:>15} {gname:>4} {r.min():8.2f} {r.max():8.2f} {m.min():8.2f} "
                  f"{m.max():8.2f} {int(np.sum(m > 1.25)):>10}")


def additive(seeds):
    from fastattn.functional import attention_backward

    rows = {"fastattn": [], "exact-from-f32": []}
    names = ["dq", "dk", "dv", "W_q", "W_k", "v", "b"]
    for seed in range(seeds):
        for causal in (False, True):
            rng = np.random.default_rng(seed)
            f = np.float32
            B, L, S, d, da, dv = 2, 200, 230, 32, 64, 16
            q, k = rng.standard_normal((B, L, d)).astype(f), rng.standard_normal((B, S, d)).astype(f)
            v, g = rng.standard_normal((B, S, dv)).astype(f), rng.standard_normal((B, L, dv)).astype(f)
            params = {"W_q": (rng.standard_normal((da, d)) / np.sqrt(d)).astype(f),
                      "W_k": (rng.standard_normal((da, d)) / np.sqrt(d)).astype(f),
                      "v": rng.standard_normal(da).astype(f),
                      "b": (0.1 * rng.standard_normal(da)).astype(f)}
            vjp_of = lambda a, b_: R.score_additive_vjp(a, b_, params["W_q"], params["W_k"],
                                                        params["v"], params["b"])
            ref = R.attention_backward(g, q, k, v, vjp_of, None, causal)
            refs = list(ref[:3]) + [ref[3][n] for n in params]
            out, lse = fastattn.attention(q, k, v, "additive", params=params, is_causal=causal,
                                          return_lse=True)
            got = attention_backward(g, q, k, v, "additive", params=params, out=out, lse=lse,
                                     is_causal=causal)
            ours = list(got[:3]) + [got[3][n] for n in params]
            s, vjp = vjp_of(q, k)
            s = np.asarray(s, np.float64)
            if causal:
                s = np.where(np.tril(np.ones((L, S), bool)), s, -np.inf)
            P = np.exp(s - lse.astype(np.float64)[..., None])
            g64, v64, o64 = (x.astype(np.float64) for x in (g, v, out))
            ds = P * (g64 @ np.swapaxes(v64, -1, -2) - np.sum(g64 * o64, -1, keepdims=True))
            edq, edk, edp = vjp(ds)
            exact = [edq, edk, np.swapaxes(P, -1, -2) @ g64] + [edp[n] for n in params]
            tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
            tp = {n: torch.tensor(x, requires_grad=True) for n, x in params.items()}
            h = (tq @ tp["W_q"].T)[..., :, None, :] + (tk @ tp["W_k"].T)[..., None, :, :] + tp["b"]
            sc = torch.tanh(h) @ tp["v"]
            if causal:
                sc = sc.masked_fill(~torch.tril(torch.ones(L, S, dtype=torch.bool)), -np.inf)
            (torch.softmax(sc, -1) @ tv).backward(torch.tensor(g))
            auto = [t.grad.numpy() for t in (tq, tk, tv)] + [tp[n].grad.numpy() for n in params]
            rms = lambda a, r: float(np.sqrt(np.mean((np.asarray(a, np.float64) - r) ** 2)))
            rows["fastattn"].append([rms(a, r) / rms(t, r) for a, t, r in zip(ours, auto, refs)])
            rows["exact-from-f32"].append([rms(a, r) / rms(t, r) for a, t, r in zip(exact, auto, refs)])
    print(f"additive: rms error / torch float32 autograd's, {2 * seeds} cases; min-max per gradient")
    print(f"{'backward':>15} " + " ".join(f"{n:>10}" for n in names))
    for n, r in rows.items():
        a = np.array(r)
        print(f"{n:>15} " + " ".join(f"{lo:4.2f}-{hi:4.2f}" for lo, hi in zip(a.min(0), a.max(0))))


if __name__ == "__main__":
    main()
