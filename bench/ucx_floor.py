"""The floor of a pull over ucxx from Python, with no kvpool code in the way.

:class:`BareResponder` (in the benchmark's server process, on its own thread) and
:class:`BareRequester` (in the client) exchange one 16-byte request (offset, size)
and one reply of that many bytes of the server's buffer, as tag messages on one
UCX worker each, progressed in blocking mode (epoll on the worker's event fd, as
kvpool's engine does). What a kvpool pull adds on top of this (request and status
frames, tokens, deadlines, the provider, completions on both sides) is the
difference between the two rows of ``bench/transfer_bench.py``.
"""

from __future__ import annotations

import select
import struct
import threading
from typing import Any

from kvpool.transport.engine import Array, effective_ucx_options, ucx_api

_REQUEST = struct.Struct("<QQQ")  # client id, offset, nbytes
_HELLO = struct.Struct("<QI")  # client id, address length; then the client's worker address
_TAG_HELLO, _TAG_REQUEST, _TAG_REPLY = 0xB0, 0xB1, 0xB2


class _Worker:
    """One UCX context and worker in blocking progress mode."""

    def __init__(self, options: dict[str, str] | None = None) -> None:
        self.context = ucx_api.UCXContext(effective_ucx_options(options),
                                          feature_flags=(ucx_api.Feature.TAG, ucx_api.Feature.WAKEUP))
        self.worker = ucx_api.UCXWorker(self.context)
        self.worker.init_blocking_progress_mode()
        self.epoll = select.epoll()
        self.epoll.register(self.worker.epoll_file_descriptor, select.EPOLLIN)

    def wait(self, requests: list[Any], timeout_s: float = 0.2) -> bool:
        """Progress until every request completes (True), or until ``timeout_s`` passes in one
        sleep with nothing done (False). Never spins: sleeps in epoll once the worker is armed."""
        while not all(r.completed for r in requests):
            self.worker.progress()
            if all(r.completed for r in requests):
                break
            if self.worker.arm() and not self.epoll.poll(timeout_s):
                return False
        for request in requests:
            request.check_error()
        return True

    def close(self) -> None:
        self.epoll.close()


class BareResponder:
    """Answers bare requests from ``view`` on a thread of its own until :meth:`close`."""

    def __init__(self, view: memoryview) -> None:
        self._view = view
        self._stop = threading.Event()
        self._ready = threading.Event()
        self.address = b""
        self._thread = threading.Thread(target=self._run, name="bare-ucxx-responder", daemon=True)
        self._thread.start()
        self._ready.wait(30)

    def _run(self) -> None:
        ucx = _Worker()
        self.address = ucx.worker.address.tobytes()
        self._ready.set()
        endpoints: dict[int, Any] = {}
        hello, request = bytearray(8192), bytearray(_REQUEST.size)
        hello_array, request_array = Array(hello), Array(request)
        hello_req = ucx.worker.tag_recv(hello_array, ucx_api.UCXXTag(_TAG_HELLO))
        request_req = ucx.worker.tag_recv(request_array, ucx_api.UCXXTag(_TAG_REQUEST))
        while not self._stop.is_set():
            ucx.worker.progress()
            if hello_req.completed:
                client, size = _HELLO.unpack_from(hello)
                address = ucx_api.UCXAddress.create_from_buffer(bytes(hello[_HELLO.size:_HELLO.size + size]))
                endpoints[client] = ucx.worker.create_endpoint_from_worker_address(address, False)
                hello_req = ucx.worker.tag_recv(hello_array, ucx_api.UCXXTag(_TAG_HELLO))
            elif request_req.completed:
                client, offset, nbytes = _REQUEST.unpack(request)
                request_req = ucx.worker.tag_recv(request_array, ucx_api.UCXXTag(_TAG_REQUEST))
                reply = Array(self._view[offset:offset + nbytes])
                while not ucx.wait([endpoints[client].tag_send(reply, ucx_api.UCXXTag(_TAG_REPLY))]):
                    if self._stop.is_set():
                        return
            elif ucx.worker.arm():
                ucx.epoll.poll(0.2)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


class BareRequester:
    """The client side: ``pull(offset, nbytes, out)`` is one request and its reply.
    ``options``: UCX options of its context (``{"TLS": "tcp,self"}`` keeps it on TCP)."""

    def __init__(self, server_address: bytes, client_id: int, options: dict[str, str] | None = None) -> None:
        self._ucx = _Worker(options)
        self._id = client_id
        address = ucx_api.UCXAddress.create_from_buffer(server_address)
        self._ep = self._ucx.worker.create_endpoint_from_worker_address(address, False)
        own = self._ucx.worker.address.tobytes()
        hello = bytearray(_HELLO.pack(client_id, len(own)) + own)
        self._ucx.wait([self._ep.tag_send(Array(hello), ucx_api.UCXXTag(_TAG_HELLO))], timeout_s=10)
        self._request = bytearray(_REQUEST.size)

    def pull(self, offset: int, nbytes: int, out: memoryview) -> None:
        _REQUEST.pack_into(self._request, 0, self._id, offset, nbytes)
        reply = self._ep.tag_recv(Array(out[:nbytes]), ucx_api.UCXXTag(_TAG_REPLY))
        send = self._ep.tag_send(Array(self._request), ucx_api.UCXXTag(_TAG_REQUEST))
        while not self._ucx.wait([reply, send], timeout_s=10):
            pass

    def close(self) -> None:
        self._ucx.close()
