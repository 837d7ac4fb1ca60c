"""The tcp transport: StreamTensorsBulk on gRPC, the chunk bytes on a TCP connection to the data port.

Real servers on 127.0.0.1 (in this process, or `weightstream serve` processes for the kill), real
sockets, real TLS. Faults come from a real TCP relay that cuts the data connection (faults.CuttingProxy,
announced to the client with --data-advertise) and, for a chunk that fails its CRC32C once, from
one kept checksum of the server made wrong for one look-up.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import ssl
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from tests.support.certificates import Pki, make_pki
from tests.support.checkpoints import expected_piece, load_folder, skeleton, write_model
from tests.support.faults import CuttingProxy
from tests.support.page_cache import make_uncached
from tests.support.ports import LOOPBACK, free_ports
from tests.support.s3_stores import S3_BUCKET, S3Process, s3_settings, upload_folder
from tests.support.serve_processes import Supervisor
from tests.support.servers import eventually, loopback_settings, running, serving
from weightstream.client import FailedPreconditionError, RetryPolicy, WeightStreamClient
from weightstream.client.sharding import ShardSpec
from weightstream.client.transports import tcp as tcp_transport
from weightstream.client.transports.tcp import STREAM_TENSORS_BULK_METHOD
from weightstream.protocol import tcp
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server import WeightStreamServer, errors
from weightstream_server.storage.reads import ChunkPlace
from weightstream_server.transports.tcp import listener
from weightstream_server.transports.tcp import servicer as tcp_servicer
from weightstream_server.transports.tcp.listener import Tickets

MODEL = "tcp-model"
# MODEL's files under another name, read cold by one test.
COLD_MODEL = "tcp-model-cold"
TENSORS = 12
NUMEL = 1 << 20  # 4 MiB of float32 each
# Quick resumes for the fault tests; idle_timeout notices a frozen data connection.
POLICY = RetryPolicy(attempts=20, initial_backoff=0.05, max_backoff=0.2, total_deadline=60.0, idle_timeout=3.0)


@pytest.fixture(scope="module")
def state(root: Path) -> dict[str, torch.Tensor]:
    return write_model(root, MODEL, tensors=TENSORS, numel=NUMEL, seed=17)


@pytest.fixture(scope="module")
def server(root: Path, state: dict[str, torch.Tensor]) -> Iterator[WeightStreamServer]:
    with serving(loopback_settings(model_root=root, data_port=free_ports(1)[0])) as s:
        yield s


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("tcp-pki"), "tcp")


def _target(server: WeightStreamServer) -> str:
    return f"{LOOPBACK}:{server.port}"


def _module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    return skeleton({name: (t.shape, t.dtype) for name, t in state.items()})


def _assert_loaded(module: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    got = dict(module.named_parameters())
    assert set(got) == set(state)
    for name, tensor in state.items():
        assert torch.equal(got[name].detach().view(torch.uint8), tensor.view(torch.uint8)), name


def test_load_into_lands_every_chunk_in_place_and_bit_exact(
    server: WeightStreamServer, state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU parameters receive every chunk straight from the socket (the transport's own buffer is never
    used); the second load is sent from the page cache with the CRC32Cs kept from the first."""

    def no_buffer(self: object) -> int:
        raise AssertionError("a chunk for a CPU parameter went through the transport's buffer")

    monkeypatch.setattr(tcp_transport._Buffer, "address", property(no_buffer))
    module = _module(state)
    before = dict(module.named_parameters())
    served = server.stats.snapshot().bytes_served_total
    with WeightStreamClient(_target(server), progress=False, transport="tcp") as client:
        first = client.load_into(module, MODEL)
        kept = len(tcp_servicer._chunk_checksums)
        for p in module.parameters():
            p.detach().zero_()
        second = client.load_into(module, MODEL)
    assert first.transport == second.transport == "tcp"
    assert first.bytes == second.bytes == sum(t.numel() * 4 for t in state.values())
    assert kept >= TENSORS
    assert server.stats.snapshot().bytes_served_total - served == first.bytes + second.bytes
    _assert_loaded(module, state)
    assert all(p is before[n] for n, p in module.named_parameters())


