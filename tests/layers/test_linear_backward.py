"""fastattn.functional.linear_backward, embedding and embedding_backward against
the float64 oracle (``fastattn._reference.linear_backward`` /
``embedding_backward``, written from the dense math), torch autograd (float64,
1e-10 relative) and central finite differences; bit-identical results for any
thread count; zero sizes; bad input; inputs unchanged.  Also
``fastattn._proj.matmul``, the deterministic product under linear_backward.

Upstream gradients are random (never all ones, which hides transposition and
summation bugs).
"""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _embedding, _linear, _proj
from fastattn import functional as F
from fastattn import _reference as R
from fastattn.functional import embedding, embedding_backward, linear, linear_backward
from fastattn.layers import Embedding

from support import assert_central_differences, assert_close, make_layout, randn

torch = pytest.importorskip("torch")


def _torch_linear_grads(g, x, w, b):
    tx, tw = (torch.tensor(np.ascontiguousarray(a, np.float64), requires_grad=True) for a in (x, w))
    tb = None if b is None else torch.tensor(np.asarray(b, np.float64), requires_grad=True)
    torch.nn.functional.linear(tx, tw, tb).backward(torch.tensor(np.ascontiguousarray(g, np.float64)))
    return tx.grad.numpy(), tw.grad.numpy(), None if tb is None else tb.grad.numpy()


def _close_to_torch(got, want):
    for a, t in zip(got, want):
        if t is None:
            assert a is None
            continue
        assert a.shape == t.shape, (a.shape, t.shape)
        np.testing.assert_allclose(a, t, rtol=1e-10, atol=1e-10 * max(1.0, np.abs(t).max(initial=0)))


# ------------------------------------------------------------------ linear_backward

# leading dims of x: none, one, three; sizes with several matmul tiles (rows, K, N > 256)
LEADS = [(), (7,), (2, 3, 4), (300,), (3, 100, 2)]


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
@pytest.mark.parametrize("lead", LEADS, ids=lambda s: "x".join(map(str, s)) or "none")
def test_float64_matches_the_oracle_and_torch_autograd(lead, bias, rng):
    K, N = (9, 5) if np.prod(lead) < 100 else (270, 300)
    x, w, g = randn(rng, lead + (K,)), randn(rng, (N, K)), randn(rng, lead + (N,))
    b = randn(rng, (N,)) if bias else None
    before = [a.copy() for a in (x, w, g) + ((b,) if bias else ())]
    got = linear_backward(g, x, w, b, n_threads=2)
    ref = R.linear_backward(g, x, w, b)
    for name, a, r, inp in zip(("dx", "dweight", "dbias"), got, ref, (x, w, b)):
        if inp is None:
            assert a is None and r is None
            continue
        assert a.shape == inp.shape and a.dtype == np.float64, (name, a.shape, a.dtype)
        assert_close(a, r, np.float64, err_msg=name)
    _close_to_torch(got, _torch_linear_grads(g, x, w, b))
    for a, c in zip((x, w, g) + ((b,) if bias else ()), before):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("case", ["x_transposed_2d", "x_heads_transposed", "x_strided", "x_padded",
                                  "w_transposed", "w_strided", "g_transposed", "flipped",
                                  "readonly", "lists"])
