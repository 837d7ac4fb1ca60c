"""The client's exceptions; gRPC errors become these in one place, from_rpc_error.

    WeightStreamError                   base; .code is the gRPC status (None for client-side checks)
    ├── NotFoundError                   NOT_FOUND: no such model, tensor or file
    ├── PermissionDeniedError           PERMISSION_DENIED: the id or a file is outside what the server may read or serve
    ├── UnauthenticatedError            UNAUTHENTICATED: missing or wrong token
    ├── InvalidArgumentError            INVALID_ARGUMENT, OUT_OF_RANGE: a bad model id or request
    ├── FailedPreconditionError         FAILED_PRECONDITION: unsupported checkpoint, changed revision, oversized file
    ├── ResourceExhaustedError          RESOURCE_EXHAUSTED: the server's stream limit is reached
    ├── UnavailableError                UNAVAILABLE, DEADLINE_EXCEEDED: worth retrying
    ├── IntegrityError                  DATA_LOSS, or a chunk whose checksum, size or place is wrong
    └── IncompatibleModuleError         the checkpoint does not fit the module (names, shapes, dtypes)

Every error raised by a load says whether the target was partly written: .partially_written is
False when no byte reached the module, True when some did, None where it does not apply.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import grpc


class WeightStreamError(Exception):
    """Base of every error the client raises."""

    code: grpc.StatusCode | None = None

    def __init__(
        self, message: str, *, code: grpc.StatusCode | None = None, partially_written: bool | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        self.partially_written = partially_written

    def with_write_state(self, partially_written: bool, detail: str) -> WeightStreamError:
        """A copy of this error, of the same class, that says whether the target was written."""
        return type(self)(f"{self.message}; {detail}", code=self.code, partially_written=partially_written)


class NotFoundError(WeightStreamError):
    code = grpc.StatusCode.NOT_FOUND


class PermissionDeniedError(WeightStreamError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(WeightStreamError):
    code = grpc.StatusCode.UNAUTHENTICATED


class InvalidArgumentError(WeightStreamError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class FailedPreconditionError(WeightStreamError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhaustedError(WeightStreamError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class UnavailableError(WeightStreamError):
    code = grpc.StatusCode.UNAVAILABLE


class AbortedError(WeightStreamError):
    """Another call got there first: for example another revision of the model is being published."""


class IntegrityError(WeightStreamError):
    code = grpc.StatusCode.DATA_LOSS


class IncompatibleModuleError(WeightStreamError):
    pass


_BY_CODE: dict[grpc.StatusCode, type[WeightStreamError]] = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: UnavailableError,
    grpc.StatusCode.DATA_LOSS: IntegrityError,
    grpc.StatusCode.ABORTED: AbortedError,
}


def from_rpc_error(error: grpc.RpcError, target: str) -> WeightStreamError:
    """The client exception for a failed RPC to target, keeping the server's message and code."""
    code = error.code() if isinstance(error, grpc.Call) else grpc.StatusCode.UNKNOWN
    details = (error.details() if isinstance(error, grpc.Call) else None) or str(error)
    cls = _BY_CODE.get(code, WeightStreamError)
    return cls(f"{code.name} from {target}: {details}", code=code)


@contextlib.contextmanager
def translated(target: str) -> Iterator[None]:
    """Turn gRPC errors raised inside into the client's exceptions (the one boundary that does)."""
    try:
        yield
    except grpc.RpcError as exc:
        raise from_rpc_error(exc, target) from exc
