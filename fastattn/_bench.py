"""Timing helpers and baselines for ``python -m fastattn bench`` and ``benchmarks/``.

Nothing in the library calls this module.  It holds:

* the plain-NumPy baseline (:func:`numpy_sdpa`): what a NumPy user would
  write (``softmax(scale * Q K^T) V`` in the inputs' dtype, in place where
  NumPy allows); it is *not* the float64 oracle in :mod:`fastattn._reference`,
  which is written for clarity rather than speed;
* the torch baseline (:func:`torch_sdpa_callable`);
* the onnxruntime baseline (:class:`OrtAttention`): a one-node ONNX model
  with the opset-23 ``Attention`` operator, run by an ``InferenceSession``
  with IOBinding so a timed call is only ``session.run_with_iobinding``;
* BLAS GEMM throughput (:func:`gemm_gflops`), the yardstick for the
  "% of GEMM" column;
* the timing loop and the one report table (:func:`measure_case`,
  :func:`format_report`, :func:`run_bench`);
* child-process probes for ``benchmarks/memory.py`` (:func:`memory_child`)
  and ``benchmarks/idle.py`` (:func:`idle_child`), and the competitor
  process for ``benchmarks/busy.py`` (:func:`start_competitor`).

onnx, onnxruntime and torch are imported lazily, inside functions.

onnxruntime notes (1.32, measured here, see :func:`ort_graph_ops`): for
float32 the CPU provider has a native ``Attention`` kernel (the graph stays
one node).  For float64 it has none: the operator is expanded into its ONNX
function body (about 57-69 ops: MatMul, Softmax, Where, ...), which builds
the full score matrix, and that body rounds ``sqrt(scale)`` to float32, so
its float64 results differ from NumPy by ~1e-7 (relative); the check
tolerance for that one combination is therefore 1e-6.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from typing import NamedTuple

import numpy as np

import fastattn

from . import _kernels

__all__ = [
    "numpy_sdpa",
    "causal_mask",
    "random_qkv",
    "time_call",
    "time_samples",
    "format_us",
    "micro_unit",
    "load_torch",
    "torch_sdpa_callable",
    "load_ort",
    "ort_attention_model",
    "ort_session",
    "ort_graph_ops",
    "OrtAttention",
    "openblas_libraries",
    "blas_threads",
    "gemm_callable",
    "gemm_gflops",
    "fma_peak_callable",
    "interleaved",
    "fma_peak_gflops",
    "Case",
    "SUITE_CASES",
    "IMPLS",
    "attention_flops",
    "impl_callable",
    "check_tolerance",
    "measure_case",
    "quiesce",
    "LoadMonitor",
    "wait_quiet",
    "format_report",
    "report_columns",
    "report_row",
    "run_bench",
    "memory_child",
    "memory_benchmark",
    "idle_child",
    "idle_benchmark",
    "start_competitor",
]


# ---------------------------------------------------------------------------
# The NumPy baseline and inputs

def parse_shape(text):
    """``"8x8x128x64"`` -> ``(8, 8, 128, 64)`` (argparse type: bad text is a usage error)."""
    import argparse

    try:
        dims = tuple(int(p) for p in text.lower().replace("\u00d7", "x").split("x"))
    except ValueError:
        dims = ()
    if len(dims) < 2 or any(d < 1 for d in dims):
        raise argparse.ArgumentTypeError(
            f"expected a shape like 8x8x128x64 (..., N, d), got {text!r}"
        )
    return dims


def numpy_sdpa(query, key, value, attn_mask=None, scale=None, return_weights=False):
    """``softmax(scale * query @ key^T) @ value`` in plain NumPy.

    Computed in the inputs' dtype (float32 stays float32).  ``attn_mask`` is
    boolean, True where a query may attend to a key (fastattn's convention),
    broadcastable to the score shape ``(..., Lq, Lk)``.  Every row must allow
    at least one key (a fully masked row gives NaN here).  With
    ``return_weights`` the softmax weights are returned too, as
    ``(output, weights)``.
    """
    d = query.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(d) if d > 0 else 1.0
    s = query @ np.swapaxes(key, -1, -2)
    s *= scale
    if attn_mask is not None:
        np.copyto(s, -np.inf, where=~attn_mask)
    s -= s.max(axis=-1, keepdims=True)
    np.exp(s, out=s)
    s /= s.sum(axis=-1, keepdims=True)
    if return_weights:
        return s @ value, s
    return s @ value


def causal_mask(Lq, Lk):
    """Boolean ``(Lq, Lk)`` mask, True where key ``j <= i`` (top-left alignment)."""
    return np.tri(Lq, Lk, dtype=bool)


def random_qkv(shape, dtype=np.float32, seed=0):
    """Three standard-normal arrays of ``shape`` = (..., L, d), C-contiguous."""
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(shape).astype(dtype) for _ in range(3))


# ---------------------------------------------------------------------------
# Timing

def time_samples(fn, budget=0.2, min_repeats=5, max_repeats=1000, min_sample=2e-4):
    """Seconds per call of ``fn()``, one value per sample (see :func:`time_call`)."""
    fn()
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-9)
    number = max(1, int(min_sample / one))
    repeats = int(min(max_repeats, max(min_repeats, budget / (one * number))))
    samples = []
    start = time.perf_counter()
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        t1 = time.perf_counter()
        samples.append((t1 - t0) / number)
        if len(samples) >= min_repeats and t1 - start > budget:
            break  # the machine got slower than the first call said: stay in budget
    return samples


def time_call(fn, budget=0.2, min_repeats=5, max_repeats=1000, min_sample=2e-4):
    """Median seconds per call of ``fn()``.

    One warm-up call, then repeated samples of ``number`` back-to-back calls
    (``number`` chosen so a sample lasts at least ``min_sample`` seconds),
    as many samples as fit in ``budget`` seconds, clamped to
    ``[min_repeats, max_repeats]`` (sampling stops once ``budget`` is spent
    and ``min_repeats`` samples are in).
    """
    return statistics.median(time_samples(fn, budget, min_repeats, max_repeats, min_sample))


def format_us(seconds):
    """Microseconds with a sensible number of digits, e.g. ``'12.3'`` or ``'4,521'``."""
    us = seconds * 1e6
    if us < 100:
        return f"{us:.1f}"
    return f"{us:,.0f}"


def micro_unit(stream):
    """``"µs"``, or ``"us"`` when ``stream`` cannot encode the micro sign."""
    try:
        "µ".encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeEncodeError, LookupError):
        return "us"
    return "µs"


class LoadMonitor:
    """CPU used by *other* processes while a benchmark runs (from ``/proc/stat``).

    ``start()``, then ``other_cores()`` = average number of cores kept busy by
    everything except this process and its children over the interval; a
    value well above 0 means the timings were taken on a loaded machine.
    """

    def __init__(self):
        self.start()

    @staticmethod
    def _machine_busy_s():
        with open("/proc/stat") as f:
            vals = [int(x) for x in f.readline().split()[1:]]
        idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
        return (sum(vals[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s():
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def start(self):
        try:
            self._t0, self._m0, self._o0 = time.perf_counter(), self._machine_busy_s(), self._own_s()
        except (OSError, ValueError):  # pragma: no cover - non-Linux
            self._t0 = None

    def other_cores(self):
        if self._t0 is None:  # pragma: no cover
            return None
        wall = time.perf_counter() - self._t0
        other = (self._machine_busy_s() - self._m0) - (self._own_s() - self._o0)
        return max(0.0, other / wall) if wall > 0 else 0.0

    def line(self):
        c = self.other_cores()
        if c is None:  # pragma: no cover
            return "machine load: unknown"
        warn = "  <- timings taken on a loaded machine: repeat" if c > LOADED_CORES else ""
        return f"other processes kept {c:.2f} core(s) busy on average during this run{warn}"


def wait_quiet(threshold=0.1, window=2.0, timeout=600.0, file=None):
    """Wait until other processes keep fewer than ``threshold`` cores busy over ``window`` s.

    Returns the last reading (cores); gives up after ``timeout`` seconds.
    """
    t_end = time.perf_counter() + timeout
    while True:
        mon = LoadMonitor()
        time.sleep(window)
        c = mon.other_cores() or 0.0
        if c < threshold or time.perf_counter() > t_end:
            return c
        if file is not None:
            print(f"waiting for a quiet machine (other processes: {c:.2f} cores)", file=file, flush=True)


# ---------------------------------------------------------------------------
# torch

def load_torch(n_threads):
    """Import torch and set its intra-op threads to ``n_threads``; None if not importable."""
    try:
        import torch
    except Exception:  # ImportError, or a broken install
        return None
    torch.set_num_threads(n_threads)
    return torch


def torch_sdpa_callable(torch, q, k, v, is_causal=False):
    """A zero-argument callable running torch's SDPA on tensors made once (no copies).

    Call it inside ``torch.inference_mode()`` (entered once, outside the timed loop).
    """
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return sdpa(tq, tk, tv, is_causal=is_causal)

    return run


# ---------------------------------------------------------------------------
# onnxruntime: the opset-23 Attention operator

ORT_OPSET = 23


def load_ort():
    """``onnxruntime`` if both it and ``onnx`` import, else None."""
    try:
        import onnx  # noqa: F401  (the model builder needs it)
        import onnxruntime
    except Exception:
        return None
    return onnxruntime


def _onnx_elem_type(dtype):
    from onnx import TensorProto

    dt = np.dtype(dtype)
    try:
        return {np.dtype(np.float32): TensorProto.FLOAT,
                np.dtype(np.float64): TensorProto.DOUBLE,
                np.dtype(np.float16): TensorProto.FLOAT16}[dt]
    except KeyError:
        raise TypeError(f"no ONNX element type for {dt}") from None


def ort_attention_model(shape=None, dtype=np.float32, is_causal=False, dv=None):
    """Serialized ONNX model: ``Y = Attention(Q, K, V)``, opset 23, standard domain.

    Q, K, V and Y are 4-D ``(B, H, N, d)`` (V and Y ``(B, H, N, dv)``).
    ``shape=None`` gives symbolic dims (one session serves every shape).
    Only the ``is_causal`` attribute is set; ``scale`` keeps its default
    ``1/sqrt(d)``.  The model passes ``onnx.checker.check_model``.
    """
    import onnx
    from onnx import helper

    elem = _onnx_elem_type(dtype)
    if shape is None:
        qdims = ["B", "H", "N", "d"]
        vdims = ["B", "H", "N", "dv"]
    else:
        if len(shape) != 4:
            raise ValueError(f"expected a 4-D shape (B, H, N, d), got {shape}")
        qdims = list(shape)
        vdims = list(shape[:3]) + [shape[3] if dv is None else dv]
    node = helper.make_node("Attention", ["Q", "K", "V"], ["Y"], is_causal=int(bool(is_causal)))
    graph = helper.make_graph(
        [node], "fastattn_bench_attention",
        [helper.make_tensor_value_info("Q", elem, qdims),
         helper.make_tensor_value_info("K", elem, qdims),
         helper.make_tensor_value_info("V", elem, vdims)],
        [helper.make_tensor_value_info("Y", elem, vdims)],
    )
    opsets = [helper.make_opsetid("", ORT_OPSET)]
    model = helper.make_model(graph, opset_imports=opsets, producer_name="fastattn-bench")
    # the lowest IR version that carries opset 23, so older runtimes load it too
    model.ir_version = helper.find_min_ir_version_for(opsets)
    onnx.checker.check_model(model)
    return model.SerializeToString()


def ort_session(model_bytes, n_threads, optimized_model_path=None):
    """CPU ``InferenceSession``: ``intra_op_num_threads=n_threads``, ``inter_op_num_threads=1``.

    Everything else is onnxruntime's default (graph optimizations on, thread
    spinning on, CPU memory arena on): what a user gets.
    """
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = int(n_threads)
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3  # errors only
    if optimized_model_path is not None:
        so.optimized_model_filepath = optimized_model_path
    return ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])


@functools.lru_cache(maxsize=None)
def ort_graph_ops(dtype="float32", is_causal=False):
    """Op types onnxruntime actually runs for the Attention model of ``dtype``.

    ``("Attention",)`` means a native kernel; a long tuple means the operator
    was expanded into its ONNX function body.  None if the session cannot be
    created (the dtype is not supported).
    """
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        try:
            ort_session(ort_attention_model((1, 2, 8, 4), dtype, is_causal), 1, path)
            model = onnx.load(path)
        except Exception:
            return None
    return tuple(n.op_type for n in model.graph.node)


def ort_describe(dtype):
    """One phrase: how onnxruntime runs Attention for ``dtype``."""
    ops = ort_graph_ops(np.dtype(dtype).name)
    if ops is None:
        return "n/a (no kernel)"
    if ops == ("Attention",):
        return "native Attention kernel"
    return f"no native kernel: expanded into {len(ops)} ONNX ops ({', '.join(sorted(set(ops))[:4])}, ...)"


class OrtAttention:
    """onnxruntime running ``Attention(q, k, v)`` with inputs and output bound once.

    ``q``, ``k``, ``v`` are 4-D C-contiguous arrays (kept referenced); the
    output is a preallocated array wrapped in an ``OrtValue`` and bound with
    ``bind_output``, so ``self()`` is only ``session.run_with_iobinding`` and
    returns that same array (overwritten on every call).

    ``symbolic=True`` builds the model with symbolic dims; ``preallocate=False``
    lets onnxruntime allocate the output during the call (the memory probe
    uses this so every library pays for its own output).
    """

    def __init__(self, q, k, v, is_causal=False, n_threads=1, symbolic=False, preallocate=True):
        import onnxruntime as ort

        arrays = []
        for name, a in (("q", q), ("k", k), ("v", v)):
            if a.ndim != 4:
                raise ValueError(f"{name}: onnxruntime's Attention takes 4-D (B, H, N, d), got {a.shape}")
            arrays.append(np.ascontiguousarray(a))
        self.q, self.k, self.v = arrays
        self.dtype = self.q.dtype
        self.is_causal = bool(is_causal)
        self.n_threads = int(n_threads)
        model = ort_attention_model(None if symbolic else self.q.shape, self.dtype, is_causal,
                                    dv=self.v.shape[-1])
        self.session = ort_session(model, n_threads)
        self.binding = self.session.io_binding()
        for name, a in zip("QKV", (self.q, self.k, self.v)):
            self.binding.bind_cpu_input(name, a)
        out_shape = self.q.shape[:-1] + (self.v.shape[-1],)
        if preallocate:
            self.out = np.empty(out_shape, self.dtype)
            self._out_value = ort.OrtValue.ortvalue_from_numpy(self.out)
            assert self._out_value.data_ptr() == self.out.ctypes.data
            self.binding.bind_output("Y", "cpu", 0, self.dtype, list(out_shape),
                                     self._out_value.data_ptr())
        else:
            self.out = None
            self.binding.bind_output("Y", "cpu")
        self._run = self.session.run_with_iobinding

    def __call__(self):
        self._run(self.binding)
        return self.out

    def result(self):
        """The output as a NumPy array (a copy when onnxruntime allocated it)."""
        if self.out is not None:
            return self.out
        return self.binding.copy_outputs_to_cpu()[0]


# ---------------------------------------------------------------------------
# BLAS thread control and GEMM throughput

class BlasLib(NamedTuple):
    path: str
    get_threads: object  # ctypes function () -> int
    set_threads: object  # ctypes function (int) -> None


_GET_NAMES = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
              "openblas_get_num_threads64_", "openblas_get_num_threads")
_SET_NAMES = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
              "openblas_set_num_threads64_", "openblas_set_num_threads")


def openblas_libraries():
    """The OpenBLAS libraries loaded in this process: ``{"numpy"|"scipy"|path: BlasLib}``.

    threadpoolctl is not a dependency; this uses OpenBLAS's own C API
    (``scipy_openblas_{get,set}_num_threads[64_]``) on the libraries found in
    ``/proc/self/maps`` after importing numpy and ``scipy.linalg.blas``.
    """
    import scipy.linalg.blas  # noqa: F401  (loads scipy's OpenBLAS)

    paths = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                p = line.split()[-1]
                if "openblas" in os.path.basename(p).lower() and p not in paths:
                    paths.append(p)
    except OSError:  # pragma: no cover - non-Linux
        pass
    libs = {}
    for p in paths:
        try:
            lib = ctypes.CDLL(p)
        except OSError:
            continue
        get = next((getattr(lib, n) for n in _GET_NAMES if hasattr(lib, n)), None)
        set_ = next((getattr(lib, n) for n in _SET_NAMES if hasattr(lib, n)), None)
        if get is None or set_ is None:
            continue
        get.restype = ctypes.c_int
        get.argtypes = []
        set_.restype = None
        set_.argtypes = [ctypes.c_int]
        tag = "numpy" if "numpy.libs" in p else "scipy" if "scipy.libs" in p else p
        libs[tag] = BlasLib(p, get, set_)
    return libs


@contextlib.contextmanager
def blas_threads(n, which=("numpy", "scipy")):
    """Hold the named OpenBLAS libraries at ``n`` threads inside the block.

    Yields ``{tag: threads read back}``; restores the previous counts.
    """
    libs = {t: lib for t, lib in openblas_libraries().items() if t in which}
    before = {t: lib.get_threads() for t, lib in libs.items()}
    try:
        for lib in libs.values():
            lib.set_threads(int(n))
        yield {t: lib.get_threads() for t, lib in libs.items()}
    finally:
        for t, lib in libs.items():
            lib.set_threads(before[t])


def gemm_callable(dtype="float32", n=2048, seed=0):
    """``scipy.linalg.blas.sgemm`` (or ``dgemm``) on ``n x n`` Fortran-ordered arrays.

    ``C = A B`` written into one preallocated Fortran-ordered ``C``
    (``overwrite_c=1``), so a call allocates nothing.  This is SciPy's
    OpenBLAS, the BLAS fastattn's kernels call.  Returns ``(run, flops)``.
    """
    from scipy.linalg import blas

    dt = np.dtype(dtype)
    fn = {np.dtype(np.float32): blas.sgemm, np.dtype(np.float64): blas.dgemm}[dt]
    rng = np.random.default_rng(seed)
    a = np.asfortranarray(rng.standard_normal((n, n)).astype(dt))
    b = np.asfortranarray(rng.standard_normal((n, n)).astype(dt))
    c = np.zeros((n, n), dt, order="F")

    def run():
        return fn(1.0, a, b, beta=0.0, c=c, overwrite_c=1)

    r = run()
    if not np.shares_memory(r, c):  # pragma: no cover - would mean a copy per call
        raise RuntimeError("gemm: overwrite_c was not honoured")
    return run, 2.0 * n ** 3


def gemm_gflops(dtype="float32", n=2048, n_threads=2, budget=1.0):
    """GFLOP/s of SciPy's ``?gemm`` at ``n_threads`` BLAS threads (median of >= 5 calls).

    Returns ``(gflops, blas_threads_read_back)``.
    """
    run, flops = gemm_callable(dtype, n)
    with blas_threads(n_threads, which=("scipy",)) as got:
        t = time_call(run, budget)
    quiesce()
    return flops / t / 1e9, got.get("scipy")


def interleaved(a, b, budget, min_rounds=5):
    """A/B timing: ``a`` and ``b`` called alternately (after one warm-up call
    each) for ``budget`` seconds and at least ``min_rounds`` rounds, so that
    load changes on a shared machine hit both alike.  Returns two arrays of
    call times in microseconds."""
    a()
    b()
    ta, tb = [], []
    end = time.perf_counter() + budget
    while time.perf_counter() < end or len(ta) < min_rounds:
        t0 = time.perf_counter()
        a()
        t1 = time.perf_counter()
        b()
        t2 = time.perf_counter()
        ta.append(t1 - t0)
        tb.append(t2 - t1)
    return np.array(ta) * 1e6, np.array(tb) * 1e6


PEAK_ITERS = 20000  # fma_probe iterations a task: 64 tasks of ~0.4 ms on one core


def fma_peak_callable(n_threads=2):
    """``(run, flops)``: one :func:`fastattn._kernels.fma_probe` call on
    ``n_threads`` threads (flops is 0 when the AVX2 code is not in use)."""
    flops = _kernels.fma_probe(1, 1) * PEAK_ITERS  # 64 tasks of PEAK_ITERS iterations

    def run():
        return _kernels.fma_probe(PEAK_ITERS, n_threads)

    return run, flops


def fma_peak_gflops(n_threads=2, budget=0.3):
    """The float32 FMA peak of this machine at ``n_threads`` threads in GFLOP/s
    (median of >= 5 probe calls), or None without the AVX2 code.  Float64's is
    half of it (4 lanes instead of 8, the same instruction rate)."""
    run, flops = fma_peak_callable(n_threads)
    if not flops:
        return None
    return flops / time_call(run, budget) / 1e9


def add_peak(gemm, peak):
    """``gemm`` (``{dtype: GFLOP/s}``) with the FMA peaks added under the keys
    ``"peak:float32"`` and ``"peak:float64"`` (report_row's %peak column)."""
    out = dict(gemm)
    if peak:
        out["peak:float32"] = peak
        out["peak:float64"] = peak / 2
    return out


def gemm_items(gemm):
    """The GEMM entries of a ``gemm`` dict (without the peaks)."""
    return {k: v for k, v in gemm.items() if not k.startswith("peak:")}


# ---------------------------------------------------------------------------
# The benchmark cases, callables and checks

class Case(NamedTuple):
    shape: tuple
    dtype: str = "float32"
    causal: bool = False

    @property
    def name(self):
        return "x".join(map(str, self.shape)) + f"-{self.dtype}" + ("-causal" if self.causal else "")

    @property
    def group(self):
        return self.name.replace("-", " ")


SUITE_SHAPES = {
    "float32": ((1, 1, 16, 64), (32, 8, 64, 64), (8, 8, 128, 64), (1, 8, 128, 64),
                (1, 12, 128, 32), (1, 8, 512, 64), (4, 8, 512, 64), (1, 8, 2048, 64),
                (1, 8, 4096, 64)),
    "float64": ((8, 8, 128, 64), (1, 8, 2048, 64)),
}
SUITE_CASES = tuple(Case(s, dt, c) for dt, shapes in SUITE_SHAPES.items()
                    for s in shapes for c in (False, True))
IMPLS = ("fastattn", "torch", "ort", "numpy")  # the report's column order


def attention_flops(shape, causal=False):
    """``4 * B * H * N^2 * d`` (QK^T and PV, 2 flops per multiply-add), halved for causal."""
    *batch, n, d = shape
    f = 4.0 * math.prod(batch) * n * n * d
    return f / 2 if causal else f


def check_tolerance(impl, dtype):
    """Relative tolerance (to ``max(1, max|expected|)``) for ``impl`` against NumPy."""
    dt = np.dtype(dtype)
    if dt == np.float64:
        # onnxruntime's float64 path rounds sqrt(scale) to float32 (module docstring)
        return 1e-6 if impl == "ort" else 1e-10
    return 1e-4


def impl_callable(impl, q, k, v, causal, n_threads, torch=None):
    """Zero-argument callable computing attention with ``impl``; its result converts with ``np.asarray``.

    torch callables must run inside ``torch.inference_mode()``.
    """
    if impl == "fastattn":
        sdpa = fastattn.scaled_dot_product_attention
        return lambda: sdpa(q, k, v, is_causal=causal, n_threads=n_threads)
    if impl == "numpy":
        mask = causal_mask(q.shape[-2], k.shape[-2]) if causal else None
        return lambda: numpy_sdpa(q, k, v, mask)
    if impl == "torch":
        return torch_sdpa_callable(torch, q, k, v, causal)
    if impl == "ort":
        return OrtAttention(q, k, v, causal, n_threads)
    raise ValueError(f"unknown implementation {impl!r}")


def _max_err(result, expected):
    return float(np.max(np.abs(np.asarray(result, dtype=np.float64) - expected))) if expected.size else 0.0


# OpenBLAS workers spin ~110 ms after a call, onnxruntime's ~40 ms, torch's
# ~10 ms (benchmarks/idle.py); on a 2-core machine a spinning pool slows
# whatever is timed next, so the timing loops rest this long between libraries.
QUIESCE_S = 0.2


# pytest-benchmark timing of one benchmark (benchmarks/test_bench_*.py)
PEDANTIC_ABOVE = 0.02   # seconds per call: time with benchmark.pedantic beyond this
PEDANTIC_BUDGET = 3.0   # seconds of timed rounds per pedantic benchmark
PEDANTIC_ROUNDS = (3, 15)


def time_benchmark(benchmark, fn, first_call_s=None):
    """Time ``fn`` with pytest-benchmark's ``benchmark`` fixture: its calibrated
    loop for calls faster than PEDANTIC_ABOVE (warm threads), else
    ``benchmark.pedantic`` (1 warm-up round, then as many 1-call rounds as fit
    in PEDANTIC_BUDGET, within PEDANTIC_ROUNDS).  ``first_call_s``: a call's
    time if already measured; otherwise ``fn`` runs twice and the second call
    is timed (the first may include set-up).  Returns the timed result."""
    if first_call_s is None:
        fn()
        t0 = time.perf_counter()
        fn()
        first_call_s = time.perf_counter() - t0
    if first_call_s < PEDANTIC_ABOVE:
        return benchmark(fn)
    lo, hi = PEDANTIC_ROUNDS
    rounds = int(min(hi, max(lo, PEDANTIC_BUDGET / first_call_s)))
    return benchmark.pedantic(fn, rounds=rounds, iterations=1, warmup_rounds=1)


def quiesce(seconds=QUIESCE_S):
    """Sleep until the previous library's spinning worker threads have gone idle."""
    time.sleep(seconds)


def measure_case(case, n_threads, budget=0.2, torch=None, use_ort=True, impls=IMPLS):
    """Time one case with every available implementation.

    Each implementation is checked against the NumPy result before it is
    timed (that reference is computed with NumPy's BLAS at one thread, so
    no OpenBLAS workers are left spinning), and the loop rests
    :data:`QUIESCE_S` after each implementation.

    Returns a dict: ``case``; ``times`` ``{impl: seconds}`` (None when
    unavailable or failing); ``errors`` ``{impl: max|diff|}``; ``bad``
    (implementations that disagreed with NumPy or raised); ``other_cores``
    (load from other processes meanwhile, see :class:`LoadMonitor`).
    """
    dt = np.dtype(case.dtype)
    q, k, v = random_qkv(case.shape, dt)
    with blas_threads(1, which=("numpy",)):
        expected = numpy_sdpa(q, k, v, causal_mask(q.shape[-2], k.shape[-2]) if case.causal else None)
    scale = max(1.0, float(np.max(np.abs(expected))))
    times, errors, bad = {}, {}, []
    load = LoadMonitor()
    for impl in impls:
        times[impl] = None
        if (impl == "torch" and torch is None) or (impl == "ort" and not use_ort):
            continue
        if impl == "ort" and (len(case.shape) != 4 or ort_graph_ops(dt.name) is None):
            continue
        try:
            fn = impl_callable(impl, q, k, v, case.causal, n_threads, torch)
            ctx = torch.inference_mode() if impl == "torch" else contextlib.nullcontext()
            with ctx:
                err = _max_err(fn(), expected)
                errors[impl] = err
                if not err <= check_tolerance(impl, dt) * scale:
                    bad.append(impl)
                    continue
                times[impl] = time_call(fn, budget)
        except Exception as exc:  # a peer that cannot run this case: report, don't crash
            bad.append(impl)
            errors[impl] = f"{type(exc).__name__}: {exc}"
        finally:
            fn = None  # drop an onnxruntime session (and its thread pool) right away
            quiesce()
    return {"case": case, "times": times, "errors": errors, "bad": bad,
            "other_cores": load.other_cores()}


def fastest_peer(times):
    """Smaller of the torch and onnxruntime times (None when neither ran)."""
    peers = [t for impl, t in times.items() if impl in ("torch", "ort") and t is not None]
    return min(peers) if peers else None


def report_columns(stream=None):
    """The report table's column header line."""
    mu = micro_unit(stream or sys.stdout)
    return (f"{'BxHxNxd':>14} {'causal':>6} {'dtype':>7} "
            + " ".join(f"{impl + ' ' + mu:>11}" for impl in IMPLS)
            + f" {'fa/peer':>8} {'GFLOP/s':>8} {'%gemm':>6} {'%peak':>6}  check")


LOADED_CORES = 0.15  # other processes' average busy cores above which a row is flagged

REPORT_FOOTER = ("fa/peer = fastattn time / faster of torch and ort (< 1: fastattn is faster); "
                 "GFLOP/s = 4*B*H*N^2*d (halved when causal) / fastattn time; %gemm = that / "
                 "the same run's SciPy-BLAS sgemm (float32) or dgemm (float64) 2048x2048 GFLOP/s; "
                 "%peak = that / the same run's FMA peak (fastattn._kernels.fma_probe: independent "
                 "float FMAs of the kernels' vector width (8 lanes AVX2, 16 AVX-512) on every thread; float64: half of it); "
                 "LOADED x = other processes kept x cores busy meanwhile (repeat that row)")


def report_row(row, gemm):
    """One line of the report table (see :func:`format_report`)."""
    c, t = row["case"], row["times"]
    cells = [f"{'x'.join(map(str, c.shape)):>14}", f"{'yes' if c.causal else 'no':>6}",
             f"{c.dtype:>7}"]
    for impl in IMPLS:
        cells.append(f"{format_us(t[impl]) if t.get(impl) else '-':>11}")
    fa, peer = t.get("fastattn"), fastest_peer(t)
    cells.append(f"{fa / peer:>7.2f}x" if fa and peer else f"{'-':>8}")
    if fa:
        gf = attention_flops(c.shape, c.causal) / fa / 1e9
        g = gemm.get(c.dtype)
        cells.append(f"{gf:>8.1f}")
        cells.append(f"{100 * gf / g:>5.0f}%" if g else f"{'-':>6}")
        pk = gemm.get("peak:" + c.dtype)
        cells.append(f"{100 * gf / pk:>5.0f}%" if pk else f"{'-':>6}")
    else:
        cells += [f"{'-':>8}", f"{'-':>6}", f"{'-':>6}"]
    bad = row.get("bad") or []
    check = " MISMATCH: " + ",".join(bad) if bad else (" " + row.get("check", "ok"))
    other = row.get("other_cores")
    if other is not None and other > LOADED_CORES:
        check += f", LOADED {other:.2f}"
    cells.append(check)
    return " ".join(cells)


def format_report(rows, gemm, stream=None, header=()):
    """The report table as a list of lines.

    ``rows``: dicts with ``case`` (:class:`Case`), ``times`` ``{impl: s}``
    and optionally ``bad`` (list of impls) or ``check`` (text for the last
    column).  ``gemm``: ``{dtype name: GFLOP/s}`` of the same run's GEMM.
    """
    return [*header, report_columns(stream), *(report_row(r, gemm) for r in rows), REPORT_FOOTER]


def environment_lines(n_threads, torch=None, use_ort=True, gemm=None, blas_read=None,
                      use_torch=True):
    """Header lines shared by ``python -m fastattn bench`` and ``benchmarks/report.py``."""
    lines = [f"fastattn {fastattn.__version__}: {n_threads} thread(s), "
             f"SIMD {'on' if fastattn.simd_active() else 'off'}"]
    if torch is not None:
        lines.append(f"torch {torch.__version__}: {torch.get_num_threads()} intra-op thread(s), "
                     "inference_mode")
    else:
        lines.append("torch: " + ("not importable" if use_torch else "left out") + ", column empty")
    ort = load_ort() if use_ort else None
    if ort is not None:
        lines.append(f"onnxruntime {ort.__version__}: opset-{ORT_OPSET} Attention, CPU EP, "
                     f"intra_op={n_threads}, inter_op=1, IOBinding; float32: "
                     f"{ort_describe('float32')}; float64: {ort_describe('float64')}")
    else:
        lines.append("onnxruntime: " + ("onnx/onnxruntime not importable" if use_ort else "left out")
                     + ", column empty")
    lines.append(f"numpy {np.__version__}: its OpenBLAS held at {n_threads} thread(s)")
    if gemm and gemm_items(gemm):
        lines.append("gemm (SciPy OpenBLAS, 2048x2048, F-order, "
                     f"{blas_read if blas_read is not None else '?'} BLAS thread(s) read back; "
                     "threadpoolctl not used): "
                     + ", ".join(f"{'s' if k == 'float32' else 'd'}gemm {v:.1f} GFLOP/s"
                                 for k, v in gemm_items(gemm).items()))
    if gemm and gemm.get("peak:float32"):
        lines.append(f"FMA peak (fastattn._kernels.fma_probe, {n_threads} thread(s)): "
                     f"float32 {gemm['peak:float32']:.1f} GFLOP/s, float64 {gemm['peak:float64']:.1f}")
    return lines


def run_bench(shapes=None, dtype="float32", causal=False, budget=0.2,
              use_torch=True, n_threads=None, file=None, use_ort=True, gemm=True,
              cases=None):
    """Print the report table from this process's own timing loop.

    Either ``cases`` (a sequence of :class:`Case`), or ``shapes`` with one
    ``dtype`` and ``causal`` setting (default: :data:`BENCH_SHAPES`).
    Returns 0, or 1 when a result disagrees with the NumPy baseline.
    """
    stream = file or sys.stdout

    def emit(line):
        print(line, file=stream, flush=True)

    nt = fastattn.get_num_threads() if n_threads is None else n_threads
    torch = load_torch(nt) if use_torch else None
    if cases is None:
        dt = np.dtype(dtype).name
        cases = [Case(tuple(s), dt, bool(causal)) for s in (shapes or BENCH_SHAPES)]
    cases = list(cases)

    load = LoadMonitor()
    gflops, blas_read = {}, None
    if gemm:
        for dt in dict.fromkeys(c.dtype for c in cases):
            gflops[dt], blas_read = gemm_gflops(dt, n_threads=nt, budget=max(budget, 0.5))
        gflops = add_peak(gflops, fma_peak_gflops(nt))
    header = [f"scaled_dot_product_attention: median {micro_unit(stream)} per call "
              "(each result checked against NumPy first)"]
    header += environment_lines(nt, torch, use_ort, gflops, blas_read, use_torch)
    use_ort = use_ort and load_ort() is not None
    for line in header:
        emit(line)
    emit(report_columns(stream))
    rows = []
    with blas_threads(nt, which=("numpy",)):
        for case in cases:
            rows.append(measure_case(case, nt, budget, torch, use_ort))
            emit(report_row(rows[-1], gflops))
    emit(REPORT_FOOTER)
    if gemm:  # the same GEMM again: a drift check on this noisy machine
        end = {dt: gemm_gflops(dt, n_threads=nt, budget=max(budget, 0.5))[0]
               for dt in gemm_items(gflops)}
        drift = max(abs(end[dt] / gflops[dt] - 1) for dt in end)
        emit("gemm again at the end: "
             + ", ".join(f"{'s' if k == 'float32' else 'd'}gemm {v:.1f} GFLOP/s" for k, v in end.items())
             + ("  <- machine speed drifted more than 15% during the run: repeat" if drift > 0.15 else ""))
    emit(load.line())
    status = 0
    for row in rows:
        for impl in row["bad"]:
            emit(f"MISMATCH {row['case'].name} {impl}: max|diff| vs numpy = {row['errors'][impl]}")
            status = 1
    return status


BENCH_SHAPES = (
    (1, 1, 16, 64),
    (1, 8, 128, 64),
    (8, 8, 128, 64),
    (1, 8, 512, 64),
    (4, 8, 512, 64),
    (1, 8, 2048, 64),
)


# ---------------------------------------------------------------------------
# Child-process probes: peak memory of one call, CPU burned after a call

def _proc_status_kb(*fields):
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


def _reset_hwm():
    """Reset VmHWM to the current RSS (Linux: write 5 to /proc/self/clear_refs); True if it took."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    s = _proc_status_kb("VmHWM", "VmRSS")
    return s["VmHWM"] <= s["VmRSS"] + 64  # within 64 kB: the reset happened


def _malloc_trim():
    """glibc ``malloc_trim(0)``: return free heap pages to the OS; False if unavailable."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def _fastattn_parent():
    return os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))


