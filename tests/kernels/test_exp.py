"""Accuracy of the dispatched vector exp (fastattn._kernels.exp), SIMD and scalar.

ULP error = |got - exact| / ulp(exact), where ulp(exact) is the spacing of
the target dtype at the exact value's magnitude: 2**(floor(log2|exact|) - p + 1)
for normal magnitudes and the smallest subnormal below the normal range.
The exact value comes from np.longdouble (x87 80-bit: 11 more bits than
float64, so its own error is < 1/1000 float64 ulp), checked against mpmath.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _kernels

HAVE_X87 = np.finfo(np.longdouble).nmant >= 63

MAX_ULP = {np.float32: 2.0, np.float64: 1.0}
SOFTMAX_RANGE = {np.float32: (-110.0, 0.0), np.float64: (-750.0, 0.0)}
FLOATS = [np.float32, np.float64]


def kexp(x):
    x = np.ascontiguousarray(x)
    y = np.empty_like(x)
    _kernels.exp(x, y)
    return y


def exact_exp(x):
    """exp(x) as np.longdouble (80-bit) -- or via mpmath where longdouble is not extended."""
    x = np.asarray(x)
    if HAVE_X87:
        with np.errstate(over="ignore"):
            return np.exp(x.astype(np.longdouble))
    mpmath = pytest.importorskip("mpmath")  # pragma: no cover - non-x86 platforms
    mpmath.mp.prec = 120
    return np.array([float(mpmath.exp(mpmath.mpf(float(t)))) for t in x.ravel()],
                    dtype=np.longdouble).reshape(x.shape)


def ulp_error(got, x, dtype):
    fi = np.finfo(dtype)
    ref = exact_exp(x)
    _, e = np.frexp(ref)  # ref = m * 2**e, 0.5 <= m < 1
    lead = np.maximum(e.astype(np.int64) - 1, fi.minexp)  # subnormals share the min spacing
    ulp = np.ldexp(np.longdouble(1), (lead - fi.nmant).astype(np.int32))
    return np.abs(got.astype(np.longdouble) - ref) / ulp


def refined_max_error(got, x, dtype, limit):
    """Max ulp error; points over ``limit`` are re-measured with mpmath (when importable)
    so that the reference's own rounding (2**-11 float64 ulp) cannot fail the test."""
    err = ulp_error(got, x, dtype)
    bad = np.flatnonzero(err > limit)
    if bad.size == 0:
        return float(err.max()), x[int(np.argmax(err))]
    try:
        import mpmath
    except ImportError:  # pragma: no cover
        return float(err.max()), x[int(np.argmax(err))]
    mpmath.mp.prec = 160
    fi = np.finfo(dtype)
    worst = (0.0, None)
    for i in bad[:2000]:
        ex = mpmath.exp(mpmath.mpf(float(x[i])))
        lead = max(int(mpmath.floor(mpmath.log(ex, 2))), fi.minexp)
        e = float(abs(mpmath.mpf(float(got[i])) - ex) / mpmath.ldexp(1, lead - fi.nmant))
        if e > worst[0]:
            worst = (e, x[i])
    return worst


def dense_sample(dtype, lo, hi, rng):
    dtype = np.dtype(dtype)
    parts = [
        np.linspace(lo, hi, 1_000_001),
        rng.uniform(lo, hi, 500_000),
        -np.logspace(-30, np.log10(max(-lo, 1e-30)), 100_000) if lo < 0 else np.logspace(-30, np.log10(hi), 100_000),
    ]
    x = np.concatenate(parts).astype(dtype)
    x = x[(x >= lo) & (x <= hi)]
    # every representable value around interesting points
    fi = np.finfo(dtype)
    points = [0.0, -1.0, -np.log(2.0), np.log(fi.tiny), np.log(fi.smallest_subnormal), lo, hi]
    if hi > 0:
        points.append(np.log(fi.max) * 0.999)
    nbr = []
    for p in points:
        t = np.array([p], dtype=dtype)
        a, b = t.copy(), t.copy()
        for _ in range(200):
            a = np.nextafter(a, dtype.type(-np.inf))
            b = np.nextafter(b, dtype.type(np.inf))
            nbr.append(a.copy())
            nbr.append(b.copy())
    nb = np.concatenate(nbr)
    nb = nb[(nb >= lo) & (nb <= hi)]
    return np.concatenate([x, nb])


