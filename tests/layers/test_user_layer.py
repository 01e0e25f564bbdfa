"""A user's own layer on the public base class fastattn.layers.Layer: it nests
in Sequential, its gradients pass check_gradients, optimizers update it,
and loading a checkpoint of it is refused by name (only fastattn's classes load)."""
from __future__ import annotations

import numpy as np
import pytest

import fastattn
from fastattn import layers as L, optim
from fastattn.testing import check_gradients


class Scale(L.Layer):
    """y = alpha * tanh(x) (per feature)."""

    def __init__(self, n):
        self._params = {"alpha": np.linspace(0.5, 1.5, n)}
        self._config = {"n": n}

    def __call__(self, x):
        return self._params["alpha"] * np.tanh(x)

    def forward_backward(self, x):
        t = np.tanh(x)

        def backprop(g):
            self.grads["alpha"] += np.sum(g * t, axis=tuple(range(g.ndim - 1)))
            return (g * self._params["alpha"] * (1 - t * t),)
        return self(x), backprop


def test_user_layer_trains_inside_sequential(rng, tmp_path):
    assert "Layer" in L.__all__
    model = L.Sequential(L.Linear(4, 3, seed=1, dtype=np.float64), Scale(3))
    x = rng.standard_normal((5, 4))
    errs = check_gradients(model, x)
    assert set(errs) >= {"param 1.alpha", "param 0.weight", "input 0"}
    assert max(errs.values()) < 1e-6
    names = dict(model.named_parameters())
    assert "1.alpha" in names
    before = names["1.alpha"].copy()
    opt = optim.Adam(model, lr=0.1)
    out, backprop = model.forward_backward(x)
    model.zero_grad()
    backprop(np.ones_like(out))
    opt.step()
    assert not np.array_equal(dict(model.named_parameters())["1.alpha"], before)
    fastattn.save(model, tmp_path / "m.npz")
    with pytest.raises((TypeError, ValueError), match="Scale"):
        fastattn.load(tmp_path / "m.npz")   # a checkpoint builds only fastattn's classes
