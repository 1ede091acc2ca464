"""An attacker process for tests/test_auth.py: tries every operation on a cluster it has no key for.

Run as ``python tests/auth_attacker.py SPEC_JSON``; SPEC holds ``master`` (address), ``control``
(a victim node's control socket), ``keys`` (victim keys, hex), ``config`` (a Config mapping:
the attacker's ``[security]``, its pool/tier settings for ``connect``), ``timeout_s`` and
``files`` (paths to try to open). Prints one JSON object per attempt on stdout:
``{"op", "ok", "error", "message", "elapsed_s"}`` (``message`` is one line). Never raises:
what it got is the parent's to judge. Imports only kvpool (it may run as another Unix user
with the repo and site-packages on PYTHONPATH).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any


def attempt(op: str, fn: Callable[[], Any]) -> None:
    started = time.monotonic()
    try:
        result = fn()
        outcome = {"ok": True, "error": None, "message": repr(result)[:200]}
    except BaseException as exc:  # reported, judged by the parent
        outcome = {"ok": False, "error": type(exc).__name__, "message": str(exc).splitlines()[0] if str(exc) else ""}
    print(json.dumps({"op": op, "elapsed_s": round(time.monotonic() - started, 3), **outcome}), flush=True)


def main(spec: dict[str, Any]) -> None:
    import numpy as np

    import kvpool
    from kvpool.cluster.wire import protocol as P
    from kvpool.cluster.wire.control import control_call
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.cluster.wire.security import ClusterKey
    from kvpool.config import Config
    from kvpool.objformat import ObjectSpec

    for path in spec.get("files", []):
        def read(path: str = path) -> int:
            with open(path, "rb") as fh:
                return len(fh.read(16))
        attempt(f"open {path}", read)
    if not spec.get("master"):
        return
    timeout = float(spec["timeout_s"])
    config = Config.load(spec["config"])
    keys = [bytes.fromhex(k) for k in spec["keys"]]
    key = keys[0]
    cluster_key: list[ClusterKey] = []
    attempt("load key", lambda: cluster_key.append(ClusterKey.from_config(config)) or cluster_key[0].describe())
    if not cluster_key:
        return  # without a readable key file nothing below can even start
    master = MasterClient(spec["master"], config=config, request_timeout_s=timeout)
    obj = ObjectSpec("float16", layers=2, tokens=4, kv_heads=1, head_dim=8)
    poison = P.replica_record("dram", obj, obj.total_nbytes, key=key, header_sum=12)
    node_id = "attacker-node"
    tiers = {"dram": {"capacity": 1 << 20, "free": 1 << 20}}
    attempt("ping", master.ping)
    attempt("stats", master.stats)
    attempt("ls", lambda: master.list_keys(b"", 100))
    attempt("exists", lambda: master.exists(key))
    attempt("lookup", lambda: master.lookup(keys))
    attempt("locate", lambda: master.locate(key))
    attempt("register+publish", lambda: master.register(node_id, "tcp://127.0.0.1:1", "attacker-host", tiers,
                                                          [poison], role=P.ROLE_STORAGE, persistent_tiers=["dram"]))
    attempt("publish", lambda: master.publish(node_id, [poison]))
    attempt("reserve", lambda: master.reserve(key, obj.total_nbytes, node_id))
    attempt("heartbeat", lambda: master.heartbeat(node_id, tiers))
    attempt("delete", lambda: master.delete(keys))
    master.close()
    ck = cluster_key[0]
    attempt("control stats", lambda: control_call(spec["control"], "stats", {}, timeout, cluster_key=ck))
    attempt("control replicate", lambda: control_call(spec["control"], "replicate", {
        "key": key, "spec": obj.to_wire(), "header_sum": 1, "source": "{}", "reservation": 1, "replicas": 1,
        "persistent": True,
    }, timeout, cluster_key=ck))

    def get() -> Any:
        pool = kvpool.connect(spec["master"], config=config)
        try:
            return pool.get(key) is not None
        finally:
            pool.close()
    attempt("get", get)
    _ = np  # numpy is what connect needs anyway; imported first so its import time is not counted


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # kvpool and tiers
    main(json.loads(sys.argv[1]))
    sys.stdout.flush()
    os._exit(0)  # no lingering UCX/ZeroMQ threads at exit
