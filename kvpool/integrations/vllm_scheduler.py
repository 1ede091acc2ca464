"""The scheduler half of kvpool's vLLM connector (it runs in vLLM's EngineCore process): which
blocks of a new request kvpool holds (one batched ``lookup`` per request: one master round
trip), which of them to load (the :class:`~kvpool.integrations.planner.Planner`: loading must
beat recomputing), and each step's plan for the workers (:class:`KvpoolConnectorMetadata`):
blocks to load in the step, blocks to load outside the steps (``load_async``), blocks the step
fills, to save. ``docs/vllm.md`` describes the whole connector."""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvpool import errors
from kvpool.hashing import prefix_hashes
from kvpool.integrations.planner import Planner
from kvpool.integrations.vllm_messages import NULL_BLOCK, KvpoolConnectorMetadata, Transfer
from kvpool.integrations.vllm_settings import (
    Settings,
    namespace_of,
    object_key,
    plain_request,
    rank_tags,
    request_keys,
    tail_keys,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

    from kvpool.cluster.wire.master_client import MasterClient

__all__ = ["LOOKUP_TIMEOUT_S", "PARAMS_KEY", "KvpoolScheduler", "MasterWatch", "answers_saved"]

log = logging.getLogger("vllm.kvpool")  # under vLLM's logger: its handlers and levels apply

#: kvpool's entry in a request's ``kv_transfer_params``: {"blocks": n, "last": key of block n - 1, hex}
PARAMS_KEY = "kvpool"
# A request waiting for a producer's blocks is looked up again at most this often (vLLM asks at
# every scheduler step).
_WAIT_LOOKUP_EVERY_S = 0.005
# The scheduler's lookups wait at most this long for the master: every request of the engine
# waits while one is asked (the scheduler is one thread), and a healthy answer takes a millisecond.
LOOKUP_TIMEOUT_S = 1.0
# Once a lookup found the master away, a thread asks it this often until it answers; meanwhile
# requests are computed without asking.
_PROBE_EVERY_S = 0.5


def answers_saved(vllm_config: Any) -> bool:
    """Whether an engine of ``vllm_config`` may save its answers' blocks (``save_answers``):
    not with speculative decoding, whose drafter (EAGLE's layers share the engine's KV cache)
    may write a position's KV after the step in which the verified model filled its block, as
    vLLM's own offloading connector also holds such a block back."""
    return getattr(vllm_config, "speculative_config", None) is None


class MasterWatch:
    """Whether the master answers, for a thread that must not wait for one that does not:
    after a failure (:meth:`failed`) :attr:`away` is true and a thread of its own pings the
    master (``ping``, each with a client of its own) every ``every_s`` until it answers.
    ``ping(timeout_s)``: one round trip, raising KVPoolError when it goes unanswered."""

    def __init__(self, ping: Callable[[float], object], every_s: float = _PROBE_EVERY_S) -> None:
        self._ping = ping
        self.every_s = every_s
        self.away = False
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def failed(self) -> None:
        with self._lock:
            if self.away or self._stop.is_set():
                return
            self.away = True
        threading.Thread(target=self._probe, name="kvpool-master-probe", daemon=True).start()

    def _probe(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                self._ping(self.every_s)
            except errors.KVPoolError:
                continue
            log.info("kvpool: the master answers again: requests are looked up again")
            break
        with self._lock:
            self.away = False

    def close(self) -> None:
        self._stop.set()


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
    expected: int = 0            # blocks a producer said it published (kv_transfer_params): waited for
    waiting_since: float = 0.0   # when it began waiting for them (monotonic)
    looked_at: float = 0.0       # its last lookup while waiting (monotonic)
    tokens: list[int] | None = None  # its prompt, when it is plain (its partial blocks are saved and found)
    tail: tuple[int, bytes] | None = None  # a tail it loads: (its tokens, its key), the load's last block
    tail_saved: bool = False     # its own prompt's tail is saved (or was loaded whole)
    prompt_blocks: int = 0       # full blocks of its prompt (``keys`` grows past them as it answers)
    request: Any = None          # vLLM's Request, while its answer's blocks are saved (``save_answers``)


class KvpoolScheduler:
    """The connector's scheduler half: vLLM's scheduler-side calls, on a kvpool master.

    ``settings``: the connector's (:class:`~kvpool.integrations.vllm_settings.Settings`);
    ``master``: a :class:`~kvpool.cluster.wire.master_client.MasterClient` it looks blocks up
    on (closed by :meth:`shutdown`); ``block_size``: vLLM's; ``namespace``: the engine's
    (:func:`~kvpool.integrations.vllm_settings.namespace_of`); ``loads`` / ``saves``: what
    its ``kv_role`` lets it do (a ``kv_producer`` never looks up, a ``kv_consumer`` never
    saves); ``rank_tags``: every parallel rank's tag ([] for an engine of one rank: a block is
    held when each rank's object of it is, see :meth:`_lookup`); ``several_groups``: the model
    has several KV cache groups (vLLM's hybrid allocator: every load waits outside the
    steps); ``host_id``: this host's (:func:`kvpool.transport.engine.local_host_id`), for
    ``load_async = "auto"``. The constructor does no I/O: :meth:`open` builds one from vLLM's
    configuration."""

    def __init__(self, settings: Settings, master: MasterClient, *, block_size: int, namespace: str,
                 loads: bool = True, saves: bool = True, rank_tags: list[bytes] | None = None,
                 several_groups: bool = False, host_id: str = "") -> None:
        self.settings = settings
        self.master = master
        self.block_size = block_size
        self.namespace = namespace
        self.loads_blocks, self.saves_blocks = loads, saves
        self.rank_tags = rank_tags or []
        self.several_groups = several_groups
        self.host_id = host_id
        self.stats: dict[str, float] = {"lookups": 0, "blocks_hit": 0, "plan_loaded_blocks": 0,
                                        "plan_recomputed_blocks": 0, "requests_skipped": 0, "lookups_skipped": 0,
                                        "producer_waits": 0, "producer_wait_s": 0.0, "tails_hit": 0,
                                        "answer_blocks": 0}
        self.tracked: dict[str, _Tracked] = {}
        self.async_pending: list[Transfer] = []  # loads of requests that wait outside the steps
        self.planner = Planner()
        self.block_bytes = 0  # one block of one layer, as the workers report it
        self.layers_count = 0
        self.rounds = 0  # requests per load (layer groups), as the workers report it
        self.worker_nodes: set[str] = set()  # this engine's workers' kvpool node ids, as they report them
        self.tails_saved = False  # the workers can save tails (they say so with their stats)
        self.master_watch = MasterWatch(self._ping)
        if several_groups and settings.load_async is False:
            log.warning('kvpool connector: "load_async": false is not kept for a model of several KV cache groups '
                        "(vLLM's hybrid allocator): its requests wait for their blocks outside the model's steps, "
                        "the only way vLLM recomputes a failed load of such a model")

    @property
    def partial_blocks(self) -> bool:
        """Whether a load may end inside a block (the ``partial_blocks`` setting; never with
        several KV cache groups, whose sliding windows expect block boundaries)."""
        return self.settings.partial_blocks and not self.several_groups

    @classmethod
    def open(cls, vllm_config: VllmConfig, settings: Settings, *, loads: bool, saves: bool,
             several_groups: bool) -> KvpoolScheduler:
        """The scheduler half of an engine of ``vllm_config``, with its own MasterClient."""
        from kvpool.cluster.wire.master_client import MasterClient
        from kvpool.config import Config
        from kvpool.transport.engine import local_host_id

        if settings.save_answers and not answers_saved(vllm_config):
            log.info("kvpool connector: speculative decoding: only prompt blocks are saved (a drafter's KV of an "
                     "answer's last tokens may still be rewritten after the step that fills their block)")
            settings = dataclasses.replace(settings, save_answers=False)
        master = MasterClient(settings.master, config=Config.load(settings.pool_config()),
                              request_timeout_s=LOOKUP_TIMEOUT_S)
        return cls(settings, master, block_size=vllm_config.cache_config.block_size,
                   namespace=namespace_of(vllm_config), loads=loads, saves=saves,
                   rank_tags=rank_tags(vllm_config.parallel_config), several_groups=several_groups,
                   host_id=local_host_id())

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """How many tokens beyond ``num_computed_tokens`` kvpool loads for ``request``, and
        whether it waits for them outside the model's steps. None: not known yet (a request
        whose ``kv_transfer_params`` name blocks a producer published, while fewer are found:
        vLLM asks again at a later step, for at most ``load_timeout_s``)."""
        tokens = request.prompt_token_ids or []
        tracked = self.tracked.get(request.request_id)
        if tracked is None:  # hashed once per request (a waiting request is asked again each step)
            keys = request_keys(request, self.block_size, self.namespace)
            if keys is None:  # extras kvpool cannot name for sure: neither looked up, loaded nor saved
                self.stats["requests_skipped"] += 1
                (log.info if self.stats["requests_skipped"] == 1 else log.debug)(
                    "kvpool: request %s is computed without kvpool (prompt embeddings, or LoRA, multimodal or "
                    "cache_salt extras it cannot read)", request.request_id)
                keys = []
            tracked = self.tracked[request.request_id] = _Tracked(keys, prompt_blocks=len(keys))
            tracked.expected = self._expected(request, keys)
            plain = plain_request(request)
            if keys and self.partial_blocks and plain:
                tracked.tokens = tokens if isinstance(tokens, list) else list(tokens)
            if plain and self.saves_blocks and self.settings.save_answers:
                tracked.request = request
        keys = tracked.keys[:tracked.prompt_blocks]
        # Every full block of the prompt may load: one that ends at the prompt's end loads all but
        # its last token, which vLLM computes (it samples the next token from it; a P/D consumer
        # of a prompt of whole blocks computes one token, not a block). With several KV cache
        # groups loads end on a block boundary, as vLLM's sliding-window groups expect. A block
        # whose load failed, and those after it, are computed (a request looked up again after a
        # failed load loads only those before).
        loadable = min((len(tokens) - (not self.partial_blocks)) // self.block_size, len(keys))
        if tracked.failed_from is not None:
            loadable = min(loadable, tracked.failed_from)
        first = num_computed_tokens // self.block_size
        tracked.saved_upto = tracked.first = first
        tracked.tail = None
        # (a kv_producer: tracked for its saves only; with every whole block vLLM's own, a plain
        # prompt may still find the tail of the next one)
        if loadable < first or not self.loads_blocks or (loadable == first and (tracked.tokens is None or not first)):
            return 0, False
        now = time.monotonic()
        if tracked.expected and now - tracked.looked_at < _WAIT_LOOKUP_EVERY_S:
            return None, False  # (vLLM asks every step: one lookup per few ms is plenty)
        tracked.looked_at = now
        if self.master_watch.away:  # computed as without a connector until the master answers again
            self.stats["lookups_skipped"] += 1
            return 0, False
        hits, near = first, None  # (no whole block to look up beyond vLLM's own: only a tail)
        try:
            if loadable > first:
                hits, near = self._lookup(keys[:loadable])
        except errors.KVPoolError as exc:  # no master: compute everything, as without a connector
            log.warning("kvpool lookup failed (%s): computing request %s, and the requests after it without "
                        "asking until the master answers again", exc, request.request_id)
            if isinstance(exc, errors.MasterUnreachableError):
                self.master_watch.failed()
            return 0, False
        self.stats["lookups"] += 1
        if tracked.expected:
            if hits < min(tracked.expected, loadable):
                tracked.waiting_since = tracked.waiting_since or now
                if now - tracked.waiting_since < self.settings.load_timeout_s:
                    return None, False
                log.warning("kvpool: request %s: %d of the %d blocks its producer published were found within "
                            "%.1f s; the rest are computed", request.request_id, hits,
                            min(tracked.expected, loadable), self.settings.load_timeout_s)
            elif tracked.waiting_since:
                self.stats["producer_waits"] += 1
                self.stats["producer_wait_s"] += now - tracked.waiting_since
                log.info("kvpool: request %s waited %.1f ms for the blocks its producer published",
                         request.request_id, (now - tracked.waiting_since) * 1e3)
            tracked.expected = 0
        # Where the held blocks (kvpool's or vLLM's own) end inside the prompt, the longest saved
        # tail of the next block: one more master round trip, only for a prompt that continues a
        # known prefix of at least a block.
        end = max(hits, first)
        if tracked.tokens is not None and 1 <= end < len(tokens) / self.block_size \
                and (tracked.failed_from is None or tracked.failed_from > end):
            tracked.tail = self._find_tail(tracked, end)
        if hits <= first and tracked.tail is None:
            return 0, False
        held = end - first + (tracked.tail is not None)
        self.stats["blocks_hit"] += held
        if self.settings.plan and self.block_bytes:
            block_bytes = self.block_bytes * self.layers_count
            rounds = self.rounds or self.layers_count
            transfer = self.planner.transfer_s(held, block_bytes, rounds)
            recompute = self.planner.recompute_s(held, self.block_size)
            if not self.planner.blocks_to_load(held, block_bytes, self.block_size, rounds):
                self.stats["plan_recomputed_blocks"] += held
                tracked.saved_upto = end  # kvpool holds them already: recomputed, not saved again
                tracked.tail = None
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
        tracked.load_async = self.several_groups or (bool(setting) if setting != "auto" else near != (True, True))
        log.debug("request %s: kvpool holds blocks %d..%d of %d (%s)", request.request_id, first, hits, len(keys),
                  "loaded outside the steps" if tracked.load_async else "loaded in its first step")
        loaded = end * self.block_size + (tracked.tail[0] if tracked.tail is not None else 0)
        return min(loaded, len(tokens) - 1) - first * self.block_size, tracked.load_async

    def _find_tail(self, tracked: _Tracked, block: int) -> tuple[int, bytes] | None:
        """The longest tail of the request's block ``block`` that kvpool holds (every rank's
        object of it), as (its tokens, its key), if it gives the request a token more: a tail
        is a block saved for its first tokens (a prompt that ended inside it, see
        :meth:`build_connector_meta`), so a prompt that extends that prompt (the next turn of a
        conversation), or repeats it (a P/D consumer), loads up to where it ended. One
        ``exists_many`` of every length the request's tokens allow; a failure is no tail."""
        tokens = tracked.tokens
        assert tokens is not None
        lengths = range(1, min(self.block_size, len(tokens) - block * self.block_size + 1))
        if len(tokens) - 1 <= block * self.block_size or not lengths:
            return None
        keys = tail_keys(tokens, tracked.keys, self.block_size, self.namespace, block, lengths)
        tags = self.rank_tags
        try:
            found = self.master.exists_many([object_key(k, t) for k in keys for t in tags] if tags else keys)
        except errors.KVPoolError as exc:
            log.debug("kvpool: looking for a tail failed (%s): none loaded", exc)
            return None
        per = len(tags) or 1
        for at in range(len(keys) - 1, -1, -1):
            if all(found[at * per:(at + 1) * per]):
                self.stats["tails_hit"] += 1
                return lengths[at], keys[at]
        return None

    def _lookup(self, keys: list[bytes]) -> tuple[int, tuple[bool, bool] | None]:
        """How many leading ``keys`` kvpool holds (one request to the master) and, for
        ``load_async = "auto"``, whether a worker reads the first and the last of them without
        the network: its own pool holds them (each worker reports its node id), or (``transport =
        "auto"``) a same-host node's cxl arena it copies them from in place (a memory copy,
        layer by layer under the forward pass). Other blocks are pulled over the network, which
        takes several times as long and varies with the holder and the link, and a step that
        waits for a pull stalls every request running in it: such a request waits outside the
        steps instead. (Measurements: docs/benchmarks.md.) Two blocks judge the whole prefix; a
        wrong guess costs time, never bytes.

        With several parallel ranks, a block is held when every rank's object of it is: each
        rank's key of each block is asked for, block by block, in the same one request (a rank
        that then misses its object at load time reports the block failed: vLLM recomputes it)."""
        tags = self.rank_tags
        if tags:
            keys = [object_key(key, tag) for key in keys for tag in tags]
        if self.settings.load_async != "auto":
            hits, near = self.master.lookup(keys), None
        else:
            hits, near = self.master.lookup_near(keys, self.worker_nodes,
                                                 self.host_id if self.settings.transport == "auto" else "")
        return (hits // len(tags) if tags else hits), near

    def update_connector_output(self, connector_output: Any) -> None:
        """The workers' measurements (:class:`KvpoolStats`) refine the planner; the blocks that
        failed to load (:class:`KvpoolWorkerMetadata`) are never loaded for their request again."""
        failures = getattr(getattr(connector_output, "kv_connector_worker_meta", None), "load_failures", None)
        for req_id, block in (failures or {}).items():
            tracked = self.tracked.get(req_id)
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
        self.block_bytes = int(data.get("block_bytes") or self.block_bytes)
        self.tails_saved = bool(data.get("tails", self.tails_saved))
        self.layers_count = int(data.get("layers") or self.layers_count)
        self.rounds = int(data.get("rounds") or self.rounds or self.layers_count)
        for node_id in data.get("node_ids", []):  # (one per worker)
            if isinstance(node_id, str) and node_id:
                self.worker_nodes.add(node_id)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self.tracked.get(request.request_id)
        if tracked is None or num_external_tokens <= 0:
            return
        first, count = tracked.first, -(-num_external_tokens // self.block_size)  # (the last may end short)
        # (a window group's blocks left behind, or not given at all: NULL_BLOCK, never written)
        groups = [list(ids[first:first + count]) for ids in blocks.get_block_ids()]
        groups = [ids + [NULL_BLOCK] * (count - len(ids)) for ids in groups]
        full = count - (tracked.tail is not None)  # (a tail is the load's last block: its own key)
        keys = tracked.keys[first:first + full] + ([tracked.tail[1]] if tracked.tail is not None else [])
        load = Transfer(request.request_id, keys, groups[0], tuple(groups[1:]), first)
        if tracked.load_async:  # the request waits outside the steps: loaded from this step on
            self.async_pending.append(load)
        else:  # loaded at the request's first step, which waits for it
            tracked.load = load
        tracked.saved_upto = first + full  # (a tail's block, once the prompt fills it, is saved whole)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KvpoolConnectorMetadata(num_tokens=scheduler_output.total_num_scheduled_tokens)
        meta.async_loads, self.async_pending = self.async_pending, []
        steps: list[tuple[str, int, Any, bool]] = []  # (request, computed tokens, new block ids per group, ...)
        for new in scheduler_output.scheduled_new_reqs:
            steps.append((new.req_id, new.num_computed_tokens, new.block_ids, True))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            steps.append((req_id, cached.num_computed_tokens[i], cached.new_block_ids[i],
                          req_id in cached.resumed_req_ids))
        for req_id, computed, block_ids, replace in steps:
            tracked = self.tracked.get(req_id)
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
            # Blocks of the prompt, and of its answer so far, that this step fills are saved as
            # the layers produce them (each in every group: in this step even a window group
            # still has them).
            scheduled = computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            if tracked.request is not None and scheduled >= (len(tracked.keys) + 1) * self.block_size:
                self._answer_keys(tracked, scheduled)
            after = min(scheduled, len(tracked.keys) * self.block_size)
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
            # A prompt that ends inside a block: that block is saved too, as a tail (the step
            # that computes the prompt's last token), where the workers can zero its other slots.
            tokens = tracked.tokens
            if tokens is not None and not tracked.tail_saved and self.tails_saved \
                    and computed + scheduler_output.num_scheduled_tokens.get(req_id, 0) >= len(tokens):
                tracked.tail_saved = True
                at, count = divmod(len(tokens), self.block_size)
                loaded_whole = tracked.tail is not None and tracked.tail[0] == count  # (held already)
                if count and not loaded_whole and at == len(tracked.keys) and tracked.block_ids \
                        and len(tracked.block_ids[0]) > at:
                    [key] = tail_keys(tokens, tracked.keys, self.block_size, self.namespace, at,
                                      range(count, count + 1))
                    meta.saves.append(Transfer(req_id, [key], [tracked.block_ids[0][at]], tail_tokens=count))
        return meta

    def _answer_keys(self, tracked: _Tracked, scheduled: int) -> None:
        """Extend a plain request's keys over the full blocks of its answer that this step
        completes (``scheduled``: the tokens whose KV exists after the step). Only tokens vLLM
        has already appended count: a speculative step's draft tokens, which a verification
        may reject, sit past them, and the blocks holding them wait for a later step."""
        tokens = tracked.request.all_token_ids
        whole = min(scheduled, len(tokens)) // self.block_size
        if whole <= len(tracked.keys):
            return
        # (the chain over the whole sequence: equal to the prompt's keys, then the answer's)
        keys = prefix_hashes(list(tokens[:whole * self.block_size]), self.block_size, namespace=self.namespace)
        if keys[:len(tracked.keys)] != tracked.keys:  # (cannot differ for a plain request: stop saving)
            tracked.request = None
            return
        self.stats["answer_blocks"] += len(keys) - len(tracked.keys)
        tracked.keys.extend(keys[len(tracked.keys):])

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Forget the request; its blocks are free at once (False): the workers published every
        block it saved inside the step that computed it (``save_async`` false) or hand them to
        their saver thread with copies of their own. An engine that saves answers, in
        ``kv_transfer_params`` (vLLM echoes them in the response; a P/D proxy hands them to the
        consumer, :mod:`kvpool.integrations.vllm_proxy`), how many of the prompt's leading
        blocks kvpool has now and the key of the last: a consumer given them waits for that
        many (:meth:`get_num_new_matched_tokens`) instead of recomputing what is still being
        published."""
        tracked = self.tracked.pop(request.request_id, None)
        if tracked is None or not self.saves_blocks or not tracked.saved_upto or not tracked.prompt_blocks:
            return False, None
        held = min(tracked.saved_upto, tracked.prompt_blocks)  # (a consumer's keys are its prompt's)
        return False, {PARAMS_KEY: {"blocks": held, "last": tracked.keys[held - 1].hex()}}

    def _expected(self, request: Request, keys: list[bytes]) -> int:
        """How many leading blocks of ``request`` its ``kv_transfer_params`` say a producer
        published (:meth:`request_finished`), when they name this engine's own key of the last
        of them (else a producer of another model, layout or namespace: 0, nothing waited for)."""
        params = getattr(request, "kv_transfer_params", None)
        ours = params.get(PARAMS_KEY) if isinstance(params, dict) else None
        if not isinstance(ours, dict) or not self.loads_blocks:
            return 0
        blocks, last = ours.get("blocks"), ours.get("last")
        if isinstance(blocks, bool) or not isinstance(blocks, int) or not 0 < blocks <= len(keys) \
                or not isinstance(last, str) or keys[blocks - 1].hex() != last:
            log.warning("kvpool: request %s names %r blocks from a producer this engine does not share keys with "
                        "(another model, block size, layout or namespace): nothing is waited for",
                        request.request_id, blocks)
            return 0
        return blocks


    def _ping(self, timeout_s: float) -> None:
        """One round trip to the master on a client of its own (the probe's thread)."""
        from kvpool.cluster.wire.master_client import MasterClient
        from kvpool.config import Config

        with MasterClient(self.settings.master, config=Config.load(self.settings.pool_config()),
                          request_timeout_s=timeout_s) as client:
            client.ping(timeout_s=timeout_s)

    def shutdown(self) -> None:
        self.master_watch.close()
        self.master.close()
