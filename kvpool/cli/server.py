"""``kvpool-server``: the standalone daemon.

Owns process concerns only: command line, logging, signals, and starting the
roles (``master``, ``node``, or ``all`` = both in one process, the default: a
one-machine pool). Every setting of :mod:`kvpool.config` is also a flag
(``--tiers.dram.capacity 2GiB``). SIGTERM and SIGINT shut down cleanly: the
node stops serving, its tiers are closed (the nvme index flushed), the master
stops last.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from kvpool.cli.args import Parser
from kvpool.config import Config, add_setting_flags, apply_setting_flags

log = logging.getLogger("kvpool.server")

DEMO_ETCD = "http://127.0.0.1:2379"


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="kvpool-server",
        description="Run a kvpool master, storage node, or both (a one-machine pool).",
    )
    parser.add_argument("--role", choices=("all", "master", "node"), default="all",
                        help="master: metadata only; node: tiers + pull server; all: both (default)")
    parser.add_argument("--config", metavar="FILE",
                        help="TOML file of settings (kvpool-server --print-defaults prints every key with its "
                             "default); flags override it")
    parser.add_argument("--print-defaults", action="store_true",
                        help="print every setting with its default and meaning as TOML, and exit")
    parser.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                        help="least severe log records printed (default INFO)")
    parser.add_argument("--with-etcd", action="store_true",
                        help="demo of the HA master: start a single-member etcd at master.etcd (default "
                             f"{DEMO_ETCD}; data in the pool's data_dir) unless one answers there, and elect "
                             "the master leader in it (needs the etcd binary; Debian: etcd-server)")
    add_setting_flags(parser)
    return parser


def load_config(args: argparse.Namespace) -> Config:
    config = Config.load(args.config)
    apply_setting_flags(config, args)
    return config


def run(config: Config, role: str, stop: threading.Event) -> int:
    """Run ``role`` until ``stop`` is set. Returns the process exit status."""
    from kvpool.cli.serve import serve  # imported late: --help must not start UCX

    return serve(config, role, stop)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.print_defaults:
        from kvpool.config import defaults_toml

        sys.stdout.write(defaults_toml())
        return 0
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args)
    except Exception as exc:  # a bad config is the operator's to fix: say what, no traceback
        print(f"kvpool-server: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        log.info("received %s: shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    etcd = None
    if args.with_etcd:
        from kvpool.cluster.wire.etcd import start_demo_etcd
        from kvpool.errors import ConfigError

        if not config.master.etcd:
            config.set("master.etcd", DEMO_ETCD, origin="--with-etcd")
        try:
            etcd = start_demo_etcd(config.master.etcd.split(",")[0], f"{config.pool.resolved_data_dir()}/etcd")
        except ConfigError as exc:
            print(f"kvpool-server: {exc}", file=sys.stderr)
            return 2
    try:
        return run(config, args.role, stop)
    finally:
        if etcd is not None:
            etcd.terminate()
            etcd.wait(10)


if __name__ == "__main__":
    sys.exit(main())