def test_slices_the_cache_and_cold_files_over_the_data_port(
    root: Path, tiny_llama_folder: Path, state: dict[str, torch.Tensor]
) -> None:
    """Gathered slices, a server cache and a cold page cache send from memory, not from the files."""
    reference = load_folder(tiny_llama_folder)
    # Copies of tiny-llama and of MODEL that no process has mapped or is still reading (the module's
    # server read MODEL in the tests before), so that their pages can be dropped.
    shutil.copytree(tiny_llama_folder, root / "tiny-llama", dirs_exist_ok=True)
    shutil.copytree(root / MODEL, root / COLD_MODEL, dirs_exist_ok=True)
    for folder in (root / "tiny-llama", root / COLD_MODEL):
        for path in folder.glob("*.safetensors"):
            make_uncached(path)
    with (
        serving(loopback_settings(model_root=root, data_port=free_ports(1)[0])) as plain,
        serving(loopback_settings(model_root=root, data_port=free_ports(1)[0], cache_bytes=256 << 20)) as cached,
    ):
        with WeightStreamClient(_target(plain), progress=False, transport="tcp") as client:
            for rank in range(2):
                spec = ShardSpec(rank, 2)
                pieces = {name: expected_piece(t, spec, name) for name, t in reference.items()}
                module = skeleton({name: (p.shape, p.dtype) for name, p in pieces.items()})
                report = client.load_into(module, "tiny-llama", shard=spec)
                assert report.transport == "tcp"
                for name, parameter in module.named_parameters():
                    assert torch.equal(parameter, pieces[name]), (rank, name)
        with WeightStreamClient(_target(cached), progress=False, transport="tcp") as client:
            for _ in range(2):  # from storage into the cache, then from the cache
                got = dict(client.iter_tensors(COLD_MODEL))
                assert all(torch.equal(got[n], t) for n, t in state.items())
        assert cached.cache is not None and cached.cache.snapshot().hits >= TENSORS


