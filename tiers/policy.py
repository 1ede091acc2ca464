"""Eviction policies: which object a full tier demotes first.

A policy orders the objects of one tier; it never touches bytes. ``victim``
removes and returns the object to demote, skipping objects the caller says are
pinned (being read), so a reader never loses its object underneath it.

- ``lru``: least recently used first.
- ``s3fifo``: S3-FIFO (Yang et al., SOSP'23). New objects enter a small FIFO
  (10% of the tier's bytes); only objects hit again while there reach the main
  FIFO, so a one-pass scan of cold prefixes cannot flush the hot working set.
  A ghost list remembers recently evicted keys so their return goes straight
  to main.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable

IsPinned = Callable[[bytes], bool]


class EvictionPolicy(ABC):
    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes

    @abstractmethod
    def insert(self, key: bytes, nbytes: int) -> None:
        """A new object entered the tier."""

    @abstractmethod
    def touch(self, key: bytes) -> None:
        """The object was read."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """The object left the tier for a reason other than ``victim`` (delete, promotion)."""

    @abstractmethod
    def victim(self, is_pinned: IsPinned) -> bytes | None:
        """Remove and return the coldest unpinned object, or None if every object is pinned."""

    @abstractmethod
    def __len__(self) -> int: ...


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._order: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, nbytes: int) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: bytes) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: bytes) -> None:
        self._order.pop(key, None)

    def victim(self, is_pinned: IsPinned) -> bytes | None:
        for key in self._order:
            if not is_pinned(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)


class S3FIFOPolicy(EvictionPolicy):
    SMALL_FRACTION = 0.10
    MAX_FREQ = 3

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._small: OrderedDict[bytes, int] = OrderedDict()  # key -> nbytes
        self._main: OrderedDict[bytes, int] = OrderedDict()
        self._ghost: OrderedDict[bytes, None] = OrderedDict()
        self._freq: dict[bytes, int] = {}
        self._small_bytes = 0

    def insert(self, key: bytes, nbytes: int) -> None:
        self.remove(key)
        self._freq[key] = 0
        if key in self._ghost:  # evicted recently and back already: it is hot
            del self._ghost[key]
            self._main[key] = nbytes
        else:
            self._small[key] = nbytes
            self._small_bytes += nbytes

    def touch(self, key: bytes) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, self.MAX_FREQ)

    def remove(self, key: bytes) -> None:
        if key in self._small:
            self._small_bytes -= self._small.pop(key)
        self._main.pop(key, None)
        self._freq.pop(key, None)

    def _remember(self, key: bytes) -> None:
        self._ghost[key] = None
        while len(self._ghost) > max(16, len(self._main) + len(self._small)):
            self._ghost.popitem(last=False)

    def victim(self, is_pinned: IsPinned) -> bytes | None:
        # Every pass either evicts, or moves an object to the back with its
        # frequency lowered / queue promoted, so 4 passes over both queues bound it.
        for _ in range(4 * (len(self._small) + len(self._main)) + 1):
            use_small = self._small and (
                self._small_bytes > self.SMALL_FRACTION * self.capacity_bytes or not self._main
            )
            queue = self._small if use_small else self._main
            if not queue:
                return None
            key, nbytes = queue.popitem(last=False)
            if use_small:
                self._small_bytes -= nbytes
            if is_pinned(key):
                queue[key] = nbytes
                if use_small:
                    self._small_bytes += nbytes
                continue
            if use_small and self._freq[key] > 0:
                self._freq[key] = 0
                self._main[key] = nbytes  # hit while small: it earned main
                continue
            if not use_small and self._freq[key] > 0:
                self._freq[key] -= 1
                self._main[key] = nbytes  # second chance
                continue
            del self._freq[key]
            if use_small:
                self._remember(key)
            return key
        return None

    def __len__(self) -> int:
        return len(self._small) + len(self._main)


POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "s3fifo": S3FIFOPolicy}


def make_policy(name: str, capacity_bytes: int) -> EvictionPolicy:
    try:
        return POLICIES[name](capacity_bytes)
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}; known: {sorted(POLICIES)}") from None
