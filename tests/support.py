"""Helpers shared by the hypothesis property files (tests/test_properties_*.py).

A *case* ``c`` is the dict a file's ``problems`` strategy draws: float64 arrays
of float32-representable values (``q``, ``k``, ``v``; ``v is k`` when the value
input is the key input), a mask ``m`` (None, boolean, or float with -inf),
``causal`` / ``align``, ``Lq`` / ``Lk``, ``dtype``, the case's ``rng``, and for
self-attention ``self=True`` (then ``q``, ``k`` and ``v`` are one array).  The
checks take the file's ``run(c, weights=..., dtype=...)`` (and ``oracle(c)``,
whose first result is the output) as arguments.
"""
from __future__ import annotations

import numpy as np
from hypothesis import strategies as st

from fastattn.similarity import ParamSpec, Similarity

from conftest import assert_close, make_layout, tol

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)


class NegL1(Similarity):
    """A NumPy plugin: ``-gamma * sum_c |q_c - k_c|`` (runs on the tiled path)."""

    name = "props_neg_l1"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0)}
    same_dims = True

    def score(self, query, key, params):
        diff = np.abs(query[..., :, None, :] - key[..., None, :, :])
        return -params["gamma"] * np.sum(diff, axis=-1)


def f32(a):
    """float32-representable float64 values (so every dtype sees the same numbers)."""
    return np.asarray(a, np.float64).astype(np.float32).astype(np.float64)


# --------------------------------------------------------------------------
# Inputs

LAYOUTS_2D = ("C", "strided", "padded", "readonly", "fortran")
LAYOUTS_ND = LAYOUTS_2D + ("transposed", "flipped_batch")


def lay(a, layout, dtype):
    """``a`` (float64 values) in ``dtype`` with the given memory layout."""
    a = np.asarray(a).astype(dtype)
    if layout == "fortran":
        return np.asfortranarray(a)
    if layout in ("transposed", "flipped_batch") and a.ndim < 3:
        layout = "C"
    return make_layout(a, layout)


def random_mask(draw, rng, kind, shape, fractions):
    """An attn_mask of ``shape``: ``kind`` "bool" is True with a probability drawn
    from ``fractions``; "float" is standard normal with about a quarter -inf."""
    if kind == "bool":
        return rng.random(shape) < draw(st.sampled_from(fractions))
    m = f32(rng.standard_normal(shape))
    m[rng.random(shape) < 0.25] = -np.inf
    return m


def score_bias(m, shape):
    """The mask ``m`` (None, boolean or float) as a float mask of ``shape``."""
    if m is None:
        return np.zeros(shape)
    if m.dtype == np.bool_:
        return np.where(np.broadcast_to(m, shape), 0.0, -np.inf)
    return np.broadcast_to(m, shape).copy()


def changed(rng, a, index):
    """A copy of ``a`` with new values (|x| ~ 3) at ``index``."""
    a = a.copy()
    a[index] = f32(3.0 * rng.standard_normal(a[index].shape))
    return a


def with_kv(c, k, v):
    """The case with new key and value inputs (value follows the key when shared;
    self-attention: the query too)."""
    if c.get("self"):
        return dict(c, q=k, k=k, v=k)
    return dict(c, k=k, v=k if c["v"] is c["k"] else v)


# --------------------------------------------------------------------------
# Comparisons and checks

def assert_agree(a, b, dtype, factor=2.0, atol_scale=1.0):
    """Two results that are each within the tolerance of the exact one."""
    rtol, atol = tol(dtype)
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = max(1.0, float(np.max(np.abs(b), initial=0.0)))
    np.testing.assert_allclose(a, b, rtol=factor * rtol, atol=factor * atol * atol_scale * scale)


def assert_all_close(got, ref, dtype):
    """Results (output, weights, ...) all of ``dtype``, each within the
    tolerance of its float64 reference."""
    assert all(g.dtype == dtype for g in got), [g.dtype for g in got]
    for g, r in zip(got, ref, strict=True):
        assert_close(g, r, dtype)


