"""One way to ask a holder for bytes.

:class:`Puller` is the interface both pull clients implement: :class:`~kvpool.transport.PullClient`
(UCX: TCP, shared memory, RDMA as UCX finds them) and :class:`~kvpool.transport.TcpPullClient`
(the holder's plain TCP port). :class:`Pulls` owns the choice between them for each pull and
the fallback: plain TCP for a pull of at most ``tcp_pull_max`` bytes from a holder that serves
it (and whose port worked lately) or of any size from a holder that has no UCX address yet (a
client node starts UCX only once it wants it), UCX for the rest and for any pull whose TCP path proves
unusable (:class:`~kvpool.transport.tcp.TcpPathUnusable`). Its callers (the reader, a node
copying replicas) ask for bytes from a holder and never name a transport.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from kvpool.objformat import LayerRange
from kvpool.transport.client import PullClient
from kvpool.transport.engine import Engine
from kvpool.transport.frames import PeerAddress
from kvpool.transport.pulls import PullRequest
from kvpool.transport.tcp import TcpPathUnusable, TcpPullClient

#: the most bytes pulled over plain TCP from a holder that UCX reaches by shared memory
#: (``transport="auto"``): above it UCX's shared memory was faster (bench/transfer_bench.py)
SAME_HOST_TCP_PULL_MAX = 1 << 20


class StartedPull(Protocol):
    """A pull whose request is on its way (:meth:`Puller.start`) and whose reply lands in a buffer
    the caller names now: exactly one of :meth:`finish` or :meth:`cancel` is called."""

    def finish(self, out: Any, header_out: bytearray | None = None, *,
               progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """Receive the reply into ``out`` (and the header into ``header_out``); the bytes received,
        or the errors of :meth:`Puller.pull`."""
        ...

    def cancel(self) -> None:
        """Drop the pull; its reply is never read."""
        ...


class Puller(Protocol):
    """Pulls layer ranges of keys from holders into the caller's buffers: what every transport's
    client implements and all :class:`Pulls` (and the reader above it) knows of one."""

    @property
    def proves_holder(self) -> bool:
        """Whether every holder this client pulls from first proves it holds the cluster key (then
        its answer may be used before the master confirms the holder)."""
        ...

    def pull(self, address: PeerAddress | tuple[str, int], key: bytes,
             layer_range: LayerRange | tuple[int, int] | range, out: Any, *, timeout_s: float = 10.0,
             token: bytes = b"", header_out: bytearray | None = None,
             progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> int:
        """One pull: ``layer_range`` of ``key`` from the holder at ``address`` into ``out`` (its
        header into ``header_out``; ``progress`` told the payload bytes as they land, where the
        transport can), abandoned once ``alive()`` says the holder is gone; the request carries
        ``token``. The bytes received; raises the typed error of a miss, a bad
        range or buffer, a refused token, a transport failure or the deadline (see
        ``PullClient.pull_into``)."""
        ...

    def pull_many(self, requests: Sequence[PullRequest], *, timeout_s: float = 10.0,
                  alive_check_s: float = 0.05) -> list[int | BaseException]:
        """Pulls in flight together: one result per request, in order, the bytes received or the
        error :meth:`pull` raises."""
        ...

    def start(self, address: PeerAddress | tuple[str, int], key: bytes,
              layer_range: LayerRange | tuple[int, int] | range, nbytes: int, *, token: bytes = b"",
              timeout_s: float = 10.0) -> StartedPull:
        """:meth:`pull` in two steps: the request for ``nbytes`` of payload (sent now where the
        transport can), then :meth:`StartedPull.finish` with the buffer the caller prepared
        meanwhile. Raises the argument errors of :meth:`pull`; every other failure is finish's."""
        ...

    def stats(self) -> dict[str, int]:
        """Counters of this client (pulls, failures, timeouts, bytes received, ...)."""
        ...

    def close(self) -> None:
        """Fail pulls in flight and release connections and threads."""
        ...


