"""The cluster secret and what is derived from it: CURVE keys for ZeroMQ, pull tokens.

Owns the key file (``security.key_file``; default
``$XDG_CONFIG_HOME/kvpool/cluster.key``, i.e. ``~/.config/kvpool/cluster.key``),
created 0600 in a 0700 directory by the first kvpool process that needs it,
and the keys derived from it. It does not own sockets: the master, the node
control socket and their clients call :meth:`ClusterKey.secure_server` /
:meth:`ClusterKey.secure_client` on theirs.

Threat model (README "Security"): every process that holds the cluster key is
trusted; any other local user or network peer is not. The key never travels.

* **ZeroMQ** (master, node control): CURVE (libzmq's Curve25519 + XSalsa20-
  Poly1305) with key pairs derived from the secret by HMAC-SHA256. A server
  accepts only clients that prove the derived client key (ZAP through
  ``zmq.auth``); a client only talks to a server that proves the derived
  server key. A process with no key or another key cannot complete the
  handshake: its requests time out, which the client reports as
  :class:`~kvpool.errors.AuthenticationError`.
* **Pulls** (UCX and TCP): the master issues, with every located replica, a token
  ``expiry_ms (u64) ‖ HMAC-SHA256(token key, key ‖ node id ‖ expiry_ms)[:16]``;
  the holder checks it before it sends a byte. Tokens are short-lived
  (``security.token_ttl_s``) and name one key on one node.
* **Holders** (TCP pulls): a reader opens each connection with a fresh nonce and
  the holder answers ``HMAC-SHA256(holder key, nonce)[:16]`` before any reply, so
  whatever listens on a dead holder's port cannot hand out bytes.
* **Master queries** (:mod:`.query`): both ends of a query connection answer the
  other's nonce with ``HMAC-SHA256(query key, side ‖ nonce)[:16]`` before any request.

With ``security.auth = false`` (documented as unsafe) nothing is derived and
every check passes.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import stat
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvpool import errors

if TYPE_CHECKING:
    import zmq

    from kvpool.config import Config

log = logging.getLogger(__name__)

SECRET_NBYTES = 32
TOKEN_NBYTES = 24  # expiry u64 + 16 bytes of HMAC-SHA256
HOLDER_PROOF_NBYTES = 16  # of HMAC-SHA256 (ClusterKey.holder_proof)
_EXPIRY = struct.Struct("<Q")
_ZAP_DOMAIN = "kvpool"


def default_key_file() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "kvpool" / "cluster.key"


def keygen(path: str | os.PathLike[str], *, overwrite: bool = False) -> Path:
    """Write a new random cluster secret to ``path`` (mode 0600, parent 0700).

    The key is written to a private temporary file and then linked into place, so a process
    that finds ``path`` always finds a whole key (many processes start at once on a fresh
    host, and each may be the first to need it)."""
    path = Path(path).expanduser()
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not overwrite and os.path.lexists(path):
        raise errors.ConfigError(f"{path} already exists (remove it first to make a new cluster key)")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            os.fchmod(fh.fileno(), 0o600)
            fh.write(secrets.token_hex(SECRET_NBYTES) + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        if overwrite:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise errors.ConfigError(
                    f"{path} already exists (remove it first to make a new cluster key)") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def read_secret(path: Path) -> bytes:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise errors.ConfigError(f"security.key_file: cannot open {path}: {exc.strerror}") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fh.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise errors.ConfigError(f"security.key_file: {path} is not a regular file")
        if st.st_mode & 0o077:
            raise errors.ConfigError(
                f"security.key_file: {path} is readable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                f"chmod 600 {path}")
        try:
            raw = fh.read(4 * SECRET_NBYTES).strip()
        except OSError as exc:
            raise errors.ConfigError(f"security.key_file: cannot read {path}: {exc.strerror}") from None
    try:  # any bytes: only a line of hex digits is a key
        secret = bytes.fromhex(raw.decode("ascii"))
    except ValueError:  # UnicodeDecodeError too
        secret = b""
    if len(secret) < 16:
        raise errors.ConfigError(f"security.key_file: {path} does not hold a kvpool key "
                                 f"(make one with: kvpool keygen {path})")
    return secret


def load_or_create(path: str | os.PathLike[str] | None) -> bytes:
    """The secret in ``path`` (default :func:`default_key_file`), created there if absent."""
    path = Path(path).expanduser() if path else default_key_file()
    try:
        if not path.exists():
            try:
                keygen(path)
                log.info("created cluster key %s (copy it to every host of this cluster)", path)
            except errors.ConfigError:
                pass  # another process created it first: read theirs
    except OSError as exc:  # e.g. a directory on the way this user may not enter: one line, no traceback
        raise errors.ConfigError(f"security.key_file: cannot use {path}: {exc.strerror}") from None
    return read_secret(path)


class ClusterKey:
    """The secret, or nothing (``auth`` off): derives CURVE key pairs and pull tokens."""

    def __init__(self, secret: bytes | None, *, token_ttl_s: float = 30.0, source: str = "") -> None:
        self.secret = secret
        self.token_ttl_s = token_ttl_s
        #: where the secret came from (a key file path), for messages; never the secret
        self.source = source
        self._token_key = self._derive(b"pull-token") if secret else b""
        self._holder_key = self._derive(b"tcp-holder") if secret else b""
        self._query_key = self._derive(b"master-query") if secret else b""

    @classmethod
    def from_config(cls, config: Config) -> ClusterKey:
        section = config.security
        if not section.auth:
            return cls(None, token_ttl_s=section.token_ttl_s)
        return _cached(section.key_file, section.token_ttl_s)

    @property
    def enabled(self) -> bool:
        return self.secret is not None

    def describe(self) -> str:
        """Which key this is, for logs and errors (the key file, never the secret)."""
        if not self.enabled:
            return "no cluster key (security.auth = false: UNAUTHENTICATED)"
        return f"cluster key file {self.source}" if self.source else "an explicit cluster key"

    def _derive(self, label: bytes) -> bytes:
        assert self.secret is not None
        return hmac.new(self.secret, b"kvpool/v1/" + label, hashlib.sha256).digest()

    # -- ZeroMQ CURVE ------------------------------------------------------------------

    def _curve_pair(self, label: bytes) -> tuple[bytes, bytes]:
        import zmq
        from zmq.utils import z85

        secret_z85 = z85.encode(self._derive(label))
        return zmq.curve_public(secret_z85), secret_z85

    def secure_server(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before bind) a CURVE server that admits only holders of this key."""
        if not self.enabled:
            return
        public, secret = self._curve_pair(b"curve-server")
        _ensure_authenticator(sock.context, self._curve_pair(b"curve-client")[0])
        sock.zap_domain = _ZAP_DOMAIN.encode()
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True

    def secure_client(self, sock: zmq.Socket[Any]) -> None:
        """Make ``sock`` (before connect) a CURVE client of servers holding this key."""
        if not self.enabled:
            return
        public, secret = self._curve_pair(b"curve-client")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_serverkey = self._curve_pair(b"curve-server")[0]

    # -- pull tokens ------------------------------------------------------------------

    def mint_token(self, key: bytes, node_id: str, *, now: float | None = None) -> bytes:
        """A token that lets its bearer pull ``key`` from ``node_id`` for ``token_ttl_s``."""
        if not self.enabled:
            return b""
        expiry_ms = int(((time.time() if now is None else now) + self.token_ttl_s) * 1000)
        return _EXPIRY.pack(expiry_ms) + self._token_mac(key, node_id, expiry_ms)

    def minter(self, *, now: float | None = None) -> Callable[[bytes, str], bytes]:
        """``mint_token`` for many tokens minted at one moment (a ``locate`` of a batch): the
        same tokens, with the expiry and the key's HMAC state prepared once."""
        if not self.enabled:
            return lambda key, node_id: b""
        expiry_ms = int(((time.time() if now is None else now) + self.token_ttl_s) * 1000)
        expiry = _EXPIRY.pack(expiry_ms)
        base = hmac.new(self._token_key, expiry, "sha256")

        def mint(key: bytes, node_id: str) -> bytes:
            mac = base.copy()
            mac.update(len(key).to_bytes(2, "little") + bytes(key) + node_id.encode())
            return expiry + mac.digest()[:16]

        return mint

    def check_token(self, token: Any, key: bytes, node_id: str, *, now: float | None = None) -> None:
        """Raise AuthenticationError unless ``token`` was minted for ``key`` on ``node_id`` and is current."""
        if not self.enabled:
            return
        if not isinstance(token, (bytes, bytearray, memoryview)) or len(token) != TOKEN_NBYTES:
            raise errors.AuthenticationError("pull refused: no valid token")
        token = bytes(token)
        (expiry_ms,) = _EXPIRY.unpack_from(token, 0)
        if not hmac.compare_digest(token[_EXPIRY.size:], self._token_mac(key, node_id, expiry_ms)):
            raise errors.AuthenticationError("pull refused: token not issued for this key and node")
        if expiry_ms < (time.time() if now is None else now) * 1000:
            raise errors.AuthenticationError("pull refused: token expired")

    # -- holders proving themselves (TCP pulls) -----------------------------------------

    def holder_proof(self, nonce: bytes) -> bytes:
        """A pull server's answer to a reader's ``nonce``: proof that it holds the cluster key
        (16 zero bytes without one)."""
        return self._proof(self._holder_key, b"", nonce)

    def check_holder_proof(self, nonce: bytes, proof: bytes) -> bool:
        """Whether ``proof`` answers ``nonce`` as only a holder of this key can (always true
        without a key)."""
        return not self.enabled or hmac.compare_digest(bytes(proof), self.holder_proof(nonce))

    def reader_proof(self, nonce: bytes) -> bytes:
        """A reader's answer to a pull server's ``nonce``: proof that it holds the cluster key,
        so the server may skip its pulls' tokens (16 zero bytes without one). Labelled, so a
        holder's proof is never a reader's."""
        return self._proof(self._holder_key, b"reader", nonce)

    def check_reader_proof(self, nonce: bytes, proof: bytes) -> bool:
        """Whether ``proof`` answers ``nonce`` as only a holder of this key can (never true
        without a key: then tokens are checked, and they check nothing)."""
        return self.enabled and hmac.compare_digest(bytes(proof), self.reader_proof(nonce))

    # -- the master's query port ------------------------------------------------------

    def query_proof(self, side: bytes, nonce: bytes) -> bytes:
        """One end's answer to the other's nonce on a master query connection (``side``:
        ``b"server"`` or ``b"client"``, so neither answer can be replayed as the other)."""
        return self._proof(self._query_key, side, nonce)

    def check_query_proof(self, side: bytes, nonce: bytes, proof: bytes) -> bool:
        return not self.enabled or hmac.compare_digest(bytes(proof), self.query_proof(side, nonce))

    def _proof(self, key: bytes, label: bytes, nonce: bytes) -> bytes:
        """HMAC-SHA256 of ``label + nonce`` under a derived ``key``, cut to HOLDER_PROOF_NBYTES
        (zeros without a cluster key): every nonce answer of the TCP pull and query ports."""
        if not self.enabled:
            return bytes(HOLDER_PROOF_NBYTES)
        return hmac.digest(key, label + bytes(nonce), "sha256")[:HOLDER_PROOF_NBYTES]

    @staticmethod
    def token_expiry_s(token: bytes) -> float:
        """When ``token`` stops being accepted (epoch seconds); 0 for an empty token."""
        return _EXPIRY.unpack_from(token, 0)[0] / 1000.0 if len(token) == TOKEN_NBYTES else float("inf")

    def _token_mac(self, key: bytes, node_id: str, expiry_ms: int) -> bytes:
        message = _EXPIRY.pack(expiry_ms) + len(key).to_bytes(2, "little") + bytes(key) + node_id.encode()
        return hmac.digest(self._token_key, message, "sha256")[:16]


