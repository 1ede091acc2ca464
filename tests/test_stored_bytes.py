"""Any bytes in any file kvpool reads back: skipped or refused with a typed error, never a crash.

One Hypothesis test (or two: random contents, and mutations of a valid file) per reader of a
file: ``durable.log`` (:mod:`kvpool.cluster.node.durable_log`), the nvme tier's segment files and
LMDB index records, a cxl arena and its shared index, a config TOML, the cluster key file.
"Typed" means a :class:`kvpool.errors.KVPoolError`; anything else escaping is a failure.
Example counts are bounded so the file runs in seconds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lmdb
import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpool import errors
from kvpool.cluster.node import durable_log
from kvpool.cluster.wire.security import keygen, read_secret
from kvpool.config import Config
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec, encode
from tests.conftest import bounded
from tiers.cxl.arena import DATA_OFFSET
from tiers.cxl.index import SharedIndexReader, index_path
from tiers.cxl.reader import CxlArenaReader
from tiers.cxl.tier import CxlTier
from tiers.nvme import NvmeTier
from tiers.nvme.layout import INDEX_DIR

FILES = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
SPEC = ObjectSpec("float16", layers=3, tokens=8, kv_heads=2, head_dim=8)


def mutate(blob: bytes, data: st.DataObject, *, at_most: int = 6) -> bytes:
    """A few byte flips, non-ASCII bytes, truncations, insertions or deletions of ``blob``."""
    buf = bytearray(blob)
    for _ in range(data.draw(st.integers(1, at_most))):
        if not buf:
            buf += data.draw(st.binary(min_size=1, max_size=8))
            continue
        at = data.draw(st.integers(0, len(buf) - 1))
        kind = data.draw(st.sampled_from(["flip", "high", "truncate", "insert", "delete", "newline"]))
        if kind == "flip":
            buf[at] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "high":
            buf[at] = data.draw(st.integers(0x80, 0xFF))
        elif kind == "truncate":
            del buf[at:]
        elif kind == "insert":
            buf[at:at] = data.draw(st.binary(min_size=1, max_size=16))
        elif kind == "newline":
            buf[at:at] = b"\n"
        else:
            del buf[at:at + data.draw(st.integers(1, 16))]
    return bytes(buf)


def kv(seed: int) -> np.ndarray:
    shape = (SPEC.layers, 2, SPEC.tokens, SPEC.kv_heads, SPEC.head_dim)
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def payload(seed: int) -> np.ndarray:
    return kv(seed).reshape(-1).view(np.uint8)


# -- durable.log ---------------------------------------------------------------------------------


def durable_line(key: bytes, replicas: int) -> bytes:
    return b"%s %d\n" % (key.hex().encode(), replicas)


@FILES
@given(st.binary(max_size=600))
def test_durable_log_random_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    directory = tmp_path_factory.mktemp("durable")
    (directory / durable_log.FILE_NAME).write_bytes(blob)
    with bounded(5.0):
        found = durable_log.read(directory, max_key_bytes=64)
    for key, replicas in found.items():
        assert 0 < len(key) <= 64 and 1 <= replicas <= durable_log.MAX_REPLICAS


@FILES
@given(st.data(), st.lists(st.tuples(st.binary(min_size=1, max_size=32), st.integers(1, 9)), min_size=1,
                           max_size=6, unique_by=lambda kv: kv[0]))
def test_durable_log_mutated_keeps_every_intact_line(tmp_path_factory: pytest.TempPathFactory,
                                                      data: st.DataObject, entries: list[tuple[bytes, int]]) -> None:
    """Garbage between whole lines (any bytes, no newline) never costs the lines around it."""
    directory = tmp_path_factory.mktemp("durable")
    blob = b""
    for key, replicas in entries:
        garbage = data.draw(st.binary(max_size=20)).replace(b"\n", b"\xff")
        blob += (garbage + b"\n" if garbage else b"") + durable_line(key, replicas)
    blob += mutate(durable_line(b"torn", 1), data)  # and a torn (or corrupted) last line
    (directory / durable_log.FILE_NAME).write_bytes(blob)
    found = durable_log.read(directory, max_key_bytes=64)
    for key, replicas in entries:
        assert found[key] == replicas


def test_durable_log_with_non_ascii_bytes_is_logged_not_raised(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / durable_log.FILE_NAME).write_bytes(durable_line(b"a", 2) + b"\xc3\x28 garbage \xff\n"
                                                   + b"x" * (300 << 10) + b"\n" + durable_line(b"b", 3)
                                                   + b"abcd -1\n" + b"abcd 99999999999\n" + b"ab\xa0cd 2\n")
    with caplog.at_level(logging.WARNING, logger="kvpool.node"):
        assert durable_log.read(tmp_path, max_key_bytes=64) == {b"a": 2, b"b": 3}
    assert "skipped 5 malformed line(s)" in caplog.text
    (tmp_path / durable_log.FILE_NAME).unlink()
    (tmp_path / durable_log.FILE_NAME).mkdir()  # unreadable as a file: empty, logged
    assert durable_log.read(tmp_path, max_key_bytes=64) == {}


# -- config TOML -----------------------------------------------------------------------------------


VALID_TOML = b"""[pool]
name = "p"
data_dir = "/tmp/kvpool-fuzz"
chunk_tokens = 256
[tiers.dram]
capacity = "64MiB"
mlock = false
[tiers.cxl]
capacity = 0
[tiers.nvme]
capacity = "1GiB"
segment_size = "64MiB"
[eviction]
policy = "s3fifo"
[master]
listen = "tcp://127.0.0.1:7700"
heartbeat_ms = 500
[security]
auth = true
"""


def load_config(path: Path) -> None:
    with bounded(5.0):
        try:
            Config.load(path)
        except errors.KVPoolError:
            pass


@FILES
@given(st.binary(max_size=400))
def test_config_random_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    path = tmp_path_factory.mktemp("config") / "kvpool.toml"
    path.write_bytes(blob)
    load_config(path)


@FILES
@given(st.data())
def test_config_mutated(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("config") / "kvpool.toml"
    path.write_bytes(mutate(VALID_TOML, data))
    load_config(path)


@pytest.mark.parametrize("blob", [b"[pool]\nname = \"\xff\"\n", b"\xef\xbb\xbf\x00", b"[" * 100_000,
                                  b"a = " + b"[" * 5000 + b"]" * 5000, b"[tiers.dram]\ncapacity = 1e400\n"])
def test_config_edge_cases_are_config_errors(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "kvpool.toml"
    path.write_bytes(blob)
    with pytest.raises(errors.ConfigError, match="kvpool.toml"):
        Config.load(path)


def test_config_that_is_a_directory_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "kvpool.toml").mkdir()
    with pytest.raises(errors.ConfigError, match="kvpool.toml"):
        Config.load(tmp_path / "kvpool.toml")


# -- cluster key file ------------------------------------------------------------------------------


def read_key(path: Path) -> None:
    os.chmod(path, 0o600)
    with bounded(5.0):
        try:
            secret = read_secret(path)
        except errors.ConfigError:
            return
    assert len(secret) >= 16


@FILES
@given(st.binary(max_size=200))
def test_key_file_random_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    path.write_bytes(blob)
    read_key(path)


@FILES
@given(st.data())
def test_key_file_mutated(tmp_path_factory: pytest.TempPathFactory, data: st.DataObject) -> None:
    path = tmp_path_factory.mktemp("key") / "cluster.key"
    keygen(path)
    path.write_bytes(mutate(path.read_bytes(), data))
    read_key(path)


def test_key_file_with_non_utf8_bytes_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "cluster.key"
    keygen(path)
    path.write_bytes(path.read_bytes()[:10] + b"\xff\xfe" + path.read_bytes()[10:])
    with pytest.raises(errors.ConfigError, match="does not hold a kvpool key"):
        read_secret(path)


# -- cxl arena and its shared index ----------------------------------------------------------------


@pytest.fixture(scope="module")
def arena_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[bytes, bytes, list[int]]]:
    """The bytes of a small arena holding three objects and of its index, and the objects' offsets."""
    directory = tmp_path_factory.mktemp("arena")
    tier = CxlTier(directory / "kvpool-fuzz-cxl", 1 << 20, prefault=False)
    offsets = []
    try:
        for i in range(3):
            key = b"key-%d" % i
            blob = encode(kv(i), key)
            extent = tier.allocate(len(blob))
            tier.write(extent, 0, blob)
            tier.commit(key, extent, ObjectHeader.unpack(blob))
            offsets.append(extent.offset)
        yield tier.path.read_bytes(), index_path(tier.path).read_bytes(), offsets
    finally:
        tier.close()