class Pulls:
    """The pull clients of one reader or node and the choice between them (see the module).

    The UCX client is made at the first pull over UCX (a reader whose pulls all go over plain
    TCP, a CLI ``kvpool get``, never imports ucxx). ``engine``: the process's UCX engine, or
    what makes it (a node's ``ucx_engine``), called then. ``check_proof``/``prove``: TCP pulls go only
    to holders that prove they hold the cluster key, and this end proves it in turn.
    ``same_host_tcp_pull_max``: the TCP limit for a same-host holder that UCX reaches by shared
    memory (None: ``tcp_pull_max`` for every holder). ``counters["tcp_fallbacks"]`` counts pulls
    moved to UCX because their TCP path proved unusable.
    """

    def __init__(self, host_id: str, *, transport: str = "auto", max_message: int = 16 << 20,
                 host: str = "127.0.0.1", engine: Engine | Callable[[], Engine] | None = None,
                 tcp_pull_max: int = 0,
                 check_proof: Callable[[bytes, bytes], bool] | None = None,
                 prove: Callable[[bytes], bytes] | None = None, poll_s: float = 0.0,
                 same_host_tcp_pull_max: int | None = SAME_HOST_TCP_PULL_MAX,
                 counters: Counter[str] | None = None) -> None:
        self.host_id = host_id
        self.transport = transport
        self.tcp_pull_max = tcp_pull_max
        self.same_host_tcp_pull_max = same_host_tcp_pull_max
        self.counters: Counter[str] = counters if counters is not None else Counter()
        self._max_message = max_message
        self._host = host
        self._engine = engine
        self._ucx: PullClient | None = None
        self._lock = threading.Lock()
        self._check_proof, self._prove, self._poll_s = check_proof, prove, poll_s
        # With tcp_pull_max 0, made only for a holder that serves TCP pulls alone (client_for).
        self.tcp: TcpPullClient | None = self._make_tcp() if tcp_pull_max else None

    def _make_tcp(self) -> TcpPullClient:
        return TcpPullClient(check_proof=self._check_proof, prove=self._prove, poll_s=self._poll_s)

    @property
    def ucx(self) -> PullClient:
        """The UCX pull client, made on first use."""
        if self._ucx is None:
            with self._lock:
                if self._ucx is None:
                    engine = self._engine() if callable(self._engine) else self._engine
                    self._ucx = PullClient(transport=self.transport, max_message=self._max_message,
                                           host=self._host, engine=engine)
        return self._ucx

    def client_for(self, peer: PeerAddress | tuple[str, int], nbytes: int) -> Puller:
        """The client a pull of ``nbytes`` from ``peer`` goes over (see the module)."""
        if not isinstance(peer, PeerAddress):
            return self.ucx
        if peer.tcp_port and not (peer.port or peer.worker_address):
            # A client node that has not started UCX: TCP whatever the size, also with tcp_pull_max 0.
            if self.tcp is None:
                with self._lock:
                    if self.tcp is None:
                        self.tcp = self._make_tcp()
            if self.tcp.reachable(peer):
                return self.tcp
        tcp = self.tcp
        if tcp is None:
            return self.ucx
        limit = self.tcp_pull_max
        if (self.same_host_tcp_pull_max is not None and self.transport == "auto"
                and peer.host_id == self.host_id and peer.worker_address):
            limit = min(limit, self.same_host_tcp_pull_max)
        return tcp if nbytes <= limit and tcp.reachable(peer) else self.ucx

    def pull(self, peer: PeerAddress | tuple[str, int], key: bytes, layer_range: LayerRange, out: Any, *,
             timeout_s: float, token: bytes = b"", header_out: bytearray | None = None,
             progress: Callable[[int], None] | None = None, alive: Callable[[], bool] | None = None) -> None:
        """One pull into ``out`` (the holder's header into ``header_out``; ``progress`` told the
        bytes so far as they arrive over TCP), abandoned once ``alive()`` says the holder is
        gone; raises what :meth:`Puller.pull` raises."""
        client = self.client_for(peer, out.nbytes)
        try:
            client.pull(peer, key, layer_range, out, timeout_s=timeout_s, token=token, header_out=header_out,
                        progress=progress, alive=alive)
            return
        except TcpPathUnusable:  # that path is unusable: over UCX, as pull_many would
            if client is self._ucx:
                raise
            self.counters["tcp_fallbacks"] += 1
        self.ucx.pull(peer, key, layer_range, out, timeout_s=timeout_s, token=token, header_out=header_out,
                      alive=alive)

    def pull_many(self, requests: Sequence[PullRequest], *, timeout_s: float) -> list[int | BaseException]:
        """Pulls in flight together: one result per request, the bytes received or the error.
        Each client's share goes together, UCX's last: those whose path proved unusable go over
        UCX with the rest."""
        results: list[int | BaseException | None] = [None] * len(requests)
        shares: dict[int, tuple[Puller, list[int]]] = {}  # id(client) -> (client, request indices)
        for i, request in enumerate(requests):
            client = self.client_for(request.address, request.out.nbytes)
            shares.setdefault(id(client), (client, []))[1].append(i)
        over_ucx: list[int] = []
        for client, share in shares.values():
            if client is self._ucx:
                over_ucx += share
                continue
            for i, outcome in zip(share, client.pull_many([requests[i] for i in share], timeout_s=timeout_s)):
                if isinstance(outcome, TcpPathUnusable):
                    self.counters["tcp_fallbacks"] += 1
                    over_ucx.append(i)
                else:
                    results[i] = outcome
        if over_ucx:
            over_ucx.sort()
            for i, outcome in zip(over_ucx, self.ucx.pull_many([requests[i] for i in over_ucx], timeout_s=timeout_s)):
                results[i] = outcome
        done: list[int | BaseException] = []
        for result in results:
            assert result is not None  # every request went over one client or the other
            done.append(result)
        return done

    # -- a pull from a holder that proves itself, in two steps ------------------------------------

    def proving_client(self, peer: PeerAddress | tuple[str, int], nbytes: int) -> Puller | None:
        """The client a pull of ``nbytes`` from ``peer`` goes over if it pulls only from holders
        that first prove they hold the cluster key (:attr:`Puller.proves_holder`), else None.
        Its pull may be used as the holder answers, and needs no token (this end proves the key
        in turn); start it with :meth:`Puller.start`."""
        client = self.client_for(peer, nbytes)
        return client if client.proves_holder else None

    @staticmethod
    def path_unusable(exc: BaseException) -> bool:
        """Whether ``exc`` says the way to the holder could not be used (nothing was asked of it:
        the caller may get the bytes another way); not a miss, not a failure of the holder."""
        return isinstance(exc, TcpPathUnusable)

    # -- pooled connections ------------------------------------------------------------------------

    def sweep(self, alive: Collection[PeerAddress] | None = None) -> int:
        """Close pooled connections that can no longer serve: TCP ones whose holder hung up and,
        with ``alive`` (every node the master lists alive), TCP connections and idle UCX
        endpoints to any other holder (nodes that left or died). Never blocks; run it
        periodically (a node's neighbour watch, a storage node's peer sweep). Returns how many
        TCP connections it closed."""
        tcp_ports = None if alive is None else {(a.host, a.tcp_port) for a in alive if a.tcp_port}
        closed = 0
        if self.tcp is not None:
            closed = self.tcp.sweep(None if tcp_ports is None else tcp_ports.__contains__)
        if alive is not None and self._ucx is not None:
            self._ucx.forget_peers_except(alive)
        return closed

    def idle_connections(self, older_than_s: float = 0.0) -> int:
        """TCP connections waiting in the pool, idle for more than ``older_than_s``."""
        return self.tcp.idle_connections(older_than_s) if self.tcp is not None else 0

    def stats(self) -> dict[str, Any]:
        ucx = (self._ucx.stats() if self._ucx is not None  # none yet: nothing pulled over UCX
               else {"peers": 0, "connects_failed": 0, "connects_skipped": 0, "pulls": 0, "failures": 0,
                     "timeouts": 0, "bytes_received": 0})
        return {"pull_client": ucx, "tcp_pull_client": self.tcp.stats() if self.tcp is not None else {}}

    def close(self) -> None:
        if self._ucx is not None:
            self._ucx.close()
        if self.tcp is not None:
            self.tcp.close()


if TYPE_CHECKING:  # both clients implement the interface (checked by mypy, no cost at run time)
    from kvpool.transport.client import DeferredPull
    from kvpool.transport.tcp.client import TcpPull

    def _conforms(ucx: PullClient, tcp: TcpPullClient, deferred: DeferredPull,
                  sent: TcpPull) -> tuple[Puller, Puller, StartedPull, StartedPull]:
        return ucx, tcp, deferred, sent
