"""S3 as a source: model ids `s3://bucket/prefix`, listed and header-read with boto3.

Tensor bytes are not read here but by the Run:ai streamer's S3 backend (reader.py); this module
lists a model's objects, reads their headers and whole files (for fetch) with ranged GETs, and says
whether a bucket answers.
Only buckets named in the settings are served: a model id naming any other bucket is refused
before any request is made.

Credentials come from the standard AWS chain (environment, shared config and profile, web
identity token, instance metadata), for boto3 here and for the streamer alike. They are never
put into messages or logs: errors name the bucket and key only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

import boto3
import botocore.exceptions
from botocore.config import Config

from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    ModelNotFound,
    ServerError,
    StorageUnauthenticated,
    StorageUnavailable,
)
from weightstream_server.settings import ServerSettings
from weightstream_server.storage.index import INDEX_CACHE_ENTRIES, INDEX_FILE, MAX_INDEX_BYTES, parse_index
from weightstream_server.storage.model_ids import S3_SCHEME, S3Location, parse_s3_model_id
from weightstream_server.storage.parse_once import ParseOnce
from weightstream_server.storage.sources import COMPANION_FILES, ModelFiles, SourceFile

if TYPE_CHECKING:
    from weightstream_server.serving.read_plan import ReadPlan

_NOT_FOUND = {"NoSuchBucket", "NoSuchKey", "404", "NotFound"}
_DENIED = {"AccessDenied", "403", "AllAccessDisabled", "AccountProblem", "Forbidden"}
_UNAUTHENTICATED = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}
_DATA_LOSS = {"InvalidRange"}
# Bytes taken at a time from the body of a long GET (read_from).
_PIECE_BYTES = 8 * 1024 * 1024


def make_client(settings: ServerSettings, *, probe: bool = False) -> Any:
    """A boto3 S3 client for settings (thread-safe; shared by every S3 source of a server).

    A probe client answers readiness checks: one attempt with short timeouts, so that a dead store
    makes /readyz say so within a probe's timeout instead of after a series of retries.
    """
    config = Config(
        s3={"addressing_style": "path" if settings.s3_path_style else "auto"},
        retries={"mode": "standard", "max_attempts": 1 if probe else 3},
        connect_timeout=1 if probe else 5,
        read_timeout=1 if probe else max(1, settings.s3_request_timeout_ms // 1000),
    )
    return boto3.session.Session().client(
        "s3",
        endpoint_url=settings.s3_endpoint,
        region_name=settings.s3_region,
        verify=settings.s3_ca_bundle if settings.s3_ca_bundle else None,
        config=config,
    )


class S3Source:
    """The models under one allowed bucket."""

    def __init__(self, bucket: str, client: Any, probe_client: Any) -> None:
        self.bucket = bucket
        self._client = client
        self._probe_client = probe_client
        self._indexes: ParseOnce[dict[str, str]] = ParseOnce(
            max_weight=INDEX_CACHE_ENTRIES, keep_results=True, weight=len
        )

    def claims(self, model: str) -> bool:
        return model == S3_SCHEME + self.bucket or model.startswith(f"{S3_SCHEME}{self.bucket}/")

    def describe(self) -> str:
        return f"s3://{self.bucket}"

    def public_name(self) -> str:
        # Clients name this source's models by it.
        return f"s3://{self.bucket}"

    def read_units(self, files: Sequence[SourceFile], plan: ReadPlan) -> None:
        return None  # the streamer reads objects by URL

    def reachable(self) -> bool:
        try:
            self._probe_client.head_bucket(Bucket=self.bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False
        return True

    def resolve(self, model: str) -> ModelFiles:
        location = parse_s3_model_id(model)
        objects = self._list(location)
        weight_map = self._read_index(model, location, objects)
        if weight_map is not None:
            names = sorted(set(weight_map.values()))
            absent = [n for n in names if n not in objects]
            if absent:
                raise CorruptCheckpoint(
                    f"model {model!r}: {INDEX_FILE} names {absent[0]!r}, which is not in "
                    f"s3://{location.bucket}/{location.prefix}"
                )
        else:
            names = sorted(n for n in objects if n.endswith(".safetensors"))
        if not names:
            raise ModelNotFound(
                f"model {model!r}: no *.safetensors objects under s3://{location.bucket}/{location.prefix}"
            )
        return ModelFiles(model, tuple(_source_file(location, name, objects) for name in names), weight_map)

    def companion_files(self, model: str) -> tuple[SourceFile, ...]:
        location = parse_s3_model_id(model)
        objects = self._list(location)
        return tuple(_source_file(location, name, objects) for name in sorted(COMPANION_FILES & objects.keys()))

    def _list(self, location: S3Location) -> dict[str, tuple[int, str]]:
        """(size, ETag) of every object directly under location's prefix, by name."""
        objects: dict[str, tuple[int, str]] = {}
        with translated(location.bucket, location.prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=location.bucket, Prefix=location.prefix, Delimiter="/"
            )
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(location.prefix) :]
                    objects[name] = (int(item["Size"]), str(item.get("ETag", "")).strip('"'))
        return objects

    def read_range(self, file: SourceFile, start: int, length: int) -> bytes:
        key = file.path[len(S3_SCHEME) + len(self.bucket) + 1 :]
        if length <= 0:
            return b""
        with translated(self.bucket, key):
            response = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{start + length - 1}")
            data: bytes = response["Body"].read()
        return data

    def read_from(self, file: SourceFile, start: int, length: int = 0) -> Iterator[tuple[bytes, int | None]]:
        """(data, None) pieces of file from start, length bytes or to its end, from one ranged GET."""
        key = file.path[len(S3_SCHEME) + len(self.bucket) + 1 :]
        end = start + length if length else file.size
        if end <= start:
            return
        with translated(self.bucket, key):
            response = self._client.get_object(Bucket=self.bucket, Key=key, Range=f"bytes={start}-{end - 1}")
            for piece in response["Body"].iter_chunks(_PIECE_BYTES):
                yield piece, None

    def _read_index(
        self, model: str, location: S3Location, objects: dict[str, tuple[int, str]]
    ) -> dict[str, str] | None:
        if INDEX_FILE not in objects:
            return None
        size, etag = objects[INDEX_FILE]
        key = location.prefix + INDEX_FILE
        if size > MAX_INDEX_BYTES:
            raise CorruptCheckpoint(f"model {model!r}: {INDEX_FILE} is larger than {MAX_INDEX_BYTES} bytes")

        def parse() -> dict[str, str]:
            with translated(location.bucket, key):
                # IfMatch: the object read is the version listed, or the read fails (and is not remembered).
                raw = self._client.get_object(Bucket=location.bucket, Key=key, IfMatch=etag)["Body"].read()
            return parse_index(model, raw)

        return self._indexes.get(f"{S3_SCHEME}{location.bucket}/{key}", f"{etag}:{size}", parse)