def read_arena(directory: Path, arena: bytes, index: bytes, offsets: list[int]) -> None:
    """Open the arena and index as a same-host reader would, and read every key and offset."""
    path = directory / "kvpool-fuzz-cxl"
    path.write_bytes(arena)
    index_path(path).write_bytes(index)
    with bounded(5.0):
        try:
            reader = CxlArenaReader.open(path, require_owner=False, prefault=False)
        except errors.KVPoolError:
            return
        with reader:
            for i, offset in enumerate([*offsets, 0, 1, DATA_OFFSET, reader.header.capacity_bytes - 1]):
                key = b"key-%d" % i
                with contextlib.suppress(errors.KVPoolError):
                    found = reader.find(key)
                    if found is not None:  # whatever the index says, a found object is verified
                        out = np.empty(found[1].spec.layer_bytes(LayerRange(0, found[1].spec.layers)).nbytes,
                                       dtype=np.uint8)
                        reader.read_layers_into(found[0], found[1], None, out)
                        assert np.array_equal(out, payload(i)), "a corrupted arena returned wrong bytes"
                with contextlib.suppress(errors.KVPoolError):
                    header, arr = reader.read_object(offset)
                    assert header.is_for(b"key-%d" % offsets.index(offset)) if offset in offsets else True


@FILES
@given(st.data())
def test_arena_mutated(tmp_path_factory: pytest.TempPathFactory, arena_files: tuple[bytes, bytes, list[int]],
                       data: st.DataObject) -> None:
    arena, index, offsets = arena_files
    # Mutations near the header and the objects (a 1 MiB file is mostly zeros).
    head = DATA_OFFSET + offsets[-1] + 2 * SPEC.total_nbytes
    read_arena(tmp_path_factory.mktemp("arena"), mutate(arena[:head], data) + arena[head:], index, offsets)


