"""Object stores as sources: the models under one bucket (container) of S3, Google Cloud Storage or Azure Blob.

Tensor bytes are not read here but by the Run:ai streamer's backend for the store (reader.py
hands it the object URLs). ObjectSource lists a model's objects, reads its index, and reads
ranges and whole files (headers, fetch, the disk cache) through an ObjectStore: one per kind of
store (s3.S3Store with boto3, gcs.GcsStore with google-cloud-storage, azure.AzureStore with
azure-storage-blob). A store turns its SDK's errors into the server's, naming the object's URL and
never a credential.

Only buckets named in the settings are served: a model id naming any other bucket is refused
before any request is made (Catalog.source_for).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Protocol

from weightstream_server.errors import CorruptCheckpoint, ModelNotFound
from weightstream_server.storage.index import INDEX_CACHE_ENTRIES, INDEX_FILE, MAX_INDEX_BYTES, parse_index
from weightstream_server.storage.model_ids import ObjectLocation, canonical_model_id, parse_object_model_id
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.sources import COMPANION_FILES, ModelFiles, SourceFile

if TYPE_CHECKING:
    from weightstream_server.serving.read_plan import ReadPlan


class ObjectStore(Protocol):
    """One kind of object store, reached through its SDK; safe to use from many threads.

    Objects are named by bucket and key. Errors are the server's (ModelNotFound, AccessDenied,
    StorageUnauthenticated, StorageUnavailable, CorruptCheckpoint), naming the object's URL.
    """

    scheme: str  # model ids of this store start with it (model_ids.OBJECT_SCHEMES)

    def list(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        """(size, version) of every object directly under prefix, by its name below prefix."""
        ...

    def get(self, bucket: str, key: str, start: int, end: int, version: str = "") -> bytes:
        """Bytes [start, end) of the object; with version, only of that version (else an error)."""
        ...

    def stream(self, bucket: str, key: str, start: int, end: int, version: str = "") -> Iterator[bytes]:
        """Bytes [start, end) of the object in pieces; with version, only of that version."""
        ...

    def reachable(self, bucket: str) -> bool:
        """Whether the bucket answers now (a readiness probe: one short attempt)."""
        ...


class ObjectSource:
    """The models under one allowed bucket of an object store."""

    def __init__(self, bucket: str, store: ObjectStore) -> None:
        self.bucket = bucket
        self.store = store
        self._name = f"{store.scheme}{bucket}"
        self._indexes: ParseOnce[dict[str, str]] = ParseOnce(
            max_weight=INDEX_CACHE_ENTRIES, keep_results=True, weight=len
        )

    def claims(self, model: str) -> bool:
        model = canonical_model_id(model)
        return model == self._name or model.startswith(self._name + "/")

    def describe(self) -> str:
        return self._name

    def public_name(self) -> str:
        # Clients name this source's models by it.
        return self._name

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> None:
        return None  # the streamer reads objects by URL

    def reachable(self) -> bool:
        return self.store.reachable(self.bucket)

    def resolve(self, model: str) -> ModelFiles:
        location = parse_object_model_id(model)
        objects = self.store.list(location.bucket, location.prefix)
        weight_map = self._read_index(model, location, objects)
        if weight_map is not None:
            names = sorted(set(weight_map.values()))
            absent = [n for n in names if n not in objects]
            if absent:
                raise CorruptCheckpoint(
                    f"model {model!r}: {INDEX_FILE} names {absent[0]!r}, which is not in {location.url()}"
                )
        else:
            names = sorted(n for n in objects if n.endswith(".safetensors"))
        if not names:
            raise ModelNotFound(f"model {model!r}: no *.safetensors objects under {location.url()}")
        return ModelFiles(model, tuple(_source_file(location, name, objects) for name in names), weight_map)

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        location = parse_object_model_id(model)
        objects = self.store.list(location.bucket, location.prefix)
        return tuple(_source_file(location, name, objects) for name in sorted(COMPANION_FILES & objects.keys()))

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        return self.store.get(self.bucket, self._key(file), start, start + length, file.version)

    def read_from(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, None) pieces of file from start, length bytes or to its end, of the version listed."""
        end = start + length if length else file.size
        if end <= start:
            return
        for piece in self.store.stream(self.bucket, self._key(file), start, end, file.version):
            yield piece, None

    def _key(self, file: SourceFile) -> str:
        return file.path[len(self._name) + 1 :]

    def _read_index(
        self, model: str, location: ObjectLocation, objects: dict[str, tuple[int, str]]
    ) -> dict[str, str] | None:
        if INDEX_FILE not in objects:
            return None
        size, version = objects[INDEX_FILE]
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"model {model!r}: {INDEX_FILE} is larger than {MAX_INDEX_BYTES} bytes")
        key = location.prefix + INDEX_FILE

        def parse() -> dict[str, str]:
            # Of the version listed, or the read fails (and is not remembered).
            return parse_index(model, self.store.get(location.bucket, key, 0, size, version=version))

        return self._indexes.get(location.url(INDEX_FILE), f"{version}:{size}", parse)


def _source_file(location: ObjectLocation, name: str, objects: dict[str, tuple[int, str]]) -> SourceFile:
    return SourceFile(name, location.url(name), *objects[name])
