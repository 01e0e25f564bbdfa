"""Shared fixtures, tolerances and array builders for the fastattn tests.

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
import pytest
from hypothesis import HealthCheck, settings

import fastattn
from fastattn import _kernels
from fastattn._reference import scaled_dot_product_attention as oracle_sdpa

# --------------------------------------------------------------------------
# Hypothesis profiles (see docs/testing.md).  Chosen by HYPOTHESIS_PROFILE:
#
# ci    (the default) derandomized -- every run draws the same examples, so a
#       red CI run is red again locally -- no example database, no deadline
#       (the machine is shared; timing is not a property), and the failing
#       example's reproduction blob printed.  Budgeted so that every property
#       file together stays within ~30 s of the default pytest run.
# long  25x the examples, random (a fresh search each run), failures kept in
#       the local .hypothesis/ database and replayed first on the next run.
#
# Property tests take their example count from ``prop_settings(weight)``:
# weight x the profile's base count, so one profile scales every test.

PROFILE_BASE_EXAMPLES = {"ci": 20, "long": 500}

settings.register_profile(
    "ci", max_examples=PROFILE_BASE_EXAMPLES["ci"], deadline=None, derandomize=True,
    database=None, print_blob=True, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile(
    "long", max_examples=PROFILE_BASE_EXAMPLES["long"], deadline=None, derandomize=False,
    print_blob=True, suppress_health_check=[HealthCheck.too_slow])
HYPOTHESIS_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.load_profile(HYPOTHESIS_PROFILE)


def prop_settings(weight=1.0, **overrides):
    """Settings of one property test: ``weight`` x the profile's base example
    count (cheap tests get more, costly ones less), the rest from the profile."""
    n = max(1, round(settings.default.max_examples * weight))
    return settings(max_examples=n, **overrides)


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


# --------------------------------------------------------------------------
# Global state: SIMD dispatch and thread count.

def _simd_capable() -> bool:
    """True when this build and CPU can run the AVX2 kernels (state restored)."""
    was = _kernels.simd_active()
    _kernels.set_simd_disabled(False)
    cap = _kernels.simd_active()
    _kernels.set_simd_disabled(not was)
    return cap


SIMD_CAPABLE = _simd_capable()
_INITIAL_SIMD = _kernels.simd_active()


def _restore_simd():
    _kernels.set_simd_disabled(not _INITIAL_SIMD if SIMD_CAPABLE else True)


@pytest.fixture(params=["simd", "scalar"])
def simd_mode(request):
    """Run the test once with the AVX2 kernels and once with the scalar ones."""
    if request.param == "simd":
        if not SIMD_CAPABLE:
            pytest.skip("this CPU/build has no AVX2+FMA kernels")
        _kernels.set_simd_disabled(False)
        assert fastattn.simd_active()
    else:
        _kernels.set_simd_disabled(True)
        assert not fastattn.simd_active()
    try:
        yield request.param
    finally:
        _restore_simd()


@pytest.fixture(autouse=True)
def _global_state_guard():
    """Every test leaves SIMD dispatch and the thread default as it found them."""
    simd_before = _kernels.simd_active()
    threads_before = fastattn._threads._global_threads
    yield
    _restore_simd()
    fastattn.set_num_threads(threads_before)
    assert _kernels.simd_active() == simd_before
    assert fastattn._threads._context_threads.get() is None


@pytest.fixture
def rng():
    return np.random.default_rng(20240611)


def randn(rng, shape, dtype=np.float64, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


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
