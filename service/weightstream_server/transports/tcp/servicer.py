"""The tcp transport: StreamTensorsBulk, chunk bytes on a TCP connection to the data port.

The call is the control plane: it is authenticated like every call, runs in a StreamSession (the
checks, --max-streams, the drain, the counting, the end-of-stream line) and its status says how
the stream ended. Its one message announces the data port and a one-time ticket (listener.py);
once the client's connection is admitted, the stream's chunks go out on it as frames
(weightstream.protocol.tcp), and the END frame goes last, after every chunk.

Copies per byte on this side: where every file is local and in the page cache, no slice gathers
rows and there is no server cache, none in this process: the kernel sends the file's pages
(os.sendfile), and the CRC32C comes from the kept ones (checksums.KeptChecksums, one per chunk and
file version); a chunk not checksummed yet is read once into a reused buffer, checksummed and sent
from there. Over TLS every chunk goes through that buffer (the kernel cannot encrypt). Otherwise
(S3, a cold page cache, the cache, gathered slices) the chunks of chunks.serve_chunks are sent from
the memory they lie in, with the CRC32C taken there.

Memory: one chunk-sized buffer per stream, plus the chunk source's read-ahead; a client that reads
slowly holds the sends, never more memory (the kernel's socket buffer is the only queue). A client
that reads nothing for --stall-timeout seconds ends its stream UNAVAILABLE (the stall rule, serving/stalls.py,
with the socket's own timeout as the wait's bound).

Threading: the stream's gRPC worker thread waits for the connection, then sends every frame; the
connection is closed when the call terminates (a callback), after its status went out, so that a
client that sees the connection end can learn why from the call.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import select
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from weightstream.protocol import tcp, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import (
    ClientGone,
    CorruptCheckpoint,
    DataConnectionLost,
    RequestTimeout,
    TcpUnavailable,
)
from weightstream_server.serving.checksums import KeptChecksums
from weightstream_server.serving.reader import open_plan, page_cached, reads_directly, unit_chunks
from weightstream_server.serving.stream_session import Streams, StreamSession
from weightstream_server.storage.file_errors import file_error
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.reads import ChunkPlace
from weightstream_server.transports import rpc
from weightstream_server.transports.tcp.listener import DataPort, Pending, peer_host

logger = logging.getLogger(__name__)

# How long a stream waits for its client's data connection after announcing it.
CONNECT_TIMEOUT_S = 10.0
# CRC32Cs kept per chunk and file version: 4 MiB chunks of 1 TiB of checkpoints.
CHUNK_CHECKSUMS_KEPT = 262_144
_WAIT_POLL_S = 0.25
# Chunks up to this size go out in one send with their header.
SMALL_CHUNK_BYTES = 64 * 1024

# (path, size, fingerprint, file offset, length) of a chunk of a local file.
ChunkKey = tuple[str, int, str, int, int]
_chunk_checksums: KeptChecksums[ChunkKey] = KeptChecksums(CHUNK_CHECKSUMS_KEPT)


class TcpServicer:
    """StreamTensorsBulk. Safe to call from many threads.

    data_port is None when the server has none (every call is then FAILED_PRECONDITION);
    advertise is the (host, port) announced to clients (host "": they dial their own target's host).
    """

    def __init__(self, streams: Streams, data_port: DataPort | None, advertise: tuple[str, int]) -> None:
        self._streams = streams
        self._port = data_port
        self._advertise = advertise

    def StreamTensorsBulk(
        self, request: pb.StreamTensorsBulkRequest, context: grpc.ServicerContext
    ) -> Iterator[pb.StreamTensorsBulkResponse]:
        port = self._port
        if port is None:
            error = TcpUnavailable("this server has no data port (--data-port 0); use StreamTensors")
            rpc.abort(context, self._streams.stats, "StreamTensorsBulk", request.request.model, error)
        connection = CallConnection()
        context.add_callback(connection.close)
        streams = self._streams
        with streams.session(
            context, method="StreamTensorsBulk", kind="tcp stream", model=request.request.model
        ) as session:
            chunk_bytes = session.start(request.request)
            plan = session.plan_reads(chunk_bytes)
            pending = issue(port, context, session.peer)
            try:
                host, announced = self._advertise
                yield pb.StreamTensorsBulkResponse(data_host=host, data_port=announced, ticket=pending.ticket)
            except BaseException:
                port.tickets.withdraw(pending)
                raise
            conn = accept(port, pending, context)
            connection.set(conn)
            sender = FrameSender(
                conn, session.peer, self._streams.settings.stall_timeout, self._streams.stats.stream_stalled
            )
            manifest = session.manifest
            direct = (
                streams.cache is None
                and not session.sends_deltas
                and reads_directly(manifest, plan)
                and page_cached(manifest, plan)
            )
            logger.debug(
                "tcp stream %r from %s: %d tensors, %d bytes, %s",
                session.model_id,
                session.peer,
                session.tensors,
                plan.total_bytes,
                "sent from the page cache" if direct else "sent from the streamer or the cache",
            )
            if direct:
                _send_files(sender, session, chunk_bytes)
            else:
                with session.streamer() as streamer:
                    for chunk in session.chunks(streamer):
                        sender.from_memory(chunk.place, chunk.crc32c, chunk.data, chunk.encoding)
                        session.count_sent(chunk.data.size)
            sender.end()


def _send_files(sender: FrameSender, session: StreamSession, chunk_bytes: int) -> None:
    """Every chunk of the session's plan (local, page-cached files) from its file, checksummed once per file version."""
    manifest, plan = session.manifest, session.plan
    buffer = np.empty(chunk_bytes, dtype=np.uint8)
    record = session.block_recorder()
    with open_plan(manifest, plan) as files:
        for unit in unit_chunks(plan):
            source = manifest.files[unit.file_index]
            fd = files.fd(unit.file_index)
            for file_offset, place in unit.chunks:
                key = (source.path, source.size, source.fingerprint, file_offset, place.length)
                crc = _chunk_checksums.get(key)
                if crc is None or not sender.plain:
                    data = buffer[: place.length]
                    _read_exactly(files, unit.file_index, fd, file_offset, data, session.model_id, source.name)
                    if crc is None:  # a kept one vouches for these bytes too; the client checks them anyway
                        if record is None:
                            crc = wire.crc32c_at(data.ctypes.data, place.length)
                        else:
                            crc = record.checksum(place, data.ctypes.data)
                        _chunk_checksums.put(key, crc)
                    sender.from_memory(place, crc, data)
                else:
                    check = functools.partial(files.check_unchanged, unit.file_index)
                    sender.from_file(place, crc, fd, file_offset, check)
                session.count_sent(place.length)
            session.count_read(unit.length)
        # Before the END frame: a file rewritten meanwhile ends the stream FAILED_PRECONDITION.
        files.check_all_unchanged()
        if record is not None:
            record.commit()


def _read_exactly(
    files: OpenFiles, index: int, fd: int, offset: int, into: np.ndarray, model: str, file_name: str
) -> None:
    done, length = 0, into.size
    view = into.data.cast("B")
    while done < length:
        try:
            n = os.preadv(fd, [view[done:]], offset + done)
        except OSError as exc:
            files.check_unchanged(index)
            raise file_error(exc, f"model {model!r}: file {file_name!r}", listed=True) from exc
        if n == 0:
            files.check_unchanged(index)
            raise CorruptCheckpoint(
                f"model {model!r}: file {file_name!r} ended at byte {offset + done}, {length - done} bytes early"
            )
        done += n


def issue(port: DataPort, context: grpc.ServicerContext, peer: str) -> Pending:
    """A ticket for the call's data connection: from the call's host (and certificate, under mutual TLS)."""
    return port.tickets.issue(peer_host(peer), _call_certificate(context, port))


def accept(port: DataPort, pending: Pending, context: grpc.ServicerContext) -> socket.socket:
    """The data connection that came with pending's ticket (announced on the call); ClientGone if the
    call ended first, RequestTimeout if none came within CONNECT_TIMEOUT_S. The ticket is spent."""
    try:
        conn = _wait_for_connection(pending, context)
    finally:
        conn = port.tickets.withdraw(pending)
    if conn is None:
        if not context.is_active():
            raise ClientGone()
        raise RequestTimeout(
            f"the client did not open its data connection to port {port.port} within {CONNECT_TIMEOUT_S:.0f} s"
        )
    return conn


def _wait_for_connection(pending: Pending, context: grpc.ServicerContext) -> socket.socket | None:
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    while context.is_active():
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn = pending.wait(min(left, _WAIT_POLL_S))
        if conn is not None:
            return conn
    return None


def _call_certificate(context: grpc.ServicerContext, port: DataPort) -> bytes | None:
    """The client certificate the call showed (DER), when the data port asks for one (mutual TLS)."""
    if port.tls is None or port.tls.verify_mode != ssl.CERT_REQUIRED:
        return None
    found = context.auth_context().get("x509_pem_cert")
    pems = [found] if isinstance(found, bytes) else list(found or [])
    for pem in pems:
        return ssl.PEM_cert_to_DER_cert(pem.decode())
    return None


class CallConnection:
    """A stream's data connection, closed when the call terminates (from gRPC's callback thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conn: socket.socket | None = None
        self._closed = False

    def set(self, conn: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._conn = conn
                return
        conn.close()
        raise ClientGone()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(OSError):
                # Wakes a send blocked on a client that stopped reading.
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()


class FrameSender:
    """Writes a stream's frames to its connection; a broken or stalled connection is DataConnectionLost."""

    def __init__(
        self, conn: socket.socket, peer: str, stall_timeout: float, on_stall: Callable[[], None] | None = None
    ) -> None:
        self._conn = conn
        self._peer = peer
        self._stall_timeout = stall_timeout
        # Told when a send outlasts stall_timeout (ServerStats.stream_stalled): the stall rule on the data port.
        self._on_stall = on_stall
        # A plain TCP socket can take file pages from the kernel; a TLS one needs the bytes here.
        self.plain = not isinstance(conn, ssl.SSLSocket)
        self.chunks = 0
        self.nbytes = 0
        try:
            conn.settimeout(stall_timeout)
        except OSError as exc:  # the call ended (and closed the connection) as the stream began
            raise DataConnectionLost(f"the data connection to {peer} closed before the first frame: {exc}") from None

    def from_memory(self, place: ChunkPlace, crc32c: int, data: np.ndarray, encoding: int = 0) -> None:
        """One chunk from memory: a CHUNK frame of its bytes, or a DELTA frame of an encoded payload (encoding set)."""
        name = place.tensor.encode()
        if encoding:
            header = tcp.delta_header(name, place.offset, place.length, crc32c, data.size, encoding)
        else:
            header = tcp.chunk_header(name, place.offset, place.length, crc32c)
        with self._sending():
            if data.size <= SMALL_CHUNK_BYTES:
                self._conn.sendall(header + data.tobytes())  # a second send would cost more than the copy
            else:
                self._conn.sendall(header)
                self._conn.sendall(data.data.cast("B"))
        self._sent(data.size)

    def from_file(
        self, place: ChunkPlace, crc32c: int, fd: int, offset: int, check_unchanged: Callable[[], None]
    ) -> None:
        """place.length bytes of fd from offset, sent by the kernel; a file that ends early is CorruptCheckpoint."""
        header = tcp.chunk_header(place.tensor.encode(), place.offset, place.length, crc32c)
        with self._sending():
            self._conn.sendall(header, socket.MSG_MORE)
            self._sendfile(fd, offset, place.length, check_unchanged)
        self._sent(place.length)

    def raw(self, name: bytes, offset: int, crc32c: int, data: bytes) -> None:
        """One CHUNK frame of data (a file's piece: name is the file's, offset within it)."""
        with self._sending():
            self._conn.sendall(tcp.chunk_header(name, offset, len(data), crc32c), socket.MSG_MORE if self.plain else 0)
            self._conn.sendall(data)
        self._sent(len(data))

    def end(self, crc32c: int = 0) -> None:
        """The END frame (crc32c: a file read's whole-file CRC32C)."""
        with self._sending():
            self._conn.sendall(tcp.end_frame(self.chunks, self.nbytes, crc32c))

    def _sendfile(self, fd: int, offset: int, length: int, check_unchanged: Callable[[], None]) -> None:
        out = self._conn.fileno()
        if out < 0:  # the call ended and closed the connection meanwhile
            raise ConnectionAbortedError("the data connection was closed")
        writable = select.poll()
        writable.register(out, select.POLLOUT)
        done = 0
        while done < length:
            try:
                n = os.sendfile(out, fd, offset + done, length - done)
            except BlockingIOError:
                if not writable.poll(self._stall_timeout * 1000):
                    raise TimeoutError(f"the client took no byte for {self._stall_timeout:.0f} s") from None
                continue
            if n == 0:
                check_unchanged()
                raise CorruptCheckpoint(f"a checkpoint file ended at byte {offset + done}, {length - done} bytes early")
            done += n

    def _sent(self, nbytes: int) -> None:
        self.chunks += 1
        self.nbytes += nbytes

    @contextlib.contextmanager
    def _sending(self) -> Iterator[None]:
        try:
            yield
        except TimeoutError as exc:
            if self._on_stall is not None:
                self._on_stall()
            raise DataConnectionLost(
                f"the client at {self._peer} took nothing for {self._stall_timeout:.0f} s (--stall-timeout) on its "
                f"data connection, after {self.nbytes} bytes; the stream is ended"
            ) from exc
        except OSError as exc:
            raise DataConnectionLost(
                f"the data connection to {self._peer} broke after {self.nbytes} bytes: {exc}"
            ) from exc


def add_to_server(servicer: TcpServicer, server: grpc.Server) -> None:
    """Register StreamTensorsBulk (a generic handler for WeightStreamService)."""
    rpc.register(server, rpc.handler(servicer.StreamTensorsBulk))
