"""Build the fastattn extension: C sources in csrc/, Cython bindings in fastattn/.

BLAS is not linked: the kernels call the gemm that scipy.linalg.cython_blas
exports, so SciPy's .pxd files are read at build time.  Threads are POSIX
threads (csrc/fa_pool.c explains why not OpenMP).  AVX2/FMA and AVX-512 code
is compiled per function (target attributes) and selected at run time, so the
baseline stays portable.
"""
import glob
import os
import threading
from collections import Counter

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.command.build_py import build_py as _build_py


class build_py(_build_py):
    """Also ship csrc/fastattn_plugin.h (the compiled-plugin ABI) as
    fastattn/include/fastattn_plugin.h, for fastattn.get_include()."""

    def run(self):
        super().run()
        dest = os.path.join(self.build_lib, "fastattn", "include")
        self.mkpath(dest)
        self.copy_file(os.path.join("csrc", "fastattn_plugin.h"), dest)


class build_ext(_build_ext):
    """``--parallel`` builds several extensions at once, and two extensions that
    list the same C file (csrc/fa_pool.c, fa_simd.c, fa_proj.c) compile it to the
    same object file under build_temp: one could link the object while the other
    was rewriting it (seen once: ``_kernels.so: undefined symbol: fa_simd_level``
    from the sanitizer build).  Those extensions take turns: each holds a lock
    per shared C file (taken in sorted order) while it compiles and links;
    extensions sharing nothing still build in parallel."""

    def build_extension(self, ext):
        locks = [_SOURCE_LOCKS[s] for s in sorted(set(ext.sources)) if s in _SOURCE_LOCKS]
        for lock in locks:
            lock.acquire()
        try:
            super().build_extension(ext)
        finally:
            for lock in reversed(locks):
                lock.release()


CYTHON_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
}

# No -ffast-math: masks rely on IEEE -inf and NaN must propagate.
extra_compile = ["-O3", "-std=c99", "-fno-math-errno", "-pthread"]
extra_link = ["-pthread"]
extra_compile += os.environ.get("FASTATTN_EXTRA_CFLAGS", "").split()
extra_link += os.environ.get("FASTATTN_EXTRA_LDFLAGS", "").split()

# Headers (csrc/*.h, included by the C sources) and shared Cython
# declarations: an edit to any of them rebuilds every extension (setuptools
# compares only the listed sources otherwise).
DEPENDS = sorted(glob.glob("csrc/*.h") + glob.glob("fastattn/*.pxd"))

extensions = [
    Extension(
        "fastattn._kernels",
        sources=["fastattn/_kernels.pyx", "csrc/fa_sdpa.c", "csrc/fa_pool.c", "csrc/fa_simd.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
    # Similarity kernels (fused additive / concat, compiled plugins); they run on
    # _kernels' worker pool and BLAS hold (addresses handed over at import).
    Extension(
        "fastattn._scores",
        sources=["fastattn/_scores.pyx", "csrc/fa_additive.c", "csrc/fa_pool.c", "csrc/fa_simd.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
    # Multi-head projections (Y = X W^T + b): Cython over cython_blas, plus a
    # few-row AVX2 kernel; it runs on _kernels' worker pool (addresses handed over).
    Extension(
        "fastattn._proj",
        sources=["fastattn/_proj.pyx", "csrc/fa_proj.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
    # The RNN layers' time loop (csrc/fa_rnn.c; fa_proj.c's few-row kernel for
    # h W_hh^T) and its backward (csrc/fa_rnn_bwd.c); runs on _kernels' worker
    # pool (addresses handed over).
    Extension(
        "fastattn._rnn",
        sources=["fastattn/_rnn.pyx", "csrc/fa_rnn.c", "csrc/fa_rnn_bwd.c", "csrc/fa_proj.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
    # The training ops' row-wise kernels (layer norm, dropout, masked
    # backward products; csrc/fa_rowwise.c); runs on _kernels' worker pool.
    Extension(
        "fastattn._rowwise",
        sources=["fastattn/_rowwise.pyx", "csrc/fa_rowwise.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
    # NumPy's data-memory handler over csrc/fa_cache.c's bounded block cache
    # (fastattn/_alloc.py switches it on around the layers).
    Extension(
        "fastattn._memory",
        sources=["fastattn/_memory.pyx", "csrc/fa_cache.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
        depends=DEPENDS,
    ),
]

# the C files that more than one extension compiles, each with its lock
_SHARED = Counter(src for ext in extensions for src in set(ext.sources) if src.endswith(".c"))
_SOURCE_LOCKS = {src: threading.Lock() for src, n in _SHARED.items() if n > 1}

setup(
    ext_modules=cythonize(extensions, compiler_directives=CYTHON_DIRECTIVES),
    cmdclass={"build_py": build_py, "build_ext": build_ext},
)
