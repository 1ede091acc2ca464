"""The stored object format: one prefix chunk's KV for all layers.

Owns the byte layout of an object (header + layer-major payload), the dtype
table, layer/byte range value types, per-layer checksums, and turning user
arrays into contiguous layer-major views. It does not own where bytes live
(``tiers``) or how they move (``kvpool.transport``).

Layout of one object ("blob")::

    offset 0                      header_nbytes                 total_nbytes
    | fixed header | layer xxh3-64 | pad | layer 0 | layer 1 | ... | layer L-1 |

Fixed header (little-endian, 80 bytes)::

    magic 4s "KVPL" | version u16 | dtype u8 | flags u8 | header_nbytes u32
    | layers u32 | kv u32 (=2) | tokens u32 | kv_heads u32 | head_dim u32
    | reserved u32 | layer_nbytes u64 | key_digest 16s | generation u64
    | header_xxh3_64 u64 | pad 4x

followed by ``layers`` u64 per-layer checksums, zero-padded to a multiple of
64 bytes. Each layer is ``[2 (K,V)][tokens][kv_heads][head_dim]`` elements, so
layers ``[a, b)`` are the single byte range
``header_nbytes + a*layer_nbytes .. header_nbytes + b*layer_nbytes``.
The header checksum covers the fixed header (with its own field zeroed) and
the layer checksums, so a flipped bit in the dims is caught, not trusted.

Identity: ``key_digest`` is the xxh3-128 of the object's key and
``generation`` a number unique to one put of it, both under the header
checksum. A reader that found an object by key through any index (the shared
arena index, the master, an nvme index) checks the digest against the key it
asked for (:meth:`ObjectHeader.check_identity`), so an extent freed and
reused for another object is a miss, never that object's bytes. Readers take
the header from one copy of it and verify the layers they copied against that
copy's checksums: nothing is parsed twice from memory another process writes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import struct
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import xxhash

from kvpool import errors
from kvpool.native import extension

if TYPE_CHECKING:
    from kvpool import _layersum
else:  # built by setup.py where a C compiler is; the same checksums in Python otherwise (None)
    _layersum = extension("_layersum")

#: layers at least this long have their checksums computed in C (kvpool/_layersum.c)
_NATIVE_MIN_STEP = _layersum.MIN_STEP if _layersum is not None else 1 << 62
_FUSED_FROM = 4 << 20  # without C, copies at least this large are hashed layer by layer as copied

MAGIC = b"KVPL"
FORMAT_VERSION = 2
HEADER_ALIGN = 64
_FIXED = struct.Struct("<4sHBBIIIIIIIQ16sQQ4x")
FIXED_HEADER_NBYTES = _FIXED.size  # 80
_CHECKSUM_OFFSET = 68
_KEY_OFFSET = 44
KEY_DIGEST_NBYTES = 16
_generations = itertools.count(time.time_ns())


def key_digest(key: bytes) -> bytes:
    """The 16-byte identity of ``key`` recorded in every object header (xxh3-128)."""
    return xxhash.xxh3_128_digest(key)


def next_generation() -> int:
    """A number no earlier put in this process used (seeded from the clock across restarts)."""
    return next(_generations) & 0xFFFFFFFFFFFFFFFF


# -- dtypes -------------------------------------------------------------------


@dataclass(frozen=True)
class DTypeInfo:
    code: int
    name: str
    storage: str  # numpy dtype the bytes are viewed as when no richer type exists


# Codes are part of the on-disk format: never renumber, only append.
DTYPES: dict[str, DTypeInfo] = {
    d.name: d
    for d in (
        DTypeInfo(1, "float16", "<f2"),
        DTypeInfo(2, "bfloat16", "<u2"),
        DTypeInfo(3, "float32", "<f4"),
        DTypeInfo(4, "uint8", "u1"),
        DTypeInfo(5, "float8_e4m3fn", "u1"),
        DTypeInfo(6, "float8_e5m2", "u1"),
        DTypeInfo(7, "int8", "i1"),
    )
}
_DTYPE_BY_CODE = {d.code: d for d in DTYPES.values()}

#: what users type for the stored types (case-insensitive; a leading ``torch.`` is ignored).
#: ``fp8`` is e4m3, as vLLM's ``kv_cache_dtype="fp8"``.
DTYPE_ALIASES: dict[str, str] = {
    "fp16": "float16", "f16": "float16", "half": "float16", "<f2": "float16",
    "bf16": "bfloat16",
    "fp32": "float32", "f32": "float32", "float": "float32", "single": "float32", "<f4": "float32",
    "fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e4m3fn": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn",
    "fp8_e5m2": "float8_e5m2", "e5m2": "float8_e5m2",
    "u8": "uint8", "byte": "uint8", "i8": "int8",
}


def canonical_dtype(name: str) -> str:
    """The stored type's name for ``name`` or one of its aliases (``"bf16"``, ``"fp8"``,
    ``"half"``, ``"torch.float16"``...); DTypeError naming what is accepted otherwise."""
    if name in DTYPES:
        return name
    key = str(name).strip().lower().removeprefix("torch.")
    key = DTYPE_ALIASES.get(key, key)
    if key in DTYPES:
        return key
    raise errors.DTypeError(f"unsupported dtype {name!r}; kvpool stores {sorted(DTYPES)} "
                            f"(also written {', '.join(sorted(DTYPE_ALIASES))})")


def dtype_info(name: str) -> DTypeInfo:
    return DTYPES[canonical_dtype(name)]


@functools.cache
def storage_dtype(name: str) -> np.dtype:
    """The plain numpy type an object's bytes are stored as (uint16 for bfloat16, ...)."""
    return np.dtype(dtype_info(name).storage)


