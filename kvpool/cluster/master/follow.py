"""Warm standbys: the leader's ordered change stream, and the standby that follows it.

Leader side (:class:`ChangeLog`)
    With ``master.etcd``, the leader records every change of its index, its node registry and
    its durability map (see :meth:`IndexState.record_changes`) as it makes it: each change is
    encoded once, numbered, and kept in a log of at most :data:`FOLLOW_LOG_BYTES`. A standby
    asks ``follow`` with (stream, since) and gets the changes after ``since`` in order. A
    standby that is new, follows an older stream (another leader's term) or fell out of the
    log gets a snapshot instead: the whole state at one change number, in parts, after which
    it follows from that number. Leases, reservations and deletes not yet sent to nodes are
    not followed (a new leader starts without them, as after a restart).

Standby side (:class:`Follower`)
    A thread of every master that does not lead: it asks the leader for changes every
    :data:`POLL_S` (at once again while more are waiting) and applies them to its own state
    under the serving lock. When the standby wins an election with a copy that was answered
    within :meth:`Follower.eligible`'s window it leads *warm*: it answers from that index at
    once and the nodes it knows keep heartbeating without re-registering. A standby without
    such a copy (just started, still loading, or cut off from the leader) does not campaign
    while another master could (see ``Election``'s ``eligible``); if no leader appears, it
    leads *cold* after a grace period and says so in its log and in ``stats``
    (``ha.warm = false``): the nodes re-register everything, as after a restart.

What a takeover can miss, and how the nodes fill it in
    The copy lacks the changes the old leader made after the standby last asked a question
    whose answer left nothing behind (``Follower.covered_at``: at most a poll period before the
    leader stopped, plus whatever the standby was behind). A warm leader therefore asks every
    node, in its first heartbeat reply of the term, to publish again what it changed since then
    (``HeartbeatReply.resend_s``, measured back from when the node sent the beat):
    :class:`kvpool.cluster.node.recent.RecentChanges` remembers which keys each node changed and
    when, so the node publishes each such key as its tiers hold it now (durable counts from its
    ``durable.log``) or says it is gone, and registers everything instead if it no longer
    remembers that far back. An acknowledged put is thus back in the index at the node's first
    beat to the new leader; until then a get of it is a miss, never wrong bytes.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import deque
from contextlib import AbstractContextManager
from itertools import islice
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

import msgspec
import numpy as np

from kvpool import errors
from kvpool.cluster.master.index import split_key_bytes
from kvpool.cluster.master.records import Replica, node_from_wire, node_wire
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire.master_client import MasterClient

if TYPE_CHECKING:
    from kvpool.cluster.master.state import IndexState
    from kvpool.cluster.wire.etcd import Election
    from kvpool.cluster.wire.security import ClusterKey
    from kvpool.config import MasterSection

log = logging.getLogger("kvpool.master.follow")

FOLLOW_LOG_BYTES = 256 << 20   # changes kept for standbys; one further behind reloads a snapshot
FOLLOW_REPLY_BYTES = 8 << 20   # changes in one follow answer, at most (about)
SNAPSHOT_PART_BYTES = 8 << 20
SNAPSHOT_KEEP_S = 120.0        # a snapshot no standby asked for in this long is dropped
POLL_S = 0.05                  # a caught-up standby asks again after this
_ENCODER = msgspec.msgpack.Encoder()
_COLUMNS = ("<u8", "<u8", "<u2", "<u4", "<u8", "<i8")  # k0 k1 node shape header_sum offset


class Snapshot:
    """The leader's whole state at change ``seq``, as parts: part 0 the tables, then the
    index's columns in pieces of at most SNAPSHOT_PART_BYTES."""

    def __init__(self, state: IndexState, seq: int, now: float) -> None:
        self.ident = secrets.randbits(48) or 1
        self.seq = seq
        self.used = now
        tables, columns = state.index.snapshot()
        head = {
            "index": tables,
            "nodes": [node_wire(n) for n in state.nodes.values()],
            "durable": list(state.durable.items()),
            "columns": [int(c.size) for c in columns],
        }
        self.parts: list[bytes | memoryview] = [_ENCODER.encode(head)]
        for column, dtype in zip(columns, _COLUMNS):
            raw = np.ascontiguousarray(column, dtype=dtype).data.cast("B")
            for start in range(0, len(raw), SNAPSHOT_PART_BYTES):
                self.parts.append(raw[start:start + SNAPSHOT_PART_BYTES])

    def part(self, i: int) -> bytes:
        if not 0 <= i < len(self.parts):
            raise errors.InvalidArgumentError(f"snapshot part {i} of {len(self.parts)}")
        return bytes(self.parts[i])


