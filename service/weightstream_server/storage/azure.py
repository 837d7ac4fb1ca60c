"""Azure Blob as a source: model ids `az://container/prefix`, listed and header-read with azure-storage-blob.

Tensor bytes are read by the Run:ai streamer's Azure backend (runai-model-streamer-azure);
AzureStore lists a model's objects and reads ranges for objects.ObjectSource. Versions are ETags.

The storage account and its credentials come from Azure's standard variables, for the SDK here
and for the streamer alike (account_settings): AZURE_STORAGE_CONNECTION_STRING, or
AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY, AZURE_STORAGE_SAS_TOKEN or else
DefaultAzureCredential (workload identity on AKS, managed identity, the Azure CLI's login).
AZURE_STORAGE_ENDPOINT_SUFFIX names another cloud's blob endpoint (default blob.core.windows.net).

The streamer's backend reaches an account at https://ACCOUNT.SUFFIX only, which is every Azure
cloud's form; an endpoint of another form (Azurite's default http://127.0.0.1:10000/ACCOUNT, say)
is refused at start-up with a message that says so, rather than served by the SDK alone. Nothing
of the credentials goes into messages or logs.

Needs the azure extra: pip install 'weightstream[azure]'.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import azure.core.exceptions as azure_errors
from azure.storage.blob import BlobServiceClient

from weightstream_server.errors import (
    AccessDenied,
    CorruptCheckpoint,
    ModelNotFound,
    StorageUnauthenticated,
    StorageUnavailable,
)
from weightstream_server.storage.model_ids import AZURE_SCHEME

CONNECTION_STRING = "AZURE_STORAGE_CONNECTION_STRING"
ACCOUNT_NAME = "AZURE_STORAGE_ACCOUNT_NAME"
ACCOUNT_KEY = "AZURE_STORAGE_ACCOUNT_KEY"
SAS_TOKEN = "AZURE_STORAGE_SAS_TOKEN"
ENDPOINT_SUFFIX = "AZURE_STORAGE_ENDPOINT_SUFFIX"
DEFAULT_SUFFIX = "blob.core.windows.net"
_PIECE_BYTES = 8 * 1024 * 1024
_TIMEOUT_S = 30
_PROBE_TIMEOUT_S = 2
_UNAUTHENTICATED = {"AuthenticationFailed", "InvalidAuthenticationInfo", "NoAuthenticationInformation"}


@dataclass(frozen=True)
class Account:
    """A storage account as the streamer's backend reads it: name, the blob endpoint's suffix, and one secret."""

    name: str
    suffix: str
    key: str = ""
    sas: str = ""

    @property
    def url(self) -> str:
        return f"https://{self.name}.{self.suffix}"


def account_settings(environ: dict[str, str] | None = None) -> Account:
    """The account the standard variables name; ValueError (naming the variable, never a secret) if none can be used."""
    env = dict(os.environ if environ is None else environ)
    connection = env.get(CONNECTION_STRING, "")
    if connection:
        fields = _connection_fields(connection)
        if fields.get("usedevelopmentstorage", "").lower() == "true":
            raise ValueError(
                f"{CONNECTION_STRING} is UseDevelopmentStorage=true (Azurite at http://127.0.0.1:10000): the Run:ai "
                "streamer's Azure backend reads https://ACCOUNT.SUFFIX endpoints only; serve Azurite over TLS and "
                "name it with AccountName, AccountKey and EndpointSuffix"
            )
        name = fields.get("accountname", "")
        if not name:
            raise ValueError(f"{CONNECTION_STRING} has no AccountName")
        endpoint = fields.get("blobendpoint", "")
        if endpoint:
            match = re.fullmatch(rf"https://{re.escape(name)}\.([^/]+)/?", endpoint)
            if match is None:
                raise ValueError(
                    f"{CONNECTION_STRING}'s BlobEndpoint {endpoint[:200]!r} is not https://{name}.SUFFIX: the Run:ai "
                    "streamer's Azure backend reads that form of endpoint only"
                )
            suffix = match.group(1)
        else:
            suffix = "blob." + fields.get("endpointsuffix", DEFAULT_SUFFIX.removeprefix("blob."))
        return Account(name, suffix, fields.get("accountkey", ""), fields.get("sharedaccesssignature", ""))
    name = env.get(ACCOUNT_NAME, "")
    if not name:
        raise ValueError(
            f"az:// models need a storage account: set {CONNECTION_STRING}, or {ACCOUNT_NAME} (with "
            f"{ACCOUNT_KEY}, {SAS_TOKEN}, or an identity DefaultAzureCredential finds)"
        )
    return Account(name, env.get(ENDPOINT_SUFFIX) or DEFAULT_SUFFIX, env.get(ACCOUNT_KEY, ""), env.get(SAS_TOKEN, ""))


def configure_azure(account: Account) -> None:
    """Give the streamer's Azure backend the account, in the variables it reads (those already set are kept)."""
    os.environ.setdefault(ACCOUNT_NAME, account.name)
    os.environ.setdefault(ENDPOINT_SUFFIX, account.suffix)
    if account.key:
        os.environ.setdefault(ACCOUNT_KEY, account.key)
    elif account.sas:
        os.environ.setdefault(SAS_TOKEN, account.sas)


