"""SIMD dispatch switches: FASTATTN_DISABLE_SIMD at import, set_simd_disabled at run time."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import _kernels
from support import SIMD_CAPABLE, _restore_simd, assert_close, oracle, randn, run_child


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
