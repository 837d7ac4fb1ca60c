"""Object-store model ids, the Azure account from its standard variables, and the start-up checks of gs:// and az://."""

from __future__ import annotations

import os

import pytest
from azure.core.exceptions import ClientAuthenticationError, HttpResponseError, ResourceNotFoundError

from weightstream_server.assembly import _extra, object_sources
from weightstream_server.errors import (
    AccessDenied,
    InvalidModelId,
    ModelNotFound,
    StorageUnauthenticated,
    StorageUnavailable,
)
from weightstream_server.settings import ServerSettings
from weightstream_server.storage.azure import Account, account_settings, configure_azure
from weightstream_server.storage.azure import translated as azure_translated
from weightstream_server.storage.gcs import configure_gcs
from weightstream_server.storage.model_ids import ObjectLocation, canonical_model_id, parse_object_model_id

KEY = "a2V5LW9mLXRoZS1hY2NvdW50"


@pytest.mark.parametrize(
    ("model", "location"),
    [
        ("s3://bucket-1/llama/7b", ObjectLocation("s3://", "bucket-1", "llama/7b/")),
        ("gs://my_bucket.v2/llama", ObjectLocation("gs://", "my_bucket.v2", "llama/")),
        ("az://weights/llama/", ObjectLocation("az://", "weights", "llama/")),
        ("abfs://weights/llama", ObjectLocation("az://", "weights", "llama/")),
        ("gs://bucket", ObjectLocation("gs://", "bucket", "")),
    ],
)
def test_object_ids_parse(model: str, location: ObjectLocation) -> None:
    assert parse_object_model_id(model) == location


@pytest.mark.parametrize(
    ("model", "message"),
    [
        ("s3://Bad_Bucket/x", "not a valid bucket name"),  # S3 takes no capitals and no underscores
        ("gs://Bucket/x", "not a valid bucket name"),
        ("az://my_container/x", "not a valid container name"),  # Azure takes no underscores
        ("az://two--dashes/x", "not a valid container name"),
        ("az://ab/x", "not a valid container name"),  # three characters at least
        ("abfs://weights@account.dfs.core.windows.net/x", "the storage account comes from the server's settings"),
        ("gs://bucket/a\x01b", "invalid key prefix"),
        ("hdfs://bucket/x", "is not an s3://, gs:// or az:// id"),
    ],
)
def test_invalid_object_ids_are_refused_with_the_reason(model: str, message: str) -> None:
    with pytest.raises(InvalidModelId, match=message):
        parse_object_model_id(model)


def test_abfs_is_another_spelling_of_az() -> None:
    assert canonical_model_id("abfs://weights/llama") == "az://weights/llama"
    assert canonical_model_id("s3://b/abfs://x") == "s3://b/abfs://x"


@pytest.mark.parametrize(
    ("environ", "account"),
    [
        (
            {
                "AZURE_STORAGE_CONNECTION_STRING": f"DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={KEY};"
                "EndpointSuffix=core.windows.net"
            },
            Account("acct", "blob.core.windows.net", key=KEY),
        ),
        (
            {
                "AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;SharedAccessSignature=sv=2024&sig=x;"
                "BlobEndpoint=https://acct.blob.core.chinacloudapi.cn/"
            },
            Account("acct", "blob.core.chinacloudapi.cn", sas="sv=2024&sig=x"),
        ),
        ({"AZURE_STORAGE_ACCOUNT_NAME": "acct"}, Account("acct", "blob.core.windows.net")),
        (
            {
                "AZURE_STORAGE_ACCOUNT_NAME": "acct",
                "AZURE_STORAGE_ACCOUNT_KEY": KEY,
                "AZURE_STORAGE_ENDPOINT_SUFFIX": "blob.core.usgovcloudapi.net",
            },
            Account("acct", "blob.core.usgovcloudapi.net", key=KEY),
        ),
    ],
)
def test_the_azure_account_comes_from_the_standard_variables(environ: dict[str, str], account: Account) -> None:
    assert account_settings(environ) == account


