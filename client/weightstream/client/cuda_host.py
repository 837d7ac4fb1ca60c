"""Registering host memory with CUDA (cudaHostRegister), so that copies from it to a device are DMA.

The shared-memory transport hands out each ring it maps as a HostRegion; the first CUDA copy out
of it registers it (on that copy's device, so that no other device gets a context), and chunks
then go from the slot straight to the device (one copy), instead of slot -> pinned staging -> device.

The calls go to the CUDA runtime library that torch already loaded in this process, found by its
path in /proc/self/maps, through ctypes: torch's own binding (torch.cuda.cudart) has no
cudaGetLastError, and a refused registration must be cleared, or the next kernel launch check in
torch would report it as its own error. Support is asked for first (device attributes), so that
the usual refusals never happen. Anything missing (no CUDA runtime found, no support, a refusal)
means no registration: the caller keeps its staging path. Registration is best effort by design.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# cudaHostRegister flags and cudaDeviceAttr values (cuda_runtime_api.h, driver_types.h).
HOST_REGISTER_PORTABLE = 0x01
HOST_REGISTER_READ_ONLY = 0x08
DEV_ATTR_HOST_REGISTER_SUPPORTED = 99
DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED = 113
_SUCCESS = 0


@functools.cache
def _runtime() -> ctypes.CDLL | None:
    """The CUDA runtime library loaded in this process (by torch), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = sorted({line.split()[-1] for line in maps.splitlines() if "/libcudart.so" in line})
    for path in paths:
        try:
            library = ctypes.CDLL(path)
            for name in ("cudaHostRegister", "cudaHostUnregister", "cudaGetLastError", "cudaDeviceGetAttribute"):
                getattr(library, name).restype = ctypes.c_int
        except (OSError, AttributeError):
            continue
        library.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        library.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        library.cudaDeviceGetAttribute.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int]
        return library
    return None


def in_use() -> bool:
    """Whether this process has started CUDA (so that registering host memory can pay off)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


class HostRegion:
    """Host memory (address, size) that CUDA copies may read from once registered; registered on first use.

    Ownership: whoever mapped the memory; release() before unmapping it. Used from one thread.
    """

    def __init__(self, address: int, size: int, *, writable: bool) -> None:
        self.address = address
        self.size = size
        self.writable = writable
        self._registered: bool | None = None  # None: not tried yet

    def pinned(self, device: torch.device) -> bool:
        """Whether the region is registered with CUDA, registering it now (on device) if not tried yet."""
        if self._registered is None:
            with torch.cuda.device(device):
                self._registered = register(self.address, self.size, writable=self.writable)
        return self._registered

    def release(self) -> None:
        """Unregister, if registered; the region must not be the source of a copy still in flight."""
        if self._registered:
            unregister(self.address)
        self._registered = None


def register(address: int, size: int, *, writable: bool) -> bool:
    """Register [address, address + size) with CUDA for every device; False (nothing registered) if it cannot be.

    writable: whether the memory is mapped writable; read-only memory needs the device's support
    for cudaHostRegisterReadOnly. The support asked about is the current device's. The caller
    must unregister() before unmapping.
    """
    if not in_use():
        return False
    runtime = _runtime()
    if runtime is None:
        _declined("the CUDA runtime library was not found in this process")
        return False
    device = torch.cuda.current_device()
    if not _attribute(runtime, DEV_ATTR_HOST_REGISTER_SUPPORTED, device):
        _declined(f"device {device} does not support registering host memory")
        return False
    flags = HOST_REGISTER_PORTABLE
    if not writable:
        if not _attribute(runtime, DEV_ATTR_HOST_REGISTER_READ_ONLY_SUPPORTED, device):
            _declined(f"the mapping is read-only and device {device} cannot register read-only memory")
            return False
        flags |= HOST_REGISTER_READ_ONLY
    error = runtime.cudaHostRegister(address, size, flags)
    if error != _SUCCESS:
        runtime.cudaGetLastError()  # clear it: the refusal is handled here, not torch's to report
        _declined(f"cudaHostRegister of {size} bytes failed with CUDA error {error}")
        return False
    return True


def unregister(address: int) -> None:
    """Undo register(address, ...); the memory must not be the source of a copy still in flight."""
    runtime = _runtime()
    if runtime is not None and runtime.cudaHostUnregister(address) != _SUCCESS:
        runtime.cudaGetLastError()
        logger.warning("cudaHostUnregister of the mapping at %#x failed", address)


def _attribute(runtime: ctypes.CDLL, attribute: int, device: int) -> int:
    value = ctypes.c_int(0)
    if runtime.cudaDeviceGetAttribute(ctypes.byref(value), attribute, device) != _SUCCESS:
        runtime.cudaGetLastError()
        return 0
    return value.value


@functools.cache
def _declined(why: str) -> None:
    """Log once per reason: the load goes on through pinned staging buffers."""
    logger.info("shared-memory slots not registered with CUDA, copying through pinned staging: %s", why)