def make_client(account: Account, *, probe: bool = False) -> Any:
    """A BlobServiceClient for account: its key, its SAS token, or DefaultAzureCredential."""
    options: dict[str, Any] = {"connection_timeout": 1 if probe else 5, "read_timeout": 1 if probe else _TIMEOUT_S}
    if probe:
        options["retry_total"] = 0
    credential: Any
    if account.key:
        credential = {"account_name": account.name, "account_key": account.key}
    elif account.sas:
        credential = account.sas
    else:
        from azure.identity import DefaultAzureCredential

        credential = DefaultAzureCredential()
    return BlobServiceClient(account.url, credential=credential, **options)


class AzureStore:
    """Azure Blob through azure-storage-blob: the ObjectStore of az:// sources (containers as buckets)."""

    scheme = AZURE_SCHEME

    def __init__(self, client: Any, probe_client: Any) -> None:
        self._client = client
        self._probe_client = probe_client

    def list(self, bucket: str, prefix: str) -> dict[str, tuple[int, str]]:
        objects: dict[str, tuple[int, str]] = {}
        with translated(bucket, prefix):
            container = self._client.get_container_client(bucket)
            for item in container.walk_blobs(name_starts_with=prefix or None, delimiter="/"):
                if getattr(item, "size", None) is None:  # a "folder" (BlobPrefix)
                    continue
                objects[item.name[len(prefix) :]] = (int(item.size), str(item.etag).strip('"'))
        return objects

    def get(self, bucket: str, key: str, start: int, end: int, version: str = "") -> bytes:
        if end <= start:
            return b""
        with translated(bucket, key):
            extra: dict[str, Any] = {"etag": version, "match_condition": _if_match()} if version else {}
            blob = self._client.get_blob_client(bucket, key)
            data: bytes = blob.download_blob(offset=start, length=end - start, timeout=_TIMEOUT_S, **extra).readall()
        if len(data) != end - start:
            raise CorruptCheckpoint(f"az://{bucket}/{key}: read {len(data)} bytes at {start}, expected {end - start}")
        return data

    def stream(self, bucket: str, key: str, start: int, end: int, version: str = "") -> Iterator[bytes]:
        with translated(bucket, key):
            extra: dict[str, Any] = {"etag": version, "match_condition": _if_match()} if version else {}
            blob = self._client.get_blob_client(bucket, key)
            downloader = blob.download_blob(
                offset=start, length=end - start, timeout=_TIMEOUT_S, max_concurrency=1, **extra
            )
            yield from downloader.chunks()

    def reachable(self, bucket: str) -> bool:
        try:
            return bool(self._probe_client.get_container_client(bucket).exists(timeout=_PROBE_TIMEOUT_S))
        except azure_errors.AzureError:
            return False


def _code(exc: Exception) -> str:
    """The error code Azure sent (StorageErrorCode is a str enum: its value, not its name), or ""."""
    code = getattr(exc, "error_code", None) or ""
    return str(getattr(code, "value", code))


def _if_match() -> Any:
    from azure.core import MatchConditions

    return MatchConditions.IfNotModified


def _connection_fields(connection: str) -> dict[str, str]:
    fields = {}
    for part in connection.split(";"):
        key, sep, value = part.partition("=")
        if sep:
            fields[key.strip().lower()] = value.strip()
    return fields


@contextlib.contextmanager
def translated(container: str, key: str) -> Iterator[None]:
    """Turn the SDK's errors into the server's, naming the container and blob (never credentials)."""
    where = f"az://{container}/{key}"
    try:
        yield
    except azure_errors.ResourceNotFoundError as exc:
        if _code(exc) == "ContainerNotFound":
            raise ModelNotFound(f"{where}: container {container!r} does not exist") from exc
        raise ModelNotFound(f"{where}: not found") from exc
    except azure_errors.ResourceModifiedError as exc:
        raise StorageUnavailable(f"{where}: the blob changed while it was read; try again") from exc
    except azure_errors.ClientAuthenticationError as exc:
        code = _code(exc)
        if code in _UNAUTHENTICATED or exc.status_code in (None, 401):
            raise StorageUnauthenticated(f"{where}: Azure rejected the server's credentials ({code})") from exc
        raise AccessDenied(f"{where}: Azure denied access ({code or exc.status_code})") from exc
    except azure_errors.HttpResponseError as exc:
        status = exc.status_code or 0
        code = _code(exc) or str(status)
        if status == 416:
            raise CorruptCheckpoint(f"{where}: blob is shorter than its header says ({code})") from exc
        if status == 403:
            raise AccessDenied(f"{where}: Azure denied access ({code})") from exc
        if status >= 500 or status in (408, 429):
            raise StorageUnavailable(f"{where}: Azure failed ({code}); try again") from exc
        raise StorageUnavailable(f"{where}: Azure request failed ({code})") from exc
    except azure_errors.AzureError as exc:  # connection and timeout errors, and DefaultAzureCredential's
        if "credential" in type(exc).__name__.lower():
            raise StorageUnauthenticated(f"{where}: no Azure credential was found ({type(exc).__name__})") from exc
        raise StorageUnavailable(f"{where}: Azure is unreachable ({type(exc).__name__})") from exc
