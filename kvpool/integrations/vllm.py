"""kvpool as vLLM's KV store: a v1 KV connector, layer by layer.

Load it with::

    KVTransferConfig(kv_connector="KvpoolConnector",
                     kv_connector_module_path="kvpool.integrations.vllm",
                     kv_role="kv_both",
                     kv_connector_extra_config={"master": "tcp://127.0.0.1:7700",
                                                "config": "optional kvpool TOML"})

(``--kv-transfer-config '{"kv_connector": "KvpoolConnector", ...}'`` for
``vllm serve``). Extra settings: ``master`` (required), ``config`` (a kvpool
TOML for this engine's own pool: tiers, security; without one, no dram tier: every save lands
in the worker's shared-memory arena, which the other engines on the host read in place,
:func:`~kvpool.integrations.vllm_settings.default_pool_config`), ``durable`` (also keep
``replicas`` copies on kvpool storage nodes, so the KV outlives this engine) and
``replicas``: left out, the pool config's ``node.durable`` / ``node.replicas``
decide (false / 1 by default), the one rule of ``put`` and ``put_many``
(:func:`kvpool.client.durable_copies`); ``load_timeout_s`` (how long the model waits
for a layer before those blocks are recomputed; 30), ``on_load_failure``
(``"recompute"``, the default: a block kvpool cannot deliver intact is computed
instead; ``"fail"``: vLLM fails the request, its own default), ``transport``
(``"auto"``: same-host holders over shared memory, others over TCP; ``"tcp"``),
``plan`` (load only where loading beats recomputing; true), ``layers_per_pull``
(``"auto"`` or a count, below), ``load_async`` (true: a request waits for its blocks
outside the model's steps; false: its first step waits for them, layer by layer;
``"auto"``, the default: false for blocks read without the network, true for pulled ones,
see :meth:`KvpoolConnector._lookup`), ``cpus``
(where the worker's kvpool threads run, :func:`worker_cpus`: ``"auto"``, ``"inherit"`` or a
list of CPU ids), ``model_id`` (names the model's weights in the namespace instead of
their content fingerprint, :func:`~kvpool.integrations.vllm_settings.model_fingerprint`).

``kv_role``: ``kv_both`` engines load and save; a ``kv_producer`` engine (prefill in a
prefill/decode split) saves its blocks and never looks them up or loads them (every request
is computed whole); a ``kv_consumer`` engine (decode) loads and never saves (nothing it
computes is stored, no saver thread puts anything).

One kvpool object per full vLLM block: the block's bytes of every layer,
layer-major, under the block's key: the prefix hash (:func:`kvpool.hashing.prefix_hashes`
of the request's tokens, chunk = block size), chained with what else vLLM's own
prefix cache tells apart when the request has it (LoRA adapter, multimodal inputs,
``cache_salt``; a request whose extras cannot be read, or with prompt embeddings, is
computed without kvpool: :func:`~kvpool.integrations.vllm_settings.request_keys`).
The bytes are vLLM's own block layout, stored as they are: the namespace of the hashes
names the model, the cache dtype, the block size, the layout of a block (shape and
device kind, the CPU's vector ISA on CPU) and the tensor- and pipeline-parallel sizes,
so only an engine that reads blocks the same way ever finds them, and a load is a copy
of each layer straight into the paged cache's block (``out=`` views of it), no decode.
With several ranks (TP, PP), each rank's share of a block is its own object, under
``xxh3_128(rank || block key)`` (:func:`~kvpool.integrations.vllm_settings.object_key`):
the scheduler counts a block held only when every rank's object is, and a rank that
misses its own at load time reports the block failed (recomputed), never reading
another rank's. Context parallelism (DCP, PCP) is refused at start.

Scheduler side (EngineCore process): one batched ``lookup`` per new request
(one master round trip) finds how many leading blocks of the prompt kvpool holds
beyond vLLM's own prefix-cache hits; at most all but the last prompt token load
(vLLM must compute one). Partial blocks are never stored or loaded. When some are
held and ``load_async`` is ``"auto"``, the same request says whether the first and the
last held block are where a worker reads them without the network.

Worker side, loads: blocks a same-host node keeps in its shared-memory ``cxl`` arena are
copied from there straight into the paged cache, layer by layer, each copy verified as it
is made (found through the arena's shared index: no master, no pull); the others are
pulled. For a request that waits outside the steps (``load_async``: by default one whose
blocks are pulled over the network), :meth:`KvpoolConnector.get_num_new_matched_tokens` tells
vLLM to keep the request waiting (``WAITING_FOR_REMOTE_KVS``) while a thread of its own
loads the blocks, and :meth:`~KvpoolConnector.get_finished` hands the request back when
they are in (failed blocks reported in the same pass): no forward pass waits for a load,
other requests' steps go on, but the request's own forward pass starts only after its
load (``docs/vllm.md`` compares the two). For the others (by default blocks in a
same-host arena or the worker's own pool),
:meth:`KvpoolConnector.start_load_kv` hands the step's loads to a long-lived loader
thread, which asks for every block in one pipelined ``get_many`` per stream (one
``locate`` for all the step's blocks at most, then the location cache), ``layers_per_pull``
layers of a block per pull, layer group by layer group, into one reused staging buffer;
when every block has a group, one scatter per layer moves it into the paged cache and
:meth:`~KvpoolConnector.wait_for_layer_load` lets the model go on with those layers while
later ones are still in flight. Every pull costs a fixed amount of CPU on both sides, so
``"auto"`` (the default) makes each move at least 4 MiB of a block: blocks up to that
size go whole, one pull each. :meth:`~KvpoolConnector.save_kv_layer` gathers
each layer's newly full blocks as the forward pass produces them;
:meth:`~KvpoolConnector.wait_for_save` hands the step's objects to a saver thread (one
``put_many``: one master round trip, and when durable one placement and one replicate
exchange per storage node), so the next step does not wait for them. Blocks a request
loaded, blocks vLLM had itself and held blocks the planner recomputes are not saved
again. A block that cannot be loaded whole (a miss, a checksum failure, a dead holder,
the deadline) is reported to vLLM, which recomputes it: kvpool never hands the model
bytes it did not verify. (With several KV cache groups, vLLM takes that report only as a
failed request that waited outside the steps: such a model's loads all do, see
:meth:`KvpoolConnector.get_transfer_results`.) A model whose KV cache is not made of
full-attention layers, with or without sliding-window groups beside them, is refused at start
(:func:`check_model_kind`). Where a load's time goes: ``docs/vllm.md``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from kvpool import errors
from kvpool.integrations.planner import Planner
from kvpool.integrations.vllm_settings import (
    Settings,
    check_parallel,
    default_pool_config,
    model_fingerprint,
    namespace_of,
    object_key,
    rank_tag,
    rank_tags,
    request_keys,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvpoolConnector", "KvpoolConnectorMetadata", "KvpoolStats", "KvpoolWorkerMetadata", "Settings",
           "Transfer", "check_model_kind", "check_parallel", "model_fingerprint", "namespace_of", "object_key",
           "open_pool", "pull_cpus", "rank_tag", "rank_tags", "request_keys", "threads_on", "worker_cpus"]

log = logging.getLogger("vllm.kvpool")  # under vLLM's logger: its handlers and levels apply

# "auto" layers per pull: each pull moves at least this much of a block (a whole block when
# it is smaller). Every pull costs each side ~50-65 us of CPU whatever its size (request,
# pin, send, reply, checks; measured on loopback here), which a load of many small pulls pays
# thousands of times, while overlap with the model gains at most the step's compute: in one
# pipelined request per load, vLLM-CPU TCP TTFT was 1.87x / 1.42x / 0.99x ExampleConnector's
# at 2, 4, 8 (all) layers of 128 KiB per pull (2k tokens; 8k: 1.30x / 0.95x / 0.99x).
_PULL_TARGET_BYTES = 4 << 20
_STAGING_PREPARED_BYTES = 256 << 20  # at most this much staging buffer made at start, per loader thread
# Saves give way to loads: a step's blocks go in put_many batches of about this many bytes,
# and before each the saver waits (at most _SAVE_YIELD_S) while a load is in flight.
_SAVE_BATCH_BYTES = 8 << 20
_SAVE_YIELD_S = 0.05
# A load's blocks go in up to this many concurrent get_many calls (streams), each on its own
# connection (holders serve one connection's pulls one after another), one per CPU the
# connector's threads run on: more threads than CPUs only take turns with the GIL. 16 blocks of
# 1 MiB from another node's dram over TCP, every group in flight at once, with both of this
# VM's CPUs free: 1 stream 0.61x get_many's speed, 2 streams 0.56x, 4 streams 0.40x.
_PULL_STREAMS = 4
_MIN_BLOCKS_PER_STREAM = 4
_DTYPES = {torch.bfloat16: ("bfloat16", np.uint16), torch.float16: ("float16", np.float16),
           torch.float32: ("float32", np.float32), torch.uint8: ("uint8", np.uint8)}


# vLLM's block pool hands out block 0 as its shared null block (BlockPool: the first block,
# ``is_null``): with the hybrid allocator, a sliding-window group's blocks that left the
# window are it. Nothing is ever loaded into it or saved from it.
NULL_BLOCK = 0


@dataclass
class Transfer:
    """Blocks of one request to load or save this step: ``keys[i]`` is block ``block_ids[i]``
    of the first KV cache group, ``groups[g - 1][i]`` of group ``g`` (vLLM's hybrid
    allocator: one list per further group, same length; empty with one group). A load's
    ``keys[0]`` is the request's block ``first`` (its prompt's blocks counted from 0)."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    groups: tuple[list[int], ...] = ()
    first: int = 0

    def ids(self, group: int) -> list[int]:
        return self.block_ids if group == 0 else self.groups[group - 1]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # Loads of requests waiting outside the model's steps (``load_async``): finished through
    # get_finished, never waited for by a forward pass.
    async_loads: list[Transfer] = field(default_factory=list)
    num_tokens: int = 0  # tokens the step computes (the worker measures the prefill rate)


