"""Reading an object's layers from another node's replica.

Owns the choice among replicas (same host first, ``cxl`` first, this node's
own skipped), the ways to read one (in place from a same-host ``cxl`` arena,
:mod:`kvpool.cluster.node.same_host`; else a pull over TCP or UCX into the caller's
buffer), checksum verification of every layer received
(:mod:`kvpool.cluster.node.checks`), guessed holders (speculative pulls), the
location cache, and the miss reasons. The master keeps only each replica's
spec and header checksum; the header comes from the holder (its arena, or the
pull's reply) and must match that checksum before any layer is verified
against it. Used by the cluster client and by the operators' CLI; it does not
talk to the master (callers locate and lease replicas first).

What the master says is not trusted blindly: every located replica is checked
where its answer is read (:func:`kvpool.cluster.node.located.located_replicas`),
and this reader takes only the checked records; a key whose every record was bad
is a miss (``miss_malformed``), never an exception. Each replica
carries the pull token the master minted for it; the location cache stops
using a replica once its token expired.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.node.checks import ArrivalCheck, Speculation, check_same, guessed_check, located_check
from kvpool.cluster.node.located import LocatedReplica
from kvpool.cluster.node.same_host import OutView, SameHostArenas
from kvpool.cluster.wire.security import ClusterKey
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec
from kvpool.transport import Engine, PullRequest, Pulls

log = logging.getLogger("kvpool.remote")

_TIER_ORDER = {"cxl": 0, "dram": 1, "hbm": 2, "nvme": 3}  # replicas of a key, fastest to read first
_TOKEN_MARGIN_S = 1.0  # a cached replica whose token expires sooner is not used (locate again)
_SPECULATION_MAX_SCORE = 8
_SPECULATION_RETRY_EVERY = 32  # with speculation off (guesses kept missing), still try this often
_GONE_REMEMBERED = 65536  # node ids known gone (each process that joins is a new node id)
_DELETED_REMEMBERED = 65536  # keys deleted through this process that are never guessed (LRU)


class ReplicaReader:
    """Reads layer ranges from located replicas; never returns unverified bytes."""

    def __init__(self, host_id: str, *, node_id: str | None = None, transport: str = "auto",
                 max_message: int = 16 << 20, pull_timeout_s: float = 10.0,
                 location_cache_size: int = 0, allowed_dirs: Sequence[str] | None = None,
                 host: str = "127.0.0.1", engine: Engine | Callable[[], Engine] | None = None, tcp_pull_max: int = 0,
                 cluster_key: ClusterKey | None = None, poll_s: float = 0.0) -> None:
        self.host_id = host_id
        self.node_id = node_id
        self.pull_timeout_s = pull_timeout_s
        self.counters: Counter[str] = Counter()
        # How bytes come from a holder (plain TCP up to ``tcp_pull_max``, else UCX; the fallback
        # between them). ``engine``: the node's, shared (one UCX worker and progress thread per
        # process), or what makes it (``Node.ucx_engine``). ``cluster_key``: TCP pulls go only to
        # holders that prove they hold it, and this reader proves it holds it too (its pulls
        # there then need no token).
        self.pulls = Pulls(host_id, transport=transport, max_message=max_message, host=host, engine=engine,
                           tcp_pull_max=tcp_pull_max, poll_s=poll_s, counters=self.counters,
                           check_proof=None if cluster_key is None else cluster_key.check_holder_proof,
                           prove=None if cluster_key is None else cluster_key.reader_proof)
        #: same-host nodes' cxl arenas, read in place (only inside ``allowed_dirs``)
        self.arenas = SameHostArenas(host_id, node_id, allowed_dirs, self.counters)
        self.location_cache_size = location_cache_size
        self._locations: OrderedDict[bytes, list[LocatedReplica]] = OrderedDict()  # key -> replicas, LRU
        #: node ids the master last reported alive (None until the first report), and those it
        #: reported alive once and no longer does (LRU): a replica on a gone node is skipped, and
        #: a pull from it is abandoned as soon as it is known gone. A node that joined since the
        #: last report is not gone: the master names only alive nodes' replicas.
        self._alive_nodes: set[str] | None = None
        self._gone_nodes: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()
        # Speculative pulls (:meth:`speculate`): the replica last pulled from, and how well
        # guessing it has done lately (a hit adds one, a wasted guess takes two; off at zero).
        self._last_holder: LocatedReplica | None = None
        self._speculation_score = _SPECULATION_MAX_SCORE // 2
        self._speculation_skipped = 0
        #: keys deleted through this process (LRU): never guessed, so this process's own delete
        #: is a miss at once even with unconfirmed speculative pulls
        self._deleted: OrderedDict[bytes, None] = OrderedDict()

    def ordered(self, replicas: list[LocatedReplica] | None) -> list[LocatedReplica]:
        """Same-host replicas first (no network), then by tier: ``cxl`` (read in place), memory
        (``dram``, ``hbm``), ``nvme`` last (a disk read before the send); never this node's own."""
        return self._order(replicas or [])

    def _order(self, replicas: list[LocatedReplica]) -> list[LocatedReplica]:
        """:meth:`ordered` of a list."""
        others = [r for r in replicas if self.node_id is None or r.node_id != self.node_id]
        if len(others) < 2:
            return others
        return sorted(others, key=lambda r: (r.host_id != self.host_id, _TIER_ORDER.get(r.tier, len(_TIER_ORDER))))

    def read(self, key: bytes, replicas: list[LocatedReplica] | None, layers: Any, out: Any,
             out_view: OutView, source: str = "master",
             skip: Mapping[str, str] | None = None) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact, or None.

        Raises LayerRangeError / OutBufferError for the caller's mistakes (the
        same on every replica); every other failure moves on to the next replica.
        ``source``: the locator that found ``replicas``
        (:mod:`kvpool.cluster.node.locators`): a miss the master's answer ends in is counted
        by reason, a remembered location by whether it still held, a same-host index's by
        its retries. Replicas that served are remembered (:meth:`remembered`) unless a
        same-host index found them. ``skip``: node ids already known to fail now, with the
        miss reason each counts as. ``replicas``: as
        :func:`~kvpool.cluster.node.located.located_replicas` gives them (None: the master
        listed none; empty: every record it sent was malformed).
        """
        if source == "same_host" and replicas and len(replicas) == 1:
            return self._read_found_in_place(key, replicas[0], layers, out, out_view)
        counted = source == "master"
        if replicas is None:
            self.counters["miss_absent"] += counted
            return None
        if not replicas:
            self.counters["miss_malformed"] += counted
            return None
        return self._read_ordered(key, self._order(replicas), layers, out, out_view, source, skip)

    def _read_found_in_place(self, key: bytes, replica: LocatedReplica, layers: Any, out: Any,
                             out_view: OutView) -> np.ndarray | None:
        """:meth:`read` of the one replica a same-host index found (the common single-key case,
        kept short): read in place against the header found, verified; None (a same-host retry)
        when it changed since."""
        spec: ObjectSpec = replica.spec
        layer_range = LayerRange.resolve(layers, spec.layers)
        arr, buf = out_view(spec, layer_range, out)
        try:
            self.arenas.at(replica.location).read_layers_into(replica.location["offset"], replica.header,
                                                              layer_range, buf, verify=True)
        except (errors.KVPoolError, OSError) as exc:  # freed or reused since the index was read: ask on
            log.debug("same-host read of %s failed: %s", key.hex(), exc)
            self.counters["same_host_retries"] += 1
            return None
        counters = self.counters
        counters["hits_same_host"] += 1
        counters["bytes_pulled"] += len(buf)
        return arr

    def _read_ordered(self, key: bytes, replicas: list[LocatedReplica], layers: Any, out: Any,
                      out_view: OutView, source: str, skip: Mapping[str, str] | None) -> np.ndarray | None:
        """:meth:`read` of checked replicas in the order :meth:`ordered` gives."""
        failed: set[str] = set()
        arr = self._first_intact(key, replicas, layers, out, out_view, count_misses=source == "master",
                                 failed=failed, skip=skip)
        if source == "cache":  # a remembered location: counted as such, forgotten when it failed
            self.counters["location_cache_hits" if arr is not None else "location_cache_stale"] += 1
            if arr is None:
                self.forget(key)
        elif source == "same_host":  # freed or reused since the index was read: ask on
            if arr is None:
                self.counters["same_host_retries"] += 1
            return arr
        if arr is not None:
            self._remember(key, [r for r in replicas if r.node_id not in failed] if failed else replicas)
        return arr

    def _remember(self, key: bytes, replicas: list[LocatedReplica]) -> None:
        """Where ``key`` was read from, for :meth:`read_cached` (LRU, ``location_cache_size``):
        checked replicas, in :meth:`ordered`'s order."""
        if not self.location_cache_size:
            return
        with self._lock:
            self._locations[key] = replicas
            self._locations.move_to_end(key)
            if len(self._locations) > self.location_cache_size:
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
        current = [r for r in replicas if ClusterKey.token_expiry_s(r.token) > soon]
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
        return None if current is None else self._read_ordered(key, current, layers, out, out_view, "cache", None)

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
            gone = self._gone_nodes
            for node_id in (self._alive_nodes or set()) - alive:
                gone[node_id] = None
            for node_id in alive:
                gone.pop(node_id, None)
            while len(gone) > _GONE_REMEMBERED:
                gone.popitem(last=False)
            self._alive_nodes = set(alive)
            for key in list(self._locations):
                replicas = self._locations[key]
                keep = [r for r in replicas if r.node_id in alive]
                if not keep:
                    del self._locations[key]
                elif len(keep) != len(replicas):
                    self._locations[key] = keep

    def holder_alive(self, replica: LocatedReplica) -> bool:
        """False once the holder is known gone: the master no longer lists it alive, or (same
        host) its cxl arena's owner lock is free. Cheap; asked while a pull waits."""
        node_id = replica.node_id
        if node_id in self._gone_nodes:
            return False
        return self.arenas.owner_alive(node_id) is not False

    def _first_intact(self, key: bytes, replicas: list[LocatedReplica], layers: Any, out: Any,
                      out_view: OutView, *, count_misses: bool, failed: set[str] | None = None,
                      skip: Mapping[str, str] | None = None) -> np.ndarray | None:
        """The layers from the first replica that delivers them intact; ``failed`` collects the
        node ids of replicas that failed (dead, frozen, evicted, corrupt) on the way."""
        for replica in replicas:
            reason = None
            known = skip.get(replica.node_id) if skip else None
            # (a replica found in a same-host index was found in its live owner's arena just now)
            if known is not None or (not replica.in_place_only and not self.holder_alive(replica)):
                reason = known or "holder_gone"
                if failed is not None:
                    failed.add(str(replica.node_id))
                if count_misses:
                    self.counters[f"miss_{reason}"] += 1
                continue
            try:
                spec: ObjectSpec = replica.spec
                layer_range = LayerRange.resolve(layers, spec.layers)
                arr, buf = out_view(spec, layer_range, out)
                self.read_into(key, replica, layer_range, buf)
                self._hit(len(buf), replica)
                return arr
            except (errors.LayerRangeError, errors.OutBufferError):
                raise
            except (ValueError, TypeError, KeyError, IndexError, OverflowError, errors.KVPoolError) as exc:
                reason = self._reason_of(key, replica, exc)
            if failed is not None:
                failed.add(str(replica.node_id))
            if count_misses:
                self.counters[f"miss_{reason}"] += 1
        return None

    def read_many(self, keys: list[bytes], replicas: list[list[LocatedReplica] | None], layers: Sequence[Any],
                  out_view: OutView, outs: Sequence[Any], source: str = "master",
                  landed: Callable[[int, np.ndarray | None], None] | None = None,
                  skip: dict[str, str] | None = None) -> list[np.ndarray | None]:
        """``read`` for many keys (``layers``: each key's; results in order; ``source`` as
        :meth:`read` takes it): every key's first
        choice of replica that must be pulled is pulled in one :meth:`PullClient.pull_many` (all
        in flight at once, driven by this thread); same-host in-place reads, keys whose first
        choice failed and keys without a usable replica take the one-key path. ``landed(i,
        result)``: told each key's result once, as soon as it is final: a TCP pull's the moment
        its last layer is verified, while the pulls behind it are still arriving (an error the
        callback raises is raised here once every pull is done). ``skip``: node ids known to
        fail now, with the miss reason each counts as (see :meth:`read`).

        ``source`` "guess" (:class:`~kvpool.cluster.node.locators.LastHolder`): each key's one
        replica is a guess, pulled only over TCP from a holder that proves the cluster key, with
        no token, and used when the holder's header is whole, names the key, has the guessed
        spec and every layer matches it (:meth:`accept`'s rule). A key the guess does not fit
        (``layers`` or ``out`` of another spec, deleted through this process) is not pulled,
        and no failure is final: each such key stays None for the next locator (told nothing),
        and a holder that failed as one (dead, timed out) is added to ``skip``."""
        guessed = source == "guess"
        results: list[np.ndarray | None] = [None] * len(keys)
        told = [False] * len(keys)
        raised: list[BaseException] = []

        def tell(i: int, arr: np.ndarray | None) -> None:
            if landed is None or told[i]:
                return
            told[i] = True
            try:
                landed(i, arr)
            except BaseException as exc:  # not in the middle of a pull's receive: raised at the end
                raised.append(exc)

        alone: list[tuple[int, dict[str, str] | None]] = []  # read one by one, skipping these nodes
        batch: list[tuple[int, LocatedReplica, np.ndarray, ArrivalCheck]] = []
        if source == "same_host":  # what the same-host indexes found, copied per arena at once
            self._read_many_found_in_place(replicas, layers, outs, out_view, results, tell)
        for i, (located, out) in enumerate(zip(replicas, outs)):
            if source == "same_host":
                if results[i] is None and located and len(located) != 1:
                    alone.append((i, skip or None))
                continue
            first = self._first_to_pull(located)
            if guessed:
                item = self._guess_of(keys[i], first, layers[i], out, out_view)
                if item is not None:
                    batch.append((i, *item))
                continue
            if first is None or (skip and first.node_id in skip):
                alone.append((i, skip or None))
                continue
            spec: ObjectSpec = first.spec
            layer_range = LayerRange.resolve(layers[i], spec.layers)
            arr, buf = out_view(spec, layer_range, out)
            batch.append((i, first, arr, located_check(keys[i], first, layer_range, buf)))
        if landed is not None:
            for i, _, arr, check in batch:
                check.landed = lambda i=i, arr=arr: tell(i, arr)
        if batch:
            pulled = self._pull_many([
                PullRequest(replica.peer, keys[i], check.layer_range, check.buf,
                            token=replica.token, header_out=check.raw_header,
                            alive=lambda replica=replica: self.holder_alive(replica), progress=check)
                for i, replica, _, check in batch])
            wasted = 0
            for (i, replica, arr, check), outcome in zip(batch, pulled):
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    check.finish()
                except (errors.LayerRangeError, errors.OutBufferError):
                    if not guessed:
                        raise
                    wasted += 1
                    continue
                except Exception as exc:  # this replica failed: the others, one by one
                    if guessed:
                        wasted += 1
                        failure = self._holder_failure(exc)
                        if failure is not None and skip is not None:
                            skip[replica.node_id] = failure
                        continue
                    alone.append((i, {**(skip or {}), replica.node_id: self._reason_of(keys[i], replica, exc)}))
                    continue
                self._hit(len(check.buf), replica)
                self._pulled_from(replica)
                if guessed:
                    self.counters["speculative_hits"] += 1
                    self.counters["speculative_unconfirmed"] += 1
                else:
                    if source == "cache":
                        self.counters["location_cache_hits"] += 1
                    self._remember(keys[i], self.ordered(replicas[i]))
                results[i] = arr
                tell(i, arr)
            if guessed:
                self._guessed_batch(len(batch) - wasted, wasted)
        for i, skipping in sorted(alone, key=lambda item: item[0]):
            results[i] = self.read(keys[i], replicas[i], layers[i], outs[i], out_view, source, skip=skipping)
            tell(i, results[i])
        if raised:
            raise raised[0]
        return results

    def _guess_of(self, key: bytes, replica: LocatedReplica | None, layers: Any, out: Any,
                  out_view: OutView) -> tuple[LocatedReplica, np.ndarray, ArrivalCheck] | None:
        """What :meth:`read_many` pulls of ``key`` from a guessed holder, or None when the guess
        does not fit (see there)."""
        if replica is None or key in self._deleted:
            return None
        spec: ObjectSpec = replica.spec
        try:
            layer_range = LayerRange.resolve(layers, spec.layers)
            arr, buf = out_view(spec, layer_range, out)
        except errors.KVPoolError:  # not the guessed spec: the next locator says what is wrong
            return None
        if self.pulls.proving_client(replica.peer, len(buf)) is None:
            return None
        return replica, arr, guessed_check(key, replica, layer_range, buf)

    @staticmethod
    def _holder_failure(exc: BaseException) -> str | None:
        """The miss reason a guessed holder's failure counts as when it failed as a holder (dead,
        frozen, the connection lost); None when it only did not have the key, or not as guessed."""
        if isinstance(exc, errors.KVTimeoutError):
            return "timeout"
        if isinstance(exc, (errors.RemoteMissError, errors.LayerRangeError, errors.OutBufferError,
                            errors.ProtocolError, errors.AuthenticationError, errors.WrongObjectError,
                            errors.ChecksumError, errors.FormatError)) or Pulls.path_unusable(exc):
            return None
        return "holder_gone"

    def _guessed_batch(self, used: int, wasted: int) -> None:
        """Score a batch of guessed pulls as one guess: a hit (one up) when at least half of them
        were used, else a miss (two down), so a reader whose keys moved to other holders soon
        stops guessing, and one whose batches are mostly on one holder keeps on."""
        if wasted:
            self.counters["speculative_wasted"] += wasted
        if used < wasted:
            self._speculation_score -= 2
        elif used and self._speculation_score < _SPECULATION_MAX_SCORE:
            self._speculation_score += 1

    def _read_many_found_in_place(self, replicas: Sequence[list[LocatedReplica] | None], layers: Sequence[Any],
                                  outs: Sequence[Any], out_view: OutView, results: list[np.ndarray | None],
                                  tell: Callable[[int, np.ndarray | None], None]) -> None:
        """:meth:`_read_found_in_place` of every key a same-host index found (one replica
        each), one :meth:`CxlArenaReader.read_many_into` per arena: each copy verified against
        the header found, a failed one (freed or reused since) left None in ``results``."""
        arenas: dict[int, tuple[Any, list[tuple[int, int, Any, LayerRange, np.ndarray, memoryview]]]] = {}
        for i, located in enumerate(replicas):
            if not located or len(located) != 1:
                continue
            replica = located[0]
            layer_range = LayerRange.resolve(layers[i], replica.spec.layers)
            arr, buf = out_view(replica.spec, layer_range, outs[i])
            try:
                reader = self.arenas.at(replica.location)
            except (errors.KVPoolError, OSError) as exc:
                log.debug("same-host arena of %s: %s", replica.node_id, exc)
                self.counters["same_host_retries"] += 1
                continue
            arenas.setdefault(id(reader), (reader, []))[1].append(
                (i, replica.location["offset"], replica.header, layer_range, arr, buf))
        counters = self.counters
        for reader, items in arenas.values():
            try:
                ok = reader.read_many_into([(offset, header, layer_range) for _, offset, header, layer_range, _, _
                                            in items], [buf for *_, buf in items])
            except (errors.KVPoolError, OSError) as exc:  # the arena went away meanwhile: ask on
                log.debug("same-host read of %d objects failed: %s", len(items), exc)
                ok = [False] * len(items)
            for (i, _, _, _, arr, buf), intact in zip(items, ok):
                if not intact:
                    counters["same_host_retries"] += 1
                    continue
                counters["hits_same_host"] += 1
                counters["bytes_pulled"] += len(buf)
                results[i] = arr
                tell(i, arr)

    def _first_to_pull(self, located: list[LocatedReplica] | None) -> LocatedReplica | None:
        """The replica a one-key read would try first, if it is to be pulled (not read in place
        from a same-host arena) and its holder is alive; else None."""
        ordered = self.ordered(located)
        if not ordered:
            return None
        first = ordered[0]
        if first.host_id == self.host_id and first.tier == "cxl" and first.location:
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
            log.info("replica of %s on %s refused the pull: %s", key.hex(), replica.node_id, exc)
            return "unauthorized"
        if isinstance(exc, (errors.TransferError, errors.FormatError, errors.TierError)):
            log.info("replica of %s on %s failed: %s", key.hex(), replica.node_id, exc)
            return "holder_gone"
        # what the master said about this replica does not add up (header, location)
        log.warning("replica of %s on %s is malformed: %s: %.200s", key.hex(), replica.node_id,
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
        spec: ObjectSpec = replica.spec
        header_sum = replica.header_sum
        location = replica.location
        if replica.host_id == self.host_id and replica.tier == "cxl" and location:
            try:
                reader = self.arenas.at(location)
                header: ObjectHeader = replica.header if replica.in_place_only \
                    else reader.header_at(location["offset"], key, header_sum, spec)
                check_same(header, same_as, layer_range)
                reader.read_layers_into(location["offset"], header, layer_range, buf, verify=True)
                if not replica.in_place_only:
                    self.counters["reads_in_place"] += 1
                return header
            except (errors.KVPoolError, OSError) as exc:  # moved or reused since located: pull instead
                if replica.in_place_only:  # no token to pull with: the next locator decides
                    log.debug("same-host read of %s failed: %s", key.hex(), exc)
                    if isinstance(exc, OSError):
                        raise errors.TierError(f"same-host arena of {replica.node_id}: {exc}") from exc
                    raise
                log.debug("in-place read of %s failed (%s); pulling", key.hex(), exc)
        check = located_check(key, replica, layer_range, buf, same_as)
        self._pull(key, replica, layer_range, buf, check.raw_header, replica.token, check)
        header = check.finish()
        self._pulled_from(replica)
        return header

    def _pull(self, key: bytes, replica: LocatedReplica, layer_range: LayerRange, buf: memoryview,
              raw_header: bytearray, token: bytes, check: ArrivalCheck | None = None) -> None:
        """Pull ``layer_range`` of ``key`` from ``replica``'s holder into ``buf`` with its header
        (unverified, or checked as it arrives by ``check``), abandoned as soon as the holder is
        known gone."""
        self.pulls.pull(replica.peer, key, layer_range, buf, token=token,
                        header_out=raw_header, progress=check, alive=lambda: self.holder_alive(replica),
                        timeout_s=self.pull_timeout_s)

    def _pull_many(self, requests: list[PullRequest]) -> list[int | BaseException]:
        """Pulls in flight together (:meth:`Pulls.pull_many`): one result per request, the bytes
        received or the error."""
        return self.pulls.pull_many(requests, timeout_s=self.pull_timeout_s)

    def _pulled_from(self, replica: LocatedReplica) -> None:
        """Count a verified pull; its holder is the next speculative guess."""
        self.counters["pulls"] += 1
        self._last_holder = replica

    def _hit(self, nbytes: int, replica: LocatedReplica) -> None:
        self.counters["hits_same_host" if replica.in_place_only else "hits_remote"] += 1
        self.counters["bytes_pulled"] += nbytes

    # -- speculative pulls -------------------------------------------------------------------

    def speculate(self, key: bytes, layers: Any, out: Any) -> Speculation | None:
        """A pull of ``key`` to start from the node this reader last pulled from, before the
        master has said where ``key`` is (:meth:`run`, then :meth:`confirm` or :meth:`accept`),
        or None: nothing pulled yet, the guesses have kept missing lately, that node is gone, or
        ``layers`` (or ``out``'s size) do not fit the last object's spec (the guess is that
        ``key`` has the same one). ``out`` is taken by :meth:`Speculation.bind`.

        A reader that keeps reading from one holder (a decode node reading what its prefill
        node wrote) then pays max(locate, pull) instead of their sum.
        """
        if key in self._deleted:
            return None
        replica = self.guessed_holder()
        if replica is None:
            return None
        spec: ObjectSpec = replica.spec
        try:
            layer_range = LayerRange.resolve(layers, spec.layers)
        except errors.KVPoolError:  # not this spec: the located read will say what is wrong
            return None
        guess = Speculation(key, replica, layer_range)
        if out is not None and getattr(out, "nbytes", guess.nbytes) != guess.nbytes:
            return None  # (out is checked in full by bind)
        return guess

    def guessed_holder(self) -> LocatedReplica | None:
        """The node to guess a key is on (the one this reader last pulled from, as it was located
        then: its spec is the guess of the key's), or None: nothing pulled yet, the guesses have
        kept missing lately (then one in every ``_SPECULATION_RETRY_EVERY`` tries guesses
        again), or that node is gone."""
        replica = self._last_holder
        if replica is None:
            return None
        if self._speculation_score <= 0:
            self._speculation_skipped += 1
            if self._speculation_skipped < _SPECULATION_RETRY_EVERY:
                return None
            self._speculation_skipped, self._speculation_score = 0, 1
        return replica if self.holder_alive(replica) else None

    def provable(self, guess: Speculation) -> bool:
        """Whether ``guess`` would be pulled over TCP from a holder that must first prove it holds
        the cluster key: only such a pull may be used as the holder answers (:meth:`accept`).
        (A UCX endpoint proves nothing: whatever took over a dead holder's address would be
        believed.) This reader proves the key to that holder in turn, so the pull needs no token."""
        return self.pulls.proving_client(guess.replica.peer, guess.nbytes) is not None

    def run(self, guess: Speculation, token: bytes) -> None:
        """Pull the guessed bytes into the buffer :meth:`Speculation.bind` took (unverified until
        :meth:`confirm`); never raises a kvpool error."""
        try:
            self._pull(guess.key, guess.replica, guess.layer_range, guess.buf, guess.raw_header, token)
            guess.pulled = True
        except errors.KVPoolError as exc:
            self._guess_failed(guess, exc)

    def run_proven(self, guess: Speculation, out: Any, out_view: OutView) -> None:
        """Pull the guessed bytes over TCP from a holder that proves itself (see :meth:`provable`;
        no token), checked as they arrive, for :meth:`accept`; never raises a kvpool error. The
        request goes out first: ``out`` is bound (:meth:`Speculation.bind`) while the holder
        answers. Not pulled at all if its TCP port is unusable or ``out`` does not fit."""
        replica = guess.replica
        client = self.pulls.proving_client(replica.peer, guess.nbytes)
        if client is None:  # no longer provable (its TCP port just proved unusable): locate decides
            return
        try:
            sent = client.start(replica.peer, guess.key, guess.layer_range, guess.nbytes,
                                timeout_s=self.pull_timeout_s)
            try:
                if not guess.bind(out, out_view):
                    raise errors.OutBufferError("out does not fit the guessed spec")
            except BaseException:
                sent.cancel()  # its reply is never read
                raise
            sent.finish(guess.buf, guess.raw_header, progress=guess.check, alive=lambda: self.holder_alive(replica))
            guess.pulled = guess.proven = True
        except errors.KVPoolError as exc:
            self._guess_failed(guess, exc)

    def _guess_failed(self, guess: Speculation, exc: errors.KVPoolError) -> None:
        """Keep why a guessed pull failed on the guess (or nothing, for locate to decide)."""
        node_id = guess.replica.node_id
        log.debug("speculative pull of %s from %s: %s", guess.key.hex(), node_id, exc)
        guess.failure = self._holder_failure(exc)  # None: locate decides

    def accept(self, guess: Speculation) -> np.ndarray | None:
        """The guessed holder's own answer, without the master (``node.confirm_speculative =
        false``): the pulled layers if a holder that proved itself sent them (:meth:`run_proven`),
        its header is whole, names ``guess.key``, has the guessed spec, and every layer matches
        it; else None (the guess is wasted: locate and read as usual).

        What this gives up against :meth:`confirm` is only how soon another process's delete
        shows: a holder keeps a deleted key until its next heartbeat, as a remembered location
        or a same-host arena does. The bytes are the key's, whole, in every case.
        """
        if guess.pulled and guess.proven:
            try:
                guess.check.finish()
            except errors.KVPoolError as exc:  # another object or damaged: read as located
                log.info("speculative pull of %s from %s not used: %s", guess.key.hex(),
                         guess.replica.node_id, exc)
            else:
                self.counters["speculative_unconfirmed"] += 1
                self._pulled_from(guess.replica)
                return self._guess_used(guess)
        self._guess_wasted()
        return None

    def _guess_used(self, guess: Speculation) -> np.ndarray:
        if self._speculation_score < _SPECULATION_MAX_SCORE:
            self._speculation_score += 1
        counters = self.counters
        counters["speculative_hits"] += 1
        counters["hits_remote"] += 1
        counters["bytes_pulled"] += guess.nbytes
        return guess.arr

    def _guess_wasted(self) -> None:
        self._speculation_score -= 2
        self.counters["speculative_wasted"] += 1

    def confirm(self, guess: Speculation, located: list[LocatedReplica] | None) -> np.ndarray | None:
        """The speculatively pulled layers, if the master located ``guess.key`` on the guessed
        node with the same spec and header checksum and every layer matches that header;
        else None (the guess is wasted: read the located replicas as usual)."""
        replicas = located or []
        for replica in replicas:
            if not guess.pulled or replica.node_id != guess.replica.node_id:
                continue
            spec: ObjectSpec = replica.spec
            if spec != guess.replica.spec:
                break
            try:
                located_check(guess.key, replica, guess.layer_range, guess.buf,
                              raw_header=guess.raw_header).finish()
            except errors.KVPoolError as exc:  # another version, or damaged: read as located
                log.info("speculative pull of %s from %s not used: %s", guess.key.hex(), replica.node_id, exc)
                break
            self._pulled_from(replica)
            self._remember(guess.key, self._order(replicas))
            return self._guess_used(guess)
        self._guess_wasted()
        return None

    def stats(self) -> dict[str, Any]:
        return {**self.counters, **self.pulls.stats()}

    def close(self) -> None:
        self.pulls.close()
        self.arenas.close()
