"""Model ids: a relative name under a model root, or s3://bucket/prefix; each checked before it is used."""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightstream_server.errors import InvalidModelId

MAX_MODEL_ID_CHARS = 512
# One or more path components of letters, digits, ".", "_" and "-", none starting with a dot:
# this rules out "..", hidden folders, absolute paths and backslashes in one place.
_MODEL_ID = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")
S3_SCHEME = "s3://"
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
MAX_PREFIX_CHARS = 1024


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


@dataclass(frozen=True)
class S3Location:
    bucket: str
    prefix: str  # "" or ending in "/"


def parse_s3_model_id(model: str) -> S3Location:
    """Bucket and folder prefix of an `s3://bucket/prefix` model id."""
    if not model.startswith(S3_SCHEME):
        raise InvalidModelId(f"model {model[:200]!r} is not an s3:// id")
    bucket, _, prefix = model[len(S3_SCHEME) :].partition("/")
    if not _BUCKET.fullmatch(bucket):
        raise InvalidModelId(f"model {model[:200]!r}: {bucket[:80]!r} is not a valid bucket name")
    if len(prefix) > MAX_PREFIX_CHARS or any(ord(c) < 0x20 for c in prefix):
        raise InvalidModelId(f"model {model[:200]!r}: invalid key prefix")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return S3Location(bucket, prefix)
