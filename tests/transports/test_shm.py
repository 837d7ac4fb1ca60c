"""The shared-memory transport: negotiation, bit-exact loads, fallback to gRPC, segment hygiene, crashes.

Everything is real: servers on 127.0.0.1 (in this process, or `weightstream serve` processes for
the crash tests), safetensors files, torch modules, and segment files in a directory under /dev/shm
(a tmpfs, like a pod's emptyDir with medium Memory); clients killed with SIGKILL are subprocesses.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
import transformers

from tests.support.checkpoints import expected_piece, llama_config, load_folder, skeleton, write_model, write_tiny_llama
from tests.support.page_cache import PAGE, make_cached, make_partly_cached, make_uncached
from tests.support.ports import free_ports
from tests.support.reliability_report import record
from tests.support.serve_processes import serve_process
from tests.support.servers import eventually, loopback_settings, serving
from weightstream.client import WeightStreamClient, cuda_host
from weightstream.client.errors import FailedPreconditionError
from weightstream.client.manifest import TensorSlice
from weightstream.client.retry import RetryPolicy
from weightstream.client.sharding import ShardSpec
from weightstream.client.transports.base import StreamCancel
from weightstream.client.transports.shm import ShmTransport
from weightstream.protocol import shm, wire
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server import WeightStreamServer, create_server
from weightstream_server.errors import CheckpointChanged, CorruptCheckpoint
from weightstream_server.serving import reader as reader_module
from weightstream_server.serving.catalog import Catalog, Manifest
from weightstream_server.serving.read_plan import plan_reads
from weightstream_server.serving.reader import DirectReader, page_cached, reads_directly
from weightstream_server.storage.local import LocalSource
from weightstream_server.transports.shm import segments as shm_segments
from weightstream_server.transports.shm import servicer as shm_servicer

LOOPBACK = "127.0.0.1"
# Small chunks give small slots (16 slots of 64 KiB), so that every load wraps the ring many times.
CHUNK = 64 * 1024
START_TIMEOUT_S = 60.0


def _entries(directory: Path) -> list[str]:
    return sorted(os.listdir(directory))


@pytest.fixture(scope="module")
def shm_dir() -> Iterator[Path]:
    """A fresh directory on a tmpfs (/dev/shm where there is one), removed at the end."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="weightstream-test-shm-", dir=base) as name:
        yield Path(name)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models for this module: a tiny Llama, and a float32 model of 24 tensors of 1 MB."""
    folder = tmp_path_factory.mktemp("shm-models")
    write_tiny_llama(folder / "tiny-llama")
    write_model(folder, "blocks", tensors=24, numel=250_000, seed=7)
    return folder


@pytest.fixture(scope="module")
def shm_server(root: Path, shm_dir: Path) -> Iterator[WeightStreamServer]:
    with serving(loopback_settings(model_root=root, shm_dir=shm_dir)) as server:
        yield server


@pytest.fixture(scope="module")
def plain_server(root: Path) -> Iterator[WeightStreamServer]:
    """The same models, served with no shared-memory directory."""
    with serving(
        loopback_settings(
            model_root=root,
        )
    ) as server:
        yield server


def _target(server: WeightStreamServer) -> str:
    return f"{LOOPBACK}:{server.port}"


def _assert_same(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        other = got[name].detach().cpu()
        assert other.dtype == tensor.dtype and other.shape == tensor.shape, name
        assert other.contiguous().view(torch.uint8).equal(tensor.contiguous().view(torch.uint8)), name


# --- through the client ------------------------------------------------------------------------


def test_load_into_over_shm_is_bit_exact(shm_server: WeightStreamServer, root: Path, shm_dir: Path) -> None:
    expected = load_folder(root / "tiny-llama")
    module = transformers.LlamaForCausalLM(llama_config())
    before = _entries(shm_dir)
    with WeightStreamClient(
        _target(shm_server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK
    ) as client:
        report = client.load_into(module, "tiny-llama")
    assert report.transport == "shm"
    assert report.bytes == sum(t.numel() * t.element_size() for t in expected.values())
    _assert_same(expected, dict(module.state_dict()))
    assert _entries(shm_dir) == before


def test_iter_tensors_and_load_state_dict_over_shm(shm_server: WeightStreamServer, root: Path, shm_dir: Path) -> None:
    expected = load_folder(root / "blocks")
    before = _entries(shm_dir)
    with WeightStreamClient(
        _target(shm_server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK, streams=2
    ) as client:
        _assert_same(expected, dict(client.iter_tensors("blocks")))
        _assert_same(expected, client.load_state_dict("blocks"))
        llama = load_folder(root / "tiny-llama")
        _assert_same(llama, client.load_state_dict("tiny-llama"))
    assert _entries(shm_dir) == before


def test_auto_uses_shm_dir_from_the_environment(
    shm_server: WeightStreamServer, root: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WEIGHTSTREAM_SHM_DIR", str(shm_dir))
    expected = load_folder(root / "tiny-llama")
    module = transformers.LlamaForCausalLM(llama_config())
    with WeightStreamClient(_target(shm_server), progress=False, transport="auto") as client:
        report = client.load_into(module, "tiny-llama")
    assert report.transport == "shm"
    _assert_same(expected, dict(module.state_dict()))


def test_auto_falls_back_to_grpc_when_directories_differ(
    shm_server: WeightStreamServer, root: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    expected = load_folder(root / "tiny-llama")
    module = transformers.LlamaForCausalLM(llama_config())
    other = tmp_path / "elsewhere"
    other.mkdir()
    with (
        caplog.at_level(logging.INFO, logger="weightstream.client"),
        WeightStreamClient(_target(shm_server), progress=False, transport="auto", shm_dir=other) as client,
    ):
        first = client.load_into(module, "tiny-llama")
        second = client.load_into(module, "tiny-llama")
    assert first.transport == second.transport == "grpc"
    _assert_same(expected, dict(module.state_dict()))
    why = [r for r in caplog.records if "shared memory not used" in r.getMessage()]
    assert len(why) == 1, [r.getMessage() for r in caplog.records]
    assert "does not see" in why[0].getMessage()
    assert _entries(other) == [], "the nonce file was left behind"


def test_auto_falls_back_to_grpc_when_the_server_has_no_shm_dir(
    plain_server: WeightStreamServer, root: Path, shm_dir: Path
) -> None:
    module = transformers.LlamaForCausalLM(llama_config())
    with WeightStreamClient(_target(plain_server), progress=False, transport="auto", shm_dir=shm_dir) as client:
        report = client.load_into(module, "tiny-llama")
        got = client.load_state_dict("blocks")
    assert report.transport == "grpc"
    _assert_same(load_folder(root / "tiny-llama"), dict(module.state_dict()))
    _assert_same(load_folder(root / "blocks"), got)


def test_shm_transport_refuses_clearly_when_it_cannot_be_used(plain_server: WeightStreamServer, shm_dir: Path) -> None:
    with (
        WeightStreamClient(_target(plain_server), progress=False, transport="shm", shm_dir=shm_dir) as client,
        pytest.raises(FailedPreconditionError, match="shared-memory directory"),
    ):
        client.load_state_dict("blocks")


# --- the protocol, on a raw call -----------------------------------------------------------------


def _raw_call(server: WeightStreamServer) -> tuple[grpc.Channel, grpc.StreamStreamMultiCallable]:
    channel = grpc.insecure_channel(_target(server))
    method = channel.stream_stream(
        "/weightstream.v1.WeightStreamService/StreamTensorsShared",
        request_serializer=pb.StreamTensorsSharedRequest.SerializeToString,
        response_deserializer=pb.StreamTensorsSharedResponse.FromString,
    )
    return channel, method


class _Requests:
    """A request stream fed from the test's thread."""

    def __init__(self) -> None:
        import queue

        self.queue: queue.SimpleQueue[pb.StreamTensorsSharedRequest | None] = queue.SimpleQueue()

    def __iter__(self) -> Iterator[pb.StreamTensorsSharedRequest]:
        while (item := self.queue.get()) is not None:
            yield item


