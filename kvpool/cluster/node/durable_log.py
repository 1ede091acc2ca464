"""``durable.log``: the keys a storage node holds as durable copies, one line each.

A line is ``<key hex> <replicas>\\n``, appended by the node's control thread when it stores a
durable copy (:meth:`kvpool.cluster.node.server.Node._replicate`) and read back at every
registration (start, and after a master restart or failover), so the master learns those
copies are durable again. Owns only the file's format: which keys are durable is the master's.
Lines of copies that are gone (deleted, overwritten) are dropped by :func:`compact`, which the
node runs at start and whenever the file has grown well past what it holds.

Any bytes may be found there (a torn last line after a crash, a disk that returns garbage, a
hand edit): a line that is not exactly a bounded hex key and a replica count in range is
skipped and counted, never an exception. A file that cannot be read at all counts as empty.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
from pathlib import Path

from kvpool import errors

log = logging.getLogger("kvpool.node")

FILE_NAME = "durable.log"
#: the most replicas a line may name (a put asking more is refused long before)
MAX_REPLICAS = 1 << 16
# A line longer than this is garbage (a key is at most pool.max_key_bytes, bounded by 64 KiB).
_MAX_LINE_BYTES = 2 * (64 << 10) + 32


def parse_line(line: bytes, max_key_bytes: int) -> tuple[bytes, int] | None:
    """(key, replicas) from one line (its newline stripped or not), or None if it is not one."""
    line = line.rstrip(b"\n")
    key_hex, space, count = line.partition(b" ")
    if not space or not 0 < len(key_hex) <= 2 * max_key_bytes or not 0 < len(count) <= 6:
        return None
    if not (key_hex.isascii() and count.isascii() and count.isdigit()):
        return None
    try:
        key = bytes.fromhex(key_hex.decode("ascii"))
    except ValueError:
        return None
    replicas = int(count)
    if len(key_hex) != 2 * len(key) or not 1 <= replicas <= MAX_REPLICAS:  # fromhex skips spaces
        return None
    return key, replicas


def read(directory: str | os.PathLike[str], max_key_bytes: int) -> dict[bytes, int]:
    """Every well-formed line of ``directory``/durable.log as key -> replicas (a later line of a
    key wins). Malformed lines are skipped with one warning that counts them; a missing file is
    empty, an unreadable one is empty with a warning."""
    path = Path(directory) / FILE_NAME
    found: dict[bytes, int] = {}
    skipped = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return found
    except OSError as exc:
        log.warning("cannot read %s (%s): its durable copies register as plain replicas", path, exc.strerror)
        return found
    try:
        with open(fd, "rb") as fh:
            while line := fh.readline(_MAX_LINE_BYTES):
                if len(line) == _MAX_LINE_BYTES and not line.endswith(b"\n"):  # overlong: skip all of it
                    while (rest := fh.readline(_MAX_LINE_BYTES)) and not rest.endswith(b"\n"):
                        pass
                    skipped += 1
                    continue
                parsed = parse_line(line, max_key_bytes)
                if parsed is None:
                    skipped += 1
                    continue
                found[parsed[0]] = parsed[1]
    except OSError as exc:  # EISDIR, EIO: what was read so far stands
        log.warning("reading %s failed (%s): %d durable keys read before it", path, exc.strerror, len(found))
    if skipped > 0:
        log.warning("%s: skipped %d malformed line(s) (a torn last line after a crash, or corruption); "
                    "%d durable keys read", path, skipped, len(found))
    return found


def append(directory: str | os.PathLike[str], key: bytes, replicas: int) -> None:
    """Add one line (only the node's control thread appends; a torn last line is skipped when
    read). DiskFullError when the filesystem is full, TierError for another failure."""
    path = Path(directory) / FILE_NAME
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "ab") as fh:
            fh.write(b"%s %d\n" % (key.hex().encode(), replicas))
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise errors.DiskFullError(exc.errno, f"cannot record a durable copy in {path}: {exc.strerror}") from None
        raise errors.TierError(f"cannot record a durable copy in {path}: {exc}") from None


def compact(directory: str | os.PathLike[str], held: dict[bytes, int]) -> None:
    """Rewrite ``directory``/durable.log to the lines of ``held`` only (key -> replicas), through a
    new file renamed over the old one, so a crash leaves one or the other whole. DiskFullError /
    TierError as :func:`append`; the old file then stays as it was."""
    path = Path(directory) / FILE_NAME
    new = path.with_name(FILE_NAME + ".new")
    try:
        fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as fh:
            fh.write(b"".join(b"%s %d\n" % (key.hex().encode(), replicas) for key, replicas in held.items()))
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(new, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            new.unlink()
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise errors.DiskFullError(exc.errno, f"cannot rewrite {path}: {exc.strerror}") from None
        raise errors.TierError(f"cannot rewrite {path}: {exc}") from None
