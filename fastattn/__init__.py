"""fastattn: fast CPU attention for NumPy.

Public names only; see :mod:`fastattn.functional` for the shape glossary and
the mask convention (boolean True = may attend).
"""
import os as _os

try:
    from . import _kernels
except ImportError as _exc:  # pragma: no cover - depends on how it was installed
    raise ImportError(
        "fastattn's compiled extension could not be imported. If you are running from "
        "the fastattn source checkout, Python picked up the unbuilt source folder: run "
        "from another directory, use the installed command (`fastattn demo`, `pytest`), "
        "or build in place with `python setup.py build_ext --inplace`. "
        f"Original error: {_exc}"
    ) from _exc
from ._threads import get_num_threads, set_num_threads, threads
from .functional import Plan, explain, multi_head_attention, scaled_dot_product_attention

from . import layers  # noqa: E402  (pure Python: fastattn.layers.MultiHeadAttention)

__version__ = "0.1.0"

# FASTATTN_DISABLE_SIMD=1 forces the portable scalar code paths.
if _os.environ.get("FASTATTN_DISABLE_SIMD", "").strip() not in ("", "0"):
    _kernels.set_simd_disabled(True)


def simd_active() -> bool:
    """True when the AVX2/FMA kernels are in use (CPU support and not disabled)."""
    return _kernels.simd_active()


__all__ = [
    "scaled_dot_product_attention",
    "multi_head_attention",
    "explain",
    "Plan",
    "get_num_threads",
    "set_num_threads",
    "threads",
    "simd_active",
    "__version__",
]
