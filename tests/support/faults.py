"""Fault injection for the reliability tests: a TCP proxy that cuts, freezes or stalls connections.

CuttingProxy relays TCP between a client and a server on 127.0.0.1 and, on the connections it is
told to, resets the connection after a given number of bytes from the server, stops relaying (a
peer that vanished without closing anything), or answers the connection itself as an HTTP/2 peer
that is alive but never answers a stream (a server stuck on its calls, or a call lost on the way).
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
from collections.abc import Sequence
from concurrent import futures

from tests.support.ports import LOOPBACK

# Relay unit of the proxy: large enough for loopback speed, small enough that cuts land near their mark.
RELAY_BYTES = 256 * 1024
# HTTP/2 (RFC 9113): the client's connection preface, and the frame types a stalling peer answers.
_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
_SETTINGS, _PING, _ACK = 0x4, 0x6, 0x1


# How long a "drain" cut waits, relaying nothing, before its RST.
DRAIN_S = 0.5


class CuttingProxy:
    """A TCP relay from 127.0.0.1:port to a server; connection i (from 0) is cut per plan[i].

    plan[i] is (bytes, how): after that many bytes from the server, "reset" closes both sides with
    an RST; "drain" does too, but only DRAIN_S after the last byte was relayed, so that the client
    has read what came before the cut (an RST discards what its socket still holds);
    "freeze" stops relaying both ways but keeps the sockets open; "stall" (bytes ignored)
    never reaches the server: the proxy speaks HTTP/2 itself, answers SETTINGS and PING (so
    keepalive finds the connection alive) and never answers a stream. Connections past the plan
    are relayed untouched. At most max_connections are accepted; two threads relay each one. With
    from_client, the bytes of the plan are counted from the client instead (a cut during an upload).
    """

    def __init__(
        self,
        upstream_port: int,
        plan: Sequence[tuple[int, str]],
        max_connections: int = 32,
        *,
        from_client: bool = False,
    ) -> None:
        self._from_client = from_client
        self._upstream = upstream_port
        self._plan = list(plan)
        self._listener = socket.create_server((LOOPBACK, 0))
        self.port = int(self._listener.getsockname()[1])
        self.target = f"{LOOPBACK}:{self.port}"
        self._pool = futures.ThreadPoolExecutor(max_workers=2 * max_connections + 1, thread_name_prefix="chaos-proxy")
        self._max = max_connections
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self.connections = 0
        self.cuts = 0
        self.stalled = 0  # connections answered by the stalling peer
        self.relayed = 0  # bytes from the server, over all connections

    def __enter__(self) -> CuttingProxy:
        self._pool.submit(self._accept)
        return self

    def __exit__(self, *exc: object) -> None:
        self._closed.set()
        # close() does not wake a thread blocked in accept(); shutdown does.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            for s in self._sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                index = self.connections
                self.connections += 1
            if index >= self._max:
                client.close()
                continue
            limit, how = self._plan[index] if index < len(self._plan) else (None, "")
            if how == "stall":
                with self._lock:
                    self._sockets.append(client)
                    self.stalled += 1
                self._pool.submit(self._stall, client)
                continue
            server = socket.create_connection((LOOPBACK, self._upstream), timeout=10)
            server.settimeout(None)
            with self._lock:
                self._sockets += [client, server]
            pair = _Pair(client, server)
            upload, download = ((limit, how), (None, "")) if self._from_client else ((None, ""), (limit, how))
            self._pool.submit(self._relay, pair, client, server, False, *upload)
            self._pool.submit(self._relay, pair, server, client, True, *download)

    def _relay(
        self,
        pair: _Pair,
        source: socket.socket,
        sink: socket.socket,
        from_server: bool,
        limit: int | None,
        how: str,
    ) -> None:
        sent = 0
        try:
            while not self._closed.is_set():
                data = source.recv(RELAY_BYTES if limit is None else max(1, min(RELAY_BYTES, limit - sent)))
                if not data:
                    break
                if pair.frozen.is_set():
                    continue  # swallowed: a frozen peer answers nothing, not even pings
                sink.sendall(data)
                sent += len(data)
                if from_server:
                    with self._lock:
                        self.relayed += len(data)
                if limit is not None and sent >= limit:
                    with self._lock:
                        self.cuts += 1
                    if how == "freeze":
                        pair.frozen.set()
                        self._closed.wait()  # the peer must notice by itself that nothing comes any more
                        return
                    if how == "drain":
                        pair.frozen.set()
                        self._closed.wait(DRAIN_S)
                    pair.reset()
                    return
        except OSError:
            pass
        finally:
            pair.finished()

    def _stall(self, client: socket.socket) -> None:
        """Be an HTTP/2 server that keeps the connection alive and never answers a stream."""
        try:
            with client:
                if _recv_exactly(client, len(_PREFACE)) != _PREFACE:
                    return
                client.sendall(_frame(_SETTINGS, 0, b""))
                while not self._closed.is_set():
                    header = _recv_exactly(client, 9)
                    length, kind, flags = int.from_bytes(header[:3], "big"), header[3], header[4]
                    payload = _recv_exactly(client, length)
                    if kind == _SETTINGS and not flags & _ACK:
                        client.sendall(_frame(_SETTINGS, _ACK, b""))
                    elif kind == _PING and not flags & _ACK:
                        client.sendall(_frame(_PING, _ACK, payload))
                    # HEADERS, DATA, WINDOW_UPDATE, RST_STREAM, GOAWAY: read and never answered.
        except (OSError, EOFError):
            pass


def _frame(kind: int, flags: int, payload: bytes) -> bytes:
    """An HTTP/2 frame on stream 0."""
    return len(payload).to_bytes(3, "big") + bytes((kind, flags)) + (0).to_bytes(4, "big") + payload


def _recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        piece = sock.recv(size - len(data))
        if not piece:
            raise EOFError("the peer closed the connection")
        data += piece
    return bytes(data)


class _Pair:
    """The two sockets of one relayed connection; the last of its two relay threads closes them.

    Closing a socket that another thread is blocked on would let its descriptor number be reused
    by the next connection under that thread; SHUT_RD wakes the blocked thread instead.
    """

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.sockets = (client, server)
        self.frozen = threading.Event()
        self._lock = threading.Lock()
        self._running = 2

    def reset(self) -> None:
        """Make the close send RST to both peers, as a crashed peer's kernel would, and wake the other thread."""
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                s.shutdown(socket.SHUT_RD)

    def finished(self) -> None:
        with self._lock:
            self._running -= 1
            last = self._running == 0
        if not last:
            for s in self.sockets:
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RD)
            return
        for s in self.sockets:
            with contextlib.suppress(OSError):
                s.close()
