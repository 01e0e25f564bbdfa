"""Agreement with torch.nn.functional.scaled_dot_product_attention on shared arguments."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fastattn  # noqa: E402
from support import assert_close, oracle, randn  # noqa: E402

sdpa = fastattn.scaled_dot_product_attention
F = torch.nn.functional

SHAPES = {
    "3d": ((3, 13, 8), (3, 21, 8), (3, 21, 6)),
    "3d_Lq_gt_Lk": ((2, 33, 16), (2, 7, 16), (2, 7, 16)),
    "4d": ((2, 3, 17, 16), (2, 3, 17, 16), (2, 3, 17, 8)),
    "4d_stream": ((1, 2, 40, 32), (1, 2, 700, 32), (1, 2, 700, 32)),
    "4d_Lq_lt_Lk": ((2, 2, 5, 8), (2, 2, 11, 8), (2, 2, 11, 8)),
}


def _mask(kind, rng, Lq, Lk, dtype):
    if kind == "bool":
        m = rng.random((Lq, Lk)) < 0.6
        m[:, 0] = True  # no fully masked rows here (see test_fully_masked_rows)
        return m
    if kind == "float":
        return randn(rng, (Lq, Lk), dtype)
    if kind == "float_neginf":
        m = randn(rng, (Lq, Lk), dtype)
        m[rng.random((Lq, Lk)) < 0.3] = -np.inf
        m[:, -1] = 0.0
        return m
    return None


@pytest.mark.parametrize("scale", [None, 0.3])
@pytest.mark.parametrize("kind", ["none", "bool", "float", "float_neginf", "causal"])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_matches_torch(simd_mode, dtype, shape, kind, scale, rng):
    qs, ks, vs = SHAPES[shape]
    q, k, v = randn(rng, qs, dtype), randn(rng, ks, dtype), randn(rng, vs, dtype)
    causal = kind == "causal"
    m = _mask(kind, rng, qs[-2], ks[-2], dtype)
    ours = sdpa(q, k, v, m, causal, scale)
    tt = F.scaled_dot_product_attention(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
        attn_mask=None if m is None else torch.from_numpy(m), is_causal=causal, scale=scale,
    ).numpy()
    ref = oracle(q, k, v, m, causal, scale)
    assert ours.dtype == tt.dtype == dtype
    assert_close(ours, ref, dtype)
    assert_close(tt, ref, dtype)  # torch itself is within our table of the oracle
    assert_close(ours, tt.astype(np.float64), dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_causal_top_left_is_torch_rule(dtype, rng):
    """torch's is_causal is top-left aligned; ours by default, explicitly and vs a tril mask."""
    q, k, v = randn(rng, (2, 9, 8), dtype), randn(rng, (2, 4, 8), dtype), randn(rng, (2, 4, 8), dtype)
    tt = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        is_causal=True).numpy()
    tril = torch.ones(9, 4, dtype=torch.bool).tril()
    tm = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        attn_mask=tril).numpy()
    np.testing.assert_allclose(tt, tm, rtol=1e-6, atol=1e-6)
    assert_close(sdpa(q, k, v, is_causal=True), tt.astype(np.float64), dtype)
    assert_close(sdpa(q, k, v, is_causal=True, causal_alignment="top_left"), tt.astype(np.float64), dtype)
    # bottom-right is not torch's is_causal but equals torch with the shifted tril mask
    br = torch.ones(9, 4, dtype=torch.bool).tril(diagonal=4 - 9)
    tb = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        attn_mask=br).numpy()
    ours = sdpa(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert_close(ours, oracle(q, k, v, is_causal=True, causal_alignment="bottom_right"), dtype)
    ok = br.numpy().any(axis=-1)  # torch 2.13 gives zeros on fully masked rows too
    assert_close(ours[:, ok], tb[:, ok].astype(np.float64), dtype)
    assert np.all(ours[:, ~ok] == 0)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_fully_masked_rows(dtype, rng):
    q, k, v = randn(rng, (2, 3, 6, 8), dtype), randn(rng, (2, 3, 5, 8), dtype), randn(rng, (2, 3, 5, 4), dtype)
    m = rng.random((6, 5)) < 0.6
    m[2] = False
    ours = sdpa(q, k, v, m)
    ref = oracle(q, k, v, m)
    assert np.all(ours[..., 2, :] == 0)
    assert_close(ours, ref, dtype)
    tt = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        attn_mask=torch.from_numpy(m)).numpy()
    rows = np.ones(6, bool)
    if not np.all(tt[..., 2, :] == 0):  # pragma: no cover - older torch gives NaN here
        rows[2] = False
    assert_close(ours[..., rows, :], tt[..., rows, :].astype(np.float64), dtype)


def test_padding_mask_semantics_match_torch(rng):
    """Our bool key mask (True = real token) is torch's attn_mask, not MHA's key_padding_mask."""
    B, H, L, d = 2, 2, 7, 8
    q, k, v = (randn(rng, (B, H, L, d)) for _ in range(3))
    real = np.arange(L) < np.array([7, 3])[:, None]
    m = real[:, None, None, :]
    tt = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                                        attn_mask=torch.from_numpy(m)).numpy()
    assert_close(sdpa(q, k, v, m), tt, np.float64)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(1, 2, 2048, 64), (1, 4, 512, 64), (2, 8, 128, 64)],
                         ids=lambda s: "x".join(map(str, s)))
def test_float32_error_not_above_torch(simd_mode, shape, causal):
    """Issue 3's accuracy rule: float32 error against the float64 oracle no worse
    than torch's on the same inputs -- the rms error within 10 %, the largest
    within 25 % (one output element; the two differ by a float32 ulp or so).
    Long key lengths are where summation order shows: one sequential sum over
    all 2048 keys per output element had 1.6x torch's rms error; the portable
    fallback's softmax sums (SIMD off) in one float accumulator a row had 1.35x
    (rms) and 1.58x (max) at 512 keys -- they are summed in double now."""
    rng = np.random.default_rng(7)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for _ in range(3))
    ref = oracle(q, k, v, is_causal=causal)
    ours = sdpa(q, k, v, is_causal=causal)
    theirs = F.scaled_dot_product_attention(torch.from_numpy(q), torch.from_numpy(k),
                                            torch.from_numpy(v), is_causal=causal).numpy()
    e_ours, e_theirs = ours - ref, theirs - ref
    rms = np.sqrt(np.mean(e_ours ** 2)) / np.sqrt(np.mean(e_theirs ** 2))
    worst = np.abs(e_ours).max() / np.abs(e_theirs).max()
    assert rms <= 1.10, f"rms error {rms:.3f}x torch's"
    assert worst <= 1.25, f"max error {worst:.3f}x torch's"
