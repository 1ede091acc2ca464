"""``kvpool``: the operators' command line against a running cluster.

``kvpool stats`` (nodes, tiers, usage, hits/misses per tier, bytes moved),
``kvpool gc`` (remove shared-memory arenas left by killed processes; no master needed),
``kvpool ls`` (keys and where their replicas are), ``kvpool get KEY`` (read an
object or some layers, verified, into a ``.npy`` file) and ``kvpool rm KEY``;
``kvpool keygen FILE`` writes a new cluster key (mode 0600).
Keys are given in hex (prefix hashes are binary) or, with ``--text``, as UTF-8.
This process joins nothing: it asks the master, and reads bytes as a plain
puller without tiers of its own. It authenticates with the cluster key
(``--key-file``, else the config's ``security.key_file``, else the default key
file); a refused key is one line on stderr and exit status 3.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpool import errors
from kvpool.cli.args import Parser
from kvpool.cluster.node.server import NodeAddress
from kvpool.cluster.wire.control import control_call
from kvpool.cluster.wire.master_client import MasterClient
from kvpool.config import Config, format_size, master_address, node_host


def _key(text: str, as_text: bool) -> bytes:
    if as_text:
        return text.encode()
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise SystemExit(f"kvpool: {text!r} is not hex (use --text for a UTF-8 key)") from None


def _show_key(key: bytes) -> str:
    try:
        text = key.decode()
        if text.isprintable():
            return repr(text)
    except UnicodeDecodeError:
        pass
    return key.hex()


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _stats_when_ready(master: MasterClient, wait_s: float) -> dict[str, Any]:
    """The master's stats; with ``wait_s`` > 0, asked again until a master answers and
    lists a live node, or ``wait_s`` has passed (then the last answer, or its error)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            stats = master.stats()
            if any(node["alive"] for node in stats["nodes"].values()) or time.monotonic() >= deadline:
                return stats
        except (errors.MasterUnreachableError, errors.NotLeaderError, errors.CoordinatorError):
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.2)


def cmd_stats(master: MasterClient, args: argparse.Namespace) -> int:
    stats = _stats_when_ready(master, args.wait)
    ha = stats.get("ha")
    role = f" (leader, term {ha['term']}, etcd {ha['etcd']})" if isinstance(ha, dict) else ""
    print(f"master {master.address}{role}: up {stats['uptime_s']:.0f} s, {stats['keys']} keys, "
          f"{stats['replicas']} replicas, {stats['leases']} leases, {stats['reservations']} reservations")
    if isinstance(ha, dict):
        from kvpool.cluster.wire.etcd import masters

        try:
            _leader, announced = masters(str(ha["etcd"]), str(ha.get("prefix", "/kvpool")))
            standbys = [m for m in announced if m != ha.get("endpoint")]
            print(f"standby masters: {', '.join(standbys) if standbys else 'none'}")
        except errors.KVPoolError as exc:
            print(f"standby masters: unknown ({exc})")
    rows, tier_rows = [], []
    for node_id, node in sorted(stats["nodes"].items()):
        address = NodeAddress.decode(node["address"])
        detail: dict[str, Any] = {}
        if node["alive"]:
            try:
                detail = control_call(address.control, "stats", {}, timeout_s=args.timeout,
                                      cluster_key=master.cluster_key)
            except errors.KVPoolError as exc:
                detail = {"error": str(exc)}
        transfer = detail.get("transfer", {})
        counters = detail.get("counters", {})
        moves = "/".join(str(counters.get(c, 0)) for c in ("demotions", "promotions", "evictions"))
        state = node.get("state") or ("alive" if node["alive"] else "dead")
        peer = address.peer  # where it serves pulls: UCX listener port (0: none), plain TCP port
        serves = f"{peer.host}:{peer.port}" + (f" tcp {peer.tcp_port}" if peer.tcp_port else "")
        rows.append([node_id[:12], state, serves,
                     node["objects"], counters.get("miss_absent", "-"), moves,
                     format_size(transfer.get("bytes_sent", 0)), transfer.get("requests_served", "-"),
                     f"{node['last_seen_s']:.1f} s"])
        for tier in detail.get("tiers", []):
            tier_rows.append([node_id[:12], tier["tier"], format_size(tier["capacity_bytes"]),
                              format_size(tier["used_bytes"]), tier["objects"], tier["hits"],
                              "emulated" if tier.get("emulated") else ""])
    print()
    print(_table(["node", "state", "serves", "objects", "local misses", "demote/promote/evict",
                  "bytes served", "pulls served", "last beat"], rows))
    if tier_rows:
        print()
        print(_table(["node", "tier", "capacity", "used", "objects", "hits", "notes"], tier_rows))
    counters = stats["counters"]
    print()
    print("master counters: " + ", ".join(f"{k}={v}" for k, v in sorted(counters.items()) if v))
    return 0


