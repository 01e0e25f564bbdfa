"""fastattn.losses against the independent float64 oracle of fastattn._reference
(the cross-entropy gradient from the explicit log-softmax Jacobian
``δ_cj - p_j`` contracted with the target weights; BCE from ``logaddexp``).

float64 inputs to the float64 tolerance of tests/support.py, float32 inputs
(the oracle fed the same float32 values upcast) to the float32 one.  The grid:
class-index targets with ignored entries (ignore_index -100 and equal to a
real class), every target ignored, class-probability targets, label
smoothing 0 / 0.1 / 1, class weights or None, each reduction, C = 1 and 3,
1-d, 2-d and 4-d logits, zero samples; BCE with weight / pos_weight
broadcasting; mse of odd and empty shapes.  Inputs are read-only and
checked unchanged.  The oracle itself is checked against central
differences and (when torch is installed) torch's values, and
``test_the_comparison_catches_wrong_formulas`` shows the comparisons reject
plausible mistakes.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

import fastattn._reference as R
from fastattn.losses import binary_cross_entropy_with_logits, cross_entropy, mse
from support import assert_central_differences, assert_close, randn

DTYPES = [np.float64, np.float32]
REDUCTIONS = ["mean", "sum", "none"]


def _frozen(*arrays):
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


def _check(got, ref, dtype, reduction):
    (loss, grad), (rloss, rgrad) = got, ref
    if reduction == "none":
        assert isinstance(loss, np.ndarray) and loss.dtype == dtype, type(loss)
        assert loss.shape == np.shape(rloss), (loss.shape, np.shape(rloss))
    else:
        assert type(loss) is float, type(loss)
    assert isinstance(grad, np.ndarray) and grad.dtype == dtype, grad.dtype
    if reduction == "mean" and math.isnan(rloss):
        assert math.isnan(loss)
    else:
        assert_close(loss, rloss, dtype, err_msg="loss")
    assert_close(grad, rgrad, dtype, err_msg="grad")


# ------------------------------------------------------------------ cross_entropy

# (logits shape, class axis size) -- the class axis is 1 (0 for 1-d logits)
CE_SHAPES = [(5,), (1,), (4, 3), (4, 1), (7, 5), (2, 3, 4, 2), (0, 3), (0, 3, 2)]


def _index_targets(rng, zshape, ignore_index, frac_ignored=0.3):
    C = zshape[0] if len(zshape) == 1 else zshape[1]
    tshape = () if len(zshape) == 1 else zshape[:1] + zshape[2:]
    t = rng.integers(0, C, size=tshape)
    if t.size > 1:
        t[rng.random(tshape) < frac_ignored] = ignore_index
    return np.asarray(t, dtype=np.int64)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("ignore_index", [-100, 0])
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_class_indices(dtype, shape, ignore_index, weighted, smoothing, reduction, rng):
    C = shape[0] if len(shape) == 1 else shape[1]
    z = randn(rng, shape, dtype, scale=3.0)
    t = _index_targets(rng, shape, ignore_index)
    w = (rng.random(C) + 0.5).astype(dtype) if weighted else None
    (z, t, w), saved = _frozen(z, t, w)
    kw = dict(ignore_index=ignore_index, label_smoothing=smoothing, weight=w, reduction=reduction)
    _check(cross_entropy(z, t, **kw), R.cross_entropy(z, t, **kw), dtype, reduction)
    _assert_unchanged((z, t, w), saved)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_class_probabilities(dtype, shape, weighted, smoothing, reduction, rng):
    axis = 0 if len(shape) == 1 else 1
    C = shape[axis]
    z = randn(rng, shape, dtype, scale=3.0)
    t = rng.random(shape)
    t = (t / np.maximum(t.sum(axis=axis, keepdims=True), 1e-300)).astype(dtype)
    w = (rng.random(C) + 0.5).astype(dtype) if weighted else None
    (z, t, w), saved = _frozen(z, t, w)
    kw = dict(label_smoothing=smoothing, weight=w, reduction=reduction)
    _check(cross_entropy(z, t, **kw), R.cross_entropy(z, t, **kw), dtype, reduction)
    _assert_unchanged((z, t, w), saved)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_every_target_ignored(dtype, rng):
    z = randn(rng, (3, 4), dtype)
    t = np.full(3, -100)
    loss, grad = cross_entropy(z, t)
    rloss, rgrad = R.cross_entropy(z, t)
    assert math.isnan(loss) and math.isnan(rloss)
    np.testing.assert_array_equal(grad, 0.0)
    np.testing.assert_array_equal(rgrad, 0.0)
    assert cross_entropy(z, t, reduction="sum")[0] == 0.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy_large_logits(dtype, rng):
    z = randn(rng, (6, 5), dtype, scale=1e3)     # exp overflows without the max shift
    t = rng.integers(0, 5, size=6)
    for red in REDUCTIONS:
        got, ref = cross_entropy(z, t, reduction=red), R.cross_entropy(z, t, reduction=red)
        assert np.all(np.isfinite(got[1]))
        _check(got, ref, dtype, red)


def test_cross_entropy_oracle_against_central_differences(rng):
    z = randn(rng, (4, 5, 2), scale=2.0)
    t = _index_targets(rng, z.shape, -100)
    w = rng.random(5) + 0.5
    for kw in (dict(), dict(label_smoothing=0.3, weight=w), dict(reduction="sum")):
        loss = lambda z: R.cross_entropy(z, t, **kw)[0]  # noqa: E731
        assert_central_differences(loss, [z], [R.cross_entropy(z, t, **kw)[1]], rng, points=6)
    p = rng.random(z.shape)
    p /= p.sum(axis=1, keepdims=True)
    loss = lambda z: R.cross_entropy(z, p, label_smoothing=0.1, weight=w)[0]  # noqa: E731
    assert_central_differences(loss, [z], [R.cross_entropy(z, p, label_smoothing=0.1, weight=w)[1]],
                               rng, points=6)


# ------------------------------------------------------------------ binary_cross_entropy_with_logits

BCE_SHAPES = [(), (1,), (5,), (4, 3), (2, 3, 3), (0, 3)]


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("wshape", [None, "full", "last", "scalar"])
@pytest.mark.parametrize("pwshape", [None, "last", "full"])
@pytest.mark.parametrize("shape", BCE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_bce_with_logits(dtype, shape, pwshape, wshape, reduction, rng):
    def weights(kind):
        if kind is None:
            return None
        s = {"full": shape, "last": shape[-1:], "scalar": ()}[kind]
        return (rng.random(s) * 2 + 0.1).astype(dtype)
    x = randn(rng, shape, dtype, scale=4.0)
    if x.size >= 2:
        x.flat[:2] = [60.0, -60.0]            # saturated sigmoid both ways
    y = (rng.random(shape) < 0.5).astype(dtype)
    if y.size >= 3:
        y.flat[2] = 0.3                       # a soft target
    (x, y, w, pw), saved = _frozen(x, y, weights(wshape), weights(pwshape))
    kw = dict(weight=w, pos_weight=pw, reduction=reduction)
    _check(binary_cross_entropy_with_logits(x, y, **kw),
           R.binary_cross_entropy_with_logits(x, y, **kw), dtype, reduction)
    _assert_unchanged((x, y, w, pw), saved)


def test_bce_oracle_against_central_differences(rng):
    x, y = randn(rng, (3, 4), scale=3.0), rng.random((3, 4))
    w, pw = rng.random((3, 4)) + 0.5, rng.random(4) + 0.5
    loss = lambda x: R.binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw)[0]  # noqa: E731
    grad = R.binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw)[1]
    assert_central_differences(loss, [x], [grad], rng, points=8)


# ------------------------------------------------------------------ mse

@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(), (1,), (3,), (2, 3, 5), (0,), (4, 0)], ids=str)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mse(dtype, shape, reduction, rng):
    (p, t), saved = _frozen(randn(rng, shape, dtype, scale=2.0), randn(rng, shape, dtype))
    _check(mse(p, t, reduction=reduction), R.mse(p, t, reduction=reduction), dtype, reduction)
    _assert_unchanged((p, t), saved)


def test_mse_empty_mean_is_nan():
    loss, grad = mse(np.zeros((0, 2)), np.zeros((0, 2)))
    assert math.isnan(loss) and math.isnan(R.mse(np.zeros((0, 2)), np.zeros((0, 2)))[0])
    assert grad.shape == (0, 2)


# ------------------------------------------------------------------ the oracle against torch

def test_oracle_matches_torch(rng):
    torch = pytest.importorskip("torch")
    tF = torch.nn.functional
    z = randn(rng, (6, 4, 3), scale=2.0)
    t = _index_targets(rng, z.shape, 1)
    w = rng.random(4) + 0.5
    for red in REDUCTIONS:
        kw = dict(ignore_index=1, label_smoothing=0.2, weight=w, reduction=red)
        tz = torch.tensor(z, requires_grad=True)
        tl = tF.cross_entropy(tz, torch.from_numpy(t), ignore_index=1, label_smoothing=0.2,
                              weight=torch.from_numpy(w), reduction=red)
        tl.sum().backward()
        loss, grad = R.cross_entropy(z, t, **kw)
        np.testing.assert_allclose(loss, tl.detach().numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(grad, tz.grad.numpy(), rtol=1e-12, atol=1e-14)
    x, y = randn(rng, (3, 4), scale=3.0), rng.random((3, 4))
    pw = rng.random(4) + 0.5
    tx = torch.tensor(x, requires_grad=True)
    tl = tF.binary_cross_entropy_with_logits(tx, torch.from_numpy(y), pos_weight=torch.from_numpy(pw))
    tl.backward()
    loss, grad = R.binary_cross_entropy_with_logits(x, y, pos_weight=pw)
    np.testing.assert_allclose(loss, tl.item(), rtol=1e-12)
    np.testing.assert_allclose(grad, tx.grad.numpy(), rtol=1e-12, atol=1e-15)


# ------------------------------------------------------------------ the checks can fail

def test_the_comparison_catches_wrong_formulas(rng):
    z = randn(rng, (5, 4))
    t = np.array([0, 1, -100, 3, 2])
    w = rng.random(4) + 0.5
    ref_loss, ref_grad = R.cross_entropy(z, t, weight=w, label_smoothing=0.1)
    # "mean" over the number of non-ignored samples instead of their total weight
    got_loss, _ = cross_entropy(z, t, weight=w, label_smoothing=0.1, reduction="sum")
    with pytest.raises(AssertionError):
        assert_close(got_loss / 4, ref_loss, np.float64)
    # the ignored sample not left out of the gradient
    _, g_all = R.cross_entropy(z, np.array([0, 1, 0, 3, 2]), weight=w, label_smoothing=0.1)
    with pytest.raises(AssertionError):
        assert_close(g_all, ref_grad, np.float64)
    # a float32 gradient off by a relative 1e-3 (a float16-sized error) is caught
    g32 = cross_entropy(z.astype(np.float32), t)[1]
    with pytest.raises(AssertionError):
        assert_close(g32 * np.float32(1 + 1e-3), R.cross_entropy(z.astype(np.float32), t)[1], np.float32)
    # bce: pos_weight applied to the negative term
    x, y, pw = randn(rng, (4,)), np.array([1.0, 0.0, 1.0, 0.0]), np.full(4, 3.0)
    wrong = R.binary_cross_entropy_with_logits(x, 1 - y, pos_weight=pw)[1]
    with pytest.raises(AssertionError):
        assert_close(wrong, R.binary_cross_entropy_with_logits(x, y, pos_weight=pw)[1], np.float64)
    # mse gradient without the factor 2
    p, q = randn(rng, (3,)), randn(rng, (3,))
    with pytest.raises(AssertionError):
        assert_close(mse(p, q)[1] / 2, R.mse(p, q)[1], np.float64)
