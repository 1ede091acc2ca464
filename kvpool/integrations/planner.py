"""Load or recompute: a small cost model of the seeds' analysis (transfer bottlenecks).

Loading ``n`` blocks of a prefix costs ``rounds * alpha + n * block_bytes / beta``: ``alpha`` is
the fixed cost of one request (a round trip, a master lookup, a thread hand-off) and ``beta``
the bytes per second a pull moves; a layer-wise load makes one request per layer
(``rounds`` = layers). Recomputing them costs ``n * block_tokens / prefill_tokens_per_s``.
Both grow with ``n``, so loading wins for every prefix length or for none beyond a threshold:
:meth:`Planner.blocks_to_load` returns the blocks to load (all of them, or 0).

``alpha`` and ``beta`` are fitted (least squares, the most recent samples) from live pulls,
``(bytes, seconds)`` of each request; the prefill rate from measured steps, ``(tokens,
seconds)``. Until there are samples, the defaults say loading wins (a KV store is
configured because transfer is expected to be cheaper); a model that measures otherwise
stops loading, and one that measures too few samples keeps its defaults.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class Planner:
    alpha_s: float = 0.5e-3          # per request, until measured
    beta_bytes_per_s: float = 1e9    # until measured
    prefill_tokens_per_s: float = 0.0  # 0: not measured yet (loading is assumed to win)
    window: int = 64
    _pulls: deque[tuple[float, float]] = field(default_factory=deque, repr=False)
    _steps: deque[tuple[float, float]] = field(default_factory=deque, repr=False)

    def observe_pull(self, nbytes: float, seconds: float) -> None:
        """One request of a load: its bytes and how long it took."""
        if self._keep(self._pulls, nbytes, seconds):
            self._fit_link()

    def observe_prefill(self, tokens: float, seconds: float) -> None:
        """One forward step that computed ``tokens`` tokens (time spent waiting for loads excluded)."""
        if self._keep(self._steps, tokens, seconds):
            self.prefill_tokens_per_s = sum(t for t, _ in self._steps) / sum(s for _, s in self._steps)

    def _keep(self, samples: deque[tuple[float, float]], amount: float, seconds: float) -> bool:
        """Add a sample (the oldest beyond ``window`` go); False for a meaningless one."""
        if amount <= 0 or seconds <= 0:
            return False
        samples.append((float(amount), float(seconds)))
        while len(samples) > self.window:
            samples.popleft()
        return True

    def _fit_link(self) -> None:
        """Least squares of seconds = alpha + bytes / beta over the samples kept; the fit is used
        only when the sizes differ enough to separate the two and both come out positive."""
        n = len(self._pulls)
        if n < 2:
            return
        mean_x = sum(x for x, _ in self._pulls) / n
        mean_y = sum(y for _, y in self._pulls) / n
        var_x = sum((x - mean_x) ** 2 for x, _ in self._pulls)
        if var_x <= (0.05 * mean_x) ** 2 * n:  # all requests about one size: only the sum is known
            per_byte = mean_y / mean_x
            self.beta_bytes_per_s = 1.0 / max(per_byte - self.alpha_s / mean_x, per_byte * 0.5)
            return
        slope = sum((x - mean_x) * (y - mean_y) for x, y in self._pulls) / var_x
        intercept = mean_y - slope * mean_x
        if slope > 0:
            self.beta_bytes_per_s = 1.0 / slope
            self.alpha_s = max(intercept, 0.0)

    def transfer_s(self, blocks: int, block_bytes: int, rounds: int = 1) -> float:
        return rounds * self.alpha_s + blocks * block_bytes / self.beta_bytes_per_s if blocks else 0.0

    def recompute_s(self, blocks: int, block_tokens: int) -> float | None:
        """None while the prefill rate is unknown."""
        if self.prefill_tokens_per_s <= 0:
            return None
        return blocks * block_tokens / self.prefill_tokens_per_s

    def blocks_to_load(self, blocks: int, block_bytes: int, block_tokens: int, rounds: int = 1) -> int:
        """How many of ``blocks`` leading blocks to load (the rest are recomputed): all of them when
        transferring them is faster than computing them, else none."""
        if blocks <= 0:
            return 0
        recompute = self.recompute_s(blocks, block_tokens)
        if recompute is None:
            return blocks
        return blocks if self.transfer_s(blocks, block_bytes, rounds) < recompute else 0
