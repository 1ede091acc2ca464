"""The cxl tier: conformance, a real second process reading in place, ownership, the model."""

from __future__ import annotations

import json
import os
import selectors
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from kvpool import errors
from kvpool.config import Config
from kvpool.objformat import LayerRange, ObjectHeader, byte_view
from kvpool.testing import TierTests, make_object, store
from tiers.base import madvise, tmpfs_huge_pages
from tiers.cxl import DATA_OFFSET, CxlArenaReader, CxlTier, default_arena_path

REPO = Path(__file__).resolve().parents[2]
CHILD_TIMEOUT_S = 20.0


@pytest.fixture
def arena_path(tmp_path: Path) -> Iterator[Path]:
    """A fresh arena path in /dev/shm (real shared memory), removed after the test."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    path = base / f"kvpool-test-{uuid.uuid4().hex[:12]}-cxl"
    yield path
    path.unlink(missing_ok=True)


def digest(arr: Any) -> str:
    return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(arr)).cast("B"))


class TestCxlTier(TierTests):
    def make_tier(self, tmp_path, capacity_bytes):
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
        return CxlTier(base / f"kvpool-test-{uuid.uuid4().hex[:12]}-cxl", capacity_bytes)


# -- a real second process ------------------------------------------------------------

# Reads JSON commands on stdin, answers one JSON line each. Keeps the last view so
# the parent can change arena bytes and ask for the *same* view's digest again.
READER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np, xxhash
    from kvpool import errors
    from kvpool.objformat import LayerRange
    from tiers.cxl import CxlArenaReader

    def digest(arr):
        return xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(arr)).cast("B"))

    reader, view = None, None
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        try:
            op = cmd["op"]
            if op == "open":
                reader = CxlArenaReader.from_location(cmd["location"])
                reply = {"capacity": reader.header.capacity_bytes, "owner_alive": reader.owner_alive()}
            elif op == "read":
                layers = tuple(cmd["layers"]) if "layers" in cmd else None
                header, view = reader.read_object(cmd["offset"], layers, nbytes=cmd.get("nbytes"))
                reply = {"digest": digest(view), "shape": list(view.shape), "dtype": str(view.dtype),
                         "in_place": bool(np.shares_memory(view, reader.arena)),
                         "writeable": bool(view.flags.writeable)}
            elif op == "redigest":
                reply = {"digest": digest(view)}
            elif op == "read_into":
                header = reader.read_header(cmd["offset"])
                rng = LayerRange(*cmd["layers"])
                out = np.empty(header.spec.array_shape(rng), dtype=view.dtype)
                reader.read_layers_into(cmd["offset"], header, rng, memoryview(out.reshape(-1).view(np.uint8)))
                reply = {"digest": digest(out)}
            elif op == "owner_alive":
                reply = {"owner_alive": reader.owner_alive()}
            else:
                reply = {"error": "unknown op " + op}
        except errors.KVPoolError as exc:
            reply = {"error": type(exc).__name__, "message": str(exc)}
        print(json.dumps(reply), flush=True)
    """
)


