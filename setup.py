"""Build the fastattn extension: C sources in csrc/, Cython bindings in fastattn/.

BLAS is not linked: the kernels call the gemm that scipy.linalg.cython_blas
exports, so SciPy's .pxd files are read at build time.  Threads are POSIX
threads (csrc/fa_pool.c explains why not OpenMP).  AVX2/FMA code is compiled
per function (target attributes) and selected at run time, so the baseline
stays portable.
"""
import os

import numpy as np
from Cython.Build import cythonize
from setuptools import Extension, setup

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

extensions = [
    Extension(
        "fastattn._kernels",
        sources=["fastattn/_kernels.pyx", "csrc/fa_sdpa.c", "csrc/fa_pool.c", "csrc/fa_simd.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
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
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives=CYTHON_DIRECTIVES))
