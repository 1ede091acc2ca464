"""The hbm tier: conformance against the emulated device here, real CuPy where a GPU exists."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvpool import errors
from kvpool.config import Config
from kvpool.objformat import LayerRange, byte_view
from kvpool.testing import TierTests, make_object, store
from tiers.hbm import EMULATED_DEVICE, HbmTier, cuda_unavailable_reason

NO_CUDA_REASON = cuda_unavailable_reason()
HAS_CUDA = NO_CUDA_REASON is None
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason=f"needs a CUDA device: {NO_CUDA_REASON}")
needs_no_gpu = pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only path; this machine has a GPU")


class TestHbmTier(TierTests):
    """Emulated on CPU-only machines; on a GPU the same suite runs against device memory."""

    def make_tier(self, tmp_path, capacity_bytes):
        return HbmTier(capacity_bytes, emulate=True)


@needs_no_gpu
def test_emulated_device_says_so_and_exposes_no_views() -> None:
    tier = HbmTier(1 << 20)
    try:
        stats = tier.stats()
        assert stats["emulated"] is True
        assert stats["device"] == EMULATED_DEVICE == "emulated (no CUDA device)"
        assert stats["emulation_reason"] == NO_CUDA_REASON
        assert not tier.supports_views
        extent = tier.allocate(4096)
        assert extent is not None
        with pytest.raises(NotImplementedError):  # a GPU has no host view; neither does its stand-in
            tier.view(extent, 0, 64)
    finally:
        tier.close()


@needs_no_gpu
def test_without_cuda_and_without_emulation_the_error_says_how_to_install() -> None:
    with pytest.raises(errors.TierError, match=r"pip install 'kvpool\[gpu\]'"):
        HbmTier(1 << 20, emulate=False)


def test_from_config_uses_the_section() -> None:
    config = Config()
    config.tiers.hbm.capacity = 2 << 20
    tier = HbmTier.from_config(config.tiers.hbm, config)
    try:
        assert tier.capacity_bytes == 2 << 20
        assert tier.device_id == 0
        assert tier.stats()["emulated"] is (not HAS_CUDA)
    finally:
        tier.close()


# -- real GPU ----------------------------------------------------------------------------


@pytest.fixture
def gpu_tier() -> Iterator[HbmTier]:
    tier = HbmTier(8 << 20, emulate=False)
    try:
        yield tier
    finally:
        tier.close()


@gpu
@needs_gpu
def test_gpu_round_trip_host_to_device_to_host(gpu_tier: HbmTier) -> None:
    assert gpu_tier.stats()["emulated"] is False
    assert gpu_tier.stats()["device"].startswith("cuda:0")
    arr, header, payload = make_object(layers=6, tokens=32)
    extent = store(gpu_tier, header, payload)
    out = np.empty(header.spec.array_shape(LayerRange(1, 4)), dtype=arr.dtype)
    gpu_tier.read_layers(extent, header, LayerRange(1, 4), byte_view(out))
    np.testing.assert_array_equal(out, arr[1:4])


@gpu
@needs_gpu
def test_gpu_device_to_device_source_and_out(gpu_tier: HbmTier) -> None:
    import cupy  # type: ignore[import-not-found]

    arr, header, payload = make_object(layers=4, tokens=16)
    device_payload: Any = cupy.asarray(arr)
    extent = gpu_tier.allocate(header.spec.total_nbytes)
    assert extent is not None
    gpu_tier.write_object(extent, header, device_payload)  # payload device -> device
    out = cupy.empty(header.spec.array_shape(LayerRange(2, 4)), dtype=arr.dtype)
    gpu_tier.read_layers(extent, header, LayerRange(2, 4), out)  # device -> device out
    np.testing.assert_array_equal(cupy.asnumpy(out), arr[2:4])
    with pytest.raises(errors.OutBufferError):
        gpu_tier.read_layers(extent, header, LayerRange(0, 4), out)


# -- the CuPy code path against a stand-in device ---------------------------------------
#
# CI has no GPU, so the device branch of HbmTier would otherwise never run. This
# stand-in keeps device memory in numpy but enforces the contract real CuPy
# enforces (cupy/_core/core.pyx): ``set``/``get(out=)`` take only numpy arrays of
# the same dtype and shape into contiguous device arrays, and device arrays never
# mix implicitly with host arrays.


class FakeDeviceArray:
    def __init__(self, host: np.ndarray) -> None:
        self._host = host

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        return {"shape": self._host.shape, "typestr": self._host.dtype.str,
                "data": (self._host.ctypes.data, False), "version": 3}

    shape = property(lambda self: self._host.shape)
    dtype = property(lambda self: self._host.dtype)
    nbytes = property(lambda self: self._host.nbytes)
    flags = property(lambda self: self._host.flags)

    def __getitem__(self, index: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self._host[index])

    def __setitem__(self, index: Any, value: Any) -> None:
        if not isinstance(value, FakeDeviceArray):
            raise TypeError(f"Unsupported type {type(value)}")  # as CuPy: no implicit host->device
        self._host[index] = value._host

    def reshape(self, *shape: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self._host.reshape(*shape))

    def view(self, dtype: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self._host.view(dtype))

    def set(self, arr: Any, stream: Any = None) -> None:
        if not isinstance(arr, np.ndarray):
            raise TypeError("Only numpy.ndarray can be set to cupy.ndarray")
        if arr.dtype != self.dtype or arr.shape != self.shape or not self._host.flags.c_contiguous:
            raise ValueError("dtype/shape mismatch or non-contiguous destination")
        self._host[...] = arr

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        if out is None:
            return self._host.copy()
        if not isinstance(out, np.ndarray) or out.dtype != self.dtype or out.shape != self.shape:
            raise TypeError("out must be a numpy array of the same dtype and shape")
        out[...] = self._host
        return out


def _fake_cupy_module() -> Any:
    import contextlib
    import types

    cupy = types.ModuleType("cupy")
    runtime = types.SimpleNamespace(
        getDeviceCount=lambda: 1,
        getDeviceProperties=lambda device: {"name": b"Fake H200"},
        CUDARuntimeError=type("CUDARuntimeError", (RuntimeError,), {}),
    )
    stream = types.SimpleNamespace(synchronize=lambda: None)
    cupy.cuda = types.SimpleNamespace(  # type: ignore[attr-defined]
        runtime=runtime,
        memory=types.SimpleNamespace(OutOfMemoryError=type("OutOfMemoryError", (MemoryError,), {})),
        Device=lambda device: contextlib.nullcontext(),
        get_current_stream=lambda: stream,
    )
    cupy.uint8 = np.uint8  # type: ignore[attr-defined]
    cupy.empty = lambda n, dtype: FakeDeviceArray(np.empty(n, dtype))  # type: ignore[attr-defined]

    def asarray(obj: Any) -> FakeDeviceArray:
        if isinstance(obj, FakeDeviceArray):
            return obj
        raise TypeError("the stand-in only wraps its own device arrays")

    cupy.asarray = asarray  # type: ignore[attr-defined]
    cupy.ascontiguousarray = lambda a: FakeDeviceArray(np.ascontiguousarray(a._host))  # type: ignore[attr-defined]
    return cupy


@pytest.fixture
def fake_cupy(monkeypatch: pytest.MonkeyPatch) -> Any:
    module = _fake_cupy_module()
    monkeypatch.setitem(__import__("sys").modules, "cupy", module)
    return module


class TestHbmTierOnStandInDevice(TierTests):
    """The device branch (host<->device copies through CuPy's API) against the stand-in."""

    @pytest.fixture(autouse=True)
    def _device(self, fake_cupy: Any) -> None:
        pass

    def make_tier(self, tmp_path, capacity_bytes):
        tier = HbmTier(capacity_bytes, emulate=False)
        assert tier.emulated is False and tier.stats()["device"] == "cuda:0 (Fake H200)"
        return tier


def test_stand_in_device_to_device_source_and_out(fake_cupy: Any) -> None:
    tier = HbmTier(1 << 20, emulate=False)
    try:
        arr, header, _ = make_object(layers=4, tokens=16)
        device_payload = FakeDeviceArray(arr.copy())
        extent = tier.allocate(header.spec.total_nbytes)
        assert extent is not None
        tier.write_object(extent, header, device_payload)
        out = FakeDeviceArray(np.empty(header.spec.array_shape(LayerRange(2, 4)), dtype=arr.dtype))
        tier.read_layers(extent, header, LayerRange(2, 4), out)
        np.testing.assert_array_equal(out._host, arr[2:4])
        with pytest.raises(errors.OutBufferError):
            tier.read_layers(extent, header, LayerRange(0, 4), out)
        strided = FakeDeviceArray(np.empty((4, 2, 32, 2, 32), dtype=arr.dtype)[:, :, ::2])
        with pytest.raises(errors.OutBufferError):
            tier.read_into(extent, header.nbytes, strided)
    finally:
        tier.close()
