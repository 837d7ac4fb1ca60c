"""S3 as a source: model ids `s3://bucket/prefix`, listed and header-read with boto3 (S3Store).

Tensor bytes are not read here but by the Run:ai streamer's S3 backend (reader.py); S3Store lists
a model's objects, reads their headers and whole files (for fetch) with ranged GETs, and says
whether a bucket answers, for objects.ObjectSource.

Credentials come from the standard AWS chain (environment, shared config and profile, web
identity token, instance metadata), for boto3 here and for the streamer alike. They are never
put into messages or logs: errors name the bucket and key only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

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
from weightstream_server.storage.model_ids import S3_SCHEME

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


class S3Store:
    """S3 through boto3: the ObjectStore of s3:// sources (objects.ObjectSource); versions are ETags."""

    scheme = S3_SCHEME

    def __init__(self, client: Any, probe_client: Any) -> None:
        self._client = client
        self._probe_client = probe_client

    def list(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        objects: dict[str, tuple[int, str]] = {}
        with translated(bucket, prefix):
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/")
            for page in pages:
                for item in page.get("Contents", []):
                    name = item["Key"][len(prefix) :]
                    objects[name] = (int(item["Size"]), str(item.get("ETag", "")).strip('"'))
        return objects

    def get(self, bucket: str, key: str, start: int, end: int, version: str = "") -> bytes:
        if end <= start:
            return b""
        with translated(bucket, key):
            extra = {"IfMatch": version} if version else {}
            response = self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
            data: bytes = response["Body"].read()
        return data

    def stream(self, bucket: str, key: str, start: int, end: int, version: str = "") -> Iterator[bytes]:
        with translated(bucket, key):
            extra = {"IfMatch": version} if version else {}
            response = self._client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}", **extra)
            yield from response["Body"].iter_chunks(_PIECE_BYTES)

    def reachable(self, bucket: str) -> bool:
        try:
            self._probe_client.head_bucket(Bucket=bucket)
        except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError):
            return False
        return True


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
