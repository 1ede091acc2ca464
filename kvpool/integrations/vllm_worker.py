"""The worker half of kvpool's vLLM connector (it runs in each vLLM worker process, beside the
model): loads blocks into the paged KV cache (in place from a same-host arena, else pulled,
layer by layer under the forward pass or outside the steps) and saves the blocks each step
fills. ``docs/vllm.md`` describes the whole connector; ``docs/threads.md`` its threads."""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool import errors
from kvpool.cluster.wire.affinity import process_cpus
from kvpool.integrations.vllm_messages import (
    NULL_BLOCK,
    KvpoolConnectorMetadata,
    KvpoolStats,
    KvpoolWorkerMetadata,
    Transfer,
)
from kvpool.integrations.vllm_settings import Settings, default_pool_config, namespace_of, object_key, rank_tag

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["KvpoolWorker", "open_pool", "pull_cpus", "threads_on", "worker_cpus"]

log = logging.getLogger("vllm.kvpool")  # under vLLM's logger: its handlers and levels apply

# "auto" layers per pull: each pull moves at least this much of a block (a whole block when
# it is smaller). Every pull costs each side a fixed amount of CPU whatever its size (request,
# pin, send, reply, checks), which a load of many small pulls pays thousands of times, while
# overlap with the model gains at most the step's compute (docs/benchmarks.md, "Whole blocks
# per pull").
_PULL_TARGET_BYTES = 4 << 20
_STAGING_PREPARED_BYTES = 256 << 20  # at most this much staging buffer made at start, per loader thread
# Saves give way to loads: a step's blocks go in put_many batches of about this many bytes,
# and before each the saver waits (at most _SAVE_YIELD_S) while a load is in flight.
_SAVE_BATCH_BYTES = 8 << 20
_SAVE_YIELD_S = 0.05
# A load's blocks go in up to this many concurrent get_many calls (streams), each on its own
# connection (holders serve one connection's pulls one after another), at most one per CPU the
# connector's threads run on: more threads than CPUs only take turns with the GIL.
_PULL_STREAMS = 4
_MIN_BLOCKS_PER_STREAM = 4
_DTYPES = {torch.bfloat16: ("bfloat16", np.uint16), torch.float16: ("float16", np.float16),
           torch.float32: ("float32", np.float32), torch.uint8: ("uint8", np.uint8)}
# x86-64 Linux: arch_prctl's syscall number, its "request permission" code, AMX's tile data (allow_amx)
_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA = 158, 0x1023, 18

@dataclass
class _Stage:
    """One step's blocks to save: ``objects[i]`` ([layers, ...]) is ``keys[i]``'s object,
    filled layer by layer from the paged cache's ``block_ids[g][i]`` (``g``: the layer's KV
    cache group)."""

    keys: list[bytes]
    block_ids: list[torch.Tensor]  # per KV cache group
    objects: np.ndarray
    tails: list[tuple[int, int]] = field(default_factory=list)  # (object, its valid tokens): the rest zeroed


class _LayerLoad:
    """One step's loads: a thread pulls layer by layer; the model waits per layer (an
    asynchronous load: nobody waits; get_finished reports ``req_ids`` when it is done).
    Block ``i`` of the load is block ``owners[i][1]`` of request ``owners[i][0]``."""

    def __init__(self, layers: int, groups: list[list[int]], owners: list[tuple[str, int]],
                 req_ids: list[str] | None = None) -> None:
        self.req_ids = req_ids or []
        self.owners = owners
        self.done = [threading.Event() for _ in range(layers)]
        self.groups = groups  # the load's block i in the paged cache: groups[g][i], g its KV cache group
        self.blocks = len(groups[0])
        self.failed_rows: set[int] = set()  # the load's blocks (indices) that failed
        self.timed_out = False  # the model went on without a layer: every block is recomputed
        self.waited_s = 0.0
        self.started = time.perf_counter()
        self.finished_s = 0.0
        self.pull_s = 0.0  # in get_many (locate, pulls, checksums)
        self.copy_s = 0.0  # into the paged cache (from same-host arenas, or the staging buffer)
        self.loader_cpu_s = 0.0  # CPU time its copies and pulls used (the rest of their time they waited)
        self.in_place = 0  # blocks copied from a same-host node's arena
        # Held while the loader writes a layer into the paged cache, and by the model's side
        # when it gives up waiting: once timed_out is set, nothing more is written there.
        self.lock = threading.Lock()

    def ids_of(self, blocks: Iterable[int]) -> set[int]:
        """The paged cache's blocks, in every group, of the load's blocks ``blocks`` (indices):
        what vLLM recomputes when they fail."""
        return {ids[i] for i in blocks for ids in self.groups if ids[i] != NULL_BLOCK}

    def failed(self) -> set[int]:
        """The load's blocks (indices) that failed: every one once the model (or get_finished)
        gave up on the load, else those that missed, failed their checksums or their copy."""
        return set(range(self.blocks)) if self.timed_out else self.failed_rows

    def failures(self) -> dict[str, int]:
        """{request: the first of its blocks that failed} (see :class:`KvpoolWorkerMetadata`)."""
        first: dict[str, int] = {}
        for row in self.failed():
            req_id, block = self.owners[row]
            first[req_id] = min(block, first.get(req_id, block))
        return first


