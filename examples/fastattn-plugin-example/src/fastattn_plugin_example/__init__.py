"""Example compiled similarity for fastattn: ``-gamma * |q - k|_1``.

Installed, it is discovered through the ``fastattn.similarities`` entry
point::

    import fastattn
    out = fastattn.attention(q, k, v, "neg_l1_distance", params={"gamma": 0.5})

The scores come from C (``_l1.c``), called inside fastattn's streaming loop
with no Python call per tile.
"""
import numpy as np
from fastattn.similarity import CompiledSimilarity, ParamSpec

from . import _l1

__all__ = ["NegL1Distance"]


class NegL1Distance(CompiledSimilarity):
    """``score(q, k) = -gamma * sum_c |q_c - k_c|``; gamma >= 0 (default 1)."""

    name = "neg_l1_distance"
    params_spec = {"gamma": ParamSpec((), required=False, default=1.0, doc="distance scale")}
    capsule = _l1.score_plugin

    def pack_params(self, params, d, dtype):
        # the C side reads one double: gamma
        return np.array([float(params["gamma"])], dtype=np.float64)

    def score(self, query, key, params):
        """NumPy version (for reference; fastattn.attention uses the C one)."""
        diff = np.abs(query[..., :, None, :] - key[..., None, :, :])
        return -params["gamma"] * diff.sum(axis=-1)
