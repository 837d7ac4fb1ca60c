"""The tcp transport: chunk bytes read from a TCP (or TLS) connection to the server's data port.

A StreamTensorsBulk call (the control plane: authenticated, resumable, its status how the stream
ended) announces the data port and a one-time ticket; the client connects, shows the ticket, and
reads the stream's frames (weightstream.protocol.tcp). Each chunk's header comes first, so its
bytes are received straight where they belong: the load's land() gives the address of a CPU
destination's bytes and recv_into writes there, one kernel copy, no buffer in between; the CRC32C
is computed where the bytes landed, piece by piece as they arrive (while each piece is still in
the core's cache), and checked by the session: a chunk that fails it stays missing and is asked
for again. Chunks land() declines (CUDA destinations, ranges that already hold checked
bytes) are received into one buffer of the stream's, registered with CUDA when CUDA is in use, and
placed from there as on the other transports.

A connection that ends without the END frame was cut: the stream then raises what the call ended
with (the server's status, or CANCELLED after a cancel) or, when the call says nothing within
CALL_END_GRACE_S, TransportError (UNAVAILABLE): the load resumes either way.

Falling back: with transport="auto" a stream whose server has no data port (FAILED_PRECONDITION, or
UNIMPLEMENTED from an older server), or whose data port cannot be reached, refuses the ticket or
fails the TLS handshake within CONNECT_TIMEOUT_S, goes over gRPC instead, and so does every later
stream of the client (Fallback logs one INFO line). With transport="tcp" those are
FailedPreconditionError.

Memory: the socket's buffers and, for chunks land() declines, one buffer of the largest chunk size.

Concurrency: as for every transport, one stream per thread, each generator used by one thread;
StreamCancel shuts the connection down from any thread, which wakes the stream's receive.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import socket
import ssl
import threading
from collections.abc import Sequence

import grpc

from weightstream.client import cuda_host
from weightstream.client.errors import FailedPreconditionError, IntegrityError, UnavailableError
from weightstream.client.transports.base import (
    Batches,
    ChunkRef,
    Landing,
    StreamCancel,
    TransportError,
    method_path,
)
from weightstream.client.transports.call_reader import CallReader
from weightstream.client.transports.grpc_stream import GrpcTransport
from weightstream.protocol import tcp, wire
from weightstream.protocol.names import TransportName
from weightstream.v1 import weightstream_pb2 as pb

logger = logging.getLogger(__name__)

STREAM_TENSORS_BULK_METHOD = method_path("StreamTensorsBulk")
# Connecting, the TLS handshake and the server's answer to the ticket, together.
CONNECT_TIMEOUT_S = 3.0
# How long a stream whose connection was cut waits for the call to say why.
CALL_END_GRACE_S = 5.0
# Bytes received at a time into a destination, each piece checksummed right after it landed.
# Larger than wire.CACHE_PIECE_BYTES: every receive is a system call, and a receiver that drains
# its socket in small pieces makes the sender's kernel work harder; still well under a core's L2.
RECEIVE_PIECE_BYTES = 1024 * 1024


class Fallback:
    """Whether a client's tcp streams gave up on the data port (auto), shared by all of them. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.why: str | None = None

    def fall_back(self, why: str) -> None:
        with self._lock:
            if self.why is not None:
                return
            self.why = why
        logger.info("data port not used, streaming over gRPC: %s", why)


class DataPortUnusable(Exception):
    """The data port cannot serve this client (see the module docstring: falling back)."""


class Cut(Exception):
    """The data connection ended or failed before its END frame."""


