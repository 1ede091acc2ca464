"""SGLang HiCache storage backends side by side: kvpool, SGLang's HiCacheFile, Mooncake.

Pages move the way SGLang's cache controller moves them: through SGLang's own host pool
(``MHATokenToKVPoolHost``, page-first layout, on the CPU with ``pin_memory=False``) and the
backend SGLang's ``StorageBackendFactory`` makes, 128 pages per call (SGLang's storage batch).
For every page size, each backend stores ``--warmup + --calls`` batches of fresh pages and
reads each back; set and get are timed per 128-page call (GB/s over the timed calls, p50 ms per
call), and every page read is compared byte for byte with what was stored (untimed).

Rows (one run, taking turns, same layout and page contents):

* ``kvpool same host``: interface v1 (``batch_set_v1`` / ``batch_get_v1``, zero-copy into the
  host pool). A writer engine (a forked process with its own SGLang host pool and backend)
  stores into its pool's shared-memory arena (cxl tier only, as the vLLM connector's default
  pool); this process, the reader engine, reads the pages in place from that arena. A master
  (``kvpool-server --role master``) runs in its own process.
* ``kvpool, own pool``: one process sets and gets through one backend, its pool's arena
  (cxl tier only): the counterpart of Mooncake's own-segment row, a read of the process's own
  memory.
* ``kvpool TCP``: the same as ``kvpool same host``, the reader's ``"transport": "tcp"`` and a writer whose pool keeps
  pages in dram (a same-host arena would be read in place whatever the transport), so every
  page is pulled over TCP, as from another host.
* ``HiCacheFile tmpfs`` / ``HiCacheFile disk``: SGLang's file backend (``file_storage_path``)
  in a directory on /dev/shm and one on the disk holding ``--disk-dir`` (the file system type
  is printed). HiCacheFile has no interface v1: it is driven as SGLang's controller drives it
  (``_generic_page_set``: ``get_data_page`` per page then ``batch_set``; ``_generic_page_get``:
  ``batch_get`` into dummy pages then ``set_from_flat_data_page``). Reads from the disk
  directory come from the page cache where it holds them.
* ``Mooncake`` (``mooncake``, "own segment"): SGLang's ``MooncakeStore`` (interface v1) with a
  ``mooncake_master`` on 127.0.0.1, TCP protocol, this process contributing the only segment,
  so its gets read its own memory; ``mooncake-remote`` ("writer's segment"): a forked writer
  engine contributes the segment and sets, this process (no segment) gets, as kvpool's rows
  do. Both only where ``mooncake.store``
  imports in this interpreter; otherwise the row says why it is not there
  (``bench/install_peers.sh mooncake`` installs it into ``.venv-sglang`` too, where SGLang lives).

``kvpool TCP`` and ``Mooncake (writer's segment)``, the two rows whose gets pull between
processes, take turns get by get (the one going first alternating) rather than one row after
the other: on this VM the two vCPUs share one physical core for stretches of seconds (a
CPU-bound loop on one vCPU then runs at half speed while the other is busy), which slows
either row's gets by up to half, so rows timed at different moments compared the host's
moods as much as the stores. Their sets still run one row after the other: Mooncake's first,
on memory touched (untimed) just before, as kvpool's is when its writer attaches (see
``reclaim_from_host``).

kvpool's memory is reserved at start (``tiers.cxl.prefault`` / ``tiers.dram.prefault``, as a
server that owns its memory runs and as SGLang's pinned host pools are); ``--cold-arenas``
leaves it to the library default (allocated as puts reach it). kvpool's set is the writer's
(``exists_many`` + ``put_many``: into its arena + one master publish); its get is the reader's
(one ``get_many``: locate + in-place copy or pull). Ratios
kvpool / HiCacheFile and kvpool / Mooncake are printed per page size with issue 43's targets
(>= 1.5x HiCacheFile, >= 1.0x Mooncake): reported, never asserted. Speed on a shared machine
is noisy; run it on an idle one. On a VM that hands free memory back to its host, memory used
again costs a fault in the host too; the run prints how much was handed back meanwhile.

    .venv-sglang/bin/python bench/hicache_bench.py                 # layers 8, 8 heads x 128, pages 16 and 64
    .venv-sglang/bin/python bench/hicache_bench.py --quick         # smoke run, under a minute
    .venv-sglang/bin/python bench/hicache_bench.py --page-sizes 16,32,64 --calls 16 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib.util
import json
import mmap
import multiprocessing
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

if __package__ in (None, ""):  # run as a script: make ``bench``, ``tests`` and ``kvpool`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import memory_given_to_host  # noqa: E402  (after the path above)
from tiers.base import mount_of, tmpfs_huge_pages  # noqa: E402

BATCH = 128  # pages per call: SGLang's STORAGE_BATCH_SIZE
KVPOOL_EXTRA = {"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
                "class_name": "KvpoolHiCacheStorage", "interface_v1": 1}
ROWS = ("kvpool-shm", "kvpool-tcp", "kvpool-own", "file-tmpfs", "file-disk", "mooncake-remote", "mooncake")
LABELS = {"kvpool-shm": "kvpool same host (arena, in place)", "kvpool-tcp": "kvpool TCP (pulled)",
          "kvpool-own": "kvpool, own pool (one process)",
          "file-tmpfs": "HiCacheFile tmpfs", "file-disk": "HiCacheFile disk", "mooncake": "Mooncake (TCP, own segment)",
          "mooncake-remote": "Mooncake (TCP, writer's segment)"}
TARGETS = {"file": 1.5, "mooncake": 1.0}


@dataclass
class Layout:
    layers: int
    heads: int
    head_dim: int
    dtype: str = "bfloat16"

    def token_bytes(self) -> int:
        return 2 * self.layers * self.heads * self.head_dim * 2  # K and V, 2-byte dtypes

    def describe(self) -> str:
        return (f"MHA page_first, {self.layers} layers x {self.heads} KV heads x head_dim {self.head_dim}, "
                f"{self.dtype} ({self.token_bytes() // 1024} KiB a token, K and V)")


@dataclass
class Row:
    row: str
    page_size: int
    page_bytes: int
    call_bytes: int
    status: str = "ok"  # ok | not installed: ... | failed: ...
    set_s: list[float] = field(default_factory=list)
    get_s: list[float] = field(default_factory=list)
    verified_pages: int = 0
    reads: dict[str, int] = field(default_factory=dict)  # kvpool reader's counters: how its pages came

    def gbps(self, op: str) -> float | None:
        times = self.set_s if op == "set" else self.get_s
        return self.call_bytes * len(times) / sum(times) / 1e9 if times else None

    def p50_ms(self, op: str) -> float | None:
        times = self.set_s if op == "set" else self.get_s
        return statistics.median(times) * 1e3 if times else None


# -- SGLang's pieces -------------------------------------------------------------------------------


def host_pool(layout: Layout, page_size: int) -> Any:
    """SGLang's MHATokenToKVPoolHost (page_first) on the CPU with room for 2 x 128 pages:
    slots 0..127 are what a set stores, 128..255 where a get lands."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = BATCH * page_size
    device = MHATokenToKVPool(tokens, page_size, getattr(torch, layout.dtype), layout.heads, layout.head_dim,
                              layout.layers, "cpu", False, start_layer=0, end_layer=layout.layers)
    host = MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, "page_first",
                                pin_memory=False, device_capacity_tokens=device.size,
                                start_layer=device.start_layer, end_layer=device.end_layer)
    del device
    assert host.size >= 2 * BATCH * page_size, (host.size, page_size)
    return host


