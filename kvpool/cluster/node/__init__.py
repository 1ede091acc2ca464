"""A node: runs in ``kvpool-server --role node`` and in every ``connect()``'d client process,
which embeds one.

Owns serving pulls and the control socket (:mod:`.server`, with :mod:`.durable_log`: which
keys it keeps durable), heartbeats to the master (:mod:`.heartbeat`), the reader that pulls
located replicas and verifies them (:mod:`.reader`, with :mod:`.located`, :mod:`.checks`,
:mod:`.same_host`), and a process's view of the cluster (:mod:`.view`: node, master client,
reader, leases). Imports :mod:`kvpool.cluster.wire`, never :mod:`kvpool.cluster.master`.
"""
