"""Re-replication: restores durable keys' copy counts off the master's request loop."""

from __future__ import annotations

import logging
import queue
import threading
from functools import partial
from typing import Any

import zmq

from kvpool import errors
from kvpool.cluster.master.ops import MasterState
from kvpool.cluster.master.records import REREPLICATE_MAX_IN_FLIGHT, REREPLICATE_WORKERS, RereplicationTask, loggable
from kvpool.cluster.wire import schema as S
from kvpool.cluster.wire.control import control_call
from kvpool.cluster.wire.security import ClusterKey
from kvpool.config import MasterSection

log = logging.getLogger("kvpool.master")


class Rereplicator:
    """Restores durable keys' copy counts without ever blocking the master's request loop.

    :meth:`round` runs on the serving thread (it alone touches :class:`MasterState`):
    it applies finished copies, then plans new ones within the rate limit (a token
    bucket of ``rereplicate_per_s``) and hands them to worker threads, which only
    talk to the targets' control sockets (each a socket of its own) and report back
    through a queue. The target commits its copy to the master itself before it
    answers, over the master's normal request path.
    """

    def __init__(self, state: MasterState, context: zmq.Context[Any], config: MasterSection,
                 cluster_key: ClusterKey) -> None:
        self.state = state
        self.cluster_key = cluster_key
        self.rate = config.rereplicate_per_s
        self.timeout_s = config.rereplicate_timeout_s
        self._context = context
        self._tokens = max(1.0, self.rate)
        self._burst = max(1.0, self.rate)
        self._refilled = state.clock()
        self._todo: queue.SimpleQueue[RereplicationTask | None] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[tuple[RereplicationTask, str | None]] = queue.SimpleQueue()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.in_flight = 0
        # Targets no longer alive, so a worker waiting on one gives up (replaced, never mutated).
        self._gone: frozenset[str] = frozenset()

    def round(self, now: float) -> None:
        state = self.state
        done = failed = 0
        last_error = ""
        while True:
            try:
                task, error = self._done.get_nowait()
            except queue.Empty:
                break
            self.in_flight -= 1
            state.finish_rereplication(task, error, now)
            if error is None:
                done += 1
            else:
                failed += 1
                last_error = f"{task.key.hex()[:16]} -> {task.target_label}: {loggable(error)}"
        if self.in_flight:
            self._gone = frozenset(nid for nid, n in state.nodes.items() if not n.alive)
        started: list[RereplicationTask] = []
        lost = waiting = 0
        # Just after a (re)start, nodes are still re-registering what they hold: copies
        # counted short now may only be unregistered yet.
        settled = now - state.started >= state.dead_after_s
        if self.rate > 0 and state.to_check and settled:
            self._tokens = min(self._burst, self._tokens + (now - self._refilled) * self.rate)
            self._refilled = now
            limit = min(int(self._tokens), REREPLICATE_MAX_IN_FLIGHT - self.in_flight)
            if limit > 0:
                started, lost, waiting = state.plan_rereplication(now, limit)
        else:
            self._refilled = now
        for task in started:
            self._start_workers()
            self._tokens -= 1
            self.in_flight += 1
            self._todo.put(task)
        if started or done or failed or lost:
            log.info(
                "re-replication: %d copies started, %d done, %d failed%s; %d keys without a live holder, "
                "%d waiting for a storage node; %d under-replicated, %d copies in flight",
                len(started), done, failed, f" (last: {last_error})" if last_error else "", lost, waiting,
                len(state.to_check) + len(state.rereplicating), self.in_flight,
            )

    def _start_workers(self) -> None:
        while len(self._threads) < REREPLICATE_WORKERS:
            thread = threading.Thread(target=self._work, name=f"kvpool-rereplicate-{len(self._threads)}",
                                      daemon=True)
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while not self._stop.is_set():
            try:
                task = self._todo.get(timeout=0.2)
            except queue.Empty:
                continue
            if task is None:
                return
            error: str | None = None
            try:
                control_call(task.target_control, "replicate", S.Replicate(
                    key=task.key, spec=list(task.spec), header_sum=task.header_sum, source=task.source_address,
                    reservation=task.reservation, replicas=task.replicas, persistent=True,
                    token=self.cluster_key.mint_token(task.key, task.source_id),
                ), self.timeout_s, context=self._context, cluster_key=self.cluster_key,
                    check=partial(self._check_task, task))
            except Exception as exc:  # reported on the serving thread; retried with backoff
                error = f"{type(exc).__name__}: {exc}" if not isinstance(exc, errors.KVPoolError) else str(exc)
            self._done.put((task, error))

    def _check_task(self, task: Any) -> None:
        """While a copy waits: give up when the master stops or the target is gone."""
        if self._stop.is_set():
            raise errors.KVTimeoutError("replicate: the master is stopping")
        if task.target_id in self._gone:
            raise errors.UnknownNodeError("replicate: the target left or was declared dead")

    def close(self) -> None:
        self._stop.set()
        for _ in self._threads:
            self._todo.put(None)
        for thread in self._threads:
            thread.join(2.0)