def storage_config(model: str, extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name=model, extra_config=extra)


def make_backend(name: str, model: str, extra: dict[str, Any], host: Any) -> Any:
    """The backend as SGLang's cache controller attaches it."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(name, storage_config(model, extra), host)
    backend.register_mem_pool_host(host)
    return backend


def indices(page_size: int, first_slot: int) -> Any:
    import torch

    return torch.arange(first_slot * page_size, (first_slot + BATCH) * page_size, dtype=torch.int64)


def pieces(host: Any, first_slot: int) -> list[np.ndarray]:
    """The 128 pages' pieces (SGLang's get_page_buffer_meta: K then V a page) as byte views."""
    import torch

    ptrs, sizes = host.get_page_buffer_meta(indices(host.page_size, first_slot))
    arena = host.kv_buffer.view(torch.uint8).reshape(-1).numpy()
    base = host.kv_buffer.data_ptr()
    return [arena[int(p) - base:int(p) - base + int(n)] for p, n in zip(ptrs, sizes)]


def content(row: str, page_size: int, call: int, nbytes: int) -> np.ndarray:
    """The bytes of one call's 128 pages (deterministic: the reader makes them again)."""
    seed = int.from_bytes(hashlib.sha256(f"{row}/{page_size}/{call}".encode()).digest()[:8], "little")
    return np.frombuffer(np.random.default_rng(seed).bytes(nbytes), np.uint8)


def fill(host: Any, data: np.ndarray) -> None:
    at = 0
    for piece in pieces(host, 0):
        piece[:] = data[at:at + len(piece)]
        at += len(piece)


def clear_landing(host: Any) -> None:
    for piece in pieces(host, BATCH):
        piece[:] = 0


