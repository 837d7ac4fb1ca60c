"""Hostile servers for the tests: a gRPC proxy in front of a real server that rewrites what passes.

RewritingProxy listens on 127.0.0.1 (port 0) and relays every call of WeightStreamService to a real
server, with the caller's metadata, decoding each message both ways: ask(method, request) gives the
request to send on, answer(method, response) the responses to send back instead of one (it may
repeat, add, drop or change them). Only the gRPC calls go through it: bytes on a data port or a
shared segment bypass it (a client used with it on the data path must use transport="grpc").

- TamperingProxy: StreamTensors' answers pass through tamper (a server that sends a range twice).
- LyingUpstream: names are renamed (a revision called "step-1" upstream is reported as
  "../../escape", a model as another), and back in what is asked, so that follow-up calls about the
  lie reach the real revision and succeed (a lying upstream in front of a sidecar).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import Message

from tests.support.ports import LOOPBACK
from weightstream.v1 import weightstream_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["WeightStreamService"]
# The string fields LyingUpstream renames, wherever they are nested.
NAME_FIELDS = ("revision", "since", "model")

Tamper = Callable[[pb.StreamTensorsResponse], Iterable[pb.StreamTensorsResponse]]


class RewritingProxy:
    """Relays WeightStreamService to 127.0.0.1:upstream_port through ask and answer (by method name)."""

    def __init__(self, upstream_port: int) -> None:
        self._channel = grpc.insecure_channel(f"{LOOPBACK}:{upstream_port}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="proxy"))
        handlers = {method.name: self._handler(method) for method in SERVICE.methods}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = self._server.add_insecure_port(f"{LOOPBACK}:0")
        self.target = f"{LOOPBACK}:{self.port}"

    def ask(self, method: str, request: Message) -> Message:
        return request

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        return (response,)

    def __enter__(self) -> Any:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait(10)
        self._channel.close()

    def _handler(self, method: Any) -> grpc.RpcMethodHandler:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        name, path = method.name, f"/{SERVICE.full_name}/{method.name}"
        options: dict[str, Any] = {
            "request_serializer": lambda m: self.ask(name, m).SerializeToString(),
            "response_deserializer": response_class.FromString,
        }
        streaming = (method.client_streaming, method.server_streaming)

        def answered(responses: Iterable[Message], context: grpc.ServicerContext) -> Iterator[Message]:
            try:
                for response in responses:
                    yield from self.answer(name, response)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]

        def forward(request: Any, context: grpc.ServicerContext) -> Any:
            metadata = context.invocation_metadata()
            try:
                if streaming[1]:
                    call = (self._channel.stream_stream if streaming[0] else self._channel.unary_stream)(
                        path, **options
                    )(request, metadata=metadata)
                    context.add_callback(call.cancel)
                    return answered(call, context)
                call_unary = self._channel.stream_unary if streaming[0] else self._channel.unary_unary
                (only,) = self.answer(name, call_unary(path, **options)(request, metadata=metadata))
                return only
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[streaming]
        return make(  # type: ignore[no-any-return]
            forward, request_deserializer=request_class.FromString, response_serializer=lambda m: m.SerializeToString()
        )


class TamperingProxy(RewritingProxy):
    """StreamTensors' answers pass through tamper, which returns the messages to send instead."""

    def __init__(self, upstream_port: int, tamper: Tamper) -> None:
        super().__init__(upstream_port)
        self._tamper = tamper
        self.tampered = 0  # StreamTensors answers tamper returned something else for

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        if method != "StreamTensors":
            return (response,)
        assert isinstance(response, pb.StreamTensorsResponse)
        out = list(self._tamper(response))
        if out != [response]:
            self.tampered += 1
        return out


class LyingUpstream(RewritingProxy):
    """Every NAME_FIELDS value that is a key of renames is reported as its value, and asked back as the key."""

    def __init__(self, upstream_port: int, renames: dict[str, str]) -> None:
        super().__init__(upstream_port)
        self.renames = renames
        self._back = {lie: truth for truth, lie in renames.items()}

    def ask(self, method: str, request: Message) -> Message:
        return _renamed(request, self._back)

    def answer(self, method: str, response: Message) -> Iterable[Message]:
        return (_renamed(response, self.renames),)


def _renamed(message: Message, renames: dict[str, str]) -> Message:
    """message with every string field in NAME_FIELDS (nested ones too) renamed by renames."""
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None:
            for item in [value] if isinstance(value, Message) else value:
                if isinstance(item, Message):
                    _renamed(item, renames)
        elif descriptor.name in NAME_FIELDS and isinstance(value, str) and value in renames:
            setattr(message, descriptor.name, renames[value])
    return message
