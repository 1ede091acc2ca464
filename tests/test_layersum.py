"""kvpool._layersum (per-layer xxh3-64 in C, optionally while copying) against xxhash itself,
and the Python path objformat takes where the extension is not built."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pytest
import xxhash

from kvpool import errors, objformat
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, copy_layer_checksums, layer_checksums


def reference(data: np.ndarray, step: int) -> tuple[int, ...]:
    mv = memoryview(data).cast("B")
    return tuple(xxhash.xxh3_64_intdigest(mv[i:i + step]) for i in range(0, len(mv), step))


@pytest.fixture
def native() -> Any:
    return pytest.importorskip("kvpool._layersum", reason="the C extension is not built here")


@pytest.fixture(params=["native", "python"])
def checksum_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """objformat computing its checksums with the C extension (skipped where it is not built),
    then with xxhash in Python (the path an install without a compiler takes)."""
    if request.param == "native":
        request.getfixturevalue("native")
    else:
        monkeypatch.setattr(objformat, "_NATIVE_MIN_STEP", 1 << 62)
    return str(request.param)


@pytest.fixture(params=["avx2", "portable"])
def variant(request: pytest.FixtureRequest, native: Any):
    try:
        before = native.use_variant(request.param)
    except ValueError:
        pytest.skip(f"this CPU has no {request.param}")
    yield request.param
    native.use_variant(before)


def test_digests_equal_xxhash_on_every_length_class(native: Any, variant: str) -> None:
    """Lengths around the block (1024) and stripe (64) edges and random ones, random bytes: the
    digests are xxhash's, hashed in place and as copied, and the copy is exact."""
    rng = np.random.default_rng(7)
    chooser = random.Random(7)
    edges = [241, 255, 256, 319, 320, 1023, 1024, 1025, 1087, 1088, 2047, 2048, 4096, 4097, 65536, 65599]
    steps = edges + [chooser.randint(native.MIN_STEP, 70_000) for _ in range(300)]
    for step in steps:
        count = chooser.randint(1, 3)
        src = rng.integers(0, 256, step * count, dtype=np.uint8)
        expected = reference(src, step)
        assert native.layer_digests(src, step) == expected, step
        dst = np.zeros_like(src)
        assert native.copy_layer_digests(dst, src, step) == expected, step
        assert np.array_equal(dst, src)


def test_large_object_and_flipped_bit(native: Any, variant: str) -> None:
    src = np.random.default_rng(1).integers(0, 256, 32 * (512 << 10), dtype=np.uint8)
    dst = np.empty_like(src)
    expected = reference(src, 512 << 10)
    assert native.copy_layer_digests(dst, src, 512 << 10) == expected
    src[5 * (512 << 10) + 77] ^= 1
    got = native.layer_digests(src, 512 << 10)
    assert [i for i, (a, b) in enumerate(zip(got, expected)) if a != b] == [5]


def test_bad_arguments_are_refused(native: Any) -> None:
    data = np.zeros(4096, np.uint8)
    with pytest.raises(ValueError, match="at least"):
        native.layer_digests(data, 128)
    with pytest.raises(ValueError, match="whole number"):
        native.layer_digests(data, 1000)
    with pytest.raises(ValueError, match="dst holds"):
        native.copy_layer_digests(np.zeros(2048, np.uint8), data, 1024)
    with pytest.raises(ValueError, match="overlap"):
        native.copy_layer_digests(data[1024:3072], data[:2048], 1024)
    with pytest.raises(TypeError):
        native.copy_layer_digests(bytes(4096), data, 1024)  # read-only dst


def test_spans_give_each_layer_of_each_span(native: Any, variant: str) -> None:
    """``copy_spans_digests`` with ``steps``: every span copied, every layer's digest in order
    (spans of different layer sizes in one call); without ``steps`` one digest a span."""
    rng = np.random.default_rng(5)
    srcs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (4096, 3 * 1000, 241)]
    steps = [1024, 1000, 241]
    dsts = [np.zeros_like(src) for src in srcs]
    expected = tuple(d for src, step in zip(srcs, steps) for d in reference(src, step))
    assert native.copy_spans_digests(dsts, srcs, steps) == expected
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert native.copy_spans_digests(dsts, srcs) == tuple(reference(src, len(src))[0] for src in srcs)
    with pytest.raises(ValueError, match="whole number"):
        native.copy_spans_digests(dsts, srcs, [1024, 1024, 241])
    with pytest.raises(ValueError, match="at least"):
        native.copy_spans_digests(dsts, srcs, [128, 1000, 241])
    with pytest.raises(ValueError, match="2 steps for 3 spans"):
        native.copy_spans_digests(dsts, srcs, [1024, 1000])