class TcpTransport:
    """StreamTensorsBulk on one channel, its chunks read from the data port.

    target_host is dialled when the server announces no host; tls (a client context with the
    channel's CA and certificate) wraps the data connection when the channel runs TLS, checked
    against server_hostname (the name the channel checks). fallback is None for transport="tcp".
    """

    def __init__(
        self,
        channel: grpc.Channel,
        *,
        target_host: str,
        tls: ssl.SSLContext | None,
        server_hostname: str | None,
        fallback: Fallback | None,
    ) -> None:
        self._method: grpc.UnaryStreamMultiCallable[pb.StreamTensorsBulkRequest, pb.StreamTensorsBulkResponse]
        self._method = channel.unary_stream(
            STREAM_TENSORS_BULK_METHOD,
            request_serializer=pb.StreamTensorsBulkRequest.SerializeToString,
            response_deserializer=pb.StreamTensorsBulkResponse.FromString,
        )
        self._grpc = GrpcTransport(channel)
        self._target_host = target_host
        self._tls = tls
        self._server_hostname = server_hostname
        self._fallback = fallback

    @property
    def name(self) -> TransportName:
        return "grpc" if self._fallback is not None and self._fallback.why is not None else "tcp"

    def stream(
        self,
        request: pb.StreamTensorsRequest,
        metadata: Sequence[tuple[str, str]],
        cancel: StreamCancel,
        land: Landing | None = None,
    ) -> Batches:
        """Chunks of request, one batch per chunk; in place where land() allows, else in the stream's buffer."""
        if self.name == "grpc":
            yield from self._grpc.stream(request, metadata, cancel, land)
            return
        call = self._method(pb.StreamTensorsBulkRequest(request=request), metadata=tuple(metadata))
        cancel.on_cancel(call.cancel)
        messages = CallReader[pb.StreamTensorsBulkResponse](call, cancel, name="weightstream-tcp-call")
        conn: socket.socket | None = None
        buffer: _Buffer | None = None
        try:
            try:
                conn = self._open(messages, request.model)
            except DataPortUnusable as exc:
                if self._fallback is None:
                    raise FailedPreconditionError(
                        f"model {request.model!r}: the tcp transport cannot be used: {exc}"
                    ) from None
                self._fallback.fall_back(str(exc))
            if conn is None:
                call.cancel()
                messages.close()
                yield from self._grpc.stream(request, metadata, cancel, land)
                return
            opened = conn
            cancel.on_cancel(lambda: _shut(opened))
            buffer = _Buffer()
            yield from _receive(conn, land, buffer, messages, request.model)
        finally:
            call.cancel()
            messages.close()
            if conn is not None:
                conn.close()
            if buffer is not None:
                buffer.close()

    def _open(self, messages: CallReader[pb.StreamTensorsBulkResponse], model: str) -> socket.socket:
        """The admitted data connection of the call's announcement; DataPortUnusable when there is none to be had."""
        try:
            announcement = next(messages)
        except StopIteration:
            raise IntegrityError(f"model {model!r}: the tcp stream ended before it announced its data port") from None
        except grpc.RpcError as exc:
            raise_if_no_data_port(exc)
            raise
        return self.connect(announcement.data_host, announcement.data_port, announcement.ticket)

    def connect(self, data_host: str, data_port: int, ticket: bytes) -> socket.socket:
        """A data connection to the port a call announced, admitted with its ticket (DataPortUnusable if not)."""
        host = data_host or self._target_host
        address = f"[{host}]:{data_port}" if ":" in host else f"{host}:{data_port}"
        if not host or not data_port or len(ticket) != tcp.TICKET_BYTES:
            raise DataPortUnusable(f"the server announced no usable data port ({address!r})")
        try:
            raw = socket.create_connection((host, data_port), timeout=CONNECT_TIMEOUT_S)
        except OSError as exc:
            raise DataPortUnusable(f"cannot connect to the data port {address}: {exc}") from None
        conn: socket.socket = raw
        try:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self._tls is not None:
                conn = self._tls.wrap_socket(raw, server_hostname=self._server_hostname)
            conn.sendall(tcp.hello(ticket))
            answer = conn.recv(1)
        except (OSError, ssl.SSLError) as exc:
            conn.close()
            raise DataPortUnusable(f"the data port {address} did not admit the connection: {exc}") from None
        if answer != tcp.ADMITTED:
            conn.close()
            why = "refused the ticket" if answer == tcp.REFUSED else f"answered {answer!r}"
            raise DataPortUnusable(f"the data port {address} {why} (another replica, or a proxy in between)")
        # Blocking from now on: a stalled stream is the idle watchdog's to notice, and its cancel shuts us down.
        conn.settimeout(None)
        return conn

    @property
    def fallback(self) -> Fallback | None:
        return self._fallback


def raise_if_no_data_port(exc: grpc.RpcError) -> None:
    """DataPortUnusable when a call's error says the server has no data port (or predates it)."""
    code = exc.code() if isinstance(exc, grpc.Call) else None
    if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNIMPLEMENTED):
        details = exc.details() if isinstance(exc, grpc.Call) else ""
        # A changed checkpoint is FAILED_PRECONDITION too, and no reason to leave the data port.
        if code == grpc.StatusCode.UNIMPLEMENTED or "data port" in (details or ""):
            raise DataPortUnusable(f"the server says {code.name}: {details}") from None