@FILES
@given(st.data())
def test_arena_index_mutated(tmp_path_factory: pytest.TempPathFactory,
                             arena_files: tuple[bytes, bytes, list[int]], data: st.DataObject) -> None:
    arena, index, offsets = arena_files
    live = [i for i in range(64, len(index), 64) if index[i + 8:i + 16] != bytes(8)]  # slots in use
    at = data.draw(st.sampled_from([0, *live]))
    blob = index[:at] + mutate(index[at:at + 128], data) + index[at + 128:]
    read_arena(tmp_path_factory.mktemp("arena"), arena, blob, offsets)


@FILES
@given(st.binary(max_size=300))
def test_arena_index_random_bytes(tmp_path_factory: pytest.TempPathFactory, blob: bytes) -> None:
    path = tmp_path_factory.mktemp("index") / "x.index"
    path.write_bytes(blob)
    with bounded(5.0):
        try:
            reader = SharedIndexReader(path)
        except errors.KVPoolError:
            return
        try:
            for i in range(8):
                reader.find(b"key-%d" % i)
        finally:
            reader.close()


# -- nvme: segment files and index records ---------------------------------------------------------


@pytest.fixture(scope="module")
def nvme_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("nvme") / "tier"
    tier = NvmeTier(directory, 4 << 20, segment_size=1 << 20, direct_io="off")
    try:
        for i in range(4):
            key = b"key-%d" % i
            blob = encode(kv(i), key)
            extent = tier.allocate(len(blob))
            tier.write(extent, 0, blob)
            tier.commit(key, extent, ObjectHeader.unpack(blob))
    finally:
        tier.close()
    return directory


def open_nvme(directory: Path) -> None:
    """Open the tier and read back everything it recovered: each object exact, or refused typed."""
    with bounded(10.0):
        try:
            tier = NvmeTier(directory, 4 << 20, segment_size=1 << 20, direct_io="off")
        except errors.KVPoolError:
            return
        try:
            for key, extent, header in tier.recover():
                out = np.empty(extent.nbytes, dtype=np.uint8)
                with contextlib.suppress(errors.FormatError):
                    tier.read_into(extent, 0, out)
                    header.verify(LayerRange(0, header.spec.layers), out[header.nbytes:])
                    assert key.startswith(b"key-") and np.array_equal(out[header.nbytes:], payload(int(key[4:])))
        finally:
            tier.close()


