"""The nvme tier on real files: conformance, restart, kill -9, corruption, full disk.

Everything runs against real segment files, a real LMDB index and real
O_DIRECT I/O on the disk under pytest's tmp_path (checked not to be tmpfs).
The full-disk cases are real too: RLIMIT_FSIZE makes the kernel refuse writes
and fallocate past a size with EFBIG, and (as root) a tiny tmpfs mount runs out
of space with ENOSPC.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import queue
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import lmdb
import msgspec
import numpy as np
import pytest

from kvpool import errors
from kvpool.config import Config
from kvpool.objformat import LayerRange, ObjectHeader, byte_view, layer_checksums, spec_of
from kvpool.testing import TierTests, make_object, store
from tiers.base import Extent
from tiers.nvme import NvmeTier
from tiers.nvme.fs import filesystem_type
from tiers.nvme.layout import ALIGN, INDEX_DIR, MEMORY_FILESYSTEMS

REPO_ROOT = Path(__file__).resolve().parents[2]
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def disk_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory on a real disk (so O_DIRECT is exercised), never tmpfs."""
    if filesystem_type(tmp_path) not in MEMORY_FILESYSTEMS:
        yield tmp_path / "nvme"
        return
    base = Path(tempfile.mkdtemp(prefix="kvpool-nvme-test-", dir="/var/tmp"))
    try:
        yield base / "nvme"
    finally:
        shutil.rmtree(base, ignore_errors=True)


def read_all(tier: NvmeTier, extent: Extent, header: ObjectHeader) -> np.ndarray:
    from kvpool.objformat import numpy_dtype

    out = np.empty(header.spec.array_shape(), dtype=numpy_dtype(header.spec.dtype))
    tier.read_layers(extent, header, LayerRange(0, header.spec.layers), byte_view(out))
    return out


def keyed_object(key: bytes, seed: int = 0, **shape: int) -> tuple[np.ndarray, ObjectHeader, memoryview]:
    """make_object, with a header naming ``key`` (commit checks the header's key digest)."""
    arr, header, payload = make_object(seed=seed, **shape)
    return arr, ObjectHeader.for_key(key, header.spec, header.layer_checksums), payload


def put(tier: NvmeTier, key: bytes, seed: int, **shape: int) -> tuple[Extent, np.ndarray]:
    arr, header, payload = keyed_object(key, seed=seed, **shape)
    extent = store(tier, header, payload)
    tier.commit(key, extent, header)
    return extent, arr


def aligned_buffer(nbytes: int) -> np.ndarray:
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


# -- conformance ----------------------------------------------------------------


class TestNvmeTier(TierTests):
    def make_tier(self, tmp_path, capacity_bytes):
        # One segment (the suite allocates the whole capacity at once); small
        # io_chunk so the suite's objects go through the parallel I/O path.
        return NvmeTier(tmp_path / "nvme", capacity_bytes, segment_size=capacity_bytes, io_chunk=16 * KiB)


# -- I/O paths ----------------------------------------------------------------------