@pytest.mark.parametrize("nbytes", [64 << 10, 8 << 20])  # below and above the Python path's fused size
def test_both_paths_give_xxhash_checksums_of_the_copy(checksum_path: str, nbytes: int) -> None:
    step = nbytes // 16
    src = np.random.default_rng(3).integers(0, 256, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    assert copy_layer_checksums(memoryview(dst), memoryview(src), step) == reference(src, step)
    assert np.array_equal(dst, src)
    assert layer_checksums(src, step) == reference(src, step)


def test_copy_verified_names_the_bad_layer(checksum_path: str) -> None:
    spec = ObjectSpec("float16", 8, 16, 2, 64)  # 8 KiB layers
    payload = np.random.default_rng(5).integers(0, 256, spec.payload_nbytes, dtype=np.uint8)
    header = ObjectHeader.for_key(b"k", spec, layer_checksums(payload, spec.layer_nbytes))
    whole = LayerRange(0, 8)
    out = np.zeros_like(payload)
    header.copy_verified(whole, out, payload)
    assert np.array_equal(out, payload)
    part = LayerRange(2, 5)
    source = payload[2 * spec.layer_nbytes:5 * spec.layer_nbytes].copy()
    source[spec.layer_nbytes + 9] ^= 0xFF  # layer 3
    with pytest.raises(errors.ChecksumError, match="layer 3"):
        header.copy_verified(part, np.zeros_like(source), source)
    with pytest.raises(errors.OutBufferError):
        header.copy_verified(part, np.zeros(10, np.uint8), source)
    with pytest.raises(errors.OutBufferError, match="read-only"):
        header.copy_verified(part, bytes(source.nbytes), source)


def test_a_source_rewritten_during_the_copy_is_caught_or_copied_whole(checksum_path: str) -> None:
    """Another thread rewrites the source (the owner reusing an extent, in one process) while
    it is copied (the C copy runs without the GIL; numpy's copy in that thread releases it
    too): each verified copy either holds the version its header describes, exactly, or
    raises ChecksumError; never other bytes."""
    spec = ObjectSpec("float16", 8, 128, 2, 64)  # 64 KiB layers
    rng = np.random.default_rng(11)
    version_a = rng.integers(0, 256, spec.payload_nbytes, dtype=np.uint8)
    version_b = rng.integers(0, 256, spec.payload_nbytes, dtype=np.uint8)
    header = ObjectHeader.for_key(b"k", spec, layer_checksums(version_a, spec.layer_nbytes))
    source = version_a.copy()
    stop = threading.Event()

    def rewrite() -> None:
        while not stop.is_set():
            np.copyto(source, version_b)
            np.copyto(source, version_a)

    writer = threading.Thread(target=rewrite, daemon=True)
    writer.start()
    caught = whole = 0
    out = np.empty_like(source)
    try:
        for _ in range(400):
            try:
                header.copy_verified(LayerRange(0, 8), out, source)
            except errors.ChecksumError:
                caught += 1
                continue
            assert np.array_equal(out, version_a), "a verified copy returned other bytes"
            whole += 1
    finally:
        stop.set()
        writer.join(5)
    print(f"{caught} copies caught mid-rewrite, {whole} whole")  # (both kinds happen here)


WITHOUT_EXTENSIONS = """
import importlib.abc, sys
class NotBuilt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ("kvpool._layersum", "kvpool._poll", "kvpool._index"):
            raise ImportError(f"no module named {name!r} (blocked by the test)")
        return None
sys.meta_path.insert(0, NotBuilt())
import numpy as np
import kvpool.objformat, kvpool.transport.tcp.stream, kvpool.cluster.master.index
from kvpool.objformat import decode, encode
arr = np.arange(2 * 2 * 4 * 1 * 8, dtype=np.float32).reshape(2, 2, 4, 1, 8)
assert (decode(encode(arr, b"k"))[1] == arr).all()  # the Python fallbacks give the same bytes
from kvpool.native import extension
print("fallback", extension("_layersum"), extension("_poll"), extension("_index"))
"""


def test_a_process_without_the_c_extensions_says_so_once() -> None:
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    done = subprocess.run([sys.executable, "-c", WITHOUT_EXTENSIONS], capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "fallback None None None"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert all(f"kvpool.{name}" in lines[0] for name in ("_layersum", "_poll", "_index"))
    assert "pip install -e ." in lines[0]
    from kvpool.native import extension

    if all(extension(name) is not None for name in ("_layersum", "_poll", "_index")):  # built here: not a word
        built = subprocess.run([sys.executable, "-c", "import kvpool.objformat, kvpool.transport.tcp.stream, "
                                "kvpool.cluster.master.index"],
                               capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
        assert built.returncode == 0 and built.stderr == ""
