"""The master's requests: one ``op_*`` per protocol operation on :class:`IndexState`.

Each ``op_*`` takes its op's struct from :mod:`kvpool.cluster.wire.schema` (shape and fixed
limits already checked) and checks what depends on settings and state before changing
anything, so a bad request never leaves half an update behind.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvpool import errors
from kvpool.cluster.master.bulk import RecordColumns
from kvpool.cluster.master.follow import answer_follow
from kvpool.cluster.master.records import MAX_DELETES_PER_BEAT, Lease, NodeInfo, describe_address, node_wire
from kvpool.cluster.master.state import IndexState
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire import schema as S

log = logging.getLogger("kvpool.master")

# Added to what nodes are asked to publish again after a warm takeover (HeartbeatReply.resend_s):
# the nodes measure it back from when they sent the beat, with their own clock; this covers the
# two clocks running at slightly different rates.
RESEND_MARGIN_S = 0.5


class MasterState(IndexState):
    """All master state and every operation on it; no sockets, no threads."""

    @functools.cached_property
    def handlers(self) -> dict[str, Callable[[Any], Any]]:
        return {
            P.PING: self.op_ping, P.REGISTER: self.op_register, P.LEAVE: self.op_leave,
            P.HEARTBEAT: self.op_heartbeat,
            P.LOOKUP: self.op_lookup, P.EXISTS: self.op_exists, P.LOCATE: self.op_locate,
            P.RELEASE: self.op_release, P.RESERVE: self.op_reserve, P.COMMIT: self.op_commit,
            P.REVOKE: self.op_revoke, P.PUBLISH: self.op_publish,
            P.EVICT_REQUEST: self.op_evict_request, P.REMOVED: self.op_removed,
            P.DELETE: self.op_delete, P.PLACE: self.op_place, P.STATS: self.op_stats,
            P.LIST: self.op_list, P.FOLLOW: self.op_follow,
        }

    # -- operations -----------------------------------------------------------------

    def handle(self, op: str, body: Any) -> Any:
        """Serve one request: ``body`` is the op's struct (a mapping is decoded into it first, as
        the wire would be). Returns the reply body as builtins."""
        self.counters["requests"] += 1
        return self.handlers[op](P.decode_body(op, body))

    def op_ping(self, body: S.Ping) -> Any:
        return {"version": P.PROTOCOL_VERSION, "uptime_s": self.clock() - self.started, "query_port": self.query_port}

    def op_register(self, body: S.Register) -> Any:
        node_id, host_id, role, persistent = body.node_id, body.host_id, body.role, body.persistent_tiers
        address = self._bounded_str("address", body.address, self.config.max_address_bytes)
        tiers = self._tiers(body.tiers)
        raw_objects: Any = self._batch(body.objects, "objects")
        endpoint, control = describe_address(address)
        if body.control is not None:
            control = body.control
        node = self.nodes.get(node_id)
        columns: RecordColumns | None = None
        if isinstance(raw_objects, RecordColumns):
            # As columns (kvpool.cluster.master.bulk) unless deletes wait for this node (they are
            # matched key by key) or the records do not fit the index's columns.
            sid = None if node is not None and node.pending_deletes else self._encode_columns(raw_objects)
            if sid is None:
                raw_objects = raw_objects.records()
            else:
                columns = raw_objects
        if columns is not None:
            keys: list[bytes] = []
            durable = columns.durable_pairs()
            # Refused whole (PoolFullError) before anything changes if the new keys do not fit.
            self.index.check_room_columns(columns.keys, columns.lo, columns.hi)
        else:
            keys, sids, sums, offsets, whole, durable = self._encode_records(raw_objects)
            self.index.check_room(keys)
        now = self.clock()
        if node is None:
            node = self.nodes[node_id] = NodeInfo(node_id, address, host_id, tiers, now)
            previously: list[bytes] = []
        else:
            # The list is authoritative: forget what we believed the node held.
            previously = self._durable_held_by(node)
            self._drop_replicas_of(node)
            node.address, node.host_id, node.tiers = address, host_id, tiers
            node.last_seen, node.alive, node.committed_since_beat = now, True, 0
        node.role, node.persistent_tiers, node.control = role, tuple(persistent), control
        node.hand_off = body.hand_off and role == P.ROLE_CLIENT
        node.endpoint, node.state, node.term_seen = endpoint, "alive", self.term
        if self.resend_from is not None:
            self._takeover_filled_in()
        self._journal(["node", node_wire(node)])
        skipped = 0
        pending = node.pending_deletes
        if pending:  # deleted by a client while the node was away
            keep = [i for i, key in enumerate(keys) if key not in pending]
            skipped = len(keys) - len(keep)
            durable = [(key, wanted) for key, wanted in durable if key not in pending]
            keys = [keys[i] for i in keep]
            sids, sums, offsets = ([seq[i] for i in keep] for seq in (sids, sums, offsets))
            whole = [whole[i] for i in keep] if whole else whole
        if columns is not None:
            self.index.add_columns(node_id, columns.keys, columns.lo, columns.hi, sid, columns.sums)  # type: ignore[arg-type]
        else:
            self.index.add_many(node_id, keys, sids, sums, offsets, whole)
        indexed = len(columns) if columns is not None else len(keys)
        self.durable.update(durable)
        # Keys this node lost, and keys it brings back (maybe the only copy left of a
        # durable key whose other holders died), may need copies.
        self._check_durable(previously)
        self._check_durable(self._durable_held_by(node))
        if node.stores_durably and node.control:
            # A new target: keys waiting for one are looked at in the next round.
            check = self.to_check
            for key, not_before in check.items():
                if not_before > now:
                    check[key] = now
        self.counters["registers"] += 1
        if role == P.ROLE_CLIENT:
            kind = "inference client"
        elif node.stores_durably:
            kind = f"storage node, durable copies in {'+'.join(node.persistent_tiers)}"
        else:
            kind = "storage node without a persistent tier (takes no durable copies)"
        log.info(
            "node %s registered: %s, host=%.64s, %d objects (%d skipped: deleted meanwhile)",
            node.label, kind, host_id, indexed, skipped,
        )
        return {
            "heartbeat_ms": self.config.heartbeat_ms,
            "dead_after_missed": self.config.dead_after_missed,
            "lease_s": self.config.lease_s,
            "indexed": indexed,
            "skipped_deleted": skipped,
            "term": self.term,
        }

    def op_leave(self, body: S.Leave) -> Any:
        """A clean departure: the node's replicas leave the index now; it is listed as ``left``."""
        node = self.nodes.get(body.node_id)
        if node is None or not node.alive:
            return {"withdrawn": 0, "known": node is not None}
        dropped, stale = self._retire(node, self.clock(), "left")
        self.counters["nodes_left"] += 1
        log.info("node %s left: %d replicas withdrawn, %d reservations dropped", node.label, dropped, stale)
        return {"withdrawn": dropped, "known": True}

    def op_heartbeat(self, body: S.Heartbeat) -> Any:
        node_id, ack = body.node_id, body.delete_ack
        tiers = None if body.tiers is None else self._tiers(body.tiers)
        self.counters["heartbeats"] += 1
        node = self.nodes.get(node_id)
        term = self.term
        resend_s = 0.0 if self.resend_from is None else self.clock() - self.resend_from + RESEND_MARGIN_S
        if node is None or not node.alive:
            return {"reregister": True, "delete": [], "delete_seq": 0, "term": term}
        node.last_seen = self.clock()
        if body.term != node.term_seen:
            node.term_seen = body.term
            if self.resend_from is not None and body.term == term:
                self._takeover_filled_in()
        if tiers is not None:
            node.tiers = tiers
            node.committed_since_beat = 0
        pending = node.pending_deletes
        if not pending:
            return {"reregister": False, "delete": [], "delete_seq": node.delete_seq, "term": term,
                    "resend_s": resend_s}
        if ack:
            for key in [k for k, seq in pending.items() if 0 < seq <= ack]:
                del pending[key]
        # Pinned replicas stay until their lease ends; unacknowledged ones are
        # sent again (the reply carrying them may have been lost).
        sendable = [k for k in pending if (k, node_id) not in self.pins][:MAX_DELETES_PER_BEAT]
        if sendable:
            node.delete_seq += 1
            for key in sendable:
                pending[key] = node.delete_seq
        return {"reregister": False, "delete": sendable, "delete_seq": node.delete_seq, "term": term,
                "resend_s": resend_s}

    def op_lookup(self, body: S.Keys) -> Any:
        keys = self._keys(body.keys, strict=False)
        prefix = self.index.prefix(keys)
        c = self.counters
        c["lookups"] += 1
        c["lookup_hashes"] += len(keys)
        c["lookup_hits"] += prefix
        if prefix and (body.near_nodes or body.near_host):
            near = set(body.near_nodes)
            return {"prefix": prefix, "near": [self._near(keys[i], near, body.near_host) for i in (0, prefix - 1)]}
        return {"prefix": prefix}

    def _near(self, key: bytes, nodes: set[str], host: str) -> bool:
        """Whether ``key`` has a replica on one of ``nodes``, or in a cxl arena on ``host``."""
        for node_id, record in (self.index.get(key) or {}).items():
            if node_id in nodes:
                return True
            node = self.nodes.get(node_id)
            if host and node is not None and node.host_id == host and record["tier"] == "cxl":
                return True
        return False

    def op_exists(self, body: S.Keys) -> Any:
        keys = self._keys(body.keys, strict=False)
        found = self.index.contains_many(keys)
        hits = sum(found)
        self.counters["key_hits"] += hits
        self.counters["key_misses"] += len(found) - hits
        return {"exists": found}

    def op_locate(self, body: S.Locate) -> Any:
        keys = self._keys(body.keys, strict=False)
        want_lease = body.lease
        nodes = self.nodes
        mint = self.cluster_key.minter() if self.cluster_key is not None and self.cluster_key.enabled else None
        out: list[list[dict[str, Any]] | None] = []
        pins: list[tuple[bytes, str]] = []
        for key, replicas in zip(keys, self.index.located_many(keys)):
            if not replicas:
                out.append(None)
                continue
            located = []
            for node_id, record in replicas:
                node = nodes[node_id]
                record["address"] = node.address
                record["host_id"] = node.host_id
                record["token"] = mint(key, node_id) if mint is not None else b""
                located.append(record)
                pins.append((key, node_id))
            out.append(located)
        hits = len(keys) - out.count(None)
        self.counters["key_hits"] += hits
        self.counters["key_misses"] += len(keys) - hits
        lease_id = None
        if want_lease and pins:
            lease_id = self._new_id()
            self.leases[lease_id] = Lease(pins, self.clock() + self.config.lease_s)
            table = self.pins
            for pin in pins:
                table[pin] = table.get(pin, 0) + 1
            self.counters["leases_granted"] += 1
        return {"replicas": out, "lease": lease_id}

    def op_release(self, body: S.Release) -> Any:
        lease_ids = self._batch(body.leases, "leases")
        released = 0
        for lid in lease_ids:
            lease = self.leases.pop(lid, None)
            if lease is not None:
                self._unpin(lease)
                released += 1
        self.counters["leases_released"] += released
        return {"released": released}

    def op_reserve(self, body: S.Reserve) -> Any:
        checked = [(self._key(item.key), item.nbytes, self._alive_node(item.node_id))
                   for item in self._batch(body.items, "items")]
        now = self.clock()
        return {"reservations": [self._reserve(key, nbytes, node, now) for key, nbytes, node in checked]}

    def op_commit(self, body: S.Commit) -> Any:
        checked = [(item.reservation, self._record(item.replica, with_key=False)[1])
                   for item in self._batch(body.items, "items")]
        # Refused whole (PoolFullError) before any reservation is used if the keys do not fit.
        self.index.check_room([res.key for rid, _ in checked if (res := self.reservations.get(rid)) is not None])
        committed = []
        for rid, record in checked:
            res = self.reservations.pop(rid, None)
            node = None if res is None else self._release_reservation(res)
            if res is None or node is None or not node.alive:
                committed.append(False)
                self.counters["commits_failed"] += 1
                continue
            node.committed_since_beat += record["nbytes"]
            self._note_durable(res.key, record)
            if res.durable:
                self.durable[res.key] = res.durable
            self._add_replica(node, res.key, record)
            committed.append(True)
            self.counters["commits"] += 1
            self.counters["bytes_committed"] += record["nbytes"]
        return {"committed": committed}

    def op_revoke(self, body: S.Revoke) -> Any:
        revoked = 0
        for rid in self._batch(body.reservations, "reservations"):
            res = self.reservations.pop(rid, None)
            if res is not None:
                self._release_reservation(res)
                revoked += 1
        self.counters["revokes"] += revoked
        return {"revoked": revoked}

    def op_publish(self, body: S.Publish) -> Any:
        node = self._alive_node(body.node_id)
        raws: Any = self._batch(body.objects, "objects")
        sid = self._encode_columns(raws) if isinstance(raws, RecordColumns) else None
        if sid is None and isinstance(raws, RecordColumns):
            raws = raws.records()
        # A node sending what it holds is alive: one that re-registers a large index in many
        # batches is never declared dead between them for want of a heartbeat.
        if sid is not None:  # one kind of record, as columns (kvpool.cluster.master.bulk)
            node.last_seen = max(node.last_seen, self.clock())
            _, new_bytes = self.index.add_columns(node.node_id, raws.keys, raws.lo, raws.hi, sid, raws.sums)
            durable = raws.durable_pairs()
            keys: Iterable[bytes] = raws.key_list() if node.pending_deletes else ()
        else:
            keys, sids, sums, offsets, whole, durable = self._encode_records(raws)
            node.last_seen = max(node.last_seen, self.clock())
            _, new_bytes = self.index.add_many(node.node_id, keys, sids, sums, offsets, whole)
        node.committed_since_beat += new_bytes
        self.durable.update(durable)
        pending = node.pending_deletes
        if pending:  # a new copy supersedes a delete the node has not carried out yet
            for key in keys:
                pending.pop(key, None)
        self.counters["published"] += len(raws)
        return {"indexed": len(raws)}

    def op_evict_request(self, body: S.NodeKeys) -> Any:
        node_id = body.node_id
        keys = self._keys(body.keys)
        node = self.nodes.get(node_id)
        if node is None or not node.alive:
            # Nothing of this node is indexed, so nothing can be pointed at.
            return {"allowed": keys, "pinned": [], "reregister": True}
        allowed, pinned = [], []
        pins = self.pins
        for key in keys:
            if (key, node_id) in pins:
                pinned.append(key)
            else:
                self._remove_replica(node, key)
                node.pending_deletes.pop(key, None)
                allowed.append(key)
        self._check_durable(allowed)
        self.counters["evictions_allowed"] += len(allowed)
        self.counters["evictions_refused"] += len(pinned)
        return {"allowed": allowed, "pinned": pinned, "reregister": False}

    def op_removed(self, body: S.NodeKeys) -> Any:
        node_id = body.node_id
        keys = self._keys(body.keys)
        node = self.nodes.get(node_id)
        if node is None:
            return {"removed": 0}
        removed = 0
        for key in keys:
            removed += self._remove_replica(node, key)
            node.pending_deletes.pop(key, None)
        self._check_durable(keys)
        self.counters["removed"] += removed
        return {"removed": removed}

    def op_delete(self, body: S.Delete) -> Any:
        keys = self._keys(body.keys)
        caller = body.node_id  # drops its own copies itself, at once
        nodes = self.nodes
        deleted = []
        for key in keys:
            holders = self.index.pop(key)
            deleted.append(holders is not None)
            self.durable.pop(key, None)
            self.to_check.pop(key, None)
            self._attempts.pop(key, None)
            for node_id in holders or ():
                node = nodes[node_id]
                if node_id != caller:
                    node.pending_deletes[key] = 0
        self.counters["deletes"] += sum(deleted)
        return {"deleted": deleted}

    def op_place(self, body: S.Place) -> Any:
        nbytes, replicas = body.nbytes, body.replicas
        exclude = set(self._batch(body.exclude, "exclude"))
        key = None if body.key is None else self._key(body.key)
        # A batch (put_many): the same nodes take every item, each must fit their persistent
        # tier, and together they weigh the choice.
        items = [(self._key(item.key), item.nbytes) for item in self._batch(body.items, "items")]
        largest = max((n for _, n in items), default=nbytes)
        if items:
            nbytes = sum(n for _, n in items)
        if replicas < 1:
            raise errors.InvalidArgumentError(f"replicas must be >= 1, got {replicas}")
        eligible = self._eligible(exclude)
        if replicas > len(eligible):
            others = sum(1 for n in self.nodes.values() if n.alive and n.node_id not in exclude) - len(eligible)
            raise errors.NotEnoughReplicasError(
                f"{replicas} durable replicas asked for, but only {len(eligible)} storage nodes with a "
                f"persistent tier are alive and eligible ({len(exclude)} excluded; {others} other alive "
                f"nodes are inference clients or have no nvme tier and never take durable copies)"
            )
        candidates = [n for n in eligible if n.largest_persistent_tier_bytes >= largest]
        if not candidates:
            raise errors.ObjectTooLargeError(
                f"{largest} bytes is larger than the persistent tier of every one of the "
                f"{len(eligible)} eligible storage nodes"
            )
        if replicas > len(candidates):
            raise errors.NotEnoughReplicasError(
                f"{replicas} durable replicas asked for, but the object ({largest} bytes) fits the persistent "
                f"tier of only {len(candidates)} of the {len(eligible)} eligible storage nodes"
            )
        chosen = self._choose(nbytes, replicas, candidates)
        now = self.clock()
        self.counters["placements"] += 1
        targets = []
        for n in chosen:
            target: dict[str, Any] = {
                "node_id": n.node_id, "address": n.address, "host_id": n.host_id,
                "reservation": None if key is None else self._reserve(key, nbytes, n, now, durable=replicas),
            }
            if items:
                target["reservations"] = [self._reserve(k, size, n, now, durable=replicas) for k, size in items]
            targets.append(target)
        return {"targets": targets}

    def op_list(self, body: S.ListKeys) -> Any:
        """Keys starting with ``prefix`` (operators' ``kvpool ls``), at most ``limit``."""
        prefix = body.prefix
        limit = min(body.limit, self.config.max_batch)  # a reply stays as bounded as a request
        out: list[dict[str, Any]] = []
        for key, replicas in self.index.items(prefix):
            if len(out) == limit:
                return {"keys": out, "truncated": True}
            first = next(iter(replicas.values()))
            out.append({"key": key, "nbytes": first.get("nbytes", 0), "spec": first.get("spec"),
                        "replicas": [{"node_id": nid, "tier": r.get("tier")} for nid, r in replicas.items()]})
        return {"keys": out, "truncated": False}

    def op_follow(self, body: S.Follow) -> Any:
        """A standby's question for the changes it has not seen (kvpool.cluster.master.follow)."""
        return answer_follow(self, body)

    def op_stats(self, body: Any) -> Any:  # no fields (tests call it with {})
        now = self.clock()
        return {
            "protocol_version": P.PROTOCOL_VERSION,
            "uptime_s": now - self.started,
            "nodes": {
                n.node_id: {
                    "alive": n.alive, "state": n.state, "role": n.role, "endpoint": n.endpoint,
                    "persistent_tiers": list(n.persistent_tiers), "stores_durably": n.stores_durably,
                    "address": n.address, "host_id": n.host_id,
                    "tiers": n.tiers, "objects": self.index.node_count(n.node_id),
                    "reserved_bytes": n.reserved_bytes,
                    "effective_free_bytes": n.effective_free_bytes,
                    "pending_deletes": len(n.pending_deletes),
                    "last_seen_s": now - n.last_seen,
                }
                for n in self.nodes.values()
            },
            "keys": len(self.index),
            "replicas": self.index.replicas,
            "index": self.index.stats(),
            "reservations": len(self.reservations),
            "leases": len(self.leases),
            "pinned_replicas": len(self.pins),
            "durable_keys": len(self.durable),
            "under_replicated": len(self.to_check) + len(self.rereplicating),
            "rereplications_in_flight": sum(len(t) for t in self.rereplicating.values()),
            "counters": dict(self.counters),
            "ha": self.ha,
            "takeover": self.takeover,
            "change_stream": None if self.change_log is None else self.change_log.stats(now),
        }