@dataclass
class KvpoolWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler's connector after a step (vLLM's worker-to-scheduler
    channel): ``load_failures`` {request id: the first of its prompt's blocks that failed to
    load}. The scheduler never loads that block or any after it for the request again: vLLM
    computes them (and a request it looks up anew, as after a failed asynchronous load of a
    model with several KV cache groups, loads only the blocks before)."""

    load_failures: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.load_failures)
        for req_id, block in getattr(other, "load_failures", {}).items():
            merged[req_id] = min(block, merged.get(req_id, block))
        return KvpoolWorkerMetadata(merged)


class KvpoolStats(KVConnectorStats):
    """What a worker measured since its last report, for the scheduler's planner and vLLM's
    stats log: ``pulls`` [[bytes, seconds]] of each load request, ``prefill`` [[tokens,
    seconds]] of each step that computed at least a block, ``block_bytes`` (one block, one
    layer), ``layers``, ``node_ids`` (the workers' kvpool nodes), and counters."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            elif name in ("block_bytes", "layers", "rounds"):
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        pulls, prefill = self.data.get("pulls", []), self.data.get("prefill", [])
        return {"pulls": len(pulls), "MB pulled": round(sum(b for b, _ in pulls) / 1e6, 3),
                "pull s": round(sum(t for _, t in pulls), 4),
                "prefill tokens/s": round(sum(n for n, _ in prefill) / max(sum(t for _, t in prefill), 1e-9), 1),
                **{k: v for k, v in self.data.items()
                   if not isinstance(v, list) and k not in ("block_bytes", "layers", "rounds")}}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("pulls", "prefill", "blocks_loaded", "blocks_saved",
                                                    "blocks_failed"))