@pytest.mark.parametrize(
    ("environ", "message"),
    [
        ({}, "set AZURE_STORAGE_CONNECTION_STRING, or AZURE_STORAGE_ACCOUNT_NAME"),
        (
            {"AZURE_STORAGE_CONNECTION_STRING": "UseDevelopmentStorage=true"},
            "reads https://ACCOUNT.SUFFIX endpoints only",
        ),
        (
            {
                "AZURE_STORAGE_CONNECTION_STRING": f"AccountName=devstoreaccount1;AccountKey={KEY};"
                "BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1"
            },
            "BlobEndpoint 'http://127.0.0.1:10000/devstoreaccount1' is not https://devstoreaccount1.SUFFIX",
        ),
        ({"AZURE_STORAGE_CONNECTION_STRING": f"AccountKey={KEY}"}, "has no AccountName"),
    ],
)
def test_unusable_azure_settings_are_refused_without_the_secret(environ: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        account_settings(environ)
    assert KEY not in str(info.value)


def test_the_streamer_backends_get_the_stores_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    # configure_* write the process's environment: here a copy of it, dropped after the test.
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("AZURE_", "CLOUD_STORAGE_"))}
    environ["STORAGE_EMULATOR_HOST"] = "127.0.0.1:9023"
    monkeypatch.setattr(os, "environ", environ)
    configure_gcs()
    assert os.environ["CLOUD_STORAGE_EMULATOR_ENDPOINT"] == "http://127.0.0.1:9023"
    configure_azure(Account("acct", "blob.localhost:10443", key=KEY))
    assert os.environ["AZURE_STORAGE_ACCOUNT_NAME"] == "acct"
    assert os.environ["AZURE_STORAGE_ENDPOINT_SUFFIX"] == "blob.localhost:10443"
    assert os.environ["AZURE_STORAGE_ACCOUNT_KEY"] == KEY
    assert "AZURE_STORAGE_SAS_TOKEN" not in os.environ


def test_a_missing_extra_is_named_at_start_up() -> None:
    with pytest.raises(
        ValueError,
        match=r"gs:// models need the gcs extra: pip install 'weightstream\[gcs\]' "
        r"\(no_such_backend is not installed\)",
    ):
        _extra("gcs", "weightstream_server.storage.gcs", "no_such_backend")
    with pytest.raises(ValueError, match=r"pip install 'weightstream\[azure\]' \(no_such_module is not installed\)"):
        _extra("azure", "no_such_module", "runai_model_streamer_azure")


def test_azure_containers_without_an_account_fail_at_start_up(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_STORAGE_ACCOUNT_NAME"):
        monkeypatch.delenv(name, raising=False)
    settings = ServerSettings(azure_containers=("weights",), grpc_port=0, http_port=0)
    with pytest.raises(ValueError, match="az:// models need a storage account"):
        object_sources(settings)


def test_buckets_of_every_store_count_as_something_to_serve() -> None:
    assert ServerSettings(gcs_buckets=("b1",)).object_buckets == ("gs://b1",)
    assert ServerSettings(azure_containers=("c1",), s3_buckets=("s1",)).object_buckets == ("s3://s1", "az://c1")
    with pytest.raises(ValueError, match="--gcs-bucket NAME, --azure-container NAME"):
        ServerSettings()


@pytest.mark.parametrize(
    ("status", "code", "error"),
    [
        (403, "AuthenticationFailed", StorageUnauthenticated),
        (403, "AuthorizationPermissionMismatch", AccessDenied),
        (404, "ContainerNotFound", ModelNotFound),
        (503, "ServerBusy", StorageUnavailable),
    ],
)
def test_azure_errors_map_to_the_servers(status: int, code: str, error: type[Exception]) -> None:
    """Azure's answers (built here as the SDK raises them: Azurite gives only some of them) map like S3's."""
    kind = {403: ClientAuthenticationError, 404: ResourceNotFoundError}.get(status, HttpResponseError)
    raised = kind(message=f"{code}: refused")
    raised.status_code = status
    raised.error_code = code
    with pytest.raises(error, match=r"az://weights/llama/model\.safetensors"):
        with azure_translated("weights", "llama/model.safetensors"):
            raise raised
