"""Contract tests: no input mutation, out=, overlap, no hidden copies, dtypes, 0-size dims."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import fastattn
from support import assert_close, make_layout, oracle, randn

sdpa = fastattn.scaled_dot_product_attention
FLOATS = [np.float32, np.float64]


# ------------------------------------------------------------------ out=

def _out_like(kind, shape, dtype, tmp_path):
    if kind == "C":
        return np.empty(shape, dtype)
    if kind == "transposed":  # (B, L, H, dv) buffer viewed as (B, H, L, dv)
        return np.empty((shape[0], shape[2], shape[1], shape[3]), dtype).transpose(0, 2, 1, 3)
    if kind == "padded":
        return np.empty(shape[:-1] + (shape[-1] + 5,), dtype)[..., 2:shape[-1] + 2]
    if kind == "strided_rows":
        return np.empty(shape[:-2] + (2 * shape[-2], shape[-1]), dtype)[..., ::2, :]
    if kind == "fortran":  # last axis not contiguous: goes through a temporary
        return np.asfortranarray(np.empty(shape, dtype))
    if kind == "reversed_rows":
        return np.empty(shape, dtype)[..., ::-1, :]
    if kind == "memmap":
        return np.memmap(tmp_path / "out.bin", dtype=dtype, mode="w+", shape=shape)
    raise ValueError(kind)


OUT_KINDS = ["C", "transposed", "padded", "strided_rows", "fortran", "reversed_rows", "memmap"]


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal", "padding"])
@pytest.mark.parametrize("Lk", [21, 600])
@pytest.mark.parametrize("out_kind", OUT_KINDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_out(simd_mode, dtype, out_kind, Lk, mask_kind, rng, tmp_path):
    B, H, Lq, d, dv = 2, 3, 13, 8, 6
    q, k, v = randn(rng, (B, H, Lq, d), dtype), randn(rng, (B, H, Lk, d), dtype), randn(rng, (B, H, Lk, dv), dtype)
    mask, causal = None, False
    if mask_kind == "bool":
        mask = rng.random((Lq, Lk)) < 0.6
    elif mask_kind == "float":
        mask = randn(rng, (B, 1, Lq, Lk), dtype)
    elif mask_kind == "causal":
        causal = True
    elif mask_kind == "padding":
        mask = (np.arange(Lk) < np.array([Lk, 5])[:, None]).reshape(B, 1, 1, Lk)
    inputs = [q, k, v] + ([] if mask is None else [mask])
    saved = [a.copy() for a in inputs]
    out = _out_like(out_kind, (B, H, Lq, dv), dtype, tmp_path)
    out[...] = np.nan
    res = sdpa(q, k, v, mask, causal, out=out)
    assert res is out
    assert np.shares_memory(res, out)
    assert_close(out, oracle(q, k, v, mask, causal), dtype)
    for a, a0 in zip(inputs, saved):
        np.testing.assert_array_equal(a, a0)
    # with weights
    out[...] = np.nan
    res, w = sdpa(q, k, v, mask, causal, out=out, return_weights=True)
    assert res is out
    ref_o, ref_w = oracle(q, k, v, mask, causal, return_weights=True)
    assert_close(out, ref_o, dtype)
    assert_close(w, ref_w, dtype)
    for a, a0 in zip(inputs, saved):
        np.testing.assert_array_equal(a, a0)


def test_out_float16(simd_mode, rng):
    q, k, v = (randn(rng, s, np.float16) for s in ((2, 9, 8), (2, 700, 8), (2, 700, 4)))
    out = np.full((2, 9, 4), np.nan, np.float16)
    res = sdpa(q, k, v, out=out)
    assert res is out and res.dtype == np.float16
    assert_close(out, oracle(q, k, v), np.float16)


@pytest.mark.parametrize("case", ["batch0", "Lq0", "dv0"])
def test_out_empty(case, rng):
    """A freshly allocated empty out= is accepted (NumPy gives empty arrays zero strides)."""
    qs, ks, vs = {"batch0": ((0, 3, 4), (0, 5, 4), (0, 5, 3)),
                  "Lq0": ((2, 0, 4), (2, 5, 4), (2, 5, 3)),
                  "dv0": ((2, 3, 4), (2, 5, 4), (2, 5, 0))}[case]
    q, k, v = randn(rng, qs), randn(rng, ks), randn(rng, vs)
    out = np.empty(qs[:-1] + vs[-1:])
    assert sdpa(q, k, v, out=out) is out


# ---------------------------------------------------------------- overlap

@pytest.mark.parametrize("Lk", [16, 600])
@pytest.mark.parametrize("target", ["query", "key", "value", "float_mask", "query_shifted",
                                    "value_transposed", "query_reversed_batch"])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_out_overlaps_input(simd_mode, dtype, target, Lk, rng):
    """out may alias an input: the result must be what the untouched inputs give."""
    L, d = 16, 8
    if target in ("key", "value", "value_transposed"):
        Lk = L  # the aliased array must have the output's shape
    B = 3
    q, k, v = randn(rng, (B, L, d), dtype), randn(rng, (B, Lk, d), dtype), randn(rng, (B, Lk, d), dtype)
    mask = None
    if target == "float_mask":
        Lk = d
        k, v = k[:, :Lk].copy(), v[:, :Lk].copy()
        mask = randn(rng, (B, L, Lk), dtype)
    if target == "query_shifted":  # q and out are overlapping, non-identical views of one buffer
        buf = randn(rng, (B, L, d + 1), dtype)
        q = buf[..., :d]
        out = buf[..., 1:]
    elif target == "value_transposed":
        buf = randn(rng, (B, L, 2, d), dtype)
        v = buf[:, :, 0, :]
        k = buf[:, :, 1, :]
        out = v
    elif target == "query_reversed_batch":
        q = np.ascontiguousarray(q[::-1])[::-1]
        out = q
    else:
        out = {"query": q, "key": k, "value": v, "float_mask": mask}[target]
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    m0 = None if mask is None else mask.copy()
    ref = oracle(q0, k0, v0, m0)
    res = sdpa(q, k, v, mask, out=out)
    assert res is out
    assert_close(res, ref, dtype)


def test_out_is_query_causal_streaming(simd_mode, rng):
    q = randn(rng, (2, 700, 8))
    k, v = randn(rng, (2, 700, 8)), randn(rng, (2, 700, 8))
    ref = oracle(q, k, v, is_causal=True)
    res = sdpa(q, k, v, is_causal=True, out=q)
    assert res is q
    assert_close(q, ref, np.float64)


# ------------------------------------------------------------ no copies

@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_strided_views_are_not_copied(dtype, rng):
    B, L, H, d = 2, 33, 4, 16
    qkv = randn(rng, (B, L, 3, H, d), dtype)  # fused projection output
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))  # (B, H, L, d) views
    assert not q.flags.c_contiguous
    plan = fastattn.explain(q, k, v, is_causal=True)
    assert plan.copies == ()
    assert_close(sdpa(q, k, v, is_causal=True), oracle(q, k, v, is_causal=True), dtype)
    views = (q[..., ::2, :], k[..., ::3, :], v[..., ::3, :])
    assert fastattn.explain(*views).copies == ()
    assert_close(sdpa(*views), oracle(*views), dtype)
    # broadcast (zero-stride) batch dims, negative batch strides
    kb = np.broadcast_to(k[:1], k.shape)
    vb = np.broadcast_to(v[:1], v.shape)
    assert fastattn.explain(q[::-1], kb, vb).copies == ()
    assert_close(sdpa(q[::-1], kb, vb), oracle(q[::-1], kb, vb), dtype)
    # a view whose last axis is not contiguous must be copied (only that one)
    qf = np.asfortranarray(np.ascontiguousarray(q))
    assert fastattn.explain(qf, k, v).copies == ("query",)
    assert_close(sdpa(qf, k, v), oracle(qf, k, v), dtype)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_unusual_row_strides_are_copied_and_correct(simd_mode, dtype, rng):
    """Rows that BLAS cannot address (zero or negative row stride) are copied, and only those."""
    q, k, v = randn(rng, (2, 9, 8), dtype), randn(rng, (2, 600, 8), dtype), randn(rng, (2, 600, 4), dtype)
    cases = {
        "query": (np.broadcast_to(q[:, :1], q.shape), k, v),  # row stride 0
        "key": (q, k[:, ::-1], v),                             # negative row stride
        "value": (q, k, v[:, ::-1]),
    }
    for name, args in cases.items():
        assert fastattn.explain(*args).copies == (name,)
        assert_close(sdpa(*args), oracle(*args), dtype)
        assert_close(sdpa(*args, is_causal=True), oracle(*args, is_causal=True), dtype)


def test_mismatched_dtype_copies_reported(rng):
    q = randn(rng, (4, 8), np.float32)
    k, v = randn(rng, (5, 8)), randn(rng, (5, 3))
    assert fastattn.explain(q, k, v).copies == ("query",)
    assert fastattn.explain(q, k, v).dtype == "float64"


def test_unaligned_inputs_copied(rng):
    """_validation copies misaligned arrays before handing them to C (typed pointers)."""
    q, k, v = randn(rng, (2, 5, 8)), randn(rng, (2, 7, 8)), randn(rng, (2, 7, 3))
    uq, uk, uv = (make_layout(a, "unaligned") for a in (q, k, v))
    assert not uq.flags.aligned
    assert_close(sdpa(uq, uk, uv), oracle(q, k, v), np.float64)
    assert fastattn.explain(uq, uk, uv).copies == ("query", "key", "value")


def test_unaligned_out_and_mask(simd_mode, rng):
    q, k, v = randn(rng, (2, 70, 16)), randn(rng, (2, 700, 16)), randn(rng, (2, 700, 16))
    m = make_layout(randn(rng, (70, 700)), "unaligned")
    out = make_layout(np.zeros((2, 70, 16)), "unaligned")
    res = sdpa(q, k, v, m, out=out)
    assert res is out
    assert_close(out, oracle(q, k, v, m), np.float64)


@pytest.mark.parametrize("kind", ["bool", "float32"])
def test_padding_mask_not_expanded(simd_mode, kind, rng):
    """A (B, 1, 1, Lk) mask is read in place: no (B, H, Lq, Lk) temporary."""
    B, H, Lq, Lk, d = 2, 4, 512, 1024, 16
    q, k, v = (randn(rng, (B, H, L, d), np.float32) for L in (Lq, Lk, Lk))
    lengths = np.array([Lk, 300])
    m = (np.arange(Lk) < lengths[:, None]).reshape(B, 1, 1, Lk)
    if kind == "float32":
        m = np.where(m, 0.0, -np.inf).astype(np.float32)
    expanded_bytes = B * H * Lq * Lk * m.itemsize
    out = np.empty((B, H, Lq, d), np.float32)
    tracemalloc.start()
    try:
        sdpa(q, k, v, m, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < expanded_bytes / 8, (peak, expanded_bytes)
    assert_close(out, oracle(q, k, v, m), np.float32)
    # a padding mask given as (B, 1, Lq, Lk) via broadcast_to is not materialised either
    mb = np.broadcast_to(m, (B, 1, Lq, Lk))
    tracemalloc.start()
    try:
        sdpa(q, k, v, mb, out=out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < expanded_bytes / 8, (peak, expanded_bytes)
    assert_close(out, oracle(q, k, v, m), np.float32)


# ---------------------------------------------------------------- dtypes

PROMOTIONS = [
    # (q, k, v dtypes) -> result dtype
    ((np.float16,) * 3, np.float16),
    ((np.float16, np.float16, np.float32), np.float32),
    ((np.float32, np.float32, np.float64), np.float64),
    ((np.int64,) * 3, np.float64),
    ((np.int32,) * 3, np.float64),
    ((np.int8, np.uint8, np.int16), np.float64),
    ((np.uint64,) * 3, np.float64),
    ((np.bool_,) * 3, np.float64),
    ((np.int32, np.float32, np.float32), np.float64),
    ((np.int8, np.float16, np.float16), np.float16),
    ((np.bool_, np.float32, np.float32), np.float32),
]


@pytest.mark.parametrize("Lk", [7, 600])
@pytest.mark.parametrize("dtypes,expected", PROMOTIONS, ids=lambda x: str(x))
def test_dtype_promotion(simd_mode, dtypes, expected, Lk, rng):
    def make(shape, dt):
        if np.dtype(dt).kind == "b":
            return rng.random(shape) < 0.5
        if np.dtype(dt).kind in "iu":
            return rng.integers(0, 3, shape).astype(dt)
        return randn(rng, shape, dt)
    q, k, v = make((2, 5, 4), dtypes[0]), make((2, Lk, 4), dtypes[1]), make((2, Lk, 3), dtypes[2])
    assert np.dtype(expected) == (np.result_type(q, k, v) if np.result_type(q, k, v).kind == "f" else np.float64)
    o, w = sdpa(q, k, v, return_weights=True)
    assert o.dtype == expected and w.dtype == expected
    ref_o, ref_w = oracle(q, k, v, return_weights=True)
    assert_close(o, ref_o, expected)
    assert_close(w, ref_w, expected)
    o2 = sdpa(q, k, v, is_causal=True)
    assert o2.dtype == expected
    assert_close(o2, oracle(q, k, v, is_causal=True), expected)
    assert fastattn.explain(q, k, v).dtype == ("float32" if expected in (np.float16, np.float32) else "float64")


@pytest.mark.parametrize("mask_dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_float_mask_dtype_does_not_change_result_dtype(dtype, mask_dtype, rng):
    q, k, v = randn(rng, (5, 4), dtype), randn(rng, (7, 4), dtype), randn(rng, (7, 3), dtype)
    m = randn(rng, (5, 7), mask_dtype)
    o = sdpa(q, k, v, m)
    assert o.dtype == dtype
    # the bias is applied in the compute dtype
    assert_close(o, oracle(q, k, v, m.astype(dtype)), dtype)


def test_non_native_byte_order(simd_mode, rng):
    q, k, v = randn(rng, (2, 5, 4)), randn(rng, (2, 600, 4)), randn(rng, (2, 600, 3))
    m = randn(rng, (5, 600))
    be = [a.astype(a.dtype.newbyteorder(">")) for a in (q, k, v, m)]
    o = sdpa(*be)
    assert o.dtype == np.float64 and o.dtype.isnative
    assert_close(o, oracle(q, k, v, m), np.float64)
    o = sdpa(be[0].astype(">f4"), be[1].astype(">f4"), be[2].astype(">f4"), be[3])
    assert o.dtype == np.float32
    f32 = [a.astype(np.float32) for a in (q, k, v)]
    assert_close(o, oracle(*f32, m.astype(np.float32)), np.float32)


def test_list_inputs():
    q = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    k = [[1.0, 0.0], [0.0, 1.0]]
    v = [[1, 2, 3], [4, 5, 6]]
    o = sdpa(q, k, v)
    assert isinstance(o, np.ndarray) and o.dtype == np.float64 and o.shape == (3, 3)
    assert_close(o, oracle(q, k, v), np.float64)
    o = sdpa(q, k, v, [[True, False], [False, True], [False, False]])
    assert_close(o, oracle(q, k, v, np.array([[True, False], [False, True], [False, False]])), np.float64)
    np.testing.assert_array_equal(o[0], [1, 2, 3])
    np.testing.assert_array_equal(o[2], [0, 0, 0])
    o = sdpa([[[1, 2]]], [[[3, 4]]], [[[5]]])  # ints -> float64
    assert o.dtype == np.float64 and o.shape == (1, 1, 1) and o[0, 0, 0] == 5.0


def test_hand_computed():
    """softmax([0, ln 3]) = [1/4, 3/4]."""
    q = np.array([[1.0]])
    k = np.array([[0.0], [np.log(3.0)]])
    v = np.array([[4.0, 0.0], [0.0, 8.0]])
    o, w = sdpa(q, k, v, scale=1.0, return_weights=True)
    np.testing.assert_allclose(w, [[0.25, 0.75]], rtol=1e-15)
    np.testing.assert_allclose(o, [[1.0, 6.0]], rtol=1e-15)
    o = sdpa(q, k, v, np.array([[0.0, -np.inf]]), scale=1.0)
    np.testing.assert_array_equal(o, [[4.0, 0.0]])


# ---------------------------------------------------------- 0-size dims

ZERO_CASES = {
    "batch0": ((0, 3, 4), (0, 5, 4), (0, 5, 6)),
    "batch0_bcast": ((0, 1, 3, 4), (1, 2, 5, 4), (1, 2, 5, 6)),
    "Lq0": ((2, 0, 4), (2, 5, 4), (2, 5, 6)),
    "Lk0": ((2, 3, 4), (2, 0, 4), (2, 0, 6)),
    "d0": ((2, 3, 0), (2, 5, 0), (2, 5, 6)),
    "dv0": ((2, 3, 4), (2, 5, 4), (2, 5, 0)),
    "d0_dv0": ((2, 3, 0), (2, 5, 0), (2, 5, 0)),
    "Lk0_d0": ((2, 3, 0), (2, 0, 0), (2, 0, 6)),
    "d0_stream": ((1, 3, 0), (1, 600, 0), (1, 600, 2)),
    # more than 4 queries: the streaming path (with SIMD) with no key tile at all
    "Lk0_stream": ((3, 70, 4), (3, 0, 4), (3, 0, 3)),
    "Lk0_d0_stream": ((1, 2, 9, 0), (1, 2, 0, 0), (1, 2, 0, 5)),
    "d0_many_q": ((2, 9, 0), (2, 7, 0), (2, 7, 3)),
}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "float", "causal"])
@pytest.mark.parametrize("weights", [False, True])
@pytest.mark.parametrize("case", list(ZERO_CASES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_zero_size(dtype, case, weights, mask_kind, rng):
    qs, ks, vs = ZERO_CASES[case]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    Lq, Lk = qs[-2], ks[-2]
    mask, causal = None, False
    if mask_kind == "bool":
        mask = np.ones((Lq, Lk), bool)
        mask[::2, 1::2] = False
    elif mask_kind == "float":
        mask = randn(rng, (Lq, Lk), dtype)
    elif mask_kind == "causal":
        causal = True
    ref_o, ref_w = oracle(q, k, v, mask, causal, return_weights=True)
    res = sdpa(q, k, v, mask, causal, return_weights=weights)
    o = res[0] if weights else res
    assert o.shape == ref_o.shape and o.dtype == dtype
    assert np.all(np.isfinite(o))
    assert_close(o, ref_o, dtype)
    if weights:
        w = res[1]
        ref_w = np.broadcast_to(ref_w, o.shape[:-1] + (Lk,))
        assert w.shape == ref_w.shape and w.dtype == dtype
        assert_close(w, ref_w, dtype)
    plan = fastattn.explain(q, k, v, mask, causal, return_weights=weights)
    if o.size == 0 and not (weights and res[1].size):
        assert plan.path == "empty"


def test_d0_gives_uniform_weights():
    q, k = np.zeros((3, 0)), np.zeros((4, 0))
    v = np.arange(8.0).reshape(4, 2)
    o, w = sdpa(q, k, v, return_weights=True)
    np.testing.assert_allclose(w, np.full((3, 4), 0.25), rtol=1e-15)
    np.testing.assert_allclose(o, np.tile(v.mean(axis=0), (3, 1)), rtol=1e-15)


def test_lk0_gives_zeros():
    o, w = sdpa(np.ones((2, 3, 4)), np.ones((2, 0, 4)), np.ones((2, 0, 5)), return_weights=True)
    np.testing.assert_array_equal(o, np.zeros((2, 3, 5)))
    assert w.shape == (2, 3, 0)


def test_accepts_numpy_bool_flags(rng):
    q, k, v = randn(rng, (5, 4)), randn(rng, (5, 4)), randn(rng, (5, 3))
    assert_close(sdpa(q, k, v, is_causal=np.True_), oracle(q, k, v, is_causal=True), np.float64)
    o, w = sdpa(q, k, v, return_weights=np.True_)
    assert_close(w, oracle(q, k, v, return_weights=True)[1], np.float64)
    assert_close(sdpa(q, k, v, scale=np.float64(0.3)), oracle(q, k, v, scale=0.3), np.float64)
    assert_close(sdpa(q, k, v, n_threads=np.int64(2)), oracle(q, k, v), np.float64)