def check_row_constant_invariance(run, c, shape, c_max):
    """The case's mask as a float mask of ``shape``, then plus a per-row constant
    in [-c_max, c_max]: the same output and weights.  Returns both weights."""
    base = score_bias(c["m"], shape)
    shift = f32(c["rng"].uniform(-c_max, c_max, shape[:-1] + (1,)))
    a, wa = run(dict(c, m=base), weights=True)
    b, wb = run(dict(c, m=base + shift), weights=True)
    # |shift| costs float32 rounding of the shifted scores (eps * c_max each)
    s = max(1.0, c_max / 8.0) if c["dtype"] == F32 else 1.0
    assert_agree(b, a, c["dtype"], atol_scale=s)
    assert_agree(wb, wa, c["dtype"], atol_scale=s)
    return wa, wb


def check_kv_permutation(run, c):
    """Keys and values permuted at random, and the masks' key axes with them
    (self-attention: also the mask's query axis): the same output, the weights'
    columns permuted; for self-attention the output and weight rows permuted too."""
    perm = c["rng"].permutation(c["Lk"])
    m = c["m"]
    if m is not None and m.shape[-1] == c["Lk"]:
        m = m[..., perm]
    if c.get("self") and m is not None and m.shape[-2] == c["Lq"]:
        m = m[..., perm, :]
    c2 = dict(with_kv(c, c["k"][..., perm, :], c["v"][..., perm, :]), m=m)
    if c.get("km") is not None:
        c2["km"] = c["km"][..., perm]
    (a, wa), (b, wb) = run(c, weights=True), run(c2, weights=True)
    if c.get("self"):
        a, wa = a[..., perm, :], wa[..., perm, :]
    assert_agree(b, a, c["dtype"])
    assert_agree(wb, wa[..., perm], c["dtype"])


def check_rows_unchanged(run, oracle, c, c2, weights, rows, weights_rows=None):
    """``run`` on ``c`` and ``c2`` gives bit-for-bit the same ``out[rows]`` (and
    weights, each through ``weights_rows``, at ``rows``); ``c2`` agrees with the oracle."""
    a, b = run(c, weights=weights), run(c2, weights=weights)
    if weights:
        (a, wa), (b, wb) = a, b
        if weights_rows is not None:
            wa, wb = weights_rows(wa), weights_rows(wb)
        np.testing.assert_array_equal(wa[rows], wb[rows])
    np.testing.assert_array_equal(a[rows], b[rows])
    assert_close(b, oracle(c2)[0], c["dtype"])


def check_causal_rows(run, oracle, c, t, weights):
    """Rows whose causal limit is before key ``t`` are bit-for-bit unchanged when
    keys and values from ``t`` on change."""
    Lq, Lk = c["Lq"], c["Lk"]
    off = 0 if c["align"] == "top_left" else Lk - Lq
    n = min(Lq, max(0, t - off))  # rows r with r + off < t
    idx = (Ellipsis, slice(t, None), slice(None))
    c2 = with_kv(c, changed(c["rng"], c["k"], idx), changed(c["rng"], c["v"], idx))
    check_rows_unchanged(run, oracle, c, c2, weights, (Ellipsis, slice(None, n), slice(None)))


def check_padded_keys(run, oracle, c, weights, weights_rows=None):
    """Keys/values where key_mask (``c["km"]``, one more key made padding) is
    False: any values, the same result bit-for-bit (self-attention: for the
    rows whose query did not change)."""
    km = c["km"].copy()
    km[..., c["rng"].integers(0, c["Lk"])] = False
    c = dict(c, km=km)
    pad = ~km
    c2 = with_kv(c, changed(c["rng"], c["k"], pad), changed(c["rng"], c["v"], pad))
    rows = km if c["self"] else np.ones(km.shape[:-1] + (c["Lq"],), bool)
    check_rows_unchanged(run, oracle, c, c2, weights, rows, weights_rows)


def check_float32_and_float64_agree(run_in, factor=1.0):
    """``run_in(dtype)`` -> (output, weights) for float32 and float64: each keeps
    its dtype, and they agree within ``factor`` x the float32 tolerance."""
    o32, w32 = run_in(F32)
    o64, w64 = run_in(F64)
    assert o32.dtype == F32 and o64.dtype == F64
    assert_agree(o32, o64, F32, factor=factor)
    assert_agree(w32, w64, F32, factor=factor)
