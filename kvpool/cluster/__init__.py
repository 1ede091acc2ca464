"""The cluster: the master's protocol, state and server, its client, a node (serves pulls, keeps
the master's index in step), the reader (pulls located replicas, verifies them), etcd leader
election and the cluster key. Builds on :mod:`kvpool.transport` and the tiers."""
