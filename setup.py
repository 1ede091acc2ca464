"""The one C extension, kvpool._layersum (per-layer checksums computed while copying).

Optional: where it cannot be built (no C compiler, no Python headers) the install goes on
and kvpool computes the same checksums with xxhash in Python (kvpool.objformat).
Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvpool._layersum", ["kvpool/_layersum.c"], optional=True,
                             extra_compile_args=["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"])])