class ChangeLog:
    """The leader's numbered changes (see the module)."""

    def __init__(self, clock: Any = time.monotonic) -> None:
        self.stream = secrets.token_hex(8)
        self.head = 0
        self.clock = clock
        self._log: deque[tuple[int, bytes]] = deque()
        self._bytes = 0
        self.snapshot: Snapshot | None = None
        #: follower endpoint -> (its last acknowledged change, when it asked)
        self.followers: dict[str, tuple[int, float]] = {}

    def append(self, change: list[Any]) -> None:
        data = _ENCODER.encode(change)
        self.head += 1
        self._log.append((self.head, data))
        self._bytes += len(data)
        while self._bytes > FOLLOW_LOG_BYTES and len(self._log) > 1:
            _, dropped = self._log.popleft()
            self._bytes -= len(dropped)

    def after(self, since: int) -> tuple[list[msgspec.Raw], int] | None:
        """The changes after ``since`` (about FOLLOW_REPLY_BYTES at most) and the number of the
        last one; None when they are no longer (or not) in the log."""
        if since == self.head:
            return [], since
        first = self._log[0][0] if self._log else self.head + 1
        if not first - 1 <= since < self.head:
            return None
        out: list[msgspec.Raw] = []
        size, last = 0, since
        for seq, data in islice(self._log, since - first + 1, None):
            out.append(msgspec.Raw(data))
            size += len(data)
            last = seq
            if size >= FOLLOW_REPLY_BYTES:
                break
        return out, last

    def snapshot_for(self, state: IndexState) -> Snapshot:
        """A snapshot a standby can follow on from: the last one while its changes are still in
        the log, else a new one of the state now."""
        now = self.clock()
        snap = self.snapshot
        first = self._log[0][0] if self._log else self.head + 1
        if snap is None or snap.seq < first - 1 or now - snap.used > SNAPSHOT_KEEP_S:
            started = time.perf_counter()
            snap = self.snapshot = Snapshot(state, self.head, now)
            log.info("snapshot for a standby: %d keys at change %d in %d parts (%.2f s)", len(state.index),
                     self.head, len(snap.parts), time.perf_counter() - started)
        snap.used = now
        return snap

    def stats(self, now: float) -> dict[str, Any]:
        return {"stream": self.stream, "head": self.head, "log_bytes": self._bytes,
                "followers": {who: {"behind": self.head - seq, "asked_s_ago": round(now - at, 3)}
                              for who, (seq, at) in self.followers.items() if now - at < 60}}


def answer_follow(state: IndexState, body: Any) -> Any:
    """The leader's answer to ``follow`` (see the module)."""
    changes: ChangeLog | None = state.change_log
    if changes is None:
        raise errors.InvalidArgumentError("this master keeps no change stream (it leads without master.etcd)")
    now = state.clock()
    if body.snapshot:
        snap = changes.snapshot
        if snap is None or snap.ident != body.snapshot:
            raise errors.InvalidArgumentError(f"snapshot {body.snapshot} is gone: follow again from the start")
        snap.used = now
        return {"stream": changes.stream, "snapshot": snap.ident, "seq": snap.seq, "part": body.part,
                "parts": len(snap.parts), "data": snap.part(body.part)}
    if body.follower:
        changes.followers[body.follower[:256]] = (body.since, now)
        if len(changes.followers) > 64:
            changes.followers.pop(next(iter(changes.followers)))
    if body.stream == changes.stream:
        got = changes.after(body.since)
        if got is not None:
            answer = {"stream": changes.stream, "head": changes.head, "last": got[1], "changes": got[0]}
            if state.resend_from is not None:  # this leader's own takeover is not filled in yet
                answer["resend_age"] = now - state.resend_from
            return answer
    snap = changes.snapshot_for(state)
    return {"stream": changes.stream, "snapshot": snap.ident, "seq": snap.seq, "part": 0,
            "parts": len(snap.parts), "data": snap.part(0)}


