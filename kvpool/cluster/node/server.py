"""A cluster node: local tiers made visible to the pool.

Owns the glue between one process's :class:`tiers.manager.TierManager` and the
cluster: it serves pulls of ``(key, layer range)`` straight out of tier memory
(:class:`kvpool.transport.PullServer`), keeps the master's index in step with
what the tiers hold (moves and removals are published in batches from a
background thread; puts are published by the pool with a two-phase
reserve/commit), heartbeats on its own thread, re-registers everything after a
master restart, asks the master before the bottom tier drops an object a
remote reader holds a lease on, and accepts replication requests for durable
puts on a small ZeroMQ control socket.

It never decides placement (the master does) and never reads KV bytes except
to serve or replicate them.
"""

from __future__ import annotations

import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import json
import logging
import os
import queue
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from kvpool import errors
from kvpool.cluster.node import durable_log
from kvpool.cluster.node.heartbeat import Heartbeater
from kvpool.cluster.node.recent import RecentChanges
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.affinity import io_threads_anywhere
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.cluster.wire.protocol import ReplicaRecord, replica_record
from kvpool.cluster.wire.security import ClusterKey
from kvpool.config import Config, node_host
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec
from kvpool.transport import (
    Engine,
    PeerAddress,
    ProviderWouldBlock,
    PullRequest,
    Pulls,
    PullServer,
    ServeSource,
    TcpPullServer,
    in_inline_provider,
    local_host_id,
    plausible_worker_address,
    ucx_interface_options,
)
from kvpool.transport.puller import SAME_HOST_TCP_PULL_MAX
from kvpool.transport.tcp.admission import raise_descriptor_limit
from tiers.base import Extent, Tier
from tiers.entries import LockBusy
from tiers.manager import TierManager

DURABLE_LOG_SLACK = 4096  # durable.log lines appended before it is compacted, at least

log = logging.getLogger("kvpool.node")

_PUBLISH_BATCH = 512
#: how often a node closes the pooled pull connections (of its replicas' pulls) whose holder hung up
PEER_SWEEP_S = 2.0
#: a pooled connection idle this long, its holder silent (a host gone without closing it), has
#: the node ask the master which nodes are alive, and close those to the others
PEER_ASK_IDLE_S = 10.0
#: the UCX pull server's counters (:meth:`PullServer.stats`), all 0 before UCX has started
_UCX_COUNTERS = ("bytes_sent", "messages_sent", "requests_served", "misses", "errors", "refused", "in_flight")


@dataclass(frozen=True)
class NodeAddress:
    """How peers reach a node: UCX pulls, and the control socket for replication.

    Published to the master as one opaque string (JSON), so the master needs
    to know nothing about transports.
    """

    peer: PeerAddress
    control: str
    #: the node's cxl arena (path, instance) if it has one: same-host readers map it
    arena: dict[str, str] | None = None

    def encode(self) -> str:
        return json.dumps({
            "ucx": [self.peer.host, self.peer.port],
            "tcp": self.peer.tcp_port,
            "worker": base64.b64encode(self.peer.worker_address).decode(),
            "host_id": self.peer.host_id,
            "control": self.control,
            "arena": self.arena,
        }, separators=(",", ":"))

    @classmethod
    def decode(cls, text: str) -> NodeAddress:
        address = cls.parse(text)
        if address is None:
            raise errors.ProtocolError(f"unreadable node address {text[:300]!r}")
        return address

    @classmethod
    def parse(cls, text: str) -> NodeAddress | None:
        """The address in ``text`` (as the master relays it from any node), or None if any part
        is malformed: checked before UCX or a socket sees it."""
        try:
            data = json.loads(text)
            host, port = data["ucx"]
            tcp_port = data.get("tcp", 0)
            worker = base64.b64decode(data["worker"], validate=True)
            host_id, control, arena = data["host_id"], data["control"], data.get("arena")
        except (ValueError, KeyError, TypeError, binascii.Error, RecursionError):
            return None
        if not isinstance(host, str) or not 0 < len(host) <= 255 or not _is_port(port) or not _is_port(tcp_port):
            return None
        if worker and not plausible_worker_address(worker):
            return None
        if not isinstance(host_id, str) or len(host_id) > 1024 or not isinstance(control, str) \
                or len(control) > 1024:
            return None
        if arena is not None and not (isinstance(arena, dict) and isinstance(arena.get("path"), str)
                                      and isinstance(arena.get("instance"), str) and len(arena["instance"]) <= 256
                                      and 0 < len(arena["path"]) <= 4096):
            return None
        return cls(PeerAddress(host, port, worker, host_id, tcp_port), control, arena)


def ucx_reachable(peer: PeerAddress) -> bool:
    """Whether ``peer`` has published a UCX way in (a listener port or a worker address): a node
    whose UCX is still starting has not, and is pulled from over TCP whatever the size."""
    return bool(peer.port or peer.worker_address)


def alive_peers_of(master_stats: Any) -> list[PeerAddress] | None:
    """Where the nodes the master's stats list as alive serve pulls; None when the stats are
    unreadable (then no pooled connection is taken for one to a departed node)."""
    nodes = master_stats.get("nodes") if isinstance(master_stats, dict) else None
    if not isinstance(nodes, dict):
        return None
    peers = []
    for node in nodes.values():
        if isinstance(node, dict) and node.get("alive") is True and isinstance(node.get("address"), str):
            address = NodeAddress.parse(node["address"])
            if address is not None:
                peers.append(address.peer)
    return peers


def _is_port(value: Any) -> bool:
    return type(value) is int and 0 <= value < 65536


def record_for(key: bytes, tier: Tier, extent: Extent, header: ObjectHeader,
               durable: int | None = None) -> ReplicaRecord:
    """The master's replica record for an object this node holds (``durable``: a durable
    copy, with the replicas its put asked for)."""
    location = tier.location(extent)
    return replica_record(tier.name, header.spec, header.spec.total_nbytes, key=key,
                          header_sum=header.checksum(), location=location, durable=durable)


