"""Master leadership through etcd: a small etcd v3 client, the election, the leader finder.

kvpool keeps only *who leads* in etcd, never the index: the leader's address
lives under ``<master.etcd_prefix>/leader``, attached to the leader's lease,
and every master (leader or standby) announces itself under
``<prefix>/masters/<listen address>`` with the same lease. The index is
rebuilt on a new leader by the nodes re-registering what they hold, exactly as
after a master restart (see :mod:`kvpool.cluster.master.server`).

No split brain: a leader serves only while ``leading()``, which holds until the
time its last lease renewal was *sent* plus the TTL etcd granted, minus a safety
margin. etcd cannot expire the lease before that moment, and another master can
only win the key after etcd expired it, so a deposed leader (paused, cut off from
etcd) has stopped answering before anyone else starts.

The client speaks etcd's v3 JSON gateway over plain HTTP with the standard
library (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/lease/grant`` ...): no gRPC stack
whose generated code drifts with protobuf versions. Several endpoints may be
given; a request that cannot reach one tries the next.
"""

from __future__ import annotations

import base64
import http.client
import json
import logging
import os
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvpool import errors
from kvpool.config import parse_endpoints

log = logging.getLogger("kvpool.etcd")

# How often a standby (or a client that lost its leader) reads the leader key.
POLL_S = 0.2
# The request deadline of one etcd call.
REQUEST_TIMEOUT_S = 2.0


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


