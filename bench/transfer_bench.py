"""Pull throughput over UCX (kvpool.transport) beside the raw limits, in two processes.

What it measures, each at the same message sizes in the same run:

* ``pull``    PullClient.pull_into from a PullServer in another process,
              ``transport="tcp"`` (listener, error handling on) and ``"auto"``
              (same host: worker-address endpoints, shared memory).
* ``pull sock`` TcpPullClient.pull_into from a TcpPullServer (the same provider):
              the plain-TCP data path nodes use for pulls up to ``node.tcp_pull_max``.
* ``bare``    the same request/reply over bare ucxx with blocking progress, no
              kvpool code (``bench/ucx_floor.py``), over TCP and by worker
              address (shared memory): the floor a pull's own steps sit on.
* ``socket``  the raw limit of the same request/reply over a TCP socket on
              127.0.0.1: an 16-byte request, ``sendall`` of a memoryview,
              ``recv_into`` a preallocated buffer.
* ``perftest`` ``ucx_perftest -t tag_bw`` from the libucx wheel (UCX's own
              busy-polling streaming benchmark, window of 32 messages) with
              ``UCX_TLS=tcp,self`` and with the default transports (shared
              memory), under the same UCX_RNDV_* settings the pull uses.
* ``memcpy``  numpy copy of the same bytes in one process (the ceiling for
              any same-host path).

Then two shapes of the KV workload:

* pages vs aggregated: the same ``--pages-total`` bytes pulled as 16-token
  pages one by one (RTT-bound), as pages with 16 pulls in flight (asyncio),
  and as larger messages (bandwidth-bound): the message-size curve.
* pull-on-demand: ``k`` of ``L`` layers of one object (one range, one pull):
  bytes moved and time, against pulling the whole object.

Placement on CPUs: by default (``--pin split``, on a machine with >= 2 CPUs)
the server process is pinned to CPU 0 and this client process to CPU 1 with
``os.sched_setaffinity``; each process's threads (main, UCX progress, I/O)
inherit its CPU, ucx_perftest gets the same split via ``-c``. ``--pin none``
leaves placement to the scheduler. The placement is printed with the results.

Usage::

    python bench/transfer_bench.py                       # everything, defaults
    python bench/transfer_bench.py --sizes 64K,1M,16M --iters 10 --plot out.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvpool.config import format_size, parse_size
from kvpool.objformat import LayerRange
from kvpool.transport import (
    DEFAULT_UCX_OPTIONS,
    PeerAddress,
    PullClient,
    PullServer,
    ServeSource,
    TcpPullClient,
    TcpPullServer,
)
from kvpool.transport.engine import effective_ucx_options

if __package__ in (None, ""):  # run as a script: make ``bench`` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.common import pyplot_or_none  # noqa: E402
from bench.ucx_floor import BareRequester, BareResponder  # noqa: E402

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"
_REQUEST = struct.Struct("<QQ")  # raw socket request: offset, nbytes
_BLOB_KEY = b"blob:"  # key b"blob:<layer bytes>": layers are consecutive slices of one buffer


def _gbps(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("nan")


def _size_arg(text: str) -> list[int]:
    """``64K,1M,16MiB,1000`` -> bytes; a bare K/M/G suffix is binary (KiB/MiB/GiB)."""
    sizes = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part[-1:].upper() in ("K", "M", "G"):
            part = part[:-1] + part[-1].upper() + "iB"
        try:
            sizes.append(parse_size(part))
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return sizes


def _one_size(text: str) -> int:
    sizes = _size_arg(text)
    if len(sizes) != 1:
        raise argparse.ArgumentTypeError(f"expected one size, got {text!r}")
    return sizes[0]


def _progress(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


# -- the server process -----------------------------------------------------------------------


def run_server(args: argparse.Namespace) -> None:
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    payload = np.random.default_rng(0).integers(0, 256, args.buffer_bytes, dtype=np.uint8)
    view = memoryview(payload)

    def provider(key: bytes, layer_range: LayerRange) -> ServeSource | None:
        if not key.startswith(_BLOB_KEY):
            return None
        layer_nbytes = int(key[len(_BLOB_KEY):])
        lo, hi = layer_range.start * layer_nbytes, layer_range.stop * layer_nbytes
        if hi > len(view):
            raise ValueError(f"range ends at {hi}, buffer holds {len(view)}")
        return ServeSource(nbytes=hi - lo, buffers=[view[lo:hi]])

    server = PullServer(provider, max_message=args.max_message, inline_provider=True).start()
    tcp = TcpPullServer(provider).start()
    bare = BareResponder(view)
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_raw_socket_server, args=(listener, view), daemon=True).start()
    peer = server.peer_address
    print(json.dumps({
        "peer": [peer.host, peer.port, peer.worker_address.hex(), peer.host_id],
        "socket_port": listener.getsockname()[1],
        "bare": bare.address.hex(),
        "tcp_port": tcp.port,
    }), flush=True)
    sys.stdin.read()  # until the client closes our stdin
    tcp.close()
    bare.close()
    server.close()
    listener.close()


def _raw_socket_server(listener: socket.socket, view: memoryview) -> None:
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=_raw_socket_conn, args=(conn, view), daemon=True).start()


def _raw_socket_conn(conn: socket.socket, view: memoryview) -> None:
    header = bytearray(_REQUEST.size)
    with conn:
        while True:
            if not _recv_exact(conn, memoryview(header)):
                return
            offset, nbytes = _REQUEST.unpack(header)
            conn.sendall(view[offset:offset + nbytes])


def _recv_exact(conn: socket.socket, out: memoryview) -> bool:
    got = 0
    while got < len(out):
        n = conn.recv_into(out[got:])
        if n == 0:
            return False
        got += n
    return True


@dataclass
class ServerHandle:
    proc: subprocess.Popen[str]
    peer: PeerAddress
    socket_port: int
    bare_address: bytes

    def close(self) -> None:
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait()


def start_server(cpu: int | None, buffer_bytes: int, max_message: int) -> ServerHandle:
    cmd = [sys.executable, __file__, "--role", "server", "--buffer-bytes", str(buffer_bytes),
           "--max-message", str(max_message)]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if not line:
        proc.wait()
        raise SystemExit(f"benchmark server failed to start (exit code {proc.returncode})")
    info = json.loads(line)
    host, port, worker_address, host_id = info["peer"]
    return ServerHandle(proc, PeerAddress(host, port, bytes.fromhex(worker_address), host_id, info["tcp_port"]),
                        info["socket_port"], bytes.fromhex(info["bare"]))


# -- backends ------------------------------------------------------------------------------------


class Backend:
    """One way of moving ``size`` bytes into a local buffer; ``run_once`` times one pull."""

    name = "?"

    def setup(self, size: int) -> None:
        self.out = np.empty(size, np.uint8)
        self.out.fill(0)  # fault the pages in before timing

    def run_once(self, size: int) -> None:
        raise NotImplementedError

    def measure(self, size: int, iters: int, warmup: int) -> list[float]:
        self.setup(size)
        for _ in range(warmup):
            self.run_once(size)
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            self.run_once(size)
            times.append(time.perf_counter() - start)
        return times

    def close(self) -> None:
        pass


class PullBackend(Backend):
    """Pulls with ``client``: a PullClient (UCX, ``transport``), or with ``transport="sock"`` a
    TcpPullClient (plain TCP: what a node uses up to node.tcp_pull_max)."""

    def __init__(self, server: ServerHandle, transport: str, max_message: int) -> None:
        self.name = f"pull {transport}"
        self.server = server
        self.client: PullClient | TcpPullClient = (
            TcpPullClient() if transport == "sock" else PullClient(transport=transport, max_message=max_message))

    def run_once(self, size: int) -> None:
        n = self.client.pull_into(self.server.peer, _BLOB_KEY + str(size).encode(), (0, 1), self.out, timeout_s=60)
        assert n == size

    def close(self) -> None:
        self.client.close()


class BareBackend(Backend):
    """The same request/reply over bare ucxx (bench/ucx_floor.py): the transport's own floor."""

    def __init__(self, server: ServerHandle, transport: str, client_id: int) -> None:
        self.name = f"bare {transport}"
        options = {"TLS": "tcp,self"} if transport == "tcp" else None
        self.requester = BareRequester(server.bare_address, client_id, options)

    def run_once(self, size: int) -> None:
        self.requester.pull(0, size, memoryview(self.out))

    def close(self) -> None:
        self.requester.close()