def verify(host: Any, data: np.ndarray) -> int:
    """Pages in slots 128..255 equal to ``data``, byte for byte; raises on the first that is not."""
    at = 0
    per_page = len(data) // BATCH
    for i, piece in enumerate(pieces(host, BATCH)):
        if not np.array_equal(piece, data[at:at + len(piece)]):
            raise AssertionError(f"page {at // per_page} (piece {i}) differs from what was set")
        at += len(piece)
    return BATCH


def keys_of(row: str, page_size: int, call: int) -> list[str]:
    """SGLang-like page keys (hex sha256), fresh for every call (a set skips stored pages)."""
    return [hashlib.sha256(f"{row}/{page_size}/{call}/{i}".encode()).hexdigest() for i in range(BATCH)]


# -- set / get, as SGLang's controller calls them ---------------------------------------------------


def set_v1(backend: Any, keys: list[str], host: Any) -> None:
    ok = backend.batch_set_v1(keys, indices(host.page_size, 0), None)
    if not all(ok):
        raise RuntimeError(f"batch_set_v1 stored {sum(ok)} of {len(keys)} pages")


def get_v1(backend: Any, keys: list[str], host: Any) -> None:
    ok = backend.batch_get_v1(keys, indices(host.page_size, BATCH), None)
    if not all(ok):
        raise RuntimeError(f"batch_get_v1 found {sum(ok)} of {len(keys)} pages")


def set_generic(backend: Any, keys: list[str], host: Any) -> None:
    """SGLang's ``_generic_page_set`` (what the controller calls for ``file``)."""
    where = indices(host.page_size, 0)
    data = [host.get_data_page(where[i * host.page_size]) for i in range(len(keys))]
    if not backend.batch_set(keys, data):
        raise RuntimeError("batch_set failed")


def get_generic(backend: Any, keys: list[str], host: Any) -> None:
    """SGLang's ``_generic_page_get``: into dummy flat pages, then into the host pool."""
    where = indices(host.page_size, BATCH)
    dummies = [host.get_dummy_flat_data_page() for _ in keys]
    pages = backend.batch_get(keys, dummies)
    if pages is None or any(p is None for p in pages):
        raise RuntimeError(f"batch_get found {0 if pages is None else sum(p is not None for p in pages)} of "
                           f"{len(keys)} pages")
    for i, page in enumerate(pages):
        host.set_from_flat_data_page(where[i * host.page_size], page)


# -- kvpool's writer engine (a forked process) --------------------------------------------------------


def writer_main(conn: Any, backend_name: str, extra: dict[str, Any], layout: Layout) -> None:
    """A writer engine: per page size its own host pool and backend (``backend_name`` with
    ``extra``: kvpool's, or Mooncake's contributing the segment another process reads); stores
    the calls it is asked for and answers each call's set time."""
    backend = None
    try:
        while True:
            msg = conn.recv()
            if msg["op"] == "quit":
                break
            try:
                if msg["op"] == "attach":
                    if backend is not None:
                        backend.close()
                    host = host_pool(layout, msg["page_size"])
                    backend = None  # (a Mooncake store's segment is freed before the next is made)
                    backend = make_backend(backend_name, msg["model"], msg.get("extra", extra), host)
                    conn.send({"ok": True})
                elif msg["op"] == "detach":  # the row is done: its memory goes back before the next rows
                    if backend is not None:
                        backend.close()
                    backend = None
                    conn.send({"ok": True})
                elif msg["op"] == "set":
                    row, page_size, call = msg["row"], msg["page_size"], msg["call"]
                    data = content(row, page_size, call, msg["call_bytes"])
                    fill(host, data)
                    keys = keys_of(row, page_size, call)
                    start = time.perf_counter()
                    set_v1(backend, keys, host)
                    conn.send({"ok": True, "s": time.perf_counter() - start})
            except Exception as exc:  # reported to the bench, which fails the row
                conn.send({"ok": False, "error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()})
    finally:
        if backend is not None:
            backend.close()
        conn.close()


class Writer:
    def __init__(self, backend_name: str, extra: dict[str, Any], layout: Layout) -> None:
        ctx = multiprocessing.get_context("fork")  # SGLang is imported already: no second 10 s import
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=writer_main, args=(child, backend_name, extra, layout), daemon=True)
        self.proc.start()
        child.close()

    def ask(self, msg: dict[str, Any], timeout_s: float = 120.0) -> dict[str, Any]:
        self.conn.send(msg)
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"writer did not answer {msg['op']} in {timeout_s:.0f} s")
        answer: dict[str, Any] = self.conn.recv()
        if not answer["ok"]:
            raise RuntimeError(f"writer: {answer['error']}\n{answer.get('trace', '')}")
        return answer

    def stop(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.conn.send({"op": "quit"})
        self.proc.join(15)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)
        self.conn.close()


