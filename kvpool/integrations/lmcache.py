"""kvpool below an LMCache server: :class:`KvpoolL2Adapter`, an LMCache L2 adapter.

LMCache's server (``lmcache server``, which vLLM reaches through ``LMCacheMPConnector``) keeps
chunks in its own memory (L1) and hands them to its L2 adapters to keep beyond it. It loads
this one by module path (``pip install 'kvpool[lmcache]'``)::

    lmcache server --host localhost --port 6555 --chunk-size 256 --l1-size-gb 4 \\
        --eviction-policy LRU --supported-transfer-mode auto \\
        --l2-adapter '{"type": "plugin", "module_path": "kvpool.integrations.lmcache",
                       "class_name": "KvpoolL2Adapter", "config_class_name": "KvpoolL2AdapterConfig",
                       "adapter_params": {"master": "tcp://127.0.0.1:7700", "durable": true}}'

``adapter_params`` (:class:`KvpoolL2AdapterConfig`; a bad or unknown one is one ConfigError
naming it when the server starts): ``master`` (a kvpool master; absent: the server's own
embedded pool), ``config`` (a kvpool TOML path or a mapping, for the server's pool),
``durable`` / ``replicas`` (default: the config's ``node.durable`` / ``node.replicas``),
``transport``, ``num_workers`` (threads doing kvpool calls, default 2). What is stored stays on
the server's own kvpool node unless it is durable: only durable copies (on kvpool storage
nodes) outlive the server, so a server that must find its chunks after a restart sets
``"durable": true``. Servers on other hosts read each other's chunks through the master either way.

What a chunk becomes. Each LMCache object (one chunk of one rank's KV, ``MemoryObj``) is one
kvpool object: its bytes as they are, in the object's dtype where it has one kvpool knows
(else bytes), shaped ``[rows, 2, 1, 1, n]`` only so that kvpool checks them in rows. Its key
is ``xxh3_128`` of everything LMCache's ``ObjectKey`` names: the model, the rank
(``kv_rank``: world size, rank, local world size, local rank), the object group, the cache
salt and the chunk's hash; two deployments whose keys differ in any of these never read each
other's chunks. Exact bytes or a miss: a load lands only when the object's checksums, its key,
its dtype and its size all agree with the buffer LMCache gives; otherwise that chunk is a miss
(0 in LMCache's bitmap) and LMCache recomputes or reads it elsewhere.

How calls run. Every ``submit_*`` queues its task on a small thread pool (``num_workers``) and
returns its id at once; a task is one batched kvpool call (a lookup one ``exists_many``, a
load one ``get_many`` into LMCache's buffers in place, a store one ``exists_many`` and one
``put_many`` of the chunks kvpool lacks), and its end is signalled on the operation's eventfd,
which LMCache's controllers poll. A kvpool error (master away, a node gone, a full pool) is
logged and answered as a failed store or as misses, never raised into LMCache's threads.

Not provided: locks (``submit_unlock`` does nothing; a chunk evicted between lookup and load
is a load miss), deletes (kvpool evicts on its own; objects are shared by every server with
the same keys), capacity-driven eviction by LMCache (no capacity is declared), key listing.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface
from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from kvpool import errors
from kvpool.integrations.engine_pool import POOL_KEYS, EnginePool
from kvpool.objformat import dtype_info, storage_dtype

if TYPE_CHECKING:
    from kvpool.api import PoolAPI

log = logging.getLogger("kvpool.integrations.lmcache")

__all__ = ["KvpoolL2Adapter", "KvpoolL2AdapterConfig", "object_key"]

_KEYS = POOL_KEYS | {"num_workers"}
_KEY_SEED = 0x6B76706F6F6C4C4D  # xxh3's seed of chunk keys ("kvpoolLM")
_KEY_VERSION = b"lmcache-l2-v1"
_MAX_ROWS = 64  # rows an object is split into for its checksums (a power of two)


class KvpoolL2AdapterConfig(L2AdapterConfigBase):
    """``adapter_params`` of the ``--l2-adapter`` plugin spec, checked once when the server starts.

    LMCache builds it with :meth:`from_dict` (``config_class_name``); a bad or unknown key raises
    ConfigError (a ValueError) naming it."""

    def __init__(self, master: str | None = None, config: str | Mapping[str, Any] | None = None,
                 durable: bool | None = None, replicas: int | None = None, transport: str = "auto",
                 num_workers: int = 2) -> None:
        self.master = master  # None: the server's own embedded pool
        self.config = config  # a kvpool TOML path, or its settings as a mapping
        self.durable = durable  # None: the pool config's node.durable
        self.replicas = replicas  # None: the pool config's node.replicas
        self.transport = transport
        self.num_workers = num_workers  # threads doing kvpool calls

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KvpoolL2AdapterConfig:
        """Raises ConfigError naming the first bad or unknown key."""
        params = dict(d or {})
        params.pop("type", None)  # LMCache's own key, when it passes the whole spec
        unknown = sorted(set(params) - _KEYS)
        if unknown:
            raise errors.ConfigError(f"kvpool L2 adapter_params: unknown setting(s) {unknown}; "
                                     f"kvpool's are {sorted(_KEYS)}")
        pool = EnginePool.from_settings(params)
        workers = params.get("num_workers", 2)
        if isinstance(workers, bool) or not isinstance(workers, int) or not 1 <= workers <= 64:
            raise errors.ConfigError(f'"num_workers" must be an int from 1 to 64, got {workers!r}')
        return cls(pool.master, pool.config, pool.durable, pool.replicas, pool.transport, workers)

    @classmethod
    def help(cls) -> str:
        return ("kvpool L2 adapter (adapter_params):\n"
                '- master (str): a kvpool master, "tcp://HOST:PORT" (absent: the server\'s own embedded pool)\n'
                "- config (str or dict): a kvpool TOML path or its settings, for the server's pool\n"
                "- durable (bool): keep copies on kvpool storage nodes, which outlive the server "
                "(default: the config's node.durable)\n"
                "- replicas (int >= 1): durable copies (default: the config's node.replicas)\n"
                '- transport ("auto" or "tcp"): how pulls travel\n'
                "- num_workers (int, 1-64): threads doing kvpool calls (default 2)")

    def open_pool(self) -> PoolAPI:
        """The server's pool: connected to ``master`` (without ``config``, every chunk in a
        shared-memory arena that other processes on the host read in place, as the vLLM
        connector's default: no dram tier), or embedded. Raises what
        :func:`kvpool.connect` / :class:`kvpool.Pool` raise (MasterUnreachableError, ConfigError)."""
        return EnginePool(self.master, self.config, self.durable, self.replicas, self.transport).open(start_ucx=True)


def object_key(key: Any) -> bytes:
    """kvpool's key of LMCache's ``ObjectKey`` ``key``: a hash of every field it has, each
    length-prefixed so that no two keys run together."""
    fields = [_KEY_VERSION, key.model_name.encode(), int(key.kv_rank).to_bytes(8, "little", signed=True),
              int(key.object_group_id).to_bytes(8, "little"), key.cache_salt.encode(), bytes(key.chunk_hash)]
    return xxhash.xxh3_128_digest(b"".join(len(f).to_bytes(4, "little") + f for f in fields), seed=_KEY_SEED)


@dataclass(frozen=True)
class _Chunk:
    """One LMCache object's bytes as the kvpool array they are stored as (a view, no copy)."""

    dtype: str  # kvpool's name of the object's dtype ("uint8" when it has none or several)
    array: np.ndarray  # [rows, 2, 1, 1, n] over the object's memory

    @classmethod
    def of(cls, memory_obj: Any) -> _Chunk:
        """The chunk over ``memory_obj``'s memory; InvalidKVError when its size cannot be rows of pairs."""
        meta = memory_obj.metadata
        dtypes = list(meta.dtypes) if meta.dtypes else [meta.dtype]
        names = {_dtype_name(d) for d in dtypes}
        only = names.pop() if len(names) == 1 else None
        dtype = only if only is not None else "uint8"
        raw = np.frombuffer(memory_obj.byte_array, dtype=np.uint8)
        itemsize = storage_dtype(dtype).itemsize
        if raw.size % (2 * itemsize):
            if dtype == "uint8" or raw.size % 2:
                raise errors.InvalidKVError(f"an LMCache object of {raw.size} B cannot be stored as pairs of rows")
            dtype, itemsize = "uint8", 1
        pairs = raw.size // (2 * itemsize)
        rows = _MAX_ROWS
        while pairs % rows:
            rows //= 2
        return cls(dtype, raw.view(storage_dtype(dtype)).reshape(rows, 2, 1, 1, pairs // rows))


def _dtype_name(dtype: Any) -> str | None:
    """kvpool's name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``), or None."""
    if dtype is None:
        return None
    try:
        return dtype_info(str(dtype).removeprefix("torch.")).name
    except errors.KVPoolError:
        return None


class KvpoolL2Adapter(L2AdapterInterface):
    """LMCache's ``L2AdapterInterface`` over a kvpool pool; see the module's doc.

    LMCache's plugin loader makes it with ``cls(config, l1_memory_desc=...)``; the pool is
    opened here (MasterUnreachableError or ConfigError fails the server's start). Thread-safe:
    LMCache's store and prefetch controllers call it from their own threads."""

    config_class_name = "KvpoolL2AdapterConfig"  # found by LMCache's plugin loader without the spec naming it

    def __init__(self, config: KvpoolL2AdapterConfig | Mapping[str, Any], l1_memory_desc: Any = None) -> None:
        super().__init__()
        if not isinstance(config, KvpoolL2AdapterConfig):
            config = KvpoolL2AdapterConfig.from_dict(dict(config))
        self.config = config
        self._put_options: dict[str, Any] = {}
        if config.master is not None:
            self._put_options = {"durable": config.durable, "replicas": config.replicas}
        self.pool = config.open_pool()
        self._workers = concurrent.futures.ThreadPoolExecutor(config.num_workers, thread_name_prefix="kvpool-l2")
        # distinct eventfds (LMCache's controllers map each fd to one adapter and operation)
        flags = os.EFD_NONBLOCK | os.EFD_CLOEXEC
        self._store_fd, self._lookup_fd, self._load_fd = (os.eventfd(0, flags) for _ in range(3))
        self._lock = threading.Lock()
        self._next_task_id = 0
        self._stored: dict[int, L2StoreResult] = {}
        self._looked_up: dict[int, Any] = {}  # task id -> Bitmap
        self._loaded: dict[int, Any] = {}  # task id -> Bitmap
        self._closed = False
        log.info("kvpool L2 adapter: %s pool, %d workers", f"master {config.master}" if config.master else "embedded",
                 config.num_workers)

    # -- event fds ------------------------------------------------------------------------------

    def get_store_event_fd(self) -> int:
        return self._store_fd

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._lookup_fd

    def get_load_event_fd(self) -> int:
        return self._load_fd

    # -- tasks ------------------------------------------------------------------------------------

    def _submit(self, work: Callable[[], Any], results: dict[int, Any], failed: Callable[[], Any], fd: int) -> int:
        """Queue ``work`` on the pool; its result (``failed()``'s if it raises) lands in
        ``results`` under the returned task id, and ``fd`` is signalled."""
        with self._lock:
            if self._closed:
                raise errors.PoolClosedError("kvpool L2 adapter is closed")
            task_id = self._next_task_id
            self._next_task_id += 1

        def run() -> None:
            try:
                result = work()
            except Exception:  # a task must always end, or LMCache's controller waits for it forever
                log.exception("kvpool L2 adapter: task %d failed", task_id)
                result = failed()
            with self._lock:
                results[task_id] = result
                if self._closed:
                    return
                os.eventfd_write(fd, 1)

        self._workers.submit(run)
        return task_id

    def submit_store_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Store each (key, object); the task fails as a whole if any chunk is not stored."""
        return self._submit(lambda: self._store(keys, objects), self._stored, lambda: L2StoreResult(False, 0),
                            self._store_fd)

    def pop_completed_store_tasks(self) -> dict[int, L2StoreResult]:
        with self._lock:  # (the dict stays: tasks in flight hold it)
            done = dict(self._stored)
            self._stored.clear()
        return done

    def submit_lookup_and_lock_task(self, keys: list[Any], group_layout_descs: Any = None) -> int:
        """Which keys kvpool holds (one ``exists_many``); nothing is locked."""
        return self._submit(lambda: self._lookup(keys), self._looked_up, lambda: Bitmap(len(keys)), self._lookup_fd)

    def query_lookup_and_lock_result(self, task_id: int) -> Any:
        with self._lock:
            return self._looked_up.pop(task_id, None)

    def submit_unlock(self, keys: list[Any]) -> None:
        """Nothing to release: lookups lock nothing (a chunk gone by its load is a miss then)."""

    def submit_load_task(self, keys: list[Any], objects: list[Any]) -> int:
        """Read each key's chunk into its object's memory (in place); 1 in the task's bitmap
        for each chunk read exact, 0 for a miss or a chunk that failed any check."""
        return self._submit(lambda: self._load(keys, objects), self._loaded, lambda: Bitmap(len(keys)),
                            self._load_fd)

    def query_load_result(self, task_id: int) -> Any:
        with self._lock:
            return self._loaded.pop(task_id, None)

    # -- the work, on the thread pool --------------------------------------------------------------

    def _store(self, keys: Sequence[Any], objects: Sequence[Any]) -> L2StoreResult:
        pool_keys = [object_key(k) for k in keys]
        try:
            present = self.pool.exists_many(pool_keys)
        except errors.KVPoolError as exc:
            log.warning("kvpool L2 adapter: exists check of %d chunks failed (%s); not stored", len(keys), exc)
            return L2StoreResult(False, 0)
        by_dtype: dict[str, list[tuple[bytes, np.ndarray]]] = {}
        stored_keys: list[Any] = []
        sizes: list[int] = []
        ok = True
        for key, pool_key, memory_obj, there in zip(keys, pool_keys, objects, present):
            if there:  # another server (or this one, before) stored it: same key, same bytes
                continue
            try:
                chunk = _Chunk.of(memory_obj)
            except errors.KVPoolError as exc:
                log.warning("kvpool L2 adapter: chunk not stored (%s)", exc)
                ok = False
                continue
            by_dtype.setdefault(chunk.dtype, []).append((pool_key, chunk.array))
            stored_keys.append(key)
            sizes.append(chunk.array.nbytes)
        for dtype, items in by_dtype.items():
            try:
                self.pool.put_many(items, dtype=dtype, **self._put_options)
            except errors.KVPoolError as exc:
                log.warning("kvpool L2 adapter: put of %d chunks failed (%s)", len(items), exc)
                return L2StoreResult(False, 0)
        if stored_keys:
            self._notify_keys_stored(stored_keys, sizes)
        return L2StoreResult(ok, sum(sizes))

    def _lookup(self, keys: Sequence[Any]) -> Any:
        found = Bitmap(len(keys))
        if not keys:
            return found
        try:
            present = self.pool.exists_many([object_key(k) for k in keys])
        except errors.KVPoolError as exc:
            log.warning("kvpool L2 adapter: lookup of %d chunks failed (%s); counted as misses", len(keys), exc)
            return found
        for i, there in enumerate(present):
            if there:
                found.set(i)
        return found

    def _load(self, keys: Sequence[Any], objects: Sequence[Any]) -> Any:
        loaded = Bitmap(len(keys))
        pool_keys: list[bytes] = []
        outs: list[np.ndarray] = []
        slots: list[int] = []  # the task's index of each get
        for i, (key, memory_obj) in enumerate(zip(keys, objects)):
            try:
                chunk = _Chunk.of(memory_obj)
            except errors.KVPoolError as exc:
                log.warning("kvpool L2 adapter: chunk not loaded (%s)", exc)
                continue
            pool_keys.append(object_key(key))
            outs.append(chunk.array)
            slots.append(i)
        if not pool_keys:
            return loaded
        try:
            got = self.pool.get_many(pool_keys, outs=outs)
        except errors.OutBufferError:
            # one stored object is not what its buffer holds (another dtype or size): every
            # chunk alone, so that only that one is a miss
            got = [self._load_one(k, out) for k, out in zip(pool_keys, outs)]
        except errors.KVPoolError as exc:
            log.warning("kvpool L2 adapter: load of %d chunks failed (%s); counted as misses", len(keys), exc)
            return loaded
        hits = [slot for slot, array in zip(slots, got) if array is not None]
        for slot in hits:
            loaded.set(slot)
        if hits:
            self._notify_keys_accessed([keys[slot] for slot in hits])
        return loaded

    def _load_one(self, pool_key: bytes, out: np.ndarray) -> np.ndarray | None:
        try:
            return self.pool.get_many([pool_key], outs=[out])[0]
        except errors.KVPoolError as exc:
            log.warning("kvpool L2 adapter: chunk %s is a miss (%s)", pool_key.hex(), exc)
            return None

    # -- the rest of LMCache's interface ------------------------------------------------------------

    def report_status(self) -> dict[str, Any]:
        with self._lock:
            closed = self._closed
        return {"is_healthy": not closed, "type": "KvpoolL2Adapter", "master": self.config.master,
                "durable": self.config.durable, "num_workers": self.config.num_workers}

    def close(self) -> None:
        """Finish the tasks already queued, then close the pool and the event fds (idempotent)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._workers.shutdown(wait=True, cancel_futures=True)
        self.pool.close()
        for fd in (self._store_fd, self._lookup_fd, self._load_fd):
            os.close(fd)
        log.info("kvpool L2 adapter closed")
