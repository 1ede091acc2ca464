"""Pulls over a plain TCP connection (:class:`TcpPullServer`, :class:`TcpPullClient`): the data
path for payloads up to ``node.tcp_pull_max``.

Why a second data path
    Where UCX itself runs over TCP or shared memory (no RDMA device), a small pull over it
    from Python costs several wake-ups of each side's progress thread, where a blocking TCP
    socket costs one each way: for small payloads those wake-ups are most of a pull's time.
    For large ones the copy dominates, UCX over shared memory copies once where a socket copies
    twice, and RDMA is what UCX is for: large payloads stay on UCX. (Measurements:
    ``bench/transfer_bench.py``, docs/benchmarks.md.)

Wire (the UCX protocol's frames over one byte stream, :mod:`..frames`)
    A client keeps connections to a holder open. Each starts with a hello each way
    (:mod:`.stream`, see Security); then the client writes requests (``_REQUEST`` + key +
    token, no reply address) and the server answers each request, in the order sent, with
    a status frame (``_STATUS`` + failure text, or for an OK the served object's header when
    asked for) followed, for an OK, by exactly ``nbytes`` payload bytes. A read that fails
    after its OK went out (nvme) closes the connection, so the client sees the stream end
    short and fails that pull: nothing is ever taken for payload that was not. A client that
    stops reading for ``send_timeout_s`` is dropped.

Threads and system calls
    The server (:mod:`.server`) has one thread accepting and one per open connection, each
    blocked in ``recv`` or ``send`` (after answering a request, one connection's thread at a
    time first polls briefly for the next, see below). The client (:mod:`.client`) has none: the
    calling thread writes its requests and reads the replies, waking every ``alive_check_s``
    to ask whether the holder is still alive. Connections are kept per holder, one per
    concurrent caller. Sockets are blocking with kernel timeouts, so each read or write is
    one system call; a server reads every request that has arrived with one ``recv``; a
    reply's first receive lands its status, header and what came of its payload in place
    (``recvmsg_into``), and the rest of the payload comes with one receive per MiB that returns
    once that piece is whole (``MSG_WAITALL``), not one per segment that happened to be there.
    One pull can go in two steps (``start``, then ``finish``): its request goes out first, and
    the caller prepares the buffer its reply lands in while the holder answers. Each wait for a
    reply's status and header, and a server's wait for a connection's next request, is polled for,
    briefly, before the thread blocks (``poll_s``, :class:`.stream.ReplyPoll`, in C without the
    GIL: an idle vCPU is slow to wake); one thread of a client (of a server) polls at a time,
    and none while polls keep running out or being preempted.

Security
    The server binds ``host`` only (the node's address). A client opens every connection
    (:data:`.stream.PULL_HELLO`) with a hello carrying a fresh nonce; the server answers it
    with ``prove(nonce)`` and a nonce of its own, and the client sends nothing more before
    ``check_proof`` accepted that (:meth:`ClusterKey.holder_proof`): a process that took
    over a dead holder's port cannot hand out bytes. The client then answers the server's
    nonce (``prove``, :meth:`ClusterKey.reader_proof`; zeros without the key) ahead of its
    first requests. A client whose answer ``trust`` accepts holds the cluster key, so it
    could mint any pull token: its requests are served without one. Any other client's
    requests each carry the pull token that ``authorize(key, token)`` checks before the
    provider runs, as over UCX; a refusal is ``STATUS_UNAUTHORIZED``, never data. Nonces are
    fresh per connection, so a recorded hello cannot be replayed. The bytes are not encrypted.
"""

from kvpool.transport.tcp.client import TcpPullClient
from kvpool.transport.tcp.server import TcpPullServer
from kvpool.transport.tcp.stream import TcpPathUnusable

__all__ = ["TcpPathUnusable", "TcpPullClient", "TcpPullServer"]
