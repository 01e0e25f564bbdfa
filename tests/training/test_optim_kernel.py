"""The Adam / AdamW update in C (fastattn._optim_ops on fastattn._rowwise): the
same bits as its NumPy form (the path for arrays the kernel does not take),
for every option, both dtypes, any thread count; torch's trajectory is
checked in test_optim.py."""
from __future__ import annotations

import numpy as np
import pytest

from fastattn import _optim_ops


def _run(dtype, kernel, n_threads=None, steps=5, **hyper):
    rng = np.random.default_rng(0)
    p = rng.standard_normal(100003).astype(dtype)   # several chunks: the pool is used
    m, v = np.zeros_like(p), np.zeros_like(p)
    vmax = np.zeros_like(p) if hyper.pop("amsgrad") else None
    for t in range(1, steps + 1):
        g = rng.standard_normal(p.shape).astype(dtype) * (10.0 if t == 3 else 1.0)
        if kernel:
            _optim_ops.adam_update(p, g, m, v, vmax, step=t, n_threads=n_threads, **hyper)
        else:   # the NumPy form: a non-contiguous view of the same numbers takes it
            views = [np.stack([a, a], axis=1)[:, 0] for a in (p, g, m, v)]
            vm = None if vmax is None else np.stack([vmax, vmax], axis=1)[:, 0]
            _optim_ops.adam_update(*views, vm, step=t, **hyper)
            for a, b in zip((p, m, v), (views[0], views[2], views[3])):
                a[...] = b
            if vmax is not None:
                vmax[...] = vm
    return p, m, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("opts", [
    dict(weight_decay=0.0, decoupled=False, maximize=False, amsgrad=False),
    dict(weight_decay=0.1, decoupled=False, maximize=False, amsgrad=True),
    dict(weight_decay=0.05, decoupled=True, maximize=True, amsgrad=False),
    dict(weight_decay=0.05, decoupled=True, maximize=False, amsgrad=True),
], ids=["adam", "l2-amsgrad", "adamw-maximize", "adamw-amsgrad"])
def test_kernel_same_bits_as_numpy_form(dtype, opts):
    hyper = dict(lr=3e-3, betas=(0.9, 0.98), eps=1e-7, **opts)
    got = _run(dtype, True, **dict(hyper))
    ref = _run(dtype, False, **dict(hyper))
    for a, b in zip(got, ref):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)
    one = _run(dtype, True, n_threads=1, **dict(hyper))
    for a, b in zip(got, one):
        np.testing.assert_array_equal(a, b)


def test_kernel_propagates_nan_as_numpy():
    p = np.ones(8, np.float32)
    g = np.array([np.nan, 1, 1, 1, 1, 1, 1, np.inf], np.float32)
    m, v, vm = np.zeros(8, np.float32), np.zeros(8, np.float32), np.zeros(8, np.float32)
    _optim_ops.adam_update(p, g, m, v, vm, step=1, lr=0.1, betas=(0.9, 0.999), eps=1e-8,
                           weight_decay=0.0, decoupled=False, maximize=False)
    assert np.isnan(p[0]) and np.isnan(vm[0]) and np.isfinite(p[1:7]).all()
