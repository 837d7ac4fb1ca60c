"""XOR deltas, written once for every side that makes or applies them (weightstream.v1 ChunkEncoding).

A delta stands for a chunk's new bytes as the XOR of them with a base revision's bytes at the same
place. CHUNK_ENCODING_XOR_ZSTD: a zstd frame (its content size written) of the whole XOR.
CHUNK_ENCODING_SPARSE_XOR_ZSTD: a zstd frame of the XOR's nonzero words only: COUNT (how many),
then that many gaps (uint32, little-endian: the first word's index, then each one's distance from
the one before, never 0), then the words (little-endian). A word is word_bytes(offset, length)
bytes, and the whole is never longer than the chunk (else the dense form is smaller).

encode picks the cheapest form for an XOR (or None: send the bytes themselves); xor_into applies
a payload to the bytes a destination holds, checking that it decodes to what its form promises
(DeltaUnusable otherwise, the destination untouched). The server encodes what it sends to
updating clients and applies what publishers send; clients apply and publishers encode. Both use
torch and numpy ops (no per-element Python). The caller checks the result against the chunk's CRC32C.

Concurrency: a Codec (a zstd compressor, decompressor and scratch buffer) belongs to one thread.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import torch
import zstandard

from weightstream.protocol import wire
from weightstream.v1 import weightstream_pb2 as pb

XOR_ZSTD = pb.CHUNK_ENCODING_XOR_ZSTD
SPARSE_XOR_ZSTD = pb.CHUNK_ENCODING_SPARSE_XOR_ZSTD
ENCODINGS = frozenset((XOR_ZSTD, SPARSE_XOR_ZSTD))
COUNT = struct.Struct("<I")
GAP_BYTES = 4
ZSTD_LEVEL = 1
# An XOR with more than this share of nonzero bytes is not worth compressing: the chunk goes whole.
DENSE = 0.25
# A delta is sent only when its payload is at most this share of the chunk's bytes.
WORTH = 0.75
# The sparse form is used when its words and gaps, before compression, are at most this share of the chunk.
SPARSE = 0.25


class DeltaUnusable(ValueError):
    """A delta payload that does not decode to what its form promises (corrupt on the way, or not zstd)."""


def word_bytes(offset: int, length: int) -> int:
    """The sparse form's word size for a chunk at offset of length bytes: 2 when both are even, else 1."""
    return 2 if offset % 2 == 0 and length % 2 == 0 else 1


def word_type(offset: int, length: int) -> type[np.integer]:
    """The numpy type of the sparse form's words for a chunk at offset of length bytes."""
    return np.int16 if word_bytes(offset, length) == 2 else np.uint8


def changed_words(new: np.ndarray, old: np.ndarray, offset: int) -> np.ndarray:
    """Where the words of a chunk at offset whose bytes are new differ from its base's old (flat uint8
    arrays of one length), ascending: one comparison of the two, then numpy's search of the booleans
    (4 MiB of bfloat16 words, 2% changed: 1.9 ms here, against 2.9 ms to XOR them and search the XOR)."""
    kind = word_type(offset, new.size)
    return np.flatnonzero(new.view(kind) != old.view(kind))


def sparse_bytes(count: int, word: int) -> int:
    """The decoded size of a sparse delta of count words of word bytes."""
    return COUNT.size + count * (GAP_BYTES + word)


class Decoded:
    """A delta, decoded and checked against its chunk: what to XOR into the chunk's bytes."""

    __slots__ = ("dense", "length", "places", "values")

    def __init__(
        self,
        length: int,
        *,
        dense: torch.Tensor | None = None,
        places: np.ndarray | None = None,
        values: np.ndarray | None = None,
    ) -> None:
        self.length = length
        # The whole XOR (flat uint8), or the places of its nonzero words (ascending) and the words.
        self.dense = dense
        self.places = places
        self.values = values

    def xor_into(self, view: torch.Tensor) -> int:
        """view (the chunk's bytes, flat uint8, length of them) ^= this delta; the CRC32C of the result."""
        if view.device.type != "cpu":
            if self.dense is not None:
                view.bitwise_xor_(self.dense.to(view.device))
            elif self.places is not None and self.values is not None:
                on = view.view(torch.int16 if self.values.dtype == np.int16 else torch.uint8)
                at = torch.from_numpy(self.places).to(view.device)
                on[at] = on[at] ^ torch.from_numpy(self.values).to(view.device)
            landed = view.cpu()
            return wire.crc32c_at(landed.data_ptr(), landed.numel())
        address, length = view.data_ptr(), view.numel()
        if self.dense is not None:
            # Piece by piece: each is checksummed while the XOR has it in the core's cache, and a piece
            # this size is below torch's grain for splitting an operation over threads (which on a
            # busy host cost more than the XOR itself).
            words = torch.int64 if address % 8 == 0 and length % 8 == 0 else torch.uint8
            xor = self.dense
            crc = 0
            for start in range(0, length, wire.CACHE_PIECE_BYTES):
                end = min(length, start + wire.CACHE_PIECE_BYTES)
                view[start:end].view(words).bitwise_xor_(xor[start:end].view(words))
                crc = wire.crc32c_at(address + start, end - start, crc)
            return crc
        if self.places is None or self.values is None or not self.places.size:
            return wire.crc32c_at(address, length)
        # numpy on the host: its gather and scatter run on this thread, where torch's would wake its
        # thread pool for every chunk (slower here than the work, on a host whose cores are busy).
        # One scatter, then one checksum: in pieces, the two ran no faster end to end, since each
        # piece's calls wait again for the interpreter's lock that the stream's thread holds.
        target = view.numpy().view(self.values.dtype)
        target[self.places] = np.bitwise_xor(target[self.places], self.values)
        return wire.crc32c_at(address, length)


