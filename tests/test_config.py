from __future__ import annotations

from pathlib import Path

import pytest

from kvpool import errors
from kvpool.config import Config, parse_size

ROOT = Path(__file__).resolve().parents[1]


def test_default_toml_mirrors_the_dataclass_defaults() -> None:
    assert Config.load(ROOT / "conf" / "default.toml") == Config()


def test_every_file_under_conf_loads() -> None:
    for path in (ROOT / "conf").glob("*.toml"):
        Config.load(path)


def test_partial_file_overrides_and_keeps_defaults(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[tiers.dram]\ncapacity = "64MiB"\n[eviction]\npolicy = "s3fifo"\n')
    config = Config.load(path)
    assert config.tiers.dram.capacity == 64 << 20
    assert config.eviction.policy == "s3fifo"
    assert config.tiers.cxl.capacity == Config().tiers.cxl.capacity


@pytest.mark.parametrize("text, key", [
    ("[tiers.dram]\ncapcity = 1\n", "tiers.dram.capcity"),
    ("[nope]\nx = 1\n", "nope"),
    ('[tiers.dram]\ncapacity = "lots"\n', "tiers.dram.capacity"),
    ('[eviction]\npolicy = "random"\n', "eviction.policy"),
    ("[pool]\nchunk_tokens = \"x\"\n", "pool.chunk_tokens"),
    ("[tiers.dram]\nmlock = 3\n", "tiers.dram.mlock"),
])
def test_unknown_key_or_bad_value_names_key_and_file(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError) as info:
        Config.load(path)
    assert key in str(info.value) and str(path) in str(info.value)


def test_missing_file_and_invalid_toml_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError):
        Config.load(tmp_path / "absent.toml")
    (tmp_path / "x.toml").write_text("[[[")
    with pytest.raises(errors.ConfigError):
        Config.load(tmp_path / "x.toml")


def test_sizes() -> None:
    assert parse_size("1GiB") == 1 << 30
    assert parse_size("512 MiB") == 512 << 20
    assert parse_size("64KB") == 64_000
    assert parse_size(4096) == 4096
    for bad in ("1 parsec", -1, True, "GiB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_dotted_set_from_command_line() -> None:
    config = Config()
    config.set("tiers.nvme.capacity", "2GiB")
    assert config.tiers.nvme.capacity == 2 << 30
    with pytest.raises(errors.ConfigError, match="<command line>"):
        config.set("tiers.nvme.nope", "1")


def test_node_host_is_loopback_for_a_local_master_and_the_route_to_a_remote_one() -> None:
    from kvpool.config import node_host

    for master in ("tcp://127.0.0.1:7700", "tcp://localhost:7700", "tcp://*:7700", "ipc:///tmp/kvpool-master"):
        assert node_host(Config.load({"master": {"listen": master}})) == "127.0.0.1", master
    assert node_host(Config.load({"node": {"host": "10.9.9.9"}, "master": {"listen": "tcp://192.0.2.1:7700"}})) \
        == "10.9.9.9"  # an explicit node.host is kept
    try:
        routed = node_host(Config.load({}), "tcp://192.0.2.1:7700")  # TEST-NET-1: only a route is asked for
    except errors.ConfigError as exc:  # a machine with no route there at all
        assert "node.host" in str(exc)
    else:
        assert not routed.startswith("127.")


@pytest.mark.parametrize(("key", "value", "expected"), [
    ("master.heartbeat_ms", "1s", 1000), ("master.heartbeat_ms", "250ms", 250), ("master.heartbeat_ms", "1.5s", 1500),
    ("master.heartbeat_ms", 200, 200), ("master.heartbeat_ms", "200", 200),
    ("master.lease_s", "500ms", 0.5), ("master.lease_s", "2m", 120.0), ("node.pull_timeout_s", 3, 3.0),
    ("node.reply_poll_us", "100us", 100), ("node.reply_poll_us", "0.25ms", 250), ("node.reply_poll_us", 0, 0),
])
def test_durations_take_units(key: str, value: object, expected: float) -> None:
    config = Config()
    config.set(key, value)
    section, name = key.split(".")
    assert getattr(getattr(config, section), name) == expected


@pytest.mark.parametrize(("key", "value", "message"), [
    ("master.heartbeat_ms", "1 sec", "duration such as"),
    ("master.heartbeat_ms", "1.0005s", "whole number of milliseconds"),
    ("master.leader_ttl_s", "500ms", "whole number of seconds"),
    ("node.reply_poll_us", "0.5us", "whole number of microseconds"),
    ("node.reply_poll_us", "1s", "between 0 and 10000"),
    ("master.dead_after_missed", "three", "expected an integer"),
])
def test_bad_durations_and_numbers_say_what_is_expected(key: str, value: str, message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message) as caught:
        Config().set(key, value)
    assert key in str(caught.value)


def test_every_setting_in_default_toml_has_a_comment() -> None:
    section = None
    bare = []
    for line in (ROOT / "conf" / "default.toml").read_text().splitlines():
        if line.startswith("["):
            section = line.strip("[]")
        elif "=" in line and not line.lstrip().startswith("#") and "#" not in line.split("=", 1)[1]:
            bare.append(f"{section}.{line.split('=')[0].strip()}")
    assert bare == []