def _receive(
    conn: socket.socket,
    land: Landing | None,
    buffer: _Buffer,
    messages: CallReader[pb.StreamTensorsBulkResponse],
    model: str,
) -> Batches:
    reader = FrameReader(conn)
    chunks = payload = 0
    try:
        while True:
            frame = tcp.decode_header(reader.exactly(tcp.HEADER.size), deltas=True)
            if frame.kind == tcp.END:
                if (frame.offset, frame.length) != (chunks, payload):
                    raise IntegrityError(
                        f"model {model!r}: the server sent {chunks} chunks of {payload} bytes, and says it sent "
                        f"{frame.offset} of {frame.length}"
                    )
                break
            try:
                tensor = reader.exactly(frame.name_bytes).decode()
            except UnicodeDecodeError:
                raise IntegrityError(f"model {model!r}: a chunk's tensor name is not UTF-8") from None
            chunks += 1
            if frame.kind == tcp.DELTA:
                size, encoding = tcp.DELTA_HEADER.unpack(reader.exactly(tcp.DELTA_HEADER.size))
                if size > wire.MAX_CHUNK_BYTES:
                    raise tcp.FrameError(f"delta frame with {size} payload bytes")
                payload += size
                reader.into(buffer.address, size)
                yield [
                    ChunkRef(
                        tensor, frame.offset, frame.crc32c, frame.length, buffer.address, size, buffer.region,
                        encoding=encoding, encoded_length=size,
                    )
                ]  # fmt: skip
                continue
            address = land(tensor, frame.offset, frame.length) if land is not None else None
            payload += frame.length
            if address is None:  # placed from the buffer, and checked as it is placed
                reader.into(buffer.address, frame.length)
                yield [
                    ChunkRef(
                        tensor, frame.offset, frame.crc32c, frame.length, buffer.address, frame.length, buffer.region
                    )
                ]
                continue
            landed = reader.into(address, frame.length, checksum=True)
            yield [
                ChunkRef(
                    tensor, frame.offset, frame.crc32c, frame.length, address, frame.length,
                    in_place=True, landed_crc32c=landed,
                )
            ]  # fmt: skip
    except tcp.FrameError as exc:
        raise IntegrityError(f"model {model!r}: malformed frame on the data connection: {exc}") from exc
    except Cut as cut:
        outcome = _call_outcome(messages)
        if outcome is not None:
            raise outcome from None
        raise TransportError(
            UnavailableError(f"model {model!r}: the data connection ended after {payload} bytes: {cut}")
        ) from None
    outcome = _call_outcome(messages)
    if outcome is not None:
        raise outcome


def _call_outcome(messages: CallReader[pb.StreamTensorsBulkResponse]) -> BaseException | None:
    """What the call ended with (None if OK, or if it has not ended within CALL_END_GRACE_S)."""
    try:
        return messages.outcome(CALL_END_GRACE_S)
    except TimeoutError:
        return None


def ended_with_error(call: grpc.Future) -> bool:
    """Whether a call ended, within CALL_END_GRACE_S, with an error status (then it is the error to raise)."""
    done = threading.Event()
    call.add_done_callback(lambda _: done.set())
    return done.wait(CALL_END_GRACE_S) and call.code() != grpc.StatusCode.OK  # type: ignore[attr-defined]


def _shut(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)


class FrameReader:
    """Exact reads from the data connection; Cut when it ends or fails first."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        # MSG_WAITALL: one system call per read where the kernel can; TLS sockets take no flags.
        self._flags = 0 if isinstance(conn, ssl.SSLSocket) else socket.MSG_WAITALL
        self._small = bytearray(tcp.HEADER.size + tcp.MAX_NAME_BYTES)

    def exactly(self, size: int) -> bytes:
        view = memoryview(self._small)[:size]
        self._fill(view)
        return bytes(view)

    def payload(self, size: int) -> bytes:
        """The next size bytes, as bytes (received in as few calls as the socket allows)."""
        parts: list[bytes] = []
        left = size
        while left:
            try:
                data = self._conn.recv(left, self._flags)
            except OSError as exc:
                raise Cut(str(exc)) from None
            if not data:
                raise Cut(f"the server closed it {left} bytes into a read")
            parts.append(data)
            left -= len(data)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def into(self, address: int, size: int, *, checksum: bool = False) -> int:
        """Receive size bytes at address; with checksum, their CRC32C as they landed (else 0).

        With checksum the bytes come in RECEIVE_PIECE_BYTES pieces, each checksummed right after it
        landed, while it is still in the core's cache.
        """
        if not size:
            return 0
        view = wire.memory_at(address, size)
        if not checksum:
            self._fill(view)
            return 0
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
            except OSError as exc:
                raise Cut(str(exc)) from None
            if n == 0:
                raise Cut(f"the server closed it {size - got} bytes into a read")
            got += n


class _Buffer:
    """One chunk-sized buffer for chunks received outside their destination; registered with CUDA on first use there."""

    def __init__(self) -> None:
        self._memory: mmap.mmap | None = None
        self.region: cuda_host.HostRegion | None = None
        self._address = 0

    @property
    def address(self) -> int:
        if self._memory is None:
            self._memory = mmap.mmap(-1, wire.MAX_CHUNK_BYTES)
            self._address = ctypes.addressof(ctypes.c_char.from_buffer(self._memory))
            if cuda_host.in_use():
                self.region = cuda_host.HostRegion(self._address, wire.MAX_CHUNK_BYTES, writable=True)
        return self._address

    def close(self) -> None:
        if self.region is not None:
            self.region.release()
            self.region = None
        if self._memory is not None:
            self._memory.close()
            self._memory = None
