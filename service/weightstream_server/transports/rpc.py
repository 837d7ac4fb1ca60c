"""Where the server meets gRPC's machinery: raw request bytes parsed, handlers registered, errors sent.

abort is the one place an exception becomes a gRPC status on the wire (errors.status_code chooses
the code). Handlers are registered by the servicer methods' own names, checked against the service
as the generated code describes it, and parse their request bytes themselves: gRPC's own
deserializer would end a request of bad bytes with INTERNAL, not INVALID_ARGUMENT.

Worker threads: gRPC runs each call on a thread of the server's pool for as long as its handler
runs, which for a streaming call is as long as its client likes. WeightStreamService's streaming
calls are admitted by their StreamSession (serving/stream_session.py, --max-streams); HeldCallLimit bounds
every other call that holds a thread while it waits for its client (reflection), so that the
workers kept for short calls stay free.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeAlias, TypeVar

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import (
    InvalidRequest,
    RequestTimeout,
    ServerError,
    ShmUnavailable,
    StorageUnavailable,
    TcpUnavailable,
    TooManyStreams,
    status_code,
)
from weightstream_server.ops.stats import ServerStats

logger = logging.getLogger(__name__)

SERVICE: ServiceDescriptor = pb.DESCRIPTOR.services_by_name["WeightStreamService"]

# A method name and its handler; the handler type is generic in the type stubs only.
Handler: TypeAlias = "tuple[str, grpc.RpcMethodHandler[Any, Any]]"
T = TypeVar("T")
# Trailing metadata that tells a client's gRPC not to retry the call by itself (gRFC A6 pushback).
NO_RETRY = ("grpc-retry-pushback-ms", "-1")


def abort(context: grpc.ServicerContext, stats: ServerStats, method: str, model: str, exc: Exception) -> NoReturn:
    """End the RPC with exc's status code and message (internal errors: logged whole, sent as their type only)."""
    code = status_code(exc)
    # A tcp stream refused for want of a data port is a client's probe (it falls back), not an error.
    if not isinstance(exc, TcpUnavailable):
        stats.error(code.name)
    if isinstance(exc, ServerError):
        # A client that falls back from shared memory or the data port to gRPC is no warning.
        level = logging.INFO if isinstance(exc, ShmUnavailable | TcpUnavailable) else logging.WARNING
        # model is as the client sent it: a log line holds its first 200 characters only.
        logger.log(level, "%s %r: %s: %s", method, model[:200], code.name, exc)
        if isinstance(exc, StorageUnavailable):
            # The store's own client retried already: gRPC's retries (replicas.py) would repeat that
            # and run past the call's deadline. The caller's RetryPolicy decides on another try.
            context.set_trailing_metadata((NO_RETRY,))
        context.abort(code, str(exc))
    logger.error("%s %r: internal error", method, model, exc_info=exc)
    context.abort(code, f"internal error while serving model {model!r}: {type(exc).__name__}")


def handler(method: Callable[..., Any], *, serialized: bool = False) -> Handler:
    """The handler of the RPC named like method (a servicer's bound method), with its request parsed here.

    serialized: method yields its responses as bytes already, and no serializer runs on them.
    """
    name = method.__name__
    descriptor = SERVICE.methods_by_name.get(name)
    if descriptor is None:
        raise ValueError(f"{name} is not a method of {SERVICE.full_name}")
    request_type = message_factory.GetMessageClass(descriptor.input_type)
    response_type = message_factory.GetMessageClass(descriptor.output_type)
    serializer = None if serialized else response_type.SerializeToString
    if descriptor.client_streaming:
        if not descriptor.server_streaming:
            raise ValueError(f"{name}: client-streaming RPCs with one response are not served")
        return name, grpc.stream_stream_rpc_method_handler(
            parsing_stream(request_type, method), request_deserializer=None, response_serializer=serializer
        )
    make = grpc.unary_stream_rpc_method_handler if descriptor.server_streaming else grpc.unary_unary_rpc_method_handler
    return name, make(parsing(request_type, method), request_deserializer=None, response_serializer=serializer)


def register(server: grpc.Server, *handlers: Handler) -> None:
    """Add handlers for methods of the service; several such groups may be added to one server."""
    generic = grpc.method_handlers_generic_handler(SERVICE.full_name, dict(handlers))
    server.add_generic_rpc_handlers((generic,))