class Codec:
    """One thread's zstd contexts and scratch buffer, made on first use."""

    def __init__(self) -> None:
        self._compressor: zstandard.ZstdCompressor | None = None
        self._decompressor: zstandard.ZstdDecompressor | None = None
        self._scratch: torch.Tensor | None = None

    def encode(self, xor: torch.Tensor, offset: int) -> tuple[int, bytes] | None:
        """The cheapest delta of a chunk at offset whose XOR with its base is xor (flat uint8, on the host):
        (encoding, payload), or None when the chunk's bytes themselves are cheaper. A few samples of xor
        decide first whether it is worth the work: an XOR mostly nonzero costs them only."""
        # numpy, on this thread: torch's nonzero and diff wake its thread pool for every chunk, which
        # cost ten times the work on a host whose cores are busy (4 MiB: 32 ms against 3.5 ms here).
        length = xor.numel()
        if not length or _sampled_share(xor) > DENSE:
            return None
        words = xor.numpy().view(word_type(offset, length))
        where = _nonzero(words)
        return self._cheapest(where, lambda: words[where], lambda: xor.numpy(), length, words.itemsize)

    def encode_between(
        self, new: np.ndarray, old: np.ndarray, where: np.ndarray, offset: int, scratch: np.ndarray
    ) -> tuple[int, bytes] | None:
        """As encode, for a chunk at offset whose bytes are new and its base's old (flat uint8 arrays of one
        length), which differ at the words where (changed_words): the XOR is made only where the form
        needs it (the dense form's, in scratch), not found by a pass over a whole one first."""
        length = new.size
        kind = word_type(offset, length)
        return self._cheapest(
            where,
            lambda: np.bitwise_xor(new.view(kind)[where], old.view(kind)[where]),
            lambda: np.bitwise_xor(new, old, out=scratch[:length]),
            length,
            np.dtype(kind).itemsize,
        )

    def _cheapest(
        self,
        where: np.ndarray,
        values: Callable[[], np.ndarray],
        xor: Callable[[], np.ndarray],
        length: int,
        word: int,
    ) -> tuple[int, bytes] | None:
        """The cheapest form of a delta whose nonzero words lie at where: sparse (values: the words), dense
        (xor: the whole XOR), or None."""
        if where.size * word > DENSE * length:
            return None
        if sparse_bytes(where.size, word) <= SPARSE * length:
            gaps = np.diff(where, prepend=0).astype(np.uint32)
            raw = b"".join((COUNT.pack(where.size), gaps.tobytes(), values().tobytes()))
            encoding, payload = SPARSE_XOR_ZSTD, self._compress(raw)
        else:
            encoding, payload = XOR_ZSTD, self._compress(xor().data)
        return (encoding, payload) if len(payload) <= WORTH * length else None

    def xor_into(self, view: torch.Tensor, offset: int, address: int, payload_bytes: int, encoding: int) -> int:
        """view (the destination's bytes of a chunk at offset, flat uint8) ^= the delta at address; the
        CRC32C of the result (DeltaUnusable, view untouched, when the delta does not decode)."""
        return self.decode(view.numel(), offset, address, payload_bytes, encoding).xor_into(view)

    def decode(
        self, length: int, offset: int, address: int, payload_bytes: int, encoding: int, *, own: bool = False
    ) -> Decoded:
        """The delta at address for a chunk at offset of length bytes, checked and ready to apply; it
        lies in this Codec's scratch buffer (valid until its next use) unless own, when it is a copy
        of its own (for another thread to apply)."""
        if payload_bytes > length:
            # No delta larger than its chunk is ever worth sending (WORTH): one is refused unread.
            raise DeltaUnusable(f"a delta of {payload_bytes} payload bytes for a chunk of {length}")
        if encoding == SPARSE_XOR_ZSTD:
            return self._decode_sparse(length, offset, address, payload_bytes, own)
        if encoding == XOR_ZSTD:
            xor = self.decompress(address, payload_bytes, exactly=length)
            return Decoded(length, dense=xor.clone() if own else xor)
        raise DeltaUnusable(f"encoding {encoding} is not a delta")

    def _decode_sparse(self, length: int, offset: int, address: int, payload_bytes: int, own: bool) -> Decoded:
        word = word_bytes(offset, length)
        words = length // word
        raw = self.decompress(address, payload_bytes, most=min(sparse_bytes(words, word), length))
        if raw.numel() < COUNT.size:
            raise DeltaUnusable("a sparse delta shorter than its count")
        (count,) = COUNT.unpack(_bytes_of(raw[: COUNT.size]))
        if count > words or raw.numel() != sparse_bytes(count, word):
            raise DeltaUnusable(f"a sparse delta of {raw.numel()} bytes does not hold {count} words of {word} bytes")
        if not count:
            return Decoded(length)
        start = COUNT.size
        gaps = raw[start : start + GAP_BYTES * count].numpy().view(np.uint32)
        if (count > 1 and not bool(gaps[1:].all())) or int(gaps[0]) >= words:
            raise DeltaUnusable("a sparse delta's words are not in order")
        places = np.cumsum(gaps, dtype=np.int64)
        if int(places[-1]) >= words:
            raise DeltaUnusable(f"a sparse delta's word {int(places[-1])} lies beyond the chunk's {words}")
        values = raw[start + GAP_BYTES * count :].numpy().view(np.int16 if word == 2 else np.uint8)
        return Decoded(length, places=places, values=values.copy() if own else values)

    def decompress(self, address: int, payload_bytes: int, *, exactly: int = -1, most: int = 0) -> torch.Tensor:
        """What a zstd frame at address holds, in the scratch buffer (valid until its next use): exactly
        that many bytes, or at most `most`; DeltaUnusable otherwise."""
        payload = wire.memory_at(address, payload_bytes)
        try:
            stated = zstandard.frame_content_size(payload)
        except zstandard.ZstdError as exc:
            raise DeltaUnusable(f"not a zstd frame: {exc}") from None
        if stated < 0 or (exactly >= 0 and stated != exactly) or stated > max(exactly, most):
            raise DeltaUnusable(f"the frame holds {stated} bytes, not what the chunk takes")
        out = self._scratch_of(stated)
        target = wire.memory_at(out.data_ptr(), stated) if stated else None
        got = 0
        if self._decompressor is None:
            self._decompressor = zstandard.ZstdDecompressor()
        try:
            with self._decompressor.stream_reader(payload) as reader:
                while target is not None and got < stated:
                    n = reader.readinto(target[got:])
                    if not n:
                        break
                    got += n
                extra = reader.read(1)
        except zstandard.ZstdError as exc:
            raise DeltaUnusable(f"the frame does not decode: {exc}") from None
        if got != stated or extra:
            raise DeltaUnusable(f"the frame decoded to {'more than ' if extra else ''}{got} bytes, not {stated}")
        return out

    def _compress(self, data: bytes | memoryview) -> bytes:
        if self._compressor is None:
            self._compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
        return self._compressor.compress(data)

    def _scratch_of(self, length: int) -> torch.Tensor:
        if self._scratch is None or self._scratch.numel() < length:
            self._scratch = torch.empty(max(length, wire.DEFAULT_CHUNK_BYTES), dtype=torch.uint8)
        return self._scratch[:length]