def test_reference_is_accurate():
    """Cross-check the longdouble reference against mpmath where mpmath is importable."""
    try:
        import mpmath  # noqa: F811
    except ImportError:  # pragma: no cover - then only the x87 check below runs
        assert HAVE_X87
        assert np.exp(np.longdouble(1)) != np.longdouble(np.e)  # more precise than float64
        return
    mpmath.mp.prec = 120
    xs = np.concatenate([np.linspace(-750, 700, 301), [-745.1, -708.4, -103.9, -87.3, 0.5]])
    for x in xs:
        ref = exact_exp(np.array([x]))[0]
        ex = mpmath.exp(mpmath.mpf(float(x)))
        rel = abs((mpmath.mpf(np.format_float_scientific(ref, unique=True)) - ex) / ex)
        assert rel < 2.0**-60, (x, rel)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_exp_softmax_range(simd_mode, dtype, rng):
    lo, hi = SOFTMAX_RANGE[dtype]
    x = dense_sample(dtype, lo, hi, rng)
    got = kexp(x)
    assert got.dtype == dtype
    assert np.all(np.isfinite(got))
    worst, at = refined_max_error(got, x, dtype, MAX_ULP[dtype])
    assert worst <= MAX_ULP[dtype], f"max error {worst:.5f} ulp at x={at!r}"


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_exp_positive_range(simd_mode, dtype, rng):
    """Up to the largest x whose exp is finite (streaming rescale factors are <= 1, but
    exp is exported for any input)."""
    hi = float(np.log(np.finfo(dtype).max)) * (1 - 1e-7 if dtype == np.float32 else 1 - 1e-15)
    x = dense_sample(dtype, 0.0, np.float64(dtype(hi)), rng)
    x = x[exact_exp(x) <= np.finfo(dtype).max]
    got = kexp(x)
    worst, at = refined_max_error(got, x, dtype, MAX_ULP[dtype])
    assert worst <= MAX_ULP[dtype], f"max error {worst:.5f} ulp at x={at!r}"


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_exp_subnormal_and_underflow(simd_mode, dtype):
    """Every representable x in a band across the subnormal range and the cut to 0."""
    fi = np.finfo(dtype)
    lo = np.log(fi.smallest_subnormal) - 2.0
    hi = np.log(fi.tiny) + 1.0
    x = np.linspace(lo, hi, 400_001).astype(dtype)
    got = kexp(x)
    worst, at = refined_max_error(got, x, dtype, MAX_ULP[dtype])
    assert worst <= MAX_ULP[dtype], f"max error {worst:.5f} ulp at x={at!r}"
    ref = exact_exp(x)
    assert np.all(got[ref < fi.smallest_subnormal / 2 * 0.999] == 0)
    assert np.all(got >= 0)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_exp_special_values(simd_mode, dtype):
    t = np.dtype(dtype).type
    fi = np.finfo(dtype)
    x = np.array([-np.inf, np.nan, 0.0, -0.0, np.inf, -1e30, 1e30, fi.smallest_subnormal,
                  -fi.smallest_subnormal, fi.tiny, -fi.tiny, fi.eps, -fi.epsneg, np.log(2.0),
                  -np.log(2.0), 10 * np.log(2.0), -1000.0, 1000.0, -np.nan], dtype=dtype)
    y = kexp(x)
    assert y[0] == 0.0 and not np.signbit(y[0]), "exp(-inf) must be exactly +0"
    assert np.isnan(y[1]) and np.isnan(y[-1])
    assert y[2] == 1.0 and y[3] == 1.0
    assert y[4] == np.inf
    assert y[5] == 0.0 and y[6] == np.inf
    assert np.all(y[7:11] == 1.0)
    assert y[11] == t(1) + fi.eps or y[11] == 1.0  # 1 + eps rounds to 1 + eps or 1
    err = ulp_error(y[11:16], x[11:16], dtype)
    assert float(err.max()) <= MAX_ULP[dtype]
    assert y[16] == 0.0 and y[17] == np.inf
    # overflow: first x whose exact exp exceeds the largest finite value (+ half an ulp)
    over = np.log(np.longdouble(fi.max)) * (1 + (1e-6 if dtype == np.float32 else 1e-14))
    xo = np.array([over, over + 1, 200.0, 800.0], dtype=dtype)
    assert np.all(kexp(xo)[exact_exp(xo) > np.longdouble(fi.max) * (1 + fi.eps)] == np.inf)
    # -inf and NaN inside an otherwise normal vector do not disturb neighbours
    v = np.array([-1.0, -np.inf, -2.0, np.nan, -3.0, -np.inf, np.nan, -4.0, -5.0], dtype=dtype)
    yv = kexp(v)
    assert yv[1] == 0 and yv[5] == 0 and np.isnan(yv[3]) and np.isnan(yv[6])
    fin = np.isfinite(v)
    assert float(ulp_error(yv[fin], v[fin], dtype).max()) <= MAX_ULP[dtype]