def test_o_direct_is_used_on_a_disk(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        stats = tier.stats()
        assert stats["direct_io"] is True, stats["direct_io_reason"]
        assert stats["path"] == str(disk_dir)
        assert stats["fsync"] is False
    finally:
        tier.close()
    tier = NvmeTier(disk_dir, 4 * MiB, direct_io="off")
    try:
        assert tier.stats()["direct_io"] is False
    finally:
        tier.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_large_object_split_across_threads_and_unaligned_access(disk_dir: Path, direct_io: str) -> None:
    tier = NvmeTier(disk_dir, 64 * MiB, segment_size=32 * MiB, direct_io=direct_io, io_chunk=1 * MiB)
    try:
        arr, header, payload = make_object(layers=8, tokens=8192, seed=3)  # 16 MiB
        extent = store(tier, header, payload)
        np.testing.assert_array_equal(read_all(tier, extent, header), arr)
        blob = header.pack() + bytes(payload)
        # Unaligned offsets and lengths, crossing chunk boundaries, into unaligned buffers.
        for offset, nbytes in ((1, 100), (4095, 2), (MiB - 7, 3 * MiB + 11), (len(blob) - 5000, 5000)):
            out = bytearray(nbytes)
            tier.read_into(extent, offset, out)
            assert out == blob[offset:offset + nbytes]
        # Aligned offset, length and buffer: read straight into `out`.
        out_aligned = aligned_buffer(4 * MiB)
        tier.read_into(extent, 0, out_aligned)
        assert out_aligned.tobytes() == blob[:4 * MiB]
        # A partial write keeps the neighbouring bytes of its edge blocks.
        patch = bytes(range(256)) * 40
        tier.write(extent, 4000, patch)
        out = bytearray(5 * ALIGN)
        tier.read_into(extent, 0, out)
        expected = bytearray(blob[:5 * ALIGN])
        expected[4000:4000 + len(patch)] = patch
        assert out == expected
        with pytest.raises(errors.TierError):
            tier.read_into(extent, len(blob) - 10, bytearray(11))
        with pytest.raises(errors.OutBufferError):
            tier.read_into(extent, 0, bytes(10))
    finally:
        tier.close()


@pytest.mark.parametrize("direct_io", ["auto", "off"])
def test_any_read_or_write_range_matches_a_byte_model(disk_dir: Path, direct_io: str) -> None:
    """Reads and partial writes at arbitrary offsets, lengths and buffer alignments."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    tier = NvmeTier(disk_dir, 4 * MiB, direct_io=direct_io, io_chunk=8 * KiB)
    try:
        _, header, payload = make_object(layers=3, tokens=100, seed=8)  # not a multiple of 4 KiB
        extent = store(tier, header, payload)
        model = bytearray(header.pack() + bytes(payload))
        size = len(model)
        arena = aligned_buffer(size + 2 * ALIGN)

        @settings(max_examples=60, deadline=None, derandomize=True)
        @given(st.data())
        def check(data: st.DataObject) -> None:
            offset = data.draw(st.integers(0, size - 1))
            nbytes = data.draw(st.integers(1, size - offset))
            shift = data.draw(st.sampled_from([0, 0, 1, 64, 513, ALIGN - 1]))
            if data.draw(st.booleans()):
                patch = data.draw(st.binary(min_size=nbytes, max_size=nbytes))
                tier.write(extent, offset, patch)
                model[offset:offset + nbytes] = patch
            out = arena[shift:shift + nbytes]
            tier.read_into(extent, offset, out)
            assert out.tobytes() == model[offset:offset + nbytes]

        check()
        whole = bytearray(size)
        tier.read_into(extent, 0, whole)
        assert whole == model  # no write disturbed bytes outside its range
    finally:
        tier.close()


# -- persistence ------------------------------------------------------------------------


def test_reopen_finds_every_committed_object_bit_exact(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB, io_chunk=64 * KiB)
    shapes = [dict(layers=4, tokens=t) for t in (64, 512, 700, 1000, 96)]
    originals = {}
    try:
        for seed, shape in enumerate(shapes):
            originals[b"key-%d" % seed] = put(tier, b"key-%d" % seed, seed, **shape)
        # Written but never committed: must not exist after the restart.
        _, header, payload = make_object(seed=99, layers=4, tokens=300)
        store(tier, header, payload)
        # Forgotten and freed: gone too.
        gone_extent, _ = originals.pop(b"key-1")
        tier.forget(b"key-1", gone_extent)
        tier.free(gone_extent)
        used = sum(tier.allocated_size(extent.nbytes) for extent, _ in originals.values())
        segments = tier.stats()["segments_created"]
        assert segments >= 2  # objects really spread over several segment files
    finally:
        tier.close()
    tier.close()  # idempotent

    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)
    try:
        recovered = {key: (extent, header) for key, extent, header in tier.recover()}
        assert set(recovered) == set(originals)
        for key, (extent, header) in recovered.items():
            assert extent == originals[key][0]
            np.testing.assert_array_equal(read_all(tier, extent, header), originals[key][1])
        assert tier.used_bytes == used
        stats = tier.stats()
        assert stats["recovered_objects"] == len(originals) == stats["indexed_objects"]
        assert stats["segments_created"] == segments
    finally:
        tier.close()


def test_reopen_with_a_smaller_capacity_keeps_what_fits_and_nothing_else_ever_returns(
        disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Restarted with a smaller capacity: the objects within it are read bit-exact, the index is
    trusted (no rescan), the ones past it are misses, and their space is given back (segment
    files past the capacity removed, the last one cut to its share). Raised again afterwards,
    even a rescan of the segments never brings a dropped object back."""
    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB, io_chunk=64 * KiB)
    originals = {}
    try:
        for seed in range(12):  # ~300 KiB each: three to a segment, four segments
            originals[b"key-%d" % seed] = put(tier, b"key-%d" % seed, seed, layers=4, tokens=300)
        assert tier.stats()["segments_created"] == 4
    finally:
        tier.close()
    smaller = 2 * MiB + 512 * KiB  # two segments and half of the third
    kept = {key: found for key, found in originals.items()
            if found[0].segment < 2 or found[0].segment == 2
            and found[0].offset + tier.allocated_size(found[0].nbytes) <= 512 * KiB}
    assert 6 <= len(kept) < len(originals)
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(disk_dir, smaller, segment_size=1 * MiB)
    try:
        recovered = {key: (extent, header) for key, extent, header in tier.recover()}
        assert set(recovered) == set(kept)
        for key, (extent, header) in recovered.items():
            np.testing.assert_array_equal(read_all(tier, extent, header), kept[key][1])
        stats = tier.stats()
        assert stats["index_rebuilt"] == ""  # not a damaged index
        assert stats["dropped_records"] == len(originals) - len(kept)
        assert sorted(p.name for p in disk_dir.glob("seg-*.kvs")) == [f"seg-{i:05d}.kvs" for i in range(3)]
        assert (disk_dir / "seg-00002.kvs").stat().st_size == 512 * KiB
        assert any(f"dropped {len(originals) - len(kept)} objects stored beyond" in r.message for r in caplog.records)
        put(tier, b"while-small", seed=40, layers=4, tokens=100)
    finally:
        tier.close()
    expected = set(kept) | {b"while-small"}
    for rescan in (False, True):
        if rescan:
            shutil.rmtree(disk_dir / INDEX_DIR)
        tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)
        try:
            assert {key for key, _, _ in tier.recover()} == expected
            assert ("missing" in tier.stats()["index_rebuilt"]) == rescan
            for seed in range(6):  # the space past the cut is usable again
                put(tier, b"after-%d-%d" % (rescan, seed), seed=41 + seed, layers=4, tokens=300)
                expected.add(b"after-%d-%d" % (rescan, seed))
        finally:
            tier.close()


def test_reopen_reads_nearby_prefixes_together_and_still_checks_each(disk_dir: Path) -> None:
    """Opening reads the record prefixes of neighbouring objects in one window; every prefix
    in the window is still compared with its index record: one damaged in the middle of a
    window is found (the index is rebuilt from the segments) and costs only that object."""
    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=4 * MiB)
    objects = {}
    try:
        for i in range(120):  # small objects: ~12 KiB apart, hundreds of prefixes per window
            objects[b"small-%03d" % i] = put(tier, b"small-%03d" % i, i, layers=2, tokens=8)
        objects[b"big"] = put(tier, b"big", 999, layers=4, tokens=2000)  # a gap of ~2 MiB to the next
        objects[b"after-big"] = put(tier, b"after-big", 1000, layers=2, tokens=8)
    finally:
        tier.close()
    reopened = NvmeTier(disk_dir, 8 * MiB, segment_size=4 * MiB)
    try:
        recovered = {key: (extent, header) for key, extent, header in reopened.recover()}
        assert set(recovered) == set(objects) and not reopened.stats()["index_rebuilt"]
        for key, (extent, header) in recovered.items():
            np.testing.assert_array_equal(read_all(reopened, extent, header), objects[key][1])
    finally:
        reopened.close()
    damaged_extent = objects[b"small-060"][0]
    segment = disk_dir / sorted(p.name for p in disk_dir.iterdir() if p.name.startswith("seg"))[damaged_extent.segment]
    with open(segment, "r+b") as fh:  # one byte of that record's prefix block (its magic)
        fh.seek(damaged_extent.offset - ALIGN)
        first = fh.read(1)
        fh.seek(damaged_extent.offset - ALIGN)
        fh.write(bytes([first[0] ^ 0xFF]))
    rebuilt = NvmeTier(disk_dir, 8 * MiB, segment_size=4 * MiB)
    try:
        recovered = {key: (extent, header) for key, extent, header in rebuilt.recover()}
        assert "disagree" in rebuilt.stats()["index_rebuilt"]
        assert set(recovered) == set(objects) - {b"small-060"}
        for key, (extent, header) in recovered.items():
            np.testing.assert_array_equal(read_all(rebuilt, extent, header), objects[key][1])
    finally:
        rebuilt.close()