# -- processes this bench starts ------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def start_kvpool_master(work: Path) -> tuple[str, subprocess.Popen[bytes]]:
    from kvpool.cluster.wire.master_client import MasterClient

    address = f"tcp://127.0.0.1:{free_port()}"
    log = open(work / "kvpool-master.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen([sys.executable, "-m", "kvpool.cli.server", "--role", "master", "--master.listen",
                             address, "--log-level", "WARNING"], stdout=log, stderr=subprocess.STDOUT)
    log.close()
    client = MasterClient(address, request_timeout_s=1.0)
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"kvpool master exited {proc.returncode}: "
                                   f"{(work / 'kvpool-master.log').read_text()[-2000:]}")
            try:
                client.ping(timeout_s=0.5)
                break
            except Exception:
                if time.monotonic() > deadline:
                    stop_process(proc)
                    raise RuntimeError("kvpool master did not answer in 60 s") from None
                time.sleep(0.2)
    finally:
        client.close()
    return address, proc


def mooncake_missing() -> str | None:
    if importlib.util.find_spec("mooncake") is None:
        venv = Path(sys.prefix).name
        return (f"not installed: mooncake.store does not import in {venv} (bench/install_peers.sh mooncake "
                "installs mooncake-transfer-engine-non-cuda here, into .venv-sglang)")
    if mooncake_master_binary() is None:
        return "not installed: the mooncake package imports but no mooncake_master binary was found"
    return None


def mooncake_extra(master: str, segment_bytes: int) -> dict[str, Any]:
    """SGLang's MooncakeStore settings: TCP, this process contributing ``segment_bytes``."""
    return {"master_server_address": master, "metadata_server": "P2PHANDSHAKE", "protocol": "tcp",
            "device_name": "", "global_segment_size": segment_bytes, "check_server": False}


def mooncake_master_binary() -> str | None:
    beside = Path(sys.executable).parent / "mooncake_master"
    return str(beside) if beside.exists() else shutil.which("mooncake_master")


def fs_type(path: Path) -> str:
    """The file system type of the mount holding ``path``."""
    return mount_of(path)[0] or "?"


# -- the run -------------------------------------------------------------------------------------------


def progress(text: str) -> None:
    print(f"[hicache-bench] {text}", file=sys.stderr, flush=True)


def attach_writer(writer: Writer, row: Row, model: str, writer_extra: dict[str, Any] | None = None) -> None:
    """The writer makes its backend for ``row`` (``writer_extra``: its settings for this row, else
    those it was made with)."""
    writer.ask({"op": "attach", "page_size": row.page_size, "model": model,
                **({} if writer_extra is None else {"extra": writer_extra})})


def reclaim_from_host(nbytes: int) -> None:
    """Touch ``nbytes`` of new memory, then free it: what a process allocates next comes from
    this VM's own free pages, not from pages it had handed back to its host, each of which
    costs a host fault on first use (see :func:`bench.common.memory_given_to_host`). Run before
    a row whose timed calls touch memory for the first time (Mooncake's writer's segment), as
    the row freeing its memory just before it did when rows ran one after another."""
    region = mmap.mmap(-1, nbytes)
    try:
        np.frombuffer(region, np.uint8)[::mmap.PAGESIZE] = 1
    finally:
        region.close()


def set_calls(row: Row, writer: Writer, warmup: int, calls: int) -> None:
    """A writer process (attached: :func:`attach_writer`) sets ``row``'s calls, timing each itself."""
    for call in range(warmup + calls):
        answer = writer.ask({"op": "set", "row": row.row, "page_size": row.page_size, "call": call,
                             "call_bytes": row.call_bytes})
        if call >= warmup:
            row.set_s.append(answer["s"])


def get_calls(sides: list[tuple[Row, Any]], host: Any, warmup: int, calls: int) -> None:
    """This process's readers get what writer processes set (:func:`set_calls`): kvpool's rows and
    Mooncake's remote row, each side a ``(row, reader)``. Two sides (kvpool TCP and Mooncake's
    writer's segment) take turns get by get, the one going first alternating, so both meet the
    same machine: on this VM the two vCPUs sometimes share one physical core for a while (a
    CPU-bound loop on one runs half as fast while the other is busy), which slows a row pulling
    between two processes by up to half, whichever row happens to run then."""
    for call in range(warmup + calls):
        for row, reader in sides[call % 2:] + sides[:call % 2]:
            clear_landing(host)
            keys = keys_of(row.row, row.page_size, call)
            start = time.perf_counter()
            get_v1(reader, keys, host)
            elapsed = time.perf_counter() - start
            row.verified_pages += verify(host, content(row.row, row.page_size, call, row.call_bytes))
            if call >= warmup:
                row.get_s.append(elapsed)
    for row, reader in sides:
        with contextlib.suppress(AttributeError):  # how the reader's pages came: in place, or pulled
            counters = reader.pool.cluster.reader.counters
            row.reads = {k: int(v) for k, v in counters.items()
                         if k in ("hits_same_host", "reads_in_place", "pulls", "hits_remote", "tcp_fallbacks",
                                  "speculative_hits")}


