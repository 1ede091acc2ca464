"""kvpool as SGLang HiCache's L3 storage: :class:`KvpoolHiCacheStorage`.

SGLang loads it by module path (``pip install 'kvpool[sglang]'``)::

    --enable-hierarchical-cache --hicache-mem-layout page_first
    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
    '{"backend_name": "kvpool", "module_path": "kvpool.integrations.sglang",
      "class_name": "KvpoolHiCacheStorage", "interface_v1": 1, "master": "tcp://127.0.0.1:7700"}'

Settings, beside SGLang's own four keys (:class:`HiCacheSettings`): ``master`` (a kvpool
master; absent: this process's own embedded pool, one rank only), ``config`` (a kvpool TOML
path or a mapping, for this process's pool), ``durable`` / ``replicas`` (default: the config's
``node.durable`` / ``node.replicas``), ``transport``. A bad one is one ConfigError naming it
when SGLang attaches the backend.

What a page becomes. SGLang's host pool describes each page as pieces
(``get_page_buffer_meta``), and each piece is a kvpool object:

* page-first layouts (``page_first``, ``page_first_direct``, and ``page_head`` for MHA): an
  MHA page is two pieces, its K and its V, so two objects (as SGLang's Mooncake backend
  stores them), an MLA page one. Both directions are zero-copy: ``put_many`` reads the
  host pool's bytes in place and ``get_many`` writes into the host pool (``out=``);
* ``layer_first``: a page's pieces are one per layer (K and V apart for MHA) and not
  adjacent, so the page is one object whose rows are its pieces in SGLang's order. A get
  still lands in place (one ``get_many`` entry per piece); a put gathers the page first
  (one copy).

An object is ``[rows, 2, 1, 1, n]`` of the pool's dtype: the piece's bytes as they are,
split into rows only for kvpool's per-row checksums (a page-first piece into its layer
count of equal rows). A page is a hit when all its objects are.

Keys: ``xxh3_128(namespace || SGLang's page key || piece)``, where the namespace names the
model (SGLang's ``model_name``), MHA or MLA, the layout, the page size, the dtype, the
geometry of a page and the ranks whose pages differ: an MHA page per TP, PP and attention-CP
rank, an MLA page per PP and CP rank only (every TP rank holds the same MLA KV, so they share
it, and only SGLang's storage writer, TP rank 0, writes it; other ranks' sets write nothing,
as SGLang's own controller skips their backups). DP replicas share pages. Two deployments that
differ in any of these never read each other's pages.

Each call is one batched kvpool call (at most 128 pages, SGLang's batch): ``batch_exists``
one ``lookup``, ``batch_get_v1`` one ``get_many``, ``batch_set_v1`` one ``exists_many`` (pages
already stored are skipped, as Mooncake's backend does) and one ``put_many`` of the rest.
Exact bytes or a miss: every object is checked against its checksums and its key, and a page
whose object misses, fails its checksums or cannot be read is False in the answer, so SGLang
loads no page after it (its bytes in the host pool are never handed on). A kvpool error
during a call (master away, a node gone) is logged and answered as misses / failed writes,
never raised into SGLang's I/O threads.

Not served (ConfigError when SGLang attaches): SGLang's legacy (non-``interface_v1``) calls,
other host layouts (``page_unified``, ``page_first_kv_split``), hybrid pools registered
through ``register_mem_host_pool_v2`` (Mamba, SWA, DSA indexer), heterogeneous-TP head
splitting (``tp_lcm_size``) and decode context parallelism.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvpool import errors
from kvpool.integrations.engine_pool import POOL_KEYS, EnginePool
from kvpool.objformat import LayerRange, dtype_info, storage_dtype

if TYPE_CHECKING:
    from kvpool.api import PoolAPI

log = logging.getLogger("kvpool.integrations.sglang")

__all__ = ["HiCacheSettings", "KvpoolHiCacheStorage", "PageLayout", "namespace_of"]

# The extra-config keys SGLang's dynamic loader itself reads.
_SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1"})
_OUR_KEYS = POOL_KEYS
# Host layouts whose pages are contiguous pieces (one object each); layer_first pages are
# gathered from one piece per layer (one object a page).
_PAGE_FIRST = {"mha": ("page_first", "page_first_direct", "page_head"), "mla": ("page_first", "page_first_direct")}
_LAYER_FIRST = "layer_first"
_KEY_SEED = 0x6B76706F6F6C5347  # xxh3's seed of page keys ("kvpoolSG")


@dataclass(frozen=True)
class HiCacheSettings:
    """kvpool's keys of ``--hicache-storage-backend-extra-config``, checked once at attach."""

    master: str | None = None  # None: this process's own embedded pool (one rank only)
    config: str | Mapping[str, Any] | None = None  # a kvpool TOML path, or its settings as a mapping
    durable: bool | None = None  # None: the pool config's node.durable
    replicas: int | None = None  # None: the pool config's node.replicas
    transport: str = "auto"

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> HiCacheSettings:
        """Raises ConfigError naming the first bad or unknown key."""
        extra = dict(extra or {})
        unknown = sorted(set(extra) - _SGLANG_KEYS - _OUR_KEYS)
        if unknown:
            raise errors.ConfigError(f"hicache-storage-backend-extra-config: unknown setting(s) {unknown}; "
                                     f"kvpool's are {sorted(_OUR_KEYS)}")
        if not extra.get("interface_v1"):
            raise errors.ConfigError('hicache-storage-backend-extra-config needs "interface_v1": 1 (kvpool serves '
                                     "SGLang's zero-copy batch_get_v1 / batch_set_v1 only)")
        pool = EnginePool.from_settings(extra)
        return cls(pool.master, pool.config, pool.durable, pool.replicas, pool.transport)

    def open_pool(self) -> PoolAPI:
        """This process's pool: connected to ``master`` (without ``config``, every page in a
        shared-memory arena that other processes on the host read in place, as the vLLM
        connector's default: no dram tier), or embedded. Raises what
        :func:`kvpool.connect` / :class:`kvpool.Pool` raise (MasterUnreachableError, ConfigError).
        UCX starts now, while SGLang starts: started at the first page above 1 MiB, it would
        hold the GIL (~0.4 s here) in the scheduler's process mid-request."""
        return EnginePool(self.master, self.config, self.durable, self.replicas,
                          self.transport).open(start_ucx=True)