def test_space_is_rebuilt_from_the_index_and_reused_after_reopen(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 2 * MiB, segment_size=1 * MiB)
    try:
        _, header, _ = make_object(layers=4, tokens=256)
        keys = []
        while (extent := tier.allocate(header.spec.total_nbytes)) is not None:
            _, h, p = keyed_object(b"k%d" % len(keys), layers=4, tokens=256, seed=len(keys))
            tier.write_object(extent, h, p)
            tier.commit(b"k%d" % len(keys), extent, h)
            keys.append(b"k%d" % len(keys))
        assert tier.allocate(header.spec.total_nbytes) is None
    finally:
        tier.close()

    tier = NvmeTier(disk_dir, 2 * MiB, segment_size=1 * MiB)
    try:
        found = {key: extent for key, extent, _ in tier.recover()}
        assert sorted(found) == sorted(keys)
        assert tier.allocate(header.spec.total_nbytes) is None  # the allocator knows it is full
        victim = found[keys[3]]
        tier.forget(keys[3], victim)
        tier.free(victim)
        reused = tier.allocate(header.spec.total_nbytes)
        assert reused is not None and (reused.segment, reused.offset) == (victim.segment, victim.offset)
        arr, h, p = keyed_object(b"new", layers=4, tokens=256, seed=1000)
        tier.write_object(reused, h, p)
        tier.commit(b"new", reused, h)
    finally:
        tier.close()

    tier = NvmeTier(disk_dir, 2 * MiB, segment_size=1 * MiB)
    try:
        found_headers = {key: (extent, header) for key, extent, header in tier.recover()}
        assert keys[3] not in found_headers
        np.testing.assert_array_equal(read_all(tier, *found_headers[b"new"]), arr)
    finally:
        tier.close()


def test_forget_keeps_a_newer_commit_of_the_same_key(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        old, _ = put(tier, b"k", seed=1)
        new, arr = put(tier, b"k", seed=2)
        tier.forget(b"k", old)  # the manager retiring the old copy must not delete the new record
        tier.free(old)
    finally:
        tier.close()
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        [(key, extent, header)] = list(tier.recover())
        assert (key, extent) == (b"k", new)
        np.testing.assert_array_equal(read_all(tier, extent, header), arr)
    finally:
        tier.close()


def test_bad_index_records_are_dropped_and_logged(disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        good, arr = put(tier, b"good", seed=1)
        _, header, _ = keyed_object(b"good", seed=1)
    finally:
        tier.close()
    env = lmdb.open(str(disk_dir / INDEX_DIR), max_dbs=2, subdir=True)
    try:
        db = env.open_db(b"objects")
        with env.begin(write=True, db=db) as txn:
            txn.put(b"garbage", b"\xc1 not msgpack")
            txn.put(b"overlap", msgspec.msgpack.encode([good.segment, good.offset, good.nbytes, header.pack()]))
            txn.put(b"beyond", msgspec.msgpack.encode([7, 0, good.nbytes, header.pack()]))
            txn.put(b"bad-header", msgspec.msgpack.encode([0, 1 * MiB, good.nbytes, b"KVPL" + bytes(60)]))
    finally:
        env.close()
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        assert [key for key, _, _ in tier.recover()] == [b"good"]
        assert tier.stats()["dropped_records"] == 4
        assert tier.used_bytes == tier.allocated_size(good.nbytes)
        assert sum("dropped index record" in r.message for r in caplog.records) == 4
        assert "disagree" in tier.stats()["index_rebuilt"]  # then rebuilt from the segments
        np.testing.assert_array_equal(read_all(tier, good, header), arr)
    finally:
        tier.close()


def _fill(directory: Path, count: int = 8, **kwargs: int) -> dict[bytes, np.ndarray]:
    """A closed tier holding ``count`` committed objects of mixed sizes over several segments."""
    tier = NvmeTier(directory, 8 * MiB, segment_size=1 * MiB, **kwargs)
    arrays = {}
    try:
        for seed in range(count):
            key = b"key-%d" % seed
            arrays[key] = put(tier, key, seed, layers=4, tokens=64 * (1 + seed % 5))[1]
    finally:
        tier.close()
    return arrays


def _check_all(tier: NvmeTier, arrays: dict[bytes, np.ndarray], *, all_back: bool = True) -> None:
    """Every recovered object is bit-exact (or a checksum miss); with all_back, all of them came back."""
    recovered = {key: (extent, header) for key, extent, header in tier.recover()}
    assert set(recovered) <= set(arrays)
    if all_back:
        assert set(recovered) == set(arrays)
    for key, (extent, header) in recovered.items():
        try:
            np.testing.assert_array_equal(read_all(tier, extent, header), arrays[key])
        except errors.ChecksumError:
            assert not all_back


def test_deleted_index_is_rebuilt_from_the_segments_bit_exact(disk_dir: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    arrays = _fill(disk_dir)
    shutil.rmtree(disk_dir / INDEX_DIR)
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)
    try:
        _check_all(tier, arrays)
        assert tier.stats()["recovered_objects"] == len(arrays) == tier.stats()["indexed_objects"]
        assert "missing" in tier.stats()["index_rebuilt"]
        assert any(str(disk_dir / INDEX_DIR) in r.message for r in caplog.records)
        [counts] = [r.message for r in caplog.records if "index rebuilt" in r.message]
        assert f"recovered {len(arrays)} objects, dropped 0 records" in counts
        put(tier, b"after", seed=50)  # the rebuilt allocator knows what is taken
    finally:
        tier.close()
    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)  # and the rebuilt index is used as is
    try:
        assert tier.stats()["index_rebuilt"] == ""
        assert len(list(tier.recover())) == len(arrays) + 1
    finally:
        tier.close()


@pytest.mark.parametrize("damage", ["garbage-file", "garbage-data", "empty-data", "truncated", "no-data"])
def test_unusable_index_is_moved_aside_and_rebuilt(disk_dir: Path, damage: str,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    arrays = _fill(disk_dir, count=5)
    index = disk_dir / INDEX_DIR
    data = index / "data.mdb"
    if damage == "garbage-file":
        shutil.rmtree(index)
        index.write_bytes(os.urandom(10_000))
    elif damage == "garbage-data":
        data.write_bytes(os.urandom(data.stat().st_size))
    elif damage == "empty-data":
        data.write_bytes(b"")
    elif damage == "truncated":
        # LMDB's map is larger than the file: reading the lost pages would be SIGBUS, not an error.
        os.truncate(data, data.stat().st_size // 2)
    else:
        data.unlink()
    with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
        tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)
    try:
        _check_all(tier, arrays)
        assert tier.stats()["index_rebuilt"]
        assert (disk_dir / "index.corrupt").exists()
        assert any(str(index) in r.message and r.levelno == logging.WARNING for r in caplog.records)
    finally:
        tier.close()


def _flip_trial(directory: str, seed: int) -> None:
    """Child: flip random bytes of the LMDB file, open, read everything (exit code tells)."""
    import random as random_module

    arrays = {b"key-%d" % s: put_args_array(s) for s in range(8)}
    rnd = random_module.Random(seed)
    data = Path(directory) / INDEX_DIR / "data.mdb"
    blob = bytearray(data.read_bytes())
    for _ in range(rnd.choice([1, 2, 4, 16, 64])):
        # Half the flips land in the pages LMDB uses most (metas, roots), half anywhere.
        at = rnd.randrange(3 * 4096 if rnd.random() < 0.5 else len(blob)) % len(blob)
        blob[at] ^= 1 << rnd.randrange(8)
    if rnd.random() < 0.2:  # and sometimes the file is cut short too
        del blob[rnd.randrange(len(blob)):]
    data.write_bytes(bytes(blob))
    tier = NvmeTier(directory, 8 * MiB, segment_size=1 * MiB)
    try:
        _check_all(tier, arrays)
    finally:
        tier.close()


def put_args_array(seed: int) -> np.ndarray:
    return make_object(seed=seed, layers=4, tokens=64 * (1 + seed % 5))[0]


@pytest.mark.slow
def test_random_flips_in_the_lmdb_file_never_crash_and_lose_nothing(tmp_path: Path) -> None:
    """Seeded byte flips in data.mdb; each trial opens in a child so a SIGBUS would show, not kill pytest."""
    template = tmp_path / "template"
    _fill(template)
    script = textwrap.dedent("""
        import sys
        from tests.tiers.test_nvme import _flip_trial
        for arg in sys.argv[2:]:
            directory = f"{sys.argv[1]}/{arg}"
            _flip_trial(directory, int(arg))
            print("ok", arg, flush=True)
    """)
    trials = [str(seed) for seed in range(20)]
    for seed in trials:
        shutil.copytree(template, tmp_path / seed)
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path), *trials], cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}"
                                                             f"{os.environ.get('PYTHONPATH', '')}"})
    assert result.returncode == 0, (result.returncode, result.stdout[-500:], result.stderr[-3000:])
    assert result.stdout.split() == [w for seed in trials for w in ("ok", seed)]


