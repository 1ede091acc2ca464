"""Configuration: one dataclass per component, TOML files mapped onto them.

Every knob is declared once here, with its type, unit and default. TOML files
(``conf/*.toml``, read with :mod:`tomllib`) and command-line flags
(``--tiers.dram.capacity 2GiB``, generated from these dataclasses) override the
defaults; keys left out keep them. An unknown key or a bad value raises
:class:`kvpool.errors.ConfigError` naming the key and the file.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import itertools
import json
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvpool import errors

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": TiB,
}
_SIZE_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$")
_TCP_ADDRESS_RE = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.*-]+):([0-9]{1,5})$")
_ETCD_URL_RE = re.compile(r"^(?:http://)?(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})/?$")
VALID_ADDRESS_HINT = "tcp://HOST:PORT with a port 1-65535 (e.g. tcp://127.0.0.1:7700) or ipc:///path/to/socket"


def check_master_address(address: Any, what: str = "master address") -> str:
    """``address`` if it is a ZeroMQ address kvpool can use, else ConfigError saying what one looks like.

    ZeroMQ itself rejects ``localhost:7700`` only when a socket connects, and a
    socket left open by that failure hangs context termination forever, so
    every master address is checked here first.
    """
    if isinstance(address, str):
        m = _TCP_ADDRESS_RE.match(address)
        if m and 1 <= int(m.group(2)) <= 65535:
            return address
        if address.startswith("ipc://") and len(address) > len("ipc://") and "\0" not in address:
            return address
    raise errors.ConfigError(f"{what} {address!r} is not valid: expected {VALID_ADDRESS_HINT}")


def parse_endpoints(value: str) -> list[tuple[str, int]]:
    """``"http://h1:2379,h2:2379"`` -> ``[("h1", 2379), ("h2", 2379)]``; ConfigError when malformed."""
    endpoints = []
    for part in (p.strip() for p in value.split(",")):
        m = _ETCD_URL_RE.match(part)
        if not part or m is None or not 1 <= int(m.group(2)) <= 65535:
            raise errors.ConfigError(
                f"master.etcd: {part!r} is not an etcd client URL: expected http://HOST:PORT[,http://HOST:PORT...] "
                f"(e.g. http://127.0.0.1:2379; TLS endpoints are not supported)")
        endpoints.append((m.group(1).strip("[]"), int(m.group(2))))
    return endpoints


def master_address(config: Config, explicit: str | None = None) -> str | None:
    """The master a client or node talks to: ``explicit``, else None with ``master.etcd`` (follow
    the leader there), else ``master.listen``."""
    if explicit:
        return explicit
    return None if config.master.etcd else config.master.listen


def node_host(config: Config, master: str | None = None) -> str:
    """The address this process's node serves on: ``node.host`` when set; else (``""``, auto)
    127.0.0.1 when the master is on this host, or the local address of the route to the
    master, so that a node or client on another host is reachable with no extra setting."""
    if config.node.host:
        return config.node.host
    if master is None and config.master.etcd:  # the masters' hosts are not known yet: route to etcd's
        host, port = parse_endpoints(config.master.etcd)[0]
        master = f"tcp://{host}:{port}"
    master = master or config.master.listen
    m = _TCP_ADDRESS_RE.match(master or "")
    if m is None:  # ipc:// or unparsable: this host only
        return "127.0.0.1"
    master_host, port = m.group(1).strip("[]"), int(m.group(2))
    if master_host in ("*", "0.0.0.0", "::", "localhost") or master_host.startswith("127.") or master_host == "::1":
        return "127.0.0.1"
    import socket

    try:
        family = socket.AF_INET6 if ":" in master_host else socket.AF_INET
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((master_host, port))  # no packet is sent: this only asks the routing table
            return str(probe.getsockname()[0])
    except OSError as exc:
        raise errors.ConfigError(
            f"node.host: no route from this host to the master {master} ({exc.strerror or exc}); "
            f"set node.host to this host's address") from None


def parse_size(value: Any) -> int:
    """Bytes from an int or a string such as ``"512MiB"``, ``"2GiB"``, ``"64KB"``."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size, got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ValueError(f"expected a size like 1073741824 or '1GiB', got {value!r}")


