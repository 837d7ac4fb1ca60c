"""Google Cloud Storage as a source: model ids `gs://bucket/prefix`, listed and header-read with google-cloud-storage.

Tensor bytes are read by the Run:ai streamer's GCS backend (runai-model-streamer-gcs); GcsStore
lists a model's objects and reads ranges for objects.ObjectSource. Versions are object
generations: a replaced object is a new generation, and a read of a listed generation fails
rather than return another's bytes.

Credentials come from Google's standard chain (application default credentials: the
GOOGLE_APPLICATION_CREDENTIALS service-account file, gcloud's, workload identity on GKE), for the
SDK here and for the streamer alike. STORAGE_EMULATOR_HOST points both at an emulator:
configure_gcs passes it on to the streamer in the variable its C++ client reads
(CLOUD_STORAGE_EMULATOR_ENDPOINT). Nothing of the credentials goes into messages or logs.

Needs the gcs extra: pip install 'weightstream[gcs]'.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import google.api_core.exceptions as api_errors
import google.auth.exceptions
import requests.exceptions
from google.cloud import storage
from google.cloud.storage.retry import DEFAULT_RETRY

from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    ModelNotFound,
    StorageUnauthenticated,
    StorageUnavailable,
)
from weightstream_server.storage.model_ids import GCS_SCHEME

EMULATOR_HOST = "STORAGE_EMULATOR_HOST"  # what Google's SDKs read
STREAMER_EMULATOR = "CLOUD_STORAGE_EMULATOR_ENDPOINT"  # what the streamer's C++ client (google-cloud-cpp) reads
_PIECE_BYTES = 8 * 1024 * 1024
# Seconds: (connect, read) for requests, one short attempt for readiness probes.
_TIMEOUT = (5.0, 30.0)
_PROBE_TIMEOUT = (1.0, 1.0)
# The SDK's own retries go on for 120 s against a store that refuses connections; a client's call
# (30 s by default) would end DEADLINE_EXCEEDED first. Within this the answer is UNAVAILABLE.
_RETRY = DEFAULT_RETRY.with_timeout(15.0)


def configure_gcs() -> None:
    """Point the streamer's GCS backend at the emulator STORAGE_EMULATOR_HOST names, if any."""
    emulator = os.environ.get(EMULATOR_HOST)
    if emulator and not os.environ.get(STREAMER_EMULATOR):
        os.environ[STREAMER_EMULATOR] = emulator if "://" in emulator else f"http://{emulator}"


def make_client() -> Any:
    """A google-cloud-storage client on the standard credential chain (anonymous for an emulator)."""
    try:
        return storage.Client()
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise StorageUnauthenticated(
            f"Google Cloud Storage: no credentials found ({type(exc).__name__}); set "
            "GOOGLE_APPLICATION_CREDENTIALS, run on GKE with workload identity, or log in with gcloud"
        ) from exc


class GcsStore:
    """Google Cloud Storage through google-cloud-storage: the ObjectStore of gs:// sources."""

    scheme = GCS_SCHEME

    def __init__(self, client: Any) -> None:
        self._client = client

    def list(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        objects: dict[str, tuple[int, str]] = {}
        with translated(bucket, prefix):
            for blob in self._client.list_blobs(bucket, prefix=prefix, delimiter="/", timeout=_TIMEOUT, retry=_RETRY):
                objects[blob.name[len(prefix) :]] = (int(blob.size or 0), str(blob.generation))
        return objects

    def get(self, bucket: str, key: str, start: int, end: int, version: str = "") -> bytes:
        if end <= start:
            return b""
        with translated(bucket, key):
            blob = self._client.bucket(bucket).blob(key, generation=int(version) if version else None)
            data: bytes = blob.download_as_bytes(
                start=start, end=end - 1, checksum=None, timeout=_TIMEOUT, retry=_RETRY
            )
        if len(data) != end - start:
            raise CorruptCheckpoint(f"gs://{bucket}/{key}: read {len(data)} bytes at {start}, expected {end - start}")
        return data

    def stream(self, bucket: str, key: str, start: int, end: int, version: str = "") -> Iterator[bytes]:
        # One ranged request per piece, each of the version listed.
        for at in range(start, end, _PIECE_BYTES):
            yield self.get(bucket, key, at, min(end, at + _PIECE_BYTES), version)

    def reachable(self, bucket: str) -> bool:
        try:
            return bool(self._client.bucket(bucket).exists(timeout=_PROBE_TIMEOUT, retry=None))
        except (
            api_errors.GoogleAPIError,
            google.auth.exceptions.GoogleAuthError,
            requests.exceptions.RequestException,
        ):
            return False


@contextlib.contextmanager
def translated(bucket: str, key: str) -> Iterator[None]:
    """Turn the SDK's errors into the server's, naming the bucket and key (never credentials)."""
    where = f"gs://{bucket}/{key}"
    try:
        yield
    except api_errors.NotFound as exc:
        raise ModelNotFound(f"{where}: not found") from exc
    except api_errors.Unauthorized as exc:
        raise StorageUnauthenticated(f"{where}: Google Cloud Storage rejected the server's credentials") from exc
    except api_errors.Forbidden as exc:
        raise AccessDenied(f"{where}: Google Cloud Storage denied access") from exc
    except (api_errors.PreconditionFailed, api_errors.RequestRangeNotSatisfiable) as exc:
        raise StorageUnavailable(f"{where}: the object changed while it was read; try again") from exc
    except google.auth.exceptions.DefaultCredentialsError as exc:
        raise StorageUnauthenticated(f"{where}: no Google credentials were found in the server's chain") from exc
    except google.auth.exceptions.GoogleAuthError as exc:
        raise StorageUnauthenticated(f"{where}: Google credentials failed ({type(exc).__name__})") from exc
    except api_errors.RetryError as exc:
        cause = type(exc.cause).__name__ if exc.cause is not None else "no answer"
        raise StorageUnavailable(
            f"{where}: Google Cloud Storage failed for {_RETRY.timeout:g} s of retries ({cause}); try again"
        ) from exc
    except (api_errors.TooManyRequests, api_errors.ServerError) as exc:
        raise StorageUnavailable(f"{where}: Google Cloud Storage failed ({type(exc).__name__}); try again") from exc
    except api_errors.GoogleAPIError as exc:
        raise StorageUnavailable(f"{where}: Google Cloud Storage request failed ({type(exc).__name__})") from exc
    except requests.exceptions.RequestException as exc:
        raise StorageUnavailable(f"{where}: Google Cloud Storage is unreachable ({type(exc).__name__})") from exc