def _source_file(location: S3Location, name: str, objects: dict[str, tuple[int, str]]) -> SourceFile:
    return SourceFile(name, f"{S3_SCHEME}{location.bucket}/{location.prefix}{name}", *objects[name])


@contextlib.contextmanager
def translated(bucket: str, key: str) -> Iterator[None]:
    """Turn boto3's errors into the server's, naming the bucket and key (never credentials)."""
    where = f"s3://{bucket}/{key}"
    try:
        yield
    except botocore.exceptions.ClientError as exc:
        error = exc.response.get("Error", {})
        code = str(error.get("Code", ""))
        status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) or 0)
        raise _from_code(where, bucket, code, status) from exc
    except botocore.exceptions.NoCredentialsError as exc:
        raise StorageUnauthenticated(f"{where}: no S3 credentials were found in the server's credential chain") from exc
    except (
        botocore.exceptions.EndpointConnectionError,
        botocore.exceptions.ConnectTimeoutError,
        botocore.exceptions.ReadTimeoutError,
        botocore.exceptions.ConnectionClosedError,
        botocore.exceptions.ResponseStreamingError,
    ) as exc:
        raise StorageUnavailable(f"{where}: S3 is unreachable ({type(exc).__name__})") from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise StorageUnavailable(f"{where}: S3 request failed ({type(exc).__name__})") from exc


def _from_code(where: str, bucket: str, code: str, status: int) -> ServerError:
    if code == "NoSuchBucket":
        return ModelNotFound(f"{where}: bucket {bucket!r} does not exist")
    if code in _NOT_FOUND:
        return ModelNotFound(f"{where}: not found")
    if code in _UNAUTHENTICATED:
        return StorageUnauthenticated(f"{where}: S3 rejected the server's credentials ({code})")
    if code in _DENIED:
        return AccessDenied(f"{where}: S3 denied access ({code})")
    if code in _DATA_LOSS:
        return CorruptCheckpoint(f"{where}: object is shorter than its header says ({code})")
    if status >= 500 or code in {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}:
        return StorageUnavailable(f"{where}: S3 failed ({code or status}); try again")
    return StorageUnavailable(f"{where}: S3 request failed ({code or status})")
