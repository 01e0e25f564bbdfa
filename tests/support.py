"""Helpers shared by the fastattn tests: the tolerance table and the oracle,
array builders and memory layouts, SIMD state, child processes, property
budgets, and the checks of the hypothesis property files (tests/properties/).

Import them with ``from support import ...`` from any folder under tests/:
pytest's default (prepend) import mode puts tests/ on sys.path when it
imports tests/conftest.py.  The fixtures, hooks and hypothesis profiles are
in conftest.py.

Every numeric result is checked against the float64 NumPy oracle
``fastattn._reference.scaled_dot_product_attention``; the oracle is always
fed the *same* (already rounded) input values as the kernel, so the only
differences are the kernel's own rounding errors.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st

import fastattn
from fastattn import _kernels
from fastattn._reference import scaled_dot_product_attention as oracle_sdpa
from fastattn.similarity import ParamSpec, Similarity


# --------------------------------------------------------------------------
# Paths: tests/ (this file's folder), the checkout's root above it, and the
# folders of test files under tests/ (one per part of fastattn; README.md).

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)
TEST_FOLDERS = tuple(sorted(
    path for path in (os.path.join(TESTS_DIR, name) for name in os.listdir(TESTS_DIR))
    if os.path.isdir(path) and any(f.startswith("test_") and f.endswith(".py")
                                   for f in os.listdir(path))))


# --------------------------------------------------------------------------
# Tolerances: the one table.
#
# (rtol, atol), where atol is relative to the value scale: assert_close uses
# atol * max(1, max|reference|).
#
# float64: scores are dot products of length d (<= 128 here) and the output a
#   weighted mean of up to 2048 rows; summation error is ~ sqrt(n) * eps with
#   eps = 1.1e-16, plus exp error (<= 1 ulp), i.e. ~1e-14 in the worst cases.
#   1e-12 leaves two orders of margin while still catching any real bug
#   (a wrong mask, scale or softmax shows up at 1e-3 or worse).
# float32: the same analysis with eps = 6e-8 gives ~1e-7 typical, ~1e-6 worst
#   case (SIMD exp is within 2 ulp, the streaming path rescales the
#   accumulator once per 256-key tile; worst observed over the shape grid:
#   6.7e-7 absolute); 2e-5 is a 30x margin and far below any semantic error.
# float16: computed in float32 then rounded once to float16 (eps = 9.8e-4),
#   so the result is within half an ulp of float16 plus float32 noise.
TOLERANCES = {
    np.dtype(np.float16): (2e-3, 2e-3),
    np.dtype(np.float32): (2e-5, 2e-5),
    np.dtype(np.float64): (1e-12, 1e-12),
}


def tol(dtype):
    return TOLERANCES[np.dtype(dtype)]


def assert_close(got, ref, dtype=None, err_msg=""):
    """Compare a kernel result to a float64 reference with the table above."""
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    dtype = got.dtype if dtype is None else np.dtype(dtype)
    rtol, atol = tol(dtype)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    finite = ref[np.isfinite(ref)]
    scale = max(1.0, float(np.max(np.abs(finite)))) if finite.size else 1.0
    np.testing.assert_allclose(
        got.astype(np.float64), ref, rtol=rtol, atol=atol * scale, equal_nan=True,
        err_msg=err_msg,
    )


def oracle(q, k, v, attn_mask=None, is_causal=False, scale=None, *,
           causal_alignment="top_left", return_weights=False):
    """The float64 oracle (inputs upcast exactly; masks passed through)."""
    return oracle_sdpa(q, k, v, attn_mask, is_causal, scale,
                       causal_alignment=causal_alignment, return_weights=return_weights)


def allowed_matrix(Lq, Lk, attn_mask=None, is_causal=False, causal_alignment="top_left"):
    """Boolean 'may attend' matrix (broadcast over the mask's leading dims)."""
    allowed = np.ones((Lq, Lk), dtype=bool)
    if attn_mask is not None:
        m = np.asarray(attn_mask)
        if m.dtype == np.bool_:
            allowed = allowed & m
        else:
            allowed = allowed & (m != -np.inf)
    if is_causal:
        off = 0 if causal_alignment == "top_left" else Lk - Lq
        allowed = allowed & (np.arange(Lk)[None, :] <= np.arange(Lq)[:, None] + off)
    return allowed


def check_weights(w, allowed, dtype):
    """Rows with an allowed key sum to 1; forbidden entries and fully masked rows are 0."""
    w = np.asarray(w, dtype=np.float64)
    allowed = np.broadcast_to(allowed, w.shape)
    rtol, atol = tol(dtype)
    assert np.all(w[~allowed] == 0.0), "weight on a forbidden key"
    any_allowed = allowed.any(axis=-1)
    sums = w.sum(axis=-1)
    np.testing.assert_allclose(sums[any_allowed], 1.0, rtol=0, atol=atol)
    assert np.all(w >= 0)


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# --------------------------------------------------------------------------
# Global state: SIMD dispatch (the fixtures in conftest.py restore it, and
# the thread count, after every test).

def _simd_capable() -> bool:
    """True when this build and CPU can run the AVX2 kernels (state restored)."""
    was = _kernels.simd_active()
    _kernels.set_simd_disabled(False)
    cap = _kernels.simd_active()
    _kernels.set_simd_disabled(not was)
    return cap


SIMD_CAPABLE = _simd_capable()
_INITIAL_SIMD = _kernels.simd_active()
_INITIAL_SIMD_CAP = _kernels.simd_max_level()


def _top_isa():
    """The best vector ISA this build and CPU run ("avx512", "avx2" or None),
    whatever FASTATTN_DISABLE_SIMD / FASTATTN_SIMD asked for (state restored)."""
    was_on = _kernels.simd_active()
    _kernels.set_simd_disabled(False)
    _kernels.set_simd_max_level(2)
    top = {0: None, 1: "avx2", 2: "avx512"}[_kernels.simd_level()]
    _kernels.set_simd_max_level(_INITIAL_SIMD_CAP)
    _kernels.set_simd_disabled(not was_on)
    return top


SIMD_TOP_ISA = _top_isa()


def _restore_simd():
    _kernels.set_simd_disabled(not _INITIAL_SIMD if SIMD_CAPABLE else True)
    _kernels.set_simd_max_level(_INITIAL_SIMD_CAP)


# --------------------------------------------------------------------------
# Memory layouts.  Each returns an array equal to ``a`` (same values, dtype
# and shape) laid out differently.  All but "unaligned" need no copy.

NO_COPY_LAYOUTS = ("C", "strided", "padded", "transposed", "flipped_batch", "readonly", "memmap")


def make_layout(a: np.ndarray, layout: str, tmp_path=None, name="x") -> np.ndarray:
    a = np.asarray(a)
    if layout == "C":
        r = np.ascontiguousarray(a).copy()
    elif layout == "strided":  # every other row of a buffer twice as long
        big = np.full(a.shape[:-2] + (2 * a.shape[-2], a.shape[-1]), np.nan, a.dtype)
        big[..., ::2, :] = a
        r = big[..., ::2, :]
    elif layout == "padded":  # rows of a wider buffer (row stride > feature size)
        big = np.full(a.shape[:-1] + (a.shape[-1] + 3,), np.nan, a.dtype)
        big[..., 1:a.shape[-1] + 1] = a
        r = big[..., 1:a.shape[-1] + 1]
    elif layout == "transposed":  # (B, L, H, d).transpose(0, 2, 1, 3)
        assert a.ndim >= 3
        blhd = np.ascontiguousarray(np.swapaxes(a, -3, -2))
        r = np.swapaxes(blhd, -3, -2)
    elif layout == "flipped_batch":  # negative strides on the batch dims
        assert a.ndim >= 3
        axes = tuple(range(a.ndim - 2))
        r = np.flip(np.ascontiguousarray(np.flip(a, axes)), axes)
    elif layout == "readonly":
        r = a.copy()
        r.flags.writeable = False
    elif layout == "memmap":
        assert tmp_path is not None
        fn = os.path.join(str(tmp_path), f"{name}.bin")
        mm = np.memmap(fn, dtype=a.dtype, mode="w+", shape=a.shape)
        mm[...] = a
        mm.flush()
        del mm
        r = np.memmap(fn, dtype=a.dtype, mode="r", shape=a.shape)
    elif layout == "unaligned":
        buf = np.zeros(a.nbytes + a.itemsize, dtype=np.uint8)
        r = np.ndarray(a.shape, a.dtype, buffer=buf, offset=1)
        r[...] = a
    else:  # pragma: no cover
        raise ValueError(layout)
    assert r.shape == a.shape and r.dtype == a.dtype
    np.testing.assert_array_equal(r, a)
    return r


# --------------------------------------------------------------------------
# Child processes (env-var and memory-capped tests) must import the *same*
# fastattn as this process -- the installed one or the in-place build -- and
# never an unbuilt source folder that happens to be the working directory.

FASTATTN_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(fastattn.__file__)))


