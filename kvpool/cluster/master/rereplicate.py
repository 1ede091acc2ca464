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
from kvpool.cluster.master.records import (
    REREPLICATE_MAX_IN_FLIGHT,
    REREPLICATE_WORKERS,
    RereplicationTask,
    RescueTask,
    loggable,
)
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
        self.max_batch = config.max_batch
        #: finished rescues (a thread each: they are rare, one per client that died), told back
        #: to the serving thread: (task, objects kept, error or None)
        self._rescued: queue.SimpleQueue[tuple[RescueTask, int, str | None]] = queue.SimpleQueue()
        self._rescuers: list[threading.Thread] = []
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
        self._rescue_round()
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

    def _rescue_round(self) -> None:
        """Start the rescues the state planned (a thread each) and count the ones that ended."""
        state = self.state
        while state.rescues:
            task = state.rescues.pop(0)
            thread = threading.Thread(target=self._rescue, args=(task,), daemon=True,
                                      name=f"kvpool-rescue-{task.source_id[:8]}")
            thread.start()
            self._rescuers = [t for t in self._rescuers if t.is_alive()] + [thread]
        while True:
            try:
                task, kept, error = self._rescued.get_nowait()
            except queue.Empty:
                break
            state.counters["rescues_failed" if error else "rescues_done"] += 1
            state.counters["rescued_objects"] += kept
            log.info("rescue of dead client %s's arena by %s: %d of %d objects kept%s", task.source_id[:8],
                     task.target_label, kept, len(task.items), f"; stopped: {error}" if error else "")

    def _rescue(self, task: RescueTask) -> None:
        """Ask the storage node to read the dead client's objects out of its arena (adopt_many with
        ``rescue``), a batch at a time; off the serving thread."""
        kept, error = 0, None
        try:
            for at in range(0, len(task.items), self.max_batch):
                if self._stop.is_set():
                    raise errors.KVTimeoutError("rescue: the master is stopping")
                items = [S.AdoptItem(key=key, spec=spec, header_sum=header_sum)
                         for key, spec, header_sum in task.items[at:at + self.max_batch]]
                reply = control_call(task.target_control, "adopt_many",
                                     S.AdoptMany(items=items, source=task.source_address, rescue=True),
                                     self.timeout_s, context=self._context, cluster_key=self.cluster_key,
                                     check=self._check_stopping)
                adopted = reply.get("adopted") if isinstance(reply, dict) else None
                kept += adopted if type(adopted) is int and adopted >= 0 else 0
        except Exception as exc:  # reported on the serving thread
            error = f"{type(exc).__name__}: {exc}"
        self._rescued.put((task, kept, error))

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

    def _check_stopping(self) -> None:
        if self._stop.is_set():
            raise errors.KVTimeoutError("the master is stopping")

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
        for thread in self._threads + self._rescuers:
            thread.join(2.0)
