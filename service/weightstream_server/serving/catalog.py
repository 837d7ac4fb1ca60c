"""Manifests: a model's tensors, dtypes, shapes and byte positions, built from its headers.

A manifest is cached per model and rebuilt when any of its files changes (its size, its
modification time, or, for local files, its identity: another inode, a new change time), so a
request costs a walk to each file and one stat, not a header parse. Headers are read through
descriptors opened beneath the model root (storage.open_files), checked again once read.

Concurrent requests of one model version share one build, and each file version's header is
parsed once (storage.parse_once): a header that failed to parse is remembered as failed for that
version, so neither a burst of requests nor a repeated one parses it again.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from weightstream.protocol import dtypes
from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    InvalidModelId,
    ModelNotFound,
    RevisionMismatch,
    RevisionNotKept,
    ServerError,
    TensorNotFound,
    UpstreamError,
)
from weightstream_server.storage.header import HeaderTensor, read_header
from weightstream_server.storage.index import INDEX_FILE
from weightstream_server.storage.model_ids import (
    AZURE_SCHEME,
    canonical_model_id,
    object_scheme,
    parse_object_model_id,
)
from weightstream_server.storage.open_files import OpenFiles
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.sources import ModelFiles, Source, SourceFile, revision

# Failed parses (and builds in flight) remembered, by file or model; each costs a message.
MAX_REMEMBERED = 4096


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a model; file_offset is the absolute position of its first byte in its file."""

    name: str
    dtype: dtypes.DType
    shape: tuple[int, ...]
    nbytes: int
    file_index: int
    file_offset: int


