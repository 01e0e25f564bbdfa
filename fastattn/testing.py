"""Helpers for testing and benchmarking similarities.

Benchmark your similarity against the built-ins with pytest-benchmark in a
few lines (see :func:`benchmark_similarity` and the ``docs/similarities.md``
section "Profiling your similarity")::

    # test_bench_mine.py -- run: pytest test_bench_mine.py --benchmark-only
    import pytest
    from fastattn.testing import benchmark_similarity

    @pytest.mark.parametrize("sim", ["mine", "additive", "scaled_dot"])
    def test_speed(benchmark, sim):
        benchmark_similarity(benchmark, sim, batch=4, Lq=256, Lk=256, d=64)

Also here: :func:`selftest_similarity`, a compiled plugin built into
fastattn that exercises the plugin ABI (``csrc/fastattn_plugin.h``), and
:func:`check_gradients`, finite differences against a layer's
``forward_backward`` (for your own layers).
"""
from __future__ import annotations

import numpy as np

from . import _reference
from ._attention import attention, attention_path, selftest_capsule
from .registry import get_similarity
from .similarity import CompiledSimilarity, ParamSpec

__all__ = ["benchmark_similarity", "check_against_oracle", "check_gradients", "make_inputs",
           "selftest_similarity"]


class _SelftestNegSqDist(CompiledSimilarity):
    """-gamma |q - k|^2 from C (fa_selftest_plugin); ``mode`` 1/2/3 makes the C
    function fail with code 7 / write a NaN / write +inf (for error tests)."""

    name = "fastattn_selftest_neg_sq_dist"
    params_spec = {
        "gamma": ParamSpec((), required=False, default=1.0),
        "mode": ParamSpec((), required=False, default=0.0),
    }

    def __init__(self):
        self.capsule = selftest_capsule()

    def score(self, query, key, params):
        diff = query[..., :, None, :] - key[..., None, :, :]
        return -params["gamma"] * np.sum(diff * diff, axis=-1)


def make_inputs(similarity, *, batch=1, Lq=256, Lk=None, d=64, dv=None, d_a=None,
                dtype="float32", seed=0):
    """Random ``(query, key, value, params)`` for a similarity.

    query (batch, Lq, d), key (batch, Lk, d), value (batch, Lk, dv);
    ``params`` from the similarity's ``init_params`` (``d_a`` defaults to d;
    None for a similarity without ``params_spec``).  Inputs are standard
    normal, so dot-product scores are O(sqrt(d)).
    """
    sim = get_similarity(similarity)
    Lk = Lq if Lk is None else Lk
    dv = d if dv is None else dv
    dt = np.dtype(dtype)
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((batch, Lq, d)).astype(dt)
    k = rng.standard_normal((batch, Lk, d)).astype(dt)
    v = rng.standard_normal((batch, Lk, dv)).astype(dt)
    params = sim.init_params(d, d, rng=rng, dtype=dt, d_a=d if d_a is None else d_a)
    return q, k, v, params


def _first_item_rows(a, rows, batch_axis, query_axis=True):
    """a[first batch item, first ``rows`` queries], leaving broadcast (size 1)
    axes alone.  ``batch_axis``: the axis of ``a`` aligned with the query's
    first batch axis (None when it has none)."""
    if a.ndim >= 2 and query_axis and a.shape[-2] != 1:
        a = a[..., :rows, :]
    if batch_axis is not None and 0 <= batch_axis < a.ndim - 2 and a.shape[batch_axis] != 1:
        a = a[(slice(None),) * batch_axis + (slice(0, 1),)]
    return a