@dataclass(frozen=True)
class PageLayout:
    """How the pages of one SGLang host pool map to kvpool objects (see the module's doc)."""

    layout: str
    page_size: int
    dtype: str  # kvpool's name of the pool's dtype
    pieces: int  # pieces a page has (get_page_buffer_meta's entries per page)
    piece_nbytes: tuple[int, ...]  # each piece's size
    objects: int  # objects a page is: ``pieces`` (page-first) or 1 (layer_first)
    object_shape: tuple[int, ...]  # each object's array shape (all a page's objects have one shape)

    @property
    def gathered(self) -> bool:
        """True when a page is one object of its pieces (layer_first)."""
        return self.objects == 1 and self.pieces > 1

    @classmethod
    def of(cls, host_pool: Any, kind: str) -> PageLayout:
        """The pages of ``host_pool`` (an SGLang HostKVCache); ConfigError for what is not served."""
        layout = str(getattr(host_pool, "layout", ""))
        served = (*_PAGE_FIRST[kind], _LAYER_FIRST)
        if layout not in served:
            raise errors.ConfigError(f"kvpool HiCache storage: host pool layout {layout!r} is not supported for "
                                     f"{kind.upper()} (served: {', '.join(served)}); set --hicache-mem-layout")
        if getattr(host_pool, "kv_buffer", None) is None:
            raise errors.ConfigError(f"kvpool HiCache storage: {type(host_pool).__name__} has no KV buffer of its own "
                                     "(a logical or hybrid pool); not supported")
        dtype = _dtype_name(host_pool.dtype)
        page_size = int(host_pool.page_size)
        import torch

        ptrs, sizes = host_pool.get_page_buffer_meta(torch.arange(page_size, dtype=torch.int64))
        if not sizes or len(ptrs) != len(sizes) or any(isinstance(p, Sequence) for p in ptrs):
            raise errors.ConfigError(f"kvpool HiCache storage: {type(host_pool).__name__} ({layout}) describes a page "
                                     "as nested buffers; not supported")
        itemsize = storage_dtype(dtype).itemsize
        pieces, piece_nbytes = len(sizes), tuple(int(s) for s in sizes)
        if any(n % (2 * itemsize) for n in piece_nbytes):
            raise errors.ConfigError(f"kvpool HiCache storage: a page piece of {piece_nbytes} bytes is not an even "
                                     f"number of {dtype} elements; kvpool cannot store it as [rows, 2, ...]")
        if layout == _LAYER_FIRST:
            if len(set(piece_nbytes)) != 1:
                raise errors.ConfigError(f"kvpool HiCache storage: layer_first pieces of unequal sizes {piece_nbytes}")
            return cls(layout, page_size, dtype, pieces, piece_nbytes, 1,
                       (pieces, 2, 1, 1, piece_nbytes[0] // (2 * itemsize)))
        if pieces not in (1, 2) or len(set(piece_nbytes)) != 1:
            raise errors.ConfigError(f"kvpool HiCache storage: a {layout} page of {pieces} pieces {piece_nbytes} "
                                     "(expected its K and V, or one MLA piece)")
        elements = piece_nbytes[0] // itemsize
        layers = int(getattr(host_pool, "layer_num", 1) or 1)
        rows = layers if elements % (2 * layers) == 0 else 1
        return cls(layout, page_size, dtype, pieces, piece_nbytes, pieces, (rows, 2, 1, 1, elements // (2 * rows)))

    def describe(self) -> str:
        return (f"{self.layout} pages of {self.page_size} tokens, {self.dtype}, {self.pieces} piece(s) of "
                f"{self.piece_nbytes[0]} B, {self.objects} object(s) {self.object_shape} a page")


def _dtype_name(dtype: Any) -> str:
    """kvpool's name of a torch dtype (``torch.bfloat16`` -> ``bfloat16``); ConfigError if none."""
    name = str(dtype).removeprefix("torch.")
    try:
        return dtype_info(name).name
    except errors.KVPoolError:
        raise errors.ConfigError(f"kvpool HiCache storage: KV dtype {dtype} has no kvpool type") from None


def namespace_of(storage_config: Any, kind: str, pages: PageLayout, host_pool: Any) -> str:
    """What must agree for two SGLang ranks to read each other's pages (see the module's doc)."""
    model = storage_config.model_name
    if not model:
        raise errors.ConfigError("kvpool HiCache storage: SGLang gave no model_name; pages must name their model")
    ranks = [f"pp{storage_config.pp_rank}/{storage_config.pp_size}",
             f"cp{storage_config.attn_cp_rank}/{storage_config.attn_cp_size}"]
    if kind == "mha":
        ranks.insert(0, f"tp{storage_config.tp_rank}/{storage_config.tp_size}")
    geometry = [f"layers{getattr(host_pool, 'start_layer', 0)}-{getattr(host_pool, 'end_layer', 0)}"
                f"x{getattr(host_pool, 'layer_num', 0)}"]
    if kind == "mha":
        geometry.append(f"heads{getattr(host_pool, 'head_num', 0)}x{getattr(host_pool, 'head_dim', 0)}")
    else:
        geometry.append(f"kvdim{getattr(host_pool, 'kv_cache_dim', 0)}")
    geometry.append("pieces" + ",".join(str(n) for n in pages.piece_nbytes))
    return "|".join(["sglang-hicache-v1", f"model:{model}", kind, pages.layout, f"page{pages.page_size}",
                     pages.dtype, *geometry, *ranks])


class KvpoolHiCacheStorage(HiCacheStorage):
    """SGLang's ``HiCacheStorage`` (interface v1) over a kvpool pool; see the module's doc.

    SGLang makes it with ``cls(storage_config, kwargs)`` and then hands it the host pool with
    :meth:`register_mem_pool_host`; the pool is opened in ``__init__`` (MasterUnreachableError
    there fails SGLang's attach), the pages are checked when the host pool arrives
    (ConfigError for a layout or pool not served)."""

    def __init__(self, storage_config: Any, kwargs: Mapping[str, Any] | None = None) -> None:
        self.storage_config = storage_config
        self.settings = HiCacheSettings.from_extra(storage_config.extra_config)
        self.kind = "mla" if storage_config.is_mla_model else "mha"
        if getattr(storage_config, "should_split_heads", False):
            raise errors.ConfigError("kvpool HiCache storage: heterogeneous TP head splitting (tp_lcm_size) "
                                     "is not supported")
        if int(getattr(storage_config, "dcp_size", 1) or 1) > 1:
            raise errors.ConfigError("kvpool HiCache storage: decode context parallelism is not supported")
        ranks = storage_config.tp_size * storage_config.pp_size * storage_config.attn_cp_size
        if self.settings.master is None and ranks > 1:
            raise errors.ConfigError(f'kvpool HiCache storage: {ranks} ranks share pages only through a kvpool '
                                     'master; give "master"')
        # MLA KV is the same on every TP rank: one writer (SGLang's rule), the others read.
        writer = getattr(storage_config, "is_storage_writer", None)
        self.writer = bool(writer) if writer is not None else (self.kind == "mha" or storage_config.tp_rank == 0)
        self.pages: PageLayout | None = None
        self.namespace = ""
        self._key_prefix = b""
        self._arena = np.empty(0, np.uint8)  # the host pool's KV buffer as bytes, set at registration
        self._arena_base = 0
        self._put_options: dict[str, Any] = {}
        if self.settings.master is not None:
            self._put_options = {"durable": self.settings.durable, "replicas": self.settings.replicas}
        self.pool = self.settings.open_pool()

    # -- attach ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Map the host pool's pages to kvpool objects; ConfigError for what is not served."""
        import torch

        pages = PageLayout.of(mem_pool_host, self.kind)
        buffer = mem_pool_host.kv_buffer
        if buffer.device.type != "cpu" or not buffer.is_contiguous():
            raise errors.ConfigError(f"kvpool HiCache storage: the host pool's KV buffer must be contiguous host "
                                     f"memory, got a {'' if buffer.is_contiguous() else 'non-contiguous '}"
                                     f"{buffer.device} tensor")
        super().register_mem_pool_host(mem_pool_host)
        self.pages = pages
        self.namespace = namespace_of(self.storage_config, self.kind, pages, mem_pool_host)
        self._key_prefix = self.namespace.encode() + b"\0"
        self._arena = buffer.view(torch.uint8).reshape(-1).numpy()  # shares the buffer's memory
        self._arena_base = int(buffer.data_ptr())
        log.info("kvpool HiCache storage (%s, %s): %s; namespace %s", self.kind.upper(),
                 "writer" if self.writer else "reader", pages.describe(), self.namespace)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) == "kv" and host_pool is getattr(self, "mem_pool_host", None):
            return
        raise errors.ConfigError(f"kvpool HiCache storage: hybrid host pool {str(host_pool_name)!r} is not supported "
                                 "(only the KV pool's pages are stored)")

    # -- keys and views -----------------------------------------------------------------------

    def _object_keys(self, key: str) -> list[bytes]:
        """The kvpool keys of page ``key``'s objects (one per piece, or one)."""
        assert self.pages is not None
        base = self._key_prefix + key.encode()
        return [xxhash.xxh3_128_digest(base + b"\0" + bytes([i]), seed=_KEY_SEED) for i in range(self.pages.objects)]

    def _piece_views(self, host_indices: Any, count: int) -> list[list[np.ndarray] | None]:
        """Each page's pieces as arrays over the host pool's memory (None for a page whose
        pieces SGLang placed outside the registered buffer: never read or written)."""
        assert self.pages is not None
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        pieces, dtype, arena = self.pages.pieces, storage_dtype(self.pages.dtype), self._arena
        if len(ptrs) != count * pieces:
            raise errors.InvalidArgumentError(f"{len(ptrs)} page pieces for {count} pages of {pieces}")
        row = self.pages.object_shape[1:] if self.pages.gathered else self.pages.object_shape
        views: list[list[np.ndarray] | None] = []
        for page in range(count):
            page_views: list[np.ndarray] | None = []
            for j in range(page * pieces, (page + 1) * pieces):
                start, nbytes = int(ptrs[j]) - self._arena_base, int(sizes[j])
                if start < 0 or start + nbytes > len(arena) or nbytes != self.pages.piece_nbytes[j % pieces]:
                    log.error("kvpool HiCache storage: page piece at offset %d (%d B) is outside the host pool's "
                              "buffer (%d B); page skipped", start, nbytes, len(arena))
                    page_views = None
                    break
                assert page_views is not None
                page_views.append(arena[start:start + nbytes].view(dtype).reshape(row))
            views.append(page_views)
        return views

    def _check_call(self, keys: Sequence[str], host_indices: Any) -> bool:
        assert self.pages is not None, "register_mem_pool_host was not called"
        if len(host_indices) != len(keys) * self.pages.page_size:
            log.error("kvpool HiCache storage: %d host indices for %d pages of %d tokens", len(host_indices),
                      len(keys), self.pages.page_size)
            return False
        return True

    # -- interface v1 ---------------------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of ``keys`` kvpool holds: one ``lookup`` of their objects."""
        if not keys:
            return 0
        assert self.pages is not None, "register_mem_pool_host was not called"
        object_keys = [k for key in keys for k in self._object_keys(key)]
        try:
            found = self.pool.lookup(object_keys)
        except errors.KVPoolError as exc:
            log.warning("kvpool HiCache storage: lookup of %d pages failed (%s); counted as misses", len(keys), exc)
            return 0
        return found // self.pages.objects

    def batch_get_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Read pages into the host pool at ``host_indices`` (in place): one ``get_many``.
        True for each page read exact; False for a miss, a page that failed its checksums, or
        every page when kvpool failed (logged)."""
        if not keys or not self._check_call(keys, host_indices):
            return [False] * len(keys)
        assert self.pages is not None
        views = self._piece_views(host_indices, len(keys))
        object_keys: list[bytes] = []
        layers: list[LayerRange | None] = []
        outs: list[np.ndarray] = []
        owner: list[int] = []  # the page of each get_many entry
        for page, (key, page_views) in enumerate(zip(keys, views)):
            if page_views is None:
                continue
            if self.pages.gathered:  # one object; each of its rows lands where its piece is
                (object_key,) = self._object_keys(key)
                for row, view in enumerate(page_views):
                    object_keys.append(object_key)
                    layers.append(LayerRange(row, row + 1))
                    outs.append(view.reshape(1, *view.shape))
                    owner.append(page)
            else:
                for object_key, view in zip(self._object_keys(key), page_views):
                    object_keys.append(object_key)
                    layers.append(None)
                    outs.append(view)
                    owner.append(page)
        if not object_keys:
            return [False] * len(keys)
        try:
            got = self.pool.get_many(object_keys, layers=layers, outs=outs)
        except errors.KVPoolError as exc:
            log.warning("kvpool HiCache storage: get of %d pages failed (%s); counted as misses", len(keys), exc)
            return [False] * len(keys)
        ok = [views[page] is not None for page in range(len(keys))]
        for page, array in zip(owner, got):
            if array is None:
                ok[page] = False
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: Any, extra_info: Any = None) -> list[bool]:
        """Store the pages at ``host_indices`` (from the host pool's memory in place, or one copy
        for layer_first), skipping pages kvpool holds already: one ``exists_many`` and one
        ``put_many``. True for each page stored or already there. A rank that is not SGLang's
        storage writer (MLA, TP rank > 0) writes nothing and answers True, as SGLang's own
        controller does for it."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)
        if not self._check_call(keys, host_indices):
            return [False] * len(keys)
        assert self.pages is not None
        views = self._piece_views(host_indices, len(keys))
        per_page = [self._object_keys(key) for key in keys]
        try:
            present = self.pool.exists_many([k for object_keys in per_page for k in object_keys])
        except errors.KVPoolError as exc:
            log.warning("kvpool HiCache storage: exists check of %d pages failed (%s); not stored", len(keys), exc)
            return [False] * len(keys)
        items: list[tuple[bytes, np.ndarray]] = []
        written: list[int] = []
        ok = [views[page] is not None for page in range(len(keys))]
        for page, (object_keys, page_views) in enumerate(zip(per_page, views)):
            if page_views is None:
                continue
            first = page * self.pages.objects
            missing = [i for i in range(self.pages.objects) if not present[first + i]]
            if not missing:
                continue
            written.append(page)
            if self.pages.gathered:
                items.append((object_keys[0], np.stack(page_views)))
            else:
                items.extend((object_keys[i], page_views[i]) for i in missing)
        if items:
            try:
                self.pool.put_many(items, dtype=self.pages.dtype, **self._put_options)
            except errors.KVPoolError as exc:
                log.warning("kvpool HiCache storage: put of %d pages failed (%s)", len(written), exc)
                for page in written:
                    ok[page] = False
        return ok

    # -- the rest of SGLang's interface ---------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # SGLang's legacy per-tensor calls: only used without interface_v1, which __init__ refuses.
    # They raise rather than return None, which SGLang would read as a miss or a failed write.
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvpool HiCache storage serves interface_v1 (batch_get_v1) only")

    def batch_get(self, keys: list[str], target_locations: Any = None, target_sizes: Any = None) -> Any:
        raise NotImplementedError("kvpool HiCache storage serves interface_v1 (batch_get_v1) only")

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvpool HiCache storage serves interface_v1 (batch_set_v1) only")

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        raise NotImplementedError("kvpool HiCache storage serves interface_v1 (batch_set_v1) only")

    def clear(self) -> bool:
        """Deletes nothing: kvpool's objects are keyed by hash, shared with other engines, and
        leave by eviction. Returns False (nothing cleared)."""
        log.warning("kvpool HiCache storage: clear() keeps kvpool's objects (shared; they leave by eviction)")
        return False

    def close(self) -> None:
        """Close this process's kvpool pool (idempotent)."""
        self.pool.close()