def test_views_and_layouts_give_the_same_gradients(case, rng):
    """Transposed, strided, padded, flipped and read-only views of x, W and
    grad_out (some read in place as transposed operands, the others copied)."""
    x, w, g, b = randn(rng, (40, 30)), randn(rng, (20, 30)), randn(rng, (40, 20)), randn(rng, (20,))
    if case == "x_transposed_2d":
        x = np.ascontiguousarray(x.T).T               # F-ordered: read as its transpose
    elif case == "x_heads_transposed":
        x = make_layout(randn(rng, (2, 5, 4, 30)), "transposed")
        g = randn(rng, (2, 5, 4, 20))
    elif case == "x_strided":
        x = make_layout(x, "strided")
    elif case == "x_padded":
        x = make_layout(x, "padded")
    elif case == "w_transposed":
        w = np.ascontiguousarray(w.T).T               # W.T of a C-ordered (K, N) array
    elif case == "w_strided":
        w = randn(rng, (20, 60))[:, ::2]              # last axis not contiguous: copied
    elif case == "g_transposed":
        g = np.ascontiguousarray(g.T).T
    elif case == "flipped":
        x, w, g = x[::-1], w[::-1, ::-1], g[::-1, ::-1]
    elif case == "readonly":
        for a in (x, w, g, b):
            a.flags.writeable = False
    before = [np.array(a, copy=True) for a in (x, w, g, b)]
    if case == "lists":
        got = linear_backward(g.tolist(), x.tolist(), w.tolist(), b.tolist())
    else:
        got = linear_backward(g, x, w, b)
    want = _torch_linear_grads(g, x, w, b)
    _close_to_torch(got, want)
    for a, c in zip((x, w, g, b), before):
        np.testing.assert_array_equal(a, c)
    if case in ("x_transposed_2d", "w_transposed", "g_transposed"):  # read in place, not copied
        view = {"x_transposed_2d": x, "w_transposed": w, "g_transposed": g}[case]
        buf, transposed = _linear._operand(view, np.dtype(np.float64))
        assert transposed and np.shares_memory(buf, view)
    # the C-contiguous call's values (to rounding: a transposed operand is
    # another gemm variant)
    plain = linear_backward(*(np.ascontiguousarray(a) for a in (g, x, w, b)))
    for a, p in zip(got, plain):
        np.testing.assert_allclose(a, p, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("lead", [(5,), (3, 90)], ids=["few_rows", "270_rows"])
def test_float32_within_the_tolerance_table(lead, rng):
    K, N = 70, 90
    x, w, g, b = (randn(rng, s, np.float32) for s in (lead + (K,), (N, K), lead + (N,), (N,)))
    got = linear_backward(g, x, w, b)
    ref = R.linear_backward(g, x, w, b)
    for name, a, r in zip(("dx", "dweight", "dbias"), got, ref):
        assert a.dtype == np.float32, name
        assert_close(a, r, np.float32, err_msg=name)
    # and not merely float64 results cast down: float32 products do differ from them
    assert not np.array_equal(got[1], ref[1].astype(np.float32))


def test_dtypes_follow_the_inputs(rng):
    x16, w16, g16, b16 = (randn(rng, s, np.float16) for s in ((6, 4), (3, 4), (6, 3), (3,)))
    got = linear_backward(g16, x16, w16, b16)
    assert [a.dtype for a in got] == [np.float16] * 3
    ref = R.linear_backward(g16, x16, w16, b16)
    for a, r in zip(got, ref):
        assert_close(a, r, np.float16)
    # float16 x with float32 weights: computed in float32, dx float16, dweight float32
    dx, dw, db = linear_backward(g16, x16, w16.astype(np.float32), b16)
    assert (dx.dtype, dw.dtype, db.dtype) == (np.float16, np.float32, np.float16)
    # integer x: computed in float64, dx in the compute dtype
    xi = np.arange(24).reshape(6, 4) % 5
    dx, dw, db = linear_backward(randn(rng, (6, 3)), xi, randn(rng, (3, 4)))
    assert (dx.dtype, dw.dtype, db) == (np.float64, np.float64, None)
    # float32 inputs and a float64 grad_out: grad_out is cast to float32
    x, w = randn(rng, (6, 4), np.float32), randn(rng, (3, 4), np.float32)
    g = randn(rng, (6, 3))
    got = linear_backward(g, x, w)
    assert got[0].dtype == np.float32 and got[1].dtype == np.float32
    np.testing.assert_array_equal(got[1], linear_backward(g.astype(np.float32), x, w)[1])


def test_central_finite_differences(rng):
    """d/dθ of sum(linear(x, W, b) * g) by central differences, for x, W and b."""
    x, w, b, g = randn(rng, (2, 3, 4)), randn(rng, (5, 4)), randn(rng, (5,)), randn(rng, (2, 3, 5))
    grads = linear_backward(g, x, w, b)

    def loss(x, w, b):
        return float(np.sum(linear(x, w, b) * g))

    assert_central_differences(loss, [x, w, b], grads, rng, points=5)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_same_bits_for_any_thread_count(dtype, rng):
    lead, K, N = (7, 110), 300, 260       # 770 rows: several tiles in both products
    x, w, g, b = (randn(rng, s, dtype) for s in (lead + (K,), (N, K), lead + (N,), (N,)))
    rows = int(np.prod(lead))
    for M, Nc, Rd in ((rows, K, N), (N, K, rows)):   # dx and dweight: more than one tile each
        tm, tn = _proj.matmul_tiles(M, Nc, Rd)
        assert -(-M // tm) * -(-Nc // tn) > 3, (M, Nc, Rd, tm, tn)
    res = [linear_backward(g, x, w, b, n_threads=n) for n in (1, 2, 3)]
    for other in res[1:]:
        for a, c in zip(res[0], other):
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("lead,K,N", [((0,), 4, 3), ((3, 0), 4, 3), ((5,), 0, 3), ((2, 5), 4, 0),
                                      ((0,), 0, 0)])
def test_zero_sizes(lead, K, N, rng):
    x, w, g, b = randn(rng, lead + (K,)), randn(rng, (N, K)), randn(rng, lead + (N,)), randn(rng, (N,))
    got = linear_backward(g, x, w, b)
    ref = R.linear_backward(g, x, w, b)
    want = _torch_linear_grads(g, x, w, b)
    for a, r, t, inp in zip(got, ref, want, (x, w, b)):
        assert a.shape == inp.shape and a.dtype == np.float64
        assert_close(a, r, np.float64)
        np.testing.assert_allclose(a, t, rtol=1e-12, atol=1e-12)
    rows = int(np.prod(lead))
    if rows == 0 or N == 0:     # dx and dweight: sums of nothing, exact zeros
        assert not got[0].any() and not got[1].any()
    if K == 0 and rows and N:   # dbias is still the sum of grad_out
        assert np.abs(got[2]).max() > 0


def test_linear_backward_bad_input_names_the_argument(rng):
    x, w, b = randn(rng, (2, 5, 4)), randn(rng, (3, 4)), randn(rng, (3,))
    g = randn(rng, (2, 5, 3))
    before = [a.copy() for a in (x, w, b, g)]
    cases = [
        ((g[..., :2], x, w, b), ValueError, r"^grad_out: expected shape \(2, 5, 3\), got \(2, 5, 2\)$"),
        ((g[0], x, w, b), ValueError, r"^grad_out: expected shape \(2, 5, 3\), got \(5, 3\)$"),
        ((g.astype(np.int64), x, w, b), TypeError,
         r"^grad_out: expected a real floating array \(float16, float32 or float64\), got dtype int64$"),
        ((g.astype(np.complex128), x, w, b), TypeError, r"^grad_out: expected a real floating array .* complex128"),
        ((g > 0, x, w, b), TypeError, r"^grad_out: expected a real floating array .* got dtype bool"),
        ((g, x[..., :3], w, b), ValueError, r"^x: expected last dim 4 \(weight's in_features\), got shape \(2, 5, 3\)"),
        ((g, x, w[0], b), ValueError, r"^weight: expected a 2-d array \(out_features, in_features\), got shape \(4,\)"),
        ((g, x, w, b[:2]), ValueError, r"^bias: expected shape \(3,\), got \(2,\)"),
        ((g, x.astype(np.complex128), w, b), TypeError, r"^x: complex dtypes are not supported"),
        ((g, x, w, b.astype(np.complex64)), TypeError, r"^bias: complex dtypes are not supported"),
        ((g, x, w, np.array(["a", "b", "c"])), TypeError, r"^bias: expected a real numeric dtype"),
        ((g, [[1.0], [1.0, 2.0]], w, b), TypeError, r"^x: expected an array-like of numbers"),
    ]
    for args, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            linear_backward(*args)
    with pytest.raises(ValueError, match=r"^n_threads: expected a positive integer \(>= 1\), got 0"):
        linear_backward(g, x, w, b, n_threads=0)
    with pytest.raises(TypeError, match=r"^n_threads: expected a positive integer, got float 2.0"):
        linear_backward(g, x, w, b, n_threads=2.0)
    for a, c in zip((x, w, b, g), before):
        np.testing.assert_array_equal(a, c)


def test_linear_forward_unchanged_by_the_shared_checks(rng):
    """linear's checks moved into a helper shared with the backward: same messages."""
    x, w = randn(rng, (2, 4)), randn(rng, (3, 4))
    with pytest.raises(ValueError, match=r"^bias: expected shape \(3,\), got \(4,\)"):
        linear(x, w, np.zeros(4))
    with pytest.raises(ValueError, match=r"^x: expected last dim 4"):
        linear(x[:, :3], w)
    y = linear(x, w, np.ones(3, np.float32))
    np.testing.assert_allclose(y, x @ w.T + 1, rtol=1e-12)


# ------------------------------------------------------------------ _proj.matmul

@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_proj_matmul_all_transposes_and_tiles(ta, tb, dtype, rng):
    M, N, Rd = 300, 270, 90
    a = randn(rng, (Rd, M) if ta else (M, Rd), dtype)
    b = randn(rng, (N, Rd) if tb else (Rd, N), dtype)
    ref = (a.astype(np.float64).T if ta else a.astype(np.float64)) @ \
          (b.astype(np.float64).T if tb else b.astype(np.float64))
    _linear._ensure_runtime()
    outs = []
    for nt in (1, 2, 3):
        c = np.full((M, N), np.nan, dtype)
        ntiles = _proj.matmul(a, ta, b, tb, c, nt)
        assert ntiles == 4  # 256 x 256 tiles
        assert_close(c, ref, dtype)
        outs.append(c)
    for c in outs[1:]:
        np.testing.assert_array_equal(outs[0], c)


def test_proj_matmul_tiles_depend_on_the_shapes_only():
    assert _proj.matmul_tiles(10, 10, 10) == (10, 10)              # below 2 MFLOP: one tile
    assert _proj.matmul_tiles(1000, 1000, 1000) == (256, 256)
    tm, tn = _proj.matmul_tiles(2048, 512, 8192)                   # a 256 x 256 tile > 1 GFLOP: halved
    assert 2.0 * tm * tn * 8192 <= 1e9 and (tm, tn) != (256, 256)
    assert _proj.matmul_tiles(64, 64, 10**7) == (64, 64)           # never below 64
    c = np.full((3, 2), np.nan)
    assert _proj.matmul(np.zeros((3, 0)), False, np.zeros((0, 2)), False, c, 2) == 0
    np.testing.assert_array_equal(c, 0)                            # a sum of no terms
    with pytest.raises(ValueError, match="operands do not match"):
        _proj.matmul(np.zeros((3, 4)), False, np.zeros((5, 2)), False, c, 1)


# ------------------------------------------------------------------ embedding

def _torch_embedding_grad(g, ids, n, padding_idx):
    tw = torch.tensor(randn(np.random.default_rng(5), (n, g.shape[-1])), requires_grad=True)
    out = torch.nn.functional.embedding(torch.tensor(np.asarray(ids, np.int64)), tw,
                                        padding_idx=padding_idx)
    out.backward(torch.tensor(np.asarray(g, np.float64)))
    return tw.grad.numpy()


@pytest.mark.parametrize("shape", [(), (7,), (3, 4), (2, 3, 5)], ids=lambda s: "x".join(map(str, s)) or "0d")
def test_embedding_forward_is_the_lookup(shape, rng):
    w = randn(rng, (6, 3), np.float32)
    ids = rng.integers(0, 6, size=shape)
    before = w.copy()
    out = embedding(ids, w, padding_idx=2)
    assert out.shape == shape + (3,) and out.dtype == np.float32
    tw = torch.from_numpy(w.copy())
    want = torch.nn.functional.embedding(torch.tensor(ids), tw, padding_idx=2).numpy()
    np.testing.assert_array_equal(out, want)
    out[...] = 7  # a new array, not a view of the weight
    np.testing.assert_array_equal(w, before)
    np.testing.assert_array_equal(embedding(ids.tolist(), w.tolist()), want)


@pytest.mark.parametrize("padding_idx", [None, 0, 3, -1])
@pytest.mark.parametrize("shape", [(), (40,), (5, 8), (2, 3, 7)], ids=lambda s: "x".join(map(str, s)) or "0d")
def test_embedding_backward_matches_the_oracle_and_torch(shape, padding_idx, rng):
    n, E = 6, 5
    ids = rng.integers(0, n, size=shape)
    if ids.size > 1:
        ids.reshape(-1)[:2] = 3       # repeated ids (also the padding row for padding_idx=3)
    g = randn(rng, shape + (E,))
    before = [ids.copy(), g.copy()]
    dw = embedding_backward(g, ids, n, padding_idx=padding_idx)
    assert dw.shape == (n, E) and dw.dtype == np.float64
    pad = None if padding_idx is None else padding_idx % n
    ref = R.embedding_backward(g, ids, n, pad)
    assert_close(dw, ref, np.float64)
    want = _torch_embedding_grad(g, ids, n, padding_idx)
    np.testing.assert_allclose(dw, want, rtol=1e-10, atol=1e-10 * np.abs(want).max(initial=1))
    if pad is not None:
        assert np.all(dw[pad] == 0)
        if np.any(ids == pad):                  # the padding id occurs and still gets nothing
            assert np.abs(np.sum(g[ids == pad], axis=0)).max() > 0
    absent = np.setdiff1d(np.arange(n), ids)
    assert np.all(dw[absent] == 0)
    for a, c in zip((ids, g), before):
        np.testing.assert_array_equal(a, c)


def test_embedding_backward_sums_repeated_ids_in_their_order(rng):
    """The sums are the sequential ones of a loop over the ids, bit for bit, in
    float32 (whose rounding depends on the order), as numpy.add.at's; from a
    non-contiguous grad_out too."""
    n, E = 4, 33
    ids = rng.integers(0, n, size=(50, 7))
    scale = np.float32(1e3) ** rng.integers(-1, 2, size=(50, 7, 1)).astype(np.float32)
    g = (randn(rng, (50, 7, E)) * scale).astype(np.float32)   # magnitudes 1e-3 to 1e3
    loop = np.zeros((n, E), np.float32)
    for i, row in zip(ids.reshape(-1), g.reshape(-1, E)):
        loop[i] += row
    got = embedding_backward(g, ids, n)
    np.testing.assert_array_equal(got, loop)
    # a different order of the same terms rounds differently (so the test above can fail)
    rev = np.zeros((n, E), np.float32)
    for i, row in zip(ids.reshape(-1)[::-1], g.reshape(-1, E)[::-1]):
        rev[i] += row
    assert not np.array_equal(rev, loop)
    at = np.zeros((n, E), np.float32)
    np.add.at(at, ids.reshape(-1), g.reshape(-1, E))
    np.testing.assert_array_equal(got, at)
    wide = np.zeros((50, 7, 2 * E), np.float32)
    wide[..., ::2] = g
    np.testing.assert_array_equal(embedding_backward(wide[..., ::2], ids, n), loop)
    np.testing.assert_array_equal(embedding_backward(g, ids, n), got)


def test_embedding_backward_dtypes(rng):
    ids = rng.integers(0, 5, size=(4, 6))
    g16 = randn(rng, (4, 6, 3), np.float16)
    dw = embedding_backward(g16, ids, 5)
    assert dw.dtype == np.float16
    assert_close(dw, R.embedding_backward(g16, ids, 5), np.float16)
    g32 = randn(rng, (4, 6, 3), np.float32)
    dw64 = embedding_backward(g32, ids, 5, dtype=np.float64)   # summed in float64
    assert dw64.dtype == np.float64
    assert_close(dw64, R.embedding_backward(g32, ids, 5), np.float64)
    dw32 = embedding_backward(g32.astype(np.float64), ids, 5, dtype="float32")
    assert dw32.dtype == np.float32
    np.testing.assert_array_equal(dw32, dw64.astype(np.float32))
    assert embedding_backward(g32, ids.astype(np.uint8), 5).dtype == np.float32


@pytest.mark.parametrize("ids_shape,E,n", [((0,), 3, 4), ((3, 0), 3, 4), ((5,), 0, 4), ((0,), 2, 0)])
def test_embedding_zero_sizes(ids_shape, E, n, rng):
    ids = rng.integers(0, max(n, 1), size=ids_shape)
    g = randn(rng, ids_shape + (E,))
    dw = embedding_backward(g, ids, n, padding_idx=0 if n else None)
    assert dw.shape == (n, E)
    np.testing.assert_array_equal(dw, np.zeros((n, E)))
    w = randn(rng, (n, E))
    assert embedding(ids, w).shape == ids_shape + (E,)


def test_embedding_bad_input_names_the_argument(rng):
    w = randn(rng, (5, 3))
    ids = np.array([[0, 4], [2, 2]])
    g = randn(rng, (2, 2, 3))
    before = [a.copy() for a in (w, ids, g)]
    fwd = [
        ((ids.astype(float), w), TypeError, r"^ids: expected an integer array of token ids, got dtype float64$"),
        ((ids > 1, w), TypeError, r"^ids: expected an integer array of token ids, got dtype bool$"),
        ((np.array([-1, 3]), w), ValueError, r"^ids: expected token ids in \[0, 5\), got values in \[-1, 3\]$"),
        ((np.array([0, 5]), w), ValueError, r"^ids: expected token ids in \[0, 5\), got values in \[0, 5\]$"),
        ((ids, w[0]), ValueError, r"^weight: expected a 2-d array \(num_embeddings, embedding_dim\), got shape \(3,\)$"),
        ((ids, w.astype(np.complex128)), TypeError, r"^weight: complex dtypes are not supported"),
    ]
    for args, exc, pattern in fwd:
        with pytest.raises(exc, match=pattern):
            embedding(*args)
    with pytest.raises(ValueError, match=r"^padding_idx: expected an index in \[0, 5\), got 5$"):
        embedding(ids, w, padding_idx=5)
    bwd = [
        ((g, ids, 5), dict(padding_idx=-6), ValueError, r"^padding_idx: expected an int >= -5, got -6$"),
        ((g, ids, 5), dict(padding_idx=True), TypeError, r"^padding_idx: expected an int >= -5, got bool True$"),
        ((g, ids, 5), dict(padding_idx=1.0), TypeError, r"^padding_idx: expected an int >= -5, got float 1.0$"),
        ((g, ids, -1), {}, ValueError, r"^num_embeddings: expected an int >= 0, got -1$"),
        ((g, ids, 5.0), {}, TypeError, r"^num_embeddings: expected an int >= 0, got float 5.0$"),
        ((g, ids, 4), {}, ValueError, r"^ids: expected token ids in \[0, 4\), got values in \[0, 4\]$"),
        ((g, ids.astype(np.float32), 5), {}, TypeError, r"^ids: expected an integer array of token ids"),
        ((g[:, :1], ids, 5), {}, ValueError,
         r"^grad_out: expected shape ids.shape \+ \(embedding_dim,\) = \(2, 2\) \+ \(3,\), got \(2, 1, 3\)$"),
        ((g[..., 0], ids, 5), {}, ValueError, r"^grad_out: expected shape ids.shape \+ \(embedding_dim,\)"),
        ((np.float64(1.0), ids, 5), {}, ValueError, r"^grad_out: expected shape .* \+ \(embedding_dim,\), got \(\)$"),
        ((g.astype(np.int32), ids, 5), {}, TypeError,
         r"^grad_out: expected a real floating array \(float16, float32 or float64\), got dtype int32$"),
        ((g, ids, 5), dict(dtype=np.int64), TypeError, r"^dtype: expected float16, float32 or float64, got int64$"),
        ((g, ids, 5), dict(dtype="nope"), TypeError, r"^dtype: expected float16, float32 or float64, got 'nope'$"),
    ]
    for args, kw, exc, pattern in bwd:
        with pytest.raises(exc, match=pattern):
            embedding_backward(*args, **kw)
    for a, c in zip((w, ids, g), before):
        np.testing.assert_array_equal(a, c)


def test_embedding_layer_calls_functional_with_its_messages(monkeypatch, rng):
    layer = Embedding(10, 3, padding_idx=-2, seed=0)
    ids = np.array([[1, 8], [8, 0]])
    calls = []
    real = _embedding.embedding

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    import fastattn.functional as F
    monkeypatch.setattr(F, "embedding", spy)
    out = layer(ids)
    assert calls == [{"padding_idx": 8}]
    np.testing.assert_array_equal(out, layer.weight[ids])
    assert np.all(out[0, 1] == 0) and np.all(out[1, 0] == 0)   # the padding row (id 8) is zeros
    with pytest.raises(TypeError, match=r"^ids: expected an integer array of token ids, got dtype float64$"):
        layer(ids.astype(float))
    with pytest.raises(ValueError, match=r"^ids: expected token ids in \[0, 10\), got values in \[-1, 10\]$"):
        layer(np.array([-1, 10]))


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_embedding_accumulate_in_place_matches_embedding_backward(dt, rng):
    """The layers' in-place form: acc + embedding_backward's sums (from zero:
    the same bits), the padding row untouched, other dtypes declined."""
    n, E = 6, 5
    ids = rng.integers(0, n, size=(9, 4))
    g = randn(rng, (9, 4, E), dt)
    acc = np.zeros((n, E), dt)
    assert F._embedding_backward_into(acc, g, ids, padding_idx=2)
    np.testing.assert_array_equal(acc, embedding_backward(g, ids, n, padding_idx=2))
    base = randn(rng, (n, E), dt)
    acc = base.copy()
    assert F._embedding_backward_into(acc, g, ids, padding_idx=2)
    np.testing.assert_array_equal(acc[2], base[2])
    assert_close(acc, base + R.embedding_backward(g, ids, n, padding_idx=2), dt)
    other = np.float64 if dt == np.float32 else np.float32
    acc = np.zeros((n, E), other)
    assert not F._embedding_backward_into(acc, g, ids)
    assert not acc.any()
    with pytest.raises(ValueError, match="ids: expected token ids in"):
        F._embedding_backward_into(np.zeros((n, E), dt), g, ids + n)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows, N, K, cols", [(1024, 768, 512, 256), (96, 48, 40, 17), (70, 33, 64, 64),
                                              (8, 12, 9, 4)])
