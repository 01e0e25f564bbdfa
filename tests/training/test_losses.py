"""fastattn.losses (cross_entropy, binary_cross_entropy_with_logits, mse): the
loss and its gradient against torch (value from ``torch.nn.functional``,
gradient from autograd: float64 to the float64 tolerance, float32 computed by
torch in float32 to the float32 tolerance of tests/support.py), against
central finite differences, with large logits, and the argument errors; inputs
unchanged.

Every option is in the grids: class-index targets with ignored entries
(ignore_index negative, and equal to a real class), label smoothing with and
without class weights, each reduction, class-probability targets, 1-d and >2-d
logits, weight / pos_weight broadcasting.  For ``reduction="none"`` the
gradient is that of ``loss.sum()`` (the documented contract), and the
chain-rule recipe of the module docstring is checked with a random upstream.
"""
from __future__ import annotations

import math

import numpy as np
import pytest

from fastattn.losses import binary_cross_entropy_with_logits, cross_entropy, mse

from support import assert_central_differences, assert_close

torch = pytest.importorskip("torch")
F = torch.nn.functional

DTYPES = [np.float64, np.float32]
REDUCTIONS = ["mean", "sum", "none"]


def _t(a, dtype=None):
    # np.array, not np.ascontiguousarray (which makes a 0-d target 1-d)
    return torch.from_numpy(np.array(a, dtype=dtype, order="C"))


def _torch_loss_and_grad(fn, x, dtype, args, kwargs, upstream=None):
    """torch's loss of ``fn(x, *args, **kwargs)`` (x in ``dtype``) and the gradient
    of loss.sum() (or of (upstream * loss).sum())."""
    tx = _t(x, dtype).requires_grad_(True)
    loss = fn(tx, *args, **kwargs)
    (loss.sum() if upstream is None else (loss * _t(upstream, dtype)).sum()).backward()
    return loss.detach().numpy(), tx.grad.numpy()


def _check(got, want, dtype, reduction):
    (loss, grad), (tloss, tgrad) = got, want
    if reduction == "none":
        assert isinstance(loss, np.ndarray) and loss.dtype == dtype, type(loss)
        assert loss.shape == tloss.shape, (loss.shape, tloss.shape)
    else:
        assert type(loss) is float, type(loss)
    assert isinstance(grad, np.ndarray) and grad.dtype == dtype, grad.dtype
    assert_close(loss, tloss, dtype, err_msg="loss")
    assert_close(grad, tgrad, dtype, err_msg="grad")


# ------------------------------------------------------------------ cross_entropy

SHAPES = [(7, 5), (5,), (4, 5, 3), (3, 5, 2, 3)]   # class axis 1 (axis 0 for 1-d)


def _index_shape(shape):
    return () if len(shape) == 1 else shape[:1] + shape[2:]


