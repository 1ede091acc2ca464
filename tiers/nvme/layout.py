"""The nvme tier's on-disk layout: alignment, segment and index names, the record prefix
that precedes every object in a segment."""

from __future__ import annotations

import errno
import logging
import re
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import xxhash

from kvpool import errors
from kvpool.config import MiB

if TYPE_CHECKING:
    pass


log = logging.getLogger("tiers.nvme")

#: Extent and I/O alignment: O_DIRECT needs the logical block size (512 or 4096).
ALIGN = 4096
#: Bytes of record prefix in front of every object (one aligned block).
PREFIX_NBYTES = ALIGN
# Opening: record prefixes closer than PREFIX_GAP_BYTES are read together, up to a window.
PREFIX_WINDOW_BYTES = 8 << 20
PREFIX_GAP_BYTES = 64 << 10
LAYOUT_VERSION = 2  # 2: every object is preceded by a record prefix
SEGMENT_NAME = "seg-{:05d}.kvs"
SEGMENT_RE = re.compile(r"seg-(\d{5})\.kvs")
INDEX_DIR = "index"
INDEX_ASIDE = "index.corrupt"
LOCK_NAME = "LOCK"

RECORD_MAGIC = b"KVPLREC1"
_RECORD_VERSION = 1
LIVE, TOMBSTONE = 1, 2
# magic | version | state | key_len | nbytes | generation | header_xxh3 | prefix_xxh3, then the key
_PREFIX = struct.Struct("<8sHHIQQQQ")
_PREFIX_SUM_OFFSET = 40
MAX_KEY_NBYTES = PREFIX_NBYTES - _PREFIX.size
MAGIC_U64 = int.from_bytes(RECORD_MAGIC, "little")

DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})
# Read errors that mean "these stored bytes cannot be had": a miss, like rot.
UNREADABLE_ERRNOS = frozenset(
    e for e in (errno.EIO, errno.ENXIO, errno.ENODATA, errno.EBADMSG, getattr(errno, "EUCLEAN", None),
                getattr(errno, "ESTALE", None)) if e is not None
)
# statfs f_type of filesystems that keep file data in memory: there is no page
# cache to bypass, so O_DIRECT buys nothing and only adds alignment rules.
MEMORY_FILESYSTEMS = {0x01021994: "tmpfs", 0x858458F6: "ramfs"}
# Staging buffers grow in these steps and are kept per thread unless larger than
# the limit (a one-off huge object should not pin that much memory forever).
STAGING_GRAIN_BYTES = 1 * MiB
STAGING_KEEP_BYTES = 256 * MiB
# When the disk fills, this much of the free space is left to the LMDB index
# (on the same filesystem): records are ~100 B + 8 B per layer, copy-on-write.
INDEX_RESERVE_BYTES = 1 * MiB
SCAN_WINDOW_BYTES = 8 * MiB


class Prefix(NamedTuple):
    state: int
    key: bytes
    nbytes: int
    generation: int
    header_sum: int


def pack_prefix(state: int, key: bytes, nbytes: int, generation: int, header_sum: int) -> bytes:
    """One prefix block (``PREFIX_NBYTES``) for a live record or a tombstone."""
    if len(key) > MAX_KEY_NBYTES:
        raise errors.InvalidKeyError(f"nvme: keys must be at most {MAX_KEY_NBYTES} bytes, got {len(key)}")
    block = bytearray(PREFIX_NBYTES)
    _PREFIX.pack_into(block, 0, RECORD_MAGIC, _RECORD_VERSION, state, len(key), nbytes, generation, header_sum, 0)
    block[_PREFIX.size:_PREFIX.size + len(key)] = key
    struct.pack_into("<Q", block, _PREFIX_SUM_OFFSET, xxhash.xxh3_64_intdigest(bytes(block[:_PREFIX.size + len(key)])))
    return bytes(block)


def parse_prefix(block: Any) -> Prefix | None:
    """The record a prefix block describes, or None if it is not an intact prefix."""
    mv = memoryview(block).cast("B")
    if len(mv) < _PREFIX.size:
        return None
    magic, version, state, key_len, nbytes, generation, header_sum, prefix_sum = _PREFIX.unpack_from(mv, 0)
    if magic != RECORD_MAGIC or version != _RECORD_VERSION or state not in (LIVE, TOMBSTONE):
        return None
    if not 0 < key_len <= MAX_KEY_NBYTES or len(mv) < _PREFIX.size + key_len:
        return None
    covered = bytearray(mv[:_PREFIX.size + key_len])
    struct.pack_into("<Q", covered, _PREFIX_SUM_OFFSET, 0)
    if xxhash.xxh3_64_intdigest(bytes(covered)) != prefix_sum:
        return None
    return Prefix(state, bytes(mv[_PREFIX.size:_PREFIX.size + key_len]), nbytes, generation, header_sum)


