"""Large blocks reused across fastattn's layer calls.

A training step allocates the same activations and gradients as the step
before (megabytes each) and frees them at its end; glibc hands regions that
large back to the kernel, so the next step maps fresh pages and pays a page
fault and a page clear for each (9 % of a TransformerEncoderLayer training
step on a 2-core Xeon, ``clear_page_erms`` in ``perf``).  While a layer runs
(``__call__``, ``forward_backward`` and the backprop it returns,
``loss_and_grads``), NumPy allocates through fastattn's data-memory handler
(NEP 49, :mod:`fastattn._memory` over ``csrc/fa_cache.c``): blocks of at
least 128 KiB (glibc's default mmap threshold) freed later go to a bounded cache and serve the next requests of
about their size.  Arrays outside fastattn's layers are not affected (NumPy
keeps the handler in a context variable); an array made by a layer keeps the
handler for its life, whoever frees it.

Also the public ops allocate through the cache: `scaled_dot_product_attention`,
`sdpa_backward`, `attention`, `attention_backward`, `linear`, `linear_backward`,
`rnn_scan`, `rnn_scan_backward`, `rnn_cell`, `rnn_cell_backward`,
`multi_head_attention`, `multi_head_attention_backward` and
`multi_head_attention_forward_backward` (and the backward it returns).

The cache holds at most :func:`set_memory_cache`'s limit (default 256 MiB,
or the ``FASTATTN_MEMORY_CACHE`` environment variable at import: bytes, or a
number with ``K``, ``M`` or ``G`` for KiB, MiB, GiB; ``0`` turns the handler
off); :func:`release_memory` frees what it holds, :func:`memory_cache_info`
reports it.
"""
from __future__ import annotations

import functools
import os
import re
import threading
import warnings

from . import _kernels, _memory

__all__ = ["set_memory_cache", "memory_cache_info", "release_memory"]

DEFAULT_LIMIT = 256 << 20
ENV = "FASTATTN_MEMORY_CACHE"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}

#: the C limit > 0, kept here so a layer call reads a global instead of calling C
_enabled = True


def _parse_limit(text):
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)(?:I?B)?\s*", text, re.IGNORECASE)
    if not m:
        return None
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def set_memory_cache(limit):
    """The most bytes fastattn keeps in freed large blocks for reuse by its
    layers (an int >= 0; 0: no cache, and the layers allocate through NumPy's
    default handler).  Lowering it frees the excess now.  Returns the
    previous limit."""
    global _enabled
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit: expected an int number of bytes, got {type(limit).__name__}")
    if limit < 0:
        raise ValueError(f"limit: expected a number of bytes >= 0, got {limit}")
    prev = _memory.limit()
    _memory.set_limit(limit)
    _enabled = limit > 0
    return prev


def memory_cache_info():
    """``{"limit", "cached_bytes", "cached_blocks", "hits", "misses"}``: the
    cache's limit, what it holds now, and how many large requests it served
    (hits) or passed on to malloc (misses) since the process started."""
    return _memory.stats()


def release_memory():
    """Free every block the cache holds (arrays in use are not affected)."""
    _memory.trim()


def _init_from_env():
    text = os.environ.get(ENV)
    if text is None or not text.strip():
        return
    limit = _parse_limit(text)
    if limit is None:
        warnings.warn(f"{ENV}={text!r}: expected a number of bytes (e.g. 0, 268435456, 256M); "
                      f"using the default {DEFAULT_LIMIT >> 20} MiB", RuntimeWarning, stacklevel=2)
        return
    set_memory_cache(limit)


_init_from_env()


_hold = _kernels.pool_hold


class _Depth(threading.local):
    depth = 0   # 1 while this thread runs a cached call (nested ones skip the set-up)


_local = _Depth()


def cached_method(fn, *, returns_backprop=False):
    """``fn`` running with the cache as NumPy's handler and a hold open on
    fastattn's worker pool (its idle workers spin up to 500 us between the
    call's kernels instead of 50 us: csrc/fa_pool.c); with
    ``returns_backprop``, a tuple result whose last item is callable gets that
    callable wrapped the same way."""
    if getattr(fn, "_fa_cached", False):
        return fn

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _local.depth:   # inside another such call on this thread: set up already
            res = fn(*args, **kwargs)
        else:
            prev = _memory.enter() if _enabled else None
            _hold(1)   # the pool's idle workers stay awake between this call's kernels
            _local.depth = 1
            try:
                res = fn(*args, **kwargs)
            finally:
                _local.depth = 0
                _hold(-1)
                _memory.exit(prev)
        if returns_backprop and type(res) is tuple and res and callable(res[-1]):
            res = res[:-1] + (cached_method(res[-1]),)   # the backprop, on the cache too
        return res
    wrapper._fa_cached = True
    return wrapper


def cached(fn):
    """Decorator: ``fn`` (a public op) allocates through the cache."""
    return cached_method(fn)


def cached_forward_backward(fn):
    """Decorator: ``fn`` returns ``(..., backward)``; both run on the cache."""
    return cached_method(fn, returns_backprop=True)
