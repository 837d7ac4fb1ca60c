"""The weightstream client: load a model's weights from a weightstream server into torch.

Example::

    from weightstream.client import WeightStreamClient

    with WeightStreamClient("127.0.0.1:50051") as client:
        report = client.load_into(model, "tiny-llama")
"""

from __future__ import annotations

from weightstream.client.client import LoadReport, WeightStreamClient
from weightstream.client.errors import (
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
from weightstream.client.manifest import Manifest, TensorInfo

__all__ = [
    "FailedPreconditionError",
    "IncompatibleModuleError",
    "IntegrityError",
    "InvalidArgumentError",
    "LoadReport",
    "Manifest",
    "NotFoundError",
    "PermissionDeniedError",
    "ResourceExhaustedError",
    "TensorInfo",
    "UnauthenticatedError",
    "UnavailableError",
    "WeightStreamClient",
    "WeightStreamError",
]
