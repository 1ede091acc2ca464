"""While etcd or the masters are away every public call fails typed, within its deadline.

Real processes (etcd, two masters, a storage node, a writer holding keys) and a client in
this process. etcd is killed: every call of the client (puts plain and durable, gets of
remembered and unknown keys, get_many, exists, lookup, delete, a MasterClient's ping, a
new ``connect``) either succeeds or raises MasterUnreachableError within its deadline;
nothing untyped reaches the caller, the logs or a thread's excepthook, here or in the
storage node. etcd is started again and calls succeed again. Then both masters are killed
and the same holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvpool
from kvpool import errors
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.config import Config
from tests.cluster_actor import content, key_of, small_config
from tests.conftest import ChildProcess, Etcd, WaitAborted, wait_for
from tests.test_ha import HA, HEARTBEAT_MS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

REQUEST_TIMEOUT_S = 3.0  # small_config's master.request_timeout_s
PULL_TIMEOUT_S = 3.0  # small_config's node.pull_timeout_s (a durable copy's exchange: this + 5 s)
# What a call may take past its deadline: the scheduling of a loaded 2-CPU machine, a last
# etcd read (refused at once while etcd is down).
SLACK_S = 1.5
# Names that must never reach a log or a thread's excepthook: untyped errors.
UNTYPED = ("Traceback", "UnboundLocalError", "NameError", "TypeError", "AttributeError", "KeyError",
           "IndexError", "AssertionError", "ZMQError", "RuntimeError")


@pytest.fixture
def ha(tmp_path: Path, spawn_python: Callable[..., ChildProcess], etcd: Etcd) -> HA:
    return HA(tmp_path, spawn_python, etcd)


class Untyped:
    """Log records with a traceback or an untyped error's name, and exceptions that ended a
    thread, in this process while it is installed."""

    def __init__(self) -> None:
        self.found: list[str] = []
        self._handler = logging.Handler(logging.DEBUG)
        self._handler.emit = self._emit  # type: ignore[method-assign]
        self._logger = logging.getLogger("kvpool")
        self._level = self._logger.level
        self._hook = threading.excepthook

    def _emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if record.exc_info or any(name in text for name in UNTYPED):
            self.found.append(f"{record.name}: {text} {record.exc_info!r}")

    def _thread_died(self, args: threading.ExceptHookArgs) -> None:
        self.found.append(f"thread {args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: "
                          f"{args.exc_value}")

    def __enter__(self) -> Untyped:
        self._logger.setLevel(logging.DEBUG)
        self._logger.addHandler(self._handler)
        threading.excepthook = self._thread_died
        return self

    def __exit__(self, *exc: object) -> None:
        threading.excepthook = self._hook
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)


def client_config(ha: HA, tmp_path: Path, name: str) -> Config:
    """A client following the leader in etcd (``master.listen``: unused, but must be valid)."""
    return small_config("tcp://127.0.0.1:7700", name, str(tmp_path / name), HEARTBEAT_MS, etcd=ha.etcd.url,
                        etcd_prefix=ha.prefix)


def untyped_in(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(name in line for name in UNTYPED)]


class Calls:
    """Every public call of ``pool`` (and a MasterClient, and ``connect``), each on its own
    thread, over and over for a window: (call, outcome, seconds) for each."""

    def __init__(self, ha: HA, pool: kvpool.Pool, tmp_path: Path, remembered: bytes, unknown: bytes) -> None:
        self.ha, self.pool, self.tmp_path = ha, pool, tmp_path
        n = iter(range(10_000, 20_000))
        arr = content(0)
        # What a call may take: its master round trips, request_timeout_s each. A put that must
        # make room in its bottom tier asks the master first (once per outage: not again while
        # the master is known away).
        put = 2 * REQUEST_TIMEOUT_S  # evict_request, publish
        durable = put + 2 * REQUEST_TIMEOUT_S + PULL_TIMEOUT_S + 5.0  # + place, replicate_many, revoke
        self.calls: dict[str, tuple[float, Callable[[], Any]]] = {
            "put": (put, lambda: pool.put(key_of(next(n)), arr)),
            "put_durable": (durable, lambda: pool.put(key_of(next(n)), arr, durable=True)),
            "get_remembered": (REQUEST_TIMEOUT_S, lambda: pool.get(remembered)),
            "get_unknown": (REQUEST_TIMEOUT_S, lambda: pool.get(unknown)),
            "get_many": (REQUEST_TIMEOUT_S, lambda: pool.get_many([remembered, unknown])),
            "exists": (REQUEST_TIMEOUT_S, lambda: pool.exists(unknown)),
            "exists_many": (REQUEST_TIMEOUT_S, lambda: pool.exists_many([remembered, unknown])),
            "lookup": (REQUEST_TIMEOUT_S, lambda: pool.lookup([remembered, unknown])),
            "delete": (REQUEST_TIMEOUT_S, self._delete),
            "ping": (REQUEST_TIMEOUT_S, self._ping),
            "connect": (REQUEST_TIMEOUT_S + 5.0, self._connect),  # + opening a pool and its node
        }
        self.outcomes: list[tuple[str, str, float]] = []
        self._lock = threading.Lock()
        self._connects = iter(range(1000))

    def _delete(self) -> None:
        try:
            self.pool.delete(b"never-put-key")
        except errors.KeyNotFoundError:
            pass  # the master answered: not there

    def _ping(self) -> None:
        with MasterClient(config=self.ha.config(request_timeout_s=REQUEST_TIMEOUT_S)) as client:
            client.ping()

    def _connect(self) -> None:
        name = f"late-{next(self._connects)}"
        kvpool.connect(config=client_config(self.ha, self.tmp_path, name)).close()

    def run(self, seconds: float, names: list[str] | None = None) -> list[tuple[str, str, float]]:
        end = time.monotonic() + seconds
        outcomes: list[tuple[str, str, float]] = []

        def loop(name: str, call: Callable[[], Any]) -> None:
            while time.monotonic() < end:
                began = time.monotonic()
                try:
                    call()
                    outcome = "ok"
                except errors.MasterUnreachableError:
                    outcome = "MasterUnreachableError"
                except Exception as exc:  # the defect this test is about: reported with its type
                    outcome = f"{type(exc).__name__}: {exc}"
                with self._lock:
                    outcomes.append((name, outcome, time.monotonic() - began))
                time.sleep(0.05)

        threads = [threading.Thread(target=loop, args=(name, call), name=f"call-{name}")
                   for name, (_, call) in self.calls.items() if names is None or name in names]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(seconds + 60)
        assert not any(thread.is_alive() for thread in threads), "a call hung"
        self.outcomes.extend(outcomes)
        return outcomes

    def check(self, outcomes: list[tuple[str, str, float]]) -> None:
        bad = [(name, outcome) for name, outcome, _ in outcomes if outcome not in ("ok", "MasterUnreachableError")]
        assert not bad, bad
        slow = [(name, round(seconds, 2)) for name, _, seconds in outcomes
                if seconds > self.calls[name][0] + SLACK_S]
        assert not slow, slow


def summary(outcomes: list[tuple[str, str, float]]) -> dict[str, str]:
    by_call: dict[str, list[tuple[str, float]]] = {}
    for name, outcome, seconds in outcomes:
        by_call.setdefault(name, []).append((outcome, seconds))
    return {name: f"{sum(o == 'ok' for o, _ in got)} ok / {len(got)}, slowest {max(s for _, s in got):.2f} s"
            for name, got in by_call.items()}


def test_calls_fail_typed_within_their_deadline_while_etcd_or_the_masters_are_away(
        ha: HA, tmp_path: Path) -> None:
    ha.start_master()
    ha.start_master()
    ha.leader()
    storage = ha.start_node("storage")
    ha.start_actor("writer", "holder", "--keys", "3", "--first", "0")
    with Untyped() as untyped:
        pool = kvpool.connect(config=client_config(ha, tmp_path, "client"))
        try:
            pool.put(key_of(100), content(100), durable=True)
            assert np.array_equal(pool.get(key_of(0)), content(0))  # remembered from now on
            calls = Calls(ha, pool, tmp_path, remembered=key_of(0), unknown=b"never-put")

            ha.etcd.child.kill()
            away = calls.run(12.0)  # the leader's lease runs out within 2 s: most of this is leaderless
            print("etcd away:", summary(away))
            calls.check(away)
            failed = {name for name, outcome, _ in away if outcome == "MasterUnreachableError"}
            assert {"put", "put_durable", "get_unknown", "ping", "lookup"} <= failed, summary(away)
            assert all(outcome == "ok" for name, outcome, _ in away if name == "get_remembered")

            ha.etcd.start()
            ha.leader(timeout_s=20.0)

            def all_succeed() -> bool:
                pool.put(key_of(101), content(101), durable=True)
                return np.array_equal(pool.get(key_of(1)), content(1)) and pool.exists(key_of(101))

            wait_for(all_succeed, 30, "calls to succeed once etcd is back", interval_s=0.2)
            # A leader deposed while etcd was away may lose an election once more just after it
            # returns (docs/ha.md): every call of some 2 s window succeeds within 30 s.
            windows: list[Any] = []

            def a_clean_window() -> bool:
                windows.append(calls.run(2.0, ["put", "put_durable", "get_unknown", "exists_many", "lookup", "ping"]))
                try:
                    calls.check(windows[-1])  # typed and within its deadline, or the test fails now
                except AssertionError as exc:
                    raise WaitAborted(str(exc)) from None
                return all(outcome == "ok" for _, outcome, _ in windows[-1])

            try:
                wait_for(a_clean_window, 30, "a 2 s window of calls that all succeed")
            except WaitAborted:
                raise
            except AssertionError:
                raise AssertionError([summary(w) for w in windows]) from None

            for master in ha.masters.values():
                master.kill()
            gone = calls.run(8.0)
            print("masters away:", summary(gone))
            calls.check(gone)
            assert {name for name, outcome, _ in gone if outcome == "MasterUnreachableError"} >= {"put", "ping"}
        finally:
            pool.close()
    assert not untyped.found, untyped.found[:20]
    assert not untyped_in(storage.output()), untyped_in(storage.output())[:20]
