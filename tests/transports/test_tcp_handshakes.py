"""The data port's handshake slots: connections that never send a hello cannot keep a ticket holder out.

A real server on 127.0.0.1 with a data port that takes publishes (and one with TLS). The idle
connections are real sockets that send nothing, from 127.0.0.1 (the ticket holders' own host) or
from other addresses of 127.0.0.0/8 bound as their source; they are opened before the load and the
publish and closed at the end. Their handshake timeout is raised to a minute, so that a client that
got in did not wait for them to time out.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.certificates import make_pki
from tests.support.checkpoints import skeleton, write_model
from tests.support.ports import LOOPBACK, free_ports
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import WeightStreamClient
from weightstream_server import WeightStreamServer
from weightstream_server.transports.tcp import listener

MODEL = "handshake-model"
IDLE = 200
OTHER_HOSTS = [f"127.0.0.{i}" for i in range(2, 10)]

pytestmark = pytest.mark.slow  # each about a second: a server, 200 connections, a load


@pytest.fixture(autouse=True)
def patient_handshakes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT_S", 60.0)


@pytest.fixture
def state(tmp_path: Path) -> dict[str, torch.Tensor]:
    return write_model(tmp_path, MODEL, tensors=4, numel=1 << 16, seed=23)


@pytest.fixture
def server(tmp_path: Path, state: dict[str, torch.Tensor]) -> Iterator[WeightStreamServer]:
    settings = loopback_settings(model_root=tmp_path, allow_publish=True, data_port=free_ports(1)[0])
    with serving(settings) as s:
        yield s


@contextlib.contextmanager
def idle_connections(port: int, sources: list[str]) -> Iterator[list[socket.socket]]:
    """IDLE connections to port from the source addresses in turn, sending nothing; closed on the way out."""
    conns: list[socket.socket] = []
    try:
        for i in range(IDLE):
            conn = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            conns.append(conn)
            conn.bind((sources[i % len(sources)], 0))
            conn.connect((LOOPBACK, port))
            conn.setblocking(False)
        yield conns
    finally:
        for conn in conns:
            conn.close()


def held(conns: list[socket.socket]) -> list[socket.socket]:
    """Those of conns the server still holds open (it sends an idle connection nothing before closing it)."""
    still: list[socket.socket] = []
    for conn in conns:
        try:
            if conn.recv(1):
                raise AssertionError("the server sent an idle connection something")
        except BlockingIOError:
            still.append(conn)
        except ConnectionResetError:
            pass
    return still


def flooded(conns: list[socket.socket]) -> None:
    """Wait until the server has taken in the flood: more of conns closed than it reads at once."""
    eventually(lambda: len(held(conns)) <= len(conns) - listener.MAX_HANDSHAKES, "the flood reaching the server")


def load_and_publish(target: str, state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture) -> None:
    """A load and a publish of MODEL, both over the data port."""
    caplog.set_level(logging.INFO, logger="weightstream.client.facade")
    with WeightStreamClient(target, progress=False, transport="tcp") as client:
        module = skeleton({name: (t.shape, t.dtype) for name, t in state.items()})
        assert client.load_into(module, MODEL).transport == "tcp"
        for name, parameter in module.named_parameters():
            assert torch.equal(parameter.detach(), state[name]), name
        revision = client.publish(MODEL, {name: t + 1 for name, t in state.items()})
        assert client.manifest(MODEL).revision == revision
    assert any("over the data port" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_idle_connections_from_the_clients_own_host_do_not_keep_it_out(
    server: WeightStreamServer, state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    assert server.data_port is not None
    refused = server.stats.snapshot().data_connections_refused_total
    with idle_connections(server.data_port.port, [LOOPBACK]) as conns:
        flooded(conns)
        load_and_publish(f"{LOOPBACK}:{server.port}", state, caplog)
        still = held(conns)
        assert still, "the idle connections timed out: the client may have waited for them"
        assert len(still) <= listener.MAX_HANDSHAKES_PER_HOST
        # Each idle connection shed counts once, as a refused one.
        shed = IDLE - len(still)
        eventually(lambda: server.stats.snapshot().data_connections_refused_total - refused == shed, "shed counted")


def test_idle_connections_from_many_hosts_do_not_keep_a_client_out(
    server: WeightStreamServer, state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    assert server.data_port is not None
    with idle_connections(server.data_port.port, OTHER_HOSTS) as conns:
        flooded(conns)
        load_and_publish(f"{LOOPBACK}:{server.port}", state, caplog)
        still = held(conns)
        assert still, "the idle connections timed out: the client may have waited for them"
        assert len(still) <= listener.MAX_HANDSHAKES
        for host in OTHER_HOSTS:
            assert len([c for c in still if c.getsockname()[0] == host]) <= listener.MAX_HANDSHAKES_PER_HOST, host


def test_idle_connections_do_not_keep_a_client_out_of_the_tls_data_port(
    tmp_path: Path, state: dict[str, torch.Tensor]
) -> None:
    """The idle connections send no TLS ClientHello: shed while the server waits in its TLS handshake."""
    pki = make_pki(tmp_path / "pki", "handshakes")
    settings = loopback_settings(
        model_root=tmp_path, data_port=free_ports(1)[0], tls_cert=pki.server_cert, tls_key=pki.server_key
    )
    with serving(settings) as server:
        assert server.data_port is not None and server.data_port.tls is not None
        with idle_connections(server.data_port.port, [LOOPBACK]) as conns:
            flooded(conns)
            with WeightStreamClient(
                f"localhost:{server.port}", progress=False, transport="tcp", tls=True, ca_file=pki.ca
            ) as client:
                module = skeleton({name: (t.shape, t.dtype) for name, t in state.items()})
                assert client.load_into(module, MODEL).transport == "tcp"
            assert held(conns)
    for name, parameter in module.named_parameters():
        assert torch.equal(parameter.detach(), state[name]), name


def test_ipv6_peers_share_the_slots_of_their_64_network() -> None:
    """One IPv6 subscriber may use every address of its /64: those count as one host (a unit test of the
    slots, since loopback has one IPv6 address)."""
    assert listener.peer_group("2001:db8::1") == listener.peer_group("2001:db8::ffff:1") == "2001:db8::/64"
    assert listener.peer_group("2001:db8:0:1::1") == "2001:db8:0:1::/64"
    assert listener.peer_group("192.0.2.7") == "192.0.2.7"
    slots = listener.HandshakeSlots(total=8, per_host=2)
    pairs = [socket.socketpair() for _ in range(4)]
    try:
        taken = [slots.take(listener.peer_group(f"2001:db8::{n}"), pairs[n][0]) for n in range(3)]
        assert all(t is not None for t in taken)
        assert taken[0] is not None and taken[0].shed  # the third address of the same /64 shed the first
        other = slots.take(listener.peer_group("2001:db8:0:1::1"), pairs[3][0])
        assert other is not None and taken[1] is not None and not taken[1].shed
    finally:
        for a, b in pairs:
            a.close()
            b.close()
