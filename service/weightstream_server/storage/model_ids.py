"""Model ids: a relative name under a model root, or an object store's URL; each checked before it is used.

Object stores: `s3://bucket/prefix` (S3 and S3-compatible stores), `gs://bucket/prefix` (Google
Cloud Storage) and `az://container/prefix` (Azure Blob, the scheme Run:ai's Azure backend reads).
`abfs://container/prefix` (fsspec's spelling) is the same id as `az://container/prefix`; ABFS's
`abfs://container@account.../` form names an account, which the server takes from its settings
instead, so it is refused with a message that says so.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightstream_server.errors import InvalidModelId, InvalidRequest

MAX_MODEL_ID_CHARS = 512
# One or more path components of letters, digits, ".", "_" and "-", none starting with a dot:
# this rules out "..", hidden folders, absolute paths and backslashes in one place.
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
S3_SCHEME = "s3://"
GCS_SCHEME = "gs://"
AZURE_SCHEME = "az://"
AZURE_ALIAS = "abfs://"
OBJECT_SCHEMES = (S3_SCHEME, GCS_SCHEME, AZURE_SCHEME)
# Each store's own rules for a bucket's (container's) name.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_NAMES = {
    S3_SCHEME: (_BUCKET, "bucket"),
    GCS_SCHEME: (re.compile(r"[a-z0-9][a-z0-9._-]{1,61}[a-z0-9]"), "bucket"),
    AZURE_SCHEME: (re.compile(r"[a-z0-9](?!.*--)[a-z0-9-]{1,61}[a-z0-9]"), "container"),
}
MAX_PREFIX_CHARS = 1024
# What a revision may be named, wherever the name comes from (a publisher, an upstream, a peer): it
# becomes a folder name under --publish-dir and a label in the metrics.
_REVISION_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_model_id(model: str) -> None:
    """Raise InvalidModelId unless model is a relative path of plain names."""
    if not model:
        raise InvalidModelId("model id is empty")
    if len(model) > MAX_MODEL_ID_CHARS:
        raise InvalidModelId(f"model id is longer than {MAX_MODEL_ID_CHARS} characters")
    if not _MODEL_ID.fullmatch(model):
        raise InvalidModelId(
            f"invalid model id {model[:80]!r}: use a relative name of letters, digits, '.', '_', '-' and '/', "
            "with no '..' and no leading '/'"
        )


def check_revision_name(model: str, revision: str, where: str = "publish") -> None:
    """Raise InvalidRequest unless revision is 1 to 128 letters, digits, '.', '_' and '-', starting with a
    letter or digit (where: what named it, for the message)."""
    if not _REVISION_NAME.fullmatch(revision):
        raise InvalidRequest(
            f"{where} of model {model[:200]!r}: revision name {revision[:200]!r} is not 1 to 128 letters, "
            "digits, '.', '_' and '-', starting with a letter or digit"
        )


@dataclass(frozen=True)
class ObjectLocation:
    """Where an object store's model lies: its scheme (OBJECT_SCHEMES), bucket or container, and folder."""

    scheme: str
    bucket: str
    prefix: str  # "" or ending in "/"

    def url(self, name: str = "") -> str:
        """The URL of the object name in this folder (the folder's own with no name)."""
        return f"{self.scheme}{self.bucket}/{self.prefix}{name}"


def canonical_model_id(model: str) -> str:
    """model, with an alternative spelling of an object store's scheme replaced by the one the server uses."""
    if model.startswith(AZURE_ALIAS):
        container = model[len(AZURE_ALIAS) :].partition("/")[0]
        if "@" in container:
            raise InvalidModelId(
                f"model {model[:200]!r}: name the container as az://CONTAINER/PREFIX; the storage account "
                "comes from the server's settings (AZURE_STORAGE_ACCOUNT_NAME or AZURE_STORAGE_CONNECTION_STRING)"
            )
        return AZURE_SCHEME + model[len(AZURE_ALIAS) :]
    return model


def object_scheme(model: str) -> str | None:
    """The object-store scheme model starts with (after canonical_model_id), or None."""
    return next((scheme for scheme in OBJECT_SCHEMES if model.startswith(scheme)), None)


def parse_object_model_id(model: str) -> ObjectLocation:
    """Scheme, bucket (container) and folder prefix of an `s3://`, `gs://` or `az://` model id."""
    model = canonical_model_id(model)
    scheme = object_scheme(model)
    if scheme is None:
        raise InvalidModelId(f"model {model[:200]!r} is not an s3://, gs:// or az:// id")
    bucket, _, prefix = model[len(scheme) :].partition("/")
    pattern, noun = _NAMES[scheme]
    if not pattern.fullmatch(bucket):
        raise InvalidModelId(f"model {model[:200]!r}: {bucket[:80]!r} is not a valid {noun} name")
    if len(prefix) > MAX_PREFIX_CHARS or any(ord(c) < 0x20 for c in prefix):
        raise InvalidModelId(f"model {model[:200]!r}: invalid key prefix")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return ObjectLocation(scheme, bucket, prefix)


def parse_s3_model_id(model: str) -> ObjectLocation:
    """Bucket and folder prefix of an `s3://bucket/prefix` model id."""
    if not model.startswith(S3_SCHEME):
        raise InvalidModelId(f"model {model[:200]!r} is not an s3:// id")
    return parse_object_model_id(model)
