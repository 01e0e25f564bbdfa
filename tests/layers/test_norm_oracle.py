"""functional.layer_norm / gelu / relu / dropout_backward and their backwards
against the independent float64 oracle of fastattn._reference (the
layer_norm backward there is the explicit per-row Jacobian; the GELU uses
the normal CDF ``ndtr`` and the tanh form as ``x sigmoid(2u)``).

float64 inputs to the float64 tolerance of tests/support.py (1e-12); float32
inputs -- the oracle fed the same float32 values upcast -- to the float32
one; float16 inputs (the elementwise ops and layer_norm's backward) to the
float16 one, their results float16 (docs/bad_input.md row 5).  Shapes: E = 1, 3, 8, leading dims (), (2, 3) and zero rows; weight and
bias present or None.  Every call gets read-only inputs and checks them
unchanged afterwards.  The oracle itself is checked once against central
differences, and ``test_the_comparison_catches_wrong_formulas`` shows that
the comparisons used here reject plausible mistakes (unbiased variance, a
missing term of the backward, the other GELU form).
"""
from __future__ import annotations

import numpy as np
import pytest

import fastattn._reference as R
from fastattn import functional as F
from support import assert_central_differences, assert_close, randn

DTYPES = [np.float64, np.float32]
#: the elementwise ops also take float16 (computed in float32 or wider, returned as
#: float16: docs/bad_input.md row 5), to the float16 tolerance of tests/support.py
ACT_DTYPES = DTYPES + [np.float16]
SHAPES = [(1,), (3,), (8,), (2, 3, 1), (2, 3, 3), (2, 3, 8), (0, 3), (2, 0, 8)]
AFFINE = [(True, True), (True, False), (False, True), (False, False)]


def _frozen(*arrays):
    """Read-only copies (a write raises) and snapshots to compare against."""
    out = []
    for a in arrays:
        if a is None:
            out.append(None)
            continue
        a = np.array(a, copy=True)
        a.setflags(write=False)
        out.append(a)
    return out, [None if a is None else a.copy() for a in out]


def _assert_unchanged(arrays, saved):
    for i, (a, s) in enumerate(zip(arrays, saved)):
        if a is not None:
            np.testing.assert_array_equal(a, s, err_msg=f"argument {i} was modified")


def _ln_inputs(rng, shape, dtype, affine, bias):
    E = shape[-1]
    x = (randn(rng, shape, scale=3.0) + 5.0).astype(dtype)   # an offset: cancellation in x - mean
    g = randn(rng, shape, dtype)
    w = randn(rng, (E,), dtype) if affine else None
    b = randn(rng, (E,), dtype) if bias else None
    return x, w, b, g


# ----------------------------------------------------------------- layer_norm

@pytest.mark.parametrize("affine,bias", AFFINE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_matches_oracle(dtype, shape, affine, bias, rng):
    (x, w, b), saved = _frozen(*_ln_inputs(rng, shape, dtype, affine, bias)[:3])
    y = F.layer_norm(x, w, b, eps=1e-5)
    assert y.dtype == dtype and y.shape == x.shape
    assert_close(y, R.layer_norm(x, w, b, eps=1e-5), dtype)
    _assert_unchanged((x, w, b), saved)


@pytest.mark.parametrize("affine,bias", AFFINE)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ACT_DTYPES)   # float16 too: each gradient in its input's dtype
def test_layer_norm_backward_matches_oracle(dtype, shape, affine, bias, rng):
    (x, w, b, g), saved = _frozen(*_ln_inputs(rng, shape, dtype, affine, bias))
    dx, dw, db = F.layer_norm_backward(g, x, w, b, eps=1e-5)
    rdx, rdw, rdb = R.layer_norm_backward(g, x, w, b, eps=1e-5)
    assert dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, rdx, dtype, err_msg="dx")
    if affine:
        assert dw.dtype == dtype and dw.shape == w.shape
        assert_close(dw, rdw, dtype, err_msg="dweight")
    else:
        assert dw is None
    if bias:
        assert db.dtype == dtype and db.shape == b.shape
        assert_close(db, rdb, dtype, err_msg="dbias")
    else:
        assert db is None
    _assert_unchanged((x, w, b, g), saved)


