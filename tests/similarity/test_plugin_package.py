"""The example compiled plugin under examples/fastattn-plugin-example: build
it with pip into a temporary ``--target`` directory (never the running
interpreter's site-packages), discover it by entry point from that
directory (on sys.path here, on PYTHONPATH for a child process), check its
results against a NumPy reference."""
from __future__ import annotations

import importlib
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import fastattn
from fastattn import _reference as R, registry
from fastattn._attention import SimilarityError

from support import FASTATTN_PARENT, REPO_ROOT, assert_close, randn, run_child

EXAMPLE = os.path.join(REPO_ROOT, "examples", "fastattn-plugin-example")
DIST = "fastattn-plugin-example"


def _pip(*args, timeout=180):
    env = dict(os.environ)
    # the build imports this fastattn (for fastattn.get_include())
    env["PYTHONPATH"] = FASTATTN_PARENT + os.pathsep + env.get("PYTHONPATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def _forget_plugin():
    for mod in [m for m in sys.modules if m.startswith("fastattn_plugin_example")]:
        del sys.modules[mod]
    with registry._lock:
        registry._store.pop("neg_l1_distance", None)
    registry._reset_entry_points()
    importlib.invalidate_caches()


@pytest.fixture(scope="module")
def plugin_target(tmp_path_factory):
    """The example built and installed into a fresh directory (a copy of its
    source is built, so no build files land in the repository)."""
    if not os.path.isdir(EXAMPLE):
        pytest.fail(f"example plugin not found at {EXAMPLE}")
    tmp = tmp_path_factory.mktemp("plugin")
    src = tmp / "src"
    shutil.copytree(EXAMPLE, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "*.so"))
    target = tmp / "site"
    r = _pip("install", "--target", str(target), "--no-build-isolation", "--no-deps",
             "--no-index", str(src))
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(p.name.startswith("fastattn_plugin_example") and p.name.endswith(".dist-info")
               for p in target.iterdir()), sorted(p.name for p in target.iterdir())
    return str(target)


@pytest.fixture(scope="module")
def installed_plugin(plugin_target):
    """The target directory on sys.path for this module's tests only."""
    sys.path.insert(0, plugin_target)
    _forget_plugin()
    try:
        yield plugin_target
    finally:
        sys.path.remove(plugin_target)
        _forget_plugin()


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


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_backward_against_the_oracle_and_torch(plugin, dtype, rng):
    """The plugin's C score_backward (ABI version 2) under attention_backward:
    against the float64 oracle, and (float64) torch autograd to 1e-10."""
    q, k, v = randn(rng, (2, 70, 5), dtype), randn(rng, (2, 150, 5), dtype), randn(rng, (2, 150, 3), dtype)
    g = randn(rng, (2, 70, 3), dtype)
    mask = rng.random((70, 150)) < 0.7
    out, lse = fastattn.attention(q, k, v, "neg_l1_distance", params={"gamma": 0.4},
                                  attn_mask=mask, return_lse=True)
    got = fastattn.functional.attention_backward(g, q, k, v, "neg_l1_distance",
                                                 params={"gamma": 0.4}, out=out, lse=lse,
                                                 attn_mask=mask)
    gamma = float(np.dtype(dtype).type(0.4))
    ref = R.attention_backward(g, q, k, v, lambda a, b: R.score_neg_l1_vjp(a, b, gamma), mask)
    for a, r, x in zip(got[:3], ref[:3], (q, k, v)):
        assert a.shape == x.shape and a.dtype == x.dtype
        assert_close(a, r, dtype)
    np.testing.assert_allclose(got[3]["gamma"], ref[3]["gamma"],
                               rtol=2e-4 if dtype == "float32" else 1e-10)
    if dtype == "float32":
        return
    torch = pytest.importorskip("torch")
    tq, tk, tv, tgam = (torch.tensor(x, requires_grad=True) for x in (q, k, v, np.float64(0.4)))
    s = -tgam * (tq[..., :, None, :] - tk[..., None, :, :]).abs().sum(-1)
    s = s.masked_fill(~torch.tensor(mask), -np.inf)
    (torch.softmax(s, -1) @ tv).backward(torch.tensor(g))
    for a, t in zip(list(got[:3]) + [got[3]["gamma"]], (tq, tk, tv, tgam)):
        b = t.grad.numpy()
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10 * np.abs(b).max())


def test_plugin_error_code_surfaces(plugin, rng):
    q = randn(rng, (4, 3))
    with pytest.raises(SimilarityError, match=r"similarity 'neg_l1_distance': the compiled score "
                                              r"function returned error code 1"):
        fastattn.attention(q, q, q, "neg_l1_distance", params={"gamma": -1.0})


def test_fresh_process_finds_it(plugin_target):
    """A child process with the target directory on PYTHONPATH discovers the
    plugin by its entry point (importlib.metadata reads that path); without
    it, it does not: nothing was installed into the environment."""
    code = ("import sys, numpy as np, fastattn; q = np.arange(12.).reshape(4, 3) / 10; "
            "names = fastattn.available_similarities(); print('neg_l1_distance' in names); "
            "from importlib.metadata import entry_points; "
            "eps = [e for e in entry_points(group='fastattn.similarities')]; "
            "print([e.value for e in eps]); "
            "o = fastattn.attention(q, q, q, 'neg_l1_distance') if 'neg_l1_distance' in names "
            "else np.zeros(1); print(repr(float(o.sum())))")
    r = run_child(code, env_update={"PYTHONPATH": plugin_target})
    assert r.returncode == 0, r.stderr
    found, eps, total = r.stdout.split("\n")[:3]
    assert found == "True"
    assert "fastattn_plugin_example:NegL1Distance" in eps
    q = np.arange(12.0).reshape(4, 3) / 10
    ref = R.attention(q, q, q, lambda a, b: R.score_neg_l1(a, b, 1.0))
    np.testing.assert_allclose(float(total), ref.sum(), rtol=1e-12)
    r = run_child(code, env_remove=("PYTHONPATH",))
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[0] == "False"


def test_installed_only_in_the_target(plugin_target):
    """The distribution exists in the target directory and nowhere else on
    this interpreter's path (site-packages untouched)."""
    from importlib.metadata import distributions

    def names(path):
        return {(d.metadata["Name"] or "").lower() for d in distributions(path=path)}

    assert DIST in names([plugin_target])
    assert DIST not in names([p for p in sys.path if p != plugin_target])
