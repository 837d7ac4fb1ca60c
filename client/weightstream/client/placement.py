"""Where chunks are placed: each chunk's bytes are written straight into its destination tensor.

A Destination is one tensor being filled. Its bytes are written through a flat uint8 view of the
tensor itself when the tensor is contiguous (and of the bytes' dtype), so a CPU parameter receives
each byte with exactly one copy (from the received message into the parameter). A non-contiguous
target, one of another dtype, or several views to fill, go through a contiguous staging tensor,
copied (and converted) once more when complete.

CUDA destinations go through a small ring of pinned host buffers: the chunk is copied into a
pinned buffer, then to the device with a non-blocking copy on a side stream, so the next chunk is
received while the previous one is in flight. A chunk whose memory is already registered with
CUDA (a shared-memory slot, ChunkRef.region) is copied to the device directly, one copy; its
memory must then stay until settle() has waited for those copies. A tensor is handed out only
after its copies have finished.

Concurrency: placers and destinations are used by one thread, the one reading the stream.
"""

from __future__ import annotations

import ctypes

import torch

from weightstream.client.cuda_host import HostRegion
from weightstream.client.errors import IntegrityError
from weightstream.client.ranges import RangeSet
from weightstream.protocol import wire
from weightstream.protocol.memory import Region


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes (shares its memory)."""
    return tensor.reshape(-1).view(torch.uint8)


class Destination:
    """One tensor being filled, and which of its bytes have landed.

    The bytes are the checkpoint's, of dtype (default: target's). They are written straight into
    target when it is contiguous and of that dtype, so a CPU parameter receives each byte with
    exactly one copy. Otherwise (a strided view, another dtype, or more views to fill: also) they
    land in a contiguous staging buffer on target's device, and finish() copies them into target
    and each of also, converting the dtype on that copy. Every view holds as many elements as the
    bytes do.
    """

    def __init__(
        self,
        name: str,
        target: torch.Tensor,
        *,
        dtype: torch.dtype | None = None,
        also: tuple[torch.Tensor, ...] = (),
    ) -> None:
        self.name = name
        self.target = target
        self.dtype = dtype or target.dtype
        self.also = also
        self.nbytes = target.numel() * self.dtype.itemsize
        if target.is_contiguous() and self.dtype == target.dtype and not also:
            self._staging: torch.Tensor | None = None
            self.buffer = byte_view(target)
        else:
            self._staging = torch.empty(self.nbytes, dtype=torch.uint8, device=target.device)
            self.buffer = self._staging
        # Whether the bytes land in a staging buffer that finish() copies into target and also.
        self.staged = self._staging is not None
        self.landed = RangeSet(self.nbytes)
        self.written = False

    @property
    def complete(self) -> bool:
        return self.landed.complete

    def finish(self) -> None:
        """Make the target (and also) hold the landed bytes (copies out of staging, if any)."""
        if self._staging is not None:
            landed = self._staging.view(self.dtype)
            for view in (self.target, *self.also):
                view.copy_(landed.view(view.shape))
            self._staging = None


class CpuPlacer:
    """Writes chunks into host memory with one copy each, checksummed where they landed."""

    def place(self, dest: Destination, offset: int, address: int, length: int, region: HostRegion | None = None) -> int:
        """Copy length bytes at address into dest at offset; their CRC32C as they landed.

        The caller keeps the source alive, and checks the CRC32C before it counts the bytes as landed.
        """
        into = Region(dest.buffer.data_ptr(), dest.nbytes, f"tensor {dest.name!r}")
        return into.copy_crc32c(offset, address, length)

    def finish(self, dest: Destination) -> None:
        dest.finish()

    def settle(self) -> None:
        pass  # every copy is done when place() returns

    def close(self) -> None:
        pass


class CudaPlacer:
    """Writes chunks into one CUDA device through pinned staging buffers and non-blocking copies."""

    def __init__(self, device: torch.device, staging_bytes: int, depth: int = 4) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        # Destinations were allocated on the current stream; the side stream must not run ahead of that.
        self.stream.wait_stream(torch.cuda.current_stream(device))
        self.staging = [torch.empty(staging_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.events: list[torch.cuda.Event | None] = [None] * depth
        self.next = 0
        # Whether copies straight from the caller's (registered) memory were queued since settle().
        self.direct = False

    def place(self, dest: Destination, offset: int, address: int, length: int, region: HostRegion | None = None) -> int:
        """Copy length bytes at address into dest at offset: straight from region if CUDA registered it,
        else through the pinned ring. Their CRC32C, read from the source before the copies are queued
        (the device's copy is not read back); the caller checks it before it counts the bytes as landed."""
        crc = wire.crc32c_at(address, length)
        if region is not None and region.pinned(self.device):
            # One copy: registered host memory -> device, asynchronous on the side stream.
            source_bytes = torch.frombuffer((ctypes.c_char * length).from_address(address), dtype=torch.uint8)
            with torch.cuda.stream(self.stream):
                dest.buffer[offset : offset + length].copy_(source_bytes, non_blocking=True)
            self.direct = True
            return crc
        source, total = address, length
        size = self.staging[0].numel()
        for start in range(0, total, size):
            length = min(size, total - start)
            slot = self.next
            self.next = (slot + 1) % len(self.staging)
            event = self.events[slot]
            if event is not None:
                event.synchronize()  # the slot's previous copy to the device is done
            staging = self.staging[slot]
            # Copy 1 of 2: received bytes -> pinned host memory.
            ctypes.memmove(staging.data_ptr(), source + start, length)
            at = offset + start
            with torch.cuda.stream(self.stream):
                # Copy 2 of 2: pinned host -> device, asynchronous on the side stream.
                dest.buffer[at : at + length].copy_(staging[:length], non_blocking=True)
                recorded = torch.cuda.Event()
                recorded.record(self.stream)
            self.events[slot] = recorded
        return crc

    def finish(self, dest: Destination) -> None:
        self.stream.synchronize()
        dest.finish()
        # Later work on the current stream (the caller's) sees the finished bytes.
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def settle(self) -> None:
        """Wait for the direct copies queued since the last settle(): their source memory may go now."""
        if self.direct:
            self.stream.synchronize()
            self.direct = False

    def close(self) -> None:
        self.stream.synchronize()


Placer = CpuPlacer | CudaPlacer


class Placers:
    """One placer per device, made on first use."""

    def __init__(self, staging_bytes: int) -> None:
        self._staging_bytes = staging_bytes
        self._by_device: dict[torch.device, Placer] = {}

    def for_tensor(self, tensor: torch.Tensor) -> Placer:
        device = tensor.device
        placer = self._by_device.get(device)
        if placer is None:
            if device.type == "cpu":
                placer = CpuPlacer()
            elif device.type == "cuda":
                placer = CudaPlacer(device, self._staging_bytes)
            else:
                raise IntegrityError(f"cannot place tensor bytes on device {device}")
            self._by_device[device] = placer
        return placer

    def settle(self) -> None:
        """Wait until no copy reads the memory of the chunks placed so far (before it is given back)."""
        for placer in self._by_device.values():
            placer.settle()

    def close(self) -> None:
        for placer in self._by_device.values():
            placer.close()