def cmd_ls(master: MasterClient, args: argparse.Namespace) -> int:
    prefix = _key(args.prefix, args.text) if args.prefix else b""
    keys, truncated = master.list_keys(prefix, args.limit)
    rows = []
    for item in keys:
        dtype, layers, tokens, heads, dim = item["spec"] or ["?"] * 5
        replicas = ", ".join(f"{r['node_id'][:8]}/{r['tier']}" for r in item["replicas"])
        rows.append([_show_key(item["key"]), format_size(item["nbytes"]),
                     f"{dtype}[{layers},2,{tokens},{heads},{dim}]", replicas])
    print(_table(["key", "size", "shape", "replicas (node/tier)"], rows))
    if truncated:
        print(f"... more than {args.limit} keys; use --limit or --prefix")
    return 0


def layer_arg(text: str) -> int | slice:
    """``--layers``: ``5`` -> layer 5; ``2:6``, ``2:``, ``:6`` -> a half-open slice."""
    def number(part: str) -> int | None:
        if part.strip() == "":
            return None
        if not part.strip().isdigit():
            raise argparse.ArgumentTypeError(f"{text!r}: layers are N, A:B, A: or :B with whole numbers >= 0")
        return int(part)

    if ":" not in text:
        layer = number(text)
        if layer is None:
            raise argparse.ArgumentTypeError("empty layer spec")
        return layer
    start, _, stop = text.partition(":")
    first, last = number(start), number(stop)
    if first is not None and last is not None and last <= first:
        raise argparse.ArgumentTypeError(f"{text!r}: an empty range (B must be greater than A)")
    return slice(first, last)


#: exit status of ``kvpool get`` on a miss and ``kvpool rm`` of a key that is not there
MISS_EXIT = 1

_MISS_REASONS = {
    "evicted": "evicted", "stale": "replaced meanwhile", "checksum": "checksum mismatch", "timeout": "timed out",
    "holder_gone": "holder gone", "unauthorized": "refused by the holder", "malformed": "malformed answer",
}


def _why_missed(replicas: int, counters: dict[str, int]) -> str:
    """A miss in words: not cached anywhere, or which replicas failed how."""
    if replicas == 0:
        return "not cached anywhere in the pool"
    failures = [f"{n} {_MISS_REASONS.get(reason, reason.replace('_', ' '))}"
                for name, n in sorted(counters.items()) if n and name.startswith("miss_")
                and (reason := name.removeprefix("miss_")) != "absent"]
    found = f"{replicas} replica{'s' if replicas != 1 else ''} found, none readable"
    return f"{found}: {', '.join(failures)}" if failures else found


