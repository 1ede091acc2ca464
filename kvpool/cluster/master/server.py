"""The master process: :class:`MasterServer` serves :class:`MasterState` over one ZeroMQ ROUTER
socket from one thread (see :mod:`kvpool.cluster.master.state` for the semantics); ``python -m
kvpool.cluster.master`` runs one.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import zmq

from kvpool import errors
from kvpool.cluster.master.bulk import BULK_MIN_BYTES, collector_paused, unpack_bulk
from kvpool.cluster.master.follow import ChangeLog, Follower
from kvpool.cluster.master.index import tune_process_memory
from kvpool.cluster.master.ops import MasterState
from kvpool.cluster.master.query_server import QueryServer
from kvpool.cluster.master.records import loggable
from kvpool.cluster.master.rereplicate import Rereplicator
from kvpool.cluster.wire import protocol as P
from kvpool.cluster.wire.etcd import Election, EtcdClient, check_address_for_etcd
from kvpool.cluster.wire.query import QUERY_OPS, query_host
from kvpool.cluster.wire.security import ClusterKey, stop_authenticator
from kvpool.config import Config, MasterSection, add_setting_flags, apply_setting_flags
from kvpool.transport.tcp.admission import raise_descriptor_limit

log = logging.getLogger("kvpool.master")


class MasterServer:
    """The ROUTER socket and the single thread that serves :class:`MasterState`."""

    election: Election | None = None  # with master.etcd: this master serves only while it leads
    follower: Follower[MasterState] | None = None  # with master.etcd: follows the leader's changes while standing by
    queries: QueryServer | None = None  # the query port (master.tcp_queries)

    def __init__(self, config: MasterSection, *, cluster_key: ClusterKey, max_key_bytes: int = 256) -> None:
        """The master's state, ready to answer request frames (:meth:`serve_frames`,
        :meth:`answer`); nothing bound or started: :meth:`start` binds ``config.listen``, joins
        the election (with ``master.etcd``) and opens the query port, and :meth:`serve` serves."""
        # Only holders of the cluster key get an answer: the key of the settings this master was
        # started with (a MasterSection has no [security]: its caller passes the key down).
        self.cluster_key = cluster_key
        self.config = config
        self.max_key_bytes = max_key_bytes
        # (ZeroMQ starts a context's I/O thread with its first socket, in start())
        self._context = zmq.Context(io_threads=1)
        self._context.setsockopt(zmq.LINGER, 0)
        self.state, self.rereplicator = self._fresh_state()
        self._socket: zmq.Socket[bytes] | None = None
        self.endpoint: str = ""  # the bound address, once started
        # With master.etcd this master serves only while it leads (see kvpool.cluster.wire.etcd); a
        # standby answers every request with NotLeaderError naming the leader.
        self._term = 0
        # One request at a time: the ZeroMQ loop holds this for each of its turns, the query
        # port's threads for each of their questions (and a standby's follower for each change).
        self._turn = threading.Lock()
        # Timers (dead nodes, reservation and lease expiry) run at least this
        # often; between requests the socket poll blocks for at most this long.
        heartbeat_s = config.heartbeat_ms / 1000
        self.tick_s = max(0.01, min(0.25, heartbeat_s / 2))

    def start(self) -> MasterServer:
        """Bind ``master.listen`` (ConfigError when it cannot be bound), with ``master.etcd``
        join the election and follow the leader while standing by, and open the query port
        (``master.tcp_queries``). Returns this server; :meth:`close` undoes it all."""
        config = self.config
        raise_descriptor_limit()  # before any socket: the query port's cap is sized from it
        self._socket = socket = self._context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.LINGER, 0)
        self.cluster_key.secure_server(socket)
        # A larger message is dropped by ZeroMQ before it is read (the peer is disconnected).
        socket.setsockopt(zmq.MAXMSGSIZE, config.max_request_bytes)
        try:
            socket.bind(config.listen)
        except zmq.ZMQError as exc:
            self.close()
            raise errors.ConfigError(f"master.listen = {config.listen!r}: cannot bind: {exc}") from None
        self.endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        if config.etcd:
            try:
                check_address_for_etcd(self.endpoint)
            except errors.ConfigError:
                self.close()
                raise
            # A standby follows the leader's changes (kvpool.cluster.master.follow) and campaigns only
            # with a copy the leader answered for lately, or once no leader has come for a while.
            window_s = 2.0 * config.leader_ttl_s + 2.0
            self.follower = Follower(self, window_s)
            self.election = Election(EtcdClient(config.etcd), config.etcd_prefix, self.endpoint,
                                     config.leader_ttl_s, eligible=self.follower.eligible,
                                     cold_after_s=config.leader_ttl_s + 1.0).start()
            self.follower.start()
        if config.tcp_queries:
            try:
                self.queries = QueryServer(self._answer_query, query_host(self.endpoint), self.cluster_key)
            except OSError as exc:  # ZeroMQ alone still serves everything
                log.warning("no query port on %s: %s", query_host(self.endpoint), exc)
            else:
                self.state.query_port = self.queries.port
        return self

    def _fresh_state(self) -> tuple[MasterState, Rereplicator]:
        state = self.new_state()
        return state, Rereplicator(state, self._context, self.config, self.cluster_key)

    def turn(self) -> threading.Lock:
        """The lock that makes the served state change one request at a time: hold it to change
        the state from a thread of one's own (a standby's follower applying the leader's changes)."""
        return self._turn

    def new_state(self) -> MasterState:
        state = MasterState(self.config, max_key_bytes=self.max_key_bytes)
        state.cluster_key = self.cluster_key
        state.query_port = self.queries.port if self.queries is not None else 0
        return state

    def adopt(self, state: MasterState) -> None:
        """Serve ``state`` from now on (a standby's copy of the leader's; under the turn)."""
        self.rereplicator.close()
        state.query_port = self.state.query_port
        self.state, self.rereplicator = state, Rereplicator(state, self._context, self.config, self.cluster_key)

    def leading(self) -> bool:
        """Serve requests now? Always without etcd; with it, only while this master's term lasts.
        A term starts warm from the copy this master followed as a standby, or cold from an
        empty index that the nodes' re-registration rebuilds (see kvpool.cluster.master.follow)."""
        election = self.election
        if election is None:
            return True
        if election.term != self._term:
            self._term = election.term
            self._take_over(election)
        return election.leading()

    def _take_over(self, election: Election) -> None:
        follower = self.follower
        now = time.monotonic()
        warm = follower is not None and follower.eligible()
        if warm:
            assert follower is not None
            state = self.state
            # The nodes it knows beat to this master from now on: none is dead for the silence
            # of the takeover, and re-replication waits as after a restart.
            state.started = now
            for node in state.nodes.values():
                if node.alive:
                    node.last_seen = now
            self.rereplicator.close()
            self.rereplicator = Rereplicator(state, self._context, self.config, self.cluster_key)
            # The copy may lack what the last leader changed after the standby's last complete
            # answer: every node publishes again what it changed since then (see follow.py).
            state.resend_from = min(follower.covered_at, follower.resend_before or follower.covered_at)
            why = (f"warm: {len(state.index):,} keys of {sum(n.alive for n in state.nodes.values())} nodes "
                   f"followed from the last leader up to its change {follower.seq}, complete as of "
                   f"{now - follower.covered_at:.2f} s before; the nodes publish again what they changed in the "
                   f"last {now - state.resend_from:.2f} s")
        else:
            self.rereplicator.close()
            self.state, self.rereplicator = self._fresh_state()
            why = ("cold: " + ("no leader was followed" if follower is None or not follower.loaded else
                               f"the followed copy is {now - follower.answered_at:.1f} s old") +
                   "; nodes re-register what they hold")
        state = self.state
        state.term = self._term
        state.record_changes(ChangeLog())
        state.ha = {"etcd": election.client.urls, "prefix": election.prefix, "term": self._term,
                    "endpoint": self.endpoint}
        state.takeover = {"warm": warm, "term": self._term, "keys": len(state.index), "how": why}
        if follower is not None:
            state.takeover["followed_change"] = follower.seq
            follower.forget()
        (log.info if warm else log.warning)("serving as master leader, term %d, %s", self._term, why)

    def serve(self, stop_event: threading.Event) -> None:
        """Serve requests until ``stop_event`` is set (after :meth:`start`)."""
        assert self._socket is not None, "MasterServer.serve before start()"
        sock, tick_s = self._socket, self.tick_s
        # A blocking recv with a timeout is one call per request when busy (a
        # poll and a failing non-blocking recv would be three) and wakes up at
        # least every tick when idle, so timers and stop_event are noticed.
        sock.setsockopt(zmq.RCVTIMEO, max(1, int(tick_s * 1000)))
        next_sweep = time.monotonic() + tick_s
        while not stop_event.is_set():
            try:
                frames = sock.recv_multipart()
            except zmq.Again:
                frames = None
            with self._turn:
                if frames is not None:
                    try:
                        sock.send_multipart(self.serve_frames(frames), zmq.NOBLOCK)
                    except zmq.Again:  # that peer's queue is full: it will time out and retry
                        pass
                now = time.monotonic()
                state = self.state
                # A turn longer than the receive timeout (a large request, a slow sweep, a GC
                # pause) is time the nodes' heartbeats spent queued: not held against them.
                state.note_turn(now, tick_s)
                if now >= next_sweep and self.leading():
                    state.sweep(now)
                    self.rereplicator.round(now)
                    next_sweep = now + tick_s

    def _answer_query(self, frame: bytes) -> bytes:
        """One request frame from the query port, answered if it is a question. An exists or
        lookup is decoded in one step, outside the turn; anything else the general way."""
        request = P.unpack_question(frame)
        with self._turn:
            return self.answer(frame, request, questions_only=True)

    def serve_frames(self, frames: list[bytes]) -> list[bytes]:
        """One routed request in, one routed reply out (errors become typed replies)."""
        # REQ peers put an empty delimiter after their identity; DEALER peers need not.
        split = 2 if len(frames) >= 3 and frames[1] == b"" else 1
        envelope, payload = frames[:split], frames[split:]
        if len(payload) != 1:
            malformed = P.MalformedRequest(f"expected one message frame after the envelope, got {len(payload)}")
            return [*envelope, self._refused(malformed, None)]
        return [*envelope, self.answer(payload[0])]

    def answer(self, frame: bytes, request: P.Request | None = None, *, questions_only: bool = False) -> bytes:
        """The reply frame to one request frame (``request``: the frame already parsed); errors
        become typed replies. ``questions_only``: anything but :data:`QUERY_OPS` is refused."""
        request_id: Any = None
        op = "?"
        try:
            if request is None:
                request = unpack_bulk(frame) or P.unpack_request(frame)
            request_id, op = request.request_id, request.op
            if questions_only and op not in QUERY_OPS:
                raise P.MalformedRequest(
                    f"{op} is not answered on the query port (only {', '.join(sorted(QUERY_OPS))})", request_id)
            if not self.leading():
                leader = self.election.known_leader() if self.election is not None else None
                raise errors.NotLeaderError(
                    f"master {self.endpoint} is a standby; the leader is {leader or '(being elected)'}")
            if len(frame) >= BULK_MIN_BYTES:
                with collector_paused():
                    return P.pack_reply(request_id, self.state.handle(op, request.body))
            return P.pack_reply(request_id, self.state.handle(op, request.body))
        except errors.KVPoolError as exc:
            return self._refused(exc, request_id)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            # A body shaped wrong in a way the validators did not name.
            self.state.counters["protocol_errors"] += 1
            return P.pack_error(request_id, "ProtocolError",
                                f"malformed {op} body: {type(exc).__name__}: {loggable(str(exc))}")
        except Exception as exc:  # keep serving: one bad request must not take the master down
            log.exception("internal error serving %s", op)
            self.state.counters["errors"] += 1
            return P.pack_error(request_id, "KVPoolError", f"internal master error in {op}: {loggable(repr(exc))}")

    def _refused(self, exc: errors.KVPoolError, request_id: Any) -> bytes:
        """The error reply to a request refused with ``exc`` (a MalformedRequest: a ProtocolError
        echoing the id it read, if any)."""
        if isinstance(exc, P.MalformedRequest):
            self.state.counters["protocol_errors"] += 1
            return P.pack_error(exc.request_id if exc.request_id is not None else request_id, "ProtocolError",
                                str(exc))
        self.state.counters["errors"] += 1
        return P.pack_error(request_id, type(exc).__name__, str(exc.args[0]) if exc.args else "")

    def close(self) -> None:
        if self.queries is not None:
            self.queries.close()
        if self.follower is not None:
            self.follower.stop()
        if self.election is not None:
            self.election.stop()  # the lease is revoked: a standby takes over at once
        self.rereplicator.close()
        if self._socket is not None:
            self._socket.close(linger=0)
        stop_authenticator(self._context)  # its ZAP thread holds a socket of this context
        # destroy(): closes whatever socket is still open (a worker that did not stop in
        # time) instead of waiting for it forever, as term() would.
        self._context.destroy(linger=0)