def test_input_grad_of_a_column_slice_is_those_columns_of_dx(rows, N, K, cols, dtype, rng):
    """functional._linear_input_grad with a slice of the weight's columns (the
    decoder's embedding columns of W_ih): on the float32 packed kernel exactly
    those columns of linear_backward's dx (each column its own product), on
    the tiled products (float64, few rows) those columns to rounding;
    _linear_weight_grads exactly linear_backward's dW and db; the float64
    oracle agrees."""
    g = randn(rng, (rows, N), dtype)
    x = randn(rng, (rows, K), dtype)
    w, b = randn(rng, (N, K), dtype), randn(rng, (N,), dtype)
    dx, dw, db = linear_backward(g, x, w, b)
    part = F._linear_input_grad(g, x[:, :cols], w[:, :cols])
    assert part.dtype == dtype and part.shape == (rows, cols)
    if dtype == np.float32 and _proj.packs_transposed(rows, K, N):
        np.testing.assert_array_equal(part, dx[:, :cols])
    else:
        assert_close(part, dx[:, :cols].astype(np.float64), dtype)
    dw2, db2 = F._linear_weight_grads(g, x, w, b)
    np.testing.assert_array_equal(dw2, dw)
    np.testing.assert_array_equal(db2, db)
    want = g.astype(np.float64) @ w[:, :cols].astype(np.float64)
    assert_close(part, want, dtype)
