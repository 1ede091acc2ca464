"""Reading an object's layers from another node's replica.

Owns the choice among replicas (same host first, ``cxl`` first, this node's
own skipped), the two ways to read one (in place from a same-host ``cxl``
arena, else a UCX pull into the caller's buffer), checksum verification of
every layer received, and the miss reasons. The master keeps only each
replica's spec and header checksum; the header comes from the holder (its
arena, or the pull's reply) and must match that checksum before any layer is
verified against it. Used by the cluster client and
by the operators' CLI; it does not talk to the master (callers locate and
lease replicas first).

What the master says is not trusted blindly (a wrong or hostile master must not
crash or redirect a reader): every located replica and every node entry is
checked before use (:func:`clean_replica`, :func:`clean_node_address`), and a bad
one is a miss (``miss_malformed``) plus one log line, never an exception. Only
regular files inside the allowed shared-memory directories (``allowed_dirs``:
``/dev/shm``, the directory of this process's own cxl arena and
``tiers.cxl.shared_dirs``) are ever mapped, opened non-blocking and without
following a final symlink. Each replica carries the pull token the master
minted for it; the location cache stops using a replica once its token expired.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.node import NodeAddress
from kvpool.cluster.protocol import LocatedReplica
from kvpool.cluster.security import ClusterKey
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec
from kvpool.transport import Engine, PeerAddress, PullClient, PullRequest, TcpPullClient
from kvpool.transport.tcp import TcpPathUnusable

log = logging.getLogger("kvpool.remote")

#: the most bytes pulled over plain TCP from a holder that UCX reaches by shared memory
SAME_HOST_TCP_PULL_MAX = 1 << 20


OutView = Callable[[ObjectSpec, LayerRange, Any], "tuple[np.ndarray, memoryview]"]

DEFAULT_SHARED_DIRS = ("/dev/shm",)
_TOKEN_MARGIN_S = 1.0  # a cached replica whose token expires sooner is not used (locate again)
_MAX_ID = 256
_MAX_ADDRESS = 64 << 10
_MAX_TOKEN = 64


def shared_dirs_of(config: Any) -> tuple[str, ...]:
    """The directories whose cxl arenas this process may map: /dev/shm, the directory of its own
    configured arena, and ``tiers.cxl.shared_dirs`` (``:``-separated)."""
    dirs = list(DEFAULT_SHARED_DIRS)
    cxl = getattr(getattr(config, "tiers", None), "cxl", None)
    own = getattr(cxl, "path", "") or ""
    if own:
        dirs.append(os.path.dirname(os.path.abspath(os.path.expanduser(own))))
    extra = getattr(cxl, "shared_dirs", "") or ""
    dirs += [os.path.expanduser(d) for d in str(extra).split(":") if d]
    return tuple(dirs)


def clean_location(raw: Any) -> dict[str, Any] | None:
    """A cxl location ``{path, offset, instance?, ...}`` with sane types, or None."""
    if not isinstance(raw, dict):
        return None
    path, offset, instance = raw.get("path"), raw.get("offset"), raw.get("instance")
    if not isinstance(path, str) or not 0 < len(path) <= 4096 or "\0" in path:
        return None
    if not isinstance(offset, int) or isinstance(offset, bool) or not 0 <= offset < 1 << 62:
        return None
    if instance is not None and not (isinstance(instance, (str, bytes)) and len(instance) <= 256):
        return None
    return {**raw, "path": path, "offset": offset}


# Addresses and specs repeat for every key a node holds: each distinct one is decoded and checked
# once (bounded; a full memo is simply cleared). Entries are immutable.
_MEMO_LIMIT = 4096
_addresses: dict[str, NodeAddress | None] = {}
_specs: dict[tuple[Any, ...], ObjectSpec | None] = {}


def clean_node_address(text: Any) -> NodeAddress | None:
    """A node address string from the master, decoded and checked, or None."""
    if not isinstance(text, str) or len(text) > _MAX_ADDRESS:
        return None
    try:
        return _addresses[text]
    except KeyError:
        pass
    if len(_addresses) >= _MEMO_LIMIT:
        _addresses.clear()
    node = _addresses[text] = NodeAddress.parse(text)
    return node


def _clean_spec(raw: Any) -> ObjectSpec | None:
    if not isinstance(raw, (list, tuple)) or len(raw) != 5 \
            or not all(type(v) in (int, str) for v in raw):
        return None
    wire = tuple(raw)
    try:
        return _specs[wire]
    except KeyError:
        pass
    try:
        spec: ObjectSpec | None = ObjectSpec.from_wire(wire)
    except (TypeError, ValueError, errors.KVPoolError):
        spec = None
    if len(_specs) >= _MEMO_LIMIT:
        _specs.clear()
    _specs[wire] = spec
    return spec


def clean_replica(raw: Any) -> LocatedReplica | None:
    """A located replica with every field the reader uses checked (types, bounds), or None."""
    if not isinstance(raw, dict):
        return None
    node_id, address, host_id = raw.get("node_id"), raw.get("address"), raw.get("host_id", "")
    tier, header_sum, token = raw.get("tier", ""), raw.get("header_sum"), raw.get("token", b"")
    location = raw.get("location")
    if not isinstance(node_id, str) or not 0 < len(node_id) <= _MAX_ID:
        return None
    if not isinstance(host_id, str) or len(host_id) > 1024 or not isinstance(tier, str) or len(tier) > 64:
        return None
    if type(header_sum) is not int or not 0 <= header_sum < 1 << 64:
        return None
    spec = _clean_spec(raw.get("spec"))
    if spec is None:
        return None
    if not isinstance(token, bytes) or len(token) > _MAX_TOKEN:
        return None
    node = clean_node_address(address)
    if node is None:
        return None
    if location:
        location = clean_location(location)
        if location is None:
            return None
    # "_node": the decoded address, which also marks the record as checked (nothing from the wire
    # can be a NodeAddress), so later steps of the same get neither re-check nor re-parse it;
    # "_spec": the spec the reader sizes its buffer by (the holder's header must agree).
    return {**raw, "node_id": node_id, "address": address, "host_id": host_id,  # type: ignore[return-value]
            "tier": tier, "header_sum": header_sum, "token": token, "location": location or {},
            "_node": node, "_spec": spec}


class Speculation:
    """A pull from a guessed holder, before the master said where the key is
    (:meth:`ReplicaReader.speculate`). Its bytes count only once :meth:`ReplicaReader.accept`
    (a holder that proved itself sent them, whole and naming the key) or
    :meth:`ReplicaReader.confirm` (the master's ``locate`` names the guessed node with the
    same spec and header checksum) took them: until then they are unverified, and when
    neither does they are thrown away (the read then goes on as if no guess had been made)."""

    __slots__ = ("arr", "buf", "check", "failure", "key", "layer_range", "proven", "pulled", "raw_header",
                 "replica")

    def __init__(self, key: bytes, replica: LocatedReplica, layer_range: LayerRange, arr: np.ndarray,
                 buf: memoryview) -> None:
        self.key, self.replica, self.layer_range, self.arr, self.buf = key, replica, layer_range, arr, buf
        self.raw_header = bytearray(replica["_spec"].header_nbytes)  # type: ignore[typeddict-item]
        self.pulled = False
        self.proven = False  # pulled from a holder that proved it holds the cluster key
        #: the holder's answer checked as it arrives, as :meth:`ReplicaReader.accept` takes it
        self.check = ArrivalCheck(self._own_header, self.raw_header, layer_range, buf)
        #: why the guessed holder failed as a holder (dead, frozen, timed out), if it did: the
        #: located read then skips it rather than wait on it a second time
        self.failure: str | None = None

    def _own_header(self, raw_header: bytearray) -> ObjectHeader:
        """The holder's header, if whole, naming this key, with the guessed spec."""
        spec: ObjectSpec = self.replica["_spec"]  # type: ignore[typeddict-item]
        header = ObjectHeader.unpack(raw_header, spec)
        header.check_identity(self.key)
        if header.spec != spec:
            raise errors.WrongObjectError(f"the holder's object is {header.spec}, guessed {spec}")
        return header


