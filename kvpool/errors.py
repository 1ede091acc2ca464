"""Every exception a kvpool user can catch.

One hierarchy under :class:`KVPoolError`. A cache miss is never an exception
(``get`` returns ``None``); these are raised for bad input, corruption,
exhausted capacity and failures of the pool's own machinery.
"""

from __future__ import annotations


class KVPoolError(Exception):
    """Base class of every kvpool error."""


# -- configuration ----------------------------------------------------------


class ConfigError(KVPoolError, ValueError):
    """A configuration file or value is invalid; the message names key and file."""


# -- bad input ----------------------------------------------------------------


class InvalidKVError(KVPoolError, ValueError):
    """A KV tensor has the wrong rank, shape, dtype or memory layout."""


class ShapeError(InvalidKVError):
    """Wrong rank or shape (expected ``[layers, 2, tokens, kv_heads, head_dim]``)."""


class DTypeError(InvalidKVError):
    """A dtype kvpool does not store, or one that disagrees with the object."""


class InvalidKeyError(KVPoolError, ValueError):
    """A key (prefix hash) that is not bytes/str or has an unusable length."""


class LayerRangeError(KVPoolError, IndexError):
    """A requested layer range lies outside the object's layers."""


class OutBufferError(KVPoolError, ValueError):
    """An ``out=`` buffer has the wrong size, dtype, or is not writable/contiguous."""


class OutDTypeError(OutBufferError, DTypeError):
    """An ``out=`` array of another dtype than the object's: both an OutBufferError (a bad
    ``out=``) and a DTypeError (a dtype that disagrees with the object)."""


class KeyNotFoundError(KVPoolError, KeyError):
    """``delete`` (or another operation that needs the key) named an absent key."""


# -- capacity -----------------------------------------------------------------


class CapacityError(KVPoolError):
    """There is no room for an object."""


class ObjectTooLargeError(CapacityError):
    """The object is larger than every tier that accepts puts."""


class PoolFullError(CapacityError):
    """Every tier is full of objects that cannot be evicted right now (pinned by readers)."""


class DiskFullError(CapacityError, OSError):
    """The filesystem under the nvme tier ran out of space."""


# -- stored bytes ---------------------------------------------------------------


class FormatError(KVPoolError):
    """Stored or received bytes are not a valid kvpool object."""


class BadMagicError(FormatError):
    """The object header does not start with kvpool's magic bytes."""


class UnsupportedVersionError(FormatError):
    """The object header names a format version this build cannot read."""


class TruncatedObjectError(FormatError):
    """Fewer bytes than the header promises."""


class ChecksumError(FormatError):
    """A layer's (or the header's) xxh3-64 checksum does not match its bytes."""


class WrongObjectError(ChecksumError):
    """The object found is another key's (its header's key digest differs): a miss, never data."""


# -- lifecycle and cluster ------------------------------------------------------


class PoolClosedError(KVPoolError, RuntimeError):
    """The pool (or tier) was closed."""


class PoolLockedError(KVPoolError, RuntimeError):
    """Another live process already owns this pool's data directory or arena."""


class ForeignOwnerError(PoolLockedError):
    """A file or directory kvpool would use (a cxl arena, its directory) belongs to another user;
    the message names the owner."""


class TierError(KVPoolError):
    """A tier failed in a way that is not one of the more specific errors."""


class MasterUnreachableError(KVPoolError, ConnectionError):
    """The metadata master did not answer within the deadline."""


class NotLeaderError(MasterUnreachableError):
    """A standby master (``master.etcd``) was asked; the message names the leader it knows.
    Clients configured with ``master.etcd`` follow the leader by themselves."""


class CoordinatorError(KVPoolError, ConnectionError):
    """etcd (``master.etcd``) cannot be reached or answered something unusable."""


class ProtocolError(KVPoolError):
    """A peer sent a message that could not be parsed or names an unknown version."""


class RequestTooLargeError(ProtocolError):
    """A request (or a field of it: batch, address, id, record) exceeds the receiver's limits."""


class UnknownNodeError(KVPoolError, LookupError):
    """A request named a node the master does not know or has declared dead."""


class ReservationError(KVPoolError):
    """A put reservation is unknown, expired, revoked, or its node died before commit."""


class TransferError(KVPoolError):
    """A pull of KV bytes from a peer node failed."""


class RemoteMissError(TransferError):
    """The peer a key was pulled from no longer holds it (evicted or deleted since it was located)."""


class KVTimeoutError(KVPoolError, TimeoutError):
    """An operation did not finish within its deadline."""


# -- durable puts and arguments -------------------------------------------------


class NotEnoughReplicasError(CapacityError):
    """A durable put asked for more copies than there are eligible storage nodes (nothing was copied)."""


class InvalidArgumentError(KVPoolError, ValueError):
    """An argument is out of range (e.g. ``replicas < 1``)."""


class AuthenticationError(KVPoolError, PermissionError):
    """The peer refused this process's credentials (no or another cluster key), or a pull token."""
