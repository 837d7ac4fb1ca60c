"""The server's domain errors, and the one function that chooses their gRPC status codes.

ServerError
├── InvalidModelId        INVALID_ARGUMENT   the model id is malformed (absolute, "..", NUL)
├── InvalidRequest        INVALID_ARGUMENT   a request field is out of bounds or contradictory
├── RangeOutOfBounds      OUT_OF_RANGE       a requested byte range lies outside its tensor
├── ModelNotFound         NOT_FOUND          no such model, or it holds no safetensors file
├── TensorNotFound        NOT_FOUND          the model has no tensor of that name
├── FileNotFound          NOT_FOUND          an allowed companion file the model does not have
├── AccessDenied          PERMISSION_DENIED  the id or a file resolves outside the model root (whenever
│                                            it is opened), the server may not read it, or a file name
│                                            is neither weights nor an allowed companion
├── CorruptCheckpoint     DATA_LOSS          a bad header or index, a truncated file, a short read, a
│                                            FIFO or folder where a checkpoint file should be
├── UnsupportedCheckpoint FAILED_PRECONDITION a dtype torch cannot hold, and the like
├── RevisionMismatch      FAILED_PRECONDITION the checkpoint changed since the client's manifest
├── CheckpointChanged     FAILED_PRECONDITION a file changed on disk (another file, rewritten, gone)
│                                            between its listing and the end of its reads
├── FileTooLarge          FAILED_PRECONDITION a companion file is larger than the server serves
├── ShmUnavailable FAILED_PRECONDITION no --shm-dir, or not the client's directory
├── TcpUnavailable       FAILED_PRECONDITION no data port (--data-port 0): use StreamTensors
├── DataConnectionLost    UNAVAILABLE        a tcp stream's data connection broke or stopped reading
├── TooManyStreams        RESOURCE_EXHAUSTED the concurrent stream limit is reached
├── RequestTimeout        DEADLINE_EXCEEDED  the client did not send what the call waits for in time
├── StorageUnauthenticated UNAUTHENTICATED   storage rejected the server's credentials
├── StorageUnavailable    UNAVAILABLE        storage failed in a way worth retrying
├── Draining              UNAVAILABLE        the server is shutting down and takes no new streams
├── SourceStalled         UNAVAILABLE        a block a peer asked for did not reach this server in time
│                                            (its own source stalled; the peer may ask another)
├── Unauthenticated       UNAUTHENTICATED    the call carries no valid bearer token
└── UpstreamError         the upstream's     the server this one reads from (--upstream) refused or
                          own code           failed a call; the message names that tier first

ClientGone (not a ServerError): the client cancelled or went away while its stream waited for it;
the stream ends CANCELLED and nothing is sent.
"""

from __future__ import annotations

import grpc


class ServerError(Exception):
    """Base of the errors a request can end with; the message is sent to the client as is."""


class InvalidModelId(ServerError):
    pass


class InvalidRequest(ServerError):
    pass


class RangeOutOfBounds(ServerError):
    pass


class ModelNotFound(ServerError):
    pass


class TensorNotFound(ServerError):
    pass


class FileNotFound(ServerError):
    pass


class AccessDenied(ServerError):
    pass


class CorruptCheckpoint(ServerError):
    pass


class UnsupportedCheckpoint(ServerError):
    pass


class RevisionMismatch(ServerError):
    pass


class CheckpointChanged(ServerError):
    pass


class FileTooLarge(ServerError):
    pass


class ShmUnavailable(ServerError):
    pass


class TcpUnavailable(ServerError):
    """The server has no data port (--data-port 0)."""


class DataConnectionLost(ServerError):
    """A tcp stream's data connection broke, or its client stopped reading it."""


class TooManyStreams(ServerError):
    pass


class RequestTimeout(ServerError):
    pass


class StorageUnauthenticated(ServerError):
    pass


class StorageUnavailable(ServerError):
    pass


class Draining(ServerError):
    pass


class SourceStalled(ServerError):
    pass


class Unauthenticated(ServerError):
    pass


class RevisionNotKept(ServerError):
    """A named revision this server does not have (never, or no longer: evicted)."""


class PublishRefused(ServerError):
    """A publish this server does not take: publishing is off, or the caller's token is not a publisher's."""


class PublishConflict(ServerError):
    """Another revision of the model is being published, or this one's parts disagree."""


class PublishTooLarge(ServerError):
    """A publish that would hold more than the server's budget for published revisions."""


class UpstreamError(ServerError):
    """A call to the upstream server failed; it ends the client's call with the upstream's own code."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class ClientGone(Exception):
    """The client cancelled or went away while its stream waited for it (a free slot, an attach)."""


_CODES: dict[type[ServerError], grpc.StatusCode] = {
    InvalidModelId: grpc.StatusCode.INVALID_ARGUMENT,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    RangeOutOfBounds: grpc.StatusCode.OUT_OF_RANGE,
    ModelNotFound: grpc.StatusCode.NOT_FOUND,
    TensorNotFound: grpc.StatusCode.NOT_FOUND,
    FileNotFound: grpc.StatusCode.NOT_FOUND,
    AccessDenied: grpc.StatusCode.PERMISSION_DENIED,
    CorruptCheckpoint: grpc.StatusCode.DATA_LOSS,
    UnsupportedCheckpoint: grpc.StatusCode.FAILED_PRECONDITION,
    RevisionMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    CheckpointChanged: grpc.StatusCode.FAILED_PRECONDITION,
    FileTooLarge: grpc.StatusCode.FAILED_PRECONDITION,
    ShmUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    TcpUnavailable: grpc.StatusCode.FAILED_PRECONDITION,
    DataConnectionLost: grpc.StatusCode.UNAVAILABLE,
    TooManyStreams: grpc.StatusCode.RESOURCE_EXHAUSTED,
    RequestTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
    StorageUnauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    StorageUnavailable: grpc.StatusCode.UNAVAILABLE,
    Draining: grpc.StatusCode.UNAVAILABLE,
    SourceStalled: grpc.StatusCode.UNAVAILABLE,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    RevisionNotKept: grpc.StatusCode.NOT_FOUND,
    PublishRefused: grpc.StatusCode.PERMISSION_DENIED,
    PublishConflict: grpc.StatusCode.ABORTED,
    PublishTooLarge: grpc.StatusCode.RESOURCE_EXHAUSTED,
}


def status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status code a request that failed with error ends with."""
    if isinstance(error, UpstreamError):
        return error.code
    for cls in type(error).__mro__:
        code = _CODES.get(cls)
        if code is not None:
            return code
    return grpc.StatusCode.INTERNAL
