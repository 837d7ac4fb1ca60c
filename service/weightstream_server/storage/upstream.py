"""Another weightstream server as a source (--upstream): the models this server does not hold itself.

The upstream is asked through weightstream's own client, over gRPC, with its own token and TLS
settings (--upstream-token-file, --upstream-tls, ...): ListModelFiles gives a model's files, their
sizes and versions (so this server's revision of a model is its upstream's), and ReadModelFile their
bytes (over the upstream's data port when it has one, else in the call's messages), each piece
checked against its CRC32C as it arrives and a read to the end of a file against the whole file's.
Manifests are built here from the headers so read, as for any source.

Every failure of a call to the upstream is an UpstreamError that keeps the upstream's status code
and names the upstream first, so a client can tell which tier failed.

Concurrency: one client (one channel) serves every thread of the server; each read runs its own call.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from weightstream.client import WeightStreamClient
from weightstream.client.errors import WeightStreamError
from weightstream.client.manifest import ModelFileList
from weightstream.protocol.names import FileKind, TransportChoice
from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import ModelNotFound, UpstreamError
from weightstream_server.settings import ServerSettings
from weightstream_server.storage.sources import ModelFiles, SourceFile

if TYPE_CHECKING:
    from weightstream_server.storage.reads import ReadPlan

logger = logging.getLogger(__name__)

# What SourceFile.path of an upstream file starts with: upstream:<model>/<file name>.
UPSTREAM_SCHEME = "upstream:"
# The service whose health the upstream reports (grpc.health.v1).
_SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["WeightStreamService"].full_name
# Readiness asks the upstream's health service with this deadline.
PROBE_TIMEOUT_S = 2.0
# Listings and manifests are short calls; a stalled upstream fails them within this.
CALL_TIMEOUT_S = 30.0


class UpstreamSource:
    """The models of an upstream weightstream server (one address, several, or a name that resolves to its replicas)."""

    def __init__(self, settings: ServerSettings) -> None:
        assert settings.upstream is not None
        self.target = settings.upstream
        token = _read_token(settings.upstream_token_file) if settings.upstream_token_file is not None else None
        self._metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self._client = upstream_client(settings, "auto")
        self._lock = threading.Lock()
        # The revision of each model's latest listing, passed on its reads: a model that changed
        # upstream since is refused there, never read mixed.
        self._revisions: dict[str, tuple[tuple[SourceFile, ...], str]] = {}
        # Listings kept while the upstream's watch of their model is held (revisions.relay): until it
        # reports another revision, a manifest costs no call to the upstream.
        self._held: dict[str, list[tuple[SourceFile, FileKind]]] = {}
        self._holding: set[str] = set()

    def claims(self, model: str) -> bool:
        return True

    def describe(self) -> str:
        return f"upstream {self.target}"

    def public_name(self) -> str:
        return "upstream"  # its address stays with the callers that hold a token

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> None:
        return None  # read through a TieredSource, which fills and reads the files itself

    def reachable(self) -> bool:
        stub = health_pb2_grpc.HealthStub(self._client.channel)
        try:
            answer = stub.Check(
                health_pb2.HealthCheckRequest(service=_SERVICE_NAME), timeout=PROBE_TIMEOUT_S, metadata=self._metadata
            )
        except grpc.RpcError:
            return False
        return bool(answer.status == health_pb2.HealthCheckResponse.SERVING)

    def resolve(self, model: str) -> ModelFiles:
        return self._weights(model, self._listing(model))

    def list_anew(self, model: str) -> ModelFiles:
        """model's files as the upstream lists them now; the kept listing (what this server answers with
        until forget_listing) stays as it is."""
        return self._weights(model, self._listing(model, keep=False))

    def _weights(self, model: str, listing: list[tuple[SourceFile, FileKind]]) -> ModelFiles:
        weights = tuple(f for f, kind in listing if kind == "weights")
        if not weights:
            raise ModelNotFound(f"{self.describe()}: model {model!r} has no *.safetensors files")
        return ModelFiles(model, weights, None)

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        return tuple(f for f, kind in self._listing(model) if kind == "companion")

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        length = max(0, min(length, file.size - start))
        if length == 0:
            return b""
        return b"".join(data for data, _ in self.read_from(file, start, length))

    def read_from(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, file_crc32c) pieces of file from start: length bytes, or to its end with the whole
        file's CRC32C on the last piece; each piece checked against its own CRC32C."""
        model = model_of(file)
        revision = self._revision(model, file)
        try:
            with translated(self.describe()):
                yield from self._client.read_file(model, file.name, offset=start, revision=revision, length=length)
        except UpstreamError as exc:
            if exc.code == grpc.StatusCode.FAILED_PRECONDITION:
                self.forget_listing(model)  # changed upstream before its watch said so: list it anew
            raise

    def hold_listings(self, model: str, hold: bool) -> None:
        """Keep model's listing until forget_listing (while a watch of the upstream stands for it), or not."""
        with self._lock:
            if hold:
                self._holding.add(model)
            else:
                self._holding.discard(model)
            self._held.pop(model, None)

    def forget_listing(self, model: str) -> None:
        """Drop model's kept listing: the next manifest lists its files anew."""
        with self._lock:
            self._held.pop(model, None)

    def close(self) -> None:
        self._client.close()

    def _listing(self, model: str, keep: bool = True) -> list[tuple[SourceFile, FileKind]]:
        """model's listing: the kept one if there is one (keep), else the upstream's, kept while held (keep)."""
        with self._lock:
            held = self._held.get(model) if keep else None
        if held is not None:
            return held
        try:
            with translated(self.describe()):
                listing: ModelFileList = self._client.list_files(model)
        except UpstreamError as exc:
            if exc.code == grpc.StatusCode.NOT_FOUND and keep:
                with self._lock:
                    if model in self._holding:
                        self._held[model] = []  # no files (a model only published there) until its watch says
            raise
        files = [
            (SourceFile(f.name, f"{UPSTREAM_SCHEME}{model}/{f.name}", f.size, f.version or listing.revision), f.kind)
            for f in listing.files
        ]
        with self._lock:
            self._revisions[model] = (tuple(f for f, _ in files), listing.revision)
            if keep and model in self._holding:
                self._held[model] = files
        return files

    def _revision(self, model: str, file: SourceFile) -> str:
        with self._lock:
            listed = self._revisions.get(model)
        return listed[1] if listed is not None and file in listed[0] else ""