@pytest.mark.parametrize("eps", [0.0, 1e-5, 0.5])
def test_layer_norm_eps_enters_the_variance(eps, rng):
    x, w, b, g = _ln_inputs(rng, (4, 3), np.float64, True, True)
    x = x * 1e-2   # var ~ 1e-3: eps = 0.5 dominates it
    assert_close(F.layer_norm(x, w, b, eps=eps), R.layer_norm(x, w, b, eps=eps), np.float64)
    for got, ref in zip(F.layer_norm_backward(g, x, w, b, eps=eps),
                        R.layer_norm_backward(g, x, w, b, eps=eps)):
        assert_close(got, ref, np.float64)


def test_layer_norm_E1_and_constant_rows(rng):
    """A row of one element (or of equal elements) normalises to 0: the result
    is the bias, dx is 0 (the Jacobian of a constant row is (I - 1/E) / sqrt(eps))."""
    x = np.array([[3.0], [-7.0]])
    b = np.array([0.25])
    np.testing.assert_array_equal(F.layer_norm(x, np.array([2.0]), b), [[0.25], [0.25]])
    dx, dw, db = F.layer_norm_backward(np.array([[1.0], [2.0]]), x, np.array([2.0]), b)
    np.testing.assert_array_equal(dx, [[0.0], [0.0]])
    np.testing.assert_array_equal(dw, [0.0])
    np.testing.assert_array_equal(db, [3.0])
    xc = np.full((2, 4), 1.5)
    g = randn(rng, (2, 4))
    assert_close(F.layer_norm_backward(g, xc)[0], R.layer_norm_backward(g, xc)[0], np.float64)


def test_layer_norm_oracle_against_central_differences(rng):
    x, w, b, g = _ln_inputs(rng, (2, 3, 5), np.float64, True, True)
    loss = lambda x, w, b: float(np.sum(g * R.layer_norm(x, w, b)))  # noqa: E731
    assert_central_differences(loss, [x, w, b], R.layer_norm_backward(g, x, w, b), rng, points=6)


# ----------------------------------------------------------------- gelu, relu

ACT_SHAPES = [(), (1,), (3,), (2, 3, 5), (0, 4)]


def _act_input(rng, shape, dtype):
    x = randn(rng, shape, scale=3.0)
    if x.size >= 6:
        x.flat[:6] = [0.0, -0.0, 1e-9, -1e-9, 30.0, -30.0]   # 0, tiny, saturated
    return x.astype(dtype)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
def test_gelu_and_backward_match_oracle(dtype, shape, approximate, rng):
    (x, g), saved = _frozen(_act_input(rng, shape, dtype), randn(rng, shape, dtype))
    y = F.gelu(x, approximate=approximate)
    assert type(y) is np.ndarray and y.dtype == dtype and y.shape == x.shape   # 0-d: an array
    assert_close(y, R.gelu(x, approximate), dtype)
    dx = F.gelu_backward(g, x, approximate=approximate)
    assert type(dx) is np.ndarray and dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, R.gelu_backward(g, x, approximate), dtype)
    _assert_unchanged((x, g), saved)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_oracle_against_central_differences(approximate, rng):
    x, g = randn(rng, (3, 4), scale=2.0), randn(rng, (3, 4))
    loss = lambda x: float(np.sum(g * R.gelu(x, approximate)))  # noqa: E731
    assert_central_differences(loss, [x], [R.gelu_backward(g, x, approximate)], rng, points=8)


def test_gelu_modes_differ():
    """The two forms are distinguishable at the tolerances used above."""
    x = np.linspace(-3, 3, 13)
    assert np.max(np.abs(R.gelu(x, "none") - R.gelu(x, "tanh"))) > 1e-4
    assert np.max(np.abs(F.gelu(x, approximate="none") - F.gelu(x, approximate="tanh"))) > 1e-4


@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
def test_relu_and_backward_match_oracle(dtype, shape, rng):
    (x, g), saved = _frozen(_act_input(rng, shape, dtype), randn(rng, shape, dtype))
    y = F.relu(x)
    assert type(y) is np.ndarray and y.dtype == dtype and y.shape == x.shape   # 0-d: an array
    np.testing.assert_array_equal(y, R.relu(x))          # exact: a selection, no rounding
    dx = F.relu_backward(g, x)
    assert type(dx) is np.ndarray and dx.dtype == dtype and dx.shape == x.shape
    np.testing.assert_array_equal(dx, R.relu_backward(g, x))
    _assert_unchanged((x, g), saved)


