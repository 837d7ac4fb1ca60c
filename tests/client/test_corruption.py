"""A byte flipped on the wire is caught by the chunk's CRC32C.

The corruption is real network corruption: a TCP proxy on loopback between client and server
flips one byte of the server's stream inside a tensor's payload. Nothing in the client or the
server is patched.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from weightstream.client import IntegrityError, WeightStreamClient
from weightstream.samples import ParameterTree
from weightstream_server import WeightStreamServer

MODEL = "corruptible"
PATTERN = 0x5A
TENSOR_BYTES = 2 * 1024 * 1024


class FlippingProxy:
    """Forwards 127.0.0.1:port to upstream; flips one byte of the first long run of PATTERN from upstream.

    A run of 64 PATTERN bytes cannot hold an HTTP/2 frame header, so the flipped byte is always
    tensor payload, never framing. Every thread ends when either side closes, or at stop().
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.port = self.listener.getsockname()[1]
        self.flipped = threading.Event()
        self.stopping = threading.Event()
        self.threads: list[threading.Thread] = []
        self._start(self._accept)

    def _start(self, target, *args) -> None:  # type: ignore[no-untyped-def]
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self.threads.append(thread)

    def _accept(self) -> None:
        while not self.stopping.is_set():
            try:
                downstream, _ = self.listener.accept()
            except TimeoutError:
                continue
            upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._start(self._pipe, downstream, upstream, False)
            self._start(self._pipe, upstream, downstream, True)

    def _pipe(self, source: socket.socket, sink: socket.socket, corrupt: bool) -> None:
        source.settimeout(0.2)
        run = 0
        try:
            while not self.stopping.is_set():
                try:
                    data = source.recv(1 << 16)
                except TimeoutError:
                    continue
                if not data:
                    break
                if corrupt and not self.flipped.is_set():
                    buffer = bytearray(data)
                    for i, byte in enumerate(buffer):
                        run = run + 1 if byte == PATTERN else 0
                        if run == 64:
                            buffer[i - 32] ^= 0xFF
                            self.flipped.set()
                            break
                    data = bytes(buffer)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for s in (source, sink):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def stop(self) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(timeout=5)
        self.listener.close()


@pytest.fixture
def proxy(server: WeightStreamServer) -> Iterator[FlippingProxy]:
    proxy = FlippingProxy(server.port)
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def checkpoint(model_root: Path) -> dict[str, torch.Tensor]:
    state = {
        "first.weight": torch.arange(TENSOR_BYTES // 4, dtype=torch.int32).view(torch.float32),
        "patterned.weight": torch.full((TENSOR_BYTES,), PATTERN, dtype=torch.uint8),
    }
    (model_root / MODEL).mkdir()
    save_file(state, str(model_root / MODEL / "model.safetensors"))
    return state


def test_flipped_byte_is_an_integrity_error_and_says_module_was_partly_written(
    checkpoint: dict[str, torch.Tensor], proxy: FlippingProxy, target: str
) -> None:
    module = ParameterTree({n: (tuple(t.shape), t.dtype) for n, t in checkpoint.items()})
    with WeightStreamClient(f"127.0.0.1:{proxy.port}", chunk_bytes=256 * 1024, progress=False) as client:
        with pytest.raises(IntegrityError, match=r"'patterned.weight'.*CRC32C mismatch") as info:
            client.load_into(module, MODEL)
    assert proxy.flipped.is_set()
    assert info.value.partially_written is not None
    assert ("partly written" in str(info.value)) == info.value.partially_written

    # The same server, reached directly, still serves the model intact.
    with WeightStreamClient(target, progress=False) as direct:
        direct.load_into(module, MODEL)
    for name, param in module.named_parameters():
        assert torch.equal(param.view(torch.uint8), checkpoint[name].view(torch.uint8)), name


def test_clean_proxy_path_loads(checkpoint: dict[str, torch.Tensor], server: WeightStreamServer) -> None:
    """Control: with nothing to flip (no long PATTERN run), the same proxy passes the load intact."""
    proxy = FlippingProxy(server.port)
    try:
        with WeightStreamClient(f"127.0.0.1:{proxy.port}", progress=False) as client:
            got = dict(client.iter_tensors(MODEL, names=["first.weight"]))
        assert not proxy.flipped.is_set()
        assert torch.equal(got["first.weight"].view(torch.uint8), checkpoint["first.weight"].view(torch.uint8))
    finally:
        proxy.stop()


def test_a_bad_first_chunk_of_an_untouched_module_says_the_module_was_partly_written(
    model_root: Path, proxy: FlippingProxy
) -> None:
    """The chunk is copied and checksummed in one pass, so a chunk that fails its check has been
    written into its parameter: the error must say so even when nothing else was written."""
    state = {"patterned.weight": torch.full((TENSOR_BYTES,), PATTERN, dtype=torch.uint8)}
    (model_root / "patterned-only").mkdir()
    save_file(state, str(model_root / "patterned-only" / "model.safetensors"))
    module = ParameterTree({"patterned.weight": ((TENSOR_BYTES,), torch.uint8)})
    with WeightStreamClient(
        f"127.0.0.1:{proxy.port}", chunk_bytes=256 * 1024, progress=False, transport="grpc"
    ) as client:
        with pytest.raises(IntegrityError, match=r"CRC32C mismatch.*the module was partly written") as info:
            client.load_into(module, "patterned-only")
    assert proxy.flipped.is_set()
    assert info.value.partially_written is True
