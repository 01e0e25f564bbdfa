"""Thread-count policy for fastattn's kernels.

Precedence, highest first:

1. ``n_threads=`` given to a call;
2. the innermost active ``fastattn.threads(n)`` context (local to the thread
   or asyncio task that entered it, via :mod:`contextvars`);
3. ``fastattn.set_num_threads(n)`` (process-wide);
4. ``OMP_NUM_THREADS`` as it was when fastattn was imported (its first
   entry, if it is a positive integer) — the variable people already use
   to keep native libraries to a thread budget;
5. the number of CPUs this process may run on (its affinity mask).

The kernels run on fastattn's own worker pool, not an OpenMP runtime, so
``threadpoolctl`` limits do not change fastattn's thread count (use
``fastattn.threads(n)`` next to them).

While a call runs with more than one thread, the SciPy BLAS that the kernels
call is held at one thread so the two pools never oversubscribe the cores;
the previous BLAS setting is restored when the last concurrent call ends.
"""
from __future__ import annotations

import contextlib
import contextvars
import ctypes
import glob
import operator
import os
import threading

from . import _kernels

_global_threads: int | None = None
_context_threads: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "fastattn_threads", default=None
)
_blas_hook_done = False


def _env_threads() -> int | None:
    val = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    try:
        n = int(val)
    except ValueError:
        return None
    return n if n >= 1 else None



_blas_hook_library: str | None = None


def _check_count(n, name: str) -> int:
    if isinstance(n, bool):
        raise TypeError(f"{name}: expected a positive integer, got bool {n!r}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(
            f"{name}: expected a positive integer, got {type(n).__name__} {n!r}"
        ) from None
    if n < 1:
        raise ValueError(f"{name}: expected a positive integer (>= 1), got {n}")
    return n


def _affinity_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


# The default is fixed at import (like OpenMP runtimes read OMP_NUM_THREADS once).
_default_threads = _env_threads() or _affinity_count()


def get_num_threads() -> int:
    """Number of threads a call without ``n_threads`` would use right now."""
    n = _context_threads.get()
    if n is not None:
        return n
    if _global_threads is not None:
        return _global_threads
    return _default_threads


def set_num_threads(n: int | None) -> None:
    """Set the process-wide default thread count; ``None`` restores the default."""
    global _global_threads
    _global_threads = None if n is None else _check_count(n, "n")


@contextlib.contextmanager
def threads(n: int):
    """Use ``n`` threads for fastattn calls made inside the ``with`` block.

    The setting is local to the current thread (and asyncio task): other
    threads of the application keep their own.
    """
    token = _context_threads.set(_check_count(n, "n"))
    try:
        yield
    finally:
        _context_threads.reset(token)


def resolve(n_threads) -> int:
    """The thread count for one call (``n_threads`` validated when given)."""
    if n_threads is None:
        n = _context_threads.get()
        if n is not None:
            return n
        return _default_threads if _global_threads is None else _global_threads
    if type(n_threads) is int and n_threads >= 1:
        return n_threads
    return _check_count(n_threads, "n_threads")


def _blas_candidates():
    try:
        import scipy
    except ImportError:  # pragma: no cover - scipy is a dependency
        return []
    libs = os.path.join(os.path.dirname(os.path.dirname(scipy.__file__)), "scipy.libs")
    found = sorted(glob.glob(os.path.join(libs, "*openblas*")))
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if "openblas" in os.path.basename(path) and path not in found:
                    found.append(path)
    except OSError:
        pass
    return found


_blas_hook_lock = threading.Lock()


def ensure_blas_hook() -> None:
    """Hand the kernels a way to hold SciPy's OpenBLAS at one thread (once).

    The flag is set only after the hook is installed, under a lock, so a
    concurrent first call cannot run with half of it.
    """
    global _blas_hook_done, _blas_hook_library
    if _blas_hook_done:
        return
    with _blas_hook_lock:
        if _blas_hook_done:
            return
        for path in _blas_candidates():
            try:
                lib = ctypes.CDLL(path)
            except OSError:
                continue
            fn = None
            for sym in ("openblas_set_num_threads_local", "scipy_openblas_set_num_threads_local"):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    break
            if fn is not None:
                _kernels.set_blas_threads_hook(ctypes.cast(fn, ctypes.c_void_p).value)
                _blas_hook_library = path
                break
        _blas_hook_done = True


def blas_hook_library() -> str | None:
    """Path of the BLAS library whose thread count fastattn controls (None if none)."""
    ensure_blas_hook()
    return _blas_hook_library


def install_runtime(set_runtime, *, simd=True) -> bool:
    """Hand another compiled module (``_proj``, ``_rnn``, ``_scores``) this
    process's one worker pool, BLAS hold and, with ``simd``, SIMD switch:
    calls its ``set_runtime`` with :func:`kernel_runtime_addresses`.  Each op
    module calls this itself before its first kernel call (no module is
    imported for this side effect).  Safe to repeat (the same addresses).
    False when the symbols are not exported (the module keeps its own)."""
    addrs = kernel_runtime_addresses(simd=simd)
    if addrs is None:  # pragma: no cover - depends on the platform's loader
        return False
    set_runtime(*addrs)
    return True


def kernel_runtime_addresses(simd=True):
    """C addresses of fastattn._kernels' worker pool (``fa_pool_run``), BLAS hold
    (``fa_blas_threads_enter`` / ``_exit``) and, with ``simd``, its SIMD switch
    (``fa_simd_level``: 0 off, 1 AVX2, 2 AVX-512), for the other extensions' ``set_runtime`` (so that the
    process has one pool and one BLAS thread count); None when the symbols are
    not exported on this platform."""
    names = ("fa_pool_run", "fa_blas_threads_enter", "fa_blas_threads_exit")
    if simd:
        names += ("fa_simd_level",)
    try:
        lib = ctypes.CDLL(_kernels.__file__)
        return [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value for name in names]
    except (OSError, AttributeError):  # pragma: no cover - depends on the platform's loader
        return None


_installed = set()


def install_runtime_once(set_runtime, *, simd=True) -> bool:
    """:func:`install_runtime` the first time a module's ``set_runtime`` is
    seen in this process (the row-wise kernels' callers: one check per call)."""
    if set_runtime in _installed:
        return True
    ok = install_runtime(set_runtime, simd=simd)
    if ok:
        _installed.add(set_runtime)
    return ok