@dataclass
class _Tracked:
    """What the scheduler side remembers of a running request."""

    keys: list[bytes]            # prefix hashes of its full prompt blocks
    block_ids: list[list[int]] = field(default_factory=list)  # its blocks, per KV cache group
    saved_upto: int = 0          # blocks below this are in kvpool (loaded, hit, or saved)
    first: int = 0               # blocks vLLM had computed itself when the request arrived
    load: Transfer | None = None  # blocks to load at its first step
    load_async: bool = False     # whether it waits for its blocks outside the model's steps
    failed_from: int | None = None  # a load of this block failed: it and the blocks after it are computed


@dataclass
class _Stage:
    """One step's blocks to save: ``objects[i]`` ([layers, ...]) is ``keys[i]``'s object,
    filled layer by layer from the paged cache's ``block_ids[g][i]`` (``g``: the layer's KV
    cache group)."""

    keys: list[bytes]
    block_ids: list[torch.Tensor]  # per KV cache group
    objects: np.ndarray


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
        self.loader_cpu_s = 0.0  # CPU time the loader thread used (the rest of its time it waited)
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


def check_model_kind(kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse, with one ConfigError at start-up, a model whose KV cache this connector cannot
    store and load block for block. Served: KV cache groups of full-attention layers
    (``FullAttentionSpec``, MLA included), each block of a prompt kept, and beside at least
    one such group, sliding-window groups (``SlidingWindowSpec``: vLLM's hybrid allocator,
    which this connector supports, keeps only their blocks inside the window; the others are
    its null block), all of one block size. One object per block holds every layer of every
    group; a sliding-window group's layers of a block outside its window are neither loaded
    nor saved. With the hybrid allocator off (always on vLLM-CPU) sliding-window layers are
    promoted to full attention: one group. Refused: a model of only sliding-window or
    chunked-local layers, Mamba state, cross-attention and encoder-only caches, groups of
    several block sizes."""
    if kv_cache_config is None:
        return
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec

    groups = kv_cache_config.kv_cache_groups
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    full = [type(g.kv_cache_spec) in (FullAttentionSpec, MLAAttentionSpec)
            and getattr(g.kv_cache_spec, "attention_chunk_size", None) is None for g in groups]
    window = [type(g.kv_cache_spec) is SlidingWindowSpec for g in groups]
    sizes = {g.kv_cache_spec.block_size for g in groups}
    if any(full) and all(f or w for f, w in zip(full, window)) and len(sizes) == 1:
        return
    described = ", ".join(f"{kind} ({len(g.layer_names)} layers, block {g.kv_cache_spec.block_size})"
                          for kind, g in zip(kinds, groups)) or "none"
    raise errors.ConfigError(
        f"kvpool connector: this model's KV cache cannot be stored block for block: {len(groups)} KV cache "
        f"group(s): {described}. The connector needs full-attention layers (FullAttentionSpec or "
        f"MLAAttentionSpec), with or without sliding-window groups beside them, all of one block size. "
        f"Run this model without the kvpool connector.")


def worker_cpus(setting: str | frozenset[int]) -> frozenset[int] | None:
    """The CPUs the connector's threads run on in a worker process (None: where they are
    created). vLLM-CPU binds its compute threads, the main thread among them, to the cores
    of ``VLLM_CPU_OMP_THREADS_BIND``, and every thread started later inherits that binding:
    left alone, kvpool's loader, pulls and saves would take turns with the model on its
    own cores (measured: a same-host load's copies 66-71 ms instead of 18 ms, the model
    slowed by as much) while the cores vLLM leaves for the framework sit idle. ``"auto"``:
    the CPUs this process may use that the calling thread is not bound to (the model's are
    the rest), or all of them when none are left (a process nothing bound: no change).
    ``"inherit"``: as created. A set: those; ConfigError names any this process may not use
    (checked at start, not when a thread would fail to start)."""
    if setting == "inherit" or not hasattr(os, "sched_setaffinity"):
        return None
    model = os.sched_getaffinity(0)
    named = frozenset() if isinstance(setting, str) else frozenset(setting)
    allowed = _allowed_cpus(model | named)
    if named:
        if not named <= allowed:
            raise errors.ConfigError(
                f'kv_connector_extra_config "cpus": CPU(s) {sorted(named - allowed)} are not among this process\'s '
                f"CPUs {sorted(allowed)}")
        return named
    return frozenset(allowed - model or allowed)


def pull_cpus(setting: str | frozenset[int], cpus: frozenset[int] | None) -> frozenset[int] | None:
    """The CPUs a load's pulls run on, given the connector's ``cpus`` (:func:`worker_cpus`).
    ``"auto"``: every CPU this process may use, the model's included: a pull's thread spends
    its time in the kernel receiving, while the model waits for its layers (an idle core),
    and the holder it pulls from may share the host. Measured here (2 vCPUs, the model bound
    to one, TCP loads of 16 and 64 MiB from a node on the same VM), three runs of TTFT
    against the pulls on the spare CPU only: 0.97x / 1.34x, 1.83x / 2.02x, 1.19x / 1.75x of
    ExampleConnector's. Same-host copies (memory-bound, and the model's core is the
    model's) stay on ``cpus``: there the spare CPU alone was better in two runs of three.
    Any other setting: ``cpus``."""
    if setting != "auto" or cpus is None or not hasattr(os, "sched_setaffinity"):
        return cpus
    return _allowed_cpus(cpus)


def _allowed_cpus(known: set[int] | frozenset[int]) -> frozenset[int]:
    """Every CPU this process may use (the kernel keeps those of its cpuset); ``known``: CPU
    ids to ask for at least."""
    model = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, range(max(os.cpu_count() or 1, max(set(model) | set(known)) + 1)))
        return frozenset(os.sched_getaffinity(0))
    except OSError:
        return frozenset(model)
    finally:
        os.sched_setaffinity(0, model)


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
    (:func:`worker_cpus`). Raises what :func:`kvpool.connect` raises (MasterUnreachableError,
    ConfigError)."""
    import kvpool

    with threads_on(cpus):
        pool = kvpool.connect(settings.master, config=settings.pool_config(), transport=settings.transport)
        # Now, not at the first save of a block above 1 MiB: starting UCX holds the GIL for
        # ~0.4 s, which stalled the model and a load in flight mid-request.
        pool.start_ucx()
    return pool


class KvpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over a kvpool cluster (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        check_model_kind(kv_cache_config)  # before anything is opened
        check_parallel(getattr(vllm_config, "parallel_config", None))
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = Settings.from_extra(self._kv_transfer_config.kv_connector_extra_config)
        self.block_size = vllm_config.cache_config.block_size
        # vLLM's hybrid allocator: block ids are numbered per group, and vLLM's scheduler takes a
        # failed load of such a model only as a failed request that waited outside the steps
        # (see get_transfer_results): every load of it is asynchronous.
        self._several_groups = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1
        if role == KVConnectorRole.SCHEDULER and self._several_groups and self.settings.load_async is False:
            log.warning('kvpool connector: "load_async": false is not kept for a model of several KV cache groups '
                        "(vLLM's hybrid allocator): its requests wait for their blocks outside the model's steps, "
                        "the only way vLLM recomputes a failed load of such a model")
        self.stats: dict[str, float] = {"lookups": 0, "blocks_hit": 0, "blocks_loaded": 0, "blocks_failed": 0,
                                        "blocks_saved": 0, "load_wait_s": 0.0, "load_total_s": 0.0,
                                        "plan_loaded_blocks": 0, "plan_recomputed_blocks": 0,
                                        "requests_skipped": 0}
        if role == KVConnectorRole.SCHEDULER:
            from kvpool.cluster.wire.master_client import MasterClient
            from kvpool.config import Config

            # A block kvpool cannot deliver intact is recomputed, not the request failed: vLLM's
            # scheduler reads this after it made the connector (``on_load_failure`` = "fail" keeps
            # vLLM's own default).
            self._kv_transfer_config.kv_load_failure_policy = self.settings.on_load_failure
            self.namespace = namespace_of(vllm_config)
            # Every rank's tag ([] for an engine of one rank): a block is held when each rank's
            # object of it is (see _lookup).
            self._rank_tags = rank_tags(vllm_config.parallel_config)
            self._master = MasterClient(self.settings.master, config=Config.load(self.settings.pool_config()))
            self._tracked: dict[str, _Tracked] = {}
            self._async_pending: list[Transfer] = []  # loads of requests that wait outside the steps
            self.planner = Planner()
            self._block_bytes = 0  # one block of one layer, as the workers report it
            self._layers_count = 0
            self._rounds = 0  # requests per load (layer groups), as the workers report it
            from kvpool.transport.engine import local_host_id

            self._host_id = local_host_id()
            self._worker_nodes: set[str] = set()  # this engine's workers' kvpool node ids, as they report them
        else:
            from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

            self.namespace = namespace_of(vllm_config)
            tag = rank_tag(vllm_config.parallel_config, get_tensor_model_parallel_rank(),
                           get_pp_group().rank_in_group)
            cpus = worker_cpus(self.settings.cpus)
            pool = open_pool(self.settings, cpus)
            self._init_worker(pool, cpus, tag)
            if not self.settings.config:
                arena = default_pool_config()["tiers"]["cxl"]["capacity"]
                log.info('kvpool connector: no "config": this worker\'s saves go to its shared-memory arena '
                         "(cxl tier, %d MiB, no dram tier), which the other engines on this host read in place",
                         arena >> 20)
            log.info("kvpool connector: worker threads on CPUs %s, a load's pulls on %s (the model's: %s)",
                     "as created" if cpus is None else sorted(cpus),
                     "as created" if self._pull_cpus is None else sorted(self._pull_cpus),
                     sorted(os.sched_getaffinity(0)))
        log.info("kvpool connector (%s, %s: %s) on master %s, namespace %s%s", role.name.lower(),
                 self._kv_transfer_config.kv_role,
                 "loads and saves" if self.loads_blocks and self.saves_blocks else
                 "saves, never loads" if self.saves_blocks else "loads, never saves",
                 self.settings.master, self.namespace,
                 "" if role == KVConnectorRole.SCHEDULER or self._rank_tag is None
                 else f", rank {self._rank_tag.decode()}")

    @property
    def loads_blocks(self) -> bool:
        """``kv_role`` is ``kv_consumer`` or ``kv_both``: the scheduler looks prompts up and
        the workers load blocks; a ``kv_producer`` engine does neither."""
        return bool(self._kv_transfer_config.is_kv_consumer)

    @property
    def saves_blocks(self) -> bool:
        """``kv_role`` is ``kv_producer`` or ``kv_both``: the blocks a step computes are
        saved; a ``kv_consumer`` engine schedules no save and its saver thread puts nothing."""
        return bool(self._kv_transfer_config.is_kv_producer)

    def _init_worker(self, pool: Any, cpus: frozenset[int] | None = None, tag: bytes | None = None) -> None:
        """The worker side's state around its kvpool client ``pool``; its threads run on
        ``cpus`` (:func:`worker_cpus`), a load's pulls on :func:`pull_cpus`; ``tag``: its
        parallel rank's (:func:`~kvpool.integrations.vllm_settings.rank_tag`; None: the engine's
        only rank), which its objects' keys are made of (:meth:`_object_keys`)."""
        self._rank_tag = tag
        for name in ("blocks_loaded", "blocks_failed", "blocks_saved", "load_wait_s", "load_total_s", "save_s"):
            self.stats.setdefault(name, 0)
        self._pool = pool
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

        self._loader = executor(1, "kvpool-load")
        usable = self._pull_cpus if self._pull_cpus is not None else \
            os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else range(os.cpu_count() or 1)
        self._pull_streams = max(1, min(_PULL_STREAMS, len(usable)))  # see _PULL_STREAMS
        self._streams = executor(max(1, self._pull_streams - 1), "kvpool-pull", self._pull_cpus)
        self._load_future: concurrent.futures.Future[None] | None = None
        # Asynchronous loads (``load_async``), on a thread of their own, until get_finished
        # reports them: (load, its future).
        self._async_loader = executor(1, "kvpool-load-async")
        self._async_loads: list[tuple[_LayerLoad, concurrent.futures.Future[None]]] = []
        # Reused by loads of several layers per pull, one per loader thread (the sync and the
        # asynchronous loader never share one).
        self._stagings: dict[int, np.ndarray] = {}
        self._stage: _Stage | None = None  # this step's blocks to save, as the layers come
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
        self._failed_blocks: set[int] = set()  # for get_block_ids_with_load_errors (one KV cache group)
        self._failed_requests: set[str] = set()  # for get_transfer_results (several groups)
        self._load_failures: dict[str, int] = {}  # for build_connector_worker_meta
        self._groups = 1  # KV cache groups (register_kv_caches)

    # -- scheduler side ---------------------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        tokens = request.prompt_token_ids or []
        tracked = self._tracked.get(request.request_id)
        if tracked is None:  # hashed once per request (a waiting request is asked again each step)
            keys = request_keys(request, self.block_size, self.namespace)
            if keys is None:  # extras kvpool cannot name for sure: neither looked up, loaded nor saved
                self.stats["requests_skipped"] += 1
                (log.info if self.stats["requests_skipped"] == 1 else log.debug)(
                    "kvpool: request %s is computed without kvpool (prompt embeddings, or LoRA, multimodal or "
                    "cache_salt extras it cannot read)", request.request_id)
                keys = []
            tracked = self._tracked[request.request_id] = _Tracked(keys)
        keys = tracked.keys
        # vLLM computes at least the last token; a block whose load failed, and those after it,
        # are computed (a request looked up again after a failed load loads only those before)
        loadable = min((len(tokens) - 1) // self.block_size, len(keys))
        if tracked.failed_from is not None:
            loadable = min(loadable, tracked.failed_from)
        first = num_computed_tokens // self.block_size
        tracked.saved_upto = tracked.first = first
        if loadable <= first or not self.loads_blocks:  # (a kv_producer: tracked for its saves only)
            return 0, False
        try:
            hits, near = self._lookup(keys[:loadable])
        except errors.KVPoolError as exc:  # no master: compute everything, as without a connector
            log.warning("kvpool lookup failed (%s): computing request %s", exc, request.request_id)
            return 0, False
        self.stats["lookups"] += 1
        if hits <= first:
            return 0, False
        held = hits - first
        self.stats["blocks_hit"] += held
        if self.settings.plan and self._block_bytes:
            block_bytes = self._block_bytes * self._layers_count
            rounds = self._rounds or self._layers_count
            transfer = self.planner.transfer_s(held, block_bytes, rounds)
            recompute = self.planner.recompute_s(held, self.block_size)
            if not self.planner.blocks_to_load(held, block_bytes, self.block_size, rounds):
                self.stats["plan_recomputed_blocks"] += held
                tracked.saved_upto = hits  # kvpool holds them already: recomputed, not saved again
                log.info("kvpool plan: request %s recomputes %d held blocks: %.2f ms beats loading them in "
                         "%.2f ms (alpha %.3f ms, beta %.2f GB/s, prefill %.0f tokens/s)", request.request_id,
                         held, (recompute or 0) * 1e3, transfer * 1e3, self.planner.alpha_s * 1e3,
                         self.planner.beta_bytes_per_s / 1e9, self.planner.prefill_tokens_per_s)
                return 0, False
            self.stats["plan_loaded_blocks"] += held
            if recompute is not None:  # a real comparison (the prefill rate is measured): say it
                log.info("kvpool plan: request %s loads %d held blocks: %.2f ms beats recomputing them in %.2f ms",
                         request.request_id, held, transfer * 1e3, recompute * 1e3)
        # "auto": loaded in its first step only when a worker reads the blocks without the network;
        # with several KV cache groups always outside the steps (see __init__)
        setting = self.settings.load_async
        tracked.load_async = self._several_groups or (bool(setting) if setting != "auto" else near != (True, True))
        log.debug("request %s: kvpool holds blocks %d..%d of %d (%s)", request.request_id, first, hits, len(keys),
                  "loaded outside the steps" if tracked.load_async else "loaded in its first step")
        return held * self.block_size, tracked.load_async

    def _lookup(self, keys: list[bytes]) -> tuple[int, tuple[bool, bool] | None]:
        """How many leading ``keys`` kvpool holds (one request to the master) and, for
        ``load_async = "auto"``, whether a worker reads the first and the last of them without
        the network: its own pool holds them (each worker reports its node id), or (``transport =
        "auto"``) a same-host node's cxl arena it copies them from in place (a 64 MiB load in
        ~14-25 ms, layer by layer under the forward pass). Other blocks are pulled (50-250 ms for
        64 MiB over TCP inside an engine here), and a step that waits for a pull stalls every
        request running in it: such a request waits outside the steps instead. Two blocks judge
        the whole prefix; a wrong guess costs time, never bytes.

        With several parallel ranks, a block is held when every rank's object of it is: each
        rank's key of each block is asked for, block by block, in the same one request (a rank
        that then misses its object at load time reports the block failed: vLLM recomputes it)."""
        tags = self._rank_tags
        if tags:
            keys = [object_key(key, tag) for key in keys for tag in tags]
        if self.settings.load_async != "auto":
            hits, near = self._master.lookup(keys), None
        else:
            hits, near = self._master.lookup_near(keys, self._worker_nodes,
                                                  self._host_id if self.settings.transport == "auto" else "")
        return (hits // len(tags) if tags else hits), near

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' measurements (:class:`KvpoolStats`) refine the planner; the blocks that
        failed to load (:class:`KvpoolWorkerMetadata`) are never loaded for their request again."""
        failures = getattr(getattr(connector_output, "kv_connector_worker_meta", None), "load_failures", None)
        for req_id, block in (failures or {}).items():
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                tracked.failed_from = block if tracked.failed_from is None else min(block, tracked.failed_from)
        stats = getattr(connector_output, "kv_connector_stats", None)
        data = getattr(stats, "data", None)
        if not isinstance(data, dict):
            return
        for nbytes, seconds in data.get("pulls", []):
            self.planner.observe_pull(nbytes, seconds)
        for tokens, seconds in data.get("prefill", []):
            self.planner.observe_prefill(tokens, seconds)
        self._block_bytes = int(data.get("block_bytes") or self._block_bytes)
        self._layers_count = int(data.get("layers") or self._layers_count)
        self._rounds = int(data.get("rounds") or self._rounds or self._layers_count)
        for node_id in data.get("node_ids", []):  # (one per worker)
            if isinstance(node_id, str) and node_id:
                self._worker_nodes.add(node_id)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpoolStats(data=dict(data or {}))

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        first, count = tracked.first, num_external_tokens // self.block_size
        # (a window group's blocks left behind, or not given at all: NULL_BLOCK, never written)
        groups = [list(ids[first:first + count]) for ids in blocks.get_block_ids()]
        groups = [ids + [NULL_BLOCK] * (count - len(ids)) for ids in groups]
        load = Transfer(request.request_id, tracked.keys[first:first + count], groups[0], tuple(groups[1:]), first)
        if tracked.load_async:  # the request waits outside the steps: loaded from this step on
            self._async_pending.append(load)
        else:  # loaded at the request's first step, which waits for it
            tracked.load = load
        tracked.saved_upto = first + count

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvpoolConnectorMetadata(num_tokens=scheduler_output.total_num_scheduled_tokens)
        meta.async_loads, self._async_pending = self._async_pending, []
        steps: list[tuple[str, int, Any, bool]] = []  # (request, computed tokens, new block ids per group, ...)
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, new.block_ids, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            steps.append((req_id, cached.num_computed_tokens[i], cached.new_block_ids[i],
                          req_id in cached.resumed_req_ids))
        for req_id, computed, block_ids, replace in steps:
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            if block_ids is not None:
                if replace or not tracked.block_ids:
                    tracked.block_ids = [[] for _ in block_ids]
                for mine, more in zip(tracked.block_ids, block_ids):
                    mine.extend(more or ())
            if tracked.load is not None:
                meta.loads.append(tracked.load)
                tracked.load = None
            if not self.saves_blocks:  # a kv_consumer
                continue
            # Blocks of the prompt that this step fills are saved as the layers produce them
            # (each in every group: in this step even a window group still has them).
            after = min(computed + scheduler_output.num_scheduled_tokens.get(req_id, 0),
                        len(tracked.keys) * self.block_size)
            full = min([after // self.block_size, *(len(ids) for ids in tracked.block_ids)]) \
                if tracked.block_ids else 0  # (no blocks given yet: nothing to save)
            if full > tracked.saved_upto:
                span = range(tracked.saved_upto, full)
                whole = [i for i in span if all(ids[i] != NULL_BLOCK for ids in tracked.block_ids)]
                if whole:
                    groups = [[ids[i] for i in whole] for ids in tracked.block_ids]
                    meta.saves.append(Transfer(req_id, [tracked.keys[i] for i in whole], groups[0],
                                               tuple(groups[1:])))
                tracked.saved_upto = full
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._tracked.pop(request.request_id, None)
        return False, None  # saves complete within the step that computed the blocks

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with vLLM's hybrid allocator (``SupportsHMA``)."""
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # -- worker side ------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._layers = list(kv_caches.values())
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}
        # Each layer's KV cache group (vLLM's hybrid allocator: a layer's blocks are its group's;
        # with it off, or a model of one kind of layer, every layer is in group 0).
        groups = getattr(getattr(self, "_kv_cache_config", None), "kv_cache_groups", None) or []
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
        # Layers per pull: one layer each gives the finest overlap, but every request costs a
        # fixed amount (see _PULL_TARGET_BYTES); "auto" makes each pull move >= 4 MiB of a
        # block, so blocks up to that size are fetched whole, larger ones a few layers at a time.
        auto = -(-_PULL_TARGET_BYTES // self._block_nbytes)
        self._layers_per_pull = max(1, min(self.settings.layers_per_pull or auto, len(self._layers)))
        elements = block.numel()
        kv_heads = self._vllm_config.model_config.get_num_kv_heads(self._vllm_config.parallel_config)
        if elements % (2 * self.block_size * kv_heads):
            kv_heads = 1
        self._shape = (1, 2, self.block_size, kv_heads, elements // (2 * self.block_size * kv_heads))
        log.info("kvpool connector: %d layers, blocks of %s %s stored as %s", len(self._layers),
                 tuple(block.shape), first.dtype, self._shape)
        # The loader threads' staging buffers for one request of the longest prompt, made and
        # faulted in now, off the first load's path (a first touch costs more than the copy:
        # 64 MiB of fresh huge pages took ~400 ms on a VM whose freed memory the host reclaims).
        longest = getattr(getattr(self._vllm_config, "model_config", None), "max_model_len", 0) or 0
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
        super().bind_connector_metadata(connector_metadata)
        self._step_started = time.perf_counter()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
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
        self._load_future = self._loader.submit(self._pull, load, keys)
        self._count("blocks_loaded", len(keys))

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

    def _pull(self, load: _LayerLoad, keys: list[bytes]) -> None:
        """The loader thread: blocks a same-host node holds in its shared-memory arena are
        copied from there straight into the paged cache (:meth:`_copy_in_place`); the others
        are pulled (:meth:`_pull_remote`, through a staging buffer: a load that timed out
        writes nothing into the cache later). Each layer is handed to the model
        (``load.done``) as soon as every block has it; the blocks (indices) that failed end
        in ``load.failed_rows``."""
        failed: set[int] = set()
        cpu = time.thread_time()
        try:
            rest = self._copy_in_place(load, keys, failed)
            if rest and not load.timed_out:
                with threads_on(self._pull_cpus):  # (this thread, while it pulls)
                    self._pull_remote(load, [keys[i] for i in rest], rest, failed)
        finally:
            load.failed_rows = failed
            load.finished_s = time.perf_counter() - load.started
            load.loader_cpu_s = time.thread_time() - cpu
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
        block's header as it is made (one ``copy_layer_out`` per layer for every block); the
        indices of the blocks left to pull: not found, or a copy failed its checksum (all of
        that block's layers are then pulled again, so it is whole or reported failed). Hands
        each layer to the model as it lands when nothing is left to pull."""
        everything = list(range(len(keys)))
        arenas = getattr(getattr(getattr(self._pool, "cluster", None), "reader", None), "arenas", None)
        if not self._on_host or self.settings.transport != "auto" or arenas is None:
            return everything
        started = time.perf_counter()
        found = arenas.find_many(keys)
        here = [i for i, hit in enumerate(found) if hit is not None]
        if not here:
            return everything
        fits = [i for i in here if found[i][2].spec.layers == len(self._layers)
                and found[i][2].spec.layer_nbytes == self._block_nbytes]
        bad: set[int] = set(here) - set(fits)
        if bad:
            log.warning("kvpool: %d same-host blocks have another shape than this cache's (%s): pulled instead",
                        len(bad), found[min(bad)][2].spec)
        rest = sorted(set(everything) - set(fits) | bad)
        for layer, cache in enumerate(self._byte_layers):
            with load.lock:
                if load.timed_out:  # the model went on: vLLM recomputes into these blocks
                    break
                ids = load.groups[self._layer_group[layer]]  # (a window group's block left behind: none)
                live = [i for i in fits if i not in bad and ids[i] != NULL_BLOCK]
                by_reader: dict[Any, list[int]] = {}
                for i in live:
                    by_reader.setdefault(found[i][0], []).append(i)
                for reader, items in by_reader.items():
                    try:
                        ok = reader.copy_layer_out(layer, [found[i][1:] for i in items],
                                                   [cache[ids[i]] for i in items])
                    except (errors.KVPoolError, OSError) as exc:  # the arena went away: pull these
                        log.info("kvpool: same-host arena copy failed (%s): pulling %d blocks", exc, len(items))
                        ok = [False] * len(items)
                    bad.update(i for i, good in zip(items, ok) if not good)
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
        still arriving. A round trip per group would cost a pipeline start and drain each (16
        blocks over TCP: 4 rounds of 2 layers took twice one get_many of all 8). Blocks that
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
                got = self._pool.get_many(
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
        wherever it lives, in one call: a numpy scatter on the host (~4x faster than torch's
        ``index_copy_`` there), ``index_copy_`` on a device. A block that is vLLM's null block
        (a window group's block left behind) is skipped: that layer of it is not kept."""
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
                 "from a same-host arena; %d layers per pull; pulls %.2f ms, copies into the cache %.2f ms, the loader "
                 "thread's CPU time %.2f ms, started %.2f ms after the step)",
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
        if self._role == KVConnectorRole.SCHEDULER or not self._load_failures:
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
        if self._role == KVConnectorRole.SCHEDULER or not self._async_loads:
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
        if self._role == KVConnectorRole.SCHEDULER:
            return None
        with self._count_lock:
            report, self._report = self._report, {}
        if not report:
            return None
        # One round: every layer group of a load is asked for at once (see _pull_remote).
        return KvpoolStats(data={**report, "block_bytes": self._block_nbytes, "layers": len(self._layers),
                                 "rounds": 1, "node_ids": [getattr(self._pool, "node_id", "")]})

    def _count(self, name: str, n: float) -> None:
        """A worker counter: in this process's stats and in the next report to the scheduler
        (the saver thread counts too)."""
        with self._count_lock:
            self.stats[name] = self.stats.get(name, 0) + n
            self._report[name] = self._report.get(name, 0) + n

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvpoolConnectorMetadata)
        layer = self._layer_index.get(layer_name)
        if layer is None or not meta.saves or not self.saves_blocks:  # (a kv_consumer's scheduler sends none)
            return
        stage = self._stage
        if stage is None:
            # The step's blocks to save, each key once (two requests may fill the same block),
            # staged as one array: object i is stage.objects[i], [layers, ...], contiguous.
            chosen: dict[bytes, tuple[int, ...]] = {}
            for transfer in meta.saves:
                for i, key in enumerate(transfer.keys):
                    chosen.setdefault(key, tuple(transfer.ids(g)[i] for g in range(self._groups)))
            stage = self._stage = _Stage(
                self._object_keys(chosen), [torch.tensor([ids[g] for ids in chosen.values()], dtype=torch.long)
                               for g in range(self._groups)],
                np.empty((len(chosen), len(self._layers), *self._shape[1:]), self._np_dtype))
        # One gather of the layer's blocks (no per-block Python), then one strided copy.
        ids = stage.block_ids[self._layer_group[layer]]
        blocks = self._layers[layer].index_select(0, ids.to(self._layers[layer].device)).cpu()
        if blocks.dtype == torch.bfloat16:
            blocks = blocks.view(torch.int16)
        stage.objects[:, layer] = blocks.numpy().view(self._np_dtype).reshape(len(stage.keys), *self._shape[1:])

    def wait_for_save(self) -> None:
        waited = self._load.waited_s if self._load is not None else self._last_waited
        if self._load is not None:  # a step whose model never waited for the last layer
            self._finish_load()
        meta = self._connector_metadata
        if isinstance(meta, KvpoolConnectorMetadata) and meta.num_tokens >= self.block_size and self._step_started:
            seconds = time.perf_counter() - self._step_started - waited  # computing, not waiting for loads
            self._report.setdefault("prefill", []).append([meta.num_tokens, seconds])
        self._step_started, self._last_waited = 0.0, 0.0
        stage, self._stage = self._stage, None
        if stage is not None:  # stored off the model's path: the next step does not wait for it
            self._saves.append(self._saver.submit(self._save, stage))
            self._saves = [f for f in self._saves if not f.done()]

    def _save(self, stage: _Stage) -> None:
        """Put one step's blocks (the saver thread) in ``put_many`` batches of about
        ``_SAVE_BATCH_BYTES``, durable by the one rule of :func:`kvpool.client.durable_copies`
        (the ``durable`` / ``replicas`` settings, else the pool config's ``node.durable`` /
        ``node.replicas``): one placement and one replicate exchange per storage node for each
        batch. Loads come first: before each batch the saver waits, up to ``_SAVE_YIELD_S``,
        while a load is in flight (the saver and the loader share the cores the model leaves)."""
        started = time.perf_counter()
        per_batch = max(1, _SAVE_BATCH_BYTES // max(1, stage.objects[0].nbytes))
        for at in range(0, len(stage.keys), per_batch):
            self._loads_idle.wait(_SAVE_YIELD_S)
            keys = stage.keys[at:at + per_batch]
            try:
                self._pool.put_many(zip(keys, stage.objects[at:at + per_batch]), dtype=self._dtype_name,
                                    durable=self.settings.durable, replicas=self.settings.replicas)
                self._count("blocks_saved", len(keys))
            except errors.KVPoolError as exc:  # a save that fails is a future miss, never an engine error
                log.warning("kvpool: saving %d blocks failed: %s", len(keys), exc)
        self._count("save_s", time.perf_counter() - started)

    def wait_saved(self, timeout_s: float | None = None) -> None:
        """Until every save handed to the saver thread so far has finished (tests, shutdown)."""
        concurrent.futures.wait(self._saves, timeout_s)
        self._saves = [f for f in self._saves if not f.done()]

    def shutdown(self) -> None:
        if self._role == KVConnectorRole.SCHEDULER:
            self._master.close()
        else:
            if self._load_future is not None:
                concurrent.futures.wait([self._load_future], self.settings.load_timeout_s)
            concurrent.futures.wait([f for _, f in self._async_loads], self.settings.load_timeout_s)
            self._loader.shutdown(wait=False)
            self._async_loader.shutdown(wait=False)
            self._streams.shutdown(wait=False)
            self._saver.shutdown(wait=True)  # saves in flight finish first
            log.info("kvpool saves: %d blocks saved in %.3f s on the saver thread", self.stats["blocks_saved"],
                     self.stats["save_s"])
            self._pool.close()