def parsing(
    message_type: type[Message], method: Callable[[Any, grpc.ServicerContext], Any]
) -> Callable[[bytes, grpc.ServicerContext], Any]:
    """method on the request's raw bytes, parsed here; bad bytes end the call INVALID_ARGUMENT."""

    def handle(raw: bytes, context: grpc.ServicerContext) -> Any:
        try:
            request = message_type.FromString(raw)
        except DecodeError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, _not_valid(message_type, exc))
        return method(request, context)

    return handle


def parsing_stream(
    message_type: type[Message], method: Callable[[Iterator[Any], grpc.ServicerContext], Any]
) -> Callable[[Iterator[bytes], grpc.ServicerContext], Any]:
    """parsing for a client stream: each message is parsed as it is read; a bad one raises InvalidRequest."""

    def messages(raw: Iterator[bytes]) -> Iterator[Any]:
        for item in raw:
            try:
                yield message_type.FromString(item)
            except DecodeError as exc:
                raise InvalidRequest(_not_valid(message_type, exc)) from None

    return lambda raw, context: method(messages(raw), context)


def _not_valid(message_type: type[Message], exc: DecodeError) -> str:
    return f"request is not a valid {message_type.DESCRIPTOR.full_name}: {exc}"


def first_message(messages: Iterator[T], timeout: float, what: str) -> T | None:
    """The first of a client stream's messages (None when it ended without one); RequestTimeout
    when none came within timeout seconds.

    The message is awaited on a thread of its own, so that a silent client cannot hold the
    caller's worker beyond timeout; that thread ends when the call does. Once this has returned,
    the caller may read the rest of messages, from one thread at a time.
    """
    arrived: queue.SimpleQueue[tuple[T | None, BaseException | None]] = queue.SimpleQueue()

    def read() -> None:
        try:
            arrived.put((next(messages, None), None))
        except BaseException as exc:  # handed over to the caller, who raises it
            arrived.put((None, exc))

    threading.Thread(target=read, name="weightstream-first-message", daemon=True).start()
    try:
        message, error = arrived.get(timeout=timeout)
    except queue.Empty:
        raise RequestTimeout(f"the first {what} did not arrive within {timeout:g} s") from None
    if error is not None:
        raise error
    return message


class HeldCallLimit(grpc.ServerInterceptor):
    """Bounds the calls, other than WeightStreamService's, that hold a worker thread while open.

    Those are the client- or server-streaming handlers (reflection's ServerReflectionInfo waits on
    its client for as long as the client likes); handlers that gRPC runs without holding a worker
    (experimental_non_blocking, as health Watch is) are left alone, and WeightStreamService's
    streams are admitted by their StreamSession. Beyond size such calls at once, one more ends
    RESOURCE_EXHAUSTED before it runs. A place is given back when its call ends, however it ends.
    """

    def __init__(self, size: int, stats: ServerStats) -> None:
        self._size = size
        self._stats = stats
        self._places = threading.BoundedSemaphore(size)

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        method: str = handler_call_details.method
        if handler is None or not (handler.request_streaming or handler.response_streaming):
            return handler
        if method.startswith(f"/{SERVICE.full_name}/"):
            return handler
        behavior = handler.stream_stream or handler.unary_stream or handler.stream_unary
        if getattr(behavior, "experimental_non_blocking", False):
            return handler
        return self._limited(handler, method)

    def _admit(self, context: grpc.ServicerContext, method: str) -> None:
        if not self._places.acquire(blocking=False):
            error = TooManyStreams(f"{method}: {self._size} such calls are already open; try again later")
            abort(context, self._stats, method, "", error)
        if not context.add_callback(self._places.release):
            self._places.release()  # the call has ended already

    def _limited(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        """handler, admitted first."""
        serializers = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        inner: Callable[[Any, grpc.ServicerContext], Any]
        if handler.stream_stream is not None:
            inner, make = handler.stream_stream, grpc.stream_stream_rpc_method_handler
        elif handler.unary_stream is not None:
            inner, make = handler.unary_stream, grpc.unary_stream_rpc_method_handler
        elif handler.stream_unary is not None:
            inner, make = handler.stream_unary, grpc.stream_unary_rpc_method_handler
        else:
            return handler

        def admitted(request: Any, context: grpc.ServicerContext) -> Any:
            self._admit(context, method)
            return inner(request, context)

        return make(admitted, **serializers)
