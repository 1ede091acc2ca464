"""What the two halves of kvpool's vLLM connector tell each other: the scheduler's plan for a
step (:class:`KvpoolConnectorMetadata`: blocks to load, to save, to load outside the steps),
the workers' answer (:class:`KvpoolWorkerMetadata`: where loads failed) and their
measurements (:class:`KvpoolStats`). vLLM carries them between the processes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

__all__ = ["NULL_BLOCK", "KvpoolConnectorMetadata", "KvpoolStats", "KvpoolWorkerMetadata", "Transfer"]


# vLLM's block pool hands out block 0 as its shared null block (BlockPool: the first block,
# ``is_null``): with the hybrid allocator, a sliding-window group's blocks that left the
# window are it. Nothing is ever loaded into it or saved from it.
NULL_BLOCK = 0


@dataclass
class Transfer:
    """Blocks of one request to load or save this step: ``keys[i]`` is block ``block_ids[i]``
    of the first KV cache group, ``groups[g - 1][i]`` of group ``g`` (vLLM's hybrid
    allocator: one list per further group, same length; empty with one group). A load's
    ``keys[0]`` is the request's block ``first`` (its prompt's blocks counted from 0).
    ``tail_tokens``: a save whose one key is a *tail* (a block saved for its first
    ``tail_tokens`` tokens: a prompt's partial last block): the worker zeroes the rest."""

    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    groups: tuple[list[int], ...] = ()
    first: int = 0
    tail_tokens: int = 0

    def ids(self, group: int) -> list[int]:
        return self.block_ids if group == 0 else self.groups[group - 1]


@dataclass
class KvpoolConnectorMetadata(KVConnectorMetadata):
    loads: list[Transfer] = field(default_factory=list)
    saves: list[Transfer] = field(default_factory=list)
    # Loads of requests waiting outside the model's steps (``load_async``): finished through
    # get_finished, never waited for by a forward pass.
    async_loads: list[Transfer] = field(default_factory=list)
    num_tokens: int = 0  # tokens the step computes (the worker measures the prefill rate)


@dataclass
class KvpoolWorkerMetadata(KVConnectorWorkerMetadata):
    """What the workers tell the scheduler's connector after a step (vLLM's worker-to-scheduler
    channel): ``load_failures`` {request id: the first of its prompt's blocks that failed to
    load}. The scheduler never loads that block or any after it for the request again: vLLM
    computes them (and a request it looks up anew, as after a failed asynchronous load of a
    model with several KV cache groups, loads only the blocks before)."""

    load_failures: dict[str, int] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        merged = dict(self.load_failures)
        for req_id, block in getattr(other, "load_failures", {}).items():
            merged[req_id] = min(block, merged.get(req_id, block))
        return KvpoolWorkerMetadata(merged)


class KvpoolStats(KVConnectorStats):
    """What a worker measured since its last report, for the scheduler's planner and vLLM's
    stats log: ``pulls`` [[bytes, seconds]] of each load request, ``prefill`` [[tokens,
    seconds]] of each step that computed at least a block, ``block_bytes`` (one block, one
    layer), ``layers``, ``node_ids`` (the workers' kvpool nodes), and counters."""

    def reset(self) -> None:
        self.data: dict[str, Any] = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for name, value in (other.data or {}).items():
            if isinstance(value, list):
                self.data.setdefault(name, []).extend(value)
            elif name in ("block_bytes", "layers", "rounds"):
                self.data[name] = value
            else:
                self.data[name] = self.data.get(name, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        pulls, prefill = self.data.get("pulls", []), self.data.get("prefill", [])
        return {"pulls": len(pulls), "MB pulled": round(sum(b for b, _ in pulls) / 1e6, 3),
                "pull s": round(sum(t for _, t in pulls), 4),
                "prefill tokens/s": round(sum(n for n, _ in prefill) / max(sum(t for _, t in prefill), 1e-9), 1),
                **{k: v for k, v in self.data.items()
                   if not isinstance(v, list) and k not in ("block_bytes", "layers", "rounds")}}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in ("pulls", "prefill", "blocks_loaded", "blocks_saved",
                                                    "blocks_failed"))
