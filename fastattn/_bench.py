"""Timing helpers and a plain-NumPy baseline for ``python -m fastattn`` and ``benchmarks/``.

Nothing in the library calls this module.  The baseline here is what a
NumPy user would write (``softmax(scale * Q K^T) V`` in the inputs' dtype, in
place where NumPy allows); it is *not* the float64 oracle in
:mod:`fastattn._reference`, which is written for clarity rather than speed.
"""
from __future__ import annotations

import math
import statistics
import time

import numpy as np

__all__ = [
    "numpy_sdpa",
    "causal_mask",
    "random_qkv",
    "time_call",
    "format_us",
    "micro_unit",
    "load_torch",
    "torch_sdpa_callable",
    "run_bench",
]


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


def time_call(fn, budget=0.2, min_repeats=5, max_repeats=1000, min_sample=2e-4):
    """Median seconds per call of ``fn()``.

    One warm-up call, then repeated samples of ``number`` back-to-back calls
    (``number`` chosen so a sample lasts at least ``min_sample`` seconds),
    as many samples as fit in ``budget`` seconds, clamped to
    ``[min_repeats, max_repeats]`` (sampling stops once ``budget`` is spent
    and ``min_repeats`` samples are in).
    """
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
    return statistics.median(samples)


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


BENCH_SHAPES = (
    (1, 1, 16, 64),
    (1, 8, 128, 64),
    (8, 8, 128, 64),
    (1, 8, 512, 64),
    (4, 8, 512, 64),
    (1, 8, 2048, 64),
)


def run_bench(shapes=BENCH_SHAPES, dtype="float32", causal=False, budget=0.2,
              use_torch=True, n_threads=None, file=None):
    """Print a table: median µs of fastattn, NumPy and torch (when importable) per shape.

    Returns 0, or 1 when a result disagrees with the NumPy baseline.
    """
    import sys

    import fastattn

    stream = file or sys.stdout

    def emit(line):
        print(line, file=stream, flush=True)

    dt = np.dtype(dtype)
    nt = fastattn.get_num_threads() if n_threads is None else n_threads
    torch = load_torch(nt) if use_torch else None
    tol = {np.dtype(np.float32): 1e-4, np.dtype(np.float64): 1e-10}[dt]

    emit(f"fastattn {fastattn.__version__} bench: scaled_dot_product_attention, {dt.name}"
         f"{', causal' if causal else ''}; {nt} thread(s), "
         f"SIMD {'on' if fastattn.simd_active() else 'off'}; "
         f"median {micro_unit(stream)} per call")
    if use_torch and torch is None:
        emit("torch is not importable: its column is left out")
    head = f"{'BxHxNxd':>16} {'fastattn':>10} {'numpy':>10} {'numpy/fa':>9}"
    if torch is not None:
        head += f" {'torch':>10} {'torch/fa':>9}"
    head += f" {'max|diff|':>10}"  # fastattn vs NumPy
    emit(head)
    status = 0
    for shape in shapes:
        q, k, v = random_qkv(shape, dt)
        L = shape[-2]
        mask = causal_mask(L, L) if causal else None

        def fa():
            return fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal, n_threads=nt)

        def npy():
            return numpy_sdpa(q, k, v, mask)

        expected = npy()
        err = float(np.max(np.abs(fa() - expected)))
        t_fa = time_call(fa, budget)
        t_np = time_call(npy, budget)
        row = (f"{'x'.join(map(str, shape)):>16} {format_us(t_fa):>10} {format_us(t_np):>10}"
               f" {t_np / t_fa:>8.2f}x")
        if torch is not None:
            tfn = torch_sdpa_callable(torch, q, k, v, causal)
            with torch.inference_mode():
                t_t = time_call(tfn, budget)
            row += f" {format_us(t_t):>10} {t_t / t_fa:>8.2f}x"
        row += f" {err:>10.1e}"
        if not err <= tol * max(1.0, float(np.max(np.abs(expected)))):
            row += "  MISMATCH"
            status = 1
        emit(row)
    emit("x/fa > 1 means fastattn is faster than x; max|diff| = largest |fastattn - numpy|")
    return status
