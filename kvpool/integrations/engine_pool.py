"""The kvpool settings an engine-side store takes (SGLang's HiCache backend, LMCache's L2
adapter): ``master``, ``config``, ``durable``, ``replicas``, ``transport``, checked once, and the
pool they open. The vLLM connector has its own (:mod:`kvpool.integrations.vllm_settings`), whose
default pool (a shared-memory arena, no dram tier) these share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvpool import errors

if TYPE_CHECKING:
    from kvpool.api import PoolAPI

__all__ = ["POOL_KEYS", "EnginePool"]

#: the settings :meth:`EnginePool.from_settings` reads
POOL_KEYS = frozenset({"master", "config", "durable", "replicas", "transport"})


@dataclass(frozen=True)
class EnginePool:
    """Where an engine-side store keeps its objects: on ``master`` (None: a pool embedded in
    the process), with ``config`` (a kvpool TOML path or its settings; None: the shared-memory
    default), ``durable`` / ``replicas`` (None: the config's), pulls over ``transport``."""

    master: str | None = None
    config: str | Mapping[str, Any] | None = None
    durable: bool | None = None
    replicas: int | None = None
    transport: str = "auto"

    @classmethod
    def from_settings(cls, settings: Mapping[str, Any]) -> EnginePool:
        """The :data:`POOL_KEYS` of ``settings`` (others are the caller's to check); raises
        ConfigError naming the first bad one."""
        from kvpool.config import check_master_address

        master = settings.get("master")
        if master is not None:
            if not isinstance(master, str) or not master:
                raise errors.ConfigError(f'"master" must be a kvpool master address "tcp://HOST:PORT", got {master!r}')
            check_master_address(master)
        config = settings.get("config")
        if config is not None and not isinstance(config, (str, Mapping)):
            raise errors.ConfigError(f'"config" must be a kvpool TOML path or a mapping, got {type(config).__name__}')
        durable, replicas = settings.get("durable"), settings.get("replicas")
        if durable is not None and not isinstance(durable, bool):
            raise errors.ConfigError(f'"durable" must be true or false, got {durable!r}')
        if replicas is not None and (isinstance(replicas, bool) or not isinstance(replicas, int) or replicas < 1):
            raise errors.ConfigError(f'"replicas" must be an int >= 1, got {replicas!r}')
        if master is None and (durable is not None or replicas is not None):
            raise errors.ConfigError('"durable" and "replicas" need a "master": durable copies live on storage nodes')
        transport = settings.get("transport", "auto")
        if transport not in ("auto", "tcp"):
            raise errors.ConfigError(f'"transport" must be "auto" or "tcp", got {transport!r}')
        return cls(master, config, durable, replicas, transport)

    def open(self, *, start_ucx: bool = False) -> PoolAPI:
        """The pool: connected to ``master`` (without ``config``, every object in a shared-memory
        arena that other processes on the host read in place, as the vLLM connector's default: no
        dram tier), or embedded. ``start_ucx``: start UCX now, not at the first pull that wants it
        (starting it holds the GIL for a while, stalling a server mid-request). Raises what
        :func:`kvpool.connect` / :class:`kvpool.Pool` raise (MasterUnreachableError, ConfigError)."""
        from kvpool.client import connect
        from kvpool.integrations.vllm_settings import default_pool_config
        from kvpool.pool import Pool

        if self.master is None:
            return Pool(config=self.config)
        pool = connect(self.master, config=self.config if self.config is not None else default_pool_config(),
                       transport=self.transport)
        if start_ucx:
            pool.start_ucx()
        return pool
