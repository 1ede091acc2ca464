"""The vLLM connector's settings (``kv_connector_extra_config``) and the namespace of its
block hashes: what must agree for two engines to read each other's blocks.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import xxhash

from kvpool import errors

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config``, checked once at start-up (ConfigError names the setting)."""

    master: str
    config: str | None = None
    durable: bool | None = None  # None: the pool config's node.durable (kvpool.client.durable_copies)
    replicas: int | None = None  # None: the pool config's node.replicas
    load_timeout_s: float = 30.0
    on_load_failure: Literal["recompute", "fail"] = "recompute"
    transport: str = "auto"
    plan: bool = True
    layers_per_pull: int = 0  # 0: auto
    # True: requests wait for their blocks outside the model's steps; False: their first step
    # waits, layer by layer; "auto": False when the blocks are read without the network, else True
    load_async: bool | Literal["auto"] = "auto"
    cpus: str | frozenset[int] = "auto"  # where the connector's threads run: "auto", "inherit" or CPU ids

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        from kvpool.config import check_master_address

        extra = dict(extra or {})
        known = {"master", "config", "durable", "replicas", "load_timeout_s", "on_load_failure", "transport", "plan",
                 "layers_per_pull", "load_async", "cpus"}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise errors.ConfigError(f"kv_connector_extra_config: unknown setting(s) {unknown}; known: {sorted(known)}")
        master = extra.get("master")
        if not isinstance(master, str) or not master:
            raise errors.ConfigError(
                'kv_connector_extra_config needs "master": "tcp://HOST:PORT" (the kvpool master, e.g. the one '
                "kvpool-server starts)")
        check_master_address(master)
        config = extra.get("config")
        if config is not None and not isinstance(config, str):
            raise errors.ConfigError('kv_connector_extra_config "config" must be the path of a kvpool TOML file')
        durable, replicas, timeout = extra.get("durable"), extra.get("replicas"), extra.get("load_timeout_s", 30.0)
        if durable is not None and not isinstance(durable, bool):
            raise errors.ConfigError(f'kv_connector_extra_config "durable" must be true or false, got {durable!r}')
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise errors.ConfigError(f'kv_connector_extra_config "replicas" must be an int >= 1, got {replicas!r}')
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise errors.ConfigError(f'kv_connector_extra_config "load_timeout_s" must be > 0, got {timeout!r}')
        on_failure = extra.get("on_load_failure", "recompute")
        if on_failure not in ("recompute", "fail"):
            raise errors.ConfigError(
                f'kv_connector_extra_config "on_load_failure" must be "recompute" or "fail", got {on_failure!r}')
        transport = extra.get("transport", "auto")
        if transport not in ("auto", "tcp"):
            raise errors.ConfigError(
                f'kv_connector_extra_config "transport" must be "auto" or "tcp", got {transport!r}')
        plan = extra.get("plan", True)
        if not isinstance(plan, bool):
            raise errors.ConfigError(f'kv_connector_extra_config "plan" must be true or false, got {plan!r}')
        per_pull = extra.get("layers_per_pull", "auto")
        if per_pull != "auto" and (isinstance(per_pull, bool) or not isinstance(per_pull, int) or per_pull < 1):
            raise errors.ConfigError(
                f'kv_connector_extra_config "layers_per_pull" must be "auto" or an int >= 1, got {per_pull!r}')
        load_async = extra.get("load_async", "auto")
        if not isinstance(load_async, bool) and load_async != "auto":
            raise errors.ConfigError(
                f'kv_connector_extra_config "load_async" must be "auto", true or false, got {load_async!r}')
        cpus = extra.get("cpus", "auto")
        if cpus not in ("auto", "inherit"):
            if not isinstance(cpus, list) or not cpus or any(
                    isinstance(c, bool) or not isinstance(c, int) or c < 0 for c in cpus):
                raise errors.ConfigError(
                    f'kv_connector_extra_config "cpus" must be "auto", "inherit" or a list of CPU ids, got {cpus!r}')
            cpus = frozenset(cpus)
        return cls(master, config, durable, replicas, float(timeout), "fail" if on_failure == "fail" else "recompute",
                   transport, plan, 0 if per_pull == "auto" else per_pull, load_async, cpus)

    def pool_config(self) -> dict[str, Any]:
        """The kvpool settings of this engine's own pool: the TOML's, as a mapping, so that one
        naming no ``pool.name`` opens a pool of its own (``client-<pid>``) and never collides
        with a kvpool-server or another engine on the host."""
        if not self.config:
            return {}
        try:
            with open(self.config, "rb") as fh:
                return tomllib.load(fh)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise errors.ConfigError(f'kv_connector_extra_config "config": cannot read {self.config}: {exc}') from None


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """Names the weights, not just where they are: for a local directory, the names, sizes and
    modification times of its files (a model saved again at the same path is another model);
    for a hub id, its revision."""
    if os.path.isdir(model):
        hasher = xxhash.xxh3_64()
        for entry in sorted(os.scandir(model), key=lambda e: e.name):
            if entry.is_file():
                st = entry.stat()
                hasher.update(f"{entry.name}:{st.st_size}:{st.st_mtime_ns};".encode())
        return f"{os.path.realpath(model)}@{hasher.hexdigest()}"
    return f"{model}@{revision or 'main'}"


def namespace_of(vllm_config: VllmConfig, tp_rank: int = 0) -> str:
    """What must agree for two engines to read each other's blocks (see
    :mod:`kvpool.integrations.vllm`): the model, the cache dtype, the block size, the
    layout of a block (device kind, the CPU's vector ISA on CPU) and the parallel ranks."""
    import torch

    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    device = str(getattr(vllm_config.device_config, "device_type", "")) or "cpu"
    isa = torch.backends.cpu.get_cpu_capability() if device == "cpu" else ""
    return "|".join(["vllm-blocks-v1", model_fingerprint(str(model.model), model.revision), str(model.dtype),
                     str(cache.cache_dtype), f"bs{cache.block_size}", f"{device}{'-' + isa if isa else ''}",
                     f"tp{tp_rank}/{parallel.tensor_parallel_size}", f"pp{parallel.pipeline_parallel_size}"])
