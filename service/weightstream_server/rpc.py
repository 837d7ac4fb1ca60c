"""Where the server meets gRPC's machinery: raw request bytes parsed, handlers registered, errors sent.

abort is the one place an exception becomes a gRPC status on the wire (errors.status_code chooses
the code). Handlers are registered by the servicer methods' own names, checked against the service
as the generated code describes it, and parse their request bytes themselves: gRPC's own
deserializer would end a request of bad bytes with INTERNAL, not INVALID_ARGUMENT.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeAlias

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError, Message

from weightstream.v1 import weightstream_pb2 as pb
from weightstream_server.errors import InvalidRequest, ServerError, SharedMemoryUnavailable, status_code
from weightstream_server.stats import ServerStats

logger = logging.getLogger(__name__)

SERVICE: ServiceDescriptor = pb.DESCRIPTOR.services_by_name["WeightStreamService"]

# A method name and its handler; the handler type is generic in the type stubs only.
Handler: TypeAlias = "tuple[str, grpc.RpcMethodHandler[Any, Any]]"


def abort(context: grpc.ServicerContext, stats: ServerStats, method: str, model: str, exc: Exception) -> NoReturn:
    """End the RPC with exc's status code and message (internal errors: logged whole, sent as their type only)."""
    code = status_code(exc)
    stats.error(code.name)
    if isinstance(exc, ServerError):
        # A client that falls back from shared memory to gRPC is no warning.
        level = logging.INFO if isinstance(exc, SharedMemoryUnavailable) else logging.WARNING
        logger.log(level, "%s %r: %s: %s", method, model, code.name, exc)
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