def _targets(rng, shape, kind):
    """Targets for logits of ``shape``: (targets, ignore_index)."""
    C = shape[0] if len(shape) == 1 else shape[1]
    if kind == "probs":
        t = rng.random(shape)
        return t / t.sum(axis=0 if len(shape) == 1 else 1, keepdims=True), -100
    if kind == "soft":  # unnormalised, some zeros (torch takes them as they are)
        t = rng.random(shape) * 2
        t[t < 0.4] = 0.0
        return t, -100
    t = rng.integers(0, C, _index_shape(shape))
    if kind == "index":
        return t, -100
    flat = t.reshape(-1)
    if kind == "ignore":           # about a third ignored with the default -100
        if flat.size > 1:
            flat[rng.random(flat.size) < 0.35] = -100
            flat[0] = -100
            flat[-1] = 1
        return t, -100
    assert kind == "ignore_class"  # ignore_index is a real class
    if flat.size > 1:
        flat[0], flat[-1] = 2, 3
    return t, 2


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("weighted", [False, True], ids=["noweight", "weight"])
@pytest.mark.parametrize("smoothing", [0.0, 0.3], ids=["ls0", "ls0.3"])
@pytest.mark.parametrize("kind", ["index", "ignore", "ignore_class", "probs", "soft"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_cross_entropy_matches_torch(shape, reduction, kind, smoothing, weighted, dtype, rng):
    C = shape[0] if len(shape) == 1 else shape[1]
    z = (rng.standard_normal(shape) * 3).astype(dtype)
    t, ii = _targets(rng, shape, kind)
    if kind in ("probs", "soft"):
        t = t.astype(dtype)
    w = (rng.random(C) * 2 + 0.1).astype(dtype) if weighted else None
    before = [a.copy() for a in (z, t) + ((w,) if weighted else ())]
    got = cross_entropy(z, t, ignore_index=ii, label_smoothing=smoothing, weight=w,
                        reduction=reduction)
    want = _torch_loss_and_grad(
        F.cross_entropy, z, dtype, (_t(t),),
        dict(ignore_index=ii, label_smoothing=smoothing,
             weight=None if w is None else _t(w), reduction=reduction))
    _check(got, want, np.dtype(dtype), reduction)
    assert got[1].shape == z.shape
    for a, b in zip((z, t) + ((w,) if weighted else ()), before):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["ignore", "probs"])
def test_cross_entropy_full_label_smoothing_and_other_ignore_index(kind, reduction, rng):
    """label_smoothing=1 (only the uniform part remains) with weights; a
    negative ignore_index other than -100."""
    z, w = rng.standard_normal((6, 4, 2)), rng.random(4) + 0.5
    t, _ = _targets(rng, z.shape, kind)
    if kind == "ignore":
        t = np.where(t == -100, -1, t)
    for ls in (1.0, 0.999):
        kw = dict(ignore_index=-1, label_smoothing=ls, weight=w, reduction=reduction)
        got = cross_entropy(z, t, **kw)
        want = _torch_loss_and_grad(F.cross_entropy, z, np.float64, (_t(t),), dict(kw, weight=_t(w)))
        _check(got, want, np.dtype(np.float64), reduction)


def test_cross_entropy_none_chain_rule_with_an_upstream_gradient(rng):
    """The documented recipe: the gradient of sum(g * loss) is grad * expand_dims(g, 1)."""
    z = rng.standard_normal((4, 6, 3))
    t, _ = _targets(rng, z.shape, "ignore")
    w = rng.random(6) + 0.5
    g = rng.standard_normal((4, 3))
    loss, grad = cross_entropy(z, t, label_smoothing=0.2, weight=w, reduction="none")
    _, tgrad = _torch_loss_and_grad(F.cross_entropy, z, np.float64, (_t(t),),
                                    dict(label_smoothing=0.2, weight=_t(w), reduction="none"),
                                    upstream=g)
    assert_close(grad * np.expand_dims(g, 1), tgrad, np.float64)


@pytest.mark.parametrize("smoothing", [0.0, 0.2])
@pytest.mark.parametrize("weighted", [False, True])
def test_cross_entropy_all_targets_ignored(weighted, smoothing):
    """"mean" over no target is nan (0 / 0, as torch), with an all-zero gradient;
    "sum" is 0 and "none" all zeros."""
    z = np.arange(12.0).reshape(3, 4)
    t = np.full(3, -100)
    w = np.array([1.0, 2.0, 3.0, 4.0]) if weighted else None
    loss, grad = cross_entropy(z, t, weight=w, label_smoothing=smoothing)
    tl, tg = _torch_loss_and_grad(F.cross_entropy, z, np.float64, (_t(t),),
                                  dict(weight=None if w is None else _t(w),
                                       label_smoothing=smoothing))
    assert math.isnan(loss) and np.isnan(tl)
    np.testing.assert_array_equal(grad, tg)
    np.testing.assert_array_equal(grad, 0.0)
    assert cross_entropy(z, t, weight=w, reduction="sum")[0] == 0.0
    np.testing.assert_array_equal(cross_entropy(z, t, weight=w, reduction="none")[0], 0.0)


@pytest.mark.parametrize("kind", ["index", "probs"])
def test_cross_entropy_empty_batch(kind):
    z = np.zeros((0, 3))
    t = np.zeros(0, np.int64) if kind == "index" else np.zeros((0, 3))
    loss, grad = cross_entropy(z, t)
    assert math.isnan(loss) and grad.shape == (0, 3)
    assert cross_entropy(z, t, reduction="sum")[0] == 0.0
    assert cross_entropy(z, t, reduction="none")[0].shape == (0,)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("kind", ["index", "probs"])
def test_cross_entropy_large_logits_stay_finite(kind, dtype, rng):
    """Logits of size 1e4 (exp would overflow without the max subtraction)."""
    z = (rng.standard_normal((6, 5)) * 1e4).astype(dtype)
    z[0] = [1e4, -1e4, 1e4, 0.0, 5e3]
    t, _ = _targets(rng, z.shape, kind)
    t = t.astype(dtype) if kind == "probs" else t
    for ls, w in ((0.0, None), (0.1, np.linspace(0.5, 2, 5).astype(dtype))):
        kw = dict(label_smoothing=ls, weight=w)
        loss, grad = cross_entropy(z, t, **kw)
        assert np.isfinite(loss) and np.all(np.isfinite(grad))
        want = _torch_loss_and_grad(F.cross_entropy, z, dtype, (_t(t),),
                                    dict(kw, weight=None if w is None else _t(w)))
        _check((loss, grad), want, np.dtype(dtype), "mean")


def test_cross_entropy_float16_and_integer_logits(rng):
    z16 = rng.standard_normal((5, 4)).astype(np.float16)
    t = rng.integers(0, 4, 5)
    loss, grad = cross_entropy(z16, t, reduction="none")
    assert grad.dtype == np.float16 and loss.dtype == np.float16
    ref_l, ref_g = cross_entropy(z16.astype(np.float64), t, reduction="none")
    np.testing.assert_allclose(loss, ref_l, rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(grad, ref_g, rtol=2e-3, atol=2e-3)
    zi = rng.integers(-3, 4, (5, 4))
    loss, grad = cross_entropy(zi, t)
    assert grad.dtype == np.float64
    ref = cross_entropy(zi.astype(np.float64), t)
    assert loss == ref[0]
    np.testing.assert_array_equal(grad, ref[1])


def test_cross_entropy_lists_scalars_and_readonly_inputs(rng):
    z = rng.standard_normal((3, 4))
    t = np.array([0, 3, 1])
    ref = cross_entropy(z, t, weight=np.array([1.0, 2.0, 3.0, 4.0]))
    got = cross_entropy(z.tolist(), t.tolist(), weight=[1, 2, 3, 4])
    assert got[0] == pytest.approx(ref[0], rel=1e-15)
    np.testing.assert_allclose(got[1], ref[1], rtol=1e-15, atol=1e-17)
    zr, tr = z.copy(), t.copy()
    zr.flags.writeable = tr.flags.writeable = False
    np.testing.assert_array_equal(cross_entropy(zr, tr)[1], cross_entropy(z, t)[1])
    # one sample: (C,) logits and a scalar target, as torch
    loss, grad = cross_entropy(z[1], 3, reduction="none")
    assert loss.shape == () and grad.shape == (4,)
    assert float(loss) == pytest.approx(cross_entropy(z[1:2], [3])[0], rel=1e-15)
    # non-contiguous logits (class axis strided)
    big = rng.standard_normal((3, 9))
    np.testing.assert_array_equal(cross_entropy(big[:, ::2], [1, 2, 0])[1],
                                  cross_entropy(big[:, ::2].copy(), [1, 2, 0])[1])


@pytest.mark.parametrize("kind", ["ignore", "probs"])
def test_cross_entropy_gradient_by_central_differences(kind, rng):
    z = rng.standard_normal((3, 4, 2))
    t, _ = _targets(rng, z.shape, kind)
    w = rng.random(4) + 0.5
    kw = dict(label_smoothing=0.15, weight=w)
    _, grad = cross_entropy(z, t, **kw)
    assert_central_differences(lambda a: cross_entropy(a, t, **kw)[0], [z], [grad], rng,
                               points=8)


# ------------------------------------------------------------------ binary_cross_entropy_with_logits

BCE_CASES = [  # (logits shape, weight shape, pos_weight shape)
    ((9,), None, None),
    ((4, 5), None, (5,)),
    ((4, 5), (4, 5), None),
    ((4, 5), (4, 1), (1,)),
    ((2, 3, 5), (5,), (3, 5)),
    ((2, 3, 5), (2, 1, 1), (2, 3, 5)),
    ((2, 3, 5), (), ()),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("soft", [False, True], ids=["binary", "soft"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("case", BCE_CASES, ids=lambda c: "-".join(
    "x".join(map(str, s)) if s is not None else "no" for s in c))
def test_bce_with_logits_matches_torch(case, reduction, soft, dtype, rng):
    shape, wshape, pshape = case
    x = (rng.standard_normal(shape) * 4).astype(dtype)
    y = (rng.random(shape) if soft else (rng.random(shape) < 0.5)).astype(dtype)
    w = None if wshape is None else (rng.random(wshape) * 2).astype(dtype)
    pw = None if pshape is None else (rng.random(pshape) * 3 + 0.2).astype(dtype)
    inputs = [a for a in (x, y, w, pw) if a is not None]
    before = [a.copy() for a in inputs]
    got = binary_cross_entropy_with_logits(x, y, weight=w, pos_weight=pw, reduction=reduction)
    want = _torch_loss_and_grad(
        F.binary_cross_entropy_with_logits, x, dtype, (_t(y),),
        dict(weight=None if w is None else _t(w), pos_weight=None if pw is None else _t(pw),
             reduction=reduction))
    _check(got, want, np.dtype(dtype), reduction)
    for a, b in zip(inputs, before):
        np.testing.assert_array_equal(a, b)


def test_bce_none_chain_rule_and_bool_targets(rng):
    x = rng.standard_normal((4, 3))
    y = rng.random((4, 3)) < 0.5
    g = rng.standard_normal((4, 3))
    pw = np.array([0.5, 1.0, 3.0])
    loss, grad = binary_cross_entropy_with_logits(x, y, pos_weight=pw, reduction="none")
    _, tgrad = _torch_loss_and_grad(F.binary_cross_entropy_with_logits, x, np.float64,
                                    (_t(y, np.float64),),
                                    dict(pos_weight=_t(pw), reduction="none"), upstream=g)
    assert_close(grad * g, tgrad, np.float64)
    ref = binary_cross_entropy_with_logits(x, y.astype(np.float64), pos_weight=pw, reduction="none")
    np.testing.assert_array_equal(loss, ref[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
def test_bce_large_logits_stay_finite(dtype):
    x = np.array([1e4, -1e4, 1e4, -1e4, 50.0, -50.0, 0.0], dtype)
    y = np.array([1.0, 0.0, 0.0, 1.0, 0.3, 0.7, 1.0], dtype)
    pw = np.full(7, 2.0, dtype)
    for kw in ({}, {"pos_weight": pw}):
        loss, grad = binary_cross_entropy_with_logits(x, y, reduction="none", **kw)
        assert np.all(np.isfinite(loss)) and np.all(np.isfinite(grad))
        want = _torch_loss_and_grad(F.binary_cross_entropy_with_logits, x, dtype, (_t(y),),
                                    dict(reduction="none", **{k: _t(v) for k, v in kw.items()}))
        _check((loss, grad), want, np.dtype(dtype), "none")
    # the exact values where torch's formula cancels: -log(1 - sigmoid(-50)) = log1p(e^-50)
    loss, _ = binary_cross_entropy_with_logits(np.array([-50.0]), np.array([0.0]), reduction="sum")
    assert loss == pytest.approx(math.log1p(math.exp(-50.0)), rel=1e-14)


def test_bce_gradient_by_central_differences(rng):
    x, y = rng.standard_normal((3, 4)) * 2, rng.random((3, 4))
    kw = dict(weight=rng.random((3, 1)) + 0.5, pos_weight=rng.random(4) * 3)
    _, grad = binary_cross_entropy_with_logits(x, y, **kw)
    assert_central_differences(lambda a: binary_cross_entropy_with_logits(a, y, **kw)[0],
                               [x], [grad], rng, points=6)


def test_bce_empty():
    loss, grad = binary_cross_entropy_with_logits(np.zeros((0, 2)), np.zeros((0, 2)))
    assert math.isnan(loss) and grad.shape == (0, 2)


# ------------------------------------------------------------------ mse

@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("shape", [(7,), (3, 4), (2, 3, 4), ()], ids=lambda s: "x".join(map(str, s)) or "0d")
def test_mse_matches_torch(shape, reduction, dtype, rng):
    p = (rng.standard_normal(shape) * 3).astype(dtype)
    y = rng.standard_normal(shape).astype(dtype)
    before = (p.copy(), y.copy())
    got = mse(p, y, reduction=reduction)
    want = _torch_loss_and_grad(F.mse_loss, p, dtype, (_t(y),), dict(reduction=reduction))
    _check(got, want, np.dtype(dtype), reduction)
    np.testing.assert_array_equal(p, before[0])
    np.testing.assert_array_equal(y, before[1])


def test_mse_gradient_by_central_differences_and_empty(rng):
    p, y = rng.standard_normal((3, 5)), rng.standard_normal((3, 5))
    _, grad = mse(p, y)
    assert_central_differences(lambda a: mse(a, y)[0], [p], [grad], rng, points=6)
    loss, grad = mse(np.zeros((0, 3)), np.zeros((0, 3)))
    assert math.isnan(loss) and grad.shape == (0, 3)
    loss, grad = mse(np.array([1, 2, 3]), np.array([1.5, 2.0, 2.0]), reduction="sum")
    assert loss == 0.25 + 1.0 and grad.dtype == np.float64
    np.testing.assert_array_equal(grad, [-1.0, 0.0, 2.0])


# ------------------------------------------------------------------ bad input

Z = np.zeros((3, 4))
T = np.array([0, 1, 2])

BAD = [
    # (function, args, kwargs, error, match)
    (cross_entropy, (Z, np.array([0, 1])), {}, ValueError,
     r"targets: expected class indices of shape \(3,\) .* got shape \(2,\)"),
    (cross_entropy, (Z, np.zeros((3, 1), np.int64)), {}, ValueError,
     r"targets: expected class indices of shape \(3,\)"),
    (cross_entropy, (Z, np.zeros((3,))), {}, ValueError,
     r"targets: floating targets are class probabilities and must have the logits' shape "
     r"\(3, 4\), got shape \(3,\)"),
    (cross_entropy, (Z, np.array([True, False, True])), {}, TypeError,
     r"targets: expected integer class indices or floating class probabilities, got dtype bool"),
    (cross_entropy, (Z, np.array(["a", "b", "c"])), {}, TypeError, r"targets: .* got dtype <U1"),
    (cross_entropy, (Z, np.array([0, 4, 1])), {}, ValueError,
     r"targets: expected class indices in \[0, 4\) or ignore_index=-100, got 4 at index \(1,\)"),
    (cross_entropy, (Z, np.array([0, -1, 1])), {}, ValueError,
     r"targets: expected class indices in \[0, 4\) or ignore_index=-100, got -1"),
    (cross_entropy, (Z, np.array([0, -100, 1])), {"ignore_index": -1}, ValueError,
     r"targets: .* ignore_index=-1, got -100"),
    (cross_entropy, (Z, np.array([0, 2**40, 1], np.uint64)), {}, ValueError,
     r"targets: expected class indices in \[0, 4\)"),
    (cross_entropy, (np.zeros(4), np.array([1])), {}, ValueError,
     r"targets: expected class indices of shape \(\) "),
    (cross_entropy, (np.float64(1.0), 0), {}, ValueError, r"logits: expected an array of shape \(C,\)"),
    (cross_entropy, (np.zeros((3, 0)), T), {}, ValueError, r"logits: expected at least one class"),
    (cross_entropy, (Z.astype(complex), T), {}, TypeError, r"logits: .*complex"),
    (cross_entropy, (Z, T), {"reduction": "avg"}, ValueError,
     r"reduction: expected one of 'mean', 'sum', 'none', got 'avg'"),
    (cross_entropy, (Z, T), {"reduction": None}, TypeError, r"reduction: expected one of .* got NoneType"),
    (cross_entropy, (Z, T), {"label_smoothing": 1.5}, ValueError,
     r"label_smoothing: expected a float in \[0, 1\], got 1.5"),
    (cross_entropy, (Z, T), {"label_smoothing": -0.1}, ValueError, r"label_smoothing: .* got -0.1"),
    (cross_entropy, (Z, T), {"label_smoothing": float("nan")}, ValueError, r"label_smoothing: .* got nan"),
    (cross_entropy, (Z, T), {"label_smoothing": "0.1"}, TypeError, r"label_smoothing: .* got str"),
    (cross_entropy, (Z, T), {"ignore_index": 1.5}, TypeError, r"ignore_index: expected an int, got float"),
    (cross_entropy, (Z, T), {"ignore_index": True}, TypeError, r"ignore_index: expected an int, got bool"),
    (cross_entropy, (Z, T), {"weight": np.ones(3)}, ValueError,
     r"weight: expected shape \(C,\) = \(4,\), one weight per class, got shape \(3,\)"),
    (cross_entropy, (Z, T), {"weight": np.ones((1, 4))}, ValueError, r"weight: .* got shape \(1, 4\)"),
    (cross_entropy, (Z, T), {"weight": np.ones(4, complex)}, TypeError, r"weight: .*complex"),
    (binary_cross_entropy_with_logits, (Z, np.zeros((3,))), {}, ValueError,
     r"targets: expected the logits' shape \(3, 4\), got shape \(3,\)"),
    (binary_cross_entropy_with_logits, (Z, np.zeros((3, 4), complex)), {}, TypeError, r"targets: .*complex"),
    (binary_cross_entropy_with_logits, (Z, Z), {"weight": np.ones(3)}, ValueError,
     r"weight: expected a shape that broadcasts to the logits' shape \(3, 4\), got \(3,\)"),
    (binary_cross_entropy_with_logits, (Z, Z), {"pos_weight": np.ones((2, 3, 4))}, ValueError,
     r"pos_weight: expected a shape that broadcasts to the logits' shape \(3, 4\), got \(2, 3, 4\)"),
    (binary_cross_entropy_with_logits, (Z, Z), {"reduction": "mean "}, ValueError, r"reduction: .* got 'mean '"),
    (binary_cross_entropy_with_logits, ("abc", Z), {}, TypeError, r"logits: expected real numbers"),
    (mse, (Z, np.zeros((4, 3))), {}, ValueError, r"target: expected pred's shape \(3, 4\), got shape \(4, 3\)"),
    (mse, (Z, np.zeros((1, 4))), {}, ValueError, r"target: expected pred's shape \(3, 4\), got shape \(1, 4\)"),
    (mse, (Z.astype(complex), Z), {}, TypeError, r"pred: .*complex"),
    (mse, (Z, Z), {"reduction": "Mean"}, ValueError, r"reduction: .* got 'Mean'"),
]


@pytest.mark.parametrize("fn, args, kwargs, error, match", BAD,
                         ids=[f"{i}-{b[0].__name__}" for i, b in enumerate(BAD)])
def test_bad_input_is_named(fn, args, kwargs, error, match):
    copies = [np.array(a, copy=True) if isinstance(a, np.ndarray) else a for a in args]
    with pytest.raises(error, match=match):
        fn(*args, **kwargs)
    for a, c in zip(args, copies):
        if isinstance(a, np.ndarray):
            np.testing.assert_array_equal(a, c)


def test_torch_also_rejects_targets_out_of_range():
    """The out-of-range rows of the table are errors in torch too (not a choice of ours)."""
    with pytest.raises((IndexError, RuntimeError)):
        F.cross_entropy(_t(Z), _t(np.array([0, 4, 1])))
    with pytest.raises(RuntimeError, match="label_smoothing"):
        F.cross_entropy(_t(Z), _t(T), label_smoothing=1.5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_zero_d_inputs_give_array_gradients(dtype, reduction):
    """0-d logits / pred: the gradient is a 0-d ndarray of the input's dtype
    (binary_cross_entropy_with_logits returned a NumPy scalar)."""
    for fn, x, t in ((binary_cross_entropy_with_logits, np.array(0.3, dtype), np.array(1.0, dtype)),
                     (mse, np.array(0.3, dtype), np.array(1.0, dtype))):
        _, grad = fn(x, t, reduction=reduction)
        assert type(grad) is np.ndarray and grad.shape == () and grad.dtype == dtype, (fn, type(grad))


# ------------------------------------------- cross_entropy's row kernel (C)
def _np_cross_entropy64(z, t, ignore_index, reduction):
    """An independent float64 NumPy reference: log-softmax by rows."""
    z = np.asarray(z, np.float64)
    m = z.max(axis=1, keepdims=True)
    lse = np.log(np.exp(z - m).sum(axis=1)) + m[:, 0]
    keep = t != ignore_index
    y = np.where(keep, t, 0)
    nll = np.where(keep, lse - z[np.arange(len(t)), y], 0.0)
    p = np.exp(z - lse[:, None])
    g = p.copy()
    g[np.arange(len(t)), y] -= 1.0
    g *= keep[:, None]
    if reduction == "mean":
        n = keep.sum()
        return (nll.sum() / n if n else math.nan), (g / n if n else g * 0)
    if reduction == "sum":
        return nll.sum(), g
    return nll, g


@pytest.mark.parametrize("dtype", DTYPES, ids=["f64", "f32"])
@pytest.mark.parametrize("C", [1, 3, 7, 8, 9, 16, 61, 1000])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_rows_kernel_against_float64_reference(C, reduction, dtype, rng):
    """(N, C) logits with class indices, no weights, no smoothing run in
    fastattn._rowwise's row kernel (SIMD exp, tails of 1..7 classes): loss and
    gradient against a float64 NumPy log-softmax, with ignored targets."""
    N = 300
    z = (rng.standard_normal((N, C)) * 4).astype(dtype)
    t = rng.integers(0, C, N)
    t[rng.random(N) < 0.3] = -100
    z0 = z.copy()
    loss, grad = cross_entropy(z, t, reduction=reduction)
    want_loss, want_grad = _np_cross_entropy64(z, t, -100, reduction)
    assert grad.dtype == dtype and grad.shape == z.shape
    assert_close(loss, want_loss, dtype, err_msg="loss")
    assert_close(grad, want_grad, dtype, err_msg="grad")
    np.testing.assert_array_equal(z, z0)   # input untouched


def test_cross_entropy_rows_kernel_threads_simd_and_nonfinite(rng):
    """The row kernel: the same bits for 1 and 2 threads (rows are independent);
    its SIMD and portable loops agree to rounding; rows with NaN, +inf and
    -inf logits give what the NumPy path (weights of one) gives, NaN where it
    has NaN; strided and float16 logits are taken."""
    import fastattn
    from fastattn import _kernels
    z = (rng.standard_normal((512, 1000)) * 3).astype(np.float32)
    z[3, 5] = np.nan
    z[4, 7] = np.inf
    z[5, :] = -np.inf
    z[6, 9] = -np.inf
    t = rng.integers(0, 1000, 512)
    t[::5] = -100
    prev = fastattn.get_num_threads()
    try:
        fastattn.set_num_threads(1)
        one = cross_entropy(z, t, reduction="none")
        fastattn.set_num_threads(2)
        two = cross_entropy(z, t, reduction="none")
    finally:
        fastattn.set_num_threads(prev)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
    try:
        _kernels.set_simd_disabled(True)
        scalar = cross_entropy(z, t, reduction="none")
    finally:
        _kernels.set_simd_disabled(False)
    with np.errstate(invalid="ignore"):   # the NumPy path's inf - inf
        generic = cross_entropy(z, t, reduction="none", weight=np.ones(1000, np.float32))
    for got in (scalar, generic):
        for a, b in zip(one, got):
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b))
            ok = ~np.isnan(a)
            np.testing.assert_allclose(a[ok], b[ok], rtol=2e-6, atol=1e-7)
    # an ignore_index beyond int64 takes the NumPy path (nothing equals it)
    with np.errstate(invalid="ignore"):   # the NumPy path's inf - inf
        big = cross_entropy(z[:8, :10], t[:8] % 10, ignore_index=2 ** 70)
    want = cross_entropy(z[:8, :10], t[:8] % 10, ignore_index=-1)
    assert big[0] == want[0] or (np.isnan(big[0]) and np.isnan(want[0]))
    np.testing.assert_allclose(big[1], want[1], rtol=2e-6, atol=1e-7)
    # strided (a column slice) and float16 logits: the same as a contiguous copy
    wide = (rng.standard_normal((64, 40)) * 2).astype(np.float32)
    tt = rng.integers(0, 20, 64)
    got = cross_entropy(wide[:, ::2], tt)
    want = cross_entropy(np.ascontiguousarray(wide[:, ::2]), tt)
    assert got[0] == want[0]
    np.testing.assert_array_equal(got[1], want[1])
    h = wide[:, :20].astype(np.float16)
    lh, gh = cross_entropy(h, tt)
    assert gh.dtype == np.float16
    want_loss, want_grad = _np_cross_entropy64(h.astype(np.float64), tt, -100, "mean")
    assert abs(lh - want_loss) < 1e-5 * max(1.0, abs(want_loss))
    np.testing.assert_allclose(gh.astype(np.float64), want_grad, atol=2e-3)