def _take_ring(directory: Path, announcement: pb.StreamTensorsSharedResponse, ticket: bytes | None = None) -> int:
    """The protocol's hand-over, done by hand: the descriptor the segment socket gives for ticket; -1 if none."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(10)
        with shm.socket_address(directory, announcement.segment_socket) as address:
            conn.connect(address)
        conn.sendall(announcement.ticket if ticket is None else ticket)
        answer, fds, _, _ = socket.recv_fds(conn, 1, 4)
    if answer == shm.HANDOVER_OK and len(fds) == 1:
        return fds[0]
    assert (answer, fds) == (b"", []), "a refused hand-over closes the connection and sends nothing"
    return -1


def test_segment_handover_ticket_seals_and_ring(shm_server: WeightStreamServer, shm_dir: Path) -> None:
    before = _entries(shm_dir)
    channel, method = _raw_call(shm_server)
    requests = _Requests()
    requests.queue.put(
        pb.StreamTensorsSharedRequest(
            request=pb.StreamTensorsRequest(model="blocks", max_chunk_bytes=CHUNK), slots=4, slot_bytes=CHUNK
        )
    )
    call = method(iter(requests), timeout=30)
    fd = -1
    try:
        announcement = next(call)
        assert (announcement.slots, announcement.slot_bytes) == (4, CHUNK)
        assert announcement.segment_socket.startswith(f"weightstream-sock-{os.getpid()}-")
        assert len(announcement.ticket) == shm.TICKET_BYTES
        path = shm_dir / announcement.segment_socket
        info = path.stat()
        assert stat.S_ISSOCK(info.st_mode) and stat.S_IMODE(info.st_mode) == shm_segments.SOCKET_MODE == 0o660
        # The segment itself is no file in the directory, only its hand-over socket is.
        assert _entries(shm_dir) == sorted([*before, announcement.segment_socket])
        # Another ticket gets nothing, and the socket stays for the right one.
        assert _take_ring(shm_dir, announcement, ticket=bytes(shm.TICKET_BYTES)) == -1
        fd = _take_ring(shm_dir, announcement)
        assert fd >= 0
        eventually(lambda: not path.exists(), "the socket removed once the segment is handed over")
        # A sealed memfd of exactly the ring: nobody can shrink or grow it under the server's mapping.
        assert os.fstat(fd).st_size == 4 * CHUNK and shm.is_sealed(fd)
        assert os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{shm.SEGMENT_PREFIX}")
        for resize in (0, 8 * CHUNK):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, resize)
        requests.queue.put(pb.StreamTensorsSharedRequest())
        # With the ring full and no credits returned, the server sends no more than the ring holds.
        # (Slots filled together may come in one message.)
        slots_seen: set[int] = set()
        for _ in range(4):
            message = next(call)
            slots_seen.update(c.slot for c in message.chunks)
            if len(slots_seen) == 4:
                break
        assert slots_seen == {0, 1, 2, 3}
        assert sum(c.length for c in message.chunks) <= 4 * CHUNK
        # A credit for a slot that is not in flight is refused.
        requests.queue.put(pb.StreamTensorsSharedRequest(released_slots=[0, 0]))
        with pytest.raises(grpc.RpcError) as raised:
            for _ in call:
                pass
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not in flight" in (raised.value.details() or "")
    finally:
        if fd >= 0:
            os.close(fd)
        requests.queue.put(None)
        call.cancel()
        channel.close()
    eventually(lambda: shm_server.stats.active_streams == 0, "the stream ended on the server")
    assert _entries(shm_dir) == before


@pytest.mark.slow
def test_silent_and_wrong_connections_to_a_segment_socket_cost_seconds_not_the_stream(
    shm_server: WeightStreamServer, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A connection that never sends its ticket is closed after TICKET_TIMEOUT_S; the right client gets the ring."""
    channel, method = _raw_call(shm_server)
    requests = _Requests()
    requests.queue.put(pb.StreamTensorsSharedRequest(request=pb.StreamTensorsRequest(model="blocks")))
    call = method(iter(requests), timeout=30)
    fd = -1
    caplog.set_level(logging.WARNING, logger=shm_segments.logger.name)
    try:
        announcement = next(call)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as silent:
            with shm.socket_address(shm_dir, announcement.segment_socket) as address:
                silent.connect(address)
            started = time.monotonic()
            fd = _take_ring(shm_dir, announcement)  # waits while the server waits on the silent one
            waited = time.monotonic() - started
            silent.settimeout(10)
            assert silent.recv(16) == b"", "the silent connection is closed without a descriptor"
        assert fd >= 0 and shm.is_sealed(fd)
        assert waited < shm_segments.TICKET_TIMEOUT_S + 5
    finally:
        if fd >= 0:
            os.close(fd)
        requests.queue.put(None)
        call.cancel()
        channel.close()
    eventually(lambda: shm_server.stats.active_streams == 0, "the stream ended on the server")
    assert any("closed 1 connections without its ticket" in r.getMessage() for r in caplog.records)