def measure_local(row: Row, backend: Any, host: Any, warmup: int, calls: int, v1: bool) -> None:
    do_set, do_get = (set_v1, get_v1) if v1 else (set_generic, get_generic)
    total = warmup + calls
    for call in range(total):
        fill(host, content(row.row, row.page_size, call, row.call_bytes))
        start = time.perf_counter()
        do_set(backend, keys_of(row.row, row.page_size, call), host)
        if call >= warmup:
            row.set_s.append(time.perf_counter() - start)
    for call in range(total):
        clear_landing(host)
        start = time.perf_counter()
        do_get(backend, keys_of(row.row, row.page_size, call), host)
        elapsed = time.perf_counter() - start
        row.verified_pages += verify(host, content(row.row, row.page_size, call, row.call_bytes))
        if call >= warmup:
            row.get_s.append(elapsed)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tests.sglang_engine import load_sglang

    load_sglang()  # SGLang's imports (and its torchvision work-around), before the writers fork
    import torch

    # SGLang's page copies (get_data_page, set_from_flat_data_page, a dummy page) are torch ops
    # that go multi-threaded above 32k elements; on a small busy host those threads wait on each
    # other (1.7 s instead of 0.04 s for 128 pages of 256 KiB, measured on 2 vCPUs), which would
    # make HiCacheFile look far worse than it is.
    torch.set_num_threads(args.torch_threads)
    layout = Layout(args.layers, args.heads, args.head_dim, args.dtype)
    rows_wanted = [r for r in args.rows.split(",") if r]
    unknown = set(rows_wanted) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; known: {','.join(ROWS)}")
    given_before = memory_given_to_host()
    work = Path(tempfile.mkdtemp(prefix="kvpool-hicache-bench-"))
    tmpfs_dir = Path(tempfile.mkdtemp(prefix="kvpool-hicache-bench-", dir="/dev/shm"))
    disk_dir = Path(tempfile.mkdtemp(prefix="kvpool-hicache-bench-", dir=args.disk_dir))
    dirs = {"file-tmpfs": tmpfs_dir, "file-disk": disk_dir}
    where = {name: f"{path} ({fs_type(path)})" for name, path in dirs.items() if name in rows_wanted}
    for name in ("kvpool-shm", "kvpool-own"):  # where their cxl arenas are, and with which pages
        if name in rows_wanted:
            arena_dir = Path(args.arena_dir) if args.arena_dir else Path("/dev/shm")
            huge = tmpfs_huge_pages(arena_dir)
            where[name] = (f"cxl arena in {arena_dir} ({fs_type(arena_dir)}{f', huge={huge}' if huge else ''}), "
                           f"{'cold (allocated as it fills)' if args.cold_arenas else 'prefaulted at start'}")
    processes: list[subprocess.Popen[bytes]] = []
    master: str | None = None

    def writer_extra(writer_row: str, capacity: int) -> dict[str, Any]:
        """The writers' pools: "shm" saves in a cxl arena only (as the vLLM connector's default
        pool), "tcp" in dram only (so its pages are pulled, never read in place)."""
        prefault = not args.cold_arenas
        if writer_row == "kvpool-shm":
            arena_at = {} if args.arena_dir is None else {"path": str(Path(args.arena_dir) / "kvpool-shm-writer-cxl")}
            tiers = {"dram": {"capacity": 0}, "cxl": {"capacity": capacity, "prefault": prefault, **arena_at}}
        else:
            tiers = {"dram": {"capacity": capacity, "mlock": False, "prefault": prefault}, "cxl": {"capacity": 0}}
        config = {"pool": {"data_dir": str(work / writer_row)}, "tiers": {**tiers, "nvme": {"capacity": 0}}}
        return {**KVPOOL_EXTRA, "master": master, "config": config}

    writers: dict[str, Writer] = {}
    backends: list[Any] = []
    rows: list[Row] = []
    try:
        master = None
        if any(r.startswith("kvpool") for r in rows_wanted):
            master, proc = start_kvpool_master(work)
            processes.append(proc)
            for writer_row in ("kvpool-shm", "kvpool-tcp"):
                if writer_row in rows_wanted:
                    # (each row's pool comes with its attach: writer_extra sized for its page size)
                    writers[writer_row] = Writer("dynamic", {}, layout)
        mooncake_master = None
        wants_mooncake = any(r.startswith("mooncake") for r in rows_wanted)
        mooncake_why = mooncake_missing() if wants_mooncake else None
        if wants_mooncake and mooncake_why is None:
            port = free_port()
            binary = mooncake_master_binary()
            assert binary is not None
            mooncake_master = f"127.0.0.1:{port}"
            log = open(work / "mooncake-master.log", "wb")  # noqa: SIM115
            processes.append(subprocess.Popen([binary, f"--port={port}"], stdout=log, stderr=subprocess.STDOUT))
            log.close()
            time.sleep(1.0)
            if "mooncake-remote" in rows_wanted:  # forked before this process runs any Mooncake store
                writers["mooncake-remote"] = Writer("mooncake", mooncake_extra(mooncake_master, 0), layout)

        for page_size in args.page_sizes:
            host = host_pool(layout, page_size)
            page_bytes = page_size * layout.token_bytes()
            # a Mooncake segment holds one page size's calls (each Mooncake row's store lives on)
            segment = int((args.warmup + args.calls) * BATCH * page_bytes * 1.5) + (64 << 20)
            room = int((args.warmup + args.calls) * BATCH * page_bytes * 1.25) + (64 << 20)  # kvpool's
            page_rows = {name: Row(name, page_size, page_bytes, BATCH * page_bytes) for name in rows_wanted}
            rows.extend(page_rows.values())
            # kvpool TCP and Mooncake's writer's segment, the two pulled between processes, take
            # turns get by get (get_calls says why), at the later one's turn, so the rows between
            # them keep their order; the rest run one after another
            paired = sorted({"kvpool-tcp", "mooncake-remote"}, key=rows_wanted.index) \
                if {"kvpool-tcp", "mooncake-remote"} <= set(rows_wanted) and mooncake_why is None else []

            def pulled_side(name: str, host: Any, stack: contextlib.ExitStack) -> tuple[Row, Writer, Any]:
                """``name``'s writer attached and this process's reader made (both undone by ``stack``)."""
                row = page_rows[name]
                model = f"hicache-bench/{name}/{os.getpid()}"
                if name == "mooncake-remote":  # a writer's segment; this process contributes none
                    assert mooncake_master is not None
                    # the writer's segment first: the reader's store puts a warm-up object as it
                    # starts, which fails (10 tries, then RuntimeError) where no segment is mounted
                    attach_writer(writers[name], row, model, mooncake_extra(mooncake_master, segment))
                    reader = make_backend("mooncake", model, mooncake_extra(mooncake_master, 0), host)
                else:
                    transport = "tcp" if name == "kvpool-tcp" else "auto"
                    reader_config = {"pool": {"data_dir": str(work / f"reader-{name}-{page_size}")},
                                     "tiers": {"dram": {"capacity": "64MiB", "mlock": False, "prefault": False},
                                               "cxl": {"capacity": 0, "shared_dirs": args.arena_dir or ""},
                                               "nvme": {"capacity": 0}}}
                    # a pool per page size, its memory sized for that page size's calls
                    attach_writer(writers[name], row, model, writer_extra(name, room))

                    def detach(writer: Writer = writers[name]) -> None:
                        with contextlib.suppress(RuntimeError, OSError):  # (a failed row says why already)
                            writer.ask({"op": "detach"})  # its memory, reserved at start, freed

                    stack.callback(detach)
                    reader = make_backend("dynamic", model, {**KVPOOL_EXTRA, "master": master,
                                                             "config": reader_config, "transport": transport},
                                          host)
                backends.append(reader)
                stack.callback(backends.remove, reader)
                stack.callback(reader.close)
                return row, writers[name], reader

            for name in rows_wanted:
                row = page_rows[name]
                if name in paired and name != paired[-1]:
                    continue  # measured with paired[-1]
                model = f"hicache-bench/{name}/{os.getpid()}"
                together = paired if name in paired else [name]
                progress(f"page {page_size}: {' and '.join(LABELS[n] for n in together)}")
                try:
                    if name == "kvpool-own":  # sets and gets in this process, as Mooncake's own segment
                        own_at = {} if args.arena_dir is None else {
                            "path": str(Path(args.arena_dir) / f"kvpool-own-{page_size}-cxl")}
                        config = {"pool": {"data_dir": str(work / f"own-{page_size}")},
                                  "tiers": {"dram": {"capacity": 0},
                                            "cxl": {"capacity": room, "prefault": not args.cold_arenas, **own_at},
                                            "nvme": {"capacity": 0}}}
                        backend = make_backend("dynamic", model, {**KVPOOL_EXTRA, "master": master,
                                                                  "config": config}, host)
                        backends.append(backend)
                        try:
                            measure_local(row, backend, host, args.warmup, args.calls, v1=True)
                        finally:
                            backend.close()
                            backends.remove(backend)
                    elif name.startswith("kvpool") or name in paired:
                        with contextlib.ExitStack() as stack:
                            sides = []
                            # Mooncake's first: its writer's segment is touched by its sets, kvpool's
                            # memory when its writer attaches, so Mooncake's sets meet the memory
                            # the rows before freed, as when the rows ran one after another (the
                            # other way round, on memory this VM had handed back to its host, they
                            # took 190-520 ms instead of 42-63)
                            for side in sorted(together, key=lambda n: n != "mooncake-remote"):
                                row_of, writer, reader = pulled_side(side, host, stack)
                                if side == "mooncake-remote":
                                    reclaim_from_host(segment)
                                set_calls(row_of, writer, args.warmup, args.calls)
                                sides.append((row_of, reader))
                            get_calls(sides, host, args.warmup, args.calls)
                    elif name.startswith("file"):
                        backend = make_backend("file", model, {"file_storage_path": str(dirs[name])}, host)
                        measure_local(row, backend, host, args.warmup, args.calls, v1=False)
                        for path in dirs[name].iterdir():  # room for the next page size
                            path.unlink()
                    elif mooncake_why is not None:
                        row.status = mooncake_why
                    elif name == "mooncake-remote":
                        with contextlib.ExitStack() as stack:
                            row_of, writer, reader = pulled_side(name, host, stack)
                            set_calls(row_of, writer, args.warmup, args.calls)
                            get_calls([(row_of, reader)], host, args.warmup, args.calls)
                    else:
                        assert mooncake_master is not None
                        backend = make_backend("mooncake", model, mooncake_extra(mooncake_master, segment), host)
                        backends.append(backend)
                        measure_local(row, backend, host, args.warmup, args.calls, v1=True)
                except Exception as exc:  # one backend failing is its row's status, not the run's end
                    for failed in together:  # (rows taking turns fail together)
                        page_rows[failed].status = \
                            f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    progress(f"{name} page {page_size} failed:\n{traceback.format_exc()}")
            del host
    finally:
        for backend in backends:
            with contextlib.suppress(Exception):
                backend.close()
        for writer in writers.values():
            writer.stop()
        for proc in processes:
            stop_process(proc)
        for path in (work, tmpfs_dir, disk_dir):
            shutil.rmtree(path, ignore_errors=True)
    return {"layout": asdict(layout), "layout_text": layout.describe(), "pages_per_call": BATCH,
            "warmup": args.warmup, "calls": args.calls, "torch_threads": args.torch_threads, "where": where,
            "given_to_host": None if given_before is None else (memory_given_to_host() or 0) - given_before,
            "rows": [{**asdict(r), "label": LABELS[r.row], "set_gbps": r.gbps("set"), "get_gbps": r.gbps("get"),
                      "set_p50_ms": r.p50_ms("set"), "get_p50_ms": r.p50_ms("get")} for r in rows],
            "ratios": ratios(rows)}