_CACHE: dict[tuple[str, float], ClusterKey] = {}
_CACHE_LOCK = threading.Lock()


def _cached(key_file: str, token_ttl_s: float) -> ClusterKey:
    with _CACHE_LOCK:
        found = _CACHE.get((key_file, token_ttl_s))
        if found is None:
            path = Path(key_file).expanduser() if key_file else default_key_file()
            found = _CACHE[(key_file, token_ttl_s)] = ClusterKey(load_or_create(path), token_ttl_s=token_ttl_s,
                                                                 source=str(path))
        return found


# -- ZAP: one authenticator per ZeroMQ context ----------------------------------------------

_AUTHENTICATORS: dict[int, Any] = {}
_AUTH_LOCK = threading.Lock()


class _AllowOneKey:
    """ZAP credentials provider: only the cluster's derived client key is admitted."""

    def __init__(self, client_public_z85: bytes) -> None:
        self.allowed = {client_public_z85}

    def callback(self, domain: str, key: bytes) -> bool:  # pyzmq passes the client key z85-encoded
        return bytes(key) in self.allowed


def _ensure_authenticator(context: zmq.Context[Any], client_public_z85: bytes) -> None:
    from zmq.auth.thread import ThreadAuthenticator

    with _AUTH_LOCK:
        auth = _AUTHENTICATORS.get(id(context))
        if auth is None or not auth.is_alive():
            auth = ThreadAuthenticator(context, log=logging.getLogger("kvpool.zap"))
            auth.start()
            _AUTHENTICATORS[id(context)] = auth
        provider = getattr(auth, "kvpool_provider", None)
        if provider is None:
            provider = _AllowOneKey(client_public_z85)
            setattr(auth, "kvpool_provider", provider)  # noqa: B010 (an attribute of ours on pyzmq's object)
            auth.configure_curve_callback(domain=_ZAP_DOMAIN, credentials_provider=provider)
        else:
            provider.allowed.add(client_public_z85)