def run_master(
    config: Config | str | os.PathLike[str] | None = None,
    stop_event: threading.Event | None = None,
    *,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Serve until ``stop_event`` is set (or SIGTERM/SIGINT when none is given).

    Signal handlers are only installed when no ``stop_event`` is passed and this
    runs on the main thread; a daemon that owns signals passes its own event.
    ``on_ready`` gets the bound endpoint once requests are being accepted.
    Raises ConfigError when the listen address cannot be bound.
    """
    full = Config.load(config)  # the whole config: [master] and the [security] its key comes from
    section = full.master
    tune_process_memory()
    stop = stop_event if stop_event is not None else threading.Event()
    previous: dict[signal.Signals, Any] = {}
    if stop_event is None and threading.current_thread() is threading.main_thread():
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous[signum] = signal.signal(signum, lambda *_: stop.set())
    cluster_key = ClusterKey.from_config(full)
    server = MasterServer(section, max_key_bytes=full.pool.max_key_bytes, cluster_key=cluster_key).start()
    try:
        (log.info if cluster_key.enabled else log.warning)(
            "kvpool master authenticates with %s", cluster_key.describe())
        log.info(
            "kvpool master listening on %s (protocol v%d, heartbeat %d ms x %d, lease %.1f s)%s",
            server.endpoint, P.PROTOCOL_VERSION, section.heartbeat_ms,
            section.dead_after_missed, section.lease_s,
            f"; campaigning for leadership in etcd at {section.etcd} ({section.etcd_prefix})"
            if section.etcd else "",
        )
        if on_ready is not None:
            on_ready(server.endpoint)
        server.serve(stop)
    finally:
        server.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        log.info("kvpool master on %s stopped", server.endpoint)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvpool.cluster.master", description="kvpool metadata master")
    parser.add_argument("--listen", help="ZeroMQ address to bind (overrides master.listen)")
    parser.add_argument("--config", help="TOML config file")
    parser.add_argument("--log-level", default="INFO")
    add_setting_flags(parser)
    args = parser.parse_args(None if argv is None else list(argv))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        config = Config.load(args.config)
        apply_setting_flags(config, args)
        if args.listen:
            config.set("master.listen", args.listen)
        run_master(config)
    except errors.ConfigError as exc:
        log.error("%s", exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

