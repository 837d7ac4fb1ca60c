"""The data port: where clients of tcp streams connect, and the tickets that admit them.

A tcp stream (tcp_servicer.py) issues a ticket on its authenticated gRPC call and announces it;
the client connects to the data port and sends tcp.MAGIC and the ticket. The port admits
a connection only with a ticket that is waiting, from the address the call came from (and, under
mutual TLS, with the certificate the call showed), and only once: the ticket is withdrawn when it
is used, when its stream stops waiting for it, and when the stream ends. Being able to reach the
port gives nothing.

Hostile connections: each connection gets HANDSHAKE_TIMEOUT_S to finish its TLS handshake and send
its HELLO_BYTES; at most MAX_HANDSHAKES are read at once, at most MAX_HANDSHAKES_PER_HOST of them
from one peer host (HandshakeSlots). A new connection that finds no slot free takes the place of an
idle one (no complete hello yet): its own host's oldest when its host holds its share, else the
oldest of the host holding the most. So idle connections from one host, or from many, cannot keep
a ticket holder out: it sends its hello a few round trips after connecting, long before a flood
catches up with it. A connection that sends garbage, a wrong ticket or nothing in time, or is shed for a newer
one, is closed, costs one WARNING line and counts in the stats (data_connections_refused); memory
per handshake is the socket, a duplicate of its descriptor and one small buffer.

Threading: one thread accepts; each connection's handshake runs on a short-lived thread of its own.
Tickets is shared by those threads and the streams' gRPC workers, and is locked; HandshakeSlots is
shared by the accepting thread (take) and the handshakes (hello_received, release), and is locked.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import secrets
import socket
import ssl
import threading
from dataclasses import dataclass, field

from weightstream.protocol import tcp
from weightstream_server.ops.stats import ServerStats

logger = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 5.0
MAX_HANDSHAKES = 64
MAX_HANDSHAKES_PER_HOST = 16
_BACKLOG = 128
_SHED = "it had sent no hello when a newer connection needed its handshake slot"


@dataclass(eq=False)
class Pending:
    """A ticket waiting for its data connection: who may present it, and the connection once it came."""

    ticket: bytes
    host: str
    certificate: bytes | None
    _arrived: threading.Event = field(default_factory=threading.Event)
    _conn: socket.socket | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _withdrawn: bool = False

    def wait(self, timeout: float) -> socket.socket | None:
        """The admitted connection, once it comes within timeout s; None if not (yet)."""
        self._arrived.wait(timeout)
        return self._conn

    def _deliver(self, conn: socket.socket) -> bool:
        with self._lock:
            if self._withdrawn:
                return False
            self._conn = conn
            self._withdrawn = True
        self._arrived.set()
        return True


class Tickets:
    """The tickets of the tcp streams waiting for their connections. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: dict[bytes, Pending] = {}

    def issue(self, host: str, certificate: bytes | None) -> Pending:
        """A fresh ticket for a connection from host (showing certificate, DER, if not None)."""
        pending = Pending(secrets.token_bytes(tcp.TICKET_BYTES), host, certificate)
        with self._lock:
            self._waiting[pending.ticket] = pending
        return pending

    def withdraw(self, pending: Pending) -> socket.socket | None:
        """Stop pending from admitting anyone; the connection it admitted before, if one came."""
        with self._lock:
            self._waiting.pop(pending.ticket, None)
        with pending._lock:
            pending._withdrawn = True
            return pending._conn

    def admit(self, ticket: bytes, host: str, certificate: bytes | None) -> Pending | None:
        """The stream ticket admits a connection from host to, used up by this; None (nothing used) if none."""
        with self._lock:
            pending = next((p for t, p in self._waiting.items() if hmac.compare_digest(t, ticket)), None)
            if pending is None:
                return None
            if pending.host != host or (pending.certificate is not None and pending.certificate != certificate):
                return None
            del self._waiting[pending.ticket]
            return pending

    def __len__(self) -> int:
        with self._lock:
            return len(self._waiting)


def peer_host(peer: str) -> str:
    """The address of a gRPC peer string ("ipv4:10.0.0.5:51234", "ipv6:[::1]:4000") or socket address, normalised."""
    host = peer
    if peer.startswith(("ipv4:", "ipv6:")):
        host = peer.split(":", 1)[1].rsplit(":", 1)[0].strip("[]")
    return normal_host(host)


