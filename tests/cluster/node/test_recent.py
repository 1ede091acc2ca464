"""RecentChanges: what a node publishes again after a warm master takeover."""

from __future__ import annotations

import time

from kvpool.cluster.node.recent import RecentChanges


def test_keys_changed_since_a_time_in_order_of_their_last_change() -> None:
    recent = RecentChanges()
    recent.note([b"a", b"b"])
    time.sleep(0.01)
    middle = time.monotonic()
    time.sleep(0.01)
    recent.note([b"c", b"a"])
    assert recent.since(middle) == [b"c", b"a"]
    assert recent.since(time.monotonic() + 1) == []


def test_a_time_before_what_it_remembers_is_none_so_the_node_registers_everything() -> None:
    started = time.monotonic()
    recent = RecentChanges(max_entries=3)
    assert recent.since(started - 1.0) == []  # nothing changed, nothing forgotten yet
    recent.registered()
    assert recent.since(started - 1.0) is None  # before its register: the master needs all of it
    recent.note([b"1", b"2", b"3"])
    time.sleep(0.01)
    recent.note([b"4"])  # the oldest is forgotten
    assert len(recent) == 3
    assert recent.since(started) is None
    assert recent.since(time.monotonic() - 0.005) == [b"4"]


def test_old_changes_are_forgotten_by_age() -> None:
    recent = RecentChanges(keep_s=0.05)
    recent.note([b"old"])
    first = time.monotonic()
    time.sleep(0.08)
    recent.note([b"new"])
    assert len(recent) == 1
    assert recent.since(first - 0.01) is None
    assert recent.since(time.monotonic() - 0.01) == [b"new"]