def test_cancel_before_attach_leaves_no_socket(shm_server: WeightStreamServer, shm_dir: Path) -> None:
    before = _entries(shm_dir)
    channel, method = _raw_call(shm_server)
    requests = _Requests()
    requests.queue.put(pb.StreamTensorsSharedRequest(request=pb.StreamTensorsRequest(model="blocks")))
    call = method(iter(requests), timeout=30)
    try:
        announcement = next(call)
        assert (shm_dir / announcement.segment_socket).exists()
        call.cancel()
        eventually(lambda: not (shm_dir / announcement.segment_socket).exists(), "the socket removed after cancel")
    finally:
        requests.queue.put(None)
        channel.close()
    eventually(lambda: shm_server.stats.active_streams == 0, "the stream ended on the server")
    assert _entries(shm_dir) == before


def test_bad_rings_and_nonces_are_refused(shm_server: WeightStreamServer, shm_dir: Path) -> None:
    channel, method = _raw_call(shm_server)
    try:
        for slots, slot_bytes, needle in ((1, 0, "slots 1"), (16, 100, "slot_bytes 100"), (4096, 1 << 24, "larger")):
            first = pb.StreamTensorsSharedRequest(
                request=pb.StreamTensorsRequest(model="blocks"), slots=slots, slot_bytes=slot_bytes
            )
            with pytest.raises(grpc.RpcError) as raised:
                list(method(iter([first]), timeout=30))
            assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, needle
            assert needle in (raised.value.details() or "")
        with pytest.raises(grpc.RpcError) as raised:
            list(method(iter([pb.StreamTensorsSharedRequest()]), timeout=30))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        opener = channel.unary_unary(
            "/weightstream.v1.WeightStreamService/OpenSharedMemory",
            request_serializer=pb.OpenSharedMemoryRequest.SerializeToString,
            response_deserializer=pb.OpenSharedMemoryResponse.FromString,
        )
        nonce_name = "weightstream-nonce-0123456789abcdef"
        (shm_dir / nonce_name).write_bytes(b"a" * 32)
        # Another small file in the directory: its name is refused before it is opened, so a client
        # cannot probe whether it exists or what it holds.
        (shm_dir / "secret.txt").write_bytes(b"a" * 32)
        try:
            for name, nonce, code in (
                ("../etc/passwd", b"x", grpc.StatusCode.INVALID_ARGUMENT),
                ("secret.txt", b"a" * 32, grpc.StatusCode.INVALID_ARGUMENT),
                ("weightstream-nonce-test", b"a" * 32, grpc.StatusCode.INVALID_ARGUMENT),
                (nonce_name, b"b" * 32, grpc.StatusCode.FAILED_PRECONDITION),
                ("weightstream-nonce-fedcba9876543210", b"a" * 32, grpc.StatusCode.FAILED_PRECONDITION),
            ):
                with pytest.raises(grpc.RpcError) as raised:
                    opener(pb.OpenSharedMemoryRequest(nonce_file=name, nonce=nonce), timeout=10)
                assert raised.value.code() == code, name
            granted = opener(pb.OpenSharedMemoryRequest(nonce_file=nonce_name, nonce=b"a" * 32))
            assert granted.max_ring_bytes == shm_server.settings.read_ahead_bytes
        finally:
            (shm_dir / nonce_name).unlink()
            (shm_dir / "secret.txt").unlink()
    finally:
        channel.close()


