"""Benchmarks of the multi-head attention layer forward against its peers.

Self-attention, E = 512, H = 8, float32, one pytest-benchmark group per
(B, N) in :data:`SHAPES`.  Every implementation uses the same weights (a
seeded ``fastattn.layers.MultiHeadAttention`` with non-zero biases):

* ``fastattn``: ``layer(x)``, the layer as a user gets it (``auto_pack``: its
  first call packs the projection weights for the projection kernel);
* ``fastattn_frozen``: the same layer after ``freeze()`` (read-only weights,
  packed as well);
* ``fastattn_weights`` (at (8, 128) only): ``layer(x, return_weights=True)``,
  the head-averaged weights computed on the same kernel;
* ``numpy``: plain NumPy in float32 (packed QKV GEMM, head split, softmax,
  output GEMM: :func:`numpy_mha`), NumPy's OpenBLAS held at fastattn's thread
  count;
* ``torch``: ``torch.nn.MultiheadAttention(batch_first=True)`` in ``eval()``,
  ``need_weights=False`` (its fast path), under ``torch.inference_mode()``,
  ``torch.set_num_threads`` = fastattn's thread count;
* ``ort``: onnxruntime running the fused ``com.microsoft.Attention`` contrib
  operator (packed QKV weights ``(E, 3E)`` + bias as initializers) followed by
  ``MatMul``/``Add`` for the output projection (:class:`OrtMHA`):
  ``intra_op_num_threads`` = fastattn's thread count, ``inter_op_num_threads=1``,
  input and a preallocated output bound once with IOBinding, so the timed call
  is only ``session.run_with_iobinding``.

Each result is checked, outside the timing, against the float64 oracle
(``fastattn._reference.multi_head_attention``), and fastattn's output against
torch's: max abs difference <= 1e-5 (recorded as ``extra_info["max_abs_diff_torch"]``).
Each benchmark is followed by a rest (``_bench.quiesce``) so worker threads
still spinning from one library do not slow the next one down.

    python -m pytest benchmarks/test_bench_mha.py --benchmark-only
"""
from __future__ import annotations

import contextlib
import copy
import functools
import math
import time

import numpy as np
import pytest

import fastattn
from fastattn import _bench, _reference
from fastattn.layers import MultiHeadAttention

# every benchmark records the other processes' load and rests afterwards (conftest)
pytestmark = pytest.mark.usefixtures("quiesce_after")

N_THREADS = fastattn.get_num_threads()
torch = _bench.load_torch(N_THREADS)
ort = _bench.load_ort()

E, H = 512, 8
SHAPES = ((1, 16), (1, 128), (8, 128), (4, 512), (1, 1024))
WEIGHTS_SHAPE = (8, 128)
IMPLS = ("fastattn", "fastattn_frozen", "torch", "ort", "numpy")
TOLERANCE = (1e-4, 1e-5)  # (rtol, atol) against the float64 oracle, float32 results
TORCH_MAX_ABS_DIFF = 1e-5



@functools.lru_cache(maxsize=1)
def layer() -> MultiHeadAttention:
    m = MultiHeadAttention(E, H, seed=0)
    rng = np.random.default_rng(1)
    sd = m.state_dict()
    sd["in_proj_bias"] = (rng.standard_normal(3 * E) * 0.1).astype(np.float32)
    sd["out_proj.bias"] = (rng.standard_normal(E) * 0.1).astype(np.float32)
    return m.load_state_dict(sd)


@functools.lru_cache(maxsize=1)
def frozen_layer() -> MultiHeadAttention:
    return copy.deepcopy(layer()).freeze()


@functools.lru_cache(maxsize=2)
def case_data(B, N):
    x = np.random.default_rng(B * 10007 + N).standard_normal((B, N, E)).astype(np.float32)
    p = layer().params
    W, b = p["in_proj_weight"], p["in_proj_bias"]
    expected = _reference.multi_head_attention(
        x, x, x, num_heads=H, w_query=W[:E], w_key=W[E:2 * E], w_value=W[2 * E:],
        b_query=b[:E], b_key=b[E:2 * E], b_value=b[2 * E:], w_out=p["out_proj.weight"],
        b_out=p["out_proj.bias"])
    return x, expected


def numpy_mha(x, p, num_heads):
    """Self-attention in plain NumPy, float32 throughout."""
    B, L, E_ = x.shape
    dh = E_ // num_heads
    qkv = x @ p["in_proj_weight"].T
    qkv += p["in_proj_bias"]
    qkv = qkv.reshape(B, L, 3, num_heads, dh).transpose(2, 0, 3, 1, 4)
    q, k, v = qkv[0], qkv[1], qkv[2]
    s = q @ k.transpose(0, 1, 3, 2)
    s *= np.float32(1.0 / math.sqrt(dh))
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    o = (s @ v).transpose(0, 2, 1, 3).reshape(B, L, E_)
    y = o @ p["out_proj.weight"].T
    y += p["out_proj.bias"]
    return y


def torch_module():
    m = torch.nn.MultiheadAttention(E, H, batch_first=True).eval()
    with torch.no_grad():
        for name, t in m.state_dict().items():
            t.copy_(torch.from_numpy(layer().params[name]))
    return m