def run_child(code, args=(), env_update=None, env_remove=(), timeout=300):
    env = dict(os.environ)
    for name in env_remove:
        env.pop(name, None)
    env.update(env_update or {})
    env["PYTHONPATH"] = FASTATTN_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    with tempfile.TemporaryDirectory() as cwd:
        return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                              env=env, cwd=cwd, timeout=timeout)


def run_in_threads(work, n):
    """Run ``work(i)`` for i in range(n) on n threads at once; wait for all."""
    import threading
    ts = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


# --------------------------------------------------------------------------
# Property budgets: the hypothesis profiles are registered in conftest.py
# (see docs/testing.md).

def prop_settings(weight=1.0, **overrides):
    """Settings of one property test: ``weight`` x the profile's base example
    count (cheap tests get more, costly ones less), the rest from the profile."""
    n = max(1, round(settings.default.max_examples * weight))
    return settings(max_examples=n, **overrides)


# --------------------------------------------------------------------------
# The hypothesis property files' helpers (tests/properties/).
#
# A *case* ``c`` is the dict a file's ``problems`` strategy draws: float64 arrays
# of float32-representable values (``q``, ``k``, ``v``; ``v is k`` when the value
# input is the key input), a mask ``m`` (None, boolean, or float with -inf),
# ``causal`` / ``align``, ``Lq`` / ``Lk``, ``dtype``, the case's ``rng``, and for
# self-attention ``self=True`` (then ``q``, ``k`` and ``v`` are one array).  The
# checks take the file's ``run(c, weights=..., dtype=...)`` (and ``oracle(c)``,
# whose first result is the output) as arguments.

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


