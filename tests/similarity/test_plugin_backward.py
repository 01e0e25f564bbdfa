"""The compiled-plugin ABI's backward entry (version 2): a plugin's C
score_backward under attention_backward, version 1 plugins (forward only),
the capsule / ABI checks, a plugin's error code, packed-parameter gradients
and their unpacking, zero features.  The numbers of the self-test plugin are
checked against the float64 oracle and torch in test_attention_backward
(its "compiled_plugin" case runs every test there)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

import fastattn
import fastattn.testing
from fastattn import _reference as R, _scores
from fastattn._attention import SimilarityError
from fastattn.functional import attention_backward
from fastattn.similarity import (PLUGIN_CAPSULE_NAME, PLUGIN_CAPSULE_NAME_V1, CompiledSimilarity,
                                 ParamSpec)

from support import assert_close, randn

_KEEP = []  # ctypes structs and names that live capsules point into


def _selftest_functions():
    info = _scores.capsule_info(_scores.selftest_capsule())
    assert info is not None and info[:2] == (2, 2)
    return info[2:]


def _capsule(fields, values, name):
    class Plugin(ctypes.Structure):
        _fields_ = [("abi_version", ctypes.c_int), ("name", ctypes.c_char_p)] + \
            [(f, ctypes.c_void_p) for f in fields]

    st = Plugin(values[0], b"fake", *values[1:])
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    keep = ctypes.create_string_buffer(name.encode())
    _KEEP.append((st, keep))
    return new(ctypes.addressof(st), keep, None)


def v1_capsule():
    """The self-test plugin's scores as a version 1 plugin: a struct of four
    fields (no backward entries), named fastattn.score_plugin.v1."""
    f32, f64, _, _ = _selftest_functions()
    return _capsule(["score_f32", "score_f64"], (1, f32, f64), PLUGIN_CAPSULE_NAME_V1)


def v2_capsule(f32, f64, b32, b64, abi=2, name=PLUGIN_CAPSULE_NAME):
    return _capsule(["score_f32", "score_f64", "score_backward_f32", "score_backward_f64"],
                    (abi, f32, f64, b32, b64), name)


class Fake(CompiledSimilarity):
    """-gamma |q - k|^2 from whatever capsule it is given."""

    name = "test_fake_plugin"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0),
                   "mode": ParamSpec((), required=False, default=0.0)}

    def __init__(self, capsule):
        self.capsule = capsule


def _inputs(rng, dt=np.float64, Lq=7, Lk=9, d=4):
    q, k, v = randn(rng, (2, Lq, d), dt), randn(rng, (2, Lk, d), dt), randn(rng, (2, Lk, 3), dt)
    g = randn(rng, (2, Lq, 3), dt)
    return q, k, v, g


def _backward(g, q, k, v, sim, params=None, **kw):
    out, lse = fastattn.attention(q, k, v, sim, params=params, return_lse=True, **kw)
    return attention_backward(g, q, k, v, sim, params=params, out=out, lse=lse, **kw)


def _oracle(g, q, k, v, gamma=1.0, **kw):
    dq, dk, dv, dp = R.attention_backward(g, q, k, v, lambda a, b: R.score_neg_sq_dist_vjp(a, b, gamma),
                                          **kw)
    return dq, dk, dv, dp["gamma"]


def test_constants_match_the_header():
    assert _scores.PLUGIN_CAPSULE_NAME == PLUGIN_CAPSULE_NAME == "fastattn.score_plugin.v2"
    assert _scores.PLUGIN_CAPSULE_NAME_V1 == PLUGIN_CAPSULE_NAME_V1 == "fastattn.score_plugin.v1"
    assert _scores.PLUGIN_ABI_VERSION == fastattn.similarity.PLUGIN_ABI_VERSION == 2


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["f32", "f64"])
def test_c_backward_matches_the_oracle_and_the_score_is_not_called(dtype, rng):
    """The C score_backward (and the C scores) are what runs: the NumPy score
    of the class raises if called."""
    class NoNumpyScore(type(fastattn.testing.selftest_similarity())):
        def score(self, query, key, params):
            raise AssertionError("the NumPy score was called")

    q, k, v, g = _inputs(rng, dtype, Lq=70, Lk=150)  # several tiles, ragged ones
    q = q[:, ::-1]  # negative strides
    k = np.asfortranarray(k)
    mask = rng.random((70, 150)) < 0.8
    mask[3] = False
    before = [a.copy() for a in (q, k, v, g)]
    got = _backward(g, q, k, v, NoNumpyScore(), {"gamma": 0.3}, attn_mask=mask)
    ref = _oracle(g, q, k, v, float(np.dtype(dtype).type(0.3)), attn_mask=mask)
    for a, r, x in zip(got[:3], ref[:3], (q, k, v)):
        assert a.shape == x.shape and a.dtype == dtype
        assert_close(a, r, dtype)
    np.testing.assert_allclose(got[3]["gamma"], ref[3], rtol=2e-4 if dtype == np.float32 else 1e-10)
    assert got[3]["mode"] == 0 and got[3]["gamma"].dtype == dtype
    assert np.all(got[0][:, 3] == 0)  # the query that sees no key
    for a, b in zip((q, k, v, g), before):
        np.testing.assert_array_equal(a, b)


def test_version_1_plugin_runs_forward_only(rng):
    q, k, v, g = _inputs(rng)
    sim = Fake(v1_capsule())
    want = fastattn.attention(q, k, v, fastattn.testing.selftest_similarity())
    np.testing.assert_array_equal(fastattn.attention(q, k, v, sim), want)
    out, lse = fastattn.attention(q, k, v, sim, return_lse=True)
    with pytest.raises(NotImplementedError,
                       match=r"similarity 'test_fake_plugin' has no backward \(its compiled plugin "
                             r"has no score_backward"):
        attention_backward(g, q, k, v, sim, out=out, lse=lse)


def test_version_2_plugin_without_backward_or_without_one_dtype(rng):
    f32, f64, b32, b64 = _selftest_functions()
    q, k, v, g = _inputs(rng)
    out, lse = fastattn.attention(q, k, v, Fake(v2_capsule(f32, f64, 0, 0)), return_lse=True)
    with pytest.raises(NotImplementedError, match="'test_fake_plugin' has no backward"):
        attention_backward(g, q, k, v, Fake(v2_capsule(f32, f64, 0, 0)), out=out, lse=lse)
    only64 = Fake(v2_capsule(f32, f64, 0, b64))
    got = _backward(g, q, k, v, only64)
    for a, r in zip(got[:3], _oracle(g, q, k, v)[:3]):
        assert_close(a, r, np.float64)
    q32, k32, v32, g32 = (a.astype(np.float32) for a in (q, k, v, g))
    out, lse = fastattn.attention(q32, k32, v32, only64, return_lse=True)
    with pytest.raises(NotImplementedError, match=r"has no float32 score_backward"):
        attention_backward(g32, q32, k32, v32, only64, out=out, lse=lse)
    # a backward without the matching score: the forward's TypeError
    with pytest.raises(TypeError, match="the plugin has no float32 score function"):
        attention_backward(g32, q32, k32, v32, Fake(v2_capsule(0, f64, b32, b64)), out=out,
                           lse=lse)


def test_capsule_name_and_abi_version_must_agree(rng):
    f32, f64, b32, b64 = _selftest_functions()
    q, k, v, g = _inputs(rng)
    with pytest.raises(TypeError, match=r"plugin ABI version 1 in a capsule named "
                                        r"'fastattn.score_plugin.v2', this fastattn expects 2"):
        fastattn.attention(q, k, v, Fake(v2_capsule(f32, f64, b32, b64, abi=1)))
    with pytest.raises(TypeError, match=r"plugin ABI version 2 in a capsule named "
                                        r"'fastattn.score_plugin.v1', this fastattn expects 1"):
        attention_backward(g, q, k, v, Fake(v2_capsule(f32, f64, b32, b64, name=PLUGIN_CAPSULE_NAME_V1)),
                           out=g, lse=g[..., 0])
    with pytest.raises(TypeError, match=r"capsule must be a PyCapsule named "
                                        r"'fastattn.score_plugin.v2' \(or a version 1"):
        attention_backward(g, q, k, v, Fake(v2_capsule(f32, f64, b32, b64, name="other")),
                           out=g, lse=g[..., 0])


def test_error_code_and_nonfinite_scores_of_the_recomputation(rng):
    sim = fastattn.testing.selftest_similarity()
    q, k, v, g = _inputs(rng)
    out, lse = fastattn.attention(q, k, v, sim, return_lse=True)
    with pytest.raises(SimilarityError,
                       match=r"similarity 'fastattn_selftest_neg_sq_dist': the compiled "
                             r"score_backward function returned error code 9"):
        attention_backward(g, q, k, v, sim, params={"mode": 4}, out=out, lse=lse)
    with pytest.raises(SimilarityError, match="the compiled score function returned error code 7"):
        attention_backward(g, q, k, v, sim, params={"mode": 1}, out=out, lse=lse)
    for mode in (2, 3):
        with pytest.raises(ValueError, match=r"score returned NaN or \+inf values"):
            attention_backward(g, q, k, v, sim, params={"mode": mode}, out=out, lse=lse)


class Repacked(type(fastattn.testing.selftest_similarity())):
    """pack_params with another layout: [gamma, mode, 0]; the C code reads
    only the first two.  Without its own unpack_param_grads, a clear error."""

    name = "test_repacked"

    def pack_params(self, params, d, dtype):
        return np.array([params["gamma"], params["mode"], 0.0])


class RepackedUnpacked(Repacked):
    name = "test_repacked_unpacked"

    def unpack_param_grads(self, grad_packed, params, d):
        assert grad_packed.shape == (3,) and grad_packed[2] == 0
        return {"gamma": grad_packed[0], "mode": grad_packed[1]}


def test_packed_parameter_gradients_are_unpacked(rng):
    q, k, v, g = _inputs(rng)
    with pytest.raises(ValueError, match=r"'test_repacked': unpack_param_grads got a packed "
                                         r"gradient of 3 elements, the parameters have 2"):
        _backward(g, q, k, v, Repacked(), {"gamma": 0.5})
    got = _backward(g, q, k, v, RepackedUnpacked(), {"gamma": 0.5})
    np.testing.assert_allclose(got[3]["gamma"], _oracle(g, q, k, v, 0.5)[3], rtol=1e-10)
    assert got[3]["mode"] == 0


def test_zero_features(rng):
    """d = 0: every score is 0 (as the forward: one zero feature in the C
    calls); dq, dk are empty, dv the uniform average's gradient."""
    sim = fastattn.testing.selftest_similarity()
    q, k = np.zeros((2, 5, 0)), np.zeros((2, 6, 0))
    v, g = randn(rng, (2, 6, 3)), randn(rng, (2, 5, 3))
    dq, dk, dv, dp = _backward(g, q, k, v, sim)
    assert dq.shape == q.shape and dk.shape == k.shape
    np.testing.assert_allclose(dv, np.repeat(g.sum(1, keepdims=True) / 6, 6, axis=1), rtol=1e-12)
    assert dp["gamma"] == 0


def test_numpy_score_backward_of_a_version_1_plugin_is_used(rng):
    """A class with a v1 capsule and a NumPy score + score_backward: those run."""
    class WithNumpy(Fake):
        name = "test_fake_with_numpy_backward"

        def score(self, query, key, params):
            diff = query[..., :, None, :] - key[..., None, :, :]
            return -params["gamma"] * np.sum(diff * diff, axis=-1)

        def score_backward(self, query, key, params, grad_scores):
            _, vjp = R.score_neg_sq_dist_vjp(query, key, params["gamma"])
            return vjp(grad_scores)

    q, k, v, g = _inputs(rng)
    got = _backward(g, q, k, v, WithNumpy(v1_capsule()), {"gamma": 0.7})
    ref = _oracle(g, q, k, v, 0.7)
    for a, r in zip(got[:3], ref[:3]):
        assert_close(a, r, np.float64)
    np.testing.assert_allclose(got[3]["gamma"], ref[3], rtol=1e-10)
