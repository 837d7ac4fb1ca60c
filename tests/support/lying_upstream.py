"""A lying upstream for a sidecar's tests: a gRPC proxy in front of a real server that renames what it reports.

LyingUpstream listens on 127.0.0.1 (port 0) and relays every call of WeightStreamService to a real
server, decoding each message both ways. In what it answers, every string field named in
`answers` whose value is a key of `renames` is replaced by the value (a revision called "step-1"
upstream is reported as "../../escape", a model as another model); in what it is asked, the
reverse, so that the sidecar's follow-up calls about the lie reach the real revision and succeed.
Only the gRPC calls go through it; bytes a sidecar reads from the upstream's data port do not.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf.message import Message

from tests.support.ports import LOOPBACK
from weightstream.v1 import weightstream_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["WeightStreamService"]
FIELDS = ("revision", "since", "model")


def _rewrite(message: Message, renames: dict[str, str]) -> Message:
    """message with every string field in FIELDS (nested ones too) renamed by renames."""
    for descriptor, value in message.ListFields():
        if descriptor.message_type is not None:
            items = [value] if isinstance(value, Message) else value
            for item in items:
                if isinstance(item, Message):
                    _rewrite(item, renames)
        elif descriptor.name in FIELDS and isinstance(value, str) and value in renames:
            setattr(message, descriptor.name, renames[value])
    return message


class LyingUpstream:
    """Relays WeightStreamService to 127.0.0.1:upstream_port, renaming what it reports by renames."""

    def __init__(self, upstream_port: int, renames: dict[str, str]) -> None:
        self.renames = renames
        self._channel = grpc.insecure_channel(f"{LOOPBACK}:{upstream_port}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="lying-upstream"))
        handlers = {method.name: self._handler(method) for method in SERVICE.methods}
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),))
        self.port = self._server.add_insecure_port(f"{LOOPBACK}:0")
        self.target = f"{LOOPBACK}:{self.port}"

    def __enter__(self) -> LyingUpstream:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait(10)
        self._channel.close()

    def _handler(self, method: Any) -> grpc.RpcMethodHandler:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        back = {lie: truth for truth, lie in self.renames.items()}
        path = f"/{SERVICE.full_name}/{method.name}"
        options: dict[str, Any] = {
            "request_serializer": lambda m: _rewrite(m, back).SerializeToString(),
            "response_deserializer": lambda data: _rewrite(response_class.FromString(data), self.renames),
        }
        streaming = (method.client_streaming, method.server_streaming)

        def forward(request: Any, context: grpc.ServicerContext) -> Any:
            metadata = context.invocation_metadata()
            try:
                if streaming == (True, True):
                    return _relayed(self._channel.stream_stream(path, **options)(request, metadata=metadata), context)
                if streaming == (True, False):
                    return self._channel.stream_unary(path, **options)(request, metadata=metadata)
                if streaming == (False, True):
                    return _relayed(self._channel.unary_stream(path, **options)(request, metadata=metadata), context)
                return self._channel.unary_unary(path, **options)(request, metadata=metadata)
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


def _relayed(answers: Any, context: grpc.ServicerContext) -> Iterator[Any]:
    context.add_callback(answers.cancel)
    try:
        yield from answers
    except grpc.RpcError as exc:
        context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]
