"""Hypothesis properties of multi_head_attention (profile: see docs/testing.md)."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given
from hypothesis import strategies as st

import fastattn
from support import assert_close, prop_settings, tol
from test_multihead import make_params, packed, ref

mha = fastattn.multi_head_attention

# 40 examples under the ci profile (2 x its base), 25x that under long
SETTINGS = prop_settings(2, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    dh = draw(st.integers(1, 6))
    E = H * dh
    B = draw(st.integers(1, 3))
    Lq = draw(st.integers(1, 12))
    Lk = draw(st.integers(1, 12))
    kdim = draw(st.sampled_from([None, 3, 7]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    p = make_params(rng, E, H, Hkv=Hkv, kdim=kdim, vdim=kdim, dtype=dtype,
                    bias=draw(st.booleans()))
    q = rng.standard_normal((B, Lq, E)).astype(dtype)
    kv = rng.standard_normal((B, Lk, kdim or E)).astype(dtype)
    km = rng.random((B, Lk)) < draw(st.sampled_from([0.3, 0.8, 1.0]))
    return dict(q=q, kv=kv, p=p, H=H, Hkv=Hkv, km=km, causal=draw(st.booleans()), dtype=dtype,
                rng=rng, packed_ok=kdim is None)


@SETTINGS
@given(problems())
def test_matches_oracle_and_weights_are_distributions(pr):
    q, kv, p, dtype = pr["q"], pr["kv"], pr["p"], pr["dtype"]
    kw = dict(num_heads=pr["H"], num_kv_heads=pr["Hkv"], key_mask=pr["km"], is_causal=pr["causal"])
    weights = packed(p) if pr["packed_ok"] else p
    out, w = mha(q, kv, kv, return_weights=True, average_weights=False, **weights, **kw)
    r_out, r_w = ref(q, kv, kv, p, return_weights=True, average_weights=False, **kw)
    assert_close(out, r_out, dtype)
    assert_close(w, r_w, dtype)
    allowed = pr["km"][:, None, None, :]
    if pr["causal"]:
        Lq, Lk = q.shape[1], kv.shape[1]
        allowed = allowed & np.tri(Lq, Lk, dtype=bool)
    allowed = np.broadcast_to(allowed, w.shape)
    assert np.all(w[~allowed] == 0)
    sums = w.sum(-1)
    any_ok = allowed.any(-1)
    np.testing.assert_allclose(sums[any_ok], 1.0, atol=tol(dtype)[1])
    assert np.all(sums[~any_ok] == 0)


@SETTINGS
@given(problems())
def test_key_permutation_invariance(pr):
    """Permuting keys (values and key mask with them) does not change the output (non-causal)."""
    q, kv, p, dtype = pr["q"], pr["kv"], pr["p"], pr["dtype"]
    perm = pr["rng"].permutation(kv.shape[1])
    kw = dict(num_heads=pr["H"], num_kv_heads=pr["Hkv"])
    weights = packed(p) if pr["packed_ok"] else p
    a = mha(q, kv, kv, key_mask=pr["km"], **weights, **kw)
    b = mha(q, kv[:, perm], kv[:, perm], key_mask=pr["km"][:, perm], **weights, **kw)
    assert_close(a, b.astype(np.float64), dtype)