def check_against_oracle(similarity, q, k, v, params, *, rows=16, rtol=None, **kwargs):
    """fastattn.attention on the first batch item's first ``rows`` queries
    against the float64 oracle built from the similarity's own NumPy
    ``score`` on float64 inputs (dense; so kept small).

    q (batch, Lq, d) or (Lq, d); k and v alike.  ``attn_mask`` (any shape
    that broadcasts to (..., Lq, Lk)) is cut the same way along its query
    and batch axes where it is not broadcast there (size 1).  With
    ``return_weights=True`` the weights are checked too.  Returns the max
    error relative to max |reference|; raises AssertionError above ``rtol``
    (default 1e-5 for float32, 1e-10 for float64)."""
    sim = get_similarity(similarity)
    q, k, v = (np.asarray(a) for a in (q, k, v))

    def cut(a, query_axis=True):
        # axes align from the right: q's first batch axis is a's axis a.ndim - q.ndim
        return _first_item_rows(a, rows, a.ndim - q.ndim if q.ndim >= 3 else None, query_axis)

    qs, ks, vs = cut(q), cut(k, False), cut(v, False)
    kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask = cut(np.asarray(mask))
        kwargs["attn_mask"] = mask
    want_w = bool(kwargs.get("return_weights", False))
    got = attention(qs, ks, vs, sim, params=params, **kwargs)
    got_w = None
    if want_w:
        got, got_w = got
    p64 = sim.check_params(params, q.shape[-1], k.shape[-1], np.float64) \
        if sim.params_spec is not None else params
    ref, ref_w = _reference.attention(qs, ks, vs, lambda a, b: sim.score(a, b, p64), mask,
                                      kwargs.get("is_causal", False),
                                      causal_alignment=kwargs.get("causal_alignment", "top_left"),
                                      return_weights=True)

    def rel(a, b):
        if not b.size:
            return 0.0
        return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))

    err = rel(got, ref)
    what = "relative error"
    if got_w is not None:
        err_w = rel(got_w, ref_w)
        if err_w > err:
            err, what = err_w, "relative error of the weights"
    if rtol is None:
        rtol = 1e-5 if got.dtype == np.float32 else 1e-10
    if not err <= rtol:
        raise AssertionError(f"similarity {sim.name!r}: {what} {err:.3g} > {rtol:g}")
    return err


def benchmark_similarity(benchmark, similarity, *, batch=1, Lq=256, Lk=None, d=64, dv=None,
                         d_a=None, dtype="float32", params=None, seed=0, check=True,
                         rounds=None, **attention_kwargs):
    """Time ``fastattn.attention`` with one similarity under pytest-benchmark.

    ``benchmark`` is pytest-benchmark's fixture; ``similarity`` a registered
    name or a Similarity.  Inputs come from :func:`make_inputs` (``params``
    overrides the random parameters); other keyword arguments
    (``attn_mask``, ``is_causal``, ``n_threads``, ...) go to
    ``fastattn.attention``.  With ``check`` the result is first compared with
    the float64 oracle (:func:`check_against_oracle`, outside the timing).
    Calls slower than 20 ms are timed with ``benchmark.pedantic`` (1 warm-up,
    then ``rounds`` rounds, default 3-15 within ~3 s).  The similarity's name,
    shape, dtype and kernel path go into ``benchmark.extra_info``.  Returns
    the last result.
    """
    import time

    sim = get_similarity(similarity)
    q, k, v, P = make_inputs(sim, batch=batch, Lq=Lq, Lk=Lk, d=d, dv=dv, d_a=d_a,
                             dtype=dtype, seed=seed)
    if params is not None:
        P = params
    if check:
        check_against_oracle(sim, q, k, v, P, **{kk: vv for kk, vv in attention_kwargs.items()
                                                 if kk not in ("out",)})

    def run():
        return attention(q, k, v, sim, params=P, **attention_kwargs)

    benchmark.extra_info.update(
        kind="similarity", similarity=sim.name, sim_shape=[batch, Lq, k.shape[1], d],
        dtype=np.dtype(dtype).name, impl="fastattn",
        path=attention_path(q, k, v, sim, params=P, **attention_kwargs))
    run()
    t0 = time.perf_counter()
    run()
    one = time.perf_counter() - t0
    if one < 0.02 and rounds is None:
        return benchmark(run)
    n = rounds if rounds is not None else int(min(15, max(3, 3.0 / max(one, 1e-9))))
    return benchmark.pedantic(run, rounds=n, iterations=1, warmup_rounds=1)


