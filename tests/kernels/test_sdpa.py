"""Numeric grid: dtype x shape x layout x mask, SIMD on and off, against the oracle."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from support import (
    NO_COPY_LAYOUTS,
    allowed_matrix,
    assert_close,
    check_weights,
    make_layout,
    oracle,
    randn,
)

sdpa = fastattn.scaled_dot_product_attention
FLOATS = [np.float32, np.float64]

# (query shape, key shape, value shape); keys > 512 take the streaming path
SHAPES = {
    "all_ones": ((1, 1), (1, 1), (1, 1)),
    "Lq1_Lk1": ((1, 8), (1, 8), (1, 8)),
    "Lq1": ((1, 16), (13, 16), (13, 5)),
    "Lk1": ((9, 4), (1, 4), (1, 3)),
    "d1": ((7, 1), (13, 1), (13, 3)),
    "dv1": ((7, 6), (13, 6), (13, 1)),
    "odd_13_7": ((13, 7), (7, 7), (7, 13)),
    "odd_33": ((33, 33), (33, 33), (33, 33)),
    "1lead": ((3, 7, 13), (3, 33, 13), (3, 33, 7)),
    "2lead": ((2, 3, 13, 8), (2, 3, 7, 8), (2, 3, 7, 8)),
    "3lead": ((2, 2, 2, 5, 4), (2, 2, 2, 9, 4), (2, 2, 2, 9, 6)),
    "bcast_2x1_1x3": ((2, 1, 13, 8), (1, 3, 13, 8), (1, 3, 13, 8)),
    "bcast_q_unbatched": ((13, 8), (4, 7, 8), (4, 7, 5)),
    "bcast_mixed_ranks": ((2, 3, 5, 8), (7, 8), (3, 7, 8)),
    "bcast_v_only": ((5, 8), (7, 8), (2, 3, 7, 4)),
    "Lq_many_blocks": ((2, 200, 16), (2, 13, 16), (2, 13, 16)),
    "single_pass_512": ((1, 64, 32), (1, 512, 32), (1, 512, 32)),
    "stream_513": ((2, 17, 16), (2, 513, 16), (2, 513, 16)),
    "stream_700": ((2, 70, 24), (2, 700, 24), (2, 700, 24)),
    "stream_bcast": ((2, 1, 33, 16), (1, 3, 777, 16), (1, 3, 777, 9)),
    "stream_d128": ((1, 130, 128), (1, 1000, 128), (1, 1000, 64)),
    "large_2048": ((1, 2048, 64), (1, 2048, 64), (1, 2048, 64)),
    "large_2048_Lk13": ((2048, 16), (13, 16), (13, 16)),
}


@pytest.mark.parametrize("weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_shapes(simd_mode, dtype, shape, weights, rng):
    qs, ks, vs = SHAPES[shape]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    q0, k0, v0 = q.copy(), k.copy(), v.copy()
    ref_o, ref_w = oracle(q, k, v, return_weights=True)
    res = sdpa(q, k, v, return_weights=weights)
    if weights:
        o, w = res
        assert w.dtype == dtype
        # the oracle's weights do not broadcast over value-only batch dims; ours do
        ref_w = np.broadcast_to(ref_w, ref_o.shape[:-1] + (ks[-2],))
        assert_close(w, ref_w, dtype)
        check_weights(w, True, dtype)
    else:
        o = res
    assert o.dtype == dtype
    assert o.shape == ref_o.shape
    assert_close(o, ref_o, dtype)
    for a, a0 in ((q, q0), (k, k0), (v, v0)):
        np.testing.assert_array_equal(a, a0)
    plan = fastattn.explain(q, k, v, return_weights=weights)
    assert plan.copies == ()
    # with SIMD every key length streams (packed products); without, only > 512 keys
    long_or_simd = ks[-2] > 512 or fastattn.simd_active()
    expected_path = "streaming" if (long_or_simd and qs[-2] > 4 and not weights) else "single_pass"
    assert plan.path == expected_path


# ----------------------------------------------------------------- layouts

LAYOUT_SHAPES = {
    "single": ((2, 3, 13, 8), (2, 3, 21, 8), (2, 3, 21, 6)),
    "stream": ((2, 2, 40, 16), (2, 2, 600, 16), (2, 2, 600, 12)),
}


@pytest.mark.parametrize("size", list(LAYOUT_SHAPES))
@pytest.mark.parametrize("layout", list(NO_COPY_LAYOUTS) + ["unaligned", "mixed"])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_layouts(simd_mode, dtype, layout, size, rng, tmp_path):
    qs, ks, vs = LAYOUT_SHAPES[size]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    if layout == "mixed":
        lq, lk, lv = make_layout(q, "strided"), make_layout(k, "transposed"), make_layout(v, "memmap", tmp_path, "v")
    else:
        lq, lk, lv = (make_layout(a, layout, tmp_path, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    ref = oracle(q, k, v, is_causal=True)
    got = sdpa(lq, lk, lv, is_causal=True)
    assert_close(got, ref, dtype)
    for a, a0 in ((lq, q), (lk, k), (lv, v)):
        np.testing.assert_array_equal(a, a0)
    if layout != "unaligned":  # unaligned inputs: see test_contract.test_unaligned_inputs_copied
        assert fastattn.explain(lq, lk, lv, is_causal=True).copies == ()


@pytest.mark.parametrize("Lk", [21, 600])
@pytest.mark.parametrize("layout", ["strided", "padded", "transposed", "flipped_batch", "readonly",
                                    "memmap", "fortran", "reversed_rows", "unaligned"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_mask_layouts(simd_mode, layout, kind, Lk, rng, tmp_path):
    B, H, Lq = 2, 3, 13
    q, k, v = randn(rng, (B, H, Lq, 8)), randn(rng, (B, H, Lk, 8)), randn(rng, (B, H, Lk, 5))
    if kind == "bool":
        m = rng.random((B, H, Lq, Lk)) < 0.7
    else:
        m = randn(rng, (B, H, Lq, Lk))
    if layout == "fortran":
        lm = np.asfortranarray(m)
    elif layout == "reversed_rows":
        lm = np.ascontiguousarray(m[..., ::-1, :])[..., ::-1, :]
    else:
        lm = make_layout(m, layout, tmp_path, "m")
    np.testing.assert_array_equal(lm, m)
    assert_close(sdpa(q, k, v, lm), oracle(q, k, v, m), np.float64)
    np.testing.assert_array_equal(lm, m)


# ------------------------------------------------------------------- masks

# (B, H, Lq, Lk, d, dv)
MASK_SIZES = {
    "square": (2, 3, 16, 16, 8, 8),
    "q_gt_k": (2, 3, 21, 13, 8, 5),
    "q_lt_k": (2, 3, 13, 21, 8, 5),
    "stream": (2, 2, 70, 700, 16, 8),
    "stream_q_gt_k": (1, 1, 600, 520, 8, 8),
}


def _pad_mask(rng, B, Lq, Lk, lengths, as_float=False):
    m = np.arange(Lk)[None, :] < np.asarray(lengths)[:, None]  # True = real token
    m = m.reshape(B, 1, 1, Lk)
    if as_float:
        return np.where(m, 0.0, -np.inf)
    return m


def make_mask(kind, rng, B, H, Lq, Lk):
    """-> (attn_mask, is_causal, causal_alignment)"""
    if kind == "none":
        return None, False, "top_left"
    if kind == "bool":
        return rng.random((Lq, Lk)) < 0.7, False, "top_left"
    if kind == "bool_batched":
        return rng.random((B, H, Lq, Lk)) < 0.5, False, "top_left"
    if kind == "float":
        return rng.standard_normal((Lq, Lk)), False, "top_left"
    if kind == "float_neginf":
        m = rng.standard_normal((B, 1, Lq, Lk))
        m[rng.random(m.shape) < 0.3] = -np.inf
        return m, False, "top_left"
    if kind == "causal_tl":
        return None, True, "top_left"
    if kind == "causal_br":
        return None, True, "bottom_right"
    if kind == "padding":
        return _pad_mask(rng, B, Lq, Lk, [Lk, max(1, Lk // 3)][:B]), False, "top_left"
    if kind == "padding_zero_len":  # a batch item with no real key: all its rows zero
        return _pad_mask(rng, B, Lq, Lk, [0, Lk - 1][:B]), False, "top_left"
    if kind == "padding_float":
        return _pad_mask(rng, B, Lq, Lk, [max(1, Lk // 2), Lk][:B], as_float=True), False, "top_left"
    if kind == "late_keys":  # the first key tiles are fully masked
        m = np.zeros((1, Lk), bool)
        m[:, (2 * Lk) // 3:] = True
        return m, False, "top_left"
    if kind == "key_mask_1d":
        return rng.random(Lk) < 0.6, False, "top_left"
    if kind == "query_mask_col":  # (Lq, 1): some queries may attend to nothing
        return (np.arange(Lq) % 3 != 1)[:, None], False, "top_left"
    if kind == "full_row_bool":
        m = rng.random((Lq, Lk)) < 0.7
        m[0] = False
        m[-1] = False
        m[Lq // 2] = False
        return m, False, "top_left"
    if kind == "full_row_float":
        m = rng.standard_normal((B, H, Lq, Lk))
        m[:, :, 1] = -np.inf
        m[0, 0, -1] = -np.inf
        return m, False, "top_left"
    if kind == "all_masked":
        return np.zeros((Lq, Lk), bool), False, "top_left"
    if kind == "causal_tl_bool":
        return rng.random((B, 1, Lq, Lk)) < 0.7, True, "top_left"
    if kind == "causal_br_float":
        return rng.standard_normal((Lq, Lk)), True, "bottom_right"
    if kind == "causal_br_padding":
        return _pad_mask(rng, B, Lq, Lk, [Lk, max(1, Lk // 2)][:B]), True, "bottom_right"
    if kind == "extra_batch_dims":  # the mask adds a leading dim to the output
        return rng.random((3, 1, 1, Lq, Lk)) < 0.7, False, "top_left"
    raise ValueError(kind)


MASK_KINDS = [
    "none", "bool", "bool_batched", "float", "float_neginf", "causal_tl", "causal_br",
    "padding", "padding_zero_len", "padding_float", "late_keys", "key_mask_1d",
    "query_mask_col", "full_row_bool", "full_row_float", "all_masked",
    "causal_tl_bool", "causal_br_float", "causal_br_padding", "extra_batch_dims",
]


@pytest.mark.parametrize("weights", [False, True], ids=["out", "weights"])
@pytest.mark.parametrize("size", list(MASK_SIZES))
@pytest.mark.parametrize("kind", MASK_KINDS)
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_masks(simd_mode, dtype, kind, size, weights, rng):
    B, H, Lq, Lk, d, dv = MASK_SIZES[size]
    q, k, v = randn(rng, (B, H, Lq, d), dtype), randn(rng, (B, H, Lk, d), dtype), randn(rng, (B, H, Lk, dv), dtype)
    mask, causal, align = make_mask(kind, rng, B, H, Lq, Lk)
    copies = [a.copy() for a in (q, k, v)] + ([] if mask is None else [mask.copy()])

    ref_o, ref_w = oracle(q, k, v, mask, causal, causal_alignment=align, return_weights=True)
    res = sdpa(q, k, v, mask, causal, causal_alignment=align, return_weights=weights)
    o, w = res if weights else (res, None)

    assert o.dtype == dtype and o.shape == ref_o.shape
    assert_close(o, ref_o, dtype)
    allowed = allowed_matrix(Lq, Lk, mask, causal, align)
    allowed = np.broadcast_to(allowed, ref_w.shape)
    fully = ~allowed.any(axis=-1)
    assert np.all(o[fully] == 0.0), "fully masked rows must be exactly zero"
    if weights:
        assert w.dtype == dtype and w.shape == ref_w.shape
        assert_close(w, ref_w, dtype)
        check_weights(w, allowed, dtype)
        assert np.all(w[fully] == 0.0)
    for a, a0 in zip([q, k, v] + ([] if mask is None else [mask]), copies):
        np.testing.assert_array_equal(a, a0)

    plan = fastattn.explain(q, k, v, mask, causal, causal_alignment=align, return_weights=weights)
    assert plan.causal == (align if causal else None)
    assert plan.mask == {None: "none", True: "bool", False: "additive"}[
        None if mask is None else mask.dtype == np.bool_]


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (1, 9), (9, 1), (5, 9), (9, 5), (64, 65), (65, 64),
                                   (3, 1000), (1000, 520), (130, 777)])
@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_causal_alignment(simd_mode, dtype, align, Lq, Lk, rng):
    q, k, v = randn(rng, (2, Lq, 8), dtype), randn(rng, (2, Lk, 8), dtype), randn(rng, (2, Lk, 4), dtype)
    ref_o, ref_w = oracle(q, k, v, is_causal=True, causal_alignment=align, return_weights=True)
    o = sdpa(q, k, v, is_causal=True, causal_alignment=align)
    assert_close(o, ref_o, dtype)
    o2, w = sdpa(q, k, v, is_causal=True, causal_alignment=align, return_weights=True)
    assert_close(o2, ref_o, dtype)
    assert_close(w, ref_w, dtype)
    allowed = allowed_matrix(Lq, Lk, None, True, align)
    check_weights(w, allowed, dtype)
    # explicit mask equivalent
    o3 = sdpa(q, k, v, allowed)
    assert_close(o3, ref_o, dtype)


@pytest.mark.parametrize("scale", [None, 0.0, 1.0, 0.125, -0.7, 3, np.float32(0.5)])
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_scale(simd_mode, dtype, scale, rng):
    q, k, v = randn(rng, (2, 9, 8), dtype), randn(rng, (2, 600, 8), dtype), randn(rng, (2, 600, 3), dtype)
    ref = oracle(q, k, v, scale=None if scale is None else float(scale))
    assert_close(sdpa(q, k, v, scale=scale), ref, dtype)
    assert_close(sdpa(q[:, :, :], k[:, :50], v[:, :50], scale=scale),
                 oracle(q, k[:, :50], v[:, :50], scale=None if scale is None else float(scale)), dtype)
    if scale is None:  # default is 1/sqrt(d)
        assert_close(sdpa(q, k, v, scale=1 / np.sqrt(8)), ref, dtype)


def test_large_values_softmax_stable(simd_mode, rng):
    """Scores of size ~1e3 must not overflow (max subtraction), both paths."""
    q = randn(rng, (2, 5, 4), scale=30.0)
    k = randn(rng, (2, 900, 4), scale=30.0)
    v = randn(rng, (2, 900, 3))
    for kk, vv in ((k, v), (k[:, :100], v[:, :100])):
        ref = oracle(q, kk, vv)
        assert np.all(np.isfinite(ref))
        assert_close(sdpa(q, kk, vv), ref, np.float64)
        assert_close(sdpa(q.astype(np.float32), kk.astype(np.float32), vv.astype(np.float32)),
                     oracle(q.astype(np.float32), kk.astype(np.float32), vv.astype(np.float32)),
                     np.float32)


def test_streaming_rescale_order(simd_mode):
    """The running max grows tile after tile: every later tile rescales the accumulator."""
    Lk = 1300
    k = np.zeros((Lk, 2))
    k[:, 0] = np.linspace(0.0, 40.0, Lk)  # scores increase along the keys
    q = np.array([[1.0, 0.0], [0.5, 0.0], [-1.0, 0.0], [0.25, 0.0], [2.0, 0.0], [0.0, 0.0]])
    v = np.stack([np.arange(Lk, dtype=float), np.ones(Lk)], axis=1)
    for dt in FLOATS:
        args = [a.astype(dt) for a in (q, k, v)]
        assert fastattn.explain(*args).path == "streaming"
        assert_close(sdpa(*args), oracle(*args), dt)