class Node:
    """Serves this process's tiers to the cluster (see the module docstring)."""

    def __init__(self, config: Config, manager: TierManager, master_address: str | None) -> None:
        self.config = config
        self.manager = manager
        self.node_id = uuid.uuid4().hex
        self.host_id = local_host_id()
        self.master_address = master_address
        self.host = node_host(config, master_address)  # what this node binds and advertises
        self.cluster_key = ClusterKey.from_config(config)
        # One ZeroMQ context for the process (its I/O thread): this node's master clients and
        # its control socket. Its I/O thread on every CPU, whatever this thread is bound to.
        self._zmq: zmq.Context[Any] = zmq.Context.instance()
        io_threads_anywhere(self._zmq)
        self.master = MasterClient(master_address, config=config, cluster_key=self.cluster_key, context=self._zmq)
        # One UCX worker and progress thread for the process (:meth:`ucx_engine`): the UCX pull
        # server's, and the pull client of a ClusterPool around this node. Made at start by a
        # storage node, a node with a UCX listener port, or one without a TCP pull port; else
        # when first wanted (importing ucxx alone takes ~0.5-1 s): see :meth:`start`.
        self.engine: Engine | None = None
        self.server: PullServer | None = None
        self._ucx_lock = threading.Lock()
        self._ucx_thread: threading.Thread | None = None
        #: a client node starts UCX once it holds an object larger than this
        self.ucx_wanted_above = min(config.node.tcp_pull_max, SAME_HOST_TCP_PULL_MAX)
        # Small pulls over plain TCP (node.tcp_pull_max): a thread per reader connection, which
        # may block in the provider, so the manager's lock is simply taken there.
        self.tcp_server = TcpPullServer(self._provide, self.host, authorize=self._authorize,
                                        prove=self.cluster_key.holder_proof,
                                        trust=self.cluster_key.check_reader_proof,
                                        poll_s=config.node.serve_poll_us * 1e-6,
                                        hello_timeout_s=config.node.hello_timeout_s,
                                        max_unproven_per_address=config.node.unproven_per_address,
                                        name=f"kvpool-tcp-{self.node_id[:8]}") if config.node.tcp_pull_max else None
        self._events: queue.Queue[tuple[str, bytes, Any]] = queue.Queue()
        #: unpins that found the manager busy on the progress thread finish here
        self._unpinner = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvpool-unpin")
        self._stopping = threading.Event()
        self._publisher = threading.Thread(target=self._publish_loop, name="kvpool-node-publish", daemon=True)
        self._register_lock = threading.Lock()  # one register at a time (heartbeat reply, put, start)
        # A put's publish and the background publisher's sends reach the master in the order
        # the tiers changed: without it, a "removed" of a key deleted and put again could be
        # sent after the new copy's publish, and the master would drop the new copy.
        self._publish_lock = threading.Lock()
        self._control_thread = threading.Thread(target=self._control_loop, name="kvpool-node-control",
                                                daemon=True)
        self._control: zmq.Socket[bytes] | None = None  # bound by start()
        self.control_address = ""  # where the master asks this node to copy replicas, once started
        self._replicator: Pulls | None = None  # the pulls of replicas copied here, made on first use
        self._replicator_lock = threading.Lock()
        self._peer_sweeper: threading.Thread | None = None  # started with the replicator
        #: control requests served: ``replicate_requests`` (one per replicate or replicate_many
        #: exchange), ``replicated_objects`` (copies committed); a departing node's hand-offs:
        #: ``adopt_requests``, ``adopted_objects`` (kept and published), ``adopt_failures``
        self.counters = Counter[str]()
        self.heartbeater: Heartbeater | None = None
        self.address: NodeAddress | None = None
        self._registered = False  # the master has answered a register at least once
        self._registered_term = 0  # the master term of the last register's answer
        # durable.log: lines appended since it was last compacted, and the copies it then named
        self._durable_appends, self._durable_held = 0, 0
        self._beat_s = self.config.master.heartbeat_ms / 1000.0  # or the master's period, if shorter
        # What this node changed at the master lately: published again after a warm takeover.
        self.recent = RecentChanges()

    # -- lifecycle -----------------------------------------------------------------

    @property
    def ucx_later(self) -> bool:
        """Whether UCX starts on a thread after :meth:`start` (see there)."""
        return getattr(self, "role", "client") != "storage" and self.tcp_server is not None \
            and not self.config.node.port

    def _bind_control(self) -> None:
        """The control socket (the master's replicate requests), on a free port of ``host``."""
        control = self._zmq.socket(zmq.ROUTER)
        control.setsockopt(zmq.LINGER, 0)
        # A larger message is dropped unread (its peer disconnected), never buffered.
        control.setsockopt(zmq.MAXMSGSIZE, self.config.master.max_request_bytes)
        self.cluster_key.secure_server(control)  # only holders of the cluster key are answered
        try:
            port = control.bind_to_random_port(f"tcp://{self.host}")
        except zmq.ZMQError:
            control.close(0)
            raise
        self._control = control
        self.control_address = f"tcp://{self.host}:{port}"

    def start(self) -> Node:
        """Serve pulls, register with the master, heartbeat.

        A client node (``kvpool.connect``) with a TCP pull port and no UCX listener port does
        not start UCX here, so that ``connect()`` does not wait for it: it registers with its
        TCP port only, and peers pull whatever it holds over TCP, whatever the size
        (:func:`ucx_reachable`). It starts UCX on a thread once it is wanted: this node holds
        an object larger than ``ucx_wanted_above`` (``node.tcp_pull_max``, at most the 1 MiB
        above which same-host readers prefer UCX's shared memory), or this process pulls over
        UCX; then it registers again, with its UCX worker address. A client that puts and
        reads only small objects never loads UCX. A storage node starts UCX before it
        registers: it registers its whole nvme index, which it should send once.
        """
        raise_descriptor_limit()  # before any socket: the pull port's cap is sized from it
        self._bind_control()
        tcp_port = self.tcp_server.start().port if self.tcp_server is not None else 0
        if self.ucx_later:
            peer = PeerAddress(self.host, 0, b"", self.host_id, tcp_port)
        else:
            self.ucx_engine()
            assert self.server is not None
            peer = dataclasses.replace(self.server.peer_address, tcp_port=tcp_port)
        arena = next((info for t in self.manager.tiers if (info := t.arena_info()) is not None), None)
        self.address = NodeAddress(peer, self.control_address, arena)
        self.manager.listener = self
        self.manager.may_drop_many = self._may_drop_many
        self._keep_durable_copies()
        self._publisher.start()
        self._control_thread.start()
        self.register()
        self.heartbeater = Heartbeater(
            lambda: MasterClient(self.master_address, config=self.config, cluster_key=self.cluster_key,
                                 context=self._zmq),
            self.node_id,
            self._beat_s, self.beat_state, self.register, self._on_delete,
            self.publish_again,
        )
        self.heartbeater.term = self._registered_term
        self.heartbeater.start()
        peer = self.address.peer
        ways = [f"TCP port {peer.tcp_port}"] if peer.tcp_port else []
        ways.append(f"UCX port {peer.port}" if peer.port else "UCX by worker address" if peer.worker_address
                    else "UCX by worker address once started")
        log.info("node %s serving pulls on %s (%s), control %s, master %s", self.node_id[:8], peer.host,
                 ", ".join(ways), self.control_address, self.master.address)
        return self

    def ucx_engine(self) -> Engine:
        """The node's UCX engine, its pull server serving: made now (waiting for a start already
        under way on the UCX thread) if it is not yet. TransferError if UCX cannot start."""
        with self._ucx_lock:
            if self.engine is None:
                if self._stopping.is_set():
                    raise errors.PoolClosedError(f"node {self.node_id[:8]} is closed")
                # The provider only pins and takes a view (or hands nvme reads to a worker), so
                # it runs on the progress thread: a thread hand-off per pull costs ~50-140 us.
                # Every pull must carry a token the master (or a key holder) minted for this
                # node; with node.port 0 there is no UCX sockaddr listener (ucxx binds those to
                # every interface): peers reach this node by its worker address, over UCX
                # transports kept on node.host.
                engine = Engine(f"kvpool-node-{self.node_id[:8]}", ucx_interface_options(self.host))
                server = PullServer(self._provide, host=self.host, port=self.config.node.port,
                                    max_message=self.config.node.max_message, inline_provider=True,
                                    name=f"kvpool-node-{self.node_id[:8]}", authorize=self._authorize,
                                    listener=bool(self.config.node.port), engine=engine)
                try:
                    server.start()
                except BaseException:
                    engine.stop(lambda: None)
                    raise
                self.engine, self.server = engine, server
            engine = self.engine
        if self.ucx_later:
            self.want_ucx()  # (made here for this process's own pulls: publish it too)
        return engine

    def want_ucx(self) -> None:
        """Start UCX on a thread (once), and then register its address (see :meth:`start`)."""
        with self._ucx_lock:
            if self._ucx_thread is None and not self._stopping.is_set():
                self._ucx_thread = threading.Thread(target=self._start_ucx_later, name="kvpool-node-ucx",
                                                    daemon=True)
                self._ucx_thread.start()

    def _want_ucx_for(self, records: list[ReplicaRecord]) -> None:
        if self.ucx_later and self._ucx_thread is None and any(
                r.get("nbytes", 0) > self.ucx_wanted_above for r in records):
            self.want_ucx()

    def _start_ucx_later(self) -> None:
        """The UCX thread: start UCX, then publish the worker address (a register: the master
        keeps one address per node). A node whose UCX cannot start keeps serving over TCP."""
        try:
            self.ucx_engine()
        except errors.KVPoolError as exc:
            if not self._stopping.is_set():
                log.warning("node %s: UCX did not start (%s): serving pulls over TCP only", self.node_id[:8], exc)
            return
        assert self.server is not None and self.address is not None
        # Under both locks: a put's publish cannot fall between the snapshot this register
        # sends and the master replacing this node's replicas with it.
        with self._register_lock, self._publish_lock:
            self.address = dataclasses.replace(
                self.address, peer=dataclasses.replace(self.server.peer_address, tcp_port=self.address.peer.tcp_port))
            if not self._registered or self._stopping.is_set():
                return  # the first register (still to come) carries it
            try:
                self._register()
            except errors.KVPoolError as exc:  # the heartbeat's next register carries it
                log.info("node %s: registering the UCX address failed: %s", self.node_id[:8], exc)

    def close(self) -> None:
        """Stop serving and withdraw this node's replicas from the master (best effort: a dead
        master learns it from missed heartbeats, and a restart's register brings them back)."""
        if self._stopping.is_set():
            return
        self._stopping.set()
        self.manager.listener = None
        self.manager.may_drop_many = None
        if self.heartbeater is not None:
            self.heartbeater.stop()
        with self._ucx_lock:  # (no UCX thread starts once stopping)
            ucx_thread = self._ucx_thread
        if ucx_thread is not None:  # its register, if under way, before the leave below
            ucx_thread.join(30.0)  # (UCX cannot be stopped while it starts)
        self._events.put(("stop", b"", None))
        for thread in (self._publisher, self._control_thread):
            if thread.is_alive():
                thread.join(5.0)
        # Deregister: readers stop locating replicas here now, not after the heartbeat
        # timeout, and the master logs a departure (and re-replicates durable keys), not a death.
        # A node the master never registered (it did not answer) has nothing to withdraw: no
        # second wait on an unreachable master.
        try:
            if self._registered:
                withdrawn = self.master.leave(self.node_id, timeout_s=1.0)
                log.info("node %s left the master: %d replicas withdrawn", self.node_id[:8], withdrawn)
        except errors.KVPoolError as exc:
            log.info("node %s could not deregister from the master on close: %s", self.node_id[:8], exc)
        if self._control is not None:
            self._control.close(0)
        if self._peer_sweeper is not None:  # before the master client closes: it may be asking it
            self._peer_sweeper.join(self.master.request_timeout_s + 1.0)
        if self._replicator is not None:
            self._replicator.close()
        if self.tcp_server is not None:
            self.tcp_server.close()
        with self._ucx_lock:  # (no new engine once stopping)
            if self.server is not None:
                self.server.close()
            if self.engine is not None:
                self.engine.stop(lambda: None)  # after every server and client on it closed
        self._unpinner.shutdown(wait=True)
        self.master.close()

    # -- master bookkeeping -----------------------------------------------------------

    def tier_state(self) -> dict[str, dict[str, int]]:
        return {t.name: {"capacity": t.capacity_bytes, "free": t.free_bytes} for t in self.manager.tiers}

    def beat_state(self) -> dict[str, dict[str, int]]:
        """:meth:`tier_state` for a heartbeat, which also touches this node's shared arena
        (``CxlTier.mark_in_use``): an arena touched lately is spared by other processes' start-up
        collection for a while after this node died, for the master's rescue."""
        for tier in self.manager.tiers:
            mark = getattr(tier, "mark_in_use", None)
            if mark is not None:
                mark()
        return self.tier_state()

    def register(self) -> None:
        """Tell the master this node exists, what it is and everything it holds (one message).

        ``role`` is ``storage`` for a ``kvpool-server`` node (the class attribute of
        :class:`kvpool.cli.serve.StorageNode`), else ``client``; only storage nodes with a
        persistent tier receive durable copies. Durable copies this node holds in a
        persistent tier are sent with ``durable`` (read from ``durable.log`` beside the
        tier's index, appended by :meth:`_replicate`), so the master knows them as
        durable again after a restart of either.
        """
        with self._register_lock:
            self._register()

    def publish(self, records: list[ReplicaRecord]) -> None:
        """Announce objects this node just stored (one round trip). When the master does not
        know this node (it restarted, or a new HA leader took over, and this node's
        re-registration is still to come), register everything now instead: the register
        carries these records too, so they are visible when this returns either way."""
        self._want_ucx_for(records)
        deadline = time.monotonic() + self.master.request_timeout_s
        try:
            with self._publish_lock_until(deadline):
                try:
                    self.master.publish(self.node_id, records, timeout_s=max(0.0, deadline - time.monotonic()))
                finally:  # also when it failed: the master may have taken it before it went
                    self.recent.note(r["key"] for r in records)
        except errors.UnknownNodeError:
            log.info("node %s: the master does not know this node (restarted or failed over): registering",
                     self.node_id[:8])
            self.register()

    @contextlib.contextmanager
    def _publish_lock_until(self, deadline: float) -> Iterator[None]:
        """``_publish_lock``, waited for until ``deadline`` at most: a put's publish queued behind
        others that wait on an unreachable master fails within its own deadline
        (MasterUnreachableError), not after all of theirs."""
        if not self._publish_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise errors.MasterUnreachableError(
                f"node {self.node_id[:8]}: earlier changes still wait for the master at {self.master.address} "
                f"after {self.master.request_timeout_s:.3g} s")
        try:
            yield
        finally:
            self._publish_lock.release()

    def publish_again(self, since: float) -> None:
        """Publish again, as the tiers hold them now, the keys this node changed at the master at
        or after ``since`` (this clock): a master that took over warm may have missed them (see
        :mod:`kvpool.cluster.node.recent`). Registers everything if it does not remember that far."""
        keys = self.recent.since(since)
        if keys is None:
            log.info("node %s: the new master leader asks for %.1f s of changes, more than this node remembers "
                     "or reaching back before its last register: registering everything", self.node_id[:8],
                     time.monotonic() - since)
            self.register()
            return
        with self._publish_lock:
            durable = self._durable_counts() if keys else {}
            records: list[ReplicaRecord] = []
            gone: list[bytes] = []
            for key in keys:
                found = self.manager.describe(key)
                if found is None:
                    gone.append(key)
                else:
                    # (a durable copy may be read from a higher tier now, its disk copy the backing)
                    kept = found[0].persistent or self.manager.is_durable(key)
                    records.append(record_for(key, *found, durable.get(key) if kept else None))
            if gone:
                self.master.removed(self.node_id, gone)
            if records:
                self.master.publish(self.node_id, records)
        self.counters["published_again"] += len(keys)
        log.info("node %s: published again %d objects and %d removals changed in the last %.2f s, which the new "
                 "master leader may have missed", self.node_id[:8], len(records), len(gone),
                 time.monotonic() - since)

    def _keep_durable_copies(self) -> None:
        """At start: the durable copies ``durable.log`` names are never evicted for room (see
        :meth:`TierManager.protect`); those a persistent tier dropped at open (they lay beyond a
        capacity lowered since) are counted in ``durable_dropped`` and named in the log."""
        durable = self._durable_counts()
        if not durable:
            return
        kept = self.manager.protect(list(durable))
        for tier in self.manager.tiers:
            path = getattr(tier, "path", None)
            if tier.persistent and tier.capacity_bytes > 0 and path is not None:
                self._compact_durable_log(path)
        dropped = [key for tier in self.manager.tiers for key in getattr(tier, "dropped_keys", ()) if key in durable]
        if dropped:
            self.manager.counters["durable_dropped"] += len(dropped)
            log.warning("node %s: %d durable copies lay beyond the persistent tier's (smaller) capacity and are "
                        "gone from here (first: %s); the master copies them again from another holder if one "
                        "exists", self.node_id[:8], len(dropped), dropped[0][:32].hex())
        log.info("node %s: %d durable copies held (never evicted for room)", self.node_id[:8], kept)

    def _compact_durable_log(self, path: str) -> None:
        """Rewrite ``path``/durable.log to the durable copies this node still holds: lines of keys
        deleted or overwritten since would make it grow without end. A failure (a full disk) is
        logged; the file stays as it was and is compacted again later."""
        held: dict[bytes, int] = {}
        for key, replicas in durable_log.read(path, self.config.pool.max_key_bytes).items():
            if self.manager.is_durable(key):
                held[key] = replicas
        try:
            durable_log.compact(path, held)
        except errors.KVPoolError as exc:
            log.warning("node %s: could not compact %s/durable.log: %s", self.node_id[:8], path, exc)
        self._durable_held, self._durable_appends = len(held), 0

    def _durable_counts(self) -> dict[bytes, int]:
        """Key -> copies wanted, of the durable copies this node's persistent tiers hold (their
        ``durable.log``)."""
        durable: dict[bytes, int] = {}
        for tier in self.manager.tiers:
            path = getattr(tier, "path", None)
            if tier.persistent and tier.capacity_bytes > 0 and path is not None:
                durable.update(durable_log.read(path, self.config.pool.max_key_bytes))
        return durable

    def _register(self) -> None:
        role = getattr(self, "role", "client")
        persistent = [t for t in self.manager.tiers if t.persistent and t.capacity_bytes > 0]
        durable = self._durable_counts()  # any bytes there: malformed lines are skipped and logged
        # A durable copy may sit in a higher tier now (promoted, or kept in the shared arena:
        # share_copy), its disk copy the backing: it is still durable.
        backed = self.manager.durable_keys() if durable else set()
        records = [record_for(key, tier, extent, header,
                              durable.get(key) if tier.persistent or key in backed else None)
                   for key, tier, extent, header in self.manager.snapshot()]
        self._want_ucx_for(records)
        assert self.address is not None  # started
        reply = self.master.register(self.node_id, self.address.encode(), self.host_id,
                                     self.tier_state(), records, role=role,
                                     persistent_tiers=[t.name for t in persistent],
                                     control=self.control_address, hand_off=self.config.node.hand_off_s > 0)
        self._registered = True
        self.recent.registered()
        self._registered_term = int(reply.get("term", 0))
        # The master declares a node dead after its own heartbeat period times dead_after_missed:
        # beat at least that often, whatever this node's settings say.
        self._beat_s = min(self.config.master.heartbeat_ms, int(reply.get("heartbeat_ms") or 1 << 30)) / 1000.0
        if self.heartbeater is not None:
            self.heartbeater.term = self._registered_term
            self.heartbeater.period_s = self._beat_s
        log.info("node %s registered with master %s as %s: %d objects indexed (%d durable)", self.node_id[:8],
                 self.master.address, role, reply.get("indexed", len(records)),
                 sum(1 for r in records if r.get("durable")))

    def record(self, key: bytes) -> ReplicaRecord | None:
        found = self.manager.describe(key)
        return None if found is None else record_for(key, *found)

    # ManagerListener: called under the manager's lock, so only enqueue.
    def stored(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None:
        """Puts are published by the pool's two-phase put, not here."""

    def moved(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None:
        self._events.put(("moved", key, None))  # published as the tiers hold it when sent

    def removed(self, key: bytes, reason: str) -> None:
        self._events.put(("removed", key, reason))

    def _publish_loop(self) -> None:
        while True:
            kind, key, payload = self._events.get()
            batch = [(kind, key, payload)]
            while len(batch) < _PUBLISH_BATCH:
                try:
                    batch.append(self._events.get_nowait())
                except queue.Empty:
                    break
            stop = any(kind == "stop" for kind, _, _ in batch)
            try:
                with self._publish_lock:
                    # What the tiers hold now, not what the events said: a key removed (or moved)
                    # and put again since is published as it is, never removed.
                    changed = list(dict.fromkeys(k for kind, k, _ in batch if kind != "stop"))
                    now = {k: self.record(k) for k in changed}
                    removed = [k for k, record in now.items() if record is None]
                    moved = [record for record in now.values() if record is not None]
                    try:
                        if removed:
                            self.master.removed(self.node_id, removed)
                        if moved:
                            self.master.publish(self.node_id, moved)
                    finally:
                        self.recent.note(changed)
            except errors.KVPoolError as exc:
                # The next register (after a master restart) resends the truth.
                log.warning("could not publish %d changes to the master: %s", len(batch), exc)
            if stop:
                return

    def _may_drop_many(self, keys: list[bytes]) -> set[bytes]:
        """The bottom tier asks (outside the manager's lock, one batch): remotely leased objects stay."""
        try:
            try:
                decision = self.master.evict_request(self.node_id, keys)
            finally:
                self.recent.note(keys)
        except errors.KVPoolError as exc:
            log.debug("master unreachable for evict_request (%s): dropping %d victims", exc, len(keys))
            return set(keys)  # a cache must make room; readers verify and fall back
        pinned = set(decision.pinned)
        return {key for key in keys if key in decision.allowed or key not in pinned}

    def _on_delete(self, keys: list[bytes]) -> None:
        for key in keys:
            try:
                self.manager.delete(key)
            except errors.KeyNotFoundError:
                pass

    # -- serving pulls ----------------------------------------------------------------

    def _authorize(self, key: bytes, token: bytes) -> None:
        """Refuse (AuthenticationError) a pull whose token was not minted for ``key`` on this node."""
        self.cluster_key.check_token(token, key, self.node_id)

    def _provide(self, key: bytes, layer_range: LayerRange) -> ServeSource | None:
        # On the UCX progress thread the manager's lock is only tried: a demotion copying
        # under it must not stall every transfer; the transport retries on a worker.
        inline = in_inline_provider()
        try:
            obj = self.manager.pin(key, blocking=not inline)
        except LockBusy:
            raise ProviderWouldBlock() from None
        if obj is None:
            return None
        try:
            layer_range = LayerRange.resolve(layer_range, obj.spec.layers)
            rng = obj.spec.layer_bytes(layer_range)

            def release() -> None:  # never waits: a busy lock hands the unpin to a thread
                if not self.manager.unpin(obj, bytes_read=rng.nbytes, blocking=False):
                    self._unpinner.submit(self.manager.unpin, obj, bytes_read=rng.nbytes)

            if obj.tier.supports_views:  # in place (as obj.view_layers, with the range resolved once)
                view = obj.tier.view(obj.extent, rng.offset, rng.nbytes)
                return ServeSource(rng.nbytes, buffers=[view], release=release, header=obj.header.packed,
                                   release_nonblocking=True)
            tier, extent = obj.tier, obj.extent

            def read_into(offset: int, out: memoryview) -> int:
                tier.read_into(extent, rng.offset + offset, out)
                return len(out)

            return ServeSource(rng.nbytes, read_into=read_into, release=release, header=obj.header.packed,
                               release_nonblocking=True)
        except BaseException:
            self.manager.unpin(obj)
            raise

    def stats(self) -> dict[str, Any]:
        """Tiers, counters and pull-server counters of this node (also served on the control socket)."""
        ucx = self.server.stats() if self.server is not None else dict.fromkeys(_UCX_COUNTERS, 0)
        tcp = self.tcp_server.stats() if self.tcp_server is not None else {}
        return {"node_id": self.node_id, "host_id": self.host_id, "objects": len(self.manager),
                "tiers": self.manager.tier_stats(), "counters": {**self.manager.counters, **self.counters},
                # served over both data paths together, and each on its own
                "transfer": {name: value + tcp.get(name, 0) for name, value in ucx.items()},
                "transfer_by_path": {"ucx": ucx, "tcp": tcp}}

    # -- replication for durable puts ----------------------------------------------------

    def _control_loop(self) -> None:
        poller = zmq.Poller()
        control = self._control
        assert control is not None  # (the loop starts after the socket is bound)
        poller.register(control, zmq.POLLIN)
        while not self._stopping.is_set():
            if not poller.poll(200):
                continue
            try:
                frames = control.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 2:
                continue
            reply = self.serve_control(frames[-1])
            try:
                control.send_multipart([*frames[:-1], reply], zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone or its queue is full: it times out
                pass

    def serve_control(self, payload: bytes) -> bytes:
        """One control request in, one reply out; every failure is a typed error reply.

        Malformed requests (not msgpack, wrong shape or version, unknown op, a body
        field missing or of the wrong type) are ProtocolError; kvpool errors keep
        their type; anything else is TransferError. Nothing raises out of here.
        """
        request_id: Any = None
        try:
            request = P.unpack_control_request(payload)
            request_id, op, body = request.request_id, request.op, request.body
            if op == P.CONTROL_REPLICATE:
                result: Any = self._replicate(body)
            elif op == P.CONTROL_REPLICATE_MANY:
                result = self._replicate_many(body)
            elif op == P.CONTROL_ADOPT_MANY:
                result = self._adopt_many(body)
            elif op == P.CONTROL_PING:
                result = {"node_id": self.node_id}
            else:
                result = self.stats()
            return P.pack_control_reply(request_id, result)
        except P.MalformedRequest as exc:
            rid = exc.request_id if exc.request_id is not None else request_id
            return P.pack_control_error(rid, "ProtocolError", str(exc))
        except errors.KVPoolError as exc:
            return P.pack_control_error(request_id, type(exc).__name__, str(exc))
        except Exception as exc:  # the loop keeps serving
            log.warning("control request failed: %s: %.200s", type(exc).__name__, exc)
            return P.pack_control_error(request_id, "TransferError", f"{type(exc).__name__}: {str(exc):.500}")

    def _replica_pulls(self) -> Pulls:
        """How copies come here: plain TCP up to ``node.tcp_pull_max`` from any holder with a TCP
        port (pipelined on one connection; ~5x less CPU on both ends than UCX's callbacks here,
        which matters when the holder is an inference engine saving as it computes), else UCX."""
        with self._replicator_lock:
            if self._replicator is None:
                key = self.cluster_key
                self._replicator = Pulls(self.host_id, transport="auto", max_message=self.config.node.max_message,
                                         host=self.host, engine=self.ucx_engine,
                                         tcp_pull_max=self.config.node.tcp_pull_max,
                                         check_proof=key.check_holder_proof, prove=key.reader_proof,
                                         same_host_tcp_pull_max=None)
                self._peer_sweeper = threading.Thread(target=self._sweep_peers_loop, daemon=True,
                                                      name=f"kvpool-node-peers-{self.node_id[:8]}")
                self._peer_sweeper.start()
            return self._replicator

    def sweep_peers(self, alive: list[PeerAddress] | None = None) -> None:
        """Close the pooled connections of this node's replica pulls whose holder hung up and,
        with ``alive`` (the master's alive nodes), those to any other node."""
        if self._replicator is not None:
            self._replicator.sweep(alive)

    def _sweep_peers_loop(self) -> None:
        """Every PEER_SWEEP_S: close the replicator's pooled connections whose holder hung up (a
        client that did durable puts and exited); when one stays idle past PEER_ASK_IDLE_S,
        ask the master which nodes are alive and close those to the others (at most once per
        PEER_ASK_IDLE_S). No descriptor outlives the client that came and went."""
        asked = time.monotonic()
        while not self._stopping.wait(PEER_SWEEP_S):
            replicator = self._replicator
            try:
                if replicator is None:
                    continue
                replicator.sweep()
                now = time.monotonic()
                if now - asked < PEER_ASK_IDLE_S or not replicator.idle_connections(PEER_ASK_IDLE_S):
                    continue
                asked = now
                alive = alive_peers_of(self.master.stats())
                if alive is not None and not self._stopping.is_set():
                    replicator.sweep(alive)
            except errors.KVPoolError as exc:  # the master is away: asked again later
                log.debug("node %s: sweeping pooled pull connections: %s", self.node_id[:8], exc)
            except Exception as exc:  # never ends the thread
                log.warning("node %s: sweeping pooled pull connections failed: %s: %.200s", self.node_id[:8],
                            type(exc).__name__, exc)

    def _replicate(self, body: S.Replicate) -> dict[str, Any]:
        """Pull a whole object from a holder, verify it, store it, commit the reservation.

        A durable copy (``persistent``: every durable put and re-replication) goes
        into the persistent tier (nvme; CapacityError if this node has none) and
        its key is appended to ``durable.log`` there, so the node re-registers it
        as durable after a restart. Replies only once the master has the commit.
        """
        if body.reservation is None:
            raise errors.ProtocolError("replicate: a reservation to commit is needed")
        self.counters["replicate_requests"] += 1
        item = S.ReplicateItem(body.key, body.spec, body.header_sum, body.reservation, body.token)
        source = self._replication_source(body.source)
        [(spec, payload, raw_header)] = self._replication_buffers([item], body.persistent)
        (outcome,) = self._pull_replicas(source, [PullRequest(source, item.key, LayerRange(0, spec.layers), payload,
                                                               token=item.token, header_out=raw_header)])
        if isinstance(outcome, BaseException):
            raise outcome
        record, tier = self._store_replica(item, spec, payload, raw_header, body.persistent, body.replicas)
        try:
            self.master.commit(item.reservation, record)
        finally:
            self.recent.note([item.key])
        self.counters["replicated_objects"] += 1
        return {"node_id": self.node_id, "tier": tier}

    def _replicate_many(self, body: S.ReplicateMany) -> dict[str, Any]:
        """:meth:`_replicate` of a durable batch (``put_many``) from one source: every object
        pulled at once, each verified and stored, all reservations committed in one master
        round trip. An object that fails (pull, checksum, room) is not committed (its
        reservation expires) and the request fails after the others are committed."""
        self.counters["replicate_requests"] += 1
        items = body.items
        if len(items) > self.config.master.max_batch:
            raise errors.RequestTooLargeError(f"replicate_many: {len(items)} items; the most is master.max_batch")
        source = self._replication_source(body.source)
        buffers = self._replication_buffers(items, body.persistent)
        pulled = self._pull_replicas(source, [
            PullRequest(source, item.key, LayerRange(0, spec.layers), payload, token=item.token,
                        header_out=raw_header) for item, (spec, payload, raw_header) in zip(items, buffers)])
        commits: list[tuple[int, ReplicaRecord]] = []
        tiers: list[str] = []
        failures: list[str] = []
        for item, (spec, payload, raw_header), result in zip(items, buffers, pulled):
            try:
                if isinstance(result, BaseException):
                    raise result
                record, tier = self._store_replica(item, spec, payload, raw_header, body.persistent, body.replicas)
            except errors.KVPoolError as exc:
                failures.append(f"{item.key.hex()}: {type(exc).__name__}: {exc}")
                continue
            commits.append((item.reservation, record))
            tiers.append(tier)
        try:
            committed = sum(self.master.commit_many(commits)) if commits else 0
        finally:
            self.recent.note(record["key"] for _, record in commits)
        self.counters["replicated_objects"] += committed
        if failures or committed < len(items):
            raise errors.TransferError(
                f"replicate_many: {committed} of {len(items)} copies committed; failed: {'; '.join(failures)[:1500]}")
        return {"node_id": self.node_id, "tiers": tiers, "committed": committed}

    def _adopt_many(self, body: S.AdoptMany) -> dict[str, Any]:
        """A departing node's hand-off (:meth:`kvpool.client.ClusterPool.close`, ``node.hand_off_s``):
        the objects it alone would take away, kept here for the engines that come after it.

        Objects this node already holds are skipped. The rest are pulled
        together, each verified against the header the source named (a corrupt or changed
        object is not kept: a miss later, never its bytes), stored as ordinary evictable
        objects, a shared-memory tier first (the engines beside this node read them in place),
        and published in one master round trip. A rescue (``rescue``: the master's, for a
        source declared dead) reads them out of the arena the source left instead
        (:meth:`_rescue_from_arena`). Returns how many were ``adopted``, ``held`` already and
        ``failed``."""
        self.counters["adopt_requests"] += 1
        items = body.items
        if len(items) > self.config.master.max_batch:
            raise errors.RequestTooLargeError(f"adopt_many: {len(items)} items; the most is master.max_batch")
        if len(body.source) > self.config.master.max_address_bytes:
            raise errors.ProtocolError("adopt_many: source must be a node address (str, bounded)")
        address = NodeAddress.decode(body.source)
        source = address.peer
        # A key held here already is skipped, whatever version: a copy (a durable one, an earlier
        # hand-off's) has a header of its own, and keys name their content (prefix hashes).
        todo = [S.ReplicateItem(item.key, item.spec, item.header_sum, 0, item.token)
                for item in items if item.key not in self.manager]
        held = len(items) - len(todo)
        # A live source's objects are pulled: with a vLLM engine exiting beside it, reading an
        # 8k-token run's 779 blocks out of its arena here took over 3 s where pulls took 1.2
        # (docs/benchmarks.md, "Hand-off at exit"). A dead one's arena is all there is.
        if body.rescue:  # the source is dead: its arena is all there is, nobody serves a pull
            records, failed = self._rescue_from_arena(address, todo)
        else:
            records, failed = self._pull_adopted(source, todo)
        if records:
            self.publish(records)
        self.counters["adopted_objects"] += len(records)
        self.counters["adopt_failures"] += failed
        return {"node_id": self.node_id, "adopted": len(records), "held": held, "failed": failed}

    def _pull_adopted(self, source: PeerAddress, todo: list[S.ReplicateItem]) -> tuple[list[ReplicaRecord], int]:
        """A live source's objects, pulled together, each checked and kept: (records, failures)."""
        records: list[ReplicaRecord] = []
        failed = 0
        buffers = self._replication_buffers(todo, persistent=False)
        pulled = self._pull_replicas(source, [
            PullRequest(source, item.key, LayerRange(0, spec.layers), payload, token=item.token,
                        header_out=raw_header) for item, (spec, payload, raw_header) in zip(todo, buffers)])
        for item, (spec, payload, raw_header), result in zip(todo, buffers, pulled):
            try:
                if isinstance(result, BaseException):
                    raise result
                header = ObjectHeader.unpack_expected(raw_header, item.key, item.header_sum, spec)
                header.verify(LayerRange(0, spec.layers), payload)
                self._keep_adopted(item.key, spec, payload, records)
            except errors.KVPoolError as exc:
                failed += 1
                log.debug("adopt %s: %s: %s", item.key.hex(), type(exc).__name__, exc)
        return records, failed

    def _rescue_from_arena(self, address: NodeAddress, items: list[S.ReplicateItem],
                           ) -> tuple[list[ReplicaRecord], int]:
        """A dead source's objects read out of the shared-memory arena it left (on this host,
        where this node may map arenas: ``tiers.cxl.shared_dirs``; no owner needed): each found
        through the arena's index, its header the version the master indexed, copied out and
        verified against that header, then kept. Returns (records, failures): an object not
        there as named, or no arena to read, is a failure too."""
        arena = address.arena
        if not items or arena is None or address.peer.host_id != self.host_id:
            return [], len(items)
        from tiers.cxl import CxlArenaReader
        from tiers.cxl.arena import inside_dirs, shared_dirs_of

        real = os.path.realpath(arena["path"])
        if not inside_dirs(real, [os.path.realpath(d) for d in shared_dirs_of(self.config)]):
            return [], len(items)
        try:
            reader = CxlArenaReader.open(real, instance=arena["instance"], require_owner=False)
        except (errors.KVPoolError, OSError) as exc:
            log.debug("rescue: cannot map the dead source's arena %s: %s", real, exc)
            return [], len(items)
        records: list[ReplicaRecord] = []
        failed = 0
        buffer = np.empty(0, dtype=np.uint8)  # one receive buffer, reused: put copies out of it
        try:
            for item in items:
                found = reader.find(item.key)
                if found is None or found[1].checksum() != item.header_sum:
                    failed += 1  # not there as the master indexed it
                    continue
                offset, header = found
                spec = header.spec
                if buffer.nbytes < spec.payload_nbytes:
                    buffer = np.empty(spec.payload_nbytes, dtype=np.uint8)
                payload = buffer[:spec.payload_nbytes]
                try:
                    reader.read_layers_into(offset, header, LayerRange(0, spec.layers), payload, verify=True)
                    self._keep_adopted(item.key, spec, payload, records)
                except errors.KVPoolError as exc:
                    failed += 1
                    log.debug("rescue %s: %s: %s", item.key.hex(), type(exc).__name__, exc)
        finally:
            reader.close()
        self.counters["rescued_objects"] += len(records)
        return records, failed

    def _keep_adopted(self, key: bytes, spec: ObjectSpec, payload: np.ndarray, records: list[ReplicaRecord]) -> None:
        """Store a verified adopted object, a shared-memory tier first, and note its record for
        the publish (none where a flood of puts evicted it again meanwhile)."""
        self.manager.put(key, spec, payload.data, shared=True)
        record = self.record(key)
        if record is not None:
            records.append(record)

    def _pull_replicas(self, source: PeerAddress, requests: list[PullRequest]) -> list[int | BaseException]:
        """A batch's pulls, all in flight together (see :meth:`_replica_pulls`); those whose TCP
        path proves unusable go over UCX."""
        return self._replica_pulls().pull_many(requests, timeout_s=self.config.node.pull_timeout_s)

    def _replication_source(self, raw_source: str) -> PeerAddress:
        if len(raw_source) > self.config.master.max_address_bytes:
            raise errors.ProtocolError("replicate: source must be a node address (str, bounded)")
        return NodeAddress.decode(raw_source).peer

    def _replication_buffers(self, items: list[S.ReplicateItem],
                             persistent: bool) -> list[tuple[ObjectSpec, np.ndarray, bytearray]]:
        """Checked specs and receive buffers, before anything is pulled: a peer's claimed sizes
        are never allocated unless they could be stored here."""
        room = max((t.capacity_bytes for t in self.manager.tiers if t.persistent or not persistent), default=0)
        buffers = []
        for item in items:
            if not 0 < len(item.key) <= self.config.pool.max_key_bytes:
                raise errors.ProtocolError(f"replicate: key must be 1..{self.config.pool.max_key_bytes} bytes")
            if len(item.token) > 64:
                raise errors.ProtocolError("replicate: token must be bytes (at most 64)")
            try:
                spec = ObjectSpec.from_wire(item.spec)
            except (TypeError, ValueError, errors.KVPoolError) as exc:
                raise errors.ProtocolError(f"replicate: bad spec {item.spec!r:.100}: {exc}") from None
            if spec.payload_nbytes > room:
                raise errors.ObjectTooLargeError(
                    f"replicate: object of {spec.payload_nbytes} bytes is larger than every tier here ({room})")
            buffers.append((spec, np.empty(spec.payload_nbytes, dtype=np.uint8), bytearray(spec.header_nbytes)))
        return buffers

    def _store_replica(self, item: S.ReplicateItem, spec: ObjectSpec, payload: np.ndarray, raw_header: bytearray,
                       persistent: bool, replicas: int) -> tuple[ReplicaRecord, str]:
        """Verify a pulled object, store it (a durable copy in the persistent tier, its key in
        ``durable.log``); its record for the commit and the tier it landed in."""
        key = item.key
        header = ObjectHeader.unpack_expected(raw_header, key, item.header_sum, spec)
        whole = LayerRange(0, spec.layers)
        header.verify(whole, payload)
        if persistent:
            self.manager.put(key, spec, payload.data, persistent=True)
        else:
            self.manager.put(key, spec, payload.data)
        found = self.manager.describe(key)
        if found is None:
            raise errors.CapacityError("replica evicted before it could be committed")
        path = getattr(found[0], "path", None)  # a persistent tier's directory
        if persistent and found[0].persistent and path is not None:
            try:
                durable_log.append(path, key, replicas)
            except errors.KVPoolError:  # e.g. a full disk: no durable copy here that is not recorded as one
                with contextlib.suppress(errors.KVPoolError):
                    self.manager.delete(key)
                raise
            self._durable_appends += 1
            if self._durable_appends > max(DURABLE_LOG_SLACK, 2 * self._durable_held):
                self._compact_durable_log(path)  # (on the control thread, the only one that appends)
            # Also in this node's shared-memory arena, when it has one with room (the disk copy
            # stays its backing): an engine beside this node that starts after the one that
            # computed the object reads it in place, not from disk through a pull.
            if self.manager.share_copy(key):
                self.counters["durable_shared"] += 1
                found = self.manager.describe(key) or found
        return record_for(key, *found, durable=replicas if persistent else None), found[0].name
