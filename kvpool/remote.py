"""Reading an object's layers from another node's replica.

Owns the choice among replicas (same host first, ``cxl`` first, this node's
own skipped), the two ways to read one (in place from a same-host ``cxl``
arena, else a UCX pull into the caller's buffer), checksum verification of
every layer received, and the miss reasons. Used by the cluster client and
by the operators' CLI; it does not talk to the master (callers locate and
lease replicas first).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections import Counter, OrderedDict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kvpool import errors
from kvpool.node import NodeAddress
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec
from kvpool.protocol import LocatedReplica
from kvpool.transfer import PullClient

log = logging.getLogger("kvpool.remote")

_PARALLEL_PULLS = 8  # pulls of one get_many in flight at once

OutView = Callable[[ObjectSpec, LayerRange, Any], "tuple[np.ndarray, memoryview]"]


class ReplicaReader:
    """Reads layer ranges from located replicas; never returns unverified bytes."""

    def __init__(self, host_id: str, *, node_id: str | None = None, transport: str = "auto",
                 max_message: int = 16 << 20, pull_timeout_s: float = 10.0,
                 location_cache_size: int = 0) -> None:
        self.host_id = host_id
        self.node_id = node_id
        self.pull_timeout_s = pull_timeout_s
        self.puller = PullClient(transport=transport, max_message=max_message)
        self.counters: Counter[str] = Counter()
        self._cxl_readers: dict[tuple[str, str], Any] = {}
        self._neighbours: dict[str, Any] = {}  # node_id -> CxlArenaReader of a same-host node
        self.location_cache_size = location_cache_size
        self._locations: OrderedDict[bytes, list[LocatedReplica]] = OrderedDict()  # key -> replicas, LRU
        #: node ids the master last reported alive (None until the first report): a replica on
        #: any other node is skipped, and a pull from it is abandoned as soon as it is known dead
        self._alive_nodes: set[str] | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- same-host arenas, found by key without the master ----------------------------

    def refresh_neighbours(self, master_stats: Mapping[str, Any]) -> None:
        """Map the cxl arenas of live nodes on this host; forget the ones gone."""
        from tiers.cxl import CxlArenaReader

        wanted: dict[str, dict[str, str]] = {}
        for node_id, node in master_stats.get("nodes", {}).items():
            if node_id == self.node_id or not node.get("alive") or node.get("host_id") != self.host_id:
                continue
            try:
                arena = NodeAddress.decode(node["address"]).arena
            except errors.ProtocolError:
                continue
            if arena:
                wanted[node_id] = arena
        with self._lock:
            for node_id in list(self._neighbours):
                reader = self._neighbours[node_id]
                if node_id not in wanted or not reader.current():  # gone, dead, or replaced
                    del self._neighbours[node_id]
                    reader.close()
            for node_id, arena in wanted.items():
                if node_id not in self._neighbours:
                    try:
                        self._neighbours[node_id] = CxlArenaReader.open(arena["path"], instance=arena["instance"])
                    except (errors.KVPoolError, OSError) as exc:
                        log.debug("cannot map the arena of %s: %s", node_id, exc)

    def read_same_host(self, key: bytes, layers: Any, out: Any, out_view: OutView) -> np.ndarray | None:
        """The layers read in place from a same-host node's arena found through its shared
        index (no master round trip), verified layer by layer; None if no neighbour has it."""
        with self._lock:
            neighbours = list(self._neighbours.values())
        for reader in neighbours:
            try:
                found = reader.read_key_into(key, layers, lambda spec, rng: out_view(spec, rng, out))
                if found is None:
                    continue
                arr, buf = found
            except (errors.LayerRangeError, errors.OutBufferError):
                raise
            except (errors.KVPoolError, OSError) as exc:  # freed or reused meanwhile: try elsewhere
                log.debug("same-host read of %s failed: %s", key.hex(), exc)
                self.counters["same_host_retries"] += 1
                continue
            self.counters["hits_same_host"] += 1
            self.counters["bytes_pulled"] += len(buf)
            return arr
        return None

    def ordered(self, replicas: list[LocatedReplica]) -> list[LocatedReplica]:
        """Same-host replicas first (no network), ``cxl`` first among them; never this node's own."""
        others = [r for r in replicas if self.node_id is None or r.get("node_id") != self.node_id]
        return sorted(others, key=lambda r: (r.get("host_id") != self.host_id, r.get("tier") != "cxl"))

    def read(self, key: bytes, replicas: list[LocatedReplica] | None, layers: Any, out: Any,
             out_view: OutView) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact, or None (counted by reason).

        Raises LayerRangeError / OutBufferError for the caller's mistakes (the
        same on every replica); every other failure moves on to the next replica.
        Replicas that served are remembered for :meth:`read_cached`.
        """
        if not replicas:
            self.counters["miss_absent"] += 1
            return None
        failed: set[str] = set()
        arr = self._first_intact(key, self.ordered(replicas), layers, out, out_view, count_misses=True,
                                 failed=failed)
        if arr is not None and self.location_cache_size:
            keep = [r for r in replicas if r.get("node_id") not in failed]
            with self._lock:
                self._locations[key] = keep
                self._locations.move_to_end(key)
                while len(self._locations) > self.location_cache_size:
                    self._locations.popitem(last=False)
        return arr

    def read_cached(self, key: bytes, layers: Any, out: Any, out_view: OutView) -> np.ndarray | None:
        """Read from where ``key`` was found last time, without asking the master; None if
        it is not remembered or no longer there (the entry is then forgotten)."""
        with self._lock:
            replicas = self._locations.get(key)
        if replicas is None:
            return None
        failed: set[str] = set()
        arr = self._first_intact(key, self.ordered(replicas), layers, out, out_view, count_misses=False,
                                 failed=failed)
        if arr is None:
            with self._lock:
                self._locations.pop(key, None)
            self.counters["location_cache_stale"] += 1
        else:
            self.counters["location_cache_hits"] += 1
            if failed:  # a holder that failed once is not asked first again: it costs a deadline
                with self._lock:
                    if self._locations.get(key) is replicas:
                        self._locations[key] = [r for r in replicas if r.get("node_id") not in failed]
        return arr

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._locations.pop(key, None)

    def forget_nodes_except(self, alive: set[str]) -> None:
        """Remember which nodes are alive; drop remembered replicas on any other node."""
        with self._lock:
            self._alive_nodes = set(alive)
            for key in list(self._locations):
                replicas = self._locations[key]
                keep = [r for r in replicas if r.get("node_id") in alive]
                if not keep:
                    del self._locations[key]
                elif len(keep) != len(replicas):
                    self._locations[key] = keep

    def holder_alive(self, replica: LocatedReplica) -> bool:
        """False once the holder is known gone: the master no longer lists it alive, or (same
        host) its cxl arena's owner lock is free. Cheap; asked while a pull waits."""
        node_id = replica.get("node_id")
        alive = self._alive_nodes
        if alive is not None and node_id not in alive:
            return False
        neighbour = self._neighbours.get(node_id) if isinstance(node_id, str) else None
        if neighbour is not None:
            try:
                return bool(neighbour.owner_alive())
            except errors.KVPoolError:
                return False
        return True

    def _first_intact(self, key: bytes, replicas: list[LocatedReplica], layers: Any, out: Any,
                      out_view: OutView, *, count_misses: bool, failed: set[str] | None = None) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact; ``failed`` collects the
        node ids of replicas that failed (dead, frozen, evicted, corrupt) on the way."""
        for replica in replicas:
            reason = None
            if not self.holder_alive(replica):
                reason = "holder_gone"
                if failed is not None:
                    failed.add(str(replica.get("node_id")))
                if count_misses:
                    self.counters["miss_holder_gone"] += 1
                continue
            try:
                header = ObjectHeader.unpack(replica["header"])
                header.check_identity(key)
                layer_range = LayerRange.resolve(layers, header.spec.layers)
                arr, buf = out_view(header.spec, layer_range, out)
                self.read_into(key, replica, header, layer_range, buf)
                self.counters["hits_remote"] += 1
                self.counters["bytes_pulled"] += len(buf)
                return arr
            except (errors.LayerRangeError, errors.OutBufferError):
                raise
            except errors.RemoteMissError:
                reason = "evicted"
            except errors.ChecksumError:
                reason = "checksum"
            except errors.KVTimeoutError:
                reason = "timeout"
            except (errors.TransferError, errors.FormatError, errors.TierError) as exc:
                log.info("replica of %s on %s failed: %s", key.hex(), replica.get("node_id"), exc)
                reason = "holder_gone"
            if failed is not None:
                failed.add(str(replica.get("node_id")))
            if count_misses:
                self.counters[f"miss_{reason}"] += 1
        return None

    def read_many(self, keys: list[bytes], replicas: list[list[LocatedReplica] | None], layers: Any,
                  out_view: OutView, outs: Sequence[Any]) -> list[np.ndarray | None]:
        """``read`` for many keys with their pulls in flight together (results in order)."""
        jobs = list(zip(keys, replicas, outs))
        if len(jobs) <= 1:
            return [self.read(k, r, layers, out, out_view) for k, r, out in jobs]
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(_PARALLEL_PULLS, thread_name_prefix="kvpool-pull")
            pool = self._pool
        futures = [pool.submit(self.read, k, r, layers, out, out_view) for k, r, out in jobs]
        return [f.result() for f in futures]

    def read_into(self, key: bytes, replica: LocatedReplica, header: ObjectHeader,
                  layer_range: LayerRange, buf: memoryview) -> None:
        """Fill ``buf`` with verified layers from one replica, or raise."""
        location = replica.get("location") or {}
        if replica.get("host_id") == self.host_id and replica.get("tier") == "cxl" and location:
            try:
                reader = self._cxl_reader(location)
                reader.read_layers_into(location["offset"], header, layer_range, buf, verify=True)
                self.counters["reads_in_place"] += 1
                return
            except (errors.KVPoolError, OSError) as exc:  # moved or reused since located: pull instead
                log.debug("in-place read of %s failed (%s); pulling", key.hex(), exc)
        peer = NodeAddress.decode(replica["address"]).peer
        self.puller.pull_into(peer, key, layer_range, buf, timeout_s=self.pull_timeout_s,
                              alive=lambda: self.holder_alive(replica))
        header.verify(layer_range, buf)
        self.counters["pulls"] += 1

    def _cxl_reader(self, location: Mapping[str, Any]) -> Any:
        from tiers.cxl import CxlArenaReader

        ident = (str(location["path"]), str(location.get("instance", "")))
        with self._lock:
            reader = self._cxl_readers.get(ident)
            if reader is None:
                reader = self._cxl_readers[ident] = CxlArenaReader.from_location(dict(location))
            return reader

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "pull_client": self.puller.stats()}

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self.puller.close()
        with self._lock:
            for reader in [*self._cxl_readers.values(), *self._neighbours.values()]:
                reader.close()
            self._cxl_readers.clear()
            self._neighbours.clear()
