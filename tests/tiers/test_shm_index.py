from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpool import errors
from tiers.cxl.index import SEQ, STATE, IndexEntry, SharedIndexReader, SharedIndexWriter

INSTANCE = b"0123456789abcdef"


@pytest.fixture
def pair(tmp_path: Path):
    writer = SharedIndexWriter(tmp_path / "idx", 64, INSTANCE)
    reader = SharedIndexReader(tmp_path / "idx", INSTANCE)
    yield writer, reader
    reader.close()
    writer.close()


def test_insert_find_replace_remove(pair) -> None:
    writer, reader = pair
    assert reader.find(b"a") is None
    assert writer.insert(b"a", IndexEntry(4096, 100, 7))
    assert reader.find(b"a") == IndexEntry(4096, 100, 7)
    assert writer.insert(b"a", IndexEntry(8192, 200, 8))  # replaced in place
    assert reader.find(b"a") == IndexEntry(8192, 200, 8) and writer.live == 1
    assert not writer.remove(b"a", 4096)  # a stale extent never removes the newer entry
    assert writer.remove(b"a", 8192)
    assert reader.find(b"a") is None and writer.live == 0


def test_tombstones_are_reused_and_a_full_table_refuses(pair) -> None:
    writer, reader = pair
    keys = [b"k%d" % i for i in range(48)]  # 3/4 of 64 slots
    assert all(writer.insert(k, IndexEntry(i, 1, i)) for i, k in enumerate(keys))
    assert not writer.insert(b"one-too-many", IndexEntry(0, 1, 0))
    assert reader.find(b"one-too-many") is None
    assert writer.remove(b"k3", 3)
    assert writer.insert(b"k3-again", IndexEntry(99, 1, 99))  # lands in a tombstone
    assert reader.find(b"k3-again") == IndexEntry(99, 1, 99)
    assert all(reader.find(k) == IndexEntry(i, 1, i) for i, k in enumerate(keys) if k != b"k3")


def test_readers_refuse_other_files_and_see_a_closed_owner(tmp_path: Path) -> None:
    (tmp_path / "junk").write_bytes(b"x" * 4096)
    with pytest.raises(errors.BadMagicError):
        SharedIndexReader(tmp_path / "junk")
    with pytest.raises(errors.TierError):
        SharedIndexReader(tmp_path / "absent")
    writer = SharedIndexWriter(tmp_path / "idx", 64, INSTANCE)
    with pytest.raises(errors.TierError):
        SharedIndexReader(tmp_path / "idx", b"another-instance")
    reader = SharedIndexReader(tmp_path / "idx", INSTANCE)
    writer.insert(b"a", IndexEntry(1, 2, 3))
    writer.close()
    assert reader.find(b"a") is None  # the owner is gone: nothing is found any more
    reader.close()


def _churn_against(writer: SharedIndexWriter, script: str, seconds: float,
                   entry_of: Callable[[int], tuple[int, IndexEntry]],
                   offset_of: Callable[[int], int]) -> tuple[int, int]:
    """Run the reader ``script`` (it prints ``found bad``) in another process while ``writer``
    churns for ``seconds``: write ``v`` puts key ``entry_of(v)[0]``'s entry ``entry_of(v)[1]``, and
    every seventh also removes the key five on, if still at the offset write ``v - 59`` gave it
    (``offset_of``). The writer is closed and the child stopped, also on failure."""
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                             cwd=Path(__file__).resolve().parents[2])
    try:
        version = 0
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            version += 1
            i, entry = entry_of(version)
            writer.insert(b"key-%d" % i, entry)
            if version % 7 == 0:
                writer.remove(b"key-%d" % ((i + 5) % 64), offset_of(version - 59))
        found, bad = map(int, child.communicate(timeout=30)[0].split())
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        writer.close()
    return found, bad