@dataclass(frozen=True)
class Manifest:
    """A model's tensors, the files they lie in, and the source those files are read from."""

    model: str
    revision: str
    files: tuple[SourceFile, ...]
    tensors: tuple[TensorEntry, ...]
    by_name: dict[str, TensorEntry] = field(repr=False)
    source: Source = field(repr=False, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def tensor(self, name: str) -> TensorEntry:
        entry = self.by_name.get(name)
        if entry is None:
            raise TensorNotFound(f"model {self.model!r} has no tensor {name[:200]!r}")
        return entry


class KeptRevision(Protocol):
    id: str
    origin: str
    manifest: Manifest
    servable: bool
    digest: str


class RevisionLookup(Protocol):
    """What the catalog asks of the revisions kept (revisions.store.RevisionStore)."""

    def find(self, model: str, revision: str) -> KeptRevision | None: ...

    def current(self, model: str) -> KeptRevision | None: ...

    def observe_storage(self, model: str, manifest: Manifest) -> KeptRevision: ...

    def kept(self, model: str) -> list[str]: ...

    def was_evicted(self, model: str, revision: str) -> bool: ...

    def asked(self, model: str, revision: str = "") -> None: ...


class Catalog:
    """Manifests of the models of every configured source. Safe to use from many threads."""

    def __init__(self, sources: Sequence[Source], revisions: RevisionLookup | None = None) -> None:
        self.sources = tuple(sources)
        # Each model's kept revisions (published ones included); None: storage's current one only.
        self.revisions = revisions
        self._lock = threading.Lock()
        self._cache: dict[str, Manifest] = {}
        # Builds in flight (none kept: _cache keeps manifests), and headers that failed to parse.
        self._builds: ParseOnce[Manifest] = ParseOnce(max_weight=MAX_REMEMBERED, keep_results=False)
        self.headers: ParseOnce[list[HeaderTensor]] = ParseOnce(max_weight=MAX_REMEMBERED, keep_results=False)

    def source_for(self, model: str) -> Source:
        for source in self.sources:
            if source.claims(model):
                return source
        if object_scheme(canonical_model_id(model)) is not None:
            location = parse_object_model_id(model)
            noun = "container" if location.scheme == AZURE_SCHEME else "bucket"
            raise AccessDenied(
                f"model {model[:200]!r}: {noun} {location.scheme}{location.bucket} is not served by this server; "
                "refused"
            )
        if "://" in model:
            raise InvalidModelId(f"model {model[:200]!r}: unsupported URL scheme")
        raise AccessDenied(f"model {model[:200]!r}: this server has no model root")

    def manifest(self, model: str, revision: str = "") -> Manifest:
        """The manifest of model's current revision, or of the kept revision named.

        The current revision is the newest of storage's (a change of files is a new one) and the
        published ones. A named revision that storage no longer has (its files changed since, or one
        this server never saw, of a model it has files of) is RevisionMismatch, FAILED_PRECONDITION,
        as for a load whose checkpoint changed under it; a published revision no longer kept (or any
        revision of a model that only publishes made) is RevisionNotKept, NOT_FOUND. Both messages
        name the revisions kept.
        """
        store = self.revisions
        if store is None:
            only = self.storage_manifest(model)
            if revision and revision != only.revision:
                raise RevisionMismatch(
                    f"model {model!r} changed: revision {only.revision}, the request expects {revision}"
                )
            return only
        store.asked(model, revision)
        if revision:
            kept = store.find(model, revision)
            if kept is not None and kept.servable and kept.origin != "storage":
                return kept.manifest
        missing: ServerError | None = None
        try:
            stored: Manifest | None = self.storage_manifest(model)
        except (ModelNotFound, AccessDenied, UpstreamError) as exc:  # a model published only has no files
            if isinstance(exc, UpstreamError) and exc.code != grpc.StatusCode.NOT_FOUND:
                raise
            stored, missing = None, exc
        if stored is not None:
            store.observe_storage(model, stored)
        latest = store.current(model)
        if revision:
            if stored is not None and stored.revision == revision:
                return stored
            names = ", ".join(store.kept(model)) or "none"
            if store.was_evicted(model, revision) or stored is None:
                raise RevisionNotKept(f"model {model!r}: revision {revision[:200]!r} is not kept here (kept: {names})")
            # A storage revision this server had, or one from before it started: the files changed.
            raise RevisionMismatch(
                f"model {model!r} changed: revision {latest.id if latest else stored.revision}, the request "
                f"expects {revision[:200]} (kept: {names})"
            )
        if latest is not None and latest.servable and latest.origin != "storage":
            return latest.manifest
        if stored is None:
            assert missing is not None
            raise missing
        return stored

    def storage_manifest(self, model: str) -> Manifest:
        """The manifest of model's files as storage has them now."""
        source = self.source_for(model)
        located = source.resolve(model)
        current = revision(located.files)
        with self._lock:
            cached = self._cache.get(model)
        # The files compared too: a local file may be another one under the same revision (same name,
        # size and modification time), and reads check the identities the manifest holds.
        if cached is not None and cached.revision == current and cached.files == located.files:
            return cached
        version = current + "".join(f":{f.fingerprint}" for f in located.files)
        manifest = self._builds.get(model, version, lambda: build_manifest(source, located, current, self.headers))
        with self._lock:
            self._cache[model] = manifest
        return manifest


def build_manifest(
    source: Source, located: ModelFiles, revision: str, headers: ParseOnce[list[HeaderTensor]] | None = None
) -> Manifest:
    """Read every file's header (each once per version, through headers) and join them into one manifest,
    checked against the index."""
    tensors: list[TensorEntry] = []
    by_name: dict[str, TensorEntry] = {}
    for file_index, source_file in enumerate(located.files):
        display = f"model {located.model!r}, file {source_file.name!r}"

        def parse(
            source_file: SourceFile = source_file, file_index: int = file_index, display: str = display
        ) -> list[HeaderTensor]:
            with OpenFiles(source, located.model, {file_index: source_file}) as opened:
                header = read_header(functools.partial(opened.read_range, file_index), source_file.size, display)
                opened.check_unchanged(file_index)
            return header

        header = parse() if headers is None else headers.get(source_file.path, source_file.fingerprint, parse)
        for header_tensor in header:
            if header_tensor.name in by_name:
                other = located.files[by_name[header_tensor.name].file_index].name
                raise CorruptCheckpoint(f"{display}: tensor {header_tensor.name!r} is also in file {other!r}")
            entry = TensorEntry(
                header_tensor.name,
                header_tensor.dtype,
                header_tensor.shape,
                header_tensor.nbytes,
                file_index,
                header_tensor.start,
            )
            tensors.append(entry)
            by_name[entry.name] = entry
    if located.weight_map is not None:
        for name, file_name in located.weight_map.items():
            listed = by_name.get(name)
            if listed is None or located.files[listed.file_index].name != file_name:
                raise CorruptCheckpoint(
                    f"model {located.model!r}: {INDEX_FILE} puts tensor {name!r} in {file_name!r}, "
                    "but that file has no such tensor"
                )
    return Manifest(located.model, revision, located.files, tuple(tensors), by_name, source)