@functools.cache
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype arrays of ``name`` are returned as.

    bfloat16 and fp8 have no numpy dtype; when ``ml_dtypes`` is importable
    (``pip install kvpool[dtypes]``) its types are used, otherwise the raw storage
    type (uint16 / uint8) so the bytes stay exact.
    """
    info = dtype_info(name)
    if np.dtype(info.storage).name != info.name:  # bfloat16, fp8: richer types only in ml_dtypes
        try:
            import ml_dtypes  # type: ignore[import-not-found]

            richer: np.dtype[Any] = np.dtype(getattr(ml_dtypes, info.name))
            return richer
        except (ImportError, AttributeError):
            pass
    return np.dtype(info.storage)


# -- value types ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LayerRange:
    """Half-open range of layers ``[start, stop)``."""

    start: int
    stop: int

    @property
    def count(self) -> int:
        return self.stop - self.start

    @classmethod
    def resolve(cls, layers: Any, num_layers: int) -> LayerRange:
        """Normalise ``None`` / int / ``range`` / ``slice`` / ``(a, b)`` / LayerRange.

        Raises LayerRangeError if empty, stepped, or outside ``[0, num_layers)``.
        """
        if layers is None:
            whole = _WHOLE.get(num_layers)
            if whole is not None and cls is LayerRange:
                return whole
            start, stop = 0, num_layers
        elif isinstance(layers, LayerRange):
            if 0 <= layers.start < layers.stop <= num_layers and type(layers) is cls:
                return layers  # immutable: used as it is
            start, stop = layers.start, layers.stop
        elif isinstance(layers, (int, np.integer)):
            start, stop = int(layers), int(layers) + 1
        elif isinstance(layers, range):
            if layers.step != 1:
                raise errors.LayerRangeError(f"layer range {layers!r} must have step 1")
            start, stop = layers.start, layers.stop
        elif isinstance(layers, slice):
            start, stop, step = layers.indices(num_layers)
            if step != 1:
                raise errors.LayerRangeError(f"layer slice {layers!r} must have step 1")
        elif isinstance(layers, tuple) and len(layers) == 2:
            start, stop = int(layers[0]), int(layers[1])
        else:
            raise errors.LayerRangeError(f"cannot read {layers!r} as a layer range")
        if not 0 <= start < stop <= num_layers:
            raise errors.LayerRangeError(
                f"layers [{start}, {stop}) outside the object's {num_layers} layers"
            )
        resolved = cls(start, stop)
        if layers is None and cls is LayerRange and len(_WHOLE) < _WHOLE_MAX:
            _WHOLE[num_layers] = resolved
        return resolved


_WHOLE_MAX = 1024
_WHOLE: dict[int, LayerRange] = {}  # num_layers -> LayerRange(0, num_layers), shared (immutable)


class ByteRange(NamedTuple):
    """``nbytes`` bytes starting at ``offset`` (relative to the object's first byte). (A tuple:
    every get and served pull makes one, and a frozen dataclass's ``__init__`` sets each field
    through ``object.__setattr__``, several times a tuple's cost.)"""

    offset: int
    nbytes: int

    @property
    def end(self) -> int:
        return self.offset + self.nbytes


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """Shape and dtype of one object: ``[layers, 2, tokens, kv_heads, head_dim]``."""

    dtype: str
    layers: int
    tokens: int
    kv_heads: int
    head_dim: int
    # Derived once (every get needs them): element, layer and header sizes in bytes.
    itemsize: int = dataclasses.field(init=False, repr=False, compare=False)
    layer_nbytes: int = dataclasses.field(init=False, repr=False, compare=False)
    header_nbytes: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        info = dtype_info(self.dtype)
        for name in ("layers", "tokens", "kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0 or value >= 2**32:
                raise errors.ShapeError(f"{name} must be a positive 32-bit int, got {value!r}")
        itemsize = np.dtype(info.storage).itemsize
        object.__setattr__(self, "itemsize", itemsize)
        object.__setattr__(self, "layer_nbytes", 2 * self.tokens * self.kv_heads * self.head_dim * itemsize)
        object.__setattr__(self, "header_nbytes", _round_up(FIXED_HEADER_NBYTES + 8 * self.layers, HEADER_ALIGN))

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)

    @property
    def payload_nbytes(self) -> int:
        return self.layers * self.layer_nbytes

    @property
    def total_nbytes(self) -> int:
        return self.header_nbytes + self.payload_nbytes

    def layer_bytes(self, layer_range: LayerRange) -> ByteRange:
        """Byte range of ``layer_range`` within the whole object (header included)."""
        return ByteRange(
            self.header_nbytes + layer_range.start * self.layer_nbytes,
            layer_range.count * self.layer_nbytes,
        )

    def array_shape(self, layer_range: LayerRange | None = None) -> tuple[int, ...]:
        count = self.layers if layer_range is None else layer_range.count
        return (count, 2, self.tokens, self.kv_heads, self.head_dim)

    def to_wire(self) -> list[Any]:
        return [self.dtype, self.layers, self.tokens, self.kv_heads, self.head_dim]

    @classmethod
    def from_wire(cls, fields: Sequence[Any]) -> ObjectSpec:
        dtype, layers, tokens, kv_heads, head_dim = fields
        return cls(str(dtype), int(layers), int(tokens), int(kv_heads), int(head_dim))


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


# -- header -----------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectHeader:
    """An object's spec, its identity (key digest, generation) and one xxh3-64 per layer."""

    spec: ObjectSpec
    layer_checksums: tuple[int, ...]
    key_digest: bytes
    generation: int = 0

    def __post_init__(self) -> None:
        if len(self.layer_checksums) != self.spec.layers:
            raise errors.FormatError(
                f"{len(self.layer_checksums)} checksums for {self.spec.layers} layers"
            )
        if len(self.key_digest) != KEY_DIGEST_NBYTES:
            raise errors.FormatError(f"key digest is {len(self.key_digest)} bytes, expected {KEY_DIGEST_NBYTES}")

    @classmethod
    def for_key(cls, key: bytes, spec: ObjectSpec, layer_checksums: tuple[int, ...],
                generation: int | None = None) -> ObjectHeader:
        """A header naming ``key``; a fresh generation unless one is given."""
        return cls(spec, tuple(layer_checksums), key_digest(key),
                   next_generation() if generation is None else generation)

    def is_for(self, key: bytes) -> bool:
        return self.key_digest == key_digest(key)

    def check_identity(self, key: bytes) -> None:
        """Raise WrongObjectError unless this header names ``key``."""
        if self.key_digest != key_digest(key):
            raise errors.WrongObjectError("the object found is not the one asked for (key digest differs)")

    @property
    def nbytes(self) -> int:
        return self.spec.header_nbytes

    def pack(self) -> bytes:
        spec = self.spec
        buf = bytearray(spec.header_nbytes)
        _FIXED.pack_into(
            buf, 0, MAGIC, FORMAT_VERSION, dtype_info(spec.dtype).code, 0,
            spec.header_nbytes, spec.layers, 2, spec.tokens, spec.kv_heads,
            spec.head_dim, 0, spec.layer_nbytes, self.key_digest, self.generation, 0,
        )
        end = FIXED_HEADER_NBYTES + 8 * spec.layers
        _sums_struct(spec.layers).pack_into(buf, FIXED_HEADER_NBYTES, *self.layer_checksums)
        struct.pack_into("<Q", buf, _CHECKSUM_OFFSET, xxhash.xxh3_64_intdigest(memoryview(buf)[:end]))
        return bytes(buf)

    @functools.cached_property
    def packed(self) -> bytes:
        """:meth:`pack`, computed once (a holder sends it with every pull it serves)."""
        return self.pack()

    def checksum(self) -> int:
        """The header's own xxh3-64 (it covers the dims, the identity and every layer checksum):
        what the master keeps of a replica's header, and what a reader checks the holder's
        header against."""
        return stored_header_checksum(self.packed)

    @classmethod
    def unpack(cls, data: Any, expected: ObjectSpec | None = None) -> ObjectHeader:
        """Parse and verify a header from the first bytes of ``data``.

        Raises BadMagicError, UnsupportedVersionError, TruncatedObjectError,
        ChecksumError (header checksum) or FormatError (impossible dims).
        ``expected``: a spec the header very likely has (a reader's located one); when its dims
        are the header's, the header shares that spec object instead of building one.
        """
        mv = data if type(data) is bytes else memoryview(data).cast("B")
        if len(mv) < FIXED_HEADER_NBYTES:
            raise errors.TruncatedObjectError(
                f"{len(mv)} bytes is shorter than the {FIXED_HEADER_NBYTES}-byte header"
            )
        fields = _FIXED.unpack_from(mv, 0)
        magic, version, layers, digest, generation, header_sum = (fields[0], fields[1], fields[5], fields[12],
                                                                  fields[13], fields[14])
        if magic != MAGIC:
            raise errors.BadMagicError(f"bad magic {bytes(magic)!r}, expected {MAGIC!r}")
        if version != FORMAT_VERSION:
            raise errors.UnsupportedVersionError(
                f"object format version {version}; this build reads {FORMAT_VERSION}"
            )
        end = FIXED_HEADER_NBYTES + 8 * layers
        if len(mv) < end:
            raise errors.TruncatedObjectError(f"header needs {end} bytes, got {len(mv)}")
        # the checksum covers the header with its own field zeroed
        if xxhash.xxh3_64_intdigest(b"".join((mv[:_CHECKSUM_OFFSET], _ZERO_SUM,
                                              mv[_CHECKSUM_OFFSET + 8:end]))) != header_sum:
            raise errors.ChecksumError("object header checksum mismatch")
        dims = fields[2:12]  # dtype code .. layer bytes
        known = _known_dims.get(dims)
        if known is None:
            known = _dims_of(*dims)
            if len(_known_dims) < 1024:
                _known_dims[dims] = known
        spec, sums = known
        if expected is not None and expected == spec:
            spec = expected
        # built without __init__'s checks: the struct gave one checksum a layer and a 16-byte digest
        header = object.__new__(cls)
        header.__dict__.update(spec=spec, layer_checksums=sums.unpack_from(mv, FIXED_HEADER_NBYTES),
                               key_digest=bytes(digest), generation=generation)
        return header

    @classmethod
    def unpack_exact(cls, data: Any, expected: ObjectSpec | None = None) -> ObjectHeader:
        """:meth:`unpack` of exactly a header's bytes, remembered by those bytes (the last
        :data:`_PARSED_MAX` distinct ones): reading an object again skips parsing and checking
        its header. Safe because the same bytes always parse to the same (immutable) header,
        and bytes that fail to parse are never remembered."""
        blob = bytes(data)
        header = _parsed.get(blob)
        if header is None:
            header = cls.unpack(blob, expected)
            if len(_parsed) >= _PARSED_MAX:
                try:  # the oldest, in O(1) (next(iter(dict)) walks every slot deleted before it)
                    _parsed.popitem(last=False)
                except KeyError:  # another thread emptied it meanwhile
                    pass
            _parsed[blob] = header
        return header

    @classmethod
    def unpack_expected(cls, data: Any, key: bytes, header_sum: int, spec: ObjectSpec) -> ObjectHeader:
        """The header a holder sent (or an arena holds), checked against what the master indexed:
        its own checksum equals ``header_sum`` (this very version of the object, not one put
        again or reused since it was located), it names ``key``, and its spec is ``spec`` (the
        one the reader sized its buffer by). Raises WrongObjectError for a different object or
        version, the errors of :meth:`unpack` for a damaged one. ``data``: exactly the header
        (:meth:`unpack_exact`)."""
        header = cls.unpack_exact(data, spec)
        if stored_header_checksum(data) != header_sum:
            raise errors.WrongObjectError(
                "the holder's header is not the one indexed (the object was replaced since it was located)")
        header.check_identity(key)
        if header.spec != spec:
            raise errors.WrongObjectError(f"the holder's object is {header.spec}, the index says {spec}")
        return header

    def verify(self, layer_range: LayerRange, data: Any) -> None:
        """Check that ``data`` holds exactly the layers of ``layer_range``, intact.

        Raises TruncatedObjectError on a short buffer, ChecksumError naming the
        first bad layer.
        """
        step = self.spec.layer_nbytes
        nbytes = (layer_range.stop - layer_range.start) * step
        mv = data if type(data) is memoryview and data.format == "B" and data.ndim == 1 and data.c_contiguous \
            else memoryview(data).cast("B")
        if mv.nbytes != nbytes:
            if mv.nbytes < nbytes:
                raise errors.TruncatedObjectError(
                    f"{len(mv)} bytes for {layer_range.count} layers of {step} bytes"
                )
            mv = mv[:nbytes]
        self._compare(layer_range, layer_checksums(mv, step))

    def copy_verified(self, layer_range: LayerRange, out: Any, source: Any) -> None:
        """Copy ``source`` (exactly the layers of ``layer_range``) into ``out`` and verify the
        copy: what ``out`` holds is checked, so a ``source`` that another process changes during
        the copy is caught. Raises OutBufferError for an ``out`` of another size or read-only,
        ChecksumError naming the first bad layer."""
        dst, src = memoryview(out), memoryview(source)
        nbytes = layer_range.count * self.spec.layer_nbytes
        if dst.readonly:
            raise errors.OutBufferError("out is read-only")
        if dst.nbytes != nbytes or src.nbytes != nbytes:
            raise errors.OutBufferError(f"out holds {dst.nbytes} bytes, source {src.nbytes}, layers need {nbytes}")
        self._compare(layer_range, copy_layer_checksums(dst, src, self.spec.layer_nbytes))

    def _compare(self, layer_range: LayerRange, got: tuple[int, ...]) -> None:
        expected = self.layer_checksums[layer_range.start:layer_range.stop]
        if got != expected:
            bad = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
            raise errors.ChecksumError(f"layer {layer_range.start + bad} checksum mismatch")


_ZERO_SUM = bytes(8)


def _dims_of(code: int, _flags: int, header_nbytes: int, layers: int, kv: int, tokens: int, kv_heads: int,
             head_dim: int, _reserved: int, layer_nbytes: int) -> tuple[ObjectSpec, struct.Struct]:
    """The spec a header's dims name and the struct of its layer checksums (:data:`_known_dims`
    keeps them: every header of a model has the same dims). Raises FormatError for dims no spec
    has."""
    info = _DTYPE_BY_CODE.get(code)
    if info is None:
        raise errors.FormatError(f"unknown dtype code {code}")
    if kv != 2:
        raise errors.FormatError(f"kv dimension is {kv}, expected 2")
    try:
        spec = ObjectSpec(info.name, layers, tokens, kv_heads, head_dim)
    except errors.ShapeError as exc:
        raise errors.FormatError(f"impossible dims in header: {exc}") from None
    if spec.header_nbytes != header_nbytes or spec.layer_nbytes != layer_nbytes:
        raise errors.FormatError("header sizes disagree with its dims")
    return spec, _sums_struct(layers)


@functools.lru_cache(maxsize=256)
def _sums_struct(layers: int) -> struct.Struct:
    """The layer checksums of a ``layers``-layer header, as one struct (little-endian u64s)."""
    return struct.Struct(f"<{layers}Q")


#: a header's dims (its fixed fields from the dtype code to the layer size) -> (spec, the struct
#: of its layer checksums), for dims that made a valid spec (the first 1,024 sets seen): one
#: shared spec per model, built (and its dims validated) once
_known_dims: dict[tuple[int, ...], tuple[ObjectSpec, struct.Struct]] = {}
_PARSED_MAX = 4096  # ~2 KiB each for a 32-layer header (its bytes, the header, 32 checksums)
_parsed: OrderedDict[bytes, ObjectHeader] = OrderedDict()  # exact header bytes -> header (unpack_exact)


def stored_header_checksum(blob: Any) -> int:
    """The header checksum recorded in the first bytes of an object (not verified here)."""
    checksum: int = struct.unpack_from("<Q", blob, _CHECKSUM_OFFSET)[0]
    return checksum


def header_nbytes_at(blob: Any) -> int:
    """The header length an object's first bytes claim (not verified: bound it before use)."""
    if len(memoryview(blob).cast("B")) < FIXED_HEADER_NBYTES:
        raise errors.TruncatedObjectError("fewer bytes than a fixed header")
    return int(struct.unpack_from("<I", blob, 8)[0])


def layer_checksums(payload: Any, layer_nbytes: int) -> tuple[int, ...]:
    """xxh3-64 of each ``layer_nbytes`` slice of ``payload`` (in C, in one call, where built)."""
    mv = payload if type(payload) is memoryview and payload.format == "B" and payload.ndim == 1 \
        and payload.c_contiguous else memoryview(payload).cast("B")
    if layer_nbytes >= _NATIVE_MIN_STEP and len(mv) % layer_nbytes == 0:
        return _layersum.layer_digests(mv, layer_nbytes)
    return tuple(
        xxhash.xxh3_64_intdigest(mv[i:i + layer_nbytes]) for i in range(0, len(mv), layer_nbytes)
    )


def copy_layer_checksums(dst: memoryview, src: memoryview, layer_nbytes: int) -> tuple[int, ...]:
    """Copy ``src`` into ``dst`` (byte views of one length, whole layers, not overlapping) and
    return :func:`layer_checksums` of the copy.

    In C the layers are hashed in the same pass as they are copied, so the bytes are read from
    memory once (a copy and then a hash reads them twice); without it, large copies hash
    each layer right after copying it, while it is still in cache.
    """
    dst, src = dst.cast("B"), src.cast("B")
    if layer_nbytes >= _NATIVE_MIN_STEP:
        return _layersum.copy_layer_digests(dst, src, layer_nbytes)
    if len(dst) < _FUSED_FROM:
        dst[:] = src
        return layer_checksums(dst, layer_nbytes)
    sums = []
    for offset in range(0, len(dst), layer_nbytes):
        part = dst[offset:offset + layer_nbytes]
        part[:] = src[offset:offset + layer_nbytes]
        sums.append(xxhash.xxh3_64_intdigest(part))
    return tuple(sums)


# -- user arrays ----------------------------------------------------------------------


def _dtype_name_of(dt: np.dtype) -> str:
    if dt.name in DTYPES:
        return dt.name
    raise errors.DTypeError(f"unsupported dtype {dt}; kvpool stores {sorted(DTYPES)}")


def as_host_array(obj: Any) -> tuple[np.ndarray, str | None]:
    """A numpy view of ``obj`` (no copy when possible) and the dtype name numpy lacks, if any.

    Accepts numpy arrays, CuPy arrays (copied to host), anything with
    ``__dlpack__`` (e.g. torch CPU tensors) and buffer-protocol objects.
    """
    if isinstance(obj, np.ndarray):
        return obj, None
    if hasattr(obj, "__cuda_array_interface__") and hasattr(obj, "get"):
        return obj.get(), None  # CuPy: device -> host
    if hasattr(obj, "__dlpack__"):
        if getattr(obj, "requires_grad", False) and hasattr(obj, "detach"):
            # A tensor from a forward pass run with autograd on (a model called outside
            # torch.no_grad()) refuses export; the bytes stored are the same without its graph.
            obj = obj.detach()
        try:
            return np.from_dlpack(obj), None
        except (TypeError, BufferError, RuntimeError) as exc:
            # numpy refuses dtypes it lacks (torch.bfloat16): reinterpret the
            # same bytes as a 2-byte integer type on the producer's side.
            view = getattr(obj, "view", None)
            if view is not None and "bfloat16" in str(getattr(obj, "dtype", "")):
                import torch  # only reachable with a torch tensor in hand

                return np.from_dlpack(obj.view(torch.int16)).view("<u2"), "bfloat16"
            raise errors.DTypeError(f"cannot view {type(obj).__name__} on the host: {exc}") from exc
    try:
        return np.asarray(memoryview(obj)), None
    except TypeError:
        raise errors.InvalidKVError(
            f"{type(obj).__name__} is not an array (numpy, CuPy, __dlpack__ or buffer)"
        ) from None


def spec_of(kv: Any, dtype: str | None = None) -> tuple[ObjectSpec, np.ndarray]:
    """Validate a user KV array and return its spec and a C-contiguous host view.

    ``dtype`` names the stored type when numpy cannot (``"bfloat16"`` for a
    uint16/int16 array, ``"float8_e4m3fn"`` for uint8 bytes). A non-contiguous
    array is copied once. Raises ShapeError / DTypeError.
    """
    arr, hint = as_host_array(kv)
    dtype = dtype or hint
    if arr.ndim != 5:
        raise errors.ShapeError(
            f"KV must have rank 5 [layers, 2, tokens, kv_heads, head_dim], got shape {arr.shape}"
        )
    if arr.shape[1] != 2:
        raise errors.ShapeError(f"dimension 1 must be 2 (K and V), got shape {arr.shape}")
    if 0 in arr.shape:
        raise errors.ShapeError(f"KV has an empty dimension: shape {arr.shape}")
    if dtype is None:
        name = _dtype_name_of(arr.dtype)
    else:
        info = dtype_info(dtype)
        if arr.dtype.itemsize != np.dtype(info.storage).itemsize:
            raise errors.DTypeError(
                f"dtype={dtype!r} needs {np.dtype(info.storage).itemsize}-byte elements, "
                f"array has {arr.dtype}"
            )
        name = info.name
    if not arr.flags.c_contiguous:
        arr = np.ascontiguousarray(arr)
    layers, _, tokens, kv_heads, head_dim = (int(d) for d in arr.shape)
    return ObjectSpec(name, layers, tokens, kv_heads, head_dim), arr


def byte_view(arr: np.ndarray) -> memoryview:
    """Flat, writable-if-possible byte view of a C-contiguous array."""
    try:
        return arr.data.cast("B")  # the quick way, for dtypes the buffer protocol knows
    except (TypeError, ValueError, BufferError):  # e.g. ml_dtypes' bfloat16
        return arr.reshape(-1).view(np.uint8).data


def out_view(spec: ObjectSpec, layer_range: LayerRange, out: Any) -> tuple[np.ndarray, memoryview]:
    """(array to return, byte view to fill) for ``out=``, or fresh if ``out`` is None."""
    shape = spec.array_shape(layer_range)
    if out is None:
        arr = np.empty(shape, dtype=numpy_dtype(spec.dtype))
        return arr, byte_view(arr)
    if isinstance(out, np.ndarray):
        if out.shape != shape:
            raise errors.OutBufferError(f"out has shape {out.shape}, layers need {shape}")
        if out.dtype != numpy_dtype(spec.dtype) and out.dtype != storage_dtype(spec.dtype):
            raise errors.OutDTypeError(f"out has dtype {out.dtype}, object is {spec.dtype}")
        flags = out.flags
        if not flags.c_contiguous or not flags.writeable:
            raise errors.OutBufferError("out must be C-contiguous and writable")
        return out, byte_view(out)
    try:
        mv = memoryview(out)
    except TypeError:
        raise errors.OutBufferError(
            f"out must be a numpy array or a writable buffer, got {type(out).__name__}"
        ) from None
    if mv.readonly or not mv.c_contiguous:
        raise errors.OutBufferError("out must be C-contiguous and writable")
    mv = mv.cast("B")
    need = spec.layer_nbytes * layer_range.count
    if len(mv) != need:
        raise errors.OutBufferError(f"out holds {len(mv)} bytes, layers need {need}")
    arr = np.frombuffer(mv, dtype=numpy_dtype(spec.dtype)).reshape(shape)
    return arr, mv


def encode(kv: Any, key: bytes, dtype: str | None = None) -> bytes:
    """Serialise an array to one self-describing object (header naming ``key`` + payload)."""
    spec, arr = spec_of(kv, dtype)
    payload = byte_view(arr)
    header = ObjectHeader.for_key(key, spec, layer_checksums(payload, spec.layer_nbytes))
    return header.pack() + payload.tobytes()


def decode(blob: Any, layers: Any = None, *, verify: bool = True,
           key: bytes | None = None) -> tuple[ObjectHeader, np.ndarray]:
    """Parse an object and return (header, array view of the requested layers).

    The array is a view into ``blob`` (no copy). Raises the FormatError family
    on bad magic, version, truncation or checksum mismatch, WrongObjectError
    when ``key`` is given and the object is another key's.
    """
    mv = memoryview(blob).cast("B")
    header = ObjectHeader.unpack(mv)
    if key is not None:
        header.check_identity(key)
    spec = header.spec
    layer_range = LayerRange.resolve(layers, spec.layers)
    rng = spec.layer_bytes(layer_range)
    if len(mv) < rng.end:
        raise errors.TruncatedObjectError(f"object needs {rng.end} bytes, got {len(mv)}")
    data = mv[rng.offset:rng.end]
    if verify:
        header.verify(layer_range, data)
    arr = np.frombuffer(data, dtype=numpy_dtype(spec.dtype)).reshape(spec.array_shape(layer_range))
    return header, arr

