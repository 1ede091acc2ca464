"""The master process (``python -m kvpool.cluster.master``, ``kvpool-server --role master``).

Owns the cluster's metadata: the key index (:mod:`.index`, records in :mod:`.records`), the
node registry, leases and timers, durability planning (:mod:`.state`), one handler per request
(:mod:`.ops`), re-replication of lost copies (:mod:`.rereplicate`), bulk decoding of large
publishes (:mod:`.bulk`), the leader's change log and a standby's follower (:mod:`.follow`)
and the ZeroMQ server (:mod:`.server`). Never sees KV bytes. Imports
:mod:`kvpool.cluster.wire`, never :mod:`kvpool.cluster.node`.
"""
