"""The cluster, in one package per process that runs the code:

- :mod:`kvpool.cluster.wire`: what every process of the cluster speaks (framing, message
  schemas, the cluster key, etcd discovery) and the client ends of its sockets (the master's
  client, its query port's client, calls to a node's control socket).
- :mod:`kvpool.cluster.master`: the master process (``python -m kvpool.cluster.master`` or
  ``kvpool-server --role master``): the key index, registry, leases, durability planning,
  re-replication and the standby's follower.
- :mod:`kvpool.cluster.node`: a node (``kvpool-server --role node``, and the one every
  ``connect()``'d client embeds): serving pulls and its control socket, heartbeats, the
  reader that pulls and verifies located replicas, and a process's view of the cluster.

``master`` and ``node`` both import ``wire`` and never each other (tests/test_layering.py).
Builds on :mod:`kvpool.transport` and the tiers.
"""