def stop_authenticator(context: zmq.Context[Any]) -> None:
    """Stop the ZAP thread of ``context`` (before the context is terminated)."""
    with _AUTH_LOCK:
        auth = _AUTHENTICATORS.pop(id(context), None)
    if auth is not None:
        auth.stop()


# -- telling "refused our key" from "nobody answers" ------------------------------------------

_MONITOR_IDS = itertools.count()
_HANDSHAKE_FAILED = ("EVENT_HANDSHAKE_FAILED_NO_DETAIL", "EVENT_HANDSHAKE_FAILED_PROTOCOL",
                     "EVENT_HANDSHAKE_FAILED_AUTH")


class HandshakeWatch:
    """Watches the ZeroMQ handshakes of one client socket (a socket monitor).

    A server that holds another key, or that wants CURVE from a client without
    one (or the reverse), never completes the handshake; a request on it would
    just time out. What the client sees (libzmq 4.3): its connection closed
    right after connecting (``EVENT_HANDSHAKE_FAILED_NO_DETAIL``, EPIPE), again
    at every reconnect; or, when it reads the server's greeting first,
    ``EVENT_HANDSHAKE_FAILED_PROTOCOL`` with ZMTP_MECHANISM_MISMATCH (after
    which libzmq stops reconnecting); or a ZAP denial
    (``EVENT_HANDSHAKE_FAILED_AUTH``). A dead address produces no handshake
    event at all. :meth:`refused` tells the two apart. Reading the monitor costs nothing on the request path: callers
    look only while they wait for a first reply or after a timeout.
    """

    def __init__(self, sock: zmq.Socket[Any]) -> None:
        import zmq

        mask = zmq.EVENT_HANDSHAKE_SUCCEEDED
        for name in _HANDSHAKE_FAILED:
            mask |= getattr(zmq, name)
        self._failed_mask = mask & ~zmq.EVENT_HANDSHAKE_SUCCEEDED
        self._denied = zmq.EVENT_HANDSHAKE_FAILED_AUTH
        self._protocol = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        self._disconnected = zmq.EVENT_DISCONNECTED
        # Protocol errors that mean "not our key / not our mechanism" (not a garbled stream).
        self._auth_protocol_errors = {zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH,
                                      zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC,
                                      zmq.PROTOCOL_ERROR_ZMTP_KEY_EXCHANGE}
        # A name of its own: pyzmq's default names the socket's fd, which a socket opened right
        # after this one closes may reuse before the old monitor endpoint is gone (EADDRINUSE).
        address = f"inproc://kvpool-handshake-{os.getpid()}-{next(_MONITOR_IDS)}"
        self._sock = sock
        sock.monitor(address, mask | zmq.EVENT_DISCONNECTED)
        # Unbounded: libzmq sends events with a blocking send from the context's I/O thread,
        # so a monitor left unread with 1000 queued (an idle connection to a peer that keeps
        # refusing it) would stop every socket of the context.
        self.monitor: zmq.Socket[Any] = sock.context.socket(zmq.PAIR)
        self.monitor.setsockopt(zmq.RCVHWM, 0)
        self.monitor.connect(address)
        self.failures = 0       # handshakes failed since the last one that succeeded
        self.denied = False     # a decisive refusal: a ZAP denial or a mechanism/crypto mismatch
        self.sessions_lost = 0  # connections that dropped after their handshake succeeded
        self._in_session = False  # the last handshake succeeded, and its connection is up
        self._pending_events = (zmq.EVENTS, zmq.POLLIN)

    def update(self) -> None:
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        while True:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # zmq.Again (nothing more), or the monitor is closed
                return
            message = parse_monitor_message(frames)
            event = message["event"]
            if event == self._disconnected:
                self.sessions_lost += self._in_session
                self._in_session = False
            elif event & self._failed_mask:
                self.failures += 1
                self._in_session = False
                self.denied = self.denied or bool(event & self._denied) or bool(
                    event & self._protocol and int(message["value"]) in self._auth_protocol_errors)
            else:
                self.failures, self.denied, self._in_session = 0, False, True

    def lost(self) -> int:
        """:attr:`sessions_lost`, counting the events already reported (one ``getsockopt`` when
        there are none). A request sent while this was *n* can be answered only while it is
        still *n*: a reply cannot reach a connection made after the one that carried it."""
        option, readable = self._pending_events
        if int(self.monitor.getsockopt(option)) & readable:
            self.update()
        return self.sessions_lost

    def refused(self, *, settled: bool = False) -> bool:
        """True when the peer refuses our key: a decisive refusal, or failed handshakes and none
        succeeding since (two in a row while still waiting; one once the wait is over)."""
        self.update()
        return self.denied or self.failures >= (1 if settled else 2)

    def close(self) -> None:
        """Stop watching, then close the monitor; call before the watched socket closes. libzmq
        reports a closing socket's events (its connections' DISCONNECTED) with a blocking send
        to the monitor: with the monitor closed first, that send waits forever in the
        context's I/O thread, and every socket of the context stops (seen: a client refused
        once, then every later call to the master timed out)."""
        import zmq

        if not self._sock.closed:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
        self.monitor.close(0)