class OrtMHA:
    """``com.microsoft.Attention`` (packed QKV) + ``MatMul`` + ``Add``, IOBinding, output bound once."""

    def __init__(self, x, p, num_heads, n_threads):
        from onnx import TensorProto, helper, numpy_helper

        B, N, E_ = x.shape
        inits = [
            numpy_helper.from_array(np.ascontiguousarray(p["in_proj_weight"].T), "W_qkv"),
            numpy_helper.from_array(p["in_proj_bias"], "b_qkv"),
            numpy_helper.from_array(np.ascontiguousarray(p["out_proj.weight"].T), "W_out"),
            numpy_helper.from_array(p["out_proj.bias"], "b_out"),
        ]
        nodes = [
            helper.make_node("Attention", ["X", "W_qkv", "b_qkv"], ["A"], domain="com.microsoft",
                             num_heads=num_heads),
            helper.make_node("MatMul", ["A", "W_out"], ["P"]),
            helper.make_node("Add", ["P", "b_out"], ["Y"]),
        ]
        graph = helper.make_graph(
            nodes, "fastattn_bench_mha",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [B, N, E_])],
            [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [B, N, E_])],
            initializer=inits)
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets, producer_name="fastattn-bench")
        model.ir_version = 8
        self.session = _bench.ort_session(model.SerializeToString(), n_threads)
        self.x = np.ascontiguousarray(x)
        self.out = np.empty_like(self.x)
        self.binding = self.session.io_binding()
        self.binding.bind_cpu_input("X", self.x)
        self.binding.bind_output("Y", "cpu", 0, np.float32, list(self.out.shape),
                                 self.out.ctypes.data)
        self._run = self.session.run_with_iobinding

    def __call__(self):
        self._run(self.binding)
        return self.out


def _callable(impl, x):
    m = layer()
    if impl == "fastattn":
        return lambda: m(x)
    if impl == "fastattn_frozen":
        f = frozen_layer()
        return lambda: f(x)
    if impl == "fastattn_weights":
        return lambda: m(x, return_weights=True)
    if impl == "numpy":
        p = m.params
        return lambda: numpy_mha(x, p, H)
    if impl == "torch":
        tm = torch_module()
        tx = torch.from_numpy(x)
        return lambda: tm(tx, tx, tx, need_weights=False)[0]
    if impl == "ort":
        return OrtMHA(x, m.params, H, N_THREADS)
    raise ValueError(impl)




def _params():
    for B, N in SHAPES:
        group = f"mha B={B} N={N} E={E} H={H} float32"
        impls = IMPLS + (("fastattn_weights",) if (B, N) == WEIGHTS_SHAPE else ())
        for impl in impls:
            marks = [pytest.mark.benchmark(group=group)]
            if impl == "torch" and torch is None:
                marks.append(pytest.mark.skip(reason="torch is not importable"))
            if impl == "ort" and ort is None:
                marks.append(pytest.mark.skip(reason="onnx/onnxruntime is not importable"))
            yield pytest.param(B, N, impl, id=f"B{B}-N{N}-{impl}", marks=marks)


def _result(r):
    if isinstance(r, tuple):
        r = r[0]
    if torch is not None and isinstance(r, torch.Tensor):
        r = r.numpy()
    return np.asarray(r)


@pytest.mark.parametrize(("B", "N", "impl"), list(_params()))
def test_mha_forward(benchmark, B, N, impl):
    x, expected = case_data(B, N)
    flops = 2 * B * N * E * 4 * E + 4 * B * N * N * E
    benchmark.extra_info.update(kind="mha", B=B, N=N, E=E, H=H, dtype="float32", impl=impl,
                                threads=N_THREADS, flops=flops)
    ctx = contextlib.ExitStack()
    if impl == "torch":
        ctx.enter_context(torch.inference_mode())
    if impl == "numpy":
        ctx.enter_context(_bench.blas_threads(N_THREADS, which=("numpy",)))
    with ctx:
        fn = _callable(impl, x)
        first = _result(fn()).copy()  # checked before anything is timed
        np.testing.assert_allclose(first, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1])
        # rest: the oracle just computed (NumPy's threaded OpenBLAS) and this
        # first call may leave worker threads spinning for ~100 ms
        _bench.quiesce()
        t0 = time.perf_counter()
        fn()
        first_s = time.perf_counter() - t0
        result = _bench.time_benchmark(benchmark, fn, first_s)
    result = _result(result)
    assert result.dtype == np.float32 and result.shape == (B, N, E)
    np.testing.assert_allclose(result, expected, rtol=TOLERANCE[0], atol=TOLERANCE[1])
    if impl.startswith("fastattn") and torch is not None:
        tm = torch_module()
        with torch.inference_mode():
            tx = torch.from_numpy(x)
            t_out = tm(tx, tx, tx, need_weights=False)[0].numpy()
        diff = float(np.max(np.abs(result - t_out)))
        benchmark.extra_info["max_abs_diff_torch"] = diff
        assert diff <= TORCH_MAX_ABS_DIFF, diff
