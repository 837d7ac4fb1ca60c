"""The weightstream client: load a model's weights from a weightstream server into torch.

Example::

    from weightstream.client import WeightStreamClient

    with WeightStreamClient("127.0.0.1:50051") as client:
        report = client.load_into(model, "tiny-llama")
        client.fetch("tiny-llama", "/models/tiny-llama")  # weights, config and tokenizer files
"""

from __future__ import annotations

from weightstream.client.errors import (
    AbortedError,
    FailedPreconditionError,
    IncompatibleModuleError,
    IntegrityError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    UnauthenticatedError,
    UnavailableError,
    WeightStreamError,
)
from weightstream.client.facade import LoadReport, PublishReport, WeightStreamClient
from weightstream.client.fetch import FetchReport
from weightstream.client.manifest import Manifest, ModelFile, ModelFileList, TensorInfo
from weightstream.client.retry import RetryPolicy
from weightstream.client.revisions import Changes, RevisionEvent

__all__ = [
    "AbortedError",
    "Changes",
    "FailedPreconditionError",
    "FetchReport",
    "IncompatibleModuleError",
    "IntegrityError",
    "InvalidArgumentError",
    "LoadReport",
    "Manifest",
    "ModelFile",
    "ModelFileList",
    "NotFoundError",
    "PermissionDeniedError",
    "PublishReport",
    "ResourceExhaustedError",
    "RetryPolicy",
    "RevisionEvent",
    "TensorInfo",
    "UnauthenticatedError",
    "UnavailableError",
    "WeightStreamClient",
    "WeightStreamError",
]
