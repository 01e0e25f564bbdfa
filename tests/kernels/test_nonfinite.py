"""NaN and infinity: propagate like the oracle, never crash, never poison other rows."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from support import assert_close, oracle, randn

sdpa = fastattn.scaled_dot_product_attention
FLOATS = [np.float32, np.float64]
SIZES = {"single": (13, 21), "stream": (70, 700)}  # (Lq, Lk)


def _inputs(rng, dtype, Lq, Lk, B=2, d=8, dv=5):
    return (randn(rng, (B, Lq, d), dtype), randn(rng, (B, Lk, d), dtype),
            randn(rng, (B, Lk, dv), dtype))


def _both(q, k, v, *a, **kw):
    o = sdpa(q, k, v, *a, **kw)
    o2, w = sdpa(q, k, v, *a, return_weights=True, **kw)
    return o, o2, w


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_nan_in_query_row(simd_mode, dtype, size, rng):
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    q[0, 3, 2] = np.nan
    q[1, -1, :] = np.nan
    ref_o, ref_w = oracle(q, k, v, return_weights=True)
    o, o2, w = _both(q, k, v)
    for out in (o, o2):
        assert np.all(np.isnan(out[0, 3])) and np.all(np.isnan(out[1, -1]))
        assert_close(out, ref_o, dtype)  # equal_nan: other rows equal the oracle
        assert np.isfinite(out[0, :3]).all() and np.isfinite(out[1, :-1]).all()
    assert np.all(np.isnan(w[0, 3])) and np.all(np.isnan(w[1, -1]))
    assert_close(w, ref_w, dtype)


@pytest.mark.parametrize("where", ["key", "key_first_tile", "key_last_tile"])
@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_nan_in_unmasked_key(simd_mode, dtype, size, where, rng):
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    j = {"key": Lk // 2, "key_first_tile": 0, "key_last_tile": Lk - 1}[where]
    k[1, j, 0] = np.nan
    ref = oracle(q, k, v)
    o, o2, w = _both(q, k, v)
    for out in (o, o2):
        assert np.all(np.isnan(out[1])), "every row attending to a NaN key is NaN"
        assert_close(out, ref, dtype)
        assert np.isfinite(out[0]).all()
    assert np.all(np.isnan(w[1]))


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_nan_in_masked_key_is_ignored(simd_mode, dtype, size, rng):
    """A NaN *score* of a masked key is replaced by -inf (bool mask, causal)."""
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    k[:, -1, 0] = np.nan
    m = np.ones((Lq, Lk), bool)
    m[:, -1] = False
    ref = oracle(q, k, v, m)
    assert np.isfinite(ref).all()
    o, o2, w = _both(q, k, v, m)
    assert_close(o, ref, dtype)
    assert_close(o2, ref, dtype)
    assert np.all(w[..., -1] == 0)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_nan_in_value(simd_mode, dtype, size, rng):
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    v[0, 5, 1] = np.nan
    ref = oracle(q, k, v)
    o, o2, _ = _both(q, k, v)
    for out in (o, o2):
        assert np.all(np.isnan(out[0, :, 1]))
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_nan_in_float_mask(simd_mode, dtype, size, rng):
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    m = randn(rng, (Lq, Lk), dtype)
    m[2, 7] = np.nan
    ref = oracle(q, k, v, m)
    o, o2, _ = _both(q, k, v, m)
    for out in (o, o2):
        assert np.all(np.isnan(out[:, 2]))
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_neg_inf_scores_act_as_mask(simd_mode, dtype, size, rng):
    """A key component of -inf against positive query components scores -inf: masked."""
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    q[..., 0] = np.abs(q[..., 0]) + 0.5
    k[:, 3, 0] = -np.inf
    k[:, -2, 0] = -np.inf
    ref = oracle(q, k, v)
    assert np.isfinite(ref).all()
    o, o2, w = _both(q, k, v)
    assert_close(o, ref, dtype)
    assert_close(o2, ref, dtype)
    assert np.all(w[:, :, 3] == 0) and np.all(w[:, :, -2] == 0)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_all_keys_neg_inf_row_gives_zeros(simd_mode, dtype, size, rng):
    """Every score of a row -inf (from the data, not a mask): the oracle gives zeros."""
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    k[..., 0] = np.abs(k[..., 0]) + 0.5
    q[0, 4, 0] = -np.inf
    ref = oracle(q, k, v)
    assert np.all(ref[0, 4] == 0)
    o, o2, w = _both(q, k, v)
    for out in (o, o2):
        assert np.all(out[0, 4] == 0)
        assert_close(out, ref, dtype)
    assert np.all(w[0, 4] == 0)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_pos_inf_score(simd_mode, dtype, size, rng):
    """+inf scores give NaN like the oracle (inf - inf), other rows untouched."""
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    m = np.zeros((Lq, Lk), dtype)
    m[1, Lk - 3] = np.inf
    m[3, :] = -np.inf  # fully masked by -inf: zeros
    ref = oracle(q, k, v, m)
    o, o2, w = _both(q, k, v, m)
    for out in (o, o2):
        assert_close(out, ref, dtype)
        assert np.all(out[:, 3] == 0)
    assert np.isfinite(o[:, 0]).all()


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_inf_in_value(simd_mode, dtype, size, rng):
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    v[0, 2, 0] = np.inf
    v[0, 3, 1] = -np.inf
    ref = oracle(q, k, v)
    o, o2, _ = _both(q, k, v)
    for out in (o, o2):
        assert_close(out, ref, dtype)
        assert np.all(out[0, :, 0] == np.inf) and np.all(out[0, :, 1] == -np.inf)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_huge_finite_inputs_do_not_crash(simd_mode, dtype, rng):
    big = np.finfo(dtype).max / 4
    q, k, v = _inputs(rng, dtype, 9, 600)
    q[0, 0] = big
    k[0, 0] = big
    with np.errstate(all="ignore"):
        ref = oracle(q, k, v)
    o = sdpa(q, k, v)
    assert o.shape == ref.shape
    assert_close(o[1], ref[1], dtype)


def _fully_masked_case(how, size, bad, rng):
    dtype = np.float64
    Lq, Lk = SIZES[size]
    if how == "causal_br":
        Lq = Lk + 70  # the first 70 query rows see no key (bottom-right alignment)
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    v[:, Lk // 2, 0] = bad
    kw = {}
    if how == "bool_row":
        m = np.ones((Lq, Lk), bool)
        m[:, Lk // 2] = False
        m[[0, 5, Lq - 1]] = False
        kw = dict(attn_mask=m)
        fully = ~m.any(-1)
    elif how == "float_row":
        m = np.zeros((Lq, Lk), dtype)
        m[:, Lk // 2] = -np.inf
        m[[0, 5, Lq - 1]] = -np.inf
        kw = dict(attn_mask=m)
        fully = np.all(m == -np.inf, -1)
    elif how == "causal_br":
        kw = dict(is_causal=True, causal_alignment="bottom_right")
        fully = np.arange(Lq) < Lq - Lk
        v[:, Lk // 2, 0] = 0.0
        v[:, -1, 0] = bad  # seen only by the last query row
        fully[-1] = False
    else:  # padding: batch item 1 has no real keys at all
        m = np.ones((2, 1, Lk), bool)
        m[1] = False
        m[0, 0, Lk // 2] = False
        kw = dict(attn_mask=m)
        fully = np.zeros((2, Lq), bool)
        fully[1] = True
    return q, k, v, kw, np.broadcast_to(fully, (2, Lq))


@pytest.mark.parametrize("how", ["bool_row", "float_row", "causal_br", "padding_item"])
def test_fully_masked_rows_zero_despite_nonfinite_values(how, rng):
    """'Fully masked rows give zeros, never NaN, on every path' -- also when the
    (masked-out) values hold NaN/inf, e.g. an uninitialised key/value cache."""
    problems = []
    for size in SIZES:
        for bad in (np.nan, np.inf):
            q, k, v, kw, fully = _fully_masked_case(how, size, bad, rng)
            for weights in (False, True):
                res = sdpa(q, k, v, return_weights=weights, **kw)
                o = res[0] if weights else res
                bad_rows = np.flatnonzero(np.any(o[fully] != 0, axis=-1))
                if bad_rows.size:
                    problems.append(
                        f"{size} path, v has {bad}, return_weights={weights}: {bad_rows.size} of "
                        f"{int(fully.sum())} fully masked rows not zero (e.g. {o[fully][bad_rows[0]][:2]})")
                if weights:
                    assert np.all(res[1][fully] == 0)
                # rows that can see only finite values match the oracle
                with np.errstate(invalid="ignore"):
                    ref = oracle(q, k, v, kw.get("attn_mask"), kw.get("is_causal", False),
                                 causal_alignment=kw.get("causal_alignment", "top_left"))
                fin = np.all(np.isfinite(ref), -1) & ~fully
                assert_close(o[fin], ref[fin], np.float64)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("size", list(SIZES))
@pytest.mark.parametrize("dtype", FLOATS, ids=["f32", "f64"])
def test_extreme_finite_float_mask(simd_mode, dtype, size, rng):
    """Float masks at finfo.min / finfo.max (the 'large negative' masks of
    Hugging Face models): a row masked with finfo.min everywhere has equal
    finite scores, so uniform weights, as in the oracle and in PyTorch -- not
    the zeros of a -inf row; finfo.max keys take all the weight, no NaN."""
    Lq, Lk = SIZES[size]
    q, k, v = _inputs(rng, dtype, Lq, Lk)
    fi = np.finfo(dtype)
    m = np.zeros((Lq, Lk), dtype)
    m[1, :] = fi.min                       # every key: uniform weights
    m[2, : Lk // 2] = fi.min               # half the keys
    m[3, :3] = fi.max                      # three keys win outright
    m[4, :] = fi.min / 2                   # finite after the base change too
    m[5, 1::2] = -np.inf                   # true -inf keeps meaning "masked"
    m[6, :] = -np.inf                      # every key masked: zeros
    ref_o, ref_w = oracle(q, k, v, attn_mask=m, return_weights=True)
    o, o2, w = _both(q, k, v, attn_mask=m)
    for out in (o, o2):
        assert np.isfinite(out).all()
        assert_close(out, ref_o, dtype)
        np.testing.assert_allclose(out[:, 1], v.astype(np.float64).mean(axis=1), rtol=1e-4, atol=1e-5)
        assert np.all(out[:, 6] == 0)
    assert_close(w, ref_w, dtype)
