"""What both ends of the cluster's sockets speak; runs in every cluster process (master, node,
client, CLI).

Owns: the master protocol's framing and message schemas (:mod:`.protocol`, :mod:`.schema`),
the cluster key and CURVE/HMAC handshakes (:mod:`.security`), etcd leader discovery and
election (:mod:`.etcd`), and the client ends of the cluster's sockets: the master's client
(:mod:`.master_client`), its query port (:mod:`.query`), calls to a node's control socket
(:mod:`.control`). Owns no state of the master or of a node; imports neither
:mod:`kvpool.cluster.master` nor :mod:`kvpool.cluster.node`.
"""