def _run_child(code, timeout=600):
    # run in the folder that holds this fastattn: with ``-c`` the working
    # directory comes first on sys.path, and a source checkout's unbuilt
    # fastattn/ folder must not shadow the installed package
    parent = _fastattn_parent()
    env = dict(os.environ)
    env["PYTHONPATH"] = parent + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=parent)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"child failed (rc {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return json.loads(lines[-1])


def _child_callable(impl, q, k, v, causal, n_threads, torch):
    """(callable, result-getter) for the probes; every library allocates its own output."""
    if impl == "ort":
        ort = OrtAttention(q, k, v, causal, n_threads, symbolic=True, preallocate=False)
        return ort, ort.result
    fn = impl_callable(impl, q, k, v, causal, n_threads, torch)
    box = []

    def run():
        box[:] = [fn()]
        return box[0]

    return run, lambda: np.asarray(box[0])


def memory_child(impl, shape=(1, 8, 4096, 64), dtype="float32", causal=False, n_threads=None,
                 sample_interval=0.001):
    """Run in a fresh process: peak extra RSS of ONE call of ``impl`` on ``shape``.

    Before the measured call the library is imported and warmed on a tiny
    shape and the inputs are allocated (for ort: the session, with symbolic
    dims, exists and has run the tiny shape).  Then VmHWM is reset via
    ``/proc/self/clear_refs`` and, as a cross-check, a thread samples VmRSS
    every ``sample_interval`` seconds.  Free heap memory is returned to the
    OS first (glibc ``malloc_trim(0)``), so an allocation made by the call
    cannot hide in pages freed earlier (e.g. the inputs' float64
    temporaries).  Returns a dict (kB values).
    """
    import gc
    import threading

    nt = fastattn.get_num_threads() if n_threads is None else n_threads
    torch = load_torch(nt) if impl == "torch" else None
    dt = np.dtype(dtype)
    ctx = torch.inference_mode() if torch is not None else contextlib.nullcontext()
    with ctx:
        tiny = random_qkv((1, 2, 16, 8), dt, seed=1)
        if impl == "ort":
            warm, _ = _child_callable(impl, *tiny, causal, nt, torch)
            warm()
            q, k, v = random_qkv(shape, dt)
            # same session object for the big call: rebind its inputs
            fn = warm
            fn.q, fn.k, fn.v = q, k, v
            for name, a in zip("QKV", (q, k, v)):
                fn.binding.bind_cpu_input(name, a)
            fn.binding.bind_output("Y", "cpu")
            get = fn.result
        else:
            w, _ = _child_callable(impl, *tiny, causal, nt, torch)
            w()
            del w
            q, k, v = random_qkv(shape, dt)
            fn, get = _child_callable(impl, q, k, v, causal, nt, torch)
        gc.collect()
        trimmed = _malloc_trim()  # freed heap (e.g. input temporaries) back to the OS

        peak = [0]
        stop = threading.Event()
        page_kb = os.sysconf("SC_PAGE_SIZE") // 1024

        def sampler():
            with open("/proc/self/statm") as f:
                while not stop.is_set():
                    f.seek(0)
                    rss = int(f.read().split()[1]) * page_kb
                    if rss > peak[0]:
                        peak[0] = rss
                    time.sleep(sample_interval)

        th = threading.Thread(target=sampler, daemon=True)
        th.start()
        time.sleep(0.05)
        hwm_ok = _reset_hwm()
        before = _proc_status_kb("VmRSS")["VmRSS"]
        peak[0] = before
        t0 = time.perf_counter()
        fn()
        elapsed = time.perf_counter() - t0
        hwm = _proc_status_kb("VmHWM")["VmHWM"]
        time.sleep(0.01)
        stop.set()
        th.join()
        out = get()
    return {"impl": impl, "shape": list(shape), "dtype": dt.name, "causal": bool(causal),
            "threads": nt, "rss_before_kb": before, "hwm_kb": hwm, "hwm_reset_ok": hwm_ok,
            "sampled_peak_kb": peak[0], "out_bytes": int(np.asarray(out).nbytes),
            "call_s": elapsed, "malloc_trim": trimmed}


