"""The C extensions: kvpool._layersum (per-layer checksums computed while copying) and
kvpool._poll (a socket polled for bytes with the GIL released).

Optional: where they cannot be built (no C compiler, no Python headers) the install goes on
and kvpool computes the same checksums with xxhash in Python (kvpool.objformat) and polls in
Python (kvpool.transport.tcp.stream). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(ext_modules=[
    Extension("kvpool._layersum", ["kvpool/_layersum.c"], optional=True, extra_compile_args=_FLAGS),
    Extension("kvpool._poll", ["kvpool/_poll.c"], optional=True, extra_compile_args=[*_FLAGS, "-D_GNU_SOURCE"]),
])
