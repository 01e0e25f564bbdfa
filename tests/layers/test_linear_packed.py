"""Linear's inference calls read a packed copy of a float32 weight (made on
the first call that is worth it, as MultiHeadAttention's ``auto_pack``), and
that copy follows every write fastattn makes (optimizer steps,
load_state_dict, params_changed after a user's in-place edit, a replaced
array).  Every result against a float64 NumPy oracle of the layer's current
arrays; ``F.linear``'s few-multiply-add rule against NumPy too."""
from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import fastattn
from fastattn import _proj, optim
from fastattn import functional as F
from fastattn.layers import Linear, TransformerEncoderLayer
from support import assert_close, randn

needs_packed = pytest.mark.skipif(not _proj.packed_kernel_active(),
                                  reason="no packed projection kernel on this CPU/build (AVX2+FMA)")


def oracle(m, x):
    w = m._params["weight"].astype(np.float64)
    y = np.asarray(x, np.float64) @ w.T
    if "bias" in m._params:
        y = y + m._params["bias"].astype(np.float64)
    return y


def randomised(rng, n_in=128, n_out=128, **kw):
    m = Linear(n_in, n_out, seed=0, **kw)
    for name, a in m._params.items():
        a[...] = randn(rng, a.shape, a.dtype)
    return m.params_changed()


def packed_of(m):
    c = m.__dict__.get("_packed")
    return None if c is None else c[3]


@needs_packed
@pytest.mark.parametrize("shape", [(2, 5, 128), (7, 128), (3, 1, 2, 128)], ids=["3d", "2d", "4d"])
@pytest.mark.parametrize("bias", [True, False])
def test_inference_reads_a_packed_copy(rng, shape, bias):
    m = randomised(rng, bias=bias)
    x = randn(rng, shape, np.float32)
    got = m(x)
    assert got.dtype == np.float32 and got.shape == shape[:-1] + (128,)
    assert packed_of(m) is not None and packed_of(m).wp is not None
    assert_close(got, oracle(m, x), np.float32)
    again = m(x)
    np.testing.assert_array_equal(again, got)          # the same bits on every call


@needs_packed
def test_non_contiguous_input_and_input_untouched(rng):
    m = randomised(rng)
    base = randn(rng, (4, 9, 256), np.float32)
    x = base[:, ::2, ::2]                                # strided view, last axis 128
    keep = x.copy()
    assert_close(m(x), oracle(m, x), np.float32)
    np.testing.assert_array_equal(x, keep)


def test_single_row_and_tiny_products_skip_the_copy(rng):
    m = randomised(rng, n_in=8, n_out=4)
    x = randn(rng, (3, 8), np.float32)                   # 3 * 4 * 8 multiply-adds: NumPy's
    assert_close(m(x), oracle(m, x), np.float32)
    big = randomised(rng)
    one = randn(rng, (1, 128), np.float32)
    assert_close(big(one), oracle(big, one), np.float32)
    assert packed_of(m) is None or not packed_of(m).worth_it(3)
    if packed_of(big) is not None:
        assert not packed_of(big).worth_it(1)


def test_float64_layer_and_float64_input_pack_nothing(rng):
    m = randomised(rng, dtype=np.float64)
    x = randn(rng, (6, 128), np.float64)
    assert_close(m(x), oracle(m, x), np.float64)
    assert packed_of(m) is None
    m32 = randomised(rng)
    assert_close(m32(x), oracle(m32, x), np.float64)     # float64 input: F.linear, float64 out
    assert m32(x).dtype == np.float64


@needs_packed
@pytest.mark.parametrize("opt_cls", [optim.SGD, optim.AdamW])
def test_optimizer_steps_are_seen(rng, opt_cls):
    m = randomised(rng)
    x = randn(rng, (5, 128), np.float32)
    opt = opt_cls(m, lr=0.05)
    before = m(x)
    for _ in range(3):
        m.zero_grad()
        out, backprop = m.forward_backward(x)
        backprop(randn(rng, out.shape, np.float32))
        opt.step()
        got = m(x)
        assert_close(got, oracle(m, x), np.float32)
    assert not np.allclose(got, before)


@needs_packed
def test_in_place_edit_with_params_changed_replaced_array_and_load_state_dict(rng):
    m = randomised(rng)
    x = randn(rng, (5, 128), np.float32)
    m(x)
    m._params["weight"][...] *= -2.0
    m.params_changed()
    assert_close(m(x), oracle(m, x), np.float32)
    m._params["weight"] = randn(rng, (128, 128), np.float32)  # a new array: seen without a call
    assert_close(m(x), oracle(m, x), np.float32)
    other = randomised(rng)
    m.load_state_dict(other.state_dict())
    assert_close(m(x), oracle(other, x), np.float32)


@needs_packed
def test_save_load_copy_and_pickle_carry_no_packed_copy(rng, tmp_path):
    m = randomised(rng)
    x = randn(rng, (5, 128), np.float32)
    want = m(x)
    assert packed_of(m) is not None
    for clone in (pickle.loads(pickle.dumps(m)), copy.deepcopy(m)):
        assert "_packed" not in clone.__dict__
        np.testing.assert_array_equal(clone(x), want)
    fastattn.save(m, tmp_path / "lin.npz")
    np.testing.assert_array_equal(fastattn.load(tmp_path / "lin.npz")(x), want)


@needs_packed
def test_same_bits_for_any_thread_count(rng):
    m = randomised(rng, n_in=128, n_out=256)
    x = randn(rng, (60, 128), np.float32)
    with fastattn.threads(1):
        one = m(x)
    with fastattn.threads(2):
        two = m(x)
    np.testing.assert_array_equal(one, two)
    assert_close(one, oracle(m, x), np.float32)


def test_bad_input_still_named(rng):
    m = randomised(rng)
    with pytest.raises(ValueError, match="x"):
        m(np.zeros((3, 127), np.float32))
    m._params["bias"] = np.zeros(3, np.float32)              # a broken parameter: linear says so
    with pytest.raises(ValueError, match="bias"):
        m(np.zeros((3, 128), np.float32))


def test_transformer_layer_inference_matches_training_pass(rng):
    layer = TransformerEncoderLayer(32, 4, 64, dropout=0.0, seed=1).eval()
    x = randn(rng, (2, 7, 32), np.float32)
    inf = layer(x)
    trn, _ = layer.forward_backward(x)
    assert_close(inf, trn.astype(np.float64), np.float32)


@pytest.mark.parametrize("rows,k,n", [(60, 64, 2), (8, 128, 64), (3, 5, 7), (1, 300, 300)])
def test_functional_linear_few_multiply_adds(rng, rows, k, n):
    x = randn(rng, (rows, k), np.float32)
    w = randn(rng, (n, k), np.float32)
    b = randn(rng, (n,), np.float32)
    got = F.linear(x, w, b)
    assert got.dtype == np.float32
    ref = x.astype(np.float64) @ w.astype(np.float64).T + b
    assert_close(got, ref, np.float32)


@needs_packed
def test_auto_pack_off_reads_the_arrays(rng):
    m = randomised(rng)
    x = randn(rng, (5, 128), np.float32)
    m(x)
    assert packed_of(m) is not None
    m.auto_pack = False
    assert packed_of(m) is None
    m._params["weight"][...] *= 3.0                        # no params_changed: read in place
    assert_close(m(x), oracle(m, x), np.float32)
    assert packed_of(m) is None
    with pytest.raises(TypeError, match="auto_pack"):
        m.auto_pack = "yes"
