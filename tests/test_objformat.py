from __future__ import annotations

import struct

import numpy as np
import pytest

from kvpool import errors
from kvpool.objformat import (
    DTYPES,
    FIXED_HEADER_NBYTES,
    LayerRange,
    ObjectHeader,
    canonical_dtype,
    decode,
    encode,
    numpy_dtype,
    spec_of,
)

SHAPE = (6, 2, 16, 4, 8)


def sample(dtype: str) -> np.ndarray:
    rng = np.random.default_rng(1)
    if dtype in ("uint8",):
        return rng.integers(0, 256, SHAPE, dtype=np.uint8)
    return rng.standard_normal(SHAPE).astype(dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32", "uint8"])
def test_round_trip(dtype: str) -> None:
    arr = sample(dtype)
    header, out = decode(encode(arr, b"key"))
    assert header.spec.dtype == dtype
    np.testing.assert_array_equal(out, arr)


@pytest.mark.parametrize("dtype, raw", [("bfloat16", np.uint16), ("float8_e4m3fn", np.uint8),
                                        ("float8_e5m2", np.uint8)])
def test_round_trip_of_types_numpy_lacks_as_raw_bytes(dtype: str, raw: type) -> None:
    arr = np.random.default_rng(2).integers(0, np.iinfo(raw).max, SHAPE, dtype=raw)
    header, out = decode(encode(arr, b"key", dtype=dtype))
    assert header.spec.dtype == dtype
    assert out.dtype.itemsize == np.dtype(raw).itemsize
    assert out.view(raw).tobytes() == arr.tobytes()
    assert numpy_dtype(dtype).itemsize == np.dtype(raw).itemsize


def test_bfloat16_and_fp8_come_back_as_ml_dtypes_where_it_is_installed() -> None:
    """kvpool[dtypes]: a bfloat16 put comes back as bfloat16 (without ml_dtypes: its uint16 bytes,
    the test above)."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    for name in ("bfloat16", "float8_e4m3fn", "float8_e5m2"):
        arr = np.random.default_rng(3).standard_normal(SHAPE).astype(getattr(ml_dtypes, name))
        header, out = decode(encode(arr, b"key"))  # the dtype is the array's own
        assert header.spec.dtype == name and out.dtype == arr.dtype
        assert out.tobytes() == arr.tobytes()


@pytest.mark.parametrize("alias, name", [
    ("fp8", "float8_e4m3fn"), ("FP8_E4M3", "float8_e4m3fn"), ("e5m2", "float8_e5m2"), ("bf16", "bfloat16"),
    ("BF16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("fp16", "float16"), ("half", "float16"),
    ("fp32", "float32"), ("float", "float32"), ("int8", "int8"), ("u8", "uint8")])
def test_dtype_aliases_users_type_name_the_stored_type(alias: str, name: str) -> None:
    width = np.dtype(DTYPES[name].storage).itemsize
    raw = np.zeros(SHAPE, dtype={1: np.uint8, 2: np.uint16, 4: np.uint32}[width])
    spec, _ = spec_of(raw, dtype=alias)
    assert spec.dtype == name
    assert canonical_dtype(alias) == name


def test_an_unknown_dtype_names_what_is_accepted() -> None:
    with pytest.raises(errors.DTypeError, match="float8_e4m3fn.*fp8"):
        spec_of(np.zeros(SHAPE, np.uint8), dtype="fp4")


def test_every_layer_range_is_one_contiguous_byte_range() -> None:
    arr = sample("float16")
    blob = encode(arr, b"key")
    spec, _ = spec_of(arr)
    for start in range(6):
        for stop in range(start + 1, 7):
            rng = spec.layer_bytes(LayerRange(start, stop))
            assert blob[rng.offset:rng.end] == arr[start:stop].tobytes()
            _, part = decode(blob, layers=range(start, stop))
            np.testing.assert_array_equal(part, arr[start:stop])


def test_bad_magic_version_truncation_and_checksum_each_raise_their_own_error() -> None:
    blob = bytearray(encode(sample("float16"), b"key"))
    with pytest.raises(errors.BadMagicError):
        decode(b"XXXX" + bytes(blob[4:]))
    bad_version = bytearray(blob)
    struct.pack_into("<H", bad_version, 4, 99)
    with pytest.raises(errors.UnsupportedVersionError):
        decode(bad_version)
    with pytest.raises(errors.TruncatedObjectError):
        decode(blob[:-1])
    with pytest.raises(errors.TruncatedObjectError):
        decode(blob[:FIXED_HEADER_NBYTES - 1])
    flipped = bytearray(blob)
    flipped[-1] ^= 0x01
    with pytest.raises(errors.ChecksumError, match="layer 5"):
        decode(flipped)
    dims = bytearray(blob)
    dims[20] ^= 0x01  # a bit in the token count: caught by the header checksum
    with pytest.raises(errors.ChecksumError):
        decode(dims)
    # a partial read of intact layers still verifies when another layer is corrupt
    _, ok = decode(flipped, layers=range(0, 5))
    assert ok.shape[0] == 5


def test_header_pack_unpack_is_identity() -> None:
    spec, arr = spec_of(sample("float32"))
    blob = encode(arr, b"key")
    header = ObjectHeader.unpack(blob)
    assert header.spec == spec and header.pack() == blob[:spec.header_nbytes]
    assert spec.header_nbytes % 64 == 0


def test_a_header_parsed_from_the_same_bytes_is_remembered_and_a_damaged_one_never_is() -> None:
    spec, arr = spec_of(sample("float32"))
    raw = bytearray(encode(arr, b"remembered")[:spec.header_nbytes])
    first = ObjectHeader.unpack_exact(raw, spec)
    assert ObjectHeader.unpack_exact(bytes(raw), spec) is first and first == ObjectHeader.unpack(raw)
    raw[FIXED_HEADER_NBYTES] ^= 1  # a layer checksum flipped: the header's own checksum fails
    for _ in range(2):
        with pytest.raises(errors.ChecksumError):
            ObjectHeader.unpack_exact(raw, spec)
    raw[FIXED_HEADER_NBYTES] ^= 1
    other = bytearray(encode(arr, b"another key")[:spec.header_nbytes])
    assert not ObjectHeader.unpack_exact(other, spec).is_for(b"remembered")
    with pytest.raises(errors.WrongObjectError):
        ObjectHeader.unpack_expected(other, b"remembered", first.checksum(), spec)


@pytest.mark.parametrize("bad, error", [
    (np.zeros((2, 2, 4, 4)), errors.ShapeError),
    (np.zeros((2, 3, 4, 4, 4), dtype=np.float16), errors.ShapeError),
    (np.zeros((2, 2, 0, 4, 4), dtype=np.float16), errors.ShapeError),
    (np.zeros((2, 2, 4, 4, 4), dtype=np.int64), errors.DTypeError),
    (np.zeros((2, 2, 4, 4, 4), dtype=np.complex64), errors.DTypeError),
])
def test_bad_arrays_raise_typed_errors(bad: np.ndarray, error: type) -> None:
    with pytest.raises(error):
        spec_of(bad)


def test_explicit_dtype_must_match_element_width() -> None:
    with pytest.raises(errors.DTypeError):
        spec_of(np.zeros(SHAPE, dtype=np.float32), dtype="bfloat16")


def test_layer_range_forms_and_errors() -> None:
    assert LayerRange.resolve(None, 8) == LayerRange(0, 8)
    assert LayerRange.resolve(3, 8) == LayerRange(3, 4)
    assert LayerRange.resolve(range(2, 5), 8) == LayerRange(2, 5)
    assert LayerRange.resolve(slice(-2, None), 8) == LayerRange(6, 8)
    assert LayerRange.resolve((1, 2), 8) == LayerRange(1, 2)
    for bad in (range(0, 9), range(0, 8, 2), (5, 5), 8, "x"):
        with pytest.raises(errors.LayerRangeError):
            LayerRange.resolve(bad, 8)