# -- the standby's side --------------------------------------------------------------------


def load_snapshot(state: IndexState, parts: list[bytes]) -> None:
    """Make ``state`` (a fresh one) the leader's state the parts describe."""
    head = msgspec.msgpack.decode(parts[0])
    now = state.clock()
    for wire in head["nodes"]:
        state.nodes[wire["node_id"]] = node_from_wire(wire, now)
    for key, replicas in head["durable"]:
        dict.__setitem__(state.durable, key, replicas)
    data = b"".join(parts[1:])
    columns, offset = [], 0
    for count, dtype in zip(head["columns"], _COLUMNS):
        nbytes = count * np.dtype(dtype).itemsize
        columns.append(np.frombuffer(data, dtype, count, offset).astype(dtype.replace("<", "="), copy=True))
        offset += nbytes
    if offset != len(data):
        raise errors.ProtocolError(f"snapshot: {len(data)} bytes of columns, {offset} described")
    state.index.load(head["index"], columns)


def apply_change(state: IndexState, change: list[Any]) -> None:
    """Replay one of the leader's changes on a standby's ``state``."""
    kind = change[0]
    index = state.index
    if kind == "add":
        _, node_id, keys, sids, sums, offsets, wholes = change
        records: list[Replica | None] = []
        if wholes:
            records = [None] * len(keys)
            for i, wire in wholes:
                records[i] = Replica(wire["tier"], wire["spec"], wire["nbytes"], wire["header_sum"],
                                     wire["location"], None)
        index.add_many(node_id, keys, sids, sums, offsets, records)
    elif kind == "addc":
        _, node_id, keys, sid, sums = change
        lo, hi = split_key_bytes(keys)
        index.add_columns(node_id, keys, lo, hi, sid, np.frombuffer(sums, "<u8").astype(np.uint64))
    elif kind == "shape":
        index.put_shape(*change[1:])
    elif kind == "rm":
        index.remove(change[2], change[1])
    elif kind == "pop":
        index.pop(change[1])
    elif kind == "drop":
        index.drop_node(change[1])
    elif kind == "node":
        wire = change[1]
        known = state.nodes.get(wire["node_id"])
        node = node_from_wire(wire, state.clock())
        if known is not None:  # keeps what is the standby's own (pending deletes are not followed)
            node.pending_deletes = known.pending_deletes
        state.nodes[node.node_id] = node
    elif kind == "retire":
        retired = state.nodes.get(change[1])
        if retired is not None:
            retired.alive, retired.state, retired.died_at = False, change[2], state.clock()
    elif kind == "forget":
        state.nodes.pop(change[1], None)
        index.forget_node(change[1])
    elif kind == "durable":
        dict.__setitem__(state.durable, change[1], change[2])
    elif kind == "undurable":
        dict.pop(state.durable, change[1], None)
    else:
        raise errors.ProtocolError(f"change stream: unknown change {kind!r:.40}")


StateT = TypeVar("StateT", bound="IndexState")


class Standby(Protocol[StateT]):
    """What a :class:`Follower` uses of the master it runs in
    (:class:`kvpool.cluster.master.server.MasterServer`)."""

    @property
    def election(self) -> Election | None: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def config(self) -> MasterSection: ...

    @property
    def cluster_key(self) -> ClusterKey: ...

    @property
    def state(self) -> StateT: ...

    def turn(self) -> AbstractContextManager[Any]:
        """Held while the state served changes: one request, or one change followed, at a time."""

    def new_state(self) -> StateT: ...

    def adopt(self, state: StateT) -> None:
        """Serve ``state`` from now on (called within a turn)."""


