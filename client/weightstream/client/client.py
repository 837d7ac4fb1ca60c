"""WeightStreamClient: manifests, tensor iterators and in-place loads over one gRPC channel."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import grpc
import torch
from tqdm import tqdm

from weightstream import wire
from weightstream.client import replicas
from weightstream.client.errors import (
    FailedPreconditionError,
    IntegrityError,
    NotFoundError,
    UnavailableError,
    WeightStreamError,
    from_rpc_error,
)
from weightstream.client.fetch import FetchReport, fetch
from weightstream.client.manifest import (
    Manifest,
    ModelFileList,
    TensorInfo,
    TensorSlice,
    files_from_proto,
    manifest_from_proto,
)
from weightstream.client.placement import Destination, Placers
from weightstream.client.progress import byte_bar
from weightstream.client.retry import IDLE, RETRYABLE_CODES, IdleWatchdog, Outage, RetryPolicy
from weightstream.client.sharding import ShardSpec, sliced_manifest
from weightstream.client.targets import plan_targets
from weightstream.client.transport import ChunkRef, GrpcTransport, StreamCancel, Transport
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)

# Where the client finds a bearer token when none is passed.
TOKEN_ENV = "WEIGHTSTREAM_TOKEN"
# Where the client finds its shared-memory directory when none is passed.
SHM_DIR_ENV = "WEIGHTSTREAM_SHM_DIR"

# The reason a StreamCancel carries when the load itself stopped a stream (another stream failed,
# or the caller stopped iterating).
_STOPPED = "stopped"
# Transports a client may be asked for.
TRANSPORTS = ("auto", "grpc", "shm")

_CHANNEL_OPTIONS: list[tuple[str, int]] = [
    # A message carries up to MAX_CHUNK_BYTES of payload plus chunk descriptors; gRPC's default
    # limit of 4 MiB would refuse the server's larger messages.
    ("grpc.max_receive_message_length", wire.MAX_MESSAGE_BYTES),
    # Ping after 10 s without reads and close the connection when no answer comes within 5 s: a
    # server that died without closing its connection (power loss, a cut cable, a frozen node) is
    # noticed in about 15 s, not when the kernel's TCP retransmission timeout fires (about 15 min).
    # The stream then fails UNAVAILABLE and is resumed. The server accepts pings every 5 s
    # (grpc_server.py, min_ping_interval_without_data_ms), so these never earn a GOAWAY
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
    # Streams resumed after a failure, and bytes received again that had already landed.
    retries: int = 0
    resent_bytes: int = 0

    @property
    def gbps(self) -> float:
        """Gigabytes (10^9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


class WeightStreamClient:
    """A client of a weightstream service: one server, or several replicas.

    target is "host:port", a gRPC name such as "dns:///weightstream-headless:50051" that resolves
    to every replica, or several IP "host:port" addresses (a list, or joined by commas); calls are
    spread over the replicas (see weightstream.client.replicas).

    Use it as a context manager, or call close(). The channel is made on first use. One client may
    be used from several threads; each call runs its own stream.

    token is sent as "authorization: Bearer <token>" on every call; without one, the environment
    variable WEIGHTSTREAM_TOKEN is used when set. tls=True connects over TLS, verifying the server
    against ca_file (PEM; the system's roots when None); client_cert and client_key (PEM) are this
    client's certificate for servers that require mutual TLS. The files are read here, once.

    retry says how broken streams are resumed and how long GetManifest is retried on UNAVAILABLE
    (see RetryPolicy; on by default); None fails at the first error and turns the idle-stream
    deadline off. transport chooses the data path: "auto" (the default) uses shared memory when the
    server proves it sees shm_dir (default: the environment variable WEIGHTSTREAM_SHM_DIR) and
    gRPC otherwise; "shm" insists on shared memory; "grpc" never tries it.
    """

    def __init__(
        self,
        target: str | Sequence[str],
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
        retry: RetryPolicy | None = RetryPolicy(),  # noqa: B008 - frozen, one shared default
        transport: str = "auto",
        shm_dir: str | Path | None = None,
    ) -> None:
        self.target = target if isinstance(target, str) else ",".join(target)
        # Several replicas, or a name resolving to several: see weightstream.client.replicas.
        self._channel_target = replicas.channel_target(target)
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
        self._extra_channels: list[grpc.Channel] = []
        self._transports: dict[int, Transport] = {}
        self._lock = threading.Lock()
        if streams < 1:
            raise ValueError(f"streams must be at least 1, not {streams}")
        self._streams = streams
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {', '.join(TRANSPORTS)}, not {transport!r}")
        self._transport_kind = transport
        # Like the token, the shared-memory directory may come from the environment (a pod sets it once).
        shm_dir = shm_dir if shm_dir is not None else os.environ.get(SHM_DIR_ENV) or None
        self._shm_dir = Path(shm_dir) if shm_dir is not None else None
        if transport == "shm" and self._shm_dir is None:
            raise ValueError(f"transport='shm' needs shm_dir, or the environment variable {SHM_DIR_ENV}")
        # What OpenSharedMemory granted (max ring bytes), asked once per client; 0: use gRPC.
        self._shm_grant: int | None = None
        self._shm_lock = threading.Lock()
        self._retry = retry
        self._watchdog = IdleWatchdog(retry.idle_timeout) if retry is not None else None

    def __enter__(self) -> WeightStreamClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            channels = [c for c in (self._channel, *self._extra_channels) if c is not None]
            self._channel, self._stub = None, None
            self._extra_channels = []
            self._transports = {}
        for channel in channels:
            channel.close()
        if self._watchdog is not None:
            self._watchdog.close()

    @property
    def stub(self) -> pb_grpc.WeightStreamServiceStub:
        if self._stub is None:
            self._connect()
        assert self._stub is not None
        return self._stub

    def _transport_for(self, index: int) -> Transport:
        """The transport of stream index (0 is the main channel): the one place a stream's transport is chosen.

        Parallel streams of one load go over separate channels (separate TCP connections), which
        measured better than several streams sharing one connection.
        """
        with self._lock:
            found = self._transports.get(index)
        if found is not None:
            return found
        # "shm" and "auto": shared memory when the server proves it sees self._shm_dir (asked once,
        # on the main channel); "auto" falls back to gRPC, logged once by negotiate, "shm" raises.
        if self._transport_kind != "grpc":
            from weightstream.client.shm import SharedMemoryTransport

            with self._shm_lock:
                if self._shm_grant is None:
                    granted = None
                    if self._shm_dir is not None:
                        granted = SharedMemoryTransport.negotiate(
                            self._channel_at(0), self._shm_dir, self._metadata, required=self._transport_kind == "shm"
                        )
                    else:
                        logger.debug("shared memory not used: no shm_dir given and %s is not set", SHM_DIR_ENV)
                    self._shm_grant = granted.max_ring_bytes if granted is not None else 0
        made: Transport
        if self._shm_grant and self._shm_dir is not None:
            made = SharedMemoryTransport(self._channel_at(index), self._shm_dir, max_ring_bytes=self._shm_grant)
        else:
            made = GrpcTransport(self._channel_at(index))
        with self._lock:
            return self._transports.setdefault(index, made)

    def _channel_at(self, index: int) -> grpc.Channel:
        """Channel index: 0 is the main channel, others are extra ones made on first use."""
        if self._channel is None:
            self._connect()
        with self._lock:
            assert self._channel is not None
            if index == 0:
                return self._channel
            while len(self._extra_channels) < index:
                self._extra_channels.append(self._new_channel())
            return self._extra_channels[index - 1]

    def _connect(self) -> None:
        with self._lock:
            if self._channel is None:
                self._channel = self._new_channel()
                self._stub = pb_grpc.WeightStreamServiceStub(self._channel)

    def _new_channel(self) -> grpc.Channel:
        options = [*_CHANNEL_OPTIONS, *replicas.CHANNEL_OPTIONS]
        if self._credentials is None:
            return grpc.insecure_channel(self._channel_target, options=options)
        return grpc.secure_channel(self._channel_target, self._credentials, options=options)

    def manifest(self, model: str) -> Manifest:
        """Every tensor of model: name, dtype, shape, size and file; retried on UNAVAILABLE per the RetryPolicy."""
        outage = Outage(self._retry) if self._retry is not None else None
        while True:
            try:
                with self._translated():
                    response = self.stub.GetManifest(
                        pb.GetManifestRequest(model=model), timeout=self._timeout, metadata=self._metadata
                    )
                return manifest_from_proto(response)
            except UnavailableError as exc:
                delay = outage.next_delay() if outage is not None and exc.code == grpc.StatusCode.UNAVAILABLE else None
                if delay is None or _not_transient(exc):
                    raise
                assert self._retry is not None and outage is not None
                logger.warning(
                    "model %r: manifest from %s failed (%s), try %d of %d in %.2f s",
                    model,
                    self.target,
                    exc.message,
                    outage.failures + 1,
                    self._retry.attempts,
                    delay,
                )
                time.sleep(delay)

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
        self,
        model: str,
        *,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        slices: Mapping[str, TensorSlice] | ShardSpec | None = None,
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for the tensors of model (all, or names), each as soon as it is complete.

        Tensors are yielded in the order they complete, which is not the checkpoint's order. Each
        tensor is allocated on device when its first chunk arrives and is the caller's once yielded;
        memory held at once is bounded by the tensors in flight, not the model. With slices (by
        name, or a ShardSpec for one tensor-parallel rank) only those slices are sent and yielded.
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], not {device}")
        manifest = self.manifest(model)
        if slices is not None:
            manifest = sliced_manifest(manifest, slices)
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

    def load_into(
        self, module: torch.nn.Module, model: str, *, strict: bool = True, shard: ShardSpec | None = None
    ) -> LoadReport:
        """Write model's tensors into module's existing parameters and buffers, in place.

        Names, shapes and dtypes are checked against the module before any byte is written; with
        strict (the default) every module tensor must be in the checkpoint and every checkpoint
        tensor in the module. An error raised after writing began has partially_written=True and
        says how much of the module was written. With shard, module is one tensor-parallel rank:
        its split tensors have the shapes of that rank's slices, and only those bytes are sent.
        """
        started = time.perf_counter()
        manifest = self.manifest(model)
        if shard is not None:
            manifest = sliced_manifest(manifest, shard)
        plan = plan_targets(module, manifest, strict=strict)
        infos = {name: manifest[name] for name in plan.targets}
        dests = {name: Destination(name, tensor) for name, tensor in plan.targets.items()}
        received = 0
        tally = _Tally()
        try:
            for dest in self._receive(manifest, infos, dests.__getitem__, description=model, tally=tally):
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
        report = LoadReport(
            model,
            len(dests),
            received,
            seconds,
            plan.missing,
            plan.unexpected,
            transport=self._transport_for(0).name,
            retries=tally.retries,
            resent_bytes=tally.resent_bytes,
        )
        logger.info(
            "loaded %s into %s: %d tensors, %d bytes in %.3f s (%.2f GB/s), %d retries, %d bytes re-sent",
            model,
            type(module).__name__,
            report.tensors,
            report.bytes,
            seconds,
            report.gbps,
            report.retries,
            report.resent_bytes,
        )
        return report

    def _receive(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        *,
        description: str,
        tally: _Tally | None = None,
    ) -> Iterator[Destination]:
        """Stream infos' bytes into destinations; yield each destination once it is complete.

        Every chunk is checked (known tensor, CRC32C, bounds) before it is placed, and the streams
        are checked to have delivered every byte of every tensor. With streams > 1 the tensors are
        split into that many groups of about equal bytes, each received on its own channel and
        thread; destinations are yielded here, on the caller's thread, as they complete. A broken
        stream is resumed (see _receive_stream); tally counts its retries and re-sent bytes.
        """
        total = sum(info.nbytes for info in infos.values())
        groups = _split(infos, self._streams)
        tally = tally if tally is not None else _Tally()
        with self._translated(), byte_bar(total, description, self._progress) as bar:
            if len(groups) == 1:
                yield from self._receive_stream(manifest, groups[0], destination, bar, 0, StreamCancel(), tally)
                return
            yield from self._receive_parallel(manifest, groups, destination, bar, tally)

    def _receive_parallel(
        self,
        manifest: Manifest,
        groups: list[dict[str, TensorInfo]],
        destination: Callable[[str], Destination],
        bar: tqdm,
        tally: _Tally,
    ) -> Iterator[Destination]:
        """Run one stream per group on worker threads; relay their destinations and their first error."""
        done: queue.Queue[Destination | BaseException | None] = queue.Queue()
        stops = [StreamCancel() for _ in groups]

        def work(index: int, group: dict[str, TensorInfo]) -> None:
            try:
                for dest in self._receive_stream(manifest, group, destination, bar, index, stops[index], tally):
                    done.put(dest)
                    if stops[index].reason is not None:
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
            for stop in stops:
                stop.cancel(_STOPPED)
            for worker in workers:
                worker.join(timeout=30)

    def _receive_stream(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        bar: tqdm,
        index: int,
        stop: StreamCancel,
        tally: _Tally,
    ) -> Iterator[Destination]:
        """One stream of infos' tensors: place every chunk, yield each destination once complete.

        On a retryable failure (retry.RETRYABLE_CODES, or no message for idle_timeout seconds) the
        stream is asked again, after a backoff, for only what has not landed: whole tensors not
        begun, the missing ranges of those begun. Every request carries the manifest's revision,
        so a checkpoint that changed meanwhile ends the load (FailedPreconditionError) instead of
        mixing two versions. stop.cancel, from any thread, ends the stream and its retries.
        """
        pending = {name: info for name, info in infos.items() if info.nbytes}
        if not pending:
            return
        transport = self._transport_for(index)
        touched: dict[str, Destination] = {}
        outage = Outage(self._retry) if self._retry is not None else None
        stopped = threading.Event()
        stop.on_cancel(stopped.set)
        placers = Placers(self._chunk_bytes)
        try:
            while True:
                request = self._stream_request(manifest, infos, pending, touched)
                cancel = StreamCancel()
                stop.on_cancel(functools.partial(cancel.cancel, _STOPPED))
                watch = self._watchdog.watch(cancel) if self._watchdog is not None else None
                batches = transport.stream(request, self._metadata, cancel)
                try:
                    while True:
                        # The transport may give the last batch's memory back now (a slot to the server).
                        placers.settle()
                        if watch is not None:
                            watch.arm()
                        batch = next(batches, None)
                        if watch is not None:
                            watch.disarm()
                        if batch is None:
                            break
                        landed = 0
                        for chunk in batch:
                            placed = self._place(manifest, infos, destination, placers, chunk)
                            if placed is None:
                                continue
                            dest, new = placed
                            landed += new
                            touched[dest.name] = dest
                            if dest.complete and dest.name in pending:
                                placers.for_tensor(dest.buffer).finish(dest)
                                del pending[dest.name]
                                # Only partly landed tensors are kept for a resume: a complete one
                                # is the caller's (iter_tensors must not hold every tensor it yielded).
                                del touched[dest.name]
                                yield dest
                        bar.update(landed)
                        resent = sum(c.length for c in batch) - landed
                        if resent:
                            tally.add(resent_bytes=resent)
                        if landed and outage is not None:
                            outage.progressed()
                except grpc.RpcError as exc:
                    delay = self._retry_delay(manifest, exc, cancel, stop, outage, pending, touched)
                    tally.add(retries=1)
                    if stopped.wait(delay):
                        raise WeightStreamError(f"model {manifest.model!r}: the load was stopped") from exc
                    continue
                finally:
                    try:
                        placers.settle()  # before the transport unmaps what the copies read from
                    finally:
                        batches.close()
                    if watch is not None and self._watchdog is not None:
                        self._watchdog.unwatch(watch)
                break
        finally:
            placers.close()
        if pending:
            missing_bytes = _missing_bytes(pending, touched)
            raise IntegrityError(
                f"model {manifest.model!r}: the stream ended with {len(pending)} tensors incomplete "
                f"({missing_bytes} bytes missing), for example {sorted(pending)[0]!r}"
            )

    def _retry_delay(
        self,
        manifest: Manifest,
        exc: grpc.RpcError,
        cancel: StreamCancel,
        stop: StreamCancel,
        outage: Outage | None,
        pending: dict[str, TensorInfo],
        touched: dict[str, Destination],
    ) -> float:
        """Seconds to wait before resuming after exc; raises the error that ends the load instead."""
        code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
        idle = cancel.reason == IDLE
        if stop.reason is not None:
            raise WeightStreamError(f"model {manifest.model!r}: the load was stopped") from exc
        if code == grpc.StatusCode.FAILED_PRECONDITION:
            raise self._precondition_failed(manifest, exc) from exc
        if outage is None or not (idle or code in RETRYABLE_CODES):
            raise exc
        delay = outage.next_delay()
        assert self._retry is not None
        what = f"no message for {self._retry.idle_timeout:g} s" if idle else code.name
        missing = _missing_bytes(pending, touched)
        if delay is None:
            error = (
                UnavailableError(f"from {self.target}: {what}", code=code) if idle else from_rpc_error(exc, self.target)
            )
            raise type(error)(
                f"model {manifest.model!r}: {error.message}; gave up after {outage.failures} tries in "
                f"{outage.elapsed:.1f} s with {missing} bytes missing",
                code=error.code,
            ) from exc
        logger.warning(
            "model %r: stream from %s failed (%s), try %d of %d in %.2f s for the %d bytes missing",
            manifest.model,
            self.target,
            what,
            outage.failures + 1,
            self._retry.attempts,
            delay,
            missing,
        )
        return delay

    def _precondition_failed(self, manifest: Manifest, exc: grpc.RpcError) -> WeightStreamError:
        """FAILED_PRECONDITION on a stream: say so plainly when the checkpoint changed since the manifest."""
        error = from_rpc_error(exc, self.target)
        try:
            now = self.manifest(manifest.model)
        except WeightStreamError:
            return error
        if now.revision == manifest.revision:
            return error
        return FailedPreconditionError(
            f"model {manifest.model!r}: the checkpoint changed on the server during the load (revision "
            f"{manifest.revision} when the load began, {now.revision} now); the load stopped rather than mix "
            f"two versions ({error.message})"
        )

    def _stream_request(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        pending: dict[str, TensorInfo],
        touched: dict[str, Destination],
    ) -> pb.StreamTensorsRequest:
        """The request for what has not landed: whole pending tensors, or their missing ranges once begun."""
        sliced = any(info.slice is not None for info in infos.values())
        begun = bool(touched) or len(pending) < sum(1 for info in infos.values() if info.nbytes)
        everything = not begun and not sliced and len(infos) == len(manifest.tensors)
        tensors = []
        if not everything:
            for name, info in pending.items():
                dest = touched.get(name)
                ranges = [pb.ByteRange(start=s, end=e) for s, e in dest.landed.missing()] if dest is not None else []
                if info.slice is None:
                    tensors.append(pb.TensorRequest(name=name, ranges=ranges))
                else:
                    s = info.slice
                    piece = pb.TensorSlice(dim=s.dim, start=s.start, stop=s.stop)
                    tensors.append(pb.TensorRequest(name=name, ranges=ranges, slice=piece))
        return pb.StreamTensorsRequest(
            model=manifest.model,
            tensors=tensors,
            max_chunk_bytes=self._chunk_bytes,
            revision=manifest.revision,
        )

    def _place(
        self,
        manifest: Manifest,
        infos: dict[str, TensorInfo],
        destination: Callable[[str], Destination],
        placers: Placers,
        chunk: ChunkRef,
    ) -> tuple[Destination, int] | None:
        """Check one chunk (known tensor, bounds, CRC32C), write it into its tensor; (destination, new bytes).

        Copies per byte on this side (gRPC): gRPC's buffer -> the received message (bytes), message
        -> the tensor (one memmove; on CUDA, message -> pinned staging -> device). A chunk that
        lands again after a resume is written again, which is harmless; only its new bytes count.
        """
        info = infos.get(chunk.tensor)
        if info is None:
            raise IntegrityError(f"model {manifest.model!r}: received a chunk of unrequested tensor {chunk.tensor!r}")
        size = chunk.received
        end = chunk.offset + size
        if size != chunk.length or end > info.nbytes:
            raise IntegrityError(
                f"model {manifest.model!r}: tensor {chunk.tensor!r}: chunk at offset {chunk.offset} with "
                f"{size} bytes (stated {chunk.length}) does not fit its {info.nbytes} bytes"
            )
        if wire.crc32c_at(chunk.address, size) != chunk.crc32c:
            raise IntegrityError(
                f"model {manifest.model!r}: tensor {chunk.tensor!r}: CRC32C mismatch in the chunk at offset "
                f"{chunk.offset} ({size} bytes); the data was corrupted in transit"
            )
        if not size:
            return None
        dest = destination(chunk.tensor)
        placers.for_tensor(dest.buffer).place(dest, chunk.offset, chunk.address, size, chunk.region)
        dest.written = True
        return dest, dest.landed.add(chunk.offset, end)

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


class _Tally:
    """Retries and re-sent bytes of one load; its streams add to it from their own threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0
        self.resent_bytes = 0

    def add(self, *, retries: int = 0, resent_bytes: int = 0) -> None:
        with self._lock:
            self.retries += retries
            self.resent_bytes += resent_bytes


def _missing_bytes(pending: dict[str, TensorInfo], touched: dict[str, Destination]) -> int:
    return sum(
        touched[name].nbytes - touched[name].landed.covered if name in touched else info.nbytes
        for name, info in pending.items()
    )


# Failures to connect that no retry can mend: a TLS handshake refused, or a certificate not trusted.
_PERMANENT_CONNECT_ERRORS = ("handshake", "ssl", "certificate")


def _not_transient(error: UnavailableError) -> bool:
    """True for UNAVAILABLE that says the connection can never succeed as configured (TLS)."""
    message = error.message.lower()
    return any(word in message for word in _PERMANENT_CONNECT_ERRORS)


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