def ratios(rows: list[Row]) -> list[dict[str, Any]]:
    """kvpool / peer GB/s for set and get, per page size (None where either did not run)."""
    out = []
    by = {(r.row, r.page_size): r for r in rows}
    for (name, page_size), ours in by.items():
        if not name.startswith("kvpool"):
            continue
        for peer in ("file-tmpfs", "file-disk", "mooncake", "mooncake-remote"):
            theirs = by.get((peer, page_size))
            if theirs is None:
                continue
            entry: dict[str, Any] = {"kvpool": name, "peer": peer, "page_size": page_size,
                                     "target": TARGETS["mooncake" if peer.startswith("mooncake") else "file"]}
            for op in ("set", "get"):
                a, b = ours.gbps(op), theirs.gbps(op)
                entry[op] = a / b if a and b and ours.status == "ok" and theirs.status == "ok" else None
            why = theirs.status if theirs.status != "ok" else (ours.status if ours.status != "ok" else "")
            entry["why"] = f"{peer} {why.split(':')[0]}" if why else ""
            out.append(entry)
    return out


def how(reads: dict[str, int]) -> str:
    """How a kvpool reader's objects came: in place from a same-host arena, or pulled."""
    if not reads:
        return ""
    in_place = reads.get("hits_same_host", 0) + reads.get("reads_in_place", 0)
    pulled = reads.get("pulls", 0)
    guessed = f" ({reads['speculative_hits']} without the master)" if reads.get("speculative_hits") else ""
    return f" ({in_place} objects in place, {pulled} pulled{guessed})"