def selftest_similarity():
    """A :class:`~fastattn.CompiledSimilarity` backed by fastattn's own C
    self-test plugin (not registered)."""
    return _SelftestNegSqDist()


# ----------------------------------------------------------------- gradients
def _float_leaves(x):
    """The float ndarrays of a nested tuple / list, in order (others skipped)."""
    if isinstance(x, np.ndarray):
        return [x] if x.dtype.kind == "f" else []
    if isinstance(x, (tuple, list)):
        return [a for e in x for a in _float_leaves(e)]
    return []


def _like(x, make):
    """x's structure with each float ndarray replaced by make(array), the rest
    dropped at the end of a tuple (the masks and ids a layer returns last)."""
    if isinstance(x, np.ndarray):
        return make(x) if x.dtype.kind == "f" else None
    items = [_like(e, make) for e in x]
    while items and items[-1] is None:
        items.pop()
    return tuple(items)


def check_gradients(layer, *inputs, eps=1e-6, rtol=1e-5, atol=1e-8, entries=6, seed=0, **kwargs):
    """Check ``layer.forward_backward(*inputs, **kwargs)`` against central
    finite differences of ``layer(*inputs, **kwargs)``; for users' own layers.

    The scalar checked is ``Σ <g, out>`` over the float arrays of the output
    (nested tuples too) with random ``g`` (seeded); ``backprop`` gets ``g``
    in the output's structure (one argument per top-level output, trailing
    masks / ids dropped).  ``entries`` random entries of every parameter
    (:meth:`Layer.named_parameters`) and of every float input array are
    perturbed by ``±eps`` in place and restored.  Use a float64 layer and
    inputs.  Gradients already in ``layer.grads`` are set to zero first.
    Returns ``{name: max relative error}``; raises ``AssertionError`` naming
    the first entry off by more than ``atol + rtol |fd|``.
    """
    rng = np.random.default_rng(seed)
    layer.zero_grad()
    out, backprop = layer.forward_backward(*inputs, **kwargs)
    leaves = _float_leaves(out)
    gs = [rng.standard_normal(a.shape) for a in leaves]
    it = iter(gs)
    g_struct = _like(out, lambda a: next(it))
    in_grads = backprop(*g_struct) if isinstance(out, tuple) else backprop(g_struct)

    changed = getattr(layer, "params_changed", None)   # a user's layer may have none

    def value():
        if changed is not None:   # written in place below: no derived copy (packed weights) may lag
            changed()
        o = layer(*inputs, **kwargs)
        return float(sum(np.sum(np.asarray(a, np.float64) * g) for a, g in zip(_float_leaves(o), gs)))

    checks = [(f"param {n}", p, dict(layer.named_grads())[n]) for n, p in layer.named_parameters()]
    for i, (x, dx) in enumerate(zip(inputs, in_grads or ())):
        if isinstance(x, np.ndarray) and x.dtype.kind == "f" and dx is not None:
            checks.append((f"input {i}", x, dx))
    report = {}
    for name, arr, grad in checks:
        if arr.size == 0:
            continue
        if not arr.flags.writeable:
            raise ValueError(f"{name}: read-only (a frozen layer?): finite differences need to write it")
        worst = 0.0
        for _ in range(entries):
            idx = tuple(int(rng.integers(s)) for s in arr.shape)
            old = arr[idx]
            arr[idx] = old + eps
            up = value()
            arr[idx] = old - eps
            down = value()
            arr[idx] = old
            fd = (up - down) / (2 * eps)
            an = float(np.asarray(grad)[idx])
            if abs(an - fd) > atol + rtol * abs(fd):
                raise AssertionError(f"{name}{list(idx)}: backward gives {an!r}, finite "
                                     f"differences {fd!r}")
            worst = max(worst, abs(an - fd) / max(abs(fd), atol))
        report[name] = worst
    return report
