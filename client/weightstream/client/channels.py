"""The client's gRPC channels, and the one place where a stream's transport is chosen.

Channel 0, the main channel, carries the control calls (GetManifest, ListModelFiles,
ReadModelFile, OpenSharedMemory) and a load's first stream; parallel stream i > 0 of a load goes
over channel i, made on first use, so that each stream has a TCP connection of its own. Every
channel gets the options below and the replicas' service config (replicas.py). A channel whose
connection carried a stuck stream is replaced by a fresh one (replace), and a stream whose last
try found no server waits for its channel to connect before the next (wait_ready).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
import weakref
from pathlib import Path

import grpc

from weightstream.client import replicas
from weightstream.client.options import SHM_DIR_ENV
from weightstream.client.transports.base import StreamCancel, Transport
from weightstream.client.transports.grpc_stream import GrpcTransport
from weightstream.client.transports.shm import ShmTransport
from weightstream.client.transports.tcp import Fallback, TcpTransport
from weightstream.protocol import wire
from weightstream.protocol.names import TRANSPORTS, TransportChoice
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# How often wait_ready looks whether the stream it waits for was stopped meanwhile.
_READY_POLL_S = 0.25

_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    # A message carries up to MAX_CHUNK_BYTES of payload plus chunk descriptors; gRPC's default
    # limit of 4 MiB would refuse the server's larger messages.
    ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
    # Ping after 10 s without reads and close the connection when no answer comes within 5 s: a
    # server that died without closing its connection (power loss, a cut cable, a frozen node) is
    # noticed in about 15 s, not when the kernel's TCP retransmission timeout fires (about 15 min).
    # The stream then fails UNAVAILABLE and is resumed. The server accepts pings every 5 s
    # (weightstream_server.assembly, min_ping_interval_without_data_ms), so these never earn a GOAWAY
    # "too_many_pings".
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    # A long tensor can keep the client busy placing while nothing is sent its way; pings must not
    # stop after gRPC's default of 2 without data frames, or a dead peer goes unnoticed again.
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    # Any ping already in flight (gRPC's own bandwidth probes) is otherwise given 60 s to be
    # answered, and a keepalive ping that finds one waits on it: a silent peer then took a minute
    # to notice in tests. 5 s, like keepalive_timeout.
    ("grpc.http2.ping_timeout_ms", 5_000),
    # After a failed connect gRPC waits 1 s, growing to 120 s, before it tries again, and fails
    # calls at once meanwhile; the client's RetryPolicy decides how long to keep trying, so the
    # channel reconnects promptly when asked (a restarted server is found within a second).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
]


def channel_credentials(
    tls: bool, ca_file: str | Path | None, client_cert: str | Path | None, client_key: str | Path | None
) -> grpc.ChannelCredentials | None:
    """TLS credentials from PEM files, or None for a plaintext channel."""
    if not tls:
        if ca_file is not None or client_cert is not None or client_key is not None:
            raise ValueError("ca_file, client_cert and client_key need tls=True")
        return None
    if (client_cert is None) != (client_key is None):
        raise ValueError("mutual TLS needs both client_cert and client_key")
    return grpc.ssl_channel_credentials(
        root_certificates=Path(ca_file).read_bytes() if ca_file is not None else None,
        private_key=Path(client_key).read_bytes() if client_key is not None else None,
        certificate_chain=Path(client_cert).read_bytes() if client_cert is not None else None,
    )


def data_tls_context(
    tls: bool, ca_file: str | Path | None, client_cert: str | Path | None, client_key: str | Path | None
) -> ssl.SSLContext | None:
    """The data connection's TLS context, from the channel's PEM files (None for plaintext)."""
    if not tls:
        return None
    context = ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if client_cert is not None and client_key is not None:
        context.load_cert_chain(str(client_cert), str(client_key))
    return context


class Channels:
    """One client's channels to channel_target, made on first use, and the transport of each stream.

    metadata goes with every call (the bearer token). transport is one of TRANSPORTS: "auto" uses
    shared memory when the server proves it sees shm_dir, else the server's data port (the tcp transport's
    transport), and gRPC when neither can be used; "shm" insists on shared memory, "tcp" on the
    data port, "grpc" tries neither. data_tls wraps data connections when the channel runs TLS.

    Thread-safe: any thread may ask for a channel, the stub or a transport; each is made once
    (again after replace), and shared memory is negotiated once (on the main channel). close()
    closes every channel; a later call makes new ones.
    """

    def __init__(
        self,
        channel_target: str,
        *,
        credentials: grpc.ChannelCredentials | None,
        metadata: tuple[tuple[str, str], ...],
        transport: TransportChoice,
        shm_dir: Path | None,
        data_tls: ssl.SSLContext | None = None,
    ) -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        if transport == "shm" and shm_dir is None:
            raise ValueError(f"transport='shm' needs shm_dir, or the environment variable {SHM_DIR_ENV}")
        self.metadata = metadata
        self._channel_target = channel_target
        self._credentials = credentials
        self._kind = transport
        self._shm_dir = shm_dir
        self._data_tls = data_tls
        self._tcp_fallback = Fallback()
        self._lock = threading.Lock()
        self._channels: list[grpc.Channel] = []
        self._stub: pb_grpc.WeightStreamServiceStub | None = None
        self._transports: dict[int, Transport] = {}
        # Transports whose channel replace() closed: calls on them failed CANCELLED for that reason.
        self._replaced: weakref.WeakSet[Transport] = weakref.WeakSet()
        # What OpenSharedMemory granted (max ring bytes); None: not asked yet, 0: use gRPC.
        self._shm_grant: int | None = None
        self._shm_lock = threading.Lock()

    @property
    def stub(self) -> pb_grpc.WeightStreamServiceStub:
        """The generated stub on the main channel, for the control calls."""
        channel = self.channel(0)
        with self._lock:
            if self._stub is None:
                self._stub = pb_grpc.WeightStreamServiceStub(channel)
            return self._stub

    def channel(self, index: int) -> grpc.Channel:
        """Channel index: 0 is the main channel, others are extra ones for parallel streams."""
        with self._lock:
            while len(self._channels) <= index:
                self._channels.append(self._new_channel())
            return self._channels[index]

    def transport(self, index: int) -> Transport:
        """The transport of stream index, on channel index: the one place a stream's transport is chosen.

        Raises what negotiating shared memory raises (grpc.RpcError; FailedPreconditionError for
        "shm" when the server cannot use it); the next call asks again.
        """
        with self._lock:
            found = self._transports.get(index)
        if found is not None:
            return found
        grant = self._negotiated_grant()
        made: Transport
        if grant and self._shm_dir is not None:
            made = ShmTransport(self.channel(index), self._shm_dir, max_ring_bytes=grant)
        elif self._kind in ("auto", "tcp"):
            host = replicas.target_host(self._channel_target)
            made = TcpTransport(
                self.channel(index),
                target_host=host,
                tls=self._data_tls,
                server_hostname=host or None,
                fallback=self._tcp_fallback if self._kind == "auto" else None,
            )
        else:
            made = GrpcTransport(self.channel(index))
        with self._lock:
            return self._transports.setdefault(index, made)

    def data_port(self) -> TcpTransport | None:
        """The data port's transport for calls that send bytes there (publishes), on the main channel;
        None for transport "grpc" or "shm", or once "auto" fell back to gRPC."""
        if self._kind not in ("auto", "tcp") or (self._kind == "auto" and self._tcp_fallback.why is not None):
            return None
        host = replicas.target_host(self._channel_target)
        return TcpTransport(
            self.channel(0),
            target_host=host,
            tls=self._data_tls,
            server_hostname=host or None,
            fallback=self._tcp_fallback if self._kind == "auto" else None,
        )

    def replace(self, index: int, stale: Transport) -> None:
        """Close the channel stale streams on and put a fresh one in its place, for channel(index) and transport(index).

        For a connection that carried a stuck stream: the resume then goes out on a new connection
        instead of the old one, which keepalive may still find alive. Every other call on the
        closed channel ends CANCELLED (a load's stream that finds replaced() true resumes; control
        calls of other threads on channel 0 fail). A no-op once stale is not index's transport any
        more: another stream replaced it already.
        """
        with self._lock:
            if self._transports.get(index) is not stale:
                return
            del self._transports[index]
            self._replaced.add(stale)
            old = self._channels[index]
            self._channels[index] = self._new_channel()
            if index == 0:
                self._stub = None
        logger.info("replacing channel %d to %s with a fresh connection", index, self._channel_target)
        old.close()

    def replaced(self, transport: Transport) -> bool:
        """Whether replace() closed transport's channel (so that its calls ended CANCELLED)."""
        with self._lock:
            return transport in self._replaced

    def wait_ready(self, index: int, timeout: float, stop: StreamCancel | None = None) -> bool:
        """Wait until channel index is connected (READY); False after timeout seconds, or once stop is cancelled.

        Waiting is what makes gRPC connect: it tries again after each failed connect, 100 ms to
        1 s later (the reconnect options above), so a server that comes back is found within about
        a second, and a call made now does not fail at once against the channel's backoff.
        """
        deadline = time.monotonic() + timeout
        future = grpc.channel_ready_future(self.channel(index))
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or (stop is not None and stop.reason is not None):
                    return False
                try:
                    future.result(timeout=min(left, _READY_POLL_S))
                    return True
                except grpc.FutureTimeoutError:
                    continue
        finally:
            future.cancel()  # only here, once: gRPC's future fails a second cancel()

    def close(self) -> None:
        with self._lock:
            channels, self._channels = self._channels, []
            self._stub = None
            self._transports = {}
        for channel in channels:
            channel.close()

    def _negotiated_grant(self) -> int:
        """The ring bytes the server grants this client's shared memory, asked once; 0 for gRPC.

        "auto" falls back to gRPC (negotiate logs why, once); "shm" raises instead.
        """
        if self._kind in ("grpc", "tcp"):
            return 0
        with self._shm_lock:
            if self._shm_grant is None:
                granted = None
                if self._shm_dir is not None:
                    granted = ShmTransport.negotiate(
                        self.channel(0), self._shm_dir, self.metadata, required=self._kind == "shm"
                    )
                else:
                    logger.debug("shared memory not used: no shm_dir given and %s is not set", SHM_DIR_ENV)
                self._shm_grant = granted.max_ring_bytes if granted is not None else 0
            return self._shm_grant

    def _new_channel(self) -> grpc.Channel:
        options = [*_CHANNEL_OPTIONS, *replicas.CHANNEL_OPTIONS]
        if self._credentials is None:
            return grpc.insecure_channel(self._channel_target, options=options)
        return grpc.secure_channel(self._channel_target, self._credentials, options=options)
