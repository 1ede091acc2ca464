"""The locator chain a remote read walks (kvpool.cluster.node.locators), with a real master and
real nodes: a batch's keys are each answered by the nearest locator that knows them (a
same-host arena's shared index, the location cache, the master), a key whose nearer replica
fails goes on to the next locator, and only the master's answer ends a key as a miss."""

from __future__ import annotations

import numpy as np
import pytest

from tests.cluster_actor import content, key_of
from tests.test_cluster import Cluster, damage_in_arena


def _master_key_requests(cluster: Cluster) -> int:
    counters = cluster.client.stats()["counters"]
    return int(counters["key_hits"] + counters["key_misses"])


@pytest.mark.slow
def test_a_batch_is_answered_by_the_nearest_locator_of_each_key(cluster: Cluster) -> None:
    cluster.start_master()
    # keys 0-2 in a same-host arena (found through its shared index); keys 3-4 in another
    # node's dram (only the master, then the location cache, know where)
    cluster.start_actor("writer", "in-arena", "--keys", "3", "--dram", "0")
    cluster.start_actor("writer", "in-dram", "--keys", "2", "--first", "3")
    # keys 6-7 in a second same-host arena: a batch asks each arena's index for what the
    # ones before it did not have
    cluster.start_actor("writer", "in-arena-2", "--keys", "2", "--first", "6", "--dram", "0")
    reader = cluster.connect("reader")
    try:
        keys = [key_of(i) for i in range(5)] + [b"never-put"]
        before = _master_key_requests(cluster)
        got = reader.get_many([*keys, key_of(7), key_of(6)], layers=range(1, 3))
        for i in range(5):
            np.testing.assert_array_equal(got[i], content(i)[1:3])
        assert got[5] is None
        np.testing.assert_array_equal(got[6], content(7)[1:3])
        np.testing.assert_array_equal(got[7], content(6)[1:3])
        remote = reader.stats()["remote"]
        assert remote["hits_same_host"] == 5 and remote["hits_remote"] == 2
        # one master round trip, for the three keys no same-host index had
        assert _master_key_requests(cluster) - before == 3

        # again: the arena's keys from its index, the pulled ones from where they were last
        # read: the master is not asked at all
        before = _master_key_requests(cluster)
        got = reader.get_many(keys[:5])
        for i in range(5):
            np.testing.assert_array_equal(got[i], content(i))
        remote = reader.stats()["remote"]
        assert remote["hits_same_host"] == 8 and remote["location_cache_hits"] == 2
        assert _master_key_requests(cluster) == before

        # Damage key 1 in the arena: its index entry still names it, the in-place read fails
        # its checksum (a retry, not a miss yet), the master's replica is the same damaged
        # copy, so the key ends as a checksum miss; the others in the batch are unharmed.
        damage_in_arena(reader, key_of(1))
        got = reader.get_many(keys[:3])
        assert got[1] is None
        np.testing.assert_array_equal(got[0], content(0))
        np.testing.assert_array_equal(got[2], content(2))
        stats = reader.stats()
        assert stats["remote"]["same_host_retries"] >= 1 and stats["misses"]["checksum"] == 1
    finally:
        reader.close()
