"""Packing chunks into StreamTensors messages: serialized StreamTensorsResponse bytes of about chunk_bytes each.

Copies per byte on this side: file -> streamer ring (the read), ring -> message (encode_chunk;
the CRC is taken from the ring in place), then gRPC's own buffer to the socket. With a cache,
a unit is copied once more, from the ring into the cache, and chunks are framed from there.
Chunks smaller than half a message are packed together, which copies their few bytes once more.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from weightstream.protocol import framing
from weightstream_server.serving.chunks import ServedChunk


def pack_chunks(chunks: Iterable[ServedChunk], chunk_bytes: int) -> Iterator[tuple[bytes, int]]:
    """(serialized StreamTensorsResponse, payload bytes in it) per message, in the order of chunks.

    Memory: each chunk's data is copied into its message before the next chunk is taken, so a chunk
    need only stay valid until then (as chunks.serve_chunks promises).
    """
    pending: list[bytes] = []
    pending_bytes = 0
    pending_payload = 0
    for chunk in chunks:
        place = chunk.place
        length = chunk.data.size  # the payload: an encoded chunk's is smaller than its bytes
        # The ring slot is reused once the next chunk is taken, so the chunk is framed (copied) now.
        entry = framing.encode_chunk(
            place.tensor, place.offset, chunk.crc32c, chunk.data.data, length=place.length, encoding=chunk.encoding
        )
        if pending and pending_bytes + len(entry) > chunk_bytes:
            yield b"".join(pending), pending_payload
            pending, pending_bytes, pending_payload = [], 0, 0
        if len(entry) >= chunk_bytes // 2:
            yield entry, length
            continue
        pending.append(entry)
        pending_bytes += len(entry)
        pending_payload += length
    if pending:
        yield b"".join(pending), pending_payload
