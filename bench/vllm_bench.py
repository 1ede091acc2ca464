"""vLLM with and without a KV store: time to first token of requests whose long prefixes
another engine computed.

A kvpool master + storage node (``kvpool.cli.server --role all``, nvme) and real vLLM-CPU
engines (``tests/vllm_engine.py``), each a fresh process tree, so nothing is in its own
prefix cache:

1. warm-up: one engine per store computes ``--docs`` documents of ``--prefix`` tokens and
   stores their blocks: vLLM's ``ExampleConnector`` (safetensors files in a directory) and
   kvpool (durable copies on the storage node, so they outlive the engine);
2. measured: a fresh engine per configuration first computes a document nobody stored (so
   the planner has a measured prefill rate; left out of the numbers), then serves one request
   per stored document (the document + a 16-token tail), one at a time, ``max_tokens=1``: the
   call's time is the TTFT; "requests" is their sum. Rows: no connector (recompute),
   ExampleConnector, kvpool same host (``transport=auto``), kvpool over TCP
   (``transport=tcp``). Every row's tokens are checked against the first's;
3. from the kvpool engines' logs: the time the model waited for layers against the time loads
   were in flight (``kvpool load: ... in X ms, the model waited Y ms``), and the planner's
   decisions (``kvpool plan: ... loads|recomputes N held blocks``).

4. saves: a fresh engine per row computes ``--docs`` documents nobody stored, one request
   at a time: no connector (saves off), kvpool saving each step's blocks (saves on), kvpool
   saving them durably (``durable``: one placement and one replicate exchange per storage
   node for each step's batch). TTFT, and the step time the connector measured.

Before the engines, without one (``--only loads`` runs just these):

* loads: the connector's worker half (the code vLLM's worker runs: ``start_load_kv``,
  ``wait_for_layer_load``) loads ``--prefix`` tokens of blocks that a writer stored durably
  (they are on the storage node's nvme, as in the engine rows) into a paged cache shaped as
  vLLM-CPU's, against ``get_many`` of the same objects into one buffer, interleaved, same
  host (``transport=auto``) and over TCP; with the load's stages (pulls, copies into the
  cache) and the master's ``locate`` of those blocks;
* lookup: the scheduler side's lookup of a 128k-token prompt (1,000 blocks of 128): the
  request to the master alone, and with hashing the prompt.

Engines run one compute thread on core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``, as in the tests);
kvpool's daemon and the engine's other processes share the machine's cores.

    python bench/vllm_bench.py [--docs 8] [--prefix 2048] [--layers 8] [--hidden 512] [--plot vllm.png]
                               [--only loads|engines]
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
_LOAD_RE = re.compile(r"kvpool load: (\d+) blocks of (\d+) layers in ([\d.]+) ms, the model waited ([\d.]+) ms")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def engine(work: Path, name: str, model: Path, prompts: Path, *args: str) -> tuple[dict[str, Any], str]:
    out, log = work / f"{name}.json", work / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tests.vllm_engine", "run", str(model), str(prompts), str(out),
                                 "--max-tokens", "1", *args], cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                start_new_session=True)
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


def _median(samples: list[float]) -> float:
    return percentile(samples, 50)


def load_rows(master: str, work: Path, args: argparse.Namespace) -> None:
    """The connector's load bandwidth next to ``get_many`` of the same objects (see the
    module docstring), same host and over TCP, and where a load's time goes."""
    import numpy as np
    import torch

    import kvpool
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.integrations.vllm import KvpoolConnectorMetadata, Settings, Transfer
    from kvpool.objformat import layer_checksums
    from tests.vllm_engine import BLOCK_SIZE, worker_connector

    blocks, head_dim = args.prefix // BLOCK_SIZE, 64
    shape = (args.layers, 2, BLOCK_SIZE, args.kv_heads, head_dim)

    def config(name: str) -> dict[str, Any]:
        return {"pool": {"data_dir": str(work / name)},
                "tiers": {"dram": {"capacity": "512MiB", "mlock": False}, "cxl": {"capacity": 0},
                          "nvme": {"capacity": 0}}, "master": {"listen": master}}

    keys = [b"vllm-bench-load-%04d" % i for i in range(blocks)]
    rng = np.random.default_rng(0)
    writer = kvpool.connect(master, config=config("load-writer"))
    try:  # durable: on the storage node's nvme, where the engine rows' blocks are
        writer.put_many([(k, rng.integers(0, 1 << 16, shape, dtype=np.uint16)) for k in keys], dtype="bfloat16",
                        durable=True)
    finally:
        writer.close()
    nbytes = blocks * int(np.prod(shape)) * 2
    rows, stages = [], []
    for transport in ("auto", "tcp"):
        pool = kvpool.connect(master, config=config(f"load-{transport}"), transport=transport)
        try:
            caches = {f"layer.{i}": torch.zeros(blocks * 2, args.kv_heads, BLOCK_SIZE, 2 * head_dim,
                                                dtype=torch.bfloat16) for i in range(args.layers)}
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
                connector.start_load_kv(None)  # type: ignore[arg-type]
                loads.append(connector._load)
                for i in range(args.layers):
                    connector.wait_for_layer_load(f"layer.{i}")
                connector.wait_for_save()
                assert not connector.get_block_ids_with_load_errors()

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
            started = time.perf_counter()
            layer_checksums(outs.reshape(-1).view(np.uint8), outs.nbytes // (blocks * args.layers))
            verify_s = time.perf_counter() - started
            where = "same host" if transport == "auto" else "TCP"
            g, c = _median(timed["get_many"]), _median(timed["connector"])
            rows.append([where, f"{nbytes / 2**20:.0f} MiB", f"{g * 1e3:.2f} ms", f"{nbytes / g / 1e9:.2f} GB/s",
                         f"{c * 1e3:.2f} ms", f"{nbytes / c / 1e9:.2f} GB/s", f"{g / c:.2f}x"])
            stages.append([where, f"{_median(locate) * 1e3:.2f} ms",
                           f"{_median([x.pull_s for x in loads]) * 1e3:.2f} ms", f"{verify_s * 1e3:.2f} ms",
                           f"{_median([x.copy_s for x in loads]) * 1e3:.2f} ms",
                           f"{_median([x.waited_s for x in loads]) * 1e3:.2f} ms"])
            connector._loader.shutdown()
            connector._saver.shutdown()
        finally:
            pool.close()
    disk = _disk_read_s(work / "storage", nbytes, args.iters, args.direct_io != "off")
    if disk is not None:
        rows.append(["the storage node's segment file, read alone", f"{nbytes / 2**20:.0f} MiB",
                     f"{disk * 1e3:.2f} ms", f"{nbytes / disk / 1e9:.2f} GB/s", "-", "-", "-"])
    print(f"\nloads: {blocks} blocks of {nbytes // blocks / 2**20:.2f} MiB ({args.layers} layers), from the storage "
          f"node's nvme (direct_io {args.direct_io}); p50 of {args.iters}, interleaved", flush=True)
    print(format_table(["path", "bytes", "get_many", "get_many bandwidth", "connector load", "connector bandwidth",
                        "connector / get_many"], rows))
    print(format_table(["path", "master locate (all blocks)", "pulls (get_many in the load)",
                        "checksums (in the pulls)", "copies into the cache", "model waited (all layers)"], stages))


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


def lookup_rows(master: str, work: Path, args: argparse.Namespace) -> None:
    """The scheduler side's lookup of a 128k-token prompt: 1,000 blocks of 128 tokens."""
    import numpy as np

    import kvpool
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.hashing import prefix_hashes

    tokens = [int(t) for t in np.random.default_rng(1).integers(1, 32000, 128_000)]
    keys = prefix_hashes(tokens, 128, namespace="vllm-bench-lookup")
    writer = kvpool.connect(master, config={"pool": {"data_dir": str(work / "lookup-writer")},
                                            "tiers": {"dram": {"capacity": "64MiB", "mlock": False},
                                                      "cxl": {"capacity": 0}, "nvme": {"capacity": 0}},
                                            "master": {"listen": master}})
    try:
        writer.put_many([(k, np.zeros((1, 2, 1, 1, 8), np.float16)) for k in keys])
        with MasterClient(master) as scheduler:
            asked, hashed = [], []
            for i in range(args.lookups):
                started = time.perf_counter()
                if i % 2:
                    assert scheduler.lookup(keys) == len(keys)
                    asked.append(time.perf_counter() - started)
                else:
                    assert scheduler.lookup(prefix_hashes(tokens, 128, namespace="ns")) == 0
                    hashed.append(time.perf_counter() - started)
            calls = scheduler.query_calls
    finally:
        writer.close()
    rows = [["one lookup request (1,000 keys)", f"{percentile(asked, 50) * 1e3:.3f} ms",
             f"{percentile(asked, 99) * 1e3:.3f} ms"],
            ["hash the prompt + lookup request", f"{percentile(hashed, 50) * 1e3:.3f} ms",
             f"{percentile(hashed, 99) * 1e3:.3f} ms"]]
    print(f"\nscheduler lookup of a 128k-token prompt (1,000 blocks), {len(asked)} + {len(hashed)} requests "
          f"({calls} on the master's query port)", flush=True)
    print(format_table(["", "p50", "p99"], rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", type=int, default=8, help="documents (one request each)")
    parser.add_argument("--prefix", type=int, default=2048, help="tokens per document (a multiple of 128)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--direct-io", choices=["auto", "on", "off"], default="auto",
                        help="the storage node's nvme reads: O_DIRECT (auto/on) or through the page cache (off)")
    parser.add_argument("--plot", default="", help="write a bar chart of TTFT p50 here")
    parser.add_argument("--only", choices=["loads", "engines"], default=None,
                        help="loads: only the rows without an engine (loads, lookup); engines: only the engines")
    parser.add_argument("--iters", type=int, default=15, help="loads measured per path")
    parser.add_argument("--lookups", type=int, default=400, help="lookup requests measured")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="kvpool-vllm-bench-"))
    master = f"tcp://127.0.0.1:{_free_port()}"
    metrics = _free_port()
    daemon = subprocess.Popen(
        [sys.executable, "-m", "kvpool.cli.server", "--pool.name", "vllm-bench",
         "--pool.data_dir", str(work / "storage"),
         "--tiers.dram.capacity", "0", "--tiers.cxl.capacity", "0", "--tiers.nvme.capacity", "1GiB",
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
        if args.only != "engines":
            load_rows(master, work, args)
            lookup_rows(master, work, args)
            if args.only == "loads":
                return
        config = work / "engine.toml"
        config.write_text(f'[pool]\ndata_dir = "{work / "engines"}"\n[tiers.dram]\ncapacity = "512MiB"\n'
                          f'mlock = false\n[tiers.cxl]\ncapacity = 0\n[tiers.nvme]\ncapacity = 0\n'
                          f'[master]\nlisten = "{master}"\n')
        model = work / "model"
        subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", str(model), "--layers",
                        str(args.layers), "--hidden", str(args.hidden), "--kv-heads", str(args.kv_heads)],
                       cwd=REPO_ROOT, check=True, capture_output=True)
        rng = random.Random(1)
        docs = [[rng.randrange(1, 1000) for _ in range(args.prefix)] for _ in range(args.docs)]
        warm = work / "warm.json"
        warm.write_text(json.dumps([d + [1] for d in docs]))  # computes (and stores) every full block
        # First a document no engine has seen (computed everywhere: it gives the planner a measured
        # prefill rate, and is left out of the TTFT columns), then one request per stored document.
        cold = [rng.randrange(1, 1000) for _ in range(args.prefix + 16)]
        asked = work / "asked.json"
        asked.write_text(json.dumps([cold] + [d + [rng.randrange(1, 1000) for _ in range(16)] for d in docs]))
        store = work / "example-store"
        kv = ["--connector", "kvpool", "--master", master, "--config", str(config)]
        print(f"{args.docs} documents of {args.prefix} tokens + 16-token tails; model: {args.layers} layers, hidden "
              f"{args.hidden}, {args.kv_heads} KV heads of 64, bfloat16; block 128; storage node nvme direct_io "
              f"{args.direct_io}", flush=True)
        engine(work, "warm-example", model, warm, "--connector", "example", "--store", str(store))
        engine(work, "warm-kvpool", model, warm, *kv, "--durable")
        runs = [("no connector (recompute)", []), ("vLLM ExampleConnector (disk)", ["--connector", "example",
                                                                                    "--store", str(store)]),
                ("kvpool, same host", kv), ("kvpool, TCP", [*kv, "--transport", "tcp"])]
        rows, reference, results = [], None, {}
        for label, extra in runs:
            result, log = engine(work, label.split()[0] + str(len(rows)), model, asked, *extra)
            tokens = [o["tokens"] for o in result["outputs"]]
            reference = reference or tokens
            ttft = [o["ttft_s"] for o in result["outputs"][1:]]
            loads = [tuple(float(x) for x in m.groups()) for m in _LOAD_RE.finditer(log)]
            in_flight = sum(m[2] for m in loads)
            waited = sum(m[3] for m in loads)
            cached = sum(o["cached"] for o in result["outputs"][1:])
            plans = [m.groups() for m in _PLAN_RE.finditer(log)]
            planned = (f"load {sum(int(n) for verb, n in plans if verb == 'loads')} / recompute "
                       f"{sum(int(n) for verb, n in plans if verb == 'recomputes')}") if plans else "-"
            results[label] = ttft
            rows.append([label, f"{percentile(ttft, 50) * 1e3:.0f} ms", f"{percentile(ttft, 99) * 1e3:.0f} ms",
                         f"{sum(ttft):.2f} s", f"{cached:,}",
                         f"{waited:.1f} / {in_flight:.1f} ms" if loads else "-", planned,
                         "yes" if tokens == reference else "NO"])
        print(format_table(["configuration", "TTFT p50", "TTFT p99", f"{args.docs} requests", "tokens loaded",
                            "model waited / loads in flight", "planner (blocks)", "same tokens"], rows))
        save_rows = []
        for label, extra in (("saves off (no connector)", []), ("kvpool, saves on", kv),
                             ("kvpool, saves durable", [*kv, "--durable"])):
            fresh = [[rng.randrange(1, 1000) for _ in range(args.prefix + 16)] for _ in range(args.docs + 1)]
            prompts = work / f"saves{len(save_rows)}.json"
            prompts.write_text(json.dumps(fresh))
            result, log = engine(work, f"saves{len(save_rows)}", model, prompts, *extra)
            ttft = [o["ttft_s"] for o in result["outputs"][1:]]
            saved = _SAVED_RE.search(log)
            save_rows.append([label, f"{percentile(ttft, 50) * 1e3:.0f} ms", f"{percentile(ttft, 99) * 1e3:.0f} ms",
                              f"{sum(ttft):.2f} s",
                              f"{saved.group(1)} blocks, {float(saved.group(2)) * 1e3:.0f} ms" if saved else "-"])
            results[label] = ttft
        base = percentile(results["saves off (no connector)"], 50)
        for row, label in zip(save_rows, [r[0] for r in save_rows]):
            row.insert(2, f"{percentile(results[label], 50) / base:.2f}x")
        print(f"\nsaves: {args.docs} documents nobody stored (+ a first one left out), one request at a time")
        print(format_table(["configuration", "TTFT p50", "vs saves off", "TTFT p99", f"{args.docs} requests",
                            "saved (saver thread time)"], save_rows))
        plt = pyplot_or_none(args.plot)
        if plt is not None:
            fig, ax = plt.subplots(figsize=(7, 3.5))
            labels = list(results)
            ax.barh(labels, [percentile(v, 50) * 1e3 for v in results.values()])
            ax.set_xlabel("TTFT p50 (ms), lower is better")
            ax.set_title(f"vLLM-CPU: TTFT, {args.prefix}-token prefixes another engine computed", fontsize=10)
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
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
