"""What the tier manager keeps per object and hands out: its index entry (:class:`Entry`),
a reader's pin (:class:`PinnedObject`), the listener of index changes
(:class:`ManagerListener`), and :class:`LockBusy`. Pure data; the rules are
:mod:`tiers.manager`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader, ObjectSpec
from tiers.base import Extent, Tier


def largest_fit(tier: Tier) -> int:
    """The largest object (total bytes, header included) ``tier`` could ever hold."""
    low, high = 0, tier.capacity_bytes
    while low < high:
        mid = (low + high + 1) // 2
        if tier.fits_ever(mid):
            low = mid
        else:
            high = mid - 1
    return low


@dataclass
class Entry:
    key: bytes
    tier: int
    extent: Extent
    header: ObjectHeader
    pins: int = 0
    doomed: bool = False  # deleted or overwritten while pinned: free on last unpin
    lower_hits: int = 0  # hits since it landed in a tier below the top
    #: a copy left in a persistent tier when the object was promoted out of it (never read
    #: while the upper copy exists; dropped when its tier needs the space)
    backing: tuple[int, Extent] | None = None
    #: an acknowledged durable copy: its persistent copy is never an eviction victim (it is in
    #: no policy of its persistent tier); only a delete, an overwrite or a lost file removes it
    durable: bool = False


class NeedsApproval(Exception):
    """Making room needs the ``may_drop_many`` hook's word on these bottom-tier victims."""

    def __init__(self, entries: list[Entry]) -> None:
        super().__init__(f"{len(entries)} victims await approval")
        self.entries = entries


class LockBusy(errors.KVPoolError):
    """``pin(blocking=False)`` found the manager's lock taken (retry on a thread that may wait)."""




@dataclass(eq=False, slots=True)
class PinnedObject:
    """A read-pinned object: its bytes stay put until ``TierManager.unpin``. (Not frozen: a
    frozen dataclass's ``__init__`` sets each field through ``object.__setattr__``, and every
    get and served pull makes one. Nothing assigns to it.)"""

    key: bytes
    header: ObjectHeader
    tier: Tier
    extent: Extent
    _entry: Entry = field(repr=False, compare=False)

    @property
    def spec(self) -> ObjectSpec:
        return self.header.spec

    def read_layers(self, layer_range: LayerRange, out: Any) -> None:
        """Copy the layers into ``out`` (verified where the tier can rot)."""
        self.tier.read_layers(self.extent, self.header, layer_range, out)

    def view_layers(self, layer_range: LayerRange) -> memoryview | None:
        """Zero-copy view of the layers in tier memory, or None if the tier has none."""
        if not self.tier.supports_views:
            return None
        rng = self.header.spec.layer_bytes(layer_range)
        return self.tier.view(self.extent, rng.offset, rng.nbytes)


class ManagerListener(Protocol):
    """Told of every change to the index (called with the manager's lock held: keep it cheap)."""

    def stored(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None: ...

    def moved(self, key: bytes, tier: Tier, extent: Extent, header: ObjectHeader) -> None: ...

    def removed(self, key: bytes, reason: str) -> None: ...
