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
see :meth:`~kvpool.integrations.vllm_scheduler.KvpoolScheduler._lookup`), ``cpus``
(where the worker's kvpool threads run, :func:`worker_cpus`: ``"auto"``, ``"inherit"`` or a
list of CPU ids), ``model_id`` (names the model's weights in the namespace instead of
their content fingerprint, :func:`~kvpool.integrations.vllm_settings.model_fingerprint`),
``save_async`` (false: a step's saves are published before its output leaves the engine;
true: after, on a saver thread, below).

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
blocks are pulled over the network),
:meth:`~kvpool.integrations.vllm_scheduler.KvpoolScheduler.get_num_new_matched_tokens` tells vLLM to keep
the request waiting (``WAITING_FOR_REMOTE_KVS``) while a thread of its own
loads the blocks, and :meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.get_finished` hands the request back when
they are in (failed blocks reported in the same pass): no forward pass waits for a load,
other requests' steps go on, but the request's own forward pass starts only after its
load (``docs/vllm.md`` compares the two). For the others (by default blocks in a
same-host arena or the worker's own pool),
:meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.start_load_kv` hands the step's loads to a long-lived loader
thread, which asks for every block in one pipelined ``get_many`` per stream (one
``locate`` for all the step's blocks at most, then the location cache), ``layers_per_pull``
layers of a block per pull, layer group by layer group, into one reused staging buffer;
when every block has a group, one scatter per layer moves it into the paged cache and
:meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.wait_for_layer_load` lets the model go on with those layers while
later ones are still in flight. Every pull costs a fixed amount of CPU on both sides, so
``"auto"`` (the default) makes each move at least 4 MiB of a block: blocks up to that
size go whole, one pull each. :meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.save_kv_layer` gathers
each layer's newly full blocks as the forward pass produces them;
:meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.wait_for_save` puts the step's objects
(one ``put_many``: one master round trip, and when durable one placement and one replicate
exchange per storage node) on the model's thread by default (``save_async`` false): the
step's output (a first token, an answer) leaves the engine only once its prompt's full
blocks are published, so a request sent the moment an answer arrived, to any engine,
finds them. A producer's answer also names them in its ``kv_transfer_params``
(``{"kvpool": {"blocks": n, "last": key}}``, which vLLM echoes); a consumer given them
waits, at most ``load_timeout_s``, until that many are found, instead of recomputing them
(the P/D proxy :mod:`kvpool.integrations.vllm_proxy` passes them on). ``save_async``
true: the step does not wait (a request sent at once may recompute them). Blocks a request
loaded, blocks vLLM had itself and held blocks the planner recomputes are not saved
again. A block that cannot be loaded whole (a miss, a checksum failure, a dead holder,
the deadline) is reported to vLLM, which recomputes it: kvpool never hands the model
bytes it did not verify. (With several KV cache groups, vLLM takes that report only as a
failed request that waited outside the steps: such a model's loads all do, see
:meth:`~kvpool.integrations.vllm_worker.KvpoolWorker.get_transfer_results`.) A model whose KV cache is not made of
full-attention layers, with or without sliding-window groups beside them, is refused at start
(:func:`check_model_kind`). Where a load's time goes: ``docs/vllm.md``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

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
from kvpool.integrations.vllm_messages import (
    NULL_BLOCK,
    KvpoolConnectorMetadata,
    KvpoolStats,
    KvpoolWorkerMetadata,
    Transfer,
)
from kvpool.integrations.vllm_scheduler import KvpoolScheduler
from kvpool.integrations.vllm_settings import (
    Settings,
    check_parallel,
    model_fingerprint,
    namespace_of,
    object_key,
    rank_tag,
    rank_tags,
    request_keys,
)
from kvpool.integrations.vllm_worker import KvpoolWorker, open_pool, pull_cpus, threads_on, worker_cpus

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("vllm.kvpool")  # under vLLM's logger: its handlers and levels apply

__all__ = ["NULL_BLOCK", "KvpoolConnector", "KvpoolConnectorMetadata", "KvpoolScheduler", "KvpoolStats",
           "KvpoolWorker", "KvpoolWorkerMetadata", "Settings", "Transfer", "check_model_kind", "check_parallel",
           "model_fingerprint", "namespace_of", "object_key", "open_pool", "pull_cpus", "rank_tag", "rank_tags",
           "request_keys", "threads_on", "worker_cpus"]


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



class KvpoolConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM v1 KV connector over a kvpool cluster (see the module docstring). vLLM makes one in
    its scheduler process and one in each worker; each is the thin front of one half:
    :attr:`scheduler` (:class:`~kvpool.integrations.vllm_scheduler.KvpoolScheduler`) or
    :attr:`worker` (:class:`~kvpool.integrations.vllm_worker.KvpoolWorker`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        check_model_kind(kv_cache_config)  # before anything is opened
        check_parallel(getattr(vllm_config, "parallel_config", None))
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = self._kv_transfer_config
        self.settings = settings = Settings.from_extra(config.kv_connector_extra_config)
        loads, saves = bool(config.is_kv_consumer), bool(config.is_kv_producer)
        self._scheduler: KvpoolScheduler | None = None
        self._worker: KvpoolWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            # A block kvpool cannot deliver intact is recomputed, not the request failed: vLLM's
            # scheduler reads this after it made the connector (``on_load_failure`` = "fail" keeps
            # vLLM's own default).
            config.kv_load_failure_policy = settings.on_load_failure
            # vLLM's hybrid allocator: block ids are numbered per group, and vLLM's scheduler takes a
            # failed load of such a model only as a failed request that waited outside the steps
            # (see KvpoolWorker.get_transfer_results): every load of it is asynchronous.
            several = len(getattr(kv_cache_config, "kv_cache_groups", None) or ()) > 1
            self._scheduler = KvpoolScheduler.open(vllm_config, settings, loads=loads, saves=saves,
                                                   several_groups=several)
        else:
            self._worker = KvpoolWorker.open(vllm_config, settings, loads=loads, saves=saves,
                                             kv_cache_config=kv_cache_config)
        log.info("kvpool connector (%s, %s: %s) on master %s", role.name.lower(), config.kv_role,
                 "loads and saves" if loads and saves else "saves, never loads" if saves else "loads, never saves",
                 settings.master or "the leader in etcd")

    @property
    def scheduler(self) -> KvpoolScheduler:
        """The scheduler half (only in vLLM's scheduler process)."""
        assert self._scheduler is not None, "the kvpool connector's scheduler half runs in the scheduler process"
        return self._scheduler

    @property
    def worker(self) -> KvpoolWorker:
        """The worker half (only in a worker process)."""
        assert self._worker is not None, "the kvpool connector's worker half runs in a worker process"
        return self._worker

    # -- scheduler side: KvpoolScheduler ------------------------------------------------

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """:meth:`request_finished` with vLLM's hybrid allocator (``SupportsHMA``)."""
        return self.scheduler.request_finished(request, block_ids[0] if block_ids else [])

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvpoolStats(data=dict(data or {}))

    # -- worker side: KvpoolWorker ------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self.worker.bind_connector_metadata(connector_metadata)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        if self._worker is not None:
            self._worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self.worker.start_load_kv()

    def wait_for_layer_load(self, layer_name: str) -> None:
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        self.worker.save_kv_layer(layer_name)

    def wait_for_save(self) -> None:
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker.get_finished(finished_req_ids) if self._worker is not None else (None, None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self.worker.get_transfer_results(finished_req_ids)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.get_block_ids_with_load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.build_connector_worker_meta() if self._worker is not None else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        return self._worker.get_kv_connector_stats() if self._worker is not None else None

    def shutdown(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()