@FILES
@given(st.data())
def test_nvme_segment_mutated(tmp_path_factory: pytest.TempPathFactory, nvme_template: Path,
                              data: st.DataObject) -> None:
    directory = tmp_path_factory.mktemp("nvme") / "tier"
    shutil.copytree(nvme_template, directory)
    segment = directory / "seg-00000.kvs"
    blob = segment.read_bytes()
    used = 4 * (SPEC.total_nbytes + 8192)
    segment.write_bytes(mutate(blob[:used], data) + blob[used:])
    if data.draw(st.booleans()):
        shutil.rmtree(directory / INDEX_DIR)  # rebuilt by scanning the mutated segment
    open_nvme(directory)


index_values = st.one_of(
    st.binary(max_size=80),
    st.builds(lambda v: msgspec.msgpack.encode(v), st.lists(st.one_of(st.integers(-(1 << 63), (1 << 64) - 1),
                                                             st.binary(max_size=300), st.none(), st.text(max_size=5)),
                                                   max_size=5)),
)


@FILES
@given(st.data(), st.dictionaries(st.binary(min_size=1, max_size=40), index_values, max_size=4))
def test_nvme_index_records_replaced(tmp_path_factory: pytest.TempPathFactory, nvme_template: Path,
                                     data: st.DataObject, records: dict[bytes, bytes]) -> None:
    """Index records (and the layout record) with any value: dropped or rebuilt, never a crash."""
    directory = tmp_path_factory.mktemp("nvme") / "tier"
    shutil.copytree(nvme_template, directory)
    env = lmdb.open(str(directory / INDEX_DIR), max_dbs=2, subdir=True)
    try:
        objects, meta = env.open_db(b"objects"), env.open_db(b"meta")
        with env.begin(write=True) as txn:
            for key, value in records.items():
                txn.put(key, value, db=objects)
            existing = [bytes(k) for k, _ in txn.cursor(db=objects)]
            for key in existing[:data.draw(st.integers(0, 2))]:
                raw = bytes(txn.get(key, db=objects))
                txn.put(key, mutate(raw, data), db=objects)
            if data.draw(st.booleans()):
                txn.put(b"layout", data.draw(index_values), db=meta)
    finally:
        env.close()
    open_nvme(directory)


# -- a storage node whose durable.log holds any bytes ----------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_node_with_non_ascii_bytes_in_durable_log_starts_and_registers_again(cluster: Any) -> None:
    """The bug of issue 33: one non-ASCII byte in durable.log raised UnicodeDecodeError out of the
    node's registration, at start and at every re-registration (after a master restart)."""
    from tests.conftest import wait_for

    master = cluster.start_master()
    nvme = cluster.tmp_path / "store" / "nvme-store"
    nvme.mkdir(parents=True, mode=0o700)
    (nvme / durable_log.FILE_NAME).write_bytes(durable_line(b"k", 1) + b"\xc3\x28\xff garbage\n" + b"\x80" * 50)
    node = cluster.start_node("store")
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 10, "the node to register")
    assert "skipped 2 malformed line(s)" in node.output()
    master.kill()
    cluster.start_master()  # an empty master: the node registers again, reading the log again
    wait_for(lambda: len(cluster.alive_nodes()) == 1, 15, "the node to register again")
    assert node.popen.poll() is None and "Traceback" not in node.output()


def test_recording_a_durable_copy_on_a_full_disk_is_disk_full_error(tmpfs: Any) -> None:
    """The fault soak's find: durable.log's append on a full disk raised a bare OSError (ENOSPC)."""
    directory = tmpfs("64k")
    (directory / "filler").write_bytes(b"\0" * (60 << 10))
    with contextlib.suppress(OSError):
        with open(directory / "filler", "ab") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
    with pytest.raises(errors.DiskFullError, match="durable.log"):
        durable_log.append(directory, b"key", 1)
