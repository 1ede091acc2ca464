"""Where a read looks for a key's replicas: the locator chain, nearest first.

1. :class:`SameHostIndex`: the shared indexes of this host's other nodes' cxl arenas (no
   master, no lease, no token); a replica found there is read in place.
2. :class:`LocationCache`: where this process read the key last time, the master's answer
   kept while its pull tokens are good (no master).
3. :class:`LastHolder` (``node.speculative_pulls`` without ``node.confirm_speculative``): the
   node this process last pulled from, guessed for every key of a batch (no master); its
   answer is used only from a holder that proves the cluster key, with a whole header naming
   the key and the guessed spec (see :meth:`ReplicaReader.read_many`).
4. :class:`MasterLocator`: the master's ``locate``, under a read lease the caller releases
   once it has read.

Each answers a batch of keys with :class:`~kvpool.cluster.node.located.LocatedReplica` lists
(None where it does not know a key), the one record the reader takes, whichever locator found
it; the reader (:class:`~kvpool.cluster.node.reader.ReplicaReader`) reads them the same way
(in place on this host, else a pull) and counts each read by the locator's ``source``. A key
the first locators know but whose replicas fail there goes on to the next; the master's answer
is final. :class:`~kvpool.cluster.node.view.ClusterView` walks the chain.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import msgspec

from kvpool.cluster.node.located import LocatedReplica, located_replicas
from kvpool.cluster.node.same_host import SameHostArenas
from kvpool.cluster.wire.master_client import MasterClient

Replicas = list[LocatedReplica] | None


class Found(NamedTuple):
    """What one locator knows of a batch of keys: each key's replicas (None: not known here)
    and the read leases that keep them (release them once read)."""

    replicas: list[Replicas]
    lease_ids: Sequence[int] = ()


class Locator(Protocol):
    #: what the reader counts a read of these replicas as: "same_host", "cache" or "master"
    source: str

    def find_many(self, keys: Sequence[bytes]) -> Found: ...


class SameHostIndex:
    """Same-host nodes' shared cxl indexes (:meth:`SameHostArenas.locate_many`)."""

    source = "same_host"

    def __init__(self, arenas: SameHostArenas) -> None:
        self._arenas = arenas

    def find_many(self, keys: Sequence[bytes]) -> Found:
        return Found(self._arenas.locate_many(keys))


class LocationCache:
    """Replicas a key was read from last time (``remembered(key)``: the reader's LRU, tokens
    still good for a while)."""

    source = "cache"

    def __init__(self, remembered: Callable[[bytes], Replicas]) -> None:
        self._remembered = remembered

    def find_many(self, keys: Sequence[bytes]) -> Found:
        return Found([self._remembered(key) for key in keys])


class LastHolder:
    """Every key guessed to be on the node this reader last pulled from
    (:meth:`ReplicaReader.guessed_holder`), as it was located then: its spec is the guess of
    each key's, and no token or location of another key's goes with it."""

    source = "guess"

    def __init__(self, guessed_holder: Callable[[], LocatedReplica | None]) -> None:
        self._guessed_holder = guessed_holder

    def find_many(self, keys: Sequence[bytes]) -> Found:
        replica = self._guessed_holder()
        if replica is None:
            return Found([None] * len(keys))
        guess = [msgspec.structs.replace(replica, header_sum=0, token=b"", location={}, header=None)]
        return Found([guess] * len(keys))


class MasterLocator:
    """The master's ``locate`` under read leases; its answers checked where they are read
    (:func:`~kvpool.cluster.node.located.located_replicas`, bad records counted in
    ``counters``)."""

    source = "master"

    def __init__(self, master: MasterClient, counters: Counter[str]) -> None:
        self._master = master
        self._counters = counters

    def find_many(self, keys: Sequence[bytes]) -> Found:
        located = self._master.locate_many(keys, lease=True)
        return Found([located_replicas(located, i, self._counters) for i in range(len(keys))],
                     located.lease_ids)

    def find(self, key: bytes, meanwhile: Callable[[], Any] | None = None) -> Found:
        """One key; ``meanwhile`` runs while the request travels (a guessed pull)."""
        located = self._master.locate(key, lease=True, meanwhile=meanwhile)
        return Found([located_replicas(located, 0, self._counters)], located.lease_ids)
