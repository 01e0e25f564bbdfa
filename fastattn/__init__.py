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
from ._alloc import memory_cache_info, release_memory, set_memory_cache
from .functional import (Plan, attention, explain, merge_attention, multi_head_attention,
                         scaled_dot_product_attention)
from .registry import (available_similarities, get_similarity, register_similarity,
                       unregister_similarity)
from .similarity import CompiledSimilarity, Similarity
from . import layers  # the public subpackage fastattn.layers (pure Python)
from . import losses  # fastattn.losses: cross_entropy, binary_cross_entropy_with_logits, mse
from . import optim  # fastattn.optim: SGD, Adam, AdamW, clip_grad_norm, schedules
from ._checkpoint import load, save
from . import train  # fastattn.train: fit, bucket_batches
from .train import fit

__version__ = "0.1.0"

# FASTATTN_DISABLE_SIMD=1 forces the portable scalar code paths;
# FASTATTN_SIMD=avx2 keeps an AVX-512 CPU on the AVX2 kernels.
if _os.environ.get("FASTATTN_DISABLE_SIMD", "").strip() not in ("", "0"):
    _kernels.set_simd_disabled(True)
_SIMD_CAPS = {"avx2": 1, "avx512": 2}
_simd_env = _os.environ.get("FASTATTN_SIMD", "").strip().lower()
if _simd_env in _SIMD_CAPS:
    _kernels.set_simd_max_level(_SIMD_CAPS[_simd_env])
elif _simd_env:
    import warnings as _warnings

    _warnings.warn(f"FASTATTN_SIMD: expected 'avx2' or 'avx512', got {_simd_env!r}; ignored",
                   RuntimeWarning, stacklevel=2)


def get_include() -> str:
    """Directory holding ``fastattn_plugin.h``, the C ABI of compiled similarity
    plugins (add it to your extension's ``include_dirs``)."""
    here = _os.path.dirname(_os.path.abspath(__file__))
    for d in (_os.path.join(here, "include"), _os.path.join(_os.path.dirname(here), "csrc")):
        if _os.path.exists(_os.path.join(d, "fastattn_plugin.h")):
            return d
    raise FileNotFoundError("fastattn_plugin.h is not installed with this fastattn")


def simd_active() -> bool:
    """True when the AVX2/FMA kernels are in use (CPU support and not disabled)."""
    return _kernels.simd_active()


def simd_isa():
    """The vector kernels in use: ``"avx512"`` (AVX-512 products on AVX512F
    CPUs), ``"avx2"``, or None (the portable scalar code: no AVX2/FMA, or
    ``FASTATTN_DISABLE_SIMD=1``).  ``FASTATTN_SIMD=avx2`` before the import
    keeps an AVX-512 CPU on the AVX2 kernels (the results are the same bits,
    but for a few-row dot-product path)."""
    return {0: None, 1: "avx2", 2: "avx512"}[_kernels.simd_level()]


__all__ = [
    "scaled_dot_product_attention",
    "attention",
    "multi_head_attention",
    "merge_attention",
    "register_similarity",
    "get_similarity",
    "available_similarities",
    "unregister_similarity",
    "Similarity",
    "CompiledSimilarity",
    "explain",
    "Plan",
    "get_num_threads",
    "set_num_threads",
    "threads",
    "set_memory_cache",
    "memory_cache_info",
    "release_memory",
    "simd_active",
    "simd_isa",
    "get_include",
    "save",
    "load",
    "losses",
    "optim",
    "train",
    "fit",
    "__version__",
]
