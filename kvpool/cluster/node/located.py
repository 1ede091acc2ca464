"""What the master says about where a key is, checked before a reader uses any of it.

The one place a node checks what came off the wire about replicas: :func:`located_replicas`
turns a master's ``locate`` answer for one key into :class:`LocatedReplica` records (one struct
from here to the pull, carrying the decoded address and spec), and everything after it (the
reader, the location cache, speculative pulls) takes only those. A wrong or hostile master must
not crash or redirect a reader: every located replica and every node address is checked here
(types, bounds, a decodable address, a possible spec) and a bad one is dropped, counted and
logged, never raised.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import msgspec

from kvpool import errors
from kvpool.cluster.node.server import NodeAddress
from kvpool.objformat import ObjectSpec
from kvpool.transport import PeerAddress

log = logging.getLogger("kvpool.remote")

_MAX_ID = 256
_MAX_REPLICAS = 1024  # of one key read from an answer; the rest are ignored
_MAX_ADDRESS = 64 << 10
_MAX_TOKEN = 64


class LocatedReplica(msgspec.Struct, frozen=True, gc=False):
    """One replica of a located key, checked: what the master said of it (the holder's
    ``node_id`` and ``host_id``, its ``tier``, ``header_sum``, pull ``token`` and cxl
    ``location``, empty when it has none), where its holder serves pulls (``peer``, decoded from
    the node address the master relays: what the transport is handed) and the spec the reader
    sizes its buffer by (``spec``; the holder's header must agree).

    ``header``: the holder's header itself, when the locator read it (a same-host node's shared
    index, :meth:`~kvpool.cluster.node.same_host.SameHostArenas.locate_many`: checked against
    the index entry, no master, no lease, no token). Such a replica is read in place only,
    its layers verified against this header; it is never pulled."""

    node_id: str
    host_id: str
    tier: str
    header_sum: int
    token: bytes
    location: dict[str, Any]
    peer: PeerAddress
    spec: ObjectSpec
    header: Any = None

    @property
    def in_place_only(self) -> bool:
        """Found through a same-host index (see ``header``): read in place, never pulled."""
        return self.header is not None


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
    if node is None:  # (address is then a str: clean_node_address takes nothing else)
        return None
    if location:
        location = clean_location(location)
        if location is None:
            return None
    return LocatedReplica(node_id=node_id, host_id=host_id, tier=tier, header_sum=header_sum, token=token,
                          location=location or {}, peer=node.peer, spec=spec)


def checked_replicas(replicas: Any, counters: Counter[str]) -> list[LocatedReplica] | None:
    """One key's replicas as a master listed them, checked (:func:`clean_replica`): None when it
    listed none (a miss), else the well-formed ones, possibly none (each bad record is counted,
    ``counters["bad_records"]``, and logged once)."""
    if not replicas:
        return None
    if not isinstance(replicas, list):
        counters["bad_records"] += 1
        log.warning("master sent replicas that are not a list: %.200r", replicas)
        return []
    good = []
    for raw in replicas[:_MAX_REPLICAS]:
        replica = clean_replica(raw)
        if replica is None:
            counters["bad_records"] += 1
            log.warning("ignoring a malformed replica record from the master: %.200r", raw)
            continue
        good.append(replica)
    return good


def located_replicas(located: Any, index: int, counters: Counter[str]) -> list[LocatedReplica] | None:
    """:func:`checked_replicas` of key ``index`` of a master's ``locate`` answer (None also when
    the answer has no such entry)."""
    return checked_replicas(replicas_at(located, index), counters)


def replicas_at(located: Any, index: int) -> Any:
    """``located.replicas[index]`` of a master reply as it came, or None when the reply has no
    such entry."""
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
