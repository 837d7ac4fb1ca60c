"""One part of a publish, received: its buffer laid out from the announcement, every chunk checked as it lands.

A part's buffer is allocated with the size its layout (revisions.layout.lay_out) gives and written
only through a Region over it (weightstream.protocol.memory): each chunk's destination is the
tensor's place plus the chunk's offset, checked against the tensor (it comes next, it fits) and then
against the buffer itself, so no chunk, whole or delta, lands outside the memory the part owns.

The revision a part belongs to is assembled by revisions.published.Publisher; a part hands itself
over (finish) or is dropped (fail) through the Assembly the publisher gives it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from weightstream.allocator import PopulateAhead
from weightstream.protocol import deltas as delta_forms
from weightstream.protocol import digests, wire
from weightstream.protocol.memory import Region
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import (
    CorruptCheckpoint,
    InvalidRequest,
    RangeOutOfBounds,
    RequestTimeout,
    ServerError,
)
from weightstream_server.revisions.layout import Layout, Placed
from weightstream_server.revisions.published_source import BLOCK_BYTES, check_blocks, check_blocks_later
from weightstream_server.revisions.store import BlockHashes, Blocks, Revision
from weightstream_server.serving.deltas import ChunkKey, Delta

# What one kept chunk (Part.sent) counts against the budget at least: its key and entry.
KEPT_ENTRY_BYTES = 256


@dataclass
class Part:
    """A part's tensors, placed in its buffer, and what of each arrived."""

    index: int
    tensors: dict[str, Placed]
    buffer: torch.Tensor
    received: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, Blocks] = field(default_factory=dict)
    block_hashes: dict[str, BlockHashes] = field(default_factory=dict)
    hashes: dict[str, bytes] = field(default_factory=dict)
    # Tensors that start as the delta base's bytes (PublishStart.delta_base), and where each one's
    # chunks have reached: they come in order but may skip what did not change. The buffer holds
    # each one's final bytes up to there; the base's bytes beyond (base_bytes, a view of the base's
    # buffer) are copied in as the chunks reach them (take_base), each delta's while it is applied.
    based: dict[str, int] = field(default_factory=dict)
    base_bytes: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # The delta base's revision ("" for a whole publish), and what the publisher sent for the chunks
    # of the based tensors, checked (a delta's payload, None for a chunk sent whole): the server's
    # base -> revision deltas once the revision is taken (serving.deltas.Deltas.keep_published).
    base: str = ""
    sent: dict[ChunkKey, Delta] = field(default_factory=dict)
    sent_bytes: int = 0
    # Each tensor's (CRC32C, BLAKE3 hash) per block as they become known, None until then: taken from
    # the delta base for the blocks no chunk touched, checked on the checking threads as chunks land
    # (landed), the rest at the end (compute_blocks). A publish so pays for the blocks it sent, once,
    # while they are fresh, not for a second pass over the whole part.
    known: dict[str, list[tuple[int, bytes] | None]] = field(default_factory=dict, repr=False)
    checking: list[tuple[str, list[int], Future[list[tuple[int, bytes]]]]] = field(default_factory=list, repr=False)

    @classmethod
    def allocate(cls, index: int, layout: Layout) -> Part:
        """A part with a buffer of exactly the bytes layout needs (at least one)."""
        return cls(index, layout.tensors, torch.empty(max(layout.nbytes, 1), dtype=torch.uint8))

    def region(self, what: str) -> Region:
        """The part's buffer as a Region: the one way its bytes are written."""
        return Region(int(self.buffer.data_ptr()), self.buffer.numel(), what)

    def view(self, tensor: Placed) -> torch.Tensor:
        """tensor's bytes in the buffer, as a tensor of its dtype and shape (checked to lie inside it)."""
        self.region(f"tensor {tensor.name!r}").at(tensor.offset, tensor.nbytes)
        flat = self.buffer[tensor.offset : tensor.offset + tensor.nbytes]
        return flat.view(tensor.dtype.torch).view(tensor.shape)

    def _known(self, tensor: Placed) -> list[tuple[int, bytes] | None]:
        known = self.known.get(tensor.name)
        if known is None:
            known = self.known[tensor.name] = [None] * -(-tensor.nbytes // BLOCK_BYTES)
        return known

    def landed(self, tensor: Placed, start: int, end: int) -> None:
        """Bytes start..end of tensor landed, checked: the blocks they hold whole are checked on a checking
        thread from now; a block they hold in part is left to the end."""
        known = self._known(tensor)
        # The blocks from first to last lie whole in start..end (the tensor's last one may be short).
        first = -(-start // BLOCK_BYTES)
        last = len(known) if end == tensor.nbytes else end // BLOCK_BYTES
        touched = [start // BLOCK_BYTES] if start < end else []
        if end % BLOCK_BYTES and end != tensor.nbytes:
            touched.append(end // BLOCK_BYTES)
        for index in touched:
            if not first <= index < last:
                known[index] = None  # written in part: checked at the end
        if first < last:
            self.region(f"tensor {tensor.name!r}").at(tensor.offset, tensor.nbytes)
            indices = list(range(first, last))
            for index in indices:
                known[index] = None
            self.checking.append(
                (tensor.name, indices, check_blocks_later(self.buffer, tensor.offset, tensor.nbytes, indices))
            )

    def compute_blocks(self) -> None:
        """Each tensor's block CRC32Cs and its BLAKE3 hash (weightstream.protocol.digests): those checked as
        chunks landed or taken from the base, and the others now."""
        for name, indices, future in self.checking:
            known = self.known[name]
            for index, checked in zip(indices, future.result(), strict=True):
                known[index] = checked
        self.checking.clear()
        for tensor in self.tensors.values():
            self.region(f"tensor {tensor.name!r}").at(tensor.offset, tensor.nbytes)
            known = self._known(tensor)
            missing = [i for i, checked in enumerate(known) if checked is None]
            for index, checked in zip(
                missing, check_blocks(self.buffer, tensor.offset, tensor.nbytes, missing), strict=True
            ):
                known[index] = checked
            crcs = tuple(checked[0] for checked in known if checked is not None)
            hashes = tuple(checked[1] for checked in known if checked is not None)
            self.blocks[tensor.name] = crcs
            self.block_hashes[tensor.name] = hashes
            self.hashes[tensor.name] = digests.hash_of_blocks(list(hashes))

    def start_from(self, base: Revision, base_buffer: Callable[[int], torch.Tensor]) -> None:
        """Start the tensors that base holds with the same dtype and shape as base's bytes (and their
        blocks' checks as base's, where it knows them). The bytes are copied in as the part's chunks
        reach them (take_base): a serial copy of the whole base before the first chunk cost a publish
        of a few changed words most of its time."""
        manifest = base.manifest
        for tensor in self.tensors.values():
            entry = manifest.by_name.get(tensor.name)
            if entry is None or entry.dtype != tensor.dtype or entry.shape != tensor.shape:
                continue
            held = base_buffer(entry.file_index)[entry.file_offset : entry.file_offset + entry.nbytes]
            if held.numel() != tensor.nbytes:
                raise ServerError(f"tensor {tensor.name!r}: the delta base holds {held.numel()} bytes of it")
            self.base_bytes[tensor.name] = held
            self.received[tensor.name] = tensor.nbytes
            self.based[tensor.name] = 0
            crcs = base.blocks.get(tensor.name) if base.blocks is not None else None
            hashes = base.block_hashes.get(tensor.name) if base.block_hashes is not None else None
            known = self._known(tensor)
            if crcs is not None and hashes is not None and len(crcs) == len(hashes) == len(known):
                known[:] = list(zip(crcs, hashes, strict=True))
        self.base = manifest.revision

    def take_base(self, tensor: Placed, end: int) -> None:
        """Copy the delta base's bytes of a based tensor from where its chunks have reached up to byte end."""
        start = self.based[tensor.name]
        held = self.base_bytes.get(tensor.name)
        if held is None or end <= start:
            return
        address = self.region(f"tensor {tensor.name!r}").at(tensor.offset + start, end - start)
        ctypes.memmove(address, int(held.data_ptr()) + start, end - start)

    def take_all_base(self) -> None:
        """Copy the rest of every based tensor's base bytes (the chunks are all in); the base is let go."""
        for name, reached in self.based.items():
            tensor = self.tensors[name]
            self.take_base(tensor, tensor.nbytes)
            self.based[name] = max(reached, tensor.nbytes)
        self.base_bytes.clear()


class Assembly(Protocol):
    """What a part in flight reports to the publisher assembling its revision."""

    def drop(self, index: int, reason: str) -> None: ...

    def check_open(self) -> None:
        """Raise (PublishConflict) once the revision was dropped: its parts stop receiving."""

    def hand_over(self, part: Part, payload_bytes: int, alive: Callable[[], bool]) -> pb.PublishResponse: ...


class PartInFlight:
    """One part of a publish whose bytes are landing in its buffer: from PublishRequest chunks
    (receive) or frames on the data port (land, one chunk at a time), then finish (or fail).

    Every chunk is checked as it lands: a tensor announced, the next offset of it (a tensor's chunks
    come in order), within its size, inside the buffer, its CRC32C computed where its bytes landed.
    A mismatch drops the whole part (and revision), so bytes written before a check never count.

    What landed in the tensors that start as the delta base's bytes is kept (Part.sent), checked, up
    to keep_bytes of payloads (a copy of each): past that, the rest is not kept.
    """

    def __init__(self, assembly: Assembly, model: str, part: Part, message_timeout: float, keep_bytes: int = 0) -> None:
        self._assembly = assembly
        self.part = part
        self.model = model
        self._message_timeout = message_timeout
        self._keep_bytes = keep_bytes
        self._region = part.region(f"part {part.index} of a publish of model {model!r}")
        self._codec = delta_forms.Codec()
        self.chunks = 0
        self.bytes = 0
        # Fresh memory: its pages faulted in on a helper thread ahead of the bytes (a trap per 4 KiB
        # page inside every receive otherwise).
        self._ahead = PopulateAhead(self._region.address, self._region.size)

    @contextlib.contextmanager
    def failing(self) -> Iterator[None]:
        """Drop the part (and its revision) if the block raises."""
        try:
            yield
        except BaseException as exc:
            self.fail(exc)
            raise

    def fail(self, exc: BaseException) -> None:
        self._ahead.close()
        self.part.base_bytes.clear()  # the base's memory is not held by a part that failed
        for _, _, future in self.part.checking:
            future.cancel()  # a dropped part's blocks are not checked (its buffer goes once they are done)
        reason = f"part {self.part.index} failed: {exc}" if isinstance(exc, ServerError) else ""
        self._assembly.drop(self.part.index, reason)

    def receive(self, messages: Iterator[pb.PublishRequest]) -> None:
        """Land the chunks of messages up to commit; InvalidRequest names what was dropped when they end
        without one."""
        for message in _bounded(messages, self._message_timeout, self.model):
            if message.HasField("start"):
                raise InvalidRequest(f"publish of model {self.model!r}: a second PublishStart")
            for chunk in message.chunks:
                data = chunk.data  # each read of the field is a copy of its bytes: read once
                length = len(data)
                source = int(np.frombuffer(data, dtype=np.uint8).ctypes.data) if length else 0
                if chunk.encoding:
                    self.land_delta(
                        chunk.tensor, chunk.offset, chunk.length, chunk.crc32c, chunk.encoding, source, length
                    )
                    continue
                # One pass: copied into the part and checksummed where it landed.
                self.land(chunk.tensor, chunk.offset, length, chunk.crc32c, functools.partial(_copy, source, length))
            if message.commit:
                break
        else:
            raise InvalidRequest(
                f"publish of model {self.model!r}: the stream ended without commit after {self.chunks} chunks "
                f"({self.bytes} bytes); part {self.part.index} and its revision are dropped, nothing was published"
            )
        self.check_complete()

    def land(self, name: str, offset: int, length: int, crc32c: int, write: Callable[[int], int]) -> None:
        """One chunk: checked, then written by write(address), which returns the CRC32C of what it wrote."""
        tensor = self._placed(name, offset, length)
        if tensor.name in self.part.based:
            self.part.take_base(tensor, offset)  # what was skipped before this chunk
        self._check(tensor, offset, length, crc32c, write)
        self.part.landed(tensor, offset, offset + length)
        if tensor.name in self.part.based:
            self.part.based[tensor.name] = offset + length
            self._keep_sent(tensor.name, offset, length, None, b"")
        else:
            self.part.received[tensor.name] = offset + length
        self.chunks += 1
        self.bytes += length

    def land_delta(
        self, name: str, offset: int, length: int, crc32c: int, encoding: int, address: int, payload_bytes: int
    ) -> None:
        """One chunk as a delta against the part's base (payload_bytes at address): XORed into the base's
        bytes and checked against crc32c (the new bytes')."""
        if name not in self.part.based:
            raise InvalidRequest(
                f"publish of model {self.model!r}: tensor {name[:200]!r}: a delta, but the tensor is not in the "
                "delta base with this dtype and shape"
            )
        if length > wire.MAX_CHUNK_BYTES:
            raise InvalidRequest(
                f"publish of model {self.model!r}: tensor {name[:200]!r}: a delta for {length} bytes, more than a "
                f"chunk's {wire.MAX_CHUNK_BYTES}"
            )
        tensor = self._placed(name, offset, length)
        base = self._region.address

        def apply(at: int) -> int:
            view = self.part.buffer[at - base : at - base + length]
            try:
                return self._codec.xor_into(view, offset, address, payload_bytes, encoding)
            except delta_forms.DeltaUnusable as exc:
                raise CorruptCheckpoint(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: the delta at byte {offset}: {exc}"
                ) from None

        # The base's bytes up to this chunk's end: those skipped before it, then its own, XORed next
        # while the core's cache holds them.
        self.part.take_base(tensor, offset + length)
        self._check(tensor, offset, length, crc32c, apply)
        self.part.landed(tensor, offset, offset + length)
        self.part.based[tensor.name] = offset + length
        self._keep_sent(tensor.name, offset, length, encoding, wire.memory_at(address, payload_bytes))
        self.chunks += 1
        self.bytes += payload_bytes

    def _keep_sent(
        self, name: str, offset: int, length: int, encoding: int | None, payload: memoryview | bytes
    ) -> None:
        """Keep what landed for a chunk of a based tensor (checked): a delta's payload (copied), or None (whole)."""
        part = self.part
        # Each entry counts at least KEPT_ENTRY_BYTES: a flood of tiny chunks keeps a bounded number.
        cost = max(len(payload), KEPT_ENTRY_BYTES)
        if not self._keep_bytes or part.sent_bytes + cost > self._keep_bytes or not length:
            return
        part.sent[(name, offset, length)] = (encoding, bytes(payload)) if encoding is not None else None
        part.sent_bytes += cost

    def _placed(self, name: str, offset: int, length: int) -> Placed:
        """The announced tensor of a chunk at offset of length bytes, checked to come next and to fit."""
        self._assembly.check_open()
        part, model = self.part, self.model
        tensor = part.tensors.get(name)
        if tensor is None:
            raise InvalidRequest(f"publish of model {model!r}: chunk of tensor {name[:200]!r}, not announced")
        based = part.based.get(tensor.name)
        expected = part.received.get(tensor.name, 0) if based is None else based
        # A tensor starting as the base's bytes may skip ranges (unchanged); others come whole, in order.
        out_of_order = offset < expected if based is not None else offset != expected
        if out_of_order:
            raise InvalidRequest(
                f"publish of model {model!r}: tensor {tensor.name!r}: chunk at byte {offset}, expected "
                f"{'at least ' if based is not None else ''}{expected} (a tensor's chunks come in order)"
            )
        if offset < 0 or length < 0 or offset + length > tensor.nbytes:
            raise RangeOutOfBounds(
                f"publish of model {model!r}: tensor {tensor.name!r}: chunk ends at byte {offset + length}, the "
                f"tensor has {tensor.nbytes} ({tensor.dtype.safetensors} {list(tensor.shape)})"
            )
        return tensor

    def _check(self, tensor: Placed, offset: int, length: int, crc32c: int, write: Callable[[int], int]) -> None:
        if not length:
            if crc32c != 0:
                raise CorruptCheckpoint(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: an empty chunk with a CRC32C"
                )
        elif write(self._region.at(tensor.offset + offset, length)) != crc32c:
            raise CorruptCheckpoint(
                f"publish of model {self.model!r}: tensor {tensor.name!r}: the chunk at byte {offset} does not match "
                "its CRC32C"
            )

    def check_complete(self) -> None:
        """Every announced byte arrived: compute the block CRC32Cs (InvalidRequest names a tensor short)."""
        part = self.part
        for tensor in part.tensors.values():
            got = part.received.get(tensor.name, 0)
            if got != tensor.nbytes:
                raise InvalidRequest(
                    f"publish of model {self.model!r}: tensor {tensor.name!r}: {got} of {tensor.nbytes} bytes arrived "
                    "before commit"
                )
        part.take_all_base()
        part.compute_blocks()

    def finish(self, alive: Callable[[], bool] = lambda: True) -> pb.PublishResponse:
        """Hand the complete part over; the answer once its revision is complete (PublishConflict if it
        failed). alive says whether the part's call still waits: once it does not, the revision is dropped."""
        self._ahead.close()
        return self._assembly.hand_over(self.part, self.bytes, alive)


def _copy(source: int, length: int, address: int) -> int:
    return wire.copy_crc32c(address, source, length)


def _bounded(messages: Iterator[pb.PublishRequest], timeout: float, model: str) -> Iterator[pb.PublishRequest]:
    """messages, each of which must come within timeout of the last (a publisher that stalls is ended).

    They are read on a thread of their own, which stops once this generator is closed.
    """
    arrived: queue.Queue[tuple[pb.PublishRequest | None, BaseException | None]] = queue.Queue(maxsize=2)
    stop = threading.Event()

    def hand_over(item: tuple[pb.PublishRequest | None, BaseException | None]) -> bool:
        while not stop.is_set():
            try:
                arrived.put(item, timeout=0.5)
                return True
            except queue.Full:
                continue
        return False

    def read() -> None:
        try:
            for message in messages:
                if not hand_over((message, None)):
                    return
            hand_over((None, None))
        except BaseException as exc:  # handed to the caller
            hand_over((None, exc))

    threading.Thread(target=read, name="weightstream-publish-reader", daemon=True).start()
    try:
        while True:
            try:
                message, error = arrived.get(timeout=timeout)
            except queue.Empty:
                raise RequestTimeout(
                    f"publish of model {model!r}: no message for {timeout:.0f} s (--stall-timeout); "
                    "the publish is dropped"
                ) from None
            if error is not None:
                raise error
            if message is None:
                return
            yield message
    finally:
        stop.set()
