"""Raw memory that one side allocated, and the one way its writers find where to write.

A writer into raw memory by address (a publish part or a relay's buffer, a shared-memory ring slot,
a tier's receive buffer, a delta payload, a client's tensor) holds the Region of the buffer it
writes into and asks it for every destination: Region.at(offset, length) checks the whole range
against the buffer, so a layout that disagrees with the buffer's size, or an offset from the wire
that was not checked, is an error instead of a write past the end. Writers that are handed a
memoryview (reads from files and sockets) write through it, whose slicing is bounded the same way.
Both sides import it.
"""

from __future__ import annotations

from dataclasses import dataclass

from weightstream.protocol import wire


class OutsideRegion(ValueError):
    """A write was asked for outside the buffer it was meant for: a bug, never written."""


@dataclass(frozen=True)
class Region:
    """size bytes of raw memory at address, described by what (named in errors); the owner keeps it alive."""

    address: int
    size: int
    what: str

    def at(self, offset: int, length: int) -> int:
        """The address of the length bytes at offset, which must lie inside the region."""
        if offset < 0 or length < 0 or offset + length > self.size:
            raise OutsideRegion(
                f"{self.what}: bytes {offset} to {offset + length} lie outside its {self.size} bytes; nothing written"
            )
        return self.address + offset

    def view(self, offset: int, length: int) -> memoryview:
        """A writable view of the length bytes at offset, checked as at() does."""
        return wire.memory_at(self.at(offset, length), length)

    def put(self, offset: int, data: bytes | memoryview) -> None:
        """Copy data to offset."""
        self.view(offset, len(data))[:] = data

    def copy_crc32c(self, offset: int, source: int, length: int) -> int:
        """Copy length bytes from source to offset; the CRC32C of the bytes as they landed."""
        return wire.copy_crc32c(self.at(offset, length), source, length)