def worker_cpus(setting: str | frozenset[int]) -> frozenset[int] | None:
    """The CPUs the connector's threads run on in a worker process (None: where they are
    created). vLLM-CPU binds its compute threads, the main thread among them, to the cores
    of ``VLLM_CPU_OMP_THREADS_BIND``, and every thread started later inherits that binding:
    left alone, kvpool's loader, pulls and saves would take turns with the model on its
    own cores (slowing both) while the cores vLLM leaves for the framework sit idle. ``"auto"``:
    the CPUs this process may use that the calling thread is not bound to (the model's are
    the rest), or all of them when none are left (a process nothing bound: no change).
    ``"inherit"``: as created. A set: those; ConfigError names any this process may not use
    (checked at start, not when a thread would fail to start)."""
    if setting == "inherit" or not hasattr(os, "sched_setaffinity"):
        return None
    model = os.sched_getaffinity(0)
    named = frozenset() if isinstance(setting, str) else frozenset(setting)
    allowed = process_cpus(model | named)
    if named:
        if not named <= allowed:
            raise errors.ConfigError(
                f'kv_connector_extra_config "cpus": CPU(s) {sorted(named - allowed)} are not among this process\'s '
                f"CPUs {sorted(allowed)}")
        return named
    return frozenset(allowed - model or allowed)


def pull_cpus(setting: str | frozenset[int], cpus: frozenset[int] | None) -> frozenset[int] | None:
    """The CPUs a load runs on (its same-host copies and its pulls), given the connector's
    ``cpus`` (:func:`worker_cpus`). ``"auto"``: every CPU this process may use, the model's
    included: while a load is in flight the model's thread sleeps waiting for its layers, so
    its core is idle, while the "spare" CPUs may be busy (the holder it pulls from may share
    the host, and with several engines on a host one engine's spare CPU is another's compute
    core). Any other setting: ``cpus``. (Measurements: docs/benchmarks.md.)"""
    if setting != "auto" or cpus is None or not hasattr(os, "sched_setaffinity"):
        return cpus
    return process_cpus(cpus)


def allow_amx() -> None:
    """Ask Linux to let this process use AMX tiles (``arch_prctl(ARCH_REQ_XCOMP_PERM,
    XFEATURE_XTILEDATA)``; a CPU without them refuses, which changes nothing). vLLM-CPU 0.32's
    attention over a prefix already in the cache (``cpu_attention_with_kv_cache``) uses AMX on a
    CPU that has it without asking first: an engine whose first such step comes before any torch
    work that asks (one whose first requests load their prefixes from kvpool) dies there of
    SIGILL."""
    if sys.platform != "linux" or platform.machine() != "x86_64":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall(_SYS_ARCH_PRCTL, _ARCH_REQ_XCOMP_PERM, _XFEATURE_XTILEDATA)
    except (OSError, AttributeError) as exc:
        log.debug("kvpool: asking for AMX failed: %s", exc)