def report(result: dict[str, Any]) -> None:
    def num(value: float | None, fmt: str) -> str:
        return "-" if value is None else format(value, fmt)

    print(f"layout: {result['layout_text']}; {result['pages_per_call']} pages a call, "
          f"{result['calls']} timed calls (+{result['warmup']} warm-up) per backend and page size; "
          f"torch threads {result['torch_threads']}")
    if result["given_to_host"] is not None:
        print(f"memory this VM handed back to its host during the run: {result['given_to_host'] / (1 << 30):.1f} "
              "GiB (free page reporting: a row that allocates memory while timed pays a host fault per page "
              "used again; which rows do depends on their order)")
    for name, text in result["where"].items():
        print(f"{LABELS[name]}: {text}")
    for page_size in sorted({r["page_size"] for r in result["rows"]}):
        rows = [r for r in result["rows"] if r["page_size"] == page_size]
        print(f"\n== page {page_size} tokens ({rows[0]['page_bytes'] // 1024} KiB a page, "
              f"{rows[0]['call_bytes'] / (1 << 20):.0f} MiB a call)")
        print(f"{'backend':38s} {'set GB/s':>9s} {'set p50 ms':>11s} {'get GB/s':>9s} {'get p50 ms':>11s}  verified")
        for r in rows:
            if r["status"] != "ok":
                print(f"{r['label']:38s} {r['status']}")
                continue
            print(f"{r['label']:38s} {num(r['set_gbps'], '9.2f')} {num(r['set_p50_ms'], '11.1f')} "
                  f"{num(r['get_gbps'], '9.2f')} {num(r['get_p50_ms'], '11.1f')}  "
                  f"{r['verified_pages']} pages exact{how(r['reads'])}")
        print("kvpool / peer (GB/s; issue 43 targets: >= 1.5x HiCacheFile, >= 1.0x Mooncake):")
        for q in (q for q in result["ratios"] if q["page_size"] == page_size):
            if q["set"] is None or q["get"] is None:
                print(f"  {q['kvpool']:10s} / {q['peer']:10s}  n/a ({q['why'] or 'not measured'})")
                continue
            marks = ["" if v >= q["target"] else " (below)" for v in (q["set"], q["get"])]
            print(f"  {q['kvpool']:10s} / {q['peer']:10s}  set {q['set']:.2f}x{marks[0]}  "
                  f"get {q['get']:.2f}x{marks[1]}  (target >= {q['target']}x)")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 2 layers x 4 heads, pages 16 and 64, 2 timed calls (under a minute)")
    parser.add_argument("--page-sizes", default=None, help="tokens a page, comma-separated (default 16,64)")
    parser.add_argument("--layers", type=int, default=None, help="layers (default 8; --quick 2)")
    parser.add_argument("--heads", type=int, default=None, help="KV heads (default 8; --quick 4)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    parser.add_argument("--calls", type=int, default=None, help="timed 128-page calls per backend and page size "
                                                                "(default 8; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls first (default 1)")
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which backends (default {','.join(ROWS)})")
    parser.add_argument("--disk-dir", default=tempfile.gettempdir(),
                        help="a directory on disk for HiCacheFile's disk row (default: the temp dir; its file "
                             "system type is printed)")
    parser.add_argument("--arena-dir", default=None,
                        help="where kvpool's cxl arenas go (the same-host writer's and the own pool's; default "
                             "/dev/shm/kvpool-<uid>): e.g. a tmpfs mounted with huge=within_size")
    parser.add_argument("--cold-arenas", action="store_true",
                        help="kvpool's memory as the library default leaves it (allocated as puts first reach it) "
                             "instead of reserved at start (tiers.cxl.prefault / tiers.dram.prefault = true, as a "
                             "server that owns its memory runs; SGLang's and vLLM's pinned host pools are too)")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch intra-op threads for SGLang's page copies (default 1)")
    parser.add_argument("--json", metavar="FILE", help="write the rows and ratios here")
    args = parser.parse_args(argv)
    args.page_sizes = [int(p) for p in (args.page_sizes or "16,64").split(",")]
    args.layers = args.layers or (2 if args.quick else 8)
    args.heads = args.heads or (4 if args.quick else 8)
    args.calls = args.calls or (2 if args.quick else 8)
    if importlib.util.find_spec("sglang") is None:
        print("SGLang is not importable here: run with .venv-sglang/bin/python (.ci/run builds it)", file=sys.stderr)
        return 2
    result = run(args)
    report(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    # a peer that fails is its row's status (printed); the run fails where kvpool's own rows do
    failed = [r for r in result["rows"] if r["row"].startswith("kvpool") and r["status"].startswith("failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
