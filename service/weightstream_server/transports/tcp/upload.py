"""A publish's bytes over the data port: the part's frames received straight into its buffer.

A PublishTensors call whose PublishStart asks for the data port (data_port) is answered first with
the port and a one-time ticket, as a tcp stream is (servicer.issue, servicer.accept: the same
handshake, the same rules for who may present the ticket). The client then writes the part's CHUNK
frames and the END frame (weightstream.protocol.tcp) the other way, client to server. Each chunk's
header and name come first and are checked (revisions.parts.PartInFlight.land) before its
payload is received, straight into its place in the part's buffer: one kernel copy, no buffer in
between, its CRC32C computed piece by piece where it landed (while each piece is in the core's
cache). A DELTA frame (a publish against a delta base) is received into a buffer of its own and
XORed into the part (PartInFlight.land_delta). END carries the chunk and payload byte counts, which
must match what came.

A connection that sends nothing for --stall-timeout seconds ends the publish UNAVAILABLE, as one
that breaks does; either drops the part (and its revision), as on gRPC.
"""

from __future__ import annotations

import functools
import socket
import ssl

import numpy as np

from weightstream.protocol import tcp, wire
from weightstream.protocol.memory import Region
from weightstream_server.errors import DataConnectionLost, InvalidRequest
from weightstream_server.revisions.parts import PartInFlight

# Bytes received at a time into the part, each piece checksummed right after it landed.
RECEIVE_PIECE_BYTES = 1024 * 1024


def receive_part(conn: socket.socket, part: PartInFlight, stall_timeout: float) -> None:
    """Land every frame of conn into part, up to END; raises what a bad frame or connection is."""
    conn.settimeout(stall_timeout)
    reader = _Reader(conn, part.model, stall_timeout)
    payload: np.ndarray | None = None  # a DELTA frame's payload, made at the first one
    while True:
        try:
            frame = tcp.decode_header(reader.exactly(tcp.HEADER.size), deltas=True)
        except tcp.FrameError as exc:
            raise InvalidRequest(f"publish of model {part.model!r}: a bad frame on the data port: {exc}") from None
        if frame.kind == tcp.END:
            if (frame.offset, frame.length) != (part.chunks, part.bytes):
                raise InvalidRequest(
                    f"publish of model {part.model!r}: END says {frame.offset} chunks and {frame.length} bytes, "
                    f"{part.chunks} chunks and {part.bytes} bytes came"
                )
            part.check_complete()
            return
        try:
            name = reader.exactly(frame.name_bytes).decode()
        except UnicodeDecodeError:
            raise InvalidRequest(f"publish of model {part.model!r}: a chunk's tensor name is not UTF-8") from None
        if frame.kind == tcp.DELTA:
            size, encoding = tcp.DELTA_HEADER.unpack(reader.exactly(tcp.DELTA_HEADER.size))
            if size > wire.MAX_CHUNK_BYTES:
                raise InvalidRequest(f"publish of model {part.model!r}: a delta frame of {size} payload bytes")
            if payload is None:
                payload = np.empty(wire.MAX_CHUNK_BYTES, dtype=np.uint8)
            address = Region(int(payload.ctypes.data), payload.size, "a delta frame's payload buffer").at(0, size)
            reader.into(address, size)
            part.land_delta(name, frame.offset, frame.length, frame.crc32c, encoding, address, size)
            continue
        part.land(name, frame.offset, frame.length, frame.crc32c, functools.partial(reader.into, size=frame.length))


class _Reader:
    """Exact reads from the data connection; DataConnectionLost when it ends, fails or stalls first."""

    def __init__(self, conn: socket.socket, model: str, stall_timeout: float) -> None:
        self._conn = conn
        self._model = model
        self._stall_timeout = stall_timeout
        # MSG_WAITALL: one system call per read where the kernel can; TLS sockets take no flags.
        self._flags = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL
        self._small = bytearray(tcp.HEADER.size + tcp.MAX_NAME_BYTES)

    def exactly(self, size: int) -> bytes:
        view = memoryview(self._small)[:size]
        self._fill(view)
        return bytes(view)

    def into(self, address: int, size: int) -> int:
        """Receive size bytes at address; their CRC32C, piece by piece as they landed."""
        view = wire.memory_at(address, size)
        crc = 0
        for start in range(0, size, RECEIVE_PIECE_BYTES):
            piece = min(RECEIVE_PIECE_BYTES, size - start)
            self._fill(view[start : start + piece])
            crc = wire.crc32c_at(address + start, piece, crc)
        return crc

    def _fill(self, view: memoryview) -> None:
        got, size = 0, len(view)
        while got < size:
            try:
                n = self._conn.recv_into(view[got:], size - got, self._flags)
            except TimeoutError:
                raise DataConnectionLost(
                    f"publish of model {self._model!r}: the data connection sent nothing for "
                    f"{self._stall_timeout:.0f} s (--stall-timeout); the publish is dropped"
                ) from None
            except OSError as exc:
                raise DataConnectionLost(
                    f"publish of model {self._model!r}: the data connection broke: {exc}"
                ) from None
            if n == 0:
                raise DataConnectionLost(
                    f"publish of model {self._model!r}: the data connection ended {size - got} bytes into a read"
                )
            got += n
