"""A node's heartbeats: :class:`Heartbeater`, on its own thread with its own master client.

Each beat tells the master the node is alive and how full its tiers are; the
reply says whether to register again (first contact, a master restart, a node
declared dead) and which keys other clients deleted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping

import zmq

from kvpool import errors
from kvpool.cluster.wire.master_client import MasterClient

log = logging.getLogger("kvpool.master_client")


class Heartbeater:
    """Beats for one node on its own thread, with its own client and socket.

    Each period it sends ``state_fn()`` (the node's tiers ``{name: {capacity,
    free}}``; keep it cheap: it runs under the GIL on this thread). When the
    master answers ``reregister`` (first contact, after a master restart, or
    after the node was declared dead) it calls ``on_reregister()``, which
    should :meth:`MasterClient.register` everything the node holds; starting a
    Heartbeater is therefore enough to get a node registered. Deletes the
    master relays go to ``on_delete(keys)`` and are acknowledged on the next
    beat once it returned. Callback errors and an unreachable master are
    logged and retried on the next beat; they never stop the thread.
    """

    def __init__(
        self,
        client_factory: Callable[[], MasterClient],
        node_id: str,
        period_s: float,
        state_fn: Callable[[], Mapping[str, Mapping[str, int]]],
        on_reregister: Callable[[], None],
        on_delete: Callable[[list[bytes]], None] | None = None,
        on_new_term: Callable[[float], None] | None = None,
    ) -> None:
        self.node_id = node_id
        self.period_s = period_s
        self._client_factory = client_factory
        self._state_fn = state_fn
        self._on_reregister = on_reregister
        self._on_delete = on_delete
        self._on_new_term = on_new_term
        self.term = 0  # the last master term whose takeover gap this node filled in (or registered in)
        self._wake = threading.Event()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=f"kvpool-heartbeat-{node_id[:8]}", daemon=True)
        self._delete_ack = 0
        self.beats = 0            # replies received
        self.reregistrations = 0  # on_reregister calls that returned
        self.reachable = False    # did the last beat get a reply?
        self._auth_warned = False

    def start(self) -> Heartbeater:
        self._thread.start()
        return self

    def beat_now(self) -> None:
        """Send the next heartbeat at once instead of at the end of the period."""
        self._wake.set()

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> Heartbeater:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _fill_in(self, term: int, since: float | None) -> None:
        """A new master term: publish again what this node changed at the master since ``since``
        (this clock; None: nothing asked), which a warm takeover may have missed. The next beat
        tells the master it is done; a failure is retried at the next beat."""
        if since is not None and self._on_new_term is not None:
            try:
                self._on_new_term(since)
            except errors.KVPoolError as exc:
                log.warning("node %s: publishing again for master term %d failed (%s); retrying next beat",
                            self.node_id[:8], term, exc)
                return
            except Exception:
                log.exception("node %s: publishing again for master term %d failed; retrying next beat",
                              self.node_id[:8], term)
                return
        self.term = term
        self._wake.set()  # tell the master at once: it stops asking once every node has

    def _run(self) -> None:
        client = self._client_factory()
        try:
            while not self._stopping:
                self._beat(client)
                # Blocks (no spinning) until the period ends, beat_now() or stop().
                self._wake.wait(self.period_s)
                self._wake.clear()
        finally:
            client.close()

    def _beat(self, client: MasterClient) -> None:
        sent = time.monotonic()
        try:
            reply = client.heartbeat(self.node_id, self._state_fn(), self._delete_ack, self.term)
        except errors.MasterUnreachableError as exc:
            if self.reachable:
                log.warning("node %s: heartbeat failed: %s", self.node_id[:8], exc)
            self.reachable = False
            return
        except errors.AuthenticationError as exc:  # logged once per outage, not at every beat
            if self.reachable or not self._auth_warned:
                log.error("node %s: heartbeat refused: %s", self.node_id[:8], exc)
            self._auth_warned = True
            self.reachable = False
            return
        except Exception as exc:
            if isinstance(exc, zmq.ZMQError) and exc.errno in (zmq.ENOTSOCK, zmq.ETERM):
                self._stopping = True  # its socket is gone: the process exits without close()
                return
            log.exception("node %s: heartbeat failed", self.node_id[:8])
            self.reachable = False
            return
        if not self.reachable:
            log.info("node %s: master at %s answers heartbeats", self.node_id[:8], client.address)
        self.reachable = True
        self.beats += 1
        if reply.reregister:
            try:
                self._on_reregister()
                self.reregistrations += 1
                self.term = reply.term  # everything this node holds is in that term's index
            except errors.KVPoolError as exc:  # typed (the master went away meanwhile): no traceback
                log.warning("node %s: re-registration failed (%s); retrying next beat", self.node_id[:8], exc)
            except Exception:
                log.exception("node %s: re-registration failed; retrying next beat", self.node_id[:8])
            return
        if reply.term != self.term:
            self._fill_in(reply.term, sent - reply.resend_s if reply.resend_s > 0 else None)
        if reply.delete:
            if self._on_delete is None:
                log.warning("node %s: %d deletes relayed but no on_delete handler", self.node_id[:8], len(reply.delete))
            else:
                try:
                    self._on_delete(reply.delete)
                except Exception:
                    log.exception("node %s: applying %d deletes failed", self.node_id[:8], len(reply.delete))
                    return
            self._delete_ack = reply.delete_seq