class ArrivalCheck:
    """Checks a pull's bytes as they arrive: the TCP client calls it (``PullRequest.progress``)
    with the payload bytes received so far, between its reads, so hashing layer *i* overlaps
    receiving layer *i+1*. ``check_header`` turns the header the holder sent into the header to
    verify against, or raises; :meth:`finish` checks what is left (everything, after a pull
    that made no progress calls) and returns that header, or raises the first failure."""

    __slots__ = ("buf", "check_header", "checked", "error", "header", "layer_range", "raw_header")

    def __init__(self, check_header: Callable[[bytearray], ObjectHeader], raw_header: bytearray,
                 layer_range: LayerRange, buf: memoryview) -> None:
        self.check_header, self.raw_header, self.layer_range, self.buf = check_header, raw_header, layer_range, buf
        self.header: ObjectHeader | None = None
        self.error: errors.KVPoolError | None = None
        self.checked = 0  # layers verified

    def __call__(self, received: int) -> None:
        if self.error is None:
            try:
                self._check(received)
            except errors.KVPoolError as exc:  # raised by finish(); the pull reads on meanwhile
                self.error = exc

    def finish(self) -> ObjectHeader:
        if self.error is not None:
            raise self.error
        self._check(len(self.buf))
        assert self.header is not None
        return self.header

    def _check(self, received: int) -> None:
        if self.header is None:
            self.header = self.check_header(self.raw_header)
        step = self.header.spec.layer_nbytes
        ready = min(received // step, self.layer_range.count)
        if ready > self.checked:
            start = self.layer_range.start
            self.header.verify(LayerRange(start + self.checked, start + ready),
                               self.buf[self.checked * step:ready * step])
            self.checked = ready


_SPECULATION_MAX_SCORE = 8
_SPECULATION_RETRY_EVERY = 32  # with speculation off (guesses kept missing), still try this often
_DELETED_REMEMBERED = 65536  # keys deleted through this process that are never guessed (LRU)


def _check_same(header: ObjectHeader, same_as: ObjectHeader | None, layer_range: LayerRange) -> None:
    if same_as is not None and header.layer_checksums[layer_range.start:layer_range.stop] != \
            same_as.layer_checksums[layer_range.start:layer_range.stop]:
        raise errors.WrongObjectError("this replica holds other bytes than the one read before")


def _is_clean(replica: Any) -> bool:
    return isinstance(replica, dict) and isinstance(replica.get("_node"), NodeAddress)


def _checked_quietly(located: Any) -> list[LocatedReplica]:
    """The well-formed replicas of a master's answer, bad ones dropped without counting them
    (for a look ahead: the one-key read that may follow counts them)."""
    if not isinstance(located, list):
        return []
    checked = [r if _is_clean(r) else clean_replica(r) for r in located[:1024]]
    return [r for r in checked if r is not None]


def replicas_at(located: Any, index: int) -> Any:
    """``located.replicas[index]`` of a master reply, or None when the reply has no such entry."""
    replicas = getattr(located, "replicas", None)
    if not isinstance(replicas, list) or not 0 <= index < len(replicas):
        return None
    return replicas[index]


def alive_nodes_of(master_stats: Any) -> set[str] | None:
    """Node ids the master's stats list as alive; None when the stats are unreadable."""
    nodes = master_stats.get("nodes") if isinstance(master_stats, dict) else None
    if not isinstance(nodes, dict):
        return None
    return {nid for nid, node in nodes.items() if isinstance(nid, str) and isinstance(node, dict)
            and node.get("alive") is True}


class ReplicaReader:
    """Reads layer ranges from located replicas; never returns unverified bytes."""

    def __init__(self, host_id: str, *, node_id: str | None = None, transport: str = "auto",
                 max_message: int = 16 << 20, pull_timeout_s: float = 10.0,
                 location_cache_size: int = 0, allowed_dirs: Sequence[str] | None = None,
                 host: str = "127.0.0.1", engine: Engine | None = None, tcp_pull_max: int = 0,
                 cluster_key: ClusterKey | None = None) -> None:
        self.host_id = host_id
        self.node_id = node_id
        self.pull_timeout_s = pull_timeout_s
        #: only arenas that are regular files directly or deeper inside these are mapped
        self.allowed_dirs = tuple(os.path.realpath(d) for d in (allowed_dirs or DEFAULT_SHARED_DIRS))
        # ``engine``: the node's, shared (one UCX worker and progress thread per process)
        self.puller = PullClient(transport=transport, max_message=max_message, host=host, engine=engine)
        self.transport = transport
        #: pulls of at most this many bytes from a holder with a TCP port go over plain TCP (at
        #: most SAME_HOST_TCP_PULL_MAX from a same-host holder that UCX reaches by shared memory)
        self.tcp_pull_max = tcp_pull_max
        # ``cluster_key``: TCP pulls go only to holders that prove they hold it
        self.tcp_puller = TcpPullClient(check_proof=None if cluster_key is None else cluster_key.check_holder_proof) \
            if tcp_pull_max else None
        self.counters: Counter[str] = Counter()
        self._cxl_readers: dict[tuple[str, str], Any] = {}
        self._neighbours: dict[str, Any] = {}  # node_id -> CxlArenaReader of a same-host node
        self.location_cache_size = location_cache_size
        self._locations: OrderedDict[bytes, list[LocatedReplica]] = OrderedDict()  # key -> replicas, LRU
        #: node ids the master last reported alive (None until the first report): a replica on
        #: any other node is skipped, and a pull from it is abandoned as soon as it is known dead
        self._alive_nodes: set[str] | None = None
        self._lock = threading.Lock()
        # Speculative pulls (:meth:`speculate`): the replica last pulled from, and how well
        # guessing it has done lately (a hit adds one, a wasted guess takes two; off at zero).
        self._last_holder: LocatedReplica | None = None
        self._speculation_score = _SPECULATION_MAX_SCORE // 2
        self._speculation_skipped = 0
        #: keys deleted through this process (LRU): never guessed, so this process's own delete
        #: is a miss at once even with unconfirmed speculative pulls
        self._deleted: OrderedDict[bytes, None] = OrderedDict()

    # -- same-host arenas, found by key without the master ----------------------------

    def allowed_path(self, path: str) -> str | None:
        """``path`` resolved, if it lies inside one of :attr:`allowed_dirs`; else None (logged)."""
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            real = ""
        for folder in self.allowed_dirs:
            if real.startswith(folder.rstrip("/") + "/"):
                return real
        log.warning("refusing to map %.300r: not inside the allowed shared-memory directories %s",
                    path, self.allowed_dirs)
        self.counters["refused_paths"] += 1
        return None

    def refresh_neighbours(self, master_stats: Mapping[str, Any]) -> None:
        """Map the cxl arenas of live nodes on this host; forget the ones gone."""
        from tiers.cxl import CxlArenaReader

        wanted: dict[str, dict[str, str]] = {}
        nodes = master_stats.get("nodes") if isinstance(master_stats, dict) else None
        if not isinstance(nodes, dict):
            log.warning("master stats without a readable node list: %.200r", master_stats)
            nodes = {}
        for node_id, node in nodes.items():
            if not isinstance(node_id, str) or not isinstance(node, dict):
                self.counters["bad_records"] += 1
                continue
            if node_id == self.node_id or node.get("alive") is not True or node.get("host_id") != self.host_id:
                continue
            address = clean_node_address(node.get("address"))
            if address is None:
                self.counters["bad_records"] += 1
                log.warning("master lists node %.64s with an unreadable address", node_id)
                continue
            arena = address.arena
            if arena:
                path = self.allowed_path(arena["path"])
                if path is not None:
                    wanted[node_id] = {**arena, "path": path}
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

    def clean(self, replicas: Any) -> list[LocatedReplica]:
        """The well-formed replicas of a master's answer (see :func:`clean_replica`); each bad
        one is counted (``bad_records``) and logged once."""
        if replicas is None:
            return []
        if not isinstance(replicas, list):
            self.counters["bad_records"] += 1
            log.warning("master sent replicas that are not a list: %.200r", replicas)
            return []
        good = []
        for raw in replicas[:1024]:
            replica = raw if _is_clean(raw) else clean_replica(raw)
            if replica is None:
                self.counters["bad_records"] += 1
                log.warning("ignoring a malformed replica record from the master: %.200r", raw)
                continue
            good.append(replica)
        return good

    def ordered(self, replicas: list[LocatedReplica]) -> list[LocatedReplica]:
        """Same-host replicas first (no network), ``cxl`` first among them; never this node's own."""
        replicas = self.clean(replicas)
        others = [r for r in replicas if self.node_id is None or r.get("node_id") != self.node_id]
        return sorted(others, key=lambda r: (r.get("host_id") != self.host_id, r.get("tier") != "cxl"))

    def read(self, key: bytes, replicas: list[LocatedReplica] | None, layers: Any, out: Any,
             out_view: OutView, count_misses: bool = True,
             skip: Mapping[str, str] | None = None) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact, or None (counted by reason).

        Raises LayerRangeError / OutBufferError for the caller's mistakes (the
        same on every replica); every other failure moves on to the next replica.
        Replicas that served are remembered for :meth:`read_cached`. ``skip``: node ids
        already known to fail now, with the miss reason each counts as.
        """
        if not replicas:
            self.counters["miss_absent"] += count_misses
            return None
        replicas = self.clean(replicas)
        if not replicas:
            self.counters["miss_malformed"] += count_misses
            return None
        failed: set[str] = set()
        arr = self._first_intact(key, self.ordered(replicas), layers, out, out_view, count_misses=count_misses,
                                 failed=failed, skip=skip)  # ordered() keeps the checked records as they are
        if not count_misses:  # a remembered location: counted as such, forgotten when it failed
            self.counters["location_cache_hits" if arr is not None else "location_cache_stale"] += 1
            if arr is None:
                self.forget(key)
        if arr is not None:
            self._remember(key, [r for r in replicas if r.get("node_id") not in failed])
        return arr

    def _remember(self, key: bytes, replicas: list[LocatedReplica]) -> None:
        """Where ``key`` was read from, for :meth:`read_cached` (LRU, ``location_cache_size``)."""
        if not self.location_cache_size:
            return
        with self._lock:
            self._locations[key] = replicas
            self._locations.move_to_end(key)
            while len(self._locations) > self.location_cache_size:
                self._locations.popitem(last=False)

    def remembered(self, key: bytes) -> list[LocatedReplica] | None:
        """The replicas ``key`` was read from last time whose tokens are still good for a while
        (None: not remembered, or locate again)."""
        with self._lock:
            replicas = self._locations.get(key)
        if replicas is None:
            return None
        # A replica whose token is about to expire would be refused: ask the master again.
        soon = time.time() + _TOKEN_MARGIN_S
        current = [r for r in replicas if ClusterKey.token_expiry_s(r.get("token", b"")) > soon]
        if not current:
            with self._lock:
                if self._locations.get(key) is replicas:  # not one a concurrent read stored since
                    del self._locations[key]
            self.counters["location_cache_expired"] += 1
            return None
        return current

    def read_cached(self, key: bytes, layers: Any, out: Any, out_view: OutView) -> np.ndarray | None:
        """Read from where ``key`` was found last time, without asking the master; None if
        it is not remembered or no longer there (the entry is then forgotten)."""
        current = self.remembered(key)
        return None if current is None else self.read(key, current, layers, out, out_view, count_misses=False)

    def forget(self, key: bytes) -> None:
        with self._lock:
            self._locations.pop(key, None)

    def deleted(self, key: bytes) -> None:
        """``key`` was deleted through this process: forget where it was, and never guess its
        holder again (:meth:`speculate`), which may hold it until its next heartbeat."""
        with self._lock:
            self._locations.pop(key, None)
            self._deleted[key] = None
            self._deleted.move_to_end(key)
            while len(self._deleted) > _DELETED_REMEMBERED:
                self._deleted.popitem(last=False)

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
                      out_view: OutView, *, count_misses: bool, failed: set[str] | None = None,
                      skip: Mapping[str, str] | None = None) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact; ``failed`` collects the
        node ids of replicas that failed (dead, frozen, evicted, corrupt) on the way."""
        for replica in replicas:
            reason = None
            known = skip.get(replica["node_id"]) if skip else None
            if known is not None or not self.holder_alive(replica):
                reason = known or "holder_gone"
                if failed is not None:
                    failed.add(str(replica.get("node_id")))
                if count_misses:
                    self.counters[f"miss_{reason}"] += 1
                continue
            try:
                spec: ObjectSpec = replica["_spec"]  # type: ignore[typeddict-item]
                layer_range = LayerRange.resolve(layers, spec.layers)
                arr, buf = out_view(spec, layer_range, out)
                self.read_into(key, replica, layer_range, buf)
                self._hit(len(buf))
                return arr
            except (errors.LayerRangeError, errors.OutBufferError):
                raise
            except (ValueError, TypeError, KeyError, IndexError, OverflowError, errors.KVPoolError) as exc:
                reason = self._reason_of(key, replica, exc)
            if failed is not None:
                failed.add(str(replica.get("node_id")))
            if count_misses:
                self.counters[f"miss_{reason}"] += 1
        return None

    def read_many(self, keys: list[bytes], replicas: list[list[LocatedReplica] | None], layers: Any,
                  out_view: OutView, outs: Sequence[Any], count_misses: bool = True) -> list[np.ndarray | None]:
        """``read`` for many keys (results in order): every key's first choice of replica that
        must be pulled is pulled in one :meth:`PullClient.pull_many` (all in flight at once,
        driven by this thread); same-host in-place reads, keys whose first choice failed and
        keys without a usable replica take the one-key path."""
        results: list[np.ndarray | None] = [None] * len(keys)
        alone: list[tuple[int, dict[str, str] | None]] = []  # read one by one, skipping these nodes
        batch: list[tuple[int, LocatedReplica, np.ndarray, ArrivalCheck]] = []
        for i, (located, out) in enumerate(zip(replicas, outs)):
            first = self._first_to_pull(located)
            if first is None:
                alone.append((i, None))
                continue
            spec: ObjectSpec = first["_spec"]  # type: ignore[typeddict-item]
            layer_range = LayerRange.resolve(layers, spec.layers)
            arr, buf = out_view(spec, layer_range, out)
            batch.append((i, first, arr, self._located_check(keys[i], first, layer_range, buf)))
        if batch:
            pulled = self._pull_many([
                PullRequest(replica["_node"].peer, keys[i], check.layer_range, check.buf,  # type: ignore[typeddict-item]
                            token=replica.get("token", b""), header_out=check.raw_header,
                            alive=lambda replica=replica: self.holder_alive(replica), progress=check)
                for i, replica, _, check in batch])
            for (i, replica, arr, check), outcome in zip(batch, pulled):
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    check.finish()
                except (errors.LayerRangeError, errors.OutBufferError):
                    raise
                except Exception as exc:  # this replica failed: the others, one by one
                    alone.append((i, {replica["node_id"]: self._reason_of(keys[i], replica, exc)}))
                    continue
                self._hit(len(check.buf))
                self._pulled_from(replica)
                if not count_misses:
                    self.counters["location_cache_hits"] += 1
                self._remember(keys[i], self.clean(replicas[i]))
                results[i] = arr
        for i, skip in sorted(alone, key=lambda item: item[0]):
            results[i] = self.read(keys[i], replicas[i], layers, outs[i], out_view, count_misses, skip=skip)
        return results

    def _first_to_pull(self, located: list[LocatedReplica] | None) -> LocatedReplica | None:
        """The replica a one-key read would try first, if it is to be pulled (not read in place
        from a same-host arena) and its holder is alive; else None. Checked quietly: the
        one-key read of what is left counts bad records."""
        ordered = self.ordered(_checked_quietly(located))
        if not ordered:
            return None
        first = ordered[0]
        if first.get("host_id") == self.host_id and first.get("tier") == "cxl" and first.get("location"):
            return None
        return first if self.holder_alive(first) else None

    def _reason_of(self, key: bytes, replica: LocatedReplica, exc: BaseException) -> str:
        """The miss reason a failed read of ``replica`` counts as (logged where it says more)."""
        if isinstance(exc, errors.RemoteMissError):
            return "evicted"
        if isinstance(exc, errors.WrongObjectError):  # the holder has another version now (put again)
            return "stale"
        if isinstance(exc, errors.ChecksumError):
            return "checksum"
        if isinstance(exc, errors.KVTimeoutError):
            return "timeout"
        if isinstance(exc, errors.AuthenticationError):  # the holder refused the token: never data
            log.info("replica of %s on %s refused the pull: %s", key.hex(), replica.get("node_id"), exc)
            return "unauthorized"
        if isinstance(exc, (errors.TransferError, errors.FormatError, errors.TierError)):
            log.info("replica of %s on %s failed: %s", key.hex(), replica.get("node_id"), exc)
            return "holder_gone"
        # what the master said about this replica does not add up (header, location)
        log.warning("replica of %s on %s is malformed: %s: %.200s", key.hex(), replica.get("node_id"),
                    type(exc).__name__, exc)
        return "malformed"

    def read_into(self, key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview,
                  *, same_as: ObjectHeader | None = None) -> ObjectHeader:
        """Fill ``buf`` with verified layers from one replica and return the header they were
        verified against, or raise.

        The master keeps only a checksum of each replica's header. The header
        itself comes from the holder: read from its arena (same host, in place)
        or sent with the pull's reply. It must be the version indexed (its
        checksum), name ``key`` and have the located spec, and every layer
        copied must match it; WrongObjectError when the holder has another
        object or version there now, ChecksumError for damaged bytes.
        ``same_as``: the header earlier layers of the same read were verified
        against; these layers must have the same checksums (a layer-wise read
        that moves to another replica never mixes two versions' layers).
        """
        if not _is_clean(replica):
            replica = clean_replica(replica)  # type: ignore[assignment]
            if replica is None:
                raise errors.TransferError("malformed replica record")
        spec: ObjectSpec = replica["_spec"]  # type: ignore[typeddict-item]
        header_sum = replica["header_sum"]
        location = replica.get("location") or {}
        if replica.get("host_id") == self.host_id and replica.get("tier") == "cxl" and location:
            try:
                reader = self._cxl_reader(location)
                header = reader.header_at(location["offset"], key, header_sum, spec)
                _check_same(header, same_as, layer_range)
                reader.read_layers_into(location["offset"], header, layer_range, buf, verify=True)
                self.counters["reads_in_place"] += 1
                return header
            except (errors.KVPoolError, OSError) as exc:  # moved or reused since located: pull instead
                log.debug("in-place read of %s failed (%s); pulling", key.hex(), exc)
        check = self._located_check(key, replica, layer_range, buf, same_as)
        self._pull(key, replica, layer_range, buf, check.raw_header, replica.get("token", b""), check)
        header = check.finish()
        self._pulled_from(replica)
        return header

    def _pull(self, key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview,
              raw_header: bytearray, token: bytes, check: ArrivalCheck | None = None, *,
              tcp_only: bool = False) -> None:
        """Pull ``layer_range`` of ``key`` from ``replica``'s holder into ``buf`` with its header
        (unverified, or checked as it arrives by ``check``), abandoned as soon as the holder is
        known gone. ``tcp_only``: never over UCX (see :meth:`_pull_many`)."""
        (outcome,) = self._pull_many([PullRequest(replica["_node"].peer, key, layer_range, buf,  # type: ignore[typeddict-item]
                                                  token, raw_header, lambda: self.holder_alive(replica),
                                                  progress=check)], tcp_only=tcp_only)
        if isinstance(outcome, BaseException):
            raise outcome

    def _client_for(self, peer: PeerAddress | tuple[str, int], nbytes: int) -> PullClient | TcpPullClient:
        """Plain TCP for a pull of at most ``tcp_pull_max`` bytes from a holder that serves it
        (and whose port worked lately), else UCX. From a same-host holder that UCX reaches by
        shared memory (``transport="auto"``), plain TCP only up to SAME_HOST_TCP_PULL_MAX:
        above it UCX's shared memory was faster (bench/transfer_bench.py)."""
        if self.tcp_puller is None or not isinstance(peer, PeerAddress):
            return self.puller
        limit = self.tcp_pull_max
        if self.transport == "auto" and peer.host_id == self.host_id and peer.worker_address:
            limit = min(limit, SAME_HOST_TCP_PULL_MAX)
        return self.tcp_puller if nbytes <= limit and self.tcp_puller.reachable(peer) else self.puller

    def _pull_many(self, requests: list[PullRequest], *, tcp_only: bool = False) -> list[int | BaseException]:
        """Pulls in flight together (:meth:`PullClient.pull_many`): one result per request, the
        bytes received or the error. The small ones go over TCP first; those whose holder's TCP
        port proved unusable then go over UCX with the rest (``tcp_only``: they fail with
        TcpPathUnusable instead; the caller checked that every one goes over TCP)."""
        results: list[int | BaseException | None] = [None] * len(requests)
        over_ucx = list(range(len(requests)))
        if self.tcp_puller is not None:
            over_tcp = [i for i in over_ucx if self._client_for(requests[i].address, requests[i].out.nbytes)
                        is self.tcp_puller]
            if over_tcp:
                for i, outcome in zip(over_tcp, self.tcp_puller.pull_many(
                        [requests[i] for i in over_tcp], timeout_s=self.pull_timeout_s)):
                    results[i] = outcome
                    self.counters["tcp_fallbacks"] += isinstance(outcome, TcpPathUnusable)
                over_ucx = [i for i in over_ucx if results[i] is None or isinstance(results[i], TcpPathUnusable)]
        if tcp_only:
            for i in over_ucx:
                if results[i] is None:  # not over TCP after all (its port became unreachable meanwhile)
                    results[i] = TcpPathUnusable(f"pull of {requests[i].key!r:.80} would go over UCX")
        elif over_ucx:
            for i, outcome in zip(over_ucx, self.puller.pull_many([requests[i] for i in over_ucx],
                                                                  timeout_s=self.pull_timeout_s)):
                results[i] = outcome
        return results  # type: ignore[return-value]

    @staticmethod
    def _located_check(key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview,
                       same_as: ObjectHeader | None = None, raw_header: bytearray | None = None) -> ArrivalCheck:
        """The check of a pull from ``replica``: the header the holder sends (into ``raw_header``,
        a new buffer by default) must be the one the master indexed for it (and agree with
        ``same_as``), and every layer in ``buf`` must match that header (see :meth:`read_into`)."""
        spec: ObjectSpec = replica["_spec"]  # type: ignore[typeddict-item]

        def indexed(raw: bytearray) -> ObjectHeader:
            header = ObjectHeader.unpack_expected(raw, key, replica["header_sum"], spec)
            _check_same(header, same_as, layer_range)
            return header

        return ArrivalCheck(indexed, bytearray(spec.header_nbytes) if raw_header is None else raw_header,
                            layer_range, buf)

    def _pulled_from(self, replica: LocatedReplica) -> None:
        """Count a verified pull; its holder is the next speculative guess."""
        self.counters["pulls"] += 1
        self._last_holder = replica

    def _hit(self, nbytes: int) -> None:
        self.counters["hits_remote"] += 1
        self.counters["bytes_pulled"] += nbytes

    # -- speculative pulls -------------------------------------------------------------------

    def speculate(self, key: bytes, layers: Any, out: Any, out_view: OutView) -> Speculation | None:
        """A pull of ``key`` to start from the node this reader last pulled from, before the
        master has said where ``key`` is (:meth:`run`, then :meth:`confirm`), or None: nothing
        pulled yet, the guesses have kept missing lately, that node is gone, or ``layers`` /
        ``out`` do not fit the last object's spec (the guess is that ``key`` has the same one).

        A reader that keeps reading from one holder (a decode node reading what its prefill
        node wrote) then pays max(locate, pull) instead of their sum.
        """
        replica = self._last_holder
        if replica is None or key in self._deleted:
            return None
        if self._speculation_score <= 0:
            self._speculation_skipped += 1
            if self._speculation_skipped < _SPECULATION_RETRY_EVERY:
                return None
            self._speculation_skipped, self._speculation_score = 0, 1
        if not self.holder_alive(replica):
            return None
        spec: ObjectSpec = replica["_spec"]  # type: ignore[typeddict-item]
        try:
            layer_range = LayerRange.resolve(layers, spec.layers)
            arr, buf = out_view(spec, layer_range, out)
        except errors.KVPoolError:  # not this spec: the located read will say what is wrong
            return None
        return Speculation(key, replica, layer_range, arr, buf)

    def provable(self, guess: Speculation) -> bool:
        """Whether ``guess`` would be pulled over TCP from a holder that must first prove it holds
        the cluster key: only such a pull may be used as the holder answers (:meth:`accept`).
        (A UCX endpoint proves nothing: whatever took over a dead holder's address would be
        believed.)"""
        tcp = self.tcp_puller
        return tcp is not None and tcp.check_proof is not None and \
            self._client_for(guess.replica["_node"].peer, len(guess.buf)) is tcp  # type: ignore[typeddict-item]

    def run(self, guess: Speculation, token: bytes, *, proven: bool = False) -> None:
        """Pull the guessed bytes (unverified until :meth:`confirm` or :meth:`accept`); never
        raises a kvpool error. ``proven``: only over TCP from a holder that proves itself (see
        :meth:`provable`), else not at all."""
        replica = guess.replica
        try:
            self._pull(guess.key, replica, guess.layer_range, guess.buf, guess.raw_header, token,
                       guess.check if proven else None, tcp_only=proven)
            guess.pulled, guess.proven = True, proven
        except errors.KVTimeoutError:
            guess.failure = "timeout"
        except (errors.RemoteMissError, errors.LayerRangeError, errors.OutBufferError, errors.ProtocolError,
                errors.AuthenticationError, TcpPathUnusable) as exc:
            # not there, not the guessed spec, or (proven) its TCP port unusable: locate decides
            log.debug("speculative pull of %s from %s: %s", guess.key.hex(), replica.get("node_id"), exc)
        except errors.KVPoolError as exc:  # the holder failed (gone, connection lost)
            log.debug("speculative pull of %s from %s: %s", guess.key.hex(), replica.get("node_id"), exc)
            guess.failure = "holder_gone"

    def accept(self, guess: Speculation) -> np.ndarray | None:
        """The guessed holder's own answer, without the master (``node.confirm_speculative =
        false``): the pulled layers if a holder that proved itself sent them (``run(proven=
        True)``), its header is whole, names ``guess.key``, has the guessed spec, and every layer
        matches it; else None (the guess is wasted: locate and read as usual).

        What this gives up against :meth:`confirm` is only how soon another process's delete
        shows: a holder keeps a deleted key until its next heartbeat, as a remembered location
        or a same-host arena does. The bytes are the key's, whole, in every case.
        """
        if guess.pulled and guess.proven:
            try:
                guess.check.finish()
            except errors.KVPoolError as exc:  # another object or damaged: read as located
                log.info("speculative pull of %s from %s not used: %s", guess.key.hex(),
                         guess.replica.get("node_id"), exc)
            else:
                self.counters["speculative_unconfirmed"] += 1
                self._pulled_from(guess.replica)
                return self._guess_used(guess)
        self._guess_wasted()
        return None

    def _guess_used(self, guess: Speculation) -> np.ndarray:
        self._speculation_score = min(_SPECULATION_MAX_SCORE, self._speculation_score + 1)
        self.counters["speculative_hits"] += 1
        self._hit(len(guess.buf))
        return guess.arr

    def _guess_wasted(self) -> None:
        self._speculation_score -= 2
        self.counters["speculative_wasted"] += 1

    def confirm(self, guess: Speculation, located: Any) -> np.ndarray | None:
        """The speculatively pulled layers, if the master located ``guess.key`` on the guessed
        node with the same spec and header checksum and every layer matches that header;
        else None (the guess is wasted: read the located replicas as usual)."""
        # Checked quietly: the located read that follows a wasted guess counts bad records.
        replicas = _checked_quietly(located)
        for replica in replicas:
            if not guess.pulled or replica["node_id"] != guess.replica["node_id"]:
                continue
            spec: ObjectSpec = replica["_spec"]  # type: ignore[typeddict-item]
            if spec != guess.replica["_spec"]:  # type: ignore[typeddict-item]
                break
            try:
                self._located_check(guess.key, replica, guess.layer_range, guess.buf,
                                    raw_header=guess.raw_header).finish()
            except errors.KVPoolError as exc:  # another version, or damaged: read as located
                log.info("speculative pull of %s from %s not used: %s", guess.key.hex(), replica["node_id"], exc)
                break
            self._pulled_from(replica)
            self._remember(guess.key, replicas)
            return self._guess_used(guess)
        self._guess_wasted()
        return None

    def _cxl_reader(self, location: Mapping[str, Any]) -> Any:
        from tiers.cxl import CxlArenaReader

        path = self.allowed_path(str(location["path"]))
        if path is None:
            raise errors.TierError(f"cxl: {str(location['path'])[:300]!r} is outside the allowed directories")
        ident = (path, str(location.get("instance", "")))
        with self._lock:
            reader = self._cxl_readers.get(ident)
            if reader is None:
                reader = self._cxl_readers[ident] = CxlArenaReader.from_location({**location, "path": path})
            return reader

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "pull_client": self.puller.stats(),
                "tcp_pull_client": self.tcp_puller.stats() if self.tcp_puller is not None else {}}

    def close(self) -> None:
        self.puller.close()
        if self.tcp_puller is not None:
            self.tcp_puller.close()
        with self._lock:
            for reader in [*self._cxl_readers.values(), *self._neighbours.values()]:
                reader.close()
            self._cxl_readers.clear()
            self._neighbours.clear()
