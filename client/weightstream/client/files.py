"""Reading a model's whole files from the server: ListModelFiles and ReadModelFile, each piece checked."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import grpc

from weightstream.client.channels import Channels
from weightstream.client.errors import FailedPreconditionError, IntegrityError, UnavailableError, translated
from weightstream.client.manifest import ModelFileList, files_from_proto
from weightstream.client.transports.tcp import (
    Cut,
    DataPortUnusable,
    FrameReader,
    TcpTransport,
    ended_with_error,
    raise_if_no_data_port,
)
from weightstream.protocol import tcp, wire
from weightstream.v1 import weightstream_pb2 as pb


class RemoteFiles:
    """The files of the server's models, read over the main channel of channels (target names it in errors).

    Thread-safe as the channels are: each read runs its own call.
    """

    def __init__(self, channels: Channels, target: str, *, chunk_bytes: int, timeout: float | None) -> None:
        self._channels = channels
        self._target = target
        self._chunk_bytes = chunk_bytes
        self._timeout = timeout

    def list_files(self, model: str) -> ModelFileList:
        """The files of model the server lets a client read whole: weight files and companion files."""
        with translated(self._target):
            response = self._channels.stub.ListModelFiles(
                pb.ListModelFilesRequest(model=model), timeout=self._timeout, metadata=self._channels.metadata
            )
        return files_from_proto(response)

    def read_file(
        self, model: str, name: str, *, offset: int = 0, revision: str = "", length: int = 0
    ) -> Iterator[tuple[bytes, int | None]]:
        """Yield (data, file_crc32c) pieces of model's file name from offset, in order, each CRC32C-checked.

        file_crc32c is None except on the last piece, where it is the server's CRC32C of the whole
        file from byte 0; a stream that ends without it raises IntegrityError. With length (not 0),
        only that many bytes are read and no piece carries file_crc32c; fewer raise IntegrityError.
        With revision, the server refuses (FailedPreconditionError) if the model's files changed
        since that listing.
        """
        request = pb.ReadModelFileRequest(
            model=model,
            file=name,
            offset=offset,
            revision=revision,
            max_chunk_bytes=self._chunk_bytes,
            length=length,
        )
        where = f"model {model!r}, file {name!r}"
        pieces: Iterator[tuple[int, bytes, int, int | None]] | None = None
        transport = self._channels.data_port()
        if transport is not None:
            try:
                with translated(self._target):
                    pieces = self._data_port_pieces(transport, request, where)
            except DataPortUnusable as exc:
                if transport.fallback is None:
                    raise FailedPreconditionError(f"{where}: the tcp transport cannot be used: {exc}") from None
                transport.fallback.fall_back(str(exc))
        if pieces is None:
            pieces = self._grpc_pieces(request)
        expected = offset
        finished = False
        try:
            with translated(self._target):
                for piece_offset, data, crc, file_crc in pieces:
                    if finished or piece_offset != expected:
                        raise IntegrityError(f"{where}: received bytes at offset {piece_offset}, expected {expected}")
                    if wire.crc32c(data) != crc:
                        raise IntegrityError(
                            f"{where}: CRC32C mismatch in the chunk at offset {piece_offset} "
                            f"({len(data)} bytes); the data was corrupted in transit"
                        )
                    expected += len(data)
                    if length:
                        if expected > offset + length:
                            raise IntegrityError(f"{where}: received bytes past offset {offset + length}")
                        finished = expected == offset + length
                        yield data, None
                        continue
                    finished = file_crc is not None
                    yield data, file_crc
        finally:
            close = getattr(pieces, "close", None)
            if close is not None:
                close()
        if not finished:
            end = f"offset {offset + length}" if length else "the end of the file"
            raise IntegrityError(f"{where}: the stream ended at offset {expected}, before {end}")

    def _grpc_pieces(self, request: pb.ReadModelFileRequest) -> Iterator[tuple[int, bytes, int, int | None]]:
        """(offset, data, CRC32C, the whole file's CRC32C on the last piece of a read to the end) over gRPC."""
        call = self._channels.stub.ReadModelFile(request, metadata=self._channels.metadata)
        try:
            for message in call:
                data = message.data  # each access of a protobuf bytes field makes a new copy
                whole = message.file_crc32c if message.HasField("file_crc32c") else None
                yield message.offset, data, message.crc32c, whole
        finally:
            call.cancel()

    def _data_port_pieces(
        self, transport: TcpTransport, request: pb.ReadModelFileRequest, where: str
    ) -> Iterator[tuple[int, bytes, int, int | None]]:
        """The call opened and its data connection admitted (DataPortUnusable if not), then its pieces."""
        ask = pb.ReadModelFileRequest()
        ask.CopyFrom(request)
        ask.data_port = True
        call = self._channels.stub.ReadModelFile(ask, metadata=self._channels.metadata)
        try:
            try:
                announcement = next(call)
            except StopIteration:
                raise IntegrityError(f"{where}: the read ended before it announced its data port") from None
            except grpc.RpcError as exc:
                raise_if_no_data_port(exc)
                raise
            conn = transport.connect(announcement.data_host, announcement.data_port, announcement.ticket)
        except BaseException:
            call.cancel()
            raise
        return _frames(call, conn, where, to_end=not request.length)


def _frames(
    call: grpc.Call, conn: socket.socket, where: str, *, to_end: bool
) -> Iterator[tuple[int, bytes, int, int | None]]:
    """A file read's frames from conn as pieces; the last one (held back until END) with END's whole-file
    CRC32C on a read to the end. A connection cut before END raises what the call ended with."""
    reader = FrameReader(conn)
    held: tuple[int, bytes, int] | None = None
    try:
        while True:
            try:
                frame = tcp.decode_header(reader.exactly(tcp.HEADER.size))
                if frame.kind == tcp.END:
                    if held is not None:
                        yield (*held, frame.crc32c if to_end else None)
                    elif to_end:
                        raise IntegrityError(f"{where}: the read ended with no bytes")
                    return
                reader.exactly(frame.name_bytes)
                data = reader.payload(frame.length)
            except (Cut, tcp.FrameError) as exc:
                if ended_with_error(call):  # type: ignore[arg-type]
                    raise call from None  # type: ignore[misc]
                raise UnavailableError(f"{where}: the data connection was cut: {exc}") from None
            if held is not None:
                yield (*held, None)
            held = (frame.offset, data, frame.crc32c)
    finally:
        call.cancel()
        conn.close()