def test_a_chunk_that_fails_its_check_is_asked_for_again(
    server: WeightStreamServer, state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    module = _module(state)
    with WeightStreamClient(_target(server), progress=False, transport="tcp", retry=POLICY) as client:
        client.load_into(module, MODEL)  # every chunk's CRC32C is kept now
        kept = tcp_servicer._chunk_checksums
        real_get = kept.get
        spoiled: list[object] = []

        def get_once_wrong(key: tcp_servicer.ChunkKey) -> int | None:
            crc = real_get(key)
            if crc is not None and not spoiled and key[3] > 8 * NUMEL:  # a chunk well into the file
                spoiled.append(key)
                return crc ^ 0x1
            return crc

        monkeypatch.setattr(kept, "get", get_once_wrong)
        for p in module.parameters():
            p.detach().zero_()
        report = client.load_into(module, MODEL)
    assert spoiled, "no chunk was sent with a kept CRC32C"
    assert report.transport == "tcp"
    assert report.retries == 1
    _assert_loaded(module, state)


@pytest.mark.slow
def test_a_cut_or_frozen_data_connection_resumes_where_it_stopped(root: Path, state: dict[str, torch.Tensor]) -> None:
    data_port = free_ports(1)[0]
    total = sum(t.numel() * 4 for t in state.values())
    with CuttingProxy(data_port, [(total // 3, "reset"), (total // 4, "freeze")]) as proxy:
        settings = loopback_settings(model_root=root, data_port=data_port, data_advertise=f"{LOOPBACK}:{proxy.port}")
        with serving(settings) as s, WeightStreamClient(_target(s), progress=False, transport="tcp", retry=POLICY) as c:
            module = _module(state)
            report = c.load_into(module, MODEL)
    assert proxy.cuts == 2
    assert report.transport == "tcp"
    assert report.retries >= 2
    # A resume asks only for what had not landed: far less than a second copy.
    assert report.resent_bytes < total // 2
    _assert_loaded(module, state)


@pytest.mark.slow
def test_a_server_killed_mid_load_resumes_over_the_data_port(
    root: Path, state: dict[str, torch.Tensor], tmp_path: Path
) -> None:
    data_port = free_ports(1)[0]
    module = _module(state)
    lasts = [p.detach().view(-1)[-1:] for p in module.parameters()]
    with Supervisor(root, tmp_path, "--data-port", str(data_port)) as supervisor:
        with WeightStreamClient(supervisor.target, progress=False, transport="tcp", retry=POLICY) as client:
            client.manifest(MODEL)
            for kill in range(2):
                for p in module.parameters():
                    p.detach().zero_()
                done = threading.Event()
                killed: list[int] = []

                def killer(done: threading.Event = done, killed: list[int] = killed) -> None:
                    while not done.wait(0.002):
                        landed = sum(1 for last in lasts if bool(last.ne(0).item()))
                        if landed >= TENSORS // 3:
                            supervisor.kill()
                            killed.append(landed)
                            return

                thread = threading.Thread(target=killer, daemon=True)
                thread.start()
                report = client.load_into(module, MODEL)
                done.set()
                thread.join(timeout=10)
                assert killed, f"load {kill} finished before the kill"
                assert report.retries >= 1 and report.transport == "tcp"
                _assert_loaded(module, state)
        assert supervisor.kills == 2


def _announce(target: str) -> tuple[grpc.Channel, Iterator[pb.StreamTensorsBulkResponse], pb.StreamTensorsBulkResponse]:
    """Open a StreamTensorsBulk call by hand; (channel, call, its announcement)."""
    channel = grpc.insecure_channel(target)
    method = channel.unary_stream(
        STREAM_TENSORS_BULK_METHOD,
        request_serializer=pb.StreamTensorsBulkRequest.SerializeToString,
        response_deserializer=pb.StreamTensorsBulkResponse.FromString,
    )
    call = method(pb.StreamTensorsBulkRequest(request=pb.StreamTensorsRequest(model=MODEL)))
    return channel, call, next(call)


def _closed_by_server(conn: socket.socket) -> bool:
    """Whether the server closes conn (an end, or a reset) before sending it anything but a TLS alert."""
    conn.settimeout(10)
    try:
        while data := conn.recv(1 << 16):
            if not data.startswith(b"\x15"):  # a TLS alert record is a goodbye too
                return False
    except ConnectionResetError:
        pass
    return True


def _hello(port: int, ticket: bytes, *, tls: ssl.SSLContext | None = None) -> tuple[socket.socket, bytes]:
    raw = socket.create_connection((LOOPBACK, port), timeout=10)
    conn = tls.wrap_socket(raw, server_hostname="localhost") if tls is not None else raw
    conn.sendall(tcp.hello(ticket))
    return conn, conn.recv(1)


def test_a_ticket_admits_one_connection_from_its_peer_only(
    server: WeightStreamServer, state: dict[str, torch.Tensor]
) -> None:
    tickets = Tickets()
    pending = tickets.issue("127.0.0.1", None)
    assert tickets.admit(pending.ticket, "10.1.2.3", None) is None  # stolen: another host
    assert tickets.admit(bytes(tcp.TICKET_BYTES), "127.0.0.1", None) is None  # guessed
    assert tickets.admit(pending.ticket, "127.0.0.1", None) is pending
    assert tickets.admit(pending.ticket, "127.0.0.1", None) is None  # used
    mtls = tickets.issue("127.0.0.1", b"certificate of the call")
    assert tickets.admit(mtls.ticket, "127.0.0.1", b"another client's certificate") is None
    assert tickets.withdraw(mtls) is None and len(tickets) == 0

    assert server.data_port is not None
    refused_before = server.stats.snapshot().data_connections_refused_total
    channel, call, announcement = _announce(_target(server))
    try:
        assert announcement.data_host == LOOPBACK and len(announcement.ticket) == tcp.TICKET_BYTES
        conn, answer = _hello(announcement.data_port, announcement.ticket)
        assert answer == tcp.ADMITTED
        again, second = _hello(announcement.data_port, announcement.ticket)
        assert second == tcp.REFUSED
        assert again.recv(1) == b""  # and closed
        again.close()
        with conn:
            assert _payload_bytes(conn) == sum(t.numel() * 4 for t in state.values())
        assert list(call) == []  # the call ends OK once every chunk is out
    finally:
        channel.close()
    eventually(lambda: server.stats.snapshot().data_connections_refused_total == refused_before + 1, "one refusal")


def _payload_bytes(conn: socket.socket) -> int:
    """Read a data connection frame by frame to its END; the payload bytes received."""
    conn.settimeout(30)

    def exactly(n: int) -> bytes:
        data = bytearray()
        while len(data) < n:
            piece = conn.recv(min(n - len(data), 1 << 20))
            if not piece:
                raise AssertionError("the connection ended without an END frame")
            data += piece
        return bytes(data)

    payload = 0
    while True:
        frame = tcp.decode_header(exactly(tcp.HEADER.size))
        if frame.kind == tcp.END:
            assert frame.length == payload
            return payload
        exactly(frame.name_bytes)
        payload += len(exactly(frame.length))


def test_a_stolen_ticket_needs_the_callers_certificate_under_mutual_tls(
    root: Path, state: dict[str, torch.Tensor], pki: Pki
) -> None:
    settings = dict(tls_cert=pki.server_cert, tls_key=pki.server_key, tls_client_ca=pki.ca)
    with running(root, data_port=free_ports(1)[0], **settings) as r:
        credentials = grpc.ssl_channel_credentials(
            pki.ca.read_bytes(), pki.client_key.read_bytes(), pki.client_cert.read_bytes()
        )
        channel = grpc.secure_channel(r.target, credentials, options=[("grpc.ssl_target_name_override", "localhost")])
        method = channel.unary_stream(
            STREAM_TENSORS_BULK_METHOD,
            request_serializer=pb.StreamTensorsBulkRequest.SerializeToString,
            response_deserializer=pb.StreamTensorsBulkResponse.FromString,
        )
        call = method(pb.StreamTensorsBulkRequest(request=pb.StreamTensorsRequest(model=MODEL)))
        try:
            announcement = next(call)
            thief = ssl.create_default_context(cafile=str(pki.ca))
            thief.load_cert_chain(str(pki.other_client_cert), str(pki.other_client_key))
            stolen, answer = _hello(announcement.data_port, announcement.ticket, tls=thief)
            stolen.close()
            assert answer == tcp.REFUSED
            owner = ssl.create_default_context(cafile=str(pki.ca))
            owner.load_cert_chain(str(pki.client_cert), str(pki.client_key))
            conn, answer = _hello(announcement.data_port, announcement.ticket, tls=owner)
            with conn:
                assert answer == tcp.ADMITTED
                assert _payload_bytes(conn) == sum(t.numel() * 4 for t in state.values())
        finally:
            call.cancel()
            channel.close()
        # And the client library, over mutual TLS on both connections:
        with WeightStreamClient(
            r.target.replace(LOOPBACK, "localhost"),
            progress=False,
            transport="tcp",
            tls=True,
            ca_file=pki.ca,
            client_cert=pki.client_cert,
            client_key=pki.client_key,
        ) as client:
            module = _module(state)
            assert client.load_into(module, MODEL).transport == "tcp"
        _assert_loaded(module, state)


def test_tls_on_the_data_connection(root: Path, state: dict[str, torch.Tensor], pki: Pki) -> None:
    with running(root, data_port=free_ports(1)[0], tls_cert=pki.server_cert, tls_key=pki.server_key) as r:
        assert r.server.data_port is not None and r.server.data_port.tls is not None
        with WeightStreamClient(
            r.target.replace(LOOPBACK, "localhost"), progress=False, transport="tcp", tls=True, ca_file=pki.ca
        ) as client:
            module = _module(state)
            assert client.load_into(module, MODEL).transport == "tcp"
        _assert_loaded(module, state)
        # A plaintext peer on the TLS data port gets nothing: its hello is no TLS handshake.
        refused = r.server.stats.snapshot().data_connections_refused_total
        with socket.create_connection((LOOPBACK, r.server.data_port.port), timeout=10) as plain:
            plain.sendall(tcp.hello(bytes(tcp.TICKET_BYTES)))
            assert _closed_by_server(plain)
        eventually(lambda: r.server.stats.snapshot().data_connections_refused_total == refused + 1, "refused")


def test_an_unreachable_data_port_falls_back_in_auto_and_fails_clearly_with_tcp(
    root: Path, state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=tcp_transport.logger.name)
    closed_port = free_ports(1)[0]  # nothing listens there
    unreachable = loopback_settings(
        model_root=root, data_port=free_ports(1)[0], data_advertise=f"{LOOPBACK}:{closed_port}"
    )
    for settings, why in (
        (unreachable, f"cannot connect to the data port {LOOPBACK}:{closed_port}"),
        (loopback_settings(model_root=root), "no data port"),
    ):
        with serving(settings) as s:
            caplog.clear()
            with WeightStreamClient(_target(s), progress=False) as client:
                module = _module(state)
                started = time.monotonic()
                first = client.load_into(module, MODEL)
                second = client.load_into(module, MODEL)
            assert time.monotonic() - started < 15
            assert first.transport == second.transport == "grpc"
            _assert_loaded(module, state)
            lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data port not used")]
            assert len(lines) == 1 and why in lines[0], lines
            with WeightStreamClient(_target(s), progress=False, transport="tcp") as client:
                with pytest.raises(FailedPreconditionError, match=why) as raised:
                    client.load_into(_module(state), MODEL)
            assert raised.value.partially_written is False


@pytest.mark.slow
def test_hostile_connections_to_the_data_port_cost_a_line_each_and_nothing_else(
    root: Path, state: dict[str, torch.Tensor], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(listener, "HANDSHAKE_TIMEOUT_S", 0.5)
    caplog.set_level(logging.WARNING, logger=listener.logger.name)
    with running(root, data_port=free_ports(1)[0], stall_timeout=1.0) as r:
        server = r.server
        assert server.data_port is not None
        port = server.data_port.port
        garbage = socket.create_connection((LOOPBACK, port))
        garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(64))
        silent = socket.create_connection((LOOPBACK, port))
        wrong, answer = _hello(port, bytes(range(tcp.TICKET_BYTES)))
        assert answer == tcp.REFUSED
        flood = [socket.create_connection((LOOPBACK, port)) for _ in range(listener.MAX_HANDSHAKES + 6)]
        for conn in (garbage, silent, wrong, *flood):
            conn.settimeout(10)
            assert _closed_by_server(conn), "the server kept a hostile connection open"
            conn.close()
        refused = 3 + len(flood)
        eventually(lambda: server.stats.snapshot().data_connections_refused_total == refused, "refusals counted")
        lines = [m for m in (rec.getMessage() for rec in caplog.records) if m.startswith("data port: closed")]
        assert len(lines) == refused

        # A client with a valid ticket that never reads: its stream ends once the socket buffers fill.
        channel, call, announcement = _announce(r.target)
        never_reads = socket.create_connection((LOOPBACK, port))
        never_reads.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        never_reads.sendall(tcp.hello(announcement.ticket))
        with pytest.raises(grpc.RpcError) as stalled:
            list(call)
        assert stalled.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "took nothing for" in (stalled.value.details() or "")
        never_reads.close()
        channel.close()
        eventually(lambda: server.stats.snapshot().active_streams == 0, "the stalled stream ended")

        with WeightStreamClient(r.target, progress=False, transport="tcp") as client:
            module = _module(state)
            assert client.load_into(module, MODEL).transport == "tcp"
        _assert_loaded(module, state)


def test_a_ticket_shown_to_another_replica_is_refused_and_the_load_goes_over_grpc(
    root: Path, state: dict[str, torch.Tensor], caplog: pytest.LogCaptureFixture
) -> None:
    """Replica a announces replica b's data port, as a Service in front of both would route it."""
    caplog.set_level(logging.INFO, logger=tcp_transport.logger.name)
    with serving(loopback_settings(model_root=root, data_port=free_ports(1)[0])) as b:
        assert b.data_port is not None
        wrong = f"{LOOPBACK}:{b.data_port.port}"
        with serving(loopback_settings(model_root=root, data_port=free_ports(1)[0], data_advertise=wrong)) as a:
            with WeightStreamClient(_target(a), progress=False) as client:
                module = _module(state)
                report = client.load_into(module, MODEL)
            # The abandoned tcp stream ends as soon as it notices its client cancelled it.
            eventually(lambda: a.stats.snapshot().active_streams == 0, "the abandoned tcp stream ended")
        assert b.stats.snapshot().data_connections_refused_total == 1
    assert report.transport == "grpc"
    _assert_loaded(module, state)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("data port not used")]
    assert len(lines) == 1 and "refused the ticket" in lines[0], lines


@pytest.mark.slow
def test_s3_models_over_the_data_port(s3_store: S3Process, root: Path, state: dict[str, torch.Tensor]) -> None:
    upload_folder(s3_store.client(), root / MODEL, S3_BUCKET, "tcp/model")
    with serving(s3_settings(s3_store, data_port=free_ports(1)[0])) as s:
        with WeightStreamClient(_target(s), progress=False, transport="tcp") as client:
            module = _module(state)
            report = client.load_into(module, f"s3://{S3_BUCKET}/tcp/model")
    assert report.transport == "tcp"
    _assert_loaded(module, state)


def test_bulk_calls_cancelled_in_a_loop_leave_no_stream_and_no_ticket(
    server: WeightStreamServer, state: dict[str, torch.Tensor]
) -> None:
    assert server.data_port is not None
    for _ in range(20):
        # A cancelled stream frees its slot once the server sees the cancel, which a loaded machine
        # may do later than the next call comes: the loop must not run into --max-streams.
        eventually(
            lambda: server.stats.snapshot().active_streams < server.settings.max_streams - 1, "a stream slot is free"
        )
        channel, call, announcement = _announce(_target(server))
        assert len(announcement.ticket) == tcp.TICKET_BYTES
        call.cancel()  # type: ignore[attr-defined]
        channel.close()
    eventually(lambda: server.stats.snapshot().active_streams == 0, "every cancelled stream ended")
    eventually(lambda: len(server.data_port.tickets) == 0, "every ticket withdrawn")  # type: ignore[union-attr]
    with WeightStreamClient(_target(server), progress=False, transport="tcp") as client:
        module = _module(state)
        assert client.load_into(module, MODEL).transport == "tcp"
    _assert_loaded(module, state)


def test_a_file_truncated_while_the_kernel_sends_it_ends_the_stream_not_the_server(tmp_path: Path) -> None:
    """Cut short in place (same inode) while its pages go out by sendfile: the stream ends with an
    error naming the change, the connection ends without its END frame, and the server serves on."""
    state = write_model(tmp_path, MODEL, tensors=8, numel=NUMEL, seed=5)
    path = tmp_path / MODEL / "model.safetensors"
    with serving(loopback_settings(model_root=tmp_path, data_port=free_ports(1)[0])) as s:
        with WeightStreamClient(_target(s), progress=False, transport="tcp") as client:
            client.load_into(_module(state), MODEL)  # warms the page cache and keeps the CRC32Cs
        channel, call, announcement = _announce(_target(s))
        conn, answer = _hello(announcement.data_port, announcement.ticket)
        assert answer == tcp.ADMITTED
        time.sleep(0.5)  # the server fills the socket buffers and waits for room
        os.truncate(path, path.stat().st_size // 2)
        with conn, pytest.raises(AssertionError, match="without an END frame"):
            _payload_bytes(conn)
        with pytest.raises(grpc.RpcError) as ended:
            list(call)
        assert ended.value.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.DATA_LOSS)
        assert "changed" in (ended.value.details() or "") or "early" in (ended.value.details() or "")
        channel.close()
        eventually(lambda: s.stats.snapshot().active_streams == 0, "the stream ended")


def test_data_advertise_is_host_or_host_and_port() -> None:
    from weightstream_server.assembly import advertised
    from weightstream_server.settings import ServerSettings, split_host_port

    assert split_host_port("10.0.0.7") == ("10.0.0.7", None)
    assert split_host_port("weightstream-0.weightstream:7000") == ("weightstream-0.weightstream", 7000)
    assert split_host_port("[fd00::1]:50052") == ("fd00::1", 50052)
    assert split_host_port("fd00::1") == ("fd00::1", None)
    for bad in ("http://x", "host:0", "host:99999", "a b", "[::1]x"):
        with pytest.raises(ValueError):
            split_host_port(bad)
    root = Path("/")
    assert advertised(ServerSettings(model_root=root, host="0.0.0.0")) == ("", None)
    assert advertised(ServerSettings(model_root=root, host="10.1.1.1")) == ("10.1.1.1", None)
    assert advertised(ServerSettings(model_root=root, data_advertise="10.2.2.2")) == ("10.2.2.2", None)
    with pytest.raises(ValueError, match="data_advertise"):
        ServerSettings(model_root=root, data_advertise="not a host")


def test_a_stream_whose_connection_closed_as_it_was_admitted_is_a_lost_connection_not_an_internal_error() -> None:
    """The call ended (and closed its data connection) between admission and the first frame."""
    ours, theirs = socket.socketpair()
    theirs.close()
    ours.close()
    with pytest.raises(errors.DataConnectionLost, match="closed before the first frame"):
        tcp_servicer.FrameSender(ours, "127.0.0.1", stall_timeout=1.0)


def test_a_connection_closed_while_a_file_is_sent_is_a_lost_connection(tmp_path: Path) -> None:
    """The call ended (and closed its data connection) while the stream sent a file's bytes."""
    ours, theirs = socket.socketpair()
    sender = tcp_servicer.FrameSender(ours, "127.0.0.1", stall_timeout=1.0)
    ours.close()
    theirs.close()
    path = tmp_path / "bytes"
    path.write_bytes(b"x" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(errors.DataConnectionLost, match="broke"):
            sender.from_file(ChunkPlace("t", 0, 4096), 0, fd, 0, lambda: None)
        # Closed between the frame's header and its bytes: an OSError too (what _sending maps), not a ValueError.
        with pytest.raises(OSError, match="closed"):
            sender._sendfile(fd, 0, 4096, lambda: None)
    finally:
        os.close(fd)