def test_forgotten_key_does_not_come_back_from_a_rescan(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        gone, _ = put(tier, b"gone", seed=1)
        kept, arr = put(tier, b"kept", seed=2)
        tier.forget(b"gone", gone)
        tier.free(gone)
    finally:
        tier.close()
    shutil.rmtree(disk_dir / INDEX_DIR)
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        assert [key for key, _, _ in tier.recover()] == [b"kept"]
        assert tier.used_bytes == tier.allocated_size(kept.nbytes)
        np.testing.assert_array_equal(read_all(tier, kept, tier_header(tier, b"kept")), arr)
    finally:
        tier.close()


def test_newest_generation_wins_in_a_rescan(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        # Two live records of one key on disk (as a crash between the new
        # record's commit and the old one's tombstone would leave them).
        old, _ = put(tier, b"k", seed=1)
        saved = bytearray(ALIGN)
        with open(disk_dir / "seg-00000.kvs", "rb") as f:
            f.seek(old.offset - ALIGN)
            saved[:] = f.read(ALIGN)
        new, arr = put(tier, b"k", seed=2)
        with open(disk_dir / "seg-00000.kvs", "r+b") as f:  # undo the tombstone commit wrote
            f.seek(old.offset - ALIGN)
            f.write(saved)
    finally:
        tier.close()
    shutil.rmtree(disk_dir / INDEX_DIR)
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        [(key, extent, header)] = list(tier.recover())
        assert (key, extent) == (b"k", new)
        np.testing.assert_array_equal(read_all(tier, extent, header), arr)
        assert tier.stats()["dropped_records"] == 1  # the superseded record, now tombstoned
    finally:
        tier.close()
    shutil.rmtree(disk_dir / INDEX_DIR)
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        assert [key for key, _, _ in tier.recover()] == [b"k"]
        assert tier.stats()["dropped_records"] == 0  # the loser stays dead
    finally:
        tier.close()


def test_torn_write_is_absent_after_a_rescan(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        kept, arr = put(tier, b"kept", seed=1)
        torn, _ = put(tier, b"torn", seed=2, layers=4, tokens=256)
        _, header, payload = keyed_object(b"uncommitted", seed=3)
        store(tier, header, payload)  # written, never committed
    finally:
        tier.close()
    with open(disk_dir / "seg-00000.kvs", "r+b") as f:  # the tail of "torn" never reached the disk
        f.seek(torn.offset + torn.nbytes - 5000)
        f.write(bytes(5000))
    shutil.rmtree(disk_dir / INDEX_DIR)
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        assert [key for key, _, _ in tier.recover()] == [b"kept"]
        assert tier.stats()["dropped_records"] == 1
        np.testing.assert_array_equal(read_all(tier, kept, tier_header(tier, b"kept")), arr)
    finally:
        tier.close()


def test_index_record_disagreeing_with_its_segment_triggers_a_rescan(disk_dir: Path) -> None:
    arrays = _fill(disk_dir, count=4)
    env = lmdb.open(str(disk_dir / INDEX_DIR), max_dbs=2, subdir=True)
    try:
        db = env.open_db(b"objects")
        with env.begin(write=True, db=db) as txn:  # a key flipped in the index: the record is lost under it
            raw = txn.pop(b"key-2")
            txn.put(b"kez-2", raw)
    finally:
        env.close()
    tier = NvmeTier(disk_dir, 8 * MiB, segment_size=1 * MiB)
    try:
        _check_all(tier, arrays)  # key-2 came back under its real key, from its record prefix
        assert "disagree" in tier.stats()["index_rebuilt"]
    finally:
        tier.close()


def test_segment_truncated_under_a_running_tier_is_a_miss(disk_dir: Path) -> None:
    from kvpool.pool import Pool

    config = {"pool": {"data_dir": str(disk_dir / "data")},
              "tiers": {"hbm": {"capacity": 0}, "dram": {"capacity": 0}, "cxl": {"capacity": 0},
                        "nvme": {"capacity": "4MiB", "segment_size": "4MiB", "path": str(disk_dir)}}}
    try:
        pool = Pool(config)
    except errors.ConfigError as exc:  # pragma: no cover - the config schema moved
        pytest.skip(f"cannot build an nvme-only pool here: {exc}")
    try:
        arr = put_args_array(3)
        pool.put(b"k", arr)
        os.truncate(disk_dir / "seg-00000.kvs", 3 * ALIGN)  # cut inside the record
        tier = pool.manager.tiers[-1]
        [(_, extent, header)] = [(k, e, h) for k, t, e, h in pool.manager.snapshot()]
        with pytest.raises(errors.ChecksumError):
            read_all(tier, extent, header)
        with pytest.raises(errors.ChecksumError):
            tier.read_into(extent, 0, bytearray(extent.nbytes))
        assert pool.get(b"k") is None  # a miss, not an exception
        assert pool.get(b"k") is None  # and it stays one
    finally:
        pool.close()


def test_iter_layers_over_a_layer_rotten_on_disk_raises_and_drops_the_object(disk_dir: Path) -> None:
    import asyncio

    from kvpool.pool import Pool

    config = {"pool": {"data_dir": str(disk_dir / "data")},
              "tiers": {"hbm": {"capacity": 0}, "dram": {"capacity": 0}, "cxl": {"capacity": 0},
                        "nvme": {"capacity": "4MiB", "segment_size": "4MiB", "path": str(disk_dir)}}}
    pool = Pool(config)
    try:
        arr = put_args_array(3)
        pool.put(b"k", arr)
        segment = disk_dir / "seg-00000.kvs"
        data = bytearray(segment.read_bytes())
        at = data.find(arr[-1].tobytes())  # the last layer's bytes, wherever the record put them
        assert at > 0
        data[at + 7] ^= 0xFF
        segment.write_bytes(data)
        seen: list[int] = []

        async def read() -> None:
            async for layer, layer_arr in pool.iter_layers(b"k"):
                np.testing.assert_array_equal(layer_arr, arr[layer])
                seen.append(layer)

        with pytest.raises(errors.ChecksumError):  # earlier layers were handed out: not a silent miss
            asyncio.run(read())
        assert seen == list(range(arr.shape[0] - 1))
        assert not pool.exists(b"k") and pool.get(b"k") is None  # dropped at once, not served again
    finally:
        pool.close()


def test_files_are_private(disk_dir: Path) -> None:
    import stat as stat_module

    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        put(tier, b"k", seed=1)
    finally:
        tier.close()
    assert stat_module.S_IMODE(os.stat(disk_dir).st_mode) == 0o700
    assert stat_module.S_IMODE(os.stat(disk_dir / INDEX_DIR).st_mode) == 0o700
    for name in ("LOCK", "seg-00000.kvs", f"{INDEX_DIR}/data.mdb"):
        assert stat_module.S_IMODE(os.stat(disk_dir / name).st_mode) == 0o600, name
    os.chmod(disk_dir / "seg-00000.kvs", 0o644)  # left by an older build: tightened at open
    NvmeTier(disk_dir, 4 * MiB).close()
    assert stat_module.S_IMODE(os.stat(disk_dir / "seg-00000.kvs").st_mode) == 0o600


def test_the_data_dir_it_creates_is_private_too(tmp_path: Path) -> None:
    import stat as stat_module

    os.chmod(tmp_path, 0o755)
    old_umask = os.umask(0o022)
    try:
        NvmeTier(tmp_path / "data" / "pool" / "nvme", 4 * MiB).close()
    finally:
        os.umask(old_umask)
    for folder in ("data", "data/pool", "data/pool/nvme"):
        assert stat_module.S_IMODE(os.stat(tmp_path / folder).st_mode) == 0o700, folder
    assert stat_module.S_IMODE(os.stat(tmp_path).st_mode) == 0o755  # what existed is left alone


def test_other_segment_size_on_an_existing_directory_is_refused(disk_dir: Path) -> None:
    NvmeTier(disk_dir, 4 * MiB, segment_size=1 * MiB).close()
    with pytest.raises(errors.TierError, match="segment_size=1048576"):
        NvmeTier(disk_dir, 4 * MiB, segment_size=2 * MiB)
    NvmeTier(disk_dir, 4 * MiB, segment_size=1 * MiB).close()  # the refused open released the lock


def test_overlong_key_is_refused(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        arr, header, payload = make_object()
        extent = store(tier, header, payload)
        with pytest.raises(errors.InvalidKeyError):
            tier.commit(b"x" * 4096, extent, header)
    finally:
        tier.close()


# -- crashes ---------------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import sys
    from tests.tiers.test_nvme import crash_object, crash_seed
    from tiers.nvme import NvmeTier

    tier = NvmeTier(sys.argv[1], 24 << 20, segment_size=8 << 20, io_chunk=512 << 10)
    live = sorted(((key, extent) for key, extent, _ in tier.recover()), key=lambda item: crash_seed(item[0]))
    seed = int(sys.argv[2])
    while True:
        arr, header, payload = crash_object(seed)
        extent = tier.allocate(header.spec.total_nbytes)
        while extent is None:  # full: retire the oldest, so new objects overwrite freed space
            key, old = live.pop(0)
            print("deleting", key.decode(), flush=True)
            tier.forget(key, old)
            tier.free(old)
            extent = tier.allocate(header.spec.total_nbytes)
        key = b"obj-%d" % seed
        print("writing", key.decode(), flush=True)
        tier.write_object(extent, header, payload)
        tier.commit(key, extent, header)
        live.append((key, extent))
        print("committed", key.decode(), flush=True)
        seed += 1
    """
)
_CRASH_BASES: dict[int, np.ndarray] = {}


def crash_seed(key: bytes) -> int:
    return int(key.split(b"-")[1])


def crash_object(seed: int) -> tuple[np.ndarray, ObjectHeader, memoryview]:
    """Object ``seed`` of the kill -9 test: 1-4 MiB, cheap to make, so the child spends its time writing.

    The returned array is reused by the next call with the same size.
    """
    tokens = 512 * (1 + seed % 4)
    base = _CRASH_BASES.get(tokens)
    if base is None:
        base = _CRASH_BASES[tokens] = make_object(layers=8, tokens=tokens, seed=tokens)[0]
    base[:, :, 0, 0, 0] = seed % 2048  # every layer's bytes, hence checksums, differ per object
    spec, arr = spec_of(base)
    payload = byte_view(arr)
    return arr, ObjectHeader.for_key(f"obj-{seed}".encode(), spec, layer_checksums(payload, spec.layer_nbytes)), payload


@contextlib.contextmanager
def _child(script: str, *args: str) -> Iterator[tuple[subprocess.Popen[str], queue.Queue[str | None]]]:
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO_ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.endswith("\n"):  # a line cut short by kill -9 was never reported
                lines.put(line[:-1])
        lines.put(None)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)
        reader.join(timeout=10)
        if proc.stderr is not None:
            proc.stderr.close()


def _next_line(proc: subprocess.Popen[str], lines: queue.Queue[str | None], deadline: float) -> str:
    try:
        line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
    except queue.Empty:
        raise AssertionError("the child reported nothing before the deadline") from None
    if line is None:
        assert proc.stderr is not None
        raise AssertionError(f"the child exited early: {proc.wait()}: {proc.stderr.read()}")
    return line


@pytest.mark.slow
def test_kill_9_mid_stream_loses_nothing_committed_and_leaves_nothing_half_written(disk_dir: Path) -> None:
    committed: set[bytes] = set()
    deleting: set[bytes] = set()
    in_flight: set[bytes] = set()  # objects being written when a child died
    # Each child recovers what the last one left. Rounds 0 and 2 are killed as
    # an object's write starts (so mid-write), round 1 just after a commit.
    for round_, kill_on in enumerate(("writing", "committed", "writing")):
        with _child(_CHILD, str(disk_dir), str(round_ * 1000)) as (proc, lines):
            deadline = time.monotonic() + 20
            reported = 0
            while True:
                verb, name = _next_line(proc, lines, deadline).split()
                key = name.encode()
                if verb == "committed":
                    committed.add(key)
                    reported += 1
                elif verb == "deleting":
                    deleting.add(key)
                if round_ == 0 and reported == 1:
                    with pytest.raises(errors.PoolLockedError, match=str(proc.pid)):
                        NvmeTier(disk_dir, 24 * MiB, segment_size=8 * MiB)
                if reported >= 12 and verb == kill_on:  # by now the child has reused freed space
                    break
            assert proc.poll() is None
            proc.send_signal(signal.SIGKILL)
            assert proc.wait(timeout=10) == -signal.SIGKILL
            # Lines already in the pipe were reported before the kill, too.
            while (line := lines.get(timeout=10)) is not None:
                verb, name = line.split()
                {"committed": committed, "deleting": deleting, "writing": in_flight}[verb].add(name.encode())
        in_flight.add(b"obj-%d" % (max(crash_seed(k) for k in committed) + 1))
        assert deleting, "the child never wrapped around; the test would not cover space reuse"

        tier = NvmeTier(disk_dir, 24 * MiB, segment_size=8 * MiB)
        try:
            recovered = {key: (extent, header) for key, extent, header in tier.recover()}
            assert committed - deleting <= set(recovered)
            # Beyond those, at most an object in flight that committed before the kill.
            assert set(recovered) <= committed | in_flight
            for key, (extent, header) in recovered.items():  # every object present verifies
                np.testing.assert_array_equal(read_all(tier, extent, header), crash_object(crash_seed(key))[0])
        finally:
            tier.close()


# -- corruption, locking, filesystems -------------------------------------------------------


def test_flipped_byte_on_disk_is_a_checksum_error(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        arr, header, payload = make_object(layers=4, tokens=64)
        extent = store(tier, header, payload)
        position = extent.offset + header.spec.layer_bytes(LayerRange(2, 3)).offset + 17
        with open(disk_dir / "seg-00000.kvs", "r+b") as segment:  # buffered; O_DIRECT reads flush it
            segment.seek(position)
            byte = segment.read(1)
            segment.seek(position)
            segment.write(bytes([byte[0] ^ 0x40]))
        out = np.empty(header.spec.array_shape(LayerRange(2, 4)), dtype=arr.dtype)
        with pytest.raises(errors.ChecksumError, match="layer 2"):
            tier.read_layers(extent, header, LayerRange(2, 4), byte_view(out))
        # The untouched layers still read (and verify).
        out = np.empty(header.spec.array_shape(LayerRange(0, 2)), dtype=arr.dtype)
        tier.read_layers(extent, header, LayerRange(0, 2), byte_view(out))
        np.testing.assert_array_equal(out, arr[0:2])
    finally:
        tier.close()


def test_second_tier_on_the_same_directory_is_refused(disk_dir: Path) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB)
    try:
        with pytest.raises(errors.PoolLockedError, match=str(os.getpid())):
            NvmeTier(disk_dir, 4 * MiB)
        put(tier, b"still-mine", seed=5)  # the refused open disturbed nothing
    finally:
        tier.close()
    NvmeTier(disk_dir, 4 * MiB).close()  # released on close


def test_tmpfs_falls_back_to_buffered_io_and_says_so() -> None:
    if filesystem_type(Path("/dev/shm")) != 0x01021994:
        pytest.skip("/dev/shm is not tmpfs here")
    base = Path(tempfile.mkdtemp(prefix="kvpool-nvme-test-", dir="/dev/shm"))
    try:
        tier = NvmeTier(base, 4 * MiB)
        try:
            stats = tier.stats()
            assert stats["direct_io"] is False
            assert "tmpfs" in stats["direct_io_reason"]
            extent, arr = put(tier, b"k", seed=4)
        finally:
            tier.close()
        tier = NvmeTier(base, 4 * MiB)
        try:
            [(key, extent, header)] = list(tier.recover())
            np.testing.assert_array_equal(read_all(tier, extent, header), arr)
        finally:
            tier.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)


@contextlib.contextmanager
def _mount(tmp_path: Path, fstype: str, options: str = "") -> Iterator[Path]:
    """A fresh filesystem mounted under tmp_path (root only; skips where mounting is refused)."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a test filesystem needs root")
    target = tmp_path / f"mnt-{fstype}"
    target.mkdir()
    command = ["mount", "-t", fstype, *(["-o", options] if options else []), "none", str(target)]
    if subprocess.run(command, capture_output=True).returncode != 0:
        pytest.skip(f"cannot mount {fstype} here")
    try:
        yield target
    finally:
        subprocess.run(["umount", "-l", str(target)], check=False)


def test_filesystem_refusing_o_direct(tmp_path: Path) -> None:
    with _mount(tmp_path, "ramfs") as mount:  # ramfs has no direct I/O: open(O_DIRECT) is EINVAL
        with pytest.raises(errors.TierError, match="refuses O_DIRECT"):
            NvmeTier(mount / "nvme", 4 * MiB, direct_io="on")
        tier = NvmeTier(mount / "nvme", 4 * MiB, direct_io="auto")
        try:
            assert tier.stats()["direct_io"] is False
            assert "EINVAL" in tier.stats()["direct_io_reason"]
            extent, arr = put(tier, b"k", seed=2)
            np.testing.assert_array_equal(read_all(tier, extent, tier_header(tier, b"k")), arr)
        finally:
            tier.close()


def tier_header(tier: NvmeTier, key: bytes) -> ObjectHeader:
    return next(header for k, _, header in tier.recover() if k == key)


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """The kernel refuses to grow any file of this process past ``nbytes`` (EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of death
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def test_file_size_limit_is_disk_full_lowers_capacity_and_loses_nothing(
        disk_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = NvmeTier(disk_dir, 4 * MiB, segment_size=1 * MiB, io_chunk=64 * KiB)
    try:
        kept, kept_arr = put(tier, b"kept", seed=1, layers=4, tokens=256)  # 256 KiB in segment 0
        kept_header = tier_header(tier, b"kept")
        record = tier.allocated_size(kept.nbytes)
        _, header, payload = keyed_object(b"next", seed=2, layers=4, tokens=256)
        with file_size_limit(record), caplog.at_level(logging.WARNING, logger="tiers.nvme"):
            # Space in an existing segment, but the write past the limit fails.
            extent = tier.allocate(header.spec.total_nbytes)
            assert extent is not None and extent.segment == 0
            with pytest.raises(errors.DiskFullError) as info:
                tier.write_object(extent, header, payload)
            assert isinstance(info.value, OSError) and info.value.errno is not None
            tier.free(extent)  # what the tier manager does with a failed put
            # Every segment file is capped at the limit: one record's room in each.
            assert tier.capacity_bytes == 4 * record
            assert tier.stats()["capacity_bytes"] == 4 * record
            assert tier.stats()["configured_capacity_bytes"] == 4 * MiB
            assert str(disk_dir) in tier.stats()["disk_limited"]
            for i in range(3):  # the lowered capacity is what allocations now get, and they work
                put(tier, b"more-%d" % i, seed=10 + i, layers=4, tokens=256)
            assert tier.allocate(header.spec.total_nbytes) is None  # full: the manager evicts
            assert tier.used_bytes == tier.capacity_bytes
            warnings = [r for r in caplog.records if "effective capacity lowered" in r.message]
            assert len(warnings) == 1 and str(disk_dir) in warnings[0].message
            np.testing.assert_array_equal(read_all(tier, kept, kept_header), kept_arr)
    finally:
        tier.close()
    tier = NvmeTier(disk_dir, 4 * MiB, segment_size=1 * MiB)  # reopening measures afresh
    try:
        assert tier.capacity_bytes == 4 * MiB
        assert len(list(tier.recover())) == 4
        put(tier, b"again", seed=2, layers=4, tokens=256)
    finally:
        tier.close()


def test_segment_preallocation_past_the_file_size_limit_in_a_child(disk_dir: Path) -> None:
    """EFBIG while preparing a segment (RLIMIT_FSIZE set in a child process only)."""
    script = textwrap.dedent("""
        import resource, signal, sys
        from kvpool import errors
        from tests.tiers.test_nvme import keyed_object, MiB
        from tiers.nvme import NvmeTier
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (768 << 10, resource.RLIM_INFINITY))
        tier = NvmeTier(sys.argv[1], 4 * MiB, segment_size=1 * MiB, direct_io="off")
        _, header, payload = keyed_object(b"a", layers=4, tokens=256)
        try:
            tier.allocate(header.spec.total_nbytes)
        except errors.DiskFullError:
            print("disk full", tier.capacity_bytes, flush=True)
        stored = 0
        while (extent := tier.allocate(header.spec.total_nbytes)) is not None:
            key = b"k%d" % stored
            _, header, payload = keyed_object(key, layers=4, tokens=256)
            tier.write_object(extent, header, payload)
            tier.commit(key, extent, header)
            stored += 1
        print("stored", stored, flush=True)
        tier.close()
    """)
    result = subprocess.run([sys.executable, "-c", script, str(disk_dir)], cwd=REPO_ROOT, capture_output=True,
                            text=True, timeout=60,
                            env={**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}"
                                                             f"{os.environ.get('PYTHONPATH', '')}"})
    assert result.returncode == 0, result.stderr
    lines = result.stdout.split("\n")
    assert lines[0] == f"disk full {4 * (768 << 10)}"  # each segment file holds 768 KiB
    assert lines[1] == "stored 8"  # two 260 KiB records per capped segment, no further error


def test_tiny_filesystem_runs_out_of_space(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real 8 MiB tmpfs under a 32 MiB tier that keeps no headroom (as when another writer
    takes the space): DiskFullError once, then a lower capacity that fits."""
    with _mount(tmp_path, "tmpfs", "size=8m") as mount:
        directory = mount / "nvme"
        tier = NvmeTier(directory, 32 * MiB, segment_size=2 * MiB, headroom=0)
        live: list[tuple[bytes, Extent]] = []
        arrays: dict[bytes, np.ndarray] = {}
        failures = 0
        try:
            with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
                for seed in range(60):  # ~30 MiB of puts through ~8 MiB of disk
                    key = b"obj-%d" % seed
                    arr, header, payload = keyed_object(key, seed=seed, layers=4, tokens=512)  # 512 KiB
                    while True:
                        try:
                            extent = tier.allocate(header.spec.total_nbytes)
                            if extent is None:  # full: evict the oldest, as the tier manager would
                                old_key, old = live.pop(0)
                                tier.forget(old_key, old)
                                tier.free(old)
                                arrays.pop(old_key)
                                continue
                            tier.write_object(extent, header, payload)
                        except errors.DiskFullError:
                            failures += 1
                            assert failures == 1, "the lowered capacity must fit the filesystem"
                            continue
                        tier.commit(key, extent, header)
                        live.append((key, extent))
                        arrays[key] = arr
                        break
            assert failures == 1
            assert 2 * MiB <= tier.capacity_bytes < 8 * MiB
            assert tier.stats()["capacity_bytes"] == tier.capacity_bytes
            warnings = [r for r in caplog.records if "effective capacity lowered" in r.message]
            assert len(warnings) == 1 and str(directory) in warnings[0].message
            assert str(tier.capacity_bytes) in warnings[0].message
            for key, extent in live:  # nothing stored was damaged
                np.testing.assert_array_equal(read_all(tier, extent, tier_header(tier, key)), arrays[key])
        finally:
            tier.close()
        tier = NvmeTier(directory, 32 * MiB, segment_size=2 * MiB)
        try:
            assert {key for key, _, _ in tier.recover()} == set(arrays)
        finally:
            tier.close()


def test_the_tier_keeps_headroom_on_a_small_filesystem(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real 16 MiB tmpfs under a 64 MiB tier with the default headroom (auto: a quarter of a
    filesystem this small, 4 MiB): ~60 MiB of puts never meet DiskFullError, the filesystem
    keeps the headroom free throughout, one warning says why the capacity is lower, and the
    small writes beside the segments (durable.log lines) still fit afterwards."""
    from kvpool.cluster.node import durable_log

    def free_bytes(path: Path) -> int:
        st = os.statvfs(path)
        return st.f_bavail * st.f_frsize

    with _mount(tmp_path, "tmpfs", "size=16m") as mount:
        directory = mount / "nvme"
        tier = NvmeTier(directory, 64 * MiB, segment_size=2 * MiB)
        live: list[tuple[bytes, Extent]] = []
        arrays: dict[bytes, np.ndarray] = {}
        try:
            with caplog.at_level(logging.WARNING, logger="tiers.nvme"):
                for seed in range(120):  # 512 KiB each, evicting the oldest as the tier manager would
                    key = b"obj-%d" % seed
                    arr, header, payload = keyed_object(key, seed=seed, layers=4, tokens=512)
                    while (extent := tier.allocate(header.spec.total_nbytes)) is None:
                        old_key, old = live.pop(0)
                        tier.forget(old_key, old)
                        tier.free(old)
                        arrays.pop(old_key)
                    tier.write_object(extent, header, payload)  # never DiskFullError
                    tier.commit(key, extent, header)
                    live.append((key, extent))
                    arrays[key] = arr
                    assert free_bytes(mount) >= 3 * MiB  # the headroom, less the index's own growth
            stats = tier.stats()
            assert stats["headroom_bytes"] == 4 * MiB and stats["disk_full_events"] == 0
            assert 8 * MiB <= tier.capacity_bytes <= 12 * MiB and "tiers.nvme.headroom" in stats["disk_limited"]
            warnings = [r for r in caplog.records if "effective capacity lowered" in r.message]
            assert len(warnings) == 1 and "tiers.nvme.headroom" in warnings[0].message
            for i in range(2000):  # ~270 KiB of durable.log lines
                durable_log.append(directory, b"k" * 64 + i.to_bytes(4, "big"), 2)
            assert len(durable_log.read(directory, 256)) == 2000
            for key, extent in live:  # nothing stored was damaged
                np.testing.assert_array_equal(read_all(tier, extent, tier_header(tier, key)), arrays[key])
        finally:
            tier.close()


def test_headroom_settings() -> None:
    from kvpool.config import headroom_bytes

    GiB = 1 << 30
    assert headroom_bytes("auto", 16 * MiB) == 4 * MiB  # at most a quarter of a small filesystem
    assert headroom_bytes("auto", 1 * GiB) == 64 * MiB
    assert headroom_bytes("auto", 1000 * GiB) == 20 * GiB  # 2%
    assert headroom_bytes("5%", 100 * MiB) == 5 * MiB and headroom_bytes("256MiB", GiB) == 256 * MiB
    assert headroom_bytes(0, GiB) == 0
    config = Config.load({"tiers": {"nvme": {"headroom": 0}}})
    assert config.tiers.nvme.headroom == "0"
    for bad in ("lots", "100%", "-1%", True):
        with pytest.raises(errors.ConfigError, match="tiers.nvme.headroom"):
            Config.load({"tiers": {"nvme": {"headroom": bad}}})
        with pytest.raises(errors.TierError, match="headroom"):
            NvmeTier("/nonexistent/never-made", 4 * MiB, headroom=bad)  # type: ignore[arg-type]


# -- configuration ------------------------------------------------------------------------------


def test_from_config_paths(tmp_path: Path) -> None:
    config = Config.load({"pool": {"data_dir": str(tmp_path / "data")},
                          "tiers": {"nvme": {"capacity": "4MiB", "segment_size": "1MiB", "fsync": True}}})
    tier = NvmeTier.from_config(config.tiers.nvme, config)
    try:
        assert tier.path == tmp_path / "data" / "nvme"
        assert tier.capacity_bytes == 4 * MiB and tier.segment_bytes == 1 * MiB
        assert tier.stats()["fsync"] is True
        put(tier, b"durable", seed=1)  # the fsync path (fdatasync + synced LMDB) really runs
    finally:
        tier.close()
    config.tiers.nvme.path = str(tmp_path / "elsewhere")
    tier = NvmeTier.from_config(config.tiers.nvme, config)
    try:
        assert tier.path == tmp_path / "elsewhere"
    finally:
        tier.close()