def test_a_reader_in_another_process_never_sees_a_torn_slot(tmp_path: Path) -> None:
    """The writer churns entries whose fields all derive from one number; a reader in
    another process checks every entry it finds is self-consistent."""
    writer = SharedIndexWriter(tmp_path / "idx", 256, INSTANCE)
    script = textwrap.dedent(f"""
        import sys, time
        from tiers.cxl.index import SharedIndexReader
        reader = SharedIndexReader({str(tmp_path / 'idx')!r}, {INSTANCE!r})
        found = bad = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for i in range(64):
                entry = reader.find(b"key-%d" % i)
                if entry is None:
                    continue
                found += 1
                if entry.nbytes != entry.offset * 3 + 1 or entry.header_sum != entry.offset ^ 0xABCDEF:
                    bad += 1
        print(found, bad)
    """)
    found, bad = _churn_against(
        writer, script, 1.7,
        lambda v: (v % 64, IndexEntry(v * 64, v * 64 * 3 + 1, v * 64 ^ 0xABCDEF)), lambda v: v * 64)
    assert found > 1000 and bad == 0


def _write_field_by_field(self: SharedIndexWriter, base: int, state: int, lo: int, hi: int,
                          entry: IndexEntry) -> None:
    """:meth:`SharedIndexWriter._write` one field at a time (a Python step between any two): the
    same protocol (sequence odd, the fields, sequence even), with a torn slot visible for longer."""
    words = self._table.words
    seq = int(words[base + SEQ])
    words[base + SEQ] = seq + 1
    for word, value in enumerate((state, lo, hi, entry.offset, entry.nbytes, entry.header_sum), start=STATE):
        words[base + word] = value
        time.sleep(0)  # the other process may run here
    words[base + SEQ] = seq + 2


def test_the_c_probe_in_another_process_never_sees_a_torn_slot(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """:meth:`SharedIndexReader.find_snapshots` (the probe in C) against a writer churning
    entries (a key's entry moves on each write, its size derived from its offset), over an
    arena the reader built with a header at every offset an entry can name (naming that
    offset's key, carrying its header sum): every entry it hands back is one version, whole."""
    from tiers.cxl.index import find_shared

    if find_shared is None:
        pytest.skip("the C extension is not built here")
    writer = SharedIndexWriter(tmp_path / "idx", 256, INSTANCE)
    monkeypatch.setattr(SharedIndexWriter, "_write", _write_field_by_field)  # a wide window for a torn read
    script = textwrap.dedent(f"""
        import struct, time
        import numpy as np, xxhash
        from tiers.cxl.index import SharedIndexReader
        reader = SharedIndexReader({str(tmp_path / 'idx')!r}, {INSTANCE!r})
        slots = 4096
        arena = np.zeros(slots * 128 + 128, np.uint8)
        for j in range(slots):  # the header an entry at offset j * 128 names: key j % 64's
            at = j * 128
            arena[at + 8:at + 12] = np.frombuffer(struct.pack("<I", 80), np.uint8)
            arena[at + 44:at + 60] = np.frombuffer(xxhash.xxh3_128_digest(b"key-%d" % (j % 64)), np.uint8)
            arena[at + 68:at + 76] = np.frombuffer(struct.pack("<Q", (j % 64) ^ 0xABCDEF), np.uint8)
        digests = b"".join(xxhash.xxh3_128_digest(b"key-%d" % i) for i in range(64))
        found = bad = 0
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for i, hit in enumerate(reader.find_snapshots(digests, arena, 4096)):
                if hit is None:
                    continue
                found += 1
                offset, snapshot, nbytes, header_sum = hit
                if (nbytes != 80 + offset % 7 or header_sum != i ^ 0xABCDEF or (offset // 128) % 64 != i
                        or snapshot != arena[offset:offset + 80].tobytes()):
                    bad += 1
        print(found, bad)
    """)
    def offset_of(version: int) -> int:
        return (version % 4096) * 128

    found, bad = _churn_against(
        writer, script, 1.9,
        lambda v: (v % 64, IndexEntry(offset_of(v), 80 + offset_of(v) % 7, v % 64 ^ 0xABCDEF)), offset_of)
    assert found > 1000 and bad == 0, (found, bad)


def test_churn_far_beyond_the_slot_count_keeps_working(pair) -> None:
    writer, reader = pair
    for i in range(2000):  # every removal leaves a tombstone; compaction must sweep them
        key = b"churn-%d" % i
        assert writer.insert(key, IndexEntry(i, 1, i))
        assert reader.find(key) == IndexEntry(i, 1, i)
        if i >= 10:
            old = i - 10
            assert writer.remove(b"churn-%d" % old, old)
    assert writer.live == 10
    assert [reader.find(b"churn-%d" % i) is not None for i in range(1985, 2000)] == [False] * 5 + [True] * 10
