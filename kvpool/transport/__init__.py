"""Pulling KV bytes between nodes over UCX (``ucxx``), and small pulls over plain TCP: the
transport package.

Modules: :mod:`.frames` (the wire format), :mod:`.engine` (one UCX context and
worker, its progress thread and caller-driven progress), :mod:`.server`
(:class:`PullServer`, :class:`ServeSource`), :mod:`.client` (:class:`PullClient`)
and :mod:`.tcp` (:class:`TcpPullServer`, :class:`TcpPullClient`: the same frames over a
TCP connection, for payloads where UCX from Python is the slower path; see its docstring).
The rest of this docstring is about UCX.

Owns the wire protocol and the UCX plumbing for one operation: a client names
``(key, layer range)`` and a :class:`PullServer` answers with exactly those
bytes, which land straight in the client's preallocated ``out`` buffer.
It does not own where bytes live or how keys are located: the node wires a
*provider* callback into the server (tiers -> :class:`ServeSource`), and the
pool asks the master which node to pull from.

Threads and progress
    An :class:`Engine` is one UCX context and worker driven by one dedicated thread; only
    that thread, or a caller waiting for its own pull that holds the engine's drive lock,
    makes UCX calls. A node creates one engine and hands it to its :class:`PullServer` and
    :class:`PullClient` (``engine=``), so a process has one worker and one progress thread;
    a server or client built without ``engine=`` makes its own. The thread progresses the
    worker in *blocking* mode: when nothing is left to do it arms the worker and sleeps in
    ``epoll_wait`` on the worker's event fd plus an eventfd used for wake-ups, never
    spinning (two busy-polling UCX processes sharing a vCPU turn round trips into
    milliseconds).

Wire protocol (all tag messages; tags are 64-bit and matched worker-wide)
    request  client -> server, tag ``REQUEST_TAG``: fixed header ``REQUEST``
             + key + (``auto`` transport only) the client's worker address.
    status   server -> client, tag ``request_id << 20``: ``STATUS`` + text.
             OK carries the payload size and the chunk size the server uses,
             and, when the request asked for it (``header_out``), the served
             object's packed header in place of the text: the reader checks it
             against the header checksum the master indexed, then every layer
             against it, so the master never has to hold whole headers.
    data     server -> client, tag ``request_id << 20 | i`` for chunk
             ``i = 1..n``: chunk ``i`` is bytes ``[(i-1)*chunk, i*chunk)`` of
             the payload. The client posts its receives straight into slices
             of ``out`` once the status arrives; UCX holds a rendezvous message
             until its receive is posted, so large chunks are never staged.
    abort    server -> client, tag ``request_id << 20 | 0xFFFFF``: a status
             frame sent instead of the remaining chunks when reading the
             object fails after OK went out (nvme path), once every chunk
             already posted has been delivered; the client cancels its
             receives for the chunks that will never come. Only a payload
             read while it is sent can fail so: its OK is
             ``STATUS_OK_MAY_ABORT``, and only then does the client post a
             receive for an abort frame (a payload from memory needs none).
    hello    client -> server over the UCX *stream* API, once per listener
             connection: 16 bytes naming the connection (``conn_id``, which
             every request repeats), because a worker-wide tag receive cannot
             tell which endpoint a request came from.

Transports
    ``"tcp"``: the client connects to the server's UCX listener
        (``host``, ``port``) with endpoint error handling on, so UCX detects a
        peer that dies (TCP reset, keepalive) and fails the pull at once.
    ``"auto"``: for a peer on the same host (same ``host_id``) the client
        connects to the server's *worker address* and the server replies to the
        client's worker address, both with error handling **off**, which lets
        UCX choose shared memory (posix/sysv/cma). UCX cannot detect a dead
        peer on such endpoints, so only the pull deadline (``timeout_s``)
        catches a holder that dies mid-pull; the server likewise drops a
        client that stops receiving after ``send_timeout_s``. Nor can closing
        such an endpoint stop a sender that is alive but stalled between
        UCX's rendezvous handshake and its copy into ``out`` (cross-memory
        writes come from the sender's side), so after a deadline on this path
        ``out`` is not guaranteed untouched. Peers on other hosts, or without
        a worker address, use the listener as with ``"tcp"``.

Failure rules
    A miss is answered with a MISS status (:class:`errors.RemoteMissError` at
    the client), a provider exception with an ERROR status carrying its text,
    a read that fails mid-pull with an abort frame; none of them hangs the
    client or costs the connection. Any transport error or deadline on an endpoint
    drops that endpoint from the client's cache and fails every pull still
    using it: UCX cancels their receives as the endpoint closes, so no late
    bytes land in an ``out`` buffer after its pull raised (on TCP; see the
    ``"auto"`` caveat above). A cancelled ``apull_into`` is not a failure of
    the endpoint: that pull finishes in the background instead. Callers still
    verify per-layer checksums.

UCX environment
    ``ucxx`` is imported at the first UCX use, not with this package. Importing
    it sets ``UCX_MEMTYPE_CACHE=n``, ``UCX_RNDV_THRESH=8192``
    and ``UCX_RNDV_FRAG_MEM_TYPE=cuda`` unless already set. kvpool then adds
    ``UCX_WARN_UNUSED_ENV_VARS=n`` (ucxx's own variable otherwise triggers a
    warning) and passes :data:`DEFAULT_UCX_OPTIONS` to its contexts unless the
    matching ``UCX_*`` variable is set, so the environment always wins. Every
    process of a pool must run with the same UCX options: with
    ``RNDV_SCHEME`` differing between client and server, listener connections
    were seen to fail ("no remote ep address for lane").
    Both ends pass ``NET_DEVICES`` = the interface holding their ``host``
    (:func:`ucx_interface_options`, e.g. ``lo`` for 127.0.0.1), so UCX's own
    TCP listener binds that address only. The ucxx 0.52 sockaddr listener
    cannot bind an address (it takes the wildcard): ``PullServer(listener=False)``
    has none, and clients reach it by worker address (``"tcp"``: with UCX
    peer-failure detection, the server replying with it too). Requests carry
    a pull token (at most 64 bytes) that ``authorize(key, token)`` checks
    before the provider runs; a refusal is STATUS_UNAUTHORIZED
    (:class:`errors.AuthenticationError`), never data. UCX trusts what peers send it (a malformed worker
    address aborts the process; both ends check addresses first, see
    :func:`plausible_worker_address`): keep UCX ports on a trusted network.
"""

from kvpool.transport.client import PullClient
from kvpool.transport.engine import (
    DEFAULT_UCX_OPTIONS,
    TRANSPORTS,
    Engine,
    interface_for_host,
    local_host_id,
    ucx_interface_options,
)
from kvpool.transport.frames import MAX_HEADER_NBYTES, PeerAddress, plausible_worker_address
from kvpool.transport.puller import Puller, Pulls
from kvpool.transport.pulls import PullRequest
from kvpool.transport.server import PullServer
from kvpool.transport.source import Provider, ProviderWouldBlock, ServeSource, in_inline_provider
from kvpool.transport.tcp import TcpPullClient, TcpPullServer

__all__ = [
    "DEFAULT_UCX_OPTIONS",
    "Engine",
    "MAX_HEADER_NBYTES",
    "PeerAddress",
    "Provider",
    "ProviderWouldBlock",
    "PullClient",
    "Puller",
    "Pulls",
    "PullRequest",
    "PullServer",
    "ServeSource",
    "TRANSPORTS",
    "TcpPullClient",
    "TcpPullServer",
    "in_inline_provider",
    "interface_for_host",
    "local_host_id",
    "plausible_worker_address",
    "ucx_interface_options",
]