# An XOR is sampled at this many places, this many bytes each, before it is encoded.
SAMPLES = 4
SAMPLE_BYTES = 16 * 1024


def sample_starts(length: int) -> tuple[int, list[int]]:
    """(sample size, where each of SAMPLES samples of length bytes starts), spread evenly."""
    sample = min(SAMPLE_BYTES, length)
    return sample, sorted({(length - sample) * i // max(1, SAMPLES - 1) for i in range(SAMPLES)})


def dense(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether new XOR old (flat uint8 host tensors of one length) is too dense for a delta, by samples
    alone: a chunk whose every element changed costs a few small XORs, not a whole one."""
    return dense_between(new.numpy(), old.numpy())


def dense_between(new: np.ndarray, old: np.ndarray) -> bool:
    """dense, for flat uint8 numpy arrays of one length."""
    sample, starts = sample_starts(new.size)
    nonzero = sum(int(np.count_nonzero(new[s : s + sample] != old[s : s + sample])) for s in starts)
    return nonzero > DENSE * sample * len(starts)


def _sampled_share(xor: torch.Tensor) -> float:
    """The share of nonzero bytes in SAMPLES windows spread over xor."""
    sample, starts = sample_starts(xor.numel())
    data = xor.numpy()
    nonzero = sum(int(np.count_nonzero(data[start : start + sample])) for start in starts)
    return nonzero / (sample * len(starts))


def _nonzero(words: np.ndarray) -> np.ndarray:
    """The indices of words' nonzero elements, ascending (int64). Through a mask of booleans: numpy
    finds the true ones of a boolean array about twice as fast as the nonzero ones of an integer array,
    and faster than looking at eight bytes together first (4 MiB of bfloat16 words, 2% changed: 1.6 ms
    against 2.9 ms and 3.9 ms here), whatever share of them is nonzero."""
    return np.flatnonzero(words != 0)


def _view_of(tensor: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, without a copy (valid while the tensor is)."""
    size = tensor.numel() * tensor.element_size()
    return wire.memory_at(tensor.data_ptr(), size)


def _bytes_of(tensor: torch.Tensor) -> bytes:
    return bytes(_view_of(tensor.contiguous()))
