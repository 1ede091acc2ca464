"""Pieces every kvpool benchmark shares: CLI, sizes, timing stats, progress, output.

Owns the shared command line (``--sizes --iters --warmup --plot``), size
parsing and labels (benchmark sizes are binary: ``64K`` is 65536 bytes),
percentile / GB/s arithmetic, a single-line progress display on stderr, table
printing, and optional matplotlib plotting. It does not own what a benchmark
measures or which physical reference it compares against; each benchmark
module does.
"""

from __future__ import annotations

import argparse
import math
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

DEFAULT_SIZES = "64K,256K,1M,4M,16M,64M"
_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}
_SIZE_RE = re.compile(r"^\s*(\d+)\s*([A-Za-z]*)\s*$")


# -- the machine ----------------------------------------------------------------

_REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def memory_given_to_host() -> int | None:
    """Bytes this VM's kernel has reported free to its host so far (virtio-balloon free page
    reporting, where the kernel counts them; None elsewhere). A reported page is taken back
    by the host, and the next use of it costs a fault in the host as well as the guest's own:
    on the 2-vCPU VM, 16 MiB of new shared-memory pages took ~48 ms instead of ~5 ms, so a
    benchmark row that allocates memory while timed is slower by however much of it had been
    handed back (docs/benchmarks.md). Compare it before and after a run."""
    try:
        return int(_REPORTED_KIB.read_text().split()[0]) << 10
    except (OSError, ValueError, IndexError):
        return None


# -- sizes ----------------------------------------------------------------------


def parse_size(text: str) -> int:
    """Bytes from ``"64K"``, ``"4M"``, ``"1GiB"``, ``"4096"``; units are binary (K = 1024)."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 64K, 4M, 1G)")
    nbytes = int(m.group(1)) * _UNITS[m.group(2).upper()]
    if nbytes <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return nbytes


def parse_sizes(text: str) -> list[int]:
    """Sorted, de-duplicated sizes from a comma-separated list such as ``"64K,1M,64M"``."""
    sizes = sorted({parse_size(part) for part in text.split(",") if part.strip()})
    if not sizes:
        raise ValueError(f"no sizes in {text!r}")
    return sizes


def size_label(nbytes: int) -> str:
    """Short binary label: 65536 -> ``64K``, 1048576 -> ``1M``, 1536 -> ``1.5K``."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale:
            value = nbytes / scale
            return f"{value:g}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return f"{nbytes}B"


# -- command line ---------------------------------------------------------------------


def add_common_args(parser: argparse.ArgumentParser, *, sizes: str = DEFAULT_SIZES,
                    iters: int = 5, warmup: int = 1) -> None:
    """``--sizes --iters --warmup --plot``, the flags every kvpool benchmark takes."""
    parser.add_argument("--sizes", type=_sizes_arg, default=parse_sizes(sizes), metavar="LIST",
                        help=f"comma-separated object/message sizes, binary units (default: {sizes})")
    parser.add_argument("--iters", type=_positive_int, default=iters, metavar="N",
                        help=f"timed rounds per size (default: {iters})")
    parser.add_argument("--warmup", type=_non_negative_int, default=warmup, metavar="N",
                        help=f"untimed rounds per size before the timed ones (default: {warmup})")
    parser.add_argument("--plot", metavar="FILE.png", default=None,
                        help="draw GB/s against size into this image (needs matplotlib)")


def _sizes_arg(text: str) -> list[int]:
    try:
        return parse_sizes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


# -- statistics ------------------------------------------------------------------------


def percentile(samples: Sequence[float], pct: float) -> float:
    """The ``pct``-th percentile (0..100) with linear interpolation between ranks; NaN if empty."""
    if not samples:
        return math.nan
    ordered = sorted(samples)
    rank = (len(ordered) - 1) * pct / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def gbps(nbytes: float, seconds: float) -> float:
    """Decimal gigabytes per second (1 GB/s = 1e9 bytes/s, as link and disk vendors quote)."""
    return nbytes / seconds / 1e9 if seconds > 0 else math.nan


@dataclass
class Timing:
    """Per-operation latencies (seconds) of ``nbytes`` each, grouped in rounds.

    ``gbps`` is the median over rounds of (bytes moved in the round / its time):
    on a shared machine one round disturbed by another process moves the
    median less than it moves a total. Latency percentiles use every sample.
    """

    nbytes: int
    rounds: list[list[float]] = field(default_factory=list)

    def add_round(self, samples_s: Sequence[float]) -> None:
        if samples_s:
            self.rounds.append(list(samples_s))

    @property
    def samples_s(self) -> list[float]:
        return [s for r in self.rounds for s in r]

    @property
    def count(self) -> int:
        return sum(len(r) for r in self.rounds)

    @property
    def gbps(self) -> float:
        rates = [gbps(self.nbytes * len(r), sum(r)) for r in self.rounds]
        return percentile(rates, 50)

    def p(self, pct: float) -> float:
        return percentile(self.samples_s, pct)


# -- progress ------------------------------------------------------------------------------