@contextlib.contextmanager
def threads_on(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread, and threads started inside (they inherit its binding), run on
    ``cpus``; its binding is restored after."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def open_pool(settings: Settings, cpus: frozenset[int] | None = None) -> Any:
    """A worker's own kvpool client, as the connector opens it: on the master ``settings.master``
    with ``settings.pool_config()`` (without a ``config``: every save in a shared-memory arena
    that same-host engines read in place, :func:`~kvpool.integrations.vllm_settings.default_pool_config`)
    and ``settings.transport``; its threads (serving pulls, heartbeats, UCX) on ``cpus``
    (:func:`worker_cpus`), but for its master link's ZeroMQ I/O thread, which a step's saves
    wait for: that one runs on every CPU (:mod:`kvpool.cluster.wire.affinity`). Raises what
    :func:`kvpool.connect` raises (MasterUnreachableError, ConfigError)."""
    import kvpool

    with threads_on(cpus):
        pool = kvpool.connect(settings.master, config=settings.pool_config(), transport=settings.transport)
        # Now, not at the first save of a block above 1 MiB: starting UCX holds the GIL while
        # it sets up its context and worker, and mid-request that would stall the model and a
        # load in flight.
        pool.start_ucx()
    return pool


class KvpoolWorker:
    """The connector's worker half: vLLM's worker-side calls, on this worker's kvpool client.

    ``settings``: the connector's; ``pool``: this worker's kvpool client (:func:`open_pool`;
    closed by :meth:`shutdown`); ``block_size``: vLLM's; ``kv_heads``: the KV heads this rank
    holds (how a block is stored); ``loads`` / ``saves``: what its ``kv_role`` lets it do;
    ``cpus``: where its threads run (:func:`worker_cpus`), a load's pulls on
    :func:`pull_cpus`; ``tag``: its parallel rank's
    (:func:`~kvpool.integrations.vllm_settings.rank_tag`; None: the engine's only rank),
    which its objects' keys are made of (:meth:`_object_keys`); ``kv_cache_config``: vLLM's
    (each layer's KV cache group; None: one group); ``max_model_len``: the longest prompt
    (staging buffers are made for it at :meth:`register_kv_caches`). Threads start when work
    is handed to them; :meth:`open` builds one from vLLM's configuration, opening the pool."""

    def __init__(self, settings: Settings, pool: Any, *, block_size: int, kv_heads: int, loads: bool = True,
                 saves: bool = True, cpus: frozenset[int] | None = None, tag: bytes | None = None,
                 kv_cache_config: KVCacheConfig | None = None, max_model_len: int = 0) -> None:
        self.settings = settings
        self.block_size = block_size
        self.loads_blocks, self.saves_blocks = loads, saves
        self._kv_heads = kv_heads
        self._kv_cache_config = kv_cache_config
        self._max_model_len = max_model_len
        self._meta: KvpoolConnectorMetadata | None = None  # this step's plan (bind_connector_metadata)
        self.stats: dict[str, float] = {}
        self._rank_tag = tag
        for name in ("blocks_loaded", "blocks_failed", "blocks_saved", "load_wait_s", "load_total_s", "save_s",
                     "save_wait_s"):
            self.stats.setdefault(name, 0)
        self.pool = pool
        self._layers: list[torch.Tensor] = []
        self._layer_index: dict[str, int] = {}
        self._load: _LayerLoad | None = None

        self._pull_cpus = pull_cpus(self.settings.cpus, cpus)

        def executor(threads: int, name: str,
                     on: frozenset[int] | None = cpus) -> concurrent.futures.ThreadPoolExecutor:
            def bind() -> None:
                if on is not None:
                    os.sched_setaffinity(0, on)

            return concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name, initializer=bind)

        # The loaders live on every CPU a load may use (pull_cpus), not only the spare ones: a
        # load handed to a thread bound to a spare CPU waits for that CPU to start at all, and
        # with several engines on a host it is another engine's compute core, busy for a whole
        # prefill, while the model's own core idles waiting for the load.
        self._loader = executor(1, "kvpool-load", self._pull_cpus)
        usable = self._pull_cpus if self._pull_cpus is not None else \
            os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        self._pull_streams = max(1, min(_PULL_STREAMS, len(usable)))  # see _PULL_STREAMS
        self._streams = executor(max(1, self._pull_streams - 1), "kvpool-pull", self._pull_cpus)
        self._load_future: concurrent.futures.Future[None] | None = None
        # Asynchronous loads (``load_async``), on a thread of their own, until get_finished
        # reports them: (load, its future).
        self._async_loader = executor(1, "kvpool-load-async", self._pull_cpus)
        self._async_loads: list[tuple[_LayerLoad, concurrent.futures.Future[None]]] = []
        # Reused by loads of several layers per pull, one per loader thread (the sync and the
        # asynchronous loader never share one).
        self._stagings: dict[int, np.ndarray] = {}
        self._stage: _Stage | None = None  # this step's blocks to save, as the layers come
        self._master_away = False  # a save found the master away and none has got through since
        self._saver = executor(1, "kvpool-save")
        self._saves: list[concurrent.futures.Future[None]] = []
        self._count_lock = threading.Lock()
        self._loads_in_flight = 0  # loads handed to a loader thread and not finished (under _count_lock)
        self._loads_idle = threading.Event()
        self._loads_idle.set()
        self._report: dict[str, Any] = {}  # measured since the last get_kv_connector_stats
        self._step_started = 0.0
        self._last_waited = 0.0  # of this step's load, once finished
        self._block_nbytes = 0
        self._block_shape: tuple[int, ...] = ()
        self._token_axis: int | None = None
        self._failed_blocks: set[int] = set()  # for get_block_ids_with_load_errors (one KV cache group)
        self._failed_requests: set[str] = set()  # for get_transfer_results (several groups)
        self._load_failures: dict[str, int] = {}  # for build_connector_worker_meta
        self._groups = 1  # KV cache groups (register_kv_caches)


    @classmethod
    def open(cls, vllm_config: VllmConfig, settings: Settings, *, loads: bool, saves: bool,
             kv_cache_config: KVCacheConfig | None) -> KvpoolWorker:
        """The worker half of this worker process of an engine of ``vllm_config``: its kvpool
        client opened (:func:`open_pool`), its threads on :func:`worker_cpus`."""
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        tag = rank_tag(vllm_config.parallel_config, get_tensor_model_parallel_rank(), get_pp_group().rank_in_group)
        cpus = worker_cpus(settings.cpus)
        pool = open_pool(settings, cpus)
        worker = cls(settings, pool, block_size=vllm_config.cache_config.block_size,
                     kv_heads=vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config),
                     loads=loads, saves=saves, cpus=cpus, tag=tag, kv_cache_config=kv_cache_config,
                     max_model_len=getattr(vllm_config.model_config, "max_model_len", 0) or 0)
        if not settings.config:
            arena = default_pool_config()["tiers"]["cxl"]["capacity"]
            log.info('kvpool connector: no "config": this worker\'s saves go to its shared-memory arena '
                     "(cxl tier, %d MiB, no dram tier), which the other engines on this host read in place",
                     arena >> 20)
        log.info("kvpool connector: worker threads on CPUs %s, a load's pulls on %s (the model's: %s); namespace "
                 "%s%s", "as created" if cpus is None else sorted(cpus),
                 "as created" if worker._pull_cpus is None else sorted(worker._pull_cpus),
                 sorted(os.sched_getaffinity(0)), namespace_of(vllm_config),
                 "" if tag is None else f", rank {tag.decode()}")
        return worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        # Each layer's KV cache group (vLLM's hybrid allocator: a layer's blocks are its group's;
        # with it off, or a model of one kind of layer, every layer is in group 0).
        groups = getattr(self._kv_cache_config, "kv_cache_groups", None) or []
        group_of = {name: g for g, group in enumerate(groups) for name in group.layer_names}
        self._layer_group = [group_of.get(name, 0) for name in kv_caches]
        self._groups = max(1, len(groups))
        first = self._layers[0]
        if first.dtype not in _DTYPES:
            raise errors.ConfigError(f"kvpool connector: KV cache dtype {first.dtype} is not supported")
        block = first[0]
        if not block.is_contiguous() or any(t.shape != first.shape or t.dtype != first.dtype for t in self._layers):
            raise errors.ConfigError(
                f"kvpool connector: needs every layer's cache as [num_blocks, ...] with contiguous blocks of one "
                f"shape, got {tuple(first.shape)} ({'' if block.is_contiguous() else 'non-'}contiguous blocks)")
        self._dtype_name, self._np_dtype = _DTYPES[first.dtype]
        self._block_nbytes = block.numel() * block.element_size()
        # Each layer's blocks as bytes ([num_blocks, ...] uint8, no copy): where same-host
        # arena copies land (host caches only).
        self._byte_layers = [t.view(torch.uint8).numpy() if t.device.type == "cpu" else np.empty(0, np.uint8)
                             for t in self._layers]
        # A CPU engine's cache is read and written in place; a GPU engine's goes through host
        # buffers (one copy each way; not yet run on a GPU).
        self._on_host = first.device.type == "cpu"
        if self._on_host:
            allow_amx()
        # Layers per pull: one layer each gives the finest overlap, but every request costs a
        # fixed amount (see _PULL_TARGET_BYTES); "auto" makes each pull move >= 4 MiB of a
        # block, so blocks up to that size are fetched whole, larger ones a few layers at a time.
        auto = -(-_PULL_TARGET_BYTES // self._block_nbytes)
        self._layers_per_pull = max(1, min(self.settings.layers_per_pull or auto, len(self._layers)))
        elements = block.numel()
        kv_heads = self._kv_heads
        if elements % (2 * self.block_size * kv_heads):
            kv_heads = 1
        self._shape = (1, 2, self.block_size, kv_heads, elements // (2 * self.block_size * kv_heads))
        # The axis of a block that counts its tokens (vLLM 0.32's per-layer cache is logically
        # [blocks, heads, tokens, content]; an MLA one [blocks, tokens, content]): a tail (a
        # block saved for its first tokens) has the rest zeroed along it, so no stale slot of an
        # earlier request leaves the engine. None where the shape does not say: no tails are saved.
        shape = tuple(block.shape)
        self._block_shape = shape
        self._token_axis = 1 if len(shape) == 3 and shape[:2] == (self._kv_heads, self.block_size) else \
            0 if len(shape) == 2 and shape[0] == self.block_size else None
        log.info("kvpool connector: %d layers, blocks of %s %s stored as %s", len(self._layers),
                 tuple(block.shape), first.dtype, self._shape)
        # The loader threads' staging buffers for one request of the longest prompt, made and
        # faulted in now, off the first load's path: a first touch of fresh memory costs a page
        # fault (and on a VM whose freed memory the host reclaims, the host's fault too), which
        # for a buffer of many MiB costs more than the copy into it.
        longest = self._max_model_len
        blocks = min(-(-int(longest) // self.block_size),
                     _STAGING_PREPARED_BYTES // (len(self._layers) * self._block_nbytes))
        if blocks > 0 and self.loads_blocks:  # (a kv_producer never loads)
            # Each loader that may pull: with load_async "auto" both (the step's loader pulls the
            # blocks of the worker's own pool, and any a same-host arena lost meanwhile).
            setting = self.settings.load_async
            for loader in [self._loader] * (setting is not True) + [self._async_loader] * (setting is not False):
                loader.submit(lambda: self._staging_for(blocks, len(self._layers)).fill(0))

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Each step starts here, before its forward pass (vLLM starts loads only after the
        forward when the step has none to wait for): the step's compute time runs from here."""
        assert isinstance(connector_metadata, KvpoolConnectorMetadata)
        self._meta = connector_metadata
        self._step_started = time.perf_counter()

    def _step_meta(self) -> KvpoolConnectorMetadata:
        """This step's plan, as :meth:`bind_connector_metadata` was given it."""
        assert self._meta is not None, "no connector metadata bound for this step"
        return self._meta

    def clear_connector_metadata(self) -> None:
        """The step is over (vLLM calls this after the forward pass)."""
        self._meta = None

    def start_load_kv(self) -> None:
        meta = self._step_meta()
        if meta.async_loads:
            keys = self._object_keys(k for t in meta.async_loads for k in t.keys)
            groups = self._group_ids(meta.async_loads)
            load = _LayerLoad(len(self._layers), groups, self._owners(meta.async_loads),
                              [t.req_id for t in meta.async_loads])
            self._loading(+1)
            self._async_loads.append((load, self._async_loader.submit(self._pull, load, keys)))
            self._count("blocks_loaded", len(keys))
        keys = self._object_keys(k for t in meta.loads for k in t.keys)
        if not keys:
            return
        groups = self._group_ids(meta.loads)
        load = self._load = _LayerLoad(len(self._layers), groups, self._owners(meta.loads))
        self._loading(+1)
        self._count("blocks_loaded", len(keys))
        # The blocks in a same-host arena are copied here, on the model's own thread: the model
        # would only wait for them meanwhile, so its core is the one sure to be free, while a
        # loader thread waits for a CPU that another engine may keep busy (served P/D, two
        # engines on two cores: 17-22 ms of copying took 25-460 ms there). What is left to pull
        # goes to the loader thread, as before in the same order.
        failed: set[int] = set()
        cpu, started = time.thread_time(), time.perf_counter()
        try:
            rest = self._copy_in_place(load, keys, failed)
        except Exception:  # never the model's error: every block is recomputed
            log.exception("kvpool: copying %d same-host blocks failed: they are recomputed", len(keys))
            rest, failed = [], set(range(len(keys)))
        load.waited_s += time.perf_counter() - started  # the step's time, as a wait for a layer is
        if rest:
            self._load_future = self._loader.submit(self._pull, load, keys, rest, failed, time.thread_time() - cpu)
        else:
            self._load_future = None
            self._loaded(load, failed, time.thread_time() - cpu)

    def _object_keys(self, keys: Iterable[bytes]) -> list[bytes]:
        """This rank's objects of the blocks ``keys`` (the scheduler's, one per block): the keys
        themselves in an engine of one rank, else each rank's own
        (:func:`~kvpool.integrations.vllm_settings.object_key`): a rank saves and loads only its
        own share of a block, and a rank whose object is missing fails the block (recomputed)."""
        return [object_key(key, self._rank_tag) for key in keys]

    def _group_ids(self, transfers: list[Transfer]) -> list[list[int]]:
        """The transfers' blocks in each KV cache group, one list per group."""
        return [[b for t in transfers for b in t.ids(g)] for g in range(self._groups)]

    @staticmethod
    def _owners(transfers: list[Transfer]) -> list[tuple[str, int]]:
        """(request, its block) of each block the transfers load, in the load's order."""
        return [(t.req_id, t.first + i) for t in transfers for i in range(len(t.keys))]

    def _pull(self, load: _LayerLoad, keys: list[bytes], rest: list[int] | None = None,
              failed: set[int] | None = None, cpu_before: float = 0.0) -> None:
        """A loader thread: blocks a same-host node holds in its shared-memory arena are
        copied from there straight into the paged cache (:meth:`_copy_in_place`; ``rest``
        given: the model's thread did that already, these are the indices left, ``failed``
        what failed there, ``cpu_before`` its CPU time); the others are pulled
        (:meth:`_pull_remote`, through a staging buffer: a load that timed out writes nothing
        into the cache later). Each layer is handed to the model (``load.done``) as soon as
        every block has it; the blocks (indices) that failed end in ``load.failed_rows``
        (every block, should anything here raise: none is used)."""
        failed = set() if failed is None else failed
        cpu = time.thread_time()
        try:
            if rest is None:
                rest = self._copy_in_place(load, keys, failed)  # (the loaders run on pull_cpus)
            if rest and not load.timed_out:
                self._pull_remote(load, [keys[i] for i in rest], rest, failed)
        except BaseException:
            failed.update(range(load.blocks))
            raise
        finally:
            self._loaded(load, failed, cpu_before + time.thread_time() - cpu)

    def _loaded(self, load: _LayerLoad, failed: set[int], cpu_s: float) -> None:
        """A load is over: its failed blocks, its times, every layer handed to the model."""
        load.failed_rows = failed
        load.finished_s = time.perf_counter() - load.started
        load.loader_cpu_s = cpu_s
        for event in load.done:
            event.set()
        self._loading(-1)

    def _loading(self, change: int) -> None:
        """Count a load handed to a loader thread (+1) or finished (-1); the saver waits on
        ``_loads_idle``."""
        with self._count_lock:
            self._loads_in_flight += change
            if self._loads_in_flight:
                self._loads_idle.clear()
            else:
                self._loads_idle.set()

    def _copy_in_place(self, load: _LayerLoad, keys: list[bytes], failed: set[int]) -> list[int]:
        """Copy the blocks found in a same-host node's cxl arena (through its shared index, no
        master, no pull) layer by layer into the paged cache, each copy verified against the
        block's header as it is made (one ``copy_layer_in_place`` per layer for every block); the
        indices of the blocks left to pull: not found, or a copy failed its checksum (all of
        that block's layers are then pulled again, so it is whole or reported failed). Hands
        each layer to the model as it lands when nothing is left to pull."""
        everything = list(range(len(keys)))
        if not self._on_host or self.settings.transport != "auto":
            return everything
        started = time.perf_counter()
        found = self.pool.find_in_place(keys)
        here = [i for i, hit in enumerate(found) if hit is not None]
        if not here:
            return everything
        fits = [i for i in here if found[i].spec.layers == len(self._layers)
                and found[i].spec.layer_nbytes == self._block_nbytes]
        bad: set[int] = set(here) - set(fits)
        if bad:
            log.warning("kvpool: %d same-host blocks have another shape than this cache's (%s): pulled instead",
                        len(bad), found[min(bad)].spec)
        rest = sorted(set(everything) - set(fits) | bad)
        for layer, cache in enumerate(self._byte_layers):
            with load.lock:
                if load.timed_out:  # the model went on: vLLM recomputes into these blocks
                    break
                ids = load.groups[self._layer_group[layer]]  # (a window group's block left behind: none)
                live = [i for i in fits if i not in bad and ids[i] != NULL_BLOCK]
                try:
                    ok = self.pool.copy_layer_in_place(layer, [found[i] for i in live],
                                                       [cache[ids[i]] for i in live])
                except errors.KVPoolError as exc:  # (shapes were checked above) these are pulled
                    log.warning("kvpool: same-host arena copy refused (%s): pulling %d blocks", exc, len(live))
                    ok = [False] * len(live)
                bad.update(i for i, good in zip(live, ok) if not good)
                if not rest and not bad:
                    load.done[layer].set()
        in_place = len(fits) - len(bad)
        load.in_place += in_place
        load.copy_s += time.perf_counter() - started
        self._count("blocks_in_place", in_place)
        return sorted(set(rest) | bad)

    def _pull_remote(self, load: _LayerLoad, keys: list[bytes], rows: list[int], failed: set[int]) -> None:
        """Every block's layers (``keys[i]`` is the load's block ``rows[i]``),
        ``layers_per_pull`` at a time, all asked for at once: layer group by layer group
        (every block's first group, then every block's second, ...) in one ``get_many`` per
        stream (each its own connection to a holder, which answers in order), into a staging
        buffer. Each pull is reported as it lands verified (``landed``); when every block has
        a group, its layers are copied into the paged cache (one gather-copy per layer, no
        per-block Python) and handed to the model (``load.done``) while the later groups are
        still arriving. A round trip per group would cost a pipeline start and drain each, the
        holder idle while the reader asks again (hence one get_many for all groups). Blocks that
        fail go in ``failed`` (the load's indices, ``rows[i]``); once the model went on without
        a layer (``load.timed_out``) nothing more is written into the cache (pulls in flight
        land in the staging buffer only). ("Groups" here are layers pulled together, not
        vLLM's KV cache groups.)"""
        group, layers_count, n = self._layers_per_pull, len(self._layers), len(keys)
        groups = [range(first, min(first + group, layers_count)) for first in range(0, layers_count, group)]
        staging = self._staging_for(n, layers_count)  # row i: block i's layers
        waiting = [n] * len(groups)  # blocks each group still waits for
        missing: list[set[int]] = [set() for _ in groups]
        told = np.zeros((len(groups), n), bool)
        lock = threading.Lock()
        copied = [0.0]

        def landed(g: int, i: int, arr: np.ndarray | None) -> None:
            with lock:
                if told[g, i]:
                    return
                told[g, i] = True
                if arr is None:
                    missing[g].add(i)
                waiting[g] -= 1
                complete = not waiting[g]
            if complete:
                took = self._group_landed(load, groups[g], rows, staging, missing[g], failed)
                with lock:  # (streams finish groups on their own threads)
                    copied[0] += took

        streams = max(1, min(self._pull_streams, n // _MIN_BLOCKS_PER_STREAM))
        step = -(-n // streams)

        def one(at: int) -> None:
            items = [(g, i) for g in range(len(groups)) for i in range(at, min(at + step, n))]
            started = time.perf_counter()
            try:
                got = self.pool.get_many(
                    [keys[i] for _, i in items], layers=[groups[g] for g, _ in items],
                    outs=[staging[i, groups[g].start:groups[g].stop] for g, i in items],
                    landed=lambda j, arr: landed(*items[j], arr))
            except errors.KVPoolError as exc:
                log.warning("kvpool: loading %d blocks failed: %s", len(items) // len(groups), exc)
                got = [None]
            finally:
                for g, i in items:  # (each told once: these only if the get_many ended early)
                    landed(g, i, None)
            if all(arr is not None for arr in got):  # a request's cost, for the planner
                with self._count_lock:
                    self._report.setdefault("pulls", []).append(
                        [sum(len(groups[g]) for g, _ in items) * self._block_nbytes, time.perf_counter() - started])

        started = time.perf_counter()
        others = [self._streams.submit(one, at) for at in range(step, n, step)]
        one(0)
        for future in others:
            future.result()
        load.copy_s += copied[0]
        load.pull_s += time.perf_counter() - started - copied[0]

    def _group_landed(self, load: _LayerLoad, layers: range, rows: list[int], staging: np.ndarray,
                      missing: set[int], failed: set[int]) -> float:
        """One layer group of every block (staging row i: the load's block ``rows[i]``) is in
        the staging buffer (but ``missing``): copied into the paged cache and handed to the
        model. Returns the seconds it took."""
        started = time.perf_counter()
        ok = [i for i in range(len(rows)) if i not in missing]
        with load.lock:
            failed.update(rows[i] for i in missing)
            if load.timed_out:  # the model went on without these blocks: vLLM recomputes them
                return 0.0  # into blocks it may reuse meanwhile, so nothing more is written there
            try:
                for layer in layers:
                    if ok:
                        ids = load.groups[self._layer_group[layer]]
                        self._write_layer(layer, [ids[rows[i]] for i in ok],
                                          staging[:, layer] if len(ok) == len(rows) else staging[ok, layer])
                    load.done[layer].set()
            except Exception:  # (called from inside a get_many: never raised there) recomputed whole
                log.exception("kvpool: copying layers %d..%d into the paged cache failed; their %d blocks are "
                              "recomputed", layers[0], layers[-1], len(rows))
                failed.update(rows)
        return time.perf_counter() - started

    def _staging_for(self, blocks: int, layers: int) -> np.ndarray:
        """A [blocks, layers, ...] buffer the pulls land in, reused from load to load (a fresh
        one would cost a page fault per 4 KiB on every load)."""
        nbytes = blocks * layers * self._block_nbytes
        staging = self._stagings.get(threading.get_ident())
        if staging is None or staging.nbytes < nbytes:
            staging = self._stagings[threading.get_ident()] = np.empty(nbytes, np.uint8)
        return staging[:nbytes].view(self._np_dtype).reshape(blocks, layers, *self._shape[1:])

    def _write_layer(self, layer: int, block_ids: list[int], data: np.ndarray) -> None:
        """Copy one layer of several blocks (host bytes, [blocks, ...]) into the paged cache,
        wherever it lives, in one call: a numpy scatter on the host (faster there than torch's
        ``index_copy_``; measurement: docs/benchmarks.md), ``index_copy_`` on a device. A block
        that is vLLM's null block (a window group's block left behind) is skipped: that layer of
        it is not kept."""
        if NULL_BLOCK in block_ids:
            keep = [i for i, b in enumerate(block_ids) if b != NULL_BLOCK]
            if not keep:
                return
            block_ids, data = [block_ids[i] for i in keep], data[keep]
        target = self._layers[layer]
        if target.dtype == torch.bfloat16:
            target, data = target.view(torch.int16), data.view(np.int16)
        if target.device.type == "cpu":
            target.numpy()[block_ids] = data.reshape(len(block_ids), *target.shape[1:])
            return
        source = torch.from_numpy(np.ascontiguousarray(data)).reshape(len(block_ids), *target.shape[1:])
        target.index_copy_(0, torch.tensor(block_ids, dtype=torch.long, device=target.device),
                           source.to(target.device))

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._load
        layer = self._layer_index.get(layer_name)
        if load is None or layer is None:
            return
        started = time.perf_counter()
        if not load.done[layer].wait(self.settings.load_timeout_s):
            log.warning("kvpool: layer %d did not load within %.1f s: its blocks are recomputed", layer,
                        self.settings.load_timeout_s)
            with load.lock:  # a layer being written finishes first; then nothing more is
                load.timed_out = True
        load.waited_s += time.perf_counter() - started
        if layer == len(self._layers) - 1:
            self._finish_load()

    def _finish_load(self) -> None:
        load, self._load = self._load, None
        if load is None:
            return
        if self._load_future is not None:
            concurrent.futures.wait([self._load_future], self.settings.load_timeout_s)
        # (a load in the step: never one of a model of several KV cache groups, whose loads are
        # all asynchronous; see get_transfer_results)
        failed = load.ids_of(load.failed())
        if failed:
            self._failed_blocks |= failed
            self._note_failures(load)
            log.info("kvpool: %d blocks failed to load; vLLM recomputes them", len(failed))
        self._last_waited = load.waited_s
        self.stats["load_wait_s"] += load.waited_s
        self.stats["load_total_s"] += load.finished_s
        log.info("kvpool load: %d blocks of %d layers in %.2f ms, the model waited %.2f ms for them (%d in place "
                 "from a same-host arena; %d layers per pull; pulls %.2f ms, copies into the cache %.2f ms, their CPU "
                 "time %.2f ms, started %.2f ms after the step)",
                 load.blocks, len(self._layers), load.finished_s * 1e3, load.waited_s * 1e3, load.in_place,
                 self._layers_per_pull, load.pull_s * 1e3, load.copy_s * 1e3, load.loader_cpu_s * 1e3,
                 (load.started - self._step_started) * 1e3 if self._step_started else 0.0)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished`'s requests, and among them (a model of several KV cache groups)
        those whose load failed: ``failed_recving``.

        vLLM 0.32's scheduler maps failed block ids (:meth:`get_block_ids_with_load_errors`)
        back to requests only with one KV cache group: with several (the hybrid allocator) a
        block id names a block of each group, and it raises RuntimeError on any. Such a model's
        loads are therefore all asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS``),
        and a request with a failed block is reported here, finished and failed in one pass:
        vLLM then frees its blocks (none of them ever cached) and schedules it anew, and the
        scheduler's connector, told the first failed block (:class:`KvpoolWorkerMetadata`),
        loads only the blocks before it; vLLM computes the rest. With one group, failed blocks
        go to :meth:`get_block_ids_with_load_errors` as before (vLLM keeps the loaded blocks
        before the first failed one and computes from there)."""
        sending, recving = self.get_finished(finished_req_ids)
        failed, self._failed_requests = self._failed_requests, set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()), finished_recving=set(recving or ()),
                                          failed_recving=failed)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        """The first failed block of each request whose load failed since the last step
        (:class:`KvpoolWorkerMetadata`); None when none failed."""
        if not self._load_failures:
            return None
        failures, self._load_failures = self._load_failures, {}
        return KvpoolWorkerMetadata(failures)

    def _note_failures(self, load: _LayerLoad) -> None:
        """Count a finished load's failed blocks and remember each request's first (for
        :meth:`build_connector_worker_meta`)."""
        self._count("blocks_failed", len(load.failed()))
        for req_id, block in load.failures().items():
            self._load_failures[req_id] = min(block, self._load_failures.get(req_id, block))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The requests whose asynchronous load finished (loaded, failed, or given up after
        ``load_timeout_s``: then every block of it is reported for recompute, and the loader
        writes nothing more into the cache). Their failed blocks are in this same pass's
        :meth:`get_block_ids_with_load_errors`, as vLLM requires; with several KV cache groups
        the requests they belong to are in :meth:`get_transfer_results`' ``failed_recving``
        instead."""
        if not self._async_loads:
            return None, None
        done: set[str] = set()
        pending = []
        now = time.perf_counter()
        for load, future in self._async_loads:
            if not future.done():
                if now - load.started < self.settings.load_timeout_s:
                    pending.append((load, future))
                    continue
                with load.lock:  # a layer being written finishes first; then nothing more is
                    load.timed_out = True
                log.warning("kvpool: an asynchronous load of %d blocks did not finish within %.1f s: they are "
                            "recomputed", load.blocks, self.settings.load_timeout_s)
                load.finished_s = now - load.started
            done.update(load.req_ids)
            rows = load.failed()
            if rows:
                self._note_failures(load)
                if self._groups > 1:
                    requests = load.failures()
                    self._failed_requests |= set(requests)
                    log.info("kvpool: %d blocks of %d requests failed to load; vLLM computes each request "
                             "from its first failed block on", len(rows), len(requests))
                else:
                    self._failed_blocks |= load.ids_of(rows)
                    log.info("kvpool: %d blocks failed to load; vLLM recomputes them", len(rows))
            self.stats["load_total_s"] += load.finished_s
            log.info("kvpool load: %d blocks of %d layers in %.2f ms, the model waited 0.00 ms for them (%d in place "
                     "from a same-host arena; asynchronous: %d requests waited outside the model's steps; pulls "
                     "%.2f ms, copies into the cache %.2f ms)", load.blocks, len(self._layers),
                     load.finished_s * 1e3, load.in_place, len(load.req_ids), load.pull_s * 1e3, load.copy_s * 1e3)
        self._async_loads = pending
        return None, done or None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        with self._count_lock:
            report, self._report = self._report, {}
        if not report:
            return None
        # One round: every layer group of a load is asked for at once (see _pull_remote).
        return KvpoolStats(data={**report, "block_bytes": self._block_nbytes, "layers": len(self._layers),
                                 "rounds": 1, "node_ids": [getattr(self.pool, "node_id", "")],
                                 "tails": self._token_axis is not None})

    def _count(self, name: str, n: float) -> None:
        """A worker counter: in this process's stats and in the next report to the scheduler
        (the saver thread counts too)."""
        with self._count_lock:
            self.stats[name] = self.stats.get(name, 0) + n
            self._report[name] = self._report.get(name, 0) + n

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str) -> None:
        meta = self._step_meta()
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves or not self.saves_blocks:  # (a kv_consumer's scheduler sends none)
            return
        stage = self._stage
        if stage is None:
            # The step's blocks to save, each key once (two requests may fill the same block),
            # staged as one array: object i is stage.objects[i], [layers, ...], contiguous.
            # A tail (a block's first transfer.tail_tokens tokens) only where its other slots can be zeroed.
            chosen: dict[bytes, tuple[int, ...]] = {}
            valid: dict[bytes, int] = {}
            for transfer in meta.saves:
                if transfer.tail_tokens and self._token_axis is None:
                    continue
                for i, key in enumerate(transfer.keys):
                    chosen.setdefault(key, tuple(transfer.ids(g)[i] for g in range(self._groups)))
                if transfer.tail_tokens:
                    valid[transfer.keys[-1]] = transfer.tail_tokens
            if not chosen:
                return
            stage = self._stage = _Stage(
                self._object_keys(chosen), [torch.tensor([ids[g] for ids in chosen.values()], dtype=torch.long)
                               for g in range(self._groups)],
                np.empty((len(chosen), len(self._layers), *self._shape[1:]), self._np_dtype),
                [(row, valid[key]) for row, key in enumerate(chosen) if key in valid])
        # One gather of the layer's blocks (no per-block Python), then one strided copy.
        ids = stage.block_ids[self._layer_group[layer]]
        blocks = self._layers[layer].index_select(0, ids.to(self._layers[layer].device)).cpu()
        if blocks.dtype == torch.bfloat16:
            blocks = blocks.view(torch.int16)
        stage.objects[:, layer] = blocks.numpy().view(self._np_dtype).reshape(len(stage.keys), *self._shape[1:])
        for row, tokens in stage.tails:
            block = stage.objects[row, layer].reshape(self._block_shape)
            block[(slice(None),) * (self._token_axis or 0) + (slice(tokens, None),)] = 0

    def wait_for_save(self) -> None:
        waited = self._load.waited_s if self._load is not None else self._last_waited
        if self._load is not None:  # a step whose model never waited for the last layer
            self._finish_load()
        meta = self._meta
        if meta is not None and meta.num_tokens >= self.block_size and self._step_started:
            seconds = time.perf_counter() - self._step_started - waited  # computing, not waiting for loads
            self._report.setdefault("prefill", []).append([meta.num_tokens, seconds])
        self._step_started, self._last_waited = 0.0, 0.0
        stage, self._stage = self._stage, None
        if stage is None:
            return
        self._saves = [f for f in self._saves if not f.done()]
        if self.settings.save_async or self._master_away:  # off the model's path: the step does not wait
            if self._master_away and self._saves:  # one save at a time tries while the master is away
                self._count("blocks_save_skipped", len(stage.keys))
                return
            self._saves.append(self._saver.submit(self._save, stage))
            return
        # Published before the step's output leaves the engine: once a request's answer (or first
        # token) is out, any engine's lookup finds its prompt's full blocks. The model's thread
        # puts them itself: it would only wait for the saver meanwhile, and its core is the one
        # sure to be free (the saver's may be another engine's). The put is bounded by the
        # master's deadline; once the master is found away, steps stop waiting (above).
        started = time.perf_counter()
        self._save(stage, yield_to_loads=False)
        self._count("save_wait_s", time.perf_counter() - started)

    def _save(self, stage: _Stage, yield_to_loads: bool = True) -> None:
        """Put one step's blocks (the saver thread) in ``put_many`` batches of about
        ``_SAVE_BATCH_BYTES``, durable by the one rule of :func:`kvpool.client.durable_copies`
        (the ``durable`` / ``replicas`` settings, else the pool config's ``node.durable`` /
        ``node.replicas``): one placement and one replicate exchange per storage node for each
        batch. ``yield_to_loads`` (``save_async``): loads come first: before each batch the saver
        waits, up to ``_SAVE_YIELD_S``, while a load is in flight (the saver and the loader share
        the cores the model leaves); else (the step waits for this) one ``put_many`` of them all,
        one master round trip."""
        started = time.perf_counter()
        per_batch = max(1, _SAVE_BATCH_BYTES // max(1, stage.objects[0].nbytes)) if yield_to_loads else len(stage.keys)
        for at in range(0, len(stage.keys), per_batch):
            if yield_to_loads:
                self._loads_idle.wait(_SAVE_YIELD_S)
            keys = stage.keys[at:at + per_batch]
            try:
                self.pool.put_many(zip(keys, stage.objects[at:at + per_batch]), dtype=self._dtype_name,
                                    durable=self.settings.durable, replicas=self.settings.replicas)
                self._count("blocks_saved", len(keys))
                if self._master_away:
                    self._master_away = False
                    log.info("kvpool: the master answers again: steps wait for their saves again")
            except errors.KVPoolError as exc:  # a save that fails is a future miss, never an engine error
                log.warning("kvpool: saving %d blocks failed: %s", len(keys), exc)
                if isinstance(exc, errors.MasterUnreachableError) and not self._master_away:
                    # Until a save gets through, steps do not wait for theirs (each would wait for
                    # the master's deadline) and one save at a time tries; the rest are not stored.
                    self._master_away = True
                    log.warning("kvpool: the master is away: saves go on without the steps waiting for them, "
                                "one at a time, until one gets through")
        self._count("save_s", time.perf_counter() - started)

    def wait_saved(self, timeout_s: float | None = None) -> None:
        """Until every save handed to the saver thread so far has finished (tests, shutdown)."""
        concurrent.futures.wait(self._saves, timeout_s)
        self._saves = [f for f in self._saves if not f.done()]

    def shutdown(self) -> None:
        if self._load_future is not None:
            concurrent.futures.wait([self._load_future], self.settings.load_timeout_s)
        concurrent.futures.wait([f for _, f in self._async_loads], self.settings.load_timeout_s)
        self._loader.shutdown(wait=False)
        self._async_loader.shutdown(wait=False)
        self._streams.shutdown(wait=False)
        self._saver.shutdown(wait=True)  # saves in flight finish first
        log.info("kvpool saves: %d blocks saved in %.3f s (the steps waited %.3f s for them)",
                 self.stats["blocks_saved"], self.stats["save_s"], self.stats.get("save_wait_s", 0.0))
        started = time.perf_counter()
        self.pool.close()  # hands the blocks to a storage node on this host first (node.hand_off_s)
        done = getattr(self.pool, "handed_off", None)
        if done is not None and done["target"] is None and done["left"]:
            log.info("kvpool hand-off at exit: no storage node on this host (or no master): %d blocks gone with "
                     "this engine", done["left"])
        elif done is not None and done["target"] is not None:
            log.info("kvpool hand-off at exit to storage node %s: %d blocks kept there, %d held there already, "
                     "%d failed, %d gone with this engine; closed in %.2f s", done["target"][:8], done["adopted"],
                     done["held"], done["failed"], done["left"], time.perf_counter() - started)
