"""Additive (Bahdanau) attention implementations compared by
test_bench_similarity.py and memory_similarity.py.

Every implementation computes, for float32 inputs q, k (B, T, d), v (B, T, dv)
and parameters W_q, W_k (d_a, d), b, v_a (d_a,):

    softmax_j( v_a . tanh(W_q q_i + b + W_k k_j) ) @ v

* ``fastattn``: ``fastattn.attention(q, k, v, "additive", params=...)``;
* ``torch``: the usual PyTorch Bahdanau module,
  ``V(tanh(W1(q)[:, :, None] + W2(k)[:, None]))``, softmax, ``@ v``
  (``torch.set_num_threads(n)``, ``torch.inference_mode``);
* ``keras``: ``keras.layers.AdditiveAttention(use_scale=True)`` (Keras 3,
  torch backend) on inputs projected with ``keras.ops.matmul`` inside the
  timed call, ``scale = v_a`` (its score is ``sum(scale * tanh(q + k))``);
* ``numpy``: the same dense formula in NumPy float32 (BLAS held at n threads).

Each returns ``(callable, to_numpy)``.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import numpy as np

IMPLS = ("fastattn", "torch", "keras", "numpy")


class SimCase(NamedTuple):
    B: int
    T: int
    d: int
    d_a: int

    @property
    def name(self):
        return f"{self.B}x{self.T}x{self.T}-d{self.d}-da{self.d_a}"

    @property
    def group(self):
        return f"additive {self.B}x{self.T}x{self.T} d={self.d} d_a={self.d_a} float32"


CASES = (SimCase(8, 256, 128, 128), SimCase(1, 1024, 64, 64))


def make_data(case: SimCase, seed=0):
    """q, k, v, params: fastattn.testing.make_inputs (so benchmark_similarity with
    the same seed sees the same inputs) plus a small bias b."""
    from fastattn import testing

    q, k, v, P = testing.make_inputs("additive", batch=case.B, Lq=case.T, d=case.d,
                                     d_a=case.d_a, dtype="float32", seed=seed)
    P["b"] = (0.1 * np.random.default_rng(seed + 1).standard_normal(case.d_a)).astype(np.float32)
    return q, k, v, P


def oracle(q, k, v, P, rows=16):
    """float64 result, computed over query chunks (never the full 4-D tensor)."""
    from fastattn import _reference as R

    out = np.empty(q.shape[:-1] + (v.shape[-1],))
    for i0 in range(0, q.shape[-2], rows):
        qs = q[..., i0:i0 + rows, :]
        s = R.score_additive(qs, k, P["W_q"], P["W_k"], P["v"], P["b"])
        out[..., i0:i0 + rows, :] = R.attention(qs, k, v, lambda a, b: s)
    return out


def load_keras():
    os.environ.setdefault("KERAS_BACKEND", "torch")
    try:
        import keras
    except Exception:
        return None
    if keras.backend.backend() != "torch":
        return None
    return keras


def make_callable(impl, q, k, v, P, n_threads):
    if impl == "fastattn":
        import fastattn

        def run():
            return fastattn.attention(q, k, v, "additive", params=P, n_threads=n_threads)
        return run, np.asarray

    if impl == "numpy":
        Wq_t, Wk_t, b, va = P["W_q"].T.copy(), P["W_k"].T.copy(), P["b"], P["v"]

        def run():
            qp = q @ Wq_t + b
            kp = k @ Wk_t
            s = np.tanh(qp[:, :, None, :] + kp[:, None, :, :]) @ va
            s -= s.max(axis=-1, keepdims=True)
            np.exp(s, out=s)
            s /= s.sum(axis=-1, keepdims=True)
            return s @ v
        return run, np.asarray

    import torch

    torch.set_num_threads(n_threads)
    if impl == "torch":
        d, d_a = q.shape[-1], P["W_q"].shape[0]
        W1 = torch.nn.Linear(d, d_a, bias=True)
        W2 = torch.nn.Linear(d, d_a, bias=False)
        V = torch.nn.Linear(d_a, 1, bias=False)
        with torch.no_grad():
            W1.weight.copy_(torch.from_numpy(P["W_q"]))
            W1.bias.copy_(torch.from_numpy(P["b"]))
            W2.weight.copy_(torch.from_numpy(P["W_k"]))
            V.weight.copy_(torch.from_numpy(P["v"])[None, :])
        tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))

        def run():
            with torch.inference_mode():
                scores = V(torch.tanh(W1(tq)[:, :, None] + W2(tk)[:, None])).squeeze(-1)
                return torch.softmax(scores, dim=-1) @ tv
        return run, lambda r: r.numpy()

    if impl == "keras":
        keras = load_keras()
        layer = keras.layers.AdditiveAttention(use_scale=True)
        ops = keras.ops
        tq, tk, tv = (ops.convert_to_tensor(a) for a in (q, k, v))
        wq_t, wk_t = ops.convert_to_tensor(P["W_q"].T.copy()), ops.convert_to_tensor(P["W_k"].T.copy())
        b = ops.convert_to_tensor(P["b"])
        layer([tq[:, :2] @ wq_t, tv[:, :2], tk[:, :2] @ wk_t])  # build
        layer.scale.assign(P["v"])

        def run():
            with torch.no_grad():
                qp = ops.matmul(tq, wq_t) + b
                kp = ops.matmul(tk, wk_t)
                return layer([qp, tv, kp])
        return run, lambda r: ops.convert_to_numpy(r)

    raise ValueError(impl)