def upstream_client(settings: ServerSettings, transport: TransportChoice) -> WeightStreamClient:
    """A client of --upstream with its token and TLS settings (never this server's own token)."""
    assert settings.upstream is not None
    return peer_client(settings, settings.upstream, transport)


def peer_client(settings: ServerSettings, target: str, transport: TransportChoice = "grpc") -> WeightStreamClient:
    """A client of target (the upstream, or a peer it named: fleet fan-out) with the upstream's token and TLS."""
    token = _read_token(settings.upstream_token_file) if settings.upstream_token_file is not None else None
    return WeightStreamClient(
        target,
        # "" and not None: the server's own WEIGHTSTREAM_TOKEN must never be sent upstream.
        token=token or "",
        tls=settings.upstream_tls,
        ca_file=settings.upstream_ca_file,
        client_cert=settings.upstream_client_cert,
        client_key=settings.upstream_client_key,
        timeout=CALL_TIMEOUT_S,
        progress=False,
        transport=transport,
    )


def model_of(file: SourceFile) -> str:
    """The model id an upstream file belongs to."""
    return file.path[len(UPSTREAM_SCHEME) :].rpartition("/")[0]


@contextlib.contextmanager
def translated(upstream: str) -> Iterator[None]:
    """The client's errors as UpstreamError: the upstream's code, and a message that names it."""
    try:
        yield
    except WeightStreamError as exc:
        code = exc.code if exc.code is not None else grpc.StatusCode.DATA_LOSS
        raise UpstreamError(f"{upstream}: {exc.message}", code) from exc


def _read_token(path: Path) -> str:
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"upstream_token_file {path}: {exc.strerror or exc}") from exc
    token = next((line.strip() for line in lines if line.strip()), "")
    if not token:
        raise ValueError(f"upstream_token_file {path} holds no token")
    return token