class Follower(Generic[StateT]):
    """A standby master's thread following the leader's change stream (see the module)."""

    def __init__(self, server: Standby[StateT], window_s: float) -> None:
        self.server = server
        self.window_s = window_s  # eligible while the leader answered within this long
        self.stream = ""
        self.seq = 0
        self.loaded = False
        self.answered_at = -1e9
        # When (this clock) this master last *asked* a question whose answer left it with every
        # change the leader had made: the copy lacks at most what the leader changed after this.
        self.covered_at = -1e9
        # The leader's own takeover gap, while some node has not filled it in yet (this clock, at
        # or before the leader's): a takeover from this copy must ask the nodes from there.
        self.resend_before: float | None = None
        self.behind = 0
        self.leader: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-master-follow", daemon=True)

    def start(self) -> Follower[StateT]:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def eligible(self) -> bool:
        """May lead warm: holds a copy that was complete (nothing behind) within the window."""
        return self.loaded and time.monotonic() - self.covered_at < self.window_s

    def forget(self) -> None:
        """This master leads now: what it followed is its own state; after a deposition it
        starts over from a snapshot of the next leader."""
        self.stream, self.seq, self.loaded = "", 0, False
        self.covered_at, self.resend_before = -1e9, None

    def describe(self) -> dict[str, Any]:
        now = time.monotonic()
        return {"following": self.leader, "loaded": self.loaded, "change": self.seq, "behind": self.behind,
                "answered_s_ago": round(now - self.answered_at, 3) if self.loaded else None,
                "complete_s_ago": round(now - self.covered_at, 3) if self.loaded and self.covered_at > 0 else None}

    def _run(self) -> None:
        client: MasterClient | None = None
        server = self.server
        try:
            while not self._stop.is_set():
                election = server.election
                leader = None if election is None or election.leading() else election.leader
                if not leader or leader == server.endpoint:
                    self._stop.wait(POLL_S)
                    continue
                if leader != self.leader or client is None:
                    if client is not None:
                        client.close()
                    self.leader = leader
                    client = MasterClient(leader, config=server.config, request_timeout_s=3.0,
                                          cluster_key=server.cluster_key)
                try:
                    more = self._follow(client)
                except errors.KVPoolError as exc:
                    log.debug("following %s: %s", leader, exc)
                    client.close()
                    client = None
                    self._stop.wait(POLL_S * 4)
                    continue
                if not more:
                    self._stop.wait(POLL_S)
        finally:
            if client is not None:
                client.close()

    def _follow(self, client: MasterClient) -> bool:
        """One question to the leader; True if more changes are waiting."""
        server = self.server
        asked = time.monotonic()
        reply = client.call(P.FOLLOW, {"stream": self.stream, "since": self.seq, "follower": server.endpoint})
        if "snapshot" in reply:
            self._load(client, reply)
            return True
        changes = reply["changes"]
        with server.turn():
            if server.election is None or server.election.leading() or reply["stream"] != self.stream:
                return False
            state = server.state
            for change in changes:
                apply_change(state, change)
        self.seq = reply["last"]
        self.behind = reply["head"] - self.seq
        self.answered_at = time.monotonic()
        if self.behind == 0:  # every change the leader made before it read this question
            self.covered_at = asked
        age = reply.get("resend_age")
        self.resend_before = None if age is None else asked - float(age)
        return self.behind > 0

    def _load(self, client: MasterClient, first: dict[str, Any]) -> None:
        started = time.perf_counter()
        parts = [first["data"]]
        for i in range(1, first["parts"]):
            parts.append(client.call(P.FOLLOW, {"snapshot": first["snapshot"], "part": i})["data"])
        state = self.server.new_state()
        load_snapshot(state, parts)
        with self.server.turn():
            if self.server.election is None or self.server.election.leading():
                return
            self.server.adopt(state)
            self.stream, self.seq, self.loaded = first["stream"], first["seq"], True
            self.answered_at = time.monotonic()
            # A snapshot may have been made a while before it was asked for: the copy is
            # complete only once a follow answer leaves nothing behind.
            self.covered_at = -1e9
        log.info("standby: loaded a snapshot of %d keys from the leader %s at change %d (%.2f s); following it",
                 len(state.index), self.leader, self.seq, time.perf_counter() - started)