class NegL1(Similarity):
    """A NumPy plugin: ``-gamma * sum_c |q_c - k_c|`` (runs on the tiled path)."""

    name = "props_neg_l1"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0)}
    same_dims = True

    def score(self, query, key, params):
        diff = np.abs(query[..., :, None, :] - key[..., None, :, :])
        return -params["gamma"] * np.sum(diff, axis=-1)


def f32(a):
    """float32-representable float64 values (so every dtype sees the same numbers)."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


# --------------------------------------------------------------------------
# Inputs

LAYOUTS_2D = ("C", "strided", "padded", "readonly", "fortran")
LAYOUTS_ND = LAYOUTS_2D + ("transposed", "flipped_batch")


def lay(a, layout, dtype):
    """``a`` (float64 values) in ``dtype`` with the given memory layout."""
    a = np.asarray(a).astype(dtype)
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout in ("transposed", "flipped_batch") and a.ndim < 3:
        layout = "C"
    return make_layout(a, layout)


def random_mask(draw, rng, kind, shape, fractions):
    """An attn_mask of ``shape``: ``kind`` "bool" is True with a probability drawn
    from ``fractions``; "float" is standard normal with about a quarter -inf."""
    if kind == "bool":
        return rng.random(shape) < draw(st.sampled_from(fractions))
    m = f32(rng.standard_normal(shape))
    m[rng.random(shape) < 0.25] = -np.inf
    return m


def score_bias(m, shape):
    """The mask ``m`` (None, boolean or float) as a float mask of ``shape``."""
    if m is None:
        return np.zeros(shape)
    if m.dtype == np.bool_:
        return np.where(np.broadcast_to(m, shape), 0.0, -np.inf)
    return np.broadcast_to(m, shape).copy()


def changed(rng, a, index):
    """A copy of ``a`` with new values (|x| ~ 3) at ``index``."""
    a = a.copy()
    a[index] = f32(3.0 * rng.standard_normal(a[index].shape))
    return a


def with_kv(c, k, v):
    """The case with new key and value inputs (value follows the key when shared;
    self-attention: the query too)."""
    if c.get("self"):
        return dict(c, q=k, k=k, v=k)
    return dict(c, k=k, v=k if c["v"] is c["k"] else v)


# --------------------------------------------------------------------------
# Comparisons and checks

def assert_agree(a, b, dtype, factor=2.0, atol_scale=1.0):
    """Two results that are each within the tolerance of the exact one."""
    rtol, atol = tol(dtype)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
    np.testing.assert_allclose(a, b, rtol=factor * rtol, atol=factor * atol * atol_scale * scale)


def assert_all_close(got, ref, dtype):
    """Results (output, weights, ...) all of ``dtype``, each within the
    tolerance of its float64 reference."""
    assert all(g.dtype == dtype for g in got), [g.dtype for g in got]
    for g, r in zip(got, ref, strict=True):
        assert_close(g, r, dtype)


def check_row_constant_invariance(run, c, shape, c_max):
    """The case's mask as a float mask of ``shape``, then plus a per-row constant
    in [-c_max, c_max]: the same output and weights.  Returns both weights."""
    base = score_bias(c["m"], shape)
    shift = f32(c["rng"].uniform(-c_max, c_max, shape[:-1] + (1,)))
    a, wa = run(dict(c, m=base), weights=True)
    b, wb = run(dict(c, m=base + shift), weights=True)
    # |shift| costs float32 rounding of the shifted scores (eps * c_max each)
    s = max(1.0, c_max / 8.0) if c["dtype"] == F32 else 1.0
    assert_agree(b, a, c["dtype"], atol_scale=s)
    assert_agree(wb, wa, c["dtype"], atol_scale=s)
    return wa, wb


def check_kv_permutation(run, c):
    """Keys and values permuted at random, and the masks' key axes with them
    (self-attention: also the mask's query axis): the same output, the weights'
    columns permuted; for self-attention the output and weight rows permuted too."""
    perm = c["rng"].permutation(c["Lk"])
    m = c["m"]
    if m is not None and m.shape[-1] == c["Lk"]:
        m = m[..., perm]
    if c.get("self") and m is not None and m.shape[-2] == c["Lq"]:
        m = m[..., perm, :]
    c2 = dict(with_kv(c, c["k"][..., perm, :], c["v"][..., perm, :]), m=m)
    if c.get("km") is not None:
        c2["km"] = c["km"][..., perm]
    (a, wa), (b, wb) = run(c, weights=True), run(c2, weights=True)
    if c.get("self"):
        a, wa = a[..., perm, :], wa[..., perm, :]
    assert_agree(b, a, c["dtype"])
    assert_agree(wb, wa[..., perm], c["dtype"])


def check_rows_unchanged(run, oracle, c, c2, weights, rows, weights_rows=None):
    """``run`` on ``c`` and ``c2`` gives bit-for-bit the same ``out[rows]`` (and
    weights, each through ``weights_rows``, at ``rows``); ``c2`` agrees with the oracle."""
    a, b = run(c, weights=weights), run(c2, weights=weights)
    if weights:
        (a, wa), (b, wb) = a, b
        if weights_rows is not None:
            wa, wb = weights_rows(wa), weights_rows(wb)
        np.testing.assert_array_equal(wa[rows], wb[rows])
    np.testing.assert_array_equal(a[rows], b[rows])
    assert_close(b, oracle(c2)[0], c["dtype"])


def check_causal_rows(run, oracle, c, t, weights):
    """Rows whose causal limit is before key ``t`` are bit-for-bit unchanged when
    keys and values from ``t`` on change."""
    Lq, Lk = c["Lq"], c["Lk"]
    off = 0 if c["align"] == "top_left" else Lk - Lq
    n = min(Lq, max(0, t - off))  # rows r with r + off < t
    idx = (Ellipsis, slice(t, None), slice(None))
    c2 = with_kv(c, changed(c["rng"], c["k"], idx), changed(c["rng"], c["v"], idx))
    check_rows_unchanged(run, oracle, c, c2, weights, (Ellipsis, slice(None, n), slice(None)))


def check_padded_keys(run, oracle, c, weights, weights_rows=None):
    """Keys/values where key_mask (``c["km"]``, one more key made padding) is
    False: any values, the same result bit-for-bit (self-attention: for the
    rows whose query did not change)."""
    km = c["km"].copy()
    km[..., c["rng"].integers(0, c["Lk"])] = False
    c = dict(c, km=km)
    pad = ~km
    c2 = with_kv(c, changed(c["rng"], c["k"], pad), changed(c["rng"], c["v"], pad))
    rows = km if c["self"] else np.ones(km.shape[:-1] + (c["Lq"],), bool)
    check_rows_unchanged(run, oracle, c, c2, weights, rows, weights_rows)


def check_float32_and_float64_agree(run_in, factor=1.0):
    """``run_in(dtype)`` -> (output, weights) for float32 and float64: each keeps
    its dtype, and they agree within ``factor`` x the float32 tolerance."""
    o32, w32 = run_in(F32)
    o64, w64 = run_in(F64)
    assert o32.dtype == F32 and o64.dtype == F64
    assert_agree(o32, o64, F32, factor=factor)
    assert_agree(w32, w64, F32, factor=factor)


# --------------------------------------------------------------------------
# Gradients: central finite differences.

def assert_central_differences(loss, args, grads, rng, points=4, h=1e-6, rtol=1e-6, atol=1e-8):
    """Each ``grads[k]`` against (loss(.., args[k] + h e, ..) - loss(.., - h e, ..)) / 2h at
    ``points`` random entries of ``args[k]`` (float64 arrays; a non-finite entry,
    e.g. a -inf mask value, must have an exact zero gradient instead)."""
    for k, (arr, grad) in enumerate(zip(args, grads)):
        for idx in [tuple(int(rng.integers(0, n)) for n in arr.shape) for _ in range(points)]:
            if not np.isfinite(arr[idx]):
                assert grad[idx] == 0, (k, idx)
                continue
            hi, lo = list(args), list(args)
            hi[k], lo[k] = arr.copy(), arr.copy()
            hi[k][idx] += h
            lo[k][idx] -= h
            fd = (loss(*hi) - loss(*lo)) / (2 * h)
            np.testing.assert_allclose(grad[idx], fd, rtol=rtol, atol=atol, err_msg=f"arg {k} {idx}")
