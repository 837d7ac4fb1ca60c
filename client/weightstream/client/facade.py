"""WeightStreamClient: the facade that holds a client's configuration and runs its calls.

Channels and the choice of transport live in channels.py, one load in flight in session.py, file
reads in files.py and fetch.py; this module wires them together behind the public methods.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Literal

import grpc
import torch

from weightstream.client import peers, replicas, revisions, unchanged
from weightstream.client.channels import Channels, channel_credentials, data_tls_context
from weightstream.client.deltas import APPLIER_THREADS
from weightstream.client.errors import (
    FailedPreconditionError,
    NotFoundError,
    UnavailableError,
    WeightStreamError,
    translated,
)
from weightstream.client.fetch import FetchReport, fetch
from weightstream.client.files import RemoteFiles
from weightstream.client.loader_plan import WriteTarget
from weightstream.client.manifest import Manifest, ModelFileList, TensorInfo, TensorSlice, manifest_from_proto
from weightstream.client.options import ClientOptions
from weightstream.client.placement import Destination
from weightstream.client.prefault import Prefault
from weightstream.client.progress import is_rank_zero
from weightstream.client.retry import (
    READY_WAIT_S,
    IdleWatchdog,
    Outage,
    RetryPolicy,
    permanent_connect_error,
    reached_no_server,
)
from weightstream.client.session import DeltaSink, LoadSession, SessionConfig
from weightstream.client.sharding import ShardSpec, sliced_manifest
from weightstream.client.targets import match_targets
from weightstream.client.transports.tcp import DataPortUnusable
from weightstream.client.transports.tcp_publish import publish_over_data_port
from weightstream.protocol import wire
from weightstream.protocol.names import TransportChoice, TransportName
from weightstream.v1 import weightstream_pb2 as pb
from weightstream.v1 import weightstream_pb2_grpc as pb_grpc

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadReport:
    """What load_into did."""

    model: str
    tensors: int
    bytes: int
    seconds: float
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    transport: TransportName = "grpc"
    # Streams resumed after a failure that reached a server (RetryPolicy.attempts counts the same
    # tries), and bytes received again that had already landed.
    retries: int = 0
    resent_bytes: int = 0
    # The revision loaded (an update's new one).
    revision: str = ""
    # An update's chunks that came as XOR deltas and checked, their payload bytes, and the chunks
    # whose result failed its check (the module did not hold `since` there) and came again, whole.
    delta_chunks: int = 0
    delta_bytes: int = 0
    delta_fallbacks: int = 0
    # An update's bytes that GetChanges called unchanged and the module did not hold (their block's
    # CRC32C was not the new revision's): received too, and counted in bytes.
    stale_bytes: int = 0

    @property
    def gbps(self) -> float:
        """Gigabytes (10^9 bytes) per second."""
        return self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class PublishReport:
    """What the last publish did: its revision, the tensors and bytes of the part, what went on the wire
    (chunk payloads: the whole part, or the deltas of what changed), how, and how long it took."""

    model: str
    revision: str
    tensors: int
    bytes: int
    sent_bytes: int
    seconds: float
    transport: str
    delta_base: str = ""
    # Against a delta base: whether what changed went as XOR deltas (False: every chunk whole, as
    # deltas="auto" chose).
    encoded: bool = False
    # Whether this client now holds host copies of what it published, so that the next publish with
    # deltas sends what changed against them (deltas="auto": only when it will encode).
    host_copy: bool = False


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
    server proves it sees shm_dir (default: the environment variable WEIGHTSTREAM_SHM_DIR), else a
    TCP connection to the server's data port (TLS with the same files when tls=True), and gRPC
    when neither can be used (one INFO line says why); "shm" and "tcp" insist on theirs; "grpc"
    tries neither. The environment is read once, here (options.ClientOptions).
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
        transport: TransportChoice = "auto",
        shm_dir: str | Path | None = None,
    ) -> None:
        self.target = target if isinstance(target, str) else ",".join(target)
        # Several replicas, or a name resolving to several: see weightstream.client.replicas.
        channel_target = replicas.channel_target(target)
        self._options = ClientOptions.from_environ()
        if token is None:
            token = self._options.token
        # A token read from a file or a variable often ends in a newline, which gRPC metadata refuses.
        token = token.strip() if token else None
        metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        credentials = channel_credentials(tls, ca_file, client_cert, client_key)
        chunk_bytes = wire.clamp_chunk_bytes(chunk_bytes or 0)
        self._timeout = timeout
        self._progress = progress
        if streams < 1:
            raise ValueError(f"streams must be at least 1, not {streams}")
        self._channels = Channels(
            channel_target,
            credentials=credentials,
            metadata=metadata,
            transport=transport,
            shm_dir=Path(shm_dir) if shm_dir is not None else self._options.shm_dir,
            data_tls=data_tls_context(tls, ca_file, client_cert, client_key),
        )
        self._files = RemoteFiles(self._channels, self.target, chunk_bytes=chunk_bytes, timeout=timeout)
        self._retry = retry
        self._watchdog = IdleWatchdog(retry.idle_timeout) if retry is not None else None
        self._session_config = SessionConfig(
            channels=self._channels,
            target=self.target,
            chunk_bytes=chunk_bytes,
            streams=streams,
            retry=retry,
            watchdog=self._watchdog,
            current_manifest=self.manifest,
        )
        # What publish(deltas=True) published last, per (model, part): the base of the next one.
        self._published: dict[tuple[str, int], revisions.HeldPublish] = {}
        # deltas="auto": per (model, part), how its publishes send what changed.
        self._send_choices: dict[tuple[str, int], revisions.SendChoice] = {}
        # What the last publish from this client did (None before the first).
        self.last_publish: PublishReport | None = None

    def __enter__(self) -> WeightStreamClient:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def transport(self) -> TransportName:
        """The data path this client's streams use now: "shm", "tcp" or "grpc" (negotiated on first use)."""
        return self._channels.transport(0).name

    def close(self) -> None:
        self._channels.close()
        if self._watchdog is not None:
            self._watchdog.close()

    @property
    def stub(self) -> pb_grpc.WeightStreamServiceStub:
        return self._channels.stub

    @property
    def channel(self) -> grpc.Channel:
        """The main gRPC channel (made on first use), for calls this client does not wrap, such as health checks."""
        return self._channels.channel(0)

    def manifest(self, model: str, *, revision: str = "") -> Manifest:
        """Every tensor of model (of its current revision, or the kept one named): name, dtype, shape,
        size and file; retried on UNAVAILABLE per the RetryPolicy.

        A failure that found no server (one still starting) is waited out within the outage's
        total_deadline and is not a try; see RetryPolicy.
        """
        outage = Outage(self._retry) if self._retry is not None else None
        waiting = False  # for a server that was not there: warned once
        while True:
            try:
                with translated(self.target):
                    response = self.stub.GetManifest(
                        pb.GetManifestRequest(model=model, revision=revision),
                        timeout=self._timeout,
                        metadata=self._channels.metadata,
                    )
                return manifest_from_proto(response)
            except UnavailableError as exc:
                unavailable = exc.code == grpc.StatusCode.UNAVAILABLE
                reached = not reached_no_server(exc.message)
                delay = outage.next_delay(reached=reached) if outage is not None and unavailable else None
                if delay is None or permanent_connect_error(exc.message):
                    raise
                assert self._retry is not None and outage is not None
                # As a load's stream does (session._Stream._pause): after a try that reached a
                # server, its backoff; after one that found none, no pause once one connects.
                if reached:
                    waiting = False
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
                else:
                    (logger.info if waiting else logger.warning)(
                        "model %r: no server at %s for %.1f s (%s); waiting for one, at most %.0f s more",
                        model,
                        self.target,
                        outage.elapsed,
                        exc.message,
                        outage.remaining,
                    )
                    waiting = True
                    self._channels.wait_ready(0, min(max(delay, READY_WAIT_S), outage.remaining))

    def list_files(self, model: str) -> ModelFileList:
        """The files of model the server lets a client read whole: weight files and companion files."""
        return self._files.list_files(model)

    def read_file(
        self, model: str, name: str, *, offset: int = 0, revision: str = "", length: int = 0
    ) -> Iterator[tuple[bytes, int | None]]:
        """(data, file_crc32c) pieces of model's file name from offset, each checked; see RemoteFiles.read_file."""
        return self._files.read_file(model, name, offset=offset, revision=revision, length=length)

    def fetch(self, model: str, directory: str | Path, *, metadata_only: bool = False) -> FetchReport:
        """Download model's files into directory, resuming what an earlier fetch left; see client.fetch.fetch."""
        return fetch(self._files, model, directory, metadata_only=metadata_only, progress=self._shows_progress())

    def iter_tensors(
        self,
        model: str,
        *,
        names: Iterable[str] | None = None,
        device: str | torch.device = "cpu",
        slices: Mapping[str, TensorSlice] | ShardSpec | None = None,
        revision: str = "",
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield (name, tensor) for the tensors of model (all, or names; of its current revision, or
        the kept one named), each as soon as it is complete.

        Tensors are yielded in the order they complete, which is not the checkpoint's order. Each
        tensor is allocated on device when its first chunk arrives and is the caller's once yielded;
        memory held at once is bounded by the tensors in flight, not the model. With slices (by
        name, or a ShardSpec for one tensor-parallel rank) only those slices are sent and yielded.
        """
        device = torch.device(device)
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda[:N], not {device}")
        manifest = self.manifest(model, revision=revision)
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
        session = LoadSession(self._session_config, manifest, infos, destination)
        for dest in session.receive(description=model, progress=self._shows_progress()):
            del in_flight[dest.name]
            yield dest.name, dest.target

    def load_state_dict(self, model: str, *, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """Every tensor of model, by name, in the checkpoint's order."""
        tensors = dict(self.iter_tensors(model, device=device))
        return {info.name: tensors[info.name] for info in self.manifest(model).tensors if info.name in tensors}

    def load_into(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        model: str,
        *,
        strict: bool = True,
        shard: ShardSpec | Mapping[str, TensorSlice] | None = None,
        revision: str = "",
    ) -> LoadReport:
        """Write model's tensors (of its current revision, or the kept one named) into module's existing
        parameters and buffers (or a mapping's tensors, by name), in place.

        Names, shapes and dtypes are checked against the module before any byte is written; with
        strict (the default) every module tensor must be in the checkpoint and every checkpoint
        tensor in the module. An error raised after writing began has partially_written=True and
        says how much of the module was written. With shard (a ShardSpec, or a slice per tensor name),
        module is one tensor-parallel rank: its split tensors have the shapes of that rank's slices,
        and only those bytes are sent.
        """
        started = time.perf_counter()
        manifest = self.manifest(model, revision=revision)
        if shard is not None:
            manifest = sliced_manifest(manifest, shard)
        matched = match_targets(module, manifest, strict=strict)
        dests = {name: Destination(name, tensor) for name, tensor in matched.targets.items()}
        report = self._receive_into(model, manifest, dests, started, matched.missing, matched.unexpected)
        logger.info(
            "loaded %s into %s: %d tensors, %d bytes in %.3f s (%.2f GB/s), %d retries, %d bytes re-sent",
            model,
            type(module).__name__ if isinstance(module, torch.nn.Module) else "tensors",
            report.tensors,
            report.bytes,
            report.seconds,
            report.gbps,
            report.retries,
            report.resent_bytes,
        )
        return report

    def load_targets(
        self, model: str, targets: Mapping[str, WriteTarget], *, manifest: Manifest | None = None
    ) -> LoadReport:
        """Write the parts of model's tensors that targets name straight into their views, in place.

        Each WriteTarget asks for one slice of its tensor (or all of it) and names the views it is
        copied into (loader_plan.plan_loads finds them for an engine's own loader); only those
        bytes are sent. manifest: the one the targets were planned from (default: asked now); the
        load is of its revision, so a model changed since fails rather than mixing. Errors are as
        for load_into, partially_written included.
        """
        started = time.perf_counter()
        manifest = manifest or self.manifest(model)
        unknown = sorted(set(targets) - set(manifest.by_name))
        if unknown:
            raise NotFoundError(f"model {model!r} has no tensors {unknown[:5]}")
        slices = {name: target.slice for name, target in targets.items() if target.slice is not None}
        manifest = sliced_manifest(manifest, slices)
        dests: dict[str, Destination] = {}
        for name, target in targets.items():
            info = manifest[name]
            first, *also = target.views
            for view in target.views:
                if view.numel() * info.dtype.itemsize != info.nbytes:
                    raise ValueError(
                        f"model {model!r}: tensor {name!r}: a view of {view.numel()} elements cannot hold "
                        f"{list(info.shape)} of {info.dtype}"
                    )
            dests[name] = Destination(name, first, dtype=info.dtype, also=tuple(also))
        return self._receive_into(model, manifest, dests, started)

    def publish(
        self,
        model: str,
        named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
        *,
        revision: str | None = None,
        part: int = 0,
        parts: int = 1,
        new_layout: bool = False,
        deltas: bool | Literal["auto"] = False,
    ) -> str:
        """Publish named_tensors (full, unsharded, the checkpoint's names; CPU or CUDA) as model's next
        revision, held in the server's memory; the revision's name once it is current.

        Atomic: engines see the revision only once every tensor (of every part) arrived whole and
        checked; a publish that fails leaves the current revision as it was. Several trainer ranks
        may each publish a part (part of parts, disjoint tensors, the same revision name): each call
        returns once the whole revision is current. Unless new_layout, the names, dtypes and shapes
        must be the current revision's. Errors: PermissionDeniedError (the server takes no
        publishes, or the token is not a publisher's), AbortedError (another revision of the model
        is being published), InvalidArgumentError (a tensor that differs, named).

        With deltas, this client keeps a host copy of what it published (memory of the tensors'
        size) and the next publish of the model (the same part) sends only what changed since:
        chunks equal to the copy are skipped, the others go as XOR deltas where that is smaller;
        the server starts the revision from the one it holds. Where the server no longer keeps that
        revision, the publish goes whole; after a publish that failed, the next one does too.
        deltas="auto" sends what changed as deltas, or every chunk whole (no host copy compared, none
        brought up to date: its memory stays allocated), whichever took less time in its recent
        publishes (revisions.SendChoice): on a fast link with few cores to spare, finding and
        encoding what changed can cost more than sending it all. Either way the server starts the
        revision from the one before and keeps what was sent for engines updating from there, so
        that none of them waits for a delta to be computed.
        """
        if isinstance(deltas, str) and deltas != "auto":
            raise ValueError(f'deltas must be True, False or "auto", not {deltas!r}')
        started = time.perf_counter()
        tensors = revisions.named_list(named_tensors)
        key = (model, part)
        held = self._published.get(key) if deltas else None
        choice = self._send_choices.setdefault(key, revisions.SendChoice()) if deltas == "auto" else None
        # Whether what changed goes as deltas: only against host copies that hold the base's bytes.
        encode = (choice.encode() if choice is not None else True) and (held is None or held.current)
        chunk_bytes = self._session_config.chunk_bytes
        sent = [0]  # payload bytes of the chunks sent, by the try that succeeded
        delta_base = held.revision if held is not None else ""
        try:
            with translated(self.target):
                try:
                    response, how = self._publish_part(
                        model, tensors, revision, part, parts, new_layout, held, chunk_bytes, sent, encode
                    )
                except grpc.RpcError as exc:
                    if held is None or exc.code() != grpc.StatusCode.NOT_FOUND:
                        raise
                    logger.warning(
                        "publish of %s: the server no longer keeps %s; publishing whole", model, held.revision
                    )
                    delta_base = ""
                    response, how = self._publish_part(
                        model, tensors, revision, part, parts, new_layout, None, chunk_bytes, sent
                    )
        except BaseException:
            # The host copy may hold some of these tensors' bytes by now: the next publish goes whole.
            self._published.pop(key, None)
            raise
        nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        if choice is not None and delta_base:
            choice.record(encode, time.perf_counter() - started, nbytes)
        if deltas and (choice is None or choice.encode()):
            # Out of the map while its copies change: should after() fail midway, no later publish
            # takes copies that hold some of this revision's bytes for the old one's.
            self._published.pop(key, None)
            self._published[key] = revisions.HeldPublish.after(
                held, str(response.revision), tensors, synced=bool(delta_base) and encode
            )
        elif deltas:
            # deltas="auto" sends the next publish whole: against this revision, with no host copy to update.
            copies = held.tensors if held is not None else {}
            self._published[key] = revisions.HeldPublish(str(response.revision), copies, current=False)
        else:
            self._published.pop(key, None)
        seconds = time.perf_counter() - started
        self.last_publish = PublishReport(
            model,
            str(response.revision),
            len(tensors),
            nbytes,
            sent[0],
            seconds,
            how,
            delta_base,
            encode and bool(delta_base),
            bool(deltas) and self._published[key].current,
        )
        logger.info(
            "published %s revision %s: %d tensors, %d bytes in %.3f s (%.2f GB/s) over %s%s",
            model,
            response.revision,
            len(tensors),
            nbytes,
            seconds,
            nbytes / seconds / 1e9 if seconds else 0.0,
            how,
            (
                f", what changed since {delta_base} ({sent[0]} bytes sent)"
                if encode
                else f", every chunk whole against {delta_base}"
            )
            if delta_base
            else "",
        )
        return str(response.revision)

    def _publish_part(
        self,
        model: str,
        tensors: list[tuple[str, torch.Tensor]],
        revision: str | None,
        part: int,
        parts: int,
        new_layout: bool,
        held: revisions.HeldPublish | None,
        chunk_bytes: int,
        sent: list[int],
        encode: bool = True,
    ) -> tuple[pb.PublishResponse, str]:
        """One publish of tensors (whole, or what changed since held, as deltas where encode); the answer
        and how it went. sent[0]: the payload bytes of the chunks it sent."""
        start = revisions.publish_start(
            model,
            tensors,
            revision=revision or "",
            part=part,
            parts=parts,
            new_layout=new_layout,
            delta_base=held.revision if held is not None else "",
        )
        # Not encoding (deltas="auto"): every chunk whole, against held's revision, nothing compared.
        base = held.tensors if held is not None and encode else None
        sent[0] = 0
        response = self._publish_over_data_port(
            start, _counted(revisions.publish_chunks(tensors, chunk_bytes, base), sent)
        )
        if response is not None:
            return response, "the data port"
        sent[0] = 0
        requests = revisions.publish_requests(
            start, _counted(revisions.publish_chunks(tensors, chunk_bytes, base), sent)
        )
        return next(iter(self.stub.PublishTensors(requests, metadata=self._channels.metadata))), "gRPC"

    def _publish_over_data_port(
        self, start: pb.PublishStart, chunks: Iterator[revisions.OutChunk]
    ) -> pb.PublishResponse | None:
        """The publish over the data port (transport "auto" or "tcp"); None: it goes over gRPC."""
        transport = self._channels.data_port()
        if transport is None:
            return None
        try:
            return publish_over_data_port(
                self.stub,
                transport,
                start,
                chunks,
                metadata=self._channels.metadata,
            )
        except DataPortUnusable as exc:
            if transport.fallback is None:
                raise FailedPreconditionError(
                    f"model {start.model!r}: the tcp transport cannot be used to publish: {exc}"
                ) from None
            transport.fallback.fall_back(str(exc))
        return None

    def changes(self, model: str, *, since: str, revision: str = "") -> revisions.Changes:
        """What changed in model from revision since to the current one (or the one named), per tensor."""
        with translated(self.target):
            response = self.stub.GetChanges(
                pb.GetChangesRequest(model=model, since=since, revision=revision),
                timeout=self._timeout,
                metadata=self._channels.metadata,
            )
        return revisions.changes_from_proto(response)

    def watch(self, model: str, *, after: str = "", peer_port: int = 0) -> Iterator[revisions.RevisionEvent]:
        """model's current revision (once it is not after), then each new one as it becomes current.

        Runs until the caller stops iterating (the call is then cancelled) or the server ends it.
        peer_port: this caller serves StreamRevisionBlocks to peers on that port (a sidecar with
        --peers); each published revision's event then names the peer to take its blocks from.
        """
        with translated(self.target):
            call = self.stub.WatchModel(
                pb.WatchModelRequest(model=model, after=after, peer_port=peer_port), metadata=self._channels.metadata
            )
            try:
                for response in call:
                    yield revisions.event_from_proto(response)
            finally:
                call.cancel()

    def block_hashes(self, model: str, revision: str) -> dict[str, tuple[bytes, ...]]:
        """The BLAKE3 hash of each DIGEST_BLOCK_BYTES block of each tensor of revision, by tensor, in order."""
        with translated(self.target):
            call = self.stub.GetBlockHashes(
                pb.GetBlockHashesRequest(model=model, revision=revision),
                timeout=self._timeout,
                metadata=self._channels.metadata,
            )
            return {response.tensor: tuple(response.hashes) for response in call}

    def revision_blocks(
        self,
        model: str,
        revision: str,
        tensors: Sequence[str],
        *,
        first_block: int = 0,
        refused_peer: str = "",
        keepalive_ms: int = 0,
        since: str = "",
        wanted: bytes = b"",
    ) -> peers.BlockStream:
        """The blocks of tensors of a published revision as this server holds them, from first_block.

        What arrives is the server's word, unchecked: check each block against the block_hashes of a
        server you trust (peers.BlockStream says how to cancel the stream). keepalive_ms > 0: the stream
        also yields None for each keep-alive, which a server sends about that often while it waits for
        the next block itself (one that predates them sends none). wanted: a bitmap of the blocks to send
        (bit i % 8 of byte i / 8; empty: all); since: a revision the caller holds, against whose blocks
        the server may send deltas (a server that predates both sends every block whole)."""
        request = pb.StreamRevisionBlocksRequest(
            model=model,
            revision=revision,
            tensors=list(tensors),
            first_block=first_block,
            refused_peer=refused_peer,
            keepalive_ms=keepalive_ms,
            since=since,
            wanted=wanted,
        )
        call = self.stub.StreamRevisionBlocks(request, metadata=self._channels.metadata)
        return peers.BlockStream(self.target, call, keepalives=keepalive_ms > 0)

    def update_into(
        self,
        module: torch.nn.Module | Mapping[str, torch.Tensor],
        model: str,
        *,
        since: str,
        revision: str = "",
        strict: bool = True,
        shard: ShardSpec | Mapping[str, TensorSlice] | None = None,
        deltas: bool = True,
        verify_unchanged: bool | None = None,
        delta_sink: DeltaSink | None = None,
    ) -> LoadReport:
        """Write only what changed in model since revision `since` (which module holds) into its
        parameters (or a mapping's tensors, by name), in place; the report names the new revision, the
        tensors and bytes received.

        The server says which byte ranges changed (per-block CRC32Cs of both revisions); a tensor
        written straight into its parameter receives only those, one written through staging (another
        dtype, a strided view, a slice not along dim 0) all of its slice. With deltas (the default),
        a server that holds `since` in memory sends changed chunks of tensors written straight in as
        XOR deltas against it where that is smaller; each result is checked against the new
        revision's CRC32C, and a chunk that fails (the parameter did not hold `since` there) comes
        again whole (report.delta_fallbacks). An error raised after writing began has
        partially_written=True: the module then holds some tensors of each revision, and calling
        update_into again with the same since completes it.

        verify_unchanged: whether the bytes kept as unchanged are checked first against the new
        revision's block CRC32Cs (GetChanges carries them); blocks that differ (the module did not
        hold since there) are received too (report.stale_bytes), so the module ends holding the
        revision reported whatever it held. None (the default) checks parameters in host memory and
        trusts since for those on a device (the check would copy them to the host); True checks both;
        False trusts since. What cannot be checked is always trusted: see weightstream.client.unchanged.

        delta_sink: called with (tensor, offset, length, encoding, payload) of each chunk that came as a
        delta and checked, from the receiving threads (a tier keeps them to serve its own clients).
        """
        started = time.perf_counter()
        changes = self.changes(model, since=since, revision=revision)
        full = self.manifest(model, revision=changes.revision)
        manifest = sliced_manifest(full, shard) if shard is not None else full
        matched = match_targets(module, manifest, strict=strict)
        # Per target: its destination and the ranges kept as unchanged (None: none).
        plans: dict[str, tuple[Destination, list[tuple[int, int]] | None]] = {}
        checks: list[unchanged.Kept] = []
        unchecked = 0  # tensors kept without block CRC32Cs from the server to check them by
        for name, target in matched.targets.items():
            info = manifest[name]
            dest = Destination(name, target)
            if dest.staged:
                if name not in changes.tensors:
                    continue  # its bytes are converted, not the checkpoint's: kept unchecked
                keep = None
            else:
                keep = revisions.unchanged_ranges(info, full[name], changes.tensors.get(name, []))
            start = revisions.run_start(info, full[name])
            checked = verify_unchanged or (verify_unchanged is None and dest.buffer.device.type == "cpu")
            if keep and checked and start is not None:
                crcs = changes.blocks.get(name)
                if crcs is None:
                    unchecked += 1
                else:
                    unchanged.check_crcs(model, name, full[name].nbytes, changes.block_bytes, crcs)
                    checks.append(unchanged.Kept(name, dest.buffer, keep, start, full[name].nbytes, crcs))
            plans[name] = (dest, keep)
        if unchecked:
            logger.info("update of %s: the server sent no block CRC32Cs of %d kept tensors (trusted)", model, unchecked)
        dests: dict[str, Destination] = {}
        landed: dict[str, list[tuple[int, int]]] = {}
        # Tensors whose parameters hold since's bytes in place, of the same layout: deltas apply.
        held: set[str] = set()
        changed_bytes = 0
        for name, (dest, keep) in plans.items():
            info = manifest[name]
            if keep is not None and sum(e - s for s, e in keep) == info.nbytes:
                continue  # this rank's slice did not change
            if keep:
                landed[name] = keep
            if deltas and not dest.staged and changes.tensors.get(name) is not None:
                held.add(name)
            changed_bytes += revisions.changed_bytes(info, keep)
            dests[name] = dest
        # The kept bytes are checked while the changed ones arrive: the load writes none of them (they
        # count as landed; a chunk there is refused), and the check reads nothing else. An error leaves
        # once the check has stopped reading the module (the pool's exit waits for it).
        with ThreadPoolExecutor(1, thread_name_prefix="weightstream-unchanged") as background:
            checking = background.submit(unchanged.stale, checks, changes.block_bytes, APPLIER_THREADS)
            report = self._receive_into(
                model,
                manifest,
                dests,
                started,
                matched.missing,
                matched.unexpected,
                landed=landed,
                delta_base=changes.since if held else "",
                delta_tensors=frozenset(held),
                delta_sink=delta_sink,
            )
            stale = checking.result()
        report = dataclasses.replace(
            report, bytes=changed_bytes, revision=changes.revision, seconds=time.perf_counter() - started
        )
        if stale:
            targets = {name: plans[name][0].target for name in stale}
            again = self._receive_stale(model, manifest, targets, stale, started, bool(dests))
            stale_bytes = sum(e - s for ranges in stale.values() for s, e in ranges)
            report = dataclasses.replace(
                report,
                tensors=len(dests.keys() | stale.keys()),
                bytes=changed_bytes + stale_bytes,
                seconds=again.seconds,
                retries=report.retries + again.retries,
                resent_bytes=report.resent_bytes + again.resent_bytes,
                stale_bytes=stale_bytes,
            )
        logger.info(
            "updated %s from %s to %s: %d tensors, %d bytes in %.3f s (%d chunks as deltas of %d bytes, %d fell back; "
            "%d bytes kept as unchanged were not since's)",
            model,
            since,
            changes.revision,
            report.tensors,
            report.bytes,
            report.seconds,
            report.delta_chunks,
            report.delta_bytes,
            report.delta_fallbacks,
            report.stale_bytes,
        )
        return report

    def _receive_stale(
        self,
        model: str,
        manifest: Manifest,
        targets: dict[str, torch.Tensor],
        stale: dict[str, list[tuple[int, int]]],
        started: float,
        written: bool,
    ) -> LoadReport:
        """Receive the stale ranges of targets (kept as unchanged by an update, but not the new revision's
        bytes there), whole; written: whether the update wrote into the module before."""
        dests = {name: Destination(name, targets[name]) for name in stale}
        landed = {name: unchanged.without([(0, dests[name].nbytes)], ranges) for name, ranges in stale.items()}
        logger.warning(
            "update of %s: %d bytes of %d tensors that did not change since the revision named were not that "
            "revision's in the module (their block CRC32Cs differ); fetching them",
            model,
            sum(e - s for ranges in stale.values() for s, e in ranges),
            len(stale),
        )
        return self._receive_into(model, manifest, dests, started, landed=landed, written_before=written)

    def _receive_into(
        self,
        model: str,
        manifest: Manifest,
        dests: dict[str, Destination],
        started: float,
        missing: list[str] | None = None,
        unexpected: list[str] | None = None,
        landed: Mapping[str, list[tuple[int, int]]] | None = None,
        delta_base: str = "",
        delta_tensors: frozenset[str] = frozenset(),
        written_before: bool = False,
        delta_sink: DeltaSink | None = None,
    ) -> LoadReport:
        """Receive dests' tensors of manifest into them (but the landed ranges; delta_tensors' may come as
        deltas against delta_base); the report, or the error with the write state (written_before: the
        call this receive is part of wrote into the module already)."""
        infos = {name: manifest[name] for name in dests}
        session = LoadSession(
            self._session_config, manifest, infos, dests.__getitem__, landed, delta_base, delta_tensors, delta_sink
        )
        received = 0
        try:
            # Fresh host memory faulted in on a helper thread while the first bytes are on their way.
            with Prefault(dests.values()):
                for dest in session.receive(description=model, progress=self._shows_progress()):
                    received += dest.nbytes
        except WeightStreamError as exc:
            written = sum(1 for d in dests.values() if d.written)
            complete = sum(1 for d in dests.values() if d.complete and d.nbytes)
            if written:
                detail = (
                    f"the module was partly written: {complete} of {len(dests)} tensors complete, {written} touched"
                )
            elif written_before:
                detail = "the module was partly written (before these tensors)"
            else:
                detail = "the module was not written"
            raise exc.with_write_state(bool(written) or written_before, detail) from exc
        return LoadReport(
            model,
            len(dests),
            received,
            time.perf_counter() - started,
            missing or [],
            unexpected or [],
            transport=self.transport,
            retries=session.retries,
            resent_bytes=session.resent_bytes,
            revision=manifest.revision,
            delta_chunks=session.delta_chunks,
            delta_bytes=session.delta_bytes,
            delta_fallbacks=session.delta_fallbacks,
        )

    def _shows_progress(self) -> bool:
        """Whether a call draws a progress bar: asked for, and on rank 0."""
        return self._progress and is_rank_zero(self._options)


def _select(manifest: Manifest, names: Iterable[str] | None) -> dict[str, TensorInfo]:
    if names is None:
        return dict(manifest.by_name)
    selected: dict[str, TensorInfo] = {}
    for name in names:
        if name not in manifest:
            raise NotFoundError(f"model {manifest.model!r} has no tensor {name!r}")
        selected[name] = manifest[name]
    return selected


def _counted(chunks: Iterator[revisions.OutChunk], sent: list[int]) -> Iterator[revisions.OutChunk]:
    """chunks, their payload bytes added to sent[0] as they are taken."""
    for chunk in chunks:
        sent[0] += len(chunk.payload)
        yield chunk
