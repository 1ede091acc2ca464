"""The C extensions: kvpool._layersum (per-layer checksums computed while copying),
kvpool._poll (a socket polled for bytes with the GIL released) and kvpool._index (the
master's key index probed for a batch of keys).

Optional: where they cannot be built (no C compiler, no Python headers) the install goes on
and kvpool computes the same checksums with xxhash in Python (kvpool.objformat), polls in
Python (kvpool.transport.tcp.stream) and probes the index with numpy
(kvpool.cluster.master.index). Everything else about the package is in pyproject.toml.
"""

from setuptools import Extension, setup

_FLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra", "-Wno-unused-parameter"]

setup(ext_modules=[
    Extension("kvpool._layersum", ["kvpool/_layersum.c"], optional=True, extra_compile_args=_FLAGS),
    Extension("kvpool._index", ["kvpool/_index.c"], optional=True, extra_compile_args=_FLAGS),
    Extension("kvpool._poll", ["kvpool/_poll.c"], optional=True, extra_compile_args=[*_FLAGS, "-D_GNU_SOURCE"]),
])
