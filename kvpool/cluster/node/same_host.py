"""The cxl arenas of other nodes on this host, read in place.

A reader maps a same-host node's arena read-only, either as a *neighbour* (a live node the
master lists on this host: keys are found through the arena's shared index, without the
master) or at a located replica's path. Only regular files inside the allowed shared-memory
directories (``/dev/shm``, the directory of this process's own cxl arena and
``tiers.cxl.shared_dirs``) are ever mapped, opened non-blocking and without following a final
symlink: a wrong or hostile master cannot make a reader map anything else.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cluster.node.located import LocatedReplica, clean_node_address
from kvpool.objformat import LayerRange, ObjectSpec
from kvpool.transport import PeerAddress
from tiers.cxl.arena import DEFAULT_SHARED_DIRS, inside_dirs

log = logging.getLogger("kvpool.remote")

OutView = Callable[[ObjectSpec, LayerRange, Any], "tuple[np.ndarray, memoryview]"]

@dataclass(frozen=True)
class ArenaBlock:
    """Where an object lies in a same-host node's cxl arena, found through the arena's shared
    index (:meth:`SameHostArenas.find_many`): ``reader`` (the arena, mapped read-only),
    ``offset`` and ``header`` (the object's header as it was found: every copy of a layer
    is checked against its checksums, so an extent reused since fails the copy)."""

    reader: Any
    offset: int
    header: Any

    @property
    def spec(self) -> ObjectSpec:
        spec: ObjectSpec = self.header.spec
        return spec


def copy_layer(layer: int, blocks: Sequence[ArenaBlock], outs: Sequence[Any]) -> list[bool]:
    """Copy layer ``layer`` of each of ``blocks`` into ``outs[i]`` (one layer's bytes each):
    one verified copy per arena for all its blocks. ``ok[i]`` False: that copy failed its
    checksum or its arena went away (``outs[i]`` then holds bytes that must not be used).
    Raises LayerRangeError / OutBufferError (before anything is copied) as the arena's
    ``copy_layer_out`` does."""
    ok = [False] * len(blocks)
    by_reader: dict[int, list[int]] = {}
    for i, block in enumerate(blocks):
        by_reader.setdefault(id(block.reader), []).append(i)
    for items in by_reader.values():
        reader = blocks[items[0]].reader
        try:
            copied = reader.copy_layer_out(layer, [(blocks[i].offset, blocks[i].header) for i in items],
                                           [outs[i] for i in items])
        except (errors.LayerRangeError, errors.OutBufferError):
            raise
        except (errors.KVPoolError, OSError) as exc:  # the arena went away: these are not copied
            log.info("same-host arena copy failed (%s): %d blocks not copied", exc, len(items))
            continue
        for i, good in zip(items, copied):
            ok[i] = bool(good)
    return ok


class SameHostArenas:
    """The arenas this reader mapped: its neighbours' (by node id) and located ones (by path and
    instance). ``counters``: the reader's (``hits_same_host``, ``same_host_retries``,
    ``refused_paths``, ``bad_records``, ``bytes_pulled``)."""

    def __init__(self, host_id: str, node_id: str | None, allowed_dirs: Sequence[str] | None,
                 counters: Counter[str]) -> None:
        self.host_id = host_id
        self.node_id = node_id
        #: only arenas that are regular files directly or deeper inside these are mapped
        self.allowed_dirs = tuple(os.path.realpath(d) for d in (allowed_dirs or DEFAULT_SHARED_DIRS))
        self.counters = counters
        self._lock = threading.Lock()
        self._neighbours: dict[str, Any] = {}  # node_id -> CxlArenaReader of a same-host node
        self._peers: dict[str, tuple[PeerAddress, str]] = {}  # node_id -> (its peer, its arena's instance)
        #: (node_id, reader, peer, path, instance) of each neighbour: what locate_many reads, remade
        #: (never changed in place) when the neighbours change
        self._indexed: tuple[tuple[str, Any, PeerAddress, str, str], ...] = ()
        #: (resolved path, instance) -> CxlArenaReader: arenas located replicas named, and the
        #: neighbours' (so a replica :meth:`locate_many` found maps nothing twice)
        self._located: dict[tuple[str, str], Any] = {}

    def allowed_path(self, path: str) -> str | None:
        """``path`` resolved, if it lies inside one of :attr:`allowed_dirs`; else None (logged)."""
        try:
            real = os.path.realpath(path)
        except (OSError, ValueError):
            real = ""
        if real and inside_dirs(real, self.allowed_dirs):
            return real
        log.warning("refusing to map %.300r: not inside the allowed shared-memory directories %s",
                    path, self.allowed_dirs)
        self.counters["refused_paths"] += 1
        return None

    def refresh(self, master_stats: Mapping[str, Any]) -> None:
        """Map the cxl arenas of live nodes on this host; forget the ones gone."""
        from tiers.cxl import CxlArenaReader

        wanted: dict[str, dict[str, str]] = {}
        peers: dict[str, PeerAddress] = {}
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
                    peers[node_id] = address.peer
        with self._lock:
            for node_id in list(self._neighbours):
                reader = self._neighbours[node_id]
                if node_id not in wanted or not reader.current():  # gone, dead, or replaced
                    del self._neighbours[node_id]
                    del self._peers[node_id]
                    ident = (str(reader.path), reader.header.instance.hex())
                    if self._located.get(ident) is reader:
                        del self._located[ident]
                    reader.close()
                else:
                    reader.map_ahead()  # what the owner allocated since (nothing to do: no thread)
            for node_id, arena in wanted.items():
                if node_id not in self._neighbours:
                    try:
                        reader = CxlArenaReader.open(arena["path"], instance=arena["instance"])
                    except (errors.KVPoolError, OSError) as exc:
                        log.debug("cannot map the arena of %s: %s", node_id, exc)
                        continue
                    instance = reader.header.instance.hex()
                    self._neighbours[node_id] = reader
                    self._peers[node_id] = (peers[node_id], instance)
                    self._located.setdefault((str(reader.path), instance), reader)
                    reader.map_ahead()  # its pages mapped before reads need them
            self._indexed = tuple((node_id, reader, self._peers[node_id][0], str(reader.path), self._peers[node_id][1])
                                  for node_id, reader in self._neighbours.items())

    def locate_many(self, keys: Sequence[bytes]) -> list[list[LocatedReplica] | None]:
        """Each key's replica in a neighbour's arena, found through its shared index (no master,
        no lease), or None: a record whose ``header`` is the one found (whole, naming the key, the
        version the index recorded), read in place only. The first neighbour that has a key
        answers for it; should its read fail (the extent reused since), the read asks on."""
        neighbours = self._indexed
        if not neighbours:
            return [None] * len(keys)
        found: list[list[LocatedReplica] | None] = [None] * len(keys)
        pending: Sequence[int] = range(len(keys))
        for node_id, reader, peer, path, instance in neighbours:
            try:
                hits = reader.find_many([keys[i] for i in pending])
            except (errors.KVPoolError, OSError):
                continue
            missed = []
            for i, hit in zip(pending, hits):
                if hit is None:
                    missed.append(i)
                    continue
                offset, header, header_sum = hit
                found[i] = [LocatedReplica(node_id, self.host_id, "cxl", header_sum, b"",
                                           {"path": path, "offset": offset, "instance": instance},
                                           peer, header.spec, header)]
            if not missed:
                break
            pending = missed
        return found

    def find_many(self, keys: Sequence[bytes]) -> list[ArenaBlock | None]:
        """Where each key lies in a neighbour's arena (:meth:`locate_many`), or None. Copy its
        layers with :func:`copy_layer` (each copy verified against the header found: a reused
        extent fails)."""
        return [None if found is None else ArenaBlock(self.at(found[0].location), found[0].location["offset"],
                                                      found[0].header)
                for found in self.locate_many(keys)]

    def owner_alive(self, node_id: Any) -> bool | None:
        """Whether a neighbour's arena still has its owner (its lock is held); None when
        ``node_id`` is not a neighbour."""
        neighbour = self._neighbours.get(node_id) if isinstance(node_id, str) else None
        if neighbour is None:
            return None
        try:
            return bool(neighbour.owner_alive())
        except errors.KVPoolError:
            return False

    def at(self, location: Mapping[str, Any]) -> Any:
        """The reader of the arena a located replica names (mapped once, then kept)."""
        mapped = self._located.get((str(location["path"]), str(location.get("instance", ""))))
        if mapped is not None:  # a path resolved and allowed when it was mapped
            return mapped
        from tiers.cxl import CxlArenaReader

        path = self.allowed_path(str(location["path"]))
        if path is None:
            raise errors.TierError(f"cxl: {str(location['path'])[:300]!r} is outside the allowed directories")
        ident = (path, str(location.get("instance", "")))
        with self._lock:
            reader = self._located.get(ident)
            if reader is None:
                reader = self._located[ident] = CxlArenaReader.from_location({**location, "path": path})
                reader.map_ahead()
            return reader

    def mapped(self) -> int:
        """How many arenas are mapped now."""
        with self._lock:
            return len(self._neighbours) + len(self._located)

    def close(self) -> None:
        with self._lock:
            for reader in [*self._located.values(), *self._neighbours.values()]:
                reader.close()
            self._located.clear()
            self._neighbours.clear()
            self._peers.clear()
            self._indexed = ()