class EtcdClient:
    """Thread-safe client of the etcd v3 JSON gateway (one kept-alive HTTP connection)."""

    def __init__(self, urls: str, *, timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.urls = urls
        self.endpoints = parse_endpoints(urls)
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._conn: http.client.HTTPConnection | None = None
        self._current = 0  # index of the endpoint that answered last

    def _post(self, path: str, body: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """One request, answered by the first endpoint that can. ``timeout_s``: the most it may
        take in all, waiting for another thread's request included (None: ``self.timeout_s``
        per endpoint tried); CoordinatorError past it."""
        payload = json.dumps(body).encode()
        last: Exception | None = None
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._lock.acquire(timeout=-1 if timeout_s is None else max(0.0, timeout_s)):
            raise errors.CoordinatorError(f"etcd at {self.urls} did not answer {path} within {timeout_s:.3g} s "
                                          "(another request still waits for it)")
        try:
            for attempt in range(len(self.endpoints) + 1):  # every endpoint once, the current one twice
                wait_s = self.timeout_s
                if deadline is not None:
                    wait_s = min(wait_s, deadline - time.monotonic())
                    if wait_s <= 0:
                        last = last or TimeoutError(f"no time left within {timeout_s:.3g} s")
                        break
                if self._conn is None:
                    host, port = self.endpoints[self._current]
                    self._conn = http.client.HTTPConnection(host, port, timeout=wait_s)
                else:  # a kept-alive connection: this request's own deadline
                    self._conn.timeout = wait_s
                    if self._conn.sock is not None:
                        self._conn.sock.settimeout(wait_s)
                try:
                    self._conn.request("POST", path, payload, {"Content-Type": "application/json"})
                    response = self._conn.getresponse()
                    data = response.read()
                except (OSError, http.client.HTTPException) as exc:
                    last = exc
                    self._conn.close()
                    self._conn = None
                    if attempt:  # the first retry stays on this endpoint (a kept-alive connection went stale)
                        self._current = (self._current + 1) % len(self.endpoints)
                    continue
                if response.status != 200:
                    raise errors.CoordinatorError(
                        f"etcd {path} answered HTTP {response.status}: {data[:200].decode(errors='replace')}")
                try:
                    reply = json.loads(data)
                except ValueError:
                    raise errors.CoordinatorError(f"etcd {path}: reply is not JSON") from None
                if not isinstance(reply, dict):
                    raise errors.CoordinatorError(f"etcd {path}: unexpected reply {reply!r:.200}")
                return reply
        finally:
            self._lock.release()
        raise errors.CoordinatorError(f"etcd at {self.urls} is unreachable ({path}: {last})")

    def grant(self, ttl_s: int) -> tuple[int, int]:
        """A new lease: (id, TTL etcd granted, which may be longer than asked)."""
        reply = self._post("/v3/lease/grant", {"TTL": ttl_s})
        if reply.get("error"):
            raise errors.CoordinatorError(f"etcd lease grant: {reply['error']}")
        return int(reply["ID"]), int(reply.get("TTL", ttl_s))

    def keepalive(self, lease: int) -> int:
        """Renew ``lease``; the TTL it now has, 0 when it has expired (or was revoked)."""
        reply = self._post("/v3/lease/keepalive", {"ID": str(lease)})
        result = reply.get("result", reply)
        return int(result.get("TTL", 0)) if isinstance(result, dict) else 0

    def revoke(self, lease: int) -> None:
        self._post("/v3/lease/revoke", {"ID": str(lease)})

    def get(self, key: bytes, *, timeout_s: float | None = None) -> bytes | None:
        """The value of ``key``, None if it does not exist (``timeout_s``: see :meth:`_post`)."""
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}, timeout_s).get("kvs") or []
        try:
            return base64.b64decode(kvs[0].get("value", ""), validate=True) if kvs else None
        except (AttributeError, IndexError, KeyError, TypeError, ValueError):
            raise errors.CoordinatorError(f"etcd: unreadable value of {key!r:.200}") from None

    def delete(self, key: bytes) -> None:
        self._post("/v3/kv/deleterange", {"key": _b64(key)})

    def put(self, key: bytes, value: bytes, lease: int = 0) -> None:
        self._post("/v3/kv/put", {"key": _b64(key), "value": _b64(value), "lease": str(lease)})

    def list_prefix(self, prefix: bytes) -> list[tuple[bytes, bytes]]:
        end = prefix[:-1] + bytes([prefix[-1] + 1])
        kvs = self._post("/v3/kv/range", {"key": _b64(prefix), "range_end": _b64(end)}).get("kvs") or []
        return [(base64.b64decode(kv["key"]), base64.b64decode(kv.get("value", ""))) for kv in kvs]

    def get_versioned(self, key: bytes) -> tuple[bytes | None, int]:
        """(value, mod_revision) of ``key``; (None, 0) when it does not exist."""
        kvs = self._post("/v3/kv/range", {"key": _b64(key)}).get("kvs") or []
        if not kvs:
            return None, 0
        return base64.b64decode(kvs[0].get("value", "")), int(kvs[0].get("mod_revision", 0))

    def create(self, key: bytes, value: bytes, lease: int, *,
               and_put: tuple[bytes, bytes, int] | None = None) -> tuple[bool, bytes | None]:
        """Put ``key`` only if it does not exist: (True, None) when this call created it,
        else (False, the value it has, or None).

        ``and_put`` = (key2, value2, mod_revision): in the same transaction, put key2 (no
        lease) too, and only if key2's mod_revision is still that (0: key2 does not exist)."""
        k = _b64(key)
        compare = [{"target": "CREATE", "result": "EQUAL", "key": k, "create_revision": "0"}]
        success = [{"request_put": {"key": k, "value": _b64(value), "lease": str(lease)}}]
        if and_put is not None:
            k2, value2, revision2 = and_put
            compare.append({"target": "MOD", "result": "EQUAL", "key": _b64(k2), "mod_revision": str(revision2)})
            success.append({"request_put": {"key": _b64(k2), "value": _b64(value2)}})
        reply = self._post("/v3/kv/txn", {"compare": compare, "success": success,
                                          "failure": [{"request_range": {"key": k}}]})
        if reply.get("succeeded"):
            return True, None
        for response in reply.get("responses") or []:
            kvs = (response.get("response_range") or {}).get("kvs") or []
            if kvs:
                return False, base64.b64decode(kvs[0].get("value", ""))
        return False, None  # it vanished between compare and range: the caller campaigns again

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None