def cmd_get(master: MasterClient, args: argparse.Namespace) -> int:
    from kvpool.cluster.node.located import checked_replicas, replicas_at
    from kvpool.cluster.node.reader import ReplicaReader
    from kvpool.objformat import out_view
    from kvpool.transport import local_host_id
    from tiers.cxl.arena import shared_dirs_of

    key = _key(args.key, args.text)
    layers = args.layers
    config = Config.load(args.config)
    located = master.locate(key, lease=True)
    # What the master says is checked before use: only arenas in the shared-memory dirs are mapped.
    # Objects up to node.tcp_pull_max come over the holder's TCP port (both ends prove the cluster
    # key); UCX (and its import) only for larger ones or holders without a TCP port.
    reader = ReplicaReader(local_host_id(), transport=args.transport, pull_timeout_s=args.timeout,
                           allowed_dirs=shared_dirs_of(config), host=node_host(config, master.address),
                           tcp_pull_max=config.node.tcp_pull_max, cluster_key=master.cluster_key)
    replicas = replicas_at(located, 0)
    try:
        arr = reader.read(key, checked_replicas(replicas, reader.counters), layers, None, out_view)
    finally:
        master.release(located.lease_ids)
        reader.close()
    if arr is None:
        found = len(replicas) if isinstance(replicas, list) else 0
        print(f"kvpool: {_show_key(key)}: miss ({_why_missed(found, reader.counters)})", file=sys.stderr)
        return MISS_EXIT
    np.save(args.out, arr)
    print(f"{_show_key(key)}: {arr.dtype}{list(arr.shape)} ({format_size(arr.nbytes)}) -> {args.out}")
    return 0


def cmd_rm(master: MasterClient, args: argparse.Namespace) -> int:
    keys = [_key(k, args.text) for k in args.keys]
    status = 0
    for key, deleted in zip(keys, master.delete(keys)):
        if deleted:
            print(f"deleted {_show_key(key)}")
        else:
            print(f"kvpool: {_show_key(key)}: no such key", file=sys.stderr)
            status = MISS_EXIT
    return status


def cmd_gc(args: argparse.Namespace) -> int:
    """Remove the cxl arenas (and their indexes) of dead owners on this host."""
    from tiers.cxl import SHM_DIR, collect_stale_arenas
    from tiers.cxl.arena import user_shm_dir

    directories = {Path(d) for d in args.dir} or {SHM_DIR, user_shm_dir()}  # older builds' arenas, this user's
    if args.config:
        configured = Config.load(args.config).tiers.cxl.path
        if configured:
            directories.add(Path(configured).expanduser().parent)
    removed = [path for directory in sorted(directories) for path in collect_stale_arenas(directory)]
    for path in removed:
        print(f"removed {path}")
    print(f"{len(removed)} stale arena(s) removed")
    return 0


def cmd_keygen(args: argparse.Namespace) -> int:
    """Write a new cluster key (0600); an existing file is kept unless ``--force``."""
    from kvpool.cluster.wire.security import keygen

    path = Path(args.file).expanduser()
    if path.exists() and not args.force:
        print(f"kvpool: {path} already exists; not overwritten (use --force to replace it: every "
              f"process of the cluster then needs the new key)", file=sys.stderr)
        return 1
    try:
        keygen(path, overwrite=args.force)
    except (errors.ConfigError, OSError) as exc:
        print(f"kvpool: keygen {path}: {exc}", file=sys.stderr)
        return 1
    print(f"wrote a new cluster key to {path} (mode 0600); copy it to every host of the cluster")
    return 0


