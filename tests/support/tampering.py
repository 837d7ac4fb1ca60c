"""A hostile server for the client's tests: a gRPC proxy that rewrites what StreamTensors answers.

TamperingProxy listens on 127.0.0.1 (port 0) and relays every call of WeightStreamService to a real
server, as raw bytes, both ways, with the caller's metadata. The messages of StreamTensors' answer
are decoded and handed to tamper(response) first, which returns the messages to send instead (it
may repeat a chunk, add one, or change one). Only the gRPC data path goes through it: a client
used with it must use transport="grpc" (a data port or a shared segment would bypass it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc

from tests.support.ports import LOOPBACK
from weightstream.v1 import weightstream_pb2 as pb

SERVICE = "weightstream.v1.WeightStreamService"
STREAM_TENSORS = f"/{SERVICE}/StreamTensors"

Tamper = Callable[[pb.StreamTensorsResponse], Iterable[pb.StreamTensorsResponse]]


def _raw(data: bytes) -> bytes:
    return data


class TamperingProxy:
    """Relays WeightStreamService to 127.0.0.1:upstream_port; StreamTensors' answers pass through tamper."""

    def __init__(self, upstream_port: int, tamper: Tamper) -> None:
        self._tamper = tamper
        self._channel = grpc.insecure_channel(f"{LOOPBACK}:{upstream_port}")
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tampering-proxy"))
        self._server.add_generic_rpc_handlers((_Relay(self),))
        self.port = self._server.add_insecure_port(f"{LOOPBACK}:0")
        self.target = f"{LOOPBACK}:{self.port}"
        self.tampered = 0  # StreamTensors answers tamper returned something else for

    def __enter__(self) -> TamperingProxy:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None).wait(10)
        self._channel.close()

    def stream_tensors(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        call = self._channel.unary_stream(STREAM_TENSORS, request_serializer=_raw, response_deserializer=_raw)
        answers = call(request, metadata=context.invocation_metadata())
        context.add_callback(answers.cancel)
        for data in answers:
            response = pb.StreamTensorsResponse.FromString(data)
            out = list(self._tamper(response))
            if out != [response]:
                self.tampered += 1
            for message in out:
                yield message.SerializeToString()

    def relay(self, method: str, streaming: tuple[bool, bool]) -> grpc.RpcMethodHandler:
        """A handler that forwards method's raw messages upstream and its answers back."""
        client_streaming, server_streaming = streaming
        options: dict[str, Any] = {"request_serializer": _raw, "response_deserializer": _raw}

        def forward(request: Any, context: grpc.ServicerContext) -> Any:
            metadata = context.invocation_metadata()
            try:
                if client_streaming and server_streaming:
                    return iter(self._channel.stream_stream(method, **options)(request, metadata=metadata))
                if client_streaming:
                    return self._channel.stream_unary(method, **options)(request, metadata=metadata)
                if server_streaming:
                    return iter(self._channel.unary_stream(method, **options)(request, metadata=metadata))
                return self._channel.unary_unary(method, **options)(request, metadata=metadata)
            except grpc.RpcError as exc:
                context.abort(exc.code(), exc.details() or "")  # type: ignore[attr-defined]

        handlers = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }
        return handlers[streaming](forward)  # type: ignore[no-any-return]


class _Relay(grpc.GenericRpcHandler):
    def __init__(self, proxy: TamperingProxy) -> None:
        self._proxy = proxy
        service = pb.DESCRIPTOR.services_by_name["WeightStreamService"]
        self._streaming = {f"/{SERVICE}/{m.name}": (m.client_streaming, m.server_streaming) for m in service.methods}

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        method: str = handler_call_details.method  # type: ignore[attr-defined]
        if method == STREAM_TENSORS:
            return grpc.unary_stream_rpc_method_handler(self._proxy.stream_tensors)
        streaming = self._streaming.get(method)
        return self._proxy.relay(method, streaming) if streaming is not None else None