class Progress:
    """A single updating line on stderr: ``[ 12/48  25%  3.1s] dram get 4M``.

    On a terminal the line is rewritten in place (at most ~10 times a second);
    elsewhere (a log, a test's pipe) one line is written per step so output
    stays readable. ``done()`` ends the line.
    """

    def __init__(self, total_steps: int, stream: IO[str] | None = None, min_interval_s: float = 0.1) -> None:
        self.total = max(total_steps, 1)
        self.step = 0
        self.stream = stream if stream is not None else sys.stderr
        self.interactive = bool(getattr(self.stream, "isatty", lambda: False)())
        self.start = time.perf_counter()
        self._last_draw = 0.0
        self._min_interval_s = min_interval_s
        self._width = 0

    def advance(self, label: str, steps: int = 1) -> None:
        """Count ``steps`` as done and show ``label`` (what was just done)."""
        self.step = min(self.step + steps, self.total)
        self._draw(label, force=not self.interactive)

    def show(self, label: str) -> None:
        """Show what runs now without counting a step (terminals only: logs get one line per step)."""
        if self.interactive:
            self._draw(label, force=False)

    def _draw(self, label: str, force: bool) -> None:
        now = time.perf_counter()
        pct = 100 * self.step // self.total
        line = f"[{self.step:>{len(str(self.total))}}/{self.total} {pct:3d}% {now - self.start:6.1f}s] {label}"
        if not self.interactive:
            print(line, file=self.stream, flush=True)
            return
        if not force and now - self._last_draw < self._min_interval_s and self.step < self.total:
            return
        self._last_draw = now
        self.stream.write("\r" + line.ljust(self._width))
        self.stream.flush()
        self._width = len(line)

    def done(self) -> None:
        if self.interactive:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()


# -- output --------------------------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], align: str | None = None) -> str:
    """A plain-text table; ``align`` has one ``l``/``r`` per column (default: text left, numbers right)."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    if align is None:
        align = "".join("r" if rows and isinstance(rows[0][i], (int, float)) else "l" for i in range(len(headers)))

    def line(values: Sequence[str]) -> str:
        return "  ".join(v.rjust(w) if a == "r" else v.ljust(w) for v, w, a in zip(values, widths, align)).rstrip()

    out = [line(headers), "  ".join("-" * w for w in widths)]
    out.extend(line(r) for r in cells)
    return "\n".join(out)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        return f"{value:.2f}" if abs(value) >= 10 else f"{value:.3f}"
    return str(value)


def pyplot_or_none(path: str | None) -> Any:
    """matplotlib.pyplot (drawing to files only) for ``--plot path``; None when no plot was
    asked for, or matplotlib is not installed (said on stderr: the table is the result)."""
    if not path:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: never needs a display
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"--plot {path}: matplotlib is not installed (pip install matplotlib); "
              "no plot drawn, the table above has the numbers", file=sys.stderr)
        return None
    return plt


def plot_series(path: str, series: Sequence[dict[str, Any]], *, title: str,
                ylabel: str = "throughput (GB/s)", xlabel: str = "object size") -> bool:
    """Draw lines of GB/s against size (log2 x axis with size labels) into ``path``.

    Each series is ``{"label": str, "sizes": [bytes], "values": [float]}`` with
    optional ``"dashed"`` (a physical reference), ``"group"`` (series of one
    group share a colour), ``"marker"`` and ``"panel"`` (series with different
    panels go into side-by-side plots, titled by the panel name, so a 20 GB/s
    memory curve does not flatten a 1 GB/s disk curve). Returns False (and says
    why on stderr) when matplotlib is not installed; the benchmark's table is
    the result either way.
    """
    plt = pyplot_or_none(path)
    if plt is None:
        return False
    panels = list(dict.fromkeys(s.get("panel", "") for s in series)) or [""]
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 5.5), squeeze=False)
    colours: dict[str, Any] = {}
    for ax, panel in zip(axes[0], panels):
        sizes: set[int] = set()
        for s in (s for s in series if s.get("panel", "") == panel):
            group = s.get("group", s["label"])
            kwargs: dict[str, Any] = {"label": s["label"], "marker": s.get("marker", "o"),
                                      "linestyle": "--" if s.get("dashed") else "-"}
            if group in colours:
                kwargs["color"] = colours[group]
            (line,) = ax.plot(s["sizes"], s["values"], **kwargs)
            colours.setdefault(group, line.get_color())
            sizes.update(s["sizes"])
        ax.set_xscale("log", base=2)
        ticks = sorted(sizes)
        ax.set_xticks(ticks)
        ax.set_xticklabels([size_label(t) for t in ticks])
        ax.minorticks_off()
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.set_title(panel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small", ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# -- child processes ----------------------------------------------------------------


class Child:
    """A started child process and its log file: its output, and ways to end it (benchmarks and
    tests alike start their servers this way)."""

    def __init__(self, popen: subprocess.Popen[bytes], log_path: Path) -> None:
        self.popen = popen
        self.log_path = log_path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def output(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def kill(self) -> None:
        """SIGKILL (no cleanup in the child) and reap."""
        if self.popen.poll() is None:
            self.popen.kill()
        self.popen.wait(10)

    def stop(self, grace_s: float = 5.0) -> int:
        """SIGTERM, then SIGKILL after ``grace_s``; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
        return self.popen.wait(10)
