"""Build the example plugin's C extension against fastattn's plugin header.

The header is looked up, in order, in $FASTATTN_INCLUDE, in
fastattn.get_include() and in ../../csrc (this example inside a fastattn
checkout).
"""
import os

from setuptools import Extension, setup


def fastattn_include():
    env = os.environ.get("FASTATTN_INCLUDE")
    if env:
        return env
    try:
        import fastattn

        return fastattn.get_include()
    except Exception:
        pass
    here = os.path.dirname(os.path.abspath(__file__))
    return os.path.join(here, "..", "..", "csrc")


setup(
    ext_modules=[
        Extension(
            "fastattn_plugin_example._l1",
            sources=["src/fastattn_plugin_example/_l1.c"],
            include_dirs=[fastattn_include()],
            extra_compile_args=["-O3", "-std=c99"],
        )
    ]
)
