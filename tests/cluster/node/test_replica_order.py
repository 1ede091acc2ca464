"""Which replica of a key a reader tries first (kvpool.cluster.node.reader)."""

from __future__ import annotations

from kvpool.cluster.node.located import LocatedReplica
from kvpool.cluster.node.reader import ReplicaReader


def replica(node_id: str, host_id: str, tier: str) -> LocatedReplica:
    # Only the fields the order reads matter here; the rest are placeholders.
    return LocatedReplica(node_id, host_id, tier, 0, b"", {}, None, None)  # type: ignore[arg-type]


def test_replicas_are_tried_same_host_first_then_fastest_tier_first_never_this_nodes_own() -> None:
    reader = ReplicaReader("host-a", node_id="me")
    try:
        got = reader._order([replica("far-cxl", "host-b", "cxl"), replica("near-nvme", "host-a", "nvme"),
                             replica("far-dram", "host-b", "dram"), replica("near-dram", "host-a", "dram"),
                             replica("me", "host-a", "cxl"), replica("near-odd", "host-a", "tape"),
                             replica("near-cxl", "host-a", "cxl"), replica("far-nvme", "host-b", "nvme"),
                             replica("near-hbm", "host-a", "hbm")])
        assert [r.node_id for r in got] == ["near-cxl", "near-dram", "near-hbm", "near-nvme", "near-odd",
                                            "far-cxl", "far-dram", "far-nvme"]
    finally:
        reader.close()
