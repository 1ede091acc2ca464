"""The cluster key: key file handling, CURVE on ZeroMQ sockets, pull tokens."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from kvpool import errors
from kvpool.cluster.wire.security import TOKEN_NBYTES, ClusterKey, keygen, load_or_create
from tests.conftest import communicate_all, free_tcp_port


def test_key_file_is_created_private_and_reused(tmp_path: Path) -> None:
    path = tmp_path / "conf" / "kvpool" / "cluster.key"
    secret = load_or_create(path)
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert load_or_create(path) == secret  # the next process reads the same key
    with pytest.raises(errors.ConfigError, match="already exists"):
        keygen(path)


@pytest.mark.slow
def test_processes_starting_together_on_a_fresh_host_agree_on_one_key(tmp_path: Path) -> None:
    # Each may be the first to need the key: none may read a half-written one or make its own.
    path = tmp_path / "fresh" / "cluster.key"
    code = ("import sys; from kvpool.cluster.wire.security import load_or_create; "
            "print(load_or_create(sys.argv[1]).hex())")
    for _ in range(3):
        procs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(8)]
        outs = communicate_all(procs, 60)
        assert all(p.returncode == 0 for p in procs), [err for _, err in outs]
        assert len({out.strip() for out, _ in outs}) == 1
        assert [p.name for p in path.parent.iterdir()] == ["cluster.key"]  # no temporary left behind
        path.unlink()


def test_a_key_file_others_can_read_is_refused(tmp_path: Path) -> None:
    path = keygen(tmp_path / "k")
    os.chmod(path, 0o644)
    with pytest.raises(errors.ConfigError, match="chmod 600"):
        load_or_create(path)
    path.write_text("not a key\n")
    os.chmod(path, 0o600)
    with pytest.raises(errors.ConfigError, match="kvpool keygen"):
        load_or_create(path)


def test_tokens_name_one_key_on_one_node_and_expire() -> None:
    key = ClusterKey(b"s" * 32, token_ttl_s=10.0)
    token = key.mint_token(b"prefix", "node-a", now=1000.0)
    assert len(token) == TOKEN_NBYTES
    key.check_token(token, b"prefix", "node-a", now=1005.0)
    for args in ((b"other", "node-a", 1005.0), (b"prefix", "node-b", 1005.0), (b"prefix", "node-a", 1011.0)):
        with pytest.raises(errors.AuthenticationError):
            key.check_token(token, args[0], args[1], now=args[2])
    with pytest.raises(errors.AuthenticationError):  # another cluster's key cannot mint one
        key.check_token(ClusterKey(b"t" * 32).mint_token(b"prefix", "node-a", now=1000.0), b"prefix", "node-a",
                        now=1005.0)
    forged = bytearray(token)
    forged[0] ^= 0xFF  # a later expiry with the same MAC
    with pytest.raises(errors.AuthenticationError):
        key.check_token(bytes(forged), b"prefix", "node-a", now=1005.0)
    ClusterKey(None).check_token(b"", b"prefix", "node-a")  # auth off: everything passes


def test_a_minter_mints_the_tokens_mint_token_does() -> None:
    """``minter`` (a locate's batch of tokens, the HMAC prepared once) mints exactly what
    ``mint_token`` mints at the same moment, each checked as such."""
    key = ClusterKey(b"s" * 32, token_ttl_s=10.0)
    mint = key.minter(now=1000.0)
    for prefix, node in ((b"prefix", "node-a"), (b"other", "node-a"), (b"prefix", "node-b"), (b"\0" * 16, "n")):
        token = mint(prefix, node)
        assert token == key.mint_token(prefix, node, now=1000.0)
        key.check_token(token, prefix, node, now=1005.0)
    with pytest.raises(errors.AuthenticationError):
        key.check_token(mint(b"prefix", "node-a"), b"prefix", "node-b", now=1005.0)
    assert ClusterKey(None).minter()(b"prefix", "node-a") == b""


def _roundtrip(server_key: ClusterKey, client_key: ClusterKey | None) -> bool:
    ctx = zmq.Context()
    try:
        server = ctx.socket(zmq.ROUTER)
        server.setsockopt(zmq.LINGER, 0)
        server_key.secure_server(server)
        port = server.bind_to_random_port("tcp://127.0.0.1")
        client = zmq.Context.instance().socket(zmq.DEALER)
        client.setsockopt(zmq.LINGER, 0)
        if client_key is not None:
            client_key.secure_client(client)
        client.connect(f"tcp://127.0.0.1:{port}")
        try:
            client.send(b"ping")
            if not server.poll(1500):
                return False
            ident, body = server.recv_multipart()
            server.send_multipart([ident, body])
            return bool(client.poll(1500)) and client.recv() == b"ping"
        finally:
            client.close(0)
            server.close(0)
    finally:
        from kvpool.cluster.wire.security import stop_authenticator

        stop_authenticator(ctx)
        ctx.destroy(linger=0)


@pytest.mark.slow
def test_curve_admits_only_holders_of_the_cluster_key() -> None:
    ours = ClusterKey(b"a" * 32)
    assert _roundtrip(ours, ClusterKey(b"a" * 32))
    assert not _roundtrip(ours, ClusterKey(b"b" * 32))  # another cluster's key
    assert not _roundtrip(ours, None)  # no key at all


def test_a_master_started_with_a_key_file_in_its_config_uses_that_file_not_the_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key comes from the settings the master was started with, passed down to every
    socket it opens; nothing falls back to the default key file (~/.config/kvpool)."""
    import queue
    import threading

    from kvpool.cluster.master.server import MasterServer, run_master
    from kvpool.cluster.wire.master_client import MasterClient
    from kvpool.config import Config, MasterSection

    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    default_file = home / ".config" / "kvpool" / "cluster.key"
    key_file = keygen(tmp_path / "keys" / "cluster.key")
    settings = tmp_path / "master.toml"
    listen = f"tcp://127.0.0.1:{free_tcp_port()}"
    settings.write_text(f'[master]\nlisten = "{listen}"\n\n[security]\nkey_file = "{key_file}"\n')
    config = Config.load(str(settings))
    stop = threading.Event()
    started: queue.Queue[str | BaseException] = queue.Queue()

    def serve() -> None:
        try:
            run_master(config, stop, on_ready=started.put)
        except BaseException as exc:  # handed to the test
            started.put(exc)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        endpoint = started.get(timeout=30)
        assert isinstance(endpoint, str), endpoint
        with MasterClient(endpoint, config=config, request_timeout_s=5) as holder:
            assert holder.cluster_key.source == str(key_file)
            assert holder.ping()["version"] >= 1
        stranger = ClusterKey(os.urandom(32))
        with MasterClient(endpoint, config=config, request_timeout_s=5, cluster_key=stranger) as other:
            with pytest.raises(errors.AuthenticationError):
                other.ping()
    finally:
        stop.set()
        thread.join(30)
    assert not thread.is_alive()
    assert not default_file.exists()
    # A section alone has no [security]: whoever starts from one passes the key down.
    with pytest.raises(TypeError):
        MasterServer(MasterSection(listen="tcp://127.0.0.1:*"))  # no cluster_key
    with pytest.raises(TypeError, match="cluster_key"):
        MasterClient("tcp://127.0.0.1:1", config=MasterSection())
    assert not default_file.exists()