def leader_key(prefix: str) -> bytes:
    return f"{prefix.rstrip('/')}/leader".encode()


def term_key(prefix: str) -> bytes:
    """The cluster's last master term: raised by one, in the same etcd transaction, by each election won."""
    return f"{prefix.rstrip('/')}/term".encode()


def member_key(prefix: str, address: str) -> bytes:
    return f"{prefix.rstrip('/')}/masters/{address}".encode()


class Election:
    """Campaigns for leadership of the masters under ``prefix``; one thread.

    ``leading()`` is what the serving thread checks before every request; ``term`` is the
    cluster's term this process last won (one more than the one before, whichever master held
    it: kept in etcd beside the leader key; a new term starts with an empty index).
    """

    def __init__(self, client: EtcdClient, prefix: str, address: str, ttl_s: int,
                 clock: Callable[[], float] = time.monotonic, *, eligible: Callable[[], bool] | None = None,
                 cold_after_s: float = 0.0) -> None:
        self.client = client
        # A master for which eligible() is false (a standby without a recent copy of the
        # leader's state) campaigns only once no leader has been seen for cold_after_s.
        self.eligible = eligible
        self.cold_after_s = cold_after_s
        self._leaderless_since: float | None = None
        self._looked_up = -1.0
        self.prefix = prefix
        self.address = address
        self.ttl_s = ttl_s
        self.clock = clock
        self.term = 0
        self.leader: str | None = None  # the leader last seen in etcd (this process's address when leading)
        self._valid_until = 0.0        # serve requests until then (leader only)
        self._lease_valid_until = 0.0  # etcd cannot expire the lease before then
        self._lease = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvpool-election", daemon=True)

    def margin_s(self, ttl: int) -> float:
        """Stop serving this long before etcd could expire the lease (clock-rate skew, GC pauses)."""
        return min(1.0, 0.25 * ttl)

    def leading(self, now: float | None = None) -> bool:
        return (self.clock() if now is None else now) < self._valid_until

    def start(self) -> Election:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Step down (the lease is revoked, so a standby takes over at once) and stop campaigning."""
        self._stop.set()
        self._thread.join(self.ttl_s + REQUEST_TIMEOUT_S * 2)
        self._valid_until = 0.0
        if self._lease:
            try:
                self.client.revoke(self._lease)
            except errors.KVPoolError as exc:
                log.warning("could not revoke the master lease (etcd expires it within %d s): %s", self.ttl_s, exc)
        self.client.close()

    def _run(self) -> None:
        backoff = POLL_S
        while not self._stop.is_set():
            try:
                if self._lease == 0:
                    sent = self.clock()
                    self._lease, ttl = self.client.grant(self.ttl_s)
                    self.client.put(member_key(self.prefix, self.address), b"", self._lease)
                    self._renewed(sent, ttl)
                if self.leading():
                    self._hold()
                else:
                    self._campaign()
                backoff = POLL_S
            except errors.KVPoolError as exc:
                if self.leading():
                    log.warning("etcd: %s (still leading for %.1f s)", exc, self._valid_until - self.clock())
                else:
                    log.warning("etcd: %s", exc)
                self._stop.wait(backoff)
                backoff = min(2.0, backoff * 2)
            if self._lease and not self.leading() and self.leader == self.address:
                self._deposed("its lease ran out before it could be renewed")

    def _renewed(self, sent: float, ttl: int) -> None:
        self._lease_valid_until = sent + ttl - self.margin_s(ttl)

    def _campaign(self) -> None:
        sent = self.clock()
        ttl = self.client.keepalive(self._lease)  # the lease must be alive before it can win
        if ttl <= 0:
            self._lease = 0
            return
        self._renewed(sent, ttl)
        if self.eligible is not None and not self.eligible() and not self._may_lead_cold():
            return
        raw_term, term_revision = self.client.get_versioned(term_key(self.prefix))
        try:
            last_term = int(raw_term or b"0")
        except ValueError:  # written by hand: count on from nothing rather than refuse to lead
            last_term = 0
        won, current = self.client.create(leader_key(self.prefix), self.address.encode(), self._lease,
                                          and_put=(term_key(self.prefix), str(last_term + 1).encode(), term_revision))
        if won:
            self.term = last_term + 1
            self.leader = self.address
            self._valid_until = self._lease_valid_until
            log.info("elected master leader (term %d) through etcd at %s; lease TTL %d s", self.term,
                     self.client.urls, ttl)
            return
        leader = current.decode(errors="replace") if current else None
        if leader != self.leader:
            log.info("standby: the master leader is %s", leader or "(none: campaigning)")
        self.leader = leader
        self._stop.wait(min(POLL_S, self.ttl_s / 6))

    def known_leader(self) -> str | None:
        """The leader, for a standby's refusals: as last seen, or asked of etcd (at most every
        50 ms) while none has been seen yet."""
        now = self.clock()
        if self.leader is None and now - self._looked_up >= 0.05:
            self._looked_up = now
            try:
                current = self.client.get(leader_key(self.prefix))
            except errors.KVPoolError:
                return None
            return current.decode(errors="replace") if current else None
        return self.leader

    def _may_lead_cold(self) -> bool:
        """A master without a copy to lead from: True once no leader has been seen in etcd for
        cold_after_s (then it campaigns, and leads cold); meanwhile it notes the leader."""
        current = self.client.get(leader_key(self.prefix))
        now = self.clock()
        if current is not None:
            self._leaderless_since = None
            leader = current.decode(errors="replace")
            if leader != self.leader:
                log.info("standby: the master leader is %s", leader)
            self.leader = leader
        elif self._leaderless_since is None:
            self._leaderless_since = now
        elif now - self._leaderless_since >= self.cold_after_s:
            log.warning("no master leader for %.1f s and no standby copy of its state here: campaigning to "
                        "lead cold", now - self._leaderless_since)
            return True
        self._stop.wait(min(POLL_S, self.ttl_s / 6))
        return False

    def _hold(self) -> None:
        self._stop.wait(self.ttl_s / 4)
        if self._stop.is_set():
            return
        sent = self.clock()
        ttl = self.client.keepalive(self._lease)
        if ttl <= 0:
            self._deposed("etcd says its lease expired")
            return
        self._renewed(sent, ttl)
        # The key is attached to the lease, so it lives as long as the lease does, unless someone
        # deletes it by hand; then another master may create it: step down at once.
        if self.client.get(leader_key(self.prefix)) != self.address.encode():
            self._deposed("the leader key in etcd no longer names this master")
            return
        self._valid_until = self._lease_valid_until

    def _deposed(self, why: str) -> None:
        log.warning("deposed as master leader (term %d): %s; serving nothing until elected again", self.term, why)
        self._valid_until = 0.0
        lease, self._lease, self.leader = self._lease, 0, None
        try:  # if etcd still has it (it was only unreachable), the key is free for a standby at once
            self.client.revoke(lease)
        except errors.KVPoolError:
            pass


class LeaderFinder:
    """Where the master leader is, read from etcd (for clients and nodes with ``master.etcd``)."""

    def __init__(self, urls: str, prefix: str, *, min_interval_s: float = 0.05) -> None:
        self.client = EtcdClient(urls)
        self.key = leader_key(prefix)
        self.min_interval_s = min_interval_s
        self._lock = threading.Lock()
        self._address: str | None = None
        self._read_at = float("-inf")

    def describe(self) -> str:
        return f"the leader in etcd at {self.client.urls}"

    def current(self, timeout_s: float | None = None) -> str | None:
        """The leader last read (reads etcd once if it was never read; ``timeout_s``: see
        :meth:`refresh`)."""
        if self._address is None:
            return self.refresh(timeout_s)
        return self._address

    def refresh(self, timeout_s: float | None = None) -> str | None:
        """Read the leader key again (at most once per ``min_interval_s`` across threads).
        ``timeout_s``: the most this may take (None: the etcd client's timeout per endpoint);
        an etcd that does not answer in time, or at all, leaves the leader last read."""
        with self._lock:
            now = time.monotonic()
            if now - self._read_at < self.min_interval_s:
                return self._address
            self._read_at = now
        try:
            value = self.client.get(self.key, timeout_s=timeout_s)
        except errors.CoordinatorError as exc:
            log.debug("leader lookup failed: %s", exc)
            return self._address
        address = value.decode(errors="replace") if value else None
        if address != self._address and address is not None:
            log.info("master leader is %s", address)
        if address is not None:
            self._address = address
        return address

    def close(self) -> None:
        self.client.close()


def masters(urls: str, prefix: str) -> tuple[str | None, list[str]]:
    """(leader address, every master announced) for ``kvpool masters`` and tests."""
    client = EtcdClient(urls)
    try:
        leader = client.get(leader_key(prefix))
        base = member_key(prefix, "")
        announced = sorted(k[len(base):].decode(errors="replace") for k, _ in client.list_prefix(base))
        return (leader.decode(errors="replace") if leader else None), announced
    finally:
        client.close()


def check_address_for_etcd(listen: str, what: Sequence[str] = ("*", "0.0.0.0", "::")) -> None:
    """A master announced in etcd must be reachable at its listen address: no wildcard host."""
    m = re.match(r"^tcp://\[?([^\]]+)\]?:[0-9]+$", listen)
    if m and m.group(1) in what:
        raise errors.ConfigError(
            f"master.listen = {listen!r}: with master.etcd the listen address is what clients connect to; "
            f"give this host's address, not a wildcard")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the process that started it dies (Linux)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def start_demo_etcd(url: str, data_dir: str, timeout_s: float = 20.0) -> Any:
    """For ``kvpool-server --with-etcd``: a single-member etcd serving ``url`` (data in
    ``data_dir``), or None when one already answers there. Returns the started process
    (the caller stops it; if the caller is killed, the kernel stops it too). ConfigError
    when the etcd binary is missing or it does not start."""
    client = EtcdClient(url, timeout_s=1.0)
    try:
        try:
            client.get(b"/kvpool-probe")
            log.info("--with-etcd: etcd already answers at %s; using it", url)
            return None
        except errors.CoordinatorError:
            pass
        binary = shutil.which("etcd")
        if binary is None:
            raise errors.ConfigError("--with-etcd: no etcd binary on PATH (Debian/Ubuntu: apt-get install etcd-server)")
        host, port = parse_endpoints(url)[0]
        # A one-member cluster never hears from a peer, but etcd binds a peer port anyway: a free
        # one the system picks (port + 1, as before, was sometimes taken).
        with socket.socket() as probe:
            probe.bind((host, 0))
            peer = f"http://{host}:{probe.getsockname()[1]}"
        os.makedirs(data_dir, mode=0o700, exist_ok=True)
        with open(f"{data_dir}/etcd.log", "ab") as etcd_log:  # the child keeps its own descriptor
            process = subprocess.Popen(
                [binary, "--name", "kvpool-demo", "--data-dir", data_dir,
                 "--listen-client-urls", f"http://{host}:{port}", "--advertise-client-urls", f"http://{host}:{port}",
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"kvpool-demo={peer}"],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=etcd_log,
                preexec_fn=_die_with_parent)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.get(b"/kvpool-probe")
                log.info("--with-etcd: started etcd (pid %d) at %s, data in %s", process.pid, url, data_dir)
                return process
            except errors.CoordinatorError:
                if process.poll() is not None or time.monotonic() > deadline:
                    process.kill()
                    raise errors.ConfigError(
                        f"--with-etcd: etcd did not start at {url} (see {data_dir}/etcd.log)") from None
                time.sleep(0.1)
    finally:
        client.close()