def test_relu_at_zero_and_nan():
    x = np.array([-1.0, -0.0, 0.0, 2.0, np.nan])
    g = np.array([1.0, 2.0, 3.0, 4.0, 5.0])
    np.testing.assert_array_equal(F.relu(x), R.relu(x))
    assert np.isnan(F.relu(x)[4])
    np.testing.assert_array_equal(F.relu_backward(g, x), [0.0, 0.0, 0.0, 4.0, 5.0])  # as torch
    np.testing.assert_array_equal(R.relu_backward(g, x), [0.0, 0.0, 0.0, 4.0, 5.0])


# ----------------------------------------------------------------- dropout_backward

@pytest.mark.parametrize("p", [0.0, 0.3, 0.9])
@pytest.mark.parametrize("shape", ACT_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", ACT_DTYPES)
def test_dropout_backward_matches_oracle(dtype, shape, p, rng):
    x = randn(rng, shape, dtype)
    out, keep = F.dropout(x, p, rng=np.random.default_rng(5))
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == x.shape
    assert keep.dtype == np.bool_ and keep.shape == x.shape
    # the forward with the same mask is the backward's own formula applied to x
    assert_close(out, R.dropout_backward(x, keep, p), dtype, err_msg="dropout forward")
    (g, keep), saved = _frozen(randn(rng, shape, dtype), keep)
    dx = F.dropout_backward(g, keep, p)
    assert type(dx) is np.ndarray and dx.dtype == dtype and dx.shape == x.shape
    assert_close(dx, R.dropout_backward(g, keep, p), dtype)
    assert np.all(dx[~keep] == 0)
    _assert_unchanged((g, keep), saved)


def test_dropout_backward_with_a_given_mask():
    keep = np.array([[True, False, True], [False, False, True]])
    g = np.arange(1.0, 7.0).reshape(2, 3)
    want = np.array([[1.0, 0.0, 3.0], [0.0, 0.0, 6.0]]) / 0.75
    np.testing.assert_allclose(F.dropout_backward(g, keep, 0.25), want, rtol=1e-15)
    np.testing.assert_allclose(R.dropout_backward(g, keep, 0.25), want, rtol=1e-15)


# ----------------------------------------------------------------- the checks can fail

def test_the_comparison_catches_wrong_formulas(rng):
    """Plausible mistakes are rejected by the same assert_close used above."""
    x, w, b, g = _ln_inputs(rng, (2, 3, 5), np.float64, True, True)
    E = x.shape[-1]
    xc = x - x.mean(-1, keepdims=True)
    unbiased = xc / np.sqrt(xc.var(-1, ddof=1, keepdims=True) + 1e-5) * w + b
    no_eps = xc / np.sqrt(xc.var(-1, keepdims=True)) * w + b
    ref = R.layer_norm(x, w, b)
    for wrong in (unbiased, no_eps * (1 + 1e-9)):
        with pytest.raises(AssertionError):
            assert_close(wrong, ref, np.float64)
    # the backward without its mean(g x̂) x̂ term
    rstd = 1 / np.sqrt(xc.var(-1, keepdims=True) + 1e-5)
    gh = g * w
    partial = rstd * (gh - gh.mean(-1, keepdims=True))
    with pytest.raises(AssertionError):
        assert_close(partial, R.layer_norm_backward(g, x, w, b)[0], np.float64)
    # dweight summing g instead of g x̂
    with pytest.raises(AssertionError):
        assert_close(g.reshape(-1, E).sum(0), R.layer_norm_backward(g, x, w, b)[1], np.float64)
    # the other GELU form, in float32 too
    xs = randn(rng, (50,), scale=2.0)
    with pytest.raises(AssertionError):
        assert_close(F.gelu(xs.astype(np.float32), approximate="tanh"), R.gelu(xs.astype(np.float32)),
                     np.float32)
    # relu's gradient passing through at 0 (x >= 0 instead of x > 0)
    z, ones = np.array([0.0, 1.0]), np.ones(2)
    with pytest.raises(AssertionError):
        np.testing.assert_array_equal(np.where(z >= 0, ones, 0.0), R.relu_backward(ones, z))