def normal_host(host: str) -> str:
    """An IP address in one spelling (an IPv4-mapped IPv6 address as the IPv4 one); other text as given."""
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def peer_group(host: str) -> str:
    """Whose share of the handshake slots a connection from host counts against: its IPv4 address, or
    its IPv6 /64 network (one subscriber's, which may use any address in it); other text as given."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host
    if isinstance(address, ipaddress.IPv6Address):
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return host


@dataclass(eq=False)
class Handshake:
    """One connection being read: its peer host, and a duplicate of its socket through which it can be shed."""

    host: str
    # A duplicate, not the socket itself: a TLS wrap takes the socket's descriptor over midway.
    handle: socket.socket
    idle: bool = True  # no complete hello yet
    shed: bool = False


class HandshakeSlots:
    """The connections being read, at most total at once and at most per_host of them from one host. Thread-safe.

    take() makes room for a new connection by shedding an idle handshake: shutting its socket down
    through the duplicate (which wakes its thread's read) and giving its slot to the new one at once.
    Once hello_received() said yes, a handshake is no longer idle and is never shed.
    """

    def __init__(self, total: int, per_host: int) -> None:
        self._total = total
        self._per_host = per_host
        self._lock = threading.Lock()
        self._by_host: dict[str, list[Handshake]] = {}  # oldest first
        self._count = 0

    def take(self, host: str, handle: socket.socket) -> Handshake | None:
        """A slot for a connection from host (handle: a duplicate of its socket); None where none is free or idle."""
        with self._lock:
            if len(self._by_host.get(host, ())) >= self._per_host:
                victim = self._oldest_idle([host])
                if victim is None:
                    return None
                self._shed(victim)
            elif self._count >= self._total:
                hosts = sorted(self._by_host, key=lambda h: len(self._by_host[h]), reverse=True)
                victim = self._oldest_idle(hosts)
                if victim is None:
                    return None
                self._shed(victim)
            handshake = Handshake(host, handle)
            self._by_host.setdefault(host, []).append(handshake)
            self._count += 1
            return handshake

    def hello_received(self, handshake: Handshake) -> bool:
        """Mark handshake as no longer idle; False if it was shed first."""
        with self._lock:
            handshake.idle = False
            return not handshake.shed

    def release(self, handshake: Handshake) -> None:
        """Free handshake's slot (if it was not shed) and its duplicate socket."""
        with self._lock:
            if not handshake.shed:
                self._remove(handshake)
        handshake.handle.close()

    def _oldest_idle(self, hosts: list[str]) -> Handshake | None:
        """The oldest idle handshake of the first of hosts that has one."""
        return next((h for host in hosts for h in self._by_host.get(host, ()) if h.idle), None)

    def _shed(self, handshake: Handshake) -> None:
        handshake.shed = True
        self._remove(handshake)
        with contextlib.suppress(OSError):
            handshake.handle.shutdown(socket.SHUT_RDWR)

    def _remove(self, handshake: Handshake) -> None:
        held = self._by_host[handshake.host]
        held.remove(handshake)
        if not held:
            del self._by_host[handshake.host]
        self._count -= 1


class DataPort:
    """The listening data port on host:port (port 0 picks one: see .port); TLS with tls as the server's context.

    start() begins accepting; close() stops, and connections being read are closed by their timeout.
    """

    def __init__(self, host: str, port: int, tls: ssl.SSLContext | None, stats: ServerStats) -> None:
        self.tls = tls
        self.tickets = Tickets()
        self._stats = stats
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        self.port = int(self._listener.getsockname()[1])
        self._handshakes = HandshakeSlots(MAX_HANDSHAKES, MAX_HANDSHAKES_PER_HOST)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="weightstream-data-port", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        self._listener.close()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, address = self._listener.accept()
            except OSError:
                if self._closed:
                    return
                continue
            try:
                handle = conn.dup()
            except OSError as exc:
                self._refuse(conn, address[0], f"{type(exc).__name__}: {exc}")
                continue
            slot = self._handshakes.take(peer_group(normal_host(address[0])), handle)
            if slot is None:
                handle.close()
                self._refuse(conn, address[0], "every handshake slot it may use holds a connection being admitted")
                continue
            threading.Thread(
                target=self._handshake, args=(conn, address[0], slot), name="weightstream-data-handshake", daemon=True
            ).start()

    def _handshake(self, raw: socket.socket, address: str, slot: Handshake) -> None:
        conn: socket.socket = raw
        try:
            raw.settimeout(HANDSHAKE_TIMEOUT_S)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            certificate = None
            if self.tls is not None:
                conn = self.tls.wrap_socket(raw, server_side=True)
                certificate = conn.getpeercert(binary_form=True) if isinstance(conn, ssl.SSLSocket) else None
            hello = _receive_exactly(conn, tcp.HELLO_BYTES)
            if not self._handshakes.hello_received(slot):
                self._refuse(conn, address, _SHED)
                return
            if hello is None or not hello.startswith(tcp.MAGIC):
                self._refuse(conn, address, "it did not open with a weightstream data handshake")
                return
            ticket = hello[len(tcp.MAGIC) :]
            pending = self.tickets.admit(ticket, normal_host(address), certificate)
            if pending is None:
                with contextlib.suppress(OSError):
                    conn.sendall(tcp.REFUSED)
                self._refuse(conn, address, "its ticket is unknown, used, expired, or not for this peer")
                return
            conn.sendall(tcp.ADMITTED)
            if not pending._deliver(conn):
                # The stream stopped waiting a moment ago; it ends without this connection.
                conn.close()
        except (OSError, ssl.SSLError, ValueError) as exc:
            self._refuse(conn, address, _SHED if slot.shed else f"{type(exc).__name__}: {exc}")
        finally:
            self._handshakes.release(slot)

    def _refuse(self, conn: socket.socket, address: str, why: str) -> None:
        self._stats.data_connection_refused()
        logger.warning("data port: closed a connection from %s: %s", address, why)
        with contextlib.suppress(OSError):
            conn.close()


def _receive_exactly(conn: socket.socket, size: int) -> bytes | None:
    """size bytes from conn, or None if it ends first (a timeout raises)."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    got = 0
    while got < size:
        n = conn.recv_into(view[got:], size - got)
        if n == 0:
            return None
        got += n
    return bytes(buffer)


def server_context(cert: str, key: str, client_ca: str | None) -> ssl.SSLContext:
    """The data port's TLS context: the gRPC port's certificate, and mutual TLS when client_ca is set."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca)
    return context