def memory_benchmark(impl, shape=(1, 8, 4096, 64), dtype="float32", causal=False, n_threads=None):
    """:func:`memory_child` in a fresh subprocess; returns its dict."""
    args = dict(impl=impl, shape=tuple(shape), dtype=np.dtype(dtype).name, causal=bool(causal),
                n_threads=n_threads)
    code = ("import json; from fastattn import _bench; "
            f"print(json.dumps(_bench.memory_child(**{args!r})))")
    return _run_child(code)


def _threads_in_process():
    return _proc_status_kb("Threads")["Threads"]


def idle_child(impl, shape=(1, 8, 512, 64), dtype="float32", causal=False, n_threads=None,
               window=0.2, repeats=5):
    """Run in a fresh process: CPU time burned in the ``window`` seconds after a call.

    After two warm-up calls and a 0.3 s rest: ``repeats`` times, one call,
    then ``time.process_time()`` (all threads of the process) across a
    ``time.sleep(window)``.  Also measures the same window with no call
    before it (the baseline).  Returns a dict of CPU milliseconds.
    """
    nt = fastattn.get_num_threads() if n_threads is None else n_threads
    torch = load_torch(nt) if impl == "torch" else None
    q, k, v = random_qkv(shape, np.dtype(dtype))
    ctx = torch.inference_mode() if torch is not None else contextlib.nullcontext()
    with ctx:
        fn, _ = _child_callable(impl, q, k, v, causal, nt, torch)
        fn()
        fn()
        time.sleep(0.3)
        base = []
        for _ in range(3):
            t0 = time.process_time()
            time.sleep(window)
            base.append((time.process_time() - t0) * 1e3)
        after, call_cpu = [], []
        for _ in range(repeats):
            c0 = time.process_time()
            fn()
            t0 = time.process_time()
            time.sleep(window)
            after.append((time.process_time() - t0) * 1e3)
            call_cpu.append((t0 - c0) * 1e3)
            time.sleep(0.3)  # let any spinning end before the next call
    return {"impl": impl, "shape": list(shape), "threads": nt, "window_ms": window * 1e3,
            "baseline_ms": base, "after_ms": after, "call_cpu_ms": call_cpu,
            "os_threads": _threads_in_process()}


def idle_benchmark(impl, shape=(1, 8, 512, 64), dtype="float32", causal=False, n_threads=None,
                   window=0.2, repeats=5):
    """:func:`idle_child` in a fresh subprocess; returns its dict."""
    args = dict(impl=impl, shape=tuple(shape), dtype=np.dtype(dtype).name, causal=bool(causal),
                n_threads=n_threads, window=window, repeats=repeats)
    code = ("import json; from fastattn import _bench; "
            f"print(json.dumps(_bench.idle_child(**{args!r})))")
    return _run_child(code)


def start_competitor(cpu=None):
    """Start a CPU-bound Python busy loop pinned to one core; returns the ``Popen``.

    ``cpu`` defaults to the highest CPU this process may run on.  The caller
    stops it with ``proc.kill(); proc.wait()``.
    """
    if cpu is None:
        cpu = max(os.sched_getaffinity(0))
    code = (f"import os; os.sched_setaffinity(0, {{{int(cpu)}}}); print('ready', flush=True)\n"
            "while True: pass\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    proc.stdout.readline()  # pinned and about to spin
    time.sleep(0.1)
    return proc
