"""SIMD dispatch switches: FASTATTN_DISABLE_SIMD and FASTATTN_SIMD at import,
set_simd_disabled and set_simd_max_level at run time; the AVX2 and AVX-512 tables agree."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _kernels
from support import SIMD_CAPABLE, SIMD_TOP_ISA, _restore_simd, assert_close, oracle, randn, run_child


def _child_simd_active(value):
    code = ("import fastattn, numpy as np; "
            "q = np.random.default_rng(0).standard_normal((3, 700, 8)); "
            "o = fastattn.scaled_dot_product_attention(q, q, q); "
            "print(fastattn.simd_active(), float(o.sum()).hex())")
    proc = run_child(code, env_update={} if value is None else {"FASTATTN_DISABLE_SIMD": value},
                     env_remove=("FASTATTN_DISABLE_SIMD",), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.split()
    return out[0] == "True", float.fromhex(out[1])


def test_env_var_disables_simd():
    active_default, s_default = _child_simd_active(None)
    assert active_default == SIMD_CAPABLE
    for v in ("1", "yes", " 1 "):
        active, s = _child_simd_active(v)
        assert active is False, v
        np.testing.assert_allclose(s, s_default, rtol=1e-12)
    for v in ("", "0", " 0"):
        assert _child_simd_active(v)[0] == SIMD_CAPABLE, repr(v)


def test_runtime_toggle():
    try:
        _kernels.set_simd_disabled(True)
        assert fastattn.simd_active() is False
        _kernels.set_simd_disabled(False)
        assert fastattn.simd_active() is SIMD_CAPABLE
        assert _kernels.simd_compiled() in (True, False)
        if SIMD_CAPABLE:
            assert _kernels.simd_compiled()
    finally:
        _restore_simd()


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_simd_and_scalar_agree(dtype, rng):
    q, k, v = randn(rng, (2, 70, 16), dtype), randn(rng, (2, 900, 16), dtype), randn(rng, (2, 900, 8), dtype)
    m = rng.random((70, 900)) < 0.8
    res = {}
    try:
        for mode in (False, True):
            _kernels.set_simd_disabled(mode)
            res[mode] = (fastattn.scaled_dot_product_attention(q, k, v, m, True),
                         fastattn.scaled_dot_product_attention(q, k, v, m, True, return_weights=True))
    finally:
        _restore_simd()
    ref_o, ref_w = oracle(q, k, v, m, True, return_weights=True)
    for mode in res:
        assert_close(res[mode][0], ref_o, dtype)
        assert_close(res[mode][1][0], ref_o, dtype)
        assert_close(res[mode][1][1], ref_w, dtype)


def _child_isa(env):
    code = ("import fastattn, numpy as np; "
            "q = np.random.default_rng(0).standard_normal((2, 300, 64)).astype(np.float32); "
            "o = fastattn.scaled_dot_product_attention(q, q, q, is_causal=True); "
            "print(fastattn.simd_isa(), float(o.astype(np.float64).sum()).hex())")
    proc = run_child(code, env_update=env, env_remove=("FASTATTN_DISABLE_SIMD", "FASTATTN_SIMD"),
                     timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    isa, s = proc.stdout.split()
    return isa, float.fromhex(s), proc.stderr


def test_env_var_caps_the_isa():
    isa, s, _ = _child_isa({})
    assert isa == str(SIMD_TOP_ISA) and (isa != "None") == SIMD_CAPABLE
    isa2, s2, _ = _child_isa({"FASTATTN_SIMD": "avx2"})
    assert isa2 == ("avx2" if SIMD_CAPABLE else "None")
    assert s2 == s   # the streaming kernel gives the same bits on both tables
    isa3, _, err = _child_isa({"FASTATTN_SIMD": "sse9"})
    assert isa3 == isa and "FASTATTN_SIMD: expected 'avx2' or 'avx512', got 'sse9'" in err
    assert _child_isa({"FASTATTN_SIMD": "avx2", "FASTATTN_DISABLE_SIMD": "1"})[0] == "None"


def test_isa_levels():
    try:
        top = SIMD_TOP_ISA
        _kernels.set_simd_disabled(False)
        _kernels.set_simd_max_level(1)
        assert fastattn.simd_isa() == (None if top is None else "avx2")
        _kernels.set_simd_max_level(2)
        assert fastattn.simd_isa() == top
        _kernels.set_simd_disabled(True)
        assert fastattn.simd_isa() is None and _kernels.simd_level() == 0
    finally:
        _restore_simd()


# The AVX2 and AVX-512 tables: the packed products are FMA chains over the
# inner dimension in the same order, the exp rows and the backward's
# elementwise steps round alike and sum in the same order: the streaming
# forward, its lse and the backward are the same bits on both.
@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [(2, 300, 700, 64, 48), (1, 37, 900, 24, 40), (3, 520, 530, 16, 80)],
                         ids=["300x700", "37x900", "520x530"])
def test_avx2_and_avx512_tables_agree_bitwise(dtype, causal, shape, rng):
    B, Lq, Lk, d, dv = shape
    q, k = randn(rng, (B, Lq, d), dtype), randn(rng, (B, Lk, d), dtype)
    v, g = randn(rng, (B, Lk, dv), dtype), randn(rng, (B, Lq, dv), dtype)
    m = rng.random((Lq, Lk)) < 0.9
    res = {}
    try:
        for level in (1, 2):
            _kernels.set_simd_max_level(level)
            o, lse = fastattn.scaled_dot_product_attention(q, k, v, m, causal, return_lse=True)
            res[level] = (o, lse) + tuple(fastattn.functional.sdpa_backward(g, q, k, v, o, lse, m, causal))
    finally:
        _restore_simd()
    for a, b in zip(res[1][:5], res[2][:5]):
        np.testing.assert_array_equal(a, b)
    ref = oracle(q, k, v, m, causal)
    assert_close(res[2][0], ref, dtype)


def test_avx2_and_avx512_projections_agree_bitwise(rng):
    """fa_proj.c's packed products (linear, the RNN recurrences and their
    backward): two panels a time in 512-bit vectors, the same floats."""
    F = fastattn.functional
    x = randn(rng, (4, 37, 200), np.float32)
    w, b = randn(rng, (216, 200), np.float32, 0.1), randn(rng, (216,), np.float32)
    whh, bhh = randn(rng, (216, 72), np.float32, 0.1), randn(rng, (216,), np.float32)
    h0 = randn(rng, (4, 72), np.float32)
    g = randn(rng, (4, 37, 72), np.float32)
    res = {}
    try:
        for level in (1, 2):
            _kernels.set_simd_max_level(level)
            xw = F.linear(x, w, b)
            few = F.linear(x[:, :3], w[:50], b[:50])   # a partial last panel pair
            out, *_, gates = F.rnn_scan(xw, whh, bhh, h0, cell="gru", return_gates=True)
            grads = F.rnn_scan_backward(g, None, xw, whh, bhh, h0, out, cell="gru", gates=gates)
            res[level] = [xw, few, out] + [a for a in grads if a is not None]
    finally:
        _restore_simd()
    for a, b_ in zip(res[1], res[2]):
        np.testing.assert_array_equal(a, b_)
    ref = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert_close(res[2][0], ref, np.float32)


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 9, 10, 11, 13, 15, 21, 27, 97, 101])
def test_avx2_and_avx512_projection_row_blocks_agree_bitwise(rows, rng):
    """The 512-bit path takes row blocks of up to 8 where the 256-bit one takes
    6; the rows the latter leaves in 1-3-row blocks (another summation order)
    must be blocked alike: row counts around each case of both policies, on
    the packed kernel (prepacked weights, one thread: one block of rows)."""
    from fastattn import _proj
    x = randn(rng, (1, rows, 300), np.float32)
    w, b = randn(rng, (100, 300), np.float32, 0.1), randn(rng, (100,), np.float32)
    wp = np.empty(_proj.packed_size(100, 300), np.float32)
    _proj.pack_f32(w, wp)
    res = {}
    try:
        for level in (1, 2):
            _kernels.set_simd_max_level(level)
            assert _proj.packed_kernel_active()
            res[level] = np.empty((1, rows, 100), np.float32)
            _proj.linear(x, w, b, res[level], 1, wp)
    finally:
        _restore_simd()
    np.testing.assert_array_equal(res[1], res[2])
    assert_close(res[2][0], x[0].astype(np.float64) @ w.T.astype(np.float64) + b, np.float32)


@pytest.mark.parametrize("masked", [False, True], ids=["plain", "masked"])
def test_avx2_and_avx512_exp_rows_agree_bitwise(masked):
    """The 512-bit exp scales by 2^n in one vscalefps, the 256-bit one by an
    exact multiply or two steps for subnormal results: every float whose exp
    is subnormal ([-104, -87.3]), a spread over [-200, 0], zeros and -inf
    must give the same bits and the same row sums."""
    sub = np.arange(np.float32(-87.3).view(np.uint32), np.float32(-104.0).view(np.uint32) + 1,
                    dtype=np.uint32).view(np.float32)
    spread = -np.random.default_rng(5).random(1 << 20, dtype=np.float32) * 200
    specials = np.array([0.0, -0.0, -np.inf, -110.0, -126.0, -149.0, -150.0, -1e-30], np.float32)
    x = np.concatenate([sub, spread, specials])
    if not masked:
        x = x[np.isfinite(x)]
    res = {}
    try:
        for level in (1, 2):
            _kernels.set_simd_max_level(level)
            y = x.copy()
            total = _kernels.expsub(y, 0.0, masked)
            res[level] = (y, total)
    finally:
        _restore_simd()
    np.testing.assert_array_equal(res[1][0].view(np.uint32), res[2][0].view(np.uint32))
    assert res[1][1] == res[2][1]
    np.testing.assert_allclose(res[2][0], np.exp(x.astype(np.float64)), rtol=2e-7, atol=1e-44)


@pytest.mark.parametrize("d_a", [16, 40, 43, 128])
def test_avx2_and_avx512_additive_agree_bitwise(d_a, rng):
    """The fused additive kernel's float rows: on AVX-512 the tanh of 16
    features at a time, its halves summed as the 256-bit loop sums them; the
    forward, its lse and the backward (which recomputes the tanh rows) are the
    same bits on both (d_a: whole 16s, a trailing 8, a scalar tail)."""
    F = fastattn.functional
    B, Tq, Tk, d = 2, 37, 29, 24
    q, k, v = (randn(rng, (B, t, d), np.float32) for t in (Tq, Tk, Tk))
    g = randn(rng, (B, Tq, d), np.float32)
    p = fastattn.get_similarity("additive").init_params(d, d, d_a=d_a, rng=3, dtype=np.float32)
    res = {}
    try:
        for level in (1, 2):
            _kernels.set_simd_max_level(level)
            out, lse = fastattn.attention(q, k, v, "additive", params=p, return_lse=True)
            dq, dk, dv, dp = F.attention_backward(g, q, k, v, "additive", params=p, out=out, lse=lse)
            res[level] = [out, lse, dq, dk, dv] + [dp[n] for n in sorted(dp)]
    finally:
        _restore_simd()
    for a, b in zip(res[1], res[2]):
        np.testing.assert_array_equal(a, b)
