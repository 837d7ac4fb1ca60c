"""Object stores as sources: the models under one bucket (container) of S3, Google Cloud Storage or Azure Blob.

Tensor bytes are not read here but by the Run:ai streamer's backend for the store (reader.py
hands it the object URLs). ObjectSource lists a model's objects, reads its index, and reads
ranges and whole files (headers, fetch, the disk cache) through an ObjectStore: one per kind of
store (s3.S3Store with boto3, gcs.GcsStore with google-cloud-storage, azure.AzureStore with
azure-storage-blob). A store turns its SDK's errors into the server's, naming the object's URL and
never a credential.

Only buckets named in the settings are served: a model id naming any other bucket is refused
before any request is made (Catalog.source_for).

A bucket that stops answering costs each listing or small read up to its SDK's retry window
(15 s for GCS), and those calls hold the server's workers for short calls. So once such a call
fails UNAVAILABLE after STALLED_S or more, the bucket's listings and small reads fail UNAVAILABLE
at once for COOLDOWN_S (naming the failure); then one call is let through to try the store again,
the others still failing at once until it answers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Protocol, TypeVar

from weightstream_server.errors import CorruptCheckpoint, ModelNotFound, StorageUnavailable
from weightstream_server.storage.index import INDEX_CACHE_ENTRIES, INDEX_FILE, MAX_INDEX_BYTES, parse_index
from weightstream_server.storage.model_ids import ObjectLocation, canonical_model_id, parse_object_model_id
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.sources import COMPANION_FILES, ModelFiles, SourceFile

if TYPE_CHECKING:
    from weightstream_server.storage.reads import ReadPlan

T = TypeVar("T")

logger = logging.getLogger(__name__)

# A listing or small read that failed UNAVAILABLE after this long means the store is not answering...
STALLED_S = 5.0
# ...and its bucket's listings and small reads then fail at once for this long.
COOLDOWN_S = 15.0


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

    def __init__(self, bucket: str, store: ObjectStore, clock: Callable[[], float] = time.monotonic) -> None:
        self.bucket = bucket
        self.store = store
        self._name = f"{store.scheme}{bucket}"
        self._breaker = Breaker(self._name, clock)
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
        objects = self._list(location)
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
        objects = self._list(location)
        return tuple(_source_file(location, name, objects) for name in sorted(COMPANION_FILES & objects.keys()))

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        if length <= 0:
            return b""
        key = self._key(file)
        return self._breaker.call(
            file.path, lambda: self.store.get(self.bucket, key, start, start + length, file.version)
        )

    def read_from(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, None) pieces of file from start, length bytes or to its end, of the version listed."""
        end = start + length if length else file.size
        if end <= start:
            return
        for piece in self.store.stream(self.bucket, self._key(file), start, end, file.version):
            yield piece, None

    def _list(self, location: ObjectLocation) -> dict[str, tuple[int, str]]:
        return self._breaker.call(location.url(), lambda: self.store.list(location.bucket, location.prefix))

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
            url = location.url(INDEX_FILE)
            data = self._breaker.call(url, lambda: self.store.get(location.bucket, key, 0, size, version=version))
            return parse_index(model, data)

        return self._indexes.get(location.url(INDEX_FILE), f"{version}:{size}", parse)


def _source_file(location: ObjectLocation, name: str, objects: dict[str, tuple[int, str]]) -> SourceFile:
    return SourceFile(name, location.url(name), *objects[name])


class Breaker:
    """Fails a store's calls at once while it is known not to answer (see the module doc). Thread-safe."""

    def __init__(self, name: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._name = name
        self._clock = clock
        self._lock = threading.Lock()
        # When a call last stalled and failed, and how; whether a call is trying the store again.
        self._failed_at: float | None = None
        self._failure = ""
        self._trying = False

    def call(self, url: str, work: Callable[[], T]) -> T:
        """work() (a call to the store about url), unless the store is known not to answer."""
        trial = self._admit(url)
        started = self._clock()
        try:
            result = work()
        except StorageUnavailable as exc:
            self._ended(trial, exc if self._clock() - started >= STALLED_S else None)
            raise
        except BaseException:
            self._ended(trial, None, answered=True)
            raise
        self._ended(trial, None, answered=True)
        return result

    def _admit(self, url: str) -> bool:
        """Whether this call is the one trying the store again; StorageUnavailable while it must wait."""
        with self._lock:
            if self._failed_at is None:
                return False
            waited = self._clock() - self._failed_at
            if waited >= COOLDOWN_S and not self._trying:
                self._trying = True
                return True
            left = max(0.0, COOLDOWN_S - waited)
            again = f"tried again in {left:.0f} s" if left else "being tried again by another call"
            raise StorageUnavailable(
                f"{url}: {self._name} did not answer {waited:.0f} s ago ({self._failure}); it is {again}; try again"
            )

    def _ended(self, trial: bool, stalled: StorageUnavailable | None, answered: bool = False) -> None:
        with self._lock:
            if trial:
                self._trying = False
            if stalled is not None:
                if self._failed_at is None:
                    logger.warning(
                        "%s is not answering (%s); its listings and small reads fail at once for %.0f s",
                        self._name,
                        stalled,
                        COOLDOWN_S,
                    )
                self._failed_at, self._failure = self._clock(), str(stalled).removesuffix("; try again")
            elif answered and self._failed_at is not None:
                logger.info("%s answers again", self._name)
                self._failed_at = None
