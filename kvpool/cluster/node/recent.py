"""Which keys this node changed at the master lately, and when: :class:`RecentChanges`.

A standby master that takes over warm answers from a copy of the last leader's index that may
lack the leader's last changes (:mod:`kvpool.cluster.master.follow`). Its first heartbeat reply
asks each node to publish again what it changed in the last ``resend_s`` seconds; this is what
the node consults. A change is noted *after* the master answered it (or the call failed), so a
change the old leader made after the standby's copy ended is always at or after that time.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable

#: Changes remembered, at most: ~100 bytes each. A node asked further back than it remembers
#: registers everything instead (correct, only slower).
RECENT_CHANGES_MAX = 262_144
#: Changes older than this are forgotten (a takeover asks for seconds, not minutes).
RECENT_CHANGES_KEEP_S = 300.0


class RecentChanges:
    """A time-ordered record of the keys this node published, removed or committed at the
    master. Thread-safe; :meth:`note` is O(keys) and never blocks on I/O."""

    def __init__(self, max_entries: int = RECENT_CHANGES_MAX, keep_s: float = RECENT_CHANGES_KEEP_S) -> None:
        self.max_entries = max_entries
        self.keep_s = keep_s
        self._entries: deque[tuple[float, bytes]] = deque()
        # Anything changed at or before this time may have been forgotten.
        self._forgotten_until = float("-inf")
        # The node's last register (it replaced everything the master knew of it): a takeover
        # whose gap reaches back before it must be told everything again.
        self._registered_at = float("-inf")
        self._lock = threading.Lock()

    def note(self, keys: Iterable[bytes]) -> None:
        """``keys`` were changed at the master just now (call after the master answered)."""
        now = time.monotonic()
        with self._lock:
            entries = self._entries
            entries.extend((now, key) for key in keys)
            cutoff = now - self.keep_s
            while entries and (len(entries) > self.max_entries or entries[0][0] < cutoff):
                self._forgotten_until = max(self._forgotten_until, entries.popleft()[0])

    def registered(self) -> None:
        """The master answered a register of this node (everything it holds) just now."""
        with self._lock:
            self._registered_at = time.monotonic()

    def since(self, since: float) -> list[bytes] | None:
        """The distinct keys changed at or after ``since`` (this process's monotonic clock), in
        order of their last change; None if changes from then may have been forgotten, or the
        node registered since then (a master that lacks that register needs all of it)."""
        with self._lock:
            if since <= max(self._forgotten_until, self._registered_at):
                return None
            newest_first: list[bytes] = []
            for t, key in reversed(self._entries):
                if t < since:
                    break
                newest_first.append(key)
        return list(dict.fromkeys(reversed(newest_first)))

    def __len__(self) -> int:
        return len(self._entries)