class Child:
    """A Python subprocess spoken to in JSON lines, with a deadline on every answer."""

    def __init__(self, script: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        self.proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
        self._selector = selectors.DefaultSelector()
        assert self.proc.stdout is not None
        self._selector.register(self.proc.stdout, selectors.EVENT_READ)
        assert self.recv() == {"ready": True}

    def recv(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        if not self._selector.select(timeout=CHILD_TIMEOUT_S):
            raise TimeoutError(f"child said nothing within {CHILD_TIMEOUT_S} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"child exited with {self.proc.wait()}")
        return json.loads(line)

    def ask(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.recv()

    def stop(self) -> None:
        self._selector.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None:
                stream.close()


@pytest.fixture
def reader_process() -> Iterator[Child]:
    child = Child(READER_SCRIPT)
    try:
        yield child
    finally:
        child.stop()


@pytest.fixture
def cxl(arena_path: Path) -> Iterator[CxlTier]:
    tier = CxlTier(arena_path, 8 << 20)
    try:
        yield tier
    finally:
        tier.close()


def test_second_process_reads_objects_in_place(cxl: CxlTier, reader_process: Child) -> None:
    arr, header, payload = make_object(layers=6, tokens=32, seed=3)
    store(cxl, *make_object(seed=1)[1:])  # so the object of interest is not at offset 0
    extent = store(cxl, header, payload)
    location = cxl.location(extent)
    assert location["offset"] == extent.offset > 0

    opened = reader_process.ask(op="open", location=location)
    assert opened == {"capacity": cxl.capacity_bytes, "owner_alive": True}

    whole = reader_process.ask(op="read", offset=extent.offset, nbytes=extent.nbytes)
    assert whole == {"digest": digest(arr), "shape": list(arr.shape), "dtype": "float16",
                     "in_place": True, "writeable": False}
    part = reader_process.ask(op="read", offset=extent.offset, layers=[1, 3])
    assert part["digest"] == digest(arr[1:3]) and part["shape"][0] == 2
    copied = reader_process.ask(op="read_into", offset=extent.offset, layers=[2, 5])
    assert copied["digest"] == digest(arr[2:5])

    # In place, not a copy: bytes the owner changes show through the child's existing
    # view (still the one of layers 1..2).
    new_layer2 = np.ascontiguousarray(-arr[2])
    rng = header.spec.layer_bytes(LayerRange(2, 3))
    cxl.write(extent, rng.offset, byte_view(new_layer2))
    assert reader_process.ask(op="redigest") == {"digest": digest(np.stack([arr[1], new_layer2]))}


def test_second_process_detects_a_corrupt_object(cxl: CxlTier, reader_process: Child) -> None:
    arr, header, payload = make_object(layers=4)
    extent = store(cxl, header, payload)
    reader_process.ask(op="open", location=cxl.location(extent))
    assert reader_process.ask(op="read", offset=extent.offset)["digest"] == digest(arr)

    flip_at = header.spec.layer_bytes(LayerRange(3, 4)).offset + 17
    byte = cxl.view(extent, flip_at, 1)
    byte[0] ^= 0x40
    assert reader_process.ask(op="read", offset=extent.offset)["error"] == "ChecksumError"
    assert reader_process.ask(op="read", offset=extent.offset, layers=[0, 3])["digest"] == digest(arr[:3])
    assert reader_process.ask(op="read_into", offset=extent.offset, layers=[2, 4])["error"] == "ChecksumError"
    # No object starts in the middle of one.
    assert reader_process.ask(op="read", offset=extent.offset + 64)["error"] == "BadMagicError"


def test_reader_refuses_an_arena_with_a_bad_header(arena_path: Path) -> None:
    arena_path.write_bytes(b"NOTKVPL!" + bytes(2 * DATA_OFFSET))
    with pytest.raises(errors.BadMagicError):
        CxlArenaReader.open(arena_path, require_owner=False)


def test_reader_refuses_a_torn_header_and_another_instance(cxl: CxlTier) -> None:
    with pytest.raises(errors.TierError, match="another owner instance"):
        CxlArenaReader.open(cxl.path, instance=b"\0" * 16)
    with CxlArenaReader.open(cxl.path, instance=cxl.instance.hex()) as reader:
        assert reader.header.capacity_bytes == cxl.capacity_bytes
        assert reader.header.owner_pid == os.getpid()
    with open(cxl.path, "r+b") as raw:  # a byte inside the header's capacity field
        raw.seek(20)
        raw.write(b"\xff")
    with pytest.raises(errors.ChecksumError):
        CxlArenaReader.open(cxl.path)


def test_reader_in_this_process_matches_and_checks_ranges(cxl: CxlTier) -> None:
    arr, header, payload = make_object(layers=5)
    extent = store(cxl, header, payload)
    with CxlArenaReader.open(cxl.path) as reader:
        got_header, view = reader.read_object(extent.offset, layers=range(1, 4))
        assert got_header == header
        np.testing.assert_array_equal(view, arr[1:4])
        with pytest.raises(errors.LayerRangeError):
            reader.read_object(extent.offset, layers=range(3, 9))
        with pytest.raises(errors.FormatError):
            reader.read_object(cxl.capacity_bytes + 64)
        with pytest.raises(errors.FormatError):
            reader.read_object(extent.offset, nbytes=extent.nbytes + 1)
        with pytest.raises(errors.OutBufferError):
            reader.read_layers_into(extent.offset, header, LayerRange(0, 2), bytearray(10))
        with pytest.raises(errors.OutBufferError):
            reader.read_layers_into(extent.offset, header, LayerRange(0, 1), bytes(header.spec.layer_nbytes))
    with pytest.raises(errors.PoolClosedError):
        reader.read_header(extent.offset)


# -- ownership -------------------------------------------------------------------------


OWNER_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from tiers.cxl import CxlTier
    tier = CxlTier(sys.argv[1], 1 << 20)
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()  # hold the arena until killed
    """
)


def test_second_owner_is_refused_and_close_unlinks(arena_path: Path) -> None:
    tier = CxlTier(arena_path, 1 << 20)
    try:
        assert arena_path.stat().st_size == DATA_OFFSET + tier.capacity_bytes
        with pytest.raises(errors.PoolLockedError):
            CxlTier(arena_path, 1 << 20)
        assert arena_path.exists()  # the refused owner did not touch the live arena
    finally:
        tier.close()
    assert not arena_path.exists()
    with pytest.raises(errors.TierError):
        CxlArenaReader.open(arena_path)


def test_stale_arena_of_a_killed_owner_is_detected_and_reused(arena_path: Path) -> None:
    owner = Child(OWNER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
    try:
        with pytest.raises(errors.PoolLockedError):  # a live owner in another process
            CxlTier(arena_path, 1 << 20)
        with CxlArenaReader.open(arena_path) as reader:
            assert reader.owner_alive()
            assert reader.header.owner_pid == owner.proc.pid
            owner.proc.send_signal(signal.SIGKILL)
            owner.proc.wait()
            assert not reader.owner_alive()
        assert arena_path.exists()  # SIGKILL: nobody unlinked it
        with pytest.raises(errors.TierError, match="no live owner"):
            CxlArenaReader.open(arena_path)
    finally:
        owner.stop()
    tier = CxlTier(arena_path, 2 << 20)  # the stale file is taken over, resized
    try:
        with CxlArenaReader.open(arena_path) as reader:
            assert reader.header.owner_pid == os.getpid()
            assert reader.header.capacity_bytes == 2 << 20
    finally:
        tier.close()


@pytest.fixture
def tiny_shm(tmpfs) -> Path:
    """A real 4 MiB tmpfs (root only)."""
    return tmpfs("4m")


def fill_up(directory: Path) -> None:
    """Write a file in ``directory`` until its filesystem is full."""
    filler = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with pytest.raises(OSError):
            while True:
                os.write(filler, b"\xff" * 4096)
    finally:
        os.close(filler)


def test_arena_larger_than_its_filesystem_is_lowered_to_what_fits(tiny_shm: Path, caplog) -> None:
    tier = CxlTier(tiny_shm / "kvpool-tiny-cxl", 64 << 20)
    try:
        assert 1 << 20 <= tier.capacity_bytes < 4 << 20
        assert "capacity lowered" in caplog.text and str(tiny_shm) in caplog.text
        arr, header, payload = make_object(layers=4, tokens=64, seed=5)
        extent = store(tier, header, payload)  # the lowered arena really holds objects
        out = np.empty_like(arr)
        tier.read_layers(extent, header, LayerRange(0, 4), byte_view(out))
        np.testing.assert_array_equal(out, arr)
    finally:
        tier.close()


def test_arena_that_cannot_fit_at_all_fails_at_start(tiny_shm: Path) -> None:
    filler = tiny_shm / "filler"
    filler.write_bytes(b"\0" * (3584 << 10))  # leaves well under 1 MiB
    with pytest.raises(errors.CapacityError):
        CxlTier(tiny_shm / "kvpool-tiny-cxl", 64 << 20)
    assert not (tiny_shm / "kvpool-tiny-cxl").exists()


def test_a_growing_arena_meets_a_full_filesystem_as_a_lower_capacity(tiny_shm: Path, caplog) -> None:
    """The arena file is allocated as objects reach it: a /dev/shm filled meanwhile lowers the
    tier's capacity to what it has (DiskFullError, as a full disk does for nvme), never a SIGBUS."""
    tier = CxlTier(tiny_shm / "kvpool-tiny-cxl", 2 << 20)
    tier.grow_step_bytes = 1 << 20
    try:
        assert tier.ready_bytes == 0 and os.stat(tier.path).st_blocks * 512 < 1 << 20  # sparse at start
        arr, header, payload = make_object(layers=4, tokens=64, seed=7)
        first = store(tier, header, payload)
        assert tier.ready_bytes == 1 << 20 and os.stat(tier.path).st_blocks * 512 >= 1 << 20
        fill_up(tiny_shm)  # another user takes the rest
        big = tier.allocated_size(1 << 20)
        with pytest.raises(errors.DiskFullError):
            tier.allocate(big)
        assert tier.capacity_bytes == 1 << 20 and "is full" in caplog.text
        out = np.empty_like(arr)
        tier.read_layers(first, header, LayerRange(0, 4), byte_view(out))  # what it held is intact
        np.testing.assert_array_equal(out, arr)
    finally:
        tier.close()


def _wait_for(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_an_arena_readies_ahead_of_its_puts_in_the_background_and_stops_at_a_full_filesystem(
        tiny_shm: Path, caplog) -> None:
    """With ``ready_ahead`` a thread keeps that much of the arena allocated beyond the highest
    object (puts then write to pages that exist), never beyond the capacity; a filesystem
    filled meanwhile stops it quietly and the puts meet the full disk themselves, as without it."""
    tier = CxlTier(tiny_shm / "kvpool-tiny-cxl", 3 << 20, ready_ahead=1 << 20)
    tier.grow_step_bytes = 1 << 19
    try:
        assert tier.ready_bytes == 0 and os.stat(tier.path).st_blocks * 512 < 1 << 19  # nothing before a put
        arr, header, payload = make_object(layers=4, tokens=64, seed=9)
        first = store(tier, header, payload)
        # the readier allocates up to ready_ahead past the object, in whole steps
        want = -(-(tier.used_end + (1 << 20)) // (1 << 19)) * (1 << 19)
        assert _wait_for(lambda: tier.ready_bytes == want), (tier.ready_bytes, want)
        assert os.stat(tier.path).st_blocks * 512 >= want
        assert [t for t in threading.enumerate() if t.name == "kvpool-cxl-ready"]
        fill_up(tiny_shm)  # another user takes the rest
        with pytest.raises(errors.DiskFullError):  # beyond what was readied: the put meets the full disk
            while True:
                store(tier, header, payload)
        assert tier.capacity_bytes >= want  # what was readied stays usable
        out = np.empty_like(arr)
        tier.read_layers(first, header, LayerRange(0, 4), byte_view(out))
        np.testing.assert_array_equal(out, arr)
    finally:
        tier.close()
    assert not [t for t in threading.enumerate() if t.name == "kvpool-cxl-ready"]  # joined by close


def test_from_config_names_the_arena_after_the_pool() -> None:
    config = Config()
    config.pool.name = f"test {uuid.uuid4().hex[:8]}/x"
    config.tiers.cxl.capacity = 1 << 20
    config.tiers.cxl.bandwidth_gbps = 64.0
    tier = CxlTier.from_config(config.tiers.cxl, config)
    try:
        assert tier.path == default_arena_path(config.pool.name, config.pool.data_dir)
        # in this user's own directory, which no one else may create names in
        assert tier.path.parent == Path(f"/dev/shm/kvpool-{os.geteuid()}") and "/" not in tier.path.name
        st = os.lstat(tier.path.parent)
        assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) & 0o022 == 0
        assert tier.path.exists()
        stats = tier.stats()
        assert stats["shared"] is True and stats["path"] == str(tier.path)
        assert stats["model"]["bandwidth_gbps"] == 64.0
    finally:
        tier.close()
    assert not tier.path.exists()


# -- the latency / bandwidth model ------------------------------------------------------


def test_bandwidth_model_slows_a_large_read(arena_path: Path) -> None:
    nbytes = 16 << 20
    tier = CxlTier(arena_path, nbytes + (1 << 20), bandwidth_gbps=1.0)
    try:
        extent = tier.allocate(nbytes)
        assert extent is not None
        tier.write(extent, 0, np.full(nbytes, 7, dtype=np.uint8))
        out = np.empty(nbytes, dtype=np.uint8)
        start = time.perf_counter()
        tier.read_into(extent, 0, out)
        elapsed = time.perf_counter() - start
        assert elapsed >= 0.014  # modelled: 16.8 ms at 1 GB/s, minus at most the sleep threshold
        assert out[0] == out[-1] == 7
        model = tier.stats()["model"]
        assert model["modelled_delay_s"] >= 2 * nbytes / 1e9 * 0.99  # the write and the read
    finally:
        tier.close()


def test_latency_model_accumulates_small_accesses(arena_path: Path) -> None:
    tier = CxlTier(arena_path, 1 << 20, latency_ns=50_000)  # 50 us: below the sleep threshold
    try:
        extent = tier.allocate(4096)
        assert extent is not None
        out = bytearray(64)
        start = time.perf_counter()
        for _ in range(400):
            tier.read_into(extent, 0, out)
        assert time.perf_counter() - start >= 400 * 50e-6 - 2 * 100e-6
        assert tier.stats()["model"]["slept_s"] > 0
    finally:
        tier.close()


def test_no_model_means_no_sleeping(arena_path: Path) -> None:
    tier = CxlTier(arena_path, 1 << 20)
    try:
        extent = tier.allocate(4096)
        assert extent is not None
        tier.read_into(extent, 0, bytearray(4096))
        model = tier.stats()["model"]
        assert model["enabled"] is False and model["slept_s"] == 0.0
    finally:
        tier.close()


# -- restarts, reuse races and stale arenas -------------------------------------------------

# Maps an arena, then reads every page of the mapping in a loop until stdin closes;
# a truncated-under-it arena would kill it with SIGBUS (exit code -7).
MAPPING_READER_SCRIPT = textwrap.dedent(
    """
    import json, sys, threading
    from tiers.cxl import CxlArenaReader
    reader = CxlArenaReader.open(sys.argv[1])
    done = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.readline(), done.set()), daemon=True).start()
    print(json.dumps({"ready": True}), flush=True)
    passes = 0
    while not done.is_set():
        int(reader.arena[::4096].sum())  # touches every page
        passes += 1
    print(json.dumps({"passes": passes, "current": reader.current()}), flush=True)
    """
)


def test_restarting_an_owner_never_faults_readers_of_the_old_arena(arena_path: Path) -> None:
    """kill -9 the owner, start a new one (smaller) at the same path: a process still
    mapping the old arena keeps reading valid memory and sees it is no longer current."""
    owner = Child(OWNER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
    reader = None
    try:
        reader = Child(MAPPING_READER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
        old_inode = arena_path.stat().st_ino
        tier = CxlTier(arena_path, 512 << 10)  # smaller than the killed owner's 1 MiB
        try:
            assert arena_path.stat().st_ino != old_inode  # replaced, not truncated in place
            time.sleep(0.2)  # the reader keeps touching the old mapping meanwhile
            assert reader.proc.stdin is not None
            reader.proc.stdin.write("\n")
            reader.proc.stdin.flush()
            answer = reader.recv()
            assert answer["passes"] > 0 and answer["current"] is False
            assert reader.proc.wait(CHILD_TIMEOUT_S) == 0
        finally:
            tier.close()
    finally:
        owner.stop()
        if reader is not None:
            reader.stop()


def test_find_refuses_an_extent_reused_by_another_key(cxl: CxlTier) -> None:
    """The interleaving that returned another key's bytes: the index still names key A at
    an offset the owner has meanwhile filled with key B's object (even with B's header sum)."""
    from kvpool.objformat import ObjectHeader, layer_checksums, spec_of
    from tiers.cxl.index import IndexEntry

    def obj(key: bytes, seed: int):
        arr = np.random.default_rng(seed).standard_normal((4, 2, 16, 2, 32)).astype("float16")
        spec, arr = spec_of(arr)
        payload = byte_view(arr)
        return arr, ObjectHeader.for_key(key, spec, layer_checksums(payload, spec.layer_nbytes)), payload

    arr_a, header_a, payload_a = obj(b"key-a", 1)
    extent = store(cxl, header_a, payload_a)
    cxl.commit(b"key-a", extent, header_a)
    with CxlArenaReader.open(cxl.path) as reader:
        def out_view(spec, rng):
            out = np.empty(spec.array_shape(rng), dtype="float16")
            return out, byte_view(out)

        got = reader.read_key_into(b"key-a", None, out_view)
        assert got is not None and np.array_equal(got[0], arr_a)
        # The owner reuses the extent for B, and a stale index entry for A names B's header sum.
        _, header_b, payload_b = obj(b"key-b", 2)
        cxl.write_object(extent, header_b, payload_b)
        assert cxl.index is not None
        cxl.index.insert(b"key-a", IndexEntry(extent.offset, extent.nbytes, header_b.checksum()))
        assert reader.find(b"key-a") is None
        assert reader.read_key_into(b"key-a", None, out_view) is None
        cxl.write(extent, header_b.nbytes, payload_a)  # B's header, A's payload: still not A
        assert reader.read_key_into(b"key-a", None, out_view) is None
        # A header found for A whose payload is then overwritten mid-read: the copy fails its checksums.
        cxl.write_object(extent, header_a, payload_a)
        cxl.index.insert(b"key-a", IndexEntry(extent.offset, extent.nbytes, header_a.checksum()))
        found = reader.find(b"key-a")
        assert found is not None
        cxl.write(extent, header_a.nbytes, payload_b)
        out = np.empty(header_a.spec.shape, dtype="float16")
        with pytest.raises(errors.ChecksumError):
            reader.read_layers_into(found[0], found[1], LayerRange(0, 4), byte_view(out))


def committed(cxl: CxlTier, key: bytes, seed: int, layers: int = 4) -> tuple[np.ndarray, ObjectHeader, Any, Any]:
    """A random float16 object of ``layers`` layers stored and committed under ``key``: (its
    array, header, payload view, extent)."""
    from kvpool.objformat import layer_checksums, spec_of

    arr = np.random.default_rng(seed).standard_normal((layers, 2, 16, 2, 32)).astype("float16")
    spec, arr = spec_of(arr)
    payload = byte_view(arr)
    header = ObjectHeader.for_key(key, spec, layer_checksums(payload, spec.layer_nbytes))
    extent = store(cxl, header, payload)
    cxl.commit(key, extent, header)
    return arr, header, payload, extent


@pytest.mark.parametrize("copies", ["one C call", "one by one"])
def test_a_batched_read_judges_every_object_on_its_own_copy(cxl: CxlTier, copies: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """``find_many`` + ``read_many_into`` (a same-host get_many's path): one C call copies a
    whole batch, and each object is judged on the bytes its own copy holds. Interleaving: the
    reader finds A, B and C; then the owner overwrites B's extent (its payload, then the whole
    object with key D's) before the copy. Only B is refused; A and C land exact; a stale index
    entry is a miss at find."""
    import tiers.cxl.reader
    from tiers.cxl.index import IndexEntry

    if copies == "one by one":  # an install without the C extension
        monkeypatch.setattr(tiers.cxl.reader, "_copy_spans", None)
    else:
        pytest.importorskip("kvpool._layersum", reason="the C extension is not built here")

    def obj(key: bytes, seed: int, layers: int = 4):
        return committed(cxl, key, seed, layers)

    a, b, c = obj(b"key-a", 1), obj(b"key-b", 2, layers=6), obj(b"key-c", 3)
    with CxlArenaReader.open(cxl.path) as reader:
        found = reader.find_many([b"key-a", b"missing", b"key-b", b"key-c"])
        assert found[1] is None
        assert [f[0] for f in (found[0], found[2], found[3])] == [a[3].offset, b[3].offset, c[3].offset]
        assert [f[2] for f in (found[0], found[2], found[3])] == [a[1].checksum(), b[1].checksum(), c[1].checksum()]
        wanted = [(found[0][0], found[0][1], LayerRange(0, 4)), (found[2][0], found[2][1], LayerRange(1, 5)),
                  (found[3][0], found[3][1], LayerRange(2, 4))]

        def outs():
            arrays = [np.zeros(h.spec.array_shape(r), "float16") for _, h, r in wanted]
            return arrays, [byte_view(x) for x in arrays]

        arrays, views = outs()
        assert reader.read_many_into(wanted, views) == [True, True, True]
        assert np.array_equal(arrays[0], a[0]) and np.array_equal(arrays[1], b[0][1:5])
        assert np.array_equal(arrays[2], c[0][2:4])

        _, _, payload_x, _ = obj(b"key-x", 9, layers=6)  # B's extent gets other bytes, same length
        cxl.write(b[3], b[1].nbytes, payload_x)
        arrays, views = outs()
        assert reader.read_many_into(wanted, views) == [True, False, True]
        assert np.array_equal(arrays[0], a[0]) and np.array_equal(arrays[2], c[0][2:4])

        # B's extent reused whole by D; the index still names B there: a miss at find.
        _, header_d, payload_d, _ = obj(b"key-d", 4, layers=6)
        cxl.write_object(b[3], header_d, payload_d)
        assert cxl.index is not None
        cxl.index.insert(b"key-b", IndexEntry(b[3].offset, b[3].nbytes, header_d.checksum()))
        assert reader.find_many([b"key-b", b"key-a"])[0] is None

        with pytest.raises(errors.OutBufferError):  # a wrongly sized out: refused before any copy
            reader.read_many_into(wanted[:1], [byte_view(np.zeros(7, "float16"))])


def test_the_c_probe_finds_what_the_python_probe_finds_and_nothing_else(cxl: CxlTier,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``find_many`` through ``kvpool._index.find_shared`` (one C pass: each slot read under its
    seqlock, one snapshot of the header checked on that copy) answers key by key what the Python
    probe answers, over intact objects and every way an entry or its header can be wrong: each
    damaged one a miss, never another object's header."""
    import struct

    import tiers.cxl.reader
    from tiers.cxl.index import IndexEntry

    if tiers.cxl.reader.find_shared is None:
        pytest.skip("the C extension is not built here")

    def obj(key: bytes, seed: int, layers: int = 4):
        _, header, _, extent = committed(cxl, key, seed, layers)
        return header, extent

    # 1 layer: a 88-byte header; 4: 112; 40: 400 (xxh3's short, mid and long inputs alike)
    made = {name: obj(name.encode(), seed, layers) for seed, (name, layers) in enumerate(
        [("intact-1", 1), ("intact-4", 4), ("intact-40", 40), ("index-sum", 4), ("header-sum", 4), ("claimed-huge", 4),
         ("claimed-short", 40), ("digest", 4), ("magic", 4), ("offset-out", 4), ("nbytes", 4), ("reused", 4),
         ("version", 4)])}
    assert cxl.index is not None

    def patch(name: str, at: int, data: bytes) -> None:
        cxl.write(made[name][1], at, data)

    patch("index-sum", 68, struct.pack("<Q", made["index-sum"][0].checksum() ^ 1))  # not the version indexed
    patch("header-sum", 80, b"\xff")  # a layer checksum: the header's own checksum fails
    patch("claimed-huge", 8, struct.pack("<I", 1 << 20))
    patch("claimed-short", 8, struct.pack("<I", 80))  # fewer bytes than its 40 layers' checksums
    patch("digest", 44, b"\x00")  # names another key
    patch("magic", 0, b"XXXX")
    patch("version", 4, struct.pack("<H", 99))
    header, extent = made["offset-out"]
    cxl.index.insert(b"offset-out", IndexEntry(cxl.capacity_bytes - 40, extent.nbytes, header.checksum()))
    header, extent = made["nbytes"]
    cxl.index.insert(b"nbytes", IndexEntry(extent.offset, extent.nbytes + 64, header.checksum()))
    header, extent = made["intact-4"]  # an extent reused by another key, its header sum and all
    cxl.index.insert(b"reused", IndexEntry(extent.offset, extent.nbytes, header.checksum()))

    keys = [name.encode() for name in made] + [b"absent"]
    with CxlArenaReader.open(cxl.path) as reader:
        in_c = reader.find_many(keys)
        monkeypatch.setattr(tiers.cxl.reader, "find_shared", None)
        in_python = reader.find_many(keys)
    assert in_c == in_python
    found = {key.decode() for key, hit in zip(keys, in_c) if hit is not None}
    assert found == {"intact-1", "intact-4", "intact-40"}
    for key, hit in zip(keys, in_c):
        if hit is not None:
            header, extent = made[key.decode()]
            assert hit == (extent.offset, header, header.checksum())


def test_stale_arenas_of_dead_owners_are_collected(arena_path: Path) -> None:
    from tiers.cxl import collect_stale_arenas
    from tiers.cxl.index import index_path

    live = CxlTier(arena_path.with_name(arena_path.name.replace("-cxl", "-live-cxl")), 1 << 20)
    owner = Child(OWNER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
    try:
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
        assert arena_path.exists() and index_path(arena_path).exists()
        removed = collect_stale_arenas(arena_path.parent)
        assert arena_path in removed
        assert not arena_path.exists() and not index_path(arena_path).exists()
        assert live.path.exists() and live.path not in removed  # a live owner's arena stays
    finally:
        owner.stop()
        live.close()


def killed_owner_left(arena_path: Path) -> None:
    """An owner process of an arena at ``arena_path``, killed -9: its arena stays behind."""
    owner = Child(OWNER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
    try:
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
    finally:
        owner.stop()


def test_a_starting_tier_spares_a_freshly_dead_owners_arena_for_its_rescue_then_collects_it(
        arena_path: Path) -> None:
    """A tier that starts collects dead owners' arenas, but not one touched within
    DEAD_OWNER_GRACE_S (its owner's heartbeat touches it): the master may still have a storage
    node rescue its objects. Past that it is collected; ``collect_stale_arenas`` without a
    grace (``kvpool gc``) collects at once."""
    from tiers.cxl import collect_stale_arenas
    from tiers.cxl.tier import DEAD_OWNER_GRACE_S

    killed_owner_left(arena_path)
    starters = [arena_path.with_name(arena_path.name.replace("-cxl", f"-starter{i}-cxl")) for i in range(2)]
    CxlTier(starters[0], 1 << 20).close()  # freshly dead: spared
    assert arena_path.exists()
    with CxlArenaReader.open(arena_path, require_owner=False) as reader:  # (a rescuer can still read it)
        assert not reader.owner_alive()
    past = time.time() - DEAD_OWNER_GRACE_S - 1
    os.utime(arena_path, (past, past))  # as if its owner's last heartbeat were that long ago
    CxlTier(starters[1], 1 << 20).close()
    assert not arena_path.exists()
    killed_owner_left(arena_path)
    assert collect_stale_arenas(arena_path.parent) == [arena_path]  # no grace: at once


def test_an_owner_touching_its_arena_moves_its_mtime(arena_path: Path) -> None:
    tier = CxlTier(arena_path, 1 << 20)
    try:
        past = time.time() - 100
        os.utime(arena_path, (past, past))
        tier.mark_in_use()
        assert time.time() - arena_path.stat().st_mtime < 10
    finally:
        tier.close()


def test_reader_refuses_a_fifo_and_a_symlink(tmp_path: Path) -> None:
    fifo = tmp_path / "kvpool-fifo-cxl"
    os.mkfifo(fifo)
    started = time.monotonic()
    with pytest.raises(errors.TierError):
        CxlArenaReader.open(fifo, require_owner=False)
    assert time.monotonic() - started < 5.0  # never blocks on the FIFO's open
    link = tmp_path / "kvpool-link-cxl"
    link.symlink_to("/etc/passwd")
    with pytest.raises(errors.TierError):
        CxlArenaReader.open(link, require_owner=False)


def test_kvpool_gc_removes_the_arena_of_a_killed_owner(arena_path: Path) -> None:
    owner = Child(OWNER_SCRIPT.replace("sys.argv[1]", repr(str(arena_path))))
    try:
        owner.proc.send_signal(signal.SIGKILL)
        owner.proc.wait()
        assert arena_path.exists()
        done = subprocess.run([sys.executable, "-m", "kvpool.cli", "gc", "--dir", str(arena_path.parent)],
                              capture_output=True, text=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr
        assert f"removed {arena_path}" in done.stdout
        assert not arena_path.exists()
    finally:
        owner.stop()


# -- another Unix user: only by explicit group ---------------------------------------------------

GROUP_READER = textwrap.dedent(
    """
    import json, sys
    import numpy as np, xxhash
    from kvpool.objformat import LayerRange
    from tiers.cxl import CxlArenaReader

    path, key = sys.argv[1], sys.argv[2].encode()
    try:
        reader = CxlArenaReader.open(path)
        out = {}
        got = reader.read_key_into(key, LayerRange(0, 2), lambda spec, rng: (
            out.setdefault("a", np.empty(spec.array_shape(rng), spec.dtype)),
            memoryview(out["a"].reshape(-1).view(np.uint8))))
        arr = got[0]
        print(json.dumps({"digest": xxhash.xxh3_128_hexdigest(memoryview(np.ascontiguousarray(arr)).cast("B"))}))
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    """
)


@pytest.mark.parametrize("shared", [False, True], ids=["private", "group"])
def test_another_user_reads_an_arena_only_through_its_configured_group(arena_path: Path, shared: bool) -> None:
    from tests.conftest import NOBODY, as_nobody, nobody_python

    python, env = nobody_python()
    if not str(arena_path).startswith("/dev/shm/"):
        pytest.skip("needs /dev/shm")
    tier = CxlTier(arena_path, 1 << 20, group=NOBODY if shared else None)
    try:
        arr, header, payload = make_object(layers=4, seed=7)
        header = ObjectHeader.for_key(b"shared-key", header.spec, header.layer_checksums)
        extent = store(tier, header, payload)
        tier.commit(b"shared-key", extent, header)
        for path in (arena_path, Path(f"{arena_path}.index")):
            st = path.stat()
            assert oct(st.st_mode & 0o777) == oct(0o640 if shared else 0o600), path
            if shared:
                assert st.st_gid == NOBODY, path
        proc = subprocess.run([python, "-c", GROUP_READER, str(arena_path), "shared-key"], capture_output=True,
                              text=True, timeout=60, env=env, preexec_fn=as_nobody, cwd="/")
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"stderr": proc.stderr}
        if shared:
            assert result == {"digest": digest(arr[0:2])}, result
        else:
            assert result.get("error") == "TierError" and "Permission denied" in result.get("message", ""), result
    finally:
        tier.close()


# -- arena-path squatting: another user's names are never this user's arena -------------------------


@pytest.fixture
def shared_shm(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A world-writable sticky directory like /dev/shm (inside it, so the user nobody can reach it),
    standing in for it as ``tiers.cxl.arena.SHM_DIR``; removed at teardown."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as the user nobody")
    root = Path("/dev/shm") / f"kvpool-test-squat-{uuid.uuid4().hex[:12]}"
    root.mkdir()
    os.chmod(root, 0o1777)
    monkeypatch.setattr("tiers.cxl.arena.SHM_DIR", root)
    try:
        yield root
    finally:
        subprocess.run(["rm", "-rf", str(root)], check=False)


def as_nobody(*argv: str) -> None:
    from tests.conftest import as_nobody as become_nobody

    subprocess.run(argv, check=True, preexec_fn=become_nobody, timeout=10)


def test_a_user_directory_planted_by_another_user_is_refused_naming_the_owner(shared_shm: Path) -> None:
    config = Config()
    config.pool.name = "squatted"
    config.tiers.cxl.capacity = 1 << 20
    as_nobody("mkdir", "-m", "0777", str(shared_shm / f"kvpool-{os.geteuid()}"))
    with pytest.raises(errors.ForeignOwnerError, match=r"belongs to nobody \(uid 65534\)"):
        CxlTier.from_config(config.tiers.cxl, config)
    os.rmdir(shared_shm / f"kvpool-{os.geteuid()}")
    as_nobody("ln", "-s", "/tmp", str(shared_shm / f"kvpool-{os.geteuid()}"))  # a symlink is not followed
    with pytest.raises(errors.ForeignOwnerError, match="nobody"):
        CxlTier.from_config(config.tiers.cxl, config)
    assert not list(Path("/tmp").glob("kvpool-squatted-*cxl"))


def test_the_user_directory_is_private_and_a_loose_one_is_tightened(shared_shm: Path) -> None:
    config = Config()
    config.pool.name = "mine"
    config.tiers.cxl.capacity = 1 << 20
    mine = shared_shm / f"kvpool-{os.geteuid()}"
    for before in (None, 0o777):
        if before is not None:
            os.chmod(mine, before)
        tier = CxlTier.from_config(config.tiers.cxl, config)
        try:
            assert tier.path.parent == mine and tier.path.name.startswith("kvpool-mine-")
            assert stat.S_IMODE(os.lstat(mine).st_mode) == 0o700
            with pytest.raises(subprocess.CalledProcessError):  # nobody cannot create names there
                as_nobody("touch", str(mine / "kvpool-other-cxl"))
        finally:
            tier.close()


def test_an_explicit_path_to_another_users_file_is_refused_naming_the_owner(shared_shm: Path) -> None:
    arena = shared_shm / "explicit-arena"
    as_nobody("touch", str(arena))
    with pytest.raises(errors.ForeignOwnerError, match=r"arena file .* belongs to nobody"):
        CxlTier(arena, 1 << 20)
    assert arena.stat().st_uid == 65534  # left alone
    other = shared_shm / "other-arena"
    as_nobody("touch", f"{other}.index")
    with pytest.raises(errors.ForeignOwnerError, match=r"arena index .* belongs to nobody"):
        CxlTier(other, 1 << 20)
    tier = CxlTier(shared_shm / "own-arena", 1 << 20)  # an explicit path of this user's own works
    tier.close()


@pytest.mark.timeout(120)
def test_the_server_starts_while_another_user_squats_the_old_arena_name(tmp_path: Path, spawn_python) -> None:
    """The user nobody creates /dev/shm/kvpool-<pool>-cxl (the name older builds used) and holds a
    shared flock on it: kvpool-server with that pool name still starts, in its own directory."""
    from tests.conftest import as_nobody as become_nobody
    from tests.conftest import free_tcp_port, wait_for

    if os.geteuid() != 0:
        pytest.skip("needs root to act as the user nobody")
    name = f"squat-{uuid.uuid4().hex[:8]}"
    squatted = Path("/dev/shm") / f"kvpool-{name}-cxl"
    squatter = subprocess.Popen(["flock", "-s", str(squatted), "sleep", "60"], preexec_fn=become_nobody)
    try:
        wait_for(lambda: squatted.exists(), 10, "the squatter to create and lock the old name")
        log = tmp_path / "server.log"
        spawn_python(["-m", "kvpool.cli.server", "--pool.name", name, "--pool.data_dir", str(tmp_path / "data"),
                      "--master.listen", f"tcp://127.0.0.1:{free_tcp_port()}", "--tiers.dram.capacity", "4MiB",
                      "--tiers.dram.mlock", "false", "--tiers.cxl.capacity", "4MiB", "--tiers.nvme.capacity", "0",
                      "--security.key_file", str(tmp_path / "cluster.key")],
                     log_path=log, ready=lambda: "ready" in log.read_text(), timeout_s=60)
        arena = default_arena_path(name, tmp_path / "data")
        assert arena.parent == Path(f"/dev/shm/kvpool-{os.geteuid()}") and arena.exists()
        assert squatted.stat().st_uid == 65534  # untouched
    finally:
        squatter.kill()
        squatter.wait()
        squatted.unlink(missing_ok=True)


def test_a_group_shared_arena_in_the_user_directory_is_readable_by_that_group(shared_shm: Path) -> None:
    """tiers.cxl.group: the user directory becomes 0710 in that group, so its members reach the arena."""
    from tests.conftest import NOBODY, nobody_python
    from tests.conftest import as_nobody as become_nobody

    python, env = nobody_python()
    config = Config()
    config.pool.name = "grouped"
    config.tiers.cxl.capacity = 1 << 20
    config.tiers.cxl.group = str(NOBODY)
    tier = CxlTier.from_config(config.tiers.cxl, config)
    try:
        st = os.lstat(tier.path.parent)
        assert stat.S_IMODE(st.st_mode) == 0o710 and st.st_gid == NOBODY
        arr, header, payload = make_object(layers=4, seed=7)
        header = ObjectHeader.for_key(b"shared-key", header.spec, header.layer_checksums)
        tier.commit(b"shared-key", store(tier, header, payload), header)
        proc = subprocess.run([python, "-c", GROUP_READER, str(tier.path), "shared-key"], capture_output=True,
                              text=True, timeout=60, env=env, preexec_fn=become_nobody, cwd="/")
        result = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.stdout.strip() else {"stderr": proc.stderr}
        assert result == {"digest": digest(arr[0:2])}, result
    finally:
        tier.close()


def test_copying_layers_out_maps_each_chunk_of_the_arena_once(arena_path: Path, monkeypatch) -> None:
    """A layer-by-layer copy of many objects asks the kernel to map their pages once per 2 MiB
    chunk, not once per layer of each object (that walk cost a third of a same-host load's
    copy time), and every copy is still verified and exact."""
    import tiers.cxl.reader as reader_module
    from kvpool.objformat import layer_checksums, spec_of

    calls: list[tuple[int, int, int]] = []

    def counting(region: Any, advice: int, start: int, length: int) -> None:
        calls.append((advice, start, length))
        madvise(region, advice, start, length)

    tier = CxlTier(arena_path, 16 << 20)
    try:
        objects = []
        for seed in range(6):  # 6 objects of 1 MiB (4 layers of 256 KiB): 6 MiB and headers
            arr = np.random.default_rng(seed).integers(0, 1 << 16, (4, 2, 128, 8, 64), dtype=np.uint16)
            payload = byte_view(arr)
            spec, _ = spec_of(arr.view(np.float16))
            header = ObjectHeader.for_key(b"k%d" % seed, spec, layer_checksums(payload, spec.layer_nbytes))
            extent = store(tier, header, payload)
            tier.commit(b"k%d" % seed, extent, header)
            objects.append(arr)
        with CxlArenaReader.open(tier.path) as reader:
            monkeypatch.setattr(reader_module, "madvise", counting)
            found = [f for f in (reader.find(b"k%d" % seed) for seed in range(6)) if f is not None]
            assert len(found) == 6
            outs = np.zeros((2, 4, 6, 2, 128, 8, 64), np.uint16)
            for rep in range(2):
                for layer in range(4):
                    ok = reader.copy_layer_out(layer, found, [byte_view(outs[rep, layer, i]) for i in range(6)])
                    assert ok == [True] * 6
                if rep == 0:  # the 4 chunks under the objects, at most: not 24 spans
                    first_pass = len(calls)
                    assert 1 <= first_pass <= 4
                    assert 6 << 20 <= sum(n for _, _, n in calls) <= 8 << 20
            assert len(calls) == first_pass  # the second pass asks nothing again
            for rep in range(2):
                for i, arr in enumerate(objects):
                    assert np.array_equal(outs[rep, :, i], arr)
    finally:
        tier.close()


def _mapping_rss(address: int) -> int:
    """Resident bytes of this process's mapping that starts at ``address`` (/proc/self/smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("-", 1)[0] == f"{address:x}":
            return next(int(rss.split()[1]) << 10 for rss in lines[i + 1:] if rss.startswith("Rss:"))
    raise AssertionError(f"no mapping at {address:x}")


def test_map_ahead_maps_what_the_owner_allocated_and_allocates_nothing(arena_path: Path) -> None:
    """``map_ahead`` maps, in the background, the pages of the owner's arena that are allocated
    (so a same-host read finds them mapped); the holes beyond stay holes (a read fault there
    would allocate pages in the owner's file); a second call with nothing new starts nothing,
    and one after the owner allocated more maps that; a closed reader maps nothing."""
    tier = CxlTier(arena_path, 256 << 20, ready_ahead=0)  # allocated in 16 MiB steps as used
    try:
        arr, header, payload = make_object(layers=8, tokens=4096)  # 8 MiB
        first = store(tier, header, payload)
        allocated = os.stat(arena_path).st_blocks * 512
        assert allocated < 64 << 20  # a sparse arena: what the object needed
        reader = CxlArenaReader.open(arena_path)
        try:
            at = reader.arena.ctypes.data - DATA_OFFSET
            assert _mapping_rss(at) < 1 << 20
            assert reader.map_ahead()
            reader._ahead.join(30)
            mapped = _mapping_rss(at)
            assert mapped >= tier.ready_bytes - (2 << 20), (mapped, tier.ready_bytes)
            assert os.stat(arena_path).st_blocks * 512 == allocated  # no hole was filled
            assert not reader.map_ahead()  # nothing new
            for _ in range(3):  # 24 MiB more: the owner allocates further steps
                store(tier, header, payload)
            assert reader.map_ahead()
            reader._ahead.join(30)
            assert _mapping_rss(at) >= tier.ready_bytes - (2 << 20) > mapped
            got_header, view = reader.read_object(first.offset)
            assert got_header == header
            np.testing.assert_array_equal(view, arr)
            del view
            assert reader.map_ahead() is False
        finally:
            reader.close()
        assert reader.map_ahead() is False  # closed: nothing
    finally:
        tier.close()


def test_madvise_maps_a_range_without_holding_the_gil() -> None:
    """``tiers.base.madvise`` populates the range asked for (writable and read-only mappings),
    refuses a start outside the mapping, and lets the process's other threads run while the
    kernel works: CPython's ``mmap.madvise`` holds the GIL, so a readier thread populating
    16 MiB steps stalled the puts it readied for."""
    import mmap

    nbytes = 288 << 20
    path = Path("/dev/shm") / f"kvpool-test-madvise-{uuid.uuid4().hex}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
        rw = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        ro = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        try:
            rw_at = np.frombuffer(rw, np.uint8).ctypes.data
            ro_at = np.frombuffer(ro, np.uint8).ctypes.data
            assert _mapping_rss(rw_at) == 0 and _mapping_rss(ro_at) == 0
            madvise(ro, 22, 16 << 20, 8 << 20)  # MADV_POPULATE_READ of 8 MiB
            assert _mapping_rss(ro_at) == 8 << 20
            with pytest.raises(ValueError):
                madvise(rw, 23, nbytes, 4096)

            # While another thread populates 256 MiB writable, the main thread waits for 10 ms
            # past the call's start, then notes the time once (noting it allocating all along
            # would stall it: growing a list maps memory, which waits for the mmap lock the
            # populate holds). With the GIL held through the call, it could note it only once
            # the call returned (a little before the worker notes the end: the worker then
            # waits for the GIL in its turn).
            span: list[float] = []
            seen: list[float] = []
            done = threading.Event()

            def populate() -> None:
                span.append(time.monotonic())
                madvise(rw, 23, 0, 256 << 20)  # MADV_POPULATE_WRITE
                span.append(time.monotonic())
                done.set()

            worker = threading.Thread(target=populate)
            worker.start()
            while not done.is_set():
                if span and not seen and time.monotonic() > span[0] + 0.01:
                    seen.append(time.monotonic())
            worker.join()
            assert _mapping_rss(rw_at) == 256 << 20
            start, end = span
            if end - start < 0.04:
                pytest.skip(f"populating 256 MiB took {1e3 * (end - start):.0f} ms: too quick to tell")
            assert seen and seen[0] - start < (end - start) / 2, \
                f"the main thread did not run in the first half of the {1e3 * (end - start):.0f} ms call"
        finally:
            rw.close()
            ro.close()
    finally:
        os.close(fd)
        path.unlink()


# -- huge pages ------------------------------------------------------------------------------


def _pmd_mapped_kib(path: Path) -> list[int]:
    """ShmemPmdMapped (kB) of each of this process's mappings of ``path`` (/proc/self/smaps;
    madvise of part of a mapping splits it, so one mmap may be several)."""
    found: list[int] = []
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if len(fields) >= 6 and "-" in fields[0] and ":" in fields[3]:  # a mapping's first line
                inside = fields[-1] == str(path)
            elif inside and line.startswith("ShmemPmdMapped:"):
                found.append(int(fields[1]))
    return found


def test_an_arena_on_a_huge_page_tmpfs_is_mapped_2_mib_at_a_time_by_its_owner_and_readers(
        tmp_path: Path, arena_path: Path) -> None:
    """On a tmpfs mounted with huge=within_size the arena's pages are 2 MiB ones: the owner
    writes into them and a reader maps them a PMD at a time (the arena advises huge pages on
    both mappings); ``huge_pages`` says which the arena has. On /dev/shm (no huge= option) it
    says False."""
    plain = CxlTier(arena_path, 8 << 20)
    try:
        assert plain.huge_pages is (tmpfs_huge_pages(arena_path.parent) in ("always", "within_size", "advise"))
        assert plain.stats()["huge_pages"] is plain.huge_pages
    finally:
        plain.close()
    mount = tmp_path / "huge"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "huge=within_size,size=64m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        path = mount / "arena"
        tier = CxlTier(path, 32 << 20)
        try:
            assert tier.huge_pages and tier.stats()["huge_pages"]
            arr, header, payload = make_object(layers=8, tokens=2048)  # 4 MiB
            extent = store(tier, header, payload)
            owner_kib = sum(_pmd_mapped_kib(path))
            assert owner_kib >= 4096  # the object's 4 MiB written through 2 MiB pages
            with CxlArenaReader.open(path) as reader:
                got_header, view = reader.read_object(extent.offset)
                assert got_header == header
                np.testing.assert_array_equal(view, arr)
                assert sum(_pmd_mapped_kib(path)) - owner_kib >= 4096  # and read through them
        finally:
            tier.close()
    finally:
        subprocess.run(["umount", "--lazy", str(mount)], check=False)  # also while a failed assertion holds a view