class SocketBackend(Backend):
    name = "socket"

    def __init__(self, server: ServerHandle) -> None:
        self.conn = socket.create_connection(("127.0.0.1", server.socket_port))
        self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def run_once(self, size: int) -> None:
        self.conn.sendall(_REQUEST.pack(0, size))
        if not _recv_exact(self.conn, memoryview(self.out)[:size]):
            raise ConnectionError("raw socket server went away")

    def close(self) -> None:
        self.conn.close()


class MemcpyBackend(Backend):
    name = "memcpy"

    def setup(self, size: int) -> None:
        super().setup(size)
        self.src = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)

    def run_once(self, size: int) -> None:
        np.copyto(self.out, self.src)


def perftest_binary() -> Path | None:
    try:
        import libucx  # type: ignore[import-not-found]
    except ImportError:
        return None
    candidate = Path(libucx.__file__).parent / "bin" / "ucx_perftest"
    return candidate if candidate.exists() else None


def run_perftest(binary: Path, tls: str | None, size: int, iters: int, warmup: int,
                 cpus: tuple[int, int] | None, port: int) -> float:
    """Bandwidth in GB/s of ``ucx_perftest -t tag_bw`` between two processes."""
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(binary.parent.parent / "lib") + ":" + env.get("LD_LIBRARY_PATH", "")
    # The same UCX settings a kvpool pull runs with (transfer defaults over ucxx's).
    env["UCX_RNDV_THRESH"] = effective_ucx_options({}).get("RNDV_THRESH", os.environ.get("UCX_RNDV_THRESH", "8192"))
    for name, value in DEFAULT_UCX_OPTIONS.items():
        env.setdefault(f"UCX_{name}", value)
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if tls:
        env["UCX_TLS"] = tls
    server_cmd = [str(binary), "-p", str(port)]
    client_cmd = [str(binary), "127.0.0.1", "-p", str(port), "-t", "tag_bw", "-s", str(size),
                  "-n", str(iters), "-w", str(warmup), "-f"]
    if cpus is not None:
        server_cmd += ["-c", str(cpus[0])]
        client_cmd += ["-c", str(cpus[1])]
    server = subprocess.Popen(server_cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # The client fails fast while the server's out-of-band socket is not
        # listening yet; retry instead of guessing a start-up delay.
        for _ in range(50):
            result = subprocess.run(client_cmd, env=env, capture_output=True, text=True, timeout=300)
            if result.returncode == 0 or server.poll() is not None:
                break
            time.sleep(0.1)
    finally:
        server.kill()
        server.wait()
    for line in result.stdout.splitlines():
        fields = line.split()
        # final line: iterations, p50 latency, avg latency, overall latency,
        # avg MB/s, overall MB/s, avg msg/s, overall msg/s (MB = 2**20 bytes)
        if len(fields) == 8 and fields[0].isdigit():
            return float(fields[5]) * (1 << 20) / 1e9
    raise RuntimeError(f"cannot parse ucx_perftest output:\n{result.stdout}\n{result.stderr}")


# -- sections ---------------------------------------------------------------------------------------


@dataclass
class Results:
    placement: str = ""
    throughput: dict[str, dict[int, float]] = field(default_factory=dict)  # backend -> size -> GB/s
    rtt_us: dict[str, dict[int, float]] = field(default_factory=dict)
    # transport -> mode -> (message bytes, GB/s)
    pages: dict[str, dict[str, tuple[int, float]]] = field(default_factory=dict)
    pages_curve: dict[str, dict[int, float]] = field(default_factory=dict)
    on_demand: dict[str, list[tuple[int, int, float]]] = field(default_factory=dict)  # transport -> (k, bytes, s)


def section_throughput(
    args: argparse.Namespace, server: ServerHandle, results: Results, cpus: tuple[int, int] | None
) -> None:
    backends: list[Backend] = [SocketBackend(server), MemcpyBackend()]
    backends += [PullBackend(server, t, args.max_message) for t in ("tcp", "auto", "sock")]
    backends += [BareBackend(server, t, i) for i, t in enumerate(("tcp", "auto"))]
    total = len(args.sizes) * (len(backends) + 2)
    step = 0
    try:
        for size in args.sizes:
            for backend in backends:
                step += 1
                times = backend.measure(size, args.iters, args.warmup)
                median = statistics.median(times)
                results.throughput.setdefault(backend.name, {})[size] = _gbps(size, median)
                results.rtt_us.setdefault(backend.name, {})[size] = median * 1e6
                _progress(f"[{step}/{total}] {backend.name:<10} {format_size(size):>10}: "
                          f"{_gbps(size, median):6.2f} GB/s (median of {args.iters}, {median * 1e3:.3f} ms)")
            binary = perftest_binary()
            for label, tls in (("perftest tcp", "tcp,self"), ("perftest shm", None)):
                step += 1
                if binary is None or args.no_perftest:
                    continue
                try:
                    gbps = run_perftest(binary, tls, size, max(args.iters, 10 if args.quick else 50),
                                        max(args.warmup, 2 if args.quick else 5), cpus, args.perftest_port)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    _progress(f"[{step}/{total}] {label}: failed: {exc}")
                    continue
                results.throughput.setdefault(label, {})[size] = gbps
                _progress(f"[{step}/{total}] {label:<10} {format_size(size):>10}: {gbps:6.2f} GB/s")
    finally:
        for backend in backends:
            backend.close()


def section_pages(args: argparse.Namespace, server: ServerHandle, results: Results) -> None:
    total, page = args.pages_total, args.page_bytes
    out = np.zeros(total, np.uint8)
    for transport in ("tcp", "auto"):
        with PullClient(transport=transport, max_message=args.max_message) as client:
            def pull_all(message: int) -> float:
                key = _BLOB_KEY + str(message).encode()
                start = time.perf_counter()
                for i in range(total // message):
                    client.pull_into(server.peer, key, (i, i + 1), out[i * message:(i + 1) * message], timeout_s=60)
                return time.perf_counter() - start

            async def pull_pipelined(message: int, in_flight: int) -> float:
                key = _BLOB_KEY + str(message).encode()
                gate = asyncio.Semaphore(in_flight)

                async def one(i: int) -> None:
                    async with gate:
                        await client.apull_into(server.peer, key, (i, i + 1),
                                                out[i * message:(i + 1) * message], timeout_s=60)

                start = time.perf_counter()
                await asyncio.gather(*[one(i) for i in range(total // message)])
                return time.perf_counter() - start

            def best(fn: Callable[[], float]) -> float:
                for _ in range(max(1, args.warmup)):
                    fn()
                return min(fn() for _ in range(max(3, args.iters // 4)))

            modes = results.pages.setdefault(transport, {})
            curve = results.pages_curve.setdefault(transport, {})
            seconds = best(lambda: pull_all(page))
            modes["pages one by one"] = (page, _gbps(total, seconds))
            _progress(f"pages {transport}: {total // page} x {format_size(page)} one by one: "
                      f"{_gbps(total, seconds):.2f} GB/s ({seconds / (total // page) * 1e6:.0f} us per page)")
            seconds = best(lambda: asyncio.run(pull_pipelined(page, 16)))
            modes["pages, 16 in flight"] = (page, _gbps(total, seconds))
            _progress(f"pages {transport}: pipelined 16 in flight: {_gbps(total, seconds):.2f} GB/s")
            for message in sorted({page, *[s for s in args.sizes if page <= s <= total], total}):
                seconds = best(lambda: pull_all(message))
                curve[message] = _gbps(total, seconds)
                _progress(f"pages {transport}: aggregated into {format_size(message)} messages: "
                          f"{curve[message]:.2f} GB/s")
            modes["aggregated, one message"] = (total, curve[total])


def section_on_demand(args: argparse.Namespace, server: ServerHandle, results: Results) -> None:
    layers, layer_nbytes = args.layers, args.layer_bytes
    key = _BLOB_KEY + str(layer_nbytes).encode()
    out = np.zeros(layers * layer_nbytes, np.uint8)
    ks = sorted({k for k in (1, 2, 4, 8, 16, layers) if k <= layers})
    for transport in ("tcp", "auto"):
        rows = results.on_demand.setdefault(transport, [])
        with PullClient(transport=transport, max_message=args.max_message) as client:
            for k in ks:
                view = out[:k * layer_nbytes]
                for _ in range(args.warmup):
                    client.pull_into(server.peer, key, (0, k), view, timeout_s=60)
                times = []
                for _ in range(args.iters):
                    start = time.perf_counter()
                    client.pull_into(server.peer, key, (0, k), view, timeout_s=60)
                    times.append(time.perf_counter() - start)
                rows.append((k, k * layer_nbytes, statistics.median(times)))
                _progress(f"on-demand {transport}: {k}/{layers} layers, {format_size(k * layer_nbytes)}: "
                          f"{statistics.median(times) * 1e3:.2f} ms")


# -- reporting ---------------------------------------------------------------------------------------


def print_report(args: argparse.Namespace, results: Results) -> None:
    print()
    print(f"Placement: {results.placement}")
    print(f"Pull: PullServer max_message {format_size(args.max_message)}, blocking progress; "
          f"median of {args.iters} after {args.warmup} warm-up; GB/s = 1e9 bytes/s")
    print()
    tp = results.throughput
    cols = ["socket", "pull tcp", "perftest tcp", "memcpy", "pull auto", "perftest shm"]
    header = (f"{'size':>10} " + " ".join(f"{c:>13}" for c in cols)
              + f" {'tcp/socket':>10} {'tcp/perf':>9} {'auto/perf':>9} {'auto/memcpy':>11}")
    print("Throughput (GB/s), one pull = one request and its reply")
    print(header)
    for size in args.sizes:
        row = [tp.get(c, {}).get(size, float("nan")) for c in cols]
        socket_, tcp, ptcp, memcpy, auto, pshm = row
        print(f"{format_size(size):>10} " + " ".join(f"{v:13.2f}" for v in row)
              + f" {tcp / socket_:10.2f} {tcp / ptcp:9.2f} {auto / pshm:9.2f} {auto / memcpy:11.2f}")
    if results.rtt_us:
        print()
        print("Time per pull (us, median)")
        rtt_cols = ("socket", "pull sock", "bare tcp", "pull tcp", "bare auto", "pull auto")
        print(f"{'size':>10} " + " ".join(f"{c:>13}" for c in rtt_cols))
        for size in args.sizes:
            print(f"{format_size(size):>10} " + " ".join(
                f"{results.rtt_us.get(c, {}).get(size, float('nan')):13.1f}" for c in rtt_cols))
    if results.pages:
        print()
        print(f"Same {format_size(args.pages_total)} as {format_size(args.page_bytes)} pages (16 tokens) "
              "vs aggregated (GB/s, best run)")
        print(f"{'mode':<28} {'message':>10} " + " ".join(f"{t:>9}" for t in results.pages))
        for mode in next(iter(results.pages.values())):
            message = next(iter(results.pages.values()))[mode][0]
            print(f"{mode:<28} {format_size(message):>10} " + " ".join(
                f"{results.pages[t][mode][1]:9.2f}" for t in results.pages))
        print(f"{'message-size curve':<28}")
        for message in next(iter(results.pages_curve.values())):
            print(f"{'':<28} {format_size(message):>10} " + " ".join(
                f"{results.pages_curve[t].get(message, float('nan')):9.2f}" for t in results.pages_curve))
    if results.on_demand:
        print()
        print(f"Pull-on-demand: k of {args.layers} layers of {format_size(args.layer_bytes)} "
              "(median ms; vs whole object)")
        transports = list(results.on_demand)
        print(f"{'k':>4} {'bytes':>10} " + " ".join(f"{t + ' ms':>10} {t + ' x':>8}" for t in transports))
        for i, (k, nbytes, _) in enumerate(results.on_demand[transports[0]]):
            cells = []
            for t in transports:
                whole = results.on_demand[t][-1][2]
                seconds = results.on_demand[t][i][2]
                cells.append(f"{seconds * 1e3:10.2f} {seconds / whole:8.2f}")
            print(f"{k:>4} {format_size(nbytes):>10} " + " ".join(cells))


def plot(path: str, args: argparse.Namespace, results: Results) -> None:
    plt = pyplot_or_none(path)
    if plt is None:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 5))
    ax = axes[0]
    for name, by_size in results.throughput.items():
        sizes = sorted(by_size)
        ax.plot(sizes, [by_size[s] for s in sizes], marker="o", label=name,
                linestyle="-" if name.startswith("pull") else "--")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s (log)")
    ax.set_title("pull throughput vs raw limits")
    ax.legend(fontsize=8)
    ax = axes[1]
    for transport, curve in results.pages_curve.items():
        sizes = sorted(curve)
        ax.plot(sizes, [curve[s] for s in sizes], marker="o", label=f"{transport}: sequential messages")
        pipelined = results.pages[transport]["pages, 16 in flight"]
        ax.scatter([pipelined[0]], [pipelined[1]], marker="x", s=60, label=f"{transport}: pages, 16 in flight")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("effective GB/s")
    ax.set_title(f"{format_size(args.pages_total)} as pages vs aggregated")
    ax.legend(fontsize=8)
    ax = axes[2]
    for transport, rows in results.on_demand.items():
        ax.plot([k for k, _, _ in rows], [s * 1e3 for _, _, s in rows], marker="o", label=transport)
    ax.set_xlabel(f"layers pulled (of {args.layers})")
    ax.set_ylabel("ms")
    ax.set_title("pull-on-demand")
    ax.legend(fontsize=8)
    fig.suptitle(results.placement, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot written to {path}")


# -- main ------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=_size_arg, default=_size_arg(DEFAULT_SIZES),
                        help=f"message sizes, comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--iters", type=int, default=20, help="timed iterations per point (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed iterations per point (default 3)")
    parser.add_argument("--sections", default="throughput,pages,on-demand",
                        help="which parts to run (default: throughput,pages,on-demand)")
    parser.add_argument("--pin", choices=("split", "none"), default="split",
                        help="split: server on CPU 0, client on CPU 1 (default); none: no pinning")
    parser.add_argument("--max-message", type=_one_size, default=16 << 20,
                        help="PullServer/PullClient max_message (default 16MiB)")
    parser.add_argument("--page-bytes", type=_one_size, default=16 * 2 * 8 * 128 * 2,
                        help="one 16-token page: 16 tokens x K,V x 8 kv heads x 128 dim x fp16 (default 64KiB)")
    parser.add_argument("--pages-total", type=_one_size, default=16 << 20,
                        help="bytes moved in the pages-vs-aggregated test (default 16MiB)")
    parser.add_argument("--layers", type=int, default=32, help="layers of the on-demand object (default 32)")
    parser.add_argument("--layer-bytes", type=_one_size, default=256 * 2 * 8 * 128 * 2,
                        help="bytes per layer: 256 tokens x K,V x 8 heads x 128 x fp16 (default 1MiB)")
    parser.add_argument("--no-perftest", action="store_true", help="skip ucx_perftest")
    parser.add_argument("--perftest-port", type=int, default=13437)
    parser.add_argument("--quick", action="store_true",
                        help="a fast smoke run: 3 iterations, 1 warm-up, 4MiB of pages, 8 layers")
    parser.add_argument("--plot", metavar="FILE.png", help="draw the curves (needs matplotlib)")
    parser.add_argument("--json", metavar="FILE", help="also write every measured number as JSON")
    parser.add_argument("--role", choices=("client", "server"), default="client", help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--buffer-bytes", type=int, default=0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.quick:
        args.iters, args.warmup = min(args.iters, 3), min(args.warmup, 1)
        args.pages_total, args.layers = min(args.pages_total, 4 << 20), min(args.layers, 8)
    if args.role == "server":
        run_server(args)
        return
    cpus_available = sorted(os.sched_getaffinity(0))
    cpus: tuple[int, int] | None = None
    if args.pin == "split" and len(cpus_available) >= 2:
        cpus = (cpus_available[0], cpus_available[1])
        placement = (f"server process pinned to CPU {cpus[0]}, client process to CPU {cpus[1]} "
                     f"(os.sched_setaffinity; threads inherit; ucx_perftest -c likewise); "
                     f"{len(cpus_available)} CPUs visible")
    else:
        placement = f"no pinning: the scheduler places both processes on {len(cpus_available)} CPU(s)"
    sections = {s.strip() for s in args.sections.split(",")}
    buffer_bytes = max([*args.sizes, args.pages_total, args.layers * args.layer_bytes])
    server = start_server(cpus[0] if cpus else None, buffer_bytes, args.max_message)
    if cpus:
        os.sched_setaffinity(0, {cpus[1]})
    results = Results(placement=placement)
    _progress(placement)
    try:
        if "throughput" in sections:
            section_throughput(args, server, results, cpus)
        if "pages" in sections:
            section_pages(args, server, results)
        if "on-demand" in sections:
            section_on_demand(args, server, results)
    finally:
        server.close()
    print_report(args, results)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "placement": results.placement,
            "throughput_gbps": {k: {str(s): v for s, v in d.items()} for k, d in results.throughput.items()},
            "time_per_pull_us": {k: {str(s): v for s, v in d.items()} for k, d in results.rtt_us.items()},
            "pages_gbps": {t: {m: {"message_bytes": b, "gbps": g} for m, (b, g) in d.items()}
                           for t, d in results.pages.items()},
            "pages_curve_gbps": {t: {str(s): v for s, v in d.items()} for t, d in results.pages_curve.items()},
            "on_demand": {t: [{"layers": k, "bytes": b, "seconds": sec} for k, b, sec in rows]
                          for t, rows in results.on_demand.items()},
        }, indent=1))
    if args.plot:
        plot(args.plot, args, results)


if __name__ == "__main__":
    main()
