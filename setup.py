"""Build the fastattn extension: C sources in csrc/, Cython bindings in fastattn/.

BLAS is not linked: the kernels call the gemm that scipy.linalg.cython_blas
exports, so SciPy's .pxd files are read at build time.  OpenMP is enabled
when the compiler supports it; AVX2/FMA code is compiled per function
(target attributes) and selected at run time, so the baseline stays portable.
"""
import os
import sys

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


def openmp_flags():
    if os.environ.get("FASTATTN_NO_OPENMP"):
        return [], []
    if sys.platform == "darwin":
        return ["-Xpreprocessor", "-fopenmp"], ["-lomp"]
    if sys.platform == "win32":
        return ["/openmp"], []
    return ["-fopenmp"], ["-fopenmp"]


omp_compile, omp_link = openmp_flags()
extra_compile = ["-O3", "-std=c99", "-fno-math-errno"] + omp_compile
if sys.platform == "win32":
    extra_compile = ["/O2"] + omp_compile
extra_compile += os.environ.get("FASTATTN_EXTRA_CFLAGS", "").split()
extra_link = omp_link + os.environ.get("FASTATTN_EXTRA_LDFLAGS", "").split()

extensions = [
    Extension(
        "fastattn._kernels",
        sources=["fastattn/_kernels.pyx", "csrc/fa_sdpa.c", "csrc/fa_simd.c"],
        include_dirs=["csrc", np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_9_API_VERSION")],
        extra_compile_args=extra_compile,
        extra_link_args=extra_link,
    ),
]

setup(ext_modules=cythonize(extensions, compiler_directives=CYTHON_DIRECTIVES))