def test_transport_directly_matches_the_file(shm_server: WeightStreamServer, root: Path, shm_dir: Path) -> None:
    """The transport on its own: every byte of every chunk, read at its address, checked against the file."""
    import ctypes

    from weightstream.protocol import wire

    expected = {n: t.contiguous().view(torch.uint8).reshape(-1) for n, t in load_folder(root / "blocks").items()}
    channel = grpc.insecure_channel(_target(shm_server))
    try:
        transport = ShmTransport.negotiate(channel, shm_dir, ())
        assert transport is not None and transport.name == "shm"
        got = {n: torch.zeros_like(t) for n, t in expected.items()}
        chunks = 0
        request = pb.StreamTensorsRequest(model="blocks", max_chunk_bytes=CHUNK)
        for batch in transport.stream(request, (), StreamCancel()):
            for chunk in batch:
                chunks += 1
                assert wire.crc32c_at(chunk.address, chunk.length) == chunk.crc32c
                ctypes.memmove(got[chunk.tensor].data_ptr() + chunk.offset, chunk.address, chunk.length)
        assert chunks >= sum(t.numel() for t in expected.values()) // CHUNK
        for name, tensor in expected.items():
            assert got[name].equal(tensor), name
    finally:
        channel.close()


# --- crashes -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_stale_segments_of_dead_processes_are_removed_at_start(root: Path, tmp_path: Path) -> None:
    directory = tmp_path / "shm"
    directory.mkdir()
    # A process that made a segment and died without cleaning up (its hand-over socket stays, with
    # nobody listening), and one that still holds its own.
    maker = textwrap.dedent(
        f"""
        import os, sys, time
        from pathlib import Path
        from weightstream_server.transports.shm.segments import Segment
        segment = Segment(Path({str(directory)!r}), 2, 4096)
        print(segment.socket_name, flush=True)
        if sys.argv[1] == "die":
            os._exit(0)
        time.sleep(120)
        """
    )
    dead = subprocess.run([sys.executable, "-c", maker, "die"], capture_output=True, text=True, timeout=60, check=True)
    holder = subprocess.Popen([sys.executable, "-c", maker, "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None
        held = holder.stdout.readline().strip()
        stale = dead.stdout.strip()
        # Nonce files of clients that crashed while negotiating: an old one goes, a fresh one stays.
        old_nonce = directory / "weightstream-nonce-00000000000000aa"
        fresh_nonce = directory / "weightstream-nonce-00000000000000bb"
        old_nonce.write_bytes(b"x" * 32)
        fresh_nonce.write_bytes(b"y" * 32)
        # A segment file of an older version, which nobody locks.
        legacy = directory / "weightstream-seg-1-00000000000000cc"
        legacy.write_bytes(b"z" * 4096)
        long_ago = time.time() - 2 * shm_segments.NONCE_MAX_AGE_S
        os.utime(old_nonce, (long_ago, long_ago))
        assert _entries(directory) == sorted([stale, held, old_nonce.name, fresh_nonce.name, legacy.name])
        server = create_server(loopback_settings(model_root=root, shm_dir=directory))
        server.start()
        server.stop(grace=0)
        assert _entries(directory) == sorted([held, fresh_nonce.name])
    finally:
        holder.kill()
        holder.wait(timeout=30)
    assert shm_segments.remove_stale_segments(directory) == 1
    assert _entries(directory) == [fresh_nonce.name]


_SLOW_CLIENT = textwrap.dedent(
    """
    import sys, time
    from weightstream.client import WeightStreamClient, cuda_host
    client = WeightStreamClient(sys.argv[1], progress=False, transport="shm", shm_dir=sys.argv[2], chunk_bytes=65536)
    for name, tensor in client.iter_tensors("blocks"):
        print("got", name, flush=True)
        time.sleep(120)
    """
)


@pytest.mark.slow
def test_killed_client_leaves_no_segment(shm_server: WeightStreamServer, shm_dir: Path) -> None:
    before = _entries(shm_dir)
    proc = subprocess.Popen(
        [sys.executable, "-c", _SLOW_CLIENT, _target(shm_server), str(shm_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("got "), proc.stderr.read() if proc.stderr else ""
        assert shm_server.stats.active_streams == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    eventually(lambda: shm_server.stats.active_streams == 0, "the server ending the killed client's stream", 30)
    assert _entries(shm_dir) == before


_LIBC = ctypes.CDLL(None, use_errno=True)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 0x01, 0x02


@pytest.mark.slow
def test_a_client_that_shrinks_or_punches_its_ring_costs_only_its_own_stream(
    root: Path, shm_dir: Path, tmp_path: Path
) -> None:
    """A same-user client does its worst to the segment it was handed while the server copies into it.

    A truncated file under the server's mapping would kill it with SIGBUS (the copies from the
    server's cache are memmoves into the mapping): the segment must refuse every change of size.
    Punching holes is allowed (the pages come back as zeros): the server survives it, and the
    client only spoils its own chunks. The server is a process, so that a crash shows as one.
    """
    before = _entries(shm_dir)
    (port,) = free_ports(1)
    args = ["--model-root", str(root), "--host", LOOPBACK, "--grpc-port", str(port), "--http-port", "0"]
    args += ["--shm-dir", str(shm_dir), "--chunk-bytes", str(CHUNK), "--cache-bytes", str(64 << 20)]
    expected = load_folder(root / "blocks")
    target = f"{LOOPBACK}:{port}"
    with serve_process(args, tmp_path) as server:
        server.wait_listening(port, START_TIMEOUT_S)
        channel = grpc.insecure_channel(target)
        method = channel.stream_stream(
            "/weightstream.v1.WeightStreamService/StreamTensorsShared",
            request_serializer=pb.StreamTensorsSharedRequest.SerializeToString,
            response_deserializer=pb.StreamTensorsSharedResponse.FromString,
        )
        requests = _Requests()
        requests.queue.put(
            pb.StreamTensorsSharedRequest(
                request=pb.StreamTensorsRequest(model="blocks", max_chunk_bytes=CHUNK), slots=2, slot_bytes=CHUNK
            )
        )
        call = method(iter(requests), timeout=60)
        refused: list[str] = []
        try:
            announcement = next(call)
            fd = _take_ring(shm_dir, announcement)
            size = os.fstat(fd).st_size
            for resize in (0, size // 2, size - 1, size + 4096):
                try:
                    os.ftruncate(fd, resize)
                except PermissionError:
                    refused.append(f"ftruncate {resize}")
            requests.queue.put(pb.StreamTensorsSharedRequest())
            # Every slot the server announces is punched out and returned, so that it copies
            # into the punched pages again and again until the model is through.
            messages = 0
            for message in call:
                messages += 1
                assert _LIBC.fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, 0, size) == 0
                slots = sorted({c.slot for c in message.chunks})
                requests.queue.put(pb.StreamTensorsSharedRequest(released_slots=slots))
            os.close(fd)
        finally:
            requests.queue.put(None)
            call.cancel()
            channel.close()
        assert refused == [f"ftruncate {n}" for n in (0, size // 2, size - 1, size + 4096)]
        assert messages > 4, "the ring went round more than once"
        server.assert_running()
        # The server still serves everyone else, over shared memory, bit-exact.
        with WeightStreamClient(target, progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK) as client:
            _assert_same(expected, client.load_state_dict("blocks"))
        server.assert_running()
    assert _entries(shm_dir) == before
    record("shared memory", hostile_ring_resizes_refused=len(refused))


@contextlib.contextmanager
def _serve_process(root: Path, shm_dir: Path, port: int, log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`weightstream serve` with --shm-dir on a fixed port, its output appended to log; waits until it listens."""
    args = ["--model-root", str(root), "--host", LOOPBACK, "--grpc-port", str(port), "--http-port", "0"]
    args += ["--shm-dir", str(shm_dir), "--chunk-bytes", str(CHUNK)]
    with serve_process(args, log.parent, log=log) as server:
        server.wait_listening(port, START_TIMEOUT_S)
        yield server.proc


@pytest.mark.slow
def test_server_killed_mid_stream_client_resumes_bit_exact(root: Path, shm_dir: Path, tmp_path: Path) -> None:
    expected = load_folder(root / "blocks")
    before = _entries(shm_dir)
    (port,) = free_ports(1)
    log = tmp_path / "serve.log"
    got: dict[str, torch.Tensor] = {}
    retry = RetryPolicy(attempts=50, initial_backoff=0.05, max_backoff=0.5, total_deadline=60.0, idle_timeout=30.0)
    with WeightStreamClient(
        f"{LOOPBACK}:{port}", progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK, retry=retry
    ) as client:
        first = _serve_process(root, shm_dir, port, log)
        server = first.__enter__()
        try:
            tensors = client.iter_tensors("blocks")
            name, tensor = next(tensors)
            got[name] = tensor
            # The first server dies with its ring full and a stream in flight.
            server.send_signal(signal.SIGKILL)
            server.wait(timeout=30)
        finally:
            first.__exit__(None, None, None)
        with _serve_process(root, shm_dir, port, log):
            for name, tensor in tensors:
                got[name] = tensor
            assert client._channels.transport(0).name == "shm"
    _assert_same(expected, got)
    assert _entries(shm_dir) == before
    # The rest of the load came over shared memory from the second server.
    assert re.search(r"shared stream end: model='blocks' .* code=OK", log.read_text()), log.read_text()
    record("shared memory", server_kills_survived=1)


def test_shm_streams_from_the_cache_are_bit_exact(root: Path, shm_dir: Path) -> None:
    """With --cache-bytes, the second load's chunks come from the cache (framed bytes) into the slots."""
    settings = loopback_settings(model_root=root, shm_dir=shm_dir, cache_bytes=64 << 20)
    with serving(settings) as server:
        expected = load_folder(root / "blocks")
        with WeightStreamClient(
            _target(server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK
        ) as client:
            _assert_same(expected, client.load_state_dict("blocks"))
            read_once = server.stats.snapshot().storage_bytes_read_total
            _assert_same(expected, client.load_state_dict("blocks"))
            assert server.stats.snapshot().storage_bytes_read_total == read_once, "the second load read storage"


READ_INTO_SLOTS = "read into the slots"
COPIED_INTO_SLOTS = "copied into the slots from the streamer or the cache"


def _fill_paths(caplog: pytest.LogCaptureFixture) -> list[str]:
    """How each shared stream logged since the test began filled its slots."""
    messages = [r.getMessage() for r in caplog.records if r.name == shm_servicer.logger.name]
    return [m.rsplit(", ", 1)[1] for m in messages if m.startswith("shared stream ") and " ring " in m]


def test_tensor_parallel_ranks_over_shm_are_bit_exact(
    shm_server: WeightStreamServer, root: Path, shm_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Row-parallel slices are gathered from the streamer's reads and copied into the slots; plain byte
    ranges (whole tensors, slices of dimension 0) are read by the kernel straight into the slots."""
    caplog.set_level(logging.DEBUG, logger=shm_servicer.logger.name)
    reference = load_folder(root / "tiny-llama")
    blocks = load_folder(root / "blocks")
    first = sorted(blocks)[0]
    with WeightStreamClient(
        _target(shm_server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK
    ) as client:
        for rank in range(2):
            spec = ShardSpec(rank, 2)
            pieces = {name: expected_piece(t, spec, name) for name, t in reference.items()}
            module = skeleton({name: (p.shape, p.dtype) for name, p in pieces.items()})
            report = client.load_into(module, "tiny-llama", shard=spec)
            assert report.transport == "shm"
            for name, parameter in module.named_parameters():
                assert torch.equal(parameter, pieces[name]), (rank, name)
        sliced = dict(client.iter_tensors("blocks", slices={first: TensorSlice(0, 1000, 200_000)}))
    assert torch.equal(sliced[first], blocks[first][1000:200_000])
    assert _fill_paths(caplog) == [COPIED_INTO_SLOTS, COPIED_INTO_SLOTS, READ_INTO_SLOTS]
    assert not [name for name in _entries(shm_dir) if name.startswith("weightstream-")]


def test_a_direct_read_partly_in_the_page_cache_gives_the_chunks_bytes_and_crc32c(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chunk whose first pieces are cached and whose rest is not: the checksum taken piece by piece
    on the caller's thread is carried on to the bytes read on the reader's threads."""
    state = write_model(tmp_path, "partly", tensors=1, numel=1 << 20, seed=5)  # one 4 MiB tensor
    catalog = Catalog([LocalSource(tmp_path)])
    manifest = catalog.manifest("partly")
    plan = plan_reads(manifest, [], 4 << 20)
    (source,) = manifest.files
    path = Path(source.path)
    data_start = source.size - plan.total_bytes
    # The premise, established and checked: the first pages of the tensor cached, none of the rest.
    cached_start = data_start // PAGE * PAGE
    make_partly_cached(path, cached_start, 300 * 1024, source.size)
    handed_over: list[int] = []
    real_read_into = reader_module._ChunkRead.read_into

    def read_into(self: reader_module._ChunkRead, address: int, done: int = 0, crc: int = 0) -> int:
        handed_over.append(done)
        return real_read_into(self, address, done, crc)

    monkeypatch.setattr(reader_module._ChunkRead, "read_into", read_into)
    buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8)
    with DirectReader(manifest, plan, lambda n: None, threads=2) as reader:
        (read,) = list(reader.reads())
        crc = read.start(buffer.data_ptr())
        value = crc if isinstance(crc, int) else crc.result()
    (tensor,) = state.values()
    assert bytes(buffer.numpy()) == tensor.numpy().tobytes()
    assert value == wire.crc32c(tensor.numpy().tobytes())
    assert len(handed_over) == 1 and 0 < handed_over[0] < plan.total_bytes, handed_over


def test_direct_reads_warm_and_cold_and_refuse_a_changed_or_short_file(tmp_path: Path) -> None:
    """Cached bytes are read on the caller's thread, the rest on the reader's threads; either way the
    bytes and CRC32Cs are the file's. The checks are the streamer path's: a file changed since its
    listing (FAILED_PRECONDITION), a read that comes up short (DATA_LOSS)."""
    state = write_model(tmp_path, "changing", tensors=4, numel=50_000, seed=3)
    catalog = Catalog([LocalSource(tmp_path)])
    manifest = catalog.manifest("changing")
    plan = plan_reads(manifest, [], CHUNK)
    assert reads_directly(manifest, plan)
    (source,) = manifest.files
    path = Path(source.path)
    expected = b"".join(state[name].numpy().tobytes() for name in sorted(state))
    buffer = torch.zeros(plan.total_bytes, dtype=torch.uint8)

    def read_all(m: Manifest) -> list[bool]:
        """Read every chunk into buffer at its place in expected; whether each one went to a thread."""
        offsets = {name: sum(state[n].numel() * 4 for n in sorted(state)[:i]) for i, name in enumerate(sorted(state))}
        threaded = []
        with DirectReader(m, plan, lambda n: None, threads=2) as reader:
            for read in reader.reads():
                address = buffer.data_ptr() + offsets[read.place.tensor] + read.place.offset
                crc = read.start(address)
                threaded.append(not isinstance(crc, int))
                value = crc if isinstance(crc, int) else crc.result()
                assert value == wire.crc32c_at(address, read.place.length), read.place
        return threaded

    assert page_cached(manifest, plan)
    assert not any(read_all(manifest)), "the page cache holds the file just written: no read needs a thread"
    assert bytes(buffer.numpy()) == expected
    buffer.zero_()
    # Checked as the reader itself probes too: readahead still in flight may bring pages back.
    make_uncached(path, also=lambda: not page_cached(manifest, plan))
    assert any(read_all(manifest)), "after eviction, reads wait for storage on the reader's threads"
    assert bytes(buffer.numpy()) == expected
    with path.open("r+b") as f:
        f.truncate(source.size - 1000)
    changed = r"model 'changing': model.safetensors is \d+ bytes, not the \d+ bytes .* changed on disk"
    with pytest.raises(CheckpointChanged, match=changed):
        read_all(manifest)
    # The short file as it is listed now, read with the plan of its old size: the last read ends early.
    shorter = dataclasses.replace(manifest, files=LocalSource(tmp_path).resolve("changing").files)
    assert shorter.files[0].size == source.size - 1000
    with pytest.raises(CorruptCheckpoint, match=r"read \d+ bytes at file offset \d+ of .*the file ended early"):
        read_all(shorter)


def _segment_mappings() -> list[str]:
    """The permissions of this process's mappings of shared-memory segments (/proc/self/maps)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return [line.split()[1] for line in lines if shm.SEGMENT_PREFIX in line]


@pytest.mark.parametrize("cuda_in_use", [False, True])
def test_ring_is_mapped_read_only_unless_cuda_may_register_it(
    shm_server: WeightStreamServer, root: Path, shm_dir: Path, monkeypatch: pytest.MonkeyPatch, cuda_in_use: bool
) -> None:
    """A CPU process maps the ring read-only; a process using CUDA maps it writable (same user), so that
    a CUDA copy can register it. Copies into CPU tensors never ask CUDA to register anything.

    This machine has no GPU: with cuda_in_use the test pretends that the process uses CUDA; the
    parameters are still CPU tensors, so registration is never asked for.
    """
    asked: list[bool] = []

    def recorded(address: int, size: int, *, writable: bool) -> bool:
        asked.append(writable)
        return False

    monkeypatch.setattr(cuda_host, "register", recorded)
    if cuda_in_use:
        monkeypatch.setattr(cuda_host, "in_use", lambda: True)
    expected = load_folder(root / "blocks")
    with WeightStreamClient(
        _target(shm_server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK, streams=1
    ) as client:
        tensors = client.iter_tensors("blocks")
        got = dict([next(tensors)])
        during = _segment_mappings()
        got.update(tensors)
    _assert_same(expected, got)
    # The server runs in this process too, and maps the segment writable.
    assert sorted(during) == sorted(["rw-s", "rw-s" if cuda_in_use else "r--s"])
    assert asked == []
    assert _segment_mappings() == []


def test_cold_files_are_read_by_the_streamer_and_copied_into_slots(
    shm_dir: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """From a cold page cache the streamer's parallel reads serve the slots; once cached, the kernel reads into them."""
    state = write_model(tmp_path, "cold", tensors=8, numel=100_000, seed=11)
    settings = loopback_settings(model_root=tmp_path, shm_dir=shm_dir)
    with serving(settings) as server:
        caplog.set_level(logging.DEBUG, logger=shm_servicer.logger.name)
        with WeightStreamClient(
            _target(server), progress=False, transport="shm", shm_dir=shm_dir, chunk_bytes=CHUNK
        ) as client:
            make_uncached(tmp_path / "cold" / "model.safetensors")
            _assert_same(state, client.load_state_dict("cold"))
            make_cached(tmp_path / "cold" / "model.safetensors")
            _assert_same(state, client.load_state_dict("cold"))
    assert _fill_paths(caplog) == [COPIED_INTO_SLOTS, READ_INTO_SLOTS]


def test_shm_needs_the_token_like_every_rpc(root: Path, shm_dir: Path, tmp_path: Path) -> None:
    """With bearer tokens, negotiation and the shared stream need one; a wrong token is no reason to fall back."""
    from weightstream.client.errors import UnauthenticatedError

    tokens = tmp_path / "tokens"
    tokens.write_text("shm-secret\n")
    with serving(loopback_settings(model_root=root, shm_dir=shm_dir, token_file=tokens)) as server:
        expected = load_folder(root / "blocks")
        with WeightStreamClient(
            _target(server), progress=False, transport="auto", shm_dir=shm_dir, token="shm-secret"
        ) as client:
            _assert_same(expected, client.load_state_dict("blocks"))
            assert client._channels.transport(0).name == "shm"
        channel = grpc.insecure_channel(_target(server))
        try:
            with pytest.raises(grpc.RpcError) as raised:
                ShmTransport.negotiate(channel, shm_dir, (("authorization", "Bearer wrong"),))
            assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED
        finally:
            channel.close()
        with (
            WeightStreamClient(_target(server), progress=False, transport="auto", shm_dir=shm_dir, token="x") as bad,
            pytest.raises(UnauthenticatedError),
        ):
            bad.load_state_dict("blocks")
    assert not [name for name in _entries(shm_dir) if name.startswith("weightstream-")]
