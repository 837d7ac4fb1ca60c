"""WeightStreamClient: manifests, tensor iterators and in-place loads over one gRPC channel."""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
import torch
from tqdm import tqdm

from weightstream import framing, wire
from weightstream.client.errors import IntegrityError, NotFoundError, WeightStreamError, from_rpc_error
from weightstream.client.fetch import FetchReport, fetch
from weightstream.client.manifest import Manifest, ModelFileList, TensorInfo, files_from_proto, manifest_from_proto
from weightstream.client.placement import Destination, Placers
from weightstream.client.progress import byte_bar
from weightstream.client.targets import plan_targets
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Where the client finds a bearer token when none is passed.
TOKEN_ENV = "WEIGHTSTREAM_TOKEN"

STREAM_TENSORS_METHOD = "/weightstream.v1.WeightStreamService/StreamTensors"

_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    # A message carries up to MAX_CHUNK_BYTES of payload plus chunk descriptors; gRPC's default
    # limit of 4 MiB would refuse the server's larger messages.
    ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
    # Ping an idle connection every 30 s and give up after 10 s without an answer, so that a dead
    # server is noticed in seconds rather than when the kernel's TCP timeout fires (minutes).
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
]


@dataclass(frozen=True)
class LoadReport:
    """What load_into did."""

    model: str
    tensors: int
    bytes: int
    seconds: float
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    transport: str = "grpc"

    @property
    def gbps(self) -> float:
        """Gigabytes (10^9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightStreamClient:
    """A client of one weightstream server.

    Use it as a context manager, or call close(). The channel is made on first use. One client may
    be used from several threads; each call runs its own stream.

    token is sent as "authorization: Bearer <token>" on every call; without one, the environment
    variable WEIGHTSTREAM_TOKEN is used when set. tls=True connects over TLS, verifying the server
    against ca_file (PEM; the system's roots when None); client_cert and client_key (PEM) are this
    client's certificate for servers that require mutual TLS. The files are read here, once.
    """

    def __init__(
        self,
        target: str,
        *,
        token: str | None = None,
        tls: bool = False,
        ca_file: str | Path | None = None,
        client_cert: str | Path | None = None,
        client_key: str | Path | None = None,
        chunk_bytes: int | None = None,
        timeout: float | None = 30.0,
        progress: bool = True,
        streams: int = 1,
    ) -> None:
        self.target = target
        if token is None:
            token = os.environ.get(TOKEN_ENV)
        # A token read from a file or a variable often ends in a newline, which gRPC metadata refuses.
        token = token.strip() if token else None
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._credentials = _channel_credentials(tls, ca_file, client_cert, client_key)
        self._chunk_bytes = wire.clamp_chunk_bytes(chunk_bytes or 0)
        self._timeout = timeout
        self._progress = progress
        self._channel: grpc.Channel | None = None
        self._stub: pb_grpc.WeightStreamServiceStub | None = None
        self._stream_raw: grpc.UnaryStreamMultiCallable | None = None
        self._extra_channels: list[grpc.Channel] = []
        self._lock = threading.Lock()
        if streams < 1:
            raise ValueError(f"streams must be at least 1, not {streams}")
        self._streams = streams

    def __enter__(self) -> WeightStreamClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            channels = [c for c in (self._channel, *self._extra_channels) if c is not None]
            self._channel, self._stub, self._stream_raw = None, None, None
            self._extra_channels = []
        for channel in channels:
            channel.close()

    @property
    def stub(self) -> pb_grpc.WeightStreamServiceStub:
        if self._stub is None:
            self._connect()
        assert self._stub is not None
        return self._stub

    def _stream_callable(self, index: int) -> grpc.UnaryStreamMultiCallable:
        """The raw StreamTensors method on channel index: 0 is the main channel, others are extra ones.

        Parallel streams of one load go over separate channels (separate TCP connections), which
        measured better than several streams sharing one connection.
        """
        if self._stream_raw is None:
            self._connect()
        assert self._stream_raw is not None and self._channel is not None
        if index == 0:
            return self._stream_raw
        with self._lock:
            while len(self._extra_channels) < index:
                self._extra_channels.append(self._new_channel())
            channel = self._extra_channels[index - 1]
        return _raw_stream_method(channel)

    def _connect(self) -> None:
        with self._lock:
            if self._channel is None:
                self._channel = self._new_channel()
                self._stub = pb_grpc.WeightStreamServiceStub(self._channel)
                self._stream_raw = _raw_stream_method(self._channel)

    def _new_channel(self) -> grpc.Channel:
        if self._credentials is None:
            return grpc.insecure_channel(self.target, options=_CHANNEL_OPTIONS)
        return grpc.secure_channel(self.target, self._credentials, options=_CHANNEL_OPTIONS)

    def manifest(self, model: str) -> Manifest:
        """Every tensor of model: name, dtype, shape, size and file."""
        with self._translated():
            response = self.stub.GetManifest(
                pb.GetManifestRequest(model=model), timeout=self._timeout, metadata=self._metadata
            )
        return manifest_from_proto(response)

    def list_files(self, model: str) -> ModelFileList:
        """The files of model the server lets a client read whole: weight files and companion files."""
        with self._translated():
            response = self.stub.ListModelFiles(
                pb.ListModelFilesRequest(model=model), timeout=self._timeout, metadata=self._metadata
            )
        return files_from_proto(response)

    def read_file(
        self, model: str, name: str, *, offset: int = 0, revision: str = ""
    ) -> Iterator[tuple[bytes, int | None]]:
        """Yield (data, file_crc32c) pieces of model's file name from offset, in order, each CRC32C-checked.

        file_crc32c is None except on the last piece, where it is the server's CRC32C of the whole
        file from byte 0; a stream that ends without it raises IntegrityError. With revision, the
        server refuses (FailedPreconditionError) if the model's files changed since that listing.
        """
        request = pb.ReadModelFileRequest(
            model=model, file=name, offset=offset, revision=revision, max_chunk_bytes=self._chunk_bytes
        )
        where = f"model {model!r}, file {name!r}"
        expected = offset
        finished = False
        call = self.stub.ReadModelFile(request, metadata=self._metadata)
        try:
            with self._translated():
                for message in call:
                    if finished or message.offset != expected:
                        raise IntegrityError(f"{where}: received bytes at offset {message.offset}, expected {expected}")
                    data = message.data  # each access of a protobuf bytes field makes a new copy
                    if wire.crc32c(data) != message.crc32c:
                        raise IntegrityError(
                            f"{where}: CRC32C mismatch in the chunk at offset {message.offset} "
                            f"({len(data)} bytes); the data was corrupted in transit"
                        )
                    expected += len(data)
                    finished = message.HasField("file_crc32c")
                    yield data, message.file_crc32c if finished else None
        finally:
            call.cancel()
        if not finished:
            raise IntegrityError(f"{where}: the stream ended at offset {expected}, before the end of the file")

    def fetch(self, model: str, directory: str | Path, *, metadata_only: bool = False) -> FetchReport:
        """Download model's files into directory, resuming what an earlier fetch left; see client.fetch.fetch."""
        return fetch(self, model, directory, metadata_only=metadata_only, progress=self._progress)

    def iter_tensors(
        self, model: str, *, names: Iterable[str] | None = None, device: str | torch.device = "cpu"
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for the tensors of model (all, or names), each as soon as it is complete.

        Tensors are yielded in the order they complete, which is not the checkpoint's order. Each
        tensor is allocated on device when its first chunk arrives and is the caller's once yielded;
        memory held at once is bounded by the tensors in flight, not the model.
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], not {device}")
        manifest = self.manifest(model)
        infos = _select(manifest, names)
        in_flight: dict[str, Destination] = {}

        def destination(name: str) -> Destination:
            dest = in_flight.get(name)
            if dest is None:
                info = infos[name]
                dest = Destination(name, torch.empty(info.shape, dtype=info.dtype, device=device))
                in_flight[name] = dest
            return dest

        for info in infos.values():
            if info.nbytes == 0:
                yield info.name, torch.empty(info.shape, dtype=info.dtype, device=device)
        for dest in self._receive(manifest, infos, destination, description=f"{model}"):
            del in_flight[dest.name]
            yield dest.name, dest.target

    def load_state_dict(self, model: str, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of model, by name, in the checkpoint's order."""
        tensors = dict(self.iter_tensors(model, device=device))
        return {info.name: tensors[info.name] for info in self.manifest(model).tensors if info.name in tensors}

    def load_into(self, module: torch.nn.Module, model: str, *, strict: bool = True) -> LoadReport:
        """Write model's tensors into module's existing parameters and buffers, in place.

        Names, shapes and dtypes are checked against the module before any byte is written; with
        strict (the default) every module tensor must be in the checkpoint and every checkpoint
        tensor in the module. An error raised after writing began has partially_written=True and
        says how much of the module was written.
        """
        started = time.perf_counter()
        manifest = self.manifest(model)
        plan = plan_targets(module, manifest, strict=strict)
        infos = {name: manifest[name] for name in plan.targets}
        dests = {name: Destination(name, tensor) for name, tensor in plan.targets.items()}
        received = 0
        try:
            for dest in self._receive(manifest, infos, dests.__getitem__, description=model):
                received += dest.nbytes
        except WeightStreamError as exc:
            written = sum(1 for d in dests.values() if d.written)
            complete = sum(1 for d in dests.values() if d.complete and d.nbytes)
            if written:
                detail = (
                    f"the module was partly written: {complete} of {len(dests)} tensors complete, {written} touched"
                )
            else:
                detail = "the module was not written"
            raise exc.with_write_state(bool(written), detail) from exc
        seconds = time.perf_counter() - started
        report = LoadReport(model, len(dests), received, seconds, plan.missing, plan.unexpected)
        logger.info(
            "loaded %s into %s: %d tensors, %d bytes in %.3f s (%.2f GB/s)",
            model,
            type(module).__name__,
            report.tensors,
            report.bytes,
            seconds,
            report.gbps,
        )
        return report

    def _receive(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        *,
        description: str,
    ) -> Iterator[Destination]:
        """Stream infos' bytes into destinations; yield each destination once it is complete.

        Every chunk is checked (known tensor, CRC32C, bounds) before it is placed, and the streams
        are checked to have delivered every byte of every tensor. With streams > 1 the tensors are
        split into that many groups of about equal bytes, each received on its own channel and
        thread; destinations are yielded here, on the caller's thread, as they complete.
        """
        total = sum(info.nbytes for info in infos.values())
        groups = _split(infos, self._streams)
        with self._translated(), byte_bar(total, description, self._progress) as bar:
            if len(groups) == 1:
                yield from self._receive_stream(manifest, groups[0], destination, bar, self._stream_callable(0), [])
                return
            yield from self._receive_parallel(manifest, groups, destination, bar)

    def _receive_parallel(
        self,
        manifest: Manifest,
        groups: list[dict[str, TensorInfo]],
        destination: Callable[[str], Destination],
        bar: tqdm,
    ) -> Iterator[Destination]:
        """Run one stream per group on worker threads; relay their destinations and their first error."""
        done: queue.Queue[Destination | BaseException | None] = queue.Queue()
        stop = threading.Event()
        calls: list[grpc.Call] = []

        def work(index: int, group: dict[str, TensorInfo]) -> None:
            try:
                stream = self._stream_callable(index)
                for dest in self._receive_stream(manifest, group, destination, bar, stream, calls):
                    done.put(dest)
                    if stop.is_set():
                        return
            except BaseException as exc:  # relayed to the caller's thread
                done.put(exc)
            finally:
                done.put(None)

        workers = [
            threading.Thread(target=work, args=(i, group), name=f"weightstream-stream-{i}", daemon=True)
            for i, group in enumerate(groups)
        ]
        for worker in workers:
            worker.start()
        running = len(workers)
        try:
            while running:
                item = done.get()
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            stop.set()
            for call in list(calls):
                call.cancel()
            for worker in workers:
                worker.join(timeout=30)

    def _receive_stream(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        bar: tqdm,
        stream: grpc.UnaryStreamMultiCallable,
        calls: list[grpc.Call],
    ) -> Iterator[Destination]:
        """One stream of infos' tensors: place every chunk, yield each destination once complete.

        The call is added to calls, so that another thread can cancel it.
        """
        all_tensors = len(infos) == len(manifest.tensors)
        request = pb.StreamTensorsRequest(
            model=manifest.model,
            tensors=[] if all_tensors else [pb.TensorRequest(name=name) for name in infos],
            max_chunk_bytes=self._chunk_bytes,
            revision=manifest.revision,
        )
        pending = {name for name, info in infos.items() if info.nbytes}
        if not pending:
            return
        placers = Placers(self._chunk_bytes)
        call = stream(request, metadata=self._metadata)
        calls.append(call)
        try:
            with self._translated():
                for message in call:
                    try:
                        chunks = framing.decode_response(message)
                    except framing.FramingError as exc:
                        raise IntegrityError(f"model {manifest.model!r}: malformed stream message: {exc}") from exc
                    # The message's own memory: payloads are read from here, never sliced out.
                    base = ctypes.cast(ctypes.c_char_p(message), ctypes.c_void_p).value or 0
                    for chunk in chunks:
                        dest = self._place(manifest, infos, destination, placers, chunk, base)
                        bar.update(chunk.data_length)
                        if dest is not None and dest.complete and dest.name in pending:
                            placers.for_tensor(dest.buffer).finish(dest)
                            pending.discard(dest.name)
                            yield dest
        finally:
            call.cancel()
            placers.close()
        if pending:
            missing_bytes = sum(infos[name].nbytes for name in pending)
            raise IntegrityError(
                f"model {manifest.model!r}: the stream ended with {len(pending)} tensors incomplete "
                f"({missing_bytes} bytes missing), for example {sorted(pending)[0]!r}"
            )

    def _place(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        placers: Placers,
        chunk: framing.RawChunk,
        base: int,
    ) -> Destination | None:
        """Check one chunk (known tensor, bounds, CRC32C) and write its payload into its tensor.

        Copies per byte on this side: gRPC's buffer -> the received message (bytes), message ->
        the tensor (one memmove; on CUDA, message -> pinned staging -> device).
        """
        info = infos.get(chunk.tensor)
        if info is None:
            raise IntegrityError(f"model {manifest.model!r}: received a chunk of unrequested tensor {chunk.tensor!r}")
        size = chunk.data_length
        end = chunk.offset + size
        if size != chunk.length or end > info.nbytes:
            raise IntegrityError(
                f"model {manifest.model!r}: tensor {chunk.tensor!r}: chunk at offset {chunk.offset} with "
                f"{size} bytes (stated {chunk.length}) does not fit its {info.nbytes} bytes"
            )
        address = base + chunk.data_start
        if wire.crc32c_at(address, size) != chunk.crc32c:
            raise IntegrityError(
                f"model {manifest.model!r}: tensor {chunk.tensor!r}: CRC32C mismatch in the chunk at offset "
                f"{chunk.offset} ({size} bytes); the data was corrupted in transit"
            )
        if not size:
            return None
        dest = destination(chunk.tensor)
        placers.for_tensor(dest.buffer).place(dest, chunk.offset, address, size)
        dest.written = True
        dest.landed.add(chunk.offset, end)
        return dest

    @contextlib.contextmanager
    def _translated(self) -> Iterator[None]:
        """Turn gRPC errors raised inside into the client's exceptions (the one place that does)."""
        try:
            yield
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, self.target) from exc


def _channel_credentials(
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


def _raw_stream_method(channel: grpc.Channel) -> grpc.UnaryStreamMultiCallable:
    # The data stream is read as raw message bytes, decoded by framing.decode_response, so that
    # payloads are checksummed and placed straight from the received message.
    return channel.unary_stream(
        STREAM_TENSORS_METHOD,
        request_serializer=pb.StreamTensorsRequest.SerializeToString,
        response_deserializer=None,
    )


def _split(infos: dict[str, TensorInfo], streams: int) -> list[dict[str, TensorInfo]]:
    """infos cut into at most `streams` groups of about equal bytes (largest tensors first)."""
    sized = sorted((info for info in infos.values() if info.nbytes), key=lambda i: -i.nbytes)
    count = max(1, min(streams, len(sized)))
    groups: list[dict[str, TensorInfo]] = [{} for _ in range(count)]
    loads = [0] * count
    for info in sized:
        smallest = loads.index(min(loads))
        groups[smallest][info.name] = info
        loads[smallest] += info.nbytes
    for info in infos.values():
        if not info.nbytes:
            groups[0][info.name] = info
    return groups


def _select(manifest: Manifest, names: Iterable[str] | None) -> dict[str, TensorInfo]:
    if names is None:
        return dict(manifest.by_name)
    selected: dict[str, TensorInfo] = {}
    for name in names:
        if name not in manifest:
            raise NotFoundError(f"model {manifest.model!r} has no tensor {name!r}")
        selected[name] = manifest[name]
    return selected
