"""The example compiled plugin under examples/fastattn-plugin-example: build
and install it with pip, discover it by entry point, check its results
against a NumPy reference, uninstall it."""
from __future__ import annotations

import importlib
import os
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R, registry
from fastattn._attention import SimilarityError

from conftest import FASTATTN_PARENT, assert_close, randn, run_child

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "examples", "fastattn-plugin-example")
DIST = "fastattn-plugin-example"


def _pip(*args, timeout=180):
    env = dict(os.environ)
    # the build imports this fastattn (for fastattn.get_include())
    env["PYTHONPATH"] = FASTATTN_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def installed_plugin():
    if not os.path.isdir(EXAMPLE):
        pytest.fail(f"example plugin not found at {EXAMPLE}")
    r = _pip("install", "--no-build-isolation", "--no-deps", "--no-index", EXAMPLE)
    assert r.returncode == 0, r.stdout + r.stderr
    importlib.invalidate_caches()
    try:
        yield
    finally:
        _pip("uninstall", "-y", DIST)
        for mod in [m for m in sys.modules if m.startswith("fastattn_plugin_example")]:
            del sys.modules[mod]
        with registry._lock:
            registry._store.pop("neg_l1_distance", None)
        registry._reset_entry_points()
        importlib.invalidate_caches()


@pytest.fixture
def plugin(installed_plugin):
    registry._reset_entry_points()
    with registry._lock:
        registry._store.pop("neg_l1_distance", None)
    sim = fastattn.get_similarity("neg_l1_distance")  # a miss: loads the entry points
    yield sim
    with registry._lock:
        registry._store.pop("neg_l1_distance", None)


def test_discovered_by_entry_point(plugin):
    assert "neg_l1_distance" in fastattn.available_similarities()
    assert type(plugin).__module__ == "fastattn_plugin_example"
    assert isinstance(plugin, fastattn.CompiledSimilarity)
    from fastattn import _attention

    q = np.ones((3, 4))
    assert _attention.attention_path(q, q, q, "neg_l1_distance") == "fused"


@pytest.mark.parametrize("mask_kind", ["none", "bool", "causal", "padding_fully_masked"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_results_against_numpy_reference(plugin, dtype, mask_kind, rng):
    q, k, v = randn(rng, (2, 70, 5), dtype), randn(rng, (2, 300, 5), dtype), randn(rng, (2, 300, 3), dtype)
    mask, causal = None, False
    if mask_kind == "bool":
        mask = rng.random((70, 300)) < 0.6
    elif mask_kind == "causal":
        causal = True
    elif mask_kind == "padding_fully_masked":
        mask = (np.arange(300) < np.array([120, 0])[:, None])[:, None, :]  # item 1: no key
    ref, ref_w = R.attention(q, k, v, lambda a, b: R.score_neg_l1(a, b, 0.4), mask, causal,
                             return_weights=True)
    got = fastattn.attention(q, k, v, "neg_l1_distance", params={"gamma": 0.4}, attn_mask=mask,
                             is_causal=causal, n_threads=2)
    assert_close(got, ref, dtype)
    got, w = fastattn.attention(q, k, v, "neg_l1_distance", params={"gamma": 0.4}, attn_mask=mask,
                                is_causal=causal, return_weights=True)
    assert_close(got, ref, dtype)
    assert_close(w, ref_w, dtype)


def test_plugin_error_code_surfaces(plugin, rng):
    q = randn(rng, (4, 3))
    with pytest.raises(SimilarityError, match=r"similarity 'neg_l1_distance': the compiled score "
                                              r"function returned error code 1"):
        fastattn.attention(q, q, q, "neg_l1_distance", params={"gamma": -1.0})


def test_fresh_process_finds_it(installed_plugin):
    code = ("import numpy as np, fastattn; q = np.arange(12.).reshape(4, 3) / 10; "
            "o = fastattn.attention(q, q, q, 'neg_l1_distance'); print(repr(float(o.sum())))")
    r = run_child(code)
    assert r.returncode == 0, r.stderr
    q = np.arange(12.0).reshape(4, 3) / 10
    ref = R.attention(q, q, q, lambda a, b: R.score_neg_l1(a, b, 1.0))
    np.testing.assert_allclose(float(r.stdout), ref.sum(), rtol=1e-12)