def headroom_bytes(value: Any, filesystem_bytes: int) -> int:
    """The bytes an nvme tier leaves free on a filesystem of ``filesystem_bytes``
    (``tiers.nvme.headroom``): ``"auto"`` is the larger of 64 MiB and 2% of the filesystem, at
    most a quarter of it; ``"N%"`` is N percent of it (0 <= N < 100); anything else is a size
    (:func:`parse_size`; 0: none). ValueError for anything else."""
    if isinstance(value, str) and value.strip().lower() == "auto":
        return min(max(64 * MiB, filesystem_bytes // 50), filesystem_bytes // 4)
    if isinstance(value, str) and value.strip().endswith("%"):
        try:
            percent = float(value.strip()[:-1])
        except ValueError:
            percent = -1.0
        if not 0 <= percent < 100:
            raise ValueError(f"expected a percentage from 0% to 99%, got {value!r}")
        return int(filesystem_bytes * percent / 100)
    try:
        return parse_size(value)
    except ValueError:
        raise ValueError(f"expected auto, a size like '256MiB' or a percentage like '5%', got {value!r}") from None


def format_size(nbytes: float) -> str:
    for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(nbytes) >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{int(nbytes)} B"


def _size(default: int | str, doc: str) -> Any:
    return field(default=parse_size(default), metadata={"size": True, "doc": doc})


def _opt(default: Any, doc: str, choices: tuple[Any, ...] | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "choices": choices})


# -- sections -----------------------------------------------------------------


@dataclass
class PoolSection:
    name: str = _opt("default", "pool name; the cxl arena (with data_dir) and log lines are named after it; "
                                "left out: kvpool.Pool() opens 'embedded', kvpool.connect() client-<pid>")
    data_dir: str = _opt("~/.local/share/kvpool", "directory holding nvme segments and the index")
    chunk_tokens: int = _opt(256, "tokens per prefix chunk (one object per chunk)")
    token_dtype: str = _opt("int32", "token width used in prefix hashes", ("int32", "int64"))
    max_key_bytes: int = _opt(256, "longest key accepted, in bytes")

    def resolved_data_dir(self) -> Path:
        return Path(os.path.expandvars(os.path.expanduser(self.data_dir)))


@dataclass
class HbmSection:
    capacity: int = _size(0, "bytes of GPU memory; 0 disables the tier")
    put: bool = _opt(True, "new objects may land in this tier")
    device: int = _opt(0, "CUDA device ordinal")
    emulate: bool = _opt(True, "without a CUDA device, emulate it with host memory (reported in stats)")


@dataclass
class DramSection:
    capacity: int = _size("1GiB", "bytes of host memory; 0 disables the tier")
    put: bool = _opt(True, "new objects may land in this tier")
    mlock: bool = _opt(True, "page-lock the arena as far as RLIMIT_MEMLOCK allows")
    prefault: bool = _opt(False, "fault in (and lock) every page at start so first puts run at memcpy speed; "
                                 "false: pages come (and are locked) in 64 MiB steps as objects first use them")


@dataclass
class CxlSection:
    capacity: int = _size("1GiB", "bytes of the shared-memory arena; 0 disables the tier")
    put: bool = _opt(True, "new objects may land in this tier")
    path: str = _opt("", "arena file; default /dev/shm/kvpool-<uid>/kvpool-<pool name>-<hash of data_dir>-cxl "
                          "(in a directory only this user can create names in); never another user's file")
    prefault: bool = _opt(False, "allocate and map the whole arena at start; false: the file is allocated in "
                                 "16 MiB steps as objects first use it (a full /dev/shm lowers the capacity)")
    ready_ahead: int = _size("256MiB", "with prefault false: bytes a background thread keeps allocated and "
                                       "mapped beyond the arena's highest object, so puts copy at memory speed "
                                       "instead of paying for new shared-memory pages; "
                                       "0: each put readies what it needs")
    group: str = _opt("", "a group (name or gid) whose members may read this arena and its index "
                          "(files 0640); empty: this user only (0600)")
    shared_dirs: str = _opt("", "more directories (':'-separated) whose same-host cxl arenas may be mapped; "
                                "/dev/shm and this arena's own directory always may, nothing else")
    latency_ns: float = _opt(0.0, "emulated access latency per operation (0 = no model)")
    bandwidth_gbps: float = _opt(0.0, "emulated bandwidth in GB/s (0 = no model; CXL 3.0 Type 3 ~64)")


@dataclass
class NvmeSection:
    capacity: int = _size("8GiB", "bytes of segment files; 0 disables the tier")
    put: bool = _opt(True, "new objects may land in this tier")
    path: str = _opt("", "directory of segment files and index; default <data_dir>/nvme for pool "
                          "'default', <data_dir>/nvme-<pool name> for any other")
    segment_size: int = _size("1GiB", "bytes per preallocated segment file (largest object)")
    direct_io: str = _opt("auto", "O_DIRECT: auto (use where supported), on (required), off", ("auto", "on", "off"))
    fsync: bool = _opt(False, "fdatasync data and index on every put (survive power loss, not only crashes)")
    io_threads: int = _opt(4, "parallel I/Os per large read/write")
    io_chunk: int = _size("4MiB", "bytes per I/O when a read or write is split across threads")
    headroom: str = field(default="auto", metadata={
        "headroom": True, "doc": "free space the tier leaves on its filesystem (for its index, durable.log and "
                                 "everything else there): auto (the larger of 64MiB and 2% of the filesystem, "
                                 "at most a quarter of it), a size, or a percentage like \"5%\"; 0: none"})


@dataclass
class TiersSection:
    hbm: HbmSection = field(default_factory=HbmSection)
    dram: DramSection = field(default_factory=DramSection)
    cxl: CxlSection = field(default_factory=CxlSection)
    nvme: NvmeSection = field(default_factory=NvmeSection)


@dataclass
class EvictionSection:
    policy: str = _opt("lru", "which object a full tier demotes first", ("lru", "s3fifo"))
    promote: bool = _opt(True, "copy an object up a tier when it is hit below the top")
    promote_min_hits: int = _opt(2, "hits in a lower tier before promotion (one-off reads never churn)")


@dataclass
class MasterSection:
    listen: str = _opt("tcp://127.0.0.1:7700", "ZeroMQ address the master binds / clients connect to")
    heartbeat_ms: int = _opt(1000, "node heartbeat period")
    dead_after_missed: int = _opt(3, "missed heartbeats before a node is declared dead")
    reservation_timeout_s: float = _opt(30.0, "a put reserved but never committed is reclaimed after this")
    lease_s: float = _opt(10.0, "a located replica is pinned for this long unless released")
    request_timeout_s: float = _opt(5.0, "client deadline for one master round trip")
    forget_nodes_after_s: float = _opt(60.0, "dead or departed nodes stay in stats this long, then are forgotten")
    rereplicate_per_s: float = _opt(
        20.0, "durable copies the master re-creates per second at most after a holder dies or leaves (0: off)")
    rereplicate_timeout_s: float = _opt(30.0, "deadline for one re-replication (target pulls, stores, commits)")
    max_request_bytes: int = _size(
        "64MiB", "largest message the master (and a node's control socket) accepts; larger ones are dropped "
        "unread (ZeroMQ MAXMSGSIZE); clients refuse to send them (RequestTooLargeError)")
    max_batch: int = _opt(
        65536, "most keys/items/records in one request; more is RequestTooLargeError "
        "(MasterClient splits larger batches into several requests)")
    max_keys: int = _opt(
        100_000_000, "most keys the master indexes (about 50 bytes of memory each); a publish, commit or "
        "register that would index more is refused whole with PoolFullError (0: no limit)")
    max_address_bytes: int = _size("64KiB", "longest node address a node may register with (RequestTooLargeError)")
    tcp_queries: bool = _opt(True, "also answer exists / lookup / ping on a plain TCP port (ephemeral, on the "
                                   "listen address, found through ping; both ends prove the cluster key, the "
                                   "answers are not encrypted): a one-key exists without ZeroMQ's I/O threads")
    etcd: str = _opt("", "etcd client URLs (http://HOST:PORT, comma-separated) for a highly available master: "
                         "masters elect a leader there, clients and nodes find it there; empty: one master "
                         "at master.listen")
    etcd_prefix: str = _opt("/kvpool", "etcd key prefix of this cluster's leader and master list (one per cluster)")
    leader_ttl_s: int = _opt(2, "etcd lease of the leader: a dead leader is replaced this long after its last "
                                "renewal (etcd's minimum is about 2 s)")


@dataclass
class NodeSection:
    host: str = _opt("", "address whose interface the node's UCX transports and control socket use (nothing "
                         "listens elsewhere); empty: 127.0.0.1 with a master on this host, else the local "
                         "address of the route to the master")
    port: int = _opt(0, "0: no UCX sockaddr listener, peers connect by worker address; a port: also "
                        "listen there (ucxx binds that listener to EVERY interface)")
    max_message: int = _size("16MiB", "large layer ranges are split into messages of at most this many bytes")
    durable: bool = _opt(False, "puts default to durable placement on storage nodes")
    replicas: int = _opt(1, "replicas for durable puts")
    pull_timeout_s: float = _opt(10.0, "deadline for one pull from a peer")
    same_host_index: bool = _opt(True, "find objects in same-host nodes' cxl arenas by key, without the master")
    location_cache: int = _opt(65536, "keys whose holder is remembered, so a repeat get skips the master (0: off)")
    speculative_pulls: bool = _opt(True, "a get, and get_many for its whole batch, first pulls from the node "
                                         "last pulled from (a decode node mostly reads one prefill node's keys)")
    confirm_speculative: bool = _opt(False, "use a speculative pull's bytes only once the master's locate (sent "
                                            "alongside) names that holder and version, so a key deleted by "
                                            "another process is a miss at once (get_many then guesses "
                                            "nothing); false: the holder's verified answer is used with no "
                                            "master round trip, as a remembered location's is")
    tcp_pull_max: int = _size("16MiB", "pulls of at most this many bytes go over a plain TCP connection to the "
                                      "holder (node.host, an ephemeral port), larger ones over UCX (from a "
                                      "same-host holder over UCX shared memory: above 1 MiB); 0: every pull "
                                      "over UCX and no TCP port (set 0 where UCX has RDMA)")
    reply_poll_us: int = _opt(200, "a reader polls for a TCP pull's reply bytes or a master query's answer this "
                                   "long at each wait before it blocks (a blocked thread's idle vCPU is slow to "
                                   "wake); one thread at a time, without the GIL, and not while polls keep "
                                   "running out or being preempted; 0: block at once")
    serve_poll_us: int = _opt(200, "a holder's thread polls for a reader's next TCP pull request this long after "
                                   "answering one, before it blocks (one connection at a time, without the GIL, "
                                   "and not while polls keep running out or being preempted); 0: block at once")
    hello_timeout_s: float = _opt(3.0, "a connection to this node's TCP pull port must complete its opening "
                                       "(hello, answer, proof) this soon, or it is closed")
    hand_off_s: float = _opt(0.0, "a client that closes spends at most this long having a storage node on its "
                                  "host keep the objects it holds (newest first; a shared-memory tier there "
                                  "first), so a process started after it still finds them; 0: they leave with "
                                  "it (the vLLM connector's default pool: 3)")
    unproven_per_address: int = _opt(16, "connections from one peer address that have not (yet) proved the "
                                         "cluster key; a newer one cuts the oldest (the port's descriptors stay "
                                         "for peers with the key)")


@dataclass
class MetricsSection:
    port: int = _opt(0, "Prometheus/health HTTP port on 127.0.0.1; 0 disables")


@dataclass
class SecuritySection:
    auth: bool = _opt(True, "authenticate every process with the cluster key (false is UNSAFE: anyone who can "
                            "reach a port can read, poison and delete keys)")
    key_file: str = _opt("", "cluster secret; default $XDG_CONFIG_HOME/kvpool/cluster.key (~/.config/kvpool), "
                             "created 0600 on first use; copy it to every host (kvpool keygen FILE makes one)")
    token_ttl_s: float = _opt(30.0, "a pull token issued with a locate is accepted for this long")


@dataclass
class Config:
    pool: PoolSection = field(default_factory=PoolSection)
    tiers: TiersSection = field(default_factory=TiersSection)
    eviction: EvictionSection = field(default_factory=EvictionSection)
    master: MasterSection = field(default_factory=MasterSection)
    node: NodeSection = field(default_factory=NodeSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    security: SecuritySection = field(default_factory=SecuritySection)

    def __post_init__(self) -> None:
        # Dotted names of the settings a file, mapping, flag or set() gave (not a field: it is
        # bookkeeping, never a setting); see given().
        self._given: set[str] = set()

    # -- loading ------------------------------------------------------------

    @classmethod
    def load(cls, source: str | os.PathLike[str] | Mapping[str, Any] | Config | None = None) -> Config:
        """Defaults overridden by a TOML file path, a mapping, or a Config (returned as is)."""
        if isinstance(source, Config):
            return source
        config = cls()
        if source is None:
            return config
        if isinstance(source, Mapping):
            config.update(source, origin="<mapping>")
            return config
        path = Path(source)
        try:
            with path.open("rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise errors.ConfigError(f"config file {path} does not exist") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as exc:  # any bytes: refused
            raise errors.ConfigError(f"{path}: not valid TOML: {str(exc)[:200]}") from None
        except OSError as exc:
            raise errors.ConfigError(f"config file {path} cannot be read: {exc.strerror}") from None
        config.update(data, origin=str(path))
        return config

    def update(self, data: Mapping[str, Any], *, origin: str) -> None:
        _apply(self, data, prefix="", origin=origin, given=self._given)
        self.validate(origin)

    def given(self, dotted_key: str) -> bool:
        """Whether ``dotted_key`` (e.g. ``pool.name``) was set by whoever made these settings: in a
        file, a mapping, a flag or :meth:`set`, or (a Config built in code) to a value other than
        its default. Settings nobody gave are the ones each kind of process may choose for itself
        (:func:`settings_for`)."""
        if dotted_key in self._given:
            return True
        value: Any = self
        default: Any = Config()
        for part in dotted_key.split("."):
            value, default = getattr(value, part), getattr(default, part)
        return bool(value != default)

    def set(self, dotted_key: str, value: Any, *, origin: str = "<command line>") -> None:
        """Set one setting by its dotted name, e.g. ``tiers.dram.capacity``."""
        *parents, leaf = dotted_key.split(".")
        nested: dict[str, Any] = {leaf: value}
        for part in reversed(parents):
            nested = {part: nested}
        self.update(nested, origin=origin)

    def validate(self, origin: str) -> None:
        def bad(key: str, why: str) -> errors.ConfigError:
            return errors.ConfigError(f"{origin}: {key}: {why}")

        if self.pool.chunk_tokens <= 0:
            raise bad("pool.chunk_tokens", "must be positive")
        nvme = self.tiers.nvme
        if nvme.capacity and nvme.segment_size <= 0:
            raise bad("tiers.nvme.segment_size", "must be positive")
        if nvme.io_threads <= 0:
            raise bad("tiers.nvme.io_threads", "must be positive")
        if self.eviction.promote_min_hits < 1:
            raise bad("eviction.promote_min_hits", "must be >= 1")
        try:
            check_master_address(self.master.listen)
        except errors.ConfigError as exc:
            raise bad("master.listen", str(exc)) from None
        if self.master.etcd:
            try:
                parse_endpoints(self.master.etcd)
            except errors.ConfigError as exc:
                raise bad("master.etcd", str(exc).removeprefix("master.etcd: ")) from None
            if not self.master.etcd_prefix.startswith("/") or len(self.master.etcd_prefix) > 200:
                raise bad("master.etcd_prefix", "must start with / (at most 200 characters)")
        if not 1 <= self.master.leader_ttl_s <= 600:
            raise bad("master.leader_ttl_s", "must be 1..600 seconds")
        if self.master.heartbeat_ms <= 0 or self.master.dead_after_missed <= 0:
            raise bad("master.heartbeat_ms", "heartbeat period and dead_after_missed must be positive")
        if self.master.max_request_bytes < 1 << 20:
            raise bad("master.max_request_bytes", "must be at least 1MiB")
        if self.master.max_batch < 1:
            raise bad("master.max_batch", "must be >= 1")
        if self.master.max_keys < 0:
            raise bad("master.max_keys", "must be >= 0")
        if not 256 <= self.master.max_address_bytes <= self.master.max_request_bytes // 16:
            raise bad("master.max_address_bytes", "must be at least 256 bytes and at most max_request_bytes / 16")
        if self.node.replicas < 1:
            raise bad("node.replicas", "must be >= 1")
        if self.node.location_cache < 0:
            raise bad("node.location_cache", "must be >= 0")
        if self.node.tcp_pull_max < 0:
            raise bad("node.tcp_pull_max", "must be >= 0")
        for name in ("reply_poll_us", "serve_poll_us"):
            if not 0 <= getattr(self.node, name) <= 10_000:
                raise bad(f"node.{name}", "must be between 0 and 10000 (10 ms): a longer poll only burns a CPU")
        if self.node.max_message < 4096:
            raise bad("node.max_message", "must be at least 4096 bytes")
        if self.security.token_ttl_s <= 0:
            raise bad("security.token_ttl_s", "must be positive")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# -- the pool a process opens when its settings name none ---------------------------------

DAEMON_POOL = "default"  # kvpool-server
EMBEDDED_POOL = "embedded"  # kvpool.Pool()
_client_pools = itertools.count()


def settings_for(source: str | os.PathLike[str] | Mapping[str, Any] | Config | None, *, process: str) -> Config:
    """The settings a process of kind ``process`` opens its pool with: ``Config.load(source)`` plus
    one rule for what the settings leave out, whatever form they take (None, a TOML file, a
    mapping or a Config, which is copied, never changed):

    * ``"server"`` (``kvpool-server``): pool ``default``, as declared.
    * ``"embedded"`` (``kvpool.Pool()``): no ``pool.name`` given opens pool ``embedded``, never the
      one a kvpool-server on this host has open with the same defaults.
    * ``"client"`` (``kvpool.connect()``): no ``pool.name`` given opens this process's own pool
      (``client-<pid>``, ``client-<pid>-<n>`` for the n-th after the first), so clients never
      collide with each other or with a kvpool-server; and no nvme tier unless
      ``tiers.nvme.capacity`` is given (durable copies live on storage nodes).

    Raises ConfigError for settings that do not load, ValueError for an unknown ``process``.
    """
    if process not in ("server", "embedded", "client"):
        raise ValueError(f"process must be 'server', 'embedded' or 'client', got {process!r}")
    config = Config.load(source)
    chosen: dict[str, Any] = {}
    if process != "server" and not config.given("pool.name"):
        if process == "embedded":
            chosen["pool.name"] = EMBEDDED_POOL
        else:
            n = next(_client_pools)  # a second client pool in this process needs its own name too
            chosen["pool.name"] = f"client-{os.getpid()}" + (f"-{n}" if n else "")
    if process == "client" and not config.given("tiers.nvme.capacity"):
        chosen["tiers.nvme.capacity"] = 0
    if chosen and config is source:
        config = copy.deepcopy(config)
    for dotted, value in chosen.items():
        config.set(dotted, value, origin=f"kvpool {process} defaults")
    return config


def _apply(obj: Any, data: Mapping[str, Any], *, prefix: str, origin: str, given: set[str]) -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        dotted = f"{prefix}{key}"
        f = fields.get(key)
        if f is None:
            raise errors.ConfigError(
                f"{origin}: unknown key {dotted!r} (known here: {', '.join(sorted(fields))})"
            )
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, Mapping):
                raise errors.ConfigError(f"{origin}: {dotted} must be a table, got {value!r}")
            _apply(current, value, prefix=f"{dotted}.", origin=origin, given=given)
            continue
        try:
            setattr(obj, key, _coerce(f, current, value))
        except ValueError as exc:
            raise errors.ConfigError(f"{origin}: {dotted}: {exc}") from None
        given.add(dotted)


_DURATION_RE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*(us|ms|s|m|h)\s*$")
_DURATION_UNITS = {"us": 1e-6, "ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_UNIT_NAMES = {1e-6: "microseconds", 0.001: "milliseconds", 1.0: "seconds"}


def parse_duration(value: str, unit_s: float) -> float:
    """A duration string (``"200ms"``, ``"1.5s"``, ``"2m"``) in units of ``unit_s`` seconds."""
    m = _DURATION_RE.match(value)
    if m is None:
        raise ValueError(f"expected {_UNIT_NAMES[unit_s]} or a duration such as 250ms, 1.5s, 2m; got {value!r}")
    return round(float(m.group(1)) * _DURATION_UNITS[m.group(2)] / unit_s, 9)


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _coerce(f: dataclasses.Field[Any], current: Any, value: Any) -> Any:
    if f.metadata.get("size"):
        return parse_size(value)
    if f.metadata.get("headroom"):  # auto, a size or a percentage: kept as given, checked here
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected auto, a size or a percentage, got {value!r}")
        headroom_bytes(value, TiB)
        return str(value)
    # Durations: settings named *_us, *_ms and *_s also take "1s", "250ms", "2m", "100us".
    unit_s = next((scale for suffix, scale in (("_us", 1e-6), ("_ms", 0.001), ("_s", 1.0)) if f.name.endswith(suffix)),
                  None)
    if unit_s is not None and isinstance(value, str) and not _is_number(value):
        amount = parse_duration(value, unit_s)
        if isinstance(current, int) and not isinstance(current, bool):
            if amount != int(amount):
                raise ValueError(f"{value!r} is not a whole number of {_UNIT_NAMES[unit_s]}")
            amount = int(amount)
        value = amount
    if isinstance(current, bool):
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if not isinstance(value, bool):
            raise ValueError(f"expected true/false, got {value!r}")
        result: Any = value
    elif isinstance(current, int):
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"expected an integer, got {value!r}")
        try:
            result = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
    elif isinstance(current, float):
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise ValueError(f"expected a number, got {value!r}")
        try:
            result = float(value)
        except ValueError:
            raise ValueError(f"expected a number, got {value!r}") from None
        if result < 0:
            raise ValueError(f"must be >= 0, got {value!r}")
    else:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {value!r}")
        result = value
    choices = f.metadata.get("choices")
    if choices and result not in choices:
        raise ValueError(f"must be one of {list(choices)}, got {value!r}")
    return result


# -- command-line flags -------------------------------------------------------------


def iter_settings(obj: Any = None, prefix: str = "") -> list[tuple[str, dataclasses.Field[Any], Any]]:
    """Every leaf setting as (dotted name, field, default value)."""
    obj = Config() if obj is None else obj
    out: list[tuple[str, dataclasses.Field[Any], Any]] = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            out.extend(iter_settings(value, f"{prefix}{f.name}."))
        else:
            out.append((f"{prefix}{f.name}", f, value))
    return out


def _toml_value(f: dataclasses.Field[Any], value: Any) -> str:
    if f.metadata.get("size") and value:
        for unit, scale in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if value % scale == 0:
                return f'"{value // scale}{unit}"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return repr(value)


def defaults_toml() -> str:
    """Every setting with its default and what it means, as a TOML file (``kvpool-server
    --print-defaults``): what ``conf/default.toml`` shows in a checkout, for an installed
    package too. Loading it gives the defaults back."""
    lines = ["# kvpool settings and their defaults (kvpool-server --print-defaults). Every key is optional.",
             "# Sizes take bytes or \"512MiB\"/\"2GiB\"; settings ending in _ms/_s/_us take \"250ms\", \"1.5s\"."]
    section = None
    for dotted, f, default in iter_settings():
        table, _, leaf = dotted.rpartition(".")
        if table != section:
            lines += ["", f"[{table}]"]
            section = table
        doc = f.metadata.get("doc", "")
        choices = f.metadata.get("choices")
        lines.append(f"{leaf} = {_toml_value(f, default)}" + (f"  # {doc}" if doc else "")
                     + (f" (one of {', '.join(map(str, choices))})" if choices else ""))
    return "\n".join(lines) + "\n"


def add_setting_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--section.key VALUE`` flag per setting (values parsed like TOML values)."""
    group = parser.add_argument_group("settings (override the config file)")
    for dotted, f, default in iter_settings():
        shown = format_size(default) if f.metadata.get("size") else default
        group.add_argument(
            f"--{dotted}", dest=f"set:{dotted}", default=None, metavar="VALUE",
            help=f"{f.metadata.get('doc', '')} (default: {shown!r})".replace("%", "%%"),  # (argparse formats it)
        )


def apply_setting_flags(config: Config, args: argparse.Namespace) -> None:
    for name, value in vars(args).items():
        if name.startswith("set:") and value is not None:
            config.set(name[4:], value)