@pytest.mark.parametrize("n", list(range(0, 20)) + [31, 32, 33, 1000, 1001])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_exp_lengths_and_in_place(simd_mode, dtype, n, rng):
    """Vector tails of every length, and x is y (in place) as the C API allows."""
    x = rng.uniform(-20, 5, n).astype(dtype)
    y = kexp(x)
    if n:
        assert float(ulp_error(y, x, dtype).max()) <= MAX_ULP[dtype]
    z = x.copy()
    _kernels.exp(z, z)
    np.testing.assert_array_equal(z, y)
    # a guard element after the output is not written
    buf = np.full(n + 1, 7.0, dtype)
    _kernels.exp(x, buf[:n])
    assert buf[n] == 7.0
    np.testing.assert_array_equal(buf[:n], y)


def test_simd_and_scalar_both_exercised():
    """The simd_mode fixture really switches the kernel (results differ somewhere)."""
    from support import SIMD_CAPABLE, _restore_simd
    if not SIMD_CAPABLE:  # pragma: no cover
        pytest.skip("no AVX2")
    x = np.linspace(-80, 0, 100_000).astype(np.float32)
    try:
        _kernels.set_simd_disabled(False)
        a = kexp(x)
        _kernels.set_simd_disabled(True)
        b = kexp(x)
    finally:
        _restore_simd()
    assert not np.array_equal(a, b)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
@pytest.mark.parametrize("m", [0.0, 3.25, -17.5, 60.0])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_expsub_softmax_rows(simd_mode, dtype, m, masked, rng):
    """The softmax row operation (its exp assumes x - m <= 0): exp(x - m) in place
    within the same ulp bound, exact 0 for -inf, NaN kept, the sum returned."""
    lo, hi = SOFTMAX_RANGE[dtype]
    x = (dense_sample(dtype, lo, hi, rng) + dtype(m)).astype(dtype)
    x = x[x <= dtype(m)]
    diff = x - dtype(m)            # what the kernel exponentiates, rounded as it is
    y = x.copy()
    total = _kernels.expsub(y, m, masked)
    worst, at = refined_max_error(y, diff, dtype, MAX_ULP[dtype])
    assert worst <= MAX_ULP[dtype], f"max error {worst:.5f} ulp at x-m={at!r}"
    # the sum, over a row of a realistic length (the accumulation is plain summation)
    part = rng.choice(x, 4096)
    ref_sum = float(np.sum(exact_exp(part - dtype(m)), dtype=np.longdouble))
    got_sum = _kernels.expsub(part, m, masked)
    rel = 1e-5 if dtype == np.float32 else 1e-13
    assert abs(got_sum - ref_sum) <= rel * ref_sum, (got_sum, ref_sum)
    assert total > 0
    row = np.array([m, -np.inf, m - 1, np.nan, -np.inf, m - 200, m - 2, m - 3, m - 4], dtype)
    total = _kernels.expsub(row, m, masked)
    assert row[0] == 1.0 and row[1] == 0.0 and row[4] == 0.0 and np.isnan(row[3])
    assert np.isnan(total)
    # every length of masked and unmasked lanes, -inf anywhere (vector tails too)
    for n in range(1, 20):
        live = rng.random(n) < 0.6
        live[0] = True
        xs = np.where(live, rng.uniform(-30, 0, n) + m, -np.inf).astype(dtype)
        xs[0] = dtype(m)
        ref = np.exp((xs - dtype(m)).astype(np.float64))  # the difference rounded as in the kernel
        ys = xs.copy()
        tot = _kernels.expsub(ys, m, masked)
        assert np.all(ys[~live] == 0) and np.all(ys[live] > 0)
        np.testing.assert_allclose(ys, ref, rtol=4 * np.finfo(dtype).eps, atol=0)
        assert np.isclose(tot, ref.sum(), rtol=8 * np.finfo(dtype).eps)
