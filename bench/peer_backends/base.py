"""What every system in the peers benchmark shares: the two halves of a backend,
the workload's values, and the processes that run them.

A system is measured by two kinds of code:

* :class:`Peer` (the orchestrator's side, ``bench/peers.py``): starts the
  system's server processes on 127.0.0.1 (master, storage node, ...), says
  which actor process puts and which gets, reports the servers' pids for RSS,
  and stops everything.
* :class:`PeerClient` (inside an actor process, ``bench/peer_backends/actor.py``):
  the system's client library doing one put/get/exists call at a time. The
  timing loops live in the actor and are the same for every system; a client
  only says how its library does one call.

Also here: :class:`ValueSource` (the random values every system stores: the
same bytes for the same seed in every process, so a reader can check what a
writer put), :func:`kv_shape` (a KV array shape with an exact byte size) and
:class:`ServerProcess` (a child process pinned to some CPUs, waited on until
ready, always stopped). This module measures nothing by itself.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import Child  # noqa: E402

KV_HEADS, HEAD_DIM, ITEM_BYTES = 8, 128, 2  # float16 KV of a Llama-3-8B-like model
TOKEN_LAYER_BYTES = 2 * KV_HEADS * HEAD_DIM * ITEM_BYTES  # K and V of one token in one layer: 4 KiB
SOURCE_SPAN_BYTES = 128 << 20  # distinct random bytes behind the values (values past it shift by 4 KiB)


class PeerError(RuntimeError):
    """A system under test failed (did not start, answered an error, returned wrong bytes)."""


# -- values ------------------------------------------------------------------------


def kv_shape(nbytes: int) -> tuple[int, int, int, int, int]:
    """``[layers, 2, tokens, kv_heads, head_dim]`` float16 with exactly ``nbytes`` bytes.

    8 KV heads x 128 dims; up to 32 layers; 64 KiB -> 16 layers x 1 token,
    1 MiB -> 32 x 8, 16 MiB -> 32 x 128. Sizes must be multiples of 4 KiB.
    """
    if nbytes % TOKEN_LAYER_BYTES:
        raise ValueError(f"value size {nbytes} is not a multiple of {TOKEN_LAYER_BYTES} bytes (one token-layer)")
    token_layers = nbytes // TOKEN_LAYER_BYTES
    layers = 1
    while layers < 32 and token_layers % (layers * 2) == 0:
        layers *= 2
    return (layers, 2, token_layers // layers, KV_HEADS, HEAD_DIM)


class ValueSource:
    """``count`` random values of ``size`` bytes, views into one random pool.

    Value ``i`` is ``pool[offset(i) : offset(i) + size]``; offsets tile the
    first :data:`SOURCE_SPAN_BYTES` and shift by 4 KiB on each wrap, so every
    value of a run differs from the others while the pool stays small enough
    to sit in any process (or in a peer's registered shared memory).
    ``np.random.default_rng(seed)`` makes the pool identical in every process.
    """

    def __init__(self, size: int, count: int, seed: int) -> None:
        self.size, self.count, self.seed = size, count, seed
        self.shape = kv_shape(size)
        self.span = min(count * size, SOURCE_SPAN_BYTES)
        self.pool_nbytes = self.span + size
        self._pool: np.ndarray | None = None

    @property
    def pool(self) -> np.ndarray:
        if self._pool is None:
            self._pool = self.generate()
        return self._pool

    def generate(self, out: np.ndarray | None = None) -> np.ndarray:
        """The pool's bytes, written into ``out`` (a peer's registered memory) when given."""
        data = np.random.default_rng(self.seed).integers(0, 256, self.pool_nbytes, dtype=np.uint8)
        if out is None:
            return data
        out[: self.pool_nbytes] = data
        return out

    def use_pool(self, memory: np.ndarray) -> None:
        """Keep the values in ``memory`` (uint8, at least ``pool_nbytes``): fills it, then views into it."""
        self._pool = self.generate(memory)[: self.pool_nbytes]

    def offset(self, i: int) -> int:
        start = i * self.size
        return (start + (start // self.span) * 4096) % self.span

    def value(self, i: int) -> np.ndarray:
        """Value ``i`` as flat uint8 (a view, no copy)."""
        off = self.offset(i)
        return self.pool[off: off + self.size]

    def kv(self, i: int) -> np.ndarray:
        """Value ``i`` as the float16 KV array of :attr:`shape` (a view, no copy)."""
        return self.value(i).view(np.float16).reshape(self.shape)


def key_name(kind: str, size: int, i: int) -> str:
    """``s-1048576-17``: value ``i`` of size ``size`` in key set ``kind`` (s: single puts, b: batched)."""
    return f"{kind}-{size}-{i}"


# -- the two halves of a backend --------------------------------------------------------


@dataclass
class Plan:
    """One size of the workload, as the orchestrator hands it to a deployment."""

    size: int
    count: int          # values per key set
    batch: int          # keys per batched call
    seed: int
    capacity: int       # bytes the servers must be able to hold (both key sets + slack)
    work_dir: Path


@dataclass
class ActorSpec:
    """How to start an actor process: which backend client, in which role, with what settings."""

    system: str
    role: str
    settings: dict[str, Any] = field(default_factory=dict)
    python: str = sys.executable


class PeerClient(ABC):
    """A system's client library, one call at a time (runs inside an actor process).

    ``put``/``get`` take one key per call or a batch; a backend that has a
    batched API uses it for ``len(keys) > 1``. Gets land in ``outs`` when the
    library can write into caller memory (returned then), else return what the
    library allocated; ``None`` in the result is a miss.
    """

    def __init__(self, role: str, settings: dict[str, Any]) -> None:
        self.role = role
        self.settings = settings

    def prepare(self, source: ValueSource, out_slots: int) -> list[np.ndarray]:
        """Make the values reachable by the library (register memory...) and return
        ``out_slots`` flat uint8 buffers of ``source.size`` for gets."""
        return [np.empty(source.size, np.uint8) for _ in range(out_slots)]

    @abstractmethod
    def put(self, keys: Sequence[str], indices: Sequence[int], source: ValueSource) -> None: ...

    @abstractmethod
    def get(self, keys: Sequence[str], outs: Sequence[np.ndarray]) -> list[Any]: ...

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]: ...

    def info(self) -> dict[str, Any]:
        """Counters worth printing (which path the reads took...)."""
        return {}

    def close(self) -> None:
        pass


class Peer(ABC):
    """A system's deployment for one plan: its servers, and which actor does what.

    Subclasses set the class attributes and implement :meth:`start`; ``put_role``
    and ``get_role`` name the actor roles (actors are started by the orchestrator
    from :meth:`actors`, pinned like clients unless ``server_actor`` says so).
    """

    system: ClassVar[str]            # --systems name, e.g. "kvpool-tcp"
    label: ClassVar[str]             # row label in the tables
    put_note: ClassVar[str] = ""     # what a timed put includes, said under the tables
    put_role: ClassVar[str] = "client"
    get_role: ClassVar[str] = "client"
    install_hint: ClassVar[str] = "bash bench/install_peers.sh"
    has_batch: ClassVar[bool] = True  # False: the system has no batched put/get/exists API

    def __init__(self, plan: Plan, cpus: CpuPlan, options: dict[str, Any]) -> None:
        self.plan = plan
        self.cpus = cpus
        self.options = options
        self.servers: list[ServerProcess] = []

    @classmethod
    def missing(cls, options: dict[str, Any]) -> str | None:
        """Why this system cannot run here (``"not installed (...)"``), or None.

        ``options``: the benchmark's command line as a dict (where the peer's
        binaries are, e.g. ``redis_server``)."""
        return None

    @abstractmethod
    def start(self) -> None:
        """Start the server processes and wait until they serve."""

    def actors(self) -> dict[str, tuple[ActorSpec, bool]]:
        """role -> (spec, runs on the server CPUs); default: one client actor."""
        return {"client": (ActorSpec(self.system, "client", self.client_settings()), False)}

    def client_settings(self) -> dict[str, Any]:
        return {}

    def server_pids(self) -> dict[str, int]:
        """Processes that hold or index the data, by name (their RSS is reported)."""
        return {s.name: s.pid for s in self.servers if s.alive()}

    def stop(self) -> None:
        for server in reversed(self.servers):  # storage before master (Mooncake needs that order)
            server.stop()


# -- processes --------------------------------------------------------------------------


@dataclass(frozen=True)
class CpuPlan:
    """Which CPUs the benchmark client and the servers run on (None: not pinned)."""

    client: frozenset[int] | None
    server: frozenset[int] | None

    @classmethod
    def make(cls, mode: str) -> CpuPlan:
        cpus = sorted(os.sched_getaffinity(0))
        if mode == "none" or len(cpus) < 2:
            return cls(None, None)
        half = len(cpus) // 2
        return cls(frozenset(cpus[:half]), frozenset(cpus[half:]))

    def describe(self) -> str:
        if self.client is None:
            return f"not pinned ({len(os.sched_getaffinity(0))} CPUs shared by all processes)"
        return (f"benchmark client pinned to CPU {_cpus(self.client)}, every server process "
                f"(masters, storage nodes, holders) to CPU {_cpus(self.server)} (os.sched_setaffinity)")


def _cpus(cpus: frozenset[int] | None) -> str:
    return ",".join(map(str, sorted(cpus or ())))


# Runs as `python -c _PIN_AND_EXEC CPUS CMD...`: pin, then become CMD (pinning is inherited by exec).
_PIN_AND_EXEC = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
                 "os.execvp(sys.argv[2], sys.argv[2:])")


def pinned_command(command: Sequence[str], cpus: frozenset[int] | None) -> list[str]:
    if cpus is None:
        return list(command)
    return [sys.executable, "-c", _PIN_AND_EXEC, _cpus(cpus), *command]


class ServerProcess(Child):
    """A peer's server process, pinned to ``cpus``, with its output in a log file."""

    def __init__(self, name: str, command: Sequence[str], log_path: Path, cpus: frozenset[int] | None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        with log_path.open("wb") as log:
            popen = subprocess.Popen(
                pinned_command(command, cpus), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=REPO_ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )
        super().__init__(popen, log_path)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def output(self, tail_chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-tail_chars:]
        except FileNotFoundError:
            return ""

    def wait_ready(self, ready: Callable[[], Any], timeout_s: float) -> None:
        """Until ``ready()`` is truthy; PeerError (with the log) if the process dies or the deadline passes."""
        deadline = time.monotonic() + timeout_s
        last: BaseException | None = None
        while True:
            if not self.alive():
                raise PeerError(f"{self.name} exited with code {self.popen.returncode} before it was ready:\n"
                                f"{self.output()}")
            try:
                if ready():
                    return
            except Exception as exc:  # not ready yet
                last = exc
            if time.monotonic() > deadline:
                raise PeerError(f"{self.name} not ready within {timeout_s} s (last error: {last!r}):\n"
                                f"{self.output()}")
            time.sleep(0.05)

    def stop(self, grace_s: float = 10.0) -> int:  # servers flushing state get longer than the default
        return super().stop(grace_s)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def rss_bytes(pid: int) -> int | None:
    """VmRSS of ``pid`` from /proc (None when the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (FileNotFoundError, ProcessLookupError, ValueError):
        return None
    return None


class ActorProcess:
    """An actor (``bench/peer_backends/actor.py``) answering one JSON request per line."""

    def __init__(self, spec: ActorSpec, cpus: frozenset[int] | None, log_path: Path, timeout_s: float) -> None:
        self.spec = spec
        self.log_path = log_path
        self.timeout_s = timeout_s
        command = [spec.python, "-m", "bench.peer_backends.actor", spec.system, spec.role]
        if cpus is not None:
            command += ["--cpus", _cpus(cpus)]
        self._log = log_path.open("wb")
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        self.popen = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log,
                                      cwd=REPO_ROOT, env=env, text=True, bufsize=1)
        self.call({"op": "init", "settings": spec.settings})

    @property
    def pid(self) -> int:
        return self.popen.pid

    def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply (PeerError on an error reply or a dead actor)."""
        assert self.popen.stdin is not None and self.popen.stdout is not None
        try:
            self.popen.stdin.write(json.dumps(request) + "\n")
            self.popen.stdin.flush()
        except BrokenPipeError:
            pass  # the readline below reports the dead actor with its log
        line = _readline(self.popen.stdout, self.timeout_s)
        if not line:
            self.popen.wait(10)
            raise PeerError(f"{self.spec.system} {self.spec.role} actor died (exit {self.popen.returncode}) "
                            f"during {request['op']}:\n{self.output()}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"{self.spec.system} {self.spec.role}: {request['op']} failed: {reply['error']}")
        return reply

    def output(self, tail_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-tail_chars:]

    def stop(self) -> None:
        if self.popen.poll() is None:
            try:
                assert self.popen.stdin is not None
                self.popen.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.popen.stdin.flush()
                self.popen.wait(15)
            except (BrokenPipeError, OSError, subprocess.TimeoutExpired):
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()


def _readline(stream: IO[str], timeout_s: float) -> str:
    import select

    if not select.select([stream], [], [], timeout_s)[0]:
        raise PeerError(f"no reply within {timeout_s} s")
    return stream.readline()
