"""The ``hbm`` tier: one preallocated arena of GPU memory, through CuPy.

With CuPy and a CUDA device the arena is a single ``cupy.empty(capacity,
uint8)`` on the configured device; writes copy host→device (or
device→device when the source is a CuPy/``__cuda_array_interface__`` array),
reads copy device→host into ``out`` (or device→device into a device ``out``).
Device memory has no host view, so ``supports_views`` is False.

Without CUDA, ``emulate=True`` backs the same interface with a host numpy
arena (the slicing and copies of :class:`~tiers.base.ArenaTier`), so placement,
eviction and promotion logic can be tested on CPU-only machines; ``stats()``
says ``emulated: True``. The emulation keeps ``supports_views = False`` so code
exercised against it takes the same paths it will take on a GPU.

This module owns the device arena and its copies; it does not own which
objects live here (the tier manager) nor pinned staging buffers (the dram tier).
CuPy is imported lazily: kvpool imports without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from kvpool import errors
from kvpool.objformat import LayerRange, ObjectHeader
from tiers.base import ArenaTier, Extent

if TYPE_CHECKING:
    from kvpool.config import Config, HbmSection

INSTALL_HINT = "pip install 'kvpool[gpu]' (CuPy) to use a real GPU for the hbm tier"
ALIGNMENT = 256  # cudaMalloc's alignment: every object starts on a coalescing boundary
EMULATED_DEVICE = "emulated (no CUDA device)"


def cuda_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device, else why not."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError without a driver; any failure means no GPU
        return f"CUDA is unavailable ({exc})"
    return None if count > 0 else "no CUDA device is visible"


def _is_device_array(obj: Any) -> bool:
    return hasattr(obj, "__cuda_array_interface__")


class HbmTier(ArenaTier):
    """GPU memory tier (or its host emulation); objects are stored whole, as elsewhere."""

    name = "hbm"
    supports_views = False

    def __init__(self, capacity_bytes: int, *, device: int = 0, emulate: bool = True) -> None:
        super().__init__(capacity_bytes, alignment=ALIGNMENT)
        self.device_id = device
        reason = cuda_unavailable_reason()
        if reason is None:
            import cupy

            try:
                self._device: Any = cupy.cuda.Device(device)
                with self._device:
                    self._arena = cupy.empty(self.capacity_bytes, dtype=cupy.uint8)
            except cupy.cuda.runtime.CUDARuntimeError as exc:
                raise errors.TierError(f"hbm: cannot allocate {self.capacity_bytes} bytes "
                                       f"on CUDA device {device}: {exc}") from exc
            except cupy.cuda.memory.OutOfMemoryError as exc:
                raise errors.CapacityError(f"hbm: CUDA device {device} has no room for "
                                           f"{self.capacity_bytes} bytes: {exc}") from exc
            self.emulated = False
            props = cupy.cuda.runtime.getDeviceProperties(device)
            name = props["name"]
            self.device_name = f"cuda:{device} ({name.decode() if isinstance(name, bytes) else name})"
            return
        if not emulate:
            raise errors.TierError(f"hbm: {reason}; {INSTALL_HINT}, "
                                   f"or set tiers.hbm.emulate = true to test without a GPU")
        self._device = None
        self._arena = np.empty(self.capacity_bytes, dtype=np.uint8)
        self._arena[::4096] = 0  # pre-fault, as the dram tier does: puts then run at memcpy speed
        self.emulated = True
        self.device_name = EMULATED_DEVICE
        self.emulation_reason = reason

    @classmethod
    def from_config(cls, section: HbmSection, config: Config) -> HbmTier:
        return cls(section.capacity, device=section.device, emulate=section.emulate)

    # -- bytes ----------------------------------------------------------------------

    def write(self, extent: Extent, offset: int, data: Any) -> None:
        """Copy ``data`` into the arena: host→device, or device→device for a device array."""
        if self.emulated:
            super().write(extent, offset, data)
            return
        self._check_open()
        import cupy

        with self._device:
            if _is_device_array(data):
                src = self._device_bytes(data)
                self._slice(extent, offset, src.nbytes)[:] = src
            else:
                src_host = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
                self._slice(extent, offset, src_host.nbytes).set(src_host)
            # Both copies are queued on the current stream (``set`` from pinned
            # memory returns before the DMA ends); the caller may reuse its
            # buffer as soon as we return.
            cupy.cuda.get_current_stream().synchronize()

    def read_into(self, extent: Extent, offset: int, out: Any) -> None:
        """Fill ``out`` from the arena: device→host, or device→device for a device ``out``."""
        if self.emulated:
            super().read_into(extent, offset, out)
            return
        self._check_open()
        import cupy

        with self._device:
            if _is_device_array(out):
                dst = self._device_bytes(out, writable=True)
                dst[:] = self._slice(extent, offset, dst.nbytes)
                cupy.cuda.get_current_stream().synchronize()
            else:
                mv = memoryview(out).cast("B")
                if mv.readonly:
                    raise errors.OutBufferError("out is read-only")
                dst_host = np.frombuffer(mv, dtype=np.uint8)
                self._slice(extent, offset, dst_host.nbytes).get(out=dst_host)

    def view(self, extent: Extent, offset: int, nbytes: int) -> memoryview:
        raise NotImplementedError("the hbm tier holds device memory; copy it out with read_into")

    def read_layers(self, extent: Extent, header: ObjectHeader, layer_range: LayerRange, out: Any) -> None:
        """Fill ``out`` (host buffer, or a device array on a real GPU) with ``layer_range``."""
        if not _is_device_array(out):
            super().read_layers(extent, header, layer_range, out)
            return
        rng = header.spec.layer_bytes(layer_range)
        nbytes = int(getattr(out, "nbytes", -1))
        if nbytes != rng.nbytes:
            raise errors.OutBufferError(f"out holds {nbytes} bytes, layers need {rng.nbytes}")
        self.read_into(extent, rng.offset, out)

    @staticmethod
    def _device_bytes(arr: Any, *, writable: bool = False) -> Any:
        """A flat uint8 CuPy view of a C-contiguous device array (no copy)."""
        import cupy

        dev = cupy.asarray(arr)
        if not dev.flags.c_contiguous:
            if writable:
                raise errors.OutBufferError("out must be a C-contiguous device array")
            dev = cupy.ascontiguousarray(dev)
        return dev.reshape(-1).view(cupy.uint8)

    # -- lifecycle ------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        stats = {**super().stats(), "emulated": self.emulated, "device": self.device_name}
        if self.emulated:
            stats["emulation_reason"] = self.emulation_reason
        return stats

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        self._arena = None  # frees the device allocation (back to CuPy's pool)