def build_parser() -> argparse.ArgumentParser:
    # The connection options go before or after the command (kvpool --master X stats, kvpool stats --master X).
    common = Parser(add_help=False)
    common.add_argument("--master", default=argparse.SUPPRESS,
                        help=f"master address (default: {Config().master.listen} or --config)")
    common.add_argument("--etcd", metavar="URLS", default=argparse.SUPPRESS,
                        help="talk to the master leader found in etcd at URLS (master.etcd) instead of --master")
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS,
                        help="TOML file to take master.listen and security from")
    common.add_argument("--timeout", type=float, default=argparse.SUPPRESS, help="seconds per request (default 5)")
    common.add_argument("--key-file", metavar="FILE", default=argparse.SUPPRESS,
                        help="cluster key (default: security.key_file of --config, else ~/.config/kvpool/cluster.key)")
    parser = Parser(prog="kvpool", description="Inspect and operate a running kvpool cluster.",
                                     parents=[common])
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                help="stats | ls | get | rm | gc | keygen (each has --help)")
    stats = sub.add_parser("stats", help="nodes, tiers, usage, hits, bytes served", parents=[common])
    stats.add_argument("--wait", type=float, default=0.0, metavar="S",
                       help="ask again until a master answers with a live node, for up to S seconds "
                            "(a server just started; default 0: ask once)")
    ls = sub.add_parser("ls", help="list keys and their replicas", parents=[common])
    ls.add_argument("--prefix", default="", help="only keys starting with this (hex, or text with --text)")
    ls.add_argument("--limit", type=int, default=100, help="list at most this many keys (default 100)")
    ls.add_argument("--text", action="store_true", help="prefix is UTF-8 text, not hex")
    get = sub.add_parser("get", help="read an object (or --layers a:b) into a .npy file", parents=[common],
                         epilog=f"exit status: 0 read, {MISS_EXIT} a miss (one line says why), 2 bad command line "
                                "or master unreachable, 3 authentication refused")
    get.add_argument("key", help="the key (prefix hash) in hex, or text with --text")
    get.add_argument("--layers", type=layer_arg, metavar="SPEC",
                     help="layers to read: N (one layer), A:B (half-open), A: (to the last), :B (from the first)")
    get.add_argument("--out", default="kv.npy", help="numpy file to write (default kv.npy)")
    get.add_argument("--transport", default="auto", choices=("auto", "tcp"),
                     help="auto: shared memory for same-host holders, else TCP (default); tcp: always UCX TCP")
    get.add_argument("--text", action="store_true", help="the key is UTF-8 text, not hex")
    rm = sub.add_parser("rm", help="delete keys everywhere", parents=[common])
    rm.add_argument("keys", nargs="+", help="keys in hex, or text with --text")
    rm.add_argument("--text", action="store_true", help="keys are UTF-8 text, not hex")
    gc = sub.add_parser("gc", help="remove shared-memory arenas of killed kvpool processes on this host")
    gc.add_argument("--dir", action="append", default=[],
                    help="directory to sweep (default /dev/shm and /dev/shm/kvpool-<uid>; repeatable)")
    keygen = sub.add_parser("keygen", help="write a new cluster key to FILE (mode 0600)")
    keygen.add_argument("file", metavar="FILE", help="where to write the key (copy it to every host of the pool)")
    keygen.add_argument("--force", action="store_true", help="overwrite an existing FILE")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for name, default in (("master", None), ("config", None), ("timeout", 5.0), ("key_file", None), ("etcd", None)):
        if not hasattr(args, name):  # given neither before nor after the command
            setattr(args, name, default)
    if args.command == "gc":
        return cmd_gc(args)
    if args.command == "keygen":
        return cmd_keygen(args)
    commands = {"stats": cmd_stats, "ls": cmd_ls, "get": cmd_get, "rm": cmd_rm}
    try:
        config = Config.load(args.config)
        if args.key_file:
            config.set("security.key_file", args.key_file)
        if args.etcd:
            config.set("master.etcd", args.etcd)
        address = master_address(config, args.master)
        master = MasterClient(address, config=config, request_timeout_s=args.timeout)
    except errors.ConfigError as exc:
        print(f"kvpool: {exc}", file=sys.stderr)
        return 2
    with master:
        try:
            return commands[args.command](master, args)
        except BrokenPipeError:  # `kvpool ls | head`: the reader is gone, which is not an error
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 0
        except errors.AuthenticationError as exc:
            print(f"kvpool: {exc}", file=sys.stderr)
            return 3
        except errors.NotLeaderError as exc:
            print(f"kvpool: {exc} (--etcd URLS follows the leader)", file=sys.stderr)
            return 2
        except errors.MasterUnreachableError as exc:
            print(f"kvpool: master {address or master.address} unreachable: {exc}", file=sys.stderr)
            return 2
        except errors.KVPoolError as exc:
            print(f"kvpool: {exc}", file=sys.stderr)
            return 1


if __name__ == "__main__":
    sys.exit(main())