def refused_error(what: str, address: str, key: ClusterKey | None) -> errors.AuthenticationError:
    mine = key.describe() if key is not None else "no cluster key"
    return errors.AuthenticationError(
        f"{what} at {address} refused the connection: authentication failed (this process uses {mine}; "
        f"the server holds another cluster key, or security.auth differs)")


def recv_or_refused(sock: zmq.Socket[Any], watch: HandshakeWatch, timeout_s: float, what: str, address: str,
                    key: ClusterKey | None, check: Callable[[], None] | None = None,
                    lost: int | None = None) -> bytes | None:
    """The next message on ``sock`` within ``timeout_s``, None at the deadline; raises
    AuthenticationError as soon as the peer is seen refusing our key (also at the deadline).
    ``check()`` runs every 100 ms of waiting and may raise to give up early. ``lost``: the
    watch's :meth:`~HandshakeWatch.lost` when the request was sent; None is returned as soon as
    it moves (the connection that carried the request dropped: no reply can come)."""
    import zmq

    deadline = time.monotonic() + timeout_s
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(watch.monitor, zmq.POLLIN)
    while True:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0:
            if watch.refused(settled=True):
                raise refused_error(what, address, key)
            return None
        ready = dict(poller.poll(min(remaining_ms, 100)))
        if sock in ready:
            return sock.recv(zmq.NOBLOCK)
        if watch.refused():
            raise refused_error(what, address, key)
        if lost is not None and watch.sessions_lost != lost:
            return None
        if check is not None:
            check()
